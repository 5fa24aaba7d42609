"""Fakes of hip-python's ``hip`` and ``hiprtc`` modules for tests without AMD hardware.

They record every call, return hip-python's ``(hipError_t, *outputs)`` tuples, back
"device" memory with host memory so copies really move bytes, run work recorded on a
capturing stream at hipGraphLaunch, and fail a named call on request.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
from vt_rocm.caps import DeviceProfile

# --------------------------------------------------------------------------- the fake


class hipError_t(enum.IntEnum):  # noqa: N801 - hip-python's names
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorNoDevice = 100
    hipErrorNotReady = 600
    hipErrorNotSupported = 801
    hipErrorStreamCaptureUnsupported = 900


class hipMemcpyKind(enum.IntEnum):  # noqa: N801
    hipMemcpyHostToHost = 0
    hipMemcpyHostToDevice = 1
    hipMemcpyDeviceToHost = 2
    hipMemcpyDeviceToDevice = 3


class hipMemAllocationType(enum.IntEnum):  # noqa: N801
    hipMemAllocationTypePinned = 1


class hipMemLocationType(enum.IntEnum):  # noqa: N801
    hipMemLocationTypeDevice = 1


class hipMemAccessFlags(enum.IntEnum):  # noqa: N801
    hipMemAccessFlagsProtReadWrite = 3


class hipMemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    hipMemAllocationGranularityMinimum = 0


class hipStreamCaptureMode(enum.IntEnum):  # noqa: N801
    hipStreamCaptureModeGlobal = 0
    hipStreamCaptureModeThreadLocal = 1
    hipStreamCaptureModeRelaxed = 2


class hipDeviceAttribute_t(enum.IntEnum):  # noqa: N801
    hipDeviceAttributeIntegrated = 1
    hipDeviceAttributeManagedMemory = 2
    hipDeviceAttributeConcurrentManagedAccess = 3
    hipDeviceAttributePageableMemoryAccess = 4
    hipDeviceAttributeVirtualMemoryManagementSupported = 5


ATTRIBUTE_FIELDS = {
    hipDeviceAttribute_t.hipDeviceAttributeIntegrated: "integrated",
    hipDeviceAttribute_t.hipDeviceAttributeManagedMemory: "managed_memory",
    hipDeviceAttribute_t.hipDeviceAttributeConcurrentManagedAccess: "concurrent_managed_access",
    hipDeviceAttribute_t.hipDeviceAttributePageableMemoryAccess: "pageable_memory_access",
    hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported: "vmm_supported",
}


class _Struct:
    """hipMemAllocationProp / hipMemAccessDesc: attributes plus a nested location."""

    def __init__(self) -> None:
        self.location = SimpleNamespace(type=None, id=None)


DISCRETE = DeviceProfile(
    name="AMD Radeon RX 7900 XTX",
    gcn_arch_name="gfx1100",
    platform="linux",
    integrated=False,
    managed_memory=False,
    concurrent_managed_access=False,
    pageable_memory_access=False,
    vmm_supported=True,
    vmm_granularity=4096,
    total_memory=24 << 30,
)
APU = DISCRETE.model_copy(
    update={
        "name": "AMD Instinct MI300A",
        "gcn_arch_name": "gfx942",
        "integrated": True,
        "managed_memory": True,
        "concurrent_managed_access": True,
        "pageable_memory_access": True,
    }
)


class FakeHip:
    """Just enough of ``hip.hip`` for the backend: every function call is recorded."""

    hipError_t = hipError_t
    hipMemcpyKind = hipMemcpyKind
    hipMemAllocationType = hipMemAllocationType
    hipMemLocationType = hipMemLocationType
    hipMemAccessFlags = hipMemAccessFlags
    hipMemAllocationGranularity_flags = hipMemAllocationGranularity_flags
    hipDeviceAttribute_t = hipDeviceAttribute_t
    hipStreamCaptureMode = hipStreamCaptureMode
    hipEventDisableTiming = 2
    hipHostMallocDefault = 0
    hipMemAttachGlobal = 1
    hipMemAllocationProp = _Struct
    hipMemAccessDesc = _Struct

    def __init__(self, profile: DeviceProfile = DISCRETE) -> None:
        self.profile = profile
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, hipError_t] = {}  # next call of that name returns this error
        self.query_results: list[hipError_t] = []
        self._memory: dict[int, np.ndarray] = {}  # keeps "device" memory alive
        self._next = 0
        # Stream capture: work on a capturing stream is recorded, run on hipGraphLaunch.
        self.capturing: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.graphs: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.execs: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}

    def _end_capture(self, stream: str) -> tuple[str]:
        graph = self._handle("graph")
        self.graphs[graph] = self.capturing.pop(stream)
        return (graph,)

    def _instantiate(self, graph: str, flags: int) -> tuple[str]:
        graph_exec = self._handle("graphexec")
        self.execs[graph_exec] = list(self.graphs[graph])
        return (graph_exec,)

    def _graph_launch(self, graph_exec: str, stream: Any) -> tuple[()]:
        for impl, args in self.execs[graph_exec]:
            impl(*args)
        return ()

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]

    def _host(self, nbytes: int) -> int:
        array = np.zeros(max(nbytes, 1), dtype=np.uint8)
        address = int(array.ctypes.data)
        self._memory[address] = array
        return address

    def _handle(self, kind: str) -> str:
        self._next += 1
        return f"{kind}#{self._next}"

    def _impl(self, name: str) -> Callable[..., tuple[Any, ...]]:
        p = self.profile
        copy = lambda dst, src, n, *_: ctypes.memmove(dst, src, n) and ()  # noqa: E731
        fill = lambda dst, value, n, *_: ctypes.memset(dst, value, n) and ()  # noqa: E731
        table: dict[str, Callable[..., tuple[Any, ...]]] = {
            "hipGetDeviceCount": lambda: (1,),
            "hipSetDevice": lambda device: (),
            "hipGetDeviceProperties": lambda device: (
                SimpleNamespace(
                    name=p.name.encode() + b"\0junk",
                    gcnArchName=p.gcn_arch_name,
                    totalGlobalMem=p.total_memory,
                    warpSize=p.warp_size,
                ),
            ),
            "hipDeviceGetAttribute": lambda attr, device: (
                int(getattr(p, ATTRIBUTE_FIELDS[attr])),
            ),
            "hipMemGetAllocationGranularity": lambda prop, option: (p.vmm_granularity,),
            "hipGetErrorString": lambda err: (hipError_t.hipSuccess, b"fake: " + err.name.encode()),
            "hipMalloc": lambda n: (self._host(n),),
            "hipMallocManaged": lambda n, flags: (self._host(n),),
            "hipFree": lambda ptr: (),
            "hipMemGetInfo": lambda: (p.total_memory // 2, p.total_memory),
            "hipMemset": fill,
            "hipMemsetAsync": fill,
            "hipMemcpy": copy,
            "hipMemcpyAsync": copy,
            "hipHostMalloc": lambda n, flags: (self._host(n),),
            "hipHostFree": lambda ptr: (),
            "hipStreamCreate": lambda: (self._handle("stream"),),
            "hipStreamDestroy": lambda s: (),
            "hipStreamSynchronize": lambda s: (),
            "hipEventCreateWithFlags": lambda flags: (self._handle("event"),),
            "hipEventDestroy": lambda e: (),
            "hipEventRecord": lambda e, s: (),
            "hipEventSynchronize": lambda e: (),
            "hipStreamWaitEvent": lambda s, e, flags: (),
            "hipMemAddressReserve": lambda n, align, addr, flags: (self._host(n),),
            "hipMemCreate": lambda n, prop, flags: (self._handle("mem"),),
            "hipMemMap": lambda ptr, n, offset, handle, flags: (),
            "hipMemSetAccess": lambda ptr, n, desc, count: (),
            "hipMemUnmap": lambda ptr, n: (),
            "hipMemRelease": lambda handle: (),
            "hipMemAddressFree": lambda ptr, n: (),
            "hipModuleLoadData": lambda code: (self._handle("module"),),
            "hipModuleGetFunction": lambda module, name: (f"{module}:{name.decode()}",),
            "hipModuleLaunchKernel": lambda *args: (),
            "hipStreamBeginCapture": lambda s, mode: self.capturing.__setitem__(s, []) or (),
            "hipStreamEndCapture": self._end_capture,
            "hipGraphInstantiateWithFlags": self._instantiate,
            "hipGraphLaunch": self._graph_launch,
            "hipGraphExecDestroy": lambda e: self.execs.pop(e) and (),
            "hipGraphDestroy": lambda g: self.graphs.pop(g) and (),
        }
        return table[name]

    def hipEventQuery(self, event: Any) -> tuple[hipError_t]:  # noqa: N802
        self.calls.append(("hipEventQuery", (event,)))
        if "hipEventQuery" in self.fail:
            return (self.fail.pop("hipEventQuery"),)
        return (self.query_results.pop(0) if self.query_results else hipError_t.hipSuccess,)

    def __getattr__(self, name: str) -> Callable[..., tuple[Any, ...]]:
        if not name.startswith("hip"):
            raise AttributeError(name)
        impl = self._impl(name)

        def call(*args: Any) -> tuple[Any, ...]:
            if name != "hipGetErrorString":
                self.calls.append((name, args))
            if name in self.fail:
                # hip-python returns the error plus placeholder outputs.
                return (self.fail.pop(name), None)
            if name not in ("hipStreamBeginCapture", "hipStreamEndCapture"):
                stream = next((a for a in args if isinstance(a, str) and a in self.capturing), "")
                if stream and name == "hipStreamSynchronize":
                    return (hipError_t.hipErrorStreamCaptureUnsupported,)
                if stream:  # recorded with its arguments, run by hipGraphLaunch
                    self.capturing[stream].append((impl, args))
                    return (hipError_t.hipSuccess,)
            return (hipError_t.hipSuccess, *impl(*args))

        return call


class hiprtcResult(enum.IntEnum):  # noqa: N801
    HIPRTC_SUCCESS = 0
    HIPRTC_ERROR_COMPILATION = 6


class FakeHiprtc:
    """``hip.hiprtc``: a compile that succeeds (a fake code object) or fails with a log."""

    hiprtcResult = hiprtcResult

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.compile_error: str | None = None

    def __getattr__(self, name: str) -> Callable[..., tuple[Any, ...]]:
        if not name.startswith("hiprtc"):
            raise AttributeError(name)

        def call(*args: Any) -> tuple[Any, ...]:
            self.calls.append((name, args))
            ok = hiprtcResult.HIPRTC_SUCCESS
            if name == "hiprtcCreateProgram":
                return (ok, "prog")
            if name == "hiprtcCompileProgram" and self.compile_error is not None:
                return (hiprtcResult.HIPRTC_ERROR_COMPILATION,)
            if name == "hiprtcGetProgramLogSize":
                return (ok, len((self.compile_error or "").encode()) + 1)
            if name == "hiprtcGetProgramLog":
                log = (self.compile_error or "").encode() + b"\0"
                args[1][: len(log)] = log
            if name == "hiprtcGetCodeSize":
                return (ok, 8)
            if name == "hiprtcGetCode":
                args[1][:] = b"HSACODE!"
            if name == "hiprtcVersion":
                return (ok, 6, 4)
            return (ok,)

        return call
