"""sparse_rulebook against an independent statement of the definition: a dense grid of row ids
(-1 = empty) shifted per kernel offset gives every (input, output, offset) triple; the output
sites are where a dense conv of the occupancy grid is nonzero. Everything here is exact
(integers): no tolerance.

Inputs: voxels of generated LiDAR frames (mu_space.testing.lidar, mmcv hard voxelization) and
small random grids; the rules: output order, pair order, SubM keeps the input rows, the
duplicate / out-of-range / batch rules, empty inputs.
"""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from mu_space.ops import _sparse
from mu_space.ops.sparse_rulebook import sparse_rulebook


def random_sites(n, batch, shape, seed=0):
    """n distinct (batch, spatial...) int32 rows in random order."""
    g = torch.Generator().manual_seed(seed)
    volume = batch * int(torch.tensor(shape).prod())
    keys = torch.randperm(volume, generator=g)[:n]
    return _sparse.decode_keys(keys, shape)


def dense_triples(indices, batch, shape, ksize, stride, padding, dilation, subm, transposed,
                  out_shape):  # fmt: skip
    """{k: sorted [(input row, output site tuple)]} by brute force over the kernel window
    (Python over offsets and rows: the tests' sizes are small)."""
    rows = indices.tolist()
    active = {tuple(r): i for i, r in enumerate(rows)}
    triples = {}
    for k, off in enumerate(itertools.product(*[range(k) for k in ksize])):
        got = []
        for i, (b, *p) in enumerate(rows):
            if transposed:
                o = [
                    pi * s - pd + ki * d
                    for pi, s, pd, ki, d in zip(p, stride, padding, off, dilation)
                ]
            else:
                num = [pi + pd - ki * d for pi, pd, ki, d in zip(p, padding, off, dilation)]
                if any(v % s for v, s in zip(num, stride)):
                    continue
                o = [v // s for v, s in zip(num, stride)]
            if not all(0 <= v < m for v, m in zip(o, out_shape)):
                continue
            if subm and (b, *o) not in active:
                continue
            got.append((i, (b, *o)))
        triples[k] = got
    return triples


def _check(rb, indices, batch, shape, ksize, stride, padding, dilation, subm=False,
           transposed=False, output_padding=0):  # fmt: skip
    nd = len(shape)
    if subm:
        out_shape = list(shape)
    elif transposed:
        out_shape = _sparse.deconv_output_size(
            shape, ksize, stride, padding, dilation, [output_padding] * nd
        )
    else:
        out_shape = _sparse.conv_output_size(shape, ksize, stride, padding, dilation)
    want = dense_triples(
        indices, batch, shape, ksize, stride, padding, dilation, subm, transposed, out_shape
    )
    out_sites = [tuple(r) for r in rb.out_indices.tolist()]
    if subm:
        assert torch.equal(rb.out_indices, indices)
    else:
        reached = sorted({o for v in want.values() for _, o in v})
        assert out_sites == reached  # exactly the reached sites, ascending (b, z, y, x)
    K = len(want)
    n = indices.shape[0]
    assert rb.indice_pairs.shape == (K, 2, n) and rb.indice_pairs.dtype == torch.int32
    assert rb.indice_pair_num.dtype == torch.int32
    for k in range(K):
        cnt = int(rb.indice_pair_num[k])
        assert cnt == len(want[k])
        ins = rb.indice_pairs[k, 0, :cnt].tolist()
        outs = rb.indice_pairs[k, 1, :cnt].tolist()
        assert ins == [i for i, _ in want[k]]  # ascending input row
        assert [out_sites[o] for o in outs] == [o for _, o in want[k]]
        assert (rb.indice_pairs[k, :, cnt:] == -1).all()


def test_subm_on_lidar_voxels_matches_the_definition():
    idx, shape = _sparse.tiny_indices("cpu", keep=120)
    rb = sparse_rulebook(idx, 2, shape, 3, 1, 1, 1, 0, True, False)
    _check(rb, idx, 2, shape, [3] * 3, [1] * 3, [1] * 3, [1] * 3, subm=True)
    # the centre offset maps every row to itself
    assert rb.indice_pair_num[13] == idx.shape[0]
    assert torch.equal(rb.indice_pairs[13, 0], rb.indice_pairs[13, 1])


def test_output_sites_are_where_a_dense_conv_of_the_occupancy_is_nonzero():
    idx, shape = _sparse.tiny_indices("cpu", keep=200)
    occ = torch.zeros(2, 1, *shape)
    occ[idx[:, 0].long(), 0, idx[:, 1].long(), idx[:, 2].long(), idx[:, 3].long()] = 1
    for k, s, p, d in [(3, 2, 1, 1), (2, 2, 0, 1), ([3, 1, 1], [2, 1, 1], 0, 1), (3, 1, 0, 2)]:
        rb = sparse_rulebook(idx, 2, shape, k, s, p, d)
        dense = F.conv3d(
            occ, torch.ones(1, 1, *_sparse.int_list(k, "k", 3)), stride=s, padding=p, dilation=d
        )
        want = (dense[:, 0] > 0).nonzero().to(torch.int32)  # row-major = ascending (b, z, y, x)
        assert torch.equal(rb.out_indices, want), (k, s, p, d)


@pytest.mark.parametrize(
    ("ksize", "stride", "padding", "dilation"),
    [([3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1]), ([3, 1, 1], [2, 1, 1], [0, 0, 0], [1, 1, 1]),
     ([2, 3, 2], [1, 2, 1], [0, 1, 1], [1, 1, 1]), ([3, 3, 3], [1, 1, 1], [2, 2, 2], [2, 2, 2])],
)  # fmt: skip
def test_strided_pairs_match_the_definition(ksize, stride, padding, dilation):
    idx = random_sites(60, 2, [5, 7, 6], seed=1)
    rb = sparse_rulebook(idx, 2, [5, 7, 6], ksize, stride, padding, dilation)
    _check(rb, idx, 2, [5, 7, 6], ksize, stride, padding, dilation)


def test_transposed_and_2d_and_dilated_subm_match_the_definition():
    idx = random_sites(30, 2, [4, 5, 4], seed=2)
    rb = sparse_rulebook(idx, 2, [4, 5, 4], 3, 2, 1, 1, 1, transposed=True)
    _check(
        rb, idx, 2, [4, 5, 4], [3] * 3, [2] * 3, [1] * 3, [1] * 3, transposed=True, output_padding=1
    )
    idx2 = random_sites(40, 3, [9, 8], seed=3)
    rb2 = sparse_rulebook(idx2, 3, [9, 8], 3, 2, 1, 1)
    _check(rb2, idx2, 3, [9, 8], [3, 3], [2, 2], [1, 1], [1, 1])
    rb3 = sparse_rulebook(idx2, 3, [9, 8], 3, 1, [2, 2], 2, 0, True)
    _check(rb3, idx2, 3, [9, 8], [3, 3], [1, 1], [2, 2], [2, 2], subm=True)


def test_subm_keeps_input_order_and_strided_output_order_is_independent_of_it():
    idx = random_sites(50, 2, [6, 6, 6], seed=4)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    a = sparse_rulebook(idx, 2, [6, 6, 6], 3, 2, 1)
    b = sparse_rulebook(idx[perm], 2, [6, 6, 6], 3, 2, 1)
    assert torch.equal(a.out_indices, b.out_indices)
    assert torch.equal(a.indice_pair_num, b.indice_pair_num)
    s = sparse_rulebook(idx[perm], 2, [6, 6, 6], 3, 1, 1, 1, 0, True)
    assert torch.equal(s.out_indices, idx[perm])


def test_deterministic_reruns():
    idx, shape = _sparse.tiny_indices("cpu")
    a = sparse_rulebook(idx, 2, shape, 3, 2, 1)
    b = sparse_rulebook(idx, 2, shape, 3, 2, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_empty_input():
    rb = sparse_rulebook(torch.zeros(0, 4, dtype=torch.int32), 1, [4, 4, 4], 3, 2, 1)
    assert rb.out_indices.shape == (0, 4) and rb.indice_pairs.shape == (27, 2, 0)
    assert int(rb.indice_pair_num.sum()) == 0


@pytest.mark.parametrize(
    ("row", "match"),
    [([0, -1, 0, 0], "indices row 3"), ([0, 4, 0, 0], "spatial_shape"), ([2, 0, 0, 0], "batch_size")],
)  # fmt: skip
def test_out_of_range_rows_are_rejected_naming_indices(row, match):
    idx = random_sites(10, 2, [4, 4, 4], seed=5)
    idx[3] = torch.tensor(row, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        sparse_rulebook(idx, 2, [4, 4, 4], 3, 1, 1, 1, 0, True)


def test_duplicates_are_rejected():
    idx = random_sites(10, 1, [4, 4, 4], seed=6)
    idx[7] = idx[2]
    with pytest.raises(ValueError, match=r"indices rows 2 and 7 are the same site"):
        sparse_rulebook(idx, 1, [4, 4, 4], 3, 2, 1)


def test_argument_errors_name_the_argument():
    idx = random_sites(10, 1, [4, 4, 4], seed=7)
    with pytest.raises(TypeError, match="indices must be int32"):
        sparse_rulebook(idx.long(), 1, [4, 4, 4], 3)
    with pytest.raises(ValueError, match="indices must be"):
        sparse_rulebook(idx[:, :1], 1, [4, 4, 4], 3)
    with pytest.raises(ValueError, match="spatial_shape must have 3 values"):
        sparse_rulebook(idx, 1, [4, 4], 3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        sparse_rulebook(idx, 0, [4, 4, 4], 3)
    with pytest.raises(ValueError, match="kernel_size"):
        sparse_rulebook(idx, 1, [4, 4, 4], 17)
    with pytest.raises(ValueError, match="output spatial shape"):
        sparse_rulebook(idx, 1, [4, 4, 4], 5)
    with pytest.raises(ValueError, match="stride"):
        sparse_rulebook(idx, 1, [4, 4, 4], 3, 0)
    with pytest.raises(TypeError, match=r"padding\[0\] must be an integer"):
        sparse_rulebook(idx, 1, [4, 4, 4], 3, 1, [1.5, 1, 1])
    with pytest.raises(ValueError, match="int64 key range"):
        sparse_rulebook(idx, 1, [2**30, 2**30, 2**30], 3)


def test_the_kept_geometry_parse_is_the_full_parse():
    """The geometry's parse is kept per plain value tuple (sparse_rulebook._GEOMETRIES): a kept
    parse equals the parse of the same values given as tensors (never kept), an error is raised
    on every call (never kept), and True never stands for 1."""
    module = importlib.import_module("mu_space.ops.sparse_rulebook")
    idx = random_sites(10, 1, [4, 4, 4], seed=7)
    geometry = (1, [4, 4, 4], [3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1], [0, 0, 0], False, False)
    first = module._parse(idx, *geometry)
    assert module._geometry_key(3, geometry) in module._GEOMETRIES
    assert module._parse(idx, *geometry) == first
    as_tensors = [torch.tensor(v) if isinstance(v, list) else v for v in geometry]
    assert module._geometry_key(3, as_tensors) is None
    assert module._parse(idx, *as_tensors) == first
    assert module._parse(idx[:4], *geometry)["n"] == 4
    for _ in range(2):
        with pytest.raises(TypeError, match="batch_size must be an integer"):
            module._parse(idx, True, *geometry[1:])
        with pytest.raises(TypeError, match=r"kernel_size\[0\] must be an integer"):
            module._parse(idx, 1, [4, 4, 4], [True, 3, 3], *geometry[3:])
        with pytest.raises(ValueError, match="stride"):
            module._parse(idx, 1, [4, 4, 4], 3, 0, *geometry[4:])
