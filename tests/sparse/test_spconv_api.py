"""mu_space.sparse as spconv 2.x (`import mu_space.sparse as spconv`): layers against dense
torch convolutions, indice_key reuse, the inverse conv restoring its input sites, the weight
layouts and loaders, errors, empty inputs, and a SparseEncoder-like stack on a voxelized
synthetic LiDAR frame, forward and backward.

Tolerance: float64 layers vs float64 dense convs differ by summation order only (1e-10); the
float32 stack is compared with its own float64 twin (float32 sums of <= 27 * 32 products per
layer over four layers: 1e-4 relative to the largest output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mu_space.sparse as spconv
from mu_space.ops import _sparse
from mu_space.ops.voxelization import voxelization
from mu_space.sparse import weights
from mu_space.testing import lidar
from tests.helpers import assert_close
from tests.ops.test_sparse_conv import at, dense
from tests.ops.test_sparse_rulebook import random_sites

F64 = {"atol": 1e-10, "rtol": 1e-10}


def _tensor(n=200, c=4, dtype=torch.float64, seed=0):
    idx, shape = _sparse.tiny_indices("cpu", keep=n // 2)
    g = torch.Generator().manual_seed(seed)
    return spconv.SparseConvTensor(
        torch.randn(idx.shape[0], c, generator=g, dtype=dtype), idx, shape, 2
    )


def _dense_w(layer):
    """spconv KRSC [C_out, *k, C_in] -> F.conv weight [C_out, C_in, *k]."""
    nd = layer.ndim
    return layer.weight.permute(0, nd + 1, *range(1, nd + 1))


def test_subm_and_strided_layers_are_dense_convs_with_bias():
    x = _tensor()
    d = x.dense()
    subm = spconv.SubMConv3d(4, 6, 3, bias=True).double()
    y = subm(x)
    assert y.indices is x.indices and y.spatial_shape == x.spatial_shape
    want = at(F.conv3d(d, _dense_w(subm), subm.bias, padding=1), x.indices)
    assert_close(y.features, want, **F64)
    down = spconv.SparseConv3d(4, 5, 3, stride=2, padding=1, bias=False).double()
    z = down(x)
    want = F.conv3d(d, _dense_w(down), stride=2, padding=1)
    assert z.spatial_shape == list(want.shape[2:])
    assert_close(z.dense(), want, **F64)  # exactly the reached sites, zero elsewhere


def test_2d_layers_and_to_dense():
    idx = random_sites(60, 2, [12, 10], seed=1)
    x = spconv.SparseConvTensor(torch.randn(60, 3, dtype=torch.float64), idx, [12, 10], 2)
    net = spconv.SparseSequential(
        spconv.SubMConv2d(3, 4, 3), spconv.SparseConv2d(4, 2, 3, 2, 1), spconv.ToDense()
    ).double()
    got = net(x)
    h = at(F.conv2d(x.dense(), net[0].weight.permute(0, 3, 1, 2), net[0].bias, padding=1), idx)
    hd = dense(h, idx, 2, [12, 10])
    want = F.conv2d(hd, net[1].weight.permute(0, 3, 1, 2), net[1].bias, stride=2, padding=1)
    occ = (
        F.conv2d(
            dense(torch.ones(60, 1, dtype=torch.float64), idx, 2, [12, 10]),
            torch.ones(1, 1, 3, 3, dtype=torch.float64),
            stride=2,
            padding=1,
        )
        > 0
    )
    assert_close(got, torch.where(occ, want, 0.0), **F64)  # bias only at the active sites


def test_subm_reuses_the_rule_book_of_its_key(monkeypatch):
    import mu_space.sparse.conv as conv_mod

    calls = []
    real = conv_mod.sparse_rulebook
    monkeypatch.setattr(
        conv_mod, "sparse_rulebook", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x = _tensor()
    a = spconv.SubMConv3d(4, 4, 3, indice_key="subm1").double()
    b = spconv.SubMConv3d(4, 4, 3, indice_key="subm1").double()
    y = a(x)
    z = b(y)
    assert len(calls) == 1
    assert z.indice_dict["subm1"] is y.indice_dict["subm1"]
    assert "subm1" not in x.indice_dict  # spconv copies the dict per output
    with pytest.raises(ValueError, match="same kernel size"):
        spconv.SubMConv3d(4, 4, 5, indice_key="subm1").double()(y)


def test_inverse_conv_restores_the_input_sites_and_is_the_transposed_dense_conv():
    x = _tensor()
    down = spconv.SparseConv3d(4, 8, 3, 2, 1, indice_key="cp1").double()
    up = spconv.SparseInverseConv3d(8, 4, 3, indice_key="cp1").double()
    y = down(x)
    z = up(y)
    assert z.indices is x.indices and z.spatial_shape == x.spatial_shape
    assert z.indice_dict["cp1"] is y.indice_dict["cp1"]
    shape = x.spatial_shape
    op = [s - ((o - 1) * 2 - 2 + 3) for s, o in zip(shape, y.spatial_shape)]
    wt = up.weight.permute(4, 0, 1, 2, 3)  # [C_out, *k, C_in] -> conv_transpose [C_in, C_out, *k]
    full = F.conv_transpose3d(y.dense(), wt, up.bias, stride=2, padding=1, output_padding=op)
    assert_close(z.features, at(full, x.indices), **F64)
    with pytest.raises(ValueError, match="no rule book of that key"):
        spconv.SparseInverseConv3d(8, 4, 3, indice_key="nope").double()(y)
    with pytest.raises(ValueError, match="kernel size of its conv"):
        spconv.SparseInverseConv3d(8, 4, 2, indice_key="cp1").double()(y)
    with pytest.raises(ValueError, match="already exists"):
        spconv.SparseConv3d(8, 8, 3, 2, 1, indice_key="cp1").double()(y)


def test_maxpool_layer_and_its_inverse():
    x = _tensor()
    pool = spconv.SparseMaxPool3d(2, indice_key="pool1")
    assert pool.stride == [2, 2, 2]
    y = pool(x)
    d = torch.where(x.dense() != 0, x.dense(), -torch.inf)
    assert torch.equal(y.features, at(F.max_pool3d(d, 2, 2), y.indices))
    z = spconv.SparseInverseConv3d(4, 3, 2, indice_key="pool1").double()(y)
    assert z.indices is x.indices


def test_weight_layout_state_dict_round_trip_and_old_layouts(monkeypatch):
    layer = spconv.SubMConv3d(4, 6, (3, 1, 2), indice_key="a")
    assert layer.weight.shape == (6, 3, 1, 2, 4)  # spconv 2.x KRSC [C_out, *k, C_in]
    sd = layer.state_dict()
    other = spconv.SubMConv3d(4, 6, (3, 1, 2))
    other.load_state_dict(sd)  # spconv 2.x checkpoints load unchanged
    assert torch.equal(other.weight, layer.weight)
    old = {"weight": weights.from_krsc(layer.weight.detach(), "RSCK"), "bias": sd["bias"]}
    assert old["weight"].shape == (3, 1, 2, 4, 6)  # spconv 1.x / mmcv [*k, C_in, C_out]
    fresh = spconv.SubMConv3d(4, 6, (3, 1, 2))
    weights.load_state_dict(fresh, old, layout="RSCK")
    assert torch.equal(fresh.weight, layer.weight)
    x = _tensor(dtype=torch.float32)
    assert torch.equal(fresh(x).features, layer(x).features)
    net = nn.Sequential(spconv.SubMConv3d(4, 6, 3), nn.ReLU(), spconv.SparseConv3d(6, 2, 3, 2))
    twin = nn.Sequential(spconv.SubMConv3d(4, 6, 3), nn.ReLU(), spconv.SparseConv3d(6, 2, 3, 2))
    sd_old = {
        k: weights.from_krsc(v, "RSCK") if k.endswith("weight") else v
        for k, v in net.state_dict().items()
    }
    weights.load_state_dict(twin, sd_old, layout="RSCK")
    assert all(
        torch.equal(a, b) for a, b in zip(net.state_dict().values(), twin.state_dict().values())
    )
    with pytest.raises(ValueError, match="0.weight"):
        weights.load_state_dict(twin, {**sd_old, "0.weight": sd_old["2.weight"]}, layout="RSCK")
    monkeypatch.setenv("SPCONV_SAVED_WEIGHT_LAYOUT", "RSKC")  # spconv's own switch
    rskc = spconv.SubMConv3d(4, 6, (3, 1, 2))
    rskc.load_state_dict(
        {"weight": layer.weight.detach().permute(1, 2, 3, 0, 4), "bias": sd["bias"]}
    )
    assert torch.equal(rskc.weight, layer.weight)


def test_conv1x1_keeps_the_sites_and_is_a_matmul():
    x = _tensor()
    layer = spconv.SparseConv3d(4, 3, 1).double()
    y = layer(x)
    assert y.indices is x.indices
    assert_close(y.features, x.features @ layer.weight.reshape(3, 4).t() + layer.bias, **F64)


def test_errors_and_empty_inputs():
    x = _tensor(dtype=torch.float32)
    with pytest.raises(ValueError, match="in_channels is 5"):
        spconv.SubMConv3d(5, 4, 3)(x)
    with pytest.raises(TypeError, match="takes a SparseConvTensor"):
        spconv.SubMConv3d(4, 4, 3)(x.features)
    with pytest.raises(ValueError, match="groups must be 1"):
        spconv.SubMConv3d(4, 4, 3, groups=2)
    with pytest.raises(TypeError, match="indices must be int32"):
        spconv.SparseConvTensor(x.features, x.indices.long(), x.spatial_shape, 2)
    with pytest.raises(ValueError, match="indices has 200 rows but features has 3"):
        spconv.SparseConvTensor(x.features[:3], x.indices, x.spatial_shape, 2)
    with pytest.raises(ValueError, match="spatial_shape must have 3 values"):
        spconv.SparseConvTensor(x.features, x.indices, [10, 64], 2)
    with pytest.raises(ValueError, match="batch_size"):
        spconv.SubMConv3d(4, 4, 3)(
            spconv.SparseConvTensor(x.features, x.indices, x.spatial_shape, 1)
        )
    bad = x.indices.clone()
    bad[5] = bad[9]
    with pytest.raises(ValueError, match="rows 5 and 9 are the same site"):
        spconv.SparseConv3d(4, 4, 3, 2)(
            spconv.SparseConvTensor(x.features, bad, x.spatial_shape, 2)
        )
    with pytest.raises(ValueError, match="can't set features"):
        x.features = x.features
    empty = spconv.SparseConvTensor(
        torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32), [8, 8, 8], 2
    )
    net = spconv.SparseSequential(spconv.SubMConv3d(4, 8, 3), nn.BatchNorm1d(8), nn.ReLU(),
                                  spconv.SparseConv3d(8, 8, 3, 2, 1), spconv.SparseMaxPool3d(2), spconv.ToDense())  # fmt: skip
    out = net(empty)
    assert out.shape == (2, 8, 2, 2, 2) and not out.any()


def test_dense_and_from_dense_round_trip():
    x = _tensor()
    d = x.dense(channels_first=False)
    back = spconv.SparseConvTensor.from_dense(d)
    order = torch.argsort(_sparse.linear_keys(x.indices, x.spatial_shape))
    assert torch.equal(back.indices, x.indices[order]) and torch.equal(
        back.features, x.features[order]
    )


def _voxel_frame():
    """A voxelized synthetic LiDAR frame (mmcv hard voxelization, HardSimpleVFE's mean)."""
    vs, pcr, max_pts, max_vox = lidar.layer_args("tiny-voxels")
    pts = lidar.batch(lidar.VOXEL_CONFIGS["tiny-voxels"].cloud, 1)[0]
    voxels, coors, counts = voxelization(pts, vs, pcr, max_pts, max_vox, backend="reference")
    feats = voxels.sum(1) / counts.clamp(min=1)[:, None].to(voxels.dtype)
    idx = F.pad(coors, (1, 0), value=0).to(torch.int32)
    gx, gy, gz = lidar.VOXEL_CONFIGS["tiny-voxels"].grid_size
    return feats, idx, [gz + 1, gy, gx]  # SparseEncoder's sparse_shape: z + 1


def _encoder():
    def block(cin, cout, kind, key, **kw):
        conv = {"subm": spconv.SubMConv3d, "spconv": spconv.SparseConv3d}[kind]
        return spconv.SparseSequential(
            conv(cin, cout, 3, bias=False, indice_key=key, **kw), nn.BatchNorm1d(cout), nn.ReLU()
        )

    return spconv.SparseSequential(
        block(5, 16, "subm", "subm1", padding=1), block(16, 16, "subm", "subm1", padding=1),
        block(16, 32, "spconv", "spconv2", stride=2, padding=1), block(32, 32, "subm", "subm2", padding=1),
        spconv.SparseSequential(spconv.SparseConv3d(32, 32, (3, 1, 1), (2, 1, 1), bias=False, indice_key="spconv_down2"),
                                nn.BatchNorm1d(32), nn.ReLU()),
        spconv.ToDense(),
    )  # fmt: skip


def test_sparse_encoder_stack_on_a_voxelized_lidar_frame_forward_and_backward():
    feats, idx, shape = _voxel_frame()
    assert idx.shape[0] > 500
    torch.manual_seed(0)
    net = _encoder().train()
    twin = _encoder().double().train()
    twin.load_state_dict(
        {k: v.double() if v.is_floating_point() else v for k, v in net.state_dict().items()}
    )
    x = spconv.SparseConvTensor(feats, idx, shape, 1)
    out = net(x)
    n, c, d, h, w = out.shape
    mid = _sparse.conv_output_size(shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3)
    want = _sparse.conv_output_size(mid, [3, 1, 1], [2, 1, 1], [0] * 3, [1] * 3)
    assert (n, c) == (1, 32) and [d, h, w] == want == [2, 32, 32]
    bev = out.reshape(n, c * d, h, w)  # SparseEncoder's BEV view
    loss = bev.square().mean()
    loss.backward()
    x64 = spconv.SparseConvTensor(feats.double(), idx, shape, 1)
    out64 = twin(x64)
    out64.reshape(n, c * d, h, w).square().mean().backward()
    scale = float(out64.detach().abs().max())
    assert_close(out.double(), out64, atol=1e-4 * scale, rtol=1e-4)
    for (name, p), p64 in zip(net.named_parameters(), twin.parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        g_scale = float(p64.grad.abs().max())
        assert_close(p.grad.double(), p64.grad, atol=1e-3 * g_scale + 1e-12, rtol=1e-3, name=name)
