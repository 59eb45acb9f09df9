"""boxes_overlap_bev, boxes_iou_bev, box_iou_rotated: the pairwise BEV family against the
plain-Python polygon clipping of tests/ops/_box3d_oracle.py (float64) on random detections and
on identical, touching, nested, degenerate and far-away rectangles; native vs reference on a GPU
(skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

from mu_space.ops import _box3d
from mu_space.ops.box_iou_rotated import box_iou_rotated
from mu_space.ops.iou3d import boxes_iou_bev, boxes_overlap_bev
from mu_space.testing import boxes as box_inputs
from tests.helpers import assert_close, native_gpu_device
from tests.ops import _box3d_oracle as oracle

# float64 on both sides, different algorithms (frame clipping vs world clipping): rounding only
F64 = {"atol": 1e-9, "rtol": 1e-9}
# float32 against float64: coordinates up to ~50 m carry ~3e-6 m of rounding, areas ~10 m^2
# built from a handful of such products
F32_AREA = {"atol": 2e-4, "rtol": 1e-5}
F32_IOU = {"atol": 2e-5, "rtol": 1e-5}


def _rect(b7):
    return (b7[0], b7[1], b7[3], b7[4], b7[6])


def _oracle_overlap(a, b):
    a, b = a.double().tolist(), b.double().tolist()
    return torch.tensor(
        [[oracle.rect_intersection(_rect(x), _rect(y)) for y in b] for x in a], dtype=torch.float64
    )


@pytest.fixture(scope="module")
def dets():
    a, _ = box_inputs.detections(60, seed=11, extent=12.0)
    b, _ = box_inputs.detections(45, seed=12, extent=12.0)
    return a, b


def test_overlap_matches_polygon_clipping(dets):
    a, b = dets
    want = _oracle_overlap(a, b)
    assert (want > 0).sum() > 20  # the sets really overlap
    got = boxes_overlap_bev(a.double(), b.double())
    assert got.shape == (60, 45) and got.dtype == torch.float64
    assert_close(got, want, **F64)
    got32 = boxes_overlap_bev(a, b)
    assert got32.dtype == torch.float32
    assert_close(got32.double(), want, **F32_AREA)


def test_overlap_is_symmetric_and_the_diagonal_is_the_area(dets):
    a, _ = dets
    ov = boxes_overlap_bev(a, a)
    assert_close(ov, ov.T, atol=2e-5, rtol=1e-6)
    # identical boxes: the clipped polygon is the box itself (relative angle 0, centre 0)
    assert_close(ov.diag(), a[:, 3] * a[:, 4], atol=0.0, rtol=3e-7)


@pytest.mark.parametrize("name", sorted(box_inputs.rect_cases()))
def test_edge_cases_match_the_definition(name):
    a, b = box_inputs.rect_cases()[name]
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-6)):
        aa, bb = a.to(dtype), b.to(dtype)
        # the definition on the inputs as the dtype holds them (4000.6 is not a float32)
        want_ov = oracle.rect_intersection(aa[0].double().tolist(), bb[0].double().tolist())
        want_iou = oracle.rotated_iou(aa[0].double().tolist(), bb[0].double().tolist())
        iou = box_iou_rotated(aa, bb)
        assert iou.shape == (1, 1)
        scale = max(1.0, want_ov)
        assert abs(float(iou[0, 0]) - want_iou) <= tol * 10, (name, dtype, float(iou), want_iou)
        # the same rectangles as LiDAR boxes
        a7 = torch.zeros(1, 7, dtype=dtype)
        b7 = torch.zeros(1, 7, dtype=dtype)
        a7[:, [0, 1, 3, 4, 6]] = aa
        b7[:, [0, 1, 3, 4, 6]] = bb
        ov = float(boxes_overlap_bev(a7, b7)[0, 0])
        assert abs(ov - want_ov) <= tol * scale * 10, (name, dtype, ov, want_ov)


def test_identical_rectangles_have_iou_one_exactly_enough():
    a, _ = box_inputs.detections(40, seed=13)
    r = box_inputs.xywhr(a)
    iou = box_iou_rotated(r, r, aligned=True)
    assert (iou - 1).abs().max() <= 3e-7
    assert (box_iou_rotated(r.double(), r.double(), aligned=True) - 1).abs().max() <= 1e-15


def test_touching_and_nested():
    sq = torch.tensor([[0.0, 0.0, 2.0, 2.0, 0.0]])
    right = torch.tensor([[2.0, 0.0, 2.0, 2.0, 0.0]])
    inner = torch.tensor([[0.1, 0.2, 0.5, 0.25, 0.7]])
    assert float(box_iou_rotated(sq, right)) == 0.0
    assert float(box_iou_rotated(sq, inner, mode="iof")) == pytest.approx(0.125 / 4, rel=1e-6)
    assert float(box_iou_rotated(inner, sq, mode="iof")) == pytest.approx(1.0, rel=1e-6)


def test_non_finite_and_degenerate_values():
    good = torch.tensor([[0.0, 0.0, 2.0, 2.0, 0.0]])
    for bad in (math.nan, math.inf, -math.inf):
        for col in range(5):
            b = good.clone()
            b[0, col] = bad
            assert math.isnan(float(box_iou_rotated(good, b))), (bad, col)
            assert math.isnan(float(box_iou_rotated(b, good, mode="iof"))), (bad, col)
    zero = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0]])
    neg = torch.tensor([[0.0, 0.0, -2.0, 2.0, 0.0]])
    assert float(box_iou_rotated(good, zero)) == 0.0
    assert float(box_iou_rotated(zero, zero)) == 0.0
    assert float(box_iou_rotated(good, neg)) == 0.0
    # mmcv's 1e-14 area rule: a sliver of area 1e-15 counts as empty
    sliver = torch.tensor([[0.0, 0.0, 1e-8, 1e-7, 0.0]], dtype=torch.float64)
    assert float(box_iou_rotated(sliver, sliver)) == 0.0


def test_box_iou_rotated_modes_aligned_and_clockwise(dets):
    a, b = dets
    ra, rb = box_inputs.xywhr(a).double(), box_inputs.xywhr(b).double()
    la, lb = ra.tolist(), rb.tolist()
    want = torch.tensor([[oracle.rotated_iou(x, y) for y in lb] for x in la], dtype=torch.float64)
    want_iof = torch.tensor(
        [[oracle.rotated_iou(x, y, iof=True) for y in lb] for x in la], dtype=torch.float64
    )
    assert_close(box_iou_rotated(ra, rb), want, **F64)
    assert_close(box_iou_rotated(ra, rb, "iof"), want_iof, **F64)
    assert_close(box_iou_rotated(ra[:45], rb, aligned=True), want.diag(), **F64)
    flipped = ra.clone()
    flipped[:, 4] = -flipped[:, 4]
    flipped_b = rb.clone()
    flipped_b[:, 4] = -flipped_b[:, 4]
    assert_close(
        box_iou_rotated(ra, rb, clockwise=False),
        box_iou_rotated(flipped, flipped_b),
        atol=0.0,
        rtol=0.0,
    )
    got32 = box_iou_rotated(ra.float(), rb.float())
    assert_close(got32.double(), want, **F32_IOU)


def test_boxes_iou_bev_is_box_iou_rotated_of_the_converted_boxes(dets):
    a, b = dets
    xa, xb = box_inputs.xyxyr(a), box_inputs.xyxyr(b)

    def conv(t):  # mmcv's _xyxyr2xywhr, in torch
        return torch.stack(
            (
                (t[:, 0] + t[:, 2]) / 2,
                (t[:, 1] + t[:, 3]) / 2,
                t[:, 2] - t[:, 0],
                t[:, 3] - t[:, 1],
                t[:, 4],
            ),
            -1,
        )

    assert torch.equal(boxes_iou_bev(xa, xb), box_iou_rotated(conv(xa), conv(xb)))
    la, lb = conv(xa.double()).tolist(), conv(xb.double()).tolist()
    want = torch.tensor([[oracle.rotated_iou(x, y) for y in lb] for x in la], dtype=torch.float64)
    assert_close(boxes_iou_bev(xa.double(), xb.double()), want, **F64)


def test_empty_inputs_and_low_precision_dtypes(dets):
    a, b = dets
    assert boxes_overlap_bev(a[:0], b).shape == (0, 45)
    assert boxes_overlap_bev(a, b[:0]).shape == (60, 0)
    assert box_iou_rotated(
        box_inputs.xywhr(a)[:0], box_inputs.xywhr(b)[:0], aligned=True
    ).shape == (0,)
    for dtype in (torch.float16, torch.bfloat16):
        got = boxes_overlap_bev(a.to(dtype), b.to(dtype))
        assert got.dtype == dtype
        # computed in float32 from the rounded inputs, rounded once to the dtype
        want = boxes_overlap_bev(a.to(dtype).float(), b.to(dtype).float()).to(dtype)
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: boxes_overlap_bev(torch.zeros(3, 5), torch.zeros(2, 7)),
            r"boxes_a must be \[\*, 7\]",
        ),
        (
            lambda: boxes_overlap_bev(torch.zeros(3, 7), torch.zeros(2, 7).half()),
            "boxes_b must have the dtype",
        ),
        (lambda: boxes_iou_bev(torch.zeros(3, 7), torch.zeros(2, 7)), r"boxes_a must be \[\*, 5\]"),
        (lambda: box_iou_rotated(torch.zeros(3, 5), torch.zeros(2, 5), "giou"), "mode must be"),
        (
            lambda: box_iou_rotated(torch.zeros(3, 5), torch.zeros(2, 5), aligned=True),
            "bboxes2 must have 3 rows",
        ),
        (
            lambda: box_iou_rotated(torch.zeros(3, 5), torch.zeros(2, 5), aligned="yes"),
            "aligned must be a bool",
        ),
        (
            lambda: box_iou_rotated(torch.zeros(3, 5, dtype=torch.int64), torch.zeros(2, 5)),
            "bboxes1 must be float32",
        ),
    ],
)
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def _needs_clip(a, b):
    """box3d::needs_clip (the IoU kinds): finite, positive sizes and not far apart."""
    ok = _box3d._finite(a) & _box3d._finite(b)
    positive = (a.w > 0) & (a.h > 0) & (b.w > 0) & (b.h > 0)
    reach = ((a.w * 0.5).abs() + (a.h * 0.5).abs()) + ((b.w * 0.5).abs() + (b.h * 0.5).abs())
    far = ((a.x - b.x).abs() > reach) | ((a.y - b.y).abs() > reach)
    return ok & positive & ~far, ok


@pytest.mark.parametrize(
    "kind", [_box3d.OVERLAP, _box3d.IOU3D, _box3d.ROTATED_IOU, _box3d.ROTATED_IOF]
)
def test_unclipped_pairs_are_zero_or_nan(kind):
    """The kernels skip pair_value for the pairs that need no clip and write 0 (finite boxes)
    or NaN (box3d::unclipped_value; NMS: 0 suppresses only below a negative threshold). Checked
    on the reference (the same steps as pair_value) over every pair of detections and of
    degenerate, tiny (area <= 1e-14), huge (areas overflow to +-inf), negative, NaN and
    infinite rectangles."""
    dets, _ = box_inputs.detections(120, seed=4, extent=15.0)
    r = _box3d.rects(dets, _box3d.LIDAR7)
    odd = [
        (0.0, 0.0, 0.0, 2.0, 0.1),
        (0.0, 0.0, 1e-8, 1e-8, 0.0),
        (0.1, 0.0, 1e-7, 1e-7, 0.3),
        (0.0, 0.0, 1e30, 1e30, 0.0),
        (1e31, 0.0, 1e30, 1e30, 0.2),
        (0.0, 0.0, -1e30, 1e30, 0.0),
        (0.0, 0.0, -2.0, 3.0, 0.5),
        (0.0, 0.0, 2.0, -3.0, 0.5),
        (math.nan, 0.0, 2.0, 3.0, 0.0),
        (0.0, 0.0, 2.0, 3.0, math.inf),
        (math.inf, 0.0, 2.0, 3.0, 0.0),
        (3.0, 4.0, 2.0, 1.0, -0.7),
    ]
    o = torch.tensor(odd, dtype=torch.float32)
    all_r = _box3d.Rects(*(torch.cat([t, o[:, i]]) for i, t in enumerate(r)))
    a = _box3d.Rects(*(t[:, None] for t in all_r))
    b = _box3d.Rects(*(t[None, :] for t in all_r))
    values = _box3d.pair_values(a, b, kind)
    a2, b2, shape = _box3d._broadcast(a, b)
    clip, ok = (t.reshape(shape) for t in _needs_clip(a2, b2))
    assert clip.sum() > 200 and (~clip & ok).sum() > 1000 and (~ok).sum() > 100
    skipped = values[~clip]
    assert torch.equal(skipped.isnan(), ~ok[~clip])
    assert (skipped[ok[~clip]] == 0).all()


# ------------------------------------------------------------------------------ native (GPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_equals_reference_bitwise(dtype):
    device = native_gpu_device()
    a, _ = box_inputs.detections(1000, seed=21)
    b, _ = box_inputs.detections(700, seed=22)
    a, b = a.to(device, dtype), b.to(device, dtype)
    for fn, args in (
        (boxes_overlap_bev, (a, b)),
        (boxes_iou_bev, (box_inputs.xyxyr(a), box_inputs.xyxyr(b))),
        (box_iou_rotated, (box_inputs.xywhr(a), box_inputs.xywhr(b), "iof", False, False)),
        (box_iou_rotated, (box_inputs.xywhr(a[:700]), box_inputs.xywhr(b), "iou", True)),
    ):
        got = fn(*args, backend="native")
        want = fn(*args, backend="reference")
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), fn.__name__


def test_native_edge_cases():
    device = native_gpu_device()
    for name, (a, b) in box_inputs.rect_cases().items():
        a, b = a.float().to(device), b.float().to(device)
        got = box_iou_rotated(a, b, backend="native")
        want = box_iou_rotated(a, b, backend="reference")
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), name
