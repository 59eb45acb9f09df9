"""roipoint_pool3d / RoIPointPool3d (mmcv API): against mmcv's loop written out in plain Python
(first S points per box in index order, repeated k % cnt, empty flag); native vs reference on a
GPU (skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

from mu_space.ops.roipoint import RoIPointPool3d, roipoint_pool3d
from mu_space.testing import boxes as box_inputs
from tests.helpers import native_gpu_device
from tests.ops import _box3d_oracle as oracle


def _want(points, feats, boxes, S):
    B, P, M, C = points.shape[0], points.shape[1], boxes.shape[1], feats.shape[2]
    pooled = torch.zeros(B, M, S, 3 + C, dtype=torch.float64)
    empty = torch.zeros(B, M, dtype=torch.int32)
    pl, bl = points.double().tolist(), boxes.double().tolist()
    rows = torch.cat([points, feats], -1).double()
    for b in range(B):
        for m in range(M):
            idx = [p for p in range(P) if oracle.point_in_lidar_box(pl[b][p], bl[b][m])][:S]
            if not idx:
                empty[b, m] = 1
                continue
            for k in range(S):
                pooled[b, m, k] = rows[b, idx[k % len(idx)]]
    return pooled, empty


@pytest.fixture(scope="module")
def frame():
    pts, bxs = box_inputs.lidar_frame(600, 10, batch=2, seed=61)
    far = bxs[:, :2].clone()
    far[..., :2] += 500.0  # two boxes without points
    bxs = torch.cat([bxs, far], 1)
    feats = torch.randn(2, 600, 5, generator=torch.Generator().manual_seed(1))
    return pts, feats, bxs


@pytest.mark.parametrize("S", [1, 16, 64])
def test_matches_mmcv_loop(frame, S):
    pts, feats, bxs = frame
    want_p, want_e = _want(pts, feats, bxs, S)
    got_p, got_e = roipoint_pool3d(pts.double(), feats.double(), bxs.double(), S)
    assert got_p.shape == (2, 12, S, 8) and got_e.dtype == torch.int32
    assert torch.equal(got_e, want_e) and torch.equal(got_p, want_p)
    assert want_e.sum() >= 4 and (want_e == 0).sum() > 10
    p32, e32 = roipoint_pool3d(pts, feats, bxs, S)
    assert torch.equal(e32, want_e) and torch.equal(p32.double(), want_p.float().double())


def test_module_and_repetition(frame):
    pts, feats, bxs = frame
    p, e = RoIPointPool3d(num_sampled_points=200)(pts, feats, bxs)
    # boxes with fewer than 200 points repeat them in order
    cnt = (p[..., :3] != 0).any(-1).sum(-1)
    assert p.shape == (2, 12, 200, 8) and cnt.max() == 200
    want, _ = _want(pts, feats, bxs, 200)
    assert torch.equal(p.double(), want.float().double())


def test_nan_points_are_in_no_box_and_empty_inputs(frame):
    pts, feats, bxs = frame
    p = pts.clone()
    p[:, :, 2] = math.nan
    _, e = roipoint_pool3d(p, feats, bxs, 8)
    assert bool((e == 1).all())
    pooled, e = roipoint_pool3d(pts[:, :0], feats[:, :0], bxs, 8)
    assert pooled.shape == (2, 12, 8, 8) and bool((pooled == 0).all()) and bool((e == 1).all())
    pooled, e = roipoint_pool3d(pts, feats, bxs[:, :0], 8)
    assert pooled.shape == (2, 0, 8, 8) and e.shape == (2, 0)
    pooled, e = roipoint_pool3d(pts, feats, bxs, 0)
    assert pooled.shape == (2, 12, 0, 8) and bool((e == 1).all())  # mmcv: cnt stays 0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda p, f, b: (p[..., :2], f, b, 4), r"points must be \[\*, \*, 3\]"),
        (lambda p, f, b: (p, f[:, :5], b, 4), r"point_features must be \[2, 600, \*\]"),
        (lambda p, f, b: (p, f.double(), b, 4), "point_features must have the dtype"),
        (lambda p, f, b: (p, f, b[..., :6], 4), r"boxes3d must be \[2, \*, 7\]"),
        (lambda p, f, b: (p, f, b, -1), "num_sampled_points must be >= 0"),
        (lambda p, f, b: (p, f, b, 2**40), "num_sampled_points must be <="),
    ],
)
def test_bad_arguments_name_the_argument(frame, args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        roipoint_pool3d(*args(*frame))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_equals_reference(dtype):
    device = native_gpu_device()
    pts, bxs = box_inputs.lidar_frame(100000, 128, batch=2, seed=7)
    feats = torch.randn(2, 100000, 16)
    args = (pts.to(device, dtype), feats.to(device, dtype), bxs.to(device, dtype))
    for S in (1, 512):
        got = roipoint_pool3d(*args, S, backend="native")
        want = roipoint_pool3d(*args, S, backend="reference")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
