"""The spconv default patches (issue 11): spconv.pytorch's SubMConv3d / SparseConv3d /
SparseInverseConv3d / SubMConv2d / SparseConv2d / SparseMaxPool3d / SparseSequential /
SparseConvTensor / ToDense swapped for mu_space.sparse's, against stand-ins written from spconv
2.3.8's rules (constructor signatures, KRSC weights [C_out, *k, C_in], SubM = the input sites,
strided = every reached site, dense conv semantics), and, where spconv is importable (the
spconv venv of tests/sparse/test_against_spconv.py), against the real package.

The rule checked: swapped classes are used consistently (model code builds muSPACE's tensor
and layers); an upstream SparseConvTensor without rule books is converted, one with upstream
rule books is a TypeError; upstream SparseModule subclasses in a swapped SparseSequential get
the tensor. Tolerance: float64 stand-ins (dense convs) vs the rule-book path: summation order
only, 1e-10."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mu_space.sparse as ms
from mu_space.patcher import default_patcher
from tests.ops.test_sparse_rulebook import random_sites

F64 = 1e-10


# --------------------------------------------------------------------------- stand-ins


def install_spconv_upstream(monkeypatch):
    """spconv.pytorch stand-ins (spconv 2.3.8's module layout and constructor signatures)."""
    names = ("spconv", "spconv.pytorch", "spconv.pytorch.conv", "spconv.pytorch.pool",
             "spconv.pytorch.core", "spconv.pytorch.modules")  # fmt: skip
    mods = {n: types.ModuleType(n) for n in names}
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
        if "." in n:
            parent, child = n.rsplit(".", 1)
            setattr(mods[parent], child, m)

    class SparseConvTensor:
        def __init__(self, features, indices, spatial_shape, batch_size, grid=None,
                     voxel_num=None, indice_dict=None, benchmark=False,
                     permanent_thrust_allocator=False, enable_timer=False, force_algo=None):  # fmt: skip
            self.features, self.indices = features, indices
            self.spatial_shape, self.batch_size = list(spatial_shape), batch_size
            self.indice_dict = {} if indice_dict is None else indice_dict

        def dense(self):
            b, c = self.batch_size, self.features.shape[1]
            out = self.features.new_zeros(b, *self.spatial_shape, c)
            out[tuple(self.indices.long().t())] = self.features
            return out.permute(0, -1, *range(1, len(self.spatial_shape) + 1))

    class SparseModule(nn.Module):
        def __init__(self, name=None):
            super().__init__()
            self.name = name

    def _occupancy(x):  # the active sites (not the values: a ReLU zeroes some)
        occ = torch.zeros(x.batch_size, 1, *x.spatial_shape, dtype=torch.bool)
        occ[(x.indices[:, 0].long(), 0, *x.indices[:, 1:].long().t())] = True
        return occ

    def _sample(dense, indices):
        return dense.permute(0, *range(2, dense.dim()), 1)[tuple(indices.long().t())]

    class _Conv(SparseModule):
        def _setup(self, nd, cin, cout, k, stride, padding, dilation, bias, key, subm):
            k = [k] * nd if isinstance(k, int) else list(k)
            self.nd, self.k, self.subm, self.indice_key = nd, k, subm, key
            self.stride = [stride] * nd if isinstance(stride, int) else list(stride)
            self.padding = [padding] * nd if isinstance(padding, int) else list(padding)
            self.dilation = [dilation] * nd if isinstance(dilation, int) else list(dilation)
            self.weight = nn.Parameter(torch.randn(cout, *k, cin) * 0.2)
            self.bias = nn.Parameter(torch.randn(cout) * 0.1) if bias else None

        def forward(self, x):
            conv = F.conv3d if self.nd == 3 else F.conv2d
            w = self.weight.permute(0, self.nd + 1, *range(1, self.nd + 1))
            d = x.dense()
            if self.subm:
                pad = [k // 2 * dl for k, dl in zip(self.k, self.dilation)]
                out = conv(d, w, self.bias, padding=pad, dilation=self.dilation)
                return SparseConvTensor(_sample(out, x.indices), x.indices, x.spatial_shape,
                                        x.batch_size, indice_dict=dict(x.indice_dict))  # fmt: skip
            out = conv(d, w, self.bias, self.stride, self.padding, self.dilation)
            occ = conv(
                _occupancy(x).to(d), torch.ones_like(w[:1, :1]), None,
                self.stride, self.padding, self.dilation,
            )  # fmt: skip
            idx = (occ[:, 0] > 0).nonzero().int()
            return SparseConvTensor(_sample(out, idx), idx, list(out.shape[2:]), x.batch_size,
                                    indice_dict=dict(x.indice_dict))  # fmt: skip

    def subm(nd):
        class SubM(_Conv):
            def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                         dilation=1, groups=1, bias=True, indice_key=None, algo=None,
                         fp32_accum=None, large_kernel_fast_algo=False, name=None):  # fmt: skip
                super().__init__(name)
                self._setup(nd, in_channels, out_channels, kernel_size, 1, padding, dilation,
                            bias, indice_key, True)  # fmt: skip

        SubM.__name__ = f"SubMConv{nd}d"
        return SubM

    def strided(nd):
        class Conv(_Conv):
            def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                         dilation=1, groups=1, bias=True, indice_key=None, algo=None,
                         fp32_accum=None, record_voxel_count=False,
                         large_kernel_fast_algo=False, name=None):  # fmt: skip
                super().__init__(name)
                self._setup(nd, in_channels, out_channels, kernel_size, stride, padding,
                            dilation, bias, indice_key, False)  # fmt: skip

        Conv.__name__ = f"SparseConv{nd}d"
        return Conv

    class SparseInverseConv3d(SparseModule):
        def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True,
                     algo=None, fp32_accum=None, large_kernel_fast_algo=False, name=None):  # fmt: skip
            super().__init__(name)

    class SparseMaxPool3d(SparseModule):
        def __init__(self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None,
                     algo=None, record_voxel_count=False, name=None):  # fmt: skip
            super().__init__(name)

    class SparseSequential(SparseModule):
        def __init__(self, *args, **kwargs):
            super().__init__()
            for i, m in enumerate(args):
                self.add_module(str(i), m)

        def add(self, module, name=None):
            self.add_module(name or str(len(self._modules)), module)

        def forward(self, x):
            for m in self._modules.values():
                x = m(x) if isinstance(m, SparseModule) else SparseConvTensor(
                    m(x.features), x.indices, x.spatial_shape, x.batch_size, indice_dict=x.indice_dict
                )  # fmt: skip
            return x

    class ToDense(SparseModule):
        def __init__(self, name=None):
            super().__init__(name)

        def forward(self, x):
            return x.dense()

    conv, pool, core, modules, pkg = (
        mods["spconv.pytorch.conv"], mods["spconv.pytorch.pool"], mods["spconv.pytorch.core"],
        mods["spconv.pytorch.modules"], mods["spconv.pytorch"],
    )  # fmt: skip
    classes = {
        "SubMConv3d": subm(3), "SparseConv3d": strided(3), "SubMConv2d": subm(2),
        "SparseConv2d": strided(2), "SparseInverseConv3d": SparseInverseConv3d,
    }  # fmt: skip
    for name, cls in classes.items():
        cls.__qualname__ = name
        setattr(conv, name, cls)
        setattr(pkg, name, cls)
    pool.SparseMaxPool3d = pkg.SparseMaxPool3d = SparseMaxPool3d
    core.SparseConvTensor = pkg.SparseConvTensor = SparseConvTensor
    modules.SparseModule = pkg.SparseModule = SparseModule
    modules.SparseSequential = pkg.SparseSequential = SparseSequential
    pkg.ToDense = ToDense
    return types.SimpleNamespace(pkg=pkg, conv=conv, core=core, modules=modules, **classes)


SPCONV = (
    "spconv.SubMConv3d", "spconv.SparseConv3d", "spconv.SparseInverseConv3d", "spconv.SubMConv2d",
    "spconv.SparseConv2d", "spconv.SparseMaxPool3d", "spconv.SparseSequential",
    "spconv.SparseConvTensor", "spconv.ToDense",
)  # fmt: skip


def _frame(c=4, seed=0):
    idx = random_sites(300, 2, [10, 12, 14], seed=seed)
    return torch.randn(
        idx.shape[0], c, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    ), idx


def _net(sp):
    class Block(sp.modules.SparseModule):  # a user block on upstream's SparseModule
        def __init__(self):
            super().__init__()
            self.conv = sp.pkg.SubMConv3d(8, 8, 3, padding=1, bias=False)

        def forward(self, x):
            return self.conv(x)

    return sp.pkg.SparseSequential(
        sp.pkg.SubMConv3d(4, 8, 3, padding=1, bias=False, indice_key="subm1"),
        nn.BatchNorm1d(8).double().eval(),
        nn.ReLU(),
        Block(),
        sp.pkg.SparseConv3d(8, 6, 3, 2, 1, bias=True, indice_key="down"),
        sp.pkg.ToDense(),
    )


# --------------------------------------------------------------------------- stand-in tests


def test_swapped_network_matches_the_upstream_rules(monkeypatch):
    sp = install_spconv_upstream(monkeypatch)
    torch.manual_seed(0)
    upstream_net = _net(sp).double()
    feats, idx = _frame()
    want = upstream_net(sp.pkg.SparseConvTensor(feats, idx, [10, 12, 14], 2))
    with default_patcher() as patcher:
        results = {r.name: r for r in patcher.results()}
        assert all(results[n].status == "applied" for n in SPCONV), {
            n: results[n].reason for n in SPCONV
        }
        assert sp.pkg.SubMConv3d is sp.conv.SubMConv3d and issubclass(
            sp.pkg.SubMConv3d, ms.SubMConv3d
        )
        net = _net(sp).double()
        net.load_state_dict(upstream_net.state_dict(), strict=True)  # KRSC both
        x = sp.pkg.SparseConvTensor(feats, idx, [10, 12, 14], 2)
        assert isinstance(x, ms.SparseConvTensor)
        got = net(x)
        assert torch.allclose(got, want, atol=F64, rtol=F64)
        # a subclass carrying the patch's backend
        assert net[0].backend == "auto" and net[4].backend == "auto"
    assert not issubclass(sp.pkg.SubMConv3d, ms.SubMConv3d)  # restored


def test_backend_is_passed_to_the_layers(monkeypatch):
    install_spconv_upstream(monkeypatch)
    with default_patcher(backend="reference"):
        import spconv.pytorch as spp

        assert spp.SubMConv3d(4, 4, 3).backend == "reference"
        assert spp.SparseMaxPool3d(2).backend == "reference"


def test_upstream_tensor_is_converted_or_refused(monkeypatch):
    sp = install_spconv_upstream(monkeypatch)
    original_tensor = sp.core.SparseConvTensor
    feats, idx = _frame()
    with default_patcher():
        layer = sp.pkg.SubMConv3d(4, 5, 3, bias=False).double()
        plain = original_tensor(feats, idx, [10, 12, 14], 2)  # the upstream class, no rule books
        out = layer(plain)
        assert isinstance(out, ms.SparseConvTensor) and torch.equal(out.indices, idx)
        with_books = original_tensor(feats, idx, [10, 12, 14], 2, indice_dict={"k": object()})
        with pytest.raises(TypeError, match="upstream rule books"):
            layer(with_books)


def test_wrong_signature_is_a_clean_skip(monkeypatch):
    sp = install_spconv_upstream(monkeypatch)

    class OldSubM(sp.modules.SparseModule):  # spconv 1.x-like signature
        def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0,
                     dilation=1, groups=1, bias=True, indice_key=None, use_hash=False):  # fmt: skip
            super().__init__()

    monkeypatch.setattr(sp.conv, "SubMConv3d", OldSubM)
    monkeypatch.setattr(sp.pkg, "SubMConv3d", OldSubM)
    with default_patcher() as patcher:
        r = {r.name: r for r in patcher.results()}["spconv.SubMConv3d"]
        assert r.status == "skipped" and "differs from the supported" in r.reason
        assert sp.pkg.SubMConv3d is OldSubM


def test_absent_spconv_is_a_skip(monkeypatch):
    for name in list(sys.modules):
        if name.split(".")[0] == "spconv":
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "spconv", None)
    with default_patcher() as patcher:
        r = {r.name: r for r in patcher.results()}
        assert all(r[n].status == "skipped" for n in SPCONV)


def test_our_constructors_take_the_supported_upstream_signatures():
    """The replacements are built from mu_space.sparse's classes: their parameter names are
    the spconv 2.3.x ones the prechecks accept."""
    import inspect

    from mu_space.patcher import patches

    for cls_name, _, accepted in patches.SPCONV_LAYERS:
        names = tuple(inspect.signature(getattr(ms, cls_name).__init__).parameters)
        assert names in accepted, (cls_name, names)
    names = tuple(inspect.signature(ms.SparseConvTensor.__init__).parameters)
    assert names in patches.SPCONV_TENSOR_PARAMS


# --------------------------------------------------------------------------- the real spconv


def _real_spconv():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(
            "spconv.pytorch", reason="spconv not importable (runs in the spconv venv only)"
        )


def test_real_spconv_patches_apply_and_agree(monkeypatch):
    sp = _real_spconv()
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv's CPU path races otherwise (test_against_spconv.py)
    feats, idx = _frame()
    feats = feats.float()
    torch.manual_seed(0)
    upstream = sp.SparseSequential(
        sp.SubMConv3d(4, 8, 3, padding=1, bias=False, indice_key="s"), nn.ReLU(),
        sp.SparseConv3d(8, 8, 3, 2, 1, bias=False, indice_key="d"),
        sp.SparseInverseConv3d(8, 4, 3, indice_key="d", bias=False),
    )  # fmt: skip
    x = sp.SparseConvTensor(feats, idx, [10, 12, 14], 2)
    import spconv.pytorch.ops as sp_ops

    if not torch.cuda.is_available():
        # spconv's CPU-only-torch stream lookup (test_against_spconv.py)
        monkeypatch.setattr(sp_ops, "get_current_stream", lambda: 0)
    want = upstream(x)
    with default_patcher() as patcher:
        r = {r.name: r for r in patcher.results()}
        assert all(r[n].status == "applied" for n in SPCONV), {n: r[n].reason for n in SPCONV}
        import spconv.pytorch as spp

        net = spp.SparseSequential(
            spp.SubMConv3d(4, 8, 3, padding=1, bias=False, indice_key="s"), nn.ReLU(),
            spp.SparseConv3d(8, 8, 3, 2, 1, bias=False, indice_key="d"),
            spp.SparseInverseConv3d(8, 4, 3, indice_key="d", bias=False),
        )  # fmt: skip
        assert isinstance(net[0], ms.SubMConv3d)
        net.load_state_dict(upstream.state_dict(), strict=True)
        got = net(spp.SparseConvTensor(feats, idx, [10, 12, 14], 2))
        assert torch.equal(got.indices, idx) and torch.equal(want.indices, idx)
        scale = float(want.features.abs().max())
        assert float((got.features - want.features).abs().max()) <= 1e-5 * scale
    assert not isinstance(sp.SubMConv3d(4, 4, 3), ms.SparseConvolution)  # restored
    torch.set_num_threads(n_threads)
