"""bev_pool_v2 (BEVDet API). Reference tests and a model of the kernels' partition logic always;
native (GPU) tests skip without a GPU.

Inputs come from real camera-frustum geometry (mu_space.testing.bev_geometry) pooled by the
reference `bev_pool_prepare`, so intervals have the real length distribution (1 .. ~500 points).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mu_space.ops.bev_pool_prepare import bev_pool_prepare_reference, sort_by_cell_reference
from mu_space.ops.bev_pool_v2 import (
    bev_pool_v2,
    bev_pool_v2_backward_reference,
    bev_pool_v2_reference,
    validate_inputs,
)
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle
from mu_space.testing import bev_geometry
from tests.helpers import (
    assert_close,
    forbid_host_sync,
    graph_capture_device,
    native_gpu_device,
    poisoned,
    synchronize,
    tolerance,
)
from tests.ops import _bev_pool_v2_model as model

bpv2 = sys.modules[
    "mu_space.ops.bev_pool_v2"
]  # the module (mu_space.ops.bev_pool_v2 is the function)


def backward(grad, args, need_depth, need_feat, deterministic, backend="native"):
    """(grad_depth, grad_feat) through the op's backward (its custom op's body): None where not
    needed."""
    schema_args = bpv2.OP.capture_schema_args(*args)
    gd, gf = bpv2.OP.run_backward(
        [grad], schema_args, [need_depth, need_feat], deterministic, backend
    )
    return gd, gf


# ---------------------------------------------------------------- inputs


@functools.lru_cache(maxsize=16)
def _ranks(config: str, batch: int):
    g = bev_geometry.make(config, batch=batch)
    r = bev_pool_prepare_reference(
        g["coor"], g["grid_lower_bound"], g["grid_interval"], g["grid_size"]
    )
    return g, r


def make_inputs(
    config="tiny", *, batch=1, channels=None, dtype=torch.float32, device="cpu", seed=0
):
    """bev_pool_v2 positional arguments from frustum geometry; C may differ from the config's."""
    g, r = _ranks(config, batch)
    cfg = g["config"]
    C = channels or cfg.channels
    gen = torch.Generator().manual_seed(seed)
    depth = g["depth"].double()
    feat = torch.randn(*g["feat"].shape[:-1], C, generator=gen, dtype=torch.float64)
    B, Z, Y, X, _ = g["bev_feat_shape"]
    args = (
        depth.to(dtype),
        feat.to(dtype),
        r.ranks_depth,
        r.ranks_feat,
        r.ranks_bev,
        (B, Z, Y, X, C),
        r.interval_starts,
        r.interval_lengths,
    )
    # copies: the ranks are cached (_ranks) and must not alias a test's CPU tensors
    return tuple(a.to(device, copy=True) if isinstance(a, torch.Tensor) else a for a in args)


def loop_bev_pool_v2(depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, starts, lengths):
    """Independent straightforward computation (BEVDet's kernel as Python loops), float64."""
    B, Z, Y, X, C = shape
    out = torch.zeros(B * Z * Y * X, C, dtype=torch.float64)
    rows = feat.detach().double().cpu().reshape(-1, C)
    w = None if depth is None else depth.detach().double().cpu().reshape(-1)
    rd = None if ranks_depth is None else ranks_depth.tolist()
    rf, rb = ranks_feat.tolist(), ranks_bev.tolist()
    for s, n in zip(starts.tolist(), lengths.tolist()):
        for i in range(s, s + n):
            out[rb[s]] += (1.0 if w is None else w[rd[i]]) * rows[rf[i]]
    return out.view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3)


def custom_ranks(cells, n_cells, *, n_feat_rows, depth_numel=None, seed=0):
    """Ranks for hand-made cases: `cells` (list) sorted here, feat rows / depth entries random."""
    gen = torch.Generator().manual_seed(seed)
    rb = torch.tensor(sorted(cells), dtype=torch.int32)
    n = rb.numel()
    rf = torch.randint(0, max(n_feat_rows, 1), (n,), generator=gen, dtype=torch.int32)
    rd = (
        None
        if depth_numel is None
        else torch.randperm(depth_numel, generator=gen)[:n].to(torch.int32)
    )
    if n:
        _, lengths = torch.unique_consecutive(rb, return_counts=True)
        starts = torch.cumsum(lengths, 0) - lengths
    else:
        starts = lengths = torch.zeros(0, dtype=torch.int64)
    return rd, rf, rb, starts.to(torch.int32), lengths.to(torch.int32)


def hand_case(
    cells, shape, *, with_depth=True, dtype=torch.float64, device="cpu", seed=0, n_frustum=None
):
    """Full argument tuple around custom_ranks: depth [1, n_frustum], feat [rows, C]."""
    B, Z, Y, X, C = shape
    n_frustum = n_frustum or max(len(cells), 1) * 2
    rows = max(len(cells), 1) + 3
    gen = torch.Generator().manual_seed(seed + 1)
    feat = torch.randn(rows, C, generator=gen, dtype=torch.float64).to(dtype)
    depth = (
        torch.rand(1, n_frustum, generator=gen, dtype=torch.float64).to(dtype)
        if with_depth
        else None
    )
    rd, rf, rb, s, l = custom_ranks(
        cells,
        B * Z * Y * X,
        n_feat_rows=rows,
        depth_numel=n_frustum if with_depth else None,
        seed=seed,
    )
    args = (depth, feat, rd, rf, rb, shape, s, l)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


# ---------------------------------------------------------------- reference path


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("with_depth", [True, False])
def test_reference_matches_loop_on_frustum_geometry(batch, with_depth):
    args = list(make_inputs("tiny", batch=batch, dtype=torch.float64))
    if not with_depth:
        args[0] = args[2] = None
    got = bev_pool_v2(*args)
    want = loop_bev_pool_v2(*args)
    B, Z, Y, X, C = args[5]
    assert got.shape == (B, C, Z, Y, X) and got.dtype == torch.float64 and got.is_contiguous()
    assert_close(got, want, **tolerance(torch.float64))
    assert (got != 0).any(dim=1).sum() > 100  # the geometry really fills the grid
    assert torch.equal(bev_pool_v2_reference(*args), got)


def test_tiny_geometry_has_real_interval_lengths():
    _, r = _ranks("tiny", 1)
    lengths = r.interval_lengths
    assert lengths.min() <= 3 and lengths.max() >= 50 and 3 < lengths.float().mean() < 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_low_precision_accumulates_in_float32(dtype):
    args = make_inputs("tiny", batch=2, channels=7, dtype=dtype)
    got = bev_pool_v2_reference(*args)
    want = loop_bev_pool_v2(*args)  # float64 of the same (rounded) inputs
    assert got.dtype == dtype
    # one rounding of the float32 sum to dtype: the dtype's own tolerance
    assert_close(got.double(), want, **tolerance(dtype))


@pytest.mark.parametrize("with_depth", [True, False])
def test_reference_gradcheck_float64(with_depth):
    args = list(hand_case([0, 0, 1, 5, 5, 5, 6, 11, 11], (2, 1, 2, 3, 3)))
    if not with_depth:
        args[0] = args[2] = None
    depth, feat = args[0], args[1]
    feat.requires_grad_(True)
    inputs = (feat,) if depth is None else (depth.requires_grad_(True), feat)

    def fn(*xs):
        d, f = (None, xs[0]) if depth is None else xs
        return bev_pool_v2_reference(d, f, *args[2:])

    assert torch.autograd.gradcheck(fn, inputs)


def test_reference_gradcheck_on_geometry():
    args = list(make_inputs("tiny", channels=2, dtype=torch.float64))
    depth, feat = args[0].requires_grad_(True), args[1].requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda d, f: bev_pool_v2_reference(d, f, *args[2:]), (depth, feat), fast_mode=True
    )


@pytest.mark.parametrize("with_depth", [True, False])
def test_autograd_through_public_api_matches_loop_gradients(with_depth):
    """bev_pool_v2 with requires_grad goes through the custom op and its registered backward."""
    args = list(make_inputs("tiny", batch=2, dtype=torch.float64))
    if not with_depth:
        args[0] = args[2] = None
    feat = args[1].requires_grad_(True)
    depth = None if args[0] is None else args[0].requires_grad_(True)
    out = bev_pool_v2(*args)
    g = torch.randn_like(out)
    out.backward(g)
    # independent: autograd through the differentiable reference (gather / index_add graph)
    d2 = None if depth is None else depth.detach().clone().requires_grad_(True)
    f2 = feat.detach().clone().requires_grad_(True)
    bev_pool_v2_reference(d2, f2, *args[2:]).backward(g)
    assert_close(feat.grad, f2.grad, **tolerance(torch.float64), name="grad_feat")
    if with_depth:
        assert_close(depth.grad, d2.grad, **tolerance(torch.float64), name="grad_depth")
        # independent check: grad_depth[rd_i] = <g[cell_i], feat[rf_i]>
        B, Z, Y, X, C = args[5]
        gcells = g.permute(0, 2, 3, 4, 1).reshape(-1, C)
        want = (gcells[args[4].long()] * feat.detach().reshape(-1, C)[args[3].long()]).sum(1)
        assert_close(depth.grad.reshape(-1)[args[2].long()], want, **tolerance(torch.float64))


@pytest.mark.parametrize("with_depth", [True, False])
@pytest.mark.parametrize("bad", [False, True])
def test_backward_reference_equals_autograd_of_reference(with_depth, bad):
    args = list(make_inputs("tiny", batch=2, dtype=torch.float64))
    if bad:  # bad entries contribute nothing in both
        for pos in (2, 3, 4):
            args[pos] = args[pos].clone()
            args[pos][::17] = -3
        args[7] = args[7].clone()
        args[7][::5] = 10**6
    if not with_depth:
        args[0] = args[2] = None
    d = None if args[0] is None else args[0].clone().requires_grad_(True)
    f = args[1].clone().requires_grad_(True)
    out = bev_pool_v2_reference(d, f, *args[2:])
    g = torch.randn_like(out)
    out.backward(g)
    gd, gf = bev_pool_v2_backward_reference(g, *args)
    assert_close(gf, f.grad, **tolerance(torch.float64), name="grad_feat")
    if with_depth:
        assert_close(gd, d.grad, **tolerance(torch.float64), name="grad_depth")
    else:
        assert gd is None


def test_edge_cases_reference():
    shape = (1, 1, 4, 5, 3)
    # empty: no points, no intervals -> zeros
    args = hand_case([], shape)
    out = bev_pool_v2(*args)
    assert out.shape == (1, 3, 1, 4, 5) and not out.any()
    # one point
    args = hand_case([7], shape)
    out = bev_pool_v2(*args)
    assert_close(out, loop_bev_pool_v2(*args), **tolerance(torch.float64))
    assert (out != 0).any(dim=1).sum() == 1
    # all points in one cell (one interval of 50)
    args = hand_case([13] * 50, shape)
    assert_close(bev_pool_v2(*args), loop_bev_pool_v2(*args), **tolerance(torch.float64))
    # C = 0 and an empty grid
    assert bev_pool_v2(*hand_case([0], (1, 1, 2, 2, 0))).shape == (1, 0, 1, 2, 2)
    assert bev_pool_v2(*hand_case([], (0, 1, 2, 2, 3))).shape == (0, 3, 1, 2, 2)


def test_points_outside_grid_are_dropped_by_prepare():
    g, r = _ranks("tiny", 1)
    B, N, D, H, W, _ = g["coor"].shape
    assert r.ranks_bev.numel() < B * N * D * H * W  # the geometry has points outside the grid
    out = bev_pool_v2(
        g["depth"].double(), g["feat"].double(), *r.bev_pool_v2_args(g["bev_feat_shape"])
    )
    # the dropped frustum points' depth does not matter: zero it, same result
    depth = torch.zeros_like(g["depth"]).double()
    flat = depth.view(-1)
    flat[r.ranks_depth.long()] = g["depth"].double().view(-1)[r.ranks_depth.long()]
    assert torch.equal(
        bev_pool_v2(depth, g["feat"].double(), *r.bev_pool_v2_args(g["bev_feat_shape"])), out
    )


def test_reference_skips_bad_indices_without_reading_out_of_bounds():
    depth, feat, rd, rf, rb, shape, s, l = hand_case([1, 1, 2, 3], (1, 1, 2, 2, 3))
    rf_bad, rd_bad, rb_bad = rf.clone(), rd.clone(), rb.clone()
    rf_bad[0], rd_bad[2], rb_bad[3] = 10**6, -5, 99
    s_bad, l_bad = s.clone(), l.clone()
    l_bad[-1] = 1000
    out = bev_pool_v2_reference(depth, feat, rd_bad, rf_bad, rb_bad, shape, s_bad, l_bad)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------- argument errors


def test_argument_errors_name_the_argument():
    depth, feat, rd, rf, rb, shape, s, l = make_inputs("tiny")
    with pytest.raises(TypeError, match="ranks_bev must be int32, got int64"):
        bev_pool_v2(depth, feat, rd, rf, rb.long(), shape, s, l)
    with pytest.raises(TypeError, match="ranks_feat must be int32, got float32"):
        bev_pool_v2(depth, feat, rd, rf.float(), rb, shape, s, l)
    with pytest.raises(TypeError, match="interval_lengths must be int32, got int64"):
        bev_pool_v2(depth, feat, rd, rf, rb, shape, s, l.long())
    with pytest.raises(
        TypeError, match=r"depth must have the dtype of feat \(float32\), got float16"
    ):
        bev_pool_v2(depth.half(), feat, rd, rf, rb, shape, s, l)
    with pytest.raises(
        TypeError, match="feat must be float32, float16, bfloat16 or float64, got int32"
    ):
        bev_pool_v2(depth, feat.int(), rd, rf, rb, shape, s, l)
    with pytest.raises(TypeError, match="feat must be a torch.Tensor"):
        bev_pool_v2(depth, feat.tolist(), rd, rf, rb, shape, s, l)
    with pytest.raises(
        ValueError, match=r"ranks_depth.shape\[0\] must be .* \(the length of ranks_bev\)"
    ):
        bev_pool_v2(depth, feat, rd[:-1], rf, rb, shape, s, l)
    with pytest.raises(ValueError, match="ranks_feat must be 1-D, got 2-D"):
        bev_pool_v2(depth, feat, rd, rf[None], rb, shape, s, l)
    with pytest.raises(
        ValueError,
        match=r"interval_lengths.shape\[0\] must be .* \(the length of interval_starts\)",
    ):
        bev_pool_v2(depth, feat, rd, rf, rb, shape, s, l[:-1])
    with pytest.raises(
        ValueError, match=r"feat must be \[..., C\] with C = bev_feat_shape\[4\] = 6"
    ):
        bev_pool_v2(depth, feat, rd, rf, rb, shape[:4] + (6,), s, l)
    with pytest.raises(
        ValueError, match=r"bev_feat_shape must be 5 integers \(B, Z, Y, X, C\), got 4 values"
    ):
        bev_pool_v2(depth, feat, rd, rf, rb, shape[:4], s, l)
    with pytest.raises(ValueError, match="depth and ranks_depth must be given together"):
        bev_pool_v2(None, feat, rd, rf, rb, shape, s, l)
    with pytest.raises(ValueError, match="backend must be one of"):
        bev_pool_v2(depth, feat, rd, rf, rb, shape, s, l, backend="bogus")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="ranks_bev must be on cpu"):
            bev_pool_v2(depth, feat, rd, rf, rb.cuda(), shape, s, l)


# ---------------------------------------------------------------- validate=True


def test_validate_accepts_prepared_ranks():
    validate_inputs(*make_inputs("tiny", batch=2))
    bev_pool_v2(*make_inputs("tiny", batch=2), validate=True)


@pytest.mark.parametrize(
    "name,index,value,pattern",
    [
        ("ranks_bev", 5, -1, r"ranks_bev\[5\] = -1 is out of range \[0, 400\)"),
        ("ranks_bev", 17, 400, r"ranks_bev\[17\] = 400 is out of range"),
        ("ranks_feat", 3, 10**6, r"ranks_feat\[3\] = 1000000 is out of range \[0, 264\)"),
        ("ranks_depth", 0, -7, r"ranks_depth\[0\] = -7 is out of range \[0, 2640\)"),
        ("interval_starts", 2, 10**7, r"interval_starts\[2\] = 10000000 is out of range"),
        (
            "interval_lengths",
            4,
            0,
            r"interval_lengths\[4\] = 0: the interval .* is empty or exceeds",
        ),
        ("interval_lengths", 4, 10**7, r"interval_lengths\[4\] = 10000000"),
    ],
)
def test_validate_raises_index_error_naming_array_and_index(name, index, value, pattern):
    args = list(make_inputs("tiny"))
    pos = {
        "ranks_depth": 2,
        "ranks_feat": 3,
        "ranks_bev": 4,
        "interval_starts": 6,
        "interval_lengths": 7,
    }[name]
    t = args[pos].clone()
    t[index] = value
    args[pos] = t
    with pytest.raises(IndexError, match=pattern):
        bev_pool_v2(*args, validate=True)


def test_validate_rejects_unsorted_ranks_and_foreign_intervals():
    args = list(make_inputs("tiny"))
    rb = args[4].clone()
    rb[11] = rb.max()  # rb[12] < rb[11] now
    with pytest.raises(
        ValueError, match=r"sorted ascending: ranks_bev\[12\] = \d+ < ranks_bev\[11\]"
    ):
        validate_inputs(*args[:4], rb, *args[5:])
    s, l = args[6].clone(), args[7].clone()
    s, l = s[1:], l[1:]  # drops the first run: valid indices, but not the runs
    with pytest.raises(ValueError, match="must be the runs of equal ranks_bev"):
        validate_inputs(*args[:6], s, l)


# ---------------------------------------------------------------- custom op / compile


# ---------------------------------------------------------------- kernel logic (model)
# _bev_pool_v2_model mirrors the kernels' block partition, slot ownership, shared window and
# zeroing. These tests run it on the real geometry and on adversarial layouts, with small
# launch parameters so that every path (runs crossing many slots and blocks, window overflow,
# several zeroing rounds, blocks owning nothing) is taken. The forward zero-fills its output
# first: there the kernel writes each key at most once and every key with points exactly once.


def _assert_forward_writes(writes, keys, n_keys):
    has_points = np.zeros(n_keys, dtype=bool)
    inside = [int(k) for k in keys if 0 <= int(k) < n_keys]
    has_points[inside] = True
    assert (writes <= 1).all(), f"cells written {set(writes.tolist())} times"
    assert (writes[has_points] == 1).all(), "a cell with points was not written"


def _point_values(args):
    depth, feat, rd, rf, rb, shape, _, _ = args
    C = shape[4]
    vals = feat.double().reshape(-1, C)[rf.long()]
    if depth is not None:
        vals = vals * depth.double().reshape(-1)[rd.long()].unsqueeze(1)
    return vals.numpy()


@pytest.mark.parametrize(
    "ppb,lanes,window,bitmap_bits",
    [(64, 16, 87, 4096), (37, 32, 15, 64), (300, 3, 1, 16), (1000, 64, 0, 4096), (9, 128, 5, 8)],
)
def test_kernel_model_forward_on_geometry(ppb, lanes, window, bitmap_bits):
    args = make_inputs("tiny", batch=2, dtype=torch.float64)
    B, Z, Y, X, C = args[5]
    out, writes, crossings = model.segmented_pool(
        args[4].numpy(),
        _point_values(args),
        B * Z * Y * X,
        points_per_block=ppb,
        lanes=lanes,
        window=window,
        bitmap_bits=bitmap_bits,
    )
    if window > 0:
        _assert_forward_writes(writes, args[4].numpy(), B * Z * Y * X)
    else:
        assert (writes == 1).all(), f"cells written {set(writes.tolist())} times"
    want = bev_pool_v2_reference(*args).permute(0, 2, 3, 4, 1).reshape(-1, C).numpy()
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)
    assert crossings > 0  # some runs crossed slot boundaries


@pytest.mark.parametrize(
    "cells,n_cells",
    [
        ([5] * 3000, 20),  # all points in one cell: one run across every block
        ([0] * 700 + [19] * 700, 20),  # two long runs, empty cells between
        (list(range(0, 40000, 97)), 40000),  # sparse: long empty gaps, several zeroing rounds
        ([3], 100000),  # one point, a huge empty grid
        ([], 7),  # nothing
    ],
)
def test_kernel_model_forward_edge_layouts(cells, n_cells):
    keys = np.array(sorted(cells), dtype=np.int64)
    values = np.random.default_rng(0).standard_normal((len(cells), 2))
    out, writes, _ = model.segmented_pool(
        keys, values, n_cells, points_per_block=128, lanes=16, window=31, bitmap_bits=256
    )
    want = np.zeros((n_cells, 2))
    np.add.at(want, keys, values)
    _assert_forward_writes(writes, keys, n_cells)
    np.testing.assert_allclose(out, want, atol=1e-9)


def test_kernel_model_drops_out_of_range_keys_and_stays_in_bounds():
    keys = np.array([-3, -3, 0, 0, 4, 9, 9, 12, 12, 12])  # sorted; -3 and 12 are outside [0, 10)
    values = np.ones((len(keys), 1))
    out, writes, _ = model.segmented_pool(
        keys, values, 10, points_per_block=3, lanes=128, window=3, bitmap_bits=8
    )
    _assert_forward_writes(writes, keys, 10)
    np.testing.assert_array_equal(out[:, 0], [2, 0, 0, 0, 1, 0, 0, 0, 0, 2])


def _padded_inputs(batch=2):
    """make_inputs' geometry with bev_pool_prepare_padded's ranks (upper-bound sizes)."""
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare_padded_reference

    g = bev_geometry.make("tiny", batch=batch, dtype=torch.float64)
    grid = (g["grid_lower_bound"], g["grid_interval"], g["grid_size"])
    padded = bev_pool_prepare_padded_reference(g["coor"], *grid)
    plain = bev_pool_prepare_reference(g["coor"], *grid)
    shape = g["bev_feat_shape"]
    return (
        (g["depth"], g["feat"], *padded.bev_pool_v2_args(shape)),
        (g["depth"], g["feat"], *plain.bev_pool_v2_args(shape)),
    )


def test_padded_ranks_pool_and_differentiate_like_the_plain_ones():
    """bev_pool_prepare_padded's tail (keys above every cell, ranks -1, empty intervals) adds
    nothing, forward or backward (reference path: bit for bit)."""
    padded, plain = _padded_inputs()
    assert padded[4].shape[0] > plain[4].shape[0]  # there is a tail
    leaves = [[t.clone().requires_grad_(True) for t in args[:2]] for args in (padded, plain)]
    outs = [bev_pool_v2(*lv, *args[2:]) for lv, args in zip(leaves, (padded, plain))]
    assert torch.equal(outs[0], outs[1])
    g = torch.randn(outs[0].shape, dtype=outs[0].dtype)
    for out in outs:
        out.backward(g)
    for a, b in zip(*leaves):
        assert torch.equal(a.grad, b.grad)
    want = bev_pool_v2_backward_reference(g, *plain)
    got = bev_pool_v2_backward_reference(g, *padded)
    assert all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("ppb,lanes,window", [(64, 16, 87), (37, 32, 15), (9, 128, 5)])
def test_kernel_model_forward_on_padded_ranks(ppb, lanes, window):
    """The kernel's algorithm on the padded layout: the tail's keys are outside the cells, so
    their (zero: ranks -1 are bad points) sums are dropped, every cell is written once."""
    padded, plain = _padded_inputs()
    B, Z, Y, X, C = padded[5]
    n_cells = B * Z * Y * X
    keys = padded[4].numpy()
    values = np.zeros((keys.shape[0], C))
    k = plain[4].shape[0]
    values[:k] = _point_values(plain)  # the tail: bad points gather nothing
    out, writes, _ = model.segmented_pool(
        keys, values, n_cells, points_per_block=ppb, lanes=lanes, window=window
    )
    _assert_forward_writes(writes, keys, n_cells)
    want = bev_pool_v2_reference(*plain).permute(0, 2, 3, 4, 1).reshape(-1, C).numpy()
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=1e-12)


def test_kernel_model_unsorted_keys_never_write_outside():
    rng = np.random.default_rng(1)
    keys = rng.integers(-5, 60, 500)
    out, writes, _ = model.segmented_pool(
        keys,
        rng.standard_normal((500, 1)),
        50,
        points_per_block=40,
        lanes=32,
        window=7,
        bitmap_bits=16,
    )
    assert writes.shape == (50,)  # every write landed in [0, 50); values are unspecified


@pytest.mark.parametrize("with_depth", [True, False])
def test_kernel_model_deterministic_grad_feat(with_depth):
    """The deterministic backward: sort_by_cell(ranks_feat) + rows sink (window 0) gives the
    reference grad_feat, every feat row written once (rows without points get zeros)."""
    args = list(make_inputs("tiny", batch=2, dtype=torch.float64))
    if not with_depth:
        args[0] = args[2] = None
    depth, feat, rd, rf, rb, shape, s, l = args
    B, Z, Y, X, C = shape
    g = torch.randn(B, C, Z, Y, X, dtype=torch.float64)
    grad_rows = g.permute(0, 2, 3, 4, 1).reshape(-1, C)
    n_rows = feat.numel() // C
    order = sort_by_cell_reference(rf, n_rows).order.long()
    w = (
        torch.ones(order.numel(), dtype=torch.float64)
        if depth is None
        else depth.reshape(-1)[rd.long()[order]]
    )
    values = (grad_rows[rb.long()[order]] * w.unsqueeze(1)).numpy()
    out, writes, _ = model.segmented_pool(
        rf.long()[order].numpy(),
        values,
        n_rows,
        points_per_block=50,
        lanes=5,
        window=0,
        bitmap_bits=32,
    )
    assert (writes == 1).all()
    _, want = bev_pool_v2_backward_reference(g, *args)
    np.testing.assert_allclose(out, want.reshape(-1, C).numpy(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("lanes", [16, 20, 5, 1, 32])
@pytest.mark.parametrize("irregular", [False, True])
def test_kernel_model_frustum_backward(lanes, irregular):
    """The frustum backward's index arithmetic (blocks of 4 rows, rounds of P*4 bins, staged
    entries, slot <-> entry maps) on real geometry: every depth entry written exactly once,
    both gradients equal the reference; irregular points (shared ranks_depth, moved ranks_feat,
    bad ranks) are flagged and added."""
    args = list(make_inputs("tiny", batch=2, dtype=torch.float64, seed=lanes))
    if irregular:
        rd, rf = args[2].clone(), args[3].clone()
        rd[10:40] = rd[11:41].clone()
        rf[100:130] = (rf[100:130] + 3) % (args[1].numel() // args[1].shape[-1])
        rd[200:210] = -1
        args[2], args[3] = rd, rf
    B, Z, Y, X, C = args[5]
    g = torch.randn(B, C, Z, Y, X, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_rows = g.permute(0, 2, 3, 4, 1).reshape(-1, C).numpy()
    gd, gf, flagged, writes = model.frustum_backward(
        grad_rows, args[0].numpy(), args[1].numpy(), *(t.numpy() for t in args[2:5]), lanes=lanes
    )
    assert (writes == 1).all()
    assert flagged == irregular
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    np.testing.assert_allclose(gd, want_d.numpy(), atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(gf, want_f.numpy(), atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------- native (GPU) tests
# Tolerances (native vs reference on the same inputs, both accumulating in float32): float32
# differs only by summation order (intervals of up to ~500 terms of O(1)): 1e-5 abs + rel;
# float16 / bfloat16: both round one float32 sum to the dtype, which can differ by one unit in
# the last place when the float32 sums straddle a rounding boundary: TOLERANCES[dtype].

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _native_forward(args, out):
    depth, feat, rd, rf, rb = args[:5]
    native.function("bev_pool_v2_forward")(depth, feat, rd, rf, rb, out, 0, stream_handle(feat))


def _out_shape(args):
    B, Z, Y, X, C = args[5]
    return (B, C, Z, Y, X)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    "config,batch",
    [
        ("tiny", 1),
        ("tiny", 2),
        ("bevdet-r50", 1),
        ("bevdet-r50", 2),
        ("bevdet-r50-d88", 1),
        ("bevdet-d118", 1),
    ],
)
@pytest.mark.parametrize("channels", [3, 64, 67, 80])
def test_native_forward_matches_reference(dtype, config, batch, channels):
    device = native_gpu_device()
    args = make_inputs(config, batch=batch, channels=channels, dtype=dtype, device=device)
    out = poisoned(_out_shape(args), dtype, device)
    _native_forward(args, out)
    want = bev_pool_v2_reference(*args)
    assert_close(out, want, **tolerance(dtype))
    assert torch.equal(bev_pool_v2(*args, backend="native"), out)  # deterministic, same path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("channels", [1, 8, 300])
def test_native_forward_without_depth_and_channel_tiles(dtype, channels):
    """depth=None (bev_pool / bev_pool_v3 use it) and C beyond one channel tile (300)."""
    device = native_gpu_device()
    args = list(make_inputs("bevdet-r50", channels=channels, dtype=dtype, device=device))
    args[0] = args[2] = None
    out = poisoned(_out_shape(args), dtype, device)
    _native_forward(args, out)
    # Without depth weights a cell sums up to ~500 unit-variance features (|sum| up to ~20), so
    # float32 rounding of two summation orders differs by up to ~500 * 6e-8 * |x|: compare with
    # a float64 reference and allow atol 1e-4 (seen: 5.9e-5 against a float32 reference).
    ref = bev_pool_v2_reference(
        *[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ).to(dtype)
    tol = tolerance(dtype, "bev_pool_v2")
    assert_close(out, ref, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,channels",
    [(torch.float32, 300), (torch.float16, 520), (torch.bfloat16, 258), (torch.float32, 131)],
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_channel_tiles_forward_and_backward(dtype, channels, deterministic):
    """C beyond one channel tile (128 float32 / 256 16-bit channels per tile in grid.y): each
    tile must read and write its own channels, forward and deterministic backward alike."""
    device = native_gpu_device()
    args = make_inputs("tiny", batch=2, channels=channels, dtype=dtype, device=device)
    out = poisoned(_out_shape(args), dtype, device)
    _native_forward(args, out)
    assert_close(out, bev_pool_v2_reference(*args), **tolerance(dtype))
    g = torch.randn(_out_shape(args), device=device).to(dtype)
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    got_d, got_f = backward(g, args, True, True, deterministic, "native")
    tol = tolerance(dtype, "bev_pool_v2")
    assert_close(got_f, want_f, **tol, name="grad_feat")
    assert_close(got_d, want_d, **tol, name="grad_depth")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("channels", [4, 8, 16, 24, 40, 136])
def test_native_forward_lane_layouts(dtype, channels):
    """The forward's slots of G = C / vector lanes: G below the 4 points staged per slot and
    batch (1-3 lanes: lanes load several records), G not a power of two (3, 5, 17), slots capped
    at 64 (G < 4 leaves threads idle); float32 rows in 32-byte vectors."""
    device = native_gpu_device()
    args = make_inputs("bevdet-r50", channels=channels, dtype=dtype, device=device, seed=channels)
    out = poisoned(_out_shape(args), dtype, device)
    _native_forward(args, out)
    assert_close(out, bev_pool_v2_reference(*args), **tolerance(dtype))


def _feat_at_offset(feat: torch.Tensor, elements: int) -> torch.Tensor:
    """A copy of feat that starts `elements` elements past an allocation's (aligned) start."""
    storage = torch.empty(feat.numel() + elements, dtype=feat.dtype, device=feat.device)
    out = storage[elements:].view(feat.shape)
    out.copy_(feat)
    return out


@pytest.mark.gpu
def test_native_forward_16_byte_aligned_feat_uses_narrower_vectors():
    """feat 16- but not 32-byte aligned: float32 rows fall back from 32- to 16-byte vectors."""
    device = native_gpu_device()
    args = list(make_inputs("bevdet-r50", channels=64, device=device))
    args[1] = _feat_at_offset(args[1], 4)
    assert args[1].data_ptr() % 32 == 16
    out = poisoned(_out_shape(args), torch.float32, device)
    _native_forward(args, out)
    assert_close(out, bev_pool_v2_reference(*args), **tolerance(torch.float32))


@pytest.mark.gpu
def test_native_forward_vector_bytes_knob_keeps_results():
    """MUSPACE_BEV_POOL_V2_VECTOR_BYTES=16 (profiling: 16-byte float32 rows instead of 32) is
    read once per process, so it runs in a child process."""
    import os
    import subprocess

    device = native_gpu_device()
    code = (
        "import torch, sys\n"
        "from tests.ops.test_bev_pool_v2 import make_inputs, _out_shape\n"
        "from mu_space.ops.bev_pool_v2 import bev_pool_v2, bev_pool_v2_reference\n"
        f"args = make_inputs('bevdet-r50-d88', device='{device}')\n"
        "out = bev_pool_v2(*args, backend='native')\n"
        "err = (out - bev_pool_v2_reference(*args)).abs().max().item()\n"
        "sys.exit(0 if err < 1e-4 else 1)\n"
    )
    env = dict(os.environ, MUSPACE_BEV_POOL_V2_VECTOR_BYTES="16")
    root = str(Path(__file__).resolve().parents[2])
    subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True, timeout=300)


@pytest.mark.gpu
def test_native_forward_unaligned_feat_falls_back_to_scalar_loads():
    device = native_gpu_device()
    args = list(make_inputs("tiny", channels=64, device=device))
    args[1] = _feat_at_offset(args[1], 1)  # 4-byte offset: no 16-byte vector loads possible
    out = poisoned(_out_shape(args), torch.float32, device)
    _native_forward(args, out)
    assert_close(out, bev_pool_v2_reference(*args), **tolerance(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("with_depth", [True, False])
@pytest.mark.parametrize(
    "cells,shape",
    [
        ([], (1, 1, 4, 5, 3)),  # empty: zeros everywhere
        ([7], (1, 1, 4, 5, 64)),  # one point
        ([13] * 20000, (2, 1, 8, 8, 16)),  # every point in one cell
        ([3] * 5000 + [60] * 7000 + [61], (1, 1, 8, 8, 80)),  # long runs across blocks
        (list(range(0, 300000, 331)), (3, 1, 300, 400, 4)),  # sparse: pre-zeroed output
        ([5, 6, 7], (2, 1, 64, 64, 8)),  # a whole empty batch after them
        (
            sorted(i % 100 for i in range(100000)),
            (2, 1, 100, 100, 4),
        ),  # dense batch 0, empty batch 1:
        # one block zeroes 19900 cells (5 rounds)
    ],
)
def test_native_forward_edge_cases(cells, shape, with_depth):
    device = native_gpu_device()
    args = hand_case(cells, shape, with_depth=with_depth, dtype=torch.float32, device=device)
    out = poisoned(_out_shape(args), torch.float32, device)
    _native_forward(args, out)
    # long runs are summed in another order than the reference: a 20000-term float32 sum of
    # magnitude ~80 carries ~1e-3 of rounding in either order (random walk of 0.5-ulp errors)
    assert_close(out, bev_pool_v2_reference(*args), atol=1e-2, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(
    "config,channels,batch",
    [
        ("tiny", 5, 2),
        ("bevdet-r50", 64, 1),
        ("bevdet-r50", 67, 2),
        ("bevdet-d118", 80, 1),
        ("bevdet-r50", 3, 1),
    ],
)
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_backward_matches_reference(dtype, config, channels, batch, deterministic):
    device = native_gpu_device()
    args = make_inputs(config, batch=batch, channels=channels, dtype=dtype, device=device)
    g = torch.randn(_out_shape(args), device=device, dtype=torch.float32).to(dtype)
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    got_d, got_f = backward(g, args, True, True, deterministic, "native")
    # grad_feat sums up to ~D = 118 products, grad_depth C products of O(1) values: float32
    # order effects ~1e-6 of |value| <~ 30; low precision: one rounding of each sum
    tol = tolerance(dtype, "bev_pool_v2")
    assert_close(got_f, want_f, **tol, name="grad_feat")
    assert_close(got_d, want_d, **tol, name="grad_depth")


def _frustum_entry(grad, args, out_dtype, add_irregular, *, poison=True, flag=True):
    """bev_pool_v2_backward_frustum called directly, every output poisoned first; flag=False
    passes no irregular tensor (the caller vouches for the layout: that pass is skipped)."""
    depth, feat, rd, rf, rb = args[:5]
    device, C = feat.device, feat.shape[-1]
    grad_rows = grad.permute(0, 2, 3, 4, 1).reshape(-1, C).contiguous()
    point_of_depth = torch.full((depth.numel(),), 12345, dtype=torch.int32, device=device)
    irregular = torch.full((1,), -7, dtype=torch.int32, device=device) if flag else None
    gd = poisoned(depth.shape, out_dtype, device)
    gf = poisoned(feat.shape, out_dtype, device)
    covered = native.function("bev_pool_v2_backward_frustum")(
        grad_rows,
        depth,
        feat,
        rd,
        rf,
        rb,
        point_of_depth,
        gd,
        gf,
        irregular,
        add_irregular,
        stream_handle(feat),
    )
    return covered, gd, gf, (int(irregular[0]) if flag else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("config,channels", [("bevdet-r50", 64), ("bevdet-d118", 80), ("tiny", 5)])
def test_native_frustum_backward_writes_every_element(dtype, config, channels):
    """The frustum entry point on bev_pool_prepare's ranks: every gradient element written (the
    outputs start as NaN; entries of dropped frustum points get 0), no point irregular."""
    device = native_gpu_device()
    args = make_inputs(config, channels=channels, dtype=dtype, device=device, seed=3)
    g = torch.randn(_out_shape(args), device=device).to(dtype)
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    tol = tolerance(dtype, "bev_pool_v2")
    for out_dtype, add in ((dtype, False), (torch.float32, True)):
        covered, gd, gf, irregular = _frustum_entry(g, args, out_dtype, add)
        assert covered and irregular == 0
        assert_close(gf.to(dtype), want_f, **tol, name="grad_feat")
        assert_close(gd.to(dtype), want_d, **tol, name="grad_depth")
    assert args[2].numel() < args[0].numel()  # some frustum points were dropped


def _prepared_on_device(config, dtype, device, channels=None, seed=0):
    """make_inputs with the ranks bev_pool_prepare builds on the device: recorded as
    frustum-layout ranks (_bev.FRUSTUM_RANKS), as a model's prepare + pooling has them."""
    from mu_space.ops._bev import FRUSTUM_RANKS
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare

    args = list(make_inputs(config, channels=channels, dtype=dtype, device=device, seed=seed))
    g = bev_geometry.make(config)
    lo, iv, size = g["grid_lower_bound"], g["grid_interval"], g["grid_size"]
    r = bev_pool_prepare(g["coor"].to(device), lo, iv, size, backend="native")
    args[2:5] = r.ranks_depth, r.ranks_feat, r.ranks_bev
    args[6:8] = r.interval_starts, r.interval_lengths
    assert FRUSTUM_RANKS.holds(args[2], args[3], tuple(args[0].shape))
    return tuple(args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("config", ["bevdet-r50", "bevdet-d118", "tiny"])
def test_native_backward_on_prepared_ranks_is_one_path_for_both_modes(dtype, config):
    """On ranks bev_pool_prepare built, the default and the deterministic backward (under
    torch.use_deterministic_algorithms(True)) are the same launches: bit-identical, no host
    synchronisation through autograd (loss.backward() as a model calls it), and equal to the
    reference; the flag pass for points outside the layout is skipped (irregular=None)."""
    device = native_gpu_device()
    args = _prepared_on_device(config, dtype, device, seed=21)
    g = torch.randn(_out_shape(args), device=device).to(dtype)
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    runs = []
    for deterministic in (False, True, True):
        d = args[0].detach().clone().requires_grad_(True)
        f = args[1].detach().clone().requires_grad_(True)
        torch.use_deterministic_algorithms(deterministic)
        try:
            out = bev_pool_v2(d, f, *args[2:], backend="native")
            with forbid_host_sync(out.device):  # any synchronisation raises
                out.backward(g)
        finally:
            torch.use_deterministic_algorithms(False)
        runs.append((d.grad, f.grad))
    for other in runs[1:]:
        assert torch.equal(other[0], runs[0][0]) and torch.equal(other[1], runs[0][1])
    tol = tolerance(dtype, "bev_pool_v2")
    assert_close(runs[0][1], want_f, **tol, name="grad_feat")
    assert_close(runs[0][0], want_d, **tol, name="grad_depth")
    covered, gd, gf, flag = _frustum_entry(g, args, dtype, False, flag=False)
    assert covered and flag is None
    assert torch.equal(gd, runs[0][0]) and torch.equal(gf, runs[0][1])


@pytest.mark.gpu
def test_native_prepared_ranks_modified_in_place_are_checked_again():
    """Ranks bev_pool_prepare built, then edited in place (a point moved to another feat row):
    no longer known to be in the layout, so both modes find the point and still equal the
    reference."""
    device = native_gpu_device()
    args = list(_prepared_on_device("bevdet-r50", torch.float32, device, seed=22))
    args[3][::97] = (args[3][::97] + 5) % _bev_feat_rows(args[1])
    g = torch.randn(_out_shape(args), device=device)
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    tol = tolerance(torch.float32, "bev_pool_v2")
    for deterministic in (False, True):
        got_d, got_f = backward(g, args, True, True, deterministic, "native")
        assert_close(got_f, want_f, **tol, name="grad_feat")
        assert_close(got_d, want_d, **tol, name="grad_depth")


@pytest.mark.gpu
def test_native_frustum_backward_declines_other_layouts():
    """Not the frustum layout (flat depth, or > 32 channel vectors): nothing launched, False."""
    device = native_gpu_device()
    args = list(make_inputs("tiny", channels=64, device=device))
    g = torch.randn(_out_shape(args), device=device)
    flat = list(args)
    flat[0] = args[0].reshape(-1)
    assert not _frustum_entry(g, flat, torch.float32, True)[0]
    wide = make_inputs("tiny", channels=300, device=device)
    assert not _frustum_entry(
        torch.randn(_out_shape(wide), device=device), wide, torch.float32, True
    )[0]


def _irregular_inputs(dtype, device):
    """bevdet-r50 ranks with points outside the frustum layout: some depth entries shared by 2
    or 3 points, some ranks_feat moved to another row, some points made bad (rank -1)."""
    args = list(make_inputs("bevdet-r50", channels=64, dtype=dtype, device=device, seed=5))
    n = args[4].numel()
    gen = torch.Generator().manual_seed(7)
    rd, rf = args[2].clone(), args[3].clone()
    pick = torch.randint(0, n - 2, (n // 50,), generator=gen).to(device)
    rd[pick] = rd[pick + 1]  # shared by 2 (or 3 where picks are adjacent)
    rd[pick[:50] + 2] = rd[pick[:50] + 1]
    moved = torch.randint(0, n, (n // 50,), generator=gen).to(device)
    rf[moved] = (rf[moved] + 17) % _bev_feat_rows(args[1])
    bad = torch.randint(0, n, (n // 100,), generator=gen).to(device)
    rd[bad] = -1
    args[2], args[3] = rd, rf
    return args


def _bev_feat_rows(feat):
    return feat.numel() // feat.shape[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_backward_with_points_outside_the_frustum_layout(dtype, deterministic):
    """Irregular points: the default mode adds them with atomics, the deterministic mode sees
    the flag and takes the sorted path; both equal the reference. The deterministic mode runs
    as a model gets it, under torch.use_deterministic_algorithms(True): its grad_depth of depth
    entries shared by 3 points sums with torch's index_add, deterministic only then (without it
    the rerun differed in the last bits under compute-sanitizer on the H200, 2026-12-01)."""
    device = native_gpu_device()
    args = _irregular_inputs(dtype, device)
    g = torch.randn(_out_shape(args), device=device).to(dtype)
    assert _frustum_entry(g, args, torch.float32, True)[3] == 1
    want_d, want_f = bev_pool_v2_backward_reference(g, *args)
    torch.use_deterministic_algorithms(deterministic)
    try:
        got_d, got_f = backward(g, args, True, True, deterministic, "native")
        again = backward(g, args, True, True, deterministic, "native") if deterministic else None
    finally:
        torch.use_deterministic_algorithms(False)
    tol = tolerance(dtype, "bev_pool_v2")
    assert_close(got_f, want_f, **tol, name="grad_feat")
    assert_close(got_d, want_d, **tol, name="grad_depth")
    if deterministic:
        assert torch.equal(again[0], got_d) and torch.equal(again[1], got_f)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("config", ["bevdet-r50", "bevdet-r50-d88"])
def test_native_default_backward_is_bit_identical_between_runs(dtype, config):
    """On bev_pool_prepare's ranks the default backward has no float atomics (frustum layout):
    two runs give the same bits, and the deterministic mode the same values."""
    device = native_gpu_device()
    args = make_inputs(config, dtype=dtype, device=device, seed=11)
    g = torch.randn(_out_shape(args), device=device).to(dtype)
    first = backward(g, args, True, True, False, "native")
    second = backward(g, args, True, True, False, "native")
    det = backward(g, args, True, True, True, "native")
    for a, b, c in zip(first, second, det):
        assert torch.equal(a, b)
        assert_close(c, a, **tolerance(dtype, "bev_pool_v2"))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_backward_on_padded_ranks(deterministic):
    """bev_pool_prepare_padded's tail (ranks -1, keys above every cell) gets no gradient."""
    device = native_gpu_device()
    padded, plain = (
        tuple(
            a.to(device).float()
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            else (a.to(device) if isinstance(a, torch.Tensor) else a)
            for a in args
        )
        for args in _padded_inputs()
    )
    g = torch.randn(_out_shape(plain), device=device)
    want_d, want_f = bev_pool_v2_backward_reference(g, *plain)
    got_d, got_f = backward(g, padded, True, True, deterministic, "native")
    tol = tolerance(torch.float32, "bev_pool_v2")
    assert_close(got_f, want_f, **tol, name="grad_feat")
    assert_close(got_d, want_d, **tol, name="grad_depth")


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_backward_without_depth(deterministic):
    device = native_gpu_device()
    args = list(make_inputs("bevdet-r50", channels=80, device=device))
    args[0] = args[2] = None
    g = torch.randn(_out_shape(args), device=device)
    _, want_f = bev_pool_v2_backward_reference(g, *args)
    got_d, got_f = backward(g, args, False, True, deterministic, "native")
    assert got_d is None
    assert_close(got_f, want_f, atol=1e-4, rtol=1e-5, name="grad_feat")


@pytest.mark.gpu
def test_cuda_graph_capture_of_forward_and_backward():
    device = graph_capture_device()
    args = list(make_inputs("bevdet-r50", device=device))
    depth = args[0].clone().requires_grad_(True)
    feat = args[1].clone().requires_grad_(True)
    static_g = torch.randn(_out_shape(args), device=device)

    def step():
        depth.grad = feat.grad = None
        out = bev_pool_v2(depth, feat, *args[2:], backend="native")
        out.backward(static_g)
        return out

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside capture (allocator, library load)
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    static_g.copy_(torch.randn_like(static_g))
    graph.replay()
    torch.cuda.synchronize(device)
    want_d, want_f = bev_pool_v2_backward_reference(
        static_g, depth.detach(), feat.detach(), *args[2:]
    )
    assert_close(
        static_out,
        bev_pool_v2_reference(depth.detach(), feat.detach(), *args[2:]),
        **tolerance(torch.float32),
    )
    assert_close(feat.grad, want_f, atol=1e-4, rtol=1e-5, name="grad_feat")
    assert_close(depth.grad, want_d, atol=1e-4, rtol=1e-5, name="grad_depth")


@pytest.mark.gpu
@pytest.mark.parametrize("corruption", ["negative", "huge", "unsorted", "garbage_intervals"])
@pytest.mark.parametrize("channels", [67, 64])  # 64: the frustum backward; 67: point kernels
def test_bad_indices_never_crash_and_validate_raises(corruption, channels):
    device = native_gpu_device()
    args = list(make_inputs("bevdet-r50", batch=2, channels=channels, device=device))
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = args[4].numel()
    idx = torch.randint(0, n, (n // 10,), generator=gen).to(device)
    for pos in (2, 3, 4):
        t = args[pos].clone()
        if corruption == "negative":
            t[idx] = -1 - t[idx]
        elif corruption == "huge":
            t[idx] = 2**31 - 1 - t[idx]
        elif corruption == "unsorted" and pos == 4:
            t = t[torch.randperm(n, generator=gen).to(device)]
        args[pos] = t
    if corruption == "garbage_intervals":
        args[6] = torch.randint(
            -(10**6), 10**6, args[6].shape, generator=gen, dtype=torch.int32
        ).to(device)
        args[7] = torch.randint(
            -(10**6), 10**6, args[7].shape, generator=gen, dtype=torch.int32
        ).to(device)
    depth = args[0].clone().requires_grad_(True)
    feat = args[1].clone().requires_grad_(True)
    out = bev_pool_v2(depth, feat, *args[2:], backend="native")
    out.backward(torch.ones_like(out))
    for mode in (True, False):
        torch.use_deterministic_algorithms(mode)
        try:
            backward(torch.ones_like(out), args, True, True, mode, "native")
        finally:
            torch.use_deterministic_algorithms(False)
    synchronize(device)  # an illegal access would surface here
    assert torch.isfinite(out).all()
    with pytest.raises((IndexError, ValueError)):
        bev_pool_v2(*args, backend="native", validate=True)


@pytest.mark.gpu
def test_output_beyond_int32_elements():
    """B*Z*Y*X*C > 2**31 elements: int64 offsets (float16 output of ~5.4 GB)."""
    device = native_gpu_device(too_large_to_emulate=True)
    if torch.cuda.get_device_properties(device).total_memory < 24 * 2**30:
        pytest.skip("needs ~12 GB of GPU memory")
    shape = (1, 1, 4096, 4096, 160)  # 2.7e9 elements
    n_cells = 4096 * 4096
    cells = [0, 1, n_cells // 2, n_cells - 2, n_cells - 1, n_cells - 1]
    args = hand_case(cells, shape, dtype=torch.float16, device=device)
    out = bev_pool_v2(*args, backend="native")
    assert out.shape == (1, 160, 1, 4096, 4096)
    rows = args[1].float().reshape(-1, 160)
    w = args[0].float().reshape(-1)
    flat = out.view(160, -1)
    for cell in sorted(set(cells)):
        pts = [i for i, c in enumerate(cells) if c == cell]
        want = sum(w[args[2][i]] * rows[args[3][i]] for i in pts)
        assert_close(flat[:, cell].float(), want, atol=2e-2, rtol=2e-3)
    assert not flat[:, 2 : n_cells // 2].any() and not flat[:, n_cells // 2 + 1 : n_cells - 2].any()


@pytest.mark.gpu
def test_native_entry_point_validates_arguments():
    device = native_gpu_device()
    fn = native.function("bev_pool_v2_forward")
    depth, feat, rd, rf, rb, shape, _, _ = make_inputs("tiny", device=device)
    stream = stream_handle(feat)
    out = torch.empty(_out_shape((None,) * 5 + (shape,)), device=device)
    with pytest.raises(TypeError, match="ranks_bev must be int32, got int64"):
        fn(depth, feat, rd, rf, rb.long(), out, 0, stream)
    with pytest.raises(TypeError, match="feat must be float32, float16 or bfloat16, got float64"):
        fn(depth.double(), feat.double(), rd, rf, rb, out.double(), 0, stream)
    with pytest.raises(
        TypeError, match=r"depth must have the dtype of feat \(float32\), got float16"
    ):
        fn(depth.half(), feat, rd, rf, rb, out, 0, stream)
    if device.type == "cuda":  # the host emulation's device is the CPU itself
        with pytest.raises(ValueError, match="feat must be a cuda tensor, got cpu:0"):
            fn(depth, feat.cpu(), rd, rf, rb, out, 0, stream)
        with pytest.raises(ValueError, match="ranks_feat must be on cuda:0, got cpu:0"):
            fn(depth, feat, rd, rf.cpu(), rb, out, 0, stream)
    with pytest.raises(ValueError, match=r"ranks_depth.shape\[0\] must be"):
        fn(depth, feat, rd[1:], rf, rb, out, 0, stream)
    with pytest.raises(ValueError, match=r"out.shape\[1\] must be 5"):
        fn(depth, feat, rd, rf, rb, torch.empty(1, 6, 1, 20, 20, device=device), 0, stream)
    with pytest.raises(ValueError, match="out must be contiguous"):
        fn(depth, feat, rd, rf, rb, out.transpose(3, 4), 0, stream)
    with pytest.raises(ValueError, match="depth and ranks_depth must be given together"):
        fn(None, feat, rd, rf, rb, out, 0, stream)


@pytest.mark.gpu
def test_points_per_block_override_keeps_results():
    """Profiling knob: any points-per-block gives the same values (fp32 order may differ)."""
    device = native_gpu_device()
    args = make_inputs("bevdet-r50", batch=2, channels=80, device=device)
    want = bev_pool_v2_reference(*args)
    for ppb in (1, 7, 64, 1000, 100000):
        out = poisoned(_out_shape(args), torch.float32, device)
        native.function("bev_pool_v2_forward")(*args[:5], out, ppb, stream_handle(out))
        assert_close(out, want, **tolerance(torch.float32))


# ---------------------------------------------------------------- repeated ranks_depth


def _repeated_depth_case(device="cpu"):
    """The issue's case: two points share ranks_depth 0 (and feat rows 0 and 1, cells 0 and 1)."""
    i32 = torch.int32
    depth = torch.tensor([2.0], device=device)
    feat = torch.tensor([[1.0], [3.0]], device=device)
    t = lambda v: torch.tensor(v, dtype=i32, device=device)  # noqa: E731
    return (depth, feat, t([0, 0]), t([0, 1]), t([0, 1]), (1, 1, 1, 2, 1), t([0, 1]), t([1, 1]))


def test_grad_depth_sums_every_point_of_a_repeated_ranks_depth():
    """Rule: grad_depth[k] = sum over points i with ranks_depth[i] == k of
    <grad_out[:, cell_i], feat row of i>: here 1 * 1 + 1 * 3 = 4."""
    args = _repeated_depth_case()
    gd, gf = bev_pool_v2_backward_reference(torch.ones(1, 1, 1, 1, 2), *args)
    assert gd.tolist() == [4.0] and gf.tolist() == [[2.0], [2.0]]
    depth = args[0].clone().requires_grad_(True)
    bev_pool_v2(depth, *args[1:]).sum().backward()
    assert depth.grad.tolist() == [4.0]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_grad_depth_sums_a_repeated_ranks_depth(deterministic):
    device = native_gpu_device()
    args = _repeated_depth_case(device)
    depth = args[0].clone().requires_grad_(True)
    feat = args[1].clone().requires_grad_(True)
    torch.use_deterministic_algorithms(deterministic)
    try:
        bev_pool_v2(depth, feat, *args[2:], backend="native").sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert depth.grad.tolist() == [4.0] and feat.grad.tolist() == [[2.0], [2.0]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("deterministic", [False, True])
def test_native_grad_depth_with_many_repeats_matches_reference(dtype, deterministic):
    """Every point of the tiny frustum points at one of 7 depth entries."""
    device = native_gpu_device()
    args = list(make_inputs("tiny", dtype=dtype, device=device))
    args[2] = (args[2] % 7).to(torch.int32)
    depth = args[0].clone().requires_grad_(True)
    grad = torch.randn(_out_shape(args), device=device, dtype=dtype)
    torch.use_deterministic_algorithms(deterministic)
    try:
        bev_pool_v2(depth, *args[1:], backend="native").backward(grad)
    finally:
        torch.use_deterministic_algorithms(False)
    want, _ = bev_pool_v2_backward_reference(grad, *args)
    if deterministic:  # 3+ points per depth entry: the deterministic reduction, bit-exact
        torch.use_deterministic_algorithms(True)
        try:
            again = depth.detach().clone().requires_grad_(True)
            bev_pool_v2(again, *args[1:], backend="native").backward(grad)
        finally:
            torch.use_deterministic_algorithms(False)
        assert torch.equal(again.grad, depth.grad)
    scale = want.abs().max().item()
    assert_close(
        depth.grad,
        want,
        atol=(1e-5 if dtype == torch.float32 else 2e-3) * scale,
        rtol=2e-3,
        name="grad_depth",
    )


def test_validate_accepts_ranks_feat_when_there_are_no_channels():
    """C = 0: feat has rows (feat.shape[:-1]) even though it holds no values."""
    depth, feat, rd, rf, rb, shape, s, l = make_inputs("tiny")
    empty_c = feat[..., :0]
    zero_c = shape[:4] + (0,)
    out = bev_pool_v2(depth, empty_c, rd, rf, rb, zero_c, s, l, validate=True)
    assert out.shape == (shape[0], 0, *shape[1:4])


def test_grid_beyond_int32_cells_is_a_value_error_naming_bev_feat_shape():
    depth, feat, rd, rf, rb, shape, s, l = make_inputs("tiny")
    big = (2, 1, 2**15, 2**15, shape[4])  # 2**31 cells: ranks_bev (int32) cannot address them
    with pytest.raises(ValueError, match="bev_feat_shape: .* exceeds the int32 range of ranks_bev"):
        bev_pool_v2(depth, feat, rd, rf, rb, big, s, l)


def test_repeat_count_of_depth_entries_is_cached_per_tensor():
    rd = torch.tensor([0, 1, 1, 2], dtype=torch.int32)
    assert not bpv2._depth_entries_shared_by_3(rd, 5)
    assert bpv2._depth_entries_shared_by_3(torch.tensor([4, 1, 1, 1, -3, 99], dtype=torch.int32), 5)
    rd[0] = 1  # an in-place change bumps the version: counted again
    assert bpv2._depth_entries_shared_by_3(rd, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("config", ["tiny", "bevdet-r50"])
def test_native_padded_ranks_forward_and_backward(config, deterministic):
    """bev_pool_prepare_padded's ranks on the kernels: the tail adds nothing to the output or
    the gradients (float32; to rounding: the partition into blocks depends on n)."""
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare, bev_pool_prepare_padded

    device = native_gpu_device()
    g = bev_geometry.make(config)
    grid = (g["grid_lower_bound"], g["grid_interval"], g["grid_size"])
    coor = g["coor"].to(device)
    shape = g["bev_feat_shape"]
    runs = []
    for prepare in (bev_pool_prepare_padded, bev_pool_prepare):
        r = prepare(coor, *grid, backend="native")
        depth, feat = (g[k].to(device, copy=True).requires_grad_(True) for k in ("depth", "feat"))
        torch.use_deterministic_algorithms(deterministic)
        try:
            out = bev_pool_v2(depth, feat, *r.bev_pool_v2_args(shape), backend="native")
            out.backward(torch.ones_like(out))
        finally:
            torch.use_deterministic_algorithms(False)
        runs.append((out.detach(), depth.grad, feat.grad))
    tol = tolerance(torch.float32)
    for got, want, name in zip(runs[0], runs[1], ("out", "grad_depth", "grad_feat")):
        assert_close(got, want, **tol, name=name)
