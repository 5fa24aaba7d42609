"""Async output slots and sampled-token readback, chosen from effective capabilities.

A step samples its ids on the device into the ``ids`` buffer of an :class:`OutputSlot`.
The pool of slots is created once and reused round-robin, so no step allocates. How the
host gets the ids back depends on what the backend can do (the contract whose violation
read ``hipMalloc`` memory on the CPU in the original bug):

``host_view``
    device memory is host-addressable: record ``ready`` on the main stream after sampling;
    :meth:`StepOutput.get_output` synchronises ``ready`` and reads through ``host_view``.
``async_d2h``
    record ``fork`` on the main stream; a second (copy) stream waits on it, copies the ids
    into pinned staging and records ``ready``; the host synchronises only ``ready`` before
    reading the pinned memory (vLLM's ``AsyncModelRunnerOutput``).
``sync``
    the host synchronises the main stream, then copies with ``copy_d2h``. Never
    ``host_view``.

A step whose rows ask for logprobs carries them the same way. Where the backend implements
the op ``logprobs``, the step launches it on the device after sampling, into the slot's
``lp`` buffer: ``m * (1 + 2k)`` 4-byte values for ``m`` asking rows and ``k``
alternatives (chosen logprob, top ids, top logprobs), which travel the ids' path (read
through ``host_view``, copied on the copy stream into ``host_lp``, or copied after a
synchronize). Elsewhere (the op's fallback) the step copies the asking rows' logits into the
slot's ``logits`` buffer, and the host reads them back and computes the logprobs.

Each slot also carries the pinned staging of its step's host inputs; a slot is reused only
after its previous step's output has been read (or read eagerly on reuse), which also proves
the step consumed its staging, so an async host-to-device copy is never overwritten in flight.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass

import numpy as np

from .. import envs
from ..errors import VtError
from ..protocol.backend import Backend, Buffer, Event, HostBuffer, Stream
from ..protocol.capabilities import Capabilities


class ReadbackPath(str, enum.Enum):
    host_view = "host_view"
    async_d2h = "async_d2h"
    sync = "sync"


class OutputAlreadyReadError(VtError, RuntimeError):
    """``get_output()`` was called a second time for the same step."""


def async_scheduling_enabled(async_scheduling: bool | None = None) -> tuple[bool, str]:
    """Whether the async runner is on, and why: the argument wins, then ``VT_ASYNC_RUNNER``."""
    if async_scheduling is not None:
        return bool(async_scheduling), f"async_scheduling={bool(async_scheduling)}"
    return envs.bool_with_reason("VT_ASYNC_RUNNER")


def choose_readback(caps: Capabilities, async_enabled: bool) -> tuple[ReadbackPath, str]:
    """The readback path for these *effective* capabilities, with a one-line reason."""
    if not async_enabled:
        return ReadbackPath.sync, "async scheduling is off"
    if caps.device_memory_is_host_addressable:
        return ReadbackPath.host_view, "device memory is host-addressable"
    if caps.supports_async_sampled_token_readback:
        lacking = [
            name
            for name in ("events", "pinned_host_memory", "async_d2h_copy")
            if not getattr(caps, name)
        ]
        if lacking:
            # The registry's rules reject such a declaration; never trust it regardless.
            return ReadbackPath.sync, (
                "supports_async_sampled_token_readback without " + ", ".join(lacking)
            )
        return ReadbackPath.async_d2h, "async device-to-host copy on a second stream"
    return ReadbackPath.sync, (
        "device memory is not host-addressable and async sampled-token readback is unsupported"
    )


@dataclass(eq=False)
class OutputSlot:
    """One step's output resources: device ids, pinned staging, fork and ready events."""

    index: int
    ids: Buffer  # device int32[max_rows]: the step's sampled ids
    inputs: HostBuffer  # pinned: this step's host inputs, copied to the device async
    host_ids: HostBuffer | None  # pinned landing of the async copy (async_d2h only)
    fork: Event
    ready: Event
    pending: StepOutput | None = None  # the step whose output is not read yet
    logits: Buffer | None = None  # device float32[max_rows, vocab]: the host fallback's copy
    lp: Buffer | None = None  # device: the logprobs op's results (see LogprobLayout)
    host_lp: HostBuffer | None = None  # pinned landing of ``lp`` (async_d2h only)


#: One sampled token's log-probabilities: its own, and the most likely ids with theirs.
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class LogprobLayout:
    """Where the logprobs op writes a step's results in the slot's ``lp`` buffer: the
    asking sampled rows in ascending order (``picked``), ``k`` alternatives for all of
    them (the most any asked for); chosen float32[m], top ids int32[m, k], top logprobs
    float32[m, k], back to back."""

    picked: tuple[int, ...]
    k: int

    @classmethod
    def of(cls, rows: dict[int, int]) -> LogprobLayout:
        return cls(tuple(sorted(rows)), max(rows.values()))

    @property
    def m(self) -> int:
        return len(self.picked)

    @property
    def nbytes(self) -> int:
        return 4 * self.m * (1 + 2 * self.k)

    def parse(self, raw: np.ndarray, rows: dict[int, int]) -> dict[int, TokenLogprobs]:
        """``{sampled row: (chosen, [(id, logprob), ...])}`` from the op's bytes."""
        m, k = self.m, self.k
        chosen = raw[: 4 * m].view(np.float32)
        top_ids = raw[4 * m : 4 * m * (1 + k)].view(np.int32).reshape(m, k)
        top_lp = raw[4 * m * (1 + k) : self.nbytes].view(np.float32).reshape(m, k)
        out: dict[int, TokenLogprobs] = {}
        for i, j in enumerate(self.picked):
            n = rows[j]
            top = [(int(t), float(v)) for t, v in zip(top_ids[i, :n], top_lp[i, :n], strict=True)]
            out[j] = (float(chosen[i]), top)
        return out


class StepOutput:
    """The sampled ids of one step; :meth:`get_output` may be called once.

    ``logprob_rows`` maps sampled rows (their index among the step's samples) to how many
    alternatives they want; :meth:`get_logprobs` has them once the ids are read.
    """

    def __init__(
        self,
        pool: OutputPool,
        slot: OutputSlot,
        sampled_slots: tuple[int, ...],
        step: int,
        logprob_rows: dict[int, int] | None = None,
        targets: tuple[tuple[int, int], ...] = (),
    ) -> None:
        self._pool = pool
        self._slot: OutputSlot | None = slot
        self.sampled_slots = sampled_slots
        self.step = step
        self._ids: np.ndarray | None = None
        self._error: Exception | None = None
        self._read = False
        self._logprob_rows = logprob_rows or {}
        self._logprobs: dict[int, TokenLogprobs] = {}
        self._targets = targets  # (kv slot, next prompt id) of each scored row, in order
        self._prompt: dict[int, list[tuple[int, float, list[tuple[int, float]]]]] = {}

    def ready(self) -> bool:
        """True when :meth:`get_output` will not block (a non-blocking event query)."""
        if self._slot is None:
            return True
        if not self._pool.has_events:
            return False  # no real event to ask: only a blocking synchronize can tell
        return self._pool.backend.query_event(self._slot.ready)

    def get_output(self) -> dict[int, int]:
        """Block until the step's ids are on the host; ``{slot: sampled id}``."""
        if self._read:
            raise OutputAlreadyReadError(
                f"get_output() was already called for step {self.step}; it may be called once"
            )
        self._materialize()
        self._read = True
        assert self._ids is not None
        return {s: int(i) for s, i in zip(self.sampled_slots, self._ids, strict=True)}

    def get_logprobs(self) -> dict[int, TokenLogprobs]:
        """``{slot: (logprob of the sampled id, [(id, logprob), ...])}`` for the rows that
        asked (after :meth:`get_output`): log-probabilities of the model's distribution,
        from the device op ``logprobs`` or (its fallback) a copy of the step's logits."""
        return dict(self._logprobs)

    def get_prompt_logprobs(self) -> dict[int, list[tuple[int, float, list[tuple[int, float]]]]]:
        """``{slot: [(prompt id, its logprob, [(id, logprob), ...]), ...]}`` for the scored
        prompt rows of the step (after :meth:`get_output`), in position order."""
        return {s: list(v) for s, v in self._prompt.items()}

    def _materialize(self) -> None:
        """Read the ids now and give the slot back to the pool.

        A failed read (say, ``HostAccessError`` from a backend that lied about host access)
        is kept and raised by every later :meth:`get_output`; the slot is released anyway.
        """
        slot = self._slot
        if slot is None:
            if self._error is not None:
                raise self._error
            return
        try:
            self._ids = self._pool.read(slot, len(self.sampled_slots))
            if self._logprob_rows:
                n = len(self.sampled_slots)
                ids = self._ids
                if self._targets:
                    extra = np.array([t for _, t in self._targets], dtype=np.int32)
                    ids = np.concatenate([ids, extra])
                got = self._pool.read_logprobs(slot, ids, self._logprob_rows)
                self._logprobs = {self.sampled_slots[j]: v for j, v in got.items() if j < n}
                for i, (kv_slot, target) in enumerate(self._targets):
                    chosen, top = got[n + i]
                    self._prompt.setdefault(kv_slot, []).append((target, chosen, top))
        except Exception as exc:
            self._error = exc
            raise
        finally:
            slot.pending = None
            self._slot = None

    def __repr__(self) -> str:
        state = "read" if self._read else ("ready" if self._slot is None else "pending")
        return f"StepOutput(step={self.step}, slots={list(self.sampled_slots)}, {state})"


class OutputPool:
    """The round-robin pool of :class:`OutputSlot`, created once per runner."""

    def __init__(
        self,
        backend: Backend,
        path: ReadbackPath,
        n_slots: int,
        max_rows: int,
        inputs_nbytes: int,
        main: Stream,
    ) -> None:
        if n_slots < 2:
            raise ValueError(
                f"n_output_slots must be at least 2 (one step in flight while the next "
                f"is enqueued), got {n_slots}"
            )
        self.backend = backend
        self.path = path
        self.main = main
        self.max_rows = max_rows
        self.copy_stream: Stream | None = None
        self.slots: list[OutputSlot] = []
        self.vocab = 0
        self.lp_on_device = False
        #: Bytes of logprob data read back to the host so far (results, or logits copies).
        self.lp_bytes_read = 0
        self._next = 0
        # Without real events, waiting on an event means waiting on its stream.
        self.has_events = backend.capabilities.events
        try:
            if path is ReadbackPath.async_d2h:
                self.copy_stream = backend.create_stream("vt-readback")
            for i in range(n_slots):
                self.slots.append(self._make_slot(i, inputs_nbytes))
        except BaseException:
            self.close()
            raise

    def _make_slot(self, index: int, inputs_nbytes: int) -> OutputSlot:
        b = self.backend
        ids = b.alloc(self.max_rows * 4)
        slot = OutputSlot(
            index=index,
            ids=ids,
            inputs=b.alloc_pinned(inputs_nbytes),
            host_ids=b.alloc_pinned(self.max_rows * 4)
            if self.path is ReadbackPath.async_d2h
            else None,
            fork=b.create_event(),
            ready=b.create_event(),
        )
        b.memset(ids, 0)
        return slot

    def acquire(self) -> OutputSlot:
        """The next slot, once its previous step's output is on the host."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        if slot.pending is not None:
            # The caller ran n_slots steps ahead of get_output(): read this one now so its
            # device ids, pinned staging and input staging can be reused.
            with contextlib.suppress(Exception):  # kept for that step's get_output()
                slot.pending._materialize()
        return slot

    def publish(self, slot: OutputSlot, lp_nbytes: int = 0) -> None:
        """Enqueue the readback of ``slot.ids`` (and of the first ``lp_nbytes`` of
        ``slot.lp``) after the step's sampling on the main stream."""
        b = self.backend
        if self.path is ReadbackPath.async_d2h:
            assert self.copy_stream is not None and slot.host_ids is not None
            b.record_event(slot.fork, self.main)
            b.stream_wait_event(self.copy_stream, slot.fork)
            b.copy_d2h_async(slot.host_ids, slot.ids, self.copy_stream)
            if lp_nbytes:
                assert slot.lp is not None and slot.host_lp is not None
                h = slot.host_lp
                part = HostBuffer(h.array[:lp_nbytes], handle=h.handle, pinned=h.pinned)
                b.copy_d2h_async(part, slot.lp, self.copy_stream)
            b.record_event(slot.ready, self.copy_stream)
        else:
            b.record_event(slot.ready, self.main)

    def _wait_ready(self, slot: OutputSlot) -> None:
        if self.has_events:
            self.backend.synchronize_event(slot.ready)
        else:
            self.backend.synchronize(self.main)

    def read(self, slot: OutputSlot, n: int) -> np.ndarray:
        """Block until ``slot``'s step is done; its first ``n`` sampled ids (a host copy)."""
        b = self.backend
        if self.path is ReadbackPath.host_view:
            self._wait_ready(slot)
            return b.host_view(slot.ids)[: 4 * n].view(np.int32).copy()
        if self.path is ReadbackPath.async_d2h:
            assert slot.host_ids is not None
            b.synchronize_event(slot.ready)
            return slot.host_ids.array[: 4 * n].view(np.int32).copy()
        b.synchronize(self.main)
        out = np.zeros(n, dtype=np.int32)
        if n:
            b.copy_d2h(out, slot.ids)
        return out

    def enable_logprobs(self, vocab: int, max_k: int, on_device: bool) -> None:
        """Give every slot what a step's logprobs need: a device buffer for the logprobs
        op's results (``on_device``; pinned landing on the async path) or for a copy of the
        step's logits (the host fallback). Call it between steps."""
        b = self.backend
        self.vocab = vocab
        self.lp_on_device = on_device
        lp_bytes = max(4 * self.max_rows * (1 + 2 * max_k), 4)
        if any(s.lp is not None and s.lp.nbytes < lp_bytes for s in self.slots):
            self.drain()  # a step in flight may still have its results in a buffer to free
        for slot in self.slots:
            if not on_device:
                if slot.logits is None:
                    slot.logits = b.alloc(self.max_rows * vocab * 4)
                continue
            if slot.lp is not None and slot.lp.nbytes >= lp_bytes:
                continue
            if slot.lp is not None:
                b.free(slot.lp)
                slot.lp = None
            if slot.host_lp is not None:
                b.free_pinned(slot.host_lp)
                slot.host_lp = None
            slot.lp = b.alloc(lp_bytes)
            if self.path is ReadbackPath.async_d2h:
                slot.host_lp = b.alloc_pinned(lp_bytes)

    def read_logprobs(
        self, slot: OutputSlot, ids: np.ndarray, rows: dict[int, int]
    ) -> dict[int, TokenLogprobs]:
        """The log-probabilities of ``rows`` (sampled row -> alternatives wanted) of the step
        in ``slot``, whose ids were just read (so its results or logits copy are complete)."""
        if self.lp_on_device:
            return self._read_device_logprobs(slot, rows)
        from ..reference.sampling import logprobs

        assert slot.logits is not None
        vocab = self.vocab
        n = max(rows) + 1
        if self.path is ReadbackPath.host_view:
            raw = self.backend.host_view(slot.logits)[: n * vocab * 4]
            logits = raw.view(np.float32).reshape(n, vocab)
        else:
            logits = np.empty((n, vocab), dtype=np.float32)
            self.backend.copy_d2h(logits, slot.logits)
        self.lp_bytes_read += logits.nbytes
        picked = sorted(rows)
        k = max(rows.values())
        chosen, top_ids, top_lp = logprobs(logits[picked], ids[picked], k)
        out: dict[int, TokenLogprobs] = {}
        for i, j in enumerate(picked):
            top = [(int(t), float(v)) for t, v in zip(top_ids[i], top_lp[i], strict=True)]
            out[j] = (float(chosen[i]), top[: rows[j]])
        return out

    def _read_device_logprobs(
        self, slot: OutputSlot, rows: dict[int, int]
    ) -> dict[int, TokenLogprobs]:
        layout = LogprobLayout.of(rows)
        n = layout.nbytes
        assert slot.lp is not None
        if self.path is ReadbackPath.host_view:
            raw = self.backend.host_view(slot.lp)[:n]
        elif self.path is ReadbackPath.async_d2h:
            assert slot.host_lp is not None
            raw = slot.host_lp.array[:n]
        else:
            raw = np.empty(n, dtype=np.uint8)
            self.backend.copy_d2h(raw, slot.lp)
        self.lp_bytes_read += n
        return layout.parse(raw, rows)

    def reset(self, error: Exception) -> None:
        """Forget every step still pending (after a failed step, once the streams have
        drained): its :meth:`StepOutput.get_output` raises ``error``, and every slot is
        free again."""
        for slot in self.slots:
            pending, slot.pending = slot.pending, None
            if pending is not None and pending._slot is not None:
                pending._slot = None
                pending._error = error
        self._next = 0

    def drain(self) -> None:
        """Read every pending output, so that each stays readable after :meth:`close`."""
        for slot in self.slots:
            if slot.pending is not None:
                with contextlib.suppress(Exception):  # kept for that step's get_output()
                    slot.pending._materialize()

    def close(self) -> None:
        """Free the pool (idempotent). Pending outputs are read first."""
        b = self.backend
        self.drain()
        slots, self.slots = self.slots, []
        for slot in slots:
            b.free(slot.ids)
            if slot.logits is not None:
                b.free(slot.logits)
            if slot.lp is not None:
                b.free(slot.lp)
            if slot.host_lp is not None:
                b.free_pinned(slot.host_lp)
            b.free_pinned(slot.inputs)
            if slot.host_ids is not None:
                b.free_pinned(slot.host_ids)
            b.destroy_event(slot.fork)
            b.destroy_event(slot.ready)
        if self.copy_stream is not None:
            b.synchronize(self.copy_stream)
            b.destroy_stream(self.copy_stream)
            self.copy_stream = None
