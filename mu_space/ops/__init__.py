"""Public operators. Importing this package registers every operator in the registry."""

from mu_space.ops.add_one import add_one  # build smoke, not in the operator matrix
from mu_space.ops.bev_pool import bev_pool
from mu_space.ops.bev_pool_prepare import bev_pool_prepare
from mu_space.ops.bev_pool_v2 import bev_pool_v2
from mu_space.ops.bev_pool_v3 import bev_pool_v3
from mu_space.ops.multi_scale_deformable_attn import multi_scale_deformable_attn

__all__ = [
    "add_one",
    "bev_pool",
    "bev_pool_prepare",
    "bev_pool_v2",
    "bev_pool_v3",
    "multi_scale_deformable_attn",
]
