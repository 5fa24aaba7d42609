"""Fakes of cuda-python's ``driver`` and ``nvrtc`` modules for tests without a GPU.

They record every call, return cuda-python's ``(CUresult, *outputs)`` tuples, back "device"
memory with host memory so copies really move bytes, and fail a named call on request.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
from vt_cuda.caps import ATTRIBUTES, DeviceProfile


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900


CUdevice_attribute = enum.IntEnum(  # type: ignore[misc]
    "CUdevice_attribute",
    {f"CU_DEVICE_ATTRIBUTE_{name}": i + 1 for i, name in enumerate(ATTRIBUTES.values())},
)
ATTRIBUTE_FIELDS = {
    getattr(CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}"): field
    for field, attr in ATTRIBUTES.items()
}


class CUmemAllocationType(enum.IntEnum):
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(enum.IntEnum):
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(enum.IntEnum):  # noqa: N801 - cuda-python's names
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUstream_flags(enum.IntEnum):  # noqa: N801
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):  # noqa: N801
    CU_EVENT_DISABLE_TIMING = 2


class CUmemAttach_flags(enum.IntEnum):  # noqa: N801
    CU_MEM_ATTACH_GLOBAL = 1


class CUstreamCaptureMode(enum.IntEnum):  # noqa: N801
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUlaunchAttributeID(enum.IntEnum):  # noqa: N801
    CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class CUlaunchAttribute:  # noqa: N801
    def __init__(self) -> None:
        self.id = None
        self.value = SimpleNamespace(programmaticStreamSerializationAllowed=0)


class CUlaunchConfig:  # noqa: N801
    """cuda-python's launch configuration: plain attributes."""

    gridDimX = gridDimY = gridDimZ = blockDimX = blockDimY = blockDimZ = 0  # noqa: N815
    sharedMemBytes = numAttrs = 0  # noqa: N815
    hStream: Any = None  # noqa: N815
    attrs: list[CUlaunchAttribute] = []  # noqa: RUF012


#: Calls that control a capture rather than being captured by it.
CAPTURE_CONTROL = frozenset({"cuStreamBeginCapture", "cuStreamEndCapture"})


class _Struct:
    """CUmemAllocationProp / CUmemAccessDesc: attributes plus a nested location."""

    def __init__(self) -> None:
        self.location = SimpleNamespace(type=None, id=None)


H200 = DeviceProfile(
    name="NVIDIA H200",
    platform="linux",
    compute_capability_major=9,
    compute_capability_minor=0,
    integrated=False,
    managed_memory=True,
    concurrent_managed_access=True,
    pageable_memory_access=False,
    vmm_supported=True,
    vmm_granularity=2 << 20,
    warp_size=32,
    total_memory=150_000_000_000,
    driver_version=13000,
)


class FakeDriver:
    """Just enough of ``cuda.bindings.driver``: every function call is recorded."""

    CUresult = CUresult
    CUdevice_attribute = CUdevice_attribute
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUstream_flags = CUstream_flags
    CUevent_flags = CUevent_flags
    CUmemAttach_flags = CUmemAttach_flags
    CUstreamCaptureMode = CUstreamCaptureMode
    CUmemAllocationProp = _Struct
    CUmemAccessDesc = _Struct
    CUlaunchAttributeID = CUlaunchAttributeID
    CUlaunchAttribute = CUlaunchAttribute
    CUlaunchConfig = CUlaunchConfig

    def __init__(self, profile: DeviceProfile = H200, device_count: int = 1) -> None:
        self.profile = profile
        self.device_count = device_count
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail: dict[str, CUresult] = {}  # next call of that name returns this error
        self.query_results: list[CUresult] = []
        self.launches: list[dict[str, Any]] = []
        self._memory: dict[int, np.ndarray] = {}  # keeps "device" memory alive
        self._next = 0
        # Stream capture: work on a capturing stream is recorded, run on cuGraphLaunch.
        self.capturing: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.graphs: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        self.execs: dict[str, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}

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

    def _launch(self, f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,
                smem: int, stream: Any, params: int, extra: Any) -> tuple[()]:  # fmt: skip
        self.launches.append(
            {"fn": f, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
             "stream": stream, "params": params, "extra": extra}
        )  # fmt: skip
        return ()

    def _launch_ex(self, config: CUlaunchConfig, f: Any, params: int, extra: Any) -> tuple[()]:
        self.launches.append(
            {"fn": f, "grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
             "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
             "smem": config.sharedMemBytes, "stream": config.hStream, "params": params,
             "extra": extra, "attrs": [(a.id, a.value.programmaticStreamSerializationAllowed)
                                       for a in config.attrs[: config.numAttrs]]}
        )  # fmt: skip
        return ()

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

    def _impl(self, name: str) -> Callable[..., tuple[Any, ...]]:
        p = self.profile
        copy = lambda dst, src, n, *_: ctypes.memmove(dst, src, n) and ()  # noqa: E731
        fill = lambda dst, value, n, *_: ctypes.memset(dst, value, n) and ()  # noqa: E731
        table: dict[str, Callable[..., tuple[Any, ...]]] = {
            "cuInit": lambda flags: (),
            "cuDeviceGetCount": lambda: (self.device_count,),
            "cuDeviceGet": lambda ordinal: (f"dev{ordinal}",),
            "cuDeviceGetName": lambda n, dev: (p.name.encode() + b"\0junk",),
            "cuDeviceTotalMem": lambda dev: (p.total_memory,),
            "cuDriverGetVersion": lambda: (p.driver_version,),
            "cuDeviceGetAttribute": lambda attr, dev: (int(getattr(p, ATTRIBUTE_FIELDS[attr])),),
            "cuMemGetAllocationGranularity": lambda prop, option: (p.vmm_granularity,),
            "cuDevicePrimaryCtxRetain": lambda dev: ("ctx",),
            "cuDevicePrimaryCtxRelease": lambda dev: (),
            "cuCtxSetCurrent": lambda ctx: (),
            "cuGetErrorString": lambda err: (CUresult.CUDA_SUCCESS, b"fake: " + err.name.encode()),
            "cuMemAlloc": lambda n: (self._host(n),),
            "cuMemAllocManaged": lambda n, flags: (self._host(n),),
            "cuMemFree": lambda ptr: (),
            "cuMemGetInfo": lambda: (p.total_memory // 2, p.total_memory),
            "cuMemsetD8": fill,
            "cuMemsetD8Async": fill,
            "cuMemcpyHtoD": copy,
            "cuMemcpyDtoH": copy,
            "cuMemcpyHtoDAsync": copy,
            "cuMemcpyDtoHAsync": copy,
            "cuMemcpyDtoDAsync": copy,
            "cuMemHostAlloc": lambda n, flags: (self._host(n),),
            "cuMemFreeHost": lambda ptr: (),
            "cuStreamCreate": lambda flags: (self._handle("stream"),),
            "cuStreamDestroy": lambda s: (),
            "cuStreamSynchronize": lambda s: (),
            "cuEventCreate": lambda flags: (self._handle("event"),),
            "cuEventDestroy": lambda e: (),
            "cuEventRecord": lambda e, s: (),
            "cuEventSynchronize": lambda e: (),
            "cuStreamWaitEvent": lambda s, e, flags: (),
            "cuMemAddressReserve": lambda n, align, addr, flags: (self._host(n),),
            "cuMemCreate": lambda n, prop, flags: (self._handle("mem"),),
            "cuMemMap": lambda ptr, n, offset, handle, flags: (),
            "cuMemSetAccess": lambda ptr, n, descs, count: (),
            "cuMemUnmap": lambda ptr, n: (),
            "cuMemRelease": lambda handle: (),
            "cuMemAddressFree": lambda ptr, n: (),
            "cuModuleLoadData": lambda image: (self._handle("module"),),
            "cuModuleGetFunction": lambda module, name: (f"{module}:{name.decode()}",),
            "cuLaunchKernel": self._launch,
            "cuLaunchKernelEx": self._launch_ex,
            "cuStreamBeginCapture": lambda s, mode: self.capturing.__setitem__(s, []) or (),
            "cuStreamEndCapture": self._end_capture,
            "cuGraphInstantiate": self._instantiate,
            "cuGraphLaunch": self._graph_launch,
            "cuGraphExecDestroy": lambda e: self.execs.pop(e) and (),
            "cuGraphDestroy": lambda g: self.graphs.pop(g) and (),
        }
        return table[name]

    def cuEventQuery(self, event: Any) -> tuple[CUresult]:  # noqa: N802
        self.calls.append(("cuEventQuery", (event,)))
        if "cuEventQuery" in self.fail:
            return (self.fail.pop("cuEventQuery"),)
        return (self.query_results.pop(0) if self.query_results else CUresult.CUDA_SUCCESS,)

    def __getattr__(self, name: str) -> Callable[..., tuple[Any, ...]]:
        if not name.startswith("cu"):
            raise AttributeError(name)
        impl = self._impl(name)

        def call(*args: Any) -> tuple[Any, ...]:
            if name != "cuGetErrorString":
                self.calls.append((name, args))
            if name in self.fail:
                # cuda-python returns the error plus placeholder outputs.
                return (self.fail.pop(name), None)
            if name not in CAPTURE_CONTROL:
                streams = [getattr(a, "hStream", a) for a in args]  # a launch config's stream
                live = self.capturing
                stream = next((a for a in streams if isinstance(a, str) and a in live), "")
                if stream and name == "cuStreamSynchronize":
                    return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)
                if stream:  # recorded with its arguments, run by cuGraphLaunch
                    self.capturing[stream].append((impl, args))
                    return (CUresult.CUDA_SUCCESS,)
            return (CUresult.CUDA_SUCCESS, *impl(*args))

        return call


class nvrtcResult(enum.IntEnum):  # noqa: N801
    NVRTC_SUCCESS = 0
    NVRTC_ERROR_INVALID_OPTION = 5
    NVRTC_ERROR_COMPILATION = 6


class FakeNvrtc:
    """``cuda.bindings.nvrtc``: a compile that succeeds (a fake cubin) or fails with a log."""

    nvrtcResult = nvrtcResult

    def __init__(self, log: str = "") -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.compile_error: str | None = None  # a compiler log: compilation fails with it
        self.version: tuple[int, int] = (13, 0)

    def _rec(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def nvrtcVersion(self) -> tuple[Any, ...]:  # noqa: N802
        return (nvrtcResult.NVRTC_SUCCESS, *self.version)

    def nvrtcCreateProgram(self, src: bytes, name: bytes, n: int, h: list, i: list) -> tuple:  # noqa: N802
        self._rec("nvrtcCreateProgram", name)
        return (nvrtcResult.NVRTC_SUCCESS, "prog")

    def nvrtcCompileProgram(self, prog: Any, n: int, opts: list[bytes]) -> tuple:  # noqa: N802
        self._rec("nvrtcCompileProgram", n, tuple(opts))
        if self.compile_error is not None:
            return (nvrtcResult.NVRTC_ERROR_COMPILATION,)
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcGetProgramLogSize(self, prog: Any) -> tuple:  # noqa: N802
        return (nvrtcResult.NVRTC_SUCCESS, len((self.compile_error or "").encode()) + 1)

    def nvrtcGetProgramLog(self, prog: Any, buf: bytes) -> tuple:  # noqa: N802
        data = (self.compile_error or "").encode() + b"\0"
        ctypes.memmove(buf, data, len(data))  # cuda-python writes into the bytes object
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcGetCUBINSize(self, prog: Any) -> tuple:  # noqa: N802
        return (nvrtcResult.NVRTC_SUCCESS, 8)

    def nvrtcGetCUBIN(self, prog: Any, buf: bytes) -> tuple:  # noqa: N802
        ctypes.memmove(buf, b"FAKECUBN", 8)
        self._rec("nvrtcGetCUBIN")
        return (nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcDestroyProgram(self, prog: Any) -> tuple:  # noqa: N802
        self._rec("nvrtcDestroyProgram")
        return (nvrtcResult.NVRTC_SUCCESS,)
