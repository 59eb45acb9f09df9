"""CenterPoint (voxel 0.075, nuScenes) LiDAR front end: the data preprocessor's voxelization
and the voxel encoder that feeds the sparse 3-D backbone, built from ordinary torch.nn modules
around muSPACE's voxel operators. Two variants, as in mmdet3d's CenterPoint configs:

  --mode hard (default)   mu_space.voxelization_batch (10 points, 120000 voxels per sample)
                          -> HardSimpleVFE (the mean of each voxel's points) -> Linear + BN +
                          ReLU (a stand-in for the first sparse convolution's per-voxel map)
  --mode dynamic          mu_space.dynamic_voxelize_batch (a voxel per point, -1 rows dropped)
                          -> DynamicVFE: per point the offset to its voxel's point mean
                          (mu_space.dynamic_scatter 'mean', mapped back through point2voxel)
                          and to the voxel centre, Linear + BN + ReLU, then
                          mu_space.dynamic_scatter 'max' -> voxel features [M, 64]

Output: the voxel features (the sparse backbone's input; its [41, 1440, 1440] sparse shape is
the grid). The same weights and inputs run with backend A (default native) and backend B
(default reference); outputs and parameter gradients are compared, then forward + backward is
timed for both. Exit status 0 = agree, 1 = mismatch.

    python model_examples/CenterPoint/scripts/centerpoint_hot_path.py                 # GPU
    python model_examples/CenterPoint/scripts/centerpoint_hot_path.py --mode dynamic
    python model_examples/CenterPoint/scripts/centerpoint_hot_path.py --device cpu --small

Config: centerpoint-0075-nus (mu_space.testing.lidar: voxel 0.075 x 0.075 x 0.2, range
+-54 m x [-5, 3], 10 points, 120000 / 160000 voxels, 10 nuScenes-like sweeps per sample).
--small: tiny-voxels.

Tolerances (max-relative, _common.compare): hard mode: voxelization is exact on both paths, so
1e-6 / 1e-5 as for any identical computation. Dynamic mode: dynamic_scatter's mean and sum
accumulate in input order on the native path and with torch's index_add (atomics on a GPU) on
the reference path: float32 rounding, ~1e-7 relative; the ReLU and the max downstream can turn
such a rounding difference into a different winner for a few (voxel, channel) pairs, so the
gradients are compared in the L2 norm (1e-4) and the output with 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space  # noqa: E402
from mu_space.ops.dynamic_scatter import dynamic_scatter_with_map  # noqa: E402
from mu_space.testing import lidar  # noqa: E402

FEAT = 64


class HardEncoder(nn.Module):
    """voxelization_batch -> HardSimpleVFE (mean of the points) -> Linear + BN + ReLU."""

    def __init__(self, cfg, in_channels, backend):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.linear = nn.Linear(in_channels, FEAT, bias=False)
        self.norm = nn.BatchNorm1d(FEAT, eps=1e-3, momentum=0.01)

    def forward(self, points, sample_sizes):
        cfg = self.cfg
        voxels, coors, num = mu_space.voxelization_batch(
            points,
            list(cfg.voxel_size),
            list(cfg.point_cloud_range),
            cfg.max_num_points,
            cfg.max_voxels[0],
            sample_sizes=sample_sizes.tolist(),
            backend=self.backend,
        )
        mean = voxels.sum(dim=1) / num.clamp(min=1).type_as(voxels)[:, None]  # HardSimpleVFE
        return {"voxel_feats": torch.relu(self.norm(self.linear(mean)))}


class DynamicEncoder(nn.Module):
    """dynamic_voxelize_batch -> mmdet3d's DynamicVFE (cluster + voxel centre offsets, one
    PFN layer, max scatter)."""

    def __init__(self, cfg, in_channels, backend):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        vs, pcr = cfg.voxel_size, cfg.point_cloud_range
        self.register_buffer("size", torch.tensor(vs[::-1]), persistent=False)  # (z, y, x)
        self.register_buffer(
            "offset", torch.tensor([vs[2] / 2 + pcr[2], vs[1] / 2 + pcr[1], vs[0] / 2 + pcr[0]]),
            persistent=False,
        )  # fmt: skip
        self.linear = nn.Linear(in_channels + 6, FEAT, bias=False)
        self.norm = nn.BatchNorm1d(FEAT, eps=1e-3, momentum=0.01)

    def forward(self, points, sample_sizes):
        cfg = self.cfg
        coors = mu_space.dynamic_voxelize_batch(
            points,
            list(cfg.voxel_size),
            list(cfg.point_cloud_range),
            sample_sizes=sample_sizes.tolist(),
            backend=self.backend,
        )
        kept = (coors >= 0).all(dim=1)
        xyz = points[:, :3]
        voxel_mean, _, p2v, _ = dynamic_scatter_with_map(xyz, coors, "mean", backend=self.backend)
        safe = p2v.long().clamp(min=0)
        f_cluster = torch.where(kept[:, None], xyz - voxel_mean[safe], 0)
        centre = coors[:, 1:].type_as(points) * self.size + self.offset  # (z, y, x)
        f_center = torch.where(kept[:, None], xyz - centre.flip(1), 0)
        feats = torch.cat((points, f_cluster, f_center), dim=1)
        x = torch.relu(self.norm(self.linear(feats)))
        voxel_feats, _ = mu_space.dynamic_scatter(x, coors, "max", backend=self.backend)
        return {"voxel_feats": voxel_feats}


def make_inputs(cfg, batch: int, device) -> dict:
    clouds = lidar.batch(cfg.cloud, batch)
    return {
        "points": torch.cat(clouds).to(device),
        "sample_sizes": torch.tensor([c.shape[0] for c in clouds]),  # host ints
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    p.add_argument("--mode", default="hard", choices=("hard", "dynamic"))
    args = _common.resolve(p.parse_args(argv))
    cfg = lidar.VOXEL_CONFIGS["tiny-voxels" if args.small else "centerpoint-0075-nus"]
    batch = args.batch or 2
    inputs = make_inputs(cfg, batch, args.device)
    in_ch = inputs["points"].shape[1]
    encoder = HardEncoder if args.mode == "hard" else DynamicEncoder
    gx, gy, gz = cfg.grid_size
    title = (
        f"CenterPoint front end, {args.mode} voxelization ({cfg.name}: B {batch}, "
        f"{inputs['points'].shape[0]} points, voxel {cfg.voxel_size}, grid [{gz + 1}, {gy}, {gx}])"
    )
    dynamic = args.mode == "dynamic"
    return _common.run_ab(
        args,
        title,
        lambda backend: encoder(cfg, in_ch, backend),
        inputs,
        1e-5 if dynamic else 1e-6,
        1e-4 if dynamic else 1e-5,
        no_grad_inputs=("points",),
        grad_metric="l2" if dynamic else "max",
    )


if __name__ == "__main__":
    _common.entry(main)
