"""Runtime probes: prove a started backend's declared capabilities by exercising them.

Each probe is a function ``(backend) -> list[Check]`` over a started backend whose
``capabilities`` are its effective ones. ``vt audit`` runs them all
(:data:`vt.management.audit.PROBES`;
``vt.management.audit`` re-exports the public names of this package) and the conformance kit's
contracts are built on them. A probe proves what is declared and, where the opposite is
declared, that the backend refuses (``host_view`` must raise without host-addressable
memory). A probe that cannot run says ``skip`` with the reason.

- :mod:`vt.management.probes.base`: :class:`Check`, :func:`run_probe`, and the helpers the
  probes and
  the kit share (scoped buffers, streams and events, busy work, patterns);
- :mod:`vt.management.probes.device`: the required core (memory, ``host_view``, sync readback) and
  pinned memory, events, async copies, async readback, graphs;
- :mod:`vt.management.probes.vmm`: the VMM arena smoke (it uses :mod:`vt.execution.memory`;
  memory never
  imports probes).
"""

from __future__ import annotations

from .base import Check, Kind, ProbeFailed, Result, run_checks, run_probe
from .device import (
    SeenCopy,
    copy_behind_work,
    probe_async_d2h,
    probe_events,
    probe_graphs,
    probe_host_view,
    probe_memory,
    probe_pinned,
    probe_readback,
)
from .vmm import SMOKE_IDS, arena_smoke, probe_vmm

__all__ = [
    "SMOKE_IDS",
    "SeenCopy",
    "Check",
    "Kind",
    "ProbeFailed",
    "Result",
    "arena_smoke",
    "copy_behind_work",
    "probe_async_d2h",
    "probe_events",
    "probe_graphs",
    "probe_host_view",
    "probe_memory",
    "probe_pinned",
    "probe_readback",
    "probe_vmm",
    "run_checks",
    "run_probe",
]
