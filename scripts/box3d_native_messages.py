"""The validation of the 3D box entry points of a built library, on a machine without a GPU
(the method of scripts/native_messages.py: host arrays handed over as `cuda:0` DLPack tensors,
so every check before the first runtime call runs and nothing is launched).

    python scripts/box3d_native_messages.py build/check-box3d/libmuspace_ops.so [--out f.json]

For each entry point: the valid argument set must pass every check (it stops at the device
guard: "get current device failed" without a driver, or returns early for empty inputs), and each
argument replaced by a variant (other dtypes, a cpu tensor, other ndim / sizes, non-contiguous,
empty, None) must give a TypeError / ValueError, stop at the device guard, or (empty / benign
variants) return. Anything else is reported and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("native_messages", _HERE / "native_messages.py")
nm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nm)

DEVICE_STOP = "get current device failed"


def cases(lib) -> dict:
    f32, i32, i64 = np.float32, np.int32, np.int64
    B, M, T = 2, 5, 3
    pts, boxes = np.zeros((B, M, 3), f32), np.zeros((B, T, 7), f32)
    out = {}
    out["points_in_boxes_part_forward"] = nm._battery(
        lib, "points_in_boxes_part_forward", [pts, boxes, np.zeros((B, M), i32), 0]
    )
    out["points_in_boxes_all_forward"] = nm._battery(
        lib, "points_in_boxes_all_forward", [pts, boxes, np.zeros((B, M, T), i32), 0]
    )
    a, b = np.zeros((4, 7), f32), np.zeros((3, 7), f32)
    out["box3d_bev_pairwise"] = nm._battery(
        lib, "box3d_bev_pairwise", [a, b, np.zeros((4, 3), f32), 0, 1, False, False, 0]
    )
    out["box3d_bev_pairwise aligned xywhr"] = nm._battery(
        lib,
        "box3d_bev_pairwise",
        [np.zeros((4, 5), f32), np.zeros((4, 5), f32), np.zeros(4, f32), 1, 2, True, True, 0],
    )
    n = 70
    out["box3d_nms"] = nm._battery(
        lib,
        "box3d_nms",
        [
            np.zeros((n, 7), f32),
            np.arange(n, dtype=i64),
            np.zeros(int(lib["box3d_nms_workspace_ints"](n)), i64),
            np.zeros(n + 1, i64),
            0,
            1,
            0.5,
            0,
            0,
        ],
    )
    S, C = 4, 2
    out["roipoint_pool3d_forward"] = nm._battery(
        lib,
        "roipoint_pool3d_forward",
        [
            pts,
            np.zeros((B, M, C), f32),
            boxes,
            np.zeros((B, T, 1), i32),
            np.zeros((B, T, S), i32),
            np.zeros((B, T, S, 3 + C), f32),
            np.zeros((B, T), i32),
            0,
        ],
    )
    rois, p = np.zeros((3, 7), f32), np.zeros((6, 3), f32)
    cells = 3 * 2 * 2 * 2
    out["roiaware_pool3d_count"] = nm._battery(
        lib, "roiaware_pool3d_count", [rois, p, np.zeros(cells, i32), 2, 2, 2, 0]
    )
    out["roiaware_pool3d_fill"] = nm._battery(
        lib,
        "roiaware_pool3d_fill",
        [rois, p, np.zeros(cells, i64), np.zeros(cells, i32), np.zeros(5, i32), 2, 2, 2, 0],
    )
    out["roiaware_pool3d_sort"] = nm._battery(
        lib,
        "roiaware_pool3d_sort",
        [
            np.zeros(cells, i64),
            np.zeros(cells, i32),
            np.zeros(5, i32),
            np.zeros(cells + 1, i32),
            6,
            128,
            0,
        ],
    )
    feat = np.zeros((6, C), f32)
    slices = [np.zeros(cells, i64), np.zeros(cells, i32), np.zeros(5, i32)]
    out["roiaware_pool3d_pool"] = nm._battery(
        lib,
        "roiaware_pool3d_pool",
        [feat, *slices, np.zeros((cells, C), f32), np.zeros((cells, C), i32), 0, 0],
    )
    out["roiaware_pool3d_backward"] = nm._battery(
        lib,
        "roiaware_pool3d_backward",
        [
            np.zeros((cells, C), f32),
            feat,
            *slices,
            np.zeros((cells, C), i32),
            np.zeros((6, C), f32),
            0,
            0,
        ],
    )
    return out


def check(results: dict) -> list[str]:
    bad = []
    for entry, table in results.items():
        if DEVICE_STOP not in table["valid"] and table["valid"] != "OK":
            bad.append(f"{entry} valid: {table['valid']}")
        for case, msg in table.items():
            ok = (
                msg == "OK"
                or DEVICE_STOP in msg
                or msg.startswith(("TypeError", "ValueError"))
                or (msg.startswith("RuntimeError") and "None" in case)
            )
            if not ok:
                bad.append(f"{entry} {case}: {msg}")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("library")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import tvm_ffi

    results = cases(tvm_ffi.load_module(args.library))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    n = sum(len(v) for v in results.values())
    bad = check(results)
    for line in bad:
        print("UNEXPECTED", line)
    print(f"{n} argument sets over {len(results)} entry point batteries, {len(bad)} unexpected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
