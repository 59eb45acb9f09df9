"""Shared benchmark harness (the standard is docs/benchmark_standard.md).

A benchmark script declares a `build_cases(args)` function and its `Target`s; its `main` is one
call, `harness.main("<bench>", build_cases, argv, doc=__doc__, targets=TARGETS)`. The harness
parses the common options, decides once whether this machine can run the benchmark (a CUDA GPU
with the native library; `--smoke` runs anywhere on tiny inputs), checks each case against its
reference, times it on the GPU with CUDA events (cold L2 by default), evaluates the targets and
writes the results as JSON under `benchmarks/results/<gpu>/` together with the environment
metadata and the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.targets import Target, format_line
from benchmarks.targets import evaluate as evaluate_targets

MiB = 1 << 20
GiB = 1 << 30
FLUSH_MIN_BYTES = 256 * MiB
MAX_ARG_SETS = 128
SPACER_CYCLES = 1_000_000  # ~0.5 ms of GPU sleep at 2 GHz queued before each timed call
# The warm-up runs at least this long as well as its count: 5 warm-up calls of a ~60-us call
# left the first case of a run 27-38 us slower than the same call in the next case (H200,
# 2026-12-02, bench_voxelization: pointpillars-kitti hard-det 102.1 us, then hard-nondet, the
# same kernels, 64.1 us).
WARMUP_MIN_S = 0.025
RESULTS_ROOT = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent
# run mode -> (reps, warm-up calls, bytes of the copy-bandwidth measurement)
RUN_MODES = {
    "full": (100, 10, 2 * GiB),
    "quick": (30, 5, 2 * GiB),  # model cases only (no size sweeps), fewer reps
    "smoke": (3, 1, 16 * MiB),  # tiny inputs, anywhere (CPU too): does the script run?
}
EXIT_CANNOT_RUN = 1

_clock = time.perf_counter  # module attribute so tests can substitute a fake clock
_FLUSH_BUFFERS: dict[torch.device, torch.Tensor] = {}


# --------------------------------------------------------------------------- timing


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    mean_us: float
    reps: int
    mode: str  # "cold-l2" | "warm-l2" | "graph" (GPU) or "cpu"
    n_arg_sets: int = 1


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of an ascending list."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_us: list[float], mode: str, n_arg_sets: int = 1) -> Timing:
    values = sorted(samples_us)
    return Timing(
        median_us=statistics.median(values),
        p10_us=percentile(values, 10),
        p90_us=percentile(values, 90),
        mean_us=statistics.fmean(values),
        reps=len(values),
        mode=mode,
        n_arg_sets=n_arg_sets,
    )


def l2_cache_bytes(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def flush_l2(device: torch.device | str) -> None:
    """Evict the L2 by writing a cached buffer of max(256 MiB, 2 x L2) bytes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _FLUSH_BUFFERS.get(device)
    if buf is None:
        nbytes = max(FLUSH_MIN_BYTES, 2 * l2_cache_bytes(device))
        buf = _FLUSH_BUFFERS[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    buf.zero_()


def tensor_bytes(obj: Any) -> int:
    """Total bytes of the tensors in obj (nested tuples, lists and dict values)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return 0


def arg_sets_needed(set_bytes: int, l2_bytes: int, flush: bool) -> int:
    """One set when flushing; otherwise enough sets to exceed 2 x L2 (at most MAX_ARG_SETS)."""
    if flush:
        return 1
    if set_bytes <= 0:
        return MAX_ARG_SETS
    return max(1, min(MAX_ARG_SETS, 2 * l2_bytes // set_bytes + 1))


def _gpu_spacer() -> None:
    """Queue GPU idle time so the host runs ahead: events then time the device, not Python."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(SPACER_CYCLES)


def _as_args(made: Any) -> tuple:
    return made if isinstance(made, tuple) else (made,)


def _make_arg_sets(make_args: Callable, n_arg_sets: int | None, flush: bool, device) -> list:
    first = _as_args(make_args())
    if n_arg_sets is None:
        n_arg_sets = arg_sets_needed(tensor_bytes(first), l2_cache_bytes(device), flush)
    return [first] + [_as_args(make_args()) for _ in range(n_arg_sets - 1)]


def _graph_replayer(fn: Callable, arg_sets: list) -> Callable[[int], Any]:
    """Capture fn once per argument set (after an eager call on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graphs = []
    for args in arg_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        graphs.append(graph)
    return lambda i: graphs[i % len(graphs)].replay()


def device_kernel_times(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    """Device time per call of each kernel (summed over its launches) that `calls` calls of `fn`
    launch, from torch.profiler (CUPTI), largest first; {} without a CUDA device. The per-kernel
    split of the profile scripts (benchmarks/profile_*.py) where neither ncu nor nsys is there."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    per_call: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_call[event.key] = (
                per_call.get(event.key, 0.0) + event.self_device_time_total / calls
            )
    return dict(sorted(per_call.items(), key=lambda kv: -kv[1]))


def _warm_up(call: Callable[[int], Any], calls: int, device) -> None:
    """`calls` untimed calls, then more until WARMUP_MIN_S has passed (at most 1000 in all);
    none for calls = 0."""
    start = _clock()
    i = 0
    while i < calls or (0 < calls and i < 1000 and _clock() - start < WARMUP_MIN_S):
        call(i)
        i += 1
        if i >= calls:
            torch.cuda.synchronize(device)  # the clock then counts device time too


def time_gpu(
    fn: Callable,
    make_args: Callable[[], Any],
    *,
    reps: int = 100,
    warmup: int = 10,
    n_arg_sets: int | None = None,
    flush: bool = True,
    graph: bool = False,
    spacer: bool = True,
) -> Timing:
    """Time single calls of fn(*args) with CUDA events on the current device and stream.

    make_args() returns the positional arguments (a tuple, or one non-tuple argument). The
    calls rotate over n_arg_sets argument sets. With flush, L2 is flushed before every rep,
    outside the event pair; then a GPU sleep is queued so the host enqueues the call before the
    device reaches it (spacer=False: none, so the device idles until the host's first launch,
    and the host work before it is inside the timing). With graph, fn is captured once per set
    and the replays are timed.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    arg_sets = _make_arg_sets(make_args, n_arg_sets, flush, device)
    if graph:
        call = _graph_replayer(fn, arg_sets)
    else:
        call = lambda i: fn(*arg_sets[i % len(arg_sets)])  # noqa: E731
    _warm_up(call, warmup, device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for i, (start, end) in enumerate(events):
        if flush:
            flush_l2(device)
        if spacer:
            _gpu_spacer()
        else:
            torch.cuda.synchronize(device)  # the device idle when the call starts
        start.record()
        call(i)
        end.record()
    torch.cuda.synchronize(device)
    samples = [start.elapsed_time(end) * 1e3 for start, end in events]
    mode = "graph" if graph else ("cold-l2" if flush else "warm-l2")
    return summarize(samples, mode, len(arg_sets))


def time_cpu(
    fn: Callable,
    make_args: Callable[[], Any],
    *,
    reps: int = 100,
    warmup: int = 10,
    n_arg_sets: int = 1,
) -> Timing:
    """CPU counterpart of time_gpu (perf_counter around each call); mode "cpu"."""
    arg_sets = [_as_args(make_args()) for _ in range(n_arg_sets)]
    for i in range(warmup):
        fn(*arg_sets[i % n_arg_sets])
    samples = []
    for i in range(reps):
        args = arg_sets[i % n_arg_sets]
        start = _clock()
        fn(*args)
        samples.append((_clock() - start) * 1e6)
    return summarize(samples, "cpu", n_arg_sets)


def time_host(
    fn: Callable, make_args: Callable[[], Any], *, calls: int, trials: int, warmup: int = 200
) -> Timing:
    """Host time per call: `calls` back-to-back calls of fn(*args), then one device sync, per
    trial (mode "host"). For calls whose device work is shorter than their host work (the
    queue never fills), so this is the Python / dispatch overhead in front of the kernel."""
    args = _as_args(make_args())
    sync = torch.cuda.synchronize if gpu_available() else (lambda: None)
    for _ in range(warmup):
        fn(*args)
    sync()
    samples = []
    for _ in range(trials):
        start = _clock()
        for _ in range(calls):
            fn(*args)
        sync()
        samples.append((_clock() - start) / calls * 1e6)
    return summarize(samples, "host")


def achieved_gbps(nbytes: int, median_us: float) -> float:
    """Decimal GB/s of moving nbytes in median_us microseconds."""
    return nbytes / median_us / 1e3


def pct_of_copy(gbps: float, copy_bw_gbps: float | None) -> float | None:
    return 100.0 * gbps / copy_bw_gbps if copy_bw_gbps else None


def measure_copy_bandwidth(
    device: torch.device | str = "cuda", nbytes: int = 2 * GiB, reps: int = 20
) -> float:
    """GB/s of dst.copy_(src) on one device, counting bytes read plus bytes written."""
    device = torch.device(device)

    def make_args():
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return src, torch.empty_like(src)

    copy = lambda src, dst: dst.copy_(src)  # noqa: E731
    if device.type == "cuda":
        with torch.cuda.device(device):
            timing = time_gpu(copy, make_args, reps=reps, warmup=3, n_arg_sets=1, flush=False)
    else:
        timing = time_cpu(copy, make_args, reps=reps, warmup=2)
    return achieved_gbps(2 * nbytes, timing.median_us)


# --------------------------------------------------------------------------- cases


def close_check(op: str | None) -> Callable[[Any, Any], None]:
    """A Case.check through the one tolerance table: `mu_space.testing.tolerances.assert_close`
    with `tolerance(op, dtype)` of each result (tensors, or tuples of tensors / None, compared
    element by element; integer results exactly)."""
    from mu_space.testing import tolerances

    def check(out: Any, ref: Any) -> None:
        tolerances.assert_close(out, ref, op=op, name=op or "out")

    return check


@dataclass
class Case:
    """One timed configuration. fn(*make_args()) is the path under test.

    compulsory_bytes counts each input read once and each output written once (0: not a
    bandwidth case). When reference is given, fn and reference run on the same arguments (fn
    first) and check(out, ref_out) (default: close_check(op)) must pass before the case is
    timed. timer(fn, make_args, settings) -> Timing replaces the harness's device timing (e.g.
    `time_host` for host overhead); the reference is timed the same way. skip: why this case
    cannot run here (recorded with status "skipped", neither checked nor timed; not a failure).
    """

    name: str
    op: str
    direction: str
    dtype: Any
    params: dict
    compulsory_bytes: int
    fn: Callable
    make_args: Callable[[], Any]
    reference: Callable | None = None
    check: Callable[[Any, Any], None] | None = None
    time_reference: bool = True
    timer: Callable[[Callable, Callable, dict], Timing] | None = None
    skip: str = ""

    def __post_init__(self):
        if self.check is not None and self.reference is None:
            raise ValueError(f"case {self.name!r}: check given without a reference")


def backward_args(
    forward: Callable[..., Any], inputs: tuple, grad_out: torch.Tensor
) -> Callable[[], tuple]:
    """make_args of a backward case timed through the public API's autograd: leaves (detached
    views of `inputs`, the tensors to differentiate) and out = forward(*leaves), built outside
    the timed region; pair it with fn=autograd_backward (or deterministic(autograd_backward))."""

    def make_args():
        leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
        return forward(*leaves), leaves, grad_out

    return make_args


def autograd_backward(out: torch.Tensor, leaves: tuple, grad_out: torch.Tensor) -> tuple:
    """Every gradient of out w.r.t. leaves; the graph is kept for the next repetition."""
    return torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


@contextlib.contextmanager
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) inside, the previous setting restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def deterministic(fn: Callable) -> Callable:
    """fn called under deterministic_algorithms() (the public way to ask an op for its
    deterministic path)."""

    @functools.wraps(fn)
    def call(*args):
        with deterministic_algorithms():
            return fn(*args)

    return call


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def check_case(case: Case) -> bool:
    """Run fn (and the reference) on one argument set; True when checked against a reference.

    Raises whatever fn, reference or check raise (AssertionError on mismatch).
    """
    args = _as_args(case.make_args())
    out = case.fn(*args)
    if case.reference is None:
        return False
    ref = case.reference(*args)
    (case.check or close_check(case.op))(out, ref)
    return True


def run_mode(args: argparse.Namespace) -> str:
    """The run mode: "smoke", "quick" or "full" (see RUN_MODES)."""
    if getattr(args, "smoke", False):
        return "smoke"
    return "quick" if args.quick else "full"


def timing_settings(args: argparse.Namespace) -> dict:
    """reps and warm-up of the run mode unless given explicitly, flush and graph flags."""
    reps, warmup, _ = RUN_MODES[run_mode(args)]
    return {
        "reps": reps if args.reps is None else args.reps,
        "warmup": warmup if args.warmup is None else args.warmup,
        "flush": not args.no_flush,
        "graph": args.graph,
        "time_reference": not getattr(args, "no_reference_timing", False),
    }


def gpu_available() -> bool:
    """The one place that decides whether this run has a CUDA GPU (tests substitute it)."""
    return torch.cuda.is_available()


def native_available() -> bool:
    """A CUDA GPU with the native library built for it."""
    from mu_space.runtime import native

    return gpu_available() and native.unavailable_reason(default_device()) is None


def backend() -> str:
    """The backend the benchmarked calls ask for: "native" where the native library runs;
    elsewhere (a smoke run on a CPU) "auto", i.e. the reference path."""
    return "native" if native_available() else "auto"


def _time(fn: Callable, make_args: Callable, settings: dict, timer=None) -> Timing:
    if timer is not None:
        return timer(fn, make_args, settings)
    if gpu_available():
        timing = {k: settings[k] for k in ("reps", "warmup", "flush", "graph")}
        return time_gpu(fn, make_args, **timing)
    return time_cpu(fn, make_args, reps=settings["reps"], warmup=settings["warmup"])


def _empty_record(case: Case) -> dict:
    return {
        "name": case.name,
        "op": case.op,
        "direction": case.direction,
        "dtype": dtype_name(case.dtype),
        "params": case.params,
        "compulsory_bytes": int(case.compulsory_bytes),
        "status": "failed",
        "checked": False,
        "error": None,
        "mode": None,
        "reps": None,
        "n_arg_sets": None,
        "median_us": None,
        "p10_us": None,
        "p90_us": None,
        "mean_us": None,
        "gbps": None,
        "pct_of_copy_bw": None,
        "reference_median_us": None,
        "speedup_vs_reference": None,
        "reference_error": None,
    }


def _time_reference(case: Case, settings: dict, record: dict) -> None:
    try:
        ref = _time(case.reference, case.make_args, settings, case.timer)
    except Exception as exc:  # the reference may not support this mode (e.g. graph capture)
        record["reference_error"] = f"{type(exc).__name__}: {exc}"
        return
    record["reference_median_us"] = ref.median_us
    record["speedup_vs_reference"] = ref.median_us / record["median_us"]


def run_case(case: Case, settings: dict, copy_bw: float | None) -> dict:
    """Check, then time one case. Failures are recorded in the dict, never raised."""
    record = _empty_record(case)
    if case.skip:
        record.update(status="skipped", error=case.skip)
        return record
    try:
        record["checked"] = check_case(case)
    except Exception as exc:
        record["error"] = f"check failed: {type(exc).__name__}: {exc}"
        return record
    try:
        timing = _time(case.fn, case.make_args, settings, case.timer)
    except Exception as exc:
        record["error"] = f"timing failed: {type(exc).__name__}: {exc}"
        return record
    record.update(asdict(timing), status="ok")
    if case.compulsory_bytes:
        record["gbps"] = achieved_gbps(case.compulsory_bytes, timing.median_us)
        record["pct_of_copy_bw"] = pct_of_copy(record["gbps"], copy_bw)
    if case.reference is not None and case.time_reference and settings.get("time_reference", True):
        _time_reference(case, settings, record)
    return record


def _progress(cases: list[Case], desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(cases, desc=desc, unit="case", file=sys.stderr)
        return
    for i, case in enumerate(cases, 1):
        print(f"\r{desc}: {i}/{len(cases)} {case.name:<48}", end="", file=sys.stderr, flush=True)
        yield case
    print(file=sys.stderr)


def select_cases(cases: list[Case], pattern: str | None) -> list[Case]:
    return [c for c in cases if pattern is None or re.search(pattern, c.name)]


def run_cases(
    cases: list[Case], *, args: argparse.Namespace, copy_bw: float | None = None
) -> list[dict]:
    """Check and time the cases selected by args.cases; copy_bw is measured if not given."""
    if copy_bw is None:
        copy_bw = measure_copy_bandwidth(default_device(), copy_nbytes(args))
    settings = timing_settings(args)
    selected = select_cases(cases, args.cases)
    return [run_case(case, settings, copy_bw) for case in _progress(selected, "benchmark")]


def exit_status(records: list[dict]) -> int:
    """0 when every case passed its check and was timed (or was skipped), 1 otherwise."""
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


# --------------------------------------------------------------------------- environment


def default_device() -> torch.device:
    if gpu_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def copy_nbytes(args: argparse.Namespace) -> int:
    return RUN_MODES[run_mode(args)][2]


def gpu_slug(name: str | None = None) -> str:
    """Short directory name for a device: "NVIDIA H200" -> "h200"; "cpu" without a GPU."""
    if name is None:
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = re.sub(r"^(nvidia|moore threads)\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown"


def _command_output(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD (+ "-dirty"); on a machine whose copy of the tree has no .git (the GPU machine),
    the commit is passed in MUSPACE_GIT_COMMIT."""
    if os.environ.get("MUSPACE_GIT_COMMIT"):
        return os.environ["MUSPACE_GIT_COMMIT"]
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"])
    if commit and _command_output(["git", "status", "--porcelain"]):
        commit += "-dirty"
    return commit


def _module_version(name: str) -> str | None:
    try:
        module = __import__(name)
    except Exception:  # absent, or present but broken (e.g. native library missing)
        return None
    return getattr(module, "__version__", None)


def _gpu_metadata() -> dict:
    if not torch.cuda.is_available():
        return {
            "gpu_name": None,
            "sm_count": None,
            "l2_bytes": None,
            "gpu_memory_bytes": None,
            "driver_version": None,
        }
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "gpu_name": props.name,
        "sm_count": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "gpu_memory_bytes": props.total_memory,
        "driver_version": driver.splitlines()[0] if driver else None,
    }


def environment_metadata() -> dict:
    return {
        **_gpu_metadata(),
        "cuda_version": torch.version.cuda,
        "torch_version": torch.__version__,
        "tvm_ffi_version": _module_version("tvm_ffi"),
        "mu_space_version": _module_version("mu_space"),
        "python_version": platform.python_version(),
        "git_commit": git_commit(),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# --------------------------------------------------------------------------- CLI and output


def common_argparser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--reps", type=int, help="timed repetitions (default 100; --quick 30, --smoke 3)"
    )
    parser.add_argument(
        "--warmup", type=int, help="untimed warm-up calls (default 10; --quick 5, --smoke 1)"
    )
    parser.add_argument(
        "--no-flush", action="store_true", help="do not flush L2 before each rep (labelled warm-l2)"
    )
    parser.add_argument("--graph", action="store_true", help="time CUDA graph replays")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="model cases only (no size sweeps), 30 reps; writes <bench>.quick.json",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny inputs, 3 reps, runs without a GPU too (the reference path); writes nothing "
        "unless --out",
    )
    parser.add_argument("--cases", metavar="REGEX", help="only cases whose name matches")
    parser.add_argument(
        "--no-reference-timing",
        action="store_true",
        help="check against the reference but do not time it (no speedup column; A/B runs)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="results directory (default benchmarks/results/<gpu>/; none for --smoke)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    return parser


def result_stem(bench_name: str, args: argparse.Namespace) -> str:
    """bench_name for the headline cold-L2 run; labelled variants get a suffix."""
    settings = timing_settings(args)
    mode = "graph" if settings["graph"] else ("cold-l2" if settings["flush"] else "warm-l2")
    size = run_mode(args)
    parts = (
        [bench_name] + ([mode] if mode != "cold-l2" else []) + ([size] if size != "full" else [])
    )
    return ".".join(parts)


def output_dir(args: argparse.Namespace) -> Path | None:
    """Where the JSON goes: --out; else benchmarks/results/<gpu>/ for a GPU run that is not a
    smoke run; else nowhere (a CPU run never writes into the source tree by default)."""
    if args.no_write:
        return None
    if args.out is not None:
        return Path(args.out)
    if run_mode(args) == "smoke" or not gpu_available():
        return None
    return RESULTS_ROOT / gpu_slug()


def cannot_run(args: argparse.Namespace, needs_native: bool = True) -> str | None:
    """Why this machine cannot run the benchmark (None: it can). A smoke run runs anywhere."""
    if run_mode(args) == "smoke":
        return None
    if not gpu_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    if needs_native:
        from mu_space.runtime import native

        reason = native.unavailable_reason(default_device())
        if reason is not None:
            return f"needs the native library on the GPU: {reason}"
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: list[dict]) -> str:
    header = ("name", "direction", "dtype", "median us", "GB/s", "% copy bw", "speedup", "")
    rows = [header]
    for r in records:
        note = "" if r.get("checked") else "unchecked"
        if r.get("status") == "skipped":
            note = "skipped: " + " ".join(str(r.get("error")).split())[:200]
        elif r.get("status") != "ok":
            note = "FAILED: " + " ".join(str(r.get("error")).split())[:200]
        rows.append(
            (
                r["name"],
                r["direction"],
                r["dtype"],
                _fmt(r.get("median_us"), ".1f"),
                _fmt(r.get("gbps"), ".1f"),
                _fmt(r.get("pct_of_copy_bw"), ".1f"),
                _fmt(r.get("speedup_vs_reference"), ".2f"),
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        + "  "
        + row[-1]
        for row in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def print_table(records: list[dict]) -> None:
    print(format_table(records))


def print_verdicts(verdicts: list[dict]) -> None:
    for v in verdicts:
        print(format_line(v))


def write_results(
    bench_name: str,
    records: list[dict],
    out_dir: Path | str,
    metadata: dict,
    copy_bw: float | None,
    targets: list[dict] | None = None,
) -> Path:
    """Write <out_dir>/<bench_name>.json and print the table; returns the file path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bench_name}.json"
    doc = {
        "benchmark": bench_name,
        "metadata": metadata,
        "copy_bandwidth_gbps": copy_bw,
        "results": records,
        "targets": targets or [],
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print_table(records)
    print(f"copy bandwidth {_fmt(copy_bw, '.1f')} GB/s; wrote {path}")
    return path


def run_benchmark(
    bench_name: str,
    cases: list[Case] | Callable[[argparse.Namespace], list[Case]],
    args: argparse.Namespace,
    *,
    targets: tuple[Target, ...] | list[Target] = (),
    needs_native: bool = True,
) -> int:
    """The one runner: refuse promptly where the benchmark cannot run, build the cases (a list,
    or build_cases(args)), measure copy bandwidth, check and time the cases, evaluate the
    targets, print the table and verdicts, write the JSON; returns the exit status."""
    reason = cannot_run(args, needs_native)
    if reason is not None:
        print(
            f"bench_{bench_name}: {reason}; `python -m benchmarks.bench_{bench_name} --smoke` "
            "runs a quick smoke run on tiny inputs instead (writes nothing unless --out)",
            file=sys.stderr,
        )
        return EXIT_CANNOT_RUN
    if run_mode(args) == "smoke":
        print(
            f"bench_{bench_name}: smoke run on {default_device()} with tiny inputs "
            f"(backend {backend()!r}): the timings are not measurements",
            file=sys.stderr,
        )
    if callable(cases):
        cases = cases(args)
    nbytes = copy_nbytes(args)
    copy_bw = measure_copy_bandwidth(default_device(), nbytes)
    records = run_cases(cases, args=args, copy_bw=copy_bw)
    verdicts = evaluate_targets(records, targets)
    out_dir = output_dir(args)
    if out_dir is None:
        print_table(records)
    else:
        metadata = {
            **environment_metadata(),
            "copy_bandwidth_bytes": nbytes,
            "timing": timing_settings(args),
            "run_mode": run_mode(args),
            "argv": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        write_results(result_stem(bench_name, args), records, out_dir, metadata, copy_bw, verdicts)
    print_verdicts(verdicts)
    failed = [r["name"] for r in records if r["status"] not in ("ok", "skipped")]
    if failed:
        print(f"{len(failed)} case(s) failed: {', '.join(failed)}", file=sys.stderr)
    return exit_status(records)


def main(
    bench_name: str,
    build_cases: Callable[[argparse.Namespace], list[Case]],
    argv: list[str] | None = None,
    *,
    doc: str | None = None,
    targets: tuple[Target, ...] | list[Target] = (),
    needs_native: bool = True,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """A benchmark script's whole main: the common options (plus the script's own, added by
    add_arguments), then run_benchmark."""
    description = (doc or bench_name).strip().splitlines()[0]
    parser = common_argparser(description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    return run_benchmark(bench_name, build_cases, args, targets=targets, needs_native=needs_native)
