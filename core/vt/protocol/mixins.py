"""Optional capability mixins, and the one place capabilities are derived.

A backend class inherits the mixin of each capability it has code for and implements the
mixin's hooks; a hook left as the base version makes the class's claim a lie, and rule
``declared-without-implementation`` rejects it. :func:`derive_capabilities` turns what the
class implements and what its probe declares into capabilities, with provenance.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import Backend
from .capabilities import BOOL_FIELDS, Capabilities, Source
from .handles import Buffer, Event, Graph, HostBuffer, Segment, Stream, VirtualRange


class HostAddressable:
    """The host may dereference device memory: implement ``_host_view``."""

    def _host_view(self, buf: Buffer) -> np.ndarray:
        raise NotImplementedError


class Events:
    """Real events: implement the six ``_*event`` hooks."""

    def _create_event(self) -> Event:
        raise NotImplementedError

    def _destroy_event(self, event: Event) -> None:
        raise NotImplementedError

    def _record_event(self, event: Event, stream: Stream) -> None:
        raise NotImplementedError

    def _query_event(self, event: Event) -> bool:
        raise NotImplementedError

    def _synchronize_event(self, event: Event) -> None:
        raise NotImplementedError

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        raise NotImplementedError


class PinnedHostMemory:
    """Page-locked host memory: implement ``_alloc_pinned`` and ``_free_pinned``."""

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        raise NotImplementedError

    def _free_pinned(self, buf: HostBuffer) -> None:
        raise NotImplementedError


class AsyncD2HCopy:
    """Device-to-host copies that run on a stream: implement ``_copy_d2h_async``."""

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        raise NotImplementedError


class Graphs:
    """Capture a stream's work once and replay it: implement the four graph hooks."""

    def _begin_capture(self, stream: Stream) -> None:
        raise NotImplementedError

    def _end_capture(self, stream: Stream) -> Graph:
        raise NotImplementedError

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        raise NotImplementedError

    def _destroy_graph(self, graph: Graph) -> None:
        raise NotImplementedError


class VirtualMemory:
    """Reserve, map and unmap device virtual memory: implement the six ``_vmm_*`` hooks.
    The granularity and aliasing are physical facts the probe declares (``vmm``)."""

    def _vmm_granularity(self) -> int:
        raise NotImplementedError

    def _vmm_reserve(self, nbytes: int) -> VirtualRange:
        raise NotImplementedError

    def _vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        raise NotImplementedError

    def _vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        raise NotImplementedError

    def _vmm_release(self, vrange: VirtualRange) -> None:
        raise NotImplementedError

    def _vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        raise NotImplementedError


#: Capability -> (mixin, hooks it needs). The capabilities that need code.
IMPLEMENTATION: dict[str, tuple[type, tuple[str, ...]]] = {
    "device_memory_is_host_addressable": (HostAddressable, ("_host_view",)),
    "events": (
        Events,
        (
            "_create_event",
            "_destroy_event",
            "_record_event",
            "_query_event",
            "_synchronize_event",
            "_stream_wait_event",
        ),
    ),
    "pinned_host_memory": (PinnedHostMemory, ("_alloc_pinned", "_free_pinned")),
    "async_d2h_copy": (AsyncD2HCopy, ("_copy_d2h_async",)),
    "graphs": (Graphs, ("_begin_capture", "_end_capture", "_launch_graph", "_destroy_graph")),
    "vmm": (
        VirtualMemory,
        (
            "_vmm_granularity",
            "_vmm_reserve",
            "_vmm_map",
            "_vmm_unmap",
            "_vmm_release",
            "_vmm_buffer",
        ),
    ),
}

#: Physical facts: only the declaration can say them.
PHYSICAL: tuple[str, ...] = (
    "unified_memory",
    "device_memory_is_host_addressable",
    "host_memory_is_device_addressable",
    "vmm",
)


def unimplemented(cls: type, capability: str) -> list[str]:
    """What ``cls`` lacks to back ``capability``: the mixin, or hooks left unimplemented."""
    mixin, hooks = IMPLEMENTATION[capability]
    if not issubclass(cls, mixin):
        return [f"vt.{mixin.__name__}"]
    return [h for h in hooks if _inherited_from(cls, h) in (mixin, Backend)]


def implements(cls: type, capability: str) -> bool:
    return not unimplemented(cls, capability)


def _inherited_from(cls: type, attr: str) -> type | None:
    for klass in cls.__mro__:
        if attr in klass.__dict__:
            return klass
    return None


def derive_capabilities(cls: type, declared: Capabilities) -> Capabilities:
    """The capabilities of backend class ``cls`` whose probe declared ``declared``.

    A capability that needs code is what the class implements, unless the declaration
    sets it explicitly (False where the device lacks it; True is kept, and the rules
    reject it if the code is missing). ``supports_async_sampled_token_readback`` follows
    from the others unless declared. Physical facts are taken as declared.
    """
    caps = declared
    explicit = declared.model_fields_set
    for field in BOOL_FIELDS:
        if field in explicit or field == "supports_async_sampled_token_readback":
            continue
        if field in IMPLEMENTATION and field not in PHYSICAL:
            mixin = IMPLEMENTATION[field][0].__name__
            if implements(cls, field):
                caps = caps.with_value(field, True, Source.derived, f"implements vt.{mixin}")
            else:
                caps = caps.with_value(
                    field, False, Source.derived, f"does not implement vt.{mixin}"
                )
    if "supports_async_sampled_token_readback" not in explicit:
        path = caps.device_memory_is_host_addressable or caps.async_d2h_copy
        value = caps.events and caps.pinned_host_memory and path
        detail = "events, pinned host memory and (host-addressable memory or async D2H copy)"
        caps = caps.with_value(
            "supports_async_sampled_token_readback",
            bool(value),
            Source.derived,
            ("has " if value else "lacks one of: ") + detail,
        )
    return caps


def describe(cls: type) -> dict[str, Any]:
    """Which capability mixins ``cls`` implements (for ``vt backends --json``)."""
    return {cap: implements(cls, cap) for cap in IMPLEMENTATION}
