"""Vendor facts of one HIP device, and the one pure function that turns them into capabilities.

Nothing here calls HIP: the adapter reads a :class:`DeviceProfile` from the runtime, and
:func:`capabilities_from_device` is tested on a table of real device profiles without one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from vt import Capabilities, Provenance, Source, VmmCaps


class DeviceProfile(BaseModel):
    """What the HIP runtime reports about one device (``hipDeviceGetAttribute`` and friends)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="", description="marketing name (hipDeviceProp_t.name)")
    gcn_arch_name: str = Field(description="e.g. 'gfx1151' or 'gfx942:sramecc+:xnack-'")
    platform: Literal["linux", "windows"]
    integrated: bool = Field(description="hipDeviceAttributeIntegrated")
    managed_memory: bool = Field(description="hipDeviceAttributeManagedMemory")
    concurrent_managed_access: bool = Field(description="hipDeviceAttributeConcurrentManagedAccess")
    pageable_memory_access: bool = Field(description="hipDeviceAttributePageableMemoryAccess")
    vmm_supported: bool = Field(description="hipDeviceAttributeVirtualMemoryManagementSupported")
    vmm_granularity: int = Field(
        default=0,
        ge=0,
        description="hipMemGetAllocationGranularity (minimum) in bytes; 0 when not queried",
    )
    total_memory: int = Field(default=0, ge=0, description="hipDeviceProp_t.totalGlobalMem")
    warp_size: int = Field(
        default=64, ge=1, description="hipDeviceProp_t.warpSize (64 on CDNA, 32 on RDNA)"
    )


def _flag(name: str, value: bool) -> str:
    return f"hipDeviceAttribute{name}={int(value)}"


def use_managed_alloc(profile: DeviceProfile) -> bool:
    """Whether ``alloc`` should use ``hipMallocManaged`` rather than ``hipMalloc``.

    Only where the memory is physically shared (integrated) *and* the runtime both supports
    managed memory and lets host and device touch it concurrently; elsewhere managed memory
    migrates pages on fault, which is slow, or is not implemented (Windows).
    """
    return profile.integrated and profile.managed_memory and profile.concurrent_managed_access


def capabilities_from_device(profile: DeviceProfile) -> Capabilities:
    """The physical facts of the ROCm backend on the device ``profile`` describes.

    The memory facts (unified, addressable either way) and VMM are declared here. Events,
    pinned host memory, async D2H copies and graphs need code: vt derives them from the mixins
    :class:`vt.gpu.GpuBackend` implements over HIP (``hipEventCreateWithFlags``,
    ``hipHostMalloc``, ``hipMemcpyAsync``, ``hipStreamBeginCapture``), and so async
    sampled-token readback. A device that lacks one would set it False here; every HIP
    device has them.
    """
    managed = use_managed_alloc(profile)
    unified = managed or (profile.integrated and profile.pageable_memory_access)
    host_addressable = unified

    attrs = ", ".join(
        [
            _flag("Integrated", profile.integrated),
            _flag("ManagedMemory", profile.managed_memory),
            _flag("ConcurrentManagedAccess", profile.concurrent_managed_access),
            _flag("PageableMemoryAccess", profile.pageable_memory_access),
        ]
    )
    if managed:
        why = "managed allocation on an integrated device"
    elif unified:
        why = "integrated device with pageable memory access"
    else:
        why = "neither managed allocation nor an integrated device with pageable access"
    alloc = "hipMallocManaged" if managed else "hipMalloc"

    vmm: VmmCaps | None = None
    vmm_detail = _flag("VirtualMemoryManagementSupported", profile.vmm_supported)
    if profile.vmm_supported and profile.vmm_granularity > 0:
        # Windows ROCm mapped later segments over earlier ones' pages; segments_may_alias
        # selects the policy that avoids it: map the full reservation once, never grow.
        vmm = VmmCaps(
            granularity=profile.vmm_granularity,
            segments_may_alias=profile.platform == "windows",
        )
        vmm_detail += (
            f", hipMemGetAllocationGranularity(minimum)={profile.vmm_granularity}"
            f" on {profile.platform}"
        )
        if vmm.segments_may_alias:
            vmm_detail += ": later segments may alias, map the full reservation once"
    elif profile.vmm_supported:
        vmm_detail += ", but no allocation granularity was reported: no VMM"

    values: dict[str, tuple[object, str]] = {
        "unified_memory": (unified, f"{attrs}: {why}"),
        "device_memory_is_host_addressable": (
            host_addressable,
            f"equals unified_memory for {alloc} memory ({why})",
        ),
        "host_memory_is_device_addressable": (
            profile.pageable_memory_access,
            _flag("PageableMemoryAccess", profile.pageable_memory_access),
        ),
        "vmm": (vmm, vmm_detail),
    }
    return Capabilities.model_validate(
        {
            **{name: value for name, (value, _) in values.items()},
            "provenance": {
                name: Provenance(source=Source.derived, detail=detail)
                for name, (_, detail) in values.items()
            },
        }
    )
