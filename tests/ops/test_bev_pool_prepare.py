"""bev_pool_prepare (BEVDet's voxel_pooling_prepare_v2 on the GPU) and sort_by_cell.

Reference tests always run; native tests need a GPU. Every native result must equal the
reference bit for bit: both are deterministic (stable order) and integer-valued, and the cell
arithmetic is the same IEEE operations in the same dtype.
"""

import importlib
import math

import numpy as np
import pytest
import torch

from mu_space.ops.bev_pool_prepare import (
    BEVPoolRanks,
    BEVPoolRanksPadded,
    CellSort,
    bev_pool_prepare,
    bev_pool_prepare_padded,
    bev_pool_prepare_padded_reference,
    bev_pool_prepare_reference,
    sort_by_cell,
    sort_by_cell_reference,
)
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle
from mu_space.testing import bev_geometry
from tests.helpers import (
    forbid_host_sync,
    graph_capture_device,
    native_gpu_device,
    poisoned,
    synchronize,
)

GRID = ((-51.2, -51.2, -5.0), (0.8, 0.8, 8.0), (128, 128, 1))  # BEVDet-R50's grid
# the module (mu_space.ops.bev_pool_prepare is the function: the package re-exports it)
BPP = importlib.import_module("mu_space.ops.bev_pool_prepare")


def _geometry(name, *, batch=None, device="cpu", dtype=torch.float32):
    g = bev_geometry.make(name, batch=batch)
    coor = g["coor"].to(device=device, dtype=dtype)
    return coor, (g["grid_lower_bound"], g["grid_interval"], g["grid_size"])


def _assert_equal_ranks(got, want, name="ranks"):
    assert len(got) == len(want)
    for field, g, w in zip(type(want)._fields, got, want):
        assert g.dtype == torch.int32, f"{name}.{field}: dtype {g.dtype}"
        assert g.dim() == 1, f"{name}.{field}: {g.dim()}-D"
        assert g.device == w.device, f"{name}.{field}: device {g.device} != {w.device}"
        assert g.shape == w.shape, f"{name}.{field}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not torch.equal(g, w):
            bad = (g != w).nonzero()[0].item()
            raise AssertionError(
                f"{name}.{field}: {int((g != w).sum())} entries differ, first at "
                f"{bad}: got {g[bad].item()}, want {w[bad].item()}"
            )


# ---------------------------------------------------------------- independent straightforward computation


def _loop_prepare(coor: torch.Tensor, lower, interval, size):
    """Point by point in Python with numpy scalars of coor's dtype (float32 / float64)."""
    B, N, D, H, W, _ = coor.shape
    X, Y, Z = size
    np_dtype = {torch.float32: np.float32, torch.float64: np.float64}[coor.dtype]
    lo = [np_dtype(np.float32(v)) for v in lower]  # BEVDet's float32 grid, .to(coor)
    iv = [np_dtype(np.float32(v)) for v in interval]
    flat = coor.reshape(-1, 3).numpy()
    members = {}
    for p in range(flat.shape[0]):
        cell = []
        for a in range(3):
            q = (flat[p, a] - lo[a]) / iv[a]
            if not math.isfinite(q):
                cell = None
                break
            cell.append(int(q))  # Python int() truncates toward zero, as .long() does
        if cell is None:
            continue
        x, y, z = cell
        if not (0 <= x < X and 0 <= y < Y and 0 <= z < Z):
            continue
        b = p // (N * D * H * W)
        members.setdefault(((b * Z + z) * Y + y) * X + x, []).append(p)
    ranks_bev, ranks_depth, ranks_feat, starts, lengths = [], [], [], [], []
    for rank in sorted(members):
        starts.append(len(ranks_bev))
        lengths.append(len(members[rank]))
        for p in members[rank]:  # ascending point index: the stable order
            ranks_bev.append(rank)
            ranks_depth.append(p)
            bn, hw = p // (D * H * W), p % (H * W)
            ranks_feat.append(bn * H * W + hw)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return BEVPoolRanks(
        as_t(ranks_bev), as_t(ranks_depth), as_t(ranks_feat), as_t(starts), as_t(lengths)
    )


@pytest.mark.parametrize("batch", [1, 2])
def test_reference_matches_a_point_by_point_loop(batch):
    coor, grid = _geometry("tiny", batch=batch)
    want = _loop_prepare(coor, *grid)
    assert want.ranks_bev.numel() > 1000 and want.interval_starts.numel() > 100
    _assert_equal_ranks(bev_pool_prepare_reference(coor, *grid), want)
    _assert_equal_ranks(bev_pool_prepare(coor, *grid), want)


def test_reference_float64_matches_the_loop():
    coor, grid = _geometry("tiny", dtype=torch.float64)
    _assert_equal_ranks(bev_pool_prepare(coor, *grid), _loop_prepare(coor, *grid))


def test_same_sets_as_upstream_formula_on_bevdet_r50():
    """Against BEVDet's formula written out with torch (.long(), unstable argsort): the same
    ranks_bev and intervals, and the same set of points in each interval."""
    coor, (lower, interval, size) = _geometry("bevdet-r50")
    got = bev_pool_prepare(coor, lower, interval, size)
    B, N, D, H, W, _ = coor.shape
    c = ((coor - torch.tensor(lower)) / torch.tensor(interval)).long().view(-1, 3)
    kept = ((c >= 0) & (c < torch.tensor(size))).all(1)
    idx = kept.nonzero().squeeze(1)
    rank = c[idx, 2] * size[1] * size[0] + c[idx, 1] * size[0] + c[idx, 0]
    order = rank.argsort()
    assert torch.equal(got.ranks_bev.long(), rank[order])
    assert got.ranks_bev.numel() == 177_584 and got.interval_starts.numel() == 9_722
    starts = torch.cat([torch.ones(1, dtype=torch.bool), rank[order][1:] != rank[order][:-1]])
    assert torch.equal(got.interval_starts.long(), starts.nonzero().squeeze(1))
    for s, n in zip(got.interval_starts.tolist()[::97], got.interval_lengths.tolist()[::97]):
        assert set(got.ranks_depth[s : s + n].tolist()) == set(idx[order][s : s + n].tolist())


# ---------------------------------------------------------------- semantics


def _points(values, dtype=torch.float32, shape=None):
    """coor [1, 1, n, 1, 1, 3] (or `shape`) from a list of (x, y, z)."""
    t = torch.tensor(values, dtype=dtype)
    return t.reshape(shape or (1, 1, len(values), 1, 1, 3))


def test_points_outside_the_grid_are_dropped():
    # grid: x, y in [0, 4) with 1 m cells, z in [0, 2) one 2 m cell
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 2.0), (4, 4, 1))
    coor = _points(
        [
            (0.5, 0.5, 1.0),
            (4.0, 0.5, 1.0),
            (0.5, 4.2, 1.0),
            (0.5, 0.5, 2.0),
            (3.99, 3.99, 1.99),
            (0.5, 0.5, -2.5),
            (-2.0, 0.5, 1.0),
            (1.5, 2.5, 0.0),
        ]
    )
    r = bev_pool_prepare(coor, *grid)
    assert r.ranks_depth.tolist() == [0, 7, 4]
    assert r.ranks_bev.tolist() == [0, 2 * 4 + 1, 3 * 4 + 3]
    assert r.interval_starts.tolist() == [0, 1, 2] and r.interval_lengths.tolist() == [1, 1, 1]


def test_truncation_quirk_keeps_points_less_than_one_cell_below_the_lower_bound():
    """Upstream converts with .long() (truncation toward zero): q in (-1, 0) lands in cell 0."""
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (4, 4, 1))
    # values exact enough in bfloat16 (8 significant bits) to stay on their side of each bound
    coor = _points(
        [
            (-0.5, 0.5, 0.5),
            (-0.9, -0.25, 0.5),
            (-1.0, 0.5, 0.5),
            (0.5, 0.5, -0.75),
            (-1.5, 0.5, 0.5),
            (3.9, 0.5, 0.5),
            (4.0, 0.5, 0.5),
        ]
    )
    for backend_coor in (coor, coor.double(), coor.half(), coor.bfloat16()):
        r = bev_pool_prepare(backend_coor, *grid)
        assert r.ranks_depth.tolist() == [0, 1, 3, 5], backend_coor.dtype
        assert r.ranks_bev.tolist() == [0, 0, 0, 3]
        assert r.interval_lengths.tolist() == [3, 1]


def test_nan_and_inf_coordinates_are_dropped():
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (4, 4, 1))
    nan, inf = float("nan"), float("inf")
    coor = _points([(nan, 0.5, 0.5), (0.5, inf, 0.5), (0.5, 0.5, -inf), (1.5, 1.5, 0.5)])
    r = bev_pool_prepare(coor, *grid)
    assert r.ranks_depth.tolist() == [3] and r.ranks_bev.tolist() == [5]


def test_batch_offsets_and_feature_ranks():
    # B=2, N=2, D=3, H=1, W=2: every point in the grid, cell = x index
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (8, 1, 1))
    B, N, D, H, W = 2, 2, 3, 1, 2
    coor = torch.zeros(B, N, D, H, W, 3)
    coor[..., 0] = torch.arange(B * N * D * H * W, dtype=torch.float32).reshape(B, N, D, H, W) % 8
    coor[..., 1:] = 0.5
    r = bev_pool_prepare(coor, *grid)
    p = r.ranks_depth.long()
    b, n, d, w = p // (N * D * W), p // (D * W) % N, p // W % D, p % W
    assert torch.equal(r.ranks_bev.long(), b * 8 + p % 8)
    assert torch.equal(r.ranks_feat.long(), (b * N + n) * W + w)
    assert d.max() == D - 1 and b.max() == 1
    assert torch.all(r.ranks_bev[1:] >= r.ranks_bev[:-1])


def test_no_point_in_the_grid_gives_five_empty_int32_tensors():
    """Upstream returns None here; we return empty tensors (documented)."""
    coor = torch.full((1, 2, 3, 2, 2, 3), 1000.0)
    for c in (coor, torch.empty(0, 6, 4, 2, 2, 3), torch.empty(1, 6, 0, 2, 2, 3)):
        r = bev_pool_prepare(c, *GRID)
        assert isinstance(r, BEVPoolRanks)
        assert all(t.dtype == torch.int32 and t.shape == (0,) for t in r)


def test_one_point():
    r = bev_pool_prepare(_points([(0.1, -0.1, 0.0)]), *GRID)
    assert r.ranks_bev.tolist() == [63 * 128 + 64] and r.ranks_depth.tolist() == [0]
    assert r.interval_starts.tolist() == [0] and r.interval_lengths.tolist() == [1]


def test_every_point_in_one_cell():
    coor = torch.full((2, 3, 5, 2, 3, 3), 0.3)
    r = bev_pool_prepare(coor, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (2, 2, 1))
    n = coor.numel() // 3
    per_batch = n // 2
    # two cells (one per batch element), each a run of ascending point indices
    assert r.interval_starts.tolist() == [0, per_batch]
    assert r.interval_lengths.tolist() == [per_batch, per_batch]
    assert torch.equal(r.ranks_depth, torch.arange(n, dtype=torch.int32))
    assert r.ranks_bev.tolist() == [0] * per_batch + [4] * per_batch


def test_half_and_bfloat16_follow_upstream_arithmetic_in_that_dtype():
    """upstream: (coor - lower.to(coor)) / interval.to(coor), each op rounded to the dtype."""
    coor, (lower, interval, size) = _geometry("tiny")
    for dtype in (torch.float16, torch.bfloat16):
        c = coor.to(dtype)
        q = ((c - torch.tensor(lower).to(c)) / torch.tensor(interval).to(c)).float()
        r = bev_pool_prepare(c, lower, interval, size)
        want_kept = ((q > -1) & (q < torch.tensor(size))).all(-1).flatten().nonzero().squeeze(1)
        assert torch.equal(r.ranks_depth.sort().values.long(), want_kept), dtype
        cell = q.long().view(-1, 3)[r.ranks_depth.long()]
        assert torch.equal(
            r.ranks_bev.long(), (cell[:, 2] * size[1] + cell[:, 1]) * size[0] + cell[:, 0]
        )


def test_grid_as_tensors_like_bevdet():
    coor, (lower, interval, size) = _geometry("tiny")
    want = bev_pool_prepare(coor, lower, interval, size)
    got = bev_pool_prepare(
        coor, torch.tensor(lower), torch.tensor(interval), torch.tensor(size, dtype=torch.float32)
    )  # BEVDet's grid_size is float
    _assert_equal_ranks(got, want)
    _assert_equal_ranks(bev_pool_prepare(coor, list(lower), np.array(interval), list(size)), want)


def test_bev_pool_v2_args_order_is_bevdets():
    coor, grid = _geometry("tiny")
    r = bev_pool_prepare(coor, *grid)
    shape = (1, 1, 20, 20, 5)
    args = r.bev_pool_v2_args(shape)
    assert args[0] is r.ranks_depth and args[1] is r.ranks_feat and args[2] is r.ranks_bev
    assert args[3] == shape and args[4] is r.interval_starts and args[5] is r.interval_lengths
    ranks_bev, ranks_depth, ranks_feat, interval_starts, interval_lengths = r  # upstream unpacking
    assert ranks_bev is r.ranks_bev and interval_lengths is r.interval_lengths


def test_deterministic_over_reruns():
    coor, grid = _geometry("tiny", batch=2)
    first = bev_pool_prepare(coor, *grid)
    for _ in range(3):
        _assert_equal_ranks(bev_pool_prepare(coor, *grid), first)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (lambda c: [c], TypeError, "coor must be a torch.Tensor"),
        (
            lambda c: c.long(),
            TypeError,
            "coor must be float32, float16, bfloat16 or float64, got int64",
        ),
        (lambda c: c[0], ValueError, r"coor must be \[B, N, D, H, W, 3\]"),
        (lambda c: c[..., :2], ValueError, r"coor must be \[B, N, D, H, W, 3\]"),
    ],
)
def test_bad_coor_errors_name_the_argument(bad, exc, match):
    coor, grid = _geometry("tiny")
    with pytest.raises(exc, match=match):
        bev_pool_prepare(bad(coor), *grid)


@pytest.mark.parametrize(
    "grid, exc, match",
    [
        (((0, 0), (1, 1, 1), (4, 4, 1)), ValueError, "grid_lower_bound must have 3 values"),
        (((0, 0, 0), (1, 1, 1, 1), (4, 4, 1)), ValueError, "grid_interval must have 3 values"),
        (((0, 0, 0), (1, 1, 1), 4), TypeError, "grid_size must be 3 numbers"),
        (((0, 0, 0), (1, 0, 1), (4, 4, 1)), ValueError, "grid_interval must be positive"),
        (((0, 0, 0), (1, -1, 1), (4, 4, 1)), ValueError, "grid_interval must be positive"),
        (((0, 0, 0), (1, 1e-50, 1), (4, 4, 1)), ValueError, "grid_interval must be positive"),
        (
            ((0, float("nan"), 0), (1, 1, 1), (4, 4, 1)),
            ValueError,
            "grid_lower_bound must be finite",
        ),
        (((0, 0, 0), (1, 1, 1), (4, 0, 1)), ValueError, "grid_size must be positive"),
        (((0, 0, 0), (1, 1, 1), (4, 4.5, 1)), ValueError, "grid_size must be 3 integers"),
        (((0, 0, 0), (1, 1, 1), (4, "a", 1)), TypeError, "grid_size must be 3 integers"),
        (((0, 0, 0), (1, 1, 1), (2**16, 2**16, 1)), ValueError, "exceeds the int32 range"),
    ],
)
def test_bad_grid_errors_name_the_argument(grid, exc, match):
    coor = _points([(0.5, 0.5, 0.5)])
    with pytest.raises(exc, match=match):
        bev_pool_prepare(coor, *grid)
    with pytest.raises(exc, match=match):
        bev_pool_prepare_reference(coor, *grid)


# ---------------------------------------------------------------- sort_by_cell


def _loop_sort(cell: list, n_cells: int):
    kept = [i for i, c in enumerate(cell) if 0 <= c < n_cells]
    order = sorted(kept, key=lambda i: cell[i])  # Python's sort is stable
    starts, lengths = [], []
    for k, i in enumerate(order):
        if k == 0 or cell[order[k - 1]] != cell[i]:
            starts.append(k)
            lengths.append(0)
        lengths[-1] += 1
    return order, starts, lengths


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_by_cell_is_a_stable_sort_dropping_out_of_range(dtype):
    g = torch.Generator().manual_seed(5)
    cell = torch.randint(-20, 120, (3000,), generator=g)
    cell[::7] = 2**40 if dtype == torch.int64 else -(2**31)
    cell = cell.to(dtype)
    got = sort_by_cell(cell, 100)
    order, starts, lengths = _loop_sort(cell.tolist(), 100)
    assert isinstance(got, CellSort) and all(t.dtype == torch.int32 for t in got)
    assert got.order.tolist() == order
    assert got.interval_starts.tolist() == starts and got.interval_lengths.tolist() == lengths


def test_sort_by_cell_small_cases():
    assert sort_by_cell(torch.tensor([3, 1, -1, 3, 5, 1, 0]), 5).order.tolist() == [6, 1, 5, 0, 3]
    empty = sort_by_cell(torch.empty(0, dtype=torch.int64), 10)
    assert all(t.shape == (0,) and t.dtype == torch.int32 for t in empty)
    none_kept = sort_by_cell(torch.tensor([5, 6, -1]), 5)
    assert all(t.shape == (0,) for t in none_kept)
    assert all(t.shape == (0,) for t in sort_by_cell(torch.tensor([0, 1]), 0))
    one_cell = sort_by_cell(torch.full((50,), 2, dtype=torch.int32), 3)
    assert one_cell.order.tolist() == list(range(50))
    assert one_cell.interval_starts.tolist() == [0] and one_cell.interval_lengths.tolist() == [50]


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.tensor([1.0, 2.0]), 4), TypeError, "cell must be int32 or int64, got float32"),
        ((torch.zeros(2, 2, dtype=torch.int64), 4), ValueError, "cell must be 1-D, got 2-D"),
        (([1, 2], 4), TypeError, "cell must be a torch.Tensor"),
        ((torch.tensor([1, 2]), -1), ValueError, "n_cells must be in"),
        ((torch.tensor([1, 2]), 2**31), ValueError, "n_cells must be in"),
        ((torch.tensor([1, 2]), 2.5), TypeError, "n_cells must be an int"),
    ],
)
def test_sort_by_cell_bad_inputs(args, exc, match):
    with pytest.raises(exc, match=match):
        sort_by_cell(*args)


# ---------------------------------------------------------------- torch.library / registry


# ---------------------------------------------------------------- the padded (sync-free) variant


def _assert_padded(got, want: BEVPoolRanks, n: int, n_cells: int, name="padded"):
    """got = want's entries followed by the documented padding, and the counts."""
    assert isinstance(got, BEVPoolRanksPadded)
    k, m = want.ranks_bev.shape[0], want.interval_starts.shape[0]
    cap = min(n, n_cells)
    assert got.counts.dtype == torch.int32 and got.counts.tolist() == [k, m], name
    for field, g, w, size in zip(BEVPoolRanks._fields, got, want, (n, n, n, cap, cap)):
        assert g.dtype == torch.int32 and g.shape == (size,), f"{name}.{field}: {g.shape}"
        assert torch.equal(g[: w.shape[0]], w), f"{name}.{field}: the prefix differs"
    tail = torch.arange(k, n, dtype=torch.int64, device=got.ranks_bev.device)
    assert torch.equal(got.ranks_bev[k:].long(), 2**31 - n + tail), f"{name}: ranks_bev padding"
    assert (got.ranks_bev[k:].long() >= n_cells).all()
    assert (got.ranks_bev[1:] >= got.ranks_bev[:-1]).all(), f"{name}: ranks_bev not sorted"
    assert (got.ranks_depth[k:] == -1).all() and (got.ranks_feat[k:] == -1).all(), name
    assert (got.interval_starts[m:] == 0).all() and (got.interval_lengths[m:] == 0).all(), name


@pytest.mark.parametrize("name, batch", [("tiny", None), ("tiny", 3), ("bevdet-r50", None)])
def test_padded_reference_is_the_ranks_then_padding(name, batch):
    coor, grid = _geometry(name, batch=batch)
    n = coor.numel() // 3
    n_cells = coor.shape[0] * math.prod(grid[2])
    want = bev_pool_prepare_reference(coor, *grid)
    assert 0 < want.ranks_bev.shape[0] < n  # some points fall outside the grid: a real tail
    _assert_padded(bev_pool_prepare_padded_reference(coor, *grid), want, n, n_cells, name)
    got = bev_pool_prepare_padded(coor, *grid)  # the public call (reference on the CPU)
    _assert_padded(got, want, n, n_cells, name)
    assert got.bev_pool_v2_args((1, 1, 2, 3, 4))[3] == (1, 1, 2, 3, 4)


def test_padded_no_points_and_the_pad_key_limit():
    coor, grid = _geometry("tiny")
    empty = bev_pool_prepare_padded(coor[:, :, :0], *grid)
    assert [t.shape[0] for t in empty] == [0, 0, 0, 0, 0, 2] and empty.counts.tolist() == [0, 0]
    outside = bev_pool_prepare_padded(coor + 1000.0, *grid)  # every point dropped
    n = coor.numel() // 3
    assert outside.counts.tolist() == [0, 0] and (outside.ranks_depth == -1).all()
    assert torch.equal(outside.ranks_bev.long(), 2**31 - n + torch.arange(n))
    # every point needs a key above the cells: n + cells <= 2**31
    huge = (grid[0], grid[1], (2**31 - 1, 1, 1))
    with pytest.raises(ValueError, match="padded ranks_bev"):
        bev_pool_prepare_padded(coor, *huge)
    with pytest.raises(ValueError, match="padded ranks_bev"):
        bev_pool_prepare_padded_reference(coor, *huge)


# ---------------------------------------------------------------- native (GPU) tests

CONFIGS = ["tiny", "bevdet-r50", "bevdet-r50-d88", "bevdet-d118", "bevfusion-cam"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_native_equals_reference_on_frustum_geometry(name):
    device = native_gpu_device()
    coor, grid = _geometry(name, device=device)
    want = bev_pool_prepare_reference(coor, *grid)
    _assert_equal_ranks(bev_pool_prepare(coor, *grid, backend="native"), want, name)
    # and the CPU reference agrees with the GPU reference
    _assert_equal_ranks(
        bev_pool_prepare_reference(coor.cpu(), *grid),
        BEVPoolRanks(*(t.cpu() for t in want)),
        name + " cpu",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name, batch", [("bevdet-r50", 2), ("bevdet-r50", 4), ("tiny", 3)])
def test_native_batch_greater_than_one(name, batch):
    device = native_gpu_device()
    coor, grid = _geometry(name, batch=batch, device=device)  # per-sample calibration jitter
    _assert_equal_ranks(
        bev_pool_prepare(coor, *grid, backend="native"),
        bev_pool_prepare_reference(coor, *grid),
        f"{name} B={batch}",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny", "bevdet-r50", "bevfusion-cam"])
def test_native_half_and_bfloat16_equal_reference(name, dtype):
    device = native_gpu_device()
    coor, grid = _geometry(name, device=device, dtype=dtype)
    want = bev_pool_prepare_reference(coor, *grid)
    _assert_equal_ranks(bev_pool_prepare(coor, *grid, backend="native"), want, f"{name} {dtype}")
    _assert_equal_ranks(
        bev_pool_prepare_reference(coor.cpu(), *grid),
        BEVPoolRanks(*(t.cpu() for t in want)),
        f"{name} {dtype} cpu",
    )


# flags of the native entry points: stages COUNT (1) and ORDER (2), clean workspace (4),
# block-aggregated histogram (8)
COUNT, ORDER, CLEAN, AGGREGATE = 1, 2, 4, 8


def _call_native_prepare(coor, grid, *, workspace=None, flag_sets=((COUNT | ORDER),)):
    """The raw entry point with poisoned outputs and (unless given) a garbage workspace, called
    once per entry of flag_sets."""
    from mu_space.ops.bev_pool_prepare import _grid

    lower, interval, size = _grid(*grid)
    device = coor.device
    n = coor.numel() // 3
    n_cells = coor.shape[0] * size[0] * size[1] * size[2]
    cap = min(n, n_cells)
    if workspace is None:
        ints = native.function("bev_pool_sort_workspace_ints")(n, n_cells)
        workspace = torch.full((ints,), 0x3F3F3F3F, dtype=torch.int32, device=device)
    outs = [poisoned((n,), torch.int32, device) for _ in range(3)]
    outs += [poisoned((cap,), torch.int32, device) for _ in range(2)]
    for flags in flag_sets:
        native.function("bev_pool_prepare_forward")(
            coor, workspace, *outs, *lower, *interval, *size, flags, 0, 0, stream_handle(coor)
        )
    synchronize(device)
    k, m = workspace[:2].tolist()
    return outs, k, m


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "bevdet-r50", "bevfusion-cam"])
def test_native_stages_and_a_reused_workspace(name):
    """COUNT then ORDER as two calls (what the Python side does), and a workspace reused with
    the clean flag: every COUNT stage must leave the workspace's zero region zero again, whatever
    garbage the rest of it holds from the previous call."""
    device = native_gpu_device()
    coor, grid = _geometry(name, device=device)
    want = bev_pool_prepare_reference(coor, *grid)
    from mu_space.ops.bev_pool_prepare import _grid

    n = coor.numel() // 3
    size = _grid(*grid)[2]
    ints = native.function("bev_pool_sort_workspace_ints")(
        n, coor.shape[0] * size[0] * size[1] * size[2]
    )
    ws = torch.full((ints,), 0x3F3F3F3F, dtype=torch.int32, device=device)
    for flag_sets in [
        (COUNT, ORDER),
        (COUNT | CLEAN, ORDER),
        (COUNT | ORDER | CLEAN,),
        (COUNT | CLEAN | AGGREGATE, ORDER),
        (COUNT | ORDER | CLEAN | AGGREGATE,),
    ]:
        outs, k, m = _call_native_prepare(coor, grid, workspace=ws, flag_sets=flag_sets)
        assert k == want.ranks_bev.numel() and m == want.interval_starts.numel(), flag_sets
        _assert_equal_ranks(
            BEVPoolRanks(outs[0][:k], outs[1][:k], outs[2][:k], outs[3][:m], outs[4][:m]),
            want,
            f"{name} {flag_sets}",
        )
        assert all(torch.all(t[k:] == -1) for t in outs[:3])
        assert all(torch.all(t[m:] == -1) for t in outs[3:])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, dtype",
    [("bevdet-r50", torch.float32), ("bevfusion-cam", torch.float16), ("tiny", torch.bfloat16)],
)
def test_native_aggregated_histogram_policy(name, dtype, monkeypatch):
    """The block-aggregated histogram (profiling knob) gives the same result."""
    device = native_gpu_device()
    monkeypatch.setattr(BPP, "_POLICY", AGGREGATE)
    coor, grid = _geometry(name, device=device, dtype=dtype)
    _assert_equal_ranks(
        bev_pool_prepare(coor, *grid, backend="native"),
        bev_pool_prepare_reference(coor, *grid),
        name,
    )
    cell = torch.randint(-5, 3000, (100_000,), device=device)
    cell[::3] = 7  # a hot cell
    _assert_equal_ranks(
        sort_by_cell(cell, 3000, backend="native"), sort_by_cell_reference(cell, 3000)
    )


@pytest.mark.gpu
def test_native_cached_workspaces_across_configs_and_ops():
    """The per-stream workspace cache: configs of different sizes and cell counts, sort_by_cell
    with a changing n (as bev_pool_v2's backward calls it) and a second stream, interleaved."""
    device = native_gpu_device()
    inputs = [_geometry(name, device=device) for name in ("bevdet-r50", "tiny", "bevfusion-cam")]
    wants = [bev_pool_prepare_reference(c, *g) for c, g in inputs]
    g = torch.Generator().manual_seed(2)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None  # emulation: no streams
    for step in range(3):
        for (coor, grid), want in zip(inputs, wants):
            _assert_equal_ranks(
                bev_pool_prepare(coor, *grid, backend="native"), want, f"step {step}"
            )
            n = 50_000 + 20_000 * step
            cell = torch.randint(-10, 4224, (n,), generator=g).to(device)
            _assert_equal_ranks(
                sort_by_cell(cell, 4224, backend="native"),
                sort_by_cell_reference(cell, 4224),
                f"sort n={n}",
            )
        if side is None:
            continue
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            got = bev_pool_prepare(inputs[0][0], *inputs[0][1], backend="native")
        side.synchronize()
        _assert_equal_ranks(got, wants[0], "side stream")


@pytest.mark.gpu
@pytest.mark.parametrize("readback", ["zerocopy", "event", "sync"])
def test_native_count_readback_modes(readback, monkeypatch):
    """Every way the two counts reach the host gives the same result: the zero-copy write into
    pinned memory, the pinned copy + event, and the plain read after both stages; also when the
    stream has a long queue ahead (the host stops spinning and blocks on the event)."""
    device = native_gpu_device()
    if device.type != "cuda" and readback != "sync":
        pytest.skip("pinned-memory readback: CUDA only (the CPU path reads after both stages)")
    monkeypatch.setattr(BPP, "_READBACK", readback)
    for name in ("bevdet-r50", "tiny", "bevfusion-cam"):
        coor, grid = _geometry(name, device=device)
        want = bev_pool_prepare_reference(coor, *grid)
        for _ in range(2):
            _assert_equal_ranks(bev_pool_prepare(coor, *grid, backend="native"), want, name)
        if device.type == "cuda":
            torch.cuda._sleep(20_000_000)  # ~10 ms queued: longer than the spin limit
        _assert_equal_ranks(bev_pool_prepare(coor, *grid, backend="native"), want, name + " queued")
    cell = torch.randint(-3, 5000, (70_000,), device=device)
    _assert_equal_ranks(
        sort_by_cell(cell, 5000, backend="native"), sort_by_cell_reference(cell, 5000)
    )
    assert BPP._READBACK == readback  # no fallback was needed


@pytest.mark.gpu
def test_native_semantic_edge_cases():
    device = native_gpu_device()
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (4, 4, 1))
    nan, inf = float("nan"), float("inf")
    cases = [
        _points(
            [
                (-0.5, 0.5, 0.5),
                (-0.999, -0.25, 0.5),
                (-1.0, 0.5, 0.5),
                (0.5, 0.5, -0.75),
                (-1.5, 0.5, 0.5),
                (3.999, 0.5, 0.5),
                (4.0, 0.5, 0.5),
                (-0.9, 0.5, 0.5),
                (3.9, 0.5, 0.5),
            ]
        ),  # truncation quirk, dtype rounding
        _points([(nan, 0.5, 0.5), (0.5, inf, 0.5), (0.5, 0.5, -inf), (1.5, 1.5, 0.5)]),
        _points([(0.5, 0.5, 0.5)]),  # one point
        torch.full((2, 3, 5, 2, 3, 3), 0.3),  # every point in one cell per batch element
        torch.full((1, 2, 3, 2, 2, 3), 1000.0),  # no point in the grid
    ]
    for coor in cases:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            c = coor.to(device=device, dtype=dtype)
            _assert_equal_ranks(
                bev_pool_prepare(c, *grid, backend="native"),
                bev_pool_prepare_reference(c, *grid),
                f"{list(coor.shape)} {dtype}",
            )
    empty = bev_pool_prepare(torch.empty(1, 6, 0, 2, 2, 3, device=device), *grid, backend="native")
    assert all(t.shape == (0,) and t.device == device for t in empty)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [0, AGGREGATE])
def test_native_long_segments_use_the_block_sort(policy, monkeypatch):
    """Segments longer than the counting limit (256) and than one shared-memory chunk (2048):
    every point of 100k in one cell, and clusters of 300..20000 points."""
    device = native_gpu_device()
    monkeypatch.setattr(BPP, "_POLICY", policy)
    grid = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), (64, 64, 2))
    g = torch.Generator().manual_seed(3)
    one = torch.full((1, 4, 25, 10, 100, 3), 0.5)
    sizes = torch.tensor([300, 257, 2047, 2048, 2049, 5000, 20000, 1, 256])
    centres = torch.rand(len(sizes), 3, generator=g) * torch.tensor([60.0, 60.0, 1.5])
    pts = torch.cat([c + 0.01 * torch.rand(int(s), 3, generator=g) for c, s in zip(centres, sizes)])
    pts = pts[torch.randperm(len(pts), generator=g)]
    clustered = pts.reshape(1, 1, -1, 1, 1, 3)
    for coor in (one, clustered):
        c = coor.to(device)
        got = bev_pool_prepare(c, *grid, backend="native")
        want = bev_pool_prepare_reference(c, *grid)
        _assert_equal_ranks(got, want, f"{list(coor.shape)}")
        assert got.interval_lengths.max() >= 2049


@pytest.mark.gpu
def test_native_non_contiguous_coor():
    device = native_gpu_device()
    coor, grid = _geometry("tiny", device=device)
    t = coor.permute(0, 1, 3, 4, 2, 5).contiguous().permute(0, 1, 4, 2, 3, 5)  # same values
    assert not t.is_contiguous()
    _assert_equal_ranks(
        bev_pool_prepare(t, *grid, backend="native"), bev_pool_prepare_reference(coor, *grid)
    )


@pytest.mark.gpu
def test_native_entry_points_validate_arguments():
    device = native_gpu_device()
    prep = native.function("bev_pool_prepare_forward")
    sort = native.function("sort_by_cell_forward")
    ws_ints = native.function("bev_pool_sort_workspace_ints")
    coor = torch.rand(1, 1, 4, 1, 2, 3, device=device)  # n = 8
    s = stream_handle(coor)
    n, cells = 8, 16
    ws = torch.empty(ws_ints(n, cells), dtype=torch.int32, device=device)
    i32 = lambda k: torch.empty(k, dtype=torch.int32, device=device)  # noqa: E731
    grid = (0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 4, 4, 1)
    good = [coor, ws, i32(n), i32(n), i32(n), i32(8), i32(8)]

    def call(i, value):
        args = list(good)
        args[i] = value
        prep(*args, *grid, 3, 0, 0, s)

    with pytest.raises(TypeError, match="coor must be float32, float16 or bfloat16, got float64"):
        call(0, coor.double())
    wrong_device = device.type == "cuda"  # the host emulation's device is the CPU itself
    if wrong_device:
        with pytest.raises(ValueError, match="coor must be a cuda tensor, got cpu:0"):
            call(0, coor.cpu())
    with pytest.raises(ValueError, match="coor must be 6-D, got 5-D"):
        call(0, coor[0])
    with pytest.raises(ValueError, match="coor must be contiguous"):
        call(0, torch.rand(1, 1, 2, 1, 4, 3, device=device).transpose(2, 4))
    with pytest.raises(TypeError, match="ranks_bev must be int32, got int64"):
        call(2, torch.empty(n, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"ranks_feat.shape\[0\] must be 8, got 7"):
        call(4, i32(7))
    with pytest.raises(ValueError, match=r"interval_lengths.shape\[0\] must be 8, got 16"):
        call(6, i32(16))
    if wrong_device:
        with pytest.raises(ValueError, match="ranks_depth must be on cuda:0, got cpu:0"):
            call(3, torch.empty(n, dtype=torch.int32))
    with pytest.raises(ValueError, match="workspace must hold at least"):
        call(1, i32(10))
    with pytest.raises(ValueError, match="grid_size must be positive"):
        prep(*good, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 4, 0, 1, 3, 0, 0, s)
    with pytest.raises(ValueError, match="grid_interval must be positive and finite"):
        prep(*good, 0.0, 0.0, 0.0, 1.0, -1.0, 1.0, 4, 4, 1, 3, 0, 0, s)
    with pytest.raises(ValueError, match="exceeds the int32 range"):
        prep(*good, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1 << 16, 1 << 16, 1, 3, 0, 0, s)
    for bad_flags in (0, 4, 16, -1):
        with pytest.raises(ValueError, match="flags must select at least one stage"):
            prep(*good, *grid, bad_flags, 0, 0, s)
    with pytest.raises(ValueError, match="host_counts must be a 4-byte aligned address"):
        prep(*good, *grid, 3, 2, 1, s)
    with pytest.raises(ValueError, match="sequence must be in"):
        prep(*good, *grid, 3, 0, -1, s)
    cell = torch.zeros(n, dtype=torch.int64, device=device)
    with pytest.raises(TypeError, match="cell must be int32 or int64, got float32"):
        sort(cell.float(), ws, i32(n), i32(8), i32(8), 16, 3, 0, 0, s)
    with pytest.raises(ValueError, match=r"order.shape\[0\] must be 8, got 9"):
        sort(cell, ws, i32(9), i32(8), i32(8), 16, 3, 0, 0, s)
    with pytest.raises(ValueError, match="n_cells must be in"):
        sort(cell, ws, i32(n), i32(0), i32(0), -1, 3, 0, 0, s)
    with pytest.raises(ValueError, match="flags must select at least one stage"):
        sort(cell, ws, i32(n), i32(8), i32(8), 16, 8, 0, 0, s)
    with pytest.raises(ValueError, match="n must be in"):
        ws_ints(-1, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "kind, n, n_cells",
    [
        ("uniform", 200_000, 16_384),
        ("uniform-out-of-range", 100_000, 1000),
        ("power-law", 300_000, 50_000),
        ("one-cell", 60_000, 7),
        ("sparse", 1000, 3_000_000),
        ("one", 1, 1),
        ("bev_pool_v2-backward-feat", 177_584, 4224),
    ],
)
def test_native_sort_by_cell_equals_reference(kind, n, n_cells, dtype):
    device = native_gpu_device()
    g = torch.Generator().manual_seed(11)
    if kind == "uniform":
        cell = torch.randint(0, n_cells, (n,), generator=g)
    elif kind == "uniform-out-of-range":  # bad cells are dropped, never used as an index
        cell = torch.randint(-n_cells, 2 * n_cells, (n,), generator=g)
        cell[::13] = -(2**31)
        cell[::17] = 2**31 - 1
        if dtype == torch.int64:
            cell[::19] = 2**40
            cell[::23] = -(2**62)
    elif kind == "power-law":  # a few cells with thousands of entries, many with one
        cell = (n_cells * torch.rand(n, generator=g) ** 4).long()
    elif kind == "one-cell":
        cell = torch.full((n,), 3)
    elif kind == "sparse":
        cell = torch.randint(0, n_cells, (n,), generator=g)
    elif kind == "one":
        cell = torch.zeros(1, dtype=torch.int64)
    else:  # ranks_feat of bevdet-r50, as bev_pool_v2's deterministic backward groups them
        coor, grid = _geometry("bevdet-r50")
        cell = bev_pool_prepare_reference(coor, *grid).ranks_feat.long()
    cell = cell.to(device=device, dtype=dtype)
    want = sort_by_cell_reference(cell, n_cells)
    got = sort_by_cell(cell, n_cells, backend="native")
    _assert_equal_ranks(got, want, kind)
    _assert_equal_ranks(sort_by_cell(cell, n_cells, backend="native"), got, kind + " rerun")


@pytest.mark.gpu
def test_native_sort_by_cell_empty_and_no_cells():
    device = native_gpu_device()
    for cell, n_cells in (
        (torch.empty(0, dtype=torch.int64, device=device), 10),
        (torch.arange(5, device=device), 0),
        (torch.full((100,), -1, device=device), 10),
    ):
        got = sort_by_cell(cell, n_cells, backend="native")
        assert all(t.shape == (0,) and t.dtype == torch.int32 and t.device == device for t in got)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CONFIGS)
def test_native_padded_equals_reference_without_a_host_sync(name):
    device = native_gpu_device()
    coor, grid = _geometry(name, device=device)
    want = bev_pool_prepare_padded_reference(coor, *grid)
    bev_pool_prepare_padded(coor, *grid, backend="native")  # warm: library, caches
    with forbid_host_sync(coor.device):  # any synchronisation raises
        got = bev_pool_prepare_padded(coor, *grid, backend="native")
    for field, g, w in zip(BEVPoolRanksPadded._fields, got, want):
        assert torch.equal(g, w), f"{name}.{field}"


@pytest.mark.gpu
def test_native_padded_view_transform_captured_in_one_cuda_graph():
    """prepare + bev_pool_v2 in one CUDA graph: replays with new coordinates, depth and feat
    (written into the captured inputs) give what the eager, unpadded path gives for them (to
    float32 rounding: the pooling kernel's partition of the points depends on their number)."""
    from mu_space.ops.bev_pool_v2 import bev_pool_v2
    from mu_space.testing import tolerances

    device = graph_capture_device()
    g = bev_geometry.make("bevdet-r50")
    grid = (g["grid_lower_bound"], g["grid_interval"], g["grid_size"])
    shape = g["bev_feat_shape"]
    coor, depth, feat = (g[k].to(device) for k in ("coor", "depth", "feat"))

    def view_transform():
        r = bev_pool_prepare_padded(coor, *grid, backend="native")
        return bev_pool_v2(depth, feat, *r.bev_pool_v2_args(shape), backend="native")

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        view_transform()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = view_transform()
    gen = torch.Generator(device="cpu").manual_seed(3)
    for step in range(3):
        coor.copy_(g["coor"].to(device) + 2.0 * step * torch.rand(3, generator=gen).to(device))
        depth.copy_(torch.rand(depth.shape, generator=gen).to(device))
        feat.copy_(torch.randn(feat.shape, generator=gen).to(device))
        graph.replay()
        r = bev_pool_prepare(coor, *grid, backend="native")
        want = bev_pool_v2(depth, feat, *r.bev_pool_v2_args(shape), backend="native")
        tolerances.assert_close(out, want, op="bev_pool_v2", name=f"replay {step}")
