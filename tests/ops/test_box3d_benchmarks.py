"""The issue-12 benchmark scripts end to end on tiny inputs (CPU-capable smoke runs: every case
checked against its reference and timed, the JSON written, the targets evaluated), and the mmcv
peer's ratio table (benchmarks/_box3d_peer.py)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from benchmarks import _box3d_peer, harness

BENCHES = ("points_in_boxes", "boxes_overlap_bev", "nms3d", "roiaware_pool3d", "roipoint_pool3d")


@pytest.mark.parametrize("bench", BENCHES)
def test_smoke_run(bench, tmp_path, monkeypatch):
    # our cases only: mmcv's twins (where their .so is built, on a GPU machine) are judged by the
    # benchmark runs themselves, which print each twin's agreement with our reference; on the
    # H200 (2026-12-01) the roiaware backward twin is unchecked by design and the roipoint twin
    # failed its agreement on these tiny inputs (open: its message was not logged)
    monkeypatch.setattr(_box3d_peer.PEER, "_checked", True)
    monkeypatch.setattr(_box3d_peer.PEER, "_reason", "left out of the smoke run")
    module = importlib.import_module(f"benchmarks.bench_{bench}")
    assert module.main(["--smoke", "--quick", "--reps", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["results"] and all(r["status"] == "ok" and r["checked"] for r in doc["results"])
    assert len(doc["targets"]) == len(
        harness.evaluate_targets(doc["results"], getattr(module, "TARGETS", ()))
    )


def test_without_a_gpu_the_peer_is_skipped_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the peer may be built there")
    assert _box3d_peer.reason() is not None
    assert not _box3d_peer.has("nms3d_keep")


def test_ratio_table(tmp_path):
    doc = {
        "results": [
            {"name": "a", "median_us": 10.0},
            {"name": "a-mmcv", "median_us": 250.0},
            {"name": "b", "median_us": 5.0},
        ]
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    table = _box3d_peer.ratio_table([str(path)])
    assert "| a | 10.0 | 250.0 | 25.0x |" in table and "| b |" not in table


def test_profile_script_smoke(capsys):
    """benchmarks/profile_box3d.py (the GPU session's host vs kernel split) on tiny inputs: one
    row per selected case with a positive wall time."""
    from benchmarks import profile_box3d

    assert (
        profile_box3d.main(["--smoke", "--calls", "1", "--cases", "nms3d-top500|overlap-float32"])
        == 0
    )
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    rows = [r for r in rows if not r[0].startswith("USDT")]
    assert {r[0] for r in rows} == {
        "det-4096-nms3d-top500-float32",
        "det-1000x1000-overlap-float32",
    }
    assert all(float(r[1]) > 0 for r in rows)
