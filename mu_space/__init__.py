"""muSPACE: spatial / 3D-perception operators for MUSA and CUDA GPUs.

Operators live in `mu_space.ops`; the public ones (the operator matrix) are re-exported here.
`python -m mu_space` runs the self-check. Backends and dispatch records:
`mu_space.runtime.kernel_dispatch`.
"""

from mu_space import ops, runtime
from mu_space._version import __version__
from mu_space.runtime import registry as _registry
from mu_space.runtime.kernel_dispatch import DispatchError

for _op in _registry.operators(public_only=True):
    globals()[_op.api.__name__] = _op.api

__all__ = ["DispatchError", "__version__", "ops", "runtime"] + sorted(
    op.api.__name__ for op in _registry.operators(public_only=True)
)
