"""Markdown tables from benchmark results, for docs to quote:

python -m benchmarks.report benchmarks/results/h200/bev_pool_v2.json [--cases REGEX]

The results table, then (when the file has target verdicts) a table of the targets.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks import targets


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def overhead_table(doc: dict) -> str:
    """bench_overhead's results in the format it wrote before it used the harness (records with
    "variant" and "us_per_call"): microseconds per call of each calling variant."""
    meta = doc["metadata"]
    lines = [
        f"{meta.get('gpu_name')}, torch {meta.get('torch_version')}, commit "
        f"{meta.get('git_commit')}, {meta.get('date_utc')}; {doc.get('calls')} calls x "
        f"{doc.get('trials')} trials (median).",
        "",
        "| variant | us per call | ratio to torch.add |",
        "| --- | ---: | ---: |",
    ]
    for r in doc["results"]:
        lines.append(
            f"| {r['variant']} | {_fmt(r.get('us_per_call'), '.2f')} | "
            f"{_fmt(r.get('ratio_to_torch_add'), '.2f')} |"
        )
    return "\n".join(lines)


_MODES = {
    "cold-l2": "cold L2",
    "warm-l2": "warm L2",
    "graph": "CUDA graph replays",
    "host": "host time per call",
    "cpu": "CPU",
}


def _timing(doc: dict) -> str:
    """How the cases were timed, from the records: "cold L2, median of 100 reps"."""
    timed = [r for r in doc["results"] if r.get("mode")]
    modes = ", ".join(dict.fromkeys(_MODES.get(r["mode"], r["mode"]) for r in timed)) or "-"
    reps = "/".join(dict.fromkeys(str(r["reps"]) for r in timed)) or "n"
    label = "trials" if {r["mode"] for r in timed} == {"host"} else "reps"
    return f"{modes}, median of {reps} {label}"


def targets_table(verdicts: list[dict], pattern: str | None = None) -> str:
    """The target verdicts of a results file ("targets": see benchmarks/targets.py)."""
    lines = [
        "| case | direction | dtype | target | measured | verdict | source |",
        "| --- | --- | --- | --- | ---: | --- | --- |",
    ]
    for v in verdicts:
        if pattern and not re.search(pattern, v["case"]):
            continue
        unit, spec = targets.METRICS[v["metric"]]
        lines.append(
            f"| {v['case']} | {v['direction']} | {v['dtype']} | "
            f"{v['op']} {format(v['target'], spec)}{unit} | "
            f"{targets.format_value(v['metric'], v['value'])} | {targets.state(v)} | "
            f"{v.get('note') or ''} |"
        )
    return "\n".join(lines)


def markdown_table(doc: dict, pattern: str | None = None) -> str:
    """The results table of one file, followed by its targets table when it has verdicts."""
    if doc.get("results") and "variant" in doc["results"][0]:
        return overhead_table(doc)
    meta = doc["metadata"]
    lines = [
        f"{meta.get('gpu_name')}, torch {meta.get('torch_version')}, CUDA "
        f"{meta.get('cuda_version')}, commit {meta.get('git_commit')}, {meta.get('date_utc')}; "
        f"copy bandwidth {_fmt(doc.get('copy_bandwidth_gbps'), '.0f')} GB/s; {_timing(doc)}.",
        "",
        "| case | direction | dtype | median us | GB/s | % copy bw | speedup vs reference |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in doc["results"]:
        if pattern and not re.search(pattern, r["name"]):
            continue
        status = "" if r.get("status") == "ok" else f" ({r.get('status')})"
        lines.append(
            f"| {r['name']}{status} | {r['direction']} | {r['dtype']} | "
            f"{_fmt(r.get('median_us'), '.1f')} | {_fmt(r.get('gbps'), '.0f')} | "
            f"{_fmt(r.get('pct_of_copy_bw'), '.1f')} | "
            f"{_fmt(r.get('speedup_vs_reference'), '.1f')} |"
        )
    if doc.get("targets"):
        lines += ["", targets_table(doc["targets"], pattern)]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--cases", help="only cases whose name matches")
    args = parser.parse_args(argv)
    print(markdown_table(json.loads(args.results.read_text()), args.cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
