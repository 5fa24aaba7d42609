"""How busy the shared machine is: for the benchmarks that compare engines side by side.

``busy_cpu_s()`` reads the machine's busy CPU time from ``/proc/stat`` (Linux; None
elsewhere). ``wait_quiet(threshold, max_wait_s)`` waits until, over a short window, the
rest of the machine keeps less than ``threshold`` of the CPUs busy, for at most
``max_wait_s``, and says how long it waited and how busy the last window was. It cannot
stop a neighbour from starting during the measurement: that is what the per-run
``others_cpu_share`` is for.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (Linux ``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def busy_share(window_s: float = 2.0) -> float | None:
    """The share of the CPUs kept busy over the next ``window_s`` seconds."""
    a = busy_cpu_s()
    time.sleep(window_s)
    b = busy_cpu_s()
    if a is None or b is None:
        return None
    return (b - a) / (window_s * (os.cpu_count() or 1))


def wait_quiet(threshold: float, max_wait_s: float, window_s: float = 2.0) -> dict:
    """Wait until a window's busy share is below ``threshold`` (at most ``max_wait_s``)."""
    t0 = time.perf_counter()
    share = busy_share(window_s)
    while share is not None and share >= threshold and time.perf_counter() - t0 < max_wait_s:
        share = busy_share(window_s)
    return {
        "waited_s": round(time.perf_counter() - t0, 1),
        "busy_share_before": None if share is None else round(share, 3),
        "quiet": share is not None and share < threshold,
    }
