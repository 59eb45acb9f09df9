"""Realistic inputs of the 3D box operators: LiDAR boxes with nuScenes-like class sizes, point
clouds clustered on a ground plane and on the objects, NMS candidates (several noisy detections
per object plus false positives) and the geometric edge cases of rotated rectangles.

Everything is seeded and built on the CPU in float32 (move it with `.to(device)`). Point clouds
are generated here until `mu_space.testing.lidar` (issue 10) provides them; the layout is the
same ([n, 3] x, y, z in metres, sensor at the origin, ground at z = -1.8 m).

Box layout: LiDAR [x, y, z, dx, dy, dz, yaw] with z the BOTTOM of the box (mmcv's
points_in_boxes / RoI pooling convention), yaw counter-clockwise from +x.
"""

from __future__ import annotations

import math

import torch

GROUND_Z = -1.8
# (name, dx, dy, dz, share) nuScenes-like mean sizes in metres and class shares
CLASSES = (
    ("car", 4.6, 1.95, 1.73, 0.50),
    ("pedestrian", 0.73, 0.67, 1.77, 0.25),
    ("bicycle", 1.76, 0.6, 1.29, 0.08),
    ("truck", 6.9, 2.5, 2.8, 0.10),
    ("barrier", 0.5, 2.5, 0.98, 0.07),
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lidar_boxes(n: int, *, seed: int = 0, extent: float = 50.0, min_gap: bool = True):
    """[n, 7] float32 LiDAR boxes on the ground of a (2 * extent) m square scene: class sizes with
    10% jitter, yaw uniform in [-pi, pi). With min_gap, centres are at least one car length
    apart where the scene allows (real objects rarely overlap)."""
    g = _gen(seed)
    shares = torch.tensor([c[4] for c in CLASSES])
    cls = torch.multinomial(shares, n, replacement=True, generator=g) if n else torch.zeros(0)
    sizes = torch.tensor([c[1:4] for c in CLASSES])[cls.long()]
    sizes = sizes * (1 + 0.1 * (torch.rand(n, 3, generator=g) - 0.5) * 2)
    centres = (torch.rand(n * 4 if min_gap else n, 2, generator=g) * 2 - 1) * extent
    if min_gap and n:
        kept = [centres[0]]
        for c in centres[1:]:
            if len(kept) == n:
                break
            if min(float((c - k).norm()) for k in kept[-200:]) > 4.0:
                kept.append(c)
        while len(kept) < n:  # dense scenes: the gap cannot hold for every box
            kept.append(centres[len(kept)])
        centres = torch.stack(kept[:n])
    z = GROUND_Z + 0.1 * (torch.rand(n, generator=g) - 0.5)
    yaw = (torch.rand(n, generator=g) * 2 - 1) * math.pi
    return torch.cat([centres, z[:, None], sizes, yaw[:, None]], 1).float()


def lidar_points(
    boxes: torch.Tensor, n: int, *, seed: int = 0, extent: float = 50.0, object_share: float = 0.3
):
    """[n, 3] float32 points: a ground plane whose density falls with the range (a spinning
    sensor), points inside the boxes (object_share of all, each box weighted by its volume
    and its closeness to the sensor), and a few points in the air."""
    g = _gen(seed + 1)
    n_obj = int(n * object_share) if boxes.shape[0] else 0
    n_air = n // 50
    n_ground = n - n_obj - n_air
    r = extent * torch.rand(n_ground, generator=g) ** 2  # denser near the sensor
    t = torch.rand(n_ground, generator=g) * 2 * math.pi
    ground = torch.stack(
        [r * torch.cos(t), r * torch.sin(t), GROUND_Z + 0.03 * torch.randn(n_ground, generator=g)],
        1,
    )
    air = torch.stack(
        [
            (torch.rand(n_air, generator=g) * 2 - 1) * extent,
            (torch.rand(n_air, generator=g) * 2 - 1) * extent,
            GROUND_Z + 6 * torch.rand(n_air, generator=g),
        ],
        1,
    )
    parts = [ground, air]
    if n_obj:
        b = boxes.double()
        dist = b[:, :2].norm(dim=1).clamp(min=2.0)
        weight = (b[:, 3] * b[:, 4] * b[:, 5]).clamp(min=1e-3) / dist
        which = torch.multinomial(weight.float(), n_obj, replacement=True, generator=g)
        bb = b[which]
        local = (torch.rand(n_obj, 3, generator=g, dtype=torch.float64) - 0.5) * 0.98
        lx, ly = local[:, 0] * bb[:, 3], local[:, 1] * bb[:, 4]
        lz = (local[:, 2] + 0.5) * bb[:, 5]
        c, s = torch.cos(bb[:, 6]), torch.sin(bb[:, 6])
        obj = torch.stack(
            [bb[:, 0] + lx * c - ly * s, bb[:, 1] + lx * s + ly * c, bb[:, 2] + lz], 1
        ).float()
        parts.append(obj)
    pts = torch.cat(parts, 0)
    return pts[torch.randperm(pts.shape[0], generator=g)].contiguous()


def lidar_frame(n_points: int, n_boxes: int, *, batch: int = 1, seed: int = 0):
    """(points [B, n_points, 3], boxes [B, n_boxes, 7]) float32: `batch` independent frames."""
    pts, bxs = [], []
    for b in range(batch):
        boxes = lidar_boxes(n_boxes, seed=seed + 97 * b)
        bxs.append(boxes)
        pts.append(lidar_points(boxes, n_points, seed=seed + 97 * b))
    return torch.stack(pts), torch.stack(bxs)


def boxes_on_points(points: torch.Tensor, n: int, *, seed: int = 0, ground_z: float = -1.84):
    """[n, 7] float32 LiDAR boxes (class sizes, yaw uniform, bottom on the ground) centred on
    random non-ground points of `points` [P, >=3] (0.3 m above the ground or more): boxes that
    hold points the way ground-truth boxes do, for any cloud (mu_space.testing.lidar's too)."""
    g = _gen(seed + 4)
    above = points[points[:, 2] > ground_z + 0.3, :2]
    if above.shape[0] == 0:
        above = points[:, :2] if points.shape[0] else torch.zeros(1, 2)
    centres = above[torch.randint(0, above.shape[0], (n,), generator=g)].float()
    centres = centres + 0.3 * torch.randn(n, 2, generator=g)
    boxes = lidar_boxes(n, seed=seed, min_gap=False)
    boxes[:, :2] = centres
    boxes[:, 2] = ground_z
    return boxes.contiguous()


def benchmark_cloud(n_points: int | None = None, *, seed: int = 0) -> torch.Tensor:
    """[P, 3] float32: mu_space.testing.lidar's nuScenes 10-sweep cloud (~327k points, clustered
    like a real frame; n_points cuts or tiles it), or, where that module is absent, this module's
    own clustered cloud."""
    try:
        from mu_space.testing import lidar

        cloud = lidar.make("nus-10sweeps")[:, :3].contiguous()
    except ImportError:  # pragma: no cover - issue 10's module not there
        cloud = lidar_points(lidar_boxes(60, seed=seed), 327000, seed=seed)
    if n_points is None:
        return cloud
    reps = -(-n_points // cloud.shape[0])
    return cloud.repeat(reps, 1)[:n_points].contiguous()


def roi_inputs(n_points: int, n_rois: int, *, seed: int = 0, extent: float = 15.0):
    """RoI pooling inputs: (rois [N, 7], pts [P, 3]) float32, proposals around LiDAR objects
    (detections' noise: centre +-0.3 m, sizes +-8%, yaw +-0.15) over a point cloud with 60% of
    its points on the objects."""
    rois, _ = detections(n_rois, seed=seed, extent=extent, per_object=3)
    return rois, lidar_points(rois, n_points, seed=seed, extent=extent, object_share=0.6)


def detections(n: int, *, seed: int = 0, per_object: int = 8, extent: float = 50.0):
    """NMS candidates: (boxes [n, 7], scores [n]) float32. Objects (lidar_boxes) each get
    per_object noisy copies (centre +-0.3 m, size +-8%, yaw +-0.15 rad) with scores around the
    object's confidence; a fifth of the candidates are false positives anywhere. Scores are
    distinct with probability 1 (ties: see `tied_scores`)."""
    g = _gen(seed + 2)
    n_fp = n // 5
    n_obj = max(1, (n - n_fp) // per_object) if n else 0
    objects = lidar_boxes(n_obj, seed=seed, extent=extent)
    k = n - n_fp
    which = torch.arange(k) % max(n_obj, 1)
    base = objects[which] if n_obj else torch.zeros(0, 7)
    noise = torch.randn(k, 7, generator=g)
    boxes = base.clone()
    boxes[:, 0:2] += 0.3 * noise[:, 0:2]
    boxes[:, 2] += 0.05 * noise[:, 2]
    boxes[:, 3:6] *= 1 + 0.08 * noise[:, 3:6].clamp(-2, 2)
    boxes[:, 6] += 0.15 * noise[:, 6]
    conf = torch.rand(n_obj, generator=g) * 0.6 + 0.3
    scores = (conf[which] if n_obj else torch.zeros(0)) * (1 - 0.3 * torch.rand(k, generator=g))
    fp = lidar_boxes(n_fp, seed=seed + 5, extent=extent, min_gap=False)
    fp_scores = 0.3 * torch.rand(n_fp, generator=g)
    perm = torch.randperm(n, generator=g)
    return torch.cat([boxes, fp])[perm].float().contiguous(), torch.cat([scores, fp_scores])[
        perm
    ].float().contiguous()


def tied_scores(n: int, *, seed: int = 0, levels: int = 7):
    """[n] float32 scores with many exact ties (quantised): NMS tie-breaking tests."""
    g = _gen(seed + 3)
    return (torch.randint(0, levels, (n,), generator=g).float() / levels).contiguous()


def xyxyr(boxes7: torch.Tensor) -> torch.Tensor:
    """LiDAR boxes -> mmcv's deprecated [x1, y1, x2, y2, r] BEV layout (nms_bev, boxes_iou_bev)."""
    x, y, dx, dy, r = boxes7[:, 0], boxes7[:, 1], boxes7[:, 3], boxes7[:, 4], boxes7[:, 6]
    return torch.stack([x - dx / 2, y - dy / 2, x + dx / 2, y + dy / 2, r], 1).contiguous()


def xywhr(boxes7: torch.Tensor) -> torch.Tensor:
    """LiDAR boxes -> rotated [x, y, w, h, theta] (box_iou_rotated)."""
    return boxes7[:, [0, 1, 3, 4, 6]].contiguous()


def rect_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Named pairs of rotated rectangles [x, y, w, h, theta] (float64) for the geometry tests:
    identical, identical up to a quarter turn, touching along an edge and at a corner, nested,
    disjoint, crossing, zero-size and thin, huge coordinates."""
    pi = math.pi

    def t(rows):
        return torch.tensor(rows, dtype=torch.float64)

    return {
        "identical": (t([[1.0, 2.0, 4.0, 2.0, 0.3]]), t([[1.0, 2.0, 4.0, 2.0, 0.3]])),
        "identical axis-aligned": (t([[0.0, 0.0, 2.0, 1.0, 0.0]]), t([[0.0, 0.0, 2.0, 1.0, 0.0]])),
        "same rectangle, quarter turn": (
            t([[5.0, -3.0, 4.0, 2.0, 0.0]]),
            t([[5.0, -3.0, 2.0, 4.0, pi / 2]]),
        ),
        "same rectangle, half turn": (
            t([[5.0, -3.0, 4.0, 2.0, 0.2]]),
            t([[5.0, -3.0, 4.0, 2.0, 0.2 + pi]]),
        ),
        "touching edge": (t([[0.0, 0.0, 2.0, 2.0, 0.0]]), t([[2.0, 0.0, 2.0, 2.0, 0.0]])),
        "touching corner": (t([[0.0, 0.0, 2.0, 2.0, 0.0]]), t([[2.0, 2.0, 2.0, 2.0, 0.0]])),
        "touching rotated corner": (
            t([[0.0, 0.0, 2.0, 2.0, 0.0]]),
            t([[1.0 + math.sqrt(0.5), 0.0, 1.0, 1.0, pi / 4]]),
        ),
        "nested": (t([[0.0, 0.0, 6.0, 4.0, 0.4]]), t([[0.2, -0.1, 1.0, 0.5, 1.1]])),
        "nested sharing an edge": (t([[0.0, 0.0, 4.0, 4.0, 0.0]]), t([[1.0, 0.0, 2.0, 4.0, 0.0]])),
        "disjoint": (t([[0.0, 0.0, 1.0, 1.0, 0.0]]), t([[10.0, 0.0, 1.0, 1.0, 0.7]])),
        "crossing": (t([[0.0, 0.0, 8.0, 1.0, 0.0]]), t([[0.0, 0.0, 8.0, 1.0, pi / 2]])),
        "octagon": (t([[0.0, 0.0, 2.0, 2.0, 0.0]]), t([[0.0, 0.0, 2.0, 2.0, pi / 4]])),
        "zero width": (t([[0.0, 0.0, 0.0, 2.0, 0.0]]), t([[0.0, 0.0, 2.0, 2.0, 0.0]])),
        "zero size both": (t([[0.0, 0.0, 0.0, 0.0, 0.0]]), t([[0.0, 0.0, 0.0, 0.0, 0.0]])),
        "thin sliver": (t([[0.0, 0.0, 4.0, 1e-4, 0.1]]), t([[0.0, 0.0, 4.0, 2.0, 0.0]])),
        "far from the origin": (
            t([[4000.0, -3000.0, 4.5, 1.9, 0.5]]),
            t([[4000.6, -3000.2, 4.4, 2.0, 0.6]]),
        ),
        "negative size": (t([[0.0, 0.0, -2.0, 2.0, 0.0]]), t([[0.0, 0.0, 2.0, 2.0, 0.0]])),
    }
