"""The runtime adapter a GPU vendor plugin implements: the few calls GpuBackend needs.

A vendor adapter (``vt_cuda.adapter.CudaRuntime`` over cuda-python, ``vt_rocm.adapter.
HipRuntime`` over hip-python) subclasses :class:`GpuRuntime`. Pointers are plain ints (so
``Buffer.offset`` is pointer arithmetic); streams, events, modules, functions and VMM
handles are whatever the vendor library returns. Every method raises a
:class:`GpuCallError` (or a subclass) naming the failed call when the runtime reports one.
Nothing here imports a vendor library.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import VtError

#: One kernel argument: a ctypes scalar (c_void_p, c_int32, c_float, ...) or Structure.
KernelArg = Any


class GpuCallError(VtError, RuntimeError):
    """A runtime call failed; names the call and the vendor's error name and string."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call, self.code, self.error_name = call, code, name
        super().__init__(f"{call} failed: {name} ({code}): {text}")


class GpuRuntime(abc.ABC):
    """Checked access to one GPU through its vendor runtime."""

    #: "cuda" or "hip": selects nothing in the kernels (macros do), names things in errors.
    vendor: str = ""
    device: int = 0

    # ---- device facts
    @abc.abstractmethod
    def device_name(self) -> str:
        """The marketing name ("NVIDIA H200")."""

    @abc.abstractmethod
    def arch(self) -> str:
        """The compile target nvrtc/hiprtc is given ("sm_90", "gfx942")."""

    @abc.abstractmethod
    def warp_size(self) -> int:
        """Threads per warp/wavefront (the kernels' VT_WARP)."""

    @abc.abstractmethod
    def attribute(self, name: str) -> int:
        """A device attribute by the vendor's short name (``"Integrated"``)."""

    def close(self) -> None:  # noqa: B027 - optional: most runtimes hold nothing
        """Release what the adapter holds (a retained context); called by backend.close()."""

    # ---- memory
    @abc.abstractmethod
    def malloc(self, nbytes: int) -> int:
        """Device memory for ``alloc`` (the adapter picks plain or managed allocation)."""

    @abc.abstractmethod
    def free(self, ptr: int) -> None: ...

    @abc.abstractmethod
    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        """Set bytes; synchronous when ``stream`` is None, else enqueued on it."""

    @abc.abstractmethod
    def memcpy_h2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        """Host to device; synchronous when ``stream`` is None, else enqueued on it."""

    @abc.abstractmethod
    def memcpy_d2h(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        """Device to host; synchronous when ``stream`` is None, else enqueued on it."""

    @abc.abstractmethod
    def memcpy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Device to device, enqueued on ``stream``."""

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        """Page-locked host memory: its address and a uint8 numpy view of it
        (:func:`host_array` makes the view)."""

    @abc.abstractmethod
    def host_free(self, ptr: int) -> None: ...

    def memory_info(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of device memory now (``cuMemGetInfo``,
        ``hipMemGetInfo``), or None when the runtime cannot say. Optional (not abstract, so
        an older adapter still loads): GpuBackend keeps the BLAS path's weight copies only
        while it can see room for them, so without it none are kept."""
        return None

    # ---- streams and events (events only order work: no timing)
    @abc.abstractmethod
    def stream_create(self) -> Any: ...

    @abc.abstractmethod
    def stream_destroy(self, stream: Any) -> None: ...

    @abc.abstractmethod
    def stream_synchronize(self, stream: Any) -> None: ...

    @abc.abstractmethod
    def event_create(self) -> Any: ...

    @abc.abstractmethod
    def event_destroy(self, event: Any) -> None: ...

    @abc.abstractmethod
    def event_record(self, event: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def event_query(self, event: Any) -> bool:
        """True when the event has completed, False while it is pending."""

    @abc.abstractmethod
    def event_synchronize(self, event: Any) -> None: ...

    @abc.abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None: ...

    # ---- virtual memory
    @abc.abstractmethod
    def vmm_granularity(self) -> int:
        """The minimum allocation granularity; raises :class:`vt.VmmError` naming the
        device attribute when the device has no VMM (without calling the runtime)."""

    @abc.abstractmethod
    def vmm_reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of device virtual addresses; returns the base address."""

    @abc.abstractmethod
    def vmm_create(self, nbytes: int) -> Any:
        """Create ``nbytes`` of physical device memory; returns its handle."""

    @abc.abstractmethod
    def vmm_map(self, ptr: int, nbytes: int, handle: Any) -> None: ...

    @abc.abstractmethod
    def vmm_set_access(self, ptr: int, nbytes: int) -> None:
        """Read-write access for this device over ``[ptr, ptr + nbytes)``."""

    @abc.abstractmethod
    def vmm_unmap(self, ptr: int, nbytes: int) -> None: ...

    @abc.abstractmethod
    def vmm_release(self, handle: Any) -> None: ...

    @abc.abstractmethod
    def vmm_address_free(self, ptr: int, nbytes: int) -> None: ...

    # ---- kernels
    @abc.abstractmethod
    def compile(self, source: str, name: str, options: Sequence[str]) -> Any:
        """Compile ``source`` with nvrtc/hiprtc for :meth:`arch` and load it; a module.

        Adapters cache the compiled binary per process (keyed by architecture, options and
        source), so a second backend only loads it. Raises :class:`GpuCallError` carrying
        the compiler's log when compilation fails.
        """

    def prebuild(self, source: str, name: str, options: Sequence[str]) -> None:  # noqa: B027
        """Optional: build the binary a later :meth:`compile` with the same arguments loads,
        without loading it, so that compile only loads. Makes no driver call and may run on
        any thread: :class:`GpuBackend` builds a model's modules in parallel while its
        weights upload (the compilers release the GIL). The default builds nothing; compile
        then builds as it always does. A compiler error may be raised here or by compile."""

    @abc.abstractmethod
    def get_function(self, module: Any, name: str) -> Any: ...

    @abc.abstractmethod
    def launch(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[KernelArg],
    ) -> None:
        """Enqueue ``fn`` on ``stream``; ``args`` are ctypes values in parameter order."""

    def launch_overlapped(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[KernelArg],
    ) -> None:
        """Enqueue ``fn`` so that it may start before the stream's previous kernel has
        finished (CUDA's programmatic dependent launch): only for kernels that wait for it
        themselves (``vt_grid_wait`` in the kernel source) before reading what it wrote.
        Optional: this default launches the plain way, which is always correct."""
        self.launch(fn, grid, block, shared_mem, stream, args)

    # ---- graphs (optional: not abstract, so adapters written before them still load;
    # GpuBackend implements vt.Graphs over them, so the capability function of a plugin
    # whose adapter lacks them declares ``graphs=False``)
    def graph_begin_capture(self, stream: Any) -> None:
        """Start capturing the work enqueued on ``stream`` (this thread's capture mode)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def graph_end_capture(self, stream: Any) -> Any:
        """End the capture on ``stream``; the captured graph."""
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def graph_instantiate(self, graph: Any) -> Any:
        """An executable graph of ``graph`` (which may be destroyed afterwards)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    def graph_destroy(self, graph: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not capture graphs")

    # ---- vendor BLAS (optional: GpuBackend runs matmuls of many rows through it when
    # ``blas()`` names a library, else through its own tiled kernel)
    def blas(self) -> str | None:
        """What ``gemm`` runs on ("cuBLAS, TF32 tensor cores ..."), or None without one."""
        return None

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool,
        inputs: str = "f32",
    ) -> None:  # fmt: skip
        """``out[n, m] = x[n, k] @ w[m, k].T (+ out if accumulate)``, row-major, enqueued
        on ``stream``: ``out`` float32; ``x`` and ``w`` float32 (``inputs="f32"``) or IEEE
        half (``"f16"``, summed in float32)."""
        raise NotImplementedError(f"{type(self).__name__} has no BLAS")


#: The argument arrays' types by length (made once: every launch builds one).
_PARAM_ARRAYS = tuple(ctypes.c_void_p * n for n in range(1, 33))


def kernel_params(args: Sequence[KernelArg]) -> tuple[ctypes.Array, int]:
    """The ``void**`` array of a launch: pointers to each argument's bytes.

    Returns the array (keep it alive until the launch call returns) and its address.
    """
    n = len(args)
    kind = _PARAM_ARRAYS[n - 1] if 0 < n <= len(_PARAM_ARRAYS) else ctypes.c_void_p * max(1, n)
    array = kind(*map(ctypes.addressof, args))
    return array, ctypes.addressof(array)


def host_array(address: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of ``nbytes`` at ``address`` (it does not keep the memory alive)."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))
