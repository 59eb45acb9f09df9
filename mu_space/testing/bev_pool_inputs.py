"""Inputs of the BEV pooling ops built from real frustum geometry (`bev_geometry`), the way the
upstream models build them. Shared by tests, self-check cases and benchmarks.

- `bevfusion_inputs`: BEVFusion's `BaseTransform.bev_pool` -> `bev_pool(feats, coords, B, D, H, W)`.
- `bevdet_ranks`: BEVDet's `voxel_pooling_prepare_v2` before its sort (unsorted ranks, as
  DrivingSDK's `bev_pool_v3` takes them), optionally shuffled.
"""

from __future__ import annotations

import torch

from mu_space.testing import bev_geometry


def _config(cfg_or_name, channels: int | None):
    cfg = bev_geometry.CONFIGS[cfg_or_name] if isinstance(cfg_or_name, str) else cfg_or_name
    if channels is not None:
        cfg = bev_geometry.BEVConfig(**{**cfg.__dict__, "channels": channels})
    return cfg


def bevfusion_inputs(
    cfg_or_name="bevfusion-cam",
    *,
    batch: int | None = None,
    seed: int = 0,
    channels: int | None = None,
    dtype=torch.float32,
    device="cpu",
    keep_out_of_range: bool = False,
) -> dict:
    """`feats[n, C]`, `coords[n, 4]` int64 (x, y, z, batch) and B, D, H, W for `bev_pool`.

    As BEVFusion's vtransform: x = depth[:, :, :, None] * feat[:, :, None] (the lifted frustum
    features, [B, N, D, H, W, C]); geom = ((coor - (bx - dx / 2)) / dx).long() with bx the centre
    of the first cell (so bx - dx / 2 is the grid's lower bound, up to float32 rounding) and
    `.long()` truncating toward zero (points up to one cell below the lower bound land in cell 0:
    BEVFusion's own convention); points outside [0, nx) are filtered out unless
    `keep_out_of_range`. Then bev_pool(x, geom, B, nx[2], nx[0], nx[1]): D = z cells,
    H = x cells, W = y cells.
    """
    cfg = _config(cfg_or_name, channels)
    g = bev_geometry.make(cfg, batch=batch, seed=seed, device=device, dtype=torch.float32)
    cfg = g["config"]
    depth, feat, coor = g["depth"], g["feat"], g["coor"].to(torch.float32)
    B, C = cfg.batch, cfg.channels
    x = (depth.unsqueeze(-1) * feat.unsqueeze(2)).reshape(-1, C)
    dx = torch.tensor(cfg.grid_interval, dtype=torch.float32, device=device)
    bx = torch.tensor(cfg.grid_lower_bound, dtype=torch.float32, device=device) + dx / 2.0
    geom = ((coor - (bx - dx / 2.0)) / dx).long().reshape(-1, 3)
    per_batch = geom.shape[0] // B
    batch_ix = torch.arange(B, device=device).repeat_interleave(per_batch).unsqueeze(1)
    coords = torch.cat([geom, batch_ix], dim=1)
    nx = cfg.grid_size  # (X, Y, Z)
    if not keep_out_of_range:
        kept = ((geom >= 0) & (geom < torch.tensor(nx, device=device))).all(dim=1)
        x, coords = x[kept], coords[kept]
    return {
        "feats": x.to(dtype).contiguous(),
        "coords": coords.contiguous(),
        "B": B,
        "D": nx[2],
        "H": nx[0],
        "W": nx[1],
        "config": cfg,
    }


def bevdet_ranks(
    cfg_or_name="bevdet-r50",
    *,
    batch: int | None = None,
    seed: int = 0,
    channels: int | None = None,
    dtype=torch.float32,
    device="cpu",
    shuffle: bool = False,
) -> dict:
    """`depth, feat, ranks_depth, ranks_feat, ranks_bev` (int32, NOT sorted) and bev_feat_shape.

    As BEVDet's voxel_pooling_prepare_v2 up to (not including) its argsort: coor =
    ((coor - grid_lower_bound) / grid_interval).long(), points outside the grid dropped,
    ranks_bev = ((b*Z + z)*Y + y)*X + x. `shuffle` applies a random permutation (seeded).
    """
    cfg = _config(cfg_or_name, channels)
    g = bev_geometry.make(cfg, batch=batch, seed=seed, device=device, dtype=dtype)
    cfg = g["config"]
    B, N, D, H, W = g["depth"].shape
    X, Y, Z = cfg.grid_size
    ranks_depth = torch.arange(B * N * D * H * W, device=device)
    ranks_feat = (
        torch.arange(B * N * H * W, device=device)
        .reshape(B, N, 1, H, W)
        .expand(B, N, D, H, W)
        .reshape(-1)
    )
    lower = torch.tensor(cfg.grid_lower_bound, dtype=torch.float32, device=device)
    interval = torch.tensor(cfg.grid_interval, dtype=torch.float32, device=device)
    coor = ((g["coor"].to(torch.float32) - lower) / interval).long().reshape(-1, 3)
    batch_ix = torch.arange(B, device=device).repeat_interleave(N * D * H * W)
    kept = ((coor >= 0) & (coor < torch.tensor((X, Y, Z), device=device))).all(dim=1)
    coor, batch_ix = coor[kept], batch_ix[kept]
    ranks_depth, ranks_feat = ranks_depth[kept], ranks_feat[kept]
    ranks_bev = ((batch_ix * Z + coor[:, 2]) * Y + coor[:, 1]) * X + coor[:, 0]
    if shuffle:
        gen = torch.Generator().manual_seed(seed + 1)
        perm = torch.randperm(ranks_bev.shape[0], generator=gen).to(device)
        ranks_depth, ranks_feat, ranks_bev = ranks_depth[perm], ranks_feat[perm], ranks_bev[perm]
    return {
        "depth": g["depth"],
        "feat": g["feat"],
        "ranks_depth": ranks_depth.int(),
        "ranks_feat": ranks_feat.int(),
        "ranks_bev": ranks_bev.int(),
        "bev_feat_shape": cfg.bev_feat_shape,
        "config": cfg,
    }
