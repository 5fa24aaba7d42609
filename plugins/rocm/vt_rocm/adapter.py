"""vt.gpu's runtime adapter over hip-python: checked HIP calls, hiprtc, the device profile.

hip-python functions return a tuple ``(hipError_t, *outputs)``. :meth:`HipRuntime.call`
checks the error and returns the outputs, so the adapter reads like the C API without the
error plumbing. The ``hip`` and ``hiprtc`` modules are injected, so tests drive this code
with fakes. Everything else (argument checks, VMM bookkeeping, kernels) is vt.gpu's
GpuBackend, shared with the CUDA backend.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, ClassVar

from vt import VmmError
from vt.gpu import Binaries, GpuCallError, GpuRuntime, host_array, kernel_params
from vt.gpu.kernel_cache import Key

from .blas import PRECISION as BLAS_PRECISION
from .blas import Hipblas, import_hipblas
from .caps import DeviceProfile, use_managed_alloc

INSTALL_HINT = "pip install 'vt[rocm]'"


class HipError(GpuCallError):
    """A HIP or hiprtc call returned an error; names the call and HIP's error name and string."""


class HipLibraryError(RuntimeError):
    """The HIP runtime library (libamdhip64) cannot be loaded."""


def import_hip() -> ModuleType:
    """hip-python's runtime module. Raises ImportError when hip-python is not installed, and
    :class:`HipLibraryError` when it is but the HIP runtime library cannot be loaded."""
    check_hip_library()
    from hip import hip

    return hip


def check_hip_library() -> None:
    """Raise :class:`HipLibraryError` when the library hip-python would load cannot be loaded.

    hip-python's bindings cost ~9 MiB of memory and ~25 ms to import, and on a machine
    without ROCm their first call fails to dlopen libamdhip64 anyway: look for the library
    first, at the path hip-python itself resolves (its pure-Python ``paths`` module), so a
    process that never uses ROCm never imports the bindings. Without hip-python (the
    import then says so), or with a layout that has no ``paths`` module, this checks
    nothing and hip-python looks for the library itself.
    """
    try:
        installed = importlib.util.find_spec("hip") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return
    try:
        from rocm.bindings.util.paths import get_library_path

        path = os.fsdecode(get_library_path("amdhip64"))
    except Exception:  # another layout, or its lookup failed: let hip-python look itself
        return
    try:
        ctypes.CDLL(path)
    except OSError as e:
        # The words hip-python's own RuntimeError uses, so the reason reads the same.
        raise HipLibraryError(f"failed to dlopen '{path}': {e}") from e


def import_hiprtc() -> ModuleType:
    """hip-python's hiprtc module (loaded when the kernels are first compiled)."""
    from hip import hiprtc

    return hiprtc


def _fmt(arg: Any) -> str:
    # Keep messages short: plain values verbatim, handles and structs by type.
    if arg is None or isinstance(arg, (bool, int, str)):
        return repr(arg) if isinstance(arg, str) else str(arg)
    return type(arg).__name__


class HipRuntime(GpuRuntime):
    """Checked access to the HIP runtime for one device."""

    vendor = "hip"

    def __init__(
        self, hip: ModuleType | Any, device: int = 0, hiprtc: ModuleType | Any | None = None
    ) -> None:
        self.hip = hip
        self.device = device
        self._hiprtc = hiprtc
        self.profile: DeviceProfile | None = None
        self._managed = False
        self._blas: Hipblas | None | bool = None  # None: not looked for yet; False: absent

    def close(self) -> None:
        """Destroy the hipBLAS handle, if one was made (idempotent)."""
        if self._blas:
            blas, self._blas = self._blas, None
            blas.close()

    # ---- vendor BLAS: hipBLAS through hip-python, when it has the module
    def _hipblas(self) -> Hipblas | None:
        if self._blas is None:
            try:
                self._blas = Hipblas(import_hipblas())
            except ImportError:
                self._blas = False
        return self._blas or None

    def blas(self) -> str | None:
        return BLAS_PRECISION if self._hipblas() else None

    def gemm(
        self, stream: Any, n: int, m: int, k: int, x: int, w: int, out: int, accumulate: bool,
        inputs: str = "f32",
    ) -> None:  # fmt: skip
        hipblas = self._hipblas()
        if hipblas is None:
            raise NotImplementedError("hip-python has no hipblas module here")
        if inputs != "f32":
            raise NotImplementedError(f"vt_rocm's hipBLAS path takes float32 inputs, not {inputs}")
        hipblas.gemm(stream, n, m, k, x, w, out, accumulate)

    @classmethod
    def load(cls, device: int = 0) -> HipRuntime:
        return cls(import_hip(), device)

    def error_name(self, code: int) -> str:
        try:
            return self.hip.hipError_t(int(code)).name
        except ValueError:
            return f"hipError {int(code)}"

    def error_string(self, code: int) -> str:
        try:
            result = self.hip.hipGetErrorString(code)
        except Exception:  # best effort: the error name already identifies the failure
            return "(no error string)"
        text = result[-1] if isinstance(result, tuple) else result
        return text.decode(errors="replace") if isinstance(text, bytes) else str(text)

    def ready(self, name: str, *args: Any) -> bool:
        """For query calls (hipEventQuery): True on hipSuccess, False on hipErrorNotReady."""
        result = getattr(self.hip, name)(*args)
        err = result[0] if isinstance(result, tuple) else result
        if err == self.hip.hipError_t.hipErrorNotReady:
            return False
        self._check(name, args, err)
        return True

    def call(self, name: str, *args: Any) -> Any:
        """Call ``hip.<name>(*args)``; raise :class:`HipError` unless it returned hipSuccess.

        Returns None, the single output, or a tuple of outputs.
        """
        result = getattr(self.hip, name)(*args)
        err, outputs = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        self._check(name, args, err)
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def _check(self, name: str, args: tuple[Any, ...], err: int) -> None:
        if err != self.hip.hipError_t.hipSuccess:
            call = f"{name}({', '.join(_fmt(a) for a in args)})"
            raise HipError(call, int(err), self.error_name(err), self.error_string(err))

    def attribute(self, name: str) -> int:
        """``hipDeviceGetAttribute(hipDeviceAttribute<name>, device)``."""
        attr = getattr(self.hip.hipDeviceAttribute_t, f"hipDeviceAttribute{name}")
        return int(self.call("hipDeviceGetAttribute", attr, self.device))

    # ---- structs the VMM calls take
    def allocation_prop(self) -> Any:
        """Pinned device memory on this device, as hipMemCreate and the granularity query want."""
        prop = self.hip.hipMemAllocationProp()
        prop.type = self.hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = self.hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = self.device
        return prop

    def access_desc(self) -> Any:
        """Read-write access for this device, for hipMemSetAccess."""
        desc = self.hip.hipMemAccessDesc()
        desc.location.type = self.hip.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = self.device
        desc.flags = self.hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        return desc

    # ---- device facts
    def device_count(self) -> int:
        return int(self.call("hipGetDeviceCount"))

    def device_profile(self, platform: str | None = None) -> DeviceProfile:
        """Read the vendor facts :func:`~vt_rocm.caps.capabilities_from_device` needs.

        The adapter keeps the profile: allocation (managed or not), the compile target and
        the VMM granularity follow it.
        """
        props = self.call("hipGetDeviceProperties", self.device)
        vmm = bool(self.attribute("VirtualMemoryManagementSupported"))
        granularity = 0
        if vmm:
            granularity = int(
                self.call(
                    "hipMemGetAllocationGranularity",
                    self.allocation_prop(),
                    self.hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum,
                )
            )
        profile = DeviceProfile(
            name=_text(props.name),
            gcn_arch_name=_text(props.gcnArchName),
            platform=host_platform(platform),
            integrated=bool(self.attribute("Integrated")),
            managed_memory=bool(self.attribute("ManagedMemory")),
            concurrent_managed_access=bool(self.attribute("ConcurrentManagedAccess")),
            pageable_memory_access=bool(self.attribute("PageableMemoryAccess")),
            vmm_supported=vmm,
            vmm_granularity=granularity,
            total_memory=int(props.totalGlobalMem),
            warp_size=int(getattr(props, "warpSize", 64) or 64),
        )
        self.profile = profile
        self._managed = use_managed_alloc(profile)
        return profile

    def _profile(self) -> DeviceProfile:
        if self.profile is None:
            return self.device_profile()
        return self.profile

    # ---- vt.gpu runtime protocol: device facts
    def device_name(self) -> str:
        return self._profile().name

    def arch(self) -> str:
        return self._profile().gcn_arch_name

    def warp_size(self) -> int:
        return self._profile().warp_size

    # ---- memory
    def malloc(self, nbytes: int) -> int:
        if self._managed:
            return int(self.call("hipMallocManaged", nbytes, self.hip.hipMemAttachGlobal))
        return int(self.call("hipMalloc", nbytes))

    def free(self, ptr: int) -> None:
        self.call("hipFree", ptr)

    def memory_info(self) -> tuple[int, int]:
        """``hipMemGetInfo``: free and total bytes of the current device."""
        free, total = self.call("hipMemGetInfo")
        return int(free), int(total)

    def memset(self, ptr: int, value: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self.call("hipMemset", ptr, value, nbytes)
        else:
            self.call("hipMemsetAsync", ptr, value, nbytes, stream)

    def _memcpy(self, dst: int, src: int, nbytes: int, k: Any, stream: Any) -> None:
        if stream is None:
            self.call("hipMemcpy", dst, src, nbytes, k)
        else:
            self.call("hipMemcpyAsync", dst, src, nbytes, k, stream)

    def memcpy_h2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._memcpy(dst, src, nbytes, self.hip.hipMemcpyKind.hipMemcpyHostToDevice, stream)

    def memcpy_d2h(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._memcpy(dst, src, nbytes, self.hip.hipMemcpyKind.hipMemcpyDeviceToHost, stream)

    def memcpy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._memcpy(dst, src, nbytes, self.hip.hipMemcpyKind.hipMemcpyDeviceToDevice, stream)

    def host_alloc(self, nbytes: int) -> tuple[int, Any]:
        ptr = int(self.call("hipHostMalloc", nbytes, self.hip.hipHostMallocDefault))
        return ptr, host_array(ptr, nbytes)

    def host_free(self, ptr: int) -> None:
        self.call("hipHostFree", ptr)

    # ---- streams and events (timing off: they only order work, which is the cheap kind)
    def stream_create(self) -> Any:
        return self.call("hipStreamCreate")

    def stream_destroy(self, stream: Any) -> None:
        self.call("hipStreamDestroy", stream)

    def stream_synchronize(self, stream: Any) -> None:
        self.call("hipStreamSynchronize", stream)

    def event_create(self) -> Any:
        return self.call("hipEventCreateWithFlags", self.hip.hipEventDisableTiming)

    def event_destroy(self, event: Any) -> None:
        self.call("hipEventDestroy", event)

    def event_record(self, event: Any, stream: Any) -> None:
        self.call("hipEventRecord", event, stream)

    def event_query(self, event: Any) -> bool:
        return self.ready("hipEventQuery", event)

    def event_synchronize(self, event: Any) -> None:
        self.call("hipEventSynchronize", event)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.call("hipStreamWaitEvent", stream, event, 0)

    # ---- virtual memory
    def vmm_granularity(self) -> int:
        p = self._profile()
        if not p.vmm_supported:
            raise VmmError(
                f"{p.gcn_arch_name}: the device does not support virtual memory "
                "(hipDeviceAttributeVirtualMemoryManagementSupported=0)"
            )
        minimum = self.hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
        return int(self.call("hipMemGetAllocationGranularity", self.allocation_prop(), minimum))

    def vmm_reserve(self, nbytes: int) -> int:
        return int(self.call("hipMemAddressReserve", nbytes, 0, None, 0))

    def vmm_create(self, nbytes: int) -> Any:
        return self.call("hipMemCreate", nbytes, self.allocation_prop(), 0)

    def vmm_map(self, ptr: int, nbytes: int, handle: Any) -> None:
        self.call("hipMemMap", ptr, nbytes, 0, handle, 0)

    def vmm_set_access(self, ptr: int, nbytes: int) -> None:
        self.call("hipMemSetAccess", ptr, nbytes, self.access_desc(), 1)

    def vmm_unmap(self, ptr: int, nbytes: int) -> None:
        self.call("hipMemUnmap", ptr, nbytes)

    def vmm_release(self, handle: Any) -> None:
        self.call("hipMemRelease", handle)

    def vmm_address_free(self, ptr: int, nbytes: int) -> None:
        self.call("hipMemAddressFree", ptr, nbytes)

    # ---- kernels: hiprtc
    #: This process's code objects (vt.gpu.kernel_cache), shared by every HipRuntime.
    binaries: ClassVar[Binaries] = Binaries("hip")

    @property
    def hiprtc(self) -> Any:
        if self._hiprtc is None:
            self._hiprtc = import_hiprtc()
        return self._hiprtc

    def rtc(self, name: str, *args: Any) -> Any:
        """Call ``hiprtc.<name>(*args)``, checked like :meth:`call`."""
        rtc = self.hiprtc
        result = getattr(rtc, name)(*args)
        err, outputs = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != rtc.hiprtcResult.HIPRTC_SUCCESS:
            call = f"{name}({', '.join(_fmt(a) for a in args)})"
            raise HipError(call, int(err), _rtc_name(rtc, err), "hiprtc call failed")
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def compile(self, source: str, name: str, options: Sequence[str]) -> Any:
        """hiprtc to a code object for this device's architecture (once per process, and
        kept in ``VT_HOME/kernels`` for the next: vt.gpu.kernel_cache), loaded as a module."""
        return self.binaries.load(
            self._key(source, options),
            self._compiler,
            lambda opts: self._hiprtc_compile(source, name, opts),
            lambda binary: self.call("hipModuleLoadData", binary),
            announce=name,
        )

    def prebuild(self, source: str, name: str, options: Sequence[str]) -> None:
        """hiprtc's part of :meth:`compile` (or the disk cache's code object), without
        loading it; no driver call, so any thread may run it."""
        self.binaries.prebuild(
            self._key(source, options),
            self._compiler,
            lambda opts: self._hiprtc_compile(source, name, opts),
            announce=name,
        )

    def _key(self, source: str, options: Sequence[str]) -> Key:
        arch = self.arch()
        return Binaries.key(arch, f"--offload-arch={arch}", source, options)

    def _compiler(self) -> tuple[str, str]:
        return ("hiprtc", ".".join(str(v) for v in self.rtc("hiprtcVersion")))

    def _hiprtc_compile(self, source: str, name: str, opts: Sequence[str]) -> bytes:
        rtc = self.hiprtc
        prog = self.rtc("hiprtcCreateProgram", source.encode(), name.encode(), 0, [], [])
        try:
            encoded = [o.encode() for o in opts]
            result = rtc.hiprtcCompileProgram(prog, len(encoded), encoded)
            err = result[0] if isinstance(result, tuple) else result
            if err != rtc.hiprtcResult.HIPRTC_SUCCESS:
                size = int(self.rtc("hiprtcGetProgramLogSize", prog))
                log = bytearray(size)
                self.rtc("hiprtcGetProgramLog", prog, log)
                raise HipError(
                    f"hiprtcCompileProgram({name!r}, {' '.join(opts)})",
                    int(err),
                    _rtc_name(rtc, err),
                    _text(bytes(log)).strip() or "no compiler log",
                )
            code = bytearray(int(self.rtc("hiprtcGetCodeSize", prog)))
            self.rtc("hiprtcGetCode", prog, code)
        finally:
            ref = prog.createRef() if hasattr(prog, "createRef") else prog
            self.rtc("hiprtcDestroyProgram", ref)
        return bytes(code)

    def get_function(self, module: Any, name: str) -> Any:
        return self.call("hipModuleGetFunction", module, name.encode())

    def launch(
        self,
        fn: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        args: Sequence[Any],
    ) -> None:
        params, address = kernel_params(args)
        self.call("hipModuleLaunchKernel", fn, *grid, *block, shared_mem, stream, address, None)
        del params  # kept alive until HIP has copied the arguments

    # ---- graphs: stream capture in this thread's mode (as the CUDA adapter)
    def graph_begin_capture(self, stream: Any) -> None:
        mode = self.hip.hipStreamCaptureMode.hipStreamCaptureModeThreadLocal
        self.call("hipStreamBeginCapture", stream, mode)

    def graph_end_capture(self, stream: Any) -> Any:
        return self.call("hipStreamEndCapture", stream)

    def graph_instantiate(self, graph: Any) -> Any:
        return self.call("hipGraphInstantiateWithFlags", graph, 0)

    def graph_launch(self, graph_exec: Any, stream: Any) -> None:
        self.call("hipGraphLaunch", graph_exec, stream)

    def graph_exec_destroy(self, graph_exec: Any) -> None:
        self.call("hipGraphExecDestroy", graph_exec)

    def graph_destroy(self, graph: Any) -> None:
        self.call("hipGraphDestroy", graph)


def host_platform(platform: str | None = None) -> str:
    """'windows' or 'linux' from ``sys.platform`` (HIP runs on nothing else)."""
    platform = sys.platform if platform is None else platform
    return "windows" if platform in ("win32", "cygwin", "windows") else "linux"


def _rtc_name(rtc: Any, err: Any) -> str:
    try:
        return rtc.hiprtcResult(int(err)).name
    except ValueError:
        return f"hiprtcResult {int(err)}"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)
