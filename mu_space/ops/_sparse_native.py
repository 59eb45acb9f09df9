"""Native paths of the sparse-convolution family (csrc/sparse/, docs/operators/sparse_conv.md
"Native kernels"): sparse_rulebook, sparse_conv (forward and backward) and sparse_maxpool
(forward and backward). Outputs and workspaces are allocated here; every entry point runs on
the caller's stream (`stream_handle`).

Rule book (`rulebook_native`), the reference's layout and order element by element:
  1. `sparse_hash_insert`: a GPU hash table (open addressing, power-of-two capacity >= 2N,
     linear probing bounded by the capacity) of the input keys; rows outside the grid and
     repeated sites set header flags; a repeated key keeps its first row.
  SubM (a rule book already built for the same live sites and layer geometry is returned as
  is: SUBM_RULEBOOKS), one entry point, `sparse_rulebook_subm` (`rulebook_subm`):
  1. the table (as above), the insert also copying the rows into out_indices;
  2. the pairs (`sparse_rulebook_forward`'s mode 0 kernels): for every (offset k, input j) the
     reached site looked up in the input table -> output row or -1; the pairs of offset k are
     the found j in ascending order, then -1, and the K counts (three launches: lookups with a
     count per tile of 2048 inputs, a scan of each offset's tile counts, the emit at tile
     prefix + in-tile rank with the -1 padding). Where the offsets come in mirror pairs
     (2 padding = (kernel_size - 1) dilation on every axis: every spconv / mmcv SubM layer),
     only offsets k < K - 1 - k are looked up, each pair (j -> i) also written as (i -> j) of
     offset K - 1 - k, the centre pairing every row with itself (SUBM_MIRROR);
  3. one host synchronisation: the header (flags), read back after the insert and waited for
     once the pairs' kernels are queued -> the reference's error when a flag is set; none where
     the indices are a native rule book's output sites for this grid (VALID_SITES).
  strided / transposed (step 1 only where the input sites are not VALID_SITES of this grid:
  the table is needed for its flags alone), over an output grid of at most
  BITMAP_CELLS_PER_CANDIDATE cells per (k, j) candidate (every CenterPoint / SECOND layer):
  2. `sparse_rulebook_mark`: a bitmap of batch x out_shape, a bit set per reached cell, the
     words' popcounts and their exclusive scan (the rank of a set bit = its output row: the
     ascending linearised (b, z, y, x) of the reference's output order) and M;
  3. one host synchronisation: the header (flags and M); 4. `sparse_rulebook_forward_bitmap`
     (mode 1 / 2): the rank as the lookup, the same per-offset compaction;
     5. `sparse_rulebook_decode_bitmap`: the set bits -> out_indices.
  Larger output grids (where the bitmap would move more bytes than the sort):
  2. `sparse_rulebook_candidates`: the key each (k, j) reaches ([K N] int64, LLONG_MAX where
     none); 3. torch.sort of the candidates (values only: the one step done by torch, between
     two launches, no synchronisation); 4. `sparse_rulebook_unique`: run starts + scan -> the
     sorted unique keys and M; 5. one host synchronisation: the header (flags and M);
  6. `sparse_hash_insert` of the M output keys (capacity >= 2M, row = rank);
  7. `sparse_rulebook_forward` (mode 1 / 2): lookups in the output table, the same per-offset
     compaction; 8. `sparse_rulebook_decode`.
  Both give the same rule book element by element (tests/ops/test_sparse_native.py).

Convolution, im2col path (`conv_native`, `conv_backward_native`, the default):
`sparse_conv_maps` builds the rule book's neighbour maps once (cached per rule book like the
check, NEIGHBOUR_MAPS): out_map [M, K] (the input row feeding output o through offset k, -1 if
none) and in_map [N, K] (the output row input i feeds through k). Forward: `sparse_conv_im2col`
gathers cols = features[out_map] -> [rows, K C_in] (zeros for -1) and ONE torch.mm(cols,
weight.view(K C_in, C_out)) per chunk of output rows (IM2COL_CHUNK_ELEMENTS). Backward: grad_w
= sum over chunks of cols^T @ grad_out (cols recomputed), grad_x = grad_out[in_map] [N, K C_out]
@ weight^T [K C_out, C_in]. For the dtypes of IMPLICIT_GEMM_DTYPES the forward and grad_x run
`sparse_conv_implicit_gemm` and grad_w `sparse_conv_implicit_wgrad` instead: the same sums with
the gathered rows staged in shared memory (no cols buffer, no torch.mm: one entry point per
product); float16 / bfloat16 take sparse_conv_implicit_gemm where it runs on the tensor cores
(TENSOR_CORE_DTYPES). No atomics anywhere (deterministic by construction); float16 /
bfloat16 gather and multiply in 16 bits with float32 accumulation and output where torch.mm
has out_dtype for that device (else float32 operands). A rule book that breaks the rule-book
invariant (an (o, k) or (i, k) slot twice: the maps cannot hold it, and the per-offset
scatter's plain adds would race on it) or has a bad row takes the reference on the same device
(which sums repeated pairs; for a bad row it raises its error).
Per-offset path: `sparse_pairs_check` (counts, starts and row checks; its header is the op's
one host synchronisation, shared with the maps' flags), `sparse_conv_gather` (the rows of one
side of every offset into one float32 buffer, one launch), torch.mm per offset in float32
(cuBLAS / muBLAS; the reference's shapes and operands), `sparse_conv_scatter` (per offset, in
offset order, plain float32 adds: the rows of an offset are distinct), one cast at the end.
Backward: grad_features gathers grad_out at the scatter side, mm with weight[k]^T, scatters to
the gather side; grad_weight[k] = gathered_features_k^T @ gathered_grad_k.

Max pool (`maxpool_native`, `maxpool_backward_native`): the same check, then one kernel launch
per offset (in order) for the maximum, and for the gradient into a float32 buffer.

Sizes beyond the kernels' int32 limits (K * N candidates, K * P pairs) take the reference on
the same device; a flagged error re-runs the reference, which raises its own message.
"""

from __future__ import annotations

import functools
import os

import torch

from mu_space.ops import _opdef
from mu_space.ops._tensor_cache import TensorKeyedCache
from mu_space.runtime import native
from mu_space.runtime.device import stream_handle

# Verified on an H200 (2026-12-01): memcheck and racecheck clean over tests/ops/
# test_sparse_native.py (csrc/sparse of 0c53cb5, unchanged since), the GPU suite at 33d2aee.
UNVERIFIED = ""
# sparse_conv's im2col path (sparse_conv_maps, sparse_conv_im2col), new since then: the GPU suite
# and memcheck clean over test_sparse_native.py (87 tests, the im2col ones included) on the H200,
# 2026-12-01 (csrc/sparse of e056a11); its kernels use no shared memory, which is all racecheck
# examines. The implicit GEMMs (sparse_conv_implicit_gemm / _wgrad, 2026-12-02): the GPU suite,
# memcheck over their 84 tests, racecheck over their entry-point tests and 21 conv cases (H200,
# runs_2026-12-02_session10 d3 / d4; docs/operators/sparse_conv.md). Their per-tile offset lists
# and row orders (2026-12-03): the GPU suite, memcheck over 45 and racecheck over 37 of their
# tests (runs_2026-12-03_session12 d4, sparse_conv_row_order then with 4096-row windows), and the
# 2048-row build of sparse_conv_row_order the same way (runs_2026-12-03_session13 d5).
CONV_UNVERIFIED = ""
RULEBOOK_ENTRY_POINTS = (
    "sparse_rulebook_subm",
    "sparse_rulebook_subm_workspace_ints",
    "sparse_rulebook_forward",
    "sparse_rulebook_workspace_ints",
    "sparse_hash_insert",
    "sparse_rulebook_candidates",
    "sparse_rulebook_unique",
    "sparse_rulebook_decode",
    "sparse_rulebook_bitmap_workspace_ints",
    "sparse_rulebook_mark",
    "sparse_rulebook_forward_bitmap",
    "sparse_rulebook_decode_bitmap",
)
PAIR_ENTRY_POINTS = ("sparse_pairs_check", "sparse_conv_gather", "sparse_conv_scatter")
IM2COL_ENTRY_POINTS = (
    "sparse_conv_maps",
    "sparse_conv_im2col",
    "sparse_conv_implicit_gemm",
    "sparse_conv_implicit_wgrad",
    "sparse_conv_row_order",
)

# Elements of one im2col operand (cols [rows, K C]): 2^26 = 256 MiB in float32, 128 MiB in 16
# bits. CenterPoint-0.075's layers (118k rows x K C_in <= 27 x 16, fewer rows as C grows) fit
# one chunk; a 1M-row C = 256 layer (27 GB unchunked) takes 104 chunks of ~9.7k rows, each
# still a GEMM large enough to fill the GPU. Tests lower it to force the chunked path.
IM2COL_CHUNK_ELEMENTS = 1 << 26
# Profiling only: MUSPACE_SPARSE_CONV_IM2COL=0 runs every conv on the per-offset path (A/B).
IM2COL_ENABLED = os.environ.get("MUSPACE_SPARSE_CONV_IM2COL", "1") != "0"
# The dtypes whose convolutions run sparse_conv_implicit_gemm (forward, input gradient) and, up
# to WGRAD_MAX_COLUMNS output channels, sparse_conv_implicit_wgrad (weight gradient): the
# gathered rows multiplied in shared memory, no cols buffer, no torch.mm, instead of im2col +
# torch.mm. On the H200 (2026-12-02, CenterPoint encoder) the float32 forward's GPU time went
# 10.8 -> 9.8 ms and its wall time 13.9 -> 12.6 ms; the weight gradient's kernel took 2.5 ms for
# the 32-column layers and 12.5 ms for the wider ones, where im2col + torch.mm is faster.
# float16 / bfloat16 take the implicit GEMM (forward, input gradient) only where its kernel
# multiplies them on the tensor cores (TENSOR_CORE_DTYPES, tensor_core_gemm: CUDA sm_80+): its
# SIMT kernel took 10.0 ms against im2col + cuBLAS's 4.9 ms; their weight gradient stays on
# im2col + torch.mm (cuBLAS's tensor cores).
# MUSPACE_SPARSE_CONV_GEMM=implicit | im2col overrides it for every dtype and width (A/B timing).
IMPLICIT_GEMM_DTYPES = frozenset({torch.float32})
TENSOR_CORE_DTYPES = frozenset({torch.float16, torch.bfloat16})
WGRAD_MAX_COLUMNS = 16
GEMM_CHOICE = os.environ.get("MUSPACE_SPARSE_CONV_GEMM", "auto")
# float32 forwards of C_in * C_out >= PER_OFFSET_MIN_CHANNEL_PRODUCT over at least
# PER_OFFSET_MIN_ROWS output rows take the per-offset path (gather -> torch.mm -> scatter-add
# over the pairs only): the SIMT implicit GEMM falls behind as channels grow. H200, SubM k3
# forward at 118561 voxels (runs_2026-12-03_session13 d7, us, implicit / per-offset): 16 -> 16
# 675 / 1129, 32 -> 32 890 / 1669, 64 -> 64 1554 / 1700, 128 -> 128 4119 / 1907, 256 -> 256
# 14359 / 4068 (d8: 3850 / 2134 and 14052 / 4241; spconv 2.3.8 in d6: 1456 and 4018). The
# CenterPoint encoder's 128 -> 128 layers (14142 rows) gained nothing that way (d8, its float32
# forward 11.0 ms with them per offset against 9.4 without, forward + backward 35.5 against 28.9
# in the same call), so fewer rows keep the implicit GEMM. The backward keeps its choice (not
# measured wide). MUSPACE_SPARSE_CONV_PER_OFFSET_CHANNELS=0: never (A/B timing).
PER_OFFSET_MIN_CHANNEL_PRODUCT = int(
    os.environ.get("MUSPACE_SPARSE_CONV_PER_OFFSET_CHANNELS", 128 * 128)
)
PER_OFFSET_MIN_ROWS = 65536
# The implicit GEMMs take a strided rule book's input-side map (ordered_map: the input
# gradient's in_map, an inverse conv's out_map) in the order of its rows' masks (row_order:
# sorted within windows of 2048 rows, sparse_conv_row_order), so a tile steps through fewer
# offsets: an input of a stride-2 k3 conv reaches at most 8 of the 27, in one of 8 parity
# patterns, and rows in site order mix them all. On the CenterPoint frame (118561 voxels;
# reference rule books, counted on the CPU, 2026-12-03) the (offset, 64-row tile) steps of those
# maps fell 2.4-4.9x (2.5-5.2x with the 4096-row windows the H200 ran), within 16% of the pair
# count. The other maps keep site order: their steps fell 1.1-1.9x by mask, but on the H200
# (D3 of session 12, no spconv in the process) the SubM 16 -> 16 forward took 649 us in mask
# order against 476 in site order (gathered rows and written rows no longer near each other)
# and the strided forward 616 against 574, while the inverse forward fell 236 -> 75 us and the
# strided backward 501 -> 340. Maps of fewer than ROW_ORDER_MIN_ROWS rows (a few tiles) and of
# K > 32 offsets (no 32-bit mask) keep site order too. MUSPACE_SPARSE_CONV_ROW_ORDER=0 keeps
# site order everywhere (A/B timing).
ROW_ORDER_MIN_ROWS = 4096
# SubM layers of C_in x C_out >= SUBM_ORDER_MIN_CHANNEL_PRODUCT take their out_map in mask order
# too (forward and weight gradient): there the float32 implicit GEMM's multiplies, not the
# gathers' locality, take the time (session 19, H100, SubM k3 at 118561 voxels: ours / spconv
# 0.83x at 16 -> 16 but 1.16x / 1.62x at 32 -> 32 / 64 -> 64, site order), and a 64-row tile in
# site order steps through nearly all 27 offsets where its rows have ~6-9 neighbours each.
# Measured beside spconv (same H100 run, two rounds): 64 -> 64 1147 / 1202 us in site order,
# 980 / 1094 with the order (spconv 795-898); 16 / 32 channels within the run-to-run spread.
# MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS sets it; 0 (never) stays the default until the
# encoder, whose wide layers hold fewer rows, has been timed with it.
SUBM_ORDER_MIN_CHANNEL_PRODUCT = int(os.environ.get("MUSPACE_SPARSE_CONV_SUBM_ORDER_CHANNELS", 0))
ROW_ORDER_WINDOW = 2048  # sparse_conv_row_order's kOrderWindow (rows sorted together)
ROW_ORDER_ENABLED = os.environ.get("MUSPACE_SPARSE_CONV_ROW_ORDER", "1") != "0"
# Why `auto` would keep site order (row_order_allowed); "" once verified: the 2048-row windows
# (16 KB of static shared memory, inside MUSA's < 28 KB) passed the GPU suite, memcheck and
# racecheck on the H200 (runs_2026-12-03_session13 d5).
ROW_ORDER_UNVERIFIED = ""

# Strided / transposed rule books whose output grid (batch x out_shape) has at most this many
# cells per (offset, input) candidate take the bitmap (its words <= 2 K N int32: zeroing,
# popcounting and scanning them moves no more bytes than the K N int64 candidates the sort path
# writes before sorting them). On the H200 (2026-12-02) the sort path's torch.sort took ~250 us
# of host time per strided layer of the CenterPoint encoder, whose grids hold 3-4 cells a
# candidate. MUSPACE_SPARSE_RULEBOOK_BITMAP=0 takes the sort path everywhere (A/B timing).
BITMAP_CELLS_PER_CANDIDATE = 64
BITMAP_ENABLED = os.environ.get("MUSPACE_SPARSE_RULEBOOK_BITMAP", "1") != "0"
# SubM rule books of mirrored offsets look up half of them (sparse_rulebook_subm's use_mirror;
# the same rule book: tests/ops/test_sparse_native.py). MUSPACE_SPARSE_RULEBOOK_MIRROR=0 looks
# up every offset (A/B timing).
SUBM_MIRROR = os.environ.get("MUSPACE_SPARSE_RULEBOOK_MIRROR", "1") != "0"
# sparse_rulebook_subm's PackedTable (key and row in one 64-bit slot: one init launch instead of
# three fills, one compare-and-swap per insert, one load per probe) over grids of fewer than 2^31
# cells. Verified on the H200 (2026-12-05: GPU suite, memcheck, racecheck) and faster there: the
# SubM rule book alone 104.2 / 103.9 us against the int64-key table's 112.3 / 112.8 (two rounds).
PACKED_TABLE_UNVERIFIED = ""


def packed_table_allowed() -> bool:
    """Whether sparse_rulebook_subm may take the PackedTable (PACKED_TABLE_UNVERIFIED)."""
    return _opdef.step_allowed(PACKED_TABLE_UNVERIFIED)


# header of sparse_hash_insert / sparse_rulebook_unique / sparse_rulebook_mark
_BAD, _DUP, _COUNT, _FULL = range(4)
_KEY_NONE = 2**63 - 1


@functools.cache
def _shape_type():
    import tvm_ffi  # imported on first use: the reference paths never need it

    return tvm_ffi.Shape


def native_shape(values):
    """A TVM-FFI Shape (an int64 array passed by value) of `values`, one object per distinct
    value tuple (Shapes are immutable): building one took ~13 us of host time under cProfile on
    the H200 machine, 84 of them per CenterPoint encoder forward (D2 of session 12)."""
    return _cached_shape(tuple(int(v) for v in values))


@functools.lru_cache(maxsize=1024)
def _cached_shape(values: tuple):
    return _shape_type()(values)


def table_capacity(n: int) -> int:
    """The hash table's slots for n keys: the smallest power of two >= max(2, 2n)."""
    return 1 << max(1, (2 * n - 1).bit_length())


def _workspace(n: int, dtype, device) -> torch.Tensor:
    """A buffer the kernels write before they read it: never filled (not even by deterministic
    mode's fill of uninitialised memory). ~110 per CenterPoint encoder forward, so the context
    manager is entered only where deterministic mode is on."""
    if not torch.are_deterministic_algorithms_enabled():
        return torch.empty(n, dtype=dtype, device=device)
    with _opdef.no_fill():
        return torch.empty(n, dtype=dtype, device=device)


# --------------------------------------------------------------------------- the rule book


def _rulebook_reference(args):
    from mu_space.ops.sparse_rulebook import sparse_rulebook_reference

    return sparse_rulebook_reference(*args)


def insert_table(source, batch_size, shape, header, st):
    """A hash table of `source` (indices [N, ndim + 1] int32 or keys [M] int64) -> (keys, vals)."""
    cap = table_capacity(source.shape[0])
    keys = _workspace(cap, torch.int64, source.device)
    vals = _workspace(cap, torch.int32, source.device)
    native.function("sparse_hash_insert")(
        source, keys, vals, header, batch_size, native_shape(shape), st
    )
    return keys, vals


def _geometry(info):
    return _geometry_shapes(
        tuple(info[k] for k in ("spatial", "out_shape", "ksize", "stride", "padding", "dilation"))
    )


@functools.lru_cache(maxsize=256)
def _geometry_shapes(values: tuple):
    return tuple(native_shape(v) for v in values)


def rulebook_pairs(indices, table, workspace, info, mode: int, n_rows: int, st):
    """sparse_rulebook_forward -> (indice_pairs [K, 2, N], indice_pair_num [K])."""
    n, K = info["n"], info["K"]
    pairs = _opdef.new_output(indices, (K, 2, n), torch.int32)
    num = _opdef.new_output(indices, (K,), torch.int32)
    native.function("sparse_rulebook_forward")(
        indices, *table, workspace, pairs, num, info["batch_size"], *_geometry(info), mode,
        n_rows, st,
    )  # fmt: skip
    return pairs, num


def rulebook_subm(indices, info, read_flags: bool, st):
    """sparse_rulebook_subm -> (indice_pairs [K, 2, N], indice_pair_num [K], out_indices (a copy
    of indices), flags: -1 where not read, else bit 0 a row outside the grid, bit 1 a repeated
    site, bit 2 a full table)."""
    n, K = info["n"], info["K"]
    ws = _workspace(subm_workspace_ints(K, n), torch.int32, indices.device)
    pairs = _opdef.new_output(indices, (K, 2, n), torch.int32)
    num = _opdef.new_output(indices, (K,), torch.int32)
    out_indices = _opdef.new_output(indices)
    spatial, _, ksize, _, padding, dilation = _geometry(info)
    flags = native.function("sparse_rulebook_subm")(
        indices, ws, pairs, num, out_indices, info["batch_size"], spatial, ksize, padding,
        dilation, read_flags, SUBM_MIRROR, packed_table_allowed(), st,
    )  # fmt: skip
    return pairs, num, out_indices, int(flags)


@functools.lru_cache(maxsize=64)
def subm_workspace_ints(K: int, n: int) -> int:
    return int(native.function("sparse_rulebook_subm_workspace_ints")(K, n))


def use_bitmap(info) -> bool:
    """Whether a strided / transposed rule book takes the bitmap (BITMAP_CELLS_PER_CANDIDATE)."""
    cells = info["batch_size"]
    for size in info["out_shape"]:
        cells *= size
    words = (cells + 31) // 32
    return (
        BITMAP_ENABLED
        and cells <= BITMAP_CELLS_PER_CANDIDATE * info["K"] * info["n"]
        and words <= native.limit("sparse_rulebook.max_bitmap_words")
    )


def rulebook_mark(indices, header, info, st):
    """sparse_rulebook_mark -> the bitmap workspace (words, prefix, scan sums); header[2] = M."""
    out_shape = native_shape(info["out_shape"])
    ints = native.function("sparse_rulebook_bitmap_workspace_ints")(info["batch_size"], out_shape)
    bitmap = _workspace(int(ints), torch.int32, indices.device)
    native.function("sparse_rulebook_mark")(
        indices, bitmap, header, info["batch_size"], *_geometry(info), info["transposed"], st
    )
    return bitmap


def rulebook_pairs_bitmap(indices, bitmap, workspace, info, m: int, st):
    """sparse_rulebook_forward_bitmap -> (indice_pairs [K, 2, N], indice_pair_num [K])."""
    n, K = info["n"], info["K"]
    pairs = _opdef.new_output(indices, (K, 2, n), torch.int32)
    num = _opdef.new_output(indices, (K,), torch.int32)
    mode = 2 if info["transposed"] else 1
    native.function("sparse_rulebook_forward_bitmap")(
        indices, bitmap, workspace, pairs, num, info["batch_size"], *_geometry(info), mode, m, st
    )
    return pairs, num


def rulebook_decode_bitmap(bitmap, m: int, info, st):
    out = _opdef.new_output(bitmap, (m, info["ndim"] + 1), torch.int32)
    native.function("sparse_rulebook_decode_bitmap")(
        bitmap, out, info["batch_size"], native_shape(info["out_shape"]), st
    )
    return out


def rulebook_candidates(indices, info, st):
    cand = _workspace(info["K"] * info["n"], torch.int64, indices.device)
    spatial, out_shape, ksize, stride, padding, dilation = _geometry(info)
    native.function("sparse_rulebook_candidates")(
        indices, cand, info["batch_size"], spatial, out_shape, ksize, stride, padding, dilation,
        info["transposed"], st,
    )  # fmt: skip
    return cand


def rulebook_unique(sorted_keys, uniq, workspace, header, st):
    native.function("sparse_rulebook_unique")(sorted_keys, uniq, workspace, header, st)


def rulebook_decode(keys, info, st):
    out = _opdef.new_output(keys, (keys.shape[0], info["ndim"] + 1), torch.int32)
    native.function("sparse_rulebook_decode")(
        keys, out, info["batch_size"], native_shape(info["out_shape"]), st
    )
    return out


@torch.no_grad()
def rulebook_native(c, *args):
    """The native sparse_rulebook (module docstring) -> RuleBook."""
    from mu_space.ops.sparse_rulebook import RuleBook

    info = c.info
    indices = args[0]
    n, K = info["n"], info["K"]
    if n == 0 or K * n > native.limit("sparse_rulebook.max_candidates"):
        return _rulebook_reference(args)  # nothing to launch / beyond the int32 candidates
    grid = (info["batch_size"], tuple(info["spatial"]))
    layer = (*grid, *(tuple(info[k]) for k in ("ksize", "padding", "dilation")))
    if info["subm"] and (same := SUBM_RULEBOOKS.get(args[0], layer)) is not None:
        return same
    indices = indices.contiguous()
    st = stream_handle(indices)
    if info["subm"]:
        # no flag can be set over sites already checked for this grid (they depend on the
        # sites and the grid only; a table of capacity >= 2n is never full): no read, no wait
        read = not VALID_SITES.holds(args[0], grid)
        pairs, num, out_indices, flags = rulebook_subm(indices, info, read, st)
        if flags > 0:
            return _rulebook_reference(args)  # raises the reference's message
        if read:
            VALID_SITES.add(args[0], grid)  # checked: the SubM layers after it read nothing
        # valid by construction for a SubM layer over these n rows (n in, n out, not inverse);
        # the counts stay on the device (the per-offset path reads them once if it runs)
        CHECKED_PAIRS.put(pairs, num, n, n, False, (None, None, False))
        VALID_SITES.add(out_indices, grid)
        rulebook = RuleBook(out_indices, pairs, num)
        SUBM_RULEBOOKS.put(args[0], layer, rulebook)
        return rulebook
    dev = indices.device
    header = torch.zeros(4, dtype=torch.int32, device=dev)
    ws = _workspace(int(native.function("sparse_rulebook_workspace_ints")(K, n)), torch.int32, dev)
    if not VALID_SITES.holds(args[0], grid):
        insert_table(indices, info["batch_size"], info["spatial"], header, st)  # for its flags
    out_grid = (info["batch_size"], tuple(info["out_shape"]))
    if use_bitmap(info):
        bitmap = rulebook_mark(indices, header, info, st)
        bad, dup, m, full = header.tolist()  # the one host synchronisation (flags and M)
        if bad or dup or full:
            return _rulebook_reference(args)
        VALID_SITES.add(args[0], grid)
        pairs, num = rulebook_pairs_bitmap(indices, bitmap, ws, info, m, st)
        CHECKED_PAIRS.put(pairs, num, n, m, False, (None, None, False))
        out_indices = rulebook_decode_bitmap(bitmap, m, info, st)
        VALID_SITES.add(out_indices, out_grid)  # the set bits of distinct cells of out_shape
        return RuleBook(out_indices, pairs, num)
    cand = rulebook_candidates(indices, info, st)
    sorted_keys = torch.sort(cand).values  # ascending; LLONG_MAX (no output) last
    uniq = cand  # the candidates are dead once sorted: their buffer takes the unique keys
    rulebook_unique(sorted_keys, uniq, ws, header, st)
    del sorted_keys
    bad, dup, m, full = header.tolist()  # the one host synchronisation (flags and M)
    if bad or dup or full:
        return _rulebook_reference(args)
    VALID_SITES.add(args[0], grid)
    out_keys = uniq[:m]
    out_header = torch.zeros(4, dtype=torch.int32, device=dev)
    out_table = insert_table(out_keys, info["batch_size"], info["out_shape"], out_header, st)
    pairs, num = rulebook_pairs(indices, out_table, ws, info, 2 if info["transposed"] else 1, m, st)
    # valid by construction over (n in, m out, not inverse); counts unknown on the host
    CHECKED_PAIRS.put(pairs, num, n, m, False, (None, None, False))
    out_indices = rulebook_decode(out_keys, info, st)
    # distinct sites inside the output grid by construction (sorted unique keys of out_shape)
    VALID_SITES.add(out_indices, out_grid)
    return RuleBook(out_indices, pairs, num)


class _ValidSites(TensorKeyedCache):
    """Index tensors known to hold distinct sites inside a (batch_size, spatial shape) grid:
    sites whose SubM flags were read clean (and the rule book's copy of them), and a strided /
    transposed rule book's decoded unique keys. A SubM rule book over such
    indices needs no flag read, so a SparseEncoder synchronises once for its input sites and
    once per strided layer (M), not once per layer: on the H200 (2026-12-01) the CenterPoint
    encoder's forward took 24.5 ms of wall time for 13.0 ms of kernels with 21 such reads per
    forward. An entry holds while its tensor lives and is not modified in place (version)."""

    MAX_ENTRIES = 256

    def add(self, indices: torch.Tensor, grid) -> None:
        self.store((indices,), grid, True)

    def holds(self, indices: torch.Tensor, grid) -> bool:
        return self.lookup((indices,), grid) is not None


VALID_SITES = _ValidSites()


class _SubMRuleBooks(TensorKeyedCache):
    """The native SubM rule books of live index tensors, by (batch_size, spatial shape,
    kernel size, padding, dilation): a SubM rule book is a function of its sites and those
    alone, so a second SubM layer over the same sites (mmdet3d's SparseBasicBlock convs carry no
    indice_key, and each would build its own: 17 of the CenterPoint encoder's 21 rule books)
    gets the first one's tensors instead of a rebuild. An entry holds while the index tensor
    lives and neither it nor the rule book's tensors were modified in place (version counters).
    Memory: a rule book lives as long as its sites do (autograd keeps both for the backward)."""

    MAX_ENTRIES = 16

    def put(self, indices, layer, rulebook) -> None:
        self.store((indices,), layer, rulebook, also=tuple(rulebook))

    def get(self, indices, layer):
        return self.lookup((indices,), layer)


SUBM_RULEBOOKS = _SubMRuleBooks()


# --------------------------------------------------------------------------- pairs


class _CheckedPairs(TensorKeyedCache):
    """The checks of rule books already seen: one host synchronisation per rule book, not one per
    layer call. A SparseEncoder calls the convolutions of one rule book several times (SubM
    layers sharing an indice_key, then each one's backward): on the H200 (2026-12-01) the
    CenterPoint encoder spent 31.8 ms per forward against 14.1 ms of device time, its GPU idle
    at every layer's sync while Python set up the next. An entry is keyed by the identity of
    the pairs and counts tensors and the sizes it was checked against, and holds only while
    both tensors live and neither was modified in place (their version counters)."""

    def get(self, pairs, num, n_in, n_out, inverse):
        return self.lookup((pairs, num), (int(n_in), int(n_out), bool(inverse)))

    def put(self, pairs, num, n_in, n_out, inverse, value) -> None:
        self.store((pairs, num), (int(n_in), int(n_out), bool(inverse)), value)


CHECKED_PAIRS = _CheckedPairs()
# (out_map, in_map) of a rule book, or False where the reference must take it (a repeated slot
# or a bad row)
NEIGHBOUR_MAPS = _CheckedPairs()


def check_pairs(indice_pairs, indice_pair_num, n_in: int, n_out: int, inverse: bool, st):
    """sparse_pairs_check -> (header [2K + 3] int32 on the device, host counts [K], bad): the
    one host synchronisation of the conv / pool paths, once per rule book (CHECKED_PAIRS; a
    rule book built by rulebook_native comes with its counts, so none at all)."""
    K = indice_pairs.shape[0]
    known = CHECKED_PAIRS.get(indice_pairs, indice_pair_num, n_in, n_out, inverse)
    if known is not None and known[0] is not None:
        return known
    header = launch_pairs_check(indice_pairs, indice_pair_num, n_in, n_out, inverse, st)
    if known is not None and known[1] is not None:  # valid by construction: the starts only
        result = (header, known[1], False)
    else:
        result = (header, *pairs_facts(header.tolist(), K))
    CHECKED_PAIRS.put(indice_pairs, indice_pair_num, n_in, n_out, inverse, result)
    return result


def launch_pairs_check(indice_pairs, indice_pair_num, n_in, n_out, inverse, st):
    header = _workspace(2 * indice_pairs.shape[0] + 3, torch.int32, indice_pairs.device)
    native.function("sparse_pairs_check")(
        indice_pairs, indice_pair_num, header, n_in, n_out, inverse, st
    )
    return header


def pairs_facts(values, K: int):
    """(host counts [K], bad) from the values of sparse_pairs_check's header."""
    return values[:K], bool(values[2 * K + 1] or values[2 * K + 2])


def neighbour_maps(indice_pairs, indice_pair_num, n_in: int, n_out: int, inverse: bool, st):
    """The rule book's (out_map [n_out, K], in_map [n_in, K]) int32 (sparse_conv_maps), or None
    where only the reference may take it (a repeated slot, which the per-offset scatter's plain
    adds would race on; a bad row, whose error the reference raises). Cached per rule book
    (NEIGHBOUR_MAPS). The host synchronisation is check_pairs' one, shared with the maps'
    flags; a rule book built by rulebook_native is valid by construction (no repeated slot
    either: an offset's reach is injective over distinct sites), so none."""
    key = (indice_pairs, indice_pair_num, n_in, n_out, inverse)
    maps = NEIGHBOUR_MAPS.get(*key)
    if maps is not None:
        return maps or None
    known = CHECKED_PAIRS.get(*key)
    if known is not None and known[2]:
        NEIGHBOUR_MAPS.put(*key, False)
        return None
    K, dev = indice_pairs.shape[0], indice_pairs.device
    out_map = _workspace((n_out, K), torch.int32, dev)
    in_map = _workspace((n_in, K), torch.int32, dev)
    flags = _workspace(2, torch.int32, dev)  # a repeated slot | a bad row (zeroed by the kernel)
    native.function("sparse_conv_maps")(
        indice_pairs, indice_pair_num, out_map, in_map, flags, inverse, st
    )
    if known is not None and known[0] is None:
        usable = True
    elif known is not None:  # checked without maps before (a max pool's rule book): its flags
        usable = not any(flags.tolist())
    else:
        header = launch_pairs_check(indice_pairs, indice_pair_num, n_in, n_out, inverse, st)
        values = torch.cat((header, flags)).tolist()
        counts, bad = pairs_facts(values, K)
        CHECKED_PAIRS.put(*key, (header, counts, bad))
        usable = not (bad or values[-2] or values[-1])
    NEIGHBOUR_MAPS.put(*key, (out_map, in_map) if usable else False)
    return (out_map, in_map) if usable else None


def gather(src, indice_pairs, header, total: int, side: int, st):
    """float32 [total, C]: src's rows at `side` of every offset's pairs, offset after offset."""
    K = indice_pairs.shape[0]
    out = _workspace((total, src.shape[1]), torch.float32, src.device)
    native.function("sparse_conv_gather")(src, indice_pairs, header[K : 2 * K + 1], out, side, st)
    return out


def scatter(products, indice_pairs, counts, acc, side: int, st):
    native.function("sparse_conv_scatter")(
        products, indice_pairs, native_shape(counts), acc, side, st
    )


def _per_offset(counts):
    start = 0
    for k, count in enumerate(counts):
        if count:
            yield k, slice(start, start + count)
        start += count


def _too_many_pairs(indice_pairs, op: str) -> bool:
    K, _, P = indice_pairs.shape
    return K * P > native.limit(f"{op}.max_pairs")


# --------------------------------------------------------------------------- conv


@functools.cache
def _mm_out_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32, out=...) runs for `dtype` operands on
    this device type (torch >= 2.8 on CUDA: 16-bit operands, float32 accumulation and output)."""
    try:
        a = torch.zeros((1, 1), dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32, out=torch.empty((1, 1), device=device_type))
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def gemm_dtype(features) -> torch.dtype:
    """The im2col operands' dtype: features' own where the GEMM accumulates it in float32."""
    if features.dtype != torch.float32 and _mm_out_float32(features.device.type, features.dtype):
        return features.dtype
    return torch.float32


def mm_float32(a, b, out) -> None:
    """out (float32) = a @ b with float32 accumulation."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=out)


def row_chunks(rows: int, row_elements: int):
    """(start, stop) blocks of `rows` whose im2col operand stays within IM2COL_CHUNK_ELEMENTS."""
    step = max(1, IM2COL_CHUNK_ELEMENTS // max(1, row_elements))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def im2col(src, neighbour_map, dtype, st):
    """cols [rows, K C] of `dtype` (src's or float32): src's rows at neighbour_map, 0 for -1."""
    rows, K = neighbour_map.shape
    cols = _workspace((rows, K * src.shape[1]), dtype, src.device)
    native.function("sparse_conv_im2col")(src, neighbour_map, cols, st)
    return cols


@functools.cache
def _tensor_core_gemm(device_type: str, index: int) -> bool:
    if device_type != "cuda" or not native.build_facts().get("limits", {}).get(
        "sparse_conv.tensor_core_gemm"
    ):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 8


def tensor_core_gemm(device: torch.device) -> bool:
    """Whether sparse_conv_implicit_gemm multiplies 16-bit operands on `device`'s tensor cores
    (the build fact sparse_conv.tensor_core_gemm: CUDA builds; sm_80 or newer, as the entry
    point itself checks)."""
    return _tensor_core_gemm(device.type, device.index or 0)


def use_implicit_gemm(features: torch.Tensor) -> bool:
    """Whether the forward / input gradient of `features` take sparse_conv_implicit_gemm."""
    if GEMM_CHOICE == "auto":
        dtype = features.dtype
        return dtype in IMPLICIT_GEMM_DTYPES or (
            dtype in TENSOR_CORE_DTYPES and tensor_core_gemm(features.device)
        )
    return GEMM_CHOICE == "implicit"


def use_per_offset_forward(dtype: torch.dtype, c_in: int, c_out: int, rows: int) -> bool:
    """Whether a forward of `rows` output rows takes the per-offset path although the im2col
    paths could (PER_OFFSET_MIN_CHANNEL_PRODUCT, PER_OFFSET_MIN_ROWS)."""
    return (
        GEMM_CHOICE == "auto"
        and dtype == torch.float32
        and 0 < PER_OFFSET_MIN_CHANNEL_PRODUCT <= c_in * c_out
        and rows >= PER_OFFSET_MIN_ROWS
    )


def use_implicit_wgrad(dtype: torch.dtype, c_out: int) -> bool:
    """Whether the weight gradient takes sparse_conv_implicit_wgrad."""
    if GEMM_CHOICE == "auto":
        return dtype in IMPLICIT_GEMM_DTYPES and c_out <= WGRAD_MAX_COLUMNS
    return GEMM_CHOICE == "implicit"


class _RowOrders(TensorKeyedCache):
    """row_order's answers by neighbour map (maps live as long as their rule book's
    NEIGHBOUR_MAPS entry): computed once per map, used by its forward and backward GEMMs."""

    def get(self, neighbour_map):
        return self.lookup((neighbour_map,), None)

    def put(self, neighbour_map, order) -> None:
        self.store((neighbour_map,), None, order)


ROW_ORDERS = _RowOrders()


def row_order_allowed() -> bool:
    """Whether row_order may order maps: enabled, and verified (ROW_ORDER_UNVERIFIED) or
    MUSPACE_TRY_UNVERIFIED=1."""
    if not ROW_ORDER_ENABLED:
        return False
    return _opdef.step_allowed(ROW_ORDER_UNVERIFIED)


def row_order(neighbour_map, st):
    """int32 [rows]: neighbour_map's rows sorted by their masks (bit k: a neighbour at offset k)
    within windows of ROW_ORDER_WINDOW rows, ties by row (sparse_conv_row_order), the order the
    implicit GEMMs take them in; None for site order (row_order_allowed, ROW_ORDER_MIN_ROWS,
    K > 32). Cached per map (ROW_ORDERS)."""
    rows, K = neighbour_map.shape
    if not row_order_allowed() or rows < ROW_ORDER_MIN_ROWS or K > 32:
        return None
    order = ROW_ORDERS.get(neighbour_map)
    if order is None:
        order = _opdef.new_output(neighbour_map, (rows,), torch.int32)
        native.function("sparse_conv_row_order")(neighbour_map, order, st)
        ROW_ORDERS.put(neighbour_map, order)
    return order


def ordered_map(n_in: int, n_out: int, inverse: bool, c_in: int, c_out: int) -> int | None:
    """The neighbour map (0: out_map, 1: in_map) whose rows the implicit GEMMs take in mask
    order: a strided rule book's input side (n_in != n_out; in_map, or out_map for an inverse
    conv); for a SubM one its out_map from SUBM_ORDER_MIN_CHANNEL_PRODUCT on, else None (site
    order: ROW_ORDER_MIN_ROWS' comment)."""
    if n_in == n_out:
        return 0 if 0 < SUBM_ORDER_MIN_CHANNEL_PRODUCT <= c_in * c_out else None
    return 0 if inverse else 1


def implicit_gemm(src, neighbour_map, weight, out_dtype, st, ordered: bool = False):
    """[rows, C_out] of out_dtype (src's or float32) = sum_k src[neighbour_map[:, k]] @ weight[k]
    (weight [K, C_a, C_b] of src's dtype), float32 accumulation, 0 for -1 entries; `ordered`:
    the tiles take the rows in row_order's order (the same sums)."""
    out = _opdef.new_output(src, (neighbour_map.shape[0], weight.shape[2]), out_dtype)
    order = row_order(neighbour_map, st) if ordered else None
    native.function("sparse_conv_implicit_gemm")(src, neighbour_map, weight, out, order, st)
    return out


# sparse_conv_implicit_wgrad's row splits: about this many blocks in all (8 per multiprocessor
# of a 132-SM H200), each at least WGRAD_MIN_ROWS rows (16 of its 32-row steps).
WGRAD_TARGET_BLOCKS = 1024
WGRAD_MIN_ROWS = 512


def wgrad_splits(rows: int, K: int, c_in: int, c_out: int) -> int:
    blocks = -(-K // 4) * -(-c_in // 16) * -(-c_out // 64)
    return max(1, min(-(-rows // WGRAD_MIN_ROWS), -(-WGRAD_TARGET_BLOCKS // blocks), 65535))


def implicit_wgrad(src, neighbour_map, grad, st, ordered: bool = False):
    """float32 [K, C_in, C_out] = sum over rows r of src[neighbour_map[r, k]]^T grad[r] (grad of
    src's dtype), deterministic (per-split sums added in split order; `ordered`: rows in
    row_order's order)."""
    rows, K = neighbour_map.shape
    c_in, c_out = src.shape[1], grad.shape[1]
    partial = _workspace((wgrad_splits(rows, K, c_in, c_out), K, c_in, c_out), torch.float32,
                         src.device)  # fmt: skip
    out = _opdef.new_output(src, (K, c_in, c_out), torch.float32)
    order = row_order(neighbour_map, st) if ordered else None
    native.function("sparse_conv_implicit_wgrad")(src, neighbour_map, grad, partial, out, order, st)
    return out


def im2col_forward(feats, weight, out_map, st):
    """float32 [M, C_out] = sum_k feats[out_map[:, k]] @ weight[k], chunk by chunk."""
    m, K = out_map.shape
    c_in, c_out = weight.shape[1:]
    dtype = gemm_dtype(feats)
    w = weight.to(dtype).reshape(K * c_in, c_out)
    out = _workspace((m, c_out), torch.float32, feats.device)
    for start, stop in row_chunks(m, K * c_in):
        mm_float32(im2col(feats, out_map[start:stop], dtype, st), w, out[start:stop])
    return out


def im2col_backward(grad_out, feats, weight, maps, needs, st, ordered=None):
    """(grad_x [N, C_in] (float32, or the features' dtype from the implicit GEMM) or None,
    grad_w float32 [K, C_in, C_out] or None); `ordered`: ordered_map's answer."""
    out_map, in_map = maps
    K, c_in, c_out = weight.shape
    dtype = gemm_dtype(feats)
    g = grad_out.to(dtype).contiguous()
    grad_x = grad_w = None
    implicit = use_implicit_gemm(feats)
    implicit_w = use_implicit_wgrad(feats.dtype, c_out)
    if implicit or implicit_w:  # the implicit GEMMs multiply in the features' dtype
        g_same = g if g.dtype == feats.dtype else grad_out.to(feats.dtype).contiguous()
    if needs[1] and implicit_w:
        grad_w = implicit_wgrad(feats, out_map, g_same, st, ordered == 0)
    elif needs[1]:
        grad_w = _workspace((K * c_in, c_out), torch.float32, feats.device)
        for start, stop in row_chunks(out_map.shape[0], K * c_in):
            cols_t = im2col(feats, out_map[start:stop], dtype, st).t()
            if start == 0:
                mm_float32(cols_t, g[start:stop], grad_w)
            else:  # chunks summed in order: deterministic
                part = _workspace((K * c_in, c_out), torch.float32, feats.device)
                mm_float32(cols_t, g[start:stop], part)
                grad_w += part
        grad_w = grad_w.view(K, c_in, c_out)
    if needs[0] and implicit:
        w_t = weight.to(feats.dtype).permute(0, 2, 1).contiguous()  # [K, C_out, C_in]
        grad_x = implicit_gemm(g_same, in_map, w_t, feats.dtype, st, ordered == 1)  # no cast
    elif needs[0]:
        w_t = weight.to(dtype).permute(0, 2, 1).reshape(K * c_out, c_in)
        grad_x = _workspace((in_map.shape[0], c_in), torch.float32, feats.device)
        for start, stop in row_chunks(in_map.shape[0], K * c_out):
            mm_float32(im2col(g, in_map[start:stop], dtype, st), w_t, grad_x[start:stop])
    return grad_x, grad_w


def _conv_prologue(c, features, indice_pairs, indice_pair_num, op: str = "sparse_conv"):
    n, m, K, c_in, c_out, inverse = c.info
    feats = features.contiguous()
    pairs = indice_pairs.contiguous()
    st = stream_handle(feats)
    header, counts, bad = check_pairs(pairs, indice_pair_num.contiguous(), n, m, inverse, st)
    return feats, pairs, st, header, counts, bad


def _conv_maps(c, features, indice_pairs, indice_pair_num):
    """The neighbour maps where the im2col path takes the call, False where the reference
    must (neighbour_maps), None for the per-offset path (nothing to multiply: zeros, or its
    error for a bad rule book; or MUSPACE_SPARSE_CONV_IM2COL=0)."""
    n, m, K, c_in, c_out, inverse = c.info
    if not (IM2COL_ENABLED and n and m and c_in and c_out):
        return None
    pairs, num = indice_pairs.contiguous(), indice_pair_num.contiguous()
    maps = neighbour_maps(pairs, num, n, m, inverse, stream_handle(features))
    return False if maps is None else maps


@torch.no_grad()  # torch.mm(out=...) on buffers; the op's autograd is its own
def conv_native(c, features, weight, indice_pairs, indice_pair_num, num_out, inverse):
    """The native sparse_conv forward (module docstring) -> [num_out, C_out]."""
    from mu_space.ops.sparse_conv import sparse_conv_reference

    args = (features, weight, indice_pairs, indice_pair_num, num_out, inverse)
    if _too_many_pairs(indice_pairs, "sparse_conv"):
        return sparse_conv_reference(*args)
    n, m, K, c_in, c_out, inverse = c.info
    if use_per_offset_forward(features.dtype, c_in, c_out, m):
        maps = None
    else:
        maps = _conv_maps(c, features, indice_pairs, indice_pair_num)
    if maps is False:
        return sparse_conv_reference(*args)  # sums repeated pairs / raises for bad rows
    if maps is not None:
        feats, st = features.contiguous(), stream_handle(features)
        if use_implicit_gemm(feats):
            w = weight.to(feats.dtype).contiguous()
            ordered = ordered_map(n, m, inverse, c_in, c_out) == 0
            return implicit_gemm(feats, maps[0], w, feats.dtype, st, ordered)
        out = im2col_forward(feats, weight, maps[0], st)
        return out if features.dtype == torch.float32 else out.to(features.dtype)
    feats, pairs, st, header, counts, bad = _conv_prologue(
        c, features, indice_pairs, indice_pair_num
    )
    if bad:
        return sparse_conv_reference(*args)  # raises the reference's message
    out = torch.zeros((m, c_out), dtype=torch.float32, device=feats.device)
    total = sum(counts)
    if total and m and c_out:
        gather_side, scatter_side = (1, 0) if inverse else (0, 1)
        x = gather(feats, pairs, header, total, gather_side, st)
        w = weight.to(torch.float32).contiguous()
        prod = _workspace((total, c_out), torch.float32, feats.device)
        for k, rows in _per_offset(counts):
            torch.mm(x[rows], w[k], out=prod[rows])
        scatter(prod, pairs, counts, out, scatter_side, st)
    return out if features.dtype == torch.float32 else out.to(features.dtype)


@torch.no_grad()  # torch.mm(out=...) on buffers; the op's autograd is its own
def conv_backward_native(
    c, grad_out, features, weight, indice_pairs, indice_pair_num, num_out, inverse, *, needs,
    deterministic,
):  # fmt: skip
    """(grad_features [N, C_in], grad_weight [K, C_in, C_out]); deterministic either way."""
    from mu_space.ops.sparse_conv import sparse_conv_backward_reference

    args = (grad_out, features, weight, indice_pairs, indice_pair_num, num_out, inverse)
    if _too_many_pairs(indice_pairs, "sparse_conv"):
        return sparse_conv_backward_reference(*args)
    n, m, K, c_in, c_out, inverse = c.info
    maps = _conv_maps(c, features, indice_pairs, indice_pair_num)
    if maps is False:
        return sparse_conv_backward_reference(*args)
    if maps is not None:
        st = stream_handle(features)
        grad_x, grad_w = im2col_backward(grad_out, features.contiguous(), weight, maps, needs, st,
                                         ordered_map(n, m, inverse, c_in, c_out))  # fmt: skip
    else:
        grad_x, grad_w = _per_offset_backward(c, grad_out, features, weight, indice_pairs,
                                              indice_pair_num, needs, args)  # fmt: skip
        if grad_x is _REFERENCE:
            return sparse_conv_backward_reference(*args)
    if grad_x is not None and features.dtype != torch.float32:
        grad_x = grad_x.to(features.dtype)
    if grad_w is not None and weight.dtype != torch.float32:
        grad_w = grad_w.to(weight.dtype)
    return grad_x, grad_w


_REFERENCE = object()  # _per_offset_backward's answer for a rule book the reference must take


def _per_offset_backward(c, grad_out, features, weight, indice_pairs, indice_pair_num, needs,
                         args):  # fmt: skip
    """The per-offset backward -> float32 (grad_x, grad_w), or (_REFERENCE, None)."""
    n, m, K, c_in, c_out, inverse = c.info
    feats, pairs, st, header, counts, bad = _conv_prologue(
        c, features, indice_pairs, indice_pair_num
    )
    if bad:
        return _REFERENCE, None
    dev = feats.device
    grad_x = torch.zeros((n, c_in), dtype=torch.float32, device=dev) if needs[0] else None
    grad_w = torch.zeros((K, c_in, c_out), dtype=torch.float32, device=dev) if needs[1] else None
    total = sum(counts)
    if total and c_in and c_out:
        gather_side, scatter_side = (1, 0) if inverse else (0, 1)
        g = gather(grad_out.contiguous(), pairs, header, total, scatter_side, st)
        if grad_w is not None:
            x = gather(feats, pairs, header, total, gather_side, st)
            for k, rows in _per_offset(counts):
                torch.mm(x[rows].t(), g[rows], out=grad_w[k])
            del x
        if grad_x is not None:
            w = weight.to(torch.float32).contiguous()
            prod = _workspace((total, c_in), torch.float32, dev)
            for k, rows in _per_offset(counts):
                torch.mm(g[rows], w[k].t(), out=prod[rows])
            scatter(prod, pairs, counts, grad_x, gather_side, st)
    return grad_x, grad_w


# --------------------------------------------------------------------------- max pool


def pool_forward(feats, pairs, counts, m: int, st):
    out = _opdef.new_output(feats, (m, feats.shape[1]))
    hit = _workspace(m, torch.int32, feats.device)
    native.function("sparse_maxpool_forward")(feats, pairs, native_shape(counts), out, hit, st)
    return out


def _pool_prologue(c, features, indice_pairs, indice_pair_num):
    n, m, K, C = c.info
    feats = features.contiguous()
    pairs = indice_pairs.contiguous()
    st = stream_handle(feats)
    _, counts, bad = check_pairs(pairs, indice_pair_num.contiguous(), n, m, False, st)
    return feats, pairs, st, counts, bad


@torch.no_grad()
def maxpool_native(c, features, indice_pairs, indice_pair_num, num_out):
    """The native sparse_maxpool forward -> [num_out, C]."""
    from mu_space.ops.sparse_maxpool import sparse_maxpool_reference

    args = (features, indice_pairs, indice_pair_num, num_out)
    if _too_many_pairs(indice_pairs, "sparse_maxpool"):
        return sparse_maxpool_reference(*args)
    feats, pairs, st, counts, bad = _pool_prologue(c, features, indice_pairs, indice_pair_num)
    if bad:
        return sparse_maxpool_reference(*args)
    return pool_forward(feats, pairs, counts, c.info[1], st)


@torch.no_grad()
def maxpool_backward_native(
    c, grad_out, features, indice_pairs, indice_pair_num, num_out, *, needs, deterministic
):
    """(grad_features [N, C],): the forward recomputed natively, then the tie-rule gradient."""
    from mu_space.ops.sparse_maxpool import sparse_maxpool_backward_reference

    args = (grad_out, features, indice_pairs, indice_pair_num, num_out)
    if _too_many_pairs(indice_pairs, "sparse_maxpool"):
        return sparse_maxpool_backward_reference(*args)
    feats, pairs, st, counts, bad = _pool_prologue(c, features, indice_pairs, indice_pair_num)
    if bad:
        return sparse_maxpool_backward_reference(*args)
    out = pool_forward(feats, pairs, counts, c.info[1], st)
    acc = pool_backward(grad_out.to(feats.dtype).contiguous(), feats, out, pairs, counts, st)
    return (acc if features.dtype == torch.float32 else acc.to(features.dtype),)


def pool_backward(grad_out, feats, out, pairs, counts, st):
    """sparse_maxpool_backward -> the float32 gradient [N, C] (zeroed by the kernel)."""
    acc = _workspace(tuple(feats.shape), torch.float32, feats.device)
    native.function("sparse_maxpool_backward")(
        grad_out, feats, out, pairs, native_shape(counts), acc, st
    )
    return acc
