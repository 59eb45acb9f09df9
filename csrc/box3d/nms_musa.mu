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
// 1. mask_kernel: the 64 x 64 tiles of the suppression matrix on and above the diagonal,
//    mask[i][w] bit r = box i suppresses box 64*w + r (> i). One block of 64 threads per tile
//    (tiles below the diagonal return at once); far-apart pairs cost a few compares.
// 2. reduce_kernel: one block walks the 64-box tiles in order. Thread 0 resolves a tile
//    sequentially from the removed-bits word of the tile and the tile's diagonal words (shared
//    memory, prefetched one tile ahead: they do not depend on the decisions); then all threads
//    OR the kept rows' words into the removed bits of the later tiles. It writes
//    keep[k] = order[kept box] and count, and stops early at max_keep.
// The mask holds N * ceil(N / 64) 64-bit words (the caller's workspace, plus ceil(N / 64) words
// of removed bits): no box-count limit but memory (and 65535 * 64 boxes for the tile grid).
// Everything runs on the caller's stream; the caller reads `count` back (the one sync).
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

constexpr int kTile = 64;  // boxes per tile: one 64-bit word of the mask
constexpr int kReduceThreads = 256;
constexpr int64_t kMaxTiles = 65535;  // tile rows of the mask grid (grid.y)
constexpr int64_t kMaxBoxes = kMaxTiles * kTile;
MUSPACE_LIMIT(box3d_nms, max_boxes, kMaxBoxes);

using Word = unsigned long long;

template <typename T>
__device__ __forceinline__ Rect load_ordered(const T* __restrict__ boxes, const int64_t* order,
                                             int64_t k, int64_t n_rows, int layout) {
  const int64_t row = order[k];
  if (row < 0 || row >= n_rows) return nan_rect();  // a bad order entry: a NaN box
  return load_rect(boxes, row, layout, 1.0f);
}

template <typename T, int kKind>
__global__ void __launch_bounds__(kTile)
    mask_kernel(const T* __restrict__ boxes, const int64_t* __restrict__ order,
                Word* __restrict__ mask, int64_t n, int64_t n_rows, int layout, float threshold) {
  const int c = blockIdx.x;  // column tile
  const int r = blockIdx.y;  // row tile
  if (c < r) return;         // below the diagonal: never read
  __shared__ Rect s_col[kTile];
  const int64_t words = (n + kTile - 1) / kTile;
  const int64_t j0 = static_cast<int64_t>(c) * kTile;
  const int cols = static_cast<int>(::min(static_cast<int64_t>(kTile), n - j0));
  if (static_cast<int>(threadIdx.x) < cols) {
    s_col[threadIdx.x] = load_ordered(boxes, order, j0 + threadIdx.x, n_rows, layout);
  }
  __syncthreads();
  const int64_t i = static_cast<int64_t>(r) * kTile + threadIdx.x;
  if (i >= n) return;
  const Rect a = load_ordered(boxes, order, i, n_rows, layout);
  Word bits = 0;
  const int start = c == r ? static_cast<int>(threadIdx.x) + 1 : 0;
  for (int k = start; k < cols; ++k) {
    if (suppresses(pair_value(a, s_col[k], kKind), threshold, kKind)) bits |= Word{1} << k;
  }
  mask[i * words + c] = bits;
}

// Lowest set bit of a nonzero word.
__device__ __forceinline__ int lowest_bit(Word w) { return __ffsll(static_cast<long long>(w)) - 1; }

__global__ void __launch_bounds__(kReduceThreads)
    reduce_kernel(const Word* __restrict__ mask, Word* __restrict__ removed,
                  const int64_t* __restrict__ order, int64_t* __restrict__ keep,
                  int64_t* __restrict__ count_out, int64_t n, int64_t max_keep) {
  __shared__ Word s_diag[2][kTile];
  __shared__ Word s_kept;
  __shared__ int64_t s_count;
  __shared__ int s_stop;
  const int tid = threadIdx.x;
  const int64_t words = (n + kTile - 1) / kTile;
  for (int64_t w = tid; w < words; w += kReduceThreads) removed[w] = 0;
  if (tid < kTile) s_diag[0][tid] = tid < n ? mask[static_cast<int64_t>(tid) * words] : 0;
  int64_t count = 0;  // thread 0's
  __syncthreads();
  for (int64_t k = 0; k < words; ++k) {
    const int buf = static_cast<int>(k & 1);
    // the next tile's diagonal words, while thread 0 resolves this one
    if (k + 1 < words && tid >= kTile && tid < 2 * kTile) {
      const int64_t row = (k + 1) * kTile + (tid - kTile);
      s_diag[buf ^ 1][tid - kTile] = row < n ? mask[row * words + k + 1] : 0;
    }
    if (tid == 0) {
      const int rows = static_cast<int>(::min(static_cast<int64_t>(kTile), n - k * kTile));
      const Word valid = rows == kTile ? ~Word{0} : (Word{1} << rows) - 1;
      Word cur = removed[k];
      Word kept = 0;
      int stop = 0;
      Word candidates = ~cur & valid;
      while (candidates) {
        const int r = lowest_bit(candidates);
        kept |= Word{1} << r;
        keep[count++] = order[k * kTile + r];
        if (count == max_keep) {
          stop = 1;
          break;
        }
        cur |= s_diag[buf][r];
        const Word above = r == kTile - 1 ? Word{0} : ~Word{0} << (r + 1);
        candidates = ~cur & valid & above;
      }
      s_kept = kept;
      s_count = count;
      s_stop = stop;
    }
    __syncthreads();
    if (s_stop) break;  // block-uniform
    const Word kept = s_kept;
    if (kept) {
      for (int64_t w = k + 1 + tid; w < words; w += kReduceThreads) {
        Word acc = 0;
        for (Word bits = kept; bits; bits &= bits - 1) {
          acc |= mask[(k * kTile + lowest_bit(bits)) * words + w];
        }
        removed[w] |= acc;  // word w has one owner in this step
      }
    }
    __syncthreads();  // removed[] and s_diag[buf ^ 1] ready for the next tile
  }
  if (tid == 0) count_out[0] = n == 0 ? 0 : s_count;
}

// boxes [n_rows, W] (layout: box3d::Layout; W = 7, 5, 5, 3), order [n] int64 (rows of boxes in
// visiting order), workspace int64 [n * ceil(n/64) + ceil(n/64)], keep int64 [n] (the first
// count entries are written), count int64 [1]. kind: box3d::Kind 1, 2, 4 or 5; threshold: the
// float32 threshold (circle: already rounded down); max_keep <= 0: no limit.
void nms(TensorView boxes, TensorView order, TensorView workspace, TensorView keep,
         TensorView count, int64_t layout, int64_t kind, float threshold, int64_t max_keep,
         int64_t stream) {
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
  const int64_t words = (n + kTile - 1) / kTile;
  check_input(workspace, "workspace", boxes, kInt64);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < n * words + words) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << n * words + words << " int64, got "
                              << workspace.size(0);
  }
  check_vector(keep, "keep", boxes, kInt64, n);
  check_vector(count, "count", boxes, kInt64, 1);
  const int device_id = boxes.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (n == 0) {
    launch_zero(data_of(count), 8, device_id, st, "box3d_nms fill (count)");
    return;
  }
  Word* mask = data_of<Word>(workspace);
  dispatch_float(boxes, "boxes", [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(words), static_cast<unsigned>(words));
    auto launch = [&](auto kind_tag) {
      constexpr int kKind = decltype(kind_tag)::value;
      mask_kernel<T, kKind>
          <<<grid, kTile, 0, st>>>(data_of<const T>(boxes), data_of<const int64_t>(order), mask, n,
                                   boxes.size(0), static_cast<int>(layout), threshold);
    };
    dispatch_int<kIoU3D, kRotatedIoU, kNormal, kCircle>(static_cast<int>(kind), launch);
    check_launch("box3d_nms mask_kernel");
  });
  reduce_kernel<<<1, kReduceThreads, 0, st>>>(mask, mask + n * words, data_of<const int64_t>(order),
                                              data_of<int64_t>(keep), data_of<int64_t>(count), n,
                                              max_keep > 0 ? max_keep : n);
  check_launch("box3d_nms reduce_kernel");
}

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(box3d_nms, muspace::box3d::nms);
