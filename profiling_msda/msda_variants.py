"""Times the native MSDA kernels directly over launch-policy variants (profiling driver).

    python profiling/msda_variants.py [--reps 10] [--ncu]

Each timing: CUDA events around one native call, L2 flushed (256 MB write) before every rep,
median. Without --ncu: a table of variants (channels_per_thread, backward mode) per case and
dtype, plus the max relative difference of each variant against the default. With --ncu: one
call of each kernel of interest (for `ncu --kernel-name regex:...`).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from mu_space.runtime import native
from mu_space.testing import msda_inputs

CASES = ("bevformer-base-tsa", "bevformer-base-sca", "deformable-detr")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
FWD = native.function("multi_scale_deformable_attn_forward")
BWD = native.function("multi_scale_deformable_attn_backward")


_CPU = {}


def make(name, dtype, device):
    if name not in _CPU:
        m = msda_inputs.make(name, dtype=torch.float32, device="cpu", seed=0)
        value, shapes, starts, loc, attn = msda_inputs.args(m)
        cfg = m["config"]
        g = torch.Generator().manual_seed(1)
        grad = torch.randn(cfg.batch, cfg.queries, cfg.heads * cfg.head_dim, generator=g)
        _CPU[name] = (grad, value, shapes, starts, loc, attn)
    grad, value, shapes, starts, loc, attn = _CPU[name]
    t = [x.to(device=device, dtype=dtype) for x in (grad, value, loc, attn)]
    return t[0], t[1], shapes.to(device), starts.to(device), t[2], t[3]


def fwd(inp, cpt, block=0):
    grad, value, shapes, starts, loc, attn = inp
    out = torch.empty(grad.shape, dtype=value.dtype, device=value.device)
    FWD(value, shapes, starts, loc, attn, out, cpt, block, torch.cuda.current_stream().cuda_stream)
    return out


def bwd(inp, cpt, mode, block=0, bufs=None):
    grad, value, shapes, starts, loc, attn = inp
    if bufs is None:
        bufs = (torch.empty_like(value), torch.empty_like(loc), torch.empty_like(attn),
                torch.empty(value.shape if value.dtype != torch.float32 else (0,),
                            dtype=torch.float32, device=value.device))
    gv, gl, ga, ws = bufs
    BWD(grad, value, shapes, starts, loc, attn, gv, gl, ga, ws,
        torch.empty(0, dtype=torch.int32, device=value.device), mode, cpt, block,
        torch.cuda.current_stream().cuda_stream)
    return gv, gl, ga


_FLUSH = None


def timed(fn, reps):
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        _FLUSH.fill_(1)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)


def reldiff(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default="f32,f16,bf16")
    ap.add_argument("--fwd", default="0,4", help="channels_per_thread variants (forward)")
    ap.add_argument("--bwd", default="0:0,4:0,0:2,4:2", help="cpt:mode variants (backward)")
    ap.add_argument("--blocks", default="0")
    a = ap.parse_args()
    dev = torch.device("cuda")
    fwd_v = [int(v) for v in a.fwd.split(",") if v]
    bwd_v = [tuple(int(x) for x in v.split(":")) for v in a.bwd.split(",") if v]
    blocks = [int(v) for v in a.blocks.split(",")]
    rows = []
    for name in a.cases.split(","):
        for dn in a.dtypes.split(","):
            inp = make(name, DTYPES[dn], dev)
            if a.ncu:
                for cpt in fwd_v:
                    fwd(inp, cpt)
                for cpt, mode in bwd_v:
                    bwd(inp, cpt, mode)
                torch.cuda.synchronize()
                continue
            ref_f = fwd(inp, 0)
            ref_b = bwd(inp, 0, 0)
            for blk in blocks:
                for cpt in fwd_v:
                    t = timed(lambda: fwd(inp, cpt, blk), a.reps)
                    err = reldiff(fwd(inp, cpt, blk), ref_f)
                    rows.append((name, dn, "fwd", f"cpt{cpt}", blk, t, err))
                for cpt, mode in bwd_v:
                    bufs = (torch.empty_like(inp[1]), torch.empty_like(inp[4]), torch.empty_like(inp[5]),
                            torch.empty(inp[1].shape if inp[1].dtype != torch.float32 else (0,),
                                        dtype=torch.float32, device=dev))
                    t = timed(lambda: bwd(inp, cpt, mode, blk, bufs), a.reps)
                    got = bwd(inp, cpt, mode, blk)
                    err = max(reldiff(x, y) for x, y in zip(got, ref_b))
                    rows.append((name, dn, "bwd", f"cpt{cpt}m{mode}", blk, t, err))
            del inp
            torch.cuda.empty_cache()
    if not a.ncu:
        print(f"{'case':20s} {'dt':4s} {'dir':3s} {'variant':9s} {'blk':>4s} {'us':>9s} {'rel.diff':>9s}")
        for r in rows:
            print(f"{r[0]:20s} {r[1]:4s} {r[2]:3s} {r[3]:9s} {r[4]:4d} {r[5]:9.1f} {r[6]:9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
