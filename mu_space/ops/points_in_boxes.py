"""`points_in_boxes_part`, `points_in_boxes_all`, `points_in_boxes_cpu`: which LiDAR boxes hold
each point (mmcv.ops.points_in_boxes). Formulas, shapes and the conventions: the public
functions' docstrings and docs/operators/points_in_boxes.md.

Native path: csrc/box3d/points_in_boxes_musa.mu (part: one thread per point over the boxes in
shared-memory tiles, first hit wins; all: consecutive threads write consecutive int32 of the
[B, M, T] output). No host synchronisation. `points_in_boxes_cpu` is mmcv's CPU entry point:
the same result as `points_in_boxes_all` (here on any device).
"""

from __future__ import annotations

import torch

from mu_space.ops import _box3d, _opdef
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

_UNVERIFIED = _box3d.UNVERIFIED


def _check(points, boxes, all_boxes: bool = True) -> _opdef.Checked:
    _box3d.check_float_tensor(points, "points")
    _box3d.check_shape(points, "points", (None, None, 3), "B, M, (x, y, z)")
    _box3d.check_float_tensor(boxes, "boxes", points, "points")
    _box3d.check_shape(
        boxes, "boxes", (points.shape[0], None, 7), "B, T, (x, y, z bottom, dx, dy, dz, yaw)"
    )
    B, M, T = points.shape[0], points.shape[1], boxes.shape[1]
    shape = (B, M, T) if all_boxes else (B, M)
    return _opdef.Checked(points.device, points.dtype, ((shape, torch.int32),), (B, M, T), "points")


def _check_part(points, boxes) -> _opdef.Checked:
    return _check(points, boxes, False)


def points_in_boxes_all_reference(points, boxes) -> torch.Tensor:
    _check(points, boxes)
    return _box3d.points_in_boxes_mask(points, boxes).to(torch.int32)


def points_in_boxes_part_reference(points, boxes) -> torch.Tensor:
    _check(points, boxes)
    mask = _box3d.points_in_boxes_mask(points, boxes)
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:2], -1, dtype=torch.int32, device=points.device)
    first = mask.to(torch.uint8).argmax(-1)  # the first maximum: the first box holding it
    return torch.where(mask.any(-1), first, -1).to(torch.int32)


def _native(entry: str, all_boxes: bool):
    def run(c, points, boxes):
        B, M, T = c.info
        shape = (B, M, T) if all_boxes else (B, M)
        points, boxes = points.contiguous(), boxes.contiguous()
        out = _opdef.new_output(points, shape, torch.int32)
        if B * M == 0 or (all_boxes and T == 0):
            return out
        if not all_boxes and T == 0:
            return out.fill_(-1)
        native.function(entry)(points, boxes, out, stream_handle(points))
        return out

    return run


def _supports_all(c: _opdef.Checked) -> str | None:
    B, M, T = c.info
    if T > (limit := native.limit("points_in_boxes.max_all_boxes")):
        return f"{T} boxes per batch exceed the native kernel's limit of {limit}"
    return _supports_part(c)


def _supports_part(c: _opdef.Checked) -> str | None:
    B, M, T = c.info
    if M > (limit := native.limit("points_in_boxes.max_points")):
        return f"{M} points per batch exceed the native kernels' limit of {limit}"
    if T > (limit := native.limit("points_in_boxes.max_boxes")):
        return f"{T} boxes per batch exceed the native kernels' limit of {limit}"
    return None


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import boxes as box_inputs

    pts, bxs = box_inputs.lidar_frame(3000, 24, batch=2, seed=1)
    pts, bxs = pts.to(device), bxs.to(device)
    return [
        _opdef.Sample("2 frames, 3000 points, 24 boxes", (pts, bxs)),
        _opdef.Sample("float16", (pts.half(), bxs.half())),
        _opdef.Sample("bfloat16, 1 frame", (pts[:1].bfloat16(), bxs[:1].bfloat16())),
        _opdef.Sample("no boxes", (pts, bxs[:, :0])),
        _opdef.Sample("no points", (pts[:, :0], bxs)),
    ]


_COMMON = dict(
    family="box3d",
    schema="(Tensor points, Tensor boxes) -> Tensor",
    native_dtypes=_box3d.NATIVE_DTYPES,
    samples=_samples,
    unverified=_UNVERIFIED,
    models="PointRCNN, PartA2, CenterPoint / SECOND GT sampling, 3DSSD",
    doc="docs/operators/points_in_boxes.md",
)

PART = _opdef.define(
    _opdef.OpDef(
        name="points_in_boxes_part",
        check=_check_part,
        reference=points_in_boxes_part_reference,
        native=_native("points_in_boxes_part_forward", False),
        supports=_supports_part,
        entry_points=("points_in_boxes_part_forward",),
        upstream="mmcv `points_in_boxes_part`",
        patches=("mmcv.points_in_boxes_part", "pcdet.points_in_boxes_gpu"),
        **_COMMON,
    )
)

ALL = _opdef.define(
    _opdef.OpDef(
        name="points_in_boxes_all",
        check=_check,
        reference=points_in_boxes_all_reference,
        native=_native("points_in_boxes_all_forward", True),
        supports=_supports_all,
        entry_points=("points_in_boxes_all_forward",),
        upstream="mmcv `points_in_boxes_all`",
        patches=("mmcv.points_in_boxes_all", "pcdet.points_in_boxes_cpu"),
        **_COMMON,
    )
)


def _cpu_native(c, points, boxes, *, backend):
    return ALL(points, boxes, backend="native" if backend == "auto" else backend)


CPU = _opdef.define(
    _opdef.OpDef(
        name="points_in_boxes_cpu",
        check=_check,
        reference=points_in_boxes_all_reference,
        native=_cpu_native,
        composite=True,
        supports=_supports_all,
        entry_points=("points_in_boxes_all_forward",),
        upstream="mmcv `points_in_boxes_cpu`",
        patches=("mmcv.points_in_boxes_cpu",),
        **_COMMON,
    )
)

_FORMULA = """
    inside(p, box) = |p.z - (box.z + box.dz/2)| <= box.dz/2          (z: the box's BOTTOM)
                     and |l.x| < box.dx/2 and |l.y| < box.dy/2       (strict)
    with l = R(-yaw) (p.x - box.x, p.y - box.y), float32, each operation rounded once
    (a point with a NaN coordinate is in no box)

    Args:
        points: Tensor[B, M, 3] (x, y, z) float32 / float16 / bfloat16 (float64: reference
            path); any B (mmcv's kernels: any B too, one batch per grid row).
        boxes: Tensor[B, T, 7] (x, y, z, dx, dy, dz, yaw), LiDAR / depth coordinates, z at the
            bottom centre; points' dtype and device.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".
"""


@PART.export
def points_in_boxes_part(points, boxes, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `points_in_boxes_part(points, boxes)` -> Tensor[B, M] int32: for each point the
    index of the FIRST box (in box order) that holds it, -1 for none.
    """
    return PART(points, boxes, backend=backend)


@ALL.export
def points_in_boxes_all(points, boxes, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `points_in_boxes_all(points, boxes)` -> Tensor[B, M, T] int32: 1 where box t
    holds point m, else 0.
    """
    return ALL(points, boxes, backend=backend)


@CPU.export
def points_in_boxes_cpu(points, boxes, *, backend: str = "auto") -> torch.Tensor:
    """mmcv's `points_in_boxes_cpu(points, boxes)` -> Tensor[B, M, T] int32, the same result
    as `points_in_boxes_all` (mmcv's CPU loop; here the reference on CPU tensors, the native
    kernel of points_in_boxes_all on a GPU).
    """
    return CPU(points, boxes, backend=backend)


for _fn in (points_in_boxes_part, points_in_boxes_all, points_in_boxes_cpu):
    _fn.__doc__ = (_fn.__doc__ or "").rstrip() + "\n" + _FORMULA
