"""`bev_pool_v3`: BEV pooling from unsorted ranks, no interval arrays (Ascend DrivingSDK API).

    out[b, c, z, y, x] = sum over points i with ranks_bev[i] == ((b*Z + z)*Y + y)*X + x of
                         depth.flat[ranks_depth[i]] * feat.flat[ranks_feat[i]*C + c]

    depth            Tensor[B, N, D, H, W]  floating (any shape; indexed flat)   or None
    feat             Tensor[B, N, H, W, C]  floating, channels last (any shape with last dim C)
    ranks_depth      Tensor[n] int32                                              or None
    ranks_feat       Tensor[n] int32                                              or None
    ranks_bev        Tensor[n] int32 flat cells, or Tensor[n, 4] int32/int64 (h, w, d, b)
    bev_feat_shape   (B, Z, Y, X, C)  -- DrivingSDK calls it (B, D, H, W, C)
    returns          Tensor[B, C, Z, Y, X] in feat's dtype (float32 accumulation)

Same arguments and output as `mx_driving.bev_pool_v3`, which is `bev_pool_v2` without the sort:
ranks may come in any order and there are no `interval_starts` / `interval_lengths`.

v1 mode (DrivingSDK's BEVFusion path): `depth=None, ranks_depth=None, ranks_feat=None` and a 2-D
`ranks_bev[n, 4]` whose columns are (h, w, d, b) -- exactly BEVFusion's `coords` (x, y, z, batch)
with x indexing H (= Y) and y indexing W (= X) -- pools `feat[n, C]` row i into cell
((b*Z + d)*Y + h)*X + w with weight 1; backward gives grad for feat only.

Extensions over DrivingSDK (documented in docs/operators/bev_pool_v3.md): float16 / bfloat16 with
float32 accumulation; any C (DrivingSDK needs C % 8 == 0); 2-D ranks_bev also with depth;
`depth=None` with a 1-D ranks_bev and a ranks_feat (weight-1 pooling of gathered feat rows);
points with any out-of-range index (a flat cell outside [0, B*Z*Y*X), a 2-D coordinate outside
its dimension, a ranks_depth / ranks_feat outside its tensor) are dropped instead of read or
written out of bounds; `validate=True` turns them into an IndexError instead (one host sync).
Forward is deterministic (DrivingSDK accumulates with atomics).

Native path: composed from two primitives, nothing new in C++:
`bev_pool_prepare.sort_by_cell` (deterministic counting sort of the cells; drops out-of-range
cells) gives the permutation and intervals, the ranks are permuted, and
`bev_pool_v2.bev_pool_v2` pools them (its autograd gives the backward; in v1 mode, where each
feat row has one cell, the backward is a row gather instead, as in `bev_pool`). The sort has a
data-dependent output size, so the forward synchronises with the host once (as every sort-based
BEV pooling does; DrivingSDK's atomics path avoids it at the cost of determinism).

`bev_pool_v3_reference` is vectorised PyTorch (gather, multiply, `index_add`), float64 capable,
and is the CPU / fallback path. `bev_pool.py` (BEVFusion's `bev_pool`) reuses this module's
helpers: it is v1 mode.

torch.compile(fullgraph=True): the reference path has no data-dependent shapes; on the native
path the backend choice is made at trace time, v1 mode is one custom op
(`mu_space::bev_pool_rows`: sort + pool inside, fixed output shape, row-gather backward) and
depth mode traces sort_by_cell's custom op (data-dependent size), the permutation and
bev_pool_v2's custom op.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops.bev_pool_prepare import sort_by_cell
from mu_space.ops.bev_pool_v2 import bev_pool_v2
from mu_space.runtime import kernel_dispatch, registry

OP = "bev_pool_v3"
NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_LIMIT = 2**31
# The primitives' entry points these ops run through (they have no kernel of their own).
_ROWS_ENTRY_POINTS = ("sort_by_cell_forward", "bev_pool_sort_workspace_ints", "bev_pool_v2_forward")
_NATIVE_ENTRY_POINTS = _ROWS_ENTRY_POINTS + (
    "bev_pool_v2_backward",
    "bev_pool_v2_backward_feat_sorted",
)


# ------------------------------------------------------------------ shared helpers (bev_pool too)


def _check_floating(t, name: str) -> None:
    check_tensor(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {dtype_name(t.dtype)}")


def _as_int(value, name: str) -> int:
    """A non-negative Python int from an int / 0-d integer tensor (BEVFusion passes `self.nx[i]`)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


class Grid(NamedTuple):
    """(B, Z, Y, X) cell counts of the output and the channel count C."""

    B: int
    Z: int
    Y: int
    X: int
    C: int

    @property
    def n_cells(self) -> int:
        return self.B * self.Z * self.Y * self.X


def _grid(bev_feat_shape, name: str = "bev_feat_shape") -> Grid:
    if (
        isinstance(bev_feat_shape, torch.Tensor)
        or not isinstance(bev_feat_shape, Sequence)
        or len(bev_feat_shape) != 5
    ):
        raise ValueError(f"{name} must be 5 integers (B, Z, Y, X, C), got {bev_feat_shape!r}")
    labels = ("B", "Z", "Y", "X", "C")
    return Grid(*(_as_int(v, f"{name}[{i}] ({labels[i]})") for i, v in enumerate(bev_feat_shape)))


_CONSTANTS: dict = {}


def _cell_constants(dims: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device):
    """(lower bounds, upper bounds, strides) of the (h, w, d, b) columns as tensors on `device`.

    Cached per (device, dtype, dims) in eager mode: building them is a host-to-device copy that
    torch waits for, i.e. a host sync on every call (and illegal inside CUDA-graph capture).
    """
    B, D, H, W = dims

    def build():
        return (
            torch.zeros(4, dtype=dtype, device=device),
            torch.tensor([H - 1, W - 1, D - 1, B - 1], dtype=dtype, device=device),
            torch.tensor([W, 1, H * W, D * H * W], dtype=dtype, device=device),
        )

    if torch.compiler.is_compiling():  # inductor turns these into graph constants
        return build()
    key = (device, dtype, dims)
    hit = _CONSTANTS.get(key)
    if hit is None:
        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        hit = _CONSTANTS[key] = build()
    return hit


def _coords_to_cells(coords: torch.Tensor, dims: tuple[int, int, int, int]) -> torch.Tensor:
    """Flat cells of `coords[n, 4] = (h, w, d, b)` in a (B, D, H, W) grid.

        cell = ((b*D + d)*H + h)*W + w,   -1 where any coordinate is outside its dimension

    (a per-column check: a w == W must not wrap into the next row). int32 cells when the grid
    fits int32 (what the native kernels take), else int64. Six elementwise kernels over coords,
    no host sync. (A fused kernel would read coords once; see docs/operators/bev_pool.md.)
    """
    B, D, H, W = dims
    n_cells = B * D * H * W
    small = n_cells < INT32_LIMIT
    ct = torch.int32 if coords.dtype == torch.int32 and small else torch.int64  # compute dtype
    c = coords if coords.dtype == ct else coords.to(ct)
    lo, hi, strides = _cell_constants(dims, ct, c.device)
    clamped = torch.clamp(c, min=lo, max=hi)
    bad = (clamped != c).any(dim=1)
    # clamped values (and so every partial product) are < n_cells: int32 output is exact
    cells = (clamped * strides).sum(dim=1, dtype=torch.int32 if small else torch.int64)
    return cells.masked_fill_(bad, -1)


def _pool_reference(depth, feat, ranks_depth, ranks_feat, cells, grid: Grid) -> torch.Tensor:
    """Vectorised PyTorch pooling of validated inputs (float32 accumulation, float64 kept).

    Invalid points (cell outside [0, n_cells), rank outside its tensor) go to a scratch row that
    is dropped, so there is no data-dependent shape (torch.compile(fullgraph=True) works) and no
    out-of-bounds gather.
    """
    B, Z, Y, X, C = grid
    n_cells = grid.n_cells
    acc = torch.float64 if feat.dtype == torch.float64 else torch.float32
    device = feat.device
    n = cells.shape[0]
    cells = cells.long()
    valid = (cells >= 0) & (cells < n_cells)
    # `feat.reshape(-1)[:0].sum()` is a free 0 that keeps the output in feat's autograd graph
    if C == 0 or n_cells == 0:
        return feat.new_zeros((B, C, Z, Y, X)) + feat.reshape(-1)[:0].sum()
    rows = feat.reshape(-1, C)
    if ranks_feat is None:
        row_index = torch.arange(n, device=device)
    else:
        row_index = ranks_feat.long()
        valid = valid & (row_index >= 0) & (row_index < rows.shape[0])
    if depth is not None:
        weights = depth.reshape(-1)
        depth_index = ranks_depth.long()
        valid = valid & (depth_index >= 0) & (depth_index < weights.shape[0])
    if rows.shape[0] == 0 and n > 0:  # then every point is invalid: nothing to gather
        vals = torch.zeros(n, C, dtype=acc, device=device) + rows[:0].sum().to(acc)
    else:
        vals = rows.index_select(0, torch.where(valid, row_index, 0)).to(acc)
    if depth is not None and weights.shape[0] > 0:
        w = weights.index_select(0, torch.where(valid, depth_index, 0)).to(acc)
        vals = vals * w.unsqueeze(1)
    target = torch.where(valid, cells, n_cells)
    out = torch.zeros(n_cells + 1, C, dtype=acc, device=device).index_add(0, target, vals)
    return out[:n_cells].view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3).to(feat.dtype).contiguous()


def _primitives():
    """The two native primitives these ops are composed from (tests substitute fakes here)."""
    return sort_by_cell, bev_pool_v2


def _pool_native(depth, feat, ranks_depth, ranks_feat, cells, grid: Grid, backend: str):
    """sort_by_cell + permuted ranks + bev_pool_v2 (its autograd gives the backward)."""
    sort_by_cell, bev_pool_v2 = _primitives()
    s = sort_by_cell(cells, grid.n_cells, backend=backend)
    order = s.order
    ranks_bev = cells[order]
    if ranks_bev.dtype != torch.int32:  # int64 1-D ranks_bev cannot reach here (int32 checked)
        ranks_bev = ranks_bev.to(torch.int32)  # values < n_cells < 2**31 (checked)
    ranks_feat = order if ranks_feat is None else ranks_feat[order]
    if depth is not None:
        ranks_depth = ranks_depth[order]
    return bev_pool_v2(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        tuple(grid),
        s.interval_starts,
        s.interval_lengths,
        backend=backend,
    )


def _row_gather_grad(grad_out: torch.Tensor, cells: torch.Tensor, grid: Grid) -> torch.Tensor:
    """grad of feat[n, C] when point i adds row i to cell[i] with weight 1 (each row used once):

        grad[i] = grad_out[b, :, z, y, x] of cell[i],   0 for a cell outside [0, B*Z*Y*X)

    grad_out goes channels-last once (into a buffer with a trailing zero row for the dropped
    points), then one row gather: no atomics, no float32 scratch, no sort; exact in every dtype.
    """
    B, Z, Y, X, C = grid
    n_cells = grid.n_cells
    rows = grad_out.new_empty(n_cells + 1, C)
    rows[:n_cells].view(B, Z, Y, X, C).copy_(grad_out.permute(0, 2, 3, 4, 1))
    rows[n_cells].zero_()
    return rows.index_select(0, torch.where((cells >= 0) & (cells < n_cells), cells, n_cells))


# Weight-1 pooling of feat[n, C] rows (bev_pool, bev_pool_v3 v1 mode), native: one custom op
# whose inside is sort_by_cell + bev_pool_v2 (no depth), so torch.compile sees a fixed output
# shape and no data-dependent sizes (an autograd.Function around the sort cannot be traced:
# its unbacked sizes would escape). Backward: `_row_gather_grad` -- every point has exactly one
# cell, so the gradient is a gather (bev_pool_v2's general backward would zero a float32 buffer
# and scatter into it with atomics, or re-sort the points by ranks_feat).


@torch.library.custom_op("mu_space::bev_pool_rows", mutates_args=())
def _pool_rows_op(
    feat: torch.Tensor, cells: torch.Tensor, grid: list[int], backend: str
) -> torch.Tensor:
    return _pool_native(None, feat, None, None, cells, Grid(*grid), backend)


@_pool_rows_op.register_fake
def _(feat, cells, grid, backend):
    B, Z, Y, X, C = grid
    return feat.new_empty((B, C, Z, Y, X))


def _pool_rows_setup_context(ctx, inputs, output):
    _, cells, grid, _ = inputs
    ctx.save_for_backward(cells)
    ctx.grid = Grid(*grid)


def _pool_rows_backward(ctx, grad_out):
    (cells,) = ctx.saved_tensors
    return _row_gather_grad(grad_out, cells, ctx.grid), None, None, None


_pool_rows_op.register_autograd(_pool_rows_backward, setup_context=_pool_rows_setup_context)


def _pool_rows_native(feat, cells, grid: Grid, backend: str) -> torch.Tensor:
    """The custom op when compiling or when feat needs a grad; else its body directly (the
    dispatcher costs microseconds)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and feat.requires_grad):
        return torch.ops.mu_space.bev_pool_rows(feat, cells, list(grid), backend)
    return _pool_native(None, feat, None, None, cells, grid, backend)


def _native_unsupported(feat: torch.Tensor, grid: Grid) -> str | None:
    if feat.dtype not in NATIVE_DTYPES:
        return (
            f"feat dtype {dtype_name(feat.dtype)} has no native kernel (float32, float16, bfloat16)"
        )
    if grid.n_cells >= INT32_LIMIT:
        return f"B*Z*Y*X = {grid.n_cells} cells do not fit the native kernels' int32 ranks"
    return None


@torch.compiler.assume_constant_result
def _traced_choice(op: str, backend: str, device: str, unsupported: str | None) -> bool:
    # Under torch.compile the choice is made once, at trace time, and baked into the graph
    # (dynamo cannot trace the library loader's lock); the primitives are custom ops in it.
    return kernel_dispatch.use_native(op, backend, torch.device(device), unsupported)


def _use_native(op: str, backend: str, feat: torch.Tensor, grid: Grid, n_points: int) -> bool:
    """Backend choice (recorded); empty problems always take the reference path."""
    unsupported = _native_unsupported(feat, grid)
    if torch.compiler.is_compiling():
        native_ok = _traced_choice(op, backend, str(feat.device), unsupported)
    else:
        native_ok = kernel_dispatch.use_native(op, backend, feat.device, unsupported)
    return native_ok and n_points > 0 and grid.C > 0 and grid.n_cells > 0


# ------------------------------------------------------------------ bev_pool_v3


def _check_rank(t, name: str, n: int | None, ref: torch.Tensor) -> None:
    check_tensor(t, name)
    check_same_device(t, name, ref, "feat")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got {t.dim()}-D")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}.shape[0] must be {n} (the length of ranks_bev), got {t.shape[0]}")


def _check_v3(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape) -> Grid:
    grid = _grid(bev_feat_shape)
    _check_floating(feat, "feat")
    if feat.dim() == 0 or feat.shape[-1] != grid.C:
        raise ValueError(
            f"feat must have C = bev_feat_shape[4] = {grid.C} channels in its last "
            f"dim, got shape {tuple(feat.shape)}"
        )
    check_tensor(ranks_bev, "ranks_bev")
    check_same_device(ranks_bev, "ranks_bev", feat, "feat")
    if ranks_bev.dim() == 2:
        if ranks_bev.shape[1] != 4:
            raise ValueError(
                f"ranks_bev.shape[1] must be 4 (h, w, d, b) when 2-D, got {ranks_bev.shape[1]}"
            )
        if ranks_bev.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"ranks_bev must be int32 or int64 when 2-D, got {dtype_name(ranks_bev.dtype)}"
            )
    else:
        _check_rank(ranks_bev, "ranks_bev", None, feat)
    n = ranks_bev.shape[0]
    if (depth is None) != (ranks_depth is None):
        raise ValueError(
            "depth and ranks_depth must be given together (or both None), got "
            f"depth={'None' if depth is None else 'Tensor'}, "
            f"ranks_depth={'None' if ranks_depth is None else 'Tensor'}"
        )
    if depth is not None:
        _check_floating(depth, "depth")
        check_same_device(depth, "depth", feat, "feat")
        if depth.dtype != feat.dtype:
            raise TypeError(
                f"depth must have the dtype of feat ({dtype_name(feat.dtype)}), "
                f"got {dtype_name(depth.dtype)}"
            )
        _check_rank(ranks_depth, "ranks_depth", n, feat)
        if ranks_feat is None:
            raise ValueError("ranks_feat must be given when depth is given")
    if ranks_feat is not None:
        _check_rank(ranks_feat, "ranks_feat", n, feat)
    elif feat.dim() != 2 or feat.shape[0] != n:
        raise ValueError(
            f"feat must be [n, C] = [{n}, {grid.C}] (one row per point) when "
            f"ranks_feat is None, got shape {tuple(feat.shape)}"
        )
    return grid


def _first_bad(index: torch.Tensor, limit: int):
    bad = (index < 0) | (index >= limit)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        return i, int(index[i])
    return None


def _validate_ranks(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid: Grid) -> None:
    """validate=True: the first out-of-range index as an IndexError (synchronises)."""
    checks = []
    if ranks_bev.dim() == 2:
        limits = (grid.Y, grid.X, grid.Z, grid.B)
        checks += [
            (ranks_bev[:, k], f"ranks_bev[:, {k}]", limits[k], ("h", "w", "d", "b")[k])
            for k in range(4)
        ]
    else:
        checks.append((ranks_bev, "ranks_bev", grid.n_cells, "B*Z*Y*X"))
    if ranks_depth is not None:
        checks.append((ranks_depth, "ranks_depth", depth.numel(), "depth.numel()"))
    if ranks_feat is not None:
        checks.append(
            (ranks_feat, "ranks_feat", feat.numel() // max(grid.C, 1), "feat.numel() / C")
        )
    for index, name, limit, what in checks:
        hit = _first_bad(index, limit)
        if hit is not None:
            raise IndexError(f"{name}[{hit[0]}] = {hit[1]} is out of range [0, {limit}) ({what})")


def _cells_of(ranks_bev: torch.Tensor, grid: Grid) -> torch.Tensor:
    if ranks_bev.dim() == 2:
        return _coords_to_cells(ranks_bev, (grid.B, grid.Z, grid.Y, grid.X))
    return ranks_bev


def bev_pool_v3_reference(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape):
    """PyTorch reference of `bev_pool_v3` (same arguments; CPU or GPU; float64 capable)."""
    grid = _check_v3(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape)
    return _pool_reference(depth, feat, ranks_depth, ranks_feat, _cells_of(ranks_bev, grid), grid)


def bev_pool_v3(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    *,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """BEV pooling from unsorted ranks (DrivingSDK `bev_pool_v3`) -> Tensor[B, C, Z, Y, X].

    See the module docstring for the formula, shapes, v1 mode and what differs from DrivingSDK.
    Out-of-range indices are dropped; `validate=True` raises IndexError for them instead.
    Backward: grads for depth and feat (feat only in v1 / no-depth mode).
    """
    grid = _check_v3(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape)
    if validate:
        _validate_ranks(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid)
    cells = _cells_of(ranks_bev, grid)
    if _use_native(OP, backend, feat, grid, ranks_bev.shape[0]):
        if depth is None and ranks_feat is None:  # v1 mode: each feat row has one cell
            return _pool_rows_native(feat, cells, grid, backend)
        return _pool_native(depth, feat, ranks_depth, ranks_feat, cells, grid, backend)
    return _pool_reference(depth, feat, ranks_depth, ranks_feat, cells, grid)


# ------------------------------------------------------------------ registry


def _self_check_cases(device: torch.device) -> list[registry.SelfCheckCase]:
    from mu_space.testing import bev_pool_inputs

    cases = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        a = bev_pool_inputs.bevdet_ranks("tiny", batch=2, dtype=dtype, device=device, shuffle=True)
        cases.append(
            registry.SelfCheckCase(
                f"tiny B=2 shuffled {dtype_name(dtype)}",
                (
                    a["depth"],
                    a["feat"],
                    a["ranks_depth"],
                    a["ranks_feat"],
                    a["ranks_bev"],
                    a["bev_feat_shape"],
                ),
                atol=tol,
                rtol=tol,
                backward=dtype == torch.float32,
            )
        )
    v1 = bev_pool_inputs.bevfusion_inputs("tiny", batch=2, device=device, keep_out_of_range=True)
    shape = (v1["B"], v1["D"], v1["H"], v1["W"], v1["feats"].shape[1])
    cases.append(
        registry.SelfCheckCase(
            "tiny v1 mode (coords, out-of-range kept)",
            (None, v1["feats"], None, None, v1["coords"].int(), shape),
            atol=1e-5,
            rtol=1e-5,
            backward=True,
        )
    )
    return cases


registry.register(
    registry.OperatorSpec(
        name=OP,
        family="bev",
        api=bev_pool_v3,
        reference=bev_pool_v3_reference,
        native_entry_points=_NATIVE_ENTRY_POINTS,
        self_check_cases=_self_check_cases,
        dtypes=("float32", "float16", "bfloat16"),
        backward="native",
        upstream="DrivingSDK bev_pool_v3",
        models="BEVDet, BEVDepth, BEVFusion (DrivingSDK recipes)",
        doc="docs/operators/bev_pool_v3.md",
    )
)
