"""`python -m mu_space` and the generated operator matrix."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from mu_space import selfcheck
from mu_space.runtime import registry

ROOT = Path(__file__).resolve().parent.parent


def test_selfcheck_json_passes(capsys):
    assert selfcheck.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert {r["op"] for r in report["results"]} == {s.name for s in registry.operators()}
    assert report["environment"]["torch"] == torch.__version__
    assert report["dispatch"], "the self-check must leave dispatch records"


def test_selfcheck_strict_fails_where_native_cannot_run(capsys):
    if not torch.cuda.is_available():
        assert selfcheck.main(["--strict", "--json", "--device", "cpu"]) == 1
        assert json.loads(capsys.readouterr().out)["ok"] is False


def test_selfcheck_reports_a_wrong_result(monkeypatch, capsys):
    op = registry.get("add_one")
    monkeypatch.setattr(op.d, "api", lambda x, backend: x + (1 if backend == "reference" else 2))
    monkeypatch.setattr(selfcheck.native, "unavailable_reason", lambda device: None)
    assert selfcheck.main(["--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_module_entry_point_runs():
    proc = subprocess.run(
        [sys.executable, "-m", "mu_space"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dispatch report" in proc.stdout and "native_built" in proc.stdout


def test_operator_matrix_doc_matches_registry():
    doc = (ROOT / "docs" / "operator_matrix.md").read_text()
    assert doc == registry.operator_matrix_markdown(), (
        "docs/operator_matrix.md is stale: run `python -m mu_space --operator-matrix > docs/operator_matrix.md`"
    )


def test_bad_device_arguments_are_one_line_errors(capsys):
    import pytest

    with pytest.raises(SystemExit, match="--device 'foo' is not a torch device"):
        selfcheck.main(["--device", "foo"])
    with pytest.raises(SystemExit, match="muSPACE runs on cpu, cuda and musa"):
        selfcheck.main(["--device", "meta"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="has no usable CUDA device"):
            selfcheck.main(["--device", "cuda"])


def test_strict_where_native_cannot_run_says_so_once(capsys):
    if torch.cuda.is_available():
        return
    assert selfcheck.main(["--strict", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert out.count("strict: native kernels cannot run on cpu") == 1
    assert "Traceback" not in out and "FAIL" not in out


def test_dispatch_log_prints_each_decision_to_stderr():
    code = "import torch, mu_space; mu_space.ops.add_one(torch.zeros(2))"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "MUSPACE_DISPATCH_LOG": "1"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mu_space.dispatch: add_one -> reference (" in proc.stderr


def test_selfcheck_says_whether_the_library_was_built_from_this_checkout():
    import build_utils

    assert selfcheck._sources_current({"sources_sha256": build_utils.sources_digest()}) is True
    assert selfcheck._sources_current({"sources_sha256": "0" * 64}) is False
    assert selfcheck._sources_current({}) is None  # a build without a digest
