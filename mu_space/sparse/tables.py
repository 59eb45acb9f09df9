"""spconv 2.x `spconv.pytorch.tables`: JoinTable, AddTable, ConcatTable."""

from __future__ import annotations

import torch

from mu_space.sparse.core import SparseConvTensor
from mu_space.sparse.modules import SparseModule


def _like(first: SparseConvTensor, features: torch.Tensor) -> SparseConvTensor:
    return first.replace_feature(features)


class JoinTable(SparseModule):
    """Concatenate the features of tensors on the same sites (channels)."""

    def forward(self, input: list):
        return _like(input[0], torch.cat([x.features for x in input], 1))


class AddTable(SparseModule):
    """Sum the features of tensors on the same sites."""

    def forward(self, input: list):
        return _like(input[0], sum(x.features for x in input))


class ConcatTable(SparseModule):
    """Apply every child module to the input: a list of results."""

    def forward(self, input):
        return [module(input) for module in self._modules.values()]

    def add(self, module):
        self._modules[str(len(self._modules))] = module
        return self
