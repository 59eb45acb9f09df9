"""`mu_space.patcher`: adopt muSPACE in existing model code without editing it.

    from mu_space.patcher import Patcher, Patch
"""

from mu_space.patcher.core import Patch, Patcher, PatchResult, PatchTargetMissing, resolve

__all__ = ["Patch", "PatchResult", "PatchTargetMissing", "Patcher", "resolve"]
