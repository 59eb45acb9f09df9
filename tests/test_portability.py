"""MUSA portability rules (docs/architecture.md, "MUSA portability rules"), checked statically over csrc/:
- vendor runtime names (cuda*/musa*/CUDA*/MUSA*) only in csrc/ffi/gpu_compat.muh;
- no literal warp width 32 in warp intrinsics, no 0xffffffff lane masks;
- no double precision in kernels;
- attributes before `__shared__` (`alignas(16) __shared__ T buf[N]`): clang, and so mcc, rejects
  an attribute list after it (scripts/clang_cuda_check.sh compiles the tree with clang)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "csrc" / "ffi" / "gpu_compat.muh"
SOURCES = sorted(p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".mu", ".muh"))

VENDOR_NAME = re.compile(r"\b(?:cuda|musa|CUDA|MUSA|cu[A-Z]\w*|mu[A-Z]\w*)\w*")
FULL_MASK = re.compile(r"0x[fF]{8}\b")
WARP_32 = re.compile(
    r"__shfl\w*\s*\([^;]*\b32\s*\)|\b(?:warp_?size|WARP_?SIZE)\s*=\s*32\b|\bwarpSize\b"
)
ATTRIBUTE_AFTER_SHARED = re.compile(r"__shared__\s+(?:alignas\b|__align__\b|__attribute__\b|\[\[)")
DOUBLE = re.compile(r"\bdouble\b|\b\d+\.\d*(?:[eE][-+]?\d+)?(?![fF\w])")


def _code(path: Path) -> str:
    """Source without comments and string literals (messages may name anything)."""
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_sources_found():
    assert COMPAT in SOURCES and len(SOURCES) >= 3


@pytest.mark.parametrize("path", [p for p in SOURCES if p != COMPAT], ids=lambda p: p.name)
def test_no_vendor_names_outside_compat(path):
    hits = sorted(set(VENDOR_NAME.findall(_code(path))))
    assert not hits, f"{path.relative_to(ROOT)} names vendor APIs {hits}; use gpu_compat.muh"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_hard_coded_warp_width_or_full_masks(path):
    code = _code(path)
    assert not FULL_MASK.search(code), (
        f"{path.name}: 0xffffffff lane mask (warps are 128 wide on MUSA)"
    )
    if path != COMPAT:
        assert not WARP_32.search(code), f"{path.name}: literal warp width; use muspace::kWarpSize"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_double_precision(path):
    hits = DOUBLE.findall(_code(path))
    assert not hits, (
        f"{path.name}: double precision {hits[:5]} (many MUSA builds lack FP64); "
        "write float literals with an f suffix"
    )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_attributes_before_shared(path):
    hits = [m.group(0) for m in ATTRIBUTE_AFTER_SHARED.finditer(_code(path))]
    assert not hits, (
        f"{path.name}: {hits[:3]}: write the attribute first (alignas(16) __shared__ ...); "
        "clang-based compilers (mcc) reject an attribute after __shared__"
    )


def test_rules_catch_violations(tmp_path):
    bad = tmp_path / "bad.mu"
    bad.write_text(
        "__global__ void k(double* x) { cudaMemcpy(0,0,0,0); "
        "x[0] = __shfl_xor_sync(0xffffffff, 1.0, 32); }  // cudaFree is fine here\n"
        "__shared__ alignas(16) unsigned char a[16]; __shared__ __align__(8) float b[2];\n"
        "alignas(16) __shared__ unsigned char ok[16];\n"
    )
    code = _code(bad)
    assert VENDOR_NAME.findall(code) == ["cudaMemcpy"]
    assert FULL_MASK.search(code) and WARP_32.search(code) and DOUBLE.search(code)
    assert len(ATTRIBUTE_AFTER_SHARED.findall(code)) == 2
