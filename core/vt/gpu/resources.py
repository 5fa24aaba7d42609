"""GpuResources: ``vt.Backend``'s memory, stream, event, graph and virtual-memory hooks over
a :class:`GpuRuntime` (``GpuBackend``'s plumbing: no kernels). Device pointers are plain
ints (``Buffer.handle``), so ``Buffer.offset`` is pointer arithmetic."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..errors import VmmError
from ..protocol.backend import Buffer, Event, Graph, HostBuffer, Segment, Stream, VirtualRange
from .runtime import GpuCallError, GpuRuntime, host_array


@dataclass(eq=False)
class _GpuGraph:
    """What ``Graph.handle`` holds: the executable graph (its source graph is destroyed)."""

    exec: Any
    destroyed: bool = False


@dataclass(eq=False)
class _Reservation:
    """The state behind a VirtualRange: its base address and mapped segments."""

    base: int
    segments: list[Segment] = field(default_factory=list)
    unmapped: list[Segment] = field(default_factory=list)  # unmapped, release failed
    released: bool = False
    nbytes: int = 0  # the reservation's size

    def unmapped_bytes(self) -> int:
        """Bytes of the reservation no segment maps yet (what growth may still claim)."""
        return 0 if self.released else max(0, self.nbytes - sum(s.nbytes for s in self.segments))

    def mapped_prefix(self) -> int:
        """End of the run of segments that starts at offset 0 without gaps."""
        end = 0
        for seg in sorted(self.segments, key=lambda s: s.offset):
            if seg.offset != end:
                break
            end += seg.nbytes
        return end


class GpuResources:
    """The hooks behind alloc, copies, streams, events, graphs and VMM: each one runtime
    call (or a few, for a VMM map's access). A ``GpuBackend`` base; it keeps ``_rt``."""

    name: ClassVar[str]
    _rt: GpuRuntime
    _granularity: int | None
    _reservations: list[_Reservation]

    # ---- memory
    @staticmethod
    def _addr(buf: Buffer) -> int:
        return int(buf.handle) + buf.offset

    def _alloc(self, nbytes: int) -> Buffer:
        return Buffer(int(self._rt.malloc(nbytes)), nbytes, owner=self.name)

    def _free(self, buf: Buffer) -> None:
        if buf.offset:  # the runtime frees allocations, not addresses inside them
            raise ValueError("free() takes the buffer alloc() returned, not a view of it")
        self._rt.free(int(buf.handle))

    def _memset(self, buf: Buffer, value: int, stream: Stream | None) -> None:
        handle = None if stream is None else stream.handle
        self._rt.memset(self._addr(buf), value, buf.nbytes, handle)

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        self._rt.memcpy_h2d(self._addr(dst), int(src.ctypes.data), src.nbytes)

    def _copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        self._rt.memcpy_d2h(int(dst.ctypes.data), self._addr(src), dst.nbytes)

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        # ``src`` views the caller's memory, which must live until the stream reads it.
        self._rt.memcpy_h2d(self._addr(dst), int(src.ctypes.data), src.nbytes, stream.handle)

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        ptr = int(dst.array.ctypes.data)
        self._rt.memcpy_d2h(ptr, self._addr(src), dst.nbytes, stream.handle)

    def _copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        self._rt.memcpy_d2d(self._addr(dst), self._addr(src), nbytes, stream.handle)

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        ptr, array = self._rt.host_alloc(nbytes)
        return HostBuffer(array, handle=int(ptr), pinned=True)

    def _free_pinned(self, buf: HostBuffer) -> None:
        if buf.pinned and buf.handle is not None:
            self._rt.host_free(buf.handle)
            buf.handle = None  # a second free is a no-op, not a double free

    def _host_view(self, buf: Buffer) -> np.ndarray:
        # Reached only where the effective capability says the host may dereference it.
        return host_array(self._addr(buf), buf.nbytes)

    # ---- streams and events
    def _create_stream(self, name: str) -> Stream:
        return Stream(self._rt.stream_create(), name)

    def _destroy_stream(self, stream: Stream) -> None:
        self._rt.stream_destroy(stream.handle)

    def _synchronize(self, stream: Stream) -> None:
        self._rt.stream_synchronize(stream.handle)

    def _create_event(self) -> Event:
        return Event(self._rt.event_create())

    def _destroy_event(self, event: Event) -> None:
        self._rt.event_destroy(event.handle)

    def _record_event(self, event: Event, stream: Stream) -> None:
        self._rt.event_record(event.handle, stream.handle)

    def _query_event(self, event: Event) -> bool:
        return self._rt.event_query(event.handle)

    def _synchronize_event(self, event: Event) -> None:
        self._rt.event_synchronize(event.handle)

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        self._rt.stream_wait_event(stream.handle, event.handle)

    # ---- graphs: stream capture, instantiated at once; the source graph is not kept
    def _begin_capture(self, stream: Stream) -> None:
        self._rt.graph_begin_capture(stream.handle)

    def _end_capture(self, stream: Stream) -> Graph:
        graph = self._rt.graph_end_capture(stream.handle)
        try:
            graph_exec = self._rt.graph_instantiate(graph)
        finally:
            self._rt.graph_destroy(graph)  # an executable graph does not need its source
        return Graph(_GpuGraph(graph_exec), stream.name)

    def _gpu_graph(self, graph: Graph) -> _GpuGraph:
        g = graph.handle
        if not isinstance(g, _GpuGraph):
            raise ValueError(f"graph is not a graph of the {self.name} backend")
        if g.destroyed:
            raise ValueError(f"graph captured on {graph.name!r} was destroyed")
        return g

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        self._rt.graph_launch(self._gpu_graph(graph).exec, stream.handle)

    def _destroy_graph(self, graph: Graph) -> None:
        g = self._gpu_graph(graph)
        g.destroyed = True  # in-flight replays finish; the runtime frees it after them
        self._rt.graph_exec_destroy(g.exec)

    # ---- virtual memory
    def _vmm_granularity(self) -> int:
        if self._granularity is None:
            self._granularity = int(self._rt.vmm_granularity())
        return self._granularity

    def _check_multiple(self, what: str, nbytes: int, allow_zero: bool = False) -> int:
        g = self._vmm_granularity()
        if nbytes % g or (nbytes == 0 and not allow_zero):
            kind = "a multiple" if allow_zero else "a non-zero multiple"
            raise VmmError(f"{what} of {nbytes} bytes must be {kind} of granularity {g}")
        return g

    def _vmm_reserve(self, nbytes: int) -> VirtualRange:
        self._check_multiple("reservation", nbytes)
        res = _Reservation(int(self._rt.vmm_reserve(nbytes)), nbytes=nbytes)
        self._reservations = [r for r in self._reservations if not r.released] + [res]
        return VirtualRange(res, nbytes)

    def _reservation(self, vrange: VirtualRange) -> _Reservation:
        res = vrange.handle
        if not isinstance(res, _Reservation):
            raise VmmError(f"not a reservation of the {self.name} backend")
        if res.released:
            raise VmmError("the reservation was already released")
        return res

    def _vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        res = self._reservation(vrange)
        self._check_multiple("segment", nbytes)
        self._check_multiple("segment offset", offset, allow_zero=True)
        if offset + nbytes > vrange.nbytes:
            raise VmmError(
                f"segment would exceed reserve: {offset} + {nbytes} > {vrange.nbytes} bytes"
            )
        for seg in res.segments:
            if offset < seg.offset + seg.nbytes and seg.offset < offset + nbytes:
                raise VmmError(
                    f"segment [{offset}, {offset + nbytes}) overlaps the mapped segment "
                    f"[{seg.offset}, {seg.offset + seg.nbytes})"
                )
        handle = self._rt.vmm_create(nbytes)
        try:
            self._rt.vmm_map(res.base + offset, nbytes, handle)
        except GpuCallError:
            with contextlib.suppress(GpuCallError):  # the map failure is the error to report
                self._rt.vmm_release(handle)
            raise
        segment = Segment(handle, offset, nbytes)
        res.segments.append(segment)
        # Access is set over the whole mapped prefix, not just the new segment (as the
        # original engine did on ROCm); a segment past a gap gets access on its own.
        prefix = res.mapped_prefix()
        start, size = (0, prefix) if offset + nbytes <= prefix else (offset, nbytes)
        try:
            self._rt.vmm_set_access(res.base + start, size)
        except GpuCallError:
            with contextlib.suppress(GpuCallError):
                self._vmm_unmap(vrange, segment)
            if segment in res.unmapped:
                # Its release failed, and the caller never sees this segment to retry it:
                # forget it (leaking the physical memory) so the reservation can be freed.
                res.unmapped.remove(segment)
                res.segments.remove(segment)
            raise
        return segment

    def _vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        res = self._reservation(vrange)
        if segment not in res.segments:
            raise VmmError(
                f"segment [{segment.offset}, {segment.offset + segment.nbytes}) "
                "is not mapped in this reservation"
            )
        if segment not in res.unmapped:  # a retry after a failed release only releases
            self._rt.vmm_unmap(res.base + segment.offset, segment.nbytes)
            res.unmapped.append(segment)
        self._rt.vmm_release(segment.handle)
        # Forget the segment only now, so the arena's retry of a failed release finds it.
        res.unmapped.remove(segment)
        res.segments.remove(segment)

    def _vmm_release(self, vrange: VirtualRange) -> None:
        res = vrange.handle
        if isinstance(res, _Reservation) and res.released:
            return
        res = self._reservation(vrange)
        if res.segments:
            raise VmmError(
                f"unmap the {len(res.segments)} mapped segment(s) before releasing the reservation"
            )
        self._rt.vmm_address_free(res.base, vrange.nbytes)
        res.released = True

    def _vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        return Buffer(self._reservation(vrange).base, vrange.nbytes, owner=self.name)
