"""Per-call host overhead of the public API against a direct TVM-FFI call and `torch.add`.

Operators such as bev_pool_v2 run in a few microseconds, so the Python path in front of the
kernel (validation, dispatch record, stream lookup, custom-op registration) must stay small.
Each variant is called back to back N times on a tiny tensor (the GPU work is shorter than the
host work, so the queue never fills and wall time per call is the host overhead); the median
of several trials is reported.

    python -m benchmarks.bench_overhead [--calls 20000] [--trials 7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import mu_space
from benchmarks import harness
from mu_space.runtime import kernel_dispatch, native
from mu_space.runtime.device import stream_handle


def per_call_us(fn, calls: int, trials: int, sync) -> float:
    for _ in range(200):
        fn()
    sync()
    samples = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def variants(x: torch.Tensor) -> dict:
    out = torch.empty_like(x)
    ffi = native.function("add_one_forward")
    stream = stream_handle(x)
    compiled = torch.compile(lambda t: mu_space.ops.add_one(t), fullgraph=True)
    return {
        "torch.add(x, 1)": lambda: torch.add(x, 1),
        "tvm-ffi call, preallocated out": lambda: ffi(x, out, stream),
        "tvm-ffi call + empty_like + stream lookup": lambda: ffi(
            x, torch.empty_like(x), stream_handle(x)
        ),
        "mu_space.ops.add_one (public eager path)": lambda: mu_space.ops.add_one(x),
        "torch.ops.mu_space.add_one (custom op dispatch)": lambda: torch.ops.mu_space.add_one(
            x, "auto"
        ),
        "torch.compile(add_one)": lambda: compiled(x),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args, _ = parser.parse_known_args(argv)
    if args.quick:
        args.calls, args.trials = 2000, 3
    device = harness.default_device()
    if device.type != "cuda" or native.unavailable_reason(device):
        print(
            f"bench_overhead needs the native library on a GPU: "
            f"{native.unavailable_reason(device) if device.type == 'cuda' else 'no GPU'}"
        )
        return 1
    x = torch.randn(1024, device=device)
    sync = torch.cuda.synchronize
    rows = []
    for name, fn in variants(x).items():
        kernel_dispatch.reset()
        rows.append(
            {"variant": name, "us_per_call": per_call_us(fn, args.calls, args.trials, sync)}
        )
    base = rows[0]["us_per_call"]
    for r in rows:
        r["ratio_to_torch_add"] = r["us_per_call"] / base
    print(f"{'variant':50s} {'us/call':>8s} {'x torch.add':>12s}")
    for r in rows:
        print(f"{r['variant']:50s} {r['us_per_call']:8.2f} {r['ratio_to_torch_add']:12.2f}")
    out = Path(args.out or harness.RESULTS_ROOT / harness.gpu_slug())
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("overhead.quick.json" if args.quick else "overhead.json")
    path.write_text(
        json.dumps(
            {
                "benchmark": "overhead",
                "metadata": harness.environment_metadata(),
                "calls": args.calls,
                "trials": args.trials,
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
