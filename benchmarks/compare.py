"""Old vs new build: one markdown table per benchmark, case by case, with a noise verdict.

    python -m benchmarks.compare OLD.json NEW.json
    python -m benchmarks.compare --old OLD_RUN1.json OLD_RUN2.json --new NEW_RUN1.json NEW_RUN2.json
        [--committed benchmarks/results/h200/<bench>.json] [--title TEXT]

Each file is one run of one benchmark script (any harness version: the results of
`bench_overhead` before it used the harness, with "variant" / "us_per_call", are read too).
Cases are matched by (name, direction, dtype), or by name alone where a file's records have no
direction. Per case: the old and new median (the mean of the runs' medians), new / old, the
noise band and the verdict.

Noise band (in us), from the run itself; the largest of
- 2 x the spread between the runs of one build (max - min of its medians; the larger of the
  old and the new spread): how far two runs of the *same* code land apart in this session;
- 3 x the standard error of new - old from each run's own p10-p90 range (sigma ~ (p90 - p10) /
  2.563, the median's standard error ~ 1.2533 sigma / sqrt(reps), averaged over the runs);
- 2% of the old median (clock and timer granularity).
|new - old| <= band: "same"; new < old - band: "faster"; new > old + band: "SLOWER". A case
failed or missing on either side says so. Exit status 1 when any case is SLOWER or failed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

FLOOR = 0.02  # fraction of the old median
SPREAD_FACTOR = 2.0
SE_FACTOR = 3.0
SIGMA_PER_P10_P90 = 2.563  # p90 - p10 of a normal distribution, in sigmas
MEDIAN_SE = 1.2533  # standard error of a sample median, in sigma / sqrt(n)


def load(path: Path | str) -> dict:
    return json.loads(Path(path).read_text())


def normalized(doc: dict) -> list[dict]:
    """The records as {name, direction, dtype, ok, median, p10, p90, reps}."""
    out = []
    for r in doc.get("results", []):
        median = r.get("median_us", r.get("us_per_call"))
        out.append(
            {
                "name": r.get("name", r.get("variant")),
                "direction": r.get("direction"),
                "dtype": r.get("dtype"),
                "ok": r.get("status", "ok") == "ok" and median is not None,
                "median": median,
                "p10": r.get("p10_us"),
                "p90": r.get("p90_us"),
                "reps": r.get("reps") or doc.get("trials"),
            }
        )
    return out


def _by_name_only(runs: list[list[dict]]) -> bool:
    return any(r["direction"] is None for run in runs for r in run)


def keyed(runs: list[list[dict]], by_name: bool) -> dict:
    """key -> [the record of each run that has it], keys in first-seen order."""
    cases: dict = {}
    for run in runs:
        for r in run:
            key = (r["name"],) if by_name else (r["name"], r["direction"], r["dtype"])
            cases.setdefault(key, []).append(r)
    return cases


def _median_se(r: dict) -> float:
    if r["p10"] is None or r["p90"] is None or not r["reps"]:
        return 0.0
    sigma = (r["p90"] - r["p10"]) / SIGMA_PER_P10_P90
    return MEDIAN_SE * sigma / math.sqrt(r["reps"])


def _side(records: list[dict]) -> tuple[float, float, float]:
    """(mean of the medians, spread of the medians, standard error of that mean)."""
    medians = [r["median"] for r in records]
    se = math.sqrt(statistics.fmean(_median_se(r) ** 2 for r in records) / len(records))
    return statistics.fmean(medians), max(medians) - min(medians), se


def verdict(old: list[dict], new: list[dict]) -> dict:
    """The comparison of one case: old / new medians, ratio, band (us) and verdict."""
    row = {"old": None, "new": None, "ratio": None, "band": None, "verdict": None}
    if not old or not new:
        row["verdict"] = "only in new" if not old else "only in old"
    elif not all(r["ok"] for r in old) or not all(r["ok"] for r in new):
        bad = [side for side, rs in (("old", old), ("new", new)) if not all(r["ok"] for r in rs)]
        row["verdict"] = "FAILED " + "+".join(bad)
    if row["verdict"] is not None:
        return row
    o, o_spread, o_se = _side(old)
    n, n_spread, n_se = _side(new)
    band = max(
        FLOOR * o,
        SPREAD_FACTOR * max(o_spread, n_spread),
        SE_FACTOR * math.sqrt(o_se**2 + n_se**2),
    )
    diff = n - o
    row.update(old=o, new=n, ratio=n / o if o else None, band=band)
    row["verdict"] = "same" if abs(diff) <= band else ("faster" if diff < 0 else "SLOWER")
    return row


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def compare(
    old_docs: list[dict], new_docs: list[dict], committed: dict | None = None, title: str = ""
) -> tuple[str, dict]:
    """(markdown, verdict counts) for the runs of one benchmark on the two builds."""
    old_runs = [normalized(d) for d in old_docs]
    new_runs = [normalized(d) for d in new_docs]
    committed_runs = [normalized(committed)] if committed else []
    by_name = _by_name_only(old_runs + new_runs + committed_runs)
    old_cases, new_cases = keyed(old_runs, by_name), keyed(new_runs, by_name)
    committed_cases = keyed(committed_runs, by_name)
    bench = title or new_docs[0].get("benchmark") or old_docs[0].get("benchmark")
    reps = sorted({str(r["reps"]) for run in old_runs + new_runs for r in run if r["reps"]})
    lines = [
        f"### {bench}",
        "",
        f"old: {_commits(old_docs)}, {len(old_docs)} run(s); new: {_commits(new_docs)}, "
        f"{len(new_docs)} run(s); {'/'.join(reps) or '?'} reps per case; medians in us.",
        "",
        "| case | direction | dtype | old | new | new/old | noise band | verdict |"
        + (" committed |" if committed else ""),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |" + (" ---: |" if committed else ""),
    ]
    counts: dict = {}
    for key in list(old_cases) + [k for k in new_cases if k not in old_cases]:
        old, new = old_cases.get(key, []), new_cases.get(key, [])
        row = verdict(old, new)
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
        first = (old or new)[0]
        band = None if row["band"] is None else 100.0 * row["band"] / row["old"]
        line = (
            f"| {first['name']} | {first['direction'] or '-'} | {first['dtype'] or '-'} | "
            f"{_fmt(row['old'], '.1f')} | {_fmt(row['new'], '.1f')} | "
            f"{_fmt(row['ratio'], '.3f')} | {_fmt(band, '.1f')}{'%' if band is not None else ''} | "
            f"{row['verdict']} |"
        )
        if committed:
            c = committed_cases.get(key, [])
            line += f" {_fmt(c[0]['median'] if c and c[0]['ok'] else None, '.1f')} |"
        lines.append(line)
    lines += [
        "",
        f"{sum(counts.values())} cases: " + ", ".join(f"{n} {v}" for v, n in counts.items()),
    ]
    return "\n".join(lines), counts


def _commits(docs: list[dict]) -> str:
    commits = dict.fromkeys(str((d.get("metadata") or {}).get("git_commit")) for d in docs)
    return "/".join(commits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path, help="OLD.json NEW.json (one run each)")
    p.add_argument("--old", nargs="+", type=Path, default=[], help="the old build's runs")
    p.add_argument("--new", nargs="+", type=Path, default=[], help="the new build's runs")
    p.add_argument("--committed", type=Path, help="a committed results file: a column for it")
    p.add_argument("--title", default="", help="heading (default: the benchmark's name)")
    a = p.parse_args(argv)
    old, new = list(a.old), list(a.new)
    if a.files:
        if len(a.files) != 2 or old or new:
            p.error("give OLD.json NEW.json, or --old ... --new ...")
        old, new = [a.files[0]], [a.files[1]]
    if not old or not new:
        p.error("need at least one old and one new results file")
    committed = load(a.committed) if a.committed and a.committed.exists() else None
    text, counts = compare([load(f) for f in old], [load(f) for f in new], committed, a.title)
    print(text)
    print()
    bad = sum(n for v, n in counts.items() if v == "SLOWER" or v.startswith("FAILED"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
