"""spconv 2.x compatible sparse convolution: `import mu_space.sparse as spconv` in model code.

    SparseConvTensor(features, indices, spatial_shape, batch_size)   .dense() .replace_feature()
    SubMConv{1,2,3,4}d, SparseConv{1,2,3,4}d, SparseConvTranspose{1,2,3,4}d,
    SparseInverseConv{1,2,3,4}d, SparseMaxPool{1,2,3,4}d, SparseSequential, ToDense, RemoveGrid,
    SparseModule, SparseBatchNorm, SparseReLU, SparseIdentity, JoinTable, AddTable, ConcatTable,
    ConvAlgo, IndiceData

Constructor arguments, `indice_key` reuse and the weight layout ([C_out, *kernel, C_in]) are
spconv 2.x's; older checkpoints (spconv 1.x / mmcv [*kernel, C_in, C_out]) load through
`mu_space.sparse.weights`; mmcv's `_ext` sparse functions are `mu_space.sparse.mmcv_ext`.
The layers run mu_space.ops.sparse_rulebook / sparse_conv / sparse_maxpool
(docs/operators/sparse_conv.md).
"""

from mu_space.sparse import mmcv_ext, weights
from mu_space.sparse.conv import (
    DEFAULT_SPARSE_CONV_TYPES,
    SparseConv1d,
    SparseConv2d,
    SparseConv3d,
    SparseConv4d,
    SparseConvolution,
    SparseConvTranspose1d,
    SparseConvTranspose2d,
    SparseConvTranspose3d,
    SparseConvTranspose4d,
    SparseInverseConv1d,
    SparseInverseConv2d,
    SparseInverseConv3d,
    SparseInverseConv4d,
    SubMConv1d,
    SubMConv2d,
    SubMConv3d,
    SubMConv4d,
)
from mu_space.sparse.core import ConvAlgo, IndiceData, SparseConvTensor, expand_nd, scatter_nd
from mu_space.sparse.modules import (
    RemoveGrid,
    SparseBatchNorm,
    SparseIdentity,
    SparseModule,
    SparseReLU,
    SparseSequential,
    SparseSyncBatchNorm,
    ToDense,
    assign_name_for_sparse_modules,
    is_sparse_conv,
    is_spconv_module,
)
from mu_space.sparse.pool import (
    SparseMaxPool,
    SparseMaxPool1d,
    SparseMaxPool2d,
    SparseMaxPool3d,
    SparseMaxPool4d,
)
from mu_space.sparse.tables import AddTable, ConcatTable, JoinTable

Identity = SparseIdentity

__all__ = [
    "DEFAULT_SPARSE_CONV_TYPES", "AddTable", "ConcatTable", "ConvAlgo", "Identity", "IndiceData",
    "JoinTable", "RemoveGrid", "SparseBatchNorm", "SparseConv1d", "SparseConv2d", "SparseConv3d",
    "SparseConv4d", "SparseConvTensor", "SparseConvTranspose1d", "SparseConvTranspose2d",
    "SparseConvTranspose3d", "SparseConvTranspose4d", "SparseConvolution", "SparseIdentity",
    "SparseInverseConv1d", "SparseInverseConv2d", "SparseInverseConv3d", "SparseInverseConv4d",
    "SparseMaxPool", "SparseMaxPool1d", "SparseMaxPool2d", "SparseMaxPool3d", "SparseMaxPool4d",
    "SparseModule", "SparseReLU", "SparseSequential", "SparseSyncBatchNorm", "SubMConv1d",
    "SubMConv2d", "SubMConv3d", "SubMConv4d", "ToDense", "assign_name_for_sparse_modules",
    "expand_nd", "is_sparse_conv", "is_spconv_module", "mmcv_ext", "scatter_nd", "weights",
]  # fmt: skip
