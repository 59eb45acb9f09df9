"""The default patches: upstream call sites of mmcv, mmdet3d, BEVDet, BEVFusion, OpenPCDet and
spconv that muSPACE replaces.

    from mu_space.patcher import default_patcher
    default_patcher().apply()

Each replacement keeps the upstream signature and return layout and calls only the public
`mu_space` API. Each patch has a precheck that compares the upstream parameter names with the
ones the replacement was written against, so another upstream version is a clean skip with the
reason, never a wrong call. What each patch replaces, and its limits: docs/patcher.md.

Patch names (for `Patcher.disable` / `enable`):

    mmcv.MultiScaleDeformableAttnFunction     on   mmcv.ops.multi_scale_deform_attn
    mmcv.multi_scale_deformable_attn_pytorch  OFF  mmcv.ops.multi_scale_deform_attn (CPU path)
    bevdet.bev_pool_v2                        on   mmdet3d.ops.bev_pool_v2.bev_pool
    bevdet.voxel_pooling_prepare_v2           on   mmdet3d.models.necks.view_transformer
    bevfusion.bev_pool                        on   mmdet3d.ops.bev_pool.bev_pool (+ mmdet3d.ops)
    bevfusion.bev_pool.projects               on   projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool
                                                   (mmdet3d 1.x projects/BEVFusion; + its re-exports)
    bevfusion.factored_lss.*                  OFF  BEVFusion LSS / DepthLSS vtransforms: pool depth
                                                   and context without their product (6 patches:
                                                   mmdet3d 1.x projects/BEVFusion, MIT BEVFusion)
    mmcv.voxelization                         on   mmcv.ops.voxelize.voxelization (+ mmcv.ops)
    mmcv.Voxelization                         on   mmcv.ops.voxelize.Voxelization (+ mmcv.ops)
    mmcv.dynamic_scatter                      on   mmcv.ops.scatter_points.dynamic_scatter (+ mmcv.ops)
    mmcv.DynamicScatter                       on   mmcv.ops.scatter_points.DynamicScatter (+ mmcv.ops)
    mmcv._ext.hard_voxelize_forward           on   mmcv._ext (what mmdet3d 1.x's voxelize.py calls)
    mmcv._ext.dynamic_voxelize_forward        on   mmcv._ext
    mmcv._ext.dynamic_point_to_voxel_forward  on   mmcv._ext
    mmcv._ext.dynamic_point_to_voxel_backward on   mmcv._ext
    mmdet3d.PointPillarsScatter               on   mmdet3d.models.middle_encoders.pillar_scatter
    mmcv.points_in_boxes_part / _all / _cpu   on   mmcv.ops.points_in_boxes (+ mmcv.ops)
    mmcv.boxes_overlap_bev / boxes_iou_bev    on   mmcv.ops.iou3d (+ mmcv.ops)
    mmcv.nms_bev / nms3d / nms3d_normal       on   mmcv.ops.iou3d (+ mmcv.ops)
    mmcv._ext.iou3d_boxes_overlap_bev_forward on   mmcv._ext (mmcv's boxes_iou3d)
    mmcv.box_iou_rotated                      on   mmcv.ops.box_iou_rotated (+ mmcv.ops)
    mmcv.RoIAwarePool3d / RoIPointPool3d      on   mmcv.ops.roiaware_pool3d / roipoint_pool3d
    mmdet3d.nms_bev / circle_nms              on   mmdet3d.models.layers.box3d_nms (1.x)
    mmdet3d.core.nms_bev / circle_nms         on   mmdet3d.core.post_processing.box3d_nms (0.x)
    pcdet.boxes_iou_bev / boxes_bev_iou_cpu   on   pcdet.ops.iou3d_nms.iou3d_nms_utils
    pcdet.nms_gpu / nms_normal_gpu            on   pcdet.ops.iou3d_nms.iou3d_nms_utils
    pcdet.points_in_boxes_gpu / _cpu          on   pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils
    spconv.SubMConv3d / SparseConv3d          on   spconv.pytorch.conv (+ spconv.pytorch)
    spconv.SparseInverseConv3d                on   spconv.pytorch.conv (+ spconv.pytorch)
    spconv.SubMConv2d / SparseConv2d          on   spconv.pytorch.conv (+ spconv.pytorch)
    spconv.SparseMaxPool3d                    on   spconv.pytorch.pool (+ spconv.pytorch)
    spconv.SparseSequential                   on   spconv.pytorch.modules (+ spconv.pytorch)
    spconv.SparseConvTensor                   on   spconv.pytorch.core (+ spconv.pytorch)
    spconv.ToDense                            on   spconv.pytorch (+ spconv.pytorch.modules)

Declined call sites (no patch) and the reasons: `DECLINED` below.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Callable

import torch

import mu_space
from mu_space.patcher.core import Patch, Patcher
from mu_space.runtime.kernel_dispatch import BACKENDS

MSDA_MODULE = "mmcv.ops.multi_scale_deform_attn"
BEV_POOL_V2_MODULE = "mmdet3d.ops.bev_pool_v2.bev_pool"
VIEW_TRANSFORMER = "mmdet3d.models.necks.view_transformer.LSSViewTransformer"
BEV_POOL_MODULE = "mmdet3d.ops.bev_pool.bev_pool"
BEV_POOL_PROJECTS_MODULE = "projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool"  # mmdet3d 1.x

# Upstream parameter names each replacement was written against (checked by the prechecks).
MSDA_FUNCTION_PARAMS = (
    "ctx",
    "value",
    "value_spatial_shapes",
    "value_level_start_index",
    "sampling_locations",
    "attention_weights",
    "im2col_step",
)
MSDA_PYTORCH_PARAMS = ("value", "value_spatial_shapes", "sampling_locations", "attention_weights")
BEV_POOL_V2_PARAMS = (
    "depth",
    "feat",
    "ranks_depth",
    "ranks_feat",
    "ranks_bev",
    "bev_feat_shape",
    "interval_starts",
    "interval_lengths",
)
PREPARE_V2_PARAMS = ("self", "coor")
BEV_POOL_PARAMS = ("feats", "coords", "B", "D", "H", "W")
# The LSS vtransforms: mmdet3d 1.x's projects/BEVFusion (one module) and MIT HAN Lab's BEVFusion
# (mmdet3d/models/vtransforms/{base,lss,depth_lss}.py): (prefix, {class: module}).
LSS_VTRANSFORMS = (
    (
        "bevfusion.factored_lss",
        {
            "BaseTransform": "projects.BEVFusion.bevfusion.depth_lss",
            "LSSTransform": "projects.BEVFusion.bevfusion.depth_lss",
            "DepthLSSTransform": "projects.BEVFusion.bevfusion.depth_lss",
        },
    ),
    (
        "bevfusion.factored_lss.mit",
        {
            "BaseTransform": "mmdet3d.models.vtransforms.base",
            "LSSTransform": "mmdet3d.models.vtransforms.lss",
            "DepthLSSTransform": "mmdet3d.models.vtransforms.depth_lss",
        },
    ),
)
LSS_POOL_PARAMS = ("self", "geom_feats", "x")
LSS_CAM_FEATS_PARAMS = ("self", "x")
DEPTH_LSS_CAM_FEATS_PARAMS = ("self", "x", "d")
VOXELIZE_MODULE = "mmcv.ops.voxelize"
SCATTER_MODULE = "mmcv.ops.scatter_points"
EXT_MODULE = "mmcv._ext"
PILLAR_SCATTER = "mmdet3d.models.middle_encoders.pillar_scatter.PointPillarsScatter"
# mmcv 2.x (and late 1.x) with `deterministic`; early mmcv 1.x without it
VOXELIZATION_FORWARD_PARAMS = (
    ("ctx", "points", "voxel_size", "coors_range", "max_points", "max_voxels", "deterministic"),
    ("ctx", "points", "voxel_size", "coors_range", "max_points", "max_voxels"),
)
VOXELIZATION_INIT_PARAMS = (
    ("self", "voxel_size", "point_cloud_range", "max_num_points", "max_voxels", "deterministic"),
    ("self", "voxel_size", "point_cloud_range", "max_num_points", "max_voxels"),
)
DYNAMIC_SCATTER_FORWARD_PARAMS = (("ctx", "feats", "coors", "reduce_type"),)
DYNAMIC_SCATTER_INIT_PARAMS = (("self", "voxel_size", "point_cloud_range", "average_points"),)
# mmcv._ext (pybind11: names from the docstring signature). 2.x / late 1.x, then early 1.x.
EXT_HARD_PARAMS = (
    (
        "points", "voxel_size", "coors_range", "voxels", "coors", "num_points_per_voxel",
        "voxel_num", "max_points", "max_voxels", "NDim", "deterministic",
    ),
    (
        "points", "voxels", "coors", "num_points_per_voxel", "voxel_size", "coors_range",
        "max_points", "max_voxels", "NDim",
    ),
)  # fmt: skip
EXT_DYNAMIC_PARAMS = (
    ("points", "voxel_size", "coors_range", "coors", "NDim"),
    ("points", "coors", "voxel_size", "coors_range", "NDim"),
)
EXT_SCATTER_FORWARD_PARAMS = (("feats", "coors", "reduce_type"),)
EXT_SCATTER_BACKWARD_PARAMS = (
    (
        "grad_feats", "grad_reduced_feats", "feats", "reduced_feats", "coors_idx",
        "reduce_count", "reduce_type",
    ),
)  # fmt: skip
PILLAR_FORWARD_PARAMS = (("self", "voxel_features", "coors", "batch_size"),)

# box3d (issue 12): mmcv 1.x (>= 1.6 for nms3d / boxes_overlap_bev) and 2.x use these paths
POINTS_IN_BOXES_MODULE = "mmcv.ops.points_in_boxes"
IOU3D_MODULE = "mmcv.ops.iou3d"
BOX_IOU_ROTATED_MODULE = "mmcv.ops.box_iou_rotated"
ROIAWARE_MODULE = "mmcv.ops.roiaware_pool3d"
ROIPOINT_MODULE = "mmcv.ops.roipoint_pool3d"
MMDET3D_NMS_MODULE = "mmdet3d.models.layers.box3d_nms"  # mmdet3d 1.x
MMDET3D_CORE_NMS_MODULE = "mmdet3d.core.post_processing.box3d_nms"  # mmdet3d 0.x / 1.0.0rc
PCDET_IOU3D_MODULE = "pcdet.ops.iou3d_nms.iou3d_nms_utils"
PCDET_ROIAWARE_MODULE = "pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils"
POINTS_BOXES_PARAMS = (("points", "boxes"),)
BOX_PAIR_PARAMS = (("boxes_a", "boxes_b"),)
NMS_BEV_PARAMS = (("boxes", "scores", "thresh", "pre_max_size", "post_max_size"),)
NMS3D_PARAMS = (("boxes", "scores", "iou_threshold"),)
# mmcv 2.x / late 1.x with `clockwise`; early mmcv 1.x without it
BOX_IOU_ROTATED_PARAMS = (
    ("bboxes1", "bboxes2", "mode", "aligned", "clockwise"),
    ("bboxes1", "bboxes2", "mode", "aligned"),
)
EXT_OVERLAP_BEV_PARAMS = (("boxes_a", "boxes_b", "ans_iou"),)
ROIAWARE_INIT_PARAMS = (("self", "out_size", "max_pts_per_voxel", "mode"),)
ROIPOINT_INIT_PARAMS = (("self", "num_sampled_points"),)
CIRCLE_NMS_PARAMS = (("dets", "thresh", "post_max_size"),)
PCDET_NMS_PARAMS = (("boxes", "scores", "thresh", "pre_maxsize", "kwargs"),)
PCDET_NMS_NORMAL_PARAMS = (("boxes", "scores", "thresh", "kwargs"),)

_MARK = "__mu_space_patch__"  # set on every replacement: the patch name
_ORIGINAL = "__mu_space_original__"  # the upstream object it replaces


# --------------------------------------------------------------------------- prechecks


def _parameter_names(fn: Any) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _signature_check(
    expected: tuple[str, ...], *, attribute: str | None = None
) -> Callable[[Any], str | None]:
    """A precheck: the upstream callable (or its `attribute`, e.g. an autograd.Function's
    `forward`) must have exactly the parameter names `expected`, and must not already be a
    muSPACE replacement (a second patcher applied on top of a first one)."""

    def check(original: Any) -> str | None:
        marked = getattr(original, _MARK, None)
        if marked is not None:
            return f"already replaced by muSPACE (patch {marked!r} of another Patcher)"
        fn = original
        if attribute is not None:
            fn = getattr(original, attribute, None)
            if fn is None:
                return f"{getattr(original, '__name__', original)!r} has no {attribute!r}"
        names = _parameter_names(fn)
        if names is None:
            return "upstream signature cannot be inspected"
        if names != expected:
            return (
                f"upstream signature ({', '.join(names)}) differs from the supported "
                f"({', '.join(expected)})"
            )
        return None

    return check


def _mark(replacement: Any, name: str, original: Any) -> Any:
    setattr(replacement, _MARK, name)
    setattr(replacement, _ORIGINAL, original)
    return replacement


def _doc_parameter_names(fn: Any) -> tuple[str, ...] | None:
    """Parameter names from a pybind11 docstring signature, `name(a: T, b: T = 3) -> R`
    (compiled extensions such as mmcv._ext have no inspectable signature)."""
    doc = getattr(fn, "__doc__", None)
    name = getattr(fn, "__name__", "")
    if not isinstance(doc, str):
        return None
    line = doc.strip().splitlines()[0] if doc.strip() else ""
    if not line.startswith(f"{name}(") or ")" not in line:
        return None
    inner = line[len(name) + 1 : line.rindex(")")]
    names, depth, part = [], 0, ""
    for ch in inner + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            arg = part.strip().split(":")[0].split("=")[0].strip()
            if arg:
                names.append(arg)
            part = ""
        else:
            part += ch
    return tuple(names) if all(n.isidentifier() for n in names) else None


def _names_of(fn: Any) -> tuple[str, ...] | None:
    names = _parameter_names(fn)
    if names is None or names in (("args", "kwargs"), ("self", "args", "kwargs")):
        return _doc_parameter_names(fn)
    return names


def _one_of(
    accepted: tuple[tuple[str, ...], ...], *, get: Callable[[Any], Any] | None = None
) -> Callable[[Any], str | None]:
    """A precheck: the parameter names of the upstream callable (or of `get(original)`, e.g.
    an autograd.Function's forward behind its `apply`) must be one of `accepted`; never a
    muSPACE replacement already. Compiled functions are read from their pybind11 docstring."""

    def check(original: Any) -> str | None:
        marked = getattr(original, _MARK, None)
        if marked is not None:
            return f"already replaced by muSPACE (patch {marked!r} of another Patcher)"
        fn = original if get is None else get(original)
        if fn is None:
            return (
                f"{getattr(original, '__name__', original)!r} is not the expected upstream object"
            )
        names = _names_of(fn)
        if names is None:
            return "upstream signature cannot be inspected"
        if names not in accepted:
            return (
                f"upstream signature ({', '.join(names)}) differs from the supported "
                + " or ".join(f"({', '.join(a)})" for a in accepted)
            )
        return None

    return check


def _function_forward(original: Any) -> Any:
    """The forward of the autograd.Function whose `apply` is `original` (mmcv's
    `voxelization = _Voxelization.apply`)."""
    owner = getattr(original, "__self__", None)
    return getattr(owner, "forward", None) if isinstance(owner, type) else None


def _class_init(original: Any) -> Any:
    return original.__init__ if isinstance(original, type) else None


# --------------------------------------------------------------------------- mmcv: MSDA


def _msda_function(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        class MultiScaleDeformableAttnFunction:
            """muSPACE replacement of mmcv's `MultiScaleDeformableAttnFunction`: `apply(value,
            value_spatial_shapes, value_level_start_index, sampling_locations,
            attention_weights, im2col_step)` -> Tensor[bs, num_queries, num_heads * head_dim]
            in value's dtype, differentiable w.r.t. value, sampling_locations and
            attention_weights. As upstream, sampling_locations and attention_weights are cast to
            value's dtype first (mixed precision); im2col_step is accepted and ignored."""

            @staticmethod
            def apply(
                value,
                value_spatial_shapes,
                value_level_start_index,
                sampling_locations,
                attention_weights,
                im2col_step=64,
            ):
                return mu_space.multi_scale_deformable_attn(
                    value,
                    value_spatial_shapes,
                    value_level_start_index,
                    sampling_locations.type_as(value),
                    attention_weights.type_as(value),
                    im2col_step,
                    backend=backend,
                )

        MultiScaleDeformableAttnFunction.__module__ = __name__
        return _mark(
            MultiScaleDeformableAttnFunction, "mmcv.MultiScaleDeformableAttnFunction", original
        )

    return make


class _LevelStarts:
    """value_level_start_index for mmcv's pytorch path (which takes no start index), computed
    once per spatial-shapes tensor object and in-place version. A fresh start index per call
    would cost a cumsum each time and, for GPU metadata, the op's validation (one host
    synchronisation per new tensor object) on every call."""

    MAX_ENTRIES = 16

    def __init__(self) -> None:
        self._cache: dict[int, tuple] = {}  # id(shapes) -> (weakref, version, starts)

    def __call__(self, shapes: torch.Tensor) -> torch.Tensor:
        try:
            version = shapes._version
        except RuntimeError:  # inference tensors have no version counter
            version = None
        hit = self._cache.get(id(shapes))
        if hit is not None and hit[0]() is shapes and hit[1] == version:
            return hit[2]
        sizes = shapes[:, 0] * shapes[:, 1]
        starts = sizes.cumsum(0) - sizes
        if len(self._cache) >= self.MAX_ENTRIES:
            self._cache.clear()
        self._cache[id(shapes)] = (weakref.ref(shapes), version, starts)
        return starts


def _msda_pytorch(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        level_starts = _LevelStarts()

        def multi_scale_deformable_attn_pytorch(
            value, value_spatial_shapes, sampling_locations, attention_weights
        ):
            """muSPACE replacement of mmcv's `multi_scale_deformable_attn_pytorch` (same
            arguments, Tensor[bs, num_queries, num_heads * head_dim] in value's dtype)."""
            shapes = value_spatial_shapes
            if not isinstance(shapes, torch.Tensor):  # upstream also takes a list of (h, w)
                shapes = torch.as_tensor([[int(h), int(w)] for h, w in shapes], dtype=torch.int64)
            return mu_space.multi_scale_deformable_attn(
                value,
                shapes,
                level_starts(shapes),
                sampling_locations.type_as(value),
                attention_weights.type_as(value),
                backend=backend,
            )

        return _mark(
            multi_scale_deformable_attn_pytorch,
            "mmcv.multi_scale_deformable_attn_pytorch",
            original,
        )

    return make


# --------------------------------------------------------------------------- BEVDet


def _bev_pool_v2(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def bev_pool_v2(
            depth,
            feat,
            ranks_depth,
            ranks_feat,
            ranks_bev,
            bev_feat_shape,
            interval_starts,
            interval_lengths,
        ):
            """muSPACE replacement of BEVDet's `bev_pool_v2`: Tensor[B, C, Z, Y, X], float32
            like upstream (depth and feat are computed in float32, ranks taken as int32)."""
            return mu_space.bev_pool_v2(
                depth.float(),
                feat.float(),
                ranks_depth.int(),
                ranks_feat.int(),
                ranks_bev.int(),
                bev_feat_shape,
                interval_starts.int(),
                interval_lengths.int(),
                backend=backend,
            )

        return _mark(bev_pool_v2, "bevdet.bev_pool_v2", original)

    return make


def _integral_grid(module: Any) -> tuple | None:
    """(grid_lower_bound, grid_interval, grid_size) of a BEVDet view transformer, or None when
    the instance has not got them or its grid_size is not integral (then upstream runs)."""
    grid = tuple(
        getattr(module, name, None) for name in ("grid_lower_bound", "grid_interval", "grid_size")
    )
    if any(v is None for v in grid):
        return None
    size = grid[2]
    values = size.detach().reshape(-1).tolist() if isinstance(size, torch.Tensor) else list(size)
    if len(values) != 3 or not all(
        math.isfinite(float(v)) and float(v).is_integer() for v in values
    ):
        return None
    return grid


def _voxel_pooling_prepare_v2(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def voxel_pooling_prepare_v2(self, coor):
            """muSPACE replacement of BEVDet's `LSSViewTransformer.voxel_pooling_prepare_v2`:
            (ranks_bev, ranks_depth, ranks_feat, interval_starts, interval_lengths), int32, in
            upstream's order; five Nones when no point falls in the grid (as upstream)."""
            grid = _integral_grid(self)
            if grid is None:
                return original(self, coor)
            ranks = mu_space.bev_pool_prepare(coor, *grid, backend=backend)
            if ranks.ranks_bev.numel() == 0:
                return None, None, None, None, None
            return tuple(ranks)

        return _mark(voxel_pooling_prepare_v2, "bevdet.voxel_pooling_prepare_v2", original)

    return make


# --------------------------------------------------------------------------- BEVFusion


def _dim(value: Any) -> Any:
    """BEVFusion passes `self.nx[i]` (0-d tensors; float ones in BEVDet's older view transformer):
    integral floats become ints, anything else goes through unchanged (mu_space checks it)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        f = float(value.item())
        if f.is_integer():
            return int(f)
    return value


def _bev_pool(backend: str, name: str = "bevfusion.bev_pool") -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def bev_pool(feats, coords, B, D, H, W):
            """muSPACE replacement of BEVFusion's `bev_pool`: Tensor[B, C, D, H, W] in feats'
            dtype; coords (x, y, z, batch) index (H, W, D, B)."""
            return mu_space.bev_pool(
                feats, coords, _dim(B), _dim(D), _dim(H), _dim(W), backend=backend
            )

        return _mark(bev_pool, name, original)

    return make


class FactoredFrustum:
    """What a factored LSS `get_cam_feats` returns instead of `depth (outer) context`
    (`bevfusion.factored_lss.*`): depth [B, N, D, H, W] and context channels-last [B, N, H, W, C].
    Not a tuple (MIT BEVFusion's forward unpacks a tuple result as (features, depth))."""

    def __init__(self, depth: torch.Tensor, context: torch.Tensor):
        self.depth, self.context = depth, context


_FACTORED_POOL = "__mu_space_factored_pool__"  # set on the factored bev_pool replacement
# bev_pool_v2 writes [B, C, Z, Y, X]; with x and y swapped it writes BEVFusion's X-major layout
_XY_SWAP = [1, 0, 2]


def factored_lss_pool(depth, context, geom, lower, interval, grid_size, *, backend="auto"):
    """BEVFusion's LSS pooling from its factors: what `BaseTransform.bev_pool` computes from the
    product `depth (outer) context`, without forming it.

        depth [B, N, D, H, W], context [B, N, H, W, C] (channels last), geom [B, N, D, H, W, 3]
        cells ((geom - lower) / interval).long(), points outside grid_size (X, Y, Z) dropped
        -> [B, C * Z, X, Y] (BEVFusion's x-major layout, z folded into channels)

    bev_pool_prepare + bev_pool_v2 with x and y swapped (bev_pool_v2 writes y-major)."""
    b, c = depth.shape[0], context.shape[-1]
    nx, ny, nz = (int(v) for v in grid_size)
    ranks = mu_space.bev_pool_prepare(
        geom[..., _XY_SWAP].contiguous(),
        lower[_XY_SWAP],
        interval[_XY_SWAP],
        (ny, nx, nz),
        backend=backend,
    )
    bev = mu_space.bev_pool_v2(
        depth, context, *ranks.bev_pool_v2_args((b, nz, nx, ny, c)), backend=backend
    )  # [B, C, Z, X, Y]
    return torch.cat(bev.unbind(dim=2), 1)


def _lss_pool(backend: str) -> Callable[[Any], Any]:
    """BaseTransform.bev_pool(self, geom_feats, x): a FactoredFrustum goes to factored_lss_pool
    over the same cells BEVFusion computes (`((geom - (bx - dx / 2)) / dx).long()`, in-grid
    filter); anything else goes to the original."""

    def make(original: Any) -> Any:
        def bev_pool(self, geom_feats, x):
            """muSPACE replacement of BEVFusion's `BaseTransform.bev_pool`: [B, C * Z, X, Y]."""
            if not isinstance(x, FactoredFrustum):
                return original(self, geom_feats, x)
            depth, context = x.depth, x.context
            if getattr(self, "fp16_enabled", False):  # MIT BEVFusion's @force_fp32
                depth, context, geom_feats = depth.float(), context.float(), geom_feats.float()
            lower = self.bx - self.dx / 2.0
            return factored_lss_pool(
                depth, context, geom_feats, lower, self.dx, self.nx, backend=backend
            )

        setattr(bev_pool, _FACTORED_POOL, True)
        return _mark(bev_pool, "bevfusion.factored_lss.bev_pool", original)

    return make


def _lifted(module: Any, x: torch.Tensor, b: int, n: int, h: int, w: int) -> Any:
    """The depthnet output [B*N, D + C, H, W] lifted as upstream does (softmax over the D depth
    bins, times the C context channels): a FactoredFrustum when the module's bev_pool is the
    factored one, else the materialised [B, N, D, H, W, C] product (upstream's result)."""
    d, c = module.D, module.C
    depth = x[:, :d].softmax(dim=1)
    context = x[:, d : d + c]
    if getattr(type(module).bev_pool, _FACTORED_POOL, False):
        return FactoredFrustum(
            depth.view(b, n, d, h, w), context.permute(0, 2, 3, 1).reshape(b, n, h, w, c)
        )
    lifted = depth.unsqueeze(1) * context.unsqueeze(2)
    return lifted.view(b, n, c, d, h, w).permute(0, 1, 3, 4, 5, 2)


def _lss_cam_feats(original: Any) -> Any:
    def get_cam_feats(self, x):
        """muSPACE replacement of LSSTransform.get_cam_feats: depth and context, unmultiplied
        when the factored bev_pool is patched in too."""
        b, n, c, h, w = x.shape
        return _lifted(self, self.depthnet(x.view(b * n, c, h, w)), b, n, h, w)

    return _mark(get_cam_feats, "bevfusion.factored_lss.LSSTransform", original)


def _depth_lss_cam_feats(original: Any) -> Any:
    def get_cam_feats(self, x, d):
        """muSPACE replacement of DepthLSSTransform.get_cam_feats (the LiDAR depth map through
        dtransform, concatenated with the image features, through depthnet)."""
        if getattr(self, "fp16_enabled", False):  # MIT BEVFusion's @force_fp32
            x, d = x.float(), d.float()
        b, n, c, h, w = x.shape
        d = self.dtransform(d.view(b * n, *d.shape[2:]))
        x = self.depthnet(torch.cat([d, x.view(b * n, c, h, w)], dim=1))
        return _lifted(self, x, b, n, h, w)

    return _mark(get_cam_feats, "bevfusion.factored_lss.DepthLSSTransform", original)


def _lss_patches(backend: str) -> list[Patch]:
    """The factored-LSS patches of each known BEVFusion layout, off by default: they change what
    get_cam_feats returns (a FactoredFrustum instead of a tensor) for code that calls it itself.
    Each is safe alone (get_cam_feats multiplies unless the factored bev_pool is in place;
    bev_pool passes tensors to the original). Enable: `patcher.enable("bevfusion.factored_lss.*")`."""
    patches = []
    for prefix, classes in LSS_VTRANSFORMS:
        where = classes["BaseTransform"].split(".")[0]
        for cls, method, make, params in (
            ("BaseTransform", "bev_pool", _lss_pool(backend), LSS_POOL_PARAMS),
            ("LSSTransform", "get_cam_feats", _lss_cam_feats, LSS_CAM_FEATS_PARAMS),
            (
                "DepthLSSTransform",
                "get_cam_feats",
                _depth_lss_cam_feats,
                DEPTH_LSS_CAM_FEATS_PARAMS,
            ),
        ):
            patches.append(
                Patch(
                    f"{prefix}.{cls}" if method == "get_cam_feats" else f"{prefix}.bev_pool",
                    f"{classes[cls]}.{cls}.{method}",
                    make,
                    precheck=_signature_check(params),
                    enabled=False,
                    description=f"BEVFusion ({where}) {cls}.{method}: depth and context pooled "
                    "by mu_space.bev_pool_prepare + bev_pool_v2, never multiplied out",
                )
            )
    return patches


# --------------------------------------------------------------------------- mmcv: voxels


def _voxelization(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def voxelization(
            points, voxel_size, coors_range, max_points=35, max_voxels=20000, deterministic=True
        ):
            """muSPACE replacement of mmcv's `voxelization` (`_Voxelization.apply`): hard
            voxelization -> (voxels [M, max_points, C], coors [M, 3] int32 (z, y, x),
            num_points_per_voxel [M] int32); max_points or max_voxels == -1: dynamic, coors
            [N, 3]. Deterministic (mmcv's deterministic order) whatever `deterministic` says."""
            return mu_space.voxelization(
                points, voxel_size, coors_range, max_points, max_voxels, bool(deterministic),
                backend=backend,
            )  # fmt: skip

        return _mark(voxelization, "mmcv.voxelization", original)

    return make


def _voxelization_class(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        class Voxelization(original):
            """muSPACE replacement of mmcv's `Voxelization` module: mmcv's constructor and
            attributes (a subclass), forward through `mu_space.voxelization`."""

            def forward(self, input):
                max_voxels = self.max_voxels[0] if self.training else self.max_voxels[1]
                return mu_space.voxelization(
                    input,
                    self.voxel_size,
                    self.point_cloud_range,
                    self.max_num_points,
                    max_voxels,
                    bool(getattr(self, "deterministic", True)),
                    backend=backend,
                )

        Voxelization.__module__ = getattr(original, "__module__", __name__)
        Voxelization.__qualname__ = original.__qualname__
        return _mark(Voxelization, "mmcv.Voxelization", original)

    return make


def _dynamic_scatter(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def dynamic_scatter(feats, coors, reduce_type="max"):
            """muSPACE replacement of mmcv's `dynamic_scatter` (`_DynamicScatter.apply`):
            (voxel_feats [M, C], voxel_coors [M, ndim]), differentiable w.r.t. feats."""
            return mu_space.dynamic_scatter(feats, coors, reduce_type, backend=backend)

        return _mark(dynamic_scatter, "mmcv.dynamic_scatter", original)

    return make


def _dynamic_scatter_class(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops.voxel_layers import scatter_batched

        class DynamicScatter(original):
            """muSPACE replacement of mmcv's `DynamicScatter` module (a subclass): the
            (batch, z, y, x) form in one call instead of mmcv's loop over the samples."""

            def forward_single(self, points, coors):
                reduce = "mean" if self.average_points else "max"
                return mu_space.dynamic_scatter(
                    points.contiguous(), coors.contiguous(), reduce, backend=backend
                )

            def forward(self, points, coors):
                if coors.size(-1) == 3:
                    return self.forward_single(points, coors)
                reduce = "mean" if self.average_points else "max"
                return scatter_batched(points, coors, reduce, backend)

        DynamicScatter.__module__ = getattr(original, "__module__", __name__)
        DynamicScatter.__qualname__ = original.__qualname__
        return _mark(DynamicScatter, "mmcv.DynamicScatter", original)

    return make


def _ext_hard_voxelize(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        new_api = _names_of(original) == EXT_HARD_PARAMS[0]

        def fill(points, voxel_size, coors_range, voxels, coors, num, max_points, max_voxels, det):
            v, c, k = mu_space.voxelization(
                points, voxel_size, coors_range, int(max_points), int(max_voxels), bool(det),
                backend=backend,
            )  # fmt: skip
            m = v.shape[0]
            voxels[:m].copy_(v)
            coors[:m].copy_(c)
            num[:m].copy_(k)
            return m

        if new_api:

            def hard_voxelize_forward(
                points, voxel_size, coors_range, voxels, coors, num_points_per_voxel,
                voxel_num, max_points, max_voxels, NDim=3, deterministic=True,
            ):  # fmt: skip
                """muSPACE replacement of mmcv 2.x's `_ext.hard_voxelize_forward`: fills the
                caller's max_voxels buffers (zero-initialised by the caller) and voxel_num."""
                if NDim != 3:
                    return original(
                        points, voxel_size, coors_range, voxels, coors, num_points_per_voxel,
                        voxel_num, max_points, max_voxels, NDim, deterministic,
                    )  # fmt: skip
                m = fill(
                    points, voxel_size, coors_range, voxels, coors, num_points_per_voxel,
                    max_points, max_voxels, deterministic,
                )  # fmt: skip
                voxel_num.fill_(m)
                return None

        else:

            def hard_voxelize_forward(
                points, voxels, coors, num_points_per_voxel, voxel_size, coors_range,
                max_points, max_voxels, NDim=3,
            ):  # fmt: skip
                """muSPACE replacement of early mmcv 1.x's `_ext.hard_voxelize_forward`:
                fills the caller's buffers, returns the voxel count."""
                if NDim != 3:
                    return original(
                        points, voxels, coors, num_points_per_voxel, voxel_size, coors_range,
                        max_points, max_voxels, NDim,
                    )  # fmt: skip
                return fill(
                    points, voxel_size, coors_range, voxels, coors, num_points_per_voxel,
                    max_points, max_voxels, True,
                )  # fmt: skip

        return _mark(hard_voxelize_forward, "mmcv._ext.hard_voxelize_forward", original)

    return make


def _ext_dynamic_voxelize(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        new_api = _names_of(original) == EXT_DYNAMIC_PARAMS[0]

        def fill(points, voxel_size, coors_range, coors):
            coors.copy_(mu_space.dynamic_voxelize(points, voxel_size, coors_range, backend=backend))

        if new_api:

            def dynamic_voxelize_forward(points, voxel_size, coors_range, coors, NDim=3):
                """muSPACE replacement of mmcv 2.x's `_ext.dynamic_voxelize_forward`: writes
                coors [N, 3] in place."""
                if NDim != 3:
                    return original(points, voxel_size, coors_range, coors, NDim)
                fill(points, voxel_size, coors_range, coors)

        else:

            def dynamic_voxelize_forward(points, coors, voxel_size, coors_range, NDim=3):
                """muSPACE replacement of early mmcv 1.x's `_ext.dynamic_voxelize_forward`."""
                if NDim != 3:
                    return original(points, coors, voxel_size, coors_range, NDim)
                fill(points, voxel_size, coors_range, coors)

        return _mark(dynamic_voxelize_forward, "mmcv._ext.dynamic_voxelize_forward", original)

    return make


def _ext_scatter_forward(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops.dynamic_scatter import dynamic_scatter_with_map

        def dynamic_point_to_voxel_forward(feats, coors, reduce_type):
            """muSPACE replacement of mmcv's `_ext.dynamic_point_to_voxel_forward`:
            [voxel_feats, voxel_coors, point2voxel (int32, -1 dropped), voxel_points_count]."""
            return list(dynamic_scatter_with_map(feats, coors, reduce_type, backend=backend))

        return _mark(
            dynamic_point_to_voxel_forward, "mmcv._ext.dynamic_point_to_voxel_forward", original
        )

    return make


def _ext_scatter_backward(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops.dynamic_scatter import dynamic_scatter_backward_from_map

        def dynamic_point_to_voxel_backward(
            grad_feats, grad_reduced_feats, feats, reduced_feats, coors_idx, reduce_count,
            reduce_type,
        ):  # fmt: skip
            """muSPACE replacement of mmcv's `_ext.dynamic_point_to_voxel_backward`: writes
            grad_feats in place by mmcv's rule (max: the gradient to the lowest point index
            whose feature equals the saved maximum)."""
            grad_feats.copy_(
                dynamic_scatter_backward_from_map(
                    grad_reduced_feats, feats, reduced_feats, coors_idx, reduce_count, reduce_type
                )
            )

        return _mark(
            dynamic_point_to_voxel_backward, "mmcv._ext.dynamic_point_to_voxel_backward", original
        )

    return make


# --------------------------------------------------------------------------- mmdet3d: pillars


def _pillar_scatter(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def forward(self, voxel_features, coors, batch_size=None):
            """muSPACE replacement of mmdet3d's `PointPillarsScatter.forward`: the canvas
            [B, in_channels, ny, nx] (B = 1 when batch_size is None: forward_single ignores the
            batch column, as upstream) through `mu_space.pillar_scatter`."""
            if getattr(self, "fp16_enabled", False):  # mmcv 1.x's auto_fp16 on this forward
                voxel_features = voxel_features.half()
            if batch_size is None:
                coors = torch.cat((torch.zeros_like(coors[:, :1]), coors[:, 1:]), dim=1)
                batch_size = 1
            return mu_space.pillar_scatter(
                voxel_features, coors, int(batch_size), (self.ny, self.nx), backend=backend
            )

        return _mark(forward, "mmdet3d.PointPillarsScatter", original)

    return make


# --------------------------------------------------------------------------- box3d (issue 12)


def _py_func(original: Any) -> Any:
    """The Python function behind a numba dispatcher (mmdet3d's `@numba.jit circle_nms`), whose
    own signature is not inspectable; a plain function is its own."""
    return getattr(original, "py_func", original)


def _points_in_boxes_part(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def points_in_boxes_part(points, boxes):
            """muSPACE replacement of mmcv's `points_in_boxes_part(points [B, M, 3], boxes
            [B, T, 7])` -> Tensor[B, M] int32: the first box holding each point, -1 for none
            (boxes with z at the bottom)."""
            return mu_space.points_in_boxes_part(points, boxes, backend=backend)

        return _mark(points_in_boxes_part, "mmcv.points_in_boxes_part", original)

    return make


def _points_in_boxes_all(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def points_in_boxes_all(points, boxes):
            """muSPACE replacement of mmcv's `points_in_boxes_all(points [B, M, 3], boxes
            [B, T, 7])` -> Tensor[B, M, T] int32, 1 where box t holds point m."""
            return mu_space.points_in_boxes_all(points, boxes, backend=backend)

        return _mark(points_in_boxes_all, "mmcv.points_in_boxes_all", original)

    return make


def _boxes_overlap_bev(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def boxes_overlap_bev(boxes_a, boxes_b):
            """muSPACE replacement of mmcv's `boxes_overlap_bev(boxes_a [M, 7], boxes_b
            [N, 7])` -> Tensor[M, N]: the exact BEV intersection areas, in boxes_a's dtype."""
            return mu_space.boxes_overlap_bev(boxes_a, boxes_b, backend=backend)

        return _mark(boxes_overlap_bev, "mmcv.boxes_overlap_bev", original)

    return make


def _boxes_iou_bev(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def boxes_iou_bev(boxes_a, boxes_b):
            """muSPACE replacement of mmcv's `iou3d.boxes_iou_bev(boxes_a [M, 5], boxes_b
            [N, 5])` ([x1, y1, x2, y2, ry]) -> Tensor[M, N] IoU (box_iou_rotated of the
            converted boxes, as mmcv >= 1.6)."""
            return mu_space.boxes_iou_bev(boxes_a, boxes_b, backend=backend)

        return _mark(boxes_iou_bev, "mmcv.boxes_iou_bev", original)

    return make


def _points_in_boxes_cpu(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def points_in_boxes_cpu(points, boxes):
            """muSPACE replacement of mmcv's `points_in_boxes_cpu(points [B, M, 3], boxes
            [B, T, 7])` -> Tensor[B, M, T] int32; computed in float32 as mmcv (`.float()`)."""
            return mu_space.points_in_boxes_cpu(points.float(), boxes.float(), backend=backend)

        return _mark(points_in_boxes_cpu, "mmcv.points_in_boxes_cpu", original)

    return make


def _nms_bev(patch_name: str) -> Callable[[str], Callable[[Any], Any]]:
    def factory(backend: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def nms_bev(boxes, scores, thresh, pre_max_size=None, post_max_size=None):
                """muSPACE replacement of `nms_bev(boxes [N, 5] (x1, y1, x2, y2, ry), scores
                [N], thresh, pre_max_size=None, post_max_size=None)` (mmcv's iou3d and
                mmdet3d's box3d_nms): Tensor[K] int64 kept indices, highest score first."""
                return mu_space.nms_bev(
                    boxes, scores, thresh, pre_max_size, post_max_size, backend=backend
                )

            return _mark(nms_bev, patch_name, original)

        return make

    return factory


def _nms3d(op_name: str, patch_name: str) -> Callable[[str], Callable[[Any], Any]]:
    def factory(backend: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            op = getattr(mu_space, op_name)

            def nms(boxes, scores, iou_threshold):
                """muSPACE replacement of mmcv's `nms3d` / `nms3d_normal(boxes [N, 7], scores
                [N], iou_threshold)` -> Tensor[K] int64 kept indices, highest score first."""
                return op(boxes, scores, iou_threshold, backend=backend)

            nms.__name__ = nms.__qualname__ = op_name
            return _mark(nms, patch_name, original)

        return make

    return factory


def _box_iou_rotated(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        with_clockwise = _names_of(original) == BOX_IOU_ROTATED_PARAMS[0]
        if with_clockwise:

            def box_iou_rotated(bboxes1, bboxes2, mode="iou", aligned=False, clockwise=True):
                """muSPACE replacement of mmcv's `box_iou_rotated(bboxes1 [N, 5], bboxes2
                [M, 5], mode='iou', aligned=False, clockwise=True)` -> Tensor[N, M] (aligned:
                [N]) IoU / IoF of (x, y, w, h, theta) rectangles, in bboxes1's dtype."""
                return mu_space.box_iou_rotated(
                    bboxes1, bboxes2, mode, aligned, clockwise, backend=backend
                )

        else:

            def box_iou_rotated(bboxes1, bboxes2, mode="iou", aligned=False):
                """muSPACE replacement of early mmcv 1.x's `box_iou_rotated(bboxes1, bboxes2,
                mode='iou', aligned=False)` (before `clockwise`: mmcv's clockwise=True)."""
                return mu_space.box_iou_rotated(
                    bboxes1, bboxes2, mode, aligned, True, backend=backend
                )

        return _mark(box_iou_rotated, "mmcv.box_iou_rotated", original)

    return make


def _ext_overlap_bev(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def iou3d_boxes_overlap_bev_forward(boxes_a, boxes_b, ans_iou):
            """muSPACE replacement of `mmcv._ext.iou3d_boxes_overlap_bev_forward`: writes the
            BEV overlaps [M, N] into the caller's `ans_iou` (what mmcv's boxes_overlap_bev and
            boxes_iou3d allocate)."""
            ans_iou.copy_(mu_space.boxes_overlap_bev(boxes_a, boxes_b, backend=backend))

        return _mark(
            iou3d_boxes_overlap_bev_forward, "mmcv._ext.iou3d_boxes_overlap_bev_forward", original
        )

    return make


_ROIAWARE_MODES = ("max", "avg")  # mmcv stores the mode as 0 / 1


def _roiaware_class(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        class RoIAwarePool3d(original):
            """muSPACE replacement of mmcv's `RoIAwarePool3d` module (a subclass: mmcv's
            constructor and attributes); forward(rois [N, 7], pts [P, 3], pts_feature [P, C])
            -> Tensor[N, ox, oy, oz, C] through `mu_space.roiaware_pool3d`."""

            def forward(self, rois, pts, pts_feature):
                mode = self.mode
                if not isinstance(mode, str):
                    mode = _ROIAWARE_MODES[int(mode)]
                return mu_space.roiaware_pool3d(
                    rois, pts, pts_feature, self.out_size, self.max_pts_per_voxel, mode,
                    backend=backend,
                )  # fmt: skip

        RoIAwarePool3d.__module__ = getattr(original, "__module__", __name__)
        RoIAwarePool3d.__qualname__ = original.__qualname__
        return _mark(RoIAwarePool3d, "mmcv.RoIAwarePool3d", original)

    return make


def _roipoint_class(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        class RoIPointPool3d(original):
            """muSPACE replacement of mmcv's `RoIPointPool3d` module (a subclass);
            forward(points [B, N, 3], point_features [B, N, C], boxes3d [B, M, 7]) ->
            (pooled_features [B, M, S, 3 + C], pooled_empty_flag [B, M] int32)."""

            def forward(self, points, point_features, boxes3d):
                return mu_space.roipoint_pool3d(
                    points, point_features, boxes3d, self.num_sampled_points, backend=backend
                )

        RoIPointPool3d.__module__ = getattr(original, "__module__", __name__)
        RoIPointPool3d.__qualname__ = original.__qualname__
        return _mark(RoIPointPool3d, "mmcv.RoIPointPool3d", original)

    return make


def _circle_nms(patch_name: str) -> Callable[[str], Callable[[Any], Any]]:
    def factory(backend: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def circle_nms(dets, thresh, post_max_size=83):
                """muSPACE replacement of mmdet3d's numba `circle_nms(dets [N, 3] (x, y, score),
                thresh, post_max_size=83)`: the kept indices as a list of ints, as upstream
                (CenterPoint wraps them in torch.tensor); a torch `dets` gives a Tensor."""
                keep = mu_space.circle_nms(dets, thresh, post_max_size, backend=backend)
                return keep if isinstance(keep, torch.Tensor) else [int(i) for i in keep]

            return _mark(circle_nms, patch_name, original)

        return make

    return factory


# OpenPCDet (pcdet.ops.iou3d_nms / roiaware_pool3d): the adapters of mu_space.ops.pcdet


def _pcdet_boxes_iou_bev(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def boxes_iou_bev(boxes_a, boxes_b):
            """muSPACE replacement of OpenPCDet's `boxes_iou_bev(boxes_a [N, 7], boxes_b
            [M, 7])` -> IoU [N, M] = ov / max(union, 1e-8)."""
            return pcdet.boxes_iou_bev(boxes_a, boxes_b, backend=backend)

        return _mark(boxes_iou_bev, "pcdet.boxes_iou_bev", original)

    return make


def _pcdet_boxes_bev_iou_cpu(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def boxes_bev_iou_cpu(boxes_a, boxes_b):
            """muSPACE replacement of OpenPCDet's `boxes_bev_iou_cpu(boxes_a, boxes_b)`: CPU
            tensors or numpy arrays (numpy in, numpy out) -> IoU [N, M] (muSPACE's reference;
            `backend` does not apply: CPU only, as upstream)."""
            return pcdet.boxes_bev_iou_cpu(boxes_a, boxes_b)

        return _mark(boxes_bev_iou_cpu, "pcdet.boxes_bev_iou_cpu", original)

    return make


def _pcdet_nms(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def nms_gpu(boxes, scores, thresh, pre_maxsize=None, **kwargs):
            """muSPACE replacement of OpenPCDet's `nms_gpu(boxes [N, 7], scores [N], thresh,
            pre_maxsize=None, **kwargs)` -> (keep Tensor[K] int64, None)."""
            return pcdet.nms_gpu(boxes, scores, thresh, pre_maxsize, backend=backend)

        return _mark(nms_gpu, "pcdet.nms_gpu", original)

    return make


def _pcdet_nms_normal(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def nms_normal_gpu(boxes, scores, thresh, **kwargs):
            """muSPACE replacement of OpenPCDet's `nms_normal_gpu(boxes [N, 7], scores [N],
            thresh, **kwargs)` -> (keep Tensor[K] int64, None), axis-aligned IoU."""
            return pcdet.nms_normal_gpu(boxes, scores, thresh, backend=backend)

        return _mark(nms_normal_gpu, "pcdet.nms_normal_gpu", original)

    return make


def _as_float32(x: Any) -> Any:
    """OpenPCDet's CPU entry casts with `.float()`; numpy arrays stay numpy (float32)."""
    if isinstance(x, torch.Tensor):
        return x.float()
    import numpy as np

    return np.ascontiguousarray(x, dtype=np.float32)


def _pcdet_points_in_boxes_gpu(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def points_in_boxes_gpu(points, boxes):
            """muSPACE replacement of OpenPCDet's `points_in_boxes_gpu(points [B, M, 3], boxes
            [B, T, 7] (z at the centre))` -> [B, M] int32, the first box holding each point or
            -1."""
            return pcdet.points_in_boxes_gpu(points, boxes, backend=backend)

        return _mark(points_in_boxes_gpu, "pcdet.points_in_boxes_gpu", original)

    return make


def _pcdet_points_in_boxes_cpu(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        from mu_space.ops import pcdet

        def points_in_boxes_cpu(points, boxes):
            """muSPACE replacement of OpenPCDet's `points_in_boxes_cpu(points [M, 3], boxes
            [T, 7] (z at the centre))` -> point_indices [T, M] int32 0 / 1 (numpy in, numpy
            out), computed in float32 as upstream (`.float()`)."""
            return pcdet.points_in_boxes_cpu(_as_float32(points), _as_float32(boxes))

        return _mark(points_in_boxes_cpu, "pcdet.points_in_boxes_cpu", original)

    return make


# --------------------------------------------------------------------------- spconv / sparse conv
#
# The rule (issue 11): the spconv.pytorch classes below are swapped for subclasses of
# mu_space.sparse's, CONSISTENTLY - the tensor type too - so a network built after apply() holds
# only muSPACE layers and muSPACE tensors:
# - SparseConvTensor(...) then builds muSPACE's tensor; the swapped layers also accept an
#   upstream spconv SparseConvTensor (one made before apply(), or through a reference to the
#   original class) and convert it, as long as it carries no upstream rule book (an empty
#   indice_dict); one that does is a TypeError naming the keys (its rule books are spconv's
#   objects, not ours);
# - the swapped SparseSequential passes the tensor to muSPACE's sparse modules AND to subclasses
#   of upstream spconv's SparseModule (user blocks such as mmdet3d's SparseBasicBlock), features
#   to everything else, as spconv does;
# - weights: spconv 2.x's KRSC layout [C_out, *k, C_in], the same state_dict keys and shapes.
# Layers not swapped (SparseConvTranspose*, 1-d / 4-d, other pools, subclasses of the upstream
# classes defined before apply()) stay spconv's: apply() before the model code is imported and
# the model is built. mmcv's sparse-conv modules are declined (DECLINED).
SPCONV_CONV_MODULE = "spconv.pytorch.conv"
SPCONV_POOL_MODULE = "spconv.pytorch.pool"
SPCONV_CORE_MODULE = "spconv.pytorch.core"
SPCONV_MODULES_MODULE = "spconv.pytorch.modules"
SPCONV_PACKAGE = "spconv.pytorch"
# spconv 2.3.x constructor parameter names
SPCONV_SUBM_PARAMS = ((
    "self", "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
    "groups", "bias", "indice_key", "algo", "fp32_accum", "large_kernel_fast_algo", "name",
),)  # fmt: skip
SPCONV_CONV_PARAMS = ((
    "self", "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
    "groups", "bias", "indice_key", "algo", "fp32_accum", "record_voxel_count",
    "large_kernel_fast_algo", "name",
),)  # fmt: skip
SPCONV_INVERSE_PARAMS = ((
    "self", "in_channels", "out_channels", "kernel_size", "indice_key", "bias", "algo",
    "fp32_accum", "large_kernel_fast_algo", "name",
),)  # fmt: skip
SPCONV_POOL_PARAMS = ((
    "self", "kernel_size", "stride", "padding", "dilation", "indice_key", "algo",
    "record_voxel_count", "name",
),)  # fmt: skip
SPCONV_TENSOR_PARAMS = ((
    "self", "features", "indices", "spatial_shape", "batch_size", "grid", "voxel_num",
    "indice_dict", "benchmark", "permanent_thrust_allocator", "enable_timer", "force_algo",
),)  # fmt: skip
SPCONV_TODENSE_PARAMS = (("self", "name"),)
# (patch name's class, defining module, precheck parameter sets)
SPCONV_LAYERS = (
    ("SubMConv3d", SPCONV_CONV_MODULE, SPCONV_SUBM_PARAMS),
    ("SparseConv3d", SPCONV_CONV_MODULE, SPCONV_CONV_PARAMS),
    ("SparseInverseConv3d", SPCONV_CONV_MODULE, SPCONV_INVERSE_PARAMS),
    ("SubMConv2d", SPCONV_CONV_MODULE, SPCONV_SUBM_PARAMS),
    ("SparseConv2d", SPCONV_CONV_MODULE, SPCONV_CONV_PARAMS),
    ("SparseMaxPool3d", SPCONV_POOL_MODULE, SPCONV_POOL_PARAMS),
)


def _sparse_input(x: Any, where: str) -> Any:
    """muSPACE's SparseConvTensor for `x`: itself, or an upstream spconv SparseConvTensor
    converted (features, indices, spatial shape and batch size; no rule books)."""
    from mu_space.sparse import SparseConvTensor

    if isinstance(x, SparseConvTensor) or not all(
        hasattr(x, a) for a in ("features", "indices", "spatial_shape", "batch_size")
    ):
        return x  # not a sparse tensor: the layer's own check names it
    keys = list(getattr(x, "indice_dict", None) or {})
    if keys:
        raise TypeError(
            f"{where}: an upstream {type(x).__module__}.{type(x).__name__} carrying upstream rule "
            f"books (indice_dict keys {keys}) cannot feed muSPACE's sparse layers; build the "
            "tensor and the network after default_patcher().apply() so every layer is muSPACE's"
        )
    return SparseConvTensor(x.features, x.indices, list(x.spatial_shape), int(x.batch_size))


def _spconv_layer(cls_name: str, patch_name: str, backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        import mu_space.sparse as ms

        base = getattr(ms, cls_name)

        def forward(self, input, *args, **kwargs):
            return base.forward(self, _sparse_input(input, cls_name), *args, **kwargs)

        replacement = type(
            cls_name,
            (base,),
            {
                "backend": backend,
                "forward": forward,
                "__module__": __name__,
                "__doc__": f"muSPACE replacement of spconv.pytorch.{cls_name} (a subclass of "
                f"mu_space.sparse.{cls_name}: spconv 2.x's constructor, KRSC weights, "
                f"indice_key rules; backend {backend!r}); upstream tensors are converted.",
            },
        )
        return _mark(replacement, patch_name, original)

    return make


def _spconv_tensor(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        import mu_space.sparse as ms

        class SparseConvTensor(ms.SparseConvTensor):
            """muSPACE replacement of spconv.pytorch.SparseConvTensor (mu_space.sparse's, with
            spconv 2.x's constructor and attributes)."""

        SparseConvTensor.__module__ = __name__
        return _mark(SparseConvTensor, "spconv.SparseConvTensor", original)

    return make


def _spconv_sequential(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        import importlib

        import mu_space.sparse as ms

        upstream_module = getattr(
            importlib.import_module(SPCONV_MODULES_MODULE), "SparseModule", ()
        )

        class SparseSequential(ms.SparseSequential):
            """muSPACE replacement of spconv.pytorch.SparseSequential: muSPACE's sparse modules
            and subclasses of upstream spconv's SparseModule get the tensor, other modules its
            features (skipped for a tensor without rows, as spconv)."""

            def forward(self, input):
                input = _sparse_input(input, "SparseSequential")
                for module in self._modules.values():
                    if ms.is_spconv_module(module) or isinstance(module, upstream_module):
                        input = module(input)
                    elif isinstance(input, ms.SparseConvTensor):
                        if input.indices.shape[0] != 0:
                            input = input.replace_feature(module(input.features))
                    else:
                        input = module(input)
                return input

        SparseSequential.__module__ = __name__
        return _mark(SparseSequential, "spconv.SparseSequential", original)

    return make


def _spconv_to_dense(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        import mu_space.sparse as ms

        class ToDense(ms.ToDense):
            """muSPACE replacement of spconv.pytorch.ToDense: [B, C, *spatial_shape]."""

            def forward(self, x):
                return ms.ToDense.forward(self, _sparse_input(x, "ToDense"))

        ToDense.__module__ = __name__
        return _mark(ToDense, "spconv.ToDense", original)

    return make


def _sequential_check(original: Any) -> str | None:
    """SparseSequential(*args, **kwargs) has no parameter names to compare: it must be an
    nn.Module class with spconv's `add` method, never a muSPACE replacement."""
    marked = getattr(original, _MARK, None)
    if marked is not None:
        return f"already replaced by muSPACE (patch {marked!r} of another Patcher)"
    if not (isinstance(original, type) and issubclass(original, torch.nn.Module)):
        return f"{original!r} is not an nn.Module class"
    if not callable(getattr(original, "add", None)):
        return "upstream SparseSequential has no add(module, name) method (not spconv 2.x's)"
    return None


def _spconv_patches(backend: str) -> list[Patch]:
    patches = [
        Patch(
            f"spconv.{cls}",
            f"{module}.{cls}",
            _spconv_layer(cls, f"spconv.{cls}", backend),
            aliases=(f"{SPCONV_PACKAGE}.{cls}",),
            precheck=_one_of(params, get=_class_init),
            description=f"spconv 2.x {cls} -> mu_space.sparse.{cls} (a subclass; "
            "mu_space.sparse_rulebook + sparse_conv / sparse_maxpool)",
        )
        for cls, module, params in SPCONV_LAYERS
    ]
    patches += [
        Patch(
            "spconv.SparseSequential",
            f"{SPCONV_MODULES_MODULE}.SparseSequential",
            _spconv_sequential(backend),
            aliases=(f"{SPCONV_PACKAGE}.SparseSequential",),
            precheck=_sequential_check,
            description="spconv 2.x SparseSequential -> mu_space.sparse.SparseSequential "
            "(also passes the tensor to upstream SparseModule subclasses)",
        ),
        Patch(
            "spconv.SparseConvTensor",
            f"{SPCONV_CORE_MODULE}.SparseConvTensor",
            _spconv_tensor(backend),
            aliases=(f"{SPCONV_PACKAGE}.SparseConvTensor",),
            precheck=_one_of(SPCONV_TENSOR_PARAMS, get=_class_init),
            description="spconv 2.x SparseConvTensor -> mu_space.sparse.SparseConvTensor",
        ),
        Patch(
            "spconv.ToDense",
            f"{SPCONV_PACKAGE}.ToDense",
            _spconv_to_dense(backend),
            aliases=(f"{SPCONV_MODULES_MODULE}.ToDense",),
            precheck=_one_of(SPCONV_TODENSE_PARAMS, get=_class_init),
            description="spconv 2.x ToDense -> mu_space.sparse.ToDense",
        ),
    ]
    return patches


# Upstream call sites with no default patch, and why (docs/patcher.md, "Box operators").
DECLINED = {
    "mmcv.nms_normal_bev": "mmcv >= 1.6 computes it as the 2-D axis-aligned `nms(boxes[:, :4], "
    "scores, thresh)` of (x1, y1, x2, y2) corners (mmcv <= 1.5: an iou3d kernel); muSPACE has no "
    "operator with that IoU on corner boxes (nms3d_normal takes centre / size boxes, and "
    "converting the corners rounds them)",
    "mmdet3d.nms_normal_bev": "the same computation as mmcv's nms_normal_bev (mmcv.ops.nms on "
    "the corners), in mmdet3d.models.layers.box3d_nms and mmdet3d.core.post_processing",
    "mmdet3d.aligned_3d_nms": "no muSPACE operator (3-D axis-aligned NMS with class masks)",
    "pcdet.boxes_iou3d_gpu": "no muSPACE 3-D IoU operator; its BEV overlap is a call into "
    "OpenPCDet's compiled iou3d_nms_cuda, whose pybind functions declare no argument names to "
    "check (mmcv's boxes_iou3d is covered by mmcv._ext.iou3d_boxes_overlap_bev_forward)",
    "pcdet.RoIAwarePool3d": "OpenPCDet's signature differs from mmcv's: RoIAwarePool3d(out_size, "
    "max_pts_each_voxel) with pool_method per forward call and RoIs with z at the CENTRE; "
    "mu_space.roiaware_pool3d is mmcv's (z at the bottom) and mu_space.ops.pcdet has no adapter",
    "pcdet.RoIPointPool3d": "OpenPCDet's RoIPointPool3d(num_sampled_points, pool_extra_width) "
    "enlarges z-centre boxes first; mu_space.roipoint_pool3d is mmcv's (no enlargement, z at the "
    "bottom) and mu_space.ops.pcdet has no adapter",
    "mmcv.sparse_conv": "mmcv.ops.sparse_conv / sparse_modules / sparse_structure (SubMConv3d, "
    "SparseConv3d, SparseInverseConv3d, SparseSequential, SparseConvTensor) hold RSCK weights "
    "[*k, C_in, C_out] (spconv 1.x's) where mu_space.sparse's modules hold spconv 2.x's KRSC "
    "[C_out, *k, C_in]: a swap would change the shape of every checkpoint's conv weights, and "
    "mmcv's max pool floors at 0; mmcv's modules keep running, on mmcv's _ext functions, which "
    "mu_space.sparse.mmcv_ext provides with mmcv's rules (served as mmcv._ext by "
    "mu_space.compat.mmcv). mmdet3d uses spconv.pytorch's classes when spconv 2.x is installed "
    "(mmdet3d.models.layers.spconv), which the spconv.* patches cover",
    "spconv.others": "spconv.pytorch's SparseConvTranspose*d, 1-d / 4-d layers, SparseAvgPool*, "
    "global pools and SparseModule are not swapped (not in the issue's list; SparseModule is a "
    "base class that model code subclasses at import time); they stay spconv's and must not be "
    "mixed with swapped layers in one network",
}


# --------------------------------------------------------------------------- assembly


def _check_backend(backend: Any) -> None:
    # Checked here: the ops would only reject it at the first model call.
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )


def default_patches(*, backend: str = "auto") -> list[Patch]:
    """Fresh Patch objects for the upstream call sites muSPACE replaces (docs/patcher.md).
    `backend` is passed to every muSPACE call: one of
    `mu_space.runtime.kernel_dispatch.BACKENDS` ("auto", "native", "cuda", "musa", "reference");
    anything else is a ValueError here."""
    _check_backend(backend)
    return [
        Patch(
            "mmcv.MultiScaleDeformableAttnFunction",
            f"{MSDA_MODULE}.MultiScaleDeformableAttnFunction",
            _msda_function(backend),
            aliases=("mmcv.ops.MultiScaleDeformableAttnFunction",),
            precheck=_signature_check(MSDA_FUNCTION_PARAMS, attribute="forward"),
            description="mmcv 1.x / 2.x multi-scale deformable attention (forward and "
            "backward) -> mu_space.multi_scale_deformable_attn",
        ),
        Patch(
            "mmcv.multi_scale_deformable_attn_pytorch",
            f"{MSDA_MODULE}.multi_scale_deformable_attn_pytorch",
            _msda_pytorch(backend),
            aliases=("mmcv.ops.multi_scale_deformable_attn_pytorch",),
            precheck=_signature_check(MSDA_PYTORCH_PARAMS),
            enabled=False,
            description="mmcv's pure-PyTorch MSDA path (off by default: it is upstream's "
            "reference) -> mu_space.multi_scale_deformable_attn",
        ),
        Patch(
            "bevdet.bev_pool_v2",
            f"{BEV_POOL_V2_MODULE}.bev_pool_v2",
            _bev_pool_v2(backend),
            aliases=("mmdet3d.ops.bev_pool_v2.bev_pool_v2", "mmdet3d.ops.bev_pool_v2"),
            precheck=_signature_check(BEV_POOL_V2_PARAMS),
            description="BEVDet dev2.0 bev_pool_v2 -> mu_space.bev_pool_v2",
        ),
        Patch(
            "bevdet.voxel_pooling_prepare_v2",
            f"{VIEW_TRANSFORMER}.voxel_pooling_prepare_v2",
            _voxel_pooling_prepare_v2(backend),
            precheck=_signature_check(PREPARE_V2_PARAMS),
            description="BEVDet dev2.0 LSSViewTransformer.voxel_pooling_prepare_v2 -> "
            "mu_space.bev_pool_prepare",
        ),
        Patch(
            "bevfusion.bev_pool",
            f"{BEV_POOL_MODULE}.bev_pool",
            _bev_pool(backend),
            aliases=("mmdet3d.ops.bev_pool.bev_pool", "mmdet3d.ops.bev_pool"),
            precheck=_signature_check(BEV_POOL_PARAMS),
            description="BEVFusion bev_pool -> mu_space.bev_pool",
        ),
        Patch(
            "bevfusion.bev_pool.projects",
            f"{BEV_POOL_PROJECTS_MODULE}.bev_pool",
            _bev_pool(backend, "bevfusion.bev_pool.projects"),
            aliases=(
                "projects.BEVFusion.bevfusion.ops.bev_pool.bev_pool",
                "projects.BEVFusion.bevfusion.ops.bev_pool",
            ),
            precheck=_signature_check(BEV_POOL_PARAMS),
            description="mmdet3d 1.x projects/BEVFusion bev_pool -> mu_space.bev_pool",
        ),
        *_lss_patches(backend),
        Patch(
            "mmcv.voxelization",
            f"{VOXELIZE_MODULE}.voxelization",
            _voxelization(backend),
            aliases=("mmcv.ops.voxelization",),
            precheck=_one_of(VOXELIZATION_FORWARD_PARAMS, get=_function_forward),
            description="mmcv 1.x / 2.x voxelization (hard and dynamic) -> mu_space.voxelization",
        ),
        Patch(
            "mmcv.Voxelization",
            f"{VOXELIZE_MODULE}.Voxelization",
            _voxelization_class(backend),
            aliases=("mmcv.ops.Voxelization",),
            precheck=_one_of(VOXELIZATION_INIT_PARAMS, get=_class_init),
            description="mmcv's Voxelization module (a subclass, forward replaced) -> "
            "mu_space.voxelization",
        ),
        Patch(
            "mmcv.dynamic_scatter",
            f"{SCATTER_MODULE}.dynamic_scatter",
            _dynamic_scatter(backend),
            aliases=("mmcv.ops.dynamic_scatter",),
            precheck=_one_of(DYNAMIC_SCATTER_FORWARD_PARAMS, get=_function_forward),
            description="mmcv 1.x / 2.x dynamic_scatter (forward and backward) -> "
            "mu_space.dynamic_scatter",
        ),
        Patch(
            "mmcv.DynamicScatter",
            f"{SCATTER_MODULE}.DynamicScatter",
            _dynamic_scatter_class(backend),
            aliases=("mmcv.ops.DynamicScatter",),
            precheck=_one_of(DYNAMIC_SCATTER_INIT_PARAMS, get=_class_init),
            description="mmcv's DynamicScatter module (a subclass; batched coors in one call) "
            "-> mu_space.dynamic_scatter",
        ),
        Patch(
            "mmcv._ext.hard_voxelize_forward",
            f"{EXT_MODULE}.hard_voxelize_forward",
            _ext_hard_voxelize(backend),
            precheck=_one_of(EXT_HARD_PARAMS),
            description="mmcv._ext.hard_voxelize_forward (what mmdet3d 1.x's own voxelize.py "
            "calls) -> mu_space.voxelization",
        ),
        Patch(
            "mmcv._ext.dynamic_voxelize_forward",
            f"{EXT_MODULE}.dynamic_voxelize_forward",
            _ext_dynamic_voxelize(backend),
            precheck=_one_of(EXT_DYNAMIC_PARAMS),
            description="mmcv._ext.dynamic_voxelize_forward -> mu_space.dynamic_voxelize",
        ),
        Patch(
            "mmcv._ext.dynamic_point_to_voxel_forward",
            f"{EXT_MODULE}.dynamic_point_to_voxel_forward",
            _ext_scatter_forward(backend),
            precheck=_one_of(EXT_SCATTER_FORWARD_PARAMS),
            description="mmcv._ext.dynamic_point_to_voxel_forward (mmdet3d 1.x "
            "dynamic_scatter_3d) -> mu_space.dynamic_scatter's parts",
        ),
        Patch(
            "mmcv._ext.dynamic_point_to_voxel_backward",
            f"{EXT_MODULE}.dynamic_point_to_voxel_backward",
            _ext_scatter_backward(backend),
            precheck=_one_of(EXT_SCATTER_BACKWARD_PARAMS),
            description="mmcv._ext.dynamic_point_to_voxel_backward -> mmcv's backward rule",
        ),
        Patch(
            "mmdet3d.PointPillarsScatter",
            f"{PILLAR_SCATTER}.forward",
            _pillar_scatter(backend),
            precheck=_one_of(PILLAR_FORWARD_PARAMS),
            description="mmdet3d PointPillarsScatter.forward -> mu_space.pillar_scatter",
        ),
        # ----------------------------------------------------------- box3d (issue 12)
        Patch(
            "mmcv.points_in_boxes_part",
            f"{POINTS_IN_BOXES_MODULE}.points_in_boxes_part",
            _points_in_boxes_part(backend),
            aliases=("mmcv.ops.points_in_boxes_part",),
            precheck=_one_of(POINTS_BOXES_PARAMS),
            description="mmcv points_in_boxes_part -> mu_space.points_in_boxes_part",
        ),
        Patch(
            "mmcv.points_in_boxes_all",
            f"{POINTS_IN_BOXES_MODULE}.points_in_boxes_all",
            _points_in_boxes_all(backend),
            aliases=("mmcv.ops.points_in_boxes_all",),
            precheck=_one_of(POINTS_BOXES_PARAMS),
            description="mmcv points_in_boxes_all -> mu_space.points_in_boxes_all",
        ),
        Patch(
            "mmcv.points_in_boxes_cpu",
            f"{POINTS_IN_BOXES_MODULE}.points_in_boxes_cpu",
            _points_in_boxes_cpu(backend),
            aliases=("mmcv.ops.points_in_boxes_cpu",),
            precheck=_one_of(POINTS_BOXES_PARAMS),
            description="mmcv points_in_boxes_cpu -> mu_space.points_in_boxes_cpu",
        ),
        Patch(
            "mmcv.boxes_overlap_bev",
            f"{IOU3D_MODULE}.boxes_overlap_bev",
            _boxes_overlap_bev(backend),
            aliases=("mmcv.ops.boxes_overlap_bev",),
            precheck=_one_of(BOX_PAIR_PARAMS),
            description="mmcv iou3d boxes_overlap_bev -> mu_space.boxes_overlap_bev",
        ),
        Patch(
            "mmcv.boxes_iou_bev",
            f"{IOU3D_MODULE}.boxes_iou_bev",
            _boxes_iou_bev(backend),
            aliases=("mmcv.ops.boxes_iou_bev",),
            precheck=_one_of(BOX_PAIR_PARAMS),
            description="mmcv iou3d boxes_iou_bev ([x1, y1, x2, y2, ry]) -> mu_space.boxes_iou_bev",
        ),
        Patch(
            "mmcv.nms_bev",
            f"{IOU3D_MODULE}.nms_bev",
            _nms_bev("mmcv.nms_bev")(backend),
            aliases=("mmcv.ops.nms_bev",),
            precheck=_one_of(NMS_BEV_PARAMS),
            description="mmcv iou3d nms_bev -> mu_space.nms_bev",
        ),
        Patch(
            "mmcv.nms3d",
            f"{IOU3D_MODULE}.nms3d",
            _nms3d("nms3d", "mmcv.nms3d")(backend),
            aliases=("mmcv.ops.nms3d",),
            precheck=_one_of(NMS3D_PARAMS),
            description="mmcv iou3d nms3d -> mu_space.nms3d",
        ),
        Patch(
            "mmcv.nms3d_normal",
            f"{IOU3D_MODULE}.nms3d_normal",
            _nms3d("nms3d_normal", "mmcv.nms3d_normal")(backend),
            aliases=("mmcv.ops.nms3d_normal",),
            precheck=_one_of(NMS3D_PARAMS),
            description="mmcv iou3d nms3d_normal -> mu_space.nms3d_normal",
        ),
        Patch(
            "mmcv._ext.iou3d_boxes_overlap_bev_forward",
            f"{EXT_MODULE}.iou3d_boxes_overlap_bev_forward",
            _ext_overlap_bev(backend),
            precheck=_one_of(EXT_OVERLAP_BEV_PARAMS),
            description="mmcv._ext.iou3d_boxes_overlap_bev_forward (behind mmcv's "
            "boxes_overlap_bev and boxes_iou3d) -> mu_space.boxes_overlap_bev",
        ),
        Patch(
            "mmcv.box_iou_rotated",
            f"{BOX_IOU_ROTATED_MODULE}.box_iou_rotated",
            _box_iou_rotated(backend),
            aliases=("mmcv.ops.box_iou_rotated",),
            precheck=_one_of(BOX_IOU_ROTATED_PARAMS),
            description="mmcv box_iou_rotated (with or without clockwise) -> "
            "mu_space.box_iou_rotated",
        ),
        Patch(
            "mmcv.RoIAwarePool3d",
            f"{ROIAWARE_MODULE}.RoIAwarePool3d",
            _roiaware_class(backend),
            aliases=("mmcv.ops.RoIAwarePool3d",),
            precheck=_one_of(ROIAWARE_INIT_PARAMS, get=_class_init),
            description="mmcv's RoIAwarePool3d module (a subclass, forward replaced) -> "
            "mu_space.roiaware_pool3d",
        ),
        Patch(
            "mmcv.RoIPointPool3d",
            f"{ROIPOINT_MODULE}.RoIPointPool3d",
            _roipoint_class(backend),
            aliases=("mmcv.ops.RoIPointPool3d",),
            precheck=_one_of(ROIPOINT_INIT_PARAMS, get=_class_init),
            description="mmcv's RoIPointPool3d module (a subclass, forward replaced) -> "
            "mu_space.roipoint_pool3d",
        ),
        Patch(
            "mmdet3d.nms_bev",
            f"{MMDET3D_NMS_MODULE}.nms_bev",
            _nms_bev("mmdet3d.nms_bev")(backend),
            aliases=("mmdet3d.models.layers.nms_bev",),
            precheck=_one_of(NMS_BEV_PARAMS),
            description="mmdet3d 1.x nms_bev (box3d_multiclass_nms, CenterPoint) -> "
            "mu_space.nms_bev",
        ),
        Patch(
            "mmdet3d.circle_nms",
            f"{MMDET3D_NMS_MODULE}.circle_nms",
            _circle_nms("mmdet3d.circle_nms")(backend),
            aliases=("mmdet3d.models.layers.circle_nms",),
            precheck=_one_of(CIRCLE_NMS_PARAMS, get=_py_func),
            description="mmdet3d 1.x circle_nms (numba, CenterPoint) -> mu_space.circle_nms",
        ),
        Patch(
            "mmdet3d.core.nms_bev",
            f"{MMDET3D_CORE_NMS_MODULE}.nms_bev",
            _nms_bev("mmdet3d.core.nms_bev")(backend),
            aliases=("mmdet3d.core.post_processing.nms_bev", "mmdet3d.core.nms_bev"),
            precheck=_one_of(NMS_BEV_PARAMS),
            description="mmdet3d 0.x / 1.0.0rc nms_bev -> mu_space.nms_bev",
        ),
        Patch(
            "mmdet3d.core.circle_nms",
            f"{MMDET3D_CORE_NMS_MODULE}.circle_nms",
            _circle_nms("mmdet3d.core.circle_nms")(backend),
            aliases=("mmdet3d.core.post_processing.circle_nms", "mmdet3d.core.circle_nms"),
            precheck=_one_of(CIRCLE_NMS_PARAMS, get=_py_func),
            description="mmdet3d 0.x / 1.0.0rc circle_nms -> mu_space.circle_nms",
        ),
        Patch(
            "pcdet.boxes_iou_bev",
            f"{PCDET_IOU3D_MODULE}.boxes_iou_bev",
            _pcdet_boxes_iou_bev(backend),
            precheck=_one_of(BOX_PAIR_PARAMS),
            description="OpenPCDet iou3d_nms_utils.boxes_iou_bev -> mu_space.ops.pcdet",
        ),
        Patch(
            "pcdet.boxes_bev_iou_cpu",
            f"{PCDET_IOU3D_MODULE}.boxes_bev_iou_cpu",
            _pcdet_boxes_bev_iou_cpu(backend),
            precheck=_one_of(BOX_PAIR_PARAMS),
            description="OpenPCDet iou3d_nms_utils.boxes_bev_iou_cpu -> mu_space.ops.pcdet",
        ),
        Patch(
            "pcdet.nms_gpu",
            f"{PCDET_IOU3D_MODULE}.nms_gpu",
            _pcdet_nms(backend),
            precheck=_one_of(PCDET_NMS_PARAMS),
            description="OpenPCDet iou3d_nms_utils.nms_gpu -> mu_space.ops.pcdet.nms_gpu",
        ),
        Patch(
            "pcdet.nms_normal_gpu",
            f"{PCDET_IOU3D_MODULE}.nms_normal_gpu",
            _pcdet_nms_normal(backend),
            precheck=_one_of(PCDET_NMS_NORMAL_PARAMS),
            description="OpenPCDet iou3d_nms_utils.nms_normal_gpu -> "
            "mu_space.ops.pcdet.nms_normal_gpu",
        ),
        Patch(
            "pcdet.points_in_boxes_gpu",
            f"{PCDET_ROIAWARE_MODULE}.points_in_boxes_gpu",
            _pcdet_points_in_boxes_gpu(backend),
            precheck=_one_of(POINTS_BOXES_PARAMS),
            description="OpenPCDet roiaware_pool3d_utils.points_in_boxes_gpu -> "
            "mu_space.ops.pcdet.points_in_boxes_gpu",
        ),
        Patch(
            "pcdet.points_in_boxes_cpu",
            f"{PCDET_ROIAWARE_MODULE}.points_in_boxes_cpu",
            _pcdet_points_in_boxes_cpu(backend),
            precheck=_one_of(POINTS_BOXES_PARAMS),
            description="OpenPCDet roiaware_pool3d_utils.points_in_boxes_cpu -> "
            "mu_space.ops.pcdet.points_in_boxes_cpu",
        ),
        # ----------------------------------------------------------- spconv (issue 11)
        *_spconv_patches(backend),
    ]


def default_patcher(*, backend: str = "auto") -> Patcher:
    """A new Patcher holding `default_patches(backend=backend)`; nothing is applied yet.

    patcher = default_patcher()
    patcher.apply()          # or: with default_patcher(): ...
    print(patcher.report())
    """
    return Patcher(default_patches(backend=backend))
