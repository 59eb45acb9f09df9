// Greedy NMS on the GPU without a host round trip per box: nms3d, nms3d_normal, nms_bev
// (mmcv) and circle_nms (mmdet3d / CenterPoint); OpenPCDet's nms_gpu / nms_normal_gpu.
//
// The caller gives the visiting order (mmcv's `scores.sort(0, descending=True)`, sliced to
// pre_max_size; circle_nms: the reversed stable argsort), so the kept boxes, their order and
// the tie-breaking are mmcv's. Box i suppresses a later box j when
//   value(box_i, box_j) > threshold       (IoU kinds, box3d::pair_value)
//   value(box_i, box_j) <= threshold      (kCircle: squared centre distance)
// and the result is the greedy one: visit the boxes in order, keep a box unless a kept box
// suppresses it, stop after max_keep kept boxes (post_max_size).
//
// Boxes are grouped in tiles of 64 (tile k = boxes 64k .. 64k + 63 of the order); word w of
// row i holds bit b = "box i suppresses box 64w + b" (only b > i within the diagonal tile).
// 1. mask_kernel, one block of 64 threads per 64 x 64 tile on and above the diagonal: the
//    NONZERO words only, as entries {bits, column tile, row in tile} appended to the list of the
//    row tile (block-aggregated atomics). Suppression is sparse (a box overlaps a handful of
//    others), so a tile's list is short: 4096 boxes at IoU 0.7 give ~1 entry per box, not 64.
// 2. fixed_point_kernel (up to 512 tiles), one block: the greedy result as the fixed point of
//    "kept = not suppressed by a kept box", iterated over all entries at once from "all kept";
//    a round costs two barriers, and sparse suppression converges in a few rounds instead of
//    one serial step per tile. After 32 rounds without convergence it leaves the result to
// 3. reduce_kernel, one block (also the path above 512 tiles): walks the tiles in order with the removed bits of every tile in
//    shared memory. Per tile k: thread 0 resolves the tile from its removed word and its diagonal
//    entries, visiting only rows that suppress something inside the tile (the rows of a nonzero
//    diagonal word); every other row's fate is its removed bit. Then all threads OR the kept
//    rows' off-diagonal entries into the removed words (shared atomics). The entries of tile
//    k + 1 are loaded into registers while tile k resolves (they do not depend on decisions),
//    so the walk never waits on global memory per box. Kept bits and running counts per tile
//    go to the workspace; a final pass writes keep[rank] = order[box] in parallel.
// Everything runs on the caller's stream; the caller reads keep[n] (the count: the one sync).
#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "box3d.muh"
#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"

namespace muspace {
namespace box3d {
namespace {

constexpr int kTile = 64;     // boxes per tile: one 64-bit word of the mask
constexpr int kQueue = 1024;  // pairs a mask block clips together (more: clipped in place)
constexpr int kReduceThreads = 128;
constexpr int kSlots = 4;  // entries of the next tile each reduce thread holds in registers
// fixed_point_kernel: one block for up to kFixedMaxTiles tiles (32768 boxes; its shared memory
// is 3 x 4 KB of removed words, 2 KB of list starts, 4 KB of scan buffers), entries of kFixedSlots
// per thread in registers (4096 in all; more are re-read each round), kFixedRounds rounds.
constexpr int kFixedThreads = 512;
constexpr int kFixedMaxTiles = kFixedThreads;  // one tile per thread in the prefix sums
constexpr int kFixedSlots = 8;
constexpr int kFixedRounds = 32;
// removed bits of every tile in shared memory (24 KB, under the 28 KB portable limit)
constexpr int64_t kMaxTiles = 3072;
constexpr int64_t kMaxBoxes = kMaxTiles * kTile;
MUSPACE_LIMIT(box3d_nms, max_boxes, kMaxBoxes);

using Word = unsigned long long;

// One nonzero mask word: row `row` of its row tile suppresses the boxes `bits` of tile `col`.
struct alignas(16) Entry {
  Word bits;
  int32_t col;
  int32_t row;
};

// The list of row tile r starts at 64 * (sum over r' < r of (tiles - r')): room for every
// word of its rows on and above the diagonal.
__host__ __device__ __forceinline__ int64_t list_offset(int64_t r, int64_t tiles) {
  return kTile * (r * tiles - r * (r - 1) / 2);
}

// Workspace in int64 words: the lists (2 words per entry), then per tile the entry count
// (uint32, one int64 word each for simplicity), the kept bits and the kept count before it.
__host__ __device__ __forceinline__ int64_t workspace_words(int64_t tiles) {
  return 2 * list_offset(tiles, tiles) + 3 * tiles;
}

template <typename T>
__device__ __forceinline__ Rect load_ordered(const T* __restrict__ boxes, const int64_t* order,
                                             int64_t k, int64_t n_rows, int layout) {
  const int64_t row = order[k];
  if (row < 0 || row >= n_rows) return nan_rect();  // a bad order entry: a NaN box
  return load_rect(boxes, row, layout, 1.0f);
}

// s_word |= v from many threads at once: two 32-bit shared atomics (portable everywhere).
__device__ __forceinline__ void atomic_or_word(Word* p, Word v) {
  unsigned int* half = reinterpret_cast<unsigned int*>(p);
  const unsigned int lo = static_cast<unsigned int>(v);
  const unsigned int hi = static_cast<unsigned int>(v >> 32);
  if (lo) atomicOr(half, lo);
  if (hi) atomicOr(half + 1, hi);
}

// Exclusive prefix of one value per thread over a block of kFixedThreads (`total`: the sum);
// s: two kFixedThreads buffers, alternating so that each step reads one and writes the other.
__device__ __forceinline__ int block_exclusive_prefix(int v, int (*s)[kFixedThreads], int& total) {
  const int tid = threadIdx.x;
  int cur = 0;
  s[0][tid] = v;
  __syncthreads();
  for (int off = 1; off < kFixedThreads; off <<= 1) {
    s[cur ^ 1][tid] = s[cur][tid] + (tid >= off ? s[cur][tid - off] : 0);
    cur ^= 1;
    __syncthreads();
  }
  const int inclusive = s[cur][tid];
  total = s[cur][kFixedThreads - 1];
  __syncthreads();  // s is free again
  return inclusive - v;
}

template <typename T, int kKind>
__global__ void __launch_bounds__(kTile)
    mask_kernel(const T* __restrict__ boxes, const int64_t* __restrict__ order,
                Entry* __restrict__ lists, unsigned int* __restrict__ list_size, int64_t n,
                int64_t n_rows, int layout, float threshold) {
  constexpr bool kClips = kKind == kIoU3D || kKind == kRotatedIoU;
  const int c = blockIdx.x;  // column tile
  const int r = blockIdx.y;  // row tile
  if (c < r) return;         // below the diagonal: nothing (block-uniform)
  __shared__ Rect s_col[kTile];
  __shared__ Rect s_row[kTile];
  __shared__ Word s_clipped[kTile];           // bits decided by the clip queue
  __shared__ unsigned short s_queue[kQueue];  // (row << 6) | column of a pair to clip
  // each thread's clip vertices, interleaved (conflict-free): 8 KB in shared memory instead of
  // the 160-byte stack, which 24 resident blocks with 9 KB of shared memory each left little L1
  __shared__ float s_clip[kClips ? kClipFloats * kTile : 1];
  __shared__ unsigned int s_queued;
  __shared__ unsigned int s_count;
  __shared__ unsigned int s_base;
  const int tid = threadIdx.x;
  const int64_t j0 = static_cast<int64_t>(c) * kTile;
  const int cols = static_cast<int>(::min(static_cast<int64_t>(kTile), n - j0));
  const int64_t i = static_cast<int64_t>(r) * kTile + tid;
  if (tid == 0) {
    s_count = 0;
    s_queued = 0;
  }
  s_clipped[tid] = 0;
  if (tid < cols) s_col[tid] = load_ordered(boxes, order, j0 + tid, n_rows, layout);
  if (i < n) s_row[tid] = load_ordered(boxes, order, i, n_rows, layout);
  __syncthreads();
  Word bits = 0;
  if (i < n) {
    const Rect a = s_row[tid];
    const int start = c == r ? tid + 1 : 0;
    if constexpr (kClips) {
      const bool zero_suppresses = suppresses(0.0f, threshold, kKind);  // threshold < 0
      for (int k = start; k < cols; ++k) {
        const Rect& b = s_col[k];
        if (needs_clip(a, b, kKind)) {
          const unsigned int q = atomicAdd(&s_queued, 1u);
          if (q < kQueue) {
            s_queue[q] = static_cast<unsigned short>((tid << 6) | k);
          } else if (suppresses(pair_value_in<kTile>(a, b, kKind, s_clip + tid), threshold,
                                kKind)) {  // queue full
            bits |= Word{1} << k;
          }
        } else if (zero_suppresses && a.ok && b.ok) {  // unclipped_value: 0 or NaN
          bits |= Word{1} << k;
        }
      }
    } else {
      for (int k = start; k < cols; ++k) {
        if (suppresses(pair_value(a, s_col[k], kKind), threshold, kKind)) bits |= Word{1} << k;
      }
    }
  }
  if constexpr (kClips) {
    __syncthreads();
    const unsigned int queued = ::min(s_queued, static_cast<unsigned int>(kQueue));
    for (unsigned int q = tid; q < queued; q += kTile) {
      const int row = s_queue[q] >> 6;
      const int col = s_queue[q] & (kTile - 1);
      if (suppresses(pair_value_in<kTile>(s_row[row], s_col[col], kKind, s_clip + tid), threshold,
                     kKind)) {
        atomic_or_word(s_clipped + row, Word{1} << col);
      }
    }
    __syncthreads();
    bits |= s_clipped[tid];
  }
  unsigned int slot = 0;
  if (bits) slot = atomicAdd(&s_count, 1u);
  __syncthreads();
  if (tid == 0 && s_count) s_base = atomicAdd(list_size + r, s_count);
  __syncthreads();
  if (bits) {
    const int64_t tiles = gridDim.x;
    Entry e;
    e.bits = bits;
    e.col = c;
    e.row = tid;
    lists[list_offset(r, tiles) + s_base + slot] = e;
  }
}

__device__ __forceinline__ int lowest_bit(Word w) { return __ffsll(static_cast<long long>(w)) - 1; }

// Entries [0, size) of a list: slot s of this thread is entry tid + s * kReduceThreads.
__device__ __forceinline__ unsigned int slot_index(int tid, int s) {
  return static_cast<unsigned int>(tid + s * kReduceThreads);
}

__device__ __forceinline__ void load_slots(const Entry* list, unsigned int size, int tid,
                                           Entry (&e)[kSlots]) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const unsigned int idx = slot_index(tid, s);
    e[s] = idx < size ? list[idx] : Entry{0, 0, 0};
  }
}

// The diagonal entry of a row tile: its word for shared memory and its row in the nonzero set.
__device__ __forceinline__ void publish_diagonal(const Entry& e, Word* s_diag,
                                                 unsigned int* s_nonzero) {
  s_diag[e.row] = e.bits;
  atomicOr(s_nonzero + (e.row >> 5), 1u << (e.row & 31));
}

__global__ void __launch_bounds__(kReduceThreads)
    reduce_kernel(const Entry* __restrict__ lists, const unsigned int* __restrict__ list_size,
                  const int64_t* __restrict__ order, Word* __restrict__ tile_kept,
                  int64_t* __restrict__ tile_base, int64_t* __restrict__ keep,
                  const unsigned int* __restrict__ fallback, int64_t n, int64_t max_keep) {
  // fixed_point_kernel ran first (fallback not null) and converged: keep is written
  if (fallback != nullptr && *fallback == 0) return;
  extern __shared__ Word s_removed[];  // [tiles]
  __shared__ Word s_diag[kTile];
  __shared__ unsigned int s_nonzero[2];  // rows of the tile with a nonzero diagonal word
  __shared__ Word s_kept;
  __shared__ int s_stop;
  const int tid = threadIdx.x;
  const int64_t tiles = (n + kTile - 1) / kTile;
  for (int64_t w = tid; w < tiles; w += kReduceThreads) s_removed[w] = 0;
  if (tid < 2) s_nonzero[tid] = 0;
  __syncthreads();

  Entry cur[kSlots];
  unsigned int cur_size = list_size[0];
  unsigned int next_size = tiles > 1 ? list_size[1] : 0;
  load_slots(lists, cur_size, tid, cur);
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (slot_index(tid, s) < cur_size && cur[s].col == 0) {
      publish_diagonal(cur[s], s_diag, s_nonzero);
    }
  }
  for (unsigned int idx = tid + kSlots * kReduceThreads; idx < cur_size; idx += kReduceThreads) {
    const Entry e = lists[idx];
    if (e.col == 0) publish_diagonal(e, s_diag, s_nonzero);
  }
  __syncthreads();

  int64_t count = 0;  // thread 0's: kept boxes so far
  int64_t tiles_done = tiles;
  for (int64_t k = 0; k < tiles; ++k) {
    // the next tile's entries (and the size of the one after) while this tile resolves
    Entry nxt[kSlots];
    const Entry* next_list = lists + list_offset(k + 1, tiles);
    const unsigned int after_size = k + 2 < tiles ? list_size[k + 2] : 0;
    if (k + 1 < tiles) load_slots(next_list, next_size, tid, nxt);

    if (tid == 0) {
      const int rows = static_cast<int>(::min(static_cast<int64_t>(kTile), n - k * kTile));
      const Word valid = rows == kTile ? ~Word{0} : (Word{1} << rows) - 1;
      Word removed = s_removed[k] | ~valid;
      const Word nonzero = (static_cast<Word>(s_nonzero[1]) << 32) | s_nonzero[0];
      s_nonzero[0] = 0;  // refilled for tile k + 1 after the barrier
      s_nonzero[1] = 0;
      // Visit in order only the rows that suppress something in the tile; a row is kept iff it
      // is not removed when its turn comes (its diagonal bits are all above it).
      for (Word todo = nonzero & ~removed; todo; todo &= ~removed) {
        const int row = lowest_bit(todo);
        removed |= s_diag[row];
        todo &= todo - 1;
      }
      Word kept = ~removed;
      int64_t added = __popcll(kept);
      int stop = 0;
      if (count + added >= max_keep) {  // keep the first max_keep - count of them
        Word first = 0;
        for (int64_t q = count; q < max_keep; ++q) {
          const Word low = kept & (~kept + 1);
          first |= low;
          kept ^= low;
        }
        kept = first;
        added = max_keep - count;
        stop = 1;
      }
      tile_kept[k] = kept;
      tile_base[k] = count;
      count += added;
      s_kept = kept;
      s_stop = stop;
    }
    __syncthreads();
    if (s_stop) {  // block-uniform
      tiles_done = k + 1;
      break;
    }
    const Word kept = s_kept;
    if (kept) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (slot_index(tid, s) < cur_size && cur[s].col != k && ((kept >> cur[s].row) & 1)) {
          atomic_or_word(s_removed + cur[s].col, cur[s].bits);
        }
      }
      const Entry* list = lists + list_offset(k, tiles);
      for (unsigned int idx = tid + kSlots * kReduceThreads; idx < cur_size;
           idx += kReduceThreads) {
        const Entry e = list[idx];
        if (e.col != k && ((kept >> e.row) & 1)) atomic_or_word(s_removed + e.col, e.bits);
      }
    }
    if (k + 1 < tiles) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (slot_index(tid, s) < next_size && nxt[s].col == k + 1) {
          publish_diagonal(nxt[s], s_diag, s_nonzero);
        }
        cur[s] = nxt[s];
      }
      for (unsigned int idx = tid + kSlots * kReduceThreads; idx < next_size;
           idx += kReduceThreads) {
        const Entry e = next_list[idx];
        if (e.col == k + 1) publish_diagonal(e, s_diag, s_nonzero);
      }
    }
    cur_size = next_size;
    next_size = after_size;
    __syncthreads();  // s_removed, s_diag and s_nonzero ready for tile k + 1
  }
  // tile_kept / tile_base of thread 0 are visible after the last barrier
  const int64_t boxes = ::min(n, tiles_done * kTile);
  for (int64_t i = tid; i < boxes; i += kReduceThreads) {
    const int64_t k = i / kTile;
    const int b = static_cast<int>(i % kTile);
    const Word kept = tile_kept[k];
    if ((kept >> b) & 1) {
      keep[tile_base[k] + __popcll(kept & ((Word{1} << b) - 1))] = order[i];
    }
  }
  if (tid == 0) keep[n] = count;
}

// The fixed point of the greedy rule, for up to kFixedMaxTiles tiles: a box is kept iff it is
// not suppressed by a kept box before it. That rule has exactly one solution (by induction
// over the visiting order), so any removed set R with R = suppressed(kept = not R) IS the greedy
// result. Starting from R = {} (every box kept), each round recomputes R from the previous
// round's kept boxes, all entries in parallel; a round that changes nothing has reached it.
// Round t fixes at least every box whose suppression chains are shorter than t, so a handful of
// rounds suffice when suppression is sparse (detections: clusters of jittered copies). After
// kFixedRounds rounds without convergence (a long chain: box k suppresses only k + 1, ...) the
// kernel gives up (*fallback = 1) and the tile walk (reduce_kernel) runs as before.
// Removed words rotate through three buffers (read r % 3, write (r + 1) % 3, clear (r + 2) % 3),
// so every shared word is only read or only written between two barriers; two barriers a round.
__global__ void __launch_bounds__(kFixedThreads)
    fixed_point_kernel(const Entry* __restrict__ lists, const unsigned int* __restrict__ list_size,
                       const int64_t* __restrict__ order, Word* __restrict__ tile_kept,
                       int64_t* __restrict__ tile_base, int64_t* __restrict__ keep,
                       unsigned int* __restrict__ fallback, int64_t n, int64_t max_keep) {
  __shared__ Word s_removed[3][kFixedMaxTiles];
  __shared__ int s_start[kFixedMaxTiles];  // flat index of each row tile's first entry
  __shared__ int s_scan[2][kFixedThreads];
  __shared__ int s_changed[3];
  const int tid = threadIdx.x;
  const int tiles = static_cast<int>((n + kTile - 1) / kTile);  // <= kFixedMaxTiles
  const unsigned int own_size = tid < tiles ? list_size[tid] : 0u;
  for (int w = tid; w < tiles; w += kFixedThreads) {
    s_removed[0][w] = 0;
    s_removed[1][w] = 0;
  }
  if (tid < 3) s_changed[tid] = 0;
  // exclusive prefix of the list sizes (one tile per thread), Hillis-Steele over two buffers
  int total = 0;
  const int first = block_exclusive_prefix(static_cast<int>(own_size), s_scan, total);
  if (tid < tiles) s_start[tid] = first;
  __syncthreads();
  // the list entry of flat index f: the last row tile whose start is <= f
  auto locate = [&](int f, int& tile) -> Entry {
    int lo = 0, hi = tiles - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_start[mid] <= f) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    tile = lo;
    return lists[list_offset(lo, tiles) + (f - s_start[lo])];
  };
  Entry e[kFixedSlots];
  int e_tile[kFixedSlots];  // the entry's row tile, -1: no entry
#pragma unroll
  for (int q = 0; q < kFixedSlots; ++q) {
    const int f = tid + q * kFixedThreads;
    e[q] = Entry{0, 0, 0};
    e_tile[q] = -1;
    if (f < total) e[q] = locate(f, e_tile[q]);
  }
  int round = 0;
  int final_buffer = -1;
  for (; round < kFixedRounds; ++round) {
    const int rd = round % 3, wr = (round + 1) % 3, cl = (round + 2) % 3;
    for (int w = tid; w < tiles; w += kFixedThreads) s_removed[cl][w] = 0;
    if (tid == 0) s_changed[(round + 1) % 3] = 0;
#pragma unroll
    for (int q = 0; q < kFixedSlots; ++q) {
      if (e_tile[q] >= 0 && !((s_removed[rd][e_tile[q]] >> e[q].row) & 1)) {
        atomic_or_word(&s_removed[wr][e[q].col], e[q].bits);
      }
    }
    for (int f = tid + kFixedSlots * kFixedThreads; f < total; f += kFixedThreads) {
      int tile;
      const Entry x = locate(f, tile);
      if (!((s_removed[rd][tile] >> x.row) & 1)) atomic_or_word(&s_removed[wr][x.col], x.bits);
    }
    __syncthreads();
    for (int w = tid; w < tiles; w += kFixedThreads) {
      if (s_removed[wr][w] != s_removed[rd][w]) atomicOr(&s_changed[round % 3], 1);
    }
    __syncthreads();
    if (!s_changed[round % 3]) {  // block-uniform
      final_buffer = wr;
      break;
    }
  }
  if (final_buffer < 0) {  // block-uniform: not converged, the walk takes over
    if (tid == 0) *fallback = 1;
    return;
  }
  if (tid == 0) *fallback = 0;
  // kept bits per tile, their exclusive prefix, the max_keep cut; then keep[rank] = order[i]
  Word kept = 0;
  if (tid < tiles) {
    const int rows = static_cast<int>(::min(static_cast<int64_t>(kTile), n - tid * kTile));
    const Word valid = rows == kTile ? ~Word{0} : (Word{1} << rows) - 1;
    kept = valid & ~s_removed[final_buffer][tid];
  }
  int count = 0;
  const int base = block_exclusive_prefix(__popcll(kept), s_scan, count);
  if (tid < tiles) {
    if (base >= max_keep) {
      kept = 0;
    } else if (base + __popcll(kept) > max_keep) {  // the first max_keep - base of them
      Word first = 0;
      for (int64_t q = base; q < max_keep; ++q) {
        const Word low = kept & (~kept + 1);
        first |= low;
        kept ^= low;
      }
      kept = first;
    }
    tile_kept[tid] = kept;
    tile_base[tid] = base;
    s_removed[final_buffer][tid] = kept;  // read back below, after the barrier
    s_start[tid] = base;
  }
  __syncthreads();
  for (int64_t i = tid; i < n; i += kFixedThreads) {
    const int k = static_cast<int>(i / kTile);
    const int b = static_cast<int>(i % kTile);
    const Word bits = s_removed[final_buffer][k];
    if ((bits >> b) & 1) keep[s_start[k] + __popcll(bits & ((Word{1} << b) - 1))] = order[i];
  }
  if (tid == 0) keep[n] = ::min(static_cast<int64_t>(count), max_keep);
}

// boxes [n_rows, W] (layout: box3d::Layout; W = 7, 5, 5, 3), order [n] int64 (rows of boxes in
// visiting order), workspace int64 [box3d_nms_workspace_ints(n)], keep int64 [n + 1]: keep[0 .. K)
// = the kept rows of boxes in visiting order, keep[n] = the kept count K (rows first, so the
// result keep[:K] starts at the allocation, as the op's fake tensor does). kind:
// box3d::Kind 1, 2, 4 or 5; threshold: the float32 threshold (circle: already rounded down);
// max_keep <= 0: no limit.
void nms(TensorView boxes, TensorView order, TensorView workspace, TensorView keep, int64_t layout,
         int64_t kind, float threshold, int64_t max_keep, int64_t stream) {
  check_gpu_tensor(boxes, "boxes");
  check_float_dtype(boxes, "boxes");
  check_contiguous(boxes, "boxes");
  if (layout < kLidar7 || layout > kCenter3) {
    TVM_FFI_THROW(ValueError) << "layout must be in [0, 3], got " << layout;
  }
  if (kind != kIoU3D && kind != kRotatedIoU && kind != kNormal && kind != kCircle) {
    TVM_FFI_THROW(ValueError) << "kind must be 1, 2, 4 or 5, got " << kind;
  }
  const int width = layout == kLidar7 ? 7 : layout == kCenter3 ? 3 : 5;
  check_ndim(boxes, "boxes", 2);
  check_size(boxes, "boxes", 1, width);
  check_input(order, "order", boxes, kInt64);
  check_ndim(order, "order", 1);
  const int64_t n = order.size(0);
  if (n > kMaxBoxes) {
    TVM_FFI_THROW(ValueError) << n << " boxes exceed the NMS limit of " << kMaxBoxes;
  }
  const int64_t tiles = (n + kTile - 1) / kTile;
  check_input(workspace, "workspace", boxes, kInt64);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < workspace_words(tiles)) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << workspace_words(tiles) << " int64, got "
                              << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);  // the list entries are 16-byte vector accesses
  check_vector(keep, "keep", boxes, kInt64, n + 1);
  const int device_id = boxes.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (n == 0) {
    launch_zero(data_of(keep), 8, device_id, st, "box3d_nms fill (count)");  // keep[n], n = 0
    return;
  }
  int64_t* ws = data_of<int64_t>(workspace);
  Entry* lists = reinterpret_cast<Entry*>(ws);
  int64_t* per_tile = ws + 2 * list_offset(tiles, tiles);
  unsigned int* list_size = reinterpret_cast<unsigned int*>(per_tile);
  Word* tile_kept = reinterpret_cast<Word*>(per_tile + tiles);
  int64_t* tile_base = per_tile + 2 * tiles;
  // list_size[tiles]: fixed_point_kernel's fallback flag (the per-tile words have room: the
  // sizes use half of them)
  unsigned int* fallback = tiles <= kFixedMaxTiles ? list_size + tiles : nullptr;
  launch_zero(list_size, (tiles + 1) * static_cast<int64_t>(sizeof(unsigned int)), device_id, st,
              "box3d_nms fill (list sizes)");
  dispatch_float(boxes, "boxes", [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(tiles));
    auto launch = [&](auto kind_tag) {
      constexpr int kKind = decltype(kind_tag)::value;
      mask_kernel<T, kKind><<<grid, kTile, 0, st>>>(
          data_of<const T>(boxes), data_of<const int64_t>(order), lists, list_size, n,
          boxes.size(0), static_cast<int>(layout), threshold);
    };
    dispatch_int<kIoU3D, kRotatedIoU, kNormal, kCircle>(static_cast<int>(kind), launch);
    check_launch("box3d_nms mask_kernel");
  });
  const int64_t keep_limit = max_keep > 0 ? max_keep : n;
  if (fallback != nullptr) {
    fixed_point_kernel<<<1, kFixedThreads, 0, st>>>(lists, list_size, data_of<const int64_t>(order),
                                                    tile_kept, tile_base, data_of<int64_t>(keep),
                                                    fallback, n, keep_limit);
    check_launch("box3d_nms fixed_point_kernel");
  }
  const size_t shared = static_cast<size_t>(tiles) * sizeof(Word);
  reduce_kernel<<<1, kReduceThreads, shared, st>>>(lists, list_size, data_of<const int64_t>(order),
                                                   tile_kept, tile_base, data_of<int64_t>(keep),
                                                   fallback, n, keep_limit);
  check_launch("box3d_nms reduce_kernel");
}

// The int64 elements of the workspace box3d_nms needs for n boxes.
int64_t nms_workspace_ints(int64_t n) {
  if (n < 0 || n > kMaxBoxes) {
    TVM_FFI_THROW(ValueError) << "n must be in [0, " << kMaxBoxes << "], got " << n;
  }
  return workspace_words((n + kTile - 1) / kTile);
}

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(box3d_nms, muspace::box3d::nms);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(box3d_nms_workspace_ints, muspace::box3d::nms_workspace_ints);
