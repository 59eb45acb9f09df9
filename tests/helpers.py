"""Shared test helpers: the tolerance table's bounds as keyword arguments, comparisons with an
explicit bound, poisoned buffers, GPU selection. Tolerances live in mu_space.testing.tolerances."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from mu_space.ops import _opdef
from mu_space.runtime import native
from mu_space.testing import tolerances


def tolerance(dtype: torch.dtype, op: str | None = None) -> dict:
    """{"atol", "rtol"} of the tolerance table for `op` (None: the defaults) and `dtype`."""
    t = tolerances.tolerance(op, dtype)
    assert not t.relative_to_max, "scaled tolerances: use tolerances.assert_close(op=...)"
    return {"atol": t.atol, "rtol": t.rtol}


def assert_close(got, want, *, atol: float, rtol: float, name: str = "out"):
    """tolerances.assert_close with a bound given by the test (its reason is the test's)."""
    bound = tolerances.Tolerance(atol, rtol, "the bound this test states")
    tolerances.assert_close(got, want, bound, name=name)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN (or -1 for integers) so unwritten elements fail."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan") if dtype.is_floating_point else -1)


def native_gpu_device(too_large_to_emulate: bool = False) -> torch.device:
    """The first CUDA device when the native library can run there, else skip the test. With a
    host-emulation library (MUSPACE_LIBRARY, docs/host_emulation.md) the CPU: the GPU tests
    then run the kernel source on the CPU, except those marked too large to emulate (gigabytes
    of tensors, or millions of threads)."""
    if emulated():
        if too_large_to_emulate:
            pytest.skip("too large for the host emulation (a GPU test only)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda", 0)
    reason = native.unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"native library unusable on {device}: {reason}")
    return device


def emulated() -> bool:
    """Whether the loaded native library is a host emulation (its kernels run on CPU tensors)."""
    st = native.status()
    return st.loaded and st.backend == native.HOST_EMULATION


@contextlib.contextmanager
def forbid_host_sync(device: torch.device):
    """Inside: any torch synchronisation with `device` raises (CUDA's sync debug mode). Under
    the host emulation (CPU tensors) there is nothing to synchronise: no check."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def synchronize(device: torch.device) -> None:
    """torch.cuda.synchronize(device) on CUDA (a kernel fault surfaces here); nothing on the
    CPU, where the host emulation's launches are synchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def poisoned_allocations(device: torch.device, nbytes: int = 1 << 30):
    """Outputs the native path allocates inside start as NaN: an unwritten element then fails
    the comparison. CUDA: a large block of the caching allocator filled with NaN and freed.
    CPU (host emulation, no caching allocator): new_output's NaN fill."""
    if device.type != "cuda":
        with _opdef.poisoned_outputs():
            yield
        return
    torch.empty(nbytes // 4, device=device).fill_(float("nan"))
    torch.cuda.synchronize(device)
    yield


def graph_capture_device() -> torch.device:
    """native_gpu_device() for a CUDA-graph capture test. Skips under
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 (the sanitizer memcheck runs): every allocation is then a
    cudaMalloc, which stream capture forbids (seen on the H200, 2026-12-01: error 900 inside
    torch's allocator, not in a muSPACE call)."""
    if emulated():
        pytest.skip("CUDA graph capture needs a GPU (the native library is a host emulation)")
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip(
            "CUDA graph capture needs the caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1)"
        )
    return native_gpu_device()


def recording_entry_points(monkeypatch) -> list[str]:
    """The names of the native entry points called from now on (in call order; the calls run)."""
    names: list[str] = []
    real = native.function

    def function(name):
        fn = real(name)

        def call(*args):
            names.append(name)
            return fn(*args)

        return call

    monkeypatch.setattr(native, "function", function)
    return names
