"""roiaware_pool3d / RoIAwarePool3d (mmcv API): against mmcv's algorithm written out in plain
Python (mask, voxel index, collect the first max_pts_per_voxel - 1 points per voxel in point
order, strict-max / float sum), gradients, the internal map / pool ops; native vs reference on a
GPU (skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

from mu_space.ops.roiaware import (
    RoIAwarePool3d,
    roiaware_pool3d,
    roiaware_pool3d_map,
    roiaware_pool3d_pool,
)
from mu_space.runtime.kernel_dispatch import DispatchError
from mu_space.testing.boxes import roi_inputs as _roi_inputs
from tests.helpers import assert_close, native_gpu_device
from tests.ops import _box3d_oracle as oracle


def _oracle(rois, pts, feats, out, K, mode):
    ox, oy, oz = out
    N, C = rois.shape[0], feats.shape[1]
    res = torch.zeros(N, ox, oy, oz, C, dtype=torch.float64)
    pl, rl, fl = pts.double().tolist(), rois.double().tolist(), feats.double().tolist()
    for r, roi in enumerate(rl):
        cx, cy, cz, dx, dy, dz, yaw = roi
        voxels: dict = {}
        for p, pt in enumerate(pl):
            if not oracle.point_in_lidar_box(pt, roi):
                continue
            c, s = math.cos(-yaw), math.sin(-yaw)
            lx = (pt[0] - cx) * c - (pt[1] - cy) * s
            ly = (pt[0] - cx) * s + (pt[1] - cy) * c

            def q(v, o):
                return min(max(int(v), 0), o - 1)

            key = (
                q((lx + dx / 2) / (dx / ox), ox),
                q((ly + dy / 2) / (dy / oy), oy),
                q((pt[2] - cz) / (dz / oz), oz),
            )
            lst = voxels.setdefault(key, [])
            if len(lst) < K - 1:
                lst.append(p)
        for (ix, iy, iz), lst in voxels.items():
            for ch in range(C):
                vals = [fl[p][ch] for p in lst]
                if mode == "max":
                    best, arg = -math.inf, -1
                    for p, v in zip(lst, vals):
                        if v > best:
                            best, arg = v, p
                    res[r, ix, iy, iz, ch] = best if arg >= 0 else 0.0
                elif lst:
                    total = 0.0
                    for v in vals:
                        total += v
                    res[r, ix, iy, iz, ch] = total / len(lst)
    return res


@pytest.fixture(scope="module")
def inputs():
    rois, pts = _roi_inputs(1500, 8, seed=71)
    feats = torch.randn(1500, 3, generator=torch.Generator().manual_seed(2))
    return rois, pts, feats


@pytest.mark.parametrize(
    ("out", "K", "mode"), [((5, 5, 5), 128, "max"), ((4, 6, 3), 128, "avg"), ((3, 3, 3), 4, "max")]
)
def test_matches_mmcv_algorithm(inputs, out, K, mode):
    rois, pts, feats = inputs
    want = _oracle(rois, pts, feats, out, K, mode)
    assert (want != 0).any(-1).sum() > 30  # voxels really get points
    got = roiaware_pool3d(rois.double(), pts.double(), feats.double(), out, K, mode)
    assert got.shape == (8, *out, 3) and got.dtype == torch.float64
    assert_close(got, want, atol=1e-12, rtol=1e-12)
    got32 = roiaware_pool3d(rois, pts, feats, out, K, mode)
    assert_close(got32.double(), want, atol=1e-6, rtol=1e-6)


def test_voxel_caps_keep_the_first_points(inputs):
    rois, pts, feats = inputs
    start, count, plist = roiaware_pool3d_map(rois, pts, 2, 3)  # at most 2 points per voxel
    assert int(count.max()) == 2
    full_start, full_count, full_list = roiaware_pool3d_map(rois, pts, 2, 10**6)
    assert int(full_count.max()) > 2
    for c in torch.nonzero(full_count > 2).squeeze(1)[:20].tolist():
        s, fs = int(start[c]), int(full_start[c])
        kept = plist[s : s + 2].tolist()
        assert kept == full_list[fs : fs + 2].tolist()  # the smallest point indices
        assert kept == sorted(full_list[fs : fs + int(full_count[c])].tolist())[:2]
    assert bool((plist[plist < 0] == -1).all())  # unused entries are -1
    assert roiaware_pool3d(rois, pts, feats, 2, 1, "max").abs().sum() == 0  # no point kept


def test_max_ignores_nan_and_minus_inf_avg_propagates_nan(inputs):
    rois, pts, feats = inputs
    f = feats.clone()
    f[:, 0] = -math.inf
    f[::3, 1] = math.nan
    out = roiaware_pool3d(rois, pts, f, 4, 128, "max")
    assert bool((out[..., 0] == 0).all())  # nothing beats -inf: 0, as mmcv
    want = _oracle(rois, pts, torch.where(torch.isnan(f), -math.inf, f), (4, 4, 4), 128, "max")
    assert_close(out[..., 1].double(), want[..., 1], atol=1e-6, rtol=1e-6)
    avg = roiaware_pool3d(rois, pts, f, 4, 128, "avg")
    assert torch.isnan(avg[..., 1]).any()


def test_gradients(inputs):
    rois, pts, feats = inputs
    rois, pts = rois[:3].double(), pts.double()
    for mode in ("max", "avg"):
        f = feats.double().requires_grad_(True)
        out = roiaware_pool3d(rois, pts, f, 3, 16, mode)
        g = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, f, g)
        start, count, plist = roiaware_pool3d_map(rois, pts, 3, 16)
        want = torch.zeros_like(f)
        gf = g.reshape(-1, f.shape[1])
        for cell in torch.nonzero(count > 0).squeeze(1).tolist():
            members = plist[int(start[cell]) : int(start[cell]) + int(count[cell])].tolist()
            for ch in range(f.shape[1]):
                if mode == "avg":
                    for p in members:
                        want[p, ch] += gf[cell, ch] / len(members)
                else:
                    vals = [float(f.detach()[p, ch]) for p in members]
                    want[members[vals.index(max(vals))], ch] += gf[cell, ch]
        assert_close(grad, want, atol=1e-12, rtol=1e-12)
    f = feats[:, :2].double().requires_grad_(True)
    mapping = roiaware_pool3d_map(rois, pts, 3, 16)
    assert torch.autograd.gradcheck(
        lambda x: roiaware_pool3d_pool(x, *mapping, 3, 1), (f,), fast_mode=True
    )


def test_module_empty_inputs_and_degenerate_rois(inputs):
    rois, pts, feats = inputs
    m = RoIAwarePool3d(out_size=(2, 3, 4), max_pts_per_voxel=8, mode="avg")
    assert m(rois, pts, feats).shape == (8, 2, 3, 4, 3)
    assert roiaware_pool3d(rois[:0], pts, feats, 4).shape == (0, 4, 4, 4, 3)
    assert roiaware_pool3d(rois, pts[:0], feats[:0], 4).abs().sum() == 0
    zero = rois.clone()
    zero[:, 3:6] = 0.0
    assert roiaware_pool3d(zero, pts, feats, 4).abs().sum() == 0
    far = rois.clone()
    far[:, :2] += 1e4
    assert roiaware_pool3d(far, pts, feats, 4, 128, "avg").abs().sum() == 0


def _edge_voxel_inputs():
    """One RoI, out_size (2^24 + 4, 1, 1): float(ox - 1) rounds up to ox, so a float clamp alone
    let points near the +x face land in voxel ox (cell N * V: past every cell array)."""
    rois = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]])
    xs = torch.tensor([0.5 - 2.0**-k for k in range(2, 30)])
    pts = torch.stack([xs, torch.zeros_like(xs), torch.full_like(xs, 0.5)], 1)
    return rois, pts, [2**24 + 4, 1, 1]


def test_voxel_index_stays_below_out_size_above_2_pow_24():
    rois, pts, out = _edge_voxel_inputs()
    start, count, plist = roiaware_pool3d_map(rois, pts, out, 4, backend="reference")
    V = math.prod(out)
    assert start.shape == (V,) and count.shape == (V,)
    assert int(count[-1]) > 0  # the points at the +x face: the last voxel


def test_native_voxel_index_stays_below_out_size_above_2_pow_24():
    device = native_gpu_device()
    rois, pts, out = _edge_voxel_inputs()
    got = roiaware_pool3d_map(rois.to(device), pts.to(device), out, 4, backend="native")
    want = roiaware_pool3d_map(rois, pts, out, 4, backend="reference")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r, p, f: roiaware_pool3d(r[:, :6], p, f, 4), r"rois must be \[\*, 7\]"),
        (lambda r, p, f: roiaware_pool3d(r, p, f[:-1], 4), r"pts_feature must be \[1500, \*\]"),
        (lambda r, p, f: roiaware_pool3d(r, p.double(), f, 4), "pts must have the dtype"),
        (lambda r, p, f: roiaware_pool3d(r, p, f, 0), "out_size must be >= 1"),
        (lambda r, p, f: roiaware_pool3d(r, p, f, (2, 2)), "out_size must be an int or 3 ints"),
        (lambda r, p, f: roiaware_pool3d(r, p, f, 4, 0), "max_pts_per_voxel must be >= 1"),
        (lambda r, p, f: roiaware_pool3d(r, p, f, 4, 128, "sum"), "mode must be 'max' or 'avg'"),
        (lambda r, p, f: RoIAwarePool3d(4, mode="min"), "mode must be 'max' or 'avg'"),
    ],
)
def test_bad_arguments_name_the_argument(inputs, call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call(*inputs)


# ------------------------------------------------------------------------------ native (GPU)


def _reference(rois, pts, feats, out, K, mode):
    """roiaware_pool3d's reference with its pooling step on the CPU: the reference map on the
    inputs' device (that device's sinf / cosf, as the kernels), then the reference pooling
    (element-wise float32 in list order: the same result on either device) on CPU copies. On
    the GPU that pooling is a loop of max_pts_per_voxel steps of GPU ops, which took over 120 s
    per case under compute-sanitizer (H200, 2026-12-01). Returns (pooled, the CPU features)."""
    mapping = roiaware_pool3d_map(rois, pts, out, K, backend="reference")
    host = feats.detach().cpu().requires_grad_(feats.requires_grad)
    code = {"max": 0, "avg": 1}[mode]
    pooled = roiaware_pool3d_pool(host, *(t.cpu() for t in mapping), out, code, backend="reference")
    return pooled, host


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["max", "avg"])
def test_native_equals_reference(dtype, mode):
    device = native_gpu_device()
    rois, pts = _roi_inputs(100000, 128, seed=3)
    feats = torch.randn(100000, 16)
    args = (rois.to(device, dtype), pts.to(device, dtype), feats.to(device, dtype))
    # 2049 = the native kernels' largest max_pts_per_voxel (a 2048-key shared-memory sort)
    for out, K in ((14, 128), ((6, 4, 2), 2049), (4, 2)):
        got = roiaware_pool3d(*args, out, K, mode, backend="native")
        want, _ = _reference(*args, out, K, mode)
        assert torch.equal(got.cpu().nan_to_num(), want.nan_to_num()), (out, K)
    with pytest.raises(DispatchError, match="max_pts_per_voxel = 3000 exceeds"):
        roiaware_pool3d(*args, (6, 4, 2), 3000, mode, backend="native")
    small = (args[0][:8], args[1][:5000], args[2][:5000])  # the fallback's result, not its speed
    auto = roiaware_pool3d(*small, (6, 4, 2), 3000, mode)  # auto: the reference, with the reason
    want, _ = _reference(*small, (6, 4, 2), 3000, mode)
    assert torch.equal(auto.cpu().nan_to_num(), want.nan_to_num())
    mg = roiaware_pool3d_map(args[0], args[1], 14, 128, backend="native")
    mr = roiaware_pool3d_map(args[0], args[1], 14, 128, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(mg, mr))


def test_native_backward_and_big_voxels():
    device = native_gpu_device()
    rois, pts = _roi_inputs(200000, 32, seed=4)
    rois[:4, 3:6] *= 6  # huge RoIs: thousands of points per voxel (the block sort path)
    feats = torch.randn(200000, 8, device=device)
    rois, pts = rois.to(device), pts.to(device)
    for mode in ("max", "avg"):
        f = feats.clone().requires_grad_(True)
        out = roiaware_pool3d(rois, pts, f, 3, 2049, mode, backend="native")
        (g,) = torch.autograd.grad(out, f, torch.ones_like(out))
        want, host = _reference(rois, pts, feats.clone().requires_grad_(True), 3, 2049, mode)
        (want_g,) = torch.autograd.grad(want, host, torch.ones_like(want))
        outs = [(out.cpu(), g.cpu()), (want, want_g)]
        assert torch.equal(outs[0][0], outs[1][0])
        assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-5)  # float32 atomics


@pytest.mark.parametrize("channels", [3, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_backward_channel_groups(channels, dtype):
    """The backward's thread per (cell, 4 channels) (C % 4 == 0) or per (cell, channel), empty
    cells skipped before their gradient is read: random gradients with exact zeros (skipped
    atomics), both modes, against the reference's index_add."""
    device = native_gpu_device()
    rois, pts = _roi_inputs(30000, 24, seed=channels)
    feats = torch.randn(30000, channels).to(dtype)
    rois, pts = rois.to(device), pts.to(device)
    g = torch.Generator().manual_seed(channels)
    for mode in ("max", "avg"):
        f = feats.to(device, copy=True).requires_grad_(True)
        host_in = feats.clone().requires_grad_(True)
        out = roiaware_pool3d(rois, pts, f, (5, 4, 3), 64, mode, backend="native")
        grad = torch.randn(out.shape, generator=g)
        grad[grad.abs() < 0.3] = 0.0
        (got,) = torch.autograd.grad(out, f, grad.to(device, dtype))
        want, host = _reference(rois, pts, host_in, (5, 4, 3), 64, mode)
        (want_g,) = torch.autograd.grad(want, host, grad.to(dtype))
        assert torch.equal(out.cpu(), want)
        tol = 1e-5 if dtype == torch.float32 else 4e-3  # float32 atomics, then the dtype
        assert_close(got.cpu().float(), want_g.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("channels", [4, 16, 5])
def test_native_max_backward_with_and_without_the_saved_argmax(channels):
    """The max forward of a pts_feature that needs a gradient saves its winners (SAVED_ARGMAX),
    and the backward loads them; without the entry (cleared) the backward walks the slices as
    before. Both equal the reference's gradient (the same adds, in an atomic order)."""
    from mu_space.ops import roiaware as ra

    device = native_gpu_device()
    rois, pts = _roi_inputs(30000, 24, seed=7)
    feats = torch.randn(30000, channels)
    rois, pts = rois.to(device), pts.to(device)
    grad = torch.randn(24, 5, 4, 3, channels, generator=torch.Generator().manual_seed(8))
    want, host = _reference(rois, pts, feats.clone().requires_grad_(True), (5, 4, 3), 64, "max")
    (want_g,) = torch.autograd.grad(want, host, grad)
    got = []
    for saved in (True, False):
        f = feats.to(device, copy=True).requires_grad_(True)
        out = roiaware_pool3d(rois, pts, f, (5, 4, 3), 64, "max", backend="native")
        assert len(ra.SAVED_ARGMAX._entries) > 0
        if not saved:
            ra.SAVED_ARGMAX._entries.clear()
        (g,) = torch.autograd.grad(out, f, grad.to(device))
        got.append(g.cpu())
    for g in got:
        assert_close(g, want_g, atol=1e-5, rtol=1e-5)  # float32 atomics


def test_saved_argmax_entry_lives_with_its_inputs_and_versions():
    """SAVED_ARGMAX answers only for the same four tensor objects, unmodified (versions), and
    drops an entry when its slice tensors are freed."""
    import gc

    from mu_space.ops._tensor_cache import SavedForBackward

    saved = SavedForBackward()
    inputs = [torch.zeros(3, 2), torch.zeros(4, dtype=torch.long), torch.zeros(4), torch.zeros(5)]
    argmax = torch.zeros(4, 2, dtype=torch.int32)
    saved.put(tuple(inputs), argmax)
    assert saved.get(tuple(inputs)) is argmax
    assert saved.get((inputs[0].clone(), *inputs[1:])) is None
    inputs[0].add_(1)  # in place: stale
    assert saved.get(tuple(inputs)) is None
    saved.put(tuple(inputs), argmax)
    inputs[1] = None  # the slice tensor freed: the entry goes with it
    gc.collect()
    assert len(saved._entries) == 0
    for _ in range(saved.MAX_ENTRIES + 3):
        saved.put((torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)), argmax)
    assert len(saved._entries) <= saved.MAX_ENTRIES
