"""Camera-frustum geometry for BEV pooling inputs (Lift-Splat-Shoot / BEVDet style).

Six surround cameras with pinhole intrinsics and nuScenes-like extrinsics (mounted ~1.5 m up,
looking out at yaw 0, ±55°, ±110°, 180°); every feature-map pixel is lifted along `D` depth
bins, giving ego-frame points `coor[B, N, D, H, W, 3]`. Pooled into a 0.8 m BEV grid this gives
intervals of the real length distribution (mean ~15-25 points, a few hundred near the ego
vehicle), which uniform noise does not.

Named configs follow the model configs they come from; `BEVConfig.make(...)` builds one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (yaw in degrees, x, y in metres, focal scale) per camera: front, front-right, front-left,
# back, back-left, back-right. The back camera is wider (nuScenes: f ~ 800 vs ~1260 px).
CAMERAS = (
    (0.0, 1.70, 0.00, 1.00),
    (-55.0, 1.55, -0.49, 1.00),
    (55.0, 1.52, 0.49, 1.00),
    (180.0, 0.03, 0.00, 0.64),
    (110.0, 1.04, 0.48, 1.00),
    (-110.0, 1.05, -0.48, 1.00),
)
_CAMERA_HEIGHT = 1.5


@dataclass(frozen=True)
class BEVConfig:
    name: str
    batch: int = 1
    cameras: int = 6
    image_hw: tuple[int, int] = (256, 704)
    feature_hw: tuple[int, int] = (16, 44)
    depth: tuple[float, float, float] = (1.0, 60.0, 1.0)  # start, stop, step (BEVDet grid_config)
    channels: int = 64
    x: tuple[float, float, float] = (-51.2, 51.2, 0.8)
    y: tuple[float, float, float] = (-51.2, 51.2, 0.8)
    z: tuple[float, float, float] = (-5.0, 3.0, 8.0)

    @property
    def n_depth(self) -> int:
        start, stop, step = self.depth
        return int(round((stop - start) / step))

    @property
    def grid_size(self) -> tuple[int, int, int]:
        """(X, Y, Z) cell counts, BEVDet order."""
        return tuple(int(round((hi - lo) / step)) for lo, hi, step in (self.x, self.y, self.z))

    @property
    def grid_lower_bound(self) -> tuple[float, float, float]:
        return (self.x[0], self.y[0], self.z[0])

    @property
    def grid_interval(self) -> tuple[float, float, float]:
        return (self.x[2], self.y[2], self.z[2])

    @property
    def bev_feat_shape(self) -> tuple[int, int, int, int, int]:
        """(B, Z, Y, X, C) as BEVDet's bev_pool_v2 takes it."""
        gx, gy, gz = self.grid_size
        return (self.batch, gz, gy, gx, self.channels)


CONFIGS = {
    # BEVDet-R50 (256x704 input, 16x44 features), depth bins of bevdet-r50 / -d88 / -d118 variants.
    "bevdet-r50": BEVConfig("bevdet-r50", depth=(1.0, 60.0, 1.0), channels=64),
    "bevdet-r50-d88": BEVConfig("bevdet-r50-d88", depth=(1.0, 45.0, 0.5), channels=80),
    "bevdet-d118": BEVConfig("bevdet-d118", depth=(1.0, 60.0, 0.5), channels=80),
    # BEVFusion camera branch: 256x704 input, 32x88 features, 0.3 m cells on a 360x360 grid.
    "bevfusion-cam": BEVConfig(
        "bevfusion-cam",
        feature_hw=(32, 88),
        depth=(1.0, 60.0, 0.5),
        channels=80,
        x=(-54.0, 54.0, 0.3),
        y=(-54.0, 54.0, 0.3),
        z=(-10.0, 10.0, 20.0),
    ),
    # Small enough for float64 gradcheck and CPU tests, same geometry.
    "tiny": BEVConfig(
        "tiny",
        cameras=6,
        image_hw=(64, 176),
        feature_hw=(4, 11),
        depth=(1.0, 41.0, 4.0),
        channels=5,
        x=(-40.0, 40.0, 4.0),
        y=(-40.0, 40.0, 4.0),
        z=(-5.0, 3.0, 8.0),
    ),
}


def intrinsics(cfg: BEVConfig, focal_scale: float = 1.0) -> torch.Tensor:
    """3x3 pinhole intrinsics at the network input size (nuScenes 1600x900 resized by 0.44
    and cropped, as BEVDet's data pipeline does)."""
    h, w = cfg.image_hw
    scale = w / 1600.0
    f = 1266.0 * scale * focal_scale
    return torch.tensor(
        [[f, 0.0, w / 2.0], [0.0, f, h * 0.3], [0.0, 0.0, 1.0]], dtype=torch.float64
    )


def camera_to_ego(yaw_deg: float, x: float, y: float) -> torch.Tensor:
    """4x4 transform from camera frame (x right, y down, z forward) to ego frame."""
    yaw = math.radians(yaw_deg)
    forward = (math.cos(yaw), math.sin(yaw), 0.0)
    right = (math.sin(yaw), -math.cos(yaw), 0.0)
    down = (0.0, 0.0, -1.0)
    t = torch.eye(4, dtype=torch.float64)
    t[:3, 0], t[:3, 1], t[:3, 2] = torch.tensor(right), torch.tensor(down), torch.tensor(forward)
    t[:3, 3] = torch.tensor([x, y, _CAMERA_HEIGHT])
    return t


def frustum_points(
    cfg: BEVConfig,
    *,
    jitter: float = 0.0,
    generator: torch.Generator | None = None,
    device="cpu",
    dtype=torch.float32,
) -> torch.Tensor:
    """Ego-frame coordinates `coor[B, N, D, H, W, 3]` of every lifted frustum point.

    `jitter` (metres, std) perturbs each camera's mounting per batch element, as different
    samples' calibrations do; 0 gives the nominal rig.
    """
    n_cam = cfg.cameras
    if n_cam > len(CAMERAS):
        raise ValueError(f"at most {len(CAMERAS)} cameras, got {n_cam}")
    h_in, w_in = cfg.image_hw
    h_f, w_f = cfg.feature_hw
    start, _, step = cfg.depth
    depth = start + step * torch.arange(cfg.n_depth, dtype=torch.float64)
    v = torch.linspace(0, h_in - 1, h_f, dtype=torch.float64)
    u = torch.linspace(0, w_in - 1, w_f, dtype=torch.float64)
    d, vv, uu = torch.meshgrid(depth, v, u, indexing="ij")
    pix = torch.stack([uu * d, vv * d, d], dim=-1)  # [D, H, W, 3]
    out = torch.empty(cfg.batch, n_cam, cfg.n_depth, h_f, w_f, 3, dtype=torch.float64)
    for b in range(cfg.batch):
        for n, (yaw, x, y, focal) in enumerate(CAMERAS[:n_cam]):
            cam = pix @ torch.linalg.inv(intrinsics(cfg, focal)).T
            ext = camera_to_ego(yaw, x, y)
            if jitter:
                ext[:3, 3] += jitter * torch.randn(3, generator=generator, dtype=torch.float64)
            out[b, n] = cam @ ext[:3, :3].T + ext[:3, 3]
    return out.to(device=device, dtype=dtype)


def make(
    cfg_or_name: BEVConfig | str,
    *,
    batch: int | None = None,
    seed: int = 0,
    device="cpu",
    dtype=torch.float32,
) -> dict:
    """Everything a BEV pooling call needs: geometry plus softmaxed depth and features.

    Returns a dict with `coor [B,N,D,H,W,3]`, `depth [B,N,D,H,W]` (softmax over D, as the depth
    head produces), `feat [B,N,H,W,C]` (channels last), grid bounds and `bev_feat_shape`.
    """
    cfg = CONFIGS[cfg_or_name] if isinstance(cfg_or_name, str) else cfg_or_name
    if batch is not None:
        cfg = BEVConfig(**{**cfg.__dict__, "batch": batch})
    g = torch.Generator().manual_seed(seed)
    b, n, d, (h, w), c = cfg.batch, cfg.cameras, cfg.n_depth, cfg.feature_hw, cfg.channels
    coor = frustum_points(cfg, jitter=0.02 if b > 1 else 0.0, generator=g)
    logits = 2.0 * torch.randn(b, n, d, h, w, generator=g)
    depth = torch.softmax(logits, dim=2)
    feat = torch.randn(b, n, h, w, c, generator=g)
    return {
        "config": cfg,
        "coor": coor.to(device),
        "depth": depth.to(device=device, dtype=dtype),
        "feat": feat.to(device=device, dtype=dtype),
        "grid_lower_bound": cfg.grid_lower_bound,
        "grid_interval": cfg.grid_interval,
        "grid_size": cfg.grid_size,
        "bev_feat_shape": cfg.bev_feat_shape,
    }
