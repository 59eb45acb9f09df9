"""`mu_space.patcher`: adopt muSPACE in existing model code without editing it.

from mu_space.patcher import Patcher, Patch

from mu_space.patcher import default_patcher   # mmcv / BEVDet / BEVFusion call sites
default_patcher().apply()                       # docs/patcher.md
"""

from mu_space.patcher.core import Patch, Patcher, PatchResult, PatchTargetMissing, resolve
from mu_space.patcher.patches import default_patcher, default_patches

__all__ = [
    "Patch",
    "PatchResult",
    "PatchTargetMissing",
    "Patcher",
    "default_patcher",
    "default_patches",
    "resolve",
]
