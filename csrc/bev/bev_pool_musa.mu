// bev_pool (BEVFusion): the two native steps of its own around the shared sort and pooling.
//
//   bev_pool_cells_forward   coords [n, 4] (x, y, z, b) -> cells [n] int32, one pass:
//                            cell = ((b*D + z)*H + x)*W + y, -1 when any coordinate is outside
//                            its dimension (per column: y == W does not wrap into the next row).
//   bev_pool_rows_backward   grad_out [B, C, Z, Y, X] -> grad_feat [n, C], row i = the output
//                            gradient at cells[i] (0 for a cell outside [0, B*Z*Y*X)). Two
//                            kernels: a tile transpose of grad_out into channels-last rows
//                            [B*Z*Y*X, C] (a caller-given buffer), then a gather that writes
//                            grad_feat once, in row order, with coalesced stores. Each row has
//                            one cell, so there are no atomics: deterministic and exact (the
//                            elements are moved as raw bits, in every dtype).
//   bev_pool_runs_from_sorted  the cells after a stable sort (torch.sort: CUB's radix sort under
//                            CUDA) -> the kept points' order and sorted cells, and the runs of
//                            equal cells (interval_starts / lengths, in cell order). Two kernels
//                            around the shared exclusive scan of the run heads; the counts
//                            (n_kept, n_intervals) go to a 2-int header the caller reads back.
#include <tvm/ffi/function.h>

#include <cstdint>

#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "scan.muh"

namespace muspace {
namespace {

// ------------------------------------------------------------------------- launch policy

constexpr int kBlock = 256;            // threads of the cells and gather kernels
constexpr int kCellsBlocksPerSm = 8;   // grid cap of the grid-stride cells kernel
constexpr int kTile = 32;              // transpose tile: kTile channels x kTile cells
constexpr int kTileRows = 8;           // transpose block: kTile x kTileRows threads
constexpr int32_t kChunkWords = 4096;  // words of grad_feat per gather block (16 per thread)
constexpr int kMaxGridY = 65535;
constexpr int kMaxGridZ = 65535;
constexpr int64_t kInt32Max = 2147483647;

// ------------------------------------------------------------------------- coords -> cells

struct Dims {
  int32_t B, D, H, W;
};

template <typename Index>
struct Coord4 {
  Index x, y, z, b;
};

// One point's 4 coordinates. kVector: coords is 16-byte aligned, so a row of int32 is one
// 16-byte load and a row of int64 two (the int64 halves are joined, little-endian).
template <bool kVector>
__device__ __forceinline__ Coord4<int32_t> load_coord(const int32_t* p) {
  if constexpr (kVector) {
    const int4 v = *reinterpret_cast<const int4*>(p);
    return {v.x, v.y, v.z, v.w};
  } else {
    return {p[0], p[1], p[2], p[3]};
  }
}

__device__ __forceinline__ int64_t join_int64(int32_t lo, int32_t hi) {
  return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(hi)) << 32) |
                              static_cast<uint64_t>(static_cast<uint32_t>(lo)));
}

template <bool kVector>
__device__ __forceinline__ Coord4<int64_t> load_coord(const int64_t* p) {
  if constexpr (kVector) {
    const int4 a = *reinterpret_cast<const int4*>(p);
    const int4 b = *reinterpret_cast<const int4*>(p + 2);
    return {join_int64(a.x, a.y), join_int64(a.z, a.w), join_int64(b.x, b.y), join_int64(b.z, b.w)};
  } else {
    return {p[0], p[1], p[2], p[3]};
  }
}

template <typename Index, bool kVector>
__global__ void __launch_bounds__(kBlock)
    coords_to_cells_kernel(const Index* __restrict__ coords, int64_t n, Dims dims,
                           int32_t* __restrict__ cells) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const Coord4<Index> p = load_coord<kVector>(coords + 4 * i);
    const bool inside = p.x >= 0 && p.x < dims.H && p.y >= 0 && p.y < dims.W && p.z >= 0 &&
                        p.z < dims.D && p.b >= 0 && p.b < dims.B;
    // inside: every partial product is below B*D*H*W <= INT32_MAX (checked on the host)
    const int32_t cell =
        ((static_cast<int32_t>(p.b) * dims.D + static_cast<int32_t>(p.z)) * dims.H +
         static_cast<int32_t>(p.x)) *
            dims.W +
        static_cast<int32_t>(p.y);
    cells[i] = inside ? cell : -1;
  }
}

// ------------------------------------------------------------------------- backward

// rows[b, s, c] = grad[b, c, s] (s: the flat Z*Y*X cell of batch b), Word = the element's bits.
// Reads run along s and writes along c, both through one padded shared tile.
template <typename Word>
__global__ void __launch_bounds__(kTile* kTileRows)
    channels_last_kernel(const Word* __restrict__ grad, int64_t batches, int32_t channels,
                         int64_t spatial, Word* __restrict__ rows) {
  __shared__ Word tile[kTile][kTile + 1];
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // block-uniform loops: every thread takes every barrier
  for (int64_t b = blockIdx.z; b < batches; b += gridDim.z) {
    const Word* src = grad + b * channels * spatial;
    Word* dst = rows + b * spatial * channels;
    for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile; c0 < channels;
         c0 += static_cast<int64_t>(gridDim.y) * kTile) {
      for (int r = threadIdx.y; r < kTile; r += kTileRows) {
        const int64_t c = c0 + r, s = s0 + threadIdx.x;
        if (c < channels && s < spatial) tile[r][threadIdx.x] = src[c * spatial + s];
      }
      __syncthreads();
      for (int r = threadIdx.y; r < kTile; r += kTileRows) {
        const int64_t s = s0 + r, c = c0 + threadIdx.x;
        if (c < channels && s < spatial) dst[s * channels + c] = tile[threadIdx.x][r];
      }
      __syncthreads();  // the tile is refilled by the next round
    }
  }
}

// out[i] = rows[cells[i]] (words_per_row Words each), zeros for a cell outside [0, n_cells).
// A block writes rows_per_chunk consecutive rows of out: consecutive threads, consecutive words.
template <typename Word, typename Index>
__global__ void __launch_bounds__(kBlock)
    gather_rows_kernel(const Word* __restrict__ rows, const Index* __restrict__ cells, int64_t n,
                       int64_t n_cells, int32_t words_per_row, int32_t rows_per_chunk,
                       Word* __restrict__ out) {
  const int32_t chunk_words = rows_per_chunk * words_per_row;
  // (row, word) of thread t's j-th word, stepped without a division per word
  const int32_t row_step = kBlock / words_per_row, word_step = kBlock % words_per_row;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows_per_chunk; row0 < n;
       row0 += static_cast<int64_t>(gridDim.x) * rows_per_chunk) {
    int32_t q = static_cast<int32_t>(threadIdx.x) / words_per_row;
    int32_t w = static_cast<int32_t>(threadIdx.x) % words_per_row;
#pragma unroll 4
    for (int32_t j = threadIdx.x; j < chunk_words; j += kBlock) {
      const int64_t row = row0 + q;
      if (row < n) {
        const int64_t cell = static_cast<int64_t>(cells[row]);
        Word v{};
        if (cell >= 0 && cell < n_cells) v = rows[cell * words_per_row + w];
        out[row * words_per_row + w] = v;
      }
      q += row_step;
      w += word_step;
      if (w >= words_per_row) {
        w -= words_per_row;
        ++q;
      }
    }
  }
}

template <typename Word>
void launch_backward(const TensorView& grad_out, const TensorView& cells, const TensorView& rows,
                     const TensorView& grad_feat, int64_t n, int64_t channels, int64_t n_cells,
                     int device_id, gpuStream_t stream) {
  const int64_t batches = grad_out.size(0);
  const int64_t spatial = batches > 0 ? n_cells / batches : 0;
  const int64_t element = element_bytes(grad_out);
  if (n_cells > 0) {
    // the transpose moves elements (2 or 4 bytes): Word of that size
    const int64_t s_tiles = (spatial + kTile - 1) / kTile;
    const int64_t c_tiles = (channels + kTile - 1) / kTile;
    const dim3 grid(static_cast<unsigned>(s_tiles),
                    static_cast<unsigned>(c_tiles < kMaxGridY ? c_tiles : kMaxGridY),
                    static_cast<unsigned>(batches < kMaxGridZ ? batches : kMaxGridZ));
    const dim3 block(kTile, kTileRows);
    if (element == 4) {
      channels_last_kernel<uint32_t><<<grid, block, 0, stream>>>(
          data_of<const uint32_t>(grad_out), batches, static_cast<int32_t>(channels), spatial,
          data_of<uint32_t>(rows));
    } else {
      channels_last_kernel<uint16_t><<<grid, block, 0, stream>>>(
          data_of<const uint16_t>(grad_out), batches, static_cast<int32_t>(channels), spatial,
          data_of<uint16_t>(rows));
    }
    check_launch("bev_pool_rows_backward channels_last_kernel");
  }
  const int64_t words_per_row = channels * element / static_cast<int64_t>(sizeof(Word));
  const int32_t rows_per_chunk =
      static_cast<int32_t>(words_per_row >= kChunkWords ? 1 : kChunkWords / words_per_row);
  const int64_t chunks = (n + rows_per_chunk - 1) / rows_per_chunk;
  const int blocks = grid_for(chunks, 1, device_id, 0);
  dispatch_index(cells, "cells", [&](auto tag) {
    using I = decltype(tag);
    gather_rows_kernel<Word, I><<<blocks, kBlock, 0, stream>>>(
        data_of<const Word>(rows), data_of<const I>(cells), n, n_cells,
        static_cast<int32_t>(words_per_row), rows_per_chunk, data_of<Word>(grad_feat));
  });
  check_launch("bev_pool_rows_backward gather_rows_kernel");
}

// ------------------------------------------------------------------------- runs of sorted cells

// First position in keys[lo, hi) whose key is >= value (hi when none).
__device__ __forceinline__ int32_t lower_bound(const int32_t* keys, int32_t lo, int32_t hi,
                                               int64_t value) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < value) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The kept positions [kept[0], kept[1]) of the sorted keys: those in [0, n_cells).
__global__ void kept_range_kernel(const int32_t* __restrict__ keys, int32_t n, int64_t n_cells,
                                  int32_t* __restrict__ kept, int32_t* __restrict__ header) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const int32_t lo = lower_bound(keys, 0, n, 0);
    const int32_t hi = lower_bound(keys, lo, n, n_cells);
    kept[0] = lo;
    kept[1] = hi;
    header[0] = hi - lo;  // n_kept
  }
}

__device__ __forceinline__ bool run_head(const int32_t* keys, int32_t i, int32_t lo) {
  return i == lo || keys[i] != keys[i - 1];
}

// order / ranks_bev of the kept positions, and heads[i] = 1 where a run of equal keys starts.
// kPad: positions p >= n_kept get bev_pool_prepare_padded's padding (order -1, ranks_bev
// 2^31 - n + p: ascending, above every cell), so the caller needs no read-back.
template <bool kPad>
__global__ void __launch_bounds__(kBlock)
    run_heads_kernel(const int32_t* __restrict__ keys, const int64_t* __restrict__ perm, int32_t n,
                     const int32_t* __restrict__ kept, int32_t* __restrict__ order,
                     int32_t* __restrict__ ranks_bev, int32_t* __restrict__ heads) {
  const int32_t lo = kept[0], hi = kept[1];
  for (int64_t t = global_thread(); t < n; t += global_threads()) {
    const int32_t i = static_cast<int32_t>(t);
    const bool inside = i >= lo && i < hi;
    if (inside) {
      order[i - lo] = static_cast<int32_t>(perm[i]);
      ranks_bev[i - lo] = keys[i];
    }
    if (kPad && i >= hi - lo) {
      order[i] = -1;
      ranks_bev[i] = static_cast<int32_t>(kInt32Max - n + 1 + i);
    }
    heads[i] = inside && run_head(keys, i, lo) ? 1 : 0;
  }
}

// Run k (heads scanned into slots: slot[i] = k at its head i): its start and length in order.
// kPad: runs k in [n_intervals, capacity) are empty intervals (0, 0).
template <bool kPad>
__global__ void __launch_bounds__(kBlock)
    run_write_kernel(const int32_t* __restrict__ keys, int32_t n, const int32_t* __restrict__ kept,
                     const int32_t* __restrict__ slot, int32_t capacity,
                     const int32_t* __restrict__ counts, int32_t* __restrict__ interval_starts,
                     int32_t* __restrict__ interval_lengths) {
  const int32_t lo = kept[0], hi = kept[1];
  const int32_t n_intervals = kPad ? counts[1] : 0;
  for (int64_t t = global_thread(); t < n; t += global_threads()) {
    const int32_t i = static_cast<int32_t>(t);
    if (kPad && i >= n_intervals && i < capacity) {
      interval_starts[i] = 0;
      interval_lengths[i] = 0;
    }
    if (i < lo || i >= hi || !run_head(keys, i, lo)) continue;
    const int32_t k = slot[i];
    if (k < 0 || k >= capacity) continue;  // never: at most min(n, n_cells) distinct cells
    const int32_t end = lower_bound(keys, i, hi, static_cast<int64_t>(keys[i]) + 1);
    interval_starts[k] = i - lo;
    interval_lengths[k] = end - i;
  }
}

// Workspace ints of bev_pool_runs_from_sorted for n keys: kept range | heads / slots [n] | tile
// sums of the scan.
int64_t runs_workspace_layout(int64_t n, int64_t* heads, int64_t* sums) {
  *heads = 4;
  *sums = *heads + (n + 3) / 4 * 4;
  return *sums + scan::scan_tiles(n);
}

int64_t checked_dim(int64_t v, const char* name) {
  if (v < 0 || v > kInt32Max) {
    TVM_FFI_THROW(ValueError) << name << " must be in [0, " << kInt32Max << "], got " << v;
  }
  return v;
}

// --------------------------------------------------------------------------- entry points

// coords [n, 4] int32/int64 (x, y, z, batch) -> cells [n] int32 in a (B, D, H, W) grid with
// B*D*H*W <= INT32_MAX. Nothing is launched when n == 0.
void bev_pool_cells_forward(TensorView coords, TensorView cells, int64_t B, int64_t D, int64_t H,
                            int64_t W, int64_t stream) {
  check_gpu_tensor(coords, "coords");
  check_index_dtype(coords, "coords");
  check_contiguous(coords, "coords");
  check_ndim(coords, "coords", 2);
  check_size(coords, "coords", 1, 4);
  const int64_t n = coords.size(0);
  check_vector(cells, "cells", coords, kInt32, n);
  const int64_t dims_in[4] = {B, D, H, W};
  const char* const names[4] = {"B", "D", "H", "W"};
  bool empty = false;
  for (int k = 0; k < 4; ++k) empty |= checked_dim(dims_in[k], names[k]) == 0;
  int64_t n_cells = 1;
  for (int k = 0; k < 4 && !empty; ++k) {
    if (n_cells > kInt32Max / dims_in[k]) {
      TVM_FFI_THROW(ValueError) << "B*D*H*W = " << B << "*" << D << "*" << H << "*" << W
                                << " cells exceeds the int32 range of cells (" << kInt32Max << ")";
    }
    n_cells *= dims_in[k];
  }
  if (n == 0) return;

  DeviceGuard guard(coords.device().device_id);
  const Dims dims{static_cast<int32_t>(B), static_cast<int32_t>(D), static_cast<int32_t>(H),
                  static_cast<int32_t>(W)};
  const int blocks = grid_for(n, kBlock, coords.device().device_id, kCellsBlocksPerSm);
  const bool vector = is_aligned(coords, 16);
  dispatch_index(coords, "coords", [&](auto tag) {
    using I = decltype(tag);
    dispatch_bools(
        [&](auto vec) {
          coords_to_cells_kernel<I, decltype(vec)::value><<<blocks, kBlock, 0, as_stream(stream)>>>(
              data_of<const I>(coords), n, dims, data_of<int32_t>(cells));
        },
        vector);
  });
  check_launch("bev_pool_cells_forward coords_to_cells_kernel");
}

// grad_out [B, C, Z, Y, X] float32/float16/bfloat16, cells [n] int32/int64 -> grad_feat [n, C]
// (grad_out's dtype); rows [B*Z*Y*X, C] (grad_out's dtype) is scratch for the channels-last copy.
void bev_pool_rows_backward(TensorView grad_out, TensorView cells, TensorView rows,
                            TensorView grad_feat, int64_t stream) {
  check_gpu_tensor(grad_out, "grad_out");
  check_float_dtype<Bf16::kBits>(grad_out, "grad_out");
  check_contiguous(grad_out, "grad_out");
  check_ndim(grad_out, "grad_out", 5);
  check_index_input(cells, "cells", grad_out);
  check_ndim(cells, "cells", 1);
  const int64_t n = cells.size(0);
  const int64_t channels = grad_out.size(1);
  const int64_t n_cells = grad_out.size(0) * grad_out.size(2) * grad_out.size(3) * grad_out.size(4);
  check_like(rows, "rows", grad_out, "grad_out");
  check_ndim(rows, "rows", 2);
  check_size(rows, "rows", 0, n_cells);
  check_size(rows, "rows", 1, channels);
  check_like(grad_feat, "grad_feat", grad_out, "grad_out");
  check_ndim(grad_feat, "grad_feat", 2);
  check_size(grad_feat, "grad_feat", 0, n);
  check_size(grad_feat, "grad_feat", 1, channels);
  if (n_cells > kInt32Max) {
    TVM_FFI_THROW(ValueError) << "grad_out has " << n_cells << " cells (B*Z*Y*X); at most "
                              << kInt32Max << " are supported";
  }
  const int64_t row_bytes = channels * element_bytes(grad_out);
  if (row_bytes > kInt32Max) {
    TVM_FFI_THROW(ValueError) << "grad_out has " << channels << " channels; a row of at most "
                              << kInt32Max << " bytes is supported";
  }
  if (n == 0 || channels == 0) return;

  const int device_id = grad_out.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  // the widest word that divides a row and that both row arrays are aligned to
  auto fits = [&](int bytes) {
    return row_bytes % bytes == 0 && is_aligned(rows, bytes) && is_aligned(grad_feat, bytes);
  };
  if (fits(16)) {
    launch_backward<uint4>(grad_out, cells, rows, grad_feat, n, channels, n_cells, device_id, s);
  } else if (fits(8)) {
    launch_backward<uint2>(grad_out, cells, rows, grad_feat, n, channels, n_cells, device_id, s);
  } else if (fits(4)) {
    launch_backward<uint32_t>(grad_out, cells, rows, grad_feat, n, channels, n_cells, device_id, s);
  } else {
    launch_backward<uint16_t>(grad_out, cells, rows, grad_feat, n, channels, n_cells, device_id, s);
  }
}

int64_t bev_pool_runs_workspace_ints(int64_t n) {
  if (n < 0 || n > kInt32Max) {
    TVM_FFI_THROW(ValueError) << "n must be in [0, " << kInt32Max << "], got " << n;
  }
  int64_t heads = 0, sums = 0;
  return runs_workspace_layout(n, &heads, &sums);
}

// sorted_keys [n] int32 (ascending: a stable sort of the cells), perm [n] int64 (the sort's
// indices) -> order, ranks_bev [n] (the first n_kept valid), interval_starts, interval_lengths
// [min(n, n_cells)] (the first n_intervals valid), header [2] int32 = (n_kept, n_intervals).
// Keys outside [0, n_cells) are dropped. pad = 1: the entries after the valid ones hold
// bev_pool_prepare_padded's padding, which bev_pool_v2 skips (needs n + n_cells <= 2^31).
// Nothing is launched when n == 0.
void bev_pool_runs_from_sorted(TensorView sorted_keys, TensorView perm, int64_t n_cells,
                               TensorView workspace, TensorView order, TensorView ranks_bev,
                               TensorView interval_starts, TensorView interval_lengths,
                               TensorView header, int64_t pad, int64_t stream) {
  check_gpu_tensor(sorted_keys, "sorted_keys");
  check_input(sorted_keys, "sorted_keys", sorted_keys, kInt32);
  check_ndim(sorted_keys, "sorted_keys", 1);
  const int64_t n = sorted_keys.size(0);
  if (n > kInt32Max) {
    TVM_FFI_THROW(ValueError) << "sorted_keys has " << n << " entries; at most " << kInt32Max;
  }
  checked_dim(n_cells, "n_cells");
  check_vector(perm, "perm", sorted_keys, kInt64, n);
  check_vector(order, "order", sorted_keys, kInt32, n);
  check_vector(ranks_bev, "ranks_bev", sorted_keys, kInt32, n);
  const int64_t capacity = n < n_cells ? n : n_cells;
  check_vector(interval_starts, "interval_starts", sorted_keys, kInt32, capacity);
  check_vector(interval_lengths, "interval_lengths", sorted_keys, kInt32, capacity);
  check_vector(header, "header", sorted_keys, kInt32, 2);
  if (pad != 0 && pad != 1) {
    TVM_FFI_THROW(ValueError) << "pad must be 0 or 1, got " << pad;
  }
  if (pad == 1 && n + n_cells > kInt32Max + 1) {
    TVM_FFI_THROW(ValueError) << "pad = 1 needs n + n_cells <= 2^31, got " << n << " + " << n_cells;
  }
  int64_t heads_at = 0, sums_at = 0;
  const int64_t ints = runs_workspace_layout(n, &heads_at, &sums_at);
  check_input(workspace, "workspace", sorted_keys, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold at least " << ints
                              << " int32 (bev_pool_runs_workspace_ints), got " << workspace.size(0);
  }
  if (n == 0) return;

  const int device_id = sorted_keys.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  const int32_t n32 = static_cast<int32_t>(n);
  const int32_t* keys = data_of<const int32_t>(sorted_keys);
  int32_t* ws = data_of<int32_t>(workspace);
  int32_t* kept = ws;
  int32_t* heads = ws + heads_at;
  int32_t* counts = data_of<int32_t>(header);
  kept_range_kernel<<<1, kWarpSize, 0, s>>>(keys, n32, n_cells, kept, counts);
  check_launch("bev_pool_runs_from_sorted kept_range_kernel");
  const int blocks = grid_for(n, kBlock, device_id, kCellsBlocksPerSm);
  dispatch_bools(
      [&](auto padded) {
        constexpr bool kPad = decltype(padded)::value;
        run_heads_kernel<kPad><<<blocks, kBlock, 0, s>>>(keys, data_of<const int64_t>(perm), n32,
                                                         kept, data_of<int32_t>(order),
                                                         data_of<int32_t>(ranks_bev), heads);
        check_launch("bev_pool_runs_from_sorted run_heads_kernel");
        scan::exclusive_scan(heads, heads, n, ws + sums_at, counts + 1, s,
                             "bev_pool_runs_from_sorted scan");  // counts[1] = n_intervals
        run_write_kernel<kPad><<<blocks, kBlock, 0, s>>>(
            keys, n32, kept, heads, static_cast<int32_t>(capacity), counts,
            data_of<int32_t>(interval_starts), data_of<int32_t>(interval_lengths));
      },
      pad == 1);
  check_launch("bev_pool_runs_from_sorted run_write_kernel");
}

}  // namespace
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_cells_forward, muspace::bev_pool_cells_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_rows_backward, muspace::bev_pool_rows_backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_runs_workspace_ints, muspace::bev_pool_runs_workspace_ints);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bev_pool_runs_from_sorted, muspace::bev_pool_runs_from_sorted);
