"""The factored BEVFusion vtransform recipe (model_examples/BEVFusion/scripts/
bevfusion_factored_vtransform.py): pooling depth and context with bev_pool_v2 gives what the
upstream formulation (materialised product + bev_pool) gives, on a grid whose x and y sizes and
ranges differ (a swapped axis would fail), and the script passes and catches a wrong result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

import mu_space
from mu_space.testing import bev_geometry

SCRIPT = (
    Path(__file__).resolve().parents[1]
    / "model_examples"
    / "BEVFusion"
    / "scripts"
    / "bevfusion_factored_vtransform.py"
)


def _load():
    spec = importlib.util.spec_from_file_location("model_example_bevfusion_factored", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_factored_equals_materialised_on_a_non_square_grid():
    script = _load()
    base = bev_geometry.CONFIGS["tiny"]
    # x: 24 cells of 0.5 m from -6 m; y: 14 cells of 0.75 m from -5 m; two z cells
    cfg = bev_geometry.BEVConfig(
        **{**base.__dict__, "x": (-6.0, 6.0, 0.5), "y": (-5.0, 5.5, 0.75), "z": (-4.0, 4.0, 4.0)}
    )
    assert cfg.grid_size[0] != cfg.grid_size[1]
    inputs = script.upstream_form.make_inputs(cfg, 8, "cpu", seed=3)
    outs = {}
    for cls in (script.FactoredLSSVTransform, script.upstream_form.LSSVTransform):
        torch.manual_seed(0)
        module = cls(cfg, 8, "reference")
        img = inputs["img_feat"].clone().requires_grad_(True)
        bev = module(img, inputs["geom"])["bev"]
        (bev * torch.linspace(-1, 1, bev.numel()).view_as(bev)).sum().backward()
        outs[cls.__name__] = (bev.detach(), img.grad, module.depthnet.weight.grad)
    nx, ny, nz = cfg.grid_size
    factored, materialised = outs["FactoredLSSVTransform"], outs["LSSVTransform"]
    assert factored[0].shape == (1, cfg.channels * nz, nx, ny)  # BEVFusion's x-major layout
    assert materialised[0].abs().sum() > 0 and (materialised[0] != 0).float().mean() > 0.05
    for a, b in zip(factored, materialised):  # float32 sums of the same products (see script)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_script_passes_and_catches_a_wrong_pool(monkeypatch, capsys):
    script = _load()
    args = ["--device", "cpu", "--small", "--warmup", "0", "--reps", "1"]
    assert script.main(args) == 0
    assert "PASS" in capsys.readouterr().out
    pool = mu_space.bev_pool_v2
    monkeypatch.setattr(mu_space, "bev_pool_v2", lambda *a, **k: pool(*a, **k) * 1.001)
    assert script.main(args) == 1
    assert "FAIL" in capsys.readouterr().out
