"""model_examples/_mmdet3d_run.py (issue 14's GPU figures: native vs reference losses and
gradients, a training run, step and predict times of mmdet3d's own PointPillars / CenterPoint)
in its CPU smoke mode: every stage runs, reference against reference is exact, the loss falls,
the JSON and the markdown table are written; and its comparison catches a wrong gradient.

PointPillars ~1-3 min on 2 cores; CenterPoint only with MUSPACE_SLOW_MODEL_RUNS=1 (its CPU
reference sparse convolutions take ~8 min on 2 cores; CI, which sets MUSPACE_SLOW_MODEL_TESTS=1,
already runs CenterPoint's loss + backward + predict in test_mmdet3d_models.py). Skipped where
mmdet3d is absent."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from mu_space.compat import mmcv as compat
from mu_space.testing import mmdet3d_models as m3d

RUNNER = Path(__file__).resolve().parents[2] / "model_examples" / "_mmdet3d_run.py"


def _load():
    spec = importlib.util.spec_from_file_location("mmdet3d_run_under_test", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def runner():
    yield _load()
    compat.install(backend="auto")  # the runner leaves the surrogate on its last backend
    compat.uninstall()


def _needs_mmdet3d():
    reason = m3d.missing()
    if reason:
        pytest.skip(reason)
    if compat._hook.compiled_ext() is not None:  # pragma: no cover
        pytest.skip("a compiled mmcv._ext is installed (full mmcv)")


def _smoke(runner, model, tmp_path):
    _needs_mmdet3d()
    argv = ["--model", model, "--smoke", "--device", "cpu", "--out", str(tmp_path)]
    status = runner.main(argv + ["--frame-cache", str(tmp_path / "frames")])
    assert [p.name for p in (tmp_path / "frames").iterdir()] == ["nus-1sweep-seed0.pt"]
    result = json.loads((tmp_path / f"{model}.json").read_text())
    table = (tmp_path / f"{model}.md").read_text()
    assert status == 0, result["problems"]
    assert result["ok"] and not result["problems"]
    assert result["backend"] == result["baseline"] == "reference" and result["smoke"]
    vs = result["compare"]["vs_baseline"]
    # the same path twice on the CPU: bit-identical, every loss term and gradient tensor
    assert vs["ok"] and vs["worst_loss_rel"] == 0 and vs["whole_grad_rel"] == 0
    assert vs["grad_tensors"] > 50 and not vs["grad_failures"]
    assert "loss loss" in {r["what"] for r in vs["loss_rows"]}  # the total, then each term
    losses = result["train"]["losses"]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert result["train"]["falls"] and losses[-1] < losses[0]
    timing = result["timing"]
    for key in ("train_ms", "predict_ms"):
        assert set(timing[key]) == {"a", "b"} and all(v > 0 for v in timing[key].values())
    assert len(timing["train_steps_ms"]["a"]) == 2 and len(timing["train_steps_ms"]["b"]) == 1
    for frame in result["predict_compare"]["frames"]:  # the same path: the same boxes
        assert 0 < frame["boxes_a"] == frame["boxes_b"] <= 500
        assert frame["max_box_diff"] == 0 and frame["labels_equal"]
    assert result["compare"]["ext_calls"]["hard_voxelize_forward"] == 1
    assert result["compare"]["dispatch_backend"]["voxelization"] == {"reference (requested)": 1}
    assert "| training step" in table and "| predict" in table and "**PASS**" in table
    assert "Smoke run" in table
    return result


def test_pointpillars_smoke(runner, tmp_path):
    result = _smoke(runner, "pointpillars", tmp_path)
    assert {"loss_cls", "loss_bbox", "loss_dir"} <= {
        r["what"].removeprefix("loss ") for r in result["compare"]["vs_baseline"]["loss_rows"]
    }


@pytest.mark.skipif(
    os.environ.get("MUSPACE_SLOW_MODEL_RUNS", "") != "1",
    reason="CenterPoint 0.075 through the whole runner on the CPU reference paths takes ~8 min "
    "on 2 cores: set MUSPACE_SLOW_MODEL_RUNS=1 to run it",
)
def test_centerpoint_smoke(runner, tmp_path):
    result = _smoke(runner, "centerpoint", tmp_path)
    calls = result["compare"]["ext_calls"]
    assert calls["indice_conv_forward"] == calls["indice_conv_backward"] > 0
    assert "sparse_conv" in result["compare"]["dispatch_backend"]


def _fake_run(grads, terms):
    return {"terms": dict(terms), "grads": {k: v.clone() for k, v in grads.items()}}


def test_comparison_catches_wrong_losses_and_gradients(runner):
    g = torch.Generator().manual_seed(0)
    grads = {f"layer{i}.weight": torch.randn(64, 32, generator=g) for i in range(20)}
    grads["bn.bias"] = torch.zeros(64)  # cancelled by a following batch norm
    terms = {"loss": 2.5, "loss_cls": 1.5, "loss_bbox": 1.0}
    tol = runner.TOLERANCES["pointpillars"]
    ref = _fake_run(grads, terms)
    assert runner.compare_runs(_fake_run(grads, terms), ref, tol)["ok"]

    near = _fake_run(grads, terms)  # rounding-level noise, also on the ~0 gradient
    near["grads"]["layer3.weight"] *= 1 + 1e-7
    near["grads"]["bn.bias"] += 1e-9
    assert runner.compare_runs(near, ref, tol)["ok"]

    off = _fake_run(grads, terms)  # one tensor 1e-3 off
    off["grads"]["layer7.weight"] *= 1 + 1e-3
    out = runner.compare_runs(off, ref, tol)
    assert not out["ok"] and out["grad_failures"][0]["param"] == "layer7.weight"
    assert out["worst_grad"]["param"] == "layer7.weight"

    lossy = _fake_run(grads, terms)
    lossy["terms"]["loss_cls"] *= 1 + 1e-4
    assert not runner.compare_runs(lossy, ref, tol)["ok"]

    gone = _fake_run(grads, terms)
    del gone["grads"]["layer0.weight"]
    assert not runner.compare_runs(gone, ref, tol)["ok"]

    nan = _fake_run(grads, terms)
    nan["grads"]["layer1.weight"][0, 0] = float("nan")
    assert not runner.compare_runs(nan, ref, tol)["ok"]


def test_loss_falls_rule(runner):
    assert runner._falls([3.0, 2.0, 1.0])[0]
    assert not runner._falls([1.0, 1.2, 1.1])[0]
    assert not runner._falls([3.0, float("nan"), 1.0])[0]
    falls, ratio = runner._falls([4.0] + [2.0] * 49)  # the mean of the last 5 over the first
    assert falls and ratio == 0.5


def test_frame_cache_gives_the_same_frame(runner, tmp_path):
    _needs_mmdet3d()
    m3d.setup()  # mmdet3d.structures imports mmcv.ops (the runner fixture uninstalls it)
    want, sample = m3d.frame("tiny", 4, seed=2)
    for _ in range(2):  # written, then read
        got, again = m3d.frame("tiny", 4, seed=2, cache=tmp_path)
        assert torch.equal(got, want)
        assert torch.equal(
            again.gt_instances_3d.bboxes_3d.tensor, sample.gt_instances_3d.bboxes_3d.tensor
        )
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-seed2.pt"]
