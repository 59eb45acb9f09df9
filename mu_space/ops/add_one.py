"""`add_one`: the native build smoke (not a public operator, not in the operator matrix).

    out = x + 1,   x: Tensor[...] float32 (native); any floating dtype (reference)

It exercises the full path every operator uses: Python validation, backend dispatch and its
record, the TVM-FFI call with the caller's stream, and a `torch.library` custom op so that
`torch.compile` sees one opaque op. Eager calls skip the torch dispatcher (the custom op's
Python dispatch costs several microseconds); compiled graphs call the same implementation
through `torch.ops.mu_space.add_one`.
"""

from __future__ import annotations

import torch

from mu_space.ops._checks import dtype_name
from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.runtime.device import stream_handle

OP = "add_one"


def add_one_reference(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _native_unsupported(x: torch.Tensor) -> str | None:
    if x.dtype != torch.float32:
        return f"x dtype {dtype_name(x.dtype)} has no native kernel (float32 only)"
    return None


def _add_one(x: torch.Tensor, backend: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor, got {dtype_name(x.dtype)}")
    if not kernel_dispatch.use_native(OP, backend, x.device, _native_unsupported(x)):
        return add_one_reference(x)
    x = x.contiguous()  # documented: a non-contiguous input costs one copy
    out = torch.empty_like(x)
    native.function("add_one_forward")(x, out, stream_handle(x))
    return out


@torch.library.custom_op("mu_space::add_one", mutates_args=())
def _add_one_op(x: torch.Tensor, backend: str) -> torch.Tensor:
    return _add_one(x, backend)


@_add_one_op.register_fake
def _(x: torch.Tensor, backend: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def add_one(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Return `x + 1` (float32 native kernel; reference for other floating dtypes)."""
    if torch.compiler.is_compiling():
        return torch.ops.mu_space.add_one(x, backend)
    return _add_one(x, backend)


def _self_check_cases(device: torch.device) -> list[registry.SelfCheckCase]:
    x = torch.randn(3, 1000, 7, device=device)
    return [
        registry.SelfCheckCase("float32 [3, 1000, 7]", (x,)),
        registry.SelfCheckCase("empty", (torch.empty(0, 5, device=device),)),
    ]


registry.register(
    registry.OperatorSpec(
        name=OP,
        family="smoke",
        api=add_one,
        reference=add_one_reference,
        native_entry_points=("add_one_forward",),
        self_check_cases=_self_check_cases,
        public=False,
    )
)
