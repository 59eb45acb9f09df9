"""Stream handles of the caller, passed explicitly to every native launch.

TVM-FFI sets the current stream for CUDA tensors but not for MUSA's kDLExtDev tensors, so all
native entry points take the stream as an integer argument: one rule for both backends.
"""

from __future__ import annotations

import torch


def _cuda_stream(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def _musa_stream(index: int) -> int:  # torch_musa registers the `musa` device type
    return torch.musa.current_stream(index).musa_stream


def _no_stream(index: int) -> int:  # CPU tensors: the host emulation's launches are synchronous
    return 0


_STREAM_GETTERS = {"cuda": _cuda_stream, "musa": _musa_stream, "cpu": _no_stream}


def stream_handle(tensor: torch.Tensor) -> int:
    """Raw handle of the current stream on `tensor`'s device (torch's, not the device default)."""
    return _STREAM_GETTERS[tensor.device.type](tensor.get_device())


def stream_capturing(device: torch.device) -> bool | None:
    """Whether the current stream on `device` is capturing a graph: True / False, or None where
    the device's torch cannot say (a torch_musa without `is_current_stream_capturing`)."""
    if device.type == "cuda":
        return torch.cuda.is_current_stream_capturing()
    if device.type == "musa":
        probe = getattr(torch.musa, "is_current_stream_capturing", None)
        return bool(probe()) if probe is not None else None
    return False
