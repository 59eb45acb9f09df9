"""BEVDet-R50 hot path: the Lift-Splat-Shoot view transformer (BEVDet dev2.0
`LSSViewTransformer`), built from ordinary torch.nn modules, with muSPACE's prepare + pooling.

    img_feat [B*N, 512, 16, 44]  (the image neck's output)
      -> depth head  (1x1 conv, 512 -> D = 59)  -> softmax over D  -> depth [B, N, D, H, W]
      -> context head (1x1 conv, 512 -> C = 64)                   -> feat  [B, N, H, W, C]
      -> frustum geometry coor [B, N, D, H, W, 3]  (mu_space.testing.bev_geometry, 6 cameras)
      -> mu_space.bev_pool_prepare   (BEVDet's voxel_pooling_prepare_v2; every forward, as upstream)
      -> mu_space.bev_pool_v2        -> [B, C, Z=1, 128, 128] -> Z folded into C -> [B, 64, 128, 128]

The same weights and inputs run with backend A (default native) and backend B (default
reference); outputs and gradients (img_feat and every parameter) are compared, then forward +
backward is timed for both. Exit status 0 = agree, 1 = mismatch.

    python model_examples/BEVDet/scripts/bevdet_view_transformer.py               # GPU, upstream shapes
    python model_examples/BEVDet/scripts/bevdet_view_transformer.py --device cpu --small

Tolerances (max |a - b| <= tol * max |b| per tensor; see _common.compare):
- output 1e-5: float32 throughout; the native forward sums each BEV cell's points (up to ~480)
  in another order than the reference's index_add, so results differ by float32 rounding
  (~1e-7 relative per sum, measured per op in docs/operators/bev_pool_v2.md).
- gradients 1e-4: grad_feat is accumulated with float32 atomics natively (run-to-run order) and
  then contracted by the 1x1 convs over B*N*16*44 pixels; the softmax backward subtracts
  nearly equal numbers. Rounding grows with those sums; 1e-4 of the tensor's scale leaves ~10x
  headroom over float32 reordering while a wrong index or a missing term gives O(1) errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space  # noqa: E402
from mu_space.testing import bev_geometry  # noqa: E402

IN_CHANNELS = 512  # BEVDet-R50: FPNForBEVDet out_channels
SMALL_IN_CHANNELS = 16

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


def config(small: bool, batch: int) -> bev_geometry.BEVConfig:
    """bevdet-r50 (D 59, C 64, 16x44 features, 128x128 grid) or `tiny` for CPU checks."""
    base = bev_geometry.CONFIGS["tiny" if small else "bevdet-r50"]
    return bev_geometry.BEVConfig(**{**base.__dict__, "batch": batch})


def frustum(cfg: bev_geometry.BEVConfig, seed: int = 0) -> torch.Tensor:
    """coor [B, N, D, H, W, 3]: the nominal rig, each sample's cameras jittered by 2 cm."""
    g = torch.Generator().manual_seed(seed)
    return bev_geometry.frustum_points(cfg, jitter=0.02 if cfg.batch > 1 else 0.0, generator=g)


class LSSViewTransformer(nn.Module):
    """Depth + context heads, prepare, bev_pool_v2. `backend` goes to every muSPACE call."""

    def __init__(self, cfg: bev_geometry.BEVConfig, in_channels: int, backend: str = "auto"):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.depth_head = nn.Conv2d(in_channels, cfg.n_depth, kernel_size=1)
        self.context_head = nn.Conv2d(in_channels, cfg.channels, kernel_size=1)
        # BEVDet keeps the grid as buffers (grid_lower_bound, grid_interval, grid_size).
        self.register_buffer(
            "grid_lower_bound", torch.tensor(cfg.grid_lower_bound), persistent=False
        )
        self.register_buffer("grid_interval", torch.tensor(cfg.grid_interval), persistent=False)
        self.register_buffer(
            "grid_size", torch.tensor(cfg.grid_size, dtype=torch.float32), persistent=False
        )

    def forward(self, img_feat: torch.Tensor, coor: torch.Tensor) -> dict[str, torch.Tensor]:
        b, n = coor.shape[:2]
        h, w = img_feat.shape[-2:]
        depth = self.depth_head(img_feat).softmax(dim=1)  # [B*N, D, H, W]
        depth = depth.view(b, n, -1, h, w)
        feat = self.context_head(img_feat)  # [B*N, C, H, W]
        feat = feat.view(b, n, -1, h, w).permute(0, 1, 3, 4, 2).contiguous()  # channels last
        ranks = mu_space.bev_pool_prepare(
            coor,
            self.cfg.grid_lower_bound,
            self.cfg.grid_interval,
            self.cfg.grid_size,
            backend=self.backend,
        )
        bev = mu_space.bev_pool_v2(
            depth, feat, *ranks.bev_pool_v2_args(self.cfg.bev_feat_shape), backend=self.backend
        )  # [B, C, Z, Y, X]
        bev = torch.cat(bev.unbind(dim=2), dim=1)  # BEVDet folds Z into channels
        return {"bev": bev}


def make_inputs(cfg: bev_geometry.BEVConfig, in_channels: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, w = cfg.feature_hw
    img_feat = torch.randn(cfg.batch * cfg.cameras, in_channels, h, w, generator=g)
    return {"img_feat": img_feat.to(device), "coor": frustum(cfg, seed).to(device)}


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    args = _common.resolve(p.parse_args(argv))
    batch = args.batch or 1
    cfg = config(args.small, batch)
    in_ch = SMALL_IN_CHANNELS if args.small else IN_CHANNELS
    inputs = make_inputs(cfg, in_ch, args.device, args.seed)
    title = (
        f"BEVDet LSS view transformer ({cfg.name}: B {cfg.batch}, N {cfg.cameras}, "
        f"D {cfg.n_depth}, C {cfg.channels}, features {cfg.feature_hw}, "
        f"grid {cfg.grid_size})"
    )
    # coor is geometry, not a learnt input: keep it out of the gradient check.
    status = _common.run_ab(
        args,
        title,
        lambda backend: LSSViewTransformer(cfg, in_ch, backend),
        inputs,
        OUT_TOL,
        GRAD_TOL,
        no_grad_inputs=("coor",),
    )
    return status


if __name__ == "__main__":
    _common.entry(main)
