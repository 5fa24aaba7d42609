"""Backends for vt's own tests: a threaded one, a discrete one, and liars of each.

Imports only ``vt`` and numpy, like a third-party plugin. As a plugin module (entry point in
group ``vt``) it registers ``threads`` and ``discrete``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import vt
from vt import (
    Buffer,
    Capabilities,
    Event,
    Graph,
    HostBuffer,
    Segment,
    Stream,
    VirtualRange,
    VmmCaps,
)


def _bytes(buf: Buffer) -> np.ndarray:
    return buf.handle[buf.offset : buf.offset + buf.nbytes]


class _Worker:
    """One stream: a thread running its queue in order."""

    def __init__(self) -> None:
        self.capture: list[Callable[[], None]] | None = None  # recording a graph
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()

    def put(self, job: Callable[[], None]) -> None:
        if self.capture is not None:
            self.capture.append(job)
        else:
            self.jobs.put(job)

    def drain(self) -> None:
        done = threading.Event()
        self.put(done.set)
        done.wait()


class ThreadBackend(
    vt.Backend,
    vt.HostAddressable,
    vt.Events,
    vt.PinnedHostMemory,
    vt.AsyncD2HCopy,
    vt.Graphs,
    vt.VirtualMemory,
):
    """Unified, host-addressable memory; worker-thread streams; real events; vmm."""

    name = "threads"
    priority = 5
    description = "numpy with worker-thread streams (vt test backend)"

    @classmethod
    def probe(cls) -> vt.Probe:
        return vt.Probe(
            available=True,
            capabilities=Capabilities(
                unified_memory=True,
                device_memory_is_host_addressable=True,
                vmm=VmmCaps(granularity=64 << 10),
            ),
        )

    def _submit(self, stream: Stream | None, job: Callable[[], None]) -> None:
        if stream is None:
            job()
        else:
            stream.handle.put(job)

    def _alloc(self, nbytes: int) -> Buffer:
        return Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def _free(self, buf: Buffer) -> None:
        pass

    def _memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        self._submit(stream, lambda: _bytes(buf).fill(value))

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        raw = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
        _bytes(dst)[: raw.size] = raw

    def _copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        dst.reshape(-1).view(np.uint8)[:] = _bytes(src)[: dst.nbytes]

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        arr = src.array if isinstance(src, HostBuffer) else src
        self._submit(
            stream,
            lambda: self._copy_h2d(dst, np.ascontiguousarray(arr).reshape(-1).view(np.uint8)),
        )

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        self._submit(stream, lambda: self._copy_d2h(dst.array, src))

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.zeros(nbytes, np.uint8), pinned=True)

    def _host_view(self, buf: Buffer) -> np.ndarray:
        return _bytes(buf)

    def _begin_capture(self, stream: Stream) -> None:
        stream.handle.capture = []

    def _end_capture(self, stream: Stream) -> Graph:
        jobs, stream.handle.capture = stream.handle.capture, None
        return Graph(jobs, stream.name)

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        for job in graph.handle:
            stream.handle.put(job)

    def _destroy_graph(self, graph: Graph) -> None:
        graph.handle = []

    def _destroy_event(self, event: Event) -> None:
        pass

    def _free_pinned(self, buf: HostBuffer) -> None:
        pass

    def _create_stream(self, name: str = "") -> Stream:
        return Stream(_Worker(), name)

    def _destroy_stream(self, stream: Stream) -> None:
        stream.handle.put(None)
        stream.handle.thread.join()

    def _synchronize(self, stream: Stream) -> None:
        stream.handle.drain()

    def _create_event(self) -> Event:
        done = threading.Event()
        done.set()  # a never-recorded event is complete
        return Event({"done": done})

    def _record_event(self, event: Event, stream: Stream) -> None:
        done = threading.Event()  # a new object per record: earlier waits keep theirs
        event.handle["done"] = done
        stream.handle.put(done.set)

    def _query_event(self, event: Event) -> bool:
        return event.handle["done"].is_set()

    def _synchronize_event(self, event: Event) -> None:
        event.handle["done"].wait()

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        done = event.handle["done"]
        stream.handle.put(done.wait)

    def _vmm_granularity(self) -> int:
        return 64 << 10

    def _vmm_reserve(self, nbytes: int) -> VirtualRange:
        return VirtualRange({"array": np.zeros(nbytes, np.uint8), "segments": []}, nbytes)

    def _vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        g = self._vmm_granularity()
        if offset % g or nbytes % g or nbytes <= 0 or offset + nbytes > vrange.nbytes:
            raise vt.VmmError(f"bad mapping [{offset}, {offset + nbytes}) of {vrange.nbytes}")
        seg = Segment(None, offset, nbytes)
        vrange.handle["segments"].append(seg)
        return seg

    def _vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        vrange.handle["segments"].remove(segment)

    def _vmm_release(self, vrange: VirtualRange) -> None:
        if vrange.handle["segments"]:
            raise vt.VmmError("release with segments still mapped")

    def _vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        return Buffer(vrange.handle["array"], vrange.nbytes, owner=self.name)


class DiscreteBackend(vt.Backend):
    """Opaque buffers, synchronous, no host access: the tt_stub shape."""

    name = "discrete"
    priority = 1
    description = "synchronous discrete-device stand-in (vt test backend)"

    def _alloc(self, nbytes: int) -> Buffer:
        return Buffer(bytearray(nbytes), nbytes, owner=self.name)

    def _free(self, buf: Buffer) -> None:
        pass

    def _view(self, buf: Buffer) -> np.ndarray:
        return np.frombuffer(buf.handle, np.uint8)[buf.offset : buf.offset + buf.nbytes]

    def _memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        self._view(buf).fill(value)

    def _copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        raw = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
        self._view(dst)[: raw.size] = raw

    def _copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        dst.reshape(-1).view(np.uint8)[:] = self._view(src)[: dst.nbytes]

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        self._copy_h2d(dst, src)

    def _create_stream(self, name: str = "") -> Stream:
        return Stream(None, name)

    def _destroy_stream(self, stream: Stream) -> None:
        pass

    def _synchronize(self, stream: Stream) -> None:
        pass


class SyncEventsBackend(DiscreteBackend, vt.Events, vt.PinnedHostMemory, vt.AsyncD2HCopy):
    """Synchronous, yet honest about events and async copies: everything is done at once."""

    name = "sync-events"

    def _copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        self._copy_d2h(dst.array, src)

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.zeros(nbytes, np.uint8), pinned=True)

    def _create_event(self) -> Event:
        return Event("sync")

    def _record_event(self, event: Event, stream: Stream) -> None:
        pass  # the work before it has already run

    def _query_event(self, event: Event) -> bool:
        return True

    def _synchronize_event(self, event: Event) -> None:
        pass

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        pass

    def _destroy_event(self, event: Event) -> None:
        pass

    def _free_pinned(self, buf: HostBuffer) -> None:
        pass


class FakeEventsBackend(ThreadBackend):
    """Declares events, but its events are complete at once: the probe must catch it."""

    name = "fake-events"

    def _record_event(self, event: Event, stream: Stream) -> None:
        pass

    def _synchronize_event(self, event: Event) -> None:
        pass

    def _stream_wait_event(self, stream: Stream, event: Event) -> None:
        pass


class LeakyDiscreteBackend(DiscreteBackend):
    """Says device memory is not host-addressable, yet host_view hands it out."""

    name = "leaky"

    def host_view(self, buf: Buffer) -> np.ndarray:
        return self._view(buf)


class FakePinnedBackend(ThreadBackend):
    """Declares pinned memory but returns pageable buffers."""

    name = "fake-pinned"

    def _alloc_pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.zeros(nbytes, np.uint8), pinned=False)


class EagerGraphBackend(ThreadBackend):
    """Declares graphs, but "captured" work runs at once and a launch does nothing."""

    name = "eager-graphs"

    def _begin_capture(self, stream: Stream) -> None:
        pass

    def _end_capture(self, stream: Stream) -> Graph:
        return Graph(None, stream.name)

    def _launch_graph(self, graph: Graph, stream: Stream) -> None:
        pass


class StaleGraphBackend(ThreadBackend):
    """Declares graphs, but a replay writes back what the copies read at capture."""

    name = "stale-graphs"

    def _copy_h2d_async(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        if stream.handle.capture is None:
            super()._copy_h2d_async(dst, src, stream)
            return
        snapshot = (src.array if isinstance(src, HostBuffer) else src).copy()
        self._submit(stream, lambda: self._copy_h2d(dst, snapshot))


@vt.hookimpl
def vt_register_backends(register: Callable[[type], None]) -> None:
    register(ThreadBackend)
    register(DiscreteBackend)
