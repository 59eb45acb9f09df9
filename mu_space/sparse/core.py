"""`SparseConvTensor` and the rule-book record `IndiceData` (spconv 2.x `spconv.pytorch.core`).

A sparse tensor is `features` [N, C] at the active sites `indices` [N, ndim + 1] int32 (batch,
spatial...) of a `batch_size` x `spatial_shape` grid. Layers store the rule books they build in
`indice_dict` under their `indice_key`, so later layers reuse them (docs/operators/sparse_conv.md).
"""

from __future__ import annotations

import enum
import math

import torch

from mu_space.ops import _sparse
from mu_space.ops._checks import dtype_name


class ConvAlgo(enum.Enum):
    """spconv's algorithm choice. Accepted for compatibility; every layer here runs the rule-book
    (gather -> GEMM -> scatter) path, spconv's `Native`."""

    Native = 0
    MaskImplicitGemm = 1
    MaskSplitImplicitGemm = 2


def expand_nd(ndim: int, value, name: str = "value") -> list[int]:
    """spconv's expand_nd: an int repeated ndim times, or a sequence of ndim ints, as a list."""
    return _sparse.expand_nd(ndim, value, name)


class IndiceData:
    """One rule book (spconv 2.x `IndiceData`): out_indices [M, ndim + 1] int32, the input
    indices it was built from, indice_pairs [K, 2, N] int32 (mmcv's layout: per offset (input
    row, output row) pairs, -1 padded), indice_pair_num [K] int32, the input and output spatial
    shapes and the layer geometry that built it."""

    def __init__(
        self, out_indices, indices, indice_pairs, indice_pair_num, spatial_shape,
        out_spatial_shape, is_subm: bool, algo=ConvAlgo.Native, ksize=None, stride=None,
        dilation=None, padding=None, voxel_num=None,
    ):  # fmt: skip
        self.out_indices = out_indices
        self.indices = indices
        self.indice_pairs = indice_pairs
        self.indice_pair_num = indice_pair_num
        self.spatial_shape = list(spatial_shape)
        self.out_spatial_shape = list(out_spatial_shape)
        self.is_subm = is_subm
        self.algo = algo
        self.ksize = ksize
        self.stride = stride
        self.dilation = dilation
        self.padding = padding
        self.voxel_num = voxel_num

    def __repr__(self):
        return (
            f"IndiceData(in={self.indices.shape[0]}, out={self.out_indices.shape[0]}, "
            f"K={self.indice_pairs.shape[0]}, subm={self.is_subm}, ksize={self.ksize})"
        )


def scatter_nd(indices: torch.Tensor, updates: torch.Tensor, shape) -> torch.Tensor:
    """spconv's scatter_nd: zeros of `shape` with updates written at the rows of `indices`
    (differentiable w.r.t. updates). Duplicate rows: one of the updates is kept (unspecified
    which; the conv layers reject duplicates)."""
    shape = list(shape)
    ndim = indices.shape[-1]
    ret = updates.new_zeros(shape)
    flat = indices.reshape(-1, ndim).long()
    values = updates.reshape(-1, *shape[ndim:])
    return ret.index_put(tuple(flat[:, i] for i in range(ndim)), values)


class SparseConvTensor:
    """spconv 2.x `SparseConvTensor(features, indices, spatial_shape, batch_size)`.

    Args:
        features: Tensor[N, C] (floating point).
        indices: Tensor[N, ndim + 1] int32, rows (batch, z, y, x) (2-D: (batch, y, x)).
        spatial_shape: ndim ints, e.g. [41, 1600, 1408] (z, y, x).
        batch_size: int >= 1.
        grid, voxel_num, benchmark, permanent_thrust_allocator, enable_timer, force_algo:
            accepted for compatibility (no effect here).

    Values (negative entries, rows outside the grid, batch ids >= batch_size, duplicate sites)
    are checked when a layer builds its rule book (one reduction), not here."""

    def __init__(
        self, features, indices, spatial_shape, batch_size, grid=None, voxel_num=None,
        indice_dict=None, benchmark=False, permanent_thrust_allocator=False,
        enable_timer=False, force_algo=None,
    ):  # fmt: skip
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}")
        if features.dim() != 2:
            raise ValueError(f"features must be 2-D [N, C], got shape {tuple(features.shape)}")
        ndim = _sparse.check_indices(indices)
        if indices.shape[0] != features.shape[0]:
            raise ValueError(
                f"indices has {indices.shape[0]} rows but features has {features.shape[0]}"
            )
        self._features = features
        self.indices = indices
        self.spatial_shape = _sparse.spatial_shape_arg(spatial_shape, ndim)
        self.batch_size = _sparse.as_int(batch_size, "batch_size", 1)
        self.indice_dict = {} if indice_dict is None else indice_dict
        self.grid = torch.Tensor() if grid is None else grid
        self.voxel_num = voxel_num
        self.benchmark = benchmark
        self.benchmark_record: dict = {}
        self.thrust_allocator = None
        self._timer = None
        self.force_algo = force_algo
        self.int8_scale = None

    def __repr__(self):
        return (
            f"SparseConvTensor[shape={tuple(self._features.shape)}, "
            f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}]"
        )

    @property
    def features(self) -> torch.Tensor:
        return self._features

    @features.setter
    def features(self, value):
        raise ValueError(
            "you can't set features directly, use 'x = x.replace_feature(new_features)' "
            "(spconv 2.x)"
        )

    @property
    def is_quantized(self) -> bool:
        return self._features.dtype == torch.qint8

    @property
    def spatial_size(self) -> int:
        return math.prod(self.spatial_shape)

    def replace_feature(self, feature: torch.Tensor) -> SparseConvTensor:
        """A new tensor with these indices, shapes and rule books and `feature` as features."""
        return self.derive(feature)

    def derive(self, feature, indices=None, spatial_shape=None, indice_dict=None):
        """A new tensor of this batch: `feature` at `indices` (default: these) in
        `spatial_shape` with `indice_dict` (the layers' outputs)."""
        new = SparseConvTensor(
            feature,
            self.indices if indices is None else indices,
            self.spatial_shape if spatial_shape is None else spatial_shape,
            self.batch_size,
            self.grid,
            self.voxel_num,
            self.indice_dict if indice_dict is None else indice_dict,
        )
        new.benchmark = self.benchmark
        new.benchmark_record = self.benchmark_record
        new.thrust_allocator = self.thrust_allocator
        new._timer = self._timer
        new.force_algo = self.force_algo
        new.int8_scale = self.int8_scale
        return new

    def shadow_copy(self) -> SparseConvTensor:
        return self.replace_feature(self._features)

    def minus(self) -> SparseConvTensor:
        return self.replace_feature(-self._features)

    def find_indice_pair(self, key) -> IndiceData | None:
        if key is None:
            return None
        return self.indice_dict.get(key)

    def dense(self, channels_first: bool = True) -> torch.Tensor:
        """The dense tensor: [B, C, *spatial_shape] (channels_first) or [B, *spatial_shape, C];
        zeros at inactive sites. Differentiable w.r.t. features."""
        c = self._features.shape[1]
        out = scatter_nd(
            self.indices.to(self._features.device),
            self._features,
            [self.batch_size, *self.spatial_shape, c],
        )
        if not channels_first:
            return out
        ndim = len(self.spatial_shape)
        return out.permute(0, ndim + 1, *range(1, ndim + 1)).contiguous()

    @classmethod
    def from_dense(cls, x: torch.Tensor) -> SparseConvTensor:
        """From a channel-last dense tensor [B, *spatial, C]: the sites with a nonzero channel."""
        sp = x.to_sparse(x.dim() - 1)
        indices = sp.indices().t().contiguous().to(torch.int32)
        return cls(sp.values(), indices, list(x.shape[1:-1]), x.shape[0])

    def _other_features(self, other) -> torch.Tensor:
        if isinstance(other, SparseConvTensor):
            return other.features
        if isinstance(other, torch.Tensor):
            return other
        raise TypeError(
            f"can only add a SparseConvTensor or a torch.Tensor, got {type(other).__name__}"
        )

    def __add__(self, other):
        return self.replace_feature(self._features + self._other_features(other))

    __radd__ = __add__

    def __iadd__(self, other):
        self._features = self._features + self._other_features(other)
        return self


def check_input(x, what: str) -> SparseConvTensor:
    if not isinstance(x, SparseConvTensor):
        raise TypeError(f"{what} takes a SparseConvTensor, got {type(x).__name__}")
    if not x.features.is_floating_point():
        raise TypeError(
            f"{what}: input.features must be floating point, got {dtype_name(x.features.dtype)}"
        )
    return x
