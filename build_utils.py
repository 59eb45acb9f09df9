"""Native build for muSPACE: one shared library from the `.mu` sources in `EXTENSION_SOURCES`
(every `csrc/**/*.mu` not in `EXCLUDED_SOURCES`).

Used by `setup.py` (wheel / editable installs) and directly for development builds:

    python build_utils.py --inplace [-j N]      # build into mu_space/_lib/
    python build_utils.py --plan                # print what would be built and why
    python build_utils.py --inplace --if-stale  # build only when csrc/ or the toolchain changed

Toolchain choice (first match wins):
- `MUSPACE_NATIVE=0`            -> no native library (pure-Python install, reference backend)
- `mcc` under `MUSA_HOME` (default /usr/local/musa)  -> MUSA build, `--offload-arch=mp_$MUSA_ARCH`
- `nvcc` (CUDA_HOME/bin or PATH)                     -> CUDA build, `.mu` compiled with `-x cu`;
  arch from `CUDA_ARCH` ("90a", "80;90a" or "80,90a"), else the visible GPU's, else
  `DEFAULT_CUDA_ARCHS`; plus PTX of the newest arch's family (90a -> compute_90), so newer GPUs
  can JIT-compile the library
- neither                        -> no native library, with one line saying why.
A failed compile when a toolchain is present raises: it is never silently skipped.

Progress ("[2/5] compiling csrc/...", the link, the plan) goes to stderr; when stdout and stderr
are not terminals (pip without -v hides the build's output) also to /dev/tty where it opens.
MUSPACE_QUIET=1 silences it.

The library links against libtvm_ffi from the `apache-tvm-ffi` package (not bundled); that
package is loaded first at run time, so the loader resolves it by soname.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent

# Sources kept out of the library: path -> reason (tests/test_build_sources.py wants one).
EXCLUDED_SOURCES: dict[str, str] = {}
# The build smoke (add_one, build facts): compiled first.
SMOKE_SOURCE = "csrc/ffi/muspace_ops.mu"


def _extension_sources() -> list[str]:
    found = (p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.mu"))
    kept = [src for src in found if src not in EXCLUDED_SOURCES]
    return sorted(kept, key=lambda src: (src != SMOKE_SOURCE, src))


# The one list of native sources, from the tree: a new operator's .mu needs no edit here.
EXTENSION_SOURCES = _extension_sources()

LIBRARY_FILE = "libmuspace_native.so"


def sources_digest() -> str:
    """sha256 over every file under csrc/ and this file (the flags): what a library was built
    from, recorded in build_info.json (`--if-stale`, the GPU sessions' carried prebuilt library)."""
    digest = hashlib.sha256()
    files = [p for p in (ROOT / "csrc").rglob("*") if p.is_file()] + [ROOT / "build_utils.py"]
    for path in sorted(files):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def current_build(out_dir: Path, tc: Toolchain) -> dict | None:
    """The build_info of a library in `out_dir` built from these sources for these archs by
    this backend, else None."""
    try:
        info = json.loads((out_dir / BUILD_INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    same = (
        (out_dir / LIBRARY_FILE).is_file()
        and info.get("sources_sha256") == sources_digest()
        and info.get("backend") == tc.backend
        and info.get("archs") == tc.archs
    )
    return info if same else None


BUILD_INFO_FILE = "build_info.json"
PACKAGE_LIB_DIR = Path("mu_space") / "_lib"

# Ampere, Ada, Hopper. sm_90a SASS uses Hopper-only instructions; the compute_90 PTX embedded
# with it lets newer GPUs JIT-compile the library.
DEFAULT_CUDA_ARCHS = ["80", "86", "89", "90a"]
DEFAULT_MUSA_ARCH = "22"


@dataclass
class Toolchain:
    backend: str  # "cuda" | "musa"
    compiler: str
    archs: list[str]
    arch_source: str  # where the arch list came from
    version: str = ""
    compiler_source: str = ""  # where the compiler was found: "PATH", "CUDA_HOME", "MUSA_HOME"


@dataclass
class BuildPlan:
    toolchain: Toolchain | None
    skip_reason: str = ""
    sources: list[str] = field(default_factory=lambda: list(EXTENSION_SOURCES))


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _parse_arch_list(text: str) -> list[str]:
    return [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]


def _visible_cuda_archs() -> list[str]:
    """Compute capabilities of the visible GPUs ("9.0" -> "90a" on Hopper, else "86")."""
    if not shutil.which("nvidia-smi"):
        return []
    out = _run_text(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    archs = []
    for line in out.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            arch = major + minor + ("a" if major == "9" else "")
            if arch not in archs:
                archs.append(arch)
    return archs


def _find_nvcc(env) -> str | None:
    return _locate_nvcc(env)[0]


def _locate_nvcc(env) -> tuple[str | None, str]:
    """(nvcc, where it was found: "CUDA_HOME" / "CUDA_PATH" / "PATH")."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc"), var
        if home:
            break  # CUDA_PATH is only a fallback for an unset CUDA_HOME
    return shutil.which("nvcc", path=env.get("PATH", os.defpath)), "PATH"


def detect_toolchain(env=None) -> BuildPlan:
    env = os.environ if env is None else env
    if env.get("MUSPACE_NATIVE", "1") == "0":
        return BuildPlan(None, "MUSPACE_NATIVE=0 was set")
    musa_home = Path(env.get("MUSA_HOME", "/usr/local/musa"))
    mcc = musa_home / "bin" / "mcc"
    if mcc.exists():
        arch = env.get("MUSA_ARCH", "")
        source = "MUSA_ARCH" if arch else f"default mp_{DEFAULT_MUSA_ARCH}"
        version = _run_text([str(mcc), "--version"]).strip().splitlines()[:1]
        return BuildPlan(
            Toolchain(
                "musa",
                str(mcc),
                [arch or DEFAULT_MUSA_ARCH],
                source,
                version[0] if version else "",
                "MUSA_HOME",
            )
        )
    nvcc, nvcc_source = _locate_nvcc(env)
    if nvcc:
        if env.get("CUDA_ARCH"):
            archs, source = _parse_arch_list(env["CUDA_ARCH"]), "CUDA_ARCH"
        elif visible := _visible_cuda_archs():
            archs, source = visible, "visible GPU"
        else:
            archs, source = list(DEFAULT_CUDA_ARCHS), "default list (no CUDA_ARCH, no visible GPU)"
        version = [l for l in _run_text([nvcc, "--version"]).splitlines() if "release" in l]
        return BuildPlan(
            Toolchain(
                "cuda", nvcc, archs, source, version[0].strip() if version else "", nvcc_source
            )
        )
    return BuildPlan(
        None,
        f"no GPU toolchain found (no mcc under MUSA_HOME={musa_home}, "
        "no nvcc on PATH or under CUDA_HOME)",
    )


def _tvm_ffi_paths() -> tuple[list[str], str, str]:
    import tvm_ffi.libinfo as libinfo

    includes = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    lib_dir = str(Path(libinfo.find_libtvm_ffi()).parent)
    from tvm_ffi import __version__ as tvm_ffi_version

    return includes, lib_dir, tvm_ffi_version


def _arch_family(arch: str) -> str:
    """The portable arch of a target: "90a" -> "90" (arch-specific "a" / family "f" suffixes)."""
    return arch.rstrip("af")


def _cuda_arch_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # PTX of the newest arch's family: "a" SASS runs on that arch only, its family's PTX JITs on
    # every newer GPU.
    newest = _arch_family(max(archs, key=lambda a: int(_arch_family(a))))
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def source_flags(backend: str, includes: list[str], musa_arch: str = "") -> list[str]:
    """The -D and -I flags of every compile of a native source for `backend` ("cuda" or
    "musa"); scripts/clang_cuda_check.sh gives clang the same ones."""
    inc = [f"-I{ROOT / 'csrc' / 'ffi'}"] + [f"-I{p}" for p in includes]
    if backend == "cuda":
        return ["-DMUSPACE_BUILD_CUDA", *inc]
    return ["-DMUSPACE_BUILD_MUSA", f"-DMUSPACE_MUSA_ARCH={musa_arch}", *inc]


def compile_command(tc: Toolchain, source: Path, obj: Path, includes: list[str]) -> list[str]:
    if tc.backend == "cuda":
        return [
            tc.compiler,
            "-x",
            "cu",
            "-std=c++17",
            "-O3",
            "-lineinfo",
            "-Xcompiler",
            "-fPIC",
            "--expt-relaxed-constexpr",
            *_cuda_arch_flags(tc.archs),
            *source_flags("cuda", includes),
            "-c",
            str(source),
            "-o",
            str(obj),
        ]
    arch = tc.archs[0]
    return [
        tc.compiler,
        "-x",
        "musa",
        "-std=c++17",
        "-O3",
        "-fPIC",
        f"--offload-arch=mp_{arch}",
        *source_flags("musa", includes, arch),
        "-c",
        str(source),
        "-o",
        str(obj),
    ]


def link_command(tc: Toolchain, objs: list[Path], out: Path, tvm_lib_dir: str) -> list[str]:
    common = [*map(str, objs), "-o", str(out), f"-L{tvm_lib_dir}", "-ltvm_ffi"]
    if tc.backend == "cuda":  # nvcc links the CUDA runtime statically by default
        return [tc.compiler, "-shared", *_cuda_arch_flags(tc.archs), *common]
    musa_lib = Path(tc.compiler).parent.parent / "lib"
    return [tc.compiler, "-shared", f"-L{musa_lib}", "-lmusart", f"-Wl,-rpath,{musa_lib}", *common]


class Progress:
    """Progress lines for a person. Always on stderr; also on the terminal (/dev/tty) when a
    PEP 517 frontend captures both stdout and stderr and will not show them: pip without -v
    shows only its spinner until the build ends (with -v it prints the build's output itself).
    MUSPACE_QUIET=1: silent."""

    def __init__(self, env=None, use_tty: bool = True):
        env = os.environ if env is None else env
        self.quiet = env.get("MUSPACE_QUIET", "") == "1"
        self.tty = None
        self.lock = threading.Lock()
        if use_tty and not self.quiet and _output_hidden(env):
            try:
                self.tty = open("/dev/tty", "w")  # closed by close()
            except OSError:
                self.tty = None

    def say(self, line: str) -> None:
        if self.quiet:
            return
        with self.lock:
            print(line, file=sys.stderr, flush=True)
            if self.tty is not None:
                # On its own line, ending in spaces: pip's spinner overwrites the last
                # character written, and then sits after our line instead of inside it.
                try:
                    self.tty.write(f"\n{line}  ")
                    self.tty.flush()
                except OSError:
                    pass

    def close(self) -> None:
        if self.tty is not None:
            try:
                self.tty.close()
            except OSError:
                pass
            self.tty = None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _output_hidden(env) -> bool:
    """Whether a build frontend captures this process's output without showing it: a PEP 517
    hook (PEP517_BUILD_BACKEND) with stdout and stderr not terminals, and not pip -v."""
    if "PEP517_BUILD_BACKEND" not in env or _isatty(sys.stdout) or _isatty(sys.stderr):
        return False
    if env.get("PIP_VERBOSE", "0") not in ("", "0"):
        return False
    try:  # the hook runs as a child of pip: its command line says whether -v was given
        args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    words = [a.decode(errors="replace") for a in args]
    verbose = any(w == "--verbose" or (w.startswith("-v") and set(w[1:]) == {"v"}) for w in words)
    return not verbose


def _run_checked(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"mu_space native build: {what} failed (exit {proc.returncode})\n"
            f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
        )


def build(
    plan: BuildPlan,
    out_dir: Path,
    jobs: int | None = None,
    verbose: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Compile every source in parallel, link one library into `out_dir`, write build_info."""
    tc = plan.toolchain
    if tc is None:
        raise RuntimeError(f"no native build possible: {plan.skip_reason}")
    own_progress = progress is None
    progress = progress or Progress()
    try:
        return _build(plan, tc, Path(out_dir), jobs, verbose, progress)
    finally:
        if own_progress:
            progress.close()


def _schedule(sources: list[str]) -> list[str]:
    """Largest sources first (a proxy for compile time), so the longest compile starts early."""
    return sorted(sources, key=lambda src: -(ROOT / src).stat().st_size)


def _build(
    plan: BuildPlan, tc: Toolchain, out_dir: Path, jobs, verbose: bool, progress: Progress
) -> Path:
    includes, tvm_lib_dir, tvm_ffi_version = _tvm_ffi_paths()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Objects in a private directory: concurrent builds (other outputs) never share them.
    with tempfile.TemporaryDirectory(prefix="muspace-objs-") as obj_dir:
        return _compile_and_link(
            plan,
            tc,
            out_dir,
            Path(obj_dir),
            includes,
            tvm_lib_dir,
            tvm_ffi_version,
            jobs,
            verbose,
            progress,
        )


def _compile_and_link(
    plan, tc, out_dir, obj_dir, includes, tvm_lib_dir, tvm_ffi_version, jobs, verbose, progress
) -> Path:
    jobs = jobs or int(os.environ.get("MAX_JOBS", 0)) or os.cpu_count() or 1
    started = time.time()
    # the digest of what is compiled, taken before compiling: a source edited during the build
    # must leave the library stale (recorded after, it marked such a library current)
    digest = sources_digest()
    total = len(plan.sources)
    counter = iter(range(1, total + 1))

    def compile_one(src: str) -> Path:
        obj = obj_dir / (src.replace("/", "__") + ".o")
        cmd = compile_command(tc, ROOT / src, obj, includes)
        with progress.lock:
            step = next(counter)
        progress.say(f"mu_space: [{step}/{total}] compiling {src}")
        if verbose:
            print("$", " ".join(cmd), flush=True)
        _run_checked(cmd, f"compiling {src}")
        return obj

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(_schedule(plan.sources), pool.map(compile_one, _schedule(plan.sources))))
    objs = [done[src] for src in plan.sources]
    library = out_dir / LIBRARY_FILE
    progress.say(f"mu_space: linking {library}")
    # Linked next to it and renamed: a process loading the library never sees a partial file.
    partial = out_dir / f".{LIBRARY_FILE}.{os.getpid()}.partial"
    try:
        _run_checked(link_command(tc, objs, partial, tvm_lib_dir), "linking")
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
    info = {
        "backend": tc.backend,
        "archs": tc.archs,
        "arch_source": tc.arch_source,
        "compiler": tc.compiler,
        "compiler_version": tc.version,
        "tvm_ffi_version": tvm_ffi_version,
        "sources": plan.sources,
        "sources_sha256": digest,
        "build_seconds": round(time.time() - started, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    progress.say(
        f"mu_space: built {library} for {tc.backend} {','.join(tc.archs)} "
        f"in {info['build_seconds']} s"
    )
    return library


def describe(plan: BuildPlan) -> str:
    if plan.toolchain is None:
        return f"mu_space: building without the native library: {plan.skip_reason}"
    tc = plan.toolchain
    found = f" (found via {tc.compiler_source})" if tc.compiler_source else ""
    return (
        f"mu_space: native {tc.backend} build with {tc.compiler}{found} for "
        f"{','.join(tc.archs)} ({tc.arch_source}), {len(plan.sources)} sources"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Build the muSPACE native library.")
    parser.add_argument("--inplace", action="store_true", help="build into mu_space/_lib/")
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    parser.add_argument("--plan", action="store_true", help="print the plan and exit")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument(
        "--if-stale",
        action="store_true",
        help="skip the build when the output holds a library of the same csrc/, backend and archs",
    )
    args = parser.parse_args(argv)
    plan = detect_toolchain()
    progress = Progress()
    try:
        progress.say(describe(plan))
        if args.plan:
            print(
                json.dumps(
                    {
                        "toolchain": asdict(plan.toolchain) if plan.toolchain else None,
                        "skip_reason": plan.skip_reason,
                        "sources": plan.sources,
                    },
                    indent=2,
                )
            )
            return 0
        if plan.toolchain is None:
            return 1
        out = args.out or (ROOT / PACKAGE_LIB_DIR if args.inplace else ROOT / "build" / "lib")
        if args.if_stale and (info := current_build(out, plan.toolchain)):
            progress.say(f"mu_space: {out / LIBRARY_FILE} is current (built {info['built_at']})")
            return 0
        build(plan, out, jobs=args.jobs, verbose=args.verbose, progress=progress)
        return 0
    finally:
        progress.close()


if __name__ == "__main__":
    sys.exit(main())
