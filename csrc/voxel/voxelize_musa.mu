// Voxelization (mmcv's hard and dynamic voxelization), for MUSA and CUDA. The long form of the
// design is docs/operators/voxelization.md; in short:
//
// Dynamic (voxel_dynamic_forward): one thread per point writes mmcv's coordinate row (z, y, x),
// or its -1 pattern for a dropped point (x invalid: (-1, 0, 0); y: (-1, -1, 0); z: (-1, -1, -1)),
// with the sample index first for a batched call.
//
// Hard, deterministic, no host sync: two entry points around the caller's stable sort
// (torch.sort: CUB's radix sort under CUDA, torch_musa's under MUSA; our own 3-pass radix sort
// took ~85 of the 141 us of device time at 300k points on the H200, 2026-12-01):
//   1. keys_kernel       (voxel_hard_keys) per point its key = sample * cells + ((z * gy) + y)
//                        * gx + x, or the sentinel (= samples * cells, larger than every key)
//                        when dropped
//   2. the caller's stable sort of the keys -> sorted keys and the permutation (int64): the
//                        points of a voxel are a run, in input order; runs ordered by key
//   then voxel_hard_forward:
//   3. first_flags       first[point] = 1 for the first point of each run (the voxel's first
//                        point), 0 otherwise; every entry written (the sort is a permutation)
//   4. scan(first)       -> each voxel's rank in first-occurrence order over the whole batch
//   5. samples_kernel    (one thread) per sample: its first rank, its voxels, the kept ones
//                        (min with max_voxels), their output base; the counts for the host
//   6. rows_kernel       per run start: the voxel's output row (base + rank in the sample) when
//                        kept -> row_start[row] = the run's first sorted position
//   7. emit_kernel       per (row, slot < max_points): the point at sorted position
//                        row_start + slot if it is still in the run, else zeros; slot 0 also
//                        writes the coordinates (decoded from the key) and the point count
// The outputs have `rows` rows (an upper bound); rows beyond the voxel count are left alone, or
// padded (voxels 0, coors -1, num 0) in the padded mode (voxelization_padded: CUDA-graph
// capturable). counts[0] = the voxel count, counts[1 + b] = sample b's, on the device.
//
// Safety: every data-dependent index is checked (positions against n, rows against `rows`,
// samples against the sample count); NaN / inf points are dropped; bad arguments raise naming
// them. Everything is int32 (n, cells * samples, rows); the output offsets are int64.

#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

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

using scan::exclusive_scan;
using scan::kBlock;  // threads of every kernel here
using scan::scan_tiles;
using tvm::ffi::Shape;

constexpr int kBlocksPerSm = 8;  // grid cap of the grid-stride kernels, per multiprocessor
constexpr int64_t kMaxPoints = int64_t{1} << 30;
MUSPACE_LIMIT(voxelization, max_points, kMaxPoints);
constexpr int64_t kMaxCells = INT_MAX - 1;  // samples * gx * gy * gz: keys and the sentinel
MUSPACE_LIMIT(voxelization, max_cells, kMaxCells);
constexpr int64_t kMaxPointsPerVoxel = 1 << 16;
MUSPACE_LIMIT(voxelization, max_points_per_voxel, kMaxPointsPerVoxel);
MUSPACE_LIMIT(voxelization, max_samples, kMaxSamples);

// ------------------------------------------------------------------------------------- kernels

template <typename T>
__global__ void __launch_bounds__(kBlock)
    dynamic_kernel(const T* __restrict__ points, int n, int features, Grid g, Samples s, int ncols,
                   int* __restrict__ coors) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const T* p = points + i * features;
    int c[3] = {0, 0, 0};
    int failed = 3;  // the first invalid axis (x = 0, y = 1, z = 2), 3: valid
    for (int a = 0; a < 3; ++a) {
      if (!axis_cell(coord_value(p[a]), g, a, c[a])) {
        failed = a;
        break;
      }
    }
    int* row = coors + i * ncols;
    if (ncols == 4) *row++ = sample_of(s, static_cast<int>(i));
    if (failed == 3) {
      row[0] = c[2];
      row[1] = c[1];
      row[2] = c[0];
    } else {  // mmcv writes -1 into the columns it has reached (its output starts as zeros)
      row[0] = -1;
      row[1] = failed >= 1 ? -1 : 0;
      row[2] = failed >= 2 ? -1 : 0;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    keys_kernel(const T* __restrict__ points, int n, int features, Grid g, Samples s,
                uint32_t cells, uint32_t sentinel, uint32_t* __restrict__ keys) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const T* p = points + i * features;
    int cx = 0, cy = 0, cz = 0;
    uint32_t key = sentinel;
    if (axis_cell(coord_value(p[0]), g, 0, cx) && axis_cell(coord_value(p[1]), g, 1, cy) &&
        axis_cell(coord_value(p[2]), g, 2, cz)) {
      const int64_t cell =
          (static_cast<int64_t>(cz) * g.cells[1] + cy) * g.cells[0] + static_cast<int64_t>(cx);
      const int64_t k = static_cast<int64_t>(sample_of(s, static_cast<int>(i))) * cells + cell;
      key = static_cast<uint32_t>(k);  // < sentinel <= kMaxCells: checked by the launcher
    }
    keys[i] = key;
  }
}

__device__ __forceinline__ bool run_start(const uint32_t* keys, int p, uint32_t sentinel) {
  const uint32_t k = keys[p];
  return k != sentinel && (p == 0 || keys[p - 1] != k);
}

__global__ void __launch_bounds__(kBlock)
    first_flags_kernel(const uint32_t* __restrict__ keys, const int64_t* __restrict__ idx, int n,
                       uint32_t sentinel, int* __restrict__ first) {
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    const int64_t i = idx[p];
    if (static_cast<uint64_t>(i) < static_cast<uint64_t>(n)) {
      first[i] = run_start(keys, static_cast<int>(p), sentinel) ? 1 : 0;
    }
  }
}

// One thread: per sample b its first voxel rank, voxel count, kept count and output base.
__global__ void samples_kernel(const int* __restrict__ rank, const int* __restrict__ total, int n,
                               Samples s, int max_voxels, int* __restrict__ sample_first,
                               int* __restrict__ sample_base, int64_t* __restrict__ counts) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int64_t base = 0;
  for (int b = 0; b < s.count; ++b) {
    const int lo = s.off[b] < n ? rank[s.off[b]] : *total;
    const int hi = s.off[b + 1] < n ? rank[s.off[b + 1]] : *total;
    const int kept = std::min(std::max(hi - lo, 0), max_voxels);
    sample_first[b] = lo;
    sample_base[b] = static_cast<int>(base);
    counts[1 + b] = kept;
    base += kept;
  }
  counts[0] = base;
}

__global__ void __launch_bounds__(kBlock)
    rows_kernel(const uint32_t* __restrict__ keys, const int64_t* __restrict__ idx, int n,
                uint32_t cells, uint32_t sentinel, int n_samples, const int* __restrict__ rank,
                const int* __restrict__ sample_first, const int* __restrict__ sample_base,
                int max_voxels, int rows, int* __restrict__ row_start) {
  for (int64_t p = global_thread(); p < n; p += global_threads()) {
    if (!run_start(keys, static_cast<int>(p), sentinel)) continue;
    const int64_t i = idx[p];
    const int b = static_cast<int>(keys[p] / cells);
    if (static_cast<uint64_t>(i) >= static_cast<uint64_t>(n) || b >= n_samples) continue;
    const int local = rank[i] - sample_first[b];
    if (local < 0 || local >= max_voxels) continue;  // beyond max_voxels: dropped
    const int row = sample_base[b] + local;
    if (static_cast<unsigned>(row) < static_cast<unsigned>(rows))
      row_start[row] = static_cast<int>(p);
  }
}

// W: the raw element word (uint32_t for float32, uint16_t for 16-bit dtypes).
template <typename W>
__global__ void __launch_bounds__(kBlock)
    emit_kernel(const W* __restrict__ points, int features, const uint32_t* __restrict__ keys,
                const int64_t* __restrict__ idx, int n, uint32_t cells, Grid g,
                const int* __restrict__ row_start, const int64_t* __restrict__ counts, int rows,
                int max_points, int padded, int ncols, W* __restrict__ voxels,
                int* __restrict__ coors, int* __restrict__ num) {
  const int64_t m = counts[0];
  const int64_t total = static_cast<int64_t>(rows) * max_points;
  if (max_points <= 0) return;
  RowCol rc(global_thread(), global_threads(), max_points);
  for (int64_t e = global_thread(); e < total; e += global_threads(), rc.next()) {
    const int row = static_cast<int>(rc.row);
    const int slot = rc.col;
    W* dst = voxels + e * features;
    if (row >= m) {
      if (!padded) continue;
      for (int f = 0; f < features; ++f) dst[f] = W(0);
      if (slot == 0) {
        for (int c = 0; c < ncols; ++c) coors[static_cast<int64_t>(row) * ncols + c] = -1;
        num[row] = 0;
      }
      continue;
    }
    const int start = row_start[row];
    const bool ok_start = static_cast<unsigned>(start) < static_cast<unsigned>(n);
    const uint32_t key = ok_start ? keys[start] : 0u;
    const int pos = start + slot;
    const bool member = ok_start && pos < n && keys[pos] == key;
    const int64_t i = member ? idx[pos] : -1;
    if (member && static_cast<uint64_t>(i) < static_cast<uint64_t>(n)) {
      const W* src = points + static_cast<int64_t>(i) * features;
      for (int f = 0; f < features; ++f) dst[f] = src[f];
    } else {
      for (int f = 0; f < features; ++f) dst[f] = W(0);
    }
    if (slot != 0) continue;
    int count = 0;
    while (ok_start && count < max_points && start + count < n && keys[start + count] == key) {
      ++count;
    }
    num[row] = count;
    const int b = static_cast<int>(key / cells);
    const int cell = static_cast<int>(key - static_cast<uint32_t>(b) * cells);
    const int x = cell % g.cells[0];
    const int y = (cell / g.cells[0]) % g.cells[1];
    const int z = cell / (g.cells[0] * g.cells[1]);
    int* c = coors + static_cast<int64_t>(row) * ncols;
    if (ncols == 4) *c++ = b;
    c[0] = z;
    c[1] = y;
    c[2] = x;
  }
}

// ------------------------------------------------------------------------------ host helpers

int blocks_for(int64_t n_threads, int device_id) {
  return grid_for(n_threads, kBlock, device_id, kBlocksPerSm);
}

Grid make_grid(float vx, float vy, float vz, float x0, float y0, float z0, int64_t gx, int64_t gy,
               int64_t gz) {
  const float size[3] = {vx, vy, vz};
  const float lower[3] = {x0, y0, z0};
  const int64_t cells[3] = {gx, gy, gz};
  const char* axes = "xyz";
  Grid g;
  for (int a = 0; a < 3; ++a) {
    if (!(std::isfinite(size[a]) && size[a] > 0.0f)) {
      TVM_FFI_THROW(ValueError) << "voxel_size must be positive and finite, got " << size[a]
                                << " for " << axes[a];
    }
    if (!std::isfinite(lower[a])) {
      TVM_FFI_THROW(ValueError) << "coors_range must be finite, got " << lower[a] << " for "
                                << axes[a] << "_min";
    }
    if (cells[a] < 1 || cells[a] > INT_MAX) {
      TVM_FFI_THROW(ValueError) << "the grid must have 1 to " << INT_MAX << " cells along "
                                << axes[a] << ", got " << cells[a];
    }
    g.size[a] = size[a];
    g.lower[a] = lower[a];
    g.cells[a] = static_cast<int>(cells[a]);
  }
  return g;
}

Samples make_samples(const Shape& offsets, int64_t n) {
  if (offsets.size() < 2 || offsets.size() > kMaxSamples + 1) {
    TVM_FFI_THROW(ValueError) << "sample_offsets must hold 2 to " << kMaxSamples + 1
                              << " offsets (1 to " << kMaxSamples << " samples), got "
                              << offsets.size();
  }
  Samples s;
  s.count = static_cast<int>(offsets.size()) - 1;
  for (size_t b = 0; b < offsets.size(); ++b) {
    const int64_t o = offsets[b];
    if ((b == 0 && o != 0) || (b > 0 && o < offsets[b - 1]) || o > n) {
      TVM_FFI_THROW(ValueError) << "sample_offsets must rise from 0 to the " << n << " points, got "
                                << o << " at " << b;
    }
    s.off[b] = static_cast<int>(o);
  }
  if (offsets[offsets.size() - 1] != n) {
    TVM_FFI_THROW(ValueError) << "sample_offsets must end at the " << n << " points, got "
                              << offsets[offsets.size() - 1];
  }
  return s;
}

int64_t check_points_tensor(const TensorView& points) {
  check_gpu_tensor(points, "points");
  check_float_dtype<Bf16::kBits>(points, "points");
  check_contiguous(points, "points");
  check_ndim(points, "points", 2);
  if (points.size(1) < 3) {
    TVM_FFI_THROW(ValueError) << "points must be [N, C] with C >= 3, got C = " << points.size(1);
  }
  if (points.size(0) > kMaxPoints) {
    TVM_FFI_THROW(ValueError) << "points has " << points.size(0) << " rows; at most " << kMaxPoints
                              << " are supported";
  }
  return points.size(0);
}

// The workspace of voxel_hard_forward, in int32 units (every region 16-byte aligned).
struct HardLayout {
  int64_t sums, first, total, sample_first, sample_base, row_start, ints;
};

int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

HardLayout hard_layout(int64_t n, int64_t rows) {
  HardLayout l;
  int64_t off = 0;
  auto take = [&](int64_t k) {
    const int64_t at = off;
    off += round4(std::max<int64_t>(k, 1));
    return at;
  };
  l.sums = take(scan_tiles(n) + 1);
  l.first = take(n);
  l.total = take(1);
  l.sample_first = take(kMaxSamples);
  l.sample_base = take(kMaxSamples + 1);
  l.row_start = take(rows);
  l.ints = off;
  return l;
}

// ------------------------------------------------------------------------------ entry points

int64_t hard_workspace_ints(int64_t n, int64_t n_samples, int64_t rows) {
  if (n < 0 || rows < 0 || n_samples < 1 || n_samples > kMaxSamples) {
    TVM_FFI_THROW(ValueError) << "voxel_hard_workspace_ints: n = " << n
                              << ", n_samples = " << n_samples << ", rows = " << rows
                              << " out of range";
  }
  return hard_layout(n, rows).ints;
}

void dynamic_forward(TensorView points, TensorView coors, float vx, float vy, float vz, float x0,
                     float y0, float z0, int64_t gx, int64_t gy, int64_t gz, Shape sample_offsets,
                     int64_t stream) {
  const int64_t n = check_points_tensor(points);
  check_input(coors, "coors", points, kInt32);
  check_ndim(coors, "coors", 2);
  check_size(coors, "coors", 0, n);
  const int ncols = static_cast<int>(coors.size(1));
  if (ncols != 3 && ncols != 4) {
    TVM_FFI_THROW(ValueError) << "coors must be [N, 3] (z, y, x) or [N, 4] (sample, z, y, x), "
                              << "got " << ncols << " columns";
  }
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  if (ncols == 3 && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "coors must have a sample column ([N, 4]) for " << s.count
                              << " samples";
  }
  if (n == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  dispatch_float<Bf16::kBits>(points, "points", [&](auto tag) {
    using T = decltype(tag);
    dynamic_kernel<T><<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const T>(points), static_cast<int>(n), static_cast<int>(points.size(1)), g, s,
        ncols, data_of<int>(coors));
    check_launch("voxel dynamic_kernel");
  });
}

// Cells per sample (gx * gy * gz); samples * cells (the sentinel key) must fit the int32 keys.
int64_t checked_cells(int64_t gx, int64_t gy, int64_t gz, const Samples& s) {
  // gx, gy, gz < 2^31 each (make_grid): the products are checked step by step (no overflow)
  const int64_t cells_xy = gx * gy;
  const int64_t cells = cells_xy <= kMaxCells ? cells_xy * gz : kMaxCells + 1;
  if (cells > kMaxCells || cells * s.count > kMaxCells) {
    TVM_FFI_THROW(ValueError) << s.count << " samples of " << gx << "*" << gy << "*" << gz
                              << " cells exceed the int32 keys (" << kMaxCells << " cells)";
  }
  return cells;
}

// keys [N] int32 <- each point's key (the sentinel samples * cells for a dropped point), for
// the caller's stable sort before voxel_hard_forward.
void hard_keys(TensorView points, TensorView keys, float vx, float vy, float vz, float x0, float y0,
               float z0, int64_t gx, int64_t gy, int64_t gz, Shape sample_offsets, int64_t stream) {
  const int64_t n = check_points_tensor(points);
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  const int64_t cells = checked_cells(gx, gy, gz, s);
  check_vector(keys, "keys", points, kInt32, n);
  if (n == 0) return;
  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  const uint32_t ucells = static_cast<uint32_t>(cells);
  const uint32_t sentinel = static_cast<uint32_t>(cells * s.count);
  // keys < 2^31 (kMaxCells): the same order as int32 and as uint32
  uint32_t* out = reinterpret_cast<uint32_t*>(data_of<int>(keys));
  dispatch_float<Bf16::kBits>(points, "points", [&](auto tag) {
    using T = decltype(tag);
    keys_kernel<T><<<blocks_for(n, device_id), kBlock, 0, st>>>(
        data_of<const T>(points), static_cast<int>(n), static_cast<int>(points.size(1)), g, s,
        ucells, sentinel, out);
    check_launch("voxel keys_kernel");
  });
}

// sorted_keys [N] int32 / perm [N] int64: voxel_hard_keys' keys stably sorted (position p holds
// point perm[p]; an entry outside [0, N) is skipped).
void hard_forward(TensorView points, TensorView sorted_keys, TensorView perm, TensorView workspace,
                  TensorView voxels, TensorView coors, TensorView num_points, TensorView counts,
                  float vx, float vy, float vz, float x0, float y0, float z0, int64_t gx,
                  int64_t gy, int64_t gz, int64_t max_points, int64_t max_voxels,
                  Shape sample_offsets, bool padded, int64_t stream) {
  const int64_t n = check_points_tensor(points);
  const int64_t features = points.size(1);
  const Grid g = make_grid(vx, vy, vz, x0, y0, z0, gx, gy, gz);
  const Samples s = make_samples(sample_offsets, n);
  check_vector(sorted_keys, "sorted_keys", points, kInt32, n);
  check_vector(perm, "perm", points, kInt64, n);
  if (max_points < 0 || max_points > kMaxPointsPerVoxel) {
    TVM_FFI_THROW(ValueError) << "max_points must be in [0, " << kMaxPointsPerVoxel << "], got "
                              << max_points;
  }
  if (max_voxels < 0 || max_voxels > INT_MAX) {
    TVM_FFI_THROW(ValueError) << "max_voxels must be in [0, " << INT_MAX << "], got " << max_voxels;
  }
  if (padded && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "the padded mode takes one sample, got " << s.count;
  }
  const int64_t cells = checked_cells(gx, gy, gz, s);
  check_like(voxels, "voxels", points, "points");
  check_ndim(voxels, "voxels", 3);
  const int64_t rows = voxels.size(0);
  check_size(voxels, "voxels", 1, max_points);
  check_size(voxels, "voxels", 2, features);
  if (rows > INT_MAX)
    TVM_FFI_THROW(ValueError) << "voxels has " << rows << " rows; at most " << INT_MAX;
  check_input(coors, "coors", points, kInt32);
  check_ndim(coors, "coors", 2);
  check_size(coors, "coors", 0, rows);
  const int ncols = static_cast<int>(coors.size(1));
  if (ncols != 3 && ncols != 4) {
    TVM_FFI_THROW(ValueError) << "coors must be [rows, 3] (z, y, x) or [rows, 4] (sample, z, y, "
                              << "x), got " << ncols << " columns";
  }
  if (ncols == 3 && s.count != 1) {
    TVM_FFI_THROW(ValueError) << "coors must have a sample column ([rows, 4]) for " << s.count
                              << " samples";
  }
  int64_t needed = 0;  // rows the kept voxels can fill: sum over samples of min(points, V)
  for (int b = 0; b < s.count; ++b)
    needed += std::min<int64_t>(s.off[b + 1] - s.off[b], max_voxels);
  if (rows < needed) {
    TVM_FFI_THROW(ValueError) << "voxels must have at least " << needed << " rows (min(points, "
                              << "max_voxels) per sample), got " << rows;
  }
  check_vector(num_points, "num_points", points, kInt32, rows);
  check_vector(counts, "counts", points, kInt64, s.count + 1);
  const HardLayout l = hard_layout(n, rows);
  check_input(workspace, "workspace", points, kInt32);
  check_ndim(workspace, "workspace", 1);
  if (workspace.size(0) < l.ints) {
    TVM_FFI_THROW(ValueError) << "workspace must hold " << l.ints << " int32 (from "
                              << "voxel_hard_workspace_ints), got " << workspace.size(0);
  }
  check_aligned(workspace, "workspace", 16);

  const int device_id = points.device().device_id;
  DeviceGuard guard(device_id);
  const gpuStream_t st = as_stream(stream);
  int* ws = data_of<int>(workspace);
  int64_t* counts_p = data_of<int64_t>(counts);
  const uint32_t ucells = static_cast<uint32_t>(cells);
  const uint32_t sentinel = static_cast<uint32_t>(cells * s.count);
  const int ni = static_cast<int>(n);
  const int rows_i = static_cast<int>(rows);
  const int P = static_cast<int>(max_points);
  const int V = static_cast<int>(max_voxels);
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(data_of<const int>(sorted_keys));
  const int64_t* idx = data_of<const int64_t>(perm);
  if (n == 0) {
    launch_zero(counts_p, (s.count + 1) * 8, device_id, st, "voxel fill (counts)");
  } else {
    int* first = ws + l.first;
    first_flags_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(keys, idx, ni, sentinel, first);
    check_launch("voxel first_flags_kernel");
    exclusive_scan(first, first, n, ws + l.sums, ws + l.total, st, "voxel first scan");
    samples_kernel<<<1, 1, 0, st>>>(first, ws + l.total, ni, s, V, ws + l.sample_first,
                                    ws + l.sample_base, counts_p);
    check_launch("voxel samples_kernel");
    rows_kernel<<<blocks_for(n, device_id), kBlock, 0, st>>>(
        keys, idx, ni, ucells, sentinel, s.count, first, ws + l.sample_first, ws + l.sample_base, V,
        rows_i, ws + l.row_start);
    check_launch("voxel rows_kernel");
  }
  if (rows == 0 || max_points == 0 || (n == 0 && !padded)) return;
  const int64_t slots = rows * max_points;
  const int elem = element_bytes(points);
  auto emit = [&](auto word_tag) {
    using W = decltype(word_tag);
    emit_kernel<W><<<blocks_for(slots, device_id), kBlock, 0, st>>>(
        data_of<const W>(points), static_cast<int>(features), keys, idx, ni, ucells, g,
        ws + l.row_start, counts_p, rows_i, P, padded ? 1 : 0, ncols, data_of<W>(voxels),
        data_of<int>(coors), data_of<int>(num_points));
    check_launch("voxel emit_kernel");
  };
  if (elem == 4) {
    emit(uint32_t{});
  } else {
    emit(uint16_t{});
  }
}

}  // namespace
}  // namespace voxel
}  // namespace muspace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_dynamic_forward, muspace::voxel::dynamic_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_keys, muspace::voxel::hard_keys);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_forward, muspace::voxel::hard_forward);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(voxel_hard_workspace_ints, muspace::voxel::hard_workspace_ints);
