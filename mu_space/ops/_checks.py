"""Python-side argument checks shared by the operator modules; messages use the same wording as
csrc/ffi/checks.muh ("ranks_bev must be int32, got int64")."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_same_device(
    t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str = "feat"
) -> None:
    if t.device != ref.device:
        raise ValueError(
            f"{name} must be on {ref.device} (the device of {ref_name}), got {t.device}"
        )
