"""Toolchain detection and compiler command lines (no compiler is run here)."""

import os
import stat
from pathlib import Path

import build_utils


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho fake 1.0\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_muspace_native_0_disables_the_build():
    plan = build_utils.detect_toolchain({"MUSPACE_NATIVE": "0", "PATH": os.environ["PATH"]})
    assert plan.toolchain is None and "MUSPACE_NATIVE=0" in plan.skip_reason
    assert "without the native library" in build_utils.describe(plan)


def test_no_toolchain_gives_one_clear_reason(tmp_path):
    plan = build_utils.detect_toolchain({"PATH": str(tmp_path), "MUSA_HOME": str(tmp_path)})
    assert plan.toolchain is None and "no GPU toolchain" in plan.skip_reason


def test_mcc_under_musa_home_wins(tmp_path):
    _fake_exe(tmp_path / "musa" / "bin" / "mcc")
    _fake_exe(tmp_path / "bin" / "nvcc")
    env = {"PATH": str(tmp_path / "bin"), "MUSA_HOME": str(tmp_path / "musa"), "MUSA_ARCH": "31"}
    tc = build_utils.detect_toolchain(env).toolchain
    assert tc.backend == "musa" and tc.archs == ["31"] and tc.arch_source == "MUSA_ARCH"
    cmd = build_utils.compile_command(tc, Path("a.mu"), Path("a.o"), [])
    assert "--offload-arch=mp_31" in cmd and "-DMUSPACE_MUSA_ARCH=31" in cmd and "musa" in cmd
    link = build_utils.link_command(tc, [Path("a.o")], Path("lib.so"), "/tvm/lib")
    assert "-lmusart" in link and "-ltvm_ffi" in link


def test_cuda_arch_list_from_env(tmp_path):
    _fake_exe(tmp_path / "bin" / "nvcc")
    env = {
        "PATH": str(tmp_path / "bin"),
        "MUSA_HOME": str(tmp_path / "none"),
        "CUDA_ARCH": "80, 90a",
    }
    tc = build_utils.detect_toolchain(env).toolchain
    assert tc.backend == "cuda" and tc.archs == ["80", "90a"]
    cmd = build_utils.compile_command(tc, Path("a.mu"), Path("a.o"), [])
    assert cmd[1:3] == ["-x", "cu"]
    joined = " ".join(cmd)
    assert "code=sm_80" in joined and "code=sm_90a" in joined and "code=compute_80" in joined


def test_default_cuda_archs_without_gpu(tmp_path, monkeypatch):
    _fake_exe(tmp_path / "bin" / "nvcc")
    monkeypatch.setattr(build_utils, "_visible_cuda_archs", lambda: [])
    env = {"PATH": str(tmp_path / "bin"), "MUSA_HOME": str(tmp_path / "none")}
    tc = build_utils.detect_toolchain(env).toolchain
    assert tc.archs == build_utils.DEFAULT_CUDA_ARCHS and "default" in tc.arch_source


def test_ptx_of_newest_plain_arch_is_embedded():
    flags = " ".join(build_utils._cuda_arch_flags(["90a"]))
    assert "arch=compute_90,code=compute_90" in flags
