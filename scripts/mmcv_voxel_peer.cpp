// A minimal binding of mmcv's own voxelization and dynamic-scatter CUDA launchers, for
// side-by-side timing only (benchmarks/_voxel_peer.py loads it; scripts/build_mmcv_voxel_peer.sh
// builds it with mmcv's unmodified sources from .peers/mmcv/, which are never committed).
// Registered as torch ops `torch.ops.mmcv_voxel_peer.<name>`; each op exists only when its mmcv
// source compiled (PEER_HAS_<UNIT> from the build script).
//
// Each op does what mmcv's Python wrapper does around its launcher (mmcv/ops/voxelize.py,
// scatter_points.py): the same allocations (new_zeros of max_voxels rows, zeros_like for the
// gradient), the launcher, the slices. Written for this binding; mmcv's files are not changed.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

using at::Tensor;

#if PEER_HAS_VOXELIZATION
int HardVoxelizeForwardCUDAKernelLauncher(const Tensor& points, Tensor& voxels, Tensor& coors,
                                          Tensor& num_points_per_voxel,
                                          const std::vector<float> voxel_size,
                                          const std::vector<float> coors_range,
                                          const int max_points, const int max_voxels,
                                          const int NDim);
int NondeterministicHardVoxelizeForwardCUDAKernelLauncher(
    const Tensor& points, Tensor& voxels, Tensor& coors, Tensor& num_points_per_voxel,
    const std::vector<float> voxel_size, const std::vector<float> coors_range, const int max_points,
    const int max_voxels, const int NDim);
void DynamicVoxelizeForwardCUDAKernelLauncher(const Tensor& points, Tensor& coors,
                                              const std::vector<float> voxel_size,
                                              const std::vector<float> coors_range, const int NDim);
#endif
#if PEER_HAS_SCATTER_POINTS
// the same (anonymous) enum type as mmcv's kernel header, so the launchers' names link
typedef enum { SUM = 0, MEAN = 1, MAX = 2 } reduce_t;
std::vector<Tensor> DynamicPointToVoxelForwardCUDAKernelLauncher(const Tensor& feats,
                                                                 const Tensor& coors,
                                                                 const reduce_t reduce_type);
void DynamicPointToVoxelBackwardCUDAKernelLauncher(Tensor& grad_feats,
                                                   const Tensor& grad_reduced_feats,
                                                   const Tensor& feats, const Tensor& reduced_feats,
                                                   const Tensor& coors_map,
                                                   const Tensor& reduce_count,
                                                   const reduce_t reduce_type);
#endif

namespace {

std::vector<float> floats(const std::vector<double>& v) { return {v.begin(), v.end()}; }

#if PEER_HAS_VOXELIZATION
// mmcv/ops/voxelize.py, hard branch: new_zeros buffers, the launcher, the [:voxel_num] slices
std::tuple<Tensor, Tensor, Tensor> hard_voxelize(const Tensor& points,
                                                 std::vector<double> voxel_size,
                                                 std::vector<double> coors_range,
                                                 int64_t max_points, int64_t max_voxels,
                                                 bool deterministic) {
  Tensor voxels = points.new_zeros({max_voxels, max_points, points.size(1)});
  Tensor coors = points.new_zeros({max_voxels, 3}, points.options().dtype(at::kInt));
  Tensor num = points.new_zeros({max_voxels}, points.options().dtype(at::kInt));
  const int m = deterministic
                    ? HardVoxelizeForwardCUDAKernelLauncher(
                          points, voxels, coors, num, floats(voxel_size), floats(coors_range),
                          static_cast<int>(max_points), static_cast<int>(max_voxels), 3)
                    : NondeterministicHardVoxelizeForwardCUDAKernelLauncher(
                          points, voxels, coors, num, floats(voxel_size), floats(coors_range),
                          static_cast<int>(max_points), static_cast<int>(max_voxels), 3);
  return {voxels.slice(0, 0, m), coors.slice(0, 0, m), num.slice(0, 0, m)};
}

// mmcv/ops/voxelize.py, dynamic branch
Tensor dynamic_voxelize(const Tensor& points, std::vector<double> voxel_size,
                        std::vector<double> coors_range) {
  Tensor coors = points.new_zeros({points.size(0), 3}, points.options().dtype(at::kInt));
  DynamicVoxelizeForwardCUDAKernelLauncher(points, coors, floats(voxel_size), floats(coors_range),
                                           3);
  return coors;
}
#endif

#if PEER_HAS_SCATTER_POINTS
reduce_t reduce_of(int64_t r) { return r == 0 ? SUM : (r == 1 ? MEAN : MAX); }

// _ext.dynamic_point_to_voxel_forward: (voxel_feats, voxel_coors, point2voxel, counts)
std::tuple<Tensor, Tensor, Tensor, Tensor> scatter_forward(const Tensor& feats, const Tensor& coors,
                                                           int64_t reduce) {
  auto out = DynamicPointToVoxelForwardCUDAKernelLauncher(feats, coors, reduce_of(reduce));
  return {out[0], out[1], out[2], out[3]};
}

// mmcv's _DynamicScatter.backward: zeros_like(feats), then the launcher
Tensor scatter_backward(const Tensor& grad_reduced, const Tensor& feats,
                        const Tensor& reduced_feats, const Tensor& coors_map,
                        const Tensor& reduce_count, int64_t reduce) {
  Tensor grad = at::zeros_like(feats);
  DynamicPointToVoxelBackwardCUDAKernelLauncher(grad, grad_reduced.contiguous(), feats,
                                                reduced_feats, coors_map, reduce_count,
                                                reduce_of(reduce));
  return grad;
}
#endif

}  // namespace

TORCH_LIBRARY(mmcv_voxel_peer, m) {
#if PEER_HAS_VOXELIZATION
  m.def(
      "hard_voxelize(Tensor points, float[] voxel_size, float[] coors_range, int max_points, "
      "int max_voxels, bool deterministic) -> (Tensor, Tensor, Tensor)");
  m.def("dynamic_voxelize(Tensor points, float[] voxel_size, float[] coors_range) -> Tensor");
#endif
#if PEER_HAS_SCATTER_POINTS
  m.def(
      "scatter_forward(Tensor feats, Tensor coors, int reduce) -> (Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "scatter_backward(Tensor grad_reduced, Tensor feats, Tensor reduced_feats, Tensor coors_map, "
      "Tensor reduce_count, int reduce) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(mmcv_voxel_peer, CUDA, m) {
#if PEER_HAS_VOXELIZATION
  m.impl("hard_voxelize", hard_voxelize);
  m.impl("dynamic_voxelize", dynamic_voxelize);
#endif
#if PEER_HAS_SCATTER_POINTS
  m.impl("scatter_forward", scatter_forward);
  m.impl("scatter_backward", scatter_backward);
#endif
}
