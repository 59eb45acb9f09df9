"""`roiaware_pool3d` / `RoIAwarePool3d`: max / average pooling of point features into the voxels
of each 3D RoI (mmcv.ops.RoIAwarePool3d, PartA2), forward and backward. Formula and conventions:
the public function's docstring and docs/operators/roiaware_pool3d.md.

Composite of two internal ops (custom ops in a torch.compile graph):
- `roiaware_pool3d_map(rois, pts, out_size, max_pts_per_voxel)` -> (cell_start int64,
  cell_count int32, point_list int32): every cell (RoI, voxel) owns the slice
  point_list[cell_start, + cell_count) of its first max_pts_per_voxel - 1 points in ascending
  point index (mmcv's collect order); unused list entries are -1. Native: count, one host
  synchronisation for the pair total, fill, per-slice sort (csrc/box3d/roiaware_pool3d_musa.mu).
- `roiaware_pool3d_pool(pts_feature, cell_start, cell_count, point_list, out_size, mode)` ->
  pooled [N, ox, oy, oz, C], differentiable w.r.t. pts_feature; the backward gets the mapping as
  saved inputs (no recomputation). Native backward: float32 atomics like mmcv; under
  torch.use_deterministic_algorithms(True) the deterministic index_add of the reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mu_space.ops import _box3d, _opdef
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops._tensor_cache import SavedForBackward
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

_UNVERIFIED = _box3d.UNVERIFIED
_INT32_MAX = 2**31 - 1
_MODES = {"max": 0, "avg": 1}
_CHUNK = 1 << 22  # reference pooling: (cell, slot, channel) values at once


def out_size3(out_size, name: str = "out_size") -> list[int]:
    """mmcv's out_size: an int n (n, n, n) or 3 ints, each >= 1."""
    if isinstance(out_size, bool):
        raise TypeError(f"{name} must be an int or 3 ints, got bool")
    if isinstance(out_size, int) or (isinstance(out_size, torch.Tensor) and out_size.dim() == 0):
        n = _box3d.as_int(out_size, name, 1)
        return [n, n, n]
    if isinstance(out_size, (str, bytes)) or not hasattr(out_size, "__len__"):
        raise TypeError(f"{name} must be an int or 3 ints, got {type(out_size).__name__}")
    if len(out_size) != 3:
        raise ValueError(f"{name} must be an int or 3 ints, got {len(out_size)} values")
    dims = [_box3d.as_int(v, f"{name}[{i}]", 1) for i, v in enumerate(out_size)]
    if math.prod(dims) > _INT32_MAX:
        raise ValueError(f"{name}: {dims} has more than {_INT32_MAX} voxels per RoI")
    return dims


# --------------------------------------------------------------------------- the mapping


def _check_map(rois, pts, out_size, max_pts_per_voxel) -> _opdef.Checked:
    _box3d.check_float_tensor(rois, "rois")
    _box3d.check_shape(rois, "rois", (None, 7), "N, (x, y, z bottom, dx, dy, dz, yaw)")
    _box3d.check_float_tensor(pts, "pts", rois, "rois")
    _box3d.check_shape(pts, "pts", (None, 3), "npoints, (x, y, z)")
    dims = out_size3(out_size)
    K = _box3d.as_int(max_pts_per_voxel, "max_pts_per_voxel", 1)
    if K > _INT32_MAX:
        raise ValueError(f"max_pts_per_voxel must be <= {_INT32_MAX}, got {K}")
    return _opdef.Checked(
        rois.device, rois.dtype, None, (rois.shape[0], pts.shape[0], dims, K), "rois"
    )


def _voxel_index(q: torch.Tensor, size: int) -> torch.Tensor:
    """box3d's voxel_index: int(clamp(q, 0, size - 1)), NaN -> 0 (mmcv's CUDA conversion); the
    integer clamp again (from size > 2^24 on, float(size - 1) may round up to size)."""
    return torch.nan_to_num(q, nan=0.0).clamp(0, size - 1).long().clamp(max=size - 1)


def map_reference(rois, pts, out_size, max_pts_per_voxel):
    N, P, (ox, oy, oz), K = _check_map(rois, pts, out_size, max_pts_per_voxel).info
    V = ox * oy * oz
    device = rois.device
    inside = _box3d.points_in_boxes_mask(pts[None], rois[None])[0]  # [P, N]
    ridx, pidx = torch.nonzero(inside.T, as_tuple=True)  # RoI-major, then ascending point
    pb = _box3d.PointBoxes(*(t[ridx] for t in _box3d.point_boxes(rois)))
    r = rois.to(_box3d.compute_dtype(rois.dtype))[ridx]
    p = pts.to(r.dtype)[pidx]
    lx, ly = _box3d.local_xy(pb, p[:, 0], p[:, 1])
    # divisions by tensors: torch turns a division by a Python scalar into a multiplication by
    # its rounded reciprocal on the GPU, the kernels divide (correctly rounded)
    res = r[:, 3:6] / torch.tensor([ox, oy, oz], dtype=r.dtype, device=r.device)
    ix = _voxel_index((lx + r[:, 3] * 0.5) / res[:, 0], ox)
    iy = _voxel_index((ly + r[:, 4] * 0.5) / res[:, 1], oy)
    iz = _voxel_index((p[:, 2] - r[:, 2]) / res[:, 2], oz)
    cell = ridx * V + (ix * oy + iy) * oz + iz
    cell, order = torch.sort(cell, stable=True)  # within a cell: ascending point index
    points = pidx[order]
    counts = torch.bincount(cell, minlength=N * V)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(cell.shape[0], device=device) - start[cell]
    point_list = torch.where(rank < K - 1, points, -1).to(torch.int32)
    return start.to(torch.int64), counts.clamp(max=K - 1).to(torch.int32), point_list


def _map_native(c, rois, pts, out_size, max_pts_per_voxel):
    N, P, (ox, oy, oz), K = c.info
    rois, pts = rois.contiguous(), pts.contiguous()
    device = rois.device
    stream = stream_handle(rois)
    n_cells = N * ox * oy * oz
    counts = torch.empty(n_cells, dtype=torch.int32, device=device)
    native.function("roiaware_pool3d_count")(rois, pts, counts, ox, oy, oz, stream)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    start = ends - counts
    total = int(ends[-1]) if n_cells else 0  # the one host synchronisation
    point_list = torch.empty(total, dtype=torch.int32, device=device)
    if total:
        cursor = torch.empty(n_cells, dtype=torch.int32, device=device)
        native.function("roiaware_pool3d_fill")(
            rois, pts, start, cursor, point_list, ox, oy, oz, stream
        )
    workspace = torch.empty(n_cells + 1, dtype=torch.int32, device=device)
    native.function("roiaware_pool3d_sort")(start, counts, point_list, workspace, P, K, stream)
    return start, counts, point_list


def _map_fake(rois, pts, out_size, max_pts_per_voxel):
    N = rois.shape[0]
    n_cells = N * math.prod(out_size)
    ctx = torch.library.get_ctx()
    return (
        rois.new_empty(n_cells, dtype=torch.int64),
        rois.new_empty(n_cells, dtype=torch.int32),
        rois.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
    )


def _map_supports(c: _opdef.Checked) -> str | None:
    N, P, dims, K = c.info
    if K > (limit := native.limit("roiaware_pool3d.max_pts_per_voxel")):
        return f"max_pts_per_voxel = {K} exceeds the native kernels' limit of {limit}"
    if P > (limit := native.limit("roiaware_pool3d.max_points")):
        return f"{P} points exceed the native kernels' limit of {limit}"
    return None


def _map_samples(device: torch.device) -> list[_opdef.Sample]:
    rois, pts = _roi_inputs(2000, 10, seed=1)
    rois, pts = rois.to(device), pts.to(device)
    return [
        _opdef.Sample("10 RoIs, 2000 points, 6^3, 16 per voxel", (rois, pts, [6, 6, 6], 16)),
        _opdef.Sample("float16, (4, 5, 3), 128", (rois.half(), pts.half(), [4, 5, 3], 128)),
        _opdef.Sample("bfloat16, 1 per voxel", (rois.bfloat16(), pts.bfloat16(), [3, 3, 3], 2)),
        _opdef.Sample("no points", (rois, pts[:0], [2, 2, 2], 8)),
        _opdef.Sample("no RoIs", (rois[:0], pts, [2, 2, 2], 8)),
    ]


def _roi_inputs(n_points: int, n_rois: int, seed: int = 0):
    from mu_space.testing import boxes as box_inputs

    return box_inputs.roi_inputs(n_points, n_rois, seed=seed)


MAP = _opdef.define(
    _opdef.OpDef(
        name="roiaware_pool3d_map",
        family="box3d",
        schema="(Tensor rois, Tensor pts, int[] out_size, int max_pts_per_voxel) "
        "-> (Tensor, Tensor, Tensor)",
        check=_check_map,
        reference=map_reference,
        native=_map_native,
        fake=_map_fake,
        supports=_map_supports,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("roiaware_pool3d_count", "roiaware_pool3d_fill", "roiaware_pool3d_sort"),
        samples=_map_samples,
        unverified=_UNVERIFIED,
        public=False,
    )
)


@MAP.export
def roiaware_pool3d_map(rois, pts, out_size, max_pts_per_voxel=128, *, backend: str = "auto"):
    """The voxel lists of RoIAwarePool3d: (cell_start Tensor[N*V] int64, cell_count Tensor[N*V]
    int32, point_list Tensor[pairs] int32), V = ox*oy*oz, cell = roi*V + (ix*oy + iy)*oz + iz.
    Cell c's points are point_list[cell_start[c] : cell_start[c] + cell_count[c]], the first
    max_pts_per_voxel - 1 points of the voxel in ascending point index; other list entries are
    -1. One host synchronisation (the list length depends on the data)."""
    return MAP(rois, pts, out_size3(out_size), max_pts_per_voxel, backend=backend)


# --------------------------------------------------------------------------- pooling


def _check_pool(pts_feature, cell_start, cell_count, point_list, out_size, mode) -> _opdef.Checked:
    _box3d.check_float_tensor(pts_feature, "pts_feature")
    _box3d.check_shape(pts_feature, "pts_feature", (None, None), "npoints, C")
    for t, name, dtype in (
        (cell_start, "cell_start", torch.int64),
        (cell_count, "cell_count", torch.int32),
        (point_list, "point_list", torch.int32),
    ):
        check_tensor(t, name)
        check_same_device(t, name, pts_feature, "pts_feature")
        if t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype_name(dtype)}, got {dtype_name(t.dtype)}")
        _box3d.check_shape(t, name, (None,), "1-D")
    dims = out_size3(out_size)
    V = math.prod(dims)
    n_cells = cell_start.shape[0]
    if cell_count.shape[0] != n_cells or n_cells % V:
        raise ValueError(
            f"cell_start and cell_count must both hold N * {V} cells (out_size {dims}), got "
            f"{n_cells} and {cell_count.shape[0]}"
        )
    m = _box3d.as_int(mode, "mode")
    if m not in (0, 1):
        raise ValueError(f"mode must be 0 (max) or 1 (avg), got {m}")
    shape = (n_cells // V, *dims, pts_feature.shape[1])
    return _opdef.Checked(
        pts_feature.device,
        pts_feature.dtype,
        ((shape, pts_feature.dtype),),
        (dims, m),
        "pts_feature",
    )


def _slices(pts_feature, cell_start, cell_count, point_list):
    """For the cells with entries: (cell ids [E], point ids [E, L] (-1 where not valid), the
    count divisor [E]) in chunks; the entries of a cell are its valid list positions in order."""
    L, P = point_list.shape[0], pts_feature.shape[0]
    count = cell_count.long().clamp(min=0)
    lo = (-cell_start).clamp(min=0)
    k0 = torch.minimum(lo, count)
    k1 = torch.maximum(torch.minimum(L - cell_start, count), k0)
    span = k1 - k0
    cells = torch.nonzero(span > 0).squeeze(1)
    if cells.numel() == 0 or P == 0:  # no entry indexes a feature row
        return
    width = int(span.max())
    C = max(pts_feature.shape[1], 1)
    step = max(1, _CHUNK // (width * C))
    ar = torch.arange(width, device=cell_start.device)
    for i in range(0, cells.shape[0], step):
        cs = cells[i : i + step]
        pos = cell_start[cs, None] + k0[cs, None] + ar
        ok = ar < span[cs, None]
        p = point_list[pos.clamp(0, max(L - 1, 0))].long()
        ok = ok & (p >= 0) & (p < P)
        yield cs, torch.where(ok, p, -1), count[cs]


def _pool(pts_feature, cell_start, cell_count, point_list, out_size, mode, want_argmax=False):
    dims, m = _check_pool(pts_feature, cell_start, cell_count, point_list, out_size, mode).info
    n_cells, C = cell_start.shape[0], pts_feature.shape[1]
    acc = _box3d.compute_dtype(pts_feature.dtype)
    feat = pts_feature.to(acc)
    out = torch.zeros(n_cells, C, dtype=acc, device=pts_feature.device)
    argmax = torch.full((n_cells, C), -1, dtype=torch.long, device=pts_feature.device)
    for cs, p, count in _slices(pts_feature, cell_start, cell_count, point_list):
        vals = feat[p.clamp(min=0)]  # [E, W, C]
        ok = (p >= 0)[..., None]
        if m == 0:
            best = torch.full((cs.shape[0], C), -math.inf, dtype=acc, device=feat.device)
            arg = torch.full((cs.shape[0], C), -1, dtype=torch.long, device=feat.device)
            for k in range(p.shape[1]):
                upd = ok[:, k] & (vals[:, k] > best)
                best = torch.where(upd, vals[:, k], best)
                arg = torch.where(upd, p[:, k, None], arg)
            out[cs] = torch.where(arg >= 0, best, 0.0)
            argmax[cs] = arg
        else:
            total = torch.zeros(cs.shape[0], C, dtype=acc, device=feat.device)
            for k in range(p.shape[1]):
                total = torch.where(ok[:, k], total + vals[:, k], total)
            out[cs] = torch.where(count[:, None] > 0, total / count[:, None].to(acc), 0.0)
    pooled = out.view(n_cells // math.prod(dims), *dims, C).to(pts_feature.dtype)
    return (pooled, argmax) if want_argmax else pooled


def pool_reference(pts_feature, cell_start, cell_count, point_list, out_size, mode):
    return _pool(pts_feature, cell_start, cell_count, point_list, out_size, mode)


def pool_backward_reference(
    grad_out, pts_feature, cell_start, cell_count, point_list, out_size, mode
):
    """d pooled / d pts_feature (index_add: deterministic under deterministic algorithms):
    max: the gradient goes to the argmax point; avg: grad * (1 / max(count, 1)) to each point."""
    pooled, argmax = _pool(
        pts_feature, cell_start, cell_count, point_list, out_size, mode, want_argmax=True
    )
    acc = _box3d.compute_dtype(pts_feature.dtype)
    P, C = pts_feature.shape
    g = grad_out.reshape(-1, C).to(acc)
    grad = torch.zeros(P * C, dtype=acc, device=pts_feature.device)
    if _box3d.as_int(mode, "mode") == 0:
        ok = argmax >= 0
        cols = torch.arange(C, device=argmax.device).expand_as(argmax)
        grad.index_add_(0, (argmax * C + cols)[ok], g[ok])
    else:
        for cs, p, count in _slices(pts_feature, cell_start, cell_count, point_list):
            w = 1.0 / count.clamp(min=1).to(acc)
            contrib = (g[cs] * w[:, None])[:, None, :].expand(-1, p.shape[1], -1)
            targets = p[..., None] * C + torch.arange(C, device=p.device)
            ok = (p >= 0)[..., None].expand_as(targets)
            grad.index_add_(0, targets[ok], contrib[ok])
    return (grad.view(P, C).to(pts_feature.dtype),)


# The max-mode winners (int32 [cells, C]) each native pool call wrote for a pts_feature that
# needs a gradient, by (pts_feature, cell_start, cell_count, point_list): the backward loads them
# instead of walking every cell's slice again (the walk was 41.9 us of the max backward's 48 us
# on the H200, 2026-12-01; mmcv saves its argmax likewise).
SAVED_ARGMAX = SavedForBackward()


def _pool_native(c, pts_feature, cell_start, cell_count, point_list, out_size, mode):
    dims, m = c.info
    inputs = (pts_feature, cell_start, cell_count, point_list)
    pts_feature = pts_feature.contiguous()
    n_cells, C = cell_start.shape[0], pts_feature.shape[1]
    pooled = _opdef.new_output(pts_feature, (n_cells // math.prod(dims), *dims, C))
    # the winners for the backward, where one will run (the deterministic backward is the
    # reference's and finds its own)
    argmax = None
    if m == 0 and inputs[0].requires_grad and not torch.are_deterministic_algorithms_enabled():
        argmax = _opdef.new_output(pts_feature, (n_cells, C), torch.int32)  # written in full
    native.function("roiaware_pool3d_pool")(
        pts_feature,
        cell_start.contiguous(),
        cell_count.contiguous(),
        point_list.contiguous(),
        pooled,
        argmax,
        m,
        stream_handle(pts_feature),
    )
    if argmax is not None:
        SAVED_ARGMAX.put(inputs, argmax)
    return pooled


def _pool_backward_native(
    c,
    grad_out,
    pts_feature,
    cell_start,
    cell_count,
    point_list,
    out_size,
    mode,
    *,
    needs,
    deterministic,
):
    if not needs[0]:
        return (None,)
    if deterministic:  # torch's index_add: bit-identical reruns
        return pool_backward_reference(
            grad_out, pts_feature, cell_start, cell_count, point_list, out_size, mode
        )
    dims, m = c.info
    argmax = SAVED_ARGMAX.get((pts_feature, cell_start, cell_count, point_list)) if m == 0 else None
    pts_feature = pts_feature.contiguous()
    grad_in = torch.zeros(pts_feature.shape, dtype=torch.float32, device=pts_feature.device)
    native.function("roiaware_pool3d_backward")(
        grad_out.to(pts_feature.dtype).contiguous(),
        pts_feature,
        cell_start.contiguous(),
        cell_count.contiguous(),
        point_list.contiguous(),
        argmax,
        grad_in,
        m,
        stream_handle(pts_feature),
    )
    return (grad_in.to(pts_feature.dtype),)


def _pool_samples(device: torch.device) -> list[_opdef.Sample]:
    rois, pts = _roi_inputs(2000, 10, seed=2)
    feats = torch.randn(2000, 6, generator=torch.Generator().manual_seed(3))
    mapping = map_reference(rois, pts, [5, 5, 5], 16)
    mapping = tuple(t.to(device) for t in mapping)
    f = feats.to(device)
    return [
        _opdef.Sample("max, 10 RoIs, C 6 (fwd + bwd)", (f, *mapping, [5, 5, 5], 0), grad=True),
        _opdef.Sample("avg (fwd + bwd)", (f, *mapping, [5, 5, 5], 1), grad=True),
        _opdef.Sample("float16 max", (f.half(), *mapping, [5, 5, 5], 0)),
        _opdef.Sample("bfloat16 avg", (f.bfloat16(), *mapping, [5, 5, 5], 1)),
        _opdef.Sample("no cells", (f, mapping[0][:0], mapping[1][:0], mapping[2], [5, 5, 5], 0)),
    ]


POOL = _opdef.define(
    _opdef.OpDef(
        name="roiaware_pool3d_pool",
        family="box3d",
        schema="(Tensor pts_feature, Tensor cell_start, Tensor cell_count, Tensor point_list, "
        "int[] out_size, int mode) -> Tensor",
        check=_check_pool,
        reference=pool_reference,
        native=_pool_native,
        backward=_opdef.Backward(
            inputs=("pts_feature",), reference=pool_backward_reference, native=_pool_backward_native
        ),
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("roiaware_pool3d_pool", "roiaware_pool3d_backward"),
        samples=_pool_samples,
        unverified=_UNVERIFIED,
        public=False,
    )
)


@POOL.export
def roiaware_pool3d_pool(
    pts_feature, cell_start, cell_count, point_list, out_size, mode=0, *, backend: str = "auto"
):
    """Pooling of RoIAwarePool3d over the voxel lists of `roiaware_pool3d_map` -> Tensor[N, ox,
    oy, oz, C] in pts_feature's dtype: mode 0 (max) the first maximum of each cell's points per
    channel (NaN / -inf never win; 0 when none wins), mode 1 (avg) their float32 sum in list
    order / cell_count. Entries outside the list or the feature rows are skipped.
    Differentiable w.r.t. pts_feature."""
    return POOL(
        pts_feature, cell_start, cell_count, point_list, out_size3(out_size), mode, backend=backend
    )


# --------------------------------------------------------------------------- the public op


def _check(rois, pts, pts_feature, out_size, max_pts_per_voxel, mode) -> _opdef.Checked:
    c = _check_map(rois, pts, out_size, max_pts_per_voxel)
    _box3d.check_float_tensor(pts_feature, "pts_feature")
    check_same_device(pts_feature, "pts_feature", rois, "rois")
    _box3d.check_shape(pts_feature, "pts_feature", (pts.shape[0], None), "npoints, C")
    m = _box3d.as_int(mode, "mode")
    if m not in (0, 1):
        raise ValueError(f"mode must be 0 (max) or 1 (avg), got {m}")
    N, P, dims, K = c.info
    shape = (N, *dims, pts_feature.shape[1])
    return _opdef.Checked(
        pts_feature.device, pts_feature.dtype, ((shape, pts_feature.dtype),), (c, m), "pts_feature"
    )


def roiaware_pool3d_reference(rois, pts, pts_feature, out_size, max_pts_per_voxel, mode):
    mapping = MAP(rois, pts, out_size, max_pts_per_voxel, backend="reference")
    return POOL(pts_feature, *mapping, out_size, mode, backend="reference")


def _native(c, rois, pts, pts_feature, out_size, max_pts_per_voxel, mode, *, backend):
    be = "native" if backend == "auto" else backend
    mapping = MAP(rois, pts, out_size, max_pts_per_voxel, backend=be)
    return POOL(pts_feature, *mapping, out_size, mode, backend=be)


def _supports(c: _opdef.Checked) -> str | None:
    map_checked, _ = c.info
    if map_checked.dtype not in _box3d.NATIVE_DTYPES:
        return f"rois dtype {dtype_name(map_checked.dtype)} has no native kernel"
    return _map_supports(map_checked)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    rois, pts = _roi_inputs(3000, 12, seed=4)
    feats = torch.randn(3000, 5, generator=torch.Generator().manual_seed(4))
    rois, pts, feats = rois.to(device), pts.to(device), feats.to(device)
    return [
        _opdef.Sample(
            "max, 12 RoIs, 6^3, 32 per voxel (fwd + bwd)",
            (rois, pts, feats, 6, 32, "max"),
            grad=True,
        ),
        _opdef.Sample(
            "avg, (4, 6, 2) (fwd + bwd)", (rois, pts, feats, (4, 6, 2), 128, "avg"), grad=True
        ),
        _opdef.Sample("float16 max", (rois.half(), pts.half(), feats.half(), 5, 128, "max")),
        _opdef.Sample(
            "bfloat16 avg", (rois.bfloat16(), pts.bfloat16(), feats.bfloat16(), 4, 8, "avg")
        ),
        _opdef.Sample("no points", (rois, pts[:0], feats[:0], 4, 128, "max")),
        _opdef.Sample("no RoIs", (rois[:0], pts, feats, 4, 128, "avg")),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="roiaware_pool3d",
        family="box3d",
        schema="(Tensor rois, Tensor pts, Tensor pts_feature, int[] out_size, "
        "int max_pts_per_voxel, int mode) -> Tensor",
        check=_check,
        reference=roiaware_pool3d_reference,
        native=_native,
        composite=True,
        grad_inputs=("pts_feature",),
        supports=_supports,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=(
            "roiaware_pool3d_count",
            "roiaware_pool3d_fill",
            "roiaware_pool3d_sort",
            "roiaware_pool3d_pool",
            "roiaware_pool3d_backward",
        ),
        samples=_samples,
        unverified=_UNVERIFIED,
        upstream="mmcv `RoIAwarePool3d`",
        patches=("mmcv.RoIAwarePool3d",),
        models="PartA2 (mmdet3d PartAggregationROIHead), LiDAR RCNN-style RoI heads",
        doc="docs/operators/roiaware_pool3d.md",
    )
)


@OP.export
def roiaware_pool3d(
    rois, pts, pts_feature, out_size, max_pts_per_voxel=128, mode="max", *, backend: str = "auto"
) -> torch.Tensor:
    """mmcv's `RoIAwarePool3d(out_size, max_pts_per_voxel, mode)(rois, pts, pts_feature)` ->
    Tensor[N, ox, oy, oz, C]: max or average pooling of the points inside each RoI into its
    ox x oy x oz voxels.

        p inside RoI r: points_in_boxes' test (z at the RoI's bottom)
        voxel = (q((lx + dx/2) / (dx/ox), ox), q((ly + dy/2) / (dy/oy), oy), q((z - z_r) / (dz/oz), oz))
                q(v, o) = int(v) clamped to [0, o - 1]; (lx, ly) = R(-yaw) (p - centre)
        each voxel keeps its first max_pts_per_voxel - 1 points in ascending point index (mmcv)
        max: the first maximum per channel (NaN / -inf never win; 0 if none), avg: the float32
             sum in index order / the number of kept points (0 if none)

    Args:
        rois: Tensor[N, 7] (x, y, z, dx, dy, dz, yaw), z at the bottom; float32 / float16 /
            bfloat16 (float64: reference path).
        pts: Tensor[npoints, 3], rois' dtype. pts_feature: Tensor[npoints, C] floating.
        out_size: int n (n, n, n) or 3 ints. max_pts_per_voxel: int >= 1 (mmcv keeps
            max_pts_per_voxel - 1 points: its slot 0 is the counter). mode: "max" | "avg".
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Differentiable w.r.t. pts_feature (max: to the argmax point; avg: grad / count per point).
    One host synchronisation per forward (the total of (point, RoI) pairs); no RoI, point or
    out_size limit but memory (mmcv: out_size <= 256, packed in 8 bits).
    """
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be 'max' or 'avg', got {mode!r}")
    return OP(
        rois,
        pts,
        pts_feature,
        out_size3(out_size),
        _box3d.as_int(max_pts_per_voxel, "max_pts_per_voxel", 1),
        _MODES[mode],
        backend=backend,
    )


class RoIAwarePool3d(nn.Module):
    """mmcv's `RoIAwarePool3d(out_size, max_pts_per_voxel=128, mode='max')`:
    forward(rois, pts, pts_feature) -> Tensor[N, ox, oy, oz, C] through `roiaware_pool3d`."""

    def __init__(self, out_size, max_pts_per_voxel: int = 128, mode: str = "max"):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode must be 'max' or 'avg', got {mode!r}")
        self.out_size = out_size
        self.max_pts_per_voxel = max_pts_per_voxel
        self.mode = mode

    def forward(self, rois, pts, pts_feature):
        return roiaware_pool3d(
            rois, pts, pts_feature, self.out_size, self.max_pts_per_voxel, self.mode
        )
