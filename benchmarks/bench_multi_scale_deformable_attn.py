"""multi_scale_deformable_attn (mmcv API) at the BEVFormer / Deformable DETR shapes.

    python -m benchmarks.bench_multi_scale_deformable_attn [--quick] [--cases REGEX] [--no-flush] [--no-write]

Model cases (mu_space.testing.msda_inputs: reference points on the query grid, Deformable DETR's
initial offset pattern plus noise, softmaxed weights, ~2% of samples across the borders), each
forward and backward, float32 / float16 / bfloat16:
- bevformer-base-tsa: bs 2, 40,000 queries, 8 heads x 32, 1 level (200 x 200), 4 points
- bevformer-base-sca: bs 6, 10,000 queries, 8 heads x 32, 4 levels (116x200 .. 15x25), 8 points
- deformable-detr:    bs 1, 15,200 queries, 8 heads x 32, 4 levels (100x152 .. 13x19), 8 points
plus the deterministic backward (`torch.use_deterministic_algorithms(True)`: no float atomics)
in float32 and float16 ("-det"), and a sweep over queries (1k -> 200k, deformable-detr levels,
float32 and float16; checked against the reference but not timed against it) showing how cost
grows.

Compulsory bytes. forward: value + sampling_locations + attention_weights + level metadata read,
output written. backward: grad_output + value + sampling_locations + attention_weights + level
metadata read, grad_value + grad_sampling_locations + grad_attention_weights written (the native
backward also zero-fills grad_value / its float32 workspace: that traffic is not compulsory).
The forward reference is `multi_scale_deformable_attn_reference` (one F.grid_sample per level),
the backward reference its closed-form vectorised backward
(`multi_scale_deformable_attn_reference_backward`, gather + scatter_add per level); float16 /
bfloat16 references compute in float32. Timed calls go through the public API / the backward
custom op with backend="native", so they include the Python glue and the output allocations.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case, common_argparser
from mu_space.ops.multi_scale_deformable_attn import (
    multi_scale_deformable_attn,
    multi_scale_deformable_attn_reference,
    multi_scale_deformable_attn_reference_backward,
)
from mu_space.testing import msda_inputs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DET_DTYPES = (torch.float32, torch.float16)
SWEEP_BASE = "deformable-detr"
SWEEP_QUERIES = (1_000, 3_000, 10_000, 30_000, 100_000, 200_000)
SWEEP_DTYPES = (torch.float32, torch.float16)
QUICK_SWEEP_QUERIES = (1_000, 30_000)
CPU_SMOKE_QUERIES = 500  # without a GPU the script still runs end to end, on small inputs

# Check tolerances: (atol as a fraction of max|reference|, rtol); the native kernel rounds the
# pixel coordinate once in float32 and accumulates in float32, in another order (atomics in
# the default backward); float16 / bfloat16 outputs add one rounding of the output dtype.
CHECK_TOL = {
    torch.float32: (5e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

_inputs: dict = {}


def _backend() -> str:
    return "native" if torch.cuda.is_available() else "auto"


def inputs(cfg: msda_inputs.MSDAConfig, dtype: torch.dtype) -> tuple:
    """(grad_output, value, shapes, starts, locations, weights) on the benchmark device, cached.
    float32 locations are nudged off pixel edges so that grad_sampling_locations compares
    cleanly against the float64-free reference (it jumps across pixel edges)."""
    key = (cfg, dtype)
    if key not in _inputs:
        device = harness.default_device()
        made = msda_inputs.make(cfg, dtype=dtype, device=device, seed=0)
        value, shapes, starts, loc, attn = msda_inputs.args(made)
        if dtype == torch.float32:
            loc = msda_inputs.nudge_off_pixel_edges(loc, shapes)
        g = torch.Generator().manual_seed(1)
        grad = torch.randn(cfg.batch, cfg.queries, cfg.heads * cfg.head_dim, generator=g)
        _inputs[key] = (grad.to(device=device, dtype=dtype), value, shapes, starts, loc, attn)
    return _inputs[key]


def _close(dtype):
    frac, rtol = CHECK_TOL[dtype]

    def check(out, ref):
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        for o, r in zip(outs, refs):
            scale = r.detach().abs().max().item() if r.numel() else 0.0
            torch.testing.assert_close(o.double(), r.double(), atol=frac * scale + 1e-30, rtol=rtol)

    return check


def _forward(value, shapes, starts, loc, attn):
    return multi_scale_deformable_attn(value, shapes, starts, loc, attn, backend=_backend())


def _backward(grad, value, shapes, starts, loc, attn):
    return torch.ops.mu_space.multi_scale_deformable_attn_backward(
        grad, value, shapes, starts, loc, attn, _backend()
    )


@contextlib.contextmanager
def _deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _backward_det(grad, value, shapes, starts, loc, attn):
    with _deterministic():
        return _backward(grad, value, shapes, starts, loc, attn)


def _params(cfg: msda_inputs.MSDAConfig, **extra) -> dict:
    return {
        "batch": cfg.batch,
        "queries": cfg.queries,
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "levels": [list(hw) for hw in cfg.levels],
        "points": cfg.points,
        **extra,
    }


def tensor_bytes(cfg: msda_inputs.MSDAConfig, dtype: torch.dtype) -> dict:
    """Bytes of each tensor of one call (no tensors are built)."""
    es = torch.empty((), dtype=dtype).element_size()
    samples = cfg.batch * cfg.queries * cfg.heads * len(cfg.levels) * cfg.points
    return {
        "value": cfg.batch * cfg.num_keys * cfg.heads * cfg.head_dim * es,
        "locations": 2 * samples * es,
        "weights": samples * es,
        "metadata": 3 * len(cfg.levels) * 8,  # int64 shapes [L, 2] + start index [L]
        "output": cfg.batch * cfg.queries * cfg.heads * cfg.head_dim * es,
    }


def forward_case(cfg, dtype, name=None, **extra) -> Case:
    b = tensor_bytes(cfg, dtype)
    return Case(
        name=name or cfg.name,
        op="multi_scale_deformable_attn",
        direction="forward",
        dtype=dtype,
        params=_params(cfg, **extra),
        compulsory_bytes=b["value"] + b["locations"] + b["weights"] + b["metadata"] + b["output"],
        fn=_forward,
        make_args=lambda: inputs(cfg, dtype)[1:],
        reference=multi_scale_deformable_attn_reference,
        check=_close(dtype),
    )


def backward_case(cfg, dtype, name=None, det=False, **extra) -> Case:
    b = tensor_bytes(cfg, dtype)
    read = (
        b["output"] + b["value"] + b["locations"] + b["weights"] + b["metadata"]
    )  # grad_output first
    written = b["value"] + b["locations"] + b["weights"]
    return Case(
        name=(name or cfg.name) + ("-det" if det else ""),
        op="multi_scale_deformable_attn",
        direction="backward",
        dtype=dtype,
        params=_params(cfg, deterministic=det, **extra),
        compulsory_bytes=read + written,
        fn=_backward_det if det else _backward,
        make_args=lambda: inputs(cfg, dtype),
        reference=multi_scale_deformable_attn_reference_backward,
        check=_close(dtype),
        time_reference=not det,
    )  # the same reference as the atomic case: timed once


def _config(name: str) -> msda_inputs.MSDAConfig:
    cfg = msda_inputs.CONFIGS[name]
    if not torch.cuda.is_available():
        cfg = msda_inputs.scaled(cfg, queries=CPU_SMOKE_QUERIES, batch=1)
    return cfg


def build_cases(quick: bool) -> list[Case]:
    cases = []
    dtypes = DTYPES[:2] if quick else DTYPES
    for name in msda_inputs.BENCHMARK_CONFIGS:
        cfg = _config(name)
        for dtype in dtypes:
            cases.append(forward_case(cfg, dtype, name))
            cases.append(backward_case(cfg, dtype, name))
        for dtype in DET_DTYPES[:1] if quick else DET_DTYPES:
            cases.append(backward_case(cfg, dtype, name, det=True))
    queries = QUICK_SWEEP_QUERIES if quick else SWEEP_QUERIES
    if not torch.cuda.is_available():
        queries = queries[:1]
    for q in queries:
        cfg = msda_inputs.scaled(SWEEP_BASE, queries=q)
        for dtype in SWEEP_DTYPES[:1] if quick else SWEEP_DTYPES:
            label = f"sweep-{SWEEP_BASE}-q{q}"
            # checked against the reference, not timed against it: the sweep shows how cost
            # grows; the speedups are in the model cases (the 200k reference backward alone
            # takes ~0.5 s per call)
            for case in (
                forward_case(cfg, dtype, label, sweep="queries"),
                backward_case(cfg, dtype, label, sweep="queries"),
            ):
                case.time_reference = False
                cases.append(case)
    return cases


def main(argv: list[str] | None = None) -> int:
    args = common_argparser(__doc__.splitlines()[0]).parse_args(argv)
    cases = harness.select_cases(build_cases(args.quick), args.cases)
    return harness.run_benchmark("multi_scale_deformable_attn", cases, args)


if __name__ == "__main__":
    sys.exit(main())
