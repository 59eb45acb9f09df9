// A minimal binding of mmcv's own 3D box CUDA launchers, for side-by-side timing only
// (benchmarks/_box3d_peer.py loads it; scripts/build_mmcv_box3d_peer.sh builds it together with
// mmcv's unmodified sources from .peers/mmcv/, never committed). Registered as torch ops
// `torch.ops.mmcv_box3d_peer.<name>`; each op is only registered when its mmcv source compiled
// (PEER_HAS_<FILE> macros from the build script).
//
// The host-side parts mmcv keeps in its own C++ (the NMS mask copied to the host and walked
// there) are restated here: same data flow (device mask -> host copy -> sequential walk over
// 64-bit words), written for this binding.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

using at::Tensor;

#if PEER_HAS_POINTS_IN_BOXES
void PointsInBoxesPartForwardCUDAKernelLauncher(int batch_size, int boxes_num, int pts_num,
                                                const Tensor boxes, const Tensor pts,
                                                Tensor box_idx_of_points);
void PointsInBoxesAllForwardCUDAKernelLauncher(int batch_size, int boxes_num, int pts_num,
                                               const Tensor boxes, const Tensor pts,
                                               Tensor box_idx_of_points);
#endif
#if PEER_HAS_IOU3D
void IoU3DBoxesOverlapBevForwardCUDAKernelLauncher(const int num_a, const Tensor boxes_a,
                                                   const int num_b, const Tensor boxes_b,
                                                   Tensor ans_overlap);
#if PEER_IOU3D_KEEP_API  // mmcv 2.x: the launcher gathers the kept boxes on the device
void IoU3DNMS3DForwardCUDAKernelLauncher(const Tensor boxes, Tensor& keep, Tensor& keep_num,
                                         float nms_overlap_thresh);
void IoU3DNMS3DNormalForwardCUDAKernelLauncher(const Tensor boxes, Tensor& keep,
                                               Tensor& keep_num, float nms_overlap_thresh);
#else
void IoU3DNMS3DForwardCUDAKernelLauncher(const Tensor boxes, unsigned long long* mask,
                                         int boxes_num, float nms_overlap_thresh);
void IoU3DNMS3DNormalForwardCUDAKernelLauncher(const Tensor boxes, unsigned long long* mask,
                                               int boxes_num, float nms_overlap_thresh);
#endif
#endif
#if PEER_HAS_BOX_IOU_ROTATED
void box_iou_rotated_cuda(const Tensor boxes1, const Tensor boxes2, Tensor ious,
                          const int mode_flag, const bool aligned);
#endif
#if PEER_HAS_NMS_ROTATED
Tensor nms_rotated_cuda(const Tensor dets, const Tensor scores, const Tensor order_t,
                        const Tensor dets_sorted, float iou_threshold, const int multi_label);
#endif
#if PEER_HAS_ROIAWARE
void RoiawarePool3dForwardCUDAKernelLauncher(int boxes_num, int pts_num, int channels,
                                             int max_pts_each_voxel, int out_x, int out_y,
                                             int out_z, const Tensor rois, const Tensor pts,
                                             const Tensor pts_feature, Tensor argmax,
                                             Tensor pts_idx_of_voxels, Tensor pooled_features,
                                             int pool_method);
void RoiawarePool3dBackwardCUDAKernelLauncher(int boxes_num, int out_x, int out_y, int out_z,
                                              int channels, int max_pts_each_voxel,
                                              const Tensor pts_idx_of_voxels, const Tensor argmax,
                                              const Tensor grad_out, Tensor grad_in,
                                              int pool_method);
#endif
#if PEER_HAS_ROIPOINT
void RoIPointPool3dForwardCUDAKernelLauncher(int batch_size, int pts_num, int boxes_num,
                                             int feature_in_len, int sampled_pts_num,
                                             const Tensor xyz, const Tensor boxes3d,
                                             const Tensor pts_feature, Tensor pooled_features,
                                             Tensor pooled_empty_flag);
#endif

namespace {

#if PEER_HAS_POINTS_IN_BOXES
void points_in_boxes_part(Tensor boxes, Tensor pts, Tensor out) {
  PointsInBoxesPartForwardCUDAKernelLauncher(boxes.size(0), boxes.size(1), pts.size(1), boxes,
                                             pts, out);
}
void points_in_boxes_all(Tensor boxes, Tensor pts, Tensor out) {
  PointsInBoxesAllForwardCUDAKernelLauncher(boxes.size(0), boxes.size(1), pts.size(1), boxes,
                                            pts, out);
}
#endif

#if PEER_HAS_IOU3D
void boxes_overlap_bev(Tensor a, Tensor b, Tensor out) {
  IoU3DBoxesOverlapBevForwardCUDAKernelLauncher(a.size(0), a, b.size(0), b, out);
}

#if PEER_IOU3D_KEEP_API
// mmcv 2.x's iou3d_nms3d(_normal)_forward as its Python wrapper calls it (keep and keep_num on
// the boxes' device); returns the kept positions (int64, on the device).
Tensor nms3d_keep(Tensor boxes, double threshold, bool normal) {
  Tensor keep = at::zeros({boxes.size(0)}, boxes.options().dtype(at::kLong));
  Tensor keep_num = at::zeros({}, boxes.options().dtype(at::kLong));
  if (normal) {
    IoU3DNMS3DNormalForwardCUDAKernelLauncher(boxes, keep, keep_num, static_cast<float>(threshold));
  } else {
    IoU3DNMS3DForwardCUDAKernelLauncher(boxes, keep, keep_num, static_cast<float>(threshold));
  }
  return keep.slice(0, 0, keep_num.item<int64_t>());
}
#else
// mmcv's iou3d_nms3d(_normal)_forward host flow: mask on the device, copied to the host, the
// greedy walk over the removed-bits words there; returns the kept positions (int64, CPU).
Tensor nms3d_keep(Tensor boxes, double threshold, bool normal) {
  const int64_t n = boxes.size(0);
  const int64_t words = (n + 63) / 64;
  Tensor mask = at::empty({n, words}, boxes.options().dtype(at::kLong));
  auto* mask_ptr = reinterpret_cast<unsigned long long*>(mask.data_ptr<int64_t>());
  if (normal) {
    IoU3DNMS3DNormalForwardCUDAKernelLauncher(boxes, mask_ptr, n, static_cast<float>(threshold));
  } else {
    IoU3DNMS3DForwardCUDAKernelLauncher(boxes, mask_ptr, n, static_cast<float>(threshold));
  }
  Tensor host = mask.to(at::kCPU);
  const auto* rows = reinterpret_cast<const unsigned long long*>(host.data_ptr<int64_t>());
  std::vector<unsigned long long> removed(words, 0ull);
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < n; ++i) {
    if (removed[i / 64] >> (i % 64) & 1ull) continue;
    kept.push_back(i);
    for (int64_t w = i / 64; w < words; ++w) removed[w] |= rows[i * words + w];
  }
  return at::tensor(kept, at::TensorOptions().dtype(at::kLong));
}
#endif
#endif

#if PEER_HAS_BOX_IOU_ROTATED
void box_iou_rotated(Tensor b1, Tensor b2, Tensor ious, int64_t mode_flag, bool aligned) {
  box_iou_rotated_cuda(b1, b2, ious, static_cast<int>(mode_flag), aligned);
}
#endif

#if PEER_HAS_NMS_ROTATED
Tensor nms_rotated(Tensor dets, Tensor scores, Tensor order, Tensor dets_sorted,
                   double threshold) {
  return nms_rotated_cuda(dets, scores, order, dets_sorted, static_cast<float>(threshold), 0);
}
#endif

#if PEER_HAS_ROIAWARE
void roiaware_forward(Tensor rois, Tensor pts, Tensor pts_feature, Tensor argmax,
                      Tensor pts_idx_of_voxels, Tensor pooled, int64_t mode) {
  RoiawarePool3dForwardCUDAKernelLauncher(
      rois.size(0), pts.size(0), pts_feature.size(1), pts_idx_of_voxels.size(4),
      pts_idx_of_voxels.size(1), pts_idx_of_voxels.size(2), pts_idx_of_voxels.size(3), rois, pts,
      pts_feature, argmax, pts_idx_of_voxels, pooled, static_cast<int>(mode));
}
void roiaware_backward(Tensor pts_idx_of_voxels, Tensor argmax, Tensor grad_out, Tensor grad_in,
                       int64_t mode) {
  RoiawarePool3dBackwardCUDAKernelLauncher(
      pts_idx_of_voxels.size(0), pts_idx_of_voxels.size(1), pts_idx_of_voxels.size(2),
      pts_idx_of_voxels.size(3), grad_out.size(4), pts_idx_of_voxels.size(4), pts_idx_of_voxels,
      argmax, grad_out, grad_in, static_cast<int>(mode));
}
#endif

#if PEER_HAS_ROIPOINT
void roipoint_forward(Tensor xyz, Tensor boxes3d, Tensor pts_feature, Tensor pooled,
                      Tensor empty) {
  RoIPointPool3dForwardCUDAKernelLauncher(xyz.size(0), xyz.size(1), boxes3d.size(1),
                                          pts_feature.size(2), pooled.size(2), xyz, boxes3d,
                                          pts_feature, pooled, empty);
}
#endif

}  // namespace

TORCH_LIBRARY(mmcv_box3d_peer, m) {
#if PEER_HAS_POINTS_IN_BOXES
  m.def("points_in_boxes_part(Tensor boxes, Tensor pts, Tensor(a!) out) -> ()",
        points_in_boxes_part);
  m.def("points_in_boxes_all(Tensor boxes, Tensor pts, Tensor(a!) out) -> ()",
        points_in_boxes_all);
#endif
#if PEER_HAS_IOU3D
  m.def("boxes_overlap_bev(Tensor a, Tensor b, Tensor(a!) out) -> ()", boxes_overlap_bev);
  m.def("nms3d_keep(Tensor boxes, float threshold, bool normal) -> Tensor", nms3d_keep);
#endif
#if PEER_HAS_BOX_IOU_ROTATED
  m.def("box_iou_rotated(Tensor b1, Tensor b2, Tensor(a!) ious, int mode_flag, bool aligned) -> ()",
        box_iou_rotated);
#endif
#if PEER_HAS_NMS_ROTATED
  m.def("nms_rotated(Tensor dets, Tensor scores, Tensor order, Tensor dets_sorted, float thr) "
        "-> Tensor",
        nms_rotated);
#endif
#if PEER_HAS_ROIAWARE
  m.def("roiaware_forward(Tensor rois, Tensor pts, Tensor pts_feature, Tensor(a!) argmax, "
        "Tensor(b!) pts_idx_of_voxels, Tensor(c!) pooled, int mode) -> ()",
        roiaware_forward);
  m.def("roiaware_backward(Tensor pts_idx_of_voxels, Tensor argmax, Tensor grad_out, "
        "Tensor(a!) grad_in, int mode) -> ()",
        roiaware_backward);
#endif
#if PEER_HAS_ROIPOINT
  m.def("roipoint_forward(Tensor xyz, Tensor boxes3d, Tensor pts_feature, Tensor(a!) pooled, "
        "Tensor(b!) empty) -> ()",
        roipoint_forward);
#endif
}
