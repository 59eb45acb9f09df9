"""A line-by-line Python model of the segmented block sum in csrc/bev/bev_pool_v2_musa.mu
(find_owned_runs, owned_range, pool_runs, the two sinks, zero_unmarked), so the partition and
ownership logic runs on machines without a GPU. It mirrors the kernel's control flow per block and
per slot (not per lane: a lane's channels are summed as one vector) and counts the kernel's
writes to each output key, so tests can check that no key is written twice and every key holds
the right sum. The forward (window > 0) zero-fills its output before the kernel, so its staged
sink zeroes nothing; the rows sink (window = 0, deterministic grad_feat) zeroes the keys without
points itself and writes every key exactly once. Keep it in step with the kernel when the
algorithm changes.
"""

from __future__ import annotations

import math

import numpy as np

NOT_FOUND = 2**31 - 1
UNROLL = 4  # kUnroll: points per slot and batch (one staged record each)


def _run_start(keys, j):
    return j == 0 or keys[j] != keys[j - 1]


def _find_owned_runs(keys, n, p0, p1, span):
    q0 = 0 if p0 == 0 else NOT_FOUND
    q1 = NOT_FOUND
    base = 0
    while True:
        searching0 = q0 == NOT_FOUND and p0 + base < p1
        owns_nothing = q0 == NOT_FOUND and p0 + base >= p1
        searching1 = not owns_nothing and q1 == NOT_FOUND and p1 + base < n
        if not searching0 and not searching1:
            break
        for off in range(base, base + span):
            if searching0 and p0 + off < p1 and _run_start(keys, p0 + off):
                q0 = min(q0, p0 + off)
            if searching1 and p1 + off < n and _run_start(keys, p1 + off):
                q1 = min(q1, p1 + off)
        base += span
    return q0, (n if q1 == NOT_FOUND else q1)


def _clamp(key, n_keys):
    return min(max(int(key), 0), n_keys)


def segmented_pool(
    keys,
    values,
    n_keys,
    *,
    points_per_block,
    lanes,
    threads=256,
    window=0,
    bitmap_bits=4096,
    search_span=1024,
):
    """Model of forward_kernel (window > 0: StagedChannelsFirst, output zero-filled first) /
    grad_feat_sorted_kernel (window = 0: Rows). keys: int [n] segment keys; values: float64
    [n, C] = weight * row (0 for a bad point). Returns (out [n_keys, C] float64, writes [n_keys]
    int: the kernel's writes, partial_sum_slots). Rows sink: NaN in `out` marks a key never
    written."""
    keys = [int(k) for k in keys]
    n = len(keys)
    C = values.shape[1]
    zero_filled = window > 0
    out = np.zeros((n_keys, C)) if zero_filled else np.full((n_keys, C), np.nan)
    writes = np.zeros(n_keys, dtype=np.int64)
    crossings = 0
    n_blocks = math.ceil(n / points_per_block)
    for blk in range(n_blocks):
        p0 = blk * points_per_block
        p1 = min(p0 + points_per_block, n)
        q0, q1 = _find_owned_runs(keys, n, p0, p1, search_span)
        if q0 == NOT_FOUND:
            continue
        lo = 0 if blk == 0 else _clamp(keys[q0], n_keys)
        hi = max(lo, n_keys if q1 >= n else _clamp(keys[q1], n_keys))
        win = min(window, hi - lo) if window else 0
        z0 = lo + win
        stage = np.zeros((max(win, 0), C))
        bitmap = set()

        def emit(x, v):
            if x < 0 or x >= n_keys:
                return
            if lo <= x < lo + win:
                stage[x - lo] = v
            else:
                out[x] = v
                writes[x] += 1
                if not zero_filled and 0 <= x - z0 < bitmap_bits:
                    bitmap.add(x - z0)

        S = min(threads // lanes, threads // UNROLL)  # pool_runs: at most kMaxSlots slots
        n_own = q1 - q0
        K = -(-n_own // S)
        part, flags, pending = {}, {}, {}
        for slot in range(S):
            a = q0 + min(slot * K, n_own)
            b = min(a + K, q1)
            if a >= b:
                continue
            cur = keys[a]
            first_open = a > q0 and keys[a - 1] == cur
            seg_first = True
            acc = np.zeros(C)
            for i in range(a, b):
                if keys[i] != cur:
                    if seg_first and first_open:
                        part[slot] = acc.copy()
                    else:
                        emit(cur, acc)
                    seg_first = False
                    cur = keys[i]
                    acc = np.zeros(C)
                acc = acc + values[i]
            open_end = b < q1 and keys[b] == cur
            if seg_first and first_open:
                part[slot] = acc.copy()
            elif open_end:
                pending[slot] = (cur, acc)
            else:
                emit(cur, acc)
            flags[slot] = (seg_first, open_end)
        for slot, (cur, acc) in pending.items():  # after the barrier
            for s in range(slot + 1, S):
                crossings += 1
                acc = acc + part[s]
                if flags[s] != (True, True):
                    break
            emit(cur, acc)
        for w in range(win):  # flush
            out[lo + w] = stage[w]
            writes[lo + w] += 1
        start = hi if zero_filled else z0
        while start < hi:  # zero_unmarked (rows sink only)
            if start != z0:
                bitmap = {
                    int(keys[j]) - start
                    for j in range(q0, q1)
                    if 0 <= int(keys[j]) - start < bitmap_bits
                }
            for d in range(min(bitmap_bits, hi - start)):
                if d not in bitmap:
                    out[start + d] = 0.0
                    writes[start + d] += 1
            start += bitmap_bits
    return out, writes, crossings


def frustum_backward(grad_rows, depth, feat, ranks_depth, ranks_feat, ranks_bev, *, lanes):
    """Model of the frustum-layout backward (frustum_points_kernel, frustum_backward_kernel,
    irregular_points_kernel with add=True): its index arithmetic per block, round, staged entry
    and slot. depth [B, N, D, H, W], feat [B, N, H, W, C] float64 arrays, grad_rows [cells, C].
    Returns (grad_depth, grad_feat, irregular, entry_writes: how often each depth entry was
    written by the gather)."""
    threads, rows_per_block = 256, 4
    bins, hw = depth.shape[2], depth.shape[3] * depth.shape[4]
    C = feat.shape[-1]
    rows = feat.reshape(-1, C)
    w_flat = depth.reshape(-1)
    n_rows, n_depth, n_cells = rows.shape[0], w_flat.shape[0], grad_rows.shape[0]
    rd, rf, rb = (np.asarray(x, dtype=np.int64) for x in (ranks_depth, ranks_feat, ranks_bev))

    def frustum_row(k):
        return (k // (bins * hw)) * hw + k % hw

    valid = (rd >= 0) & (rd < n_depth) & (rf >= 0) & (rf < n_rows) & (rb >= 0) & (rb < n_cells)
    point_of_depth = np.full(n_depth, -1, dtype=np.int64)
    for i in np.nonzero(valid & (rf == frustum_row(np.where(valid, rd, 0))))[0]:
        point_of_depth[rd[i]] = i
    grad_depth = np.full(n_depth, np.nan)
    grad_feat = np.full((n_rows, C), np.nan)
    writes = np.zeros(n_depth, dtype=np.int64)
    S = min(threads // lanes, threads // UNROLL)
    P = S // rows_per_block
    per_round = P * UNROLL
    entries = rows_per_block * per_round
    assert entries <= threads
    for row0 in range(0, n_rows, rows_per_block):
        acc = {}  # (local_row, sub) -> partial grad_feat row
        for d0 in range(0, bins, per_round):
            cell = np.full(entries, -1)
            weight = np.zeros(entries)
            ks = {}
            for e in range(entries):
                r, d = row0 + e % rows_per_block, d0 + e // rows_per_block
                if r >= n_rows or d >= bins:
                    continue
                k = ((r // hw) * bins + d) * hw + r % hw
                ks[e] = k
                i = point_of_depth[k]
                if i >= 0:
                    cell[e], weight[e] = rb[i], w_flat[k]
            dots = {}
            for slot in range(rows_per_block * P):
                local_row, sub = slot % rows_per_block, slot // rows_per_block
                row = row0 + local_row
                if row >= n_rows:
                    continue
                a = acc.setdefault((local_row, sub), np.zeros(C))
                e0 = sub * UNROLL * rows_per_block + local_row
                for u in range(UNROLL):
                    e = e0 + u * rows_per_block
                    g = grad_rows[cell[e]] if cell[e] >= 0 else np.zeros(C)
                    a += weight[e] * g
                    dots[(slot, u)] = float(g @ rows[row])
            for e, k in ks.items():
                b = e // rows_per_block
                es = (b // UNROLL) * rows_per_block + e % rows_per_block
                grad_depth[k] = dots[(es, b % UNROLL)] if cell[e] >= 0 else 0.0
                writes[k] += 1
        for local_row in range(rows_per_block):
            row = row0 + local_row
            if row < n_rows:
                grad_feat[row] = sum(acc[(local_row, p)] for p in range(P))
    irregular = False
    for i in np.nonzero(valid)[0]:
        if rf[i] == frustum_row(rd[i]) and point_of_depth[rd[i]] == i:
            continue
        irregular = True
        g = grad_rows[rb[i]]
        grad_depth[rd[i]] += float(g @ rows[rf[i]])
        grad_feat[rf[i]] += w_flat[rd[i]] * g
    return grad_depth.reshape(depth.shape), grad_feat.reshape(feat.shape), irregular, writes
