"""Vendor facts of one CUDA device, and the one pure function that turns them into capabilities.

Nothing here calls CUDA: the adapter reads a :class:`DeviceProfile` from the driver, and
:func:`capabilities_from_device` is tested on a table of device profiles without one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from vt import Capabilities, Provenance, Source, VmmCaps

#: Profile fields read with cuDeviceGetAttribute, by their CU_DEVICE_ATTRIBUTE_* names.
ATTRIBUTES: dict[str, str] = {
    "integrated": "INTEGRATED",
    "managed_memory": "MANAGED_MEMORY",
    "concurrent_managed_access": "CONCURRENT_MANAGED_ACCESS",
    "pageable_memory_access": "PAGEABLE_MEMORY_ACCESS",
    "pageable_memory_access_uses_host_page_tables": (
        "PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES"
    ),
    "vmm_supported": "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "compute_capability_major": "COMPUTE_CAPABILITY_MAJOR",
    "compute_capability_minor": "COMPUTE_CAPABILITY_MINOR",
    "warp_size": "WARP_SIZE",
}


class DeviceProfile(BaseModel):
    """What the CUDA driver reports about one device (``cuDeviceGetAttribute`` and friends)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(default="", description="cuDeviceGetName")
    platform: Literal["linux", "windows"]
    compute_capability_major: int = Field(ge=1, description="e.g. 9 for Hopper")
    compute_capability_minor: int = Field(ge=0)
    integrated: bool = Field(description="CU_DEVICE_ATTRIBUTE_INTEGRATED")
    managed_memory: bool = Field(description="CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY")
    concurrent_managed_access: bool = Field(
        description="CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS"
    )
    pageable_memory_access: bool = Field(description="CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS")
    pageable_memory_access_uses_host_page_tables: bool = Field(
        default=False,
        description="CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES (ATS)",
    )
    vmm_supported: bool = Field(
        description="CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
    )
    vmm_granularity: int = Field(
        default=0,
        ge=0,
        description="cuMemGetAllocationGranularity (minimum) in bytes; 0 when not queried",
    )
    warp_size: int = Field(default=32, ge=1, description="CU_DEVICE_ATTRIBUTE_WARP_SIZE")
    total_memory: int = Field(default=0, ge=0, description="cuDeviceTotalMem")
    driver_version: int = Field(default=0, ge=0, description="cuDriverGetVersion (13000 = 13.0)")

    @property
    def arch(self) -> str:
        """The nvrtc target of this device: ``sm_90`` for compute capability 9.0."""
        return f"sm_{self.compute_capability_major}{self.compute_capability_minor}"


def _flag(name: str, value: bool) -> str:
    return f"CU_DEVICE_ATTRIBUTE_{ATTRIBUTES[name]}={int(value)}"


def use_managed_alloc(profile: DeviceProfile) -> bool:
    """Whether ``alloc`` should use ``cuMemAllocManaged`` rather than ``cuMemAlloc``.

    Only on an integrated part (one physical memory) whose driver lets host and device
    touch managed memory concurrently. Jetson parts report concurrent managed access 0: the
    host may not touch managed memory while a kernel runs, so they get plain cuMemAlloc. A
    discrete or coherent part (GH200) keeps cuMemAlloc: managed memory would migrate.
    """
    return profile.integrated and profile.managed_memory and profile.concurrent_managed_access


def capabilities_from_device(profile: DeviceProfile) -> Capabilities:
    """The physical facts of the CUDA backend on the device ``profile`` describes.

    The memory facts (unified, addressable either way) and VMM are declared here. Events,
    pinned host memory, async D2H copies and graphs need code: vt derives them from the mixins
    :class:`vt.gpu.GpuBackend` implements over the driver (``cuEventCreate``,
    ``cuMemHostAlloc``, ``cuMemcpyDtoHAsync``, ``cuStreamBeginCapture``), and so async
    sampled-token readback. A device that lacks one would set it False here; every CUDA
    device has them.
    """
    managed = use_managed_alloc(profile)
    # One physical memory only on an integrated part. GH200's Grace and Hopper memories are
    # coherent over NVLink-C2C but two memories: not unified.
    unified = profile.integrated
    # Only managed memory is host-dereferenceable. The host must not load cuMemAlloc memory
    # even where memory is unified (Jetson) or coherent (GH200: ATS lets the GPU read host
    # memory, not the CPU read cudaMalloc memory).
    host_addressable = managed

    attrs = ", ".join(
        _flag(f, getattr(profile, f))
        for f in ("integrated", "managed_memory", "concurrent_managed_access")
    )
    alloc = "cuMemAllocManaged" if managed else "cuMemAlloc"
    if managed:
        why = f"{attrs}: managed allocation on an integrated part, host and device concurrently"
    elif unified:
        why = f"{attrs}: {alloc} memory, which the host may not dereference"
    else:
        why = f"{attrs}: {alloc} memory on a discrete device"

    host_mem = _flag("pageable_memory_access", profile.pageable_memory_access)
    if profile.pageable_memory_access:
        host_mem += (
            " (ATS, host page tables)"
            if profile.pageable_memory_access_uses_host_page_tables
            else " (HMM)"
        )

    vmm: VmmCaps | None = None
    vmm_detail = _flag("vmm_supported", profile.vmm_supported)
    if profile.vmm_supported and profile.vmm_granularity > 0:
        # No CUDA runtime is known to alias later segments: the arena may grow.
        vmm = VmmCaps(granularity=profile.vmm_granularity, segments_may_alias=False)
        vmm_detail += (
            f", cuMemGetAllocationGranularity(minimum)={profile.vmm_granularity}: "
            "cuMemCreate/cuMemMap segments, which do not alias"
        )
    elif profile.vmm_supported:
        vmm_detail += ", but no allocation granularity was reported: no VMM"

    values: dict[str, tuple[object, str]] = {
        "unified_memory": (
            unified,
            f"{_flag('integrated', profile.integrated)}: "
            + ("one physical memory" if unified else "device memory is its own"),
        ),
        "device_memory_is_host_addressable": (host_addressable, why),
        "host_memory_is_device_addressable": (profile.pageable_memory_access, host_mem),
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
