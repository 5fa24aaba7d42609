"""A table of Nsight Compute's raw CSV: per profiled kernel, its time, throughputs and why
its warps stall.

    ncu --csv --page raw --section SpeedOfLight --section WarpStateStats ... > ncu.csv
    python plugins/cuda/tools/ncu_table.py ncu.csv [--top 6]

(``h200_checks.sh ncu:MODEL`` runs both.) ``--page raw`` writes a header of metric names,
a line of their units, then a line per profiled launch. Each kernel's line here: grid and
block, ``gpu__time_duration.sum`` in microseconds, memory and SM throughput (% of peak;
memory: DRAM's where the report has it, else the SpeedOfLight section's memory figure),
registers a thread, achieved occupancy, warp cycles per issued instruction, L1's and L2's
throughput (% of peak: whether the loads' wavefronts, not the DRAM, bound it), and the
``--top`` stall reasons by cycles a warp spends in them per issued instruction
(``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``): whether a
latency-bound kernel waits on memory (``long_scoreboard``), on barriers (``barrier``), on
its own launch (``no_instruction``), ... Metrics the profile lacks print as ``-``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Iterable
from pathlib import Path

#: (column title, metric names): the figures of a kernel's line, in order; the first of a
#: figure's names the report has is read (which metrics a section writes varies by ncu).
FIGURES = (
    ("us", ("gpu__time_duration.sum",)),
    ("Mem%", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
              "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed")),
    ("SM%", ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)),
    ("regs", ("launch__registers_per_thread",)),
    ("occ%", ("sm__warps_active.avg.pct_of_peak_sustained_active",)),
    ("cyc/inst", ("smsp__average_warp_latency_per_inst_issued.ratio",)),
    ("L1%", ("l1tex__throughput.avg.pct_of_peak_sustained_active",)),
    ("L2%", ("lts__throughput.avg.pct_of_peak_sustained_elapsed",)),
)  # fmt: skip
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


#: microseconds in a time unit as ncu spells it (``ns`` in 2025's releases, ``nsecond`` before)
_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
       "s": 1e6, "second": 1e6}  # fmt: skip


def _microseconds(value: float, unit: str) -> float:
    if unit not in _US:
        raise ValueError(f"gpu__time_duration in an unknown unit {unit!r}")
    return value * _US[unit]


def table(lines: Iterable[str], top: int = 6) -> list[str]:
    """The report's lines (header first) from the lines of ``ncu --csv --page raw``."""
    rows = [r for r in csv.reader(lines) if r]
    if len(rows) < 2:
        raise ValueError("not an ncu --csv --page raw report: no header and units lines")
    header, units, launches = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    if "Kernel Name" not in col:
        raise ValueError("not an ncu --csv --page raw report: no 'Kernel Name' column")
    stalls = [n for n in header if n.startswith(STALL[0]) and n.endswith(STALL[1])]
    out = [f"{'kernel':<28} {'grid':>12} {'block':>6} " + " ".join(f"{t:>8}" for t, _ in FIGURES)
           + " | stalls (cycles a warp per issued instruction)"]  # fmt: skip
    for r in launches:
        cells = []
        for title, names in FIGURES:
            i = next((col[n] for n in names if n in col), None)
            v = _number(r[i]) if i is not None and i < len(r) else None
            if v is not None and title == "us":
                v = _microseconds(v, units[i])
            cells.append(f"{v:>8.2f}" if v is not None else f"{'-':>8}")
        reasons = []
        for name in stalls:
            v = _number(r[col[name]]) if col[name] < len(r) else None
            if v:
                reasons.append((v, name[len(STALL[0]) : -len(STALL[1])]))
        reasons.sort(reverse=True)
        grid = r[col["Grid Size"]] if "Grid Size" in col else "-"
        block = r[col["Block Size"]] if "Block Size" in col else "-"
        out.append(
            f"{r[col['Kernel Name']][:28]:<28} {grid.replace(' ', ''):>12} "
            f"{block.replace(' ', '').split(',')[0].strip('()'):>6} " + " ".join(cells)
            + " | " + ", ".join(f"{name} {v:.1f}" for v, name in reasons[:top])
        )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", type=Path, help="the output of ncu --csv --page raw")
    ap.add_argument("--top", type=int, default=6, help="stall reasons a kernel (6)")
    a = ap.parse_args()
    text = a.report.read_text(errors="replace").splitlines()
    # ncu prints its own "==PROF==" lines and the profiled program's output beside the CSV
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        sys.exit(f'{a.report}: no ncu CSV report in it (no line starting with "ID")')
    print("\n".join(table(text[start:], a.top)))


if __name__ == "__main__":
    main()
