"""The ROCm capability function on a table of device profiles.

Each row is what ``hipDeviceGetAttribute`` reports for that device (values as the HIP
runtime of the stated platform reports them; one row is marked as built to reach a branch),
with the capabilities the rules of issue 2 give and why. The function declares physical
facts; the effective capabilities are what vt derives from them and the mixins RocmBackend
implements (:func:`vt.protocol.mixins.derive_capabilities`), as the registry does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError
from vt import Capabilities, Source, VmmCaps
from vt.management import rules
from vt.protocol.mixins import derive_capabilities
from vt_rocm.backend import RocmBackend
from vt_rocm.caps import DeviceProfile, capabilities_from_device, use_managed_alloc


@dataclass(frozen=True)
class Row:
    profile: DeviceProfile
    managed: bool
    unified: bool
    host_memory_device_addressable: bool
    vmm: VmmCaps | None
    why: str  # the reason the capability function records for unified_memory


def _p(arch: str, platform: str, **flags: object) -> DeviceProfile:
    return DeviceProfile(gcn_arch_name=arch, platform=platform, **flags)  # type: ignore[arg-type]


ROWS: dict[str, Row] = {
    # Strix Halo under the Windows HIP SDK: an APU, but managed memory is not implemented on
    # Windows and pageable access is 0. Not unified, so hipMalloc memory is NOT
    # host-addressable: the device of bug 1 (ACCESS_VIOLATION on a host read). Async
    # readback stays on, through pinned memory and hipMemcpyAsync; VMM segments may alias.
    "gfx1151-windows": Row(
        _p(
            "gfx1151",
            "windows",
            name="AMD Radeon(TM) 8060S Graphics",
            integrated=True,
            managed_memory=False,
            concurrent_managed_access=False,
            pageable_memory_access=False,
            vmm_supported=True,
            vmm_granularity=64 * 1024,
        ),
        managed=False,
        unified=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=64 * 1024, segments_may_alias=True),
        why="neither managed allocation nor an integrated device with pageable access",
    ),
    # The same APU where the runtime does report managed + concurrent managed access:
    # managed allocation wins even with pageable access 0, and makes memory unified.
    "gfx1151-windows-managed": Row(
        _p(
            "gfx1151",
            "windows",
            integrated=True,
            managed_memory=True,
            concurrent_managed_access=True,
            pageable_memory_access=False,
            vmm_supported=True,
            vmm_granularity=64 * 1024,
        ),
        managed=True,
        unified=True,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=64 * 1024, segments_may_alias=True),
        why="managed allocation on an integrated device",
    ),
    # RX 7900 XTX on Windows: discrete, nothing shared; VMM with the aliasing policy.
    "gfx1100-windows": Row(
        _p(
            "gfx1100",
            "windows",
            name="AMD Radeon RX 7900 XTX",
            integrated=False,
            managed_memory=False,
            concurrent_managed_access=False,
            pageable_memory_access=False,
            vmm_supported=True,
            vmm_granularity=64 * 1024,
        ),
        managed=False,
        unified=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=64 * 1024, segments_may_alias=True),
        why="neither managed allocation nor an integrated device with pageable access",
    ),
    # RX 9070 XT on Linux: discrete; managed memory exists on Linux but the part is not
    # integrated, so vt does not use it. Linux segments do not alias.
    "gfx1201-linux": Row(
        _p(
            "gfx1201",
            "linux",
            name="AMD Radeon RX 9070 XT",
            integrated=False,
            managed_memory=True,
            concurrent_managed_access=False,
            pageable_memory_access=False,
            vmm_supported=True,
            vmm_granularity=4096,
        ),
        managed=False,
        unified=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=4096, segments_may_alias=False),
        why="neither managed allocation nor an integrated device with pageable access",
    ),
    # MI300X with XNACK on: kernels may read pageable host memory and managed memory is
    # concurrent, but HBM behind a large BAR is still not unified: a host load of hipMalloc
    # memory crosses PCIe and is not what the runner may assume. Not integrated -> not unified.
    "mi300x-linux": Row(
        _p(
            "gfx942:sramecc+:xnack+",
            "linux",
            name="AMD Instinct MI300X",
            integrated=False,
            managed_memory=True,
            concurrent_managed_access=True,
            pageable_memory_access=True,
            vmm_supported=True,
            vmm_granularity=4096,
        ),
        managed=False,
        unified=False,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=4096, segments_may_alias=False),
        why="neither managed allocation nor an integrated device with pageable access",
    ),
    # MI300A: CPU and GPU share HBM; managed, concurrent and pageable access all on.
    "mi300a-linux": Row(
        _p(
            "gfx942:sramecc+:xnack+",
            "linux",
            name="AMD Instinct MI300A",
            integrated=True,
            managed_memory=True,
            concurrent_managed_access=True,
            pageable_memory_access=True,
            vmm_supported=True,
            vmm_granularity=4096,
        ),
        managed=True,
        unified=True,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=4096, segments_may_alias=False),
        why="managed allocation on an integrated device",
    ),
    # Built to reach the second branch of the unified rule (not a shipped configuration):
    # an APU on Linux with pageable (HMM) access but no concurrent managed access. Unified
    # through pageable access while alloc stays on hipMalloc.
    "apu-linux-pageable-only": Row(
        _p(
            "gfx1151",
            "linux",
            integrated=True,
            managed_memory=True,
            concurrent_managed_access=False,
            pageable_memory_access=True,
            vmm_supported=True,
            vmm_granularity=4096,
        ),
        managed=False,
        unified=True,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=4096, segments_may_alias=False),
        why="integrated device with pageable memory access",
    ),
    # Radeon 890M (gfx1150) under ROCm 7.2 on Linux: hipMallocManaged is not supported and
    # VMM is reported off (ROCm/ROCm#5944): no VMM at all, so the KV cache is contiguous.
    "gfx1150-linux": Row(
        _p(
            "gfx1150",
            "linux",
            name="AMD Radeon 890M Graphics",
            integrated=True,
            managed_memory=False,
            concurrent_managed_access=False,
            pageable_memory_access=False,
            vmm_supported=False,
        ),
        managed=False,
        unified=False,
        host_memory_device_addressable=False,
        vmm=None,
        why="neither managed allocation nor an integrated device with pageable access",
    ),
}


#: Capabilities that need code: derived from the mixins, never declared for a HIP device.
CODE = ("events", "pinned_host_memory", "async_d2h_copy", "graphs")


def effective(profile: DeviceProfile) -> Capabilities:
    """What the registry makes of the declaration (without overrides)."""
    return derive_capabilities(RocmBackend, capabilities_from_device(profile))


@pytest.mark.parametrize("row_id", list(ROWS))
def test_capabilities_from_device_profile(row_id: str) -> None:
    row = ROWS[row_id]
    declared = capabilities_from_device(row.profile)
    caps = effective(row.profile)

    assert use_managed_alloc(row.profile) is row.managed
    assert caps.unified_memory is row.unified
    # Host-addressable is exactly unified on ROCm (hipMalloc/hipMallocManaged memory).
    assert caps.device_memory_is_host_addressable is row.unified
    assert caps.host_memory_is_device_addressable is row.host_memory_device_addressable
    assert caps.vmm == row.vmm
    # The function declares the physical facts only; what needs code is left to vt.
    assert declared.model_fields_set & {*CODE, "supports_async_sampled_token_readback"} == set()
    # HIP always has real events, hipHostMalloc and hipMemcpyAsync D2H: async readback is
    # safe on every row, through host access or through the copy.
    assert caps.events and caps.pinned_host_memory and caps.async_d2h_copy and caps.graphs
    assert caps.supports_async_sampled_token_readback
    assert row.why in caps.source_of("unified_memory").detail


@pytest.mark.parametrize("row_id", list(ROWS))
def test_every_profile_passes_the_registry_rules(row_id: str) -> None:
    assert rules.check(RocmBackend, effective(ROWS[row_id].profile)) == []


def test_provenance_is_derived_and_names_the_attributes() -> None:
    caps = effective(ROWS["gfx1151-windows"].profile)
    for field in ("unified_memory", "device_memory_is_host_addressable", "vmm", *CODE):
        assert caps.source_of(field).source is Source.derived
    assert caps.source_of("events").detail == "implements vt.Events"
    assert caps.source_of("graphs").detail == "implements vt.Graphs"
    unified = caps.source_of("unified_memory").detail
    for attr in ("Integrated=1", "ManagedMemory=0", "ConcurrentManagedAccess=0"):
        assert f"hipDeviceAttribute{attr}" in unified
    assert "hipDeviceAttributePageableMemoryAccess=0" in unified
    vmm = caps.source_of("vmm").detail
    assert "hipDeviceAttributeVirtualMemoryManagementSupported=1" in vmm
    assert "map the full reservation once" in vmm
    assert "hipMalloc memory" in caps.source_of("device_memory_is_host_addressable").detail


def test_async_readback_is_derived_on_discrete_devices_and_apus() -> None:
    # The discrete device reads the ids back by an async D2H copy, the APU through host
    # access: the derivation needs one of the two, and events and pinned memory.
    for row_id in ("gfx1100-windows", "mi300a-linux"):
        caps = effective(ROWS[row_id].profile)
        readback = caps.source_of("supports_async_sampled_token_readback")
        assert caps.supports_async_sampled_token_readback
        assert readback.source is Source.derived and readback.detail.startswith("has events")


def test_vmm_supported_without_granularity_gives_no_vmm() -> None:
    profile = ROWS["gfx1201-linux"].profile.model_copy(update={"vmm_granularity": 0})
    caps = capabilities_from_device(profile)
    assert caps.vmm is None
    assert "no allocation granularity" in caps.source_of("vmm").detail


def test_same_device_aliases_only_on_windows() -> None:
    linux = ROWS["gfx1100-windows"].profile.model_copy(update={"platform": "linux"})
    assert capabilities_from_device(linux).vmm == VmmCaps(granularity=65536)


@pytest.mark.parametrize(
    ("update", "fragment"),
    [
        ({"platform": "macos"}, "platform"),
        ({"vmm_granularity": -1}, "vmm_granularity"),
        ({"integrated": "maybe"}, "integrated"),
    ],
)
def test_device_profile_rejects_bad_facts(update: dict[str, object], fragment: str) -> None:
    data = ROWS["gfx1201-linux"].profile.model_dump() | update
    with pytest.raises(ValidationError, match=fragment):
        DeviceProfile.model_validate(data)


def test_device_profile_requires_every_attribute() -> None:
    with pytest.raises(ValidationError, match="pageable_memory_access"):
        DeviceProfile(
            gcn_arch_name="gfx1100",
            platform="linux",
            integrated=False,
            managed_memory=False,
            concurrent_managed_access=False,
            vmm_supported=False,
        )  # type: ignore[call-arg]
