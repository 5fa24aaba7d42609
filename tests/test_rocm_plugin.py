"""The ROCm plugin without AMD hardware.

Availability is tested for real (hip-python absent, or present without libamdhip64). The
protocol methods are tested against a fake ``hip`` module injected into the adapter: it
records every call, returns hip-python's ``(hipError_t, *outputs)`` tuples, backs "device"
memory with host memory so copies really move bytes, and fails on request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import vt
import vt_rocm.adapter as adapter
from vt import rules
from vt.gpu import GpuBackend, GpuRuntime
from vt.memory import VmmArena
from vt.mixins import derive_capabilities
from vt_rocm.adapter import HipError, HipRuntime
from vt_rocm.backend import RocmBackend
from vt_rocm.caps import DeviceProfile, capabilities_from_device

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


def make(profile: DeviceProfile = DISCRETE) -> tuple[RocmBackend, FakeHip]:
    fake = FakeHip(profile)
    backend = RocmBackend(HipRuntime(fake), platform=profile.platform)
    # What the registry does with the probe's declaration (the fake device's, not this
    # machine's: RocmBackend.probe() would look for a real one).
    backend.capabilities = derive_capabilities(RocmBackend, capabilities_from_device(profile))
    fake.calls.clear()
    return backend, fake


# --------------------------------------------------------------------------- availability


def test_probe_in_this_environment_says_why_it_is_unavailable() -> None:
    probe = RocmBackend.probe()
    if importlib.util.find_spec("hip") is None:
        assert not probe.available
        assert probe.reason == "hip-python is not installed (pip install 'vt[rocm]')"
    elif ctypes.util.find_library("amdhip64") is None:
        # hip-python is there but the ROCm runtime is not: its RuntimeError names the library.
        assert not probe.available
        assert "libamdhip64.so" in probe.reason or "amdhip64" in probe.reason
        assert probe.reason.startswith("the HIP runtime could not be loaded")
    else:  # a real ROCm machine: available, or no device with the HIP call named
        assert probe.available or "hipGetDeviceCount" in probe.reason


def test_probe_without_hip_python_says_to_install_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "hip", None)  # makes `from hip import hip` fail
    probe = RocmBackend.probe()
    assert not probe.available
    assert probe.reason == "hip-python is not installed (pip install 'vt[rocm]')"
    with pytest.raises(vt.BackendUnavailableError, match=r"pip install 'vt\[rocm\]'"):
        RocmBackend()


def test_broken_hip_python_install_is_reported_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> Any:
        raise ImportError("undefined symbol: hipGetDeviceCount")

    monkeypatch.setattr(adapter, "import_hip", broken)
    probe = RocmBackend.probe()
    assert not probe.available
    assert "hip-python failed to import (undefined symbol: hipGetDeviceCount)" in probe.reason
    assert "vt[rocm]" in probe.reason


def test_missing_runtime_library_is_unavailable_not_broken() -> None:
    class NoLibrary(FakeHip):
        def hipGetDeviceCount(self) -> Any:  # noqa: N802
            raise RuntimeError("failed to dlopen 'libamdhip64.so': cannot open shared object file")

    probe = RocmBackend.probe_runtime(HipRuntime(NoLibrary()))
    assert not probe.available
    assert "libamdhip64.so" in probe.reason


def test_missing_runtime_reason_shows_hip_pythons_bytes_as_text() -> None:
    # hip-python's own message (seen in `vt backends` here) embeds bytes reprs.
    class NoLibrary(FakeHip):
        def hipGetDeviceCount(self) -> Any:  # noqa: N802
            raise RuntimeError(
                "failed to dlopen 'b'libamdhip64.so'': b'libamdhip64.so: cannot open shared "
                "object file: No such file or directory'"
            )

    probe = RocmBackend.probe_runtime(HipRuntime(NoLibrary()))
    assert probe.reason == (
        "the HIP runtime could not be loaded: failed to dlopen 'libamdhip64.so': "
        "libamdhip64.so: cannot open shared object file: No such file or directory"
    )


def test_no_device_is_unavailable_naming_the_call() -> None:
    fake = FakeHip()
    fake.fail["hipGetDeviceCount"] = hipError_t.hipErrorNoDevice
    probe = RocmBackend.probe_runtime(HipRuntime(fake))
    assert not probe.available
    assert probe.reason == (
        "hipGetDeviceCount() failed: hipErrorNoDevice (100): fake: hipErrorNoDevice"
    )


def test_importing_the_plugin_does_not_import_hip() -> None:
    code = "import sys, vt_rocm.plugin; assert 'hip' not in sys.modules, 'hip imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("profile", [DISCRETE, APU], ids=["discrete", "apu"])
def test_probe_on_a_device_derives_capabilities(profile: DeviceProfile) -> None:
    fake = FakeHip(profile)
    probe = RocmBackend.probe_runtime(HipRuntime(fake), platform=profile.platform)
    assert probe.available, probe.reason
    assert probe.capabilities == capabilities_from_device(profile)
    assert probe.device == f"{profile.name} ({profile.gcn_arch_name}, linux)"
    assert DeviceProfile.model_validate(probe.details) == profile
    assert rules.check(RocmBackend, derive_capabilities(RocmBackend, probe.capabilities)) == []


def test_device_profile_reads_each_attribute_and_the_granularity() -> None:
    fake = FakeHip(APU)
    profile = HipRuntime(fake).device_profile("win32")
    assert profile == APU.model_copy(update={"platform": "windows"})
    queried = {args[0] for args in fake.args("hipDeviceGetAttribute")}
    assert queried == set(ATTRIBUTE_FIELDS)
    ((prop, option),) = fake.args("hipMemGetAllocationGranularity")
    assert option == hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
    assert prop.type == hipMemAllocationType.hipMemAllocationTypePinned
    assert (prop.location.type, prop.location.id) == (
        hipMemLocationType.hipMemLocationTypeDevice,
        0,
    )


def test_device_without_vmm_skips_the_granularity_query() -> None:
    fake = FakeHip(DISCRETE.model_copy(update={"vmm_supported": False, "vmm_granularity": 0}))
    profile = HipRuntime(fake).device_profile("linux")
    assert not profile.vmm_supported and profile.vmm_granularity == 0
    assert "hipMemGetAllocationGranularity" not in fake.names()


def test_it_is_the_shared_gpu_backend_with_every_primitive_op() -> None:
    # ROCm and CUDA differ only in their runtime adapter and capability function.
    assert issubclass(RocmBackend, GpuBackend)
    assert isinstance(HipRuntime(FakeHip()), GpuRuntime)
    assert RocmBackend.op_names() == vt.PRIMITIVE_OPS  # fused ops run as decompositions


# --------------------------------------------------------------------------- kernels (hiprtc)


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
            return (ok,)

        return call


def make_rtc(
    profile: DeviceProfile = DISCRETE, fresh: bool = True
) -> tuple[RocmBackend, FakeHip, FakeHiprtc]:
    fake, rtc = FakeHip(profile), FakeHiprtc()
    backend = RocmBackend(HipRuntime(fake, hiprtc=rtc), platform=profile.platform)
    fake.calls.clear()
    if fresh:
        HipRuntime._code_objects.clear()
    return backend, fake, rtc


def test_kernels_compile_with_hiprtc_for_the_device_arch_once_per_process() -> None:
    backend, fake, rtc = make_rtc(APU.model_copy(update={"warp_size": 64}))
    backend.prepare()
    ((_, (prog, n, opts)),) = [c for c in rtc.calls if c[0] == "hiprtcCompileProgram"]
    assert opts == [b"--offload-arch=gfx942", b"-DVT_WARP=64"] and n == 2
    assert rtc.calls[-1] == ("hiprtcDestroyProgram", ("prog",))
    assert fake.args("hipModuleLoadData") == [(b"HSACODE!",)]
    other, fake2, rtc2 = make_rtc(APU.model_copy(update={"warp_size": 64}), fresh=False)
    other.prepare()  # a second backend loads the cached code object: no second compile
    assert rtc2.calls == [] and fake2.args("hipModuleLoadData") == [(b"HSACODE!",)]


def test_a_hiprtc_compile_error_carries_the_log() -> None:
    backend, _, rtc = make_rtc()
    rtc.compile_error = "vt_kernels.cu:9:1: error: unknown type name 'x'"
    with pytest.raises(HipError) as info:
        backend.prepare()
    message = str(info.value)
    assert message.startswith("hiprtcCompileProgram('vt_kernels.cu', --offload-arch=gfx1100")
    assert "HIPRTC_ERROR_COMPILATION (6)" in message and "unknown type name 'x'" in message
    assert rtc.calls[-1][0] == "hiprtcDestroyProgram"


def test_kernel_launch_translation() -> None:
    backend, fake, _ = make_rtc()
    seen: list[tuple[Any, ...]] = []

    def launch(f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
               stream: Any, params: int, extra: Any) -> tuple[hipError_t]:  # fmt: skip
        ptrs = (ctypes.c_void_p * 4).from_address(params)
        vals = [ctypes.c_void_p.from_address(ptrs[i]).value for i in range(3)]
        seen.append((f, (gx, gy, gz), (bx, by, bz), smem, stream, extra, *vals,
                     ctypes.c_int32.from_address(ptrs[3]).value))  # fmt: skip
        return (hipError_t.hipSuccess,)

    fake.hipModuleLaunchKernel = launch  # type: ignore[attr-defined]
    stream = backend.create_stream()
    out, a, b = backend.alloc(40), backend.alloc(40), backend.alloc(40)
    out_t, a_t, b_t = (vt.Tensor.of(buf, np.float32, 2, 5) for buf in (out, a, b))
    backend.launch("add", stream, out=out_t, a=a_t, b=b_t)
    assert seen[0][0].startswith("module#") and seen[0][0].endswith(":add")
    assert seen == [
        (seen[0][0], (1, 1, 1), (256, 1, 1), 0, stream.handle, None, out.handle, a.handle,
         b.handle, 10),
    ]  # fmt: skip


# --------------------------------------------------------------------------- memory


def test_alloc_uses_hipmalloc_on_a_discrete_device() -> None:
    backend, fake = make(DISCRETE)
    buf = backend.alloc(1024)
    backend.free(buf)
    assert fake.calls == [("hipMalloc", (1024,)), ("hipFree", (buf.handle,))]
    assert buf.nbytes == 1024 and buf.owner == "rocm"


def test_alloc_uses_hipmallocmanaged_on_an_apu() -> None:
    backend, fake = make(APU)
    backend.alloc(4096)
    assert fake.calls == [("hipMallocManaged", (4096, FakeHip.hipMemAttachGlobal))]


def test_free_refuses_a_view() -> None:
    backend, _ = make()
    with pytest.raises(ValueError, match="not a view"):
        backend.free(backend.alloc(64).view(16, 16))


def test_copies_move_bytes_and_honour_offsets() -> None:
    backend, fake = make()
    buf = backend.alloc(64)
    backend.memset(buf, 7)
    backend.copy_h2d(buf.view(16, 8), np.arange(8, dtype=np.uint8))
    out = np.empty(64, dtype=np.uint8)
    backend.copy_d2h(out, buf)
    expected = np.full(64, 7, dtype=np.uint8)
    expected[16:24] = np.arange(8)
    np.testing.assert_array_equal(out, expected)

    h2d, d2h = fake.args("hipMemcpy")
    assert h2d[0] == buf.handle + 16 and h2d[2:] == (8, hipMemcpyKind.hipMemcpyHostToDevice)
    assert d2h[1] == buf.handle and d2h[2:] == (64, hipMemcpyKind.hipMemcpyDeviceToHost)
    assert fake.args("hipMemset") == [(buf.handle, 7, 64)]


def test_async_copies_and_memset_run_on_the_stream() -> None:
    backend, fake = make()
    stream = backend.create_stream("main")
    a, b = backend.alloc(32), backend.alloc(32)
    pinned = backend.alloc_pinned(32)
    pinned.array[:] = np.arange(32, dtype=np.uint8)
    backend.memset(b, 0, stream)
    backend.copy_h2d_async(a, pinned, stream)
    backend.copy_d2d(b, a, 32, stream)
    out = backend.alloc_pinned(32)
    backend.copy_d2h_async(out, b, stream)
    np.testing.assert_array_equal(out.array, np.arange(32))

    assert fake.args("hipMemsetAsync") == [(b.handle, 0, 32, stream.handle)]
    kinds = [(args[3], args[4]) for args in fake.args("hipMemcpyAsync")]
    assert kinds == [
        (hipMemcpyKind.hipMemcpyHostToDevice, stream.handle),
        (hipMemcpyKind.hipMemcpyDeviceToDevice, stream.handle),
        (hipMemcpyKind.hipMemcpyDeviceToHost, stream.handle),
    ]


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (lambda be, buf: be.copy_h2d(buf, np.zeros(65, np.uint8)), "65 bytes do not fit"),
        (lambda be, buf: be.copy_d2h(np.zeros(65, np.uint8), buf), "65 bytes do not fit"),
        (lambda be, buf: be.copy_d2h(np.zeros((8, 8), np.uint8)[:, ::2], buf), "C-contiguous"),
        (lambda be, buf: be.memset(buf, 256), "is not a byte"),
        (lambda be, buf: be.alloc(-1), "non-negative integer"),
        (lambda be, buf: be.copy_d2d(buf, buf.view(0, 8), 16, be.create_stream()), "16 bytes"),
    ],
    ids=["h2d-too-big", "d2h-too-big", "d2h-strided", "memset-value", "alloc", "d2d"],
)
def test_bad_copy_arguments_fail_before_calling_hip(op: Callable, message: str) -> None:
    backend, fake = make()
    buf = backend.alloc(64)
    fake.calls.clear()
    with pytest.raises(ValueError, match=message):
        op(backend, buf)
    assert not {"hipMemcpy", "hipMemcpyAsync", "hipMemset"} & set(fake.names())


def test_read_only_destination_is_refused() -> None:
    backend, _ = make()
    out = np.zeros(8, np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        backend.copy_d2h(out, backend.alloc(8))


def test_pinned_memory_is_a_view_of_hiphostmalloc() -> None:
    backend, fake = make()
    host = backend.alloc_pinned(16)
    assert host.pinned and host.nbytes == 16 and host.array.dtype == np.uint8
    assert fake.calls == [("hipHostMalloc", (16, FakeHip.hipHostMallocDefault))]
    assert host.array.ctypes.data == host.handle  # no copy: the array IS the pinned memory
    handle = host.handle
    backend.free_pinned(host)
    backend.free_pinned(host)  # a second free is a no-op, not a double free
    assert fake.args("hipHostFree") == [(handle,)]


def test_host_view_raises_on_a_discrete_device() -> None:
    backend, _ = make(DISCRETE)
    with pytest.raises(vt.HostAccessError, match="not host-addressable"):
        backend.host_view(backend.alloc(16))


def test_host_view_shares_managed_memory_on_an_apu() -> None:
    backend, _ = make(APU)
    buf = backend.alloc(16)
    view = backend.host_view(buf.view(4, 8))
    view[:] = 9
    out = np.empty(16, np.uint8)
    backend.copy_d2h(out, buf)
    assert out.tolist() == [0] * 4 + [9] * 8 + [0] * 4


def test_host_view_follows_the_effective_capability() -> None:
    backend, _ = make(APU)
    backend.capabilities = backend.capabilities.with_value(
        "device_memory_is_host_addressable", False, vt.Source.env, "VT_CAPS"
    )
    with pytest.raises(vt.HostAccessError):
        backend.host_view(backend.alloc(16))


# --------------------------------------------------------------------------- errors


def test_a_failing_call_raises_a_clear_error() -> None:
    backend, fake = make()
    fake.fail["hipMalloc"] = hipError_t.hipErrorOutOfMemory
    with pytest.raises(HipError) as info:
        backend.alloc(1 << 40)
    message = str(info.value)
    assert message == (
        "hipMalloc(1099511627776) failed: hipErrorOutOfMemory (2): fake: hipErrorOutOfMemory"
    )
    assert isinstance(info.value, vt.VtError) and isinstance(info.value, RuntimeError)
    assert info.value.call.startswith("hipMalloc(") and info.value.code == 2


def test_unknown_error_code_is_still_named() -> None:
    fake = FakeHip()
    fake.fail["hipStreamCreate"] = 4242  # type: ignore[assignment]
    with pytest.raises(HipError, match=r"hipStreamCreate\(\) failed: hipError 4242 \(4242\)"):
        HipRuntime(fake).call("hipStreamCreate")


# --------------------------------------------------------------------------- streams, events


def test_stream_and_event_calls() -> None:
    backend, fake = make()
    stream = backend.create_stream("copy")
    event = backend.create_event()
    backend.record_event(event, stream)
    fake.query_results = [hipError_t.hipErrorNotReady, hipError_t.hipSuccess]
    assert backend.query_event(event) is False
    assert backend.query_event(event) is True
    backend.synchronize_event(event)
    backend.stream_wait_event(stream, event)
    backend.synchronize(stream)
    backend.destroy_event(event)
    backend.destroy_stream(stream)
    assert fake.calls == [
        ("hipStreamCreate", ()),
        ("hipEventCreateWithFlags", (FakeHip.hipEventDisableTiming,)),
        ("hipEventRecord", (event.handle, stream.handle)),
        ("hipEventQuery", (event.handle,)),
        ("hipEventQuery", (event.handle,)),
        ("hipEventSynchronize", (event.handle,)),
        ("hipStreamWaitEvent", (stream.handle, event.handle, 0)),
        ("hipStreamSynchronize", (stream.handle,)),
        ("hipEventDestroy", (event.handle,)),
        ("hipStreamDestroy", (stream.handle,)),
    ]
    assert stream.name == "copy"


def test_event_query_error_other_than_not_ready_raises() -> None:
    backend, fake = make()
    event = backend.create_event()
    fake.fail["hipEventQuery"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(HipError, match="hipEventQuery.*hipErrorInvalidValue"):
        backend.query_event(event)


# --------------------------------------------------------------------------- VMM


def test_vmm_call_sequence_sets_access_over_the_mapped_prefix() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(4 * g)
    base = vrange.handle.base
    first = backend.vmm_map(vrange, 0, g)
    second = backend.vmm_map(vrange, g, 2 * g)
    buf = backend.vmm_buffer(vrange)
    backend.vmm_unmap(vrange, second)
    backend.vmm_unmap(vrange, first)
    backend.vmm_release(vrange)
    backend.vmm_release(vrange)  # idempotent

    assert fake.names() == [
        "hipMemGetAllocationGranularity",
        "hipMemAddressReserve",
        "hipMemCreate",
        "hipMemMap",
        "hipMemSetAccess",
        "hipMemCreate",
        "hipMemMap",
        "hipMemSetAccess",
        "hipMemUnmap",
        "hipMemRelease",
        "hipMemUnmap",
        "hipMemRelease",
        "hipMemAddressFree",
    ]
    assert g == 4096 and (buf.handle, buf.nbytes) == (base, 4 * g)
    assert fake.args("hipMemAddressReserve") == [(4 * g, 0, None, 0)]
    (create1, prop, _), (create2, _, _) = fake.args("hipMemCreate")
    assert (create1, create2) == (g, 2 * g)
    assert prop.type == hipMemAllocationType.hipMemAllocationTypePinned
    assert fake.args("hipMemMap") == [
        (base, g, 0, first.handle, 0),
        (base + g, 2 * g, 0, second.handle, 0),
    ]
    access = fake.args("hipMemSetAccess")
    # The second call covers the whole mapped prefix [0, 3g), not only the new segment.
    assert [(ptr, n, count) for ptr, n, _, count in access] == [(base, g, 1), (base, 3 * g, 1)]
    desc = access[0][2]
    assert desc.flags == hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
    assert (desc.location.type, desc.location.id) == (
        hipMemLocationType.hipMemLocationTypeDevice,
        0,
    )
    assert fake.args("hipMemUnmap") == [(base + g, 2 * g), (base, g)]
    assert fake.args("hipMemRelease") == [(second.handle,), (first.handle,)]
    assert fake.args("hipMemAddressFree") == [(base, 4 * g)]


def test_segment_past_a_gap_gets_access_on_its_own() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(4 * g)
    backend.vmm_map(vrange, 2 * g, g)
    ((ptr, n, _, _),) = fake.args("hipMemSetAccess")
    assert (ptr - vrange.handle.base, n) == (2 * g, g)


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda be, vr, g: be.vmm_reserve(0), "reservation of 0 bytes must be a non-zero multiple"),
        (
            lambda be, vr, g: be.vmm_reserve(g + 1),
            "must be a non-zero multiple of granularity 4096",
        ),
        (lambda be, vr, g: be.vmm_map(vr, 0, g + 1), "segment of 4097 bytes must be"),
        (lambda be, vr, g: be.vmm_map(vr, 1, g), "segment offset of 1 bytes must be a multiple"),
        (lambda be, vr, g: be.vmm_map(vr, g, 2 * g), r"would exceed reserve: 4096 \+ 8192 > 8192"),
        (lambda be, vr, g: be.vmm_map(vr, 0, g) and be.vmm_map(vr, 0, g), "overlaps"),
        (lambda be, vr, g: be.vmm_map(vr, 0, g) and be.vmm_release(vr), "unmap the 1 mapped"),
        (lambda be, vr, g: be.vmm_unmap(vr, vt.Segment("x", 0, g)), "is not mapped"),
        (lambda be, vr, g: be.vmm_buffer(vt.VirtualRange(object(), g)), "not a reservation"),
    ],
    ids=["zero", "reserve", "size", "offset", "exceed", "overlap", "release", "unmap", "foreign"],
)
def test_bad_vmm_requests_raise_vmm_error(action: Callable, message: str) -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    with pytest.raises(vt.VmmError, match=message):
        action(backend, vrange, g)


def test_vmm_on_a_device_without_it_names_the_attribute() -> None:
    backend, fake = make(DISCRETE.model_copy(update={"vmm_supported": False}))
    assert backend.capabilities.vmm is None
    with pytest.raises(vt.VmmError, match="VirtualMemoryManagementSupported=0"):
        backend.vmm_reserve(4096)
    assert fake.calls == []


def test_failed_map_releases_the_physical_memory() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    fake.fail["hipMemMap"] = hipError_t.hipErrorOutOfMemory
    with pytest.raises(HipError, match="hipMemMap.*hipErrorOutOfMemory"):
        backend.vmm_map(vrange, 0, g)
    (handle,) = [args[0] for args in fake.args("hipMemRelease")]
    assert handle.startswith("mem#")
    assert vrange.handle.segments == []
    backend.vmm_map(vrange, 0, g)  # the arena can try again


def test_failed_set_access_unmaps_the_segment() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    fake.fail["hipMemSetAccess"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(HipError, match="hipMemSetAccess"):
        backend.vmm_map(vrange, 0, g)
    assert fake.names()[-3:] == ["hipMemSetAccess", "hipMemUnmap", "hipMemRelease"]
    assert vrange.handle.segments == []
    backend.vmm_release(vrange)


def test_release_after_a_failed_address_free_can_be_retried() -> None:
    backend, fake = make()
    vrange = backend.vmm_reserve(backend.vmm_granularity())
    fake.fail["hipMemAddressFree"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(HipError):
        backend.vmm_release(vrange)
    backend.vmm_release(vrange)
    assert len(fake.args("hipMemAddressFree")) == 2
    with pytest.raises(vt.VmmError, match="already released"):
        backend.vmm_map(vrange, 0, 4096)


def test_unmap_after_a_failed_release_is_retried_without_unmapping_again() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    base = vrange.handle.base
    first = backend.vmm_map(vrange, 0, g)
    second = backend.vmm_map(vrange, g, g)
    fake.fail["hipMemRelease"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(HipError, match="hipMemRelease"):
        backend.vmm_unmap(vrange, second)
    # still listed, so the reservation is not freed under its physical memory
    assert vrange.handle.segments == [first, second]
    with pytest.raises(vt.VmmError, match="unmap the 2 mapped segment"):
        backend.vmm_release(vrange)
    backend.vmm_unmap(vrange, second)  # the retry completes
    assert fake.args("hipMemUnmap") == [(base + g, g)]  # the range was unmapped once
    assert fake.args("hipMemRelease") == [(second.handle,), (second.handle,)]
    assert vrange.handle.segments == [first]
    with pytest.raises(vt.VmmError, match="is not mapped"):
        backend.vmm_unmap(vrange, second)
    backend.vmm_unmap(vrange, first)
    backend.vmm_release(vrange)


def test_arena_release_retries_a_failed_hipmemrelease() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    arena = VmmArena.reserve(backend, 4 * g, min_growth=g)
    base = arena.vrange.handle.base
    arena.ensure(g)
    arena.ensure(2 * g)
    assert arena.segments == 2
    fake.fail["hipMemRelease"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(vt.VmmError, match="2 segment\\(s\\) still mapped, call release"):
        arena.release()
    assert arena.segments == 2 and arena.mapped_bytes == 2 * g
    arena.release()
    assert arena.released and arena.mapped_bytes == 0
    assert fake.args("hipMemUnmap") == [(base + g, g), (base, g)]  # none again on the retry
    first, second = (args[3] for args in fake.args("hipMemMap"))
    assert fake.args("hipMemRelease") == [(second,), (second,), (first,)]
    assert fake.names()[-1] == "hipMemAddressFree"


def test_failed_set_access_with_a_failed_release_still_frees_the_reservation() -> None:
    backend, fake = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(2 * g)
    fake.fail["hipMemSetAccess"] = hipError_t.hipErrorInvalidValue
    fake.fail["hipMemRelease"] = hipError_t.hipErrorInvalidValue
    with pytest.raises(HipError, match="hipMemSetAccess"):
        backend.vmm_map(vrange, 0, g)
    # the caller never got the segment, so nothing could retry it: it is forgotten
    assert vrange.handle.segments == [] and vrange.handle.unmapped == []
    backend.vmm_map(vrange, 0, g)
    assert fake.names()[-1] == "hipMemSetAccess"


def test_windows_backend_declares_aliasing_segments() -> None:
    backend, _ = make(DISCRETE.model_copy(update={"platform": "windows"}))
    assert backend.capabilities.vmm == vt.VmmCaps(granularity=4096, segments_may_alias=True)


# --------------------------------------------------------------------------- graphs


def test_graphs_are_derived_from_the_graphs_mixin() -> None:
    backend, _ = make()
    assert backend.capabilities.graphs is True
    prov = backend.capabilities.source_of("graphs")
    assert (prov.source, prov.detail) == (vt.Source.derived, "implements vt.Graphs")
    assert rules.check(RocmBackend, backend.capabilities) == []


def test_graph_capture_translates_to_hip_stream_capture() -> None:
    backend, fake = make()
    s = backend.create_stream("main")
    src, dst = backend.alloc(32), backend.alloc(32)
    backend.copy_h2d(src, np.full(32, 4, np.uint8))
    backend.memset(dst, 0)
    fake.calls.clear()
    backend.begin_capture(s)
    backend.copy_d2d(dst, src, 32, s)
    graph = backend.end_capture(s)
    assert fake.names() == [
        "hipStreamBeginCapture",
        "hipMemcpyAsync",
        "hipStreamEndCapture",
        "hipGraphInstantiateWithFlags",
        "hipGraphDestroy",
    ]
    assert fake.args("hipStreamBeginCapture") == [
        (s.handle, hipStreamCaptureMode.hipStreamCaptureModeThreadLocal)
    ]
    got = np.empty(32, np.uint8)
    backend.copy_d2h(got, dst)
    assert (got == 0).all()  # recorded, not run
    backend.copy_h2d(src, np.full(32, 6, np.uint8))
    fake.calls.clear()
    backend.launch_graph(graph, s)
    assert fake.names() == ["hipGraphLaunch"]
    backend.copy_d2h(got, dst)
    assert (got == 6).all()
    backend.destroy_graph(graph)
    assert fake.names()[-1] == "hipGraphExecDestroy" and fake.execs == {}


def test_a_failed_hip_instantiation_names_the_call_and_destroys_the_graph() -> None:
    backend, fake = make()
    s = backend.create_stream()
    backend.begin_capture(s)
    fake.fail["hipGraphInstantiateWithFlags"] = hipError_t.hipErrorOutOfMemory
    with pytest.raises(HipError, match=r"hipGraphInstantiateWithFlags\(.*hipErrorOutOfMemory"):
        backend.end_capture(s)
    assert fake.names()[-1] == "hipGraphDestroy" and fake.graphs == {}


def test_the_audit_graph_probe_passes_on_the_fake_hip() -> None:
    from vt.audit import probe_graphs

    backend, fake = make()
    (check,) = probe_graphs(backend)
    assert (check.id, check.result) == ("graph-replay", "pass"), check.detail
    assert fake.names().count("hipGraphLaunch") == 2 and fake.execs == {}


# --------------------------------------------------------------------------- the real API


def test_every_hip_name_the_plugin_uses_exists_in_hip_python() -> None:
    """The fake cannot catch a misspelt HIP name; hip-python's own module can."""
    if importlib.util.find_spec("hip") is None:
        # Without hip-python this environment can only check the unavailable path.
        assert "vt[rocm]" in RocmBackend.probe().reason
        return
    from hip import hip

    source = "".join(
        Path(module.__file__).read_text() for module in (adapter, sys.modules["vt_rocm.backend"])
    )
    called = set(re.findall(r'"(hip[A-Z][A-Za-z]+)"', source))
    attributes = set(re.findall(r"\.hip\.(hip[A-Za-z_]+)|_hip\.(hip[A-Za-z_]+)", source))
    names = called | {a or b for a, b in attributes}
    assert {"hipMemAddressReserve", "hipMemSetAccess", "hipEventQuery"} <= names
    missing = sorted(name for name in names if not hasattr(hip, name))
    assert missing == []
    for short in ATTRIBUTE_FIELDS:
        assert hasattr(hip.hipDeviceAttribute_t, short.name)

    runtime = HipRuntime(hip)
    prop = runtime.allocation_prop()  # real structs: no runtime library needed to build them
    assert prop.type == hip.hipMemAllocationType.hipMemAllocationTypePinned
    assert prop.location.type == hip.hipMemLocationType.hipMemLocationTypeDevice
    desc = runtime.access_desc()
    assert desc.flags == hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
    assert runtime.error_name(hip.hipError_t.hipErrorNotReady) == "hipErrorNotReady"


def test_every_hiprtc_name_the_adapter_uses_exists_in_hip_python() -> None:
    if importlib.util.find_spec("hip") is None:
        assert "vt[rocm]" in RocmBackend.probe().reason
        return
    from hip import hiprtc

    source = Path(adapter.__file__).read_text()
    found = re.findall(r'"(hiprtc[A-Z][A-Za-z]+)"|rtc\.(hiprtc[A-Z][A-Za-z]+)', source)
    names = {a or b for a, b in found}
    assert {"hiprtcCompileProgram", "hiprtcGetCode", "hiprtcDestroyProgram"} <= names
    assert sorted(name for name in names if not hasattr(hiprtc, name)) == []
    assert hiprtc.hiprtcResult.HIPRTC_SUCCESS == 0
