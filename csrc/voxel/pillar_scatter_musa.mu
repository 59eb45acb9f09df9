// pillar_scatter (mmdet3d's PointPillarsScatter) for MUSA and CUDA: pillar features [M, C] and
// coors [M, 4] (batch, z, y, x) -> the dense canvas [B, C, ny, nx]; and its backward.
//
// Forward: (1) per pillar inside the canvas, an unsigned atomicMax of tag << 24 | pillar into
// the caller's cell map [B * ny * nx]: the last (highest) pillar of a cell wins, a fixed rule
// (upstream's index_put leaves it unspecified), and an entry of an older tag reads as an empty
// cell, so a map kept between calls with a new tag each call needs no fill (map_tag 0: any map,
// zeroed here first); (2) a thread per cell writes the cell's C channels (consecutive threads ->
// consecutive cells: every store coalesced; the canvas write is the compulsory traffic that
// dominates), copying raw element bits. Backward: the same map, then a thread per (pillar,
// channel): the cell's gradient for the winner of its cell, 0 otherwise. No host
// synchronisation, CUDA-graph capturable.

#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "build_facts.muh"
#include "checks.muh"
#include "dispatch.muh"
#include "gpu_compat.muh"
#include "launch.muh"
#include "scan.muh"
#include "voxel_grid.muh"

namespace muspace {
namespace voxel {
namespace {

using scan::kBlock;  // 256 threads, the voxel family's block
constexpr int kBlocksPerSm = 8;
// A cell map entry is tag << kTagShift | pillar: pillars below 2^24, tags 1 .. kMaxMapTag.
constexpr int kTagShift = 24;
constexpr int64_t kMaxPillars = (int64_t{1} << kTagShift) - 1;
constexpr int64_t kMaxMapTag = 255;
MUSPACE_LIMIT(pillar_scatter, max_pillars, kMaxPillars);
MUSPACE_LIMIT(pillar_scatter, max_map_tag, kMaxMapTag);

// Reads the cell map of one call: its entries are tag_bits | pillar; an entry of any other tag
// (an older call's, or the zeroed map's 0) leaves a bit of tag_bits' byte set after the XOR and
// so reads as no pillar, as does a pillar index not below m (never an out-of-bounds row).
struct CellMap {
  unsigned tag_bits;  // tag << kTagShift
  int m;
  __device__ __forceinline__ int row(int entry) const {
    const unsigned u = static_cast<unsigned>(entry) ^ tag_bits;
    return u < static_cast<unsigned>(m) ? static_cast<int>(u) : -1;
  }
};

// The canvas cell of pillar i, or -1 outside the canvas (batch, y or x out of range).
template <typename I>
__device__ __forceinline__ int64_t pillar_cell(const I* coors, int64_t i, int batch, int ny,
                                               int nx) {
  const I* r = coors + i * 4;
  const I b = r[0], y = r[2], x = r[3];
  if (b < 0 || b >= batch || y < 0 || y >= ny || x < 0 || x >= nx) return -1;
  return (static_cast<int64_t>(b) * ny + y) * nx + x;
}

template <typename I>
__global__ void __launch_bounds__(kBlock)
    pillar_map_kernel(const I* __restrict__ coors, int m, int batch, int ny, int nx,
                      unsigned tag_bits, int* __restrict__ cell_map) {
  for (int64_t i = global_thread(); i < m; i += global_threads()) {
    const int64_t cell = pillar_cell(coors, i, batch, ny, nx);
    if (cell >= 0) {
      atomicMax(reinterpret_cast<unsigned*>(&cell_map[cell]), tag_bits | static_cast<unsigned>(i));
    }
  }
}

// The K = 16 / sizeof(W) elements of K neighbouring cells as one 16-byte store (the element at
// the lower address in the low bits).
template <typename W>
struct Vector16 {
  static constexpr int kCells = 16 / sizeof(W);
};

__device__ __forceinline__ uint4 pack16(const uint32_t (&v)[4]) {
  return make_uint4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ uint4 pack16(const uint16_t (&v)[8]) {
  auto pair = [&](int i) {
    return static_cast<uint32_t>(v[i]) | (static_cast<uint32_t>(v[i + 1]) << 16);
  };
  return make_uint4(pair(0), pair(2), pair(4), pair(6));
}

// Channels per canvas thread. 4 (one sub-chunk) against 8 / 16 / 64, with the kept cell map
// (H100, 2026-12-05, whole call, cold L2, % of copy bandwidth, KITTI / nuScenes, float32 /
// float16): 69.4 / 62.8 / 49.0 / 44.7 % against 62.9-63.0 / 59.8-60.6 / 44.9-47.0 / 38.7-40.0 %
// at 8 and less at 16 and 64: twice the threads of 8 outweigh the map read once per chunk.
constexpr int kChannelChunk = 4;
constexpr int kSubChunk = 4;

// Channels [s0, s0 + kSubChunk) of K neighbouring cells (row[k]: the cell's pillar, -1 for
// none: zeros) as kSubChunk 16-byte stores, one per channel plane from dst on: each pillar's
// kSubChunk channels are one 16-byte (float32) / 8-byte (16-bit) load, transposed in registers
// (16-bit: two cells per 32-bit word, the lower cell in the low half). Needs channels %
// kSubChunk == 0 and feats aligned to kSubChunk elements.
template <typename W, int K>
__device__ __forceinline__ void store_sub_chunk(const W* __restrict__ feats, int channels,
                                                const int (&row)[K], int s0, W* dst,
                                                int64_t plane) {
  constexpr int kWords = kSubChunk * static_cast<int>(sizeof(W)) / 4;  // 4 or 2
  uint32_t w[K][kWords];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const W* src = feats + static_cast<int64_t>(row[k] >= 0 ? row[k] : 0) * channels + s0;
    if constexpr (kWords == 4) {
      const uint4 a = row[k] >= 0 ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
      w[k][0] = a.x;
      w[k][1] = a.y;
      w[k][2] = a.z;
      w[k][3] = a.w;
    } else {
      const uint2 a = row[k] >= 0 ? *reinterpret_cast<const uint2*>(src) : make_uint2(0, 0);
      w[k][0] = a.x;
      w[k][1] = a.y;
    }
  }
#pragma unroll
  for (int j = 0; j < kSubChunk; ++j, dst += plane) {
    uint32_t o[4];
#pragma unroll
    for (int q4 = 0; q4 < 4; ++q4) {
      if constexpr (sizeof(W) == 4) {
        o[q4] = w[q4][j];
      } else {
        const uint32_t lo = w[2 * q4][j / 2], hi = w[2 * q4 + 1][j / 2];
        o[q4] = j % 2 == 0 ? (lo & 0xffffu) | (hi << 16) : (lo >> 16) | (hi & 0xffff0000u);
      }
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Channel c of K neighbouring cells as one 16-byte store (one load per occupied cell).
template <typename W, int K>
__device__ __forceinline__ void store_channel(const W* __restrict__ feats, int channels,
                                              const int (&row)[K], int c, W* dst) {
  W v[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    v[k] = row[k] >= 0 ? feats[static_cast<int64_t>(row[k]) * channels + c] : W(0);
  }
  *reinterpret_cast<uint4*>(dst) = pack16(v);
}

// A thread per (K cells of one plane row, kChannelChunk channels): blockIdx.z / y walk the
// samples / channel chunks, x the cell groups, so consecutive threads write consecutive 16-byte
// pieces of one channel plane. Splitting the channels across threads gives ~C / kChannelChunk
// times the threads of a thread-per-cell loop over all C channels: the KITTI canvas (214k cells,
// C = 64) then fills the GPU instead of ~3 blocks per multiprocessor. The launcher checks
// plane % K == 0 and the canvas and the cell map 16-byte aligned.
// The K cells' map entries are K / 4 vector loads, once per chunk (the map reads are L2 traffic
// beside the canvas writes, and the kernel is bound by L2 throughput: ncu, H200, 2026-12-01,
// 70-74 %); a group with no pillar (~95% of KITTI's cells, ~80% of nuScenes') stores zeros
// without a feature load. With kVectorRows (C % kSubChunk == 0, rows aligned) a pillar's
// channels are read kSubChunk at a time as one 16-byte (float32) / 8-byte (16-bit) load per cell
// and transposed in registers; 8 channels at once held 32 words per thread (60 registers for
// float32, a spill for 16-bit: ptxas, sm_90a).

template <typename W, bool kVectorRows>
__global__ void __launch_bounds__(kBlock)
    canvas_vector_kernel(const W* __restrict__ feats, CellMap map, int channels, int channel_chunk,
                         const int* __restrict__ cell_map, int batch, int64_t plane,
                         W* __restrict__ canvas) {
  constexpr int K = Vector16<W>::kCells;
  static_assert(K % 4 == 0, "the map entries of a group are whole int4 loads");
  static_assert(kChannelChunk % kSubChunk == 0, "whole sub-chunks");
  const int64_t groups = plane / K;
  const int chunks = (channels + channel_chunk - 1) / channel_chunk;
  for (int b = blockIdx.z; b < batch; b += gridDim.z) {
    for (int chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
      const int c0 = chunk * channel_chunk;
      const int c1 = ::min(channels, c0 + channel_chunk);
      for (int64_t q = global_thread(); q < groups; q += global_threads()) {
        const int64_t cell = static_cast<int64_t>(b) * plane + q * K;
        int row[K];  // the pillar of each cell, or -1
        bool any = false;
#pragma unroll
        for (int k4 = 0; k4 < K; k4 += 4) {
          const int4 p = *reinterpret_cast<const int4*>(cell_map + cell + k4);
          const int pk[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            row[k4 + k] = map.row(pk[k]);
            any |= row[k4 + k] >= 0;
          }
        }
        W* dst = canvas + (static_cast<int64_t>(b) * channels + c0) * plane + q * K;
        if (!any) {
          for (int c = c0; c < c1; ++c, dst += plane) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
          }
          continue;
        }
        if constexpr (kVectorRows) {
          for (int s0 = c0; s0 < c1; s0 += kSubChunk, dst += kSubChunk * plane) {
            store_sub_chunk<W, K>(feats, channels, row, s0, dst, plane);
          }
        } else {
          for (int c = c0; c < c1; ++c, dst += plane)
            store_channel<W, K>(feats, channels, row, c, dst);
        }
      }
    }
  }
}

// Any plane or alignment: a thread per cell, all channels.
template <typename W>
__global__ void __launch_bounds__(kBlock)
    canvas_kernel(const W* __restrict__ feats, CellMap map, int channels,
                  const int* __restrict__ cell_map, int batch, int64_t plane,
                  W* __restrict__ canvas) {
  const int64_t cells = static_cast<int64_t>(batch) * plane;
  RowCol rc(global_thread(), global_threads(), static_cast<int>(plane));  // (b, yx)
  for (int64_t cell = global_thread(); cell < cells; cell += global_threads(), rc.next()) {
    W* dst = canvas + rc.row * channels * plane + rc.col;
    const int p = map.row(cell_map[cell]);
    const bool has = p >= 0;
    const W* src = feats + static_cast<int64_t>(has ? p : 0) * channels;
    for (int c = 0; c < channels; ++c) dst[c * plane] = has ? src[c] : W(0);
  }
}

template <typename W, typename I>
__global__ void __launch_bounds__(kBlock)
    pillar_grad_kernel(const W* __restrict__ grad_canvas, const I* __restrict__ coors, CellMap map,
                       int channels, const int* __restrict__ cell_map, int batch, int ny, int nx,
                       W* __restrict__ grad) {
  const int m = map.m;
  const int64_t plane = static_cast<int64_t>(ny) * nx;
  const int64_t total = static_cast<int64_t>(m) * channels;
  if (channels <= 0) return;
  RowCol rc(global_thread(), global_threads(), channels);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int64_t i = rc.row;
    const int c = rc.col;
    const int64_t cell = pillar_cell(coors, i, batch, ny, nx);
    W g = W(0);
    if (cell >= 0 && map.row(cell_map[cell]) == static_cast<int>(i)) {
      const int64_t b = cell / plane;
      g = grad_canvas[(b * channels + c) * plane + (cell - b * plane)];
    }
    grad[e] = g;
  }
}

// ------------------------------------------------------------- tiled forward (one launch)
//
// pillar_scatter_forward_tiled: the canvas without a cell map in global memory. A block owns a
// tile of tile_cells neighbouring cells of one sample's plane: (1) its shared map of the tile's
// cells is set to -1; (2) the block reads every pillar's (batch, y, x) (kTileUnroll rows a
// thread in flight) and takes atomicMax(shared map[cell], pillar) for the pillars inside its
// tile (the highest pillar of a cell wins, as in the map path); (3) it writes the tile's C
// channel planes: a thread per (K cells, kSubChunk channels) (or per channel), consecutive
// threads on consecutive 16-byte pieces of a plane, zeros without a load for an empty group.
// One launch instead of three (the map fill and the pillar map were ~5 us of kernels and
// launch gaps beside a ~12-19 us canvas kernel, H200, 2026-12-01), at the price of every block
// reading all M pillar rows (from L2 after the first): the host takes it while M * tiles stays
// within kMaxPillarVisits, else the map path.
constexpr int kTileThreads = 1024;
constexpr int kMaxTileCells = 4096;  // the shared map: 16 KB
constexpr int kTileUnroll = 4;
constexpr int64_t kMaxPillarVisits = int64_t{1} << 24;

template <typename W, typename I, bool kVectorRows>
__global__ void __launch_bounds__(kTileThreads, 1)
    canvas_tile_kernel(const W* __restrict__ feats, const I* __restrict__ coors, int m,
                       int channels, int batch, int ny, int nx, int tile_cells, int tiles_per_image,
                       W* __restrict__ canvas) {
  constexpr int K = Vector16<W>::kCells;
  constexpr int kSub = kVectorRows ? kSubChunk : 1;
  __shared__ int tile_map[kMaxTileCells];
  const int64_t plane = static_cast<int64_t>(ny) * nx;
  const int tiles = batch * tiles_per_image;  // host: <= INT_MAX
  const int stride = static_cast<int>(blockDim.x);
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int b = t / tiles_per_image;
    const int64_t t0 = static_cast<int64_t>(t - b * tiles_per_image) * tile_cells;
    const int len = static_cast<int>(::min(static_cast<int64_t>(tile_cells), plane - t0));
    for (int i = threadIdx.x; i < len; i += stride) tile_map[i] = -1;
    __syncthreads();
    for (int base = threadIdx.x; base < m; base += kTileUnroll * stride) {
      I rb[kTileUnroll], ry[kTileUnroll], rx[kTileUnroll];
#pragma unroll
      for (int u = 0; u < kTileUnroll; ++u) {  // the loads first: kTileUnroll rows in flight
        const int i = base + u * stride;
        const I* r = coors + static_cast<int64_t>(i < m ? i : 0) * 4;
        rb[u] = i < m ? r[0] : I(-1);
        ry[u] = r[2];
        rx[u] = r[3];
      }
#pragma unroll
      for (int u = 0; u < kTileUnroll; ++u) {
        if (rb[u] != b || ry[u] < 0 || ry[u] >= ny || rx[u] < 0 || rx[u] >= nx) continue;
        const int64_t at = static_cast<int64_t>(ry[u]) * nx + rx[u] - t0;
        if (at >= 0 && at < len) atomicMax(&tile_map[at], base + u * stride);
      }
    }
    __syncthreads();
    const int groups = len / K;  // plane % K == 0 and tile_cells % K == 0: whole groups
    const int chunks = channels / kSub;
    const int items = groups * chunks;  // <= kMaxTileCells / K * channels: the host checks int
    W* tile_base = canvas + static_cast<int64_t>(b) * channels * plane + t0;
    for (int it = threadIdx.x; it < items; it += stride) {
      const int chunk = it / groups;
      const int q = it - chunk * groups;
      int row[K];
      bool any = false;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int p = tile_map[q * K + k];
        row[k] = static_cast<unsigned>(p) < static_cast<unsigned>(m) ? p : -1;
        any |= row[k] >= 0;
      }
      W* dst = tile_base + static_cast<int64_t>(chunk) * kSub * plane + q * K;
      if (!any) {
#pragma unroll
        for (int j = 0; j < kSub; ++j) {
          *reinterpret_cast<uint4*>(dst + j * plane) = make_uint4(0, 0, 0, 0);
        }
      } else if constexpr (kVectorRows) {
        store_sub_chunk<W, K>(feats, channels, row, chunk * kSub, dst, plane);
      } else {
        store_channel<W, K>(feats, channels, row, chunk, dst);
      }
    }
    __syncthreads();  // the next tile's map reuses the shared memory
  }
}

int blocks_for(int64_t n_threads, int device_id) {
  return grid_for(n_threads, kBlock, device_id, kBlocksPerSm);
}

struct Canvas {
  int64_t m, channels;
  int batch, ny, nx;
};

// feats-like [M, C] float (16 / 32 bit), coors [M, 4] int32 / int64, the canvas-like [B, C, ny,
// nx] of feats' dtype -> (M, C) (the arguments of both forwards and of the backward).
struct Pillars {
  int64_t m, channels;
};

Pillars check_pillars(const TensorView& feats, const char* feats_name, const TensorView& coors,
                      const TensorView& canvas, const char* canvas_name) {
  check_gpu_tensor(feats, feats_name);
  check_float_dtype<Bf16::kBits>(feats, feats_name);
  check_contiguous(feats, feats_name);
  check_ndim(feats, feats_name, 2);
  Pillars p;
  p.m = feats.size(0);
  p.channels = feats.size(1);
  if (p.m > kMaxPillars) {
    TVM_FFI_THROW(ValueError) << feats_name << " has " << p.m << " rows; at most " << kMaxPillars;
  }
  check_index_input(coors, "coors", feats);
  check_ndim(coors, "coors", 2);
  check_size(coors, "coors", 0, p.m);
  check_size(coors, "coors", 1, 4);
  check_like(canvas, canvas_name, feats, feats_name);
  check_ndim(canvas, canvas_name, 4);
  check_size(canvas, canvas_name, 1, p.channels);
  return p;
}

// check_pillars, and the cell map [B * ny * nx] int32.
Canvas check_canvas(const TensorView& feats, const char* feats_name, const TensorView& coors,
                    const TensorView& canvas, const char* canvas_name, const TensorView& cell_map) {
  const Pillars p = check_pillars(feats, feats_name, coors, canvas, canvas_name);
  Canvas k;
  k.m = p.m;
  k.channels = p.channels;
  const int64_t cells = canvas.size(0) * canvas.size(2) * canvas.size(3);
  if (cells > INT_MAX) {
    TVM_FFI_THROW(ValueError) << canvas_name << ": B*ny*nx = " << cells
                              << " cells exceed the int32 cell map";
  }
  k.batch = static_cast<int>(canvas.size(0));
  k.ny = static_cast<int>(canvas.size(2));
  k.nx = static_cast<int>(canvas.size(3));
  check_vector(cell_map, "cell_map", feats, kInt32, cells);
  return k;
}

void check_map_tag(int64_t map_tag) {
  if (map_tag < 0 || map_tag > kMaxMapTag) {
    TVM_FFI_THROW(ValueError) << "map_tag must be 0 .. " << kMaxMapTag << ", got " << map_tag;
  }
}

// The pillar map of one call (pillar_map_kernel with map_tag's bits) -> the CellMap that reads
// it. map_tag 1 .. kMaxMapTag: cell_map holds no entry of that tag or above (the caller keeps
// the map between calls and raises the tag each call, zeroing the map when it wraps); map_tag
// 0: any content, zeroed here first, then tag 1.
CellMap map_pillars(const TensorView& coors, const Canvas& k, TensorView cell_map, int64_t map_tag,
                    int device_id, gpuStream_t st) {
  if (map_tag == 0) {
    launch_zero(data_of(cell_map), cell_map.numel() * 4, device_id, st,
                "pillar_scatter zero (cell map)");
    map_tag = 1;
  }
  const CellMap map{static_cast<unsigned>(map_tag) << kTagShift, static_cast<int>(k.m)};
  if (k.m == 0) return map;
  dispatch_index(coors, "coors", [&](auto tag) {
    using I = decltype(tag);
    pillar_map_kernel<I><<<blocks_for(k.m, device_id), kBlock, 0, st>>>(
        data_of<const I>(coors), static_cast<int>(k.m), k.batch, k.ny, k.nx, map.tag_bits,
        data_of<int>(cell_map));
    check_launch("pillar_map_kernel");
  });
  return map;
}

// The canvas kernel's channels per thread (a multiple of kSubChunk; each chunk re-reads the
// map): kChannelChunk, or MUSPACE_PILLAR_CHANNEL_CHUNK for tuning runs (read once per process).
int channel_chunk() {
  static const int chunk = [] {
    const char* v = std::getenv("MUSPACE_PILLAR_CHANNEL_CHUNK");
    const int want = v == nullptr ? kChannelChunk : std::atoi(v);
    return std::max(kSubChunk, want / kSubChunk * kSubChunk);
  }();
  return chunk;
}

// The canvas kernel's vector feature loads (kVectorRows); MUSPACE_PILLAR_VECTOR_ROWS=0 turns
// them off (one load per channel, as before them): profiling only, read once per process.
bool vector_rows_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("MUSPACE_PILLAR_VECTOR_ROWS");
    return v == nullptr || std::atoi(v) != 0;
  }();
  return on;
}

void forward(TensorView feats, TensorView coors, TensorView cell_map, int64_t map_tag,
             TensorView canvas, int64_t stream) {
  const Canvas k = check_canvas(feats, "voxel_features", coors, canvas, "canvas", cell_map);
  check_map_tag(map_tag);
  if (canvas.numel() == 0) return;
  const int device_id = feats.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const CellMap map = map_pillars(coors, k, cell_map, map_tag, device_id, st);
  const int64_t plane = static_cast<int64_t>(k.ny) * k.nx;
  const int elem = element_bytes(feats);
  auto launch = [&](auto word_tag) {
    using W = decltype(word_tag);
    constexpr int K = Vector16<W>::kCells;
    if (plane % K == 0 && is_aligned(canvas, 16) && is_aligned(cell_map, 16)) {
      const int chunk = channel_chunk();
      const int chunks = static_cast<int>((k.channels + chunk - 1) / chunk);
      const dim3 grid(blocks_for(plane / K, device_id), std::min(chunks, 65535),
                      std::min(k.batch, 65535));
      auto vector = [&](auto rows_tag) {
        canvas_vector_kernel<W, decltype(rows_tag)::value><<<grid, kBlock, 0, st>>>(
            data_of<const W>(feats), map, static_cast<int>(k.channels), chunk,
            data_of<const int>(cell_map), k.batch, plane, data_of<W>(canvas));
      };
      if (vector_rows_enabled() && k.channels % kSubChunk == 0 &&
          is_aligned(feats, kSubChunk * sizeof(W))) {
        vector(std::true_type{});
      } else {
        vector(std::false_type{});
      }
    } else {
      canvas_kernel<W><<<blocks_for(k.batch * plane, device_id), kBlock, 0, st>>>(
          data_of<const W>(feats), map, static_cast<int>(k.channels), data_of<const int>(cell_map),
          k.batch, plane, data_of<W>(canvas));
    }
    check_launch("pillar canvas_kernel");
  };
  if (elem == 4) {
    launch(uint32_t{});
  } else {
    launch(uint16_t{});
  }
}

// The tiled forward's plan: cells per tile (whole warps of K-cell groups, at most
// kMaxTileCells, about one tile per multiprocessor: a block of kTileThreads is resident alone,
// and a second tile would repeat the pillar pass) and tiles per sample plane; 0 cells when
// the tiled forward does not apply (a plane not a multiple of K, or M * tiles beyond
// kMaxPillarVisits: every block reads all M rows).
struct TilePlan {
  int tile_cells = 0, tiles_per_image = 0;
};

TilePlan tile_plan(int64_t m, int batch, int64_t plane, int cells_per_vector, int device_id) {
  TilePlan p;
  const int64_t K = cells_per_vector;
  if (plane <= 0 || batch <= 0 || plane % K != 0) return p;
  const int64_t granule = K * 32;
  const int64_t sms = multiprocessor_count(device_id);
  const int64_t want = (batch * plane + sms - 1) / sms;
  const int64_t cells = std::min<int64_t>(
      std::max<int64_t>((want + granule - 1) / granule * granule, granule), kMaxTileCells);
  const int64_t per_image = (plane + cells - 1) / cells;
  if (per_image * batch > INT_MAX || (m + 1) * per_image * batch > kMaxPillarVisits) return p;
  p.tile_cells = static_cast<int>(cells);
  p.tiles_per_image = static_cast<int>(per_image);
  return p;
}

// The forward in one launch (canvas_tile_kernel) where it applies; false without a launch
// otherwise (the plan above, a canvas not 16-byte aligned): the caller then runs
// pillar_scatter_forward with a cell map. pillar_scatter_forward's arguments and checks, less
// the cell map.
bool forward_tiled(TensorView feats, TensorView coors, TensorView canvas, int64_t stream) {
  const Pillars p = check_pillars(feats, "voxel_features", coors, canvas, "canvas");
  const int64_t m = p.m, channels = p.channels;  // (lambdas below: no structured bindings)
  if (canvas.numel() == 0) return true;
  const int64_t plane = canvas.size(2) * canvas.size(3);
  if (canvas.size(0) > INT_MAX || canvas.size(2) > INT_MAX || canvas.size(3) > INT_MAX ||
      canvas.size(0) * plane > INT_MAX || channels > INT_MAX / kMaxTileCells ||
      !is_aligned(canvas, 16)) {
    return false;
  }
  const int batch = static_cast<int>(canvas.size(0));
  const int ny = static_cast<int>(canvas.size(2));
  const int nx = static_cast<int>(canvas.size(3));
  const int elem = element_bytes(feats);
  const int device_id = feats.device().device_id;
  DeviceGuard guard(device_id);
  const TilePlan plan = tile_plan(m, batch, plane, 16 / elem, device_id);
  if (plan.tile_cells == 0) return false;
  const gpuStream_t st = as_stream(stream);
  const int tiles = batch * plan.tiles_per_image;
  const int grid = std::min<int>(tiles, multiprocessor_count(device_id));
  dispatch_index(coors, "coors", [&](auto itag) {
    using I = decltype(itag);
    auto launch = [&](auto word_tag) {
      using W = decltype(word_tag);
      auto run = [&](auto rows_tag) {
        canvas_tile_kernel<W, I, decltype(rows_tag)::value><<<grid, kTileThreads, 0, st>>>(
            data_of<const W>(feats), data_of<const I>(coors), static_cast<int>(m),
            static_cast<int>(channels), batch, ny, nx, plan.tile_cells, plan.tiles_per_image,
            data_of<W>(canvas));
      };
      if (vector_rows_enabled() && channels % kSubChunk == 0 &&
          is_aligned(feats, kSubChunk * sizeof(W))) {
        run(std::true_type{});
      } else {
        run(std::false_type{});
      }
      check_launch("pillar canvas_tile_kernel");
    };
    if (elem == 4) {
      launch(uint32_t{});
    } else {
      launch(uint16_t{});
    }
  });
  return true;
}

void backward(TensorView grad_canvas, TensorView coors, TensorView cell_map, int64_t map_tag,
              TensorView grad, int64_t stream) {
  const Canvas k = check_canvas(grad, "grad", coors, grad_canvas, "grad_canvas", cell_map);
  check_map_tag(map_tag);
  if (grad.numel() == 0) return;
  const int device_id = grad.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const CellMap map = map_pillars(coors, k, cell_map, map_tag, device_id, st);
  dispatch_index(coors, "coors", [&](auto itag) {
    using I = decltype(itag);
    auto launch = [&](auto word_tag) {
      using W = decltype(word_tag);
      pillar_grad_kernel<W, I><<<blocks_for(k.m * k.channels, device_id), kBlock, 0, st>>>(
          data_of<const W>(grad_canvas), data_of<const I>(coors), map, static_cast<int>(k.channels),
          data_of<const int>(cell_map), k.batch, k.ny, k.nx, data_of<W>(grad));
      check_launch("pillar_grad_kernel");
    };
    if (element_bytes(grad) == 4) {
      launch(uint32_t{});
    } else {
      launch(uint16_t{});
    }
  });
}

}  // namespace
}  // namespace voxel
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(pillar_scatter_forward, muspace::voxel::forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pillar_scatter_backward, muspace::voxel::backward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(pillar_scatter_forward_tiled, muspace::voxel::forward_tiled);
