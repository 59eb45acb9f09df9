"""mmcv-lite 2.1.0 (pure Python, no compiled ops) on the muSPACE mmcv._ext surrogate: the name
list against the installed wheel, `import mmcv.ops`, mmcv's own availability checks, and mmcv's
Python wrappers (which allocate the outputs and call the extension) giving mmcv's results.
Install: pip install -e ".[mmdet3d]" (docs/compat_mmcv.md); skipped without mmcv."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import mu_space
from mu_space.compat import mmcv as compat
from mu_space.testing import boxes as box_inputs
from mu_space.testing import msda_inputs

mmcv = pytest.importorskip("mmcv", reason="mmcv(-lite) not installed: pip install -e '.[mmdet3d]'")
if getattr(mmcv, "__version__", "") != compat.MMCV_VERSION:  # pragma: no cover
    pytest.skip(
        f"the surrogate's names are mmcv {compat.MMCV_VERSION}'s, installed: {mmcv.__version__}",
        allow_module_level=True,
    )
if compat._hook.compiled_ext() is not None:  # pragma: no cover
    pytest.skip("a compiled mmcv._ext is installed (full mmcv)", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    compat.install()
    import mmcv.ops

    yield mmcv.ops
    compat.uninstall()  # mmcv.ops' modules keep their ext_module (the surrogate)


def test_names_are_the_installed_mmcv_ones():
    root = Path(mmcv.__file__).parent
    asked = set()
    for path in (root / "ops").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "load_ext"
                and len(node.args) == 2
                and isinstance(node.args[1], ast.List)
            ):
                asked |= {e.value for e in node.args[1].elts}
    assert asked == set(compat.ALL_NAMES)
    pybind = root / "ops" / "csrc" / "pytorch" / "pybind.cpp"
    if pybind.exists():  # mmcv-lite ships the sources: the keyword names of every binding
        body = pybind.read_text()
        body = body[body.index("PYBIND11_MODULE") :]
        seen = set()
        for d in re.findall(r"m\.def\((.*?)\);", body, re.S):
            name = re.match(r'\s*"(\w+)"', d).group(1)
            if name in seen:  # a second overload (knn_forward): calls match the first
                continue
            seen.add(name)
            assert tuple(re.findall(r'py::arg\("(\w+)"\)', d)) == compat._names.SIGNATURES[name]


def test_mmcv_sees_its_ops(ops):
    from mmcv.utils.ext_loader import check_ops_exist
    from mmengine.utils.dl_utils import mmcv_full_available

    assert check_ops_exist() and mmcv_full_available()
    assert mmcv._ext is compat.surrogate()
    assert ops.get_compiler_version().startswith("muSPACE")


def test_mmcv_nms_wrappers(ops):
    boxes, scores = box_inputs.detections(160, seed=21, extent=20.0)
    xyxy = torch.cat([boxes[:, :2] - boxes[:, 3:5] / 2, boxes[:, :2] + boxes[:, 3:5] / 2], 1)
    dets, keep = ops.nms(xyxy, scores, 0.5)
    assert dets.shape == (keep.numel(), 5) and torch.equal(dets[:, 4], scores[keep])
    assert torch.all(scores[keep][1:] <= scores[keep][:-1])
    rdets, rkeep = ops.nms_rotated(box_inputs.xywhr(boxes), scores, 0.3)
    assert rdets.shape == (rkeep.numel(), 6)
    iou = mu_space.ops.box_iou_rotated(
        box_inputs.xywhr(boxes[rkeep]), box_inputs.xywhr(boxes[rkeep])
    )
    assert not torch.any(iou.triu(1) > 0.3)
    assert torch.equal(ops.nms3d(boxes, scores, 0.3), mu_space.ops.nms3d(boxes, scores, 0.3))
    assert torch.equal(
        ops.nms3d_normal(boxes, scores, 0.3), mu_space.ops.nms3d_normal(boxes, scores, 0.3)
    )
    a = box_inputs.xywhr(boxes[:30])
    assert torch.equal(ops.box_iou_rotated(a, a), mu_space.ops.box_iou_rotated(a, a))
    assert torch.equal(
        ops.box_iou_rotated(a, a, clockwise=False),
        mu_space.ops.box_iou_rotated(a, a, clockwise=False),
    )


def test_mmcv_points_and_voxels(ops):
    pts, boxes = box_inputs.lidar_frame(4000, 10, batch=2, seed=8)
    if torch.cuda.is_available():  # mmcv's part / all wrappers move the inputs to the GPU
        pts, boxes = pts.cuda(), boxes.cuda()
        want_part = mu_space.ops.points_in_boxes_part(pts, boxes)
        assert torch.equal(ops.points_in_boxes_part(pts, boxes), want_part)
        assert torch.equal(
            ops.points_in_boxes_all(pts, boxes), mu_space.ops.points_in_boxes_all(pts, boxes)
        )
        pts, boxes = pts.cpu(), boxes.cpu()
    assert torch.equal(
        ops.points_in_boxes_cpu(pts, boxes), mu_space.ops.points_in_boxes_all(pts, boxes)
    )
    from mu_space.testing import lidar

    cfg = lidar.VOXEL_CONFIGS["tiny-pillars"]
    points = cfg.points()
    layer = ops.Voxelization(cfg.voxel_size, cfg.point_cloud_range, cfg.max_num_points, 400)
    v, c, n = layer(points)
    want = mu_space.ops.voxelization(points, cfg.voxel_size, cfg.point_cloud_range,
                                     cfg.max_num_points, 400)  # fmt: skip
    for got, w in zip((v, c, n), want):
        assert torch.equal(got, w)
    scatter = ops.DynamicScatter(cfg.voxel_size, cfg.point_cloud_range, True)
    coors = mu_space.ops.dynamic_voxelize(points, cfg.voxel_size, cfg.point_cloud_range)
    feats = points.clone().requires_grad_(True)
    out, out_c = scatter(feats, coors)
    out.sum().backward()
    assert torch.isfinite(feats.grad).all() and out_c.shape[0] == out.shape[0]


def test_mmcv_roi_pooling_with_gradients(ops):
    rois, pts = box_inputs.roi_inputs(1500, 5, seed=2)
    for mode in ("max", "avg"):
        feats = torch.randn(1500, 4, requires_grad=True)
        pool = ops.RoIAwarePool3d((3, 4, 2), 12, mode)
        out = pool(rois, pts, feats)
        ref_feats = feats.detach().clone().requires_grad_(True)
        want = mu_space.ops.roiaware_pool3d(rois, pts, ref_feats, (3, 4, 2), 12, mode)
        assert torch.equal(out, want)
        g = torch.randn_like(out)
        (out * g).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(feats.grad, ref_feats.grad, atol=1e-5, rtol=1e-5)
    p, b = box_inputs.lidar_frame(1000, 6, batch=1, seed=3)
    f = torch.randn(1, 1000, 2)
    pooled, empty = ops.RoIPointPool3d(32)(p, f, b)
    want = mu_space.ops.roipoint_pool3d(p, f, b, 32)
    assert torch.equal(pooled, want[0]) and torch.equal(empty, want[1])


def test_mmcv_msda_function(ops):
    inputs = msda_inputs.make("tiny", dtype=torch.float64, seed=5, requires_grad=True)
    args = msda_inputs.args(inputs)
    out = ops.multi_scale_deform_attn.MultiScaleDeformableAttnFunction.apply(*args, 64)
    want = mu_space.ops.multi_scale_deformable_attn(*args)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [args[0], args[3], args[4]], g)
    ref = torch.autograd.grad(want, [args[0], args[3], args[4]], g)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_mmcv_sigmoid_focal_loss(ops):
    """mmcv's SigmoidFocalLossFunction (what mmdet's FocalLoss calls for CUDA tensors) on the
    surrogate: the mean loss and its gradient equal mmdet's pure-PyTorch formula's
    (py_sigmoid_focal_loss, written out here: mmdet is not needed)."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(64, 10, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
    target = torch.randint(0, 11, (64,), generator=g)  # 10: background
    loss = ops.sigmoid_focal_loss(x, target, 2.0, 0.25, None, "mean")
    onehot = (target[:, None] == torch.arange(10)[None]).double()
    p = x.sigmoid()
    pt = (1 - p) * onehot + p * (1 - onehot)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(x, onehot, reduction="none")
    want = (bce * (0.25 * onehot + 0.75 * (1 - onehot)) * pt.pow(2.0)).sum() / 64
    torch.testing.assert_close(loss, want)
    got, ref = torch.autograd.grad(loss, x)[0], torch.autograd.grad(want, x)[0]
    torch.testing.assert_close(got, ref)
