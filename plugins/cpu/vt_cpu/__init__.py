"""vt's CPU backend: numpy kernels, worker-thread streams, real virtual memory."""

from __future__ import annotations

# First: configures numba (CPU features for 512-bit vectors, the cache directory, the
# threading layer) before any module of the package defines a kernel. numba reads the CPU
# features once, when the first @njit is decorated; a kernel defined before this import
# (vt_cpu.logprobs was) leaves every kernel on 256-bit vectors.
from . import kernels as _kernels  # noqa: F401  (isort: skip)
from .backend import CpuBackend, cpu_capabilities, granularity_from_env
from .streams import StreamError

__all__ = ["CpuBackend", "StreamError", "cpu_capabilities", "granularity_from_env"]
