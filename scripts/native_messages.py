"""The error messages of a built library's entry points for a battery of invalid arguments, on a
machine without a GPU.

    python scripts/native_messages.py LIB.so --out after.json
    python scripts/native_messages.py --compare before.json after.json

Host (numpy) arrays are handed to TVM-FFI as `cuda:0` DLPack tensors, so every check before the
first runtime call runs; a call that passes them stops at that call ("get current device
failed" without a driver). Each argument of each entry point is replaced in turn by variants
(other dtypes, a cpu tensor, other ndim / sizes, non-contiguous, empty, None) and the resulting
exception (type: message) is recorded. Nothing is ever launched.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

KDL_CPU, KDL_CUDA, KDL_BFLOAT = 1, 2, 4


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_alive: list = []  # the arrays behind the tensors handed out


class _Relabelled:
    """A numpy array exported through DLPack with another device type (and dtype code)."""

    def __init__(self, array, device_type: int, code: int | None = None):
        self.array, self.device_type, self.code = array, device_type, code
        _alive.append(self)

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None, **_):
        capsule = self.array.__dlpack__()
        managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
        managed.dl_tensor.device.device_type = self.device_type
        if self.code is not None:
            managed.dl_tensor.dtype.code = self.code
        return capsule


def _tensor(array, device_type=KDL_CUDA, code=None):
    import tvm_ffi

    return tvm_ffi.from_dlpack(_Relabelled(array, device_type, code))


def _variants(a: np.ndarray):
    """(label, tensor) replacements for one array argument."""
    out = [(np.dtype(dt).name, _tensor(a.astype(dt))) for dt in _DTYPES if a.dtype != dt]
    out.append(("bfloat16", _tensor(np.zeros(a.shape, np.uint16), code=KDL_BFLOAT)))
    out.append(("cpu", _tensor(a, KDL_CPU)))
    out.append(("flat", _tensor(a.reshape(-1))))
    out.append(("unsqueezed", _tensor(a[None])))
    if a.ndim:
        out.append(("grow0", _tensor(np.concatenate([a, np.zeros((1,) + a.shape[1:], a.dtype)]))))
        if a.ndim >= 2:
            out.append(("growlast", _tensor(np.concatenate([a, a[..., :1]], -1))))
        out.append(("noncontiguous", _tensor(np.repeat(a, 2, axis=-1)[..., ::2])))
        out.append(("empty", _tensor(a[:0])))
    out.append(("None", None))
    return out


_DTYPES = [np.float32, np.float16, np.int32, np.int64, np.float64]


def _call(fn, args) -> str:
    try:
        fn(*args)
        return "OK"
    except Exception as e:  # the message is the result
        return f"{type(e).__name__}: {e}".split("\n")[0]


def _battery(lib, name: str, args: list) -> dict[str, str]:
    fn = lib[name]
    base = [_tensor(a) if isinstance(a, np.ndarray) else a for a in args]
    results = {"valid": _call(fn, base)}
    for i, a in enumerate(args):
        if not isinstance(a, np.ndarray):
            continue
        for label, t in _variants(a):
            results[f"arg{i}:{label}"] = _call(fn, base[:i] + [t] + base[i + 1 :])
    return results


def collect(path: str) -> dict[str, dict[str, str]]:
    import tvm_ffi

    lib = tvm_ffi.load_module(path)
    f32, i32, i64 = np.float32, np.int32, np.int64
    B, N, D, H, W, C, n = 1, 2, 3, 4, 5, 6, 7
    depth, feat = np.zeros((B, N, D, H, W), f32), np.zeros((B, N, H, W, C), f32)
    ranks, out = np.zeros(n, i32), np.zeros((B, C, 1, 4, 4), f32)
    cases = {}
    cases["bev_pool_v2_forward"] = _battery(
        lib, "bev_pool_v2_forward", [depth, feat, ranks, ranks, ranks, out, 0, 0]
    )
    cases["bev_pool_v2_backward"] = _battery(
        lib,
        "bev_pool_v2_backward",
        [
            out,
            depth,
            feat,
            ranks,
            ranks,
            ranks,
            np.zeros_like(depth),
            None,
            np.zeros_like(feat),
            0,
            0,
        ],
    )
    cases["bev_pool_v2_backward_feat_sorted"] = _battery(
        lib,
        "bev_pool_v2_backward_feat_sorted",
        [np.zeros((16, C), f32), depth, ranks, ranks, ranks, ranks, feat, 0, 0],
    )
    cases["bev_pool_v2_backward_frustum"] = _battery(
        lib,
        "bev_pool_v2_backward_frustum",
        [
            np.zeros((16, C), f32),
            depth,
            feat,
            ranks,
            ranks,
            ranks,
            np.zeros(depth.size, i32),
            np.zeros_like(depth),
            np.zeros_like(feat),
            np.zeros(1, i32),
            True,
            0,
        ],
    )
    coor, m = np.zeros((B, N, D, H, W, 3), f32), B * N * D * H * W
    ws = np.zeros(int(lib["bev_pool_sort_workspace_ints"](m, 64)) + 8, i32)
    per_point, intervals = np.zeros(m, i32), np.zeros(min(m, 64), i32)
    grid = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 4, 4, 4]
    cases["bev_pool_prepare_forward"] = _battery(
        lib,
        "bev_pool_prepare_forward",
        [coor, ws, per_point, per_point, per_point, intervals, intervals, *grid, 3, 0, 0, 0],
    )
    ws_sort = np.zeros(int(lib["bev_pool_sort_workspace_ints"](n, 10)) + 8, i32)
    cases["sort_by_cell_forward"] = _battery(
        lib,
        "sort_by_cell_forward",
        [ranks, ws_sort, ranks.copy(), ranks[:7].copy(), ranks[:7].copy(), 10, 3, 0, 0, 0],
    )
    bs, K, heads, Dh, L, P, Q = 1, 20, 2, 8, 2, 2, 3
    value = np.zeros((bs, K, heads, Dh), f32)
    shapes, starts = np.array([[2, 5], [2, 5]], i64), np.array([0, 10], i64)
    loc, attn = np.zeros((bs, Q, heads, L, P, 2), f32), np.zeros((bs, Q, heads, L, P), f32)
    o = np.zeros((bs, Q, heads * Dh), f32)
    msda = [value, shapes, starts, loc, attn]
    cases["msda_forward"] = _battery(
        lib, "multi_scale_deformable_attn_forward", [*msda, o, 0, 0, 0]
    )
    keys = np.zeros(bs * Q * heads * L * P, i64)
    grads = [np.zeros_like(value), np.zeros_like(loc), np.zeros_like(attn)]
    for mode in (0, 1, 2):
        cases[f"msda_backward_mode{mode}"] = _battery(
            lib,
            "multi_scale_deformable_attn_backward",
            [o, *msda, *grads, np.zeros(value.size, f32), keys, mode, 0, 0, 0],
        )
    cell_start = np.zeros(bs * heads * (3 * K + 2 * L) + 1, i64)
    cases["msda_backward_value_deterministic"] = _battery(
        lib,
        "multi_scale_deformable_attn_backward_value_deterministic",
        [o, *msda, keys, keys.copy(), cell_start, grads[0], 0, 0, 0],
    )
    x = np.zeros(5, f32)
    cases["add_one_forward"] = _battery(lib, "add_one_forward", [x, x.copy(), 0])
    return cases


def compare(before: dict, after: dict) -> int:
    changed = 0
    for entry in sorted(set(before) | set(after)):
        a, b = before.get(entry, {}), after.get(entry, {})
        for case in sorted(set(a) | set(b)):
            if a.get(case) != b.get(case):
                changed += 1
                print(f"{entry} {case}\n  before: {a.get(case)}\n  after:  {b.get(case)}")
    total = sum(len(v) for v in after.values())
    print(f"{changed} of {total} messages differ")
    return 1 if changed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("library", nargs="?")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if not args.library:
        parser.error("give a library or --compare")
    cases = collect(args.library)
    text = json.dumps(cases, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"{sum(len(v) for v in cases.values())} messages -> {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
