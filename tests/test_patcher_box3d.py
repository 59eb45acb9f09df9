"""The box3d default patches (issue 12) on stand-in upstream modules created by these tests.

The stand-ins sit at the upstream dotted paths with the upstream signatures and re-exports:
mmcv 2.x's `mmcv.ops.points_in_boxes`, `iou3d`, `box_iou_rotated`, `roiaware_pool3d`,
`roipoint_pool3d` and `_ext.iou3d_boxes_overlap_bev_forward`; mmdet3d 1.x's
`mmdet3d.models.layers.box3d_nms` and mmdet3d 0.x's `mmdet3d.core.post_processing.box3d_nms`
(circle_nms behind a numba-like dispatcher); OpenPCDet's `pcdet.ops.iou3d_nms.iou3d_nms_utils`
and `pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils`; plus user modules that imported the
functions by name. Their bodies state the upstream rules as plain Python loops over
tests/ops/_box3d_oracle (float64), independent of muSPACE's implementation. Every module goes
into sys.modules through monkeypatch, so nothing leaks between tests.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

import mu_space
from mu_space.ops import pcdet as pcdet_ops
from mu_space.patcher import default_patcher, default_patches
from mu_space.patcher.patches import DECLINED
from mu_space.testing import boxes as box_inputs
from tests.helpers import assert_close
from tests.ops import _box3d_oracle as oracle

BOX3D_PATCHES = {
    "mmcv.points_in_boxes_part",
    "mmcv.points_in_boxes_all",
    "mmcv.points_in_boxes_cpu",
    "mmcv.boxes_overlap_bev",
    "mmcv.boxes_iou_bev",
    "mmcv.nms_bev",
    "mmcv.nms3d",
    "mmcv.nms3d_normal",
    "mmcv._ext.iou3d_boxes_overlap_bev_forward",
    "mmcv.box_iou_rotated",
    "mmcv.RoIAwarePool3d",
    "mmcv.RoIPointPool3d",
    "mmdet3d.nms_bev",
    "mmdet3d.circle_nms",
    "mmdet3d.core.nms_bev",
    "mmdet3d.core.circle_nms",
    "pcdet.boxes_iou_bev",
    "pcdet.boxes_bev_iou_cpu",
    "pcdet.nms_gpu",
    "pcdet.nms_normal_gpu",
    "pcdet.points_in_boxes_gpu",
    "pcdet.points_in_boxes_cpu",
}
F64 = {"atol": 1e-9, "rtol": 1e-9}  # float64 reference vs the float64 Python statement


# --------------------------------------------------------------------------- stand-ins


def _module(monkeypatch, name: str, *, fresh: bool = True) -> types.ModuleType:
    """A new stand-in module `name` linked to its parent (the parents: modules already
    registered, e.g. tests/test_patcher_defaults.py's stand-ins, else new ones)."""
    mod = None if fresh else sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mod)
    parent, _, leaf = name.rpartition(".")
    if parent:
        monkeypatch.setattr(_module(monkeypatch, parent, fresh=False), leaf, mod, raising=False)
    return mod


def _export(monkeypatch, module, **names):
    for name, value in names.items():
        monkeypatch.setattr(module, name, value, raising=False)


def _inside_mmcv(points, boxes):
    """[B, M, T] bool by mmcv's check_pt_in_box3d (z at the bottom)."""
    p, b = points.double().tolist(), boxes.double().tolist()
    return [
        [[oracle.point_in_lidar_box(pt, bx) for bx in b[i]] for pt in p[i]] for i in range(len(p))
    ]


def _inside_pcdet(pt, box, margin=1e-5):
    """OpenPCDet's check_pt_in_box3d: z at the CENTRE, |local x / y| < d / 2 + 1e-5."""
    x, y, z = pt
    cx, cy, cz, dx, dy, dz, yaw = box
    if abs(z - cz) > dz / 2:
        return False
    c, s = math.cos(-yaw), math.sin(-yaw)
    lx = (x - cx) * c - (y - cy) * s
    ly = (x - cx) * s + (y - cy) * c
    return abs(lx) < dx / 2 + margin and abs(ly) < dy / 2 + margin


def _xywhr(b):  # mmcv's _xyxyr2xywhr
    return [(b[0] + b[2]) / 2, (b[1] + b[3]) / 2, b[2] - b[0], b[3] - b[1], b[4]]


def _greedy(boxes, order, iou, thresh):
    rows = boxes.double().tolist()
    return oracle.greedy_nms(order, lambda k, i: iou(rows[k], rows[i]) > thresh)


def _nms_rotated_keep(xywhr_rows, scores, thresh):
    """mmcv's nms_rotated(...)[1]: its own descending sort, greedy rotated IoU > thresh."""
    order = scores.sort(0, descending=True)[1].tolist()
    return oracle.greedy_nms(
        order, lambda k, i: oracle.rotated_iou(xywhr_rows[k], xywhr_rows[i]) > thresh
    )


def _nms_bev_standin(boxes, scores, thresh, pre_max_size=None, post_max_size=None):
    """mmcv >= 1.6 iou3d.nms_bev / mmdet3d's box3d_nms.nms_bev: sort, cut, nms_rotated."""
    order = scores.sort(0, descending=True)[1]
    if pre_max_size is not None:
        order = order[:pre_max_size]
    rows = [_xywhr(b) for b in boxes[order].double().tolist()]
    keep = order[torch.tensor(_nms_rotated_keep(rows, scores[order], thresh), dtype=torch.long)]
    return keep[:post_max_size] if post_max_size is not None else keep


def _nms_normal_bev_standin(boxes, scores, thresh):
    raise AssertionError("declined: never patched, never called by these tests")


def _circle_nms_py(dets, thresh, post_max_size=83):
    """mmdet3d's circle_nms body: reversed argsort, squared centre distance <= thresh."""
    order = dets[:, 2].argsort()[::-1].astype(np.int32)
    suppressed = np.zeros(dets.shape[0], dtype=np.int32)
    keep = []
    for _i in range(dets.shape[0]):
        i = order[_i]
        if suppressed[i] == 1:
            continue
        keep.append(int(i))
        for _j in range(_i + 1, dets.shape[0]):
            j = order[_j]
            dist = (dets[i, 0] - dets[j, 0]) ** 2 + (dets[i, 1] - dets[j, 1]) ** 2
            if dist <= thresh:
                suppressed[j] = 1
    return keep[:post_max_size] if post_max_size < len(keep) else keep


class _NumbaDispatcher:
    """What `@numba.jit(nopython=True)` makes of circle_nms: a callable object with the Python
    function as `py_func` and no inspectable signature of its own."""

    def __init__(self, py_func):
        self.py_func, self.__name__ = py_func, py_func.__name__

    def __call__(self, *args, **kwargs):
        return self.py_func(*args, **kwargs)


def _roiaware_standin(rois, pts, pts_feature, out_size, max_pts_per_voxel, mode):
    """mmcv's RoIAwarePool3dFunction (z at the bottom): the first max_pts_per_voxel - 1 points
    of each voxel in point order; max: the first maximum (0 when empty), avg: the mean."""
    ox, oy, oz = (out_size,) * 3 if isinstance(out_size, int) else out_size
    P, C = pts_feature.shape
    out = torch.zeros(rois.shape[0], ox, oy, oz, C, dtype=pts_feature.dtype)
    p, f = pts.double().tolist(), pts_feature.double().tolist()
    for r, (cx, cy, cz, dx, dy, dz, yaw) in enumerate(rois.double().tolist()):
        cells: dict[tuple, list[int]] = {}
        for k in range(P):
            if not oracle.point_in_lidar_box(p[k], (cx, cy, cz, dx, dy, dz, yaw)):
                continue
            c, s = math.cos(-yaw), math.sin(-yaw)
            sx, sy = p[k][0] - cx, p[k][1] - cy
            lx, ly = sx * c - sy * s, sx * s + sy * c
            idx = (
                min(max(int((lx + dx / 2) / (dx / ox)), 0), ox - 1),
                min(max(int((ly + dy / 2) / (dy / oy)), 0), oy - 1),
                min(max(int((p[k][2] - cz) / (dz / oz)), 0), oz - 1),
            )
            members = cells.setdefault(idx, [])
            if len(members) < max_pts_per_voxel - 1:
                members.append(k)
        for idx, members in cells.items():
            for ch in range(C):
                vals = [f[k][ch] for k in members]
                if mode == 0:
                    best = -1e50
                    for v in vals:
                        best = v if v > best else best
                    out[(r, *idx, ch)] = best if best > -1e50 else 0.0
                else:
                    out[(r, *idx, ch)] = sum(vals) / len(vals)
    return out


def _roipoint_standin(points, point_features, boxes3d, num_sampled_points):
    """mmcv's RoIPointPool3dFunction: the points inside each box in index order, repeated
    k % cnt up to S, with (x, y, z, features); empty flag 1 (and zeros) for an empty box."""
    B, N, C = point_features.shape
    M, S = boxes3d.shape[1], num_sampled_points
    pooled = torch.zeros(B, M, S, 3 + C, dtype=points.dtype)
    empty = torch.zeros(B, M, dtype=torch.int32)
    rows = torch.cat([points, point_features], -1)
    inside = _inside_mmcv(points, boxes3d)
    for b in range(B):
        for m in range(M):
            idx = [k for k in range(N) if inside[b][k][m]]
            if not idx:
                empty[b, m] = 1
                continue
            take = [idx[k] if k < len(idx) else idx[k % len(idx)] for k in range(S)]
            pooled[b, m] = rows[b, take]
    return pooled, empty


def install_box3d_upstream(monkeypatch):
    """The box3d stand-ins (upstream paths, signatures, re-exports and user-module imports)."""
    ext = _module(monkeypatch, "mmcv._ext", fresh=False)
    ops = _module(monkeypatch, "mmcv.ops", fresh=False)

    # mmcv/ops/points_in_boxes.py
    pib = _module(monkeypatch, "mmcv.ops.points_in_boxes")

    def points_in_boxes_part(points, boxes):
        inside = _inside_mmcv(points, boxes)
        first = [[row.index(True) if True in row else -1 for row in batch] for batch in inside]
        return torch.tensor(first, dtype=torch.int32).reshape(points.shape[:2])

    def points_in_boxes_all(points, boxes):
        shape = (points.shape[0], points.shape[1], boxes.shape[1])
        return torch.tensor(_inside_mmcv(points, boxes), dtype=torch.int32).reshape(shape)

    def points_in_boxes_cpu(points, boxes):
        return points_in_boxes_all(points.float(), boxes.float())

    _export(monkeypatch, pib, points_in_boxes_part=points_in_boxes_part,
            points_in_boxes_all=points_in_boxes_all, points_in_boxes_cpu=points_in_boxes_cpu)  # fmt: skip

    # mmcv/_ext: the BEV overlap that boxes_overlap_bev and boxes_iou3d call
    def iou3d_boxes_overlap_bev_forward(boxes_a, boxes_b, ans_iou):
        a, b = boxes_a.double().tolist(), boxes_b.double().tolist()
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                ans_iou[i, j] = oracle.rect_intersection(
                    (x[0], x[1], x[3], x[4], x[6]), (y[0], y[1], y[3], y[4], y[6])
                )

    _export(monkeypatch, ext, iou3d_boxes_overlap_bev_forward=iou3d_boxes_overlap_bev_forward)

    # mmcv/ops/iou3d.py (mmcv >= 1.6 / 2.x)
    iou3d = _module(monkeypatch, "mmcv.ops.iou3d")

    def boxes_overlap_bev(boxes_a, boxes_b):
        out = boxes_a.new_zeros((boxes_a.shape[0], boxes_b.shape[0]))
        sys.modules["mmcv._ext"].iou3d_boxes_overlap_bev_forward(boxes_a, boxes_b, out)
        return out

    def boxes_iou3d(boxes_a, boxes_b):  # mmcv's height rule over the _ext BEV overlap
        top_a, bot_a = boxes_a[:, 2] + boxes_a[:, 5] / 2, boxes_a[:, 2] - boxes_a[:, 5] / 2
        top_b, bot_b = boxes_b[:, 2] + boxes_b[:, 5] / 2, boxes_b[:, 2] - boxes_b[:, 5] / 2
        bev = boxes_a.new_zeros((boxes_a.shape[0], boxes_b.shape[0]))
        sys.modules["mmcv._ext"].iou3d_boxes_overlap_bev_forward(boxes_a, boxes_b, bev)
        h = torch.min(top_a[:, None], top_b[None]) - torch.max(bot_a[:, None], bot_b[None])
        ov = bev * h.clamp(min=0)
        vol_a = (boxes_a[:, 3] * boxes_a[:, 4] * boxes_a[:, 5])[:, None]
        vol_b = (boxes_b[:, 3] * boxes_b[:, 4] * boxes_b[:, 5])[None]
        return ov / torch.clamp(vol_a + vol_b - ov, min=1e-6)

    def boxes_iou_bev(boxes_a, boxes_b):
        a = [_xywhr(x) for x in boxes_a.double().tolist()]
        b = [_xywhr(y) for y in boxes_b.double().tolist()]
        return torch.tensor([[oracle.rotated_iou(x, y) for y in b] for x in a],
                            dtype=boxes_a.dtype).reshape(len(a), len(b))  # fmt: skip

    def nms_bev(boxes, scores, thresh, pre_max_size=None, post_max_size=None):
        return _nms_bev_standin(boxes, scores, thresh, pre_max_size, post_max_size)

    def nms3d(boxes, scores, iou_threshold):
        order = scores.sort(0, descending=True)[1].tolist()
        return torch.tensor(
            _greedy(boxes, order, oracle.iou3d_bev, iou_threshold), dtype=torch.long
        )

    def nms3d_normal(boxes, scores, iou_threshold):
        order = scores.sort(0, descending=True)[1].tolist()
        return torch.tensor(
            _greedy(boxes, order, oracle.iou_normal, iou_threshold), dtype=torch.long
        )

    mmcv_fns = dict(boxes_overlap_bev=boxes_overlap_bev, boxes_iou3d=boxes_iou3d,
                    boxes_iou_bev=boxes_iou_bev, nms_bev=nms_bev, nms3d=nms3d,
                    nms3d_normal=nms3d_normal, nms_normal_bev=_nms_normal_bev_standin)  # fmt: skip
    _export(monkeypatch, iou3d, **mmcv_fns)

    # mmcv/ops/box_iou_rotated.py: the function shadows its module in the mmcv.ops namespace
    bir = _module(monkeypatch, "mmcv.ops.box_iou_rotated")

    def box_iou_rotated(bboxes1, bboxes2, mode="iou", aligned=False, clockwise=True):
        a, b = bboxes1.double().clone(), bboxes2.double().clone()
        if not clockwise:
            a[:, 4], b[:, 4] = -a[:, 4], -b[:, 4]
        la, lb = a.tolist(), b.tolist()
        iof = mode == "iof"
        if aligned:
            vals = [oracle.rotated_iou(x, y, iof) for x, y in zip(la, lb)]
            return torch.tensor(vals, dtype=bboxes1.dtype).reshape(len(la))
        vals = [[oracle.rotated_iou(x, y, iof) for y in lb] for x in la]
        return torch.tensor(vals, dtype=bboxes1.dtype).reshape(len(la), len(lb))

    _export(monkeypatch, bir, box_iou_rotated=box_iou_rotated)

    # mmcv/ops/roiaware_pool3d.py, roipoint_pool3d.py
    roiaware = _module(monkeypatch, "mmcv.ops.roiaware_pool3d")
    roipoint = _module(monkeypatch, "mmcv.ops.roipoint_pool3d")

    class RoIAwarePool3d(torch.nn.Module):
        def __init__(self, out_size, max_pts_per_voxel=128, mode="max"):
            super().__init__()
            self.out_size, self.max_pts_per_voxel = out_size, max_pts_per_voxel
            assert mode in ["max", "avg"]
            self.mode = {"max": 0, "avg": 1}[mode]  # mmcv keeps the int

        def forward(self, rois, pts, pts_feature):
            return _roiaware_standin(
                rois, pts, pts_feature, self.out_size, self.max_pts_per_voxel, self.mode
            )

    class RoIPointPool3d(torch.nn.Module):
        def __init__(self, num_sampled_points=512):
            super().__init__()
            self.num_sampled_points = num_sampled_points

        def forward(self, points, point_features, boxes3d):
            return _roipoint_standin(points, point_features, boxes3d, self.num_sampled_points)

    _export(monkeypatch, roiaware, RoIAwarePool3d=RoIAwarePool3d)
    _export(monkeypatch, roipoint, RoIPointPool3d=RoIPointPool3d)
    _export(monkeypatch, ops, points_in_boxes_part=points_in_boxes_part,
            points_in_boxes_all=points_in_boxes_all, points_in_boxes_cpu=points_in_boxes_cpu,
            box_iou_rotated=box_iou_rotated, RoIAwarePool3d=RoIAwarePool3d,
            RoIPointPool3d=RoIPointPool3d, **mmcv_fns)  # fmt: skip

    # mmdet3d 1.x: mmdet3d/models/layers/box3d_nms.py (+ the package re-exports)
    def circle_nms(dets, thresh, post_max_size=83):
        return _circle_nms_py(dets, thresh, post_max_size)

    def nms_bev_1x(boxes, scores, thresh, pre_max_size=None, post_max_size=None):
        return _nms_bev_standin(boxes, scores, thresh, pre_max_size, post_max_size)

    nms_bev_1x.__name__ = "nms_bev"
    layers_nms = _module(monkeypatch, "mmdet3d.models.layers.box3d_nms")
    layers = _module(monkeypatch, "mmdet3d.models.layers", fresh=False)
    dispatcher = _NumbaDispatcher(circle_nms)
    for mod in (layers_nms, layers):
        _export(monkeypatch, mod, circle_nms=dispatcher, nms_bev=nms_bev_1x,
                nms_normal_bev=_nms_normal_bev_standin)  # fmt: skip

    # mmdet3d 0.x / 1.0.0rc: mmdet3d/core/post_processing/box3d_nms.py (other objects)
    def nms_bev_0x(boxes, scores, thresh, pre_max_size=None, post_max_size=None):
        return _nms_bev_standin(boxes, scores, thresh, pre_max_size, post_max_size)

    nms_bev_0x.__name__ = "nms_bev"
    dispatcher_0x = _NumbaDispatcher(lambda dets, thresh, post_max_size=83: None)
    dispatcher_0x.py_func = circle_nms  # the same body; a distinct dispatcher object
    core_nms = _module(monkeypatch, "mmdet3d.core.post_processing.box3d_nms")
    for name in ("mmdet3d.core.post_processing", "mmdet3d.core"):
        _module(monkeypatch, name, fresh=False)
    for mod in (core_nms, sys.modules["mmdet3d.core.post_processing"], sys.modules["mmdet3d.core"]):
        _export(monkeypatch, mod, circle_nms=dispatcher_0x, nms_bev=nms_bev_0x)

    # user modules that imported the names before the patcher ran
    head = _module(monkeypatch, "mmdet3d.models.dense_heads.centerpoint_head")
    _export(monkeypatch, head, circle_nms=dispatcher, nms_bev=nms_bev_1x)
    fork = _module(
        monkeypatch, "projects.plugin.fusion_head"
    )  # `from mmcv.ops import nms_bev as nms_gpu`
    _export(monkeypatch, fork, nms_gpu=nms_bev, points_in_boxes_all=points_in_boxes_all)

    # OpenPCDet
    pc_iou = _module(monkeypatch, "pcdet.ops.iou3d_nms.iou3d_nms_utils")

    def pc_boxes_iou_bev(boxes_a, boxes_b):
        a, b = boxes_a.double().tolist(), boxes_b.double().tolist()
        vals = [[oracle.iou3d_bev(x, y) for y in b] for x in a]
        return torch.tensor(vals, dtype=torch.float32).reshape(len(a), len(b))

    def boxes_bev_iou_cpu(boxes_a, boxes_b):
        is_numpy = isinstance(boxes_a, np.ndarray)
        a = torch.from_numpy(boxes_a) if is_numpy else boxes_a
        b = torch.from_numpy(boxes_b) if is_numpy else boxes_b
        out = pc_boxes_iou_bev(a, b).to(a.dtype)
        return out.numpy() if is_numpy else out

    def nms_gpu(boxes, scores, thresh, pre_maxsize=None, **kwargs):
        order = scores.sort(0, descending=True)[1]
        if pre_maxsize is not None:
            order = order[:pre_maxsize]
        keep = _greedy(boxes, order.tolist(), oracle.iou3d_bev, thresh)
        return torch.tensor(keep, dtype=torch.long), None

    def nms_normal_gpu(boxes, scores, thresh, **kwargs):
        order = scores.sort(0, descending=True)[1].tolist()
        return torch.tensor(
            _greedy(boxes, order, oracle.iou_normal, thresh), dtype=torch.long
        ), None

    def boxes_iou3d_gpu(boxes_a, boxes_b):
        raise AssertionError("declined: never patched, never called by these tests")

    _export(monkeypatch, pc_iou, boxes_iou_bev=pc_boxes_iou_bev,
            boxes_bev_iou_cpu=boxes_bev_iou_cpu, nms_gpu=nms_gpu,
            nms_normal_gpu=nms_normal_gpu, boxes_iou3d_gpu=boxes_iou3d_gpu)  # fmt: skip

    pc_roi = _module(monkeypatch, "pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils")

    def pc_points_in_boxes_cpu(points, boxes):
        is_numpy = isinstance(points, np.ndarray)
        p = (points.astype(np.float32) if is_numpy else points.float()).tolist()
        b = (boxes.astype(np.float32) if is_numpy else boxes.float()).tolist()
        out = torch.tensor([[int(_inside_pcdet(pt, bx)) for pt in p] for bx in b],
                           dtype=torch.int32).reshape(len(b), len(p))  # fmt: skip
        return out.numpy() if is_numpy else out

    def pc_points_in_boxes_gpu(points, boxes):
        out = torch.full(points.shape[:2], -1, dtype=torch.int32)
        p, bx = points.double().tolist(), boxes.double().tolist()
        for i in range(len(p)):
            for m, pt in enumerate(p[i]):
                hits = [t for t, box in enumerate(bx[i]) if _inside_pcdet(pt, box)]
                out[i, m] = hits[0] if hits else -1
        return out

    class PcdetRoIAwarePool3d(torch.nn.Module):  # OpenPCDet's own signature: declined
        def __init__(self, out_size, max_pts_each_voxel=128):
            super().__init__()

    _export(monkeypatch, pc_roi, points_in_boxes_cpu=pc_points_in_boxes_cpu,
            points_in_boxes_gpu=pc_points_in_boxes_gpu, RoIAwarePool3d=PcdetRoIAwarePool3d)  # fmt: skip

    return types.SimpleNamespace(
        ext=ext, ops=ops, pib=pib, iou3d=iou3d, bir=bir, roiaware=roiaware, roipoint=roipoint,
        layers_nms=layers_nms, layers=layers, core_nms=core_nms, head=head, fork=fork,
        pc_iou=pc_iou, pc_roi=pc_roi,
        originals={
            "mmcv.ops.points_in_boxes": dict(vars(pib)),
            "mmcv.ops.iou3d": dict(vars(iou3d)),
            "mmcv.ops": {k: getattr(ops, k) for k in [*mmcv_fns, "box_iou_rotated",
                         "RoIAwarePool3d", "RoIPointPool3d", "points_in_boxes_all"]},
            "mmcv._ext": {"iou3d_boxes_overlap_bev_forward": iou3d_boxes_overlap_bev_forward},
            "mmdet3d.models.layers": {"circle_nms": dispatcher, "nms_bev": nms_bev_1x},
            "mmdet3d.core": {"circle_nms": dispatcher_0x, "nms_bev": nms_bev_0x},
            "pcdet.ops.iou3d_nms.iou3d_nms_utils": dict(vars(pc_iou)),
            "pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils": dict(vars(pc_roi)),
        },
    )  # fmt: skip


@pytest.fixture
def up(monkeypatch):
    return install_box3d_upstream(monkeypatch)


def _status(results):
    return {r.name: r for r in results}


@pytest.fixture(scope="module")
def frame():
    return box_inputs.lidar_frame(300, 10, batch=2, seed=5)


@pytest.fixture(scope="module")
def dets():
    return box_inputs.detections(140, seed=23, extent=15.0)


# --------------------------------------------------------------------------- mechanics


def test_box3d_patches_are_default_and_declined_ones_are_absent():
    names = {p.name for p in default_patches()}
    assert BOX3D_PATCHES <= names
    assert not set(DECLINED) & names
    assert all(isinstance(r, str) and len(r) > 40 for r in DECLINED.values())
    assert all(
        p.enabled and p.precheck is not None for p in default_patches() if p.name in BOX3D_PATCHES
    )


def test_box3d_targets_aliases_rebinding_and_restore(up):
    patcher = default_patcher()
    results = _status(patcher.apply())
    assert all(results[n].status == "applied" for n in BOX3D_PATCHES), patcher.report()
    t = {n: set(results[n].targets) for n in BOX3D_PATCHES}
    assert t["mmcv.points_in_boxes_all"] == {
        "mmcv.ops.points_in_boxes.points_in_boxes_all",
        "mmcv.ops.points_in_boxes_all",
        "projects.plugin.fusion_head.points_in_boxes_all",
    }
    assert t["mmcv.nms_bev"] == {
        "mmcv.ops.iou3d.nms_bev", "mmcv.ops.nms_bev", "projects.plugin.fusion_head.nms_gpu",
    }  # fmt: skip
    assert t["mmcv.box_iou_rotated"] == {
        "mmcv.ops.box_iou_rotated.box_iou_rotated",
        "mmcv.ops.box_iou_rotated",
    }
    assert t["mmdet3d.circle_nms"] == {
        "mmdet3d.models.layers.box3d_nms.circle_nms",
        "mmdet3d.models.layers.circle_nms",
        "mmdet3d.models.dense_heads.centerpoint_head.circle_nms",
    }
    assert t["mmdet3d.core.nms_bev"] == {
        "mmdet3d.core.post_processing.box3d_nms.nms_bev",
        "mmdet3d.core.post_processing.nms_bev",
        "mmdet3d.core.nms_bev",
    }
    assert t["pcdet.nms_gpu"] == {"pcdet.ops.iou3d_nms.iou3d_nms_utils.nms_gpu"}
    assert up.ops.RoIAwarePool3d is up.roiaware.RoIAwarePool3d
    assert issubclass(up.roiaware.RoIAwarePool3d, up.originals["mmcv.ops"]["RoIAwarePool3d"])
    assert issubclass(up.ops.RoIPointPool3d, up.originals["mmcv.ops"]["RoIPointPool3d"])
    assert up.head.nms_bev is up.layers.nms_bev is up.layers_nms.nms_bev
    # declined call sites are left alone
    assert up.iou3d.nms_normal_bev is up.ops.nms_normal_bev is up.layers.nms_normal_bev
    assert up.iou3d.boxes_iou3d is up.originals["mmcv.ops.iou3d"]["boxes_iou3d"]  # via _ext
    assert (
        up.pc_iou.boxes_iou3d_gpu
        is up.originals["pcdet.ops.iou3d_nms.iou3d_nms_utils"]["boxes_iou3d_gpu"]
    )
    assert (
        up.pc_roi.RoIAwarePool3d
        is up.originals["pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils"]["RoIAwarePool3d"]
    )
    patcher.restore()
    for path, names in up.originals.items():
        mod = sys.modules[path]
        for name, value in names.items():
            assert getattr(mod, name) is value, f"{path}.{name} not restored"
    assert up.head.circle_nms is up.originals["mmdet3d.models.layers"]["circle_nms"]
    assert up.fork.nms_gpu is up.originals["mmcv.ops"]["nms_bev"]


def test_a_second_patcher_skips_the_box3d_replacements(up):
    with default_patcher():
        second = default_patcher()
        results = _status(second.apply())
        for n in BOX3D_PATCHES:
            assert results[n].status == "skipped", n
            assert "already replaced by muSPACE" in results[n].reason
        second.restore()


# (patch name, module, attribute, a stand-in with another upstream signature, reason fragment)
def _bad_function(*names):
    ns = {}
    exec(f"def f({', '.join(names)}):\n    raise AssertionError('not called')", ns)  # noqa: S102
    return ns["f"]


class _BadRoIAware(torch.nn.Module):
    def __init__(self, out_size, max_pts_each_voxel=128):  # OpenPCDet's names
        super().__init__()


class _BadRoIPoint(torch.nn.Module):
    def __init__(self, num_sampled_points=512, pool_extra_width=1.0):  # OpenPCDet's
        super().__init__()


WRONG_SIGNATURES = [
    ("mmcv.points_in_boxes_part", "mmcv.ops.points_in_boxes", "points_in_boxes_part",
     _bad_function("boxes", "points"), "(boxes, points) differs"),
    ("mmcv.points_in_boxes_all", "mmcv.ops.points_in_boxes", "points_in_boxes_all",
     _bad_function("points", "boxes", "out"), "(points, boxes, out) differs"),
    ("mmcv.points_in_boxes_cpu", "mmcv.ops.points_in_boxes", "points_in_boxes_cpu",
     _bad_function("pts", "boxes"), "(pts, boxes) differs"),
    ("mmcv.boxes_overlap_bev", "mmcv.ops.iou3d", "boxes_overlap_bev",
     _bad_function("boxes_a", "boxes_b", "mode"), "(boxes_a, boxes_b, mode) differs"),
    ("mmcv.boxes_iou_bev", "mmcv.ops.iou3d", "boxes_iou_bev",
     _bad_function("bboxes1", "bboxes2"), "(bboxes1, bboxes2) differs"),
    ("mmcv.nms_bev", "mmcv.ops.iou3d", "nms_bev",
     _bad_function("boxes", "scores", "thresh", "pre_maxsize", "post_max_size"), "pre_maxsize"),
    ("mmcv.nms3d", "mmcv.ops.iou3d", "nms3d",
     _bad_function("boxes", "scores", "thresh"), "(boxes, scores, thresh) differs"),
    ("mmcv.nms3d_normal", "mmcv.ops.iou3d", "nms3d_normal",
     _bad_function("boxes", "scores"), "(boxes, scores) differs"),
    ("mmcv._ext.iou3d_boxes_overlap_bev_forward", "mmcv._ext", "iou3d_boxes_overlap_bev_forward",
     _bad_function("boxes_a", "boxes_b"), "(boxes_a, boxes_b) differs"),
    ("mmcv.box_iou_rotated", "mmcv.ops.box_iou_rotated", "box_iou_rotated",
     _bad_function("bboxes1", "bboxes2", "mode", "is_aligned"), "is_aligned"),
    ("mmcv.RoIAwarePool3d", "mmcv.ops.roiaware_pool3d", "RoIAwarePool3d",
     _BadRoIAware, "(self, out_size, max_pts_each_voxel) differs"),
    ("mmcv.RoIPointPool3d", "mmcv.ops.roipoint_pool3d", "RoIPointPool3d",
     _BadRoIPoint, "pool_extra_width"),
    ("mmdet3d.nms_bev", "mmdet3d.models.layers.box3d_nms", "nms_bev",
     _bad_function("boxes", "scores", "thresh"), "(boxes, scores, thresh) differs"),
    ("mmdet3d.circle_nms", "mmdet3d.models.layers.box3d_nms", "circle_nms",
     _NumbaDispatcher(_bad_function("dets", "thresh", "post_max_size", "min_radius")), "min_radius"),
    ("mmdet3d.core.nms_bev", "mmdet3d.core.post_processing.box3d_nms", "nms_bev",
     _bad_function("boxes", "scores", "thresh", "post_max_size"), "(boxes, scores, thresh, post_max_size) differs"),
    ("mmdet3d.core.circle_nms", "mmdet3d.core.post_processing.box3d_nms", "circle_nms",
     _bad_function("dets", "thresh"), "(dets, thresh) differs"),
    ("pcdet.boxes_iou_bev", "pcdet.ops.iou3d_nms.iou3d_nms_utils", "boxes_iou_bev",
     _bad_function("boxes_a", "boxes_b", "ans_iou"), "ans_iou"),
    ("pcdet.boxes_bev_iou_cpu", "pcdet.ops.iou3d_nms.iou3d_nms_utils", "boxes_bev_iou_cpu",
     _bad_function("a", "b"), "(a, b) differs"),
    ("pcdet.nms_gpu", "pcdet.ops.iou3d_nms.iou3d_nms_utils", "nms_gpu",
     _bad_function("boxes", "scores", "thresh", "pre_maxsize", "post_maxsize"), "post_maxsize"),
    ("pcdet.nms_normal_gpu", "pcdet.ops.iou3d_nms.iou3d_nms_utils", "nms_normal_gpu",
     _bad_function("boxes", "scores", "thresh"), "(boxes, scores, thresh) differs"),
    ("pcdet.points_in_boxes_gpu", "pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils",
     "points_in_boxes_gpu", _bad_function("points", "boxes", "margin"), "margin"),
    ("pcdet.points_in_boxes_cpu", "pcdet.ops.roiaware_pool3d.roiaware_pool3d_utils",
     "points_in_boxes_cpu", _bad_function("boxes", "points"), "(boxes, points) differs"),
]  # fmt: skip


def test_every_box3d_patch_has_a_wrong_signature_case():
    assert {case[0] for case in WRONG_SIGNATURES} == BOX3D_PATCHES


@pytest.mark.parametrize(
    "name,module,attr,bad,needle", WRONG_SIGNATURES, ids=[c[0] for c in WRONG_SIGNATURES]
)
def test_box3d_prechecks_refuse_other_signatures(up, monkeypatch, name, module, attr, bad, needle):
    monkeypatch.setattr(sys.modules[module], attr, bad)
    with default_patcher() as patcher:
        r = _status(patcher.results())[name]
        assert r.status == "skipped" and "precheck failed" in r.reason, r
        assert needle in r.reason, r.reason
        assert getattr(sys.modules[module], attr) is bad


# --------------------------------------------------------------------------- numbers: mmcv


def test_points_in_boxes_patches_match_mmcv(up, frame):
    pts, bxs = frame
    want_all = up.ops.points_in_boxes_all(pts, bxs)
    want_part = up.ops.points_in_boxes_part(pts, bxs)
    assert want_all.sum() > 30  # the frame puts points into boxes
    with default_patcher():
        got_part = up.ops.points_in_boxes_part(pts, bxs)
        got_all = up.pib.points_in_boxes_all(pts, bxs)
        got_cpu = up.ops.points_in_boxes_cpu(pts.double(), bxs.double())  # mmcv: .float()
        via_fork = up.fork.points_in_boxes_all(pts, bxs)
    for got, want, shape in ((got_part, want_part, (2, 300)), (got_all, want_all, (2, 300, 10)),
                             (got_cpu, want_all, (2, 300, 10)), (via_fork, want_all, (2, 300, 10))):  # fmt: skip
        assert got.dtype == torch.int32 and got.shape == shape and torch.equal(got, want)
    assert torch.equal(got_part, mu_space.points_in_boxes_part(pts, bxs))


def test_iou3d_pairwise_patches_match_mmcv(up, dets):
    b, _ = dets
    a7, b7 = b[:40].double(), b[40:90].double()
    a5, b5 = box_inputs.xyxyr(a7), box_inputs.xyxyr(b7)
    want_ov = up.iou3d.boxes_overlap_bev(a7, b7)
    want_iou = up.iou3d.boxes_iou_bev(a5, b5)
    want_3d = up.iou3d.boxes_iou3d(a7, b7)
    with default_patcher() as patcher:
        got_ov = up.ops.boxes_overlap_bev(a7, b7)
        got_iou = up.iou3d.boxes_iou_bev(a5, b5)
        got_3d = up.ops.boxes_iou3d(a7, b7)  # not patched itself: its _ext call is
        got32 = up.ops.boxes_overlap_bev(a7.float(), b7.float())
        assert "mmcv._ext.iou3d_boxes_overlap_bev_forward" in patcher.report()
    assert got_ov.shape == (40, 50) and got_ov.dtype == torch.float64 and got_ov.sum() > 1
    assert_close(got_ov, want_ov, **F64)
    assert_close(got_iou, want_iou, **F64, name="boxes_iou_bev")
    assert_close(got_3d, want_3d, **F64, name="boxes_iou3d")
    assert torch.equal(got_ov, mu_space.boxes_overlap_bev(a7, b7))
    assert got32.dtype == torch.float32
    assert_close(got32.double(), want_ov, atol=1e-4, rtol=1e-4, name="float32")


@pytest.mark.parametrize("pre,post", [(None, None), (100, 20)])
def test_nms_patches_match_mmcv(up, dets, pre, post):
    b, s = dets
    b7 = b.double()
    b5 = box_inputs.xyxyr(b7)
    want_bev = up.ops.nms_bev(b5, s, 0.3, pre, post)
    want_3d = up.ops.nms3d(b7, s, 0.4)
    want_n = up.ops.nms3d_normal(b7, s, 0.25)
    with default_patcher():
        got_bev = up.iou3d.nms_bev(b5, s, 0.3, pre_max_size=pre, post_max_size=post)
        via_fork = up.fork.nms_gpu(b5, s, 0.3, pre, post)
        got_3d = up.ops.nms3d(b7, s, 0.4)
        got_n = up.iou3d.nms3d_normal(b7, s, iou_threshold=0.25)
    for got, want in (
        (got_bev, want_bev),
        (via_fork, want_bev),
        (got_3d, want_3d),
        (got_n, want_n),
    ):
        assert got.dtype == torch.int64 and got.dim() == 1 and got.tolist() == want.tolist()
    assert 5 < len(want_3d) < len(b) and torch.equal(got_3d, mu_space.nms3d(b7, s, 0.4))


def test_box_iou_rotated_patch_both_mmcv_signatures(up, dets, monkeypatch):
    b, _ = dets
    r1, r2 = box_inputs.xywhr(b[:30]).double(), box_inputs.xywhr(b[30:75]).double()
    want = up.ops.box_iou_rotated(r1, r2)
    want_ccw_iof = up.ops.box_iou_rotated(r1, r2, "iof", False, False)
    want_aligned = up.ops.box_iou_rotated(r1, r2[:30], aligned=True)
    with default_patcher():
        got = up.ops.box_iou_rotated(r1, r2)
        got_ccw_iof = up.ops.box_iou_rotated(r1, r2, mode="iof", clockwise=False)
        got_aligned = up.bir.box_iou_rotated(r1, r2[:30], "iou", True)
    assert got.shape == (30, 45) and got_aligned.shape == (30,) and got.dtype == torch.float64
    assert_close(got, want, **F64)
    assert_close(got_ccw_iof, want_ccw_iof, **F64, name="iof, clockwise=False")
    assert_close(got_aligned, want_aligned, **F64, name="aligned")

    def box_iou_rotated(bboxes1, bboxes2, mode="iou", aligned=False):  # early mmcv 1.x
        raise AssertionError("not called once patched")

    monkeypatch.setattr(up.bir, "box_iou_rotated", box_iou_rotated)
    with default_patcher() as patcher:
        assert _status(patcher.results())["mmcv.box_iou_rotated"].status == "applied"
        old = up.bir.box_iou_rotated(r1, r2, "iou", False)
        with pytest.raises(TypeError):
            up.bir.box_iou_rotated(r1, r2, clockwise=False)  # that version has none
    assert_close(old, want, **F64, name="early mmcv 1.x: clockwise=True")


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_roiaware_module_patch_matches_mmcv(up, mode):
    rois, pts = box_inputs.roi_inputs(400, 5, seed=8)
    rois, pts = rois.double(), pts.double()
    feats = torch.randn(400, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    want = up.roiaware.RoIAwarePool3d((3, 4, 2), 6, mode)(rois, pts, feats)
    with default_patcher():
        layer = up.ops.RoIAwarePool3d((3, 4, 2), 6, mode)
        assert layer.mode == {"max": 0, "avg": 1}[mode]  # mmcv's constructor ran
        assert isinstance(layer, up.originals["mmcv.ops"]["RoIAwarePool3d"])
        f = feats.clone().requires_grad_(True)
        got = layer(rois, pts, f)
        got.sum().backward()
    assert got.shape == (5, 3, 4, 2, 3) and got.dtype == torch.float64
    assert (want != 0).sum() > 20
    assert_close(got.detach(), want, **F64)
    assert f.grad.shape == feats.shape and f.grad.abs().sum() > 0  # differentiable as mmcv's


def test_roipoint_module_patch_matches_mmcv(up, frame):
    pts, bxs = frame
    feats = torch.randn(2, 300, 4, generator=torch.Generator().manual_seed(3))
    want = up.roipoint.RoIPointPool3d(16)(pts, feats, bxs)
    with default_patcher():
        layer = up.ops.RoIPointPool3d(16)
        assert isinstance(layer, up.originals["mmcv.ops"]["RoIPointPool3d"])
        got = layer(pts, feats, bxs)
    assert isinstance(got, tuple) and len(got) == 2
    assert got[0].shape == (2, 10, 16, 7) and got[0].dtype == torch.float32
    assert got[1].shape == (2, 10) and got[1].dtype == torch.int32
    assert torch.equal(got[1], want[1]) and (want[1] == 0).sum() > 3
    assert torch.equal(got[0], want[0])


# --------------------------------------------------------------------------- numbers: mmdet3d


@pytest.mark.parametrize("where", ["1.x", "0.x"])
def test_circle_nms_patch_matches_mmdet3d(up, dets, where):
    b, s = dets
    centres = torch.cat([b[:, :2], s[:, None]], 1).numpy()  # CenterPoint: .detach().cpu().numpy()
    owner = up.layers if where == "1.x" else sys.modules["mmdet3d.core"]
    want = owner.circle_nms(centres, 0.175 * 4, post_max_size=30)
    with default_patcher():
        got = owner.circle_nms(centres, 0.175 * 4, post_max_size=30)
        head = up.head if where == "1.x" else sys.modules["mmdet3d.core.post_processing"]
        from_head = head.circle_nms(centres, 0.7)  # `from ... import circle_nms` in a head
        on_tensor = owner.circle_nms(torch.from_numpy(centres), 0.7, 30)
    assert isinstance(got, list) and all(type(i) is int for i in got)
    assert got == want and 5 < len(got) <= 30
    assert torch.tensor(got, dtype=torch.long).tolist() == want  # CenterPoint's wrapping
    assert from_head == _circle_nms_py(centres, 0.7)
    assert isinstance(on_tensor, torch.Tensor) and on_tensor.tolist() == want


@pytest.mark.parametrize("where", ["1.x", "0.x"])
def test_mmdet3d_nms_bev_patch_matches_mmdet3d(up, dets, where):
    b, s = dets
    b5 = box_inputs.xyxyr(b.double())
    owner = up.layers_nms if where == "1.x" else up.core_nms
    want = owner.nms_bev(b5, s, 0.2, 120, 40)
    with default_patcher():
        got = owner.nms_bev(b5, s, 0.2, pre_max_size=120, post_max_size=40)
        via = (up.head if where == "1.x" else sys.modules["mmdet3d.core"]).nms_bev(
            b5, s, 0.2, 120, 40
        )
    assert got.dtype == torch.int64 and got.tolist() == want.tolist() == via.tolist()


# --------------------------------------------------------------------------- numbers: OpenPCDet


def test_pcdet_iou_and_nms_patches_match_openpcdet(up, dets):
    b, s = dets
    b7 = b.double()
    want_iou = up.pc_iou.boxes_iou_bev(b7[:30], b7[30:70])
    want_keep, _ = up.pc_iou.nms_gpu(b7, s, 0.5, pre_maxsize=100)
    want_n, _ = up.pc_iou.nms_normal_gpu(b7, s, 0.3)
    want_cpu = up.pc_iou.boxes_bev_iou_cpu(b7[:10].numpy(), b7[10:20].numpy())
    with default_patcher():
        got_iou = up.pc_iou.boxes_iou_bev(b7[:30], b7[30:70])
        keep, second = up.pc_iou.nms_gpu(b7, s, 0.5, pre_maxsize=100, some_cfg_key=1)
        keep_n, second_n = up.pc_iou.nms_normal_gpu(b7, s, 0.3)
        got_cpu = up.pc_iou.boxes_bev_iou_cpu(b7[:10].numpy(), b7[10:20].numpy())
    assert got_iou.shape == (30, 40)
    assert_close(got_iou, want_iou.double(), atol=1e-6, rtol=1e-6)  # upstream: float32 out
    assert second is None and second_n is None
    assert keep.dtype == torch.int64 and keep.tolist() == want_keep.tolist()
    assert keep_n.tolist() == want_n.tolist() and len(keep_n) > 5
    assert isinstance(got_cpu, np.ndarray) and np.allclose(got_cpu, want_cpu, atol=1e-9)
    assert torch.equal(keep, pcdet_ops.nms_gpu(b7, s, 0.5, 100)[0])


def _centre_z(boxes):
    out = boxes.clone()
    out[..., 2] = boxes[..., 2] + boxes[..., 5] / 2  # OpenPCDet's boxes: z at the centre
    return out


def test_pcdet_points_in_boxes_patches_match_openpcdet(up, frame):
    pts, bxs = frame
    cbx = _centre_z(bxs)
    want_gpu = up.pc_roi.points_in_boxes_gpu(pts, cbx)
    want_cpu = up.pc_roi.points_in_boxes_cpu(pts[0].numpy(), cbx[0].numpy())
    with default_patcher():
        got_gpu = up.pc_roi.points_in_boxes_gpu(pts, cbx)
        got_cpu = up.pc_roi.points_in_boxes_cpu(pts[0].numpy(), cbx[0].numpy())
        got_cpu_t = up.pc_roi.points_in_boxes_cpu(pts[0].double(), cbx[0].double())
    assert got_gpu.dtype == torch.int32 and got_gpu.shape == (2, 300)
    assert torch.equal(got_gpu, want_gpu) and (want_gpu >= 0).sum() > 30
    assert isinstance(got_cpu, np.ndarray) and got_cpu.shape == (10, 300)
    assert got_cpu.dtype == np.int32 and np.array_equal(got_cpu, want_cpu)
    assert torch.equal(got_cpu_t, torch.from_numpy(want_cpu))


def test_pcdet_points_in_boxes_margin_is_a_documented_difference(up):
    """OpenPCDet counts a point up to 1e-5 m outside an x / y face as inside (MARGIN); the
    patch (mu_space.ops.pcdet, mmcv's strict test) does not (docs/patcher.md, Limits)."""
    box = torch.tensor([[[0.0, 0.0, 0.0, 2.0, 4.0, 2.0, 0.0]]], dtype=torch.float64)  # z centre
    pts = torch.tensor(
        [[[1.0 + 5e-6, 0.0, 0.0], [0.999, 0.0, 0.0], [1.01, 0.0, 0.0]]], dtype=torch.float64
    )
    want = up.pc_roi.points_in_boxes_gpu(pts, box)
    with default_patcher():
        got = up.pc_roi.points_in_boxes_gpu(pts, box)
    assert want.tolist() == [[0, 0, -1]]
    assert got.tolist() == [[-1, 0, -1]]  # only the point in the 1e-5 band differs
