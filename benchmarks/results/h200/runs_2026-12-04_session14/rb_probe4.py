"""Rule-book probe (session 14, D1; rb_probe3.py of session 13 plus the SubM layer): the SubM k3
rule book at the benchmark's CenterPoint frame, ours over fresh sites (the flag read inside
sparse_rulebook_subm) and over sites already checked (no read), and spconv's get_indice_pairs;
then the SubM k3 16 -> 16 float32 layer forward over fresh sites (rule book + conv), ours and
spconv's: wall per call (synchronised), host time per call (calls queued back to back, one
synchronisation at the end), kernel time per call, top kernels, and the host hot spots of ours."""
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
valid = sparse_rulebook(idx, *SUBM, backend="native").out_indices  # VALID_SITES holds it


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


def host(fn, reps=60):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    h = time.perf_counter() - t
    torch.cuda.synchronize()
    return h / reps * 1e6


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
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    return s.getvalue()


def valid_call():
    sn.SUBM_RULEBOOKS.clear()
    return sparse_rulebook(valid, *SUBM, backend="native")


cases = {
    "ours subm fresh sites (flag read)": lambda: sparse_rulebook(idx.clone(), *SUBM, backend="native"),
    "ours subm checked sites (no read)": valid_call,
}
try:
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops as sp_ops

    cases["spconv subm fresh"] = lambda: sp_ops.get_indice_pairs(
        idx.clone(), 1, shape, ConvAlgo.Native, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False
    )
except Exception as e:  # noqa: BLE001
    print("spconv not loaded:", e)
for name, fn in cases.items():
    w = wall(fn)
    h = host(fn)
    total, top = kernels(fn)
    print(f"== {name}: wall {w:.1f} us, host {h:.1f} us, kernels {total:.1f} us per call")
    for row in top:
        print("   ", row)
    if name.startswith("ours"):
        print(hot(fn))



# the SubM k3 16 -> 16 float32 layer forward over fresh sites (bench_sparse_conv's layer case)
import mu_space.sparse as ms

torch.manual_seed(0)
feats = torch.randn(idx.shape[0], 16, device=idx.device)
ours_layer = ms.SubMConv3d(16, 16, 3, padding=1, bias=False, indice_key="subm").cuda()
layer_cases = {
    "ours SubM layer forward fresh": lambda: ours_layer(ms.SparseConvTensor(feats, idx.clone(), shape, 1)).features,
}
try:
    import spconv.pytorch as sp

    sp_layer = sp.SubMConv3d(16, 16, 3, padding=1, bias=False, indice_key="subm").cuda()
    sp_layer.weight.data.copy_(ours_layer.weight.data)
    layer_cases["spconv SubM layer forward fresh"] = lambda: sp_layer(sp.SparseConvTensor(feats, idx.clone(), shape, 1)).features
except Exception as e:  # noqa: BLE001
    print("spconv layer not loaded:", e)
with torch.no_grad():
    for name, fn in layer_cases.items():
        w = wall(fn)
        h = host(fn)
        total, top = kernels(fn)
        print(f"== {name}: wall {w:.1f} us, host {h:.1f} us, kernels {total:.1f} us per call")
        for row in top:
            print("   ", row)
        if name.startswith("ours"):
            print(hot(fn))


# the host split of ours (checked sites): each FFI entry's host time (argument conversion +
# launches), timed by a wrapper around native.function's result
import collections
from mu_space.runtime import native

spent = collections.Counter()
count = collections.Counter()
real = native.function


def timed(name):
    fn = real(name)

    def call(*a):
        t = time.perf_counter()
        out = fn(*a)
        spent[name] += time.perf_counter() - t
        count[name] += 1
        return out

    return call


native.function = timed
for fn in (valid_call, lambda: sparse_rulebook(idx.clone(), *SUBM, backend="native")):
    spent.clear(); count.clear()
    reps = 200
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    total = (time.perf_counter() - t) / reps * 1e6
    torch.cuda.synchronize()
    print(f"== host split: {total:.1f} us per call, FFI entries:")
    for name, s in spent.most_common():
        print(f"    {name}: {s / reps * 1e6:.1f} us ({count[name] / reps:.0f} calls)")
native.function = real
# torch's own host costs on this machine: an allocation, a fill, a clone, a small cat + tolist
x = torch.zeros(4, dtype=torch.int32, device="cuda")
for label, op in (
    ("torch.empty(262144 int64)", lambda: torch.empty(262144, dtype=torch.int64, device="cuda")),
    ("torch.zeros(4 int32)", lambda: torch.zeros(4, dtype=torch.int32, device="cuda")),
    ("idx.clone()", lambda: idx.clone()),
    ("cat + tolist (sync)", lambda: torch.cat((x, x)).tolist()),
):
    print(f"== {label}: host {host(op, 400):.1f} us")
