"""pillar_scatter (mmdet3d PointPillarsScatter) forward and backward at the PointPillars configs.

    python -m benchmarks.bench_pillar_scatter [--quick | --smoke] [--cases REGEX] [--no-flush] [--graph] [--no-write]

Pillars: deterministic hard voxelization (reference) of B different clouds of the config, C = 64
random pillar features (PillarFeatureNet's output width); canvases of the configs: pointpillars-kitti
432 x 496 (B = 1, 4), pointpillars-nus 400 x 400 (B = 1, 4); float32 and float16.

- forward: `pillar_scatter(features, coors, B, (ny, nx))`, the whole call (output allocation,
  map fill, two kernels). Compulsory bytes: features + coors read, the canvas written (the canvas
  write dominates).
- backward: `torch.autograd.grad` w.r.t. the features (map fill, two kernels). Bytes: the
  canvas gradient at the pillars' cells + coors read, the features' gradient written.
- `-mmdet3d` forward twins: mmdet3d's own PyTorch `forward_batch` (a canvas per sample, a mask,
  index_put), as a peer.

Target (issue 10, TARGETS): forward >= 50% of copy bandwidth. --smoke: tiny pillars (CPU).
"""

from __future__ import annotations

import sys

import torch

from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.pillar_scatter import pillar_scatter
from mu_space.ops.voxelization_batch import voxelization_batch
from mu_space.testing import lidar

CONFIGS = {"pointpillars-kitti": (1, 4), "pointpillars-nus": (1, 4)}
SMOKE = {"tiny-pillars": (2,)}
CHANNELS = 64
DTYPES = (torch.float32, torch.float16)
TARGETS = (
    Target(
        r"pointpillars-(kitti|nus)-b\d+-forward-(float32|float16)",
        "pct_of_copy_bw",
        ">=",
        50.0,
        "issue 10",
    ),
)

_cache: dict = {}


def inputs(layer: str, batch: int, dtype):
    key = (layer, batch, dtype)
    if key not in _cache:
        v = lidar.VOXEL_CONFIGS[layer]
        clouds = lidar.batch(v.cloud, batch)
        _, coors, _ = voxelization_batch(
            clouds, v.voxel_size, v.point_cloud_range, v.max_num_points, v.max_voxels[1],
            backend="reference",
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(coors.shape[0], CHANNELS, generator=g)
        gx, gy, _ = v.grid_size
        device = harness.default_device()
        _cache[key] = (feats.to(device=device, dtype=dtype), coors.to(device), (gy, gx))
    return _cache[key]


def mmdet3d_forward_batch(voxel_features, coors, batch_size, ny, nx):
    """mmdet3d PointPillarsScatter.forward_batch, as upstream writes it (PyTorch)."""
    C = voxel_features.shape[1]
    canvases = []
    for b in range(batch_size):
        canvas = torch.zeros(C, nx * ny, dtype=voxel_features.dtype, device=voxel_features.device)
        mask = coors[:, 0] == b
        this = coors[mask, :]
        indices = (this[:, 2] * nx + this[:, 3]).long()
        canvas[:, indices] = voxel_features[mask, :].t()
        canvases.append(canvas)
    return torch.stack(canvases, 0).view(batch_size, C, ny, nx)


def cases_for(layer: str, batch: int, dtype, graph: bool) -> list[Case]:
    feats, coors, (ny, nx) = inputs(layer, batch, dtype)
    be = harness.backend()
    dt = harness.dtype_name(dtype)
    es = feats.element_size()
    canvas_bytes = batch * CHANNELS * ny * nx * es
    in_bytes = feats.numel() * es + coors.numel() * 4
    params = {
        "config": layer,
        "batch": batch,
        "pillars": feats.shape[0],
        "C": CHANNELS,
        "canvas": [ny, nx],
    }
    name = f"{layer}-b{batch}"
    cases = [
        Case(
            name=f"{name}-forward-{dt}",
            op="pillar_scatter",
            direction="forward",
            dtype=dtype,
            params=params,
            compulsory_bytes=in_bytes + canvas_bytes,
            fn=lambda f, c: pillar_scatter(f, c, batch, (ny, nx), backend=be),
            make_args=lambda: (feats, coors),
            reference=lambda f, c: pillar_scatter(f, c, batch, (ny, nx), backend="reference"),
        )
    ]
    if graph:
        return cases
    grad = torch.randn(batch, CHANNELS, ny, nx, generator=torch.Generator().manual_seed(1)).to(
        feats
    )

    def reference_backward(out, leaves, g):
        f = leaves[0].detach().requires_grad_(True)
        o = pillar_scatter(f, coors, batch, (ny, nx), backend="reference")
        return torch.autograd.grad(o, (f,), g)

    cases.append(
        Case(
            name=f"{name}-backward-{dt}",
            op="pillar_scatter",
            direction="backward",
            dtype=dtype,
            params=params,
            compulsory_bytes=2 * feats.numel() * es + coors.numel() * 4,
            fn=harness.autograd_backward,
            make_args=harness.backward_args(
                lambda f: pillar_scatter(f, coors, batch, (ny, nx), backend=be), (feats,), grad
            ),
            reference=reference_backward,
        )
    )
    cases.append(
        Case(
            name=f"{name}-forward-{dt}-mmdet3d",
            op="pillar_scatter",
            direction="forward",
            dtype=dtype,
            params={
                **params,
                "implementation": "mmdet3d PointPillarsScatter.forward_batch (torch)",
            },
            compulsory_bytes=in_bytes + canvas_bytes,
            fn=lambda f, c: mmdet3d_forward_batch(f, c, batch, ny, nx),
            make_args=lambda: (feats, coors),
            reference=lambda f, c: pillar_scatter(f, c, batch, (ny, nx), backend="reference"),
            time_reference=False,
        )
    )
    return cases


def build_cases(args) -> list[Case]:
    cases = []
    for layer, batches in (SMOKE if args.smoke else CONFIGS).items():
        for batch in batches[:1] if args.quick else batches:
            for dtype in DTYPES:
                cases += cases_for(layer, batch, dtype, args.graph)
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("pillar_scatter", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
