"""Synthetic spinning-LiDAR point clouds for the voxel operators (tests, self-check, benchmarks).

A rig fires `beams` lasers at fixed elevations once per azimuth step; every ray is cast against
a ground plane, building walls along a street, and box-shaped cars, pedestrians and poles, and
the nearest hit within `max_range` becomes a point (no hit: no point, as on a real sensor). So
the clouds are as clustered as real frames: most points near the sensor and on the ground,
dense rings close in, sparse far away, shadowed regions behind objects. Multi-sweep clouds
(nuScenes' 10 sweeps) repeat the scan from earlier ego positions (the ego drives along +x),
expressed in the current frame, with the time lag in the last feature.

Point order is the sensor's: current sweep first, then older sweeps (mmdet3d's
`LoadPointsFromMultiSweeps` order), inside a sweep azimuth-major and beam-minor.

    cloud = lidar.make("nus-10sweeps")           # Tensor[~300k, 5]: x, y, z, intensity, time
    cfg = lidar.VOXEL_CONFIGS["pointpillars-kitti"]
    points = cfg.points()                          # the cloud of that config (cached, read-only)

Everything is seeded and deterministic; `make` caches its clouds (do not modify them in place).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Rig:
    """A spinning LiDAR: `beams` lasers between two elevations (degrees), `azimuth_steps`
    firings per revolution, mounted `height` metres above the ground."""

    name: str
    beams: int
    elevation: tuple[float, float]  # lowest, highest beam (degrees)
    azimuth_steps: int
    height: float
    max_range: float
    range_noise: float = 0.02  # metres (1 sigma)
    dropout: float = 0.03  # fraction of rays without a return (absorbing surfaces)


RIGS = {
    # Velodyne HDL-32E as on nuScenes (20 Hz: ~1085 firings per revolution)
    "hdl32": Rig("hdl32", 32, (-30.67, 10.67), 1085, 1.84, 80.0),
    # Velodyne HDL-64E as on KITTI (10 Hz: ~2080 firings per revolution)
    "hdl64": Rig("hdl64", 64, (-24.8, 2.0), 2080, 1.73, 90.0, dropout=0.08),
    # Waymo's top LiDAR (64 beams, +2.4 to -17.6 degrees, ~2650 firings per revolution)
    "waymo64": Rig("waymo64", 64, (-17.6, 2.4), 2650, 2.1, 75.0),
    # a small rig for loop-based tests (16 beams)
    "tiny16": Rig("tiny16", 16, (-25.0, 5.0), 160, 1.8, 40.0),
}


@dataclass(frozen=True)
class CloudConfig:
    """One cloud: a rig, a scene (seeded), sweeps and the feature layout.

    features: 4 = (x, y, z, intensity) (KITTI), 5 = (x, y, z, intensity, time lag) (nuScenes).
    returns: 2 adds a second (last) return for rays that graze an object edge or pass through
    vegetation-like clutter (Waymo keeps two returns per ray)."""

    name: str
    rig: str
    sweeps: int = 1
    sweep_dt: float = 0.05  # seconds between sweeps
    ego_speed: float = 10.0  # m/s along +x
    features: int = 5
    returns: int = 1
    cars: int = 24
    pedestrians: int = 16
    poles: int = 20
    street_half_width: float = 9.0
    seed: int = 0
    azimuth_steps: int = 0  # 0: the rig's; fewer gives smaller clouds (size sweeps)

    @property
    def rig_spec(self) -> Rig:
        rig = RIGS[self.rig]
        return replace(rig, azimuth_steps=self.azimuth_steps) if self.azimuth_steps else rig


CLOUDS = {
    "nus-1sweep": CloudConfig("nus-1sweep", "hdl32"),
    "nus-10sweeps": CloudConfig("nus-10sweeps", "hdl32", sweeps=10),
    "kitti": CloudConfig("kitti", "hdl64", features=4),
    "waymo": CloudConfig("waymo", "waymo64", returns=2, features=5),
    "tiny": CloudConfig("tiny", "tiny16", features=4, cars=6, pedestrians=4, poles=4),
    "tiny-3sweeps": CloudConfig(
        "tiny-3sweeps", "tiny16", sweeps=3, features=5, cars=6, pedestrians=4, poles=4
    ),
}


@dataclass(frozen=True)
class VoxelConfig:
    """A voxel layer as the upstream model configs set it (mmdet3d / CenterPoint)."""

    name: str
    cloud: str
    voxel_size: tuple[float, float, float]
    point_cloud_range: tuple[float, float, float, float, float, float]
    max_num_points: int
    max_voxels: tuple[int, int]  # (training, testing)

    def points(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return make(self.cloud, dtype=dtype)

    @property
    def grid_size(self) -> tuple[int, int, int]:
        """(X, Y, Z) cells, mmcv's round((max - min) / size) in float32."""
        from mu_space.ops import _voxel

        return _voxel.grid_size(self.voxel_size, self.point_cloud_range)


def layer_args(config: str) -> tuple:
    """(voxel_size, point_cloud_range, max_num_points, max_voxels at test time) of a
    VOXEL_CONFIGS entry, as lists and ints (what mmcv's Voxelization is built from)."""
    v = VOXEL_CONFIGS[config]
    return list(v.voxel_size), list(v.point_cloud_range), v.max_num_points, v.max_voxels[1]


VOXEL_CONFIGS = {
    # mmdet3d pointpillars_hv_secfpn_8xb6-160e_kitti-3d-car: 0.16 m pillars, 432 x 496 grid
    "pointpillars-kitti": VoxelConfig(
        "pointpillars-kitti",
        "kitti",
        (0.16, 0.16, 4.0),
        (0.0, -39.68, -3.0, 69.12, 39.68, 1.0),
        32,
        (16000, 40000),
    ),
    # mmdet3d pointpillars_hv_fpn_sbn-all_8xb4-2x_nus-3d: 0.25 m pillars, 400 x 400 grid
    "pointpillars-nus": VoxelConfig(
        "pointpillars-nus",
        "nus-10sweeps",
        (0.25, 0.25, 8.0),
        (-50.0, -50.0, -5.0, 50.0, 50.0, 3.0),
        64,
        (30000, 40000),
    ),
    # CenterPoint centerpoint_voxel0075_second_secfpn_..._nus-3d: [41, 1440, 1440] sparse shape
    "centerpoint-0075-nus": VoxelConfig(
        "centerpoint-0075-nus",
        "nus-10sweeps",
        (0.075, 0.075, 0.2),
        (-54.0, -54.0, -5.0, 54.0, 54.0, 3.0),
        10,
        (120000, 160000),
    ),
    # CenterPoint on Waymo (one frame, two returns): 0.1 x 0.1 x 0.15 voxels
    "centerpoint-waymo": VoxelConfig(
        "centerpoint-waymo",
        "waymo",
        (0.1, 0.1, 0.15),
        (-75.2, -75.2, -2.0, 75.2, 75.2, 4.0),
        5,
        (150000, 150000),
    ),
    # small: loop-based tests
    "tiny-pillars": VoxelConfig(
        "tiny-pillars",
        "tiny",
        (0.8, 0.8, 8.0),
        (-20.0, -20.0, -4.0, 20.0, 20.0, 4.0),
        8,
        (400, 400),
    ),
    "tiny-voxels": VoxelConfig(
        "tiny-voxels",
        "tiny-3sweeps",
        (0.5, 0.5, 0.5),
        (-16.0, -16.0, -3.0, 16.0, 16.0, 2.0),
        5,
        (1500, 1500),
    ),
}


# ----------------------------------------------------------------------------------- scene


@dataclass(frozen=True)
class Scene:
    """Oriented boxes (cx, cy, cz, length, width, height, yaw) and their material reflectivity."""

    boxes: torch.Tensor  # [K, 7] float64
    reflectivity: torch.Tensor  # [K] float64


def _scene(cfg: CloudConfig) -> Scene:
    """Buildings along both sides of a street along x, cars in two lanes and parked, pedestrians
    and poles on the sidewalks; seeded by cfg.seed."""
    g = torch.Generator().manual_seed(1000 + cfg.seed)

    def u(lo, hi, n=1):
        return lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)

    boxes, refl = [], []
    w = cfg.street_half_width
    # buildings: blocks of 12-30 m along x with 2-8 m gaps, 6-15 m deep, 5-25 m tall
    for side in (-1.0, 1.0):
        x = -100.0
        while x < 100.0:
            length = float(u(12.0, 30.0))
            depth = float(u(6.0, 15.0))
            setback = float(u(3.0, 7.0))
            cy = side * (w + setback + depth / 2)
            boxes.append([x + length / 2, cy, 0.0, length, depth, float(u(5.0, 25.0)) * 2, 0.0])
            refl.append(float(u(0.2, 0.5)))
            x += length + float(u(2.0, 8.0))
    lanes = (-w * 0.55, -w * 0.2, w * 0.2, w * 0.55)
    for k in range(cfg.cars):
        lane = lanes[k % len(lanes)]
        cx = float(u(-60.0, 60.0))
        if abs(cx) < 5.0 and abs(lane) < 3.0:  # not on top of the ego vehicle
            cx += 10.0
        yaw = float(u(-0.15, 0.15)) + (math.pi if lane > 0 else 0.0)
        length, width, height = float(u(3.9, 5.2)), float(u(1.7, 2.1)), float(u(1.4, 1.9))
        boxes.append([cx, lane + float(u(-0.4, 0.4)), height / 2, length, width, height, yaw])
        refl.append(float(u(0.3, 0.9)))
    for _ in range(cfg.pedestrians):
        side = 1.0 if float(u(0, 1)) > 0.5 else -1.0
        height = float(u(1.5, 1.9))
        boxes.append(
            [
                float(u(-40.0, 40.0)),
                side * (w + float(u(0.5, 2.5))),
                height / 2,
                0.6,
                0.6,
                height,
                float(u(0, math.pi)),
            ]
        )
        refl.append(float(u(0.2, 0.6)))
    for _ in range(cfg.poles):
        side = 1.0 if float(u(0, 1)) > 0.5 else -1.0
        boxes.append([float(u(-70.0, 70.0)), side * (w + 0.3), 3.0, 0.3, 0.3, 6.0, 0.0])
        refl.append(float(u(0.4, 0.8)))
    return Scene(torch.tensor(boxes, dtype=torch.float64), torch.tensor(refl, dtype=torch.float64))


def _ray_directions(rig: Rig) -> torch.Tensor:
    """Unit directions [azimuth_steps * beams, 3], azimuth-major, beam-minor."""
    lo, hi = rig.elevation
    elev = torch.deg2rad(torch.linspace(lo, hi, rig.beams, dtype=torch.float64))
    az = torch.arange(rig.azimuth_steps, dtype=torch.float64) * (2 * math.pi / rig.azimuth_steps)
    az = az[:, None].expand(-1, rig.beams).reshape(-1)
    el = elev[None, :].expand(rig.azimuth_steps, -1).reshape(-1)
    return torch.stack((el.cos() * az.cos(), el.cos() * az.sin(), el.sin()), dim=1)


def _cast(origin: torch.Tensor, dirs: torch.Tensor, scene: Scene, ground_z: float, max_range):
    """(t_first, t_last, reflectivity) of each ray: the nearest and the farthest hit within
    max_range (inf where none), and the reflectivity of the nearest surface."""
    n = dirs.shape[0]
    best = torch.full((n,), math.inf, dtype=torch.float64)
    last = torch.full((n,), math.inf, dtype=torch.float64)
    refl = torch.zeros(n, dtype=torch.float64)
    # ground plane
    down = dirs[:, 2] < -1e-9
    t_ground = torch.where(down, (ground_z - origin[2]) / dirs[:, 2].clamp(max=-1e-9), math.inf)
    t_ground = torch.where(t_ground > 0, t_ground, math.inf)
    best = torch.minimum(best, t_ground)
    refl = torch.where(best == t_ground, torch.full_like(refl, 0.15), refl)
    last = torch.where(torch.isfinite(t_ground), t_ground, last)
    # boxes, in chunks of rays (bounded memory)
    b = scene.boxes
    c, s = torch.cos(b[:, 6]), torch.sin(b[:, 6])
    half = b[:, 3:6] / 2
    rel = origin[None, :] - b[:, :3]  # [K, 3] sensor relative to box centres
    o_local = torch.stack(
        (c * rel[:, 0] + s * rel[:, 1], -s * rel[:, 0] + c * rel[:, 1], rel[:, 2]), dim=1
    )
    for start in range(0, n, 16384):
        d = dirs[start : start + 16384]
        dx = d[:, None, 0] * c[None] + d[:, None, 1] * s[None]
        dy = -d[:, None, 0] * s[None] + d[:, None, 1] * c[None]
        dz = d[:, None, 2].expand_as(dx)
        t_near = torch.full_like(dx, -math.inf)
        t_far = torch.full_like(dx, math.inf)
        for axis, dd in enumerate((dx, dy, dz)):
            o = o_local[None, :, axis]
            inv = 1.0 / torch.where(dd.abs() < 1e-12, torch.full_like(dd, 1e-12), dd)
            t1 = (-half[None, :, axis] - o) * inv
            t2 = (half[None, :, axis] - o) * inv
            t_near = torch.maximum(t_near, torch.minimum(t1, t2))
            t_far = torch.minimum(t_far, torch.maximum(t1, t2))
        hit = (t_far >= t_near) & (t_near > 0)
        t_hit = torch.where(hit, t_near, math.inf)
        t_min, k = t_hit.min(dim=1)
        t_exit = torch.where(hit, t_far, -math.inf).max(dim=1).values
        sl = slice(start, start + d.shape[0])
        closer = t_min < best[sl]
        best[sl] = torch.where(closer, t_min, best[sl])
        refl[sl] = torch.where(closer, scene.reflectivity[k], refl[sl])
        last[sl] = torch.where(torch.isfinite(t_exit) & (t_exit > 0), t_exit, last[sl])
    within = best <= max_range
    best = torch.where(within, best, math.inf)
    last = torch.where(within & (last <= max_range), last, math.inf)
    return best, last, refl


@functools.lru_cache(maxsize=16)
def _make_cached(cfg: CloudConfig) -> torch.Tensor:
    rig = cfg.rig_spec
    scene = _scene(cfg)
    g = torch.Generator().manual_seed(2000 + cfg.seed)
    dirs = _ray_directions(rig)
    sweeps = []
    for sweep in range(cfg.sweeps):
        lag = sweep * cfg.sweep_dt
        # earlier sweeps were taken from further back along +x; points in the current frame
        origin = torch.tensor([-cfg.ego_speed * lag, 0.0, 0.0], dtype=torch.float64)
        t, t_last, refl = _cast(origin, dirs, scene, -rig.height, rig.max_range)
        n = t.shape[0]
        keep = torch.isfinite(t) & (torch.rand(n, generator=g, dtype=torch.float64) >= rig.dropout)
        ranges = t + rig.range_noise * torch.randn(n, generator=g, dtype=torch.float64)
        incidence = dirs[:, 2].abs().clamp(min=0.05)  # grazing ground hits are dimmer
        inten = refl * (0.5 + 0.5 * incidence) + 0.05 * torch.rand(
            n, generator=g, dtype=torch.float64
        )
        rows = [(ranges, keep, inten)]
        if cfg.returns > 1:
            # second return: rays whose far side of an object (or ground behind it) lies
            # measurably beyond the first hit, for a share of them (edges, clutter)
            second = (
                torch.isfinite(t_last)
                & (t_last > t + 0.5)
                & (torch.rand(n, generator=g, dtype=torch.float64) < 0.2)
            )
            r2 = t_last + rig.range_noise * torch.randn(n, generator=g, dtype=torch.float64)
            rows.append((r2, second & keep, inten * 0.6))
        per_ray = []
        for r, k, it in rows:
            xyz = origin[None, :] + r[:, None] * dirs
            per_ray.append((xyz, k, it))
        # interleave returns per ray (sensor order), then drop rays without a return
        xyz = torch.stack([p[0] for p in per_ray], dim=1).reshape(-1, 3)
        kept = torch.stack([p[1] for p in per_ray], dim=1).reshape(-1)
        inten = torch.stack([p[2] for p in per_ray], dim=1).reshape(-1)
        cols = [xyz, inten[:, None].clamp(0.0, 1.0)]
        if cfg.features >= 5:
            cols.append(torch.full((xyz.shape[0], 1), lag, dtype=torch.float64))
        sweeps.append(torch.cat(cols, dim=1)[kept])
    cloud = torch.cat(sweeps, dim=0)
    if cfg.features > 5:
        extra = torch.rand(cloud.shape[0], cfg.features - 5, generator=g, dtype=torch.float64)
        cloud = torch.cat([cloud, extra], dim=1)
    return cloud.contiguous()


def make(config: str | CloudConfig, *, dtype: torch.dtype = torch.float32, device=None, **changes):
    """The cloud of a named (`CLOUDS`) or given config: Tensor[N, features] in `dtype` on
    `device`. `changes` override config fields (e.g. `sweeps=3`, `seed=1`). Cached: the same
    arguments return the same tensor object's values (a fresh tensor for another dtype or
    device); never modify it in place."""
    cfg = CLOUDS[config] if isinstance(config, str) else config
    if changes:
        cfg = replace(cfg, name=f"{cfg.name}+" + ",".join(f"{k}={v}" for k, v in changes.items()))
        cfg = replace(cfg, **changes)
    cloud = _make_cached(cfg)
    out = cloud.to(dtype)
    return out if device is None else out.to(device)


def batch(config: str | CloudConfig, n: int, *, dtype=torch.float32, device=None) -> list:
    """`n` different clouds of one config (seeds 0..n-1, so the frames differ): the list a
    data preprocessor receives for a batch of n samples."""
    cfg = CLOUDS[config] if isinstance(config, str) else config
    return [make(cfg, seed=cfg.seed + i, dtype=dtype, device=device) for i in range(n)]


def sweep_config(n_points: int, base: str = "nus-10sweeps") -> CloudConfig:
    """A cloud of about n_points points for size sweeps: the base rig with as many sweeps as
    needed (each ~34k points for the 32-beam rig), from 1 sweep up."""
    cfg = CLOUDS[base]
    per_sweep = _make_cached(replace(cfg, sweeps=1, name=f"{cfg.name}-1")).shape[0]
    if n_points < per_sweep:  # one partial-resolution sweep: fewer firings per revolution
        steps = max(16, round(cfg.rig_spec.azimuth_steps * n_points / per_sweep))
        return replace(cfg, name=f"{base}-az{steps}", sweeps=1, azimuth_steps=steps)
    sweeps = max(1, round(n_points / per_sweep))
    return replace(cfg, name=f"{base}-x{sweeps}", sweeps=sweeps)
