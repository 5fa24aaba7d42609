"""The CPU backend: numba kernels over block weights on numpy memory, worker-thread streams,
real VMM."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import vt
from vt.reference import HostMemory

from . import anon, program, vmm
from .logprobs import LogprobsOp
from .ops import CpuOps
from .streams import CpuEvent, StreamError, WorkerStream
from .threads import ThreadOwner

DEFAULT_VMM_GRANULARITY = 2 << 20
GRANULARITY_ENV = "VT_CPU_VMM_GRANULARITY"


def _checked_granularity(value: int, source: str) -> int:
    if value <= 0 or value & (value - 1) or value % vmm.PAGE_SIZE:
        raise vt.VmmError(
            f"{source}: vmm granularity {value} must be a power of two and a multiple of the "
            f"page size {vmm.PAGE_SIZE}"
        )
    return value


def granularity_from_env(env: Mapping[str, str] | None = None) -> int:
    """``VT_CPU_VMM_GRANULARITY`` (bytes), or 2 MiB when unset."""
    raw = vt.envs.raw(GRANULARITY_ENV, env)
    if raw is None:
        return DEFAULT_VMM_GRANULARITY
    try:
        value = vt.envs.get(GRANULARITY_ENV, env)
    except ValueError:
        raise vt.VmmError(f"{GRANULARITY_ENV}={raw!r} is not a number of bytes") from None
    return _checked_granularity(value, f"{GRANULARITY_ENV}={raw.strip()}")


def cpu_capabilities(granularity: int = DEFAULT_VMM_GRANULARITY) -> vt.Capabilities:
    """The physical facts the CPU backend declares; no VMM where the OS lacks memfd_create.

    Events, pinned memory, async copies and graphs are derived from the mixins it implements.
    """
    return vt.Capabilities(
        unified_memory=True,
        device_memory_is_host_addressable=True,
        host_memory_is_device_addressable=True,
        vmm=vt.VmmCaps(granularity=granularity, segments_may_alias=False)
        if vmm.SUPPORTED
        else None,
    )


def _close_streams(streams: set[WorkerStream], lock: threading.Lock) -> None:
    with lock:
        closing = list(streams)
        streams.clear()
    for stream in closing:
        stream.close()


@dataclass(eq=False)
class _Reservation:
    base: int
    nbytes: int
    segments: dict[int, vt.Segment] = field(default_factory=dict)  # by offset
    released: bool = False
    array: np.ndarray | None = None


@dataclass(eq=False)
class _Graph:
    """A captured stream's work: its closures, replayed in order on launch."""

    ops: tuple[tuple[str, Callable[[], Any], bool], ...]
    destroyed: bool = False


@dataclass(eq=False)
class _Pinned:
    """Handle of an ``alloc_pinned`` buffer: its own anonymous mapping, mlock'ed if allowed."""

    mapping: mmap.mmap
    locked: bool


class CpuBackend(
    HostMemory,
    CpuOps,
    LogprobsOp,
    vt.HostAddressable,
    vt.Events,
    vt.PinnedHostMemory,
    vt.AsyncD2HCopy,
    vt.Graphs,
    vt.VirtualMemory,
):
    """numpy memory on the host; numba kernels over weights kept in their block formats.

    Ops (:mod:`vt_cpu.ops`): weights stay quantized (:mod:`vt_cpu.weights`), projections
    run numba matrix-vector kernels (decode) or BLAS on dequantized tiles (prefill), the
    fused ops are native; the ops without a kernel here run from :mod:`vt.reference`.
    Threads (:mod:`vt_cpu.threads`): one owner sizes numba's pool and holds BLAS to one
    thread; each kernel runs split over the pool or on its stream's thread alone, whichever
    is measured faster on the machine as it is.

    Memory is unified and host-addressable (a buffer's handle is its uint8 numpy array).
    Each stream is a worker thread (:mod:`vt_cpu.streams`); synchronous copies and memsets
    first wait for every stream to go idle, as a device's blocking copies do. VMM reserves
    address space with ``PROT_NONE`` and commits memfd-backed segments on map
    (:mod:`vt_cpu.vmm`). ``alloc_pinned`` returns a dedicated anonymous mapping and tries
    ``mlock``; when RLIMIT_MEMLOCK refuses, the memory is still returned (a host copy
    needs no page locking here) and ``handle.locked`` is False.
    """

    name = "cpu"
    priority = 10
    description = (
        "host CPU: numba kernels over quantized weights, worker-thread streams, real virtual memory"
    )

    def __init__(self) -> None:
        # The same source as probe(), so the instance and its declaration agree.
        self._granularity = granularity_from_env()
        self._streams: set[WorkerStream] = set()
        self._lock = threading.Lock()
        self.threads = ThreadOwner()
        # Stop the worker threads even when close() is forgotten.
        weakref.finalize(self, _close_streams, self._streams, self._lock)

    @classmethod
    def probe(cls) -> vt.Probe:
        g = granularity_from_env()
        return vt.Probe(
            available=True,
            capabilities=cpu_capabilities(g),
            device=f"host CPU ({os.cpu_count()} threads, numpy {np.__version__})",
            details={"vmm": "memfd segments" if vmm.SUPPORTED else "unsupported on this OS"},
        )

    def close(self) -> None:
        _close_streams(self._streams, self._lock)
        self.threads.close()

    # ---- memory
    def _alloc(self, nbytes: int) -> vt.Buffer:
        # A large buffer gets its own anonymous mapping (vt_cpu.anon): a 128-row step in
        # buffers for 256 rows touches half of it, and a freed one leaves no resident heap.
        return vt.Buffer(anon.zeros(nbytes), nbytes, 0, self.name)

    def _free(self, buf: vt.Buffer) -> None:
        self._mem(buf)  # memory returns to the allocator when the last view is dropped

    def _mem(self, buf: vt.Buffer) -> np.ndarray:
        if type(buf.handle) is not np.ndarray:
            raise ValueError(f"buffer of backend {buf.owner!r} is not a cpu buffer")
        return buf.handle

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return self._mem(buf)[buf.offset : buf.offset + buf.nbytes]

    def _bytes(self, buf: vt.Buffer) -> np.ndarray:
        return self._mem(buf)[buf.offset : buf.offset + buf.nbytes]

    def _alloc_pinned(self, nbytes: int) -> vt.HostBuffer:
        mapping = mmap.mmap(-1, max(nbytes, 1))
        array = np.frombuffer(mapping, dtype=np.uint8)[:nbytes]
        locked = vmm.lock(array.ctypes.data, nbytes)
        return vt.HostBuffer(array, handle=_Pinned(mapping, locked), pinned=True)

    def _free_pinned(self, buf: vt.HostBuffer) -> None:
        if isinstance(buf.handle, _Pinned) and buf.handle.locked:
            vmm.unlock(buf.array.ctypes.data, buf.nbytes)
            buf.handle.locked = False
        # The mapping is unmapped when its last numpy view is garbage-collected.

    def _before_sync(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.wait_idle()

    # ---- streams and events
    def _worker(self, stream: vt.Stream) -> WorkerStream:
        if not isinstance(stream.handle, WorkerStream):
            raise ValueError(f"stream {stream.name!r} is not a cpu stream")
        return stream.handle

    def enqueue_host(self, stream: vt.Stream, name: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on ``stream``'s worker thread, in order (like ``cudaLaunchHostFunc``)."""
        self._worker(stream).enqueue(name, fn)

    def _create_stream(self, name: str) -> vt.Stream:
        worker = WorkerStream(name or f"stream-{id(self):x}-{len(self._streams)}")
        with self._lock:
            self._streams.add(worker)
        return vt.Stream(worker, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        worker = self._worker(stream)
        try:
            worker.synchronize()
        finally:
            worker.close()
            with self._lock:
                self._streams.discard(worker)

    def _synchronize(self, stream: vt.Stream) -> None:
        self._worker(stream).synchronize()

    def _event(self, event: vt.Event) -> CpuEvent:
        if not isinstance(event.handle, CpuEvent):
            raise ValueError("event is not a cpu event")
        return event.handle

    def _create_event(self) -> vt.Event:
        return vt.Event(CpuEvent())

    def _destroy_event(self, event: vt.Event) -> None:
        self._event(event)

    def _not_capturing(self, worker: WorkerStream, op: str) -> WorkerStream:
        if worker.capturing:  # as on a GPU: a captured event could never be waited on
            raise StreamError(f"cpu stream {worker.name!r} is capturing a graph; {op} is refused")
        return worker

    def _record_event(self, event: vt.Event, stream: vt.Stream) -> None:
        self._event(event).record(self._not_capturing(self._worker(stream), "record_event"))

    def _query_event(self, event: vt.Event) -> bool:
        return self._event(event).query()

    def _synchronize_event(self, event: vt.Event) -> None:
        self._event(event).synchronize()

    def _stream_wait_event(self, stream: vt.Stream, event: vt.Event) -> None:
        worker = self._not_capturing(self._worker(stream), "stream_wait_event")
        self._event(event).wait_on(worker)

    # ---- graphs: a capture records the stream's closures; a launch enqueues them again.
    # The closures hold views of the buffers, not their contents, so a replay computes on
    # what the buffers hold when it runs, as a device graph does.
    def _begin_capture(self, stream: vt.Stream) -> None:
        self._worker(stream).begin_capture()

    def _end_capture(self, stream: vt.Stream) -> vt.Graph:
        ops = self._worker(stream).end_capture()
        if vt.envs.get("VT_CPU_PROGRAM"):
            ops = program.build(ops, self.threads)
        return vt.Graph(_Graph(tuple(ops)), stream.name)

    def _graph(self, graph: vt.Graph) -> _Graph:
        g = graph.handle
        if not isinstance(g, _Graph):
            raise ValueError("graph is not a cpu graph")
        if g.destroyed:
            raise ValueError(f"graph captured on {graph.name!r} was destroyed")
        return g

    def _launch_graph(self, graph: vt.Graph, stream: vt.Stream) -> None:
        # One queue item for the whole graph: the stream's thread runs the step's kernels
        # back to back, without a hand-off per kernel.
        self._worker(stream).enqueue_batch(self._graph(graph).ops)

    def _destroy_graph(self, graph: vt.Graph) -> None:
        g = self._graph(graph)
        g.ops, g.destroyed = (), True

    # ---- virtual memory
    def _vmm_granularity(self) -> int:
        if not vmm.SUPPORTED:
            raise vt.VmmError("cpu: virtual memory needs Linux memfd_create")
        return self._granularity

    def _check_multiple(self, what: str, value: int, positive: bool) -> None:
        g = self.vmm_granularity()
        if value < 0 or (positive and value == 0) or value % g:
            kind = "a positive" if positive else "a non-negative"
            raise vt.VmmError(f"{what} {value} is not {kind} multiple of the granularity {g}")

    def _reservation(self, vrange: vt.VirtualRange, op: str) -> _Reservation:
        r = vrange.handle
        if not isinstance(r, _Reservation):
            raise vt.VmmError(f"{op}: not a cpu virtual range")
        if r.released:
            raise vt.VmmError(f"{op}: the reservation of {r.nbytes} bytes was already released")
        return r

    def _vmm_reserve(self, nbytes: int) -> vt.VirtualRange:
        self._check_multiple("vmm_reserve: size", nbytes, positive=True)
        try:
            base = vmm.reserve(nbytes)
        except OSError as exc:
            raise vt.VmmError(f"vmm_reserve of {nbytes} bytes failed: {exc}") from exc
        return vt.VirtualRange(_Reservation(base, nbytes), nbytes)

    def _create_physical(self, nbytes: int) -> int:
        """A file descriptor of ``nbytes`` of fresh physical memory, owned by one segment.

        A test backend may override this (e.g. return ``os.dup`` of an earlier segment's
        descriptor) to make segments alias.
        """
        fd = os.memfd_create("vt-cpu-vmm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)  # sparse: pages are committed when first touched
        except OSError:
            os.close(fd)
            raise
        return fd

    def _map_physical(self, addr: int, nbytes: int, fd: int) -> None:
        """Map ``fd`` read-write over ``[addr, addr + nbytes)`` of a reservation."""
        vmm.map_fd(addr, nbytes, fd)

    def _release_physical(self, fd: int) -> None:
        os.close(fd)

    def _vmm_map(self, vrange: vt.VirtualRange, offset: int, nbytes: int) -> vt.Segment:
        r = self._reservation(vrange, "vmm_map")
        self._check_multiple("vmm_map: offset", offset, positive=False)
        self._check_multiple("vmm_map: size", nbytes, positive=True)
        end = offset + nbytes
        if end > r.nbytes:
            raise vt.VmmError(
                f"vmm_map: segment [{offset}, {end}) runs past the reservation of {r.nbytes} bytes"
            )
        for seg in r.segments.values():
            if offset < seg.offset + seg.nbytes and seg.offset < end:
                raise vt.VmmError(
                    f"vmm_map: segment [{offset}, {end}) overlaps the mapped segment "
                    f"[{seg.offset}, {seg.offset + seg.nbytes})"
                )
        try:
            fd = self._create_physical(nbytes)
        except OSError as exc:
            raise vt.VmmError(f"vmm_map: creating {nbytes} bytes failed: {exc}") from exc
        try:
            self._map_physical(r.base + offset, nbytes, fd)
        except OSError as exc:
            self._release_physical(fd)
            raise vt.VmmError(f"vmm_map: mapping [{offset}, {end}) failed: {exc}") from exc
        segment = vt.Segment(fd, offset, nbytes)
        r.segments[offset] = segment
        return segment

    def _vmm_unmap(self, vrange: vt.VirtualRange, segment: vt.Segment) -> None:
        r = self._reservation(vrange, "vmm_unmap")
        if r.segments.get(segment.offset) is not segment:
            raise vt.VmmError(
                f"vmm_unmap: no segment [{segment.offset}, {segment.offset + segment.nbytes}) "
                "is mapped in this reservation"
            )
        self._before_sync()  # queued kernels may still touch it; a fault would kill us
        vmm.decommit(r.base + segment.offset, segment.nbytes)
        del r.segments[segment.offset]
        self._release_physical(segment.handle)

    def _vmm_release(self, vrange: vt.VirtualRange) -> None:
        r = self._reservation(vrange, "vmm_release")
        if r.segments:
            raise vt.VmmError(
                f"vmm_release: {len(r.segments)} segment(s) are still mapped; unmap them first"
            )
        self._before_sync()
        vmm.release(r.base, r.nbytes)
        r.released, r.array = True, None

    def _vmm_buffer(self, vrange: vt.VirtualRange) -> vt.Buffer:
        """A buffer over the whole reservation; touching an unmapped byte is a SIGSEGV."""
        r = self._reservation(vrange, "vmm_buffer")
        if r.array is None:
            r.array = np.asarray(vmm.AddressArray(r.base, r.nbytes, owner=r))
        return vt.Buffer(r.array, r.nbytes, 0, self.name)

    def vmm_mapped_bytes(self, vrange: vt.VirtualRange) -> int:
        """Bytes of physical memory mapped into ``vrange``."""
        segments = self._reservation(vrange, "vmm_mapped_bytes").segments.values()
        return sum(s.nbytes for s in segments)
