"""vt's CPU backend: numpy kernels, worker-thread streams, real virtual memory."""

from __future__ import annotations

from .backend import CpuBackend, cpu_capabilities, granularity_from_env
from .streams import StreamError

__all__ = ["CpuBackend", "StreamError", "cpu_capabilities", "granularity_from_env"]
