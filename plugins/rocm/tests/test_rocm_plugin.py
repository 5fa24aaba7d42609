"""The ROCm plugin without AMD hardware: availability, and how the adapter translates.

Availability is tested for real (hip-python absent, or present without libamdhip64). The
adapter is driven through :class:`RocmBackend` against fake ``hip`` and ``hiprtc`` modules
(``fake_hip.py``): these tests check which HIP calls each operation makes, with which
arguments. What vt.gpu.GpuBackend does with them (VMM bookkeeping, graphs, op launches) is
tested once, on a fake GPU runtime, in tests/test_gpu_backend.py.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
import vt_rocm.adapter as adapter
from fake_hip import (
    APU,
    ATTRIBUTE_FIELDS,
    DISCRETE,
    FakeHip,
    FakeHiprtc,
    hipError_t,
    hipMemAccessFlags,
    hipMemAllocationGranularity_flags,
    hipMemAllocationType,
    hipMemcpyKind,
    hipMemLocationType,
    hipStreamCaptureMode,
)
from vt.gpu import GpuBackend, GpuRuntime
from vt.gpu.modules import MODULE_GROUPS
from vt.management import rules
from vt.protocol.mixins import derive_capabilities
from vt_rocm.adapter import HipError, HipRuntime
from vt_rocm.backend import RocmBackend
from vt_rocm.caps import DeviceProfile, capabilities_from_device


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


_NO_LIBRARY = """
import ctypes, sys

real = ctypes.CDLL


def cdll(name, *args, **kwargs):
    if "amdhip64" in str(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    return real(name, *args, **kwargs)


ctypes.CDLL = cdll
import vt
from vt_rocm.backend import RocmBackend

probe = RocmBackend.probe()
assert not probe.available
print(probe.reason)
try:
    RocmBackend()
except vt.BackendUnavailableError as e:
    print(e)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("hip", "rocm")))
"""


def test_a_missing_hip_library_is_found_before_importing_the_bindings() -> None:
    # The bindings cost ~9 MiB and 25 ms to import: a machine without libamdhip64 (where
    # they could only fail) never imports them.
    if importlib.util.find_spec("hip") is None:
        pytest.skip("hip-python is not installed: the probe says so before any library look")
    done = subprocess.run(
        [sys.executable, "-c", _NO_LIBRARY], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    reason, error, modules = done.stdout.splitlines()
    assert reason.startswith("the HIP runtime could not be loaded: failed to dlopen '")
    assert "amdhip64" in reason and "cannot open shared object file" in reason
    assert error == f"backend 'rocm' is unavailable: {reason}"
    assert "rocm.bindings.hip" not in modules and "'hip'" not in modules


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
    assert RocmBackend.op_names() == tuple(vt.OPS)  # fused ops included


# --------------------------------------------------------------------------- kernels (hiprtc)


def make_rtc(
    profile: DeviceProfile = DISCRETE, fresh: bool = True
) -> tuple[RocmBackend, FakeHip, FakeHiprtc]:
    fake, rtc = FakeHip(profile), FakeHiprtc()
    backend = RocmBackend(HipRuntime(fake, hiprtc=rtc), platform=profile.platform)
    fake.calls.clear()
    if fresh:
        HipRuntime.binaries.clear()
    return backend, fake, rtc


def test_kernels_compile_with_hiprtc_for_the_device_arch_once_per_process() -> None:
    backend, fake, rtc = make_rtc(APU.model_copy(update={"warp_size": 64}))
    backend.prepare()
    compiles = [c[1] for c in rtc.calls if c[0] == "hiprtcCompileProgram"]
    opts = [b"--offload-arch=gfx942", b"-DVT_WARP=64", b"-DVT_NORM_LATE=1"]
    n = len(MODULE_GROUPS)
    # each group's module of every layout; the int8 group's with its own option (mma_stage)
    stage = [*opts, b"-DVT_MMA_STAGE=1"]
    assert compiles == [("prog", 4, stage) if g == "int8" else ("prog", 3, opts)
                        for g in MODULE_GROUPS]  # fmt: skip
    assert n == len(compiles)
    assert rtc.calls[-1] == ("hiprtcDestroyProgram", ("prog",))
    assert fake.args("hipModuleLoadData") == [(b"HSACODE!",)] * n
    other, fake2, rtc2 = make_rtc(APU.model_copy(update={"warp_size": 64}), fresh=False)
    other.prepare()  # a second backend loads the cached code objects: no second compile
    assert rtc2.calls == [] and fake2.args("hipModuleLoadData") == [(b"HSACODE!",)] * n


def test_a_prebuilt_code_object_is_built_on_a_helper_thread_and_loaded_by_compile() -> None:
    """GpuRuntime.prebuild: hiprtc's part on any thread (no HIP call there), so that the
    module's compile on the launching thread only loads it."""
    backend, fake, rtc = make_rtc()
    runtime = backend.runtime
    source, name, options = 'extern "C" __global__ void k() {}', "k.cu", ["-DVT_WARP=64"]
    helper = threading.Thread(target=runtime.prebuild, args=(source, name, options))
    helper.start()
    helper.join()
    assert [c[0] for c in rtc.calls].count("hiprtcCompileProgram") == 1
    assert fake.calls == []  # no HIP call on the helper thread
    runtime.prebuild(source, name, options)  # built once
    runtime.compile(source, name, options)
    assert [c[0] for c in rtc.calls].count("hiprtcCompileProgram") == 1
    assert fake.args("hipModuleLoadData") == [(b"HSACODE!",)]


def test_a_later_process_loads_the_code_object_from_vt_home(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """vt.gpu.kernel_cache, keyed by hiprtcVersion: no second compile in a new process. The
    compile says so on stderr, naming the module; the later load is quiet."""
    backend, _, rtc = make_rtc()
    backend.prepare()
    n = len(MODULE_GROUPS)
    assert [c[0] for c in rtc.calls].count("hiprtcCompileProgram") == n
    err = capsys.readouterr().err
    assert err.startswith("vt: compiling hip kernels vt_rows.cu (first run only; kept in ")
    assert "vt: compiling hip kernels vt_attention.cu (first run only; kept in " in err
    later, fake, rtc = make_rtc()  # fresh: the per-process cache emptied
    later.prepare()
    assert [c[0] for c in rtc.calls] == ["hiprtcVersion"] * n
    assert fake.args("hipModuleLoadData") == [(b"HSACODE!",)] * n
    assert "vt: compiling" not in capsys.readouterr().err


def test_a_hiprtc_compile_error_carries_the_log() -> None:
    backend, _, rtc = make_rtc()
    rtc.compile_error = "vt_rows.cu:9:1: error: unknown type name 'x'"
    with pytest.raises(HipError) as info:
        backend.prepare()
    message = str(info.value)
    assert message.startswith("hiprtcCompileProgram('vt_rows.cu', --offload-arch=gfx1100")
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


def test_free_memory_is_hipmemgetinfo() -> None:
    backend, fake = make(DISCRETE)
    assert backend.runtime.memory_info() == (DISCRETE.total_memory // 2, DISCRETE.total_memory)
    assert fake.calls[-1] == ("hipMemGetInfo", ())


def test_alloc_uses_hipmallocmanaged_on_an_apu() -> None:
    backend, fake = make(APU)
    backend.alloc(4096)
    assert fake.calls == [("hipMallocManaged", (4096, FakeHip.hipMemAttachGlobal))]


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


def test_host_view_is_refused_on_a_discrete_device_and_shares_managed_memory_on_an_apu() -> None:
    discrete, _ = make(DISCRETE)
    with pytest.raises(vt.HostAccessError, match="not host-addressable"):
        discrete.host_view(discrete.alloc(16))
    apu, fake = make(APU)
    buf = apu.alloc(16)  # hipMallocManaged: the host may dereference it
    apu.host_view(buf.view(4, 8))[:] = 9
    out = np.empty(16, np.uint8)
    apu.copy_d2h(out, buf)
    assert out.tolist() == [0] * 4 + [9] * 8 + [0] * 4
    assert fake.names()[0] == "hipMallocManaged"


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


def test_vmm_on_a_device_without_it_names_the_attribute() -> None:
    backend, fake = make(DISCRETE.model_copy(update={"vmm_supported": False}))
    assert backend.capabilities.vmm is None
    with pytest.raises(vt.VmmError, match="VirtualMemoryManagementSupported=0"):
        backend.vmm_reserve(4096)
    assert fake.calls == []


def test_windows_backend_declares_aliasing_segments() -> None:
    backend, _ = make(DISCRETE.model_copy(update={"platform": "windows"}))
    assert backend.capabilities.vmm == vt.VmmCaps(granularity=4096, segments_may_alias=True)


# --------------------------------------------------------------------------- graphs


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
