// Voxelization (mmcv's hard and dynamic voxelization), for MUSA and CUDA. The long form of the
// design is docs/operators/voxelization.md; in short:
//
// Dynamic (voxel_dynamic_forward): one thread per point writes mmcv's coordinate row (z, y, x),
// or its -1 pattern for a dropped point (x invalid: (-1, 0, 0); y: (-1, -1, 0); z: (-1, -1, -1)),
// with the sample index first for a batched call.
//
// Hard, deterministic, no host sync: two entry points around the caller's stable sort
// (torch.sort: CUB's radix sort under CUDA, torch_musa's under MUSA; our own 3-pass radix sort
// took ~85 of the 141 us of device time at 300k points on the H200, 2026-12-01):
//   1. keys_kernel       (voxel_hard_keys) per point its key = sample * cells + ((z * gy) + y)
//                        * gx + x, or the sentinel (= samples * cells, larger than every key)
//                        when dropped
//   2. the caller's stable sort of the keys -> sorted keys and the permutation (int64): the
//                        points of a voxel are a run, in input order; runs ordered by key
//   then voxel_hard_forward:
//   3. first_flags       first[point] = 1 for the first point of each run (the voxel's first
//                        point), 0 otherwise; every entry written (the sort is a permutation)
//   4. scan(first)       -> each voxel's rank in first-occurrence order over the whole batch
//   5. samples_kernel    (one thread) per sample: its first rank, its voxels, the kept ones
//                        (min with max_voxels), their output base; the counts for the host
//   6. rows_kernel       per run start: the voxel's output row (base + rank in the sample) when
//                        kept -> row_start[row] = the run's first sorted position
//   7. emit_kernel       per (row, slot < max_points): the point at sorted position
//                        row_start + slot if it is still in the run, else zeros; slot 0 also
//                        writes the coordinates (decoded from the key) and the point count
// The outputs have `rows` rows (an upper bound); rows beyond the voxel count are left alone, or
// padded (voxels 0, coors -1, num 0) in the padded mode (voxelization_padded: CUDA-graph
// capturable). counts[0] = the voxel count, counts[1 + b] = sample b's, on the device.
//
// Safety: every data-dependent index is checked (positions against n, rows against `rows`,
// samples against the sample count); NaN / inf points are dropped; bad arguments raise naming
// them. Everything is int32 (n, cells * samples, rows); the output offsets are int64.

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "readback.muh"
#include "scan.muh"
#include "voxel_grid.muh"

namespace muspace {
namespace voxel {
namespace {

using scan::exclusive_scan;
using scan::kBlock;  // threads of every kernel here
using scan::scan_tiles;
using tvm::ffi::Shape;

constexpr int kBlocksPerSm = 8;  // grid cap of the grid-stride kernels, per multiprocessor
constexpr int64_t kMaxPoints = int64_t{1} << 30;
MUSPACE_LIMIT(voxelization, max_points, kMaxPoints);
constexpr int64_t kMaxCells = INT_MAX - 1;  // samples * gx * gy * gz: keys and the sentinel
MUSPACE_LIMIT(voxelization, max_cells, kMaxCells);
constexpr int64_t kMaxPointsPerVoxel = 1 << 16;
MUSPACE_LIMIT(voxelization, max_points_per_voxel, kMaxPointsPerVoxel);
MUSPACE_LIMIT(voxelization, max_samples, kMaxSamples);

// ------------------------------------------------------------------------------------- kernels

template <typename T>
__global__ void __launch_bounds__(kBlock)
    dynamic_kernel(const T* __restrict__ points, int n, int features, Grid g, Samples s, int ncols,
                   int* __restrict__ coors) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const T* p = points + i * features;
    int c[3] = {0, 0, 0};
    int failed = 3;  // the first invalid axis (x = 0, y = 1, z = 2), 3: valid
    for (int a = 0; a < 3; ++a) {
      if (!axis_cell(coord_value(p[a]), g, a, c[a])) {
        failed = a;
        break;
      }
    }
    int* row = coors + i * ncols;
    if (ncols == 4) *row++ = sample_of(s, static_cast<int>(i));
    if (failed == 3) {
      row[0] = c[2];
      row[1] = c[1];
      row[2] = c[0];
    } else {  // mmcv writes -1 into the columns it has reached (its output starts as zeros)
      row[0] = -1;
      row[1] = failed >= 1 ? -1 : 0;
      row[2] = failed >= 2 ? -1 : 0;
    }
  }
}

// Point i's key = sample * cells + ((z * gy) + y) * gx + x; false when the point is dropped.
template <typename T>
__device__ __forceinline__ bool point_key(const T* __restrict__ points, int64_t i, int features,
                                          const Grid& g, const Samples& s, uint32_t cells,
                                          uint32_t& key) {
  const T* p = points + i * features;
  int cx = 0, cy = 0, cz = 0;
  if (!(axis_cell(coord_value(p[0]), g, 0, cx) && axis_cell(coord_value(p[1]), g, 1, cy) &&
        axis_cell(coord_value(p[2]), g, 2, cz))) {
    return false;
  }
  const int64_t cell =
      (static_cast<int64_t>(cz) * g.cells[1] + cy) * g.cells[0] + static_cast<int64_t>(cx);
  const int64_t k = static_cast<int64_t>(sample_of(s, static_cast<int>(i))) * cells + cell;
  key = static_cast<uint32_t>(k);  // < samples * cells <= kMaxCells: checked by the launcher
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    keys_kernel(const T* __restrict__ points, int n, int features, Grid g, Samples s,
                uint32_t cells, uint32_t sentinel, uint32_t* __restrict__ keys) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    uint32_t key = 0;
    keys[i] = point_key(points, i, features, g, s, cells, key) ? key : sentinel;
  }
}

__device__ __forceinline__ bool run_start(const uint32_t* keys, int p, uint32_t sentinel) {
  const uint32_t k = keys[p];
  return k != sentinel && (p == 0 || keys[p - 1] != k);
}

__global__ void __launch_bounds__(kBlock)
    first_flags_kernel(const uint32_t* __restrict__ keys, const int64_t* __restrict__ idx, int n,
                       uint32_t sentinel, int* __restrict__ first) {
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    const int64_t i = idx[p];
    if (static_cast<uint64_t>(i) < static_cast<uint64_t>(n)) {
      first[i] = run_start(keys, static_cast<int>(p), sentinel) ? 1 : 0;
    }
  }
}

// One thread: per sample b its first voxel rank, voxel count, kept count and output base.
__global__ void samples_kernel(const int* __restrict__ rank, const int* __restrict__ total, int n,
                               Samples s, int max_voxels, int* __restrict__ sample_first,
                               int* __restrict__ sample_base, int64_t* __restrict__ counts) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t base = 0;
  for (int b = 0; b < s.count; ++b) {
    const int lo = s.off[b] < n ? rank[s.off[b]] : *total;
    const int hi = s.off[b + 1] < n ? rank[s.off[b + 1]] : *total;
    const int kept = std::min(std::max(hi - lo, 0), max_voxels);
    sample_first[b] = lo;
    sample_base[b] = static_cast<int>(base);
    counts[1 + b] = kept;
    base += kept;
  }
  counts[0] = base;
}

__global__ void __launch_bounds__(kBlock)
    rows_kernel(const uint32_t* __restrict__ keys, const int64_t* __restrict__ idx, int n,
                uint32_t cells, uint32_t sentinel, int n_samples, const int* __restrict__ rank,
                const int* __restrict__ sample_first, const int* __restrict__ sample_base,
                int max_voxels, int rows, int* __restrict__ row_start) {
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    if (!run_start(keys, static_cast<int>(p), sentinel)) continue;
    const int64_t i = idx[p];
    const int b = static_cast<int>(keys[p] / cells);
    if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(n) || b >= n_samples) continue;
    const int local = rank[i] - sample_first[b];
    if (local < 0 || local >= max_voxels) continue;  // beyond max_voxels: dropped
    const int row = sample_base[b] + local;
    if (static_cast<unsigned>(row) < static_cast<unsigned>(rows))
      row_start[row] = static_cast<int>(p);
  }
}

// W: the raw element word (uint32_t for float32, uint16_t for 16-bit dtypes).
template <typename W>
__global__ void __launch_bounds__(kBlock)
    emit_kernel(const W* __restrict__ points, int features, const uint32_t* __restrict__ keys,
                const int64_t* __restrict__ idx, int n, uint32_t cells, Grid g,
                const int* __restrict__ row_start, const int64_t* __restrict__ counts, int rows,
                int max_points, int padded, int ncols, W* __restrict__ voxels,
                int* __restrict__ coors, int* __restrict__ num) {
  const int64_t m = counts[0];
  const int64_t total = static_cast<int64_t>(rows) * max_points;
  if (max_points <= 0) return;
  RowCol rc(global_thread(), global_threads(), max_points);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int row = static_cast<int>(rc.row);
    const int slot = rc.col;
    W* dst = voxels + e * features;
    if (row >= m) {
      if (!padded) continue;
      for (int f = 0; f < features; ++f) dst[f] = W(0);
      if (slot == 0) {
        for (int c = 0; c < ncols; ++c) coors[static_cast<int64_t>(row) * ncols + c] = -1;
        num[row] = 0;
      }
      continue;
    }
    const int start = row_start[row];
    const bool ok_start = static_cast<unsigned>(start) < static_cast<unsigned>(n);
    const uint32_t key = ok_start ? keys[start] : 0u;
    const int pos = start + slot;
    const bool member = ok_start && pos < n && keys[pos] == key;
    const int64_t i = member ? idx[pos] : -1;
    if (member && static_cast<uint64_t>(i) < static_cast<uint64_t>(n)) {
      const W* src = points + static_cast<int64_t>(i) * features;
      for (int f = 0; f < features; ++f) dst[f] = src[f];
    } else {
      for (int f = 0; f < features; ++f) dst[f] = W(0);
    }
    if (slot != 0) continue;
    int count = 0;
    while (ok_start && count < max_points && start + count < n && keys[start + count] == key) {
      ++count;
    }
    num[row] = count;
    const int b = static_cast<int>(key / cells);
    const int cell = static_cast<int>(key - static_cast<uint32_t>(b) * cells);
    const int x = cell % g.cells[0];
    const int y = (cell / g.cells[0]) % g.cells[1];
    const int z = cell / (g.cells[0] * g.cells[1]);
    int* c = coors + static_cast<int64_t>(row) * ncols;
    if (ncols == 4) *c++ = b;
    c[0] = z;
    c[1] = y;
    c[2] = x;
  }
}

// ---------------------------------------------------------------- hashed grouping (no sort)
//
// voxel_hard_forward_hashed: the same outputs as voxel_hard_keys + sort + voxel_hard_forward,
// without sorting the points (the sort was 40-50 % of that path's device time on the H200,
// 2026-12-01). Only the order of the atomics below depends on the thread schedule; every value
// written to the outputs does not:
//   1. fill             the slot table (key, first, count; 16 bytes a slot) and the cursor with
//                       -1: one launch
//   2. insert_kernel    per point its key -> its slot (the cell itself when the batch's cells fit
//                       the table, else open addressing over a power of two); atomicMin of the
//                       point index -> the voxel's first point; atomicAdd of the slot's count ->
//                       the point's position among the slot's points (any order)
//   3. flags_kernel     flag = point is its voxel's first point; the first points of a block
//                       take their voxels' stretches of the point list (one atomicAdd on a
//                       cursor per block)
//   4. scan(flags)      -> each voxel's rank in first-occurrence order (as in the sort path)
//   5. samples_kernel   (shared with the sort path); the voxel count is copied to the host here
//   6. place_kernel     each point into its voxel's stretch; a first point of a kept voxel
//                       writes its output row's stretch, coordinates and point count
//   7. emit_hashed_kernel  a warp per output row: the first min(count, max_points) point
//                       indices of its stretch in ascending order (input order): a stretch of
//                       at most a warp by each entry's rank (one shuffle per entry), a longer
//                       one by bitonic sorting of warp-wide chunks merged into the warp-wide
//                       smallest; the points copied, the rest of the row zeroed.
// A voxel's points cost ceil(k / warp) * ceil(count / warp) chunk steps (k = min(count,
// max_points)), which is why max_points is limited to kHashedMaxPointsPerVoxel (the sort path
// takes larger ones).

constexpr uint32_t kFreeKey = 0xFFFFFFFFu;  // a free slot: larger than every key (< 2^31)
constexpr int64_t kHashedMaxPointsPerVoxel = 1024;
MUSPACE_LIMIT(voxelization, hashed_max_points_per_voxel, kHashedMaxPointsPerVoxel);
constexpr int64_t kHashedMaxPoints = int64_t{1} << 29;  // the hash table's cap <= 2^30
MUSPACE_LIMIT(voxelization, hashed_max_points, kHashedMaxPoints);

// The slot table: one 16-byte entry per slot, so the insert's probe, compare-and-swap, minimum
// and count, and the later reads of a slot, touch one sector. key / first / count start as -1
// (one fill): first as uint32 is then larger than every point index (atomicMin), and a count
// (and the cursor) holds its value - 1.
struct Slot {
  uint32_t key;    // kFreeKey when free (unused when direct)
  uint32_t first;  // the smallest point index of the slot
  int count;       // the slot's points - 1
  int base;        // the slot's first entry in the point list (written by its first point)
};

struct Table {
  Slot* slots;    // [cap]
  int* cursor;    // [1] entries handed out - 1
  uint32_t mask;  // cap - 1 (a power of two) when hashed
  int cap;
  int direct;  // 1: slot = key (cap = samples * cells)
};

__device__ __forceinline__ uint32_t mix32(uint32_t k) {  // MurmurHash3's 32-bit finaliser
  k ^= k >> 16;
  k *= 0x85ebca6bu;
  k ^= k >> 13;
  k *= 0xc2b2ae35u;
  k ^= k >> 16;
  return k;
}

// The slot of key, claimed if new; -1 only for a full table (impossible: cap > n >= the keys).
__device__ __forceinline__ int claim_slot(const Table& t, uint32_t key) {
  if (t.direct) return static_cast<int>(key);
  uint32_t slot = mix32(key) & t.mask;
  for (uint32_t probe = 0; probe <= t.mask; ++probe) {
    // a claimed slot's key never changes, so a plain read that shows another key is final
    uint32_t* at = &t.slots[slot].key;
    const uint32_t seen = *at;
    if (seen == key) return static_cast<int>(slot);
    if (seen == kFreeKey) {
      const uint32_t old = atomicCAS(at, kFreeKey, key);
      if (old == kFreeKey || old == key) return static_cast<int>(slot);
    }
    slot = (slot + 1) & t.mask;
  }
  return -1;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    insert_kernel(const T* __restrict__ points, int n, int features, Grid g, Samples s,
                  uint32_t cells, Table t, int* __restrict__ point_slot,
                  int* __restrict__ point_pos) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    uint32_t key = 0;
    int slot = point_key(points, i, features, g, s, cells, key) ? claim_slot(t, key) : -1;
    if (static_cast<unsigned>(slot) >= static_cast<unsigned>(t.cap)) slot = -1;
    int pos = 0;
    if (slot >= 0) {
      atomicMin(&t.slots[slot].first, static_cast<uint32_t>(i));
      pos = atomicAdd(&t.slots[slot].count, 1) + 1;
    }
    point_slot[i] = slot;
    point_pos[i] = pos;
  }
}

// Block-uniform loop: the first points of a block take their stretches with one atomicAdd on
// the cursor per block (one per first point serialised on that address: 92 us of 261 at
// CenterPoint's 119k voxels on the H200, ncu, 2026-12-02).
__global__ void __launch_bounds__(kBlock)
    flags_kernel(const int* __restrict__ point_slot, int n, Table t, int* __restrict__ flags) {
  __shared__ int s[kBlock];
  __shared__ int block_base;
  for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlock; i0 < n;
       i0 += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = i0 + threadIdx.x;
    const int slot = i < n ? point_slot[i] : -1;
    const bool first = slot >= 0 && t.slots[slot].first == static_cast<uint32_t>(i);
    int total = 0;
    const int offset = scan::block_exclusive_scan(first ? t.slots[slot].count + 1 : 0, s, total);
    if (threadIdx.x == 0) block_base = atomicAdd(t.cursor, total) + 1;
    __syncthreads();
    if (first) t.slots[slot].base = block_base + offset;
    if (i < n) flags[i] = first ? 1 : 0;
    __syncthreads();  // block_base is written again in the next round
  }
}

// Each point into its voxel's stretch; the first point of a kept voxel also writes its row's
// stretch (base, count), coordinates (decoded from the key) and point count: a thread per voxel
// here instead of a lane of the emit's warp (the divisions made the emit instruction bound).
__global__ void __launch_bounds__(kBlock)
    place_kernel(const int* __restrict__ point_slot, const int* __restrict__ point_pos, int n,
                 Table t, Samples s, uint32_t cells, Grid g, const int* __restrict__ rank,
                 const int* __restrict__ sample_first, const int* __restrict__ sample_base,
                 int max_voxels, int rows, int max_points, int ncols, int* __restrict__ list,
                 int2* __restrict__ row_stretch, int* __restrict__ coors, int* __restrict__ num) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int slot = point_slot[i];
    if (slot < 0) continue;
    const Slot e = t.slots[slot];
    const int at = e.base + point_pos[i];
    if (static_cast<unsigned>(at) < static_cast<unsigned>(n)) list[at] = static_cast<int>(i);
    if (e.first != static_cast<uint32_t>(i)) continue;
    const int b = sample_of(s, static_cast<int>(i));
    const int local = rank[i] - sample_first[b];
    if (local < 0 || local >= max_voxels) continue;  // beyond max_voxels: dropped
    const int row = sample_base[b] + local;
    if (static_cast<unsigned>(row) >= static_cast<unsigned>(rows)) continue;
    const int cnt = e.count + 1;
    row_stretch[row] = make_int2(e.base, cnt);
    num[row] = min(cnt, max_points);
    const uint32_t key = t.direct ? static_cast<uint32_t>(slot) : e.key;
    const int cell = static_cast<int>(key - static_cast<uint32_t>(b) * cells);
    int* c = coors + static_cast<int64_t>(row) * ncols;
    if (ncols == 4) *c++ = b;
    c[0] = cell / (g.cells[0] * g.cells[1]);
    c[1] = (cell / g.cells[0]) % g.cells[1];
    c[2] = cell % g.cells[0];
  }
}

// Bitonic sort of one value per lane across the warp, ascending with the lane.
__device__ __forceinline__ int warp_sort_ascending(int v, int lane) {
#pragma unroll
  for (int size = 2; size <= kWarpSize; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int other = __shfl_xor_sync(kFullMask, v, stride, kWarpSize);
      const bool low = (lane & stride) == 0;
      const bool ascending = (lane & size) == 0;
      v = low == ascending ? min(v, other) : max(v, other);
    }
  }
  return v;
}

// Lane t: the t-th smallest entry of list[0, cnt) greater than `after` (INT_MAX past the end).
// Entries are distinct. Warp-uniform arguments.
__device__ __forceinline__ int warp_smallest_after(const int* __restrict__ list, int cnt, int after,
                                                   int lane) {
  int best = INT_MAX;
  for (int c = 0; c < cnt; c += kWarpSize) {
    int v = c + lane < cnt ? list[c + lane] : INT_MAX;
    if (v <= after) v = INT_MAX;
    v = warp_sort_ascending(v, lane);
    // best ascending, v reversed descending: their lane-wise minimum is bitonic and holds the
    // warp-wide smallest of both; a bitonic merge sorts it
    best = min(best, __shfl_sync(kFullMask, v, kWarpSize - 1 - lane, kWarpSize));
#pragma unroll
    for (int stride = kWarpSize >> 1; stride > 0; stride >>= 1) {
      const int other = __shfl_xor_sync(kFullMask, best, stride, kWarpSize);
      best = (lane & stride) == 0 ? min(best, other) : max(best, other);
    }
  }
  return best;
}

// W: the raw element word (uint32_t for float32, uint16_t for 16-bit dtypes).
template <typename W>
__global__ void __launch_bounds__(kBlock)
    emit_hashed_kernel(const W* __restrict__ points, int features, const int* __restrict__ list,
                       int n, const int2* __restrict__ row_stretch,
                       const int64_t* __restrict__ counts, int rows, int max_points, int padded,
                       int ncols, W* __restrict__ voxels, int* __restrict__ coors,
                       int* __restrict__ num) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warps = global_threads() / kWarpSize;
  const int64_t m = counts[0];
  const int64_t row_words = static_cast<int64_t>(max_points) * features;
  const RowCol lane_slot(lane, kWarpSize, features);                     // one division per thread
  for (int64_t r = global_thread() / kWarpSize; r < rows; r += warps) {  // warp-uniform
    W* dst = voxels + r * row_words;
    int* c = coors + r * ncols;
    if (r >= m) {
      if (!padded) continue;
      for (int64_t w = lane; w < row_words; w += kWarpSize) dst[w] = W(0);
      if (lane < ncols) c[lane] = -1;
      if (lane == 0) num[r] = 0;
      continue;
    }
    const int2 stretch_at = row_stretch[r];  // (base, count), from place_kernel
    const int base = stretch_at.x;
    int cnt = stretch_at.y;
    if (cnt < 0 || base < 0 || base > n - cnt) cnt = 0;  // never from the kernels above
    const int k = min(cnt, max_points);
    const int* stretch = list + base;
    if (cnt <= kWarpSize) {
      // one entry per lane; its rank among the stretch (entries are distinct) is its slot. The
      // common case (CenterPoint: 2.8 points per voxel on average): cnt shuffles instead of the
      // networks below
      const int v = lane < cnt ? stretch[lane] : INT_MAX;
      int rank = 0;
      for (int j = 0; j < cnt; ++j) rank += __shfl_sync(kFullMask, v, j, kWarpSize) < v ? 1 : 0;
      if (lane < cnt && rank < k && static_cast<unsigned>(v) < static_cast<unsigned>(n)) {
        const W* src = points + static_cast<int64_t>(v) * features;
        W* out = dst + static_cast<int64_t>(rank) * features;
        for (int f = 0; f < features; ++f) out[f] = src[f];
      }
    }
    int after = -1;
    for (int lo = 0; cnt > kWarpSize && lo < k; lo += kWarpSize) {
      const int best = warp_smallest_after(stretch, cnt, after, lane);
      const int64_t words = static_cast<int64_t>(min(k - lo, kWarpSize)) * features;
      W* out = dst + static_cast<int64_t>(lo) * features;
      RowCol sf = lane_slot;  // (slot in the chunk, feature) of word w
      for (int64_t w0 = 0; w0 < words; w0 += kWarpSize, sf.next()) {  // warp-uniform: shuffle
        const int64_t w = w0 + lane;
        const int p =
            __shfl_sync(kFullMask, best, w < words ? static_cast<int>(sf.row) : 0, kWarpSize);
        if (w < words && static_cast<unsigned>(p) < static_cast<unsigned>(n)) {
          out[w] = points[static_cast<int64_t>(p) * features + sf.col];
        }
      }
      after = __shfl_sync(kFullMask, best, kWarpSize - 1, kWarpSize);
    }
    for (int64_t w = static_cast<int64_t>(k) * features + lane; w < row_words; w += kWarpSize) {
      dst[w] = W(0);
    }
  }
}

// ------------------------------------------------------------------------------ host helpers

int blocks_for(int64_t n_threads, int device_id) {
  return grid_for(n_threads, kBlock, device_id, kBlocksPerSm);
}

Grid make_grid(float vx, float vy, float vz, float x0, float y0, float z0, int64_t gx, int64_t gy,
               int64_t gz) {
  const float size[3] = {vx, vy, vz};
  const float lower[3] = {x0, y0, z0};
  const int64_t cells[3] = {gx, gy, gz};
  const char* axes = "xyz";
  Grid g;
  for (int a = 0; a < 3; ++a) {
    if (!(std::isfinite(size[a]) && size[a] > 0.0f)) {
      TVM_FFI_THROW(ValueError) << "voxel_size must be positive and finite, got " << size[a]
                                << " for " << axes[a];
    }
    if (!std::isfinite(lower[a])) {
      TVM_FFI_THROW(ValueError) << "coors_range must be finite, got " << lower[a] << " for "
                                << axes[a] << "_min";
    }
    if (cells[a] < 1 || cells[a] > INT_MAX) {
      TVM_FFI_THROW(ValueError) << "the grid must have 1 to " << INT_MAX << " cells along "
                                << axes[a] << ", got " << cells[a];
    }
    g.size[a] = size[a];
    g.lower[a] = lower[a];
    g.cells[a] = static_cast<int>(cells[a]);
  }
  return g;
}

Samples make_samples(const Shape& offsets, int64_t n) {
  if (offsets.size() < 2 || offsets.size() > kMaxSamples + 1) {
    TVM_FFI_THROW(ValueError) << "sample_offsets must hold 2 to " << kMaxSamples + 1
                              << " offsets (1 to " << kMaxSamples << " samples), got "
                              << offsets.size();
  }
  Samples s;
  s.count = static_cast<int>(offsets.size()) - 1;
  for (size_t b = 0; b < offsets.size(); ++b) {
    const int64_t o = offsets[b];
    if ((b == 0 && o != 0) || (b > 0 && o < offsets[b - 1]) || o > n) {
      TVM_FFI_THROW(ValueError) << "sample_offsets must rise from 0 to the " << n << " points, got "
                                << o << " at " << b;
    }
    s.off[b] = static_cast<int>(o);
  }
  if (offsets[offsets.size() - 1] != n) {
    TVM_FFI_THROW(ValueError) << "sample_offsets must end at the " << n << " points, got "
                              << offsets[offsets.size() - 1];
  }
  return s;
}

int64_t check_points_tensor(const TensorView& points) {
  check_gpu_tensor(points, "points");
  check_float_dtype<Bf16::kBits>(points, "points");
  check_contiguous(points, "points");
  check_ndim(points, "points", 2);
  if (points.size(1) < 3) {
    TVM_FFI_THROW(ValueError) << "points must be [N, C] with C >= 3, got C = " << points.size(1);
  }
  if (points.size(0) > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << "points has " << points.size(0) << " rows; at most " << kMaxPoints
                              << " are supported";
  }
  return points.size(0);
}

// The workspace of voxel_hard_forward, in int32 units (every region 16-byte aligned).
struct HardLayout {
  int64_t sums, first, total, sample_first, sample_base, row_start, ints;
};

int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

HardLayout hard_layout(int64_t n, int64_t rows) {
  HardLayout l;
  int64_t off = 0;
  auto take = [&](int64_t k) {
    const int64_t at = off;
    off += round4(std::max<int64_t>(k, 1));
    return at;
  };
  l.sums = take(scan_tiles(n) + 1);
  l.first = take(n);
  l.total = take(1);
  l.sample_first = take(kMaxSamples);
  l.sample_base = take(kMaxSamples + 1);
  l.row_start = take(rows);
  l.ints = off;
  return l;
}

// ------------------------------------------------------------------------------ entry points

int64_t hard_workspace_ints(int64_t n, int64_t n_samples, int64_t rows) {
  if (n < 0 || rows < 0 || n_samples < 1 || n_samples > kMaxSamples) {
    TVM_FFI_THROW(ValueError) << "voxel_hard_workspace_ints: n = " << n
                              << ", n_samples = " << n_samples << ", rows = " << rows
                              << " out of range";
  }
  return hard_layout(n, rows).ints;
}

void dynamic_forward(TensorView points, TensorView coors, float vx, float vy, float vz, float x0,
                     float y0, float z0, int64_t gx, int64_t gy, int64_t gz, Shape sample_offsets,
                     int64_t stream) {
  const int64_t n = check_points_tensor(points);
  check_input(coors, "coors", points, kInt32);
  check_ndim(coors, "coors", 2);
  check_size(coors, "coors", 0, n);
  const int ncols = static_cast<int>(coors.size(1));
  if (ncols != 3 && ncols != 4) {
    TVM_FFI_THROW(ValueError) << "coors must be [N, 3] (z, y, x) or [N, 4] (sample, z, y, x), "
                              << "got " << ncols << " columns";
  }
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  if (ncols == 3 && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "coors must have a sample column ([N, 4]) for " << s.count
                              << " samples";
  }
  if (n == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  dispatch_float<Bf16::kBits>(points, "points", [&](auto tag) {
    using T = decltype(tag);
    dynamic_kernel<T><<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const T>(points), static_cast<int>(n), static_cast<int>(points.size(1)), g, s,
        ncols, data_of<int>(coors));
    check_launch("voxel dynamic_kernel");
  });
}

// Cells per sample (gx * gy * gz); samples * cells (the sentinel key) must fit the int32 keys.
int64_t checked_cells(int64_t gx, int64_t gy, int64_t gz, const Samples& s) {
  // gx, gy, gz < 2^31 each (make_grid): the products are checked step by step (no overflow)
  const int64_t cells_xy = gx * gy;
  const int64_t cells = cells_xy <= kMaxCells ? cells_xy * gz : kMaxCells + 1;
  if (cells > kMaxCells || cells * s.count > kMaxCells) {
    TVM_FFI_THROW(ValueError) << s.count << " samples of " << gx << "*" << gy << "*" << gz
                              << " cells exceed the int32 keys (" << kMaxCells << " cells)";
  }
  return cells;
}

// keys [N] int32 <- each point's key (the sentinel samples * cells for a dropped point), for
// the caller's stable sort before voxel_hard_forward.
void hard_keys(TensorView points, TensorView keys, float vx, float vy, float vz, float x0, float y0,
               float z0, int64_t gx, int64_t gy, int64_t gz, Shape sample_offsets, int64_t stream) {
  const int64_t n = check_points_tensor(points);
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  const int64_t cells = checked_cells(gx, gy, gz, s);
  check_vector(keys, "keys", points, kInt32, n);
  if (n == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const uint32_t ucells = static_cast<uint32_t>(cells);
  const uint32_t sentinel = static_cast<uint32_t>(cells * s.count);
  // keys < 2^31 (kMaxCells): the same order as int32 and as uint32
  uint32_t* out = reinterpret_cast<uint32_t*>(data_of<int>(keys));
  dispatch_float<Bf16::kBits>(points, "points", [&](auto tag) {
    using T = decltype(tag);
    keys_kernel<T><<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const T>(points), static_cast<int>(n), static_cast<int>(points.size(1)), g, s,
        ucells, sentinel, out);
    check_launch("voxel keys_kernel");
  });
}

// The checks the hard entry points share: max_points / max_voxels, the outputs against points
// and the samples. Returns the output rows; ncols gets coors' columns.
int64_t check_hard_outputs(const TensorView& points, const Samples& s, int64_t gx, int64_t gy,
                           int64_t gz, int64_t max_points, int64_t max_voxels, bool padded,
                           const TensorView& voxels, const TensorView& coors,
                           const TensorView& num_points, const TensorView& counts, int& ncols) {
  const int64_t features = points.size(1);
  if (max_points < 0 || max_points > kMaxPointsPerVoxel) {
    TVM_FFI_THROW(ValueError) << "max_points must be in [0, " << kMaxPointsPerVoxel << "], got "
                              << max_points;
  }
  if (max_voxels < 0 || max_voxels > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "max_voxels must be in [0, " << INT_MAX << "], got " << max_voxels;
  }
  if (padded && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "the padded mode takes one sample, got " << s.count;
  }
  checked_cells(gx, gy, gz, s);
  check_like(voxels, "voxels", points, "points");
  check_ndim(voxels, "voxels", 3);
  const int64_t rows = voxels.size(0);
  check_size(voxels, "voxels", 1, max_points);
  check_size(voxels, "voxels", 2, features);
  if (rows > INT_MAX)
    TVM_FFI_THROW(ValueError) << "voxels has " << rows << " rows; at most " << INT_MAX;
  check_input(coors, "coors", points, kInt32);
  check_ndim(coors, "coors", 2);
  check_size(coors, "coors", 0, rows);
  ncols = static_cast<int>(coors.size(1));
  if (ncols != 3 && ncols != 4) {
    TVM_FFI_THROW(ValueError) << "coors must be [rows, 3] (z, y, x) or [rows, 4] (sample, z, y, "
                              << "x), got " << ncols << " columns";
  }
  if (ncols == 3 && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "coors must have a sample column ([rows, 4]) for " << s.count
                              << " samples";
  }
  int64_t needed = 0;  // rows the kept voxels can fill: sum over samples of min(points, V)
  for (int b = 0; b < s.count; ++b)
    needed += std::min<int64_t>(s.off[b + 1] - s.off[b], max_voxels);
  if (rows < needed) {
    TVM_FFI_THROW(ValueError) << "voxels must have at least " << needed << " rows (min(points, "
                              << "max_voxels) per sample), got " << rows;
  }
  check_vector(num_points, "num_points", points, kInt32, rows);
  check_vector(counts, "counts", points, kInt64, s.count + 1);
  return rows;
}

// sorted_keys [N] int32 / perm [N] int64: voxel_hard_keys' keys stably sorted (position p holds
// point perm[p]; an entry outside [0, N) is skipped).
void hard_forward(TensorView points, TensorView sorted_keys, TensorView perm, TensorView workspace,
                  TensorView voxels, TensorView coors, TensorView num_points, TensorView counts,
                  float vx, float vy, float vz, float x0, float y0, float z0, int64_t gx,
                  int64_t gy, int64_t gz, int64_t max_points, int64_t max_voxels,
                  Shape sample_offsets, bool padded, int64_t stream) {
  const int64_t n = check_points_tensor(points);
  const int64_t features = points.size(1);
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  check_vector(sorted_keys, "sorted_keys", points, kInt32, n);
  check_vector(perm, "perm", points, kInt64, n);
  int ncols = 3;
  const int64_t rows = check_hard_outputs(points, s, gx, gy, gz, max_points, max_voxels, padded,
                                          voxels, coors, num_points, counts, ncols);
  const int64_t cells = checked_cells(gx, gy, gz, s);
  const HardLayout l = hard_layout(n, rows);
  check_input(workspace, "workspace", points, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < l.ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << l.ints << " int32 (from "
                              << "voxel_hard_workspace_ints), got " << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);

  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* ws = data_of<int>(workspace);
  int64_t* counts_p = data_of<int64_t>(counts);
  const uint32_t ucells = static_cast<uint32_t>(cells);
  const uint32_t sentinel = static_cast<uint32_t>(cells * s.count);
  const int ni = static_cast<int>(n);
  const int rows_i = static_cast<int>(rows);
  const int P = static_cast<int>(max_points);
  const int V = static_cast<int>(max_voxels);
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(data_of<const int>(sorted_keys));
  const int64_t* idx = data_of<const int64_t>(perm);
  if (n == 0) {
    launch_zero(counts_p, (s.count + 1) * 8, device_id, st, "voxel fill (counts)");
  } else {
    int* first = ws + l.first;
    first_flags_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(keys, idx, ni, sentinel, first);
    check_launch("voxel first_flags_kernel");
    exclusive_scan(first, first, n, ws + l.sums, ws + l.total, st, "voxel first scan");
    samples_kernel<<<1, 1, 0, st>>>(first, ws + l.total, ni, s, V, ws + l.sample_first,
                                    ws + l.sample_base, counts_p);
    check_launch("voxel samples_kernel");
    rows_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        keys, idx, ni, ucells, sentinel, s.count, first, ws + l.sample_first, ws + l.sample_base, V,
        rows_i, ws + l.row_start);
    check_launch("voxel rows_kernel");
  }
  if (rows == 0 || max_points == 0 || (n == 0 && !padded)) return;
  const int64_t slots = rows * max_points;
  const int elem = element_bytes(points);
  auto emit = [&](auto word_tag) {
    using W = decltype(word_tag);
    emit_kernel<W><<<blocks_for(slots, device_id), kBlock, 0, st>>>(
        data_of<const W>(points), static_cast<int>(features), keys, idx, ni, ucells, g,
        ws + l.row_start, counts_p, rows_i, P, padded ? 1 : 0, ncols, data_of<W>(voxels),
        data_of<int>(coors), data_of<int>(num_points));
    check_launch("voxel emit_kernel");
  };
  if (elem == 4) {
    emit(uint32_t{});
  } else {
    emit(uint16_t{});
  }
}

// The workspace of voxel_hard_forward_hashed, in int32 units (every region 16-byte aligned);
// [fill_at, fill_at + fill_ints) is the table part that starts as -1.
struct HashedLayout {
  int64_t cap;
  bool direct;
  int64_t slots, cursor, point_slot, point_pos, flags, sums, total, sample_first, sample_base,
      row_stretch, list, ints, fill_at, fill_ints;
};

// total_cells = samples * cells. The table: the cells themselves when they fit the hash table's
// capacity (no probing), else a power of two >= 1.5 n (at most 2/3 full).
HashedLayout hashed_layout(int64_t n, int64_t rows, int64_t total_cells) {
  int64_t hash_cap = 2;
  while (hash_cap < n + n / 2) hash_cap <<= 1;
  HashedLayout l;
  l.direct = total_cells <= hash_cap;
  l.cap = l.direct ? total_cells : hash_cap;
  int64_t off = 0;
  auto take = [&](int64_t k) {
    const int64_t at = off;
    off += round4(std::max<int64_t>(k, 1));
    return at;
  };
  static_assert(sizeof(Slot) == 16, "a slot is 4 int32");
  l.slots = take(4 * l.cap);
  l.cursor = take(1);
  l.fill_at = l.slots;
  l.fill_ints = off - l.slots;
  l.point_slot = take(n);
  l.point_pos = take(n);
  l.flags = take(n);
  l.sums = take(scan_tiles(n) + 1);
  l.total = take(1);
  l.sample_first = take(kMaxSamples);
  l.sample_base = take(kMaxSamples + 1);
  l.row_stretch = take(2 * rows);
  l.list = take(n);
  l.ints = off;
  return l;
}

int64_t hashed_workspace_ints(int64_t n, int64_t n_samples, int64_t rows, int64_t gx, int64_t gy,
                              int64_t gz) {
  if (n < 0 || rows < 0 || n_samples < 1 || n_samples > kMaxSamples || gx < 1 || gy < 1 || gz < 1) {
    TVM_FFI_THROW(ValueError) << "voxel_hashed_workspace_ints: n = " << n
                              << ", n_samples = " << n_samples << ", rows = " << rows << ", grid "
                              << gx << "*" << gy << "*" << gz << " out of range";
  }
  Samples s;
  s.count = static_cast<int>(n_samples);
  return hashed_layout(n, rows, checked_cells(gx, gy, gz, s) * n_samples).ints;
}

// The hard voxelization without a sort (the kernels above "hashed grouping"): the outputs of
// voxel_hard_keys + the stable sort + voxel_hard_forward, bit for bit, for max_points <=
// kHashedMaxPointsPerVoxel. Returns the voxel count (counts[0]) read back to the host, or -1 in
// the padded mode (no host synchronisation): the count is copied right after samples_kernel, so
// the host waits for it while place_kernel and the emit still run (readback.muh).
int64_t hard_forward_hashed(TensorView points, TensorView workspace, TensorView voxels,
                            TensorView coors, TensorView num_points, TensorView counts, float vx,
                            float vy, float vz, float x0, float y0, float z0, int64_t gx,
                            int64_t gy, int64_t gz, int64_t max_points, int64_t max_voxels,
                            Shape sample_offsets, bool padded, int64_t stream) {
  const int64_t n = check_points_tensor(points);
  const int64_t features = points.size(1);
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  if (n > kHashedMaxPoints) {
    TVM_FFI_THROW(ValueError) << "points has " << n << " rows; at most " << kHashedMaxPoints
                              << " here (voxel_hard_forward takes more)";
  }
  if (max_points > kHashedMaxPointsPerVoxel) {
    TVM_FFI_THROW(ValueError) << "max_points must be at most " << kHashedMaxPointsPerVoxel
                              << " here (voxel_hard_forward takes larger ones), got " << max_points;
  }
  int ncols = 3;
  const int64_t rows = check_hard_outputs(points, s, gx, gy, gz, max_points, max_voxels, padded,
                                          voxels, coors, num_points, counts, ncols);
  const int64_t cells = checked_cells(gx, gy, gz, s);
  const HashedLayout l = hashed_layout(n, rows, cells * s.count);
  check_input(workspace, "workspace", points, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < l.ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << l.ints << " int32 (from "
                              << "voxel_hashed_workspace_ints), got " << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);

  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* ws = data_of<int>(workspace);
  int64_t* counts_p = data_of<int64_t>(counts);
  const uint32_t ucells = static_cast<uint32_t>(cells);
  const int ni = static_cast<int>(n);
  const int rows_i = static_cast<int>(rows);
  const int P = static_cast<int>(max_points);
  Table t;
  t.slots = reinterpret_cast<Slot*>(ws + l.slots);
  t.cursor = ws + l.cursor;
  t.cap = static_cast<int>(l.cap);  // <= max(samples * cells, 2^30): both fit int
  t.mask = static_cast<uint32_t>(l.cap - 1);
  t.direct = l.direct ? 1 : 0;
  int* point_slot = ws + l.point_slot;
  int* point_pos = ws + l.point_pos;
  int* rank = ws + l.flags;
  int2* row_stretch = reinterpret_cast<int2*>(ws + l.row_stretch);
  Readback read;
  if (n == 0) {
    launch_zero(counts_p, (s.count + 1) * 8, device_id, st, "voxel fill (counts)");
    if (!padded) read = start_readback(counts_p, 1, device_id, st);
  } else {
    launch_fill(ws + l.fill_at, l.fill_ints * 4, 0xFFFFFFFFu, device_id, st,
                "voxel fill (slot table)");
    dispatch_float<Bf16::kBits>(points, "points", [&](auto tag) {
      using T = decltype(tag);
      insert_kernel<T><<<blocks_for(n, device_id), kBlock, 0, st>>>(
          data_of<const T>(points), ni, static_cast<int>(features), g, s, ucells, t, point_slot,
          point_pos);
      check_launch("voxel insert_kernel");
    });
    flags_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(point_slot, ni, t, rank);
    check_launch("voxel flags_kernel");
    exclusive_scan(rank, rank, n, ws + l.sums, ws + l.total, st, "voxel first scan");
    samples_kernel<<<1, 1, 0, st>>>(rank, ws + l.total, ni, s, static_cast<int>(max_voxels),
                                    ws + l.sample_first, ws + l.sample_base, counts_p);
    check_launch("voxel samples_kernel");
    if (!padded) read = start_readback(counts_p, 1, device_id, st);
    place_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        point_slot, point_pos, ni, t, s, ucells, g, rank, ws + l.sample_first, ws + l.sample_base,
        static_cast<int>(max_voxels), rows_i, P, ncols, ws + l.list, row_stretch,
        data_of<int>(coors), data_of<int>(num_points));
    check_launch("voxel place_kernel");
  }
  if (rows > 0 && max_points > 0 && (n > 0 || padded)) {
    auto emit = [&](auto word_tag) {
      using W = decltype(word_tag);
      emit_hashed_kernel<W><<<blocks_for(rows * kWarpSize, device_id), kBlock, 0, st>>>(
          data_of<const W>(points), static_cast<int>(features), ws + l.list, ni, row_stretch,
          counts_p, rows_i, P, padded ? 1 : 0, ncols, data_of<W>(voxels), data_of<int>(coors),
          data_of<int>(num_points));
      check_launch("voxel emit_hashed_kernel");
    };
    if (element_bytes(points) == 4) {
      emit(uint32_t{});
    } else {
      emit(uint16_t{});
    }
  }
  return padded ? -1 : finish_readback(read)[0];
}

}  // namespace
}  // namespace voxel
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_dynamic_forward, muspace::voxel::dynamic_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_keys, muspace::voxel::hard_keys);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_forward, muspace::voxel::hard_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_workspace_ints, muspace::voxel::hard_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_forward_hashed, muspace::voxel::hard_forward_hashed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hashed_workspace_ints, muspace::voxel::hashed_workspace_ints);
