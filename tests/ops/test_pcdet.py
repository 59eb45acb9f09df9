"""OpenPCDet adapters (mu_space.ops.pcdet): iou3d_nms_utils' call convention over the box
operators: nms_gpu / nms_normal_gpu sort once and return (keep, None), boxes_iou_bev is mmcv
iou3d's IoU of 7-value boxes; box3d_nms_ordered visits the given order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mu_space.ops.pcdet import (
    box3d_nms_ordered,
    boxes_bev_iou_cpu,
    boxes_iou_bev,
    nms_gpu,
    nms_normal_gpu,
    points_in_boxes_cpu,
    points_in_boxes_gpu,
)
from mu_space.testing import boxes as box_inputs
from tests.helpers import assert_close, native_gpu_device
from tests.ops import _box3d_oracle as oracle


@pytest.fixture(scope="module")
def dets():
    return box_inputs.detections(220, seed=51, extent=20.0)


def test_boxes_iou_bev_matches_the_definition(dets):
    b, _ = dets
    a, c = b[:70].double(), b[70:150].double()
    want = torch.tensor(
        [[oracle.iou3d_bev(x, y) for y in c.tolist()] for x in a.tolist()], dtype=torch.float64
    )
    assert_close(boxes_iou_bev(a, c), want, atol=1e-9, rtol=1e-9)
    assert_close(boxes_iou_bev(a.float(), c.float()).double(), want, atol=2e-5, rtol=1e-5)
    out = boxes_bev_iou_cpu(a.numpy(), c.numpy())
    assert isinstance(out, np.ndarray)
    assert np.allclose(out, want.numpy(), atol=1e-9)


@pytest.mark.parametrize("pre", [None, 150])
def test_nms_gpu_is_the_greedy_loop_on_one_sort(dets, pre):
    b, s = dets
    order = s.sort(0, descending=True)[1]
    if pre is not None:
        order = order[:pre]
    rows = b.double().tolist()
    want = oracle.greedy_nms(order.tolist(), lambda k, i: oracle.iou3d_bev(rows[k], rows[i]) > 0.5)
    keep, second = nms_gpu(b.double(), s, 0.5, pre_maxsize=pre, unused_kwarg=1)
    assert second is None and keep.tolist() == want
    keep_n, _ = nms_normal_gpu(b.double(), s, 0.4)
    want_n = oracle.greedy_nms(
        s.sort(0, descending=True)[1].tolist(),
        lambda k, i: oracle.iou_normal(rows[k], rows[i]) > 0.4,
    )
    assert keep_n.tolist() == want_n


def test_ordered_nms_follows_the_given_order(dets):
    b, s = dets
    order = torch.randperm(b.shape[0], generator=torch.Generator().manual_seed(0))
    rows = b.double().tolist()
    want = oracle.greedy_nms(
        order.tolist(), lambda k, i: oracle.iou3d_bev(rows[k], rows[i]) > 0.3, 9
    )
    assert box3d_nms_ordered(b.double(), order, "iou3d", 0.3, 9).tolist() == want
    with pytest.raises(ValueError, match="kind must be"):
        box3d_nms_ordered(b, order, "giou", 0.3)
    with pytest.raises(TypeError, match="order must be int64"):
        box3d_nms_ordered(b, order.int(), "iou3d", 0.3)


def test_native_equals_reference():
    device = native_gpu_device()
    b, s = box_inputs.detections(3000, seed=5)
    b, s = b.to(device), s.to(device)
    assert torch.equal(
        nms_gpu(b, s, 0.7, 2048, backend="native")[0],
        nms_gpu(b, s, 0.7, 2048, backend="reference")[0],
    )
    assert torch.equal(
        boxes_iou_bev(b, b, backend="native"), boxes_iou_bev(b, b, backend="reference")
    )


def test_points_in_boxes_adapters_take_centre_z_boxes():
    pts, bxs = box_inputs.lidar_frame(500, 9, batch=1, seed=8)
    centre = bxs.clone()
    centre[..., 2] += centre[..., 5] / 2  # OpenPCDet's layout
    rows, blist = pts[0].double().tolist(), bxs[0].double().tolist()
    want = torch.tensor(
        [[int(oracle.point_in_lidar_box(p, b)) for p in rows] for b in blist], dtype=torch.int32
    )
    got = points_in_boxes_cpu(pts[0].double(), centre[0].double())
    assert got.shape == (9, 500) and torch.equal(got, want)
    assert np.array_equal(
        points_in_boxes_cpu(pts[0].double().numpy(), centre[0].double().numpy()), want.numpy()
    )
    part = points_in_boxes_gpu(pts.double(), centre.double())
    first = torch.where(want.T.any(-1), want.T.argmax(-1), -1).int()
    assert torch.equal(part[0], first)
