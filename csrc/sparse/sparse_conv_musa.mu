// sparse_conv's row stages for MUSA and CUDA: the gather before and the scatter-add after the
// per-offset GEMMs, which mu_space/ops/_sparse_native.py runs with torch.mm (cuBLAS on CUDA,
// muBLAS under torch_musa) in float32. docs/operators/sparse_conv.md "Native kernels".
//
//   sparse_pairs_check  the rule book against the rows (one launch of 1 block + one over K x P):
//                       header [2K + 3] int32 = counts clamped to [0, P] | the exclusive starts
//                       of the offsets (K + 1) | a count outside [0, P] | a row outside its side
//                       (gathered rows in [0, n_in), scattered rows in [0, n_out)). The caller
//                       reads the header once (the op's one host synchronisation) and raises
//                       the reference's error when a flag is set.
//   sparse_conv_gather  gathered[starts[k] + j] = float32(src[pairs[k, side, j]]) for every
//                       offset in ONE launch (a thread per (row, VEC channels); the offset of a
//                       row by binary search in the K + 1 starts); VEC-wide loads when the
//                       channels and pointers allow (16 bytes for 8 half / 4 float)
//   sparse_conv_scatter acc[pairs[k, side, j]] += products[starts[k] + j] in float32, one launch
//                       per offset with pairs, offsets in ascending order: the rows of one
//                       offset are distinct (the rule-book invariant), so the plain
//                       read-modify-writes never conflict and every output row receives its
//                       terms in offset order: deterministic, no atomics, the reference's
//                       index_add order.
//   sparse_conv_maps    the im2col path's neighbour maps from the pairs (atomic-free GEMMs
//                       after it): out_map[o, k] = the input row feeding output o through
//                       offset k, in_map[i, k] = the output row input i feeds through k, -1
//                       where none; flags [2] int32 = a slot claimed twice (a repeated (o, k)
//                       or (i, k): the maps cannot hold that rule book, the caller runs the
//                       reference) | a row outside its side.
//   sparse_conv_im2col  cols[r, k C + c] = src[map[r, k], c] (0 where map is -1): the GEMM
//                       operand of map's rows, in src's dtype or float32, VEC-wide loads.
//   sparse_conv_implicit_gemm
//                       out[r, :] = sum_k src[map[r, k], :] @ weight[k] (float32 accumulation):
//                       the im2col GEMM without the cols buffer. A block computes a 64-row x BN
//                       tile, stepping through (offset k, 16 input channels): the gathered rows
//                       and the weight slice go to shared memory (double-buffered: one barrier per
//                       step, the next step's global loads in flight during the multiply), and a
//                       step in which none of the tile's 64 rows has a neighbour is skipped.
//                       Each output element is one thread's sum in (k, channel) order: no atomics,
//                       deterministic. A tile first collects the offsets its rows have (K <= 32)
//                       and steps through those only: no loads, barriers or products for the
//                       others. An optional row order (a permutation of the map's rows) says
//                       which row each tile position takes: rows grouped by their masks
//                       (sparse_conv_row_order) make a tile's rows share their offsets, so it
//                       has fewer; the sums are the same.
//   sparse_conv_implicit_wgrad
//                       grad_weight[k] = sum_r src[map[r, k]]^T grad[r] without the cols buffer:
//                       a block per (4 offsets, 16 input channels, BN output columns, split of
//                       the rows), the rows staged 32 at a time in shared memory (the 4 offsets
//                       share the grad rows), per-split partial sums in a workspace, then one
//                       thread per weight element adds the splits in order: deterministic.
//                       The same optional row order (the rows summed in that order).
//   sparse_conv_row_order
//                       order = the map's rows sorted by their masks (bit k: map[r, k] >= 0,
//                       K <= 32) within windows of 2048 rows, ties by row: one launch, a block
//                       per window sorting (mask, row) keys in shared memory (a bitonic
//                       network), deterministic.
//
// Every data-dependent row is bounds-checked: a bad row gathers zeros / is skipped.

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "sparse_common.muh"
#include "sparse_rows.muh"
#include "vec.muh"

#if MUSPACE_HAS_WMMA
#include <mma.h>
#endif

namespace muspace {
namespace sparse {
namespace {

using tvm::ffi::Shape;

MUSPACE_LIMIT(sparse_conv, max_pairs, kMaxPairs);
MUSPACE_LIMIT(sparse_maxpool, max_pairs, kMaxPairs);
// 1: sparse_conv_implicit_gemm multiplies float16 / bfloat16 on the tensor cores (sm_80+)
MUSPACE_LIMIT(sparse_conv, tensor_core_gemm, MUSPACE_HAS_WMMA);

// header layout of sparse_pairs_check
constexpr int kCounts = 0;  // + k

__global__ void __launch_bounds__(kBlock)
    pair_counts_kernel(const int* __restrict__ pair_num, int k_volume, int64_t cap,
                       int* __restrict__ header) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int* starts = header + k_volume;
  int* bad_count = header + 2 * k_volume + 1;
  int64_t run = 0;
  for (int k = 0; k < k_volume; ++k) {
    int64_t c = pair_num[k];
    if (c < 0 || c > cap) {
      *bad_count = 1;
      c = c < 0 ? 0 : cap;
    }
    header[kCounts + k] = static_cast<int>(c);
    starts[k] = static_cast<int>(run < INT_MAX ? run : INT_MAX);
    run += c;
  }
  starts[k_volume] = static_cast<int>(run < INT_MAX ? run : INT_MAX);
}

__global__ void __launch_bounds__(kBlock)
    pair_rows_kernel(const int* __restrict__ pairs, const int* __restrict__ pair_num, int k_volume,
                     int64_t cap, int64_t n_in, int64_t n_out, int gather_side,
                     int* __restrict__ header) {
  const int64_t total = static_cast<int64_t>(k_volume) * cap;
  int* bad_row = header + 2 * k_volume + 2;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t k = e / cap;
    const int64_t j = e - k * cap;
    if (j >= pair_num[k]) continue;  // a negative count: no pairs (flagged by the counts)
    const int64_t g = pairs[(2 * k + gather_side) * cap + j];
    const int64_t s = pairs[(2 * k + 1 - gather_side) * cap + j];
    if (g < 0 || g >= n_in || s < 0 || s >= n_out) atomicOr(bad_row, 1);
  }
}

// The offset k of row r: the largest k < K with starts[k] <= r (starts ascending, starts[0] = 0).
__device__ __forceinline__ int offset_of(const int* __restrict__ starts, int k_volume, int64_t r) {
  int lo = 0, hi = k_volume - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlock)
    gather_kernel(const T* __restrict__ src, int64_t n_src, int channels,
                  const int* __restrict__ pairs, int64_t cap, int side,
                  const int* __restrict__ starts, int k_volume, int64_t rows,
                  float* __restrict__ gathered) {
  const int chunks = channels / VEC;
  const int64_t total = rows * chunks;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t r = e / chunks;
    const int c = static_cast<int>(e - r * chunks) * VEC;
    const int k = offset_of(starts, k_volume, r);
    const int64_t j = r - starts[k];
    int64_t row = -1;
    if (j >= 0 && j < cap) row = pairs[(2 * static_cast<int64_t>(k) + side) * cap + j];
    float v[VEC];
    if (row >= 0 && row < n_src) {
      Vec<T, VEC>::load(src + row * channels + c).unpack(v);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = 0.0f;
    }
    store_floats<float, VEC>(gathered + r * channels + c, v);
  }
}

template <int VEC>
__global__ void __launch_bounds__(kBlock)
    scatter_kernel(const float* __restrict__ products, int64_t start, int64_t count, int channels,
                   const int* __restrict__ pairs, int64_t cap, int side, int k, int64_t n_acc,
                   float* __restrict__ acc) {
  const int chunks = channels / VEC;
  const int64_t total = count * chunks;
  const int* rows = pairs + (2 * static_cast<int64_t>(k) + side) * cap;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t j = e / chunks;
    const int c = static_cast<int>(e - j * chunks) * VEC;
    const int64_t row = rows[j];
    if (row < 0 || row >= n_acc) continue;
    float p[VEC], a[VEC];
    load_floats<float, VEC>(products + (start + j) * channels + c, p);
    float* dst = acc + row * channels + c;
    load_floats<float, VEC>(dst, a);
#pragma unroll
    for (int i = 0; i < VEC; ++i) a[i] += p[i];
    store_floats<float, VEC>(dst, a);
  }
}

// flags layout of sparse_conv_maps
constexpr int kMapDuplicate = 0;
constexpr int kMapBadRow = 1;

// One thread per pair slot; each (o, k) / (i, k) slot is claimed by a compare-and-swap from -1,
// so a slot's value is its one writer's (deterministic) unless a duplicate is flagged.
__global__ void __launch_bounds__(kBlock)
    neighbour_maps_kernel(const int* __restrict__ pairs, const int* __restrict__ pair_num,
                          int k_volume, int64_t cap, int64_t n_in, int64_t n_out, int gather_side,
                          int* __restrict__ out_map, int* __restrict__ in_map,
                          int* __restrict__ flags) {
  const int64_t total = static_cast<int64_t>(k_volume) * cap;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t k = e / cap;
    const int64_t j = e - k * cap;
    if (j >= pair_num[k]) continue;
    const int g = pairs[(2 * k + gather_side) * cap + j];
    const int s = pairs[(2 * k + 1 - gather_side) * cap + j];
    if (g < 0 || g >= n_in || s < 0 || s >= n_out) {
      atomicOr(flags + kMapBadRow, 1);
      continue;
    }
    const int old_out = atomicCAS(out_map + static_cast<int64_t>(s) * k_volume + k, -1, g);
    const int old_in = atomicCAS(in_map + static_cast<int64_t>(g) * k_volume + k, -1, s);
    if (old_out != -1 || old_in != -1) atomicOr(flags + kMapDuplicate, 1);
  }
}

// A thread per (row r, offset k, VEC channels): cols[r, k C + c .. + VEC] from src row
// map[r, k]. OutT is T (raw copy) or float (converted). I: the flat index type, uint32_t when
// the work fits (the two divisions per item are then 32-bit, not the emulated 64-bit ones).
template <typename I, typename T, typename OutT, int VEC>
__device__ __forceinline__ void im2col_items(const T* __restrict__ src, int64_t n_src, int channels,
                                             const int* __restrict__ map, int k_volume, I total,
                                             OutT* __restrict__ cols) {
  const I chunks = static_cast<I>(channels / VEC);
  const I per_row = static_cast<I>(k_volume) * chunks;
  for (I e = static_cast<I>(global_thread()); e < total; e += static_cast<I>(global_threads())) {
    const I r = e / per_row;
    const I rest = e - r * per_row;
    const I k = rest / chunks;
    const int c = static_cast<int>(rest - k * chunks) * VEC;
    const int64_t slot = static_cast<int64_t>(r) * k_volume + k;
    const int64_t row = map[slot];
    Vec<T, VEC> v;
    v.load_if(row >= 0 && row < n_src, src + row * channels + c);
    OutT* dst = cols + slot * channels + c;
    if constexpr (std::is_same_v<T, OutT>) {
      v.store(dst);
    } else {
      float f[VEC];
      v.unpack(f);
      store_floats<OutT, VEC>(dst, f);
    }
  }
}

template <typename T, typename OutT, int VEC>
__global__ void __launch_bounds__(kBlock)
    im2col_kernel(const T* __restrict__ src, int64_t n_src, int channels,
                  const int* __restrict__ map, int k_volume, int64_t rows,
                  OutT* __restrict__ cols) {
  const int64_t total = rows * k_volume * (channels / VEC);
  // uint32_t: e < INT_MAX plus at most the grid's threads (capped per multiprocessor) < 2^32
  if (total <= INT_MAX) {
    im2col_items<uint32_t, T, OutT, VEC>(src, n_src, channels, map, k_volume,
                                         static_cast<uint32_t>(total), cols);
  } else {
    im2col_items<int64_t, T, OutT, VEC>(src, n_src, channels, map, k_volume, total, cols);
  }
}

// ------------------------------------------------------------------------- implicit GEMM

constexpr int kGemmThreads = 256;
constexpr int kGemmRows = 64;   // BM: output rows per block
constexpr int kGemmDepth = 16;  // BK: input channels per step
constexpr int kGemmRowPad = 4;  // a_tile's row stride 68 floats: 16-byte rows, 2-way store banks

// The map / output row at tile position r: order[r] (a permutation of [0, rows)) or r itself
// without an order; -1 past the end, or for an order entry outside [0, rows) (bad input: that
// position does nothing).
__device__ __forceinline__ int64_t physical_row(const int* __restrict__ order, int64_t r,
                                                int64_t rows) {
  if (r >= rows) return -1;
  if (order == nullptr) return r;
  const int64_t p = order[r];
  return p >= 0 && p < rows ? p : -1;
}

// rows sorted together: 16 KB of keys (MUSA's static shared-memory budget is < 28 KB a block;
// the 4096-row windows run on the H200 in D3 / D4 of session 12 took 32 KB)
constexpr int kOrderWindow = 2048;
constexpr int kOrderThreads = 512;
// A block per window of kOrderWindow rows: keys (mask << 32 | row in the window), distinct, so
// the ascending bitonic sort is the stable sort by mask; padding keys sort last. The masks are
// OR-ed into the keys' high words from coalesced reads of the window's map rows (contiguous).
// On the H200 (session 12) neither mask pass was fast: one thread per row reading its K entries
// averaged 52 us a call (D3, all 16 maps of an encoder step), this one 79 us (D4, the 4 input-side
// maps; the ~27 lanes of one row's entries serialise on its word's shared atomicOr).
__global__ void __launch_bounds__(kOrderThreads)
    row_order_kernel(const int* __restrict__ map, int k_volume, int64_t rows,
                     int* __restrict__ order) {
  __shared__ unsigned long long key[kOrderWindow];
  // key[i]'s high 32 bits as a word (little-endian, as CUDA and MUSA GPUs are)
  unsigned* high = reinterpret_cast<unsigned*>(key) + 1;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kOrderWindow;
  const int n = rows - base < kOrderWindow ? static_cast<int>(rows - base) : kOrderWindow;
  for (int i = static_cast<int>(threadIdx.x); i < kOrderWindow; i += kOrderThreads) {
    key[i] = i < n ? static_cast<unsigned long long>(i) : ~0ull;
  }
  __syncthreads();
  const int* window = map + base * k_volume;
  const int entries = n * k_volume;  // <= kOrderWindow x 32
  for (int e = static_cast<int>(threadIdx.x); e < entries; e += kOrderThreads) {
    if (window[e] >= 0) {
      const int i = e / k_volume;
      atomicOr(high + 2 * i, 1u << (e - i * k_volume));
    }
  }
  __syncthreads();
  for (int size = 2; size <= kOrderWindow; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = static_cast<int>(threadIdx.x); t < kOrderWindow / 2; t += kOrderThreads) {
        const int lo = 2 * t - (t & (stride - 1));  // the pair (lo, lo + stride), bit stride clear
        const unsigned long long a = key[lo];
        const unsigned long long b = key[lo + stride];
        if ((a > b) == ((lo & size) == 0)) {  // ascending where bit `size` of lo is clear
          key[lo] = b;
          key[lo + stride] = a;
        }
      }
      __syncthreads();
    }
  }
  for (int i = static_cast<int>(threadIdx.x); i < n; i += kOrderThreads) {
    order[base + i] = static_cast<int>(base + static_cast<int64_t>(key[i] & 0xffffffffull));
  }
}

// The offsets (ascending) some row of the 64-row tile at row0 has a neighbour at, into
// offsets[] (K <= 32); returns their count, or K (every offset, offsets[] unused) for K > 32.
// Called by every thread of the block (barriers inside).
template <int kThreads>
__device__ int tile_offsets(const int* __restrict__ map, const int* __restrict__ order,
                            int k_volume, int64_t rows, int64_t row0, int64_t n_src, unsigned* bits,
                            int* offsets) {
  if (k_volume > 32) return k_volume;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) *bits = 0u;
  __syncthreads();
  unsigned mine = 0u;
  for (int e = tid; e < kGemmRows * k_volume; e += kThreads) {
    const int m = e / k_volume;
    const int k = e - m * k_volume;
    const int64_t r = physical_row(order, row0 + m, rows);
    if (r >= 0) {
      const int64_t v = map[r * k_volume + k];
      if (v >= 0 && v < n_src) mine |= 1u << k;
    }
  }
  if (mine != 0u) atomicOr(bits, mine);
  __syncthreads();
  const unsigned all = *bits;
  if (tid < 32 && (all >> tid & 1u)) offsets[__popc(all & ((1u << tid) - 1u))] = tid;
  __syncthreads();
  return __popc(all);
}

// One block: rows [row0, row0 + 64) x columns [n0, n0 + BN) of out. Thread roles: loading, the
// A vector (row m = tid / 4, channels 4 (tid % 4) ..), the B elements tid + i * 256; multiplying,
// the 4 x TN micro tile at rows 4 ty, columns TN tx (16 column groups).
template <typename T, typename OutT, int BN, bool kVecA>
__global__ void __launch_bounds__(kGemmThreads)
    implicit_gemm_kernel(const T* __restrict__ src, int64_t n_src, int c_in,
                         const int* __restrict__ map, const int* __restrict__ order, int k_volume,
                         int64_t rows, const T* __restrict__ weight, int c_out,
                         OutT* __restrict__ out) {
  constexpr int TM = 4;
  constexpr int TN = BN / 16;
  constexpr int kBPerThread = kGemmDepth * BN / kGemmThreads;  // 1, 2 or 4
  static_assert(kGemmRows * kGemmDepth == 4 * kGemmThreads, "one A vector of 4 per thread");
  static_assert(kBPerThread >= 1 && kGemmDepth * BN % kGemmThreads == 0, "B tile split");
  alignas(16) __shared__ float a_tile[2][kGemmDepth][kGemmRows + kGemmRowPad];
  alignas(16) __shared__ float b_tile[2][kGemmDepth][BN];
  // flag[s & 1] == s: some row of the tile has a neighbour at step s. A thread writes flag[s & 1]
  // again at step s + 2, after the barrier of step s + 1, which every reader of step s passed.
  __shared__ int flag[2];
  __shared__ unsigned tile_bits;
  __shared__ int offsets[32];

  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kGemmRows;
  const int n0 = static_cast<int>(blockIdx.y) * BN;
  const int load_m = tid >> 2;
  const int load_c = (tid & 3) * 4;
  const int64_t load_row = physical_row(order, row0 + load_m, rows);
  const int chunks = (c_in + kGemmDepth - 1) / kGemmDepth;
  const int n_offsets =
      tile_offsets<kGemmThreads>(map, order, k_volume, rows, row0, n_src, &tile_bits, offsets);
  const bool listed = k_volume <= 32;
  const int steps = n_offsets * chunks;
  if (tid < 2) flag[tid] = -1;

  float a_reg[4];
  float b_reg[kBPerThread];
  int64_t nbr = -1;
  auto load_step = [&](int s) {
    const int j = s / chunks;  // the tile's j-th offset
    const int k = listed ? offsets[j] : j;
    const int c0 = (s - j * chunks) * kGemmDepth;
    if (c0 == 0) {
      nbr = -1;
      if (load_row >= 0) {
        const int64_t v = map[load_row * k_volume + k];
        if (v >= 0 && v < n_src) nbr = v;
      }
    }
    const int c = c0 + load_c;
    if constexpr (kVecA) {  // c_in % 4 == 0 and src 4-element aligned
      Vec<T, 4> v;
      v.load_if(nbr >= 0 && c < c_in, src + nbr * c_in + c);
      v.unpack(a_reg);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a_reg[i] = nbr >= 0 && c + i < c_in ? to_float(src[nbr * c_in + c + i]) : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < kBPerThread; ++i) {
      const int e = tid + i * kGemmThreads;
      const int cc = e / BN;
      const int n = e - cc * BN;
      b_reg[i] = c0 + cc < c_in && n0 + n < c_out
                     ? to_float(weight[(static_cast<int64_t>(k) * c_in + c0 + cc) * c_out + n0 + n])
                     : 0.0f;
    }
  };

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
  }
  const int ty = tid / 16;
  const int tx = tid - ty * 16;
  __syncthreads();  // flag initialised
  if (steps > 0) load_step(0);
  for (int s = 0; s < steps; ++s) {
    const int buf = s & 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) a_tile[buf][load_c + i][load_m] = a_reg[i];
#pragma unroll
    for (int i = 0; i < kBPerThread; ++i) {
      const int e = tid + i * kGemmThreads;
      b_tile[buf][e / BN][e % BN] = b_reg[i];
    }
    if (nbr >= 0) flag[buf] = s;
    __syncthreads();
    if (s + 1 < steps) load_step(s + 1);
    if (flag[buf] != s) continue;  // no row of the tile has this offset's neighbour
    // the step's 16 products summed apart, then added: chains of 16 + K * C_in / 16 additions,
    // not one of K * C_in (on the H200, 2026-12-02, one chain put an encoder gradient 5.3x
    // further off float64 than the reference, im2col's cuBLAS GEMM 3.3x)
    float part[TM][TN];
#pragma unroll
    for (int cc = 0; cc < kGemmDepth; ++cc) {
      float a[TM];
      float b[TN];
#pragma unroll
      for (int i = 0; i < TM; ++i) a[i] = a_tile[buf][cc][ty * TM + i];
#pragma unroll
      for (int j = 0; j < TN; ++j) b[j] = b_tile[buf][cc][tx * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < TN; ++j) part[i][j] = cc ? fmaf(a[i], b[j], part[i][j]) : a[i] * b[j];
      }
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] += part[i][j];
    }
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int64_t r = physical_row(order, row0 + ty * TM + i, rows);
    if (r < 0) continue;
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int n = n0 + tx * TN + j;
      if (n < c_out) out[r * c_out + n] = from_float<OutT>(acc[i][j]);
    }
  }
}

#if MUSPACE_HAS_WMMA
// ---------------------------------------------------------- implicit GEMM on the tensor cores

constexpr int kMmaWarps = 4;  // warp w: rows [16 w, 16 w + 16) of the 64-row tile x all BN
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kMmaTile = 16;             // the wmma tile: 16 x 16 x 16
constexpr int kMmaLdA = kGemmDepth + 8;  // a_tile row stride: 48 bytes (16-byte rows)
constexpr int kMmaLdC = kMmaTile + 4;    // c_tile row stride in floats
static_assert(kMmaWarps * kMmaTile == kGemmRows, "a warp per 16 rows");
static_assert(kGemmDepth == kMmaTile, "a step is one wmma k");
static_assert(kWarpSize == 2 * kMmaTile, "a warp loads its own 16 rows, two lanes a row");

// implicit_gemm_kernel's sums for 16-bit src / weight with the products on the tensor cores:
// per (offset k, 16 channels) step the gathered 64 x 16 rows and the 16 x BN weight slice are
// staged in shared memory (double-buffered, one barrier per step) and each warp adds its 16-row
// strip times the slice into BN / 16 float32 accumulator tiles (chains of K C_in / 16 additions
// of 16-term products, as the SIMT kernel's two-level sums). A warp skips a step in which none
// of its 16 rows has a neighbour. Deterministic: fixed order, no atomics.
// Loading: thread tid stages row tid / 2, channels 8 (tid % 2) .. + 8 (so a warp loads its own
// strip, and a warp vote over its lanes' neighbours says whether the step has work for it: no
// shared flag) and weight elements tid + i * kMmaThreads.
template <typename T, typename OutT, int BN, bool kVecA>
__global__ void __launch_bounds__(kMmaThreads)
    implicit_gemm_mma_kernel(const T* __restrict__ src, int64_t n_src, int c_in,
                             const int* __restrict__ map, const int* __restrict__ order,
                             int k_volume, int64_t rows, const T* __restrict__ weight, int c_out,
                             OutT* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the host launches it on sm_80+ only (implicit_gemm_entry)
#else
  namespace wmma = nvcuda::wmma;
  static_assert(sizeof(T) == 2, "float16 / bfloat16");
  constexpr int kFrags = BN / kMmaTile;
  constexpr int kLdB = BN + 8;
  constexpr int kBPerThread = kGemmDepth * BN / kMmaThreads;  // 2, 4 or 8
  static_assert(kGemmRows * kGemmDepth == 8 * kMmaThreads, "one 8-element A vector per thread");
  static_assert(kBPerThread >= 1 && kGemmDepth * BN % kMmaThreads == 0, "B tile split");
  alignas(32) __shared__ T a_tile[2][kGemmRows][kMmaLdA];
  alignas(32) __shared__ T b_tile[2][kGemmDepth][kLdB];
  alignas(32) __shared__ float c_tile[kMmaWarps][kMmaTile][kMmaLdC];
  __shared__ unsigned tile_bits;
  __shared__ int offsets[32];

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / kWarpSize;
  const int lane = tid - warp * kWarpSize;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kGemmRows;
  const int n0 = static_cast<int>(blockIdx.y) * BN;
  const int load_m = tid >> 1;
  const int load_c = (tid & 1) * 8;
  const int64_t load_row = physical_row(order, row0 + load_m, rows);
  const int chunks = (c_in + kGemmDepth - 1) / kGemmDepth;
  const int n_offsets =
      tile_offsets<kMmaThreads>(map, order, k_volume, rows, row0, n_src, &tile_bits, offsets);
  const bool listed = k_volume <= 32;
  const int steps = n_offsets * chunks;

  const uint16_t* src_bits = reinterpret_cast<const uint16_t*>(src);
  const uint16_t* weight_bits = reinterpret_cast<const uint16_t*>(weight);
  Vec<T, 8> a_reg;
  uint16_t b_reg[kBPerThread];
  int64_t nbr = -1;
  auto load_step = [&](int s) {
    const int j = s / chunks;  // the tile's j-th offset
    const int k = listed ? offsets[j] : j;
    const int c0 = (s - j * chunks) * kGemmDepth;
    if (c0 == 0) {
      nbr = -1;
      if (load_row >= 0) {
        const int64_t v = map[load_row * k_volume + k];
        if (v >= 0 && v < n_src) nbr = v;
      }
    }
    const int c = c0 + load_c;
    if constexpr (kVecA) {  // c_in % 8 == 0 and src 16-byte aligned
      a_reg.load_if(nbr >= 0 && c < c_in, src + nbr * c_in + c);
    } else {
      uint16_t e[8];
#pragma unroll
      for (int i = 0; i < 8; ++i)
        e[i] = nbr >= 0 && c + i < c_in ? src_bits[nbr * c_in + c + i] : 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        a_reg.w[i] = e[2 * i] | (static_cast<uint32_t>(e[2 * i + 1]) << 16);
    }
#pragma unroll
    for (int i = 0; i < kBPerThread; ++i) {
      const int e = tid + i * kMmaThreads;
      const int cc = e / BN;
      const int n = e - cc * BN;
      b_reg[i] = c0 + cc < c_in && n0 + n < c_out
                     ? weight_bits[(static_cast<int64_t>(k) * c_in + c0 + cc) * c_out + n0 + n]
                     : 0;  // all-zero bits: 0.0 in float16 and bfloat16
    }
  };

  wmma::fragment<wmma::accumulator, kMmaTile, kMmaTile, kMmaTile, float> acc[kFrags];
#pragma unroll
  for (int j = 0; j < kFrags; ++j) wmma::fill_fragment(acc[j], 0.0f);
  if (steps > 0) load_step(0);
  for (int s = 0; s < steps; ++s) {
    const int buf = s & 1;
    a_reg.store(&a_tile[buf][load_m][load_c]);
#pragma unroll
    for (int i = 0; i < kBPerThread; ++i) {
      const int e = tid + i * kMmaThreads;
      reinterpret_cast<uint16_t*>(&b_tile[buf][e / BN][0])[e % BN] = b_reg[i];
    }
    const bool has_work = __any_sync(0xffffffffu, nbr >= 0);  // the warp's 16 rows, step s
    __syncthreads();
    if (s + 1 < steps) load_step(s + 1);
    if (!has_work) continue;  // none of this warp's rows has the step's neighbour
    wmma::fragment<wmma::matrix_a, kMmaTile, kMmaTile, kMmaTile, T, wmma::row_major> a;
    wmma::load_matrix_sync(a, &a_tile[buf][warp * kMmaTile][0], kMmaLdA);
#pragma unroll
    for (int j = 0; j < kFrags; ++j) {
      wmma::fragment<wmma::matrix_b, kMmaTile, kMmaTile, kMmaTile, T, wmma::row_major> b;
      wmma::load_matrix_sync(b, &b_tile[buf][0][j * kMmaTile], kLdB);
      wmma::mma_sync(acc[j], a, b, acc[j]);
    }
  }
  // each accumulator tile through the warp's c_tile to out (bounds-checked rows and columns)
  constexpr int kPerLane = kMmaTile * kMmaTile / kWarpSize;
  static_assert(kMmaTile * kMmaTile % kWarpSize == 0 && kMmaTile % kPerLane == 0, "c_tile split");
  const int r = lane * kPerLane / kMmaTile;
  const int col = lane * kPerLane - r * kMmaTile;
  const int64_t out_row = physical_row(order, row0 + warp * kMmaTile + r, rows);
#pragma unroll
  for (int j = 0; j < kFrags; ++j) {
    wmma::store_matrix_sync(&c_tile[warp][0][0], acc[j], kMmaLdC, wmma::mem_row_major);
    __syncwarp();
    if (out_row >= 0) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int n = n0 + j * kMmaTile + col + i;
        if (n < c_out) out[out_row * c_out + n] = from_float<OutT>(c_tile[warp][r][col + i]);
      }
    }
    __syncwarp();  // c_tile read before the next tile overwrites it
  }
#endif
}
#endif  // MUSPACE_HAS_WMMA

// ------------------------------------------------------------------- implicit GEMM: dweight

constexpr int kWgradOffsets = 4;    // KG: offsets per block (they share the grad rows)
constexpr int kWgradRows = 32;      // rows per step
constexpr int kWgradChannels = 16;  // input channels per block

// partial[s, k, ci, co] = sum over the rows r of split s of src[map[r, k], ci] * grad[r, co]
// (0 where map is -1). A block: offsets k0 .. k0 + 3, input channels ci0 .. ci0 + 15, output
// columns n0 .. n0 + BN, rows [split * rows_per_split, ...). Thread: offset kg = tid / 64, input
// channel ci = tid / 4 % 16, BN / 4 output columns from (tid % 4) * BN / 4. The rows go through
// shared memory 32 at a time (loaded, barrier, multiplied, barrier): each partial is one
// thread's sum in row order (with a row order, r is the row at each position of it).
template <typename T, int BN, bool kVec>
__global__ void __launch_bounds__(kGemmThreads)
    wgrad_partial_kernel(const T* __restrict__ src, int64_t n_src, int c_in,
                         const int* __restrict__ map, const int* __restrict__ order, int k_volume,
                         const T* __restrict__ grad, int c_out, int64_t rows,
                         int64_t rows_per_split, int ci_blocks, int n_blocks,
                         float* __restrict__ partial) {
  constexpr int TN = BN / 4;
  constexpr int kAVectors = kWgradOffsets * kWgradRows * kWgradChannels / 4;  // 512
  constexpr int kGElements = kWgradRows * BN;
  static_assert(kAVectors % kGemmThreads == 0, "A split");
  static_assert(kGElements % kGemmThreads == 0, "grad split");
  alignas(16) __shared__ float a_tile[kWgradOffsets][kWgradRows][kWgradChannels];
  alignas(16) __shared__ float g_tile[kWgradRows][BN];
  __shared__ int flag[kWgradOffsets];

  const int tid = static_cast<int>(threadIdx.x);
  int b = static_cast<int>(blockIdx.x);
  const int nb = b % n_blocks;
  b /= n_blocks;
  const int cb = b % ci_blocks;
  const int k0 = (b / ci_blocks) * kWgradOffsets;
  const int n0 = nb * BN;
  const int ci0 = cb * kWgradChannels;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_split;
  const int64_t r_end = r_begin + rows_per_split < rows ? r_begin + rows_per_split : rows;

  const int kg = tid / 64;
  const int ci = tid / 4 % 16;
  const int col = (tid % 4) * TN;
  if (tid < kWgradOffsets) flag[tid] = -1;
  float acc[TN];
#pragma unroll
  for (int j = 0; j < TN; ++j) acc[j] = 0.0f;
  __syncthreads();

  int tile = 0;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kWgradRows, ++tile) {
#pragma unroll
    for (int i = 0; i < kAVectors / kGemmThreads; ++i) {
      const int e = tid + i * kGemmThreads;  // (offset, row, 4 channels)
      const int q = e % (kWgradChannels / 4);
      const int m = e / (kWgradChannels / 4) % kWgradRows;
      const int g = e / (kWgradChannels / 4 * kWgradRows);
      const int k = k0 + g;
      const int64_t r = r0 + m < r_end ? physical_row(order, r0 + m, rows) : -1;
      int64_t nbr = -1;
      if (k < k_volume && r >= 0) {
        const int64_t v = map[r * k_volume + k];
        if (v >= 0 && v < n_src) nbr = v;
      }
      const int c = ci0 + q * 4;
      float f[4];
      if constexpr (kVec) {
        Vec<T, 4> v;
        v.load_if(nbr >= 0 && c < c_in, src + nbr * c_in + c);
        v.unpack(f);
      } else {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          f[t] = nbr >= 0 && c + t < c_in ? to_float(src[nbr * c_in + c + t]) : 0.0f;
        }
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) a_tile[g][m][q * 4 + t] = f[t];
      if (nbr >= 0) flag[g] = tile;
    }
#pragma unroll
    for (int i = 0; i < kGElements / kGemmThreads; ++i) {
      const int e = tid + i * kGemmThreads;
      const int m = e / BN;
      const int n = e - m * BN;
      const int64_t r = r0 + m < r_end ? physical_row(order, r0 + m, rows) : -1;
      g_tile[m][n] = r >= 0 && n0 + n < c_out ? to_float(grad[r * c_out + n0 + n]) : 0.0f;
    }
    __syncthreads();
    if (flag[kg] == tile) {  // (uniform over an offset's 64 threads: whole 32-lane warps)
      float part[TN];  // the tile's 32 rows summed apart, then added (see implicit_gemm_kernel)
#pragma unroll
      for (int j = 0; j < TN; ++j) part[j] = 0.0f;
#pragma unroll 8
      for (int m = 0; m < kWgradRows; ++m) {
        const float a = a_tile[kg][m][ci];
#pragma unroll
        for (int j = 0; j < TN; ++j) part[j] = fmaf(a, g_tile[m][col + j], part[j]);
      }
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[j] += part[j];
    }
    __syncthreads();
  }
  const int k = k0 + kg;
  if (k >= k_volume || ci0 + ci >= c_in) return;
  float* dst = partial + ((static_cast<int64_t>(blockIdx.y) * k_volume + k) * c_in + ci0 + ci) *
                             static_cast<int64_t>(c_out);
#pragma unroll
  for (int j = 0; j < TN; ++j) {
    if (n0 + col + j < c_out) dst[n0 + col + j] = acc[j];
  }
}

// grad_weight[e] = sum over s of partial[s, e], in split order.
__global__ void __launch_bounds__(kBlock)
    sum_splits_kernel(const float* __restrict__ partial, int64_t splits, int64_t n,
                      float* __restrict__ out) {
  for (int64_t e = global_thread(); e < n; e += global_threads()) {
    float s = 0.0f;
    for (int64_t t = 0; t < splits; ++t) s += partial[t * n + e];
    out[e] = s;
  }
}

// ------------------------------------------------------------------------------ entry points

void pairs_check_entry(TensorView indice_pairs, TensorView indice_pair_num, TensorView header,
                       int64_t n_in, int64_t n_out, bool inverse, int64_t stream) {
  const RuleBook rb = check_rulebook(indice_pairs, indice_pair_num);
  check_vector(header, "header", indice_pairs, kInt32, 2 * rb.k + 3);
  if (n_in < 0 || n_in > INT_MAX || n_out < 0 || n_out > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "n_in and n_out must be in [0, " << INT_MAX << "], got " << n_in
                              << " and " << n_out;
  }
  const int device_id = indice_pairs.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* head = data_of<int>(header);
  launch_zero(head + 2 * rb.k + 1, 8, device_id, st, "sparse_pairs_check (flags)");
  pair_counts_kernel<<<1, kBlock, 0, st>>>(data_of<const int>(indice_pair_num),
                                           static_cast<int>(rb.k), rb.cap, head);
  check_launch("sparse_pairs_check pair_counts_kernel");
  if (rb.k * rb.cap == 0) return;
  pair_rows_kernel<<<rows_blocks(rb.k * rb.cap, device_id), kBlock, 0, st>>>(
      data_of<const int>(indice_pairs), data_of<const int>(indice_pair_num), static_cast<int>(rb.k),
      rb.cap, n_in, n_out, inverse ? 1 : 0, head);
  check_launch("sparse_pairs_check pair_rows_kernel");
}

// src [R, C] float32 / float16 / bfloat16; pair_starts [K + 1] int32 (sparse_pairs_check's
// starts, on the device); gathered [T, C] float32, T = the total pair count.
void gather_entry(TensorView src, TensorView indice_pairs, TensorView pair_starts,
                  TensorView gathered, int64_t side, int64_t stream) {
  check_gpu_tensor(src, "src");
  check_float_dtype(src, "src");
  check_contiguous(src, "src");
  check_ndim(src, "src", 2);
  const RuleBook rb = check_pairs(indice_pairs, src);
  check_vector(pair_starts, "pair_starts", src, kInt32, rb.k + 1);
  check_side(side);
  check_input(gathered, "gathered", src, kFloat32);
  check_ndim(gathered, "gathered", 2);
  check_size(gathered, "gathered", 1, src.size(1));
  check_rows(src.size(0), "src");
  const int64_t rows = gathered.size(0);
  if (rows > static_cast<int64_t>(rb.k) * rb.cap) {
    TVM_FFI_THROW(ValueError) << "gathered has " << rows << " rows; the rule book holds at most "
                              << rb.k * rb.cap << " pairs";
  }
  const int64_t channels = src.size(1);
  if (rows == 0 || channels == 0) return;
  const int device_id = src.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  dispatch_float(src, "src", [&](auto tag) {
    using T = decltype(tag);
    const int vec = pick_vec(channels, 8,
                             {{data_of(src), static_cast<int>(sizeof(T))}, {data_of(gathered), 4}});
    dispatch_int<8, 4, 2, 1>(vec, [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      gather_kernel<T, VEC><<<rows_blocks(rows * (channels / VEC), device_id), kBlock, 0, st>>>(
          data_of<const T>(src), src.size(0), static_cast<int>(channels),
          data_of<const int>(indice_pairs), rb.cap, static_cast<int>(side),
          data_of<const int>(pair_starts), static_cast<int>(rb.k), rows, data_of<float>(gathered));
      check_launch("sparse_conv_gather gather_kernel");
    });
  });
}

// products [T, C] float32 (offset k's rows at starts[k] .. starts[k] + counts[k]); counts: the
// host copy of sparse_pairs_check's clamped counts; acc [R, C] float32 (added to, not cleared).
void scatter_entry(TensorView products, TensorView indice_pairs, Shape counts, TensorView acc,
                   int64_t side, int64_t stream) {
  check_gpu_tensor(products, "products");
  check_input(products, "products", products, kFloat32);
  check_ndim(products, "products", 2);
  const RuleBook rb = check_pairs(indice_pairs, products);
  check_side(side);
  if (static_cast<int64_t>(counts.size()) != rb.k) {
    TVM_FFI_THROW(ValueError) << "counts must have K = " << rb.k << " values, got "
                              << counts.size();
  }
  int64_t rows = 0;
  for (int64_t k = 0; k < rb.k; ++k) {
    if (counts[k] < 0 || counts[k] > rb.cap) {
      TVM_FFI_THROW(ValueError) << "counts[" << k << "] = " << counts[k] << " is outside [0, "
                                << rb.cap << "]";
    }
    rows += counts[k];
  }
  check_size(products, "products", 0, rows);
  check_input(acc, "acc", products, kFloat32);
  check_ndim(acc, "acc", 2);
  check_size(acc, "acc", 1, products.size(1));
  check_rows(acc.size(0), "acc");
  const int64_t channels = products.size(1);
  if (rows == 0 || channels == 0) return;
  const int device_id = products.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const int vec = pick_vec(channels, 4, {{data_of(products), 4}, {data_of(acc), 4}});
  dispatch_int<4, 2, 1>(vec, [&](auto v) {
    constexpr int VEC = decltype(v)::value;
    int64_t start = 0;
    for (int64_t k = 0; k < rb.k; ++k) {
      const int64_t count = counts[k];
      if (count > 0) {
        scatter_kernel<VEC><<<rows_blocks(count * (channels / VEC), device_id), kBlock, 0, st>>>(
            data_of<const float>(products), start, count, static_cast<int>(channels),
            data_of<const int>(indice_pairs), rb.cap, static_cast<int>(side), static_cast<int>(k),
            acc.size(0), data_of<float>(acc));
        check_launch("sparse_conv_scatter scatter_kernel");
      }
      start += count;
    }
  });
}

// indice_pairs / indice_pair_num as for sparse_pairs_check; out_map [n_out, K], in_map [n_in, K]
// int32 (filled with -1 here); flags [2] int32 (zeroed here).
void maps_entry(TensorView indice_pairs, TensorView indice_pair_num, TensorView out_map,
                TensorView in_map, TensorView flags, bool inverse, int64_t stream) {
  const RuleBook rb = check_rulebook(indice_pairs, indice_pair_num);
  check_input(out_map, "out_map", indice_pairs, kInt32);
  check_ndim(out_map, "out_map", 2);
  check_size(out_map, "out_map", 1, rb.k);
  check_rows(out_map.size(0), "out_map");
  check_input(in_map, "in_map", indice_pairs, kInt32);
  check_ndim(in_map, "in_map", 2);
  check_size(in_map, "in_map", 1, rb.k);
  check_rows(in_map.size(0), "in_map");
  check_vector(flags, "flags", indice_pairs, kInt32, 2);
  const int device_id = indice_pairs.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  launch_zero(data_of(flags), 8, device_id, st, "sparse_conv_maps (flags)");
  const uint32_t none = fill_word<int>(-1);
  launch_fill(data_of(out_map), out_map.numel() * 4, none, device_id, st, "sparse_conv_maps");
  launch_fill(data_of(in_map), in_map.numel() * 4, none, device_id, st, "sparse_conv_maps");
  if (rb.k * rb.cap == 0 || out_map.numel() == 0 || in_map.numel() == 0) return;
  neighbour_maps_kernel<<<rows_blocks(rb.k * rb.cap, device_id), kBlock, 0, st>>>(
      data_of<const int>(indice_pairs), data_of<const int>(indice_pair_num), static_cast<int>(rb.k),
      rb.cap, in_map.size(0), out_map.size(0), inverse ? 1 : 0, data_of<int>(out_map),
      data_of<int>(in_map), data_of<int>(flags));
  check_launch("sparse_conv_maps neighbour_maps_kernel");
}

// map [rows, K] int32 on src's device (a neighbour map, -1 for none), 1 <= K <= 4096; returns K.
int64_t check_neighbour_map(const TensorView& map, const TensorView& src) {
  check_input(map, "map", src, kInt32);
  check_ndim(map, "map", 2);
  const int64_t k_volume = map.size(1);
  if (k_volume < 1 || k_volume > kMaxRuleBookVolume) {
    TVM_FFI_THROW(ValueError) << "map.shape[1] (K) must be in [1, " << kMaxRuleBookVolume
                              << "], got " << k_volume;
  }
  return k_volume;
}

// src [R, C] float32 / float16 / bfloat16; map [rows, K] int32 (a row block of a neighbour
// map); cols [rows, K * C], src's dtype or float32.
void im2col_entry(TensorView src, TensorView map, TensorView cols, int64_t stream) {
  check_gpu_tensor(src, "src");
  check_float_dtype(src, "src");
  check_contiguous(src, "src");
  check_ndim(src, "src", 2);
  check_rows(src.size(0), "src");
  const int64_t k_volume = check_neighbour_map(map, src);
  check_device(cols, "cols", src);
  if (!same_dtype(cols.dtype(), src.dtype()) && !same_dtype(cols.dtype(), kFloat32)) {
    TVM_FFI_THROW(TypeError) << "cols must have the dtype of src (" << dtype_name(src.dtype())
                             << ") or float32, got " << dtype_name(cols.dtype());
  }
  check_contiguous(cols, "cols");
  check_ndim(cols, "cols", 2);
  check_size(cols, "cols", 0, map.size(0));
  const int64_t channels = src.size(1);
  check_size(cols, "cols", 1, k_volume * channels);
  const int64_t rows = map.size(0);
  if (rows == 0 || channels == 0) return;
  const int device_id = src.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const bool to_float = !same_dtype(cols.dtype(), src.dtype());
  dispatch_float(src, "src", [&](auto tag) {
    using T = decltype(tag);
    const int out_bytes = to_float ? 4 : static_cast<int>(sizeof(T));
    const int vec = pick_vec(
        channels, 8, {{data_of(src), static_cast<int>(sizeof(T))}, {data_of(cols), out_bytes}});
    dispatch_bools(
        [&](auto as_float) {
          using OutT = std::conditional_t<decltype(as_float)::value, float, T>;
          dispatch_int<8, 4, 2, 1>(vec, [&](auto v) {
            constexpr int VEC = decltype(v)::value;
            im2col_kernel<T, OutT, VEC>
                <<<rows_blocks(rows * k_volume * (channels / VEC), device_id), kBlock, 0, st>>>(
                    data_of<const T>(src), src.size(0), static_cast<int>(channels),
                    data_of<const int>(map), static_cast<int>(k_volume), rows, data_of<OutT>(cols));
            check_launch("sparse_conv_im2col im2col_kernel");
          });
        },
        to_float);
  });
}

// row_order (optional): [rows] int32, a permutation of [0, rows) -> its data, else nullptr
// (identity). Entries outside [0, rows) are skipped by the kernels, never dereferenced.
const int* check_row_order(const Optional<TensorView>& row_order, const TensorView& map) {
  if (!row_order.has_value()) return nullptr;
  check_vector(*row_order, "row_order", map, kInt32, map.size(0));
  return data_of<const int>(*row_order);
}

// map [rows, K] int32, K <= 32; order [rows] int32 <- the rows by mask within windows of
// kOrderWindow rows (row_order_kernel): a permutation of [0, rows).
void row_order_entry(TensorView map, TensorView order, int64_t stream) {
  check_gpu_tensor(map, "map");
  const int64_t k_volume = check_neighbour_map(map, map);
  if (k_volume > 32) {
    TVM_FFI_THROW(ValueError) << "map.shape[1] (K) must be at most 32 for a mask per row, got "
                              << k_volume;
  }
  check_rows(map.size(0), "map");
  check_vector(order, "order", map, kInt32, map.size(0));
  const int64_t rows = map.size(0);
  if (rows == 0) return;
  const int device_id = map.device().device_id;
  DeviceGuard guard(device_id);
  const int64_t windows = (rows + kOrderWindow - 1) / kOrderWindow;  // rows <= INT_MAX
  row_order_kernel<<<static_cast<unsigned>(windows), kOrderThreads, 0, as_stream(stream)>>>(
      data_of<const int>(map), static_cast<int>(k_volume), rows, data_of<int>(order));
  check_launch("sparse_conv_row_order row_order_kernel");
}

// src [R, C_in] float32 / float16 / bfloat16; map [rows, K] int32 (-1: no neighbour); weight
// [K, C_in, C_out] of src's dtype; out [rows, C_out] of src's dtype or float32; row_order
// (optional) [rows] int32: the order the tiles take the rows in (check_row_order).
void implicit_gemm_entry(TensorView src, TensorView map, TensorView weight, TensorView out,
                         Optional<TensorView> row_order, int64_t stream) {
  check_gpu_tensor(src, "src");
  check_float_dtype(src, "src");
  check_contiguous(src, "src");
  check_ndim(src, "src", 2);
  check_rows(src.size(0), "src");
  const int64_t k_volume = check_neighbour_map(map, src);
  check_rows(map.size(0), "map");
  check_like(weight, "weight", src, "src");
  check_ndim(weight, "weight", 3);
  check_size(weight, "weight", 0, k_volume);
  check_size(weight, "weight", 1, src.size(1));
  check_device(out, "out", src);
  if (!same_dtype(out.dtype(), src.dtype()) && !same_dtype(out.dtype(), kFloat32)) {
    TVM_FFI_THROW(TypeError) << "out must have the dtype of src (" << dtype_name(src.dtype())
                             << ") or float32, got " << dtype_name(out.dtype());
  }
  check_contiguous(out, "out");
  check_ndim(out, "out", 2);
  check_size(out, "out", 0, map.size(0));
  check_size(out, "out", 1, weight.size(2));
  const int* order = check_row_order(row_order, map);
  const int64_t c_in = src.size(1);
  const int64_t c_out = weight.size(2);
  const int64_t rows = map.size(0);
  if (c_in > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "src.shape[1] (C_in) must be at most " << INT_MAX;
  }
  // the kernel's int step counter (K x 16-channel steps) and grid.y (64-column blocks)
  if (k_volume * ((c_in + kGemmDepth - 1) / kGemmDepth) > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "src.shape[1] (C_in = " << c_in << ") x K (" << k_volume
                              << ") is too large for sparse_conv_implicit_gemm";
  }
  if (c_out > 65535LL * 64) {
    TVM_FFI_THROW(ValueError) << "weight.shape[2] (C_out = " << c_out << ") must be at most "
                              << 65535LL * 64;
  }
  if (rows == 0 || c_out == 0) return;
  const int device_id = src.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const int bn = c_out <= 16 ? 16 : (c_out <= 32 ? 32 : 64);
  const dim3 grid(static_cast<unsigned>((rows + kGemmRows - 1) / kGemmRows),
                  static_cast<unsigned>((c_out + bn - 1) / bn));
  if (c_in == 0) {  // an empty sum
    launch_zero(data_of(out), out.numel() * element_bytes(out), device_id, st,
                "sparse_conv_implicit_gemm (no input channels)");
    return;
  }
  const bool to_float = !same_dtype(out.dtype(), src.dtype());
  dispatch_float(src, "src", [&](auto tag) {
    using T = decltype(tag);
#if MUSPACE_HAS_WMMA
    if constexpr (sizeof(T) == 2) {
      if (compute_capability_major(device_id) >= 8) {
        const bool vec_a = pick_vec(c_in, 8, {{data_of(src), 2}}) == 8;
        dispatch_bools(
            [&](auto as_float, auto vec) {
              using OutT = std::conditional_t<decltype(as_float)::value, float, T>;
              constexpr bool kVecA = decltype(vec)::value;
              dispatch_int<16, 32, 64>(bn, [&](auto b) {
                constexpr int BN = decltype(b)::value;
                implicit_gemm_mma_kernel<T, OutT, BN, kVecA><<<grid, kMmaThreads, 0, st>>>(
                    data_of<const T>(src), src.size(0), static_cast<int>(c_in),
                    data_of<const int>(map), order, static_cast<int>(k_volume), rows,
                    data_of<const T>(weight), static_cast<int>(c_out), data_of<OutT>(out));
                check_launch("sparse_conv_implicit_gemm implicit_gemm_mma_kernel");
              });
            },
            to_float, vec_a);
        return;
      }
    }
#endif
    const bool vec_a = pick_vec(c_in, 4, {{data_of(src), static_cast<int>(sizeof(T))}}) == 4;
    dispatch_bools(
        [&](auto as_float, auto vec) {
          using OutT = std::conditional_t<decltype(as_float)::value, float, T>;
          constexpr bool kVecA = decltype(vec)::value;
          dispatch_int<16, 32, 64>(bn, [&](auto b) {
            constexpr int BN = decltype(b)::value;
            implicit_gemm_kernel<T, OutT, BN, kVecA><<<grid, kGemmThreads, 0, st>>>(
                data_of<const T>(src), src.size(0), static_cast<int>(c_in), data_of<const int>(map),
                order, static_cast<int>(k_volume), rows, data_of<const T>(weight),
                static_cast<int>(c_out), data_of<OutT>(out));
            check_launch("sparse_conv_implicit_gemm implicit_gemm_kernel");
          });
        },
        to_float, vec_a);
  });
}

// src [R, C_in] (float32 / float16 / bfloat16); map [rows, K] int32; grad [rows, C_out] of src's
// dtype; partial [S, K, C_in, C_out] float32 (workspace; S splits of the rows, S from the
// caller); grad_weight [K, C_in, C_out] float32 = sum over rows of src[map[r, k]]^T grad[r];
// row_order (optional): the order the splits take the rows in (check_row_order).
void implicit_wgrad_entry(TensorView src, TensorView map, TensorView grad, TensorView partial,
                          TensorView grad_weight, Optional<TensorView> row_order, int64_t stream) {
  check_gpu_tensor(src, "src");
  check_float_dtype(src, "src");
  check_contiguous(src, "src");
  check_ndim(src, "src", 2);
  check_rows(src.size(0), "src");
  const int64_t k_volume = check_neighbour_map(map, src);
  check_rows(map.size(0), "map");
  check_like(grad, "grad", src, "src");
  check_ndim(grad, "grad", 2);
  check_size(grad, "grad", 0, map.size(0));
  const int64_t c_in = src.size(1);
  const int64_t c_out = grad.size(1);
  if (c_in > INT_MAX || c_out > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "channels must be at most " << INT_MAX;
  }
  check_input(grad_weight, "grad_weight", src, kFloat32);
  check_ndim(grad_weight, "grad_weight", 3);
  check_size(grad_weight, "grad_weight", 0, k_volume);
  check_size(grad_weight, "grad_weight", 1, c_in);
  check_size(grad_weight, "grad_weight", 2, c_out);
  check_input(partial, "partial", src, kFloat32);
  check_ndim(partial, "partial", 4);
  const int64_t splits = partial.size(0);
  if (splits < 1 || splits > 65535) {
    TVM_FFI_THROW(ValueError) << "partial.shape[0] (splits) must be in [1, 65535], got " << splits;
  }
  check_size(partial, "partial", 1, k_volume);
  check_size(partial, "partial", 2, c_in);
  check_size(partial, "partial", 3, c_out);
  const int* order = check_row_order(row_order, map);
  const int64_t rows = map.size(0);
  const int64_t n = grad_weight.numel();
  if (n == 0) return;
  const int device_id = src.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  // rows per split: a multiple of the 32-row step, so only the last split has a partial step
  int64_t per_split = (rows + splits - 1) / splits;
  per_split = (per_split + kWgradRows - 1) / kWgradRows * kWgradRows;
  const int bn = c_out <= 16 ? 16 : (c_out <= 32 ? 32 : 64);
  const int64_t k_blocks = (k_volume + kWgradOffsets - 1) / kWgradOffsets;
  const int64_t ci_blocks = (c_in + kWgradChannels - 1) / kWgradChannels;
  const int64_t n_blocks = (c_out + bn - 1) / bn;
  if (k_blocks * ci_blocks * n_blocks > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "K x C_in x C_out is too large for sparse_conv_implicit_wgrad";
  }
  const dim3 grid(static_cast<unsigned>(k_blocks * ci_blocks * n_blocks),
                  static_cast<unsigned>(splits));
  dispatch_float(src, "src", [&](auto tag) {
    using T = decltype(tag);
    const bool vec = pick_vec(c_in, 4, {{data_of(src), static_cast<int>(sizeof(T))}}) == 4;
    dispatch_bools(
        [&](auto v) {
          constexpr bool kVec = decltype(v)::value;
          dispatch_int<16, 32, 64>(bn, [&](auto b) {
            constexpr int BN = decltype(b)::value;
            wgrad_partial_kernel<T, BN, kVec><<<grid, kGemmThreads, 0, st>>>(
                data_of<const T>(src), src.size(0), static_cast<int>(c_in), data_of<const int>(map),
                order, static_cast<int>(k_volume), data_of<const T>(grad), static_cast<int>(c_out),
                rows, per_split, static_cast<int>(ci_blocks), static_cast<int>(n_blocks),
                data_of<float>(partial));
            check_launch("sparse_conv_implicit_wgrad wgrad_partial_kernel");
          });
        },
        vec);
  });
  sum_splits_kernel<<<rows_blocks(n, device_id), kBlock, 0, st>>>(
      data_of<const float>(partial), splits, n, data_of<float>(grad_weight));
  check_launch("sparse_conv_implicit_wgrad sum_splits_kernel");
}

}  // namespace
}  // namespace sparse
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_pairs_check, muspace::sparse::pairs_check_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_gather, muspace::sparse::gather_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_scatter, muspace::sparse::scatter_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_maps, muspace::sparse::maps_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_im2col, muspace::sparse::im2col_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_implicit_gemm, muspace::sparse::implicit_gemm_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_implicit_wgrad, muspace::sparse::implicit_wgrad_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_row_order, muspace::sparse::row_order_entry);
