"""bev_pool (BEVFusion API). Reference tests always; the native composition with contract fakes on
CPU; native (GPU) tests skip without a GPU.

Inputs come from real frustum geometry built the way BEVFusion's vtransform builds them
(mu_space.testing.bev_pool_inputs.bevfusion_inputs).
"""

import pytest
import torch

from mu_space.ops import _bev, _opdef
from mu_space.ops.bev_pool import bev_pool, bev_pool_cells, bev_pool_reference
from mu_space.runtime import kernel_dispatch, native
from mu_space.runtime.device import stream_handle
from mu_space.testing.bev_pool_inputs import bevfusion_inputs
from tests.helpers import assert_close, native_gpu_device, poisoned_allocations, tolerance
from tests.ops import _bev_fakes


def loop_bev_pool(feats, coords, B, D, H, W):
    """Independent straightforward computation: one Python loop over the points, float64."""
    out = torch.zeros(B, feats.shape[1], D, H, W, dtype=torch.float64)
    for (x, y, z, b), f in zip(coords.tolist(), feats.detach().double().cpu()):
        if 0 <= x < H and 0 <= y < W and 0 <= z < D and 0 <= b < B:
            out[b, :, z, x, y] += f
    return out


def args_of(a):
    return a["feats"], a["coords"], a["B"], a["D"], a["H"], a["W"]


# ---------------------------------------------------------------- reference path


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("keep_out_of_range", [False, True])
def test_reference_matches_loop_on_frustum_geometry(batch, keep_out_of_range):
    a = bevfusion_inputs(
        "tiny", batch=batch, keep_out_of_range=keep_out_of_range, dtype=torch.float64
    )
    got = bev_pool(*args_of(a))
    want = loop_bev_pool(*args_of(a))
    assert got.shape == (batch, 5, a["D"], a["H"], a["W"]) and got.dtype == torch.float64
    assert got.is_contiguous()
    assert_close(got, want, **tolerance(torch.float64))
    assert (got != 0).any(dim=1).sum() > 100  # the geometry really fills the grid
    assert torch.equal(bev_pool_reference(*args_of(a)), got)


def test_float32_reference_matches_loop():
    a = bevfusion_inputs("tiny", batch=2)
    # float32 sums of up to ~100 products of magnitude <= ~4: error ~1e-6
    assert_close(bev_pool(*args_of(a)).double(), loop_bev_pool(*args_of(a)), atol=1e-5, rtol=1e-5)


def test_output_layout_matches_bevfusion():
    """coords (x, y, z, b): x indexes H, y indexes W, z indexes D -> out[b, :, z, x, y]."""
    feats = torch.tensor([[1.0, 2.0, 3.0]])
    coords = torch.tensor([[3, 1, 1, 1]])
    out = bev_pool(feats, coords, 2, 2, 4, 5)
    assert out.shape == (2, 3, 2, 4, 5)
    assert torch.equal(out[1, :, 1, 3, 1], feats[0])
    out[1, :, 1, 3, 1] = 0
    assert not out.any()


def test_every_point_in_one_cell_sums():
    feats = torch.randn(1000, 7, dtype=torch.float64)
    coords = torch.tensor([[2, 0, 0, 0]]).expand(1000, 4)
    out = bev_pool(feats, coords, 1, 1, 3, 2)
    assert_close(out[0, :, 0, 2, 0], feats.sum(0), atol=1e-12, rtol=1e-12)
    out[0, :, 0, 2, 0] = 0
    assert not out.any()


def test_out_of_range_coords_are_dropped_per_column():
    """Any coordinate outside its dimension drops the point; y == W must not wrap into x + 1."""
    B, D, H, W = 2, 1, 3, 4
    bad = [
        [-1, 0, 0, 0],
        [H, 0, 0, 0],
        [0, -1, 0, 0],
        [0, W, 0, 0],
        [0, 0, -1, 0],
        [0, 0, D, 0],
        [0, 0, 0, -1],
        [0, 0, 0, B],
        [2**40, 0, 0, 0],
        [-(2**40), 3, 0, 1],
    ]
    coords = torch.tensor(bad + [[1, 2, 0, 1]])
    feats = torch.arange(1, len(bad) + 2, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    out = bev_pool(feats, coords, B, D, H, W)
    want = torch.zeros(B, 3, D, H, W)
    want[1, :, 0, 1, 2] = float(len(bad) + 1)
    assert torch.equal(out, want)
    # int32 coords (DrivingSDK style), the in-int32-range bad rows only
    assert torch.equal(
        bev_pool(feats[:8], coords.int()[:8], B, D, H, W), torch.zeros(B, 3, D, H, W)
    )


def test_empty_input_and_empty_grid():
    feats = torch.zeros(0, 5, requires_grad=True)
    out = bev_pool(feats, torch.zeros(0, 4, dtype=torch.int64), 2, 1, 3, 4)
    assert out.shape == (2, 5, 1, 3, 4) and not out.any()
    out.sum().backward()
    assert feats.grad.shape == (0, 5)
    assert bev_pool(torch.randn(4, 3), torch.zeros(4, 4, dtype=torch.int32), 0, 1, 3, 4).shape == (
        0,
        3,
        1,
        3,
        4,
    )
    assert bev_pool(torch.randn(4, 0), torch.zeros(4, 4, dtype=torch.int32), 1, 1, 3, 4).shape == (
        1,
        0,
        1,
        3,
        4,
    )


def test_one_point():
    out = bev_pool(
        torch.tensor([[5.0, -1.0]]), torch.tensor([[0, 0, 0, 0]], dtype=torch.int32), 1, 1, 1, 1
    )
    assert torch.equal(out, torch.tensor([5.0, -1.0]).view(1, 2, 1, 1, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    a = bevfusion_inputs("tiny", batch=2, dtype=dtype)
    got = bev_pool(*args_of(a))
    assert got.dtype == dtype
    want = loop_bev_pool(*args_of(a)).to(dtype)  # exact sum, one rounding
    assert_close(got, want, **tolerance(dtype))


def test_result_does_not_depend_on_point_order():
    a = bevfusion_inputs("tiny", batch=2, dtype=torch.float64)
    perm = torch.randperm(a["feats"].shape[0])
    assert_close(
        bev_pool(a["feats"][perm], a["coords"][perm], a["B"], a["D"], a["H"], a["W"]),
        bev_pool(*args_of(a)),
        atol=1e-12,
        rtol=1e-12,
    )


def test_gradcheck_float64():
    a = bevfusion_inputs("tiny", batch=2, channels=3, dtype=torch.float64, keep_out_of_range=True)
    idx = torch.randperm(a["feats"].shape[0])[:300]
    feats = a["feats"][idx].clone().requires_grad_(True)
    coords = a["coords"][idx]
    assert torch.autograd.gradcheck(
        lambda f: bev_pool(f, coords, a["B"], a["D"], a["H"], a["W"]), (feats,)
    )


def test_grad_is_the_output_grad_at_each_points_cell():
    a = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True, dtype=torch.float64)
    feats = a["feats"].clone().requires_grad_(True)
    out = bev_pool(feats, a["coords"], a["B"], a["D"], a["H"], a["W"])
    g = torch.randn_like(out)
    out.backward(g)
    x, y, z, b = a["coords"].unbind(1)
    ok = (
        (x >= 0)
        & (x < a["H"])
        & (y >= 0)
        & (y < a["W"])
        & (z >= 0)
        & (z < a["D"])
        & (b >= 0)
        & (b < a["B"])
    )
    assert (~ok).any()
    want = torch.zeros_like(feats)
    want[ok] = g.permute(0, 2, 3, 4, 1)[b[ok], z[ok], x[ok], y[ok]]
    assert torch.equal(feats.grad, want)


def test_accepts_zero_dim_tensor_dims_like_bevfusion():
    """BEVFusion passes `self.nx[2], self.nx[0], self.nx[1]` (0-d LongTensor elements)."""
    a = bevfusion_inputs("tiny")
    nx = torch.tensor([a["H"], a["W"], a["D"]])
    assert torch.equal(
        bev_pool(a["feats"], a["coords"], a["B"], nx[2], nx[0], nx[1]), bev_pool(*args_of(a))
    )


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda f, c: bev_pool(f.tolist(), c, 1, 1, 20, 20),
            TypeError,
            "feats must be a torch.Tensor, got list",
        ),
        (
            lambda f, c: bev_pool(f.int(), c, 1, 1, 20, 20),
            TypeError,
            "feats must be a floating tensor, got int32",
        ),
        (lambda f, c: bev_pool(f[:, 0], c, 1, 1, 20, 20), ValueError, "feats must be 2-D"),
        (
            lambda f, c: bev_pool(f, c.float(), 1, 1, 20, 20),
            TypeError,
            "coords must be int32 or int64, got float32",
        ),
        (lambda f, c: bev_pool(f, c[:, :3], 1, 1, 20, 20), ValueError, r"coords must be \[n, 4\]"),
        (lambda f, c: bev_pool(f, c[1:], 1, 1, 20, 20), ValueError, r"coords.shape\[0\] must be"),
        (lambda f, c: bev_pool(f, c, -1, 1, 20, 20), ValueError, "B must be >= 0, got -1"),
        (lambda f, c: bev_pool(f, c, 1, 1.5, 20, 20), TypeError, "D must be an integer, got float"),
        (lambda f, c: bev_pool(f, c.to("meta"), 1, 1, 20, 20), ValueError, "coords must be on cpu"),
        (
            lambda f, c: bev_pool(f, c, 1, 1, 20, 20, backend="triton"),
            ValueError,
            "backend must be one of",
        ),
    ],
)
def test_bad_inputs_name_the_argument(call, error, message):
    a = bevfusion_inputs("tiny")
    with pytest.raises(error, match=message):
        call(a["feats"], a["coords"])


# ---------------------------------------------------------------- native composition, CPU fakes


@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32])
def test_native_composition_with_contract_fakes(monkeypatch, int_dtype):
    calls = _bev_fakes.install(monkeypatch)
    a = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True)  # float32: a native dtype
    coords = a["coords"].to(int_dtype)
    feats = a["feats"].clone().requires_grad_(True)
    out = bev_pool(feats, coords, a["B"], a["D"], a["H"], a["W"])
    assert calls.sort is not None and calls.pool is not None, "the native composition did not run"
    assert (
        calls.sort["cell"].dtype == torch.int32 and calls.sort["backend"] == "native"
    )  # bev_pool_rows chose native
    assert calls.pool["depth"] is None and calls.pool["ranks_depth"] is None
    assert calls.pool["bev_feat_shape"] == (a["B"], a["D"], a["H"], a["W"], 5)
    assert calls.sort["n_cells"] == a["B"] * a["D"] * a["H"] * a["W"]
    # the fake sums in float64 and rounds once
    assert_close(
        out.double(),
        loop_bev_pool(feats, coords, a["B"], a["D"], a["H"], a["W"]),
        atol=1e-6,
        rtol=1e-6,
    )
    g = torch.randn_like(out)
    out.backward(g)
    ref_feats = a["feats"].clone().requires_grad_(True)
    bev_pool(ref_feats, coords, a["B"], a["D"], a["H"], a["W"], backend="reference").backward(g)
    assert torch.equal(feats.grad, ref_feats.grad)
    assert ("bev_pool", "cpu", "native") in {
        (r["op"], r["backend"], r["reason"]) for r in kernel_dispatch.records()
    }


def test_native_composition_with_the_real_primitives_reference_paths(monkeypatch):
    """The same composition with the real sort_by_cell (and bev_pool_v2 once it exists) on
    their reference paths: catches a mismatch between the contract and the real modules."""
    calls = _bev_fakes.install(monkeypatch, real=True)
    a = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True)
    feats = a["feats"].clone().requires_grad_(True)
    out = bev_pool(feats, a["coords"], a["B"], a["D"], a["H"], a["W"])
    assert calls.sort is not None and calls.pool is not None
    assert_close(out.double(), loop_bev_pool(*args_of(a)), atol=1e-5, rtol=1e-5)
    out.backward(torch.ones_like(out))
    x, y, z, b = a["coords"].unbind(1)
    ok = (
        (x >= 0)
        & (x < a["H"])
        & (y >= 0)
        & (y < a["W"])
        & (z >= 0)
        & (z < a["D"])
        & (b >= 0)
        & (b < a["B"])
    )
    assert torch.equal(feats.grad, ok.float().unsqueeze(1).expand_as(feats))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph_native_composition(monkeypatch, backend):
    """The native path under torch.compile(fullgraph=True): sort + bev_pool_v2 sit inside the
    mu_space::bev_pool_rows custom op (fixed output shape), backward is the row gather. Run on
    CPU through the primitives' reference paths."""
    _bev_fakes.install_reference_primitives(monkeypatch)
    torch._dynamo.reset()
    try:
        a = bevfusion_inputs("tiny", batch=2, keep_out_of_range=True)
        B, D, H, W = a["B"], a["D"], a["H"], a["W"]
        fn = torch.compile(lambda f, c: bev_pool(f, c, B, D, H, W), backend=backend, fullgraph=True)
        feats = a["feats"].clone().requires_grad_(True)
        out = fn(feats, a["coords"])
        assert_close(out, bev_pool(*args_of(a), backend="reference"), atol=1e-5, rtol=1e-5)
        out.backward(torch.ones_like(out))
        assert (
            feats.grad.sum()
            == int(
                (
                    (a["coords"] >= 0).all(1)
                    & (a["coords"][:, 0] < H)
                    & (a["coords"][:, 1] < W)
                    & (a["coords"][:, 2] < D)
                    & (a["coords"][:, 3] < B)
                ).sum()
            )
            * feats.shape[1]
        )
        rows = {(r["op"], r["backend"]) for r in kernel_dispatch.records()}
        assert ("bev_pool", "cpu") in rows  # the traced choice: native (patched)
    finally:
        torch._dynamo.reset()


def test_native_composition_sends_empty_input_to_reference(monkeypatch):
    calls = _bev_fakes.install(monkeypatch)
    out = bev_pool(torch.zeros(0, 3), torch.zeros(0, 4, dtype=torch.int64), 1, 1, 2, 2)
    assert calls.sort is None and out.shape == (1, 3, 1, 2, 2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_runs_reference_matches_the_sort_contract(dtype):
    g = torch.Generator().manual_seed(5)
    cells = torch.randint(-3, 60, (3000,), generator=g).to(dtype)
    cells[::97] = 2**40 if dtype == torch.int64 else 2**31 - 1
    r = _bev.sort_runs_reference(cells, 50)
    s = _bev_fakes.fake_sort_by_cell(cells, 50)
    for got, want in zip(
        r, (s.order, cells[s.order.long()], s.interval_starts, s.interval_lengths)
    ):
        assert got.dtype == torch.int32 and torch.equal(got, want.to(torch.int32))


# ---------------------------------------------------------------- native (GPU)

# (config, batch, channels): realistic geometry, odd channel counts, B > 1.
GPU_CASES = [
    ("tiny", 1, None),
    ("bevdet-r50", 2, 3),
    ("bevdet-r50", 1, 67),
    ("bevdet-r50-d88", 1, 80),
    ("bevfusion-cam", 1, 80),
    ("bevfusion-cam", 2, 67),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _want(a, dtype):
    """float64 reference rounded once to the output dtype: native differs by its float32
    accumulation order (fp32) or one output rounding (fp16 / bf16): TOLERANCES covers both."""
    f = a["feats"].double()
    return bev_pool_reference(f, a["coords"], a["B"], a["D"], a["H"], a["W"]).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg, batch, channels", GPU_CASES)
def test_native_matches_reference(cfg, batch, channels, dtype):
    device = native_gpu_device()
    a = bevfusion_inputs(cfg, batch=batch, channels=channels, dtype=dtype, device=device)
    with poisoned_allocations(device):
        got = bev_pool(*args_of(a), backend="native")
    assert got.dtype == dtype and got.device == device and got.is_contiguous()
    assert_close(got, _want(a, dtype), **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_backward_matches_reference(dtype):
    device = native_gpu_device()
    a = bevfusion_inputs(
        "bevdet-r50", batch=2, channels=67, dtype=dtype, device=device, keep_out_of_range=True
    )
    feats = a["feats"].clone().requires_grad_(True)
    out = bev_pool(feats, a["coords"], a["B"], a["D"], a["H"], a["W"], backend="native")
    g = torch.randn_like(out)
    out.backward(g)
    ref = a["feats"].double().requires_grad_(True)
    bev_pool_reference(ref, a["coords"], a["B"], a["D"], a["H"], a["W"]).backward(g.double())
    # each point's grad is one element of g copied: exact in every dtype
    assert_close(feats.grad, ref.grad.to(dtype), atol=0, rtol=0, name="grad feats")


@pytest.mark.gpu
def test_native_out_of_range_and_edge_cases():
    device = native_gpu_device()
    B, D, H, W = 2, 1, 3, 4
    coords = torch.tensor(
        [
            [-1, 0, 0, 0],
            [H, 0, 0, 0],
            [0, W, 0, 0],
            [0, 0, D, 0],
            [0, 0, 0, B],
            [2**40, 0, 0, 0],
            [1, 2, 0, 1],
        ],
        device=device,
    )
    feats = torch.ones(7, 67, device=device)
    out = bev_pool(feats, coords, B, D, H, W, backend="native")
    want = torch.zeros(B, 67, D, H, W, device=device)
    want[1, :, 0, 1, 2] = 1
    assert torch.equal(out, want)
    # empty, one point, every point in one cell
    assert not bev_pool(feats[:0], coords[:0], B, D, H, W, backend="native").any()
    one = bev_pool(feats[-1:] * 3, coords[-1:].int(), B, D, H, W, backend="native")
    assert torch.equal(one, want * 3)
    many = torch.randn(100_000, 3, device=device, dtype=torch.float64).float()
    same = torch.tensor([[2, 3, 0, 1]], device=device).expand(100_000, 4)
    got = bev_pool(many, same, B, D, H, W, backend="native")
    # float32 sum of 1e5 values of magnitude ~1 (partial sums ~300): rounding ~1e-2 at most
    assert_close(got[1, :, 0, 2, 3].double(), many.double().sum(0), atol=5e-2, rtol=1e-5)
    got[1, :, 0, 2, 3] = 0
    assert not got.any()


# ---------------------------------------------------------------- native steps of bev_pool's own
# (csrc/bev/bev_pool_musa.mu: the fused cells kernel and the row-gather backward)


def _cells_kernel(coords, dims, fill=0x7EADBEEF):
    """bev_pool_cells_forward into an output pre-filled with a value no cell takes."""
    cells = torch.full((coords.shape[0],), fill, dtype=torch.int32, device=coords.device)
    native.function("bev_pool_cells_forward")(coords, cells, *dims, stream_handle(coords))
    return cells


@pytest.mark.gpu
@pytest.mark.parametrize("int_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("cfg, batch", [("bevfusion-cam", 1), ("bevdet-r50", 2), ("tiny", 2)])
def test_native_cells_match_reference(cfg, batch, int_dtype):
    device = native_gpu_device()
    a = bevfusion_inputs(cfg, batch=batch, device=device, keep_out_of_range=True)
    coords = a["coords"].to(int_dtype)
    dims = (a["B"], a["D"], a["H"], a["W"])
    want = _bev.coords_to_cells(coords, dims)
    assert bool((want < 0).any()) and bool((want >= 0).any())  # both kinds of points
    assert torch.equal(_cells_kernel(coords, dims), want)
    with _opdef.poisoned_outputs():
        assert torch.equal(bev_pool_cells(coords, *dims, backend="native"), want)
    # not 16-byte aligned: the scalar-load kernel
    flat = torch.empty(coords.numel() + 1, dtype=int_dtype, device=device)
    shifted = flat[1:].view_as(coords).copy_(coords)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(_cells_kernel(shifted, dims), want)


@pytest.mark.gpu
def test_native_cells_edge_values():
    device = native_gpu_device()
    B, D, H, W = 2, 3, 4, 5
    big = 2**40
    rows = [
        [0, 0, 0, 0],
        [H - 1, W - 1, D - 1, B - 1],
        [H, 0, 0, 0],
        [0, W, 0, 0],
        [0, 0, D, 0],
        [0, 0, 0, B],
        [-1, 0, 0, 0],
        [0, -1, 0, 0],
        [big, 0, 0, 0],
        [0, 0, 0, big + 1],  # low 32 bits = 1: must not wrap into batch 1
        [-big, 1, 1, 1],
        [1, 2, 1, 1],
    ]
    coords = torch.tensor(rows, dtype=torch.int64, device=device)
    want = _bev.coords_to_cells(coords, (B, D, H, W))
    assert torch.equal(_cells_kernel(coords, (B, D, H, W)), want)
    assert want.tolist()[:2] == [0, B * D * H * W - 1] and want.tolist()[2:11] == [-1] * 9
    # an empty grid drops every point; no points: nothing written
    assert bool((_cells_kernel(coords, (B, 0, H, W)) == -1).all())
    assert _cells_kernel(coords[:0], (B, D, H, W)).numel() == 0


# (config, batch, channels, dtype): row bytes of 16k (16-byte words), 8 (C 2 float32), 4k
# (C 67 float32, C 2 float16), 2 (C 67 / 3 float16 / bfloat16)
BACKWARD_CASES = [
    ("bevfusion-cam", 1, 80, torch.float32),
    ("bevfusion-cam", 1, 80, torch.float16),
    ("bevfusion-cam", 1, 80, torch.bfloat16),
    ("bevdet-r50", 2, 67, torch.float32),
    ("bevdet-r50", 2, 67, torch.float16),
    ("bevdet-r50", 2, 67, torch.bfloat16),
    ("bevdet-r50", 2, 2, torch.float32),
    ("bevdet-r50", 2, 2, torch.float16),
    ("bevdet-r50", 1, 3, torch.bfloat16),
    ("tiny", 2, 33, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, batch, channels, dtype", BACKWARD_CASES, ids=str)
def test_native_row_grad_kernel(cfg, batch, channels, dtype):
    """grad_feat[i] = grad_out at cell i (0 for dropped points): exact, every element written
    (poisoned outputs), bit-identical reruns, the caller's cell dtype either way."""
    device = native_gpu_device()
    a = bevfusion_inputs(
        cfg, batch=batch, channels=channels, dtype=dtype, device=device, keep_out_of_range=True
    )
    grid = _bev.Grid(a["B"], a["D"], a["H"], a["W"], a["feats"].shape[1])
    cells = _bev.coords_to_cells(a["coords"], grid[:4])
    assert bool((cells < 0).any())
    grad_out = torch.randn(grid.B, grid.C, grid.Z, grid.Y, grid.X, device=device).to(dtype)
    want = _bev.row_gather_grad(grad_out, cells, grid)
    _, row_grad, _ = _bev.native_steps()
    with _opdef.poisoned_outputs():
        got = row_grad(grad_out, cells, grid)
        again = row_grad(grad_out, cells.long(), grid)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        again.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


@pytest.mark.gpu
def test_native_row_grad_edge_cases():
    device = native_gpu_device()
    _, row_grad, _ = _bev.native_steps()
    grid = _bev.Grid(2, 1, 3, 4, 5)
    grad_out = torch.randn(2, 5, 1, 3, 4, device=device)
    # every cell out of range, huge int64 cells, the last cell
    cells = torch.tensor([-1, 24, 2**40, -(2**40), 23, 0], device=device)
    got = row_grad(grad_out, cells, grid)
    assert torch.equal(got, _bev.row_gather_grad(grad_out, cells, grid))
    assert not got[:4].any()
    # non-contiguous grad_out (an expanded one, as out.sum().backward() gives)
    g = torch.ones((), device=device).expand(2, 5, 1, 3, 4)
    assert torch.equal(row_grad(g, cells, grid), _bev.row_gather_grad(g, cells, grid))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_autograd_runs_the_row_grad_kernel(monkeypatch, dtype):
    """bev_pool's backward through the kernels (as the GPU sessions run it: unverified kernels
    allowed), at the bevfusion-cam size: exact against the float64 reference, deterministic."""
    monkeypatch.setenv("MUSPACE_TRY_UNVERIFIED", "1")
    device = native_gpu_device()
    a = bevfusion_inputs("bevfusion-cam", dtype=dtype, device=device, keep_out_of_range=True)
    dims = (a["B"], a["D"], a["H"], a["W"])
    grads = []
    for _ in range(2):
        feats = a["feats"].clone().requires_grad_(True)
        with poisoned_allocations(device):
            out = bev_pool(feats, a["coords"], *dims, backend="native")
            g = torch.randn(
                out.shape, generator=torch.Generator(device).manual_seed(1), device=device
            )
            out.backward(g.to(dtype))
        grads.append(feats.grad)
    ref = a["feats"].double().requires_grad_(True)
    bev_pool_reference(ref, a["coords"], *dims).backward(g.to(dtype).double())
    assert_close(grads[0], ref.grad.to(dtype), atol=0, rtol=0, name="grad feats")
    assert torch.equal(grads[0], grads[1])
    assert_close(out, _want(a, dtype), **tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("cfg, batch", [("bevfusion-cam", 1), ("bevdet-r50", 2), ("tiny", 1)])
def test_native_sort_runs_match_reference(cfg, batch, int_dtype):
    """torch.sort + bev_pool_runs_from_sorted: the stable order, the sorted cells and the runs
    equal the reference's exactly (poisoned outputs), on frustum cells with dropped points."""
    device = native_gpu_device()
    a = bevfusion_inputs(cfg, batch=batch, device=device, keep_out_of_range=True)
    dims = (a["B"], a["D"], a["H"], a["W"])
    n_cells = a["B"] * a["D"] * a["H"] * a["W"]
    cells = _bev.coords_to_cells(a["coords"], dims).to(int_dtype)
    if int_dtype == torch.int64:
        cells[::101] = 2**40  # above every int32 key: dropped at the top end
    want = _bev.sort_runs_reference(cells, n_cells)
    _, _, sort_runs = _bev.native_steps()
    with _opdef.poisoned_outputs():
        got = sort_runs(cells, n_cells, pad=False)
        padded = sort_runs(cells, n_cells)
    for name, g, w in zip(want._fields, got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w), name
    _assert_padded(padded, want, cells.shape[0], min(cells.shape[0], n_cells))


def _assert_padded(padded, want, n, cap):
    """The valid prefix equals want; the tails are bev_pool_prepare_padded's padding."""
    k, m = want.order.shape[0], want.interval_starts.shape[0]
    assert [t.shape[0] for t in padded] == [n, n, cap, cap]
    for name, g, w in zip(want._fields, padded, want):
        assert torch.equal(g[: w.shape[0]], w), name
    device = padded.order.device
    assert bool((padded.order[k:] == -1).all())
    pad_cells = torch.arange(2**31 - n + k, 2**31, device=device, dtype=torch.int64)
    assert torch.equal(padded.ranks_bev[k:].long(), pad_cells)
    assert not padded.interval_starts[m:].any() and not padded.interval_lengths[m:].any()


@pytest.mark.gpu
def test_native_sort_runs_edge_cases():
    device = native_gpu_device()
    _, _, sort_runs = _bev.native_steps()
    cases = [
        (torch.full((1000,), -1, dtype=torch.int32), 10),  # every point dropped
        (torch.full((1000,), 10, dtype=torch.int32), 10),  # every point at n_cells: dropped
        (torch.tensor([3], dtype=torch.int32), 10),  # one point
        (torch.full((300_000,), 7, dtype=torch.int32), 10),  # one long run
        (torch.arange(5000, dtype=torch.int32).flip(0) % 4096, 4096),  # every cell, 1 or 2 each
        (torch.randint(-5, 2**31 - 1, (50_000,), dtype=torch.int32), 2**31 - 1),  # sparse
    ]
    for cells, n_cells in cases:
        cells = cells.to(device)
        want = _bev.sort_runs_reference(cells, n_cells)
        got = sort_runs(cells, n_cells, pad=False)
        for name, g, w in zip(want._fields, got, want):
            assert torch.equal(g, w), (name, cells.shape, n_cells)
        n = cells.shape[0]
        if n + n_cells <= 2**31:
            _assert_padded(sort_runs(cells, n_cells), want, n, min(n, n_cells))


@pytest.mark.gpu
@pytest.mark.parametrize("sort", ["radix", "counting"])
def test_native_forward_both_sorts_bit_equal_reruns(monkeypatch, sort):
    """bev_pool at bevfusion-cam through the radix sort + runs step (as the GPU sessions run it:
    padded, no host sync) and through MUSPACE_BEV_POOL_ROWS_SORT=counting: each matches the
    reference and reruns are bit-identical. The two give the same order, but the padded
    arrays are longer, and bev_pool_v2's partition into blocks depends on their length: equal
    to float32 rounding, not bit for bit."""
    monkeypatch.setenv("MUSPACE_TRY_UNVERIFIED", "1")
    if sort == "counting":
        monkeypatch.setenv("MUSPACE_BEV_POOL_ROWS_SORT", "counting")
    device = native_gpu_device()
    a = bevfusion_inputs("bevfusion-cam", device=device, keep_out_of_range=True)
    with poisoned_allocations(device):
        first = bev_pool(*args_of(a), backend="native")
    assert_close(first, _want(a, torch.float32), **tolerance(torch.float32))
    assert torch.equal(first, bev_pool(*args_of(a), backend="native"))
    monkeypatch.setenv("MUSPACE_BEV_POOL_ROWS_SORT", "counting" if sort == "radix" else "radix")
    assert_close(first, bev_pool(*args_of(a), backend="native"), **tolerance(torch.float32))
