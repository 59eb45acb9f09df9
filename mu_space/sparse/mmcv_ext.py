"""mmcv's sparse-convolution `_ext` functions (mmcv/ops/csrc/pytorch/pybind.cpp names, argument
order and return layouts), on muSPACE's rule-book ops; `mu_space.compat.mmcv` serves them as
`mmcv._ext`, so mmcv.ops.SparseConv3d / SubMConv3d / SparseMaxPool3d (mmdet3d's SparseEncoder,
CenterPoint) run unchanged.

    get_indice_pairs_{2,3,4}d_forward(indices, batchSize, outSpatialShape, spatialShape,
        kernelSize, stride, padding, dilation, outPadding, _subM, _transpose)
        -> [out_indices [M, ndim + 1] int32, indice_pairs [K, 2, N] int32, indice_num [K] int32]
    get_indice_pairs_{2,3}d_backward(indices, gridOut, batchSize, ...same...) -> the same
        (mmcv's variant with a caller-allocated grid; the grid is only checked here)
    indice_conv_forward(features, filters, indicePairs, indiceNum, numActOut, _inverse, _subM)
        -> [numActOut, C_out]; filters [*kernel, C_in, C_out] (mmcv's layout)
    indice_conv_backward(features, filters, outGrad, indicePairs, indiceNum, _inverse, _subM)
        -> [input_grad [N, C_in], filters_grad (filters' shape)]
    fused_indice_conv_forward(features, filters, bias, indicePairs, indiceNum, numActOut,
        _inverse, _subM) -> indice_conv_forward + bias (also as
        fused_indice_conv_batchnorm_forward, the C++ name)
    indice_maxpool_forward(features, indicePairs, indiceNum, numAct) -> [numAct, C]
    indice_maxpool_backward(features, outFeatures, outGrad, indicePairs, indiceNum) -> [N, C]

mmcv's rules kept: SubM pairs use padding k // 2 and stride 1 whatever is passed, and return
the input `indices` tensor itself as the output indices; the max pool starts from 0 (a window of
negative features pools to 0; NaN inputs lose every comparison, so they are ignored) and its
gradient goes to every input equal to the output. Where mmcv's GPU results depend on thread
timing (the pair order within an offset, strided-conv output order from its hash), these give
the deterministic order of docs/operators/sparse_conv.md: pairs in ascending input row,
outputs in ascending (b, z, y, x), which is the order mmcv's `unique` step produces too.

Each function also takes a keyword-only `backend` (default "auto") for the muSPACE ops behind
it; the mmcv._ext surrogate passes its own (`mu_space.compat.mmcv.install(backend=...)`).
"""

from __future__ import annotations

import math
import operator

import torch

from mu_space.ops import _sparse
from mu_space.ops.sparse_conv import sparse_conv
from mu_space.ops.sparse_maxpool import sparse_maxpool
from mu_space.ops.sparse_rulebook import sparse_rulebook


def _get_indice_pairs(
    ndim, indices, batchSize, outSpatialShape, spatialShape, kernelSize, stride, padding,
    dilation, outPadding, _subM, _transpose, backend,
):  # fmt: skip
    got = _sparse.check_indices(indices)
    if got != ndim:
        raise ValueError(
            f"indices must be [N, {ndim + 1}] for get_indice_pairs_{ndim}d, got shape "
            f"{tuple(indices.shape)}"
        )
    if isinstance(batchSize, torch.Tensor):  # pybind11 takes any __index__ integer: mmdet3d's
        batchSize = operator.index(batchSize)  # SparseEncoder passes coors[-1, 0] + 1 (0-d)
    subm = _sparse.as_bool(_subM, "_subM")
    transpose = _sparse.as_bool(_transpose, "_transpose")
    ksize = _sparse.int_list(kernelSize, "kernelSize", ndim, 1)
    dilation = _sparse.int_list(dilation, "dilation", ndim, 1)
    if subm:  # mmcv's launcher: padding k / 2, stride 1
        stride, padding = [1] * ndim, [k // 2 for k in ksize]
    rb = sparse_rulebook(
        indices, batchSize, list(spatialShape), ksize, stride, padding, dilation, outPadding,
        subm, transpose, backend=backend,
    )  # fmt: skip
    spatial = _sparse.spatial_shape_arg(spatialShape, ndim, "spatialShape")
    if subm:
        want = spatial
    elif transpose:
        want = _sparse.deconv_output_size(
            spatial, ksize, _sparse.int_list(stride, "stride", ndim),
            _sparse.int_list(padding, "padding", ndim), dilation,
            _sparse.int_list(outPadding, "outPadding", ndim),
        )  # fmt: skip
    else:
        want = _sparse.conv_output_size(
            spatial, ksize, _sparse.int_list(stride, "stride", ndim),
            _sparse.int_list(padding, "padding", ndim), dilation,
        )  # fmt: skip
    if _sparse.int_list(outSpatialShape, "outSpatialShape", ndim) != want:
        raise ValueError(
            f"outSpatialShape must be {want} (mmcv's get_conv_output_size of these "
            f"arguments), got {list(outSpatialShape)}"
        )
    out_indices = indices if subm else rb.out_indices
    return [out_indices, rb.indice_pairs, rb.indice_pair_num]


def get_indice_pairs_2d_forward(indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                                stride, padding, dilation, outPadding, _subM, _transpose, *,
                                backend="auto"):  # fmt: skip
    return _get_indice_pairs(2, indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                             stride, padding, dilation, outPadding, _subM, _transpose,
                             backend)  # fmt: skip


def get_indice_pairs_3d_forward(indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                                stride, padding, dilation, outPadding, _subM, _transpose, *,
                                backend="auto"):  # fmt: skip
    return _get_indice_pairs(3, indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                             stride, padding, dilation, outPadding, _subM, _transpose,
                             backend)  # fmt: skip


def get_indice_pairs_4d_forward(indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                                stride, padding, dilation, outPadding, _subM, _transpose, *,
                                backend="auto"):  # fmt: skip
    return _get_indice_pairs(4, indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                             stride, padding, dilation, outPadding, _subM, _transpose,
                             backend)  # fmt: skip


def _check_grid(gridOut, batchSize, outSpatialShape):
    if not isinstance(gridOut, torch.Tensor):
        raise TypeError(f"gridOut must be a torch.Tensor, got {type(gridOut).__name__}")
    need = _sparse.as_int(batchSize, "batchSize", 1) * math.prod(outSpatialShape)
    if gridOut.numel() < need:
        raise ValueError(
            f"gridOut must hold >= batchSize * prod(outSpatialShape) = {need} elements, got "
            f"{gridOut.numel()}"
        )


def get_indice_pairs_2d_backward(indices, gridOut, batchSize, outSpatialShape, spatialShape,
                                 kernelSize, stride, padding, dilation, outPadding, _subM,
                                 _transpose, *, backend="auto"):  # fmt: skip
    _check_grid(gridOut, batchSize, outSpatialShape)
    return _get_indice_pairs(2, indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                             stride, padding, dilation, outPadding, _subM, _transpose,
                             backend)  # fmt: skip


def get_indice_pairs_3d_backward(indices, gridOut, batchSize, outSpatialShape, spatialShape,
                                 kernelSize, stride, padding, dilation, outPadding, _subM,
                                 _transpose, *, backend="auto"):  # fmt: skip
    _check_grid(gridOut, batchSize, outSpatialShape)
    return _get_indice_pairs(3, indices, batchSize, outSpatialShape, spatialShape, kernelSize,
                             stride, padding, dilation, outPadding, _subM, _transpose,
                             backend)  # fmt: skip


def _gemm_filters(filters, features, indicePairs):
    """mmcv's filters [*kernel, C_in, C_out] -> [K, C_in, C_out] (a view)."""
    if not isinstance(filters, torch.Tensor):
        raise TypeError(f"filters must be a torch.Tensor, got {type(filters).__name__}")
    if filters.dim() < 3:
        raise ValueError(
            f"filters must be [*kernel, C_in, C_out], got shape {tuple(filters.shape)}"
        )
    return filters.reshape(-1, filters.shape[-2], filters.shape[-1])


def indice_conv_forward(
    features, filters, indicePairs, indiceNum, numActOut, _inverse, _subM, *, backend="auto"
):
    """mmcv `_ext.indice_conv_forward` -> Tensor[numActOut, C_out] (features' dtype)."""
    _sparse.as_bool(_subM, "_subM")  # SubM pairs are pairs: the same computation
    w = _gemm_filters(filters, features, indicePairs)
    inverse = _sparse.as_bool(_inverse, "_inverse")
    return sparse_conv(features, w, indicePairs, indiceNum, numActOut, inverse, backend=backend)


def indice_conv_backward(
    features, filters, outGrad, indicePairs, indiceNum, _inverse, _subM, *, backend="auto"
):
    """mmcv `_ext.indice_conv_backward` -> [input_grad, filters_grad] (through the op
    sparse_conv_backward)."""
    _sparse.as_bool(_subM, "_subM")
    inverse = _sparse.as_bool(_inverse, "_inverse")
    if not isinstance(outGrad, torch.Tensor):
        raise TypeError(f"outGrad must be a torch.Tensor, got {type(outGrad).__name__}")
    with torch.enable_grad():
        f = features.detach().requires_grad_(True)
        w = _gemm_filters(filters, features, indicePairs).detach().requires_grad_(True)
        out = sparse_conv(f, w, indicePairs, indiceNum, outGrad.shape[0], inverse, backend=backend)
        g_f, g_w = torch.autograd.grad(out, (f, w), outGrad.to(out.dtype))
    return [g_f, g_w.reshape(filters.shape)]


def fused_indice_conv_forward(features, filters, bias, indicePairs, indiceNum, numActOut,
                              _inverse, _subM, *, backend="auto"):  # fmt: skip
    """mmcv `_ext.fused_indice_conv_forward` (C++ fused_indice_conv_batchnorm_forward): the conv
    plus bias (a batch norm folded into filters and bias by the caller)."""
    out = indice_conv_forward(
        features, filters, indicePairs, indiceNum, numActOut, _inverse, _subM, backend=backend
    )
    return out + bias.to(out.dtype)


fused_indice_conv_batchnorm_forward = fused_indice_conv_forward


def _mmcv_pool_input(features):
    _sparse.check_features(features)
    return torch.nan_to_num(features, nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)


def indice_maxpool_forward(features, indicePairs, indiceNum, numAct, *, backend="auto"):
    """mmcv `_ext.indice_maxpool_forward` -> Tensor[numAct, C]: max(0, max of the inputs),
    NaN inputs ignored (mmcv's zeroed buffer and `in > out` comparison)."""
    pooled = sparse_maxpool(
        _mmcv_pool_input(features), indicePairs, indiceNum, numAct, backend=backend
    )
    return pooled.clamp(min=0)


def indice_maxpool_backward(
    features, outFeatures, outGrad, indicePairs, indiceNum, *, backend="auto"
):
    """mmcv `_ext.indice_maxpool_backward` -> Tensor[N, C]: each output's gradient to every input
    equal to it (outFeatures must be indice_maxpool_forward's result for these features; the
    gradient goes through the op sparse_maxpool_backward)."""
    if not isinstance(outGrad, torch.Tensor):
        raise TypeError(f"outGrad must be a torch.Tensor, got {type(outGrad).__name__}")
    with torch.enable_grad():
        f = features.detach().requires_grad_(True)
        out = sparse_maxpool(
            _mmcv_pool_input(f), indicePairs, indiceNum, outGrad.shape[0], backend=backend
        )
        out = out.clamp(min=0)
        (g,) = torch.autograd.grad(out, f, outGrad.to(out.dtype))
    return g


__all__ = [
    "fused_indice_conv_batchnorm_forward",
    "fused_indice_conv_forward",
    "get_indice_pairs_2d_backward",
    "get_indice_pairs_2d_forward",
    "get_indice_pairs_3d_backward",
    "get_indice_pairs_3d_forward",
    "get_indice_pairs_4d_forward",
    "indice_conv_backward",
    "indice_conv_forward",
    "indice_maxpool_backward",
    "indice_maxpool_forward",
]
