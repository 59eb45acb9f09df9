"""`pillar_scatter`: mmdet3d's `PointPillarsScatter` (pillar features -> dense BEV canvas),
forward and backward. Formula and the rules for duplicates / out-of-range rows: the public
function's docstring and docs/operators/pillar_scatter.md.

Native path (csrc/voxel/pillar_scatter_musa.mu): a cell -> pillar map (an atomicMax of
tag << 24 | pillar: the last pillar of a cell wins, deterministically; the map is kept between
calls and each call's entries carry a new tag, so it needs no fill: KEEP_MAP below), then one
kernel writing every canvas element (a thread per cell, the channels in coalesced rows: the
canvas write dominates); or, where it applies, one launch without the map (TILED below).
Backward: the same map, then each pillar gathers its cell's gradient (0 for a pillar that lost
its cell or lies outside). No host synchronisation; CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch

from mu_space.ops import _opdef, _voxel
from mu_space.ops._checks import check_same_device, check_tensor, dtype_name
from mu_space.runtime import native
from mu_space.runtime.device import stream_capturing, stream_handle

FEAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape(output_shape) -> tuple[int, int]:
    if isinstance(output_shape, (str, bytes)) or output_shape is None:
        raise TypeError(
            f"output_shape must be 2 integers (ny, nx), got {type(output_shape).__name__}"
        )
    try:
        items = list(output_shape)
    except TypeError:
        raise TypeError(
            f"output_shape must be 2 integers (ny, nx), got {type(output_shape).__name__}"
        ) from None
    if len(items) != 2:
        raise ValueError(f"output_shape must be 2 integers (ny, nx), got {len(items)} values")
    return tuple(_voxel.as_count(v, f"output_shape[{i}]") for i, v in enumerate(items))


def _check(voxel_features, coors, batch_size, output_shape) -> _opdef.Checked:
    check_tensor(voxel_features, "voxel_features")
    if voxel_features.dtype not in FEAT_DTYPES:
        raise TypeError(
            "voxel_features must be float32, float16, bfloat16 or float64, got "
            f"{dtype_name(voxel_features.dtype)}"
        )
    if voxel_features.dim() != 2:
        raise ValueError(
            f"voxel_features must be 2-D [M, C], got shape {tuple(voxel_features.shape)}"
        )
    check_tensor(coors, "coors")
    check_same_device(coors, "coors", voxel_features, "voxel_features")
    if coors.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"coors must be int32 or int64, got {dtype_name(coors.dtype)}")
    m, C = voxel_features.shape
    if coors.dim() != 2 or coors.shape[1] != 4 or coors.shape[0] != m:
        raise ValueError(
            f"coors must be [M, 4] = [{m}, 4] (batch, z, y, x), got shape {tuple(coors.shape)}"
        )
    B = _voxel.as_count(batch_size, "batch_size")
    ny, nx = _shape(output_shape)
    if B * ny * nx > _voxel.INT32_MAX:
        raise ValueError(
            f"batch_size * ny * nx = {B}*{ny}*{nx} cells exceed the int32 range of the canvas cells"
        )
    out = ((B, C, ny, nx), voxel_features.dtype)
    return _opdef.Checked(
        voxel_features.device, voxel_features.dtype, (out,), (m, C, B, ny, nx), "voxel_features"
    )


def _cells(coors, B: int, ny: int, nx: int) -> torch.Tensor:
    """Canvas cell (b * ny + y) * nx + x of each pillar (int64), -1 outside the canvas."""
    c = coors.long()
    b, y, x = c[:, 0], c[:, 2], c[:, 3]
    ok = (b >= 0) & (b < B) & (y >= 0) & (y < ny) & (x >= 0) & (x < nx)
    return torch.where(ok, (b * ny + y) * nx + x, -1)


def _winners(cell: torch.Tensor, n_cells: int) -> torch.Tensor:
    """[n_cells + 1] int64: the last (highest) pillar index of each cell, -1 if none (the last
    entry is a scratch cell for pillars outside the canvas)."""
    m = cell.shape[0]
    target = torch.where(cell >= 0, cell, n_cells)
    rows = torch.arange(m, device=cell.device)
    return torch.full((n_cells + 1,), -1, dtype=torch.int64, device=cell.device).scatter_reduce(
        0, target, rows, "amax"
    )


def pillar_scatter_reference(voxel_features, coors, batch_size, output_shape) -> torch.Tensor:
    """Vectorised PyTorch scatter (any device, float64 too)."""
    m, C, B, ny, nx = _check(voxel_features, coors, batch_size, output_shape).info
    n_cells = B * ny * nx
    cell = _cells(coors, B, ny, nx)
    win = _winners(cell, n_cells)[:n_cells]
    has = win >= 0
    canvas = voxel_features.new_zeros((n_cells, C))
    canvas[has] = voxel_features[win[has]]
    return canvas.view(B, ny * nx, C).permute(0, 2, 1).reshape(B, C, ny, nx).contiguous()


def pillar_scatter_backward_reference(grad_out, voxel_features, coors, batch_size, output_shape):
    """(grad_voxel_features,): each pillar that won its cell gets the cell's gradient, the others 0."""
    m, C, B, ny, nx = _check(voxel_features, coors, batch_size, output_shape).info
    n_cells = B * ny * nx
    cell = _cells(coors, B, ny, nx)
    win = _winners(cell, n_cells)
    rows = torch.arange(m, device=coors.device)
    won = (cell >= 0) & (win[torch.where(cell >= 0, cell, n_cells)] == rows)
    g = grad_out.permute(0, 2, 3, 1).reshape(n_cells, C)
    g = torch.cat((g, g.new_zeros((1, C))))
    out = torch.where(won[:, None], g[torch.where(won, cell, n_cells)], 0)
    return (out.to(voxel_features.dtype),)


def _supports(c: _opdef.Checked) -> str | None:
    m, C, B, ny, nx = c.info
    if m > (limit := native.limit("pillar_scatter.max_pillars")):
        return f"{m} pillars exceed the native kernels' limit of {limit}"
    return None


# The cell map kept between calls, per (device, stream): pillar_map_kernel writes tag << 24 |
# pillar and reads any other tag as an empty cell, so with the tag raised each call the map
# needs no fill launch (the fill was one of the map path's three launches: ~2.3 us of kernel
# plus its gap beside a ~19 us canvas kernel, H200, KITTI float32). The tag wraps after
# max_map_tag calls; the map is zeroed then. A map per stream, allocated on it: its calls are
# ordered. Not under graph capture (a replay would reuse the captured tag): there, and with
# MUSPACE_PILLAR_KEEP_MAP=0 (A/B timing), a fresh map zeroed by the entry point (tag 0).
# Canvases above KEPT_MAP_MAX_CELLS (64 MB of map; BEV canvases are ~0.2-1.3M cells) get a
# fresh map too: the map would stay allocated after the call, and the fill is small beside such
# a canvas.
KEEP_MAP = os.environ.get("MUSPACE_PILLAR_KEEP_MAP", "1") != "0"
KEPT_MAP_MAX_CELLS = 1 << 24
_KEPT_MAPS_MAX = 16
_kept_maps: dict[tuple, list] = {}  # (device, stream) -> [map tensor (int32), last tag]


def _cell_map(voxel_features, B, ny, nx, stream: int) -> tuple[torch.Tensor, int]:
    """(cell map [B * ny * nx] int32, map_tag) for one native call on `stream` (its handle)."""
    cells, device = B * ny * nx, voxel_features.device
    if not KEEP_MAP or cells > KEPT_MAP_MAX_CELLS or stream_capturing(device) is not False:
        return torch.empty(cells, dtype=torch.int32, device=device), 0
    key = (device, stream)
    kept = _kept_maps.pop(key, None)
    if kept is None or kept[0].numel() < cells:
        kept = [torch.zeros(cells, dtype=torch.int32, device=device), 0]
    kept[1] += 1
    if kept[1] > native.limit("pillar_scatter.max_map_tag"):
        kept[0].zero_()
        kept[1] = 1
    _kept_maps[key] = kept  # most recent last
    while len(_kept_maps) > _KEPT_MAPS_MAX:
        _kept_maps.pop(next(iter(_kept_maps)))
    return kept[0][:cells], kept[1]


# The forward in one launch without a cell map (pillar_scatter_forward_tiled: a block per tile
# of the canvas, its pillars found by a pass over all rows into a shared-memory map), where the
# entry point takes the sizes; else the map path. Verified on the H200 (2026-12-05: GPU tests,
# memcheck, racecheck) but not faster there: tiled / map 28.4 / 28.2 us (KITTI float32),
# 27.8 / 25.9 (nuScenes float32), 18.9 / 21.1 (KITTI float16), 21.0 / 19.3 (nuScenes float16),
# medians of two alternating rounds. So the map path stays the default; MUSPACE_PILLAR_TILED=1
# takes the tiled one.
TILED_UNVERIFIED = ""
TILED = os.environ.get("MUSPACE_PILLAR_TILED", "0") == "1"


def _forward_native(c, voxel_features, coors, batch_size, output_shape):
    m, C, B, ny, nx = c.info
    feats, coors = voxel_features.contiguous(), coors.contiguous()
    canvas = _opdef.new_output(feats, (B, C, ny, nx))
    if not canvas.numel():
        return canvas
    st = stream_handle(feats)
    if TILED and _opdef.step_allowed(TILED_UNVERIFIED):
        if native.function("pillar_scatter_forward_tiled")(feats, coors, canvas, st):
            return canvas
    cell_map, map_tag = _cell_map(feats, B, ny, nx, st)
    native.function("pillar_scatter_forward")(feats, coors, cell_map, map_tag, canvas, st)
    return canvas


def _backward_native(
    c, grad_out, voxel_features, coors, batch_size, output_shape, *, needs, deterministic
):
    m, C, B, ny, nx = c.info
    feats, coors = voxel_features.contiguous(), coors.contiguous()
    grad_out = grad_out.to(feats.dtype).contiguous()
    grad = _opdef.new_output(feats)
    if grad.numel():
        st = stream_handle(feats)
        cell_map, map_tag = _cell_map(feats, B, ny, nx, st)
        native.function("pillar_scatter_backward")(grad_out, coors, cell_map, map_tag, grad, st)
    return (grad,)


def _samples(device) -> list[_opdef.Sample]:
    from mu_space.ops import _voxel as v
    from mu_space.testing import lidar

    vs, pcr, P, V = lidar.layer_args("tiny-pillars")
    grid = v.voxel_grid(vs, pcr)
    clouds = lidar.batch("tiny", 2)
    r = v.hard_voxelize_reference(torch.cat(clouds), grid, P, V, [c.shape[0] for c in clouds])
    gen = torch.Generator().manual_seed(7)
    feats = torch.randn(r.coors.shape[0], 16, generator=gen)
    gx, gy, _ = grid.cells
    shape = [gy, gx]
    dup = r.coors.clone()
    dup[1::7] = dup[::7][: dup[1::7].shape[0]]  # duplicates: the last row of a cell wins
    dup[3::11, 3] = gx + 2  # outside the canvas: dropped
    out = [
        _opdef.Sample(
            "tiny-pillars B=2 C=16 (fwd + bwd)",
            (feats.to(device), r.coors.to(device), 2, shape),
            grad=True,
        ),
        _opdef.Sample(
            "float16, int64 coors", (feats.half().to(device), r.coors.long().to(device), 2, shape)
        ),
        _opdef.Sample(
            "bfloat16, duplicates and rows outside (fwd + bwd)",
            (feats.bfloat16().to(device), dup.to(device), 2, shape),
            grad=True,
        ),
        _opdef.Sample(
            "no pillars", (feats[:0].to(device), r.coors[:0].to(device), 2, shape), grad=True
        ),
    ]
    return out


OP = _opdef.define(
    _opdef.OpDef(
        name="pillar_scatter",
        family="voxel",
        schema="(Tensor voxel_features, Tensor coors, int batch_size, int[] output_shape) -> Tensor",
        check=_check,
        reference=pillar_scatter_reference,
        native=_forward_native,
        backward=_opdef.Backward(
            inputs=("voxel_features",),
            reference=pillar_scatter_backward_reference,
            native=_backward_native,
        ),
        supports=_supports,
        native_dtypes=NATIVE_DTYPES,
        entry_points=(
            "pillar_scatter_forward",
            "pillar_scatter_backward",
            "pillar_scatter_forward_tiled",
        ),
        samples=_samples,
        upstream="mmdet3d `PointPillarsScatter`",
        models="PointPillars, PointPillars-based CenterPoint (pillar), SECOND-FPN heads on pillars",
        patches=("mmdet3d.PointPillarsScatter",),
        recipes=("model_examples/PointPillars",),
        doc="docs/operators/pillar_scatter.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def pillar_scatter(
    voxel_features: torch.Tensor,
    coors: torch.Tensor,
    batch_size: int,
    output_shape,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """mmdet3d's `PointPillarsScatter` (`forward_batch`): pillar features to a dense BEV canvas.

        canvas[b, :, y, x] = voxel_features[i] for the pillar i with coors[i] = (b, z, y, x)
        (z is ignored, as upstream); cells without a pillar are 0

    Args:
        voxel_features: Tensor[M, C] float32 / float16 / bfloat16 (float64 reference path).
        coors: Tensor[M, 4] int32 / int64 (batch, z, y, x), e.g. `voxelization_batch`'s coors.
        batch_size: B (rows with another batch index are dropped, as upstream's per-sample mask).
        output_shape: (ny, nx), as PointPillarsScatter's output_shape.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns:
        Tensor[B, C, ny, nx] in voxel_features' dtype, contiguous. Differentiable w.r.t.
        voxel_features. Two pillars in one cell (never from voxelization): the one with the
        higher row index wins and only it gets a gradient (upstream's index_put leaves the
        winner unspecified). Rows outside the canvas (y, x or b out of range, e.g. the -1 rows
        of `voxelization_padded`) are dropped (upstream would index out of bounds).
        Deterministic; no host synchronisation.
    """
    B = _voxel.as_count(batch_size, "batch_size")
    return OP(voxel_features, coors, B, list(_shape(output_shape)), backend=backend)
