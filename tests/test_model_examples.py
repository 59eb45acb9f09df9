"""The model-example scripts (model_examples/*/scripts) keep working: each A/B script's main()
runs in-process at --small shapes on the CPU (reference vs reference: native kernels do not run
on the CPU), a deliberately wrong backend A is caught, and the DDP training script runs under
torchrun with 1 and then 2 gloo processes and passes its three checks, and the BEVFormer
README's extra Patch works as written. The same scripts run on the GPU (native vs reference,
upstream shapes) from the READMEs' commands."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import mu_space

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "model_examples"

SCRIPTS = {
    "bevdet": EXAMPLES / "BEVDet" / "scripts" / "bevdet_view_transformer.py",
    "bevfusion": EXAMPLES / "BEVFusion" / "scripts" / "bevfusion_vtransform.py",
    "bevformer": EXAMPLES / "BEVFormer" / "scripts" / "bevformer_encoder_layer.py",
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"model_example_{name}", SCRIPTS[name])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_small_cpu_passes(name, capsys):
    assert _load(name).main(["--device", "cpu", "--small", "--warmup", "0", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "speedup A over B" in out
    assert "MISMATCH" not in out


@pytest.mark.parametrize(
    "name, op",
    [
        ("bevdet", "bev_pool_v2"),
        ("bevfusion", "bev_pool"),
        ("bevformer", "multi_scale_deformable_attn"),
    ],
)
def test_script_detects_a_wrong_backend(name, op, monkeypatch, capsys):
    """Backend A ("auto", which is the reference on the CPU) gets an operator that is off by
    1e-3 relative: the script must report the mismatch and exit 1."""
    original = getattr(mu_space, op)

    def off_by_a_little(*args, backend="auto", **kwargs):
        out = original(*args, backend="reference", **kwargs)
        return out * (1.0 + 1e-3) if backend == "auto" else out

    monkeypatch.setattr(mu_space, op, off_by_a_little)
    module = _load(name)
    status = module.main(
        ["--device", "cpu", "--small", "--backend-a", "auto", "--warmup", "0", "--reps", "1"]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert "MISMATCH" in out and "FAIL" in out


def test_native_on_cpu_is_a_clear_error():
    with pytest.raises(mu_space.DispatchError):
        _load("bevdet").main(["--device", "cpu", "--small", "--backend-a", "native"])


def _torchrun(nproc: int, json_path: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    with socket.socket() as sock:  # a free port (--standalone's rendezvous hangs in some sandboxes)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        f"--nproc_per_node={nproc}",
        str(EXAMPLES / "BEVDet" / "scripts" / "train_ddp.py"),
        "--device",
        "cpu",
        "--small",
        "--compare-single",
        str(json_path),
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_train_ddp_two_gloo_processes_match_one(tmp_path):
    ref = tmp_path / "single.json"
    one = _torchrun(1, ref)
    assert one.returncode == 0, one.stdout + one.stderr
    assert ref.exists() and "wrote the 1-process reference" in one.stdout
    two = _torchrun(2, ref)
    assert two.returncode == 0, two.stdout + two.stderr
    for line in (
        "check 1, loss falls",
        "check 2, ranks' parameters identical",
        "check 3, 2 processes vs 1 process",
    ):
        hits = [s for s in two.stdout.splitlines() if s.startswith(line)]
        assert hits and hits[0].endswith("ok"), two.stdout
    assert "PASS" in two.stdout


def test_bevformer_readme_fork_patch(monkeypatch):
    """The extra `Patch` for BEVFormer's `MultiScaleDeformableAttnFunction_fp32` in
    model_examples/BEVFormer/README.md, run as written on a stand-in of the plugin module (and
    an attention module that imported the fork by value): applied, called, restored."""
    readme = (EXAMPLES / "BEVFormer" / "README.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "MSDAFp32" in b]
    path = "projects.mmdet3d_plugin.bevformer.modules.multi_scale_deformable_attn_function"
    parts = path.split(".")
    modules = {}
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])
        if i > 1:
            setattr(modules[".".join(parts[: i - 1])], parts[i - 1], modules[name])

    class MultiScaleDeformableAttnFunction_fp32:  # upstream's name
        @staticmethod
        def apply(*args):
            raise AssertionError("the fork must be replaced")

    modules[path].MultiScaleDeformableAttnFunction_fp32 = MultiScaleDeformableAttnFunction_fp32
    attention = types.ModuleType("projects.mmdet3d_plugin.bevformer.modules.attention")
    attention.MultiScaleDeformableAttnFunction_fp32 = MultiScaleDeformableAttnFunction_fp32
    monkeypatch.setitem(sys.modules, attention.__name__, attention)

    namespace: dict = {}
    exec(compile(snippet, "BEVFormer/README.md", "exec"), namespace)
    patcher = namespace["patcher"]
    try:
        (result,) = [
            r
            for r in patcher.results()
            if r.name == "bevformer.MultiScaleDeformableAttnFunction_fp32"
        ]
        assert result.status == "applied", result
        assert f"{attention.__name__}.MultiScaleDeformableAttnFunction_fp32" in result.targets
        g = torch.Generator().manual_seed(0)
        shapes = torch.tensor([[3, 4], [2, 2]])
        starts = torch.tensor([0, 12])
        value = torch.randn(2, 16, 2, 4, generator=g).half()
        loc = torch.rand(2, 5, 2, 2, 3, 2, generator=g)
        weights = torch.rand(2, 5, 2, 2, 3, generator=g).softmax(-1)
        out = attention.MultiScaleDeformableAttnFunction_fp32.apply(
            value, shapes, starts, loc, weights, 64
        )
        want = mu_space.multi_scale_deformable_attn(
            value.float(), shapes, starts, loc, weights, backend="reference"
        )
        assert out.dtype == torch.float32  # the fork computes in float32
        torch.testing.assert_close(out, want)
    finally:
        patcher.restore()
    assert attention.MultiScaleDeformableAttnFunction_fp32 is MultiScaleDeformableAttnFunction_fp32
