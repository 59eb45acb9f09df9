"""spconv 2.x convolution layers (`spconv.pytorch.conv`): SubMConv{1,2,3,4}d,
SparseConv{1,2,3,4}d, SparseConvTranspose{1,2,3,4}d, SparseInverseConv{1,2,3,4}d, with spconv's
constructor arguments, weight layout ([C_out, *kernel, C_in], KRSC) and `indice_key` rules:

- a layer with an indice_key stores the rule book it builds in the output's indice_dict;
- a SubM layer whose key is already there reuses that rule book (same kernel size, dilation,
  spatial shape and row count, else ValueError); a strided conv whose key is already there is a
  ValueError (spconv: only SubM layers reuse);
- a SparseInverseConv uses the rule book of the conv / pool with its key backwards: its output
  is that layer's input sites (the same indices tensor) and spatial shape.

The computation is mu_space.ops.sparse_rulebook + mu_space.ops.sparse_conv (+ bias).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import init

from mu_space.ops import _sparse
from mu_space.ops.sparse_conv import sparse_conv
from mu_space.ops.sparse_rulebook import sparse_rulebook
from mu_space.sparse import weights as _weights
from mu_space.sparse.core import ConvAlgo, IndiceData, SparseConvTensor, check_input
from mu_space.sparse.modules import SparseModule

_MAX_VOXELS = "max_num_voxels_during_training"


def subm_padding(kernel_size, dilation) -> list[int]:
    """The padding of a SubM layer: k // 2 * dilation per axis (the outputs are the inputs; the
    window is centred for odd k; spconv and mmcv use k // 2, the same for dilation 1)."""
    return [k // 2 * d for k, d in zip(kernel_size, dilation)]


class SparseConvolution(SparseModule):
    """spconv 2.x `SparseConvolution(ndim, in_channels, out_channels, kernel_size=3, stride=1,
    padding=0, dilation=1, groups=1, bias=True, subm=False, output_padding=0,
    transposed=False, inverse=False, indice_key=None, algo=None, fp32_accum=None,
    record_voxel_count=False, act_type=None, act_alpha=0, act_beta=0, name=None,
    device=None, dtype=None, large_kernel_fast_algo=False)`.

    weight: Parameter[C_out, *kernel_size, C_in] (spconv >= 2.2 KRSC; spconv 2.x state_dicts
    load unchanged, older layouts through mu_space.sparse.weights); bias: [C_out] or None.
    `algo` and `fp32_accum` are accepted and recorded: every layer runs the rule-book path with
    float32 accumulation; so is `large_kernel_fast_algo` (spconv 2.3). Fused activations
    (`act_type`) are not supported.

    `backend` (class attribute, "auto"): the backend the layer passes to sparse_rulebook /
    sparse_conv (mu_space.runtime.kernel_dispatch.BACKENDS); set it on an instance or a
    subclass (the patcher's spconv classes do)."""

    backend = "auto"

    def __init__(
        self, ndim, in_channels, out_channels, kernel_size=3, stride=1, padding=0, dilation=1,
        groups=1, bias=True, subm=False, output_padding=0, transposed=False, inverse=False,
        indice_key=None, algo=None, fp32_accum=None, record_voxel_count=False, act_type=None,
        act_alpha=0, act_beta=0, name=None, device=None, dtype=None, large_kernel_fast_algo=False,
    ):  # fmt: skip
        super().__init__(name=name)
        if groups != 1:
            raise ValueError(f"groups must be 1 (spconv has no grouped sparse conv), got {groups}")
        if act_type not in (None, 0) and str(act_type).rsplit(".", 1)[-1] not in ("None_", "None"):
            raise NotImplementedError(f"fused activation act_type={act_type} is not supported")
        self.ndim = _sparse.as_int(ndim, "ndim", 1, _sparse.MAX_NDIM)
        self.in_channels = _sparse.as_int(in_channels, "in_channels", 1)
        self.out_channels = _sparse.as_int(out_channels, "out_channels", 1)
        self.kernel_size = _sparse.int_list(kernel_size, "kernel_size", self.ndim, 1)
        self.stride = _sparse.int_list(stride, "stride", self.ndim, 1)
        self.padding = _sparse.int_list(padding, "padding", self.ndim, 0)
        self.dilation = _sparse.int_list(dilation, "dilation", self.ndim, 1)
        self.output_padding = _sparse.int_list(output_padding, "output_padding", self.ndim, 0)
        kv = math.prod(self.kernel_size)
        if kv > _sparse.MAX_KERNEL_VOLUME:
            raise ValueError(f"kernel_size {self.kernel_size}: at most 4096 offsets, got {kv}")
        self.conv1x1 = kv == 1 and (subm or math.prod(self.stride) == 1)
        if self.conv1x1 and not subm and any(self.padding):
            raise ValueError("padding must be zero for a 1x1 conv (k = 1, s = 1)")
        self.subm = bool(subm)
        self.transposed = bool(transposed)
        self.inverse = bool(inverse)
        if self.inverse and indice_key is None:
            raise ValueError("an inverse conv needs the indice_key of the conv it inverts")
        self.groups = groups
        self.indice_key = indice_key
        self.algo = ConvAlgo.Native if algo is None else algo
        self.fp32_accum = fp32_accum
        self.record_voxel_count = record_voxel_count
        self.large_kernel_fast_algo = large_kernel_fast_algo
        self.act_type, self.act_alpha, self.act_beta = act_type, act_alpha, act_beta
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(
            torch.zeros(self.out_channels, *self.kernel_size, self.in_channels, **factory)
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        if record_voxel_count and not self.subm and not self.inverse:
            self.register_buffer(_MAX_VOXELS, torch.zeros(1, dtype=torch.int32, device=device))
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._load_weight_different_layout)

    # ------------------------------------------------------------------ parameters

    def reset_parameters(self) -> None:
        """spconv's init: kaiming-uniform (a = sqrt(5)) with fan_in = C_in * K, bias
        uniform(+-1 / sqrt(fan_in))."""
        fan_in = self.in_channels * math.prod(self.kernel_size)
        gain = init.calculate_gain("leaky_relu", math.sqrt(5))
        bound = math.sqrt(3.0) * gain / math.sqrt(fan_in)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def _load_weight_different_layout(self, state_dict, prefix, *args):
        name = prefix + _MAX_VOXELS
        if hasattr(self, _MAX_VOXELS) and name not in state_dict:
            state_dict[name] = torch.zeros(1, dtype=torch.int32)
        layout = _weights.saved_weight_layout()
        key = prefix + "weight"
        if layout and key in state_dict:
            state_dict[key] = _weights.to_krsc(state_dict[key], layout, self.ndim)

    def get_max_num_voxels(self):
        return getattr(self, _MAX_VOXELS, None)

    def extra_repr(self) -> str:
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"
        s += f", stride={self.stride}"
        if any(self.padding):
            s += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            s += f", dilation={self.dilation}"
        if self.bias is None:
            s += ", bias=False"
        if self.indice_key is not None:
            s += f", indice_key={self.indice_key!r}"
        return s

    # ------------------------------------------------------------------ forward

    def _out_spatial_shape(self, spatial_shape):
        if self.subm:
            return list(spatial_shape)
        if self.transposed:
            return _sparse.deconv_output_size(
                spatial_shape, self.kernel_size, self.stride, self.padding, self.dilation,
                self.output_padding,
            )  # fmt: skip
        return _sparse.conv_output_size(
            spatial_shape, self.kernel_size, self.stride, self.padding, self.dilation
        )

    def _rulebook(self, x: SparseConvTensor):
        """(out indices, rule book IndiceData, out spatial shape, the new indice_dict)."""
        indice_dict = dict(x.indice_dict)
        key = self.indice_key
        datas = x.find_indice_pair(key)
        if self.inverse:
            if datas is None:
                raise ValueError(
                    f"inverse conv with indice_key {key!r}: no rule book of that key in the "
                    "input (run the SparseConv3d / SparseMaxPool3d with this key first)"
                )
            if datas.is_subm:
                raise ValueError(
                    f"inverse conv with indice_key {key!r}: that rule book is a SubM layer's; "
                    "inverse conv inverts strided conv and pool layers only"
                )
            if list(datas.ksize) != self.kernel_size:
                raise ValueError(
                    f"inverse conv with indice_key {key!r} must have the kernel size of its "
                    f"conv, expect {datas.ksize}, this layer {self.kernel_size}"
                )
            if x.spatial_shape != datas.out_spatial_shape:
                raise ValueError(
                    f"inverse conv with indice_key {key!r}: input spatial shape "
                    f"{x.spatial_shape} is not the output shape {datas.out_spatial_shape} of "
                    "the conv it inverts"
                )
            if x.indices.shape[0] != datas.out_indices.shape[0]:
                raise ValueError(
                    f"inverse conv with indice_key {key!r}: input has {x.indices.shape[0]} "
                    f"rows, the conv it inverts produced {datas.out_indices.shape[0]}"
                )
            return datas.indices, datas, datas.spatial_shape, indice_dict
        if datas is not None:
            if not self.subm:
                raise ValueError(
                    f"indice_key {key!r} already exists in this sparse tensor: only SubM "
                    "layers reuse a rule book (give this layer its own key)"
                )
            if not datas.is_subm:
                raise ValueError(f"indice_key {key!r} holds a strided layer's rule book")
            if list(datas.ksize) != self.kernel_size or list(datas.dilation) != self.dilation:
                raise ValueError(
                    f"subm with same indice_key must have same kernel size and dilation, "
                    f"expect {datas.ksize} / {datas.dilation}, this layer {self.kernel_size} / "
                    f"{self.dilation}"
                )
            if x.spatial_shape != datas.spatial_shape or (
                x.indices.shape[0] != datas.indices.shape[0]
            ):
                raise ValueError(
                    f"subm with same indice_key {key!r} must have the same sites: expect "
                    f"{datas.indices.shape[0]} rows in {datas.spatial_shape}, input "
                    f"{x.indices.shape[0]} rows in {x.spatial_shape}"
                )
            return datas.out_indices, datas, x.spatial_shape, indice_dict
        out_shape = self._out_spatial_shape(x.spatial_shape)
        padding = subm_padding(self.kernel_size, self.dilation) if self.subm else self.padding
        rb = sparse_rulebook(
            x.indices, x.batch_size, x.spatial_shape, self.kernel_size, self.stride, padding,
            self.dilation, self.output_padding, self.subm, self.transposed, backend=self.backend,
        )  # fmt: skip
        out_indices = x.indices if self.subm else rb.out_indices
        datas = IndiceData(
            out_indices, x.indices, rb.indice_pairs, rb.indice_pair_num, x.spatial_shape,
            out_shape, is_subm=self.subm, algo=self.algo, ksize=self.kernel_size,
            stride=self.stride, dilation=self.dilation, padding=padding,
        )  # fmt: skip
        if key is not None:
            indice_dict[key] = datas
        return out_indices, datas, out_shape, indice_dict

    def forward(self, input: SparseConvTensor, add_input: SparseConvTensor | None = None):
        x = check_input(input, type(self).__name__)
        features = x.features
        if features.shape[1] != self.in_channels:
            raise ValueError(
                f"{type(self).__name__}: input.features has {features.shape[1]} channels, "
                f"in_channels is {self.in_channels}"
            )
        weight = self.weight if self.weight.dtype == features.dtype else self.weight.to(features)
        bias = self.bias
        if bias is not None and bias.dtype != features.dtype:
            bias = bias.to(features)
        if self.conv1x1:
            out = torch.mm(features, weight.reshape(self.out_channels, self.in_channels).t())
            if bias is not None:
                out = out + bias
            result = x.replace_feature(out)
            result.spatial_shape = self._out_spatial_shape(x.spatial_shape)
            return self._add(result, add_input)
        out_indices, datas, out_shape, indice_dict = self._rulebook(x)
        out = sparse_conv(
            features,
            _weights.to_gemm(weight),
            datas.indice_pairs,
            datas.indice_pair_num,
            out_indices.shape[0],
            self.inverse,
            backend=self.backend,
        )
        if bias is not None:
            out = out + bias
        if hasattr(self, _MAX_VOXELS):
            buf = getattr(self, _MAX_VOXELS)
            buf.fill_(max(int(buf.max()), out_indices.shape[0]))
        result = x.derive(out, out_indices, list(out_shape), indice_dict)
        return self._add(result, add_input)

    @staticmethod
    def _add(result, add_input):
        if add_input is None:
            return result
        return result.replace_feature(result.features + add_input.features)


def _make(kind: str, ndim: int):
    """The spconv subclass `kind` for ndim spatial axes (spconv's constructor signatures)."""
    if kind == "inverse":

        def __init__(
            self, in_channels, out_channels, kernel_size, indice_key=None, bias=True,
            algo=None, fp32_accum=None, large_kernel_fast_algo=False, name=None,
        ):  # fmt: skip
            SparseConvolution.__init__(
                self, ndim, in_channels, out_channels, kernel_size, bias=bias, inverse=True,
                indice_key=indice_key, algo=algo, fp32_accum=fp32_accum, name=name,
                large_kernel_fast_algo=large_kernel_fast_algo,
            )  # fmt: skip

    elif kind == "subm":  # spconv 2.3: no record_voxel_count

        def __init__(
            self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
            groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
            large_kernel_fast_algo=False, name=None,
        ):  # fmt: skip
            SparseConvolution.__init__(
                self, ndim, in_channels, out_channels, kernel_size, stride, padding, dilation,
                groups, bias, subm=True, indice_key=indice_key, algo=algo,
                fp32_accum=fp32_accum, name=name, large_kernel_fast_algo=large_kernel_fast_algo,
            )  # fmt: skip

    else:

        def __init__(
            self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
            groups=1, bias=True, indice_key=None, algo=None, fp32_accum=None,
            record_voxel_count=False, large_kernel_fast_algo=False, name=None,
        ):  # fmt: skip
            SparseConvolution.__init__(
                self, ndim, in_channels, out_channels, kernel_size, stride, padding, dilation,
                groups, bias, transposed=kind == "transpose", indice_key=indice_key, algo=algo,
                fp32_accum=fp32_accum, record_voxel_count=record_voxel_count, name=name,
                large_kernel_fast_algo=large_kernel_fast_algo,
            )  # fmt: skip

    names = {
        "subm": "SubMConv",
        "conv": "SparseConv",
        "transpose": "SparseConvTranspose",
        "inverse": "SparseInverseConv",
    }
    cls = type(f"{names[kind]}{ndim}d", (SparseConvolution,), {"__init__": __init__})
    cls.__module__ = __name__
    cls.__doc__ = (
        f"spconv 2.x `{cls.__name__}`: "
        + {
            "subm": "submanifold conv (outputs = the input sites, in input order).",
            "conv": "strided sparse conv (outputs = every site an input reaches, ascending "
            "(b, z, y, x)).",
            "transpose": "transposed sparse conv (outputs = every site an input reaches).",
            "inverse": "inverse of the strided conv / pool with `indice_key` (restores its input "
            "sites).",
        }[kind]
    )
    return cls


SubMConv1d = _make("subm", 1)
SubMConv2d = _make("subm", 2)
SubMConv3d = _make("subm", 3)
SubMConv4d = _make("subm", 4)
SparseConv1d = _make("conv", 1)
SparseConv2d = _make("conv", 2)
SparseConv3d = _make("conv", 3)
SparseConv4d = _make("conv", 4)
SparseConvTranspose1d = _make("transpose", 1)
SparseConvTranspose2d = _make("transpose", 2)
SparseConvTranspose3d = _make("transpose", 3)
SparseConvTranspose4d = _make("transpose", 4)
SparseInverseConv1d = _make("inverse", 1)
SparseInverseConv2d = _make("inverse", 2)
SparseInverseConv3d = _make("inverse", 3)
SparseInverseConv4d = _make("inverse", 4)

DEFAULT_SPARSE_CONV_TYPES = {
    SubMConv1d, SubMConv2d, SubMConv3d, SubMConv4d, SparseConv1d, SparseConv2d, SparseConv3d,
    SparseConv4d, SparseInverseConv1d, SparseInverseConv2d, SparseInverseConv3d,
    SparseInverseConv4d, SparseConvTranspose1d, SparseConvTranspose2d, SparseConvTranspose3d,
    SparseConvTranspose4d,
}  # fmt: skip
