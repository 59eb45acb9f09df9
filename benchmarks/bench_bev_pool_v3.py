"""bev_pool_v3 (DrivingSDK API: unsorted ranks, no intervals) at the BEVDet configs, shuffled ranks.

    python -m benchmarks.bench_bev_pool_v3 [--quick | --smoke] [--cases REGEX] [--no-flush] [--no-write]

Configs (B = 1, 6 cameras, 16x44 features, 128x128x1 grid of 0.8 m cells, real frustum
geometry; mu_space.testing.bev_pool_inputs.bevdet_ranks, then a random permutation of the
points, as DrivingSDK's recipes feed it: BEVDet's prepare without its sort):
bevdet-r50 (D 59, C 64), bevdet-r50-d88 (D 88, C 80), bevdet-d118 (D 118, C 80); float32 and
float16; forward (sort_by_cell + rank permutation + bev_pool_v2) and backward (bev_pool_v2's
backward). Plus v1 mode (2-D ranks_bev = BEVFusion coords, int32) at bevfusion-cam.

Compulsory bytes. forward: depth + feat + 3 int32 ranks per point + output;
backward: grad_out + depth + feat + 3 int32 ranks per point + grad_depth + grad_feat
(v1 mode: feat [n, C] + n*16 int32 coords + output; backward grad_out + n*4 + grad_feat).
The reference is `bev_pool_v3(..., backend="reference")` (PyTorch gather + index_add); the
backward reference is autograd through it in float32 (for 16-bit inputs too: autograd through
the 16-bit reference accumulates grad_feat in float16), cast to the input dtype.
--smoke: the bevdet-r50 and v1 cases on the `tiny` rig.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case
from mu_space.ops.bev_pool_v3 import bev_pool_v3
from mu_space.testing.bev_pool_inputs import bevdet_ranks, bevfusion_inputs

CONFIGS = ("bevdet-r50", "bevdet-r50-d88", "bevdet-d118")
SMOKE_CONFIGS = ("bevdet-r50",)
SMOKE_RIG = "tiny"  # the geometry --smoke builds the same cases on
DTYPES = (torch.float32, torch.float16)

_inputs: dict = {}


def v2_inputs(cfg: str, dtype: torch.dtype) -> dict:
    key = ("v2", cfg, dtype)
    if key not in _inputs:
        _inputs[key] = bevdet_ranks(cfg, dtype=dtype, device=harness.default_device(), shuffle=True)
    return _inputs[key]


def v1_inputs(dtype: torch.dtype, rig: str = "bevfusion-cam") -> dict:
    key = ("v1", rig, dtype)
    if key not in _inputs:
        a = bevfusion_inputs(rig, dtype=dtype, device=harness.default_device())
        g = torch.Generator().manual_seed(1)
        perm = torch.randperm(a["feats"].shape[0], generator=g).to(a["feats"].device)
        _inputs[key] = {
            "feat": a["feats"][perm].contiguous(),
            "ranks_bev": a["coords"][perm].int(),
            "bev_feat_shape": (a["B"], a["D"], a["H"], a["W"], a["feats"].shape[1]),
        }
    return _inputs[key]


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _out_elems(shape) -> int:
    B, Z, Y, X, C = shape
    return B * Z * Y * X * C


def _cases_for(name: str, a: dict, dtype: torch.dtype, params: dict) -> list[Case]:
    depth, feat = a.get("depth"), a["feat"]
    rd, rf, rb, shape = (
        a.get("ranks_depth"),
        a.get("ranks_feat"),
        a["ranks_bev"],
        a["bev_feat_shape"],
    )
    es = feat.element_size()
    ranks_bytes = _nbytes(rd) + _nbytes(rf) + _nbytes(rb)
    out_bytes = _out_elems(shape) * es
    inputs_bytes = _nbytes(depth) + _nbytes(feat)

    be = harness.backend()

    def clone(t):
        return None if t is None else t.clone()

    forward = Case(
        name=f"{name}-forward-{harness.dtype_name(dtype)}",
        op="bev_pool_v3",
        direction="forward",
        dtype=dtype,
        params=params,
        compulsory_bytes=inputs_bytes + ranks_bytes + out_bytes,
        fn=lambda d, f: bev_pool_v3(d, f, rd, rf, rb, shape, backend=be),
        make_args=lambda: (clone(depth), feat.clone()),
        reference=lambda d, f: bev_pool_v3(d, f, rd, rf, rb, shape, backend="reference"),
    )

    grad = {}

    def leaves(as_dtype=None):
        d = None if depth is None else depth.to(as_dtype or dtype).clone().requires_grad_(True)
        return d, feat.to(as_dtype or dtype).clone().requires_grad_(True)

    def make_args():
        d, f = leaves()
        out = bev_pool_v3(d, f, rd, rf, rb, shape, backend=be)
        # the reference backward runs in float32: autograd through the 16-bit reference would
        # accumulate grad_feat in float16 (index_add), several ulps off the float32 sums
        rd_, rf_ = leaves(torch.float32)
        ref = bev_pool_v3(rd_, rf_, rd, rf, rb, shape, backend="reference")
        if "g" not in grad:
            grad["g"] = torch.randn_like(out)
        return (
            out,
            [t for t in (d, f) if t is not None],
            ref,
            [t for t in (rd_, rf_) if t is not None],
            grad["g"],
        )

    def native_backward(out, xs, ref, ref_xs, g):
        return torch.autograd.grad(out, xs, g, retain_graph=True)

    def reference_backward(out, xs, ref, ref_xs, g):
        grads = torch.autograd.grad(ref, ref_xs, g.to(ref.dtype), retain_graph=True)
        return tuple(t.to(dtype) for t in grads)

    # depth mode reads depth, feat and the ranks and writes both grads; v1 mode reads one int32
    # cell per point (what its backward keeps) and writes grad_feat
    backward_bytes = out_bytes + (
        2 * inputs_bytes + ranks_bytes if depth is not None else inputs_bytes + rb.shape[0] * 4
    )
    backward = Case(
        name=f"{name}-backward-{harness.dtype_name(dtype)}",
        op="bev_pool_v3",
        direction="backward",
        dtype=dtype,
        params=params,
        compulsory_bytes=backward_bytes,
        fn=native_backward,
        make_args=make_args,
        reference=reference_backward,
    )
    return [forward, backward]


def build_cases(args) -> list[Case]:
    cases = []
    for cfg in SMOKE_CONFIGS if args.smoke else CONFIGS:
        for dtype in DTYPES:
            a = v2_inputs(SMOKE_RIG if args.smoke else cfg, dtype)
            B, Z, Y, X, C = a["bev_feat_shape"]
            params = {
                "config": SMOKE_RIG if args.smoke else cfg,
                "n_points": int(a["ranks_bev"].shape[0]),
                "C": C,
                "depth_shape": list(a["depth"].shape),
                "ranks": "shuffled",
            }
            cases += _cases_for(f"{cfg}-shuffled", a, dtype, params)
    for dtype in DTYPES:
        a = v1_inputs(dtype, SMOKE_RIG if args.smoke else "bevfusion-cam")
        params = {
            "config": SMOKE_RIG if args.smoke else "bevfusion-cam",
            "mode": "v1 (2-D ranks_bev)",
            "n_points": int(a["ranks_bev"].shape[0]),
            "C": a["bev_feat_shape"][4],
        }
        cases += _cases_for("bevfusion-cam-v1", a, dtype, params)
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("bev_pool_v3", build_cases, argv, doc=__doc__)


if __name__ == "__main__":
    sys.exit(main())
