"""What a backend's hardware can do, and where each answer came from.

A backend *declares* a :class:`Capabilities`; the registry turns it into the *effective*
one (environment overrides, downgrades) and records the provenance of every field.
See ``docs/capabilities.md`` for the story behind each field.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Capability fields that are plain booleans (``vmm`` is the one structured field).
BOOL_FIELDS: tuple[str, ...] = (
    "unified_memory",
    "device_memory_is_host_addressable",
    "host_memory_is_device_addressable",
    "supports_async_sampled_token_readback",
    "async_d2h_copy",
    "events",
    "pinned_host_memory",
    "graphs",
)
CAPABILITY_FIELDS: tuple[str, ...] = (*BOOL_FIELDS, "vmm")


class Source(str, Enum):
    """Where an effective capability value came from."""

    declared = "declared"
    derived = "derived"  # computed from device attributes by the plugin's capability function
    env = "env"  # overridden by VT_CAPS
    probed = "probed"  # proven (or disproven) by a runtime probe
    downgraded = "downgraded"  # turned off by vt, with the reason


class Provenance(BaseModel):
    """The origin of one capability value."""

    model_config = ConfigDict(frozen=True)

    source: Source = Source.declared
    detail: str = ""


class VmmCaps(BaseModel):
    """Device virtual-memory support (reserve / map / unmap)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    granularity: int = Field(description="allocation granularity in bytes")
    segments_may_alias: bool = Field(
        default=False,
        description="later mapped segments may alias earlier ones; policy: map the "
        "whole reservation once and never grow",
    )


class Capabilities(BaseModel):
    """A backend's capabilities. Frozen: derive a new one with :meth:`model_copy`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unified_memory: bool = Field(
        default=False, description="host and device share one physical memory"
    )
    device_memory_is_host_addressable: bool = Field(
        default=False,
        description="the host may dereference what alloc returns, with no copy and no map",
    )
    host_memory_is_device_addressable: bool = Field(
        default=False, description="a kernel may dereference ordinary host memory"
    )
    supports_async_sampled_token_readback: bool = Field(
        default=False,
        description="the runner may overlap the next step with reading back this step's ids",
    )
    async_d2h_copy: bool = Field(
        default=False,
        description="device-to-host copies can run asynchronously on a second stream",
    )
    events: bool = Field(default=False, description="real events (record/query/synchronize)")
    pinned_host_memory: bool = Field(
        default=False, description="alloc_pinned returns real page-locked host memory"
    )
    graphs: bool = Field(
        default=False,
        description="work enqueued on a stream can be captured once and replayed as a graph "
        "(begin_capture / end_capture / launch_graph / destroy_graph)",
    )
    vmm: VmmCaps | None = Field(default=None, description="virtual memory management, or None")
    provenance: dict[str, Provenance] = Field(default_factory=dict)

    @field_validator("provenance")
    @classmethod
    def _known_fields(cls, value: dict[str, Provenance]) -> dict[str, Provenance]:
        unknown = set(value) - set(CAPABILITY_FIELDS)
        if unknown:
            raise ValueError(f"provenance for unknown capabilities: {sorted(unknown)}")
        return value

    def source_of(self, field: str) -> Provenance:
        """The provenance of ``field`` (declared when nothing else was recorded)."""
        return self.provenance.get(field, Provenance())

    def with_value(self, field: str, value: object, source: Source, detail: str) -> Capabilities:
        """A copy with ``field`` set to ``value`` and its provenance recorded."""
        if field not in CAPABILITY_FIELDS:
            raise KeyError(f"unknown capability {field!r}")
        prov = dict(self.provenance)
        prov[field] = Provenance(source=source, detail=detail)
        data = self.model_dump(exclude={"provenance"})
        data[field] = value
        return Capabilities.model_validate({**data, "provenance": prov})

    def summary(self) -> dict[str, object]:
        """Plain values for display and JSON (no provenance)."""
        return self.model_dump(exclude={"provenance"})
