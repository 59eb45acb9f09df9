"""`python -m mu_space` / `mu-space`: environment, operator table, self-check, dispatch report.

Runs every registered operator on the best available device: native vs reference where the
native kernel can run, the reference alone otherwise. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import platform
import sys
import traceback
from pathlib import Path

import torch

import mu_space
from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.testing import tolerances


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "musa") and torch.musa.is_available():
        return torch.device("musa", torch.musa.current_device())
    return torch.device("cpu")


def _parse_device(text: str) -> torch.device:
    """--device, checked: a usable torch device or SystemExit with one clear line."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise SystemExit(
            f"mu-space: error: --device {text!r} is not a torch device "
            "(e.g. cpu, cuda, cuda:1, musa)"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                f"mu-space: error: --device {text}: this torch ({torch.__version__}) "
                "has no usable CUDA device"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(
                f"mu-space: error: --device {text}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type == "musa":
        if not (hasattr(torch, "musa") and torch.musa.is_available()):
            raise SystemExit(
                f"mu-space: error: --device {text}: torch_musa is not installed or "
                "sees no MUSA device"
            )
    elif device.type != "cpu":
        raise SystemExit(f"mu-space: error: --device {text}: muSPACE runs on cpu, cuda and musa")
    return device


def environment(device: torch.device) -> dict:
    st = native.status()
    env = {
        "mu_space": mu_space.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "native_built": st.built,
        "native_loaded": st.loaded,
        "native_backend": st.backend,
        "native_archs": st.archs,
        "tvm_ffi_built_against": st.tvm_ffi_built,
        "tvm_ffi_runtime": st.tvm_ffi_runtime,
        "native_library": st.path,
        "native_sources_current": _sources_current(st.build_info),
        "native_unavailable_reason": st.reason or None,
        "native_build_facts": {k: v for k, v in native.build_facts().items() if k != "limits"},
        "native_usable_on_device": native.unavailable_reason(device) is None,
        "native_device_reason": native.unavailable_reason(device),
        "strict": kernel_dispatch.is_strict(),
    }
    return env


def _sources_current(build_info: dict) -> bool | None:
    """In a source checkout: whether the loaded library was built from this tree's csrc/ (the
    digest build_utils.py records); None outside a checkout or for a build without a digest."""
    root = Path(mu_space.__file__).resolve().parent.parent
    script = root / "build_utils.py"
    if not (build_info.get("sources_sha256") and script.is_file() and (root / "csrc").is_dir()):
        return None
    spec = importlib.util.spec_from_file_location("_muspace_build_utils", script)
    build_utils = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(build_utils)  # registered first: its dataclasses look it up
    return build_utils.sources_digest() == build_info["sources_sha256"]


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, tuple) else (value,)


def _grads(op, sample, backend):
    """Gradients of the op's differentiable inputs for a fixed random output weighting."""
    names = op.backward.inputs if op.backward is not None else op.grad_inputs
    params = list(inspect.signature(op.api).parameters)
    wanted = {params.index(n) for n in names if n in params}
    args = [
        a.detach().clone().requires_grad_(True)
        if i in wanted and isinstance(a, torch.Tensor) and a.is_floating_point()
        else a
        for i, a in enumerate(sample.args)
    ]
    outs = _as_tuple(op.api(*args, **sample.kwargs, backend=backend))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o.shape, generator=gen).to(o) for o in outs]
    torch.autograd.backward(outs, weights)
    return tuple(a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad)


def run_case(op, sample, device) -> dict:
    # "auto": native where it runs, else the reference with the reason recorded (an error
    # under --strict).
    backend = "auto"
    row = {"op": op.name, "case": sample.label, "backend": backend}
    try:
        want = op.api(*sample.args, **sample.kwargs, backend="reference")
        got = op.api(*sample.args, **sample.kwargs, backend=backend)
        row["max_abs_err"] = tolerances.assert_close(got, want, op=op.name, name="output")
        if sample.grad:
            err = tolerances.assert_close(
                _grads(op, sample, backend),
                _grads(op, sample, "reference"),
                op=op.name,
                name="grad",
            )
            row["max_abs_err"] = max(row["max_abs_err"], err)
        row["status"] = "PASS"
    except kernel_dispatch.DispatchError as exc:  # strict mode: one line, no traceback
        row["status"] = "FAIL"
        row["error"] = f"DispatchError: {exc}"
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run goes on
        row["status"] = "FAIL"
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()
    return row


def operator_table(device: torch.device) -> list[dict]:
    reason = native.unavailable_reason(device)
    return [
        {
            "op": op.name,
            "family": op.family,
            "dtypes": [str(d).removeprefix("torch.") for d in op.native_dtypes],
            "native_entry_points": {e: native.has_function(e) for e in op.entry_points},
            "auto_backend_here": device.type if reason is None else "reference",
        }
        for op in registry.operators()
    ]


def _print_environment(env, table) -> None:
    print("muSPACE self-check")
    for key, value in env.items():
        print(f"  {key:28s} {value}")
    print("\noperators on this machine:")
    for t in table:
        entries = ", ".join(
            f"{e}{'' if ok else ' (missing)'}" for e, ok in t["native_entry_points"].items()
        )
        print(f"  {t['op']:20s} {t['family']:10s} auto -> {t['auto_backend_here']:9s} [{entries}]")
    if env.get("native_sources_current") is False:
        print(
            "\nwarning: the native library was built from other sources than this checkout's "
            "csrc/: rebuild it (python build_utils.py --inplace)"
        )
    if env.get("tvm_ffi_built_against") and env["tvm_ffi_built_against"] != env["tvm_ffi_runtime"]:
        print(
            f"\nwarning: the native library was built against apache-tvm-ffi "
            f"{env['tvm_ffi_built_against']} and runs with {env['tvm_ffi_runtime']}: the ABI "
            "is bound to the build's version; reinstall that version or rebuild"
        )


def _print_text(env, table, rows) -> None:
    _print_environment(env, table)
    print("\nself-check (native vs reference where native runs):")
    for r in rows:
        err = f"max|err|={r['max_abs_err']:.3g}" if "max_abs_err" in r else r.get("error", "")
        print(f"  {r['status']}  {r['op']:20s} {r['case']:32s} {r['backend']:9s} {err}")
    print()
    print(kernel_dispatch.report())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mu-space", description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="any auto fallback is a failure")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--device", help="device to check (default: first GPU, else cpu)")
    parser.add_argument(
        "--operator-matrix",
        action="store_true",
        help="print docs/operator_matrix.md generated from the registry and exit",
    )
    args = parser.parse_args(argv)
    if args.operator_matrix:
        sys.stdout.write(registry.operator_matrix_markdown())
        return 0
    if args.strict:
        kernel_dispatch.set_strict(True)
    device = _parse_device(args.device) if args.device else _default_device()
    kernel_dispatch.reset()
    env = environment(device)
    table = operator_table(device)
    if args.strict and not env["native_usable_on_device"]:
        # one line, not one failure per case: nothing native can run on this device
        reason = env["native_device_reason"]
        if args.json:
            print(
                json.dumps(
                    {
                        "environment": env,
                        "operators": table,
                        "results": [],
                        "dispatch": [],
                        "ok": False,
                        "error": f"strict: {reason}",
                    },
                    indent=2,
                )
            )
        else:
            _print_environment(env, table)
            print(f"\nstrict: native kernels cannot run on {device}: {reason}")
        return 1
    torch.manual_seed(0)
    rows = [
        run_case(op, sample, device) for op in registry.operators() for sample in op.samples(device)
    ]
    failed = [r for r in rows if r["status"] != "PASS"]
    if args.json:
        print(
            json.dumps(
                {
                    "environment": env,
                    "operators": table,
                    "results": rows,
                    "dispatch": kernel_dispatch.records(),
                    "ok": not failed,
                },
                indent=2,
            )
        )
    else:
        _print_text(env, table, rows)
        for r in failed:
            if "traceback" in r:
                print(f"\n{r['op']} / {r['case']} failed:\n{r['traceback']}", file=sys.stderr)
        print(
            f"\nself-check: {len(rows) - len(failed)}/{len(rows)} cases passed"
            f"{'; FAILED' if failed else ''}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
