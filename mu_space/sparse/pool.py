"""spconv 2.x `SparseMaxPool{1,2,3,4}d(kernel_size, stride=None, padding=0, dilation=1,
indice_key=None, algo=None, record_voxel_count=False, name=None)`: max over each output's rule-book inputs
(mu_space.ops.sparse_rulebook + mu_space.ops.sparse_maxpool). The maximum starts at -inf (the
true maximum; spconv's native path floors it at 0: docs/operators/sparse_conv.md). A pool with
an indice_key stores its rule book, so a SparseInverseConv with that key can undo it."""

from __future__ import annotations

import torch

from mu_space.ops import _sparse
from mu_space.ops.sparse_maxpool import sparse_maxpool
from mu_space.ops.sparse_rulebook import sparse_rulebook
from mu_space.sparse.conv import _MAX_VOXELS, subm_padding
from mu_space.sparse.core import ConvAlgo, IndiceData, SparseConvTensor, check_input
from mu_space.sparse.modules import SparseModule


class SparseMaxPool(SparseModule):
    """`backend` (class attribute, "auto"): passed to sparse_rulebook / sparse_maxpool."""

    backend = "auto"

    def __init__(
        self, ndim, kernel_size=3, stride=1, padding=0, dilation=1, indice_key=None,
        subm=False, algo=None, record_voxel_count=False, name=None,
    ):  # fmt: skip
        super().__init__(name=name)
        self.ndim = _sparse.as_int(ndim, "ndim", 1, _sparse.MAX_NDIM)
        self.kernel_size = _sparse.int_list(kernel_size, "kernel_size", self.ndim, 1)
        self.stride = (
            list(self.kernel_size)
            if stride is None
            else _sparse.int_list(stride, "stride", self.ndim, 1)
        )
        self.padding = _sparse.int_list(padding, "padding", self.ndim, 0)
        self.dilation = _sparse.int_list(dilation, "dilation", self.ndim, 1)
        self.subm = bool(subm)
        self.indice_key = indice_key
        self.algo = ConvAlgo.Native if algo is None else algo
        self.record_voxel_count = record_voxel_count
        if record_voxel_count and not self.subm:  # spconv 2.3: the largest output count seen
            self.register_buffer(_MAX_VOXELS, torch.zeros(1, dtype=torch.int32))

    def get_max_num_voxels(self):
        return getattr(self, _MAX_VOXELS, None)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"

    def forward(self, input: SparseConvTensor) -> SparseConvTensor:
        x = check_input(input, type(self).__name__)
        if self.subm:
            out_shape = list(x.spatial_shape)
            padding = subm_padding(self.kernel_size, self.dilation)
        else:
            out_shape = _sparse.conv_output_size(
                x.spatial_shape, self.kernel_size, self.stride, self.padding, self.dilation
            )
            padding = self.padding
        rb = sparse_rulebook(
            x.indices, x.batch_size, x.spatial_shape, self.kernel_size, self.stride, padding,
            self.dilation, 0, self.subm, False, backend=self.backend,
        )  # fmt: skip
        out_indices = x.indices if self.subm else rb.out_indices
        indice_dict = dict(x.indice_dict)
        if self.indice_key is not None:
            if self.indice_key in indice_dict:
                raise ValueError(f"indice_key {self.indice_key!r} already exists")
            indice_dict[self.indice_key] = IndiceData(
                out_indices, x.indices, rb.indice_pairs, rb.indice_pair_num, x.spatial_shape,
                out_shape, is_subm=self.subm, algo=self.algo, ksize=self.kernel_size,
                stride=self.stride, dilation=self.dilation, padding=padding,
            )  # fmt: skip
        out = sparse_maxpool(
            x.features, rb.indice_pairs, rb.indice_pair_num, out_indices.shape[0],
            backend=self.backend,
        )  # fmt: skip
        if hasattr(self, _MAX_VOXELS):
            buf = getattr(self, _MAX_VOXELS)
            buf.fill_(max(int(buf.max()), out_indices.shape[0]))
        result = x.derive(out, out_indices, list(out_shape), indice_dict)
        return result


def _make(ndim: int):
    def __init__(
        self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None, algo=None,
        record_voxel_count=False, name=None,
    ):  # fmt: skip
        SparseMaxPool.__init__(
            self, ndim, kernel_size, stride, padding, dilation, indice_key=indice_key,
            algo=algo, record_voxel_count=record_voxel_count, name=name,
        )  # fmt: skip

    cls = type(f"SparseMaxPool{ndim}d", (SparseMaxPool,), {"__init__": __init__})
    cls.__module__ = __name__
    cls.__doc__ = f"spconv 2.x `SparseMaxPool{ndim}d` (stride defaults to kernel_size)."
    return cls


SparseMaxPool1d = _make(1)
SparseMaxPool2d = _make(2)
SparseMaxPool3d = _make(3)
SparseMaxPool4d = _make(4)
