"""Per-call host overhead of the public API against a direct TVM-FFI call and `torch.add`, and
of a forward + backward through autograd against plain torch autograd.

Operators such as bev_pool_v2 run in a few microseconds, so the Python path in front of the
kernel (validation, dispatch record, stream lookup, custom-op registration) must stay small.
Each variant is called back to back N times on a tiny tensor (the GPU work is shorter than the
host work, so the queue never fills and wall time per call is the host overhead); the median
of several trials is reported (`harness.time_host`, mode "host"). Each variant is checked
against `torch.add(x, 1)` and that call is timed next to it: speedup_vs_reference is
torch.add's time over the variant's (below 1: slower than torch.add).

Autograd cases (op "autograd", the `tiny` BEVDet rig: 2124 points, C 5, 20 x 20 cells): one
call = leaves' .grad set to None (as `zero_grad()` does), forward, `out.backward(grad_out)`
(what `loss.backward()` runs for loss = (out * grad_out).sum(), less that loss's own nodes),
the gradients returned. Checked against the directly computed gradients, then timed:
- `torch.mul` (one C++ autograd node, two inputs of the output's shape): the floor of autograd;
- the same product as a Python `torch.autograd.Function`: the floor of an op defined in Python;
- `mu_space.bev_pool_v2` (the public call, eager autograd path of mu_space/ops/_opdef.py);
- `torch.ops.mu_space.bev_pool_v2` (the custom op's `register_autograd`: what torch.compile
  graphs call, and what the public call went through before the eager autograd path);
- "forward only": the public call with leaves that require grad, no backward (the autograd
  graph is recorded and dropped): fwd+bwd minus this is the backward's share.
With --stub-compute the bev_pool_v2 implementations (forward and backward, native and
reference) are replaced by allocations of their outputs while timing (after the check), so the
time is the operator layer's and autograd's host work alone: on a CPU-only machine this is how
the host overhead is measured (the reference compute would dominate otherwise).

    python -m benchmarks.bench_overhead [--calls 20000] [--trials 7] [--quick | --smoke]
        [--cases REGEX] [--stub-compute] [--out DIR]

--quick: 5000 calls x 5 trials; --smoke: 200 x 2, without the TVM-FFI variants where the native
library is absent and without torch.compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

import mu_space
from benchmarks import harness
from benchmarks.harness import Case
from mu_space.ops.bev_pool_v2 import OP as BEV_POOL_V2
from mu_space.ops.bev_pool_v2 import bev_pool_v2_backward_reference, bev_pool_v2_reference
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

# run mode -> (calls per trial, trials)
CALLS_TRIALS = {"full": (20000, 7), "quick": (5000, 5), "smoke": (200, 2)}
# the same for the autograd cases (a call is ~100 us of host work; on a CPU the smoke run's
# reference compute takes milliseconds)
AUTOGRAD_CALLS_TRIALS = {"full": (5000, 7), "quick": (2000, 5), "smoke": (5, 2)}


def variants(x: torch.Tensor, *, with_ffi: bool, with_compile: bool) -> dict:
    """name -> a call returning x + 1 (the TVM-FFI calls return the output they wrote)."""
    calls = {"torch.add(x, 1)": lambda: torch.add(x, 1)}
    if with_ffi:
        out = torch.empty_like(x)
        ffi = native.function("add_one_forward")
        stream = stream_handle(x)

        def ffi_preallocated():
            ffi(x, out, stream)
            return out

        def ffi_allocating():
            y = torch.empty_like(x)
            ffi(x, y, stream_handle(x))
            return y

        calls["tvm-ffi call, preallocated out"] = ffi_preallocated
        calls["tvm-ffi call + empty_like + stream lookup"] = ffi_allocating
    calls["mu_space.ops.add_one (public eager path)"] = lambda: mu_space.ops.add_one(x)
    calls["torch.ops.mu_space.add_one (custom op dispatch)"] = lambda: torch.ops.mu_space.add_one(
        x, "auto"
    )
    if with_compile:
        compiled = torch.compile(lambda t: mu_space.ops.add_one(t), fullgraph=True)
        calls["torch.compile(add_one)"] = lambda: compiled(x)
    return calls


class _Mul(torch.autograd.Function):
    """a * b as a Python autograd.Function (the floor of any op whose autograd is in Python)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b, grad * a


def _through_autograd(forward, leaves, grad_out):
    """One training step's autograd work for `forward`: the gradients of leaves."""

    def call():
        for t in leaves:
            t.grad = None
        forward(*leaves).backward(grad_out)
        return tuple(t.grad for t in leaves)

    return call


@contextlib.contextmanager
def stubbed_compute(op, outputs: tuple, grads: tuple):
    """op's forward and backward implementations (native and reference) replaced by
    allocations shaped like `outputs` / `grads`: what remains is the layer's host work."""
    d = op.d

    def forward(*_):
        outs = tuple(torch.empty_like(t) for t in outputs)
        return outs[0] if len(outs) == 1 else outs

    def backward(*_, **__):
        return tuple(None if t is None else torch.empty_like(t) for t in grads)

    saved = op._native, op._reference, d.backward
    op._native, op._reference = forward, forward
    d.backward = dataclasses.replace(d.backward, reference=backward, native=backward)
    try:
        yield
    finally:
        op._native, op._reference, d.backward = saved


def autograd_cases(timer, *, stub: bool, params: dict) -> list[Case]:
    """The forward + backward cases (module docstring)."""
    from benchmarks.bench_bev_pool_v2 import SMOKE_RIG, inputs
    from mu_space.testing import bev_geometry

    args = inputs(bev_geometry.CONFIGS[SMOKE_RIG], torch.float32)
    depth, feat, rd, rf, rb, shape, starts, lengths = args
    B, Z, Y, X, C = shape
    be = harness.backend()
    gen = torch.Generator().manual_seed(0)
    grad_out = torch.randn((B, C, Z, Y, X), generator=gen).to(feat.device)
    want_bev = bev_pool_v2_backward_reference(grad_out, *args)
    leaves = tuple(t.detach().clone().requires_grad_(True) for t in (depth, feat))
    a, b = (torch.randn(grad_out.shape, generator=gen).to(feat.device) for _ in range(2))
    ab = (a.requires_grad_(True), b.requires_grad_(True))
    want_mul = (grad_out * b, grad_out * a)
    schema_shape = list(shape)
    rest = (rd, rf, rb, shape, starts, lengths)
    fwd_bwd = "forward+backward"
    made = {  # name -> (direction, call, the gradients / output it must return)
        "fwd+bwd torch.mul (C++ autograd node)": (
            fwd_bwd,
            _through_autograd(torch.mul, ab, grad_out),
            want_mul,
        ),
        "fwd+bwd torch.autograd.Function (Python, a * b)": (
            fwd_bwd,
            _through_autograd(_Mul.apply, ab, grad_out),
            want_mul,
        ),
        "fwd+bwd mu_space.bev_pool_v2 (public call)": (
            fwd_bwd,
            _through_autograd(
                lambda d, f: mu_space.bev_pool_v2(d, f, *rest, backend=be), leaves, grad_out
            ),
            want_bev,
        ),
        "fwd+bwd torch.ops.mu_space.bev_pool_v2 (custom op autograd)": (
            fwd_bwd,
            _through_autograd(
                lambda d, f: torch.ops.mu_space.bev_pool_v2(
                    d, f, rd, rf, rb, schema_shape, starts, lengths, be
                ),
                leaves,
                grad_out,
            ),
            want_bev,
        ),
        "fwd only, graph recorded, mu_space.bev_pool_v2 (public call)": (
            "forward",
            lambda: mu_space.bev_pool_v2(*leaves, *rest, backend=be),
            bev_pool_v2_reference(depth, feat, *rest),
        ),
    }
    stub_shapes = ((torch.empty_like(grad_out),), want_bev)
    cases = []
    for name, (direction, fn, want) in made.items():
        stubbed = stub and "bev_pool_v2" in name
        cases.append(
            Case(
                name=name,
                op="autograd",
                direction=direction,
                dtype=torch.float32,
                params={
                    **params,
                    "rig": SMOKE_RIG,
                    "n_points": int(rb.shape[0]),
                    "C": C,
                    "output_shape": list(grad_out.shape),
                    "compute": "stubbed (allocations only)" if stubbed else "real",
                },
                compulsory_bytes=0,
                fn=fn,
                make_args=lambda: (),
                reference=lambda want=want: want,
                check=harness.close_check("bev_pool_v2" if "bev_pool_v2" in name else None),
                time_reference=False,
                timer=functools.partial(_stubbed_timer, timer=timer, stub=stub_shapes)
                if stubbed
                else timer,
            )
        )
    return cases


def _stubbed_timer(fn, make_args, settings, *, timer, stub):
    with stubbed_compute(BEV_POOL_V2, *stub):
        return timer(fn, make_args, settings)


def build_cases(args) -> list[Case]:
    mode = harness.run_mode(args)
    calls, trials = CALLS_TRIALS[mode]
    calls, trials = args.calls or calls, args.trials or trials
    x = torch.randn(1024, device=harness.default_device())
    timer = functools.partial(_timer, calls=calls, trials=trials)
    made = variants(x, with_ffi=harness.native_available(), with_compile=mode != "smoke")
    ag_calls, ag_trials = AUTOGRAD_CALLS_TRIALS[mode]
    ag_calls, ag_trials = args.calls or ag_calls, args.trials or ag_trials
    ag_timer = functools.partial(_timer, calls=ag_calls, trials=ag_trials)
    return [
        Case(
            name=name,
            op="add_one",
            direction="forward",
            dtype=x.dtype,
            params={"calls": calls, "trials": trials, "numel": x.numel()},
            compulsory_bytes=0,
            fn=fn,
            make_args=lambda: (),
            reference=lambda: torch.add(x, 1),
            timer=timer,
        )
        for name, fn in made.items()
    ] + autograd_cases(
        ag_timer, stub=args.stub_compute, params={"calls": ag_calls, "trials": ag_trials}
    )


def _timer(fn, make_args, settings, *, calls: int, trials: int):
    return harness.time_host(fn, make_args, calls=calls, trials=trials, warmup=min(200, calls))


def _add_arguments(parser) -> None:
    parser.add_argument("--calls", type=int, help="calls per trial (default 20000)")
    parser.add_argument("--trials", type=int, help="trials, median reported (default 7)")
    parser.add_argument(
        "--stub-compute",
        action="store_true",
        help="time the bev_pool_v2 autograd cases with their compute replaced by allocations",
    )


def main(argv=None) -> int:
    return harness.main("overhead", build_cases, argv, doc=__doc__, add_arguments=_add_arguments)


if __name__ == "__main__":
    raise SystemExit(main())
