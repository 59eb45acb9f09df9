"""OpenPCDet's `pcdet.ops.iou3d_nms.iou3d_nms_utils` call convention on top of the mmcv-style
operators (thin adapters, no kernels of their own), and `box3d_nms_ordered`, the family's NMS
with an explicit visiting order (OpenPCDet sorts once; mmcv's nms3d sorts inside).

    boxes_iou_bev(boxes_a[N, 7], boxes_b[M, 7])    -> IoU [N, M]: ov / max(sa + sb - ov, 1e-8)
    boxes_bev_iou_cpu(boxes_a, boxes_b)            -> the same on CPU tensors / numpy arrays
    nms_gpu(boxes[N, 7], scores, thresh, pre_maxsize=None, **kwargs)  -> (keep, None)
    nms_normal_gpu(boxes[N, 7], scores, thresh, **kwargs)             -> (keep, None)
    points_in_boxes_gpu(points[B, M, 3], boxes[B, T, 7])  -> [B, M] first box or -1
    points_in_boxes_cpu(points[M, 3], boxes[T, 7])        -> [T, M] 0 / 1 (numpy in, numpy out)
      (roiaware_pool3d_utils; OpenPCDet's boxes have z at the CENTRE: z - dz/2 is passed on)

docs/operators/nms3d.md and boxes_overlap_bev.md state the conventions (7-value LiDAR boxes,
OpenPCDet's z is the box centre, unused here; exact overlap instead of the 1 cm margin).
"""

from __future__ import annotations

import torch

from mu_space.ops import _box3d, _opdef
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops.iou3d import (
    boxes_overlap_bev,
    check_nms,
    nms_fake,
    nms_supports,
    run_nms,
)

_UNVERIFIED = _box3d.UNVERIFIED
_KINDS = {"iou3d": _box3d.IOU3D, "normal": _box3d.NORMAL}


def _check(boxes, order, kind, threshold, max_keep) -> _opdef.Checked:
    _box3d.check_float_tensor(boxes, "boxes")
    _box3d.check_shape(boxes, "boxes", (None, 7), "N, (x, y, z, dx, dy, dz, yaw)")
    check_tensor(order, "order")
    if order.dtype != torch.int64:
        raise TypeError(f"order must be int64, got {dtype_name(order.dtype)}")
    check_same_device(order, "order", boxes, "boxes")
    _box3d.check_shape(order, "order", (None,), "rows of boxes in visiting order")
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'iou3d' or 'normal', got {kind!r}")
    return _opdef.Checked(boxes.device, boxes.dtype, None, order.shape[0], "boxes")


def _reference(boxes, order, kind, threshold, max_keep):
    _check(boxes, order, kind, threshold, max_keep)
    return run_nms(boxes, order, _box3d.LIDAR7, _KINDS[kind], threshold, max_keep, False)


def _native(c, boxes, order, kind, threshold, max_keep):
    return run_nms(boxes, order, _box3d.LIDAR7, _KINDS[kind], threshold, max_keep, True)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import boxes as box_inputs

    b, s = box_inputs.detections(260, seed=14, extent=20.0)
    b, s = b.to(device), s.to(device)
    order = s.sort(0, descending=True)[1][:200]
    return [
        _opdef.Sample("260 detections, top 200, iou3d 0.7", (b, order, "iou3d", 0.7, None)),
        _opdef.Sample("normal 0.3, float16, keep 50", (b.half(), order, "normal", 0.3, 50)),
        _opdef.Sample("bfloat16", (b.bfloat16(), order[:90], "iou3d", 0.1, None)),
        _opdef.Sample("empty order", (b, order[:0], "iou3d", 0.7, None)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="box3d_nms_ordered",
        family="box3d",
        schema="(Tensor boxes, Tensor order, str kind, float threshold, int? max_keep) -> Tensor",
        check=_check,
        reference=_reference,
        native=_native,
        fake=nms_fake,
        supports=nms_supports,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("box3d_nms",),
        samples=_samples,
        unverified=_UNVERIFIED,
        public=False,
    )
)


@OP.export
def box3d_nms_ordered(boxes, order, kind="iou3d", threshold=0.5, max_keep=None, *, backend="auto"):
    """Greedy NMS of LiDAR boxes [N, 7] visited in the given `order` (Tensor[K] int64 rows of
    boxes): keep a box unless a kept box has IoU > threshold with it; stop after max_keep kept;
    returns order[kept] (Tensor int64). kind "iou3d": mmcv / OpenPCDet iou_bev (exact rotated
    overlap / max(union, 1e-8)); "normal": the axis-aligned iou_normal. The threshold is
    compared as a float32. The primitive behind OpenPCDet's nms_gpu / nms_normal_gpu, which sort
    once themselves.
    """
    return OP(
        boxes,
        order,
        kind,
        _box3d.as_float(threshold, "threshold"),
        _box3d.as_optional_int(max_keep, "max_keep"),
        backend=backend,
    )


# --------------------------------------------------------------------------- the adapters


def _iou_from_overlap(boxes_a, boxes_b, backend):
    ov = boxes_overlap_bev(boxes_a, boxes_b, backend=backend)
    sa = (boxes_a[:, 3] * boxes_a[:, 4]).to(ov.dtype)
    sb = (boxes_b[:, 3] * boxes_b[:, 4]).to(ov.dtype)
    return ov / torch.clamp(sa[:, None] + sb[None, :] - ov, min=1e-8)


def boxes_iou_bev(boxes_a, boxes_b, *, backend: str = "auto"):
    """OpenPCDet's `iou3d_nms_utils.boxes_iou_bev(boxes_a, boxes_b)`: boxes [N, 7] / [M, 7]
    (x, y, z, dx, dy, dz, heading) -> IoU [N, M] = ov / max(dx_a dy_a + dx_b dy_b - ov, 1e-8)
    with ov the exact BEV overlap (`boxes_overlap_bev`)."""
    return _iou_from_overlap(boxes_a, boxes_b, backend)


def boxes_bev_iou_cpu(boxes_a, boxes_b):
    """OpenPCDet's `boxes_bev_iou_cpu`: the same IoU for CPU tensors or numpy arrays (numpy in,
    numpy out)."""
    import numpy as np

    is_numpy = isinstance(boxes_a, np.ndarray)
    a = torch.from_numpy(boxes_a) if is_numpy else boxes_a
    b = torch.from_numpy(boxes_b) if isinstance(boxes_b, np.ndarray) else boxes_b
    if a.is_cuda or b.is_cuda:
        raise ValueError("boxes_a and boxes_b must be CPU tensors (OpenPCDet: 'Only support CPU')")
    iou = _iou_from_overlap(a, b, "reference")
    return iou.numpy() if is_numpy else iou


def nms_gpu(boxes, scores, thresh, pre_maxsize=None, *, backend: str = "auto", **kwargs):
    """OpenPCDet's `nms_gpu(boxes, scores, thresh, pre_maxsize=None, **kwargs)` -> (keep, None):
    scores sorted once (`scores.sort(0, descending=True)`), cut to pre_maxsize, greedy NMS with
    mmcv iou3d's IoU; keep = the kept indices into boxes, highest score first."""
    check_nms(boxes, scores, 7, "N, (x, y, z, dx, dy, dz, heading)")
    order = scores.sort(0, descending=True)[1]
    if pre_maxsize is not None:
        order = order[: _box3d.as_int(pre_maxsize, "pre_maxsize")]
    return box3d_nms_ordered(boxes, order, "iou3d", thresh, None, backend=backend), None


def nms_normal_gpu(boxes, scores, thresh, *, backend: str = "auto", **kwargs):
    """OpenPCDet's `nms_normal_gpu(boxes, scores, thresh, **kwargs)` -> (keep, None): the same
    with the axis-aligned IoU (heading ignored)."""
    check_nms(boxes, scores, 7, "N, (x, y, z, dx, dy, dz, heading)")
    order = scores.sort(0, descending=True)[1]
    return box3d_nms_ordered(boxes, order, "normal", thresh, None, backend=backend), None


def _bottom(boxes: torch.Tensor) -> torch.Tensor:
    """OpenPCDet's centre-z boxes in mmcv's bottom-z layout (z - dz/2; one rounding, so a point
    within ~1 ulp of a top or bottom face can differ from OpenPCDet's own test)."""
    out = boxes.clone()
    out[..., 2] = boxes[..., 2] - boxes[..., 5] / 2
    return out


def points_in_boxes_gpu(points, boxes, *, backend: str = "auto"):
    """OpenPCDet's `roiaware_pool3d_utils.points_in_boxes_gpu(points, boxes)`: points [B, M, 3],
    boxes [B, T, 7] (x, y, z centre, dx, dy, dz, heading) -> [B, M] int32, the first box holding
    each point or -1 (`points_in_boxes_part` of the bottom-z boxes)."""
    from mu_space.ops.points_in_boxes import points_in_boxes_part

    _box3d.check_float_tensor(boxes, "boxes")
    return points_in_boxes_part(points, _bottom(boxes), backend=backend)


def points_in_boxes_cpu(points, boxes):
    """OpenPCDet's `roiaware_pool3d_utils.points_in_boxes_cpu(points, boxes)`: points [M, 3],
    boxes [T, 7] (z centre), tensors or numpy arrays -> point_indices [T, M] (1 inside, else 0;
    int32, numpy for numpy input). Note the [T, M] layout (mmcv's points_in_boxes_cpu returns
    [B, M, T])."""
    import numpy as np

    is_numpy = isinstance(points, np.ndarray)
    p = torch.from_numpy(points) if is_numpy else points
    b = torch.from_numpy(boxes) if isinstance(boxes, np.ndarray) else boxes
    _box3d.check_float_tensor(p, "points")
    _box3d.check_float_tensor(b, "boxes")
    from mu_space.ops.points_in_boxes import points_in_boxes_all

    out = points_in_boxes_all(p[None], _bottom(b)[None].to(p.dtype), backend="reference")[0].T
    return out.contiguous().numpy() if is_numpy else out.contiguous()
