"""`mu_space.patcher.default_patcher` on stand-in upstream modules created by these tests.

The stand-ins sit at the upstream dotted paths (mmcv.ops.multi_scale_deform_attn,
mmdet3d.ops.bev_pool_v2.bev_pool, mmdet3d.models.necks.view_transformer,
mmdet3d.ops.bev_pool.bev_pool, mmcv.ops.voxelize, mmcv.ops.scatter_points, mmcv._ext,
mmdet3d.models.middle_encoders.pillar_scatter and their re-exports; the box3d ones of
tests/test_patcher_box3d.py, whose tests are there) with the upstream
signatures. Their bodies are small vectorised implementations of the documented upstream
semantics written for these tests (the MSDA stand-ins use mu_space's reference, a grid_sample
implementation of mmcv's rule; the voxel stand-ins use tests/ops/_voxel_oracle, mmcv's rules as
Python loops). Every module goes into sys.modules through monkeypatch, so nothing leaks between
tests.
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
from mu_space.testing import bev_geometry, bev_pool_inputs, lidar, msda_inputs
from tests.helpers import assert_close, native_gpu_device
from tests.ops import _voxel_oracle as oracle
from tests.test_patcher_box3d import BOX3D_PATCHES, install_box3d_upstream
from tests.test_patcher_sparse import install_spconv_upstream

VOXEL_PATCHES = {
    "mmcv.voxelization",
    "mmcv.Voxelization",
    "mmcv.dynamic_scatter",
    "mmcv.DynamicScatter",
    "mmcv._ext.hard_voxelize_forward",
    "mmcv._ext.dynamic_voxelize_forward",
    "mmcv._ext.dynamic_point_to_voxel_forward",
    "mmcv._ext.dynamic_point_to_voxel_backward",
    "mmdet3d.PointPillarsScatter",
}
# off by default (tests/test_patcher_bevfusion_lss.py)
FACTORED_LSS_PATCHES = {
    f"bevfusion.factored_lss{layout}.{name}"
    for layout in ("", ".mit")
    for name in ("bev_pool", "LSSTransform", "DepthLSSTransform")
}
SPCONV_PATCHES = {
    "spconv.SubMConv3d",
    "spconv.SparseConv3d",
    "spconv.SparseInverseConv3d",
    "spconv.SubMConv2d",
    "spconv.SparseConv2d",
    "spconv.SparseMaxPool3d",
    "spconv.SparseSequential",
    "spconv.SparseConvTensor",
    "spconv.ToDense",
}
ALL = (
    {
        "mmcv.MultiScaleDeformableAttnFunction",
        "mmcv.multi_scale_deformable_attn_pytorch",
        "bevdet.bev_pool_v2",
        "bevdet.voxel_pooling_prepare_v2",
        "bevfusion.bev_pool",
        "bevfusion.bev_pool.projects",
    }
    | FACTORED_LSS_PATCHES
    | VOXEL_PATCHES
    | BOX3D_PATCHES
    | SPCONV_PATCHES
)
ON_BY_DEFAULT = ALL - {"mmcv.multi_scale_deformable_attn_pytorch"} - FACTORED_LSS_PATCHES

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


def _install_bevfusion_projects(monkeypatch):
    """mmdet3d 1.x's projects/BEVFusion layout: ops/bev_pool/bev_pool.py, re-exported by
    ops/bev_pool/__init__.py and ops/__init__.py; depth_lss.py does `from .ops import bev_pool`."""
    root = "projects.BEVFusion.bevfusion"
    mods = _modules(monkeypatch, f"{root}.ops.bev_pool.bev_pool", f"{root}.depth_lss")

    def bev_pool(feats, coords, B, D, H, W):
        """_install_bevfusion's stand-in body (another function object, as upstream's two
        layouts are two functions)."""
        B, D, H, W = (int(v) for v in (B, D, H, W))
        c = coords.long()
        cell = ((c[:, 3] * D + c[:, 2]) * H + c[:, 0]) * W + c[:, 1]
        out = torch.zeros(B * D * H * W, feats.shape[1], dtype=feats.dtype)
        out = out.index_add(0, cell, feats)
        return out.view(B, D, H, W, -1).permute(0, 4, 1, 2, 3).contiguous()

    for name in ("ops.bev_pool.bev_pool", "ops.bev_pool", "ops", "depth_lss"):
        mods[f"{root}.{name}"].bev_pool = bev_pool
    return types.SimpleNamespace(
        bev_pool=bev_pool,
        module=mods[f"{root}.ops.bev_pool.bev_pool"],
        package=mods[f"{root}.ops.bev_pool"],
        ops=mods[f"{root}.ops"],
        depth_lss=mods[f"{root}.depth_lss"],
    )


def _module(monkeypatch, name: str, *, fresh: bool = True) -> types.ModuleType:
    """A new stand-in module `name` linked to its parent; the parents are the modules already
    registered (an earlier installer's stand-ins), else new ones."""
    mod = None if fresh else sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mod)
    parent, _, leaf = name.rpartition(".")
    if parent:
        monkeypatch.setattr(_module(monkeypatch, parent, fresh=False), leaf, mod, raising=False)
    return mod


def _install_mmcv_voxel(monkeypatch):
    """mmcv 2.x's voxelize.py, scatter_points.py and the four `_ext` functions (Python
    functions with the pybind argument names), as the upstream modules wire them: the autograd
    Functions call `ext_module.<function>` at call time."""
    ext = _module(monkeypatch, "mmcv._ext")
    voxelize = _module(monkeypatch, "mmcv.ops.voxelize")
    scatter = _module(monkeypatch, "mmcv.ops.scatter_points")
    ops = _module(monkeypatch, "mmcv.ops", fresh=False)

    def hard_voxelize_forward(
        points, voxel_size, coors_range, voxels, coors, num_points_per_voxel, voxel_num,
        max_points, max_voxels, NDim=3, deterministic=True,
    ):  # fmt: skip
        v, c, k = oracle.mmcv_hard(
            points, voxel_size.tolist(), coors_range.tolist(), max_points, max_voxels
        )
        m = v.shape[0]
        voxels[:m], coors[:m], num_points_per_voxel[:m] = v, c, k
        voxel_num.fill_(m)

    def dynamic_voxelize_forward(points, voxel_size, coors_range, coors, NDim=3):
        coors.copy_(oracle.mmcv_dynamic(points, voxel_size.tolist(), coors_range.tolist()))

    def dynamic_point_to_voxel_forward(feats, coors, reduce_type):
        out, vc, members = oracle.mmcv_scatter(feats, coors, reduce_type)
        p2v = torch.full((feats.shape[0],), -1, dtype=torch.int32)
        for v, pts in enumerate(members):
            p2v[pts] = v
        counts = torch.tensor([len(m) for m in members], dtype=torch.int32)
        return [out.to(feats.dtype), vc, p2v, counts]

    def dynamic_point_to_voxel_backward(
        grad_feats, grad_reduced_feats, feats, reduced_feats, coors_idx, reduce_count, reduce_type
    ):
        members = [[] for _ in range(reduced_feats.shape[0])]
        for i, v in enumerate(coors_idx.tolist()):
            if v >= 0:
                members[v].append(i)
        g = oracle.mmcv_scatter_grad(
            feats, reduce_type, reduced_feats.double(), members, grad_reduced_feats
        )
        grad_feats.copy_(g)

    for fn in (hard_voxelize_forward, dynamic_voxelize_forward, dynamic_point_to_voxel_forward,
               dynamic_point_to_voxel_backward):  # fmt: skip
        setattr(ext, fn.__name__, fn)

    class _Voxelization(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx,
            points,
            voxel_size,
            coors_range,
            max_points=35,
            max_voxels=20000,
            deterministic=True,
        ):
            vs, cr = (
                torch.tensor(voxel_size, dtype=torch.float),
                torch.tensor(coors_range, dtype=torch.float),
            )
            if max_points == -1 or max_voxels == -1:
                coors = points.new_zeros(size=(points.size(0), 3), dtype=torch.int)
                sys.modules["mmcv._ext"].dynamic_voxelize_forward(points, vs, cr, coors, NDim=3)
                return coors
            voxels = points.new_zeros(size=(max_voxels, max_points, points.size(1)))
            coors = points.new_zeros(size=(max_voxels, 3), dtype=torch.int)
            num = points.new_zeros(size=(max_voxels,), dtype=torch.int)
            voxel_num = torch.zeros(size=(), dtype=torch.long)
            sys.modules["mmcv._ext"].hard_voxelize_forward(
                points, vs, cr, voxels, coors, num, voxel_num, max_points=max_points,
                max_voxels=max_voxels, NDim=3, deterministic=deterministic,
            )  # fmt: skip
            return voxels[:voxel_num], coors[:voxel_num], num[:voxel_num]

    class Voxelization(torch.nn.Module):
        def __init__(
            self,
            voxel_size,
            point_cloud_range,
            max_num_points,
            max_voxels=20000,
            deterministic=True,
        ):
            super().__init__()
            self.voxel_size, self.point_cloud_range = voxel_size, point_cloud_range
            self.max_num_points, self.deterministic = max_num_points, deterministic
            self.max_voxels = (
                max_voxels if isinstance(max_voxels, tuple) else (max_voxels, max_voxels)
            )

        def forward(self, input):
            mv = self.max_voxels[0] if self.training else self.max_voxels[1]
            return voxelize.voxelization(
                input,
                self.voxel_size,
                self.point_cloud_range,
                self.max_num_points,
                mv,
                self.deterministic,
            )

    class _DynamicScatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, feats, coors, reduce_type="max"):
            out, vc, p2v, counts = sys.modules["mmcv._ext"].dynamic_point_to_voxel_forward(
                feats, coors, reduce_type
            )
            ctx.reduce_type = reduce_type
            ctx.save_for_backward(feats, out, p2v, counts)
            ctx.mark_non_differentiable(vc)
            return out, vc

        @staticmethod
        def backward(ctx, grad_voxel_feats, grad_voxel_coors=None):
            feats, out, p2v, counts = ctx.saved_tensors
            grad = torch.zeros_like(feats)
            sys.modules["mmcv._ext"].dynamic_point_to_voxel_backward(
                grad, grad_voxel_feats.contiguous(), feats, out, p2v, counts, ctx.reduce_type
            )
            return grad, None, None

    class DynamicScatter(torch.nn.Module):
        def __init__(self, voxel_size, point_cloud_range, average_points):
            super().__init__()
            self.voxel_size, self.point_cloud_range = voxel_size, point_cloud_range
            self.average_points = average_points

        def forward_single(self, points, coors):
            reduce = "mean" if self.average_points else "max"
            return scatter.dynamic_scatter(points.contiguous(), coors.contiguous(), reduce)

        def forward(self, points, coors):
            if coors.size(-1) == 3:
                return self.forward_single(points, coors)
            voxels, voxel_coors = [], []
            for i in range(int(coors[-1, 0]) + 1):
                inds = torch.where(coors[:, 0] == i)
                voxel, voxel_coor = self.forward_single(points[inds], coors[inds][:, 1:])
                voxel_coors.append(torch.nn.functional.pad(voxel_coor, (1, 0), value=i))
                voxels.append(voxel)
            return torch.cat(voxels, dim=0), torch.cat(voxel_coors, dim=0)

    voxelize._Voxelization, voxelize.voxelization = _Voxelization, _Voxelization.apply
    voxelize.Voxelization = Voxelization
    scatter._DynamicScatter, scatter.dynamic_scatter = _DynamicScatter, _DynamicScatter.apply
    scatter.DynamicScatter = DynamicScatter
    for name, value in (("voxelization", voxelize.voxelization), ("Voxelization", Voxelization),
                        ("dynamic_scatter", scatter.dynamic_scatter), ("DynamicScatter", DynamicScatter)):  # fmt: skip
        monkeypatch.setattr(ops, name, value, raising=False)
    return types.SimpleNamespace(
        ext=ext,
        voxelize=voxelize,
        scatter=scatter,
        ops=ops,
        voxelization=voxelize.voxelization,
        Voxelization=Voxelization,
        dynamic_scatter=scatter.dynamic_scatter,
        DynamicScatter=DynamicScatter,
        ext_functions={n: getattr(ext, n) for n in dir(ext) if not n.startswith("_")},
    )


def _install_mmdet3d_pillars(monkeypatch):
    """mmdet3d's PointPillarsScatter (forward / forward_single / forward_batch as upstream),
    with its re-export from mmdet3d.models.middle_encoders."""
    package = _module(monkeypatch, "mmdet3d.models.middle_encoders")
    mod = _module(monkeypatch, "mmdet3d.models.middle_encoders.pillar_scatter")

    class PointPillarsScatter(torch.nn.Module):
        def __init__(self, in_channels, output_shape):
            super().__init__()
            self.output_shape, self.ny, self.nx = output_shape, output_shape[0], output_shape[1]
            self.in_channels = in_channels
            self.fp16_enabled = False

        def forward(self, voxel_features, coors, batch_size=None):
            if batch_size is not None:
                return self.forward_batch(voxel_features, coors, batch_size)
            return self.forward_single(voxel_features, coors)

        def forward_single(self, voxel_features, coors):
            canvas = torch.zeros(self.in_channels, self.nx * self.ny, dtype=voxel_features.dtype)
            canvas[:, (coors[:, 2] * self.nx + coors[:, 3]).long()] = voxel_features.t()
            return canvas.view(1, self.in_channels, self.ny, self.nx)

        def forward_batch(self, voxel_features, coors, batch_size):
            out = []
            for b in range(batch_size):
                canvas = torch.zeros(
                    self.in_channels, self.nx * self.ny, dtype=voxel_features.dtype
                )
                mask = coors[:, 0] == b
                this = coors[mask, :]
                canvas[:, (this[:, 2] * self.nx + this[:, 3]).long()] = voxel_features[mask, :].t()
                out.append(canvas)
            return torch.stack(out, 0).view(batch_size, self.in_channels, self.ny, self.nx)

    mod.PointPillarsScatter = PointPillarsScatter
    monkeypatch.setattr(package, "PointPillarsScatter", PointPillarsScatter, raising=False)
    return types.SimpleNamespace(
        module=mod, PointPillarsScatter=PointPillarsScatter, forward=PointPillarsScatter.forward
    )


@pytest.fixture
def upstream(monkeypatch):
    return types.SimpleNamespace(
        mmcv=_install_mmcv(monkeypatch),
        bevdet=_install_bevdet(monkeypatch),
        bevfusion=_install_bevfusion(monkeypatch),
        bevfusion_projects=_install_bevfusion_projects(monkeypatch),
        voxel=_install_mmcv_voxel(monkeypatch),
        pillars=_install_mmdet3d_pillars(monkeypatch),
        box3d=install_box3d_upstream(monkeypatch),  # tests/test_patcher_box3d.py
        spconv=install_spconv_upstream(monkeypatch),  # tests/test_patcher_sparse.py
    )


@pytest.fixture
def absent(monkeypatch):
    """No mmcv / mmdet3d / OpenPCDet / spconv importable, even if they are installed here."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("mmcv", "mmdet3d", "pcdet", "projects", "spconv"):
            monkeypatch.delitem(sys.modules, name)
    for top in ("mmcv", "mmdet3d", "pcdet", "projects", "spconv"):
        monkeypatch.setitem(sys.modules, top, None)


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


# --------------------------------------------------------------------------- voxel patches


def _cloud(config="tiny-voxels"):
    vs, pcr, P, V = lidar.layer_args(config)
    return lidar.VOXEL_CONFIGS[config].points(), vs, pcr, P, V


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w)


def test_voxel_patches_targets_and_restore(upstream):
    v, pl = upstream.voxel, upstream.pillars
    patcher = default_patcher()
    results = _status(patcher.apply())
    assert set(results["mmcv.voxelization"].targets) == {
        "mmcv.ops.voxelize.voxelization",
        "mmcv.ops.voxelization",
    }
    assert set(results["mmcv.DynamicScatter"].targets) == {
        "mmcv.ops.scatter_points.DynamicScatter",
        "mmcv.ops.DynamicScatter",
    }
    assert results["mmcv._ext.hard_voxelize_forward"].targets == ["mmcv._ext.hard_voxelize_forward"]
    assert v.voxelize.voxelization is not v.voxelization
    assert v.ops.Voxelization is v.voxelize.Voxelization is not v.Voxelization
    assert issubclass(v.voxelize.Voxelization, v.Voxelization)  # a subclass: isinstance holds
    assert pl.PointPillarsScatter.forward is not pl.forward
    patcher.restore()
    assert v.voxelize.voxelization is v.voxelization and v.ops.Voxelization is v.Voxelization
    assert (
        v.scatter.DynamicScatter is v.DynamicScatter and v.ops.dynamic_scatter is v.dynamic_scatter
    )
    assert all(getattr(v.ext, n) is f for n, f in v.ext_functions.items())
    assert pl.PointPillarsScatter.forward is pl.forward


@pytest.mark.parametrize("P,V", [(5, 1500), (3, 200), (-1, 20000)])
def test_voxelization_patch_matches_mmcv(upstream, P, V):
    pts, vs, pcr, _, _ = _cloud()
    want = upstream.voxel.voxelization(pts, vs, pcr, P, V)
    with default_patcher():
        got = sys.modules["mmcv.ops"].voxelization(pts, vs, pcr, P, V)
        got_module = sys.modules["mmcv.ops.voxelize"].Voxelization(vs, pcr, P, V).eval()(pts)
    want = want if isinstance(want, tuple) else (want,)
    for out in (got, got_module):
        _same(out if isinstance(out, tuple) else (out,), want)


def test_voxelization_module_patch_keeps_mmcvs_attributes(upstream):
    pts, vs, pcr, P, _ = _cloud()
    with default_patcher():
        cls = sys.modules["mmcv.ops"].Voxelization
        layer = cls(vs, pcr, P, (300, 900), deterministic=False)
        assert isinstance(layer, upstream.voxel.Voxelization)
        assert layer.max_voxels == (300, 900) and layer.max_num_points == P
        assert layer.train()(pts)[0].shape[0] == 300
        _same(layer.eval()(pts), upstream.voxel.voxelization(pts, vs, pcr, P, 900))


@pytest.mark.parametrize("reduce", ["max", "mean", "sum"])
def test_dynamic_scatter_patch_matches_mmcv(upstream, reduce):
    pts, vs, pcr, _, _ = _cloud()
    coors = oracle.mmcv_dynamic(pts, vs, pcr)
    f_up = pts.clone().requires_grad_(True)
    want, want_c = upstream.voxel.dynamic_scatter(f_up, coors, reduce)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    want.backward(g)
    with default_patcher():
        f = pts.clone().requires_grad_(True)
        got, got_c = sys.modules["mmcv.ops"].dynamic_scatter(f, coors, reduce)
        got.backward(g)
    assert torch.equal(got_c, want_c)
    assert_close(got, want, **F32)
    assert_close(f.grad, f_up.grad, **F32, name="grad_feats")


def test_dynamic_scatter_module_patch_batched(upstream):
    clouds = lidar.batch("tiny-3sweeps", 3)
    vs, pcr, _, _ = lidar.layer_args("tiny-voxels")
    coors = torch.cat(
        [
            torch.nn.functional.pad(oracle.mmcv_dynamic(c, vs, pcr), (1, 0), value=i)
            for i, c in enumerate(clouds)
        ]
    )
    pts = torch.cat(clouds)
    want = upstream.voxel.DynamicScatter(vs, pcr, True)(pts, coors)
    with default_patcher():
        layer = sys.modules["mmcv.ops"].DynamicScatter(vs, pcr, True)
        got = layer(pts, coors)
        single = layer(pts[: clouds[0].shape[0]], coors[: clouds[0].shape[0], 1:])
    assert torch.equal(got[1], want[1])
    assert_close(got[0], want[0], **F32)
    assert single[1].shape[1] == 3


def test_ext_patches_serve_mmdet3d_1x_direct_calls(upstream):
    """mmdet3d 1.x's data_preprocessors/voxelize.py calls mmcv._ext with pre-allocated buffers;
    the stand-in Functions do the same, so with the function patches disabled the _ext patches
    alone must give mmcv's results, forward and backward."""
    v = upstream.voxel
    pts, vs, pcr, P, V = _cloud()
    coors = oracle.mmcv_dynamic(pts, vs, pcr)
    want_hard = v.voxelization(pts, vs, pcr, P, V)
    want_dyn = v.voxelization(pts, vs, pcr, -1, V)
    f_up = pts.clone().requires_grad_(True)
    want_sc, _ = v.dynamic_scatter(f_up, coors, "max")
    want_sc.backward(torch.ones_like(want_sc))
    patcher = default_patcher()
    for name in (
        "mmcv.voxelization",
        "mmcv.Voxelization",
        "mmcv.dynamic_scatter",
        "mmcv.DynamicScatter",
    ):
        patcher.disable(name)
    with patcher:
        assert v.ext.hard_voxelize_forward is not v.ext_functions["hard_voxelize_forward"]
        _same(v.voxelize._Voxelization.apply(pts, vs, pcr, P, V), want_hard)
        assert torch.equal(v.voxelize._Voxelization.apply(pts, vs, pcr, -1, V), want_dyn)
        f = pts.clone().requires_grad_(True)
        got_sc, _ = v.scatter._DynamicScatter.apply(f, coors, "max")
        got_sc.backward(torch.ones_like(got_sc))
    assert torch.equal(got_sc, want_sc) and torch.equal(f.grad, f_up.grad)


def test_ext_prechecks_read_pybind_docstrings_and_both_mmcv_signatures(upstream, monkeypatch):
    """Compiled functions have no inspectable signature: the names come from pybind11's
    docstring. Early mmcv 1.x's argument order is supported; anything else is skipped."""
    v = upstream.voxel
    pts, vs, pcr, P, V = _cloud()
    want = v.voxelization(pts, vs, pcr, P, V)  # before the stand-in _ext is replaced

    class Compiled:
        __signature__ = "not inspectable"  # inspect.signature raises, as for a pybind function

        def __init__(self, doc, body):
            self.__doc__, self.__name__, self.body = doc, doc.split("(")[0], body

        def __call__(self, *args, **kwargs):
            return self.body(*args, **kwargs)

    calls = []

    def old_hard(
        points, voxels, coors, num, voxel_size, coors_range, max_points, max_voxels, NDim=3
    ):
        calls.append("old")
        return 0

    doc_old = (
        "hard_voxelize_forward(points: torch.Tensor, voxels: torch.Tensor, coors: torch.Tensor, "
        "num_points_per_voxel: torch.Tensor, voxel_size: List[float], coors_range: List[float], "
        "max_points: int, max_voxels: int, NDim: int = 3) -> int\n\nhard_voxelize_forward\n"
    )
    doc_bad = "dynamic_voxelize_forward(points: torch.Tensor, coors: torch.Tensor) -> None\n"
    monkeypatch.setattr(v.ext, "hard_voxelize_forward", Compiled(doc_old, old_hard))
    monkeypatch.setattr(v.ext, "dynamic_voxelize_forward", Compiled(doc_bad, lambda *a: None))
    with default_patcher() as patcher:
        results = _status(patcher.results())
        assert results["mmcv._ext.hard_voxelize_forward"].status == "applied"
        bad = results["mmcv._ext.dynamic_voxelize_forward"]
        assert bad.status == "skipped" and "(points, coors) differs from" in bad.reason
        voxels = pts.new_zeros((V, P, pts.shape[1]))
        coors = torch.zeros((V, 3), dtype=torch.int32)
        num = torch.zeros((V,), dtype=torch.int32)
        m = v.ext.hard_voxelize_forward(pts, voxels, coors, num, vs, pcr, P, V, 3)
    assert m == want[0].shape[0] and calls == []
    _same((voxels[:m], coors[:m], num[:m]), want)


def test_voxel_prechecks_skip_other_signatures(upstream, monkeypatch):
    v = upstream.voxel

    class OldFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, points, voxel_size, coors_range):
            raise AssertionError("not called")

    monkeypatch.setattr(v.voxelize, "voxelization", OldFunction.apply)
    with default_patcher() as patcher:
        r = _status(patcher.results())["mmcv.voxelization"]
        assert (
            r.status == "skipped" and "(ctx, points, voxel_size, coors_range) differs" in r.reason
        )
        assert sys.modules["mmcv.ops.voxelize"].voxelization == OldFunction.apply


@pytest.mark.parametrize("batch", [None, 2])
def test_pillar_scatter_patch_matches_mmdet3d(upstream, batch):
    vs, pcr, P, V = lidar.layer_args("tiny-pillars")
    clouds = lidar.batch("tiny", 2)
    import mu_space

    _, coors, _ = mu_space.voxelization_batch(clouds, vs, pcr, P, V)
    if batch is None:
        coors = coors[coors[:, 0] == 0]
    feats = torch.randn(coors.shape[0], 8, generator=torch.Generator().manual_seed(2))
    gx, gy, _ = lidar.VOXEL_CONFIGS["tiny-pillars"].grid_size
    layer = upstream.pillars.PointPillarsScatter(8, [gy, gx])
    f_up = feats.clone().requires_grad_(True)
    want = layer(f_up, coors, batch)
    want.backward(torch.ones_like(want))
    with default_patcher():
        f = feats.clone().requires_grad_(True)
        got = layer(f, coors, batch)
        got.backward(torch.ones_like(got))
    assert torch.equal(got, want) and torch.equal(f.grad, f_up.grad)
