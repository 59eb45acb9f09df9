// points_in_boxes_part / _all (mmcv): which LiDAR boxes hold each point.
//
//   part: out[b, m]    = the first box t (in box order) holding points[b, m], or -1
//   all:  out[b, m, t] = 1 if box t holds points[b, m], else 0
//
// points [B, M, 3] and boxes [B, T, 7] (x, y, z bottom, dx, dy, dz, yaw) in float32 / float16 /
// bfloat16 (computed in float32), out int32. The test is box3d::point_in_box (mmcv's
// check_pt_in_box3d with each operation rounded; a NaN point is in no box).
//
// part: one thread per point; the batch's boxes pass through shared memory in tiles (cos / sin
// once per box and block), each thread stops at its first hit and the block stops when all its
// points have one. all (the output, 4*M*T bytes, is the whole cost: 240 MB at 300k x 200):
// up to kFlatBoxes boxes per batch, a block owns 128 points and ALL boxes (in shared memory),
// so its output is one contiguous range of int32: the block tests only its near (point, box)
// pairs, into a bitmask of that range in shared memory, then its threads write the range as
// 16-byte words, consecutive threads on consecutive words (memset store pattern); more boxes:
// a block owns a tile of 64 boxes and a chunk of points and consecutive threads write
// consecutive int32 of each point's row. No host synchronisation;
// any B (grid-stride over batches), any M and T up to 2^31 - 1.
#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <utility>

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
constexpr int kPartBoxTile = 256;  // boxes per shared tile (36 bytes each: 9 KB)
constexpr int kAllBoxTile = 64;    // boxes per block of the all kernel
constexpr int kAllPoints = 128;    // points per block of the all kernel
// boxes per batch the flat all kernel keeps in shared memory (36 B each: 18 KB; with the
// block's values as bits, 8 KB, and the flags 26 KB, under the 28 KB portable limit)
constexpr int kFlatBoxes = 512;
constexpr int kMaxGridY = 65535;  // batches per launch row (grid-stride beyond)
constexpr int64_t kMaxCount = INT_MAX;
MUSPACE_LIMIT(points_in_boxes, max_points, kMaxCount);
MUSPACE_LIMIT(points_in_boxes, max_boxes, kMaxCount);

// The flat all kernel's scratch: the bounds' reduction, then (after a barrier) one bit per value
// of the block's output range, offset by up to 3 bits (kAllPoints * kFlatBoxes + 3 bits).
constexpr int kFlatBitWords = (kAllPoints * kFlatBoxes + 3 + 31) / 32;
union FlatScratch {
  float red[4][kThreads];
  unsigned int bits[kFlatBitWords];
};

template <typename T>
__device__ __forceinline__ PointBox load_point_box(const T* __restrict__ boxes, int64_t i) {
  float b[7];
#pragma unroll
  for (int k = 0; k < 7; ++k) b[k] = to_float(boxes[i * 7 + k]);
  return make_point_box(b);
}

// The bounds of the block's points in x and y (NaN coordinates left out, no valid point: an
// empty box +inf / -inf), by a shared-memory tree over the block's kThreads threads.
__device__ __forceinline__ void block_bounds(bool valid, float x, float y, float (*s_red)[kThreads],
                                             float (&lo)[2], float (&hi)[2]) {
  const int tid = threadIdx.x;
  s_red[0][tid] = valid ? x : INFINITY;
  s_red[1][tid] = valid ? y : INFINITY;
  s_red[2][tid] = valid ? x : -INFINITY;
  s_red[3][tid] = valid ? y : -INFINITY;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (tid < half) {
      s_red[0][tid] = fminf(s_red[0][tid], s_red[0][tid + half]);
      s_red[1][tid] = fminf(s_red[1][tid], s_red[1][tid + half]);
      s_red[2][tid] = fmaxf(s_red[2][tid], s_red[2][tid + half]);
      s_red[3][tid] = fmaxf(s_red[3][tid], s_red[3][tid + half]);
    }
    __syncthreads();
  }
  lo[0] = s_red[0][0];
  lo[1] = s_red[1][0];
  hi[0] = s_red[2][0];
  hi[1] = s_red[3][0];
}

// Whether every point with x in [lo[0], hi[0]] and y in [lo[1], hi[1]] fails point_in_box's
// first test (|x - cx| > reach or |y - cy| > reach, on the rounded differences): the rounded
// subtraction is monotonic, so the bounds decide for all points between them. NaN never culls.
__device__ __forceinline__ bool box_misses(const PointBox& b, const float (&lo)[2],
                                           const float (&hi)[2]) {
  return sub(lo[0], b.cx) > b.reach || sub(hi[0], b.cx) < -b.reach || sub(lo[1], b.cy) > b.reach ||
         sub(hi[1], b.cy) < -b.reach;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    part_kernel(const T* __restrict__ points, const T* __restrict__ boxes, int* __restrict__ out,
                int batches, int n_points, int n_boxes) {
  __shared__ PointBox s_box[kPartBoxTile];
  __shared__ unsigned int s_near[kPartBoxTile / 32];  // boxes of the tile the block may hit
  __shared__ float s_red[4][kThreads];
  __shared__ int s_pending;
  // int64: the last block's threads reach n_points + kThreads - 1 (n_points <= INT_MAX)
  const int64_t m = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (threadIdx.x < kPartBoxTile / 32) s_near[threadIdx.x] = 0;
  for (int b = blockIdx.y; b < batches; b += gridDim.y) {
    const bool valid = m < n_points;
    float x = 0.0f, y = 0.0f, z = 0.0f;
    if (valid) {
      const T* p = points + (static_cast<int64_t>(b) * n_points + m) * 3;
      x = to_float(p[0]);
      y = to_float(p[1]);
      z = to_float(p[2]);
    }
    __syncthreads();  // s_red of the previous batch is consumed
    float lo[2], hi[2];
    block_bounds(valid, x, y, s_red, lo, hi);
    int found = -1;
    for (int t0 = 0; t0 < n_boxes; t0 += kPartBoxTile) {
      const int nt = min(kPartBoxTile, n_boxes - t0);
      __syncthreads();  // the previous tile (and the previous batch's flag) are consumed
      if (threadIdx.x == 0) s_pending = 0;
      for (int k = threadIdx.x; k < nt; k += kThreads) {
        s_box[k] = load_point_box(boxes, static_cast<int64_t>(b) * n_boxes + t0 + k);
        if (!box_misses(s_box[k], lo, hi)) atomicOr(s_near + k / 32, 1u << (k % 32));
      }
      __syncthreads();
      if (valid && found < 0) {
        // the near boxes in box order: the first hit is mmcv's
        for (int w = 0; w * 32 < nt && found < 0; ++w) {
          for (unsigned int bits = s_near[w]; bits; bits &= bits - 1) {
            const int k = w * 32 + __ffs(static_cast<int>(bits)) - 1;
            if (point_in_box(s_box[k], x, y, z)) {
              found = t0 + k;
              break;
            }
          }
        }
        if (found < 0) s_pending = 1;  // every writer stores the same value
      }
      __syncthreads();
      if (threadIdx.x < kPartBoxTile / 32) s_near[threadIdx.x] = 0;  // read before the barrier
      if (!s_pending) break;  // block-uniform: read after the barrier, rewritten after the next
    }
    if (valid) out[static_cast<int64_t>(b) * n_points + m] = found;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    all_kernel(const T* __restrict__ points, const T* __restrict__ boxes, int* __restrict__ out,
               int batches, int n_points, int n_boxes) {
  __shared__ PointBox s_box[kAllBoxTile];
  __shared__ float s_pt[kAllPoints * 3];
  __shared__ float s_red[4][kThreads];
  const int t0 = blockIdx.y * kAllBoxTile;
  const int nt = min(kAllBoxTile, n_boxes - t0);
  const int lanes = kThreads / nt;  // points handled at once (the last box tile may be narrow)
  const int lane = threadIdx.x / nt;
  const int k = threadIdx.x - lane * nt;
  const int m0 = blockIdx.x * kAllPoints;
  const int np = min(kAllPoints, n_points - m0);
  for (int b = blockIdx.z; b < batches; b += gridDim.z) {
    __syncthreads();
    for (int i = threadIdx.x; i < nt; i += kThreads) {
      s_box[i] = load_point_box(boxes, static_cast<int64_t>(b) * n_boxes + t0 + i);
    }
    const T* p = points + (static_cast<int64_t>(b) * n_points + m0) * 3;
    for (int i = threadIdx.x; i < np * 3; i += kThreads) s_pt[i] = to_float(p[i]);
    __syncthreads();
    const int own = threadIdx.x;  // the point this thread contributes to the bounds
    float lo[2], hi[2];
    block_bounds(own < np, own < np ? s_pt[own * 3] : 0.0f, own < np ? s_pt[own * 3 + 1] : 0.0f,
                 s_red, lo, hi);
    if (lane < lanes && k < nt) {
      const PointBox box = s_box[k];
      int* o = out + (static_cast<int64_t>(b) * n_points + m0) * n_boxes + t0 + k;
      // ~4 in 5 (box, block) pairs of a frame miss: no test, a zero. One store loop for both
      // cases: the lanes of a warp hold different boxes, and with the store in two divergent
      // branches each warp's 128-byte row segment went out as two partial stores (the kernel
      // measured 285 us against 118 us before the cull, H200, 2026-12-01)
      const bool miss = box_misses(box, lo, hi);
      for (int i = lane; i < np; i += lanes) {
        const bool in = !miss && point_in_box(box, s_pt[i * 3], s_pt[i * 3 + 1], s_pt[i * 3 + 2]);
        o[static_cast<int64_t>(i) * n_boxes] = in ? 1 : 0;
      }
    }
  }
}

// all, n_boxes <= kFlatBoxes: the block's output out[b, m0 : m0 + np, :] is the contiguous
// range [e0, e0 + np * n_boxes) of int32. Computing a value per stored element made the kernel
// issue-bound (ncu, H200: 80% of the issue slots, 42% of DRAM): a flag test, the point and box
// loads and the (pt, t) stepping per element, the near-box branch taken by almost every warp.
// So the values are computed first, as bits, and stored after:
//   1. points (thread tid holds point tid % kAllPoints in registers), the block's bounds, the
//      boxes and their near flags (box_misses), as before;
//   2. the near (point, box) pairs only: a thread takes one point and one 32-box word of flags
//      (a warp: 32 points, the same word: the same boxes, broadcast loads, uniform loop) and
//      ORs its hits into a bitmask of the block's range in shared memory (value e is bit
//      e + off); a culled pair is a 0 by box_misses' proof, as before;
//   3. the memset-like store: 16-byte words to consecutive threads, word w's four values one
//      nibble of the bitmask (off makes the body's words nibble-aligned); the elements before
//      the first and after the last whole word (misalign: the int32 offset of out mod 4) are
//      stored one by one.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    all_flat_kernel(const T* __restrict__ points, const T* __restrict__ boxes,
                    int* __restrict__ out, int batches, int n_points, int n_boxes, int misalign) {
  static_assert(kThreads % kAllPoints == 0, "a thread keeps one point across its box words");
  static_assert(kThreads % 8 == 0, "a thread's store nibble is the same in every iteration");
  __shared__ PointBox s_box[kFlatBoxes];
  __shared__ unsigned int s_near[kFlatBoxes / 32];  // boxes the block's bounds may hit
  __shared__ FlatScratch s_scr;  // the bounds' reduction, then the block's values as bits
  const int tid = threadIdx.x;
  const int m0 = blockIdx.x * kAllPoints;
  const int np = min(kAllPoints, n_points - m0);
  const int len = np * n_boxes;    // <= 128 * 512
  const int i = tid % kAllPoints;  // this thread's point (threads i and i + 128 share it)
  const int near_words = (n_boxes + 31) / 32;
  for (int b = blockIdx.y; b < batches; b += gridDim.y) {
    __syncthreads();  // the previous batch's boxes, flags and bits are consumed
    if (tid < kFlatBoxes / 32) s_near[tid] = 0;  // ordered before the atomics by block_bounds
    float x = 0.0f, y = 0.0f, z = 0.0f;
    if (i < np) {
      const T* p = points + (static_cast<int64_t>(b) * n_points + m0 + i) * 3;
      x = to_float(p[0]);
      y = to_float(p[1]);
      z = to_float(p[2]);
    }
    float lo[2], hi[2];
    block_bounds(tid < np, x, y, s_scr.red, lo, hi);
    for (int k = tid; k < n_boxes; k += kThreads) {
      s_box[k] = load_point_box(boxes, static_cast<int64_t>(b) * n_boxes + k);
      if (!box_misses(s_box[k], lo, hi)) atomicOr(s_near + k / 32, 1u << (k % 32));
    }
    const int64_t e0 = (static_cast<int64_t>(b) * n_points + m0) * n_boxes;
    const int head = min(len, (4 - static_cast<int>((e0 + misalign) & 3)) & 3);
    const int off = (4 - head) & 3;  // value e is bit e + off: body word w is nibble w + first
    const int first = (head + off) / 4;
    const int bit_words = (len + off + 31) / 32;
    __syncthreads();  // s_scr.red is consumed (lo, hi); boxes and flags are complete
    for (int j = tid; j < bit_words; j += kThreads) s_scr.bits[j] = 0;
    __syncthreads();
    if (i < np) {
      for (int k = tid / kAllPoints; k < near_words; k += kThreads / kAllPoints) {
        unsigned int hits = 0;
        for (unsigned int near = s_near[k]; near; near &= near - 1) {
          const int u = __ffs(static_cast<int>(near)) - 1;
          hits |= static_cast<unsigned int>(point_in_box(s_box[k * 32 + u], x, y, z)) << u;
        }
        if (hits) {  // rare: a point is in few boxes. Boxes 32k.. of point i: bits f, f + 1, ..
          const unsigned int f = i * n_boxes + k * 32 + off;
          const unsigned int s = f % 32;
          atomicOr(s_scr.bits + f / 32, hits << s);
          // the bits past the word (set bits are boxes < n_boxes: inside bit_words)
          if (s != 0 && (hits >> (32 - s)) != 0) {
            atomicOr(s_scr.bits + f / 32 + 1, hits >> (32 - s));
          }
        }
      }
    }
    __syncthreads();
    auto value = [&](int e) -> int {
      const unsigned int f = e + off;
      return (s_scr.bits[f / 32] >> (f % 32)) & 1u;
    };
    int* o = out + e0;
    const int words = (len - head) / 4;
    const int tail = head + words * 4;
    if (tid < head) o[tid] = value(tid);
    if (tid < len - tail) o[tail + tid] = value(tail + tid);
    int4* body = reinterpret_cast<int4*>(o + head);
    // word w is nibble w + first: 8 a 32-bit word (8 consecutive threads read it, broadcast);
    // kThreads is a multiple of 8, so a thread's nibble is the same one in every bit word
    const unsigned int shift = (tid + first) % 8 * 4;
    const unsigned int* src = s_scr.bits + (tid + first) / 8;
    for (int w = tid; w < words; w += kThreads, src += kThreads / 8) {
      const unsigned int nib = *src >> shift;
      body[w] = make_int4(nib & 1u, (nib >> 1) & 1u, (nib >> 2) & 1u, (nib >> 3) & 1u);
    }
  }
}

struct Shapes {
  int batches, n_points, n_boxes;
};

Shapes check_args(const TensorView& points, const TensorView& boxes, const TensorView& out,
                  bool all) {
  check_gpu_tensor(points, "points");
  check_float_dtype(points, "points");
  check_contiguous(points, "points");
  check_ndim(points, "points", 3);
  check_size(points, "points", 2, 3);
  check_like(boxes, "boxes", points, "points");
  check_ndim(boxes, "boxes", 3);
  check_size(boxes, "boxes", 0, points.size(0));
  check_size(boxes, "boxes", 2, 7);
  check_input(out, "out", points, kInt32);
  check_ndim(out, "out", all ? 3 : 2);
  check_size(out, "out", 0, points.size(0));
  check_size(out, "out", 1, points.size(1));
  if (all) check_size(out, "out", 2, boxes.size(1));
  for (const auto& [n, what] : {std::pair<int64_t, const char*>{points.size(0), "batches"},
                                {points.size(1), "points per batch"},
                                {boxes.size(1), "boxes per batch"}}) {
    if (n > kMaxCount) {
      TVM_FFI_THROW(ValueError) << n << " " << what << " exceed the limit of " << kMaxCount;
    }
  }
  return {static_cast<int>(points.size(0)), static_cast<int>(points.size(1)),
          static_cast<int>(boxes.size(1))};
}

void part_forward(TensorView points, TensorView boxes, TensorView out, int64_t stream) {
  const Shapes s = check_args(points, boxes, out, false);
  if (s.batches == 0 || s.n_points == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const dim3 grid((s.n_points + kThreads - 1) / kThreads, std::min(s.batches, kMaxGridY));
  dispatch_float(points, "points", [&](auto tag) {
    using T = decltype(tag);
    part_kernel<T><<<grid, kThreads, 0, st>>>(data_of<const T>(points), data_of<const T>(boxes),
                                              data_of<int>(out), s.batches, s.n_points, s.n_boxes);
    check_launch("points_in_boxes part_kernel");
  });
}

void all_forward(TensorView points, TensorView boxes, TensorView out, int64_t stream) {
  const Shapes s = check_args(points, boxes, out, true);
  if (s.batches == 0 || s.n_points == 0 || s.n_boxes == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  if (s.n_boxes <= kFlatBoxes) {
    const int misalign = static_cast<int>((reinterpret_cast<uintptr_t>(data_of<int>(out)) / 4) & 3);
    const dim3 grid((s.n_points + kAllPoints - 1) / kAllPoints, std::min(s.batches, kMaxGridY));
    dispatch_float(points, "points", [&](auto tag) {
      using T = decltype(tag);
      all_flat_kernel<T><<<grid, kThreads, 0, st>>>(data_of<const T>(points),
                                                    data_of<const T>(boxes), data_of<int>(out),
                                                    s.batches, s.n_points, s.n_boxes, misalign);
      check_launch("points_in_boxes all_flat_kernel");
    });
    return;
  }
  const int64_t box_tiles = (static_cast<int64_t>(s.n_boxes) + kAllBoxTile - 1) / kAllBoxTile;
  if (box_tiles > kMaxGridY) {
    TVM_FFI_THROW(ValueError) << s.n_boxes << " boxes per batch exceed the all kernel's "
                              << static_cast<int64_t>(kMaxGridY) * kAllBoxTile;
  }
  const dim3 grid((s.n_points + kAllPoints - 1) / kAllPoints, static_cast<unsigned>(box_tiles),
                  std::min(s.batches, kMaxGridY));
  dispatch_float(points, "points", [&](auto tag) {
    using T = decltype(tag);
    all_kernel<T><<<grid, kThreads, 0, st>>>(data_of<const T>(points), data_of<const T>(boxes),
                                             data_of<int>(out), s.batches, s.n_points, s.n_boxes);
    check_launch("points_in_boxes all_kernel");
  });
}

// The all kernel's box-tile limit, for the Python side.
constexpr int64_t kMaxAllBoxes = static_cast<int64_t>(kMaxGridY) * kAllBoxTile;
MUSPACE_LIMIT(points_in_boxes, max_all_boxes, kMaxAllBoxes);

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(points_in_boxes_part_forward, muspace::box3d::part_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(points_in_boxes_all_forward, muspace::box3d::all_forward);
