"""sparse_conv (gather -> GEMM -> scatter over a rule book) against dense torch convolutions of
the same sparse grids: SubM = F.conv3d with padding k // 2 read at the input sites; strided =
F.conv3d (zero exactly where no input reaches); inverse = F.conv_transpose3d read at the
forward conv's input sites; transposed = F.conv_transpose3d; 2-D = F.conv2d. Inputs: voxels of
generated LiDAR frames and small random grids. Gradients: float64 gradcheck on tiny grids and
the dense convolution's autograd.

Tolerances (next to each comparison): float64 on both sides differs by summation order only
(1e-10); float16 / bfloat16 inputs: the reference multiplies exactly in float32 (the products of
11- / 8-bit mantissas fit), sums in float32 and rounds once, so against the float64 dense conv
of the same rounded values the error is one output rounding (2^-11 / 2^-8 of |out|) plus
float32 summation (~1e-6 of the sum of |terms|, bounded by max|out| * 1e-3 here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mu_space.ops import _sparse
from mu_space.ops.sparse_conv import sparse_conv
from mu_space.ops.sparse_rulebook import sparse_rulebook
from tests.helpers import assert_close
from tests.ops.test_sparse_rulebook import random_sites

F64 = {"atol": 1e-10, "rtol": 1e-10}  # float64 both sides: summation order only


def dense(features, indices, batch, shape):
    """[B, C, *shape] with the features at their sites, zeros elsewhere."""
    out = features.new_zeros(batch, features.shape[1], *shape)
    idx = indices.long()
    out[(idx[:, 0], slice(None), *idx[:, 1:].t())] = features
    return out


def at(dense_out, indices):
    """The rows of a dense [B, C, *shape] result at `indices` -> [N, C]."""
    idx = indices.long()
    return dense_out[(idx[:, 0], slice(None), *idx[:, 1:].t())]


def torch_weight(w, ksize):
    """[K, C_in, C_out] -> F.conv weight [C_out, C_in, *k]."""
    nd = len(ksize)
    return w.reshape(*ksize, w.shape[1], w.shape[2]).permute(nd + 1, nd, *range(nd))


def torch_weight_t(w, ksize):
    """[K, C_in, C_out] -> F.conv_transpose weight [C_in, C_out, *k]."""
    nd = len(ksize)
    return w.reshape(*ksize, w.shape[1], w.shape[2]).permute(nd, nd + 1, *range(nd))


def _case(n=300, c_in=5, c_out=7, k=27, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c_in, generator=g, dtype=dtype),
            torch.randn(k, c_in, c_out, generator=g, dtype=dtype))  # fmt: skip


def test_subm_on_lidar_voxels_is_the_dense_conv_at_the_input_sites():
    idx, shape = _sparse.tiny_indices("cpu")
    x, w = _case(idx.shape[0])
    rb = sparse_rulebook(idx, 2, shape, 3, 1, 1, 1, 0, True, False)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, idx.shape[0])
    want = at(F.conv3d(dense(x, idx, 2, shape), torch_weight(w, [3, 3, 3]), padding=1), idx)
    assert_close(got, want, **F64)


@pytest.mark.parametrize(
    ("ksize", "stride", "padding", "dilation"),
    [([3, 3, 3], 2, 1, 1), ([3, 1, 1], [2, 1, 1], 0, 1), ([2, 2, 2], 2, 0, 1), ([3, 3, 3], 1, 2, 2)],
)  # fmt: skip
def test_strided_conv_is_the_dense_conv_and_zero_elsewhere(ksize, stride, padding, dilation):
    idx, shape = _sparse.tiny_indices("cpu", keep=150)
    K = ksize[0] * ksize[1] * ksize[2]
    x, w = _case(idx.shape[0], k=K, seed=1)
    rb = sparse_rulebook(idx, 2, shape, ksize, stride, padding, dilation)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, rb.out_indices.shape[0])
    want = F.conv3d(dense(x, idx, 2, shape), torch_weight(w, ksize), stride=stride,
                    padding=padding, dilation=dilation)  # fmt: skip
    assert_close(dense(got, rb.out_indices, 2, list(want.shape[2:])), want, **F64)


def test_inverse_conv_is_the_transposed_dense_conv_at_the_forward_input_sites():
    idx, shape = _sparse.tiny_indices("cpu", keep=150)
    rb = sparse_rulebook(idx, 2, shape, 3, 2, 1)
    m = rb.out_indices.shape[0]
    y, w = _case(m, c_in=6, c_out=4, seed=2)
    got = sparse_conv(y, w, rb.indice_pairs, rb.indice_pair_num, idx.shape[0], True)
    out_shape = _sparse.conv_output_size(shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3)
    # output_padding makes conv_transpose's size the forward input's: in - ((out-1) s - 2p + k)
    op = [s - ((o - 1) * 2 - 2 + 3) for s, o in zip(shape, out_shape)]
    full = F.conv_transpose3d(dense(y, rb.out_indices, 2, out_shape), torch_weight_t(w, [3] * 3),
                              stride=2, padding=1, output_padding=op)  # fmt: skip
    assert_close(got, at(full, idx), **F64)


def test_transposed_conv_is_the_dense_transposed_conv():
    idx = random_sites(40, 2, [4, 5, 4], seed=3)
    x, w = _case(40, k=8, seed=3)
    rb = sparse_rulebook(idx, 2, [4, 5, 4], 2, 2, 0, 1, 1, transposed=True)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, rb.out_indices.shape[0])
    want = F.conv_transpose3d(dense(x, idx, 2, [4, 5, 4]), torch_weight_t(w, [2] * 3), stride=2,
                              output_padding=1)  # fmt: skip
    assert_close(dense(got, rb.out_indices, 2, list(want.shape[2:])), want, **F64)


def test_2d_subm_and_strided_are_dense_conv2d():
    idx = random_sites(70, 3, [11, 9], seed=4)
    x, w = _case(70, k=9, seed=4)
    d = dense(x, idx, 3, [11, 9])
    rb = sparse_rulebook(idx, 3, [11, 9], 3, 1, 1, 1, 0, True)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, 70)
    assert_close(got, at(F.conv2d(d, torch_weight(w, [3, 3]), padding=1), idx), **F64)
    rb = sparse_rulebook(idx, 3, [11, 9], 3, 2, 1)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, rb.out_indices.shape[0])
    want = F.conv2d(d, torch_weight(w, [3, 3]), stride=2, padding=1)
    assert_close(dense(got, rb.out_indices, 3, list(want.shape[2:])), want, **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_accumulates_in_float32_and_rounds_once(dtype):
    idx, shape = _sparse.tiny_indices("cpu")
    x, w = _case(idx.shape[0], c_in=16, c_out=16, dtype=torch.float64, seed=5)
    x, w = x.to(dtype), w.to(dtype)
    rb = sparse_rulebook(idx, 2, shape, 3, 1, 1, 1, 0, True, False)
    got = sparse_conv(x, w, rb.indice_pairs, rb.indice_pair_num, idx.shape[0])
    assert got.dtype == dtype
    want = sparse_conv(x.double(), w.double(), rb.indice_pairs, rb.indice_pair_num, idx.shape[0])
    rel = {torch.float32: 1e-6, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    scale = float(want.abs().max())
    # one rounding of the output (rel) + float32 summation (<< 1e-3 of the largest output)
    assert_close(got.double(), want, atol=1e-3 * scale * (rel / 2**-11) + 1e-6 * scale, rtol=rel)


def test_gradcheck_float64_tiny():
    idx = random_sites(9, 2, [3, 4, 3], seed=6)
    for subm, inverse in [(True, False), (False, False), (False, True)]:
        rb = sparse_rulebook(idx, 2, [3, 4, 3], 3, 1 if subm else 2, 1, 1, 0, subm)
        m = rb.out_indices.shape[0]
        n_in, n_out = (m, 9) if inverse else (9, m)
        x, w = _case(n_in, c_in=2, c_out=3, seed=7)
        x.requires_grad_(True)
        w.requires_grad_(True)
        pairs, num = rb.indice_pairs, rb.indice_pair_num
        assert torch.autograd.gradcheck(
            lambda a, b, p=pairs, c=num, o=n_out, i=inverse: sparse_conv(a, b, p, c, o, i),
            (x, w),
        )


def test_gradients_match_the_dense_conv_autograd():
    idx, shape = _sparse.tiny_indices("cpu", keep=150)
    x, w = _case(idx.shape[0], seed=8)
    rb = sparse_rulebook(idx, 2, shape, 3, 2, 1)
    m = rb.out_indices.shape[0]
    g = torch.randn(m, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    sparse_conv(xs, ws, rb.indice_pairs, rb.indice_pair_num, m).backward(g)
    xd, wd = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = F.conv3d(dense(xd, idx, 2, shape), torch_weight(wd, [3] * 3), stride=2, padding=1)
    (at(out, rb.out_indices) * g).sum().backward()
    assert_close(xs.grad, xd.grad, **F64)
    assert_close(ws.grad, wd.grad, **F64)


def test_backward_is_deterministic_and_a_real_op():
    idx, shape = _sparse.tiny_indices("cpu")
    x, w = _case(idx.shape[0], dtype=torch.float32, seed=10)
    rb = sparse_rulebook(idx, 2, shape, 3, 2, 1)
    m = rb.out_indices.shape[0]
    grads = []
    for _ in range(2):
        a, b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = sparse_conv(a, b, rb.indice_pairs, rb.indice_pair_num, m)
        assert "sparse_conv" in str(out.grad_fn)
        out.square().sum().backward()
        grads.append((out, a.grad, b.grad))
    assert all(torch.equal(p, q) for p, q in zip(*grads))


def test_empty_inputs_and_offsets_without_pairs():
    x, w = _case(0)
    pairs = torch.full((27, 2, 0), -1, dtype=torch.int32)
    out = sparse_conv(x, w, pairs, torch.zeros(27, dtype=torch.int32), 5)
    assert out.shape == (5, 7) and not out.any()  # outputs no pair reaches are 0


def test_errors_name_the_argument():
    idx = random_sites(10, 1, [4, 4, 4], seed=11)
    rb = sparse_rulebook(idx, 1, [4, 4, 4], 3, 1, 1, 1, 0, True)
    x, w = _case(10, dtype=torch.float32)
    p, n = rb.indice_pairs, rb.indice_pair_num
    with pytest.raises(TypeError, match="weight must have the dtype of features"):
        sparse_conv(x, w.double(), p, n, 10)
    with pytest.raises(ValueError, match=r"weight.shape\[1\] \(C_in\) must be 5"):
        sparse_conv(x, w[:, :3], p, n, 10)
    with pytest.raises(ValueError, match=r"indice_pairs.shape\[0\] must be 9"):
        sparse_conv(x, w[:9], p, n, 10)
    with pytest.raises(TypeError, match="indice_pairs must be int32"):
        sparse_conv(x, w, p.long(), n, 10)
    with pytest.raises(ValueError, match="indice_pairs holds a gathered row"):
        sparse_conv(x[:5], w, p, n, 10)
    with pytest.raises(ValueError, match=r"scattered row .* \(num_out\)"):
        sparse_conv(x, w, p, n, 4)
    bad = n.clone()
    bad[0] = 11
    with pytest.raises(ValueError, match=r"indice_pair_num\[0\] = 11"):
        sparse_conv(x, w, p, bad, 10)
    with pytest.raises(ValueError, match="num_out must be >= 0"):
        sparse_conv(x, w, p, n, -1)
    with pytest.raises(TypeError, match="features must be float32"):
        sparse_conv(x.int(), w, p, n, 10)
