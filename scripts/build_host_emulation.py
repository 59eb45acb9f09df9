"""Build the native sources as a host-emulation library: the kernels run on the CPU
(csrc/ffi/host_emulation.h; docs/host_emulation.md).

    python3 scripts/build_host_emulation.py [--warp-size 32|128] [--out DIR] [SOURCE ...]

Each source of build_utils.EXTENSION_SOURCES (or the ones named) is copied with its kernel
launches rewritten (`k<<<grid, block, shared, stream>>>(args)` -> `muspace_emu::launch(...)`) and
`extern __shared__` arrays pointed at the launch's dynamic shared memory, then compiled by the host
C++ compiler with MUSPACE_BUILD_HOST_EMULATION. The library lands in DIR (default
build/host_emulation/w<warp size>) as libmuspace_native.so with a build_info.json, so
`MUSPACE_LIBRARY=DIR/libmuspace_native.so` makes mu_space load it: native kernels then run on CPU
tensors. Objects are cached by the digest of the whole rewritten tree and the flags (a header
change rebuilds every object).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import build_utils  # noqa: E402

RUNTIME_SOURCE = "csrc/ffi/host_emulation.cc"
PROBE_SOURCE = "tests/emulation/probe_kernels.mu"
EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")


def _matching(text: str, at: int) -> int:
    """The index of the parenthesis matching the one at `at` (forward from "(", back from ")")."""
    step = 1 if text[at] == "(" else -1
    depth = 0
    i = at
    while 0 <= i < len(text):
        depth += {"(": step, ")": -step}.get(text[i], 0)
        if depth == 0:
            return i
        i += step
    raise ValueError(f"unbalanced {text[at]!r} at offset {at}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[begin:i].strip())
            begin = i + 1
    parts.append(text[begin:].strip())
    return parts


def _kernel_start(text: str, launch: int) -> int:
    """Where the kernel expression before `<<<` at `launch` begins (a name, maybe qualified, with
    an optional template argument list)."""
    k = launch
    while k > 0 and text[k - 1].isspace():
        k -= 1
    if text[k - 1] == ">":
        depth = 0  # angle brackets; a parenthesised argument such as (K > 2) is skipped whole
        while True:
            k -= 1
            if text[k] == ")":
                k = _matching(text, k)
            elif text[k] == ">":
                depth += 1
            elif text[k] == "<":
                depth -= 1
                if depth == 0:
                    break
        while k > 0 and text[k - 1].isspace():
            k -= 1
    while k > 0 and (text[k - 1].isalnum() or text[k - 1] in "_:"):
        k -= 1
    return k


def rewrite_launches(text: str) -> str:
    """`kernel<<<grid, block[, shared[, stream]]>>>(args)` -> a muspace_emu::launch call."""
    out, i = [], 0
    while (launch := text.find("<<<", i)) >= 0:
        start = _kernel_start(text, launch)
        kernel = text[start:launch].strip()
        close = text.index(">>>", launch)
        config = _split_top_level(text[launch + 3 : close])
        if not 2 <= len(config) <= 4:
            raise ValueError(f"launch of {kernel}: configuration {config}")
        grid, block, shared, stream = [*config, "0", "nullptr"][:4]
        paren = close + 3
        while text[paren].isspace():
            paren += 1
        if text[paren] != "(":
            raise ValueError(f"launch of {kernel}: no argument list")
        end = _matching(text, paren)
        args = text[paren + 1 : end].strip()
        name = " ".join(kernel.split())
        call = (
            f'::muspace_emu::launch("{name}", {grid}, {block}, {shared}, {stream}, '
            f"[&](auto&... args) {{ {kernel}(args...); }}" + (f", {args}" if args else "") + ")"
        )
        out += [text[i:start], call]
        i = end + 1
    out.append(text[i:])
    return EXTERN_SHARED.sub(
        r"\1* \2 = static_cast<\1*>(::muspace_emu::dynamic_shared_memory());", "".join(out)
    )


def core_sources() -> list[str]:
    """The sources every library needs: the fill kernel and the build facts (csrc/ffi)."""
    return [s for s in build_utils.EXTENSION_SOURCES if s.startswith("csrc/ffi/")]


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def flags(warp_size: int, includes: list[str]) -> list[str]:
    return [
        "-std=c++17",
        "-O1",
        "-g1",
        "-fPIC",
        "-fno-strict-aliasing",
        "-Wno-unknown-pragmas",
        "-Wno-attributes",
        "-DMUSPACE_BUILD_HOST_EMULATION",
        f"-DMUSPACE_EMULATED_WARP_SIZE={warp_size}",
        *(f"-I{p}" for p in includes),
    ]


def _mirrored(src_dir: Path, source: Path) -> Path:
    """Where a source lands in the mirror: csrc/X at src_dir/X, any other file (the probe
    kernels) at src_dir/extra/<its path>."""
    rel = source.resolve().relative_to(ROOT)
    if rel.parts[0] == "csrc":
        return src_dir.joinpath(*rel.parts[1:])
    return src_dir / "extra" / rel


def mirror_tree(src_dir: Path, extra: list[Path]) -> str:
    """Write csrc/ (and the extra sources) into src_dir with the launches of every .mu / .muh
    rewritten (a `#line` keeps the original names in messages); returns a digest of the tree."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "csrc").rglob("*")) + [p.resolve() for p in extra]:
        if path.suffix not in (".mu", ".muh", ".h", ".cc"):
            continue
        text = path.read_text()
        if path.suffix in (".mu", ".muh"):
            text = rewrite_launches(text)
        target = _mirrored(src_dir, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        mirrored = f'#line 1 "{path}"\n{text}'
        if not target.exists() or target.read_text() != mirrored:
            target.write_text(mirrored)
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


def _compile(source: str, src_dir: Path, tree: str, cmd_flags: list[str], obj_dir: Path) -> Path:
    mirrored = _mirrored(src_dir, ROOT / source)
    all_flags = [*cmd_flags, f"-I{src_dir / 'ffi'}", f"-I{mirrored.parent}"]
    key = hashlib.sha256((tree + source + " ".join(all_flags)).encode()).hexdigest()[:16]
    obj = obj_dir / f"{mirrored.stem}-{key}.o"
    if obj.exists():
        return obj
    cmd = [compiler(), "-x", "c++", *all_flags, "-c", str(mirrored), "-o", f"{obj}.tmp"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"compiling {source} failed:\n{result.stderr[-6000:]}")
    os.replace(f"{obj}.tmp", obj)
    return obj


def build(out_dir: Path, warp_size: int, sources: list[str], jobs: int) -> Path:
    includes, tvm_lib_dir, tvm_ffi_version = build_utils._tvm_ffi_paths()
    src_dir, obj_dir = out_dir / "src", out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    tree = mirror_tree(src_dir, [ROOT / s for s in sources if not s.startswith("csrc/")])
    cmd_flags = flags(warp_size, includes)

    def compile_one(source: str):
        try:
            return _compile(source, src_dir, tree, cmd_flags, obj_dir)
        except RuntimeError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        objs = list(pool.map(compile_one, [RUNTIME_SOURCE, *sources]))
    failures = [str(o) for o in objs if isinstance(o, RuntimeError)]
    if failures:
        raise RuntimeError("\n".join(failures))
    lib = out_dir / build_utils.LIBRARY_FILE
    link = [
        compiler(),
        "-shared",
        *map(str, objs),
        "-o",
        str(lib),
        f"-L{tvm_lib_dir}",
        "-ltvm_ffi",
        f"-Wl,-rpath,{tvm_lib_dir}",
    ]
    subprocess.run(link, check=True)
    info = {
        "backend": "host-emulation",
        "archs": [],
        "warp_size": warp_size,
        "sources": sources,
        "tvm_ffi_version": tvm_ffi_version,
    }
    (out_dir / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warp-size", type=int, choices=(32, 128), default=32)
    parser.add_argument("--out", type=Path)
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--probe",
        action="store_true",
        help=f"add the emulation's own test kernels ({PROBE_SOURCE})",
    )
    parser.add_argument("sources", nargs="*", help="sources (default: every native source)")
    args = parser.parse_args(argv)
    out = args.out or ROOT / "build" / "host_emulation" / f"w{args.warp_size}"
    sources = list(dict.fromkeys(core_sources() + (args.sources or build_utils.EXTENSION_SOURCES)))
    if args.probe:
        sources.append(PROBE_SOURCE)
    lib = build(out, args.warp_size, sources, args.jobs)
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
