"""`boxes_overlap_bev`, `boxes_iou_bev`, `nms3d`, `nms3d_normal`, `nms_bev`: the BEV overlap /
IoU and NMS of mmcv.ops.iou3d. Formulas, conventions and the differences from mmcv: the public
functions' docstrings, docs/operators/boxes_overlap_bev.md and docs/operators/nms3d.md.

Native paths: csrc/box3d/box_overlap_musa.mu (pairwise values) and csrc/box3d/nms_musa.mu (the
suppression mask and the greedy walk on the GPU). The NMS ops sort the scores with the very
call mmcv makes (`scores.sort(0, descending=True)`, twice for nms_bev as mmcv's nms_bev ->
nms_rotated), so the keep order and the tie-breaking are mmcv's on the same torch build; the
only host synchronisation is reading the kept count.
"""

from __future__ import annotations

import functools

import torch

from mu_space.ops import _box3d, _opdef
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

_UNVERIFIED = _box3d.UNVERIFIED
_PAIR_ENTRY = ("box3d_bev_pairwise",)
_NMS_ENTRY = ("box3d_nms",)


# --------------------------------------------------------------------------- pairwise


def check_pair(boxes_a, boxes_b, width: int, what: str, name_a="boxes_a", name_b="boxes_b"):
    _box3d.check_float_tensor(boxes_a, name_a)
    _box3d.check_shape(boxes_a, name_a, (None, width), what)
    _box3d.check_float_tensor(boxes_b, name_b, boxes_a, name_a)
    _box3d.check_shape(boxes_b, name_b, (None, width), what)


def pairwise_reference(boxes_a, boxes_b, layout: int, kind: int, aligned=False, flip=False):
    """values[i, j] = box3d::pair_value(a_i, b_j) (aligned: values[i] of (a_i, b_i)) in
    boxes_a's dtype, computed in float32 (float64 for float64)."""
    a = _box3d.rects(boxes_a, layout, flip)
    b = _box3d.rects(boxes_b, layout, flip)
    if not aligned:
        a = _box3d.Rects(*(t[:, None] for t in a))
        b = _box3d.Rects(*(t[None, :] for t in b))
    return _box3d.pair_values(a, b, kind).to(boxes_a.dtype)


def pairwise_native(boxes_a, boxes_b, layout: int, kind: int, aligned=False, flip=False):
    boxes_a, boxes_b = boxes_a.contiguous(), boxes_b.contiguous()
    n, m = boxes_a.shape[0], boxes_b.shape[0]
    out = _opdef.new_output(boxes_a, (n,) if aligned else (n, m))
    if n and m:
        native.function("box3d_bev_pairwise")(
            boxes_a, boxes_b, out, layout, kind, aligned, flip, stream_handle(boxes_a)
        )
    return out


def _check_overlap(boxes_a, boxes_b) -> _opdef.Checked:
    check_pair(boxes_a, boxes_b, 7, "N, (x, y, z, dx, dy, dz, yaw)")
    shape = (boxes_a.shape[0], boxes_b.shape[0])
    return _opdef.Checked(boxes_a.device, boxes_a.dtype, ((shape, boxes_a.dtype),), None, "boxes_a")


def _check_iou_bev(boxes_a, boxes_b) -> _opdef.Checked:
    check_pair(boxes_a, boxes_b, 5, "N, (x1, y1, x2, y2, ry)")
    shape = (boxes_a.shape[0], boxes_b.shape[0])
    return _opdef.Checked(boxes_a.device, boxes_a.dtype, ((shape, boxes_a.dtype),), None, "boxes_a")


def _pair_samples(width: int, convert):
    def samples(device: torch.device) -> list[_opdef.Sample]:
        from mu_space.testing import boxes as box_inputs

        a, _ = box_inputs.detections(150, seed=1, extent=20.0)
        b, _ = box_inputs.detections(90, seed=2, extent=20.0)
        a, b = convert(a).to(device), convert(b).to(device)
        return [
            _opdef.Sample("150 x 90 detections", (a, b)),
            _opdef.Sample("identical sets, float16", (a[:40].half(), a[:40].half())),
            _opdef.Sample("bfloat16", (a[:30].bfloat16(), b.bfloat16())),
            _opdef.Sample("no boxes_b", (a, b[:0])),
        ]

    return samples


OVERLAP = _opdef.define(
    _opdef.OpDef(
        name="boxes_overlap_bev",
        family="box3d",
        schema="(Tensor boxes_a, Tensor boxes_b) -> Tensor",
        check=_check_overlap,
        reference=lambda a, b: pairwise_reference(a, b, _box3d.LIDAR7, _box3d.OVERLAP),
        native=lambda c, a, b: pairwise_native(a, b, _box3d.LIDAR7, _box3d.OVERLAP),
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=_PAIR_ENTRY,
        samples=_pair_samples(7, lambda t: t),
        unverified=_UNVERIFIED,
        upstream="mmcv `boxes_overlap_bev`",
        patches=(
            "mmcv.boxes_overlap_bev",
            "mmcv._ext.iou3d_boxes_overlap_bev_forward",
            "pcdet.boxes_iou_bev",
            "pcdet.boxes_bev_iou_cpu",
        ),
        models="mmdet3d boxes_iou3d / BboxOverlaps3D, PartA2 / PV-RCNN target assignment",
        doc="docs/operators/boxes_overlap_bev.md",
    )
)


@OVERLAP.export
def boxes_overlap_bev(boxes_a, boxes_b, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `boxes_overlap_bev(boxes_a, boxes_b)` -> Tensor[M, N]: the exact area of the BEV
    intersection of every pair of LiDAR boxes.

        overlap[i, j] = area(rect(a_i) ∩ rect(b_j)),  rect(box) = (x, y, dx, dy, yaw)

    Args:
        boxes_a: Tensor[M, 7] (x, y, z, dx, dy, dz, yaw) float32 / float16 / bfloat16
            (float64: reference path); z and dz are not used.
        boxes_b: Tensor[N, 7], boxes_a's dtype and device.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns Tensor[M, N] in boxes_a's dtype (float32 computation). Exact geometry: mmcv's kernel
    counts corners within a 1 cm margin as inside (`check_in_box2d`), which moves a small share
    of its overlaps by up to ~0.02 m^2; here identical, touching and nested boxes are exact. A
    box with a non-finite value gives NaN, a size <= 0 gives 0.
    """
    return OVERLAP(boxes_a, boxes_b, backend=backend)


IOU_BEV = _opdef.define(
    _opdef.OpDef(
        name="boxes_iou_bev",
        family="box3d",
        schema="(Tensor boxes_a, Tensor boxes_b) -> Tensor",
        check=_check_iou_bev,
        reference=lambda a, b: pairwise_reference(a, b, _box3d.XYXYR, _box3d.ROTATED_IOU),
        native=lambda c, a, b: pairwise_native(a, b, _box3d.XYXYR, _box3d.ROTATED_IOU),
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=_PAIR_ENTRY,
        samples=_pair_samples(5, lambda t: _xyxyr(t)),
        unverified=_UNVERIFIED,
        upstream="mmcv `boxes_iou_bev` (iou3d)",
        patches=("mmcv.boxes_iou_bev",),
        models="mmdet3d (deprecated path), SECOND / PointPillars assigners",
        doc="docs/operators/boxes_overlap_bev.md",
    )
)


def _xyxyr(boxes7: torch.Tensor) -> torch.Tensor:
    from mu_space.testing import boxes as box_inputs

    return box_inputs.xyxyr(boxes7)


@IOU_BEV.export
def boxes_iou_bev(boxes_a, boxes_b, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `iou3d.boxes_iou_bev(boxes_a, boxes_b)` -> Tensor[M, N]: BEV IoU of boxes in mmcv's
    deprecated [x1, y1, x2, y2, ry] layout, i.e. `box_iou_rotated` of
    ((x1+x2)/2, (y1+y2)/2, x2-x1, y2-y1, ry) (the conversion mmcv makes).

        iou[i, j] = 0 if an area <= 1e-14 else ov / (area_a + area_b - ov)

    Args:
        boxes_a: Tensor[M, 5] float32 / float16 / bfloat16 (float64: reference path).
        boxes_b: Tensor[N, 5], boxes_a's dtype and device.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns Tensor[M, N] in boxes_a's dtype. For OpenPCDet's boxes_iou_bev of 7-value boxes see
    `mu_space.ops.pcdet.boxes_iou_bev`.
    """
    return IOU_BEV(boxes_a, boxes_b, backend=backend)


# --------------------------------------------------------------------------- NMS


def check_nms(boxes, scores, width: int, what: str, boxes_name="boxes") -> _opdef.Checked:
    _box3d.check_float_tensor(boxes, boxes_name)
    _box3d.check_shape(boxes, boxes_name, (None, width), what)
    _box3d.check_float_tensor(scores, "scores")
    if scores.device != boxes.device:
        raise ValueError(
            f"scores must be on {boxes.device} (the device of {boxes_name}), got {scores.device}"
        )
    _box3d.check_shape(scores, "scores", (boxes.shape[0],), f"one score per row of {boxes_name}")
    return _opdef.Checked(boxes.device, boxes.dtype, None, boxes.shape[0], boxes_name)


def nms_fake(boxes, *args):
    ctx = torch.library.get_ctx()
    return boxes.new_empty(ctx.new_dynamic_size(), dtype=torch.int64)


def threshold_for(thresh: float, kind: int, dtype: torch.dtype) -> float:
    """The threshold the comparison uses: float64 inputs compare in float64; otherwise the
    float32 value (nearest, as mmcv's C++ `float` parameter; circle: rounded down, which keeps
    mmdet3d's float64 `<=` exact)."""
    if dtype == torch.float64:
        return thresh
    return _box3d.f32_down(thresh) if kind == _box3d.CIRCLE else _box3d.f32_nearest(thresh)


def run_nms(boxes, order, layout: int, kind: int, thresh: float, max_keep, backend_native: bool):
    """order[kept] of the greedy NMS (box3d_nms / _box3d.nms_reference); max_keep None: all."""
    thr = threshold_for(thresh, kind, boxes.dtype)
    if max_keep == 0 or order.numel() == 0:
        return order.new_zeros(0)
    if not backend_native:
        return _box3d.nms_reference(boxes, order, layout, kind, thr, max_keep)
    boxes = boxes.contiguous()
    order = order.contiguous()
    n = order.shape[0]
    workspace = torch.empty(_nms_workspace_ints(n), dtype=torch.int64, device=boxes.device)
    keep = torch.empty(n + 1, dtype=torch.int64, device=boxes.device)  # [kept rows..., count]
    native.function("box3d_nms")(
        boxes, order, workspace, keep, layout, kind, thr, max_keep or 0, stream_handle(boxes)
    )
    return keep[: int(keep[n])]  # the one host synchronisation; offset 0, as the fake


@functools.lru_cache(maxsize=256)
def _nms_workspace_ints(n: int) -> int:
    return int(native.function("box3d_nms_workspace_ints")(n))


def nms_supports(c: _opdef.Checked) -> str | None:
    if c.info > (limit := native.limit("box3d_nms.max_boxes")):
        return f"{c.info} boxes exceed the native NMS limit of {limit}"
    return None


def _nms_samples(kind: str):
    def samples(device: torch.device) -> list[_opdef.Sample]:
        from mu_space.testing import boxes as box_inputs

        b, s = box_inputs.detections(300, seed=4, extent=25.0)
        if kind == "bev":
            b = box_inputs.xyxyr(b)
        b, s = b.to(device), s.to(device)
        tied = box_inputs.tied_scores(120, seed=1).to(device)
        extra = (0.7,) if kind != "bev" else (0.7, None, None)
        capped = (0.5, 200, 40) if kind == "bev" else (0.5,)
        return [
            _opdef.Sample("300 detections, IoU 0.7", (b, s, *extra)),
            _opdef.Sample(
                "float16 boxes, capped" if kind == "bev" else "float16", (b.half(), s, *capped)
            ),
            _opdef.Sample("bfloat16, tied scores", (b[:120].bfloat16(), tied, *extra)),
            _opdef.Sample("no boxes", (b[:0], s[:0], *extra)),
        ]

    return samples


def _nms3d_check(boxes, scores, iou_threshold) -> _opdef.Checked:
    return check_nms(boxes, scores, 7, "N, (x, y, z, dx, dy, dz, yaw)")


def _nms_bev_check(boxes, scores, thresh, pre_max_size, post_max_size) -> _opdef.Checked:
    c = check_nms(boxes, scores, 5, "N, (x1, y1, x2, y2, ry)")
    if pre_max_size is not None and pre_max_size >= 0:  # the native limit is on visited boxes
        c.info = min(c.info, pre_max_size)
    return c


def _nms3d_impl(kind: int):
    def reference(boxes, scores, iou_threshold):
        order = scores.sort(0, descending=True)[1]
        return run_nms(boxes, order, _box3d.LIDAR7, kind, iou_threshold, None, False)

    def native_fn(c, boxes, scores, iou_threshold):
        order = scores.sort(0, descending=True)[1]
        return run_nms(boxes, order, _box3d.LIDAR7, kind, iou_threshold, None, True)

    return reference, native_fn


def _bev_order(scores, pre_max_size, skip_stable_resort=False):
    """mmcv's nms_bev -> nms_rotated visiting order: sorted, cut to pre_max_size, sorted again.

    skip_stable_resort: leave out the second sort where it is the identity. scores[order] is
    already in descending order, so a STABLE sort returns it unchanged. torch's CUDA sort of a
    slice of <= 4096 elements (sortKeyValueInplace, torch 2.x; this package needs >= 2.4): a
    bitonic sort (unstable) up to 32 elements, a stable warp merge sort up to 128, a stable
    radix sort above (builds without the merge sort: the radix sort from 33 on). Their orders
    agree: NaN first, and the only keys one calls equal and the other orders are -0.0 / +0.0
    (the radix keys order them, the comparator keeps them in place), so no pair is ordered
    differently. Above 4096 elements the first sort is another algorithm (CUB's radix keys,
    with their own NaN and signed-zero order), so only 32 < len(order) and len(scores) <= 4096
    skip it, on CUDA builds (not ROCm, not torch_musa: other sort kernels)."""
    order = scores.sort(0, descending=True)[1]
    if pre_max_size is not None:
        order = order[:pre_max_size]
    if skip_stable_resort and _stable_resort_is_identity(scores, order.shape[0]):
        return order
    return order[scores[order].sort(0, descending=True)[1]]


def _stable_resort_is_identity(scores, m: int) -> bool:
    return (
        scores.device.type == "cuda"
        and torch.version.hip is None
        and _STABLE_SORT_MIN < m
        and scores.shape[0] <= _SMALL_SORT_MAX
    )


_STABLE_SORT_MIN = 32  # torch's CUDA sort: bitonic (unstable) up to this many elements
_SMALL_SORT_MAX = 4096  # torch's CUDA sort: sortKeyValueInplace up to this many elements


def _nms_bev_reference(boxes, scores, thresh, pre_max_size, post_max_size):
    order = _bev_order(scores, pre_max_size)
    return run_nms(boxes, order, _box3d.XYXYR, _box3d.ROTATED_IOU, thresh, post_max_size, False)


def _nms_bev_native(c, boxes, scores, thresh, pre_max_size, post_max_size):
    order = _bev_order(scores, pre_max_size, skip_stable_resort=True)
    return run_nms(boxes, order, _box3d.XYXYR, _box3d.ROTATED_IOU, thresh, post_max_size, True)


_NMS_COMMON = dict(
    family="box3d",
    fake=nms_fake,
    supports=nms_supports,
    native_dtypes=_box3d.NATIVE_DTYPES,
    entry_points=_NMS_ENTRY,
    unverified=_UNVERIFIED,
    doc="docs/operators/nms3d.md",
)

_ref3, _nat3 = _nms3d_impl(_box3d.IOU3D)
NMS3D = _opdef.define(
    _opdef.OpDef(
        name="nms3d",
        schema="(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor",
        check=_nms3d_check,
        reference=_ref3,
        native=_nat3,
        samples=_nms_samples("3d"),
        upstream="mmcv `nms3d`",
        patches=("mmcv.nms3d", "pcdet.nms_gpu"),
        models="mmdet3d box3d_multiclass_nms (PointPillars, SECOND, PartA2, CenterPoint)",
        **_NMS_COMMON,
    )
)

_refn, _natn = _nms3d_impl(_box3d.NORMAL)
NMS3D_NORMAL = _opdef.define(
    _opdef.OpDef(
        name="nms3d_normal",
        schema="(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor",
        check=_nms3d_check,
        reference=_refn,
        native=_natn,
        samples=_nms_samples("3d"),
        upstream="mmcv `nms3d_normal`",
        patches=("mmcv.nms3d_normal", "pcdet.nms_normal_gpu"),
        models="mmdet3d box3d_multiclass_nms with use_rotate_nms=False",
        **_NMS_COMMON,
    )
)

NMS_BEV = _opdef.define(
    _opdef.OpDef(
        name="nms_bev",
        schema="(Tensor boxes, Tensor scores, float thresh, int? pre_max_size, "
        "int? post_max_size) -> Tensor",
        check=_nms_bev_check,
        reference=_nms_bev_reference,
        native=_nms_bev_native,
        samples=_nms_samples("bev"),
        upstream="mmcv / mmdet3d `nms_bev`",
        patches=("mmcv.nms_bev", "mmdet3d.nms_bev", "mmdet3d.core.nms_bev"),
        models="mmdet3d CenterPoint (nms_type='rotate'), box3d_multiclass_nms",
        **_NMS_COMMON,
    )
)

_NMS_RULES = """
    Greedy NMS: visit the boxes in the order of `scores.sort(0, descending=True)` (the call mmcv
    makes: the same ties, the same order on the same torch build), keep a box unless a kept box
    has IoU > threshold with it. The IoU is computed in float32 (float64 inputs: float64), the
    threshold compared as a float32 (mmcv's C++ float). NaN IoUs (a non-finite box) never
    suppress. No host round trip per box: the suppression mask and the greedy walk run on the
    GPU; the kept count is read back once.
"""


@NMS3D.export
def nms3d(boxes, scores, iou_threshold, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `nms3d(boxes, scores, iou_threshold)` -> Tensor[K] int64: indices of the kept
    boxes, highest score first; IoU = mmcv iou3d's rotated BEV IoU of LiDAR boxes

        iou = ov / max(dx_a*dy_a + dx_b*dy_b - ov, 1e-8),  ov = exact BEV intersection area

    Args:
        boxes: Tensor[N, 7] (x, y, z, dx, dy, dz, yaw) float32 / float16 / bfloat16 (float64:
            reference path); z and dz are not used.
        scores: Tensor[N] floating, boxes' device.
        iou_threshold: float.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".
    """
    return NMS3D(boxes, scores, _box3d.as_float(iou_threshold, "iou_threshold"), backend=backend)


@NMS3D_NORMAL.export
def nms3d_normal(boxes, scores, iou_threshold, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `nms3d_normal(boxes, scores, iou_threshold)` -> Tensor[K] int64: NMS with the
    axis-aligned BEV IoU (yaw ignored), mmcv's iou_normal:

        iou = w*h / max(dx_a*dy_a + dx_b*dy_b - w*h, 1e-8),  w, h = the overlap of the
        axis-aligned (x -+ dx/2, y -+ dy/2) rectangles

    Args: as `nms3d` (boxes Tensor[N, 7], scores Tensor[N], iou_threshold float, backend).
    """
    return NMS3D_NORMAL(
        boxes, scores, _box3d.as_float(iou_threshold, "iou_threshold"), backend=backend
    )


@NMS_BEV.export
def nms_bev(
    boxes, scores, thresh, pre_max_size=None, post_max_size=None, *, backend: str = "auto"
) -> torch.Tensor:
    """mmcv's / mmdet3d's `nms_bev(boxes, scores, thresh, pre_max_size=None,
    post_max_size=None)` -> Tensor[K] int64, K <= post_max_size: rotated NMS of boxes in the
    [x1, y1, x2, y2, ry] layout, i.e. mmcv's `nms_rotated` of ((x1+x2)/2, (y1+y2)/2, x2-x1,
    y2-y1, ry) with box_iou_rotated's IoU (0 when an area <= 1e-14, else ov / union).

    Order as mmcv: sort, keep the first pre_max_size, sort those again (nms_rotated), greedy;
    the first post_max_size kept boxes (the walk stops there).

    Args:
        boxes: Tensor[N, 5] float32 / float16 / bfloat16 (float64: reference path).
        scores: Tensor[N] floating, boxes' device.
        thresh: float IoU threshold.
        pre_max_size, post_max_size: int >= 0 or None (no limit). mmcv slices with them, so a
            negative value would drop boxes from the end; here it is a ValueError.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Empty input gives Tensor[0] (mmcv's gives a [1, 0] tensor: nms_rotated returns None).
    """
    return NMS_BEV(
        boxes,
        scores,
        _box3d.as_float(thresh, "thresh"),
        _box3d.as_optional_int(pre_max_size, "pre_max_size"),
        _box3d.as_optional_int(post_max_size, "post_max_size"),
        backend=backend,
    )


for _fn in (nms3d, nms3d_normal, nms_bev):
    _fn.__doc__ = (_fn.__doc__ or "").rstrip() + "\n" + _NMS_RULES
