"""Sweep of bev_pool_v2's points-per-block override (forward and default backward) at the
BEVDet configs, to choose the kernel's policy (`points_per_block_for` in
csrc/bev/bev_pool_v2_musa.mu). Timing as the benchmarks: cold L2, CUDA events, median.

    python -m benchmarks.tune_points_per_block [--reps 50] [--ppb 0,128,256,...]

0 is the built-in policy. Prints one line per (config, dtype, direction) with the median
microseconds of each value.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import bench_bev_pool_v2, harness


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--ppb", default="0,128,192,256,320,384,512,640,768,1024")
    a = p.parse_args(argv)
    import mu_space.ops  # noqa: F401

    m = sys.modules["mu_space.ops.bev_pool_v2"]
    values = [int(v) for v in a.ppb.split(",")]
    print("config dtype direction | " + " ".join(f"{v:>7d}" for v in values))
    for cfg in bench_bev_pool_v2.CONFIGS:
        for dtype in (torch.float32, torch.float16):
            args = bench_bev_pool_v2.inputs(cfg, dtype)
            depth, feat, rd, rf, rb, shape, starts, lengths = args
            B, Z, Y, X, C = shape
            grad = torch.randn((B, C, Z, Y, X), device=feat.device).to(dtype)
            ref = m.bev_pool_v2(*args, backend="reference")
            for direction in ("forward", "backward"):
                row = []
                for v in values:
                    m._POINTS_PER_BLOCK = v
                    if direction == "forward":
                        fn = lambda: m.bev_pool_v2(*args, backend="native")  # noqa: E731
                        torch.testing.assert_close(fn(), ref, **_tol(dtype))
                    else:
                        fn = lambda: m._backward(grad, *args, True, True, False, "native")  # noqa: E731
                    t = harness.time_gpu(fn, lambda: (), reps=a.reps, warmup=5)
                    row.append(t.median_us)
                m._POINTS_PER_BLOCK = 0
                print(
                    f"{cfg} {harness.dtype_name(dtype)} {direction} | "
                    + " ".join(f"{t:7.1f}" for t in row),
                    flush=True,
                )
    return 0


def _tol(dtype):
    atol, rtol = bench_bev_pool_v2.CHECK_TOL[dtype]
    return {"atol": atol, "rtol": rtol}


if __name__ == "__main__":
    sys.exit(main())
