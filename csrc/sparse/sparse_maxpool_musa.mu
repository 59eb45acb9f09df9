// sparse_maxpool for MUSA and CUDA over the rule book (mu_space/ops/sparse_maxpool.py has the
// rules; docs/operators/sparse_conv.md "Native kernels"):
//
//   sparse_maxpool_forward   out := -inf, hit := 0; per offset k in ascending order (one launch
//                            each, a thread per (pair, VEC channels)):
//                              out[o, c] = maximum(out[o, c], features[i, c])  (NaN propagates,
//                              as torch.maximum), hit[o] = 1
//                            then rows no pair reaches := 0. The output rows of one offset are
//                            distinct, so the read-modify-writes never conflict. The maximum is
//                            exact in any dtype (one of its inputs): equal to the reference.
//   sparse_maxpool_backward  acc (float32, zeroed here) per offset in ascending order:
//                              acc[i, c] += grad_out[o, c]  where features[i, c] == out[o, c]
//                            (spconv's / mmcv's tie rule: every input equal to the maximum gets
//                            the output's gradient); the caller casts acc once. The input rows of
//                            one offset are distinct: no conflicts, the reference's order.
//
// `counts` is the host copy of sparse_pairs_check's clamped counts (the caller's one host
// synchronisation); every row is bounds-checked (a bad pair is skipped).

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>

#include <climits>
#include <cstdint>

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

__device__ __forceinline__ float nan_max(float a, float b) {
  if (a != a || b != b) return a + b;  // NaN in, NaN out (torch.maximum)
  return a > b ? a : b;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlock)
    pool_offset_kernel(const T* __restrict__ features, int64_t n_in, int channels,
                       const int* __restrict__ pairs, int64_t cap, int k, int64_t count,
                       int64_t n_out, T* __restrict__ out, int* __restrict__ hit) {
  const int chunks = channels / VEC;
  const int64_t total = count * chunks;
  const int* in_rows = pairs + (2 * static_cast<int64_t>(k)) * cap;
  const int* out_rows = in_rows + cap;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t j = e / chunks;
    const int c = static_cast<int>(e - j * chunks) * VEC;
    const int64_t i = in_rows[j];
    const int64_t o = out_rows[j];
    if (i < 0 || i >= n_in || o < 0 || o >= n_out) continue;
    float f[VEC], m[VEC];
    Vec<T, VEC>::load(features + i * channels + c).unpack(f);
    T* dst = out + o * channels + c;
    Vec<T, VEC>::load(dst).unpack(m);
#pragma unroll
    for (int v = 0; v < VEC; ++v) m[v] = nan_max(m[v], f[v]);
    Vec<T, VEC>::pack(m).store(dst);
    if (c == 0) hit[o] = 1;
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    pool_unreached_kernel(int64_t n_out, int channels, const int* __restrict__ hit,
                          T* __restrict__ out) {
  const int64_t total = n_out * channels;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    if (!hit[e / channels]) out[e] = from_float<T>(0.0f);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kBlock)
    pool_grad_offset_kernel(const T* __restrict__ grad_out, const T* __restrict__ features,
                            const T* __restrict__ out, int64_t n_in, int channels,
                            const int* __restrict__ pairs, int64_t cap, int k, int64_t count,
                            int64_t n_out, float* __restrict__ acc) {
  const int chunks = channels / VEC;
  const int64_t total = count * chunks;
  const int* in_rows = pairs + (2 * static_cast<int64_t>(k)) * cap;
  const int* out_rows = in_rows + cap;
  for (int64_t e = global_thread(); e < total; e += global_threads()) {
    const int64_t j = e / chunks;
    const int c = static_cast<int>(e - j * chunks) * VEC;
    const int64_t i = in_rows[j];
    const int64_t o = out_rows[j];
    if (i < 0 || i >= n_in || o < 0 || o >= n_out) continue;
    float f[VEC], m[VEC], g[VEC], a[VEC];
    Vec<T, VEC>::load(features + i * channels + c).unpack(f);
    Vec<T, VEC>::load(out + o * channels + c).unpack(m);
    Vec<T, VEC>::load(grad_out + o * channels + c).unpack(g);
    float* dst = acc + i * channels + c;
    load_floats<float, VEC>(dst, a);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      if (f[v] == m[v]) a[v] += g[v];
    }
    store_floats<float, VEC>(dst, a);
  }
}

// ------------------------------------------------------------------------------ host helpers

int64_t check_counts(const Shape& counts, const RuleBook& rb) {
  if (static_cast<int64_t>(counts.size()) != rb.k) {
    TVM_FFI_THROW(ValueError) << "counts must have K = " << rb.k << " values, got "
                              << counts.size();
  }
  int64_t total = 0;
  for (int64_t k = 0; k < rb.k; ++k) {
    if (counts[k] < 0 || counts[k] > rb.cap) {
      TVM_FFI_THROW(ValueError) << "counts[" << k << "] = " << counts[k] << " is outside [0, "
                                << rb.cap << "]";
    }
    total += counts[k];
  }
  return total;
}

template <typename T>
uint32_t negative_infinity_word() {
  if constexpr (sizeof(T) == 4) {
    return 0xff800000u;
  } else if constexpr (std::is_same_v<T, half>) {
    return fill_word<uint16_t>(0xfc00u);
  } else {
    return fill_word<uint16_t>(0xff80u);  // bfloat16
  }
}

// ------------------------------------------------------------------------------ entry points

void forward_entry(TensorView features, TensorView indice_pairs, Shape counts, TensorView out,
                   TensorView hit, int64_t stream) {
  check_gpu_tensor(features, "features");
  check_float_dtype(features, "features");
  check_contiguous(features, "features");
  check_ndim(features, "features", 2);
  check_rows(features.size(0), "features");
  const RuleBook rb = check_pairs(indice_pairs, features);
  check_counts(counts, rb);
  check_like(out, "out", features, "features");
  check_ndim(out, "out", 2);
  check_size(out, "out", 1, features.size(1));
  const int64_t n_out = out.size(0);
  check_rows(n_out, "out");
  check_vector(hit, "hit", features, kInt32, n_out);
  const int64_t channels = features.size(1);
  if (n_out == 0 || channels == 0) return;
  const int device_id = features.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  dispatch_float(features, "features", [&](auto tag) {
    using T = decltype(tag);
    launch_fill(data_of(out), out.numel() * static_cast<int64_t>(sizeof(T)),
                negative_infinity_word<T>(), device_id, st, "sparse_maxpool_forward (out fill)");
    launch_zero(data_of(hit), n_out * 4, device_id, st, "sparse_maxpool_forward (hit fill)");
    const int b = static_cast<int>(sizeof(T));
    const int vec = pick_vec(channels, 8, {{data_of(features), b}, {data_of(out), b}});
    dispatch_int<8, 4, 2, 1>(vec, [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      for (int64_t k = 0; k < rb.k; ++k) {
        const int64_t count = counts[k];
        if (count == 0) continue;
        pool_offset_kernel<T, VEC>
            <<<rows_blocks(count * (channels / VEC), device_id), kBlock, 0, st>>>(
                data_of<const T>(features), features.size(0), static_cast<int>(channels),
                data_of<const int>(indice_pairs), rb.cap, static_cast<int>(k), count, n_out,
                data_of<T>(out), data_of<int>(hit));
        check_launch("sparse_maxpool_forward pool_offset_kernel");
      }
    });
    pool_unreached_kernel<T><<<rows_blocks(n_out * channels, device_id), kBlock, 0, st>>>(
        n_out, static_cast<int>(channels), data_of<const int>(hit), data_of<T>(out));
    check_launch("sparse_maxpool_forward pool_unreached_kernel");
  });
}

// out: the forward's result (sparse_maxpool_forward); acc [N, C] float32, zeroed here.
void backward_entry(TensorView grad_out, TensorView features, TensorView out,
                    TensorView indice_pairs, Shape counts, TensorView acc, int64_t stream) {
  check_gpu_tensor(features, "features");
  check_float_dtype(features, "features");
  check_contiguous(features, "features");
  check_ndim(features, "features", 2);
  check_rows(features.size(0), "features");
  const RuleBook rb = check_pairs(indice_pairs, features);
  check_counts(counts, rb);
  check_like(out, "out", features, "features");
  check_ndim(out, "out", 2);
  check_size(out, "out", 1, features.size(1));
  const int64_t n_out = out.size(0);
  check_rows(n_out, "out");
  check_like(grad_out, "grad_out", features, "features");
  check_same_shape(grad_out, "grad_out", out, "out");
  check_input(acc, "acc", features, kFloat32);
  check_same_shape(acc, "acc", features, "features");
  const int64_t channels = features.size(1);
  if (acc.numel() == 0) return;
  const int device_id = features.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  launch_zero(data_of(acc), acc.numel() * 4, device_id, st, "sparse_maxpool_backward (acc fill)");
  if (n_out == 0) return;
  dispatch_float(features, "features", [&](auto tag) {
    using T = decltype(tag);
    const int b = static_cast<int>(sizeof(T));
    const int vec = pick_vec(
        channels, 8,
        {{data_of(features), b}, {data_of(out), b}, {data_of(grad_out), b}, {data_of(acc), 4}});
    dispatch_int<8, 4, 2, 1>(vec, [&](auto v) {
      constexpr int VEC = decltype(v)::value;
      for (int64_t k = 0; k < rb.k; ++k) {
        const int64_t count = counts[k];
        if (count == 0) continue;
        pool_grad_offset_kernel<T, VEC>
            <<<rows_blocks(count * (channels / VEC), device_id), kBlock, 0, st>>>(
                data_of<const T>(grad_out), data_of<const T>(features), data_of<const T>(out),
                features.size(0), static_cast<int>(channels), data_of<const int>(indice_pairs),
                rb.cap, static_cast<int>(k), count, n_out, data_of<float>(acc));
        check_launch("sparse_maxpool_backward pool_grad_offset_kernel");
      }
    });
  });
}

}  // namespace
}  // namespace sparse
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_maxpool_forward, muspace::sparse::forward_entry);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sparse_maxpool_backward, muspace::sparse::backward_entry);
