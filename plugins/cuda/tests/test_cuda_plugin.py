"""The CUDA plugin without an NVIDIA GPU: availability, and how the adapter translates.

Availability is tested for real (cuda-python absent, or present without a driver). The
adapter is driven through :class:`CudaBackend` against fake ``driver``/``nvrtc`` modules
(``fake_cuda.py``): they record every call, return cuda-python's ``(CUresult, *outputs)``
tuples, back "device" memory with host memory so copies really move bytes, and fail on
request; these tests check which CUDA calls each operation makes, with which arguments.
What vt.gpu.GpuBackend does with them (VMM bookkeeping, graphs, op launches) is tested once,
on a fake GPU runtime, in tests/test_gpu_backend.py. The kernels themselves run only on a
GPU (``gpu_checks.py``, the conformance kit).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
import vt.gpu.modules as gpu_modules
import vt_cuda
import vt_cuda.adapter as adapter
from fake_cuda import H200, CUresult, FakeDriver, FakeNvrtc
from vt.gpu import GpuBackend
from vt.gpu.modules import MODULE_GROUPS, WEIGHT_GROUPS
from vt.management import rules
from vt.protocol.mixins import derive_capabilities
from vt.testing.kernels_suite import weight_tensor
from vt_cuda.adapter import CudaError, CudaRuntime
from vt_cuda.backend import CudaBackend
from vt_cuda.caps import ATTRIBUTES, DeviceProfile, capabilities_from_device

INSTALL = "pip install 'vt-cuda[cu13]', or 'vt-cuda[cu12]' for a CUDA 12 driver"
JETSON = H200.model_copy(
    update={
        "name": "Orin",
        "integrated": True,
        "concurrent_managed_access": False,
        "compute_capability_minor": 7,
        "compute_capability_major": 8,
    }
)
SPARK = JETSON.model_copy(update={"concurrent_managed_access": True})


def make(profile: DeviceProfile = H200) -> tuple[CudaBackend, FakeDriver, FakeNvrtc]:
    driver, nvrtc = FakeDriver(profile), FakeNvrtc()
    backend = CudaBackend(CudaRuntime(driver, nvrtc, platform=profile.platform))
    # What the registry does with the probe's declaration (the fake device's, not this
    # machine's: CudaBackend.probe() would look for a real one).
    backend.capabilities = derive_capabilities(CudaBackend, capabilities_from_device(profile))
    driver.calls.clear()
    return backend, driver, nvrtc


@pytest.fixture(autouse=True)
def _fresh_cubin_cache() -> None:
    CudaRuntime.binaries.clear()


# --------------------------------------------------------------------------- availability


def test_probe_in_this_environment_says_why_it_is_unavailable() -> None:
    probe = CudaBackend.probe()
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        assert not probe.available
        assert probe.reason == f"cuda-python is not installed ({INSTALL})"
    elif not probe.available:  # cuda-python without a driver, a GPU or NVRTC: says which
        assert probe.reason.startswith(
            ("the CUDA driver could not be loaded", "cuInit", "no CUDA device", "NVRTC")
        ), probe.reason
    else:  # an NVIDIA machine
        assert probe.capabilities is not None and probe.device


def test_probe_without_cuda_python_says_to_install_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cuda", None)  # makes `from cuda.bindings import` fail
    probe = CudaBackend.probe()
    assert not probe.available
    assert probe.reason == f"cuda-python is not installed ({INSTALL})"
    with pytest.raises(vt.BackendUnavailableError, match=r"pip install 'vt-cuda\[cu13\]'"):
        CudaBackend()


def test_broken_cuda_python_install_is_reported_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> Any:
        raise ImportError("undefined symbol: cuGetProcAddress_v2")

    monkeypatch.setattr(adapter, "import_cuda", broken)
    import vt_cuda.backend as backend_module

    monkeypatch.setattr(backend_module, "import_cuda", broken)
    probe = CudaBackend.probe()
    assert not probe.available
    assert "cuda-python failed to import (undefined symbol: cuGetProcAddress_v2)" in probe.reason


def test_missing_driver_library_is_unavailable_not_broken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class NoDriver(FakeDriver):
        def cuInit(self, flags: int) -> Any:  # noqa: N802
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found ...')

    probe = CudaBackend.probe_modules(NoDriver(), FakeNvrtc())
    assert not probe.available
    reason = 'the CUDA driver could not be loaded: "cuda" is an NVIDIA driver library'
    assert probe.reason.startswith(reason)
    # Creating the backend anyway fails at once with the same reason, never a crash later.
    monkeypatch.setattr(adapter, "import_cuda", lambda: (NoDriver(), FakeNvrtc()))
    with pytest.raises(
        vt.BackendUnavailableError, match=f"backend 'cuda' is unavailable: {reason}"
    ):
        CudaBackend()


def test_no_device_is_unavailable_naming_the_call() -> None:
    driver = FakeDriver()
    driver.fail["cuInit"] = CUresult.CUDA_ERROR_NO_DEVICE
    probe = CudaBackend.probe_modules(driver, FakeNvrtc())
    assert not probe.available
    assert (
        probe.reason == "cuInit(0) failed: CUDA_ERROR_NO_DEVICE (100): fake: CUDA_ERROR_NO_DEVICE"
    )


def test_zero_devices_is_unavailable() -> None:
    probe = CudaBackend.probe_modules(FakeDriver(device_count=0), FakeNvrtc())
    assert not probe.available and probe.reason == "no CUDA device found"


def test_missing_nvrtc_is_unavailable_with_the_install_hint() -> None:
    class NoNvrtc(FakeNvrtc):
        def nvrtcVersion(self) -> Any:  # noqa: N802
            raise RuntimeError('Failure finding "libnvrtc.so.13"')

    probe = CudaBackend.probe_modules(FakeDriver(), NoNvrtc())
    assert not probe.available
    assert (
        probe.reason == f'NVRTC could not be loaded: Failure finding "libnvrtc.so.13" ({INSTALL})'
    )


def test_importing_the_plugin_does_not_import_cuda() -> None:
    code = "import sys, vt_cuda.plugin; assert 'cuda' not in sys.modules, 'cuda imported'"
    plugin_dir = str(Path(vt_cuda.__file__).resolve().parents[1])  # works uninstalled too
    path = os.pathsep.join(p for p in (plugin_dir, os.environ.get("PYTHONPATH")) if p)
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, env={**os.environ, "PYTHONPATH": path}
    )


def test_probe_reads_the_profile_without_creating_a_context() -> None:
    driver = FakeDriver()
    probe = CudaBackend.probe_modules(driver, FakeNvrtc(), platform="linux")
    assert probe.available, probe.reason
    assert probe.capabilities == capabilities_from_device(H200)
    assert probe.device == "NVIDIA H200 (sm_90, linux)"
    assert probe.details["device_count"] == 1 and probe.details["nvrtc_version"] == "13.0"
    assert (
        DeviceProfile.model_validate(
            {k: v for k, v in probe.details.items() if k in DeviceProfile.model_fields}
        )
        == H200
    )
    assert "cuDevicePrimaryCtxRetain" not in driver.names()
    assert rules.check(CudaBackend, derive_capabilities(CudaBackend, probe.capabilities)) == []


def test_device_profile_reads_each_attribute_and_the_granularity() -> None:
    driver = FakeDriver(H200)
    runtime = CudaRuntime(driver, FakeNvrtc(), platform="win32")
    assert runtime.profile == H200.model_copy(update={"platform": "windows"})
    queried = {args[0].name for args in driver.args("cuDeviceGetAttribute")}
    assert queried == {f"CU_DEVICE_ATTRIBUTE_{a}" for a in ATTRIBUTES.values()}
    ((prop, option),) = driver.args("cuMemGetAllocationGranularity")
    assert option.name == "CU_MEM_ALLOC_GRANULARITY_MINIMUM"
    assert prop.type.name == "CU_MEM_ALLOCATION_TYPE_PINNED"
    assert (prop.location.type.name, prop.location.id) == ("CU_MEM_LOCATION_TYPE_DEVICE", 0)
    assert driver.names()[:2] == ["cuInit", "cuDeviceGetCount"]
    assert driver.names()[-2:] == ["cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]


def test_device_without_vmm_skips_the_granularity_query() -> None:
    driver = FakeDriver(H200.model_copy(update={"vmm_supported": False, "vmm_granularity": 0}))
    runtime = CudaRuntime(driver, FakeNvrtc())
    assert not runtime.profile.vmm_supported and runtime.profile.vmm_granularity == 0
    assert "cuMemGetAllocationGranularity" not in driver.names()


def test_a_missing_device_ordinal_is_named() -> None:
    with pytest.raises(adapter.NoDeviceError, match=r"CUDA device 1 does not exist \(1 found\)"):
        CudaRuntime(FakeDriver(), FakeNvrtc(), device=1)


def test_it_is_the_shared_gpu_backend_with_every_primitive_op() -> None:
    assert issubclass(CudaBackend, GpuBackend)
    assert CudaBackend.op_names() == tuple(vt.OPS)  # fused ops included


@pytest.mark.parametrize(("major", "minor", "mma"), [(9, 0, True), (8, 0, True), (8, 6, True),
                                                    (7, 5, False), (7, 0, False)])  # fmt: skip
def test_int8_steps_take_the_tensor_cores_from_sm_80(major: int, minor: int, mma: bool) -> None:
    """The adapter's arch string ("sm_90") is what GpuBackend.int8_mma reads by default:
    mma.sync with s8 inputs needs sm_80 (Ampere) or later; older parts take dp4a."""
    profile = H200.model_copy(
        update={"compute_capability_major": major, "compute_capability_minor": minor}
    )
    backend, _, _ = make(profile)
    assert backend._rt.arch() == f"sm_{major}{minor}"
    assert bool(backend._mma_tiles(8)) is mma and backend._mma_tiles(9) == (2 if mma else 0)


def test_the_blas_path_keeps_weight_copies_within_an_eighth_of_the_device_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On by default on cuda (GpuBackend's default is 0, none kept), the budget read from
    cuDeviceTotalMem; bench_variant.py's --blas-keep sets CudaBackend's too."""
    backend, _, _ = make(H200)
    assert GpuBackend.blas_keep_fraction == 0.0
    assert backend.blas_keep_fraction == 0.125 and backend.device_memory() == H200.total_memory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_variant  # noqa: PLC0415

    for cls in (GpuBackend, CudaBackend):
        monkeypatch.setattr(cls, "blas_keep_fraction", cls.blas_keep_fraction)  # restored
    assert bench_variant.apply(["--blas-keep", "0", "bench"]) == ["bench"]
    assert backend.blas_keep_fraction == 0.0 and GpuBackend.blas_keep_fraction == 0.0
    backend.close()


def test_bench_variant_takes_the_x16_layout_flags_in_hex(monkeypatch) -> None:
    """bench_variant.py --gemv-x16-flags 0x100 sets GpuBackend.gemv_x16_layout_flags; a
    value that is not a number, or none, is refused by name."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_variant  # noqa: PLC0415

    for name in ("gemv_x16_min_rows", "gemv_x16_layout_flags"):
        monkeypatch.setattr(GpuBackend, name, getattr(GpuBackend, name))  # restored
    args = ["--gemv-x16", "2", "--gemv-x16-flags", "0x100", "bench"]
    assert bench_variant.apply(args) == ["bench"]
    assert (GpuBackend.gemv_x16_min_rows, GpuBackend.gemv_x16_layout_flags) == (2, 0x100)
    with pytest.raises(SystemExit, match=r"--gemv-x16-flags takes flags \(0x100\), not nib"):
        bench_variant.apply(["--gemv-x16-flags", "nib", "bench"])
    with pytest.raises(SystemExit, match="--gemv-x16-flags needs a value"):
        bench_variant.apply(["--gemv-x16-flags"])
    assert GpuBackend.gemv_x16_layout_flags == 0x100


def test_free_memory_is_cumemgetinfo() -> None:
    """What the BLAS path's kept copies look at before they are kept (GpuBackend's margin)."""
    backend, driver, _ = make(H200)
    assert backend.runtime.memory_info() == (H200.total_memory // 2, H200.total_memory)
    assert driver.names()[-1] == "cuMemGetInfo"
    driver.fail["cuMemGetInfo"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match=r"cuMemGetInfo\(\) failed: CUDA_ERROR_INVALID_VALUE"):
        backend.runtime.memory_info()
    backend.close()


# --------------------------------------------------------------------------- memory


def test_alloc_uses_cumemalloc_on_a_discrete_device() -> None:
    backend, driver, _ = make(H200)
    buf = backend.alloc(1024)
    backend.free(buf)
    assert driver.calls == [("cuMemAlloc", (1024,)), ("cuMemFree", (buf.handle,))]
    assert buf.nbytes == 1024 and buf.owner == "cuda"


def test_alloc_of_zero_bytes_gets_an_address() -> None:
    backend, driver, _ = make(H200)
    buf = backend.alloc(0)
    assert driver.calls == [("cuMemAlloc", (1,))] and buf.nbytes == 0


@pytest.mark.parametrize(("profile", "managed"), [(JETSON, False), (SPARK, True)])
def test_managed_allocation_only_with_concurrent_access(
    profile: DeviceProfile, managed: bool
) -> None:
    backend, driver, _ = make(profile)
    backend.alloc(4096)
    if managed:
        assert driver.calls == [("cuMemAllocManaged", (4096, 1))]
    else:
        assert driver.calls == [("cuMemAlloc", (4096,))]
    assert backend.capabilities.device_memory_is_host_addressable is managed


def test_host_view_raises_on_a_discrete_device_and_views_managed_memory() -> None:
    backend, _, _ = make(H200)
    with pytest.raises(vt.HostAccessError, match="not host-addressable"):
        backend.host_view(backend.alloc(16))
    spark, _, _ = make(SPARK)
    buf = spark.alloc(16)
    spark.host_view(buf.view(4, 8))[:] = 9
    out = np.empty(16, np.uint8)
    spark.copy_d2h(out, buf)
    assert out.tolist() == [0] * 4 + [9] * 8 + [0] * 4


def test_copies_move_bytes_and_honour_offsets() -> None:
    backend, driver, _ = make()
    buf = backend.alloc(64)
    backend.memset(buf, 7)
    backend.copy_h2d(buf.view(16, 8), np.arange(8, dtype=np.uint8))
    out = np.empty(64, dtype=np.uint8)
    backend.copy_d2h(out, buf)
    expected = np.full(64, 7, dtype=np.uint8)
    expected[16:24] = np.arange(8)
    np.testing.assert_array_equal(out, expected)
    (h2d,) = driver.args("cuMemcpyHtoD")
    (d2h,) = driver.args("cuMemcpyDtoH")
    assert h2d[0] == buf.handle + 16 and h2d[2] == 8
    assert d2h[1] == buf.handle and d2h[2] == 64
    assert driver.args("cuMemsetD8") == [(buf.handle, 7, 64)]


def test_async_copies_and_memset_run_on_the_stream() -> None:
    backend, driver, _ = make()
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
    assert driver.args("cuMemsetD8Async") == [(b.handle, 0, 32, stream.handle)]
    assert [args[-1] for args in driver.args("cuMemcpyHtoDAsync")] == [stream.handle]
    assert driver.args("cuMemcpyDtoDAsync") == [(b.handle, a.handle, 32, stream.handle)]
    assert [args[-1] for args in driver.args("cuMemcpyDtoHAsync")] == [stream.handle]
    assert driver.args("cuStreamCreate") == [(1,)]  # CU_STREAM_NON_BLOCKING


def test_pinned_memory_is_a_view_of_cumemhostalloc() -> None:
    backend, driver, _ = make()
    host = backend.alloc_pinned(16)
    assert host.pinned and host.nbytes == 16 and host.array.dtype == np.uint8
    assert driver.calls == [("cuMemHostAlloc", (16, 0))]
    assert host.array.ctypes.data == host.handle  # no copy: the array IS the pinned memory
    handle = host.handle
    backend.free_pinned(host)
    backend.free_pinned(host)  # a second free is a no-op, not a double free
    assert driver.args("cuMemFreeHost") == [(handle,)]


def test_a_failing_call_raises_a_clear_error() -> None:
    backend, driver, _ = make()
    driver.fail["cuMemAlloc"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as info:
        backend.alloc(1 << 40)
    assert str(info.value) == (
        "cuMemAlloc(1099511627776) failed: CUDA_ERROR_OUT_OF_MEMORY (2): "
        "fake: CUDA_ERROR_OUT_OF_MEMORY"
    )
    assert isinstance(info.value, vt.VtError) and isinstance(info.value, RuntimeError)
    assert info.value.code == 2 and info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY"


def test_unknown_error_code_is_still_named() -> None:
    backend, driver, _ = make()
    driver.fail["cuStreamCreate"] = 4242  # type: ignore[assignment]
    with pytest.raises(CudaError, match=r"cuStreamCreate\(1\) failed: CUresult 4242 \(4242\)"):
        backend.create_stream()


# --------------------------------------------------------------------------- streams, events


def test_stream_and_event_calls() -> None:
    backend, driver, _ = make()
    stream = backend.create_stream("copy")
    event = backend.create_event()
    backend.record_event(event, stream)
    driver.query_results = [CUresult.CUDA_ERROR_NOT_READY, CUresult.CUDA_SUCCESS]
    assert backend.query_event(event) is False
    assert backend.query_event(event) is True
    backend.synchronize_event(event)
    backend.stream_wait_event(stream, event)
    backend.synchronize(stream)
    backend.destroy_event(event)
    backend.destroy_stream(stream)
    assert [(n, a) for n, a in driver.calls] == [
        ("cuStreamCreate", (1,)),
        ("cuEventCreate", (2,)),  # CU_EVENT_DISABLE_TIMING
        ("cuEventRecord", (event.handle, stream.handle)),
        ("cuEventQuery", (event.handle,)),
        ("cuEventQuery", (event.handle,)),
        ("cuEventSynchronize", (event.handle,)),
        ("cuStreamWaitEvent", (stream.handle, event.handle, 0)),
        ("cuStreamSynchronize", (stream.handle,)),
        ("cuEventDestroy", (event.handle,)),
        ("cuStreamDestroy", (stream.handle,)),
    ]


def test_event_query_error_other_than_not_ready_raises() -> None:
    backend, driver, _ = make()
    event = backend.create_event()
    driver.fail["cuEventQuery"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaError, match="cuEventQuery.*CUDA_ERROR_INVALID_VALUE"):
        backend.query_event(event)


def test_each_thread_makes_the_primary_context_current_once() -> None:
    backend, driver, _ = make()

    def work() -> None:
        backend.alloc(8)
        backend.alloc(8)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert driver.names() == ["cuCtxSetCurrent", "cuMemAlloc", "cuMemAlloc"]
    assert driver.args("cuCtxSetCurrent") == [("ctx",)]


def test_close_releases_the_primary_context_once() -> None:
    backend, driver, _ = make()
    backend.close()
    backend.close()
    assert driver.names() == ["cuDevicePrimaryCtxRelease"]


# --------------------------------------------------------------------------- VMM


def test_vmm_call_sequence() -> None:
    backend, driver, _ = make()
    g = backend.vmm_granularity()
    vrange = backend.vmm_reserve(4 * g)
    base = vrange.handle.base
    first = backend.vmm_map(vrange, 0, g)
    second = backend.vmm_map(vrange, g, 2 * g)
    backend.vmm_unmap(vrange, second)
    backend.vmm_unmap(vrange, first)
    backend.vmm_release(vrange)
    assert g == 2 << 20
    assert driver.names() == [
        "cuMemAddressReserve",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemUnmap",
        "cuMemRelease",
        "cuMemUnmap",
        "cuMemRelease",
        "cuMemAddressFree",
    ]
    assert driver.args("cuMemAddressReserve") == [(4 * g, 0, 0, 0)]
    assert driver.args("cuMemMap") == [
        (base, g, 0, first.handle, 0),
        (base + g, 2 * g, 0, second.handle, 0),
    ]
    access = driver.args("cuMemSetAccess")
    assert [(ptr, n, count) for ptr, n, _, count in access] == [(base, g, 1), (base, 3 * g, 1)]
    (desc,) = access[0][2]
    assert desc.flags.name == "CU_MEM_ACCESS_FLAGS_PROT_READWRITE"
    assert (desc.location.type.name, desc.location.id) == ("CU_MEM_LOCATION_TYPE_DEVICE", 0)
    assert driver.args("cuMemAddressFree") == [(base, 4 * g)]


def test_vmm_on_a_device_without_it_names_the_attribute() -> None:
    backend, driver, _ = make(H200.model_copy(update={"vmm_supported": False}))
    assert backend.capabilities.vmm is None
    with pytest.raises(vt.VmmError, match="VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=0"):
        backend.vmm_reserve(2 << 20)
    assert driver.calls == []


# --------------------------------------------------------------------------- kernels

#: prepare()'s modules: every group's of every layout, in order
EVERY = [f"vt_{group}.cu".encode() for group in MODULE_GROUPS]
N = len(EVERY)


def test_kernels_compile_once_per_process_with_the_device_target() -> None:
    backend, driver, nvrtc = make()
    backend.prepare()
    backend.prepare()
    programs = [a[0] for n, a in nvrtc.calls if n == "nvrtcCreateProgram"]
    assert programs == EVERY
    compiles = [a[1] for n, a in nvrtc.calls if n == "nvrtcCompileProgram"]
    opts = (b"--gpu-architecture=sm_90", b"-DVT_WARP=32", b"-DVT_NORM_LATE=1")
    # the int8 group's module adds its own option (GpuBackend.mma_stage)
    assert compiles == [(*opts, b"-DVT_MMA_STAGE=1") if p == b"vt_int8.cu" else opts
                        for p in EVERY]  # fmt: skip
    assert driver.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N
    other, driver2, nvrtc2 = make()
    other.prepare()  # a second backend loads the cached cubins: no second compile
    assert not [n for n, _ in nvrtc2.calls if n == "nvrtcCompileProgram"]
    assert driver2.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N


def _compiles(nvrtc: FakeNvrtc) -> int:
    return sum(1 for n, _ in nvrtc.calls if n == "nvrtcCompileProgram")


def test_a_later_process_loads_the_kernels_from_vt_home(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vt.gpu.kernel_cache: the first process compiles and keeps the cubin in
    VT_HOME/kernels, saying so on stderr; the next (the per-process cache empty) loads it,
    no compile, quietly; another NVRTC version compiles again; VT_KERNEL_CACHE=0 always
    compiles and keeps nothing."""
    backend, _, nvrtc = make()
    backend.prepare()
    assert _compiles(nvrtc) == N  # each group's module of every layout
    kept = sorted((Path(os.environ["VT_HOME"]) / "kernels").glob("cuda-*.bin"))
    assert len(kept) == N and {k.read_bytes() for k in kept} == {b"FAKECUBN"}
    folder = kept[0].parent
    lines = capsys.readouterr().err.splitlines()[-2 * N :]  # prepare(): one after another
    for at, name in enumerate(EVERY):
        why = f"first run only; kept in {folder}"
        assert lines[2 * at] == f"vt: compiling cuda kernels {name.decode()} ({why})..."
        assert lines[2 * at + 1].startswith(f"vt: cuda kernels {name.decode()} ready in ")
    CudaRuntime.binaries.clear()  # a new process
    later, driver, nvrtc = make()
    later.prepare()
    assert _compiles(nvrtc) == 0 and driver.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N
    assert "vt: compiling" not in capsys.readouterr().err
    CudaRuntime.binaries.clear()
    upgraded, _, nvrtc = make()
    nvrtc.version = (13, 1)
    upgraded.prepare()
    assert _compiles(nvrtc) == N
    assert len(list(folder.glob("cuda-*.bin"))) == 2 * N
    monkeypatch.setenv("VT_KERNEL_CACHE", "0")
    for _ in range(2):
        CudaRuntime.binaries.clear()
        off, _, nvrtc = make()
        off.prepare()
        assert _compiles(nvrtc) == N
    assert len(list(folder.glob("cuda-*.bin"))) == 2 * N


def _one_kept_cubin_damaged() -> tuple[list[Path], CudaBackend, FakeDriver, FakeNvrtc]:
    """The modules' cubins a first process kept, one of them overwritten with bytes
    the driver refuses, and a new process's backend."""
    make()[0].prepare()
    kept = sorted((Path(os.environ["VT_HOME"]) / "kernels").glob("cuda-*.bin"))
    kept[0].write_bytes(b"damaged")
    CudaRuntime.binaries.clear()  # a new process
    later, driver, nvrtc = make()
    load = driver.cuModuleLoadData

    def refuse_damaged(binary: bytes) -> Any:
        if binary == b"damaged":
            return (CUresult.CUDA_ERROR_INVALID_IMAGE, None)
        return load(binary)

    driver.cuModuleLoadData = refuse_damaged  # type: ignore[attr-defined]
    return kept, later, driver, nvrtc


def test_a_cached_kernel_the_driver_refuses_is_compiled_again() -> None:
    kept, later, driver, nvrtc = _one_kept_cubin_damaged()
    later.prepare()
    assert _compiles(nvrtc) == 1  # the damaged module's alone
    assert driver.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N
    assert {k.read_bytes() for k in kept} == {b"FAKECUBN"}  # replaced


def test_an_unwritable_vt_home_still_compiles_and_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "home").write_text("a file where the directory would go")
    monkeypatch.setenv("VT_HOME", str(tmp_path / "home"))
    for _ in range(2):
        CudaRuntime.binaries.clear()
        backend, driver, nvrtc = make()
        backend.prepare()
        assert _compiles(nvrtc) == N
        assert driver.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N


def _threads_of(backend: CudaBackend, driver: FakeDriver, nvrtc: FakeNvrtc, meet: int = 0) -> dict:
    """The threads nvrtc compiled on and the driver loaded modules on; the first ``meet``
    compiles wait for each other (a BrokenBarrierError unless they run at once)."""
    seen: dict[str, list[str]] = {"compiled": [], "loaded": []}
    barrier = threading.Barrier(max(meet, 1), timeout=10)
    compile_, load = nvrtc.nvrtcCompileProgram, driver.cuModuleLoadData

    def compile_on(*args: Any) -> Any:
        seen["compiled"].append(threading.current_thread().name)
        if len(seen["compiled"]) <= meet:
            barrier.wait()
        return compile_(*args)

    def load_on(*args: Any) -> Any:
        seen["loaded"].append(threading.current_thread().name)
        return load(*args)

    nvrtc.nvrtcCompileProgram = compile_on  # type: ignore[method-assign]
    driver.cuModuleLoadData = load_on  # type: ignore[attr-defined]
    return seen


def _upload_three(backend: CudaBackend) -> None:
    """Weights of two layouts (Q4_1 twice): the weights' groups' modules of each layout
    beside every group's of every layout."""
    values = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    for name, wtype in (("a", "Q4_1"), ("b", "Q8_0"), ("c", "Q4_1")):
        backend.upload_weight(weight_tensor(name, values, wtype)[0])


def test_a_models_modules_build_at_once_on_helper_threads_and_load_where_launched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A machine's first run built the module of every kernel (26 s on an H100's machine),
    then one a weight layout (13 s each), one after another: now nvrtc builds every group's
    module of every layout and the weights' groups' of each layout on helper threads while
    the weights upload (two at once here), and the modules load on the launching thread,
    none while uploading."""
    monkeypatch.setattr("vt.gpu.modules.os.cpu_count", lambda: 4)
    backend, driver, nvrtc = make()
    seen = _threads_of(backend, driver, nvrtc, meet=2)
    _upload_three(backend)
    assert seen["loaded"] == []
    # a setting changed after the uploads leaves their modules as they were started (as
    # when they compiled at upload): loaded, not compiled again
    backend.norm_late, backend.norm_fold_max_k = False, 0  # type: ignore[attr-defined]
    backend.prepare()
    own = {f"vt_{g}_q{layout}.cu".encode() for g in WEIGHT_GROUPS for layout in ("500", "c00")}
    assert len(seen["compiled"]) == N + len(own)
    assert all(t.startswith("vt-kernels") for t in seen["compiled"]), seen
    assert seen["loaded"] == [threading.current_thread().name] * (N + len(own))
    names = {a[0] for n, a in nvrtc.calls if n == "nvrtcCreateProgram"}
    assert names == set(EVERY) | own
    backend.prepare()  # loaded once
    assert len(seen["loaded"]) == N + len(own)
    backend.close()


def test_a_first_launch_before_any_upload_starts_every_kernel_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A verification probe's launch comes before any upload: its module's first need
    starts every group's module of every layout on helper threads (they build at once, as
    at upload), and loads only its own; which group holds a kernel is asked once a name."""
    monkeypatch.setattr("vt.gpu.modules.os.cpu_count", lambda: 4)
    backend, driver, nvrtc = make()
    seen = _threads_of(backend, driver, nvrtc, meet=2)
    asked: list[str] = []
    route = gpu_modules.group_of
    monkeypatch.setattr(gpu_modules, "group_of", lambda n: asked.append(n) or route(n))
    stream = backend.create_stream("decode")
    a = vt.Tensor.of(backend.alloc(64), np.float32, 1, 16)
    for _ in range(3):
        backend.launch("add", stream, out=a, a=a, b=a)
    backend.synchronize(stream)
    # the launch waited for its own module only: with fewer helper threads than modules the
    # last builds may not have begun yet (a failure once in session 32's full suite, once in 33's)
    deadline = time.monotonic() + 10
    while len(seen["compiled"]) < N and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(seen["compiled"]) == N
    assert all(t.startswith("vt-kernels") for t in seen["compiled"]), seen
    assert seen["loaded"] == [threading.current_thread().name]  # the attention group's alone
    assert asked == ["add"]
    backend.prepare()  # the others were built meanwhile: loaded, not compiled again
    assert len(seen["compiled"]) == N and len(seen["loaded"]) == N
    backend.close()


def test_modules_still_building_load_before_a_graph_capture_begins() -> None:
    """A module load inside a stream capture could break it: begin_capture first waits for
    the helper threads and loads their modules."""
    backend, driver, nvrtc = make()
    _upload_three(backend)
    stream = backend.create_stream("decode")
    backend.begin_capture(stream)
    names = driver.names()
    assert names.count("cuModuleLoadData") == N + 2 * len(WEIGHT_GROUPS)
    loads = [i for i, n in enumerate(names) if n == "cuModuleLoadData"]
    assert max(loads) < names.index("cuStreamBeginCapture")
    backend.end_capture(stream)
    backend.close()


def test_parallel_compile_off_compiles_each_module_at_its_first_upload() -> None:
    backend, driver, nvrtc = make()
    backend.parallel_compile = False  # type: ignore[attr-defined]
    seen = _threads_of(backend, driver, nvrtc)
    _upload_three(backend)
    main = threading.current_thread().name
    modules = N + 2 * len(WEIGHT_GROUPS)
    assert seen == {"compiled": [main] * modules, "loaded": [main] * modules}
    backend.close()


def test_a_helper_threads_compile_error_is_raised_where_its_module_is_needed() -> None:
    """The upload goes on; prepare (or the first launch) raises nvrtc's error with its
    log, and closing the backend after it raises nothing."""
    backend, _, nvrtc = make()
    nvrtc.compile_error = 'kernels.cu(7): error: identifier "x" is undefined'
    _upload_three(backend)
    with pytest.raises(CudaError, match='identifier "x" is undefined'):
        backend.prepare()
    backend.close()


def test_a_damaged_cached_kernel_read_by_a_helper_thread_is_compiled_again() -> None:
    kept, later, driver, nvrtc = _one_kept_cubin_damaged()
    later.upload_weight(weight_tensor("w", np.ones((4, 32), np.float32), "F32")[0])
    later.prepare()
    assert _compiles(nvrtc) == 1
    assert driver.args("cuModuleLoadData") == [(b"FAKECUBN",)] * N  # the damaged one refused
    assert {k.read_bytes() for k in kept} == {b"FAKECUBN"}
    later.close()


def test_a_compile_error_carries_the_compiler_log() -> None:
    backend, _, nvrtc = make()
    nvrtc.compile_error = 'kernels.cu(7): error: identifier "x" is undefined'
    with pytest.raises(CudaError) as info:
        backend.prepare()
    message = str(info.value)
    assert message.startswith("nvrtcCompileProgram('vt_rows.cu', --gpu-architecture=sm_90")
    assert "NVRTC_ERROR_COMPILATION (6)" in message
    assert 'identifier "x" is undefined' in message
    assert nvrtc.calls[-1][0] == "nvrtcDestroyProgram"  # the program is freed on failure


def test_launch_passes_a_pointer_array_to_each_argument() -> None:
    runtime = CudaRuntime(FakeDriver(), FakeNvrtc())
    seen: list[tuple[int, float, int]] = []

    def launch(f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
               stream: Any, params: int, extra: Any) -> tuple[CUresult]:  # fmt: skip
        ptrs = (ctypes.c_void_p * 3).from_address(params)
        seen.append(
            (
                ctypes.c_int32.from_address(ptrs[0]).value,
                ctypes.c_float.from_address(ptrs[1]).value,
                ctypes.c_void_p.from_address(ptrs[2]).value,
            )
        )
        assert (gx, gy, gz, bx, by, bz, smem, stream, extra) == (3, 2, 1, 256, 1, 1, 0, "s", 0)
        return (CUresult.CUDA_SUCCESS,)

    runtime.cu.cuLaunchKernel = launch  # type: ignore[attr-defined]
    args = [ctypes.c_int32(7), ctypes.c_float(2.5), ctypes.c_void_p(0xABC0)]
    runtime.launch("fn", (3, 2, 1), (256, 1, 1), 0, "s", args)
    assert seen == [(7, 2.5, 0xABC0)]


def test_a_failed_launch_raises_naming_the_call_and_the_error() -> None:
    runtime = CudaRuntime(FakeDriver(), FakeNvrtc())
    runtime.cu.cuLaunchKernel = lambda *a: (CUresult.CUDA_ERROR_INVALID_VALUE,)  # type: ignore[attr-defined]
    with pytest.raises(CudaError, match=r"cuLaunchKernel\('fn', 3, 2, 1, 256.*INVALID_VALUE"):
        runtime.launch("fn", (3, 2, 1), (256, 1, 1), 0, "s", [ctypes.c_int32(7)])


def test_an_overlapped_launch_is_a_programmatic_dependent_launch_on_sm_90() -> None:
    driver = FakeDriver()
    runtime = CudaRuntime(driver, FakeNvrtc())
    args = [ctypes.c_int32(7), ctypes.c_float(2.5)]
    runtime.launch_overlapped("fn", (3, 2, 1), (128, 1, 1), 0, "s", args)
    runtime.launch_overlapped("fn", (3, 2, 1), (128, 1, 1), 0, "s2", args)
    first, second = driver.launches
    assert (first["grid"], first["block"], first["stream"]) == ((3, 2, 1), (128, 1, 1), "s")
    assert first["attrs"] == [(6, 1)]  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert second["stream"] == "s2" and driver.names().count("cuLaunchKernelEx") == 2
    first_config, second_config = (args[0] for args in driver.args("cuLaunchKernelEx"))
    assert first_config is second_config  # one launch configuration per grid and block
    seen: list[Any] = []
    other = threading.Thread(
        target=lambda: (
            runtime.launch_overlapped("fn", (3, 2, 1), (128, 1, 1), 0, "s3", args),
            seen.append(driver.args("cuLaunchKernelEx")[-1][0]),
        )
    )
    other.start()
    other.join()
    assert seen[0] is not first_config  # another thread's launches never share its stream
    assert runtime.overlap_reason == "programmatic dependent launch (cuLaunchKernelEx)"
    driver.fail["cuLaunchKernelEx"] = CUresult.CUDA_ERROR_INVALID_VALUE
    call = r"cuLaunchKernelEx\('fn', 3, 2, 1, 128, 1, 1, 0, 's'\)"
    with pytest.raises(CudaError, match=call + ".*INVALID_VALUE"):
        runtime.launch_overlapped("fn", (3, 2, 1), (128, 1, 1), 0, "s", args)


@pytest.mark.parametrize("lack", ["sm_80", "binding"])
def test_an_overlapped_launch_is_a_plain_one_without_sm_90_or_the_binding(lack: str) -> None:
    profile = H200.model_copy(update={"compute_capability_major": 8})
    driver = FakeDriver(profile if lack == "sm_80" else H200)
    if lack == "binding":
        type(driver).CUlaunchConfig = None  # type: ignore[assignment]
        del type(driver).CUlaunchConfig
    try:
        runtime = CudaRuntime(driver, FakeNvrtc())
        runtime.launch_overlapped("fn", (1, 1, 1), (64, 1, 1), 0, "s", [ctypes.c_int32(1)])
    finally:
        if lack == "binding":
            import fake_cuda

            type(driver).CUlaunchConfig = fake_cuda.CUlaunchConfig  # type: ignore[attr-defined]
    assert "cuLaunchKernelEx" not in driver.names() and driver.names().count("cuLaunchKernel") == 1
    assert "attrs" not in driver.launches[0]
    want = "compute capability 8.x" if lack == "sm_80" else "cuda-python lacks CUlaunchConfig"
    assert runtime.overlap_reason.startswith(want)


def test_the_device_checks_collect_without_a_gpu() -> None:
    """gpu_checks.py runs only on a GPU, where a collection error costs a device call:
    pytest must collect all of it here (run 52 found one that had slipped through)."""
    here = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", str(here / "gpu_checks.py")],
        capture_output=True, text=True, cwd=here, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.lower().splitlines()[-1], done.stdout[-2000:]
