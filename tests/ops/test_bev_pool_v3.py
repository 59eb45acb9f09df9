"""bev_pool_v3 (DrivingSDK API: unsorted ranks, no intervals; v1 mode with 2-D ranks_bev).
Reference tests always; the native composition with contract fakes on CPU; native (GPU) tests
skip without a GPU.

Inputs: BEVDet-style ranks from real frustum geometry, not sorted, usually shuffled
(mu_space.testing.bev_pool_inputs.bevdet_ranks).
"""

import pytest
import torch

from mu_space.ops.bev_pool import bev_pool
from mu_space.ops.bev_pool_v3 import bev_pool_v3, bev_pool_v3_reference
from mu_space.testing.bev_pool_inputs import bevdet_ranks, bevfusion_inputs
from tests.helpers import (
    assert_close,
    native_gpu_device,
    poisoned_allocations,
    synchronize,
    tolerance,
)
from tests.ops import _bev_fakes


def loop_bev_pool_v3(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape):
    """Independent straightforward computation, float64: one Python loop over the points."""
    B, Z, Y, X, C = bev_feat_shape
    out = torch.zeros(B * Z * Y * X, C, dtype=torch.float64)
    f = feat.detach().double().cpu().reshape(-1, C)
    d = None if depth is None else depth.detach().double().cpu().reshape(-1)
    n = ranks_bev.shape[0]
    for i in range(n):
        if ranks_bev.dim() == 2:
            h, w, z, b = ranks_bev[i].tolist()
            if not (0 <= h < Y and 0 <= w < X and 0 <= z < Z and 0 <= b < B):
                continue
            cell = ((b * Z + z) * Y + h) * X + w
        else:
            cell = int(ranks_bev[i])
            if not 0 <= cell < B * Z * Y * X:
                continue
        row = i if ranks_feat is None else int(ranks_feat[i])
        if not 0 <= row < f.shape[0]:
            continue
        weight = 1.0
        if d is not None:
            j = int(ranks_depth[i])
            if not 0 <= j < d.shape[0]:
                continue
            weight = d[j]
        out[cell] += weight * f[row]
    return out.view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3)


def args_of(a):
    return (
        a["depth"],
        a["feat"],
        a["ranks_depth"],
        a["ranks_feat"],
        a["ranks_bev"],
        a["bev_feat_shape"],
    )


# ---------------------------------------------------------------- reference path


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_reference_matches_loop_on_frustum_geometry(batch, shuffle):
    a = bevdet_ranks("tiny", batch=batch, shuffle=shuffle, dtype=torch.float64)
    got = bev_pool_v3(*args_of(a))
    B, Z, Y, X, C = a["bev_feat_shape"]
    assert got.shape == (B, C, Z, Y, X) and got.dtype == torch.float64 and got.is_contiguous()
    assert_close(got, loop_bev_pool_v3(*args_of(a)), **tolerance(torch.float64))
    assert (got != 0).any(dim=1).sum() > 100
    assert torch.equal(bev_pool_v3_reference(*args_of(a)), got)


def test_unsorted_equals_sorted():
    a = bevdet_ranks("tiny", batch=2, shuffle=True, dtype=torch.float64)
    order = torch.sort(a["ranks_bev"].long(), stable=True).indices
    sorted_args = (
        a["depth"],
        a["feat"],
        a["ranks_depth"][order],
        a["ranks_feat"][order],
        a["ranks_bev"][order],
        a["bev_feat_shape"],
    )
    assert_close(bev_pool_v3(*args_of(a)), bev_pool_v3(*sorted_args), atol=1e-12, rtol=1e-12)


def test_layout_one_point():
    """bev_feat_shape (B, Z, Y, X, C), ranks_bev ((b*Z + z)*Y + y)*X + x -> out[b, :, z, y, x]."""
    B, Z, Y, X, C = 2, 3, 4, 5, 2
    depth = torch.zeros(7)
    depth[6] = 0.5
    feat = torch.zeros(3, C)
    feat[1] = torch.tensor([2.0, -4.0])
    b, z, y, x = 1, 2, 3, 4
    cell = ((b * Z + z) * Y + y) * X + x
    out = bev_pool_v3(
        depth,
        feat,
        torch.tensor([6], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([cell], dtype=torch.int32),
        (B, Z, Y, X, C),
    )
    assert torch.equal(out[b, :, z, y, x], torch.tensor([1.0, -2.0]))
    out[b, :, z, y, x] = 0
    assert not out.any()


def test_v1_mode_is_bevfusion_bev_pool():
    """DrivingSDK v1 mode: depth = ranks_depth = ranks_feat = None, ranks_bev[n, 4] = (h, w, d, b)."""
    a = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True, dtype=torch.float64)
    shape = (a["B"], a["D"], a["H"], a["W"], a["feats"].shape[1])
    for coords in (a["coords"], a["coords"].int()):
        got = bev_pool_v3(None, a["feats"], None, None, coords, shape)
        assert torch.equal(got, bev_pool(a["feats"], a["coords"], a["B"], a["D"], a["H"], a["W"]))
        assert_close(
            got,
            loop_bev_pool_v3(None, a["feats"], None, None, coords, shape),
            atol=1e-12,
            rtol=1e-12,
        )


def test_drivingsdk_v1_example():
    """DrivingSDK's documented v1 call: 4 points in 4 batches, bev_feat_shape [4, 1, 128, 128, C]."""
    feat = torch.rand(4, 8)
    geom = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 3]], dtype=torch.int32)
    out = bev_pool_v3(None, feat, None, None, geom, [4, 1, 128, 128, 8])
    assert out.shape == (4, 8, 1, 128, 128)
    assert torch.equal(out[:, :, 0, 0, 0], feat)
    out[:, :, 0, 0, 0] = 0
    assert not out.any()


def test_no_depth_with_flat_ranks_and_ranks_feat():
    """Extension: depth=None, 1-D ranks_bev and a ranks_feat: weight-1 pooling of gathered rows."""
    a = bevdet_ranks("tiny", batch=2, shuffle=True, dtype=torch.float64)
    got = bev_pool_v3(None, a["feat"], None, a["ranks_feat"], a["ranks_bev"], a["bev_feat_shape"])
    want = loop_bev_pool_v3(
        None, a["feat"], None, a["ranks_feat"], a["ranks_bev"], a["bev_feat_shape"]
    )
    assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_out_of_range_indices_are_dropped_and_validate_raises():
    a = bevdet_ranks("tiny", batch=2, shuffle=True, dtype=torch.float64)
    n_cells = torch.Size(a["bev_feat_shape"][:4]).numel()
    rd, rf, rb = a["ranks_depth"].clone(), a["ranks_feat"].clone(), a["ranks_bev"].clone()
    rb[0], rb[1], rd[2], rd[3], rf[4], rf[5] = -1, n_cells, -5, a["depth"].numel(), -1, 2**31 - 1
    args = (a["depth"], a["feat"], rd, rf, rb, a["bev_feat_shape"])
    got = bev_pool_v3(*args)
    keep = torch.ones(rb.shape[0], dtype=torch.bool)
    keep[:6] = False
    want = bev_pool_v3(a["depth"], a["feat"], rd[keep], rf[keep], rb[keep], a["bev_feat_shape"])
    assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert_close(got, loop_bev_pool_v3(*args), atol=1e-12, rtol=1e-12)
    with pytest.raises(IndexError, match=rf"ranks_bev\[0\] = -1 is out of range \[0, {n_cells}\)"):
        bev_pool_v3(*args, validate=True)
    rb[:2] = 0
    with pytest.raises(IndexError, match=r"ranks_depth\[2\] = -5 is out of range"):
        bev_pool_v3(a["depth"], a["feat"], rd, rf, rb, a["bev_feat_shape"], validate=True)
    rd[2:4] = 0
    with pytest.raises(IndexError, match=r"ranks_feat\[4\] = -1 is out of range"):
        bev_pool_v3(a["depth"], a["feat"], rd, rf, rb, a["bev_feat_shape"], validate=True)
    geom = torch.tensor([[0, 0, 0, 0], [0, 7, 0, 0]], dtype=torch.int32)
    with pytest.raises(IndexError, match=r"ranks_bev\[:, 1\]\[1\] = 7 is out of range \[0, 7\)"):
        bev_pool_v3(None, torch.ones(2, 3), None, None, geom, (1, 1, 2, 7, 3), validate=True)


def test_v1_mode_drops_coordinates_out_of_their_column_range():
    geom = torch.tensor(
        [[0, 7, 0, 0], [0, 6, 0, 0], [-1, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.int32
    )
    out = bev_pool_v3(None, torch.ones(4, 3), None, None, geom, (1, 1, 2, 7, 3))
    want = torch.zeros(1, 3, 1, 2, 7)
    want[0, :, 0, 0, 6] = 1  # w == 7 did not wrap into (h=1, w=0)
    assert torch.equal(out, want)


def test_empty_and_degenerate():
    a = bevdet_ranks("tiny")
    e = torch.zeros(0, dtype=torch.int32)
    depth = a["depth"].clone().requires_grad_(True)
    feat = a["feat"].clone().requires_grad_(True)
    out = bev_pool_v3(depth, feat, e, e, e, a["bev_feat_shape"])
    assert out.shape == (1, 5, 1, 20, 20) and not out.any()
    out.sum().backward()
    assert not depth.grad.any() and not feat.grad.any()
    out = bev_pool_v3(
        None, torch.zeros(0, 4), None, None, torch.zeros(0, 4, dtype=torch.int32), (2, 1, 3, 3, 4)
    )
    assert out.shape == (2, 4, 1, 3, 3) and not out.any()
    # one point, every point in one cell
    one = bev_pool_v3(
        torch.tensor([2.0]),
        torch.tensor([[1.0, 3.0]]),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        (1, 1, 1, 2, 2),
    )
    assert torch.equal(one.flatten(), torch.tensor([0.0, 2.0, 0.0, 6.0]))
    n = 500
    idx = torch.arange(n, dtype=torch.int32)
    depth = torch.rand(n, dtype=torch.float64)
    feat = torch.randn(n, 3, dtype=torch.float64)
    out = bev_pool_v3(
        depth, feat, idx, idx, torch.full((n,), 3, dtype=torch.int32), (1, 1, 2, 2, 3)
    )
    assert_close(out[0, :, 0, 1, 1], (depth[:, None] * feat).sum(0), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    a = bevdet_ranks("tiny", batch=2, shuffle=True, dtype=dtype)
    got = bev_pool_v3(*args_of(a))
    assert got.dtype == dtype
    assert_close(got, loop_bev_pool_v3(*args_of(a)).to(dtype), **tolerance(dtype))


def test_gradcheck_float64_depth_mode():
    a = bevdet_ranks("tiny", batch=2, channels=3, shuffle=True, dtype=torch.float64)
    keep = torch.randperm(a["ranks_bev"].shape[0])[:400]
    rd, rf, rb = a["ranks_depth"][keep], a["ranks_feat"][keep], a["ranks_bev"][keep]
    rb[:3] = -1  # dropped points: zero grad
    depth = a["depth"].clone().requires_grad_(True)
    feat = a["feat"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda d, f: bev_pool_v3(d, f, rd, rf, rb, a["bev_feat_shape"]), (depth, feat)
    )


def test_gradcheck_float64_v1_mode():
    a = bevfusion_inputs("tiny", batch=2, channels=3, keep_out_of_range=True, dtype=torch.float64)
    idx = torch.randperm(a["feats"].shape[0])[:300]
    feats = a["feats"][idx].clone().requires_grad_(True)
    shape = (a["B"], a["D"], a["H"], a["W"], 3)
    assert torch.autograd.gradcheck(
        lambda f: bev_pool_v3(None, f, None, None, a["coords"][idx], shape), (feats,)
    )


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (
            lambda a: {**a, "feat": a["feat"].int()},
            TypeError,
            "feat must be a floating tensor, got int32",
        ),
        (
            lambda a: {**a, "depth": a["depth"].half()},
            TypeError,
            r"depth must have the dtype of feat \(float32\), got float16",
        ),
        (
            lambda a: {**a, "ranks_depth": a["ranks_depth"].long()},
            TypeError,
            "ranks_depth must be int32, got int64",
        ),
        (
            lambda a: {**a, "ranks_feat": a["ranks_feat"][1:]},
            ValueError,
            r"ranks_feat.shape\[0\] must be",
        ),
        (
            lambda a: {**a, "ranks_bev": a["ranks_bev"].float()},
            TypeError,
            "ranks_bev must be int32, got float32",
        ),
        (
            lambda a: {**a, "ranks_bev": a["ranks_bev"].view(-1, 1)},
            ValueError,
            r"ranks_bev.shape\[1\] must be 4",
        ),
        (
            lambda a: {**a, "ranks_depth": None},
            ValueError,
            "depth and ranks_depth must be given together",
        ),
        (
            lambda a: {**a, "ranks_feat": None},
            ValueError,
            "ranks_feat must be given when depth is given",
        ),
        (
            lambda a: {**a, "bev_feat_shape": (1, 1, 20, 20)},
            ValueError,
            "bev_feat_shape must be 5 integers",
        ),
        (
            lambda a: {**a, "bev_feat_shape": (1, 1, 20, 20, 6)},
            ValueError,
            "feat must have C = bev_feat_shape",
        ),
        (
            lambda a: {**a, "bev_feat_shape": (1, 1, -20, 20, 5)},
            ValueError,
            r"bev_feat_shape\[2\] \(Y\) must be >= 0",
        ),
        (
            lambda a: {**a, "ranks_bev": a["ranks_bev"].to("meta")},
            ValueError,
            "ranks_bev must be on cpu",
        ),
        (
            lambda a: {**a, "depth": None, "ranks_depth": None, "ranks_feat": None},
            ValueError,
            r"feat must be \[n, C\]",
        ),
        (lambda a: {**a, "feat": [1.0]}, TypeError, "feat must be a torch.Tensor, got list"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, error, message):
    a = mutate(bevdet_ranks("tiny"))
    with pytest.raises(error, match=message):
        bev_pool_v3(*args_of(a))


# ---------------------------------------------------------------- native composition, CPU fakes


def test_native_composition_with_contract_fakes(monkeypatch):
    calls = _bev_fakes.install(monkeypatch)
    a = bevdet_ranks("tiny", batch=2, shuffle=True)
    a["ranks_bev"][:2] = -1  # dropped by the sort
    depth = a["depth"].clone().requires_grad_(True)
    feat = a["feat"].clone().requires_grad_(True)
    out = bev_pool_v3(depth, feat, *args_of(a)[2:])
    assert calls.sort is not None and calls.pool is not None, "the native composition did not run"
    assert calls.pool["depth"] is depth and calls.pool["feat"] is feat
    assert calls.pool["ranks_depth"].dtype == torch.int32
    assert_close(out.double(), loop_bev_pool_v3(*args_of(a)), atol=1e-6, rtol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    rd = a["depth"].clone().requires_grad_(True)
    rf = a["feat"].clone().requires_grad_(True)
    bev_pool_v3(rd, rf, *args_of(a)[2:], backend="reference").backward(g)
    assert_close(depth.grad, rd.grad, atol=1e-6, rtol=1e-6, name="grad depth")
    assert_close(feat.grad, rf.grad, atol=1e-6, rtol=1e-6, name="grad feat")


def test_native_composition_with_the_real_primitives_reference_paths(monkeypatch):
    calls = _bev_fakes.install(monkeypatch, real=True)
    a = bevdet_ranks("tiny", batch=2, shuffle=True)
    a["ranks_bev"][:2] = -1
    depth = a["depth"].clone().requires_grad_(True)
    feat = a["feat"].clone().requires_grad_(True)
    out = bev_pool_v3(depth, feat, *args_of(a)[2:])
    assert calls.sort is not None and calls.pool is not None
    assert_close(out.double(), loop_bev_pool_v3(*args_of(a)), atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    rd = a["depth"].clone().requires_grad_(True)
    rf = a["feat"].clone().requires_grad_(True)
    bev_pool_v3(rd, rf, *args_of(a)[2:], backend="reference").backward(g)
    assert_close(depth.grad, rd.grad, atol=1e-5, rtol=1e-5, name="grad depth")
    assert_close(feat.grad, rf.grad, atol=1e-5, rtol=1e-5, name="grad feat")


def test_native_composition_rows_mode_with_bad_flat_cells(monkeypatch):
    """depth = ranks_feat = None with a 1-D ranks_bev: the row-gather backward must drop cells
    outside [0, B*Z*Y*X) (not just -1) without indexing out of bounds."""
    calls = _bev_fakes.install(monkeypatch)
    shape = (2, 1, 3, 4, 5)
    n_cells = 24
    ranks_bev = torch.tensor([0, 5, 5, -1, n_cells, 2**31 - 1, 23, -7], dtype=torch.int32)
    feat = torch.randn(8, 5, requires_grad=True)
    out = bev_pool_v3(None, feat, None, None, ranks_bev, shape)
    assert calls.pool is not None
    g = torch.randn_like(out)
    out.backward(g)
    ref_feat = feat.detach().clone().requires_grad_(True)
    ref = bev_pool_v3(None, ref_feat, None, None, ranks_bev, shape, backend="reference")
    ref.backward(g)
    assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(feat.grad, ref_feat.grad)
    assert not feat.grad[3:6].any() and not feat.grad[7].any()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph_native_composition(monkeypatch, backend):
    """Depth mode under torch.compile(fullgraph=True): sort_by_cell's custom op (data-dependent
    size), the rank permutation and bev_pool_v2's custom op with its autograd. On CPU through the
    primitives' reference paths."""
    _bev_fakes.install_reference_primitives(monkeypatch)
    torch._dynamo.reset()
    try:
        a = bevdet_ranks("tiny", batch=2, shuffle=True)
        fn = torch.compile(lambda *args: bev_pool_v3(*args), backend=backend, fullgraph=True)
        depth = a["depth"].clone().requires_grad_(True)
        feat = a["feat"].clone().requires_grad_(True)
        out = fn(depth, feat, *args_of(a)[2:])
        assert_close(out, bev_pool_v3(*args_of(a), backend="reference"), atol=1e-5, rtol=1e-5)
        g = torch.randn_like(out)
        out.backward(g)
        rd = a["depth"].clone().requires_grad_(True)
        rf = a["feat"].clone().requires_grad_(True)
        bev_pool_v3(rd, rf, *args_of(a)[2:], backend="reference").backward(g)
        assert_close(depth.grad, rd.grad, atol=1e-5, rtol=1e-5, name="grad depth")
        assert_close(feat.grad, rf.grad, atol=1e-5, rtol=1e-5, name="grad feat")
    finally:
        torch._dynamo.reset()


def test_native_composition_v1_mode_with_contract_fakes(monkeypatch):
    calls = _bev_fakes.install(monkeypatch)
    v1 = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True)
    shape = (v1["B"], v1["D"], v1["H"], v1["W"], v1["feats"].shape[1])
    out = bev_pool_v3(None, v1["feats"], None, None, v1["coords"].int(), shape)
    assert calls.pool["depth"] is None and calls.pool["ranks_feat"].dtype == torch.int32
    assert_close(
        out.double(),
        loop_bev_pool_v3(None, v1["feats"], None, None, v1["coords"], shape),
        atol=1e-6,
        rtol=1e-6,
    )


# ---------------------------------------------------------------- native (GPU)

# (config, batch, channels): BEVDet configs, odd channel counts, B > 1; ranks shuffled.
GPU_CASES = [
    ("tiny", 1, None),
    ("bevdet-r50", 1, None),
    ("bevdet-r50", 2, 3),
    ("bevdet-r50", 1, 67),
    ("bevdet-r50-d88", 1, None),
    ("bevdet-d118", 2, 80),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _want(a, dtype):
    """float64 reference rounded once to dtype (native: float32 accumulation, TOLERANCES)."""
    d, f = a["depth"].double(), a["feat"].double()
    return bev_pool_v3_reference(d, f, *args_of(a)[2:]).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg, batch, channels", GPU_CASES)
def test_native_matches_reference(cfg, batch, channels, dtype):
    device = native_gpu_device()
    a = bevdet_ranks(cfg, batch=batch, channels=channels, dtype=dtype, device=device, shuffle=True)
    with poisoned_allocations(device):
        got = bev_pool_v3(*args_of(a), backend="native")
    assert got.dtype == dtype and got.is_contiguous()
    assert_close(got, _want(a, dtype), **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_backward_matches_reference(dtype):
    device = native_gpu_device()
    a = bevdet_ranks("bevdet-r50", batch=2, channels=67, dtype=dtype, device=device, shuffle=True)
    depth = a["depth"].clone().requires_grad_(True)
    feat = a["feat"].clone().requires_grad_(True)
    out = bev_pool_v3(depth, feat, *args_of(a)[2:], backend="native")
    g = torch.randn_like(out)
    out.backward(g)
    rd = a["depth"].double().requires_grad_(True)
    rf = a["feat"].double().requires_grad_(True)
    bev_pool_v3_reference(rd, rf, *args_of(a)[2:]).backward(g.double())
    # grad depth sums C products, grad feat sums up to D products: float32 accumulation
    assert_close(depth.grad, rd.grad.to(dtype), **tolerance(dtype), name="grad depth")
    assert_close(feat.grad, rf.grad.to(dtype), **tolerance(dtype), name="grad feat")


@pytest.mark.gpu
def test_native_v1_mode_matches_bev_pool():
    device = native_gpu_device()
    v1 = bevfusion_inputs("bevfusion-cam", device=device, keep_out_of_range=True)
    shape = (v1["B"], v1["D"], v1["H"], v1["W"], v1["feats"].shape[1])
    feats = v1["feats"].clone().requires_grad_(True)
    got = bev_pool_v3(None, feats, None, None, v1["coords"].int(), shape, backend="native")
    assert torch.equal(got, bev_pool(v1["feats"], v1["coords"], *shape[:4], backend="native"))
    got.backward(torch.ones_like(got))
    assert feats.grad.sum() > 0


@pytest.mark.gpu
def test_native_bad_indices_never_crash():
    device = native_gpu_device()
    a = bevdet_ranks("bevdet-r50", device=device, shuffle=True)
    rd, rf, rb = a["ranks_depth"].clone(), a["ranks_feat"].clone(), a["ranks_bev"].clone()
    rb[:100] = -7
    rb[100:200] = 2**31 - 1
    rd[200:300] = 2**31 - 1
    rf[300:400] = -1
    args = (a["depth"], a["feat"], rd, rf, rb, a["bev_feat_shape"])
    got = bev_pool_v3(*args, backend="native")
    synchronize(device)  # an illegal access would surface here
    keep = torch.ones(rb.shape[0], dtype=torch.bool, device=device)
    keep[:400] = False
    want = bev_pool_v3(
        a["depth"], a["feat"], rd[keep], rf[keep], rb[keep], a["bev_feat_shape"], backend="native"
    )
    assert_close(got, want, **tolerance(torch.float32))
    with pytest.raises(IndexError, match="ranks_bev"):
        bev_pool_v3(*args, backend="native", validate=True)


@pytest.mark.gpu
def test_native_edge_cases():
    device = native_gpu_device()
    e = torch.zeros(0, dtype=torch.int32, device=device)
    a = bevdet_ranks("tiny", device=device)
    assert not bev_pool_v3(
        a["depth"], a["feat"], e, e, e, a["bev_feat_shape"], backend="native"
    ).any()
    n = 100_000
    idx = torch.arange(n, dtype=torch.int32, device=device)
    depth = torch.rand(n, device=device)
    feat = torch.randn(n, 3, device=device)
    out = bev_pool_v3(
        depth,
        feat,
        idx,
        idx,
        torch.full((n,), 3, dtype=torch.int32, device=device),
        (1, 1, 2, 2, 3),
        backend="native",
    )
    # float32 sum of 1e5 products of magnitude <~1 (partial sums ~100): rounding ~1e-2 at most
    assert_close(
        out[0, :, 0, 1, 1].double(),
        (depth[:, None].double() * feat.double()).sum(0),
        atol=5e-2,
        rtol=1e-5,
    )


@pytest.mark.gpu
def test_native_forward_is_deterministic_and_order_independent():
    device = native_gpu_device()
    a = bevdet_ranks("bevdet-r50", device=device, shuffle=True)
    first = bev_pool_v3(*args_of(a), backend="native")
    for _ in range(3):
        assert torch.equal(bev_pool_v3(*args_of(a), backend="native"), first)
    # the stable sort keeps the points of a cell in index order, so a different shuffle of the
    # same points may sum in another order: equal up to float32 rounding
    perm = torch.randperm(a["ranks_bev"].shape[0], device=device)
    again = bev_pool_v3(
        a["depth"],
        a["feat"],
        a["ranks_depth"][perm],
        a["ranks_feat"][perm],
        a["ranks_bev"][perm],
        a["bev_feat_shape"],
        backend="native",
    )
    assert_close(again, first, **tolerance(torch.float32))


@pytest.mark.gpu
def test_native_backward_deterministic_when_requested():
    device = native_gpu_device()
    a = bevdet_ranks("bevdet-r50", device=device, shuffle=True)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            depth = a["depth"].clone().requires_grad_(True)
            feat = a["feat"].clone().requires_grad_(True)
            out = bev_pool_v3(depth, feat, *args_of(a)[2:], backend="native")
            out.backward(torch.ones_like(out))
            grads.append((depth.grad, feat.grad))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
