"""sparse_maxpool against F.max_pool3d of the dense grid with -inf at the inactive sites
(torch's max pool pads with -inf too): the same maximum at every output site, exact (a max
rounds nothing). Gradient: spconv's / mmcv's rule (every input equal to its output's maximum
gets the output's gradient), float64 gradcheck where there are no ties, and the tie rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mu_space.ops import _sparse
from mu_space.ops.sparse_maxpool import sparse_maxpool
from mu_space.ops.sparse_rulebook import sparse_rulebook
from tests.ops.test_sparse_conv import at, dense
from tests.ops.test_sparse_rulebook import random_sites


@pytest.mark.parametrize(("k", "s", "p"), [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_is_the_dense_max_pool_over_the_active_sites(k, s, p, dtype):
    idx, shape = _sparse.tiny_indices("cpu", keep=200)
    g = torch.Generator().manual_seed(k + s)
    x = torch.randn(idx.shape[0], 6, generator=g).to(dtype)  # negative values too
    rb = sparse_rulebook(idx, 2, shape, k, s, p)
    got = sparse_maxpool(x, rb.indice_pairs, rb.indice_pair_num, rb.out_indices.shape[0])
    d = dense(x.float(), idx, 2, shape)
    occ = dense(torch.ones(idx.shape[0], 1), idx, 2, shape) > 0
    d = torch.where(occ, d, -torch.inf)
    want = at(F.max_pool3d(d, k, s, p), rb.out_indices)
    assert torch.equal(got.float(), want)


def test_gradient_goes_to_every_input_holding_the_maximum():
    idx = random_sites(30, 1, [4, 4, 4], seed=1)
    rb = sparse_rulebook(idx, 1, [4, 4, 4], 4, 4, 0)  # one output
    x = torch.randn(30, 2, dtype=torch.float64)
    x[[3, 17], 0] = 10.0  # a tie in channel 0
    x.requires_grad_(True)
    out = sparse_maxpool(x, rb.indice_pairs, rb.indice_pair_num, 1)
    out.backward(torch.tensor([[2.0, 3.0]], dtype=torch.float64))
    want = torch.zeros(30, 2, dtype=torch.float64)
    want[[3, 17], 0] = 2.0
    want[int(x[:, 1].argmax()), 1] = 3.0
    assert torch.equal(x.grad, want)


def test_gradcheck_float64_and_nan_and_empty():
    idx = random_sites(12, 2, [3, 4, 3], seed=2)
    rb = sparse_rulebook(idx, 2, [3, 4, 3], 3, 2, 1)
    m = rb.out_indices.shape[0]
    x = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    p, n = rb.indice_pairs, rb.indice_pair_num
    assert torch.autograd.gradcheck(lambda a: sparse_maxpool(a, p, n, m), (x,))
    y = x.detach().clone()
    y[0] = float("nan")
    out = sparse_maxpool(y, p, n, m)
    reached = (p[:, 1][p[:, 0] == 0]).long()  # the outputs row 0 feeds
    assert torch.isnan(out[reached]).all()  # NaN propagates (like torch's max pool)
    empty = sparse_maxpool(x[:0], p[:, :, :0], torch.zeros_like(n), 4)
    assert empty.shape == (4, 3) and not empty.any()  # outputs no pair reaches are 0


def test_errors_name_the_argument():
    idx = random_sites(10, 1, [4, 4, 4], seed=3)
    rb = sparse_rulebook(idx, 1, [4, 4, 4], 2, 2)
    x = torch.randn(10, 2)
    with pytest.raises(ValueError, match="indice_pairs must be"):
        sparse_maxpool(x, rb.indice_pairs[:, :1], rb.indice_pair_num, 3)
    with pytest.raises(ValueError, match="indice_pair_num must be"):
        sparse_maxpool(x, rb.indice_pairs, rb.indice_pair_num[:3], 3)
    with pytest.raises(ValueError, match="num_out"):
        sparse_maxpool(x, rb.indice_pairs, rb.indice_pair_num, 0)
