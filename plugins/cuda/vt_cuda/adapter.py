"""vt.gpu's runtime adapter over cuda-python: the CUDA driver API and NVRTC.

cuda-python functions return a tuple ``(CUresult, *outputs)``. :meth:`CudaRuntime.call`
checks the error and returns the outputs, so the adapter reads like the C API without the
error plumbing. The ``driver`` and ``nvrtc`` modules are injected, so tests drive this code
with fakes.

Everything runs in the device's primary context (what the CUDA runtime and PyTorch use),
made current on each thread that calls in: the engine may call from more than one thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

from vt import VmmError
from vt.gpu import Binaries, GpuCallError, GpuRuntime, host_array, kernel_params
from vt.gpu.kernel_cache import Key

from .blas import INSTALL_HINT as BLAS_HINT
from .blas import PRECISION as BLAS_PRECISION
from .blas import Cublas, import_cublas, import_cublaslt
from .caps import ATTRIBUTES, DeviceProfile, use_managed_alloc

INSTALL_HINT = "pip install 'vt-cuda[cu13]', or 'vt-cuda[cu12]' for a CUDA 12 driver"


class CudaError(GpuCallError):
    """A CUDA driver or NVRTC call failed; names the call and CUDA's error name and string."""


class NoDeviceError(RuntimeError):
    """The driver works but has no device of the asked-for ordinal."""


def import_cuda() -> tuple[ModuleType, ModuleType]:
    """cuda-python's ``driver`` and ``nvrtc`` modules (ImportError when not installed)."""
    from cuda.bindings import driver, nvrtc

    return driver, nvrtc


def _fmt(arg: Any) -> str:
    # Keep messages short: plain values verbatim, handles and structs by type.
    if arg is None or isinstance(arg, (bool, int, str)):
        return repr(arg) if isinstance(arg, str) else str(arg)
    if isinstance(arg, bytes):
        return repr(arg.decode(errors="replace")) if len(arg) <= 64 else f"<{len(arg)} bytes>"
    return type(arg).__name__


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


def host_platform(platform: str | None = None) -> str:
    """'windows' or 'linux' from ``sys.platform`` (CUDA runs on nothing else)."""
    platform = sys.platform if platform is None else platform
    return "windows" if platform in ("win32", "cygwin", "windows") else "linux"


class CudaRuntime(GpuRuntime):
    """Checked access to one CUDA device through its primary context."""

    vendor = "cuda"

    def __init__(
        self,
        driver: ModuleType | Any,
        nvrtc: ModuleType | Any,
        device: int = 0,
        platform: str | None = None,
        *,
        context: bool = True,
        cublas: Cublas | None = None,
    ) -> None:
        """``context=False`` reads the device profile only (a cheap probe: no context)."""
        self.cu = driver
        self.nvrtc = nvrtc
        self.device = device
        self._tls = threading.local()
        self._ctx: Any = None
        self._blas: Cublas | None | bool = cublas  # None: not looked for yet; False: absent
        self.blas_reason = ""
        # Overlapped launches: None until the first one; then True, or False with the reason.
        self._overlap: bool | None = None
        self.overlap_reason = ""
        self._success = driver.CUresult.CUDA_SUCCESS
        self.call("cuInit", 0)
        self.device_count = int(self.call("cuDeviceGetCount"))
        if device >= self.device_count:
            raise NoDeviceError(
                "no CUDA device found"
                if self.device_count == 0
                else f"CUDA device {device} does not exist ({self.device_count} found)"
            )
        self._dev = self.call("cuDeviceGet", device)
        self.profile: DeviceProfile = self.device_profile(platform)
        self._managed = use_managed_alloc(self.profile)
        if context:
            self._ctx = self.call("cuDevicePrimaryCtxRetain", self._dev)
            self._bind()

    def close(self) -> None:
        """Release the primary context this runtime retained (idempotent)."""
        if self._blas:
            blas, self._blas = self._blas, None
            blas.close()
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            self.cu.cuDevicePrimaryCtxRelease(self._dev)
            del ctx

    @classmethod
    def load(cls, device: int = 0, platform: str | None = None) -> CudaRuntime:
        driver, nvrtc = import_cuda()
        return cls(driver, nvrtc, device, platform)

    # ---- checked calls
    def error_name(self, code: int) -> str:
        try:
            return self.cu.CUresult(int(code)).name
        except ValueError:
            return f"CUresult {int(code)}"

    def error_string(self, code: int) -> str:
        try:
            result = self.cu.cuGetErrorString(code)
        except Exception:  # best effort: the error name already identifies the failure
            return "(no error string)"
        return _text(result[-1] if isinstance(result, tuple) else result)

    def _bind(self) -> None:
        """Make the primary context current on this thread (once per thread)."""
        if self._ctx is not None and not getattr(self._tls, "bound", False):
            self._tls.bound = True
            self.call("cuCtxSetCurrent", self._ctx)

    def call(self, name: str, *args: Any) -> Any:
        """Call ``driver.<name>(*args)``; raise :class:`CudaError` unless CUDA_SUCCESS.

        Returns None, the single output, or a tuple of outputs.
        """
        if self._ctx is not None and not getattr(self._tls, "bound", False):
            self._bind()
        result = getattr(self.cu, name)(*args)
        err, outputs = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != self._success:
            raise self._error(name, args, err)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def _error(self, name: str, args: Sequence[Any], err: Any) -> CudaError:
        call = f"{name}({', '.join(_fmt(a) for a in args)})"
        return CudaError(call, int(err), self.error_name(err), self.error_string(err))

    def ready(self, name: str, *args: Any) -> bool:
        """For query calls (cuEventQuery): True on success, False on CUDA_ERROR_NOT_READY."""
        self._bind()
        result = getattr(self.cu, name)(*args)
        err = result[0] if isinstance(result, tuple) else result
        if err == self.cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        if err != self.cu.CUresult.CUDA_SUCCESS:
            call = f"{name}({', '.join(_fmt(a) for a in args)})"
            raise CudaError(call, int(err), self.error_name(err), self.error_string(err))
        return True

    def rtc(self, name: str, *args: Any) -> Any:
        """Call ``nvrtc.<name>(*args)``, checked like :meth:`call`."""
        result = getattr(self.nvrtc, name)(*args)
        err, outputs = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != self.nvrtc.nvrtcResult.NVRTC_SUCCESS:
            call = f"{name}({', '.join(_fmt(a) for a in args)})"
            raise CudaError(call, int(err), _nvrtc_name(self.nvrtc, err), "nvrtc call failed")
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    # ---- device facts
    def attribute(self, name: str) -> int:
        """``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_<name>, device)``."""
        attr = getattr(self.cu.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
        return int(self.call("cuDeviceGetAttribute", attr, self._dev))

    def allocation_prop(self) -> Any:
        """Pinned device memory on this device, as cuMemCreate and the granularity query want."""
        prop = self.cu.CUmemAllocationProp()
        prop.type = self.cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        return prop

    def access_desc(self) -> Any:
        """Read-write access for this device, for cuMemSetAccess."""
        desc = self.cu.CUmemAccessDesc()
        desc.location.type = self.cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = self.cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def device_profile(self, platform: str | None = None) -> DeviceProfile:
        """Read the vendor facts :func:`~vt_cuda.caps.capabilities_from_device` needs."""
        values: dict[str, Any] = {field: self.attribute(attr) for field, attr in ATTRIBUTES.items()}
        granularity = 0
        if values["vmm_supported"]:
            minimum = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            granularity = int(
                self.call("cuMemGetAllocationGranularity", self.allocation_prop(), minimum)
            )
        return DeviceProfile(
            name=_text(self.call("cuDeviceGetName", 256, self._dev)),
            platform=host_platform(platform),  # type: ignore[arg-type]
            vmm_granularity=granularity,
            total_memory=int(self.call("cuDeviceTotalMem", self._dev)),
            driver_version=int(self.call("cuDriverGetVersion")),
            **{k: (bool(v) if k not in _INT_FIELDS else int(v)) for k, v in values.items()},
        )

    def device_name(self) -> str:
        return self.profile.name

    def arch(self) -> str:
        return self.profile.arch

    def warp_size(self) -> int:
        return self.profile.warp_size

    # ---- memory
    def malloc(self, nbytes: int) -> int:
        if self._managed:
            flags = self.cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL
            return int(self.call("cuMemAllocManaged", max(nbytes, 1), flags))
        # cuMemAlloc(0) is an error; a zero-byte buffer still needs a distinct address.
        return int(self.call("cuMemAlloc", max(nbytes, 1)))

    def free(self, ptr: int) -> None:
        self.call("cuMemFree", ptr)

    def memory_info(self) -> tuple[int, int]:
        """``cuMemGetInfo``: free and total bytes of the device (its context's view)."""
        free, total = self.call("cuMemGetInfo")
        return int(free), int(total)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self.call("cuMemsetD8", ptr, value, nbytes)
        else:
            self.call("cuMemsetD8Async", ptr, value, nbytes, stream)

    def memcpy_h2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self.call("cuMemcpyHtoD", dst, src, nbytes)
        else:
            self.call("cuMemcpyHtoDAsync", dst, src, nbytes, stream)

    def memcpy_d2h(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self.call("cuMemcpyDtoH", dst, src, nbytes)
        else:
            self.call("cuMemcpyDtoHAsync", dst, src, nbytes, stream)

    def memcpy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.call("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def host_alloc(self, nbytes: int) -> tuple[int, Any]:
        ptr = int(self.call("cuMemHostAlloc", max(nbytes, 1), 0))
        return ptr, host_array(ptr, nbytes)

    def host_free(self, ptr: int) -> None:
        self.call("cuMemFreeHost", ptr)

    # ---- streams and events
    def stream_create(self) -> Any:
        # Non-blocking: no implicit ordering with the legacy default stream other code uses.
        return self.call("cuStreamCreate", self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def stream_destroy(self, stream: Any) -> None:
        self.call("cuStreamDestroy", stream)

    def stream_synchronize(self, stream: Any) -> None:
        self.call("cuStreamSynchronize", stream)

    def event_create(self) -> Any:
        return self.call("cuEventCreate", self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)

    def event_destroy(self, event: Any) -> None:
        self.call("cuEventDestroy", event)

    def event_record(self, event: Any, stream: Any) -> None:
        self.call("cuEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self.ready("cuEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        self.call("cuEventSynchronize", event)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.call("cuStreamWaitEvent", stream, event, 0)

    # ---- virtual memory
    def vmm_granularity(self) -> int:
        p = self.profile
        if not p.vmm_supported or p.vmm_granularity <= 0:
            raise VmmError(
                f"{p.name or p.arch}: the device does not support virtual memory "
                f"(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED={int(p.vmm_supported)})"
            )
        return p.vmm_granularity

    def vmm_reserve(self, nbytes: int) -> int:
        return int(self.call("cuMemAddressReserve", nbytes, 0, 0, 0))

    def vmm_create(self, nbytes: int) -> Any:
        return self.call("cuMemCreate", nbytes, self.allocation_prop(), 0)

    def vmm_map(self, ptr: int, nbytes: int, handle: Any) -> None:
        self.call("cuMemMap", ptr, nbytes, 0, handle, 0)

    def vmm_set_access(self, ptr: int, nbytes: int) -> None:
        self.call("cuMemSetAccess", ptr, nbytes, [self.access_desc()], 1)

    def vmm_unmap(self, ptr: int, nbytes: int) -> None:
        self.call("cuMemUnmap", ptr, nbytes)

    def vmm_release(self, handle: Any) -> None:
        self.call("cuMemRelease", handle)

    def vmm_address_free(self, ptr: int, nbytes: int) -> None:
        self.call("cuMemAddressFree", ptr, nbytes)

    # ---- kernels
    #: This process's cubins (vt.gpu.kernel_cache), shared by every CudaRuntime.
    binaries: ClassVar[Binaries] = Binaries("cuda")

    def compile(self, source: str, name: str, options: Sequence[str]) -> Any:
        """NVRTC to a cubin for this device's architecture (once per process, and kept in
        ``VT_HOME/kernels`` for the next: vt.gpu.kernel_cache), loaded as a module in this
        runtime's context."""
        return self.binaries.load(
            self._key(source, options),
            self._compiler,
            lambda opts: self._nvrtc_compile(source, name, opts),
            lambda binary: self.call("cuModuleLoadData", binary),
            announce=name,
        )

    def prebuild(self, source: str, name: str, options: Sequence[str]) -> None:
        """nvrtc's part of :meth:`compile` (or the disk cache's cubin), without loading it;
        no driver call, so any thread may run it."""
        self.binaries.prebuild(
            self._key(source, options),
            self._compiler,
            lambda opts: self._nvrtc_compile(source, name, opts),
            announce=name,
        )

    def _key(self, source: str, options: Sequence[str]) -> Key:
        arch = self.profile.arch
        return Binaries.key(arch, f"--gpu-architecture={arch}", source, options)

    def _compiler(self) -> tuple[str, str]:
        return ("nvrtc", ".".join(str(v) for v in self.rtc("nvrtcVersion")))

    def _nvrtc_compile(self, source: str, name: str, opts: Sequence[str]) -> bytes:
        prog = self.rtc("nvrtcCreateProgram", source.encode(), name.encode(), 0, [], [])
        try:
            encoded = [o.encode() for o in opts]
            result = self.nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
            err = result[0] if isinstance(result, tuple) else result
            if err != self.nvrtc.nvrtcResult.NVRTC_SUCCESS:
                log = self._program_log(prog)
                raise CudaError(
                    f"nvrtcCompileProgram({name!r}, {' '.join(opts)})",
                    int(err),
                    _nvrtc_name(self.nvrtc, err),
                    log.strip() or "no compiler log",
                )
            size = int(self.rtc("nvrtcGetCUBINSize", prog))
            cubin = b" " * size
            self.rtc("nvrtcGetCUBIN", prog, cubin)
        finally:
            self.rtc("nvrtcDestroyProgram", prog)
        return cubin

    def _program_log(self, prog: Any) -> str:
        size = int(self.rtc("nvrtcGetProgramLogSize", prog))
        log = b" " * size
        self.rtc("nvrtcGetProgramLog", prog, log)
        return _text(log)

    def get_function(self, module: Any, name: str) -> Any:
        return self.call("cuModuleGetFunction", module, name.encode())

    def launch(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[Any],
    ) -> None:
        # call()'s work inlined (the hottest call: every kernel of every step goes through it)
        params, address = kernel_params(args)
        if self._ctx is not None and not getattr(self._tls, "bound", False):
            self._bind()
        gx, gy, gz = grid
        bx, by, bz = block
        result = self.cu.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, shared_mem, stream, address, 0)
        err = result[0] if isinstance(result, tuple) else result
        if err != self._success:
            call_args = (fn, gx, gy, gz, bx, by, bz, shared_mem, stream, address, 0)
            raise self._error("cuLaunchKernel", call_args, err)
        del params  # kept alive until the driver has copied the arguments

    def launch_overlapped(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[Any],
    ) -> None:
        """``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
        (compute capability 9.0 and later): the kernel's blocks may start while the stream's
        previous kernel runs, and wait for it with griddepcontrol.wait. A plain launch where
        the device or the binding lacks it (``overlap_reason`` says why)."""
        if self._overlap is None:
            self._overlap, self.overlap_reason = self._overlap_support()
        if not self._overlap:
            self.launch(fn, grid, block, shared_mem, stream, args)
            return
        # A CUlaunchConfig per grid and block, per thread (its stream is set per launch).
        configs = getattr(self._tls, "configs", None)
        if configs is None:
            configs = self._tls.configs = {}
        key = (grid, block, shared_mem)
        config = configs.get(key)
        if config is None:
            if len(configs) >= 4096:  # shapes come and go with batch sizes: bounded
                configs.clear()
            config = configs[key] = self._launch_config(grid, block, shared_mem)
        config.hStream = stream
        params, address = kernel_params(args)
        if self._ctx is not None and not getattr(self._tls, "bound", False):
            self._bind()
        result = self.cu.cuLaunchKernelEx(config, fn, address, 0)
        err = result[0] if isinstance(result, tuple) else result
        if err != self._success:
            raise self._error("cuLaunchKernelEx", (fn, *grid, *block, shared_mem, stream), err)
        del params  # kept alive until the driver has copied the arguments

    def _overlap_support(self) -> tuple[bool, str]:
        major = self.profile.compute_capability_major
        if major < 9:
            return False, f"compute capability {major}.x: programmatic launch needs 9.0"
        names = ("cuLaunchKernelEx", "CUlaunchConfig", "CUlaunchAttribute", "CUlaunchAttributeID")
        missing = [n for n in names if not hasattr(self.cu, n)]
        if missing:
            return False, f"cuda-python lacks {', '.join(missing)}"
        return True, "programmatic dependent launch (cuLaunchKernelEx)"

    def _launch_config(
        self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int
    ) -> Any:
        cu = self.cu
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_mem
        config.attrs = [attr]
        config.numAttrs = 1
        return config

    # ---- vendor BLAS: cuBLAS through nvmath-python, when installed
    def _cublas(self) -> Cublas | None:
        """cuBLAS with its handle made (so libcublas loaded), once; None without it, the
        reason in ``blas_reason`` (matmuls of many rows then run on vt's own kernel)."""
        if self._blas is None:
            try:
                blas = Cublas(import_cublas(), self, import_cublaslt())
                self._bind()
                blas.handle()
                self._blas = blas
            except ImportError as e:
                self._blas = False
                self.blas_reason = f"nvmath-python is not installed ({e}): {BLAS_HINT}"
            except GpuCallError as e:  # nvmath without a loadable libcublas
                self._blas = False
                self.blas_reason = f"cuBLAS could not be used: {e} ({BLAS_HINT})"
        return self._blas or None

    def blas(self) -> str | None:
        return BLAS_PRECISION if self._cublas() else None

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool,
        inputs: str = "f32",
    ) -> None:  # fmt: skip
        cublas = self._blas or self._cublas()
        if cublas is None:
            raise NotImplementedError(f"no cuBLAS: {self.blas_reason}")
        if self._ctx is not None and not getattr(self._tls, "bound", False):
            self._bind()
        cublas.gemm(stream, n, m, k, x, w, out, accumulate, inputs)

    # ---- graphs: stream capture in this thread's mode, so another thread's unrelated CUDA
    # calls (a second runner, a server thread) do not invalidate the capture
    def graph_begin_capture(self, stream: Any) -> None:
        mode = self.cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        self.call("cuStreamBeginCapture", stream, mode)

    def graph_end_capture(self, stream: Any) -> Any:
        return self.call("cuStreamEndCapture", stream)

    def graph_instantiate(self, graph: Any) -> Any:
        # cuda-python 12 and 13 bind cuGraphInstantiate as (graph, flags) (13 has no
        # cuGraphInstantiateWithFlags, as seen on the H200's cuda-bindings 13.3.1)
        return self.call("cuGraphInstantiate", graph, 0)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self.call("cuGraphLaunch", graph_exec, stream)

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self.call("cuGraphExecDestroy", graph_exec)

    def graph_destroy(self, graph: Any) -> None:
        self.call("cuGraphDestroy", graph)


_INT_FIELDS = frozenset({"compute_capability_major", "compute_capability_minor", "warp_size"})


def _nvrtc_name(nvrtc: Any, err: Any) -> str:
    try:
        return nvrtc.nvrtcResult(int(err)).name
    except ValueError:
        return f"nvrtcResult {int(err)}"
