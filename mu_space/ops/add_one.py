"""`add_one`: the native build smoke (not a public operator, not in the operator matrix). It runs
the whole path every operator takes (definition, check, dispatch record, custom op, TVM-FFI call
on the caller's stream) with the smallest possible kernel; `benchmarks/bench_overhead.py` times
that path."""

from __future__ import annotations

import torch

from mu_space.ops import _checks, _opdef
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle


def add_one_reference(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _check(x) -> _opdef.Checked:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {_checks.dtype_name(x.dtype)}")
    return _opdef.Checked(x.device, x.dtype, ((x.shape, x.dtype),), None, "x")


def _forward_native(c: _opdef.Checked, x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()  # a non-contiguous input costs one copy
    out = _opdef.new_output(x)
    native.function("add_one_forward")(x, out, stream_handle(x))
    return out


def _samples(device: torch.device) -> list[_opdef.Sample]:
    return [
        _opdef.Sample("float32 [3, 1000, 7]", (torch.randn(3, 1000, 7, device=device),)),
        _opdef.Sample("empty", (torch.empty(0, 5, device=device),)),
    ]


OP = _opdef.define(
    _opdef.OpDef(
        name="add_one",
        family="smoke",
        schema="(Tensor x) -> Tensor",
        check=_check,
        reference=add_one_reference,
        native=_forward_native,
        native_dtypes=(torch.float32,),
        entry_points=("add_one_forward",),
        samples=_samples,
        public=False,
    )
)


@OP.export
def add_one(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The native build smoke (not a model operator): `out = x + 1`.

    Args:
        x: Tensor[...] of any shape, floating. float32 has a native kernel; other floating
            dtypes run the reference (`x + 1`). A non-contiguous x costs one copy.
        backend: "auto" | "native" | "cuda" | "musa" | "reference".

    Returns:
        Tensor of x's shape and dtype (contiguous on the native path). It runs the whole path an
        operator takes: check, dispatch record, custom op under torch.compile, TVM-FFI call on
        the caller's stream and device.
    """
    return OP(x, backend=backend)
