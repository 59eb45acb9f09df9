"""The off-by-default `bevfusion.factored_lss.*` patches (mu_space/patcher/patches.py): BEVFusion's
LSS / DepthLSS vtransform pooled from depth and context without their product. Checked on
stand-ins of both upstream layouts (mmdet3d 1.x projects/BEVFusion/bevfusion/depth_lss.py and MIT
BEVFusion's mmdet3d/models/vtransforms/), written from upstream's rules: get_cam_feats lifts
`softmax(depth) (outer) context` to [B, N, D, H, W, C]; bev_pool drops points outside the grid
of `((geom - (bx - dx / 2)) / dx).long()` and sums each (x, y, z, b) cell, z folded into C."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from mu_space.patcher import default_patcher
from mu_space.testing import bev_geometry

PROJECTS = "projects.BEVFusion.bevfusion.depth_lss"
MIT = ("mmdet3d.models.vtransforms.base", "mmdet3d.models.vtransforms.lss")
MIT_DEPTH = "mmdet3d.models.vtransforms.depth_lss"
FACTORED = "bevfusion.factored_lss.*"
# a non-square grid (x 20 cells, y 14, z 2), so that a swapped axis changes the result
CFG = bev_geometry.BEVConfig(
    **{
        **bev_geometry.CONFIGS["tiny"].__dict__,
        "name": "tiny-rect",
        "batch": 2,
        "y": (-28.0, 28.0, 4.0),
        "z": (-5.0, 3.0, 4.0),
    }
)
IN_CHANNELS = 6
# float32 sums of the same depth * context products in another order: ~1e-7 relative
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _upstream_bev_pool(x, geom_feats, B, D, H, W):
    """BEVFusion's bev_pool op: rows of x summed into out[b, :, z, x, y]."""
    B, D, H, W = (int(v) for v in (B, D, H, W))
    g = geom_feats.long()
    cell = ((g[:, 3] * D + g[:, 2]) * H + g[:, 0]) * W + g[:, 1]
    out = torch.zeros(B * D * H * W, x.shape[1], dtype=x.dtype).index_add(0, cell, x)
    return out.view(B, D, H, W, -1).permute(0, 4, 1, 2, 3)


def _stand_ins(get_cam_feats_of_depth_lss=None) -> dict[str, type]:
    """Fresh upstream-like classes (patching edits class attributes)."""

    class BaseTransform(nn.Module):
        def __init__(self, cfg: bev_geometry.BEVConfig):
            super().__init__()
            bounds = (cfg.x, cfg.y, cfg.z)
            self.dx = nn.Parameter(torch.tensor([b[2] for b in bounds]), requires_grad=False)
            self.bx = nn.Parameter(
                torch.tensor([b[0] + b[2] / 2.0 for b in bounds]), requires_grad=False
            )
            self.nx = nn.Parameter(
                torch.tensor([int((b[1] - b[0]) / b[2]) for b in bounds]), requires_grad=False
            )
            self.D, self.C = cfg.n_depth, cfg.channels
            self.fp16_enabled = False

        def bev_pool(self, geom_feats, x):
            B, N, D, H, W, C = x.shape
            n = B * N * D * H * W
            x = x.reshape(n, C)
            cells = ((geom_feats - (self.bx - self.dx / 2.0)) / self.dx).long().view(n, 3)
            batch = torch.arange(B).repeat_interleave(n // B)[:, None]
            cells = torch.cat((cells, batch), 1)
            kept = ((cells[:, :3] >= 0) & (cells[:, :3] < self.nx)).all(dim=1)
            out = _upstream_bev_pool(x[kept], cells[kept], B, self.nx[2], self.nx[0], self.nx[1])
            return torch.cat(out.unbind(dim=2), 1)

    def lift(self, x, B, N, fH, fW):
        depth = x[:, : self.D].softmax(dim=1)
        x = depth.unsqueeze(1) * x[:, self.D : (self.D + self.C)].unsqueeze(2)
        return x.view(B, N, self.C, self.D, fH, fW).permute(0, 1, 3, 4, 5, 2)

    class LSSTransform(BaseTransform):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.depthnet = nn.Conv2d(IN_CHANNELS, self.D + self.C, 1)

        def get_cam_feats(self, x):
            B, N, C, fH, fW = x.shape
            return lift(self, self.depthnet(x.view(B * N, C, fH, fW)), B, N, fH, fW)

    class DepthLSSTransform(BaseTransform):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.dtransform = nn.Sequential(nn.Conv2d(1, 4, 1), nn.ReLU(True), nn.Conv2d(4, 8, 1))
            self.depthnet = nn.Sequential(
                nn.Conv2d(IN_CHANNELS + 8, IN_CHANNELS, 3, padding=1),
                nn.ReLU(True),
                nn.Conv2d(IN_CHANNELS, self.D + self.C, 1),
            )

        def get_cam_feats(self, x, d):
            B, N, C, fH, fW = x.shape
            d = self.dtransform(d.view(B * N, *d.shape[2:]))
            x = self.depthnet(torch.cat([d, x.view(B * N, C, fH, fW)], dim=1))
            return lift(self, x, B, N, fH, fW)

    if get_cam_feats_of_depth_lss is not None:
        DepthLSSTransform.get_cam_feats = get_cam_feats_of_depth_lss
    return {
        "BaseTransform": BaseTransform,
        "LSSTransform": LSSTransform,
        "DepthLSSTransform": DepthLSSTransform,
    }


def _install(monkeypatch, layout: str, classes: dict[str, type] | None = None):
    """The stand-in classes at the layout's module paths (fresh modules, parents linked)."""
    classes = classes or _stand_ins()
    paths = (
        dict.fromkeys(classes, PROJECTS)
        if layout == "projects"
        else {"BaseTransform": MIT[0], "LSSTransform": MIT[1], "DepthLSSTransform": MIT_DEPTH}
    )
    made: dict[str, types.ModuleType] = {}
    for cls_name, path in paths.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in made:
                made[name] = types.ModuleType(name)
                monkeypatch.setitem(sys.modules, name, made[name])
                if i > 1:
                    setattr(made[".".join(parts[: i - 1])], parts[i - 1], made[name])
        setattr(made[path], cls_name, classes[cls_name])
    return classes


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, n, (h, w) = CFG.batch, CFG.cameras, CFG.feature_hw
    img = torch.randn(b, n, IN_CHANNELS, h, w, generator=g)
    depth_map = torch.rand(b, n, 1, h, w, generator=g) * 40
    geom = bev_geometry.frustum_points(CFG, jitter=0.02, generator=g)
    return img, depth_map, geom


def _run(module, img, depth_map, geom, with_depth: bool):
    img = img.clone().requires_grad_(True)
    x = module.get_cam_feats(img, depth_map) if with_depth else module.get_cam_feats(img)
    bev = module.bev_pool(geom, x)
    (bev * torch.linspace(-1, 1, bev.numel()).view_as(bev)).sum().backward()
    grads = [img.grad] + [p.grad for p in module.parameters() if p.requires_grad]
    return bev.detach(), grads


@pytest.mark.parametrize("layout", ["projects", "mit"])
@pytest.mark.parametrize("cls_name", ["LSSTransform", "DepthLSSTransform"])
def test_factored_pool_equals_upstream(monkeypatch, layout, cls_name):
    classes = _install(monkeypatch, layout)
    img, depth_map, geom = _inputs()
    with_depth = cls_name == "DepthLSSTransform"
    torch.manual_seed(0)
    expected = _run(classes[cls_name](CFG), img, depth_map, geom, with_depth)
    patcher = default_patcher(backend="reference").enable(FACTORED)
    with patcher:
        results = {r.name: r for r in patcher.results()}
        prefix = "bevfusion.factored_lss" + ("" if layout == "projects" else ".mit")
        for name in ("bev_pool", "LSSTransform", "DepthLSSTransform"):
            assert results[f"{prefix}.{name}"].status == "applied", results[f"{prefix}.{name}"]
        torch.manual_seed(0)
        module = classes[cls_name](CFG)
        x = module.get_cam_feats(img, depth_map) if with_depth else module.get_cam_feats(img)
        assert type(x).__name__ == "FactoredFrustum"  # no [B, N, D, H, W, C] product
        got = _run(module, img, depth_map, geom, with_depth)
    nx, ny, nz = CFG.grid_size
    assert nx != ny and got[0].shape == (CFG.batch, CFG.channels * nz, nx, ny)
    assert (expected[0] != 0).float().mean() > 0.05  # the rig covers the grid
    torch.testing.assert_close(got[0], expected[0], **TOL)
    assert len(got[1]) == len(expected[1]) > 2
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    # restored: upstream again
    torch.manual_seed(0)
    assert torch.equal(
        _run(classes[cls_name](CFG), img, depth_map, geom, with_depth)[0], expected[0]
    )


@pytest.mark.parametrize(
    "enabled", ["bevfusion.factored_lss.bev_pool", "bevfusion.factored_lss.DepthLSSTransform"]
)
def test_each_half_alone_keeps_upstream_results(monkeypatch, enabled):
    """get_cam_feats multiplies unless the factored bev_pool is in place; bev_pool passes a
    tensor to the original: either patch alone gives upstream's result and types."""
    classes = _install(monkeypatch, "projects")
    img, depth_map, geom = _inputs(1)
    torch.manual_seed(0)
    expected = _run(classes["DepthLSSTransform"](CFG), img, depth_map, geom, True)
    with default_patcher(backend="reference").enable(enabled) as patcher:
        assert {r.name for r in patcher.results() if r.status == "applied"} >= {enabled}
        torch.manual_seed(0)
        module = classes["DepthLSSTransform"](CFG)
        assert isinstance(module.get_cam_feats(img, depth_map), torch.Tensor)
        got = _run(module, img, depth_map, geom, True)
    torch.testing.assert_close(got[0], expected[0], **TOL)


def test_off_by_default_and_other_signatures_are_skipped(monkeypatch):
    def get_cam_feats(self, x, d, mats_dict):  # a BEVFusion version with mats_dict
        raise AssertionError("not called")

    _install(monkeypatch, "projects", _stand_ins(get_cam_feats))
    with default_patcher(backend="reference") as patcher:
        results = {r.name: r for r in patcher.results()}
    assert all(results[n].status == "disabled" for n in results if "factored_lss" in n)
    with default_patcher(backend="reference").enable(FACTORED) as patcher:
        results = {r.name: r for r in patcher.results()}
    assert results["bevfusion.factored_lss.bev_pool"].status == "applied"
    skipped = results["bevfusion.factored_lss.DepthLSSTransform"]
    assert skipped.status == "skipped" and "(self, x, d, mats_dict)" in skipped.reason
    assert results["bevfusion.factored_lss.mit.bev_pool"].status == "skipped"  # not installed


def test_enable_and_disable_take_star_patterns():
    patcher = default_patcher()
    names = {p.name for p in patcher.patches if p.name.startswith("bevfusion.factored_lss")}
    assert len(names) == 6
    patcher.enable("bevfusion.factored_lss.*")
    assert all(p.enabled for p in patcher.patches if p.name in names)
    patcher.disable("bevfusion.factored_lss.mit.*")
    assert {p.name for p in patcher.patches if p.name in names and p.enabled} == {
        n for n in names if ".mit." not in n
    }
    with pytest.raises(KeyError, match="no patch named 'nothing.\\*'"):
        patcher.enable("nothing.*")
