// bev_pool_prepare and sort_by_cell: a deterministic counting sort of points by BEV cell.
//
// bev_pool_prepare_forward replaces BEVDet's voxel_pooling_prepare_v2 (torch argsort + unique);
// sort_by_cell_forward is the same sort for cells given directly (bev_pool, bev_pool_v3 and
// bev_pool_v2's deterministic backward use it). Two stages on the caller's stream, no host
// synchronisation inside; the caller picks them with `flags`:
//
//   stage COUNT (the counts are final when it ends)
//   0. zero fill       only when the caller does not vouch for a clean workspace: zero the
//                      header counters, the scan tile states and the cell histogram. Every
//                      COUNT stage leaves exactly that region zero again (self-cleaning), so a
//                      workspace reused on one stream needs this launch only once.
//   1. *_cells_kernel  per point: its cell (or -1) and slot = atomicAdd(&hist[cell], 1), stored
//                      as one int2. Integer atomics make the counts exact; only the slot order
//                      depends on timing. Optionally block-aggregated (a shared-memory hash
//                      table: one global atomic per (block, cell) instead of per point).
//   2. scan_kernel     single-pass exclusive scan over the cells with decoupled look-back
//                      (Merrill & Garland 2016; kLookBack predecessor states read in parallel
//                      per round): segment starts, the compacted intervals (non-empty cells, in
//                      cell order) and the totals n_kept, n_intervals in the header. It zeroes
//                      the histogram as it reads it; the last tile to finish resets the states.
//                      Optionally (host_counts) it also writes the counts and a sequence number
//                      into the caller's pinned host buffer: a zero-copy read-back the host polls.
//   stage ORDER (the caller reads the two counts back while this stage runs)
//   3. scatter_kernel  seg[starts[cell] + slot] = point, and meta[same] = (point, cell, start,
//                      end) so the next kernel needs no dependent gathers; lists segments longer
//                      than kCountMax.
//   4. emit_kernel     puts every segment in ascending point order and writes the outputs.
//                      Short segments (<= kCountMax points): a block stages the segments that
//                      cover its 256 positions (<= kWindow points) in shared memory, and each
//                      element's rank is the number of smaller point indices in its segment.
//                      Long segments: one block sorts the segment (bitonic sort of <= kSortChunk
//                      keys in shared memory, then merge passes through global scratch). Either
//                      way the result is the stable order (cell, then point index):
//                      deterministic, independent of the slots.
//
// Everything is int32 (n points and n_cells cells must each fit int32; checked). Time and memory
// O(n + n_cells); the rank step costs at most kCountMax compares per point.
#include <tvm/ffi/function.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace {

// ------------------------------------------------------------------------- launch policy

constexpr int kBlock = 256;      // threads per block of the per-point kernels
constexpr int kBlocksPerSm = 8;  // grid cap of the grid-stride kernels, per multiprocessor
constexpr int kScanBlock = 256;  // threads of the cell scan
constexpr int kScanItems = 8;    // consecutive cells per scan thread
constexpr int kScanTile = kScanBlock * kScanItems;  // cells per scan tile (2048)
constexpr int kLookBack = 32;         // predecessor tile states read per look-back round
constexpr int32_t kCountMax = 256;    // longest segment ranked by counting; longer: block sort
constexpr int32_t kSortChunk = 2048;  // keys a block sorts in shared memory (8 KB)
// Points of the short segments that cover kBlock consecutive positions: the positions plus at
// most kCountMax - 1 on either side.
constexpr int32_t kWindow = kBlock + 2 * (kCountMax - 1);
static_assert(kWindow <= kSortChunk, "the window shares the sort buffer");
constexpr int kLongBlocksPerSm = 2;     // blocks sorting long segments (idle ones exit at once)
constexpr int kHashSlots = 2 * kBlock;  // block-aggregated histogram: open addressing, load <= 1/2
static_assert((kHashSlots & (kHashSlots - 1)) == 0, "power of two");

constexpr int64_t kInt32Max = 2147483647;
// Everything is int32: points, cells and sorted entries must each fit it.
constexpr int64_t kMaxPoints = kInt32Max;  // bev_pool_prepare: coor's points
MUSPACE_LIMIT(bev_pool_prepare, max_points, kMaxPoints);
constexpr int64_t kMaxCells = kInt32Max;  // B*X*Y*Z (prepare) / n_cells (sort_by_cell)
MUSPACE_LIMIT(bev_pool_prepare, max_cells, kMaxCells);
MUSPACE_LIMIT(sort_by_cell, max_cells, kMaxCells);
constexpr int64_t kMaxEntries = kInt32Max;  // sort_by_cell: cell's entries
MUSPACE_LIMIT(sort_by_cell, max_entries, kMaxEntries);

// flags of the entry points
constexpr int64_t kStageCount = 1;       // zero (unless clean) + cells + scan
constexpr int64_t kStageOrder = 2;       // scatter + emit (needs a completed COUNT stage)
constexpr int64_t kWorkspaceClean = 4;   // the caller vouches the zero region is zero
constexpr int64_t kPolicyAggregate = 8;  // block-aggregated histogram atomics
constexpr int64_t kAllFlags = 15;

// Workspace header (int32 slots).
constexpr int kNKept = 0;        // written by the last scan tile; read back by the caller
constexpr int kNIntervals = 1;   // idem
constexpr int kTileCounter = 2;  // dynamic scan tile ids (zero region, reset by the scan)
constexpr int kTilesDone = 3;    // scan tiles finished (zero region, reset by the scan)
constexpr int kLongCount = 4;    // entries in long_list: zeroed by the scan, counted by scatter
constexpr int64_t kHeaderInts = 8;

constexpr int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

// Workspace layout in int32 units, every region 16-byte aligned (the base is checked):
// header | tile states (uint64) | hist [n_cells]   <- the zero region, a function of n_cells only
// | starts [n_cells + 1] | long_list | cs [n] (int2: cell, slot; reused as sort scratch A, B)
// | seg [n] | meta [n] (int4: point, cell, start, end).
struct Layout {
  int64_t n_tiles = 0, long_capacity = 0;
  int64_t status = 0, hist = 0, zero_end = 0, starts = 0, long_list = 0;
  int64_t cs = 0, seg = 0, meta = 0, total = 0;
};

Layout make_layout(int64_t n, int64_t n_cells) {
  Layout l;
  l.n_tiles = (n_cells + kScanTile - 1) / kScanTile;
  l.long_capacity = n / (kCountMax + 1) + 1;  // disjoint segments of > kCountMax points
  int64_t off = kHeaderInts;
  l.status = off;
  off += round4(2 * l.n_tiles);
  l.hist = off;
  off += round4(n_cells);
  l.zero_end = off;
  l.starts = off;
  off += round4(n_cells + 1);
  l.long_list = off;
  off += round4(l.long_capacity);
  l.cs = off;
  off += round4(2 * n);
  l.seg = off;
  off += round4(n);
  l.meta = off;
  off += 4 * n;
  l.total = off;
  return l;
}

__device__ __forceinline__ int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }

// ------------------------------------------------------------------------- 1. cells + histogram

// Coordinates of each dtype: load as float (exact) and round a float result to the dtype, so
// (coor - lower) / interval is computed exactly as torch computes it in that dtype (every op in
// float, result rounded to the dtype: double rounding is innocuous since 24 >= 2 * 11 + 2).
struct CoordF32 {
  using Storage = float;
  __device__ static float load(const Storage* p) { return *p; }
  __device__ static float round(float v) { return v; }
};

struct CoordF16 {
  using Storage = half;
  __device__ static float load(const Storage* p) { return __half2float(*p); }
  __device__ static float round(float v) { return __half2float(__float2half_rn(v)); }
};

// bfloat16 as raw bits: no bf16 type or intrinsic is needed, so this path builds on every MUSA
// arch (MUSPACE_HAS_BF16 guards bf16 arithmetic types, not bit manipulation).
struct CoordBF16 {
  using Storage = uint16_t;
  __device__ static float load(const Storage* p) {
    return __uint_as_float(static_cast<uint32_t>(*p) << 16);
  }
  // Round to nearest even (torch's float -> bfloat16 conversion); NaN stays NaN.
  __device__ static float round(float v) {
    if (v != v) return v;
    uint32_t u = __float_as_uint(v);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xFFFF0000u);
  }
};

struct Grid {
  float lower[3];
  float interval[3];
  int32_t size[3];  // X, Y, Z
};

// Cell of one axis, or -1. BEVDet: cell = ((coor - lower) / interval).long(), kept when
// 0 <= cell < size. trunc(q) >= 0 <=> q > -1, and trunc(q) < size <=> q < size; NaN and +-inf
// fail the range test (upstream's .long() of NaN is platform-dependent; we drop it).
template <typename Coord>
__device__ __forceinline__ int32_t axis_cell(float v, float lower, float interval, int32_t size) {
  const float q = Coord::round(Coord::round(v - lower) / interval);
  if (!(q > -1.0f && q < 2147483648.0f)) return -1;
  const int32_t c = static_cast<int32_t>(q);  // truncation toward zero: q in (-1, 0) -> cell 0
  return c < size ? c : -1;
}

// The cell of frustum point i (or -1).
template <typename Coord>
struct FrustumCells {
  const typename Coord::Storage* coor;
  int32_t points_per_batch;
  Grid grid;

  // The bounds in coor's dtype, as upstream's lower.to(coor) / interval.to(coor); called once
  // per thread before the loop.
  __device__ __forceinline__ FrustumCells on_device() const {
    FrustumCells r = *this;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      r.grid.lower[a] = Coord::round(grid.lower[a]);
      r.grid.interval[a] = Coord::round(grid.interval[a]);
    }
    return r;
  }

  __device__ __forceinline__ int32_t operator()(int64_t i) const {
    const typename Coord::Storage* p = coor + 3 * i;
    const int32_t cx =
        axis_cell<Coord>(Coord::load(p), grid.lower[0], grid.interval[0], grid.size[0]);
    const int32_t cy =
        axis_cell<Coord>(Coord::load(p + 1), grid.lower[1], grid.interval[1], grid.size[1]);
    const int32_t cz =
        axis_cell<Coord>(Coord::load(p + 2), grid.lower[2], grid.interval[2], grid.size[2]);
    if (cx < 0 || cy < 0 || cz < 0) return -1;
    const int32_t b = static_cast<int32_t>(i) / points_per_batch;
    // Every partial product is below B*Z*Y*X <= INT32_MAX (checked on the host).
    return ((b * grid.size[2] + cz) * grid.size[1] + cy) * grid.size[0] + cx;
  }
};

// Entry i of a given cell array (or -1 when out of [0, n_cells)).
template <typename Index>
struct GivenCells {
  const Index* cells;
  int32_t n_cells;

  __device__ __forceinline__ GivenCells on_device() const { return *this; }
  __device__ __forceinline__ int32_t operator()(int64_t i) const {
    const Index c = cells[i];
    return (c >= 0 && c < n_cells) ? static_cast<int32_t>(c) : -1;
  }
};

__device__ __forceinline__ int32_t hash_slot(int32_t cell) {
  return static_cast<int32_t>((static_cast<uint32_t>(cell) * 2654435761u) >> 16) & (kHashSlots - 1);
}

// cs[i] = (cell, slot) for every point; hist[cell] counts the points of each cell.
template <bool kAggregate, typename CellFn>
__global__ void __launch_bounds__(kBlock)
    cells_kernel(CellFn cells, int64_t n, int32_t* __restrict__ hist, int2* __restrict__ cs) {
  const CellFn cell_of = cells.on_device();
  if constexpr (!kAggregate) {
    for (int64_t i = global_thread(); i < n; i += global_threads()) {
      const int32_t c = cell_of(i);
      cs[i] = make_int2(c, c >= 0 ? atomicAdd(&hist[c], 1) : -1);
    }
  } else {
    // Block-aggregated: the block's cells go into a shared hash table (at most kBlock distinct
    // keys in kHashSlots slots, so probing ends); one global atomic per distinct cell reserves
    // the block's slots; a point's slot is that base plus its rank from a shared atomic.
    __shared__ int32_t s_key[kHashSlots];
    __shared__ int32_t s_count[kHashSlots];
    __shared__ int32_t s_base[kHashSlots];
    for (int e = threadIdx.x; e < kHashSlots; e += blockDim.x) {
      s_key[e] = -1;
      s_count[e] = 0;
    }
    __syncthreads();
    // Block-uniform loop bounds: every thread takes every barrier.
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < n;
         base += global_threads()) {
      const int64_t i = base + threadIdx.x;
      const int32_t c = i < n ? cell_of(i) : -1;
      int32_t h = 0, local = 0;
      if (c >= 0) {
        h = hash_slot(c);
        while (true) {
          const int32_t key = atomicCAS(&s_key[h], -1, c);
          if (key == -1 || key == c) break;
          h = (h + 1) & (kHashSlots - 1);
        }
        local = atomicAdd(&s_count[h], 1);
      }
      __syncthreads();
      for (int e = threadIdx.x; e < kHashSlots; e += blockDim.x) {
        const int32_t k = s_count[e];
        if (k > 0) s_base[e] = atomicAdd(&hist[s_key[e]], k);
      }
      __syncthreads();
      if (i < n) cs[i] = make_int2(c, c >= 0 ? s_base[h] + local : -1);
      __syncthreads();  // every s_base read: reset the table for the next round
      for (int e = threadIdx.x; e < kHashSlots; e += blockDim.x) {
        s_key[e] = -1;
        s_count[e] = 0;
      }
      __syncthreads();
    }
  }
}

// ------------------------------------------------------------------------- 2. scan over cells

// (points, intervals) packed as intervals << 32 | points. Both totals stay below 2^31, so sums
// of pairs never carry from one half into the other.
using Pair = unsigned long long;
__device__ __forceinline__ Pair pack_pair(int32_t points, int32_t intervals) {
  return (static_cast<Pair>(static_cast<uint32_t>(intervals)) << 32) |
         static_cast<Pair>(static_cast<uint32_t>(points));
}
__device__ __forceinline__ int32_t pair_points(Pair p) {
  return static_cast<int32_t>(static_cast<uint32_t>(p));
}
__device__ __forceinline__ int32_t pair_intervals(Pair p) {
  return static_cast<int32_t>(static_cast<uint32_t>(p >> 32));
}

// Tile state word: flag (bits 62-63) | intervals (31 bits) | points (31 bits). One 64-bit word,
// so a reader never sees a flag without its value.
constexpr unsigned long long kFlagAggregate = 1;
constexpr unsigned long long kFlagPrefix = 2;
constexpr unsigned long long kLow31 = (1ull << 31) - 1;

__device__ __forceinline__ unsigned long long make_status(unsigned long long flag, Pair v) {
  return (flag << 62) | (static_cast<unsigned long long>(pair_intervals(v)) << 31) |
         static_cast<unsigned long long>(pair_points(v));
}
__device__ __forceinline__ Pair status_value(unsigned long long s) {
  return pack_pair(static_cast<int32_t>(s & kLow31), static_cast<int32_t>((s >> 31) & kLow31));
}

__global__ void __launch_bounds__(kScanBlock)
    scan_kernel(int32_t* hist, int32_t n_cells, int32_t n_tiles, int32_t* header,
                unsigned long long* status, int32_t* __restrict__ starts,
                int32_t* __restrict__ iv_starts, int32_t* __restrict__ iv_lengths,
                int32_t iv_capacity, int32_t* host_counts, int32_t sequence) {
  __shared__ Pair s_scan[kScanBlock];
  __shared__ unsigned long long s_window[kLookBack];
  __shared__ Pair s_prefix;
  __shared__ int32_t s_tile, s_next, s_last;
  const int tid = threadIdx.x;
  if (tid == 0) s_tile = atomicAdd(&header[kTileCounter], 1);
  __syncthreads();
  const int32_t tile = s_tile;
  if (tile >= n_tiles) return;  // block-uniform; cannot happen with grid == n_tiles
  if (tile == 0 && tid == 0) header[kLongCount] = 0;  // counted by scatter, after this kernel

  const int64_t first =
      static_cast<int64_t>(tile) * kScanTile + static_cast<int64_t>(tid) * kScanItems;
  int32_t count[kScanItems];
  Pair local = 0;
#pragma unroll
  for (int k = 0; k < kScanItems; ++k) {
    const int64_t c = first + k;
    const int32_t v = c < n_cells ? hist[c] : 0;
    count[k] = v > 0 ? v : 0;
    local += pack_pair(count[k], count[k] > 0 ? 1 : 0);
  }
#pragma unroll
  for (int k = 0; k < kScanItems; ++k) {  // self-cleaning: the histogram is zero again
    if (first + k < n_cells) hist[first + k] = 0;
  }

  // Inclusive block scan, Hillis-Steele in shared memory (no warp intrinsics: any warp width).
  s_scan[tid] = local;
  __syncthreads();
  for (int offset = 1; offset < kScanBlock; offset <<= 1) {
    const Pair add = tid >= offset ? s_scan[tid - offset] : 0;
    __syncthreads();
    s_scan[tid] += add;
    __syncthreads();
  }
  const Pair tile_total = s_scan[kScanBlock - 1];
  Pair running = s_scan[tid] - local;  // exclusive within the tile

  // Decoupled look-back. Publish this tile's aggregate (tile 0: its inclusive prefix), then read
  // the states of up to kLookBack predecessors at once, nearest first, adding aggregates until
  // an inclusive prefix; a predecessor not published yet is re-read in the next round. Tiles are
  // numbered in the order blocks start (atomic counter), so every predecessor belongs to a block
  // already running that never waits on this one: the loop always ends. The loop bound `s_next`
  // is read by all threads between barriers, so every thread takes every barrier.
  if (tid == 0) {
    atomicExch(&status[tile], make_status(tile == 0 ? kFlagPrefix : kFlagAggregate, tile_total));
    s_prefix = 0;
    s_next = tile;  // the window ends (exclusive) at tile s_next; 0 = done
  }
  __syncthreads();
  while (true) {
    const int32_t window_end = s_next;
    if (window_end <= 0) break;
    if (tid < kLookBack) {
      const int32_t j = window_end - 1 - tid;
      // atomicAdd(0): a coherent read of another block's state (never a stale L1 line)
      s_window[tid] = j >= 0 ? atomicAdd(&status[j], 0ull) : make_status(kFlagPrefix, 0);
    }
    __syncthreads();
    if (tid == 0) {
      int32_t next = window_end - kLookBack;  // every state an aggregate: next window
      Pair sum = 0;
      for (int k = 0; k < kLookBack; ++k) {
        const unsigned long long state = s_window[k];
        const unsigned long long flag = state >> 62;
        if (flag == 0) {  // not published yet: resume from this predecessor
          next = window_end - k;
          break;
        }
        sum += status_value(state);
        if (flag == kFlagPrefix) {
          next = 0;
          break;
        }
      }
      s_prefix += sum;
      s_next = next;
    }
    __syncthreads();
  }
  if (tid == 0 && tile > 0) {
    atomicExch(&status[tile], make_status(kFlagPrefix, s_prefix + tile_total));
  }
  running += s_prefix;

#pragma unroll
  for (int k = 0; k < kScanItems; ++k) {
    const int64_t c = first + k;
    if (c < n_cells) {
      const int32_t start = pair_points(running);
      starts[c] = start;
      if (count[k] > 0) {
        const int32_t iv = pair_intervals(running);
        if (iv < iv_capacity) {
          iv_starts[iv] = start;
          iv_lengths[iv] = count[k];
        }
      }
      running += pack_pair(count[k], count[k] > 0 ? 1 : 0);
    }
  }
  if (tile == n_tiles - 1 && tid == 0) {
    const Pair total = s_prefix + tile_total;
    starts[n_cells] = pair_points(total);
    header[kNKept] = pair_points(total);
    header[kNIntervals] = pair_intervals(total);
    if (host_counts != nullptr) {
      // Zero-copy read-back: the counts go straight to the caller's pinned host buffer, then
      // (after a system-scope fence) the call's sequence number that the host polls for.
      volatile int32_t* h = host_counts;
      h[0] = pair_points(total);
      h[1] = pair_intervals(total);
      __threadfence_system();
      h[2] = sequence;
    }
  }

  // Self-cleaning: the last tile to finish (every other tile is past its look-back) resets the
  // tile states and both counters, so the zero region is zero again when the kernel ends.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    s_last = atomicAdd(&header[kTilesDone], 1) == n_tiles - 1 ? 1 : 0;
  }
  __syncthreads();
  if (s_last) {
    for (int32_t t = tid; t < n_tiles; t += kScanBlock) status[t] = 0ull;
    if (tid == 0) {
      header[kTileCounter] = 0;
      header[kTilesDone] = 0;
    }
  }
}

// ------------------------------------------------------------------------- 3. scatter

__global__ void __launch_bounds__(kBlock)
    scatter_kernel(const int2* __restrict__ cs, const int32_t* __restrict__ starts, int64_t n,
                   int32_t n_cells, int32_t* __restrict__ seg, int4* __restrict__ meta,
                   int32_t* header, int32_t* __restrict__ long_list, int32_t long_capacity) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int2 v = cs[i];
    const int32_t c = v.x, s = v.y;
    if (c < 0 || c >= n_cells) continue;
    const int32_t start = starts[c];
    const int32_t end = starts[c + 1];
    if (start < 0 || end > n || s < 0 || s >= end - start) continue;
    const int32_t pos = start + s;
    seg[pos] = static_cast<int32_t>(i);
    meta[pos] = make_int4(static_cast<int32_t>(i), c, start, end);
    if (s == 0 && end - start > kCountMax) {
      const int32_t j = atomicAdd(&header[kLongCount], 1);
      if (j < long_capacity) long_list[j] = c;
    }
  }
}

// ------------------------------------------------------------------------- 4. order + emit

struct Emit {
  int32_t* first;  // ranks_bev (prepare) or order (sort)
  int32_t* depth;  // ranks_depth (prepare only)
  int32_t* feat;   // ranks_feat (prepare only)
  int32_t dhw;     // D*H*W: points per camera
  int32_t hw;      // H*W: pixels per camera
};

template <bool kPrepare>
__device__ __forceinline__ void emit(const Emit& out, int32_t pos, int32_t point, int32_t cell) {
  if (kPrepare) {
    out.first[pos] = cell;
    out.depth[pos] = point;
    out.feat[pos] = (point / out.dhw) * out.hw + point % out.hw;
  } else {
    out.first[pos] = point;
  }
}

// Ascending bitonic sort of keys[0, size) in shared memory, size a power of two. Each step pairs
// disjoint elements (t, t ^ j), one thread per pair; a barrier separates the steps.
__device__ void bitonic_sort(int32_t* keys, int32_t size) {
  for (int32_t k = 2; k <= size; k <<= 1) {
    for (int32_t j = k >> 1; j > 0; j >>= 1) {
      for (int32_t t = threadIdx.x; t < size; t += blockDim.x) {
        const int32_t partner = t ^ j;
        if (partner > t) {
          const int32_t a = keys[t], b = keys[partner];
          const bool ascending = (t & k) == 0;
          if ((a > b) == ascending) {
            keys[t] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Number of entries of the ascending run src[0, len) smaller than x.
__device__ __forceinline__ int32_t lower_bound(const int32_t* src, int32_t len, int32_t x) {
  int32_t lo = 0, hi = len;
  while (lo < hi) {
    const int32_t mid = lo + ((hi - lo) >> 1);
    if (src[mid] < x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// One block: sort the long segment seg[0, len) (distinct point indices) and emit it. Called with
// block-uniform arguments only (every thread reaches every barrier).
template <bool kPrepare>
__device__ void sort_long_segment(const int32_t* seg, int32_t len, int32_t pos0, int32_t cell,
                                  int32_t* scratch_a, int32_t* scratch_b, int32_t* s_keys,
                                  const Emit& out) {
  constexpr int32_t kPad = 2147483647;  // above every point index (< n <= INT32_MAX)
  for (int32_t c0 = 0; c0 < len; c0 += kSortChunk) {
    const int32_t clen = imin(kSortChunk, len - c0);
    int32_t size = 1;
    while (size < clen) size <<= 1;
    for (int32_t t = threadIdx.x; t < size; t += blockDim.x)
      s_keys[t] = t < clen ? seg[c0 + t] : kPad;
    __syncthreads();
    bitonic_sort(s_keys, size);
    if (len <= kSortChunk) {  // one chunk: it is the whole segment
      for (int32_t t = threadIdx.x; t < clen; t += blockDim.x)
        emit<kPrepare>(out, pos0 + t, s_keys[t], cell);
    } else {
      for (int32_t t = threadIdx.x; t < clen; t += blockDim.x) scratch_a[c0 + t] = s_keys[t];
    }
    __syncthreads();  // s_keys is reloaded next chunk / next segment; scratch_a complete
  }
  if (len <= kSortChunk) return;
  // Merge sorted runs of width w, w = kSortChunk, 2 kSortChunk, ...: each element's place in the
  // merged run is its index in its own run plus the number of smaller keys in the partner run
  // (keys are distinct, so the places form a permutation).
  int32_t* src = scratch_a;
  int32_t* dst = scratch_b;
  for (int64_t w = kSortChunk; w < len; w *= 2) {
    for (int32_t t = threadIdx.x; t < len; t += blockDim.x) {
      const int64_t run = t / w;
      const int64_t base = (run & ~static_cast<int64_t>(1)) * w;
      const bool left = (run & 1) == 0;
      const int64_t own = left ? base : base + w;
      const int64_t other = left ? base + w : base;
      const int64_t other_end = left ? (base + 2 * w < len ? base + 2 * w : len) : base + w;
      const int32_t other_len = other < len ? static_cast<int32_t>(other_end - other) : 0;
      const int32_t x = src[t];
      const int32_t place = static_cast<int32_t>(t - own) + lower_bound(src + other, other_len, x);
      dst[base + place] = x;
    }
    __syncthreads();
    int32_t* tmp = src;
    src = dst;
    dst = tmp;
  }
  for (int32_t t = threadIdx.x; t < len; t += blockDim.x)
    emit<kPrepare>(out, pos0 + t, src[t], cell);
  __syncthreads();
}

// Blocks [0, long_blocks) sort the long segments (block-stride over long_list); the other blocks
// take kBlock consecutive positions each and rank the points of the short segments there. Both
// read seg / meta and write disjoint output ranges; seg and meta are never written here.
template <bool kPrepare>
__global__ void __launch_bounds__(kBlock)
    emit_kernel(const int32_t* __restrict__ seg, const int4* __restrict__ meta,
                const int32_t* __restrict__ starts, const int32_t* __restrict__ header,
                const int32_t* __restrict__ long_list, int32_t long_capacity, int32_t* scratch_a,
                int32_t* scratch_b, int32_t n, int32_t n_cells, int32_t long_blocks, Emit out) {
  __shared__ int32_t s_buf[kSortChunk];  // long: the bitonic keys; short: the segment window
  __shared__ int32_t s_lo, s_hi;
  const int32_t n_kept = imin(header[kNKept], n);
  if (static_cast<int32_t>(blockIdx.x) < long_blocks) {
    const int32_t n_long = imin(header[kLongCount], long_capacity);
    for (int32_t j = blockIdx.x; j < n_long; j += long_blocks) {
      const int32_t cell = long_list[j];
      if (cell < 0 || cell >= n_cells) continue;
      const int32_t start = starts[cell];
      const int32_t len = imin(starts[cell + 1], n_kept) - start;
      if (start < 0 || len <= kCountMax) continue;
      sort_long_segment<kPrepare>(seg + start, len, start, cell, scratch_a + start,
                                  scratch_b + start, s_buf, out);
    }
    return;
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x - long_blocks) * blockDim.x;
  // Block-uniform loop (n_kept is the same for every thread): every thread takes every barrier.
  for (int64_t p0 = static_cast<int64_t>(blockIdx.x - long_blocks) * blockDim.x; p0 < n_kept;
       p0 += stride) {
    const int64_t p = p0 + threadIdx.x;
    int4 m = make_int4(0, 0, 0, 0);
    bool mine = false;
    if (p < n_kept) {
      m = meta[p];  // (point, cell, start, end)
      // a short segment that holds p; implies p - start < kCountMax and end - p <= kCountMax,
      // so the block's window stays within [p0 - kCountMax + 1, p0 + kBlock + kCountMax - 1)
      mine = m.z >= 0 && m.z <= p && p < m.w && m.w <= n_kept && m.w - m.z <= kCountMax &&
             m.x >= 0 && m.x < n && m.y >= 0 && m.y < n_cells;
    }
    if (threadIdx.x == 0) {
      s_lo = 2147483647;
      s_hi = 0;
    }
    __syncthreads();
    if (mine) {
      atomicMin(&s_lo, m.z);
      atomicMax(&s_hi, m.w);
    }
    __syncthreads();
    const int32_t lo = s_lo;
    const int32_t width = s_hi - lo;  // <= kWindow by the bounds above; empty when none is mine
    for (int32_t t = threadIdx.x; t < width && t < kWindow; t += blockDim.x) s_buf[t] = seg[lo + t];
    __syncthreads();
    if (mine) {
      const int32_t* w = s_buf + (m.z - lo);
      const int32_t len = m.w - m.z;
      int32_t rank = 0;
#pragma unroll 8
      for (int32_t q = 0; q < len; ++q) rank += w[q] < m.x ? 1 : 0;
      if (rank < len) emit<kPrepare>(out, m.z + rank, m.x, m.y);  // always true
    }
    __syncthreads();  // s_buf, s_lo, s_hi are reused by the next round
  }
}

// ------------------------------------------------------------------------- host side

void check_workspace(const TensorView& ws, const TensorView& ref, const Layout& layout) {
  check_input(ws, "workspace", ref, kInt32);
  check_ndim(ws, "workspace", 1);
  if (ws.numel() < layout.total) {
    TVM_FFI_THROW(ValueError) << "workspace must hold at least " << layout.total
                              << " int32 (bev_pool_sort_workspace_ints), got " << ws.numel();
  }
  check_aligned(ws, "workspace", 16);
}

void check_flags(int64_t flags) {
  if (flags < 0 || flags > kAllFlags || (flags & (kStageCount | kStageOrder)) == 0) {
    TVM_FFI_THROW(ValueError) << "flags must select at least one stage (1 = count, 2 = order; "
                              << "4 = clean workspace, 8 = aggregated histogram), got " << flags;
  }
}

// Optional zero-copy read-back target: the address of >= 3 int32 of page-locked host memory
// that the device can address (CUDA: any pinned allocation under unified addressing), written
// (n_kept, n_intervals, sequence) at the end of the COUNT stage; 0 = none. Internal: only
// mu_space.ops.bev_pool_prepare passes it, for its own pinned buffer.
struct HostCounts {
  int32_t* counts = nullptr;
  int32_t sequence = 0;
};

HostCounts host_counts_arg(int64_t address, int64_t sequence) {
  if (address % 4 != 0) {
    TVM_FFI_THROW(ValueError) << "host_counts must be a 4-byte aligned address or 0";
  }
  if (sequence < 0 || sequence > kInt32Max) {
    TVM_FFI_THROW(ValueError) << "sequence must be in [0, " << kInt32Max << "], got " << sequence;
  }
  HostCounts h;
  h.counts = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(address));
  h.sequence = static_cast<int32_t>(sequence);
  return h;
}

// Launches the COUNT stage around the caller's cells kernel and the ORDER stage.
struct Pipeline {
  Layout layout;
  int32_t* ws;
  int64_t n;
  int32_t n_cells;
  int device_id;
  gpuStream_t stream;

  int32_t* at(int64_t offset) const { return ws + offset; }
  int32_t* hist() const { return at(layout.hist); }
  int2* cs() const { return reinterpret_cast<int2*>(at(layout.cs)); }
  // Grid-stride kernels over `work` items.
  int grid(int64_t work) const { return grid_for(work, kBlock, device_id, kBlocksPerSm); }

  // The COUNT stage, writing the intervals into interval_starts / interval_lengths (int32,
  // iv_capacity entries each).
  template <typename CellFn>
  void count(const CellFn& cell_of, int64_t flags, const TensorView& interval_starts,
             const TensorView& interval_lengths, int64_t iv_capacity, const HostCounts& host,
             const char* cells_name) const {
    if ((flags & kWorkspaceClean) == 0) {
      launch_zero(ws, layout.zero_end * 4, device_id, stream, "bev_pool_prepare fill (workspace)");
    }
    if (flags & kPolicyAggregate) {
      cells_kernel<true><<<grid(n), kBlock, 0, stream>>>(cell_of, n, hist(), cs());
    } else {
      cells_kernel<false><<<grid(n), kBlock, 0, stream>>>(cell_of, n, hist(), cs());
    }
    check_launch(cells_name);
    scan_kernel<<<static_cast<unsigned>(layout.n_tiles), kScanBlock, 0, stream>>>(
        hist(), n_cells, static_cast<int32_t>(layout.n_tiles), ws,
        reinterpret_cast<unsigned long long*>(at(layout.status)), at(layout.starts),
        data_of<int32_t>(interval_starts), data_of<int32_t>(interval_lengths),
        static_cast<int32_t>(iv_capacity), host.counts, host.sequence);
    check_launch("bev_pool_prepare scan_kernel");
  }

  template <bool kPrepare>
  void order(const Emit& out) const {
    const int32_t n32 = static_cast<int32_t>(n);
    int4* meta = reinterpret_cast<int4*>(at(layout.meta));
    scatter_kernel<<<grid(n), kBlock, 0, stream>>>(cs(), at(layout.starts), n, n_cells,
                                                   at(layout.seg), meta, ws, at(layout.long_list),
                                                   static_cast<int32_t>(layout.long_capacity));
    check_launch("bev_pool_prepare scatter_kernel");
    const int64_t long_cap =
        static_cast<int64_t>(multiprocessor_count(device_id)) * kLongBlocksPerSm;
    const int32_t long_blocks =
        static_cast<int32_t>(layout.long_capacity < long_cap ? layout.long_capacity : long_cap);
    const int blocks = long_blocks + grid(n);
    int32_t* scratch = at(layout.cs);  // cs is dead after the scatter: 2n ints of scratch
    emit_kernel<kPrepare><<<blocks, kBlock, 0, stream>>>(
        at(layout.seg), meta, at(layout.starts), ws, at(layout.long_list),
        static_cast<int32_t>(layout.long_capacity), scratch, scratch + n, n32, n_cells, long_blocks,
        out);
    check_launch("bev_pool_prepare emit_kernel");
  }
};

int64_t checked_cells(int64_t batch, int64_t x, int64_t y, int64_t z) {
  if (x <= 0 || y <= 0 || z <= 0) {
    TVM_FFI_THROW(ValueError) << "grid_size must be positive, got (" << x << ", " << y << ", " << z
                              << ")";
  }
  int64_t cells = batch;
  for (int64_t f : {x, y, z}) {
    if (f > kMaxCells || (cells > 0 && cells > kMaxCells / f)) {
      TVM_FFI_THROW(ValueError) << "B*X*Y*Z = " << batch << "*" << x << "*" << y << "*" << z
                                << " cells exceeds the int32 range of ranks_bev (" << kMaxCells
                                << ")";
    }
    cells *= f;
  }
  return cells;
}

template <typename Coord>
FrustumCells<Coord> frustum_cells(const void* coor, int32_t per_batch, const Grid& grid) {
  FrustumCells<Coord> f;
  f.coor = static_cast<const typename Coord::Storage*>(coor);
  f.points_per_batch = per_batch;
  f.grid = grid;
  return f;
}

// The checks both entry points share after their own: flags, host_counts, the int32 outputs
// (`first`: ranks_bev / order, then the interval arrays) and the workspace; then the pipeline
// (nothing to launch when n == 0 or n_cells == 0: empty result).
struct Checked {
  Layout layout;
  HostCounts host;
  int64_t iv_capacity;
};

Checked check_outputs(const TensorView& ref, int64_t n, int64_t n_cells, int64_t flags,
                      int64_t host_counts, int64_t sequence,
                      std::initializer_list<std::pair<const TensorView*, const char*>> per_point,
                      const TensorView& interval_starts, const TensorView& interval_lengths,
                      const TensorView& workspace) {
  check_flags(flags);
  Checked c;
  c.host = host_counts_arg(host_counts, sequence);
  c.iv_capacity = n < n_cells ? n : n_cells;
  for (const auto& [t, name] : per_point) check_vector(*t, name, ref, kInt32, n);
  check_vector(interval_starts, "interval_starts", ref, kInt32, c.iv_capacity);
  check_vector(interval_lengths, "interval_lengths", ref, kInt32, c.iv_capacity);
  c.layout = make_layout(n, n_cells);
  check_workspace(workspace, ref, c.layout);
  return c;
}

Pipeline pipeline(const Checked& c, const TensorView& workspace, const TensorView& ref, int64_t n,
                  int64_t n_cells, int64_t stream) {
  return Pipeline{c.layout,
                  data_of<int32_t>(workspace),
                  n,
                  static_cast<int32_t>(n_cells),
                  ref.device().device_id,
                  as_stream(stream)};
}

// --------------------------------------------------------------------------- entry points

// Size in int32 of the workspace both entry points need for n points and n_cells cells.
int64_t bev_pool_sort_workspace_ints(int64_t n, int64_t n_cells) {
  if (n < 0 || n > kMaxEntries) {
    TVM_FFI_THROW(ValueError) << "n must be in [0, " << kMaxEntries << "], got " << n;
  }
  if (n_cells < 0 || n_cells > kMaxCells) {
    TVM_FFI_THROW(ValueError) << "n_cells must be in [0, " << kMaxCells << "], got " << n_cells;
  }
  return make_layout(n, n_cells).total;
}

// coor [B, N, D, H, W, 3] float32/float16/bfloat16 -> ranks_bev, ranks_depth, ranks_feat [n]
// and interval_starts, interval_lengths [min(n, B*X*Y*Z)], valid up to the counts written to
// workspace[0] (n_kept) and workspace[1] (n_intervals) by the COUNT stage. flags: 1 = COUNT,
// 2 = ORDER (after a COUNT on the same workspace and stream), 4 = the workspace's zero region
// is known zero (true after any completed COUNT on it), 8 = aggregated histogram (profiling).
// host_counts, sequence: the optional zero-copy read-back (HostCounts; 0, 0 = none).
// Nothing is launched when n == 0.
void bev_pool_prepare_forward(TensorView coor, TensorView workspace, TensorView ranks_bev,
                              TensorView ranks_depth, TensorView ranks_feat,
                              TensorView interval_starts, TensorView interval_lengths,
                              float lower_x, float lower_y, float lower_z, float interval_x,
                              float interval_y, float interval_z, int64_t grid_x, int64_t grid_y,
                              int64_t grid_z, int64_t flags, int64_t host_counts, int64_t sequence,
                              int64_t stream) {
  check_gpu_tensor(coor, "coor");
  check_float_dtype<Bf16::kBits>(coor, "coor");
  check_contiguous(coor, "coor");
  check_ndim(coor, "coor", 6);
  check_size(coor, "coor", 5, 3);
  const int64_t n = coor.numel() / 3;
  if (n > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << "coor has " << n << " points; int32 ranks allow at most "
                              << kMaxPoints;
  }
  const int64_t n_cells = checked_cells(coor.size(0), grid_x, grid_y, grid_z);
  const float lower[3] = {lower_x, lower_y, lower_z};
  const float interval[3] = {interval_x, interval_y, interval_z};
  for (int a = 0; a < 3; ++a) {
    if (!std::isfinite(lower[a])) {
      TVM_FFI_THROW(ValueError) << "grid_lower_bound must be finite, got " << lower[a];
    }
    if (!std::isfinite(interval[a]) || !(interval[a] > 0.0f)) {
      TVM_FFI_THROW(ValueError) << "grid_interval must be positive and finite, got " << interval[a];
    }
  }
  const Checked c = check_outputs(
      coor, n, n_cells, flags, host_counts, sequence,
      {{&ranks_bev, "ranks_bev"}, {&ranks_depth, "ranks_depth"}, {&ranks_feat, "ranks_feat"}},
      interval_starts, interval_lengths, workspace);
  if (n == 0) return;

  DeviceGuard guard(coor.device().device_id);
  const Pipeline pipe = pipeline(c, workspace, coor, n, n_cells, stream);
  if (flags & kStageCount) {
    Grid grid;
    for (int a = 0; a < 3; ++a) {
      grid.lower[a] = lower[a];
      grid.interval[a] = interval[a];
    }
    grid.size[0] = static_cast<int32_t>(grid_x);
    grid.size[1] = static_cast<int32_t>(grid_y);
    grid.size[2] = static_cast<int32_t>(grid_z);
    const int32_t per_batch = static_cast<int32_t>(n / coor.size(0));
    dispatch_float<Bf16::kBits>(coor, "coor", [&](auto tag) {
      using S = decltype(tag);
      using Coord =
          std::conditional_t<std::is_same<S, float>::value, CoordF32,
                             std::conditional_t<std::is_same<S, half>::value, CoordF16, CoordBF16>>;
      pipe.count(frustum_cells<Coord>(data_of(coor), per_batch, grid), flags, interval_starts,
                 interval_lengths, c.iv_capacity, c.host, "bev_pool_prepare cells_kernel");
    });
  }
  if (flags & kStageOrder) {
    Emit out;
    out.first = data_of<int32_t>(ranks_bev);
    out.depth = data_of<int32_t>(ranks_depth);
    out.feat = data_of<int32_t>(ranks_feat);
    out.dhw = static_cast<int32_t>(coor.size(2) * coor.size(3) * coor.size(4));
    out.hw = static_cast<int32_t>(coor.size(3) * coor.size(4));
    pipe.order<true>(out);
  }
}

// cell [n] int32/int64 -> order [n], interval_starts, interval_lengths [min(n, n_cells)], valid
// up to workspace[0] (n_kept) and workspace[1] (n_intervals); flags as for
// bev_pool_prepare_forward. Nothing is launched when n == 0 or n_cells == 0 (every entry is
// dropped: the caller knows the result is empty).
void sort_by_cell_forward(TensorView cell, TensorView workspace, TensorView order,
                          TensorView interval_starts, TensorView interval_lengths, int64_t n_cells,
                          int64_t flags, int64_t host_counts, int64_t sequence, int64_t stream) {
  check_gpu_tensor(cell, "cell");
  check_index_dtype(cell, "cell");
  check_contiguous(cell, "cell");
  check_ndim(cell, "cell", 1);
  const int64_t n = cell.numel();
  if (n > kMaxEntries) {
    TVM_FFI_THROW(ValueError) << "cell has " << n << " entries; int32 order allows at most "
                              << kMaxEntries;
  }
  if (n_cells < 0 || n_cells > kMaxCells) {
    TVM_FFI_THROW(ValueError) << "n_cells must be in [0, " << kMaxCells << "], got " << n_cells;
  }
  const Checked c =
      check_outputs(cell, n, n_cells, flags, host_counts, sequence, {{&order, "order"}},
                    interval_starts, interval_lengths, workspace);
  if (n == 0 || n_cells == 0) return;

  DeviceGuard guard(cell.device().device_id);
  const Pipeline pipe = pipeline(c, workspace, cell, n, n_cells, stream);
  if (flags & kStageCount) {
    dispatch_index(cell, "cell", [&](auto tag) {
      using I = decltype(tag);
      pipe.count(GivenCells<I>{data_of<const I>(cell), static_cast<int32_t>(n_cells)}, flags,
                 interval_starts, interval_lengths, c.iv_capacity, c.host,
                 "sort_by_cell cells_kernel");
    });
  }
  if (flags & kStageOrder) {
    Emit out;
    out.first = data_of<int32_t>(order);
    out.depth = nullptr;
    out.feat = nullptr;
    out.dhw = 1;
    out.hw = 1;
    pipe.order<false>(out);
  }
}

}  // namespace
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_sort_workspace_ints, muspace::bev_pool_sort_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_prepare_forward, muspace::bev_pool_prepare_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sort_by_cell_forward, muspace::sort_by_cell_forward);
