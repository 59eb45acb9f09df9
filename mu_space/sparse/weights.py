"""Sparse-conv weight layouts and the checkpoint loaders (docs/operators/sparse_conv.md).

spconv's layout names (`SPCONV_SAVED_WEIGHT_LAYOUT`), for ndim spatial axes:

    KRSC   [C_out, *kernel, C_in]   spconv >= 2.2 (every algorithm), the layout here
    RSKC   [*kernel, C_out, C_in]   spconv 2.0 / 2.1 Native algorithm
    RSCK   [*kernel, C_in, C_out]   spconv 1.x and mmcv (`mmcv.ops.SparseConv3d`, mmdet3d 0.x /
                                    1.x checkpoints trained on mmcv's ops)

spconv 2.x checkpoints load unchanged. An older checkpoint: `load_state_dict(model, sd,
layout="RSCK")` (or `convert_state_dict` for the dict alone), or set
SPCONV_SAVED_WEIGHT_LAYOUT=RSCK as with spconv itself (read when a layer is built). The source
layout is never guessed from the shapes: [3, 3, 3, 3, 3] is a valid weight in every layout.
"""

from __future__ import annotations

import os

import torch

LAYOUTS = ("KRSC", "RSKC", "RSCK")


def _check_layout(layout, name="layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{name} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def saved_weight_layout() -> str:
    """SPCONV_SAVED_WEIGHT_LAYOUT ('' when unset), checked."""
    value = os.environ.get("SPCONV_SAVED_WEIGHT_LAYOUT", "")
    return _check_layout(value, "SPCONV_SAVED_WEIGHT_LAYOUT") if value else ""


def to_krsc(weight: torch.Tensor, layout: str, ndim: int | None = None) -> torch.Tensor:
    """A weight of `layout` as KRSC [C_out, *kernel, C_in] (contiguous)."""
    _check_layout(layout)
    n = weight.dim() - 2 if ndim is None else ndim
    if weight.dim() != n + 2:
        raise ValueError(f"weight must have {n + 2} dims for {n} spatial axes, got {weight.dim()}")
    if layout == "RSKC":
        weight = weight.permute(n, *range(n), n + 1)
    elif layout == "RSCK":
        weight = weight.permute(n + 1, *range(n), n)
    return weight.contiguous()


def from_krsc(weight: torch.Tensor, layout: str) -> torch.Tensor:
    """A KRSC weight in `layout` (e.g. 'RSCK' for spconv 1.x / mmcv), contiguous."""
    _check_layout(layout)
    n = weight.dim() - 2
    if layout == "RSKC":
        weight = weight.permute(*range(1, n + 1), 0, n + 1)
    elif layout == "RSCK":
        weight = weight.permute(*range(1, n + 1), n + 1, 0)
    return weight.contiguous()


def to_gemm(weight: torch.Tensor) -> torch.Tensor:
    """KRSC [C_out, *kernel, C_in] -> the ops' [K, C_in, C_out] (a view, no copy)."""
    c_out, c_in = weight.shape[0], weight.shape[-1]
    return weight.reshape(c_out, -1, c_in).permute(1, 2, 0)


def _conv_modules(model):
    from mu_space.sparse.conv import SparseConvolution

    return [(name, m) for name, m in model.named_modules() if isinstance(m, SparseConvolution)]


def convert_state_dict(state_dict: dict, model, layout: str = "RSCK") -> dict:
    """A copy of `state_dict` whose sparse-conv weights (those of `model`'s SparseConvolution
    layers, by name) are converted from `layout` to KRSC; other entries unchanged."""
    _check_layout(layout)
    out = dict(state_dict)
    for name, module in _conv_modules(model):
        key = f"{name}.weight" if name else "weight"
        if key not in out:
            continue
        w = to_krsc(out[key], layout, module.ndim)
        if tuple(w.shape) != tuple(module.weight.shape):
            raise ValueError(
                f"{key}: a {layout} weight of shape {tuple(out[key].shape)} is "
                f"{tuple(w.shape)} in KRSC, the layer's weight is {tuple(module.weight.shape)}"
            )
        out[key] = w
    return out


def load_state_dict(model, state_dict: dict, layout: str = "RSCK", strict: bool = True):
    """model.load_state_dict of a checkpoint whose sparse-conv weights are in `layout`
    (spconv 1.x / mmcv: 'RSCK'). Returns what nn.Module.load_state_dict returns."""
    return model.load_state_dict(convert_state_dict(state_dict, model, layout), strict=strict)
