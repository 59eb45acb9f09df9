"""`voxelization_batch` and `dynamic_voxelize_batch`: hard / dynamic voxelization of a batch of
clouds in one call, coordinates with the sample as a first column, exactly what mmdet3d's
`Det3DDataPreprocessor.voxelize` builds with its loop over samples (F.pad of each sample's
coors with its index, then torch.cat). Per-sample rules (max_voxels, first-occurrence order)
are the single-cloud ones: docs/operators/voxelization.md.

Native path: the clouds concatenated, the sample boundaries passed by value to the kernels (at
most 64 samples per call; more go to the reference), one pass of kernels for the whole batch;
hard voxelization reads the per-sample voxel counts back once (the output size).
"""

from __future__ import annotations

import torch

from mu_space.ops import _opdef, _voxel


def _cat(points):
    """(points [sum N, C], sample sizes) of a list of clouds."""
    if isinstance(points, torch.Tensor):
        raise TypeError("points must be a list of [N_i, C] tensors (or give sample_sizes)")
    clouds = list(points)
    if not clouds:
        raise ValueError("points must hold at least one cloud")
    for i, c in enumerate(clouds):
        _voxel.check_points(c, f"points[{i}]")
        if c.shape[1] != clouds[0].shape[1] or c.dtype != clouds[0].dtype:
            raise ValueError(
                f"points[{i}] must have the features and dtype of points[0] "
                f"({clouds[0].shape[1]}, {clouds[0].dtype}), got ({c.shape[1]}, {c.dtype})"
            )
        if c.device != clouds[0].device:
            raise ValueError(f"points[{i}] must be on {clouds[0].device}, got {c.device}")
    return torch.cat(clouds, dim=0), [c.shape[0] for c in clouds]


def _normalise(points, sample_sizes):
    if sample_sizes is None:
        return _cat(points)
    _voxel.check_points(points)
    return points, list(_voxel.sample_sizes(sample_sizes, points.shape[0]))


# --------------------------------------------------------------------------- hard


def _check(points, sample_sizes, voxel_size, coors_range, max_points, max_voxels, deterministic):
    grid, P, V = _voxel.check_hard(
        points, voxel_size, coors_range, max_points, max_voxels, deterministic
    )
    sizes = _voxel.sample_sizes(sample_sizes, points.shape[0])
    n, C = points.shape
    return _opdef.Checked(points.device, points.dtype, None, (grid, P, V, n, C, sizes), "points")


def _supports(c: _opdef.Checked) -> str | None:
    grid, P, V, n, C, sizes = c.info
    return _voxel.supports_hard(n, grid.n_cells, P, len(sizes))


def voxelization_batch_reference(
    points, sample_sizes, voxel_size, coors_range, max_points, max_voxels, deterministic
):
    """Vectorised PyTorch batched hard voxelization (any device, float64 too)."""
    grid, P, V = _voxel.check_hard(
        points, voxel_size, coors_range, max_points, max_voxels, deterministic
    )
    sizes = _voxel.sample_sizes(sample_sizes, points.shape[0])
    r = _voxel.hard_voxelize_reference(points, grid, P, V, sizes)
    return r.voxels, r.coors, r.num_points


def _forward_native(
    c, points, sample_sizes, voxel_size, coors_range, max_points, max_voxels, deterministic
):
    grid, P, V, n, C, sizes = c.info
    rows = sum(min(s, V) for s in sizes)
    if rows == 0 or P == 0:
        return voxelization_batch_reference(
            points, sample_sizes, voxel_size, coors_range, P, V, deterministic
        )
    voxels, coors, num, _, m = _voxel.run_hard_native(  # m: the one host synchronisation
        points, grid, P, V, sizes, padded=False, rows=rows
    )
    return voxels.resize_(m, P, C), coors.resize_(m, 4), num.resize_(m)


def _fake(points, sample_sizes, voxel_size, coors_range, max_points, max_voxels, deterministic):
    m = torch.library.get_ctx().new_dynamic_size()
    return (
        points.new_empty((m, max_points, points.shape[1])),
        points.new_empty((m, 4), dtype=torch.int32),
        points.new_empty((m,), dtype=torch.int32),
    )


def _samples(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import lidar

    vs, pcr, P, V = lidar.layer_args("tiny-voxels")
    clouds = lidar.batch("tiny-3sweeps", 3, device=device)
    pts = torch.cat(clouds)
    sizes = [c.shape[0] for c in clouds]
    return [
        _opdef.Sample("3 x tiny-3sweeps", (pts, vs, pcr, P, V, True), {"sample_sizes": sizes}),
        _opdef.Sample(
            "3 x tiny-3sweeps float16, max_voxels 200",
            (pts.half(), vs, pcr, 2, 200, True),
            {"sample_sizes": sizes},
        ),
        _opdef.Sample(
            "an empty sample between two",
            (pts[: sizes[0] + sizes[1]], vs, pcr, P, V, True),
            {"sample_sizes": [sizes[0], 0, sizes[1]]},
        ),
        _opdef.Sample("no points", (pts[:0], vs, pcr, P, V, True), {"sample_sizes": [0, 0]}),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="voxelization_batch",
        family="voxel",
        schema="(Tensor points, int[] sample_sizes, float[] voxel_size, float[] coors_range, "
        "int max_points, int max_voxels, bool deterministic) -> (Tensor, Tensor, Tensor)",
        check=_check,
        reference=voxelization_batch_reference,
        native=_forward_native,
        fake=_fake,
        supports=_supports,
        native_dtypes=_voxel.NATIVE_POINT_DTYPES,
        entry_points=_voxel.HARD_ENTRY_POINTS,
        samples=_samples,
        upstream="mmdet3d `Det3DDataPreprocessor.voxelize` (hard), mmcv `Voxelization` per sample",
        models="PointPillars, SECOND, CenterPoint (voxel)",
        recipes=("model_examples/PointPillars", "model_examples/CenterPoint"),
        doc="docs/operators/voxelization.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@OP.export
def voxelization_batch(
    points,
    voxel_size,
    coors_range,
    max_points: int = 35,
    max_voxels: int = 20000,
    deterministic: bool = True,
    *,
    sample_sizes=None,
    backend: str = "auto",
):
    """Hard voxelization of a batch of clouds in one call: for a list of clouds `[N_i, C]`,

        voxels, coors, num_points = voxelization_batch(clouds, voxel_size, coors_range, P, V)

    equals mmdet3d's `Det3DDataPreprocessor.voxelize` loop (for i, cloud: mmcv `voxelization`,
    then `F.pad(coors, (1, 0), value=i)`, then `torch.cat` of each output): the rows of sample
    0, then sample 1, ...; coors [M, 4] int32 (sample, z, y, x); each sample keeps its own
    first max_voxels voxels (first-occurrence order) and each voxel its first max_points points.

    Args:
        points: a list of Tensor[N_i, C] (same C and dtype), or one Tensor[sum N_i, C] of the
            clouds concatenated together with `sample_sizes` (the N_i).
        voxel_size, coors_range, max_points, max_voxels, deterministic: as `voxelization`
            (max_points or max_voxels == -1: `dynamic_voxelize_batch`, coors [sum N_i, 4]).
        sample_sizes: the points per sample when `points` is one tensor.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns (voxels [M, max_points, C], coors [M, 4] int32, num_points [M] int32). One launch
    sequence for the whole batch and one host synchronisation (the voxel counts).
    """
    if _voxel.is_dynamic(max_points, max_voxels):
        return dynamic_voxelize_batch(
            points, voxel_size, coors_range, sample_sizes=sample_sizes, backend=backend
        )
    pts, sizes = _normalise(points, sample_sizes)
    vs = _voxel.parse_voxel_size(voxel_size)
    r = _voxel.parse_range(coors_range)
    return OP(pts, sizes, list(vs), list(r), max_points, max_voxels, deterministic, backend=backend)


# --------------------------------------------------------------------------- dynamic


def _check_dynamic(points, sample_sizes, voxel_size, coors_range) -> _opdef.Checked:
    _voxel.check_points(points)
    grid = _voxel.voxel_grid(voxel_size, coors_range)
    sizes = _voxel.sample_sizes(sample_sizes, points.shape[0])
    n = points.shape[0]
    return _opdef.Checked(
        points.device, points.dtype, (((n, 4), torch.int32),), (grid, n, sizes), "points"
    )


def _supports_dynamic(c: _opdef.Checked) -> str | None:
    from mu_space.runtime import native

    grid, n, sizes = c.info
    if n > (limit := native.limit("voxelization.max_points")):
        return f"{n} points exceed the native kernels' limit of {limit}"
    if len(sizes) > (limit := native.limit("voxelization.max_samples")):
        return f"{len(sizes)} samples exceed the native kernels' limit of {limit} per call"
    return None


def dynamic_voxelize_batch_reference(points, sample_sizes, voxel_size, coors_range):
    """Vectorised PyTorch batched dynamic voxelization: each sample's rows with its index first."""
    grid = _voxel.voxel_grid(voxel_size, coors_range)
    sizes = _voxel.sample_sizes(sample_sizes, points.shape[0])
    rows = _voxel.dynamic_rows(points, grid)
    sample = torch.repeat_interleave(
        torch.arange(len(sizes), dtype=torch.int32, device=points.device),
        torch.tensor(sizes, device=points.device),
        output_size=points.shape[0],
    )
    return torch.cat((sample[:, None], rows), dim=1)


def _forward_native_dynamic(c, points, sample_sizes, voxel_size, coors_range):
    grid, n, sizes = c.info
    points = points.contiguous()
    coors = _opdef.new_output(points, (n, 4), torch.int32)
    if n:
        _voxel.run_dynamic_native(points, grid, sizes, coors)
    return coors


def _samples_dynamic(device: torch.device) -> list[_opdef.Sample]:
    from mu_space.testing import lidar

    vs, pcr, _, _ = lidar.layer_args("tiny-voxels")
    clouds = lidar.batch("tiny-3sweeps", 2, device=device)
    pts = torch.cat(clouds)
    sizes = [c.shape[0] for c in clouds]
    return [
        _opdef.Sample("2 x tiny-3sweeps", (pts, vs, pcr), {"sample_sizes": sizes}),
        _opdef.Sample(
            "2 x tiny-3sweeps bfloat16, an empty sample",
            (pts.bfloat16(), vs, pcr),
            {"sample_sizes": [sizes[0], 0, sizes[1]]},
        ),
        _opdef.Sample("no points", (pts[:0], vs, pcr), {"sample_sizes": [0]}),
    ]


DYNAMIC_OP = _opdef.define(
    _opdef.OpDef(
        name="dynamic_voxelize_batch",
        family="voxel",
        schema="(Tensor points, int[] sample_sizes, float[] voxel_size, float[] coors_range) "
        "-> Tensor",
        check=_check_dynamic,
        reference=dynamic_voxelize_batch_reference,
        native=_forward_native_dynamic,
        supports=_supports_dynamic,
        native_dtypes=_voxel.NATIVE_POINT_DTYPES,
        entry_points=("voxel_dynamic_forward",),
        samples=_samples_dynamic,
        upstream="mmdet3d `Det3DDataPreprocessor.voxelize` (dynamic)",
        models="dynamic-voxel PointPillars / SECOND / CenterPoint (DynamicVFE)",
        recipes=("model_examples/CenterPoint",),
        doc="docs/operators/voxelization.md",
        unverified=_voxel.UNVERIFIED,
    )
)


@DYNAMIC_OP.export
def dynamic_voxelize_batch(
    points, voxel_size, coors_range, *, sample_sizes=None, backend: str = "auto"
):
    """Dynamic voxelization of a batch of clouds in one call: coors Tensor[sum N_i, 4] int32,
    row (sample, z, y, x) of every point, equal to mmdet3d's `Det3DDataPreprocessor.voxelize`
    (dynamic): for each sample mmcv's dynamic rows (`dynamic_voxelize`; dropped points keep
    mmcv's -1 pattern after the sample column), padded with the sample index and concatenated.

    Args:
        points: a list of Tensor[N_i, C], or one Tensor[sum N_i, C] with `sample_sizes`.
        voxel_size, coors_range: as `dynamic_voxelize`.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    One kernel for the batch, no host synchronisation.
    """
    pts, sizes = _normalise(points, sample_sizes)
    vs = _voxel.parse_voxel_size(voxel_size)
    r = _voxel.parse_range(coors_range)
    return DYNAMIC_OP(pts, sizes, list(vs), list(r), backend=backend)
