"""Rule-book host probe (session 11): wall time per call, kernel time per call (profiler), host
hot spots (cProfile) of the native SubM rule book and the strided one on both output-site paths,
on the benchmark's CenterPoint frame."""
import cProfile
import io
import pstats
import time

import torch

from benchmarks import bench_sparse_conv as b
from mu_space.ops import _sparse_native as sn
from mu_space.ops.sparse_rulebook import sparse_rulebook

_, coors, shape = b.frame(False)
idx = coors.contiguous()
SUBM = (1, shape, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False)
STRIDED = (1, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, False, False)
valid = sparse_rulebook(idx, *SUBM, backend="native").out_indices  # VALID_SITES


def wall(fn, reps=60):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def kernels(fn, calls=10):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in ev) / calls
    rows = sorted(ev, key=lambda e: -e.device_time_total)[:12]
    return total, [(e.key[:70], round(e.device_time_total / calls, 1), e.count // calls) for e in rows]


def hot(fn, calls=30):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


cases = {
    "subm fresh sites": lambda: sparse_rulebook(idx.clone(), *SUBM, backend="native"),
    "strided fresh sites": lambda: sparse_rulebook(idx.clone(), *STRIDED, backend="native"),
    "strided valid sites": lambda: sparse_rulebook(valid, *STRIDED, backend="native"),
}
for name, fn in cases.items():
    for bitmap in (True, False) if "strided" in name else (True,):
        sn.BITMAP_ENABLED = bitmap
        label = f"{name}{' bitmap' if bitmap else ' sort'}" if "strided" in name else name
        w = wall(fn)
        total, top = kernels(fn)
        print(f"== {label}: wall {w:.1f} us, kernels {total:.1f} us per call")
        for row in top:
            print("   ", row)
        if "valid" in name or "subm" in name:
            print(hot(fn))
sn.BITMAP_ENABLED = True
