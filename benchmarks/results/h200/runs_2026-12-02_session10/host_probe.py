"""Where the sparse encoder's wall time goes on the GPU: wall per forward, the GPU's busy
fraction over the window, and a cProfile of the host path (sync waits are `tolist` / `item`)."""
import cProfile, pstats, io, sys, time
import torch
from benchmarks import bench_sparse_conv as b
from benchmarks import _spconv_peer as peer

r = b.recipe()
feats, coors, shape = b.frame(False)
cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)


def busy(fn, reps=3):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps
    iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    total = 0; cur_s, cur_e = None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None: total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None: total += cur_e - cur_s
    return wall * 1e6, total / reps, len(iv) / reps


def run(name, net, x, train=False):
    w = None
    def fwd():
        if train:
            leaf = x.detach().requires_grad_(True)
            out = net.train()(leaf, coors.clone())["spatial_features"]
            out.sum().backward()
        else:
            with torch.no_grad():
                net.eval()(x, coors.clone())
    for _ in range(3): fwd()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10): fwd()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10 * 1e6
    pw, busy_us, nk = busy(fwd)
    print(f"== {name}: wall {wall:.0f} us; under profiler wall {pw:.0f} us, GPU busy {busy_us:.0f} us ({busy_us/pw:.0%}), {nk:.0f} kernels")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(5): fwd()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(35)
    print(s.getvalue()[-9000:])
    s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("cumulative").print_stats(45)
    print(s.getvalue()[-9000:])


for dtype in (torch.float32, torch.float16):
    torch.manual_seed(0)
    net = r.SparseEncoder(cfg, 1, "native").cuda().to(dtype)
    run(f"ours forward {dtype}", net, feats.to(dtype))
    if dtype == torch.float32:
        run(f"ours forward+backward {dtype}", net, feats.to(dtype), train=True)
    if peer.available():
        twin = peer.twin(net, lambda lib: r.SparseEncoder(cfg, 1, lib=lib))
        run(f"spconv forward {dtype}", twin, feats.to(dtype))
