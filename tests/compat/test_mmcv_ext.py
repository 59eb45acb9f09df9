"""The mmcv._ext surrogate (mu_space.compat.mmcv) on its own: every name, mmcv's keyword names,
idempotent install, the import machinery mmcv checks, call-time errors, the report, the .pth
hook, and each served function against an independent statement of mmcv's contract (outputs
written in place into the caller's buffers, dtypes, shapes, return values). Needs no mmcv:
tests/compat/test_mmcv_upstream.py runs mmcv's own Python wrappers on it."""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import mu_space
from mu_space.compat import mmcv as compat
from mu_space.compat.mmcv import _hook, _served
from mu_space.testing import boxes as box_inputs
from mu_space.testing import msda_inputs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_mmcv(monkeypatch):
    """An empty `mmcv` package in sys.modules (no real mmcv needed), the surrogate installed
    onto it; everything removed afterwards."""
    pkg = types.ModuleType("mmcv")
    pkg.__path__ = []
    pkg.__spec__ = importlib.util.spec_from_loader("mmcv", loader=None, is_package=True)
    monkeypatch.setitem(sys.modules, "mmcv", pkg)
    monkeypatch.delitem(sys.modules, "mmcv._ext", raising=False)
    report = compat.install()
    report.reset()
    yield pkg
    compat.uninstall()


@pytest.fixture
def ext(fake_mmcv):
    return sys.modules["mmcv._ext"]


# --------------------------------------------------------------------------- names and install


def test_every_mmcv_name_with_mmcv_keyword_names(ext):
    assert len(compat.ALL_NAMES) == 112
    for name in compat.ALL_NAMES:
        fn = getattr(ext, name)
        assert tuple(inspect.signature(fn).parameters) == compat._names.SIGNATURES[name], name
        assert fn.__doc__.startswith(f"{name}(")  # pybind11-style first line, as the real one
    for name in (
        "hard_voxelize_forward",
        "dynamic_voxelize_forward",
        "dynamic_point_to_voxel_forward",
        "dynamic_point_to_voxel_backward",
        "points_in_boxes_part_forward",
        "points_in_boxes_all_forward",
        "iou3d_boxes_overlap_bev_forward",
        "iou3d_nms3d_forward",
        "iou3d_nms3d_normal_forward",
        "nms",
        "nms_rotated",
        "box_iou_rotated",
        "roiaware_pool3d_forward",
        "roiaware_pool3d_backward",
        "ms_deform_attn_forward",
        "ms_deform_attn_backward",
        "sigmoid_focal_loss_forward",
        "sigmoid_focal_loss_backward",
    ):
        assert name in compat.SERVED_NAMES, name


def test_install_is_idempotent_and_importable(fake_mmcv):
    first = sys.modules["mmcv._ext"]
    report = compat.install()
    assert compat.install(backend="reference") is report and report.backend == "reference"
    compat.install()
    assert sys.modules["mmcv._ext"] is first is compat.surrogate() is fake_mmcv._ext
    assert sum(getattr(f, "MU_SPACE_MMCV_EXT", False) for f in sys.meta_path) == 1
    # what mmcv's check_ops_exist() / mmengine's mmcv_full_available() ask
    assert first.__spec__ is not None and first.__spec__.loader is not None
    assert importlib.util.find_spec("mmcv._ext").loader is not None
    assert importlib.import_module("mmcv._ext") is first


def test_hook_serves_the_first_import(monkeypatch):
    """mmcv imported after install(): the finder serves `import mmcv._ext` (mmcv.ops' load_ext)
    and binds it on mmcv, one object as before."""
    monkeypatch.delitem(sys.modules, "mmcv", raising=False)
    monkeypatch.delitem(sys.modules, "mmcv._ext", raising=False)
    compat.install()
    try:
        pkg = types.ModuleType("mmcv")
        pkg.__path__ = []
        monkeypatch.setitem(sys.modules, "mmcv", pkg)
        spec = importlib.util.find_spec("mmcv._ext")
        assert spec is not None and spec.loader is not None
        ext = importlib.import_module("mmcv._ext")
        assert ext is compat.surrogate() and pkg._ext is ext
        assert compat.report().status == "installed"
    finally:
        compat.uninstall()


def test_compiled_ext_is_left_alone(monkeypatch, tmp_path):
    pkg_dir = tmp_path / "mmcv"
    pkg_dir.mkdir()
    (pkg_dir / "__init__.py").write_text("")
    (pkg_dir / "_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    pkg = types.ModuleType("mmcv")
    pkg.__path__ = [str(pkg_dir)]
    pkg.__spec__ = importlib.util.spec_from_file_location(
        "mmcv", pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    monkeypatch.setitem(sys.modules, "mmcv", pkg)
    monkeypatch.delitem(sys.modules, "mmcv._ext", raising=False)
    try:
        report = compat.install()
        assert report.status == "skipped" and "compiled mmcv._ext" in report.reason
        assert "mmcv._ext" not in sys.modules
        assert compat.install(force=True).status == "installed"
        assert sys.modules["mmcv._ext"] is compat.surrogate()
    finally:
        compat.uninstall()


def test_bad_arguments(fake_mmcv):
    with pytest.raises(ValueError, match="backend"):
        compat.install(backend="gpu")
    with pytest.raises(TypeError, match="force"):
        compat.install(force=1)


def test_not_served_raises_at_call_time_naming_the_op(ext):
    # attribute access (what load_ext checks) is fine; the call raises
    fn = ext.softmax_focal_loss_forward
    with pytest.raises(NotImplementedError, match="softmax_focal_loss_forward") as info:
        fn(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), 2.0, 0.25)
    assert "docs/operator_matrix.md" in str(info.value)
    assert isinstance(info.value, compat.NotServedError)


def test_sparse_names_route_or_say_why(ext):
    for name in compat.SPARSE_NAMES:
        assert callable(getattr(ext, name))
    if _served.sparse_function("get_indice_pairs_3d_forward") is None:
        with pytest.raises(NotImplementedError, match="mu_space.sparse.mmcv_ext"):
            ext.get_indice_pairs_3d_forward(
                torch.zeros(0, 4, dtype=torch.int32), 1, [1, 1, 1], [1, 1, 1],
                [3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0], 1, 0,
            )  # fmt: skip


def test_sparse_names_take_the_surrogates_backend(ext):
    """The sparse functions run their muSPACE ops with the surrogate's backend: "reference"
    requested is recorded as such (on a GPU it is how the reference is forced)."""
    from mu_space.runtime import kernel_dispatch

    if _served.sparse_function("indice_conv_forward") is None:
        pytest.skip("mu_space.sparse.mmcv_ext is not in this checkout")
    idx = torch.tensor([[0, 1, 1, 1], [0, 1, 2, 1], [1, 0, 0, 0]], dtype=torch.int32)
    feats = torch.randn(3, 2)
    args = (idx, 2, [3, 3, 3], [3, 3, 3], [3, 3, 3], [1] * 3, [1] * 3, [1] * 3, [0] * 3, 1, 0)
    for backend, want in (("reference", {"requested"}), ("auto", set())):
        compat.install(backend=backend)
        kernel_dispatch.reset()
        _, pairs, num = ext.get_indice_pairs_3d_forward(*args)
        ext.indice_conv_forward(feats, torch.randn(3, 3, 3, 2, 4), pairs, num, 3, 0, 1)
        reasons = {
            r["reason"]
            for r in kernel_dispatch.records()
            if r["op"] in ("sparse_rulebook", "sparse_conv")
        }
        ops = {r["op"] for r in kernel_dispatch.records()}
        assert {"sparse_rulebook", "sparse_conv"} <= ops
        if want:
            assert reasons == want, kernel_dispatch.report()
        else:  # auto on the CPU: the reference with the fallback's reason, not "requested"
            assert reasons and "requested" not in reasons, kernel_dispatch.report()
    compat.install(backend="auto")


def test_keywords_and_report(ext):
    boxes, scores = box_inputs.detections(40, seed=3)
    xyxy = torch.cat([boxes[:, :2] - boxes[:, 3:5] / 2, boxes[:, :2] + boxes[:, 3:5] / 2], 1)
    a = ext.nms(xyxy, scores, iou_threshold=0.5, offset=0)
    b = ext.nms(boxes=xyxy, scores=scores, iou_threshold=0.5, offset=0)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"mmcv._ext.nms\(\)"):
        ext.nms(xyxy, scores, threshold=0.5, offset=0)
    report = compat.report()
    assert report.calls["nms"] == 2
    text = report.report()
    assert "nms " in text and "2 calls" in text and "of 112 served" in text
    assert set(report.served) | set(report.not_served) == set(compat.ALL_NAMES)
    assert ext.report() is report


def test_patcher_skips_the_surrogate(ext):
    """default_patcher() on top of the surrogate: its mmcv._ext patches see muSPACE functions
    and skip (no double wrapping)."""
    from mu_space.patcher import Patcher, default_patches

    wanted = [p for p in default_patches() if p.target.startswith("mmcv._ext.")]
    results = Patcher(wanted).apply()
    assert results and all(r.status == "skipped" for r in results)
    assert all("already replaced by muSPACE" in r.reason for r in results)


def test_pth_hook_line(tmp_path):
    """The shipped .pth line, run by `site` in a fresh interpreter: off without the variable,
    the finder at the front of sys.meta_path with it, mu_space / torch not imported by it."""
    pth = (ROOT / "mu_space_mmcv_ext.pth").read_text()
    assert pth.startswith("import ") and pth.count("\n") <= 1  # one executable .pth line
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "mu_space_mmcv_ext.pth").write_text(pth)
    probe = (
        "import site, sys; site.addsitedir(sys.argv[1]); "
        "print(any(getattr(f, 'MU_SPACE_MMCV_EXT', False) for f in sys.meta_path), "
        "'torch' in sys.modules, 'mu_space' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != compat.ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for value, want in (("", "False False False"), ("1", "True False False")):
        env[compat.ENV] = value
        out = subprocess.run(
            [sys.executable, "-c", probe, str(site_dir)],
            env=env, capture_output=True, text=True, check=True, cwd=tmp_path,
        )  # fmt: skip
        assert out.stdout.strip() == want, out.stderr


def test_environment_values(monkeypatch):
    for value, want in (("", None), ("0", None), ("off", None), ("1", "1"), ("force", "force")):
        monkeypatch.setenv(compat.ENV, value)
        assert _hook.enabled_by_environment() == want


# --------------------------------------------------------------------------- served functions


def _xyxy(boxes7):
    return torch.cat([boxes7[:, :2] - boxes7[:, 3:5] / 2, boxes7[:, :2] + boxes7[:, 3:5] / 2], 1)


def _greedy(order, suppress):
    """The textbook greedy NMS over a boolean [N, N] 'i suppresses j' matrix."""
    kept, dead = [], set()
    for i in order.tolist():
        if i in dead:
            continue
        kept.append(i)
        dead |= {j for j in order.tolist() if bool(suppress[i, j])}
    return torch.tensor(kept, dtype=torch.long)


@pytest.mark.parametrize("offset", [0, 1])
def test_nms_2d(ext, offset):
    boxes, scores = box_inputs.detections(150, seed=7, extent=20.0)
    xyxy = _xyxy(boxes) * 10  # pixel-like units (offset 1 matters)
    keep = ext.nms(xyxy, scores, 0.4, offset)
    assert keep.dtype == torch.int64
    x1, y1, x2, y2 = xyxy.double().unbind(1)
    area = (x2 - x1 + offset) * (y2 - y1 + offset)
    w = (torch.min(x2[:, None], x2) - torch.max(x1[:, None], x1) + offset).clamp(min=0)
    h = (torch.min(y2[:, None], y2) - torch.max(y1[:, None], y1) + offset).clamp(min=0)
    iou = w * h / (area[:, None] + area - w * h)
    want = _greedy(scores.sort(descending=True)[1], iou > 0.4)
    assert torch.equal(keep, want)


@pytest.mark.parametrize("multi_label", [False, True])
def test_nms_rotated(ext, multi_label):
    boxes, scores = box_inputs.detections(120, seed=5, extent=20.0)
    dets = box_inputs.xywhr(boxes)
    labels = (torch.arange(120) % 3).int()
    order = scores.sort(0, descending=True)[1]
    dets_wl = torch.cat([dets, labels[:, None].float()], 1) if multi_label else dets
    keep = ext.nms_rotated(
        dets_wl, scores, order, dets_wl[order], labels if multi_label else labels[:0],
        0.3, int(multi_label),
    )  # fmt: skip
    assert keep.dtype == torch.int64
    iou = mu_space.ops.box_iou_rotated(dets, dets)
    suppress = iou > 0.3
    if multi_label:
        suppress &= labels[:, None] == labels[None, :]
    assert torch.equal(keep, _greedy(order, suppress))


@pytest.mark.parametrize("normal", [False, True])
def test_iou3d_nms(ext, normal):
    boxes, scores = box_inputs.detections(200, seed=2, extent=25.0)
    order = scores.sort(0, descending=True)[1]
    sorted_boxes = boxes[order].contiguous()
    keep = torch.zeros(200, dtype=torch.long)
    num_out = torch.zeros((), dtype=torch.long)
    fn = ext.iou3d_nms3d_normal_forward if normal else ext.iou3d_nms3d_forward
    assert fn(sorted_boxes, keep, num_out, nms_overlap_thresh=0.25) is None
    k = int(num_out)
    want = (mu_space.ops.nms3d_normal if normal else mu_space.ops.nms3d)(boxes, scores, 0.25)
    assert torch.equal(order[keep[:k]], want)
    assert torch.all(keep[k:] == 0)  # untouched past num_out


def test_boxes_overlap_bev(ext):
    a, b = box_inputs.lidar_boxes(30, seed=1), box_inputs.lidar_boxes(20, seed=2)
    out = torch.zeros(30, 20)
    ext.iou3d_boxes_overlap_bev_forward(a, b, out)
    assert torch.equal(out, mu_space.ops.boxes_overlap_bev(a, b))
    inter = (
        mu_space.ops.box_iou_rotated(box_inputs.xywhr(a), box_inputs.xywhr(b), "iof")
        * (a[:, 3] * a[:, 4])[:, None]
    )  # iof = overlap / area_a
    torch.testing.assert_close(out, inter, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("mode_flag", [0, 1])
def test_box_iou_rotated(ext, aligned, mode_flag):
    a = box_inputs.xywhr(box_inputs.lidar_boxes(25, seed=3, extent=8.0))
    b = box_inputs.xywhr(box_inputs.lidar_boxes(25 if aligned else 17, seed=4, extent=8.0))
    ious = torch.zeros(a.shape[0] if aligned else a.shape[0] * b.shape[0])
    ext.box_iou_rotated(a, b, ious, mode_flag, aligned)
    want = mu_space.ops.box_iou_rotated(a, b, "iof" if mode_flag else "iou", aligned)
    assert torch.equal(ious, want.reshape(-1))


def test_points_in_boxes(ext):
    pts, boxes = box_inputs.lidar_frame(3000, 12, batch=2, seed=4)
    part = torch.full((2, 3000), -1, dtype=torch.int32)  # mmcv's Python: new_zeros(...).fill_(-1)
    ext.points_in_boxes_part_forward(boxes, pts, part)
    every = torch.zeros(2, 3000, 12, dtype=torch.int32)
    ext.points_in_boxes_all_forward(boxes, pts, every)
    assert part.dtype == every.dtype == torch.int32
    first = torch.where(every.any(-1), every.argmax(-1), -1).int()
    assert torch.equal(part, first) and (part >= 0).sum() > 100
    one = torch.zeros(12, 3000, dtype=torch.int32)
    ext.points_in_boxes_cpu_forward(boxes[1], pts[1], one)
    assert torch.equal(one, every[1].T)


def test_hard_and_dynamic_voxelize(ext):
    from mu_space.testing import lidar

    cfg = lidar.VOXEL_CONFIGS["tiny-voxels"]
    points = cfg.points()
    vs = torch.tensor(cfg.voxel_size)
    cr = torch.tensor(cfg.point_cloud_range)
    max_points, max_voxels = cfg.max_num_points, cfg.max_voxels[0]
    voxels = points.new_zeros(max_voxels, max_points, points.shape[1])
    coors = points.new_zeros(max_voxels, 3, dtype=torch.int32)
    num = points.new_zeros(max_voxels, dtype=torch.int32)
    voxel_num = points.new_zeros(1, dtype=torch.int32)
    assert ext.hard_voxelize_forward(
        points, vs, cr, voxels, coors, num, voxel_num, max_points, max_voxels, 3, True
    ) is None  # fmt: skip
    m = int(voxel_num)
    v, c, k = mu_space.ops.voxelization(points, cfg.voxel_size, cfg.point_cloud_range,
                                        max_points, max_voxels, True)  # fmt: skip
    assert m == v.shape[0] > 0
    assert torch.equal(voxels[:m], v) and torch.equal(coors[:m], c) and torch.equal(num[:m], k)
    assert not voxels[m:].any() and not num[m:].any()
    dyn = points.new_zeros(points.shape[0], 3, dtype=torch.int32)
    ext.dynamic_voxelize_forward(points, vs, cr, dyn, 3)
    assert torch.equal(dyn, mu_space.ops.dynamic_voxelize(points, cfg.voxel_size,
                                                          cfg.point_cloud_range))  # fmt: skip
    with pytest.raises(NotImplementedError, match="NDim"):
        ext.dynamic_voxelize_forward(points, vs, cr, dyn, 2)


def test_dynamic_point_to_voxel(ext):
    g = torch.Generator().manual_seed(0)
    coors = torch.randint(0, 6, (500, 3), generator=g, dtype=torch.int32)
    coors[::17] = -1  # dropped points
    feats = torch.randn(500, 4, generator=g, dtype=torch.float64)
    for reduce in ("max", "mean", "sum"):
        out, vc, p2v, cnt = ext.dynamic_point_to_voxel_forward(feats, coors, reduce)
        want, want_c = mu_space.ops.dynamic_scatter(feats, coors, reduce)
        assert torch.equal(out, want) and torch.equal(vc, want_c)
        grad_out = torch.randn_like(out)
        grad = torch.zeros_like(feats)
        ext.dynamic_point_to_voxel_backward(grad, grad_out, feats, out, p2v, cnt, reduce)
        f = feats.clone().requires_grad_(True)
        (mu_space.ops.dynamic_scatter(f, coors, reduce)[0] * grad_out).sum().backward()
        torch.testing.assert_close(grad, f.grad)


@pytest.mark.parametrize("pool_method", [0, 1])
def test_roiaware_pool3d(ext, pool_method):
    rois, pts = box_inputs.roi_inputs(2000, 6, seed=1)
    feats = torch.randn(2000, 5, dtype=torch.float32)
    out, max_pts = (4, 5, 3), 16
    n, c = rois.shape[0], feats.shape[1]
    pooled = feats.new_zeros(n, *out, c)
    argmax = feats.new_zeros(n, *out, c, dtype=torch.int)
    idx = feats.new_zeros(n, *out, max_pts, dtype=torch.int)
    ext.roiaware_pool3d_forward(rois, pts, feats, argmax, idx, pooled, pool_method)
    mode = "max" if pool_method == 0 else "avg"
    f = feats.clone().requires_grad_(True)
    want = mu_space.ops.roiaware_pool3d(rois, pts, f, out, max_pts, mode)
    assert torch.equal(pooled, want.detach())
    # mmcv's voxel lists: slot 0 the count (<= max_pts - 1), then ascending point indices
    count = idx[..., 0]
    assert count.max() <= max_pts - 1 and count.sum() > 0
    lists = idx[..., 1:]
    slot = torch.arange(max_pts - 1)
    used = slot < count[..., None]
    assert not lists[~used].any()
    inc = lists[..., 1:] > lists[..., :-1]
    assert torch.all(inc | ~used[..., 1:])
    if pool_method == 0:  # argmax: a listed point holding the maximum, -1 for empty voxels
        empty = count == 0
        assert torch.all(argmax[empty] == -1)
        got = feats[argmax[~empty].long(), torch.arange(c).expand(int((~empty).sum()), c)]
        assert torch.equal(got, pooled[~empty])
    grad_out = torch.randn_like(pooled)
    grad_in = feats.new_zeros(2000, c)
    ext.roiaware_pool3d_backward(idx, argmax, grad_out, grad_in, pool_method)
    (want * grad_out).sum().backward()
    torch.testing.assert_close(grad_in, f.grad, atol=1e-5, rtol=1e-5)


def test_roipoint_pool3d(ext):
    pts, boxes = box_inputs.lidar_frame(1500, 8, batch=2, seed=9)
    feats = torch.randn(2, 1500, 3)
    pooled = feats.new_zeros(2, 8, 64, 6)
    empty = feats.new_zeros(2, 8, dtype=torch.int)
    ext.roipoint_pool3d_forward(pts, boxes, feats, pooled, empty)
    want, want_empty = mu_space.ops.roipoint_pool3d(pts, feats, boxes, 64)
    assert torch.equal(pooled, want) and torch.equal(empty, want_empty)


def test_ms_deform_attn(ext):
    inputs = msda_inputs.make("tiny", dtype=torch.float64, seed=3, requires_grad=True)
    args = msda_inputs.args(inputs)
    out = ext.ms_deform_attn_forward(*args, im2col_step=64)
    assert not out.requires_grad
    want = mu_space.ops.multi_scale_deformable_attn(*args)
    torch.testing.assert_close(out, want.detach())
    grad_out = torch.randn_like(want)
    grads = torch.autograd.grad(want, [args[0], args[3], args[4]], grad_out)
    bufs = [torch.zeros_like(args[i]) for i in (0, 3, 4)]
    ext.ms_deform_attn_backward(*[a.detach() for a in args], grad_out, *bufs, 64)
    for buf, g in zip(bufs, grads):
        torch.testing.assert_close(buf, g)


def _focal_autograd(x, target, gamma, alpha, weight=None):
    """The sigmoid focal loss written out (binary cross-entropy with logits, modulated), the
    gradient from autograd: an independent statement of mmcv's kernels for |x| < 80."""
    x = x.detach().double().requires_grad_(True)
    c = x.shape[1]
    onehot = (target[:, None] == torch.arange(c)[None]).double()
    p = torch.sigmoid(x)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(x, onehot, reduction="none")
    pt = (1 - p) * onehot + p * (1 - onehot)
    loss = bce * (alpha * onehot + (1 - alpha) * (1 - onehot)) * pt.pow(gamma)
    if weight is not None:
        loss = loss * weight.double()[target][:, None]
    (grad,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), grad


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (1.5, 0.5), (0.0, 0.75)])
def test_sigmoid_focal_loss(ext, gamma, alpha, weighted):
    g = torch.Generator().manual_seed(5)
    n, c = 300, 10
    x = torch.randn(n, c, generator=g) * 6
    x[0, :3] = torch.tensor([0.0, 40.0, -40.0])
    target = torch.randint(0, c if weighted else c + 1, (n,), generator=g)  # c: background
    target[:5] = torch.tensor([0, 1, 2, c - 1, 0 if weighted else c])
    weight = torch.rand(c, generator=g) + 0.5 if weighted else torch.empty(0)
    want, want_grad = _focal_autograd(x, target, gamma, alpha, weight if weighted else None)
    out = torch.full_like(x, float("nan"))
    grad = torch.full_like(x, float("nan"))
    assert ext.sigmoid_focal_loss_forward(x, target, weight, out, gamma=gamma, alpha=alpha) is None
    ext.sigmoid_focal_loss_backward(x, target, weight, grad, gamma, alpha)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-6)
    x64, out64 = x.double(), torch.zeros(n, c, dtype=torch.float64)
    ext.sigmoid_focal_loss_forward(x64, target, weight.double(), out64, gamma, alpha)
    torch.testing.assert_close(out64, want, rtol=1e-12, atol=1e-12)


def test_sigmoid_focal_loss_floor_and_errors(ext):
    """mmcv's kernels floor log p and log(1 - p) at log(FLT_MIN): a logit of -200 at the
    target class costs alpha * 87.34, not alpha * 200."""
    x = torch.tensor([[-200.0, 200.0]])
    out = torch.zeros_like(x)
    ext.sigmoid_focal_loss_forward(x, torch.tensor([0]), torch.empty(0), out, 0.0, 0.25)
    floor = -math.log(torch.finfo(torch.float32).tiny)
    torch.testing.assert_close(out, torch.tensor([[0.25 * floor, 0.75 * floor]]))
    with pytest.raises(ValueError, match="target must be int64"):
        ext.sigmoid_focal_loss_forward(x, torch.tensor([0], dtype=torch.int32), x[:0], out, 2, 0.25)
    with pytest.raises(ValueError, match="<= 2"):
        ext.sigmoid_focal_loss_forward(x, torch.tensor([3]), torch.empty(0), out, 2.0, 0.25)
    with pytest.raises(ValueError, match="with a weight"):
        ext.sigmoid_focal_loss_forward(x, torch.tensor([2]), torch.ones(2), out, 2.0, 0.25)
    with pytest.raises(ValueError, match="buffer"):
        ext.sigmoid_focal_loss_backward(x, torch.tensor([0]), torch.empty(0), out[:, :1], 2, 0.25)


def test_reference_backend_is_the_same_on_cpu(ext):
    boxes, scores = box_inputs.detections(100, seed=11)
    dets = box_inputs.xywhr(boxes)
    order = scores.sort(0, descending=True)[1]
    auto = ext.nms_rotated(dets, scores, order, dets[order], scores.new_empty(0).int(), 0.2, 0)
    compat.install(backend="reference")
    ref = ext.nms_rotated(dets, scores, order, dets[order], scores.new_empty(0).int(), 0.2, 0)
    compat.install(backend="auto")
    assert torch.equal(auto, ref)
