"""The batched model runner: one flattened step of many sequences, sampled on the device.

A step is a list of :class:`SeqChunk`, one per sequence (KV slot). Their tokens become the
rows of one ``[n_tokens, dim]`` activation with per-row positions and slots (vLLM style), so
a decode step over many sequences is one matmul per projection, and a prompt is prefilled
in chunks of at most ``max_batch_tokens`` that the caller cuts.

:meth:`ModelRunner.execute` validates the chunks on the host, grows the KV cache, stages the
host inputs in the pinned buffer of the step's output slot, enqueues one host-to-device copy
plus the kernels, and returns a :class:`~vt.execution.readback.StepOutput` at once. A chunk marked
``from_previous`` takes its input token from the ids the previous step sampled, copied
device-to-device, so the host's bookkeeping of step N overlaps the device running N+1.
Every buffer a step touches is allocated in ``__init__``; a step enqueues kernels, copies
and events only, never a host synchronisation. Where the backend declares ``graphs``,
decode-only steps replay their forward pass as a graph captured once per shape
(:mod:`vt.execution.step_graphs` says what is captured and why replays are right).

Logprobs (:meth:`ModelRunner.enable_logprobs`): a chunk that asks gets its sampled id's
logprob and ``k`` alternatives from the op ``logprobs``, launched after the forward pass
for the asking rows only, or (a backend without the op) from a copy of the logits reduced
on the host. A prompt chunk may also ask for its prompt tokens' logprobs
(``SeqChunk.prompt_logprobs``, for ``echo``): its rows then get logits too, so a step's
sampled plus scored rows are at most ``max_rows``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import VtError
from ..model.graph import ARCHITECTURE_OPS, LlamaGraph, StepInputs, check_backend
from ..protocol.backend import SAMPLE_PARAMS_DTYPE, Backend, Buffer, HostBuffer, KVLayout, Tensor
from ..protocol.handles import F32, I32
from ..reference.sampling import MAX_TOP_LOGPROBS
from .memory.kv import KVCache
from .readback import (
    LogprobLayout,
    OutputAlreadyReadError,
    OutputPool,
    OutputSlot,
    ReadbackPath,
    StepOutput,
    async_scheduling_enabled,
    choose_readback,
)
from .step_graphs import (
    DEFAULT_MAX_GRAPHS,
    StepGraphs,
    bucket,
    context_bound,
    context_classes,
    graphs_enabled,
    padding,
    prefill_graphs_enabled,
    token_bucket,
)

__all__ = [
    "DEFAULT_MAX_MODEL_LEN",
    "InvalidStepError",
    "ModelRunner",
    "OutputAlreadyReadError",
    "ReadbackPath",
    "RunnerError",
    "SeqChunk",
    "StepOutput",
]

#: ``max_model_len=None`` means the model's context length, capped here (llama.cpp's
#: default context) so that a contiguous KV cache of a long-context model stays modest.
DEFAULT_MAX_MODEL_LEN = 4096
_ALIGN = 256
_U32_MAX = 2**32 - 1
_I32_MAX = 2**31 - 1
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


class RunnerError(VtError):
    """The runner was misused (for example, used after :meth:`ModelRunner.close`)."""


class InvalidStepError(RunnerError, ValueError):
    """A step's chunks are invalid; nothing was enqueued and no state changed."""


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step.

    ``token_ids`` are the chunk's tokens from the host (a prompt chunk), or None with
    ``from_previous=True``: then the one input token is the id this slot sampled in the
    previous step, taken device-side. ``sample=False`` for a non-final prefill chunk.
    """

    slot: int
    start_pos: int
    token_ids: list[int] | None
    from_previous: bool = False
    sample: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    counter: int = 0
    logprobs: int | None = None  # the sampled id's logprob and this many alternatives
    #: Score the chunk's prompt tokens (echo): each scored row's logprob of the token that
    #: follows it, and this many alternatives. The rows are all of a non-sampled chunk and
    #: all but the last (the sampled one) of a sampled chunk; ``prompt_targets`` holds the
    #: ids that follow them (the next prompt tokens), one per scored row.
    prompt_logprobs: int | None = None
    prompt_targets: list[int] | None = None

    @property
    def n_tokens(self) -> int:
        if self.from_previous:
            return 1
        return 0 if self.token_ids is None else len(self.token_ids)


@dataclass
class _Plan:
    """A validated step: chunks in row order and where each one's rows go."""

    chunks: list[SeqChunk]  # row order: from_previous first (by previous sample index)
    row0: list[int]
    ids: list[np.ndarray | None]
    n_tokens: int
    sampled: list[int]  # indices into ``chunks`` of sampled chunks, in sample order
    copies: list[tuple[int, int, int]]  # (first row, first previous index, count)
    max_end: int
    decode: bool = False  # every chunk one sampled token (from the device or the host)
    rows: int = 0  # rows the forward pass runs: 0 means n_tokens; else a padded bucket
    samples: int = 0  # sampled rows the forward pass runs: 0 means exact; else a bucket
    pad: tuple[int, int] | None = None  # (slot, position) of the padding rows
    #: Scored prompt rows, in logits order after the sampled ones: (chunk index, token row,
    #: target id, alternatives).
    scored: list[tuple[int, int, int, int]] | None = None


@dataclass(frozen=True)
class _InputLayout:
    """Byte offsets of one step's host inputs, identical in pinned staging and on device."""

    ids: int
    positions: int
    slots: int
    rows: int
    params: int
    lp_rows: int  # the sampled rows whose logprobs the step computes on the device
    lp_ids: int  # the ids that follow the scored prompt rows (echo)
    nbytes: int

    @classmethod
    def for_sizes(cls, max_tokens: int, max_rows: int) -> _InputLayout:
        sizes = [max_tokens * 4] * 3 + [max_rows * 4, max_rows * SAMPLE_PARAMS_DTYPE.itemsize]
        sizes += [max_rows * 4, max_rows * 4]
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += -(-size // _ALIGN) * _ALIGN
        return cls(*offsets, nbytes=at)


def batch_tokens(backend: Backend, asked: int | None) -> Any:
    """Tokens per step: ``asked``, else the backend's ``default_batch_tokens`` (checked by
    the runner like a number given)."""
    return int(getattr(backend, "default_batch_tokens", 256)) if asked is None else asked


class ModelRunner:
    """Runs the llama-family graph on ``backend`` in batched, asynchronous steps.

    ``model`` is a :class:`vt.model.ModelFile`. ``max_slots`` sequences may be live at once
    (KV slots ``0..max_slots-1``); a step holds at most ``max_batch_tokens`` tokens.
    ``async_scheduling`` (default: on unless ``VT_ASYNC_RUNNER=0``) off forces the ``sync``
    readback path. ``readback`` tells the path chosen from the backend's *effective*
    capabilities, ``readback_reason`` why. ``graphs`` (default: on unless ``VT_GRAPHS=0``,
    and only where the effective capabilities declare ``graphs``) replays decode-only steps
    as graphs, at most ``max_graphs`` shapes cached; ``graphs_reason`` says why on or off.
    ``prefill_graphs`` (default: ``VT_PREFILL_GRAPHS``, else the backend's
    ``prefill_graphs`` hint) replays prefill and mixed steps too, padded to a token bucket;
    ``prefill_graphs_reason`` says why on or off.
    """

    def __init__(
        self,
        backend: Backend,
        model: Any,
        *,
        max_slots: int = 8,
        max_model_len: int | None = None,
        max_batch_tokens: int | None = None,
        kv_cache: str = "auto",
        async_scheduling: bool | None = None,
        n_output_slots: int = 3,
        graphs: bool | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        prefill_graphs: bool | None = None,
    ) -> None:
        config = model.config
        max_batch_tokens = batch_tokens(backend, max_batch_tokens)
        if config.architecture in ARCHITECTURE_OPS:  # else LlamaGraph names the problem
            check_backend(backend, config.architecture)
        for name, value in (
            ("max_slots", max_slots),
            ("max_batch_tokens", max_batch_tokens),
            ("n_output_slots", n_output_slots),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, flag in (
            ("async_scheduling", async_scheduling),
            ("graphs", graphs),
            ("prefill_graphs", prefill_graphs),
        ):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} must be True, False or None, got {flag!r}")
        if max_model_len is None:
            max_model_len = min(int(config.context_length), DEFAULT_MAX_MODEL_LEN)
        if not isinstance(max_model_len, int) or isinstance(max_model_len, bool):
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        if not 0 < max_model_len <= config.context_length:
            raise ValueError(
                f"max_model_len={max_model_len} must be between 1 and the model's context "
                f"length {config.context_length}"
            )
        self.context_classes = context_classes(backend)
        enabled, why = async_scheduling_enabled(async_scheduling)
        path, reason = choose_readback(backend.capabilities, enabled)
        use_graphs, self.graphs_reason = graphs_enabled(backend.capabilities, graphs)
        self.graphs: bool = use_graphs
        self._graphs = StepGraphs(backend, use_graphs, max_graphs)
        self.prefill_graphs: bool
        self.prefill_graphs, self.prefill_graphs_reason = prefill_graphs_enabled(
            backend, use_graphs, prefill_graphs
        )

        self.backend = backend
        self.config = config
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.max_rows = min(max_slots, max_batch_tokens)
        self.readback: str = path.value
        self.readback_reason = reason if enabled else f"{reason} ({why})"
        self.async_scheduling = enabled
        self.logprobs_enabled = False  # enable_logprobs() allocates what logprobs need
        self.max_logprobs = 0
        self.logprobs_on_device = False  # the backend's logprobs op, else the host fallback
        self.layout = KVLayout(
            n_layers=config.n_layers,
            n_slots=max_slots,
            max_len=max_model_len,
            n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim,
        )
        self._closed = False
        self._step = 0
        self._seq_len = [0] * max_slots
        # (output slot of the previous step, {kv slot: its index among that step's samples})
        self._prev: tuple[Any, dict[int, int]] | None = None
        # Per slot, the sampling settings (with their types) _check_sampling last passed:
        # a request's rows repeat them every step, and their checks were a fifth of a
        # decode row's host time (benchmarks/engine_host.py).
        self._sampling_ok: dict[int, tuple[Any, ...]] = {}
        self._in = _InputLayout.for_sizes(max_batch_tokens, self.max_rows)

        self.graph: LlamaGraph | None = None
        self.kv: KVCache | None = None  # type: ignore[assignment]
        self._act = None
        self._inputs: Buffer | None = None
        self._graph_ids: Buffer | None = None  # where a replayed step samples into
        self._pool: OutputPool | None = None
        self.stream = None
        try:
            self.graph = LlamaGraph(backend, model)
            self.stream = backend.create_stream("vt-main")
            self.kv = KVCache.create(backend, self.layout, kind=kv_cache)
            self._act = self.graph.allocate(max_batch_tokens, self.max_rows)
            self._inputs = backend.alloc(self._in.nbytes)
            self._graph_ids = backend.alloc(self.max_rows * 4)
            self._pool = OutputPool(
                backend, path, n_output_slots, self.max_rows, self._in.nbytes, self.stream
            )
        except BaseException:
            self.close()
            raise
        i = self._in
        self._io = StepInputs(
            ids=self._inputs.view(i.ids, max_batch_tokens * 4),
            positions=self._inputs.view(i.positions, max_batch_tokens * 4),
            slots=self._inputs.view(i.slots, max_batch_tokens * 4),
            rows=self._inputs.view(i.rows, self.max_rows * 4),
            params=self._inputs.view(i.params, self.max_rows * SAMPLE_PARAMS_DTYPE.itemsize),
        )
        self._lp_rows = self._inputs.view(i.lp_rows, self.max_rows * 4)
        self._lp_ids = self._inputs.view(i.lp_ids, self.max_rows * 4)

    # ---- public API
    def execute(self, chunks: list[SeqChunk]) -> StepOutput:
        """Enqueue one step and return at once; ``get_output()`` gives ``{slot: id}``."""
        return self._enqueue(chunks)[0]

    def compute_logits(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Run one step synchronously; the float32 logits of its sampled rows.

        Row ``i`` belongs to the ``i``-th chunk with ``sample=True``, in the order given.
        The step counts as a normal step (KV written, ids sampled for ``from_previous``).
        """
        _, plan = self._enqueue(chunks)
        assert self._act is not None and self.stream is not None
        n = len(plan.sampled)
        logits = np.zeros((n, self.config.vocab_size), dtype=np.float32)
        self.backend.synchronize(self.stream)
        if n:
            self.backend.copy_d2h(logits, self._act.logits)
        sample_slot = [plan.chunks[k].slot for k in plan.sampled]
        order = [sample_slot.index(c.slot) for c in chunks if c.sample]
        return logits[order]

    def free_slot(self, slot: int, keep: int = 0) -> None:
        """Forget the sequence in ``slot``; the next chunk for it must start at position 0,
        or, with ``keep``, at any position up to ``keep``: positions ``0..keep-1`` (of those
        written) stay as they are, for a next sequence that starts with the same tokens
        (prefix reuse)."""
        self._check_open()
        self._check_slot(slot)
        if not _is_int(keep) or keep < 0:
            raise InvalidStepError(f"keep {keep!r} must be an integer >= 0")
        self._seq_len[slot] = min(int(keep), self._seq_len[slot])
        if self._prev is not None:
            self._prev[1].pop(slot, None)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make ``dst`` hold ``src``'s first ``n`` positions, as :meth:`free_slot` with
        ``keep=n`` leaves them in place: its next chunk may start at any position up to
        ``n``. The KV bytes are copied on the runner's stream, ordered after every step
        enqueued so far (``src``'s last one included) and before the next, one position at
        a time (a slot's position is contiguous in the position-major cache), so the copy
        is bit for bit what ``src`` computed. ``dst``'s own sequence is forgotten."""
        self._check_open()
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            raise InvalidStepError(f"copy_prefix: source and destination are both slot {src}")
        if not _is_int(n) or not 0 <= n <= self._seq_len[src]:
            raise InvalidStepError(
                f"copy_prefix: {n!r} positions asked of slot {src}, which holds "
                f"{self._seq_len[src]}"
            )
        assert self.kv is not None and self.stream is not None
        layout, cache = self.layout, self.kv.buffer
        size, stride = layout.token_bytes, layout.position_bytes
        for pos in range(n):
            base = pos * stride
            self.backend.copy_d2d(
                cache.view(base + dst * size, size), cache.view(base + src * size, size), size,
                self.stream,
            )  # fmt: skip
        self._seq_len[dst] = n
        if self._prev is not None:
            self._prev[1].pop(dst, None)

    def seq_len(self, slot: int) -> int:
        """Positions of ``slot`` written by the steps enqueued so far."""
        self._check_slot(slot)
        return self._seq_len[slot]

    def _check_slot(self, slot: object) -> None:
        if not _is_int(slot) or not 0 <= slot < self.max_slots:  # type: ignore[operator]
            raise InvalidStepError(f"slot {slot!r} is outside 0..{self.max_slots - 1}")

    @property
    def graph_stats(self) -> dict[str, int]:
        """Graphs cached now, and how many were captured, replayed, evicted, invalidated."""
        g = self._graphs
        return {
            "cached": len(g),
            "captures": g.captures,
            "replays": g.replays,
            "evictions": g.evictions,
            "invalidations": g.invalidations,
        }

    def enable_logprobs(
        self, max_logprobs: int = MAX_TOP_LOGPROBS, on_device: bool | None = None
    ) -> None:
        """Let chunks ask for logprobs (``SeqChunk.logprobs`` up to ``max_logprobs``). Call
        it between steps.

        Where the backend runs the op ``logprobs`` (``on_device`` None: whenever it says it
        supports it), a step that asks launches it after sampling, for the asking rows
        only, and reads back ``4 * (1 + 2k)`` bytes per row with the sampled ids. Else (the
        op's fallback) each output slot gets a device buffer for a copy of its step's logits
        (``max_rows * vocab`` floats), read back and reduced on the host for steps that ask.
        """
        self._check_open()
        if not 0 <= max_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {max_logprobs}")
        device = self.backend.supports("logprobs") if on_device is None else bool(on_device)
        if device and not self.backend.supports("logprobs"):
            raise ValueError(f"backend {self.backend.name!r} does not implement the op logprobs")
        if self.logprobs_enabled and device != self.logprobs_on_device:
            raise ValueError("logprobs are already enabled on the other path")
        assert self._pool is not None
        self.max_logprobs = max(self.max_logprobs, max_logprobs)
        self._pool.enable_logprobs(self.config.vocab_size, self.max_logprobs, device)
        self.logprobs_on_device = device
        self.logprobs_enabled = True

    def recover(self) -> None:
        """After a failed step: bring the runner back to a known-good state, or raise.

        Waits for the streams (which also clears an error a backend keeps until its stream
        is synchronized, as a device does), drops every step still in flight (its
        ``get_output()`` raises), forgets every sequence (every slot starts at position 0,
        no previous step for ``from_previous``) and every captured graph. Then one probe
        step (one greedy token in slot 0) must run and read back a valid id. Raises
        :class:`RunnerError` naming what failed when the device is not usable.
        """
        self._check_open()
        assert self._pool is not None and self.stream is not None
        b = self.backend
        streams = [self.stream]
        if self._pool.copy_stream is not None:
            streams.append(self._pool.copy_stream)
        for stream in streams:
            error: Exception | None = None
            for _ in range(2):  # the first synchronize may report (and clear) the error
                try:
                    b.synchronize(stream)
                    error = None
                    break
                except Exception as exc:  # noqa: BLE001 - reported if it persists
                    error = exc
            if error is not None:
                raise RunnerError(
                    f"the device did not recover: synchronizing its stream keeps failing "
                    f"({type(error).__name__}: {error})"
                ) from error
        self._pool.reset(RunnerError("this step was dropped after a failed step"))
        self._prev = None
        self._seq_len = [0] * self.max_slots
        try:
            self._graphs.clear(self.stream)
            out = self.execute([SeqChunk(slot=0, start_pos=0, token_ids=[0], temperature=0.0)])
            token = out.get_output()[0]
        except Exception as exc:
            raise RunnerError(
                f"the device did not recover: a probe step failed ({type(exc).__name__}: {exc})"
            ) from exc
        finally:
            self._prev = None
            self._seq_len = [0] * self.max_slots
        if not 0 <= token < self.config.vocab_size:
            raise RunnerError(
                f"the device did not recover: a probe step sampled id {token}, outside the "
                f"vocabulary 0..{self.config.vocab_size - 1}"
            )

    def synchronize(self) -> None:
        """Block until every enqueued step has finished on the device."""
        self._check_open()
        assert self.stream is not None
        self.backend.synchronize(self.stream)

    def close(self) -> None:
        """Release device memory and streams (idempotent). Pending outputs stay readable."""
        if self._closed:
            return
        self._closed = True
        b = self.backend
        if self.stream is not None:
            for _ in range(2):  # an error of a failed step is reported (and cleared) first
                try:
                    b.synchronize(self.stream)
                    break
                except Exception:  # noqa: BLE001 - releasing anyway; the step reported it
                    continue
        self._graphs.close(self.stream)
        if self._pool is not None:
            self._pool.close()
        if self._inputs is not None:
            b.free(self._inputs)
        if self._graph_ids is not None:
            b.free(self._graph_ids)
        if self._act is not None and self.graph is not None:
            self.graph.free_activations(self._act)
        if self.kv is not None:
            self.kv.release()
        if self.graph is not None:
            self.graph.close()
        if self.stream is not None:
            b.destroy_stream(self.stream)
        self._pool = self._inputs = self._graph_ids = self._act = self.stream = None

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ModelRunner(backend={self.backend.name!r}, arch={self.config.architecture!r}, "
            f"readback={self.readback!r}, graphs={self.graphs}, max_slots={self.max_slots}, "
            f"max_model_len={self.max_model_len}, max_batch_tokens={self.max_batch_tokens})"
        )

    # ---- the step
    def _check_open(self) -> None:
        if self._closed:
            raise RunnerError("the model runner is closed")

    def _enqueue(self, chunks: list[SeqChunk]) -> tuple[StepOutput, _Plan]:
        self._check_open()
        plan = self._plan(chunks)
        assert self.kv is not None and self._pool is not None and self.graph is not None
        assert self._act is not None and self.stream is not None and self._inputs is not None
        b, main = self.backend, self.stream
        replay = self.graphs and (plan.decode or (self.prefill_graphs and not plan.scored))
        if replay:  # padded to a bucket: few shapes, few graphs
            self._pad(plan)
        # Growth maps on the host now; the zeroing of fresh memory goes on the main stream,
        # ahead of this step, so it does not wait for steps still in flight.
        self.kv.ensure_positions(plan.max_end, main)
        want = {
            j: c.logprobs
            for j, c in enumerate(plan.chunks[k] for k in plan.sampled)
            if c.logprobs is not None
        }
        scored = plan.scored or []
        n_rows = len(plan.sampled)
        want.update({n_rows + i: kk for i, (_, _, _, kk) in enumerate(scored)})
        slot = self._pool.acquire()
        self._stage(slot.inputs, plan, want)
        b.copy_h2d_async(self._inputs, slot.inputs, main)
        if plan.copies:
            assert self._prev is not None
            prev_ids = self._prev[0].ids
            for row, index, count in plan.copies:
                b.copy_d2d(
                    self._io.ids.view(row * 4, count * 4),
                    prev_ids.view(index * 4, count * 4),
                    count * 4,
                    main,
                )
        graph, act, io, kv = self.graph, self._act, self._io, self.kv.buffer
        rows = plan.rows or plan.n_tokens
        sampled = plan.samples or n_rows + len(scored)  # scored rows: logits too
        context = context_bound(self.context_classes, plan.max_end, self.max_model_len)

        def forward(out_ids: Buffer) -> None:
            graph.forward(act, io, kv, self.layout, rows, sampled, out_ids, main, context)

        if replay:
            assert self._graph_ids is not None
            ids = self._graph_ids
            self._graphs.run((rows, sampled, context), kv, main, lambda: forward(ids))
            if n_rows:  # the output slot differs per step; the captured ids buffer does not
                b.copy_d2d(slot.ids, ids, n_rows * 4, main)
        else:
            forward(slot.ids)
        lp_nbytes = self._logprobs(slot, want, n_rows, len(scored)) if want else 0
        self._pool.publish(slot, lp_nbytes)
        sampled_slots = tuple(plan.chunks[k].slot for k in plan.sampled)
        targets = tuple((plan.chunks[k].slot, t) for k, _, t, _ in scored)
        out = StepOutput(self._pool, slot, sampled_slots, self._step, want, targets)
        slot.pending = out
        self._prev = (slot, {s: j for j, s in enumerate(sampled_slots)})
        for chunk in plan.chunks:
            self._seq_len[chunk.slot] = chunk.start_pos + chunk.n_tokens
        self._step += 1
        return out, plan

    def _logprobs(self, slot: OutputSlot, want: dict[int, int], n_rows: int, n_scored: int) -> int:
        """Enqueue what the step's logprobs need; the bytes of ``slot.lp`` to read back.
        Logits rows ``n_rows..`` are the ``n_scored`` scored prompt rows: their "chosen"
        ids (the next prompt tokens, staged with the inputs) go after the sampled ids.

        On the device: one ``logprobs`` launch over the asking rows, after the forward pass
        (captured or not: it runs eagerly after a graph replay, as the ids' copy does, so
        graphs never depend on who asked). Else: keep the step's logits for the host (the
        next step overwrites them)."""
        assert self._act is not None and self.stream is not None
        b, main, act, vocab = self.backend, self.stream, self._act, self.config.vocab_size
        if not self.logprobs_on_device:
            assert slot.logits is not None
            b.copy_d2d(slot.logits, act.logits, (max(want) + 1) * vocab * 4, main)
            return 0
        layout = LogprobLayout.of(want)
        m, k = layout.m, layout.k
        n_logits = n_rows + n_scored
        assert slot.lp is not None
        if n_scored:  # never read back as ids: get_output reads the first n_rows
            b.copy_d2d(slot.ids.view(4 * n_rows, 4 * n_scored), self._lp_ids, 4 * n_scored, main)
        b.launch(
            "logprobs", main,
            chosen=Tensor(slot.lp.view(0, 4 * m), F32, (m,)),
            top_ids=Tensor(slot.lp.view(4 * m, 4 * m * k), I32, (m, k)),
            top_logprobs=Tensor(slot.lp.view(4 * m * (1 + k), 4 * m * k), F32, (m, k)),
            logits=Tensor(act.logits, F32, (n_logits, vocab)),
            ids=Tensor(slot.ids, I32, (n_logits,)),
            rows=Tensor(self._lp_rows, I32, (m,)),
        )  # fmt: skip
        return layout.nbytes

    def _pad(self, plan: _Plan) -> None:
        """Pad a step to its bucket of rows and of sampled rows
        (:mod:`vt.execution.step_graphs` says why the padding rows change nothing real)."""
        n, s = plan.n_tokens, len(plan.sampled)
        if plan.decode:  # every row sampled, padding rows too
            rows = bucket(n, self.max_rows)
            ends = [(c.slot, c.start_pos) for c in plan.chunks]
        else:  # padding rows extend the last chunk's sequence where it has room
            rows = token_bucket(n, self.max_batch_tokens)
            ends = [(c.slot, c.start_pos + c.n_tokens - 1) for c in reversed(plan.chunks)]
        if rows > n:
            plan.pad = padding(ends, self.max_model_len)
            if plan.pad is None:  # every sequence is at its last position: the exact rows
                rows = n
            else:
                plan.max_end = max(plan.max_end, plan.pad[1] + 1)
        plan.rows = rows
        plan.samples = rows if plan.decode else bucket(s, min(rows, self.max_rows)) if s else 0

    def _stage(self, inputs: HostBuffer, plan: _Plan, want: dict[int, int]) -> None:
        """Write the step's host inputs into ``inputs`` (its output slot's pinned staging)."""
        lay, raw = self._in, inputs.array
        if want and self.logprobs_on_device:
            picked = LogprobLayout.of(want).picked
            raw[lay.lp_rows : lay.lp_rows + 4 * len(picked)].view(np.int32)[:] = picked
        scored = plan.scored or []
        if scored:
            s0 = len(plan.sampled)
            at = lay.rows + 4 * s0
            raw[at : at + 4 * len(scored)].view(np.int32)[:] = [row for _, row, _, _ in scored]
            at = lay.params + SAMPLE_PARAMS_DTYPE.itemsize * s0
            p = raw[at : at + SAMPLE_PARAMS_DTYPE.itemsize * len(scored)]
            p.view(SAMPLE_PARAMS_DTYPE)[:] = (0.0, 1.0, 0, 0, 0)  # greedy, never read
            ids = raw[lay.lp_ids : lay.lp_ids + 4 * len(scored)].view(np.int32)
            ids[:] = [t for _, _, t, _ in scored]
        real, s_real = plan.n_tokens, len(plan.sampled)
        # Rows real.. are padding (token 0, one slot and position); sampled rows s_real..
        # sample padding rows, else the last row, greedily: never read back.
        n, s = max(real, plan.rows), max(s_real, plan.samples)
        ids = raw[lay.ids : lay.ids + 4 * n].view(np.int32)
        pos = raw[lay.positions : lay.positions + 4 * n].view(np.int32)
        slots = raw[lay.slots : lay.slots + 4 * n].view(np.int32)
        rows = raw[lay.rows : lay.rows + 4 * s].view(np.int32)
        params = raw[lay.params : lay.params + SAMPLE_PARAMS_DTYPE.itemsize * s].view(
            SAMPLE_PARAMS_DTYPE
        )
        if plan.decode:  # a row a chunk, rows in the chunks' order: one write an array
            # from_previous rows get their id device-side after this copy lands
            ids[:real] = [0 if tok is None else tok[0] for tok in plan.ids]
            pos[:real] = [c.start_pos for c in plan.chunks]
            slots[:real] = [c.slot for c in plan.chunks]
        else:
            for chunk, row0, tok in zip(plan.chunks, plan.row0, plan.ids, strict=True):
                m = chunk.n_tokens
                ids[row0 : row0 + m] = 0 if tok is None else tok
                pos[row0 : row0 + m] = np.arange(chunk.start_pos, chunk.start_pos + m)
                slots[row0 : row0 + m] = chunk.slot
        if plan.sampled:
            picked = [plan.chunks[k] for k in plan.sampled]
            rows[:s_real] = [plan.row0[k] + plan.chunks[k].n_tokens - 1 for k in plan.sampled]
            params[:s_real] = [(c.temperature, c.top_p, c.top_k, c.seed, c.counter) for c in picked]
        if plan.pad is not None:
            ids[real:], pos[real:], slots[real:] = 0, plan.pad[1], plan.pad[0]
        if s > s_real:
            rows[s_real:] = np.minimum(np.arange(real, real + s - s_real), n - 1)
            params[s_real:] = (0.0, 1.0, 0, 0, 0)

    # ---- validation
    def _plan(self, chunks: list[SeqChunk]) -> _Plan:
        if not isinstance(chunks, (list, tuple)) or not chunks:
            raise InvalidStepError("a step needs a non-empty list of SeqChunk")
        prev = self._prev[1] if self._prev is not None else {}
        seen: set[int] = set()
        ids: dict[int, np.ndarray | None] = {}
        for c in chunks:
            if not isinstance(c, SeqChunk):
                raise InvalidStepError(f"expected SeqChunk, got {type(c).__name__}")
            ids[id(c)] = self._check_chunk(c, seen, prev)
        total = sum(c.n_tokens for c in chunks)
        if total > self.max_batch_tokens:
            raise InvalidStepError(
                f"the step holds {total} tokens but max_batch_tokens is "
                f"{self.max_batch_tokens}; split long prompts into chunks"
            )
        # from_previous rows first, ordered as the previous step sampled them, so their ids
        # arrive in as few device-to-device copies as there are runs (usually one).
        follow = sorted((c for c in chunks if c.from_previous), key=lambda c: prev[c.slot])
        order = follow + [c for c in chunks if not c.from_previous]
        row0, at = [], 0
        for c in order:
            row0.append(at)
            at += c.n_tokens
        sampled = [k for k, c in enumerate(order) if c.sample]
        scored = [
            (k, row0[k] + i, int(t), int(c.prompt_logprobs))
            for k, c in enumerate(order)
            if c.prompt_logprobs is not None and c.prompt_targets
            for i, t in enumerate(c.prompt_targets)
        ]
        if len(sampled) + len(scored) > self.max_rows:
            raise InvalidStepError(
                f"the step has {len(sampled)} sampled and {len(scored)} scored prompt rows, "
                f"more than the {self.max_rows} rows of logits a step holds (max_rows)"
            )
        copies: list[tuple[int, int, int]] = []
        for row, c in enumerate(follow):  # each from_previous chunk is one row
            index = prev[c.slot]
            last = copies[-1] if copies else None
            if last is not None and last[0] + last[2] == row and last[1] + last[2] == index:
                copies[-1] = (last[0], last[1], last[2] + 1)
            else:
                copies.append((row, index, 1))
        return _Plan(
            chunks=order,
            row0=row0,
            ids=[ids[id(c)] for c in order],
            n_tokens=total,
            sampled=sampled,
            copies=copies,
            max_end=max(c.start_pos + c.n_tokens for c in order),
            decode=not scored and all(c.n_tokens == 1 and c.sample for c in order),
            scored=scored,
        )

    def _check_chunk(self, c: SeqChunk, seen: set[int], prev: dict[int, int]) -> np.ndarray | None:
        slot = c.slot
        self._check_slot(slot)
        if slot in seen:
            raise InvalidStepError(f"slot {slot} appears more than once in the step")
        seen.add(slot)
        tok: np.ndarray | None = None
        if c.from_previous:
            if c.token_ids is not None:
                raise InvalidStepError(
                    f"slot {slot}: a from_previous chunk takes its token from the device; "
                    "token_ids must be None"
                )
            if slot not in prev:
                raise InvalidStepError(
                    f"slot {slot}: from_previous needs an id sampled for this slot in the "
                    "previous step, and there is none"
                )
        else:
            if c.token_ids is None or len(c.token_ids) == 0:
                raise InvalidStepError(
                    f"slot {slot}: a chunk needs token_ids (or from_previous=True)"
                )
            try:
                tok = np.asarray(c.token_ids)
            except (TypeError, ValueError) as exc:
                raise InvalidStepError(f"slot {slot}: token_ids are not integers") from exc
            if tok.ndim != 1 or not np.issubdtype(tok.dtype, np.integer):
                raise InvalidStepError(f"slot {slot}: token_ids must be a flat list of integers")
            vocab = self.config.vocab_size
            bad = tok[(tok < 0) | (tok >= vocab)]
            if bad.size:
                raise InvalidStepError(
                    f"slot {slot}: token id {int(bad[0])} is outside the vocabulary 0..{vocab - 1}"
                )
            tok = tok.astype(np.int32)
        start = c.start_pos
        if not _is_int(start) or start < 0:
            raise InvalidStepError(f"slot {slot}: start_pos {start!r} must be an integer >= 0")
        if start > self._seq_len[slot]:
            raise InvalidStepError(
                f"slot {slot}: start_pos {start} skips positions; the slot holds "
                f"{self._seq_len[slot]} positions"
            )
        end = start + c.n_tokens
        if end > self.max_model_len:
            raise InvalidStepError(
                f"slot {slot}: positions up to {end - 1} exceed max_model_len={self.max_model_len}"
            )
        if c.sample:
            t, p, k, seed = c.temperature, c.top_p, c.top_k, c.seed
            key = (type(t), t, type(p), p, type(k), k, type(seed), seed)
            if self._sampling_ok.get(slot) != key:
                _check_sampling(c)
                self._sampling_ok[slot] = key
            elif not _is_int(c.counter) or not 0 <= c.counter <= _U32_MAX:
                _check_sampling(c)  # the one setting that changes every step: its error
        if c.logprobs is not None:
            if not self.logprobs_enabled:
                raise InvalidStepError(
                    f"slot {slot}: logprobs were asked for but are not enabled on this "
                    "runner (enable_logprobs())"
                )
            if not c.sample or not _is_int(c.logprobs):
                raise InvalidStepError(f"slot {slot}: logprobs need a sampled chunk")
            if not 0 <= c.logprobs <= self.max_logprobs:
                raise InvalidStepError(
                    f"slot {slot}: logprobs={c.logprobs} must be in 0..{self.max_logprobs}"
                )
        if c.prompt_logprobs is not None or c.prompt_targets is not None:
            self._check_scoring(c, tok)
        return tok

    def _check_scoring(self, c: SeqChunk, tok: np.ndarray | None) -> None:
        where = f"slot {c.slot}"
        k, targets = c.prompt_logprobs, c.prompt_targets
        if not self.logprobs_enabled:
            raise InvalidStepError(f"{where}: prompt logprobs need enable_logprobs()")
        if tok is None or targets is None or not _is_int(k):
            raise InvalidStepError(
                f"{where}: prompt logprobs need a prompt chunk (token_ids), prompt_logprobs "
                "and prompt_targets"
            )
        if not 0 <= k <= self.max_logprobs:  # type: ignore[operator]
            raise InvalidStepError(
                f"{where}: prompt_logprobs={k} must be in 0..{self.max_logprobs}"
            )
        want = tok.shape[0] - (1 if c.sample else 0)
        if len(targets) != want:
            raise InvalidStepError(
                f"{where}: {len(targets)} prompt_targets for {want} scored rows (every row of "
                "the chunk but a sampled last one)"
            )
        vocab = self.config.vocab_size
        if any(not _is_int(t) or not 0 <= t < vocab for t in targets):
            raise InvalidStepError(f"{where}: a prompt target is outside the vocabulary")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_sampling(c: SeqChunk) -> None:
    # In the units the sampler reads (SAMPLE_PARAMS_DTYPE): float32 temperature and top_p.
    where = f"slot {c.slot}"
    t, p = c.temperature, c.top_p
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 or t > _F32_MAX:
        raise InvalidStepError(f"{where}: temperature {t!r} must be a finite float32 number >= 0")
    if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
        raise InvalidStepError(f"{where}: top_p {p!r} must be a number in (0, 1]")
    if p < _F32_TINY:
        raise InvalidStepError(f"{where}: top_p {p!r} is 0 in float32; it must be in (0, 1]")
    if not _is_int(c.top_k) or not -1 <= c.top_k <= _I32_MAX:
        raise InvalidStepError(f"{where}: top_k {c.top_k!r} must be an integer (0 or -1 = off)")
    for name in ("seed", "counter"):
        value = getattr(c, name)
        if not _is_int(value) or not 0 <= value <= _U32_MAX:
            raise InvalidStepError(f"{where}: {name} {value!r} must be an integer in 0..2**32-1")
