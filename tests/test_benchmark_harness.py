"""CPU tests of the benchmark harness (benchmarks/harness.py, targets.py, report.py, plot.py,
compare.py), and every benchmark script's smoke run on the CPU."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import compare, harness, report
from benchmarks.harness import Case, Target

REPO = Path(__file__).resolve().parents[1]
BENCHES = (
    "copy_bandwidth",
    "overhead",
    "bev_pool_v2",
    "bev_pool_prepare",
    "bev_pool",
    "bev_pool_v3",
    "multi_scale_deformable_attn",
)


class FakeClock:
    """Stands in for perf_counter; the benchmarked functions advance it by their 'cost'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, us: float):
        self.now += us * 1e-6


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """Run as on a machine without a GPU even where one exists (CPU timing, so the fake clock
    and call counts apply; smoke runs on the CPU)."""
    monkeypatch.setattr(harness, "gpu_available", lambda: False)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(harness, "_clock", fake)
    return fake


def parse(*argv):
    return harness.common_argparser("test").parse_args(list(argv))


def make_case(name="case-a", fn=None, reference=None, check=None, nbytes=1_000_000, **kw):
    return Case(
        name=name,
        op="toy",
        direction="forward",
        dtype=torch.float32,
        params={"n": 4},
        compulsory_bytes=nbytes,
        fn=fn or (lambda x: x + 1),
        make_args=lambda: (torch.arange(4.0),),
        reference=reference,
        check=check,
        **kw,
    )


# --------------------------------------------------------------------------- timing math


def test_percentile_interpolates():
    values = [float(v) for v in range(1, 101)]
    assert harness.percentile(values, 0) == 1.0
    assert harness.percentile(values, 100) == 100.0
    assert harness.percentile(values, 10) == pytest.approx(10.9)
    assert harness.percentile([5.0], 90) == 5.0


def test_time_cpu_statistics_and_rotation(clock):
    costs = iter([7.0] * 3 + [float(v) for v in range(100, 0, -1)])  # 3 warm-up calls first
    seen = []

    def fn(x):
        seen.append(int(x))
        clock.spend(next(costs))

    counter = iter(range(1000))
    timing = harness.time_cpu(
        fn, lambda: torch.tensor(next(counter)), reps=100, warmup=3, n_arg_sets=3
    )
    assert timing.reps == 100 and timing.mode == "cpu" and timing.n_arg_sets == 3
    assert timing.median_us == pytest.approx(50.5)
    assert timing.mean_us == pytest.approx(50.5)
    assert timing.p10_us == pytest.approx(10.9)
    assert timing.p90_us == pytest.approx(90.1)
    assert seen[:6] == [0, 1, 2, 0, 1, 2]  # warm-up and timed calls rotate over the 3 sets
    assert len(seen) == 103


def test_time_cpu_real_clock_is_ordered():
    timing = harness.time_cpu(lambda x: x.sum(), lambda: torch.ones(1000), reps=20, warmup=2)
    assert 0 < timing.p10_us <= timing.median_us <= timing.p90_us


def test_arg_sets_needed():
    l2 = 50 * harness.MiB
    assert harness.arg_sets_needed(10 * harness.MiB, l2, flush=True) == 1
    assert harness.arg_sets_needed(10 * harness.MiB, l2, flush=False) == 11  # 110 MiB > 2 x L2
    assert harness.arg_sets_needed(1 << 30, l2, flush=False) == 1
    assert harness.arg_sets_needed(1, l2, flush=False) == harness.MAX_ARG_SETS
    assert harness.tensor_bytes((torch.zeros(3), [torch.zeros(2, dtype=torch.int64)], 5)) == 28


def test_gbps_and_pct_math():
    assert harness.achieved_gbps(2_000_000_000, 1000.0) == pytest.approx(2000.0)
    assert harness.pct_of_copy(2000.0, 4000.0) == pytest.approx(50.0)
    assert harness.pct_of_copy(2000.0, None) is None


# --------------------------------------------------------------------------- cases


def test_run_cases_reports_bandwidth_and_speedup(clock):
    def fn(x):
        clock.spend(10.0)
        return x * 2

    def reference(x):
        clock.spend(40.0)
        return x + x

    case = make_case(fn=fn, reference=reference, nbytes=1_000_000)
    (rec,) = harness.run_cases([case], args=parse("--reps", "100"), copy_bw=400.0)
    assert rec["status"] == "ok" and rec["checked"] is True and rec["error"] is None
    assert rec["reps"] == 100 and rec["median_us"] == pytest.approx(10.0)
    assert rec["gbps"] == pytest.approx(100.0)  # 1e6 bytes in 10 us
    assert rec["pct_of_copy_bw"] == pytest.approx(25.0)
    assert rec["reference_median_us"] == pytest.approx(40.0)
    assert rec["speedup_vs_reference"] == pytest.approx(4.0)
    assert rec["dtype"] == "float32"
    # --no-reference-timing: still checked against the reference, not timed
    (rec,) = harness.run_cases([case], args=parse("--no-reference-timing"), copy_bw=400.0)
    assert rec["checked"] is True and rec.get("reference_median_us") is None
    assert rec.get("speedup_vs_reference") is None


def test_failing_check_is_recorded_and_not_timed():
    calls = {"bad": 0, "good": 0}

    def bad(x):
        calls["bad"] += 1
        return x

    def good(x):
        calls["good"] += 1
        return x + 1

    def check(out, ref):
        assert torch.equal(out, ref), "native differs from reference"

    cases = [
        make_case("bad", fn=bad, reference=lambda x: x + 1, check=check),
        make_case("good", fn=good, reference=lambda x: x + 1, check=check),
    ]
    records = harness.run_cases(cases, args=parse("--reps", "5", "--warmup", "1"), copy_bw=1.0)
    bad_rec, good_rec = records
    assert calls["bad"] == 1  # the check call only
    assert bad_rec["status"] == "failed" and bad_rec["checked"] is False
    assert "native differs from reference" in bad_rec["error"]
    assert bad_rec["median_us"] is None and bad_rec["gbps"] is None
    assert calls["good"] == 1 + 1 + 5  # check, warm-up, reps
    assert good_rec["status"] == "ok" and good_rec["checked"] is True
    assert harness.exit_status(records) == 1
    assert harness.exit_status([good_rec]) == 0


def test_default_check_catches_mismatch_and_errors():
    mismatch = make_case("mismatch", reference=lambda x: x)  # fn is x + 1
    raising = make_case("raising", fn=lambda x: 1 / 0, reference=lambda x: x)
    unchecked = make_case("unchecked")
    records = harness.run_cases(
        [mismatch, raising, unchecked], args=parse("--reps", "3", "--warmup", "0"), copy_bw=1.0
    )
    assert [r["status"] for r in records] == ["failed", "failed", "ok"]
    assert "AssertionError" in records[0]["error"]
    assert "ZeroDivisionError" in records[1]["error"]
    assert records[2]["checked"] is False and records[2]["speedup_vs_reference"] is None


def test_skipped_case_is_neither_run_nor_a_failure():
    def never(x):
        raise AssertionError("a skipped case ran")

    case = make_case("graph-only", fn=never, reference=never, skip="needs a CUDA GPU")
    (rec,) = harness.run_cases([case], args=parse("--reps", "3", "--warmup", "0"), copy_bw=1.0)
    assert rec["status"] == "skipped" and rec["error"] == "needs a CUDA GPU"
    assert rec["median_us"] is None and rec["checked"] is False
    assert harness.exit_status([rec]) == 0
    assert "skipped: needs a CUDA GPU" in harness.format_table([rec])
    failed = make_case("bad", fn=never, reference=lambda x: x)
    assert harness.exit_status(harness.run_cases([failed], args=parse(), copy_bw=1.0)) == 1


def test_check_without_reference_is_rejected():
    with pytest.raises(ValueError, match="without a reference"):
        make_case(check=lambda out, ref: None)


def test_argparser_defaults_and_case_filter():
    args = parse()
    assert (args.no_flush, args.graph, args.quick, args.smoke) == (False, False, False, False)
    assert args.out is None and args.cases is None and args.no_write is False
    assert harness.timing_settings(args) == {
        "reps": 100,
        "warmup": 10,
        "flush": True,
        "graph": False,
        "time_reference": True,
    }
    assert harness.timing_settings(parse("--no-reference-timing"))["time_reference"] is False
    assert harness.run_mode(args) == "full" and harness.copy_nbytes(args) == 2 * harness.GiB
    quick, smoke = parse("--quick"), parse("--smoke")
    assert (harness.timing_settings(quick)["reps"], harness.timing_settings(quick)["warmup"]) == (
        30,
        5,
    )
    assert harness.copy_nbytes(quick) == 2 * harness.GiB  # the same roofline as a full run
    assert harness.run_mode(smoke) == "smoke" and harness.timing_settings(smoke)["reps"] == 3
    assert harness.copy_nbytes(smoke) < harness.copy_nbytes(quick)
    assert harness.timing_settings(parse("--quick", "--reps", "7"))["reps"] == 7  # explicit wins
    cases = [make_case("bevdet-r50-256x704"), make_case("sweep-n-1000")]
    picked = harness.select_cases(cases, parse("--cases", "^bevdet").cases)
    assert [c.name for c in picked] == ["bevdet-r50-256x704"]


def test_result_stem_labels_variants():
    assert harness.result_stem("bev_pool", parse()) == "bev_pool"
    assert harness.result_stem("bev_pool", parse("--graph")) == "bev_pool.graph"
    warm_quick = parse("--no-flush", "--quick")
    assert harness.result_stem("bev_pool", warm_quick) == "bev_pool.warm-l2.quick"
    assert harness.result_stem("bev_pool", parse("--smoke")) == "bev_pool.smoke"


def test_gpu_slug():
    assert harness.gpu_slug("NVIDIA H200") == "h200"
    assert harness.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert harness.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert harness.gpu_slug("MTT S4000") == "mtt-s4000"


def test_environment_metadata_is_json_serialisable():
    meta = harness.environment_metadata()
    for key in (
        "gpu_name",
        "sm_count",
        "l2_bytes",
        "driver_version",
        "cuda_version",
        "torch_version",
        "tvm_ffi_version",
        "mu_space_version",
        "python_version",
        "git_commit",
        "date_utc",
    ):
        assert key in meta
    assert meta["torch_version"] == torch.__version__
    assert meta["date_utc"].endswith("+00:00")
    json.dumps(meta)


# --------------------------------------------------------------------------- output


def _sample_records(clock):
    def fn(x):
        clock.spend(20.0)
        return x + 1

    cases = [make_case("bevdet-r50-256x704", fn=fn, reference=lambda x: x + 1)]
    for n in (1000, 10000, 100000):
        cases.append(
            Case(
                name=f"sweep-n_points-{n}",
                op="toy",
                direction="backward",
                dtype="float16",
                params={"sweep": "n_points", "n_points": n},
                compulsory_bytes=n * 8,
                fn=fn,
                make_args=lambda: (torch.zeros(2),),
            )
        )
    return harness.run_cases(cases, args=parse("--reps", "5", "--warmup", "0"), copy_bw=1000.0)


def test_write_results_round_trip(tmp_path, clock, capsys):
    records = _sample_records(clock)
    meta = {"gpu_name": "NVIDIA H200", "git_commit": "abc1234-dirty"}
    path = harness.write_results("toy", records, tmp_path / "h200", meta, 1000.0)
    assert path == tmp_path / "h200" / "toy.json"
    doc = json.loads(path.read_text())
    assert set(doc) == {"benchmark", "metadata", "copy_bandwidth_gbps", "results", "targets"}
    assert doc["targets"] == []
    assert doc["benchmark"] == "toy" and doc["metadata"] == meta
    assert doc["copy_bandwidth_gbps"] == 1000.0
    assert doc["results"] == json.loads(json.dumps(records))
    assert doc["results"][0]["pct_of_copy_bw"] == pytest.approx(5.0)  # 1e6 B / 20 us = 50 GB/s
    table = capsys.readouterr().out
    assert "bevdet-r50-256x704" in table and "% copy bw" in table and "50.0" in table


def test_table_marks_failures():
    settings = {"reps": 1, "warmup": 0, "flush": True, "graph": False}
    rec = harness.run_case(make_case("broken", reference=lambda x: x), settings, 1.0)
    assert "FAILED: check failed" in harness.format_table([rec])


def test_sweep_key():
    from benchmarks.plot import sweep_key

    assert sweep_key({"params": {"sweep": "n_points", "n_points": 10}}) == "n_points"
    assert sweep_key({"params": {"sweep": "n_points", "n_points": "many"}}) is None
    assert sweep_key({"params": {"n_points": 10}}) is None


def test_plot_writes_png(tmp_path, clock):
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    path = harness.write_results("toy", _sample_records(clock), tmp_path, {}, 1000.0)
    # a profile's JSON (a list) in the same tree is skipped, not a crash
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "profile.json").write_text("[{}]")
    assert plot.main([str(tmp_path)]) == 0
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "profiles" / "profile.png").exists()


# --------------------------------------------------------------------------- checks


def test_close_check_uses_the_tolerance_table():
    check = harness.close_check("bev_pool_v2")  # float32 row: atol 1e-4
    want = torch.ones(8)
    check(want + 5e-5, want)
    with pytest.raises(AssertionError, match="out of tolerance"):
        check(want + 1e-3, want)
    with pytest.raises(AssertionError):
        harness.close_check(None)(want + 5e-5, want)  # the float32 default is tighter
    check((want, None), (want.clone(), None))  # tuples, None compared as None
    with pytest.raises(AssertionError):
        check((want, None), (want, want))
    ints = torch.arange(5, dtype=torch.int32)
    harness.close_check("sort_by_cell")(ints, ints.clone())
    with pytest.raises(AssertionError):
        harness.close_check("sort_by_cell")(ints + 1, ints)  # integers: exact


def test_default_check_is_the_table_of_the_case_op():
    case = make_case("near", fn=lambda x: x + 5e-5, reference=lambda x: x)
    case.op = "bev_pool"  # atol 1e-4 for float32
    (rec,) = harness.run_cases([case], args=parse("--reps", "1", "--warmup", "0"), copy_bw=1.0)
    assert rec["status"] == "ok" and rec["checked"] is True


# --------------------------------------------------------------------------- targets


def _record(name, direction="forward", dtype="float32", status="ok", **metrics):
    return {"name": name, "direction": direction, "dtype": dtype, "status": status, **metrics}


def test_targets_match_and_verdicts():
    from benchmarks import targets

    records = [
        _record("cfg-forward-float32", median_us=5.0, pct_of_copy_bw=60.0),
        _record("cfg-forward-float16", dtype="float16", median_us=9.0),
        _record("cfg-backward-float32", direction="backward", status="failed", median_us=None),
        _record("other-forward-float32", median_us=1.0),
    ]
    ts = [
        Target(r"cfg-.*", "median_us", "<=", 7.5, "issue 3"),
        Target("cfg-forward-float32", "pct_of_copy_bw", ">=", 50.0),
        Target("cfg", "median_us", "<=", 1.0),  # whole-name match: "cfg" matches nothing
        Target(r"cfg-.*", "median_us", "<=", 7.5, direction="forward", dtype="float16"),
    ]
    verdicts = targets.evaluate(records, ts)
    assert [(v["case"], v["met"]) for v in verdicts] == [
        ("cfg-forward-float32", True),
        ("cfg-forward-float16", False),
        ("cfg-backward-float32", None),  # failed: not measured
        ("cfg-forward-float32", True),
        ("cfg-forward-float16", False),
    ]
    v = verdicts[0]
    assert set(v) == {
        "case",
        "direction",
        "dtype",
        "metric",
        "op",
        "target",
        "value",
        "met",
        "note",
    }
    assert targets.format_line(v) == (
        "target cfg-forward-float32 (forward float32): 5.0 us (target <= 7.5 us): MET [issue 3]"
    )
    assert "NOT MEASURED" in targets.format_line(verdicts[2])
    assert "60.0% of copy bw (target >= 50.0% of copy bw): MET" in targets.format_line(verdicts[3])
    with pytest.raises(ValueError, match="metric"):
        Target("x", "p50", "<=", 1.0)
    with pytest.raises(ValueError, match="op"):
        Target("x", "median_us", "<", 1.0)


def test_targets_are_evaluated_printed_and_written(tmp_path, clock, capsys, monkeypatch):
    monkeypatch.setattr(harness, "measure_copy_bandwidth", lambda device, nbytes: 100.0)

    def fn(x):
        clock.spend(10.0)
        return x + 1

    def build(args):
        return [make_case("bevdet-r50", fn=fn, reference=lambda x: x + 1)]

    ts = (Target("bevdet-.*", "median_us", "<=", 5.0, "issue 3"),)
    rc = harness.run_benchmark(
        "toy", build, parse("--smoke", "--out", str(tmp_path)), targets=ts, needs_native=False
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "target bevdet-r50 (forward float32): 10.0 us (target <= 5.0 us): MISSED" in out
    doc = json.loads((tmp_path / "toy.smoke.json").read_text())
    assert doc["targets"][0]["met"] is False and doc["targets"][0]["value"] == pytest.approx(10.0)
    assert doc["metadata"]["run_mode"] == "smoke"
    table = report.markdown_table(doc)
    assert "| bevdet-r50 | forward | float32 | <= 5.0 us | 10.0 us | MISSED | issue 3 |" in table


def test_committed_target_verdicts_match_the_scripts_targets():
    """The verdicts stored in the committed results are what the scripts' TARGETS give on the
    committed records (same cases, values and outcomes)."""
    from benchmarks import targets

    for bench in ("bev_pool", "bev_pool_prepare"):
        doc = json.loads((REPO / "benchmarks/results/h200" / f"{bench}.json").read_text())
        module = importlib.import_module(f"benchmarks.bench_{bench}")
        fresh = targets.evaluate(doc["results"], module.TARGETS)
        assert [(v["case"], v["value"], v["met"]) for v in fresh] == [
            (v["case"], v["value"], v["met"]) for v in doc["targets"]
        ], bench


# --------------------------------------------------------------------------- host timing


def test_time_host_counts_calls_per_trial(clock):
    calls = []

    def fn():
        calls.append(1)
        clock.spend(2.0)

    timing = harness.time_host(fn, lambda: (), calls=50, trials=3, warmup=4)
    assert len(calls) == 4 + 3 * 50
    assert timing.mode == "host" and timing.reps == 3
    assert timing.median_us == pytest.approx(2.0)


def test_zero_byte_case_has_no_bandwidth(clock):
    (rec,) = harness.run_cases(
        [make_case(nbytes=0)], args=parse("--reps", "2", "--warmup", "0"), copy_bw=10.0
    )
    assert rec["status"] == "ok" and rec["gbps"] is None and rec["pct_of_copy_bw"] is None


# --------------------------------------------------------------------------- where it runs


def test_output_dir_rules(tmp_path, monkeypatch):
    assert harness.output_dir(parse("--smoke")) is None
    assert harness.output_dir(parse()) is None  # no GPU: never into the source tree
    assert harness.output_dir(parse("--smoke", "--out", str(tmp_path))) == tmp_path
    assert harness.output_dir(parse("--out", str(tmp_path), "--no-write")) is None
    monkeypatch.setattr(harness, "gpu_available", lambda: True)
    monkeypatch.setattr(harness, "gpu_slug", lambda name=None: "h200")
    assert harness.output_dir(parse()) == harness.RESULTS_ROOT / "h200"
    assert harness.output_dir(parse("--quick")) == harness.RESULTS_ROOT / "h200"
    assert harness.output_dir(parse("--smoke")) is None


@pytest.mark.parametrize("argv", [(), ("--graph", "--no-flush"), ("--no-reference-timing",)])
def test_a_gpu_run_hands_time_gpu_its_timing_settings_only(monkeypatch, argv):
    """Every run option in timing_settings that is not time_gpu's (time_reference) stays out of
    its call (a --no-reference-timing build passed it on and failed every GPU case,
    2026-12-05)."""
    seen = {}
    real = inspect.signature(harness.time_gpu)

    def fake_time_gpu(fn, make_args, **kwargs):
        real.bind(fn, make_args, **kwargs)  # what the real time_gpu accepts (TypeError if not)
        seen.update(kwargs)
        return harness.summarize([1.0, 2.0, 3.0], "fake")

    monkeypatch.setattr(harness, "gpu_available", lambda: True)
    monkeypatch.setattr(harness, "time_gpu", fake_time_gpu)
    settings = harness.timing_settings(parse(*argv))
    harness._time(lambda x: x, lambda: (torch.zeros(1),), settings)
    assert seen == {k: settings[k] for k in ("reps", "warmup", "flush", "graph")}


@pytest.mark.parametrize("bench", BENCHES)
def test_without_gpu_a_bench_refuses_in_one_line(bench, capsys):
    module = importlib.import_module(f"benchmarks.bench_{bench}")
    start = time.perf_counter()
    assert module.main([]) == harness.EXIT_CANNOT_RUN
    assert time.perf_counter() - start < 5.0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert f"bench_{bench}: needs a CUDA GPU" in lines[0] and "--smoke" in lines[0]


@pytest.mark.parametrize("bench", BENCHES)
def test_smoke_run_on_the_cpu(bench, tmp_path, capsys):
    """Each script end to end on tiny inputs: every case checked against its reference and
    timed, the JSON written where --out says, and report.py renders it."""
    module = importlib.import_module(f"benchmarks.bench_{bench}")
    assert module.main(["--smoke", "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    assert path.name == f"{bench}.smoke.json"
    doc = json.loads(path.read_text())
    ran = [r for r in doc["results"] if r["status"] != "skipped"]  # (CUDA-only cases say why)
    assert ran and all(r["status"] == "ok" for r in ran)
    assert all(r["error"] for r in doc["results"] if r["status"] == "skipped")
    assert all(r["mode"] in ("cpu", "host") for r in ran)
    assert len(doc["targets"]) == len(
        harness.evaluate_targets(doc["results"], getattr(module, "TARGETS", ()))
    )
    assert report.markdown_table(doc)


def test_smoke_run_writes_nothing_without_out(tmp_path, monkeypatch):
    from benchmarks import bench_copy_bandwidth

    monkeypatch.setattr(harness, "RESULTS_ROOT", tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    assert bench_copy_bandwidth.main(["--smoke"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_every_script_exits_promptly_without_a_gpu():
    """`python -m benchmarks.bench_<name>` with no GPU visible: exit 1 with one line naming
    --smoke, in about the time of importing torch (all scripts at once)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MUSA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    procs = {
        b: subprocess.Popen(
            [sys.executable, "-m", f"benchmarks.bench_{b}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for b in BENCHES
    }
    for bench, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == harness.EXIT_CANNOT_RUN, (bench, out, err)
        assert out == "" and len(err.strip().splitlines()) == 1 and "--smoke" in err, bench
    assert time.perf_counter() - start < 60


# --------------------------------------------------------------------------- report, compare


def test_report_tables_read_the_committed_results():
    """benchmarks.report turns every committed results file into a markdown table (the docs
    quote them), including bench_overhead's former format, and the target verdicts."""
    files = sorted((REPO / "benchmarks" / "results").glob("*/*.json"))
    assert files, "no committed benchmark results"
    for f in files:
        doc = json.loads(f.read_text())
        table = report.markdown_table(doc)
        rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
        n_targets = len(doc.get("targets", []))
        expected = len(doc["results"]) + 1 + (n_targets + 1 if n_targets else 0)
        assert len(rows) == expected, f.name  # header + one row per result (and per target)
        assert "targets" not in doc["metadata"], f.name  # the one format: top-level "targets"


def _run_doc(medians: dict, spread=0.0, commit="abc", **extra) -> dict:
    results = []
    for name, med in medians.items():
        results.append(
            {
                "name": name,
                "direction": "forward",
                "dtype": "float32",
                "status": "ok" if med is not None else "failed",
                "median_us": med,
                "p10_us": None if med is None else med - spread,
                "p90_us": None if med is None else med + spread,
                "reps": 30,
                **extra,
            }
        )
    return {"benchmark": "toy", "metadata": {"git_commit": commit}, "results": results}


def test_compare_verdicts_and_noise_band():
    old = [
        _run_doc({"a": 100.0, "b": 100.0, "c": 100.0, "d": 10.0, "gone": 1.0}),
        _run_doc({"a": 104.0, "b": 100.0, "c": 100.0, "d": 10.0, "gone": 1.0}),
    ]
    new = [
        _run_doc({"a": 109.0, "b": 90.0, "c": 110.0, "d": None, "added": 2.0}, commit="def"),
        _run_doc({"a": 109.0, "b": 90.0, "c": 110.0, "d": None, "added": 2.0}, commit="def"),
    ]
    text, counts = compare.compare(old, new)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    # a: old runs 4 us apart -> band 8 us; +7 us is within it
    assert rows["a"].endswith("| same |") and "7.8%" in rows["a"]
    assert rows["b"].endswith("| faster |") and rows["c"].endswith("| SLOWER |")
    assert rows["d"].endswith("| FAILED new |")
    assert rows["gone"].endswith("| only in old |") and rows["added"].endswith("| only in new |")
    assert counts == {"same": 1, "faster": 1, "SLOWER": 1, "FAILED new": 1, "only in old": 1,
                      "only in new": 1}  # fmt: skip
    assert "old: abc, 2 run(s); new: def, 2 run(s); 30 reps per case" in text


def test_compare_reads_the_former_overhead_format(tmp_path):
    committed = REPO / "benchmarks/results/h200/overhead.json"
    doc = json.loads(committed.read_text())
    new = {  # the harness format of the same variants
        "benchmark": "overhead",
        "metadata": {},
        "results": [
            {"name": r["variant"], "direction": "forward", "dtype": "float32", "status": "ok",
             "median_us": r["us_per_call"], "p10_us": None, "p90_us": None, "reps": 5}
            for r in doc["results"]
        ],
    }  # fmt: skip
    path = tmp_path / "new.json"
    path.write_text(json.dumps(new))
    assert compare.main([str(committed), str(path)]) == 0
    text, counts = compare.compare([doc], [new])
    assert counts == {"same": len(doc["results"])}


def test_tools_import_without_private_names():
    """The GPU-only tools import on a CPU (no names that the op layer may drop)."""
    for name in ("benchmarks.tune_points_per_block", "benchmarks.profile_kernels"):
        importlib.import_module(name)
    from benchmarks import tune_points_per_block

    assert tune_points_per_block.main([]) == 1  # needs the native library on a GPU


def test_benchmarks_use_no_private_names_of_the_ops():
    """benchmarks/ imports only public names of mu_space.ops.* (the op layer's private names
    may change at any time)."""
    import ast

    for path in sorted((REPO / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mu_space.ops"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name}: from {node.module} import {private}"
        assert 'sys.modules["mu_space.ops' not in path.read_text(), path.name


def test_profile_kernels_table_sums_launches_per_call():
    """benchmarks/profile_kernels.py --torch-profiler: a kernel's launches are summed and divided
    by the calls, largest first, the tail folded into one row, shares of the wall time."""
    from benchmarks.profile_kernels import kernel_table

    table = kernel_table([("sort", 100.0), ("emit", 50.0), ("sort", 100.0)], 2, 200.0, top=1)
    assert table.splitlines() == [
        "wall 200.0 us per call; kernels 125.0 us",
        "| kernel | us per call | % of wall |",
        "|---|---|---|",
        "| `sort` | 100.0 | 50% |",
        "| (1 more) | 25.0 | 12% |",
    ]
