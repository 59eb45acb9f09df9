"""The surrogates of mmdet3d 1.x projects/BEVFusion's compiled extensions
(mu_space.compat.bevfusion): each function against an independent statement of upstream's
contract (bev_pool: a loop over the intervals; the voxel layer: mmcv's rules as Python loops,
tests/ops/_voxel_oracle.py, in BEVFusion's (x, y, z) column order), the positional-only
bindings, install / uninstall / skip of a built extension, and stand-in upstream Python modules
written for these tests from upstream's bev_pool.py / voxelize.py / scatter_points.py (the same
calls into the extensions), built as a real package in a temporary folder so that
`from . import bev_pool_ext` goes through the import system. Needs neither mmcv nor mmdet3d."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import mu_space
from mu_space.compat import bevfusion as compat
from mu_space.compat import mmcv as mmcv_compat
from mu_space.patcher import Patcher, default_patches
from tests.helpers import assert_close
from tests.ops import _voxel_oracle as oracle

F32 = {"atol": 1e-5, "rtol": 1e-5}  # float32 sums in another order


def _drop_projects():
    for name in [n for n in sys.modules if n == "projects" or n.startswith("projects.")]:
        del sys.modules[name]


@pytest.fixture
def clean():
    """No surrogate installed, no `projects` package imported, before and after."""
    compat.uninstall()
    _drop_projects()
    yield
    compat.uninstall()
    _drop_projects()


@pytest.fixture
def installed(clean):
    report = compat.install()
    report.reset()
    return report


@pytest.fixture
def ext(installed):
    return compat.surrogate(compat.BEV_POOL_EXT)


@pytest.fixture
def layer(installed):
    return compat.surrogate(compat.VOXEL_LAYER)


# --------------------------------------------------------------------------- bev_pool inputs


def _ranked(n=120, C=5, B=2, D=3, H=6, W=4, seed=0):
    """Points sorted by BEVFusion's rank and the intervals its QuickCumsumCuda cuts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, generator=g)
    coords = torch.stack(
        [torch.randint(0, m, (n,), generator=g) for m in (H, W, D, B)], 1
    )  # (h, w, d, b)
    ranks = coords[:, 0] * (W * D * B) + coords[:, 1] * (D * B) + coords[:, 2] * B + coords[:, 3]
    order = ranks.argsort()
    x, coords, ranks = x[order], coords[order], ranks[order]
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = ranks[1:] != ranks[:-1]
    starts = torch.nonzero(new).flatten().int()
    lengths = torch.diff(starts, append=torch.tensor([n], dtype=torch.int32)).int()
    return x, coords.int(), lengths, starts, (B, D, H, W)


def _loop_forward(x, coords, lengths, starts, dims):
    """Upstream's kernel: each interval's rows summed and written to the cell of its first row."""
    B, D, H, W = dims
    out = torch.zeros(B, D, H, W, x.shape[1], dtype=torch.float64)
    for s, n in zip(starts.tolist(), lengths.tolist()):
        h, w, d, b = coords[s].tolist()
        out[b, d, h, w] = x[s : s + n].double().sum(0)
    return out


def _loop_backward(out_grad, coords, lengths, starts, n):
    x_grad = torch.zeros(n, out_grad.shape[-1], dtype=out_grad.dtype)
    for s, k in zip(starts.tolist(), lengths.tolist()):
        h, w, d, b = coords[s].tolist()
        for i in range(s, s + k):
            x_grad[i] = out_grad[b, d, h, w]
    return x_grad


# --------------------------------------------------------------------------- functions


def test_positional_bindings_and_names(ext, layer):
    assert compat.ALL_NAMES == (
        "bev_pool_ext.bev_pool_forward",
        "bev_pool_ext.bev_pool_backward",
        "voxel_layer.hard_voxelize",
        "voxel_layer.dynamic_voxelize",
        "voxel_layer.dynamic_point_to_voxel_forward",
        "voxel_layer.dynamic_point_to_voxel_backward",
    )
    for module, mod in ((compat.BEV_POOL_EXT, ext), (compat.VOXEL_LAYER, layer)):
        for name, params in compat.SIGNATURES[module].items():
            sig = inspect.signature(getattr(mod, name))
            assert tuple(sig.parameters) == params
            assert all(p.kind is p.POSITIONAL_ONLY for p in sig.parameters.values())
            assert getattr(mod, name).__doc__.startswith(f"{name}(")
    x, coords, lengths, starts, dims = _ranked()
    with pytest.raises(TypeError, match=r"bev_pool_ext\.bev_pool_forward\(\).*positional"):
        ext.bev_pool_forward(x, coords, lengths, starts, *dims[:3], w=dims[3])
    with pytest.raises(TypeError, match=r"voxel_layer\.hard_voxelize\(\)"):  # no defaults
        layer.hard_voxelize(x, x, coords, lengths, [1, 1, 1], [0] * 6, 5, 10, 3)


def test_bev_pool_forward_is_the_interval_sums(ext):
    x, coords, lengths, starts, dims = _ranked()
    out = ext.bev_pool_forward(x, coords, lengths, starts, *dims)
    assert out.shape == (*dims, x.shape[1]) and out.dtype == torch.float32
    assert out.is_contiguous()
    assert_close(out.double(), _loop_forward(x, coords, lengths, starts, dims), **F32)
    # mu_space.bev_pool's [B, C, D, H, W], channels last
    want = mu_space.bev_pool(x, coords, *dims).permute(0, 2, 3, 4, 1)
    assert_close(out, want, **F32)
    # B, D, H, W as BEVFusion passes them (self.nx[i]: 0-d long tensors); a float is refused
    tensors = [torch.tensor(v) for v in dims]
    assert torch.equal(ext.bev_pool_forward(x, coords, lengths, starts, *tensors), out)
    with pytest.raises(TypeError, match="d must be an int"):
        ext.bev_pool_forward(x, coords, lengths, starts, dims[0], 3.0, *dims[2:])


def test_bev_pool_forward_takes_any_intervals(ext):
    """Intervals that skip rows, come in another order, or start at another row of the same
    cell: the rows of each interval, summed at its first row's cell."""
    x, coords, lengths, starts, dims = _ranked(seed=1)
    keep = torch.arange(starts.numel()).flip(0)[::2]  # every other interval, reversed
    s, n = starts[keep].clone(), lengths[keep].clone()
    n[n > 1] -= 1  # drop the last row of the longer ones
    out = ext.bev_pool_forward(x, coords, n, s, *dims)
    assert_close(out.double(), _loop_forward(x, coords, n, s, dims), **F32)
    empty = ext.bev_pool_forward(x, coords, n[:0], s[:0], *dims)
    assert empty.shape == out.shape and not empty.any()


def test_bev_pool_backward_is_a_gather(ext):
    x, coords, lengths, starts, dims = _ranked(seed=2)
    out_grad = torch.randn(*dims, x.shape[1], generator=torch.Generator().manual_seed(5))
    got = ext.bev_pool_backward(out_grad, coords, lengths, starts, *dims)
    assert got.shape == x.shape and got.dtype == out_grad.dtype
    assert torch.equal(got, _loop_backward(out_grad, coords, lengths, starts, x.shape[0]))
    s, n = starts[1::3], lengths[1::3]  # rows of no interval get 0
    got = ext.bev_pool_backward(out_grad, coords, n, s, *dims)
    assert torch.equal(got, _loop_backward(out_grad, coords, n, s, x.shape[0]))
    with pytest.raises(ValueError, match="out_grad must be"):
        ext.bev_pool_backward(out_grad[:1], coords, lengths, starts, *dims)


def _cloud(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(n, 4, generator=g) * torch.tensor([12.0, 10.0, 4.0, 1.0])
    pts[:, :3] -= torch.tensor([1.0, 1.0, 0.5])  # some outside on each axis
    return pts, [1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 10.0, 8.0, 3.0]  # grid (10, 8, 3): not cubic


def _xyz(zyx: torch.Tensor) -> torch.Tensor:
    valid = zyx[:, :1] >= 0
    return torch.where(valid, zyx.flip(1), zyx)


@pytest.mark.parametrize("deterministic", [True, False])
def test_hard_voxelize_is_mmcv_hard_in_xyz_order(layer, deterministic):
    pts, size, rng = _cloud()
    max_points, max_voxels = 3, 40
    voxels = pts.new_zeros(max_voxels, max_points, 4)
    coors = pts.new_zeros(max_voxels, 3, dtype=torch.int)
    num = pts.new_zeros(max_voxels, dtype=torch.int)
    m = layer.hard_voxelize(
        pts, voxels, coors, num, size, rng, max_points, max_voxels, 3, deterministic
    )
    want_v, want_c, want_n = oracle.mmcv_hard(pts, size, rng, max_points, max_voxels)
    assert type(m) is int and m == want_v.shape[0] == max_voxels  # max_voxels reached
    assert torch.equal(voxels[:m], want_v)
    assert torch.equal(coors[:m], want_c.flip(1))  # BEVFusion: (x, y, z)
    assert torch.equal(num[:m], want_n)
    voxels2 = pts.new_zeros(400, max_points, 4)
    coors2 = pts.new_zeros(400, 3, dtype=torch.int)
    num2 = pts.new_zeros(400, dtype=torch.int)
    m = layer.hard_voxelize(pts, voxels2, coors2, num2, size, rng, max_points, 400, 3, True)
    want_v, want_c, want_n = oracle.mmcv_hard(pts, size, rng, max_points, 400)
    assert m == want_v.shape[0] < 400
    assert torch.equal(coors2[:m], want_c.flip(1)) and torch.equal(num2[:m], want_n)
    assert not coors2[m:].any() and not num2[m:].any() and not voxels2[m:].any()  # untouched
    with pytest.raises(NotImplementedError, match="NDim == 3"):
        layer.hard_voxelize(pts, voxels, coors, num, size, rng, 3, 40, 4, True)


def test_dynamic_voxelize_is_mmcv_dynamic_in_xyz_order(layer):
    pts, size, rng = _cloud(seed=1)
    coors = pts.new_zeros(pts.shape[0], 3, dtype=torch.int)
    assert layer.dynamic_voxelize(pts, coors, size, rng, 3) is None
    want = oracle.mmcv_dynamic(pts, size, rng)
    assert (want[:, 0] < 0).any() and (want[:, 0] >= 0).any()
    assert torch.equal(coors, _xyz(want))
    # the dropped rows keep upstream's positional pattern: x out (-1, 0, 0), y out (-1, -1, 0)
    rows = {tuple(r) for r in coors[coors[:, 0] < 0].tolist()}
    assert rows <= {(-1, 0, 0), (-1, -1, 0), (-1, -1, -1)} and len(rows) == 3


@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
def test_scatter_forward_and_backward_are_mmcv_scatter(layer, reduce):
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(200, 3, generator=g)
    coors = torch.randint(0, 4, (200, 3), generator=g, dtype=torch.int32)  # (x, y, z)
    coors[::17] = -1
    vf, vc, p2v, cnt = layer.dynamic_point_to_voxel_forward(feats, coors, reduce)
    want_f, want_c, members = oracle.mmcv_scatter(feats, coors, reduce)
    assert torch.equal(vc, want_c) and p2v.dtype == cnt.dtype == torch.int32
    assert_close(vf.double(), want_f, **F32)
    assert cnt.tolist() == [len(m) for m in members]
    grad = torch.randn(vf.shape, generator=g)
    grad_feats = torch.zeros_like(feats)
    out = layer.dynamic_point_to_voxel_backward(grad_feats, grad, feats, vf, p2v, cnt, reduce)
    assert out is None
    want = oracle.mmcv_scatter_grad(feats, reduce, vf.double(), members, grad)
    assert_close(grad_feats.double(), want, **F32)
    with pytest.raises(RuntimeError, match="do not support reduce type min"):
        layer.dynamic_point_to_voxel_forward(feats, coors, "min")


# --------------------------------------------------------------------------- install


def test_install_is_idempotent_and_needs_no_mmcv_surrogate(clean, monkeypatch):
    monkeypatch.setitem(sys.modules, "mmcv._ext", None)  # `import mmcv._ext` fails
    report = compat.install()
    assert compat.install() is report and report.status == "installed"
    assert report.served == compat.ALL_NAMES and report.not_served == ()
    finders = [f for f in sys.meta_path if getattr(f, "MU_SPACE_BEVFUSION_EXT", False)]
    assert len(finders) == 1 and compat.installed()
    module = compat.surrogate(compat.BEV_POOL_EXT)
    assert compat.install(backend="reference").backend == "reference"
    assert compat.surrogate(compat.BEV_POOL_EXT) is module
    with pytest.raises(ValueError, match="backend must be one of"):
        compat.install(backend="Native")
    compat.install()
    text = str(report)
    assert "6 of 6" in text and compat.VOXEL_LAYER in text and "0 calls" in text
    pts, size, rng = _cloud()
    coors = pts.new_zeros(pts.shape[0], 3, dtype=torch.int)
    compat.surrogate(compat.VOXEL_LAYER).dynamic_voxelize(pts, coors, size, rng, 3)
    assert torch.equal(coors, _xyz(oracle.mmcv_dynamic(pts, size, rng)))
    assert not mmcv_compat.installed()
    compat.uninstall()
    assert not compat.installed() and report.status == "not installed"
    assert not any(getattr(f, "MU_SPACE_BEVFUSION_EXT", False) for f in sys.meta_path)


def _standin(root: Path) -> Path:
    """Stand-ins of upstream's Python modules under root/projects/BEVFusion/bevfusion/ops,
    written for these tests: the same imports of the compiled extensions and the same calls
    into them as upstream's bev_pool.py, voxelize.py and scatter_points.py; depth_lss.py only
    imports bev_pool as upstream's does. bevfusion/__init__.py is empty (upstream's imports the
    whole model)."""
    files = {
        "projects/__init__.py": "",
        "projects/BEVFusion/__init__.py": "",
        "projects/BEVFusion/bevfusion/__init__.py": "",
        "projects/BEVFusion/bevfusion/depth_lss.py": "from .ops import bev_pool\n",
        "projects/BEVFusion/bevfusion/ops/__init__.py": """
            from .bev_pool import bev_pool
            from .voxel import dynamic_scatter, voxelization
        """,
        "projects/BEVFusion/bevfusion/ops/bev_pool/__init__.py": "from .bev_pool import bev_pool\n",
        "projects/BEVFusion/bevfusion/ops/bev_pool/bev_pool.py": """
            import torch

            from . import bev_pool_ext


            class QuickCumsumCuda(torch.autograd.Function):
                # upstream: intervals cut at rank changes, the extension pools them
                @staticmethod
                def forward(ctx, x, geom_feats, ranks, B, D, H, W):
                    first = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
                    first[1:] = ranks[1:] != ranks[:-1]
                    starts = torch.where(first)[0].int()
                    ends = torch.cat([starts[1:], starts.new_tensor([x.shape[0]])])
                    lengths = ends - starts
                    geom_feats = geom_feats.int()
                    out = bev_pool_ext.bev_pool_forward(
                        x, geom_feats, lengths, starts, B, D, H, W
                    )
                    ctx.save_for_backward(starts, lengths, geom_feats)
                    ctx.dims = (B, D, H, W)
                    return out

                @staticmethod
                def backward(ctx, out_grad):
                    starts, lengths, geom_feats = ctx.saved_tensors
                    x_grad = bev_pool_ext.bev_pool_backward(
                        out_grad.contiguous(), geom_feats, lengths, starts, *ctx.dims
                    )
                    return x_grad, None, None, None, None, None, None


            def bev_pool(feats, coords, B, D, H, W):
                assert feats.shape[0] == coords.shape[0]
                ranks = (coords[:, 0] * (W * D * B) + coords[:, 1] * (D * B)
                         + coords[:, 2] * B + coords[:, 3])
                order = ranks.argsort()
                feats, coords, ranks = feats[order], coords[order], ranks[order]
                out = QuickCumsumCuda.apply(feats, coords, ranks, B, D, H, W)
                return out.permute(0, 4, 1, 2, 3).contiguous()
        """,
        "projects/BEVFusion/bevfusion/ops/voxel/__init__.py": """
            from .scatter_points import dynamic_scatter
            from .voxelize import voxelization
        """,
        "projects/BEVFusion/bevfusion/ops/voxel/voxelize.py": """
            import torch
            from torch.autograd import Function

            from .voxel_layer import dynamic_voxelize, hard_voxelize


            class _Voxelization(Function):
                @staticmethod
                def forward(ctx, points, voxel_size, coors_range, max_points=35,
                            max_voxels=20000, deterministic=True):
                    if max_points == -1 or max_voxels == -1:
                        coors = points.new_zeros(size=(points.size(0), 3), dtype=torch.int)
                        dynamic_voxelize(points, coors, voxel_size, coors_range, 3)
                        return coors
                    voxels = points.new_zeros(size=(max_voxels, max_points, points.size(1)))
                    coors = points.new_zeros(size=(max_voxels, 3), dtype=torch.int)
                    num = points.new_zeros(size=(max_voxels,), dtype=torch.int)
                    m = hard_voxelize(points, voxels, coors, num, voxel_size, coors_range,
                                      max_points, max_voxels, 3, deterministic)
                    return voxels[:m], coors[:m], num[:m]


            voxelization = _Voxelization.apply
        """,
        "projects/BEVFusion/bevfusion/ops/voxel/scatter_points.py": """
            import torch
            from torch.autograd import Function

            from .voxel_layer import (dynamic_point_to_voxel_backward,
                                      dynamic_point_to_voxel_forward)


            class _dynamic_scatter(Function):
                @staticmethod
                def forward(ctx, feats, coors, reduce_type="max"):
                    vf, vc, p2v, cnt = dynamic_point_to_voxel_forward(feats, coors, reduce_type)
                    ctx.reduce_type = reduce_type
                    ctx.save_for_backward(feats, vf, p2v, cnt)
                    ctx.mark_non_differentiable(vc)
                    return vf, vc

                @staticmethod
                def backward(ctx, grad_vf, grad_vc=None):
                    feats, vf, p2v, cnt = ctx.saved_tensors
                    grad_feats = torch.zeros_like(feats)
                    dynamic_point_to_voxel_backward(grad_feats, grad_vf.contiguous(), feats, vf,
                                                    p2v, cnt, ctx.reduce_type)
                    return grad_feats, None, None


            dynamic_scatter = _dynamic_scatter.apply
        """,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture
def upstream(clean, tmp_path, monkeypatch):
    """The stand-in package importable from tmp_path (nothing imported yet)."""
    monkeypatch.syspath_prepend(str(_standin(tmp_path)))
    importlib.invalidate_caches()
    return tmp_path


def test_without_the_surrogate_upstream_does_not_import(upstream):
    with pytest.raises(ImportError, match="bev_pool_ext"):
        importlib.import_module("projects.BEVFusion.bevfusion.ops")


def test_upstream_imports_and_runs_on_the_surrogates(upstream):
    report = compat.install()  # before the import: the finder serves both modules
    report.reset()
    ops = importlib.import_module("projects.BEVFusion.bevfusion.ops")
    pool_mod = sys.modules["projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool"]
    assert pool_mod.bev_pool_ext is sys.modules[compat.BEV_POOL_EXT]
    assert pool_mod.bev_pool_ext is compat.surrogate(compat.BEV_POOL_EXT)
    assert sys.modules[compat.VOXEL_LAYER] is compat.surrogate(compat.VOXEL_LAYER)
    assert (
        sys.modules["projects.BEVFusion.bevfusion.ops.voxel"].voxel_layer
        is sys.modules[compat.VOXEL_LAYER]
    )
    assert sys.modules[compat.BEV_POOL_EXT].__spec__.origin == compat.ORIGIN

    # bev_pool through upstream's autograd Function vs mu_space.bev_pool, forward and backward
    x, coords, _, _, dims = _ranked(n=200, seed=3)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    x, coords = x[perm], coords[perm].long()  # unsorted, as BEVFusion's geometry gives them
    nx = torch.tensor([dims[2], dims[3], dims[1]])  # BEVFusion: (x, y, z) cell counts
    a = x.clone().requires_grad_()
    out = ops.bev_pool(a, coords, dims[0], nx[2], nx[0], nx[1])
    b = x.clone().requires_grad_()
    want = mu_space.bev_pool(b, coords, *dims)
    assert out.shape == want.shape == (dims[0], x.shape[1], *dims[1:])
    assert_close(out, want, **F32)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (ga,) = torch.autograd.grad(out, a, grad)
    (gb,) = torch.autograd.grad(want, b, grad)
    assert_close(ga, gb, **F32, name="grad_feats")

    # the voxel layer through upstream's Functions
    pts, size, rng = _cloud(seed=2)
    voxels, vcoors, num = ops.voxelization(pts, size, rng, 4, 500)
    _, want_c, want_n = oracle.mmcv_hard(pts, size, rng, 4, 500)
    assert torch.equal(vcoors, want_c.flip(1)) and torch.equal(num, want_n)
    dyn = ops.voxelization(pts, size, rng, -1, -1)
    assert torch.equal(dyn, _xyz(oracle.mmcv_dynamic(pts, size, rng)))
    feats = torch.randn(pts.shape[0], 3, requires_grad=True)
    vf, vc = ops.dynamic_scatter(feats, dyn, "mean")
    (gf,) = torch.autograd.grad(vf.sum(), feats)
    assert torch.equal(gf[dyn[:, 0] < 0], torch.zeros_like(gf[dyn[:, 0] < 0]))

    assert dict(report.calls) == {
        "bev_pool_ext.bev_pool_forward": 1,
        "bev_pool_ext.bev_pool_backward": 1,
        "voxel_layer.hard_voxelize": 1,
        "voxel_layer.dynamic_voxelize": 1,
        "voxel_layer.dynamic_point_to_voxel_forward": 1,
        "voxel_layer.dynamic_point_to_voxel_backward": 1,
    }
    assert "1 calls" in report.report()


def test_install_after_the_parent_package_is_imported(clean, monkeypatch):
    """A parent package already imported (here a bare stand-in of upstream's voxel package):
    install() puts the surrogate into sys.modules and onto the package at once."""
    parent = types.ModuleType("projects.BEVFusion.bevfusion.ops.voxel")
    parent.__path__ = []
    monkeypatch.setitem(sys.modules, parent.__name__, parent)
    compat.install()
    assert parent.voxel_layer is sys.modules[compat.VOXEL_LAYER]
    assert parent.voxel_layer is compat.surrogate(compat.VOXEL_LAYER)
    compat.uninstall()
    assert not hasattr(parent, "voxel_layer") and compat.VOXEL_LAYER not in sys.modules


def test_a_built_extension_is_left_alone_unless_forced(upstream):
    built = upstream / "projects/BEVFusion/bevfusion/ops/bev_pool"
    so = built / "bev_pool_ext.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"")  # never loaded: the finder only looks for it
    assert compat.compiled_ext(compat.BEV_POOL_EXT) == str(so)
    report = compat.install()
    assert report.modules == {compat.BEV_POOL_EXT: "skipped", compat.VOXEL_LAYER: "installed"}
    assert report.status == "partial" and str(so) in report.reasons[compat.BEV_POOL_EXT]
    assert report.served == tuple(n for n in compat.ALL_NAMES if n.startswith("voxel_layer."))
    assert "skipped" in report.report()
    finder = next(f for f in sys.meta_path if getattr(f, "MU_SPACE_BEVFUSION_EXT", False))
    assert finder.find_spec(compat.BEV_POOL_EXT) is None
    assert finder.find_spec(compat.VOXEL_LAYER) is not None
    report = compat.install(force=True)
    assert report.status == "installed" and not report.reasons
    assert finder.find_spec(compat.BEV_POOL_EXT) is not None
    ops = importlib.import_module("projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool")
    assert ops.bev_pool_ext is compat.surrogate(compat.BEV_POOL_EXT)


# --------------------------------------------------------------------------- the patch


def test_projects_bev_pool_patch_on_the_standins(upstream):
    compat.install()
    root = "projects.BEVFusion.bevfusion"
    depth_lss = importlib.import_module(f"{root}.depth_lss")
    module = sys.modules[f"{root}.ops.bev_pool.bev_pool"]
    package, ops = sys.modules[f"{root}.ops.bev_pool"], sys.modules[f"{root}.ops"]
    original = module.bev_pool
    assert package.bev_pool is ops.bev_pool is depth_lss.bev_pool is original
    (patch,) = [p for p in default_patches() if p.name == "bevfusion.bev_pool.projects"]
    assert patch.enabled and patch.target == f"{root}.ops.bev_pool.bev_pool.bev_pool"
    x, coords, _, _, dims = _ranked(n=150, seed=4)
    nx = [torch.tensor(v) for v in dims]
    feats = x.clone().requires_grad_()
    want = original(feats, coords.long(), *nx)
    (want_grad,) = torch.autograd.grad(want.sum(), feats)
    patcher = Patcher([patch])
    with patcher:
        (result,) = patcher.results()
        assert result.status == "applied", result
        assert set(result.targets) == {
            f"{root}.ops.bev_pool.bev_pool.bev_pool",
            f"{root}.ops.bev_pool.bev_pool",
            f"{root}.ops.bev_pool",
            f"{root}.depth_lss.bev_pool",
        }
        replaced = depth_lss.bev_pool
        assert replaced is not original and module.bev_pool is package.bev_pool is replaced
        assert replaced.__mu_space_patch__ == "bevfusion.bev_pool.projects"
        calls = dict(compat.report().calls)
        got = depth_lss.bev_pool(feats, coords.long(), *nx)
        (got_grad,) = torch.autograd.grad(got.sum(), feats)
        assert dict(compat.report().calls) == calls  # the extension is not called
        # a second patcher skips the replacement
        second = Patcher([p for p in default_patches() if p.name == patch.name])
        (r,) = second.apply()
        assert r.status == "skipped" and "already replaced by muSPACE" in r.reason
        second.restore()
    assert_close(got, want, **F32)
    assert_close(got_grad, want_grad, **F32, name="grad_feats")
    assert module.bev_pool is package.bev_pool is ops.bev_pool is depth_lss.bev_pool is original
