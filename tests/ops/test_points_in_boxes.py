"""points_in_boxes_part / _all / _cpu (mmcv API): the reference against the plain-Python
definition (tests/ops/_box3d_oracle.py) on clustered LiDAR frames and on hand-made boundary
cases; native vs reference on a GPU (skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

from mu_space.ops import _box3d
from mu_space.ops.points_in_boxes import (
    points_in_boxes_all,
    points_in_boxes_cpu,
    points_in_boxes_part,
)
from mu_space.testing import boxes as box_inputs
from tests.helpers import native_gpu_device
from tests.ops import _box3d_oracle as oracle


def _oracle_all(points, boxes):
    B, M, T = points.shape[0], points.shape[1], boxes.shape[1]
    out = torch.zeros(B, M, T, dtype=torch.int32)
    p, b = points.double().tolist(), boxes.double().tolist()
    for i in range(B):
        for m in range(M):
            for t in range(T):
                out[i, m, t] = int(oracle.point_in_lidar_box(p[i][m], b[i][t]))
    return out


@pytest.fixture(scope="module")
def frame():
    return box_inputs.lidar_frame(400, 12, batch=2, seed=3)


def test_all_matches_the_definition_on_lidar_frames(frame):
    pts, bxs = frame
    want = _oracle_all(pts.double(), bxs.double())
    got = points_in_boxes_all(pts.double(), bxs.double())
    assert got.dtype == torch.int32 and got.shape == (2, 400, 12)
    assert torch.equal(got, want)
    assert want.sum() > 50  # the frame really puts points into the boxes
    # float32 agrees away from the faces (the random points are not on them)
    assert torch.equal(points_in_boxes_all(pts, bxs), want)


def test_part_is_the_first_box_of_all(frame):
    pts, bxs = frame
    # overlapping boxes: every box duplicated, shifted by 0.3 m
    shifted = bxs.clone()
    shifted[..., 0] += 0.3
    bxs = torch.cat([bxs, shifted], 1)
    a = points_in_boxes_all(pts, bxs)
    p = points_in_boxes_part(pts, bxs)
    assert p.dtype == torch.int32 and p.shape == (2, 400)
    first = torch.where(a.any(-1), a.argmax(-1), -1).int()
    assert torch.equal(p, first)
    assert ((a.sum(-1) > 1) & (p >= 0)).any()  # points in two boxes: the first wins


def test_cpu_equals_all(frame):
    pts, bxs = frame
    assert torch.equal(points_in_boxes_cpu(pts, bxs), points_in_boxes_all(pts, bxs))


def _one(points, box, dtype=torch.float64):
    p = torch.tensor(points, dtype=dtype)[None]
    b = torch.tensor([box], dtype=dtype)[None]
    return points_in_boxes_all(p, b)[0, :, 0].tolist()


def test_boundaries_z_inclusive_xy_strict():
    box = [0.0, 0.0, -1.0, 2.0, 4.0, 2.0, 0.0]  # z from -1 (bottom) to 1
    pts = [
        [0.0, 0.0, -1.0],  # on the bottom: inside
        [0.0, 0.0, 1.0],  # on the top: inside
        [0.0, 0.0, 1.0001],
        [1.0, 0.0, 0.0],  # on the x face: outside (strict)
        [0.999, 0.0, 0.0],
        [0.0, 2.0, 0.0],  # on the y face
        [0.0, -1.999, 0.0],
    ]
    assert _one(pts, box) == [1, 1, 0, 0, 1, 0, 1]
    assert _one(pts, box, torch.float32) == [1, 1, 0, 0, 1, 0, 1]


def test_rotation_convention_yaw_counter_clockwise():
    # a 4 x 1 box rotated by +90 degrees stretches along y
    box = [10.0, 5.0, 0.0, 4.0, 1.0, 1.0, math.pi / 2]
    assert _one([[10.0, 6.8, 0.5], [11.8, 5.0, 0.5]], box) == [1, 0]


def test_nan_and_inf_coordinates_and_degenerate_boxes():
    box = [0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0]
    nan, inf = math.nan, math.inf
    # a NaN z is outside (mmcv's z test would let it through); NaN / inf x, y: outside
    assert _one([[0.0, 0.0, nan], [nan, 0.0, 1.0], [inf, 0.0, 1.0], [0.0, -inf, 1.0]], box) == [
        0,
        0,
        0,
        0,
    ]
    # a NaN box holds nothing; a zero-size box holds nothing (strict faces); an infinite box
    # holds every finite point (as mmcv: x_size = inf)
    assert _one([[0.0, 0.0, 1.0]], [nan, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0]) == [0]
    assert _one([[0.0, 0.0, 0.0]], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]) == [0]
    assert _one([[0.0, 0.0, 0.0]], [0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0]) == [0]
    assert _one([[1e6, -3e5, 7.0]], [0.0, 0.0, 0.0, inf, inf, inf, 0.3]) == [1]
    # a negative size holds nothing
    assert _one([[0.0, 0.0, 1.0]], [0.0, 0.0, 0.0, -2.0, 2.0, 2.0, 0.0]) == [0]


def test_boxes_far_outside_the_points_and_empty_inputs(frame):
    pts, bxs = frame
    far = bxs.clone()
    far[..., :2] += 1e4
    assert points_in_boxes_all(pts, far).sum() == 0
    assert (points_in_boxes_part(pts, far) == -1).all()
    assert points_in_boxes_part(pts, bxs[:, :0]).eq(-1).all()
    assert points_in_boxes_all(pts, bxs[:, :0]).shape == (2, 400, 0)
    assert points_in_boxes_part(pts[:, :0], bxs).shape == (2, 0)
    assert points_in_boxes_all(pts[:0], bxs[:0]).shape == (0, 400, 12)


def test_any_batch_size():
    pts, bxs = box_inputs.lidar_frame(50, 3, batch=5, seed=9)
    want = torch.stack([points_in_boxes_all(pts[i : i + 1], bxs[i : i + 1])[0] for i in range(5)])
    assert torch.equal(points_in_boxes_all(pts, bxs), want)


@pytest.mark.parametrize(
    ("points", "boxes", "match"),
    [
        (torch.zeros(2, 5, 4), torch.zeros(2, 3, 7), r"points must be \[\*, \*, 3\]"),
        (torch.zeros(2, 5, 3), torch.zeros(2, 3, 6), r"boxes must be \[2, \*, 7\]"),
        (torch.zeros(2, 5, 3), torch.zeros(1, 3, 7), r"boxes must be \[2, \*, 7\]"),
        (torch.zeros(5, 3), torch.zeros(1, 3, 7), "points must be"),
        (torch.zeros(2, 5, 3, dtype=torch.int32), torch.zeros(2, 3, 7), "points must be float32"),
        (torch.zeros(2, 5, 3), torch.zeros(2, 3, 7).double(), "boxes must have the dtype"),
        ([[0.0, 0.0, 0.0]], torch.zeros(1, 3, 7), "points must be a torch.Tensor"),
    ],
)
def test_bad_arguments_name_the_argument(points, boxes, match):
    for fn in (points_in_boxes_part, points_in_boxes_all, points_in_boxes_cpu):
        with pytest.raises((TypeError, ValueError), match=match):
            fn(points, boxes)


# ------------------------------------- model of the native kernels' block cull (float32, CPU)


def _block_cull_misses(pb, lo, hi):
    """points_in_boxes_musa.mu's box_misses for block bounds lo / hi [blocks, 2] and boxes
    [T] -> bool [blocks, T] (float32: each subtraction rounded once, as the kernel's sub)."""
    return (
        ((lo[:, 0:1] - pb.cx) > pb.reach)
        | ((hi[:, 0:1] - pb.cx) < -pb.reach)
        | ((lo[:, 1:2] - pb.cy) > pb.reach)
        | ((hi[:, 1:2] - pb.cy) < -pb.reach)
    )


@pytest.mark.parametrize("block", [1, 128, 256])  # 1: every edge point alone
def test_block_cull_never_drops_a_near_pair(block):
    """The kernels skip a box for a whole block when the block's x / y bounds fail its reach
    test. Points placed on and one float32 step around every box's reach (where rounding
    decides), inside and between ordinary frame points, NaN points, in scan (azimuth) order and
    shuffled: no (point, box) pair that passes the kernel's first test (|x - cx| <= reach and
    |y - cy| <= reach, rounded) is ever in a culled block; in scan order most are culled."""
    pts, bxs = box_inputs.lidar_frame(6000, 40, seed=8)
    pts, bxs = pts[0], bxs[0]
    pb = _box3d.point_boxes(bxs)
    edge = []
    for t in range(bxs.shape[0]):
        for sx, sy in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            for step in (-1, 0, 1):
                x = pb.cx[t] + sx * pb.reach[t]
                y = pb.cy[t] + sy * pb.reach[t]
                if step:
                    inf = torch.tensor(math.inf * step)
                    x = torch.nextafter(x, inf) if sx else x
                    y = torch.nextafter(y, inf) if sy else y
                edge.append(torch.stack([x, y, pb.zc[t]]))
    edge = torch.stack(edge)
    nan = torch.tensor([[math.nan, 1.0, 0.0], [2.0, math.nan, 0.0]])
    g = torch.Generator().manual_seed(block)
    cloud = torch.cat([pts, edge, nan])
    scan = cloud[torch.atan2(cloud[:, 1], cloud[:, 0]).nan_to_num(0.0).argsort()]  # azimuth order
    culled = []
    for points in (scan, cloud[torch.randperm(cloud.shape[0], generator=g)]):
        M = points.shape[0] // block * block
        blocks = points[:M].view(-1, block, 3)
        xy = blocks[:, :, :2]
        lo = torch.where(xy.isnan(), math.inf, xy).amin(1)  # fminf: NaN left out
        hi = torch.where(xy.isnan(), -math.inf, xy).amax(1)
        misses = _block_cull_misses(pb, lo, hi)  # [blocks, T]
        x, y = blocks[:, :, 0:1], blocks[:, :, 1:2]  # [blocks, block, 1]
        near = ((x - pb.cx).abs() <= pb.reach) & ((y - pb.cy).abs() <= pb.reach)
        assert near.any()
        assert not (near & misses[:, None, :]).any()
        culled.append(float(misses.float().mean()))
    assert culled[0] > 0.5  # a spinning LiDAR's scan order: most (block, box) pairs skipped


# ------------------------------------------------------------------------------ native (GPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_matches_reference(dtype):
    device = native_gpu_device()
    pts, bxs = box_inputs.lidar_frame(20000, 77, batch=2, seed=5)
    pts, bxs = pts.to(device, dtype), bxs.to(device, dtype)
    for fn in (points_in_boxes_part, points_in_boxes_all):
        assert torch.equal(fn(pts, bxs, backend="native"), fn(pts, bxs, backend="reference"))


def test_native_many_boxes_and_tiles():
    device = native_gpu_device()
    pts, bxs = box_inputs.lidar_frame(3000, 700, batch=1, seed=6)  # several box tiles
    pts, bxs = pts.to(device), bxs.to(device)
    for fn in (points_in_boxes_part, points_in_boxes_all):
        assert torch.equal(fn(pts, bxs, backend="native"), fn(pts, bxs, backend="reference"))


def test_native_scan_order_block_cull():
    """Points in a spinning LiDAR's azimuth order (the kernels' block cull skips most boxes),
    NaN / inf points among them, 200 boxes (the all kernel's last box tile is 8 wide), 3
    frames; every dtype's native result is the reference's."""
    device = native_gpu_device()
    pts, bxs = box_inputs.lidar_frame(30000, 200, batch=3, seed=12)
    az = torch.atan2(pts[..., 1], pts[..., 0])
    pts = pts.gather(1, az.argsort(1)[..., None].expand_as(pts)).contiguous()
    pts[0, 5000, 0] = math.nan
    pts[1, 7000, 1] = math.inf
    pts[2, 100:300, 2] = math.nan
    pts, bxs = pts.to(device), bxs.to(device)
    for dtype in (torch.float32, torch.float16):
        p, b = pts.to(dtype), bxs.to(dtype)
        for fn in (points_in_boxes_part, points_in_boxes_all):
            assert torch.equal(fn(p, b, backend="native"), fn(p, b, backend="reference"))


@pytest.mark.parametrize("n_boxes", [1, 3, 5, 64, 199, 512, 513])
def test_native_all_every_box_count(n_boxes):
    """points_in_boxes_all's flat kernel (<= 512 boxes: a block's output is one contiguous
    range, stored as 16-byte words with scalar heads and tails where a range does not start or
    end on a word) and the tiled kernel above it; odd point counts, 3 frames, outputs poisoned
    first."""
    device = native_gpu_device()
    pts, bxs = box_inputs.lidar_frame(4001, n_boxes, batch=3, seed=n_boxes)
    pts, bxs = pts.to(device), bxs.to(device)
    want = points_in_boxes_all(pts, bxs, backend="reference")
    torch.full((3, 4001, n_boxes), 7, dtype=torch.int32, device=device)  # poison the allocator
    got = points_in_boxes_all(pts, bxs, backend="native")
    assert torch.equal(got, want)
    if n_boxes >= 64:
        assert want.sum() > 0


def _flat_inputs(n_points, n_boxes, batch, seed, dense):
    """A LiDAR frame with NaN / inf points; dense: boxes of 5-60 m on the points as well, so
    that most (block, box) pairs are near and many points are in several boxes (hits on both
    sides of every 32-bit word of the kernel's bitmask)."""
    pts, bxs = box_inputs.lidar_frame(n_points, n_boxes, batch=batch, seed=seed)
    if dense:
        g = torch.Generator().manual_seed(seed)
        pick = torch.randint(0, n_points, (batch, n_boxes), generator=g)
        bxs[..., :2] = pts[..., :2].gather(1, pick[..., None].expand(-1, -1, 2))
        bxs[..., 2] = pts[..., 2].min() - 1.0
        bxs[..., 3:5] = 5.0 + 55.0 * torch.rand(batch, n_boxes, 2, generator=g)
        bxs[..., 5] = 50.0
    pts[0, n_points // 3, 0] = math.nan
    pts[-1, n_points // 2, 2] = math.nan
    pts[-1, n_points - 1, 1] = math.inf
    return pts, bxs


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("n_boxes", [1, 2, 3, 4, 5, 7, 31, 32, 33, 63, 200, 511, 512])
def test_native_all_flat_bitmask_every_offset(n_boxes, dense):
    """The flat kernel (<= 512 boxes) tests a block's near pairs into a bitmask of its output
    range, then stores it as 16-byte words (a nibble each) with scalar heads and tails: every
    box count mod 4 and mod 32 (words that span rows, rows that span bit words), 3 frames, a
    partial last block (517 points), NaN / inf points, and `out` views 0-3 int32 off a 16-byte
    boundary with poisoned guards on both sides: element by element the reference, the guards
    untouched."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device()
    pts, bxs = _flat_inputs(517, n_boxes, 3, n_boxes + 100 * dense, dense)
    pts, bxs = pts.to(device), bxs.to(device)
    want = points_in_boxes_all(pts, bxs, backend="reference")
    if dense and n_boxes > 1:
        assert (want.sum(-1) > 1).any()  # points in several boxes
    fn = native.function("points_in_boxes_all_forward")
    n = want.numel()
    for shift in range(4):
        buf = torch.full((n + 8,), -7, dtype=torch.int32, device=device)
        assert buf.data_ptr() % 16 == 0
        out = buf[shift : shift + n].view(want.shape)
        fn(pts, bxs, out, stream_handle(pts))
        assert torch.equal(out, want), f"out 4 * {shift} bytes off"
        assert (buf[:shift] == -7).all() and (buf[shift + n :] == -7).all()


def test_native_all_flat_culled_frames_and_batches_beyond_the_grid():
    """Frames whose boxes are all far from the points (every pair culled: zeros from the
    bitmask alone) next to frames with hits; then 65538 small frames (more than the grid's
    65535 rows: blocks loop over frames, reusing the bitmask, with M * T = 15 odd so the head
    and the bit offset change from frame to frame). Poisoned outputs."""
    device = native_gpu_device()
    pts, bxs = _flat_inputs(300, 37, 6, 8, True)
    bxs[1::2, :, :2] += 1e4
    pts, bxs = pts.to(device), bxs.to(device)
    want = points_in_boxes_all(pts, bxs, backend="reference")
    assert want[1::2].sum() == 0 and want[0::2].sum() > 0
    torch.full((6, 300, 37), 7, dtype=torch.int32, device=device)  # poison the allocator
    assert torch.equal(points_in_boxes_all(pts, bxs, backend="native"), want)

    g = torch.Generator().manual_seed(4)
    B = 65535 + 3
    pts = 2.0 * torch.randn(B, 3, 3, generator=g)
    bxs = torch.cat(
        [
            2.0 * torch.randn(B, 5, 3, generator=g),
            1.0 + 4.0 * torch.rand(B, 5, 3, generator=g),
            6.0 * torch.rand(B, 5, 1, generator=g),
        ],
        -1,
    )
    pts, bxs = pts.to(device), bxs.to(device)
    want = points_in_boxes_all(pts, bxs, backend="reference")
    assert want.sum() > 0 and want[-1].numel() == 15
    torch.full((B, 3, 5), 7, dtype=torch.int32, device=device)
    assert torch.equal(points_in_boxes_all(pts, bxs, backend="native"), want)
