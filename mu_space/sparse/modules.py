"""spconv 2.x `spconv.pytorch.modules`: SparseModule, SparseSequential and the element-wise
wrappers that take a SparseConvTensor."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from mu_space.sparse.core import SparseConvTensor


class SparseModule(nn.Module):
    """Base of the layers that take a SparseConvTensor (SparseSequential passes them the whole
    tensor; other modules get its features)."""

    def __init__(self, name=None):
        super().__init__()
        self.name = name
        self._sparse_unique_name = ""


class SparseBatchNorm(nn.BatchNorm1d):
    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseSyncBatchNorm(nn.SyncBatchNorm):
    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseReLU(nn.ReLU):
    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseIdentity(nn.Identity):
    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


def is_spconv_module(module) -> bool:
    return isinstance(module, (SparseModule, SparseBatchNorm, SparseReLU, SparseIdentity))


def is_sparse_conv(module) -> bool:
    from mu_space.sparse.conv import SparseConvolution

    return isinstance(module, SparseConvolution)


def assign_name_for_sparse_modules(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, SparseModule):
            m._sparse_unique_name = name


class SparseSequential(SparseModule):
    """spconv's sequential container: sparse modules get the SparseConvTensor, any other module
    (nn.BatchNorm1d, nn.ReLU, ...) gets its features and the result replaces them (skipped when
    the tensor has no rows, as in spconv)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for idx, module in enumerate(args):
                self.add_module(str(idx), module)
        for name, module in kwargs.items():
            if name in self._modules:
                raise ValueError(f"name {name!r} exists")
            self.add_module(name, module)

    def __getitem__(self, idx):
        if not -len(self) <= idx < len(self):
            raise IndexError(f"index {idx} is out of range")
        return list(self._modules.values())[idx]

    def __len__(self):
        return len(self._modules)

    def add(self, module, name=None):
        if name is None:
            name = str(len(self._modules))
            if name in self._modules:
                raise KeyError("name exists")
        self.add_module(name, module)

    def forward(self, input):
        for module in self._modules.values():
            if is_spconv_module(module):
                input = module(input)
            elif isinstance(input, SparseConvTensor):
                if input.indices.shape[0] != 0:
                    input = input.replace_feature(module(input.features))
            else:
                input = module(input)
        return input


class ToDense(SparseModule):
    """SparseConvTensor -> dense [B, C, *spatial_shape] (spconv.pytorch.ToDense)."""

    def forward(self, x: SparseConvTensor) -> torch.Tensor:
        if not isinstance(x, SparseConvTensor):
            raise TypeError(f"ToDense takes a SparseConvTensor, got {type(x).__name__}")
        return x.dense()


class RemoveGrid(SparseModule):
    def forward(self, x: SparseConvTensor):
        x.grid = None
        return x
