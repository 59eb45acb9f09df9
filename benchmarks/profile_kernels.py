"""Run each hot kernel once inside a profiler range, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --set detailed \
        python3 -m benchmarks.profile_kernels [--only REGEX]
    python3 -m benchmarks.profile_kernels --torch-profiler [--only REGEX]   (no ncu / nsys needed:
        each workload's per-kernel device time per call and its share of the wall time)

Workloads (realistic inputs, as in the benchmarks): bev_pool_v2 forward (bevdet-r50 float32 /
float16, bevdet-r50-d88 float32) and default backward (bevdet-r50 float32; backwards run through
autograd on a graph built before the range), bev_pool_prepare
(bevdet-r50), bev_pool (bevfusion-cam float32), multi_scale_deformable_attn forward and backward
(deformable-detr and bevformer-base-tsa, float32), and the voxel family (voxel_workloads:
dynamic_scatter, voxelization, pillar_scatter), nms3d / nms_bev of 4096 detections and
points_in_boxes_all, RoIAwarePool3d forward / backward (box3d_workloads), and the CenterPoint SparseEncoder forward. Each is warmed up first, so only the timed call's
kernels fall inside the range. ncu flushes caches between kernel replays by default
(cold L2, as the benchmarks).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from benchmarks import harness
from mu_space.testing import lidar


def workloads():
    from benchmarks import bench_bev_pool_v2
    from mu_space.ops.bev_pool import bev_pool
    from mu_space.ops.bev_pool_prepare import bev_pool_prepare
    from mu_space.ops.bev_pool_v2 import bev_pool_v2
    from mu_space.ops.multi_scale_deformable_attn import multi_scale_deformable_attn
    from mu_space.testing import bev_geometry, bev_pool_inputs, msda_inputs

    dev = torch.device("cuda")
    for cfg, dtype in (
        ("bevdet-r50", torch.float32),
        ("bevdet-r50", torch.float16),
        ("bevdet-r50-d88", torch.float32),
    ):
        args = bench_bev_pool_v2.inputs(cfg, dtype)
        yield f"bev_pool_v2-fwd-{cfg}-{dtype}", lambda a=args: bev_pool_v2(*a, backend="native")
    args = bench_bev_pool_v2.inputs("bevdet-r50", torch.float32)
    B, Z, Y, X, C = args[5]
    grad = torch.randn((B, C, Z, Y, X), device=dev)
    graph = bench_bev_pool_v2.backward_args(args, grad, "native")()
    yield "bev_pool_v2-bwd-bevdet-r50-float32", lambda g=graph: harness.autograd_backward(*g)
    g = bev_geometry.make("bevdet-r50")
    coor = g["coor"].to(dev)
    yield (
        "bev_pool_prepare-bevdet-r50",
        lambda: bev_pool_prepare(
            coor, g["grid_lower_bound"], g["grid_interval"], g["grid_size"], backend="native"
        ),
    )
    f = bev_pool_inputs.bevfusion_inputs("bevfusion-cam", device=dev)
    yield (
        "bev_pool-bevfusion-cam-float32",
        lambda: bev_pool(f["feats"], f["coords"], f["B"], f["D"], f["H"], f["W"], backend="native"),
    )
    for cfg in (
        "deformable-detr",
        "bevformer-base-tsa",
        "bevformer-base-tsa-uniform",
        "bevformer-base-sca",
    ):
        m = msda_inputs.args(msda_inputs.make(cfg, device=dev))
        value, shapes, starts, loc, attn = m
        graph = harness.backward_args(
            lambda v, l, a, s=shapes, i=starts: multi_scale_deformable_attn(v, s, i, l, a),
            (value, loc, attn),
            torch.randn(value.shape[0], loc.shape[1], value.shape[2] * value.shape[3], device=dev),
        )()
        yield f"msda-fwd-{cfg}", lambda m=m: multi_scale_deformable_attn(*m)
        yield f"msda-bwd-{cfg}", lambda g=graph: harness.autograd_backward(*g)
    yield from voxel_workloads(dev)
    yield from box3d_workloads()
    yield from sparse_workloads(dev)


def box3d_workloads():
    """The issue-12 ops whose call time was furthest from its target (H200, 2026-12-01):
    nms3d and nms_bev of 4096 detections, points_in_boxes_all (300k points x 200 boxes)."""
    from benchmarks import bench_nms3d, bench_points_in_boxes
    from mu_space.ops.iou3d import nms3d, nms_bev
    from mu_space.ops.points_in_boxes import points_in_boxes_all
    from mu_space.testing import boxes as box_inputs

    boxes, scores = bench_nms3d.dets(4096)
    bev = box_inputs.xyxyr(boxes)
    yield "nms3d-4096", lambda: nms3d(boxes, scores, 0.7, backend="native")[:500]
    yield "nms_bev-4096-500", lambda: nms_bev(bev, scores, 0.7, 4096, 500, backend="native")
    pts, bxs = bench_points_in_boxes.frame(None, 200, False)
    yield "points_in_boxes_all-300k-200", lambda: points_in_boxes_all(pts, bxs, backend="native")
    yield from roiaware_workloads()


def roiaware_workloads():
    """RoIAwarePool3d at the issue-12 shape (128 RoIs x 14^3 cells, 300k points; max C = 16,
    avg C = 4 as the benchmark) forward and backward: the max backward missed its target
    (H200, 2026-12-01)."""
    from benchmarks import bench_roiaware_pool3d
    from mu_space.ops.roiaware import roiaware_pool3d

    rois, pts = bench_roiaware_pool3d.inputs(128, None, False)
    for mode, C in (("max", 16), ("avg", 4)):  # the benchmark's parta2 cases
        feats = torch.randn(pts.shape[0], C, device=pts.device)
        yield (
            f"roiaware-fwd-{mode}",
            lambda m=mode, f=feats: roiaware_pool3d(rois, pts, f, 14, 128, m, backend="native"),
        )
        leaf = feats.detach().requires_grad_(True)
        yield (  # a training step's forward: max mode saves its winners for the backward
            f"roiaware-fwd-{mode}-grad",
            lambda m=mode, f=leaf: roiaware_pool3d(rois, pts, f, 14, 128, m, backend="native"),
        )
        out = roiaware_pool3d(rois, pts, leaf, 14, 128, mode, backend="native")
        graph = (out, (leaf,), torch.randn_like(out))
        yield f"roiaware-bwd-{mode}", lambda g=graph: harness.autograd_backward(*g)


def sparse_workloads(dev):
    """The CenterPoint-0.075 SparseEncoder forward (no grad) on the benchmark's frame: its wall
    time was 2.3x its kernels' device time (H200, 2026-12-01), so the host split matters."""
    from benchmarks import bench_sparse_conv

    r = bench_sparse_conv.recipe()
    feats, coors, shape = bench_sparse_conv.frame(False)
    cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)
    torch.manual_seed(0)
    net = r.SparseEncoder(cfg, 1, "native").to(dev).eval()

    def forward(net=net, x=feats):
        with torch.no_grad():
            net(x, coors.clone())  # a new frame's sites: no rule book of a call before

    yield "sparse-encoder-centerpoint-0075-fwd", forward
    # float16: the implicit GEMM's tensor-core kernel (CUDA sm_80+) instead of the SIMT one
    half = r.SparseEncoder(cfg, 1, "native").to(dev, torch.float16).eval()
    yield "sparse-encoder-centerpoint-0075-fwd-float16", lambda: forward(half, feats.half())


def voxel_workloads(dev):
    """The voxel family at its issue-10 target shapes: dynamic_scatter forward (voxel_group's
    launch sequence + segment_reduce) and C = 64 backward, hard and dynamic voxelization,
    pillar_scatter. Beside the two bandwidth targets (dynamic voxelization, pillar_scatter) a
    `floor-` workload moves the same bytes with torch's own kernel: an elementwise copy of half
    the bytes (read + written) for dynamic voxelization, `zero_()` of the canvas for
    pillar_scatter, so the kernels' durations compare on one machine."""
    from benchmarks import bench_dynamic_scatter, bench_pillar_scatter, bench_voxelization
    from mu_space.ops.dynamic_scatter import dynamic_scatter
    from mu_space.ops.dynamic_voxelize import dynamic_voxelize
    from mu_space.ops.pillar_scatter import pillar_scatter
    from mu_space.ops.voxelization import voxelization

    for c in (5, 64):
        f, co = bench_dynamic_scatter.inputs("centerpoint-0075-nus", c, torch.float32)
        yield (
            f"dynamic_scatter-fwd-c{c}-mean",
            lambda f=f, co=co: dynamic_scatter(f, co, "mean", backend="native"),
        )
    f, co = bench_dynamic_scatter.inputs("centerpoint-0075-nus", 64, torch.float32)
    for r in ("mean", "max"):
        leaf = f.detach().requires_grad_(True)
        out = dynamic_scatter(leaf, co, r, backend="native")[0]
        graph = (out, (leaf,), torch.randn_like(out))
        yield f"dynamic_scatter-bwd-c64-{r}", lambda g=graph: harness.autograd_backward(*g)
    for layer in ("centerpoint-0075-nus", "pointpillars-kitti"):
        vs, pcr, P, V = bench_voxelization._layer(layer)
        pts = bench_voxelization._points(lidar.VOXEL_CONFIGS[layer].cloud, torch.float32)
        yield (
            f"voxelization-{layer}",
            lambda a=(pts, vs, pcr, P, V): voxelization(*a, backend="native"),
        )
        yield (
            f"dynamic_voxelize-{layer}",
            lambda a=(pts, vs, pcr): dynamic_voxelize(*a, backend="native"),
        )
        moved = pts.numel() * pts.element_size() + pts.shape[0] * 3 * 4  # points + coors
        # an elementwise kernel (torch.neg), not copy_: a plain copy is a memcpy, which ncu does
        # not profile (session 20's run had no row for it)
        src = torch.zeros(moved // 8, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        yield f"floor-copy-dynamic_voxelize-{layer}", lambda s=src, d=dst: torch.neg(s, out=d)
    for layer in ("pointpillars-kitti", "pointpillars-nus"):
        for dt in (torch.float32, torch.float16):
            f, co, (ny, nx) = bench_pillar_scatter.inputs(layer, 1, dt)
            yield (
                f"pillar_scatter-fwd-{layer}-{dt}",
                lambda a=(f, co, 1, (ny, nx)): pillar_scatter(*a, backend="native"),
            )
            canvas = torch.empty((1, f.shape[1], ny, nx), dtype=dt, device=dev)
            yield f"floor-fill-pillar_scatter-{layer}-{dt}", lambda c=canvas: c.zero_()


def kernel_table(kernels: list[tuple[str, float]], calls: int, wall_us: float, top: int = 12):
    """Markdown rows of the device time per call of each kernel name (summed over its launches),
    largest first, with each one's share of the call's wall time."""
    per_call: dict[str, float] = {}
    for name, us in kernels:
        per_call[name] = per_call.get(name, 0.0) + us / calls
    rows = sorted(per_call.items(), key=lambda kv: -kv[1])
    lines = [
        f"wall {wall_us:.1f} us per call; kernels {sum(per_call.values()):.1f} us",
        "| kernel | us per call | % of wall |",
        "|---|---|---|",
    ]
    for name, us in rows[:top]:
        lines.append(f"| `{name[:90]}` | {us:.1f} | {100 * us / max(wall_us, 1e-9):.0f}% |")
    if len(rows) > top:
        rest = sum(us for _, us in rows[top:])
        lines.append(f"| ({len(rows) - top} more) | {rest:.1f} | {100 * rest / wall_us:.0f}% |")
    return "\n".join(lines)


def torch_profile(name: str, fn, calls: int = 20) -> str:
    """Per-kernel device times of `calls` calls from torch.profiler (CUPTI): the breakdown when
    neither nsys nor ncu is on the machine. Wall time per call from CUDA events around the calls
    (warm L2: these are for the split, the benchmarks give the cold-L2 figures)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1000 / calls
    kernels = harness.device_kernel_times(fn, calls)  # already per call
    return f"== {name}\n" + kernel_table(list(kernels.items()), 1, wall_us)


def host_profile(name: str, fn, calls: int = 50, top: int = 25) -> str:
    """Where a call's host time goes: cProfile over `calls` calls (synchronised at the end),
    the `top` functions by own time. For ops whose wall time per call is well above their
    kernels' device time (the host, not the device, bounds them)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(top)
    total_us = sum(v[2] for v in stats.stats.values()) * 1e6 / calls
    return f"== {name} (host, cProfile: {total_us:.0f} us of own time per call)\n{text.getvalue()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=".*", help="regex over workload names")
    p.add_argument(
        "--voxel",
        action="store_true",
        help="build the voxel family's workloads only (the others' inputs take a while to make)",
    )
    p.add_argument(
        "--torch-profiler",
        action="store_true",
        help="print each workload's per-kernel device times (torch.profiler) instead of marking "
        "ranges for ncu / nsys",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="print where each workload's host time goes (cProfile, own time per function)",
    )
    a = p.parse_args(argv)
    made = voxel_workloads(torch.device("cuda")) if a.voxel else workloads()
    chosen = [(n, fn) for n, fn in made if re.search(a.only, n)]
    for _, fn in chosen:  # warm-up: first-call allocations, caches, lazy loads
        fn()
        fn()
    torch.cuda.synchronize()
    if a.torch_profiler or a.host_profile:
        for name, fn in chosen:
            if a.torch_profiler:
                print(torch_profile(name, fn), end="\n\n", flush=True)
            if a.host_profile:
                print(host_profile(name, fn), end="\n\n", flush=True)
        return 0
    for name, fn in chosen:
        print(f"== {name}", flush=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        with torch.cuda.nvtx.range(name):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
