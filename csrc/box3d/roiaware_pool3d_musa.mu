// RoIAwarePool3d (mmcv / PartA2): max or average pooling of point features into the voxels of
// each RoI, forward and backward.
//
// A point p inside RoI r (box3d::point_in_box) falls into voxel
//   (ix, iy, iz) = (q((lx + dx/2) / (dx/ox), ox), q((ly + dy/2) / (dy/oy), oy), q((z - z_r) / (dz/oz), oz))
//   q(v, o) = int(v) clamped to [0, o - 1] (NaN -> 0, as mmcv's float -> int conversion on CUDA)
// with (lx, ly) the point in the RoI's frame and z_r the RoI's bottom. Each voxel keeps its first
// max_pts_per_voxel - 1 points in ascending point index (mmcv's collect loop), and
//   max: pooled[r, ix, iy, iz, c] = max over those points (first maximum; NaN and -inf never win;
//        0 and argmax -1 when none wins), avg: their float32 sum in index order / their count.
//
// The mapping (entry points count, fill, sort) gives every cell = (r, voxel) the slice
// point_list[cell_start[cell], + cell_count[cell]) of its points in ascending order:
//   count: one thread per point, the RoIs in shared-memory tiles, one int32 atomic per (point,
//          RoI inside) into cell_count;
//   (the caller: cell_start = exclusive cumsum, one host sync for the pair total, a zeroed
//    cursor array)
//   fill:  the same test again, each pair appended to its cell's slice at an atomic cursor;
//   sort:  each slice sorted ascending and cut to max_pts_per_voxel - 1 entries: one thread per
//          cell for up to 32 points (insertion sort in place), one block per larger cell (those
//          are listed on the device): bitonic sort in shared memory, after a binary search of
//          the cut-off index for slices above 2048 points.
// pool: one thread per (cell, channel), consecutive threads on consecutive channels. backward:
// one thread per (cell, 4 channels) (C % 4 == 0, else per channel), an empty cell stops after
// its count; it recomputes the max's argmax from the slice and adds with float32 atomics into a
// float32 buffer (mmcv's atomics), or 1/count of the gradient per point for avg.
// mmcv walks every point with one thread per RoI (76.7 ms at 128 RoIs x 300k points).
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "box3d.muh"
#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "vector_atomics.muh"

namespace muspace {
namespace box3d {
namespace {

constexpr int kThreads = 256;
constexpr int kRoiTile = 64;         // RoIs per shared-memory tile of the mapping kernels
constexpr int kSmallCell = 32;       // slices sorted by one thread
constexpr int kSortCapacity = 2048;  // shared-memory sort (8 KB of int32 keys)
constexpr int64_t kMaxPtsPerVoxel = kSortCapacity + 1;  // max_pts_per_voxel - 1 <= 2048 kept
MUSPACE_LIMIT(roiaware_pool3d, max_pts_per_voxel, kMaxPtsPerVoxel);
constexpr int64_t kMaxPoints = INT_MAX;
MUSPACE_LIMIT(roiaware_pool3d, max_points, kMaxPoints);
constexpr int kBigBlocksPerSM = 2;
constexpr int kPoolBlocksPerSM = 8;
constexpr int kGather = 8;  // slice entries whose loads are in flight together (pool, backward)

struct RoiBox {
  PointBox box;
  float zb;                // bottom z
  float hx, hy;            // dx / 2, dy / 2 (as mmcv: x_size / 2)
  float xres, yres, zres;  // dx / ox, dy / oy, dz / oz
};

template <typename T>
__device__ __forceinline__ RoiBox load_roi(const T* __restrict__ rois, int64_t r, int ox, int oy,
                                           int oz) {
  float v[7];
#pragma unroll
  for (int k = 0; k < 7; ++k) v[k] = to_float(rois[r * 7 + k]);
  RoiBox b;
  b.box = make_point_box(v);
  b.zb = v[2];
  b.hx = mul(v[3], 0.5f);
  b.hy = mul(v[4], 0.5f);
  b.xres = div(v[3], static_cast<float>(ox));
  b.yres = div(v[4], static_cast<float>(oy));
  b.zres = div(v[5], static_cast<float>(oz));
  return b;
}

// The integer min matters from size > 2^24 on: float(size - 1) may round up to size there.
__device__ __forceinline__ int voxel_index(float q, int size) {
  return min(static_cast<int>(fminf(fmaxf(q, 0.0f), static_cast<float>(size - 1))), size - 1);
}

// count (kFill = false): cell_count[cell] += 1 per (point, RoI inside);
// fill (kFill = true): point_list[cell_start[cell] + cursor[cell]++] = point.
template <typename T, bool kFill>
__global__ void __launch_bounds__(kThreads)
    map_kernel(const T* __restrict__ rois, const T* __restrict__ pts, int* __restrict__ counter,
               const int64_t* __restrict__ cell_start, int* __restrict__ point_list,
               int64_t list_len, int64_t n_rois, int n_points, int ox, int oy, int oz) {
  __shared__ RoiBox s_roi[kRoiTile];
  // int64: the last block's threads reach n_points + kThreads - 1 (n_points <= INT_MAX)
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  float x = 0.0f, y = 0.0f, z = 0.0f;
  if (p < n_points) {
    x = to_float(pts[static_cast<int64_t>(p) * 3]);
    y = to_float(pts[static_cast<int64_t>(p) * 3 + 1]);
    z = to_float(pts[static_cast<int64_t>(p) * 3 + 2]);
  }
  const int64_t voxels = static_cast<int64_t>(ox) * oy * oz;
  for (int64_t r0 = 0; r0 < n_rois; r0 += kRoiTile) {
    const int nr = static_cast<int>(::min(static_cast<int64_t>(kRoiTile), n_rois - r0));
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < nr)
      s_roi[threadIdx.x] = load_roi(rois, r0 + threadIdx.x, ox, oy, oz);
    __syncthreads();
    if (p >= n_points) continue;
    for (int k = 0; k < nr; ++k) {
      const RoiBox& b = s_roi[k];
      if (!point_in_box(b.box, x, y, z)) continue;
      float lx, ly;
      local_xy(b.box, x, y, lx, ly);
      const int ix = voxel_index(div(add(lx, b.hx), b.xres), ox);
      const int iy = voxel_index(div(add(ly, b.hy), b.yres), oy);
      const int iz = voxel_index(div(sub(z, b.zb), b.zres), oz);
      const int64_t cell = (r0 + k) * voxels + (static_cast<int64_t>(ix) * oy + iy) * oz + iz;
      if (kFill) {
        const int64_t pos = cell_start[cell] + atomicAdd(&counter[cell], 1);
        if (pos >= 0 && pos < list_len) point_list[pos] = static_cast<int>(p);
      } else {
        atomicAdd(&counter[cell], 1);
      }
    }
  }
}

// Slices of up to kSmallCell points: insertion sort in place by this thread; larger slices are
// listed for big_sort_kernel. cell_count becomes the kept count min(n, keep).
__global__ void __launch_bounds__(kThreads)
    small_sort_kernel(const int64_t* __restrict__ cell_start, int* __restrict__ cell_count,
                      int* __restrict__ point_list, int64_t list_len, int64_t n_cells, int keep,
                      int* __restrict__ big_list, int* __restrict__ big_count) {
  for (int64_t cell = global_thread(); cell < n_cells; cell += global_threads()) {
    const int64_t s = cell_start[cell];
    int n = cell_count[cell];
    if (n <= 0 || s < 0 || s >= list_len) {
      cell_count[cell] = 0;
      continue;
    }
    n = static_cast<int>(::min(static_cast<int64_t>(n), list_len - s));
    if (n > kSmallCell) {
      cell_count[cell] = n;
      big_list[atomicAdd(big_count, 1)] = static_cast<int>(cell);
      continue;
    }
    int* v = point_list + s;
    for (int i = 1; i < n; ++i) {
      const int key = v[i];
      int j = i - 1;
      while (j >= 0 && v[j] > key) {
        v[j + 1] = v[j];
        --j;
      }
      v[j + 1] = key;
    }
    const int m = min(n, keep);
    for (int i = m; i < n; ++i) v[i] = -1;  // the unused tail: -1 (deterministic output)
    cell_count[cell] = m;
  }
}

// Bitonic sort of s_keys[0, len) ascending (len a power of two <= kSortCapacity); every thread
// of the block calls it.
__device__ void bitonic_sort(int* s_keys, int len) {
  for (int k = 2; k <= len; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < len; i += kThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const bool up = (i & k) == 0;
          const int a = s_keys[i], b = s_keys[partner];
          if ((a > b) == up) {
            s_keys[i] = b;
            s_keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    big_sort_kernel(const int64_t* __restrict__ cell_start, int* __restrict__ cell_count,
                    int* __restrict__ point_list, const int* __restrict__ big_list,
                    const int* __restrict__ big_count, int keep, int n_points) {
  __shared__ int s_keys[kSortCapacity];
  __shared__ int s_n;
  const int cells = *big_count;
  for (int i = blockIdx.x; i < cells; i += gridDim.x) {
    const int cell = big_list[i];
    const int64_t s = cell_start[cell];
    const int n = cell_count[cell];  // > kSmallCell, inside the list (small_sort_kernel)
    const int m = min(n, keep);
    int* v = point_list + s;
    int bound = INT_MAX;  // keys < bound are kept
    if (n > kSortCapacity) {
      // the smallest bound with m keys below it (the keys are distinct point indices)
      int lo = 0, hi = n_points;
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        __syncthreads();
        if (threadIdx.x == 0) s_n = 0;
        __syncthreads();
        int local = 0;
        for (int k = threadIdx.x; k < n; k += kThreads) local += v[k] < mid ? 1 : 0;
        if (local) atomicAdd(&s_n, local);
        __syncthreads();
        if (s_n >= m) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      bound = lo;
    }
    __syncthreads();
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    for (int k = threadIdx.x; k < n; k += kThreads) {
      const int key = v[k];
      if (key < bound) {
        const int slot = atomicAdd(&s_n, 1);
        if (slot < kSortCapacity) s_keys[slot] = key;
      }
    }
    __syncthreads();
    const int got = min(s_n, kSortCapacity);
    int len = 1;
    while (len < got) len <<= 1;
    for (int k = got + threadIdx.x; k < len; k += kThreads) s_keys[k] = INT_MAX;
    __syncthreads();
    bitonic_sort(s_keys, len);
    const int kept = min(m, got);
    for (int k = threadIdx.x; k < n; k += kThreads) v[k] = k < kept ? s_keys[k] : -1;
    if (threadIdx.x == 0) cell_count[cell] = kept;
    __syncthreads();
  }
}

// The points of one cell's slice that index a feature row (bad entries are skipped: the
// mapping the library builds has none).
// k runs over [k0, k1): the entries k < count whose position start + k lies in the list.
struct Slice {
  const int* list;
  int64_t start;
  int count, n_points, k0, k1;
  __device__ __forceinline__ Slice(const int* l, int64_t s, int64_t list_len, int c, int np)
      : list(l), start(s), count(max(c, 0)), n_points(np) {
    const int64_t lo = ::max(static_cast<int64_t>(0), -s);
    const int64_t hi = list_len - s;
    k0 = static_cast<int>(::min(lo, static_cast<int64_t>(count)));
    k1 = static_cast<int>(::max(::min(hi, static_cast<int64_t>(count)), static_cast<int64_t>(k0)));
  }
  __device__ __forceinline__ int point(int k) const {
    const int p = list[start + k];
    return p >= 0 && p < n_points ? p : -1;
  }
};

// Calls f(p, feat[p, c]) for the slice's valid points in slice order. The loads of kGather
// entries (their list entries, then their features) are all issued before the first use: one
// slice of 100 points costs ~26 memory latencies instead of 200 dependent ones.
template <typename T, typename F>
__device__ __forceinline__ void for_each_feature(const Slice& sl, const T* __restrict__ feat,
                                                 int64_t channels, int64_t c, F&& f) {
  for (int k = sl.k0; k < sl.k1; k += kGather) {
    int p[kGather];
#pragma unroll
    for (int u = 0; u < kGather; ++u) p[u] = k + u < sl.k1 ? sl.point(k + u) : -1;
    float v[kGather];
#pragma unroll
    for (int u = 0; u < kGather; ++u) v[u] = p[u] >= 0 ? to_float(feat[p[u] * channels + c]) : 0.0f;
#pragma unroll
    for (int u = 0; u < kGather; ++u) {
      if (p[u] >= 0) f(p[u], v[u]);
    }
  }
}

template <typename T>
__device__ __forceinline__ int slice_argmax(const Slice& sl, const T* __restrict__ feat,
                                            int64_t channels, int64_t c, float& best) {
  float top = -INFINITY;  // mmcv's -1e50 in float
  int arg = -1;
  for_each_feature(sl, feat, channels, c, [&](int p, float v) {
    if (v > top) {
      top = v;
      arg = p;
    }
  });
  best = top;
  return arg;
}

template <typename T, typename I>
__global__ void __launch_bounds__(kThreads)
    pool_kernel(const T* __restrict__ feat, const int64_t* __restrict__ cell_start,
                const int* __restrict__ cell_count, const int* __restrict__ point_list,
                int64_t list_len, T* __restrict__ pooled, int* __restrict__ argmax, I n_out,
                I channels, int n_points, bool avg) {
  for (I e = static_cast<I>(global_thread()); e < n_out; e += static_cast<I>(global_threads())) {
    const I cell = e / channels;
    const I c = e - cell * channels;
    const Slice sl(point_list, cell_start[cell], list_len, cell_count[cell], n_points);
    float v = 0.0f;
    if (avg) {
      float sum = 0.0f;  // in slice order
      for_each_feature(sl, feat, channels, c, [&](int, float f) { sum = add(sum, f); });
      if (sl.count > 0) v = div(sum, static_cast<float>(sl.count));
    } else {
      float best;
      const int arg = slice_argmax(sl, feat, channels, c, best);
      if (arg >= 0) v = best;
      if (argmax) argmax[e] = arg;
    }
    pooled[e] = from_float<T>(v);
  }
}

// One thread per (cell, group of kVec channels): kVec = 4 when C % 4 == 0 and grad_in is 16-byte
// aligned (avg: one 16-byte RED per point), else 1. The cell's count and start are loaded
// first and an empty cell (most cells of an RoI) stops there, before its grad_out is read; a
// thread walks its slice once for all kVec channels (kVec independent argmax / sums), so each
// list entry is loaded once per group instead of once per channel. Max with `argmax` (the
// forward's, [cells, C]): the kVec winners are loaded instead of found again by the walk (the
// walk was the kernel's time: 41.9 us of dependent loads at 18 % SM throughput, H200).
template <typename T, typename I, int kVec>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ feat,
                    const int64_t* __restrict__ cell_start, const int* __restrict__ cell_count,
                    const int* __restrict__ point_list, int64_t list_len,
                    const int* __restrict__ argmax, float* __restrict__ grad_in, I n_groups,
                    I channels, int n_points, bool avg) {
  // 4 channels x 4 entries = 16 feature loads in flight (8 entries: 78 registers, 3 blocks per
  // SM; most cells of an RoI hold a few points, so occupancy matters more than depth)
  constexpr int kDepth = kVec == 1 ? kGather : 4;
  const I groups_per_cell = channels / kVec;
  for (I e = static_cast<I>(global_thread()); e < n_groups; e += static_cast<I>(global_threads())) {
    const I cell = e / groups_per_cell;
    const I c0 = (e - cell * groups_per_cell) * kVec;
    const int64_t start = cell_start[cell];  // loaded together with the count
    const int count = cell_count[cell];
    if (count <= 0) continue;  // an empty cell: nothing to add
    const Slice sl(point_list, start, list_len, count, n_points);
    // grad_out is not branched on before the walk: its load and the first list entries' are
    // in flight together; a zero gradient only skips the atomics (it adds nothing)
    float g[kVec];
    bool any = false;
#pragma unroll
    for (int u = 0; u < kVec; ++u) {
      g[u] = to_float(grad_out[cell * channels + c0 + u]);
      any |= g[u] != 0.0f;
    }
    if (avg) {
      const float inv = div(1.0f, fmaxf(static_cast<float>(sl.count), 1.0f));
      float gv[kVec];
#pragma unroll
      for (int u = 0; u < kVec; ++u) gv[u] = mul(g[u], inv);
      for (int k = sl.k0; k < sl.k1; k += kDepth) {
        int p[kDepth];
#pragma unroll
        for (int q = 0; q < kDepth; ++q) p[q] = k + q < sl.k1 ? sl.point(k + q) : -1;
#pragma unroll
        for (int q = 0; q < kDepth; ++q) {
          if (p[q] >= 0 && any) {
            atomic_add_scaled<kVec>(grad_in + static_cast<int64_t>(p[q]) * channels + c0, 1.0f, gv);
          }
        }
      }
    } else {
      float top[kVec];
      int arg[kVec];
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        top[u] = -INFINITY;  // mmcv's -1e50 in float
        arg[u] = argmax != nullptr ? argmax[cell * channels + c0 + u] : -1;
      }
      // a point index outside [0, n_points) (not one the forward writes) adds nothing
      for (int k = argmax != nullptr ? sl.k1 : sl.k0; k < sl.k1; k += kDepth) {
        int p[kDepth];
#pragma unroll
        for (int q = 0; q < kDepth; ++q) p[q] = k + q < sl.k1 ? sl.point(k + q) : -1;
        float v[kDepth][kVec];
#pragma unroll
        for (int q = 0; q < kDepth; ++q) {
#pragma unroll
          for (int u = 0; u < kVec; ++u) {
            v[q][u] =
                p[q] >= 0 ? to_float(feat[static_cast<int64_t>(p[q]) * channels + c0 + u]) : 0.0f;
          }
        }
#pragma unroll
        for (int q = 0; q < kDepth; ++q) {
#pragma unroll
          for (int u = 0; u < kVec; ++u) {
            if (p[q] >= 0 && v[q][u] > top[u]) {  // first maximum, as slice_argmax
              top[u] = v[q][u];
              arg[u] = p[q];
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        if (static_cast<unsigned>(arg[u]) < static_cast<unsigned>(n_points) && g[u] != 0.0f) {
          atomicAdd(&grad_in[static_cast<int64_t>(arg[u]) * channels + c0 + u], g[u]);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------ entry points

struct Dims {
  int64_t n_rois, n_points, voxels, n_cells;
  int ox, oy, oz;
};

Dims check_map(const TensorView& rois, const TensorView& pts, int64_t ox, int64_t oy, int64_t oz) {
  check_gpu_tensor(rois, "rois");
  check_float_dtype(rois, "rois");
  check_contiguous(rois, "rois");
  check_ndim(rois, "rois", 2);
  check_size(rois, "rois", 1, 7);
  check_like(pts, "pts", rois, "rois");
  check_ndim(pts, "pts", 2);
  check_size(pts, "pts", 1, 3);
  for (const int64_t o : {ox, oy, oz}) {
    if (o < 1 || o > INT_MAX) TVM_FFI_THROW(ValueError) << "out_size must be >= 1, got " << o;
  }
  if (pts.size(0) > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << pts.size(0) << " points exceed the limit of " << kMaxPoints;
  }
  Dims d;
  d.n_rois = rois.size(0);
  d.n_points = pts.size(0);
  d.ox = static_cast<int>(ox);
  d.oy = static_cast<int>(oy);
  d.oz = static_cast<int>(oz);
  if (ox * oy > INT64_MAX / oz || ox * oy * oz > INT64_MAX / std::max<int64_t>(d.n_rois, 1)) {
    TVM_FFI_THROW(ValueError) << "rois x out_size cells overflow int64";
  }
  d.voxels = ox * oy * oz;
  d.n_cells = d.n_rois * d.voxels;
  return d;
}

// cell_count int32 [N * ox * oy * oz]: zeroed here, then the number of (point, RoI) pairs per
// cell.
void count(TensorView rois, TensorView pts, TensorView cell_count, int64_t ox, int64_t oy,
           int64_t oz, int64_t stream) {
  const Dims d = check_map(rois, pts, ox, oy, oz);
  check_vector(cell_count, "cell_count", rois, kInt32, d.n_cells);
  if (d.n_cells == 0) return;
  const int device_id = rois.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  launch_zero(data_of(cell_count), d.n_cells * 4, device_id, st, "roiaware_pool3d fill (count)");
  if (d.n_points == 0) return;
  dispatch_float(rois, "rois", [&](auto tag) {
    using T = decltype(tag);
    map_kernel<T, false>
        <<<static_cast<unsigned>((d.n_points + kThreads - 1) / kThreads), kThreads, 0, st>>>(
            data_of<const T>(rois), data_of<const T>(pts), data_of<int>(cell_count), nullptr,
            nullptr, 0, d.n_rois, static_cast<int>(d.n_points), d.ox, d.oy, d.oz);
    check_launch("roiaware_pool3d map_kernel (count)");
  });
}

// cursor int32 [cells]: zeroed here; point_list int32 [total pairs]: each cell's slice
// [cell_start[cell], + count) filled (in no particular order).
void fill(TensorView rois, TensorView pts, TensorView cell_start, TensorView cursor,
          TensorView point_list, int64_t ox, int64_t oy, int64_t oz, int64_t stream) {
  const Dims d = check_map(rois, pts, ox, oy, oz);
  check_vector(cell_start, "cell_start", rois, kInt64, d.n_cells);
  check_vector(cursor, "cursor", rois, kInt32, d.n_cells);
  check_input(point_list, "point_list", rois, kInt32);
  check_ndim(point_list, "point_list", 1);
  if (d.n_cells == 0 || d.n_points == 0) return;
  const int device_id = rois.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  launch_zero(data_of(cursor), d.n_cells * 4, device_id, st, "roiaware_pool3d fill (cursor)");
  dispatch_float(rois, "rois", [&](auto tag) {
    using T = decltype(tag);
    map_kernel<T, true>
        <<<static_cast<unsigned>((d.n_points + kThreads - 1) / kThreads), kThreads, 0, st>>>(
            data_of<const T>(rois), data_of<const T>(pts), data_of<int>(cursor),
            data_of<const int64_t>(cell_start), data_of<int>(point_list), point_list.size(0),
            d.n_rois, static_cast<int>(d.n_points), d.ox, d.oy, d.oz);
    check_launch("roiaware_pool3d map_kernel (fill)");
  });
}

// Sorts every slice ascending and cuts it to max_pts_per_voxel - 1 points (cell_count becomes
// the kept count). workspace int32 [cells + 1]: the big-cell list and its counter.
void sort(TensorView cell_start, TensorView cell_count, TensorView point_list, TensorView workspace,
          int64_t n_points, int64_t max_pts_per_voxel, int64_t stream) {
  check_gpu_tensor(cell_start, "cell_start");
  check_input(cell_start, "cell_start", cell_start, kInt64);
  check_ndim(cell_start, "cell_start", 1);
  const int64_t n_cells = cell_start.size(0);
  check_vector(cell_count, "cell_count", cell_start, kInt32, n_cells);
  check_input(point_list, "point_list", cell_start, kInt32);
  check_ndim(point_list, "point_list", 1);
  check_vector(workspace, "workspace", cell_start, kInt32, n_cells + 1);
  if (max_pts_per_voxel < 1 || max_pts_per_voxel > kMaxPtsPerVoxel) {
    TVM_FFI_THROW(ValueError) << "max_pts_per_voxel must be in [1, " << kMaxPtsPerVoxel << "], got "
                              << max_pts_per_voxel;
  }
  if (n_points < 0 || n_points > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << "n_points must be in [0, " << kMaxPoints << "], got " << n_points;
  }
  if (n_cells > INT_MAX) {
    TVM_FFI_THROW(ValueError) << n_cells << " cells exceed the sort's limit of " << INT_MAX;
  }
  if (n_cells == 0) return;
  const int device_id = cell_start.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* big_list = data_of<int>(workspace);
  int* big_count = big_list + n_cells;
  launch_zero(big_count, 4, device_id, st, "roiaware_pool3d fill (big count)");
  const int keep = static_cast<int>(max_pts_per_voxel - 1);
  small_sort_kernel<<<grid_for(n_cells, kThreads, device_id, 0), kThreads, 0, st>>>(
      data_of<const int64_t>(cell_start), data_of<int>(cell_count), data_of<int>(point_list),
      point_list.size(0), n_cells, keep, big_list, big_count);
  check_launch("roiaware_pool3d small_sort_kernel");
  big_sort_kernel<<<grid_for(n_cells, kThreads, device_id, kBigBlocksPerSM), kThreads, 0, st>>>(
      data_of<const int64_t>(cell_start), data_of<int>(cell_count), data_of<int>(point_list),
      big_list, big_count, keep, static_cast<int>(n_points));
  check_launch("roiaware_pool3d big_sort_kernel");
}

void check_slices(const TensorView& cell_start, const TensorView& cell_count,
                  const TensorView& point_list, const TensorView& ref, int64_t n_cells) {
  check_vector(cell_start, "cell_start", ref, kInt64, n_cells);
  check_vector(cell_count, "cell_count", ref, kInt32, n_cells);
  check_input(point_list, "point_list", ref, kInt32);
  check_ndim(point_list, "point_list", 1);
}

// int32 when every offset fits; n_out <= INT_MAX / 2 also keeps the grid-stride step
// e += gridDim.x * blockDim.x (far below 2^30 threads) from overflowing int32.
template <class F>
void dispatch_index_width(int64_t n_out, int64_t n_points, int64_t channels, F&& f) {
  if (n_out <= INT_MAX / 2 && n_points * std::max<int64_t>(channels, 1) < INT_MAX) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

// pts_feature [P, C]; pooled [cells, C] (the [N, ox, oy, oz, C] output) in its dtype; argmax
// int32 [cells, C] (optional, max mode only); mode 0 = max, 1 = avg.
void pool(TensorView pts_feature, TensorView cell_start, TensorView cell_count,
          TensorView point_list, TensorView pooled, Optional<TensorView> argmax, int64_t mode,
          int64_t stream) {
  check_gpu_tensor(pts_feature, "pts_feature");
  check_float_dtype(pts_feature, "pts_feature");
  check_contiguous(pts_feature, "pts_feature");
  check_ndim(pts_feature, "pts_feature", 2);
  if (mode != 0 && mode != 1) TVM_FFI_THROW(ValueError) << "mode must be 0 or 1, got " << mode;
  const int64_t n_points = pts_feature.size(0), channels = pts_feature.size(1);
  if (n_points > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << n_points << " points exceed the limit of " << kMaxPoints;
  }
  const int64_t n_cells = cell_start.size(0);
  check_slices(cell_start, cell_count, point_list, pts_feature, n_cells);
  check_like(pooled, "pooled", pts_feature, "pts_feature");
  if (pooled.numel() != n_cells * channels) {
    TVM_FFI_THROW(ValueError) << "pooled must hold cells x C = " << n_cells * channels
                              << " elements, got " << pooled.numel();
  }
  if (argmax.has_value()) {
    check_input(*argmax, "argmax", pts_feature, kInt32);
    if ((*argmax).numel() != n_cells * channels) {
      TVM_FFI_THROW(ValueError) << "argmax must hold cells x C = " << n_cells * channels
                                << " elements, got " << (*argmax).numel();
    }
    if (mode != 0) TVM_FFI_THROW(ValueError) << "argmax is only written in max mode (mode 0)";
  }
  const int64_t n_out = n_cells * channels;
  if (n_out == 0) return;
  const int device_id = pts_feature.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const int grid = grid_for(n_out, kThreads, device_id, kPoolBlocksPerSM);
  dispatch_float(pts_feature, "pts_feature", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index_width(n_out, n_points, channels, [&](auto i_tag) {
      using I = decltype(i_tag);
      pool_kernel<T, I><<<grid, kThreads, 0, st>>>(
          data_of<const T>(pts_feature), data_of<const int64_t>(cell_start),
          data_of<const int>(cell_count), data_of<const int>(point_list), point_list.size(0),
          data_of<T>(pooled), data_of<int>(argmax), static_cast<I>(n_out), static_cast<I>(channels),
          static_cast<int>(n_points), mode == 1);
      check_launch("roiaware_pool3d pool_kernel");
    });
  });
}

// grad_out [cells, C] in pts_feature's dtype; grad_in float32 [P, C], zero-filled by the caller:
// receives the gradient of pts_feature (float32 atomics). argmax (max mode only, optional):
// int32 [cells, C] as the pool entry point wrote it for these inputs; without it the winners
// are found again from the slices.
void backward(TensorView grad_out, TensorView pts_feature, TensorView cell_start,
              TensorView cell_count, TensorView point_list, Optional<TensorView> argmax,
              TensorView grad_in, int64_t mode, int64_t stream) {
  check_gpu_tensor(pts_feature, "pts_feature");
  check_float_dtype(pts_feature, "pts_feature");
  check_contiguous(pts_feature, "pts_feature");
  check_ndim(pts_feature, "pts_feature", 2);
  if (mode != 0 && mode != 1) TVM_FFI_THROW(ValueError) << "mode must be 0 or 1, got " << mode;
  const int64_t n_points = pts_feature.size(0), channels = pts_feature.size(1);
  if (n_points > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << n_points << " points exceed the limit of " << kMaxPoints;
  }
  const int64_t n_cells = cell_start.size(0);
  check_slices(cell_start, cell_count, point_list, pts_feature, n_cells);
  check_like(grad_out, "grad_out", pts_feature, "pts_feature");
  if (grad_out.numel() != n_cells * channels) {
    TVM_FFI_THROW(ValueError) << "grad_out must hold cells x C = " << n_cells * channels
                              << " elements, got " << grad_out.numel();
  }
  check_input(grad_in, "grad_in", pts_feature, kFloat32);
  check_same_shape(grad_in, "grad_in", pts_feature, "pts_feature");
  if (argmax.has_value()) {
    check_input(*argmax, "argmax", pts_feature, kInt32);
    if ((*argmax).numel() != n_cells * channels) {
      TVM_FFI_THROW(ValueError) << "argmax must hold cells x C = " << n_cells * channels
                                << " elements, got " << (*argmax).numel();
    }
    if (mode != 0) TVM_FFI_THROW(ValueError) << "argmax is only read in max mode (mode 0)";
  }
  const int64_t n_out = n_cells * channels;
  if (n_out == 0) return;
  const int device_id = pts_feature.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const bool vec4 = channels % 4 == 0 && is_aligned(grad_in, 16);
  const int64_t n_groups = vec4 ? n_out / 4 : n_out;
  // one thread per group: a group's work is a few dependent loads, so every resident thread
  // should hold one (a grid-stride loop of ~20 groups per thread was ~20 chains in a row)
  const int grid = grid_for(n_groups, kThreads, device_id, 0);
  dispatch_float(pts_feature, "pts_feature", [&](auto tag) {
    using T = decltype(tag);
    // + kThreads: the grid-stride step of up to n_groups + kThreads - 1 threads stays in range
    dispatch_index_width(n_out + kThreads, n_points, channels, [&](auto i_tag) {
      using I = decltype(i_tag);
      auto launch = [&](auto vec_tag) {
        constexpr int kVec = decltype(vec_tag)::value;
        backward_kernel<T, I, kVec><<<grid, kThreads, 0, st>>>(
            data_of<const T>(grad_out), data_of<const T>(pts_feature),
            data_of<const int64_t>(cell_start), data_of<const int>(cell_count),
            data_of<const int>(point_list), point_list.size(0),
            argmax.has_value() ? data_of<const int>(*argmax) : nullptr, data_of<float>(grad_in),
            static_cast<I>(n_groups), static_cast<I>(channels), static_cast<int>(n_points),
            mode == 1);
      };
      dispatch_int<1, 4>(vec4 ? 4 : 1, launch);
      check_launch("roiaware_pool3d backward_kernel");
    });
  });
}

}  // namespace
}  // namespace box3d
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(roiaware_pool3d_count, muspace::box3d::count);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(roiaware_pool3d_fill, muspace::box3d::fill);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(roiaware_pool3d_sort, muspace::box3d::sort);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(roiaware_pool3d_pool, muspace::box3d::pool);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(roiaware_pool3d_backward, muspace::box3d::backward);
