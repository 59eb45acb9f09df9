"""The import hook that serves `mmcv._ext` from muSPACE. Self-contained (standard library only):
the interpreter-start hook (`mu_space_mmcv_ext.pth`, enabled by MUSPACE_MMCV_EXT=1) loads this
file by path without importing mu_space or torch; mu_space.compat.mmcv.install() uses it too.

`activate()` puts one finder at the front of sys.meta_path (once, however often it is called).
The finder answers only for `mmcv._ext`; its loader builds the surrogate on first import
(importing mu_space then), so mmcv, mmdet3d and mu_space may be imported in any order.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ENV = "MUSPACE_MMCV_EXT"
MODULE = "mmcv._ext"
ORIGIN = "mu_space.compat.mmcv (muSPACE surrogate of mmcv's compiled ops)"


def compiled_ext() -> str | None:
    """The path of a compiled mmcv._ext (full mmcv install) if there is one, else None. Looks at
    mmcv's package directories without importing mmcv."""
    mmcv = sys.modules.get("mmcv")
    try:
        spec = getattr(mmcv, "__spec__", None) or importlib.util.find_spec("mmcv")
    except (ImportError, ValueError):
        return None
    for folder in (getattr(spec, "submodule_search_locations", None) or ()) if spec else ():
        for pattern in ("_ext*.so", "_ext*.pyd", "_ext*.dylib"):
            found = sorted(glob.glob(os.path.join(folder, pattern)))
            if found:
                return found[0]
    return None


class SurrogateLoader(importlib.abc.Loader):
    """Creates (once) and returns the surrogate module; exec_module has nothing left to do."""

    def create_module(self, spec):
        from mu_space.compat.mmcv import _from_hook

        return _from_hook()

    def exec_module(self, module):
        return None


class SurrogateFinder(importlib.abc.MetaPathFinder):
    MU_SPACE_MMCV_EXT = True  # how activate() and install() recognise the finder

    def __init__(self, force: bool = False):
        self.force = force

    def find_spec(self, fullname, path=None, target=None):
        if fullname != MODULE or (not self.force and compiled_ext() is not None):
            return None
        return spec()


_LOADER = SurrogateLoader()


def spec() -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(MODULE, _LOADER, origin=ORIGIN)


def finder() -> SurrogateFinder | None:
    for f in sys.meta_path:
        if getattr(f, "MU_SPACE_MMCV_EXT", False):
            return f
    return None


def activate(force: bool = False) -> SurrogateFinder:
    """Install the finder at the front of sys.meta_path (idempotent); returns it."""
    found = finder()
    if found is None:
        found = SurrogateFinder(force)
        sys.meta_path.insert(0, found)
    found.force = found.force or force
    return found


def deactivate() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "MU_SPACE_MMCV_EXT", False)]


def enabled_by_environment() -> str | None:
    """'1' (serve unless a compiled mmcv._ext exists), 'force' (serve even then), or None."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return None
    return "force" if value == "force" else "1"


def at_interpreter_start() -> None:
    """What mu_space_mmcv_ext.pth runs: activate the finder when MUSPACE_MMCV_EXT asks for it.
    Never raises (a broken hook must not break the interpreter)."""
    try:
        mode = enabled_by_environment()
        if mode is not None:
            activate(force=mode == "force")
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"mu_space: {ENV} hook failed: {type(exc).__name__}: {exc}\n")
