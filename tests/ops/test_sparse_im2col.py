"""sparse_conv's im2col path (mu_space/ops/_sparse_native.py) on the CPU, with its kernels
(sparse_conv_maps, sparse_conv_im2col, and the per-offset path's sparse_pairs_check /
sparse_conv_gather / sparse_conv_scatter) emulated in PyTorch by their documented contracts:
the orchestration (neighbour maps, chunks, the backward's two GEMMs, inverse, the reference on
a repeated slot, the caches and their one host synchronisation) against the reference. The real
kernels are checked on a GPU in tests/ops/test_sparse_native.py.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from mu_space.ops import _sparse_native
from mu_space.testing import tolerances

sparse_conv = importlib.import_module("mu_space.ops.sparse_conv")  # the module, not the op


def _maps(pairs, num, out_map, in_map, flags, inverse, st):
    K, _, P = pairs.shape
    out_map.fill_(-1), in_map.fill_(-1), flags.zero_()
    g_side = 1 if inverse else 0
    for k in range(K):
        c = max(0, min(int(num[k]), P))
        for g, s in zip(pairs[k, g_side, :c].tolist(), pairs[k, 1 - g_side, :c].tolist()):
            if not (0 <= g < in_map.shape[0] and 0 <= s < out_map.shape[0]):
                flags[1] = 1
                continue
            if out_map[s, k] != -1 or in_map[g, k] != -1:
                flags[0] = 1
            out_map[s, k], in_map[g, k] = g, s


def _im2col(src, neighbour_map, cols, st):
    rows, K = neighbour_map.shape
    padded = torch.cat((src, torch.zeros_like(src[:1])))  # row -1 -> the zero row
    taken = padded[neighbour_map.long().where(neighbour_map >= 0, src.shape[0])]
    cols.copy_(taken.reshape(rows, K * src.shape[1]).to(cols.dtype))


def _pairs_check(pairs, num, header, n_in, n_out, inverse, st):
    K, _, P = pairs.shape
    counts = num.clamp(0, P)
    header.zero_()
    header[:K] = counts
    header[K + 1 : 2 * K + 1] = counts.cumsum(0)
    header[2 * K + 1] = int(((num < 0) | (num > P)).any())
    g_side = 1 if inverse else 0
    for k in range(K):
        c = int(counts[k])
        g, s = pairs[k, g_side, :c], pairs[k, 1 - g_side, :c]
        if ((g < 0) | (g >= n_in) | (s < 0) | (s >= n_out)).any():
            header[2 * K + 2] = 1


def _gather(src, pairs, starts, out, side, st):
    for k in range(pairs.shape[0]):
        a, b = int(starts[k]), int(starts[k + 1])
        out[a:b] = src[pairs[k, side, : b - a].long()].float()


def _scatter(products, pairs, counts, acc, side, st):
    start = 0
    for k, c in enumerate(counts):
        acc.index_add_(0, pairs[k, side, :c].long(), products[start : start + c])
        start += c


def _positions(neighbour_map, row_order):
    """The map's rows in the order the kernels take them: row_order (a permutation) or 0..R-1."""
    rows = neighbour_map.shape[0]
    if row_order is None:
        return torch.arange(rows)
    assert row_order.dtype == torch.int32 and row_order.shape == (rows,)
    assert torch.equal(row_order.sort().values, torch.arange(rows, dtype=torch.int32))
    return row_order.long()


def _implicit_gemm(src, neighbour_map, weight, out, row_order, st):
    n, c = src.shape
    at = _positions(neighbour_map, row_order)
    rows = neighbour_map[at].long()
    rows = rows.where((rows >= 0) & (rows < n), n)  # -1 / outside -> the zero row
    padded = torch.cat((src.float(), torch.zeros(1, c)))
    out[at] = torch.einsum("rkc,kcn->rn", padded[rows], weight.float()).to(out.dtype)


def _implicit_wgrad(src, neighbour_map, grad, partial, grad_weight, row_order, st):
    n, c = src.shape
    at = _positions(neighbour_map, row_order)
    rows = neighbour_map[at].long()
    rows = rows.where((rows >= 0) & (rows < n), n)
    padded = torch.cat((src.float(), torch.zeros(1, c)))
    grad_weight.copy_(torch.einsum("rkc,rn->kcn", padded[rows], grad[at].float()))


def _row_order(neighbour_map, order, st):
    rows, K = neighbour_map.shape
    masks = ((neighbour_map >= 0).to(torch.int64) << torch.arange(K)).sum(1)
    window = _sparse_native.ROW_ORDER_WINDOW
    for start in range(0, rows, window):
        part = masks[start : start + window]
        order[start : start + len(part)] = torch.sort(part, stable=True).indices + start


KERNELS = {
    "sparse_conv_implicit_gemm": _implicit_gemm,
    "sparse_conv_implicit_wgrad": _implicit_wgrad,
    "sparse_conv_row_order": _row_order,
    "sparse_conv_maps": _maps,
    "sparse_conv_im2col": _im2col,
    "sparse_pairs_check": _pairs_check,
    "sparse_conv_gather": _gather,
    "sparse_conv_scatter": _scatter,
}


class _Calls(list):
    syncs: int


@pytest.fixture
def emulated(monkeypatch):
    """The kernels above as `native`; returns the list of launched entry point names."""
    calls = _Calls()
    calls.syncs = 0  # tolist() calls outside the emulated kernels: the path's host syncs
    inside = []
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        calls.syncs += not inside
        return tolist(t)

    def function(name):
        def call(*args):
            calls.append(name)
            inside.append(name)
            try:
                return KERNELS[name](*args)
            finally:
                inside.pop()

        return call

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    fake = types.SimpleNamespace(function=function, limit=lambda key: 2**31 - 1)
    monkeypatch.setattr(_sparse_native, "native", fake)
    monkeypatch.setattr(_sparse_native, "stream_handle", lambda t: 0)
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_UNVERIFIED", "")  # the orchestration as verified
    caches = (
        _sparse_native.CHECKED_PAIRS,
        _sparse_native.NEIGHBOUR_MAPS,
        _sparse_native.ROW_ORDERS,
    )
    for cache in caches:
        cache.clear()
    yield calls
    for cache in caches:
        cache.clear()


def _run(args, grad_seed=5):
    """(native out, native (grad_x, grad_w)), (reference out, reference grads)."""
    f, w, p, n, m, inv = args
    c = sparse_conv._check(*args)
    got = _sparse_native.conv_native(c, *args)
    want = sparse_conv.sparse_conv_reference(*args)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(grad_seed)).to(f.dtype)
    got_g = _sparse_native.conv_backward_native(c, g, *args, needs=(True, True), deterministic=True)
    want_g = sparse_conv.sparse_conv_backward_reference(g, *args)
    return (got, got_g), (want, want_g)


CASES = {
    "subm": dict(subm=True),
    "strided": dict(subm=False),
    "inverse": dict(subm=False, inverse=True, c_in=8, c_out=4),
    "wide": dict(subm=True, c_in=4, c_out=24),  # auto: the weight gradient by im2col
}


@pytest.mark.parametrize("gemm", ["im2col", "implicit", "auto", "auto-tensor-cores"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1 << 26, 7 * 27 * 8, 1])  # one chunk, several, a row each
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("row_order", [True, False])
def test_im2col_path_matches_the_reference(emulated, monkeypatch, case, chunk, dtype, gemm,
                                           row_order):  # fmt: skip
    monkeypatch.setattr(_sparse_native, "IM2COL_CHUNK_ELEMENTS", chunk)
    # the tiny case's maps (~600 rows) take the mask order only below the size threshold
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0 if row_order else 1 << 30)
    tensor_cores = gemm == "auto-tensor-cores"  # a build and device with them (CUDA sm_80+)
    monkeypatch.setattr(_sparse_native, "tensor_core_gemm", lambda device: tensor_cores)
    gemm = "auto" if tensor_cores else gemm
    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", gemm)
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu", **CASES[case])
    args = (f.to(dtype), w.to(dtype), p, n, m, inv)
    (got, got_g), (want, want_g) = _run(args)
    assert "sparse_conv_gather" not in emulated  # the im2col path ran
    # implicit: the forward and the input gradient by sparse_conv_implicit_gemm, the weight
    # gradient by sparse_conv_implicit_wgrad, no cols; im2col: no implicit GEMM; auto: float32
    # implicit, the weight gradient too up to WGRAD_MAX_COLUMNS output channels; 16-bit
    # forward and input gradient implicit where the kernel has tensor cores, weight gradient
    # im2col
    c_out = w.shape[2]
    implicit = gemm == "implicit" or (gemm == "auto" and (dtype == torch.float32 or tensor_cores))
    implicit_w = gemm == "implicit" or (
        gemm == "auto" and dtype == torch.float32 and c_out <= _sparse_native.WGRAD_MAX_COLUMNS
    )
    assert emulated.count("sparse_conv_implicit_gemm") == (2 if implicit else 0)
    assert emulated.count("sparse_conv_implicit_wgrad") == (1 if implicit_w else 0)
    assert ("sparse_conv_im2col" in emulated) != implicit_w
    # one row order for a strided rule book's input side where an implicit GEMM reads it (in_map:
    # the input gradient; an inverse conv's out_map: forward and weight gradient, cached between)
    ordered = {"strided": implicit, "inverse": implicit or implicit_w}.get(case, False)
    assert emulated.count("sparse_conv_row_order") == (int(ordered) if row_order else 0)
    assert got.dtype == want.dtype and got_g[0].dtype == got_g[1].dtype == dtype
    tolerances.assert_close(got, want, op="sparse_conv")
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


@pytest.mark.parametrize("gemm", ["implicit", "auto", "im2col"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["subm", "wide"])
@pytest.mark.parametrize("min_product", [1, 1 << 20])
def test_a_wide_subm_layer_takes_its_out_map_in_mask_order(emulated, monkeypatch, case, dtype,
                                                           gemm, min_product):  # fmt: skip
    """SUBM_ORDER_MIN_CHANNEL_PRODUCT: from that C_in x C_out on, a SubM layer's forward and
    weight gradient take out_map in row_order's order (one order, cached between them); below
    it site order. The same sums either way."""
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(_sparse_native, "SUBM_ORDER_MIN_CHANNEL_PRODUCT", min_product)
    monkeypatch.setattr(_sparse_native, "tensor_core_gemm", lambda device: False)
    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", gemm)
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu", **CASES[case])
    args = (f.to(dtype), w.to(dtype), p, n, m, inv)
    (got, got_g), (want, want_g) = _run(args)
    implicit = gemm == "implicit" or (gemm == "auto" and dtype == torch.float32)
    implicit_w = gemm == "implicit" or (
        gemm == "auto" and dtype == torch.float32 and w.shape[2] <= _sparse_native.WGRAD_MAX_COLUMNS
    )
    wide = min_product <= w.shape[1] * w.shape[2]
    assert emulated.count("sparse_conv_row_order") == int(wide and (implicit or implicit_w))
    tolerances.assert_close(got, want, op="sparse_conv")
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


def test_a_repeated_slot_runs_the_reference(emulated):
    """A rule book whose offset lists one (input, output) pair twice: the maps cannot hold it
    and the per-offset scatter's plain adds would race on it: the reference sums both."""
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu")
    p, num = p.clone(), n.clone()
    k = int(torch.nonzero((num > 0) & (num < p.shape[2]))[0])  # an offset with a free slot
    c = int(num[k])
    p[k, :, c] = p[k, :, 0]
    num[k] = c + 1
    args = (f, w, p, num, m, inv)
    (got, got_g), (want, want_g) = _run(args)
    assert "sparse_conv_maps" in emulated
    assert not {"sparse_conv_im2col", "sparse_conv_gather"} & set(emulated)
    tolerances.assert_close(got, want, op="sparse_conv")
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


def test_a_bad_row_is_the_reference_error(emulated):
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu")
    p = p.clone()
    p[0, 1, 0] = m
    c = sparse_conv._check(f, w, p, n, m, inv)
    with pytest.raises(ValueError, match="indice_pairs"):
        _sparse_native.conv_native(c, f, w, p, n, m, inv)


def test_maps_are_built_and_checked_once_per_rule_book(emulated):
    """One maps build and one host synchronisation (the check's header and the maps' flags
    together) for a rule book used by a forward and a backward, twice."""
    args = sparse_conv.sample_case("cpu")
    c = sparse_conv._check(*args)
    g = torch.ones(args[4], args[1].shape[2])
    for _ in range(2):
        _sparse_native.conv_native(c, *args)
        _sparse_native.conv_backward_native(c, g, *args, needs=(True, True), deterministic=True)
    assert emulated.count("sparse_conv_maps") == 1
    assert emulated.count("sparse_pairs_check") == 1
    assert emulated.syncs == 1


def test_a_rulebook_native_subm_rule_book_needs_no_synchronisation(emulated):
    """rulebook_native leaves its SubM rule books as checked (counts known, valid by
    construction): the maps are built without reading anything back."""
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu")
    _sparse_native.CHECKED_PAIRS.put(p, n, len(f), m, False, (None, n.tolist(), False))
    emulated.syncs = 0
    c = sparse_conv._check(f, w, p, n, m, inv)
    got = _sparse_native.conv_native(c, f, w, p, n, m, inv)
    assert not emulated.syncs and emulated == ["sparse_conv_maps", "sparse_conv_implicit_gemm"]
    tolerances.assert_close(got, sparse_conv.sparse_conv_reference(f, w, p, n, m, inv),
                            op="sparse_conv")  # fmt: skip


def test_cached_maps_go_with_their_rule_book():
    from mu_space.ops._sparse_native import _CheckedPairs

    cache = _CheckedPairs()
    pairs, num = torch.zeros(2, 2, 5, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cache.put(pairs, num, 5, 5, False, ("maps",))
    assert len(cache._entries) == 1
    del pairs
    assert len(cache._entries) == 0  # no dead rule book's maps held until evicted


def test_the_profiling_switch_runs_the_per_offset_path(emulated, monkeypatch):
    monkeypatch.setattr(_sparse_native, "IM2COL_ENABLED", False)
    (got, got_g), (want, want_g) = _run(sparse_conv.sample_case("cpu"))
    assert "sparse_conv_maps" not in emulated and "sparse_conv_gather" in emulated
    tolerances.assert_close(got, want, op="sparse_conv")
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


def test_the_row_order_groups_rows_by_their_masks(emulated, monkeypatch):
    """row_order on a stride-2 rule book's input-side map (at most 8 of 27 offsets a row): the
    rows sorted by their masks within windows (of 64 rows here, so several), ties in site
    order, so 64-row tiles need fewer (offset, tile) steps; cached per map; site order below
    ROW_ORDER_MIN_ROWS, for K > 32 and when disabled."""
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_WINDOW", 256)
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu", subm=False)
    out_map, in_map = _sparse_native.neighbour_maps(p, n, f.shape[0], m, False, 0)
    order = _sparse_native.row_order(in_map, 0)
    assert _sparse_native.row_order(in_map, 0) is order  # cached
    assert emulated.count("sparse_conv_row_order") == 1
    bits = (in_map >= 0).long() << torch.arange(in_map.shape[1])
    rows = in_map.shape[0]
    assert rows > 512
    for start in range(0, rows, 256):
        part = order[start : start + 256].long()
        assert bool(((part >= start) & (part < start + 256)).all())  # within its window
        masks = bits.sum(1)[part]
        assert bool((masks[1:] >= masks[:-1]).all())
        ties = masks[1:] == masks[:-1]
        assert bool((part[1:][ties] > part[:-1][ties]).all())  # stable: site order within a mask

    def steps(rows):
        used = (in_map[rows] >= 0).reshape(-1)
        pad = (-len(rows)) % 64
        used = torch.cat((used, torch.zeros(pad * in_map.shape[1], dtype=torch.bool)))
        return int(used.reshape(-1, 64, in_map.shape[1]).any(1).sum())

    assert steps(order.long()) < steps(torch.arange(in_map.shape[0]))
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", in_map.shape[0] + 1)
    assert _sparse_native.row_order(out_map, 0) is None
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0)
    assert _sparse_native.row_order(torch.zeros(5, 33, dtype=torch.int32), 0) is None
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_ENABLED", False)
    assert _sparse_native.row_order(out_map, 0) is None


def test_an_unverified_row_order_runs_only_when_asked(emulated, monkeypatch):
    """While ROW_ORDER_UNVERIFIED says why, `auto` keeps site order; MUSPACE_TRY_UNVERIFIED=1
    (the GPU sessions that verify it) orders the maps."""
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0)
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_UNVERIFIED", "not run on a GPU yet")
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu", subm=False)
    out_map, in_map = _sparse_native.neighbour_maps(p, n, f.shape[0], m, False, 0)
    monkeypatch.delenv("MUSPACE_TRY_UNVERIFIED", raising=False)
    assert _sparse_native.row_order(in_map, 0) is None
    monkeypatch.setenv("MUSPACE_TRY_UNVERIFIED", "1")
    assert _sparse_native.row_order(in_map, 0) is not None
