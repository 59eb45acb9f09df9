"""A numpy model of the native hard-voxelization pipeline (csrc/voxel/voxelize_musa.mu, the
Python layer's stable sort between its two entry points), kernel by kernel, so the tests can
compare each kernel's rule with the reference on small inputs. It mirrors the kernels' index arithmetic, not their parallel schedule: each
kernel's per-item rule is applied to every item, which is what the kernels compute because no
item depends on another item of the same kernel.
"""

from __future__ import annotations

import numpy as np
import torch


def exclusive_scan(a: np.ndarray) -> tuple[np.ndarray, int]:
    """scan_tile_sums + scan_apply: out[i] = sum a[:i] (tiling does not change the values)."""
    c = np.cumsum(a, dtype=np.int64)
    return (c - a).astype(np.int64), int(c[-1]) if a.size else 0


def rowcol_walk(total: int, cols: int, threads: int) -> np.ndarray:
    """voxel_grid.muh's RowCol over a grid-stride loop of `threads` threads: the (row, col) each
    thread holds at each of its elements e (one division per thread, then quotient and
    remainder steps), as [total, 2] indexed by e."""
    out = np.full((total, 2), -1, dtype=np.int64)
    for t in range(min(threads, total)):
        for e, rc in zip(range(t, total, threads), rowcol_thread(t, threads, cols)):
            out[e] = rc
    return out


def rowcol_thread(t: int, threads: int, cols: int):
    """The (row, col) RowCol gives thread t at its elements t, t + threads, ... (endless), with
    the kernel's register widths: row int64, col / dcol / cols int32 (cols <= INT32_MAX), the
    step's col + dcol summed in uint32."""
    assert 1 <= cols <= 2**31 - 1
    row, col = divmod(t, cols)
    drow, dcol = divmod(threads, cols)
    while True:
        yield row, col
        row += drow
        c = (col + dcol) & 0xFFFFFFFF  # uint32 sum: < 2 * cols < 2**32, never wraps
        if c >= cols:
            c -= cols
            row += 1
        col = c - (1 << 32) if c >= 1 << 31 else c  # back to int32
        assert -(2**31) <= col < 2**31


def _axis_cell(v: np.ndarray, lo: float, size: float, cells: int):
    """axis_cell: floorf((v - lo) / size) in float32, valid in [0, cells)."""
    with np.errstate(invalid="ignore", over="ignore"):
        f = np.floor((v.astype(np.float32) - np.float32(lo)) / np.float32(size))
        ok = (f >= 0) & (f < 2147483648.0)
        c = np.where(ok, f, 0).astype(np.int64)
    return c, ok & (c < cells)


def samples_kernel(rank, total, off, n, V):
    """samples_kernel (both groupings): per sample its first voxel rank and output base, and
    the kept voxels in all (min(voxels, V) per sample)."""
    sample_first, sample_base = [], []
    m = 0
    for b in range(len(off) - 1):
        lo = rank[off[b]] if off[b] < n else total
        hi = rank[off[b + 1]] if off[b + 1] < n else total
        sample_first.append(lo)
        sample_base.append(m)
        m += min(max(hi - lo, 0), V)
    return sample_first, sample_base, m


def hard_voxelize(points, grid, P, V, sizes, *, padded_rows=None):
    """(voxels, coors, num, count) as voxel_hard_forward writes them; `padded_rows` set: the
    padded mode with that many rows (one sample)."""
    pts = points.detach().cpu().float().numpy()
    raw = points.detach().cpu()
    n, C = pts.shape
    ncols = 3 if sizes is None else 4  # what the Python layer passes
    sizes = list(sizes) if sizes is not None else [n]
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    B = len(sizes)
    gx, gy, gz = grid.cells
    cells = gx * gy * gz
    sentinel = B * cells
    # keys_kernel
    cx, okx = _axis_cell(pts[:, 0], grid.lower[0], grid.size[0], gx)
    cy, oky = _axis_cell(pts[:, 1], grid.lower[1], grid.size[1], gy)
    cz, okz = _axis_cell(pts[:, 2], grid.lower[2], grid.size[2], gz)
    sample = np.searchsorted(off[1:], np.arange(n), side="right")  # sample_of
    keys = np.where(okx & oky & okz, sample * cells + (cz * gy + cy) * gx + cx, sentinel)
    idx = np.argsort(keys, kind="stable")  # torch.sort(keys, stable=True) between the calls
    skeys = keys[idx]
    # first_flags_kernel + scan
    start = (skeys != sentinel) & np.concatenate([[True], skeys[1:] != skeys[:-1]])
    first = np.zeros(n, dtype=np.int64)
    first[idx] = start
    rank, total = exclusive_scan(first)
    sample_first, sample_base, m = samples_kernel(rank, total, off, n, V)
    rows = padded_rows if padded_rows is not None else sum(min(s, V) for s in sizes)
    # rows_kernel
    row_start = np.full(rows, -1, dtype=np.int64)
    for p in np.nonzero(start)[0]:
        b = skeys[p] // cells
        local = rank[idx[p]] - sample_first[b]
        if local < V:
            row = sample_base[b] + local
            if row < rows:
                row_start[row] = p
    # emit_kernel
    voxels = torch.zeros((rows, P, C), dtype=raw.dtype)
    coors = torch.zeros((rows, ncols), dtype=torch.int32)
    num = torch.zeros(rows, dtype=torch.int32)
    for row in range(rows):
        if row >= m:
            coors[row] = -1
            continue
        s = row_start[row]
        assert s >= 0, f"row {row} < m = {m} has no run"
        key = skeys[s]
        count = 0
        while count < P and s + count < n and skeys[s + count] == key:
            voxels[row, count] = raw[idx[s + count]]
            count += 1
        num[row] = count
        b, cell = key // cells, key % cells
        zyx = [cell // (gx * gy), (cell // gx) % gy, cell % gx]
        coors[row] = torch.tensor(([b] if ncols == 4 else []) + zyx, dtype=torch.int32)
    if padded_rows is None:
        return voxels[:m], coors[:m], num[:m], torch.tensor(m)
    return voxels, coors, num, torch.tensor(m)


# ------------------------------------------------------- the hashed grouping (no sort)


def mix32(k: np.ndarray) -> np.ndarray:
    """MurmurHash3's fmix32 (claim_slot's hash), in uint32 arithmetic."""
    k = k.astype(np.uint64) & 0xFFFFFFFF
    k ^= k >> 16
    k = (k * 0x85EBCA6B) & 0xFFFFFFFF
    k ^= k >> 13
    k = (k * 0xC2B2AE35) & 0xFFFFFFFF
    k ^= k >> 16
    return k


def warp_sort_ascending(v: np.ndarray) -> np.ndarray:
    """warp_sort_ascending: the bitonic network over the lanes of one warp (len(v) lanes), each
    step's __shfl_xor_sync a partner read."""
    v = v.copy()
    W = v.size
    lane = np.arange(W)
    size = 2
    while size <= W:
        stride = size // 2
        while stride > 0:
            other = v[lane ^ stride]
            low = (lane & stride) == 0
            ascending = (lane & size) == 0
            v = np.where(low == ascending, np.minimum(v, other), np.maximum(v, other))
            stride //= 2
        size *= 2
    return v


def warp_smallest_after(stretch: np.ndarray, after: int, W: int) -> np.ndarray:
    """warp_smallest_after: lane t holds the t-th smallest entry > after (INT_MAX past the
    end), by sorting W-entry chunks and merging each into the running W smallest."""
    lane = np.arange(W)
    best = np.full(W, INT_MAX, dtype=np.int64)
    for c in range(0, stretch.size, W):
        v = np.full(W, INT_MAX, dtype=np.int64)
        chunk = stretch[c : c + W]
        v[: chunk.size] = chunk
        v[v <= after] = INT_MAX
        v = warp_sort_ascending(v)
        best = np.minimum(best, v[W - 1 - lane])
        stride = W // 2
        while stride > 0:
            other = best[lane ^ stride]
            best = np.where((lane & stride) == 0, np.minimum(best, other), np.maximum(best, other))
            stride //= 2
    return best


INT_MAX = 2**31 - 1


def hard_voxelize_hashed(
    points, grid, P, V, sizes, *, padded_rows=None, warp=32, seed=0, force_hash=False
):
    """(voxels, coors, num, count) as voxel_hard_forward_hashed writes them. The atomics of
    insert_kernel and flags_kernel run in a random order of the points (`seed`): what the
    thread schedule may change (slot claims, positions in a stretch, the stretches' places) is
    drawn at random; the outputs must not depend on it. `force_hash`: the open-addressing table
    even where the cells would fit the direct one; `warp`: the lanes of the selection."""
    rng = np.random.default_rng(seed)
    pts = points.detach().cpu().float().numpy()
    raw = points.detach().cpu()
    n, C = pts.shape
    ncols = 3 if sizes is None else 4
    sizes = list(sizes) if sizes is not None else [n]
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    B = len(sizes)
    gx, gy, gz = grid.cells
    cells = gx * gy * gz
    # hashed_layout
    hash_cap = 2
    while hash_cap < n + n // 2:
        hash_cap <<= 1
    direct = B * cells <= hash_cap and not force_hash
    cap = B * cells if direct else hash_cap
    keys_t = np.full(cap, -1, dtype=np.int64)  # kFreeKey
    first = np.full(cap, 2**32 - 1, dtype=np.int64)
    count = np.full(cap, -1, dtype=np.int64)
    base = np.zeros(cap, dtype=np.int64)
    cursor = -1
    # insert_kernel, in a random order
    cx, okx = _axis_cell(pts[:, 0], grid.lower[0], grid.size[0], gx)
    cy, oky = _axis_cell(pts[:, 1], grid.lower[1], grid.size[1], gy)
    cz, okz = _axis_cell(pts[:, 2], grid.lower[2], grid.size[2], gz)
    sample = np.searchsorted(off[1:], np.arange(n), side="right")
    valid = okx & oky & okz
    key = sample * cells + (cz * gy + cy) * gx + cx
    hashed = mix32(key) & (cap - 1) if not direct else key
    point_slot = np.full(n, -1, dtype=np.int64)
    point_pos = np.zeros(n, dtype=np.int64)
    for i in rng.permutation(n):
        if not valid[i]:
            continue
        if direct:
            slot = key[i]
        else:
            slot = int(hashed[i])
            for _ in range(cap):
                if keys_t[slot] in (key[i], -1):
                    keys_t[slot] = key[i]
                    break
                slot = (slot + 1) & (cap - 1)
        first[slot] = min(first[slot], i)
        count[slot] += 1
        point_pos[i] = count[slot]  # atomicAdd(count, 1) + 1
        point_slot[i] = slot
    # flags_kernel, in another random order
    flags = np.zeros(n, dtype=np.int64)
    for i in rng.permutation(n):
        s = point_slot[i]
        if s >= 0 and first[s] == i:
            base[s] = cursor + 1
            cursor += count[s] + 1
            flags[i] = 1
    rank, total = exclusive_scan(flags)
    sample_first, sample_base, m = samples_kernel(rank, total, off, n, V)
    rows = padded_rows if padded_rows is not None else sum(min(s, V) for s in sizes)
    # place_kernel
    lst = np.full(n, -1, dtype=np.int64)
    row_slot = np.full(rows, -1, dtype=np.int64)
    for i in range(n):
        s = point_slot[i]
        if s < 0:
            continue
        lst[base[s] + point_pos[i]] = i
        if first[s] != i:
            continue
        b = sample[i]
        local = rank[i] - sample_first[b]
        if local < V and sample_base[b] + local < rows:
            row_slot[sample_base[b] + local] = s
    # emit_hashed_kernel
    voxels = torch.zeros((rows, P, C), dtype=raw.dtype)
    coors = torch.zeros((rows, ncols), dtype=torch.int32)
    num = torch.zeros(rows, dtype=torch.int32)
    for r in range(rows):
        if r >= m:
            coors[r] = -1
            continue
        s = row_slot[r]
        assert s >= 0, f"row {r} < m = {m} has no voxel"
        cnt = count[s] + 1
        stretch = lst[base[s] : base[s] + cnt]
        assert (stretch >= 0).all()
        k = min(cnt, P)
        if cnt <= warp:  # each entry's rank: the number of smaller entries
            rank = (stretch[None, :] < stretch[:, None]).sum(1)
            for v, rk in zip(stretch, rank):
                if rk < k:
                    voxels[r, rk] = raw[v]
        after = -1
        for lo in range(0, k if cnt > warp else 0, warp):
            best = warp_smallest_after(stretch, after, warp)
            for t in range(min(k - lo, warp)):
                voxels[r, lo + t] = raw[best[t]]
            after = int(best[warp - 1])
        num[r] = k
        kk = s if direct else keys_t[s]
        b, cell = kk // cells, kk % cells
        zyx = [cell // (gx * gy), (cell // gx) % gy, cell % gx]
        coors[r] = torch.tensor(([b] if ncols == 4 else []) + zyx, dtype=torch.int32)
    if padded_rows is None:
        return voxels[:m], coors[:m], num[:m], torch.tensor(m)
    return voxels, coors, num, torch.tensor(m)


def pillar_canvas(
    feats_bits: np.ndarray,
    coors: np.ndarray,
    B: int,
    ny: int,
    nx: int,
    *,
    threads: int,
    base_elems: int = 0,
    grid_y: int = 65535,
    grid_z: int = 65535,
    chunk: int | None = None,
):
    """pillar_scatter_musa.mu's forward: fill_map (-1, then the highest pillar of a cell), the
    launcher's choice K = 16 bytes / element (plane % K == 0 and the canvas base 16-byte
    aligned; the base is `base_elems` elements past a 16-byte aligned address) or 1, then
    canvas_vector_kernel (blockIdx.z over samples, blockIdx.y over chunks of `chunk` channels,
    default channel_chunk<W>(): 8 for 32-bit, 4 for 16-bit elements,
    a grid-stride loop of `threads` threads over the K-cell groups of a plane) or canvas_kernel
    (a grid-stride loop with RowCol over (b, yx)). feats_bits [M, C] are the raw element words
    (uint16 / uint32). Returns (canvas words [B, C, ny, nx], how many stores wrote each element,
    K); asserts every vector store is aligned and inside one plane."""
    m, C = feats_bits.shape
    plane = ny * nx
    cell_map = np.full(B * plane, -1, dtype=np.int64)
    for i, (b, _z, y, x) in enumerate(coors.tolist()):  # pillar_map_kernel: atomicMax
        if 0 <= b < B and 0 <= y < ny and 0 <= x < nx:
            cell = (b * ny + y) * nx + x
            cell_map[cell] = max(cell_map[cell], i)
    vector_k = 16 // feats_bits.dtype.itemsize
    K = vector_k if plane % vector_k == 0 and base_elems % vector_k == 0 else 1
    canvas = np.zeros(B * C * plane, dtype=feats_bits.dtype)
    writes = np.zeros(B * C * plane, dtype=np.int64)
    zero = feats_bits.dtype.type(0)

    def pillar(cell):
        p = cell_map[cell]
        return p if 0 <= p < m else -1

    if K == 1:
        cells = B * plane
        for t in range(min(threads, cells)):
            walk = rowcol_thread(t, threads, plane)
            for cell, (row, col) in zip(range(t, cells, threads), walk):
                p = pillar(cell)
                for c in range(C):
                    off = row * C * plane + c * plane + col
                    canvas[off] = feats_bits[p, c] if p >= 0 else zero
                    writes[off] += 1
        return canvas.reshape(B, C, ny, nx), writes.reshape(B, C, ny, nx), K
    groups = plane // K
    if chunk is None:
        chunk = 8 if feats_bits.dtype.itemsize == 4 else 4
    chunks = (C + chunk - 1) // chunk
    for bz in range(min(grid_z, B)):
        for b in range(bz, B, grid_z):
            for by in range(min(grid_y, chunks)):
                for ch in range(by, chunks, grid_y):
                    c0, c1 = ch * chunk, min(C, ch * chunk + chunk)
                    for t in range(min(threads, groups)):
                        for q in range(t, groups, threads):
                            ps = [pillar(b * plane + q * K + k) for k in range(K)]
                            for c in range(c0, c1):
                                off = (b * C + c) * plane + q * K
                                assert (base_elems + off) % K == 0, "misaligned vector store"
                                assert off // plane == (off + K - 1) // plane, "across planes"
                                for k, p in enumerate(ps):  # lower address: the low bits
                                    canvas[off + k] = feats_bits[p, c] if p >= 0 else zero
                                    writes[off + k] += 1
    return canvas.reshape(B, C, ny, nx), writes.reshape(B, C, ny, nx), K


PILLAR_MAX_TILE_CELLS = 4096  # kMaxTileCells
PILLAR_MAX_VISITS = 1 << 24  # kMaxPillarVisits


def pillar_tile_plan(m: int, B: int, plane: int, K: int, sms: int) -> tuple[int, int]:
    """pillar_scatter_musa.mu's tile_plan: (cells per tile, tiles per sample plane), (0, 0) when
    the tiled forward does not apply."""
    if plane <= 0 or B <= 0 or plane % K:
        return 0, 0
    granule = K * 32
    want = -(-(B * plane) // sms)
    cells = min(max(-(-want // granule) * granule, granule), PILLAR_MAX_TILE_CELLS)
    per_image = -(-plane // cells)
    if per_image * B > 2**31 - 1 or (m + 1) * per_image * B > PILLAR_MAX_VISITS:
        return 0, 0
    return cells, per_image


def pillar_canvas_tiled(
    feats_bits: np.ndarray,
    coors: np.ndarray,
    B: int,
    ny: int,
    nx: int,
    *,
    tile_cells: int,
    tiles_per_image: int,
    grid: int,
    threads: int,
    vector_rows: bool,
    unroll: int = 4,
    order=None,
):
    """pillar_scatter_musa.mu's canvas_tile_kernel, block by block: the shared tile map (-1,
    then atomicMax over the pillar pass, `unroll` rows a thread, in `order` of the threads'
    atomics: any order gives the same map), then the items (K cells, kSub channels) of the
    tile's planes. feats_bits [M, C] raw element words. Returns (canvas words [B, C, ny, nx],
    stores per element); asserts every 16-byte store aligned (canvas base aligned) and inside
    one plane, and every shared-map index inside the tile."""
    m, C = feats_bits.shape
    plane = ny * nx
    K = 16 // feats_bits.dtype.itemsize
    ksub = 4 if vector_rows else 1
    assert not vector_rows or C % 4 == 0
    canvas = np.zeros(B * C * plane, dtype=feats_bits.dtype)
    writes = np.zeros(B * C * plane, dtype=np.int64)
    zero = feats_bits.dtype.type(0)
    tiles = B * tiles_per_image
    rng = np.random.default_rng(0) if order == "random" else None
    for block in range(min(grid, tiles)):
        for t in range(block, tiles, grid):
            b = t // tiles_per_image
            t0 = (t - b * tiles_per_image) * tile_cells
            length = min(tile_cells, plane - t0)
            assert length > 0 and length % K == 0
            tile_map = np.full(PILLAR_MAX_TILE_CELLS, -1, dtype=np.int64)
            atomics = []
            for tid in range(threads):
                for base in range(tid, m, unroll * threads):
                    for u in range(unroll):
                        i = base + u * threads
                        rb, _, ry, rx = coors[i if i < m else 0]
                        rb = rb if i < m else -1
                        if rb != b or not (0 <= ry < ny) or not (0 <= rx < nx):
                            continue
                        at = ry * nx + rx - t0
                        if 0 <= at < length:
                            atomics.append((at, i))
            if rng is not None:
                rng.shuffle(atomics)
            for at, i in atomics:
                assert at < PILLAR_MAX_TILE_CELLS
                tile_map[at] = max(tile_map[at], i)
            groups = length // K
            items = groups * (C // ksub)
            for tid in range(threads):
                for it in range(tid, items, threads):
                    chunk, q = divmod(it, groups)
                    rows = [int(tile_map[q * K + k]) for k in range(K)]
                    rows = [r if 0 <= r < m else -1 for r in rows]
                    for j in range(ksub):
                        c = chunk * ksub + j
                        off = (b * C + c) * plane + t0 + q * K
                        assert off % K == 0, "misaligned vector store"
                        assert off // plane == (off + K - 1) // plane, "across planes"
                        for k, r in enumerate(rows):
                            canvas[off + k] = feats_bits[r, c] if r >= 0 else zero
                            writes[off + k] += 1
    return canvas.reshape(B, C, ny, nx), writes.reshape(B, C, ny, nx)


BITMAP_MAX_POINTS_PER_VOXEL = 1024  # kBitmapMaxPointsPerVoxel


def _popcount(words: np.ndarray) -> np.ndarray:
    return np.array([bin(int(x)).count("1") for x in words.reshape(-1)], dtype=np.int64)


def colmax_kernel(coors):
    """dynamic_scatter_musa.mu's colmax_kernel (both voxel_group paths): (the rows as int64, the
    valid-row mask (no negative entry), dims = the column maxima of the valid rows + 1 (0 without
    any; a value beyond int32 does not count), the int32 overflow flag)."""
    c = coors.numpy().astype(np.int64)
    valid = (c >= 0).all(axis=1)
    overflow = bool((c[valid] > INT_MAX).any())
    colmax = np.where(c[valid] > INT_MAX, 0, c[valid]).max(axis=0) if valid.any() else 0
    return c, valid, np.zeros(c.shape[1], dtype=np.int64) + colmax + 1, overflow


def voxel_group_bitmap(coors, cap_keys: int, *, seed=0):
    """voxel_group_bitmap (csrc/voxel/dynamic_scatter_musa.mu), kernel by kernel, with the
    atomics of bitmap_mark_kernel and bitmap_rank_kernel in random orders of the rows (`seed`):
    (voxel_coors, order, starts, counts, point2voxel) cut to M / K, and the fallback flag (1:
    the key range exceeds cap_keys or a value int32; 2: a voxel of more than
    BITMAP_MAX_POINTS_PER_VOXEL rows), in which case the outputs are None."""
    rng = np.random.default_rng(seed)
    c, valid, dims, overflow = colmax_kernel(coors)
    n, ndim = c.shape
    # bitmap_zero_kernel: key_range
    key_range = 1
    for d in dims:
        key_range *= int(d)
        if key_range > cap_keys:
            break
    if overflow or key_range > cap_keys:
        return None, 1
    n_words = (key_range + 31) // 32
    words = np.zeros(n_words, dtype=np.uint64)
    # bitmap_mark_kernel (atomicOr: the order does not matter)
    key = np.zeros(n, dtype=np.int64)
    for col in range(ndim):
        key = key * dims[col] + np.where(valid, c[:, col], 0)
    for i in rng.permutation(n):
        if valid[i]:
            words[key[i] >> 5] |= np.uint64(1) << np.uint64(key[i] & 31)
    # bitmap_count_kernel: per word its popcount's exclusive prefix inside its 32-word block,
    # per block the count (every block of the capacity, zero beyond the range)
    pc = _popcount(words)
    padded = np.zeros((n_words + 31) // 32 * 32, dtype=np.int64)
    padded[:n_words] = pc
    per_block = padded.reshape(-1, 32)
    word_prefix = (np.cumsum(per_block, axis=1) - per_block).reshape(-1)[:n_words]
    block_counts = np.zeros(cap_keys >> 10, dtype=np.int64)
    block_counts[: per_block.shape[0]] = per_block.sum(axis=1)
    prefix, m = exclusive_scan(block_counts)  # the block scan: M is its total
    # bitmap_rank_kernel, its atomicAdd in a random order
    p2v = np.full(n, -1, dtype=np.int64)
    counts = np.zeros(n, dtype=np.int64)
    pos = np.zeros(n, dtype=np.int64)
    vcoors = np.full((n, ndim), -7, dtype=np.int64)
    crowded = False
    for i in rng.permutation(n):
        if not valid[i]:
            continue
        k = int(key[i])
        below = int(words[k >> 5]) & ((1 << (k & 31)) - 1)
        v = int(prefix[k >> 10]) + int(word_prefix[k >> 5]) + bin(below).count("1")
        p2v[i] = v
        pos[i] = counts[v]
        counts[v] += 1
        crowded |= pos[i] >= BITMAP_MAX_POINTS_PER_VOXEL
        if pos[i] == 0:
            vcoors[v] = c[i]
    if crowded:
        return None, 2
    starts, _ = exclusive_scan(counts)  # the count scan
    # bitmap_place_kernel
    lst = np.full(n, -7, dtype=np.int64)
    for i in range(n):
        if p2v[i] >= 0:
            lst[starts[p2v[i]] + pos[i]] = i
    # stable_rank_kernel
    order = np.full(n, -7, dtype=np.int64)
    for i in range(n):
        v = p2v[i]
        if v < 0:
            continue
        s, cnt = int(starts[v]), int(counts[v])
        r = int((lst[s : s + cnt] < i).sum()) if cnt > 1 else 0
        order[s + r] = i
    K = int(valid.sum())
    out = (vcoors[:m], order[:K], starts[:m], counts[:m], p2v)
    return tuple(torch.from_numpy(np.asarray(t)) for t in out), 0
