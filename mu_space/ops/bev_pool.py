"""`bev_pool`: BEVFusion's BEV pooling of lifted frustum features. Formula, shapes and the
differences from upstream: the public function's docstring and docs/operators/bev_pool.md.

Native path (a composite op): the flat cells of the coordinates, then `bev_pool_rows`
(a sort + bev_pool_v2 without depth inside one custom op, row-gather backward):

    cell = ((b*D + z)*H + x)*W + y       (-1 when any coordinate is outside its dimension;
                                          bev_pool_cells: one kernel, int32)
    order, ranks_bev, starts, lengths = torch.sort(cell, stable=True) + the runs step
                                         (padded tails, no host sync; before issue 13:
                                          sort_by_cell + cell[order], one host sync)
    bev_pool_v2(None, feats, None, order, ranks_bev, (B, D, H, W, C), starts, lengths)

which is DrivingSDK's `bev_pool_v3` v1 mode. Upstream sorts with torch argsort and cuts the
intervals with torch.where (a host sync). docs/operators/bev_pool.md has the whole path.
"""

from __future__ import annotations

import torch

from mu_space.ops import _bev, _opdef
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.ops.bev_pool_rows import bev_pool_rows
from mu_space.runtime import native

_ENTRY_POINTS = ("sort_by_cell_forward", "bev_pool_sort_workspace_ints", "bev_pool_v2_forward")


def _dims(B, D, H, W) -> tuple[int, int, int, int]:
    return tuple(_bev.as_int(v, name) for v, name in ((B, "B"), (D, "D"), (H, "H"), (W, "W")))


def _check_coords(coords) -> None:
    check_tensor(coords, "coords")
    if coords.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"coords must be int32 or int64, got {dtype_name(coords.dtype)}")
    if coords.dim() != 2 or coords.shape[1] != 4:
        raise ValueError(f"coords must be [n, 4] (x, y, z, batch), got shape {tuple(coords.shape)}")


def _check(feats, coords, B, D, H, W) -> _opdef.Checked:
    dims = _dims(B, D, H, W)
    _bev.check_floating(feats, "feats")
    if feats.dim() != 2:
        raise ValueError(f"feats must be 2-D [n, C], got {feats.dim()}-D")
    check_tensor(coords, "coords")
    check_same_device(coords, "coords", feats, "feats")
    _check_coords(coords)
    if coords.shape[0] != feats.shape[0]:
        raise ValueError(
            f"coords.shape[0] must be {feats.shape[0]} (the rows of feats), got {coords.shape[0]}"
        )
    grid = _bev.Grid(*dims, feats.shape[1])
    b, d, h, w = dims
    shape = (b, grid.C, d, h, w)
    return _opdef.Checked(feats.device, feats.dtype, ((shape, feats.dtype),), grid, "feats")


def bev_pool_reference(feats, coords, B, D, H, W) -> torch.Tensor:
    """PyTorch reference of `bev_pool` (index_add over the flat cells; CPU or GPU; float64)."""
    grid = _check(feats, coords, B, D, H, W).info
    cells = _bev.coords_to_cells(coords, grid[:4])
    return _bev.pool_reference(None, feats, None, None, cells, grid)


def _supports(c: _opdef.Checked) -> str | None:
    if c.info.n_cells > (limit := native.limit("bev_pool_v2.max_cells")):
        return f"B*D*H*W = {c.info.n_cells} cells do not fit the native kernels' {limit}"
    return None


def _forward_native(c, feats, coords, B, D, H, W, *, backend):
    grid = c.info
    if feats.shape[0] == 0 or grid.C == 0 or grid.n_cells == 0:
        cells = _bev.coords_to_cells(coords, grid[:4])
        return _bev.pool_reference(None, feats, None, None, cells, grid)
    cells = bev_pool_cells(coords, *grid[:4], backend=backend)
    return bev_pool_rows(feats, cells, grid, backend=backend)


# ------------------------------------------------------------------ the cells step


def _check_cells(coords, B, D, H, W) -> _opdef.Checked:
    dims = _dims(B, D, H, W)
    _check_coords(coords)
    grid = _bev.Grid(*dims, 0)
    if grid.n_cells > _bev.INT32_MAX:
        raise ValueError(
            f"B*D*H*W = {'*'.join(map(str, dims))} = {grid.n_cells} cells exceeds the int32 "
            f"range of the cells ({_bev.INT32_MAX})"
        )
    outputs = (((coords.shape[0],), torch.int32),)
    return _opdef.Checked(coords.device, coords.dtype, outputs, dims, "coords")


def bev_pool_cells_reference(coords, B, D, H, W) -> torch.Tensor:
    return _bev.coords_to_cells(coords, _check_cells(coords, B, D, H, W).info)


def _cells_native(c, coords, B, D, H, W) -> torch.Tensor:
    return _bev.native_steps()[0](coords, c.info)


def _cells_samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import bev_pool_inputs

    a = bev_pool_inputs.bevfusion_inputs("tiny", batch=2, device=device, keep_out_of_range=True)
    dims = (a["B"], a["D"], a["H"], a["W"])
    coords = a["coords"]
    return [
        _opdef.Sample("tiny B=2 int64, out-of-range kept", (coords, *dims)),
        _opdef.Sample("tiny B=2 int32", (coords.int(), *dims)),
        _opdef.Sample("no points", (coords[:0], *dims)),
    ]


CELLS = _opdef.define(
    _opdef.OpDef(
        name="bev_pool_cells",
        family="bev",
        schema="(Tensor coords, int B, int D, int H, int W) -> Tensor",
        check=_check_cells,
        reference=bev_pool_cells_reference,
        native=_cells_native,
        native_dtypes=(torch.int32, torch.int64),
        entry_points=("bev_pool_cells_forward",),
        samples=_cells_samples,
        public=False,
        unverified=_bev.NATIVE_STEPS_UNVERIFIED,
    )
)


@CELLS.export
def bev_pool_cells(coords, B: int, D: int, H: int, W: int, *, backend: str = "auto"):
    """Flat cells of BEVFusion's coords[n, 4] = (x, y, z, batch) in a (B, D, H, W) grid:

        cell = ((b*D + z)*H + x)*W + y,   -1 where any coordinate is outside its dimension

    -> Tensor[n] int32 (needs B*D*H*W <= 2**31 - 1). One kernel on the native path (the
    reference: a few elementwise PyTorch ops, `_bev.coords_to_cells`)."""
    return CELLS(coords, B, D, H, W, backend=backend)


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import bev_pool_inputs

    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = bev_pool_inputs.bevfusion_inputs("tiny", batch=2, dtype=dtype, device=device)
        cases.append(
            _opdef.Sample(
                f"tiny B=2 {dtype_name(dtype)}",
                (a["feats"], a["coords"], a["B"], a["D"], a["H"], a["W"]),
                grad=dtype == torch.float32,
            )
        )
    a = bev_pool_inputs.bevfusion_inputs("tiny", device=device, keep_out_of_range=True)
    args = (a["feats"], a["coords"].int(), a["B"], a["D"], a["H"], a["W"])
    cases.append(_opdef.Sample("tiny, out-of-range coords dropped", args, grad=True))
    cases.append(_opdef.Sample("no points", (args[0][:0], args[1][:0], *args[2:])))
    return cases


OP = _opdef.define(
    _opdef.OpDef(
        name="bev_pool",
        family="bev",
        schema="(Tensor feats, Tensor coords, int B, int D, int H, int W) -> Tensor",
        check=_check,
        reference=bev_pool_reference,
        native=_forward_native,
        composite=True,
        grad_inputs=("feats",),
        supports=_supports,
        native_dtypes=(torch.float32, torch.float16, torch.bfloat16),
        entry_points=_ENTRY_POINTS,
        samples=_samples,
        upstream="BEVFusion bev_pool",
        models="BEVFusion (camera branch), DepthLSS-style transforms",
        patches=("bevfusion.bev_pool", "bevfusion.bev_pool.projects"),
        recipes=("model_examples/BEVFusion",),
        doc="docs/operators/bev_pool.md",
    )
)


@OP.export
def bev_pool(feats, coords, B, D, H, W, *, backend: str = "auto") -> torch.Tensor:
    """BEVFusion's `bev_pool(feats, coords, B, D, H, W)` (drop-in for
    `mmdet3d.ops.bev_pool.bev_pool`) -> Tensor[B, C, D, H, W].

        out[b, c, d, h, w] = sum over points i with coords[i] == (h, w, d, b) of feats[i, c]

    Args:
        feats: Tensor[n, C] float32 / float16 / bfloat16 (float64 on the reference path): the
            already multiplied frustum features (depth x image feature), one row per point.
        coords: Tensor[n, 4] int32 / int64, columns (x, y, z, batch) as BEVFusion builds them: x
            indexes H, y indexes W, z indexes D (BEVFusion calls
            bev_pool(x, geom, B, nx[2], nx[0], nx[1]): D = z cells, H = x cells, W = y cells).
        B, D, H, W: ints, or 0-d integer tensors as BEVFusion passes `self.nx[i]`.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns:
        Tensor[B, C, D, H, W] in feats' dtype (float32 accumulation); cells without points are
        0. Differentiable w.r.t. feats.

    Differences from upstream: a point with any coordinate outside [0, dim) is dropped (upstream
    writes out of bounds: undefined behaviour or a crash); float16 / bfloat16 inputs;
    deterministic forward and backward (each point has exactly one cell, so the backward is a
    row gather of the channels-last output gradient: no atomics, no sort).
    """
    b, d, h, w = (_bev.as_int(v, name) for v, name in ((B, "B"), (D, "D"), (H, "H"), (W, "W")))
    return OP(feats, coords, b, d, h, w, backend=backend)
