"""bev_pool (BEVFusion API) at the bevfusion-cam geometry: forward, backward, and a sweep over points.

    python -m benchmarks.bench_bev_pool [--quick | --smoke] [--cases REGEX] [--no-flush] [--no-write]

Inputs are built the way BEVFusion's vtransform builds them (mu_space.testing.bev_pool_inputs):
6 cameras, 32x88 feature maps, D = 118 depth bins, C = 80, a 360x360x1 grid of 0.3 m cells,
int64 coords (x, y, z, batch), points outside the grid filtered out (1.82 M points remain).

Cases
- bevfusion-cam-{forward,backward} in float32 and float16 (the issue-3 target: >= 50% of the
  copy bandwidth measured in the same run, TARGETS);
- bevfusion-cam-cells / -sort: the two steps in front of the pooling kernel (coords -> flat
  cells; sort_by_cell's counting sort), timed alone so a miss can be attributed, and since
  issue 13 item 4 -cells-torch (the previous PyTorch cells, for comparison) and -sort-radix
  (torch.sort + bev_pool_runs_from_sorted, what bev_pool_rows runs once its kernels are
  verified; run with MUSPACE_TRY_UNVERIFIED=1 for the forward / backward cases to take the
  issue-13 kernels, MUSPACE_BEV_POOL_ROWS_SORT=counting to keep the counting sort);
- sweep-n{N}: 10 k -> 5 M points, a random subset of a B = 3 bevfusion-cam batch (the 3 x 360 x
  360 x 80 output is written in every case, which is the floor at small N).

Compulsory bytes. forward: feats (n*C) + coords (n*4 int64) + output (B*C*D*H*W);
backward: grad_out (B*C*D*H*W) + one int32 cell per point + grad_feats (n*C).
The reference is `bev_pool(..., backend="reference")` (PyTorch index_add) on the same GPU.
--smoke: the same cases on the `tiny` rig (B = 3 for the sweep point).
"""

from __future__ import annotations

import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.bev_pool import bev_pool, bev_pool_cells
from mu_space.ops.bev_pool_prepare import sort_by_cell
from mu_space.ops.bev_pool_rows import sort_cells
from mu_space.testing.bev_pool_inputs import bevfusion_inputs

CONFIG = "bevfusion-cam"
SMOKE_RIG = "tiny"  # the geometry --smoke builds the same cases on
DTYPES = (torch.float32, torch.float16)
SWEEP = (10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000, 5_000_000)
SMOKE_SWEEP = (1_000,)
SWEEP_BATCH = 3  # 3 x 1.82 M points available
TARGETS = (
    Target(
        rf"{CONFIG}-(forward|backward)-float(32|16)",
        "pct_of_copy_bw",
        ">=",
        50.0,
        "issue 3",
    ),
)

_inputs: dict = {}


def inputs(batch: int, dtype: torch.dtype, n_points: int | None = None, rig: str = CONFIG) -> dict:
    """Cached inputs of `rig` on the benchmark device (optionally a seeded random subset of
    points)."""
    key = (rig, batch, dtype, n_points)
    if key not in _inputs:
        base_key = (rig, batch, dtype, None)
        if base_key not in _inputs:
            _inputs[base_key] = bevfusion_inputs(
                rig, batch=batch, dtype=dtype, device=harness.default_device()
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


def coords_to_cells(coords: torch.Tensor, dims: tuple, constants: tuple) -> torch.Tensor:
    """Flat cells ((b*D + d)*H + h)*W + w of coords[n, 4] = (h, w, d, b) (-1 outside), int32:
    the PyTorch step in front of the pooling kernel, written out as bev_pool runs it."""
    lo, hi, strides = constants
    clamped = torch.clamp(coords, min=lo, max=hi)
    bad = (clamped != coords).any(dim=1)
    return (clamped * strides).sum(dim=1, dtype=torch.int32).masked_fill_(bad, -1)


def cell_constants(dims: tuple, dtype: torch.dtype, device) -> tuple:
    """(lower bounds, upper bounds, strides) of the (h, w, d, b) columns, built once."""
    B, D, H, W = dims
    return (
        torch.zeros(4, dtype=dtype, device=device),
        torch.tensor([H - 1, W - 1, D - 1, B - 1], dtype=dtype, device=device),
        torch.tensor([W, 1, H * W, D * H * W], dtype=dtype, device=device),
    )


def forward_case(name: str, a: dict, dtype: torch.dtype, params: dict) -> Case:
    dims = _dims(a)
    be = harness.backend()
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
        fn=lambda f, c: bev_pool(f, c, *dims, backend=be),
        make_args=lambda: (a["feats"].clone(), a["coords"].clone()),
        reference=lambda f, c: bev_pool(f, c, *dims, backend="reference"),
    )


def backward_case(name: str, a: dict, dtype: torch.dtype, params: dict) -> Case:
    dims = _dims(a)
    be = harness.backend()
    n, C = a["feats"].shape
    es = a["feats"].element_size()
    grad = {}

    def make_args():
        feats = a["feats"].clone().requires_grad_(True)
        out = bev_pool(feats, a["coords"], *dims, backend=be)
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
    )


def step_cases(a: dict) -> list[Case]:
    """The steps in front of the pooling kernel, timed alone (diagnostics, unchecked)."""
    B, D, H, W = _dims(a)
    n = a["coords"].shape[0]
    params = {"config": a["config"].name, "n_points": n}
    constants = cell_constants((B, D, H, W), a["coords"].dtype, a["coords"].device)
    cells = coords_to_cells(a["coords"], (B, D, H, W), constants)
    be = harness.backend()
    coords_bytes = a["coords"].numel() * a["coords"].element_size()
    return [
        Case(
            name=f"{CONFIG}-cells",
            op="bev_pool.cells",
            direction="forward",
            dtype=a["coords"].dtype,
            params=params,
            compulsory_bytes=coords_bytes + n * 4,
            fn=lambda c: bev_pool_cells(c, B, D, H, W, backend=be),
            make_args=lambda: a["coords"].clone(),
        ),
        Case(
            name=f"{CONFIG}-cells-torch",
            op="bev_pool.cells",
            direction="forward",
            dtype=a["coords"].dtype,
            params=params,
            compulsory_bytes=coords_bytes + n * cells.element_size(),
            fn=lambda c: coords_to_cells(c, (B, D, H, W), constants),
            make_args=lambda: a["coords"].clone(),
        ),
        Case(
            name=f"{CONFIG}-sort",
            op="sort_by_cell",
            direction="forward",
            dtype=cells.dtype,
            params={**params, "n_cells": B * D * H * W},
            compulsory_bytes=n * cells.element_size() + n * 4,
            fn=lambda c: sort_by_cell(c, B * D * H * W, backend=be),
            make_args=lambda: cells.clone(),
        ),
    ] + _radix_sort_case(cells, B * D * H * W, params, be)


def _radix_sort_case(cells, n_cells, params, be) -> list[Case]:
    """torch.sort + bev_pool_runs_from_sorted (bev_pool_rows' sort once verified): cells in,
    order + sorted cells out (native library only)."""
    if be != "native":
        return []
    n = cells.shape[0]
    return [
        Case(
            name=f"{CONFIG}-sort-radix",
            op="bev_pool_rows.sort_runs",
            direction="forward",
            dtype=cells.dtype,
            params={**params, "n_cells": n_cells},
            compulsory_bytes=n * cells.element_size() + 2 * n * 4,
            fn=lambda c: sort_cells(c, n_cells),
            make_args=lambda: cells.clone(),
        )
    ]


def build_cases(args) -> list[Case]:
    rig = SMOKE_RIG if args.smoke else CONFIG
    cases = []
    for dtype in DTYPES:
        a = inputs(1, dtype, rig=rig)
        n, C = a["feats"].shape
        params = {"config": rig, "n_points": n, "C": C, "grid": [a["B"], a["D"], a["H"], a["W"]]}
        d = harness.dtype_name(dtype)
        cases.append(forward_case(f"{CONFIG}-forward-{d}", a, dtype, params))
        cases.append(backward_case(f"{CONFIG}-backward-{d}", a, dtype, params))
    cases += step_cases(inputs(1, torch.float32, rig=rig))
    if args.quick:
        return cases
    for n_points in SMOKE_SWEEP if args.smoke else SWEEP:
        for dtype in DTYPES:
            a = inputs(SWEEP_BATCH, dtype, n_points, rig=rig)
            params = {"sweep": "n_points", "n_points": n_points, "config": f"{rig} B={SWEEP_BATCH}"}
            d = harness.dtype_name(dtype)
            cases.append(forward_case(f"sweep-n{n_points}-forward-{d}", a, dtype, params))
            if dtype == torch.float32:
                cases.append(backward_case(f"sweep-n{n_points}-backward-float32", a, dtype, params))
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("bev_pool", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
