"""`mu_space.compat.bevfusion`: serve the two compiled extensions of mmdet3d 1.x's
`projects/BEVFusion` from muSPACE, so that its ops import and run without building them.

    from mu_space.compat import bevfusion as bevfusion_compat
    from mu_space.compat import mmcv as mmcv_compat
    mmcv_compat.install()               # BEVFusion's other ops (sparse encoder, NMS) use mmcv._ext
    report = bevfusion_compat.install() # before `import projects.BEVFusion.bevfusion`
    ...
    print(report)                       # which functions are served, how often each was called

BEVFusion's setup.py builds `projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool_ext`
(`bev_pool.py`: `from . import bev_pool_ext`) and `projects.BEVFusion.bevfusion.ops.voxel.voxel_layer`
(`voxelize.py` / `scatter_points.py`: `from .voxel_layer import ...`). `install()` puts an import
finder at the front of sys.meta_path that serves one surrogate module object for each to that
import (and into sys.modules at once when its parent package is already imported). The
functions keep the pybind11 bindings' positional arguments (src/bev_pool.cpp,
src/voxelization.cpp + voxelization.h: no py::arg names, so no keywords and no defaults) and
call the public muSPACE ops with the surrogate's backend ("auto": native on a GPU, the PyTorch
reference on CPU): `mu_space.bev_pool` for the pooling, the mmcv._ext surrogate's voxel adapters
(mu_space.compat.mmcv._served: the patcher's adapters over mu_space.voxelization /
dynamic_voxelize / dynamic_scatter) for the voxel layer, whose coordinates BEVFusion writes in
(x, y, z) order (mmcv: (z, y, x)). mu_space.compat.mmcv.install() is not needed for these. Conventions and differences: docs/compat_mmcv.md ("BEVFusion's extensions").
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.machinery
import operator
import os
import sys
import threading
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import mu_space
from mu_space.compat._surrogate import surrogate_function
from mu_space.runtime.kernel_dispatch import BACKENDS

PACKAGE = "projects.BEVFusion.bevfusion.ops"
BEV_POOL_EXT = f"{PACKAGE}.bev_pool.bev_pool_ext"
VOXEL_LAYER = f"{PACKAGE}.voxel.voxel_layer"
MODULES = (BEV_POOL_EXT, VOXEL_LAYER)
ORIGIN = "mu_space.compat.bevfusion (muSPACE surrogate of BEVFusion's compiled ops)"

# module -> function -> the C++ parameter names (positional only, all required: pybind11
# bindings without py::arg take no keywords and see no C++ defaults)
SIGNATURES: dict[str, dict[str, tuple[str, ...]]] = {
    BEV_POOL_EXT: {
        "bev_pool_forward": (
            "x", "geom_feats", "interval_lengths", "interval_starts", "b", "d", "h", "w",
        ),
        "bev_pool_backward": (
            "out_grad", "geom_feats", "interval_lengths", "interval_starts", "b", "d", "h", "w",
        ),
    },
    VOXEL_LAYER: {
        "hard_voxelize": (
            "points", "voxels", "coors", "num_points_per_voxel", "voxel_size", "coors_range",
            "max_points", "max_voxels", "NDim", "deterministic",
        ),
        "dynamic_voxelize": ("points", "coors", "voxel_size", "coors_range", "NDim"),
        "dynamic_point_to_voxel_forward": ("feats", "coors", "reduce_type"),
        "dynamic_point_to_voxel_backward": (
            "grad_feats", "grad_reduced_feats", "feats", "reduced_feats", "coors_idx",
            "reduce_count", "reduce_type",
        ),
    },
}  # fmt: skip
ALL_NAMES: tuple[str, ...] = tuple(
    f"{module.rpartition('.')[2]}.{fn}" for module in MODULES for fn in SIGNATURES[module]
)

__all__ = [
    "ALL_NAMES",
    "BEV_POOL_EXT",
    "MODULES",
    "VOXEL_LAYER",
    "BEVFusionExtReport",
    "compiled_ext",
    "install",
    "installed",
    "report",
    "surrogate",
    "uninstall",
]


# --------------------------------------------------------------------------- served functions


def _int(value: Any, fn: str, name: str) -> int:
    """pybind11's int conversion: __index__ (ints, 0-d integer tensors such as BEVFusion's
    `self.nx[i]`), never a float."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{fn}(): {name} must be an int (or a 0-d integer tensor), got {type(value).__name__}"
        ) from None


def _interval_rows(geom_feats, interval_lengths, interval_starts, n: int):
    """The rows covered by the intervals and, for each, the coordinates (h, w, d, b) of its
    interval's first point (where upstream's kernels read the cell): (rows or None when the
    intervals tile 0..n-1 in order, coords [rows, 4]). Rows outside [0, n) are dropped
    (upstream reads out of bounds there)."""
    device = geom_feats.device
    lengths = interval_lengths.to(device=device, dtype=torch.long).clamp(min=0)
    starts = interval_starts.to(device=device, dtype=torch.long)
    k = lengths.numel()
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=device), geom_feats[:0]
    total = int(lengths.sum())  # host sync (upstream's Python cut the intervals with one too)
    interval = torch.repeat_interleave(torch.arange(k, device=device), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    rows = starts[interval] + torch.arange(total, device=device) - first[interval]
    keep = (rows >= 0) & (rows < n) & (starts[interval] >= 0) & (starts[interval] < n)
    if not bool(keep.all()):
        rows, interval = rows[keep], interval[keep]
    coords = geom_feats[starts[interval]]
    if rows.numel() == n and torch.equal(rows, torch.arange(n, device=device)):
        return None, coords  # BEVFusion's own intervals: every point once, in order
    return rows, coords


def _check_bev(fn, x, geom_feats, interval_lengths, interval_starts):
    for name, t in (
        ("geom_feats", geom_feats),
        ("interval_lengths", interval_lengths),
        ("interval_starts", interval_starts),
    ):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex():
            raise TypeError(f"{fn}(): {name} must be an integer tensor (int32 upstream)")
    if geom_feats.dim() != 2 or geom_feats.shape[1] != 4:
        raise ValueError(
            f"{fn}(): geom_feats must be [n, 4] (h, w, d, b), got {tuple(geom_feats.shape)}"
        )
    if interval_lengths.shape != interval_starts.shape or interval_lengths.dim() != 1:
        raise ValueError(
            f"{fn}(): interval_lengths and interval_starts must be 1-D of one length, got "
            f"{tuple(interval_lengths.shape)} and {tuple(interval_starts.shape)}"
        )


def bev_pool_forward(backend, x, geom_feats, interval_lengths, interval_starts, b, d, h, w):
    """x [n, C], geom_feats [n, 4] int (h, w, d, b), intervals int [K]; returns Tensor[B, D, H,
    W, C] in x's dtype: each interval's rows summed into the cell of its first point, 0 where
    no interval lands. Through mu_space.bev_pool (its [B, C, D, H, W] result permuted)."""
    fn = "bev_pool_ext.bev_pool_forward"
    dims = [_int(v, fn, name) for v, name in zip((b, d, h, w), "bdhw")]
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{fn}(): x must be a 2-D tensor [n, C]")
    _check_bev(fn, x, geom_feats, interval_lengths, interval_starts)
    if geom_feats.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}(): geom_feats must have x's {x.shape[0]} rows")
    rows, coords = _interval_rows(geom_feats, interval_lengths, interval_starts, x.shape[0])
    with torch.no_grad():
        feats = x.detach() if rows is None else x.detach().index_select(0, rows)
        out = mu_space.bev_pool(feats, coords, *dims, backend=backend)
    return out.permute(0, 2, 3, 4, 1).contiguous()


def bev_pool_backward(backend, out_grad, geom_feats, interval_lengths, interval_starts, b, d, h, w):
    """out_grad [B, D, H, W, C]; returns x_grad [n, C] (n = geom_feats rows): every row of an
    interval gets out_grad at the cell of the interval's first point, rows of no interval 0
    (the row gather that mu_space.bev_pool's own backward is)."""
    fn = "bev_pool_ext.bev_pool_backward"
    dims = [_int(v, fn, name) for v, name in zip((b, d, h, w), "bdhw")]
    _check_bev(fn, out_grad, geom_feats, interval_lengths, interval_starts)
    if not isinstance(out_grad, torch.Tensor) or out_grad.dim() != 5:
        raise ValueError(f"{fn}(): out_grad must be [B, D, H, W, C]")
    if tuple(out_grad.shape[:4]) != tuple(dims):
        raise ValueError(
            f"{fn}(): out_grad must be [{', '.join(map(str, dims))}, C], got "
            f"{tuple(out_grad.shape)}"
        )
    n, c = geom_feats.shape[0], out_grad.shape[4]
    rows, coords = _interval_rows(geom_feats, interval_lengths, interval_starts, n)
    if rows is None:
        rows = torch.arange(n, device=geom_feats.device)
    B, D, H, W = dims
    cx, cy, cz, cb = (coords[:, i].long() for i in range(4))
    ok = (cx >= 0) & (cx < H) & (cy >= 0) & (cy < W) & (cz >= 0) & (cz < D) & (cb >= 0) & (cb < B)
    cells = ((cb * D + cz) * H + cx) * W + cy
    x_grad = out_grad.new_zeros(n, c)
    src = out_grad.detach().reshape(-1, c)
    x_grad.index_copy_(0, rows[ok], src.index_select(0, cells[ok]))
    return x_grad


def _mmcv_adapter(name: str) -> Callable[..., Any]:
    from mu_space.compat.mmcv._served import SERVED

    return SERVED[name]


def _ndim(fn: str, NDim: Any) -> None:
    if _int(NDim, fn, "NDim") != 3:
        raise NotImplementedError(
            f"{fn}(): muSPACE's surrogate serves NDim == 3 only (what BEVFusion's Python passes)"
        )


def _xyz(coors: torch.Tensor) -> torch.Tensor:
    """mmcv's (z, y, x) rows as BEVFusion's (x, y, z); rows marking a dropped point (first
    column -1: upstream's -1 pattern is positional, the same in both) unchanged."""
    return torch.where(coors[:, :1] >= 0, coors.flip(1), coors)


def hard_voxelize(
    backend, points, voxels, coors, num_points_per_voxel, voxel_size, coors_range,
    max_points, max_voxels, NDim, deterministic,
):  # fmt: skip
    """Fills the caller's voxels [max_voxels, max_points, F], coors [max_voxels, 3] int32
    (x, y, z: BEVFusion's order, mmcv's reversed) and num_points_per_voxel [max_voxels] int32
    for the first M voxels; returns M (an int). Otherwise mmcv's deterministic hard
    voxelization (mu_space.voxelization; `deterministic` passed on)."""
    _ndim("voxel_layer.hard_voxelize", NDim)
    voxel_num = torch.zeros((), dtype=torch.int64)
    _mmcv_adapter("hard_voxelize_forward")(
        backend, points, voxel_size, coors_range, voxels, coors, num_points_per_voxel,
        voxel_num, max_points, max_voxels, 3, bool(deterministic),
    )  # fmt: skip
    m = int(voxel_num)
    coors[:m] = coors[:m].flip(1)
    return m


def dynamic_voxelize(backend, points, coors, voxel_size, coors_range, NDim):
    """Writes coors [N, 3] int32 in place: (x, y, z) (BEVFusion's order, mmcv's reversed) and,
    for a point outside the range, upstream's GPU rows (x out: (-1, 0, 0), y out: (-1, -1, 0),
    z out: (-1, -1, -1)); returns None (mu_space.dynamic_voxelize)."""
    _ndim("voxel_layer.dynamic_voxelize", NDim)
    _mmcv_adapter("dynamic_voxelize_forward")(backend, points, voxel_size, coors_range, coors, 3)
    coors.copy_(_xyz(coors))


_REDUCE = ("max", "sum", "mean")


def _reduce(fn: str, reduce_type: Any) -> str:
    if reduce_type not in _REDUCE:
        raise RuntimeError(f"{fn}(): do not support reduce type {reduce_type}")  # upstream's
    return reduce_type


def dynamic_point_to_voxel_forward(backend, feats, coors, reduce_type):
    """Returns [voxel_feats, voxel_coors, point2voxel int32 (-1 dropped), voxel_points_count
    int32] (mu_space.dynamic_scatter's parts; upstream's CPU build has no such path)."""
    reduce = _reduce("voxel_layer.dynamic_point_to_voxel_forward", reduce_type)
    return _mmcv_adapter("dynamic_point_to_voxel_forward")(backend, feats, coors, reduce)


def dynamic_point_to_voxel_backward(
    backend, grad_feats, grad_reduced_feats, feats, reduced_feats, coors_idx, reduce_count,
    reduce_type,
):  # fmt: skip
    """Writes grad_feats in place (max: the gradient to the lowest point index holding the
    maximum); returns None."""
    reduce = _reduce("voxel_layer.dynamic_point_to_voxel_backward", reduce_type)
    _mmcv_adapter("dynamic_point_to_voxel_backward")(
        backend, grad_feats, grad_reduced_feats, feats, reduced_feats, coors_idx, reduce_count,
        reduce,
    )  # fmt: skip


SERVED: dict[str, dict[str, Callable[..., Any]]] = {
    BEV_POOL_EXT: {"bev_pool_forward": bev_pool_forward, "bev_pool_backward": bev_pool_backward},
    VOXEL_LAYER: {
        "hard_voxelize": hard_voxelize,
        "dynamic_voxelize": dynamic_voxelize,
        "dynamic_point_to_voxel_forward": dynamic_point_to_voxel_forward,
        "dynamic_point_to_voxel_backward": dynamic_point_to_voxel_backward,
    },
}


# --------------------------------------------------------------------------- modules and import


@dataclass
class _State:
    backend: str = "auto"
    calls: Counter = field(default_factory=Counter)
    modules: dict = field(default_factory=dict)  # module name -> surrogate module object
    serving: set = field(default_factory=set)  # module names the finder answers for
    force: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def _short(module: str) -> str:
    return module.rpartition(".")[2]


def _make_function(module: str, name: str):
    impl = SERVED[module][name]
    return surrogate_function(
        name,
        SIGNATURES[module][name],
        impl,
        _STATE,
        module=module,
        counted_as=f"{_short(module)}.{name}",
        positional_only=True,
        what=(impl.__doc__ or "").strip(),
    )


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return surrogate(spec.name)

    def exec_module(self, module):
        return None


_LOADER = _Loader()


class _Finder(importlib.abc.MetaPathFinder):
    MU_SPACE_BEVFUSION_EXT = True  # how install() / uninstall() recognise it

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _STATE.serving:
            return None
        if not _STATE.force and compiled_ext(fullname) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER, origin=ORIGIN)


def _finder() -> _Finder | None:
    for f in sys.meta_path:
        if getattr(f, "MU_SPACE_BEVFUSION_EXT", False):
            return f
    return None


def surrogate(module: str) -> types.ModuleType:
    """The one surrogate module object for `module` (one of MODULES; created on first use)."""
    if module not in SIGNATURES:
        raise KeyError(f"not a BEVFusion extension muSPACE serves: {module!r} (MODULES: {MODULES})")
    with _STATE.lock:
        mod = _STATE.modules.get(module)
        if mod is None:
            mod = types.ModuleType(module, f"muSPACE surrogate of BEVFusion's compiled {module}")
            mod.__spec__ = importlib.machinery.ModuleSpec(module, _LOADER, origin=ORIGIN)
            mod.__loader__ = _LOADER
            mod.__file__ = None
            mod.__mu_space_surrogate__ = True
            for name in SIGNATURES[module]:
                setattr(mod, name, _make_function(module, name))
            mod.report = report
            _STATE.modules[module] = mod
        return mod


def compiled_ext(module: str) -> str | None:
    """The path of a built `module` (BEVFusion's setup.py output next to its sources) if there is
    one, else None. Looks in the parent package's folders (the imported package's __path__, else
    each sys.path entry) without importing anything."""
    parent, _, leaf = module.rpartition(".")
    package = sys.modules.get(parent)
    if package is not None and getattr(package, "__path__", None) is not None:
        folders = list(package.__path__)
    else:
        parts = parent.split(".")
        folders = [
            os.path.join(entry or os.getcwd(), *parts)
            for entry in sys.path
            if isinstance(entry, str)
        ]
    for folder in folders:
        for pattern in (f"{leaf}.*.so", f"{leaf}.so", f"{leaf}.*.pyd", f"{leaf}.pyd"):
            found = sorted(glob.glob(os.path.join(glob.escape(folder), pattern)))
            if found:
                return found[0]
    return None


@dataclass
class BEVFusionExtReport:
    """What the surrogates serve and what ran. `modules`: module -> "installed" / "skipped";
    `reasons`: module -> why it was skipped; `calls`: "bev_pool_ext.bev_pool_forward" etc. ->
    number of calls since install / reset (a live view)."""

    modules: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)
    backend: str = "auto"
    calls: Counter = field(default_factory=Counter)

    @property
    def status(self) -> str:
        states = set(self.modules.values())
        if not states:
            return "not installed"
        if states == {"installed"}:
            return "installed"
        return "skipped" if states == {"skipped"} else "partial"

    @property
    def served(self) -> tuple[str, ...]:
        return tuple(
            f"{_short(m)}.{fn}"
            for m in MODULES
            if self.modules.get(m) == "installed"
            for fn in SIGNATURES[m]
        )

    @property
    def not_served(self) -> tuple[str, ...]:
        return tuple(n for n in ALL_NAMES if n not in self.served)

    def reset(self) -> None:
        self.calls.clear()

    def __str__(self) -> str:
        return self.report()

    def report(self) -> str:
        served = self.served
        lines = [
            f"BEVFusion extension surrogates: {self.status}, {len(served)} of {len(ALL_NAMES)} "
            f"functions served by muSPACE, backend {self.backend!r}"
        ]
        for module in MODULES:
            state = self.modules.get(module, "not installed")
            why = f" ({self.reasons[module]})" if module in self.reasons else ""
            lines.append(f"  {module}: {state}{why}")
        width = max(len(n) for n in ALL_NAMES)
        for name in ALL_NAMES:
            state = "served" if name in served else "NOT SERVED"
            lines.append(f"    {name.ljust(width)}  {state:10s} {self.calls.get(name, 0)} calls")
        return "\n".join(lines)


_REPORT = BEVFusionExtReport(calls=_STATE.calls)


def install(*, backend: str = "auto", force: bool = False) -> BEVFusionExtReport:
    """Serve BEVFusion's `bev_pool_ext` and `voxel_layer` from muSPACE: an import finder at the
    front of sys.meta_path answers `from . import bev_pool_ext` / `from .voxel_layer import ...`
    with the surrogate modules, and when a parent package is already imported the surrogate goes
    into sys.modules and onto it at once. Idempotent (one module object each; a later call may
    change `backend`). A built extension (BEVFusion's setup.py run) or another module already
    imported under the name is left alone unless force=True: the report says "skipped" with the
    path. Does not need mu_space.compat.mmcv.install(). Returns the report (also `report()`)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {force!r}")
    _STATE.backend = _REPORT.backend = backend
    _STATE.force = _STATE.force or force
    for module in MODULES:
        current = sys.modules.get(module)
        ours = getattr(current, "__mu_space_surrogate__", False)
        real = None if ours else compiled_ext(module)
        if not ours and not force and (real is not None or current is not None):
            where = real or getattr(current, "__file__", None) or repr(current)
            if module not in _STATE.serving:
                _REPORT.modules[module] = "skipped"
                _REPORT.reasons[module] = (
                    f"a compiled {_short(module)} is present ({where}); install(force=True) "
                    "replaces it"
                )
            continue
        mod = surrogate(module)
        _STATE.serving.add(module)
        parent_name, _, leaf = module.rpartition(".")
        parent = sys.modules.get(parent_name)
        if parent is not None or current is not None:  # else served at the parent's import
            sys.modules[module] = mod
        if parent is not None:
            setattr(parent, leaf, mod)
        _REPORT.modules[module] = "installed"
        _REPORT.reasons.pop(module, None)
    if _STATE.serving and _finder() is None:
        sys.meta_path.insert(0, _Finder())
    return _REPORT


def installed(module: str | None = None) -> bool:
    """Whether the surrogate of `module` (default: every one of MODULES) is what is imported or
    what the finder serves."""
    names = MODULES if module is None else (module,)
    return all(
        getattr(sys.modules.get(m), "__mu_space_surrogate__", False)
        or (m in _STATE.serving and _finder() is not None)
        for m in names
    )


def report() -> BEVFusionExtReport:
    """The report of install() (status "not installed" before any)."""
    return _REPORT


def uninstall() -> None:
    """Remove the finder and the surrogates from sys.modules and their parent packages. Modules
    that already imported them (bev_pool.py's `bev_pool_ext`) keep using them."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "MU_SPACE_BEVFUSION_EXT", False)]
    for module in MODULES:
        if getattr(sys.modules.get(module), "__mu_space_surrogate__", False):
            del sys.modules[module]
        parent_name, _, leaf = module.rpartition(".")
        parent = sys.modules.get(parent_name)
        if getattr(getattr(parent, leaf, None), "__mu_space_surrogate__", False):
            delattr(parent, leaf)
    _STATE.serving.clear()
    _STATE.force = False
    _REPORT.modules.clear()
    _REPORT.reasons.clear()
