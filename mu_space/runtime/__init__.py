"""Runtime layer: native library loading, backend dispatch, operator registry, streams."""

from mu_space.runtime import kernel_dispatch, native, registry
from mu_space.runtime.device import stream_handle
from mu_space.runtime.kernel_dispatch import DispatchError

__all__ = ["DispatchError", "kernel_dispatch", "native", "registry", "stream_handle"]
