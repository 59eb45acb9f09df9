"""Find and lazily load the native library; say exactly why it cannot be used.

The library (`mu_space/_lib/libmuspace_native.so`, built by build_utils.py) is loaded through
TVM-FFI on first use. `unavailable_reason(device)` answers "can native kernels run on this
device?" with None or a human-readable reason; answers are cached per device.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

LIB_DIR = Path(__file__).resolve().parent.parent / "_lib"
LIBRARY_FILE = "libmuspace_native.so"
BUILD_INFO_FILE = "build_info.json"
# The backend of a library built by scripts/build_host_emulation.py: its kernels run on CPU
# tensors (tests of the kernel source without a GPU).
HOST_EMULATION = "host-emulation"


class NativeUnavailable(RuntimeError):
    """Raised when a native function is requested but the library cannot be used."""


@dataclass
class NativeStatus:
    built: bool
    loaded: bool
    backend: str | None = None  # "cuda" | "musa" | HOST_EMULATION
    archs: list[str] = field(default_factory=list)
    tvm_ffi_built: str | None = None
    tvm_ffi_runtime: str | None = None
    path: str | None = None
    reason: str = ""  # why it is not loaded; empty when loaded
    build_info: dict = field(default_factory=dict)


_lock = threading.Lock()
_status: NativeStatus | None = None
_module = None
_functions: dict = {}
_device_reasons: dict = {}
_facts: tuple | None = None  # (the status it was read for, the facts)


def library_path() -> Path:
    override = os.environ.get("MUSPACE_LIBRARY")
    return Path(override) if override else LIB_DIR / LIBRARY_FILE


def _read_build_info(lib: Path) -> dict:
    try:
        return json.loads((lib.parent / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _load() -> NativeStatus:
    global _module
    lib = library_path()
    try:
        import tvm_ffi

        tvm_version = tvm_ffi.__version__
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return NativeStatus(False, False, reason=f"apache-tvm-ffi cannot be imported: {exc}")
    if not lib.exists():
        return NativeStatus(
            False,
            False,
            tvm_ffi_runtime=tvm_version,
            reason=(
                f"native library not built ({lib} is missing: the install found no GPU toolchain "
                "or MUSPACE_NATIVE=0; see `python build_utils.py --plan`)"
            ),
        )
    info = _read_build_info(lib)
    status = NativeStatus(
        True,
        False,
        backend=info.get("backend"),
        archs=info.get("archs", []),
        tvm_ffi_built=info.get("tvm_ffi_version"),
        tvm_ffi_runtime=tvm_version,
        path=str(lib),
        build_info=info,
    )
    try:
        _module = tvm_ffi.load_module(str(lib))
        status.backend = str(_module.build_backend())
    except Exception as exc:  # noqa: BLE001 - the loader's text is the most useful reason
        status.reason = f"native library failed to load: {type(exc).__name__}: {exc}"
        return status
    status.loaded = True
    return status


def status() -> NativeStatus:
    """Load the library once (thread-safe) and report what happened."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load()
    return _status


def function(name: str):
    """The TVM-FFI function `name` from the library (cached)."""
    fn = _functions.get(name)
    if fn is None:
        st = status()
        if not st.loaded:
            raise NativeUnavailable(st.reason)
        try:
            fn = _module[name]
        except Exception as exc:  # noqa: BLE001
            raise NativeUnavailable(f"native library has no function {name!r}: {exc}") from exc
        _functions[name] = fn
    return fn


def has_function(name: str) -> bool:
    try:
        function(name)
        return True
    except NativeUnavailable:
        return False


def build_facts() -> dict:
    """What the loaded library says about itself (`muspace_build_facts`): backend, warp_size,
    bf16, musa_arch, compiler and `limits` ({"<op>.<name>": int}, each declared next to its
    constant in the op's .mu). Empty when the library is not loaded or predates the facts."""
    global _facts
    st = status()
    if _facts is None or _facts[0] is not st:
        facts: dict = {}
        if st.loaded and has_function("muspace_build_facts"):
            facts = json.loads(str(function("muspace_build_facts")()))
        _facts = (st, facts)
    return _facts[1]


def limit(key: str) -> int:
    """A native limit ("bev_pool_v2.max_points") from the build facts. Only asked once the
    library runs on the tensors' device; a library without it is older than this operator."""
    try:
        return int(build_facts()["limits"][key])
    except KeyError:
        raise NativeUnavailable(
            f"the native library does not declare the limit {key!r} (rebuild it with "
            "`python build_utils.py --inplace`)"
        ) from None


def _arch_reason(backend: str, archs: list[str], device: torch.device) -> str | None:
    if backend != "cuda" or not archs:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    device_arch = f"{major}{minor}"
    sass = {a.rstrip("af") for a in archs}
    # PTX of the newest built arch is embedded, so newer devices can JIT it.
    if device_arch in sass or int(device_arch) > max(int(a) for a in sass):
        return None
    return (
        f"native library built for sm_{','.join(archs)}; {device} is sm_{device_arch} "
        "(rebuild with CUDA_ARCH=" + device_arch + ")"
    )


def _compute_reason(device: torch.device) -> str | None:
    st = status()
    if not st.loaded:
        return st.reason
    if st.backend == HOST_EMULATION:  # the kernels on the CPU (docs/host_emulation.md)
        if device.type == "cpu":
            return None
        return f"the native library is a host emulation; tensors are on {device.type}"
    if device.type not in ("cuda", "musa"):
        return f"tensors are on {device.type}; native kernels run on {st.backend} devices"
    if device.type != st.backend:
        return f"native library built for {st.backend}, tensors are on {device.type}"
    return _arch_reason(st.backend, st.archs, device)


def unavailable_reason(device: torch.device) -> str | None:
    """None when native kernels can run on `device`, else why not (cached per device)."""
    try:
        return _device_reasons[device]
    except KeyError:
        reason = _compute_reason(device)
        _device_reasons[device] = reason
        return reason


def reset() -> None:
    """Forget the loaded state (tests use this after pointing MUSPACE_LIBRARY elsewhere)."""
    global _status, _module, _facts
    with _lock:
        _status, _module, _facts = None, None, None
        _functions.clear()
        _device_reasons.clear()
