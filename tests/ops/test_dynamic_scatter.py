"""dynamic_scatter (mmcv API) and its parts voxel_group / segment_reduce, mmcv's DynamicScatter
module. References against `_voxel_oracle.mmcv_scatter` (mmcv's rules as loops) on dynamic
voxelization rows of generated LiDAR clouds; gradients against the loop backward and float64
gradcheck; native (GPU) tests compare the kernels with the reference.

Tolerances: max and the voxel order / coordinates are exact. Sums and means: the reference
accumulates in float32 in input order, the loop in float64: up to ~1e-6 relative on sums of
O(10) values of O(50) (metres): 1e-5 abs + 1e-5 rel covers it.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import mu_space
from mu_space.ops import _opdef, _voxel
from mu_space.ops.dynamic_scatter import (
    dynamic_scatter_backward_from_map,
    dynamic_scatter_with_map,
    groups_consistent,
    segment_reduce,
    voxel_group,
)
from mu_space.ops.voxel_layers import DynamicScatter
from mu_space.testing import lidar
from tests.helpers import assert_close, native_gpu_device, recording_entry_points
from tests.ops import _voxel_model as model
from tests.ops import _voxel_oracle as oracle

ds = sys.modules["mu_space.ops.dynamic_scatter"]
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(config="tiny-voxels", clouds=1, with_batch=False, channels=None, seed=0):
    pts, coors = ds._dynamic_coors("cpu", config, clouds, with_batch=with_batch)
    if channels:
        g = torch.Generator().manual_seed(seed)
        pts = torch.randn(pts.shape[0], channels, generator=g)
    return pts, coors


@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("with_batch", [False, True])
def test_reference_matches_mmcv(reduce, with_batch):
    feats, coors = _inputs(clouds=2 if with_batch else 1, with_batch=with_batch)
    got, got_coors = mu_space.dynamic_scatter(feats, coors, reduce)
    want, want_coors, _ = oracle.mmcv_scatter(feats, coors, reduce)
    assert torch.equal(got_coors, want_coors) and got_coors.dtype == coors.dtype
    assert got.dtype == feats.dtype
    if reduce == "max":
        assert torch.equal(got.double(), want)
    else:
        assert_close(got.double(), want, **TOL)
    assert got.shape[0] > 500  # a real workload: many voxels


def test_order_is_sorted_coordinates_and_rows_with_a_negative_entry_drop():
    coors = torch.tensor(
        [[2, 0, 1], [0, 5, 5], [-1, 0, 0], [0, 5, 5], [0, -1, 3], [1, 9, 0], [2, 0, 1]]
    )
    feats = torch.arange(7.0)[:, None].repeat(1, 2)
    out, vc = mu_space.dynamic_scatter(feats, coors, "sum")
    assert vc.tolist() == [[0, 5, 5], [1, 9, 0], [2, 0, 1]]
    assert out[:, 0].tolist() == [1 + 3, 5, 0 + 6]
    g = voxel_group(coors)
    assert g.point2voxel.tolist() == [2, 0, -1, 0, -1, 1, 2]
    assert g.order.tolist() == [1, 3, 5, 0, 6] and g.starts.tolist() == [0, 2, 3]
    assert g.counts.tolist() == [2, 1, 2]
    assert groups_consistent(g.order, g.starts, g.counts, g.point2voxel) is None


def test_max_ignores_nan_and_inf_is_a_value():
    coors = torch.tensor([[0, 0, 0]] * 4 + [[1, 0, 0]] * 2)
    feats = torch.tensor(
        [[float("nan"), 1.0], [2.0, float("-inf")], [float("nan"), 5.0], [1.0, 5.0],
         [float("nan"), float("-inf")], [float("nan"), float("-inf")]]
    )  # fmt: skip
    out, _ = mu_space.dynamic_scatter(feats, coors, "max")
    assert out.tolist() == [[2.0, 5.0], [float("-inf"), float("-inf")]]
    f = feats.clone().requires_grad_(True)
    out, _ = mu_space.dynamic_scatter(f, coors, "max")
    out.backward(torch.tensor([[10.0, 20.0], [30.0, 40.0]]))
    # channel 1 of voxel 0: rows 2 and 3 hold 5, the first (row 2) gets the gradient; voxel 1's
    # channel 0 has no number (no gradient), channel 1 is -inf at rows 4 and 5 (row 4 gets it)
    assert f.grad.tolist() == [[0, 0], [10, 0], [0, 20], [0, 0], [0, 40], [0, 0]]


@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
def test_gradients_match_mmcv_backward(reduce):
    feats, coors = _inputs(channels=4)
    feats = feats.round(decimals=1)  # ties in max
    f = feats.clone().requires_grad_(True)
    out, _ = mu_space.dynamic_scatter(f, coors, reduce)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(g)
    want_out, _, members = oracle.mmcv_scatter(feats, coors, reduce)
    want = oracle.mmcv_scatter_grad(feats, reduce, want_out, members, g)
    assert_close(f.grad.double(), want, **TOL, name="grad_feats")
    # the ext backward rule (from the saved forward results) gives the same
    _, _, p2v, counts = dynamic_scatter_with_map(feats, coors, reduce)
    ext = dynamic_scatter_backward_from_map(g, feats, out.detach(), p2v, counts, reduce)
    assert_close(ext.double(), want, **TOL, name="ext backward")


@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
def test_gradcheck_float64(reduce):
    coors = torch.tensor(
        [[0, 1, 1], [0, 1, 1], [2, 0, 1], [-1, 0, 0], [0, 1, 1], [2, 0, 1], [3, 3, 3]]
    )
    feats = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    f = feats.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: mu_space.dynamic_scatter(x, coors, reduce)[0], (f,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_float32(dtype):
    feats, coors = _inputs(channels=8)
    got, _ = mu_space.dynamic_scatter(feats.to(dtype), coors, "mean")
    want, _, _ = oracle.mmcv_scatter(feats.to(dtype).double(), coors, "mean")
    tol = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}[dtype]
    assert got.dtype == dtype
    assert_close(got.double(), want, atol=tol[0], rtol=tol[1])


def test_empty_and_all_dropped():
    feats, coors = _inputs()
    out, vc = mu_space.dynamic_scatter(feats[:0], coors[:0], "max")
    assert out.shape == (0, feats.shape[1]) and vc.shape == (0, 3)
    out, vc = mu_space.dynamic_scatter(feats, torch.full_like(coors, -1), "mean")
    assert out.shape == (0, feats.shape[1]) and vc.shape == (0, 3)


def test_argument_errors_name_the_argument():
    feats, coors = _inputs()
    with pytest.raises(ValueError, match="reduce_type must be one of"):
        mu_space.dynamic_scatter(feats, coors, "min")
    with pytest.raises(TypeError, match="coors must be int32 or int64, got float32"):
        mu_space.dynamic_scatter(feats, coors.float(), "max")
    with pytest.raises(ValueError, match=r"coors.shape\[0\] must be"):
        mu_space.dynamic_scatter(feats, coors[1:], "max")
    with pytest.raises(TypeError, match="feats must be float32, float16, bfloat16 or float64"):
        mu_space.dynamic_scatter(feats.int(), coors, "max")
    with pytest.raises(ValueError, match=r"feats must be 2-D"):
        mu_space.dynamic_scatter(feats[0], coors, "max")


def test_segment_reduce_precondition_names_inconsistent_groupings():
    feats, coors = _inputs()
    g = voxel_group(coors)
    assert groups_consistent(g.order, g.starts, g.counts, g.point2voxel) is None
    bad = g.order.clone()
    bad[[0, 1]] = bad[[1, 0]]
    assert groups_consistent(bad, g.starts, g.counts, g.point2voxel) is not None
    # inconsistent arrays never index out of bounds (unspecified values)
    out = segment_reduce(feats, g.order + 10**6, g.starts, g.counts, g.point2voxel, "sum")
    assert out.shape == (g.starts.shape[0], feats.shape[1])


def test_dynamic_scatter_module_is_mmcvs():
    feats, coors4 = _inputs(clouds=3, with_batch=True)
    layer = DynamicScatter([0.5, 0.5, 0.5], [-16, -16, -3, 16, 16, 2], average_points=True)
    got = layer(feats, coors4)
    # mmcv's loop over the samples
    parts = []
    for b in range(int(coors4[-1, 0]) + 1):
        rows = coors4[:, 0] == b
        out, vc = mu_space.dynamic_scatter(feats[rows], coors4[rows][:, 1:], "mean")
        parts.append((out, torch.nn.functional.pad(vc, (1, 0), value=b)))
    assert torch.equal(got[1], torch.cat([p[1] for p in parts]))
    assert_close(got[0], torch.cat([p[0] for p in parts]), **TOL)
    single = DynamicScatter([0.5, 0.5, 0.5], [-16, -16, -3, 16, 16, 2], average_points=False)
    c3 = coors4[coors4[:, 0] == 0][:, 1:]
    f3 = feats[coors4[:, 0] == 0]
    assert torch.equal(single(f3, c3)[0], mu_space.dynamic_scatter(f3, c3, "max")[0])


# ---------------------------------------------------------------- the kernels' algorithm

INT32_MAX = 2**31 - 1


def _model_group(coors):
    """csrc/voxel/dynamic_scatter_musa.mu's voxel_group, kernel by kernel (voxel_group_keys:
    colmax, keys; the Python layer's stable sort; voxel_group_from_sorted: run flags + scan,
    emit, counts): (voxel_coors, order, starts, counts, point2voxel) cut to the header's M / K,
    and the overflow flag."""
    c, valid, dims, overflow = model.colmax_kernel(coors)
    n, ndim = c.shape
    key_range = 1
    for d in dims:  # group_keys_kernel: prod(dims), stopped once beyond the int32 keys
        key_range = key_range * int(d) if key_range <= INT32_MAX - 1 else key_range
    overflow = overflow or key_range > INT32_MAX - 1
    sentinel = 0 if overflow else key_range
    keys = np.full(n, sentinel, dtype=np.int64)
    if not overflow:
        k = np.zeros(n, dtype=np.int64)
        for col in range(ndim):
            k = k * dims[col] + c[:, col]
        keys = np.where(valid, k, sentinel)
    idx = np.argsort(keys, kind="stable")  # torch.sort(keys, stable=True) between the calls
    skeys = keys[idx]
    start = (skeys != sentinel) & np.concatenate([[True], skeys[1:] != skeys[:-1]])
    run, m = model.exclusive_scan(start.astype(np.int64))  # run_flags_kernel + scan
    K = int(valid.sum())
    # group_emit_kernel
    order = np.full(n, -7, dtype=np.int64)
    starts = np.full(n, -7, dtype=np.int64)
    vcoors = np.full((n, ndim), -7, dtype=np.int64)
    p2v = np.full(n, -7, dtype=np.int64)
    for p in range(n):
        i = idx[p]
        if skeys[p] == sentinel:
            p2v[i] = -1
            continue
        v = run[p] + int(start[p]) - 1
        order[p] = i
        p2v[i] = v
        if start[p]:
            starts[v] = p
            vcoors[v] = c[i]
    # group_counts_kernel
    counts = np.array([(starts[v + 1] if v + 1 < m else K) - starts[v] for v in range(m)])
    out = (vcoors[:m], order[:K], starts[:m], counts.astype(np.int64), p2v)
    return tuple(torch.from_numpy(np.asarray(t)) for t in out), overflow


def _model_reduce(feats, order, starts, counts, reduce):
    """segment_reduce_kernel / segment_grad_max_kernel: per (voxel, channel) a float32 loop over
    the voxel's rows in order (max: NaN never wins, the first row holding the maximum)."""
    x = feats.float().numpy()
    m, C = starts.shape[0], x.shape[1]
    out = np.zeros((m, C), dtype=np.float32)
    arg = np.full((m, C), -1, dtype=np.int64)
    for v in range(m):
        rows = order[int(starts[v]) : int(starts[v]) + int(counts[v])].numpy()
        for ch in range(C):
            acc = np.float32(-np.inf) if reduce == "max" else np.float32(0)
            best, a = np.float32(-np.inf), -1
            for i in rows:
                xi = x[i, ch]
                if reduce == "max":
                    acc = xi if xi > acc else acc
                else:
                    acc = np.float32(acc + xi)
                if xi > best or (a < 0 and xi == best):
                    best, a = xi, i
            if reduce == "mean":
                acc = np.float32(acc / np.float32(max(int(counts[v]), 1)))
            out[v, ch], arg[v, ch] = acc, a
    return torch.from_numpy(out), arg


@pytest.mark.parametrize("with_batch,dtype", [(False, torch.int32), (True, torch.int64)])
def test_kernel_model_group_and_reduce(with_batch, dtype):
    """The numpy model of the voxel_group / segment_reduce kernels equals the references (the
    grouping exactly; sums and means of float32 in input order bit for bit; max and its
    backward's first-row rule exactly, NaN and -inf included)."""
    feats, coors = _inputs(clouds=2 if with_batch else 1, with_batch=with_batch)
    coors = coors.to(dtype)
    feats = feats.clone()
    feats[::17, 3] = float("nan")
    feats[5::23, 4] = -float("inf")
    got, overflow = _model_group(coors)
    want = voxel_group(coors, backend="reference")
    assert not overflow
    for a, b in zip(got, want):
        assert torch.equal(a, b.to(torch.int64))
    for reduce in ("sum", "mean", "max"):
        out, arg = _model_reduce(feats, want.order, want.starts, want.counts, reduce)
        args = (feats, want.order, want.starts, want.counts, want.point2voxel, reduce)
        ref = segment_reduce(*args, backend="reference")
        torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
        if reduce == "max":
            f = feats.clone().requires_grad_(True)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
            segment_reduce(f, *args[1:], backend="reference").backward(g)
            want_grad = torch.zeros_like(feats)
            v, ch = np.nonzero(arg >= 0)
            want_grad[arg[v, ch], ch] = g[v, ch]
            assert torch.equal(f.grad, want_grad)


def test_kernel_model_group_overflow_and_all_dropped():
    huge = torch.tensor([[0, 2**30, 5], [0, 2**30, 5], [7, 0, 2**31 - 1], [-3, 0, 0]])
    for c in (huge, huge.int()):
        got, overflow = _model_group(c)
        assert overflow and got[0].shape[0] == 0  # M = 0: the Python layer takes the reference
    got, overflow = _model_group(torch.tensor([[-1, 0, 0], [0, -1, 2]], dtype=torch.int32))
    assert not overflow and [t.shape[0] for t in got] == [0, 0, 0, 0, 2]
    assert got[4].tolist() == [-1, -1]


@pytest.mark.parametrize("with_batch,dtype", [(False, torch.int32), (True, torch.int64)])
def test_kernel_model_bitmap_group_equals_reference(with_batch, dtype):
    """The numpy model of voxel_group_bitmap (its atomics in random orders) gives the
    reference's grouping exactly, with and without voxels of 45 and more rows."""
    _, coors = _inputs(clouds=2 if with_batch else 1, with_batch=with_batch)
    crowd = coors[(coors >= 0).all(1)][:3].repeat(45, 1)  # 3 voxels of >= 45 rows each
    gen = torch.Generator().manual_seed(4)
    for case in (coors, torch.cat((coors, crowd))[torch.randperm(len(coors) + 135, generator=gen)]):
        case = case.to(dtype)
        want = voxel_group(case, backend="reference")
        for seed in (0, 1):
            got, fallback = model.voxel_group_bitmap(case, 1 << 24, seed=seed)
            assert fallback == 0
            for a, b in zip(got, want):
                assert torch.equal(a, b.to(torch.int64))


def test_kernel_model_bitmap_group_hands_back_to_the_sort():
    """The bitmap grouping's fallbacks: a key range beyond the bitmap, an int32 overflow, a
    voxel of more rows than its limit; and all rows dropped (M = 0, no fallback)."""
    _, coors = _inputs()
    assert model.voxel_group_bitmap(coors, 1 << 10)[1] == 1  # tiny-voxels' range > 1024 keys
    huge = torch.tensor([[0, 2**31 + 3, 5], [0, 1, 5]])
    assert model.voxel_group_bitmap(huge, 1 << 24)[1] == 1
    limit = model.BITMAP_MAX_POINTS_PER_VOXEL
    one = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    assert model.voxel_group_bitmap(one.repeat(limit, 1), 1 << 24)[1] == 0
    assert model.voxel_group_bitmap(one.repeat(limit + 1, 1), 1 << 24)[1] == 2
    got, fallback = model.voxel_group_bitmap(torch.tensor([[-1, 0, 0], [0, -1, 2]]), 1 << 24)
    assert fallback == 0 and [t.shape[0] for t in got] == [0, 0, 0, 0, 2]


# ---------------------------------------------------------------- native (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "pointpillars-nus", "tiny-voxels"])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("channels", [5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_matches_reference(config, reduce, channels, dtype):
    device = native_gpu_device()
    vs, pcr, _, _ = lidar.layer_args(config)
    pts = lidar.VOXEL_CONFIGS[config].points()
    coors = _voxel.dynamic_rows(pts, _voxel.voxel_grid(vs, pcr))
    g = torch.Generator().manual_seed(3)
    feats = (pts if channels == 5 else torch.randn(pts.shape[0], channels, generator=g)).to(dtype)
    want, want_c = mu_space.dynamic_scatter(feats, coors, reduce, backend="reference")
    f = feats.to(device, copy=True).requires_grad_(True)
    with _opdef.poisoned_outputs():  # NaN / -1 in every native output: all must be written
        got, got_c = mu_space.dynamic_scatter(f, coors.to(device), reduce, backend="native")
    assert torch.equal(got_c.cpu(), want_c)
    from mu_space.testing import tolerances

    tolerances.assert_close(got.cpu(), want, op="dynamic_scatter")
    grad = torch.randn(got.shape, generator=g).to(dtype)
    assert (coors < 0).any(), "the frame must have dropped rows (their gradient is 0)"
    with _opdef.poisoned_outputs():
        got.backward(grad.to(device))
    fr = feats.clone().requires_grad_(True)
    mu_space.dynamic_scatter(fr, coors, reduce, backend="reference")[0].backward(grad)
    tolerances.assert_close(f.grad.cpu(), fr.grad, op="dynamic_scatter", name="grad")
    again, _ = mu_space.dynamic_scatter(
        feats.to(device), coors.to(device), reduce, backend="native"
    )
    assert torch.equal(again, got.detach())  # deterministic


@pytest.mark.gpu
def test_native_group_handles_huge_coordinates_and_int64():
    device = native_gpu_device()
    coors = torch.tensor([[0, 2**30, 5], [0, 2**30, 5], [7, 0, 2**31 - 1], [-3, 0, 0]])
    for c in (coors, coors.int()):
        want = voxel_group(c, backend="reference")
        got = voxel_group(c.to(device), backend="native")  # key range overflow: reference inside
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)


def _expect_bitmap(coors_cpu) -> bool:
    """Whether voxel_group_bitmap keeps a grouping (else it hands back to the sort): the key
    range within its bitmap and no voxel above its row limit."""
    from mu_space.runtime import native

    valid = coors_cpu[(coors_cpu >= 0).all(1)].long()
    if valid.numel() == 0:
        return True
    if int(valid.max()) > 2**31 - 1:
        return False
    key_range = 1
    for d in valid.max(0).values.tolist():
        key_range *= d + 1
    n = coors_cpu.shape[0]
    cap = min(max(512 * n, 1 << 24), native.limit("voxel_group.bitmap_max_keys"))
    cap = (cap + 1023) // 1024 * 1024  # bitmap_keys in csrc/voxel/dynamic_scatter_musa.mu
    counts = voxel_group(coors_cpu, backend="reference").counts
    crowded = counts.numel() and int(counts.max()) > native.limit(
        "voxel_group.bitmap_max_points_per_voxel"
    )
    return key_range <= cap and not crowded


def _native_groupings_equal(coors_cpu, device, monkeypatch):
    """voxel_group's native bitmap grouping, its sort grouping and the reference: the same
    values; the bitmap entry point is called first and the sort runs only where it hands back."""
    want = voxel_group(coors_cpu, backend="reference")
    names = recording_entry_points(monkeypatch)
    with _opdef.poisoned_outputs():
        got = voxel_group(coors_cpu.to(device), backend="native")
    bitmap = _expect_bitmap(coors_cpu)
    assert "voxel_group_bitmap" in names, names
    assert ("voxel_group_keys" in names) == (not bitmap), names
    monkeypatch.setattr(ds, "GROUPING", "sort")
    names.clear()
    with _opdef.poisoned_outputs():
        sort = voxel_group(coors_cpu.to(device), backend="native")
    assert "voxel_group_bitmap" not in names and "voxel_group_keys" in names, names
    monkeypatch.setattr(ds, "GROUPING", "bitmap")
    for a, b, c in zip(got, sort, want):
        assert torch.equal(a.cpu(), c) and torch.equal(b.cpu(), c)
    return bitmap


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config", ["centerpoint-0075-nus", "pointpillars-kitti", "pointpillars-nus", "tiny-voxels"]
)
@pytest.mark.parametrize("with_batch,dtype", [(False, torch.int32), (True, torch.int64)])
def test_native_bitmap_grouping_equals_the_sort_grouping(config, with_batch, dtype, monkeypatch):
    device = native_gpu_device()
    _, coors = _inputs(config, clouds=2 if with_batch else 1, with_batch=with_batch)
    took_bitmap = _native_groupings_equal(coors.to(dtype), device, monkeypatch)
    if config != "pointpillars-nus":  # its 10-sweep pillars may hold > 1024 points
        assert took_bitmap


@pytest.mark.gpu
def test_native_bitmap_grouping_crowded_voxels_and_fallbacks(monkeypatch):
    """Voxels of 1 to 1024 rows, one of 1025 (the sort grouping), a key range beyond the bitmap,
    all rows dropped, one row."""
    device = native_gpu_device()
    _, coors = _inputs()
    gen = torch.Generator().manual_seed(8)
    kept = coors[(coors >= 0).all(1)]
    from mu_space.runtime import native

    limit = native.limit("voxel_group.bitmap_max_points_per_voxel")
    new_voxel = kept.max(0).values + 1  # a voxel of exactly `rows` rows
    for rows in (1, 8, 9, 32, 33, 100, limit, limit + 1):
        case = torch.cat((coors, new_voxel[None].repeat(rows, 1)))
        case = case[torch.randperm(case.shape[0], generator=gen)]
        assert _native_groupings_equal(case, device, monkeypatch) == (rows <= limit), rows
    wide = torch.tensor([[0, 40000, 40000], [1, 0, 7], [1, 0, 7], [-1, 3, 3]], dtype=torch.int32)
    assert not _native_groupings_equal(wide, device, monkeypatch)  # 2 * 40001^2 keys
    assert _native_groupings_equal(torch.tensor([[-1, 0, 0], [0, -1, 2]]), device, monkeypatch)
    assert _native_groupings_equal(kept[:1], device, monkeypatch)


def _native_grouping(device, duplicate=False):
    """tiny-voxels rows (dropped rows included; `duplicate`: every point twice, so each voxel
    holds equal rows) and their grouping on `device`."""
    pts, coors = _inputs()
    if duplicate:
        pts, coors = torch.cat((pts, pts)), torch.cat((coors, coors))
    g = voxel_group(coors, backend="reference")
    return pts, coors, tuple(t.to(device) for t in (g.order, g.starts, g.counts, g.point2voxel))


def _poisoned(shape, dtype, device, aligned=True):
    """A NaN-filled [n, C] tensor; aligned=False: a view one element into a larger buffer (not
    16-byte aligned: the kernels' scalar fallback)."""
    n, C = shape
    buf = torch.full((n * C + 1,), float("nan"), dtype=dtype, device=device)
    return (buf[: n * C] if aligned else buf[1:]).view(n, C)


def _native_backward(grad_out, feats, grouping, reduce, argmax=None, aligned=True):
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    grad = _poisoned(feats.shape, feats.dtype, feats.device, aligned)
    native.function("segment_reduce_backward")(
        grad_out, feats, *grouping, argmax, grad, ds._REDUCE_CODE[reduce], stream_handle(feats)
    )
    return grad


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("channels", [4, 5, 8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_native_sum_mean_backward_vectorised_and_fallback(reduce, channels, dtype, aligned):
    """16-byte pieces (C % 4 == 0 for float32, C % 8 == 0 for 16-bit types, aligned buffers)
    and the per-element fallback (other C, a grad buffer one element into a larger one) both
    write every element, bit-identical to the reference (float32 division, one rounding)."""
    device = native_gpu_device()
    _, _, grouping = _native_grouping(device)
    n, m = grouping[3].shape[0], grouping[1].shape[0]
    gen = torch.Generator().manual_seed(channels)
    feats = torch.randn(n, channels, generator=gen).to(dtype)
    grad_out = (torch.randn(m, channels, generator=gen) * 3).to(dtype)
    got = _native_backward(grad_out.to(device), feats.to(device), grouping, reduce, None, aligned)
    cpu = tuple(t.cpu() for t in grouping)
    (want,) = ds.segment_reduce_backward_reference(grad_out, feats, *cpu, reduce)
    assert got.is_contiguous() and (got.data_ptr() % 16 == 0) == aligned
    assert torch.equal(got.cpu(), want)


def _max_feats(n, channels, dtype, seed):
    """ReLU'd normals (many zeros: ties inside voxels), NaN in some rows and a few -inf; the
    n / 2 rows twice (for _native_grouping(duplicate=True): equal rows in every voxel, and
    channels of a voxel that hold only NaN)."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.relu(torch.randn(n // 2, channels, generator=gen)).round(decimals=1)
    feats[::7, 0] = float("nan")
    feats[3::11, channels - 1] = float("nan")
    feats[5::29, channels // 2] = -float("inf")
    return torch.cat((feats, feats)).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("channels", [4, 5, 8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_native_forward_vectorised_and_fallback(reduce, channels, dtype, aligned):
    """The forward's 16-byte pieces (C % 4 == 0 for float32, C % 8 == 0 for 16-bit types,
    aligned feats / out / argmax) and its per-element kernel (other C, feats and out one element
    into larger buffers) write every element, bit-identical to the reference, argmax included."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device()
    _, _, grouping = _native_grouping(device, duplicate=True)
    order, starts, counts, p2v = grouping
    n, m = p2v.shape[0], starts.shape[0]
    feats = _max_feats(n, channels, dtype, seed=channels + 1)
    f = _poisoned((n, channels), dtype, device, aligned)
    f.copy_(feats.to(device))
    out = _poisoned((m, channels), dtype, device, aligned)
    argmax = None
    if reduce == "max":
        argmax = torch.full((m, channels), -7, dtype=torch.int32, device=device)
    native.function("segment_reduce_forward")(
        f, order, starts, counts, out, argmax, ds._REDUCE_CODE[reduce], stream_handle(f)
    )
    cpu = tuple(t.cpu() for t in grouping)
    want = ds.segment_reduce_reference(feats, *cpu, reduce)
    assert torch.equal(out.cpu().isnan(), want.isnan())
    assert torch.equal(out.cpu().nan_to_num(), want.nan_to_num())
    if argmax is not None:
        _, arg = ds._max_and_arg(feats, ds._masked_voxel(cpu[3], m), m)
        assert torch.equal(argmax.cpu().long(), torch.where(arg < n, arg, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [4, 5, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("aligned", [True, False])
def test_native_max_backward_from_saved_argmax(channels, dtype, aligned):
    """The forward's argmax (first row holding the maximum, -1 where none, NaN never wins) and
    the backward from it equal the reference and the fill + walk backward (argmax=None) to the
    bit, with ties (zeros after ReLU, every point duplicated) and NaN features."""
    from mu_space.runtime import native
    from mu_space.runtime.device import stream_handle

    device = native_gpu_device()
    _, _, grouping = _native_grouping(device, duplicate=True)
    order, starts, counts, p2v = grouping
    n, m = p2v.shape[0], starts.shape[0]
    feats = _max_feats(n, channels, dtype, seed=channels)
    gen = torch.Generator().manual_seed(7)
    grad_out = torch.randn(m, channels, generator=gen).to(dtype)
    f, go = feats.to(device), grad_out.to(device)
    out = torch.full((m, channels), float("nan"), dtype=dtype, device=device)
    argmax = torch.full((m, channels), -7, dtype=torch.int32, device=device)
    native.function("segment_reduce_forward")(
        f, order, starts, counts, out, argmax, 2, stream_handle(f)
    )
    cpu = tuple(t.cpu() for t in grouping)
    want_out = ds.segment_reduce_reference(feats, *cpu, "max")
    assert torch.equal(out.cpu(), want_out)
    _, arg = ds._max_and_arg(feats, ds._masked_voxel(cpu[3], m), m)
    assert torch.equal(argmax.cpu().long(), torch.where(arg < n, arg, -1))
    assert (argmax == -1).any() and (arg < n).any()  # channels without a number occur
    got = _native_backward(go, f, grouping, "max", argmax, aligned)
    walk = _native_backward(go, f, grouping, "max", None, aligned)
    (want,) = ds.segment_reduce_backward_reference(grad_out, feats, *cpu, "max")
    assert torch.equal(got.cpu(), want)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), walk.view(bits))
    # a forward without argmax gives the same maxima
    plain = torch.full_like(out, float("nan"))
    native.function("segment_reduce_forward")(
        f, order, starts, counts, plain, None, 2, stream_handle(f)
    )
    assert torch.equal(plain, out)


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [5, 64])
def test_native_max_backward_takes_the_saved_argmax(channels, monkeypatch):
    """A native max forward of feats that need a gradient leaves its argmax in SAVED_ARGMAX
    (none without requires_grad, none for mean), and the backward finds it."""
    device = native_gpu_device()
    pts, coors, _ = _native_grouping("cpu", duplicate=True)
    feats = _max_feats(pts.shape[0], channels, torch.float32, seed=1)
    dc = coors.to(device)
    ds.SAVED_ARGMAX.clear()
    mu_space.dynamic_scatter(feats.to(device), dc, "max", backend="native")
    mu_space.dynamic_scatter(
        feats.to(device, copy=True).requires_grad_(True), dc, "mean", backend="native"
    )
    assert len(ds.SAVED_ARGMAX._entries) == 0
    f = feats.to(device, copy=True).requires_grad_(True)
    with _opdef.poisoned_outputs():
        out, _ = mu_space.dynamic_scatter(f, dc, "max", backend="native")
    assert len(ds.SAVED_ARGMAX._entries) == 1
    found = []
    get = ds.SAVED_ARGMAX.get
    monkeypatch.setattr(ds.SAVED_ARGMAX, "get", lambda t: found.append(get(t)) or found[-1])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    with _opdef.poisoned_outputs():
        out.backward(grad.to(device))
    assert len(found) == 1 and found[0] is not None
    fr = feats.clone().requires_grad_(True)
    mu_space.dynamic_scatter(fr, coors, "max", backend="reference")[0].backward(grad)
    assert torch.equal(f.grad.cpu(), fr.grad)


# ---------------------------------------------------------------- the one-call forward


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (NaN payloads and the sign of zero compared too)."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _signed_zero_feats(n, channels, dtype, seed):
    """_max_feats with -0.0 in place of about half of the ReLU zeros: a voxel's maximum may be a
    zero of either sign, and the first row holding it decides the bits."""
    feats = _max_feats(n, channels, torch.float32, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    flip = (feats == 0) & (torch.rand(feats.shape, generator=gen) < 0.5)
    return torch.where(flip, torch.full_like(feats, -0.0), feats).to(dtype)


def _fused_and_parts(feats, coors, reduce, monkeypatch):
    """dynamic_scatter on `device` without a gradient, through the one-call forward and through
    the parts (MUSPACE_DYNAMIC_SCATTER_FUSED=0), outputs poisoned; the entry points each called."""
    monkeypatch.setattr(ds, "FUSED_FORWARD_UNVERIFIED", "")
    names = recording_entry_points(monkeypatch)
    with _opdef.poisoned_outputs():
        fused = mu_space.dynamic_scatter(feats, coors, reduce, backend="native")
    fused_names = _launching(names)
    names.clear()
    monkeypatch.setattr(ds, "FUSED_FORWARD", False)
    with _opdef.poisoned_outputs():
        parts = mu_space.dynamic_scatter(feats, coors, reduce, backend="native")
    monkeypatch.setattr(ds, "FUSED_FORWARD", True)
    return fused, parts, fused_names, _launching(names)


def _launching(names):
    """The entry points that launch kernels (the build facts and workspace sizes are read once
    and cached)."""
    return [n for n in names if n != "muspace_build_facts" and not n.endswith("_workspace_ints")]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "tiny-voxels"])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("channels", [4, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_fused_forward_equals_the_parts(config, reduce, channels, dtype, monkeypatch):
    """The one-call forward (dynamic_scatter_bitmap_forward: the reduction queued before the
    voxel count is read, its sizes read on the device) gives the parts' outputs to the bit (the
    same float32 arithmetic in the same row order; max without its row tracking: the first row's
    zero among -0.0 / +0.0 ties, NaN and -inf rows included), and the reference within the op's
    tolerance (NaN where it has NaN).
    16-byte and per-element kernels (C = 4: 16-byte float32, per element 16-bit; 5: per element;
    64: 16-byte)."""
    device = native_gpu_device()
    vs, pcr, _, _ = lidar.layer_args(config)
    pts = lidar.VOXEL_CONFIGS[config].points()
    coors = _voxel.dynamic_rows(pts, _voxel.voxel_grid(vs, pcr))
    feats = _signed_zero_feats(2 * ((pts.shape[0] + 1) // 2), channels, dtype, seed=channels)
    feats = feats[: pts.shape[0]]
    fused, parts, fused_names, part_names = _fused_and_parts(
        feats.to(device), coors.to(device), reduce, monkeypatch
    )
    assert fused_names == ["dynamic_scatter_bitmap_forward"]
    assert "segment_reduce_forward" in part_names and "dynamic_scatter_bitmap_forward" not in (
        part_names
    )
    assert torch.equal(fused[1], parts[1])
    assert fused[0].shape == parts[0].shape and torch.equal(_bits(fused[0]), _bits(parts[0]))
    want, want_c = mu_space.dynamic_scatter(feats, coors, reduce, backend="reference")
    assert torch.equal(fused[1].cpu(), want_c)
    from mu_space.testing import tolerances

    # (the reference's zero maxima may carry either sign: scatter_reduce's amax keeps no row
    # order; the parts' kernel is the one whose bits the fused kernel must give)
    tolerances.assert_close(fused[0].cpu(), want, op="dynamic_scatter", equal_nan=True)


@pytest.mark.gpu
def test_native_fused_forward_unaligned_feats_hand_backs_and_gradients(monkeypatch):
    """The one-call forward with feats one element into a larger buffer (the per-element
    kernel), its hand-backs to the sort grouping (a voxel beyond the bitmap's row limit, a key
    range beyond the bitmap: then the parts run and the result is the same), and a call that
    needs a gradient (the parts, with segment_reduce's autograd)."""
    from mu_space.runtime import native

    device = native_gpu_device()
    pts, coors = _inputs()
    C = 8
    feats = _signed_zero_feats(2 * ((pts.shape[0] + 1) // 2), C, torch.float32, seed=3)
    feats = feats[: pts.shape[0]]
    buf = torch.empty(feats.numel() + 1, device=device)
    unaligned = buf[1:].view(feats.shape)
    unaligned.copy_(feats.to(device))
    assert unaligned.data_ptr() % 16 != 0
    fused, parts, names, _ = _fused_and_parts(unaligned, coors.to(device), "mean", monkeypatch)
    assert "dynamic_scatter_bitmap_forward" in names
    assert torch.equal(_bits(fused[0]), _bits(parts[0])) and torch.equal(fused[1], parts[1])

    limit = native.limit("voxel_group.bitmap_max_points_per_voxel")
    kept = coors[(coors >= 0).all(1)]
    crowded = torch.cat((coors, (kept.max(0).values + 1)[None].repeat(limit + 1, 1)))
    wide = torch.tensor([[0, 40000, 40000], [1, 0, 7], [1, 0, 7], [-1, 3, 3]], dtype=torch.int32)
    for case in (crowded, wide):
        f = torch.randn(case.shape[0], C, generator=torch.Generator().manual_seed(4))
        for reduce in ("max", "mean"):
            fused, parts, names, _ = _fused_and_parts(
                f.to(device), case.to(device), reduce, monkeypatch
            )
            assert names == [
                "dynamic_scatter_bitmap_forward",
                "voxel_group_keys",
                "voxel_group_from_sorted",
                "segment_reduce_forward",
            ], names
            assert torch.equal(_bits(fused[0]), _bits(parts[0])) and torch.equal(fused[1], parts[1])
            want, want_c = mu_space.dynamic_scatter(f, case, reduce, backend="reference")
            assert torch.equal(fused[1].cpu(), want_c)
            torch.testing.assert_close(fused[0].cpu(), want, **TOL)

    monkeypatch.setattr(ds, "FUSED_FORWARD_UNVERIFIED", "")
    names = recording_entry_points(monkeypatch)
    f = feats.to(device, copy=True).requires_grad_(True)
    out, _ = mu_space.dynamic_scatter(f, coors.to(device), "max", backend="native")
    assert "dynamic_scatter_bitmap_forward" not in names and "segment_reduce_forward" in names
    out.sum().backward()
    fr = feats.clone().requires_grad_(True)
    mu_space.dynamic_scatter(fr, coors, "max", backend="reference")[0].sum().backward()
    assert torch.equal(f.grad.cpu(), fr.grad)


# ---------------------------------------------------------------- the padded form


def test_padded_form_is_dynamic_scatter_plus_padding():
    """dynamic_scatter_padded (reference path): dynamic_scatter's rows, then zero / -1 rows up to
    N, voxel_num = M; voxel_group_padded: voxel_group's arrays padded (order -1 beyond K, starts
    and counts 0 beyond M); gradients as dynamic_scatter's."""
    feats, coors = _inputs(clouds=2, with_batch=True)
    n = feats.shape[0]
    for reduce in ("max", "mean"):
        f1 = feats.clone().requires_grad_(True)
        f2 = feats.clone().requires_grad_(True)
        out, vc, num = mu_space.dynamic_scatter_padded(f1, coors, reduce)
        want, want_c = mu_space.dynamic_scatter(f2, coors, reduce)
        m = want.shape[0]
        assert out.shape == (n, feats.shape[1]) and vc.shape == (n, coors.shape[1])
        assert num.dtype == torch.int64 and num.dim() == 0 and int(num) == m < n
        assert torch.equal(out[:m], want) and torch.equal(vc[:m], want_c)
        assert not out[m:].any() and bool((vc[m:] == -1).all())
        g = torch.randn(m, feats.shape[1], generator=torch.Generator().manual_seed(2))
        out.backward(torch.cat((g, torch.randn(n - m, feats.shape[1]))))  # padding: no gradient
        want.backward(g)
        assert torch.equal(f1.grad, f2.grad)
    p = mu_space.ops.voxel_group_padded(coors)
    g = voxel_group(coors, backend="reference")
    m, k = g.starts.shape[0], g.order.shape[0]
    assert int(p.voxel_num) == m
    assert torch.equal(p.order[:k], g.order) and bool((p.order[k:] == -1).all())
    assert torch.equal(p.starts[:m], g.starts) and torch.equal(p.counts[:m], g.counts)
    assert not p.starts[m:].any() and not p.counts[m:].any()
    assert torch.equal(p.point2voxel, g.point2voxel)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["centerpoint-0075-nus", "tiny-voxels"])
@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
@pytest.mark.parametrize("channels", [5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_padded_equals_dynamic_scatter(config, reduce, channels, dtype, monkeypatch):
    """The padded form's native path (the sort grouping with its count left on the device, the
    reduction over N voxel slots) gives dynamic_scatter's native rows to the bit, padding rows
    0 / -1 (outputs poisoned), voxel_num = M, and the same gradient."""
    device = native_gpu_device()
    vs, pcr, _, _ = lidar.layer_args(config)
    pts = lidar.VOXEL_CONFIGS[config].points()
    coors = _voxel.dynamic_rows(pts, _voxel.voxel_grid(vs, pcr)).to(device)
    gen = torch.Generator().manual_seed(channels)
    feats = (pts if channels == 5 else torch.randn(pts.shape[0], channels, generator=gen)).to(
        device=device, dtype=dtype
    )
    names = recording_entry_points(monkeypatch)
    f1 = feats.clone().requires_grad_(True)
    with _opdef.poisoned_outputs():
        out, vc, num = mu_space.dynamic_scatter_padded(f1, coors, reduce, backend="native")
    assert "voxel_group_keys" in names and "segment_reduce_forward" in names, names
    f2 = feats.clone().requires_grad_(True)
    want, want_c = mu_space.dynamic_scatter(f2, coors, reduce, backend="native")
    m = want.shape[0]
    assert int(num) == m
    assert torch.equal(_bits(out[:m]), _bits(want)) and torch.equal(vc[:m], want_c)
    assert not out[m:].any() and bool((vc[m:] == -1).all())
    g = torch.randn(want.shape, generator=gen).to(device=device, dtype=dtype)
    with _opdef.poisoned_outputs():
        out.backward(torch.cat((g, torch.ones_like(out[m:]))))
    want.backward(g)
    assert torch.equal(f1.grad, f2.grad)


@pytest.mark.gpu
def test_native_padded_key_range_overflow_says_so():
    """Coordinates whose key range reaches 2^31 - 1: voxel_num -1 and only padding (the
    documented precondition), no out-of-bounds access; dynamic_scatter handles them."""
    device = native_gpu_device()
    coors = torch.tensor([[0, 2**30, 5], [0, 2**30, 5], [7, 0, 2**31 - 1], [-3, 0, 0]])
    feats = torch.randn(4, 8, device=device)
    out, vc, num = mu_space.dynamic_scatter_padded(feats, coors.to(device), "max", backend="native")
    assert int(num) == -1 and not out.any() and bool((vc == -1).all())
    want, _ = mu_space.dynamic_scatter(feats, coors.to(device), "max", backend="native")
    assert want.shape[0] == 2


@pytest.mark.gpu
def test_native_padded_is_cuda_graph_capturable():
    """dynamic_scatter_padded captured in a CUDA graph, replayed on other points of the same
    count, equals dynamic_scatter on those points."""
    from tests.helpers import graph_capture_device

    device = graph_capture_device()
    vs, pcr, _, _ = lidar.layer_args("centerpoint-0075-nus")
    grid = _voxel.voxel_grid(vs, pcr)
    pts = lidar.VOXEL_CONFIGS["centerpoint-0075-nus"].points()
    # other points of the same count: shuffled and moved 0.37 m (other voxels, other order)
    other = pts[torch.randperm(pts.shape[0], generator=torch.Generator().manual_seed(7))].clone()
    other[:, :2] += 0.37
    static_f = pts.to(device)
    static_c = _voxel.dynamic_rows(pts, grid).to(device)
    for reduce in ("max", "mean"):
        mu_space.dynamic_scatter_padded(static_f, static_c, reduce, backend="cuda")  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, vc, num = mu_space.dynamic_scatter_padded(
                static_f, static_c, reduce, backend="cuda"
            )
        static_f.copy_(other.to(device))
        static_c.copy_(_voxel.dynamic_rows(other, grid).to(device))
        graph.replay()
        torch.cuda.synchronize()
        want, want_c = mu_space.dynamic_scatter(static_f, static_c, reduce, backend="cuda")
        m = want.shape[0]
        assert int(num) == m
        assert torch.equal(out[:m], want) and torch.equal(vc[:m], want_c)
        assert not out[m:].any() and bool((vc[m:] == -1).all())
        static_f.copy_(pts.to(device))
        static_c.copy_(_voxel.dynamic_rows(pts, grid).to(device))


# ---------------------------------------------------------------- the CenterPoint recipe


def _recipe():
    import importlib.util
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[2]
        / "model_examples/CenterPoint/scripts/centerpoint_hot_path.py"
    )
    spec = importlib.util.spec_from_file_location("recipe_centerpoint", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["hard", "dynamic"])
def test_centerpoint_recipe_runs_on_the_cpu(mode, capsys):
    args = ["--device", "cpu", "--small", "--warmup", "0", "--reps", "1", "--mode", mode]
    assert _recipe().main(args) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "MISMATCH" not in out


def test_centerpoint_recipe_detects_a_wrong_backend(monkeypatch, capsys):
    original = mu_space.dynamic_scatter

    def off(*args, backend="auto", **kwargs):
        out, vc = original(*args, backend="reference", **kwargs)
        return (out * (1.0 + 1e-3) if backend == "auto" else out), vc

    monkeypatch.setattr(mu_space, "dynamic_scatter", off)
    args = ["--device", "cpu", "--small", "--warmup", "0", "--reps", "1", "--mode", "dynamic"]
    assert _recipe().main([*args, "--backend-a", "auto"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_benchmark_smoke_run(tmp_path, capsys):
    """benchmarks/bench_dynamic_scatter.py end to end on tiny inputs (CPU: reference path)."""
    from benchmarks import bench_dynamic_scatter

    args = ["--smoke", "--quick", "--out", str(tmp_path), "--cases", "c5-max.*float32"]
    assert bench_dynamic_scatter.main(args) == 0, capsys.readouterr().out
    assert (tmp_path / "dynamic_scatter.smoke.json").is_file()
