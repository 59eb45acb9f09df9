"""A numpy / torch model of the native sparse kernels (csrc/sparse/), checked against the
references on the CPU: the kernels cannot run here, so this guards their algorithm until a GPU
session runs them.

Modelled step by step as the kernels do it:
- the hash table (sparse_common.muh): MurmurHash3 fmix64 of the int64 key masked to a
  power-of-two capacity >= 2n, linear probing bounded by the capacity, claim by compare-and-swap,
  the row merged by atomicMin (so the FIRST row of a repeated key wins in any thread order; the
  model inserts in several random orders), lookup until the key or an empty slot;
- reached_key (C semantics: truncating division and remainder);
- the rule-book pipeline of _sparse_native.rulebook_native: SubM lookups in the input table
  (all offsets, or where they come in mirror pairs half of them, each pair also written for its
  mirror, the centre pairing every row with itself); strided / transposed candidates, torch.sort, run starts + exclusive scan -> unique keys, the
  output table, lookups; the per-offset stable compaction over tiles of inputs (tile counts, a scan per offset, in-tile ranks, the -1 tails); the
  decode; and the bitmap path of the strided /
  transposed rule book (sparse_rulebook_mark: bits in uint32 words set by atomicOr, popcounts,
  exclusive scan; the rank lookup of sparse_rulebook_forward_bitmap; the per-word decode);
- sparse_pairs_check's counts / starts, the one-launch gather (offset of a row by binary search
  in the starts), torch.mm per offset, the per-offset scatter in offset order;
- the max pool's per-offset maximum (NaN propagates), the unreached-row zeroing and the
  tie-rule gradient in float32.
Each model result must equal the reference exactly (rule books element by element; the float
paths bit for bit on the CPU, where both sides run the same float32 operations in the same
order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mu_space.ops import _sparse, _sparse_native
from mu_space.ops.sparse_conv import sparse_conv_backward_reference, sparse_conv_reference
from mu_space.ops.sparse_maxpool import (
    sparse_maxpool_backward_reference,
    sparse_maxpool_reference,
)
from mu_space.ops.sparse_rulebook import sparse_rulebook_reference

EMPTY = -1
NO_ROW = 2**31 - 1
NO_KEY = 2**63 - 1
M64 = (1 << 64) - 1


# --------------------------------------------------------------------------- the hash table


def hash_key(keys: np.ndarray) -> np.ndarray:
    """fmix64 on uint64 (wrapping multiplication), as sparse_common.muh's hash_key."""
    k = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        k ^= k >> np.uint64(33)
        k *= np.uint64(0xFF51AFD7ED558CCD)
        k ^= k >> np.uint64(33)
        k *= np.uint64(0xC4CEB9FE1A85EC53)
        k ^= k >> np.uint64(33)
    return k


def _fmix64_int(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


class Table:
    """The device table: keys [C] int64 (-1 free), vals [C] int32 (INT_MAX free)."""

    def __init__(self, capacity: int):
        assert capacity >= 2 and capacity & (capacity - 1) == 0
        self.keys = np.full(capacity, EMPTY, dtype=np.int64)
        self.vals = np.full(capacity, NO_ROW, dtype=np.int64)
        self.mask = capacity - 1
        self.probes = 0

    def insert(self, key: int, row: int) -> str:
        slot = int(hash_key(np.array([key]))[0]) & self.mask
        for _ in range(self.mask + 1):  # bounded: never loops forever
            self.probes += 1
            old = int(self.keys[slot])
            if old == EMPTY:
                self.keys[slot] = key  # the compare-and-swap succeeded
            if old in (EMPTY, key):
                self.vals[slot] = min(int(self.vals[slot]), row)  # atomicMin
                return "duplicate" if old == key else "inserted"
            slot = (slot + 1) & self.mask
        return "full"

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Vectorised probing: the row of each key, -1 when absent (or key < 0)."""
        keys = np.asarray(keys, dtype=np.int64)
        out = np.full(keys.shape, -1, dtype=np.int64)
        active = keys >= 0
        slot = (hash_key(np.where(active, keys, 0)) & np.uint64(self.mask)).astype(np.int64)
        for _ in range(self.mask + 1):
            if not active.any():
                break
            k = self.keys[slot]
            found = active & (k == keys)
            out[found] = self.vals[slot[found]]
            active &= ~found & (k != EMPTY)
            slot = np.where(active, (slot + 1) & self.mask, slot)
        out[out == NO_ROW] = -1
        return out


def build_table(keys: np.ndarray, rng=None) -> tuple[Table, dict]:
    """Insert keys[i] -> row i in an arbitrary thread order (a random permutation)."""
    t = Table(_sparse_native.table_capacity(len(keys)))
    order = np.arange(len(keys)) if rng is None else rng.permutation(len(keys))
    flags = {"duplicate": False, "full": False}
    for i in order:
        r = t.insert(int(keys[i]), int(i))
        if r != "inserted":
            flags[r] = True
    return t, flags


def test_hash_matches_the_integer_fmix64():
    keys = np.array([0, 1, 2, 12345678901234, 2**62 - 1], dtype=np.int64)
    assert [int(h) for h in hash_key(keys)] == [_fmix64_int(int(k)) for k in keys]


def test_table_capacity_is_a_power_of_two_at_least_twice_the_keys():
    for n in (0, 1, 2, 3, 1000, 1024, 1025):
        cap = _sparse_native.table_capacity(n)
        assert cap >= max(2, 2 * n) and cap & (cap - 1) == 0 and cap < max(4, 4 * n)


def test_first_row_wins_in_any_order_and_probing_is_bounded():
    keys = np.array([7, 3, 7, 9, 3, 7], dtype=np.int64)
    for seed in range(5):
        t, flags = build_table(keys, np.random.default_rng(seed))
        assert flags["duplicate"] and not flags["full"]
        assert t.lookup(np.array([7, 3, 9, 4, -1])).tolist() == [0, 1, 3, -1, -1]
    full = Table(4)
    assert [full.insert(k, k) for k in range(5)] == ["inserted"] * 4 + ["full"]
    assert full.lookup(np.array([0, 3, 99])).tolist() == [0, 3, -1]  # 99: stops after 4 probes


def test_probe_lengths_stay_short_on_lidar_keys():
    """fmix64 spreads the row-major keys of neighbouring voxels: at load <= 1/2 the mean probe
    count of an insert stays near linear probing's 1.5."""
    idx, shape = _sparse.tiny_indices("cpu", keep=2000)
    keys = _sparse.linear_keys(idx, shape).numpy()
    t, _ = build_table(keys)
    assert t.probes / len(keys) < 2.5


# --------------------------------------------------------------------------- the rule book


def reached_keys(indices: np.ndarray, info) -> np.ndarray:
    """[K, N] int64: reached_key of every (offset, input), -1 where none (C arithmetic)."""
    ndim, K = info["ndim"], info["K"]
    ks = np.stack(np.unravel_index(np.arange(K), info["ksize"]), axis=1)  # row-major, last fastest
    b = indices[:, 0].astype(np.int64)[None, :]
    key = np.broadcast_to(b, (K, len(indices))).copy()
    valid = (b >= 0) & (b < info["batch_size"])
    valid = np.broadcast_to(valid, key.shape).copy()
    for a in range(ndim):
        c = indices[:, a + 1].astype(np.int64)[None, :]
        valid &= (c >= 0) & (c < info["spatial"][a])
        s, p, d = info["stride"][a], info["padding"][a], info["dilation"][a]
        kk = ks[:, a].astype(np.int64)[:, None]
        if info["transposed"]:
            q = c * s - p + kk * d
        else:
            num = c + p - kk * d
            if info["subm"]:
                q = num
            else:
                rem = np.fmod(num, s)  # C's %: the sign of the dividend
                valid &= rem == 0
                q = (num - rem) // s  # C's / where rem == 0 (exact)
        valid &= (q >= 0) & (q < info["out_shape"][a])
        key = key * info["out_shape"][a] + np.where(valid, q, 0)
    return np.where(valid, key, -1)


def exclusive_scan(flags: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(flags)[:-1])).astype(np.int64)


PAIR_TILE = 2048  # kPairTile of sparse_rulebook_musa.mu: 256 threads x 8 inputs


def compact(out_row: np.ndarray, K: int, n: int, tile: int = PAIR_TILE):
    """sparse_rulebook_forward's compaction: per offset, tiles of `tile` inputs; the lookups
    count each tile's pairs, a block per offset scans the counts (-> indice_pair_num), each tile
    emits its pairs at its prefix + their rank inside the tile and writes -1 at its positions
    past the offset's count."""
    tiles = max(-(-n // tile), 1)
    pairs = np.full((K, 2, n), -7, dtype=np.int64)  # every position must be written
    num = np.zeros(K, dtype=np.int64)
    for k in range(K):
        rows = out_row[k]
        counts = [int((rows[t * tile : (t + 1) * tile] >= 0).sum()) for t in range(tiles)]
        prefix = exclusive_scan(np.array(counts + [0]))
        num[k] = sum(counts)
        for t in range(tiles):
            j = np.arange(t * tile, min((t + 1) * tile, n))
            hit = j[rows[j] >= 0]
            slots = prefix[t] + np.arange(len(hit))
            pairs[k, 0, slots] = hit
            pairs[k, 1, slots] = rows[hit]
            tail = j[j >= num[k]]
            pairs[k, :, tail] = -1
    assert not (pairs == -7).any()
    return pairs, num


def mirrored(info) -> bool:
    """sparse_rulebook_subm's `mirrored`: 2 padding = (kernel_size - 1) dilation on every axis."""
    return all(
        2 * p == (k - 1) * d
        for k, p, d in zip(info["ksize"], info["padding"], info["dilation"], strict=True)
    )


def model_mirror_out_row(table, reached: np.ndarray, K: int, n: int) -> np.ndarray:
    """mirror_pair_lookup_kernel: offsets k < K - 1 - k looked up, each pair (j -> i) also written
    as out_row[K - 1 - k][i] = j (prefilled -1), the centre offset pairing every row inside the
    grid with itself; the mirror offsets are never looked up."""
    out_row = np.full((K, n), -1, dtype=np.int64)
    j = np.arange(n)
    for k in range(K):
        mirror = K - 1 - k
        if k > mirror:
            continue
        if k == mirror:
            out_row[k] = np.where(reached[k] >= 0, j, -1)
            continue
        rows = table.lookup(reached[k])
        out_row[k] = rows
        hit = rows >= 0
        assert len(np.unique(rows[hit])) == hit.sum()  # one writer per mirror slot
        out_row[mirror, rows[hit]] = j[hit]
    return out_row


def model_bitmap(reached: np.ndarray, info):
    """sparse_rulebook_mark, sparse_rulebook_forward_bitmap's lookup and
    sparse_rulebook_decode_bitmap -> (out_row [K, N] (-1: none), out keys in row order)."""
    cells = info["batch_size"] * math.prod(info["out_shape"])
    n_words = (cells + 31) // 32
    words = np.zeros(n_words, dtype=np.uint32)
    hit = reached[reached >= 0]
    np.bitwise_or.at(words, hit >> 5, (np.uint32(1) << (hit & 31).astype(np.uint32)))
    popc = np.array([bin(int(w)).count("1") for w in words], dtype=np.int64)
    prefix = exclusive_scan(popc)  # header[kCount] = popc.sum()
    bit = (np.uint32(1) << (reached & 31).astype(np.uint32)).astype(np.uint32)
    w = np.where(reached >= 0, reached >> 5, 0)
    below = words[w] & (bit - np.uint32(1))
    rank = prefix[w] + np.array([bin(int(v)).count("1") for v in below.reshape(-1)]).reshape(
        reached.shape
    )
    is_set = (reached >= 0) & ((words[w] & bit) != 0)
    out_row = np.where(is_set, rank, -1)
    keys = np.full(int(popc.sum()), -1, dtype=np.int64)
    for i, word in enumerate(words):  # decode_bitmap_kernel: a thread per word, __ffs order
        row, rest = int(prefix[i]), int(word)
        while rest:
            b = (rest & -rest).bit_length() - 1
            rest &= rest - 1
            keys[row] = i * 32 + b
            row += 1
    return out_row, keys


def model_rulebook(args, seed=0, bitmap=False, tile=PAIR_TILE, mirror=False):
    from mu_space.ops.sparse_rulebook import _parse

    info = _parse(*args)
    rng = np.random.default_rng(seed)
    indices = args[0].numpy()
    n, K = info["n"], info["K"]
    in_keys = _sparse.linear_keys(args[0], info["spatial"]).numpy()
    table, flags = build_table(in_keys, rng)
    assert not flags["duplicate"] and not flags["full"]
    reached = reached_keys(indices, info)
    if info["subm"]:
        if mirror and mirrored(info):
            out_row = model_mirror_out_row(table, reached, K, n)
        else:
            out_row = table.lookup(reached)
        pairs, num = compact(out_row, K, n, tile)
        out_indices = indices.copy()
    elif bitmap:
        out_row, uniq = model_bitmap(reached, info)
        pairs, num = compact(out_row, K, n, tile)
        out_indices = _sparse.decode_keys(torch.from_numpy(uniq), info["out_shape"]).numpy()
    else:
        cand = np.where(reached >= 0, reached, NO_KEY).reshape(-1)
        s = torch.sort(torch.from_numpy(cand)).values.numpy()  # the torch step
        start = (s != NO_KEY) & np.concatenate(([True], s[1:] != s[:-1]))
        row = exclusive_scan(start.astype(np.int64))
        m = int(start.sum())
        uniq = np.zeros(m, dtype=np.int64)
        uniq[row[start]] = s[start]
        out_table, oflags = build_table(uniq, rng)
        assert not oflags["duplicate"]
        pairs, num = compact(out_table.lookup(reached), K, n, tile)
        out_indices = _sparse.decode_keys(torch.from_numpy(uniq), info["out_shape"]).numpy()
    return out_indices, pairs, num


CASES = {
    "subm k3": (3, 1, 1, 1, 0, True, False),
    "subm k3 dilation 2": (3, 1, 2, 2, 0, True, False),
    "subm k5 pad 2": (5, 1, 2, 1, 0, True, False),
    "subm k3 pad 0 (not mirrored)": (3, 1, 0, 1, 0, True, False),
    "subm k2 dilation 2 pad 1 (mirrored, no centre)": (2, 1, 1, 2, 0, True, False),
    "subm (3, 1, 5)": ([3, 1, 5], 1, [1, 0, 2], 1, 0, True, False),
    "strided k3 s2 p1": (3, 2, 1, 1, 0, False, False),
    "strided k2 s2": (2, 2, 0, 1, 0, False, False),
    "second (3, 1, 1) s (2, 1, 1)": ([3, 1, 1], [2, 1, 1], 0, 1, 0, False, False),
    "strided k3 s3 dilation 2 pad 2": (3, 3, 2, 2, 0, False, False),
    "transposed k2 s2": (2, 2, 0, 1, 0, False, True),
    "transposed k3 s2 p1 output_padding 1": (3, 2, 1, 1, 1, False, True),
}


def _listify(v, nd):
    return [v] * nd if isinstance(v, int) else list(v)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("shuffle", [False, True], ids=["voxel-order", "shuffled"])
def test_model_rule_book_equals_the_reference(case, shuffle):
    idx, shape = _sparse.tiny_indices("cpu")
    if shuffle:
        idx = idx[torch.randperm(len(idx), generator=torch.Generator().manual_seed(5))]
    ksize, stride, padding, dilation, out_pad, subm, transposed = CASES[case]
    args = (idx, 2, shape, *(_listify(v, 3) for v in (ksize, stride, padding, dilation, out_pad)),
            subm, transposed)  # fmt: skip
    want = sparse_rulebook_reference(*args)
    # two thread orders of the inserts; the bitmap (strided / transposed only); tiles of 7 inputs
    # (the tiny frame fits one tile of 2048: the tiling's prefixes and tails checked too); SubM
    # with and without the mirror lookups
    for seed, bitmap, tile, mirror in (
        (0, False, PAIR_TILE, False),
        (1, False, 7, False),
        (0, True, PAIR_TILE, False),
        (2, False, PAIR_TILE, True),
        (3, False, 7, True),
    ):
        if bitmap and subm:
            continue  # the bitmap is the strided / transposed output-site path
        out_indices, pairs, num = model_rulebook(args, seed, bitmap, tile, mirror)
        assert np.array_equal(out_indices, want.out_indices.numpy())
        assert np.array_equal(pairs, want.indice_pairs.numpy())
        assert np.array_equal(num, want.indice_pair_num.numpy())


def test_model_rule_book_2d_random_sites():
    g = torch.Generator().manual_seed(2)
    shape = [37, 53]
    keys = torch.randperm(2 * math.prod(shape), generator=g)[:400]
    idx = _sparse.decode_keys(keys, shape)
    for ksize, stride, padding, subm, transposed in (
        (3, 1, 1, True, False), (3, 2, 0, False, False), (4, 3, 1, False, False),
        (3, 2, 1, False, True),
    ):  # fmt: skip
        args = (idx, 2, shape, [ksize] * 2, [stride] * 2, [padding] * 2, [1, 1], [0, 0], subm,
                transposed)  # fmt: skip
        want = sparse_rulebook_reference(*args)
        for bitmap in (False, True) if not subm else (False,):
            got = model_rulebook(args, bitmap=bitmap)
            for a, w in zip(got, want):
                assert np.array_equal(a, w.numpy())


# --------------------------------------------------------------------------- conv and pool


def model_check(pairs, num):
    """sparse_pairs_check: counts clamped to [0, P], exclusive starts (K + 1)."""
    P = pairs.shape[2]
    counts = np.clip(num.numpy().astype(np.int64), 0, P)
    return counts, np.concatenate(([0], np.cumsum(counts)))


def model_gather(src, pairs, starts, side):
    """One launch: row r's offset by binary search in the starts (the largest k < K with
    starts[k] <= r), then src[pairs[k, side, r - starts[k]]] as float32."""
    K = pairs.shape[0]
    total = int(starts[-1])
    r = np.arange(total)
    k = np.searchsorted(starts[:K], r, side="right") - 1
    rows = pairs[k, side, r - starts[k]].long()
    return src.float()[rows]


def model_conv(features, weight, pairs, num, m, inverse):
    counts, starts = model_check(pairs, num)
    g_side, s_side = (1, 0) if inverse else (0, 1)
    x = model_gather(features, pairs, starts, g_side)
    out = torch.zeros(m, weight.shape[2])
    w = weight.float()
    for k in range(pairs.shape[0]):
        s, e = starts[k], starts[k + 1]
        if e > s:
            prod = torch.mm(x[s:e], w[k])
            dst = pairs[k, s_side, : e - s].long()
            out[dst] += prod  # the rows of one offset are distinct: plain adds
    return out.to(features.dtype)


def model_conv_backward(grad_out, features, weight, pairs, num, inverse):
    counts, starts = model_check(pairs, num)
    g_side, s_side = (1, 0) if inverse else (0, 1)
    g = model_gather(grad_out, pairs, starts, s_side)
    x = model_gather(features, pairs, starts, g_side)
    w = weight.float()
    grad_x = torch.zeros(features.shape)
    grad_w = torch.zeros(weight.shape)
    for k in range(pairs.shape[0]):
        s, e = starts[k], starts[k + 1]
        if e > s:
            grad_w[k] = torch.mm(x[s:e].t(), g[s:e])
            grad_x[pairs[k, g_side, : e - s].long()] += torch.mm(g[s:e], w[k].t())
    return grad_x.to(features.dtype), grad_w.to(weight.dtype)


@pytest.mark.parametrize("subm", [True, False], ids=["subm", "strided"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_conv_equals_the_reference(subm, inverse, dtype):
    from mu_space.ops.sparse_conv import sample_case

    if subm and inverse:
        pytest.skip("inverse needs a strided rule book")
    f, w, p, n, m, inv = sample_case("cpu", subm=subm, inverse=inverse, c_in=5, c_out=7)
    f, w = f.to(dtype), w.to(dtype)
    # The same float32 products and sums, but torch.mm's summation order follows the CPU's BLAS
    # kernel for each operand layout (the model's slices, the reference's gathers, a transposed
    # weight): grad_x differed by 1 ulp (4.8e-7 at |x| ~ 4) on an AMD EPYC CI machine
    # (2026-12-01), and was equal elsewhere. So: a few float32 ulps; bfloat16 (rounded once from
    # the float32 sums) one bfloat16 ulp, where such a difference can cross a rounding boundary.
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    want = sparse_conv_reference(f, w, p, n, m, inv)
    torch.testing.assert_close(model_conv(f, w, p, n, m, inv), want, **tol)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want_x, want_w = sparse_conv_backward_reference(g, f, w, p, n, m, inv)
    got_x, got_w = model_conv_backward(g, f, w, p, n, inv)
    torch.testing.assert_close(got_x, want_x, **tol)
    torch.testing.assert_close(got_w, want_w, **tol)


def _nan_max(a, b):
    return torch.where(torch.isnan(a) | torch.isnan(b), a + b, torch.maximum(a, b))


def model_maxpool(features, pairs, num, m):
    counts, _ = model_check(pairs, num)
    out = torch.full((m, features.shape[1]), -torch.inf).to(features.dtype)
    hit = torch.zeros(m, dtype=torch.bool)
    for k in range(pairs.shape[0]):
        src, dst = pairs[k, 0, : counts[k]].long(), pairs[k, 1, : counts[k]].long()
        out[dst] = _nan_max(out[dst].float(), features[src].float()).to(features.dtype)
        hit[dst] = True
    out[~hit] = 0
    return out


def model_maxpool_backward(grad_out, features, pairs, num, m):
    counts, _ = model_check(pairs, num)
    out = model_maxpool(features, pairs, num, m)
    acc = torch.zeros(features.shape)
    for k in range(pairs.shape[0]):
        src, dst = pairs[k, 0, : counts[k]].long(), pairs[k, 1, : counts[k]].long()
        eq = features[src].float() == out[dst].float()
        acc[src] += torch.where(eq, grad_out[dst].float(), 0.0)
    return acc.to(features.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_model_maxpool_equals_the_reference_with_nan_and_ties(dtype):
    from mu_space.ops.sparse_rulebook import sparse_rulebook

    idx, shape = _sparse.tiny_indices("cpu")
    rb = sparse_rulebook(idx, 2, shape, 3, 2, 1, 1, 0, False, False, backend="reference")
    m = rb.out_indices.shape[0]
    gen = torch.Generator().manual_seed(4)
    f = torch.randn(idx.shape[0], 6, generator=gen).round(decimals=1).to(dtype)  # many ties
    f[3, 2] = torch.nan
    f[10:20] = -torch.inf
    want = sparse_maxpool_reference(f, rb.indice_pairs, rb.indice_pair_num, m)
    got = model_maxpool(f, rb.indice_pairs, rb.indice_pair_num, m)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(got.isnan(), want.isnan())
    g = torch.randn(m, 6, generator=gen).to(dtype)
    (want_g,) = sparse_maxpool_backward_reference(g, f, rb.indice_pairs, rb.indice_pair_num, m)
    assert torch.equal(model_maxpool_backward(g, f, rb.indice_pairs, rb.indice_pair_num, m), want_g)
