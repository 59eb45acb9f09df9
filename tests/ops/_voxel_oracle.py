"""Independent straightforward statements of the upstream voxel semantics, as Python loops over
points (small inputs only). They use numpy float32 scalars for mmcv's float arithmetic and share
no code with mu_space.ops._voxel, so the vectorised references are checked against something
written separately from them.

- mmcv_grid / mmcv_coor: mmcv's launcher and dynamic_voxelize_kernel arithmetic;
- mmcv_hard: mmcv's deterministic hard voxelization (point_to_voxelidx_kernel and the
  sequential determin_voxel_num), written with a dict instead of the O(N^2) scan;
- mmcv_dynamic: mmcv's dynamic rows including the -1 pattern of dropped points;
- mmcv_scatter: mmcv's dynamic_scatter (unique_dim order, sums, means, fmaxf max, the backward
  tie rule);
- pillars: mmdet3d's PointPillarsScatter.forward_batch (last row of a cell wins here).
"""

from __future__ import annotations

import math

import numpy as np
import torch

f32 = np.float32


def c_round(x: float) -> int:
    """C's round(): half away from zero."""
    return int(math.floor(abs(x) + 0.5)) * (1 if x >= 0 else -1)


def mmcv_grid(voxel_size, coors_range):
    """(gx, gy, gz): round((max - min) / size) with float32 operands (mmcv's launcher)."""
    return tuple(
        c_round(float((f32(coors_range[a + 3]) - f32(coors_range[a])) / f32(voxel_size[a])))
        for a in range(3)
    )


def _floor_cell(p, lo, size, dtype):
    if dtype == torch.float64:  # mmcv's double path: the double quotient, then floorf(float)
        q = f32((float(p) - float(f32(lo))) / float(f32(size)))
    else:
        q = (f32(p) - f32(lo)) / f32(size)
    q = float(q)
    if math.isnan(q) or math.isinf(q):
        return None  # muSPACE: NaN / inf are invalid (mmcv: NaN -> cell 0)
    return math.floor(q)


def mmcv_coor(point, voxel_size, coors_range, grid, dtype=torch.float32):
    """(cz, cy, cx), or the dynamic row of a dropped point: x out -> (-1, 0, 0), y out ->
    (-1, -1, 0), z out -> (-1, -1, -1). Returns (row, valid)."""
    c = []
    for a in range(3):
        v = _floor_cell(point[a], coors_range[a], voxel_size[a], dtype)
        if v is None or v < 0 or v >= grid[a]:
            row = [(-1, 0, 0), (-1, -1, 0), (-1, -1, -1)][a]
            return row, False
        c.append(v)
    return (c[2], c[1], c[0]), True


def mmcv_dynamic(points: torch.Tensor, voxel_size, coors_range) -> torch.Tensor:
    grid = mmcv_grid(voxel_size, coors_range)
    pts = points.detach().cpu().double().tolist()  # exact for every input dtype
    rows = [mmcv_coor(p, voxel_size, coors_range, grid, points.dtype)[0] for p in pts]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)


def mmcv_hard(points: torch.Tensor, voxel_size, coors_range, max_points, max_voxels):
    """(voxels, coors, num_points) of mmcv's deterministic hard voxelization."""
    grid = mmcv_grid(voxel_size, coors_range)
    n, C = points.shape
    pts = points.detach().cpu()
    vals = pts.double().tolist()  # exact for every input dtype
    voxel_of = {}  # coordinate -> voxel id (-1: first seen when max_voxels were full)
    coords, slots = [], []
    for i in range(n):
        row, ok = mmcv_coor(vals[i], voxel_size, coors_range, grid, pts.dtype)
        if not ok or max_points == 0:
            continue
        if row not in voxel_of:
            voxel_of[row] = len(coords) if len(coords) < max_voxels else -1
            if voxel_of[row] >= 0:
                coords.append(row)
                slots.append([])
        v = voxel_of[row]
        if v >= 0 and len(slots[v]) < max_points:
            slots[v].append(i)
    M = len(coords)
    voxels = torch.zeros((M, max_points, C), dtype=pts.dtype)
    for v, members in enumerate(slots):
        for k, i in enumerate(members):
            voxels[v, k] = pts[i]
    coors = torch.tensor(coords, dtype=torch.int32).reshape(M, 3)
    num = torch.tensor([len(s) for s in slots], dtype=torch.int32)
    return voxels, coors, num


def mmcv_scatter(feats: torch.Tensor, coors: torch.Tensor, reduce: str):
    """(voxel_feats float64, voxel_coors, members: list of point-index lists per voxel)."""
    rows = coors.tolist()
    groups: dict = {}
    for i, r in enumerate(rows):
        if min(r) < 0:
            continue
        groups.setdefault(tuple(r), []).append(i)
    keys = sorted(groups)
    f = feats.detach().cpu().double()
    out = torch.zeros((len(keys), feats.shape[1]), dtype=torch.float64)
    for v, key in enumerate(keys):
        members = groups[key]
        for c in range(feats.shape[1]):
            values = [f[i, c].item() for i in members]
            if reduce == "max":
                m = -math.inf
                for x in values:
                    if not math.isnan(x) and x > m:  # fmaxf: NaN ignored
                        m = x
                out[v, c] = m
            else:
                s = sum(values)
                out[v, c] = s / len(values) if reduce == "mean" else s
    voxel_coors = torch.tensor(keys, dtype=coors.dtype).reshape(len(keys), coors.shape[1])
    return out, voxel_coors, [groups[k] for k in keys]


def mmcv_scatter_grad(feats, reduce, voxel_feats, members, grad):
    """mmcv's backward: sum copies, mean divides by the count, max gives the gradient to the
    lowest point index whose feature equals the voxel's maximum (per channel)."""
    n, C = feats.shape
    f = feats.detach().cpu().double()
    g = grad.detach().cpu().double()
    out = torch.zeros((n, C), dtype=torch.float64)
    for v, pts in enumerate(members):
        for c in range(C):
            if reduce == "max":
                for i in pts:  # ascending
                    if f[i, c].item() == voxel_feats[v, c].item():
                        out[i, c] = g[v, c]
                        break
            else:
                for i in pts:
                    out[i, c] = g[v, c] / (len(pts) if reduce == "mean" else 1)
    return out


def pillars(feats: torch.Tensor, coors: torch.Tensor, batch_size: int, ny: int, nx: int):
    """PointPillarsScatter.forward_batch, with out-of-range rows dropped and the last row of a
    cell winning (float64 canvas, and the winner of every cell)."""
    C = feats.shape[1]
    canvas = torch.zeros((batch_size, C, ny, nx), dtype=torch.float64)
    winner = {}
    for i, (b, _z, y, x) in enumerate(coors.tolist()):
        if 0 <= b < batch_size and 0 <= y < ny and 0 <= x < nx:
            winner[(b, y, x)] = i
    f = feats.detach().cpu().double()
    for (b, y, x), i in winner.items():
        canvas[b, :, y, x] = f[i]
    return canvas, winner
