"""Per-call host overhead of the public API against a direct TVM-FFI call and `torch.add`.

Operators such as bev_pool_v2 run in a few microseconds, so the Python path in front of the
kernel (validation, dispatch record, stream lookup, custom-op registration) must stay small.
Each variant is called back to back N times on a tiny tensor (the GPU work is shorter than the
host work, so the queue never fills and wall time per call is the host overhead); the median
of several trials is reported (`harness.time_host`, mode "host"). Each variant is checked
against `torch.add(x, 1)` and that call is timed next to it: speedup_vs_reference is
torch.add's time over the variant's (below 1: slower than torch.add).

    python -m benchmarks.bench_overhead [--calls 20000] [--trials 7] [--quick | --smoke] [--out DIR]

--quick: 5000 calls x 5 trials; --smoke: 200 x 2, without the TVM-FFI variants where the native
library is absent and without torch.compile.
"""

from __future__ import annotations

import functools

import torch

import mu_space
from benchmarks import harness
from benchmarks.harness import Case
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

# run mode -> (calls per trial, trials)
CALLS_TRIALS = {"full": (20000, 7), "quick": (5000, 5), "smoke": (200, 2)}


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


def build_cases(args) -> list[Case]:
    mode = harness.run_mode(args)
    calls, trials = CALLS_TRIALS[mode]
    calls, trials = args.calls or calls, args.trials or trials
    x = torch.randn(1024, device=harness.default_device())
    timer = functools.partial(_timer, calls=calls, trials=trials)
    made = variants(x, with_ffi=harness.native_available(), with_compile=mode != "smoke")
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
    ]


def _timer(fn, make_args, settings, *, calls: int, trials: int):
    return harness.time_host(fn, make_args, calls=calls, trials=trials)


def _add_arguments(parser) -> None:
    parser.add_argument("--calls", type=int, help="calls per trial (default 20000)")
    parser.add_argument("--trials", type=int, help="trials, median reported (default 7)")


def main(argv=None) -> int:
    return harness.main("overhead", build_cases, argv, doc=__doc__, add_arguments=_add_arguments)


if __name__ == "__main__":
    raise SystemExit(main())
