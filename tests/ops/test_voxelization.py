"""Hard and dynamic voxelization (mmcv API), the batched and padded forms, mmcv's Voxelization
module, spconv's PointToVoxel adapter and the LiDAR generator they are tested on.

The reference paths are compared with `_voxel_oracle` (mmcv's rules as Python loops, numpy
float32 arithmetic) on clouds of the synthetic LiDAR (real sensor structure: rings, ground,
objects, multi-sweep), exactly: voxelization copies values, so there is no tolerance. The
native (GPU) tests compare the kernels with the reference, also exactly; they skip without a GPU.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

import mu_space
from mu_space.ops import _voxel
from mu_space.ops.voxel_layers import PointToVoxel, Voxelization
from mu_space.testing import lidar
from tests.helpers import graph_capture_device, native_gpu_device, recording_entry_points
from tests.ops import _voxel_model as model
from tests.ops import _voxel_oracle as oracle

vox = sys.modules["mu_space.ops.voxelization"]


def _tiny(config="tiny-voxels"):
    vs, pcr, P, V = lidar.layer_args(config)
    return lidar.VOXEL_CONFIGS[config].points(), vs, pcr, P, V


def _equal(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape, g.dtype, w.dtype)
        assert torch.equal(g.cpu(), w.cpu()), f"output {i} differs"


# ---------------------------------------------------------------- the generator


def test_generator_is_clustered_like_a_real_sweep():
    pts = lidar.make("nus-1sweep")
    assert 30_000 < pts.shape[0] < 38_000 and pts.shape[1] == 5  # ~34k points a sweep
    r = pts[:, :2].norm(dim=1)
    assert (r < 10).float().mean() > 0.4  # most points near the sensor
    ground = (pts[:, 2] < -1.6).float().mean()
    assert ground > 0.5  # and on the ground
    assert torch.equal(pts, lidar.make("nus-1sweep"))  # deterministic (cached)
    assert not torch.equal(lidar.make("nus-1sweep", seed=1), pts)


def test_generator_sweeps_and_64_beam_frames():
    multi = lidar.make("tiny-3sweeps")
    lags = multi[:, 4].unique()
    assert lags.tolist() == pytest.approx([0.0, 0.05, 0.1])
    assert float(multi[0, 4]) == 0.0  # the current sweep first
    kitti = lidar.make("kitti")
    assert 110_000 < kitti.shape[0] < 130_000 and kitti.shape[1] == 4  # one 64-beam frame
    small = lidar.make(lidar.sweep_config(10_000))
    assert 7_000 < small.shape[0] < 13_000


@pytest.mark.gpu
def test_generator_benchmark_configs_have_the_issue_sizes():
    """(Generating ~0.9 M points takes seconds: left to the GPU session's full suite.)"""
    native_gpu_device()
    nus = lidar.make("nus-10sweeps")
    assert 250_000 < nus.shape[0] < 350_000 and nus[:, 4].unique().numel() == 10
    assert 160_000 < lidar.make("waymo").shape[0] < 200_000


def test_generator_clouds_occupy_few_voxels_unevenly():
    pts = lidar.make("nus-1sweep")
    vs, pcr, _, _ = lidar.layer_args("centerpoint-0075-nus")
    grid = _voxel.voxel_grid(vs, pcr)
    cells = _voxel.linear_cells(pts, grid)
    _, counts = torch.unique(cells[cells >= 0], return_counts=True)
    assert counts.numel() < 0.001 * grid.n_cells  # sparse occupancy
    assert counts.max() >= 5 * counts.float().mean()  # clustered, not uniform noise


# ---------------------------------------------------------------- grid and coordinates


def test_grid_is_mmcv_float32_round_half_away():
    assert _voxel.grid_size([0.16, 0.16, 4], [0, -39.68, -3, 69.12, 39.68, 1]) == (432, 496, 1)
    assert _voxel.grid_size([0.075, 0.075, 0.2], [-54, -54, -5, 54, 54, 3]) == (1440, 1440, 40)
    # 0.5 cells: C round gives 1 where torch.round (half to even) gives 0
    assert _voxel.grid_size([1.0, 1.0, 2.0], [0, 0, 0, 1.5, 2.5, 1.0]) == (2, 3, 1)
    for vs, r in (
        ([0.16, 0.16, 4], [0, -39.68, -3, 69.12, 39.68, 1]),
        ([0.3, 0.7, 0.1], [-1, -2, -3, 4.45, 5.05, 0.15]),
    ):
        assert _voxel.grid_size(vs, r) == oracle.mmcv_grid(vs, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_dynamic_reference_matches_mmcv_rows(dtype):
    pts, vs, pcr, _, _ = _tiny()
    pts = pts.to(dtype)
    got = mu_space.dynamic_voxelize(pts, vs, pcr)
    assert got.dtype == torch.int32 and got.shape == (pts.shape[0], 3)
    assert torch.equal(got, oracle.mmcv_dynamic(pts, vs, pcr))
    assert (got[:, 0] == -1).sum() > 100  # the cloud reaches beyond the range
    assert torch.equal(mu_space.voxelization(pts, vs, pcr, -1, 20000), got)  # mmcv's -1 switch
    assert torch.equal(mu_space.voxelization(pts, vs, pcr, 5, -1), got)


def test_dynamic_rows_of_dropped_points_follow_mmcv_pattern():
    vs, pcr = [1.0, 1.0, 1.0], [0, 0, 0, 4, 4, 4]
    p = torch.tensor(
        [[0.5, 0.5, 0.5], [-0.5, 1.0, 1.0], [1.0, 9.0, 1.0], [1.0, 1.0, 4.0], [3.99, 3.99, 3.99],
         [float("nan"), 1, 1], [1, float("inf"), 1], [1, 1, -float("inf")], [4.0, 1, 1]]
    )  # fmt: skip
    want = [[0, 0, 0], [-1, 0, 0], [-1, -1, 0], [-1, -1, -1], [3, 3, 3], [-1, 0, 0],
            [-1, -1, 0], [-1, -1, -1], [-1, 0, 0]]  # fmt: skip
    assert mu_space.dynamic_voxelize(p, vs, pcr).tolist() == want


def test_coordinate_is_computed_in_float32_like_mmcv():
    # 0.3 / 0.1 is 2.9999998 in float32 arithmetic on these operands, 3.0000000000000004 in
    # float64: mmcv (and muSPACE) put the point in cell 2
    vs, pcr = [0.1, 1.0, 1.0], [0.0, 0, 0, 1, 1, 1]
    q = (torch.tensor(0.3, dtype=torch.float32) - 0.0) / torch.tensor(0.1, dtype=torch.float32)
    p = torch.tensor([[0.3, 0.5, 0.5]])
    want = oracle.mmcv_dynamic(p, vs, pcr)
    assert mu_space.dynamic_voxelize(p, vs, pcr).tolist() == want.tolist()
    assert want[0, 2] == math.floor(float(q))


# ---------------------------------------------------------------- hard voxelization


@pytest.mark.parametrize(
    "config,P,V",
    [
        ("tiny-voxels", 5, 1500),
        ("tiny-voxels", 2, 200),
        ("tiny-pillars", 8, 400),
        ("tiny-pillars", 1, 50),
    ],
)
def test_hard_reference_equals_mmcv_deterministic(config, P, V):
    pts, vs, pcr, _, _ = _tiny(config)
    got = mu_space.voxelization(pts, vs, pcr, P, V)
    want = oracle.mmcv_hard(pts, vs, pcr, P, V)
    _equal(got, want)
    voxels, coors, num = got
    assert coors.shape[0] <= V and (num >= 1).all() and (num <= P).all()
    assert (num == P).any()  # some voxels are full: points were dropped by max_points


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_hard_reference_other_dtypes(dtype):
    pts, vs, pcr, P, V = _tiny()
    pts = pts.to(dtype)
    got = mu_space.voxelization(pts, vs, pcr, P, V)
    _equal(got, oracle.mmcv_hard(pts, vs, pcr, P, V))
    assert got[0].dtype == dtype


def test_hard_voxelization_of_a_multi_sweep_frame_is_consistent():
    """The vectorised reference at the size of a real frame (~33k points, 1 nuScenes sweep):
    every voxel's points are the first points of its cell, in input order."""
    pts = lidar.make("nus-1sweep")
    vs, pcr, P, V = lidar.layer_args("centerpoint-0075-nus")
    voxels, coors, num = mu_space.voxelization(pts, vs, pcr, P, 8000)
    assert voxels.shape == (8000, P, 5)  # more occupied voxels than max_voxels
    rows = oracle.mmcv_dynamic(pts[:50000], vs, pcr)
    key = {tuple(r): i for i, r in enumerate(coors.tolist())}
    seen = [0] * coors.shape[0]
    first_seen = []
    for i, r in enumerate(rows.tolist()):
        v = key.get(tuple(r))
        if r[0] < 0:
            continue
        if v is None:
            continue
        if seen[v] == 0:
            first_seen.append(v)
        if seen[v] < num[v]:
            assert torch.equal(voxels[v, seen[v]], pts[i])
        seen[v] += 1
    assert first_seen == sorted(first_seen)  # voxels in first-occurrence order
    assert all(min(s, P) == int(n) for s, n in zip(seen, num))


def test_deterministic_flag_changes_nothing():
    pts, vs, pcr, P, V = _tiny()
    _equal(
        mu_space.voxelization(pts, vs, pcr, P, V, False), mu_space.voxelization(pts, vs, pcr, P, V)
    )


@pytest.mark.parametrize("P,V", [(0, 100), (5, 0)])
def test_zero_limits_give_empty_results(P, V):
    pts, vs, pcr, _, _ = _tiny()
    voxels, coors, num = mu_space.voxelization(pts, vs, pcr, P, V)
    assert voxels.shape == (0, P, pts.shape[1]) and coors.shape == (0, 3) and num.shape == (0,)


def test_safety_empty_out_of_range_and_non_finite_points():
    pts, vs, pcr, P, V = _tiny()
    voxels, coors, num = mu_space.voxelization(pts[:0], vs, pcr, P, V)
    assert voxels.shape == (0, P, 5) and coors.dtype == torch.int32
    far = pts.clone()
    far[:, 0] += 1000.0
    assert mu_space.voxelization(far, vs, pcr, P, V)[0].shape[0] == 0
    bad = pts.clone()
    bad[::3, 0] = float("nan")
    bad[1::3, 1] = float("inf")
    bad[2::7, 2] = -float("inf")
    got = mu_space.voxelization(bad, vs, pcr, P, V)
    _equal(got, oracle.mmcv_hard(bad, vs, pcr, P, V))
    assert torch.isfinite(got[0]).all()  # no NaN point reached a voxel


def test_points_on_the_grid_boundaries():
    vs, pcr = [0.5, 0.5, 1.0], [-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    p = torch.tensor([[-1.0, -1.0, -1.0, 1], [1.0, 0, 0, 2], [0.9999999, 0.9999999, 0.9999999, 3],
                      [-1.0000001, 0, 0, 4], [0, 0, 0, 5], [-0.5, -0.5, 0, 6]])  # fmt: skip
    voxels, coors, num = mu_space.voxelization(p, vs, pcr, 4, 10)
    assert coors.tolist() == [[0, 0, 0], [1, 3, 3], [1, 2, 2], [1, 1, 1]]
    assert voxels[:, 0, 3].tolist() == [1, 3, 5, 6]


def test_argument_errors_name_the_argument():
    pts, vs, pcr, P, V = _tiny()
    cases = [
        (TypeError, "points must be a torch.Tensor", (pts.tolist(), vs, pcr, P, V)),
        (
            TypeError,
            "points must be float32, float16, bfloat16 or float64, got int32",
            (pts.int(), vs, pcr, P, V),
        ),
        (ValueError, r"points must be \[N, C\] with C >= 3", (pts[:, :2], vs, pcr, P, V)),
        (ValueError, "voxel_size must have 3 values", (pts, vs[:2], pcr, P, V)),
        (ValueError, "voxel_size must be 3 positive finite", (pts, [0.5, 0, 0.5], pcr, P, V)),
        (ValueError, "voxel_size must be 3 positive finite", (pts, [0.5, -1, 0.5], pcr, P, V)),
        (ValueError, "voxel_size must be 3 positive finite", (pts, [0.5, 1e-50, 0.5], pcr, P, V)),
        (TypeError, "voxel_size must be 3 numbers", (pts, "abc", pcr, P, V)),
        (ValueError, "coors_range must have 6 values", (pts, vs, pcr[:5], P, V)),
        (
            ValueError,
            "coors_range: y_max .* must be greater than y_min",
            (pts, vs, [0, 5, 0, 1, 5, 1], P, V),
        ),
        (ValueError, "coors_range must be finite", (pts, vs, [0, 0, 0, 1, float("inf"), 1], P, V)),
        (ValueError, "less than half a voxel", (pts, [1.0, 1, 1], [0, 0, 0, 0.2, 1, 1], P, V)),
        (ValueError, "max_points must be in", (pts, vs, pcr, -2, V)),
        (ValueError, "max_voxels must be in", (pts, vs, pcr, P, -5)),
        (TypeError, "max_points must be an integer", (pts, vs, pcr, 2.5, V)),
        (ValueError, "max_voxels must be in", (pts, vs, pcr, P, 2**40)),
    ]
    for exc, pattern, args in cases:
        with pytest.raises(exc, match=pattern):
            mu_space.voxelization(*args)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        mu_space.voxelization(pts, vs, pcr, P, V, None)
    with pytest.raises(ValueError, match="exceed the int32 range"):
        mu_space.voxelization(pts, [1e-8, 1, 1], [0, 0, 0, 100, 1, 1], P, V)


# ---------------------------------------------------------------- batched and padded forms


def test_batch_equals_the_det3d_data_preprocessor_loop():
    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    clouds = lidar.batch("tiny-3sweeps", 3)
    voxels, coors, num = mu_space.voxelization_batch(clouds, vs, pcr, P, 700)
    parts = [mu_space.voxelization(c, vs, pcr, P, 700) for c in clouds]
    want_coors = torch.cat(
        [torch.nn.functional.pad(p[1], (1, 0), value=i) for i, p in enumerate(parts)]
    )
    _equal(
        (voxels, coors, num),
        (torch.cat([p[0] for p in parts]), want_coors, torch.cat([p[2] for p in parts])),
    )
    assert all(p[0].shape[0] == 700 for p in parts)  # every sample capped separately
    # the tensor + sample_sizes form, with an empty sample in the middle
    pts = torch.cat([clouds[0], clouds[1]])
    got = mu_space.voxelization_batch(
        pts, vs, pcr, P, 700, sample_sizes=[clouds[0].shape[0], 0, clouds[1].shape[0]]
    )
    assert got[1][:, 0].unique().tolist() == [0, 2]
    dyn = mu_space.voxelization_batch(clouds, vs, pcr, -1, 700)
    assert torch.equal(dyn, mu_space.dynamic_voxelize_batch(clouds, vs, pcr))
    want = torch.cat(
        [
            torch.nn.functional.pad(mu_space.dynamic_voxelize(c, vs, pcr), (1, 0), value=i)
            for i, c in enumerate(clouds)
        ]
    )
    assert torch.equal(dyn, want)


def test_batch_argument_errors():
    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    clouds = lidar.batch("tiny-3sweeps", 2)
    with pytest.raises(ValueError, match=r"points\[1\] must have the features and dtype"):
        mu_space.voxelization_batch([clouds[0], clouds[1][:, :4]], vs, pcr, P, V)
    with pytest.raises(TypeError, match="points must be a list"):
        mu_space.voxelization_batch(clouds[0], vs, pcr, P, V)
    with pytest.raises(ValueError, match="sample_sizes must sum to the .* points"):
        mu_space.voxelization_batch(clouds[0], vs, pcr, P, V, sample_sizes=[5, 6])


def test_padded_form_is_voxelization_plus_padding():
    pts, vs, pcr, P, V = _tiny()
    voxels, coors, num, count = mu_space.voxelization_padded(pts, vs, pcr, P, 4000)
    m = int(count)
    assert count.dtype == torch.int64 and count.dim() == 0
    _equal((voxels[:m], coors[:m], num[:m]), mu_space.voxelization(pts, vs, pcr, P, 4000))
    assert voxels.shape == (4000, P, 5) and not voxels[m:].any()
    assert (coors[m:] == -1).all() and not num[m:].any()


# ---------------------------------------------------------------- modules and adapters


def test_voxelization_module_is_mmcvs():
    vs, pcr, P, _ = lidar.layer_args("tiny-pillars")
    layer = Voxelization(vs, pcr, P, (300, 500))
    assert layer.grid_size.tolist() == list(_voxel.grid_size(vs, pcr))
    assert layer.pcd_shape[0] == 1 and int(layer.pcd_shape[1]) == layer.grid_size[1]
    pts = lidar.make("tiny")
    layer.train()
    assert layer(pts)[0].shape[0] <= 300
    layer.eval()
    _equal(layer(pts), mu_space.voxelization(pts, vs, pcr, P, 500))
    assert "max_voxels=(300, 500)" in repr(layer)


def test_point_to_voxel_follows_spconv():
    pts, vs, pcr, P, V = _tiny()
    gen = PointToVoxel(
        vs, pcr, num_point_features=5, max_num_voxels=600, max_num_points_per_voxel=P
    )
    assert gen.grid_size == list(reversed(_voxel.grid_size(vs, pcr)))  # (z, y, x) like spconv
    voxels, indices, num, ids = gen.generate_voxel_with_id(pts)
    _equal((voxels, indices, num), mu_space.voxelization(pts, vs, pcr, P, 600))
    rows = oracle.mmcv_dynamic(pts, vs, pcr)
    where = {tuple(r): i for i, r in enumerate(indices.tolist())}
    want_ids = [where.get(tuple(r), -1) if r[0] >= 0 else -1 for r in rows.tolist()]
    assert ids.dtype == torch.int64 and ids.tolist() == want_ids
    mean_filled = gen(pts, empty_mean=True)[0]
    for v in range(0, voxels.shape[0], 37):
        k = int(num[v])
        if k < P:
            assert torch.allclose(mean_filled[v, k:], voxels[v, :k].mean(0).expand(P - k, -1))
    with pytest.raises(ValueError, match="pc must have num_point_features = 5"):
        gen(pts[:, :4])


# ---------------------------------------------------------------- the kernels' algorithm


def _check_padded_model(single, cloud, vs, pcr, P, V):
    """A model's padded-mode outputs: the first m rows are voxelization's, the rest padding."""
    m = int(single[3])
    _equal([t[:m] for t in single[:3]], mu_space.voxelization(cloud, vs, pcr, P, V))
    assert (single[1][m:] == -1).all() and not single[0][m:].any() and not single[2][m:].any()


def _model_inputs(config, P, V):
    """Two clouds of `config` batched: (vs, pcr, clouds, points, sizes, grid, the reference's
    batched hard voxelization)."""
    vs, pcr, _, _ = lidar.layer_args(config)
    clouds = lidar.batch(lidar.VOXEL_CONFIGS[config].cloud, 2)
    pts = torch.cat(clouds)
    sizes = [c.shape[0] for c in clouds]
    grid = _voxel.voxel_grid(vs, pcr)
    return vs, pcr, clouds, pts, sizes, grid, _voxel.hard_voxelize_reference(pts, grid, P, V, sizes)


@pytest.mark.parametrize("config,P,V", [("tiny-voxels", 5, 1500), ("tiny-pillars", 3, 150)])
def test_kernel_model_hard(config, P, V):
    """_voxel_model mirrors the native pipeline (keys, the stable sort, runs, first-point scan,
    per-sample counts, rows, emit)."""
    vs, pcr, clouds, pts, sizes, grid, want = _model_inputs(config, P, V)
    got = model.hard_voxelize(pts, grid, P, V, sizes)
    _equal(got[:3], want[:3])
    single = model.hard_voxelize(clouds[0], grid, P, V, None, padded_rows=V + 7)
    _check_padded_model(single, clouds[0], vs, pcr, P, V)


@pytest.mark.parametrize("config,P,V", [("tiny-voxels", 5, 1500), ("tiny-pillars", 40, 150)])
@pytest.mark.parametrize("warp", [32, 128])
def test_kernel_model_hashed(config, P, V, warp):
    """_voxel_model mirrors the hashed pipeline (slot table, first points, stretches, the warp
    selection): with the atomics run in three random orders, the direct and the open-addressing
    table, 32- and 128-lane warps (MUSA mp_21 / mp_22), its outputs are the reference's; and the
    padded mode's padding rows."""
    vs, pcr, clouds, pts, sizes, grid, want = _model_inputs(config, P, V)
    for seed, force_hash in ((0, False), (1, True), (2, True)):
        got = model.hard_voxelize_hashed(
            pts, grid, P, V, sizes, warp=warp, seed=seed, force_hash=force_hash
        )
        _equal(got[:3], want[:3])
    single = model.hard_voxelize_hashed(clouds[0], grid, P, V, None, padded_rows=V + 7, warp=warp)
    _check_padded_model(single, clouds[0], vs, pcr, P, V)


def test_kernel_model_hashed_crowded_voxels():
    """Voxels of more points than a warp and than max_points (several chunks, several
    selection rounds, P not a multiple of the warp)."""
    pts, vs, pcr, _, V = _tiny()
    crowded = pts[:40].repeat(90, 1)  # 40 voxels or fewer, ~90 points each
    grid = _voxel.voxel_grid(vs, pcr)
    for P in (1, 31, 32, 33, 70, 100):
        want = _voxel.hard_voxelize_reference(crowded, grid, P, V, None)
        _equal(model.hard_voxelize_hashed(crowded, grid, P, V, None, seed=P)[:3], want[:3])


@pytest.mark.parametrize("warp", [32, 128])
def test_kernel_model_warp_selection(warp):
    """warp_smallest_after's network: lane t holds the t-th smallest entry above `after`, for
    stretches shorter than, equal to and longer than a warp, INT_MAX past the end."""
    rng = np.random.default_rng(warp)
    for cnt in (1, 2, warp - 1, warp, warp + 1, 3 * warp + 5, 500):
        stretch = rng.choice(10**6, size=cnt, replace=False)
        for after in (-1, int(np.sort(stretch)[cnt // 2])):
            want = np.sort(stretch[stretch > after])[:warp]
            got = model.warp_smallest_after(stretch, after, warp)
            assert (got[: want.size] == want).all() and (got[want.size :] == model.INT_MAX).all()


@pytest.mark.parametrize("cols", [1, 3, 5, 10, 32, 64, 999])
def test_kernel_model_rowcol_walk_is_divmod(cols):
    """RowCol (the emit and segment kernels' division-free (row, col)) visits every flat index
    of a grid-stride loop with e's own divmod, for strides below, at and above cols."""
    for threads in (1, 7, cols, 256, 1056 * 256 % 4099 + 1):
        total = 3 * max(threads, cols) + 5
        want = np.stack(np.divmod(np.arange(total), cols), axis=1)
        assert (model.rowcol_walk(total, cols, threads) == want).all()


@pytest.mark.parametrize("cols", [2**31 - 1, 2**31 - 2, 46341 * 46340, 2**30 + 1])
def test_kernel_model_rowcol_walk_near_int32_max(cols):
    """RowCol with cols above 2**30 (segment kernels: cols = C, the rows m * C may exceed 2**31)
    and an H200's grid-stride (132 SMs x 8 blocks x 256 threads): col + dcol exceeds INT32_MAX
    when a thread crosses a row end, so it must not be summed in int32 (it wrapped negative: a
    column < 0, reads and stores out of bounds). Each thread's walk over 2 rows against e's
    divmod. (The pillar canvas cannot get there: cells <= INT32_MAX ends its loop at that row
    end.)"""
    threads = 132 * 8 * 256
    total = 2 * cols
    for t in (0, 1, threads // 2, threads - 1):
        walk = model.rowcol_thread(t, threads, cols)
        for e, (row, col) in zip(range(t, total, threads), walk):
            assert (row, col) == divmod(e, cols), (t, e)


# ---------------------------------------------------------------- native (GPU)


def _gpu_cases():
    return [
        ("pointpillars-kitti", None),
        ("pointpillars-nus", None),
        ("centerpoint-0075-nus", None),
        ("centerpoint-waymo", None),
        ("centerpoint-0075-nus", 20000),
        ("tiny-voxels", 37),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("config,V", _gpu_cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_hard_equals_reference(config, V, dtype):
    device = native_gpu_device()
    vs, pcr, P, V0 = lidar.layer_args(config)
    pts = lidar.VOXEL_CONFIGS[config].points().to(dtype)
    V = V or V0
    want = mu_space.voxelization(pts, vs, pcr, P, V, backend="reference")
    got = mu_space.voxelization(pts.to(device), vs, pcr, P, V, backend="native")
    _equal(got, want)
    again = mu_space.voxelization(pts.to(device), vs, pcr, P, V, False, backend="native")
    _equal(again, got)  # deterministic=False: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("config,V", _gpu_cases())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_hashed_grouping_equals_the_sort_grouping(config, V, dtype, monkeypatch):
    """The two native groupings give the same bits (single cloud, batch, padded), and the
    default one is the hashed kernel."""
    device = native_gpu_device()
    vs, pcr, P, V0 = lidar.layer_args(config)
    V = V or V0
    clouds = [c.to(device, dtype) for c in lidar.batch(lidar.VOXEL_CONFIGS[config].cloud, 2)]
    calls = {
        "single": lambda: mu_space.voxelization(clouds[0], vs, pcr, P, V, backend="native"),
        "batch": lambda: mu_space.voxelization_batch(clouds, vs, pcr, P, V, backend="native"),
        "padded": lambda: mu_space.voxelization_padded(clouds[1], vs, pcr, P, V, backend="native"),
    }
    names = recording_entry_points(monkeypatch)
    hashed = {}
    for k, f in calls.items():
        names.clear()
        hashed[k] = f()
        assert "voxel_hard_forward_hashed" in names and "voxel_hard_keys" not in names, k
    monkeypatch.setattr(_voxel, "GROUPING", "sort")
    for k, f in calls.items():
        names.clear()
        _equal(hashed[k], f())
        assert "voxel_hard_keys" in names and "voxel_hard_forward_hashed" not in names, k


@pytest.mark.gpu
def test_native_hashed_crowded_voxels_and_large_max_points(monkeypatch):
    """Voxels of many more points than a warp, max_points below / at / above a warp and at the
    hashed kernels' limit, then one above it (the sort grouping)."""
    device = native_gpu_device()
    pts, vs, pcr, _, V = _tiny()
    crowded = pts[:60].repeat(300, 1)  # <= 60 voxels of ~300 points each
    from mu_space.runtime import native

    limit = native.limit("voxelization.hashed_max_points_per_voxel")
    names = recording_entry_points(monkeypatch)
    for P in (1, 31, 32, 33, 100, limit, limit + 1):
        names.clear()
        _equal(
            mu_space.voxelization(crowded.to(device), vs, pcr, P, V, backend="native"),
            mu_space.voxelization(crowded, vs, pcr, P, V, backend="reference"),
        )
        assert ("voxel_hard_forward_hashed" in names) == (P <= limit), P
        assert ("voxel_hard_keys" in names) == (P > limit), P


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["pointpillars-kitti", "centerpoint-0075-nus", "tiny-voxels"])
def test_native_dynamic_batch_and_padded_equal_reference(config):
    device = native_gpu_device()
    vs, pcr, P, V = lidar.layer_args(config)
    clouds = lidar.batch(lidar.VOXEL_CONFIGS[config].cloud, 3)
    gpu = [c.to(device) for c in clouds]
    assert torch.equal(
        mu_space.dynamic_voxelize(gpu[0], vs, pcr, backend="native").cpu(),
        mu_space.dynamic_voxelize(clouds[0], vs, pcr, backend="reference"),
    )
    _equal(
        mu_space.voxelization_batch(gpu, vs, pcr, P, V, backend="native"),
        mu_space.voxelization_batch(clouds, vs, pcr, P, V, backend="reference"),
    )
    assert torch.equal(
        mu_space.dynamic_voxelize_batch(gpu, vs, pcr, backend="native").cpu(),
        mu_space.dynamic_voxelize_batch(clouds, vs, pcr, backend="reference"),
    )
    _equal(
        mu_space.voxelization_padded(gpu[1], vs, pcr, P, V, backend="native"),
        mu_space.voxelization_padded(clouds[1], vs, pcr, P, V, backend="reference"),
    )


@pytest.mark.gpu
def test_native_safety_cases():
    device = native_gpu_device()
    pts, vs, pcr, P, V = _tiny()
    bad = pts.clone()
    bad[::3, 0] = float("nan")
    bad[1::3, 1] = float("inf")
    for case in (bad, pts[:1], pts + 1000.0, pts.repeat(30, 1)):  # repeat: long runs
        _equal(
            mu_space.voxelization(case.to(device), vs, pcr, P, V, backend="native"),
            mu_space.voxelization(case, vs, pcr, P, V, backend="reference"),
        )
    one_voxel = torch.zeros(70000, 5)  # every point in one voxel
    _equal(
        mu_space.voxelization(one_voxel.to(device), vs, pcr, 64, V, backend="native"),
        mu_space.voxelization(one_voxel, vs, pcr, 64, V, backend="reference"),
    )


@pytest.mark.gpu
def test_native_padded_is_cuda_graph_capturable():
    device = graph_capture_device()
    vs, pcr, P, V = lidar.layer_args("pointpillars-kitti")
    pts = lidar.VOXEL_CONFIGS["pointpillars-kitti"].points().to(device)
    static = pts.clone()
    mu_space.voxelization_padded(static, vs, pcr, P, V, backend="cuda")  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mu_space.voxelization_padded(static, vs, pcr, P, V, backend="cuda")
    other = lidar.make("kitti", seed=3).to(device)
    static.copy_(other[: static.shape[0]] if other.shape[0] >= static.shape[0] else static)
    graph.replay()
    torch.cuda.synchronize()
    _equal(out, mu_space.voxelization_padded(static.cpu(), vs, pcr, P, V, backend="reference"))


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmarks/bench_voxelization.py end to end on tiny inputs (CPU: reference path)."""
    from benchmarks import bench_voxelization

    args = [
        "--smoke",
        "--quick",
        "--out",
        str(tmp_path),
        "--cases",
        "centerpoint-0075-nus-(hard-det|dynamic)-float32",
    ]
    assert bench_voxelization.main(args) == 0, capsys.readouterr().out
    assert (tmp_path / "voxelization.smoke.json").is_file()


def test_nondeterministic_peer_check_is_order_free_but_not_blind():
    """benchmarks/_voxel_peer.same_voxel_sets, the check of mmcv's non-deterministic output:
    voxels and the points inside them in another order pass, and so do other kept points of a
    voxel with more than max_points points (mmcv keeps an arbitrary max_points of them); a
    changed point of a voxel that is not full, or a wrong count, fails."""
    from benchmarks import _voxel_peer

    vs, pcr, P, _ = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps")
    V = 10**6  # no voxel cut by max_voxels: the check compares the contents
    ref = mu_space.voxelization(pts, vs, pcr, P, V, backend="reference")
    voxels, coors, num = (t.clone() for t in ref)
    check = _voxel_peer.same_voxel_sets(V)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(coors.shape[0], generator=g)
    shuffled = [voxels[perm], coors[perm], num[perm]]
    for r in range(shuffled[0].shape[0]):  # the points inside each voxel reversed
        k = int(shuffled[2][r])
        shuffled[0][r, :k] = shuffled[0][r, :k].flip(0)
    full = torch.nonzero(shuffled[2] == P).flatten()
    assert full.numel() and (shuffled[2] < P).any(), "the frame must have full and partial voxels"
    shuffled[0][full[0], 0] += 1.0  # another point kept in a full voxel
    check(shuffled, ref)
    partial = int(torch.nonzero(shuffled[2] < P)[0])
    wrong = [t.clone() for t in shuffled]
    wrong[0][partial, 0] += 1.0
    with pytest.raises(AssertionError, match="contents"):
        check(wrong, ref)
    wrong = [t.clone() for t in shuffled]
    wrong[2][partial] += 1
    with pytest.raises(AssertionError, match="counts"):
        check(wrong, ref)


def test_voxel_grid_parse_cache_is_the_full_parse():
    """voxel_grid caches the parse of plain Python numbers (the same numbers every call of a
    model): the cached grid equals the uncached parse of the same values as tensors; bools,
    bad values and tensors still go through the full checks on every call."""
    vs, pcr, _, _ = lidar.layer_args("centerpoint-0075-nus")
    assert _voxel._plain_key(vs, pcr) is not None
    assert _voxel.voxel_grid(vs, pcr) == _voxel.voxel_grid(torch.tensor(vs), torch.tensor(pcr))
    assert _voxel._plain_key(torch.tensor(vs), pcr) is None
    assert _voxel._plain_key([0.1, True, 0.2], pcr) is None
    for _ in range(2):  # an error is raised every time, never cached as a result
        with pytest.raises(ValueError, match="voxel_size must be 3 positive"):
            _voxel.voxel_grid([0.1, 0.0, 0.2], pcr)
        with pytest.raises(TypeError, match="voxel_size must be 3 numbers"):
            _voxel.voxel_grid([0.1, True, 0.2], pcr)
