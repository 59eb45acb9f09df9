"""Shared plumbing of the model-example scripts: arguments, seeding, the A/B run, comparison,
timing. The models themselves live in each example's script.

Each script builds one module twice from the same seed (identical weights), runs forward +
backward with backend A and with backend B on the same inputs, compares the outputs and the
gradients of the inputs and parameters, then times forward + backward of each.

Scripts whose module has discontinuities downstream of a muSPACE op (a ReLU mask, a bilinear
cell choice) also re-run every recorded op call on the identical inputs with both backends
(`OpCheck`): a float32 rounding difference in the op's output legitimately flips a few such
discontinuities in the module, which moves the module's gradients far more than the op's own
error, so the module-level gradients there are compared in the L2 norm and the op itself is
checked tightly, call by call.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mu_space.runtime.kernel_dispatch import BACKENDS as BACKEND_CHOICES


def make_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--backend-a",
        choices=BACKEND_CHOICES,
        default=None,
        help="backend of run A (default: native on a GPU, reference on the CPU)",
    )
    p.add_argument(
        "--backend-b",
        choices=BACKEND_CHOICES,
        default="reference",
        help="backend of run B, the baseline (default: reference)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cuda, cuda:1, cpu ... (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="tiny shapes (CPU checks and CI); default: the upstream config's shapes",
    )
    p.add_argument("--batch", type=int, default=None, help="batch size (default per script)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed iterations (default 3, small 1)"
    )
    p.add_argument("--reps", type=int, default=None, help="timed iterations (default 10, small 2)")
    p.add_argument("--seed", type=int, default=0)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = torch.device(args.device)
    if args.backend_a is None:
        args.backend_a = "native" if args.device.type != "cpu" else "reference"
        if args.device.type == "cpu":
            print("note: native kernels do not run on the CPU; comparing reference vs reference")
    if args.warmup is None:
        args.warmup = 1 if args.small else 3
    if args.reps is None:
        args.reps = 2 if args.small else 10
    if args.device.type == "cuda":
        # TF32 would round the convolutions / matmuls to 10 mantissa bits and hide (or fake)
        # differences between the two backends; both runs use full float32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return args


@dataclass
class RunResult:
    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


def forward_backward(
    module: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    loss_weights: dict[str, torch.Tensor],
    collect: bool = True,
    no_grad_inputs: tuple[str, ...] = (),
) -> RunResult | None:
    """One forward + backward. The loss is <output, fixed random weights>, so every output
    element gets a distinct, non-trivial gradient (a plain .sum() would give all-ones)."""
    module.zero_grad(set_to_none=True)
    leaves = {
        k: v.detach().clone().requires_grad_(v.is_floating_point() and k not in no_grad_inputs)
        for k, v in inputs.items()
    }
    outs = module(**leaves)
    loss = sum((outs[k].float() * loss_weights[k]).sum() for k in outs)
    loss.backward()
    if not collect:  # timing: no copies
        return None
    grads = {f"input.{k}": v.grad.detach().clone() for k, v in leaves.items() if v.grad is not None}
    grads.update(
        {
            f"param.{n}": p.grad.detach().clone()
            for n, p in module.named_parameters()
            if p.grad is not None
        }
    )
    return RunResult({k: v.detach().clone() for k, v in outs.items()}, grads)


def compare(
    name: str, a: torch.Tensor, b: torch.Tensor, rel_tol: float, metric: str = "max"
) -> tuple[bool, str]:
    """metric "max": max |a - b| <= rel_tol * max |b|, the error relative to the tensor's scale
    (an elementwise relative test is meaningless for sums that cancel to ~0: gradients, pooled
    features of empty cells). metric "l2": ||a - b||_2 <= rel_tol * ||b||_2, for tensors where a
    few elements may legitimately differ (see the module docstring). NaN or Inf fails."""
    if a.shape != b.shape:
        return False, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a64, b64 = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a64).all() and torch.isfinite(b64).all()):
        return False, f"{name}: non-finite values"
    if metric == "max":
        scale = b64.abs().max().item() if b64.numel() else 0.0
        err = (a64 - b64).abs().max().item() if b64.numel() else 0.0
        label = "max"
    elif metric == "l2":
        scale, err, label = b64.norm().item(), (a64 - b64).norm().item(), "l2 "
    else:
        raise ValueError(f"metric must be 'max' or 'l2', got {metric!r}")
    ok = err <= rel_tol * scale + 1e-30
    return (
        ok,
        f"{name:<44s} {label}|a-b| {err:9.3g}  {label}|b| {scale:9.3g}  rel "
        f"{err / max(scale, 1e-30):9.3g}  (tol {rel_tol:g}) {'ok' if ok else 'MISMATCH'}",
    )


def check(
    a: RunResult, b: RunResult, out_tol: float, grad_tol: float, grad_metric: str = "max"
) -> bool:
    ok_all = True
    if set(a.grads) != set(b.grads):
        print(f"MISMATCH: gradient sets differ: {sorted(set(a.grads) ^ set(b.grads))}")
        ok_all = False
    for k in a.outputs:
        ok, line = compare(f"output {k}", a.outputs[k], b.outputs[k], out_tol)
        print("  " + line)
        ok_all &= ok
    for k in sorted(set(a.grads) & set(b.grads)):
        ok, line = compare(f"grad {k}", a.grads[k], b.grads[k], grad_tol, grad_metric)
        print("  " + line)
        ok_all &= ok
    return ok_all


# ----------------------------------------------------------------- op calls, checked one by one


@dataclass
class OpCheck:
    """Tolerances (max-relative, as `compare`) of one public muSPACE op re-run on the inputs it
    saw inside the module; `prepare(args) -> args` may adjust the recorded inputs first."""

    out_tol: float
    grad_tol: float
    prepare: Callable[[tuple], tuple] | None = None


@dataclass
class OpCall:
    name: str
    args: tuple
    kwargs: dict
    grad_output: torch.Tensor | None = None
    requires_grad: tuple = field(default_factory=tuple)


def _recording(name: str, op: Callable, calls: list[OpCall]) -> Callable:
    """`op` that also appends each call's inputs (detached copies) to `calls` and, once backward
    has run, the gradient of its output."""

    def recorded(*args, **kwargs):
        out = op(*args, **kwargs)
        call = OpCall(
            name,
            tuple(a.detach().clone() if torch.is_tensor(a) else a for a in args),
            {k: v for k, v in kwargs.items() if k != "backend"},
            requires_grad=tuple(torch.is_tensor(a) and a.requires_grad for a in args),
        )
        if out.requires_grad:

            def keep(grad, call=call):
                call.grad_output = grad.detach().clone()

            out.register_hook(keep)
        calls.append(call)
        return out

    return recorded


@contextlib.contextmanager
def record_op_calls(names):
    """Patches the public `mu_space.<name>` functions (the scripts call them through the package
    attribute) with recording wrappers; yields the list of recorded `OpCall`s."""
    from mu_space.patcher import Patch, Patcher

    calls: list[OpCall] = []
    patches = [
        Patch(
            f"record {name}", f"mu_space.{name}", lambda op, name=name: _recording(name, op, calls)
        )
        for name in names
    ]
    with Patcher(patches):
        yield calls


def _run_call(call: OpCall, args: tuple, backend: str):
    import mu_space

    leaves = tuple(
        a.clone().requires_grad_(True) if rg else a for a, rg in zip(args, call.requires_grad)
    )
    with torch.enable_grad():
        out = getattr(mu_space, call.name)(*leaves, **call.kwargs, backend=backend)
        wanted = [x for x, rg in zip(leaves, call.requires_grad) if rg]
        grads = (
            torch.autograd.grad(out, wanted, call.grad_output)
            if wanted and call.grad_output is not None
            else ()
        )
    return out.detach(), grads


def _positional_names(name: str, n: int) -> list[str]:
    """The public op's positional parameter names (for the report), "arg i" beyond them."""
    import mu_space

    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        names = [
            p.name
            for p in inspect.signature(getattr(mu_space, name)).parameters.values()
            if p.kind in kinds
        ]
    except (TypeError, ValueError):
        names = []
    return names + [f"arg {i}" for i in range(len(names), n)]


def check_op_calls(
    calls: list[OpCall], checks: dict[str, OpCheck], backend_a: str, backend_b: str
) -> bool:
    """Each recorded call re-run with both backends on the identical inputs and the gradient it
    received in the module: output and input gradients compared (max-relative)."""
    ok_all = True
    seen: dict[str, int] = {}
    for call in calls:
        k = seen[call.name] = seen.get(call.name, -1) + 1
        check_ = checks[call.name]
        args = check_.prepare(call.args) if check_.prepare else call.args
        out_a, grads_a = _run_call(call, args, backend_a)
        out_b, grads_b = _run_call(call, args, backend_b)
        ok, line = compare(f"{call.name}[{k}] output", out_a, out_b, check_.out_tol)
        print("  " + line)
        ok_all &= ok
        params = _positional_names(call.name, len(call.args))
        positions = [i for i, rg in enumerate(call.requires_grad) if rg]
        for i, ga, gb in zip(positions, grads_a, grads_b):
            ok, line = compare(f"{call.name}[{k}] grad {params[i]}", ga, gb, check_.grad_tol)
            print("  " + line)
            ok_all &= ok
    if not calls:
        print("  MISMATCH: no op call was recorded")
        return False
    return ok_all


def time_step(step: Callable[[], None], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of `step` (forward + backward): CUDA events on a GPU, perf_counter
    on the CPU."""
    for _ in range(warmup):
        step()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_ab(
    args: argparse.Namespace,
    title: str,
    build: Callable[[str], torch.nn.Module],
    inputs: dict[str, torch.Tensor],
    out_tol: float,
    grad_tol: float,
    no_grad_inputs: tuple[str, ...] = (),
    grad_metric: str = "max",
    op_checks: dict[str, OpCheck] | None = None,
) -> int:
    """Build the module for each backend from the same seed, check A against B, time both.
    `op_checks`: also re-run each call of these public ops made in run A on its recorded
    inputs with both backends. Returns the process exit status (0 pass, 1 mismatch)."""
    dev = args.device
    print(
        f"{title}\ndevice {dev}, backend A = {args.backend_a}, backend B = {args.backend_b}, "
        f"torch {torch.__version__}"
    )
    for k, v in inputs.items():
        print(f"  input {k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}")
    modules = {}
    for label, backend in (("A", args.backend_a), ("B", args.backend_b)):
        torch.manual_seed(args.seed)  # identical weights for both runs
        modules[label] = build(backend).to(dev)
    n_params = sum(p.numel() for p in modules["A"].parameters())
    print(f"  parameters: {n_params}")

    with torch.no_grad():
        probe = modules["B"](**inputs)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    weights = {k: torch.randn(v.shape, generator=g).to(dev) for k, v in probe.items()}
    for k, v in probe.items():
        print(f"  output {k}: {tuple(v.shape)}")
    del probe

    with record_op_calls(op_checks or {}) as calls:
        res_a = forward_backward(modules["A"], inputs, weights, True, no_grad_inputs)
    res_b = forward_backward(modules["B"], inputs, weights, True, no_grad_inputs)
    bound = (
        "max|a-b| <= tol * max|b|"
        if grad_metric == "max"
        else "outputs max|a-b| <= tol * max|b|, gradients ||a-b||_2 <= tol * ||b||_2"
    )
    print(f"A vs B, module (bound: {bound}):")
    ok = check(res_a, res_b, out_tol, grad_tol, grad_metric)
    del res_a, res_b
    if op_checks:
        print(
            f"A vs B, each of the {len(calls)} recorded op calls on its own inputs "
            "(bound: max|a-b| <= tol * max|b|):"
        )
        ok &= check_op_calls(calls, op_checks, args.backend_a, args.backend_b)
    del calls

    ms = {}
    for label in ("A", "B"):
        m = modules[label]
        ms[label] = time_step(
            lambda m=m: forward_backward(m, inputs, weights, False, no_grad_inputs),
            dev,
            args.warmup,
            args.reps,
        )
    clock = "CUDA events" if dev.type == "cuda" else "perf_counter"
    print(f"forward + backward, median of {args.reps} ({clock}):")
    print(f"  A ({args.backend_a}): {ms['A']:.3f} ms")
    print(f"  B ({args.backend_b}): {ms['B']:.3f} ms")
    print(f"  speedup A over B: {ms['B'] / ms['A']:.2f}x")
    print("PASS" if ok else "FAIL: A and B disagree beyond the documented tolerances")
    return 0 if ok else 1


def entry(main: Callable[[list[str] | None], int]) -> None:
    sys.exit(main(None))
