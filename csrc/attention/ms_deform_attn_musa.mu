// Multi-scale deformable attention (Deformable DETR, BEVFormer, MapTR): forward and backward.
//
//   out[b, q, h*D + c] = sum_{l, p} attn[b, q, h, l, p] *
//                        bilinear(value[b, start_l : start_l + H_l*W_l, h, c] viewed as H_l x W_l,
//                                 y = loc[b, q, h, l, p, 1] * H_l - 0.5, x = loc[..., 0] * W_l - 0.5)
//
// Bilinear rule of the upstream kernels (mmcv / Deformable DETR): a sample is taken only when
// -1 < y < H_l and -1 < x < W_l; corners outside the level contribute zero.
//
// Work decomposition (ideas from DCNv4's flash deformable attention, see docs/provenance.md):
// one (b, q, h) "group" is served by G lanes (G a power of two, <= kWarpSize, aligned inside a
// warp); each lane owns CPT = VEC * NV channels, VEC contiguous channels per <= 16-byte vector
// load, NV vectors interleaved with stride G * VEC so that one load instruction of the group
// covers G * VEC contiguous channels. Every lane walks all levels x points of its group, 4
// samples (a chunk) at a time. The gather is latency-bound, so each batch of samples first issues
// all its corner loads as raw bits (predicated, nothing consumes them yet; up to 16 per lane in
// flight) and only then converts and accumulates; the next chunk's locations and weights are
// loaded one chunk ahead. Groups of >= 4 lanes share the per-sample setup (lane i sets up sample
// i of the chunk, the group reads it by shuffles). Accumulation is in float32 for every dtype.
//
// Backward: per sample, the lanes of a group form the four channel dot products
// d_k = sum_c grad_out[c] * v_k[c] (v_k: the bilinear corners), reduce them over the group with
// a 4-samples-at-a-time reduce-scatter of warp shuffles (no shared memory, no atomics), and the
// owning lane derives grad_attention_weights and grad_sampling_locations from the four dots.
// grad_value is scattered with float atomics (vector atomics where the toolchain has them) into
// a float32 buffer, each RED of a group covering whole 32-byte sectors; in mode 2 (the Python
// default) a corner that a sample shares with the previous sample of its group is merged into
// one atomic first (the L2's atomic throughput bounds this kernel); modes 3 / 4 instead merge
// across the samples and groups of a warp, whose groups then serve consecutive queries of one
// (batch, head): the contributions of a 4-sample chunk that hit one pixel are summed (pixel keys
// matched across the warp, the other groups' grad_out read from shared memory) into one atomic.
// In the deterministic mode
// grad_value never sees float atomics: this kernel writes
// one integer "cell" key per sample, the caller sorts the keys (stable), and a gather kernel
// sums, for every value row, the contributions of the samples in its four neighbouring cells in
// ascending sample order.
//
// Data-dependent indices: level shapes and start indices come from device tensors; a level
// whose shape or start index does not fit inside `value` is treated as empty (every sample on it
// contributes zero), so bad metadata can never read or write out of bounds.
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "vec.muh"
#include "vector_atomics.muh"

namespace muspace {
namespace msda {

// ------------------------------------------------------------------------------ launch policy

constexpr int kMaxLevels = 16;  // the issue asks for 1..8
MUSPACE_LIMIT(multi_scale_deformable_attn, max_levels, kMaxLevels);
constexpr int kMaxHeadDim = 256;  // generic path: kGenericNV channels x a group of <= 32 lanes
MUSPACE_LIMIT(multi_scale_deformable_attn, max_head_dim, kMaxHeadDim);
constexpr int kBlockDefault = 256;
constexpr int kBlockMax = 512;   // every kernel's __launch_bounds__
constexpr int kChunk = 4;        // samples per step: vector loads of 4 locations / weights and
                                 // the 16-value reduce-scatter of the backward
constexpr int kGenericNV = 8;    // channels per lane on the any-head_dim path (VEC = 1)
constexpr int kFillBlock = 256;  // the cast and cell-start kernels
constexpr int kCastBlocksPerSM = 16;
constexpr int kCellStartBlocksPerSM = 32;
constexpr int64_t kMaxPointsPerQuery = 1 << 20;  // levels * points, keeps index math in int32
MUSPACE_LIMIT(multi_scale_deformable_attn, max_level_points, kMaxPointsPerQuery);

// The gather kernels load every corner of a batch of samples into Vecs first and convert / use
// them afterwards: a conversion right behind its load would make the next corner's load wait
// for this one (seen in the float16 SASS: four dependent round trips per sample instead of one).

// Samples whose corner loads are issued together, before the first of them is used (forward):
// the whole chunk of 4 when a sample's corners take <= 16 registers of raw data (one <= 16-byte
// vector per lane and corner: 16 loads in flight per lane, ~120 registers), else 1.
template <typename T, int VEC, int NV>
constexpr int samples_in_flight() {
  return 4 * NV * Vec<T, VEC>::kWords <= 16 ? kChunk : 1;
}

// The backward keeps more per lane (grad_out, the 16 dot products of a chunk): half the batch
// where a sample's corners take more than 8 registers of raw data.
template <typename T, int VEC, int NV>
constexpr int backward_samples_in_flight() {
  return 4 * NV * Vec<T, VEC>::kWords <= 8         ? kChunk
         : samples_in_flight<T, VEC, NV>() / 2 > 1 ? 2
                                                   : 1;
}

// a[i] for a run-time i without local memory (a select chain over the unrolled indices).
template <int N>
__device__ __forceinline__ float pick(const float (&a)[N], int i) {
  float r = a[0];
#pragma unroll
  for (int k = 1; k < N; ++k) r = i == k ? a[k] : r;
  return r;
}

// Whether the next chunk's locations and weights are loaded one chunk ahead (12 registers; not
// on the generic VEC = 1 path, whose 8 channels per lane already fill the register budget).
template <typename T, int VEC, int NV>
constexpr bool prefetch_meta() {
  return 4 * NV * Vec<T, VEC>::kWords <= 16;
}

// ------------------------------------------------------------------------- level metadata

struct Level {
  int h, w, start;  // h = w = 0 marks a level that does not fit inside value (skipped)
  float hf, wf;
};

__device__ __forceinline__ int64_t read_index(const void* p, bool is_i64, int64_t i) {
  return is_i64 ? static_cast<const int64_t*>(p)[i]
                : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Fills levels[0..L) from the device tensors and synchronises the block. A level is kept only
// when 1 <= h, 1 <= w and [start, start + h * w) lies inside [0, K).
__device__ __forceinline__ void load_levels(Level* levels, const void* shapes, bool shapes_i64,
                                            const void* starts, bool starts_i64, int L, int K) {
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    const int64_t h = read_index(shapes, shapes_i64, 2 * l);
    const int64_t w = read_index(shapes, shapes_i64, 2 * l + 1);
    const int64_t s = read_index(starts, starts_i64, l);
    const bool ok = h >= 1 && w >= 1 && h <= K && w <= K && s >= 0 && s <= K && h * w <= K - s;
    Level lv;
    lv.h = ok ? static_cast<int>(h) : 0;
    lv.w = ok ? static_cast<int>(w) : 0;
    lv.start = ok ? static_cast<int>(s) : 0;
    lv.hf = static_cast<float>(lv.h);
    lv.wf = static_cast<float>(lv.w);
    levels[l] = lv;
  }
  __syncthreads();
}

// ------------------------------------------------------------------------- bilinear sample

// Corner order: 0 = (y0, x0), 1 = (y0, x0 + 1), 2 = (y0 + 1, x0), 3 = (y0 + 1, x0 + 1).
struct Bilinear {
  bool inside;   // upstream's -1 < y < H && -1 < x < W test
  int y0, x0;    // floor of the pixel coordinates (valid only when inside)
  float ly, lx;  // fractional parts
  int key[4];    // key index of each corner inside value (the level start for a corner outside)
  float cw[4];   // bilinear weight of each corner, 0 for a corner outside the level
  bool valid[4];
};

// The pixel coordinate is one fused multiply-add (loc * size - 0.5, rounded once) in every
// kernel, so the forward, backward and deterministic gather kernels agree bit for bit on which
// cell a sample falls in.
__device__ __forceinline__ Bilinear bilinear(float x, float y, const Level& lv) {
  Bilinear s;
  const float yi = __fmaf_rn(y, lv.hf, -0.5f);
  const float xi = __fmaf_rn(x, lv.wf, -0.5f);
  s.inside = yi > -1.0f && xi > -1.0f && yi < lv.hf && xi < lv.wf;  // false for NaN, empty levels
  // Branch-free: a sample outside continues at (-2, -2), where no corner is valid and both
  // fractions are 0, so the callers' loads and sums need no branch per sample.
  const float ys = s.inside ? yi : -2.0f, xs = s.inside ? xi : -2.0f;
  const float yf = floorf(ys), xf = floorf(xs);
  s.y0 = static_cast<int>(yf);  // in [-1, h - 1] when inside: ys lies in (-1, h)
  s.x0 = static_cast<int>(xf);
  s.ly = ys - yf;
  s.lx = xs - xf;
  const float hy = 1.0f - s.ly, hx = 1.0f - s.lx;
  const bool y0ok = s.y0 >= 0 && s.y0 < lv.h, y1ok = s.y0 + 1 >= 0 && s.y0 + 1 < lv.h;
  const bool x0ok = s.x0 >= 0 && s.x0 < lv.w, x1ok = s.x0 + 1 >= 0 && s.x0 + 1 < lv.w;
  s.valid[0] = y0ok && x0ok;
  s.valid[1] = y0ok && x1ok;
  s.valid[2] = y1ok && x0ok;
  s.valid[3] = y1ok && x1ok;
  const float cw[4] = {hy * hx, hy * s.lx, s.ly * hx, s.ly * s.lx};
  const int base = lv.start + s.y0 * lv.w + s.x0;  // may point before the level; used only if valid
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    s.key[k] = s.valid[k] ? base + (k >> 1) * lv.w + (k & 1) : lv.start;
    s.cw[k] = s.valid[k] ? cw[k] : 0.0f;
  }
  return s;
}

// What the gather loops need of one sample, in fewer instructions than `bilinear`: corner 0's
// key (corners 1, 2, 3 are key0 + 1, + w, + w + 1), which corners lie inside the level, and
// attn * bilinear weight per corner (0 outside). Same pixel coordinate and inside rule as
// `bilinear`, so both agree on every sample.
struct Gather {
  uint32_t key0;  // start + y0 * w + x0 in unsigned 32-bit arithmetic: it wraps when y0 or x0 is
                  // -1, but only valid corners are dereferenced, and their keys are exact (< K)
  uint32_t w;
  bool valid[4];
  float cw[4];
};

__device__ __forceinline__ Gather gather_setup(float x, float y, float a, const Level& lv) {
  Gather s;
  const float yi = __fmaf_rn(y, lv.hf, -0.5f);
  const float xi = __fmaf_rn(x, lv.wf, -0.5f);
  const bool inside = yi > -1.0f && xi > -1.0f && yi < lv.hf && xi < lv.wf;  // false for NaN
  const float ys = inside ? yi : -2.0f, xs = inside ? xi : -2.0f;
  const float yf = floorf(ys), xf = floorf(xs);
  const int y0 = static_cast<int>(yf), x0 = static_cast<int>(xf);
  const float ly = ys - yf, lx = xs - xf;
  const float hy = 1.0f - ly, hx = 1.0f - lx;
  const uint32_t h = static_cast<uint32_t>(lv.h), w = static_cast<uint32_t>(lv.w);
  const bool y0ok = static_cast<uint32_t>(y0) < h, y1ok = static_cast<uint32_t>(y0 + 1) < h;
  const bool x0ok = static_cast<uint32_t>(x0) < w, x1ok = static_cast<uint32_t>(x0 + 1) < w;
  s.valid[0] = y0ok && x0ok;
  s.valid[1] = y0ok && x1ok;
  s.valid[2] = y1ok && x0ok;
  s.valid[3] = y1ok && x1ok;
  const float ah = a * hy, al = a * ly;
  const float cw[4] = {ah * hx, ah * lx, al * hx, al * lx};
#pragma unroll
  for (int k = 0; k < 4; ++k) s.cw[k] = s.valid[k] ? cw[k] : 0.0f;
  s.key0 =
      static_cast<uint32_t>(lv.start) + static_cast<uint32_t>(y0) * w + static_cast<uint32_t>(x0);
  s.w = w;
  return s;
}

// (y0 & 1) * 2 + (x0 & 1) of gather_setup's cell (same arithmetic; anything for a sample outside):
// corner c of the sample lies on a pixel of parity class (py & 1) * 2 + (px & 1) = parity ^ c.
__device__ __forceinline__ uint32_t cell_parity(float x, float y, const Level& lv) {
  const float yi = __fmaf_rn(y, lv.hf, -0.5f);
  const float xi = __fmaf_rn(x, lv.wf, -0.5f);
  const bool inside = yi > -1.0f && xi > -1.0f && yi < lv.hf && xi < lv.wf;
  const int y0 = static_cast<int>(floorf(inside ? yi : -2.0f));
  const int x0 = static_cast<int>(floorf(inside ? xi : -2.0f));
  return ((static_cast<uint32_t>(y0) & 1u) << 1) | (static_cast<uint32_t>(x0) & 1u);
}

// Byte offset of corner c of a sample from its (batch, head) row 0, for rows `row_bytes` apart.
__device__ __forceinline__ uint64_t corner_offset(const Gather& s, int c, uint32_t row_bytes) {
  const uint32_t key = s.key0 + static_cast<uint32_t>(c & 1) + ((c & 2) ? s.w : 0u);
  return static_cast<uint64_t>(key) * row_bytes;
}

template <typename P>
__device__ __forceinline__ P* byte_offset(P* p, uint64_t bytes) {
  using C = typename std::conditional<std::is_const<P>::value, const char, char>::type;
  return reinterpret_cast<P*>(reinterpret_cast<C*>(p) + bytes);
}

// Deterministic mode: the "cell" of an inside sample is (y0 + 1, x0 + 1) in a grid padded by
// one row on top and one column on the left, so cy in [0, h], cx in [0, w]. Cells map
// injectively into [0, 3K + 2L) per (batch, head): cells whose top-left corner is a pixel use
// that pixel's key; the top padding row of level l uses K + start + l + cx; the left padding
// column uses 2K + L + start + l + cy - 1.
__device__ __forceinline__ int64_t cell_key(const Level& lv, int l, int cy, int cx, int K, int L) {
  if (cy >= 1 && cx >= 1) return static_cast<int64_t>(lv.start) + (cy - 1) * lv.w + (cx - 1);
  if (cy == 0) return static_cast<int64_t>(K) + lv.start + l + cx;
  return 2 * static_cast<int64_t>(K) + L + lv.start + l + (cy - 1);
}

constexpr float kOutside = -4.0f;  // a normalised location outside every level

// Locations (x, y) and weights of samples s0 .. s0 + 3 of one group. vec: L*P % 4 == 0 and the
// tensors are 16-byte aligned, so one group's 4 samples are a whole aligned vector.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* __restrict__ loc, const T* __restrict__ attn,
                                           int s0, int LP, bool vec, float (&x)[kChunk],
                                           float (&y)[kChunk], float (&w)[kChunk]) {
  if (vec) {
    float xy[2 * kChunk];
    load_floats<T, 2 * kChunk>(loc + 2 * s0, xy);
    load_floats<T, kChunk>(attn + s0, w);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      x[i] = xy[2 * i];
      y[i] = xy[2 * i + 1];
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const bool in = s0 + i < LP;  // samples past the end sit outside every level
      x[i] = in ? load_float(loc + 2 * (s0 + i)) : kOutside;
      y[i] = in ? load_float(loc + 2 * (s0 + i) + 1) : kOutside;
      w[i] = in ? load_float(attn + s0 + i) : 0.0f;
    }
  }
}

// Problem sizes shared by the kernels.
struct Dims {
  int64_t groups;  // bs * Q * heads
  int Q, heads, D, K, L, P, LP;
  int log2g;  // lanes per group = 1 << log2g
};

// Next (point, level) of the flattened levels x points walk; the level stays in [0, L) (samples
// past the end of the last chunk read the last level and sit outside it).
__device__ __forceinline__ void advance(int& p, int& l, const Dims& d) {
  if (++p == d.P) {
    p = 0;
    l = l + 1 < d.L ? l + 1 : l;
  }
}

// Thread t of a kernel's grid-stride walk serves lane `lane` of group g = (b * Q + q) * heads + h,
// whose value rows start at element `value_offset`. Threads past the end (t >= total) are
// inactive and take group 0.
struct GroupLane {
  bool active;
  int lane, h;
  int64_t g, b, value_offset;
};

__device__ __forceinline__ GroupLane group_lane(int64_t t, int64_t total, int G, const Dims& d) {
  GroupLane r;
  r.active = t < total;
  r.g = r.active ? t >> d.log2g : 0;
  r.lane = static_cast<int>(t & (G - 1));
  const int64_t bq = r.g / d.heads;
  r.h = static_cast<int>(r.g - bq * d.heads);
  r.b = bq / d.Q;
  r.value_offset = (r.b * d.K * d.heads + r.h) * d.D;
  return r;
}

// The prefetched chunk becomes the current one.
__device__ __forceinline__ void take_chunk(float (&x)[kChunk], float (&y)[kChunk],
                                           float (&w)[kChunk], const float (&nx)[kChunk],
                                           const float (&ny)[kChunk], const float (&nw)[kChunk]) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    x[i] = nx[i];
    y[i] = ny[i];
    w[i] = nw[i];
  }
}

// ------------------------------------------------------------------------------- forward

// Locations and weights of chunk s0 of a group, or "outside, weight 0" past the last chunk.
template <typename T>
__device__ __forceinline__ void load_chunk_or_outside(const T* __restrict__ loc,
                                                      const T* __restrict__ attn, int s0, int LP,
                                                      bool vec, float (&x)[kChunk],
                                                      float (&y)[kChunk], float (&w)[kChunk]) {
  if (s0 < LP) {
    load_chunk(loc, attn, s0, LP, vec, x, y, w);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      x[i] = y[i] = kOutside;
      w[i] = 0.0f;
    }
  }
}

template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kBlockMax, 1)
    forward_kernel(const T* __restrict__ value, const void* shapes, bool shapes_i64,
                   const void* starts, bool starts_i64, const T* __restrict__ loc,
                   const T* __restrict__ attn, T* __restrict__ out, Dims d, bool vec_meta) {
  constexpr int SB = samples_in_flight<T, VEC, NV>();
  constexpr bool kPrefetch = prefetch_meta<T, VEC, NV>();
  static_assert(kChunk % SB == 0, "samples in flight must divide the chunk");
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, shapes, shapes_i64, starts, starts_i64, d.L, d.K);
  const int G = 1 << d.log2g;
  const int64_t total = d.groups << d.log2g;
  const uint32_t row_bytes =
      static_cast<uint32_t>(d.heads * d.D) * static_cast<uint32_t>(sizeof(T));
  // Groups of >= 4 lanes share the per-sample setup: lane i of a group sets up sample i of each
  // chunk and the group reads the result by shuffles (6 per sample) instead of every lane
  // repeating the ~50-instruction setup. All lanes of a warp run every shuffle (lanes past the
  // end walk outside samples and store nothing).
  const bool share = VEC > 1 && G >= kChunk;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < total;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const GroupLane gl = group_lane(base + threadIdx.x, total, G, d);
    const bool active = gl.active;
    const int64_t g = gl.g;
    const int lane = gl.lane;
    const T* vbase = value + gl.value_offset;
    int ch[NV];
    bool chok[NV];
    const T* vlane[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      ch[k] = (lane + k * G) * VEC;
      chok[k] = active && ch[k] < d.D;  // D % VEC == 0: a vector is wholly inside or outside
      vlane[k] = vbase + ch[k];
    }
    float acc[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[k][j] = 0.0f;

    const T* gloc = loc + g * d.LP * 2;
    const T* gattn = attn + g * d.LP;
    const int mine = lane & (kChunk - 1);  // shared setup: this lane's sample of each chunk

    // The walk over the group's samples, kChunk at a time; kShare selects the shared setup.
    auto walk = [&](auto share_tag) {
      constexpr bool kShare = decltype(share_tag)::value;
      // Locations and weights (x[0], y[0], w[0] only with kShare: this lane's own sample), the
      // next chunk's loaded while this chunk's corners are in flight.
      auto load_meta = [&](int s0, float(&x)[kChunk], float(&y)[kChunk], float(&w)[kChunk]) {
        if constexpr (kShare) {
          const int i = s0 + mine;
          const bool in = active && i < d.LP;
          x[0] = in ? load_float(gloc + 2 * i) : kOutside;
          y[0] = in ? load_float(gloc + 2 * i + 1) : kOutside;
          w[0] = in ? load_float(gattn + i) : 0.0f;
        } else {
          load_chunk_or_outside(gloc, gattn, active ? s0 : d.LP, d.LP, vec_meta, x, y, w);
        }
      };
      float x[kChunk], y[kChunk], w[kChunk];
      if constexpr (kPrefetch) load_meta(0, x, y, w);
      int l = 0, p = 0;
      for (int s0 = 0; s0 < d.LP; s0 += kChunk) {
        float nx[kChunk], ny[kChunk], nw[kChunk];
        if constexpr (kPrefetch) {
          load_meta(s0 + kChunk, nx, ny, nw);
        } else {
          (void)nx, (void)ny, (void)nw;
          load_meta(s0, x, y, w);
        }
        Gather my;
        uint32_t my_mask = 0u;
        if constexpr (kShare) {
          // The level of sample s0 + mine: (l, p) is sample s0's; at most 4 steps.
          int lv_mine = l;
          for (int q = p + mine; q >= d.P; q -= d.P)
            lv_mine = lv_mine + 1 < d.L ? lv_mine + 1 : lv_mine;
          my = gather_setup(x[0], y[0], w[0], levels[lv_mine]);
#pragma unroll
          for (int c = 0; c < 4; ++c) my_mask |= my.valid[c] ? 1u << c : 0u;
        }
        // One batch: phase 1 sets up SB samples and issues all their corner loads
        // (predicated, no branch); phase 2 converts and accumulates in (sample, corner) order.
        auto batch = [&](int i0) {
          Vec<T, VEC> raw[SB][4][NV];
          float cw[SB][4];
#pragma unroll
          for (int j = 0; j < SB; ++j) {
            Gather s;
            if constexpr (kShare) {
              const int src = i0 + j;
              s.key0 = __shfl_sync(kFullMask, my.key0, src, G);
              const uint32_t mask = __shfl_sync(kFullMask, my_mask, src, G);
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                s.cw[c] = __shfl_sync(kFullMask, my.cw[c], src, G);
                s.valid[c] = (mask >> c) & 1u;
              }
              s.w = static_cast<uint32_t>(levels[l].w);
            } else {
              s = gather_setup(pick(x, i0 + j), pick(y, i0 + j), pick(w, i0 + j), levels[l]);
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              cw[j][c] = s.cw[c];
              const uint64_t ofs = corner_offset(s, c, row_bytes);
#pragma unroll
              for (int k = 0; k < NV; ++k) {
                raw[j][c][k].load_if(s.valid[c] && chok[k], byte_offset(vlane[k], ofs));
              }
            }
            advance(p, l, d);
          }
#pragma unroll
          for (int j = 0; j < SB; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
#pragma unroll
              for (int k = 0; k < NV; ++k) {
                float v[VEC];
                raw[j][c][k].unpack(v);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[k][e] = __fmaf_rn(cw[j][c], v[e], acc[k][e]);
              }
        };
        if constexpr (SB == kChunk) {
          batch(0);
        } else {
          // Rolled: the compiler hoists one batch's loads above its arithmetic, and the batch
          // bounds the registers that takes.
#pragma unroll 1
          for (int i0 = 0; i0 < kChunk; i0 += SB) batch(i0);
        }
        if constexpr (kPrefetch) take_chunk(x, y, w, nx, ny, nw);
      }
    };
    if constexpr (VEC > 1) {  // (the generic path keeps its registers for its 8 channels)
      if (share) {
        walk(std::true_type{});
      } else {
        walk(std::false_type{});
      }
    } else {
      walk(std::false_type{});
    }
    T* orow = out + g * d.D;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (chok[k]) store_floats<T, VEC>(orow + ch[k], acc[k]);
  }
}

// ------------------------------------------------------------------------------ backward

// One reduce-scatter step over lane bit o: lanes without the bit keep v[0, N), lanes with it keep
// v[N, 2N) (moved to v[0, N)), each adding its partner's copy. Returns whether the bit is set.
template <int N>
__device__ __forceinline__ bool halve(float (&v)[16], int o, int G, int lane) {
  const bool up = (lane & o) != 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float send = up ? v[j] : v[j + N];
    const float keep = up ? v[j + N] : v[j];
    v[j] = keep + __shfl_xor_sync(kFullMask, send, o, G);
  }
  return up;
}

// Reduces v[16] = 4 samples x 4 corner dot products (sample-major) over the G lanes of a group
// with a reduce-scatter: 8 + 4 shuffles halve the values twice, then plain butterflies finish
// the sum. Afterwards a lane holds the full sums of samples first .. first + owned - 1 in
// v[4 * j + corner]: G = 1: all 4 samples; G = 2: 2 samples; G >= 4: 1 sample (lanes that
// differ only in the bits below G / 4 hold the same sample). Returns first.
__device__ __forceinline__ int reduce_dots(float (&v)[16], int G, int lane) {
  int first = 0;
  if (G >= 2) first = halve<8>(v, G >> 1, G, lane) ? 2 : 0;
  if (G >= 4) first += halve<4>(v, G >> 2, G, lane) ? 1 : 0;
  for (int o = G >> 3; o >= 1; o >>= 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] += __shfl_xor_sync(kFullMask, v[j], o, G);
  }
  return first;
}

__device__ __forceinline__ int pick_int(const int (&a)[kChunk], int i) {
  int r = a[0];
#pragma unroll
  for (int k = 1; k < kChunk; ++k) r = i == k ? a[k] : r;
  return r;
}

__device__ __forceinline__ void put_int(int (&a)[kChunk], int i, int v) {
#pragma unroll
  for (int k = 0; k < kChunk; ++k) a[k] = i == k ? v : a[k];
}

// ------------------------------------------------ backward: merging atomics across groups

// Modes 3 / 4 (kWarp = 1 / 2 in backward_kernel): the groups of a warp serve consecutive queries
// of one (batch, head), so their grad_value atomics go to one channel slice of neighbouring
// pixels; before issuing them, the warp finds the contributions of one chunk (four samples per
// group, four corners each) that hit the same pixel and sums them, so one RED per distinct
// (pixel, channel vector) is issued (chunk_scatter). The matching works in segments of
// kMergeWidth lanes (the whole warp on NVIDIA; 32-lane pieces of MUSA's 128-lane warps, where a
// 32-bit lane mask cannot name every lane).
constexpr int kMergeWidth = kWarpSize < 32 ? kWarpSize : 32;
constexpr uint32_t kNoKey = ~0u;  // a corner that adds nothing (pixel keys are < K < 2^31)

// Mask (bit i = segment lane i) of the lanes of this lane's segment that pass the same key.
// kHow = 1: the hardware match where the device pass has it; kHow = 2 (and every pass without
// it, MUSA included): kMergeWidth shuffles and compares.
template <int kHow>
__device__ __forceinline__ unsigned match_lanes(uint32_t key) {
#if MUSPACE_HAS_WARP_MATCH
  if constexpr (kHow == 1) {
    return __match_any_sync(kFullMask, key);  // kMergeWidth == kWarpSize on CUDA
  }
#endif
  unsigned m = 0u;
#pragma unroll
  for (int k = 0; k < kMergeWidth; ++k) {
    const uint32_t other = __shfl_sync(kFullMask, key, k, kMergeWidth);
    m |= other == key ? 1u << k : 0u;
  }
  return m;
}

// Maximum of v over the whole warp (a warp-uniform loop count).
__device__ __forceinline__ int warp_max(int v) {
#if MUSPACE_HAS_WARP_REDUCE
  return __reduce_max_sync(kFullMask, v);
#else
#pragma unroll
  for (int o = kWarpSize / 2; o >= 1; o >>= 1) {
    const int other = __shfl_xor_sync(kFullMask, v, o);
    v = other > v ? other : v;
  }
  return v;
#endif
}

// As group_lane, but consecutive groups of the walk are consecutive queries of one (batch,
// head): walk group v = (b * heads + h) * Q + q serves g = (b * Q + q) * heads + h. bh = b *
// heads + h.
__device__ __forceinline__ GroupLane group_lane_by_head(int64_t t, int64_t total, int G,
                                                        const Dims& d, int64_t& bh) {
  GroupLane r;
  r.active = t < total;
  const int64_t v = r.active ? t >> d.log2g : 0;
  r.lane = static_cast<int>(t & (G - 1));
  bh = v / d.Q;
  const int64_t q = v - bh * d.Q;
  r.b = bh / d.heads;
  r.h = static_cast<int>(bh - r.b * d.heads);
  r.g = (r.b * d.Q + q) * d.heads + r.h;
  r.value_offset = (r.b * d.K * d.heads + r.h) * d.D;
  return r;
}

// The grad_value atomics of one chunk in modes 3 / 4: one atomic per distinct pixel that the
// chunk's samples of a warp segment's groups (same (batch, head), bh_mask) touch. Lane j < 4 of
// each group presents sample j of the chunk (`mine`); a 2 x 2 footprint covers one pixel of
// each parity class (y & 1, x & 1), so four matches, one per class r, each presenting the
// corner `parity ^ r` (cell_parity), find every pair of contributions that hit one pixel, also at
// different corners, samples and groups. The lowest presenter of a pixel leads: its group
// adds the members' weights times their groups' grad_out slices (s_go, see backward_kernel)
// to its own contribution and issues one atomic per channel vector. Called by every lane of
// the warp (shuffles inside).
template <int kWarp, int AN, int AV>
__device__ __forceinline__ void chunk_scatter(const Gather& mine, uint32_t parity, int lane,
                                              int seg_lane, unsigned bh_mask,
                                              const float (&goa)[AN][AV], const float* s_go,
                                              float* arow, uint32_t row_bytes_acc,
                                              const int (&ach)[AN], const bool (&achok)[AN]) {
  const int gbase = seg_lane - lane;  // segment lane of this group's lane 0
  // this lane's channel slice in the s_go row of its segment's lane 0
  const float* slice = s_go + (static_cast<int>(threadIdx.x) - seg_lane + lane) * AV;
  // (rolled loops: unrolled, the 16 (r, j) bodies took ~3x mode 2's code, for the instruction
  // cache; nothing in them is indexed by r or j)
#pragma unroll 1
  for (int r = 0; r < 4; ++r) {
    // the corner of `mine` in parity class r, by selects on its bits (a select chain over the
    // corner index becomes an indexed local-memory load in nvcc's output)
    const uint32_t c = parity ^ static_cast<uint32_t>(r);
    const bool b0 = (c & 1u) != 0u, b1 = (c & 2u) != 0u;
    const bool valid =
        b1 ? (b0 ? mine.valid[3] : mine.valid[2]) : (b0 ? mine.valid[1] : mine.valid[0]);
    const float my_w = b1 ? (b0 ? mine.cw[3] : mine.cw[2]) : (b0 ? mine.cw[1] : mine.cw[0]);
    const uint32_t my_key = mine.key0 + (b0 ? 1u : 0u) + (b1 ? mine.w : 0u);
    const bool presents = lane < 4 && valid;
    const unsigned mm = match_lanes<kWarp>(presents ? my_key : kNoKey);
    const unsigned m = presents ? mm & bh_mask : 0u;  // (presenters of nothing lead nothing)
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {
      const int src = gbase + j;
      const unsigned self = 1u << src;
      const unsigned mc = __shfl_sync(kFullMask, m, src, kMergeWidth);
      const uint32_t key = __shfl_sync(kFullMask, my_key, src, kMergeWidth);
      const float wj = __shfl_sync(kFullMask, my_w, src, kMergeWidth);
      const bool lead = (mc & self) != 0u && (mc & (self - 1u)) == 0u;
      unsigned rest = lead ? mc & ~self : 0u;
      float acc[AN][AV];
#pragma unroll
      for (int a = 0; a < AN; ++a)
#pragma unroll
        for (int e = 0; e < AV; ++e) acc[a][e] = wj * goa[a][e];
      const int iters = warp_max(__popc(rest));
      for (int i = 0; i < iters; ++i) {
        const int u = rest != 0u ? __ffs(static_cast<int>(rest)) - 1 : 0;
        const float wu = __shfl_sync(kFullMask, my_w, u, kMergeWidth);
        if (rest != 0u) {
          const float* other = slice + (u - (u & 3)) * AV;  // u's group lane 0 is u - (u & 3)
#pragma unroll
          for (int a = 0; a < AN; ++a) {
            float gv[AV];
            load_floats<float, AV>(other + a * blockDim.x * AV, gv);
#pragma unroll
            for (int e = 0; e < AV; ++e) acc[a][e] = __fmaf_rn(wu, gv[e], acc[a][e]);
          }
          rest &= rest - 1u;
        }
      }
      if (lead) {
        const uint64_t ofs = static_cast<uint64_t>(key) * row_bytes_acc;
#pragma unroll
        for (int a = 0; a < AN; ++a) {
          if (achok[a]) atomic_add_scaled<AV>(byte_offset(arow, ofs) + ach[a], 1.0f, acc[a]);
        }
      }
    }
  }
}

// grad_value is accumulated in `gacc` (float32, zero-filled by the entry) unless keys != null
// (deterministic mode): then each sample's cell key is written instead (sentinel for samples
// that contribute nothing) and grad_value is left to the gather kernel. kWarp != 0 (not with
// kMerge; groups of 4 <= G < kMergeWidth lanes; atomic mode only): the atomics of each chunk are
// merged across the samples and groups of a warp segment (modes 3 / 4, chunk_scatter).
template <typename T, int VEC, int NV, bool kMerge, int kWarp>
__global__ void __launch_bounds__(kBlockMax, 1)
    backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ value, const void* shapes,
                    bool shapes_i64, const void* starts, bool starts_i64, const T* __restrict__ loc,
                    const T* __restrict__ attn, float* __restrict__ gacc, T* __restrict__ grad_loc,
                    T* __restrict__ grad_attn, void* keys, bool keys_i64, int64_t key_space, Dims d,
                    bool vec_meta) {
  constexpr int SB = backward_samples_in_flight<T, VEC, NV>();
  constexpr bool kPrefetch = prefetch_meta<T, VEC, NV>() && !kMerge && kWarp == 0;  // registers
  static_assert(kChunk % SB == 0, "samples in flight must divide the chunk");
  // grad_value atomics are float vectors of AV <= 4 channels. Where a lane's load vector holds
  // more than 4 channels (8 channels of a 16-bit type), the atomics use their own interleaved
  // layout, AN vectors at channels (lane + a * G) * AV, so that one RED instruction of a group
  // covers G * 16 contiguous bytes: whole 32-byte sectors instead of half of each of twice as
  // many sectors (the L2 works per sector).
  constexpr int AV = VEC > 4 ? 4 : VEC;
  constexpr int AN = VEC * NV / AV;
  constexpr bool kSplit = AV != VEC;
  constexpr bool kWarpMerge = kWarp != 0;
  static_assert(!(kWarpMerge && kMerge), "the warp merge replaces the pairwise merge");
  __shared__ Level levels[kMaxLevels];
  // kWarpMerge: every lane's grad_out slice in the atomic layout, float a * AV + e of thread t at
  // [(a * blockDim.x + t) * AV + e], so that a lane can weight another group's slice (dynamic
  // shared memory, blockDim.x * AN * AV floats; none in the other modes).
  extern __shared__ float4 s_dynamic[];
  float* s_go = reinterpret_cast<float*>(s_dynamic);
  load_levels(levels, shapes, shapes_i64, starts, starts_i64, d.L, d.K);
  const int G = 1 << d.log2g;
  const int64_t total = d.groups << d.log2g;
  const uint32_t row = static_cast<uint32_t>(d.heads * d.D);
  const uint32_t row_bytes = row * static_cast<uint32_t>(sizeof(T));
  const uint32_t row_bytes_acc = row * 4u;
  const bool deterministic = keys != nullptr;
  const int owned = G >= 4 ? 1 : kChunk / G;
  // Lanes that share an owned sample (G >= 8) leave the writes to the lowest one.
  const int dup_mask = G >= 8 ? (G >> 2) - 1 : 0;
  // Every block walks the same number of iterations, so all lanes of a warp reach every
  // shuffle; lanes past the end work on zeros and write nothing.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x; base < total;
       base += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t bh = 0;
    const GroupLane gl = kWarpMerge ? group_lane_by_head(base + threadIdx.x, total, G, d, bh)
                                    : group_lane(base + threadIdx.x, total, G, d);
    const bool active = gl.active;
    const int64_t g = gl.g;
    const int lane = gl.lane;
    const T* vrow = value + gl.value_offset;
    float* arow = gacc + gl.value_offset;
    int ch[NV];
    bool chok[NV];
    float go[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      ch[k] = (lane + k * G) * VEC;
      chok[k] = active && ch[k] < d.D;
      if (chok[k]) {
        load_floats<T, VEC>(grad_out + g * d.D + ch[k], go[k]);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) go[k][j] = 0.0f;
      }
    }
    // The atomic layout (the load layout itself unless kSplit).
    int ach[AN];
    bool achok[AN];
    float goa[AN][AV];
#pragma unroll
    for (int a = 0; a < AN; ++a) {
      if constexpr (kSplit) {
        ach[a] = (lane + a * G) * AV;
        achok[a] = active && ach[a] < d.D;
        if (achok[a]) {
          load_floats<T, AV>(grad_out + g * d.D + ach[a], goa[a]);
        } else {
#pragma unroll
          for (int j = 0; j < AV; ++j) goa[a][j] = 0.0f;
        }
      } else {
        ach[a] = ch[a];
        achok[a] = chok[a];
#pragma unroll
        for (int j = 0; j < AV; ++j) goa[a][j] = go[a][j];
      }
    }
    // kWarpMerge: publish this lane's grad_out slice and find the lanes of this segment whose
    // groups share this group's (batch, head): two groups of one segment are < kMergeWidth walk
    // groups apart, so the low 32 bits of bh tell them apart. A lane reads only the slices of
    // its own warp, so warp barriers suffice (the first keeps the last walk's readers safe);
    // without __syncwarp, block barriers, which every thread reaches (the block walks
    // uniformly).
    unsigned bh_mask = 0u;
    const int seg_lane = static_cast<int>(threadIdx.x) & (kMergeWidth - 1);
    if constexpr (kWarpMerge) {
#if MUSPACE_HAS_SYNCWARP
      __syncwarp(kFullMask);
#else
      __syncthreads();
#endif
#pragma unroll
      for (int a = 0; a < AN; ++a) {
        store_floats<float, AV>(s_go + (a * blockDim.x + threadIdx.x) * AV, goa[a]);
      }
#if MUSPACE_HAS_SYNCWARP
      __syncwarp(kFullMask);
#else
      __syncthreads();
#endif
      bh_mask = match_lanes<kWarp>(static_cast<uint32_t>(bh));
    }
    // grad_value += a * w_k * grad_out at the valid corners of one sample.
    auto scatter = [&](const Gather& s) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint64_t ofs = corner_offset(s, c, row_bytes_acc);
#pragma unroll
        for (int a = 0; a < AN; ++a) {
          float v[AV];
#pragma unroll
          for (int e = 0; e < AV; ++e) v[e] = s.cw[c] * goa[a][e];
          if (s.valid[c] && achok[a])
            atomic_add_scaled<AV>(byte_offset(arow, ofs) + ach[a], 1.0f, v);
        }
      }
    };
    // kMerge: the previous sample's corners, held back until the next sample is known.
    Gather pend;
    pend.key0 = pend.w = 0u;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      pend.valid[c] = false;
      pend.cw[c] = 0.0f;
    }
    const T* gloc = loc + g * d.LP * 2;
    const T* gattn = attn + g * d.LP;
    const int64_t key_base = (gl.b * d.heads + gl.h) * (3 * static_cast<int64_t>(d.K) + 2 * d.L);
    // Locations and weights one chunk ahead, as in the forward; inactive lanes sample nothing.
    float x[kChunk], y[kChunk], w[kChunk];
    if constexpr (kPrefetch) {
      load_chunk_or_outside(gloc, gattn, active ? 0 : d.LP, d.LP, vec_meta, x, y, w);
    }
    int l = 0, p = 0;
    for (int s0 = 0; s0 < d.LP; s0 += kChunk) {
      float nx[kChunk], ny[kChunk], nw[kChunk];
      if constexpr (kPrefetch) {
        load_chunk_or_outside(gloc, gattn, active ? s0 + kChunk : d.LP, d.LP, vec_meta, nx, ny, nw);
      } else {
        load_chunk_or_outside(gloc, gattn, active ? s0 : d.LP, d.LP, vec_meta, x, y, w);
      }
      float dots[4 * kChunk] = {};
      int lvl[kChunk] = {};
      // One batch: phase 1 sets up SB samples, issues their corner loads (predicated, no
      // branch) and their grad_value atomics (which need no loaded data); phase 2 forms the
      // corner dot products once the loads have landed.
      auto batch = [&](int i0) {
        Vec<T, VEC> raw[SB][4][NV];
#pragma unroll
        for (int j = 0; j < SB; ++j) {
          put_int(lvl, i0 + j, l);
          const Gather s =
              gather_setup(pick(x, i0 + j), pick(y, i0 + j), pick(w, i0 + j), levels[l]);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const uint64_t ofs = corner_offset(s, c, row_bytes);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
              raw[j][c][k].load_if(s.valid[c] && chok[k], byte_offset(vrow, ofs) + ch[k]);
            }
          }
          if (!deterministic) {
            if constexpr (kMerge) {
              // Corners this sample shares with the previous one (same key) take the previous
              // one's weight; the previous sample's other corners are flushed now.
              Gather cur = s;
              uint32_t pk[4], nk[4];
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                pk[c] = pend.key0 + static_cast<uint32_t>(c & 1) + ((c & 2) ? pend.w : 0u);
                nk[c] = cur.key0 + static_cast<uint32_t>(c & 1) + ((c & 2) ? cur.w : 0u);
              }
              bool used[4] = {false, false, false, false};
#pragma unroll
              for (int c2 = 0; c2 < 4; ++c2)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                  const bool m = pend.valid[c] && cur.valid[c2] && pk[c] == nk[c2];
                  cur.cw[c2] += m ? pend.cw[c] : 0.0f;
                  used[c] = used[c] || m;
                }
#pragma unroll
              for (int c = 0; c < 4; ++c) pend.valid[c] = pend.valid[c] && !used[c];
              scatter(pend);
              pend = cur;
            } else if constexpr (!kWarpMerge) {  // (kWarpMerge: after the chunk's batches)
              scatter(s);
            }
          }
          advance(p, l, d);
        }
        float bd[4 * SB];
#pragma unroll
        for (int j = 0; j < SB; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            float dot = 0.0f;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
              float v[VEC];
              raw[j][c][k].unpack(v);
#pragma unroll
              for (int e = 0; e < VEC; ++e) dot = __fmaf_rn(go[k][e], v[e], dot);
            }
            bd[4 * j + c] = dot;
          }
        // dots[4 * i0 ..] = bd: compile-time indices, one select per value and batch position
#pragma unroll
        for (int q = 0; q < kChunk; q += SB)
#pragma unroll
          for (int k = 0; k < 4 * SB; ++k) dots[4 * q + k] = i0 == q ? bd[k] : dots[4 * q + k];
      };
      if constexpr (SB == kChunk) {
        batch(0);
      } else {
#pragma unroll 1
        for (int i0 = 0; i0 < kChunk; i0 += SB) batch(i0);
      }
      if constexpr (kWarpMerge) {
        if (!deterministic) {
          // sample lane & 3 of the chunk, set up again (the batches keep no setups)
          const int mj = lane & 3;
          const float mx = pick(x, mj), my = pick(y, mj);
          const Level lv = levels[pick_int(lvl, mj)];
          chunk_scatter<kWarp, AN, AV>(gather_setup(mx, my, pick(w, mj), lv),
                                       cell_parity(mx, my, lv), lane, seg_lane, bh_mask, goa, s_go,
                                       arow, row_bytes_acc, ach, achok);
        }
      }
      const int first = reduce_dots(dots, G, lane);
      if (active && (lane & dup_mask) == 0) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          if (j >= owned) break;
          const int si = first + j;
          if (s0 + si >= d.LP) break;
          const int ls = pick_int(lvl, si);
          const Level lv = levels[ls];
          const Bilinear s = bilinear(pick(x, si), pick(y, si), lv);
          const float ws = pick(w, si);
          const float d0 = dots[4 * j], d1 = dots[4 * j + 1], d2 = dots[4 * j + 2],
                      d3 = dots[4 * j + 3];
          float ga = 0.0f, gx = 0.0f, gy = 0.0f;
          if (s.inside) {
            const float hy = 1.0f - s.ly, hx = 1.0f - s.lx;
            // d0..d3 of corners outside the level are 0, so the raw bilinear weights serve.
            ga = hy * hx * d0 + hy * s.lx * d1 + s.ly * hx * d2 + s.ly * s.lx * d3;
            gx = lv.wf * ws * (hy * (d1 - d0) + s.ly * (d3 - d2));
            gy = lv.hf * ws * (hx * (d2 - d0) + s.lx * (d3 - d1));
          }
          const int64_t sflat = g * d.LP + s0 + si;
          store_float(grad_attn + sflat, ga);
          const float xy[2] = {gx, gy};
          store_floats<T, 2>(grad_loc + 2 * sflat, xy);
          if (deterministic) {
            const int64_t key =
                s.inside ? key_base + cell_key(lv, ls, s.y0 + 1, s.x0 + 1, d.K, d.L) : key_space;
            if (keys_i64) {
              static_cast<int64_t*>(keys)[sflat] = key;
            } else {
              static_cast<int32_t*>(keys)[sflat] = static_cast<int32_t>(key);
            }
          }
        }
      }
      if constexpr (kPrefetch) take_chunk(x, y, w, nx, ny, nw);
    }
    if (kMerge && !deterministic) scatter(pend);
  }
}

// ----------------------------------------------------- deterministic grad_value (gather)

// cell_start[c] = first position i with sorted_keys[i] >= c, for c in [0, n_cells].
__global__ void __launch_bounds__(kFillBlock)
    cell_start_kernel(const void* sorted_keys, bool keys_i64, int64_t n, int64_t* cell_start,
                      int64_t n_cells) {
  const int64_t stride = global_threads();
  for (int64_t c = global_thread(); c <= n_cells; c += stride) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + ((hi - lo) >> 1);
      if (read_index(sorted_keys, keys_i64, mid) < c) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    cell_start[c] = lo;
  }
}

// One group per value row (b, key, head): sums, over the four cells whose samples touch this
// pixel and over each cell's samples in ascending sample order, attn * corner weight *
// grad_out[b, q, head, :]. Every row is written (zeros where nothing samples it), so grad_value
// needs no zero-fill and no float atomics.
template <typename T, int VEC, int NV>
__global__ void __launch_bounds__(kBlockMax)
    gather_value_grad_kernel(const T* __restrict__ grad_out, const void* shapes, bool shapes_i64,
                             const void* starts, bool starts_i64, const T* __restrict__ loc,
                             const T* __restrict__ attn, const int64_t* __restrict__ perm,
                             const int64_t* __restrict__ cell_start, int64_t n_samples,
                             T* __restrict__ grad_value, int bs, Dims d) {
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, shapes, shapes_i64, starts, starts_i64, d.L, d.K);
  const int G = 1 << d.log2g;
  const int64_t rows = static_cast<int64_t>(bs) * d.K * d.heads;
  const int64_t total = rows << d.log2g;
  const int64_t space = 3 * static_cast<int64_t>(d.K) + 2 * d.L;
  const int64_t group_samples = d.LP;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = t >> d.log2g;
    const int lane = static_cast<int>(t & (G - 1));
    const int64_t bk = r / d.heads;
    const int h = static_cast<int>(r - bk * d.heads);
    const int64_t b = bk / d.K;
    const int key = static_cast<int>(bk - b * d.K);
    int ch[NV];
    bool chok[NV];
    float acc[NV][VEC];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      ch[k] = (lane + k * G) * VEC;
      chok[k] = ch[k] < d.D;
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[k][j] = 0.0f;
    }
    int l = -1;
    for (int i = 0; i < d.L; ++i) {
      const Level& lv = levels[i];
      if (lv.h > 0 && key >= lv.start && key - lv.start < lv.h * lv.w) {
        l = i;
        break;
      }
    }
    if (l >= 0) {
      const Level lv = levels[l];
      const int rel = key - lv.start;
      const int py = rel / lv.w, px = rel - py * lv.w;
      const int64_t cbase = (b * d.heads + h) * space;
      for (int dy = 0; dy < 2; ++dy) {
        for (int dx = 0; dx < 2; ++dx) {
          // Samples whose top-left corner is (py - 1 + dy, px - 1 + dx): this pixel is their
          // corner (1 - dy, 1 - dx).
          const int64_t c = cbase + cell_key(lv, l, py + dy, px + dx, d.K, d.L);
          const int64_t i0 = cell_start[c], i1 = cell_start[c + 1];
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t sflat = perm[i];
            if (sflat < 0 || sflat >= n_samples) continue;
            const int64_t gs = sflat / group_samples;
            const float x = load_float(loc + 2 * sflat), y = load_float(loc + 2 * sflat + 1);
            const Bilinear s = bilinear(x, y, lv);
            if (!s.inside || s.y0 != py - 1 + dy || s.x0 != px - 1 + dx) continue;
            const float wy = dy == 0 ? s.ly : 1.0f - s.ly;
            const float wx = dx == 0 ? s.lx : 1.0f - s.lx;
            const float coef = load_float(attn + sflat) * wy * wx;
            const T* go = grad_out + gs * d.D;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
              if (!chok[k]) continue;
              float v[VEC];
              load_floats<T, VEC>(go + ch[k], v);
#pragma unroll
              for (int j = 0; j < VEC; ++j) acc[k][j] = __fmaf_rn(coef, v[j], acc[k][j]);
            }
          }
        }
      }
    }
    T* out = grad_value + r * d.D;
#pragma unroll
    for (int k = 0; k < NV; ++k)
      if (chok[k]) store_floats<T, VEC>(out + ch[k], acc[k]);
  }
}

// ----------------------------------------------------------------------- float32 -> T cast

template <typename T>
__global__ void __launch_bounds__(kFillBlock)
    cast_kernel(const float* __restrict__ src, T* __restrict__ dst, int64_t n) {
  const int64_t stride = global_threads();
  const int64_t start = global_thread();
  const bool vec =
      reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const int64_t n4 = vec ? n / 4 : 0;
  for (int64_t i = start; i < n4; i += stride) {
    float v[4];
    load_floats<float, 4>(src + 4 * i, v);
    store_floats<T, 4>(dst + 4 * i, v);
  }
  for (int64_t i = 4 * n4 + start; i < n; i += stride) store_float(dst + i, src[i]);
}

// ------------------------------------------------------------------------------ launchers

// Vector width per load (elements), vectors per lane, and lanes per group.
struct Config {
  int vec, nv, log2g;
};

int ceil_log2(int64_t n) {
  int k = 0;
  while ((int64_t{1} << k) < n) ++k;
  return k;
}

// channels_per_thread: 0 = default (8 where head_dim allows), else 2, 4 or 8 (profiling knob).
// Falls back to narrower vectors, then to the generic scalar path, whenever the head dim or the
// alignment of `aligned_ok(bytes)` does not allow a width.
template <typename AlignedOk>
Config choose_config(int size, int D, int64_t channels_per_thread, AlignedOk aligned_ok) {
  int order[3] = {8, 4, 2};
  if (channels_per_thread == 4) {
    order[0] = 4, order[1] = 2, order[2] = 0;
  } else if (channels_per_thread == 2) {
    order[0] = 2, order[1] = 0, order[2] = 0;
  }
  for (int cpt : order) {
    if (cpt == 0 || D % cpt != 0) continue;
    const int vec = cpt * size > 16 ? 16 / size : cpt;
    const int log2g = ceil_log2(D / cpt);
    if ((1 << log2g) > kWarpSize) continue;
    if (!aligned_ok(vec * size)) continue;
    return {vec, cpt / vec, log2g};
  }
  return {1, kGenericNV, ceil_log2((D + kGenericNV - 1) / kGenericNV)};
}

int block_threads(int64_t requested) {
  if (requested == 0) return kBlockDefault;
  if (requested < kWarpSize || requested > kBlockMax || requested % kWarpSize != 0) {
    TVM_FFI_THROW(ValueError) << "block_threads must be a multiple of " << kWarpSize << " in ["
                              << kWarpSize << ", " << kBlockMax << "], got " << requested;
  }
  return static_cast<int>(requested);
}

// Calls `fn.template run<T, VEC, NV>()` for the chosen configuration.
template <typename T, typename Fn>
void dispatch_config(const Config& c, Fn& fn) {
  constexpr int kWide = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte vector
  if (c.vec == kWide && c.nv == 8 / kWide) return fn.template run<T, kWide, 8 / kWide>();
  if (c.vec == 4 && c.nv == 1) return fn.template run<T, 4, 1>();
  if (c.vec == 2 && c.nv == 1) return fn.template run<T, 2, 1>();
  if (c.vec == 1 && c.nv == kGenericNV) return fn.template run<T, 1, kGenericNV>();
  TVM_FFI_ICHECK(false) << "no kernel for vec=" << c.vec << " nv=" << c.nv;
}

// dispatch_config for the dtype of value.
template <typename Fn>
void dispatch(const TensorView& value, const Config& c, Fn& fn) {
  dispatch_float(value, "value", [&](auto tag) { dispatch_config<decltype(tag)>(c, fn); });
}

// Shape checks shared by forward and backward. Returns the problem sizes (log2g unset).
Dims check_problem(const TensorView& value, const TensorView& shapes, const TensorView& starts,
                   const TensorView& loc, const TensorView& attn) {
  check_gpu_tensor(value, "value");
  check_float_dtype(value, "value");
  check_contiguous(value, "value");
  check_ndim(value, "value", 4);
  check_index_input(shapes, "value_spatial_shapes", value);
  check_index_input(starts, "value_level_start_index", value);
  check_input(loc, "sampling_locations", value, value.dtype());
  check_input(attn, "attention_weights", value, value.dtype());
  check_ndim(shapes, "value_spatial_shapes", 2);
  check_ndim(starts, "value_level_start_index", 1);
  check_ndim(loc, "sampling_locations", 6);
  check_ndim(attn, "attention_weights", 5);
  const int64_t bs = value.size(0), K = value.size(1), heads = value.size(2), D = value.size(3);
  const int64_t L = shapes.size(0);
  if (L < 1 || L > kMaxLevels) {
    TVM_FFI_THROW(ValueError) << "number of levels must be in [1, " << kMaxLevels << "], got " << L;
  }
  check_size(shapes, "value_spatial_shapes", 1, 2);
  check_size(starts, "value_level_start_index", 0, L);
  check_size(loc, "sampling_locations", 0, bs);
  check_size(loc, "sampling_locations", 2, heads);
  check_size(loc, "sampling_locations", 3, L);
  check_size(loc, "sampling_locations", 5, 2);
  const int64_t Q = loc.size(1), P = loc.size(4);
  for (int i = 0; i < 5; ++i) {
    if (attn.size(i) != loc.size(i)) {
      TVM_FFI_THROW(ValueError) << "attention_weights.shape[" << i << "] must be " << loc.size(i)
                                << " (sampling_locations.shape[" << i << "]), got " << attn.size(i);
    }
  }
  if (heads * D >= (int64_t{1} << 29)) {
    TVM_FFI_THROW(ValueError) << "num_heads * head_dim must be < 2^29, got " << heads * D;
  }
  if (D < 1 || D > kMaxHeadDim) {
    TVM_FFI_THROW(ValueError) << "head_dim (value.shape[3]) must be in [1, " << kMaxHeadDim
                              << "], got " << D;
  }
  if (P < 1 || L * P > kMaxPointsPerQuery) {
    TVM_FFI_THROW(ValueError)
        << "num_points (sampling_locations.shape[4]) must be >= 1 with levels * "
           "points <= "
        << kMaxPointsPerQuery << ", got " << P;
  }
  constexpr int64_t kI32 = 0x7fffffff;
  if (K >= kI32 || Q >= kI32 || heads >= kI32 || bs >= kI32) {
    TVM_FFI_THROW(ValueError)
        << "batch, num_keys, num_queries and num_heads must each be < 2^31 - 1";
  }
  Dims d;
  d.groups = bs * Q * heads;
  d.Q = static_cast<int>(Q);
  d.heads = static_cast<int>(heads);
  d.D = static_cast<int>(D);
  d.K = static_cast<int>(K);
  d.L = static_cast<int>(L);
  d.P = static_cast<int>(P);
  d.LP = static_cast<int>(L * P);
  d.log2g = 0;
  return d;
}

bool meta_vectorizable(const Dims& d, const TensorView& loc, const TensorView& attn) {
  return d.LP % kChunk == 0 && is_aligned(loc, 16) && is_aligned(attn, 16);
}

void check_channels_per_thread(int64_t cpt) {
  if (cpt != 0 && cpt != 2 && cpt != 4 && cpt != 8) {
    TVM_FFI_THROW(ValueError) << "channels_per_thread must be 0 (default), 2, 4 or 8, got " << cpt;
  }
}

void check_grad_output(const TensorView& grad_output, const TensorView& value, const Dims& d) {
  check_input(grad_output, "grad_output", value, value.dtype());
  check_ndim(grad_output, "grad_output", 3);
  check_size(grad_output, "grad_output", 0, value.size(0));
  check_size(grad_output, "grad_output", 1, d.Q);
  check_size(grad_output, "grad_output", 2, static_cast<int64_t>(d.heads) * d.D);
}

// Kernel launchers, instantiated per (dtype, VEC, NV) by dispatch().
// What every kernel of this file takes besides its own tensors: the level metadata, the
// per-sample tensors, the problem sizes and the launch shape (one thread per group lane).
struct Common {
  const void *shapes, *starts, *loc, *attn;
  bool shapes_i64, starts_i64;
  Dims d;
  int grid, block;
  gpuStream_t stream;
};

Common common_args(const TensorView& shapes, const TensorView& starts, const TensorView& loc,
                   const TensorView& attn, const Dims& d, int64_t threads, int block, int device_id,
                   gpuStream_t stream) {
  return Common{data_of<const void>(shapes),
                data_of<const void>(starts),
                data_of<const void>(loc),
                data_of<const void>(attn),
                is_int64(shapes),
                is_int64(starts),
                d,
                grid_for(threads, block, device_id, 0),
                block,
                stream};
}

struct ForwardLaunch {
  Common c;
  const void* value;
  void* out;
  bool vec_meta;
  template <typename T, int VEC, int NV>
  void run() {
    forward_kernel<T, VEC, NV><<<c.grid, c.block, 0, c.stream>>>(
        static_cast<const T*>(value), c.shapes, c.shapes_i64, c.starts, c.starts_i64,
        static_cast<const T*>(c.loc), static_cast<const T*>(c.attn), static_cast<T*>(out), c.d,
        vec_meta);
    check_launch("multi_scale_deformable_attn forward_kernel");
  }
};

struct BackwardLaunch {
  Common c;
  const void *grad_output, *value;
  float* gacc;
  void *grad_loc, *grad_attn, *keys;
  bool keys_i64;
  int64_t key_space;
  bool vec_meta, merge;
  int warp;  // 0, or 1 / 2: merge across the groups of a warp (modes 3 / 4) where G allows
  template <typename T, int VEC, int NV, bool kMerge, int kWarp>
  void launch() {
    // kWarp: one grad_out slice (VEC * NV floats) per thread in dynamic shared memory, <= 16 KB
    static_assert(sizeof(float) * kBlockMax * VEC * NV <= 16384, "shared grad_out slices");
    const size_t smem = kWarp != 0 ? sizeof(float) * c.block * VEC * NV : 0;
    backward_kernel<T, VEC, NV, kMerge, kWarp><<<c.grid, c.block, smem, c.stream>>>(
        static_cast<const T*>(grad_output), static_cast<const T*>(value), c.shapes, c.shapes_i64,
        c.starts, c.starts_i64, static_cast<const T*>(c.loc), static_cast<const T*>(c.attn), gacc,
        static_cast<T*>(grad_loc), static_cast<T*>(grad_attn), keys, keys_i64, key_space, c.d,
        vec_meta);
    check_launch("multi_scale_deformable_attn backward_kernel");
  }
  template <typename T, int VEC, int NV>
  void run() {
    if constexpr (VEC > 1) {  // the generic path has no merging variant
      // Across groups: one presenting lane per corner (G >= 4) and >= 2 groups per segment.
      const int G = 1 << c.d.log2g;
      if (warp != 0 && G >= 4 && G < kMergeWidth) {
        return warp == 1 ? launch<T, VEC, NV, false, 1>() : launch<T, VEC, NV, false, 2>();
      }
      if (merge) return launch<T, VEC, NV, true, 0>();
    }
    launch<T, VEC, NV, false, 0>();
  }
};

struct GatherLaunch {
  Common c;
  const void* grad_output;
  const int64_t *perm, *cell_start;
  int64_t n_samples;
  void* grad_value;
  int bs;
  template <typename T, int VEC, int NV>
  void run() {
    gather_value_grad_kernel<T, VEC, NV><<<c.grid, c.block, 0, c.stream>>>(
        static_cast<const T*>(grad_output), c.shapes, c.shapes_i64, c.starts, c.starts_i64,
        static_cast<const T*>(c.loc), static_cast<const T*>(c.attn), perm, cell_start, n_samples,
        static_cast<T*>(grad_value), bs, c.d);
    check_launch("multi_scale_deformable_attn gather_value_grad_kernel");
  }
};

// ---------------------------------------------------------------------------- entry points

// out[bs, Q, heads * D] (pre-allocated, value's dtype) = MSDA(value, ...). channels_per_thread
// (0 = default) and block_threads (0 = default) are profiling knobs.
void multi_scale_deformable_attn_forward(TensorView value, TensorView spatial_shapes,
                                         TensorView level_start_index,
                                         TensorView sampling_locations,
                                         TensorView attention_weights, TensorView out,
                                         int64_t channels_per_thread, int64_t block_threads_req,
                                         int64_t stream) {
  Dims d = check_problem(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights);
  check_input(out, "out", value, value.dtype());
  check_ndim(out, "out", 3);
  check_size(out, "out", 0, value.size(0));
  check_size(out, "out", 1, d.Q);
  check_size(out, "out", 2, static_cast<int64_t>(d.heads) * d.D);
  const int block = block_threads(block_threads_req);
  check_channels_per_thread(channels_per_thread);
  if (d.groups == 0) return;
  const Config cfg = choose_config(element_bytes(value), d.D, channels_per_thread, [&](int b) {
    return is_aligned(value, b) && is_aligned(out, b);
  });
  d.log2g = cfg.log2g;
  const int device_id = value.device().device_id;
  DeviceGuard guard(device_id);
  ForwardLaunch launch{
      common_args(spatial_shapes, level_start_index, sampling_locations, attention_weights, d,
                  d.groups << d.log2g, block, device_id, as_stream(stream)),
      data_of<const void>(value), data_of<void>(out),
      meta_vectorizable(d, sampling_locations, attention_weights)};
  dispatch(value, cfg, launch);
}

// Writes grad_value, grad_sampling_locations and grad_attention_weights in full (pre-allocated,
// value's dtype; grad_value is zero-filled here first).
// - mode 0: grad_value is accumulated with float atomics, directly when value is float32, else
//   in `workspace` (float32, value.numel() elements) followed by one cast pass.
// - mode 2: the same, but a corner that a sample shares with the previous sample of its group
//   (same pixel) is added once, with both weights (fewer atomics, same result up to rounding).
// - mode 3: instead of mode 2's merge, the atomics of each 4-sample chunk are merged across the
//   samples and the groups of a warp, which then serve consecutive queries of one (batch, head):
//   one atomic per distinct pixel of a chunk (groups of 4 <= G < 32 lanes; other head dims run
//   mode 2). Mode 4: the same with the shuffle-compare key match of builds without a hardware
//   match (MUSA) forced, to test that path on CUDA.
// - mode 1 (deterministic): no float atomics; `keys` (int32 or int64, one per sample) receives
//   each sample's cell key and grad_value is NOT written here: the caller sorts the keys
//   (stable) and calls multi_scale_deformable_attn_backward_value_deterministic.
// workspace / keys may be empty when their mode does not use them.
void multi_scale_deformable_attn_backward(
    TensorView grad_output, TensorView value, TensorView spatial_shapes,
    TensorView level_start_index, TensorView sampling_locations, TensorView attention_weights,
    TensorView grad_value, TensorView grad_sampling_locations, TensorView grad_attention_weights,
    TensorView workspace, TensorView keys, int64_t mode, int64_t channels_per_thread,
    int64_t block_threads_req, int64_t stream) {
  Dims d = check_problem(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights);
  check_grad_output(grad_output, value, d);
  check_input(grad_value, "grad_value", value, value.dtype());
  check_same_shape(grad_value, "grad_value", value, "value");
  check_input(grad_sampling_locations, "grad_sampling_locations", value, value.dtype());
  check_same_shape(grad_sampling_locations, "grad_sampling_locations", sampling_locations,
                   "sampling_locations");
  check_input(grad_attention_weights, "grad_attention_weights", value, value.dtype());
  check_same_shape(grad_attention_weights, "grad_attention_weights", attention_weights,
                   "attention_weights");
  const int block = block_threads(block_threads_req);
  check_channels_per_thread(channels_per_thread);
  const int size = element_bytes(value);
  if (mode < 0 || mode > 4) {
    TVM_FFI_THROW(ValueError) << "mode must be 0 (atomics), 1 (deterministic), 2 (atomics, "
                                 "merged corners), 3 or 4 (atomics, merged corners and merged "
                                 "across the groups of a warp), got "
                              << mode;
  }
  const bool det = mode == 1;
  const bool use_workspace = !det && !same_dtype(value.dtype(), kFloat32);
  if (use_workspace) {
    check_input(workspace, "workspace", value, kFloat32);
    if (workspace.numel() != value.numel()) {
      TVM_FFI_THROW(ValueError) << "workspace must have " << value.numel()
                                << " elements (value.numel()), got " << workspace.numel();
    }
  }
  const int64_t key_space = value.size(0) * d.heads * (3 * static_cast<int64_t>(d.K) + 2 * d.L);
  if (det) {
    check_index_input(keys, "keys", value);
    if (keys.numel() != d.groups * d.LP) {
      TVM_FFI_THROW(ValueError) << "keys must have " << d.groups * d.LP
                                << " elements (one per sample), got " << keys.numel();
    }
    if (!is_int64(keys) && key_space >= 0x7fffffff) {
      TVM_FFI_THROW(ValueError) << "keys must be int64 when batch * heads * (3 * num_keys + 2 * "
                                   "levels) >= 2^31 - 1, got int32 for "
                                << key_space;
    }
  }
  // Every store of grad_sampling_locations is an (x, y) pair.
  if (!is_aligned(grad_sampling_locations, 2 * size)) {
    TVM_FFI_THROW(ValueError) << "grad_sampling_locations must be aligned to " << 2 * size
                              << " bytes";
  }
  DeviceGuard guard(value.device().device_id);
  const int device_id = value.device().device_id;
  const gpuStream_t s = as_stream(stream);
  float* gacc = use_workspace ? data_of<float>(workspace) : data_of<float>(grad_value);
  const int64_t n_value = value.numel();
  if (!det) {
    launch_zero(gacc, n_value * 4, device_id, s, "multi_scale_deformable_attn fill (grad_value)");
  }
  if (d.groups > 0) {
    const Config cfg = choose_config(size, d.D, channels_per_thread, [&](int b) {
      const int acc_bytes = std::min(16, b / size * 4);  // float vector atomics into gacc
      return is_aligned(value, b) && is_aligned(grad_output, b) &&
             (det || reinterpret_cast<uintptr_t>(gacc) % acc_bytes == 0);
    });
    d.log2g = cfg.log2g;
    BackwardLaunch launch{
        common_args(spatial_shapes, level_start_index, sampling_locations, attention_weights, d,
                    d.groups << d.log2g, block, device_id, s),
        data_of<const void>(grad_output),
        data_of<const void>(value),
        gacc,
        data_of<void>(grad_sampling_locations),
        data_of<void>(grad_attention_weights),
        det ? data_of<void>(keys) : nullptr,
        det && is_int64(keys),
        key_space,
        meta_vectorizable(d, sampling_locations, attention_weights),
        mode >= 2,
        mode >= 3 ? static_cast<int>(mode) - 2 : 0};
    dispatch(value, cfg, launch);
  }
  if (use_workspace && n_value > 0) {
    // one float4 per thread and step
    const int grid = grid_for(n_value / 4 + kFillBlock, kFillBlock, device_id, kCastBlocksPerSM);
    dispatch_float(value, "value", [&](auto tag) {
      using T = decltype(tag);
      if constexpr (!std::is_same<T, float>::value) {
        cast_kernel<T><<<grid, kFillBlock, 0, s>>>(gacc, data_of<T>(grad_value), n_value);
        check_launch("multi_scale_deformable_attn cast_kernel");
      }
    });
  }
}

// Deterministic grad_value. sorted_keys / perm: torch.sort(keys, stable=True) of the keys the
// backward entry wrote; cell_start: int64 scratch of bs * heads * (3 * num_keys + 2 * levels) + 1
// elements (filled here). Writes every element of grad_value; no float atomics.
void multi_scale_deformable_attn_backward_value_deterministic(
    TensorView grad_output, TensorView value, TensorView spatial_shapes,
    TensorView level_start_index, TensorView sampling_locations, TensorView attention_weights,
    TensorView sorted_keys, TensorView perm, TensorView cell_start, TensorView grad_value,
    int64_t channels_per_thread, int64_t block_threads_req, int64_t stream) {
  Dims d = check_problem(value, spatial_shapes, level_start_index, sampling_locations,
                         attention_weights);
  check_grad_output(grad_output, value, d);
  check_input(grad_value, "grad_value", value, value.dtype());
  check_same_shape(grad_value, "grad_value", value, "value");
  check_index_input(sorted_keys, "sorted_keys", value);
  check_input(perm, "perm", value, kInt64);
  check_input(cell_start, "cell_start", value, kInt64);
  const int64_t n_samples = d.groups * d.LP;
  if (sorted_keys.numel() != n_samples || perm.numel() != n_samples) {
    TVM_FFI_THROW(ValueError) << "sorted_keys and perm must have " << n_samples
                              << " elements (one per sample), got " << sorted_keys.numel()
                              << " and " << perm.numel();
  }
  const int64_t n_cells = value.size(0) * d.heads * (3 * static_cast<int64_t>(d.K) + 2 * d.L);
  if (cell_start.numel() != n_cells + 1) {
    TVM_FFI_THROW(ValueError) << "cell_start must have " << n_cells + 1 << " elements, got "
                              << cell_start.numel();
  }
  const int block = block_threads(block_threads_req);
  check_channels_per_thread(channels_per_thread);
  if (value.numel() == 0) return;
  const int device_id = value.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t s = as_stream(stream);
  cell_start_kernel<<<grid_for(n_cells + 1, kFillBlock, device_id, kCellStartBlocksPerSM),
                      kFillBlock, 0, s>>>(data_of<const void>(sorted_keys), is_int64(sorted_keys),
                                          n_samples, data_of<int64_t>(cell_start), n_cells);
  check_launch("multi_scale_deformable_attn cell_start_kernel");
  const Config cfg = choose_config(element_bytes(value), d.D, channels_per_thread, [&](int b) {
    return is_aligned(grad_value, b) && is_aligned(grad_output, b);
  });
  d.log2g = cfg.log2g;
  const int64_t rows = value.size(0) * d.K * d.heads;
  GatherLaunch launch{common_args(spatial_shapes, level_start_index, sampling_locations,
                                  attention_weights, d, rows << d.log2g, block, device_id, s),
                      data_of<const void>(grad_output),
                      data_of<const int64_t>(perm),
                      data_of<const int64_t>(cell_start),
                      n_samples,
                      data_of<void>(grad_value),
                      static_cast<int>(value.size(0))};
  dispatch(value, cfg, launch);
}

}  // namespace msda
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(multi_scale_deformable_attn_forward,
                              muspace::msda::multi_scale_deformable_attn_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(multi_scale_deformable_attn_backward,
                              muspace::msda::multi_scale_deformable_attn_backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(
    multi_scale_deformable_attn_backward_value_deterministic,
    muspace::msda::multi_scale_deformable_attn_backward_value_deterministic);
