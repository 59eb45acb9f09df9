"""The no-GPU check of a family's native entry points against the built library
(tests/ops/test_*_native_calls.py; the method of scripts/native_messages.py): host arrays
relabelled as cuda:0 DLPack tensors reach the library's argument checks, which stop at the first
runtime call ("get current device failed"). A wrong argument shows up as the library's
TypeError / ValueError instead."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mu_space.runtime import native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from native_messages import KDL_BFLOAT, _tensor  # noqa: E402

REACHED = "get current device failed"  # the library's first runtime call without a driver


class ReachedRuntime(Exception):
    """An entry point accepted its arguments and got as far as the CUDA runtime."""


def load_library(entry_points):
    """The built library (tvm_ffi module) holding `entry_points`, else skip the test. Never on a
    machine with a GPU: there the relabelled host arrays would reach real launches (the GPU
    tests cover these calls for real)."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: this check is for machines without a GPU")
    path = native.library_path()
    if not path.is_file():
        pytest.skip(f"no native library at {path}")
    try:
        import tvm_ffi

        lib = tvm_ffi.load_module(str(path))
        for name in entry_points:
            lib[name]
    except Exception as exc:  # noqa: BLE001 - an old or unloadable library: nothing to check
        pytest.skip(f"the library cannot be used for this check: {exc}")
    return lib


def as_cuda(t):
    """A CPU tensor as a cuda:0 DLPack tensor (other arguments unchanged)."""
    if not isinstance(t, torch.Tensor):
        return t
    a = t.detach().contiguous()
    if a.dtype == torch.bfloat16:
        return _tensor(a.view(torch.int16).numpy().view(np.uint16), code=KDL_BFLOAT)
    return _tensor(a.numpy())


def relabelling(library, monkeypatch, continue_after=()) -> list[str]:
    """Route `native.function(name)` to the library's function on relabelled tensors (the
    `*_workspace_ints` and build-facts queries run as they are); returns the list of entry points that reached
    the runtime, each of which raised ReachedRuntime, except those in `continue_after`: they
    return None, so the Python path goes on to its next entry point (whose arguments are then
    checked too; outputs the skipped call would have written hold whatever they held)."""
    reached: list[str] = []

    def function(name):
        fn = library[name]
        if name.endswith("_workspace_ints") or name == "muspace_build_facts":
            return fn  # queries: no runtime call

        def call(*args):
            try:
                fn(*(as_cuda(a) for a in args))
            except RuntimeError as exc:
                if REACHED in str(exc):
                    reached.append(name)
                    if name in continue_after:
                        return None
                    raise ReachedRuntime(name) from None
                raise
            raise AssertionError(f"{name} ran without a GPU?")

        return call

    monkeypatch.setattr(native, "function", function)
    return reached
