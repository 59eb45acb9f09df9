"""`bev_pool_v2`: BEVDet's camera-to-BEV pooling ("voxel pooling v2"). Formula, shapes and
upstream compatibility: the public function's docstring; design and measured numbers:
docs/operators/bev_pool_v2.md.

Native path:
- forward: a zero fill of the output, then one kernel, deterministic (no atomics), load-balanced
  by points. It sums the runs of equal ranks_bev, which is what the interval arrays describe; it
  does not read them (so inconsistent intervals are not caught there: `validate=True` checks
  them).
- backward for the frustum layout (depth [B, N, D, H, W], feat [B, N, H, W, C], ranks as
  `bev_pool_prepare` builds them; at most 32 channel vectors per row): grad_feat of each feat
  row is a gather over its D depth entries, grad_depth of each entry a dot product, each
  written once with fixed-order sums: no atomics, bit-identical reruns, no host sync. Points
  outside that layout (a repeated ranks_depth, ranks_feat not the ray's row: hand-made ranks)
  are found by a last pass: the default mode adds them with float32 atomics; under
  `torch.use_deterministic_algorithms(True)` a flag read (one host synchronisation) sends such
  calls to the sorted path below. Ranks that bev_pool_prepare / bev_pool_prepare_padded built
  are recorded as in the layout (_bev.FRUSTUM_RANKS): for them that pass is skipped and both
  modes are one path, bit-identical, with nothing read back.
- backward otherwise (depth=None, other shapes, wide C), default: grad_depth and grad_feat are
  accumulated with float32 atomics into float32 buffers (cast once for float16 / bfloat16). A
  grad_depth element receives one add per point that indexes it, so with unique ranks_depth it
  is exact and identical between runs; grad_feat's float32 rounding may differ between runs.
- backward otherwise, under `torch.use_deterministic_algorithms(True)`: grad_depth as in the
  default mode when no depth entry is indexed by 3 or more points (then 0 + a + b has the same
  bits in any order; checked once per ranks_depth tensor), else from per-point dot products
  summed by torch's deterministic index_add; grad_feat groups the points by ranks_feat with
  `sort_by_cell` and sums each feat row in a fixed order, with no atomics. Bit-identical between
  runs. The sort's output size depends on the data, so this mode synchronises with the host
  once per backward.
- no host synchronisation in forward or default backward; kernels run on the caller's current
  stream (CUDA-graph capturable).

Safety: an out-of-range or negative rank never reads or writes out of bounds (the kernels skip
such points; out-of-range cells are dropped); unsorted ranks_bev gives unspecified values but
stays in bounds.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mu_space.ops import _bev, _opdef
from mu_space.ops._checks import check_tensor, dtype_name
from mu_space.ops.bev_pool_prepare import sort_by_cell
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = (*NATIVE_DTYPES, torch.float64)
ENTRY_POINTS = (
    "bev_pool_v2_forward",
    "bev_pool_v2_backward_frustum",
    "bev_pool_v2_backward",
    "bev_pool_v2_backward_feat_sorted",
)

# Profiling-only knob: points per block of the native kernels (0 = the launch policy's choice).
_POINTS_PER_BLOCK = int(os.environ.get("MUSPACE_BEV_POOL_V2_POINTS_PER_BLOCK", "0") or 0)


# --------------------------------------------------------------------------- validation


def _check_args(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
) -> _opdef.Checked:
    """Argument checks (no host synchronisation); info = (the Grid (B, Z, Y, X, C), n_points)."""
    grid = _bev.bev_feat_shape(bev_feat_shape)
    _bev.check_cells_fit_int32(grid)
    check_tensor(feat, "feat")
    if feat.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"feat must be float32, float16, bfloat16 or float64, got {dtype_name(feat.dtype)}"
        )
    if feat.dim() < 2 or feat.shape[-1] != grid.C:
        raise ValueError(
            f"feat must be [..., C] with C = bev_feat_shape[4] = {grid.C}, got shape "
            f"{tuple(feat.shape)}"
        )
    _bev.check_depth_pair(depth, ranks_depth)
    _bev.check_ranks(ranks_bev, "ranks_bev", feat)
    n = ranks_bev.shape[0]
    _bev.check_ranks(ranks_feat, "ranks_feat", feat, n)
    if depth is not None:
        _bev.check_depth(depth, feat)
        _bev.check_ranks(ranks_depth, "ranks_depth", feat, n)
    _bev.check_ranks(interval_starts, "interval_starts", feat)
    _bev.check_ranks(
        interval_lengths, "interval_lengths", feat, interval_starts.shape[0], n_of="interval_starts"
    )
    B, Z, Y, X, C = grid
    return _opdef.Checked(
        feat.device, feat.dtype, (((B, C, Z, Y, X), feat.dtype),), (grid, n), "feat"
    )


def _grid(*args) -> _bev.Grid:
    """The checked (B, Z, Y, X, C) of bev_pool_v2's arguments."""
    return _check_args(*args).info[0]


def _first(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0, 0]) if idx.numel() else None


def _check_index_ranges(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid) -> None:
    checks = [
        ("ranks_bev", ranks_bev, grid.n_cells),
        ("ranks_feat", ranks_feat, _bev.feat_rows(feat)),
    ]
    if depth is not None:
        checks.append(("ranks_depth", ranks_depth, depth.numel()))
    for name, t, hi in checks:
        i = _first((t < 0) | (t >= hi))
        if i is not None:
            raise IndexError(f"{name}[{i}] = {int(t[i])} is out of range [0, {hi})")


def _check_runs(ranks_bev, interval_starts, interval_lengths) -> None:
    """ValueError unless ranks_bev is sorted and the intervals are exactly its runs."""
    n = ranks_bev.shape[0]
    starts, lengths = interval_starts.long(), interval_lengths.long()
    k = _first((starts < 0) | (starts >= n))
    if k is not None:
        raise IndexError(f"interval_starts[{k}] = {int(starts[k])} is out of range [0, {n})")
    k = _first((lengths < 1) | (starts + lengths > n))
    if k is not None:
        raise IndexError(
            f"interval_lengths[{k}] = {int(lengths[k])}: the interval "
            f"[{int(starts[k])}, {int(starts[k] + lengths[k])}) is empty or exceeds "
            f"the {n} points"
        )
    rb = ranks_bev.long()
    i = _first(rb[1:] < rb[:-1])
    if i is not None:
        raise ValueError(
            f"ranks_bev must be sorted ascending: ranks_bev[{i + 1}] = {int(rb[i + 1])} "
            f"< ranks_bev[{i}] = {int(rb[i])}"
        )
    run_start = torch.ones(n, dtype=torch.bool, device=rb.device)
    run_start[1:] = rb[1:] != rb[:-1]
    want_starts = torch.nonzero(run_start).squeeze(1)
    want_lengths = torch.diff(want_starts, append=torch.tensor([n], device=rb.device))
    if (
        starts.shape != want_starts.shape
        or not bool((starts == want_starts).all())
        or not bool((lengths == want_lengths).all())
    ):
        k = 0
        m = min(starts.shape[0], want_starts.shape[0])
        if m:
            diff = (starts[:m] != want_starts[:m]) | (lengths[:m] != want_lengths[:m])
            k = _first(diff) if bool(diff.any()) else m
        raise ValueError(
            f"interval_starts / interval_lengths must be the runs of equal ranks_bev "
            f"({want_starts.shape[0]} runs, got {starts.shape[0]} intervals); first "
            f"difference at interval {k}"
        )


def validate_inputs(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
) -> None:
    """Host-side checks of the index arrays (synchronises): IndexError naming the array and the
    first bad index for out-of-range values; ValueError when ranks_bev is not sorted or the
    intervals are not its runs."""
    grid = _grid(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    _check_index_ranges(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid)
    _check_runs(ranks_bev, interval_starts, interval_lengths)


def _precondition(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
) -> str | None:
    """The documented case of an unspecified (but in-bounds) result: ranks_bev unsorted or
    intervals that are not its runs (the kernels follow the runs, the reference the intervals)."""
    try:
        _check_runs(ranks_bev, interval_starts, interval_lengths)
    except (IndexError, ValueError) as exc:
        return str(exc)
    return None


def _supports(c: _opdef.Checked) -> str | None:
    grid, n = c.info
    if n > (limit := native.limit("bev_pool_v2.max_points")):
        return f"{n} points exceed the native kernels' limit of {limit}"
    if grid.C > (limit := native.limit("bev_pool_v2.max_channels")):
        return f"C = {grid.C} exceeds the native kernels' limit of {limit} channels"
    if grid.n_cells > (limit := native.limit("bev_pool_v2.max_cells")):
        return f"B*Z*Y*X = {grid.n_cells} cells exceed the native kernels' limit of {limit}"
    return None


# --------------------------------------------------------------------------- reference


class _Points(NamedTuple):
    """The points the reference pools, expanded from the intervals (bad entries masked)."""

    cell: torch.Tensor  # long [total], the interval's cell (ranks_bev at its start)
    row: torch.Tensor  # long [total], ranks_feat, 0 where invalid
    weight_index: torch.Tensor | None  # long [total], ranks_depth, 0 where invalid
    valid: torch.Tensor  # bool [total]
    n_cells: int


def _expand_points(
    depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, interval_starts, interval_lengths
) -> _Points:
    B, Z, Y, X, C = shape
    device = feat.device
    n_cells = B * Z * Y * X
    n = ranks_bev.shape[0]
    starts, lengths = interval_starts.long(), interval_lengths.long()
    ok = (starts >= 0) & (lengths > 0) & (starts + lengths <= n)
    first = ranks_bev.long()[torch.where(ok, starts, 0)] if n else torch.zeros_like(starts)
    ok = ok & (first >= 0) & (first < n_cells)
    lengths = torch.where(ok, lengths, 0)
    total = int(lengths.sum()) if lengths.numel() else 0  # host sync (reference path only)
    seg = torch.repeat_interleave(
        torch.arange(lengths.shape[0], device=device), lengths, output_size=total
    )
    offsets = torch.cumsum(lengths, 0) - lengths
    pos = starts[seg] + torch.arange(total, device=device) - offsets[seg]
    row = ranks_feat.long()[pos]
    valid = (row >= 0) & (row < math.prod(feat.shape[:-1]))
    widx = None
    if depth is not None:
        widx = ranks_depth.long()[pos]
        valid = valid & (widx >= 0) & (widx < depth.numel())
        widx = torch.where(valid, widx, 0)
    return _Points(first[seg], torch.where(valid, row, 0), widx, valid, n_cells)


def bev_pool_v2_reference(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
) -> torch.Tensor:
    """Vectorised PyTorch bev_pool_v2 (CPU or GPU, float64 capable, differentiable).

    Follows the interval arrays like BEVDet's kernel: interval k adds its points to the cell
    ranks_bev[interval_starts[k]]. Bad entries are skipped, never read out of bounds: intervals
    outside [0, n_points) or empty, cells outside the grid, points with an out-of-range
    ranks_feat / ranks_depth. Accumulates in float32 (float64 for float64 inputs).
    """
    shape = _grid(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    B, Z, Y, X, C = shape
    acc = torch.float64 if feat.dtype == torch.float64 else torch.float32
    p = _expand_points(
        depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, interval_starts, interval_lengths
    )
    zero = torch.zeros((), dtype=acc, device=feat.device)
    rows = feat.reshape(math.prod(feat.shape[:-1]), C)
    if rows.shape[0] == 0:  # then every point is invalid: nothing to gather (keeps the graph)
        vals = torch.zeros(p.row.shape[0], C, dtype=acc, device=feat.device) + rows.sum().to(acc)
    else:
        vals = rows.index_select(0, p.row).to(acc)
    if depth is not None and depth.numel() > 0:
        vals = vals * depth.reshape(-1).index_select(0, p.weight_index).to(acc).unsqueeze(1)
    vals = torch.where(p.valid.unsqueeze(1), vals, zero)
    out = torch.zeros(p.n_cells, C, dtype=acc, device=feat.device).index_add(0, p.cell, vals)
    return out.view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3).to(feat.dtype).contiguous()


def bev_pool_v2_backward_reference(
    grad_out,
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
):
    """(grad_depth or None, grad_feat) of `bev_pool_v2_reference`, computed directly (vectorised;
    float32 accumulation, float64 for float64 inputs):
    grad_feat[ranks_feat[i]] += w_i * g[cell_i],  grad_depth[ranks_depth[i]] += <g[cell_i], feat row>."""
    shape = _grid(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    B, Z, Y, X, C = shape
    acc = torch.float64 if feat.dtype == torch.float64 else torch.float32
    p = _expand_points(
        depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, interval_starts, interval_lengths
    )
    zero = torch.zeros((), dtype=acc, device=feat.device)
    n_rows = math.prod(feat.shape[:-1])
    g = grad_out.to(acc).permute(0, 2, 3, 4, 1).reshape(p.n_cells, C)
    g_pts = torch.where(p.valid.unsqueeze(1), g.index_select(0, p.cell), zero)
    w = None
    if depth is not None:
        w = (
            depth.reshape(-1).to(acc).index_select(0, p.weight_index)
            if depth.numel()
            else torch.zeros(p.row.shape[0], dtype=acc, device=feat.device)
        )
    contrib = g_pts if w is None else g_pts * w.unsqueeze(1)
    grad_feat = torch.zeros(n_rows, C, dtype=acc, device=feat.device).index_add(0, p.row, contrib)
    grad_feat = grad_feat.view(feat.shape).to(feat.dtype)
    if depth is None:
        return None, grad_feat
    rows = feat.reshape(n_rows, C).to(acc)
    dots = (g_pts * rows.index_select(0, p.row)).sum(1) if n_rows else torch.zeros_like(w)
    grad_depth = torch.zeros(depth.numel(), dtype=acc, device=feat.device).index_add(
        0, p.weight_index, torch.where(p.valid, dots, zero)
    )
    return grad_depth.view(depth.shape).to(depth.dtype), grad_feat


# --------------------------------------------------------------------------- native


def _contiguous(*tensors):
    """The entry points take contiguous tensors: a non-contiguous input costs one copy."""
    return tuple(t.contiguous() for t in tensors)


def _forward_native(c, depth, feat, ranks_depth, ranks_feat, ranks_bev, *_intervals):
    B, Z, Y, X, C = c.info[0]
    feat, ranks_feat, ranks_bev = _contiguous(feat, ranks_feat, ranks_bev)
    if depth is not None:
        depth, ranks_depth = _contiguous(depth, ranks_depth)
    out = _opdef.new_output(feat, (B, C, Z, Y, X))
    native.function("bev_pool_v2_forward")(
        depth, feat, ranks_depth, ranks_feat, ranks_bev, out, _POINTS_PER_BLOCK, stream_handle(feat)
    )
    return out


_REPEATS: dict = {}  # (id, version, data_ptr, n, numel) -> (weakref, at least 3 points share one)


def _depth_entries_shared_by_3(ranks_depth: torch.Tensor, numel: int) -> bool:
    """Whether 3 or more points index one depth entry. Up to 2 float32 atomic adds onto 0 give
    the same bits in any order (a + b == b + a), so the deterministic mode keeps the atomic
    grad_depth unless this holds (never for `bev_pool_prepare`'s ranks, where every point has its
    own entry). Counted once per ranks_depth tensor and in-place version (one sync), like MSDA's
    level metadata; a change through `.data` is not seen (the sums stay right, only their bits
    could then vary between runs)."""
    try:
        version = ranks_depth._version
    except RuntimeError:  # inference tensors have no version counter
        version = None
    key = (id(ranks_depth), version, ranks_depth.data_ptr(), ranks_depth.numel(), numel)
    hit = _REPEATS.get(key)
    if hit is not None and hit[0]() is ranks_depth:
        return hit[1]
    rd = ranks_depth.long()
    valid = rd[(rd >= 0) & (rd < numel)]
    shared = bool(valid.numel()) and int(torch.bincount(valid, minlength=numel).max()) > 2
    if len(_REPEATS) > 64:
        _REPEATS.clear()
    _REPEATS[key] = (weakref.ref(ranks_depth), shared)
    return shared


def _sum_point_dots(dots, ranks_depth, depth):
    """grad_depth from per-point dot products: a point with an out-of-range rank adds nothing.
    torch's index_add is deterministic under `torch.use_deterministic_algorithms(True)`."""
    numel = depth.numel()
    rd = ranks_depth.long()
    target = torch.where((rd >= 0) & (rd < numel), rd, numel)
    acc = torch.zeros(numel + 1, dtype=torch.float32, device=depth.device).index_add_(
        0, target, dots
    )
    return acc[:numel].view(depth.shape).to(depth.dtype)


def _backward_frustum(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev, deterministic):
    """(grad_depth, grad_feat) by the frustum-layout kernels, or None where they do not apply
    (shapes other than depth [B, N, D, H, W] / feat [B, N, H, W, C], more than 32 channel
    vectors) or, in the deterministic mode, where some point is outside the layout (one host
    synchronisation reads that flag). The default mode adds such points with float32 atomics.
    Ranks the prepare ops built (_bev.FRUSTUM_RANKS) have no such point: both modes then run
    the same launches into feat's dtype, with nothing read back."""
    C = feat.shape[-1]
    regular = _bev.FRUSTUM_RANKS.holds(ranks_depth, ranks_feat, tuple(depth.shape))
    # Every buffer below is written in full by the copy or the kernels: no deterministic-mode
    # fill of them (the deterministic backward took 166-215 us against the default's 42-61 us
    # on the H200, 2026-12-01, with those fills and the same kernels)
    with _opdef.no_fill():
        grad_rows = grad_out.permute(0, 2, 3, 4, 1).reshape(-1, C).contiguous()
    # float32 outputs where atomics may add to them (default mode, ranks not known regular);
    # else feat's dtype directly.
    add_irregular = not (deterministic or regular)
    out_dtype = torch.float32 if add_irregular else feat.dtype
    point_of_depth = _opdef.new_output(depth, (depth.numel(),), torch.int32)
    irregular = None if regular else _opdef.new_output(depth, (1,), torch.int32)
    grad_depth = _opdef.new_output(depth, tuple(depth.shape), out_dtype)
    grad_feat = _opdef.new_output(feat, tuple(feat.shape), out_dtype)
    covered = native.function("bev_pool_v2_backward_frustum")(
        grad_rows,
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        point_of_depth,
        grad_depth,
        grad_feat,
        irregular,
        add_irregular,
        stream_handle(feat),
    )
    if not covered or (deterministic and not regular and bool(irregular[0])):
        return None
    return grad_depth.to(depth.dtype), grad_feat.to(feat.dtype)


def _backward_native(
    c, grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev, *_rest, needs, deterministic
):
    need_depth = needs[0] and depth is not None
    need_feat = needs[1]
    if not need_depth and not need_feat:
        return None, None
    grad_out = grad_out.to(feat.dtype).contiguous()
    feat, ranks_feat, ranks_bev = _contiguous(feat, ranks_feat, ranks_bev)
    if depth is not None:
        depth, ranks_depth = _contiguous(depth, ranks_depth)
        grads = _backward_frustum(
            grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev, deterministic
        )
        if grads is not None:
            return (grads[0] if need_depth else None), (grads[1] if need_feat else None)
    # Not covered by the frustum kernels: without depth (no ranks_depth, so no frustum entry of
    # a point), other shapes, wide C, or a deterministic call with points outside the layout.
    stream = stream_handle(feat)
    backward = native.function("bev_pool_v2_backward")
    f32 = torch.float32
    grad_depth = grad_feat = None
    if deterministic or not need_feat:
        if need_depth and deterministic and _depth_entries_shared_by_3(ranks_depth, depth.numel()):
            dots = torch.empty(ranks_bev.shape[0], dtype=f32, device=feat.device)
            backward(
                grad_out,
                depth,
                feat,
                ranks_depth,
                ranks_feat,
                ranks_bev,
                None,
                dots,
                None,
                _POINTS_PER_BLOCK,
                stream,
            )
            grad_depth = _sum_point_dots(dots, ranks_depth, depth)
        elif need_depth:
            acc = torch.zeros(depth.shape, dtype=f32, device=feat.device)
            backward(
                grad_out,
                depth,
                feat,
                ranks_depth,
                ranks_feat,
                ranks_bev,
                acc,
                None,
                None,
                _POINTS_PER_BLOCK,
                stream,
            )
            grad_depth = acc.to(depth.dtype)
        if need_feat:
            C = feat.shape[-1]
            grad_rows = grad_out.permute(0, 2, 3, 4, 1).reshape(-1, C).contiguous()
            order = sort_by_cell(ranks_feat, _bev.feat_rows(feat), backend="native").order
            grad_feat = _opdef.new_output(feat)
            native.function("bev_pool_v2_backward_feat_sorted")(
                grad_rows,
                depth,
                ranks_depth,
                ranks_feat,
                ranks_bev,
                order,
                grad_feat,
                _POINTS_PER_BLOCK,
                stream,
            )
    else:
        acc_feat = torch.zeros(feat.shape, dtype=f32, device=feat.device)
        acc_depth = torch.zeros(depth.shape, dtype=f32, device=feat.device) if need_depth else None
        backward(
            grad_out,
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            acc_depth,
            None,
            acc_feat,
            _POINTS_PER_BLOCK,
            stream,
        )
        grad_feat = acc_feat.to(feat.dtype)
        grad_depth = acc_depth.to(depth.dtype) if need_depth else None
    return grad_depth, grad_feat


# --------------------------------------------------------------------------- definition


def _make_inputs(config, device, dtype=torch.float32, batch=None):
    """bev_pool_v2 arguments from the realistic camera geometry of `config`."""
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare_reference
    from mu_space.testing import bev_geometry

    g = bev_geometry.make(config, batch=batch, dtype=dtype)
    ranks = bev_pool_prepare_reference(
        g["coor"], g["grid_lower_bound"], g["grid_interval"], g["grid_size"]
    )
    args = (g["depth"], g["feat"], *ranks.bev_pool_v2_args(g["bev_feat_shape"]))
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    tiny = _make_inputs("tiny", device)
    no_points = (tiny[0], tiny[1], *(t[:0] for t in tiny[2:5]), tiny[5], tiny[6][:0], tiny[7][:0])
    return [
        _opdef.Sample("tiny float32 (fwd + bwd)", tiny, grad=True),
        _opdef.Sample("tiny B=2 float16", _make_inputs("tiny", device, torch.float16, 2)),
        _opdef.Sample(
            "tiny bfloat16 (fwd + bwd)", _make_inputs("tiny", device, torch.bfloat16), grad=True
        ),
        _opdef.Sample("tiny without depth", (None, tiny[1], None, *tiny[3:]), grad=True),
        _opdef.Sample(
            "bevdet-r50 float32 (fwd + bwd)", _make_inputs("bevdet-r50", device), grad=True
        ),
        _opdef.Sample("no points", no_points, grad=True),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="bev_pool_v2",
        family="bev",
        schema="(Tensor? depth, Tensor feat, Tensor? ranks_depth, Tensor ranks_feat, "
        "Tensor ranks_bev, int[] bev_feat_shape, Tensor interval_starts, "
        "Tensor interval_lengths) -> Tensor",
        check=_check_args,
        reference=bev_pool_v2_reference,
        native=_forward_native,
        backward=_opdef.Backward(
            inputs=("depth", "feat"),
            reference=bev_pool_v2_backward_reference,
            native=_backward_native,
        ),
        supports=_supports,
        precondition=_precondition,
        native_dtypes=NATIVE_DTYPES,
        entry_points=ENTRY_POINTS,
        samples=_samples,
        upstream="BEVDet `bev_pool_v2`",
        models="BEVDet, BEVDepth, FlashOCC",
        patches=(
            "bevdet.bev_pool_v2",
            "bevfusion.factored_lss.bev_pool",
            "bevfusion.factored_lss.LSSTransform",
            "bevfusion.factored_lss.DepthLSSTransform",
            "bevfusion.factored_lss.mit.bev_pool",
            "bevfusion.factored_lss.mit.LSSTransform",
            "bevfusion.factored_lss.mit.DepthLSSTransform",
        ),
        recipes=("model_examples/BEVDet", "model_examples/BEVFusion"),
        doc="docs/operators/bev_pool_v2.md",
    )
)


@OP.export
def bev_pool_v2(
    depth: torch.Tensor | None,
    feat: torch.Tensor,
    ranks_depth: torch.Tensor | None,
    ranks_feat: torch.Tensor,
    ranks_bev: torch.Tensor,
    bev_feat_shape: Sequence[int],
    interval_starts: torch.Tensor,
    interval_lengths: torch.Tensor,
    *,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """BEVDet's `bev_pool_v2` (same arguments, same result): camera-to-BEV pooling, drop-in for
    `mmdet3d.ops.bev_pool_v2.bev_pool.bev_pool_v2` as BEVDet / BEVDepth / FlashOCC call it.

        out[b, c, z, y, x] = sum over the points i of the interval whose cell is
                             ((b*Z + z)*Y + y)*X + x  of
                             depth.flat[ranks_depth[i]] * feat.flat[ranks_feat[i]*C + c]
        cells without an interval are 0.

    Args:
        depth: Tensor[B, N, D, H, W] float32 / float16 / bfloat16 (float64: reference path),
            indexed flat (any shape works); or None (weights 1, with ranks_depth=None).
        feat: Tensor[B, N, H, W, C], channels last (any shape [..., C]), depth's dtype.
        ranks_depth: Tensor[n_points] int32 (None with depth=None).
        ranks_feat: Tensor[n_points] int32, rows of feat viewed as [-1, C].
        ranks_bev: Tensor[n_points] int32, flat cell of [B, Z, Y, X], sorted ascending; the grid
            must fit int32 (B*Z*Y*X <= 2**31 - 1).
        bev_feat_shape: (B, Z, Y, X, C), 5 integers.
        interval_starts, interval_lengths: Tensor[n_intervals] int32, the runs of equal ranks_bev
            (what `bev_pool_prepare` / BEVDet's `voxel_pooling_prepare_v2` return).
        backend: "auto" | "native" | "cuda" | "musa" | "reference".
        validate: check every index on the host first (one synchronisation): IndexError naming
            the array and the first bad index, ValueError for unsorted ranks_bev or intervals
            that are not its runs.

    Returns:
        Tensor[B, C, Z, Y, X] (channels first, contiguous) in feat's dtype; float32 accumulation
        in every dtype, rounded once. Differentiable w.r.t. depth and feat.

    Argument order is BEVDet's Python API (`interval_starts` before `interval_lengths`; BEVDet's
    C++ binding takes them the other way round). Out-of-range ranks are dropped (never read or
    written out of bounds); `validate=True` raises for them instead. Unsorted ranks_bev gives
    unspecified values. Determinism and host synchronisation: the module docstring.
    """
    shape = list(_bev.bev_feat_shape(bev_feat_shape))
    if validate and not torch.compiler.is_compiling():
        validate_inputs(
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            shape,
            interval_starts,
            interval_lengths,
        )
    return OP(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        shape,
        interval_starts,
        interval_lengths,
        backend=backend,
    )
