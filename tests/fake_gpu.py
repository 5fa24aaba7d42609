"""A fake GPU runtime: the one stand-in that tests :class:`vt.gpu.GpuBackend` once.

``FakeRuntime`` implements :class:`vt.gpu.GpuRuntime` in Python over host memory, so
copies really move bytes. It records each call as ``(method, args)``; work enqueued on a
capturing stream is recorded and runs on ``graph_launch``; kernels are recorded, not run
(``launches``). ``fail[name] = code`` makes the next call of that method raise a
:class:`vt.gpu.GpuCallError`. ``memory=N`` gives it N bytes of device memory: ``malloc``
and ``vmm_create`` take from them (``FAKE_ERROR_OUT_OF_MEMORY`` past the end), ``free`` and
``vmm_release`` give back, ``memory_info`` says ``(free, total)``; without it
``memory_info`` is None (a runtime that cannot say). The vendor plugins' own fakes
(``fake_cuda``, ``fake_hip``) test only how their adapters translate these calls.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import vt
from gguf import GGMLQuantizationType
from vt.gpu import GpuBackend, GpuCallError, GpuRuntime, host_array
from vt.protocol.mixins import derive_capabilities
from vt.testing.tiny import quantize_matrix

GRANULARITY = 4096


@dataclass
class Launch:
    """One kernel launch: the function, its grid and block, and its arguments' values."""

    fn: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    stream: Any
    args: list[Any] = field(default_factory=list)
    ctypes_args: Sequence[Any] = ()

    @property
    def kernel(self) -> str:
        return self.fn.split(":", 1)[1]


class FakeRuntime(GpuRuntime):
    """Just enough of a GPU, in Python. ``vmm_granularity=None`` is a device without VMM."""

    vendor = "fake"

    def __init__(
        self,
        warp: int = 32,
        vmm_granularity: int | None = GRANULARITY,
        blas: str | None = None,
        memory: int | None = None,
    ) -> None:
        self.warp = warp
        self.memory = memory  # total bytes of device memory, or None: not modelled
        self.used = 0  # bytes taken by malloc and vmm_create (with ``memory``)
        self._sizes: dict[Any, int] = {}  # pointer or physical handle -> bytes
        self.blas_name = blas
        self.granularity = vmm_granularity
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, int] = {}
        self.launches: list[Launch] = []
        self.compiles: list[tuple[str, tuple[str, ...]]] = []
        self.query_results: list[bool] = []
        self._memory: dict[int, np.ndarray] = {}  # keeps "device" memory alive
        self._next = 0
        self.capturing: dict[str, list[Callable[[], Any]]] = {}
        self.graphs: dict[str, list[Callable[[], Any]]] = {}
        self.execs: dict[str, list[Callable[[], Any]]] = {}
        self.closed = 0

    # ---- bookkeeping
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.fail:
            code = self.fail.pop(name)
            raise GpuCallError(f"{name}()", code, f"FAKE_ERROR_{code}", "fake failure")

    def _handle(self, kind: str) -> str:
        self._next += 1
        return f"{kind}#{self._next}"

    def _host(self, nbytes: int) -> int:
        array = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self._memory[int(array.ctypes.data)] = array
        return int(array.ctypes.data)

    def _enqueue(self, stream: Any, work: Callable[[], Any]) -> None:
        """Run ``work`` now, or record it when ``stream`` is capturing."""
        if stream is not None and stream in self.capturing:
            self.capturing[stream].append(work)
        else:
            work()

    # ---- device facts
    def device_name(self) -> str:
        return "Fake GPU"

    def arch(self) -> str:
        return "fake_arch"

    def warp_size(self) -> int:
        return self.warp

    def attribute(self, name: str) -> int:
        return 0

    def close(self) -> None:
        self.closed += 1

    # ---- memory
    def _take(self, what: str, nbytes: int) -> None:
        if self.memory is not None and self.used + nbytes > self.memory:
            raise GpuCallError(f"{what}({nbytes})", 2, "FAKE_ERROR_OUT_OF_MEMORY", "out of memory")
        self.used += nbytes

    def memory_info(self) -> tuple[int, int] | None:
        self._call("memory_info")
        return None if self.memory is None else (self.memory - self.used, self.memory)

    def malloc(self, nbytes: int) -> int:
        self._call("malloc", nbytes)
        self._take("malloc", nbytes)
        ptr = self._host(nbytes)
        self._sizes[ptr] = nbytes
        return ptr

    def free(self, ptr: int) -> None:
        self._call("free", ptr)
        self.used -= self._sizes.pop(ptr, 0)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        self._call("memset", ptr, value, nbytes, stream)
        self._enqueue(stream, lambda: ctypes.memset(ptr, value, nbytes))

    def _copy(self, name: str, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._call(name, dst, src, nbytes, stream)
        self._enqueue(stream, lambda: ctypes.memmove(dst, src, nbytes))

    def memcpy_h2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._copy("memcpy_h2d", dst, src, nbytes, stream)

    def memcpy_d2h(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._copy("memcpy_d2h", dst, src, nbytes, stream)

    def memcpy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._copy("memcpy_d2d", dst, src, nbytes, stream)

    def host_alloc(self, nbytes: int) -> tuple[int, np.ndarray]:
        self._call("host_alloc", nbytes)
        ptr = self._host(nbytes)
        return ptr, host_array(ptr, nbytes)

    def host_free(self, ptr: int) -> None:
        self._call("host_free", ptr)

    # ---- streams and events
    def stream_create(self) -> Any:
        self._call("stream_create")
        return self._handle("stream")

    def stream_destroy(self, stream: Any) -> None:
        self._call("stream_destroy", stream)

    def stream_synchronize(self, stream: Any) -> None:
        self._call("stream_synchronize", stream)
        if stream in self.capturing:
            raise GpuCallError("stream_synchronize()", 900, "FAKE_CAPTURE", "stream is capturing")

    def event_create(self) -> Any:
        self._call("event_create")
        return self._handle("event")

    def event_destroy(self, event: Any) -> None:
        self._call("event_destroy", event)

    def event_record(self, event: Any, stream: Any) -> None:
        self._call("event_record", event, stream)

    def event_query(self, event: Any) -> bool:
        self._call("event_query", event)
        return self.query_results.pop(0) if self.query_results else True

    def event_synchronize(self, event: Any) -> None:
        self._call("event_synchronize", event)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._call("stream_wait_event", stream, event)

    # ---- virtual memory
    def vmm_granularity(self) -> int:
        if self.granularity is None:
            raise vt.VmmError("the fake device has no virtual memory")
        self._call("vmm_granularity")
        return self.granularity

    def vmm_reserve(self, nbytes: int) -> int:
        self._call("vmm_reserve", nbytes)
        return self._host(nbytes)

    def vmm_create(self, nbytes: int) -> Any:
        self._call("vmm_create", nbytes)
        self._take("vmm_create", nbytes)
        handle = self._handle("mem")
        self._sizes[handle] = nbytes
        return handle

    def vmm_map(self, ptr: int, nbytes: int, handle: Any) -> None:
        self._call("vmm_map", ptr, nbytes, handle)

    def vmm_set_access(self, ptr: int, nbytes: int) -> None:
        self._call("vmm_set_access", ptr, nbytes)

    def vmm_unmap(self, ptr: int, nbytes: int) -> None:
        self._call("vmm_unmap", ptr, nbytes)

    def vmm_release(self, handle: Any) -> None:
        self._call("vmm_release", handle)
        self.used -= self._sizes.pop(handle, 0)

    def vmm_address_free(self, ptr: int, nbytes: int) -> None:
        self._call("vmm_address_free", ptr, nbytes)

    # ---- kernels
    def compile(self, source: str, name: str, options: Sequence[str]) -> Any:
        self._call("compile", name, tuple(options))
        self.compiles.append((name, tuple(options)))
        return self._handle("module")

    def get_function(self, module: Any, name: str) -> Any:
        self._call("get_function", module, name)
        return f"{module}:{name}"

    def launch(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[Any],
    ) -> None:
        self._call("launch", fn, grid, block, shared_mem, stream)
        values = [getattr(a, "value", a) for a in args]
        record = Launch(fn, grid, block, stream, values, tuple(args))
        self._enqueue(stream, lambda: self.launches.append(record))

    # ---- vendor BLAS (only with ``blas=``): a gemm is recorded in ``launches`` as "gemm"
    def blas(self) -> str | None:
        return self.blas_name

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool,
        inputs: str = "f32",
    ) -> None:  # fmt: skip
        if self.blas_name is None:
            return super().gemm(stream, n, m, k, x, w, out, accumulate, inputs)
        args = [n, m, k, x, w, out, accumulate] + ([] if inputs == "f32" else [inputs])
        self._call("gemm", *args)
        record = Launch("blas:gemm", (1, 1, 1), (1, 1, 1), stream, args)
        self._enqueue(stream, lambda: self.launches.append(record))

    # ---- graphs
    def graph_begin_capture(self, stream: Any) -> None:
        self._call("graph_begin_capture", stream)
        self.capturing[stream] = []

    def graph_end_capture(self, stream: Any) -> Any:
        self._call("graph_end_capture", stream)
        graph = self._handle("graph")
        self.graphs[graph] = self.capturing.pop(stream)
        return graph

    def graph_instantiate(self, graph: Any) -> Any:
        self._call("graph_instantiate", graph)
        graph_exec = self._handle("graphexec")
        self.execs[graph_exec] = list(self.graphs[graph])
        return graph_exec

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self._call("graph_launch", graph_exec, stream)
        for work in self.execs[graph_exec]:
            self._enqueue(stream, work)

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self._call("graph_exec_destroy", graph_exec)
        del self.execs[graph_exec]

    def graph_destroy(self, graph: Any) -> None:
        self._call("graph_destroy", graph)
        del self.graphs[graph]


class FakeGpu(GpuBackend):
    """GpuBackend under a test name; :func:`make` gives it the capabilities to test."""

    name = "fakegpu"


DISCRETE = vt.Capabilities(vmm=vt.VmmCaps(granularity=GRANULARITY))
UNIFIED = vt.Capabilities(
    unified_memory=True,
    device_memory_is_host_addressable=True,
    vmm=vt.VmmCaps(granularity=GRANULARITY),
)


def make(declared: vt.Capabilities = DISCRETE, **runtime: Any) -> tuple[FakeGpu, FakeRuntime]:
    """A GpuBackend on a fresh fake runtime, with the capabilities the registry would
    derive from ``declared``."""
    rt = FakeRuntime(**runtime)
    backend = FakeGpu(rt)
    backend.capabilities = derive_capabilities(FakeGpu, declared)
    return backend, rt


def weight_tensor(name: str, values: np.ndarray, wtype: str) -> vt.WeightTensor:
    """``values`` stored as GGML type ``wtype``, as the GGUF loader hands a tensor over."""
    qtype = GGMLQuantizationType[wtype]
    if wtype in ("F32", "F16"):
        data = values.astype(np.float32 if wtype == "F32" else np.float16)
    else:
        data = quantize_matrix(values, qtype)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return vt.WeightTensor(name, int(qtype), tuple(values.shape), raw)
