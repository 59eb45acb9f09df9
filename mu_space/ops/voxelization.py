"""`voxelization`: mmcv's hard voxelization (`mmcv.ops.voxelization`), deterministic. Formula,
shapes and upstream rules: the public function's docstring and docs/operators/voxelization.md.

Native path (csrc/voxel/voxelize_musa.mu, on the caller's stream; run_hard_native picks the
grouping): by default a slot table of the occupied cells (first points by atomicMin, so voxel ids
in first-occurrence order come from one scan; each voxel's points recovered in input order by a
warp-wide selection), no sort of the points; for max_points above the hashed kernels' limit the
platform's stable sort of the point keys and the runs of equal keys instead. Both give the same
bits. The outputs are allocated with an upper bound of rows (min(N, max_voxels)); the voxel count
is read back once (the one host synchronisation: the output size depends on the data; the hashed
grouping reads it while its last kernels run) and the results are views of the first M rows, as
mmcv returns `voxels[:voxel_num]`. `voxelization_padded` is the same without the read-back
(CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _voxel

ENTRY_POINTS = _voxel.HARD_ENTRY_POINTS


def _check(points, voxel_size, coors_range, max_points, max_voxels, deterministic):
    grid, P, V = _voxel.check_hard(
        points, voxel_size, coors_range, max_points, max_voxels, deterministic
    )
    n, C = points.shape
    return _opdef.Checked(points.device, points.dtype, None, (grid, P, V, n, C), "points")


def _supports(c: _opdef.Checked) -> str | None:
    grid, P, V, n, C = c.info
    return _voxel.supports_hard(n, grid.n_cells, P)


def voxelization_reference(points, voxel_size, coors_range, max_points, max_voxels, deterministic):
    """Vectorised PyTorch hard voxelization (any device, float64 too; `deterministic` has no
    effect: the result is always the deterministic one)."""
    grid, P, V = _voxel.check_hard(
        points, voxel_size, coors_range, max_points, max_voxels, deterministic
    )
    r = _voxel.hard_voxelize_reference(points, grid, P, V)
    return r.voxels, r.coors, r.num_points


def _forward_native(c, points, voxel_size, coors_range, max_points, max_voxels, deterministic):
    grid, P, V, n, C = c.info
    rows = min(n, V)
    if rows == 0 or P == 0:
        return voxelization_reference(points, voxel_size, coors_range, P, V, deterministic)
    voxels, coors, num, _, m = _voxel.run_hard_native(  # m: the one host synchronisation
        points, grid, P, V, None, padded=False, rows=rows
    )
    # shrink in place (metadata only: the first m rows stay where they are)
    return voxels.resize_(m, P, C), coors.resize_(m, 3), num.resize_(m)


def _fake(points, voxel_size, coors_range, max_points, max_voxels, deterministic):
    ctx = torch.library.get_ctx()
    m = ctx.new_dynamic_size()
    C = points.shape[1]
    return (
        points.new_empty((m, max_points, C)),
        points.new_empty((m, 3), dtype=torch.int32),
        points.new_empty((m,), dtype=torch.int32),
    )


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import lidar

    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    pts = lidar.make("tiny-3sweeps", device=device)
    pil_vs, pil_r, pil_p, _ = lidar.layer_args("tiny-pillars")
    pillars = lidar.make("tiny", device=device)
    return [
        _opdef.Sample("tiny-voxels float32", (pts, vs, pcr, P, V, True)),
        _opdef.Sample("tiny-voxels, max_voxels 300 (drops)", (pts, vs, pcr, 3, 300, True)),
        _opdef.Sample("tiny-pillars float16", (pillars.half(), pil_vs, pil_r, pil_p, 200, True)),
        _opdef.Sample("tiny-pillars bfloat16", (pillars.bfloat16(), pil_vs, pil_r, 4, 500, False)),
        _opdef.Sample("no points", (pts[:0], vs, pcr, P, V, True)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="voxelization",
        family="voxel",
        schema="(Tensor points, float[] voxel_size, float[] coors_range, int max_points, "
        "int max_voxels, bool deterministic) -> (Tensor, Tensor, Tensor)",
        check=_check,
        reference=voxelization_reference,
        native=_forward_native,
        fake=_fake,
        supports=_supports,
        native_dtypes=_voxel.NATIVE_POINT_DTYPES,
        entry_points=ENTRY_POINTS,
        samples=_samples,
        upstream="mmcv `voxelization` / `Voxelization` (hard)",
        models="PointPillars, SECOND, CenterPoint (voxel), PV-RCNN",
        patches=("mmcv.voxelization", "mmcv.Voxelization", "mmcv._ext.hard_voxelize_forward"),
        recipes=("model_examples/PointPillars", "model_examples/CenterPoint"),
        doc="docs/operators/voxelization.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def voxelization(
    points: torch.Tensor,
    voxel_size,
    coors_range,
    max_points: int = 35,
    max_voxels: int = 20000,
    deterministic: bool = True,
    *,
    backend: str = "auto",
):
    """mmcv's `voxelization(points, voxel_size, coors_range, max_points=35, max_voxels=20000,
    deterministic=True)` (drop-in for `mmcv.ops.voxelization`; same arguments and results).

    Hard voxelization (max_points > 0 and max_voxels > 0):

        grid  = round((max - min) / voxel_size) cells per axis (float32, C round)
        cell of a point = floor((p - min) / voxel_size) per axis (float32); points outside the
              grid (and NaN / inf points) are dropped
        voxels, in the order of their first point; the points of a voxel in input order; only
              the first max_voxels voxels and the first max_points points of each are kept

    Returns (voxels [M, max_points, C] in points' dtype, zero padded; coors [M, 3] int32
    (z, y, x); num_points_per_voxel [M] int32), M <= max_voxels. With max_points == -1 or
    max_voxels == -1 it is mmcv's dynamic voxelization instead: `dynamic_voxelize(points,
    voxel_size, coors_range)`, coors [N, 3] int32 per point (rows of dropped points start with
    -1, exactly as mmcv writes them).

    Args:
        points: Tensor[N, C >= 3] float32 / float16 / bfloat16 (float64: reference path), x, y, z
            first.
        voxel_size: 3 positive numbers (x, y, z), used as float32.
        coors_range: (x_min, y_min, z_min, x_max, y_max, z_max), used as float32.
        max_points, max_voxels: ints >= 0 (0 gives an empty result), or -1 (dynamic).
        deterministic: accepted for mmcv compatibility; muSPACE is always deterministic (the
            result equals mmcv's deterministic one), at no extra cost, so False changes nothing.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Determinism, host synchronisation (one per call: the voxel count), limits and the
    differences from mmcv (NaN points dropped): docs/operators/voxelization.md.
    `voxelization_padded` has fixed output sizes and no synchronisation.
    """
    if _voxel.is_dynamic(max_points, max_voxels):
        from mu_space.ops.dynamic_voxelize import dynamic_voxelize

        return dynamic_voxelize(points, voxel_size, coors_range, backend=backend)
    vs = _voxel.parse_voxel_size(voxel_size)
    r = _voxel.parse_range(coors_range)
    return OP(points, list(vs), list(r), max_points, max_voxels, deterministic, backend=backend)
