"""One GPU backend over a small runtime adapter and one kernel source (nvrtc or hiprtc).

A vendor plugin (vt-cuda, vt_rocm) implements :class:`GpuRuntime` over its vendor library
and subclasses :class:`GpuBackend` with its name, probe and capability function. This
package imports no vendor library.
"""

from __future__ import annotations

from .backend import MAX_HEAD_DIM, GpuBackend, GpuWeight
from .kernel_cache import Binaries, load_or_build, read_or_build
from .modules import kernel_source
from .runtime import GpuCallError, GpuRuntime, KernelArg, host_array, kernel_params

__all__ = [
    "MAX_HEAD_DIM",
    "Binaries",
    "GpuBackend",
    "GpuCallError",
    "GpuRuntime",
    "GpuWeight",
    "KernelArg",
    "host_array",
    "kernel_params",
    "kernel_source",
    "load_or_build",
    "read_or_build",
]
