"""Where a replayed decode step's time goes, from an Nsight Systems trace of its kernels.

    nsys profile -t cuda --cuda-graph-trace=node -o trace vt bench ... --batch 1
    nsys stats -q --report cuda_gpu_trace --format csv --output trace trace.nsys-rep
    python plugins/cuda/tools/nsys_steps.py trace_cuda_gpu_trace.csv [--first embedding]

(``h200_checks.sh nsys:MODEL`` runs all three; where nsys is missing, ``torch_trace.py``
writes the same columns from PyTorch's profiler: ``h200_checks.sh trace:MODEL``.) A
CUDA-event profile times each kernel launched plainly, one after another; in a replayed
graph with overlapped launches a kernel starts before the one it waits on ends, so its own
duration says little. What a kernel
costs the step is how much later the step's work ends because of it: its *increment*, its
end minus the latest end of any activity before it in the step. The trace is cut into steps
at each kernel whose name starts with ``--first``; only the steps whose sequence of names is
the most common one (the decode steps at one batch size) are kept. Per position in that
sequence: the mean start (from the step's first start), duration, gap (start minus the
previous activity's end: negative where it overlaps) and increment; then per kernel name,
its increments summed over a step. The increments add up to the step's span.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Activities per step at most in the printed per-position table (0: all).
DEFAULT_ROWS = 0


def _column(header: list[str], prefix: str) -> int:
    for i, name in enumerate(header):
        if name.strip().startswith(prefix):
            return i
    raise ValueError(f"not an nsys cuda_gpu_trace CSV: no column starting with {prefix!r}")


def activities(lines: Iterable[str]) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU activity, by start, from the CSV's lines."""
    rows = [r for r in csv.reader(lines) if r]
    # the header: the first row naming a start (nsys may print notes before it)
    at = next((k for k, r in enumerate(rows) if any(c.strip().startswith("Start") for c in r)), 0)
    if not rows:
        raise ValueError("not an nsys cuda_gpu_trace CSV: it is empty")
    header = rows[at]
    i_start, i_dur, i_name = (_column(header, p) for p in ("Start", "Duration", "Name"))
    out = []
    for r in rows[at + 1 :]:
        if len(r) <= max(i_start, i_dur, i_name):
            continue
        try:
            start, dur = float(r[i_start].replace(",", "")), float(r[i_dur].replace(",", ""))
        except ValueError:
            continue
        out.append((r[i_name], start / 1e3, dur / 1e3))  # nsys writes nanoseconds
    out.sort(key=lambda a: a[1])
    return out


def steps(acts: list[tuple[str, float, float]], first: str) -> list[list[tuple[str, float, float]]]:
    """The steps of the most common sequence of names, each cut at a name starting with first."""
    cut: list[list[tuple[str, float, float]]] = []
    for a in acts:
        if a[0].startswith(first) or not cut:
            cut.append([])
        cut[-1].append(a)
    cut = [s for s in cut if s[0][0].startswith(first)]
    if not cut:
        raise ValueError(f"no activity named {first!r}... in the trace: pick --first")
    common, _ = Counter(tuple(a[0] for a in s) for s in cut).most_common(1)[0]
    return [s for s in cut if tuple(a[0] for a in s) == common]


def report(kept: list[list[tuple[str, float, float]]]) -> dict[str, Any]:
    """Per position and per name: the means over the kept steps (see the module's text)."""
    n = len(kept)
    length = len(kept[0])
    pos = [{"name": kept[0][j][0], "start": 0.0, "dur": 0.0, "gap": 0.0, "inc": 0.0}
           for j in range(length)]  # fmt: skip
    span = 0.0
    for s in kept:
        t0 = s[0][1]
        end = t0  # the latest end so far in the step
        for j, (_, start, dur) in enumerate(s):
            p = pos[j]
            p["start"] += (start - t0) / n
            p["dur"] += dur / n
            p["gap"] += (start - end) / n if j else 0.0
            new_end = max(end, start + dur)
            p["inc"] += (new_end - end if j else dur) / n
            end = new_end
        span += (end - t0) / n
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "inc": 0.0, "dur": 0.0})
    for p in pos:
        b = by_name[p["name"]]
        b["count"] += 1
        b["inc"] += p["inc"]
        b["dur"] += p["dur"]
    names = sorted(by_name.items(), key=lambda kv: -kv[1]["inc"])
    return {
        "steps": n,
        "activities_per_step": length,
        "span_us": round(span, 2),
        "per_name": [{"name": k, **{f: round(v, 2) for f, v in b.items()}} for k, b in names],
        "per_position": [
            {k: round(v, 2) if isinstance(v, float) else v for k, v in p.items()} for p in pos
        ],
    }


def table(r: dict[str, Any], rows: int = DEFAULT_ROWS) -> list[str]:
    """The report as text: the step's span, the names by increment, then the positions."""
    out = [f"{r['steps']} steps of {r['activities_per_step']} activities, "
           f"{r['span_us']:.1f} us a step from its first start to its last end"]  # fmt: skip
    out.append(f"{'kernel':<32} {'a step':>6} {'inc us':>8} {'share':>6} {'dur us':>8}")
    for b in r["per_name"]:
        share = 100 * b["inc"] / r["span_us"] if r["span_us"] else 0.0
        out.append(f"{b['name'][:32]:<32} {b['count']:>6} {b['inc']:>8.2f} {share:>5.1f}% "
                   f"{b['dur']:>8.2f}")  # fmt: skip
    out.append(f"{'#':>4} {'kernel':<32} {'start':>8} {'dur':>7} {'gap':>7} {'inc':>7}")
    for j, p in enumerate(r["per_position"][: rows or None]):
        out.append(f"{j:>4} {p['name'][:32]:<32} {p['start']:>8.2f} {p['dur']:>7.2f} "
                   f"{p['gap']:>7.2f} {p['inc']:>7.2f}")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path, help="nsys stats --report cuda_gpu_trace --format csv")
    ap.add_argument("--first", default="embedding", help="a step's first kernel's name prefix")
    ap.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="positions printed (0: all)")
    ap.add_argument("--json", type=Path, help="also write the report here")
    a = ap.parse_args()
    if not a.trace.is_file():
        sys.exit(f"{a.trace}: no such file")
    try:
        r = report(steps(activities(a.trace.read_text(errors="replace").splitlines()), a.first))
    except ValueError as e:
        sys.exit(f"{a.trace}: {e}")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    print("\n".join(table(r, a.rows)))


if __name__ == "__main__":
    main()
