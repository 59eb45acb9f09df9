"""Host vs device time of the box3d benchmark cases (issue 12): for each --quick case of
bench_points_in_boxes, bench_boxes_overlap_bev, bench_nms3d and bench_roiaware_pool3d, the
wall time per call (back to back, warm, synchronised once per batch of calls), the device time
of its kernels per call (torch.profiler, CUDA activity) and the kernels that make it up. The
benchmarks' cold-L2 medians include both host and device; this table says which one to fix.

    python -m benchmarks.profile_box3d [--cases REGEX] [--calls 20] [--smoke]

--smoke: the benchmarks' tiny inputs, CPU-capable (no CUDA activity: device columns empty).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch

from benchmarks import (
    bench_boxes_overlap_bev,
    bench_nms3d,
    bench_points_in_boxes,
    bench_roiaware_pool3d,
    harness,
)

BENCHES = (bench_points_in_boxes, bench_boxes_overlap_bev, bench_nms3d, bench_roiaware_pool3d)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_case(case, calls: int) -> tuple[float, float, list[tuple[str, float]]]:
    """(wall us per call, device us per call, [(kernel, us per call)] largest first)."""
    args = case.make_args()
    for _ in range(3):
        case.fn(*args)
    _sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        case.fn(*args)
    _sync()
    wall = (time.perf_counter() - t0) / calls * 1e6
    per_kernel = harness.device_kernel_times(lambda: case.fn(*args), calls)
    return wall, sum(per_kernel.values()), list(per_kernel.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=".*", help="regex over case names")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    ns = argparse.Namespace(smoke=a.smoke, quick=True)
    print(f"{'case':45s} {'wall us':>9s} {'device us':>10s}  kernels (us per call)")
    for bench in BENCHES:
        for case in bench.build_cases(ns):
            if case.name.endswith("-mmcv") or not re.search(a.cases, case.name):
                continue
            wall, device, kernels = profile_case(case, a.calls)
            top = ", ".join(f"{name[:60]} {us:.1f}" for name, us in kernels[:6])
            print(f"{case.name:45s} {wall:9.1f} {device:10.1f}  {top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
