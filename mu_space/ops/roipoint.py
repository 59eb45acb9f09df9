"""`roipoint_pool3d` / `RoIPointPool3d`: the first points of each 3D box with their coordinates
and features (mmcv.ops.RoIPointPool3d, PointRCNN / PartA2). Formula and conventions: the public
function's docstring and docs/operators/roipoint_pool3d.md.

Native path: csrc/box3d/roipoint_pool3d_musa.mu (a bit per (box, point), the first S set bits
per box by a block prefix sum, a coalesced gather); no host synchronisation, no box or point
count limit but memory (mmcv materialises a [B, N, M] int32 mask).
"""

from __future__ import annotations

import torch
from torch import nn

from mu_space.ops import _box3d, _opdef
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

_UNVERIFIED = _box3d.UNVERIFIED
_INT32_MAX = 2**31 - 1


def _check(points, point_features, boxes3d, num_sampled_points) -> _opdef.Checked:
    _box3d.check_float_tensor(points, "points")
    _box3d.check_shape(points, "points", (None, None, 3), "B, N, (x, y, z)")
    B, P = points.shape[0], points.shape[1]
    _box3d.check_float_tensor(point_features, "point_features", points, "points")
    _box3d.check_shape(point_features, "point_features", (B, P, None), "B, N, C")
    _box3d.check_float_tensor(boxes3d, "boxes3d", points, "points")
    _box3d.check_shape(boxes3d, "boxes3d", (B, None, 7), "B, M, (x, y, z bottom, dx, dy, dz, yaw)")
    S = _box3d.as_int(num_sampled_points, "num_sampled_points")
    if S > _INT32_MAX:
        raise ValueError(f"num_sampled_points must be <= {_INT32_MAX}, got {S}")
    M, C = boxes3d.shape[1], point_features.shape[2]
    outputs = (((B, M, S, 3 + C), points.dtype), ((B, M), torch.int32))
    return _opdef.Checked(points.device, points.dtype, outputs, (B, P, M, C, S), "points")


def roipoint_pool3d_reference(points, point_features, boxes3d, num_sampled_points):
    """Vectorised: the [B, M, N] inside mask, a stable sort puts each box's points first in index
    order, mmcv's duplication k -> k % cnt, the gather."""
    B, P, M, C, S = _check(points, point_features, boxes3d, num_sampled_points).info
    mask = _box3d.points_in_boxes_mask(points, boxes3d).transpose(1, 2)  # [B, M, P]
    cnt = mask.sum(-1)  # [B, M]
    empty = cnt.clamp(max=S) == 0  # mmcv: with S = 0 no point is taken, every box is empty
    pooled = points.new_zeros(B, M, S, 3 + C)
    if S == 0 or P == 0 or M == 0:
        return pooled, empty.to(torch.int32)
    first = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True)[1]  # inside points first
    if P < S:
        first = torch.cat([first, first.new_zeros(B, M, S - P)], -1)
    k = torch.arange(S, device=points.device)
    pos = torch.where(k < cnt[..., None], k, k % cnt.clamp(min=1)[..., None])
    src = first.gather(-1, pos)  # [B, M, S]
    rows = torch.cat([points, point_features], -1)  # [B, P, 3 + C]
    got = rows.gather(1, src.reshape(B, M * S, 1).expand(-1, -1, 3 + C)).reshape(B, M, S, 3 + C)
    pooled = torch.where(empty[..., None, None], pooled, got)
    return pooled, empty.to(torch.int32)


def _native(c, points, point_features, boxes3d, num_sampled_points):
    B, P, M, C, S = c.info
    points, point_features, boxes3d = (t.contiguous() for t in (points, point_features, boxes3d))
    pooled = _opdef.new_output(points, (B, M, S, 3 + C))
    empty = _opdef.new_output(points, (B, M), torch.int32)
    if B * M == 0:
        return pooled, empty
    bits = torch.empty(B, M, (P + 31) // 32, dtype=torch.int32, device=points.device)
    idx = torch.empty(B, M, S, dtype=torch.int32, device=points.device)
    native.function("roipoint_pool3d_forward")(
        points, point_features, boxes3d, bits, idx, pooled, empty, stream_handle(points)
    )
    return pooled, empty


def _supports(c: _opdef.Checked) -> str | None:
    B, P, M, C, S = c.info
    if P > (limit := native.limit("roipoint_pool3d.max_points")):
        return f"{P} points per batch exceed the native kernel's limit of {limit}"
    return None


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import boxes as box_inputs

    pts, bxs = box_inputs.lidar_frame(3000, 16, batch=2, seed=21)
    feats = torch.randn(2, 3000, 4, generator=torch.Generator().manual_seed(0))
    pts, bxs, feats = pts.to(device), bxs.to(device), feats.to(device)
    return [
        _opdef.Sample("2 frames, 16 boxes, 64 samples", (pts, feats, bxs, 64)),
        _opdef.Sample("float16, 512 samples", (pts.half(), feats.half(), bxs.half(), 512)),
        _opdef.Sample(
            "bfloat16, 1 frame", (pts[:1].bfloat16(), feats[:1].bfloat16(), bxs[:1].bfloat16(), 32)
        ),
        _opdef.Sample("no boxes", (pts, feats, bxs[:, :0], 64)),
        _opdef.Sample("no points", (pts[:, :0], feats[:, :0], bxs, 16)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="roipoint_pool3d",
        family="box3d",
        schema="(Tensor points, Tensor point_features, Tensor boxes3d, int num_sampled_points) "
        "-> (Tensor, Tensor)",
        check=_check,
        reference=roipoint_pool3d_reference,
        native=_native,
        supports=_supports,
        native_dtypes=_box3d.NATIVE_DTYPES,
        entry_points=("roipoint_pool3d_forward",),
        samples=_samples,
        unverified=_UNVERIFIED,
        upstream="mmcv `RoIPointPool3d`",
        patches=("mmcv.RoIPointPool3d",),
        models="PointRCNN, PartA2 (mmdet3d point-based RoI heads)",
        doc="docs/operators/roipoint_pool3d.md",
    )
)


@OP.export
def roipoint_pool3d(
    points, point_features, boxes3d, num_sampled_points=512, *, backend: str = "auto"
):
    """mmcv's `RoIPointPool3d(num_sampled_points)(points, point_features, boxes3d)` ->
    (pooled_features Tensor[B, M, S, 3 + C], pooled_empty_flag Tensor[B, M] int32), S =
    num_sampled_points:

        idx[b, m, k] = the k-th point (ascending index) of batch b inside box m, k < cnt
                       (points_in_boxes' test: z at the box's bottom, strict x / y faces);
                       for cnt <= k < S: idx[b, m, k % cnt] (mmcv repeats the points)
        pooled[b, m, k] = (points[b, idx, 0:3], point_features[b, idx, :])
        empty[b, m] = 1 when no point is inside (then pooled[b, m] is all zeros), else 0

    Args:
        points: Tensor[B, N, 3] float32 / float16 / bfloat16 (float64: reference path).
        point_features: Tensor[B, N, C], points' dtype and device.
        boxes3d: Tensor[B, M, 7] (x, y, z, dx, dy, dz, yaw), z at the bottom (no enlargement:
            OpenPCDet's version enlarges the boxes first, mmcv's does not).
        num_sampled_points: int >= 0.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Not differentiable (mmcv's backward raises NotImplementedError). A point with a NaN
    coordinate is in no box.
    """
    return OP(
        points,
        point_features,
        boxes3d,
        _box3d.as_int(num_sampled_points, "num_sampled_points"),
        backend=backend,
    )


class RoIPointPool3d(nn.Module):
    """mmcv's `RoIPointPool3d(num_sampled_points=512)`: forward(points, point_features, boxes3d)
    -> (pooled_features, pooled_empty_flag) through `roipoint_pool3d`."""

    def __init__(self, num_sampled_points: int = 512):
        super().__init__()
        self.num_sampled_points = num_sampled_points

    def forward(self, points, point_features, boxes3d):
        return roipoint_pool3d(points, point_features, boxes3d, self.num_sampled_points)
