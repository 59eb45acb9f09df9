"""mmcv's own 3D box kernels, timed side by side with ours (issue 12).

scripts/build_mmcv_box3d_peer.sh builds mmcv's unmodified CUDA sources (from the ignored folder
.peers/mmcv/) with a minimal binding into .peers/build/mmcv_box3d_peer.so (MUSPACE_MMCV_PEER
overrides the path). When it is there and a CUDA GPU is visible, the box benchmarks add a
`<case>-mmcv` case per case with mmcv's whole Python-level call as mmcv writes it (allocations,
sorts, the host copy and walk of its NMS mask), checked for agreement with our reference, and
`python -m benchmarks._box3d_peer RESULTS.json ...` prints ours / mmcv per case. Without it the
benchmarks run unchanged (the missing peer is printed once).
"""

from __future__ import annotations

import sys

import torch

from benchmarks._peer import PeerLibrary, ratio_table
from benchmarks.harness import Case

PEER = PeerLibrary("mmcv_box3d_peer", "MUSPACE_MMCV_PEER", "scripts/build_mmcv_box3d_peer.sh")
reason = PEER.reason
has = PEER.has


def _ops():
    return PEER.ops


# ------------------------------------------------------------- mmcv's Python-level calls


def points_in_boxes_part(points, boxes):
    out = points.new_zeros((points.shape[0], points.shape[1]), dtype=torch.int).fill_(-1)
    _ops().points_in_boxes_part(boxes.contiguous(), points.contiguous(), out)
    return out


def points_in_boxes_all(points, boxes):
    out = points.new_zeros((points.shape[0], points.shape[1], boxes.shape[1]), dtype=torch.int)
    _ops().points_in_boxes_all(boxes.contiguous(), points.contiguous(), out)
    return out


def boxes_overlap_bev(a, b):
    out = a.new_zeros(torch.Size((a.shape[0], b.shape[0])))
    _ops().boxes_overlap_bev(a.contiguous(), b.contiguous(), out)
    return out


def box_iou_rotated(b1, b2, mode="iou", aligned=False, clockwise=True):
    rows, cols = b1.size(0), b2.size(0)
    ious = b1.new_zeros(rows) if aligned else b1.new_zeros(rows * cols)
    if not clockwise:
        flip = b1.new_ones(b1.shape[-1])
        flip[-1] = -1
        b1, b2 = b1 * flip, b2 * flip
    _ops().box_iou_rotated(
        b1.contiguous(), b2.contiguous(), ious, {"iou": 0, "iof": 1}[mode], aligned
    )
    return ious if aligned else ious.view(rows, cols)


def boxes_iou_bev(a, b):  # mmcv iou3d.boxes_iou_bev: xyxyr -> box_iou_rotated
    return box_iou_rotated(_xyxyr2xywhr(a), _xyxyr2xywhr(b))


def _xyxyr2xywhr(boxes):
    return torch.stack(
        (
            (boxes[:, 0] + boxes[:, 2]) / 2,
            (boxes[:, 1] + boxes[:, 3]) / 2,
            boxes[:, 2] - boxes[:, 0],
            boxes[:, 3] - boxes[:, 1],
            boxes[:, 4],
        ),
        dim=-1,
    )


def nms3d(boxes, scores, iou_threshold, normal=False):
    order = scores.sort(0, descending=True)[1]
    boxes = boxes[order].contiguous()
    keep = _ops().nms3d_keep(boxes, iou_threshold, normal)
    return order[keep.to(boxes.device)].contiguous()


def nms_rotated(dets, scores, iou_threshold):
    order = scores.sort(0, descending=True)[1]
    return _ops().nms_rotated(dets, scores, order, dets.index_select(0, order), iou_threshold)


def nms_bev(boxes, scores, thresh, pre_max_size=None, post_max_size=None):  # mmdet3d's
    order = scores.sort(0, descending=True)[1]
    if pre_max_size is not None:
        order = order[:pre_max_size]
    boxes = boxes[order].contiguous()
    scores = scores[order]
    keep = order[nms_rotated(_xyxyr2xywhr(boxes), scores, thresh)]
    return keep[:post_max_size] if post_max_size is not None else keep


def roiaware_forward(rois, pts, pts_feature, out_size, max_pts_per_voxel, mode):
    ox, oy, oz = (out_size,) * 3 if isinstance(out_size, int) else out_size
    n, c = rois.shape[0], pts_feature.shape[-1]
    pooled = pts_feature.new_zeros((n, ox, oy, oz, c))
    argmax = pts_feature.new_zeros((n, ox, oy, oz, c), dtype=torch.int)
    idx = pts_feature.new_zeros((n, ox, oy, oz, max_pts_per_voxel), dtype=torch.int)
    _ops().roiaware_forward(rois, pts, pts_feature, argmax, idx, pooled, {"max": 0, "avg": 1}[mode])
    return pooled, (idx, argmax)


def roiaware_backward(state, grad_out, n_points, mode):
    idx, argmax = state
    grad_in = grad_out.new_zeros((n_points, grad_out.shape[-1]))
    _ops().roiaware_backward(
        idx, argmax, grad_out.contiguous(), grad_in, {"max": 0, "avg": 1}[mode]
    )
    return grad_in


def roipoint(points, point_features, boxes3d, num_sampled_points=512):
    B, M, C = points.shape[0], boxes3d.shape[1], point_features.shape[2]
    pooled = point_features.new_zeros((B, M, num_sampled_points, 3 + C))
    empty = point_features.new_zeros((B, M)).int()
    _ops().roipoint_forward(
        points.contiguous(),
        boxes3d.view(B, -1, 7).contiguous(),
        point_features.contiguous(),
        pooled,
        empty,
    )
    return pooled, empty


# ------------------------------------------------------------- cases and the ratio table


def agreement(min_equal: float = 1.0, atol: float = 0.0):
    """A Case.check: the share of elements within atol of our reference is >= min_equal (mmcv
    differs by design in places: its 1 cm overlap margin, ulp-level face tests)."""

    def check(out, ref):
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        for o, r in zip(outs, refs):
            if o.shape != r.shape:
                raise AssertionError(f"mmcv peer: shape {tuple(o.shape)} vs ours {tuple(r.shape)}")
            if o.numel() == 0:
                continue
            same = ((o.double() - r.double()).abs() <= atol).double().mean().item()
            if same < min_equal:
                raise AssertionError(
                    f"mmcv peer agrees on {same:.6f} of the elements (< {min_equal})"
                )

    return check


def keep_agreement(min_jaccard: float = 0.95):
    def check(out, ref):
        a, b = set(out.tolist()), set(ref.tolist())
        j = len(a & b) / max(len(a | b), 1)
        if j < min_jaccard:
            raise AssertionError(
                f"mmcv peer keeps a set with Jaccard {j:.4f} to ours (< {min_jaccard})"
            )

    return check


def peer_case(ours: Case, fn, check=None, make_args=None) -> Case:
    """`<ours.name>-mmcv`: mmcv's call on ours' inputs; checked against ours' reference with
    `check` (agreement, not equality), the reference not timed again."""
    return Case(
        name=f"{ours.name}-mmcv",
        op=f"mmcv:{ours.op}",
        direction=ours.direction,
        dtype=ours.dtype,
        params={**ours.params, "implementation": "mmcv (unmodified kernels, issue-12 peer build)"},
        compulsory_bytes=ours.compulsory_bytes,
        fn=fn,
        make_args=make_args or ours.make_args,
        reference=ours.reference if check is not None else None,
        check=check,
        time_reference=False,
    )


if __name__ == "__main__":
    print(ratio_table(sys.argv[1:]))
