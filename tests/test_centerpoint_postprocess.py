"""model_examples/CenterPoint/scripts/centerpoint_postprocess.py keeps working: its --smoke run
on the CPU (reference vs reference: native kernels do not run on the CPU) passes both paths, a
deliberately wrong backend A is caught on each path, `native` on the CPU is a clear error, and
the synthetic heads decode to boxes at the objects they were drawn from (the coder's
coordinate convention). The same script runs on the GPU (native vs reference, the nuScenes 0.075
shapes) from the README's command."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import mu_space

SCRIPT = (
    Path(__file__).resolve().parents[1]
    / "model_examples"
    / "CenterPoint"
    / "scripts"
    / "centerpoint_postprocess.py"
)
SMOKE = ["--device", "cpu", "--smoke", "--warmup", "0", "--reps", "1"]


def _load():
    spec = importlib.util.spec_from_file_location("recipe_centerpoint_postprocess", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_smoke_run_passes_both_paths(capsys):
    assert _load().main(SMOKE) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "MISMATCH" not in out
    for stage in (
        "NMS 'circle'",
        "NMS 'rotate'",
        "points_in_boxes_all",
        "points_in_boxes_part",
        "boxes_overlap_bev",
        "ObjectSample",
    ):
        assert stage in out, stage


def _off_when_auto(monkeypatch, name, change):
    original = getattr(mu_space, name)

    def wrong(*args, backend="auto", **kwargs):
        out = original(*args, backend="reference", **kwargs)
        return change(out) if backend == "auto" else out

    monkeypatch.setattr(mu_space, name, wrong)


@pytest.mark.parametrize(
    "path, op, change",
    [
        ("postprocess", "circle_nms", lambda keep: keep[:-1]),
        ("postprocess", "nms_bev", lambda keep: keep.flip(0)),
        ("gt-sampling", "points_in_boxes_part", lambda part: torch.where(part == 0, -1, part)),
        ("gt-sampling", "boxes_overlap_bev", lambda ov: ov * (1 + 1e-3)),
    ],
)
def test_a_wrong_backend_is_caught(path, op, change, monkeypatch, capsys):
    """Backend A ("auto", the reference on the CPU) gets an operator with a wrong result: the
    script must report the mismatch and exit 1."""
    _off_when_auto(monkeypatch, op, change)
    status = _load().main([*SMOKE, "--path", path, "--backend", "auto"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "MISMATCH" in out and "FAIL" in out


def test_native_on_cpu_is_a_clear_error():
    with pytest.raises(mu_space.DispatchError):
        _load().main([*SMOKE, "--path", "postprocess", "--backend-a", "native"])


def test_heads_decode_to_the_objects_they_were_drawn_from():
    """The strongest candidate of every car decodes to within a cell (0.6 m) of the car's centre
    with its size to 15%: the heatmap / regression maps and the decoder agree on the layout
    ([B, C, y, x], out_size_factor x voxel_size per cell, log sizes, atan2(sin, cos))."""
    m = _load()
    cfg = m.PostCfg()
    boxes = torch.tensor(
        [
            [10.3, -20.7, -1.8, 4.6, 1.9, 1.7, 0.4],
            [-30.1, 5.2, -1.8, 4.4, 2.0, 1.6, -2.0],
            [44.0, 44.0, -1.8, 4.8, 1.9, 1.5, 3.0],
        ]
    )
    labels = torch.zeros(3, dtype=torch.long)  # car: task 0
    heads = m.make_heads([(boxes, labels)], cfg, seed=0)
    (dets,) = m.decode(heads[0], cfg)
    keep = mu_space.circle_nms(
        torch.cat([dets[0][:, :2], dets[1][:, None]], 1), cfg.min_radius[0], backend="reference"
    )
    found = dets[0][keep]
    for box in boxes:
        d = (found[:, :2] - box[:2]).norm(dim=1)
        best = found[d.argmin()]
        assert float(d.min()) < 0.6, (box, found[:5])
        assert torch.allclose(best[3:6], box[3:6], rtol=0.15)
        yaw_err = torch.remainder(best[6] - box[6] + torch.pi, 2 * torch.pi) - torch.pi
        assert abs(float(yaw_err)) < 0.5
