"""The default patches: upstream call sites of mmcv, BEVDet and BEVFusion that muSPACE replaces.

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


def _bev_pool(backend: str) -> Callable[[Any], Any]:
    def make(original: Any) -> Any:
        def bev_pool(feats, coords, B, D, H, W):
            """muSPACE replacement of BEVFusion's `bev_pool`: Tensor[B, C, D, H, W] in feats'
            dtype; coords (x, y, z, batch) index (H, W, D, B)."""
            return mu_space.bev_pool(
                feats, coords, _dim(B), _dim(D), _dim(H), _dim(W), backend=backend
            )

        return _mark(bev_pool, "bevfusion.bev_pool", original)

    return make


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
    ]


def default_patcher(*, backend: str = "auto") -> Patcher:
    """A new Patcher holding `default_patches(backend=backend)`; nothing is applied yet.

    patcher = default_patcher()
    patcher.apply()          # or: with default_patcher(): ...
    print(patcher.report())
    """
    return Patcher(default_patches(backend=backend))
