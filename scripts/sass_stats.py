"""Per-kernel SASS statistics of the native sources, to show that a refactor left the generated
code alone (no GPU needed).

    python scripts/sass_stats.py --csrc csrc --out /tmp/after.json [--arch 90a]
    python scripts/sass_stats.py --compare /tmp/before.json /tmp/after.json

Compiles every `.mu` under --csrc with nvcc to a cubin (the flags of the CUDA build, one arch),
disassembles it with cuobjdump (CUOBJDUMP or PATH; PyPI: nvidia-cuda-cuobjdump) and records per
kernel: instruction count, memory / atomic / barrier instruction counts, registers and a hash
of the SASS text (without the instruction addresses). --compare prints the kernels whose numbers differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import build_utils  # noqa: E402

CLASSES = {
    "ldg": re.compile(r"\bLDG\b"),
    "stg": re.compile(r"\bSTG\b"),
    "lds": re.compile(r"\bLDS\b"),
    "sts": re.compile(r"\bSTS\b"),
    "red_atom": re.compile(r"\b(?:RED|REDG|REDAS|REDUX|ATOM|ATOMG|ATOMS)\b"),
    "bar": re.compile(r"\bBAR\b"),
    "local": re.compile(r"\b(?:LDL|STL)\b"),
}
INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?);")
FUNC = re.compile(r"^\s+Function : (\S+)")


def _compile(nvcc: str, src: Path, csrc: Path, arch: str, out: Path, includes: list[str]) -> Path:
    cubin = out / (src.relative_to(csrc).as_posix().replace("/", "__") + ".cubin")
    cmd = [nvcc, "-x", "cu", "-std=c++17", "-O3", "--expt-relaxed-constexpr"]
    cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}", "-DMUSPACE_BUILD_CUDA"]
    cmd += [
        f"-I{csrc / 'ffi'}",
        *(f"-I{p}" for p in includes),
        "-cubin",
        "-o",
        str(cubin),
        str(src),
    ]
    subprocess.run(cmd, check=True)
    return cubin


def _kernels(cuobjdump: str, cubin: Path) -> dict[str, dict]:
    sass = subprocess.run(
        [cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    res = subprocess.run(
        [cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    regs = dict(re.findall(r"Function (\S+):\s*\n\s*REG:(\d+)", res))
    kernels: dict[str, dict] = {}
    name, lines = None, []

    def close():
        if name is None:
            return
        body = [ln for ln in lines if not ln.startswith("NOP")]
        stats = {k: sum(bool(r.search(ln)) for ln in body) for k, r in CLASSES.items()}
        stats["instructions"] = len(body)
        stats["registers"] = int(regs.get(name, -1))
        text = "\n".join(body)
        stats["hash"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        kernels[name] = stats

    for line in sass.splitlines():
        m = FUNC.match(line)
        if m:
            close()
            name, lines = m.group(1), []
            continue
        m = INSTR.match(line)
        if m and name is not None:
            lines.append(m.group(1))
    close()
    return kernels


def _demangle(names: list[str]) -> dict[str, str]:
    if not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True
    ).stdout.splitlines()
    return dict(zip(names, out))


def collect(csrc: Path, arch: str) -> dict[str, dict]:
    nvcc = build_utils._find_nvcc(os.environ) or "nvcc"
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not cuobjdump:
        raise SystemExit("cuobjdump not found (set CUOBJDUMP; PyPI: nvidia-cuda-cuobjdump)")
    includes, _, _ = build_utils._tvm_ffi_paths()
    sources = sorted(csrc.rglob("*.mu"))
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        cubins = list(
            pool.map(lambda s: _compile(nvcc, s, csrc, arch, Path(tmp), includes), sources)
        )
        result = {}
        for cubin in cubins:
            kernels = _kernels(cuobjdump, cubin)
            names = _demangle(list(kernels))
            for mangled, stats in kernels.items():
                result[names[mangled]] = stats
    return dict(sorted(result.items()))


def compare(before: dict, after: dict) -> int:
    same = changed = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            print(f"{'added  ' if a is None else 'removed'} {name}: {a or b}")
            continue
        if a["hash"] == b["hash"] and a["registers"] == b["registers"]:
            same += 1
            continue
        changed += 1
        diff = {k: f"{a[k]} -> {b[k]}" for k in a if k != "hash" and a[k] != b.get(k)}
        print(f"changed {name}: {diff or 'same counts, different code'}")
    print(f"{same} kernels identical (SASS hash and registers), {changed} changed")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csrc", type=Path, default=build_utils.ROOT / "csrc")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        return compare(before, after)
    stats = collect(args.csrc.resolve(), args.arch)
    text = json.dumps(stats, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
        print(f"{len(stats)} kernels -> {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
