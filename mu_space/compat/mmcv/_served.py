"""The `mmcv._ext` functions muSPACE serves, in mmcv 2.1.0's calling convention: the keyword names
of its pybind11 bindings (mmcv/ops/csrc/pytorch/pybind.cpp), outputs preallocated by the caller
written in place, the same return values. Each one calls the public muSPACE API with the
surrogate's backend ("auto": native on a GPU, reference on CPU), reusing the patcher's adapters
where the patcher already wraps the same function (mu_space/patcher/patches.py).

`SERVED` maps each served name to its implementation `fn(backend, *args)`; `SPARSE` lists the
sparse-convolution names routed at call time to `mu_space.sparse.mmcv_ext` (when it exists).
docs/compat_mmcv.md states every convention.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable

import torch

import mu_space
from mu_space import ops
from mu_space.compat.mmcv._names import SIGNATURES

MATRIX = "docs/operator_matrix.md"


class NotServedError(NotImplementedError):
    """An mmcv._ext function that muSPACE does not implement (raised when it is called)."""


def not_served(name: str, why: str = "") -> NotServedError:
    return NotServedError(
        f"mmcv._ext.{name} is not served by muSPACE's mmcv._ext surrogate"
        + (f" ({why})" if why else "")
        + f"; the operators muSPACE has are listed in {MATRIX} and the served mmcv names in "
        "docs/compat_mmcv.md (mu_space.compat.mmcv.SERVED_NAMES)"
    )


# --------------------------------------------------------------------------- patcher adapters


def _stub(name: str) -> Callable[..., Any]:
    """A stand-in 'original' for the patcher's _ext adapters: it has mmcv 2.x's parameter names
    (the adapters read them to pick the 2.x convention) and is what they fall back to for inputs
    they do not take (NDim != 3): a clear NotImplementedError."""
    params = SIGNATURES[name]
    namespace: dict[str, Any] = {"_raise": not_served, "_name": name}
    exec(  # noqa: S102 - a fixed signature from _names.py
        f"def {name}({', '.join(params)}):\n    raise _raise(_name, 'only NDim == 3')\n",
        namespace,
    )
    return namespace[name]


_PATCHER_FACTORIES = {
    "hard_voxelize_forward": "_ext_hard_voxelize",
    "dynamic_voxelize_forward": "_ext_dynamic_voxelize",
    "dynamic_point_to_voxel_forward": "_ext_scatter_forward",
    "dynamic_point_to_voxel_backward": "_ext_scatter_backward",
}
_ADAPTERS: dict[tuple[str, str], Callable[..., Any]] = {}


def _patcher_adapter(name: str) -> Callable[..., Any]:
    def call(backend: str, *args: Any) -> Any:
        fn = _ADAPTERS.get((name, backend))
        if fn is None:
            from mu_space.patcher import patches

            fn = getattr(patches, _PATCHER_FACTORIES[name])(backend)(_stub(name))
            _ADAPTERS[(name, backend)] = fn
        return fn(*args)

    return call


# --------------------------------------------------------------------------- points in boxes


def points_in_boxes_part_forward(backend, boxes_tensor, pts_tensor, box_idx_of_points_tensor):
    """boxes [B, T, 7], pts [B, M, 3]; writes box_idx_of_points [B, M] int32 (first box, -1)."""
    box_idx_of_points_tensor.copy_(
        ops.points_in_boxes_part(pts_tensor, boxes_tensor, backend=backend)
    )


def points_in_boxes_all_forward(backend, boxes_tensor, pts_tensor, box_idx_of_points_tensor):
    """boxes [B, T, 7], pts [B, M, 3]; writes box_idx_of_points [B, M, T] int32 (0 / 1)."""
    box_idx_of_points_tensor.copy_(
        ops.points_in_boxes_all(pts_tensor, boxes_tensor, backend=backend)
    )


def points_in_boxes_cpu_forward(backend, boxes_tensor, pts_tensor, pts_indices_tensor):
    """One sample: boxes [T, 7], pts [M, 3]; writes pts_indices [T, M] int32 (0 / 1)."""
    inside = ops.points_in_boxes_cpu(pts_tensor[None], boxes_tensor[None], backend=backend)
    pts_indices_tensor.copy_(inside[0].transpose(0, 1))


# --------------------------------------------------------------------------- iou3d / NMS


def iou3d_boxes_overlap_bev_forward(backend, boxes_a, boxes_b, ans_iou):
    """boxes_a [N, 7], boxes_b [M, 7]; writes the BEV overlap areas [N, M] into ans_iou."""
    ans_iou.copy_(ops.boxes_overlap_bev(boxes_a, boxes_b, backend=backend))


def _nms3d(kind: str):
    def run(backend, boxes, keep, num_out, nms_overlap_thresh):
        """boxes [N, 7] already in visiting order (mmcv's Python sorts them); writes the kept
        rows (indices into boxes) to keep[:K] and K to num_out (a 0-d int64 tensor)."""
        order = torch.arange(boxes.shape[0], device=boxes.device)
        kept = ops.box3d_nms_ordered(boxes, order, kind, float(nms_overlap_thresh), backend=backend)
        keep[: kept.numel()].copy_(kept)
        num_out.fill_(kept.numel())

    return run


def nms(backend, boxes, scores, iou_threshold, offset):
    """mmcv's 2-D NMS: boxes [N, 4] (x1, y1, x2, y2), scores [N]; returns the kept indices
    (int64, highest score first). A box is dropped when its IoU with a kept box is
    > iou_threshold; IoU = inter / (area_a + area_b - inter), widths x2 - x1 + offset (0 or 1).
    Served as the axis-aligned 'normal' NMS of box3d_nms_ordered on the equivalent centre /
    size boxes (the same overlap and areas; the union floored at 1e-8)."""
    if boxes.shape[0] == 0:
        return boxes.new_zeros(0, dtype=torch.long)
    b = boxes.float() if boxes.dtype not in (torch.float32, torch.float64) else boxes
    x1, y1 = b[:, 0], b[:, 1]
    x2, y2 = b[:, 2] + offset, b[:, 3] + offset
    zeros = torch.zeros_like(x1)
    lidar = torch.stack(
        [(x1 + x2) / 2, (y1 + y2) / 2, zeros, x2 - x1, y2 - y1, zeros + 1, zeros], 1
    )
    order = scores.sort(0, descending=True)[1]
    return ops.box3d_nms_ordered(lidar, order, "normal", float(iou_threshold), backend=backend)


def _rotated_nms_in_order(backend, dets, order, iou_threshold):
    """Greedy rotated NMS of dets [N, 5] (x, y, w, h, angle) visiting the rows `order`: the
    kept rows, in visiting order. Through mu_space.nms_bev on the (x1, y1, x2, y2, angle) boxes
    of dets[order], with descending scores so that nms_bev's sort visits them as given."""
    sub = dets[order]
    xy, wh = sub[:, 0:2], sub[:, 2:4]
    xyxyr = torch.cat([xy - wh / 2, xy + wh / 2, sub[:, 4:5]], 1)
    rank = torch.arange(order.numel(), 0, -1, dtype=torch.float32, device=dets.device)
    return order[ops.nms_bev(xyxyr, rank, float(iou_threshold), backend=backend)]


def nms_rotated(backend, dets, scores, order, dets_sorted, labels, iou_threshold, multi_label):
    """mmcv's rotated NMS: dets [N, 5] (x_ctr, y_ctr, w, h, angle; [N, 6] with the label last
    when multi_label), scores [N], order = scores sorted descending, dets_sorted = dets[order];
    returns the kept indices into dets (int64, in visiting order). A box is dropped when its
    box_iou_rotated IoU with a kept box is > iou_threshold (mmcv's CUDA rule; its CPU loop
    drops at >=, which differs only at exact ties). multi_label: boxes of different labels
    never suppress each other (mmcv's CUDA kernel; its CPU kernel ignores labels)."""
    if dets.shape[0] == 0:
        return dets.new_zeros(0, dtype=torch.long)
    order = order.to(device=dets.device, dtype=torch.long)
    boxes = dets[:, :5]
    if not multi_label:
        return _rotated_nms_in_order(backend, boxes, order, iou_threshold)
    label = labels if labels is not None and labels.numel() else dets[:, 5]
    label_in_order = label[order]
    kept = []
    for value in torch.unique(label_in_order).tolist():  # one pass per class
        kept.append(
            _rotated_nms_in_order(backend, boxes, order[label_in_order == value], iou_threshold)
        )
    kept = torch.cat(kept)
    position = torch.empty(dets.shape[0], dtype=torch.long, device=dets.device)
    position[order] = torch.arange(order.numel(), device=dets.device)
    return kept[position[kept].argsort()]


def box_iou_rotated(backend, boxes1, boxes2, ious, mode_flag, aligned):
    """boxes [N, 5] / [M, 5] (x, y, w, h, angle, already clockwise: mmcv's Python flips the
    angle for clockwise=False); mode_flag 0: IoU, 1: IoF; writes ious ([N*M] or [N, M]; [N]
    when aligned) in place."""
    mode = "iof" if int(mode_flag) == 1 else "iou"
    out = ops.box_iou_rotated(boxes1, boxes2, mode, bool(aligned), True, backend=backend)
    ious.copy_(out.reshape(ious.shape))


# --------------------------------------------------------------------------- RoI pooling


def _voxel_lists(backend, rois, pts, out_size, max_pts):
    """mmcv's pts_idx_of_voxels [N, ox, oy, oz, max_pts] int32 (slot 0: the count, then the
    first max_pts - 1 point indices in ascending order) from roiaware_pool3d_map."""
    start, count, plist = ops.roiaware_pool3d_map(rois, pts, out_size, max_pts, backend=backend)
    cells = count.numel()
    slots = torch.arange(max_pts - 1, device=pts.device)
    take = slots[None, :] < count[:, None].long()  # [cells, max_pts - 1]
    src = (start[:, None] + slots[None, :]).clamp(max=max(plist.numel() - 1, 0))
    idx = torch.zeros(cells, max_pts, dtype=torch.int32, device=pts.device)
    idx[:, 0] = count
    if plist.numel():
        idx[:, 1:] = torch.where(take, plist[src], torch.zeros_like(plist[src]))
    return idx


def roiaware_pool3d_forward(
    backend, rois, pts, pts_feature, argmax, pts_idx_of_voxels, pooled_features, pool_method
):
    """rois [N, 7], pts [P, 3], pts_feature [P, C]; writes pooled_features [N, ox, oy, oz, C],
    pts_idx_of_voxels [N, ox, oy, oz, max_pts] int32 and (max, pool_method 0) argmax
    [N, ox, oy, oz, C] int32: the point of the first maximum, -1 for an empty voxel."""
    n, ox, oy, oz, max_pts = pts_idx_of_voxels.shape
    out_size = (ox, oy, oz)
    mode = "max" if int(pool_method) == 0 else "avg"
    pooled = ops.roiaware_pool3d(rois, pts, pts_feature, out_size, max_pts, mode, backend=backend)
    pooled_features.copy_(pooled)
    idx = _voxel_lists(backend, rois, pts, out_size, max_pts)
    pts_idx_of_voxels.copy_(idx.view(pts_idx_of_voxels.shape))
    if mode == "max":
        c = pts_feature.shape[1]
        count, members = idx[:, 0].long(), idx[:, 1:].long()  # [cells], [cells, S]
        valid = torch.arange(members.shape[1], device=pts.device)[None] < count[:, None]
        feats = pts_feature.float()[members.reshape(-1)].view(*members.shape, c)
        feats = torch.where(valid[..., None], feats, torch.full_like(feats, float("-inf")))
        feats = torch.nan_to_num(feats, nan=float("-inf"))
        best = feats.max(1, keepdim=True).values  # first maximum: the lowest slot holding it
        hit = (feats == best) & (best > float("-inf")) & valid[..., None]
        slot = torch.where(
            hit, torch.arange(members.shape[1], device=pts.device)[None, :, None], members.shape[1]
        )
        first = slot.min(1).values  # [cells, C]
        found = first < members.shape[1]
        point = members.gather(1, first.clamp(max=max(members.shape[1] - 1, 0)))
        argmax.copy_(torch.where(found, point, -1).to(torch.int32).view(argmax.shape))


def roiaware_pool3d_backward(backend, pts_idx_of_voxels, argmax, grad_out, grad_in, pool_method):
    """grad_out [N, ox, oy, oz, C]; accumulates into grad_in [P, C] (zeros from the caller):
    max: each voxel's gradient to its argmax point; avg: grad / count to each listed point."""
    c = grad_out.shape[-1]
    g = grad_out.reshape(-1, c).to(grad_in.dtype)
    if int(pool_method) == 0:
        am = argmax.reshape(-1, c).long()
        ok = am >= 0
        chan = torch.arange(c, device=g.device).expand_as(am)
        flat = grad_in.view(-1)
        flat.index_add_(0, (am * c + chan)[ok], g[ok])
        return
    idx = pts_idx_of_voxels.reshape(-1, pts_idx_of_voxels.shape[-1]).long()
    count, members = idx[:, 0], idx[:, 1:]
    valid = torch.arange(members.shape[1], device=g.device)[None] < count[:, None]
    share = g / count.clamp(min=1)[:, None].to(g.dtype)  # [cells, C]
    rows = members[valid]
    vals = share[:, None, :].expand(-1, members.shape[1], -1)[valid]
    grad_in.index_add_(0, rows, vals)


def roipoint_pool3d_forward(backend, xyz, boxes3d, pts_feature, pooled_features, pooled_empty_flag):
    """xyz [B, N, 3], boxes3d [B, M, 7], pts_feature [B, N, C]; writes pooled_features
    [B, M, S, 3 + C] (S from its shape) and pooled_empty_flag [B, M] int32."""
    pooled, empty = ops.roipoint_pool3d(
        xyz, pts_feature, boxes3d, pooled_features.shape[2], backend=backend
    )
    pooled_features.copy_(pooled)
    pooled_empty_flag.copy_(empty)


# --------------------------------------------------------------------------- deformable attention


def ms_deform_attn_forward(
    backend,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    im2col_step,
):
    """Returns Tensor[bs, num_queries, num_heads * head_dim] (mmcv's forward)."""
    with torch.no_grad():
        return ops.multi_scale_deformable_attn(
            value,
            value_spatial_shapes,
            value_level_start_index,
            sampling_locations,
            attention_weights,
            int(im2col_step),
            backend=backend,
        )


def ms_deform_attn_backward(
    backend,
    value,
    value_spatial_shapes,
    value_level_start_index,
    sampling_locations,
    attention_weights,
    grad_output,
    grad_value,
    grad_sampling_loc,
    grad_attn_weight,
    im2col_step,
):
    """Adds the gradients w.r.t. value, sampling_locations and attention_weights into the
    caller's grad_value / grad_sampling_loc / grad_attn_weight (zeros from mmcv's Python; its
    kernels accumulate too)."""
    inputs = [
        t.detach().requires_grad_(True) for t in (value, sampling_locations, attention_weights)
    ]
    with torch.enable_grad():
        out = ops.multi_scale_deformable_attn(
            inputs[0],
            value_spatial_shapes,
            value_level_start_index,
            inputs[1],
            inputs[2],
            int(im2col_step),
            backend=backend,
        )
        grads = torch.autograd.grad(out, inputs, grad_output, allow_unused=True)
    for buf, g in zip((grad_value, grad_sampling_loc, grad_attn_weight), grads):
        if g is not None:
            buf.add_(g.to(buf.dtype))


# --------------------------------------------------------------------------- focal loss

_LOG_FLT_MIN = math.log(torch.finfo(torch.float32).tiny)  # mmcv's log(max(p, FLT_MIN)) floor


def _focal_terms(input, target, weight, buffer, what):
    """Checks mmcv's SigmoidFocalLossFunction makes (input [N, C] float, target [N] int64,
    weight [C] or empty, the output buffer input's shape) and the kernels' per-element terms:
    (is the target class, p, q = 1 - p, log p, log q, the weight per row or None), computed
    in float32 at least."""
    if input.dim() != 2:
        raise ValueError(f"{what}: input must be [N, C], got shape {tuple(input.shape)}")
    if target.dtype != torch.int64 or target.shape != input.shape[:1]:
        raise ValueError(
            f"{what}: target must be int64 [{input.shape[0]}], got {target.dtype} "
            f"{tuple(target.shape)}"
        )
    if buffer.shape != input.shape:
        raise ValueError(f"{what}: the output buffer must have input's shape {tuple(input.shape)}")
    n, c = input.shape
    if n and int(target.max()) > c:
        raise ValueError(f"{what}: target values must be <= {c} (C is the background)")
    x = input if input.dtype == torch.float64 else input.float()
    is_t = target[:, None] == torch.arange(c, device=input.device)[None, :]
    log_p = torch.nn.functional.logsigmoid(x).clamp(min=_LOG_FLT_MIN)
    log_q = torch.nn.functional.logsigmoid(-x).clamp(min=_LOG_FLT_MIN)
    row_weight = None
    if weight.numel():
        if weight.shape != (c,):
            raise ValueError(f"{what}: weight must be [{c}] or empty, got {tuple(weight.shape)}")
        if n and (int(target.min()) < 0 or int(target.max()) >= c):
            raise ValueError(f"{what}: with a weight every target must be a class in [0, {c})")
        row_weight = weight.to(x.dtype)[target][:, None]
    return is_t, torch.sigmoid(x), torch.sigmoid(-x), log_p, log_q, row_weight


def sigmoid_focal_loss_forward(backend, input, target, weight, output, gamma, alpha):
    """input [N, C] logits, target [N] int64 (a class, or C for the background: negative for
    every class); writes the elementwise loss into output [N, C] (mmcv's CUDA kernel):
    -alpha (1 - p)^gamma log p at the target class, -(1 - alpha) p^gamma log(1 - p) elsewhere,
    p = sigmoid(input), logs floored at log(FLT_MIN), times weight[target] when weight is not
    empty. A PyTorch computation on the tensors' device (no muSPACE op; both backends)."""
    is_t, p, q, log_p, log_q, w = _focal_terms(input, target, weight, output, "output")
    g, a = float(gamma), float(alpha)
    loss = torch.where(is_t, -a * q.pow(g) * log_p, -(1 - a) * p.pow(g) * log_q)
    output.copy_(loss if w is None else loss * w)


def sigmoid_focal_loss_backward(backend, input, target, weight, grad_input, gamma, alpha):
    """Writes d loss / d input of sigmoid_focal_loss_forward into grad_input [N, C] (mmcv's
    Python then multiplies by the incoming gradient):
    -alpha (1 - p)^gamma (1 - p - gamma p log p) at the target class,
    -(1 - alpha) p^gamma (gamma (1 - p) log(1 - p) - p) elsewhere, times weight[target]."""
    is_t, p, q, log_p, log_q, w = _focal_terms(input, target, weight, grad_input, "grad_input")
    g, a = float(gamma), float(alpha)
    grad = torch.where(
        is_t, -a * q.pow(g) * (q - g * p * log_p), -(1 - a) * p.pow(g) * (g * q * log_q - p)
    )
    grad_input.copy_(grad if w is None else grad * w)


# --------------------------------------------------------------------------- build information


def get_compiler_version(backend):
    return f"muSPACE {mu_space.__version__} mmcv._ext surrogate (no mmcv ops build)"


def get_compiling_cuda_version(backend):
    return "not available"  # mmcv's answer when its ops were built without CUDA


# --------------------------------------------------------------------------- sparse convolution

SPARSE = (
    "get_indice_pairs_2d_forward",
    "get_indice_pairs_3d_forward",
    "get_indice_pairs_4d_forward",
    "get_indice_pairs_2d_backward",
    "get_indice_pairs_3d_backward",
    "indice_conv_forward",
    "indice_conv_backward",
    "fused_indice_conv_forward",
    "indice_maxpool_forward",
    "indice_maxpool_backward",
)
SPARSE_MODULE = "mu_space.sparse.mmcv_ext"


def sparse_function(name: str) -> Callable[..., Any] | None:
    """`mu_space.sparse.mmcv_ext.<name>` when that module exists and has it, else None.
    Looked up at call time, so the surrogate serves it as soon as the module lands."""
    try:
        module = importlib.import_module(SPARSE_MODULE)
    except ImportError:
        return None
    fn = getattr(module, name, None)
    return fn if callable(fn) else None


# int parameters of the sparse bindings: pybind11 converts what mmcv passes there (mmdet3d's
# SparseEncoder passes batch_size = coors[-1, 0] + 1, a 0-d tensor) with __index__; so here.
_SPARSE_INTS = {"batchSize", "numActOut", "numAct", "_inverse", "_subM", "_transpose"}


def _sparse(name: str):
    ints = [i for i, p in enumerate(SIGNATURES[name]) if p in _SPARSE_INTS]

    def call(backend, *args):
        fn = sparse_function(name)
        if fn is None:
            raise not_served(name, f"{SPARSE_MODULE} is not available or has no {name}")
        args = list(args)
        for i in ints:
            if isinstance(args[i], torch.Tensor):
                args[i] = args[i].__index__()
        return fn(*args, backend=backend)

    return call


SERVED: dict[str, Callable[..., Any]] = {
    **{name: _patcher_adapter(name) for name in _PATCHER_FACTORIES},
    "points_in_boxes_part_forward": points_in_boxes_part_forward,
    "points_in_boxes_all_forward": points_in_boxes_all_forward,
    "points_in_boxes_cpu_forward": points_in_boxes_cpu_forward,
    "iou3d_boxes_overlap_bev_forward": iou3d_boxes_overlap_bev_forward,
    "iou3d_nms3d_forward": _nms3d("iou3d"),
    "iou3d_nms3d_normal_forward": _nms3d("normal"),
    "nms": nms,
    "nms_rotated": nms_rotated,
    "box_iou_rotated": box_iou_rotated,
    "roiaware_pool3d_forward": roiaware_pool3d_forward,
    "roiaware_pool3d_backward": roiaware_pool3d_backward,
    "roipoint_pool3d_forward": roipoint_pool3d_forward,
    "ms_deform_attn_forward": ms_deform_attn_forward,
    "ms_deform_attn_backward": ms_deform_attn_backward,
    "sigmoid_focal_loss_forward": sigmoid_focal_loss_forward,
    "sigmoid_focal_loss_backward": sigmoid_focal_loss_backward,
    "get_compiler_version": get_compiler_version,
    "get_compiling_cuda_version": get_compiling_cuda_version,
    **{name: _sparse(name) for name in SPARSE},
}
