"""`bev_pool_rows`: weight-1 pooling of feat[n, C] rows into given flat cells, the native core of
BEVFusion's `bev_pool` and of `bev_pool_v3`'s v1 mode (an internal primitive: not in the operator
matrix).

One custom op whose inside is a sort (torch.sort + bev_pool_runs_from_sorted, padded, no host
sync; or sort_by_cell's counting sort) + bev_pool_v2 without depth, so torch.compile sees a
fixed output shape and no data-dependent sizes (an autograd.Function around the sort cannot be
traced: its unbacked sizes would escape). Backward: every point has exactly one cell, so the
gradient is a row gather: natively grad_out goes channels-last in one tile transpose and a gather
writes grad_feat once, in row order (csrc/bev/bev_pool_musa.mu); the reference is the same in
PyTorch (`_bev.row_gather_grad`). bev_pool_v2's general backward would zero a float32 buffer and
scatter into it with atomics, or re-sort the points by ranks_feat.
"""

from __future__ import annotations

import os

import torch

from mu_space.ops import _bev, _opdef
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.runtime import native

_ENTRY_POINTS = (
    "sort_by_cell_forward",
    "bev_pool_sort_workspace_ints",
    "bev_pool_v2_forward",
    "bev_pool_rows_backward",
    "bev_pool_runs_workspace_ints",
    "bev_pool_runs_from_sorted",
)


def _check(feat, cells, grid) -> _opdef.Checked:
    g = _bev.bev_feat_shape(grid, "grid")
    _bev.check_floating(feat, "feat")
    if feat.dim() != 2 or feat.shape[1] != g.C:
        raise ValueError(f"feat must be [n, C] with C = grid[4] = {g.C}, got {tuple(feat.shape)}")
    check_tensor(cells, "cells")
    check_same_device(cells, "cells", feat)
    if cells.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cells must be int32 or int64, got {dtype_name(cells.dtype)}")
    if cells.dim() != 1 or cells.shape[0] != feat.shape[0]:
        raise ValueError(f"cells must be [n] = [{feat.shape[0]}], got {tuple(cells.shape)}")
    B, Z, Y, X, C = g
    return _opdef.Checked(feat.device, feat.dtype, (((B, C, Z, Y, X), feat.dtype),), g, "feat")


def _supports(c: _opdef.Checked) -> str | None:
    if c.info.n_cells > (limit := native.limit("bev_pool_v2.max_cells")):
        return f"B*Z*Y*X = {c.info.n_cells} cells do not fit the native kernels' {limit}"
    return None


def bev_pool_rows_reference(feat, cells, grid) -> torch.Tensor:
    return _bev.pool_reference(None, feat, None, None, cells, _check(feat, cells, grid).info)


# MUSPACE_BEV_POOL_ROWS_SORT=counting (profiling): sort_by_cell's counting sort instead of the
# radix sort + runs step
_SORT_KNOB = "MUSPACE_BEV_POOL_ROWS_SORT"


def _forward_native(c, feat, cells, grid) -> torch.Tensor:
    g = c.info
    if feat.shape[0] == 0 or g.C == 0 or g.n_cells == 0:
        return _bev.pool_reference(None, feat, None, None, cells, g)
    if _bev.native_steps_allowed() and os.environ.get(_SORT_KNOB) != "counting":
        return _bev.pool_rows_by_sorted_runs(feat, cells, g)
    return _bev.pool_by_sorting(None, feat, None, None, cells, g, "native")


def _row_gather(grad_out, feat, cells, grid):
    return (_bev.row_gather_grad(grad_out, cells, _bev.bev_feat_shape(grid, "grid")),)


def _native_row_gather(c, grad_out, feat, cells, grid, *, needs, deterministic):
    if grad_out.numel() == 0 or feat.numel() == 0 or not _bev.native_steps_allowed():
        return (_bev.row_gather_grad(grad_out, cells, c.info),)
    return (_bev.native_steps()[1](grad_out, cells, c.info),)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    g = torch.Generator().manual_seed(3)
    feat = torch.randn(500, 6, generator=g).to(device)
    cells = torch.randint(-20, 130, (500,), generator=g, dtype=torch.int32).to(device)
    return [
        _opdef.Sample(
            "500 rows, 120 cells, out-of-range dropped", (feat, cells, (2, 1, 6, 10, 6)), grad=True
        ),
        _opdef.Sample("no rows", (feat[:0], cells[:0], (2, 1, 6, 10, 6))),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="bev_pool_rows",
        family="bev",
        schema="(Tensor feat, Tensor cells, int[] grid) -> Tensor",
        check=_check,
        reference=bev_pool_rows_reference,
        native=_forward_native,
        backward=_opdef.Backward(
            inputs=("feat",), reference=_row_gather, native=_native_row_gather
        ),
        supports=_supports,
        native_dtypes=(torch.float32, torch.float16, torch.bfloat16),
        entry_points=_ENTRY_POINTS,
        samples=_samples,
        public=False,
    )
)


@OP.export
def bev_pool_rows(feat: torch.Tensor, cells: torch.Tensor, grid, *, backend: str = "auto"):
    """Weight-1 pooling of rows into flat cells -> Tensor[B, C, Z, Y, X] (grid = (B, Z, Y, X, C)):

        out[b, c, z, y, x] = sum over rows i with cells[i] == ((b*Z + z)*Y + y)*X + x of feat[i, c]

    feat: Tensor[n, C] floating; cells: Tensor[n] int32 / int64, entries outside [0, B*Z*Y*X)
    dropped. float32 accumulation, output in feat's dtype; deterministic forward and backward.
    """
    return OP(feat, cells, list(_bev.bev_feat_shape(grid, "grid")), backend=backend)


def sort_cells(cells: torch.Tensor, n_cells: int, *, pad: bool = True) -> _bev.SortedRuns:
    """bev_pool_rows' native sort step alone (GPU tensors, the native library; for benchmarks):
    torch.sort of int32 cell keys + bev_pool_runs_from_sorted -> SortedRuns(order, ranks_bev,
    interval_starts, interval_lengths), padded tails without a host sync where n + n_cells
    <= 2**31 (`pad`), else exact sizes after one."""
    return _bev.native_steps()[2](cells, n_cells, pad=pad)
