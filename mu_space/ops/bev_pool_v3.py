"""`bev_pool_v3`: BEV pooling from unsorted ranks, no interval arrays (Ascend DrivingSDK API).
Formula, shapes, v1 mode and the extensions over DrivingSDK: the public function's docstring and
docs/operators/bev_pool_v3.md.

Native path: composed from two primitives, nothing new in C++ (a composite op):
`sort_by_cell` (deterministic counting sort of the cells; drops out-of-range cells) gives the
permutation and intervals, the ranks are permuted, and `bev_pool_v2` pools them (its autograd
gives the backward). In v1 mode, where each feat row has one cell, `bev_pool_rows` does the same
inside one custom op with a row-gather backward. The sort has a data-dependent output size, so
the forward synchronises with the host once (as every sort-based BEV pooling does; DrivingSDK's
atomics path avoids it at the cost of determinism).

torch.compile(fullgraph=True): the reference path has no data-dependent shapes; on the native
path the backend choice is made at trace time, v1 mode is the `bev_pool_rows` custom op (fixed
output shape) and depth mode traces sort_by_cell's custom op (data-dependent size), the
permutation and bev_pool_v2's custom op.
"""

from __future__ import annotations

import torch

from mu_space.ops import _bev, _opdef
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops.bev_pool import bev_pool_cells
from mu_space.ops.bev_pool_rows import bev_pool_rows
from mu_space.runtime import native

NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The primitives' entry points this op runs through (it has no kernel of its own).
_ENTRY_POINTS = (
    "sort_by_cell_forward",
    "bev_pool_sort_workspace_ints",
    "bev_pool_v2_forward",
    "bev_pool_v2_backward_frustum",
    "bev_pool_v2_backward",
    "bev_pool_v2_backward_feat_sorted",
)


def _check(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape) -> _opdef.Checked:
    grid = _bev.bev_feat_shape(bev_feat_shape)
    _bev.check_floating(feat, "feat")
    if feat.dim() == 0 or feat.shape[-1] != grid.C:
        raise ValueError(
            f"feat must have C = bev_feat_shape[4] = {grid.C} channels in its last "
            f"dim, got shape {tuple(feat.shape)}"
        )
    check_tensor(ranks_bev, "ranks_bev")
    check_same_device(ranks_bev, "ranks_bev", feat, "feat")
    if ranks_bev.dim() == 2:
        if ranks_bev.shape[1] != 4:
            raise ValueError(
                f"ranks_bev.shape[1] must be 4 (h, w, d, b) when 2-D, got {ranks_bev.shape[1]}"
            )
        if ranks_bev.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"ranks_bev must be int32 or int64 when 2-D, got {dtype_name(ranks_bev.dtype)}"
            )
    else:
        _bev.check_ranks(ranks_bev, "ranks_bev", feat)
        _bev.check_cells_fit_int32(grid)
    n = ranks_bev.shape[0]
    _bev.check_depth_pair(depth, ranks_depth)
    if depth is not None:
        _bev.check_depth(depth, feat)
        _bev.check_ranks(ranks_depth, "ranks_depth", feat, n)
        if ranks_feat is None:
            raise ValueError("ranks_feat must be given when depth is given")
    if ranks_feat is not None:
        _bev.check_ranks(ranks_feat, "ranks_feat", feat, n)
    elif feat.dim() != 2 or feat.shape[0] != n:
        raise ValueError(
            f"feat must be [n, C] = [{n}, {grid.C}] (one row per point) when "
            f"ranks_feat is None, got shape {tuple(feat.shape)}"
        )
    B, Z, Y, X, C = grid
    return _opdef.Checked(feat.device, feat.dtype, (((B, C, Z, Y, X), feat.dtype),), grid, "feat")


def _validate_ranks(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid: _bev.Grid) -> None:
    """validate=True: the first out-of-range index as an IndexError (synchronises)."""
    checks = []
    if ranks_bev.dim() == 2:
        limits = (grid.Y, grid.X, grid.Z, grid.B)
        checks += [
            (ranks_bev[:, k], f"ranks_bev[:, {k}]", limits[k], ("h", "w", "d", "b")[k])
            for k in range(4)
        ]
    else:
        checks.append((ranks_bev, "ranks_bev", grid.n_cells, "B*Z*Y*X"))
    if ranks_depth is not None:
        checks.append((ranks_depth, "ranks_depth", depth.numel(), "depth.numel()"))
    if ranks_feat is not None:
        checks.append((ranks_feat, "ranks_feat", _bev.feat_rows(feat), "feat.numel() / C"))
    for index, name, limit, what in checks:
        hit = _bev.first_bad_index(index, limit)
        if hit is not None:
            raise IndexError(f"{name}[{hit[0]}] = {hit[1]} is out of range [0, {limit}) ({what})")


def _cells_of(ranks_bev: torch.Tensor, grid: _bev.Grid) -> torch.Tensor:
    if ranks_bev.dim() == 2:
        return _bev.coords_to_cells(ranks_bev, (grid.B, grid.Z, grid.Y, grid.X))
    return ranks_bev


def bev_pool_v3_reference(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape):
    """PyTorch reference of `bev_pool_v3` (same arguments; CPU or GPU; float64 capable)."""
    grid = _check(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape).info
    return _bev.pool_reference(
        depth, feat, ranks_depth, ranks_feat, _cells_of(ranks_bev, grid), grid
    )


def _supports(c: _opdef.Checked) -> str | None:
    if c.info.n_cells > (limit := native.limit("bev_pool_v2.max_cells")):
        return f"B*Z*Y*X = {c.info.n_cells} cells do not fit the native kernels' {limit}"
    return None


def _forward_native(c, depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape, *, backend):
    grid = c.info
    if ranks_bev.shape[0] == 0 or grid.C == 0 or grid.n_cells == 0:
        return bev_pool_v3_reference(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid)
    if ranks_bev.dim() == 2:  # one kernel natively (bev_pool's cells step)
        cells = bev_pool_cells(ranks_bev, grid.B, grid.Z, grid.Y, grid.X, backend=backend)
    else:
        cells = ranks_bev
    if depth is None and ranks_feat is None:  # v1 mode: each feat row has one cell
        return bev_pool_rows(feat, cells, grid, backend=backend)
    return _bev.pool_by_sorting(depth, feat, ranks_depth, ranks_feat, cells, grid, backend)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import bev_pool_inputs

    cases = []
    for dtype in (torch.float32, torch.float16):
        a = bev_pool_inputs.bevdet_ranks("tiny", batch=2, dtype=dtype, device=device, shuffle=True)
        args = tuple(
            a[k]
            for k in ("depth", "feat", "ranks_depth", "ranks_feat", "ranks_bev", "bev_feat_shape")
        )
        cases.append(
            _opdef.Sample(
                f"tiny B=2 shuffled {dtype_name(dtype)}", args, grad=dtype == torch.float32
            )
        )
    v1 = bev_pool_inputs.bevfusion_inputs("tiny", batch=2, device=device, keep_out_of_range=True)
    shape = (v1["B"], v1["D"], v1["H"], v1["W"], v1["feats"].shape[1])
    cases.append(
        _opdef.Sample(
            "tiny v1 mode (coords, out-of-range kept)",
            (None, v1["feats"], None, None, v1["coords"].int(), shape),
            grad=True,
        )
    )
    d, f, rd, rf, rb, s = cases[0].args
    cases.append(_opdef.Sample("no points", (d, f, rd[:0], rf[:0], rb[:0], s)))
    return cases


OP = _opdef.define(
    _opdef.OpDef(
        name="bev_pool_v3",
        family="bev",
        schema="(Tensor? depth, Tensor feat, Tensor? ranks_depth, Tensor? ranks_feat, "
        "Tensor ranks_bev, int[] bev_feat_shape) -> Tensor",
        check=_check,
        reference=bev_pool_v3_reference,
        native=_forward_native,
        composite=True,
        grad_inputs=("depth", "feat"),
        supports=_supports,
        native_dtypes=NATIVE_DTYPES,
        entry_points=_ENTRY_POINTS,
        samples=_samples,
        upstream="DrivingSDK bev_pool_v3",
        models="BEVDet, BEVDepth, BEVFusion (DrivingSDK recipes)",
        doc="docs/operators/bev_pool_v3.md",
    )
)


@OP.export
def bev_pool_v3(
    depth,
    feat,
    ranks_depth,
    ranks_feat,
    ranks_bev,
    bev_feat_shape,
    *,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """BEV pooling from unsorted ranks, no interval arrays: `mx_driving.bev_pool_v3` (Ascend
    DrivingSDK), which is `bev_pool_v2` without the sort.

        out[b, c, z, y, x] = sum over points i with ranks_bev[i] == ((b*Z + z)*Y + y)*X + x of
                             depth.flat[ranks_depth[i]] * feat.flat[ranks_feat[i]*C + c]

    Args:
        depth: Tensor[B, N, D, H, W] floating (any shape; indexed flat), or None (weights 1).
        feat: Tensor[B, N, H, W, C] floating, channels last (any shape with last dim C).
        ranks_depth: Tensor[n] int32, or None (with depth=None).
        ranks_feat: Tensor[n] int32, or None (then feat is [n, C]: row i is point i).
        ranks_bev: Tensor[n] int32 flat cells (any order), or Tensor[n, 4] int32 / int64 of
            (h, w, d, b) coordinates.
        bev_feat_shape: (B, Z, Y, X, C); DrivingSDK calls it (B, D, H, W, C).
        backend: "auto" | "native" | "cuda" | "musa" | "reference".
        validate: raise IndexError for an out-of-range index (one host sync) instead of
            dropping the point.

    Returns:
        Tensor[B, C, Z, Y, X] in feat's dtype (float32 accumulation). Differentiable w.r.t.
        depth and feat (feat only in v1 / no-depth mode).

    v1 mode (DrivingSDK's BEVFusion path): `depth=None, ranks_depth=None, ranks_feat=None` and a
    2-D `ranks_bev[n, 4]` whose columns are (h, w, d, b) -- exactly BEVFusion's `coords`
    (x, y, z, batch) with x indexing H (= Y) and y indexing W (= X) -- pools `feat[n, C]` row i
    into cell ((b*Z + d)*Y + h)*X + w with weight 1.

    Extensions over DrivingSDK: float16 / bfloat16 with float32 accumulation; any C (DrivingSDK
    needs C % 8 == 0); 2-D ranks_bev also with depth; `depth=None` with a 1-D ranks_bev and a
    ranks_feat; points with any out-of-range index (a flat cell outside [0, B*Z*Y*X), a 2-D
    coordinate outside its dimension, a rank outside its tensor) are dropped instead of read or
    written out of bounds; deterministic forward (DrivingSDK accumulates with atomics).
    """
    if validate:
        grid = _check(depth, feat, ranks_depth, ranks_feat, ranks_bev, bev_feat_shape).info
        _validate_ranks(depth, feat, ranks_depth, ranks_feat, ranks_bev, grid)
    shape = list(_bev.bev_feat_shape(bev_feat_shape))
    return OP(depth, feat, ranks_depth, ranks_feat, ranks_bev, shape, backend=backend)
