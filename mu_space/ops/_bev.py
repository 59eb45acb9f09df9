"""BEV pooling family helpers: the argument rules every BEV op shares (one rule, one message),
the cell arithmetic, and the vectorised reference pooling that bev_pool_v3, bev_pool and
bev_pool_rows share. Operator modules import these; no op imports another op's private names."""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops._tensor_cache import TensorKeyedCache
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

INT32_MAX = 2**31 - 1  # int32 ranks / cells address at most this many


class Grid(NamedTuple):
    """(B, Z, Y, X) cell counts of a BEV output [B, C, Z, Y, X] and its channel count C."""

    B: int
    Z: int
    Y: int
    X: int
    C: int

    @property
    def n_cells(self) -> int:
        return self.B * self.Z * self.Y * self.X


class _FrustumRanks(TensorKeyedCache):
    """(ranks_depth, ranks_feat) pairs known to be in the frustum layout of a depth
    [B, N, D, H, W]: every valid point has its own depth entry and its ray's feat row. The
    prepare ops (reference and native, padded too) build only such ranks and record them here,
    so bev_pool_v2's backward runs its atomic-free kernels with no irregular-point pass to
    read back: one path for the default and the deterministic mode. Hand-made ranks are not
    recorded (the backward checks them on the device). An entry holds while both tensors live
    and neither is modified in place (version counters)."""

    def add(self, ranks_depth, ranks_feat, layout) -> None:
        self.store((ranks_depth, ranks_feat), tuple(layout), True)

    def holds(self, ranks_depth, ranks_feat, layout) -> bool:
        return self.lookup((ranks_depth, ranks_feat), tuple(layout)) is not None


FRUSTUM_RANKS = _FrustumRanks()


def as_int(value, name: str) -> int:
    """A non-negative int from an int or a 0-d integer tensor (BEVFusion passes `self.nx[i]`)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{name} must be >= 0, got {v}")
    return v


_LABELS = ("B", "Z", "Y", "X", "C")


def bev_feat_shape(value, name: str = "bev_feat_shape") -> Grid:
    """The one parser of `bev_feat_shape`: 5 integers (B, Z, Y, X, C), each an int or a 0-d
    integer tensor (a 1-D integer tensor of 5 works too; one on a GPU costs a sync)."""
    if type(value) in (list, tuple, Grid) and len(value) == 5:  # the common case, per call
        b, z, y, x, c = value
        if (
            type(b) is int
            and type(z) is int
            and type(y) is int
            and type(x) is int
            and type(c) is int
            and min(value) >= 0
        ):
            return value if type(value) is Grid else Grid(b, z, y, x, c)
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be 5 integers (B, Z, Y, X, C), got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(
            f"{name} must be 5 integers (B, Z, Y, X, C), got {type(value).__name__}"
        ) from None
    if len(items) != 5:
        raise ValueError(f"{name} must be 5 integers (B, Z, Y, X, C), got {len(items)} values")
    return Grid(*(as_int(v, f"{name}[{i}] ({_LABELS[i]})") for i, v in enumerate(items)))


def check_cells_fit_int32(grid: Grid, name: str = "bev_feat_shape") -> None:
    """Flat cells are int32 (ranks_bev): the grid must have at most INT32_MAX cells."""
    if grid.n_cells > INT32_MAX:
        raise ValueError(
            f"{name}: B*Z*Y*X = {grid.B}*{grid.Z}*{grid.Y}*{grid.X} = {grid.n_cells} cells "
            f"exceeds the int32 range of ranks_bev ({INT32_MAX})"
        )


def check_floating(t, name: str) -> None:
    check_tensor(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {dtype_name(t.dtype)}")


def check_ranks(
    t,
    name: str,
    ref: torch.Tensor,
    n: int | None = None,
    n_of: str = "ranks_bev",
    ref_name: str = "feat",
) -> None:
    """An int32 1-D index tensor on ref's device, of length n when given."""
    check_tensor(t, name)
    check_same_device(t, name, ref, ref_name)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got {t.dim()}-D")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}.shape[0] must be {n} (the length of {n_of}), got {t.shape[0]}")


def check_depth_pair(depth, ranks_depth) -> None:
    if (depth is None) != (ranks_depth is None):
        raise ValueError(
            "depth and ranks_depth must be given together (or both None), got "
            f"depth={'None' if depth is None else 'Tensor'}, "
            f"ranks_depth={'None' if ranks_depth is None else 'Tensor'}"
        )


def check_depth(depth, feat) -> None:
    check_floating(depth, "depth")
    check_same_device(depth, "depth", feat)
    if depth.dtype != feat.dtype:
        raise TypeError(
            f"depth must have the dtype of feat ({dtype_name(feat.dtype)}), got "
            f"{dtype_name(depth.dtype)}"
        )


def feat_rows(feat: torch.Tensor) -> int:
    """Rows of feat viewed as [-1, C] (also when C = 0)."""
    n = 1
    for s in feat.shape[:-1]:
        n *= s
    return n


def first_bad_index(index: torch.Tensor, limit: int):
    """(position, value) of the first entry outside [0, limit), or None (synchronises)."""
    bad = (index < 0) | (index >= limit)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        return i, int(index[i])
    return None


# ------------------------------------------------------------------ cells from coordinates

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


def coords_to_cells(coords: torch.Tensor, dims: tuple[int, int, int, int]) -> torch.Tensor:
    """Flat cells of `coords[n, 4] = (h, w, d, b)` in a (B, D, H, W) grid.

        cell = ((b*D + d)*H + h)*W + w,   -1 where any coordinate is outside its dimension

    (a per-column check: a w == W must not wrap into the next row). int32 cells when the grid
    fits int32 (what the native kernels take), else int64. Six elementwise kernels over coords,
    no host sync (docs/operators/bev_pool.md: a fused kernel would read coords once).
    """
    B, D, H, W = dims
    n_cells = B * D * H * W
    small = n_cells <= INT32_MAX
    ct = torch.int32 if coords.dtype == torch.int32 and small else torch.int64  # compute dtype
    c = coords if coords.dtype == ct else coords.to(ct)
    lo, hi, strides = _cell_constants(dims, ct, c.device)
    clamped = torch.clamp(c, min=lo, max=hi)
    bad = (clamped != c).any(dim=1)
    # clamped values (and so every partial product) are < n_cells: int32 output is exact
    cells = (clamped * strides).sum(dim=1, dtype=torch.int32 if small else torch.int64)
    return cells.masked_fill_(bad, -1)


# ------------------------------------------------------------------ reference pooling


def pool_reference(depth, feat, ranks_depth, ranks_feat, cells, grid: Grid) -> torch.Tensor:
    """Vectorised PyTorch pooling of checked inputs (float32 accumulation, float64 kept):

        out[b, c, z, y, x] = sum over points i with cells[i] == cell of
                             depth.flat[ranks_depth[i]] * feat_rows[ranks_feat[i], c]

    (row i when ranks_feat is None, weight 1 when depth is None). Invalid points (cell outside
    [0, n_cells), a rank outside its tensor) go to a scratch row that is dropped: no
    data-dependent shape (torch.compile(fullgraph=True) works) and no out-of-bounds gather.
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


def row_gather_grad(grad_out: torch.Tensor, cells: torch.Tensor, grid: Grid) -> torch.Tensor:
    """grad of feat[n, C] when point i adds row i to cells[i] with weight 1 (each row used once):

        grad[i] = grad_out[b, :, z, y, x] of cells[i],   0 for a cell outside [0, B*Z*Y*X)

    grad_out goes channels-last once (into a buffer with a trailing zero row for the dropped
    points), then one row gather: no atomics, no float32 scratch, no sort; exact in every dtype.
    """
    B, Z, Y, X, C = grid
    n_cells = grid.n_cells
    rows = grad_out.new_empty(n_cells + 1, C)
    rows[:n_cells].view(B, Z, Y, X, C).copy_(grad_out.permute(0, 2, 3, 4, 1))
    rows[n_cells].zero_()
    return rows.index_select(0, torch.where((cells >= 0) & (cells < n_cells), cells, n_cells))


# ------------------------------------------------------------------ bev_pool's own kernels

# csrc/bev/bev_pool_musa.mu (the fused cells, the sort's runs and the row-gather backward):
# verified on an H200 (2026-12-01, kernels of e056a11): the GPU suite of the BEV family, memcheck
# and racecheck clean over their native tests (the 1.8M-point BEVFusion cases left out of the
# sanitizers only). "" lets `auto` take them; a reason string here would send `auto` back to the
# PyTorch steps (MUSPACE_TRY_UNVERIFIED=1 runs the kernels regardless).
NATIVE_STEPS_UNVERIFIED = ""


def native_steps_allowed() -> bool:
    from mu_space.ops import _opdef

    return _opdef.step_allowed(NATIVE_STEPS_UNVERIFIED)


def _native_cells(coords: torch.Tensor, dims: tuple[int, int, int, int]) -> torch.Tensor:
    from mu_space.ops import _opdef

    coords = coords.contiguous()
    cells = _opdef.new_output(coords, (coords.shape[0],), torch.int32)
    native.function("bev_pool_cells_forward")(coords, cells, *dims, stream_handle(coords))
    return cells


def _native_row_grad(grad_out: torch.Tensor, cells: torch.Tensor, grid: Grid) -> torch.Tensor:
    from mu_space.ops import _opdef

    B, Z, Y, X, C = grid
    grad_out = grad_out.contiguous()
    cells = cells.contiguous()
    rows = grad_out.new_empty(grid.n_cells, C)  # scratch: grad_out channels-last
    grad_feat = _opdef.new_output(grad_out, (cells.shape[0], C), grad_out.dtype)
    native.function("bev_pool_rows_backward")(
        grad_out, cells, rows, grad_feat, stream_handle(grad_out)
    )
    return grad_feat


class SortedRuns(NamedTuple):
    """The kept points (cells in [0, n_cells)) sorted by cell, ties by index (int32 1-D):
    order (their indices), ranks_bev (their cells) and the runs of equal cells."""

    order: torch.Tensor
    ranks_bev: torch.Tensor
    interval_starts: torch.Tensor
    interval_lengths: torch.Tensor


def _sort_keys(cells: torch.Tensor, n_cells: int) -> torch.Tensor:
    """int32 keys that sort like the cells: int64 cells clamped to [-1, n_cells] (both ends
    dropped alike)."""
    if cells.dtype == torch.int32:
        return cells
    return cells.clamp(-1, n_cells).to(torch.int32)


def sort_runs_reference(cells: torch.Tensor, n_cells: int) -> SortedRuns:
    """PyTorch version of the native sort + runs step (a stable sort, then the runs)."""
    keys, perm = torch.sort(_sort_keys(cells, n_cells), stable=True)
    kept = (keys >= 0) & (keys < n_cells)
    keys, perm = keys[kept], perm[kept]
    _, lengths = torch.unique_consecutive(keys, return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    i32 = torch.int32
    return SortedRuns(perm.to(i32), keys.to(i32), starts.to(i32), lengths.to(i32))


def _native_sort_runs(cells: torch.Tensor, n_cells: int, pad: bool = True) -> SortedRuns:
    """The platform's stable radix sort (torch.sort: CUB's onesweep under CUDA, torch_musa's
    under MUSA) of int32 cell keys, then bev_pool_runs_from_sorted. pad (when n + n_cells <=
    2**31): full-size outputs whose tails hold bev_pool_prepare_padded's padding (which
    bev_pool_v2 skips), no host synchronisation; otherwise one (the two counts) and exact
    sizes."""
    from mu_space.ops import _opdef

    keys, perm = torch.sort(_sort_keys(cells.contiguous(), n_cells), stable=True)
    n = keys.shape[0]
    cap = min(n, n_cells)
    pad = pad and n + n_cells <= INT32_MAX + 1
    order, ranks_bev = (_opdef.new_output(keys, (n,), torch.int32) for _ in range(2))
    starts, lengths = (_opdef.new_output(keys, (cap,), torch.int32) for _ in range(2))
    header = torch.empty(2, dtype=torch.int32, device=keys.device)
    ints = int(native.function("bev_pool_runs_workspace_ints")(n))
    workspace = torch.empty(ints, dtype=torch.int32, device=keys.device)
    native.function("bev_pool_runs_from_sorted")(
        keys,
        perm,
        n_cells,
        workspace,
        order,
        ranks_bev,
        starts,
        lengths,
        header,
        int(pad),
        stream_handle(keys),
    )
    if pad:
        return SortedRuns(order, ranks_bev, starts, lengths)
    k, m = header.tolist()  # the host synchronisation: the output sizes
    return SortedRuns(order[:k], ranks_bev[:k], starts[:m], lengths[:m])


def native_steps():
    """bev_pool's own kernels, with the arguments of their PyTorch versions:
    (cells(coords, dims) like coords_to_cells (int32), row_grad(grad_out, cells, grid) like
    row_gather_grad, sort_runs(cells, n_cells) like sort_runs_reference, natively with padded
    tails and no host synchronisation where the sizes allow). Tests substitute the PyTorch
    versions on CPU."""
    return _native_cells, _native_row_grad, _native_sort_runs


def pool_rows_by_sorted_runs(feat: torch.Tensor, cells: torch.Tensor, grid: Grid) -> torch.Tensor:
    """bev_pool_rows' native forward: the sort + runs step, then bev_pool_v2 without depth:

    order, ranks_bev, starts, lengths = sort_runs(cells, n_cells)
    bev_pool_v2(None, feat, None, order, ranks_bev, grid, starts, lengths)
    """
    _, bev_pool_v2 = primitives()
    r = native_steps()[2](cells, grid.n_cells)
    return bev_pool_v2(
        None,
        feat,
        None,
        r.order,
        r.ranks_bev,
        tuple(grid),
        r.interval_starts,
        r.interval_lengths,
        backend="native",
    )


# ------------------------------------------------------------------ the sort-and-pool composition


def primitives():
    """The two native primitives the composite BEV ops are made of (tests substitute CPU fakes
    written from their contracts here)."""
    from mu_space.ops.bev_pool_prepare import sort_by_cell
    from mu_space.ops.bev_pool_v2 import bev_pool_v2

    return sort_by_cell, bev_pool_v2


def pool_by_sorting(depth, feat, ranks_depth, ranks_feat, cells, grid: Grid, backend: str):
    """sort_by_cell + permuted ranks + bev_pool_v2 (whose autograd gives the backward):

    order, starts, lengths = sort_by_cell(cells, n_cells)      (out-of-range cells dropped)
    bev_pool_v2(depth, feat, ranks_depth[order], ranks_feat[order] (or order),
                cells[order], grid, starts, lengths)
    """
    sort_by_cell, bev_pool_v2 = primitives()
    s = sort_by_cell(cells, grid.n_cells, backend=backend)
    order = s.order
    ranks_bev = cells[order]
    if ranks_bev.dtype != torch.int32:  # values < n_cells <= INT32_MAX (checked by the caller)
        ranks_bev = ranks_bev.to(torch.int32)
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
