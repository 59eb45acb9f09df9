"""The one tolerance table: native vs reference, used by the tests, the benchmarks' checks and the
self-check (`python -m mu_space`).

`tolerance(op, dtype)` gives the bound for comparing an operator's native result with its
reference; `assert_close(got, want, tol)` applies it and reports the worst element. Operators
not listed below use the per-dtype defaults. A row says why its numbers are what they are.

Bound per element: |got - want| <= atol + rtol * |want|, where atol is absolute, or a fraction
of max|want| when `relative_to_max` is set (for outputs whose scale depends on the inputs).
NaN never passes unless `want` has NaN in the same place and `equal_nan` is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    reason: str
    relative_to_max: bool = False

    def bounds(self, want: torch.Tensor) -> tuple[float, float]:
        """(atol, rtol) for this reference tensor."""
        if not self.relative_to_max:
            return self.atol, self.rtol
        scale = want.detach().abs().max().item() if want.numel() else 0.0
        return self.atol * scale + 1e-30, self.rtol


_F32_REORDER = "float32 sums in another order (~1e-7 relative per term)"

# Native kernels accumulate in float32; the reference in the input dtype or float32. The
# differences are rounding: float16 keeps 11 significant bits (~5e-4), bfloat16 8 (~4e-3), and
# one rounding of the output can flip its last bit.
DEFAULTS: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-12, 1e-10, "float64 on both sides: reordering only"),
    torch.float32: Tolerance(1e-5, 1e-5, _F32_REORDER),
    torch.float16: Tolerance(1e-3, 2e-3, "one rounding of a float16 output (2^-11 relative)"),
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "one rounding of a bfloat16 output (2^-8 relative)"),
    # integer outputs (ranks, counts, voxel coordinates) are exact
    torch.int32: Tolerance(0.0, 0.0, "integer outputs are exact"),
    torch.int64: Tolerance(0.0, 0.0, "integer outputs are exact"),
    torch.bool: Tolerance(0.0, 0.0, "boolean outputs are exact"),
}

_BEV_F32 = Tolerance(
    1e-4,
    1e-5,
    "float32 sums of up to ~800 points per cell (intervals near the ego car) in another order; "
    "grad_depth sums C products of O(1) values",
)
_BEV_F16 = Tolerance(2e-3, 2e-3, "float32 sums rounded once to float16 (2^-11) on O(1) values")
# The MSDA kernel rounds the pixel coordinate `loc * size - 0.5` once in float32 (up to 0.5 ulp
# of size, ~4e-6 px on 64-px levels), which moves the bilinear weights by as much, and sums up to
# 4 * levels * points terms (atomics in any order for grad_value): ~1e-6 of the largest element.
_MSDA = {
    torch.float32: Tolerance(5e-5, 1e-4, "pixel coordinate rounded once in float32", True),
    torch.float16: Tolerance(2e-3, 2e-3, "float32 accumulation rounded to float16", True),
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2, "float32 accumulation rounded to bfloat16", True),
}

# sparse_conv's native paths sum the reference's products (exact in float32 for 16-bit
# operands) with float32 accumulation in another order: the im2col path in one GEMM over
# K * C_in (zero columns for absent neighbours), the per-offset path per offset on slices
# (cuBLAS / muBLAS may pick another kernel or split); an output sums up to K * C_in products
# (grad_weight: one per pair, thousands): ~1e-6 of the largest element in float32, then one
# rounding for float16 / bfloat16.
_SPARSE_CONV = {
    torch.float32: Tolerance(1e-5, 1e-5, "float32 sums of the same products (order)", True),
    torch.float16: Tolerance(1e-3, 2e-3, "float32 accumulation rounded once to float16", True),
    torch.bfloat16: Tolerance(8e-3, 1.6e-2, "float32 accumulation rounded once to bfloat16", True),
}

OVERRIDES: dict[tuple[str, torch.dtype], Tolerance] = {
    **{(op, torch.float32): _BEV_F32 for op in ("bev_pool_v2", "bev_pool_v3", "bev_pool")},
    **{(op, torch.float16): _BEV_F16 for op in ("bev_pool_v2", "bev_pool_v3", "bev_pool")},
    **{("multi_scale_deformable_attn", dtype): tol for dtype, tol in _MSDA.items()},
    **{("sparse_conv", dtype): tol for dtype, tol in _SPARSE_CONV.items()},
}


def tolerance(op: str | None, dtype: torch.dtype) -> Tolerance:
    """The native-vs-reference bound of `op` (None: the defaults) for results of `dtype`."""
    hit = OVERRIDES.get((op, dtype))
    if hit is not None:
        return hit
    try:
        return DEFAULTS[dtype]
    except KeyError:
        raise KeyError(
            f"no tolerance for dtype {dtype} (add it to mu_space/testing/tolerances.py)"
        ) from None


def _as_tuple(value) -> tuple:
    if isinstance(value, torch.Tensor) or value is None:
        return (value,)
    return tuple(value)


def assert_close(
    got,
    want,
    tol: Tolerance | None = None,
    *,
    op: str | None = None,
    name: str = "out",
    equal_nan: bool = False,
) -> float:
    """Compare tensors (or tuples of tensors / None) element-wise; raise AssertionError naming
    the worst element. `tol` defaults to `tolerance(op, want.dtype)`. Returns max |got - want|."""
    gots, wants = _as_tuple(got), _as_tuple(want)
    assert len(gots) == len(wants), f"{name}: {len(gots)} results, reference has {len(wants)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(gots, wants)):
        label = name if len(gots) == 1 else f"{name}[{i}]"
        if g is None or w is None:
            assert g is None and w is None, f"{label}: {g!r} vs reference {w!r}"
            continue
        worst = max(
            worst, _assert_tensor_close(g, w, tol or tolerance(op, w.dtype), label, equal_nan)
        )
    return worst


def _assert_tensor_close(g, w, tol: Tolerance, name: str, equal_nan: bool) -> float:
    assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
    assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
    if g.numel() == 0:
        return 0.0
    gd, wd = g.detach().double().cpu(), w.detach().double().cpu()
    atol, rtol = tol.bounds(wd)
    nan_g, nan_w = torch.isnan(gd), torch.isnan(wd)
    unexpected = nan_g & ~nan_w if equal_nan else nan_g
    if unexpected.any():
        first = tuple(int(i) for i in unexpected.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(unexpected.sum())} NaN elements (unwritten?), first at {first}"
        )
    missing = nan_w & ~nan_g
    if equal_nan and missing.any():
        first = tuple(int(i) for i in missing.nonzero()[0])
        raise AssertionError(f"{name}: reference is NaN at {first}, got {gd[first].item()}")
    both_nan = nan_g & nan_w
    same_inf = torch.isinf(wd) & (gd == wd)
    err = torch.where(both_nan | same_inf, 0.0, (gd - wd).abs())
    err = torch.nan_to_num(err, nan=float("inf"))
    bound = atol + rtol * torch.nan_to_num(wd.abs(), nan=0.0, posinf=0.0)
    bad = err > bound
    if bad.any():
        idx = tuple(
            int(i) for i in torch.unravel_index((err - bound).flatten().argmax(), err.shape)
        )
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.numel()} elements out of tolerance (atol={atol:.3g}, "
            f"rtol={rtol:.3g}: {tol.reason}); worst at {idx}: got {gd[idx].item():.9g}, "
            f"want {wd[idx].item():.9g}; max abs err {err.max().item():.3g}"
        )
    return float(err.max().item())
