"""bev_pool (BEVFusion API) at the bevfusion-cam geometry: forward, backward, and a sweep over points.

    python -m benchmarks.bench_bev_pool [--quick] [--cases REGEX] [--no-flush] [--no-write]

Inputs are built the way BEVFusion's vtransform builds them (mu_space.testing.bev_pool_inputs):
6 cameras, 32x88 feature maps, D = 118 depth bins, C = 80, a 360x360x1 grid of 0.3 m cells,
int64 coords (x, y, z, batch), points outside the grid filtered out (1.82 M points remain).

Cases
- bevfusion-cam-{forward,backward} in float32 and float16 (the issue-3 target: >= 50% of the
  copy bandwidth measured in the same run; the verdict is printed and stored in the JSON);
- bevfusion-cam-cells / -sort: the two steps in front of the pooling kernel (coords -> flat
  cells in PyTorch; sort_by_cell), timed alone so a miss can be attributed;
- sweep-n{N}: 10 k -> 5 M points, a random subset of a B = 3 bevfusion-cam batch (the 3 x 360 x
  360 x 80 output is written in every case, which is the floor at small N).

Compulsory bytes. forward: feats (n*C) + coords (n*4 int64) + output (B*C*D*H*W);
backward: grad_out (B*C*D*H*W) + one int32 cell per point + grad_feats (n*C).
The reference is `bev_pool(..., backend="reference")` (PyTorch index_add) on the same GPU.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case, common_argparser
from mu_space.ops.bev_pool import bev_pool
from mu_space.ops.bev_pool_prepare import sort_by_cell
from mu_space.ops.bev_pool_v3 import _coords_to_cells
from mu_space.testing.bev_pool_inputs import bevfusion_inputs

CONFIG = "bevfusion-cam"
DTYPES = (torch.float32, torch.float16)
SWEEP = (10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 5_000_000)
QUICK_SWEEP = (10_000, 1_000_000)
SWEEP_BATCH = 3  # 3 x 1.82 M points available
TARGET_PCT_OF_COPY = 50.0
# Check tolerances (atol, rtol): the reference accumulates with float32 atomics in another order.
CHECK_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-3, 2e-3)}

_inputs: dict = {}


def inputs(batch: int, dtype: torch.dtype, n_points: int | None = None) -> dict:
    """Cached bevfusion-cam inputs on the GPU (optionally a seeded random subset of points)."""
    key = (batch, dtype, n_points)
    if key not in _inputs:
        base_key = (batch, dtype, None)
        if base_key not in _inputs:
            _inputs[base_key] = bevfusion_inputs(
                CONFIG, batch=batch, dtype=dtype, device=harness.default_device()
            )
        a = _inputs[base_key]
        if n_points is not None:
            n = a["feats"].shape[0]
            if n_points > n:
                raise ValueError(f"{n_points} points requested, the geometry has {n}")
            g = torch.Generator().manual_seed(n_points)
            idx = torch.randperm(n, generator=g)[:n_points].to(a["feats"].device)
            a = {
                **a,
                "feats": a["feats"][idx].contiguous(),
                "coords": a["coords"][idx].contiguous(),
            }
        _inputs[key] = a
    return _inputs[key]


def _dims(a):
    return a["B"], a["D"], a["H"], a["W"]


def _out_elems(a) -> int:
    B, D, H, W = _dims(a)
    return B * a["feats"].shape[1] * D * H * W


def _check(dtype):
    return harness.close_check(*CHECK_TOL[dtype])


def forward_case(name: str, a: dict, dtype: torch.dtype, params: dict) -> Case:
    dims = _dims(a)
    n, C = a["feats"].shape
    es = a["feats"].element_size()
    return Case(
        name=name,
        op="bev_pool",
        direction="forward",
        dtype=dtype,
        params=params,
        compulsory_bytes=n * C * es
        + a["coords"].numel() * a["coords"].element_size()
        + _out_elems(a) * es,
        fn=lambda f, c: bev_pool(f, c, *dims, backend="native"),
        make_args=lambda: (a["feats"].clone(), a["coords"].clone()),
        reference=lambda f, c: bev_pool(f, c, *dims, backend="reference"),
        check=_check(dtype),
    )


def backward_case(name: str, a: dict, dtype: torch.dtype, params: dict) -> Case:
    dims = _dims(a)
    n, C = a["feats"].shape
    es = a["feats"].element_size()
    grad = {}

    def make_args():
        feats = a["feats"].clone().requires_grad_(True)
        out = bev_pool(feats, a["coords"], *dims, backend="native")
        ref_feats = a["feats"].clone().requires_grad_(True)
        ref_out = bev_pool(ref_feats, a["coords"], *dims, backend="reference")
        if "g" not in grad:
            grad["g"] = torch.randn_like(out)
        return out, feats, ref_out, ref_feats, grad["g"]

    def native_backward(out, feats, ref_out, ref_feats, g):
        return torch.autograd.grad(out, feats, g, retain_graph=True)[0]

    def reference_backward(out, feats, ref_out, ref_feats, g):
        return torch.autograd.grad(ref_out, ref_feats, g, retain_graph=True)[0]

    return Case(
        name=name,
        op="bev_pool",
        direction="backward",
        dtype=dtype,
        params=params,
        compulsory_bytes=_out_elems(a) * es + n * 4 + n * C * es,
        fn=native_backward,
        make_args=make_args,
        reference=reference_backward,
        check=_check(dtype),
    )


def step_cases(a: dict) -> list[Case]:
    """The steps in front of the pooling kernel, timed alone (diagnostics, unchecked)."""
    B, D, H, W = _dims(a)
    n = a["coords"].shape[0]
    params = {"config": CONFIG, "n_points": n}
    cells = _coords_to_cells(a["coords"], (B, D, H, W))
    return [
        Case(
            name=f"{CONFIG}-cells",
            op="bev_pool.cells",
            direction="forward",
            dtype=a["coords"].dtype,
            params=params,
            compulsory_bytes=a["coords"].numel() * a["coords"].element_size()
            + n * cells.element_size(),
            fn=lambda c: _coords_to_cells(c, (B, D, H, W)),
            make_args=lambda: a["coords"].clone(),
        ),
        Case(
            name=f"{CONFIG}-sort",
            op="sort_by_cell",
            direction="forward",
            dtype=cells.dtype,
            params={**params, "n_cells": B * D * H * W},
            compulsory_bytes=n * cells.element_size() + n * 4,
            fn=lambda c: sort_by_cell(c, B * D * H * W, backend="native"),
            make_args=lambda: cells.clone(),
        ),
    ]


def build_cases(quick: bool) -> list[Case]:
    cases = []
    for dtype in DTYPES:
        a = inputs(1, dtype)
        n, C = a["feats"].shape
        params = {"config": CONFIG, "n_points": n, "C": C, "grid": [a["B"], a["D"], a["H"], a["W"]]}
        d = harness.dtype_name(dtype)
        cases.append(forward_case(f"{CONFIG}-forward-{d}", a, dtype, params))
        cases.append(backward_case(f"{CONFIG}-backward-{d}", a, dtype, params))
    cases += step_cases(inputs(1, torch.float32))
    for n_points in QUICK_SWEEP if quick else SWEEP:
        for dtype in (torch.float32,) if quick else DTYPES:
            a = inputs(SWEEP_BATCH, dtype, n_points)
            params = {
                "sweep": "n_points",
                "n_points": n_points,
                "config": f"{CONFIG} B={SWEEP_BATCH}",
            }
            cases.append(
                forward_case(
                    f"sweep-n{n_points}-forward-{harness.dtype_name(dtype)}", a, dtype, params
                )
            )
            if dtype == torch.float32:
                cases.append(backward_case(f"sweep-n{n_points}-backward-float32", a, dtype, params))
    return cases


def target_verdicts(records: list[dict]) -> list[dict]:
    """Issue 3: bev_pool at bevfusion-cam >= 50% of the copy bandwidth, fp32 and fp16."""
    out = []
    for r in records:
        if r["name"].startswith(f"{CONFIG}-forward") or r["name"].startswith(f"{CONFIG}-backward"):
            pct = r.get("pct_of_copy_bw")
            out.append(
                {
                    "case": r["name"],
                    "pct_of_copy_bw": pct,
                    "target_pct": TARGET_PCT_OF_COPY,
                    "met": None if pct is None else pct >= TARGET_PCT_OF_COPY,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    args = common_argparser(__doc__.splitlines()[0]).parse_args(argv)
    device = harness.default_device()
    if device.type != "cuda":
        print("bench_bev_pool needs a CUDA GPU with the native library", file=sys.stderr)
        return 1
    nbytes = harness.copy_nbytes(args)
    copy_bw = harness.measure_copy_bandwidth(device, nbytes)
    records = harness.run_cases(build_cases(args.quick), args=args, copy_bw=copy_bw)
    verdicts = target_verdicts(records)
    if args.no_write:
        harness.print_table(records)
    else:
        metadata = {
            **harness.environment_metadata(),
            "copy_bandwidth_bytes": nbytes,
            "timing": harness.timing_settings(args),
            "targets": verdicts,
            "argv": {k: str(v) for k, v in vars(args).items()},
        }
        harness.write_results(
            harness.result_stem("bev_pool", args),
            records,
            args.out or harness.RESULTS_ROOT / harness.gpu_slug(),
            metadata,
            copy_bw,
        )
    for v in verdicts:
        pct = "-" if v["pct_of_copy_bw"] is None else f"{v['pct_of_copy_bw']:.1f}%"
        state = {True: "MET", False: "MISSED", None: "NOT MEASURED"}[v["met"]]
        print(
            f"target {v['case']}: {pct} of copy bandwidth (target >= {TARGET_PCT_OF_COPY:.0f}%): {state}"
        )
    return harness.exit_status(records)


if __name__ == "__main__":
    sys.exit(main())
