"""BEVFusion camera branch hot path: the LSS camera-to-BEV vtransform (BEVFusion
`mmdet3d/models/vtransforms/base.py` + `lss.py`), built from ordinary torch.nn modules, with
muSPACE's `bev_pool`.

    img_feat [B*N, 256, 32, 88]  (the camera neck's output)
      -> depthnet (1x1 conv, 256 -> D + C = 118 + 80); softmax over the D depth bins
      -> lifted features x = depth (outer) context -> [B, N, D, H, W, C], flattened to [n, C]
      -> frustum geometry [B, N, D, H, W, 3] (mu_space.testing.bev_geometry, 6 cameras)
      -> voxel coords ((geom - lower) / interval).long() + batch index; points outside dropped
      -> mu_space.bev_pool(x, coords, B, Z, X, Y) -> [B, C, Z=1, 360, 360] -> Z folded into C

The same weights and inputs run with backend A (default native) and backend B (default
reference); outputs and gradients (img_feat and every parameter) are compared, then forward +
backward is timed for both. Exit status 0 = agree, 1 = mismatch.

    python model_examples/BEVFusion/scripts/bevfusion_vtransform.py               # GPU, upstream shapes
    python model_examples/BEVFusion/scripts/bevfusion_vtransform.py --device cpu --small

Tolerances (max |a - b| <= tol * max |b| per tensor; see _common.compare):
- output 1e-5: float32; the native path sums each cell's points (up to a few hundred) in
  ascending point order after its counting sort, the reference with index_add: the same terms
  in another order, float32 rounding only (~1e-7 relative).
- gradients 1e-4: bev_pool's backward is a row gather in both paths (exact), but the gradient
  then passes the outer product, the softmax backward (differences of nearly equal numbers) and
  the 1x1 conv's sums over B*N*32*88 pixels, all of which amplify the forward's rounding;
  1e-4 of the tensor's scale leaves headroom while a wrong index gives O(1) errors.
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

IN_CHANNELS = 256  # BEVFusion LSSTransform in_channels (camera neck output)
SMALL_IN_CHANNELS = 16

OUT_TOL = 1e-5
GRAD_TOL = 1e-4


def config(small: bool, batch: int) -> bev_geometry.BEVConfig:
    """bevfusion-cam (D 118, C 80, 32x88 features, 360x360 grid) or `tiny` for CPU checks."""
    base = bev_geometry.CONFIGS["tiny" if small else "bevfusion-cam"]
    return bev_geometry.BEVConfig(**{**base.__dict__, "batch": batch})


class LSSVTransform(nn.Module):
    """depthnet, lift, voxel coords, bev_pool. `backend` goes to the muSPACE call."""

    def __init__(self, cfg: bev_geometry.BEVConfig, in_channels: int, backend: str = "auto"):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.D, self.C = cfg.n_depth, cfg.channels
        self.depthnet = nn.Conv2d(in_channels, self.D + self.C, kernel_size=1)
        self.register_buffer("lower", torch.tensor(cfg.grid_lower_bound), persistent=False)
        self.register_buffer("interval", torch.tensor(cfg.grid_interval), persistent=False)
        self.register_buffer("nx", torch.tensor(cfg.grid_size, dtype=torch.int64), persistent=False)

    def lift(self, img_feat: torch.Tensor, b: int, n: int) -> torch.Tensor:
        h, w = img_feat.shape[-2:]
        x = self.depthnet(img_feat)
        depth = x[:, : self.D].softmax(dim=1)
        ctx = x[:, self.D : self.D + self.C]
        x = depth.unsqueeze(1) * ctx.unsqueeze(2)  # [B*N, C, D, H, W]
        return x.view(b, n, self.C, self.D, h, w).permute(0, 1, 3, 4, 5, 2)  # [B, N, D, H, W, C]

    def forward(self, img_feat: torch.Tensor, geom: torch.Tensor) -> dict[str, torch.Tensor]:
        b, n = geom.shape[:2]
        x = self.lift(img_feat, b, n).reshape(-1, self.C)
        coords = ((geom - self.lower) / self.interval).long().view(-1, 3)
        batch_ix = torch.arange(b, device=geom.device).repeat_interleave(geom[0].numel() // 3)
        coords = torch.cat([coords, batch_ix[:, None]], dim=1)  # (x, y, z, batch)
        kept = ((coords[:, :3] >= 0) & (coords[:, :3] < self.nx)).all(dim=1)
        x, coords = x[kept], coords[kept]
        nx, ny, nz = self.cfg.grid_size
        bev = mu_space.bev_pool(x, coords, b, nz, nx, ny, backend=self.backend)  # [B, C, Z, X, Y]
        return {"bev": torch.cat(bev.unbind(dim=2), dim=1)}


def make_inputs(cfg: bev_geometry.BEVConfig, in_channels: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    h, w = cfg.feature_hw
    img_feat = torch.randn(cfg.batch * cfg.cameras, in_channels, h, w, generator=g)
    geom = bev_geometry.frustum_points(cfg, jitter=0.02 if cfg.batch > 1 else 0.0, generator=g)
    return {"img_feat": img_feat.to(device), "geom": geom.to(device)}


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    args = _common.resolve(p.parse_args(argv))
    cfg = config(args.small, args.batch or 1)
    in_ch = SMALL_IN_CHANNELS if args.small else IN_CHANNELS
    inputs = make_inputs(cfg, in_ch, args.device, args.seed)
    title = (
        f"BEVFusion LSS camera vtransform ({cfg.name}: B {cfg.batch}, N {cfg.cameras}, "
        f"D {cfg.n_depth}, C {cfg.channels}, features {cfg.feature_hw}, grid {cfg.grid_size})"
    )
    return _common.run_ab(
        args,
        title,
        lambda backend: LSSVTransform(cfg, in_ch, backend),
        inputs,
        OUT_TOL,
        GRAD_TOL,
        no_grad_inputs=("geom",),
    )


if __name__ == "__main__":
    _common.entry(main)
