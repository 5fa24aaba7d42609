"""The CUDA capability function on a table of device profiles.

Each row is what ``cuDeviceGetAttribute`` reports for that device and why the capabilities
follow. The H200 row was read on this workplace's H200 (plugins/cuda/tests/gpu_checks.py
writes it); the others are as NVIDIA documents those parts, and one row is built to reach
a branch (marked). The function declares physical facts; the effective capabilities are what
vt derives from them and the mixins CudaBackend implements
(:func:`vt.protocol.mixins.derive_capabilities`), as the registry does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError
from vt import Capabilities, Source, VmmCaps
from vt.management import rules
from vt.protocol.mixins import derive_capabilities
from vt_cuda.backend import CudaBackend
from vt_cuda.caps import DeviceProfile, capabilities_from_device, use_managed_alloc

MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    profile: DeviceProfile
    managed: bool
    unified: bool
    host_addressable: bool
    host_memory_device_addressable: bool
    vmm: VmmCaps | None


def _p(name: str, cc: tuple[int, int], **flags: object) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        platform=flags.pop("platform", "linux"),  # type: ignore[arg-type]
        compute_capability_major=cc[0],
        compute_capability_minor=cc[1],
        **flags,  # type: ignore[arg-type]
    )


DISCRETE = {
    "integrated": False,
    "managed_memory": True,
    "concurrent_managed_access": True,
    "pageable_memory_access": False,
    "vmm_supported": True,
    "vmm_granularity": 2 * MIB,
}

ROWS: dict[str, Row] = {
    # Read on this workplace's H200 (driver 580, CUDA 13.0): a discrete part. cuMemAlloc
    # memory is its own, so the host may not dereference it; sampled ids come back through
    # pinned memory and an async D2H copy. VMM with a 2 MiB granularity, no aliasing.
    "h200-linux": Row(
        _p("NVIDIA H200", (9, 0), **DISCRETE, total_memory=150109880320, driver_version=13000),
        managed=False,
        unified=False,
        host_addressable=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # H100 SXM on a kernel with HMM (open kernel modules): pageable memory access 1 lets a
    # kernel read malloc'ed host memory; nothing else changes.
    "h100-linux-hmm": Row(
        _p("NVIDIA H100 80GB HBM3", (9, 0), **{**DISCRETE, "pageable_memory_access": True}),
        managed=False,
        unified=False,
        host_addressable=False,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # GH200: Grace and Hopper memories are coherent over NVLink-C2C and the GPU walks the
    # CPU's page tables (ATS), so host memory is device-addressable. They are two memories,
    # not one (not unified), and the CPU must still not load cudaMalloc memory.
    "gh200-linux": Row(
        _p(
            "NVIDIA GH200 480GB",
            (9, 0),
            **{
                **DISCRETE,
                "pageable_memory_access": True,
                "pageable_memory_access_uses_host_page_tables": True,
            },
        ),
        managed=False,
        unified=False,
        host_addressable=False,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # Jetson AGX Orin: one LPDDR5 memory (unified) but concurrent managed access 0, so the
    # host may not touch managed memory while kernels run: plain cuMemAlloc, which the host
    # may not dereference. The unified part that refuses host loads of cudaMalloc memory.
    "jetson-orin": Row(
        _p(
            "Orin",
            (8, 7),
            integrated=True,
            managed_memory=True,
            concurrent_managed_access=False,
            pageable_memory_access=False,
            vmm_supported=True,
            vmm_granularity=2 * MIB,
        ),
        managed=False,
        unified=True,
        host_addressable=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # Built to reach the managed branch: an integrated part whose driver allows concurrent
    # managed access (as DGX Spark's GB10 reports) allocates managed memory, which the host
    # may dereference; pageable access 1 makes host memory device-addressable too.
    "integrated-concurrent (built)": Row(
        _p(
            "NVIDIA GB10",
            (12, 1),
            integrated=True,
            managed_memory=True,
            concurrent_managed_access=True,
            pageable_memory_access=True,
            pageable_memory_access_uses_host_page_tables=True,
            vmm_supported=True,
            vmm_granularity=2 * MIB,
        ),
        managed=True,
        unified=True,
        host_addressable=True,
        host_memory_device_addressable=True,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # RTX 4090 under Windows (WDDM): no concurrent managed access, no pageable access.
    "rtx4090-windows": Row(
        _p(
            "NVIDIA GeForce RTX 4090",
            (8, 9),
            **{**DISCRETE, "concurrent_managed_access": False, "platform": "windows"},
        ),
        managed=False,
        unified=False,
        host_addressable=False,
        host_memory_device_addressable=False,
        vmm=VmmCaps(granularity=2 * MIB),
    ),
    # A device whose driver reports no VMM: no vmm capability, the KV cache is contiguous.
    "no-vmm": Row(
        _p("Tesla P4", (6, 1), **{**DISCRETE, "vmm_supported": False, "vmm_granularity": 0}),
        managed=False,
        unified=False,
        host_addressable=False,
        host_memory_device_addressable=False,
        vmm=None,
    ),
}


#: Capabilities that need code: derived from the mixins, never declared for a CUDA device.
CODE = ("events", "pinned_host_memory", "async_d2h_copy", "graphs")


def effective(profile: DeviceProfile) -> Capabilities:
    """What the registry makes of the declaration (without overrides)."""
    return derive_capabilities(CudaBackend, capabilities_from_device(profile))


@pytest.mark.parametrize("key", list(ROWS))
def test_capability_table(key: str) -> None:
    row = ROWS[key]
    declared = capabilities_from_device(row.profile)
    caps = effective(row.profile)
    assert use_managed_alloc(row.profile) is row.managed
    assert caps.unified_memory is row.unified
    assert caps.device_memory_is_host_addressable is row.host_addressable
    assert caps.host_memory_is_device_addressable is row.host_memory_device_addressable
    assert caps.vmm == row.vmm
    # The function declares the physical facts only; what needs code is left to vt.
    assert declared.model_fields_set & {*CODE, "supports_async_sampled_token_readback"} == set()
    # Every CUDA device has real events, pinned memory and async copies: async readback on,
    # through host_view where the memory is host-addressable, else an async D2H copy.
    assert caps.events and caps.pinned_host_memory and caps.async_d2h_copy and caps.graphs
    assert caps.supports_async_sampled_token_readback
    assert rules.check(CudaBackend, caps) == []
    for field in ("unified_memory", "device_memory_is_host_addressable", "vmm", *CODE):
        assert caps.source_of(field).source is Source.derived


def test_provenance_names_the_attributes() -> None:
    caps = capabilities_from_device(ROWS["gh200-linux"].profile)
    assert caps.source_of("unified_memory").detail == (
        "CU_DEVICE_ATTRIBUTE_INTEGRATED=0: device memory is its own"
    )
    assert (
        "cuMemAlloc memory on a discrete device"
        in caps.source_of("device_memory_is_host_addressable").detail
    )
    assert caps.source_of("host_memory_is_device_addressable").detail == (
        "CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS=1 (ATS, host page tables)"
    )
    hmm = capabilities_from_device(ROWS["h100-linux-hmm"].profile)
    assert hmm.source_of("host_memory_is_device_addressable").detail.endswith("(HMM)")
    orin = capabilities_from_device(ROWS["jetson-orin"].profile)
    assert (
        "which the host may not dereference"
        in orin.source_of("device_memory_is_host_addressable").detail
    )
    readback = effective(ROWS["jetson-orin"].profile).source_of(
        "supports_async_sampled_token_readback"
    )
    assert readback.source is Source.derived and readback.detail.startswith("has events")
    assert "2097152" in caps.source_of("vmm").detail


def test_vmm_without_a_granularity_is_no_vmm() -> None:
    profile = ROWS["h200-linux"].profile.model_copy(update={"vmm_granularity": 0})
    caps = capabilities_from_device(profile)
    assert caps.vmm is None
    assert "no allocation granularity was reported" in caps.source_of("vmm").detail


def test_arch_names_the_nvrtc_target() -> None:
    assert ROWS["h200-linux"].profile.arch == "sm_90"
    assert ROWS["jetson-orin"].profile.arch == "sm_87"


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"platform": "macos"}, "platform"),
        ({"vmm_granularity": -1}, "vmm_granularity"),
        ({"compute_capability_major": 0}, "compute_capability_major"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_profile_rejects_bad_values(update: dict[str, object], field: str) -> None:
    data = {**ROWS["h200-linux"].profile.model_dump(), **update}
    with pytest.raises(ValidationError, match=field):
        DeviceProfile.model_validate(data)
