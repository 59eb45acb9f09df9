"""Rule-book probe (prepared in session 15 for the next call, not run yet): rb_probe5.py with the
hash table switched too (the PackedTable through _sparse_native.packed_table_allowed, or the
int64-key table): the SubM k3 rule book at the benchmark's CenterPoint frame (118561 voxels),
mirror lookups on and off, and spconv's get_indice_pairs in the same process: the bench's timing (CUDA events, cold L2, GPU spacer, median of 100, fresh sites: a
clone per call, so the flag read runs), wall / host / kernel time per call and the top kernels;
then the SubM k3 16 -> 16 float32 layer forward over fresh sites, both settings and spconv."""
import time

import torch

from benchmarks import bench_sparse_conv as b
from benchmarks import harness
from mu_space.ops import _sparse_native as sn
from mu_space.ops.sparse_rulebook import sparse_rulebook

_, coors, shape = b.frame(False)
idx = coors.contiguous()
SUBM = (1, shape, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False)
print("voxels", idx.shape[0])


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
    rows = sorted(ev, key=lambda e: -e.device_time_total)[:10]
    return total, [(e.key[:70], round(e.device_time_total / calls, 1), e.count // calls) for e in rows]


def with_mirror(flag, fn, packed=True):
    def call():
        sn.SUBM_MIRROR = flag
        sn.packed_table_allowed = lambda: packed
        return fn()

    return call


fresh = lambda: sparse_rulebook(idx.clone(), *SUBM, backend="native")  # noqa: E731
want = sparse_rulebook(idx, *SUBM, backend="reference")
for flag in (True, False):
    for packed in (True, False):
        got = with_mirror(flag, fresh, packed)()
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"mirror={flag} packed={packed}"
print("native (mirror on and off, packed and int64 tables) == reference at 118561 voxels")
cases = {
    "ours subm fresh, mirror, packed table": with_mirror(True, fresh),
    "ours subm fresh, mirror, int64 table": with_mirror(True, fresh, False),
    "ours subm fresh, every offset, packed table": with_mirror(False, fresh),
}
try:
    from spconv.core import ConvAlgo
    from spconv.pytorch import ops as sp_ops

    cases["spconv subm fresh"] = lambda: sp_ops.get_indice_pairs(
        idx.clone(), 1, shape, ConvAlgo.Native, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False
    )
except Exception as e:  # noqa: BLE001
    print("spconv not loaded:", e)
for rnd in range(2):
    for name, fn in cases.items():
        t = harness.time_gpu(lambda: fn(), lambda: (), reps=100, warmup=10)
        print(f"-- round {rnd} {name}: bench timing median {t.median_us:.1f} us (p10 {t.p10_us:.1f}, p90 {t.p90_us:.1f})")
for name, fn in cases.items():
    w = wall(fn)
    h = host(fn)
    total, top = kernels(fn)
    print(f"== {name}: wall {w:.1f} us, host {h:.1f} us, kernels {total:.1f} us per call")
    for row in top:
        print("   ", row)

import mu_space.sparse as ms

torch.manual_seed(0)
feats = torch.randn(idx.shape[0], 16, device=idx.device)
ours_layer = ms.SubMConv3d(16, 16, 3, padding=1, bias=False, indice_key="subm").cuda()
layer = lambda: ours_layer(ms.SparseConvTensor(feats, idx.clone(), shape, 1)).features  # noqa: E731
layer_cases = {
    "ours SubM layer forward fresh, mirror, packed table": with_mirror(True, layer),
    "ours SubM layer forward fresh, mirror, int64 table": with_mirror(True, layer, False),
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
        t = harness.time_gpu(lambda: fn(), lambda: (), reps=100, warmup=10)
        w = wall(fn)
        total, top = kernels(fn)
        print(f"== {name}: bench timing {t.median_us:.1f} us, wall {w:.1f} us, kernels {total:.1f} us per call")
        for row in top[:6]:
            print("   ", row)
sn.SUBM_MIRROR = True
