"""Compatibility layers that let upstream code run on muSPACE unchanged.

mu_space.compat.mmcv   serves mmcv's compiled extension `mmcv._ext` (docs/compat_mmcv.md)
"""
