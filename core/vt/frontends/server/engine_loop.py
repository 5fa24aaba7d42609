"""One background thread that owns the :class:`~vt.frontends.engine.Engine` and steps it.

HTTP handlers never touch the engine: they :meth:`EngineLoop.submit` a group of prompts and
:meth:`EngineLoop.abort` it, both thread-safe (a command queue the thread drains between
steps). New requests therefore join the running batch at the next step, which is
continuous batching. The thread hands every delta back to the handler's asyncio queue with
``loop.call_soon_threadsafe``, so the event loop never blocks on the device.

A step that raises fails only the requests it held (the engine drops them, requeues those
that had not started, and recovers the runner); those requests get the error and the thread
carries on. If the runner cannot be recovered the engine is unhealthy: every request gets
the reason, ``/health`` reports it, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import EngineUnhealthyError, RequestError, RequestOutput
from ..sampling import SamplingParams

log = logging.getLogger("vt.frontends.server")


class ShuttingDown(Exception):
    """The server stopped while the request was queued or running."""


class QueueFull(Exception):
    """No room in the waiting queue now (503 with Retry-After)."""


class TooManyPrompts(ValueError):
    """A request with more prompts than the server can ever hold at once (400)."""


@dataclass
class Delivery:
    """What a handler's queue receives. The first item of a group is ``accepted`` or an
    ``error``; then outputs (``index`` is the prompt's position in the group)."""

    index: int = 0
    output: RequestOutput | None = None
    error: BaseException | None = None
    accepted: bool = False


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None


@dataclass(eq=False)
class _Group:
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delivery]
    rids: list[str] = field(default_factory=list)
    live: int = 0  # prompts counted against the queue bound and not finished yet
    finals_only: bool = False  # a non-streaming answer: only finished outputs are delivered

    def deliver(self, item: Delivery) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    steps: int = 0
    failed_steps: int = 0


class EngineLoop:
    """Owns ``engine`` on a daemon thread between :meth:`start` and :meth:`stop`.

    At most ``max_slots + max_waiting`` prompts are admitted at once (running or waiting
    for a slot); past that :meth:`submit` refuses with :class:`QueueFull` at once.
    ``metrics`` (a :class:`~vt.frontends.server.metrics.Metrics`) counts steps and tokens.
    """

    def __init__(self, engine: Any, max_waiting: int | None = None, metrics: Any = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.capacity = None if max_waiting is None else int(engine.max_slots) + max_waiting
        self.metrics = metrics
        self._admitted = 0  # prompts admitted and not finished (the queue bound counts them)
        self._lock = threading.Lock()
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._groups: dict[str, _Group] = {}  # engine request id -> its group
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._drain = False  # step once more to collect a step still in flight

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="vt-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        out: asyncio.Queue[Delivery],
        loop: asyncio.AbstractEventLoop,
        finals_only: bool = False,
    ) -> None:
        """Queue one request of one or more prompts; its deliveries go to ``out``. With
        ``finals_only`` (a non-streaming answer) a prompt's output is delivered once, when it
        finishes: a delivery a token would wake the event loop, and take the GIL from the
        engine's threads, every step for nothing."""
        group = _Group(request_id, prompts, params, loop, out, finals_only=finals_only)
        if self._stopped.is_set():
            group.deliver(Delivery(error=ShuttingDown("the server is shutting down")))
            return
        if not getattr(self.engine, "healthy", True):
            reason = self.engine.unhealthy_reason
            group.deliver(Delivery(error=EngineUnhealthyError(f"the engine is unusable: {reason}")))
            return
        n = len(prompts)
        with self._lock:
            if self.capacity is not None and self._admitted + n > self.capacity:
                if n > self.capacity:
                    error: Exception = TooManyPrompts(
                        f"the request has {n} prompts but this server holds at most "
                        f"{self.capacity} at once ({self.engine.max_slots} running, "
                        f"{self.max_waiting} waiting); send fewer per request"
                    )
                else:
                    error = QueueFull(
                        f"the server is busy: {self._admitted} requests are running or "
                        f"waiting (at most {self.capacity}); retry later"
                    )
                group.deliver(Delivery(error=error))
                return
            self._admitted += n
            group.live = n
        self._commands.put(("add", group))

    @property
    def admitted(self) -> int:
        """Prompts running or waiting (submitted and not finished)."""
        return self._admitted

    def _release(self, group: _Group, n: int | None = None) -> None:
        """``n`` of the group's prompts are done (all that are left by default)."""
        with self._lock:
            k = group.live if n is None else min(n, group.live)
            group.live -= k
            self._admitted -= k

    def abort(self, request_id: str) -> None:
        """Stop every prompt of a request (its client went away); frees their KV slots."""
        self._commands.put(("abort", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is still queued or running with :class:`ShuttingDown` and end the
        thread. The engine (and the model) can be closed once this returns."""
        self._stopped.set()
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            try:
                if self._iterate():
                    return
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the thread
                log.exception("the engine loop failed; failing its requests")
                self._fail_groups(exc)

    def _iterate(self) -> bool:
        """Apply queued commands, then run one step if there is work; True on stop."""
        engine = self.engine
        busy = engine.has_unfinished() or self._drain
        try:
            command = self._commands.get(block=not busy)
        except queue.Empty:
            command = None
        while command is not None:
            if command[0] == "stop":
                self._shutdown()
                return True
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        had_work = engine.has_unfinished()
        if had_work or self._drain:
            self._drain = False
            self._step()
            # One more step after the last request finishes collects a step still in
            # flight, so the slots it held are released before the engine goes idle.
            self._drain = had_work and not engine.has_unfinished()
        return False

    def _apply(self, command: tuple[str, Any]) -> None:
        kind, arg = command
        if kind == "add":
            self._add(arg)
        elif kind == "abort":
            for rid, group in list(self._groups.items()):
                if group.request_id == arg:
                    self.engine.abort(rid)
                    del self._groups[rid]
                    self._release(group)
                    self._drain = True

    def _add(self, group: _Group) -> None:
        added: list[str] = []
        try:
            for i, prompt in enumerate(group.prompts):
                rid = f"{group.request_id}-{i}"
                self.engine.add_request(
                    prompt.ids, group.params, request_id=rid, prompt=prompt.text,
                    final_only=group.finals_only,
                )  # fmt: skip
                added.append(rid)
        except Exception as exc:  # noqa: BLE001 - handed to the request, the loop goes on
            for rid in added:  # all prompts of a request run, or none
                self.engine.abort(rid)
            if not isinstance(exc, (RequestError, EngineUnhealthyError)):
                log.exception("adding request %s failed", group.request_id)
            self._release(group)
            group.deliver(Delivery(error=exc))
            return
        group.rids = added
        for rid in added:
            self._groups[rid] = group
        group.deliver(Delivery(accepted=True))

    def _step(self) -> None:
        m = self.metrics
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine dropped its requests; tell them
            # Counted first: a client that reads /health after its error sees this step.
            self._update_stats(failed=1)
            if m is not None:
                m.failed_steps.inc()
            self._step_failed(exc)
            return
        if m is not None:
            m.steps.inc()
            m.step_time.observe(time.perf_counter() - t0)
        for out in outputs:
            if m is not None and out.delta_ids:
                m.generation_tokens.inc(len(out.delta_ids))
            group = self._groups.get(out.request_id)
            if group is None:
                continue  # aborted while its last step was in flight
            if group.finals_only and not out.finished:
                continue
            if out.finished:
                del self._groups[out.request_id]
                self._release(group, 1)
                if m is not None:
                    m.finish(out)
            group.deliver(Delivery(index=group.rids.index(out.request_id), output=out))
        self._update_stats()

    def _step_failed(self, exc: BaseException) -> None:
        failure = getattr(self.engine, "last_failure", None)
        if failure is None or failure.error is not exc or not failure.healthy:
            log.exception("an engine step failed; failing the %d request(s) it held", len(self))
            if failure is not None and not failure.healthy:
                log.error("the engine is unusable after that failure: %s", failure.reason)
            self._fail_groups(exc)
            return
        failed = set(failure.failed)
        groups = {id(g): g for rid, g in self._groups.items() if rid in failed}
        log.exception(
            "an engine step failed; failing the %d request(s) in it (%d requeued)",
            len(groups),
            len(failure.requeued),
        )
        for group in groups.values():
            for rid in group.rids:  # every prompt of a request, or none
                self.engine.abort(rid)
                self._groups.pop(rid, None)
            self._release(group)
            group.deliver(Delivery(error=exc))

    @property
    def healthy(self) -> tuple[bool, str | None]:
        """Whether the engine can take requests, and why not."""
        if not self.alive:
            return False, "the engine thread has stopped"
        if not getattr(self.engine, "healthy", True):
            return False, f"the engine is unusable: {self.engine.unhealthy_reason}"
        return True, None

    def _fail_groups(self, exc: BaseException) -> None:
        failed = {id(g): g for g in self._groups.values()}
        for rid in self._groups:  # after a failed step the engine has dropped them already
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        self._groups.clear()
        for group in failed.values():
            self._release(group)
            group.deliver(Delivery(error=exc))

    def _update_stats(self, failed: int = 0) -> None:
        s = self.stats
        self.stats = EngineStats(
            running=self.engine.num_running,
            waiting=self.engine.num_waiting,
            steps=s.steps + 1,
            failed_steps=s.failed_steps + failed,
        )

    def _shutdown(self) -> None:
        error = ShuttingDown("the server is shutting down")
        notified: set[int] = set()
        for rid, group in list(self._groups.items()):
            self.engine.abort(rid)
            if id(group) not in notified:
                notified.add(id(group))
                self._release(group)
                group.deliver(Delivery(error=error))
        self._groups.clear()
        while True:  # requests queued after the last step
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._release(arg)
                arg.deliver(Delivery(error=error))
        try:
            while self.engine.has_unfinished():
                self.engine.step()
            self.engine.step()  # collect a step still in flight
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("an engine step failed during shutdown")
        self.stats = EngineStats(steps=self.stats.steps, failed_steps=self.stats.failed_steps)

    def __len__(self) -> int:
        """Requests (groups) the thread is serving now."""
        return len({id(g) for g in self._groups.values()})
