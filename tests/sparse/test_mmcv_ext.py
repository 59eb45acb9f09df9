"""mu_space.sparse.mmcv_ext (mmcv's `_ext` sparse functions: names, argument order, return
layouts, filters [*k, C_in, C_out]) against the spconv-style modules and against mmcv's rules
written as plain per-pair loops (the max pool's zero start, NaN ignored, the gradient to every
input equal to the output). float64 throughout: summation order only (1e-10)."""

from __future__ import annotations

import pytest
import torch

import mu_space.sparse as spconv
from mu_space.ops import _sparse
from mu_space.sparse import mmcv_ext, weights
from tests.helpers import assert_close
from tests.ops.test_sparse_rulebook import random_sites

F64 = {"atol": 1e-10, "rtol": 1e-10}


def _x(seed=0):
    idx, shape = _sparse.tiny_indices("cpu", keep=100)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(idx.shape[0], 4, generator=g, dtype=torch.float64), idx, shape


def test_subm_pairs_and_conv_match_the_module():
    feats, idx, shape = _x()
    layer = spconv.SubMConv3d(4, 6, 3, bias=False).double()
    want = layer(spconv.SparseConvTensor(feats, idx, shape, 2)).features
    out_inds, pairs, num = mmcv_ext.get_indice_pairs_3d_forward(
        idx, 2, shape, shape, [3, 3, 3], [1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0], 1, 0
    )
    assert out_inds is idx  # mmcv returns the input indices for SubM
    # mmdet3d passes batchSize as a 0-d tensor (coors[-1, 0] + 1); pybind11 takes it
    again = mmcv_ext.get_indice_pairs_3d_forward(
        idx, idx[-1, 0] + 1, shape, shape, [3] * 3, [1] * 3, [0] * 3, [1] * 3, [0] * 3, 1, 0
    )
    assert int(idx[-1, 0]) + 1 == 2 and torch.equal(again[1], pairs)
    with pytest.raises(TypeError):  # a float tensor is no integer (pybind11 refuses it too)
        mmcv_ext.get_indice_pairs_3d_forward(
            idx, torch.tensor(2.0), shape, shape, [3] * 3, [1] * 3, [0] * 3, [1] * 3, [0] * 3, 1, 0
        )
    assert pairs.shape == (27, 2, idx.shape[0]) and num.dtype == torch.int32
    filters = weights.from_krsc(layer.weight.detach(), "RSCK")  # mmcv's [*k, C_in, C_out]
    got = mmcv_ext.indice_conv_forward(feats, filters, pairs, num, idx.shape[0], 0, 1)
    assert_close(got, want, **F64)
    bias = torch.randn(6, dtype=torch.float64)
    fused = mmcv_ext.fused_indice_conv_forward(feats, filters, bias, pairs, num, idx.shape[0], 0, 1)
    assert_close(fused, want + bias, **F64)


def test_strided_inverse_and_backward_match_the_modules():
    feats, idx, shape = _x(1)
    down = spconv.SparseConv3d(4, 5, 3, 2, 1, bias=False, indice_key="d").double()
    up = spconv.SparseInverseConv3d(5, 4, 3, indice_key="d", bias=False).double()
    x = spconv.SparseConvTensor(feats.clone().requires_grad_(True), idx, shape, 2)
    y = down(x)
    z = up(y)
    out_shape = y.spatial_shape
    out_inds, pairs, num = mmcv_ext.get_indice_pairs_3d_forward(
        idx, 2, out_shape, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, 0, 0
    )
    assert torch.equal(out_inds, y.indices)
    f_down = weights.from_krsc(down.weight.detach(), "RSCK")
    f_up = weights.from_krsc(up.weight.detach(), "RSCK")
    got_y = mmcv_ext.indice_conv_forward(feats, f_down, pairs, num, out_inds.shape[0], 0, 0)
    assert_close(got_y, y.features, **F64)
    got_z = mmcv_ext.indice_conv_forward(got_y, f_up, pairs, num, idx.shape[0], 1, 0)
    assert_close(got_z, z.features, **F64)
    g = torch.randn_like(got_y)
    gx, gw = mmcv_ext.indice_conv_backward(feats, f_down, g, pairs, num, 0, 0)
    assert gw.shape == f_down.shape
    y.features.backward(g)
    assert_close(gx, x.features.grad, **F64)
    assert_close(gw, weights.from_krsc(down.weight.grad, "RSCK"), **F64)
    grid = torch.full((2 * 6 * 32 * 32,), -1, dtype=torch.int32)
    again = mmcv_ext.get_indice_pairs_3d_backward(
        idx, grid, 2, out_shape, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, 0, 0
    )
    assert all(torch.equal(a, b) for a, b in zip(again, (out_inds, pairs, num)))
    with pytest.raises(ValueError, match="outSpatialShape must be"):
        mmcv_ext.get_indice_pairs_3d_forward(
            idx, 2, shape, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, 0, 0
        )
    with pytest.raises(ValueError, match="get_indice_pairs_2d"):
        mmcv_ext.get_indice_pairs_2d_forward(
            idx, 2, shape[1:], shape[1:], [3] * 2, [1] * 2, [0] * 2, [1] * 2, [0] * 2, 1, 0
        )


def _mmcv_maxpool_loops(features, pairs, num, m):
    """mmcv's kernels as loops: out starts at 0; `if in > out: out = in`; backward:
    `if in == out: grad_in += grad_out`."""
    out = torch.zeros(m, features.shape[1], dtype=features.dtype)
    for k in range(pairs.shape[0]):
        for j in range(int(num[k])):
            i, o = int(pairs[k, 0, j]), int(pairs[k, 1, j])
            for c in range(features.shape[1]):
                if features[i, c] > out[o, c]:
                    out[o, c] = features[i, c]
    return out


def test_maxpool_follows_mmcv_zero_start_nan_and_tie_rules():
    idx = random_sites(40, 1, [4, 4, 4], seed=2)
    _, pairs, num = mmcv_ext.get_indice_pairs_3d_forward(
        idx, 1, [2, 2, 2], [4, 4, 4], [2] * 3, [2] * 3, [0] * 3, [1] * 3, [0] * 3, 0, 0
    )
    m = 8
    feats = torch.randn(40, 3, dtype=torch.float64) - 1.0  # mostly negative: the zero start shows
    feats[5, 1] = float("nan")
    out = mmcv_ext.indice_maxpool_forward(feats, pairs, num, m)
    assert torch.equal(out, _mmcv_maxpool_loops(feats, pairs, num, m))
    assert (out == 0).any()
    grad = torch.randn(m, 3, dtype=torch.float64)
    got = mmcv_ext.indice_maxpool_backward(feats, out, grad, pairs, num)
    want = torch.zeros_like(feats)
    for k in range(pairs.shape[0]):
        for j in range(int(num[k])):
            i, o = int(pairs[k, 0, j]), int(pairs[k, 1, j])
            eq = feats[i] == out[o]
            want[i] += torch.where(eq, grad[o], 0.0)
    assert torch.equal(got, want)
