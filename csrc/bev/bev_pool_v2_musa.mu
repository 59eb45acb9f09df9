// bev_pool_v2: BEVDet's camera-to-BEV pooling, forward and backward, for MUSA and CUDA.
//
//   out[b, c, z, y, x] = sum over points i with ranks_bev[i] == ((b*Z + z)*Y + y)*X + x of
//                        depth.flat[ranks_depth[i]] * feat.flat[ranks_feat[i]*C + c]
//
// depth [B,N,D,H,W] and feat [...,C] (channels last) in float32 / float16 / bfloat16, ranks int32
// sorted by ranks_bev, out [B,C,Z,Y,X] (channels first) in the input dtype; float32 accumulation.
// Without depth (depth / ranks_depth absent) every weight is 1 (BEVFusion's bev_pool, bev_pool_v3).
// The long form of the design is docs/operators/bev_pool_v2.md; in short:
//
// Forward (a zero fill of the output, then one kernel; no atomics):
// - Segments are the runs of equal ranks_bev (what BEVDet's interval arrays are by construction;
//   the kernels do not read the interval arrays). Work is split by POINTS, not by intervals:
//   intervals hold 1 to ~800 points, and a thread group per interval leaves the long ones (near
//   the ego car) on the critical path.
// - Block j takes the runs that START in points [j*P, (j+1)*P) (found with one coalesced search
//   round) and with them owns the cells [cell of its first run, cell of the next block's first
//   run).
// - Inside the block, "slots" of G lanes (G = channel vectors per point) each take an equal,
//   contiguous share of the block's points and sum runs in registers. A point's indices, bounds
//   checks and depth weight are loaded once per slot (by one of its lanes, into shared memory a
//   batch ahead), not by each of its G lanes; float32 rows are read as 32-byte vectors. A run cut by slot
//   boundaries is finished by the slot holding its first point, which adds the later slots'
//   partial sums in a fixed order: the result is bit-identical from run to run.
// - The output is channels-first while feat is channels-last, so finished cells go to a
//   shared-memory window [c][cell] (zero-initialised) and leave as coalesced rows of
//   consecutive cells (one 32-bit store per cell and channel from a scattered writer would cost
//   ~8x the L2 transactions). Cells beyond the window (sparse regions; ~3% of cells in the
//   bevdet configs) are written directly.
// - Empty cells outside the windows keep a grid-wide zero fill (~2 us at bevdet-r50): blocks
//   zeroing their own empty cells would leave one block owning every trailing empty cell when
//   the points cover only part of the grid (docs/operators/bev_pool_v2.md has the measurement).
//
// Backward:
// - The frustum layout (bev_pool_prepare's ranks; depth [B,N,D,H,W], feat [B,N,H,W,C]): a feat
//   row's points are its ray's D depth entries, so frustum_backward_kernel gathers grad_feat per
//   row and grad_depth per entry through point_of_depth (the inverse of ranks_depth), each
//   written once: no atomics. Points outside the layout are found by irregular_points_kernel
//   (float32 atomics in the default mode; a flag for the deterministic mode). The kernels below
//   serve the rest (depth=None, other shapes, > kMaxLanes channel vectors).
// - backward_points_kernel, in the forward's point order: the per-point dot(grad_out[:, cell_i],
//   feat row) (lanes reduced in a fixed order), added into grad_depth[ranks_depth[i]] with a
//   float32 atomic (so repeated ranks_depth values sum up) or, in the deterministic mode, stored
//   per point for the caller to reduce; and, in the default mode, grad_feat[ranks_feat[i]] +=
//   depth * grad_out[:, cell_i] with float32 atomics. Both accumulate into float32 buffers (the
//   caller casts for float16 / bfloat16). grad_out is read through a shared-memory window of the
//   block's cells (coalesced), like the forward's output.
// - grad_feat_sorted_kernel, the deterministic mode: points grouped by ranks_feat (the caller's
//   stable sort, `order`), each feat row summed by the same segmented scheme as the forward,
//   reading channels-last grad rows; rows without points get zeros. No atomics.
//
// Safety: every data-dependent index is checked in the kernels (bad points contribute nothing,
// out-of-range cells are dropped); bad input never reads or writes out of bounds. Unsorted
// ranks_bev gives unspecified values (never out of bounds); Python's validate=True rejects it.
// No host synchronisation; everything runs on the caller's stream.

#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <type_traits>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "vec.muh"
#include "vector_atomics.muh"

namespace muspace {
namespace bev_pool_v2 {
namespace {

// ------------------------------------------------------------------------------- launch policy

constexpr int kThreads = 256;  // every kernel of this file
static_assert(kThreads % kWarpSize == 0, "blocks are whole warps");
// Launch bounds (ptxas -v, sm_90a, nvcc 13.0): the forward fits 64 registers (1024 threads per
// SM; its 16-bit 8-wide variants spill 8 bytes), 80 with 32-byte float32 vectors (768 threads,
// 8 bytes of spill); the backward's point kernel needs 80 (768 threads per SM).
constexpr int kMinBlocksPerSM = 4;
constexpr int kMinBlocksPerSMBackward = 3;
// The forward's 32-byte float32 vectors (4 points in flight: 32 registers of row data) get the
// register room of 3 blocks per SM.
template <typename T, int VEC>
constexpr int min_blocks_per_sm() {
  return VEC * static_cast<int>(sizeof(T)) > 16 ? 3 : kMinBlocksPerSM;
}
constexpr int kUnroll = 4;  // points in flight per slot (each one row vector)
// pool_runs stages each batch's point records (key, row, weight) in shared memory, kUnroll per
// slot: at most kThreads / kUnroll slots per block (G < kUnroll lanes per point leaves threads
// idle; only C <= 3 vectors).
constexpr int kMaxSlots = kThreads / kUnroll;
constexpr int kMaxLanes = 32;           // channel vectors per point in one channel tile (grid.y)
constexpr int kSmemBudget = 26 * 1024;  // static shared memory per block (rule: < 28 KB)
constexpr int kSmemMisc = 1024;         // flags, bitmap, scalars
constexpr int kSearchPerThread = 4;     // run-start search after round 0: kThreads * 4 points
constexpr int kTargetBlocksPerSM = 4;   // P is at most n / (SMs * 4): all SMs busy
// The backward's point kernel prefers ~3x more, smaller blocks (its float32 atomics spread over
// more of the kernel's lifetime). Measured on the H200 by benchmarks/tune_points_per_block.py
// (bevdet-r50 / -d88 / -d118 float32): ~110-220 points per block gave 51-55 / 99-101 / 106-110
// us against 67 / 117 / 122 us at the forward's ~340-380.
constexpr int kTargetBlocksPerSMBackward = 12;
constexpr int kMaxPointsPerSlot = 32;  // ... and at most 32 points per slot (latency bound)
constexpr int kMinPointsPerSlot = 4;   // ... and at least 4 (amortises the search round)
// Deterministic grad_feat with more than 4 feat rows per point: rows without points are zeroed
// by a grid-wide fill before the kernel instead of by their owning blocks, because one block
// could own almost all of them. (The forward always zero-fills its output first.)
constexpr int64_t kSparseKeysPerPoint = 4;
constexpr int kNotFound = INT_MAX;
// Points are int32 indices; the margin keeps `index + search span` inside int32.
constexpr int64_t kMaxPoints = (int64_t{1} << 30);
MUSPACE_LIMIT(bev_pool_v2, max_points, kMaxPoints);
constexpr int64_t kMaxChannels = (int64_t{1} << 20);  // keeps grid.y and channel products small
MUSPACE_LIMIT(bev_pool_v2, max_channels, kMaxChannels);
constexpr int64_t kMaxCells = INT_MAX;  // B*Z*Y*X: ranks_bev is int32
MUSPACE_LIMIT(bev_pool_v2, max_cells, kMaxCells);

// One batch of point records per slot, double-buffered (pool_runs).
struct PointBatch {
  int key[2][kMaxSlots * kUnroll];
  int row[2][kMaxSlots * kUnroll];  // -1: a bad point (nothing gathered)
  float weight[2][kMaxSlots * kUnroll];
};

// Shared-memory window (elements of T) next to the slots' float32 partial sums and the point
// records.
template <typename T, int VEC>
constexpr int stage_elems() {
  return (kSmemBudget - kSmemMisc - kThreads * VEC * static_cast<int>(sizeof(float)) -
          static_cast<int>(sizeof(PointBatch))) /
         static_cast<int>(sizeof(T));
}

// The backward's grad_out window, next to its double-buffered partial dot products.
template <typename T>
constexpr int backward_stage_elems() {
  return (kSmemBudget - kSmemMisc - 2 * kUnroll * kThreads * static_cast<int>(sizeof(float))) /
         static_cast<int>(sizeof(T));
}

__device__ __forceinline__ int clamp_key(int key, int n_keys) { return min(max(key, 0), n_keys); }

// ------------------------------------------------------------------------- point accessors
// A "gather" describes one segmented sum: key(j) is the segment key of point j (the points are
// sorted by it), point(j) its record (key, row, weight; row -1 for a bad point: an index out of
// range, which contributes nothing), row_vector() VEC elements of a row. A point whose key is
// out of range is still gathered (its segment is dropped by the sink): only bad input has such
// keys.

// Forward: key = ranks_bev, row = feat[ranks_feat], weight = depth[ranks_depth] (or 1).
template <typename T, int VEC, bool kHasDepth>
struct FeatGather {
  const T* __restrict__ depth;
  const T* __restrict__ rows;
  const int* __restrict__ ranks_depth;
  const int* __restrict__ ranks_feat;
  const int* __restrict__ keys;
  int n_depth;  // sizes clamped to INT_MAX: int32 indices cannot reach further
  int n_rows;
  int channels;
  int n_keys;

  __device__ __forceinline__ int key(int j) const { return keys[j]; }
  __device__ __forceinline__ void point(int j, int& key, int& row, float& w) const {
    key = keys[j];
    row = ranks_feat[j];
    const int widx = kHasDepth ? ranks_depth[j] : 0;
    const bool ok = static_cast<unsigned>(row) < static_cast<unsigned>(n_rows) &&
                    (!kHasDepth || static_cast<unsigned>(widx) < static_cast<unsigned>(n_depth));
    w = 0.0f;
    if (!ok) {
      row = -1;
      return;
    }
    w = kHasDepth ? to_float(depth[widx]) : 1.0f;
  }
  __device__ __forceinline__ Vec<T, VEC> row_vector(int row, int c) const {
    return Vec<T, VEC>::load(rows + static_cast<int64_t>(row) * channels + c);
  }
};

// Deterministic grad_feat: points in ranks_feat order (order[j]); key = ranks_feat,
// row = channels-last grad at ranks_bev, weight = depth[ranks_depth] (or 1).
template <typename T, int VEC, bool kHasDepth>
struct GradRowGather {
  const T* __restrict__ depth;
  const T* __restrict__ rows;  // grad rows [n_cells, C]
  const int* __restrict__ order;
  const int* __restrict__ ranks_depth;
  const int* __restrict__ ranks_feat;
  const int* __restrict__ ranks_bev;
  int n_points;
  int n_depth;  // clamped to INT_MAX
  int n_cells;
  int channels;
  int n_keys;  // feat rows

  __device__ __forceinline__ int key(int j) const {
    const int o = order[j];
    return static_cast<unsigned>(o) < static_cast<unsigned>(n_points) ? ranks_feat[o] : -1;
  }
  __device__ __forceinline__ void point(int j, int& key, int& row, float& w) const {
    const int o = order[j];
    key = -1;
    row = -1;
    w = 0.0f;
    if (static_cast<unsigned>(o) >= static_cast<unsigned>(n_points)) return;
    key = ranks_feat[o];
    const int cell = ranks_bev[o];
    const int widx = kHasDepth ? ranks_depth[o] : 0;
    const bool ok = static_cast<unsigned>(cell) < static_cast<unsigned>(n_cells) &&
                    (!kHasDepth || static_cast<unsigned>(widx) < static_cast<unsigned>(n_depth));
    if (!ok) return;
    row = cell;
    w = kHasDepth ? to_float(depth[widx]) : 1.0f;
  }
  __device__ __forceinline__ Vec<T, VEC> row_vector(int row, int c) const {
    return Vec<T, VEC>::load(rows + static_cast<int64_t>(row) * channels + c);
  }
};

// ---------------------------------------------------------------------------- output sinks
// A sink receives each finished run (emit). Keys of this block's range [lo, hi) that no run
// emits (empty cells / feat rows without points) are zeroed afterwards by the whole block
// (zero_unmarked): emits of keys in [z0, z0 + kBitmapBits) set a bit, the rest are found by
// re-reading the block's keys. Both sinks only write the channels [c_begin, c_begin + tile_c).

constexpr int kBitmapWords = 128;  // 4096 keys per zeroing round (512 bytes)
constexpr int kBitmapBits = kBitmapWords * 32;

__device__ __forceinline__ void mark(unsigned int* bitmap, int z0, int x) {
  const int d = x - z0;
  if (d >= 0 && d < kBitmapBits) atomicOr(&bitmap[d >> 5], 1u << (d & 31));
}
__device__ __forceinline__ bool marked(const unsigned int* bitmap, int d) {
  return (bitmap[d >> 5] >> (d & 31)) & 1u;
}

// Forward output out[b, c, cell], channels first. Cells [lo, lo + win) go through the
// shared-memory window stage[c][cell - lo] (zero-initialised, written out as coalesced rows);
// cells beyond it (sparse regions) are written directly.
template <typename T, int VEC>
struct StagedChannelsFirst {
  T* __restrict__ out;
  T* stage;  // pitch = window_cells (odd: fewer bank conflicts)
  int pitch;
  int lo, win;  // the window: cells [lo, lo + win) of the block's own cells
  int n_cells, cells_per_batch;
  int channels, c_begin, tile_c;

  __device__ __forceinline__ int64_t offset(int x, int c) const {
    const int b = x / cells_per_batch;
    return (static_cast<int64_t>(b) * channels + c) * cells_per_batch + (x - b * cells_per_batch);
  }
  __device__ __forceinline__ void emit(int x, int lane_c, const float (&v)[VEC]) const {
    if (x < 0 || x >= n_cells) return;  // dropped cell
    if (x >= lo && x < lo + win) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) stage[(lane_c + e) * pitch + (x - lo)] = from_float<T>(v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[offset(x, c_begin + lane_c + e)] = from_float<T>(v[e]);
    }
  }
  // Whole block: the window, as rows of consecutive cells per channel, a warp per row. When
  // the window lies in one batch (all but a few blocks) the row is one contiguous run of out:
  // no division per element (the flush was a visible share of the forward's instructions).
  __device__ void flush() const {
    constexpr int kWarps = kThreads / kWarpSize;
    const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
    const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
    const int b = lo / cells_per_batch;
    const int first = lo - b * cells_per_batch;
    const bool one_batch = first + win <= cells_per_batch;
    for (int c = warp; c < tile_c; c += kWarps) {
      const T* src = stage + c * pitch;
      if (one_batch) {
        T* dst = out + (static_cast<int64_t>(b) * channels + c_begin + c) * cells_per_batch + first;
        for (int w = lane; w < win; w += kWarpSize) dst[w] = src[w];
      } else {
        for (int w = lane; w < win; w += kWarpSize) out[offset(lo + w, c_begin + c)] = src[w];
      }
    }
  }
};

// Rows out[key, c], channels last (deterministic grad_feat): runs are written directly.
template <typename T, int VEC>
struct Rows {
  T* __restrict__ out;
  unsigned int* bitmap;
  int lo, hi;
  int n_keys;
  int64_t channels;
  int c_begin, tile_c;

  __device__ __forceinline__ int z0() const { return lo; }
  __device__ __forceinline__ void emit(int x, int lane_c, const float (&v)[VEC]) const {
    if (x < 0 || x >= n_keys) return;
    Vec<T, VEC>::pack(v).store(out + x * channels + c_begin + lane_c);
    if (lane_c == 0) mark(bitmap, z0(), x);
  }
  __device__ void flush() const {}
  __device__ void zero_unmarked_chunk(int from, int n) const {
    const int total = n * tile_c;
    for (int e = threadIdx.x; e < total; e += kThreads) {
      const int d = e / tile_c;
      const int c = e - d * tile_c;
      if (!marked(bitmap, d)) out[(from + d) * channels + c_begin + c] = from_float<T>(0.0f);
    }
  }
};

// ------------------------------------------------------------------- the segmented block sum

template <class Gather>
__device__ __forceinline__ bool is_run_start(const Gather& g, int j) {
  return j == 0 || g.key(j) != g.key(j - 1);
}

// The runs this block owns start in [p0, p1): afterwards s_q[0] = the first run start in
// [p0, p1) (kNotFound if none: the block owns nothing), s_q[1] = the first run start >= p1
// (kNotFound if none: n). Usually one round; a run longer than the search span costs its owner
// more rounds.
// Shared memory, race-free by construction: between two barriers a word of s_q is only read
// or only written (by thread 0's stores, or by atomicMin), never both. A round reads the state,
// syncs, updates it with atomics and syncs again; the last round ends after its reads, so
// s_q[0..1] are final and never written again.
template <class Gather>
__device__ void find_owned_runs(const Gather& g, int n, int p0, int p1, int* s_q) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    s_q[0] = (p0 == 0) ? 0 : kNotFound;
    s_q[1] = kNotFound;
  }
  __syncthreads();
  // Round 0 looks at kThreads points (most runs are shorter), later rounds at 4x as many.
  for (int base = 0, per_thread = 1;;
       base += per_thread * kThreads, per_thread = kSearchPerThread) {
    // Every thread reads the same state, so the loop exit is block-uniform.
    const bool searching0 = s_q[0] == kNotFound && p0 + base < p1;
    const bool owns_nothing = s_q[0] == kNotFound && p0 + base >= p1;
    const bool searching1 = !owns_nothing && s_q[1] == kNotFound && p1 + base < n;
    __syncthreads();  // reads done before any update
    if (!searching0 && !searching1) break;
    for (int k = 0; k < per_thread; ++k) {
      const int off = base + k * kThreads + tid;
      if (searching0 && p0 + off < p1 && is_run_start(g, p0 + off)) atomicMin(&s_q[0], p0 + off);
      if (searching1 && p1 + off < n && is_run_start(g, p1 + off)) atomicMin(&s_q[1], p1 + off);
    }
    __syncthreads();  // updates done before the next round's reads
  }
}

// Sums the runs of points [q0, q1) (whole runs) and hands each run's sum to the sink. G lanes
// per point; lane `lane` owns the channels c_begin + [lane*VEC, lane*VEC + VEC). Each slot
// takes an equal contiguous share of the points. A run cut by slot boundaries is finished by the
// slot holding its FIRST point (its last segment is still in `acc` after the loop): the later
// slots leave their first segment's sum in s_part the moment it ends, and after the barrier the
// owner adds those sums nearest first (a fixed order: bit-identical reruns).
// Point records: lane u of a slot loads point u of the slot's next batch (indices, bounds
// checks, depth weight) into s_pts while the slot consumes the current batch, so each point's
// index work is done once instead of by each of its G lanes (that repeated work bound the
// earlier version: docs/operators/bev_pool_v2.md).
// Contains barriers: every thread of the block must call it.
template <typename T, int VEC, class Gather, class Sink>
__device__ void pool_runs(const Gather& gat, const Sink& sink, int q0, int q1, int G, int c_begin,
                          float* s_part, unsigned char* s_flags, PointBatch* s_pts) {
  constexpr unsigned char kSingle = 1, kOpenEnd = 2;
  const int tid = threadIdx.x;
  const int S = min(kThreads / G, kMaxSlots);  // slots
  const int slot = tid / G;
  const int lane = tid - slot * G;
  const int lane_c = lane * VEC;       // channel offset within the tile (what sinks take)
  const int row_c = c_begin + lane_c;  // channel offset within a row (what gathers take)
  const int n_own = q1 - q0;
  const int K = (n_own + S - 1) / S;  // points per slot (the last slots may get fewer / none)
  const int a = q0 + min(slot * K, n_own);
  const int b = min(a + K, q1);
  const bool active = slot < S && a < b;
  const int batches = (K + kUnroll - 1) / kUnroll;  // block-uniform (barriers inside)

  // Lane u < kUnroll of a slot stages point u of each batch of its slot (lanes u, u + G, ...
  // when G < kUnroll: only C <= 3 vectors). Records go to entry slot * kUnroll + u.
  int next_key = 0, next_row = -1;
  float next_w = 0.0f;
  auto fetch = [&](int batch, int u) -> bool {
    const int j = a + batch * kUnroll + u;
    if (!active || u >= kUnroll || j >= b) return false;
    gat.point(j, next_key, next_row, next_w);
    return true;
  };
  auto put = [&](int buf, int u) {
    const int e = slot * kUnroll + u;
    s_pts->key[buf][e] = next_key;
    s_pts->row[buf][e] = next_row;
    s_pts->weight[buf][e] = next_w;
  };
  auto stage_rest = [&](int batch, int buf) {  // the further points of a slot with G < kUnroll
    for (int u = lane + G; u < kUnroll; u += G) {
      if (fetch(batch, u)) put(buf, u);
    }
  };

  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
  int cur = 0;
  bool owner_pending = false;
  bool first_open = false, seg_first = true;
  int key_after = 0;
  if (active) {
    const int key_before = a > q0 ? gat.key(a - 1) : 0;
    key_after = b < q1 ? gat.key(b) : 0;
    cur = gat.key(a);
    first_open = a > q0 && key_before == cur;  // continues a run of earlier slots
  }
  if (fetch(0, lane)) put(0, lane);
  stage_rest(0, 0);
  __syncthreads();

  for (int t = 0; t < batches; ++t) {
    const int buf = t & 1;
    // The next batch's records are requested before this batch's rows are consumed (one memory
    // round trip per batch); they go to the other buffer after the rows are summed.
    const bool staged_next = t + 1 < batches && fetch(t + 1, lane);
    if (active) {
      const int i = a + t * kUnroll;
      int ck[kUnroll];
      float w[kUnroll];
      Vec<T, VEC> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        ck[u] = cur;
        w[u] = 0.0f;
        v[u] = Vec<T, VEC>::zero();
        if (i + u < b) {
          const int e = slot * kUnroll + u;
          ck[u] = s_pts->key[buf][e];
          const int row = s_pts->row[buf][e];
          w[u] = s_pts->weight[buf][e];
          if (row >= 0) v[u] = gat.row_vector(row, row_c);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + u < b && ck[u] != cur) {  // the segment [.., i + u) ends here
          if (seg_first && first_open) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) s_part[tid * VEC + e] = acc[e];
          } else {
            sink.emit(cur, lane_c, acc);
          }
          seg_first = false;
          cur = ck[u];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] = 0.0f;
        }
        float f[VEC];
        v[u].unpack(f);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = fmaf(w[u], f[e], acc[e]);  // w = 0 past b
      }
    }
    if (staged_next) put(buf ^ 1, lane);
    if (t + 1 < batches) stage_rest(t + 1, buf ^ 1);
    __syncthreads();  // this batch read, the next one staged
  }

  if (active) {
    // The slot's last segment ends at b.
    const bool open_end = b < q1 && key_after == cur;
    if (seg_first && first_open) {  // one segment, continuing an earlier slot's run
#pragma unroll
      for (int e = 0; e < VEC; ++e) s_part[tid * VEC + e] = acc[e];
    } else if (open_end) {
      owner_pending = true;  // finished after the barrier
    } else {
      sink.emit(cur, lane_c, acc);
    }
    if (lane == 0) s_flags[slot] = (seg_first ? kSingle : 0) | (open_end ? kOpenEnd : 0);
  }
  __syncthreads();
  if (owner_pending) {
    // Add the first-segment sums of the slots the run continues into, in slot order; a slot
    // entirely inside the run (one segment, open at its end) passes on to the next.
    for (int s = slot + 1; s < S; ++s) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += s_part[(s * G + lane) * VEC + e];
      if (s_flags[s] != (kSingle | kOpenEnd)) break;
    }
    sink.emit(cur, lane_c, acc);
  }
}

// After pool_runs and a barrier: zeros for the keys in [sink.z0(), hi) that no run emitted.
// The first kBitmapBits keys use the bits set by emit; further rounds (very sparse ranges only)
// rebuild the bitmap from the block's keys. Block-uniform; ends with a barrier.
template <class Gather, class Sink>
__device__ void zero_unmarked(const Gather& gat, const Sink& sink, int q0, int q1, int hi) {
  for (int64_t from64 = sink.z0(); from64 < hi; from64 += kBitmapBits) {  // int64: no wrap at 2^31
    const int from = static_cast<int>(from64);
    if (from != sink.z0()) {
      for (int k = threadIdx.x; k < kBitmapWords; k += kThreads) sink.bitmap[k] = 0u;
      __syncthreads();
      for (int j = q0 + threadIdx.x; j < q1; j += kThreads) mark(sink.bitmap, from, gat.key(j));
      __syncthreads();
    }
    sink.zero_unmarked_chunk(from, min(kBitmapBits, hi - from));
    __syncthreads();
  }
}

// ------------------------------------------------------------------------------------ kernels

// Owned range of a block: runs [q0, q1) and keys [lo, hi). Returns false when the block owns
// nothing (block-uniform).
template <class Gather>
__device__ bool owned_range(const Gather& gat, int n, int points_per_block, int n_keys, int* s_q,
                            int& q0, int& q1, int& lo, int& hi) {
  const int p0 = blockIdx.x * points_per_block;
  const int p1 = min(p0 + points_per_block, n);
  find_owned_runs(gat, n, p0, p1, s_q);
  // One writer: thread 0 turns the search result into the block's range in s_q[2..5] (words
  // nobody reads before the barrier below; s_q[0..1] are only read from here on).
  if (threadIdx.x == 0) {
    const int r0 = s_q[0];
    const int r1 = s_q[1] == kNotFound ? n : s_q[1];
    s_q[2] = r0;
    s_q[3] = r1;
    if (r0 != kNotFound) {
      // Block 0 starts at key 0; the next owner starts at the key of point q1.
      const int l = blockIdx.x == 0 ? 0 : clamp_key(gat.key(r0), n_keys);
      s_q[4] = l;
      s_q[5] = max(l, r1 >= n ? n_keys : clamp_key(gat.key(r1), n_keys));
    }
  }
  __syncthreads();
  q0 = s_q[2];
  q1 = s_q[3];
  if (q0 == kNotFound) return false;
  lo = s_q[4];
  hi = s_q[5];
  return true;
}

// `out` is zero-filled before the launch; the kernel writes the cells that have points.
template <typename T, int VEC, bool kHasDepth>
__global__ void __launch_bounds__(kThreads, min_blocks_per_sm<T, VEC>())
    forward_kernel(FeatGather<T, VEC, kHasDepth> gat, T* __restrict__ out, int n_points,
                   int points_per_block, int channels, int cells_per_batch, int window_cells) {
  __shared__ float s_part[kThreads * VEC];
  alignas(16) __shared__ unsigned char s_stage_raw[stage_elems<T, VEC>() * sizeof(T)];
  __shared__ unsigned char s_flags[kThreads];
  __shared__ PointBatch s_pts;
  __shared__ int s_q[6];
  const int tid = threadIdx.x;
  // The window starts as zeros (its empty cells are flushed with the rest); sizes do not
  // depend on the search, so this overlaps it.
  {
    uint4* words = reinterpret_cast<uint4*>(s_stage_raw);
    constexpr int kWords = static_cast<int>(sizeof(s_stage_raw) / sizeof(uint4));
    for (int e = tid; e < kWords; e += kThreads) words[e] = make_uint4(0u, 0u, 0u, 0u);
  }
  int q0, q1, lo, hi;
  if (!owned_range(gat, n_points, points_per_block, gat.n_keys, s_q, q0, q1, lo, hi)) return;

  StagedChannelsFirst<T, VEC> sink;
  sink.out = out;
  sink.stage = reinterpret_cast<T*>(s_stage_raw);
  sink.pitch = window_cells;
  sink.lo = lo;
  sink.win = min(window_cells, hi - lo);
  sink.n_cells = gat.n_keys;
  sink.cells_per_batch = cells_per_batch;
  sink.channels = channels;
  sink.c_begin = blockIdx.y * kMaxLanes * VEC;
  sink.tile_c = min(kMaxLanes * VEC, channels - sink.c_begin);
  pool_runs<T, VEC>(gat, sink, q0, q1, sink.tile_c / VEC, sink.c_begin, s_part, s_flags, &s_pts);
  __syncthreads();
  sink.flush();
}

template <typename T, int VEC, bool kHasDepth>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    grad_feat_sorted_kernel(GradRowGather<T, VEC, kHasDepth> gat, T* __restrict__ grad_feat,
                            int n_sorted, int points_per_block, int channels, int out_prezeroed) {
  __shared__ float s_part[kThreads * VEC];
  __shared__ unsigned int s_bitmap[kBitmapWords];
  __shared__ unsigned char s_flags[kThreads];
  __shared__ PointBatch s_pts;
  __shared__ int s_q[6];
  for (int e = threadIdx.x; e < kBitmapWords; e += kThreads) s_bitmap[e] = 0u;
  int q0, q1, lo, hi;
  if (!owned_range(gat, n_sorted, points_per_block, gat.n_keys, s_q, q0, q1, lo, hi)) return;
  Rows<T, VEC> sink;
  sink.out = grad_feat;
  sink.bitmap = s_bitmap;
  sink.lo = lo;
  sink.hi = hi;
  sink.n_keys = gat.n_keys;
  sink.channels = channels;
  sink.c_begin = blockIdx.y * kMaxLanes * VEC;
  sink.tile_c = min(kMaxLanes * VEC, channels - sink.c_begin);
  pool_runs<T, VEC>(gat, sink, q0, q1, sink.tile_c / VEC, sink.c_begin, s_part, s_flags, &s_pts);
  __syncthreads();
  if (!out_prezeroed) zero_unmarked(gat, sink, q0, q1, hi);
}

// Backward in the forward's point order. Each block takes points [p0, p1) (not run-aligned: no
// segment sums here) and reads grad_out for its cells through a shared window (coalesced).
//   kDepthGrad: dot_i = dot(grad_out[:, cell_i], feat[rf_i, :]), either
//     grad_depth_acc[rd_i] += dot_i (float32 atomics: repeated ranks_depth values add up), or
//     point_dots[i] = dot_i (every point, 0 for a bad one; no atomics: the caller reduces).
//   kAtomicFeat: grad_feat_acc[rf_i, :] += depth[rd_i] * grad_out[:, cell_i]   (float32 atomics)
template <typename T, int VEC, bool kHasDepth, bool kDepthGrad, bool kAtomicFeat>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSMBackward)
    backward_points_kernel(const T* __restrict__ grad_out, const T* __restrict__ depth,
                           const T* __restrict__ feat, const int* __restrict__ ranks_depth,
                           const int* __restrict__ ranks_feat, const int* __restrict__ ranks_bev,
                           float* __restrict__ grad_depth_acc, float* __restrict__ point_dots,
                           float* __restrict__ grad_feat_acc, int n_points, int points_per_block,
                           int64_t n_depth, int64_t n_rows, int channels, int n_cells,
                           int cells_per_batch, int window_cells) {
  constexpr int kStageElems = backward_stage_elems<T>();
  alignas(16) __shared__ unsigned char s_stage_raw[kStageElems * sizeof(T)];
  __shared__ float s_red[2][kUnroll][kThreads];  // per-lane partial dots, double-buffered
  __shared__ int s_range[2];
  T* stage = reinterpret_cast<T*>(s_stage_raw);
  const int tid = threadIdx.x;
  const int p0 = blockIdx.x * points_per_block;
  const int p1 = min(p0 + points_per_block, n_points);
  const int n_chunks = channels / VEC;
  const int G = min(n_chunks, kMaxLanes);
  const int S = kThreads / G;
  const int slot = tid / G;
  const int lane = tid - slot * G;
  const int n_mine = p1 - p0;
  const int K = (n_mine + S - 1) / S;
  const int a = p0 + min(slot * K, n_mine);
  const int b = slot < S ? min(a + K, p1) : a;
  const int iterations = (K + kUnroll - 1) / kUnroll;  // block-uniform (syncs inside)

  if (tid == 0) {
    // Window of cells [lo, lo + win) covering this block's points (sorted by cell).
    const int lo = min(max(ranks_bev[p0], 0), n_cells - 1);
    const int last = min(max(ranks_bev[p1 - 1], 0), n_cells - 1);
    s_range[0] = lo;
    s_range[1] = min(max(last - lo + 1, 0), window_cells);
  }
  __syncthreads();
  const int lo = s_range[0];
  const int win = s_range[1];
  auto goffset = [&](int x, int c) -> int64_t {
    const int bb = x / cells_per_batch;
    return (static_cast<int64_t>(bb) * channels + c) * cells_per_batch + (x - bb * cells_per_batch);
  };
  for (int e = tid; e < channels * win; e += kThreads) {
    const int c = e / win;
    const int w = e - c * win;
    stage[c * window_cells + w] = grad_out[goffset(lo + w, c)];
  }
  __syncthreads();
  auto grad_at = [&](int x, int c) -> float {
    if (x >= lo && x < lo + win) return to_float(stage[c * window_cells + (x - lo)]);
    return to_float(grad_out[goffset(x, c)]);
  };

  for (int it = 0; it < iterations; ++it) {
    const int i = a + it * kUnroll;
    int ck[kUnroll], cr[kUnroll], cw[kUnroll];
    bool ok[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      ck[u] = cr[u] = cw[u] = 0;
      ok[u] = false;
      if (i + u < b) {
        ck[u] = ranks_bev[i + u];
        cr[u] = ranks_feat[i + u];
        cw[u] = kHasDepth ? ranks_depth[i + u] : 0;
        ok[u] = ck[u] >= 0 && ck[u] < n_cells && cr[u] >= 0 && cr[u] < n_rows &&
                (!kHasDepth || (cw[u] >= 0 && cw[u] < n_depth));
      }
    }
    float wt[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      wt[u] = 1.0f;
      if (kHasDepth && kAtomicFeat && ok[u]) wt[u] = to_float(depth[cw[u]]);
    }
    // One pass over the channel chunks serves both gradients: each grad_out value is read
    // once, used for the dot product and scattered with one vector atomic per chunk (lane l
    // takes chunks l, l + G, ...: the slot's atomics cover consecutive floats).
    float dot[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dot[u] = 0.0f;
    for (int chunk = lane; chunk < n_chunks; chunk += G) {
      Vec<T, VEC> fp[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        fp[u] = Vec<T, VEC>::zero();
        if (kDepthGrad && ok[u]) {
          fp[u] = Vec<T, VEC>::load(feat + static_cast<int64_t>(cr[u]) * channels + chunk * VEC);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!ok[u]) continue;
        float g[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[e] = grad_at(ck[u], chunk * VEC + e);
        if (kDepthGrad) {
          float f[VEC];
          fp[u].unpack(f);
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[u] = fmaf(g[e], f[e], dot[u]);
        }
        if (kAtomicFeat) {
          atomic_add_scaled<VEC>(
              grad_feat_acc + static_cast<int64_t>(cr[u]) * channels + chunk * VEC, wt[u], g);
        }
      }
    }
    if (kDepthGrad) {
      const int buf = it & 1;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) s_red[buf][u][tid] = dot[u];
      __syncthreads();
      // Lane u of each slot sums point u's G partial dots in lane order (deterministic).
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (slot >= S || u % G != lane || i + u >= b) continue;
        float sum = 0.0f;
        for (int l = 0; l < G; ++l) sum += s_red[buf][u][slot * G + l];
        if (point_dots != nullptr) {
          point_dots[i + u] = ok[u] ? sum : 0.0f;
        } else if (ok[u]) {
          atomicAdd(grad_depth_acc + cw[u], sum);
        }
      }
    }
  }
}

// ------------------------------------------------------------------ frustum-layout backward
// bev_pool_prepare's ranks are in the frustum layout: point i's depth entry ranks_depth[i] =
// ((b*N + n)*D + d)*HW + hw is unique, and its feat row ranks_feat[i] = (b*N + n)*HW + hw is the
// ray's row, shared by the ray's D depth bins. So grad_feat of a row is a gather over its D
// entries, and grad_depth of an entry a dot product with the row: each written once, no atomics.
// point_of_depth[k] (the inverse of ranks_depth) says which point, if any, entry k is.
// Points outside that layout (a repeated ranks_depth, ranks_feat not the ray's row) are
// "irregular": found afterwards and, in the default mode, added with float32 atomics.

constexpr int kFrustumRows = 4;  // feat rows per block; the block's slots split their D bins

__device__ __forceinline__ int frustum_row(int k, int bins_hw, int hw) {
  return (k / bins_hw) * hw + k % hw;
}

__device__ __forceinline__ bool valid_point(int rd, int rf, int cell, int n_depth, int n_rows,
                                            int n_cells) {
  return static_cast<unsigned>(rd) < static_cast<unsigned>(n_depth) &&
         static_cast<unsigned>(rf) < static_cast<unsigned>(n_rows) &&
         static_cast<unsigned>(cell) < static_cast<unsigned>(n_cells);
}

// point_of_depth (filled with -1 before) := i at ranks_depth[i] for the valid points in the
// layout. A repeated entry keeps one of its points (any): the others are irregular.
__global__ void __launch_bounds__(kThreads)
    frustum_points_kernel(const int* __restrict__ ranks_depth, const int* __restrict__ ranks_feat,
                          const int* __restrict__ ranks_bev, int* __restrict__ point_of_depth,
                          int* __restrict__ irregular, int n_points, int n_depth, int n_rows,
                          int n_cells, int bins_hw, int hw) {
  // set by the last kernel only; nullptr: the caller knows every point is in the layout
  if (irregular != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *irregular = 0;
  for (int64_t i = global_thread(); i < n_points; i += global_threads()) {
    const int rd = ranks_depth[i], rf = ranks_feat[i], cell = ranks_bev[i];
    if (valid_point(rd, rf, cell, n_depth, n_rows, n_cells) && rf == frustum_row(rd, bins_hw, hw)) {
      point_of_depth[rd] = static_cast<int>(i);
    }
  }
}

// grad_feat[row] = sum over the row's D entries k with a point i of depth[k] * g[cell_i], and
// grad_depth[k] = <g[cell_i], feat[row]> (0 for an entry without a point), g = grad_rows
// (channels last). A block takes kFrustumRows rows; its S slots of G lanes (lane = one channel
// vector) are (row, sub) pairs, sub s taking bins s*kUnroll + [0, kUnroll) of each round of
// P*kUnroll bins. Partial sums are combined in a fixed order: bit-identical reruns.
template <typename T, typename TOut, int VEC>
__global__ void __launch_bounds__(kThreads)
    frustum_backward_kernel(const T* __restrict__ grad_rows, const T* __restrict__ depth,
                            const T* __restrict__ feat, const int* __restrict__ ranks_bev,
                            const int* __restrict__ point_of_depth, TOut* __restrict__ grad_depth,
                            TOut* __restrict__ grad_feat, int n_rows, int bins, int hw,
                            int channels) {
  __shared__ int s_cell[kThreads];
  __shared__ float s_weight[kThreads];
  __shared__ float s_dot[kUnroll][kThreads];
  __shared__ float s_acc[kThreads * VEC];
  const int tid = threadIdx.x;
  const int G = channels / VEC;  // <= kMaxLanes (host)
  const int S = min(kThreads / G, kMaxSlots);
  const int P = S / kFrustumRows;  // subs per row (S >= 8: G <= 32)
  const int slot = tid / G;
  const int lane = tid - slot * G;
  const int local_row = slot % kFrustumRows;
  const int sub = slot / kFrustumRows;
  const int row0 = blockIdx.x * kFrustumRows;
  const int row = row0 + local_row;
  const bool active = slot < kFrustumRows * P && row < n_rows;
  const int bins_per_round = P * kUnroll;
  const int entries = kFrustumRows * bins_per_round;  // <= kMaxSlots * kUnroll = kThreads
  // Entry e of a round: bin e / kFrustumRows (sub e / (kFrustumRows*kUnroll)), row e % rows.
  auto entry_k = [&](int e, int d0, int& k) -> bool {
    const int r = row0 + e % kFrustumRows;
    const int d = d0 + e / kFrustumRows;
    if (r >= n_rows || d >= bins) return false;
    k = ((r / hw) * bins + d) * hw + r % hw;
    return true;
  };

  float f[VEC], acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) f[e] = acc[e] = 0.0f;
  if (active) Vec<T, VEC>::load(feat + static_cast<int64_t>(row) * channels + lane * VEC).unpack(f);

  for (int d0 = 0; d0 < bins; d0 += bins_per_round) {
    if (tid < entries) {
      int k = 0, cell = -1;
      float w = 0.0f;
      if (entry_k(tid, d0, k)) {
        const int i = point_of_depth[k];
        if (i >= 0) {
          cell = ranks_bev[i];  // checked by frustum_points_kernel
          w = to_float(depth[k]);
        }
      }
      s_cell[tid] = cell;
      s_weight[tid] = w;
    }
    __syncthreads();
    if (active) {
      Vec<T, VEC> g[kUnroll];
      int e0 = (sub * kUnroll) * kFrustumRows + local_row;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int cell = s_cell[e0 + u * kFrustumRows];
        g[u] = Vec<T, VEC>::zero();
        if (cell >= 0)
          g[u] = Vec<T, VEC>::load(grad_rows + static_cast<int64_t>(cell) * channels + lane * VEC);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float gv[VEC];
        g[u].unpack(gv);
        const float w = s_weight[e0 + u * kFrustumRows];
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          acc[e] = fmaf(w, gv[e], acc[e]);
          dot = fmaf(gv[e], f[e], dot);
        }
        s_dot[u][tid] = dot;
      }
    }
    __syncthreads();
    if (tid < entries) {
      int k = 0;
      if (entry_k(tid, d0, k)) {
        // The entry's slot: row tid % rows, sub = (bin in round) / kUnroll, u = bin % kUnroll.
        const int bin = tid / kFrustumRows;
        const int es = (bin / kUnroll) * kFrustumRows + tid % kFrustumRows;
        float sum = 0.0f;
        for (int l = 0; l < G; ++l) sum += s_dot[bin % kUnroll][es * G + l];
        grad_depth[k] = from_float<TOut>(s_cell[tid] >= 0 ? sum : 0.0f);
      }
    }
    __syncthreads();  // s_cell, s_weight, s_dot reused by the next round
  }
  if (active) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) s_acc[tid * VEC + e] = acc[e];
  }
  __syncthreads();
  if (active && sub == 0) {
    float total[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) total[e] = 0.0f;
    for (int p = 0; p < P; ++p) {
      const int t = (p * kFrustumRows + local_row) * G + lane;
#pragma unroll
      for (int e = 0; e < VEC; ++e) total[e] += s_acc[t * VEC + e];
    }
    Vec<TOut, VEC>::pack(total).store(grad_feat + static_cast<int64_t>(row) * channels +
                                      lane * VEC);
  }
}

// The points frustum_backward_kernel did not take (valid, but not point_of_depth's entry):
// irregular[0] := 1 and, with `add`, their terms added with float32 atomics (grad_depth_acc /
// grad_feat_acc float32, holding the gather's result).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    irregular_points_kernel(const T* __restrict__ grad_rows, const T* __restrict__ depth,
                            const T* __restrict__ feat, const int* __restrict__ ranks_depth,
                            const int* __restrict__ ranks_feat, const int* __restrict__ ranks_bev,
                            const int* __restrict__ point_of_depth,
                            float* __restrict__ grad_depth_acc, float* __restrict__ grad_feat_acc,
                            int* __restrict__ irregular, int n_points, int n_depth, int n_rows,
                            int n_cells, int channels, int bins_hw, int hw) {
  for (int64_t i = global_thread(); i < n_points; i += global_threads()) {
    const int rd = ranks_depth[i], rf = ranks_feat[i], cell = ranks_bev[i];
    if (!valid_point(rd, rf, cell, n_depth, n_rows, n_cells)) continue;  // contributes nothing
    if (rf == frustum_row(rd, bins_hw, hw) && point_of_depth[rd] == i) continue;
    *irregular = 1;
    if (grad_depth_acc == nullptr) continue;
    const float w = to_float(depth[rd]);
    const T* g = grad_rows + static_cast<int64_t>(cell) * channels;
    const T* x = feat + static_cast<int64_t>(rf) * channels;
    float* gf = grad_feat_acc + static_cast<int64_t>(rf) * channels;
    float dot = 0.0f;
    for (int c = 0; c < channels; ++c) {
      const float gc = to_float(g[c]);
      dot = fmaf(gc, to_float(x[c]), dot);
      atomicAdd(gf + c, w * gc);
    }
    atomicAdd(grad_depth_acc + rd, dot);
  }
}

// ------------------------------------------------------------------------------ host helpers

// Widest vector (16, 8, 4 or 2 bytes; 32 for float32 with `wide`) that divides a row and every
// row pointer's alignment. Instantiated widths: float32 {8 (forward), 4, 1}; 16-bit {8, 2, 1}
// elements.
int pick_vec(int elem_bytes, int64_t channels, std::initializer_list<const void*> ptrs,
             bool wide = false) {
  const int candidates_f32[] = {8, 4, 1};
  const int candidates_16[] = {8, 2, 1};
  const int* cand = elem_bytes == 4 ? candidates_f32 + (wide ? 0 : 1) : candidates_16;
  const int n = elem_bytes == 4 ? (wide ? 3 : 2) : 3;
  for (int k = 0; k < n; ++k) {
    const int vec = cand[k];
    bool ok = channels % vec == 0;
    for (const void* p : ptrs) ok = ok && reinterpret_cast<uintptr_t>(p) % (vec * elem_bytes) == 0;
    if (ok) return vec;
  }
  return 1;
}

// f(std::integral_constant<int, VEC>) for a width pick_vec chose (kWide: the forward's set).
template <typename T, bool kWide = false, class F>
void dispatch_vec(int vec, F&& f) {
  if constexpr (sizeof(T) == 4 && kWide) {
    dispatch_int<8, 4, 1>(vec, f);
  } else if constexpr (sizeof(T) == 4) {
    dispatch_int<4, 1>(vec, f);
  } else {
    dispatch_int<8, 2, 1>(vec, f);
  }
}

// Shared-memory window width (cells) for a channel tile of `tile_c` channels: odd pitch.
int window_cells_for(int capacity_elems, int tile_c) {
  int w = capacity_elems / tile_c;
  if (w % 2 == 0) w -= 1;
  return w < 1 ? 1 : w;
}

// Points per block: small enough that the block's cells usually fit the window (half of it at
// the average density), every SM gets `blocks_per_sm` blocks and a slot walks <= 32 points;
// large enough that each slot gets >= 4 points. `override_ppb` > 0 (profiling) replaces the choice.
int points_per_block_for(int64_t n_points, int64_t n_keys, int window, int lanes, int device_id,
                         int64_t override_ppb, int64_t blocks_per_sm = kTargetBlocksPerSM) {
  const int64_t slots = kThreads / lanes;
  if (override_ppb > 0) return static_cast<int>(std::min<int64_t>(override_ppb, 1 << 20));
  const int64_t sms = multiprocessor_count(device_id);
  const int64_t span = window > 0 && n_keys > 0
                           ? (static_cast<int64_t>(window) * n_points) / (2 * n_keys)
                           : n_points;
  const int64_t occupancy = (n_points + sms * blocks_per_sm - 1) / (sms * blocks_per_sm);
  int64_t p = std::min(span, occupancy);
  p = std::min(p, slots * kMaxPointsPerSlot);
  p = std::max(p, slots * kMinPointsPerSlot);
  return static_cast<int>(p);
}

// float32 forward rows as 32-byte vectors (8 channels per lane; 16-bit types have 8 channels in
// 16 bytes). MUSPACE_BEV_POOL_V2_VECTOR_BYTES=16 keeps 16 bytes (profiling only).
bool wide_forward_vectors() {
  static const bool wide = [] {
    const char* v = std::getenv("MUSPACE_BEV_POOL_V2_VECTOR_BYTES");
    return v == nullptr || std::atoi(v) != 16;
  }();
  return wide;
}

int clamp_int(int64_t v) { return static_cast<int>(std::min<int64_t>(v, INT_MAX)); }

// What every entry point checks: the feat-like tensor (feat, or grad_feat for the sorted
// kernel: float dtype, contiguous, [..., C]) and the point arrays (int32 [n], on its device;
// depth / ranks_depth both or neither, depth in its dtype).
struct Points {
  int64_t n;  // points
  int64_t channels;
  bool has_depth;
};

Points check_points(const TensorView& feat, const char* feat_name,
                    const Optional<TensorView>& depth, const Optional<TensorView>& ranks_depth,
                    const TensorView& ranks_feat, const TensorView& ranks_bev) {
  check_gpu_tensor(feat, feat_name);
  check_float_dtype(feat, feat_name);
  check_contiguous(feat, feat_name);
  if (feat.ndim() < 2) {
    TVM_FFI_THROW(ValueError) << "feat must be at least 2-D [..., C], got " << feat.ndim() << "-D";
  }
  Points p;
  p.channels = feat.size(feat.ndim() - 1);
  if (p.channels > kMaxChannels) {
    TVM_FFI_THROW(ValueError) << "feat has " << p.channels << " channels; at most " << kMaxChannels
                              << " are supported";
  }
  check_together(depth, "depth", ranks_depth, "ranks_depth");
  p.has_depth = depth.has_value();
  check_input(ranks_bev, "ranks_bev", feat, kInt32);
  check_ndim(ranks_bev, "ranks_bev", 1);
  p.n = ranks_bev.size(0);
  if (p.n > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << "ranks_bev has " << p.n << " points; at most " << kMaxPoints
                              << " are supported";
  }
  check_vector(ranks_feat, "ranks_feat", feat, kInt32, p.n);
  if (p.has_depth) {
    check_like(*depth, "depth", feat, feat_name);
    check_vector(*ranks_depth, "ranks_depth", feat, kInt32, p.n);
  }
  return p;
}

// Cells of out [B, C, Z, Y, X] (or grad_out): B*Z*Y*X must fit the int32 ranks_bev.
void out_geometry(const TensorView& out, const char* name, int64_t channels, int* n_cells,
                  int* cells_per_batch) {
  check_ndim(out, name, 5);
  check_size(out, name, 1, channels);
  const int64_t per_batch = out.size(2) * out.size(3) * out.size(4);
  const int64_t cells = out.size(0) * per_batch;
  if (cells > kMaxCells) {
    TVM_FFI_THROW(ValueError) << name << ": B*Z*Y*X = " << cells
                              << " cells exceed the int32 range of ranks_bev";
  }
  *n_cells = static_cast<int>(cells);
  *cells_per_batch = static_cast<int>(per_batch);
}

// ------------------------------------------------------------------------------ entry points

// out = bev_pool_v2(depth, feat, ...) into the pre-allocated out [B, C, Z, Y, X]; every element
// is written. depth / ranks_depth: both or neither (weights 1).
void forward(Optional<TensorView> depth, TensorView feat, Optional<TensorView> ranks_depth,
             TensorView ranks_feat, TensorView ranks_bev, TensorView out, int64_t points_per_block,
             int64_t stream) {
  const Points pts = check_points(feat, "feat", depth, ranks_depth, ranks_feat, ranks_bev);
  const int64_t n = pts.n, channels = pts.channels;
  check_like(out, "out", feat, "feat");
  int n_cells = 0, cells_per_batch = 0;
  out_geometry(out, "out", channels, &n_cells, &cells_per_batch);
  if (out.numel() == 0) return;
  const int device_id = feat.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  const int64_t out_bytes = out.numel() * element_bytes(out);
  if (n == 0) return launch_zero(data_of(out), out_bytes, device_id, s, "bev_pool_v2 fill (out)");

  const int vec = pick_vec(element_bytes(feat), channels, {data_of(feat)}, wide_forward_vectors());
  dispatch_float(feat, "feat", [&](auto tag) {
    using T = decltype(tag);
    dispatch_vec<T, true>(vec, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int tile_c = static_cast<int>(std::min<int64_t>(channels, kMaxLanes * VEC));
      const int window = window_cells_for(stage_elems<T, VEC>(), tile_c);
      // pool_runs has at most kMaxSlots slots: as if each took >= kUnroll lanes.
      const int ppb = points_per_block_for(n, n_cells, window, std::max(tile_c / VEC, kUnroll),
                                           device_id, points_per_block);
      const dim3 grid(static_cast<unsigned>((n + ppb - 1) / ppb),
                      static_cast<unsigned>((channels / VEC + kMaxLanes - 1) / kMaxLanes));
      launch_zero(data_of(out), out_bytes, device_id, s, "bev_pool_v2 fill (out)");
      dispatch_bools(
          [&](auto depth_tag) {
            constexpr bool kHasDepth = decltype(depth_tag)::value;
            FeatGather<T, VEC, kHasDepth> gat;
            gat.depth = data_of<const T>(depth);
            gat.rows = data_of<const T>(feat);
            gat.ranks_depth = data_of<const int>(ranks_depth);
            gat.ranks_feat = data_of<const int>(ranks_feat);
            gat.keys = data_of<const int>(ranks_bev);
            gat.n_depth = clamp_int(numel_of(depth));
            gat.n_rows = clamp_int(feat.numel() / channels);
            gat.channels = static_cast<int>(channels);
            gat.n_keys = n_cells;
            forward_kernel<T, VEC, kHasDepth>
                <<<grid, kThreads, 0, s>>>(gat, data_of<T>(out), static_cast<int>(n), ppb,
                                           static_cast<int>(channels), cells_per_batch, window);
            check_launch("bev_pool_v2 forward_kernel");
          },
          pts.has_depth);
    });
  });
}

// Backward in point order; the outputs are float32 and pre-zeroed by the caller, any may be None:
// - grad_depth_acc (depth's shape): grad_depth_acc[ranks_depth[i]] += dot(grad_out[:, cell_i],
//   feat[ranks_feat[i]]) with float32 atomics (the sum over repeated ranks_depth values);
// - point_dots [n_points]: that dot per point (0 for a bad point), no atomics (deterministic mode:
//   the caller reduces it);
// - grad_feat_acc (feat's shape, 16-byte aligned): atomic accumulation (default mode).
// At most one of grad_depth_acc / point_dots, both need depth; at least one output.
void backward(TensorView grad_out, Optional<TensorView> depth, TensorView feat,
              Optional<TensorView> ranks_depth, TensorView ranks_feat, TensorView ranks_bev,
              Optional<TensorView> grad_depth_acc, Optional<TensorView> point_dots,
              Optional<TensorView> grad_feat_acc, int64_t points_per_block, int64_t stream) {
  const Points pts = check_points(feat, "feat", depth, ranks_depth, ranks_feat, ranks_bev);
  const int64_t n = pts.n, channels = pts.channels;
  check_needs(grad_depth_acc, "grad_depth_acc", depth, "depth");
  check_needs(point_dots, "point_dots", depth, "depth");
  if (grad_depth_acc.has_value() && point_dots.has_value()) {
    TVM_FFI_THROW(ValueError) << "give grad_depth_acc or point_dots, not both";
  }
  const bool depth_grad = grad_depth_acc.has_value() || point_dots.has_value();
  if (!depth_grad && !grad_feat_acc.has_value()) {
    TVM_FFI_THROW(ValueError) << "give grad_depth_acc, point_dots or grad_feat_acc";
  }
  check_like(grad_out, "grad_out", feat, "feat");
  int n_cells = 0, cells_per_batch = 0;
  out_geometry(grad_out, "grad_out", channels, &n_cells, &cells_per_batch);
  if (grad_depth_acc.has_value()) {
    check_input(*grad_depth_acc, "grad_depth_acc", feat, kFloat32);
    check_same_shape(*grad_depth_acc, "grad_depth_acc", *depth, "depth");
  }
  if (point_dots.has_value()) check_vector(*point_dots, "point_dots", feat, kFloat32, n);
  if (grad_feat_acc.has_value()) {
    check_input(*grad_feat_acc, "grad_feat_acc", feat, kFloat32);
    check_same_shape(*grad_feat_acc, "grad_feat_acc", feat, "feat");
    check_aligned(*grad_feat_acc, "grad_feat_acc", 16);  // vector atomics: 8 / 16 bytes
  }
  // Nothing to accumulate: the accumulators stay zero; point_dots (not pre-zeroed) gets zeros.
  if (n == 0 || grad_out.numel() == 0 || channels == 0) {
    if (point_dots.has_value() && n > 0) {
      DeviceGuard guard(feat.device().device_id);
      launch_zero(data_of(*point_dots), n * 4, feat.device().device_id, as_stream(stream),
                  "bev_pool_v2 fill (point_dots)");
    }
    return;
  }
  const int device_id = feat.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  const int vec = pick_vec(element_bytes(feat), channels, {data_of(feat)});
  dispatch_float(feat, "feat", [&](auto tag) {
    using T = decltype(tag);
    dispatch_vec<T>(vec, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      constexpr int kStage = backward_stage_elems<T>();
      const int lanes = static_cast<int>(std::min<int64_t>(channels / VEC, kMaxLanes));
      const int window = std::max(0, window_cells_for(kStage, static_cast<int>(channels)));
      // A window narrower than one cell (huge C) is simply unused (window 0 cells).
      const int window_used = static_cast<int64_t>(window) * channels <= kStage ? window : 0;
      const int ppb = points_per_block_for(n, n_cells, std::max(window_used, 1), lanes, device_id,
                                           points_per_block, kTargetBlocksPerSMBackward);
      const dim3 grid(static_cast<unsigned>((n + ppb - 1) / ppb));
      dispatch_bools(
          [&](auto has_depth_tag, auto depth_grad_tag, auto atomic_tag) {
            constexpr bool kHasDepth = decltype(has_depth_tag)::value;
            constexpr bool kDepthGrad = decltype(depth_grad_tag)::value;
            constexpr bool kAtomic = decltype(atomic_tag)::value;
            // the depth gradient needs depth; at least one output (both checked above)
            if constexpr ((kHasDepth || !kDepthGrad) && (kDepthGrad || kAtomic)) {
              backward_points_kernel<T, VEC, kHasDepth, kDepthGrad, kAtomic>
                  <<<grid, kThreads, 0, s>>>(
                      data_of<const T>(grad_out), data_of<const T>(depth), data_of<const T>(feat),
                      data_of<const int>(ranks_depth), data_of<const int>(ranks_feat),
                      data_of<const int>(ranks_bev), data_of<float>(grad_depth_acc),
                      data_of<float>(point_dots), data_of<float>(grad_feat_acc),
                      static_cast<int>(n), ppb, numel_of(depth), feat.numel() / channels,
                      static_cast<int>(channels), n_cells, cells_per_batch, window_used);
              check_launch("bev_pool_v2 backward_points_kernel");
            }
          },
          pts.has_depth, depth_grad, grad_feat_acc.has_value());
    });
  });
}

// Deterministic grad_feat [..., C] (every element written) from channels-last grad rows
// [n_cells, C] and `order` (the stable sort of the points by ranks_feat, out-of-range dropped).
void backward_feat_sorted(TensorView grad_rows, Optional<TensorView> depth,
                          Optional<TensorView> ranks_depth, TensorView ranks_feat,
                          TensorView ranks_bev, TensorView order, TensorView grad_feat,
                          int64_t points_per_block, int64_t stream) {
  const Points pts =
      check_points(grad_feat, "grad_feat", depth, ranks_depth, ranks_feat, ranks_bev);
  const int64_t n = pts.n, channels = pts.channels;
  check_input(order, "order", grad_feat, kInt32);
  check_ndim(order, "order", 1);
  if (order.size(0) > n) {
    TVM_FFI_THROW(ValueError) << "order has " << order.size(0) << " entries, more than the " << n
                              << " points";
  }
  check_input(grad_rows, "grad_rows", grad_feat, grad_feat.dtype());
  check_ndim(grad_rows, "grad_rows", 2);
  check_size(grad_rows, "grad_rows", 1, channels);
  if (grad_rows.size(0) > kMaxCells) {
    TVM_FFI_THROW(ValueError) << "grad_rows has " << grad_rows.size(0) << " cells; at most "
                              << kMaxCells;
  }
  const int64_t n_keys = channels > 0 ? grad_feat.numel() / channels : 0;
  if (n_keys > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "feat has " << n_keys << " rows; ranks_feat (int32) reaches "
                              << INT_MAX;
  }
  if (grad_feat.numel() == 0) return;
  const int device_id = grad_feat.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  const int64_t n_sorted = order.size(0);
  const int64_t grad_feat_bytes = grad_feat.numel() * element_bytes(grad_feat);
  const char* fill_name = "bev_pool_v2 fill (grad_feat)";
  if (n_sorted == 0)
    return launch_zero(data_of(grad_feat), grad_feat_bytes, device_id, s, fill_name);
  const int vec =
      pick_vec(element_bytes(grad_feat), channels, {data_of(grad_rows), data_of(grad_feat)});
  dispatch_float(grad_feat, "grad_feat", [&](auto tag) {
    using T = decltype(tag);
    dispatch_vec<T>(vec, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const int tile_c = static_cast<int>(std::min<int64_t>(channels, kMaxLanes * VEC));
      // No window here (rows are written whole): only the occupancy and slot bounds apply.
      const int ppb = points_per_block_for(n_sorted, n_keys, 0, std::max(tile_c / VEC, kUnroll),
                                           device_id, points_per_block);
      const dim3 grid(static_cast<unsigned>((n_sorted + ppb - 1) / ppb),
                      static_cast<unsigned>((channels / VEC + kMaxLanes - 1) / kMaxLanes));
      const bool prezero = n_keys > kSparseKeysPerPoint * n_sorted;
      if (prezero) launch_zero(data_of(grad_feat), grad_feat_bytes, device_id, s, fill_name);
      dispatch_bools(
          [&](auto depth_tag) {
            constexpr bool kHasDepth = decltype(depth_tag)::value;
            GradRowGather<T, VEC, kHasDepth> gat;
            gat.depth = data_of<const T>(depth);
            gat.rows = data_of<const T>(grad_rows);
            gat.order = data_of<const int>(order);
            gat.ranks_depth = data_of<const int>(ranks_depth);
            gat.ranks_feat = data_of<const int>(ranks_feat);
            gat.ranks_bev = data_of<const int>(ranks_bev);
            gat.n_points = static_cast<int>(n);
            gat.n_depth = clamp_int(numel_of(depth));
            gat.n_cells = static_cast<int>(grad_rows.size(0));
            gat.channels = static_cast<int>(channels);
            gat.n_keys = static_cast<int>(n_keys);
            grad_feat_sorted_kernel<T, VEC, kHasDepth>
                <<<grid, kThreads, 0, s>>>(gat, data_of<T>(grad_feat), static_cast<int>(n_sorted),
                                           ppb, static_cast<int>(channels), prezero ? 1 : 0);
            check_launch("bev_pool_v2 grad_feat_sorted_kernel");
          },
          pts.has_depth);
    });
  });
}

// Backward in the frustum layout (see frustum_backward_kernel), for depth [B, N, D, H, W] and
// feat [B, N, H, W, C]. Returns false, launching nothing, when that layout does not apply: other
// shapes, or more than kMaxLanes channel vectors (C > 128 float32 / 256 16-bit channels).
// - grad_rows [n_cells, C]: grad_out channels last, feat's dtype;
// - point_of_depth int32 [depth.numel()]: workspace;
// - grad_depth (depth's shape), grad_feat (feat's shape): every element written; feat's dtype or
//   float32 (float32 with add_irregular);
// - irregular int32 [1]: := 1 if some valid point is outside the layout (a repeated ranks_depth,
//   or ranks_feat not its ray's row), else 0. Their terms are added with float32 atomics when
//   add_irregular, else left out (the caller recomputes). None: the caller knows the ranks are
//   in the layout (bev_pool_prepare's), and the pass that looks for such points is skipped.
bool backward_frustum(TensorView grad_rows, TensorView depth, TensorView feat,
                      TensorView ranks_depth, TensorView ranks_feat, TensorView ranks_bev,
                      TensorView point_of_depth, TensorView grad_depth, TensorView grad_feat,
                      Optional<TensorView> irregular, bool add_irregular, int64_t stream) {
  const Points pts = check_points(feat, "feat", Optional<TensorView>(depth),
                                  Optional<TensorView>(ranks_depth), ranks_feat, ranks_bev);
  const int64_t n = pts.n, channels = pts.channels;
  check_input(grad_rows, "grad_rows", feat, feat.dtype());
  check_ndim(grad_rows, "grad_rows", 2);
  check_size(grad_rows, "grad_rows", 1, channels);
  if (grad_rows.size(0) > kMaxCells) {
    TVM_FFI_THROW(ValueError) << "grad_rows has " << grad_rows.size(0) << " cells; at most "
                              << kMaxCells;
  }
  check_vector(point_of_depth, "point_of_depth", feat, kInt32, depth.numel());
  if (irregular.has_value()) check_vector(*irregular, "irregular", feat, kInt32, 1);
  if (add_irregular && !irregular.has_value()) {
    TVM_FFI_THROW(ValueError) << "add_irregular needs the irregular flag tensor";
  }
  int* irregular_flag = irregular.has_value() ? data_of<int>(*irregular) : nullptr;
  check_device(grad_depth, "grad_depth", feat);
  check_contiguous(grad_depth, "grad_depth");
  check_same_shape(grad_depth, "grad_depth", depth, "depth");
  check_device(grad_feat, "grad_feat", feat);
  check_contiguous(grad_feat, "grad_feat");
  check_same_shape(grad_feat, "grad_feat", feat, "feat");
  check_aligned(grad_feat, "grad_feat", 16);  // row vector stores of up to 32 bytes
  const bool out_f32 = same_dtype(grad_depth.dtype(), kFloat32);
  if (!out_f32 && !same_dtype(grad_depth.dtype(), feat.dtype())) {
    TVM_FFI_THROW(TypeError) << "grad_depth must be float32 or feat's dtype ("
                             << dtype_name(feat.dtype()) << "), got "
                             << dtype_name(grad_depth.dtype());
  }
  check_same_dtype(grad_feat, "grad_feat", grad_depth, "grad_depth");
  if (add_irregular && !out_f32) {
    TVM_FFI_THROW(TypeError) << "add_irregular needs float32 grad_depth / grad_feat, got "
                             << dtype_name(grad_feat.dtype());
  }
  const bool frustum = depth.ndim() == 5 && feat.ndim() == 5 && depth.size(0) == feat.size(0) &&
                       depth.size(1) == feat.size(1) && depth.size(3) == feat.size(2) &&
                       depth.size(4) == feat.size(3) && depth.numel() <= INT_MAX;
  const int vec = pick_vec(element_bytes(feat), channels,
                           {data_of(feat), data_of(grad_rows), data_of(grad_feat)});
  if (!frustum || channels == 0 || channels / vec > kMaxLanes) return false;
  const int device_id = feat.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  const int n_rows = static_cast<int>(feat.numel() / channels);
  if (n_rows == 0) {  // no rows, no depth entries: nothing to write but the flag
    if (irregular_flag != nullptr) {
      launch_zero(irregular_flag, 4, device_id, s, "bev_pool_v2 fill (irregular)");
    }
    return true;
  }
  const int bins = static_cast<int>(depth.size(2));
  const int hw = static_cast<int>(depth.size(3) * depth.size(4));
  const int n_depth = static_cast<int>(depth.numel());
  const int n_cells = static_cast<int>(grad_rows.size(0));
  launch_fill(data_of(point_of_depth), n_depth * int64_t{4}, fill_word(-1), device_id, s,
              "bev_pool_v2 fill (point_of_depth)");
  const int point_grid = grid_for(n, kThreads, device_id, 8);
  frustum_points_kernel<<<point_grid, kThreads, 0, s>>>(
      data_of<const int>(ranks_depth), data_of<const int>(ranks_feat),
      data_of<const int>(ranks_bev), data_of<int>(point_of_depth), irregular_flag,
      static_cast<int>(n), n_depth, n_rows, n_cells, bins * hw, hw);
  check_launch("bev_pool_v2 frustum_points_kernel");
  dispatch_float(feat, "feat", [&](auto tag) {
    using T = decltype(tag);
    dispatch_vec<T>(vec, [&](auto vec_tag) {
      constexpr int VEC = decltype(vec_tag)::value;
      const dim3 grid(static_cast<unsigned>((n_rows + kFrustumRows - 1) / kFrustumRows));
      auto launch = [&](auto out_tag) {
        using TOut = decltype(out_tag);
        frustum_backward_kernel<T, TOut, VEC><<<grid, kThreads, 0, s>>>(
            data_of<const T>(grad_rows), data_of<const T>(depth), data_of<const T>(feat),
            data_of<const int>(ranks_bev), data_of<const int>(point_of_depth),
            data_of<TOut>(grad_depth), data_of<TOut>(grad_feat), n_rows, bins, hw,
            static_cast<int>(channels));
        check_launch("bev_pool_v2 frustum_backward_kernel");
      };
      if (out_f32) {
        launch(float{});
      } else {
        launch(T{});
      }
      if (irregular_flag == nullptr) return;  // no point outside the layout: no pass for them
      irregular_points_kernel<T><<<point_grid, kThreads, 0, s>>>(
          data_of<const T>(grad_rows), data_of<const T>(depth), data_of<const T>(feat),
          data_of<const int>(ranks_depth), data_of<const int>(ranks_feat),
          data_of<const int>(ranks_bev), data_of<const int>(point_of_depth),
          add_irregular ? data_of<float>(grad_depth) : nullptr,
          add_irregular ? data_of<float>(grad_feat) : nullptr, irregular_flag, static_cast<int>(n),
          n_depth, n_rows, n_cells, static_cast<int>(channels), bins * hw, hw);
      check_launch("bev_pool_v2 irregular_points_kernel");
    });
  });
  return true;
}

}  // namespace
}  // namespace bev_pool_v2
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_v2_forward, muspace::bev_pool_v2::forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_v2_backward, muspace::bev_pool_v2::backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_v2_backward_feat_sorted,
                              muspace::bev_pool_v2::backward_feat_sorted);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_v2_backward_frustum, muspace::bev_pool_v2::backward_frustum);
