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

namespace muspace {
namespace sparse {
namespace {

using tvm::ffi::Shape;

MUSPACE_LIMIT(sparse_conv, max_pairs, kMaxPairs);
MUSPACE_LIMIT(sparse_maxpool, max_pairs, kMaxPairs);

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

// src [R, C] float32 / float16 / bfloat16; map [rows, K] int32 (a row block of a neighbour
// map); cols [rows, K * C], src's dtype or float32.
void im2col_entry(TensorView src, TensorView map, TensorView cols, int64_t stream) {
  check_gpu_tensor(src, "src");
  check_float_dtype(src, "src");
  check_contiguous(src, "src");
  check_ndim(src, "src", 2);
  check_rows(src.size(0), "src");
  check_input(map, "map", src, kInt32);
  check_ndim(map, "map", 2);
  const int64_t k_volume = map.size(1);
  if (k_volume < 1 || k_volume > kMaxRuleBookVolume) {
    TVM_FFI_THROW(ValueError) << "map.shape[1] (K) must be in [1, " << kMaxRuleBookVolume
                              << "], got " << k_volume;
  }
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

}  // namespace
}  // namespace sparse
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_pairs_check, muspace::sparse::pairs_check_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_gather, muspace::sparse::gather_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_scatter, muspace::sparse::scatter_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_maps, muspace::sparse::maps_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_conv_im2col, muspace::sparse::im2col_entry);
