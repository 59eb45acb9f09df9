"""Encoder wall time vs GPU busy time, ours (implicit / im2col GEMM) and spconv, interleaved."""
import time
import torch
from benchmarks import bench_sparse_conv as b
from benchmarks import _spconv_peer as peer
from mu_space.ops import _sparse_native

r = b.recipe()
feats, coors, shape = b.frame(False)
cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)


def busy(fn, reps=5):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    total, cs, ce = 0, None, None
    for s, e in iv:
        if ce is None or s > ce:
            if ce is not None: total += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    if ce is not None: total += ce - cs
    return total / reps, len(iv) / reps


def make(net, x, train):
    def fwd():
        if train:
            leaf = x.detach().requires_grad_(True)
            out = net.train()(leaf, coors.clone())["spatial_features"]
            out.sum().backward()
        else:
            with torch.no_grad():
                net.eval()(x, coors.clone())
    return fwd


for dtype in (torch.float32, torch.float16):
    for train in (False, True):
        torch.manual_seed(0)
        net = r.SparseEncoder(cfg, 1, "native").cuda().to(dtype)
        x = feats.to(dtype)
        runs = {}
        for choice in ("implicit", "im2col"):
            runs[choice] = (choice, make(net, x, train))
        if peer.available():
            twin = peer.twin(net, lambda lib: r.SparseEncoder(cfg, 1, lib=lib))
            runs["spconv"] = ("implicit", make(twin, x, train))
        walls = {k: [] for k in runs}
        for rnd in range(6):  # interleaved rounds: the host's speed drifts during a call
            for name, (choice, fn) in runs.items():
                _sparse_native.GEMM_CHOICE = choice
                fn(); torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(5): fn()
                torch.cuda.synchronize()
                walls[name].append((time.perf_counter() - t0) / 5 * 1e6)
        for name, (choice, fn) in runs.items():
            _sparse_native.GEMM_CHOICE = choice
            busy_us, nk = busy(fn)
            w = sorted(walls[name])
            print(f"{dtype} {'fwd+bwd' if train else 'fwd'} {name:8s}: wall median {w[len(w)//2]:.0f} us "
                  f"(min {w[0]:.0f}, max {w[-1]:.0f}); GPU busy {busy_us:.0f} us; {nk:.0f} kernels")
        _sparse_native.GEMM_CHOICE = "auto"
