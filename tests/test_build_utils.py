"""Toolchain detection and compiler command lines (no compiler is run here)."""

import json
import os
import re
import stat
from pathlib import Path

import pytest

import build_utils

ROOT = Path(build_utils.__file__).resolve().parent

# The limits the Python layer reads from muspace_build_facts()["limits"].
LIMIT_KEYS = {
    "bev_pool_v2.max_points": 1 << 30,
    "bev_pool_v2.max_channels": 1 << 20,
    "bev_pool_v2.max_cells": 2**31 - 1,
    "bev_pool_prepare.max_points": 2**31 - 1,
    "bev_pool_prepare.max_cells": 2**31 - 1,
    "sort_by_cell.max_entries": 2**31 - 1,
    "sort_by_cell.max_cells": 2**31 - 1,
    "multi_scale_deformable_attn.max_head_dim": 256,
    "multi_scale_deformable_attn.max_levels": 16,
    "multi_scale_deformable_attn.max_level_points": 1 << 20,
}
LIMIT = re.compile(r"^\s*MUSPACE_LIMIT\(\s*(\w+)\s*,\s*(\w+)\s*,", re.M)


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
    assert "code=sm_80" in joined and "code=sm_90a" in joined
    assert "arch=compute_90,code=compute_90" in joined and "code=compute_80" not in joined


def test_default_cuda_archs_without_gpu(tmp_path, monkeypatch):
    _fake_exe(tmp_path / "bin" / "nvcc")
    monkeypatch.setattr(build_utils, "_visible_cuda_archs", lambda: [])
    env = {"PATH": str(tmp_path / "bin"), "MUSA_HOME": str(tmp_path / "none")}
    tc = build_utils.detect_toolchain(env).toolchain
    assert tc.archs == build_utils.DEFAULT_CUDA_ARCHS and "default" in tc.arch_source


def test_ptx_of_the_newest_archs_family_is_embedded():
    """90a SASS runs on Hopper only; the PTX of its family (compute_90) JITs on newer GPUs."""
    for archs, ptx in [
        (["90a"], "90"),
        (build_utils.DEFAULT_CUDA_ARCHS, "90"),  # what the README promises
        (["80", "86"], "86"),
        (["100a", "90a", "80"], "100"),
    ]:
        flags = build_utils._cuda_arch_flags(archs)
        ptx_flags = [f for f in flags if "code=compute_" in f]
        assert ptx_flags == [f"arch=compute_{ptx},code=compute_{ptx}"], (archs, flags)


def test_compiler_source_is_reported(tmp_path):
    nvcc = _fake_exe(tmp_path / "cuda" / "bin" / "nvcc")
    env = {"PATH": "", "CUDA_HOME": str(tmp_path / "cuda"), "MUSA_HOME": str(tmp_path / "none")}
    plan = build_utils.detect_toolchain(env)
    assert plan.toolchain.compiler == str(nvcc) and plan.toolchain.compiler_source == "CUDA_HOME"
    assert "found via CUDA_HOME" in build_utils.describe(plan)
    _fake_exe(tmp_path / "bin" / "nvcc")
    env = {"PATH": str(tmp_path / "bin"), "MUSA_HOME": str(tmp_path / "none")}
    assert build_utils.detect_toolchain(env).toolchain.compiler_source == "PATH"


def test_progress_lines_go_to_stderr_unless_quiet(capsys):
    progress = build_utils.Progress({}, use_tty=False)
    progress.say("mu_space: [1/2] compiling a.mu")
    progress.close()
    quiet = build_utils.Progress({"MUSPACE_QUIET": "1"}, use_tty=False)
    quiet.say("hidden")
    quiet.close()
    out, err = capsys.readouterr()
    assert err == "mu_space: [1/2] compiling a.mu\n" and out == ""


def _limit_declarations() -> list[tuple[str, str]]:
    """(key, source) of every MUSPACE_LIMIT(...) statement in csrc/, comments removed."""
    found = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".mu", ".muh"):
            continue
        text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)
        rel = path.relative_to(ROOT).as_posix()
        found += [(f"{op}.{name}", rel) for op, name in LIMIT.findall(text)]
    return found


def test_build_fact_limits_are_declared_once_in_built_sources():
    declared = _limit_declarations()
    keys = [key for key, _ in declared]
    for key in LIMIT_KEYS:
        assert keys.count(key) == 1, f"{key} declared {keys.count(key)} times: {declared}"
    assert len(keys) == len(set(keys)), f"a limit is declared twice: {sorted(keys)}"
    unbuilt = {src for _, src in declared} - set(build_utils.EXTENSION_SOURCES)
    assert not unbuilt, f"MUSPACE_LIMIT outside the built .mu sources: {unbuilt}"


def test_limit_pattern_skips_the_macro_definition(tmp_path):
    text = "#define MUSPACE_LIMIT(op, name, value) x\n  MUSPACE_LIMIT(a_op, max_x, kMaxX);\n"
    assert LIMIT.findall(text) == [("a_op", "max_x")]


def test_built_library_reports_the_limits():
    """Where the package's library is built (CI: the install step), its facts hold the values."""
    library = ROOT / build_utils.PACKAGE_LIB_DIR / build_utils.LIBRARY_FILE
    if not library.exists():
        pytest.skip(f"no native library at {library}")
    import json

    import tvm_ffi

    module = tvm_ffi.load_module(str(library))
    try:
        facts_fn = module["muspace_build_facts"]
    except Exception:  # a library built before the facts existed
        pytest.skip(f"{library} has no muspace_build_facts (stale build)")
    facts = json.loads(str(facts_fn()))
    assert facts["backend"] == str(module["build_backend"]())
    assert facts["warp_size"] == int(module["build_warp_size"]())
    assert isinstance(facts["bf16"], bool) and facts["compiler"]
    assert {k: facts["limits"].get(k) for k in LIMIT_KEYS} == LIMIT_KEYS
    assert list(facts["limits"]) == sorted(facts["limits"])


def test_if_stale_keeps_only_a_library_of_the_same_sources_and_archs(tmp_path):
    """`--if-stale` (the GPU sessions carry a prebuilt library): a library counts as current only
    with this tree's csrc/ digest, backend and archs."""
    tc = build_utils.Toolchain("cuda", "nvcc", ["90a"], "CUDA_ARCH")
    (tmp_path / build_utils.LIBRARY_FILE).write_bytes(b"")
    info = {"backend": "cuda", "archs": ["90a"], "sources_sha256": build_utils.sources_digest()}
    (tmp_path / build_utils.BUILD_INFO_FILE).write_text(json.dumps(info))
    assert build_utils.current_build(tmp_path, tc) == info
    other_arch = build_utils.Toolchain("cuda", "nvcc", ["80"], "CUDA_ARCH")
    assert build_utils.current_build(tmp_path, other_arch) is None
    for stale in ({"sources_sha256": "0" * 64}, {"backend": "musa"}, {"sources_sha256": None}):
        (tmp_path / build_utils.BUILD_INFO_FILE).write_text(json.dumps({**info, **stale}))
        assert build_utils.current_build(tmp_path, tc) is None
    (tmp_path / build_utils.BUILD_INFO_FILE).write_text(json.dumps(info))
    (tmp_path / build_utils.LIBRARY_FILE).unlink()
    assert build_utils.current_build(tmp_path, tc) is None


def test_sources_digest_follows_the_csrc_tree(tmp_path, monkeypatch):
    (tmp_path / "csrc" / "x").mkdir(parents=True)
    (tmp_path / "build_utils.py").write_text("flags")
    (tmp_path / "csrc" / "x" / "a.mu").write_text("one")
    monkeypatch.setattr(build_utils, "ROOT", tmp_path)
    first = build_utils.sources_digest()
    (tmp_path / "csrc" / "x" / "a.mu").write_text("two")
    second = build_utils.sources_digest()
    (tmp_path / "csrc" / "x" / "a.mu").rename(tmp_path / "csrc" / "x" / "b.mu")
    assert len({first, second, build_utils.sources_digest()}) == 3


def test_build_info_records_the_sources_as_they_were_compiled(tmp_path, monkeypatch):
    """A source edited while the build runs leaves the library stale: the digest is taken before
    compiling (taken after, a library built from the old sources was recorded as current)."""
    compiled = []  # a source is edited as soon as the first compile has run
    monkeypatch.setattr(
        build_utils, "sources_digest", lambda: "edited" if compiled else "as compiled"
    )
    monkeypatch.setattr(build_utils, "compile_command", lambda tc, src, obj, inc: ["cc", str(obj)])
    monkeypatch.setattr(build_utils, "link_command", lambda tc, objs, out, lib: ["ld", str(out)])
    monkeypatch.setattr(build_utils, "_tvm_ffi_paths", lambda: ([], "", "0"))

    def run(cmd, what):
        compiled.append(cmd[0])
        if cmd[0] == "ld":
            Path(cmd[1]).write_bytes(b"")

    monkeypatch.setattr(build_utils, "_run_checked", run)
    tc = build_utils.Toolchain("cuda", "nvcc", ["90a"], "CUDA_ARCH")
    plan = build_utils.BuildPlan(tc, sources=build_utils.EXTENSION_SOURCES[:1])
    progress = build_utils.Progress(env={"MUSPACE_QUIET": "1"}, use_tty=False)
    build_utils.build(plan, tmp_path, jobs=1, progress=progress)
    info = json.loads((tmp_path / build_utils.BUILD_INFO_FILE).read_text())
    assert info["sources_sha256"] == "as compiled"
