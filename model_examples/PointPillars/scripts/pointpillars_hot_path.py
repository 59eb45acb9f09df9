"""PointPillars LiDAR front end (mmdet3d `PointPillars`: data preprocessor voxelization,
`PillarFeatureNet`, `PointPillarsScatter`), built from ordinary torch.nn modules around
muSPACE's `voxelization_batch` and `pillar_scatter`.

    points (B clouds from the synthetic LiDAR, 10 nuScenes-like sweeps each)
      -> mu_space.voxelization_batch: voxels [M, 64, C], coors [M, 4] (b, z, y, x), num_points [M]
         (what Det3DDataPreprocessor builds with mmcv's Voxelization per sample)
      -> PillarFeatureNet: + offsets to the pillar's point mean and centre, padding masked,
         Linear(C + 5 -> 64, no bias) + BatchNorm1d + ReLU, max over the points -> [M, 64]
      -> mu_space.pillar_scatter -> BEV canvas [B, 64, ny, nx]
      -> a 3x3 conv (the first layer of the BEV backbone)

The same weights and inputs run with backend A (default native) and backend B (default
reference); the output and the gradients of every parameter are compared, then forward +
backward is timed for both. Exit status 0 = agree, 1 = mismatch.

    python model_examples/PointPillars/scripts/pointpillars_hot_path.py             # GPU, nuScenes shapes
    python model_examples/PointPillars/scripts/pointpillars_hot_path.py --config pointpillars-kitti
    python model_examples/PointPillars/scripts/pointpillars_hot_path.py --device cpu --small

Configs (mu_space.testing.lidar.VOXEL_CONFIGS): pointpillars-nus (mmdet3d
pointpillars_hv_fpn_sbn-all_8xb4-2x_nus-3d: 0.25 x 0.25 x 8 m pillars, 64 points, 30000 /
40000 voxels, 400 x 400 grid), pointpillars-kitti (0.16 m pillars, 32 points, 16000 / 40000,
432 x 496). --small: tiny-pillars (CPU checks and CI).

Tolerances (max |a - b| <= tol * max |b|; _common.compare): voxelization and pillar_scatter are
exact on both paths (copies), so A and B see identical tensors and the rest is the same torch
code: 1e-6 for the output, 1e-5 for the gradients (headroom for torch's own nondeterministic
reductions on the GPU, e.g. BatchNorm's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space  # noqa: E402
from mu_space.testing import lidar  # noqa: E402

OUT_TOL = 1e-6
GRAD_TOL = 1e-5
FEAT = 64


class PillarFeatureNet(nn.Module):
    """mmdet3d's PillarFeatureNet (with_cluster_center, with_voxel_center, one PFN layer)."""

    def __init__(self, in_channels: int, voxel_size, pcr):
        super().__init__()
        self.vx, self.vy = voxel_size[0], voxel_size[1]
        self.x_offset = self.vx / 2 + pcr[0]
        self.y_offset = self.vy / 2 + pcr[1]
        self.linear = nn.Linear(in_channels + 5, FEAT, bias=False)
        self.norm = nn.BatchNorm1d(FEAT, eps=1e-3, momentum=0.01)

    def forward(self, voxels, num_points, coors):
        xyz = voxels[:, :, :3]
        mean = xyz.sum(dim=1, keepdim=True) / num_points.clamp(min=1).type_as(voxels).view(-1, 1, 1)
        f_cluster = xyz - mean
        f_center = torch.stack(
            (
                xyz[:, :, 0] - (coors[:, 3].type_as(voxels)[:, None] * self.vx + self.x_offset),
                xyz[:, :, 1] - (coors[:, 2].type_as(voxels)[:, None] * self.vy + self.y_offset),
            ),
            dim=2,
        )
        features = torch.cat((voxels, f_cluster, f_center), dim=2)
        P = voxels.shape[1]
        mask = torch.arange(P, device=voxels.device)[None, :] < num_points[:, None]
        features = features * mask.unsqueeze(2).type_as(features)
        x = self.linear(features)
        x = self.norm(x.permute(0, 2, 1)).permute(0, 2, 1)
        return torch.relu(x).max(dim=1).values


class PointPillarsFrontEnd(nn.Module):
    def __init__(self, cfg: lidar.VoxelConfig, in_channels: int, batch: int, backend: str):
        super().__init__()
        self.cfg, self.batch, self.backend = cfg, batch, backend
        gx, gy, _ = cfg.grid_size
        self.shape = (gy, gx)
        self.encoder = PillarFeatureNet(in_channels, cfg.voxel_size, cfg.point_cloud_range)
        self.backbone = nn.Conv2d(FEAT, FEAT, 3, padding=1, bias=False)

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
        pillars = self.encoder(voxels, num, coors)
        canvas = mu_space.pillar_scatter(
            pillars, coors, self.batch, self.shape, backend=self.backend
        )
        return {"bev": self.backbone(canvas)}


def make_inputs(cfg: lidar.VoxelConfig, batch: int, device) -> dict:
    clouds = lidar.batch(cfg.cloud, batch)
    return {
        "points": torch.cat(clouds).to(device),
        "sample_sizes": torch.tensor([c.shape[0] for c in clouds]),  # host ints
    }


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", default="pointpillars-nus", choices=("pointpillars-nus", "pointpillars-kitti")
    )
    args = _common.resolve(p.parse_args(argv))
    cfg = lidar.VOXEL_CONFIGS["tiny-pillars" if args.small else args.config]
    batch = args.batch or 2
    inputs = make_inputs(cfg, batch, args.device)
    in_ch = inputs["points"].shape[1]
    gx, gy, _ = cfg.grid_size
    title = (
        f"PointPillars front end ({cfg.name}: B {batch}, {inputs['points'].shape[0]} points, "
        f"pillars {cfg.voxel_size}, {cfg.max_num_points} points x {cfg.max_voxels[0]} voxels, "
        f"canvas {gy} x {gx} x {FEAT})"
    )
    return _common.run_ab(
        args,
        title,
        lambda backend: PointPillarsFrontEnd(cfg, in_ch, batch, backend),
        inputs,
        OUT_TOL,
        GRAD_TOL,
        no_grad_inputs=("points",),
        op_checks={"pillar_scatter": _common.OpCheck(0.0, 0.0)},
    )


if __name__ == "__main__":
    _common.entry(main)
