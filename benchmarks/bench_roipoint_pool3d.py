"""roipoint_pool3d / RoIPointPool3d (mmcv API) at PointRCNN / PartA2 shapes, plus a sweep; mmcv's
own kernels side by side when built (benchmarks/_box3d_peer.py).

    python -m benchmarks.bench_roipoint_pool3d [--quick | --smoke] [--cases REGEX] [--no-write]

Inputs: mu_space.testing.lidar's nuScenes 10-sweep cloud (~327k points, B = 1), 128 boxes on
objects (mu_space.testing.boxes.boxes_on_points), 512 sampled points per box; features C = 128
(PointRCNN's point features) and C = 16. Cases: pointrcnn-128-{c128,c16}-forward-{float32,
float16}; sweep over boxes (32 .. 512, C = 16). Compulsory bytes: points + features + boxes +
the pooled output (B * M * 512 * (3 + C)). No target in the issue (mmcv materialises a [B, N, M]
int32 mask and walks every point per box with one thread: the side-by-side ratio is the measure).
--smoke: 3000 points x 16 boxes, CPU-capable.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import _box3d_peer as peer
from benchmarks import harness
from benchmarks.harness import Case
from mu_space.ops.roipoint import roipoint_pool3d
from mu_space.testing import boxes as box_inputs

BOX_SWEEP = (32, 128, 512)
_cache: dict = {}


def inputs(n_boxes: int, smoke: bool):
    key = (n_boxes, smoke)
    if key not in _cache:
        if smoke:
            pts, bxs = box_inputs.lidar_frame(3000, 16, seed=5)
        else:
            cloud = box_inputs.benchmark_cloud()
            pts, bxs = cloud[None], box_inputs.boxes_on_points(cloud, n_boxes, seed=n_boxes)[None]
        d = harness.default_device()
        _cache[key] = (pts.to(d), bxs.to(d))
    return _cache[key]


def cases_for(name, pts, bxs, C, dtype, params) -> list[Case]:
    be = harness.backend()
    g = torch.Generator().manual_seed(C)
    feats = torch.randn(pts.shape[0], pts.shape[1], C, generator=g).to(pts.device, dtype)
    pts, bxs = pts.to(dtype), bxs.to(dtype)
    S = 512
    B, M = bxs.shape[0], bxs.shape[1]
    es = feats.element_size()
    nbytes = (pts.numel() + feats.numel() + bxs.numel() + B * M * S * (3 + C)) * es
    params = {**params, "points": pts.shape[1], "boxes": M, "C": C, "num_sampled_points": S}
    case = Case(
        name=f"{name}-forward-{harness.dtype_name(dtype)}",
        op="roipoint_pool3d",
        direction="forward",
        dtype=dtype,
        params=params,
        compulsory_bytes=nbytes,
        fn=lambda: roipoint_pool3d(pts, feats, bxs, S, backend=be),
        make_args=lambda: (),
        reference=lambda: roipoint_pool3d(pts, feats, bxs, S, backend="reference"),
        time_reference="sweep" not in params,  # sweeps: checked, not timed
    )
    cases = [case]
    if peer.has("roipoint_forward") and dtype == torch.float32:
        cases.append(
            peer.peer_case(case, lambda: peer.roipoint(pts, feats, bxs, S), peer.agreement(0.999))
        )
    return cases


def build_cases(args) -> list[Case]:
    pts, bxs = inputs(128, args.smoke)
    cases = []
    for C in (128, 16):
        for dtype in (torch.float32, torch.float16):
            cases += cases_for(f"pointrcnn-128-c{C}", pts, bxs, C, dtype, {"config": "PointRCNN"})
    if args.quick:
        return cases
    for n in BOX_SWEEP[:1] if args.smoke else BOX_SWEEP:
        p, b = inputs(n, args.smoke)
        cases += cases_for(f"sweep-boxes-{n}", p, b, 16, torch.float32, {"sweep": "boxes"})
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("roipoint_pool3d", build_cases, argv, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
