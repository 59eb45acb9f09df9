// RoIPointPool3d (mmcv): the first S points of each box, their coordinates and features.
//
//   pts_idx[b, m, k]   = the k-th point (ascending index) of batch b inside box m, k < cnt;
//                        for cnt <= k < S: pts_idx[b, m, k % cnt] (mmcv's duplication)
//   pooled[b, m, k, :] = (points[b, p, 0:3], point_features[b, p, :]) with p = pts_idx[b, m, k]
//   empty[b, m]        = 1 if no point is inside (pooled all zero), else 0
//
// points [B, P, 3], point_features [B, P, C], boxes3d [B, M, 7] (z at the bottom), one dtype
// (float32 / float16 / bfloat16), pooled [B, M, S, 3 + C] in that dtype, empty int32. The test
// is box3d::point_in_box.
//
// 1. bits_kernel: one thread per point, 32 boxes per block through shared memory: one bit per
//    (box, point), packed into 32-bit words with shared-memory atomicOr (no warp intrinsics),
//    bits[b, m, w] bit i = point 32 w + i is inside box m.
// 2. select_kernel: one block per (box, batch) walks its words in order with a block prefix
//    sum of their popcounts, writes the first S indices and stops; then fills the duplicates.
// 3. gather_kernel: one thread per output element (consecutive threads, consecutive elements).
// mmcv materialises a [B, P, M] int32 mask and walks every point of a box with one thread.
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

constexpr int kThreads = 256;
constexpr int kBitsBoxes = 32;                 // boxes per block of bits_kernel
constexpr int kWordsPerBlock = kThreads / 32;  // 32-bit words of one box per block
constexpr int kMaxGridY = 65535;
constexpr int64_t kMaxPoints = INT_MAX - 64;
MUSPACE_LIMIT(roipoint_pool3d, max_points, kMaxPoints);
constexpr int kGatherBlocksPerSM = 16;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    bits_kernel(const T* __restrict__ points, const T* __restrict__ boxes,
                uint32_t* __restrict__ bits, int batches, int n_points, int n_boxes, int words) {
  __shared__ PointBox s_box[kBitsBoxes];
  __shared__ uint32_t s_words[kBitsBoxes * kWordsPerBlock];
  // int64: the last block's threads reach n_points + kThreads - 1
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int m0 = blockIdx.y * kBitsBoxes;
  const int nm = min(kBitsBoxes, n_boxes - m0);
  for (int b = blockIdx.z; b < batches; b += gridDim.z) {
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < nm) {
      float v[7];
      const T* q = boxes + (static_cast<int64_t>(b) * n_boxes + m0 + threadIdx.x) * 7;
#pragma unroll
      for (int k = 0; k < 7; ++k) v[k] = to_float(q[k]);
      s_box[threadIdx.x] = make_point_box(v);
    }
    for (int i = threadIdx.x; i < kBitsBoxes * kWordsPerBlock; i += kThreads) s_words[i] = 0u;
    __syncthreads();
    if (p < n_points) {
      const T* q = points + (static_cast<int64_t>(b) * n_points + p) * 3;
      const float x = to_float(q[0]), y = to_float(q[1]), z = to_float(q[2]);
      const uint32_t bit = 1u << (threadIdx.x % 32);
      for (int k = 0; k < nm; ++k) {
        if (point_in_box(s_box[k], x, y, z)) {
          atomicOr(&s_words[k * kWordsPerBlock + threadIdx.x / 32], bit);
        }
      }
    }
    __syncthreads();
    const int k = threadIdx.x / kWordsPerBlock;
    const int w = blockIdx.x * kWordsPerBlock + threadIdx.x % kWordsPerBlock;
    if (k < nm && w < words) {
      bits[(static_cast<int64_t>(b) * n_boxes + m0 + k) * words + w] =
          s_words[k * kWordsPerBlock + threadIdx.x % kWordsPerBlock];
    }
  }
}

// Exclusive prefix sum of one int per thread over the block (Hillis-Steele in shared memory);
// returns this thread's prefix and sets *total. Every thread must call it.
__device__ __forceinline__ int block_exclusive_scan(int v, int* s_scan, int* total) {
  const int tid = threadIdx.x;
  s_scan[tid] = v;
  __syncthreads();
  for (int off = 1; off < kThreads; off <<= 1) {
    const int add_v = tid >= off ? s_scan[tid - off] : 0;
    __syncthreads();
    s_scan[tid] += add_v;
    __syncthreads();
  }
  const int inclusive = s_scan[tid];
  *total = s_scan[kThreads - 1];
  __syncthreads();  // s_scan may be reused by the caller
  return inclusive - v;
}

__global__ void __launch_bounds__(kThreads)
    select_kernel(const uint32_t* __restrict__ bits, int* __restrict__ idx, int* __restrict__ empty,
                  int batches, int n_boxes, int words, int samples) {
  __shared__ int s_scan[kThreads];
  const int m = blockIdx.x;
  for (int b = blockIdx.y; b < batches; b += gridDim.y) {
    const int64_t bm = static_cast<int64_t>(b) * n_boxes + m;
    const uint32_t* row = bits + bm * words;
    int* out = idx + bm * samples;
    int found = 0;  // block-uniform
    for (int w0 = 0; w0 < words && found < samples; w0 += kThreads) {
      const int w = w0 + threadIdx.x;
      const uint32_t word = w < words ? row[w] : 0u;
      int total = 0;
      int rank = found + block_exclusive_scan(__popc(word), s_scan, &total);
      for (uint32_t rest = word; rest && rank < samples; rest &= rest - 1, ++rank) {
        out[rank] = w * 32 + (__ffs(static_cast<int>(rest)) - 1);
      }
      found += total;
    }
    const int cnt = min(found, samples);
    __syncthreads();  // the first cnt indices are written
    for (int k = cnt + threadIdx.x; cnt > 0 && k < samples; k += kThreads) out[k] = out[k % cnt];
    if (threadIdx.x == 0) empty[bm] = cnt == 0 ? 1 : 0;
    __syncthreads();
  }
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const T* __restrict__ points, const T* __restrict__ feats,
                  const int* __restrict__ idx, const int* __restrict__ empty, T* __restrict__ out,
                  I n_out, I n_points, I n_boxes, I samples, I channels) {
  const I width = channels + 3;
  for (I e = static_cast<I>(global_thread()); e < n_out; e += static_cast<I>(global_threads())) {
    const I row = e / width;  // (b, m, k)
    const I ch = e - row * width;
    const I bm = row / samples;
    const I b = bm / n_boxes;
    float v = 0.0f;
    if (!empty[bm]) {
      const I p = idx[row];
      if (p >= 0 && p < n_points) {  // always, for the indices select_kernel writes
        v = ch < 3 ? to_float(points[(b * n_points + p) * 3 + ch])
                   : to_float(feats[(b * n_points + p) * channels + (ch - 3)]);
      }
    }
    out[e] = from_float<T>(v);
  }
}

// points [B, P, 3], point_features [B, P, C], boxes3d [B, M, 7] (one float dtype); workspaces
// bits int32 [B, M, ceil(P / 32)] and idx int32 [B, M, S]; outputs pooled [B, M, S, 3 + C] (the
// dtype) and empty int32 [B, M].
void forward(TensorView points, TensorView point_features, TensorView boxes3d, TensorView bits,
             TensorView idx, TensorView pooled, TensorView empty, int64_t stream) {
  check_gpu_tensor(points, "points");
  check_float_dtype(points, "points");
  check_contiguous(points, "points");
  check_ndim(points, "points", 3);
  check_size(points, "points", 2, 3);
  const int64_t B = points.size(0), P = points.size(1);
  check_like(point_features, "point_features", points, "points");
  check_ndim(point_features, "point_features", 3);
  check_size(point_features, "point_features", 0, B);
  check_size(point_features, "point_features", 1, P);
  const int64_t C = point_features.size(2);
  check_like(boxes3d, "boxes3d", points, "points");
  check_ndim(boxes3d, "boxes3d", 3);
  check_size(boxes3d, "boxes3d", 0, B);
  check_size(boxes3d, "boxes3d", 2, 7);
  const int64_t M = boxes3d.size(1);
  check_input(idx, "idx", points, kInt32);
  check_ndim(idx, "idx", 3);
  check_size(idx, "idx", 0, B);
  check_size(idx, "idx", 1, M);
  const int64_t S = idx.size(2);
  const int64_t words = (P + 31) / 32;
  check_input(bits, "bits", points, kInt32);
  check_ndim(bits, "bits", 3);
  check_size(bits, "bits", 0, B);
  check_size(bits, "bits", 1, M);
  check_size(bits, "bits", 2, words);
  check_like(pooled, "pooled", points, "points");
  check_ndim(pooled, "pooled", 4);
  check_size(pooled, "pooled", 0, B);
  check_size(pooled, "pooled", 1, M);
  check_size(pooled, "pooled", 2, S);
  check_size(pooled, "pooled", 3, C + 3);
  check_input(empty, "empty", points, kInt32);
  check_ndim(empty, "empty", 2);
  check_size(empty, "empty", 0, B);
  check_size(empty, "empty", 1, M);
  if (P > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << P << " points per batch exceed the limit of " << kMaxPoints;
  }
  if (M > INT_MAX || S > INT_MAX || B > INT_MAX || C > INT_MAX - 3) {
    TVM_FFI_THROW(ValueError) << "boxes3d / num_sampled_points / point_features too large";
  }
  if (B == 0 || M == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const int gz = static_cast<int>(std::min<int64_t>(B, kMaxGridY));
  if (P > 0) {
    const int64_t box_tiles = (M + kBitsBoxes - 1) / kBitsBoxes;
    if (box_tiles > kMaxGridY) {
      TVM_FFI_THROW(ValueError) << M << " boxes exceed the limit of "
                                << static_cast<int64_t>(kMaxGridY) * kBitsBoxes;
    }
    dispatch_float(points, "points", [&](auto tag) {
      using T = decltype(tag);
      const dim3 grid(static_cast<unsigned>((P + kThreads - 1) / kThreads),
                      static_cast<unsigned>(box_tiles), gz);
      bits_kernel<T><<<grid, kThreads, 0, st>>>(
          data_of<const T>(points), data_of<const T>(boxes3d), data_of<uint32_t>(bits),
          static_cast<int>(B), static_cast<int>(P), static_cast<int>(M), static_cast<int>(words));
      check_launch("roipoint_pool3d bits_kernel");
    });
  }
  select_kernel<<<dim3(static_cast<unsigned>(M), gz), kThreads, 0, st>>>(
      data_of<const uint32_t>(bits), data_of<int>(idx), data_of<int>(empty), static_cast<int>(B),
      static_cast<int>(M), static_cast<int>(words), static_cast<int>(S));
  check_launch("roipoint_pool3d select_kernel");
  const int64_t n_out = pooled.numel();
  if (n_out == 0) return;
  dispatch_float(points, "points", [&](auto tag) {
    using T = decltype(tag);
    const int grid = grid_for(n_out, kThreads, device_id, kGatherBlocksPerSM);
    auto launch = [&](auto i_tag) {
      using I = decltype(i_tag);
      gather_kernel<T, I><<<grid, kThreads, 0, st>>>(
          data_of<const T>(points), data_of<const T>(point_features), data_of<const int>(idx),
          data_of<const int>(empty), data_of<T>(pooled), static_cast<I>(n_out), static_cast<I>(P),
          static_cast<I>(M), static_cast<I>(S), static_cast<I>(C));
    };
    // 32-bit index arithmetic when every offset fits (the common case: cheaper divisions);
    // n_out <= INT_MAX / 2 also keeps the grid-stride step e += grid * block from overflowing
    if (n_out <= INT_MAX / 2 && B * P * std::max<int64_t>(C, 3) < INT_MAX) {
      launch(int32_t{});
    } else {
      launch(int64_t{});
    }
    check_launch("roipoint_pool3d gather_kernel");
  });
}

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(roipoint_pool3d_forward, muspace::box3d::forward);
