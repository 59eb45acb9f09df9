"""muSPACE: spatial / 3D-perception operators for MUSA and CUDA GPUs.

Operators live in `mu_space.ops` and are re-exported here; `python -m mu_space` runs the
self-check. Backends and dispatch records: `mu_space.runtime.kernel_dispatch`.
"""

from mu_space import ops, runtime
from mu_space._version import __version__
from mu_space.ops import (
    bev_pool,
    bev_pool_prepare,
    bev_pool_v2,
    bev_pool_v3,
    multi_scale_deformable_attn,
)
from mu_space.runtime.kernel_dispatch import DispatchError

__all__ = [
    "DispatchError",
    "__version__",
    "bev_pool",
    "bev_pool_prepare",
    "bev_pool_v2",
    "bev_pool_v3",
    "multi_scale_deformable_attn",
    "ops",
    "runtime",
]
