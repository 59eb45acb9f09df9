"""Sparse 3-D convolution (mu_space.sparse over sparse_rulebook / sparse_conv) at CenterPoint's
shapes, with spconv 2.3.8 side by side when it imports.

    python -m benchmarks.bench_sparse_conv [--quick | --smoke] [--cases REGEX] [--no-flush] [--no-write]
    python -m benchmarks._spconv_peer benchmarks/results/<gpu>/sparse_conv.json   # ours / spconv

Inputs: a synthetic nuScenes-like 10-sweep frame (mu_space.testing.lidar), voxelised at the
CenterPoint 0.075 config (0.075 x 0.075 x 0.2 m, 10 points, 120000 voxels: ~118k voxels in the
[41, 1440, 1440] grid), the mean of each voxel's points as features; built once outside the
timing. Weights seeded; spconv's twins load our state_dict unchanged.

- encoder-centerpoint-0075: mmdet3d's SparseEncoder of CenterPoint 0.075 (the recipe
  model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py): `forward` in eval mode
  (BN running statistics), `forward+backward` in training mode (the gradients of the voxel
  features and every parameter), float32 and float16 (the whole network in float16).
- layer cases at the same input: subm-k3 (SubMConv3d 16 -> 16, padding 1: rule book + conv),
  strided-k3s2 (SparseConv3d 16 -> 32, stride 2, padding 1: rule book + conv), inverse-k3
  (SparseInverseConv3d 32 -> 16 on the strided conv's rule book: conv only); forward and
  backward (grad of the features and the weight; the forward outside the timing).
- rulebook-subm-k3: sparse_rulebook alone (SubM k3 at ~118k voxels); spconv's twin is its
  `ops.get_indice_pairs` (Native layout), not checked against ours (other layout).
- sweeps (SubM k3 forward, float32): active voxels 10k -> 1M at C = 16 (subsets of the frame;
  above one frame, copies of it as further batch samples) and channels 16 -> 256 at ~118k.

`<case>-spconv` twins (benchmarks/_spconv_peer.py) run when spconv.pytorch imports and a CUDA GPU
is visible, each checked against our reference first (sites matched as sets). Targets (issue 11):
ours <= 1.0x spconv's median per twin (goal 0.7x), evaluated by `python -m
benchmarks._spconv_peer RESULTS.json`; the harness's absolute TARGETS are empty until spconv's
H200 figures are measured. --smoke: the recipe's --small frame (~1500 voxels, [41, 64, 64]; runs
on a CPU, reference path, no twins).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from benchmarks import _spconv_peer as peer
from benchmarks import harness
from benchmarks.harness import Case
from mu_space.ops.sparse_rulebook import sparse_rulebook

RECIPE = (
    Path(__file__).resolve().parents[1]
    / "model_examples/CenterPoint/scripts/centerpoint_sparse_encoder.py"
)
DTYPES = (torch.float32, torch.float16)
VOXEL_SWEEP = (10_000, 30_000, 100_000, 300_000, 1_000_000)
CHANNEL_SWEEP = (16, 32, 64, 128, 256)
SMOKE_VOXEL_SWEEP = (500,)
SMOKE_CHANNEL_SWEEP = (16,)
TARGETS = ()  # relative to spconv: benchmarks/_spconv_peer.py (TARGET_RATIO, GOAL_RATIO)
# The encoder (15 layers, BatchNorm in train mode) is checked against a float64 run of the same
# weights: each result's L2 error relative to its norm may be at most ENCODER_SLACK x the error of
# the reference backend in the same dtype, plus ENCODER_FLOOR[dtype]. A fixed tolerance against the
# same-dtype reference cannot work: on the H200 (2026-12-01, CenterPoint frame, 118561 voxels)
# float16 input gradients were 11.6% (native) and 11.8% (reference) off float64, so 9% off each
# other; float32 ones 0.19% and 0.17%. On the ~500-voxel smoke frame the ratio of two float16
# rounding errors fluctuates more (a 1.25 x slack failed there on the H200, 2026-12-01), and on
# the full frame, float32 forward + backward, spconv's worst result was 2.6 x (result 1: 0.00172
# vs 0.000657) and ours 2.8 x (result 45: 0.00135 vs 0.000477) further off float64 than the
# reference's (same run). With the im2col path (one GEMM per layer, K x C_in-long dot products;
# H200, 2026-12-01) ours reached 3.3 x (result 12: 0.00344 vs 0.00103) and spconv 4.2 x
# (0.0043) on the same result, so the slack is 5; float16 gets a floor of 8 units of its
# roundoff (2^-11). A wrong rule-book pair or kernel offset moves a result by far more (order
# 1e-2 to 1 relative).
ENCODER_SLACK = 5.0
ENCODER_FLOOR = {torch.float32: 1e-6, torch.float16: 8 * 2.0**-11}
# spconv's twins (implicit GEMM, its own accumulation order and float16 rounding): max-relative
PEER_TOL = {torch.float32: 1e-4, torch.float16: 1e-2}

_cache: dict = {}


def recipe():
    if "recipe" not in _cache:
        spec = importlib.util.spec_from_file_location("bench_sparse_conv_recipe", RECIPE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _cache["recipe"] = module
    return _cache["recipe"]


def frame(smoke: bool):
    """(voxel features [N, 5] float32, coors [N, 4] int32, sparse_shape) on the device."""
    key = ("frame", smoke)
    if key not in _cache:
        r = recipe()
        inputs = r.make_inputs(r.VOXELS["small" if smoke else "centerpoint-0075-nus"], 1, "cpu")
        cfg = r.ENCODERS["centerpoint-0075-nus"]
        shape = r.small_config(cfg)["sparse_shape"] if smoke else cfg["sparse_shape"]
        dev = harness.default_device()
        _cache[key] = (inputs["voxel_features"].to(dev), inputs["coors"].to(dev), shape)
    return _cache[key]


def sites(n: int, smoke: bool) -> torch.Tensor:
    """n distinct rows: a seeded subset of the frame's voxels, or (n > one frame) the frame
    repeated as further batch samples, then the subset."""
    _, coors, _ = frame(smoke)
    m = coors.shape[0]
    copies = -(-n // m)
    rows = torch.cat(
        [torch.nn.functional.pad(coors[:, 1:], (1, 0), value=b) for b in range(copies)]
    )
    g = torch.Generator().manual_seed(n)
    keep = torch.randperm(rows.shape[0], generator=g)[:n].sort().values.to(rows.device)
    return rows[keep].contiguous()


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _no_worse_than_reference(truth_of):
    """check(out, ref): out's relative L2 error against truth_of() (the float64 run) at most
    ENCODER_SLACK x ref's, plus ENCODER_FLOOR[dtype], for every result."""

    def check(out, ref) -> None:
        truth = truth_of()
        for i, (a, b, t) in enumerate(zip(out, ref, truth, strict=True)):
            t = t.detach().double()
            scale = float(t.norm()) + 1e-30
            err = float((a.detach().double() - t).norm()) / scale
            ref_err = float((b.detach().double() - t).norm()) / scale
            floor = ENCODER_FLOOR[a.dtype]
            assert err <= ENCODER_SLACK * ref_err + floor, (
                f"result {i} ({a.dtype}): relative error to float64 {err:.3g} > {ENCODER_SLACK} x "
                f"the reference's {ref_err:.3g} + {floor:.3g}"
            )

    return check


def _noted(check, params: dict):
    """The peer's check as a note, not a gate: spconv's float32 forward + backward of the
    encoder missed the float64 bound that ours meets (H200, 2026-12-01), and its time is still
    the one to compare with; params["check"] says "passed" or why not."""

    def noted(out, ref) -> None:
        try:
            check(out, ref)
            params["check"] = "passed"
        except AssertionError as exc:
            params["check"] = f"outside our bound: {exc}"

    return noted


def _max_relative(tol: float):
    def check(out, ref) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        refs = ref if isinstance(ref, (tuple, list)) else (ref,)
        for i, (a, b) in enumerate(zip(outs, refs)):
            a, b = a.detach().double(), b.detach().double()
            err, scale = float((a - b).abs().max()), float(b.abs().max())
            assert err <= tol * scale + 1e-30, (
                f"result {i}: max|a-b| {err:.3g} > {tol} x {scale:.3g}"
            )

    return check


# ------------------------------------------------------------------ the encoder


def encoder_cases(smoke: bool, dtype) -> list[Case]:
    r = recipe()
    feats, coors, shape = frame(smoke)
    cfg = dict(r.ENCODERS["centerpoint-0075-nus"], sparse_shape=shape)
    be, dt, dev = harness.backend(), harness.dtype_name(dtype), harness.default_device()
    torch.manual_seed(0)
    ours = r.SparseEncoder(cfg, 1, be).to(dev, dtype)
    ref = r.SparseEncoder(cfg, 1, "reference").to(dev, dtype)
    ref.load_state_dict(ours.state_dict())
    exact = r.SparseEncoder(cfg, 1, "reference").to(dev, torch.float64)
    exact.load_state_dict(ours.state_dict())
    twin = (
        peer.twin(ours, lambda lib: r.SparseEncoder(cfg, 1, lib=lib)) if peer.available() else None
    )
    f = feats.to(dtype)
    out_shape = ref.eval()(f, coors)["spatial_features"].shape
    w = torch.randn(out_shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    params = {"config": "centerpoint-0075-nus", "voxels": f.shape[0], "sparse_shape": shape}
    nbytes = _nbytes(f, coors) + out_shape.numel() * f.element_size()
    name = "encoder-centerpoint-0075"

    # c.clone(): every timed call sees sites it has not seen (a new frame), so no rule book of
    # an earlier call is reused (_sparse_native.SUBM_RULEBOOKS / VALID_SITES key on the tensor)
    def forward(net):
        def fn(x, c):
            with torch.no_grad():
                return (net.eval()(x, c.clone())["spatial_features"],)

        return fn

    def step(net):
        def fn(x, c):
            net.train()
            leaf = x.detach().requires_grad_(True)
            out = net(leaf, c.clone())["spatial_features"]
            wanted = [leaf, *net.parameters()]
            return torch.autograd.grad(out, wanted, w.to(out.dtype))

        return fn

    cases = []
    for direction, make in (("forward", forward), ("forward+backward", step)):
        truth = {}
        check = _no_worse_than_reference(
            lambda make=make, truth=truth: truth.setdefault("t", make(exact)(f.double(), coors))
        )
        cases.append(
            Case(
                name=f"{name}-{direction}-{dt}", op="sparse_conv", direction=direction,
                dtype=dtype, params=params, compulsory_bytes=nbytes, fn=make(ours),
                make_args=lambda: (f, coors), reference=make(ref), check=check,
            )
        )  # fmt: skip
        if twin is not None:
            twin_params = {**params, "implementation": f"spconv {peer.version()}"}
            cases.append(
                Case(
                    name=f"{name}-{direction}-{dt}-spconv", op="sparse_conv", direction=direction,
                    dtype=dtype, params=twin_params, compulsory_bytes=nbytes, fn=make(twin),
                    make_args=lambda: (f, coors), reference=make(ref),
                    check=_noted(check, twin_params), time_reference=False,
                )
            )  # fmt: skip
    return cases


# ------------------------------------------------------------------ single layers


def _layer(lib, kind, cin, cout):
    if kind == "subm-k3":
        return lib.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key="subm")
    if kind == "strided-k3s2":
        return lib.SparseConv3d(cin, cout, 3, 2, 1, bias=False, indice_key="down")
    return lib.SparseInverseConv3d(cin, cout, 3, indice_key="down", bias=False)


def layer_cases(kind, cin, cout, idx, shape, batch, dtype, label=None, extra=None, backward=True):
    import mu_space.sparse as ms

    be, dt, dev = harness.backend(), harness.dtype_name(dtype), harness.default_device()
    torch.manual_seed(0)
    ours = _layer(ms, kind, cin, cout).to(dev, dtype)
    ours.backend = be
    ref = _layer(ms, kind, cin, cout).to(dev, dtype)
    ref.load_state_dict(ours.state_dict())
    ref.backend = "reference"
    g = torch.Generator().manual_seed(2)
    n = idx.shape[0]
    twin = peer.twin(ours, lambda lib: _layer(lib, kind, cin, cout)) if peer.available() else None

    if kind == "inverse-k3":  # the input: a strided conv's output, its rule book under "down"
        down = ms.SparseConv3d(cout, cin, 3, 2, 1, bias=False, indice_key="down").to(dev, dtype)
        down.backend = "reference"
        x0 = ms.SparseConvTensor(torch.zeros(n, cout, device=dev, dtype=dtype), idx, shape, batch)
        with torch.no_grad():
            base = down(x0)
        feats = torch.randn(base.indices.shape[0], cin, generator=g).to(dev, dtype)

        def make_input(f):
            return base.replace_feature(f)

        if twin is not None:
            sp = peer.lib()
            down_sp = peer.twin(down, lambda lib: lib.SparseConv3d(cout, cin, 3, 2, 1, bias=False,
                                                                   indice_key="down"))  # fmt: skip
            with torch.no_grad():
                base_sp = down_sp(sp.SparseConvTensor(x0.features, idx, shape, batch))
            p_in = peer.matching(base_sp.indices, base.indices)  # base_sp rows[p_in] == ours

            def make_twin_input(f):
                f_sp = torch.empty_like(f)
                f_sp[p_in] = f
                return base_sp.replace_feature(f_sp)

    else:
        feats = torch.randn(n, cin, generator=g).to(dev, dtype)

        def make_input(f):  # new sites every call: no rule book reused across calls
            return ms.SparseConvTensor(f, idx.clone(), shape, batch)

        if twin is not None:

            def make_twin_input(f):
                return peer.lib().SparseConvTensor(f, idx.clone(), shape, batch)

    with torch.no_grad():
        out_ref = ref(make_input(feats))
    grad = torch.randn(out_ref.features.shape, generator=g).to(dev, dtype)
    m = out_ref.features.shape[0]
    params = {"layer": kind, "C_in": cin, "C_out": cout, "voxels_in": feats.shape[0],
              "voxels_out": m, **(extra or {})}  # fmt: skip
    w_bytes = _nbytes(ours.weight)
    fwd_bytes = _nbytes(feats, idx) + w_bytes + m * cout * feats.element_size()
    bwd_bytes = _nbytes(feats) * 2 + w_bytes * 2 + _nbytes(grad)
    name = f"{label or kind}-c{cin}-{cout}"

    def fwd(net, make):
        return lambda f: net(make(f)).features

    def bwd_args(net, make, g_out):
        def make_args():
            leaf = feats.detach().requires_grad_(True)
            return net(make(leaf)).features, (leaf, net.weight), g_out

        return make_args

    def ref_backward(out, leaves, g_out):
        # our reference with `grad` (our row order; a strided twin's g_out is permuted)
        leaf = leaves[0].detach().requires_grad_(True)
        o = ref(make_input(leaf)).features
        return torch.autograd.grad(o, (leaf, ref.weight), grad)

    cases = [
        Case(
            name=f"{name}-forward-{dt}", op="sparse_conv", direction="forward", dtype=dtype,
            params=params, compulsory_bytes=fwd_bytes, fn=fwd(ours, make_input),
            make_args=lambda: feats, reference=fwd(ref, make_input),
            check=harness.close_check("sparse_conv"),
        )
    ]  # fmt: skip
    if backward:
        cases.append(
            Case(
                name=f"{name}-backward-{dt}", op="sparse_conv", direction="backward",
                dtype=dtype, params=params, compulsory_bytes=bwd_bytes,
                fn=harness.autograd_backward, make_args=bwd_args(ours, make_input, grad),
                reference=ref_backward, check=harness.close_check("sparse_conv"),
            )
        )  # fmt: skip
    if twin is not None:
        # spconv's strided output rows come in an order of its own that may change from call to
        # call (its hash-based unique; on the H200, 2026-12-01, one permutation taken at set-up
        # scrambled the timed calls' rows: max|a-b| ~ the scale). So each checked forward
        # returns its own output sites, and each backward's g_out is permuted for its forward.
        strided = kind == "strided-k3s2"
        our_sites = out_ref.indices

        def twin_forward(f):
            out = twin(make_twin_input(f))
            return (out.features, out.indices) if strided else out.features

        def twin_check(out, ref_out) -> None:
            if strided:
                features, sites = out
                out = features[peer.matching(sites, our_sites)]  # our row order
            _max_relative(tol)(out, ref_out)

        def twin_bwd_args():
            leaf = feats.detach().requires_grad_(True)
            out = twin(make_twin_input(leaf))
            g_sp = grad
            if strided:  # twin rows[perm] == our rows: g_sp[perm] = our g_out
                g_sp = torch.empty_like(grad)
                g_sp[peer.matching(out.indices, our_sites)] = grad
            return out.features, (leaf, twin.weight), g_sp

        tol = PEER_TOL[dtype]
        twin_params = {**params, "implementation": f"spconv {peer.version()}"}
        cases.append(
            Case(
                name=f"{name}-forward-{dt}-spconv", op="sparse_conv", direction="forward",
                dtype=dtype, params=twin_params, compulsory_bytes=fwd_bytes,
                fn=twin_forward, make_args=lambda: feats,
                reference=fwd(ref, make_input), check=twin_check, time_reference=False,
            )
        )  # fmt: skip
        if backward:
            cases.append(
                Case(
                    name=f"{name}-backward-{dt}-spconv", op="sparse_conv", direction="backward",
                    dtype=dtype, params=twin_params, compulsory_bytes=bwd_bytes,
                    fn=harness.autograd_backward, make_args=twin_bwd_args,
                    reference=ref_backward, check=_max_relative(tol), time_reference=False,
                )
            )  # fmt: skip
    return cases


def rulebook_cases(idx, shape, batch) -> list[Case]:
    be = harness.backend()
    args = (batch, shape, [3] * 3, [1] * 3, [1] * 3, [1] * 3, [0] * 3, True, False)
    rb = sparse_rulebook(idx, *args, backend="reference")
    params = {"layer": "subm-k3", "voxels": idx.shape[0], "pairs": int(rb.indice_pair_num.sum())}
    nbytes = _nbytes(idx, *rb)
    cases = [
        Case(
            name="rulebook-subm-k3", op="sparse_rulebook", direction="forward",
            dtype=torch.int32, params=params, compulsory_bytes=nbytes,
            fn=lambda i: sparse_rulebook(i.clone(), *args, backend=be), make_args=lambda: idx,
            reference=lambda i: sparse_rulebook(i, *args, backend="reference"),
        )
    ]  # fmt: skip
    if peer.available():
        from spconv.core import ConvAlgo
        from spconv.pytorch import ops as sp_ops

        cases.append(
            Case(
                name="rulebook-subm-k3-spconv", op="sparse_rulebook", direction="forward",
                dtype=torch.int32, params={**params, "implementation": "spconv Native"},
                compulsory_bytes=nbytes,
                fn=lambda i: sp_ops.get_indice_pairs(
                    i.clone(), batch, shape, ConvAlgo.Native, [3] * 3, [1] * 3, [1] * 3, [1] * 3,
                    [0] * 3, True, False,
                ),
                make_args=lambda: idx,
            )
        )  # fmt: skip
    return cases


def build_cases(args) -> list[Case]:
    smoke = args.smoke
    feats, coors, shape = frame(smoke)
    cases = []
    for dtype in DTYPES:
        cases += encoder_cases(smoke, dtype)
    for dtype in DTYPES:
        cases += layer_cases("subm-k3", 16, 16, coors, shape, 1, dtype)
        cases += layer_cases("strided-k3s2", 16, 32, coors, shape, 1, dtype)
        cases += layer_cases("inverse-k3", 32, 16, coors, shape, 1, dtype)
    cases += rulebook_cases(coors, shape, 1)
    if args.quick:
        return cases
    for n in SMOKE_VOXEL_SWEEP if smoke else VOXEL_SWEEP:
        idx = sites(n, smoke)
        batch = int(idx[:, 0].max()) + 1
        cases += layer_cases(
            "subm-k3", 16, 16, idx, shape, batch, torch.float32, label=f"sweep-n{n}-subm-k3",
            extra={"sweep": "voxels"}, backward=False,
        )  # fmt: skip
    for c in SMOKE_CHANNEL_SWEEP if smoke else CHANNEL_SWEEP:
        cases += layer_cases(
            "subm-k3", c, c, coors, shape, 1, torch.float32, label="sweep-channels-subm-k3",
            extra={"sweep": "channels"}, backward=False,
        )  # fmt: skip
    return cases


def main(argv: list[str] | None = None) -> int:
    return harness.main("sparse_conv", build_cases, argv, doc=__doc__, targets=TARGETS)


if __name__ == "__main__":
    sys.exit(main())
