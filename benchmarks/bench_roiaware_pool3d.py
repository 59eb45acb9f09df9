"""roiaware_pool3d / RoIAwarePool3d (mmcv API) at PartA2's shapes, forward and backward, plus
sweeps; mmcv's own kernels side by side when built (benchmarks/_box3d_peer.py).

    python -m benchmarks.bench_roiaware_pool3d [--quick | --smoke] [--cases REGEX] [--no-write]

Inputs: mu_space.testing.lidar's nuScenes 10-sweep cloud (~327k points), 128 RoIs placed like
proposals on objects (mu_space.testing.boxes.boxes_on_points, centre +-0.3 m), out_size 14 (14^3
voxels per RoI), max_pts_per_voxel 128; PartA2's two uses: mode max on 16 segmentation
channels, mode avg on 4 part channels.
Cases: parta2-128x14-{max-c16,avg-c4}-{forward,backward}-float32 (+ float16 forward); sweeps
over RoIs (32 .. 512) and points (100k .. 1.3M), max-c16 forward. The forward includes its one
host synchronisation (the (point, RoI) pair total); the backward is torch.autograd.grad of the
public call (zeroed float32 gradient buffer, the kernel, the cast). Compulsory bytes: forward
rois + pts + pts_feature + output; backward grad_out + grad_in.

Targets (issue 12, TARGETS): forward <= 300 µs (>= 250x mmcv's 76.7 ms), backward <= 30 µs
(mmcv: 34-60 µs), at 128 RoIs x 14^3, 300k points.
--smoke: 12 RoIs x 6^3 over 3000 points, CPU-capable.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import _box3d_peer as peer
from benchmarks import harness
from benchmarks.harness import Case, Target
from mu_space.ops.roiaware import roiaware_pool3d
from mu_space.testing import boxes as box_inputs

_MAIN = r"parta2-128x14-(max-c16|avg-c4)"
TARGETS = (
    Target(rf"{_MAIN}-forward-float32", "median_us", "<=", 300.0, "issue 12 (mmcv: 76.7 ms)"),
    Target(rf"{_MAIN}-backward-float32", "median_us", "<=", 30.0, "issue 12 (mmcv: 34-60 us)"),
)
ROI_SWEEP = (32, 128, 512)
POINT_SWEEP = (100_000, 327_000, 1_300_000)
_cache: dict = {}


def inputs(n_rois: int, n_points: int | None, smoke: bool):
    key = (n_rois, n_points, smoke)
    if key not in _cache:
        if smoke:
            rois, pts = box_inputs.roi_inputs(3000, 12, seed=4)
        else:
            pts = box_inputs.benchmark_cloud(n_points)
            rois = box_inputs.boxes_on_points(pts, n_rois, seed=n_rois)
        d = harness.default_device()
        _cache[key] = (rois.to(d), pts.to(d))
    return _cache[key]


def cases_for(name, rois, pts, C, mode, out_size, dtype, params, backward=True) -> list[Case]:
    be = harness.backend()
    g = torch.Generator().manual_seed(C)
    feats = torch.randn(pts.shape[0], C, generator=g).to(pts.device, dtype)
    rois, pts = rois.to(dtype), pts.to(dtype)
    N = rois.shape[0]
    out_elems = N * out_size**3 * C
    es = feats.element_size()
    params = {
        **params,
        "rois": N,
        "points": pts.shape[0],
        "C": C,
        "mode": mode,
        "out_size": out_size,
        "max_pts_per_voxel": 128,
    }
    dt = harness.dtype_name(dtype)
    in_bytes = (rois.numel() + pts.numel() + feats.numel()) * es

    def fwd(backend):
        return roiaware_pool3d(rois, pts, feats, out_size, 128, mode, backend=backend)

    case = Case(
        name=f"{name}-forward-{dt}",
        op="roiaware_pool3d",
        direction="forward",
        dtype=dtype,
        params=params,
        compulsory_bytes=in_bytes + out_elems * es,
        fn=lambda: fwd(be),
        make_args=lambda: (),
        reference=lambda: fwd("reference"),
        time_reference="sweep" not in params,  # sweeps: checked, not timed
    )
    cases = [case]
    if peer.has("roiaware_forward") and dtype == torch.float32:
        cases.append(
            peer.peer_case(
                case,
                lambda: peer.roiaware_forward(rois, pts, feats, out_size, 128, mode)[0],
                peer.agreement(0.999, atol=1e-5),
            )
        )
    if not backward:
        return cases
    grad = torch.randn((N, out_size, out_size, out_size, C), generator=g).to(pts.device, dtype)

    def reference_backward(out, leaves, grad_out):
        f = leaves[0].detach().requires_grad_(True)
        o = roiaware_pool3d(rois, pts, f, out_size, 128, mode, backend="reference")
        return torch.autograd.grad(o, f, grad_out)

    bcase = Case(
        name=f"{name}-backward-{dt}",
        op="roiaware_pool3d",
        direction="backward",
        dtype=dtype,
        params=params,
        compulsory_bytes=out_elems * es + feats.numel() * es,
        fn=harness.autograd_backward,
        make_args=harness.backward_args(
            lambda f: roiaware_pool3d(rois, pts, f, out_size, 128, mode, backend=be), (feats,), grad
        ),
        reference=reference_backward,
    )
    cases.append(bcase)
    if peer.has("roiaware_backward") and dtype == torch.float32:
        state = {}

        def peer_args():
            if "s" not in state:
                state["s"] = peer.roiaware_forward(rois, pts, feats, out_size, 128, mode)[1]
            return (state["s"], grad)

        cases.append(
            peer.peer_case(
                bcase,
                lambda s, go: peer.roiaware_backward(s, go, pts.shape[0], mode),
                make_args=peer_args,
            )
        )
    return cases


def build_cases(args) -> list[Case]:
    smoke = args.smoke
    out = 6 if smoke else 14
    rois, pts = inputs(128, None, smoke)
    cases = []
    for mode, C in (("max", 16), ("avg", 4)):
        cases += cases_for(
            f"parta2-128x14-{mode}-c{C}",
            rois,
            pts,
            C,
            mode,
            out,
            torch.float32,
            {"config": "PartA2 RoI head"},
        )
    cases += cases_for(
        "parta2-128x14-max-c16",
        rois,
        pts,
        16,
        "max",
        out,
        torch.float16,
        {"config": "PartA2 RoI head"},
        backward=False,
    )
    if args.quick:
        return cases
    for n in ROI_SWEEP[:1] if smoke else ROI_SWEEP:
        r, p = inputs(n, None, smoke)
        cases += cases_for(
            f"sweep-rois-{n}",
            r,
            p,
            16,
            "max",
            out,
            torch.float32,
            {"sweep": "rois"},
            backward=False,
        )
    for n in POINT_SWEEP[:1] if smoke else POINT_SWEEP:
        r, p = inputs(128, n, smoke)
        cases += cases_for(
            f"sweep-points-{n}",
            r,
            p,
            16,
            "max",
            out,
            torch.float32,
            {"sweep": "points"},
            backward=False,
        )
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("roiaware_pool3d", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
