"""bev_pool_prepare (BEVDet's voxel_pooling_prepare_v2 on the GPU) and sort_by_cell.

    python -m benchmarks.bench_bev_pool_prepare [--quick | --smoke] [--cases REGEX] [--no-flush] [--no-write]

Inputs are real camera-frustum geometry (mu_space.testing.bev_geometry: 6 cameras, 16x44
features, BEVDet's 128x128x1 grid of 0.8 m cells; bevfusion-cam: 32x88 features, 360x360 grid).

Cases
- <config>-prepare-<dtype>: the whole public call `bev_pool_prepare(coor, ...)`, i.e. the
  kernels of both stages, the one host synchronisation that reads (n_kept, n_intervals) back
  (after the COUNT stage, while the ORDER stage runs) and the output resizing. Checked bit-exact against `bev_pool_prepare_reference` (vectorised PyTorch: stable
  sort + unique_consecutive on the same GPU); the speedup is against that reference.
  Configs: bevdet-r50, bevdet-r50-d88, bevdet-d118 (issue-3 target: <= 30 us each, float32,
  TARGETS), bevfusion-cam; float32 and float16 coordinates.
- <config>-bevdet-torch: BEVDet's formula written out in PyTorch (.long(), filter, argsort,
  interval boundaries), the per-forward cost the issue quotes (~1.5 ms); unchecked, timed alone.
- <config>-kernels: the native entry point alone on preallocated buffers, both stages in one
  call on a clean (reused) workspace (no host sync, no allocation, no count copy): how much of
  the call is GPU work and how much is the read-back. Checked. Needs the native library (not
  in a smoke run without it).
- <config>-sort-feat: sort_by_cell of ranks_feat (bev_pool_v2's deterministic backward groups
  by it); checked against sort_by_cell_reference.
- sweep-n{N}: 10 k -> 5 M frustum points (6 cameras, feature map and depth bins scaled) into
  the bevdet 128x128 grid: how cost grows with points (segments grow with it).

Compulsory bytes: coor read once (n x 3 x dtype) + the outputs written once (3 x n_kept + 2 x
n_intervals int32). sort: cells read + order and intervals written.
--smoke: the bevdet-r50 cases on the `tiny` rig and one small sweep point.
"""

from __future__ import annotations

import os
import struct
import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.bev_pool_prepare import (
    BEVPoolRanks,
    bev_pool_prepare,
    bev_pool_prepare_reference,
    sort_by_cell,
    sort_by_cell_reference,
)
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle
from mu_space.testing import bev_geometry

CONFIGS = ("bevdet-r50", "bevdet-r50-d88", "bevdet-d118", "bevfusion-cam")
SMOKE_CONFIGS = ("bevdet-r50",)
SMOKE_RIG = "tiny"  # the geometry --smoke builds the bevdet-r50 cases on
TARGETS = (
    Target(r"bevdet-.*-prepare-float32", "median_us", "<=", 30.0, "issue 3: the whole call"),
)
DTYPES = (torch.float32, torch.float16)
# Flags of the native entry point bev_pool_prepare_forward (csrc/bev/bev_pool_prepare_musa.mu),
# for the kernels-only case: stage COUNT, stage ORDER, workspace already clean, aggregated
# histogram (MUSPACE_BEV_POOL_PREPARE_AGGREGATE=1, as the op reads it).
STAGE_COUNT, STAGE_ORDER, WORKSPACE_CLEAN, POLICY_AGGREGATE = 1, 2, 4, 8
# sweep: (feature H, W, depth bins) of a 6-camera rig -> n = 6 * D * H * W points
SWEEP = (
    (8, 22, 10),
    (8, 22, 30),
    (16, 44, 24),
    (16, 44, 71),
    (32, 88, 59),
    (32, 88, 178),
    (64, 176, 74),
)
SMOKE_SWEEP = ((4, 11, 5),)

_geometry: dict = {}


def geometry(cfg, dtype: torch.dtype, rig=None) -> tuple[torch.Tensor, tuple]:
    """Cached (coor on the benchmark device in dtype, (lower, interval, size)) of `rig` (default
    `cfg`)."""
    key = (rig or cfg, dtype)
    if key not in _geometry:
        g = bev_geometry.make(rig or cfg)
        coor = g["coor"].to(device=harness.default_device(), dtype=dtype)
        _geometry[key] = (coor, (g["grid_lower_bound"], g["grid_interval"], g["grid_size"]))
    return _geometry[key]


def sweep_config(h: int, w: int, d: int) -> bev_geometry.BEVConfig:
    return bev_geometry.BEVConfig(
        f"sweep-{h}x{w}-d{d}", feature_hw=(h, w), depth=(1.0, 60.0, 59.0 / d)
    )


def native_grid(lower, interval, size) -> tuple[list, list, list]:
    """The grid as the native entry takes it: float32 values of the bounds, integer sizes."""

    def f32(v):
        return struct.unpack("f", struct.pack("f", float(v)))[0]

    return [f32(v) for v in lower], [f32(v) for v in interval], [int(v) for v in size]


def _policy() -> int:
    aggregate = os.environ.get("MUSPACE_BEV_POOL_PREPARE_AGGREGATE", "").strip().lower()
    return POLICY_AGGREGATE if aggregate in ("1", "true", "yes", "on") else 0


def _output_bytes(ref) -> int:
    return sum(t.numel() * t.element_size() for t in ref)


def prepare_case(name: str, coor: torch.Tensor, grid: tuple, params: dict) -> Case:
    ref = bev_pool_prepare_reference(coor, *grid)
    be = harness.backend()
    n = coor.numel() // 3
    params = {
        **params,
        "n_points": n,
        "n_kept": ref.ranks_bev.numel(),
        "n_intervals": ref.interval_starts.numel(),
        "max_interval": int(ref.interval_lengths.max()) if ref.interval_lengths.numel() else 0,
    }
    return Case(
        name=name,
        op="bev_pool_prepare",
        direction="forward",
        dtype=coor.dtype,
        params=params,
        compulsory_bytes=coor.numel() * coor.element_size() + _output_bytes(ref),
        fn=lambda c: bev_pool_prepare(c, *grid, backend=be),
        make_args=lambda: coor,
        reference=lambda c: bev_pool_prepare_reference(c, *grid),
    )


def bevdet_torch_prepare(coor: torch.Tensor, lower, interval, size):
    """BEVDet's voxel_pooling_prepare_v2 formula in plain PyTorch (for timing only)."""
    B, N, D, H, W, _ = coor.shape
    n = B * N * D * H * W
    ranks_depth = torch.arange(n, dtype=torch.int32, device=coor.device)
    ranks_feat = torch.arange(n // D, dtype=torch.int32, device=coor.device)
    ranks_feat = ranks_feat.reshape(B, N, 1, H, W).expand(B, N, D, H, W).flatten()
    lo = torch.tensor(lower, device=coor.device).to(coor)
    iv = torch.tensor(interval, device=coor.device).to(coor)
    c = ((coor - lo) / iv).long().view(n, 3)
    batch = torch.arange(B, device=coor.device).reshape(B, 1).expand(B, n // B).reshape(n, 1)
    c = torch.cat((c, batch), 1)
    X, Y, Z = size
    kept = (
        (c[:, 0] >= 0)
        & (c[:, 0] < X)
        & (c[:, 1] >= 0)
        & (c[:, 1] < Y)
        & (c[:, 2] >= 0)
        & (c[:, 2] < Z)
    )
    c, ranks_depth, ranks_feat = c[kept], ranks_depth[kept], ranks_feat[kept]
    ranks_bev = c[:, 3] * (Z * Y * X) + c[:, 2] * (Y * X) + c[:, 1] * X + c[:, 0]
    order = ranks_bev.argsort()
    ranks_bev, ranks_depth, ranks_feat = ranks_bev[order], ranks_depth[order], ranks_feat[order]
    first = torch.ones(ranks_bev.shape[0], device=coor.device, dtype=torch.bool)
    first[1:] = ranks_bev[1:] != ranks_bev[:-1]
    starts = torch.where(first)[0].int()
    lengths = torch.zeros_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = ranks_bev.shape[0] - starts[-1]
    return (ranks_bev.int(), ranks_depth.int(), ranks_feat.int(), starts, lengths)


def bevdet_torch_case(name: str, coor: torch.Tensor, grid: tuple, params: dict) -> Case:
    lower, interval, size = native_grid(*grid)
    ref = bev_pool_prepare_reference(coor, *grid)
    return Case(
        name=name,
        op="bev_pool_prepare.bevdet_torch",
        direction="forward",
        dtype=coor.dtype,
        params=params,
        compulsory_bytes=coor.numel() * coor.element_size() + _output_bytes(ref),
        fn=lambda c: bevdet_torch_prepare(c, lower, interval, size),
        make_args=lambda: coor,
    )


def kernels_case(name: str, coor: torch.Tensor, grid: tuple, params: dict) -> Case:
    """The native entry point alone: preallocated outputs and workspace, no read-back."""
    lower, interval, size = native_grid(*grid)
    n = coor.numel() // 3
    n_cells = coor.shape[0] * size[0] * size[1] * size[2]
    cap = min(n, n_cells)
    device = coor.device
    ws = torch.empty(
        native.function("bev_pool_sort_workspace_ints")(n, n_cells),
        dtype=torch.int32,
        device=device,
    )
    outs = [torch.empty(n, dtype=torch.int32, device=device) for _ in range(3)]
    outs += [torch.empty(cap, dtype=torch.int32, device=device) for _ in range(2)]
    entry = native.function("bev_pool_prepare_forward")
    ref = bev_pool_prepare_reference(coor, *grid)
    flags = [STAGE_COUNT | STAGE_ORDER]  # the first call zeroes the workspace; later: clean
    policy = _policy()

    def run(c):
        entry(c, ws, *outs, *lower, *interval, *size, flags[0] | policy, 0, 0, stream_handle(c))
        flags[0] = STAGE_COUNT | STAGE_ORDER | WORKSPACE_CLEAN
        return ws

    def check(ws_out, want):
        k, m = ws_out[:2].tolist()
        harness.close_check("bev_pool_prepare")(
            BEVPoolRanks(outs[0][:k], outs[1][:k], outs[2][:k], outs[3][:m], outs[4][:m]), want
        )

    return Case(
        name=name,
        op="bev_pool_prepare.kernels",
        direction="forward",
        dtype=coor.dtype,
        params=params,
        compulsory_bytes=coor.numel() * coor.element_size() + _output_bytes(ref),
        fn=run,
        make_args=lambda: coor,
        reference=lambda c: bev_pool_prepare_reference(c, *grid),
        check=check,
        time_reference=False,
    )


def sort_case(name: str, cells: torch.Tensor, n_cells: int, params: dict) -> Case:
    ref = sort_by_cell_reference(cells, n_cells)
    be = harness.backend()
    return Case(
        name=name,
        op="sort_by_cell",
        direction="forward",
        dtype=cells.dtype,
        params={
            **params,
            "n": cells.numel(),
            "n_cells": n_cells,
            "n_intervals": ref.interval_starts.numel(),
        },
        compulsory_bytes=cells.numel() * cells.element_size() + _output_bytes(ref),
        fn=lambda c: sort_by_cell(c, n_cells, backend=be),
        make_args=lambda: cells,
        reference=lambda c: sort_by_cell_reference(c, n_cells),
    )


def build_cases(args) -> list[Case]:
    cases = []
    rig = SMOKE_RIG if args.smoke else None
    for cfg in SMOKE_CONFIGS if args.smoke else CONFIGS:
        coor, grid = geometry(cfg, torch.float32, rig)
        params = {"config": rig or cfg, "shape": list(coor.shape)}
        if harness.native_available():
            cases.append(kernels_case(f"{cfg}-kernels-float32", coor, grid, params))
        if args.graph:  # the public call reads counts back: not capturable
            continue
        for dtype in DTYPES:
            c, _ = geometry(cfg, dtype, rig)
            cases.append(
                prepare_case(f"{cfg}-prepare-{harness.dtype_name(dtype)}", c, grid, params)
            )
        cases.append(bevdet_torch_case(f"{cfg}-bevdet-torch-float32", coor, grid, params))
        if cfg != "bevfusion-cam":
            feat = bev_pool_prepare_reference(coor, *grid).ranks_feat
            B, N, D, H, W, _ = coor.shape
            cases.append(sort_case(f"{cfg}-sort-feat-int32", feat, B * N * H * W, params))
    if args.graph or args.quick:
        return cases
    for h, w, d in SMOKE_SWEEP if args.smoke else SWEEP:
        cfg = sweep_config(h, w, d)
        coor, grid = geometry(cfg, torch.float32)
        n = coor.numel() // 3
        params = {
            "sweep": "n_points",
            "n_points": n,
            "shape": list(coor.shape),
            "grid": list(grid[2]),
        }
        cases.append(prepare_case(f"sweep-n{n}-prepare-float32", coor, grid, params))
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("bev_pool_prepare", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
