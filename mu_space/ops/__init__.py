"""Public operators. Importing this package registers every operator in the registry."""

from mu_space.ops.add_one import add_one  # build smoke, not in the operator matrix

__all__ = ["add_one"]
