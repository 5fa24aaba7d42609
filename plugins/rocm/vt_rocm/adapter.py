"""A thin layer over hip-python: checked calls, clear errors, and the device profile.

hip-python functions return a tuple ``(hipError_t, *outputs)``. :meth:`HipRuntime.call`
checks the error and returns the outputs, so the backend reads like the C API without the
error plumbing. The ``hip`` module is injected, so tests drive this code with a fake.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from vt import VtError

from .caps import DeviceProfile

INSTALL_HINT = "pip install 'vt[rocm]'"


class HipError(VtError, RuntimeError):
    """A HIP call returned an error; names the call and HIP's error name and string."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call, self.code, self.error_name = call, code, name
        super().__init__(f"{call} failed: {name} ({code}): {text}")


def import_hip() -> ModuleType:
    """hip-python's runtime module. Raises ImportError when hip-python is not installed."""
    from hip import hip

    return hip


def _fmt(arg: Any) -> str:
    # Keep messages short: plain values verbatim, handles and structs by type.
    if arg is None or isinstance(arg, (bool, int, str)):
        return repr(arg) if isinstance(arg, str) else str(arg)
    return type(arg).__name__


class HipRuntime:
    """Checked access to the HIP runtime for one device."""

    def __init__(self, hip: ModuleType | Any, device: int = 0) -> None:
        self.hip = hip
        self.device = device

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
        """Read the vendor facts :func:`~vt_rocm.caps.capabilities_from_device` needs."""
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
        return DeviceProfile(
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
        )


def host_platform(platform: str | None = None) -> str:
    """'windows' or 'linux' from ``sys.platform`` (HIP runs on nothing else)."""
    platform = sys.platform if platform is None else platform
    return "windows" if platform in ("win32", "cygwin", "windows") else "linux"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)
