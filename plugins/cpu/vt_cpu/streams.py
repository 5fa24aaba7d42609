"""Streams that really run asynchronously: one worker thread per stream, FIFO, in order.

Errors are sticky per stream, like a device's: when an op raises, the worker records it
(naming the op) and skips the rest of the stream's work, while still firing the events
recorded on it so nobody waits forever. ``synchronize_event`` on such an event raises the
error; ``synchronize`` of the stream raises it and clears it, after which the stream runs
new work again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import vt


class StreamError(vt.VtError):
    """Work enqueued on a CPU stream raised; the message names the stream and the op."""


class OpFailed(Exception):
    """Raised by work that runs several ops (a program, :mod:`vt_cpu.program`): which op
    failed (``op``) and how (``error``), so the stream's error names that op."""

    def __init__(self, op: str, error: BaseException) -> None:
        super().__init__(f"{op}: {error}")
        self.op = op
        self.error = error


class _Batch:
    """Work enqueued as one queue item (a graph's replay)."""

    __slots__ = ("ops",)

    def __init__(self, ops: tuple[tuple[str, Callable[[], Any], bool], ...]) -> None:
        self.ops = ops


class WorkerStream:
    """A FIFO of closures executed in order by a dedicated daemon thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[str, Callable[[], Any], bool] | None] = (
            queue.SimpleQueue()
        )
        self._error: StreamError | None = None
        self._closed = False
        # While capturing (graphs), enqueued work is recorded here instead of queued.
        self._capture: list[tuple[str, Callable[[], Any], bool]] | None = None
        self._thread = threading.Thread(target=self._run, name=f"vt-cpu-stream:{name}")
        self._thread.daemon = True  # a forgotten close() must not hang interpreter exit
        self._thread.start()

    def enqueue_batch(self, ops: Sequence[tuple[str, Callable[[], Any], bool]]) -> None:
        """Enqueue ``ops`` (``(op, fn, always)`` in order) as one item: the worker runs
        them back to back, with the error handling of separately enqueued work."""
        if self._closed:
            raise StreamError(f"cpu stream {self.name!r} was destroyed; a graph cannot run on it")
        if self._capture is not None:
            self._capture.extend(ops)
            return
        self._queue.put(("graph", _Batch(tuple(ops)), True))

    def enqueue(self, op: str, fn: Callable[[], Any], always: bool = False) -> None:
        """Run ``fn`` after everything enqueued before; ``always`` runs it even after an error."""
        if self._closed:
            raise StreamError(f"cpu stream {self.name!r} was destroyed; {op} cannot run on it")
        if self._capture is not None:
            self._capture.append((op, fn, always))
            return
        self._queue.put((op, fn, always))

    @property
    def capturing(self) -> bool:
        return self._capture is not None

    def begin_capture(self) -> None:
        """Record enqueued work from now on instead of running it."""
        if self._closed:
            raise StreamError(f"cpu stream {self.name!r} was destroyed; it cannot capture")
        if self._capture is not None:
            raise StreamError(f"cpu stream {self.name!r} is already capturing")
        self._capture = []

    def end_capture(self) -> list[tuple[str, Callable[[], Any], bool]]:
        """Stop recording; the work recorded since :meth:`begin_capture`, in order."""
        if self._capture is None:
            raise StreamError(f"cpu stream {self.name!r} is not capturing")
        ops, self._capture = self._capture, None
        return ops

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, fn, always = item
            if type(fn) is _Batch:
                for item in fn.ops:
                    self._run_one(*item)
            else:
                self._run_one(op, fn, always)

    def _run_one(self, op: str, fn: Callable[[], Any], always: bool) -> None:
        if self._error is not None and not always:
            return
        try:
            fn()
        except BaseException as exc:  # recorded, re-raised by synchronize
            if isinstance(exc, OpFailed):
                op, exc = exc.op, exc.error
            if self._error is None:
                err = StreamError(
                    f"cpu stream {self.name!r}: {op} failed: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
                self._error = err

    @property
    def error(self) -> StreamError | None:
        return self._error

    def wait_idle(self) -> None:
        """Block until everything enqueued so far has run (or been skipped); never raises."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(("synchronize", done.set, True))
        done.wait()

    def synchronize(self) -> None:
        """Wait for the queue to drain; raise (and clear) a recorded error."""
        if self._capture is not None:
            raise StreamError(
                f"cpu stream {self.name!r} is capturing a graph; end the capture before "
                "synchronizing it"
            )
        self.wait_idle()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self) -> None:
        """Finish the queued work and stop the thread (idempotent)."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()


class CpuEvent:
    """A marker in a stream's queue; it completes when the worker reaches it.

    As with device events, state refers to the most recent record: query and synchronize
    of a never-recorded event return at once, and ``wait_on`` captures the record current
    at the time of the call.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._recorded = 0  # generation of the latest record (host side)
        self._reached = 0  # latest generation a worker has passed
        self._stream: WorkerStream | None = None

    def record(self, stream: WorkerStream) -> None:
        with self._cond:
            self._recorded += 1
            gen, self._stream = self._recorded, stream
        stream.enqueue("record_event", partial(self._reach, gen), always=True)

    def _reach(self, gen: int) -> None:
        with self._cond:
            self._reached = max(self._reached, gen)
            self._cond.notify_all()

    def query(self) -> bool:
        return self._reached >= self._recorded

    def _wait(self, gen: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._reached >= gen)

    def synchronize(self) -> None:
        """Wait for the latest record; raise the error of the stream it was recorded on."""
        with self._cond:
            gen, stream = self._recorded, self._stream
        self._wait(gen)
        if stream is not None and stream.error is not None:
            raise stream.error

    def wait_on(self, stream: WorkerStream) -> None:
        """Make ``stream`` wait for the latest record before running later work."""
        with self._cond:
            gen, source = self._recorded, self._stream
        if gen == 0 or source is None:
            return

        def wait() -> None:
            self._wait(gen)
            if source is not stream and source.error is not None:
                raise StreamError(
                    f"waited on an event of cpu stream {source.name!r}, which failed: "
                    f"{source.error}"
                )

        stream.enqueue("stream_wait_event", wait)
