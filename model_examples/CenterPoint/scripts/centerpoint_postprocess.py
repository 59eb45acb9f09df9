"""CenterPoint (voxel 0.075, nuScenes) post-processing and GT sampling with muSPACE's box
operators, backend A (default native) against backend B (default reference) on identical inputs.

  --path postprocess   the CenterHead's test-time path (mmdet3d CenterHead.predict_by_feat /
                       get_task_detections with CenterPointBBoxCoder.decode): synthetic head
                       outputs for the 6 task groups at the 0.075 config's shapes (heatmap
                       [B, classes, 180, 180] with peaks at the objects' centres, reg / height /
                       dim / rot / vel maps), decoded to the top 500 per task in plain torch
                       (the coder is ordinary torch code, here as in mmdet3d), then NMS per task
                       and sample: nms_type 'circle' (mu_space.circle_nms, min_radius per task,
                       post_max_size 83) and nms_type 'rotate' (mu_space.nms_bev, nms_thr 0.2,
                       pre_max_size 1000, post_max_size 83), the merge of the tasks.
  --path gt-sampling   the training pipeline's ObjectSample with the DataBaseSampler on
                       synthetic nuScenes-like 10-sweep frames (mu_space.testing.lidar): crop
                       each database object's points (mu_space.points_in_boxes_all, objects with
                       < 5 points dropped), draw the nus config's sample_groups, collision test
                       against the frame's boxes (mu_space.boxes_overlap_bev), remove the frame's
                       points inside the sampled boxes (mu_space.points_in_boxes_part; mmdet3d's
                       points_in_rbbox(...).any(-1) route via points_in_boxes_all beside it),
                       paste the objects' points.
  --path both          (default) both.

Every stage runs with backend A and with backend B on the same inputs; kept indices, masks,
accepted boxes and the resulting point clouds must be EQUAL (the box kernels and their
references agree to the bit on one device, docs/operators/*.md), overlap areas agree to 1e-6
relative. Then each stage is timed for both backends (_common.time_step: median, CUDA events on
a GPU). Exit status 0 = agree, 1 = mismatch. Ties: both backends visit the NMS candidates in
the same order (the ops sort in torch before the kernel), so a tied score alone cannot split
them; the script prints the exact ties of each NMS input and, at a difference, whether the
scores at the first differing kept position were tied.

Departures from mmdet3d, all outside the compared operators: circle NMS gets the (x, y, score)
tensor on the device (mmdet3d passes a numpy copy to numba); the collision test is BEV overlap
area > 0 (mmdet3d's box_collision_test also counts boxes that only touch); the sampled objects
come from one other synthetic frame, pasted where they were (as the database's box3d_lidar),
not from a dataset's GT database; objects are boxes on non-ground points of the synthetic
clouds (mu_space.testing.boxes.boxes_on_points) with approximate nuScenes class sizes.

    python model_examples/CenterPoint/scripts/centerpoint_postprocess.py --backend-a native
    python model_examples/CenterPoint/scripts/centerpoint_postprocess.py --device cpu --small

The box kernels are marked `unverified` (mu_space/ops/_box3d.py UNVERIFIED): `auto` takes the
reference on a GPU unless MUSPACE_TRY_UNVERIFIED=1 is set (mu_space/ops/_opdef.py; it replaced
MUSPACE_BOX3D_TRY_NATIVE); `native` runs them either way. The script sets nothing itself and
prints the dispatch records of run A, so a reference-vs-reference run is visible as such.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # model_examples/
import _common  # noqa: E402

import mu_space  # noqa: E402
from mu_space.runtime import kernel_dispatch  # noqa: E402
from mu_space.testing import boxes as box_inputs  # noqa: E402
from mu_space.testing import lidar  # noqa: E402

# nuScenes' 10 classes in mmdet3d's order and CenterPoint's 6 task groups (class_names, tasks).
CLASS_NAMES = (
    "car",
    "truck",
    "construction_vehicle",
    "bus",
    "trailer",
    "barrier",
    "motorcycle",
    "bicycle",
    "pedestrian",
    "traffic_cone",
)
TASKS = (
    ("car",),
    ("truck", "construction_vehicle"),
    ("bus", "trailer"),
    ("barrier",),
    ("motorcycle", "bicycle"),
    ("pedestrian", "traffic_cone"),
)
# Approximate nuScenes class mean sizes (dx = length, dy = width, dz = height, metres), rounded
# from the anchor sizes of mmdet3d's nuScenes anchor-based configs; synthetic objects only.
SIZES = {
    "car": (4.6, 1.95, 1.73),
    "truck": (6.7, 2.46, 2.73),
    "construction_vehicle": (6.4, 2.85, 3.2),
    "bus": (10.5, 2.94, 3.47),
    "trailer": (12.0, 2.87, 3.82),
    "barrier": (0.49, 2.49, 0.98),
    "motorcycle": (2.11, 0.77, 1.47),
    "bicycle": (1.68, 0.6, 1.27),
    "pedestrian": (0.73, 0.66, 1.76),
    "traffic_cone": (0.4, 0.4, 1.06),
}
# The db_sampler of centerpoint_voxel0075_second_secfpn_8xb4-cyclic-20e_nus-3d.
SAMPLE_GROUPS = {
    "car": 2,
    "truck": 3,
    "construction_vehicle": 7,
    "bus": 4,
    "trailer": 6,
    "barrier": 2,
    "motorcycle": 6,
    "bicycle": 6,
    "pedestrian": 2,
    "traffic_cone": 2,
}
MIN_POINTS = 5  # prepare.filter_by_min_points, every class
# Annotated objects of the synthetic frames: a busy nuScenes sample (the frame the pipeline
# augments) and the frame the database is cropped from (every class, for the sampler to draw).
FRAME_OBJECTS = {
    "car": 12,
    "truck": 3,
    "construction_vehicle": 1,
    "bus": 1,
    "trailer": 1,
    "barrier": 6,
    "motorcycle": 1,
    "bicycle": 1,
    "pedestrian": 8,
    "traffic_cone": 4,
}
DB_OBJECTS = dict.fromkeys(CLASS_NAMES, 4)


@dataclass(frozen=True)
class PostCfg:
    """CenterHead bbox_coder + test_cfg of the nuScenes 0.075 configs (the 0.1 base's test_cfg
    with voxel_size / pc_range overridden)."""

    pc_range: tuple = (-54.0, -54.0)
    voxel_size: tuple = (0.075, 0.075)
    out_size_factor: int = 8
    grid: int = 180  # sparse shape 1440 / out_size_factor
    max_num: int = 500
    score_threshold: float = 0.1
    post_center_range: tuple = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0)
    min_radius: tuple = (4.0, 12.0, 10.0, 1.0, 0.85, 0.175)
    nms_thr: float = 0.2
    pre_max_size: int = 1000
    post_max_size: int = 83


# ------------------------------------------------------------------------- synthetic inputs


def frame_objects(xyz: torch.Tensor, counts: dict, seed: int, ground_z: float):
    """(boxes [N, 7] LiDAR, z at the bottom; labels [N] int64) of `counts` objects per class,
    centred on non-ground points of the cloud (mu_space.testing.boxes.boxes_on_points) with the
    class's size (+-10%)."""
    labels = torch.cat(
        [torch.full((n,), CLASS_NAMES.index(c), dtype=torch.long) for c, n in counts.items()]
    )
    n = labels.numel()
    b = box_inputs.boxes_on_points(xyz, n, seed=seed, ground_z=ground_z)
    g = torch.Generator().manual_seed(seed + 11)
    sizes = torch.tensor([SIZES[c] for c in CLASS_NAMES])[labels]
    b[:, 3:6] = sizes * (1 + 0.1 * (2 * torch.rand(n, 3, generator=g) - 1))
    return b.contiguous(), labels


def make_heads(objects: list, cfg: PostCfg, seed: int) -> list[dict]:
    """Per task, what the trained SeparateHead would output for these objects (one
    (boxes, labels) per sample): heatmap logits with a Gaussian peak per object (confidence
    0.3-0.95, sigma from the footprint, no max-pool NMS as in the config, so the top 500 hold
    many overlapping candidates per object) over a background of ~0.25% probability; and in
    each cell the nearest object's box, regressed with noise (centre offset 80% of the way to
    the true centre, log-size, sin / cos yaw, height of the centre, velocity)."""
    g = torch.Generator().manual_seed(seed + 21)
    G, cell = cfg.grid, cfg.out_size_factor * cfg.voxel_size[0]
    idx = torch.arange(G, dtype=torch.float32)
    cy, cx = torch.meshgrid(idx + 0.5, idx + 0.5, indexing="ij")  # cell centres, [y, x]
    heads = []
    for names in TASKS:
        ids = [CLASS_NAMES.index(c) for c in names]
        per_sample = {k: [] for k in ("heatmap", "reg", "height", "dim", "rot", "vel")}
        for boxes, labels in objects:
            sel = torch.isin(labels, torch.tensor(ids))
            bx, lb = boxes[sel], labels[sel]
            k = bx.shape[0]
            ox = (bx[:, 0] - cfg.pc_range[0]) / cell  # continuous cell coordinates
            oy = (bx[:, 1] - cfg.pc_range[1]) / cell
            sigma = (0.3 * (bx[:, 3] * bx[:, 4]).sqrt() / cell).clamp(min=1.0)
            d2 = (cx[None] - ox[:, None, None]) ** 2 + (cy[None] - oy[:, None, None]) ** 2
            w = torch.exp(-d2 / (2 * sigma[:, None, None] ** 2))  # [k, G, G]
            conf = 0.3 + 0.65 * torch.rand(k, generator=g)
            peak = conf[:, None, None] * w * (1 + 0.02 * torch.randn(k, G, G, generator=g))
            bg = torch.sigmoid(-6.0 + 0.5 * torch.randn(len(ids), G, G, generator=g))
            prob = bg.clone()
            for j, cid in enumerate(ids):
                mine = lb == cid
                if mine.any():
                    prob[j] = torch.maximum(prob[j], peak[mine].amax(0))
            per_sample["heatmap"].append(torch.logit(prob.clamp(1e-6, 1 - 1e-6)))
            # regression maps: the nearest (heaviest-weighted) object, background noise elsewhere
            near = w.argmax(0) if k else torch.zeros(G, G, dtype=torch.long)
            has = (w.amax(0) > 1e-3) if k else torch.zeros(G, G, dtype=torch.bool)
            noise = torch.randn(10, G, G, generator=g)
            if k:
                o = bx[near]  # [G, G, 7]
                tx = 0.8 * (ox[near] - (cx - 0.5)) + 0.1 + 0.1 * noise[0]
                ty = 0.8 * (oy[near] - (cy - 0.5)) + 0.1 + 0.1 * noise[1]
                hz = o[..., 2] + o[..., 5] / 2 + 0.05 * noise[2]
                ld = o[..., 3:6].log().permute(2, 0, 1) + 0.05 * noise[3:6]
                yaw = o[..., 6] + 0.1 * noise[6]
                vel = torch.stack([noise[7], noise[8]]) * 2.0
            else:
                tx = ty = hz = yaw = torch.zeros(G, G)
                ld, vel = torch.zeros(3, G, G), torch.zeros(2, G, G)
            bgd = torch.rand(2, G, G, generator=g)
            reg = torch.where(has, torch.stack([tx, ty]), bgd)
            height = torch.where(has, hz, -1.0 + noise[9] * 0.5)[None]
            dim = torch.where(has, ld, 0.1 * noise[3:6])
            rot = torch.where(has, torch.stack([yaw.sin(), yaw.cos()]), 2 * bgd - 1)
            for key, v in (("reg", reg), ("height", height), ("dim", dim), ("rot", rot)):
                per_sample[key].append(v)
            per_sample["vel"].append(torch.where(has, vel, 0.1 * noise[7:9]))
        heads.append({key: torch.stack(v).contiguous() for key, v in per_sample.items()})
    return heads


# ------------------------------------------------------------------------- post-processing


def _gather(feat: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
    """feat [B, C, H, W], ind [B, K] flat spatial indices -> [B, K, C]."""
    B, C = feat.shape[:2]
    flat = feat.reshape(B, C, -1)
    return flat.gather(2, ind[:, None, :].expand(B, C, ind.shape[1])).transpose(1, 2)


def decode(head: dict, cfg: PostCfg) -> list[tuple]:
    """CenterHead (sigmoid, exp of the log-dims, sin / cos split) + CenterPointBBoxCoder.decode:
    the top max_num over (class, cell) in two top-k steps, box [x, y, z_centre, dx, dy, dz, yaw,
    vx, vy], then score > score_threshold and the centre in post_center_range. Per sample:
    (boxes [N, 9], scores [N], labels [N] int64, within the task)."""
    heat = head["heatmap"].sigmoid()
    B, C, H, W = heat.shape
    K = cfg.max_num
    top_s, top_i = torch.topk(heat.reshape(B, C, H * W), K)  # per class
    scores, pick = torch.topk(top_s.reshape(B, C * K), K)  # over the task's classes
    labels = torch.div(pick, K, rounding_mode="floor")
    inds = top_i.reshape(B, C * K).gather(1, pick)
    ys = torch.div(inds, W, rounding_mode="floor").float()
    xs = (inds % W).float()
    reg = _gather(head["reg"], inds)
    xs, ys = xs + reg[..., 0], ys + reg[..., 1]
    rot = _gather(head["rot"], inds)
    yaw = torch.atan2(rot[..., 0], rot[..., 1])
    hei = _gather(head["height"], inds)[..., 0]
    dim = _gather(head["dim"].exp(), inds)
    vel = _gather(head["vel"], inds)
    cell_x = cfg.out_size_factor * cfg.voxel_size[0]
    cell_y = cfg.out_size_factor * cfg.voxel_size[1]
    x = xs * cell_x + cfg.pc_range[0]
    y = ys * cell_y + cfg.pc_range[1]
    boxes = torch.cat([x[..., None], y[..., None], hei[..., None], dim, yaw[..., None], vel], -1)
    lo = torch.tensor(cfg.post_center_range[:3], device=heat.device)
    hi = torch.tensor(cfg.post_center_range[3:], device=heat.device)
    mask = (boxes[..., :3] >= lo).all(-1) & (boxes[..., :3] <= hi).all(-1)
    mask &= scores > cfg.score_threshold
    return [(boxes[b][mask[b]], scores[b][mask[b]], labels[b][mask[b]]) for b in range(B)]


def nms_task(dets: list[tuple], task: int, nms_type: str, cfg: PostCfg, backend: str) -> list:
    """One task's NMS for each sample -> (kept indices into the decoded rows, boxes, scores,
    labels). 'circle': circle_nms of (x, y, score) at min_radius[task] (a squared distance);
    'rotate': get_task_detections: score >= score_threshold, the BEV boxes [x1, y1, x2, y2, yaw]
    (xywhr2xyxyr of LiDAR boxes' bev), nms_bev, then the centre in post_center_range."""
    out = []
    for boxes, scores, labels in dets:
        if nms_type == "circle":
            centres = torch.cat([boxes[:, :2], scores[:, None]], 1)
            keep = mu_space.circle_nms(
                centres, cfg.min_radius[task], post_max_size=cfg.post_max_size, backend=backend
            )
        else:
            rows = torch.nonzero(scores >= cfg.score_threshold)[:, 0]
            b, s = boxes[rows], scores[rows]
            sel = mu_space.nms_bev(
                box_inputs.xyxyr(b),
                s,
                cfg.nms_thr,
                cfg.pre_max_size,
                cfg.post_max_size,
                backend=backend,
            )
            keep = rows[sel]
            lo = torch.tensor(cfg.post_center_range[:3], device=boxes.device)
            hi = torch.tensor(cfg.post_center_range[3:], device=boxes.device)
            c = boxes[keep, :3]
            keep = keep[(c >= lo).all(1) & (c <= hi).all(1)]
        out.append((keep, boxes[keep], scores[keep], labels[keep]))
    return out


def merge(per_task: list[list]) -> list[tuple]:
    """predict_by_feat's merge: per sample the tasks' boxes (z moved to the bottom), scores and
    labels offset to the 10 classes."""
    offsets = [sum(len(t) for t in TASKS[:i]) for i in range(len(TASKS))]
    merged = []
    for b in range(len(per_task[0])):
        boxes = torch.cat([t[b][1] for t in per_task])
        boxes = torch.cat([boxes[:, :2], boxes[:, 2:3] - boxes[:, 5:6] * 0.5, boxes[:, 3:]], 1)
        scores = torch.cat([t[b][2] for t in per_task])
        labels = torch.cat([t[b][3] + off for t, off in zip(per_task, offsets)])
        merged.append((boxes, scores, labels))
    return merged


def postprocess(heads, cfg, nms_type, backend, decoded=None):
    decoded = decoded if decoded is not None else [decode(h, cfg) for h in heads]
    per_task = [nms_task(d, t, nms_type, cfg, backend) for t, d in enumerate(decoded)]
    return per_task, merge(per_task)


# ------------------------------------------------------------------------------ GT sampling


@dataclass
class Database:
    """The GT database of one frame (mmdet3d create_gt_database): per object its box, label,
    point count and its points relative to the box centre (rows grouped by object)."""

    boxes: torch.Tensor
    labels: torch.Tensor
    counts: torch.Tensor
    points: torch.Tensor
    owner: torch.Tensor
    mask: torch.Tensor  # [P, T] int32 points_in_boxes_all (compared between backends)


def crop_database(cloud, boxes, labels, backend) -> Database:
    xyz = cloud[:, :3].contiguous()
    mask = mu_space.points_in_boxes_all(xyz[None], boxes[None], backend=backend)[0]
    counts = mask.sum(0)
    pi, bi = mask.nonzero(as_tuple=True)
    order = torch.sort(bi, stable=True)[1]
    pi, bi = pi[order], bi[order]
    pts = cloud[pi].clone()
    pts[:, :3] -= boxes[bi, :3]
    return Database(boxes, labels, counts, pts, bi, mask)


def choose(db: Database, gt_labels: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """DataBaseSampler.sample_all's draw: per class (sample_groups order) sample_groups[c] minus
    the frame's objects of c, from the objects with >= MIN_POINTS points (seeded shuffle)."""
    g = torch.Generator().manual_seed(seed + 31)
    counts, labels = db.counts.cpu(), db.labels.cpu()
    have = gt_labels.cpu()
    chosen = []
    for name, quota in SAMPLE_GROUPS.items():
        k = CLASS_NAMES.index(name)
        need = max(quota - int((have == k).sum()), 0)
        cands = torch.nonzero((labels == k) & (counts >= MIN_POINTS))[:, 0]
        chosen.append(cands[torch.randperm(cands.numel(), generator=g)][:need])
    return chosen


def collision_test(db: Database, gt_boxes, chosen, backend):
    """sample_class_v2 per class: a drawn box that overlaps (BEV area > 0) a frame box or an
    already accepted box is rejected (and then blocks nothing). -> (accepted db rows,
    overlap matrices)."""
    avoid = gt_boxes
    accepted, overlaps = [], []
    for ids in chosen:
        if ids.numel() == 0:
            continue
        ids = ids.to(gt_boxes.device)
        sp = db.boxes[ids]
        ov = mu_space.boxes_overlap_bev(sp, torch.cat([avoid, sp]), backend=backend)
        overlaps.append(ov)
        n_av = avoid.shape[0]
        coll = (ov > 0).cpu()
        coll[:, n_av:].fill_diagonal_(False)
        valid = []
        for i in range(sp.shape[0]):
            if coll[i].any():
                coll[i] = False
                coll[:, n_av + i] = False
            else:
                valid.append(i)
        acc = ids[torch.tensor(valid, dtype=torch.long, device=ids.device)]
        accepted.append(acc)
        avoid = torch.cat([avoid, db.boxes[acc]])
    acc = torch.cat(accepted) if accepted else gt_boxes.new_zeros(0, dtype=torch.long)
    return acc, overlaps


def remove_points(frame, boxes, backend, via_all=False):
    """ObjectSample.remove_points_in_boxes: keep the frame's points in none of the boxes."""
    xyz = frame[:, :3].contiguous()[None]
    if via_all:  # mmdet3d: points_in_rbbox(points, boxes).any(-1)
        return (
            mu_space.points_in_boxes_all(xyz, boxes[None], backend=backend)[0].any(-1).logical_not()
        )
    return mu_space.points_in_boxes_part(xyz, boxes[None], backend=backend)[0] < 0


def object_sample(frame, gt_boxes, gt_labels, db, backend, seed):
    """ObjectSample: draw, collision test, remove the frame's points in the accepted boxes,
    paste the objects' points (at their database positions, first) -> dict of the results."""
    chosen = choose(db, gt_labels, seed)
    acc, overlaps = collision_test(db, gt_boxes, chosen, backend)
    boxes = db.boxes[acc]
    keep = remove_points(frame, boxes, backend)
    rows = torch.isin(db.owner, acc)
    pasted = db.points[rows].clone()
    pasted[:, :3] += db.boxes[db.owner[rows], :3]
    return {
        "drawn": torch.cat(chosen),
        "accepted": acc,
        "overlaps": overlaps,
        "keep": keep,
        "points": torch.cat([pasted, frame[keep]]),
        "gt_boxes": torch.cat([gt_boxes, boxes]),
        "gt_labels": torch.cat([gt_labels, db.labels[acc]]),
    }


# ------------------------------------------------------------------------------- the runs


class Report:
    """_common.compare for each result, printed, with the verdict kept."""

    def __init__(self):
        self.ok = True

    def check(self, name: str, a: torch.Tensor, b: torch.Tensor, tol: float = 0.0) -> bool:
        """tol 0: equal (integers, masks, copies); else max|a - b| <= tol * max|b|."""
        ok, line = _common.compare(name, a, b, tol)
        print("  " + line + ("" if ok or "MISMATCH" in line else "  MISMATCH"))
        self.ok &= ok
        return ok


def _ties(scores: torch.Tensor) -> int:
    """Scores equal to another score of the same NMS input."""
    return int(scores.numel() - torch.unique(scores).numel())


def _first_difference(ka, kb, scores) -> str:
    n = min(ka.numel(), kb.numel())
    diff = (ka[:n] != kb[:n]).nonzero()
    i = int(diff[0]) if diff.numel() else n
    if i == n:
        return f"kept counts {ka.numel()} vs {kb.numel()}"
    sa, sb = float(scores[ka[i]]), float(scores[kb[i]])
    tie = " (tied scores: the order of a tie decided it)" if sa == sb else ""
    return f"first difference at kept position {i}: row {int(ka[i])} vs {int(kb[i])}{tie}"


def _time(args, fn) -> float:
    return _common.time_step(fn, args.device, args.warmup, args.reps)


def _ab_times(args, stages) -> list[tuple]:
    """(label, ms with backend A, ms with backend B) of each (label, fn(backend)) stage."""
    rows = []
    for label, fn in stages:
        ta = _time(args, lambda fn=fn: fn(args.backend_a))
        tb = _time(args, lambda fn=fn: fn(args.backend_b))
        rows.append((label, ta, tb))
    return rows


def _print_times(args, rows):
    clock = "CUDA events" if args.device.type == "cuda" else "perf_counter"
    print(f"timings, median of {args.reps} ({clock}), ms:")
    print(f"  {'stage':<52s} {'A ' + args.backend_a:>14s} {'B ' + args.backend_b:>14s}  A over B")
    for name, ta, tb in rows:
        if tb is None:
            print(f"  {name:<52s} {ta:14.3f} {'(same)':>14s}")
        else:
            print(f"  {name:<52s} {ta:14.3f} {tb:14.3f}  {tb / ta:7.2f}x")


def _dispatch_note(args):
    rows = kernel_dispatch.records()
    print("  " + kernel_dispatch.report().replace("\n", "\n  "))
    native_calls = sum(r["calls"] for r in rows if r["backend"] != "reference")
    if args.backend_a != "reference" and native_calls == 0:
        print(
            "  note: backend A ran the reference for every call (see the reasons above): this is "
            "a reference-vs-reference run"
        )


def run_postprocess(args, cloud, ground_z, cfg: PostCfg, rep: Report):
    xyz = cloud[:, :3].contiguous()
    objects = [
        frame_objects(xyz, FRAME_OBJECTS, args.seed + 101 * b, ground_z) for b in range(args.batch)
    ]
    heads = [
        {k: v.to(args.device) for k, v in h.items()} for h in make_heads(objects, cfg, args.seed)
    ]
    print(
        f"\n== post-processing: CenterHead, {len(TASKS)} tasks, B {args.batch}, heatmaps "
        f"[B, classes, {cfg.grid}, {cfg.grid}], top {cfg.max_num} per task"
    )
    decoded = [decode(h, cfg) for h in heads]
    for t, (names, d) in enumerate(zip(TASKS, decoded)):
        n = [int(s.numel()) for _, s, _ in d]
        ties = [_ties(s) for _, s, _ in d]
        print(
            f"  task {t} {'|'.join(names):<32s} candidates after score / range filter {n}, "
            f"tied scores {ties}, circle min_radius {cfg.min_radius[t]}"
        )
    timings = [
        (
            "decode (plain torch, 6 tasks)",
            _time(args, lambda: [decode(h, cfg) for h in heads]),
            None,
        )
    ]
    for nms_type in ("circle", "rotate"):
        kernel_dispatch.reset()
        per_a, merged_a = postprocess(heads, cfg, nms_type, args.backend_a, decoded)
        print(f"A vs B, nms_type '{nms_type}' (kept rows must be equal):")
        _dispatch_note(args)
        per_b, merged_b = postprocess(heads, cfg, nms_type, args.backend_b, decoded)
        kept = []
        for t in range(len(TASKS)):
            for b in range(args.batch):
                ka, kb = per_a[t][b][0], per_b[t][b][0]
                kept.append(int(ka.numel()))
                if not rep.check(f"{nms_type} task {t} sample {b} kept rows", ka, kb):
                    print("    " + _first_difference(ka, kb, decoded[t][b][1]))
        for b in range(args.batch):
            for name, xa, xb in zip(("boxes", "scores", "labels"), merged_a[b], merged_b[b]):
                rep.check(f"{nms_type} sample {b} merged {name} {tuple(xa.shape)}", xa, xb)
        print(f"  kept per task and sample: {kept} (of post_max_size {cfg.post_max_size})")
        timings += _ab_times(
            args,
            (
                (
                    f"NMS '{nms_type}' (6 tasks x B)",
                    lambda bk, nt=nms_type: [
                        nms_task(d, t, nt, cfg, bk) for t, d in enumerate(decoded)
                    ],
                ),
                (
                    f"post-process '{nms_type}' (decode + NMS + merge)",
                    lambda bk, nt=nms_type: postprocess(heads, cfg, nt, bk),
                ),
            ),
        )
    return timings


def run_gt_sampling(args, frame, db_cloud, ground_z, rep: Report):
    gt_boxes, gt_labels = frame_objects(
        frame[:, :3].contiguous(), FRAME_OBJECTS, args.seed + 7, ground_z
    )
    db_boxes, db_labels = frame_objects(
        db_cloud[:, :3].contiguous(), DB_OBJECTS, args.seed + 8, ground_z
    )
    dev = args.device
    frame, db_cloud = frame.to(dev), db_cloud.to(dev)
    gt_boxes, gt_labels, db_boxes, db_labels = (
        t.to(dev) for t in (gt_boxes, gt_labels, db_boxes, db_labels)
    )
    print(
        f"\n== GT sampling: ObjectSample + DataBaseSampler, frame {tuple(frame.shape)} with "
        f"{gt_boxes.shape[0]} boxes, database frame {tuple(db_cloud.shape)} with "
        f"{db_boxes.shape[0]} objects"
    )
    kernel_dispatch.reset()
    db_a = crop_database(db_cloud, db_boxes, db_labels, args.backend_a)
    res_a = object_sample(frame, gt_boxes, gt_labels, db_a, args.backend_a, args.seed)
    keep_all_a = remove_points(frame, res_a["gt_boxes"][gt_boxes.shape[0] :], args.backend_a, True)
    print("A vs B (masks, decisions and point clouds must be equal; overlaps to 1e-6):")
    _dispatch_note(args)
    db_b = crop_database(db_cloud, db_boxes, db_labels, args.backend_b)
    res_b = object_sample(frame, gt_boxes, gt_labels, db_b, args.backend_b, args.seed)
    rep.check(f"database points_in_boxes_all mask {tuple(db_a.mask.shape)}", db_a.mask, db_b.mask)
    rep.check("database object points", db_a.points, db_b.points)
    for i, (oa, ob) in enumerate(zip(res_a["overlaps"], res_b["overlaps"])):
        rep.check(f"collision overlaps, drawn group {i} {tuple(oa.shape)}", oa, ob, 1e-6)
    if len(res_a["overlaps"]) != len(res_b["overlaps"]):
        print("  MISMATCH: different numbers of drawn groups")
        rep.ok = False
    for key in ("drawn", "accepted", "keep", "points", "gt_boxes", "gt_labels"):
        rep.check(f"{key} {tuple(res_a[key].shape)}", res_a[key], res_b[key])
    rep.check("part < 0 vs mmdet3d's all.any(-1) route (A)", res_a["keep"], keep_all_a)
    drawn = {c: 0 for c in CLASS_NAMES}
    for k in db_a.labels[res_a["accepted"]].tolist():
        drawn[CLASS_NAMES[k]] += 1
    print(
        f"  database objects with >= {MIN_POINTS} points: "
        f"{int((db_a.counts >= MIN_POINTS).sum())} of {db_boxes.shape[0]}; drawn "
        f"{res_a['drawn'].numel()}, accepted {res_a['accepted'].numel()} "
        f"({', '.join(f'{c} {n}' for c, n in drawn.items() if n)}); frame points removed "
        f"{int((~res_a['keep']).sum())}, pasted {res_a['points'].shape[0] - int(res_a['keep'].sum())}"
    )
    sampled = res_a["gt_boxes"][gt_boxes.shape[0] :]
    chosen = choose(db_a, gt_labels, args.seed)
    return _ab_times(
        args,
        (
            (
                f"database crop: points_in_boxes_all [1, {db_cloud.shape[0]}, {db_boxes.shape[0]}]",
                lambda bk: crop_database(db_cloud, db_boxes, db_labels, bk),
            ),
            (
                "collision test: boxes_overlap_bev per class",
                lambda bk: collision_test(db_a, gt_boxes, chosen, bk),
            ),
            (
                f"remove points: points_in_boxes_part [1, {frame.shape[0]}, {sampled.shape[0]}]",
                lambda bk: remove_points(frame, sampled, bk),
            ),
            (
                "remove points: points_in_boxes_all.any(-1) (mmdet3d)",
                lambda bk: remove_points(frame, sampled, bk, True),
            ),
            (
                "ObjectSample (draw, collision, remove, paste)",
                lambda bk: object_sample(frame, gt_boxes, gt_labels, db_a, bk, args.seed),
            ),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    p = _common.make_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend", dest="backend_a", choices=_common.BACKEND_CHOICES, help="= --backend-a"
    )
    p.add_argument("--smoke", dest="small", action="store_true", help="= --small")
    p.add_argument("--path", default="both", choices=("both", "postprocess", "gt-sampling"))
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 1  # the nuScenes test dataloader's batch_size
    args = _common.resolve(args)
    cloud_name = "tiny-3sweeps" if args.small else "nus-10sweeps"
    ground_z = -lidar.RIGS[lidar.CLOUDS[cloud_name].rig].height
    frame, db_cloud = lidar.batch(cloud_name, 2)  # seeds 0 and 1: the frame, the database's
    cfg = PostCfg(max_num=100) if args.small else PostCfg()
    print(
        "CenterPoint post-processing and GT sampling (centerpoint_voxel0075_second_secfpn_"
        f"8xb4-cyclic-20e_nus-3d; clouds {cloud_name})\ndevice {args.device}, backend A = "
        f"{args.backend_a}, backend B = {args.backend_b}, torch {torch.__version__}"
    )
    rep = Report()
    rows = []
    if args.path in ("both", "postprocess"):
        rows += run_postprocess(args, frame, ground_z, cfg, rep)
    if args.path in ("both", "gt-sampling"):
        rows += run_gt_sampling(args, frame, db_cloud, ground_z, rep)
    print()
    _print_times(args, rows)
    print("PASS" if rep.ok else "FAIL: A and B disagree")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    _common.entry(main)
