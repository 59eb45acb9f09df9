"""The voxel entry points' validation on a machine without a GPU (scripts/native_messages.py's
method: host arrays handed over as cuda:0 DLPack tensors, so every check before the first
runtime call runs; a valid call stops at that call, "get current device failed").

    python scripts/voxel_native_messages.py LIB.so [--out messages.json]

Prints, per entry point, the message of the valid call and of each argument replaced by
variants (other dtypes, a cpu tensor, other ndim / sizes, non-contiguous, empty, None). Exit 1
when a valid call fails before the runtime (an argument-passing or check bug).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native_messages import _battery  # noqa: E402

RUNTIME = "get current device failed"


def collect(path: str) -> dict:
    import tvm_ffi

    lib = tvm_ffi.load_module(path)
    f32, i32, i64 = np.float32, np.int32, np.int64
    n, C, P, rows = 9, 5, 4, 6
    grid = [0.5, 0.5, 0.5, -2.0, -2.0, -1.0, 8, 8, 4]
    points = np.zeros((n, C), f32)
    one = tvm_ffi.Shape((0, n))
    two = tvm_ffi.Shape((0, 4, n))
    cases = {}
    cases["voxel_dynamic_forward"] = _battery(
        lib, "voxel_dynamic_forward", [points, np.zeros((n, 3), i32), *grid, one, 0]
    )
    cases["voxel_dynamic_forward (batch)"] = _battery(
        lib, "voxel_dynamic_forward", [points, np.zeros((n, 4), i32), *grid, two, 0]
    )
    cases["voxel_hard_keys"] = _battery(
        lib, "voxel_hard_keys", [points, np.zeros(n, i32), *grid, one, 0]
    )
    sort = [np.zeros(n, i32), np.zeros(n, i64)]  # the sorted keys and the permutation
    ws = np.zeros(int(lib["voxel_hard_workspace_ints"](n, 1, rows)), i32)
    hard = [points, *sort, ws, np.zeros((rows, P, C), f32), np.zeros((rows, 3), i32)]
    cases["voxel_hard_forward"] = _battery(
        lib,
        "voxel_hard_forward",
        [*hard, np.zeros(rows, i32), np.zeros(2, i64), *grid, P, rows, one, False, 0],
    )
    ws2 = np.zeros(int(lib["voxel_hard_workspace_ints"](n, 2, 2 * rows)), i32)
    hard2 = [points, *sort, ws2, np.zeros((2 * rows, P, C), f32), np.zeros((2 * rows, 4), i32)]
    cases["voxel_hard_forward (batch)"] = _battery(
        lib,
        "voxel_hard_forward",
        [*hard2, np.zeros(2 * rows, i32), np.zeros(3, i64), *grid, P, rows, two, False, 0],
    )
    wsh = np.zeros(int(lib["voxel_hashed_workspace_ints"](n, 1, rows, 8, 8, 4)), i32)
    hashed = [points, wsh, np.zeros((rows, P, C), f32), np.zeros((rows, 3), i32)]
    cases["voxel_hard_forward_hashed"] = _battery(
        lib,
        "voxel_hard_forward_hashed",
        [*hashed, np.zeros(rows, i32), np.zeros(2, i64), *grid, P, rows, one, False, 0],
    )
    wsh2 = np.zeros(int(lib["voxel_hashed_workspace_ints"](n, 2, 2 * rows, 8, 8, 4)), i32)
    hashed2 = [points, wsh2, np.zeros((2 * rows, P, C), f32), np.zeros((2 * rows, 4), i32)]
    cases["voxel_hard_forward_hashed (batch)"] = _battery(
        lib,
        "voxel_hard_forward_hashed",
        [*hashed2, np.zeros(2 * rows, i32), np.zeros(3, i64), *grid, P, rows, two, False, 0],
    )
    coors = np.zeros((n, 4), i32)
    wsg = np.zeros(int(lib["voxel_group_workspace_ints"](n)), i32)
    vec = np.zeros(n, i32)
    cases["voxel_group_keys"] = _battery(lib, "voxel_group_keys", [coors, wsg, vec, 0])
    cases["voxel_group_from_sorted"] = _battery(
        lib,
        "voxel_group_from_sorted",
        [coors, wsg, vec, np.zeros(n, i64), coors.copy(), vec.copy(), vec.copy(), vec.copy(),
         vec.copy(), np.zeros(3, i64), 0],
    )  # fmt: skip
    wsb = np.zeros(int(lib["voxel_group_bitmap_workspace_ints"](n)), i32)
    cases["voxel_group_bitmap"] = _battery(
        lib,
        "voxel_group_bitmap",
        [coors, wsb, coors.copy(), vec.copy(), vec.copy(), vec.copy(), vec.copy(), 0],
    )
    m = 3
    feats, order, starts = np.zeros((n, C), f32), np.zeros(n, i32), np.zeros(m, i32)
    cases["dynamic_scatter_bitmap_forward"] = _battery(
        lib,
        "dynamic_scatter_bitmap_forward",
        [coors, wsb.copy(), coors.copy(), vec.copy(), vec.copy(), vec.copy(), vec.copy(), feats,
         np.zeros((n, C), f32), 1, 0],
    )  # fmt: skip
    cases["segment_reduce_forward"] = _battery(
        lib,
        "segment_reduce_forward",
        [feats, order, starts, starts.copy(), np.zeros((m, C), f32), np.zeros((m, C), i32), 2, 0],
    )
    cases["segment_reduce_backward"] = _battery(
        lib,
        "segment_reduce_backward",
        [
            np.zeros((m, C), f32),
            feats,
            order,
            starts,
            starts.copy(),
            vec,
            np.zeros((m, C), i32),
            feats.copy(),
            2,
            0,
        ],
    )
    B, ny, nx = 2, 3, 4
    cmap = np.zeros(B * ny * nx, i32)
    canvas = np.zeros((B, C, ny, nx), f32)
    cases["pillar_scatter_forward"] = _battery(
        lib, "pillar_scatter_forward", [feats, coors, cmap, 0, canvas, 0]
    )
    cases["pillar_scatter_forward_tiled"] = _battery(
        lib, "pillar_scatter_forward_tiled", [feats, coors, canvas.copy(), 0]
    )
    cases["pillar_scatter_backward"] = _battery(
        lib, "pillar_scatter_backward", [canvas, coors, cmap, 0, feats.copy(), 0]
    )
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("library")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        import torch

        if torch.cuda.is_available():  # host arrays labelled cuda would reach real launches
            print("voxel_native_messages: a CUDA device is visible; run this without a GPU")
            return 2
    except ImportError:
        pass
    cases = collect(args.library)
    bad = [k for k, v in cases.items() if RUNTIME not in v["valid"]]
    for name, results in cases.items():
        print(f"== {name}")
        for label, message in results.items():
            print(f"  {label:24s} {message}")
    if args.out:
        args.out.write_text(json.dumps(cases, indent=1, sort_keys=True) + "\n")
    if bad:
        print(f"valid calls that failed before the runtime: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
