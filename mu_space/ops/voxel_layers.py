"""The layers and adapters around the voxel operators, with the upstream constructors:

- `Voxelization(voxel_size, point_cloud_range, max_num_points, max_voxels=20000,
  deterministic=True)`: mmcv's module (train / test max_voxels tuple, `grid_size`, `pcd_shape`).
- `DynamicScatter(voxel_size, point_cloud_range, average_points)`: mmcv's module, including its
  batched form for (batch, z, y, x) coordinates, in one call instead of a loop over samples.
- `PointToVoxel(vsize_xyz, coors_range_xyz, num_point_features, max_num_voxels,
  max_num_points_per_voxel, device=...)`: spconv 2.x's call convention (OpenPCDet uses it) over
  the same kernels: `__call__(pc, clear_voxels=True, empty_mean=False)` and
  `generate_voxel_with_id(...)`.

Axis order: mmcv and spconv both take sizes and ranges in (x, y, z) order and return voxel
coordinates in (z, y, x) order; spconv's `grid_size` is (z, y, x), mmcv's (x, y, z).
"""

from __future__ import annotations

import torch
from torch import nn

from mu_space.ops import _voxel
from mu_space.ops.dynamic_scatter import dynamic_scatter
from mu_space.ops.voxelization import voxelization


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


class Voxelization(nn.Module):
    """mmcv's `Voxelization` module (mmcv.ops.Voxelization): `forward(points)` calls
    `voxelization(points, voxel_size, point_cloud_range, max_num_points, max_voxels[0 if
    training else 1], deterministic)`. Attributes as mmcv: voxel_size, point_cloud_range,
    max_num_points, max_voxels (a pair), deterministic, grid_size (x, y, z; torch.round of the
    float32 quotient, as mmcv computes this attribute), pcd_shape ([1, y, x])."""

    def __init__(
        self,
        voxel_size,
        point_cloud_range,
        max_num_points: int,
        max_voxels=20000,
        deterministic: bool = True,
        *,
        backend: str = "auto",
    ):
        super().__init__()
        self.voxel_size = voxel_size
        self.point_cloud_range = point_cloud_range
        self.max_num_points = max_num_points
        self.max_voxels = tuple(max_voxels) if isinstance(max_voxels, tuple) else _pair(max_voxels)
        self.deterministic = deterministic
        self.backend = backend
        pcr = torch.tensor(point_cloud_range, dtype=torch.float32)
        vs = torch.tensor(voxel_size, dtype=torch.float32)
        grid_size = torch.round((pcr[3:] - pcr[:3]) / vs).long()
        self.grid_size = grid_size
        self.pcd_shape = [*grid_size[:2], 1][::-1]

    def forward(self, input: torch.Tensor):
        max_voxels = self.max_voxels[0] if self.training else self.max_voxels[1]
        return voxelization(
            input,
            self.voxel_size,
            self.point_cloud_range,
            self.max_num_points,
            max_voxels,
            self.deterministic,
            backend=self.backend,
        )

    def __repr__(self) -> str:
        return (
            f"{self.__class__.__name__}(voxel_size={self.voxel_size}, point_cloud_range="
            f"{self.point_cloud_range}, max_num_points={self.max_num_points}, max_voxels="
            f"{self.max_voxels}, deterministic={self.deterministic})"
        )


def scatter_batched(points, coors, reduce: str, backend: str = "auto"):
    """mmcv DynamicScatter.forward for (batch, z, y, x) coordinates in one call: mmcv loops
    over batch indices 0 .. coors[-1, 0] and scatters each sample; the concatenation equals one
    scatter of all rows sorted by (batch, z, y, x), once rows with a batch index beyond the
    last row's are dropped as mmcv's loop drops them (done on the device: no sync)."""
    if coors.shape[0]:
        beyond = coors[:, 0] > coors[-1, 0]
        coors = torch.where(beyond[:, None], torch.full_like(coors, -1), coors)
    return dynamic_scatter(points.contiguous(), coors.contiguous(), reduce, backend=backend)


class DynamicScatter(nn.Module):
    """mmcv's `DynamicScatter(voxel_size, point_cloud_range, average_points)`:
    `forward(points, coors)` reduces point features into voxels with 'mean' (average_points)
    or 'max'; coors [N, 3] (z, y, x) or [N, 4] (batch, z, y, x) (one call here; mmcv loops over
    the samples). Returns (voxel_feats [M, C], voxel_coors [M, ndim])."""

    def __init__(
        self, voxel_size, point_cloud_range, average_points: bool, *, backend: str = "auto"
    ):
        super().__init__()
        self.voxel_size = voxel_size
        self.point_cloud_range = point_cloud_range
        self.average_points = average_points
        self.backend = backend

    def forward_single(self, points, coors):
        reduce = "mean" if self.average_points else "max"
        return dynamic_scatter(
            points.contiguous(), coors.contiguous(), reduce, backend=self.backend
        )

    def forward(self, points, coors):
        if coors.size(-1) == 3:
            return self.forward_single(points, coors)
        reduce = "mean" if self.average_points else "max"
        return scatter_batched(points, coors, reduce, self.backend)

    def __repr__(self) -> str:
        return (
            f"{self.__class__.__name__}(voxel_size={self.voxel_size}, point_cloud_range="
            f"{self.point_cloud_range}, average_points={self.average_points})"
        )


class PointToVoxel:
    """spconv 2.x's `spconv.pytorch.utils.PointToVoxel` call convention over muSPACE's
    deterministic hard voxelization (3-D only):

        gen = PointToVoxel(vsize_xyz=[0.1, 0.1, 0.15], coors_range_xyz=[...6...],
                           num_point_features=5, max_num_voxels=150000,
                           max_num_points_per_voxel=5, device=torch.device("cuda"))
        voxels, indices, num_per_voxel = gen(pc)
        voxels, indices, num_per_voxel, pc_voxel_id = gen.generate_voxel_with_id(pc)

    voxels [M, max_points, C] (pc's dtype), indices [M, 3] int32 in (z, y, x) order (vsize_xyz
    and coors_range_xyz are (x, y, z) as in spconv), num_per_voxel [M] int32, pc_voxel_id [N]
    int64 (the voxel row of each point, -1 when its voxel was not kept; points beyond
    max_num_points of a kept voxel still name it, as spconv). `grid_size` is (z, y, x) like
    spconv's (std::round of the float32 quotient). Voxels are in the order of their first point
    (spconv's CPU order; its CUDA order follows its hash table and is not deterministic), points
    in input order. `clear_voxels` is accepted (the outputs are always fresh and zero padded);
    `empty_mean=True` fills each voxel's empty point slots with the mean of its points, as
    spconv does."""

    def __init__(
        self,
        vsize_xyz,
        coors_range_xyz,
        num_point_features: int,
        max_num_voxels: int,
        max_num_points_per_voxel: int,
        device: torch.device | str = "cpu:0",
        *,
        backend: str = "auto",
    ):
        if len(vsize_xyz) != 3:
            raise ValueError(
                f"vsize_xyz must have 3 values (this adapter is 3-D), got {len(vsize_xyz)}"
            )
        self.ndim = 3
        self.device = torch.device(device)
        self.vsize = list(reversed(_voxel.parse_voxel_size(vsize_xyz, "vsize_xyz")))
        rng = _voxel.parse_range(coors_range_xyz, "coors_range_xyz")
        self.coors_range = [rng[2], rng[1], rng[0], rng[5], rng[4], rng[3]]  # zyx, as spconv
        grid = _voxel.grid_size(vsize_xyz, coors_range_xyz, ("vsize_xyz", "coors_range_xyz"))
        self.grid_size = list(reversed(grid))  # (z, y, x)
        self.num_point_features = _voxel.as_count(
            num_point_features, "num_point_features", minimum=3
        )
        self.max_num_voxels = _voxel.as_count(max_num_voxels, "max_num_voxels")
        self.max_num_points_per_voxel = _voxel.as_count(
            max_num_points_per_voxel,
            "max_num_points_per_voxel",
            maximum=_voxel.MAX_POINTS_PER_VOXEL,
        )
        self._vsize_xyz = list(vsize_xyz)
        self._range_xyz = list(coors_range_xyz)
        self.backend = backend

    def __call__(self, pc: torch.Tensor, clear_voxels: bool = True, empty_mean: bool = False):
        return self.generate_voxel_with_id(pc, clear_voxels, empty_mean)[:3]

    def generate_voxel_with_id(
        self, pc: torch.Tensor, clear_voxels: bool = True, empty_mean: bool = False
    ):
        _voxel.check_points(pc, "pc")
        if pc.device.type != self.device.type:
            raise ValueError(
                f"pc must be on a {self.device.type} device (the generator's), got {pc.device}"
            )
        if pc.shape[1] != self.num_point_features:
            raise ValueError(
                f"pc must have num_point_features = {self.num_point_features} columns, got {pc.shape[1]}"
            )
        with torch.no_grad():
            voxels, indices, num = voxelization(
                pc,
                self._vsize_xyz,
                self._range_xyz,
                self.max_num_points_per_voxel,
                self.max_num_voxels,
                True,
                backend=self.backend,
            )
            pc_voxel_id = point_voxel_ids(pc, self._vsize_xyz, self._range_xyz, self.max_num_voxels)
            if empty_mean and voxels.shape[0]:
                voxels = fill_empty_with_mean(voxels, num)
        return voxels, indices, num, pc_voxel_id


def point_voxel_ids(points, voxel_size, coors_range, max_voxels: int) -> torch.Tensor:
    """The output row of each point's voxel under deterministic hard voxelization (int64, -1:
    dropped point or dropped voxel): the voxel's rank in first-occurrence order, if below
    max_voxels. Vectorised PyTorch."""
    grid = _voxel.voxel_grid(voxel_size, coors_range)
    cell = _voxel.linear_cells(points, grid)
    n = points.shape[0]
    valid = cell >= 0
    ids = torch.full((n,), -1, dtype=torch.int64, device=points.device)
    idx = torch.nonzero(valid).squeeze(1)
    if idx.numel() == 0:
        return ids
    uniq, inverse = torch.unique(cell[idx], return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.int64, device=points.device)
    first = first.scatter_reduce(0, inverse, idx, "amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(first.numel(), device=points.device)
    r = rank[inverse]
    ids[idx] = torch.where(r < max_voxels, r, -1)
    return ids


def fill_empty_with_mean(voxels: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """spconv's empty_mean: slots k >= num[v] of voxel v take the mean of its num[v] points."""
    M, P, C = voxels.shape
    acc = torch.float64 if voxels.dtype == torch.float64 else torch.float32
    mean = voxels.to(acc).sum(dim=1) / num.clamp(min=1).to(acc)[:, None]
    empty = torch.arange(P, device=voxels.device)[None, :] >= num[:, None]
    return torch.where(empty[:, :, None], mean[:, None, :].to(voxels.dtype), voxels)
