"""One line per kernel of an Nsight Compute text report (`ncu --section ...` printed to stdout):
duration, speed-of-light memory / DRAM / compute throughput, achieved vs theoretical occupancy,
registers per thread, warp cycles per issued instruction, and the first stall ncu names.

    python scripts/ncu_summary.py REPORT.txt [--markdown]

The workload lines the profiled program prints (`== name`, benchmarks/profile_kernels.py) head
their kernels' rows."""

from __future__ import annotations

import argparse
import re
import sys

KERNEL = re.compile(r"^  (\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context")
METRIC = re.compile(r"^    (\S.*?)\s{2,}(\S+)\s+([\d.,]+)\s*$")
WANTED = {
    "Duration": "dur",
    "Memory Throughput": "mem",
    "DRAM Throughput": "dram",
    "Compute (SM) Throughput": "sm",
    "Achieved Occupancy": "occ",
    "Theoretical Occupancy": "theo",
    "Registers Per Thread": "regs",
    "Warp Cycles Per Issued Instruction": "cpi",
}
STALL = re.compile(r"stalled (?:waiting )?(?:on|for) (.*?)\.|spends .*? on (.*?)\.", re.I)


def short(name: str) -> str:
    name = re.sub(r"\(.*", "", name)  # drop the parameter list
    name = re.sub(r"<unnamed>::|\(anonymous namespace\)::|void ", "", name)
    return name[:70]


PROFILING = re.compile(r"^==PROF== Profiling \"")


def parse(lines):
    """ncu prints its reports after the program ends; the k-th report is the kernel of the k-th
    `==PROF== Profiling` line, whose workload is the last `== name` line printed before it."""
    lines = list(lines)
    owners, workload = [], ""
    for line in lines:
        if line.startswith("== "):
            workload = line[3:].strip()
        elif PROFILING.match(line):
            owners.append(workload)
    rows, cur, text = [], None, []
    for line in lines:
        m = KERNEL.match(line)
        if m:
            if cur:
                rows.append(finish(cur, text))
            workload = owners[len(rows)] if len(rows) < len(owners) else ""
            grid = int(m[2]) * int(m[3]) * int(m[4])
            cur, text = {"workload": workload, "kernel": short(m[1]), "grid": grid,
                         "block": int(m[5]) * int(m[6]) * int(m[7])}, []  # fmt: skip
            continue
        if cur is None:
            continue
        text.append(line)
        mm = METRIC.match(line)
        if mm and mm[1].strip() in WANTED:
            key = WANTED[mm[1].strip()]
            value = float(mm[3].replace(",", ""))
            if key == "dur" and mm[2] == "ms":
                value *= 1000.0
            if key == "dur" and mm[2] == "ns":
                value /= 1000.0
            cur.setdefault(key, value)
    if cur:
        rows.append(finish(cur, text))
    return rows


def finish(cur, text):
    joined = " ".join(t.strip() for t in text)
    m = STALL.search(joined)
    cur["stall"] = (m[1] or m[2])[:60] if m else ""
    return cur


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    with open(a.report, errors="replace") as f:
        rows = parse(f)
    cols = ("dur", "mem", "dram", "sm", "occ", "theo", "regs", "cpi")
    if a.markdown:
        print("| workload | kernel | grid x block | us | mem % | DRAM % | SM % | occ % (theo) | regs "
              "| cycles / issue | first stall named |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v = {c: r.get(c, float("nan")) for c in cols}
        if a.markdown:
            print(f"| {r['workload']} | `{r['kernel']}` | {r['grid']}x{r['block']} | {v['dur']:.1f} "
                  f"| {v['mem']:.0f} | {v['dram']:.0f} | {v['sm']:.0f} | {v['occ']:.0f} "
                  f"({v['theo']:.0f}) | {v['regs']:.0f} | {v['cpi']:.1f} | {r['stall']} |")  # fmt: skip
        else:
            print(f"{r['workload'][:34]:34} {r['kernel'][:46]:46} {v['dur']:8.1f}us mem {v['mem']:4.0f}"
                  f" dram {v['dram']:4.0f} sm {v['sm']:4.0f} occ {v['occ']:4.0f}/{v['theo']:3.0f}"
                  f" r{v['regs']:.0f} cpi {v['cpi']:.1f} {r['stall'][:40]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
