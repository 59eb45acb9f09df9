"""The native sparse kernels (csrc/sparse/) against the references on a GPU (skipped without
one): voxelized synthetic LiDAR frames (mu_space.testing.lidar, nuScenes 10-sweep clouds,
CenterPoint's 0.075 m grid, SparseEncoder's sparse shape [41, 1440, 1440]), the layers such a
backbone runs (SubM k3, strided k3 s2 p1, SECOND's (3, 1, 1) s (2, 1, 1) down-sampling, the
transposed and inverse convs), outputs poisoned (NaN / -1) before the call:
- rule books equal element by element (pairs, counts, out_indices), strided / transposed ones
  on both output-site paths (the bitmap and the sort: `rulebook_path`);
- conv forward / backward and max pool within the tolerance table (mu_space/testing/
  tolerances.py, row sparse_conv), float32 / float16 / bfloat16, odd channel counts (the scalar
  path) and aligned ones (16-byte vectors);
- bit-exact reruns under torch.use_deterministic_algorithms(True);
- empty inputs, and the reference's errors (duplicate sites, rows outside the grid, bad pairs).
"""

from __future__ import annotations

import functools

import pytest
import torch

from mu_space.ops import _opdef, _sparse, _sparse_native
from mu_space.ops.sparse_conv import sparse_conv
from mu_space.ops.sparse_maxpool import sparse_maxpool
from mu_space.ops.sparse_rulebook import sparse_rulebook
from mu_space.testing import lidar, tolerances
from tests.helpers import forbid_host_sync, native_gpu_device

CONFIG = "centerpoint-0075-nus"
SPARSE_SHAPE = [41, 1440, 1440]  # CenterPoint's SparseEncoder: grid z 40 + 1


@functools.lru_cache(maxsize=2)
def _frames(frames: int, keep: int):
    """(indices [N, 4] int32 (b, z, y, x) on the GPU, batch): voxels of `frames` generated
    nuScenes frames on the CenterPoint grid, the first `keep` of each (a subset: the reference
    paths stay quick), made on the GPU by the reference voxelization."""
    from mu_space.ops.voxelization import voxelization

    device = native_gpu_device()
    vs, pcr, max_pts, max_vox = lidar.layer_args(CONFIG)
    rows = []
    for b, pts in enumerate(lidar.batch(lidar.VOXEL_CONFIGS[CONFIG].cloud, frames)):
        _, coors, _ = voxelization(pts.to(device), vs, pcr, max_pts, max_vox, backend="reference")
        rows.append(torch.nn.functional.pad(coors[:keep], (1, 0), value=b))
    return torch.cat(rows).to(torch.int32), frames


def lidar_indices(frames=2, keep=20000):
    idx, batch = _frames(frames, keep)
    return idx.clone(), batch


LAYERS = {
    "subm k3": (3, 1, 1, 1, 0, True, False),
    "strided k3 s2 p1": (3, 2, 1, 1, 0, False, False),
    "second (3, 1, 1) s (2, 1, 1)": ([3, 1, 1], [2, 1, 1], 0, 1, 0, False, False),
    "subm k3 dilation 2": (3, 1, 2, 2, 0, True, False),
    "transposed k2 s2": (2, 2, 0, 1, 0, False, True),
}


def _rulebook(idx, batch, layer, backend, shape=SPARSE_SHAPE):
    return sparse_rulebook(idx, batch, shape, *LAYERS[layer], backend=backend)


class _Taken(list):
    """The stages called, and the path asked for (`path`)."""


@pytest.fixture(params=["bitmap", "sort"])
def rulebook_path(request, monkeypatch):
    """Strided / transposed rule books on one output-site path: "bitmap" for every grid (up to
    the bitmap's word limit), "sort" for none; -> the list of the paths' first stages called."""
    if request.param == "bitmap":
        monkeypatch.setattr(_sparse_native, "BITMAP_CELLS_PER_CANDIDATE", 2**40)
    else:
        monkeypatch.setattr(_sparse_native, "BITMAP_ENABLED", False)
    taken = _Taken()
    for name, stage in (("bitmap", "rulebook_mark"), ("sort", "rulebook_candidates")):
        fn = getattr(_sparse_native, stage)

        def spy(*a, _fn=fn, _name=name):
            taken.append(_name)
            return _fn(*a)

        monkeypatch.setattr(_sparse_native, stage, spy)
    taken.path = request.param
    return taken


@pytest.mark.gpu
@pytest.mark.parametrize("layer", list(LAYERS))
def test_rulebook_equals_the_reference_element_by_element(layer, rulebook_path):
    idx, batch = lidar_indices()
    if LAYERS[layer][-1]:  # transposed: on the down-sampled sites (a decoder's input)
        idx = _rulebook(idx, batch, "strided k3 s2 p1", "reference").out_indices
        shape = _sparse.conv_output_size(SPARSE_SHAPE, [3] * 3, [2] * 3, [1] * 3, [1] * 3)
    else:
        shape = SPARSE_SHAPE
    want = _rulebook(idx, batch, layer, "reference", shape)
    with _opdef.poisoned_outputs():
        got = _rulebook(idx, batch, layer, "native", shape)
    for name, g, w in zip(("out_indices", "indice_pairs", "indice_pair_num"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{layer}: {name} differs"
    assert rulebook_path == ([] if LAYERS[layer][5] else [rulebook_path.path])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_rulebook_of_small_odd_grids_equals_the_reference(rulebook_path, batch):
    """Grids whose cells are no multiple of 32 (the bitmap's last word partly outside), sites
    on the grid's faces and corners, every batch, each layer of LAYERS."""
    device = native_gpu_device()
    shape = [7, 13, 11]
    gen = torch.Generator().manual_seed(batch)
    cells = batch * 7 * 13 * 11
    keys = torch.randperm(cells, generator=gen)[: cells // 3]
    keys = torch.cat([keys, torch.tensor([0, cells - 1])]).unique()
    b, rest = keys // (7 * 13 * 11), keys % (7 * 13 * 11)
    idx = torch.stack([b, rest // (13 * 11), rest // 11 % 13, rest % 11], 1)
    idx = idx[torch.randperm(len(idx), generator=gen)].to(torch.int32).to(device)
    for layer in LAYERS:
        want = _rulebook(idx, batch, layer, "reference", shape)
        with _opdef.poisoned_outputs():
            got = _rulebook(idx, batch, layer, "native", shape)
        for name, g, w in zip(("out_indices", "indice_pairs", "indice_pair_num"), got, want):
            assert g.shape == w.shape and torch.equal(g, w), f"{layer}: {name} differs"
    assert rulebook_path == [rulebook_path.path] * 3  # the three strided / transposed layers


# SubM geometries (kernel_size, padding, dilation): mirrored ones (2 padding = (kernel_size - 1)
# dilation on every axis) take sparse_rulebook_subm's mirror lookups by default, the others
# look up every offset
SUBM_GEOMETRIES = {
    "k3 (mirrored)": ([3] * 3, [1] * 3, [1] * 3),
    "k3 dilation 2 (mirrored)": ([3] * 3, [2] * 3, [2] * 3),
    "k5 (mirrored)": ([5] * 3, [2] * 3, [1] * 3),
    "k2 dilation 2 pad 1 (mirrored, no centre)": ([2] * 3, [1] * 3, [2] * 3),
    "(3, 1, 5) pad (1, 0, 2) (mirrored)": ([3, 1, 5], [1, 0, 2], [1] * 3),
    "k3 pad 0 (not mirrored)": ([3] * 3, [0] * 3, [1] * 3),
    "k3 pad (1, 1, 0) (not mirrored)": ([3] * 3, [1, 1, 0], [1] * 3),
}


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["packed", "int64"])
@pytest.mark.parametrize("mirror", [True, False], ids=["mirror", "every-offset"])
@pytest.mark.parametrize("geometry", list(SUBM_GEOMETRIES))
def test_subm_rulebook_with_and_without_mirror_lookups_equals_the_reference(
    monkeypatch, geometry, mirror, table
):
    """12000 sites (6 tiles of 2048 inputs, the last one partial) in voxel order and shuffled (a
    tile's mirrored pairs then land in every tile), on either hash table: pairs, counts and
    sites equal the reference's element by element, outputs poisoned."""
    monkeypatch.setattr(_sparse_native, "SUBM_MIRROR", mirror)
    monkeypatch.setattr(_sparse_native, "packed_table_allowed", lambda: table == "packed")
    ksize, padding, dilation = SUBM_GEOMETRIES[geometry]
    idx, batch = lidar_indices(keep=6000)
    perm = torch.randperm(len(idx), generator=torch.Generator().manual_seed(3)).to(idx.device)
    for sites in (idx, idx[perm].contiguous()):
        args = (batch, SPARSE_SHAPE, ksize, [1] * 3, padding, dilation, [0] * 3, True, False)
        want = sparse_rulebook(sites, *args, backend="reference")
        with _opdef.poisoned_outputs():
            got = sparse_rulebook(sites.clone(), *args, backend="native")
        for name, g, w in zip(("out_indices", "indice_pairs", "indice_pair_num"), got, want):
            assert g.shape == w.shape and torch.equal(g, w), f"{geometry}: {name} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("mirror", [True, False], ids=["mirror", "every-offset"])
def test_subm_rulebook_over_a_grid_of_more_than_2_31_cells(monkeypatch, mirror):
    """batch 3 x [64, 4096, 4096] (3 * 2^30 cells: keys beyond the packed table's 31 bits, so
    sparse_rulebook_subm takes the int64-key table even where the packed one is allowed): the
    frame's sites, shifted towards the far corner of the grid, in three samples, give the
    reference's rule book."""
    monkeypatch.setattr(_sparse_native, "SUBM_MIRROR", mirror)
    monkeypatch.setattr(_sparse_native, "packed_table_allowed", lambda: True)
    idx, _ = lidar_indices(keep=3000)
    shape = [64, 4096, 4096]
    sites = idx.clone()
    sites[:, 0] = torch.arange(len(sites), device=sites.device) % 3
    sites[:, 1:] += torch.tensor([20, 2600, 2600], dtype=torch.int32, device=sites.device)
    sites = torch.unique(sites, dim=0)
    sites = sites[torch.randperm(len(sites), generator=torch.Generator().manual_seed(4))]
    args = (3, shape, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False)
    want = sparse_rulebook(sites, *args, backend="reference")
    with _opdef.poisoned_outputs():
        got = sparse_rulebook(sites.clone(), *args, backend="native")
    for name, g, w in zip(("out_indices", "indice_pairs", "indice_pair_num"), got, want):
        assert g.shape == w.shape and torch.equal(g, w), name
    assert int(want.indice_pair_num.sum()) > len(sites)  # pairs beyond the centre offset's


@pytest.mark.gpu
def test_rulebook_order_of_the_input_rows_only_permutes_subm():
    idx, batch = lidar_indices(keep=5000)
    perm = torch.randperm(len(idx), device=idx.device, generator=None)
    for layer in ("subm k3", "strided k3 s2 p1"):
        want = _rulebook(idx[perm], batch, layer, "reference")
        got = _rulebook(idx[perm], batch, layer, "native")
        assert all(torch.equal(g, w) for g, w in zip(got, want)), layer


def _feats(n, c, dtype, seed):
    device = native_gpu_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, c, device=device, generator=gen).to(dtype)


CONVS = [
    ("subm k3", 16, 32, False),
    ("strided k3 s2 p1", 16, 32, False),
    ("strided k3 s2 p1", 32, 16, True),  # the inverse conv of that layer
    ("second (3, 1, 1) s (2, 1, 1)", 5, 7, False),  # odd channels: the scalar path
    ("subm k3", 4, 3, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("layer", "c_in", "c_out", "inverse"), CONVS)
def test_conv_forward_and_backward_match_the_reference(layer, c_in, c_out, inverse, dtype):
    idx, batch = lidar_indices(keep=8000)
    rb = _rulebook(idx, batch, layer, "reference")
    n_in, n_out = (len(rb.out_indices), len(idx)) if inverse else (len(idx), len(rb.out_indices))
    K = rb.indice_pairs.shape[0]
    x = _feats(n_in, c_in, dtype, 1).requires_grad_()
    w = _feats(K, c_in * c_out, torch.float32, 2).reshape(K, c_in, c_out) / (K * c_in) ** 0.5
    w = w.to(dtype).requires_grad_()
    args = (rb.indice_pairs, rb.indice_pair_num, n_out, inverse)
    want = sparse_conv(x, w, *args, backend="reference")
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(n_out, c_out, dtype, 3)
    want_g = torch.autograd.grad(want, (x, w), g)
    with _opdef.poisoned_outputs():
        got_g = torch.autograd.grad(got, (x, w), g)
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


@pytest.mark.gpu
def test_conv_is_bit_exact_under_deterministic_algorithms():
    idx, batch = lidar_indices(keep=8000)
    rb = _rulebook(idx, batch, "strided k3 s2 p1", "native")
    x = _feats(len(idx), 16, torch.float16, 4).requires_grad_()
    w = (_feats(27, 16 * 32, torch.float32, 5).reshape(27, 16, 32) / 20).half().requires_grad_()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, len(rb.out_indices),
                              backend="native")  # fmt: skip
            runs.append((out, *torch.autograd.grad(out, (x, w), torch.ones_like(out))))
        rbs = [_rulebook(idx, batch, "strided k3 s2 p1", "native") for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert all(torch.equal(a, b) for a, b in zip(*rbs))


# ------------------------------------------------------------------ the im2col conv path

IM2COL_CONVS = [
    ("subm k3", 16, 16, False),
    ("strided k3 s2 p1", 16, 32, False),
    ("strided k3 s2 p1", 32, 16, True),  # inverse
    ("second (3, 1, 1) s (2, 1, 1)", 5, 7, False),  # odd channels: the scalar loads
]


def _im2col_case(layer, c_in, c_out, inverse, dtype, backend="native", keep=8000, seed=11):
    """(args of sparse_conv, x, w) on a rule book of `backend` (native: valid by construction,
    no synchronisation; reference: checked once), x and w requiring grad."""
    idx, batch = lidar_indices(keep=keep)
    rb = _rulebook(idx, batch, layer, backend)
    n_in, n_out = (len(rb.out_indices), len(idx)) if inverse else (len(idx), len(rb.out_indices))
    K = rb.indice_pairs.shape[0]
    x = _feats(n_in, c_in, dtype, seed).requires_grad_()
    w = _feats(K, c_in * c_out, torch.float32, seed + 1).reshape(K, c_in, c_out)
    w = (w / (K * c_in) ** 0.5).to(dtype).requires_grad_()
    return (rb.indice_pairs, rb.indice_pair_num, n_out, inverse), x, w


def _took_im2col(args, n_in):
    from mu_space.ops import _sparse_native

    pairs, num, n_out, inverse = args
    return bool(_sparse_native.NEIGHBOUR_MAPS.get(pairs, num, n_in, n_out, inverse))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", ["one", "chunked"])
@pytest.mark.parametrize("rule_book", ["native", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("layer", "c_in", "c_out", "inverse"), IM2COL_CONVS)
def test_im2col_conv_matches_the_reference(
    monkeypatch, layer, c_in, c_out, inverse, dtype, rule_book, chunk
):
    """The im2col path (neighbour maps, one GEMM per chunk of rows) within the tolerance table;
    "chunked": a budget of 2^16 elements, so every GEMM is split into tens of row blocks (a
    partial last one)."""
    from mu_space.ops import _sparse_native

    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", "im2col")  # float32 too
    if chunk == "chunked":
        monkeypatch.setattr(_sparse_native, "IM2COL_CHUNK_ELEMENTS", 1 << 16)
    args, x, w = _im2col_case(layer, c_in, c_out, inverse, dtype, rule_book)
    want = sparse_conv(x, w, *args, backend="reference")
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    assert _took_im2col(args, len(x))
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(len(want), c_out, dtype, 13)
    want_g = torch.autograd.grad(want, (x, w), g)
    with _opdef.poisoned_outputs():
        got_g = torch.autograd.grad(got, (x, w), g)
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["im2col", "implicit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_im2col_conv_is_bit_exact_under_deterministic_algorithms(monkeypatch, dtype, gemm):
    from mu_space.ops import _sparse_native

    monkeypatch.setattr(_sparse_native, "IM2COL_CHUNK_ELEMENTS", 1 << 16)  # several chunks
    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", gemm)
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0)  # the mask order rebuilt too
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_UNVERIFIED", "")
    args, x, w = _im2col_case("subm k3", 32, 32, False, dtype)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            _sparse_native.NEIGHBOUR_MAPS.clear()  # the maps rebuilt too
            out = sparse_conv(x, w, *args, backend="native")
            runs.append((out, *torch.autograd.grad(out, (x, w), torch.ones_like(out))))
    finally:
        torch.use_deterministic_algorithms(False)
    assert _took_im2col(args, len(x))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # im2col, implicit GEMM
@pytest.mark.parametrize("layer", ["subm k3", "strided k3 s2 p1"])
def test_im2col_conv_of_a_native_rule_book_does_not_synchronise(layer, dtype):
    """A rule book from the native sparse_rulebook is valid by construction: its convolutions
    (maps, forward, backward) read nothing back from the GPU."""
    import importlib

    from mu_space.ops import _sparse_native

    conv_module = importlib.import_module("mu_space.ops.sparse_conv")
    args, x, w = _im2col_case(layer, 16, 16, False, dtype)
    x, w = x.detach(), w.detach()
    c = conv_module._check(x, w, *args)
    g = _feats(args[2], 16, dtype, 15)
    _sparse_native.gemm_dtype(x)  # the one-time probe of torch.mm's out_dtype, outside
    with forbid_host_sync(x.device):
        out = _sparse_native.conv_native(c, x, w, *args)
        grads = _sparse_native.conv_backward_native(
            c, g, x, w, *args, needs=(True, True), deterministic=True
        )
    assert _took_im2col(args, len(x))
    want = conv_module.sparse_conv_reference(x, w, *args)
    tolerances.assert_close(out, want, op="sparse_conv")
    want_g = conv_module.sparse_conv_backward_reference(g, x, w, *args)
    tolerances.assert_close(grads, want_g, op="sparse_conv", name="grad")


# ------------------------------------------------------------------ the implicit GEMM

IMPLICIT_CONVS = [
    *IM2COL_CONVS,
    ("subm k3", 64, 128, False),  # 4 channel steps per offset, 2 column blocks
    ("subm k3", 20, 70, False),  # a partial channel step (vector loads), a partial column block
    ("subm k3", 3, 1, False),  # scalar loads, one output column
]


@pytest.mark.gpu
@pytest.mark.parametrize("row_order", ["masks", "masks-subm", "sites"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("layer", "c_in", "c_out", "inverse"), IMPLICIT_CONVS)
def test_implicit_gemm_conv_matches_the_reference(monkeypatch, layer, c_in, c_out, inverse,
                                                  dtype, row_order):  # fmt: skip
    """sparse_conv_implicit_gemm for the forward and the input gradient, sparse_conv_implicit_wgrad
    for the weight gradient (every dtype forced: MUSPACE_SPARSE_CONV_GEMM=implicit), the rows in
    mask order (ROW_ORDER_MIN_ROWS lowered for these small rule books) or site order, within
    the tolerance table; no im2col anywhere. masks-subm: a SubM layer's out_map in mask order
    too (SUBM_ORDER_MIN_CHANNEL_PRODUCT 1)."""
    from mu_space.ops import _sparse_native
    from tests.helpers import recording_entry_points

    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", "implicit")
    masks = row_order.startswith("masks")
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0 if masks else 2**40)
    subm_order = 1 if row_order == "masks-subm" else 0
    monkeypatch.setattr(_sparse_native, "SUBM_ORDER_MIN_CHANNEL_PRODUCT", subm_order)
    monkeypatch.setattr(_sparse_native, "ROW_ORDER_UNVERIFIED", "")  # the kernel under test
    args, x, w = _im2col_case(layer, c_in, c_out, inverse, dtype)
    want = sparse_conv(x, w, *args, backend="reference")
    called = recording_entry_points(monkeypatch)
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    assert called.count("sparse_conv_implicit_gemm") == 1
    assert "sparse_conv_im2col" not in called
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(len(want), c_out, dtype, 13)
    want_g = torch.autograd.grad(want, (x, w), g)
    with _opdef.poisoned_outputs():
        got_g = torch.autograd.grad(got, (x, w), g)
    assert called.count("sparse_conv_implicit_gemm") == 2  # + the input gradient
    assert called.count("sparse_conv_implicit_wgrad") == 1 and "sparse_conv_im2col" not in called
    # a strided rule book's input side (in_map; an inverse conv's out_map), with masks-subm a SubM
    # layer's out_map: one order, cached between the calls
    ordered = masks and (not layer.startswith("subm") or bool(subm_order))
    assert called.count("sparse_conv_row_order") == int(ordered)
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # SIMT, tensor-core kernels
@pytest.mark.parametrize(("layer", "c_in", "c_out", "inverse"), IM2COL_CONVS)
def test_the_row_order_changes_no_forward_bit(monkeypatch, layer, c_in, c_out, inverse, dtype):
    """Each output is one thread's sum in (offset, channel) order wherever its row sits in the
    tiles, and a skipped step adds nothing: the forward and the input gradient in mask order
    (a strided rule book's input side: the inverse forward, the strided input gradient) equal
    site order's bit for bit; the weight gradient (rows summed in another order) within the
    tolerance table."""
    from mu_space.ops import _sparse_native

    monkeypatch.setattr(_sparse_native, "ROW_ORDER_UNVERIFIED", "")  # the kernel under test
    args, x, w = _im2col_case(layer, c_in, c_out, inverse, dtype)
    g = _feats(args[2], c_out, dtype, 17)
    runs = {}
    for order in ("masks", "sites"):
        monkeypatch.setattr(_sparse_native, "ROW_ORDER_MIN_ROWS", 0 if order == "masks" else 2**40)
        _sparse_native.ROW_ORDERS.clear()
        with _opdef.poisoned_outputs():
            out = sparse_conv(x, w, *args, backend="native")
            runs[order] = (out, *torch.autograd.grad(out, (x, w), g))
    (out_a, gx_a, gw_a), (out_b, gx_b, gw_b) = runs["masks"], runs["sites"]
    assert torch.equal(out_a, out_b) and torch.equal(gx_a, gx_b)
    tolerances.assert_close(gw_a, gw_b, op="sparse_conv", name="grad_weight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("layer", "c_in", "c_out", "inverse"), IMPLICIT_CONVS)
def test_16_bit_convs_take_the_tensor_core_gemm_by_default(monkeypatch, layer, c_in, c_out,
                                                          inverse, dtype):  # fmt: skip
    """The default choice on a CUDA build and an sm_80+ GPU: 16-bit forward and input gradient
    by sparse_conv_implicit_gemm (its tensor-core kernel), the weight gradient by im2col +
    torch.mm, within the tolerance table."""
    from mu_space.ops import _sparse_native
    from mu_space.runtime import native
    from tests.helpers import recording_entry_points

    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", "auto")
    args, x, w = _im2col_case(layer, c_in, c_out, inverse, dtype)
    cuda = native.build_facts().get("backend") == "cuda" and x.device.type == "cuda"
    expected = cuda and torch.cuda.get_device_capability(x.device)[0] >= 8
    assert _sparse_native.tensor_core_gemm(x.device) == expected
    if not expected:
        pytest.skip("no tensor-core implicit GEMM here (MUSA, or CUDA before sm_80)")
    want = sparse_conv(x, w, *args, backend="reference")
    called = recording_entry_points(monkeypatch)
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    assert called.count("sparse_conv_implicit_gemm") == 1 and "sparse_conv_im2col" not in called
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(len(want), c_out, dtype, 13)
    want_g = torch.autograd.grad(want, (x, w), g)
    with _opdef.poisoned_outputs():
        got_g = torch.autograd.grad(got, (x, w), g)
    assert called.count("sparse_conv_implicit_gemm") == 2  # + the input gradient
    assert "sparse_conv_implicit_wgrad" not in called and "sparse_conv_im2col" in called
    assert got_g[0].dtype == got_g[1].dtype == dtype
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", ["default", "never"])
def test_wide_float32_forwards_take_the_per_offset_path(monkeypatch, threshold):
    """A float32 forward of C_in * C_out >= PER_OFFSET_MIN_CHANNEL_PRODUCT (128 -> 128 here)
    and enough output rows (PER_OFFSET_MIN_ROWS, lowered here) gathers, multiplies per offset
    (torch.mm) and scatters, with no neighbour maps and no implicit GEMM; with the threshold
    off (0) it takes the implicit GEMM. Both within the tolerance table, and the backward is
    unchanged by the choice."""
    from mu_space.ops import _sparse_native
    from tests.helpers import recording_entry_points

    monkeypatch.setattr(_sparse_native, "GEMM_CHOICE", "auto")
    if threshold == "never":
        monkeypatch.setattr(_sparse_native, "PER_OFFSET_MIN_CHANNEL_PRODUCT", 0)
    rows = _sparse_native.PER_OFFSET_MIN_ROWS
    wide = _sparse_native.use_per_offset_forward(torch.float32, 128, 128, rows)
    assert wide == (threshold == "default")
    assert not _sparse_native.use_per_offset_forward(torch.float32, 128, 128, rows - 1)
    assert not _sparse_native.use_per_offset_forward(torch.float32, 64, 128, rows)
    assert not _sparse_native.use_per_offset_forward(torch.float16, 128, 128, rows)
    monkeypatch.setattr(_sparse_native, "PER_OFFSET_MIN_ROWS", 1)
    args, x, w = _im2col_case("subm k3", 128, 128, False, torch.float32, keep=3000)
    want = sparse_conv(x, w, *args, backend="reference")
    called = recording_entry_points(monkeypatch)
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    if threshold == "default":
        assert "sparse_conv_gather" in called and "sparse_conv_scatter" in called
        assert "sparse_conv_implicit_gemm" not in called and "sparse_conv_maps" not in called
    else:
        assert called.count("sparse_conv_implicit_gemm") == 1
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(len(want), 128, torch.float32, 13)
    want_g = torch.autograd.grad(want, (x, w), g)
    with _opdef.poisoned_outputs():
        got_g = torch.autograd.grad(got, (x, w), g)
    tolerances.assert_close(got_g, want_g, op="sparse_conv", name="grad")


def _gathered_products(src, neighbour_map, weight):
    """float64 sum_k src[map[:, k]] @ weight[k], 0 where map is -1 or not a row of src."""
    n, c = src.shape
    rows = neighbour_map.long()
    rows = rows.where((rows >= 0) & (rows < n), n)
    padded = torch.cat((src.double(), src.new_zeros(1, c, dtype=torch.float64)))
    return torch.einsum("rkc,kcn->rn", padded[rows], weight.double())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_float32", [False, True])
@pytest.mark.parametrize(
    ("rows", "K", "c_in", "c_out"),
    [(1, 1, 1, 1), (130, 27, 16, 16), (65, 8, 33, 65), (200, 3, 4, 32)],
)
@pytest.mark.parametrize("ordered", [False, True])
def test_implicit_gemm_entry_against_float64(dtype, out_float32, rows, K, c_in, c_out, ordered):
    """The entry point on random maps with -1 and out-of-range rows (both gather zeros; the
    conv never passes the latter), row counts off the 64-row tiles, and an offset no row
    has (skipped), with and without a row order (a random permutation: the tiles take the rows
    in that order, each row's result in its own place), against float64: one rounding of a
    float32 sum."""
    from mu_space.runtime import native

    device = native_gpu_device()
    n = 50
    gen = torch.Generator(device="cpu").manual_seed(rows + K + c_in)
    nbr = torch.randint(-1, n + 3, (rows, K), generator=gen, dtype=torch.int32)
    nbr[:, K // 2] = -1  # an offset with no neighbour anywhere
    src = torch.randn(n, c_in, generator=gen).to(device, dtype)
    w = (torch.randn(K, c_in, c_out, generator=gen) / (K * c_in) ** 0.5).to(device, dtype)
    nbr = nbr.to(device)
    out = torch.full((rows, c_out), float("nan"), device=device,
                     dtype=torch.float32 if out_float32 else dtype)  # fmt: skip
    order = torch.randperm(rows, generator=gen).to(device, torch.int32) if ordered else None
    native.function("sparse_conv_implicit_gemm")(src, nbr, w, out, order, 0)
    assert not out.isnan().any(), "an element of the NaN-poisoned output was not written"
    want = _gathered_products(src, nbr, w)
    # float32 accumulation: |error| <= (terms) * 2^-24 * sum |products|, far below 1e-5 of the
    # largest output; a 16-bit output adds its one rounding (the table's 16-bit row)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    scale = float(want.abs().max()) + 1e-30
    err = float((out.double() - want).abs().max())
    assert out.dtype == (torch.float32 if out_float32 else dtype)
    limit = 1e-5 if out_float32 else tol[dtype]
    assert err <= limit * scale, f"max |out - float64| {err:.3g} > {limit} x {scale:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize(
    ("rows", "K", "c_in", "c_out"),
    [(1, 1, 1, 1), (1000, 27, 16, 16), (333, 9, 33, 65), (200, 3, 4, 128)],
)
@pytest.mark.parametrize("ordered", [False, True])
def test_implicit_wgrad_entry_against_float64(dtype, splits, rows, K, c_in, c_out, ordered):
    """The weight gradient entry point: random maps with -1 and out-of-range rows (zeros), an
    offset no row has, row counts off the 32-row steps, more splits than row steps (empty
    splits), with and without a row order (a random permutation), against float64."""
    from mu_space.runtime import native

    device = native_gpu_device()
    n = 60
    gen = torch.Generator(device="cpu").manual_seed(rows + K + c_in + splits)
    nbr = torch.randint(-1, n + 3, (rows, K), generator=gen, dtype=torch.int32)
    nbr[:, K // 2] = -1
    src = torch.randn(n, c_in, generator=gen).to(device, dtype)
    grad = torch.randn(rows, c_out, generator=gen).to(device, dtype)
    nbr = nbr.to(device)
    partial = torch.full((splits, K, c_in, c_out), float("nan"), device=device)
    out = torch.full((K, c_in, c_out), float("nan"), device=device)
    order = torch.randperm(rows, generator=gen).to(device, torch.int32) if ordered else None
    native.function("sparse_conv_implicit_wgrad")(src, nbr, grad, partial, out, order, 0)
    rows_l = nbr.long().where((nbr >= 0) & (nbr < n), n)
    padded = torch.cat((src.double(), torch.zeros(1, c_in, dtype=torch.float64, device=device)))
    want = torch.einsum("rkc,rn->kcn", padded[rows_l], grad.double())
    assert not out.isnan().any(), "an element of the NaN-poisoned output was not written"
    scale = float(want.abs().max()) + 1e-30
    err = float((out.double() - want).abs().max())
    # float32 sums of at most `rows` 16-bit or float32 products: far below 1e-5 of the largest
    assert err <= 1e-5 * scale, f"max |out - float64| {err:.3g} > 1e-5 x {scale:.3g}"


@pytest.mark.gpu
def test_implicit_gemm_entry_rejects_bad_arguments():
    from mu_space.runtime import native

    device = native_gpu_device()
    fn = native.function("sparse_conv_implicit_gemm")
    src = torch.randn(10, 8, device=device)
    nbr = torch.zeros(4, 27, dtype=torch.int32, device=device)
    w = torch.randn(27, 8, 16, device=device)
    out = torch.empty(4, 16, device=device)
    with pytest.raises(TypeError, match="weight"):
        fn(src, nbr, w.half(), out, None, 0)
    with pytest.raises(ValueError, match="weight"):
        fn(src, nbr, w[:26].contiguous(), out, None, 0)
    with pytest.raises(ValueError, match="out"):
        fn(src, nbr, w, out[:3].contiguous(), None, 0)
    with pytest.raises(TypeError, match="map"):
        fn(src, nbr.long(), w, out, None, 0)
    with pytest.raises(ValueError, match="src"):
        fn(src.t(), nbr, w, out, None, 0)
    order = torch.arange(4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="row_order"):
        fn(src, nbr, w, out, order[:3], 0)
    with pytest.raises(TypeError, match="row_order"):
        fn(src, nbr, w, out, order.long(), 0)
    wgrad = native.function("sparse_conv_implicit_wgrad")
    grad = torch.randn(4, 16, device=device)
    partial = torch.empty(2, 27, 8, 16, device=device)
    with pytest.raises(TypeError, match="grad"):
        wgrad(src, nbr, grad.half(), partial, w, None, 0)
    with pytest.raises(ValueError, match="partial"):
        wgrad(src, nbr, grad, partial[:, :26].contiguous(), w, None, 0)
    with pytest.raises(ValueError, match="partial"):
        wgrad(src, nbr, grad, torch.empty(0, 27, 8, 16, device=device), w, None, 0)
    with pytest.raises(ValueError, match="grad_weight"):
        wgrad(src, nbr, grad, partial, w[:, :7].contiguous(), None, 0)
    with pytest.raises(ValueError, match="row_order"):
        wgrad(src, nbr, grad, partial, w, order[:3], 0)


@pytest.mark.gpu
def test_row_order_entry_and_a_row_order_with_bad_entries():
    """sparse_conv_row_order against PyTorch (stable sorts of the masks, bit 31 too, within
    windows of 4096 rows, a partial last one) and its K limit; row-order entries outside
    [0, rows) are positions that do nothing (never dereferenced): the rows still listed get
    their sums, the others keep the poison."""
    from mu_space.ops import _sparse_native
    from mu_space.runtime import native

    device = native_gpu_device()
    gen = torch.Generator(device="cpu").manual_seed(7)
    order_fn = native.function("sparse_conv_row_order")
    window = _sparse_native.ROW_ORDER_WINDOW
    for rows, K in ((1, 1), (300, 27), (2 * window + 77, 32), (window, 3)):
        nbr = torch.randint(-1, 5, (rows, K), generator=gen, dtype=torch.int32)
        nbr[::7] = -1  # rows without neighbours: mask 0
        order = torch.full((rows,), -1, dtype=torch.int32, device=device)
        order_fn(nbr.to(device), order, 0)
        masks = ((nbr >= 0).long() << torch.arange(K)).sum(1)
        want = torch.cat([torch.sort(masks[i : i + window], stable=True).indices + i
                          for i in range(0, rows, window)])  # fmt: skip
        assert torch.equal(order.cpu().long(), want)
    with pytest.raises(ValueError, match="at most 32"):
        order_fn(torch.zeros(3, 33, dtype=torch.int32, device=device),
                 torch.empty(3, dtype=torch.int32, device=device), 0)  # fmt: skip
    with pytest.raises(ValueError, match="order"):
        order_fn(nbr.to(device), order[:5], 0)
    rows, K, c = 200, 27, 16
    src = torch.randn(50, c, generator=gen).to(device)
    nbr = torch.randint(-1, 50, (rows, K), generator=gen, dtype=torch.int32).to(device)
    w = (torch.randn(K, c, c, generator=gen) / (K * c) ** 0.5).to(device)
    order = torch.randperm(rows, generator=gen).to(device, torch.int32)
    kept = order.clone()
    order[::3] = torch.tensor([-1, rows, 2**31 - 1], dtype=torch.int32, device=device).repeat(
        (rows + 2) // 3
    )[: len(order[::3])]
    out = torch.full((rows, c), float("nan"), device=device)
    native.function("sparse_conv_implicit_gemm")(src, nbr, w, out, order, 0)
    listed = torch.zeros(rows, dtype=torch.bool, device=device)
    listed[kept[1::3].long()] = True
    listed[kept[2::3].long()] = True
    want = _gathered_products(src, nbr, w)
    assert out[~listed].isnan().all()
    err = float((out[listed].double() - want[listed]).abs().max())
    assert err <= 1e-5 * float(want.abs().max())  # one rounding of a float32 sum, as above


@pytest.mark.gpu
def test_a_rule_book_with_a_repeated_pair_runs_the_reference():
    """A pair listed twice in one offset (outside the rule-book invariant; the reference sums
    both terms): the neighbour maps cannot hold it and the per-offset scatter would race on it,
    so native runs the reference and matches it."""
    args, x, w = _im2col_case("strided k3 s2 p1", 8, 8, False, torch.float32, "reference")
    pairs, num, n_out, inverse = args
    counts = num.tolist()
    k = next(k for k, c in enumerate(counts) if 0 < c < pairs.shape[2])
    pairs, num = pairs.clone(), num.clone()
    pairs[k, :, counts[k]] = pairs[k, :, 0]
    num[k] += 1
    args = (pairs, num, n_out, inverse)
    want = sparse_conv(x, w, *args, backend="reference")
    with _opdef.poisoned_outputs():
        got = sparse_conv(x, w, *args, backend="native")
    assert not _took_im2col(args, len(x))
    tolerances.assert_close(got, want, op="sparse_conv")
    g = _feats(len(want), 8, torch.float32, 14)
    got_g = torch.autograd.grad(got, (x, w), g)
    tolerances.assert_close(got_g, torch.autograd.grad(want, (x, w), g), op="sparse_conv",
                            name="grad")  # fmt: skip


@pytest.mark.gpu
def test_im2col_conv_of_a_rule_book_without_pairs_is_zero():
    device = native_gpu_device()
    pairs = torch.full((27, 2, 5), -1, dtype=torch.int32, device=device)
    num = torch.zeros(27, dtype=torch.int32, device=device)
    x = torch.randn((5, 8), device=device, requires_grad=True)
    w = torch.randn((27, 8, 4), device=device, requires_grad=True)
    with _opdef.poisoned_outputs():
        out = sparse_conv(x, w, pairs, num, 3, backend="native")
    assert _took_im2col((pairs, num, 3, False), 5)
    assert torch.equal(out, torch.zeros(3, 4, device=device))
    gx, gw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert torch.equal(gx, torch.zeros_like(x)) and torch.equal(gw, torch.zeros_like(w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels", [16, 5])
def test_maxpool_matches_the_reference_with_ties_and_nan(dtype, channels):
    idx, batch = lidar_indices(keep=8000)
    rb = _rulebook(idx, batch, "strided k3 s2 p1", "reference")
    m = len(rb.out_indices)
    f = _feats(len(idx), channels, torch.float32, 6).round(decimals=1).to(dtype)  # ties
    f[5, 0], f[100:120] = torch.nan, -torch.inf
    f.requires_grad_()
    want = sparse_maxpool(f, rb.indice_pairs, rb.indice_pair_num, m, backend="reference")
    with _opdef.poisoned_outputs():
        got = sparse_maxpool(f, rb.indice_pairs, rb.indice_pair_num, m, backend="native")
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.detach().nan_to_num(3.0), want.detach().nan_to_num(3.0))
    g = _feats(m, channels, dtype, 7)
    (want_g,) = torch.autograd.grad(want, f, g)
    with _opdef.poisoned_outputs():
        (got_g,) = torch.autograd.grad(got, f, g)
    tolerances.assert_close(got_g, want_g, op="sparse_maxpool", name="grad")


@pytest.mark.gpu
def test_empty_inputs(rulebook_path):
    device = native_gpu_device()
    idx = torch.zeros((0, 4), dtype=torch.int32, device=device)
    for layer in ("subm k3", "strided k3 s2 p1"):
        got = _rulebook(idx, 1, layer, "native")
        want = _rulebook(idx, 1, layer, "reference")
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    pairs = torch.full((27, 2, 0), -1, dtype=torch.int32, device=device)
    num = torch.zeros(27, dtype=torch.int32, device=device)
    x = torch.zeros((0, 4), device=device, requires_grad=True)
    w = torch.ones((27, 4, 8), device=device, requires_grad=True)
    out = sparse_conv(x, w, pairs, num, 3, backend="native")
    assert torch.equal(out, torch.zeros(3, 8, device=device))
    gx, gw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    assert gx.shape == (0, 4) and torch.equal(gw, torch.zeros_like(w))
    pooled = sparse_maxpool(x, pairs, num, 2, backend="native")
    assert torch.equal(pooled, torch.zeros(2, 4, device=device))
    # sites that reach no output (a strided layer whose window misses every site)
    one = torch.tensor([[0, 0, 0, 2]], dtype=torch.int32, device=device)
    for backend in ("reference", "native"):
        rb = sparse_rulebook(one, 1, [1, 1, 3], [1, 1, 2], [1, 1, 2], 0, 1, 0, False, False,
                             backend=backend)  # fmt: skip
        assert rb.out_indices.shape == (0, 4) and int(rb.indice_pair_num.sum()) == 0


@pytest.mark.gpu
def test_native_raises_the_reference_errors(rulebook_path):
    idx, batch = lidar_indices(keep=2000)
    dup = torch.cat([idx, idx[7:8]])
    bad = idx.clone()
    bad[11, 2] = SPARSE_SHAPE[1]
    for layer in ("subm k3", "strided k3 s2 p1"):
        with pytest.raises(ValueError, match="duplicate"):
            _rulebook(dup, batch, layer, "native")
        with pytest.raises(ValueError, match="outside"):
            _rulebook(bad, batch, layer, "native")
    assert rulebook_path == [rulebook_path.path] * 2
    rb = _rulebook(idx, batch, "subm k3", "native")
    x = _feats(len(idx), 4, torch.float32, 8)
    w = torch.ones(27, 4, 4, device=x.device)
    pairs = rb.indice_pairs.clone()
    pairs[3, 1, 0] = len(idx)
    with pytest.raises(ValueError, match="indice_pairs"):
        sparse_conv(x, w, pairs, rb.indice_pair_num, len(idx), backend="native")
    num = rb.indice_pair_num.clone()
    num[0] = len(idx) + 1
    with pytest.raises(ValueError, match="indice_pair_num"):
        sparse_maxpool(x, rb.indice_pairs, num, len(idx), backend="native")


# ------------------------------------------------------ the per-rule-book check cache (CPU)


def test_checked_pairs_entry_lives_with_its_tensors_and_versions():
    """_sparse_native.CHECKED_PAIRS answers only for the same two tensor objects, the same
    sizes and unmodified contents (version counters); inference tensors are never cached."""
    from mu_space.ops._sparse_native import _CheckedPairs

    cache = _CheckedPairs()
    pairs, num = torch.zeros(2, 2, 5, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cache.put(pairs, num, 5, 5, False, ("header", [1, 1], False))
    assert cache.get(pairs, num, 5, 5, False) == ("header", [1, 1], False)
    assert cache.get(pairs, num, 5, 6, False) is None  # other sizes: not checked for them
    assert cache.get(pairs, num, 5, 5, True) is None
    assert cache.get(pairs.clone(), num, 5, 5, False) is None  # another object, same values
    pairs[0, 0, 0] = 3  # in place: the entry is stale
    assert cache.get(pairs, num, 5, 5, False) is None
    cache.put(pairs, num, 5, 5, False, ("h", [1, 1], False))
    num.add_(1)
    assert cache.get(pairs, num, 5, 5, False) is None
    with torch.inference_mode():
        p_inf, n_inf = torch.zeros(2, 2, 5, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cache.put(p_inf, n_inf, 5, 5, False, ("h", [1, 1], False))
    assert cache.get(p_inf, n_inf, 5, 5, False) is None


def test_checked_pairs_is_bounded():
    from mu_space.ops._sparse_native import _CheckedPairs

    cache = _CheckedPairs()
    keep = [(torch.zeros(1, 2, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))]
    for _ in range(cache.MAX_ENTRIES + 10):
        keep.append((torch.zeros(1, 2, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)))
        cache.put(*keep[-1], 1, 1, False, ("h", [0], False))
    assert len(cache._entries) == cache.MAX_ENTRIES
    assert cache.get(*keep[-1], 1, 1, False) is not None  # the newest stay
    assert cache.get(*keep[1], 1, 1, False) is None  # the oldest went


@pytest.mark.gpu
def test_a_rule_book_modified_after_its_check_is_checked_again():
    """The check runs once per rule book (its result cached): writing an out-of-range row into
    the pairs after a successful conv must still be the reference's error on the next call, not
    a gather from a stale check (an illegal access)."""
    from mu_space.ops import _sparse_native

    idx, batch = lidar_indices(keep=2000)
    rb = _rulebook(idx, batch, "subm k3", "native")
    x = _feats(len(idx), 4, torch.float32, 8)
    w = torch.ones(27, 4, 4, device=x.device)
    args = (rb.indice_pair_num, len(idx))
    first = sparse_conv(x, w, rb.indice_pairs, *args, backend="native")
    again = sparse_conv(x, w, rb.indice_pairs, *args, backend="native")  # the cached check
    assert torch.equal(first, again)
    assert _sparse_native.CHECKED_PAIRS.get(rb.indice_pairs, *args, len(idx), False) is not None
    rb.indice_pairs[3, 1, 0] = len(idx)
    with pytest.raises(ValueError, match="indice_pairs"):
        sparse_conv(x, w, rb.indice_pairs, *args, backend="native")


# ------------------------------------------- sites known valid: no flag read (CPU + GPU)


def test_valid_sites_entry_lives_with_its_tensor_grid_and_version():
    """_sparse_native.VALID_SITES answers only for the same tensor object, the same (batch,
    spatial shape) grid and unmodified contents; inference tensors are never recorded."""
    from mu_space.ops._sparse_native import _ValidSites

    sites = _ValidSites()
    idx = torch.zeros(3, 4, dtype=torch.int32)
    grid = (2, (41, 1440, 1440))
    sites.add(idx, grid)
    assert sites.holds(idx, grid)
    assert not sites.holds(idx, (3, (41, 1440, 1440)))  # another batch size
    assert not sites.holds(idx, (2, (21, 720, 720)))  # another grid
    assert not sites.holds(idx.clone(), grid)  # another object, same values
    idx[0, 1] = 5  # in place: no longer known
    assert not sites.holds(idx, grid)
    with torch.inference_mode():
        frozen = torch.zeros(3, 4, dtype=torch.int32)
    sites.add(frozen, grid)
    assert not sites.holds(frozen, grid)
    keep = [torch.zeros(1, 4, dtype=torch.int32) for _ in range(sites.MAX_ENTRIES + 5)]
    for t in keep:
        sites.add(t, grid)
    assert len(sites._entries) == sites.MAX_ENTRIES  # bounded, the newest stay
    assert sites.holds(keep[-1], grid) and not sites.holds(keep[0], grid)


@pytest.mark.gpu
@pytest.mark.parametrize("first", ["subm k3", "strided k3 s2 p1"])
def test_subm_rule_book_over_a_rule_books_sites_does_not_synchronise(first):
    """A SubM rule book over sites a native rule book checked (SubM: the input and its copy;
    strided: the unique decoded keys) reads no flags back, and still equals the reference."""
    idx, batch = lidar_indices(keep=4000)
    rb = _rulebook(idx, batch, first, "native")
    shape = (
        SPARSE_SHAPE
        if first == "subm k3"
        else _sparse.conv_output_size(SPARSE_SHAPE, [3] * 3, [2] * 3, [1] * 3, [1] * 3)
    )
    sites = rb.out_indices
    rulebooks = [(sites, shape)]
    if first == "subm k3":
        rulebooks.append((idx, SPARSE_SHAPE))  # the checked input itself (a SubM layer's output)
    with forbid_host_sync(idx.device):
        got = [_rulebook(t, batch, "subm k3", "native", s) for t, s in rulebooks]
    for (t, s), rb_native in zip(rulebooks, got):
        want = _rulebook(t, batch, "subm k3", "reference", s)
        for a, b in zip(rb_native, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_subm_rule_book_over_fresh_sites_reads_its_flags_inside_its_one_entry_point():
    """Fresh sites: the flags are read back inside sparse_rulebook_subm (its pinned read-back,
    no torch synchronisation), the rule book equals the reference, and a bad site still raises
    the reference's error through the same entry point."""
    idx, batch = lidar_indices(keep=4000)
    fresh = idx.clone()
    with forbid_host_sync(idx.device):  # a torch synchronisation (tolist, item) raises
        got = _rulebook(fresh, batch, "subm k3", "native")
    for a, b in zip(got, _rulebook(fresh, batch, "subm k3", "reference")):
        assert torch.equal(a, b)
    outside = idx.clone()
    outside[7, 2] = SPARSE_SHAPE[1]
    with pytest.raises(ValueError, match="outside"):
        _rulebook(outside, batch, "subm k3", "native")


@pytest.mark.gpu
def test_rule_book_sites_modified_in_place_are_checked_again():
    """Writing a duplicate site into a rule book's output indices makes them unknown again: the
    next SubM rule book reads its flags and raises the reference's duplicate error."""
    idx, batch = lidar_indices(keep=2000)
    sites = _rulebook(idx, batch, "subm k3", "native").out_indices
    sites[1] = sites[0]
    with pytest.raises(ValueError, match="duplicate|repeated|twice"):
        _rulebook(sites, batch, "subm k3", "native")


def test_subm_rule_book_cache_entry_lives_with_its_sites_and_versions():
    """_sparse_native.SUBM_RULEBOOKS answers only for the same sites object and layer, while
    neither the sites nor the rule book's tensors were modified in place."""
    from mu_space.ops._sparse_native import _SubMRuleBooks
    from mu_space.ops.sparse_rulebook import RuleBook

    cache = _SubMRuleBooks()
    idx = torch.zeros(3, 4, dtype=torch.int32)
    rb = RuleBook(idx.clone(), torch.zeros(27, 2, 3, dtype=torch.int32), torch.zeros(27))
    layer = (1, (41, 1440, 1440), (3, 3, 3), (1, 1, 1), (1, 1, 1))
    cache.put(idx, layer, rb)
    assert cache.get(idx, layer) is rb
    assert cache.get(idx, (*layer[:4], (2, 2, 2))) is None  # another dilation
    assert cache.get(idx.clone(), layer) is None
    rb.indice_pairs[0, 0, 0] = 1  # the rule book edited in place: rebuilt next time
    assert cache.get(idx, layer) is None
    cache.put(idx, layer, rb)
    idx[0, 0] = 1  # the sites edited in place
    assert cache.get(idx, layer) is None


@pytest.mark.gpu
def test_second_subm_rule_book_over_the_same_sites_is_the_first_one():
    """Two SubM layers over the same live sites (mmdet3d's SparseBasicBlock convs have no
    indice_key) share one native rule book; a different dilation builds its own, equal to the
    reference."""
    idx, batch = lidar_indices(keep=3000)
    first = _rulebook(idx, batch, "subm k3", "native")
    again = _rulebook(idx, batch, "subm k3", "native")
    assert all(a is b for a, b in zip(first, again))
    dilated = _rulebook(idx, batch, "subm k3 dilation 2", "native")
    assert dilated.indice_pairs is not first.indice_pairs
    for got, layer in ((again, "subm k3"), (dilated, "subm k3 dilation 2")):
        want = _rulebook(idx, batch, layer, "reference")
        for a, b in zip(got, want):
            assert torch.equal(a, b)
