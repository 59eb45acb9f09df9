"""dynamic_scatter (mmcv API) forward and backward at the LiDAR model configs, plus a sweep.

    python -m benchmarks.bench_dynamic_scatter [--quick | --smoke] [--cases REGEX] [--no-flush] [--no-write]

Inputs: the points of a config (mu_space.testing.lidar) and their dynamic-voxelization
coordinates (z, y, x; dropped points' rows start with -1), computed once outside the timing.
Features: the points themselves (C = 5: x, y, z, intensity, time) or random C = 64 features (what
a DynamicVFE layer scatters). Configs: centerpoint-0075-nus (10 sweeps, ~330k points, 0.075 m
voxels) and pointpillars-nus (the same cloud in 0.25 m pillars: long voxels near the sensor).

- forward: `dynamic_scatter(feats, coors, reduce)`, the whole call (grouping with its one host
  sync, then the reduction; feats need no gradient, so the one-call forward where it is allowed:
  FUSED_FORWARD in mu_space/ops/dynamic_scatter.py, MUSPACE_DYNAMIC_SCATTER_FUSED=0 for the parts).
- forward-padded (centerpoint-0075-nus): `dynamic_scatter_padded`, no host synchronisation
  (`--graph` times it as CUDA graph replays; the other forward cannot be captured).
- backward: `torch.autograd.grad` of the voxel features w.r.t. feats (the forward outside the
  timing): segment_reduce's backward kernel.
- `-mmcv` twins (forward and backward) when scripts/build_mmcv_voxel_peer.sh has built mmcv's own
  kernels (benchmarks/_voxel_peer.py), checked against our reference.
- sweep (float32, mean, C = 64 forward): ~10k to ~2M points on the centerpoint grid.

Compulsory bytes: forward = feats + coors read, voxel features + coordinates written; backward =
voxel gradients + feats (max: read to find the arg-max) + the point2voxel map read, feats'
gradient written. Targets (issue 10, TARGETS): mean and max at centerpoint-0075-nus, forward <= 60
us and backward <= 60 us (float32, C = 5 and C = 64); float16 no slower than float32 (compare the
rows). --smoke: the tiny voxel layer (runs on a CPU: reference path).
"""

from __future__ import annotations

import sys

import torch

from benchmarks import _voxel_peer as peer
from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.dynamic_scatter import dynamic_scatter, dynamic_scatter_with_map
from mu_space.ops.dynamic_scatter_padded import dynamic_scatter_padded
from mu_space.ops.dynamic_voxelize import dynamic_voxelize
from mu_space.testing import lidar

CONFIGS = ("centerpoint-0075-nus", "pointpillars-nus")
SMOKE = {"centerpoint-0075-nus": "tiny-voxels"}  # label -> layer
REDUCES = ("mean", "max")
CHANNELS = (5, 64)
DTYPES = (torch.float32, torch.float16)
SWEEP = (10_000, 30_000, 100_000, 300_000, 1_000_000, 2_000_000)
SMOKE_SWEEP = (5_000,)
TARGETS = tuple(
    Target(
        f"centerpoint-0075-nus-c{c}-{r}-{d}-float32",
        "median_us",
        "<=",
        60.0,
        f"issue 10 (mmcv {d}: {mm} us)",
    )
    for c, r, d, mm in (
        (5, "max", "forward", 605),
        (5, "mean", "forward", 576),
        (64, "max", "forward", 1552),
        (64, "mean", "forward", 911),
        (5, "max", "backward", 37),
        (5, "mean", "backward", 24),
        (64, "max", "backward", 854),
        (64, "mean", "backward", 539),
    )
)

_cache: dict = {}


def inputs(layer: str, channels: int, dtype, cloud=None):
    """(feats [N, C], coors [N, 3] int32) on the benchmark device, cached."""
    cloud = cloud or lidar.VOXEL_CONFIGS[layer].cloud
    key = (layer, getattr(cloud, "name", cloud), channels, dtype)
    if key not in _cache:
        v = lidar.VOXEL_CONFIGS[layer]
        pts = lidar.make(cloud)
        coors = dynamic_voxelize(pts, v.voxel_size, v.point_cloud_range, backend="reference")
        g = torch.Generator().manual_seed(0)
        feats = (
            pts if channels == pts.shape[1] else torch.randn(pts.shape[0], channels, generator=g)
        )
        device = harness.default_device()
        _cache[key] = (feats.to(device=device, dtype=dtype), coors.to(device))
    return _cache[key]


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def cases_for(label, layer, channels, reduce, dtype, params=None, backward=True, cloud=None):
    feats, coors = inputs(layer, channels, dtype, cloud)
    be = harness.backend()
    dt = harness.dtype_name(dtype)
    out, vc, p2v, counts = dynamic_scatter_with_map(feats, coors, reduce, backend="reference")
    m = out.shape[0]
    params = {
        "config": layer,
        "n_points": feats.shape[0],
        "voxels": m,
        "C": channels,
        "reduce": reduce,
        **(params or {}),
    }
    fwd_bytes = _nbytes(feats) + _nbytes(coors) + _nbytes(out) + _nbytes(vc)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    name = f"{label}-c{channels}-{reduce}"
    cases = [
        Case(
            name=f"{name}-forward-{dt}",
            op="dynamic_scatter",
            direction="forward",
            dtype=dtype,
            params=params,
            compulsory_bytes=fwd_bytes,
            fn=lambda f, c: dynamic_scatter(f, c, reduce, backend=be),
            make_args=lambda: (feats, coors),
            reference=lambda f, c: dynamic_scatter(f, c, reduce, backend="reference"),
        )
    ]
    if label == "centerpoint-0075-nus":  # the target config (smoke: its tiny stand-in)
        # N rows written: the padding too
        padded_bytes = _nbytes(feats) * 2 + _nbytes(coors) * 2 + 8
        cases.append(
            Case(
                name=f"{name}-forward-padded-{dt}",
                op="dynamic_scatter_padded",
                direction="forward",
                dtype=dtype,
                params={**params, "form": "padded"},
                compulsory_bytes=padded_bytes,
                fn=lambda f, c: dynamic_scatter_padded(f, c, reduce, backend=be),
                make_args=lambda: (feats, coors),
                reference=lambda f, c: dynamic_scatter_padded(f, c, reduce, backend="reference"),
            )
        )
    if backward:
        bwd_bytes = (
            _nbytes(grad) + _nbytes(feats) * (2 if reduce == "max" else 1) + 4 * feats.shape[0]
        )

        def reference_backward(o, leaves, g):
            f = leaves[0].detach().requires_grad_(True)
            o2, _ = dynamic_scatter(f, coors, reduce, backend="reference")
            return torch.autograd.grad(o2, (f,), g)

        cases.append(
            Case(
                name=f"{name}-backward-{dt}",
                op="dynamic_scatter",
                direction="backward",
                dtype=dtype,
                params=params,
                compulsory_bytes=bwd_bytes,
                fn=harness.autograd_backward,
                make_args=harness.backward_args(
                    lambda f: dynamic_scatter(f, coors, reduce, backend=be)[0], (feats,), grad
                ),
                reference=reference_backward,
            )
        )
    if dtype == torch.float32 and peer.has("scatter_forward"):
        cases.append(
            Case(
                name=f"{name}-forward-{dt}-mmcv",
                op="dynamic_scatter",
                direction="forward",
                dtype=dtype,
                params={**params, "implementation": "mmcv"},
                compulsory_bytes=fwd_bytes,
                fn=lambda f, c: peer.scatter_forward(f, c, reduce)[:2],
                make_args=lambda: (feats, coors),
                reference=lambda f, c: dynamic_scatter(f, c, reduce, backend="reference"),
                check=peer.close,
                time_reference=False,
            )
        )
        if backward:
            saved = peer.scatter_forward(feats, coors, reduce)

            def mmcv_backward(g):
                return peer.scatter_backward(g, feats, saved[0], saved[2], saved[3], reduce)

            def ref_backward(g):
                f = feats.detach().requires_grad_(True)
                o2, _ = dynamic_scatter(f, coors, reduce, backend="reference")
                return torch.autograd.grad(o2, (f,), g)[0]

            cases.append(
                Case(
                    name=f"{name}-backward-{dt}-mmcv",
                    op="dynamic_scatter",
                    direction="backward",
                    dtype=dtype,
                    params={**params, "implementation": "mmcv"},
                    compulsory_bytes=bwd_bytes,
                    fn=mmcv_backward,
                    make_args=lambda: grad,
                    reference=ref_backward,
                    check=peer.close,
                    time_reference=False,
                )
            )
    return cases


def build_cases(args) -> list[Case]:
    cases = []
    configs = SMOKE if args.smoke else {c: c for c in CONFIGS}
    for label, layer in configs.items():
        for channels in CHANNELS:
            for reduce in REDUCES:
                for dtype in DTYPES:
                    cases += cases_for(label, layer, channels, reduce, dtype)
    if args.quick:
        return cases
    for n in SMOKE_SWEEP if args.smoke else SWEEP:
        cfg = lidar.sweep_config(n)
        layer = "tiny-voxels" if args.smoke else "centerpoint-0075-nus"
        cases += cases_for(
            f"sweep-n{n}", layer, 64, "mean", torch.float32, {"sweep": "n_points"}, False, cfg
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("dynamic_scatter", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
