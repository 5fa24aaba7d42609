"""The probes of the required core and of each capability but VMM
(:mod:`vt.management.probes.vmm`)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import NamedTuple

import numpy as np

from ...errors import HostAccessError
from ...protocol.backend import Backend, Buffer, Graph, HostBuffer, Stream
from .base import (
    POISON,
    WORK_BYTES,
    WORK_ROUNDS,
    Check,
    ProbeFailed,
    busy,
    check,
    device_buffer,
    first_diff,
    new_event,
    new_stream,
    pattern,
    pinned_buffer,
    read,
    run_probe,
)

# --------------------------------------------------------------------------- probes


def probe_memory(backend: Backend) -> list[Check]:
    """alloc/copy_h2d/copy_d2h/memset round-trip, including a sub-range view."""

    def body() -> str:
        n = 64 << 10
        with device_buffer(backend, n) as buf:
            data = pattern(n, 1)
            backend.copy_h2d(buf, data)
            got = np.empty(n, np.uint8)
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(f"copy_h2d then copy_d2h differ: {first_diff(got, data)}")
            part = pattern(4096, 2)
            backend.copy_h2d(buf.view(8192, 4096), part)
            data[8192 : 8192 + 4096] = part
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(
                    f"a copy into buf.view(8192, 4096) landed wrong: {first_diff(got, data)}"
                )
            backend.memset(buf.view(4096, 4096), 0x5A)
            data[4096:8192] = 0x5A
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(f"memset of a view landed wrong: {first_diff(got, data)}")
        return f"{n} bytes round-trip through copy_h2d/copy_d2h; views and memset honour offsets"

    return [run_probe("memory-roundtrip", body)]


def probe_host_view(backend: Backend) -> list[Check]:
    """Host-addressable: host_view round-trips both ways. Otherwise: host_view must raise."""
    if not backend.capabilities.device_memory_is_host_addressable:

        def refused() -> str:
            with device_buffer(backend, 4096) as buf:
                try:
                    backend.host_view(buf)
                except HostAccessError as exc:
                    return f"host_view raised HostAccessError: {exc}"
            raise ProbeFailed(
                "host_view returned memory although device_memory_is_host_addressable is "
                "False; it must raise vt.HostAccessError"
            )

        return [run_probe("host-view-refused", refused)]

    def roundtrip() -> str:
        n = 16 << 10
        with device_buffer(backend, n) as buf:
            view = backend.host_view(buf)
            if not isinstance(view, np.ndarray) or view.dtype != np.uint8 or view.size != n:
                raise ProbeFailed(
                    f"host_view returned {type(view).__name__} "
                    f"{getattr(view, 'dtype', '')} of size {getattr(view, 'size', '?')}"
                    f"; expected a uint8 array of {n} bytes"
                )
            data = pattern(n, 3)
            view[:] = data
            got = np.empty(n, np.uint8)
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(
                    f"written via host_view, read via copy_d2h: {first_diff(got, data)}"
                )
            data = pattern(n, 4)
            backend.copy_h2d(buf, data)
            seen = np.array(backend.host_view(buf), copy=True)
            if not np.array_equal(seen, data):
                raise ProbeFailed(
                    f"written via copy_h2d, read via host_view: {first_diff(seen, data)}"
                )
            sub = backend.host_view(buf.view(4096, 1024))
            if sub.size != 1024 or not np.array_equal(sub, data[4096:5120]):
                raise ProbeFailed("host_view(buf.view(4096, 1024)) does not show bytes 4096..5120")
        return "host_view writes are seen by copy_d2h and copy_h2d writes by host_view (views too)"

    return [run_probe("host-view-roundtrip", roundtrip)]


def probe_events(backend: Backend) -> list[Check]:
    """Events order work: pending after long work, complete and visible after synchronize."""
    if not backend.capabilities.events:
        reason = "events not declared: the runner synchronizes whole streams instead"
        return [check("event-ordering", "skip", reason), check("stream-wait-event", "skip", reason)]

    def ordering() -> str:
        with (
            device_buffer(backend, WORK_BYTES) as work,
            device_buffer(backend, 4096) as flag,
            new_stream(backend, "vt-audit") as stream,
            new_event(backend) as event,
        ):
            for rounds in WORK_ROUNDS:
                backend.memset(flag, 0)
                start = time.perf_counter()
                busy(backend, work, stream, rounds)
                backend.memset(flag, 0xA5, stream)
                backend.record_event(event, stream)
                pending = not backend.query_event(event)
                backend.synchronize_event(event)
                ms = (time.perf_counter() - start) * 1e3
                if not backend.query_event(event):
                    raise ProbeFailed("query_event is False after synchronize_event")
                if not (read(backend, flag, as_runner=True) == 0xA5).all():
                    raise ProbeFailed(
                        "work recorded before the event had not finished after "
                        "synchronize_event returned"
                    )
                if pending:
                    return (
                        f"pending right after record_event behind {rounds} memsets of "
                        f"{WORK_BYTES >> 20} MiB ({ms:.0f} ms), complete after "
                        "synchronize_event with the work before it visible"
                    )
        return (
            f"complete after synchronize_event with the work before it visible; the pending "
            f"state was never observable (even {WORK_ROUNDS[-1]} memsets of "
            f"{WORK_BYTES >> 20} MiB finished before query_event)"
        )

    def wait() -> str:
        with (
            device_buffer(backend, WORK_BYTES) as work,
            device_buffer(backend, 4096) as cell,
            new_stream(backend, "vt-audit-1") as first,
            new_stream(backend, "vt-audit-2") as second,
            new_event(backend) as event,
        ):
            backend.memset(cell, 0)
            busy(backend, work, first, WORK_ROUNDS[1])
            backend.memset(cell, 0x11, first)
            backend.record_event(event, first)
            backend.stream_wait_event(second, event)
            backend.memset(cell, 0x22, second)
            backend.synchronize(second)
            if not backend.query_event(event):
                raise ProbeFailed(
                    "a stream that waited on an event finished before the event completed"
                )
            backend.synchronize(first)
            got = read(backend, cell, as_runner=True)
            if not (got == 0x22).all():
                raise ProbeFailed(
                    "work enqueued after stream_wait_event ran before the awaited work "
                    f"(cell holds {int(got[0]):#x}, expected 0x22)"
                )
        return "work after stream_wait_event ran after the awaited stream's work"

    return [run_probe("event-ordering", ordering), run_probe("stream-wait-event", wait)]


def probe_pinned(backend: Backend) -> list[Check]:
    """alloc_pinned returns a writable uint8 HostBuffer with pinned=True."""
    if not backend.capabilities.pinned_host_memory:
        return [check("pinned-host-memory", "skip", "pinned_host_memory not declared")]

    def body() -> str:
        n = 12345
        with pinned_buffer(backend, n) as hb:
            if not isinstance(hb, HostBuffer):
                raise ProbeFailed(f"alloc_pinned returned {type(hb).__name__}, not vt.HostBuffer")
            if hb.pinned is not True:
                raise ProbeFailed("alloc_pinned returned a HostBuffer with pinned=False")
            if hb.array.dtype != np.uint8 or hb.nbytes != n:
                raise ProbeFailed(f"expected {n} uint8 bytes, got {hb.array.dtype} x {hb.nbytes}")
            hb.array[:] = pattern(n, 5)
            if not np.array_equal(hb.array, pattern(n, 5)):
                raise ProbeFailed("pinned memory does not keep what was written")
        return f"alloc_pinned({n}) returned {n} writable page-locked bytes"

    return [run_probe("pinned-host-memory", body)]


class SeenCopy(NamedTuple):
    """What :func:`copy_behind_work` saw in the pinned destination."""

    before: np.ndarray  # right after the copy was enqueued: still the poison, if it is pending
    after: np.ndarray  # right after the fence, before anything else synchronizes the stream
    fence: str  # "the ready event" or "synchronize"


def copy_behind_work(
    backend: Backend,
    src: Buffer,
    dst: HostBuffer,
    rounds: int,
    *,
    produce: np.ndarray | None = None,
) -> SeenCopy:
    """``copy_d2h_async(dst, src)`` on a new stream behind ``rounds`` memsets of work, fenced
    by a ready event where events are declared, else by synchronizing the stream.

    ``dst`` is poisoned (:data:`POISON`) first. ``produce``: bytes written into ``src`` on
    that stream right before the copy, as the sample kernel writes the ids. The caller
    judges what was seen; the audit's probe and the kit's stricter contract differ only there.
    """
    events = backend.capabilities.events
    dst.array[:] = POISON
    with (
        device_buffer(backend, WORK_BYTES) as work,
        new_stream(backend, "vt-audit-d2h") as stream,
        new_event(backend) if events else nullcontext() as ready,
    ):
        busy(backend, work, stream, rounds)
        if produce is not None:
            backend.copy_h2d_async(src, produce, stream)
        backend.copy_d2h_async(dst, src, stream)
        if ready is not None:
            backend.record_event(ready, stream)
        before = dst.array.copy()
        if ready is not None:
            backend.synchronize_event(ready)
        else:
            backend.synchronize(stream)
        after = dst.array.copy()
    return SeenCopy(before, after, "the ready event" if events else "synchronize")


def probe_async_d2h(backend: Backend) -> list[Check]:
    """copy_d2h_async fills a poisoned pinned buffer, honouring the source offset."""
    if not backend.capabilities.async_d2h_copy:
        return [check("async-d2h-copy", "skip", "async_d2h_copy not declared")]

    def body() -> str:
        n, off = 64 << 10, 1024
        with device_buffer(backend, n) as src:
            data = pattern(n, 6)
            backend.copy_h2d(src, data)
            want = data[off:]
            with pinned_buffer(backend, n - off) as dst:
                seen = copy_behind_work(backend, src.view(off, n - off), dst, WORK_ROUNDS[1])
        if not np.array_equal(seen.after, want):
            fence = seen.fence if backend.capabilities.events else "the stream synchronize"
            raise ProbeFailed(
                f"after {fence} the pinned buffer is wrong: {first_diff(seen.after, want)}"
            )
        if not np.array_equal(seen.before, want):
            return f"still poisoned before {seen.fence}, correct after it"
        return f"correct after {seen.fence} (the copy finished too fast to see it pending)"

    return [run_probe("async-d2h-copy", body)]


def probe_readback(backend: Backend) -> list[Check]:
    """The sampled-token readback path the runner picks from the capabilities."""
    caps = backend.capabilities
    ids = (np.arange(8, dtype=np.int32) * 7919 + 13).view(np.uint8)

    def sync_path() -> str:
        with device_buffer(backend, ids.nbytes) as dev, new_stream(backend, "vt-audit-step") as s:
            backend.memset(dev, 0)
            backend.copy_h2d_async(dev, ids, s)
            backend.synchronize(s)
            got = np.empty(ids.nbytes, np.uint8)
            backend.copy_d2h(got, dev)
            if not np.array_equal(got, ids):
                raise ProbeFailed("after synchronize(stream), copy_d2h did not return the ids")
        return "ids written on a stream are read back by copy_d2h after synchronize(stream)"

    if not caps.supports_async_sampled_token_readback:
        return [
            check("async-readback", "skip", "supports_async_sampled_token_readback not declared"),
            run_probe("sync-readback", sync_path),
        ]

    def async_path() -> str:
        with (
            device_buffer(backend, ids.nbytes) as dev,
            device_buffer(backend, WORK_BYTES) as work,
            new_stream(backend, "vt-audit-step") as step,
        ):
            backend.memset(dev, 0)
            with new_event(backend) as sampled:
                busy(backend, work, step, WORK_ROUNDS[1])
                backend.copy_h2d_async(dev, ids, step)  # stands in for the sample kernel
                backend.record_event(sampled, step)
                if caps.device_memory_is_host_addressable:
                    backend.synchronize_event(sampled)
                    got = np.array(backend.host_view(dev), copy=True)
                    how = "host_view after the sampled event"
                else:
                    # vLLM's pattern: a side stream waits on the step, copies, records.
                    with (
                        new_stream(backend, "vt-audit-copy") as side,
                        pinned_buffer(backend, ids.nbytes) as dst,
                        new_event(backend) as copied,
                    ):
                        backend.stream_wait_event(side, sampled)
                        dst.array[:] = POISON
                        backend.copy_d2h_async(dst, dev, side)
                        backend.record_event(copied, side)
                        backend.synchronize_event(copied)
                        got = dst.array.copy()
                    how = "copy_d2h_async on a side stream that waited on the sampled event"
            if not np.array_equal(got, ids):
                raise ProbeFailed(f"the ids read by {how} are wrong: {first_diff(got, ids)}")
        return f"ids read correctly by {how}, overlapping the host"

    return [run_probe("async-readback", async_path), run_probe("sync-readback", sync_path)]


def probe_graphs(backend: Backend) -> list[Check]:
    """Captured work does not run at capture; each replay reruns it on current contents.

    The captured copy reads pinned host memory, as the runner's host inputs do; what it
    reads must be what that memory holds when the replay runs.
    """
    if not backend.capabilities.graphs:
        return [
            check("graph-replay", "skip", "graphs not declared: the runner launches every kernel")
        ]

    def body() -> str:
        n, tail = 64 << 10, 4096
        head = n - tail
        with (
            pinned_buffer(backend, head) as staged,
            device_buffer(backend, n) as dst,
            new_stream(backend, "vt-audit-graph") as s,
        ):
            backend.memset(dst, POISON)
            first = pattern(head, 9)
            staged.array[:] = first
            backend.begin_capture(s)
            try:
                backend.copy_h2d_async(dst, staged, s)
                backend.memset(dst.view(head, tail), 0x77, s)
            finally:
                graph = backend.end_capture(s)
            try:
                _replays(backend, graph, s, dst, staged, first)
            finally:
                backend.destroy_graph(graph)
        return (
            "a captured copy + memset did not run at capture; two replays copied what the "
            "pinned source held when they ran, in order with later work on the stream"
        )

    return [run_probe("graph-replay", body)]


def _replays(
    backend: Backend, graph: Graph, s: Stream, dst: Buffer, staged: HostBuffer, first: np.ndarray
) -> None:
    n, head = dst.nbytes, staged.nbytes
    backend.synchronize(s)
    got = np.empty(n, np.uint8)
    backend.copy_d2h(got, dst)
    if not (got == POISON).all():
        raise ProbeFailed(
            "work enqueued between begin_capture and end_capture ran at capture "
            f"({first_diff(got, np.full(n, POISON, np.uint8))}); it must only be recorded"
        )
    for round_, seed in enumerate((10, 11)):
        data = pattern(head, seed)
        staged.array[:] = data
        backend.launch_graph(graph, s)
        backend.memset(dst.view(n - 1, 1), 0x11, s)  # after the replay, in stream order
        backend.synchronize(s)
        backend.copy_d2h(got, dst)
        want = np.concatenate([data, np.full(n - head - 1, 0x77, np.uint8), [np.uint8(0x11)]])
        if not np.array_equal(got, want):
            stale = np.array_equal(got[:head], first)
            raise ProbeFailed(
                f"replay {round_ + 1} is wrong ({first_diff(got, want)})"
                + (": it copied the source as it was at capture" if stale else "")
            )
