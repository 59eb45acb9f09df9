"""Declarative performance targets and their verdicts (pure Python: report.py reads them too).

A benchmark script lists `Target`s; the harness evaluates them on the run's records, prints one
line per matched case and stores the verdicts under "targets" in the results JSON:

    {"case", "direction", "dtype", "metric", "op", "target", "value", "met", "note"}

`met` is null when the case was not measured (it failed, or the metric is missing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# metric (a field of a result record) -> (unit shown after the value, number format)
METRICS = {
    "median_us": (" us", ".1f"),
    "pct_of_copy_bw": ("% of copy bw", ".1f"),
    "gbps": (" GB/s", ".0f"),
    "speedup_vs_reference": ("x vs reference", ".2f"),
}
OPS = ("<=", ">=")


@dataclass(frozen=True)
class Target:
    """`metric op value` for every case whose name matches `cases` (a regex, whole name), and
    whose direction / dtype equal the given ones (None: any). `note` says where it comes from."""

    cases: str
    metric: str
    op: str
    value: float
    note: str = ""
    direction: str | None = None
    dtype: str | None = None

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"target metric must be one of {sorted(METRICS)}, got {self.metric!r}")
        if self.op not in OPS:
            raise ValueError(f"target op must be one of {OPS}, got {self.op!r}")
        re.compile(self.cases)

    def matches(self, record: dict) -> bool:
        return (
            re.fullmatch(self.cases, record["name"]) is not None
            and self.direction in (None, record.get("direction"))
            and self.dtype in (None, record.get("dtype"))
        )

    def verdict(self, record: dict) -> dict:
        value = record.get(self.metric) if record.get("status", "ok") == "ok" else None
        met = None
        if value is not None:
            met = value <= self.value if self.op == "<=" else value >= self.value
        return {
            "case": record["name"],
            "direction": record.get("direction"),
            "dtype": record.get("dtype"),
            "metric": self.metric,
            "op": self.op,
            "target": self.value,
            "value": value,
            "met": met,
            "note": self.note,
        }


def evaluate(records: list[dict], targets) -> list[dict]:
    """One verdict per (target, matching record), in target order."""
    return [t.verdict(r) for t in targets for r in records if t.matches(r)]


def format_value(metric: str, value: float | None) -> str:
    unit, spec = METRICS[metric]
    return "-" if value is None else f"{format(value, spec)}{unit}"


def state(verdict: dict) -> str:
    return {True: "MET", False: "MISSED", None: "NOT MEASURED"}[verdict["met"]]


def format_line(v: dict) -> str:
    """`target CASE (direction dtype): VALUE (target OP X): STATE [note]`."""
    unit, spec = METRICS[v["metric"]]
    note = f" [{v['note']}]" if v.get("note") else ""
    return (
        f"target {v['case']} ({v['direction']} {v['dtype']}): "
        f"{format_value(v['metric'], v['value'])} (target {v['op']} "
        f"{format(v['target'], spec)}{unit}): {state(v)}{note}"
    )
