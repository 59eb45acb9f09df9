"""`box_iou_rotated`: IoU / IoF of rotated rectangles (mmcv.ops.box_iou_rotated). Formula,
conventions and the differences from mmcv: the public function's docstring and
docs/operators/boxes_overlap_bev.md (the pairwise BEV family page).

Native path: csrc/box3d/box_overlap_musa.mu (box3d_bev_pairwise, kinds kRotatedIoU /
kRotatedIoF, layout kXywhr; clockwise=False negates the angles in the kernel, no copy).
"""

from __future__ import annotations

import torch

from mu_space.ops import _box3d, _opdef
from mu_space.ops.iou3d import check_pair, pairwise_native, pairwise_reference

_UNVERIFIED = _box3d.UNVERIFIED
_MODES = {"iou": _box3d.ROTATED_IOU, "iof": _box3d.ROTATED_IOF}


def _check(bboxes1, bboxes2, mode, aligned, clockwise) -> _opdef.Checked:
    check_pair(bboxes1, bboxes2, 5, "N, (x, y, w, h, theta)", "bboxes1", "bboxes2")
    if mode not in _MODES:
        raise ValueError(f"mode must be 'iou' or 'iof', got {mode!r}")
    n, m = bboxes1.shape[0], bboxes2.shape[0]
    if aligned and n != m:
        raise ValueError(
            f"bboxes2 must have {n} rows (aligned=True pairs row i with row i), got {m}"
        )
    shape = (n,) if aligned else (n, m)
    return _opdef.Checked(bboxes1.device, bboxes1.dtype, ((shape, bboxes1.dtype),), None, "bboxes1")


def box_iou_rotated_reference(bboxes1, bboxes2, mode, aligned, clockwise):
    _check(bboxes1, bboxes2, mode, aligned, clockwise)
    return pairwise_reference(bboxes1, bboxes2, _box3d.XYWHR, _MODES[mode], aligned, not clockwise)


def _native(c, bboxes1, bboxes2, mode, aligned, clockwise):
    return pairwise_native(bboxes1, bboxes2, _box3d.XYWHR, _MODES[mode], aligned, not clockwise)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import boxes as box_inputs

    a, _ = box_inputs.detections(120, seed=7, extent=15.0)
    b, _ = box_inputs.detections(80, seed=8, extent=15.0)
    a, b = box_inputs.xywhr(a).to(device), box_inputs.xywhr(b).to(device)
    return [
        _opdef.Sample("120 x 80, iou", (a, b, "iou", False, True)),
        _opdef.Sample("iof, counter-clockwise, float16", (a.half(), b.half(), "iof", False, False)),
        _opdef.Sample("aligned, bfloat16", (a[:80].bfloat16(), b.bfloat16(), "iou", True, True)),
        _opdef.Sample("no bboxes1", (a[:0], b, "iou", False, True)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="box_iou_rotated",
        family="box3d",
        schema="(Tensor bboxes1, Tensor bboxes2, str mode, bool aligned, bool clockwise) -> Tensor",
        check=_check,
        reference=box_iou_rotated_reference,
        native=_native,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("box3d_bev_pairwise",),
        samples=_samples,
        unverified=_UNVERIFIED,
        upstream="mmcv `box_iou_rotated`",
        patches=("mmcv.box_iou_rotated",),
        models="mmdet3d / mmrotate rotated assigners, mmcv nms_rotated users",
        doc="docs/operators/boxes_overlap_bev.md",
    )
)


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


@OP.export
def box_iou_rotated(
    bboxes1, bboxes2, mode="iou", aligned=False, clockwise=True, *, backend: str = "auto"
) -> torch.Tensor:
    """mmcv's `box_iou_rotated(bboxes1, bboxes2, mode='iou', aligned=False, clockwise=True)`
    -> Tensor[N, M] (aligned: Tensor[N]): IoU or IoF of rotated rectangles (x, y, w, h, theta),
    theta in radians.

        ov  = exact area of rect_1 ∩ rect_2 (float32; float64 inputs: float64)
        iou = 0 if w1*h1 <= 1e-14 or w2*h2 <= 1e-14 else ov / (w1*h1 + w2*h2 - ov)
        iof = 0 if ... (the same area rule) else ov / (w1*h1)
        corners of a rectangle: centre + R(theta) (+-w/2, +-h/2); clockwise=False negates theta
        (mmcv: "the positive angular orientation is clockwise" in image coordinates, y down)

    Args:
        bboxes1: Tensor[N, 5] float32 / float16 / bfloat16 (float64: reference path).
        bboxes2: Tensor[M, 5] (aligned: M == N), bboxes1's dtype and device.
        mode: "iou" | "iof"; aligned: pair row i with row i; clockwise: the angle convention.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns bboxes1's dtype. A box with a non-finite value gives NaN (mmcv: undefined), a size
    <= 0 gives 0. mmcv's kernel (detectron2's) clips with a 1e-14 parallel-edge tolerance and a
    convex hull; here the intersection is exact (Sutherland-Hodgman), robust for identical,
    touching and nested rectangles.
    """
    if not isinstance(mode, str):
        raise TypeError(f"mode must be 'iou' or 'iof', got {type(mode).__name__}")
    return OP(
        bboxes1,
        bboxes2,
        mode,
        _flag(aligned, "aligned"),
        _flag(clockwise, "clockwise"),
        backend=backend,
    )
