"""Runtime probes: prove a started backend's declared capabilities by exercising them.

Each probe is a function ``(backend) -> list[Check]`` over a started backend whose
``capabilities`` are its effective ones. ``vt audit`` runs them all (:data:`vt.audit.PROBES`;
``vt.audit`` re-exports the public names of this module) and the conformance kit reuses
them. A probe proves what is declared and, where the opposite is declared, that the backend
refuses (``host_view`` must raise without host-addressable memory). A probe that cannot run
says ``skip`` with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
from pydantic import BaseModel

from .backend import Backend, Buffer, Graph, HostBuffer, Stream
from .errors import HostAccessError

Kind = Literal["rule", "probe"]
Result = Literal["pass", "fail", "skip"]


class Check(BaseModel):
    """One audit result."""

    id: str
    kind: Kind
    result: Result
    detail: str = ""


class ProbeFailed(Exception):
    """A probe saw the backend break its declaration; the message is the check's detail."""


def _pass(check_id: str, detail: str) -> Check:
    return Check(id=check_id, kind="probe", result="pass", detail=detail)


def _fail(check_id: str, detail: str) -> Check:
    return Check(id=check_id, kind="probe", result="fail", detail=detail)


def _skip(check_id: str, detail: str) -> Check:
    return Check(id=check_id, kind="probe", result="skip", detail=detail)


def run_probe(check_id: str, body: Callable[[], str]) -> Check:
    """Run ``body``; its return value is the pass detail, any exception a failure."""
    try:
        return _pass(check_id, body())
    except ProbeFailed as exc:
        return Check(id=check_id, kind="probe", result="fail", detail=str(exc))
    except Exception as exc:
        return Check(
            id=check_id, kind="probe", result="fail", detail=f"{type(exc).__name__}: {exc}"
        )


# --------------------------------------------------------------------------- helpers

#: Size of the buffer the probes keep a stream busy with, and how many memsets they try.
WORK_BYTES = 32 << 20
WORK_ROUNDS = (8, 32, 128)


@contextmanager
def _allocated(backend: Backend, nbytes: int) -> Iterator[Buffer]:
    buf = backend.alloc(nbytes)
    try:
        yield buf
    finally:
        backend.free(buf)


@contextmanager
def _stream(backend: Backend, name: str) -> Iterator[Stream]:
    stream = backend.create_stream(name)
    try:
        yield stream
    finally:
        backend.synchronize(stream)
        backend.destroy_stream(stream)


def _read(backend: Backend, buf: Buffer) -> np.ndarray:
    """Device bytes as the runner would read them: host_view if allowed, else a copy."""
    if backend.capabilities.device_memory_is_host_addressable:
        return np.array(backend.host_view(buf), dtype=np.uint8, copy=True)
    out = np.empty(buf.nbytes, dtype=np.uint8)
    backend.copy_d2h(out, buf)
    return out


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _busy(backend: Backend, work: Buffer, stream: Stream, rounds: int) -> None:
    for i in range(rounds):
        backend.memset(work, i & 0xFF, stream)


def _first_diff(got: np.ndarray, want: np.ndarray) -> str:
    idx = np.flatnonzero(got != want)
    return "no difference" if idx.size == 0 else f"first wrong byte at {int(idx[0])}"


# --------------------------------------------------------------------------- probes


def probe_memory(backend: Backend) -> list[Check]:
    """alloc/copy_h2d/copy_d2h/memset round-trip, including a sub-range view."""

    def body() -> str:
        n = 64 << 10
        with _allocated(backend, n) as buf:
            data = _pattern(n, 1)
            backend.copy_h2d(buf, data)
            got = np.empty(n, np.uint8)
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(f"copy_h2d then copy_d2h differ: {_first_diff(got, data)}")
            part = _pattern(4096, 2)
            backend.copy_h2d(buf.view(8192, 4096), part)
            data[8192 : 8192 + 4096] = part
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(
                    f"a copy into buf.view(8192, 4096) landed wrong: {_first_diff(got, data)}"
                )
            backend.memset(buf.view(4096, 4096), 0x5A)
            data[4096:8192] = 0x5A
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(f"memset of a view landed wrong: {_first_diff(got, data)}")
        return f"{n} bytes round-trip through copy_h2d/copy_d2h; views and memset honour offsets"

    return [run_probe("memory-roundtrip", body)]


def probe_host_view(backend: Backend) -> list[Check]:
    """Host-addressable: host_view round-trips both ways. Otherwise: host_view must raise."""
    if not backend.capabilities.device_memory_is_host_addressable:

        def refused() -> str:
            with _allocated(backend, 4096) as buf:
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
        with _allocated(backend, n) as buf:
            view = backend.host_view(buf)
            if not isinstance(view, np.ndarray) or view.dtype != np.uint8 or view.size != n:
                raise ProbeFailed(
                    f"host_view returned {type(view).__name__} "
                    f"{getattr(view, 'dtype', '')} of size {getattr(view, 'size', '?')}"
                    f"; expected a uint8 array of {n} bytes"
                )
            data = _pattern(n, 3)
            view[:] = data
            got = np.empty(n, np.uint8)
            backend.copy_d2h(got, buf)
            if not np.array_equal(got, data):
                raise ProbeFailed(
                    f"written via host_view, read via copy_d2h: {_first_diff(got, data)}"
                )
            data = _pattern(n, 4)
            backend.copy_h2d(buf, data)
            seen = np.array(backend.host_view(buf), copy=True)
            if not np.array_equal(seen, data):
                raise ProbeFailed(
                    f"written via copy_h2d, read via host_view: {_first_diff(seen, data)}"
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
        return [_skip("event-ordering", reason), _skip("stream-wait-event", reason)]

    def ordering() -> str:
        with (
            _allocated(backend, WORK_BYTES) as work,
            _allocated(backend, 4096) as flag,
            _stream(backend, "vt-audit") as stream,
        ):
            event = backend.create_event()
            try:
                for rounds in WORK_ROUNDS:
                    backend.memset(flag, 0)
                    start = time.perf_counter()
                    _busy(backend, work, stream, rounds)
                    backend.memset(flag, 0xA5, stream)
                    backend.record_event(event, stream)
                    pending = not backend.query_event(event)
                    backend.synchronize_event(event)
                    ms = (time.perf_counter() - start) * 1e3
                    if not backend.query_event(event):
                        raise ProbeFailed("query_event is False after synchronize_event")
                    if not (_read(backend, flag) == 0xA5).all():
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
            finally:
                backend.destroy_event(event)
        return (
            f"complete after synchronize_event with the work before it visible; the pending "
            f"state was never observable (even {WORK_ROUNDS[-1]} memsets of "
            f"{WORK_BYTES >> 20} MiB finished before query_event)"
        )

    def wait() -> str:
        with (
            _allocated(backend, WORK_BYTES) as work,
            _allocated(backend, 4096) as cell,
            _stream(backend, "vt-audit-1") as first,
            _stream(backend, "vt-audit-2") as second,
        ):
            event = backend.create_event()
            try:
                backend.memset(cell, 0)
                _busy(backend, work, first, WORK_ROUNDS[1])
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
                got = _read(backend, cell)
                if not (got == 0x22).all():
                    raise ProbeFailed(
                        "work enqueued after stream_wait_event ran before the awaited work "
                        f"(cell holds {int(got[0]):#x}, expected 0x22)"
                    )
            finally:
                backend.destroy_event(event)
        return "work after stream_wait_event ran after the awaited stream's work"

    return [run_probe("event-ordering", ordering), run_probe("stream-wait-event", wait)]


def probe_pinned(backend: Backend) -> list[Check]:
    """alloc_pinned returns a writable uint8 HostBuffer with pinned=True."""
    if not backend.capabilities.pinned_host_memory:
        return [_skip("pinned-host-memory", "pinned_host_memory not declared")]

    def body() -> str:
        n = 12345
        hb = backend.alloc_pinned(n)
        try:
            if not isinstance(hb, HostBuffer):
                raise ProbeFailed(f"alloc_pinned returned {type(hb).__name__}, not vt.HostBuffer")
            if hb.pinned is not True:
                raise ProbeFailed("alloc_pinned returned a HostBuffer with pinned=False")
            if hb.array.dtype != np.uint8 or hb.nbytes != n:
                raise ProbeFailed(f"expected {n} uint8 bytes, got {hb.array.dtype} x {hb.nbytes}")
            hb.array[:] = _pattern(n, 5)
            if not np.array_equal(hb.array, _pattern(n, 5)):
                raise ProbeFailed("pinned memory does not keep what was written")
        finally:
            backend.free_pinned(hb)
        return f"alloc_pinned({n}) returned {n} writable page-locked bytes"

    return [run_probe("pinned-host-memory", body)]


def _async_copy(backend: Backend, src: Buffer, dst: HostBuffer, want: np.ndarray) -> str:
    """Copy ``src`` into poisoned ``dst`` behind long work; wrong before ready, right after."""
    caps = backend.capabilities
    dst.array[:] = 0xCD
    with _allocated(backend, WORK_BYTES) as work, _stream(backend, "vt-audit-d2h") as stream:
        event = backend.create_event() if caps.events else None
        try:
            _busy(backend, work, stream, WORK_ROUNDS[1])
            backend.copy_d2h_async(dst, src, stream)
            if event is not None:
                backend.record_event(event, stream)
            early = not np.array_equal(dst.array, want)
            if event is not None:
                backend.synchronize_event(event)
            else:
                backend.synchronize(stream)
            if not np.array_equal(dst.array, want):
                raise ProbeFailed(
                    f"after the {'ready event' if event else 'stream synchronize'} the pinned "
                    f"buffer is wrong: {_first_diff(dst.array, want)}"
                )
        finally:
            if event is not None:
                backend.destroy_event(event)
    fence = "the ready event" if caps.events else "synchronize"
    if early:
        return f"still poisoned before {fence}, correct after it"
    return f"correct after {fence} (the copy finished too fast to see it pending)"


def probe_async_d2h(backend: Backend) -> list[Check]:
    """copy_d2h_async fills a poisoned pinned buffer, honouring the source offset."""
    if not backend.capabilities.async_d2h_copy:
        return [_skip("async-d2h-copy", "async_d2h_copy not declared")]

    def body() -> str:
        n = 64 << 10
        with _allocated(backend, n) as src:
            data = _pattern(n, 6)
            backend.copy_h2d(src, data)
            dst = backend.alloc_pinned(n - 1024)
            try:
                return _async_copy(backend, src.view(1024, n - 1024), dst, data[1024:])
            finally:
                backend.free_pinned(dst)

    return [run_probe("async-d2h-copy", body)]


def probe_readback(backend: Backend) -> list[Check]:
    """The sampled-token readback path the runner picks from the capabilities."""
    caps = backend.capabilities
    ids = (np.arange(8, dtype=np.int32) * 7919 + 13).view(np.uint8)

    def sync_path() -> str:
        with _allocated(backend, ids.nbytes) as dev, _stream(backend, "vt-audit-step") as s:
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
            _skip("async-readback", "supports_async_sampled_token_readback not declared"),
            run_probe("sync-readback", sync_path),
        ]

    def async_path() -> str:
        with (
            _allocated(backend, ids.nbytes) as dev,
            _allocated(backend, WORK_BYTES) as work,
            _stream(backend, "vt-audit-step") as step,
        ):
            backend.memset(dev, 0)
            sampled = backend.create_event()
            try:
                _busy(backend, work, step, WORK_ROUNDS[1])
                backend.copy_h2d_async(dev, ids, step)  # stands in for the sample kernel
                backend.record_event(sampled, step)
                if caps.device_memory_is_host_addressable:
                    backend.synchronize_event(sampled)
                    got = np.array(backend.host_view(dev), copy=True)
                    how = "host_view after the sampled event"
                else:
                    # vLLM's pattern: a side stream waits on the step, copies, records.
                    with _stream(backend, "vt-audit-copy") as side:
                        backend.stream_wait_event(side, sampled)
                        pinned = backend.alloc_pinned(ids.nbytes)
                        try:
                            copied = backend.create_event()
                            pinned.array[:] = 0xCD
                            backend.copy_d2h_async(pinned, dev, side)
                            backend.record_event(copied, side)
                            backend.synchronize_event(copied)
                            backend.destroy_event(copied)
                            got = pinned.array.copy()
                        finally:
                            backend.free_pinned(pinned)
                    how = "copy_d2h_async on a side stream that waited on the sampled event"
            finally:
                backend.destroy_event(sampled)
            if not np.array_equal(got, ids):
                raise ProbeFailed(f"the ids read by {how} are wrong: {_first_diff(got, ids)}")
        return f"ids read correctly by {how}, overlapping the host"

    return [run_probe("async-readback", async_path), run_probe("sync-readback", sync_path)]


def probe_graphs(backend: Backend) -> list[Check]:
    """Captured work does not run at capture; each replay reruns it on current contents.

    The captured copy reads pinned host memory, as the runner's host inputs do; what it
    reads must be what that memory holds when the replay runs.
    """
    if not backend.capabilities.graphs:
        return [_skip("graph-replay", "graphs not declared: the runner launches every kernel")]

    def body() -> str:
        n, tail = 64 << 10, 4096
        head = n - tail
        staged = backend.alloc_pinned(head)
        try:
            with _allocated(backend, n) as dst, _stream(backend, "vt-audit-graph") as s:
                backend.memset(dst, 0xCD)
                first = _pattern(head, 9)
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
        finally:
            backend.free_pinned(staged)
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
    if not (got == 0xCD).all():
        raise ProbeFailed(
            "work enqueued between begin_capture and end_capture ran at capture "
            f"({_first_diff(got, np.full(n, 0xCD, np.uint8))}); it must only be recorded"
        )
    for round_, seed in enumerate((10, 11)):
        data = _pattern(head, seed)
        staged.array[:] = data
        backend.launch_graph(graph, s)
        backend.memset(dst.view(n - 1, 1), 0x11, s)  # after the replay, in stream order
        backend.synchronize(s)
        backend.copy_d2h(got, dst)
        want = np.concatenate([data, np.full(n - head - 1, 0x77, np.uint8), [np.uint8(0x11)]])
        if not np.array_equal(got, want):
            stale = np.array_equal(got[:head], first)
            raise ProbeFailed(
                f"replay {round_ + 1} is wrong ({_first_diff(got, want)})"
                + (": it copied the source as it was at capture" if stale else "")
            )


def probe_vmm(backend: Backend) -> list[Check]:
    """The VMM arena smoke (``vt.memory.smoke``) when vmm is declared."""
    if backend.capabilities.vmm is None:
        return [_skip("vmm", "vmm not declared")]
    from .memory.smoke import arena_smoke  # it imports Check from here

    try:
        return list(arena_smoke(backend))
    except Exception as exc:
        return [Check(id="vmm", kind="probe", result="fail", detail=f"{type(exc).__name__}: {exc}")]
