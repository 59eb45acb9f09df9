// dynamic_scatter's two primitives for MUSA and CUDA: voxel_group (the voxels of integer
// coordinates in mmcv's order, the points grouped by voxel) and segment_reduce (sum / mean / max
// of each voxel's feature rows, forward and backward). docs/operators/dynamic_scatter.md has the
// long form; in short:
//
// voxel_group, two entry points around a stable sort by the caller (torch.sort: CUB's radix sort
// under CUDA, torch_musa's under MUSA), no host sync; the caller reads the header:
//   voxel_group_keys
//   1. colmax_kernel   a row is valid when no entry is negative; per column the largest value
//                      of the valid rows (block-reduced, then one atomicMax per block), the
//                      valid rows counted; a value beyond int32 sets the overflow flag
//   2. keys_kernel     key = mixed radix of the row over dims = max + 1 per column (so sorted
//                      keys are the lexicographically sorted rows: mmcv's unique_dim order);
//                      invalid rows get the sentinel prod(dims) (larger than every key); a
//                      prod(dims) beyond the int32 keys sets the overflow flag (the caller then
//                      takes the reference path; nothing is read out of bounds meanwhile)
//   then the caller's stable sort of the keys (sorted keys + the permutation, int64)
//   voxel_group_from_sorted (the same workspace: its header holds the sentinel and K)
//   3. run flags, scan the voxel of each sorted position (run starts counted)
//   4. emit_kernel     order, point2voxel, starts, voxel_coors (the run's first row)
//   5. counts_kernel   counts[v] = starts[v + 1] - starts[v]; the header (M, K, overflow)
// The sort was our own LSD radix sort (3 passes of 11 bits over 31-bit keys: the key range is
// on the device); on the H200 (2026-12-01, 300k points) it took 125 of the grouping's 161 us.
//
// dynamic_scatter_bitmap_forward: voxel_group_bitmap, then segment_reduce_forward's kernel
// queued before the host waits for the voxel count (the kernel reads M and K on the device).
//
// segment_reduce_forward: a thread per (voxel, channel) sums (or maxes, NaN ignored) the voxel's
// rows in input order in float32 and rounds once; max optionally writes the winner row per
// (voxel, channel) (the first row holding the maximum, mmcv's tie rule; -1 when none) into an
// int32 argmax [M, C]. segment_reduce_backward: sum / mean a thread per (row, 16-byte piece)
// when C and the pointers allow (else per (row, channel)); max with the forward's argmax: the
// same per-row layout, grad[i, c] = argmax[v, c] == i ? grad_out[v, c] : 0 (every element
// written once); max without it: a zero fill, then a thread per (voxel, channel) finds the
// first row holding the maximum and gives it the gradient. No atomics, deterministic.
//
// Safety: every data-dependent index is checked (order entries against N, starts / counts
// against K, voxels against M); a bad grouping gives unspecified values, never an illegal
// access.

#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "readback.muh"
#include "vec.muh"
#include "scan.muh"
#include "voxel_grid.muh"

namespace muspace {
namespace voxel {
namespace {

using scan::exclusive_scan;
using scan::kBlock;  // threads of every kernel here
using scan::scan_tiles;

constexpr int kBlocksPerSm = 8;
constexpr int kMaxNdim = 4;
constexpr int64_t kMaxRows = int64_t{1} << 30;
MUSPACE_LIMIT(voxel_group, max_points, kMaxRows);
MUSPACE_LIMIT(segment_reduce, max_points, kMaxRows);
constexpr int64_t kMaxKeyRange = INT_MAX - 1;

// int32 header of the workspace
constexpr int kColMax = 0;  // [kMaxNdim] the largest value per column of the valid rows
constexpr int kValid = 4;   // valid rows (K)
constexpr int kOverflow = 5;
constexpr int kVoxels = 6;    // M (the scan's total)
constexpr int kSentinel = 7;  // prod(dims), as written by keys_kernel (thread 0)
constexpr int kHeaderInts = 8;

template <typename I>
__global__ void __launch_bounds__(kBlock)
    colmax_kernel(const I* __restrict__ coors, int n, int ndim, int* __restrict__ header) {
  __shared__ int s_max[kMaxNdim];
  __shared__ int s_valid;
  __shared__ int s_overflow;
  if (threadIdx.x < static_cast<unsigned>(kMaxNdim)) s_max[threadIdx.x] = 0;
  if (threadIdx.x == 0) {
    s_valid = 0;
    s_overflow = 0;
  }
  __syncthreads();
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const I* row = coors + i * ndim;
    bool valid = true;
    for (int c = 0; c < ndim; ++c) valid = valid && row[c] >= 0;
    if (!valid) continue;
    atomicAdd(&s_valid, 1);
    for (int c = 0; c < ndim; ++c) {
      const I v = row[c];
      if constexpr (sizeof(I) > sizeof(int)) {
        if (v > static_cast<I>(INT_MAX)) {
          atomicOr(&s_overflow, 1);
          continue;
        }
      }
      atomicMax(&s_max[c], static_cast<int>(v));
    }
  }
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < ndim) atomicMax(&header[kColMax + t], s_max[t]);
  if (t == 0) {
    if (s_valid) atomicAdd(&header[kValid], s_valid);
    if (s_overflow) atomicOr(&header[kOverflow], 1);
  }
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    group_keys_kernel(const I* __restrict__ coors, int n, int ndim, int* __restrict__ header,
                      uint32_t* __restrict__ keys) {
  int64_t dims[kMaxNdim];
  int64_t range = 1;
  for (int c = 0; c < ndim; ++c) {
    dims[c] = static_cast<int64_t>(header[kColMax + c]) + 1;
    range = range <= kMaxKeyRange ? range * dims[c] : range;  // dims <= 2^31: no overflow
  }
  const bool overflow = range > kMaxKeyRange || header[kOverflow] != 0;
  const uint32_t sentinel = overflow ? 0u : static_cast<uint32_t>(range);
  if (global_thread() == 0) {
    header[kSentinel] = static_cast<int>(sentinel);
    if (overflow) header[kOverflow] = 1;
  }
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const I* row = coors + i * ndim;
    bool valid = true;
    for (int c = 0; c < ndim; ++c) valid = valid && row[c] >= 0;
    uint32_t key = sentinel;  // overflow: every key is the sentinel 0 (the result is discarded)
    if (valid && !overflow) {
      int64_t k = 0;  // < range <= kMaxKeyRange: the row's values are < dims
      for (int c = 0; c < ndim; ++c) k = k * dims[c] + static_cast<int64_t>(row[c]);
      key = static_cast<uint32_t>(k);
    }
    keys[i] = key;
  }
}

__device__ __forceinline__ bool group_start(const uint32_t* keys, int p, uint32_t sentinel) {
  const uint32_t k = keys[p];
  return k != sentinel && (p == 0 || keys[p - 1] != k);
}

__global__ void __launch_bounds__(kBlock)
    run_flags_kernel(const uint32_t* __restrict__ keys, int n, const int* __restrict__ header,
                     int* __restrict__ flags) {
  const uint32_t sentinel = static_cast<uint32_t>(header[kSentinel]);
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    flags[p] = group_start(keys, static_cast<int>(p), sentinel) ? 1 : 0;
  }
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    group_emit_kernel(const I* __restrict__ coors, int n, int ndim,
                      const uint32_t* __restrict__ keys, const int64_t* __restrict__ idx,
                      const int* __restrict__ run, const int* __restrict__ header,
                      I* __restrict__ voxel_coors, int* __restrict__ order,
                      int* __restrict__ starts, int* __restrict__ point2voxel) {
  const uint32_t sentinel = static_cast<uint32_t>(header[kSentinel]);
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    const int64_t i64 = idx[p];
    if (static_cast<uint64_t>(i64) >= static_cast<uint64_t>(n)) continue;
    const int i = static_cast<int>(i64);
    if (keys[p] == sentinel) {
      point2voxel[i] = -1;
      continue;
    }
    const bool start = group_start(keys, static_cast<int>(p), sentinel);
    const int v = run[p] + (start ? 1 : 0) - 1;  // the exclusive scan counts earlier starts
    order[p] = i;
    point2voxel[i] = v;
    if (start) {
      starts[v] = static_cast<int>(p);
      for (int c = 0; c < ndim; ++c)
        voxel_coors[static_cast<int64_t>(v) * ndim + c] = coors[static_cast<int64_t>(i) * ndim + c];
    }
  }
}

__global__ void __launch_bounds__(kBlock)
    group_counts_kernel(const int* __restrict__ header, const int* __restrict__ starts, int n,
                        int* __restrict__ counts, int64_t* __restrict__ out_header) {
  const int m = header[kVoxels];
  const int k = header[kValid];
  for (int64_t v = global_thread(); v < m && v < n; v += global_threads()) {
    const int end = v + 1 < m ? starts[v + 1] : k;
    counts[v] = end - starts[v];
  }
  if (global_thread() == 0) {
    out_header[0] = m;
    out_header[1] = k;
    out_header[2] = header[kOverflow];
  }
}

// ---------------------------------------------------------------- bitmap grouping (no sort)
//
// voxel_group_bitmap: voxel_group's outputs without sorting the points (torch.sort was ~59 of
// the grouping's ~118 us of kernels at 327k points on the H200, ncu, 2026-12-01). The keys are
// the mixed-radix keys above; a voxel's index in sorted-key order is the number of occupied
// keys below its own, read from a bitmap of the key range:
//   1. colmax_kernel        (above) the column maxima, K, the int64 overflow flag
//   2. bitmap_zero_kernel   the key range = prod(max + 1); beyond the bitmap's capacity (or an
//                           overflow) the fallback flag is set and every later kernel does
//                           nothing. Zeroes the range's bitmap words, every block count and
//                           counts[0, N)
//   3. bitmap_mark_kernel   per valid row its key's bit (atomicOr, skipped when a plain read
//                           already shows the bit: CenterPoint's 327k rows set bits in only
//                           18k words); keys [N] <- the key, or ~0 for a dropped row
//   4. bitmap_count_kernel  a thread per word of the range: its popcount, the exclusive prefix
//                           inside its 32-word block (16 bit) and the block's count
//   5. scan(block counts)   -> the occupied keys before each block; the total is M
//   6. bitmap_rank_kernel   per row v = block prefix + word prefix + popcount of its word below
//                           its bit; point2voxel, the row's position among its voxel's rows
//                           (atomicAdd: any order; position 0 writes voxel_coors); a voxel of
//                           more than kBitmapMaxPointsPerVoxel rows sets the fallback flag. The
//                           header is copied to the host here.
//   7. scan(counts)         -> starts
//   8. bitmap_place_kernel  each row into its voxel's stretch of an unordered list
//   9. stable_rank_kernel   per row its rank among its voxel's rows by index (a pass over the
//                           stretch) -> order: each voxel's rows in input order.
// Only the order of the atomics depends on the schedule; every output value does not. Fallback:
// the caller runs the sort grouping (voxel_group_keys / sort / voxel_group_from_sorted).

constexpr int kFallback = 8;  // header: why the bitmap grouping cannot (1 range, 2 crowded)
constexpr int kKeyRange = 9;  // header: prod(max + 1), as bitmap_zero_kernel computed it
constexpr int kBitmapHeaderInts = 16;  // copied to the host as 8 int64 words
constexpr int kBlockKeysLog2 = 10;     // keys per block count: 32 words
constexpr int kBlockWords = 32;
constexpr int64_t kBitmapMinKeys = int64_t{1} << 24;
constexpr int64_t kBitmapMaxKeys = int64_t{1} << 30;
constexpr int64_t kBitmapKeysPerRow = 512;
MUSPACE_LIMIT(voxel_group, bitmap_max_keys, kBitmapMaxKeys);
// a row's rank pass reads its voxel's whole stretch: count^2 reads per voxel
constexpr int kBitmapMaxPointsPerVoxel = 1024;
MUSPACE_LIMIT(voxel_group, bitmap_max_points_per_voxel, kBitmapMaxPointsPerVoxel);
constexpr uint32_t kDroppedKey = 0xFFFFFFFFu;  // keys < 2^30

// The key range the caller's bitmap can hold for n rows (a multiple of the block size).
int64_t bitmap_keys(int64_t n) {
  const int64_t want = std::min(std::max(n * kBitmapKeysPerRow, kBitmapMinKeys), kBitmapMaxKeys);
  const int64_t block = int64_t{1} << kBlockKeysLog2;
  return (want + block - 1) / block * block;
}

// prod(max + 1) over the columns from the header, or -1 when it exceeds `cap` or a value
// overflowed int32.
__device__ __forceinline__ int64_t key_range(const int* header, int ndim, int64_t cap) {
  int64_t range = 1;
  for (int c = 0; c < ndim; ++c) {
    range *= static_cast<int64_t>(header[kColMax + c]) + 1;  // each factor <= 2^31: no overflow
    if (range > cap) return -1;
  }
  return header[kOverflow] != 0 ? -1 : range;
}

__global__ void __launch_bounds__(kBlock)
    bitmap_zero_kernel(int* __restrict__ header, int ndim, int64_t cap, int n,
                       uint32_t* __restrict__ bitmap, int* __restrict__ block_counts,
                       int* __restrict__ counts) {
  const int64_t range = key_range(header, ndim, cap);
  if (global_thread() == 0) {
    header[kKeyRange] = static_cast<int>(range);
    if (range < 0) header[kFallback] = 1;
  }
  if (range < 0) return;
  const int64_t words = (range + 31) >> 5;
  const int64_t blocks = cap >> kBlockKeysLog2;  // all of them: the scan reads every one
  const int64_t most = ::max(::max(words, blocks), static_cast<int64_t>(n));
  for (int64_t i = global_thread(); i < most; i += global_threads()) {
    if (i < words) bitmap[i] = 0u;
    if (i < blocks) block_counts[i] = 0;
    if (i < n) counts[i] = 0;
  }
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    bitmap_mark_kernel(const I* __restrict__ coors, int n, int ndim, const int* __restrict__ header,
                       uint32_t* __restrict__ bitmap, uint32_t* __restrict__ keys) {
  if (header[kFallback] != 0) return;
  int64_t dims[kMaxNdim];
  for (int c = 0; c < ndim; ++c) dims[c] = static_cast<int64_t>(header[kColMax + c]) + 1;
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const I* row = coors + i * ndim;
    bool valid = true;
    for (int c = 0; c < ndim; ++c) valid = valid && row[c] >= 0;
    uint32_t key = kDroppedKey;
    if (valid) {
      int64_t k = 0;  // < the key range: every value of a valid row is <= its column's max
      for (int c = 0; c < ndim; ++c) k = k * dims[c] + static_cast<int64_t>(row[c]);
      key = static_cast<uint32_t>(k);
      const uint32_t bit = 1u << (key & 31u);
      // a stale read only costs the atomic; the bit ends set either way
      if ((bitmap[key >> 5] & bit) == 0u) atomicOr(&bitmap[key >> 5], bit);
    }
    keys[i] = key;
  }
}

// A thread per word of the key range (rounded up to whole warps: the shuffles of a 32-word
// block need every lane of it).
__global__ void __launch_bounds__(kBlock)
    bitmap_count_kernel(const int* __restrict__ header, const uint32_t* __restrict__ bitmap,
                        uint16_t* __restrict__ word_prefix, int* __restrict__ block_counts) {
  static_assert(kWarpSize % kBlockWords == 0, "a block's words are lanes of one warp");
  if (header[kFallback] != 0) return;
  const int64_t words = (static_cast<int64_t>(header[kKeyRange]) + 31) >> 5;
  const int64_t lanes = (words + kWarpSize - 1) / kWarpSize * kWarpSize;
  const int sub = static_cast<int>(threadIdx.x) % kBlockWords;
  for (int64_t w = global_thread(); w < lanes; w += global_threads()) {  // warp-uniform
    const int c = w < words ? __popc(bitmap[w]) : 0;
    int inclusive = c;
#pragma unroll
    for (int d = 1; d < kBlockWords; d <<= 1) {
      const int y = __shfl_up_sync(kFullMask, inclusive, d, kBlockWords);
      if (sub >= d) inclusive += y;
    }
    if (w < words) word_prefix[w] = static_cast<uint16_t>(inclusive - c);
    if (sub == kBlockWords - 1 && w < words + kBlockWords - 1) {
      block_counts[w >> 5] = inclusive;
    }
  }
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    bitmap_rank_kernel(const I* __restrict__ coors, int n, int ndim, int* __restrict__ header,
                       const uint32_t* __restrict__ bitmap,
                       const uint16_t* __restrict__ word_prefix,
                       const int* __restrict__ block_prefix, const uint32_t* __restrict__ keys,
                       int* __restrict__ point2voxel, int* __restrict__ counts,
                       int* __restrict__ pos, I* __restrict__ voxel_coors) {
  if (header[kFallback] != 0) return;
  const int m = header[kVoxels];
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const uint32_t key = keys[i];
    if (key == kDroppedKey) {
      point2voxel[i] = -1;
      continue;
    }
    const uint32_t w = key >> 5;
    const int v = block_prefix[key >> kBlockKeysLog2] + word_prefix[w] +
                  __popc(bitmap[w] & ((1u << (key & 31u)) - 1u));
    if (v < 0 || v >= m) continue;  // never from the kernels above
    point2voxel[i] = v;
    const int at = atomicAdd(&counts[v], 1);
    pos[i] = at;
    if (at >= kBitmapMaxPointsPerVoxel) atomicOr(&header[kFallback], 2);
    if (at == 0) {  // one row per voxel writes its coordinates
      for (int c = 0; c < ndim; ++c)
        voxel_coors[static_cast<int64_t>(v) * ndim + c] = coors[i * ndim + c];
    }
  }
}

__global__ void __launch_bounds__(kBlock)
    bitmap_place_kernel(const int* __restrict__ header, int n, const int* __restrict__ point2voxel,
                        const int* __restrict__ pos, const int* __restrict__ starts,
                        int* __restrict__ list) {
  if (header[kFallback] != 0) return;
  const int m = header[kVoxels];
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int v = point2voxel[i];
    if (static_cast<unsigned>(v) >= static_cast<unsigned>(m)) continue;
    const int at = starts[v] + pos[i];
    if (static_cast<unsigned>(at) < static_cast<unsigned>(n)) list[at] = static_cast<int>(i);
  }
}

// Row i's place in order: its voxel's start + the number of the voxel's rows below i (rows are
// distinct, so the places are a permutation of the stretch).
__global__ void __launch_bounds__(kBlock)
    stable_rank_kernel(const int* __restrict__ header, int n, const int* __restrict__ point2voxel,
                       const int* __restrict__ starts, const int* __restrict__ counts,
                       const int* __restrict__ list, int* __restrict__ order) {
  if (header[kFallback] != 0) return;
  const int m = header[kVoxels];
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int v = point2voxel[i];
    if (static_cast<unsigned>(v) >= static_cast<unsigned>(m)) continue;
    const int s = starts[v];
    const int cnt = counts[v];
    if (s < 0 || cnt < 1 || cnt > kBitmapMaxPointsPerVoxel || s > n - cnt) continue;
    int r = 0;
    for (int j = 0; cnt > 1 && j < cnt; ++j) r += list[s + j] < static_cast<int>(i) ? 1 : 0;
    order[s + r] = static_cast<int>(i);
  }
}

// ----------------------------------------------------------------------------- segment reduce

constexpr int kSum = 0, kMean = 1, kMax = 2;

__device__ __forceinline__ float negative_infinity() { return -__int_as_float(0x7f800000); }

// M and K from the bitmap grouping's header, for a reduction queued before the host knows them
// (kSizesOnDevice: dynamic_scatter_bitmap_forward): at most the outputs' capacity m, k; false
// (nothing to do) when the grouping handed back to the sort. A template flag, so the kernels of
// segment_reduce_forward are the ones measured before (a runtime pointer cost the 16-bit
// 16-byte kernel a 16-byte spill, ptxas sm_90a).
template <bool kSizesOnDevice>
__device__ __forceinline__ bool group_sizes(const int* group_header, int& m, int& k) {
  if constexpr (!kSizesOnDevice) return true;
  if (group_header[kFallback] != 0) return false;
  m = min(max(group_header[kVoxels], 0), m);
  k = min(max(group_header[kValid], 0), k);
  return true;
}

// The voxel's valid range [s, e) of order (clamped to [0, k)).
__device__ __forceinline__ void voxel_range(const int* starts, const int* counts, int v, int k,
                                            int& s, int& e) {
  s = min(max(starts[v], 0), k);
  const int c = max(counts[v], 0);
  e = static_cast<int>(min(static_cast<int64_t>(s) + c, static_cast<int64_t>(k)));
}

template <typename T, bool kSizesOnDevice>
__global__ void __launch_bounds__(kBlock)
    segment_reduce_kernel(const T* __restrict__ feats, int n, int channels,
                          const int* __restrict__ order, int k, const int* __restrict__ starts,
                          const int* __restrict__ counts, int m, int reduce, T* __restrict__ out,
                          int* __restrict__ argmax, const int* __restrict__ group_header) {
  if (channels <= 0 || !group_sizes<kSizesOnDevice>(group_header, m, k)) return;
  const int64_t total = static_cast<int64_t>(m) * channels;
  RowCol rc(global_thread(), global_threads(), channels);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int v = static_cast<int>(rc.row);
    const int c = rc.col;
    int s, end;
    voxel_range(starts, counts, v, k, s, end);
    float acc = reduce == kMax ? negative_infinity() : 0.0f;
    int arg = -1;
    for (int j = s; j < end; ++j) {
      const int i = order[j];
      if (static_cast<unsigned>(i) >= static_cast<unsigned>(n)) continue;
      const float x = to_float(feats[static_cast<int64_t>(i) * channels + c]);
      if (reduce == kMax && kSizesOnDevice) {
        // no argmax (dynamic_scatter_bitmap_forward): a strict > keeps the first row holding the
        // maximum too (the same bits, +-0 and -inf included) without tracking the row
        if (x > acc) acc = x;
      } else if (reduce == kMax) {
        // NaN never wins (mmcv's fmaxf); the first row holding the maximum is the winner, as in
        // segment_grad_max_kernel (a -inf row counts)
        if (x > acc || (arg < 0 && x == acc)) {
          acc = x;
          arg = i;
        }
      } else {
        acc += x;
      }
    }
    if (reduce == kMean) acc = acc / static_cast<float>(max(counts[v], 1));
    out[e] = from_float<T>(acc);
    if (argmax != nullptr) argmax[e] = arg;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_grad_rows_kernel(const T* __restrict__ grad_out, int n, int channels,
                             const int* __restrict__ counts, const int* __restrict__ point2voxel,
                             int m, int reduce, T* __restrict__ grad) {
  const int64_t total = static_cast<int64_t>(n) * channels;
  if (channels <= 0) return;
  RowCol rc(global_thread(), global_threads(), channels);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int i = static_cast<int>(rc.row);
    const int c = rc.col;
    const int v = point2voxel[i];
    float g = 0.0f;
    if (static_cast<unsigned>(v) < static_cast<unsigned>(m)) {
      g = to_float(grad_out[static_cast<int64_t>(v) * channels + c]);
      if (reduce == kMean) g = g / static_cast<float>(max(counts[v], 1));
    }
    grad[e] = from_float<T>(g);
  }
}

// Elements of T in one 16-byte piece.
template <typename T>
constexpr int kPiece = 16 / static_cast<int>(sizeof(T));

// segment_reduce_kernel on 16-byte pieces (channels % kPiece<T> == 0; feats, out and argmax
// 16-byte aligned): a thread per (voxel, piece), the same float32 arithmetic per element in the
// same row order. A thread per (voxel, channel) issued a 4-byte load per row and channel and
// read at 35 % of DRAM throughput at C = 64 (ncu, H200, 2026-12-01).
template <typename T, bool kSizesOnDevice>
__global__ void __launch_bounds__(kBlock)
    segment_reduce_vec_kernel(const T* __restrict__ feats, int n, int channels,
                              const int* __restrict__ order, int k, const int* __restrict__ starts,
                              const int* __restrict__ counts, int m, int reduce,
                              T* __restrict__ out, int* __restrict__ argmax,
                              const int* __restrict__ group_header) {
  constexpr int kVec = kPiece<T>;
  const int pieces = channels / kVec;
  if (pieces <= 0 || !group_sizes<kSizesOnDevice>(group_header, m, k)) return;
  const int64_t total = static_cast<int64_t>(m) * pieces;
  RowCol rc(global_thread(), global_threads(), pieces);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int v = static_cast<int>(rc.row);
    const int c0 = rc.col * kVec;
    int s, end;
    voxel_range(starts, counts, v, k, s, end);
    float acc[kVec];
    int arg[kVec];
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      acc[u] = reduce == kMax ? negative_infinity() : 0.0f;
      arg[u] = -1;
    }
    for (int j = s; j < end; ++j) {
      const int i = order[j];
      if (static_cast<unsigned>(i) >= static_cast<unsigned>(n)) continue;
      float x[kVec];
      load_floats<T, kVec>(feats + static_cast<int64_t>(i) * channels + c0, x);
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        if (reduce == kMax && kSizesOnDevice) {
          if (x[u] > acc[u]) acc[u] = x[u];  // no argmax: as segment_reduce_kernel
        } else if (reduce == kMax) {
          if (x[u] > acc[u] || (arg[u] < 0 && x[u] == acc[u])) {  // as segment_reduce_kernel
            acc[u] = x[u];
            arg[u] = i;
          }
        } else {
          acc[u] += x[u];
        }
      }
    }
    if (reduce == kMean) {
      const float d = static_cast<float>(max(counts[v], 1));
#pragma unroll
      for (int u = 0; u < kVec; ++u) acc[u] = acc[u] / d;
    }
    const int64_t at = static_cast<int64_t>(v) * channels + c0;
    store_floats<T, kVec>(out + at, acc);
    if (argmax != nullptr) {
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q) {
        reinterpret_cast<int4*>(argmax + at)[q] =
            make_int4(arg[4 * q], arg[4 * q + 1], arg[4 * q + 2], arg[4 * q + 3]);
      }
    }
  }
}

// segment_grad_rows_kernel on 16-byte pieces (channels % kPiece<T> == 0, grad_out and grad
// 16-byte aligned): consecutive threads take consecutive pieces, one point2voxel / counts load
// per piece; the same float32 arithmetic per element.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_grad_rows_vec_kernel(const T* __restrict__ grad_out, int n, int channels,
                                 const int* __restrict__ counts,
                                 const int* __restrict__ point2voxel, int m, int reduce,
                                 T* __restrict__ grad) {
  constexpr int kVec = kPiece<T>;
  const int pieces = channels / kVec;
  const int64_t total = static_cast<int64_t>(n) * pieces;
  if (pieces <= 0) return;
  RowCol rc(global_thread(), global_threads(), pieces);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int i = static_cast<int>(rc.row);
    const int c0 = rc.col * kVec;
    const int v = point2voxel[i];
    float g[kVec];
    if (static_cast<unsigned>(v) < static_cast<unsigned>(m)) {
      load_floats<T, kVec>(grad_out + static_cast<int64_t>(v) * channels + c0, g);
      if (reduce == kMean) {
        const float d = static_cast<float>(max(counts[v], 1));
#pragma unroll
        for (int u = 0; u < kVec; ++u) g[u] = g[u] / d;
      }
    } else {
#pragma unroll
      for (int u = 0; u < kVec; ++u) g[u] = 0.0f;
    }
    store_floats<T, kVec>(grad + static_cast<int64_t>(i) * channels + c0, g);
  }
}

// Max backward from the forward's argmax [M, C]: grad[i, c] = grad_out[v, c] when argmax[v, c]
// is i (v = point2voxel[i]), else 0; every element of grad written once (no fill). argmax is
// only compared, never used as an index. Raw bits are copied, as segment_grad_max_kernel does.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_grad_argmax_kernel(const T* __restrict__ grad_out, int n, int channels,
                               const int* __restrict__ point2voxel, const int* __restrict__ argmax,
                               int m, T* __restrict__ grad) {
  const int64_t total = static_cast<int64_t>(n) * channels;
  if (channels <= 0) return;
  RowCol rc(global_thread(), global_threads(), channels);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int i = static_cast<int>(rc.row);
    const int v = point2voxel[i];
    T g = from_float<T>(0.0f);
    if (static_cast<unsigned>(v) < static_cast<unsigned>(m)) {
      const int64_t at = static_cast<int64_t>(v) * channels + rc.col;
      if (argmax[at] == i) g = grad_out[at];
    }
    grad[e] = g;
  }
}

// The same on 16-byte pieces (channels % kPiece<T> == 0; grad_out, argmax, grad 16-byte
// aligned); grad_out is loaded only when a channel of the piece is won by the row.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_grad_argmax_vec_kernel(const T* __restrict__ grad_out, int n, int channels,
                                   const int* __restrict__ point2voxel,
                                   const int* __restrict__ argmax, int m, T* __restrict__ grad) {
  constexpr int kVec = kPiece<T>;
  using V = Vec<T, kVec>;
  const int pieces = channels / kVec;
  const int64_t total = static_cast<int64_t>(n) * pieces;
  if (pieces <= 0) return;
  RowCol rc(global_thread(), global_threads(), pieces);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int i = static_cast<int>(rc.row);
    const int c0 = rc.col * kVec;
    const int v = point2voxel[i];
    V out = V::zero();
    if (static_cast<unsigned>(v) < static_cast<unsigned>(m)) {
      const int64_t at = static_cast<int64_t>(v) * channels + c0;
      const uint32_t row = static_cast<uint32_t>(i);
      bool hit[kVec];
      bool any = false;
#pragma unroll
      for (int q = 0; q < kVec / 4; ++q) {
        const uint4 a = reinterpret_cast<const uint4*>(argmax + at)[q];
        hit[4 * q + 0] = a.x == row;
        hit[4 * q + 1] = a.y == row;
        hit[4 * q + 2] = a.z == row;
        hit[4 * q + 3] = a.w == row;
      }
#pragma unroll
      for (int u = 0; u < kVec; ++u) any = any || hit[u];
      if (any) {
        const V g = V::load(grad_out + at);
#pragma unroll
        for (int k = 0; k < V::kWords; ++k) {
          uint32_t keep;
          if constexpr (V::kPerWord == 1) {
            keep = hit[k] ? 0xffffffffu : 0u;
          } else {  // two 16-bit elements per word, element 2k in the low half
            keep = (hit[2 * k] ? 0x0000ffffu : 0u) | (hit[2 * k + 1] ? 0xffff0000u : 0u);
          }
          out.w[k] = g.w[k] & keep;
        }
      }
    }
    out.store(grad + static_cast<int64_t>(i) * channels + c0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    segment_grad_max_kernel(const T* __restrict__ grad_out, const T* __restrict__ feats, int n,
                            int channels, const int* __restrict__ order, int k,
                            const int* __restrict__ starts, const int* __restrict__ counts, int m,
                            T* __restrict__ grad) {
  const int64_t total = static_cast<int64_t>(m) * channels;
  if (channels <= 0) return;
  RowCol rc(global_thread(), global_threads(), channels);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int v = static_cast<int>(rc.row);
    const int c = rc.col;
    int s, end;
    voxel_range(starts, counts, v, k, s, end);
    float best = negative_infinity();
    int arg = -1;
    for (int j = s; j < end; ++j) {
      const int i = order[j];
      if (static_cast<unsigned>(i) >= static_cast<unsigned>(n)) continue;
      const float x = to_float(feats[static_cast<int64_t>(i) * channels + c]);
      // the first row holding the maximum (order is ascending inside a voxel); -inf rows count
      if (x > best || (arg < 0 && x == best)) {
        best = x;
        arg = i;
      }
    }
    if (arg >= 0) grad[static_cast<int64_t>(arg) * channels + c] = grad_out[e];
  }
}

// ------------------------------------------------------------------------------ host helpers

int blocks_for(int64_t n_threads, int device_id) {
  return grid_for(n_threads, kBlock, device_id, kBlocksPerSm);
}

struct GroupLayout {
  int64_t header, run, sums, ints;
};

int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

GroupLayout group_layout(int64_t n) {
  GroupLayout l;
  int64_t off = 0;
  auto take = [&](int64_t k) {
    const int64_t at = off;
    off += round4(std::max<int64_t>(k, 1));
    return at;
  };
  l.header = take(kHeaderInts);
  l.run = take(n);
  l.sums = take(scan_tiles(n) + 1);
  l.ints = off;
  return l;
}

// ------------------------------------------------------------------------------ entry points

int64_t group_workspace_ints(int64_t n) {
  if (n < 0 || n > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "voxel_group_workspace_ints: n = " << n << " out of range";
  }
  return group_layout(n).ints;
}

// The checks of coors (both entry points) -> n; ndim in [1, kMaxNdim].
int64_t check_group_coors(const TensorView& coors) {
  check_gpu_tensor(coors, "coors");
  check_index_input(coors, "coors", coors);
  check_ndim(coors, "coors", 2);
  const int64_t n = coors.size(0);
  const int64_t ndim = coors.size(1);
  if (ndim < 1 || ndim > kMaxNdim) {
    TVM_FFI_THROW(ValueError) << "coors must have 1 to " << kMaxNdim << " columns, got " << ndim;
  }
  if (n > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "coors has " << n << " rows; at most " << kMaxRows;
  }
  return n;
}

GroupLayout check_group_workspace(const TensorView& workspace, const TensorView& coors, int64_t n) {
  const GroupLayout l = group_layout(n);
  check_input(workspace, "workspace", coors, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < l.ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << l.ints << " int32 (from "
                              << "voxel_group_workspace_ints), got " << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);
  return l;
}

// keys [N] int32 <- each row's key (the sentinel for rows with a negative entry); the workspace
// header <- column maxima, K, the sentinel, the overflow flag (read by voxel_group_from_sorted).
void group_keys(TensorView coors, TensorView workspace, TensorView keys, int64_t stream) {
  const int64_t n = check_group_coors(coors);
  check_vector(keys, "keys", coors, kInt32, n);
  const GroupLayout l = check_group_workspace(workspace, coors, n);
  const int device_id = coors.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* head = data_of<int>(workspace) + l.header;
  launch_zero(head, kHeaderInts * 4, device_id, st, "voxel_group fill (header)");
  if (n == 0) return;
  const int ni = static_cast<int>(n);
  const int nd = static_cast<int>(coors.size(1));
  // keys < 2^31 (kMaxKeyRange): the same order as int32 and as uint32
  uint32_t* out = reinterpret_cast<uint32_t*>(data_of<int>(keys));
  dispatch_index(coors, "coors", [&](auto tag) {
    using I = decltype(tag);
    colmax_kernel<I>
        <<<blocks_for(n, device_id), kBlock, 0, st>>>(data_of<const I>(coors), ni, nd, head);
    check_launch("voxel_group colmax_kernel");
    group_keys_kernel<I>
        <<<blocks_for(n, device_id), kBlock, 0, st>>>(data_of<const I>(coors), ni, nd, head, out);
    check_launch("voxel_group keys_kernel");
  });
}

// From voxel_group_keys' keys stably sorted (sorted_keys [N] int32, perm [N] int64: position p
// holds row perm[p]) and its workspace: all outputs have N entries (upper bounds); the header
// [3] int64 gets (M voxels, K kept rows, overflow): the first M / K entries of voxel_coors,
// starts, counts / order are the result. A perm entry outside [0, N) is skipped.
void group_from_sorted(TensorView coors, TensorView workspace, TensorView sorted_keys,
                       TensorView perm, TensorView voxel_coors, TensorView order, TensorView starts,
                       TensorView counts, TensorView point2voxel, TensorView header,
                       int64_t stream) {
  const int64_t n = check_group_coors(coors);
  const int64_t ndim = coors.size(1);
  check_vector(sorted_keys, "sorted_keys", coors, kInt32, n);
  check_vector(perm, "perm", coors, kInt64, n);
  check_input(voxel_coors, "voxel_coors", coors, coors.dtype());
  check_ndim(voxel_coors, "voxel_coors", 2);
  check_size(voxel_coors, "voxel_coors", 0, n);
  check_size(voxel_coors, "voxel_coors", 1, ndim);
  check_vector(order, "order", coors, kInt32, n);
  check_vector(starts, "starts", coors, kInt32, n);
  check_vector(counts, "counts", coors, kInt32, n);
  check_vector(point2voxel, "point2voxel", coors, kInt32, n);
  check_vector(header, "header", coors, kInt64, 3);
  const GroupLayout l = check_group_workspace(workspace, coors, n);
  const int device_id = coors.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (n == 0) {
    launch_zero(data_of(header), 3 * 8, device_id, st, "voxel_group fill (header out)");
    return;
  }
  int* ws = data_of<int>(workspace);
  int* head = ws + l.header;
  const int ni = static_cast<int>(n);
  const int nd = static_cast<int>(ndim);
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(data_of<const int>(sorted_keys));
  int* run = ws + l.run;
  run_flags_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(keys, ni, head, run);
  check_launch("voxel_group run_flags_kernel");
  exclusive_scan(run, run, n, ws + l.sums, head + kVoxels, st, "voxel_group run scan");
  dispatch_index(coors, "coors", [&](auto tag) {
    using I = decltype(tag);
    group_emit_kernel<I><<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const I>(coors), ni, nd, keys, data_of<const int64_t>(perm), run, head,
        data_of<I>(voxel_coors), data_of<int>(order), data_of<int>(starts),
        data_of<int>(point2voxel));
    check_launch("voxel_group emit_kernel");
  });
  group_counts_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
      head, data_of<const int>(starts), ni, data_of<int>(counts), data_of<int64_t>(header));
  check_launch("voxel_group counts_kernel");
}

struct BitmapLayout {
  int64_t keys_cap, header, bitmap, word_prefix, blocks, block_sums, keys, pos, list, sums, ints;
};

BitmapLayout bitmap_layout(int64_t n) {
  BitmapLayout l;
  l.keys_cap = bitmap_keys(n);
  const int64_t words = l.keys_cap / 32;
  const int64_t blocks = l.keys_cap >> kBlockKeysLog2;
  int64_t off = 0;
  auto take = [&](int64_t k) {
    const int64_t at = off;
    off += round4(std::max<int64_t>(k, 1));
    return at;
  };
  l.header = take(kBitmapHeaderInts);
  l.bitmap = take(words);
  l.word_prefix = take((words + 1) / 2);  // uint16 each
  l.blocks = take(blocks);
  l.block_sums = take(scan_tiles(blocks, scan::kFineScanItems) + 1);
  l.keys = take(n);
  l.pos = take(n);
  l.list = take(n);
  l.sums = take(scan_tiles(n, scan::kFineScanItems) + 1);
  l.ints = off;
  return l;
}

int64_t bitmap_workspace_ints(int64_t n) {
  if (n < 0 || n > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "voxel_group_bitmap_workspace_ints: n = " << n << " out of range";
  }
  return bitmap_layout(n).ints;
}

// The checks of voxel_group_bitmap's outputs (each with N entries: upper bounds) and
// workspace -> the workspace layout.
BitmapLayout check_bitmap_group(const TensorView& coors, int64_t n, const TensorView& workspace,
                                const TensorView& voxel_coors, const TensorView& order,
                                const TensorView& starts, const TensorView& counts,
                                const TensorView& point2voxel) {
  const int64_t ndim = coors.size(1);
  check_input(voxel_coors, "voxel_coors", coors, coors.dtype());
  check_ndim(voxel_coors, "voxel_coors", 2);
  check_size(voxel_coors, "voxel_coors", 0, n);
  check_size(voxel_coors, "voxel_coors", 1, ndim);
  check_vector(order, "order", coors, kInt32, n);
  check_vector(starts, "starts", coors, kInt32, n);
  check_vector(counts, "counts", coors, kInt32, n);
  check_vector(point2voxel, "point2voxel", coors, kInt32, n);
  const BitmapLayout l = bitmap_layout(n);
  check_input(workspace, "workspace", coors, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < l.ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << l.ints << " int32 (from "
                              << "voxel_group_bitmap_workspace_ints), got " << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);
  return l;
}

// Queues the bitmap grouping's kernels (n > 0) and the copy of its header to the host, which is
// started after the rank kernel (M, K and the fallback flag are final there) while the place and
// order kernels still run. Finish with finish_bitmap_group.
Readback launch_bitmap_group(const TensorView& coors, int64_t n, const BitmapLayout& l, int* ws,
                             const TensorView& voxel_coors, const TensorView& order,
                             const TensorView& starts, const TensorView& counts,
                             const TensorView& point2voxel, int device_id, gpuStream_t st) {
  int* head = ws + l.header;
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(ws + l.bitmap);
  uint32_t* keys = reinterpret_cast<uint32_t*>(ws + l.keys);
  int* blocks = ws + l.blocks;
  const int64_t n_blocks = l.keys_cap >> kBlockKeysLog2;
  const int ni = static_cast<int>(n);
  const int nd = static_cast<int>(coors.size(1));
  const int grid = blocks_for(n, device_id);
  launch_zero(head, kBitmapHeaderInts * 4, device_id, st, "voxel_group fill (bitmap header)");
  uint16_t* word_prefix = reinterpret_cast<uint16_t*>(ws + l.word_prefix);
  dispatch_index(coors, "coors", [&](auto tag) {
    using I = decltype(tag);
    const I* rows = data_of<const I>(coors);
    colmax_kernel<I><<<grid, kBlock, 0, st>>>(rows, ni, nd, head);
    check_launch("voxel_group colmax_kernel");
    const int64_t zero_items = std::max(std::max(l.keys_cap / 32, n_blocks), n);
    bitmap_zero_kernel<<<blocks_for(zero_items, device_id), kBlock, 0, st>>>(
        head, nd, l.keys_cap, ni, bitmap, blocks, data_of<int>(counts));
    check_launch("voxel_group bitmap_zero_kernel");
    bitmap_mark_kernel<I><<<grid, kBlock, 0, st>>>(rows, ni, nd, head, bitmap, keys);
    check_launch("voxel_group bitmap_mark_kernel");
    bitmap_count_kernel<<<blocks_for(l.keys_cap / 32, device_id), kBlock, 0, st>>>(
        head, bitmap, word_prefix, blocks);
    check_launch("voxel_group bitmap_count_kernel");
    exclusive_scan<scan::kFineScanItems>(blocks, blocks, n_blocks, ws + l.block_sums,
                                         head + kVoxels, st, "voxel_group block scan");
    bitmap_rank_kernel<I><<<grid, kBlock, 0, st>>>(
        rows, ni, nd, head, bitmap, word_prefix, blocks, keys, data_of<int>(point2voxel),
        data_of<int>(counts), ws + l.pos, data_of<I>(voxel_coors));
    check_launch("voxel_group bitmap_rank_kernel");
  });
  const Readback header =
      start_readback(reinterpret_cast<const int64_t*>(head), kBitmapHeaderInts / 2, device_id, st);
  exclusive_scan<scan::kFineScanItems>(data_of<int>(counts), data_of<int>(starts), n, ws + l.sums,
                                       nullptr, st, "voxel_group count scan");
  bitmap_place_kernel<<<grid, kBlock, 0, st>>>(head, ni, data_of<const int>(point2voxel),
                                               ws + l.pos, data_of<const int>(starts), ws + l.list);
  check_launch("voxel_group bitmap_place_kernel");
  stable_rank_kernel<<<grid, kBlock, 0, st>>>(
      head, ni, data_of<const int>(point2voxel), data_of<const int>(starts),
      data_of<const int>(counts), ws + l.list, data_of<int>(order));
  check_launch("voxel_group stable_rank_kernel");
  return header;
}

// Waits for the header (the one host synchronisation) -> m + k * 2^31, or -1 for the fallback.
int64_t finish_bitmap_group(const Readback& header) {
  const int* h = reinterpret_cast<const int*>(finish_readback(header));
  if (h[kFallback] != 0) return -1;
  return static_cast<int64_t>(h[kVoxels]) + (static_cast<int64_t>(h[kValid]) << 31);
}

// voxel_group's outputs (each with N entries: upper bounds) from the bitmap grouping above.
// Returns m + k * 2^31 (M voxels, K kept rows, both < 2^30: the first M / K entries of
// voxel_coors, starts, counts / order are the result), or -1 when the bitmap grouping cannot
// (the key range beyond the workspace's bitmap, an int64 value beyond int32, a voxel of more
// than kBitmapMaxPointsPerVoxel rows): the caller then runs the sort grouping. The one host
// synchronisation: the header, copied after the rank kernel while the rest runs.
int64_t group_bitmap(TensorView coors, TensorView workspace, TensorView voxel_coors,
                     TensorView order, TensorView starts, TensorView counts, TensorView point2voxel,
                     int64_t stream) {
  const int64_t n = check_group_coors(coors);
  const BitmapLayout l =
      check_bitmap_group(coors, n, workspace, voxel_coors, order, starts, counts, point2voxel);
  const int device_id = coors.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (n == 0) return 0;
  const Readback header = launch_bitmap_group(coors, n, l, data_of<int>(workspace), voxel_coors,
                                              order, starts, counts, point2voxel, device_id, st);
  return finish_bitmap_group(header);
}

struct Grouping {
  int64_t n, channels, k, m;
};

Grouping check_grouping(const TensorView& feats, const char* feats_name, const TensorView& order,
                        const TensorView& starts, const TensorView& counts) {
  check_gpu_tensor(feats, feats_name);
  check_float_dtype(feats, feats_name);
  check_contiguous(feats, feats_name);
  check_ndim(feats, feats_name, 2);
  Grouping g;
  g.n = feats.size(0);
  g.channels = feats.size(1);
  if (g.n > kMaxRows) {
    TVM_FFI_THROW(ValueError) << feats_name << " has " << g.n << " rows; at most " << kMaxRows;
  }
  check_input(order, "order", feats, kInt32);
  check_ndim(order, "order", 1);
  g.k = order.size(0);
  check_input(starts, "starts", feats, kInt32);
  check_ndim(starts, "starts", 1);
  g.m = starts.size(0);
  check_vector(counts, "counts", feats, kInt32, g.m);
  if (g.k > kMaxRows || g.m > kMaxRows) {
    TVM_FFI_THROW(ValueError) << "order / starts hold more than " << kMaxRows << " entries";
  }
  return g;
}

int reduce_code(int64_t reduce) {
  if (reduce != kSum && reduce != kMean && reduce != kMax) {
    TVM_FFI_THROW(ValueError) << "reduce_type must be 0 (sum), 1 (mean) or 2 (max), got " << reduce;
  }
  return static_cast<int>(reduce);
}

// argmax [M, C] int32 (optional, max only): where given, checked as the forward's winners.
void check_argmax(const Optional<TensorView>& argmax, const TensorView& feats, const Grouping& g,
                  int r) {
  if (!argmax.has_value()) return;
  if (r != kMax) TVM_FFI_THROW(ValueError) << "argmax is only used with reduce_type 2 (max)";
  check_input(*argmax, "argmax", feats, kInt32);
  check_ndim(*argmax, "argmax", 2);
  check_size(*argmax, "argmax", 0, g.m);
  check_size(*argmax, "argmax", 1, g.channels);
}

// segment_reduce's forward kernel over g (its m: out's rows, its k: order's length): the 16-byte
// kernel where C and the pointers allow, else one thread per element. kSizesOnDevice: M and K
// (at most g.m, g.k) are read from the bitmap grouping's header group_header on the device;
// else g.m and g.k are the sizes (group_header unused).
template <bool kSizesOnDevice>
void launch_reduce_forward(const TensorView& feats, const TensorView& order,
                           const TensorView& starts, const TensorView& counts, const Grouping& g,
                           int r, const TensorView& out, const Optional<TensorView>& argmax,
                           const int* group_header, int device_id, gpuStream_t st) {
  const int ni = static_cast<int>(g.n);
  const int nc = static_cast<int>(g.channels);
  const int nk = static_cast<int>(g.k);
  const int nm = static_cast<int>(g.m);
  dispatch_float(feats, "feats", [&](auto tag) {
    using T = decltype(tag);
    if (g.channels % kPiece<T> == 0 && is_aligned(feats, 16) && is_aligned(out, 16) &&
        (!argmax.has_value() || is_aligned(*argmax, 16))) {
      const int64_t pieces = g.m * (g.channels / kPiece<T>);
      segment_reduce_vec_kernel<T, kSizesOnDevice>
          <<<blocks_for(pieces, device_id), kBlock, 0, st>>>(
              data_of<const T>(feats), ni, nc, data_of<const int>(order), nk,
              data_of<const int>(starts), data_of<const int>(counts), nm, r, data_of<T>(out),
              data_of<int>(argmax), group_header);
      check_launch("segment_reduce_vec_kernel");
      return;
    }
    segment_reduce_kernel<T, kSizesOnDevice>
        <<<blocks_for(g.m * g.channels, device_id), kBlock, 0, st>>>(
            data_of<const T>(feats), ni, nc, data_of<const int>(order), nk,
            data_of<const int>(starts), data_of<const int>(counts), nm, r, data_of<T>(out),
            data_of<int>(argmax), group_header);
    check_launch("segment_reduce_kernel");
  });
}

// argmax (optional, max only) <- the first row of order holding each maximum, -1 when none.
void reduce_forward(TensorView feats, TensorView order, TensorView starts, TensorView counts,
                    TensorView out, Optional<TensorView> argmax, int64_t reduce, int64_t stream) {
  const Grouping g = check_grouping(feats, "feats", order, starts, counts);
  const int r = reduce_code(reduce);
  check_like(out, "out", feats, "feats");
  check_ndim(out, "out", 2);
  check_size(out, "out", 0, g.m);
  check_size(out, "out", 1, g.channels);
  check_argmax(argmax, feats, g, r);
  if (out.numel() == 0) return;
  const int device_id = feats.device().device_id;
  DeviceGuard guard(device_id);
  launch_reduce_forward<false>(feats, order, starts, counts, g, r, out, argmax, nullptr, device_id,
                               as_stream(stream));
}

// dynamic_scatter's forward in one call: voxel_group_bitmap's grouping (its arguments and
// return value), then segment_reduce_forward's kernel into out [N, C] (upper bound: the first M
// rows are the result), queued before the host waits for the voxel count: the kernel reads M
// and K from the grouping's header, so the reduction runs while the count comes back instead of
// after the host has read it and called segment_reduce_forward. No argmax (the caller takes
// this path for calls that need no gradient). -1 (the bitmap grouping hands back to the sort):
// out is untouched; the caller runs the sort grouping and segment_reduce_forward.
int64_t scatter_bitmap_forward(TensorView coors, TensorView workspace, TensorView voxel_coors,
                               TensorView order, TensorView starts, TensorView counts,
                               TensorView point2voxel, TensorView feats, TensorView out,
                               int64_t reduce, int64_t stream) {
  const int64_t n = check_group_coors(coors);
  const BitmapLayout l =
      check_bitmap_group(coors, n, workspace, voxel_coors, order, starts, counts, point2voxel);
  const Grouping g = check_grouping(feats, "feats", order, starts, counts);  // m = k = n: caps
  check_device(feats, "feats", coors);
  check_size(feats, "feats", 0, n);
  const int r = reduce_code(reduce);
  check_like(out, "out", feats, "feats");
  check_ndim(out, "out", 2);
  check_size(out, "out", 0, n);
  check_size(out, "out", 1, g.channels);
  const int device_id = coors.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (n == 0) return 0;
  int* ws = data_of<int>(workspace);
  const Readback header = launch_bitmap_group(coors, n, l, ws, voxel_coors, order, starts, counts,
                                              point2voxel, device_id, st);
  if (out.numel() != 0) {
    launch_reduce_forward<true>(feats, order, starts, counts, g, r, out, Optional<TensorView>(),
                                ws + l.header, device_id, st);
  }
  return finish_bitmap_group(header);
}

// argmax (optional, max only): the forward's winners; without it the max backward walks the
// voxels again (a zero fill, then segment_grad_max_kernel).
void reduce_backward(TensorView grad_out, TensorView feats, TensorView order, TensorView starts,
                     TensorView counts, TensorView point2voxel, Optional<TensorView> argmax,
                     TensorView grad, int64_t reduce, int64_t stream) {
  const Grouping g = check_grouping(feats, "feats", order, starts, counts);
  const int r = reduce_code(reduce);
  check_like(grad_out, "grad_out", feats, "feats");
  check_ndim(grad_out, "grad_out", 2);
  check_size(grad_out, "grad_out", 0, g.m);
  check_size(grad_out, "grad_out", 1, g.channels);
  check_vector(point2voxel, "point2voxel", feats, kInt32, g.n);
  check_like(grad, "grad", feats, "feats");
  check_same_shape(grad, "grad", feats, "feats");
  check_argmax(argmax, feats, g, r);
  if (grad.numel() == 0) return;
  const int device_id = feats.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const int ni = static_cast<int>(g.n);
  const int nc = static_cast<int>(g.channels);
  const int nm = static_cast<int>(g.m);
  dispatch_float(feats, "feats", [&](auto tag) {
    using T = decltype(tag);
    // 16-byte pieces: every row starts 16-byte aligned when the base pointers are
    const bool vec = g.channels % kPiece<T> == 0 && is_aligned(grad_out, 16) &&
                     is_aligned(grad, 16) && (!argmax.has_value() || is_aligned(*argmax, 16));
    const int64_t pieces = g.n * (g.channels / kPiece<T>);
    if (r != kMax && vec) {
      segment_grad_rows_vec_kernel<T><<<blocks_for(pieces, device_id), kBlock, 0, st>>>(
          data_of<const T>(grad_out), ni, nc, data_of<const int>(counts),
          data_of<const int>(point2voxel), nm, r, data_of<T>(grad));
      check_launch("segment_grad_rows_vec_kernel");
      return;
    }
    if (argmax.has_value()) {
      if (vec) {
        segment_grad_argmax_vec_kernel<T><<<blocks_for(pieces, device_id), kBlock, 0, st>>>(
            data_of<const T>(grad_out), ni, nc, data_of<const int>(point2voxel),
            data_of<const int>(*argmax), nm, data_of<T>(grad));
        check_launch("segment_grad_argmax_vec_kernel");
      } else {
        segment_grad_argmax_kernel<T><<<blocks_for(g.n * g.channels, device_id), kBlock, 0, st>>>(
            data_of<const T>(grad_out), ni, nc, data_of<const int>(point2voxel),
            data_of<const int>(*argmax), nm, data_of<T>(grad));
        check_launch("segment_grad_argmax_kernel");
      }
      return;
    }
    if (r != kMax) {
      segment_grad_rows_kernel<T><<<blocks_for(g.n * g.channels, device_id), kBlock, 0, st>>>(
          data_of<const T>(grad_out), static_cast<int>(g.n), static_cast<int>(g.channels),
          data_of<const int>(counts), data_of<const int>(point2voxel), static_cast<int>(g.m), r,
          data_of<T>(grad));
      check_launch("segment_grad_rows_kernel");
      return;
    }
    launch_zero(data_of(grad), grad.numel() * element_bytes(grad), device_id, st,
                "segment_reduce fill (grad)");
    if (g.m * g.channels == 0) return;
    segment_grad_max_kernel<T><<<blocks_for(g.m * g.channels, device_id), kBlock, 0, st>>>(
        data_of<const T>(grad_out), data_of<const T>(feats), static_cast<int>(g.n),
        static_cast<int>(g.channels), data_of<const int>(order), static_cast<int>(g.k),
        data_of<const int>(starts), data_of<const int>(counts), static_cast<int>(g.m),
        data_of<T>(grad));
    check_launch("segment_grad_max_kernel");
  });
}

}  // namespace
}  // namespace voxel
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_group_keys, muspace::voxel::group_keys);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_group_from_sorted, muspace::voxel::group_from_sorted);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_group_workspace_ints, muspace::voxel::group_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_group_bitmap, muspace::voxel::group_bitmap);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_group_bitmap_workspace_ints,
                              muspace::voxel::bitmap_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(segment_reduce_forward, muspace::voxel::reduce_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dynamic_scatter_bitmap_forward,
                              muspace::voxel::scatter_bitmap_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(segment_reduce_backward, muspace::voxel::reduce_backward);
