"""Where the time of the CenterPoint-0.075 SparseEncoder goes: rule book vs gather vs GEMM vs
scatter vs the rest (BatchNorm, ReLU, copies), from the device kernels torch.profiler records
(CUPTI) over a few steps, grouped by kernel name.

    python -m benchmarks.profile_sparse_encoder [--steps 5] [--dtype float32|float16]
        [--direction forward|forward+backward] [--out DIR] [--smoke]

On the GPU it profiles the native backend on the benchmark's frame (bench_sparse_conv.frame:
~120k voxels of a synthetic 10-sweep nuScenes-like cloud, `[41, 1440, 1440]`). --smoke: the small
frame, and on a machine without a GPU the reference backend's CPU operators (the categories then
group aten ops: the mechanics only, not a measurement). For per-kernel metrics (bandwidth,
occupancy) run the top kernels under Nsight Compute:

    ncu --set detailed -k regex:"gather_kernel|scatter_kernel|pair_" --launch-count 20 \
        python3 -m benchmarks.profile_sparse_encoder --steps 1
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from benchmarks import bench_sparse_conv, harness

# first match wins; device kernels (demangled names) and, for --smoke on the CPU, aten ops
CATEGORIES = (
    (
        "rule book",
        r"candidates_kernel|decode_kernel|insert_keys_kernel|insert_rows_kernel|"
        r"pair_tile_scan_kernel|pair_emit_kernel|pair_lookup_kernel|run_emit_kernel|run_flags_kernel|"
        r"mark_kernel|popcount_kernel|decode_bitmap_kernel|"
        r"RadixSort|radix_sort|aten::sort|aten::unique|aten::searchsorted",
    ),
    ("pair counts", r"pair_counts_kernel|pair_rows_kernel"),
    ("neighbour maps", r"neighbour_maps_kernel"),
    # gather and GEMM in one kernel (the float32 default since 2026-12-02)
    (
        "implicit GEMM",
        r"implicit_gemm_kernel|implicit_gemm_mma_kernel|wgrad_partial_kernel|sum_splits_kernel",
    ),
    ("gather", r"gather_kernel|im2col_kernel|aten::index_select|aten::index\b"),
    ("GEMM", r"gemm|gemv|xmma|cutlass|cublas|nvjet|sm90_|splitKreduce|aten::mm\b|aten::addmm"),
    ("scatter", r"scatter_kernel|aten::index_add"),
    ("max pool", r"pool_offset_kernel|pool_grad_offset_kernel|pool_unreached_kernel"),
    ("BatchNorm", r"batch_norm|batchnorm|bn_fw|bn_bw|welford"),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def profile(steps: int, dtype: torch.dtype, direction: str, smoke: bool) -> dict:
    on_gpu = torch.cuda.is_available()
    backend = "native" if on_gpu else "reference"
    r = bench_sparse_conv.recipe()
    feats, coors, shape = bench_sparse_conv.frame(smoke)
    cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)
    torch.manual_seed(0)
    net = r.SparseEncoder(cfg, 1, backend).to(feats.device, dtype)
    x = feats.to(dtype)

    def step():
        if direction == "forward":
            with torch.no_grad():
                net.eval()(x, coors.clone())  # new sites each call: no rule book reused
            return
        net.train()
        leaf = x.detach().requires_grad_(True)
        out = net(leaf, coors.clone())["spatial_features"]
        torch.autograd.grad(out, [leaf, *net.parameters()], torch.ones_like(out))

    for _ in range(2):  # warm-up: cuBLAS handles, allocator, lazy module state
        step()
    if on_gpu:  # the device's own events: kernels, memsets, copies
        kernels = harness.device_kernel_times(step, steps)
    else:  # the reference's aten ops on the CPU (the mechanics only)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        kernels = {}
        for evt in prof.key_averages():
            if evt.key.startswith("aten::"):
                kernels[evt.key] = kernels.get(evt.key, 0.0) + evt.self_cpu_time_total / steps
    totals: dict[str, float] = {}
    for name, us in kernels.items():
        totals[category(name)] = totals.get(category(name), 0.0) + us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (aten ops, not a measurement)",
        "backend": backend,
        "dtype": harness.dtype_name(dtype),
        "direction": direction,
        "voxels": int(feats.shape[0]),
        "sparse_shape": list(shape),
        "steps": steps,
        "us_per_step_by_category": dict(sorted(totals.items(), key=lambda kv: -kv[1])),
        "top_kernels_us_per_step": [{"name": k[:160], "us": v} for k, v in top],
    }


def table(result: dict) -> str:
    total = sum(result["us_per_step_by_category"].values()) or 1.0
    lines = [
        f"{result['direction']} {result['dtype']} on {result['device']} ({result['backend']}, "
        f"{result['voxels']} voxels): {total:.1f} us per step",
        "| category | us per step | share |",
        "|---|---|---|",
    ]
    for label, us in result["us_per_step_by_category"].items():
        lines.append(f"| {label} | {us:.1f} | {100 * us / total:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "float16"), default=None)
    parser.add_argument("--direction", choices=("forward", "forward+backward"), default=None)
    parser.add_argument("--out", type=Path, help="write profile_sparse_encoder.json there")
    parser.add_argument("--smoke", action="store_true", help="the small frame (CPU: mechanics)")
    args = parser.parse_args(argv)
    dtypes = [args.dtype] if args.dtype else ["float32", "float16"]
    directions = [args.direction] if args.direction else ["forward", "forward+backward"]
    if not torch.cuda.is_available():
        dtypes = ["float32"]  # the CPU reference: float16 matmuls there are not the point
    results = []
    for dt in dtypes:
        for direction in directions:
            res = profile(args.steps, getattr(torch, dt), direction, args.smoke)
            results.append(res)
            print(table(res), end="\n\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_sparse_encoder.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
