"""A liar for vt's tests: events that do not wait.

Built as docs/plugins.md says, from ``vt``'s public API and numpy: numpy memory, the
reference ops, and streams that really run asynchronously (one worker thread each, so
``enqueue_host`` queues instead of running at once). It inherits ``vt.Events`` and
implements its hooks, so vt derives ``events``, but recording, querying, synchronizing and
waiting on an event do nothing: an event is "complete" while the work before it still runs.
The runner would read results too early (issue 8: an empty answer, exit status 0).
``vt run`` must refuse it at open: probes ``event-ordering`` and ``stream-wait-event``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import vt
from vt.reference import HostMemory, ReferenceOps


class _Worker:
    """A stream: a thread running its queue in order; the first error is kept."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"liar-events:{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job()
            except BaseException as exc:  # raised again by synchronize
                self.error = self.error or exc

    def drain(self) -> None:
        done = threading.Event()
        self.jobs.put(done.set)
        done.wait()
        error, self.error = self.error, None
        if error is not None:
            raise vt.VtError(f"liar-events stream failed: {error}") from error

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class LiarEventsBackend(HostMemory, ReferenceOps, vt.HostAddressable, vt.Events):
    name = "liar-events"
    priority = -20
    description = "worker-thread streams whose events never wait (a liar, for vt's tests)"

    @classmethod
    def probe(cls) -> vt.Probe:
        facts = vt.Capabilities(unified_memory=True, device_memory_is_host_addressable=True)
        return vt.Probe(available=True, capabilities=facts, device="host numpy, threads")

    def __init__(self) -> None:
        self._streams: set[_Worker] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            streams, self._streams = self._streams, set()
        for worker in streams:
            worker.close()

    # ---- memory
    def _alloc(self, nbytes: int) -> vt.Buffer:
        return vt.Buffer(np.zeros(nbytes, np.uint8), nbytes, owner=self.name)

    def _free(self, buf: vt.Buffer) -> None:
        pass

    def _host_view(self, buf: vt.Buffer) -> np.ndarray:
        return buf.handle[buf.offset : buf.offset + buf.nbytes]

    def _before_sync(self) -> None:
        # A synchronous copy or memset waits for the work already queued on every stream.
        with self._lock:
            streams = list(self._streams)
        for worker in streams:
            worker.drain()

    # ---- streams: really asynchronous
    def _create_stream(self, name: str) -> vt.Stream:
        worker = _Worker(name)
        with self._lock:
            self._streams.add(worker)
        return vt.Stream(worker, name)

    def _destroy_stream(self, stream: vt.Stream) -> None:
        with self._lock:
            self._streams.discard(stream.handle)
        stream.handle.close()

    def _synchronize(self, stream: vt.Stream) -> None:
        stream.handle.drain()

    def enqueue_host(self, stream: vt.Stream, name: str, fn: Callable[[], Any]) -> None:
        stream.handle.jobs.put(fn)

    # ---- events: THE LIE. Each is complete at once; nothing waits for anything.
    def _create_event(self) -> vt.Event:
        return vt.Event(None)

    def _destroy_event(self, event: vt.Event) -> None:
        pass

    def _record_event(self, event: vt.Event, stream: vt.Stream) -> None:
        pass

    def _query_event(self, event: vt.Event) -> bool:
        return True

    def _synchronize_event(self, event: vt.Event) -> None:
        pass

    def _stream_wait_event(self, stream: vt.Stream, event: vt.Event) -> None:
        pass


@vt.hookimpl
def vt_register_backends(register):
    register(LiarEventsBackend)
