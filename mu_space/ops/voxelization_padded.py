"""`voxelization_padded`: hard voxelization with fixed-size outputs (max_voxels rows) and the
voxel count as a device tensor: no host synchronisation, so it can be captured in a CUDA graph
(mmcv's `hard_voxelize_forward` kernel contract: pre-allocated max_voxels buffers plus a
voxel_num). Rules: `voxelization` and docs/operators/voxelization.md.
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _voxel


def _check(points, voxel_size, coors_range, max_points, max_voxels) -> _opdef.Checked:
    grid, P, V = _voxel.check_hard(points, voxel_size, coors_range, max_points, max_voxels)
    n, C = points.shape
    outputs = (
        ((V, P, C), points.dtype),
        ((V, 3), torch.int32),
        ((V,), torch.int32),
        ((), torch.int64),
    )
    return _opdef.Checked(points.device, points.dtype, outputs, (grid, P, V, n, C), "points")


def _supports(c: _opdef.Checked) -> str | None:
    grid, P, V, n, C = c.info
    return _voxel.supports_hard(n, grid.n_cells, P)


def voxelization_padded_reference(points, voxel_size, coors_range, max_points, max_voxels):
    """Vectorised PyTorch path: `voxelization`'s result in max_voxels rows (padding: zeros,
    coors -1, num_points 0) and the voxel count (int64, 0-d, on points' device)."""
    grid, P, V = _voxel.check_hard(points, voxel_size, coors_range, max_points, max_voxels)
    r = _voxel.hard_voxelize_reference(points, grid, P, V)
    m = r.voxels.shape[0]
    n, C = points.shape
    voxels = points.new_zeros((V, P, C))
    voxels[:m] = r.voxels
    coors = torch.full((V, 3), -1, dtype=torch.int32, device=points.device)
    coors[:m] = r.coors
    num = torch.zeros((V,), dtype=torch.int32, device=points.device)
    num[:m] = r.num_points
    return voxels, coors, num, torch.tensor(m, dtype=torch.int64, device=points.device)


def _forward_native(c, points, voxel_size, coors_range, max_points, max_voxels):
    grid, P, V, n, C = c.info
    if V == 0 or P == 0 or n == 0:
        return voxelization_padded_reference(points, voxel_size, coors_range, P, V)
    voxels, coors, num, counts, _ = _voxel.run_hard_native(
        points, grid, P, V, None, padded=True, rows=V
    )
    return voxels, coors, num, counts.resize_(())  # counts[0]: the total, kept on the device


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import lidar

    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps", device=device)
    return [
        _opdef.Sample("tiny-voxels, 4000 rows", (pts, vs, pcr, P, 4000)),
        _opdef.Sample("tiny-voxels float16, 300 rows (drops)", (pts.half(), vs, pcr, 4, 300)),
        _opdef.Sample("no points", (pts[:0], vs, pcr, P, 50)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="voxelization_padded",
        family="voxel",
        schema="(Tensor points, float[] voxel_size, float[] coors_range, int max_points, "
        "int max_voxels) -> (Tensor, Tensor, Tensor, Tensor)",
        check=_check,
        reference=voxelization_padded_reference,
        native=_forward_native,
        supports=_supports,
        native_dtypes=_voxel.NATIVE_POINT_DTYPES,
        entry_points=_voxel.HARD_ENTRY_POINTS,
        samples=_samples,
        upstream="mmcv `hard_voxelize_forward` (pre-allocated outputs + voxel_num)",
        models="PointPillars, SECOND, CenterPoint: CUDA-graph captured inference",
        patches=(),
        doc="docs/operators/voxelization.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def voxelization_padded(
    points: torch.Tensor,
    voxel_size,
    coors_range,
    max_points: int = 35,
    max_voxels: int = 20000,
    *,
    backend: str = "auto",
):
    """Hard voxelization into fixed-size outputs (upper-bound sizes, CUDA-graph capturable):

        voxels, coors, num_points, voxel_num = voxelization_padded(points, vs, range, P, V)

    voxels[:voxel_num], coors[:voxel_num], num_points[:voxel_num] equal `voxelization(points,
    vs, range, P, V)` (deterministic). Rows beyond voxel_num are padding: voxels 0, coors
    (-1, -1, -1), num_points 0 (so `pillar_scatter` and `dynamic_scatter` drop them).

    Args: as `voxelization` (max_points, max_voxels >= 0; no dynamic mode).

    Returns (voxels [max_voxels, max_points, C] in points' dtype, coors [max_voxels, 3] int32,
    num_points [max_voxels] int32, voxel_num: 0-d int64 tensor on points' device). No host
    synchronisation (voxel_num stays on the device); the kernels run on the caller's stream.
    """
    vs = _voxel.parse_voxel_size(voxel_size)
    r = _voxel.parse_range(coors_range)
    return OP(points, list(vs), list(r), max_points, max_voxels, backend=backend)
