"""Turn benchmark results JSON files into PNG charts next to them.

    python -m benchmarks.plot [results_dir]      (default: every file under benchmarks/results)

Per file: a bar chart of median time per case, grouped by direction/dtype and annotated with the
% of copy bandwidth; and, for sweep cases (params {"sweep": "<key>", "<key>": <number>}), one
log-log plot of median time against that parameter per sweep key.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness import RESULTS_ROOT


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("benchmarks.plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sweep_key(record: dict) -> str | None:
    """The swept parameter name when params["sweep"] names a numeric param, else None."""
    params = record.get("params") or {}
    key = params.get("sweep")
    value = params.get(key) if isinstance(key, str) else None
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return key if numeric else None


def _unique(items):
    return list(dict.fromkeys(items))


def _pct_label(record: dict) -> str:
    pct = record.get("pct_of_copy_bw")
    return "" if pct is None else f"{pct:.0f}%"


def _bar_chart(ax, records: list[dict]) -> None:
    groups = _unique((r["direction"], r["dtype"]) for r in records)
    names = _unique(r["name"] for r in records)
    width = 0.8 / len(groups)
    for g, group in enumerate(groups):
        rows = [
            (names.index(r["name"]), r) for r in records if (r["direction"], r["dtype"]) == group
        ]
        xs = [i - 0.4 + width * (g + 0.5) for i, _ in rows]
        bars = ax.bar(xs, [r["median_us"] for _, r in rows], width, label=" ".join(group))
        ax.bar_label(bars, labels=[_pct_label(r) for _, r in rows], fontsize=7)
    times = [r["median_us"] for r in records]
    if max(times) > 50 * min(times):
        ax.set_yscale("log")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("median time (us)")
    ax.set_title("cases (bar labels: % of copy bandwidth)")
    ax.legend(fontsize=8)


def _sweep_chart(ax, key: str, records: list[dict]) -> None:
    series = _unique((r["direction"], r["dtype"]) for r in records)
    for s, (direction, dtype) in enumerate(series):
        rows = sorted(
            (r for r in records if (r["direction"], r["dtype"]) == (direction, dtype)),
            key=lambda r: r["params"][key],
        )
        xs = [r["params"][key] for r in rows]
        label = f"{direction} {dtype}"
        (line,) = ax.loglog(xs, [r["median_us"] for r in rows], marker="o", label=label)
        for x, r in zip(xs, rows):  # labels of different series stacked, not overlapping
            ax.annotate(
                _pct_label(r),
                (x, r["median_us"]),
                fontsize=7,
                color=line.get_color(),
                textcoords="offset points",
                xytext=(0, 6 + 9 * s),
                ha="center",
            )
        refs = [
            (x, r["reference_median_us"]) for x, r in zip(xs, rows) if r.get("reference_median_us")
        ]
        if refs:
            ax.loglog(*zip(*refs), "--", color=line.get_color(), label=f"{label} reference")
    ax.set_xlabel(key)
    ax.set_ylabel("median time (us)")
    ax.set_title(f"sweep over {key} (labels: % of copy bandwidth)")
    ax.legend(fontsize=8)


def _title(doc: dict, records: list[dict]) -> str:
    meta = doc.get("metadata") or {}
    modes = ", ".join(_unique(str(r.get("mode")) for r in records))
    bw = doc.get("copy_bandwidth_gbps")
    bw_text = f"copy bw {bw:.0f} GB/s" if bw else "copy bw n/a"
    return (
        f"{doc.get('benchmark', '?')} on {meta.get('gpu_name') or 'unknown device'} "
        f"[{modes}; {bw_text}; {meta.get('git_commit') or 'no commit'}]"
    )


def plot_results(json_path: Path | str) -> Path | None:
    """Write <json_path>.png; returns its path, or None when the file holds no timed case (or is
    not a benchmark's results file, e.g. a profile's JSON next to them)."""
    json_path = Path(json_path)
    doc = json.loads(json_path.read_text())
    if not isinstance(doc, dict):
        return None
    timed = [r for r in doc.get("results", []) if r.get("median_us")]
    if not timed:
        return None
    plain = [r for r in timed if sweep_key(r) is None]
    sweeps = {
        key: [r for r in timed if sweep_key(r) == key]
        for key in _unique(sweep_key(r) for r in timed if sweep_key(r))
    }
    plt = _pyplot()
    n_panels = bool(plain) + len(sweeps)
    fig, axes = plt.subplots(n_panels, 1, figsize=(10, 4.5 * n_panels), squeeze=False)
    axes = list(axes[:, 0])
    if plain:
        _bar_chart(axes.pop(0), plain)
    for ax, (key, rows) in zip(axes, sweeps.items()):
        _sweep_chart(ax, key, rows)
    fig.suptitle(_title(doc, timed), fontsize=9)
    fig.tight_layout()
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot benchmark results JSON files as PNGs.")
    parser.add_argument("results_dir", nargs="?", type=Path, default=RESULTS_ROOT)
    args = parser.parse_args(argv)
    files = sorted(args.results_dir.rglob("*.json"))
    if not files:
        print(f"no results JSON under {args.results_dir}", file=sys.stderr)
        return 1
    for path in files:
        png = plot_results(path)
        print(f"{path} -> {png if png else 'nothing timed, skipped'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
