"""`mu_space.compat.mmcv`: serve mmcv's compiled extension `mmcv._ext` from muSPACE, so that
upstream mmcv 2.x / mmdet3d 1.x code runs with mmcv-lite (no mmcv ops build).

    from mu_space.compat import mmcv as mmcv_compat
    report = mmcv_compat.install()      # before or after `import mmcv`: either works
    import mmcv.ops                     # now imports: every extension name exists
    ...
    print(report)                       # which names are served, how often each was called

or, with no code change, at interpreter start: `MUSPACE_MMCV_EXT=1 python train.py`
(the `mu_space_mmcv_ext.pth` hook installed with the package).

The surrogate is one module object, `sys.modules["mmcv._ext"]`, with all 112 functions of mmcv
2.1.0's extension under mmcv's keyword names. Served names call the public muSPACE operators
(backend "auto": native on a GPU, the PyTorch reference on CPU) in mmcv's convention (outputs
preallocated by the caller are written in place); the other names raise NotImplementedError
naming the mmcv function when called, never at import. docs/compat_mmcv.md lists them.
"""

from __future__ import annotations

import sys
import threading
import types
from collections import Counter
from dataclasses import dataclass, field

from mu_space.compat._surrogate import surrogate_function
from mu_space.compat.mmcv import _hook
from mu_space.compat.mmcv._hook import ENV, MODULE, compiled_ext
from mu_space.compat.mmcv._names import MMCV_VERSION, SIGNATURES
from mu_space.compat.mmcv._served import SERVED, SPARSE, NotServedError, sparse_function
from mu_space.runtime.kernel_dispatch import BACKENDS

ALL_NAMES: tuple[str, ...] = tuple(sorted(SIGNATURES))
SERVED_NAMES: tuple[str, ...] = tuple(sorted(n for n in SERVED if n not in SPARSE))
SPARSE_NAMES: tuple[str, ...] = tuple(sorted(SPARSE))

__all__ = [
    "ALL_NAMES",
    "ENV",
    "MMCV_VERSION",
    "SERVED_NAMES",
    "SPARSE_NAMES",
    "ExtReport",
    "NotServedError",
    "install",
    "installed",
    "report",
    "surrogate",
    "uninstall",
]

_MARK = "__mu_space_patch__"  # the patcher's marker: its prechecks skip marked functions


@dataclass
class _State:
    backend: str = "auto"
    calls: Counter = field(default_factory=Counter)
    module: types.ModuleType | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def _served_now(name: str) -> bool:
    if name in SPARSE:
        return sparse_function(name) is not None
    return name in SERVED


@dataclass
class ExtReport:
    """What the surrogate serves and what ran. `status`: "installed" or "skipped" (with
    `reason`); `calls`: name -> number of calls since install / reset (a live view)."""

    status: str
    reason: str = ""
    backend: str = "auto"
    calls: Counter = field(default_factory=Counter)

    @property
    def served(self) -> tuple[str, ...]:
        """Names implemented by muSPACE now (the sparse ones once mu_space.sparse.mmcv_ext has
        them)."""
        return tuple(n for n in ALL_NAMES if _served_now(n))

    @property
    def not_served(self) -> tuple[str, ...]:
        return tuple(n for n in ALL_NAMES if not _served_now(n))

    def reset(self) -> None:
        self.calls.clear()

    def __str__(self) -> str:
        return self.report()

    def report(self) -> str:
        if self.status != "installed":
            return f"mmcv._ext surrogate: {self.status} ({self.reason})"
        served = self.served
        lines = [
            f"mmcv._ext surrogate (mmcv {MMCV_VERSION} names): {len(served)} of "
            f"{len(ALL_NAMES)} served by muSPACE, backend {self.backend!r}"
        ]
        width = max(len(n) for n in ALL_NAMES)
        for name in ALL_NAMES:
            if name in served or self.calls.get(name):
                state = "served" if name in served else "NOT SERVED"
                lines.append(f"  {name.ljust(width)}  {state:10s} {self.calls.get(name, 0)} calls")
        lines.append(f"  ({len(ALL_NAMES) - len(served)} more names raise NotImplementedError)")
        return "\n".join(lines)


def _make_function(name: str):
    impl = SERVED.get(name)
    if name in SPARSE:
        what = "sparse convolution: routed to mu_space.sparse.mmcv_ext at call time"
    elif impl is None:
        what = "not served by muSPACE: raises NotImplementedError when called"
    else:
        what = (impl.__doc__ or "").strip()
    if impl is None:

        def impl(backend, *args):
            raise NotServedError(_not_served_message(name))

    function = surrogate_function(
        name,
        SIGNATURES[name],
        impl,
        _STATE,
        module=MODULE,
        counted_as=name,
        shown_as=f"{MODULE}.{name}",
        what=what,
    )
    setattr(function, _MARK, f"mmcv._ext surrogate ({name})")
    return function


def _not_served_message(name: str) -> str:
    from mu_space.compat.mmcv._served import not_served

    return str(not_served(name))


def surrogate() -> types.ModuleType:
    """The one surrogate module object (created on first use)."""
    with _STATE.lock:
        if _STATE.module is None:
            module = types.ModuleType(MODULE, "muSPACE surrogate of mmcv's compiled `_ext`")
            module.__spec__ = _hook.spec()
            module.__loader__ = module.__spec__.loader
            module.__file__ = None
            module.__mu_space_surrogate__ = True
            for name in ALL_NAMES:
                setattr(module, name, _make_function(name))
            module.report = report
            _STATE.module = module
        return _STATE.module


_REPORT: ExtReport | None = None


def _from_hook() -> types.ModuleType:
    """The import hook's loader: the surrogate, and the report of an install by the hook."""
    global _REPORT
    module = surrogate()
    if _REPORT is None or _REPORT.status != "installed":
        _REPORT = ExtReport("installed", "", _STATE.backend, _STATE.calls)
    return module


def install(*, backend: str = "auto", force: bool = False) -> ExtReport:
    """Serve `mmcv._ext` from muSPACE: an import hook at the front of sys.meta_path serves the
    surrogate to the first `import mmcv._ext` (mmcv.ops' load_ext), and when mmcv is already
    imported the surrogate goes into sys.modules and onto mmcv at once. Idempotent: one module
    object however often this is called; a later call may change `backend`.

    A compiled mmcv._ext (a full mmcv install) is left alone unless force=True (then the
    patcher, mu_space.patcher.default_patcher(), is the way to use muSPACE ops with it); the
    report says so. Returns the report (also `report()` and `mmcv._ext.report()`)."""
    global _REPORT
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {force!r}")
    current = sys.modules.get(MODULE)
    ours = getattr(current, "__mu_space_surrogate__", False)
    real = compiled_ext()
    if not ours and not force and (real is not None or current is not None):
        where = real or getattr(current, "__file__", None) or repr(current)
        _REPORT = ExtReport(
            "skipped",
            f"a compiled mmcv._ext is present ({where}); use mu_space.patcher.default_patcher() "
            "with it, or install(force=True) to replace it",
            backend,
            _STATE.calls,
        )
        return _REPORT
    _STATE.backend = backend
    module = surrogate()
    _hook.activate(force=force)
    parent = sys.modules.get("mmcv")
    if parent is not None:  # else the hook serves it on mmcv's first `import mmcv._ext`
        sys.modules[MODULE] = module
        parent._ext = module
    if _REPORT is None or _REPORT.status != "installed":
        _REPORT = ExtReport("installed", "", backend, _STATE.calls)
    _REPORT.backend = backend
    return _REPORT


def installed() -> bool:
    return getattr(sys.modules.get(MODULE), "__mu_space_surrogate__", False)


def report() -> ExtReport:
    """The report of the last install() (a "not installed" one before any)."""
    if _REPORT is None:
        return ExtReport("not installed", "mu_space.compat.mmcv.install() was not called")
    return _REPORT


def uninstall() -> None:
    """Remove the surrogate from sys.modules (and mmcv) and the import hook. Modules that
    already hold it (mmcv.ops' `ext_module`) keep using it."""
    global _REPORT
    _hook.deactivate()
    if installed():
        del sys.modules[MODULE]
    parent = sys.modules.get("mmcv")
    if getattr(getattr(parent, "_ext", None), "__mu_space_surrogate__", False):
        del parent._ext
    _REPORT = None
