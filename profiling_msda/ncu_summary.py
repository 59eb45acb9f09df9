"""Compact table from `ncu --csv --page raw` output: one column per profiled kernel.

    python profiling/ncu_summary.py ncu_raw.csv
"""

from __future__ import annotations

import csv
import re
import sys

METRICS = [
    ("us", "gpu__time_duration.sum", 1e-3),
    ("regs", "launch__registers_per_thread", 1),
    ("occ%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("SM%", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("mem%", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L1%", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1),
    ("L2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("DRAM%", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L1hit%", "l1tex__t_sector_hit_rate.pct", 1),
    ("L2hit%", "lts__t_sector_hit_rate.pct", 1),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("Minst", "smsp__inst_executed.sum", 1e-6),
    ("Mwavef", "l1tex__data_pipe_lsu_wavefronts.sum", 1e-6),
    ("Mred_sec", "lts__t_sectors_op_red.sum", 1e-6),
    ("DRAM_MB", "dram__bytes_read.sum", 1e-6),
    ("DRAMw_MB", "dram__bytes_write.sum", 1e-6),
]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def num(v):
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def main(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print("no ncu csv table in", path)
        return 1
    rows = list(csv.reader(lines[start:]))
    head, units, data = rows[0], rows[1], [r for r in rows[2:] if len(r) == len(rows[0])]
    idx = {h: i for i, h in enumerate(head)}
    name_i = idx.get("Kernel Name")
    names = []
    for r in data:
        n = r[name_i]
        m = re.search(r"(forward_kernel|backward_kernel|gather_value_grad_kernel)<([^>]*)>", n)
        names.append((m.group(1)[:3] + "<" + m.group(2).replace("__half", "h").replace("float", "f")
                      .replace("__nv_bfloat16", "bf").replace(" ", "") + ">") if m else n[:16])
    print(f"{'metric':10s} " + " ".join(f"{n[:14]:>14s}" for n in names))
    for label, key, scale in METRICS:
        if key not in idx:
            continue
        vals = [num(r[idx[key]]) for r in data]
        unit = units[idx[key]]
        if key == "gpu__time_duration.sum" and unit in ("usecond", "us"):
            scale = 1
        if key.startswith("dram__bytes") and unit in ("Mbyte", "MB"):
            scale = 1
        print(f"{label:10s} " + " ".join(f"{(v * scale if v is not None else float('nan')):14.1f}" for v in vals))
    stalls = {}
    for h, i in idx.items():
        m = STALL.fullmatch(h)
        if m and "not_issued" not in h:
            vals = [num(r[i]) or 0.0 for r in data]
            if max(vals) >= 0.3:
                stalls[m.group(1)] = vals
    for k, vals in sorted(stalls.items(), key=lambda kv: -max(kv[1])):
        print(f"{k[:10]:10s} " + " ".join(f"{v:14.2f}" for v in vals))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
