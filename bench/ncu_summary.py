"""Nsight Compute CSVs of ``bench/profile_rows.py`` -> one table: per kernel of each row, the figures that say what
bounds it (DRAM and SM throughput, occupancy and what limits it, issue rate, the top stall the rules name).

    FXGLM5_BENCH_COMMIT=<profiled commit> python bench/ncu_summary.py DIR [--name ncu_summary]
        # reads DIR/ncu_<row>.csv, saves <name>.{json,md}

The CSVs come from ``ncu ... --csv --page details python bench/profile_rows.py ROW`` with the sections
SpeedOfLight, Occupancy, LaunchStats, MemoryWorkloadAnalysis, ComputeWorkloadAnalysis and WarpStateStats
(the device command is in profile_rows.py's docstring). Output goes to $OUT when set, else bench/results. The
record's device is the machine that summarized; the profiled one is named by the CSVs (compute capability) and by
the results folder's README, and the commit should be the profiled one, hence ``FXGLM5_BENCH_COMMIT``.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

METRICS = {  # column -> ncu metric name
    "us": "Duration",
    "dram_pct": "DRAM Throughput",
    "sm_pct": "Compute (SM) Throughput",
    "l1_pct": "L1/TEX Cache Throughput",
    "l2_pct": "L2 Cache Throughput",
    "l2_hit_pct": "L2 Hit Rate",
    "regs": "Registers Per Thread",
    "smem_kb": "Dynamic Shared Memory Per Block",
    "occ_pct": "Achieved Occupancy",
    "warps_sm": "Achieved Active Warps Per SM",
    "ipc": "Executed Ipc Active",
    "cpi": "Warp Cycles Per Issued Instruction",
}
LIMITS = ("Registers", "Shared Mem", "Warps", "SM")  # "Block Limit <x>": blocks per SM each resource allows
COLUMNS = ["us", "dram_pct", "sm_pct", "l1_pct", "l2_pct", "l2_hit_pct", "occ_pct", "warps_sm", "ipc", "cpi", "regs", "smem_kb",
           "blocks_sm", "limited_by"]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _rows(path: str) -> list[dict]:
    """The CSV's records (ncu prints its own notes before the header line)."""
    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    return list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []


def summarize(path: str) -> list[dict]:
    """One record per profiled kernel launch of a row's CSV."""
    kernels: dict[str, dict] = {}
    for r in _rows(path):
        k = kernels.setdefault(r["ID"], dict(kernel=r["Kernel Name"], grid=r["Grid Size"], block=r["Block Size"],
                                             limits={}, stall=""))
        name, value = r["Metric Name"], r["Metric Value"]
        for col, metric in METRICS.items():
            if name == metric:
                k[col] = _number(value)
        if name.startswith("Block Limit ") and name[len("Block Limit "):] in LIMITS:
            k["limits"][name[len("Block Limit "):]] = _number(value)
        if r["Rule Name"] == "CPIStall" and "stalled" in r["Rule Description"] and not k["stall"]:
            k["stall"] = r["Rule Description"].split(". ")[0]
    out = []
    for k in kernels.values():
        k["us"] = k.get("us", 0) / 1e3  # ncu reports ns
        k["smem_kb"] = k.get("smem_kb", 0) / 1024
        lim = k.pop("limits")
        if lim:
            k["blocks_sm"] = min(lim.values())
            k["limited_by"] = "/".join(n for n, v in lim.items() if v == k["blocks_sm"])
        out.append(k)
    return out


def main():
    harness.answer_help(__doc__)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    name = sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else "ncu_summary"
    if not args or not os.path.isdir(args[0]):
        raise SystemExit("ncu_summary: give the folder that holds the ncu_<row>.csv files")
    res = harness.Results()
    for path in sorted(glob.glob(os.path.join(args[0], "ncu_*.csv"))):
        for k in summarize(path):
            stall = k.pop("stall")
            res.add(row=os.path.basename(path)[4:-4], **{c: k.get(c) for c in ["kernel", "grid", "block"] + COLUMNS},
                    top_stall=stall[:140])
    print("saved", res.save(name))


if __name__ == "__main__":
    main()
