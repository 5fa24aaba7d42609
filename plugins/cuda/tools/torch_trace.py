"""A vt command's GPU kernels on a timeline, through PyTorch's profiler, for nsys_steps.py.

    python plugins/cuda/tools/torch_trace.py OUT.csv [bench_variant.py flags] bench ...
    python plugins/cuda/tools/nsys_steps.py OUT.csv

Where Nsight Systems is missing (the H200 image has none) but PyTorch is there: its
profiler records every kernel of the process through CUPTI, those of vt's own CUDA
context and of replayed graphs included. The command (``vt``'s command line after
``bench_variant.py``'s options, as that tool takes them) runs in this process inside the
profiler; then each kernel, copy and memset goes to OUT.csv as ``"Start (ns)","Duration
(ns)","Name"`` lines, the columns ``nsys_steps.py`` reads from nsys's ``cuda_gpu_trace``.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: Chrome-trace categories of GPU work in PyTorch's export.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_rows(events: Iterable[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(start ns, duration ns, name) of each GPU activity of a chrome trace's events (their
    ``ts`` and ``dur`` in microseconds), by start."""
    rows = []
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and "ts" in e and "dur" in e:
            rows.append((round(float(e["ts"]) * 1e3), round(float(e["dur"]) * 1e3), e["name"]))
    return sorted(rows)


def write_csv(path: Path, rows: list[tuple[int, int, str]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Start (ns)", "Duration (ns)", "Name"])
        w.writerows(rows)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, args = Path(sys.argv[1]), sys.argv[2:]
    import bench_variant  # noqa: PLC0415  (beside this file)
    import torch  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    from vt.frontends import cli  # noqa: PLC0415

    if not torch.cuda.is_available():
        sys.exit("torch_trace.py: PyTorch sees no CUDA device, so its profiler records none")
    torch.cuda.init()  # the profiler's CUPTI needs the driver up before it starts
    sys.argv = ["vt", *bench_variant.apply(args)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        try:
            cli.main()
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        rows = gpu_rows(json.loads(trace.read_text()).get("traceEvents", []))
    if not rows:
        sys.exit("torch_trace.py: the profiler recorded no GPU activity")
    write_csv(out, rows)
    print(f"torch_trace.py: {len(rows)} GPU activities -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
