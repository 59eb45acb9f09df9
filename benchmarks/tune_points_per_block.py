"""Sweep of bev_pool_v2's points-per-block override (forward and default backward) at the
BEVDet configs, to choose the kernel's policy (`points_per_block_for` in
csrc/bev/bev_pool_v2_musa.mu). Timing as the benchmarks: cold L2, CUDA events, median.

    python -m benchmarks.tune_points_per_block [--reps 50] [--ppb 0,128,256,...]

0 is the built-in policy. Each value runs in its own process with the op's profiling knob
MUSPACE_BEV_POOL_V2_POINTS_PER_BLOCK set (it is read at import). Prints one line per (config,
dtype, direction) with the median microseconds of each value; the forward and the backward are
checked against the reference first, for every value.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from benchmarks import bench_bev_pool_v2, harness

ENV = "MUSPACE_BEV_POOL_V2_POINTS_PER_BLOCK"


def measure(reps: int) -> dict[str, float]:
    """'config dtype direction' -> median us, with the knob this process was started with."""
    from mu_space.ops.bev_pool_v2 import bev_pool_v2, bev_pool_v2_backward_reference
    from mu_space.testing.tolerances import assert_close

    medians = {}
    for cfg in bench_bev_pool_v2.CONFIGS:
        for dtype in (torch.float32, torch.float16):
            args = bench_bev_pool_v2.inputs(cfg, dtype)
            B, Z, Y, X, C = args[5]
            grad = torch.randn((B, C, Z, Y, X), device=args[1].device).to(dtype)
            calls = {
                "forward": (
                    lambda: bev_pool_v2(*args, backend="native"),
                    lambda: bev_pool_v2(*args, backend="reference"),
                ),
                "backward": (
                    lambda: bench_bev_pool_v2.backward_call(args, False, "native")(grad),
                    lambda: bev_pool_v2_backward_reference(grad, *args),
                ),
            }
            for direction, (fn, ref) in calls.items():
                assert_close(fn(), ref(), op="bev_pool_v2", name=f"{cfg} {dtype} {direction}")
                t = harness.time_gpu(fn, lambda: (), reps=reps, warmup=5)
                medians[f"{cfg} {harness.dtype_name(dtype)} {direction}"] = t.median_us
    return medians


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--ppb", default="0,128,192,256,320,384,512,640,768,1024")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.reps)))
        return 0
    if not harness.native_available():
        print("tune_points_per_block needs a CUDA GPU with the native library", file=sys.stderr)
        return 1
    values = [int(v) for v in a.ppb.split(",")]
    runs = {}
    for v in values:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.tune_points_per_block",
                "--one",
                "--reps",
                str(a.reps),
            ],
            env={**os.environ, ENV: str(v)},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        runs[v] = json.loads(done.stdout.splitlines()[-1])
        print(f"points per block {v}: done", file=sys.stderr, flush=True)
    print("config dtype direction | " + " ".join(f"{v:>7d}" for v in values))
    for key in runs[values[0]]:
        print(f"{key} | " + " ".join(f"{runs[v][key]:7.1f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
