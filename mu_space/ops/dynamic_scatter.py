"""`dynamic_scatter`: mmcv's dynamic point-to-voxel scatter (`mmcv.ops.dynamic_scatter`), and
the two primitives it is made of:

- `voxel_group(coors)` (no gradient): the voxels of the coordinates in mmcv's order (the sorted
  unique rows), and the points grouped by voxel in input order: (voxel_coors [M, ndim], order
  [K], starts [M], counts [M], point2voxel [N]).
- `segment_reduce(feats, order, starts, counts, point2voxel, reduce_type)` -> [M, C]: sum, mean
  or max of each voxel's feature rows, float32 accumulation in a fixed order (input order), and
  its backward (max: the whole gradient to the first point holding the maximum, mmcv's
  tie rule).

Native path: voxel_group is csrc/voxel/dynamic_scatter_musa.mu's bitmap grouping (GROUPING
"bitmap"): mixed-radix coordinate keys over the column maxima measured on the device, a bitmap of
the key range whose popcounts rank the occupied voxels in sorted-coordinate order, the points
placed by voxel and each voxel's points sorted in input order (in registers or by a warp), with
no sort of the points; one host synchronisation (the voxel count, read while the last kernels
run). Where the key range exceeds the bitmap or a voxel holds more points than the warp
selection takes, it hands back to the sort grouping: a stable torch.sort of the keys (CUB's
radix sort under CUDA, torch_musa's under MUSA) and the runs of equal keys. segment_reduce is one
kernel per direction, no atomics, no synchronisation. Deterministic in both directions. The
backward needs no re-sort: the grouping is an input of segment_reduce. A forward that needs no
gradient may run as one native call (dynamic_scatter_bitmap_forward: the reduction queued before
the voxel count is read; FUSED_FORWARD below).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from mu_space.ops import _opdef, _voxel
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops._tensor_cache import SavedForBackward
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

REDUCE_TYPES = ("sum", "mean", "max")
_REDUCE_CODE = {"sum": 0, "mean": 1, "max": 2}
FEAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NATIVE_FEAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_NATIVE_NDIM = 4
GROUP_ENTRY_POINTS = (
    "voxel_group_bitmap",
    "voxel_group_bitmap_workspace_ints",
    "voxel_group_keys",
    "voxel_group_from_sorted",
    "voxel_group_workspace_ints",
)
# The native grouping: "bitmap" (voxel_group_bitmap: a bitmap of the key range ranks the
# voxels, no sort of the points; it hands back to "sort" for a key range beyond its bitmap or
# a voxel of more than voxel_group.bitmap_max_points_per_voxel rows) or "sort"
# (voxel_group_keys, the platform's stable sort, voxel_group_from_sorted). Both give the same
# bits. MUSPACE_DYNAMIC_SCATTER_GROUPING=sort selects the sort for a process (benchmarks);
# tests set the attribute.
GROUPING = os.environ.get("MUSPACE_DYNAMIC_SCATTER_GROUPING", "bitmap")
_PACKED_K = 1 << 31  # voxel_group_bitmap returns m + k * 2^31
REDUCE_ENTRY_POINTS = ("segment_reduce_forward", "segment_reduce_backward")
FUSED_ENTRY_POINTS = ("dynamic_scatter_bitmap_forward",)


class VoxelGroups(NamedTuple):
    """`voxel_group`'s outputs: voxel_coors [M, ndim] (coors' dtype, sorted rows), order [K]
    int32 (the points of voxel 0, then voxel 1, ..., each in input order), starts / counts [M]
    int32 (voxel v's points are order[starts[v] : starts[v] + counts[v]]) and point2voxel [N]
    int32 (the voxel of each point, -1 for a dropped row)."""

    voxel_coors: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    point2voxel: torch.Tensor


# --------------------------------------------------------------------------- checks


def _check_coors(coors, name: str = "coors") -> int:
    check_tensor(coors, name)
    if coors.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {dtype_name(coors.dtype)}")
    if coors.dim() != 2 or coors.shape[1] < 1:
        raise ValueError(f"{name} must be [N, ndim] with ndim >= 1, got shape {tuple(coors.shape)}")
    if coors.shape[0] > _voxel.INT32_MAX:
        raise ValueError(
            f"{name} has {coors.shape[0]} rows; int32 indices allow {_voxel.INT32_MAX}"
        )
    return coors.shape[1]


def _check_reduce(reduce_type) -> str:
    if not isinstance(reduce_type, str):
        raise TypeError(
            f"reduce_type must be one of {REDUCE_TYPES}, got {type(reduce_type).__name__}"
        )
    if reduce_type not in REDUCE_TYPES:
        raise ValueError(f"reduce_type must be one of {REDUCE_TYPES}, got {reduce_type!r}")
    return reduce_type


def _check_feats(feats, name: str = "feats") -> None:
    check_tensor(feats, name)
    if feats.dtype not in FEAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16, bfloat16 or float64, got {dtype_name(feats.dtype)}"
        )
    if feats.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(feats.shape)}")


def _check_index(t, name: str, ref, n: int | None = None, n_of: str = "") -> None:
    check_tensor(t, name)
    check_same_device(t, name, ref)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got {t.dim()}-D")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}.shape[0] must be {n} ({n_of}), got {t.shape[0]}")


# --------------------------------------------------------------------------- voxel_group


def _group_check(coors) -> _opdef.Checked:
    ndim = _check_coors(coors)
    return _opdef.Checked(coors.device, coors.dtype, None, (coors.shape[0], ndim), "coors")


def _empty_int32(device, k=0):
    return torch.zeros(k, dtype=torch.int32, device=device)


def voxel_group_reference(coors) -> VoxelGroups:
    """Vectorised PyTorch grouping (torch.unique of the rows without a negative entry: sorted
    lexicographically, as mmcv's `unique_dim`)."""
    _check_coors(coors)
    n, ndim = coors.shape
    device = coors.device
    valid = (coors >= 0).all(dim=1)
    idx = torch.nonzero(valid).squeeze(1)
    p2v = torch.full((n,), -1, dtype=torch.int32, device=device)
    if idx.numel() == 0:
        return VoxelGroups(
            coors.new_zeros((0, ndim)), _empty_int32(device), _empty_int32(device),
            _empty_int32(device), p2v,
        )  # fmt: skip
    uniq, inverse, counts = torch.unique(coors[idx], dim=0, return_inverse=True, return_counts=True)
    p2v[idx] = inverse.to(torch.int32)
    order = idx[torch.sort(inverse, stable=True).indices]
    starts = torch.cumsum(counts, 0) - counts
    return VoxelGroups(
        uniq.contiguous(), order.to(torch.int32), starts.to(torch.int32),
        counts.to(torch.int32), p2v,
    )  # fmt: skip


def group_supports(c: _opdef.Checked) -> str | None:
    """Why the native groupings cannot take these coordinates (None when they can)."""
    n, ndim = c.info
    if ndim > MAX_NATIVE_NDIM:
        return f"coors with {ndim} columns: the native kernels take at most {MAX_NATIVE_NDIM}"
    if n > (limit := native.limit("voxel_group.max_points")):
        return f"{n} rows exceed the native kernels' limit of {limit}"
    return None


def _group_outputs(coors, n: int, ndim: int):
    """voxel_group's native outputs, N entries each (upper bounds): voxel_coors, order, starts,
    counts, point2voxel."""
    return (
        _opdef.new_output(coors, (n, ndim)),
        *(_opdef.new_output(coors, (n,), torch.int32) for _ in range(4)),
    )


@functools.lru_cache(maxsize=64)
def _bitmap_workspace_ints(n: int) -> int:
    """(cached: a TVM-FFI call costs ~4.6 us of host time on the H200's host, overhead.json)"""
    return int(native.function("voxel_group_bitmap_workspace_ints")(n))


def _bitmap_workspace(coors, n: int) -> torch.Tensor:
    return torch.empty(_bitmap_workspace_ints(n), dtype=torch.int32, device=coors.device)


def _cut_groups(outputs, packed: int) -> VoxelGroups:
    """The bitmap grouping's outputs cut to its M voxels and K kept rows (packed: m + k * 2^31)."""
    voxel_coors, order, starts, counts, p2v = outputs
    m, k = packed % _PACKED_K, packed // _PACKED_K
    return VoxelGroups(
        voxel_coors.resize_(m, voxel_coors.shape[1]), order.resize_(k), starts.resize_(m),
        counts.resize_(m), p2v,
    )  # fmt: skip


def launch_sort_grouping(coors, outputs) -> torch.Tensor:
    """The sort grouping's launches into `outputs` (_group_outputs: N entries each) -> its
    header [3] int64 (M, K, overflow) on the device; no host synchronisation."""
    n = coors.shape[0]
    st = stream_handle(coors)
    header = _opdef.new_output(coors, (3,), torch.int64)
    ints = int(native.function("voxel_group_workspace_ints")(n))
    workspace = torch.empty(ints, dtype=torch.int32, device=coors.device)
    keys = torch.empty(n, dtype=torch.int32, device=coors.device)
    native.function("voxel_group_keys")(coors, workspace, keys, st)
    # the platform's stable sort (CUB's radix sort under CUDA, torch_musa's under MUSA) on the
    # same stream, in place of the kernels' own 3-pass radix sort (module docstring)
    sorted_keys, perm = torch.sort(keys, stable=True)
    native.function("voxel_group_from_sorted")(
        coors, workspace, sorted_keys, perm, *outputs, header, st
    )
    return header


def _group_sort_native(coors, outputs) -> VoxelGroups:
    """The sort grouping into `outputs` (_group_outputs)."""
    voxel_coors, order, starts, counts, p2v = outputs
    header = launch_sort_grouping(coors, outputs)
    m, k, overflow = header.tolist()  # the one host synchronisation: the voxel count
    if overflow:
        # the coordinates' value range does not fit the kernels' int32 keys (prod of the
        # column maxima + 1 >= 2**31): the same result from the reference, on the same device
        return voxel_group_reference(coors)
    return VoxelGroups(
        voxel_coors.resize_(m, voxel_coors.shape[1]), order.resize_(k), starts.resize_(m),
        counts.resize_(m), p2v,
    )  # fmt: skip


def _group_native(c, coors) -> VoxelGroups:
    n, ndim = c.info
    if n == 0:
        return voxel_group_reference(coors)
    coors = coors.contiguous()
    outputs = _group_outputs(coors, n, ndim)
    if GROUPING != "sort":
        packed = int(
            native.function("voxel_group_bitmap")(
                coors, _bitmap_workspace(coors, n), *outputs, stream_handle(coors)
            )
        )  # the one host synchronisation: the voxel count
        if packed >= 0:
            return _cut_groups(outputs, packed)
        # the key range exceeds the bitmap, or a voxel is too crowded: the sort grouping
    return _group_sort_native(coors, outputs)


def _group_fake(coors):
    ctx = torch.library.get_ctx()
    m, k = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    n, ndim = coors.shape
    i32 = torch.int32
    return (
        coors.new_empty((m, ndim)),
        coors.new_empty((k,), dtype=i32),
        coors.new_empty((m,), dtype=i32),
        coors.new_empty((m,), dtype=i32),
        coors.new_empty((n,), dtype=i32),
    )


def _dynamic_coors(device, config="tiny-voxels", clouds=1, *, with_batch=False):
    """mmcv dynamic voxelization rows of tiny generated clouds (dropped rows included)."""
    from mu_space.testing import lidar

    vs, pcr, _, _ = lidar.layer_args(config)
    grid = _voxel.voxel_grid(vs, pcr)
    pts = lidar.batch(lidar.VOXEL_CONFIGS[config].cloud, clouds)
    rows = [_voxel.dynamic_rows(p, grid) for p in pts]
    if with_batch:
        rows = [torch.nn.functional.pad(r, (1, 0), value=i) for i, r in enumerate(rows)]
    return torch.cat(pts).to(device), torch.cat(rows).to(device)


def _group_samples(device) -> list[_opdef.Sample]:
    _, coors = _dynamic_coors(device)
    _, coors4 = _dynamic_coors(device, clouds=2, with_batch=True)
    return [
        _opdef.Sample("tiny-voxels int32 (z, y, x)", (coors,)),
        _opdef.Sample("2 clouds int64 (b, z, y, x)", (coors4.long(),)),
        _opdef.Sample("no rows", (coors[:0],)),
    ]


GROUP = _opdef.define(
    _opdef.OpDef(
        name="voxel_group",
        family="voxel",
        schema="(Tensor coors) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        check=_group_check,
        reference=voxel_group_reference,
        native=_group_native,
        fake=_group_fake,
        supports=group_supports,
        result=VoxelGroups,
        native_dtypes=(torch.int32, torch.int64),
        entry_points=GROUP_ENTRY_POINTS,
        samples=_group_samples,
        public=False,
        unverified=_voxel.UNVERIFIED,
    )
)


@GROUP.export
def voxel_group(coors: torch.Tensor, *, backend: str = "auto") -> VoxelGroups:
    """The voxels of `coors` (Tensor[N, ndim] int32 / int64; a row with a negative entry is
    dropped) in mmcv's `dynamic_scatter` order, and the points grouped by voxel:

        voxel_coors = the distinct rows, sorted lexicographically        [M, ndim], coors' dtype
        order       = the points of voxel 0, voxel 1, ... (input order)   [K] int32, K = kept rows
        starts, counts: voxel v holds order[starts[v] : starts[v] + counts[v]]     [M] int32
        point2voxel = the voxel of each row, -1 for a dropped row                  [N] int32

    One host synchronisation (the voxel count). No gradient."""
    return GROUP(coors, backend=backend)


# --------------------------------------------------------------------------- segment_reduce


def _reduce_check(feats, order, starts, counts, point2voxel, reduce_type) -> _opdef.Checked:
    _check_feats(feats)
    _check_reduce(reduce_type)
    n, C = feats.shape
    _check_index(order, "order", feats)
    _check_index(starts, "starts", feats)
    m = starts.shape[0]
    _check_index(counts, "counts", feats, m, "the length of starts")
    _check_index(point2voxel, "point2voxel", feats, n, "the rows of feats")
    return _opdef.Checked(
        feats.device, feats.dtype, (((m, C), feats.dtype),), (n, C, m, reduce_type), "feats"
    )


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_voxel(point2voxel, m: int):
    """(voxel of each row as int64, with m for a row that belongs to none)."""
    v = point2voxel.long()
    return torch.where((v >= 0) & (v < m), v, m)


def _max_and_arg(feats, v, m: int):
    """(max [M, C] with NaN ignored (-inf where a voxel has no number), arg [M, C] int64: the
    first row holding it, n where none): mmcv's fmaxf accumulation and its tie rule."""
    n, C = feats.shape
    x = feats.to(_acc_dtype(feats.dtype))
    x = torch.where(torch.isnan(x), -torch.inf, x)
    best = torch.full((m + 1, C), -torch.inf, dtype=x.dtype, device=feats.device)
    best = best.scatter_reduce(0, v[:, None].expand(n, C), x, "amax")
    hit = (x == best[v]) & (v[:, None] < m) & ~torch.isnan(feats.to(x.dtype))
    rows = torch.arange(n, device=feats.device)[:, None].expand(n, C)
    arg = torch.full((m + 1, C), n, dtype=torch.int64, device=feats.device)
    arg = arg.scatter_reduce(0, v[:, None].expand(n, C), torch.where(hit, rows, n), "amin")
    return best[:m], arg[:m]


def segment_reduce_reference(feats, order, starts, counts, point2voxel, reduce_type):
    """Vectorised PyTorch reduction by `point2voxel` (rows outside [0, M) dropped): float32
    accumulation (float64 for float64), rounded once; mean divides by `counts`."""
    n, C, m, reduce_type = _reduce_check(
        feats, order, starts, counts, point2voxel, reduce_type
    ).info
    v = _masked_voxel(point2voxel, m)
    acc = _acc_dtype(feats.dtype)
    if reduce_type == "max":
        best, _ = _max_and_arg(feats, v, m)
        return best.to(feats.dtype)
    total = torch.zeros((m + 1, C), dtype=acc, device=feats.device).index_add(0, v, feats.to(acc))
    total = total[:m]
    if reduce_type == "mean":
        total = total / counts.to(acc).clamp(min=1)[:, None]
    return total.to(feats.dtype)


def segment_reduce_backward_reference(
    grad_out, feats, order, starts, counts, point2voxel, reduce_type
):
    """(grad_feats,): sum: the voxel's gradient; mean: divided by counts; max: the whole
    gradient to the first row holding the maximum, 0 elsewhere."""
    n, C, m, reduce_type = _reduce_check(
        feats, order, starts, counts, point2voxel, reduce_type
    ).info
    v = _masked_voxel(point2voxel, m)
    acc = _acc_dtype(feats.dtype)
    g = torch.cat((grad_out.to(acc), torch.zeros((1, C), dtype=acc, device=feats.device)))
    if reduce_type == "max":
        _, arg = _max_and_arg(feats, v, m)
        grad = torch.zeros((n + 1) * C, dtype=acc, device=feats.device)
        flat = arg * C + torch.arange(C, device=feats.device)[None, :]
        flat = torch.where(arg < n, flat, n * C)  # no row: a scratch slot
        grad = grad.index_put((flat.reshape(-1),), g[:m].reshape(-1), accumulate=False)
        return (grad[: n * C].view(n, C).to(feats.dtype),)
    rows = g[v]
    if reduce_type == "mean":
        c = torch.cat((counts.to(acc).clamp(min=1), torch.ones(1, dtype=acc, device=feats.device)))
        rows = rows / c[v][:, None]
    return (rows.to(feats.dtype),)


def groups_consistent(order, starts, counts, point2voxel) -> str | None:
    """None when the grouping arrays are what voxel_group returns for some coordinates (every
    kept row in exactly one voxel, order grouped and ascending inside each voxel), else why
    not: segment_reduce's result is then unspecified (native and reference may differ; both
    stay in bounds)."""
    n = point2voxel.shape[0]
    m = starts.shape[0]
    k = order.shape[0]
    cnt = counts.long()
    if bool((cnt < 1).any()) or int(cnt.sum()) != k:
        return "counts must be >= 1 and sum to the length of order"
    if not torch.equal(starts.long(), torch.cumsum(cnt, 0) - cnt):
        return "starts must be the exclusive prefix sums of counts"
    o = order.long()
    if k and (bool((o < 0).any()) or bool((o >= n).any())):
        return "order holds an index outside [0, N)"
    voxel_of_pos = torch.repeat_interleave(torch.arange(m, device=o.device), cnt, output_size=k)
    want = torch.full((n,), -1, dtype=torch.int64, device=o.device)
    want[o] = voxel_of_pos
    if not torch.equal(want, point2voxel.long()):
        return "point2voxel must name the voxel of each row of order (-1 for the others)"
    if k > 1 and bool(((o[1:] <= o[:-1]) & (voxel_of_pos[1:] == voxel_of_pos[:-1])).any()):
        return "order must be ascending inside each voxel"
    return None


def _reduce_precondition(feats, order, starts, counts, point2voxel, reduce_type) -> str | None:
    return groups_consistent(order, starts, counts, point2voxel)


def _reduce_supports(c: _opdef.Checked) -> str | None:
    n, C, m, _ = c.info
    if n > (limit := native.limit("segment_reduce.max_points")):
        return f"{n} rows exceed the native kernels' limit of {limit}"
    return None


# The max winners (int32 [M, C]: the first row holding each maximum, -1 where none) each native
# max forward wrote for feats that need a gradient, by (feats, order, starts, counts,
# point2voxel): the backward then writes every gradient element once from them instead of a zero
# fill plus a walk of every voxel's rows (20.3 + 77.9 us at C = 64 on the H200, 2026-12-01).
SAVED_ARGMAX = SavedForBackward()


def _reduce_native(c, feats, order, starts, counts, point2voxel, reduce_type):
    n, C, m, reduce_type = c.info
    inputs = (feats, order, starts, counts, point2voxel)
    feats, order, starts, counts = (t.contiguous() for t in (feats, order, starts, counts))
    out = _opdef.new_output(feats, (m, C))
    # the winners for the backward, where one will run (the native backward is deterministic
    # with or without them: they are kept under deterministic algorithms too)
    argmax = None
    if reduce_type == "max" and inputs[0].requires_grad and out.numel():
        argmax = _opdef.new_output(feats, (m, C), torch.int32)  # written in full
    if out.numel():
        native.function("segment_reduce_forward")(
            feats, order, starts, counts, out, argmax, _REDUCE_CODE[reduce_type],
            stream_handle(feats),
        )  # fmt: skip
    if argmax is not None:
        SAVED_ARGMAX.put(inputs, argmax)
    return out


def _reduce_backward_native(
    c, grad_out, feats, order, starts, counts, point2voxel, reduce_type, *, needs, deterministic
):
    n, C, m, reduce_type = c.info
    argmax = (
        SAVED_ARGMAX.get((feats, order, starts, counts, point2voxel))
        if reduce_type == "max"
        else None
    )
    grad_out = grad_out.to(feats.dtype).contiguous()
    feats, order, starts, counts, point2voxel = (
        t.contiguous() for t in (feats, order, starts, counts, point2voxel)
    )
    grad = _opdef.new_output(feats)
    if grad.numel():
        native.function("segment_reduce_backward")(
            grad_out,
            feats,
            order,
            starts,
            counts,
            point2voxel,
            argmax,
            grad,
            _REDUCE_CODE[reduce_type],
            stream_handle(feats),
        )
    return (grad,)


def _reduce_samples(device) -> list[_opdef.Sample]:
    pts, coors = _dynamic_coors("cpu")
    g = voxel_group_reference(coors)
    gen = torch.Generator().manual_seed(5)
    feats = torch.cat((pts, torch.randn(pts.shape[0], 3, generator=gen)), dim=1)
    args = tuple(t.to(device) for t in (feats, g.order, g.starts, g.counts, g.point2voxel))
    return [
        _opdef.Sample("tiny-voxels mean (fwd + bwd)", (*args, "mean"), grad=True),
        _opdef.Sample("tiny-voxels max (fwd + bwd)", (*args, "max"), grad=True),
        _opdef.Sample("tiny-voxels sum float16", (args[0].half(), *args[1:], "sum")),
        _opdef.Sample(
            "tiny-voxels max bfloat16 (fwd + bwd)",
            (args[0].bfloat16(), *args[1:], "max"),
            grad=True,
        ),
        _opdef.Sample(
            "no rows",
            (args[0][:0], args[1][:0], args[2][:0], args[3][:0], args[4][:0], "max"),
            grad=True,
        ),
    ]


REDUCE = _opdef.define(
    _opdef.OpDef(
        name="segment_reduce",
        family="voxel",
        schema="(Tensor feats, Tensor order, Tensor starts, Tensor counts, Tensor point2voxel, "
        "str reduce_type) -> Tensor",
        check=_reduce_check,
        reference=segment_reduce_reference,
        native=_reduce_native,
        backward=_opdef.Backward(
            inputs=("feats",),
            reference=segment_reduce_backward_reference,
            native=_reduce_backward_native,
        ),
        supports=_reduce_supports,
        precondition=_reduce_precondition,
        native_dtypes=NATIVE_FEAT_DTYPES,
        entry_points=REDUCE_ENTRY_POINTS,
        samples=_reduce_samples,
        public=False,
        unverified=_voxel.UNVERIFIED,
    )
)


@REDUCE.export
def segment_reduce(
    feats, order, starts, counts, point2voxel, reduce_type="max", *, backend: str = "auto"
):
    """Reduce feature rows by voxel (the grouping `voxel_group` returns) -> Tensor[M, C]:

        sum:  out[v] = sum of feats[i] over the rows i of voxel v (order[starts[v]:][:counts[v]])
        mean: that sum / counts[v]
        max:  per channel the largest value (NaN ignored; -inf when a voxel has none)

    feats: Tensor[N, C] float32 / float16 / bfloat16 (float64 reference path); the index
    arrays int32 (voxel_group's). float32 accumulation in input order (deterministic), one
    rounding to feats' dtype. Differentiable w.r.t. feats: sum / mean spread the voxel's
    gradient (mean divided by counts), max gives it wholly to the first row (lowest index)
    holding the maximum (mmcv's rule). No host synchronisation, no atomics."""
    return REDUCE(feats, order, starts, counts, point2voxel, reduce_type, backend=backend)


# --------------------------------------------------------------------------- dynamic_scatter


def _check(feats, coors, reduce_type) -> _opdef.Checked:
    _check_feats(feats)
    ndim = _check_coors(coors)
    check_same_device(coors, "coors", feats, "feats")
    if coors.shape[0] != feats.shape[0]:
        raise ValueError(
            f"coors.shape[0] must be {feats.shape[0]} (the rows of feats), got {coors.shape[0]}"
        )
    _check_reduce(reduce_type)
    return _opdef.Checked(
        feats.device, feats.dtype, None, (feats.shape[0], feats.shape[1], ndim), "feats"
    )


def _supports(c: _opdef.Checked) -> str | None:
    n, C, ndim = c.info
    if ndim > MAX_NATIVE_NDIM:
        return f"coors with {ndim} columns: the native kernels take at most {MAX_NATIVE_NDIM}"
    return None


def _scatter(feats, coors, reduce_type, backend):
    g = voxel_group(coors, backend=backend)
    out = segment_reduce(
        feats, g.order, g.starts, g.counts, g.point2voxel, reduce_type, backend=backend
    )
    return out, g.voxel_coors


def dynamic_scatter_reference(feats, coors, reduce_type):
    """The parts on their reference paths (vectorised PyTorch; autograd through
    segment_reduce's backward)."""
    _check(feats, coors, reduce_type)
    return _scatter(feats, coors, reduce_type, "reference")


# The forward of calls that need no gradient in one native call: dynamic_scatter_bitmap_forward
# runs the bitmap grouping and queues the reduction before the host waits for the voxel count
# (the kernel reads M and K on the device), instead of voxel_group, the read-back, then
# segment_reduce's checks and launch while the GPU idles. Calls that need a gradient take the
# parts (segment_reduce's autograd). Verified on the H200 (2026-12-05: GPU suite, memcheck,
# racecheck); there it took 111-149 us against the parts' 120-156 us (centerpoint-0075-nus
# float32). MUSPACE_DYNAMIC_SCATTER_FUSED=0 turns it off (A/B timing).
FUSED_FORWARD_UNVERIFIED = ""
FUSED_FORWARD = os.environ.get("MUSPACE_DYNAMIC_SCATTER_FUSED", "1") != "0"


def _fused_forward_allowed(feats) -> bool:
    return (
        FUSED_FORWARD
        and GROUPING != "sort"
        and _opdef.step_allowed(FUSED_FORWARD_UNVERIFIED)
        and not (feats.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
        and feats.numel() > 0
        and feats.shape[0] <= native.limit("voxel_group.max_points")
    )


def _fused_forward(c, feats, coors, reduce_type, backend):
    n, C, ndim = c.info
    feats, coors = feats.contiguous(), coors.contiguous()
    # the workspace and the grouping's four int32 arrays (internal here: only voxel_feats and
    # voxel_coors are returned) in one allocation: each allocation costs ~3.7 us of host time
    # on the H200's host (benchmarks/results/h200/overhead.json)
    ints = _bitmap_workspace_ints(n)
    buf = torch.empty(ints + 4 * n, dtype=torch.int32, device=coors.device)
    workspace = buf[:ints]
    outputs = (_opdef.new_output(coors, (n, ndim)), *buf[ints:].view(4, n).unbind(0))
    out = _opdef.new_output(feats, (n, C))  # [N, C]: the first M rows are the result
    code = _REDUCE_CODE[reduce_type]
    scatter = native.function("dynamic_scatter_bitmap_forward")
    # the one host synchronisation: the voxel count (the reduction is already queued)
    packed = int(scatter(coors, workspace, *outputs, feats, out, code, stream_handle(feats)))
    if packed >= 0:
        m = packed % _PACKED_K
        return out.resize_(m, C), outputs[0].resize_(m, ndim)
    # the bitmap grouping handed back (key range, crowded voxel): the sort grouping and the
    # reduction as separate calls
    g = _group_sort_native(coors, outputs)
    out = segment_reduce(
        feats, g.order, g.starts, g.counts, g.point2voxel, reduce_type, backend=backend
    )
    return out, g.voxel_coors


def _forward_native(c, feats, coors, reduce_type, *, backend):
    if _fused_forward_allowed(feats):
        return _fused_forward(c, feats, coors, reduce_type, backend)
    return _scatter(feats, coors, reduce_type, backend)


def _samples(device) -> list[_opdef.Sample]:
    pts, coors = _dynamic_coors("cpu")
    pts4, coors4 = _dynamic_coors("cpu", clouds=2, with_batch=True)
    gen = torch.Generator().manual_seed(6)
    feats64 = torch.randn(pts.shape[0], 64, generator=gen)
    out = [
        _opdef.Sample("tiny-voxels C=5 max", (pts.to(device), coors.to(device), "max")),
        _opdef.Sample("tiny-voxels C=5 mean", (pts.to(device), coors.to(device), "mean")),
        _opdef.Sample("C=64 sum float16", (feats64.half().to(device), coors.to(device), "sum")),
        _opdef.Sample(
            "2 clouds (b, z, y, x) max bfloat16",
            (pts4.bfloat16().to(device), coors4.to(device), "max"),
        ),
        _opdef.Sample("no points", (pts[:0].to(device), coors[:0].to(device), "mean")),
    ]
    return out


OP = _opdef.define(
    _opdef.OpDef(
        name="dynamic_scatter",
        family="voxel",
        schema="(Tensor feats, Tensor coors, str reduce_type) -> (Tensor, Tensor)",
        check=_check,
        reference=dynamic_scatter_reference,
        native=_forward_native,
        composite=True,
        # Differentiable w.r.t. feats through segment_reduce's autograd (its contract samples
        # check the backward). Not declared here: the contract tests backpropagate through every
        # tensor output, and voxel_coors is an integer tensor (tests/ops/test_dynamic_scatter.py
        # checks this op's gradients).
        grad_inputs=(),
        supports=_supports,
        native_dtypes=NATIVE_FEAT_DTYPES,
        entry_points=GROUP_ENTRY_POINTS + REDUCE_ENTRY_POINTS + FUSED_ENTRY_POINTS,
        samples=_samples,
        upstream="mmcv `dynamic_scatter` / `DynamicScatter`",
        models="DynamicVFE (dynamic-voxel PointPillars / SECOND / CenterPoint), MVX-Net, "
        "Cylinder3D-style segmentation",
        patches=(
            "mmcv.dynamic_scatter",
            "mmcv.DynamicScatter",
            "mmcv._ext.dynamic_point_to_voxel_forward",
            "mmcv._ext.dynamic_point_to_voxel_backward",
        ),
        recipes=("model_examples/CenterPoint",),
        doc="docs/operators/dynamic_scatter.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def dynamic_scatter(
    feats: torch.Tensor, coors: torch.Tensor, reduce_type: str = "max", *, backend: str = "auto"
):
    """mmcv's `dynamic_scatter(feats, coors, reduce_type='max')` (drop-in for
    `mmcv.ops.dynamic_scatter`): reduce point features into their voxels.

        voxels      = the distinct rows of coors without a negative entry, sorted
                      lexicographically (mmcv's unique_dim order)
        voxel_feats = per voxel and channel: 'max' the largest value (NaN ignored), 'sum' the
                      sum, 'mean' the sum / the voxel's point count

    Args:
        feats: Tensor[N, C] float32 / float16 / bfloat16 (float64 reference path).
        coors: Tensor[N, ndim] int32 / int64 (mmcv: (z, y, x) or (batch, z, y, x)); rows with a
            negative entry are dropped (what dynamic voxelization writes for dropped points).
        reduce_type: "max" | "sum" | "mean".
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns:
        (voxel_feats [M, C] in feats' dtype, voxel_coors [M, ndim] in coors' dtype).
        Differentiable w.r.t. feats (max: the gradient to the first point, lowest index,
        holding the maximum, as mmcv's backward). float32 accumulation in input order:
        deterministic forward and backward (mmcv's sums use atomics). One host
        synchronisation (the voxel count).
    """
    return OP(feats, coors, reduce_type, backend=backend)


# --------------------------------------------------------------------------- mmcv's _ext contract


def dynamic_scatter_with_map(feats, coors, reduce_type="max", *, backend: str = "auto"):
    """mmcv's `_ext.dynamic_point_to_voxel_forward` results: (voxel_feats [M, C], voxel_coors
    [M, ndim], point2voxel [N] int32 (-1 dropped), voxel_points_count [M] int32)."""
    _check(feats, coors, reduce_type)
    g = voxel_group(coors, backend=backend)
    out = segment_reduce(
        feats, g.order, g.starts, g.counts, g.point2voxel, reduce_type, backend=backend
    )
    return out, g.voxel_coors, g.point2voxel, g.counts


def dynamic_scatter_backward_from_map(
    grad_reduced, feats, reduced_feats, point2voxel, counts, reduce_type
):
    """mmcv's `_ext.dynamic_point_to_voxel_backward` rule from its saved tensors -> grad_feats
    [N, C] (feats' dtype): sum / mean as `segment_reduce`'s backward; max: the gradient to the
    first point (lowest index) whose feature equals the saved maximum. Vectorised PyTorch."""
    _check_feats(feats)
    _check_reduce(reduce_type)
    n, C = feats.shape
    m = reduced_feats.shape[0]
    v = _masked_voxel(point2voxel, m)
    acc = _acc_dtype(feats.dtype)
    g = torch.cat((grad_reduced.to(acc), torch.zeros((1, C), dtype=acc, device=feats.device)))
    if reduce_type != "max":
        rows = g[v]
        if reduce_type == "mean":
            c = torch.cat(
                (counts.to(acc).clamp(min=1), torch.ones(1, dtype=acc, device=feats.device))
            )
            rows = rows / c[v][:, None]
        return rows.to(feats.dtype)
    saved = torch.cat((reduced_feats, reduced_feats.new_full((1, C), float("nan"))))
    hit = feats == saved[v]  # NaN never equal; a dropped row compares with NaN
    rows = torch.arange(n, device=feats.device)[:, None].expand(n, C)
    arg = torch.full((m + 1, C), n, dtype=torch.int64, device=feats.device)
    arg = arg.scatter_reduce(0, v[:, None].expand(n, C), torch.where(hit, rows, n), "amin")[:m]
    flat = torch.where(arg < n, arg * C + torch.arange(C, device=feats.device)[None, :], n * C)
    grad = torch.zeros((n + 1) * C, dtype=acc, device=feats.device)
    grad = grad.index_put((flat.reshape(-1),), g[:m].reshape(-1))
    return grad[: n * C].view(n, C).to(feats.dtype)
