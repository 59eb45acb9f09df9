"""circle_nms (mmdet3d / CenterPoint): against the textbook loop in plain Python (the visiting
order of mmdet3d's reversed argsort, squared distances <= thresh suppress), the cap, ties, NaN,
numpy in / out; native vs reference on a GPU (skipped without one)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mu_space.ops.circle_nms import circle_nms
from mu_space.testing import boxes as box_inputs
from tests.helpers import native_gpu_device
from tests.ops import _box3d_oracle as oracle


def _want(dets: torch.Tensor, thresh: float, post=None):
    rows = dets.double().tolist()
    # mmdet3d: order = scores.argsort()[::-1] (stable ascending, reversed: ties later index first)
    order = sorted(range(len(rows)), key=lambda i: (rows[i][2], i), reverse=True)
    nan_first = [i for i in order if math.isnan(rows[i][2])]
    order = nan_first + [i for i in order if not math.isnan(rows[i][2])]

    def suppresses(k, i):
        d = (rows[k][0] - rows[i][0]) ** 2 + (rows[k][1] - rows[i][1]) ** 2
        return d <= thresh

    return oracle.greedy_nms(order, suppresses, post)


@pytest.fixture(scope="module")
def dets():
    b, s = box_inputs.detections(400, seed=41, extent=25.0)
    return torch.cat([b[:, :2], s[:, None]], 1)


@pytest.mark.parametrize(("thresh", "post"), [(4.0, 83), (1.0, None), (0.25, 20), (16.0, 500)])
def test_matches_the_loop(dets, thresh, post):
    want = _want(dets.double(), thresh, post)
    got = circle_nms(dets.double(), thresh, post)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert circle_nms(dets, thresh, post).tolist() == want  # float32 (no pair near the radius)
    if post is not None and post < 100:
        assert len(want) == post


def test_default_cap_is_83(dets):
    assert circle_nms(dets, 0.01).shape == (83,)


def test_ties_later_index_first_and_nan_scores():
    d = torch.tensor([[0.0, 0.0, 0.5], [10.0, 0.0, 0.5], [0.5, 0.0, 0.5], [20.0, 0, math.nan]])
    assert circle_nms(d, 1.0, None).tolist() == _want(d, 1.0) == [3, 2, 1]


def test_threshold_is_a_squared_distance_compared_exactly():
    d = torch.tensor([[0.0, 0.0, 0.9], [0.3, 0.4, 0.8]], dtype=torch.float32)  # distance^2 0.25
    dist2 = float((d[1, 0] - d[0, 0]) ** 2 + (d[1, 1] - d[0, 1]) ** 2)  # float32 arithmetic
    assert circle_nms(d, dist2, None).tolist() == [0]  # <= suppresses
    assert circle_nms(d, math.nextafter(dist2, 0.0), None).tolist() == [0, 1]  # just below
    assert circle_nms(d, math.nan, None).tolist() == [0, 1]


def test_nan_centres_never_suppress(dets):
    d = dets[:50].clone()
    d[7, 0] = math.nan
    got = circle_nms(d, 9.0, None).tolist()
    assert 7 in got and got == _want(d, 9.0)


def test_numpy_in_numpy_out_and_empty(dets):
    out = circle_nms(dets.numpy(), 4.0)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64
    assert out.tolist() == circle_nms(dets, 4.0).tolist()
    assert circle_nms(dets[:0], 4.0).shape == (0,)
    assert circle_nms(dets, 4.0, 0).shape == (0,)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(5, 4), 1.0), r"dets must be \[\*, 3\]"),
        ((torch.zeros(5, 3), "1"), "thresh must be a real number"),
        ((torch.zeros(5, 3), 1.0, -1), "post_max_size must be >= 0"),
        (([[0.0, 0.0, 1.0]], 1.0), "dets must be a torch.Tensor"),
    ],
)
def test_bad_arguments_name_the_argument(args, match):
    with pytest.raises((TypeError, ValueError), match=match):
        circle_nms(*args)


@pytest.mark.parametrize("n", [1, 64, 500, 5000])
def test_native_equals_reference(n):
    device = native_gpu_device()
    b, s = box_inputs.detections(n, seed=n)
    d = torch.cat([b[:, :2], s[:, None]], 1).to(device)
    for post in (83, None):
        assert torch.equal(
            circle_nms(d, 4.0, post, backend="native"),
            circle_nms(d, 4.0, post, backend="reference"),
        )
