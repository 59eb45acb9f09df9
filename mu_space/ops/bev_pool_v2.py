"""`bev_pool_v2`: BEVDet's camera-to-BEV pooling ("voxel pooling v2"), drop-in for
`mmdet3d.ops.bev_pool_v2.bev_pool.bev_pool_v2` as BEVDet / BEVDepth / FlashOCC call it.

    out[b, c, z, y, x] = sum over the points i of the interval whose cell is
                         ((b*Z + z)*Y + y)*X + x  of  depth.flat[ranks_depth[i]] * feat.flat[ranks_feat[i]*C + c]
    cells without an interval are 0.

    depth             Tensor[B, N, D, H, W]  float32 / float16 / bfloat16 (float64: reference path);
                      indexed flat, so any shape works; or None (weights 1)
    feat              Tensor[B, N, H, W, C]  same dtype as depth, channels last (any shape [..., C])
    ranks_depth       Tensor[n_points] int32 (None with depth=None)
    ranks_feat        Tensor[n_points] int32, rows of feat viewed as [-1, C]
    ranks_bev         Tensor[n_points] int32, flat cell of [B, Z, Y, X], sorted ascending
    bev_feat_shape    (B, Z, Y, X, C)
    interval_starts   Tensor[n_intervals] int32, interval_lengths Tensor[n_intervals] int32: the runs
                      of equal ranks_bev (what `bev_pool_prepare` / BEVDet's
                      `voxel_pooling_prepare_v2` return)
    returns           Tensor[B, C, Z, Y, X] (channels first, contiguous) in feat's dtype

Argument order is BEVDet's Python API (`interval_starts` before `interval_lengths`); BEVDet's C++
binding takes the two interval arrays the other way round. `depth=None, ranks_depth=None` pools
feat rows with weight 1 (BEVFusion's `bev_pool`, `bev_pool_v3` use it); grad is then for feat only.

Precision: float32 accumulation in every dtype, output rounded once to the input dtype.

Native path (docs/operators/bev_pool_v2.md has the design and the measured numbers):
- forward: one kernel, deterministic (no atomics), every output element written (no memset),
  load-balanced by points. The kernel sums the runs of equal ranks_bev, which is what the interval
  arrays describe; it does not read them (so inconsistent intervals are not caught there:
  `validate=True` checks them).
- backward, default: grad_depth is one dot product per point (deterministic); grad_feat is
  accumulated with float32 atomics (into a float32 buffer, cast once for float16 / bfloat16), so
  its float32 rounding may differ between runs.
- backward with `torch.use_deterministic_algorithms(True)`: grad_feat groups the points by
  ranks_feat with `bev_pool_prepare.sort_by_cell` and sums each feat row in a fixed order: bit-
  identical between runs, no atomics. The sort's output size depends on the data, so this mode
  synchronises with the host once per backward (the default mode never does).
- no host synchronisation in forward or default backward; kernels run on the caller's current
  stream (CUDA-graph capturable).

Safety: an out-of-range or negative rank never reads or writes out of bounds (the kernels skip
such points; out-of-range cells are dropped); unsorted ranks_bev gives unspecified values but
stays in bounds. `validate=True` checks everything on the host first (one synchronisation) and
raises IndexError naming the array and the first bad index (ValueError for unsorted ranks_bev or
intervals that are not its runs).

`bev_pool_v2_reference` is vectorised PyTorch (gather, multiply, `index_add`), follows the interval
arrays exactly as BEVDet's kernel does, runs on CPU and GPU, in float64 too, and is the fallback.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.runtime.device import stream_handle

OP = "bev_pool_v2"
BACKWARD_OP = "bev_pool_v2_backward"
NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = NATIVE_DTYPES + (torch.float64,)
INT32_MAX = 2**31 - 1
MAX_NATIVE_POINTS = 2**30  # the kernels' int32 point indices keep a margin
ENTRY_POINTS = ("bev_pool_v2_forward", "bev_pool_v2_backward", "bev_pool_v2_backward_feat_sorted")

# Profiling-only knob: points per block of the native kernels (0 = the launch policy's choice).
_POINTS_PER_BLOCK = int(os.environ.get("MUSPACE_BEV_POOL_V2_POINTS_PER_BLOCK", "0") or 0)


# --------------------------------------------------------------------------- validation


def _check_int32(
    t, name: str, ref: torch.Tensor, n: int | None = None, n_of: str = "ranks_bev"
) -> None:
    check_tensor(t, name)
    check_same_device(t, name, ref)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got {t.dim()}-D")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (the length of {n_of}), got {t.shape[0]}")


def _shape(bev_feat_shape) -> tuple[int, int, int, int, int]:
    if isinstance(bev_feat_shape, torch.Tensor):
        bev_feat_shape = bev_feat_shape.tolist()
    try:
        dims = tuple(operator.index(v) for v in bev_feat_shape)
    except TypeError:
        raise TypeError(
            f"bev_feat_shape must be 5 ints (B, Z, Y, X, C), got {bev_feat_shape!r}"
        ) from None
    if len(dims) != 5:
        raise ValueError(f"bev_feat_shape must be 5 ints (B, Z, Y, X, C), got {len(dims)} values")
    if any(d < 0 for d in dims):
        raise ValueError(f"bev_feat_shape must be non-negative, got {dims}")
    return dims


def _check(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
) -> tuple[int, int, int, int, int]:
    """Argument checks (no host synchronisation); returns (B, Z, Y, X, C)."""
    shape = _shape(bev_feat_shape)
    check_tensor(feat, "feat")
    if feat.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"feat must be float32, float16, bfloat16 or float64, got {dtype_name(feat.dtype)}"
        )
    if feat.dim() < 2 or feat.shape[-1] != shape[4]:
        raise ValueError(
            f"feat must be [..., C] with C = bev_feat_shape[4] = {shape[4]}, got shape "
            f"{tuple(feat.shape)}"
        )
    if (depth is None) != (ranks_depth is None):
        raise ValueError(
            "depth and ranks_depth must be given together (or both None), got "
            f"depth={'None' if depth is None else 'Tensor'}, "
            f"ranks_depth={'None' if ranks_depth is None else 'Tensor'}"
        )
    _check_int32(ranks_bev, "ranks_bev", feat)
    n = ranks_bev.shape[0]
    _check_int32(ranks_feat, "ranks_feat", feat, n)
    if depth is not None:
        check_tensor(depth, "depth")
        check_same_device(depth, "depth", feat)
        if depth.dtype != feat.dtype:
            raise TypeError(
                f"depth must have the dtype of feat ({dtype_name(feat.dtype)}), got "
                f"{dtype_name(depth.dtype)}"
            )
        _check_int32(ranks_depth, "ranks_depth", feat, n)
    _check_int32(interval_starts, "interval_starts", feat)
    _check_int32(
        interval_lengths, "interval_lengths", feat, interval_starts.shape[0], n_of="interval_starts"
    )
    return shape


def _first(mask: torch.Tensor) -> int | None:
    idx = torch.nonzero(mask)
    return int(idx[0, 0]) if idx.numel() else None


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
    B, Z, Y, X, C = _check(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    n = ranks_bev.shape[0]
    n_rows = feat.numel() // C if C else 0
    checks = [("ranks_bev", ranks_bev, B * Z * Y * X), ("ranks_feat", ranks_feat, n_rows)]
    if depth is not None:
        checks.append(("ranks_depth", ranks_depth, depth.numel()))
    for name, t, hi in checks:
        i = _first((t < 0) | (t >= hi))
        if i is not None:
            raise IndexError(f"{name}[{i}] = {int(t[i])} is out of range [0, {hi})")
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


def _native_unsupported(feat: torch.Tensor, shape, n_points: int) -> str | None:
    if feat.dtype not in NATIVE_DTYPES:
        return (
            f"feat dtype {dtype_name(feat.dtype)} has no native kernel (float32, float16, bfloat16)"
        )
    B, Z, Y, X, C = shape
    if B * Z * Y * X > INT32_MAX:
        return f"B*Z*Y*X = {B * Z * Y * X} cells exceed the int32 range of ranks_bev"
    if n_points > MAX_NATIVE_POINTS:
        return f"{n_points} points exceed the native kernels' limit of {MAX_NATIVE_POINTS}"
    if C > 2**20:
        return f"C = {C} exceeds the native kernels' limit of {2**20} channels"
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
    shape = _check(
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
    shape = _check(
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


def _forward_native(depth, feat, ranks_depth, ranks_feat, ranks_bev, shape) -> torch.Tensor:
    B, Z, Y, X, C = shape
    feat = feat.contiguous()  # documented: non-contiguous inputs cost one copy
    if depth is not None:
        depth = depth.contiguous()
    out = torch.empty((B, C, Z, Y, X), dtype=feat.dtype, device=feat.device)
    native.function("bev_pool_v2_forward")(
        depth, feat, ranks_depth, ranks_feat, ranks_bev, out, _POINTS_PER_BLOCK, stream_handle(feat)
    )
    return out


def _backward_native(
    grad_out,
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    need_depth: bool,
    need_feat: bool,
    deterministic: bool,
    backend: str,
):
    grad_out = grad_out.to(feat.dtype).contiguous()
    feat = feat.contiguous()
    if depth is not None:
        depth = depth.contiguous()
    stream = stream_handle(feat)
    need_depth = need_depth and depth is not None
    grad_depth = (
        torch.zeros_like(depth, memory_format=torch.contiguous_format) if need_depth else None
    )
    grad_feat = None
    if deterministic or not need_feat:
        if need_depth:  # dot products only: deterministic in both modes
            native.function("bev_pool_v2_backward")(
                grad_out,
                depth,
                feat,
                ranks_depth,
                ranks_feat,
                ranks_bev,
                grad_depth,
                None,
                _POINTS_PER_BLOCK,
                stream,
            )
        if need_feat:
            from mu_space.ops.bev_pool_prepare import sort_by_cell

            C = feat.shape[-1]
            grad_rows = grad_out.permute(0, 2, 3, 4, 1).reshape(-1, C).contiguous()
            order = sort_by_cell(ranks_feat, feat.numel() // C if C else 0, backend=backend).order
            grad_feat = torch.empty_like(feat, memory_format=torch.contiguous_format)
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
        acc = torch.zeros(feat.shape, dtype=torch.float32, device=feat.device)
        native.function("bev_pool_v2_backward")(
            grad_out,
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            grad_depth,
            acc,
            _POINTS_PER_BLOCK,
            stream,
        )
        grad_feat = acc if feat.dtype == torch.float32 else acc.to(feat.dtype)
    return grad_depth, grad_feat


# --------------------------------------------------------------------------- implementations


def _forward(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
    backend: str,
) -> torch.Tensor:
    shape = _check(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    unsupported = _native_unsupported(feat, shape, ranks_bev.shape[0])
    if not kernel_dispatch.use_native(OP, backend, feat.device, unsupported):
        return bev_pool_v2_reference(
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            shape,
            interval_starts,
            interval_lengths,
        )
    return _forward_native(depth, feat, ranks_depth, ranks_feat, ranks_bev, shape)


def _backward(
    grad_out,
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
    need_depth: bool,
    need_feat: bool,
    deterministic: bool,
    backend: str,
):
    """(grad_depth, grad_feat); a grad not needed (or depth=None) is None."""
    shape = _check(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    )
    need_depth = need_depth and depth is not None
    unsupported = _native_unsupported(feat, shape, ranks_bev.shape[0])
    if not kernel_dispatch.use_native(BACKWARD_OP, backend, feat.device, unsupported):
        gd, gf = bev_pool_v2_backward_reference(
            grad_out,
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            shape,
            interval_starts,
            interval_lengths,
        )
        return (gd if need_depth else None), (gf if need_feat else None)
    if not need_depth and not need_feat:
        return None, None
    return _backward_native(
        grad_out,
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        need_depth,
        need_feat,
        deterministic,
        backend,
    )


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("mu_space::bev_pool_v2", mutates_args=())
def _bev_pool_v2_op(
    depth: Optional[torch.Tensor],
    feat: torch.Tensor,
    ranks_depth: Optional[torch.Tensor],
    ranks_feat: torch.Tensor,
    ranks_bev: torch.Tensor,
    bev_feat_shape: list[int],
    interval_starts: torch.Tensor,
    interval_lengths: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    return _forward(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
        backend,
    )


@_bev_pool_v2_op.register_fake
def _(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
    backend,
):
    B, Z, Y, X, C = bev_feat_shape
    return feat.new_empty((B, C, Z, Y, X))


@torch.library.custom_op("mu_space::bev_pool_v2_backward", mutates_args=())
def _bev_pool_v2_backward_op(
    grad_out: torch.Tensor,
    depth: Optional[torch.Tensor],
    feat: torch.Tensor,
    ranks_depth: Optional[torch.Tensor],
    ranks_feat: torch.Tensor,
    ranks_bev: torch.Tensor,
    bev_feat_shape: list[int],
    interval_starts: torch.Tensor,
    interval_lengths: torch.Tensor,
    need_depth: bool,
    need_feat: bool,
    deterministic: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    gd, gf = _backward(
        grad_out,
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
        need_depth,
        need_feat,
        deterministic,
        backend,
    )
    # Custom ops cannot return None: a grad that is not needed comes back as an empty tensor.
    return (
        gd if gd is not None else feat.new_empty(0),
        gf if gf is not None else feat.new_empty(0),
    )


@_bev_pool_v2_backward_op.register_fake
def _(
    grad_out,
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    interval_starts,
    interval_lengths,
    need_depth,
    need_feat,
    deterministic,
    backend,
):
    gd = (
        torch.empty_like(depth, memory_format=torch.contiguous_format)
        if need_depth and depth is not None
        else feat.new_empty(0)
    )
    gf = (
        torch.empty_like(feat, memory_format=torch.contiguous_format)
        if need_feat
        else feat.new_empty(0)
    )
    return gd, gf


def _setup_context(ctx, inputs, output):
    (
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
        backend,
    ) = inputs
    ctx.save_for_backward(
        depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts, interval_lengths
    )
    ctx.bev_feat_shape = list(bev_feat_shape)
    ctx.backend = backend


def _autograd_backward(ctx, grad_out):
    depth, feat, ranks_depth, ranks_feat, ranks_bev, starts, lengths = ctx.saved_tensors
    need_depth = bool(ctx.needs_input_grad[0]) and depth is not None
    need_feat = bool(ctx.needs_input_grad[1])
    gd, gf = torch.ops.mu_space.bev_pool_v2_backward(
        grad_out,
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        ctx.bev_feat_shape,
        starts,
        lengths,
        need_depth,
        need_feat,
        torch.are_deterministic_algorithms_enabled(),
        ctx.backend,
    )
    return (
        gd if need_depth else None,
        gf if need_feat else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_bev_pool_v2_op.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public API


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
    """BEVDet's `bev_pool_v2` (same arguments, same result); see the module docstring.

    Args:
        depth: Tensor[B, N, D, H, W] or None (weights 1).
        feat: Tensor[B, N, H, W, C], channels last, depth's dtype.
        ranks_depth, ranks_feat, ranks_bev: int32 [n_points], sorted by ranks_bev.
        bev_feat_shape: (B, Z, Y, X, C).
        interval_starts, interval_lengths: int32 [n_intervals], the runs of ranks_bev.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".
        validate: check every index on the host first (one synchronisation); bad values raise
            IndexError naming the array and the first bad index.

    Returns:
        Tensor[B, C, Z, Y, X] in feat's dtype. Differentiable w.r.t. depth and feat.
    """
    if validate and not torch.compiler.is_compiling():
        validate_inputs(
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            bev_feat_shape,
            interval_starts,
            interval_lengths,
        )
    needs_grad = torch.is_grad_enabled() and (
        (isinstance(feat, torch.Tensor) and feat.requires_grad)
        or (isinstance(depth, torch.Tensor) and depth.requires_grad)
    )
    if torch.compiler.is_compiling() or needs_grad:
        return torch.ops.mu_space.bev_pool_v2(
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            list(_shape(bev_feat_shape)),
            interval_starts,
            interval_lengths,
            backend,
        )
    return _forward(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
        backend,
    )


# --------------------------------------------------------------------------- registry


def _inputs(config, device, dtype=torch.float32, batch=None):
    """bev_pool_v2 arguments from the realistic camera geometry of `config`."""
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare_reference
    from mu_space.testing import bev_geometry

    g = bev_geometry.make(config, batch=batch, dtype=dtype)
    ranks = bev_pool_prepare_reference(
        g["coor"], g["grid_lower_bound"], g["grid_interval"], g["grid_size"]
    )
    args = (g["depth"], g["feat"], *ranks.bev_pool_v2_args(g["bev_feat_shape"]))
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _self_check_cases(device: torch.device) -> list[registry.SelfCheckCase]:
    # Float32 sums in a different order: ~1e-7 relative; grad_depth sums C = 64 products of
    # O(1) values (|value| ~ 8), so 1e-5 + 1e-5 * |value| covers the reordering with margin.
    # float16: one rounding of the output (2^-11 relative) on O(1) values.
    return [
        registry.SelfCheckCase(
            "tiny float32 (fwd + bwd)", _inputs("tiny", device), atol=1e-5, rtol=1e-5, backward=True
        ),
        registry.SelfCheckCase(
            "tiny B=2 float16", _inputs("tiny", device, torch.float16, 2), atol=2e-3, rtol=2e-3
        ),
        registry.SelfCheckCase(
            "bevdet-r50 float32 (fwd + bwd)",
            _inputs("bevdet-r50", device),
            atol=1e-5,
            rtol=1e-5,
            backward=True,
        ),
    ]


registry.register(
    registry.OperatorSpec(
        name=OP,
        family="bev",
        api=bev_pool_v2,
        reference=bev_pool_v2_reference,
        native_entry_points=ENTRY_POINTS,
        self_check_cases=_self_check_cases,
        dtypes=("float32", "float16", "bfloat16"),
        backward="native",
        upstream="BEVDet `bev_pool_v2`",
        models="BEVDet, BEVDepth, FlashOCC",
        patches=("bevdet.bev_pool_v2",),
        recipes=("model_examples/BEVDet",),
        doc="docs/operators/bev_pool_v2.md",
    )
)
