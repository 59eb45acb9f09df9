"""The sparse ops' native entry points against the built library, without a GPU (the method of
tests/ops/test_voxel_native_calls.py and scripts/native_messages.py): host arrays relabelled as
cuda:0 DLPack tensors reach the library's argument checks, which stop at the first runtime call
("get current device failed"). Checked here:
- every stage of mu_space/ops/_sparse_native.py hands the library arguments it accepts (order,
  dtypes, shapes, Shapes, workspace sizes): each call reaches the runtime;
- every entry point's validation: for each tensor argument in turn another dtype, a cpu tensor,
  another ndim / size, a non-contiguous view, None: a TypeError / ValueError that names the
  argument, or the runtime (a variant that is still valid), never a crash;
- scalar arguments out of range (mode, side, counts, batch_size, kernel volume) are ValueErrors.
Skips without a library that has the sparse entry points, and wherever CUDA is visible.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mu_space.ops import _opdef, _sparse, _sparse_native
from mu_space.runtime import native
from tests.native_calls import REACHED, ReachedRuntime, load_library, relabelling

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from native_messages import _tensor, _variants  # noqa: E402

ENTRY_POINTS = (
    *_sparse_native.RULEBOOK_ENTRY_POINTS,
    *_sparse_native.PAIR_ENTRY_POINTS,
    *_sparse_native.IM2COL_ENTRY_POINTS,
    "sparse_maxpool_forward",
    "sparse_maxpool_backward",
)
# scalar / Shape arguments that messages may name (a size relation reported on them)
DTYPE_OR_DEVICE = ("cpu", "float64", "float32", "float16", "bfloat16", "int32", "int64")
SCALARS = ("shape", "spatial_shape", "out_shape", "counts", "K = ")
# optional tensor arguments: None is a valid call (site order)
OPTIONAL = {("sparse_conv_implicit_gemm", "row_order"), ("sparse_conv_implicit_wgrad", "row_order")}


@pytest.fixture(scope="module")
def library():
    return load_library(ENTRY_POINTS)


@pytest.fixture
def calls(library, monkeypatch):
    """The entry points the Python layer called, each stopped at the runtime."""
    reached = relabelling(library, monkeypatch)
    monkeypatch.setattr(_sparse_native, "stream_handle", lambda t: 0)
    monkeypatch.setattr(native, "limit", lambda key: 2**31 - 1)
    return reached


def _info(args):
    from mu_space.ops.sparse_rulebook import _parse

    return _parse(*args)


RULEBOOK_CASES = {
    "subm k3": (3, 1, 1, 1, 0, True, False),
    "strided k3 s2": (3, 2, 1, 1, 0, False, False),
    "transposed k2 s2": (2, 2, 0, 1, 0, False, True),
}


@pytest.mark.parametrize("case", list(RULEBOOK_CASES))
def test_rulebook_stages_pass_arguments_the_library_accepts(calls, library, case):
    idx, shape = _sparse.tiny_indices("cpu")
    ks, s, p, d, op, subm, transposed = RULEBOOK_CASES[case]
    args = (idx, 2, shape, [ks] * 3, [s] * 3, [p] * 3, [d] * 3, [op] * 3, subm, transposed)
    info = _info(args)
    n, K = info["n"], info["K"]
    ws = torch.zeros(int(library["sparse_rulebook_workspace_ints"](K, n)), dtype=torch.int32)
    header = torch.zeros(4, dtype=torch.int32)
    c = _opdef.Checked(idx.device, torch.int32, None, info, "indices")
    with pytest.raises(ReachedRuntime):  # the op's first launch: SubM's one entry / the table
        _sparse_native.rulebook_native(c, *args)
    with pytest.raises(ReachedRuntime):
        _sparse_native.rulebook_subm(idx, info, True, 0)
    with pytest.raises(ReachedRuntime):
        _sparse_native.insert_table(idx, 2, shape, header, 0)
    cap = _sparse_native.table_capacity(n)
    table = (torch.zeros(cap, dtype=torch.int64), torch.zeros(cap, dtype=torch.int32))
    mode = 0 if subm else 2 if transposed else 1
    with pytest.raises(ReachedRuntime):
        _sparse_native.rulebook_pairs(idx, table, ws, info, mode, n, 0)
    first = "sparse_rulebook_subm" if subm else "sparse_hash_insert"
    want = [first, "sparse_rulebook_subm", "sparse_hash_insert", "sparse_rulebook_forward"]
    if not subm:
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_candidates(idx, info, 0)
        keys = torch.zeros(K * n, dtype=torch.int64)
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_unique(keys, keys.clone(), ws, header, 0)
        with pytest.raises(ReachedRuntime):
            _sparse_native.insert_table(keys[:100], 2, info["out_shape"], header, 0)
        m_table = _sparse_native.table_capacity(100)
        out_table = (
            torch.zeros(m_table, dtype=torch.int64),
            torch.zeros(m_table, dtype=torch.int32),
        )
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_pairs(idx, out_table, ws, info, mode, 100, 0)
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_decode(keys[:100], info, 0)
        want += [
            "sparse_rulebook_candidates", "sparse_rulebook_unique", "sparse_hash_insert",
            "sparse_rulebook_forward", "sparse_rulebook_decode",
        ]  # fmt: skip
        with pytest.raises(ReachedRuntime):
            bitmap = _sparse_native.rulebook_mark(idx, header, info, 0)
        out_shape = _sparse_native.native_shape(info["out_shape"])
        ints = int(library["sparse_rulebook_bitmap_workspace_ints"](2, out_shape))
        bitmap = torch.zeros(ints, dtype=torch.int32)
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_pairs_bitmap(idx, bitmap, ws, info, 100, 0)
        with pytest.raises(ReachedRuntime):
            _sparse_native.rulebook_decode_bitmap(bitmap, 100, info, 0)
        want += [
            "sparse_rulebook_mark", "sparse_rulebook_forward_bitmap",
            "sparse_rulebook_decode_bitmap",
        ]  # fmt: skip
    assert calls == want


@pytest.mark.parametrize("bitmap", [True, False])
def test_strided_rulebooks_over_valid_sites_skip_the_input_table(calls, monkeypatch, bitmap):
    """Input sites known valid for the grid need no table (it gives the flags only); the
    bitmap / sort choice follows use_bitmap (the tiny grid has < 64 cells a candidate)."""
    monkeypatch.setattr(_sparse_native, "BITMAP_ENABLED", bitmap)
    idx, shape = _sparse.tiny_indices("cpu")
    args = (idx, 2, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, False, False)
    info = _info(args)
    assert _sparse_native.use_bitmap(info) is bitmap
    _sparse_native.VALID_SITES.add(idx, (2, tuple(shape)))
    c = _opdef.Checked(idx.device, torch.int32, None, info, "indices")
    with pytest.raises(ReachedRuntime):
        _sparse_native.rulebook_native(c, *args)
    assert calls == ["sparse_rulebook_mark" if bitmap else "sparse_rulebook_candidates"]


def test_the_bitmap_is_taken_up_to_its_cells_per_candidate(calls):
    idx, shape = _sparse.tiny_indices("cpu")
    args = (idx, 1, shape, [3] * 3, [2] * 3, [1] * 3, [1] * 3, [0] * 3, False, False)
    info = _info(args)
    limit = _sparse_native.BITMAP_CELLS_PER_CANDIDATE * info["K"] * info["n"]
    assert _sparse_native.use_bitmap({**info, "out_shape": [limit, 1, 1]})
    assert not _sparse_native.use_bitmap({**info, "out_shape": [limit + 1, 1, 1]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_conv_and_pool_stages_pass_arguments_the_library_accepts(calls, dtype, inverse):
    sparse_conv = importlib.import_module("mu_space.ops.sparse_conv")
    sparse_maxpool = importlib.import_module("mu_space.ops.sparse_maxpool")
    f, w, p, n, m, inv = sparse_conv.sample_case("cpu", subm=False, inverse=inverse)
    f, w = f.to(dtype), w.to(dtype)
    c = sparse_conv._check(f, w, p, n, m, inv)
    with pytest.raises(ReachedRuntime):  # the first launch: sparse_conv_maps
        _sparse_native.conv_native(c, f, w, p, n, m, inv)
    g = torch.zeros(m, w.shape[2], dtype=dtype)
    with pytest.raises(ReachedRuntime):
        _sparse_native.conv_backward_native(
            c, g, f, w, p, n, m, inv, needs=(True, True), deterministic=True
        )
    K, _, P = p.shape
    n_in = f.shape[0]
    out_map = torch.zeros(m, K, dtype=torch.int32)
    with pytest.raises(ReachedRuntime):
        _sparse_native.neighbour_maps(p, n, n_in, m, inv, 0)
    with pytest.raises(ReachedRuntime):
        _sparse_native.launch_pairs_check(p, n, n_in, m, inv, 0)
    cols_dtypes = tuple(dict.fromkeys((dtype, torch.float32)))  # 16-bit GEMMs / float32 ones
    for cols_dtype in cols_dtypes:  # the forward's and the weight gradient's operand
        with pytest.raises(ReachedRuntime):
            _sparse_native.im2col(f, out_map[: m // 2], cols_dtype, 0)
    with pytest.raises(ReachedRuntime):  # the input gradient's operand
        _sparse_native.im2col(g, torch.zeros(n_in, K, dtype=torch.int32), dtype, 0)
    with pytest.raises(ReachedRuntime):  # the implicit GEMM's forward
        _sparse_native.implicit_gemm(f, out_map, w.contiguous(), dtype, 0)
    with pytest.raises(ReachedRuntime):  # and input gradient (weight [K, C_out, C_in])
        in_map = torch.zeros(n_in, K, dtype=torch.int32)
        _sparse_native.implicit_gemm(g, in_map, w.permute(0, 2, 1).contiguous(), torch.float32, 0)
    with pytest.raises(ReachedRuntime):  # and weight gradient
        _sparse_native.implicit_wgrad(f, out_map, g, 0)
    saved = _sparse_native.ROW_ORDER_MIN_ROWS, _sparse_native.ROW_ORDER_UNVERIFIED
    _sparse_native.ROW_ORDER_MIN_ROWS, _sparse_native.ROW_ORDER_UNVERIFIED = 0, ""
    try:
        with pytest.raises(ReachedRuntime):  # a map's row order
            _sparse_native.row_order(out_map, 0)
    finally:
        _sparse_native.ROW_ORDER_MIN_ROWS, _sparse_native.ROW_ORDER_UNVERIFIED = saved
    want = ["sparse_conv_maps"] * 3 + ["sparse_pairs_check"]
    want += ["sparse_conv_im2col"] * (len(cols_dtypes) + 1) + ["sparse_conv_implicit_gemm"] * 2
    want += ["sparse_conv_implicit_wgrad", "sparse_conv_row_order"]
    assert calls == want
    calls.clear()
    counts = n.clamp(0, P).tolist()
    total = sum(counts)
    header = torch.zeros(2 * K + 3, dtype=torch.int32)
    header[K : 2 * K + 1] = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int32)
    g_side, s_side = (1, 0) if inv else (0, 1)
    with pytest.raises(ReachedRuntime):
        _sparse_native.gather(f, p, header, total, g_side, 0)
    with pytest.raises(ReachedRuntime):
        _sparse_native.scatter(torch.zeros(total, w.shape[2]), p, counts,
                               torch.zeros(m, w.shape[2]), s_side, 0)  # fmt: skip
    assert calls == ["sparse_conv_gather", "sparse_conv_scatter"]
    if inverse:
        return
    calls.clear()
    c = sparse_maxpool._check(f, p, n, m)
    with pytest.raises(ReachedRuntime):
        _sparse_native.maxpool_native(c, f, p, n, m)
    with pytest.raises(ReachedRuntime):
        _sparse_native.maxpool_backward_native(
            c, torch.zeros(m, f.shape[1], dtype=dtype), f, p, n, m, needs=(True,),
            deterministic=False,
        )  # fmt: skip
    with pytest.raises(ReachedRuntime):
        _sparse_native.pool_forward(f, p, counts, m, 0)
    out = torch.zeros(m, f.shape[1], dtype=dtype)
    with pytest.raises(ReachedRuntime):
        _sparse_native.pool_backward(out, f, out, p, counts, 0)
    assert calls == ["sparse_pairs_check"] * 2 + [
        "sparse_maxpool_forward",
        "sparse_maxpool_backward",
    ]


def test_an_unverified_packed_table_runs_only_when_asked(monkeypatch):
    """While PACKED_TABLE_UNVERIFIED says why, `auto` passes use_packed = False to
    sparse_rulebook_subm; MUSPACE_TRY_UNVERIFIED=1 (the GPU sessions that verify it) or a
    verified mark ("") passes True."""
    monkeypatch.setattr(_sparse_native, "PACKED_TABLE_UNVERIFIED", "not run on a GPU yet")
    monkeypatch.delenv("MUSPACE_TRY_UNVERIFIED", raising=False)
    assert not _sparse_native.packed_table_allowed()
    monkeypatch.setenv("MUSPACE_TRY_UNVERIFIED", "1")
    assert _sparse_native.packed_table_allowed()
    monkeypatch.delenv("MUSPACE_TRY_UNVERIFIED")
    monkeypatch.setattr(_sparse_native, "PACKED_TABLE_UNVERIFIED", "")
    assert _sparse_native.packed_table_allowed()


# --------------------------------------------------------------------------- validation


def _shape(*v):
    return _sparse_native.native_shape(v)


def _base_cases(lib):
    """entry point -> (valid arguments with numpy arrays for tensors, their names)."""
    i32, i64, f32 = np.int32, np.int64, np.float32
    n, K, C, P, m = 6, 27, 8, 6, 5
    idx = np.zeros((n, 4), i32)
    ws = np.zeros(int(lib["sparse_rulebook_workspace_ints"](K, n)), i32)
    subm_ws = np.zeros(int(lib["sparse_rulebook_subm_workspace_ints"](K, n)), i32)
    cap = 16
    tk, tv, header = np.zeros(cap, i64), np.zeros(cap, i32), np.zeros(4, i32)
    geo = [_shape(9, 9, 9), _shape(5, 5, 5), _shape(3, 3, 3), _shape(2, 2, 2), _shape(1, 1, 1),
           _shape(1, 1, 1)]  # fmt: skip
    pairs, num = np.zeros((K, 2, P), i32), np.zeros(K, i32)
    counts = _shape(*([0] * K))
    feats = np.zeros((n, C), f32)
    bitmap = np.zeros(int(lib["sparse_rulebook_bitmap_workspace_ints"](2, _shape(5, 5, 5))), i32)
    return {
        "sparse_hash_insert": (
            [idx, tk, tv, header, 2, _shape(9, 9, 9), 0],
            ["source", "table_keys", "table_vals", "header"],
        ),
        "sparse_rulebook_candidates": (
            [idx, np.zeros(K * n, i64), 2, *geo, False, 0],
            ["indices", "cand"],
        ),
        "sparse_rulebook_unique": (
            [np.zeros(K * n, i64), np.zeros(K * n, i64), ws, header, 0],
            ["sorted_keys", "uniq", "workspace", "header"],
        ),
        "sparse_rulebook_subm": (
            [
                idx,
                subm_ws,
                np.zeros((K, 2, n), i32),
                num,
                idx.copy(),
                2,
                _shape(9, 9, 9),
                _shape(3, 3, 3),
                _shape(1, 1, 1),
                _shape(1, 1, 1),
                True,
                True,
                True,
                0,
            ],
            ["indices", "workspace", "pairs", "pair_num", "out_indices"],
        ),
        "sparse_rulebook_forward": (
            [idx, tk, tv, ws, np.zeros((K, 2, n), i32), num, 2, *geo, 1, 5, 0],
            ["indices", "table_keys", "table_vals", "workspace", "pairs", "pair_num"],
        ),
        "sparse_rulebook_decode": (
            [np.zeros(m, i64), np.zeros((m, 4), i32), 2, _shape(5, 5, 5), 0],
            ["keys", "out_indices"],
        ),
        "sparse_rulebook_mark": (
            [idx, bitmap, header, 2, *geo, False, 0],
            ["indices", "bitmap", "header"],
        ),
        "sparse_rulebook_forward_bitmap": (
            [idx, bitmap, ws, np.zeros((K, 2, n), i32), num, 2, *geo, 1, 5, 0],
            ["indices", "bitmap", "workspace", "pairs", "pair_num"],
        ),
        "sparse_rulebook_decode_bitmap": (
            [bitmap, np.zeros((m, 4), i32), 2, _shape(5, 5, 5), 0],
            ["bitmap", "out_indices"],
        ),
        "sparse_pairs_check": (
            [pairs, num, np.zeros(2 * K + 3, i32), n, m, False, 0],
            ["indice_pairs", "indice_pair_num", "header"],
        ),
        "sparse_conv_gather": (
            [feats, pairs, np.zeros(K + 1, i32), np.zeros((4, C), f32), 0, 0],
            ["src", "indice_pairs", "pair_starts", "gathered"],
        ),
        "sparse_conv_scatter": (
            [
                np.zeros((3, C), f32),
                pairs,
                _shape(3, *([0] * (K - 1))),
                np.zeros((m, C), f32),
                1,
                0,
            ],
            ["products", "indice_pairs", "acc"],
        ),
        "sparse_conv_maps": (
            [pairs, num, np.zeros((m, K), i32), np.zeros((n, K), i32), np.zeros(2, i32), False, 0],
            ["indice_pairs", "indice_pair_num", "out_map", "in_map", "flags"],
        ),
        "sparse_conv_im2col": (
            [feats, np.zeros((m, K), i32), np.zeros((m, K * C), f32), 0],
            ["src", "map", "cols"],
        ),
        "sparse_conv_implicit_gemm": (
            [
                feats,
                np.zeros((m, K), i32),
                np.zeros((K, C, 3), f32),
                np.zeros((m, 3), f32),
                np.zeros(m, i32),
                0,
            ],
            ["src", "map", "weight", "out", "row_order"],
        ),
        "sparse_conv_implicit_wgrad": (
            [
                feats,
                np.zeros((m, K), i32),
                np.zeros((m, 3), f32),
                np.zeros((2, K, C, 3), f32),
                np.zeros((K, C, 3), f32),
                np.zeros(m, i32),
                0,
            ],
            ["src", "map", "grad", "partial", "grad_weight", "row_order"],
        ),
        "sparse_conv_row_order": ([np.zeros((m, K), i32), np.zeros(m, i32), 0], ["map", "order"]),
        "sparse_maxpool_forward": (
            [feats, pairs, counts, np.zeros((m, C), f32), np.zeros(m, i32), 0],
            ["features", "indice_pairs", "out", "hit"],
        ),
        "sparse_maxpool_backward": (
            [np.zeros((m, C), f32), feats, np.zeros((m, C), f32), pairs, counts, feats.copy(), 0],
            ["grad_out", "features", "out", "indice_pairs", "acc"],
        ),
    }


def _outcome(fn, args):
    try:
        fn(*args)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc).split("\n")[0]
    except RuntimeError as exc:
        if REACHED in str(exc):
            return "runtime", ""
        return "RuntimeError", str(exc).split("\n")[0]
    return "returned", ""


def test_every_entry_point_checks_every_tensor_argument(library):
    names_seen, wrong = set(), []
    for name, (args, names) in _base_cases(library).items():
        fn = library[name]
        base = [_tensor(a) if isinstance(a, np.ndarray) else a for a in args]
        assert _outcome(fn, base) == ("runtime", ""), f"{name}: valid arguments rejected"
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]
        assert len(tensor_pos) == len(names), name
        for i, arg_name in zip(tensor_pos, names):
            for label, t in _variants(args[i]):
                kind, msg = _outcome(fn, base[:i] + [t] + base[i + 1 :])
                where = f"{name} {arg_name} {label}"
                if kind == "returned" and label == "empty":
                    continue  # an empty tensor that is still consistent: nothing to launch
                if kind not in ("TypeError", "ValueError", "runtime"):
                    wrong.append(f"{where}: {kind} {msg}")
                elif label == "None" and (name, arg_name) in OPTIONAL:
                    if kind != "runtime":
                        wrong.append(f"{where}: rejected ({kind} {msg})")
                elif label in ("cpu", "float64", "None") and kind == "runtime":
                    wrong.append(f"{where}: accepted")
                elif kind == "runtime" or label == "None":  # None: TVM-FFI's type error
                    pass
                elif label in DTYPE_OR_DEVICE and arg_name not in msg:
                    wrong.append(f"{where}: the message does not name {arg_name}: {msg!r}")
                elif not any(a in msg for a in (*names, *SCALARS)):
                    # a size relation is reported on the argument checked second
                    wrong.append(f"{where}: the message names no argument: {msg!r}")
                else:
                    names_seen.add(name)
    assert not wrong, "\n".join(wrong)
    assert names_seen == set(_base_cases(library))


def test_scalar_arguments_out_of_range_are_value_errors(library):
    cases = _base_cases(library)

    def with_arg(name, pos, value):
        args = [_tensor(a) if isinstance(a, np.ndarray) else a for a in cases[name][0]]
        args[pos] = value
        return _outcome(library[name], args)

    assert with_arg("sparse_rulebook_forward", 13, 3)[0] == "ValueError"  # mode
    assert with_arg("sparse_rulebook_forward", 6, 0)[0] == "ValueError"  # batch_size
    assert with_arg("sparse_rulebook_forward", 9, _shape(64, 64, 2))[0] == "ValueError"  # K > 4096
    assert with_arg("sparse_rulebook_forward", 9, _shape(3, 3))[0] == "ValueError"  # ndim
    assert with_arg("sparse_rulebook_forward", 14, 9)[0] == "ValueError"  # table < 2 * n_rows
    big = _shape(2**31 - 1, 2**31 - 1, 2**31 - 1)
    assert "key range" in with_arg("sparse_rulebook_candidates", 3, big)[1]
    assert with_arg("sparse_rulebook_forward_bitmap", 12, 0)[0] == "ValueError"  # mode: no SubM
    assert with_arg("sparse_rulebook_mark", 3, 0)[0] == "ValueError"  # batch_size
    # out_shape beyond the bitmap's int32 words (2**36 cells) but inside the key range
    kind, msg = with_arg("sparse_rulebook_mark", 5, _shape(2**12, 2**12, 2**12 + 1))
    assert kind == "ValueError" and "bitmap limit" in msg, msg
    with pytest.raises(ValueError, match="bitmap limit"):
        library["sparse_rulebook_bitmap_workspace_ints"](16, _shape(2**12, 2**12, 2**8 + 1))
    with pytest.raises(ValueError, match="out_shape"):
        library["sparse_rulebook_bitmap_workspace_ints"](1, _shape(0, 5, 5))
    with pytest.raises(ValueError, match="out_shape"):
        library["sparse_rulebook_bitmap_workspace_ints"](1, _shape(*([2] * 5)))
    # words | prefix | scan sums: 2 * 5 * 5 * 5 = 250 cells -> 8 words -> 8 + 8 + 4
    assert int(library["sparse_rulebook_bitmap_workspace_ints"](2, _shape(5, 5, 5))) == 20
    assert with_arg("sparse_hash_insert", 1, _tensor(np.zeros(12, np.int64)))[0] == "ValueError"
    assert with_arg("sparse_conv_gather", 4, 2)[0] == "ValueError"  # side
    assert with_arg("sparse_conv_scatter", 2, _shape(*([1] * 27)))[0] == "ValueError"  # rows
    assert with_arg("sparse_conv_scatter", 2, _shape(*([0] * 26 + [7])))[0] == "ValueError"
    assert with_arg("sparse_maxpool_forward", 2, _shape(1))[0] == "ValueError"  # K counts
    assert with_arg("sparse_pairs_check", 3, -1)[0] == "ValueError"
    # the implicit GEMM's grid: at most 65535 blocks of 64 output columns (K = 1, C_in = 1, one
    # row: 17 MB per operand)
    wide = 65535 * 64 + 1
    f32 = np.float32
    args = [np.zeros((3, 1), f32), np.zeros((1, 1), np.int32), np.zeros((1, 1, wide), f32),
            np.zeros((1, wide), f32)]  # fmt: skip
    kind, msg = _outcome(library["sparse_conv_implicit_gemm"], [*map(_tensor, args), None, 0])
    assert kind == "ValueError" and "weight" in msg, msg
    with pytest.raises(ValueError):
        library["sparse_rulebook_workspace_ints"](4097, 10)
    with pytest.raises(ValueError):
        library["sparse_rulebook_workspace_ints"](27, 2**31 // 27 + 1)
    assert int(library["sparse_rulebook_workspace_ints"](27, 0)) >= 4
    assert with_arg("sparse_rulebook_subm", 5, 0)[0] == "ValueError"  # batch_size
    assert with_arg("sparse_rulebook_subm", 7, _shape(64, 64, 2))[0] == "ValueError"  # K > 4096
    assert with_arg("sparse_rulebook_subm", 6, _shape(9, 9))[0] == "ValueError"  # ndim
    # the workspace (int32): the table (16 slots for n = 6: int64 keys, int32 vals), the header
    # [4], the pairs' out_row [K n] | tile counts [K] | tile prefixes [K], each rounded up to 4
    pairs_ws = 164 + 28 + 28  # 27 * 6 = 162 -> 164; 27 -> 28
    assert int(library["sparse_rulebook_subm_workspace_ints"](27, 6)) == 3 * 16 + 4 + pairs_ws
    with pytest.raises(ValueError):
        library["sparse_rulebook_subm_workspace_ints"](4097, 10)
    with pytest.raises(ValueError):
        library["sparse_rulebook_subm_workspace_ints"](27, 2**31 // 27 + 1)


def test_limits_are_build_facts(library):
    facts = native.build_facts() if native.status().loaded else None
    if facts is None:
        pytest.skip("the library does not load as mu_space's native library here")
    limits = facts["limits"]
    assert limits["sparse_rulebook.max_candidates"] == 2**31 - 2
    assert limits["sparse_rulebook.max_bitmap_words"] == 2**31 - 2
    assert limits["sparse_conv.max_pairs"] == limits["sparse_maxpool.max_pairs"] == 2**31 - 1
    assert math.prod([27, 2**31 // 27]) <= limits["sparse_conv.max_pairs"]
