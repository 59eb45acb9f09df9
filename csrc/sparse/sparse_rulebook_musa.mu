// sparse_rulebook for MUSA and CUDA: the rule book of a sparse convolution / max pool with the
// reference's layout and order (mu_space/ops/_sparse.py, docs/operators/sparse_conv.md "Native
// kernels"), so that native and reference rule books are equal element by element.
//
// Entry points (mu_space/ops/_sparse_native.py runs them in this order, on the caller's stream):
//   sparse_rulebook_subm       a SubM rule book in one call: the input table, the pairs (the
//                              kernels of sparse_rulebook_forward mode 0, or where the offsets
//                              come in mirror pairs the lookups of half of them, each pair also
//                              written for its mirror), out_indices = a copy of indices, and
//                              (when asked) the flags read back and returned; its table can be
//                              a PackedTable (key and row in one 64-bit slot) over grids of
//                              fewer than 2^31 cells (use_packed)
// strided / transposed:
//   sparse_hash_insert         the table of the input keys (rows -> keys, checked against
//                              [0, batch) x [0, spatial_shape): header[kBad]; a repeated key
//                              keeps its first row: header[kDup]), or of the output keys
//                              (int64 keys -> their positions)
//   sparse_rulebook_candidates strided / transposed: the key each (offset k, input j) reaches,
//                              cand[k * N + j] (kNoKey where none); the caller sorts them (torch)
//   sparse_rulebook_unique     the sorted unique keys (run starts of the sorted candidates,
//                              exclusive scan): uniq[0 .. M), header[kCount] = M
//   sparse_rulebook_forward    the pairs: per (k, j) the reached key looked up in the table (SubM:
//                              the input table, else the output table) -> output row or -1, and
//                              a stable compaction per offset (pairs stay in ascending input
//                              row) over tiles of 2048 inputs: the lookups count each tile's
//                              pairs, a block per offset scans its tiles' counts (-> the K
//                              counts), and each tile emits its pairs at its prefix plus a block
//                              scan and writes the -1 padding of its positions past the count
//   sparse_rulebook_decode     uniq keys -> out_indices [M, ndim + 1] (b, spatial...)
// or, strided / transposed over an output grid of at most a few cells per candidate (the caller
// picks), a bitmap of the output grid instead of the sort, the unique keys and the output table:
//   sparse_rulebook_mark       the bitmap (a bit per cell of batch x out_shape, uint32 words):
//                              zeroed, a bit set per reached cell (atomicOr, skipped where a
//                              plain read already sees it), the popcount of each word and their
//                              exclusive scan: prefix[w], header[kCount] = M. The rank of a set
//                              bit is its output row: the ascending keys of the sorted path
//   sparse_rulebook_forward_bitmap  sparse_rulebook_forward with the rank as the lookup
//   sparse_rulebook_decode_bitmap   a thread per word: its set bits -> out_indices rows
//
// No host synchronisation here except sparse_rulebook_subm's flag read; the caller reads the
// int32 header [4] (bad rows, duplicates, M, table full) once. Every data-dependent index is
// bounds-checked (rows, slots, keys).

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>

#include <climits>
#include <cstdint>

#include "build_facts.muh"
#include "checks.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "readback.muh"
#include "scan.muh"
#include "sparse_common.muh"

namespace muspace {
namespace sparse {
namespace {

using tvm::ffi::Shape;

static_assert(kBlock == scan::kBlock, "one block size for the scan and the rule-book kernels");

// candidates K * N (and the scan's K * N + 1 entries) are int32-indexed
constexpr int64_t kMaxCandidates = INT_MAX - 1;
MUSPACE_LIMIT(sparse_rulebook, max_candidates, kMaxCandidates);
constexpr int64_t kMaxKernelVolume = 4096;
constexpr int64_t kKeyLimit = int64_t{1} << 62;
// bitmap words (and their scan's entries) are int32-indexed
constexpr int64_t kMaxBitmapWords = INT_MAX - 1;
MUSPACE_LIMIT(sparse_rulebook, max_bitmap_words, kMaxBitmapWords);

// int32 header
constexpr int kBad = 0;    // a row outside [0, batch) x [0, shape)
constexpr int kDup = 1;    // a key inserted twice
constexpr int kCount = 2;  // M, the unique output keys
constexpr int kFull = 3;   // an insert found no free slot (impossible at capacity >= 2n)
constexpr int kHeaderInts = 4;

int blocks_for(int64_t n, int device_id) { return grid_for(n, kBlock, device_id, kBlocksPerSm); }

// ------------------------------------------------------------------------------ kernels

// Table: SplitTable or PackedTable (sparse_common.muh). copy (may be null): each row is also
// copied there (sparse_rulebook_subm's out_indices). minus_one [minus_one_count] is set to -1
// and zero [zero_count] to 0 (sparse_rulebook_subm's mirror offsets: their out_row and tile
// counts, which the lookups fill in by scatter).
template <typename Table>
__global__ void __launch_bounds__(kBlock)
    insert_rows_kernel(const int* __restrict__ indices, int n, int ndim, Geometry g, Table table,
                       int* __restrict__ header, int* __restrict__ copy,
                       int* __restrict__ minus_one, int64_t minus_one_count, int* __restrict__ zero,
                       int64_t zero_count) {
  for (int64_t e = global_thread(); e < minus_one_count; e += global_threads()) minus_one[e] = -1;
  for (int64_t e = global_thread(); e < zero_count; e += global_threads()) zero[e] = 0;
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int* row = indices + i * (ndim + 1);
    if (copy != nullptr) {
      for (int c = 0; c <= ndim; ++c) copy[i * (ndim + 1) + c] = row[c];
    }
    const int64_t key = site_key(row, ndim, g.batch, g.in_shape);
    if (key < 0) {
      atomicOr(header + kBad, 1);
      continue;
    }
    const int r = table.insert(key, static_cast<int>(i));
    if (r == kDuplicate) atomicOr(header + kDup, 1);
    if (r == kTableFull) atomicOr(header + kFull, 1);
  }
}

// sparse_rulebook_subm's packed table: every slot free (all ones, 16 bytes a store: the slots
// are 16-byte aligned and even in number) and the header zeroed, in one launch.
__global__ void __launch_bounds__(kBlock)
    init_packed_kernel(uint4* __restrict__ slot_pairs, int64_t count, int* __restrict__ header) {
  for (int64_t e = global_thread(); e < count; e += global_threads()) {
    slot_pairs[e] = make_uint4(~0u, ~0u, ~0u, ~0u);
  }
  if (global_thread() < kHeaderInts) header[global_thread()] = 0;
}

__global__ void __launch_bounds__(kBlock)
    insert_keys_kernel(const int64_t* __restrict__ src, int n, int64_t* __restrict__ keys,
                       int* __restrict__ vals, uint64_t mask, int* __restrict__ header) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int64_t key = src[i];
    if (key < 0 || key == kNoKey) {
      atomicOr(header + kBad, 1);
      continue;
    }
    const int r = hash_insert(keys, vals, mask, key, static_cast<int>(i));
    if (r == kDuplicate) atomicOr(header + kDup, 1);
    if (r == kTableFull) atomicOr(header + kFull, 1);
  }
}

__global__ void __launch_bounds__(kBlock)
    candidates_kernel(const int* __restrict__ indices, int n, Geometry g, int64_t total,
                      int64_t* __restrict__ cand) {
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t k = e / n;
    const int64_t j = e - k * n;
    const int64_t key = reached_key(g, indices + j * (g.ndim + 1), k);
    cand[e] = key >= 0 ? key : kNoKey;
  }
}

__device__ __forceinline__ bool run_start(const int64_t* sorted, int64_t p) {
  const int64_t k = sorted[p];
  return k != kNoKey && k >= 0 && (p == 0 || sorted[p - 1] != k);
}

__global__ void __launch_bounds__(kBlock)
    run_flags_kernel(const int64_t* __restrict__ sorted, int64_t total, int* __restrict__ flags) {
  for (int64_t p = global_thread(); p < total; p += global_threads()) {
    flags[p] = run_start(sorted, p) ? 1 : 0;
  }
}

__global__ void __launch_bounds__(kBlock)
    run_emit_kernel(const int64_t* __restrict__ sorted, int64_t total, const int* __restrict__ scan,
                    int64_t* __restrict__ uniq) {
  for (int64_t p = global_thread(); p < total; p += global_threads()) {
    if (!run_start(sorted, p)) continue;
    const int row = scan[p];
    if (row >= 0 && row < total) uniq[row] = sorted[p];
  }
}

// key -> row through the hash table
struct TableLookup {
  const int64_t* __restrict__ keys;
  const int* __restrict__ vals;
  uint64_t mask;
  __device__ __forceinline__ int operator()(int64_t key) const {
    return hash_lookup(keys, vals, mask, key);
  }
};

// key -> the rank of its bit among the set bits of the bitmap (-1 when clear)
struct BitmapLookup {
  const uint32_t* __restrict__ words;
  const int* __restrict__ prefix;
  int64_t n_words;
  __device__ __forceinline__ int operator()(int64_t key) const {
    const int64_t w = key >> 5;
    if (w >= n_words) return -1;
    const uint32_t word = words[w];
    const uint32_t bit = 1u << (key & 31);
    return (word & bit) != 0u ? prefix[w] + __popc(word & (bit - 1u)) : -1;
  }
};

// The pairs' compaction: offset k's inputs in tiles of kPairTile; block b = k * tiles + t. The
// emit stages a tile's pairs in shared memory (2 x 8 KB: MUSA's static budget is < 28 KB).
constexpr int kPairItems = 8;
constexpr int kPairTile = kBlock * kPairItems;

// Per (k, j) of the block's tile: the output row (-1: none) into out_row[k N + j] and the
// tile's count of pairs into tile_count[b]. Items strided by kBlock: coalesced.
template <typename Lookup>
__global__ void __launch_bounds__(kBlock)
    pair_lookup_kernel(const int* __restrict__ indices, int n, int tiles, Geometry g, Lookup lookup,
                       int n_rows, int* __restrict__ out_row, int* __restrict__ tile_count) {
  __shared__ int s[kBlock];
  const int64_t b = blockIdx.x;
  const int64_t k = b / tiles;
  const int64_t j0 = (b - k * tiles) * kPairTile + threadIdx.x;
  const OffsetReach reach = offset_reach(g, k);
  int mine = 0;
#pragma unroll 4
  for (int i = 0; i < kPairItems; ++i) {
    const int64_t j = j0 + static_cast<int64_t>(i) * kBlock;
    if (j >= n) break;
    const int64_t key = reached_key_at(g, reach, indices + j * (g.ndim + 1));
    int row = key >= 0 ? lookup(key) : -1;
    if (row >= n_rows) row = -1;  // a row the table cannot hold (bad input): no pair
    out_row[k * n + j] = row;
    mine += row >= 0 ? 1 : 0;
  }
  const int total = scan::block_sum(mine, s);
  if (threadIdx.x == 0) tile_count[b] = total;
}

// SubM whose reach is symmetric (2 pad = (ksize - 1) dil on every axis): offsets k and
// K - 1 - k are mirrors, and over distinct sites input j reaches row i through k exactly when i
// reaches j through K - 1 - k. So only the offsets k < K - 1 - k look up (half the lookups):
// each pair (j -> i) found is also written as out_row[K - 1 - k][i] = j (that slot prefilled
// with -1, by sparse_rulebook_subm's insert) and counted in the mirror's tile of i (a block's
// counts gathered in shared memory, then one atomicAdd per tile into the zeroed tile_count).
// The centre offset (k = K - 1 - k, a zero reach) pairs every row inside the grid with itself.
// Grid: the offsets k <= K - 1 - k x tiles (tiles <= kMaxMirrorTiles). Repeated sites break the
// one-to-one map: then the rows may differ from the full lookup's, all indices stay in bounds,
// and the caller discards the result (the insert flagged them).
constexpr int kMaxMirrorTiles = 4096;

template <typename Lookup>
__global__ void __launch_bounds__(kBlock)
    mirror_pair_lookup_kernel(const int* __restrict__ indices, int n, int tiles, int k_volume,
                              Geometry g, Lookup lookup, int* __restrict__ out_row,
                              int* __restrict__ tile_count) {
  __shared__ int s[kBlock];
  __shared__ int mirror_count[kMaxMirrorTiles];
  const int64_t b = blockIdx.x;
  const int64_t k = b / tiles;
  const int64_t mirror = k_volume - 1 - k;
  const int64_t j0 = (b - k * tiles) * kPairTile + threadIdx.x;
  const OffsetReach reach = offset_reach(g, k);
  int mine = 0;
  if (k == mirror) {
#pragma unroll 4
    for (int i = 0; i < kPairItems; ++i) {
      const int64_t j = j0 + static_cast<int64_t>(i) * kBlock;
      if (j >= n) break;
      const bool inside = reached_key_at(g, reach, indices + j * (g.ndim + 1)) >= 0;
      out_row[k * n + j] = inside ? static_cast<int>(j) : -1;
      mine += inside ? 1 : 0;
    }
  } else {
    for (int t = threadIdx.x; t < tiles; t += kBlock) mirror_count[t] = 0;
    __syncthreads();
    int* mirror_row = out_row + mirror * n;
    // a thread's pairs mostly land in one mirror tile (its inputs' neighbours): counted in a
    // run per tile, one shared atomic per run instead of per pair
    int run_tile = -1;
    int run = 0;
#pragma unroll 4
    for (int i = 0; i < kPairItems; ++i) {
      const int64_t j = j0 + static_cast<int64_t>(i) * kBlock;
      if (j >= n) break;
      const int64_t key = reached_key_at(g, reach, indices + j * (g.ndim + 1));
      int row = key >= 0 ? lookup(key) : -1;
      if (row >= n) row = -1;  // a row the table cannot hold (bad input): no pair
      out_row[k * n + j] = row;
      if (row >= 0) {
        mirror_row[row] = static_cast<int>(j);
        const int tile = row / kPairTile;
        if (tile != run_tile) {
          if (run != 0) atomicAdd(mirror_count + run_tile, run);
          run_tile = tile;
          run = 0;
        }
        ++run;
        ++mine;
      }
    }
    if (run != 0) atomicAdd(mirror_count + run_tile, run);
    __syncthreads();
    for (int t = threadIdx.x; t < tiles; t += kBlock) {
      if (mirror_count[t] != 0) atomicAdd(tile_count + mirror * tiles + t, mirror_count[t]);
    }
  }
  const int total = scan::block_sum(mine, s);
  if (threadIdx.x == 0) tile_count[b] = total;
}

// A block per offset k: tile_prefix[k * tiles + t] = the pairs of k's tiles before t, num[k]
// = k's pairs.
__global__ void __launch_bounds__(kBlock)
    pair_tile_scan_kernel(int tiles, const int* __restrict__ tile_count,
                          int* __restrict__ tile_prefix, int* __restrict__ num) {
  __shared__ int s[kBlock];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * tiles;
  int carry = 0;
  for (int t0 = 0; t0 < tiles; t0 += kBlock) {
    const int t = t0 + static_cast<int>(threadIdx.x);
    const int v = t < tiles ? tile_count[base + t] : 0;
    int total = 0;
    const int before = scan::block_exclusive_scan(v, s, total);
    if (t < tiles) tile_prefix[base + t] = carry + before;
    carry += total;
  }
  if (threadIdx.x == 0) num[blockIdx.x] = carry;
}

// The block's tile of offset k: its pairs at slot tile_prefix[b] + (pairs before them in the
// tile: a block scan over runs of kPairItems consecutive inputs per thread), staged in shared
// memory in that order and then written out by consecutive threads (coalesced: writing them
// from the thread that found them, each thread a different run of slots, took 33.7 us at
// CenterPoint's 118561 rows x 27 offsets on the H200, 2026-12-04), then -1 at the tile's
// positions j >= num[k] (pairs [K, 2, N]: every position written once, by the emit or here, so
// no fill beforehand).
__global__ void __launch_bounds__(kBlock)
    pair_emit_kernel(int n, int tiles, const int* __restrict__ out_row,
                     const int* __restrict__ tile_prefix, const int* __restrict__ num,
                     int* __restrict__ pairs) {
  __shared__ int s[kBlock];
  __shared__ int staged_in[kPairTile];
  __shared__ int staged_out[kPairTile];
  const int64_t b = blockIdx.x;
  const int64_t k = b / tiles;
  const int64_t tile0 = (b - k * tiles) * kPairTile;
  const int64_t j0 = tile0 + static_cast<int64_t>(threadIdx.x) * kPairItems;
  const int* rows = out_row + k * n;
  int row[kPairItems];
  int mine = 0;
#pragma unroll
  for (int i = 0; i < kPairItems; ++i) {
    row[i] = j0 + i < n ? rows[j0 + i] : -1;
    mine += row[i] >= 0 ? 1 : 0;
  }
  int total = 0;
  int local = scan::block_exclusive_scan(mine, s, total);
#pragma unroll
  for (int i = 0; i < kPairItems; ++i) {
    if (row[i] < 0) continue;
    staged_in[local] = static_cast<int>(j0 + i);
    staged_out[local] = row[i];
    ++local;
  }
  __syncthreads();
  int* in_side = pairs + 2 * k * n;
  int* out_side = in_side + n;
  const int base = tile_prefix[b];
  for (int e = threadIdx.x; e < total; e += kBlock) {
    const int64_t slot = static_cast<int64_t>(base) + e;
    if (slot >= 0 && slot < n) {
      in_side[slot] = staged_in[e];
      out_side[slot] = staged_out[e];
    }
  }
  const int count = num[k];
#pragma unroll 4
  for (int i = 0; i < kPairItems; ++i) {
    const int64_t j = tile0 + static_cast<int64_t>(i) * kBlock + threadIdx.x;
    if (j < n && j >= count) {
      in_side[j] = -1;
      out_side[j] = -1;
    }
  }
}

// key (b * prod(out_shape) + row-major site) -> (b, q...) at row; 32-bit divisions where a
// batch's grid has at most INT_MAX cells (every LiDAR grid here)
__device__ __forceinline__ void decode_key(int64_t key, const Geometry& g, int* __restrict__ row) {
  if (key < 0) key = 0;  // bad input: a valid site instead of an unbounded value
  int64_t cells = 1;
#pragma unroll
  for (int a = 0; a < kMaxNdim; ++a) {
    if (a < g.ndim) cells *= g.out_shape[a];
  }
  const int64_t b = key / cells;
  int64_t rest = key - b * cells;
  if (cells <= INT_MAX) {
    uint32_t r = static_cast<uint32_t>(rest);
#pragma unroll
    for (int i = 0; i < kMaxNdim; ++i) {
      const int a = kMaxNdim - 1 - i;
      if (a >= g.ndim) continue;
      const uint32_t size = static_cast<uint32_t>(g.out_shape[a]);
      row[a + 1] = static_cast<int>(r % size);
      r /= size;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kMaxNdim; ++i) {
      const int a = kMaxNdim - 1 - i;
      if (a >= g.ndim) continue;
      row[a + 1] = static_cast<int>(rest % g.out_shape[a]);
      rest /= g.out_shape[a];
    }
  }
  row[0] = static_cast<int>(b < INT_MAX ? b : INT_MAX);
}

__global__ void __launch_bounds__(kBlock)
    decode_kernel(const int64_t* __restrict__ keys, int m, Geometry g, int* __restrict__ out) {
  for (int64_t r = global_thread(); r < m; r += global_threads()) {
    decode_key(keys[r], g, out + r * (g.ndim + 1));
  }
}

// ------------------------------------------------------------------------- bitmap kernels

// The block's tile of offset k (the pair kernels' tiling: the offset decoded once per thread).
__global__ void __launch_bounds__(kBlock)
    mark_kernel(const int* __restrict__ indices, int n, int tiles, Geometry g,
                uint32_t* __restrict__ words) {
  const int64_t b = blockIdx.x;
  const int64_t k = b / tiles;
  const int64_t j0 = (b - k * tiles) * kPairTile + threadIdx.x;
  const OffsetReach reach = offset_reach(g, k);
#pragma unroll 4
  for (int i = 0; i < kPairItems; ++i) {
    const int64_t j = j0 + static_cast<int64_t>(i) * kBlock;
    if (j >= n) break;
    const int64_t key = reached_key_at(g, reach, indices + j * (g.ndim + 1));
    if (key < 0) continue;
    uint32_t* word = words + (key >> 5);
    const uint32_t bit = 1u << (key & 31);
    // most cells are reached by several (k, j): a plain read (possibly stale: then the
    // idempotent atomicOr runs anyway) skips the atomic for the bits already set
    if ((*word & bit) == 0u) atomicOr(word, bit);
  }
}

__global__ void __launch_bounds__(kBlock)
    popcount_kernel(const uint32_t* __restrict__ words, int64_t n_words, int* __restrict__ counts) {
  for (int64_t w = global_thread(); w < n_words; w += global_threads()) {
    counts[w] = __popc(words[w]);
  }
}

__global__ void __launch_bounds__(kBlock)
    decode_bitmap_kernel(const uint32_t* __restrict__ words, const int* __restrict__ prefix,
                         int64_t n_words, int m, Geometry g, int* __restrict__ out) {
  for (int64_t w = global_thread(); w < n_words; w += global_threads()) {
    uint32_t rest = words[w];
    int row = prefix[w];
    while (rest != 0u) {
      const int b = __ffs(static_cast<int>(rest)) - 1;
      rest &= rest - 1u;
      if (row >= 0 && row < m)
        decode_key(w * 32 + b, g, out + static_cast<int64_t>(row) * (g.ndim + 1));
      ++row;
    }
  }
}

// ------------------------------------------------------------------------------ host helpers

int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

// sparse_rulebook_unique's workspace (int32): run-start flags / their scan [T + 1] | tile sums
struct Layout {
  int64_t scan, sums, ints;
};

Layout layout(int64_t total) {
  Layout l;
  l.scan = 0;
  l.sums = round4(total + 1);
  l.ints = l.sums + round4(std::max<int64_t>(scan::scan_tiles(total + 1), 1));
  return l;
}

// bitmap workspace (int32): words [W] (uint32 bits) | prefix [W] | the scan's tile sums
struct BitmapLayout {
  int64_t words, prefix, sums, ints;
};

BitmapLayout bitmap_layout(int64_t n_words) {
  BitmapLayout l;
  l.words = 0;
  l.prefix = round4(n_words);
  l.sums = l.prefix + round4(n_words);
  l.ints = l.sums + round4(std::max<int64_t>(scan::scan_tiles(n_words), 1));
  return l;
}

// W = ceil(batch * prod(out_shape) / 32), checked against kMaxBitmapWords
int64_t bitmap_words(int64_t batch, const int64_t* out_shape, int ndim) {
  int64_t cells = batch;
  for (int a = 0; a < ndim; ++a) {
    if (cells > 32 * kMaxBitmapWords / out_shape[a]) {
      TVM_FFI_THROW(ValueError) << "batch_size * prod(out_shape) exceeds the bitmap limit of "
                                << 32 * kMaxBitmapWords << " cells";
    }
    cells *= out_shape[a];
  }
  return (cells + 31) / 32;
}

// sparse_rulebook_forward's workspace (int32): out_row [K N] | tile counts [K T] | tile
// prefixes [K T], T = the tiles of kPairTile inputs
struct PairLayout {
  int64_t out_row, tile_count, tile_prefix, ints;
  int tiles;
};

PairLayout pair_layout(int64_t k_volume, int64_t n) {
  PairLayout l;
  l.tiles = static_cast<int>(std::max<int64_t>((n + kPairTile - 1) / kPairTile, 1));
  l.out_row = 0;
  l.tile_count = round4(k_volume * n);
  l.tile_prefix = l.tile_count + round4(k_volume * l.tiles);
  l.ints = l.tile_prefix + round4(k_volume * l.tiles);
  return l;
}

void check_candidates(int64_t k_volume, int64_t n) {
  if (n > 0 && k_volume > kMaxCandidates / n) {
    TVM_FFI_THROW(ValueError) << "K * N = " << k_volume << " * " << n
                              << " candidates exceed the native limit of " << kMaxCandidates;
  }
}

void copy_dims(const Shape& s, const char* name, int ndim, int64_t lo, int64_t* out) {
  if (static_cast<int64_t>(s.size()) != ndim) {
    TVM_FFI_THROW(ValueError) << name << " must have " << ndim << " values (one per spatial axis), "
                              << "got " << s.size();
  }
  for (int a = 0; a < ndim; ++a) {
    if (s[a] < lo || s[a] > INT_MAX) {
      TVM_FFI_THROW(ValueError) << name << "[" << a << "] must be in [" << lo << ", " << INT_MAX
                                << "], got " << s[a];
    }
    out[a] = s[a];
  }
}

void check_key_range(int64_t batch, const int64_t* shape, int ndim, const char* what) {
  int64_t v = batch;
  for (int a = 0; a < ndim; ++a) {
    if (v > (kKeyLimit - 1) / shape[a]) {
      TVM_FFI_THROW(ValueError) << "batch_size * prod(" << what
                                << ") exceeds the int64 key range (< 2**62)";
    }
    v *= shape[a];
  }
}

int check_indices(const TensorView& indices, const char* name = "indices") {
  check_gpu_tensor(indices, name);
  check_input(indices, name, indices, kInt32);
  check_ndim(indices, name, 2);
  const int64_t cols = indices.size(1);
  if (cols < 2 || cols > kMaxNdim + 1) {
    TVM_FFI_THROW(ValueError) << name << " must be [N, ndim + 1] (batch, spatial...) with 1 <= "
                              << "ndim <= " << kMaxNdim << ", got " << cols << " columns";
  }
  if (indices.size(0) > INT_MAX) {
    TVM_FFI_THROW(ValueError) << name << " has " << indices.size(0) << " rows; at most " << INT_MAX;
  }
  return static_cast<int>(cols - 1);
}

int64_t check_batch(int64_t batch_size) {
  if (batch_size < 1 || batch_size > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "batch_size must be in [1, " << INT_MAX << "], got " << batch_size;
  }
  return batch_size;
}

// The table (keys [C] int64, vals [C] int32, C a power of two >= 2 * n); returns C - 1.
uint64_t check_table(const TensorView& keys, const TensorView& vals, const TensorView& ref,
                     int64_t n) {
  check_input(keys, "table_keys", ref, kInt64);
  check_ndim(keys, "table_keys", 1);
  const int64_t cap = keys.size(0);
  if (cap < 2 || (cap & (cap - 1)) != 0 || cap < 2 * n) {
    TVM_FFI_THROW(ValueError) << "table_keys must hold a power of two >= max(2, 2 * " << n
                              << ") slots, got " << cap;
  }
  check_vector(vals, "table_vals", ref, kInt32, cap);
  return static_cast<uint64_t>(cap - 1);
}

void check_header(const TensorView& header, const TensorView& ref) {
  check_vector(header, "header", ref, kInt32, kHeaderInts);
}

// the workspace of sparse_rulebook_workspace_ints: `need` int32 at least
void check_workspace(const TensorView& ws, const TensorView& ref, int64_t need) {
  check_input(ws, "workspace", ref, kInt32);
  check_ndim(ws, "workspace", 1);
  if (ws.size(0) < need) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << need << " int32 (from "
                              << "sparse_rulebook_workspace_ints), got " << ws.size(0);
  }
}

void fill_table(const TensorView& keys, const TensorView& vals, int device_id, gpuStream_t st) {
  const int64_t cap = keys.size(0);
  launch_fill(data_of(keys), cap * 8, fill_word(-1), device_id, st, "sparse_hash_insert (keys)");
  launch_fill(data_of(vals), cap * 4, fill_word(kNoRow), device_id, st,
              "sparse_hash_insert (vals)");
}

// ------------------------------------------------------------------------------ entry points

int64_t workspace_ints(int64_t k_volume, int64_t n) {
  if (k_volume < 1 || k_volume > kMaxKernelVolume || n < 0) {
    TVM_FFI_THROW(ValueError) << "sparse_rulebook_workspace_ints: K = " << k_volume << ", N = " << n
                              << " out of range";
  }
  check_candidates(k_volume, n);
  return std::max(layout(k_volume * n).ints, pair_layout(k_volume, n).ints);
}

// source: indices [N, ndim + 1] int32 (key of each row in the grid batch_size x shape; the row
// is its position) or keys [M] int64 (the row is the position). The table is filled here.
void hash_insert_entry(TensorView source, TensorView table_keys, TensorView table_vals,
                       TensorView header, int64_t batch_size, Shape shape, int64_t stream) {
  check_gpu_tensor(source, "source");
  const bool rows = same_dtype(source.dtype(), kInt32);
  Geometry g{};
  int64_t n = 0;
  if (rows) {
    g.ndim = check_indices(source, "source");
    n = source.size(0);
    g.batch = check_batch(batch_size);
    copy_dims(shape, "shape", g.ndim, 1, g.in_shape);
  } else {
    check_input(source, "source", source, kInt64);
    check_ndim(source, "source", 1);
    n = source.size(0);
    if (n > INT_MAX) {
      TVM_FFI_THROW(ValueError) << "source has " << n << " keys; at most " << INT_MAX;
    }
  }
  const uint64_t mask = check_table(table_keys, table_vals, source, n);
  check_header(header, source);
  const int device_id = source.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  fill_table(table_keys, table_vals, device_id, st);
  if (n == 0) return;
  if (rows) {
    const SplitTable table{data_of<int64_t>(table_keys), data_of<int>(table_vals), mask};
    insert_rows_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const int>(source), static_cast<int>(n), g.ndim, g, table, data_of<int>(header),
        nullptr, nullptr, 0, nullptr, 0);
    check_launch("sparse_hash_insert insert_rows_kernel");
  } else {
    insert_keys_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const int64_t>(source), static_cast<int>(n), data_of<int64_t>(table_keys),
        data_of<int>(table_vals), mask, data_of<int>(header));
    check_launch("sparse_hash_insert insert_keys_kernel");
  }
}

Geometry make_geometry(int ndim, int64_t batch_size, const Shape& spatial, const Shape& out_shape,
                       const Shape& ksize, const Shape& stride, const Shape& padding,
                       const Shape& dilation, int mode) {
  Geometry g{};
  g.ndim = ndim;
  g.mode = mode;
  g.batch = check_batch(batch_size);
  copy_dims(spatial, "spatial_shape", ndim, 1, g.in_shape);
  copy_dims(out_shape, "out_shape", ndim, 1, g.out_shape);
  copy_dims(ksize, "kernel_size", ndim, 1, g.ksize);
  copy_dims(stride, "stride", ndim, 1, g.stride);
  copy_dims(padding, "padding", ndim, 0, g.pad);
  copy_dims(dilation, "dilation", ndim, 1, g.dil);
  int64_t k_volume = 1;
  for (int a = 0; a < ndim; ++a) {
    k_volume *= g.ksize[a];
    if (k_volume > kMaxKernelVolume) {
      TVM_FFI_THROW(ValueError) << "kernel_size has more than " << kMaxKernelVolume << " offsets";
    }
  }
  check_key_range(g.batch, g.in_shape, ndim, "spatial_shape");
  check_key_range(g.batch, g.out_shape, ndim, "out_shape");
  return g;
}

int64_t kernel_volume(const Geometry& g) {
  int64_t k = 1;
  for (int a = 0; a < g.ndim; ++a) k *= g.ksize[a];
  return k;
}

void candidates_entry(TensorView indices, TensorView cand, int64_t batch_size, Shape spatial,
                      Shape out_shape, Shape ksize, Shape stride, Shape padding, Shape dilation,
                      bool transposed, int64_t stream) {
  const int ndim = check_indices(indices);
  const Geometry g = make_geometry(ndim, batch_size, spatial, out_shape, ksize, stride, padding,
                                   dilation, transposed ? kTransposed : kStrided);
  const int64_t n = indices.size(0);
  const int64_t k_volume = kernel_volume(g);
  check_candidates(k_volume, n);
  check_vector(cand, "cand", indices, kInt64, k_volume * n);
  if (n == 0) return;
  const int device_id = indices.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  candidates_kernel<<<blocks_for(k_volume * n, device_id), kBlock, 0, st>>>(
      data_of<const int>(indices), static_cast<int>(n), g, k_volume * n, data_of<int64_t>(cand));
  check_launch("sparse_rulebook_candidates candidates_kernel");
}

// sorted_keys [T] int64 ascending (kNoKey last) -> uniq [T] (the first M entries written),
// header[kCount] = M.
void unique_entry(TensorView sorted_keys, TensorView uniq, TensorView workspace, TensorView header,
                  int64_t stream) {
  check_gpu_tensor(sorted_keys, "sorted_keys");
  check_input(sorted_keys, "sorted_keys", sorted_keys, kInt64);
  check_ndim(sorted_keys, "sorted_keys", 1);
  const int64_t total = sorted_keys.size(0);
  if (total > kMaxCandidates) {
    TVM_FFI_THROW(ValueError) << "sorted_keys has " << total << " entries; at most "
                              << kMaxCandidates;
  }
  check_vector(uniq, "uniq", sorted_keys, kInt64, total);
  check_workspace(workspace, sorted_keys, layout(total).ints);
  check_header(header, sorted_keys);
  const int device_id = sorted_keys.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* head = data_of<int>(header);
  if (total == 0) {
    launch_zero(head + kCount, 4, device_id, st, "sparse_rulebook_unique (count)");
    return;
  }
  const Layout l = layout(total);
  int* ws = data_of<int>(workspace);
  int* flags = ws + l.scan;
  run_flags_kernel<<<blocks_for(total, device_id), kBlock, 0, st>>>(
      data_of<const int64_t>(sorted_keys), total, flags);
  check_launch("sparse_rulebook_unique run_flags_kernel");
  scan::exclusive_scan(flags, flags, total, ws + l.sums, head + kCount, st,
                       "sparse_rulebook_unique scan");
  run_emit_kernel<<<blocks_for(total, device_id), kBlock, 0, st>>>(
      data_of<const int64_t>(sorted_keys), total, flags, data_of<int64_t>(uniq));
  check_launch("sparse_rulebook_unique run_emit_kernel");
}

// The checks of both forward entry points (pairs [K, 2, N], pair_num [K], the workspace of
// K * N candidates, 0 <= n_rows <= INT_MAX) -> the geometry.
Geometry check_forward(const TensorView& indices, const TensorView& workspace,
                       const TensorView& pairs, const TensorView& pair_num, int64_t batch_size,
                       const Shape& spatial, const Shape& out_shape, const Shape& ksize,
                       const Shape& stride, const Shape& padding, const Shape& dilation,
                       int64_t mode, int64_t n_rows) {
  const int ndim = check_indices(indices);
  if (mode != kSubm && mode != kStrided && mode != kTransposed) {
    TVM_FFI_THROW(ValueError) << "mode must be 0 (subm), 1 (strided) or 2 (transposed), got "
                              << mode;
  }
  const Geometry g = make_geometry(ndim, batch_size, spatial, out_shape, ksize, stride, padding,
                                   dilation, static_cast<int>(mode));
  const int64_t n = indices.size(0);
  const int64_t k_volume = kernel_volume(g);
  check_candidates(k_volume, n);
  if (n_rows < 0 || n_rows > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "n_rows must be in [0, " << INT_MAX << "], got " << n_rows;
  }
  check_workspace(workspace, indices, pair_layout(k_volume, n).ints);
  check_input(pairs, "pairs", indices, kInt32);
  check_ndim(pairs, "pairs", 3);
  check_size(pairs, "pairs", 0, k_volume);
  check_size(pairs, "pairs", 1, 2);
  check_size(pairs, "pairs", 2, n);
  check_vector(pair_num, "pair_num", indices, kInt32, k_volume);
  return g;
}

// The scan of each offset's tile counts (-> pair_num) and the emit with the -1 padding, after
// the lookups wrote out_row and tile_count (l: the pair workspace at ws).
void launch_scan_emit(const PairLayout& l, int64_t k_volume, int64_t n, int* ws,
                      const TensorView& pairs, const TensorView& pair_num, gpuStream_t st,
                      const char* what) {
  pair_tile_scan_kernel<<<static_cast<unsigned>(k_volume), kBlock, 0, st>>>(
      l.tiles, ws + l.tile_count, ws + l.tile_prefix, data_of<int>(pair_num));
  check_launch(what);
  pair_emit_kernel<<<static_cast<unsigned>(k_volume * l.tiles), kBlock, 0, st>>>(
      static_cast<int>(n), l.tiles, ws + l.out_row, ws + l.tile_prefix,
      data_of<const int>(pair_num), data_of<int>(pairs));
  check_launch(what);
}

// Per (k, j) the reached key's output row (`lookup`, rows >= n_rows dropped), the exclusive scan
// of the flags, the -1 fill, the emit and the K counts. pairs and pair_num are written in full.
template <typename Lookup>
void launch_pairs(const TensorView& indices, const Geometry& g, Lookup lookup, int64_t n_rows,
                  int* ws, const TensorView& pairs, const TensorView& pair_num, int device_id,
                  gpuStream_t st, const char* what) {
  const int64_t n = indices.size(0);
  const int64_t k_volume = kernel_volume(g);
  if (n == 0) {
    launch_zero(data_of(pair_num), k_volume * 4, device_id, st, what);
    return;
  }
  const PairLayout l = pair_layout(k_volume, n);
  const int64_t blocks = k_volume * l.tiles;  // <= K N <= INT_MAX - 1
  pair_lookup_kernel<<<static_cast<unsigned>(blocks), kBlock, 0, st>>>(
      data_of<const int>(indices), static_cast<int>(n), l.tiles, g, lookup,
      static_cast<int>(n_rows), ws + l.out_row, ws + l.tile_count);
  check_launch(what);
  launch_scan_emit(l, k_volume, n, ws, pairs, pair_num, st, what);
}

// mode 0 SubM (table = the input keys, n_rows = N), 1 strided, 2 transposed (table = the output
// keys, n_rows = M). pairs [K, 2, N] and pair_num [K] are written in full.
void forward_entry(TensorView indices, TensorView table_keys, TensorView table_vals,
                   TensorView workspace, TensorView pairs, TensorView pair_num, int64_t batch_size,
                   Shape spatial, Shape out_shape, Shape ksize, Shape stride, Shape padding,
                   Shape dilation, int64_t mode, int64_t n_rows, int64_t stream) {
  const Geometry g = check_forward(indices, workspace, pairs, pair_num, batch_size, spatial,
                                   out_shape, ksize, stride, padding, dilation, mode, n_rows);
  const uint64_t mask = check_table(table_keys, table_vals, indices, n_rows);
  const int device_id = indices.device().device_id;
  DeviceGuard guard(device_id);
  const TableLookup lookup{data_of<const int64_t>(table_keys), data_of<const int>(table_vals),
                           mask};
  launch_pairs(indices, g, lookup, n_rows, data_of<int>(workspace), pairs, pair_num, device_id,
               as_stream(stream), "sparse_rulebook_forward");
}

// ------------------------------------------------------------------------- SubM in one call

// sparse_rulebook_subm's workspace (int32 offsets): the table's keys [C] int64 | its vals [C] |
// the header [4] | the pairs' workspace, C = the power of two >= max(2, 2 n) of
// _sparse_native.table_capacity; over grids of fewer than 2^31 cells the keys region holds the
// PackedTable's C 64-bit slots instead and vals is unused. C is even, so the header's 16 bytes
// are 8-byte aligned (the read-back copies them as two int64).
struct SubmLayout {
  int64_t capacity, vals, header, pairs, ints;
};

SubmLayout subm_layout(int64_t k_volume, int64_t n) {
  SubmLayout l;
  l.capacity = 2;
  while (l.capacity < 2 * n) l.capacity *= 2;
  l.vals = 2 * l.capacity;
  l.header = l.vals + l.capacity;
  l.pairs = l.header + kHeaderInts;
  l.ints = l.pairs + pair_layout(k_volume, n).ints;
  return l;
}

int64_t subm_workspace_ints(int64_t k_volume, int64_t n) {
  if (k_volume < 1 || k_volume > kMaxKernelVolume || n < 0 || n > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "sparse_rulebook_subm_workspace_ints: K = " << k_volume
                              << ", N = " << n << " out of range";
  }
  check_candidates(k_volume, n);
  return subm_layout(k_volume, n).ints;
}

// Whether a SubM geometry's offsets come in mirror pairs (2 pad = (ksize - 1) dil on every
// axis: the reach of offset K - 1 - k is minus that of k), so mirror_pair_lookup_kernel can
// serve it over n rows.
bool mirrored(const Geometry& g, int64_t n) {
  for (int a = 0; a < g.ndim; ++a) {
    if (2 * g.pad[a] != (g.ksize[a] - 1) * g.dil[a]) return false;
  }
  return (n + kPairTile - 1) / kPairTile <= kMaxMirrorTiles;
}

// A SubM rule book in one call (the host time of one entry instead of an insert, a forward and
// the torch ops between them; H200, 2026-12-03: 190 us of host time per SubM rule book, 42 us
// of it in the two entries): the table of the input keys, the pairs (mode 0), out_indices = a
// copy of indices (written by the insert). With read_flags the header is read back right after
// the insert and waited for once the pairs' kernels are queued (readback.muh), and the flags
// are returned: bit 0 a row outside [0, batch) x [0, spatial_shape), bit 1 a repeated site,
// bit 2 a full table (impossible at capacity >= 2 n); without, -1 and no wait. With use_mirror
// and a mirrored geometry the lookups are mirror_pair_lookup_kernel's (half of them); the
// result is the same for distinct sites inside the grid, and unspecified (in bounds) where the
// flags are set, which the caller answers with the reference. With use_packed and a grid of
// fewer than 2^31 cells the table is a PackedTable (one init launch instead of three fills, one
// compare-and-swap per insert, key and row in one load), else the int64-key table; the same
// rule book either way.
int64_t subm_entry(TensorView indices, TensorView workspace, TensorView pairs, TensorView pair_num,
                   TensorView out_indices, int64_t batch_size, Shape spatial, Shape ksize,
                   Shape padding, Shape dilation, bool read_flags, bool use_mirror, bool use_packed,
                   int64_t stream) {
  const int ndim = check_indices(indices);
  Geometry g{};
  g.ndim = ndim;
  g.mode = kSubm;
  g.batch = check_batch(batch_size);
  copy_dims(spatial, "spatial_shape", ndim, 1, g.in_shape);
  copy_dims(spatial, "spatial_shape", ndim, 1, g.out_shape);
  copy_dims(ksize, "kernel_size", ndim, 1, g.ksize);
  copy_dims(padding, "padding", ndim, 0, g.pad);
  copy_dims(dilation, "dilation", ndim, 1, g.dil);
  for (int a = 0; a < ndim; ++a) g.stride[a] = 1;
  check_key_range(g.batch, g.in_shape, ndim, "spatial_shape");
  int64_t k_volume = 1;
  for (int a = 0; a < ndim; ++a) {
    k_volume *= g.ksize[a];
    if (k_volume > kMaxKernelVolume) {
      TVM_FFI_THROW(ValueError) << "kernel_size has more than " << kMaxKernelVolume << " offsets";
    }
  }
  const int64_t n = indices.size(0);
  check_candidates(k_volume, n);
  const SubmLayout l = subm_layout(k_volume, n);
  check_workspace(workspace, indices, l.ints);
  check_input(pairs, "pairs", indices, kInt32);
  check_ndim(pairs, "pairs", 3);
  check_size(pairs, "pairs", 0, k_volume);
  check_size(pairs, "pairs", 1, 2);
  check_size(pairs, "pairs", 2, n);
  check_vector(pair_num, "pair_num", indices, kInt32, k_volume);
  check_input(out_indices, "out_indices", indices, kInt32);
  check_same_shape(out_indices, "out_indices", indices, "indices");
  const int device_id = indices.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* ws = data_of<int>(workspace);
  int* header = ws + l.header;
  const uint64_t mask = static_cast<uint64_t>(l.capacity - 1);
  int64_t cells = g.batch;  // < 2^62 (check_key_range)
  for (int a = 0; a < ndim; ++a) cells *= g.in_shape[a];
  const bool packed = use_packed && cells <= kPackedKeys;
  if (packed) {  // the keys region holds the 64-bit slots, vals is unused
    init_packed_kernel<<<blocks_for(l.capacity / 2, device_id), kBlock, 0, st>>>(
        reinterpret_cast<uint4*>(ws), l.capacity / 2, header);
    check_launch("sparse_rulebook_subm init_packed_kernel");
  } else {
    launch_fill(ws, l.capacity * 8, fill_word(-1), device_id, st, "sparse_rulebook_subm (keys)");
    launch_fill(ws + l.vals, l.capacity * 4, fill_word(kNoRow), device_id, st,
                "sparse_rulebook_subm (vals)");
    launch_zero(header, kHeaderInts * 4, device_id, st, "sparse_rulebook_subm (header)");
  }
  const bool mirror = use_mirror && n > 0 && mirrored(g, n);
  const PairLayout pl = pair_layout(k_volume, n);
  int* pws = ws + l.pairs;
  // the mirror offsets K - 1 - k > k: out_row rows and tile counts prefilled by the insert
  const int64_t first_mirror = (k_volume + 1) / 2;
  const auto insert = [&](auto table) {
    if (n == 0) return;
    insert_rows_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const int>(indices), static_cast<int>(n), ndim, g, table, header,
        data_of<int>(out_indices), pws + pl.out_row + first_mirror * n,
        mirror ? (k_volume - first_mirror) * n : 0, pws + pl.tile_count + first_mirror * pl.tiles,
        mirror ? (k_volume - first_mirror) * pl.tiles : 0);
    check_launch("sparse_rulebook_subm insert_rows_kernel");
  };
  const auto pairs_of = [&](auto lookup) {
    if (!mirror) {
      launch_pairs(indices, g, lookup, n, pws, pairs, pair_num, device_id, st,
                   "sparse_rulebook_subm");
      return;
    }
    mirror_pair_lookup_kernel<<<static_cast<unsigned>(first_mirror * pl.tiles), kBlock, 0, st>>>(
        data_of<const int>(indices), static_cast<int>(n), pl.tiles, static_cast<int>(k_volume), g,
        lookup, pws + pl.out_row, pws + pl.tile_count);
    check_launch("sparse_rulebook_subm mirror_pair_lookup_kernel");
    launch_scan_emit(pl, k_volume, n, pws, pairs, pair_num, st, "sparse_rulebook_subm");
  };
  auto* slots = reinterpret_cast<unsigned long long*>(ws);
  auto* keys = reinterpret_cast<int64_t*>(ws);
  if (packed) {
    insert(PackedTable{slots, mask});
  } else {
    insert(SplitTable{keys, ws + l.vals, mask});
  }
  Readback read{};
  if (read_flags) {
    read = start_readback(reinterpret_cast<const int64_t*>(header), kHeaderInts / 2, device_id, st);
  }
  if (packed) {
    pairs_of(PackedLookup{slots, mask});
  } else {
    pairs_of(TableLookup{keys, ws + l.vals, mask});
  }
  if (!read_flags) return -1;
  const int* h = reinterpret_cast<const int*>(finish_readback(read));
  return (h[kBad] != 0 ? 1 : 0) | (h[kDup] != 0 ? 2 : 0) | (h[kFull] != 0 ? 4 : 0);
}

// ------------------------------------------------------------------------- bitmap entry points

int64_t bitmap_workspace_ints(int64_t batch_size, Shape out_shape) {
  const int64_t ndim = static_cast<int64_t>(out_shape.size());
  if (ndim < 1 || ndim > kMaxNdim) {
    TVM_FFI_THROW(ValueError) << "out_shape must have 1 to " << kMaxNdim << " values, got " << ndim;
  }
  int64_t shape[kMaxNdim];
  copy_dims(out_shape, "out_shape", static_cast<int>(ndim), 1, shape);
  return bitmap_layout(bitmap_words(check_batch(batch_size), shape, static_cast<int>(ndim))).ints;
}

// bitmap [>= sparse_rulebook_bitmap_workspace_ints] int32 over batch x out_shape, W words
void check_bitmap(const TensorView& bitmap, const TensorView& ref, int64_t n_words) {
  check_input(bitmap, "bitmap", ref, kInt32);
  check_ndim(bitmap, "bitmap", 1);
  const int64_t need = bitmap_layout(n_words).ints;
  if (bitmap.size(0) < need) {
    TVM_FFI_THROW(ValueError) << "bitmap must hold " << need << " int32 (from "
                              << "sparse_rulebook_bitmap_workspace_ints), got " << bitmap.size(0);
  }
}

// strided / transposed: the bitmap of the cells the (k, j) reach, its word prefix sums and
// header[kCount] = M (the header's other ints are left as they are).
void mark_entry(TensorView indices, TensorView bitmap, TensorView header, int64_t batch_size,
                Shape spatial, Shape out_shape, Shape ksize, Shape stride, Shape padding,
                Shape dilation, bool transposed, int64_t stream) {
  const int ndim = check_indices(indices);
  const Geometry g = make_geometry(ndim, batch_size, spatial, out_shape, ksize, stride, padding,
                                   dilation, transposed ? kTransposed : kStrided);
  const int64_t n = indices.size(0);
  const int64_t k_volume = kernel_volume(g);
  check_candidates(k_volume, n);
  const int64_t n_words = bitmap_words(g.batch, g.out_shape, ndim);
  check_bitmap(bitmap, indices, n_words);
  check_header(header, indices);
  const int device_id = indices.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const BitmapLayout l = bitmap_layout(n_words);
  int* ws = data_of<int>(bitmap);
  uint32_t* words = reinterpret_cast<uint32_t*>(ws + l.words);
  launch_zero(words, n_words * 4, device_id, st, "sparse_rulebook_mark (zero)");
  if (n > 0) {
    const int tiles = pair_layout(k_volume, n).tiles;
    mark_kernel<<<static_cast<unsigned>(k_volume * tiles), kBlock, 0, st>>>(
        data_of<const int>(indices), static_cast<int>(n), tiles, g, words);
    check_launch("sparse_rulebook_mark mark_kernel");
  }
  popcount_kernel<<<blocks_for(n_words, device_id), kBlock, 0, st>>>(words, n_words, ws + l.prefix);
  check_launch("sparse_rulebook_mark popcount_kernel");
  scan::exclusive_scan(ws + l.prefix, ws + l.prefix, n_words, ws + l.sums,
                       data_of<int>(header) + kCount, st, "sparse_rulebook_mark scan");
}

// sparse_rulebook_forward (mode 1 / 2) with the output rows from a marked bitmap (n_rows = M)
void forward_bitmap_entry(TensorView indices, TensorView bitmap, TensorView workspace,
                          TensorView pairs, TensorView pair_num, int64_t batch_size, Shape spatial,
                          Shape out_shape, Shape ksize, Shape stride, Shape padding, Shape dilation,
                          int64_t mode, int64_t n_rows, int64_t stream) {
  if (mode != kStrided && mode != kTransposed) {
    TVM_FFI_THROW(ValueError) << "mode must be 1 (strided) or 2 (transposed), got " << mode;
  }
  const Geometry g = check_forward(indices, workspace, pairs, pair_num, batch_size, spatial,
                                   out_shape, ksize, stride, padding, dilation, mode, n_rows);
  const int64_t n_words = bitmap_words(g.batch, g.out_shape, g.ndim);
  check_bitmap(bitmap, indices, n_words);
  const int device_id = indices.device().device_id;
  DeviceGuard guard(device_id);
  const BitmapLayout l = bitmap_layout(n_words);
  const int* ws = data_of<const int>(bitmap);
  const BitmapLookup lookup{reinterpret_cast<const uint32_t*>(ws + l.words), ws + l.prefix,
                            n_words};
  launch_pairs(indices, g, lookup, n_rows, data_of<int>(workspace), pairs, pair_num, device_id,
               as_stream(stream), "sparse_rulebook_forward_bitmap");
}

// a marked bitmap -> out_indices [M, ndim + 1] (b, q...) in ascending key order
void decode_bitmap_entry(TensorView bitmap, TensorView out_indices, int64_t batch_size,
                         Shape out_shape, int64_t stream) {
  check_gpu_tensor(bitmap, "bitmap");
  check_input(out_indices, "out_indices", bitmap, kInt32);
  check_ndim(out_indices, "out_indices", 2);
  const int64_t cols = out_indices.size(1);
  if (cols < 2 || cols > kMaxNdim + 1) {
    TVM_FFI_THROW(ValueError) << "out_indices must have 2 to " << kMaxNdim + 1 << " columns, got "
                              << cols;
  }
  const int64_t m = out_indices.size(0);
  if (m > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "out_indices has " << m << " rows; at most " << INT_MAX;
  }
  Geometry g{};
  g.ndim = static_cast<int>(cols - 1);
  g.batch = check_batch(batch_size);
  copy_dims(out_shape, "out_shape", g.ndim, 1, g.out_shape);
  check_key_range(g.batch, g.out_shape, g.ndim, "out_shape");
  const int64_t n_words = bitmap_words(g.batch, g.out_shape, g.ndim);
  check_bitmap(bitmap, bitmap, n_words);
  if (m == 0) return;
  const int device_id = bitmap.device().device_id;
  DeviceGuard guard(device_id);
  const BitmapLayout l = bitmap_layout(n_words);
  const int* ws = data_of<const int>(bitmap);
  decode_bitmap_kernel<<<blocks_for(n_words, device_id), kBlock, 0, as_stream(stream)>>>(
      reinterpret_cast<const uint32_t*>(ws + l.words), ws + l.prefix, n_words, static_cast<int>(m),
      g, data_of<int>(out_indices));
  check_launch("sparse_rulebook_decode_bitmap decode_bitmap_kernel");
}

void decode_entry(TensorView keys, TensorView out_indices, int64_t batch_size, Shape out_shape,
                  int64_t stream) {
  check_gpu_tensor(keys, "keys");
  check_input(keys, "keys", keys, kInt64);
  check_ndim(keys, "keys", 1);
  const int64_t m = keys.size(0);
  if (m > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "keys has " << m << " entries; at most " << INT_MAX;
  }
  check_input(out_indices, "out_indices", keys, kInt32);
  check_ndim(out_indices, "out_indices", 2);
  const int64_t cols = out_indices.size(1);
  if (cols < 2 || cols > kMaxNdim + 1) {
    TVM_FFI_THROW(ValueError) << "out_indices must have 2 to " << kMaxNdim + 1 << " columns, got "
                              << cols;
  }
  check_size(out_indices, "out_indices", 0, m);
  Geometry g{};
  g.ndim = static_cast<int>(cols - 1);
  g.batch = check_batch(batch_size);
  copy_dims(out_shape, "out_shape", g.ndim, 1, g.out_shape);
  check_key_range(g.batch, g.out_shape, g.ndim, "out_shape");
  if (m == 0) return;
  const int device_id = keys.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  decode_kernel<<<blocks_for(m, device_id), kBlock, 0, st>>>(
      data_of<const int64_t>(keys), static_cast<int>(m), g, data_of<int>(out_indices));
  check_launch("sparse_rulebook_decode decode_kernel");
}

}  // namespace
}  // namespace sparse
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_workspace_ints, muspace::sparse::workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_hash_insert, muspace::sparse::hash_insert_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_candidates, muspace::sparse::candidates_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_unique, muspace::sparse::unique_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_forward, muspace::sparse::forward_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_decode, muspace::sparse::decode_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_subm_workspace_ints,
                              muspace::sparse::subm_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_subm, muspace::sparse::subm_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_bitmap_workspace_ints,
                              muspace::sparse::bitmap_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_mark, muspace::sparse::mark_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_forward_bitmap,
                              muspace::sparse::forward_bitmap_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_rulebook_decode_bitmap, muspace::sparse::decode_bitmap_entry);
