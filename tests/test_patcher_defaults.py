"""`mu_space.patcher.default_patcher` on stand-in upstream modules created by these tests.

The stand-ins sit at the upstream dotted paths (mmcv.ops.multi_scale_deform_attn,
mmdet3d.ops.bev_pool_v2.bev_pool, mmdet3d.models.necks.view_transformer,
mmdet3d.ops.bev_pool.bev_pool and their re-exports) with the upstream signatures. Their bodies are
small vectorised implementations of the documented upstream semantics written for these tests
(the MSDA stand-ins use mu_space's reference, a grid_sample implementation of mmcv's rule).
Every module goes into sys.modules through monkeypatch, so nothing leaks between tests.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from mu_space.ops.multi_scale_deformable_attn import (
    multi_scale_deformable_attn_reference,
    multi_scale_deformable_attn_reference_backward,
)
from mu_space.patcher import default_patcher, default_patches
from mu_space.runtime.kernel_dispatch import BACKENDS
from mu_space.testing import bev_geometry, bev_pool_inputs, msda_inputs
from tests.helpers import assert_close, native_gpu_device

ALL = {
    "mmcv.MultiScaleDeformableAttnFunction",
    "mmcv.multi_scale_deformable_attn_pytorch",
    "bevdet.bev_pool_v2",
    "bevdet.voxel_pooling_prepare_v2",
    "bevfusion.bev_pool",
}
ON_BY_DEFAULT = ALL - {"mmcv.multi_scale_deformable_attn_pytorch"}

# Patched vs stand-in on the CPU: both sides are float32 sums of the same products in another
# order (index_add vs interval sums; grid_sample vs closed-form backward), so ~1e-6 relative.
F32 = {"atol": 1e-5, "rtol": 1e-5}

# The "tiny" camera rig on a non-square grid (X = 20, Y = 16 cells), so that a swapped x / y
# (or H / W) axis anywhere changes the result.
TINY_RECT = bev_geometry.BEVConfig(
    **{**bev_geometry.CONFIGS["tiny"].__dict__, "name": "tiny-rect", "y": (-40.0, 40.0, 5.0)}
)


# --------------------------------------------------------------------------- stand-ins


def _modules(monkeypatch, *specs):
    """Registers packages/modules by dotted name (parents are created and linked)."""
    made = {}
    for name in specs:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in made:
                made[sub] = types.ModuleType(sub)
                monkeypatch.setitem(sys.modules, sub, made[sub])
                if i > 1:
                    setattr(made[".".join(parts[: i - 1])], parts[i - 1], made[sub])
    return made


def _install_mmcv(monkeypatch):
    mods = _modules(monkeypatch, "mmcv.ops.multi_scale_deform_attn")
    msda_mod = mods["mmcv.ops.multi_scale_deform_attn"]

    class MultiScaleDeformableAttnFunction(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx,
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
            im2col_step,
        ):
            sampling_locations = sampling_locations.type_as(value)  # mmcv's AMP cast
            attention_weights = attention_weights.type_as(value)
            ctx.save_for_backward(
                value,
                value_spatial_shapes,
                value_level_start_index,
                sampling_locations,
                attention_weights,
            )
            return multi_scale_deformable_attn_reference(
                value,
                value_spatial_shapes,
                value_level_start_index,
                sampling_locations,
                attention_weights,
            )

        @staticmethod
        def backward(ctx, grad_output):
            value, shapes, starts, loc, attn = ctx.saved_tensors
            g_value, g_loc, g_attn = multi_scale_deformable_attn_reference_backward(
                grad_output, value, shapes, starts, loc, attn
            )
            return g_value, None, None, g_loc, g_attn, None

    def multi_scale_deformable_attn_pytorch(
        value, value_spatial_shapes, sampling_locations, attention_weights
    ):
        sizes = [int(h) * int(w) for h, w in value_spatial_shapes]
        starts = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))])
        shapes = torch.as_tensor([[int(h), int(w)] for h, w in value_spatial_shapes])
        return multi_scale_deformable_attn_reference(
            value, shapes, starts, sampling_locations, attention_weights
        )

    msda_mod.MultiScaleDeformableAttnFunction = MultiScaleDeformableAttnFunction
    msda_mod.multi_scale_deformable_attn_pytorch = multi_scale_deformable_attn_pytorch
    mods["mmcv.ops"].MultiScaleDeformableAttnFunction = MultiScaleDeformableAttnFunction
    return types.SimpleNamespace(
        module=msda_mod,
        ops=mods["mmcv.ops"],
        Function=MultiScaleDeformableAttnFunction,
        pytorch=multi_scale_deformable_attn_pytorch,
    )


def _install_bevdet(monkeypatch):
    mods = _modules(
        monkeypatch, "mmdet3d.ops.bev_pool_v2.bev_pool", "mmdet3d.models.necks.view_transformer"
    )
    pool_mod, vt = (
        mods["mmdet3d.ops.bev_pool_v2.bev_pool"],
        mods["mmdet3d.models.necks.view_transformer"],
    )

    def _bev_pool_v2_standin(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_starts,
        interval_lengths,
    ):
        """BEVDet bev_pool_v2: float32 sums of depth * feat rows per interval cell -> [B, C, Z, Y, X]."""
        depth, feat = depth.float(), feat.float()
        B, Z, Y, X, C = (int(v) for v in bev_feat_shape)
        starts, lengths = interval_starts.long(), interval_lengths.long()
        cell_of_point = ranks_bev[starts].long().repeat_interleave(lengths)
        first = (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
        point = starts.repeat_interleave(lengths) + torch.arange(int(lengths.sum())) - first
        rows = feat.reshape(-1, C)[ranks_feat[point].long()]
        rows = rows * depth.reshape(-1)[ranks_depth[point].long()].unsqueeze(1)
        out = torch.zeros(B * Z * Y * X, C, dtype=torch.float32).index_add(0, cell_of_point, rows)
        return out.view(B, Z, Y, X, C).permute(0, 4, 1, 2, 3).contiguous()

    pool_mod.bev_pool_v2 = _bev_pool_v2_standin
    vt.bev_pool_v2 = (
        _bev_pool_v2_standin  # `from mmdet3d.ops.bev_pool_v2.bev_pool import bev_pool_v2`
    )

    class LSSViewTransformer:
        def __init__(self, cfg):
            # BEVDet keeps the grid in float32 CPU tensors (grid_size too)
            self.grid_lower_bound = torch.Tensor(list(cfg.grid_lower_bound))
            self.grid_interval = torch.Tensor(list(cfg.grid_interval))
            self.grid_size = torch.Tensor([float(v) for v in cfg.grid_size])

        def voxel_pooling_prepare_v2(self, coor):
            B, N, D, H, W, _ = coor.shape
            q = ((coor - self.grid_lower_bound.to(coor)) / self.grid_interval.to(coor)).long()
            q = q.reshape(-1, 3)
            point = torch.arange(q.shape[0])
            inside = ((q >= 0) & (q < self.grid_size.long())).all(1)
            q, point = q[inside], point[inside]
            if point.numel() == 0:
                return None, None, None, None, None
            X, Y, Z = (int(v) for v in self.grid_size)
            rank = ((point // (N * D * H * W) * Z + q[:, 2]) * Y + q[:, 1]) * X + q[:, 0]
            rank, order = torch.sort(rank, stable=True)
            point = point[order]
            feat_row = point // (D * H * W) * (H * W) + point % (H * W)
            _, lengths = torch.unique_consecutive(rank, return_counts=True)
            starts = lengths.cumsum(0) - lengths
            return tuple(t.int().contiguous() for t in (rank, point, feat_row, starts, lengths))

        def voxel_pooling_v2(self, coor, depth, feat):
            """feat [B, N, C, H, W] -> [B, C * Z, Y, X] (as BEVDet's; the global bev_pool_v2)."""
            ranks_bev, ranks_depth, ranks_feat, starts, lengths = self.voxel_pooling_prepare_v2(
                coor
            )
            X, Y, Z = (int(v) for v in self.grid_size)
            feat = feat.permute(0, 1, 3, 4, 2)
            shape = (depth.shape[0], Z, Y, X, feat.shape[-1])
            out = sys.modules["mmdet3d.models.necks.view_transformer"].bev_pool_v2(
                depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, starts, lengths
            )
            return torch.cat(out.unbind(dim=2), 1)

    vt.LSSViewTransformer = LSSViewTransformer
    return types.SimpleNamespace(
        pool_mod=pool_mod,
        vt=vt,
        bev_pool_v2=_bev_pool_v2_standin,
        LSSViewTransformer=LSSViewTransformer,
        prepare=LSSViewTransformer.voxel_pooling_prepare_v2,
    )


def _install_bevfusion(monkeypatch):
    mods = _modules(monkeypatch, "mmdet3d.ops.bev_pool.bev_pool", "mmdet3d.models.vtransforms.base")

    def bev_pool(feats, coords, B, D, H, W):
        """BEVFusion bev_pool: coords (x, y, z, b) -> out[b, :, z, x, y] += feats row."""
        B, D, H, W = (int(v) for v in (B, D, H, W))
        c = coords.long()
        cell = ((c[:, 3] * D + c[:, 2]) * H + c[:, 0]) * W + c[:, 1]
        out = torch.zeros(B * D * H * W, feats.shape[1], dtype=feats.dtype)
        out = out.index_add(0, cell, feats)
        return out.view(B, D, H, W, -1).permute(0, 4, 1, 2, 3).contiguous()

    mods["mmdet3d.ops.bev_pool.bev_pool"].bev_pool = bev_pool
    mods[
        "mmdet3d.ops.bev_pool"
    ].bev_pool = bev_pool  # package __init__: from .bev_pool import bev_pool
    mods["mmdet3d.ops"].bev_pool = bev_pool  # mmdet3d/ops/__init__.py re-export
    mods["mmdet3d.models.vtransforms.base"].bev_pool = bev_pool  # from mmdet3d.ops import bev_pool
    return types.SimpleNamespace(
        bev_pool=bev_pool,
        module=mods["mmdet3d.ops.bev_pool.bev_pool"],
        package=mods["mmdet3d.ops.bev_pool"],
        ops=mods["mmdet3d.ops"],
        base=mods["mmdet3d.models.vtransforms.base"],
    )


@pytest.fixture
def upstream(monkeypatch):
    return types.SimpleNamespace(
        mmcv=_install_mmcv(monkeypatch),
        bevdet=_install_bevdet(monkeypatch),
        bevfusion=_install_bevfusion(monkeypatch),
    )


@pytest.fixture
def absent(monkeypatch):
    """No mmcv / mmdet3d importable, even if they are installed here."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("mmcv", "mmdet3d"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mmcv", None)
    monkeypatch.setitem(sys.modules, "mmdet3d", None)


def _status(results):
    return {r.name: r for r in results}


# --------------------------------------------------------------------------- mechanics


def test_default_patcher_is_fresh_and_lists_the_call_sites():
    a, b = default_patcher(), default_patcher()
    assert a is not b and {p.name for p in a.patches} == ALL
    a.disable("bevdet.bev_pool_v2")
    assert all(p.enabled for p in b.patches if p.name in ON_BY_DEFAULT)  # no shared state
    assert not next(
        p for p in b.patches if p.name == "mmcv.multi_scale_deformable_attn_pytorch"
    ).enabled
    assert all(p.precheck is not None and p.description for p in default_patches())


@pytest.mark.parametrize("backend", ["nonsense", "Native", None, 0])
def test_unknown_backend_is_rejected_when_the_patcher_is_built(backend):
    for build in (default_patcher, default_patches):
        with pytest.raises(ValueError, match="backend must be one of") as err:
            build(backend=backend)
        assert all(repr(b) in str(err.value) for b in BACKENDS), err.value
        assert repr(backend) in str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_accepted(backend):
    assert {p.name for p in default_patcher(backend=backend).patches} == ALL


def test_absent_upstream_is_a_clean_skip(absent):
    patcher = default_patcher()
    results = _status(patcher.apply())
    for name in ON_BY_DEFAULT:
        assert results[name].status == "skipped", results[name]
        assert "not importable" in results[name].reason
    assert results["mmcv.multi_scale_deformable_attn_pytorch"].status == "disabled"
    assert not patcher.applied
    report = patcher.report()
    assert "bevfusion.bev_pool" in report and "not importable" in report
    patcher.restore()


def test_apply_restore_aliases_and_rebinding(upstream):
    m, d, f = upstream.mmcv, upstream.bevdet, upstream.bevfusion
    patcher = default_patcher()
    results = _status(patcher.apply())
    assert {n for n, r in results.items() if r.status == "applied"} == ON_BY_DEFAULT
    assert results["mmcv.multi_scale_deformable_attn_pytorch"].status == "disabled"
    assert set(results["mmcv.MultiScaleDeformableAttnFunction"].targets) == {
        "mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttnFunction",
        "mmcv.ops.MultiScaleDeformableAttnFunction",
    }
    assert set(results["bevdet.bev_pool_v2"].targets) == {
        "mmdet3d.ops.bev_pool_v2.bev_pool.bev_pool_v2",
        "mmdet3d.models.necks.view_transformer.bev_pool_v2",
    }
    assert set(results["bevfusion.bev_pool"].targets) == {
        "mmdet3d.ops.bev_pool.bev_pool.bev_pool",
        "mmdet3d.ops.bev_pool.bev_pool",
        "mmdet3d.ops.bev_pool",
        "mmdet3d.models.vtransforms.base.bev_pool",
    }
    patched_fn = m.module.MultiScaleDeformableAttnFunction
    assert patched_fn is not m.Function and m.ops.MultiScaleDeformableAttnFunction is patched_fn
    assert m.module.multi_scale_deformable_attn_pytorch is m.pytorch  # off by default
    assert d.pool_mod.bev_pool_v2 is d.vt.bev_pool_v2 is not d.bev_pool_v2
    assert d.LSSViewTransformer.voxel_pooling_prepare_v2 is not d.prepare
    assert f.module.bev_pool is f.package.bev_pool is f.ops.bev_pool is f.base.bev_pool
    assert f.base.bev_pool is not f.bev_pool
    assert "applied" in patcher.report()
    patcher.restore()
    assert m.module.MultiScaleDeformableAttnFunction is m.Function
    assert m.ops.MultiScaleDeformableAttnFunction is m.Function
    assert d.pool_mod.bev_pool_v2 is d.vt.bev_pool_v2 is d.bev_pool_v2
    assert d.LSSViewTransformer.voxel_pooling_prepare_v2 is d.prepare
    assert all(mod.bev_pool is f.bev_pool for mod in (f.module, f.package, f.ops, f.base))


def test_disable_enable_and_context_manager(upstream):
    m, f = upstream.mmcv, upstream.bevfusion
    patcher = (
        default_patcher()
        .disable("bevfusion.bev_pool")
        .enable("mmcv.multi_scale_deformable_attn_pytorch")
    )
    with patcher:
        results = _status(patcher.results())
        assert results["bevfusion.bev_pool"].status == "disabled"
        assert results["mmcv.multi_scale_deformable_attn_pytorch"].status == "applied"
        assert f.ops.bev_pool is f.bev_pool
        assert m.module.multi_scale_deformable_attn_pytorch is not m.pytorch
    assert m.module.multi_scale_deformable_attn_pytorch is m.pytorch


def test_wrong_upstream_signature_is_skipped_with_the_reason(upstream, monkeypatch):
    d, m = upstream.bevdet, upstream.mmcv

    def bev_pool_v2(
        depth,
        feat,
        ranks_depth,
        ranks_feat,
        ranks_bev,
        bev_feat_shape,
        interval_lengths,
        interval_starts,
    ):  # swapped: must not be patched
        raise AssertionError("not called")

    class OldFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value, value_spatial_shapes, sampling_locations, attention_weights):
            raise AssertionError("not called")

    monkeypatch.setattr(d.pool_mod, "bev_pool_v2", bev_pool_v2)
    monkeypatch.setattr(m.module, "MultiScaleDeformableAttnFunction", OldFunction)
    monkeypatch.setattr(
        d.LSSViewTransformer, "voxel_pooling_prepare_v2", lambda self, coor, extra: None
    )
    patcher = default_patcher()
    results = _status(patcher.apply())
    for name, needle in (
        ("bevdet.bev_pool_v2", "interval_lengths, interval_starts"),
        (
            "mmcv.MultiScaleDeformableAttnFunction",
            "ctx, value, value_spatial_shapes, sampling_locations",
        ),
        ("bevdet.voxel_pooling_prepare_v2", "self, coor, extra"),
    ):
        assert results[name].status == "skipped"
        assert "precheck failed" in results[name].reason and needle in results[name].reason
    assert results["bevfusion.bev_pool"].status == "applied"
    assert (
        d.pool_mod.bev_pool_v2 is bev_pool_v2
        and m.module.MultiScaleDeformableAttnFunction is OldFunction
    )
    patcher.restore()


def test_a_second_patcher_does_not_patch_the_replacements(upstream):
    first, second = default_patcher(), default_patcher()
    with first:
        results = _status(second.apply())
        assert all(
            results[n].status == "skipped" and "already replaced by muSPACE" in results[n].reason
            for n in ON_BY_DEFAULT
        )
        second.restore()
    assert upstream.bevfusion.ops.bev_pool is upstream.bevfusion.bev_pool


def test_missing_alias_is_not_an_error(upstream, monkeypatch):
    monkeypatch.delattr(
        upstream.mmcv.ops, "MultiScaleDeformableAttnFunction"
    )  # mmcv.ops without it
    with default_patcher() as patcher:
        (r,) = [r for r in patcher.results() if r.name == "mmcv.MultiScaleDeformableAttnFunction"]
        assert r.status == "applied"
        assert r.targets == ["mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttnFunction"]


# --------------------------------------------------------------------------- numbers


def _grads(out, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad_out)


def _msda_inputs(dtype=torch.float32):
    inputs = msda_inputs.make("tiny", dtype=dtype, seed=3)
    value, shapes, starts, loc, attn = msda_inputs.args(inputs)
    loc = msda_inputs.nudge_off_pixel_edges(loc, shapes)  # grad_loc jumps at pixel edges
    return [t.requires_grad_(t.is_floating_point()) for t in (value, shapes, starts, loc, attn)]


def test_msda_function_matches_the_standin(upstream):
    m = upstream.mmcv
    value, shapes, starts, loc, attn = _msda_inputs()
    want = m.Function.apply(value, shapes, starts, loc, attn, 64)
    want_grads = _grads(want, (value, loc, attn))
    with default_patcher():
        fn = sys.modules["mmcv.ops.multi_scale_deform_attn"].MultiScaleDeformableAttnFunction
        got = fn.apply(value, shapes, starts, loc, attn, 64)
        got_grads = _grads(got, (value, loc, attn))
    cfg = msda_inputs.CONFIGS["tiny"]
    assert got.shape == (cfg.batch, cfg.queries, cfg.heads * cfg.head_dim)
    assert_close(got, want, **F32)
    for name, g, w in zip(("grad_value", "grad_loc", "grad_attn"), got_grads, want_grads):
        assert_close(g, w, **F32, name=name)


def test_msda_function_casts_like_mmcv_under_amp(upstream):
    """mmcv casts sampling_locations / attention_weights to value's dtype (AMP gives value in
    half and the rest in float32); the replacement must accept that too."""
    value, shapes, starts, loc, attn = (t.detach() for t in _msda_inputs())
    value = value.double()
    want = upstream.mmcv.Function.apply(value, shapes, starts, loc, attn, 64)
    with default_patcher():
        got = sys.modules["mmcv.ops"].MultiScaleDeformableAttnFunction.apply(
            value, shapes, starts, loc, attn, 64
        )
    assert got.dtype == torch.float64
    assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_msda_pytorch_path_matches_the_standin(upstream):
    m = upstream.mmcv
    value, shapes, _, loc, attn = (t.detach() for t in _msda_inputs())
    want = m.pytorch(value, shapes, loc, attn)
    with default_patcher().enable("mmcv.multi_scale_deformable_attn_pytorch"):
        patched = sys.modules[
            "mmcv.ops.multi_scale_deform_attn"
        ].multi_scale_deformable_attn_pytorch
        got = patched(value, shapes, loc, attn)
        got_list = patched(value, [tuple(hw) for hw in shapes.tolist()], loc, attn)
        again = patched(value, shapes, loc, attn)  # cached start index
    for out in (got, got_list, again):
        assert_close(out, want, **F32)


def test_bev_pool_v2_matches_the_standin(upstream):
    d = upstream.bevdet
    g = bev_geometry.make(TINY_RECT, batch=2)
    vt = d.LSSViewTransformer(g["config"])
    ranks_bev, ranks_depth, ranks_feat, starts, lengths = vt.voxel_pooling_prepare_v2(g["coor"])
    depth = g["depth"].clone().requires_grad_()
    feat = g["feat"].clone().requires_grad_()
    args = (ranks_depth, ranks_feat, ranks_bev, g["bev_feat_shape"], starts, lengths)
    want = d.bev_pool_v2(depth, feat, *args)
    want_grads = _grads(want, (depth, feat))
    with default_patcher():
        got = sys.modules["mmdet3d.ops.bev_pool_v2.bev_pool"].bev_pool_v2(depth, feat, *args)
        got_grads = _grads(got, (depth, feat))
        # int64 ranks and float64 inputs: upstream casts to int32 / float32, so must we
        got64 = d.vt.bev_pool_v2(
            depth.double(),
            feat.double(),
            *(a.long() if isinstance(a, torch.Tensor) else a for a in args),
        )
    B, Z, Y, X, C = g["bev_feat_shape"]
    assert got.shape == (B, C, Z, Y, X) and got.is_contiguous() and got.dtype == torch.float32
    assert got.abs().sum() > 0
    assert_close(got, want, **F32)
    assert_close(got64, want, **F32, name="float64 / int64 inputs")
    for name, gg, w in zip(("grad_depth", "grad_feat"), got_grads, want_grads):
        assert_close(gg, w, **F32, name=name)


def test_voxel_pooling_prepare_v2_matches_the_standin(upstream):
    d = upstream.bevdet
    g = bev_geometry.make(TINY_RECT, batch=2)
    vt = d.LSSViewTransformer(g["config"])
    want = vt.voxel_pooling_prepare_v2(g["coor"])
    with default_patcher():
        got = vt.voxel_pooling_prepare_v2(g["coor"])
        # nothing in the grid: upstream's five Nones
        none = vt.voxel_pooling_prepare_v2(g["coor"] + 1000.0)
    assert type(got) is tuple and len(got) == 5
    assert none == (None, None, None, None, None)
    for name, gt, w in zip(
        ("ranks_bev", "ranks_depth", "ranks_feat", "interval_starts", "interval_lengths"), got, want
    ):
        assert gt.dtype == torch.int32 and gt.is_contiguous(), name
        assert torch.equal(gt, w), name  # both orders are stable: identical, not just equal sets
    assert want[0].numel() > 100 and want[3].numel() > 10  # a real workload


def test_prepare_falls_back_to_upstream_without_an_integral_grid(upstream, monkeypatch):
    d = upstream.bevdet
    g = bev_geometry.make(TINY_RECT)
    vt = d.LSSViewTransformer(g["config"])
    vt.grid_size = vt.grid_size + 0.5  # not integral: muSPACE leaves it to upstream
    calls = []

    def spy(self, coor):
        calls.append(1)
        return d.prepare(self, coor)

    monkeypatch.setattr(d.LSSViewTransformer, "voxel_pooling_prepare_v2", spy)
    with default_patcher():
        vt.voxel_pooling_prepare_v2(g["coor"])
        assert calls == [1]
        del vt.grid_interval  # not a BEVDet grid at all: upstream too
        with pytest.raises(AttributeError):
            vt.voxel_pooling_prepare_v2(g["coor"])
    assert len(calls) == 2


def test_bevdet_view_transform_end_to_end(upstream):
    """Both BEVDet patches through the stand-in's own voxel_pooling_v2 (class method lookup plus
    the view transformer module's imported bev_pool_v2)."""
    d = upstream.bevdet
    g = bev_geometry.make(TINY_RECT, batch=2)
    vt = d.LSSViewTransformer(g["config"])
    feat = g["feat"].permute(0, 1, 4, 2, 3).contiguous()  # [B, N, C, H, W] as BEVDet passes it
    want = vt.voxel_pooling_v2(g["coor"], g["depth"], feat)
    with default_patcher():
        got = vt.voxel_pooling_v2(g["coor"], g["depth"], feat)
    assert_close(got, want, **F32)


@pytest.mark.parametrize("float_dims", [False, True])
def test_bev_pool_matches_the_standin(upstream, float_dims):
    f = upstream.bevfusion
    inputs = bev_pool_inputs.bevfusion_inputs(TINY_RECT, batch=2)
    feats = inputs["feats"].clone().requires_grad_()
    dims = [inputs[k] for k in "BDHW"]
    # BEVFusion passes self.nx[i] (0-d long tensors); BEVDet's older transformer float ones
    dims = [torch.tensor(float(v)) if float_dims else torch.tensor(v) for v in dims]
    want = f.bev_pool(feats, inputs["coords"], *dims)
    (want_grad,) = _grads(want, (feats,))
    with default_patcher():
        got = f.base.bev_pool(feats, inputs["coords"], *dims)
        (got_grad,) = _grads(got, (feats,))
    assert got.shape == (inputs["B"], feats.shape[1], inputs["D"], inputs["H"], inputs["W"])
    assert_close(got, want, **F32)
    assert_close(got_grad, want_grad, **F32, name="grad_feats")


@pytest.mark.gpu
def test_patched_calls_match_the_standins_on_the_gpu(upstream):
    """The same comparisons with the native kernels behind the patches."""
    device = native_gpu_device()
    d, f, m = upstream.bevdet, upstream.bevfusion, upstream.mmcv
    g = bev_geometry.make(TINY_RECT, batch=2)
    vt = d.LSSViewTransformer(g["config"])
    feat = g["feat"].permute(0, 1, 4, 2, 3).contiguous()
    want_bev = vt.voxel_pooling_v2(g["coor"], g["depth"], feat)
    inputs = bev_pool_inputs.bevfusion_inputs(TINY_RECT, batch=2)
    want_pool = f.bev_pool(inputs["feats"], inputs["coords"], *(inputs[k] for k in "BDHW"))
    value, shapes, starts, loc, attn = (t.detach() for t in _msda_inputs())
    want_msda = m.Function.apply(value, shapes, starts, loc, attn, 64)
    with default_patcher(backend="native"):
        # the stand-ins' CPU-only helpers are bypassed: every call below is a replacement
        ranks = vt.voxel_pooling_prepare_v2(g["coor"].to(device))
        X, Y, Z = g["config"].grid_size
        out = d.vt.bev_pool_v2(
            g["depth"].to(device),
            feat.to(device).permute(0, 1, 3, 4, 2),
            ranks[1],
            ranks[2],
            ranks[0],
            (2, Z, Y, X, feat.shape[2]),
            ranks[3],
            ranks[4],
        )
        got_bev = torch.cat(out.unbind(dim=2), 1)
        got_pool = f.ops.bev_pool(
            inputs["feats"].to(device), inputs["coords"].to(device), *(inputs[k] for k in "BDHW")
        )
        got_msda = m.ops.MultiScaleDeformableAttnFunction.apply(
            *(t.to(device) for t in (value, shapes, starts, loc, attn)), 64
        )
    assert_close(got_bev.cpu(), want_bev, **F32)
    assert_close(got_pool.cpu(), want_pool, **F32)
    assert_close(got_msda.cpu(), want_msda, atol=1e-4, rtol=1e-4)  # MSDA self-check tolerance


def test_operator_matrix_names_every_default_patch_and_recipe():
    """The registry's `patches` / `recipes` (the operator matrix's models column) name real
    default patches and model_examples directories, and every default patch is listed under the
    op it calls."""
    import mu_space.ops  # noqa: F401  (registers the operators)
    from mu_space.runtime import registry

    root = Path(__file__).resolve().parents[1]
    default_names = {p.name for p in default_patcher().patches}
    listed = set()
    for spec in registry.operators(public_only=True):
        listed.update(spec.patches)
        for recipe in spec.recipes:
            assert (root / recipe / "README.md").is_file(), f"{spec.name}: no {recipe}/README.md"
    assert listed == default_names, (
        f"unlisted {default_names - listed}, unknown {listed - default_names}"
    )
