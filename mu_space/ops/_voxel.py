"""Voxel family helpers: the argument rules the LiDAR operators share (one rule, one message),
mmcv's grid and coordinate arithmetic, and the vectorised reference pieces (no Python loop over
points) that voxelization, dynamic_voxelize, voxelization_batch and the spconv adapter share.

mmcv's arithmetic, reproduced exactly (mmcv/ops/csrc/common/cuda/voxelization_cuda_kernel.cuh
and voxelization_cuda.cu):

    grid_a  = round((max_a - min_a) / size_a)       float32 operands, C `round` (half away from 0)
    c_a     = floorf((p_a - min_a) / size_a)         float32 (float64 points: the float64 quotient
                                                     rounded to float32 first, as mmcv's double
                                                     path passes it to floorf)
    valid   = 0 <= c_a < grid_a for a = x, y, z
    coors   = (c_z, c_y, c_x) int32

One deliberate difference: NaN coordinates are invalid here (mmcv's float-to-int conversion turns
NaN into 0, a real cell, so a NaN point lands in voxel x = 0); +-inf and huge values are invalid
in both.
"""

from __future__ import annotations

import functools
import math
import operator
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import torch

from mu_space.ops import _opdef
from mu_space.ops._checks import check_tensor, dtype_name
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

INT32_MAX = 2**31 - 1
# OpDef.unverified of every voxel op with native kernels ("" once the GPU suite and the
# compute-sanitizer stage have passed). Verified on an H200 (2026-12-01), kernels of 33d2aee:
# the LiDAR GPU suite and contract tests, memcheck and racecheck clean over the voxel families'
# native tests (racecheck of dynamic_scatter / pillar_scatter on the small clouds only;
# scripts/lidar_gpu_session.sh, benchmarks/results/h200/lidar_gpu_runs_2026-12-01.md).
UNVERIFIED = ""
POINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NATIVE_POINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# upper bounds of the integer arguments (a larger value is a ValueError naming it): the outputs
# are [max_voxels, max_points, C] at most, and every index is int32
MAX_POINTS_PER_VOXEL = 1 << 16
MAX_SAMPLES = 64  # samples of one batched call (the kernels take their offsets by value)


# --------------------------------------------------------------------------- float32 values


def as_float32(value: float) -> float:
    """The float32 nearest to `value` (mmcv passes voxel_size / coors_range as float tensors)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _f32_div(a: float, b: float) -> float:
    return as_float32(as_float32(a) / as_float32(b))


def _f32_sub(a: float, b: float) -> float:
    return as_float32(as_float32(a) - as_float32(b))


def _numbers(value, name: str, n: int, what: str) -> list[float]:
    if isinstance(value, torch.Tensor):
        if value.numel() != n:
            raise ValueError(
                f"{name} must have {n} values ({what}), got a tensor of {value.numel()}"
            )
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(
                f"{name} must be {n} real numbers, got a {dtype_name(value.dtype)} tensor"
            )
        values = value.detach().reshape(-1).tolist()  # a GPU tensor costs a sync here
    elif isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be {n} numbers ({what}), got {type(value).__name__}")
    else:
        try:
            values = list(value)
        except TypeError:
            raise TypeError(
                f"{name} must be {n} numbers ({what}), got {type(value).__name__}"
            ) from None
        if len(values) != n:
            raise ValueError(f"{name} must have {n} values ({what}), got {len(values)}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not _is_real_scalar(v):
            raise TypeError(f"{name} must be {n} numbers ({what}), got {values!r}")
        out.append(float(v))
    return out


def _is_real_scalar(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and v.dtype != torch.bool
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return not isinstance(v, (str, bytes))


def parse_voxel_size(value, name: str = "voxel_size") -> tuple[float, float, float]:
    """(x, y, z) voxel edge lengths as float32 values: 3 positive finite numbers."""
    vs = tuple(as_float32(v) for v in _numbers(value, name, 3, "x, y, z"))
    if not all(math.isfinite(v) and v > 0 for v in vs):
        raise ValueError(
            f"{name} must be 3 positive finite numbers (as float32), got {list(value)}"
        )
    return vs


def parse_range(value, name: str = "coors_range") -> tuple[float, ...]:
    """(x_min, y_min, z_min, x_max, y_max, z_max) as float32 values, finite, max > min."""
    r = tuple(
        as_float32(v) for v in _numbers(value, name, 6, "x_min, y_min, z_min, x_max, y_max, z_max")
    )
    if not all(math.isfinite(v) for v in r):
        raise ValueError(f"{name} must be finite, got {list(r)}")
    for a, axis in enumerate("xyz"):
        if not r[a + 3] > r[a]:
            raise ValueError(
                f"{name}: {axis}_max ({r[a + 3]}) must be greater than {axis}_min ({r[a]})"
            )
    return r


def _round_half_away(x: float) -> int:
    return int(math.floor(abs(x) + 0.5)) * (1 if x >= 0 else -1)


def grid_size(voxel_size, coors_range, names=("voxel_size", "coors_range")) -> tuple[int, int, int]:
    """(gx, gy, gz) = round((max - min) / size) per axis, float32 arithmetic and C's round, as
    mmcv's launcher computes it. Each must be >= 1 and the product must fit int32 cells for the
    native kernels (checked by `supports`, not here)."""
    vs = parse_voxel_size(voxel_size, names[0])
    r = parse_range(coors_range, names[1])
    grid = []
    for a, axis in enumerate("xyz"):
        g = _round_half_away(_f32_div(_f32_sub(r[a + 3], r[a]), vs[a]))
        if g < 1:
            raise ValueError(
                f"{names[1]} / {names[0]}: the {axis} range ({r[a]}, {r[a + 3]}) is less than half "
                f"a voxel ({vs[a]}): no cells along {axis}"
            )
        if g > INT32_MAX:
            raise ValueError(
                f"{names[1]} / {names[0]}: {g} cells along {axis} exceed the int32 range of the "
                "voxel coordinates"
            )
        grid.append(g)
    return tuple(grid)


class VoxelGrid(NamedTuple):
    """A parsed voxel layer: float32 sizes and lower bounds (x, y, z), cells (gx, gy, gz)."""

    size: tuple[float, float, float]
    lower: tuple[float, float, float]
    cells: tuple[int, int, int]

    @property
    def n_cells(self) -> int:
        gx, gy, gz = self.cells
        return gx * gy * gz


def voxel_grid(voxel_size, coors_range, names=("voxel_size", "coors_range")) -> VoxelGrid:
    key = _plain_key(voxel_size, coors_range)
    if key is not None:  # every call of a model passes the same numbers: parsed once
        return _cached_grid(*key, names)
    vs = parse_voxel_size(voxel_size, names[0])
    r = parse_range(coors_range, names[1])
    return VoxelGrid(vs, r[:3], grid_size(vs, r, names))


def _plain_key(voxel_size, coors_range):
    """(voxel_size, coors_range) as tuples of Python floats / ints (bools excluded), or None for
    anything else (tensors, numpy values: parsed every time, with the full checks)."""
    if not (isinstance(voxel_size, (list, tuple)) and isinstance(coors_range, (list, tuple))):
        return None  # a tensor is not iterated here (each element a view)
    a, b = tuple(voxel_size), tuple(coors_range)
    plain = all(type(v) in (float, int) for v in a + b)  # not bool: a TypeError when parsed
    return (a, b) if plain else None


@functools.lru_cache(maxsize=64)
def _cached_grid(voxel_size: tuple, coors_range: tuple, names) -> VoxelGrid:
    """The parse costs ~13 us a call on this CPU (float32 rounding per value, the grid's checks);
    errors are raised, not cached."""
    vs = parse_voxel_size(voxel_size, names[0])
    r = parse_range(coors_range, names[1])
    return VoxelGrid(vs, r[:3], grid_size(vs, r, names))


# --------------------------------------------------------------------------- argument checks


def check_points(points, name: str = "points", min_features: int = 3) -> None:
    check_tensor(points, name)
    if points.dtype not in POINT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16, bfloat16 or float64, got {dtype_name(points.dtype)}"
        )
    if points.dim() != 2 or points.shape[1] < min_features:
        raise ValueError(
            f"{name} must be [N, C] with C >= {min_features} (x, y, z first), got shape "
            f"{tuple(points.shape)}"
        )
    if points.shape[0] > INT32_MAX:
        raise ValueError(f"{name} has {points.shape[0]} points; int32 indices allow {INT32_MAX}")


def as_count(value, name: str, *, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """An integer argument in [minimum, maximum] (bools and fractional values are TypeErrors)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if not minimum <= v <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {v}")
    return v


def as_bool(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return value


def is_dynamic(max_points, max_voxels) -> bool:
    """mmcv's rule: max_points == -1 or max_voxels == -1 selects dynamic voxelization."""
    return (not isinstance(max_points, bool) and max_points == -1) or (
        not isinstance(max_voxels, bool) and max_voxels == -1
    )


def sample_sizes(value, n_points: int, name: str = "sample_sizes") -> tuple[int, ...]:
    """The points per sample of a batched call: non-negative ints summing to n_points (any
    number of samples: `supports` sends batches beyond MAX_SAMPLES to the reference)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().reshape(-1).tolist()
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a sequence of integers, got {type(value).__name__}")
    try:
        items = list(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a sequence of integers, got {type(value).__name__}"
        ) from None
    if not items:
        raise ValueError(f"{name} must name at least one sample")
    sizes = tuple(as_count(v, f"{name}[{i}]") for i, v in enumerate(items))
    if sum(sizes) != n_points:
        raise ValueError(
            f"{name} must sum to the {n_points} points (rows of points), got {sum(sizes)}"
        )
    return sizes


# --------------------------------------------------------------------------- coordinates


def axis_coordinates(points: torch.Tensor, grid: VoxelGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(c [N, 3] int64 in x, y, z order, valid [N, 3] bool): mmcv's floorf((p - min) / size)
    per axis in float32 (see the module docstring), valid = 0 <= c < cells (NaN invalid)."""
    xyz = points[:, :3]
    if xyz.dtype == torch.float64:
        lo = torch.tensor(grid.lower, dtype=torch.float64, device=points.device)
        vs = torch.tensor(grid.size, dtype=torch.float64, device=points.device)
        q = ((xyz - lo) / vs).to(torch.float32)
    else:
        lo = torch.tensor(grid.lower, dtype=torch.float32, device=points.device)
        vs = torch.tensor(grid.size, dtype=torch.float32, device=points.device)
        q = (xyz.to(torch.float32) - lo) / vs
    f = torch.floor(q).to(torch.float64)  # exact; compared with the cell counts in float64
    cells = torch.tensor(grid.cells, dtype=torch.float64, device=points.device)
    valid = (f >= 0) & (f < cells)  # NaN fails both
    c = torch.where(valid, f, torch.zeros((), dtype=torch.float64, device=points.device))
    return c.to(torch.int64), valid


def dynamic_rows(points: torch.Tensor, grid: VoxelGrid) -> torch.Tensor:
    """mmcv's dynamic_voxelize rows [N, 3] int32 (z, y, x): an invalid x gives (-1, 0, 0), an
    invalid y (x valid) (-1, -1, 0), an invalid z (x, y valid) (-1, -1, -1), as mmcv's kernel
    writes -1 into the columns it has reached (on its zero-initialised output)."""
    c, valid = axis_coordinates(points, grid)
    vx, vy, vz = valid[:, 0], valid[:, 1], valid[:, 2]
    z = torch.where(vx & vy & vz, c[:, 2], -1)
    y = torch.where(vx & vy & vz, c[:, 1], torch.where(vx, -1, 0))
    x = torch.where(vx & vy & vz, c[:, 0], torch.where(vx & vy, -1, 0))
    return torch.stack((z, y, x), dim=1).to(torch.int32)


def linear_cells(points: torch.Tensor, grid: VoxelGrid) -> torch.Tensor:
    """cell = (c_z * gy + c_y) * gx + c_x (int64), -1 for an invalid point."""
    c, valid = axis_coordinates(points, grid)
    gx, gy, _ = grid.cells
    cell = (c[:, 2] * gy + c[:, 1]) * gx + c[:, 0]
    return torch.where(valid.all(dim=1), cell, -1)


def decode_cells(cell: torch.Tensor, grid: VoxelGrid) -> torch.Tensor:
    """(z, y, x) int32 rows of linear cells."""
    gx, gy, _ = grid.cells
    x = cell % gx
    y = (cell // gx) % gy
    z = cell // (gx * gy)
    return torch.stack((z, y, x), dim=1).to(torch.int32)


# --------------------------------------------------------------------------- hard voxelization


class HardVoxels(NamedTuple):
    voxels: torch.Tensor  # [M, max_points, C] in points' dtype, zero padded
    coors: torch.Tensor  # [M, 3] int32 (z, y, x), or [M, 4] (sample, z, y, x)
    num_points: torch.Tensor  # [M] int32
    point_voxel: torch.Tensor  # [N] int64: the output row of each point's voxel, -1 if none


def hard_voxelize_reference(
    points: torch.Tensor,
    grid: VoxelGrid,
    max_points: int,
    max_voxels: int,
    sizes: Sequence[int] | None = None,
) -> HardVoxels:
    """Vectorised deterministic hard voxelization of one cloud or of samples concatenated in
    `points` (`sizes` points each, then coors get the sample as a first column):

        voxels of a sample in the order of their first point; points of a voxel in input order;
        a sample keeps its first `max_voxels` voxels (in that order) and each voxel its first
        `max_points` points; the rest is dropped (mmcv's deterministic rule, per sample).

    The output rows are the samples' voxels one after the other."""
    n, C = points.shape
    device = points.device
    cell = linear_cells(points, grid)
    if sizes is None:
        sample = torch.zeros(n, dtype=torch.int64, device=device)
    else:
        sample = torch.repeat_interleave(
            torch.arange(len(sizes), device=device),
            torch.tensor(list(sizes), device=device),
            output_size=n,
        )
    valid = cell >= 0
    idx = torch.nonzero(valid).squeeze(1)  # ascending point index
    key = sample[idx] * grid.n_cells + cell[idx]
    ncols = 3 if sizes is None else 4
    empty = HardVoxels(
        points.new_zeros((0, max_points, C)),
        torch.zeros((0, ncols), dtype=torch.int32, device=device),
        torch.zeros((0,), dtype=torch.int32, device=device),
        torch.full((n,), -1, dtype=torch.int64, device=device),
    )
    if idx.numel() == 0 or max_points == 0 or max_voxels == 0:
        return empty
    uniq, inverse = torch.unique(key, return_inverse=True)  # sorted keys; voxel u of each point
    n_u = uniq.numel()
    first = torch.full((n_u,), n, dtype=torch.int64, device=device).scatter_reduce(
        0, inverse, idx, "amin"
    )
    by_first = torch.argsort(first)  # voxels in first-occurrence order (firsts are distinct)
    occ = torch.empty_like(by_first)
    occ[by_first] = torch.arange(n_u, device=device)  # global first-occurrence rank of voxel u
    u_sample = sample[first]
    # per sample: rank inside the sample = global rank - voxels of the earlier samples
    n_samples = 1 if sizes is None else len(sizes)
    per_sample = torch.bincount(u_sample, minlength=n_samples)
    before = torch.cumsum(per_sample, 0) - per_sample
    local = occ - before[u_sample]
    kept_per_sample = torch.clamp(per_sample, max=max_voxels)
    out_before = torch.cumsum(kept_per_sample, 0) - kept_per_sample
    keep_u = local < max_voxels
    row_u = torch.where(keep_u, out_before[u_sample] + local, -1)
    M = int(kept_per_sample.sum())  # host sync (reference path)
    # rank of each point inside its voxel (input order): stable sort by voxel
    perm = torch.sort(inverse, stable=True).indices
    counts = torch.bincount(inverse, minlength=n_u)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(perm.numel(), device=device) - starts[inverse[perm]]
    row = row_u[inverse]
    take = (row >= 0) & (pos < max_points)
    voxels = points.new_zeros((M, max_points, C))
    voxels[row[take], pos[take]] = points[idx[take]]
    coors = torch.zeros((M, ncols), dtype=torch.int32, device=device)
    kept_rows = row_u[keep_u]
    zyx = decode_cells(uniq[keep_u] - u_sample[keep_u] * grid.n_cells, grid)
    if ncols == 4:
        coors[kept_rows] = torch.cat((u_sample[keep_u, None].to(torch.int32), zyx), dim=1)
    else:
        coors[kept_rows] = zyx
    num = torch.zeros((M,), dtype=torch.int32, device=device)
    num[kept_rows] = torch.clamp(counts[keep_u], max=max_points).to(torch.int32)
    point_voxel = torch.full((n,), -1, dtype=torch.int64, device=device)
    point_voxel[idx] = row
    return HardVoxels(voxels, coors, num, point_voxel)


# --------------------------------------------------------------------------- native helpers


def check_hard(points, voxel_size, coors_range, max_points, max_voxels, deterministic=True):
    """Shared by voxelization, voxelization_batch and voxelization_padded."""
    check_points(points)
    grid = voxel_grid(voxel_size, coors_range)
    P = as_count(max_points, "max_points", maximum=MAX_POINTS_PER_VOXEL)
    V = as_count(max_voxels, "max_voxels")
    as_bool(deterministic, "deterministic")
    return grid, P, V


def supports_hard(n: int, n_cells: int, P: int, n_samples: int = 1) -> str | None:
    if n > (limit := native.limit("voxelization.max_points")):
        return f"{n} points exceed the native kernels' limit of {limit}"
    if n_samples * n_cells > (limit := native.limit("voxelization.max_cells")):
        return (
            f"{n_samples} x {n_cells} voxel cells exceed the native kernels' int32 keys "
            f"({limit} cells)"
        )
    if P > (limit := native.limit("voxelization.max_points_per_voxel")):
        return f"max_points = {P} exceeds the native kernels' limit of {limit}"
    if n_samples > (limit := native.limit("voxelization.max_samples")):
        return f"{n_samples} samples exceed the native kernels' limit of {limit} per call"
    return None


def offsets_of(sizes, n: int) -> list[int]:
    """[0, s0, s0 + s1, ..., n]: sample boundaries (one sample of n points when sizes is None)."""
    out = [0]
    for s in sizes if sizes is not None else (n,):
        out.append(out[-1] + s)
    return out


def native_shape(values):
    """A TVM-FFI Shape (an int64 array passed by value) of `values`."""
    import tvm_ffi

    return tvm_ffi.Shape(tuple(int(v) for v in values))


# The grouping of the native hard voxelization: "hashed" (voxel_hard_forward_hashed: a slot table
# and a warp-wide selection per voxel, no sort of the points) or "sort" (voxel_hard_keys, the
# platform's stable sort, voxel_hard_forward). Both give the same bits. "sort" is also what
# max_points above the hashed kernels' limit takes. MUSPACE_VOXEL_GROUPING=sort selects it for
# a process (benchmarks); the tests set the attribute.
GROUPING = os.environ.get("MUSPACE_VOXEL_GROUPING", "hashed")
HARD_ENTRY_POINTS = (
    "voxel_hard_forward_hashed",
    "voxel_hashed_workspace_ints",
    "voxel_hard_keys",
    "voxel_hard_forward",
    "voxel_hard_workspace_ints",
)


def uses_hashed_grouping(n: int, P: int) -> bool:
    return (
        GROUPING != "sort"
        and P <= native.limit("voxelization.hashed_max_points_per_voxel")
        and n <= native.limit("voxelization.hashed_max_points")
    )


def run_hard_native(points, grid, P, V, sizes, *, padded: bool, rows: int):
    """The native hard voxelization of `points` (samples of `sizes` points, or one cloud when
    sizes is None): outputs with `rows` rows, the int64 counts [n_samples + 1] (the total, then
    the voxels of each sample) on the device, and the total as an int (the one host
    synchronisation), None in the padded mode (no synchronisation)."""
    points = points.contiguous()
    n, C = points.shape
    n_samples = 1 if sizes is None else len(sizes)
    offsets = offsets_of(sizes, n)
    ncols = 3 if sizes is None else 4
    voxels = _opdef.new_output(points, (rows, P, C))
    coors = _opdef.new_output(points, (rows, ncols), torch.int32)
    num = _opdef.new_output(points, (rows,), torch.int32)
    counts = _opdef.new_output(points, (n_samples + 1,), torch.int64)
    grid_args = (*grid.size, *grid.lower, *grid.cells)  # vx, vy, vz, x0, y0, z0, gx, gy, gz
    st = stream_handle(points)
    sample_offsets = native_shape(offsets)
    tail = (*grid_args, P, V, sample_offsets, padded, st)  # the entry points' common arguments
    if uses_hashed_grouping(n, P):
        ints = native.function("voxel_hashed_workspace_ints")(n, n_samples, rows, *grid.cells)
        workspace = torch.empty(int(ints), dtype=torch.int32, device=points.device)
        total = native.function("voxel_hard_forward_hashed")(
            points, workspace, voxels, coors, num, counts, *tail
        )
        return voxels, coors, num, counts, None if padded else int(total)
    ints = int(native.function("voxel_hard_workspace_ints")(n, n_samples, rows))
    workspace = torch.empty(ints, dtype=torch.int32, device=points.device)
    keys = torch.empty(n, dtype=torch.int32, device=points.device)
    native.function("voxel_hard_keys")(points, keys, *grid_args, sample_offsets, st)
    # the platform's stable sort on the same stream (CUB's radix sort under CUDA, torch_musa's
    # under MUSA; no host sync, CUDA-graph capturable): our own 3-pass radix sort took ~85 of
    # the 141 us of device time at 300k points on the H200 (2026-12-01)
    sorted_keys, perm = torch.sort(keys, stable=True)
    native.function("voxel_hard_forward")(
        points, sorted_keys, perm, workspace, voxels, coors, num, counts, *tail
    )
    return voxels, coors, num, counts, None if padded else int(counts[0])


def run_dynamic_native(points, grid, sizes, coors) -> None:
    """coors [N, 3] (one cloud) or [N, 4] (samples of `sizes` points: a sample column first)."""
    (vx, vy, vz), (x0, y0, z0), (gx, gy, gz) = grid
    native.function("voxel_dynamic_forward")(
        points,
        coors,
        vx,
        vy,
        vz,
        x0,
        y0,
        z0,
        gx,
        gy,
        gz,
        native_shape(offsets_of(sizes, points.shape[0])),
        stream_handle(points),
    )
