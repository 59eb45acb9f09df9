"""Shared test helpers: tolerance table, poisoned outputs, verbose comparisons, GPU selection."""

from __future__ import annotations

import pytest
import torch

from mu_space.runtime import native

# Native vs reference tolerances per dtype (atol, rtol). Kernels accumulate in float32 and the
# reference in the input dtype or float32, so differences are rounding of the output dtype:
# float32 ~1e-6 relative after reordered sums; float16 has 11 significant bits (~5e-4),
# bfloat16 8 bits (~4e-3), and one output rounding can flip the last bit of each.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def assert_close(
    got: torch.Tensor, want: torch.Tensor, *, atol: float, rtol: float, name: str = "out"
):
    """assert_close that reports where and how much the worst element differs; NaN never passes."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    if got.numel() == 0:
        return
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    nan = torch.isnan(g) & ~torch.isnan(w)
    assert not nan.any(), (
        f"{name}: {int(nan.sum())} NaN elements (unwritten?), first at "
        f"{tuple(int(i) for i in nan.nonzero()[0])}"
    )
    err = (g - w).abs()
    bound = atol + rtol * w.abs()
    bad = err > bound
    if bad.any():
        idx = (
            tuple(int(i) for i in (err - bound).flatten().argmax().unravel_index(err.shape))
            if hasattr(torch.Tensor, "unravel_index")
            else tuple(
                int(i) for i in torch.unravel_index((err - bound).flatten().argmax(), err.shape)
            )
        )
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.numel()} elements out of tolerance (atol={atol}, "
            f"rtol={rtol}); worst at {idx}: got {g[idx].item():.9g}, want {w[idx].item():.9g}; "
            f"max abs err {err.max().item():.3g}"
        )


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN (or -1 for integers) so unwritten elements fail."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan") if dtype.is_floating_point else -1)


def native_gpu_device() -> torch.device:
    """The first CUDA device when the native library can run there, else skip the test."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    device = torch.device("cuda", 0)
    reason = native.unavailable_reason(device)
    if reason is not None:
        pytest.skip(f"native library unusable on {device}: {reason}")
    return device
