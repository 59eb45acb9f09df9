"""CPU tests of the benchmark harness (benchmarks/harness.py, benchmarks/plot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import harness
from benchmarks.harness import Case


class FakeClock:
    """Stands in for perf_counter; the benchmarked functions advance it by their 'cost'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def spend(self, us: float):
        self.now += us * 1e-6


@pytest.fixture(autouse=True)
def cpu_timing(monkeypatch):
    """Time on the CPU even where a GPU exists, so the fake clock and call counts apply."""
    monkeypatch.setattr(harness, "_on_gpu", lambda: False)


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


def test_check_without_reference_is_rejected():
    with pytest.raises(ValueError, match="without a reference"):
        make_case(check=lambda out, ref: None)


def test_argparser_defaults_and_case_filter():
    args = parse()
    assert (args.reps, args.warmup, args.no_flush, args.graph, args.quick) == (
        100,
        10,
        False,
        False,
        False,
    )
    assert args.out is None and args.cases is None and args.no_write is False
    assert harness.timing_settings(args) == {
        "reps": 100,
        "warmup": 10,
        "flush": True,
        "graph": False,
    }
    assert harness.timing_settings(parse("--quick"))["reps"] == 10
    cases = [make_case("bevdet-r50-256x704"), make_case("sweep-n-1000")]
    picked = harness.select_cases(cases, parse("--cases", "^bevdet").cases)
    assert [c.name for c in picked] == ["bevdet-r50-256x704"]


def test_result_stem_labels_variants():
    assert harness.result_stem("bev_pool", parse()) == "bev_pool"
    assert harness.result_stem("bev_pool", parse("--graph")) == "bev_pool.graph"
    warm_quick = parse("--no-flush", "--quick")
    assert harness.result_stem("bev_pool", warm_quick) == "bev_pool.warm-l2.quick"


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
    assert set(doc) == {"benchmark", "metadata", "copy_bandwidth_gbps", "results"}
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
    assert plot.main([str(tmp_path)]) == 0
    png = path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_tables_read_the_committed_results():
    """benchmarks.report turns every committed results file into a markdown table (the docs
    quote them), including bench_overhead's own format."""
    from benchmarks import report

    files = sorted(
        (Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*/*.json")
    )
    assert files, "no committed benchmark results"
    for f in files:
        doc = json.loads(f.read_text())
        table = report.markdown_table(doc)
        rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
        assert len(rows) == len(doc["results"]) + 1, f.name  # header + one row per result
