"""points_in_boxes_part / _all (mmcv API) on a clustered LiDAR frame, plus size sweeps; mmcv's own
kernels side by side when built (benchmarks/_box3d_peer.py).

    python -m benchmarks.bench_points_in_boxes [--quick | --smoke] [--cases REGEX] [--no-write]

Inputs: mu_space.testing.lidar's nuScenes 10-sweep cloud (~327k points; the issue's ~300k), one
frame (B = 1), and 200 ground-truth-like boxes (mu_space.testing.boxes.boxes_on_points: class
sizes, centred on non-ground points, bottom on the ground): the issue's 300k x 200 case.

Cases: nus-300k-200-{part,all}-{float32,float16}; sweeps over points (30k .. 1.3M, 200 boxes)
and boxes (25 .. 1600, 327k points) in float32. Compulsory bytes: points + boxes + the output
(part: 4 B per point; all: 4 B per (point, box): 240 MB at 300k x 200, which alone bounds `all`
at ~50 µs on an H200). Reference: backend="reference" (vectorised PyTorch) on the same GPU.

Targets (issue 12, TARGETS): part and all <= 50 µs at 300k x 200 (mmcv's kernels, the issue's
anchor: 268 µs and 371 µs).
--smoke: 2000 points x 20 boxes of mu_space.testing.boxes' own frame, CPU-capable.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import _box3d_peer as peer
from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.points_in_boxes import points_in_boxes_all, points_in_boxes_part
from mu_space.testing import boxes as box_inputs

TARGETS = (
    Target(
        r"nus-300k-200-(part|all)-float32",
        "median_us",
        "<=",
        50.0,
        "issue 12 (mmcv: part 268 us, all 371 us)",
    ),
)
POINT_SWEEP = (30_000, 100_000, 327_000, 1_300_000)
BOX_SWEEP = (25, 100, 400, 1600)
_cache: dict = {}


def frame(n_points: int | None, n_boxes: int, smoke: bool):
    key = (n_points, n_boxes, smoke)
    if key not in _cache:
        device = harness.default_device()
        if smoke:
            pts, bxs = box_inputs.lidar_frame(2000, 20, seed=3)
        else:
            cloud = box_inputs.benchmark_cloud(n_points)
            pts, bxs = cloud[None], box_inputs.boxes_on_points(cloud, n_boxes)[None]
        _cache[key] = (pts.to(device), bxs.to(device))
    return _cache[key]


def cases_for(name, pts, bxs, dtype, params, with_peer=True) -> list[Case]:
    pts, bxs = pts.to(dtype), bxs.to(dtype)
    be = harness.backend()
    B, M, T = pts.shape[0], pts.shape[1], bxs.shape[1]
    dt = harness.dtype_name(dtype)
    inb = pts.numel() * pts.element_size() + bxs.numel() * bxs.element_size()
    params = {**params, "points": M, "boxes": T, "batch": B}
    out = []
    for kind, fn, out_bytes, mmcv_fn in (
        ("part", points_in_boxes_part, B * M * 4, peer.points_in_boxes_part),
        ("all", points_in_boxes_all, B * M * T * 4, peer.points_in_boxes_all),
    ):
        case = Case(
            name=f"{name}-{kind}-{dt}",
            op=f"points_in_boxes_{kind}",
            direction="forward",
            dtype=dtype,
            params=params,
            compulsory_bytes=inb + out_bytes,
            fn=lambda fn=fn: fn(pts, bxs, backend=be),
            make_args=lambda: (),
            reference=lambda fn=fn: fn(pts, bxs, backend="reference"),
            time_reference="sweep" not in params,  # sweeps: checked, not timed
        )
        out.append(case)
        if with_peer and peer.has(f"points_in_boxes_{kind}"):
            # mmcv's kernel rounds with FMA contraction: points within ~1 ulp of a face differ
            out.append(peer.peer_case(case, lambda f=mmcv_fn: f(pts, bxs), peer.agreement(0.9999)))
    return out


def build_cases(args) -> list[Case]:
    smoke = args.smoke
    pts, bxs = frame(None, 200, smoke)
    cases = []
    for dtype in (torch.float32, torch.float16):
        cases += cases_for(
            "nus-300k-200",
            pts,
            bxs,
            dtype,
            {"config": "nus-10sweeps, 200 boxes"},
            with_peer=dtype == torch.float32,
        )
    if args.quick:
        return cases
    for n in POINT_SWEEP[:1] if smoke else POINT_SWEEP:
        p, b = frame(n, 200, smoke)
        cases += cases_for(f"sweep-points-{n}", p, b, torch.float32, {"sweep": "points"})
    for t in BOX_SWEEP[:1] if smoke else BOX_SWEEP:
        p, b = frame(None, t, smoke)
        cases += cases_for(f"sweep-boxes-{t}", p, b, torch.float32, {"sweep": "boxes"})
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("points_in_boxes", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
