"""`bev_pool`: BEVFusion's BEV pooling of lifted frustum features (drop-in for
`mmdet3d.ops.bev_pool.bev_pool`).

    out[b, c, d, h, w] = sum over points i with coords[i] == (h, w, d, b) of feats[i, c]

    feats    Tensor[n, C]  float32 / float16 / bfloat16 (float64 on the reference path): the
             already multiplied frustum features (depth x image feature), one row per point
    coords   Tensor[n, 4]  int32 / int64, columns (x, y, z, batch) as BEVFusion builds them:
             x indexes H, y indexes W, z indexes D (BEVFusion calls
             bev_pool(x, geom, B, nx[2], nx[0], nx[1]), i.e. D = z cells, H = x cells, W = y cells)
    B, D, H, W  ints (or 0-d integer tensors, as BEVFusion passes `self.nx[i]`)
    returns  Tensor[B, C, D, H, W] in feats' dtype (float32 accumulation); cells without
             points are 0

Upstream sorts the points by cell (torch argsort), cuts intervals (torch.where: a host sync) and
sums each interval in a CUDA kernel, float32 only. Here the sorting and intervals are done
inside too, on the GPU:

    cell = ((b*D + z)*H + x)*W + y       (-1 when any coordinate is outside its dimension)
    order, starts, lengths = bev_pool_prepare.sort_by_cell(cell, B*D*H*W)   (deterministic)
    bev_pool_v2(None, feats, None, order, cell[order], (B, D, H, W, C), starts, lengths)

which is DrivingSDK's `bev_pool_v3` v1 mode, and shares its code (`bev_pool_v3.py`).

Differences from upstream (docs/operators/bev_pool.md):
- out-of-range coords: upstream writes out of bounds (undefined behaviour, or a crash);
  here a point with any coordinate outside [0, dim) is dropped (contributes nothing, grad 0);
- float16 / bfloat16 inputs (float32 accumulation, output in the input dtype);
- deterministic forward and backward: each point has exactly one cell, so the backward is a
  row gather of the (channels-last) output gradient, in PyTorch: no atomics, no sort;
- the sort's data-dependent interval count synchronises with the host once per forward, like
  upstream's `torch.where`.
Backward: grad for feats (coords are integer).
"""

from __future__ import annotations

import torch

from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops.bev_pool_v3 import (
    _ROWS_ENTRY_POINTS,
    Grid,
    _as_int,
    _check_floating,
    _coords_to_cells,
    _pool_reference,
    _pool_rows_native,
    _use_native,
)
from mu_space.runtime import registry

OP = "bev_pool"


def _check(feats, coords, B, D, H, W) -> Grid:
    dims = tuple(_as_int(v, name) for v, name in ((B, "B"), (D, "D"), (H, "H"), (W, "W")))
    _check_floating(feats, "feats")
    if feats.dim() != 2:
        raise ValueError(f"feats must be 2-D [n, C], got {feats.dim()}-D")
    check_tensor(coords, "coords")
    check_same_device(coords, "coords", feats, "feats")
    if coords.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"coords must be int32 or int64, got {dtype_name(coords.dtype)}")
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must be [n, 4] (x, y, z, batch), got shape {tuple(coords.shape)}")
    if coords.shape[0] != feats.shape[0]:
        raise ValueError(
            f"coords.shape[0] must be {feats.shape[0]} (the rows of feats), got {coords.shape[0]}"
        )
    b, d, h, w = dims
    return Grid(b, d, h, w, feats.shape[1])


def bev_pool_reference(feats, coords, B, D, H, W) -> torch.Tensor:
    """PyTorch reference of `bev_pool` (index_add over the flat cells; CPU or GPU; float64)."""
    grid = _check(feats, coords, B, D, H, W)
    cells = _coords_to_cells(coords, grid[:4])
    return _pool_reference(None, feats, None, None, cells, grid)


def bev_pool(feats, coords, B, D, H, W, *, backend: str = "auto") -> torch.Tensor:
    """BEVFusion `bev_pool(feats[n, C], coords[n, 4], B, D, H, W)` -> Tensor[B, C, D, H, W].

    See the module docstring for the semantics and what differs from upstream (out-of-range
    points are dropped; fp16/bf16; deterministic). Backward gives grad for feats.
    """
    grid = _check(feats, coords, B, D, H, W)
    cells = _coords_to_cells(coords, grid[:4])
    if _use_native(OP, backend, feats, grid, feats.shape[0]):
        return _pool_rows_native(feats, cells, grid, backend)
    return _pool_reference(None, feats, None, None, cells, grid)


def _self_check_cases(device: torch.device) -> list[registry.SelfCheckCase]:
    from mu_space.testing import bev_pool_inputs

    cases = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        a = bev_pool_inputs.bevfusion_inputs("tiny", batch=2, dtype=dtype, device=device)
        cases.append(
            registry.SelfCheckCase(
                f"tiny B=2 {dtype_name(dtype)}",
                (a["feats"], a["coords"], a["B"], a["D"], a["H"], a["W"]),
                atol=tol,
                rtol=tol,
                backward=dtype == torch.float32,
            )
        )
    a = bev_pool_inputs.bevfusion_inputs("tiny", device=device, keep_out_of_range=True)
    cases.append(
        registry.SelfCheckCase(
            "tiny, out-of-range coords dropped",
            (a["feats"], a["coords"].int(), a["B"], a["D"], a["H"], a["W"]),
            atol=1e-5,
            rtol=1e-5,
            backward=True,
        )
    )
    return cases


registry.register(
    registry.OperatorSpec(
        name=OP,
        family="bev",
        api=bev_pool,
        reference=bev_pool_reference,
        native_entry_points=_ROWS_ENTRY_POINTS,
        self_check_cases=_self_check_cases,
        dtypes=("float32", "float16", "bfloat16"),
        backward="native",
        upstream="BEVFusion bev_pool",
        models="BEVFusion (camera branch), DepthLSS-style transforms",
        patches=("bevfusion.bev_pool",),
        recipes=("model_examples/BEVFusion",),
        doc="docs/operators/bev_pool.md",
    )
)
