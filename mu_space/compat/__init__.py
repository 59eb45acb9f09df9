"""Compatibility layers that let upstream code run on muSPACE unchanged.

mu_space.compat.mmcv   serves mmcv's compiled extension `mmcv._ext` (docs/compat_mmcv.md)
mu_space.compat.bevfusion  serves mmdet3d 1.x projects/BEVFusion's compiled bev_pool_ext and
                           voxel_layer (docs/compat_mmcv.md, "BEVFusion's extensions")
"""
