"""`dynamic_voxelize`: mmcv's dynamic voxelization (`voxelization(..., max_points=-1)`, the
`dynamic_voxelize_forward` kernel): one voxel coordinate row per point. Formula and the exact
rows of dropped points: the public function's docstring and docs/operators/voxelization.md.

Native path: one kernel, a thread per point (read x, y, z, write 3 int32), no host
synchronisation, CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _voxel
from mu_space.runtime import native


def _check(points, voxel_size, coors_range) -> _opdef.Checked:
    _voxel.check_points(points)
    grid = _voxel.voxel_grid(voxel_size, coors_range)
    n = points.shape[0]
    return _opdef.Checked(
        points.device, points.dtype, (((n, 3), torch.int32),), (grid, n), "points"
    )


def _supports(c: _opdef.Checked) -> str | None:
    grid, n = c.info
    if n > (limit := native.limit("voxelization.max_points")):
        return f"{n} points exceed the native kernels' limit of {limit}"
    return None


def dynamic_voxelize_reference(points, voxel_size, coors_range) -> torch.Tensor:
    """Vectorised PyTorch dynamic voxelization (any device, float64 too)."""
    return _voxel.dynamic_rows(points, _voxel.voxel_grid(voxel_size, coors_range))


def _forward_native(c, points, voxel_size, coors_range):
    grid, n = c.info
    points = points.contiguous()
    coors = _opdef.new_output(points, (n, 3), torch.int32)
    if n:
        _voxel.run_dynamic_native(points, grid, None, coors)
    return coors


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import lidar

    vs, pcr, _, _ = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps", device=device)
    return [
        _opdef.Sample("tiny-voxels float32", (pts, vs, pcr)),
        _opdef.Sample("tiny-voxels float16", (pts.half(), vs, pcr)),
        _opdef.Sample(
            "centre crop bfloat16", (pts.bfloat16(), [0.2, 0.3, 0.25], [-8, -6, -2, 8, 6, 1])
        ),
        _opdef.Sample("no points", (pts[:0], vs, pcr)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="dynamic_voxelize",
        family="voxel",
        schema="(Tensor points, float[] voxel_size, float[] coors_range) -> Tensor",
        check=_check,
        reference=dynamic_voxelize_reference,
        native=_forward_native,
        supports=_supports,
        native_dtypes=_voxel.NATIVE_POINT_DTYPES,
        entry_points=("voxel_dynamic_forward",),
        samples=_samples,
        upstream="mmcv `voxelization(..., max_points=-1)` / `dynamic_voxelize_forward`",
        models="dynamic-voxel PointPillars / SECOND / CenterPoint (DynamicVFE), MVX-Net",
        patches=("mmcv._ext.dynamic_voxelize_forward",),
        recipes=("model_examples/CenterPoint",),
        doc="docs/operators/voxelization.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def dynamic_voxelize(points: torch.Tensor, voxel_size, coors_range, *, backend: str = "auto"):
    """mmcv's dynamic voxelization: the voxel coordinate of every point,
    `voxelization(points, voxel_size, coors_range, max_points=-1)`.

        c_a = floor((p_a - min_a) / voxel_size_a) per axis a (float32), valid when
              0 <= c_a < round((max_a - min_a) / voxel_size_a)
        row = (c_z, c_y, c_x) for a valid point; for a dropped point mmcv's pattern:
              x outside (or NaN) -> (-1, 0, 0); y outside -> (-1, -1, 0); z outside -> (-1, -1, -1)

    Args:
        points: Tensor[N, C >= 3] float32 / float16 / bfloat16 (float64: reference path).
        voxel_size: 3 positive numbers (x, y, z); coors_range: 6 numbers (mins, then maxes).
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns:
        coors Tensor[N, 3] int32 (z, y, x); every row with a negative entry is a dropped point
        (`dynamic_scatter` drops such rows). No host synchronisation; CUDA-graph capturable.
        NaN points are dropped (mmcv turns a NaN coordinate into cell 0).
    """
    vs = _voxel.parse_voxel_size(voxel_size)
    r = _voxel.parse_range(coors_range)
    return OP(points, list(vs), list(r), backend=backend)
