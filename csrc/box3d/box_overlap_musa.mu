// Pairwise BEV overlap / IoU of rotated rectangles: boxes_overlap_bev, boxes_iou_bev,
// box_iou_rotated (mmcv) and OpenPCDet's boxes_iou_bev.
//
//   out[i, j] = value(a_i, b_j)     (aligned: out[i] = value(a_i, b_i))
//
// value is one of box3d::Kind (overlap area, iou3d's IoU with its 1e-8 floor, box_iou_rotated's
// IoU / IoF with its 1e-14 area rule), computed by box3d::pair_value: the exact intersection of
// the two rectangles (Sutherland-Hodgman in the frame of b, float32, each operation rounded),
// NaN for a non-finite box, 0 for a size <= 0. boxes_a [N, 7 | 5], boxes_b [M, 7 | 5] of one
// dtype (float32 / float16 / bfloat16), out [N, M] (or [N]) in that dtype.
//
// Launch: 32 x 8 threads per block, a tile of 32 columns x 32 rows (4 rows per thread), both
// tiles' rectangles (with cos / sin) in shared memory; consecutive threads write consecutive
// columns. Far-apart pairs (~99% of a detector's 1000 x 1000) cost a few compares; the pairs
// that need the polygon clip (box3d::needs_clip) are queued in shared memory and then clipped
// by all 256 threads together, so one lane's clip no longer stalls its warp (with per-lane
// clipping ~1 warp iteration in 4 waited for a clip at 1% near pairs).
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

constexpr int kTileX = 32;  // columns (b) per block
constexpr int kTileY = 32;  // rows (a) per block
constexpr int kThreadsY = 8;
constexpr int kRowsPerThread = kTileY / kThreadsY;
constexpr int kAlignedThreads = 256;
constexpr int kMaxGridY = 65535;

template <typename T>
__global__ void __launch_bounds__(kTileX* kThreadsY)
    pairwise_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out,
                    int64_t na, int64_t nb, int layout, int kind, float angle_sign) {
  __shared__ Rect s_a[kTileY];
  __shared__ Rect s_b[kTileX];
  __shared__ unsigned short s_queue[kTileX * kTileY];  // (row << 5) | column of a pair to clip
  __shared__ unsigned int s_queued;
  const int tid = threadIdx.y * kTileX + threadIdx.x;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTileX;
  const int64_t j = j0 + threadIdx.x;
  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTileY; row0 < na;
       row0 += static_cast<int64_t>(gridDim.y) * kTileY) {
    __syncthreads();  // the previous rows' queue is done
    if (tid == 0) s_queued = 0;
    if (tid < kTileX) {
      const int64_t jj = j0 + tid;
      s_b[tid] = jj < nb ? load_rect(b, jj, layout, angle_sign) : nan_rect();
    } else if (tid < kTileX + kTileY) {
      const int64_t ii = row0 + (tid - kTileX);
      s_a[tid - kTileX] = ii < na ? load_rect(a, ii, layout, angle_sign) : nan_rect();
    }
    __syncthreads();
    if (j < nb) {
      const Rect rb = s_b[threadIdx.x];
#pragma unroll
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int local = threadIdx.y + r * kThreadsY;
        const int64_t i = row0 + local;
        if (i >= na) continue;
        const Rect& ra = s_a[local];
        if (needs_clip(ra, rb, kind)) {
          s_queue[atomicAdd(&s_queued, 1u)] =
              static_cast<unsigned short>((local << 5) | threadIdx.x);
        } else {  // an empty overlap: a few compares
          out[i * nb + j] = from_float<T>(kind <= kRotatedIoF ? unclipped_value(ra, rb)
                                                              : pair_value(ra, rb, kind));
        }
      }
    }
    __syncthreads();
    const unsigned int queued = s_queued;
    for (unsigned int q = tid; q < queued; q += kTileX * kThreadsY) {
      const int local = s_queue[q] >> 5;
      const int col = s_queue[q] & (kTileX - 1);
      out[(row0 + local) * nb + j0 + col] = from_float<T>(pair_value(s_a[local], s_b[col], kind));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAlignedThreads)
    aligned_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t n,
                   int layout, int kind, float angle_sign) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    out[i] = from_float<T>(
        pair_value(load_rect(a, i, layout, angle_sign), load_rect(b, i, layout, angle_sign), kind));
  }
}

// boxes_a [N, W], boxes_b [M, W] (W = 7 for layout kLidar7, 5 for kXywhr / kXyxyr) of one dtype,
// out [N, M], or [N] when aligned (N == M), in that dtype; kind: box3d::Kind 0..4; flip_angle:
// negate the angles (box_iou_rotated with clockwise=False).
void pairwise(TensorView boxes_a, TensorView boxes_b, TensorView out, int64_t layout, int64_t kind,
              bool aligned, bool flip_angle, int64_t stream) {
  check_gpu_tensor(boxes_a, "boxes_a");
  check_float_dtype(boxes_a, "boxes_a");
  check_contiguous(boxes_a, "boxes_a");
  if (layout != kLidar7 && layout != kXywhr && layout != kXyxyr) {
    TVM_FFI_THROW(ValueError) << "layout must be 0 (LiDAR 7), 1 (xywhr) or 2 (xyxyr), got "
                              << layout;
  }
  if (kind < kOverlap || kind > kNormal) {
    TVM_FFI_THROW(ValueError) << "kind must be in [0, 4], got " << kind;
  }
  const int width = layout == kLidar7 ? 7 : 5;
  check_ndim(boxes_a, "boxes_a", 2);
  check_size(boxes_a, "boxes_a", 1, width);
  check_like(boxes_b, "boxes_b", boxes_a, "boxes_a");
  check_ndim(boxes_b, "boxes_b", 2);
  check_size(boxes_b, "boxes_b", 1, width);
  check_like(out, "out", boxes_a, "boxes_a");
  const int64_t na = boxes_a.size(0), nb = boxes_b.size(0);
  if (aligned) {
    check_size(boxes_b, "boxes_b", 0, na);
    check_ndim(out, "out", 1);
    check_size(out, "out", 0, na);
  } else {
    check_ndim(out, "out", 2);
    check_size(out, "out", 0, na);
    check_size(out, "out", 1, nb);
  }
  if (na == 0 || nb == 0) return;
  const int device_id = boxes_a.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const float sign = flip_angle ? -1.0f : 1.0f;
  dispatch_float(boxes_a, "boxes_a", [&](auto tag) {
    using T = decltype(tag);
    if (aligned) {
      aligned_kernel<T><<<grid_for(na, kAlignedThreads, device_id, 0), kAlignedThreads, 0, st>>>(
          data_of<const T>(boxes_a), data_of<const T>(boxes_b), data_of<T>(out), na,
          static_cast<int>(layout), static_cast<int>(kind), sign);
      check_launch("box3d aligned_kernel");
    } else {
      const int64_t gx = (nb + kTileX - 1) / kTileX;
      const int64_t gy = std::min<int64_t>((na + kTileY - 1) / kTileY, kMaxGridY);
      if (gx > INT_MAX) TVM_FFI_THROW(ValueError) << "boxes_b has too many rows: " << nb;
      pairwise_kernel<T>
          <<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(kTileX, kThreadsY), 0,
             st>>>(data_of<const T>(boxes_a), data_of<const T>(boxes_b), data_of<T>(out), na, nb,
                   static_cast<int>(layout), static_cast<int>(kind), sign);
      check_launch("box3d pairwise_kernel");
    }
  });
}

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(box3d_bev_pairwise, muspace::box3d::pairwise);
