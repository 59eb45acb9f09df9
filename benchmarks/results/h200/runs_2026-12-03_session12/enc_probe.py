"""Encoder host probe (session 12): the CenterPoint-0.075 SparseEncoder forward (eval, no_grad,
new sites each call) in float16 / float32: wall per call, kernel time per call, the host
synchronisations (torch.cuda sync debug mode: where each happens), and the host hot spots
(cProfile, by own time and by cumulative time)."""
import cProfile
import collections
import io
import pstats
import sys
import time
import traceback
import warnings

import torch

from benchmarks import bench_sparse_conv as b

r = b.recipe()
feats, coors, shape = b.frame(False)
cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)
dtypes = [torch.float16, torch.float32] if len(sys.argv) < 2 else [getattr(torch, a) for a in sys.argv[1:]]
for dtype in dtypes:
    torch.manual_seed(0)
    net = r.SparseEncoder(cfg, 1, "auto").to("cuda", dtype).eval()
    f = feats.to(dtype)

    def fn():
        with torch.no_grad():
            return net(f, coors.clone())["spatial_features"]

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(30):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    ts.sort()
    print(f"== {dtype}: wall {ts[15] * 1e6:.1f} us per forward")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    print(f"   kernels {sum(e.device_time_total for e in ev) / 5:.1f} us per forward, "
          f"{sum(e.count for e in ev) / 5:.0f} launches")
    # host synchronisations: where
    sites = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        sites[f"{w.filename}:{w.lineno}"] += 1
    print(f"   syncs per forward: {len(caught)}")
    for k, v in sites.most_common():
        print(f"   {v} x {k}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    for key in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(30)
        print(s.getvalue())
