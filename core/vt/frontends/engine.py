"""The engine: many requests over one :class:`~vt.execution.runner.ModelRunner`, one step at a time.

Continuous batching: requests join the running batch when a KV slot is free and leave it
when they finish. Each step holds every running sequence's decode row (one token each) plus
prefill chunks of waiting prompts, within the runner's ``max_batch_tokens``.

With async scheduling (``runner.readback != "sync"``) the engine submits step N+1 *before*
reading step N's sampled ids: a decode row whose input is the id sampled in step N says
``from_previous=True`` and the runner takes it device-side. The host then detokenizes and
checks stop conditions for step N while the device runs N+1. A request that stops at step N
(stop token or stop string) wastes one row in N+1, whose id is discarded; limits the host
can foresee (``max_tokens``, ``max_model_len``) waste nothing.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..errors import VtError
from .prefix_cache import PrefixCache
from .sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class RequestError(VtError, ValueError):
    """A request the engine refuses (empty or too long prompt, ids outside the vocabulary)."""


class EngineUnhealthyError(VtError):
    """A failed step left the runner unusable; the engine takes no more requests."""


@dataclass(frozen=True)
class StepFailure:
    """What :meth:`Engine.step` did after a step raised (it re-raises the error).

    ``failed``: the requests dropped (their rows were in the failed step, or they had
    tokens in a step that was in flight with it). ``requeued``: requests that had not
    produced a token yet, put back at the head of the queue to start over (same seed, so
    the same answer). ``healthy`` is False when the runner could not be brought back to a
    known-good state; ``reason`` says why.
    """

    error: BaseException
    failed: tuple[str, ...]
    requeued: tuple[str, ...]
    healthy: bool = True
    reason: str | None = None


class Timings(BaseModel):
    """Wall-clock timings of one request. Rates are None where nothing was measured."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    generated_tokens: int = 0
    queued_s: float = 0.0  # waiting for a free KV slot
    prefill_s: float | None = None  # first prompt chunk submitted -> first token read
    decode_s: float | None = None  # first token -> last token read
    prefill_tok_s: float | None = None  # prompt tokens computed (not reused) per second
    decode_tok_s: float | None = None  # (generated_tokens - 1) / decode_s


class Logprob(BaseModel):
    """One token and its log-probability under the model (before temperature, top-k and
    top-p)."""

    token_id: int
    logprob: float


class TokenLogprobs(BaseModel):
    """A generated token's log-probability and the ``SamplingParams.logprobs`` most likely
    tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top: list[Logprob] = []


class RequestOutput(BaseModel):
    """A request's state after a step: everything so far plus what this step added.

    ``text`` is the concatenation of every ``delta_text`` so far. While a request runs, text
    that could be the start of a stop string is held back, so ``text`` never shows a stop
    string. ``ids`` includes the stop token that ended a request; ``text`` does not.
    """

    request_id: str
    prompt: str | None = None
    prompt_ids: list[int]
    ids: list[int]
    text: str
    delta_ids: list[int] = []
    delta_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    timings: Timings = Timings()
    #: One entry per id of ``ids`` when ``SamplingParams.logprobs`` is set, else None.
    logprobs: list[TokenLogprobs] | None = None
    delta_logprobs: list[TokenLogprobs] | None = None  # the entries of ``delta_ids``
    #: One entry per prompt id when ``SamplingParams.prompt_logprobs`` is set (the first is
    #: None: nothing predicts it), complete from the first output with an id; else None.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    #: Prompt tokens not prefilled: their KV was reused from the slot's earlier request
    #: (:mod:`vt.frontends.prefix_cache`).
    num_cached_tokens: int = 0


# Every output is a copy of these with every field given (pydantic's model_copy): about
# 5 us a request a step where model_construct's walk over the fields took 9 (this machine,
# benchmarks/engine_host.py). Nothing is set in them, so an output's model_fields_set names
# exactly the fields given: a test holds it to all of them.
_TIMINGS = Timings.model_construct()
_OUTPUT = RequestOutput.model_construct()


class _StopStrings:
    """A request's stop strings, prepared once: what the per-token checks need.

    The cost per token is bounded by the strings' lengths (the caller bounds those), never
    by their product: the hold-back asks a set of every proper prefix, and only at
    positions where a stop string could start.
    """

    def __init__(self, stops: list[str]) -> None:
        self.longest = max((len(s) for s in stops), default=0)
        self.first = frozenset(s[0] for s in stops)
        self.prefixes = frozenset(s[:k] for s in stops for k in range(1, len(s)))

    def holdback(self, text: str) -> int:
        """The longest end of ``text`` that is a proper prefix of a stop string."""
        n = len(text)
        for k in range(min(self.longest - 1, n), 0, -1):
            if text[n - k] in self.first and text[n - k :] in self.prefixes:
                return k
        return 0


_NO_STOPS = _StopStrings([])


@dataclass(eq=False, slots=True)
class _Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    decoder: Any
    prompt: str | None = None
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens submitted (reused ones included)
    num_cached: int = 0  # prompt tokens whose KV came from the slot's earlier request
    fed: int = 0  # sampled ids submitted as inputs (their KV is written)
    output_ids: list[int] = field(default_factory=list)  # sampled ids read back
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    pending: int = 0  # samples submitted but not yet read back (0 or 1)
    text: str = ""  # detokenized text (stop strings trimmed once finished)
    emitted: int = 0  # characters of ``text`` already handed out
    emitted_ids: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    t_arrival: float = 0.0
    t_scheduled: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    stops: _StopStrings = _NO_STOPS
    final_only: bool = False  # step() returns this request's output once, finished

    @property
    def sampled(self) -> int:
        return len(self.output_ids) + self.pending

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled == len(self.prompt_ids)


@dataclass(eq=False)
class _Step:
    seq: int
    output: Any  # the runner's StepOutput
    rows: list[tuple[_Request, int, bool]]  # (request, slot, samples)


class Engine:
    """Schedules requests over a runner and turns sampled ids into text.

    ``runner`` follows :class:`vt.execution.runner.ModelRunner`; ``tokenizer`` is a
    :class:`vt.model.Tokenizer` (``incremental_decoder()``, ``stop_ids``). With
    ``prefix_caching`` a prompt skips the prefix it shares with what a free slot's KV holds
    (:mod:`vt.frontends.prefix_cache`); the runner's ``free_slot`` must then take ``keep``.
    """

    def __init__(self, runner: Any, tokenizer: Any, *, prefix_caching: bool = True) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.prefix_caching = bool(prefix_caching)
        self.max_slots: int = int(runner.max_slots)
        self.max_model_len: int = int(runner.max_model_len)
        self.max_batch_tokens: int = int(runner.max_batch_tokens)
        self.vocab_size: int = int(runner.config.vocab_size)
        #: Rows of logits a step holds (sampled rows plus scored prompt rows).
        self.max_rows: int = int(getattr(runner, "max_rows", self.max_slots))
        self.async_scheduling: bool = runner.readback != "sync"
        self._eos_ids = frozenset(int(i) for i in tokenizer.stop_ids)
        self._ids = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._free_slots: list[int] = list(range(self.max_slots))
        self._prefix = PrefixCache(self.max_slots)
        self._deferred_free: list[tuple[int, int]] = []  # (slot, free after step seq)
        self._inflight: _Step | None = None
        self._step_seq = 0
        self._failing: list[_Request] = []  # the rows of the step being submitted or read
        #: What the last failed step did (None until one fails).
        self.last_failure: StepFailure | None = None
        #: False once a failed step left the runner unusable; ``unhealthy_reason`` says why.
        self.healthy = True
        self.unhealthy_reason: str | None = None

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request and return its id. Raises :class:`RequestError` for a bad prompt
        before touching any state, so other requests are unaffected. ``final_only``:
        :meth:`step` returns the request's output once, when it finishes (with every id
        and the whole text), not one a step: what a caller that does not stream needs,
        without building an output per request per step (run 146: at batches of 128-256
        that host work, tens of microseconds a request, set a GPU step's pace)."""
        params = params if params is not None else SamplingParams()
        if not self.healthy:
            raise EngineUnhealthyError(f"the engine is unusable: {self.unhealthy_reason}")
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty: it needs at least one token")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                "it must be shorter to leave room for at least one generated token "
                "(raise --max-model-len or shorten the prompt)"
            )
        for k in (params.logprobs, params.prompt_logprobs):
            if k is not None:
                self._enable_logprobs(k)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self._eos_ids
        req = _Request(
            id=rid,
            prompt_ids=ids,
            params=params,
            seed=params.seed if params.seed is not None else random.getrandbits(32),
            stop_ids=stop_ids,
            decoder=self.tokenizer.incremental_decoder(skip_special=True),
            prompt=prompt,
            t_arrival=time.perf_counter(),
            stops=_StopStrings(list(params.stop)) if params.stop else _NO_STOPS,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else [],
            final_only=bool(final_only),
        )
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def _enable_logprobs(self, k: int) -> None:
        runner = self.runner
        if not getattr(runner, "logprobs_enabled", False):
            enable = getattr(runner, "enable_logprobs", None)
            if enable is None:
                raise RequestError("logprobs: this engine's runner cannot compute them")
            enable()  # between steps: allocates the logits copies once
        if k > runner.max_logprobs:
            raise RequestError(f"logprobs: at most {runner.max_logprobs} alternatives, got {k}")

    def abort(self, request_id: str) -> bool:
        """Stop a request now; returns False if it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort")
        self._requests.pop(req.id, None)
        return True

    def num_generated(self, request_id: str) -> int:
        """Ids generated so far (read back) for a request the engine holds; a
        ``final_only`` request's progress between its outputs. KeyError naming an id the
        engine does not hold (unknown, or finished and returned)."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} in the engine")
        return len(req.output_ids)

    def has_unfinished(self) -> bool:
        """Whether a request is waiting or running. A step still in flight that only holds
        rows of finished requests does not count: the next :meth:`step` collects it."""
        return bool(self._waiting or self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one step; returns an output for each request that produced text or finished
        (a ``final_only`` request's only once it finished).

        With async scheduling this submits the next step before reading the previous one,
        so an output may describe the step before the one just submitted.
        """
        if not self.healthy:
            return []  # nothing runs: add_request refuses every request
        try:
            if not self.async_scheduling:
                current = self._submit()
                return self._collect(current) if current is not None else []
            if self._inflight is None:
                self._inflight = self._submit()
                if self._inflight is None:
                    return []
            previous = self._inflight
            self._inflight = self._submit()
            return self._collect(previous)
        except BaseException as exc:
            self._recover(exc)
            raise

    def _schedule(self) -> list[tuple[_Request, int, list[int] | None, int, bool]]:
        """Pick this step's rows: (request, start_pos, token ids or None, n_tokens, samples)."""
        while self._waiting and self._admit(self._waiting[0]):
            self._waiting.popleft()
        budget = self.max_batch_tokens
        rows: list[tuple[_Request, int, list[int] | None, int, bool]] = []
        for req in self._running:  # decode rows first: one token each
            if budget == 0:
                break
            if not req.prefill_done or req.finished or req.sampled == 0:
                continue
            if self._will_finish(req):
                continue
            pos = len(req.prompt_ids) + req.sampled - 1
            if req.pending:
                rows.append((req, pos, None, 1, True))  # input: last step's id, device-side
            else:
                rows.append((req, pos, [req.output_ids[-1]], 1, True))
            budget -= 1
        # then prompt chunks, first come first served; a prompt whose tokens are scored
        # (prompt_logprobs) needs a row of logits per token, so it goes last and takes at
        # most the rows of logits the others left (max_rows a step).
        prefilling = [r for r in self._running if not r.prefill_done and not r.finished]
        scoring = [r for r in prefilling if r.params.prompt_logprobs is not None]
        logit_rows = self.max_rows - sum(1 for r in rows if r[4])
        for req in [r for r in prefilling if r.params.prompt_logprobs is None] + scoring:
            if budget == 0:
                break
            start = req.num_prefilled
            take = budget
            if req.params.prompt_logprobs is not None:
                take = min(take, logit_rows)
                if take == 0:
                    continue
            chunk = req.prompt_ids[start : start + take]
            last = start + len(chunk) == len(req.prompt_ids)
            rows.append((req, start, chunk, len(chunk), last))
            budget -= len(chunk)
            logit_rows -= len(chunk) if req.params.prompt_logprobs is not None else int(last)
        return rows

    def _admit(self, req: _Request) -> bool:
        """Give ``req`` a slot, or return False when none is free.

        With prefix caching it reuses the most of its prompt that a free slot's KV holds
        (:mod:`vt.frontends.prefix_cache` says how it chooses, and when the prefix is
        copied into another slot instead). The slot may be one whose last step is still in
        flight (a request that just stopped): this request's steps run after it on the
        same stream. A prompt scored token by token (echo) needs every row's logits, so it
        reuses nothing.
        """
        free = self._free_slots
        slot, reused, source = (free[0] if free else -1), 0, -1
        if self.prefix_caching and req.params.prompt_logprobs is None:
            deferred = [s for s, _ in self._deferred_free]
            if not free and not deferred:
                return False
            best, shared = self._prefix.pick(free + deferred, req.prompt_ids)
            if shared == 0 and free:
                best, shared = self._prefix.pick(free, req.prompt_ids)
            seq_len = getattr(self.runner, "seq_len", None)
            if shared and seq_len is not None:
                shared = min(shared, seq_len(best))  # the runner's word over the table's
            target = self._prefix.copy_target(best, shared, [s for s in free if s != best])
            if target is not None and hasattr(self.runner, "copy_prefix"):
                slot, reused, source = target, shared, best
            elif shared or best in free:
                slot, reused = best, shared
        if slot < 0:
            return False
        if slot in free:
            free.remove(slot)
        else:  # released now rather than after the step in flight
            self._deferred_free = [(s, at) for s, at in self._deferred_free if s != slot]
            self.runner.free_slot(slot, keep=self._prefix.held(slot))
        if source >= 0:
            self.runner.copy_prefix(source, slot, reused)
        # The slot holds at least ``reused`` of the prompt's positions; the first chunk
        # overwrites from there on, so whatever it held past them is never read.
        self._prefix.forget(slot)
        req.slot, req.num_prefilled, req.num_cached = slot, reused, reused
        self._running.append(req)
        return True

    def _will_finish(self, req: _Request) -> bool:
        """Whether the ids sampled so far (read back or not) already reach a limit."""
        return self._at_limit(req, req.sampled)

    def _at_limit(self, req: _Request, n_generated: int) -> bool:
        limit = req.params.max_tokens
        return (limit is not None and n_generated >= limit) or (
            len(req.prompt_ids) + n_generated >= self.max_model_len
        )

    def _submit(self) -> _Step | None:
        from ..execution.runner import SeqChunk

        rows = self._schedule()
        if not rows:
            return None
        now = time.perf_counter()
        chunks = []
        step_rows = []
        self._failing = [r[0] for r in rows]
        for req, pos, ids, n, samples in rows:
            assert req.slot is not None
            p = req.params
            scored = p.prompt_logprobs is not None and ids is not None and not req.prefill_done
            targets = req.prompt_ids[pos + 1 : pos + n + (0 if samples else 1)] if scored else None
            chunks.append(
                SeqChunk(
                    slot=req.slot,
                    start_pos=pos,
                    token_ids=ids,
                    from_previous=ids is None,
                    sample=samples,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    seed=req.seed,
                    counter=req.sampled,
                    logprobs=p.logprobs if samples else None,
                    prompt_logprobs=p.prompt_logprobs if scored else None,
                    prompt_targets=targets,
                )
            )
            if req.t_scheduled is None:
                req.t_scheduled = now
            if not req.prefill_done:
                req.num_prefilled += n
            else:
                req.fed += 1  # a decode row: its input is the last sampled id
            if samples:
                req.pending += 1
            step_rows.append((req, req.slot, samples))
        self._step_seq += 1
        output = self.runner.execute(chunks)
        self._failing = []
        return _Step(self._step_seq, output, step_rows)

    def _collect(self, step: _Step) -> list[RequestOutput]:
        self._failing = [r[0] for r in step.rows]
        sampled = step.output.get_output()
        logprobs = step.output.get_logprobs() if hasattr(step.output, "get_logprobs") else {}
        prompt_lp = getattr(step.output, "get_prompt_logprobs", dict)()
        self._failing = []
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        touched: list[_Request] = []
        for req, slot, samples in step.rows:
            if slot in prompt_lp and req.params.prompt_logprobs is not None:
                req.prompt_logprobs += [
                    TokenLogprobs.model_construct(
                        token_id=t,
                        logprob=lp,
                        top=[Logprob.model_construct(token_id=i, logprob=v) for i, v in top],
                    )
                    for t, lp, top in prompt_lp[slot]
                ]
            if not samples:
                continue
            req.pending -= 1
            if req.finished:
                continue  # the wasted row of a request that stopped one step earlier
            token = int(sampled[slot])
            if req.params.logprobs is not None and slot in logprobs:
                lp, top = logprobs[slot]
                req.logprobs.append(
                    TokenLogprobs.model_construct(
                        token_id=token,
                        logprob=lp,
                        top=[Logprob.model_construct(token_id=t, logprob=v) for t, v in top],
                    )
                )
            self._accept(req, token, now)
            touched.append(req)
        self._free_deferred(step.seq)
        for req in touched:
            if req.final_only and not req.finished:
                continue
            out = self._output(req)
            if out is not None:
                outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ per token
    def _accept(self, req: _Request, token: int, now: float) -> None:
        req.output_ids.append(token)
        if req.t_first is None:
            req.t_first = now
        req.t_last = now
        if token in req.stop_ids:
            req.stop_reason = token
            self._finish(req, "stop")
            return
        previous = len(req.text)
        req.text += req.decoder.step(token)
        if req.params.stop and len(req.text) > previous:
            self._check_stop_strings(req, previous)
            if req.finished:
                return
        if self._at_limit(req, len(req.output_ids)):
            # Any row still in flight for this request is discarded when collected.
            self._finish(req, "length")

    def _check_stop_strings(self, req: _Request, previous: int) -> None:
        text = req.text
        stops = req.stops
        start = max(0, previous - stops.longest + 1)
        best: tuple[int, str] | None = None
        for s in req.params.stop:  # each search covers the new text plus len(s) - 1
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            req.text = text[: best[0]]
            req.stop_reason = best[1]
            self._finish(req, "stop")

    def _holdback(self, req: _Request) -> int:
        """Characters at the end of the text that could begin a stop string."""
        if req.finished or not req.params.stop:
            return 0
        return req.stops.holdback(req.text)

    def _output(self, req: _Request) -> RequestOutput | None:
        end = len(req.text) - self._holdback(req)
        if end < req.emitted:
            end = req.emitted
        delta_text = req.text[req.emitted : end]
        delta_ids = req.output_ids[req.emitted_ids :]
        if not delta_text and not delta_ids and not req.finished:
            return None
        wants = req.params.logprobs is not None
        delta_logprobs = req.logprobs[req.emitted_ids :] if wants else None
        req.emitted = end
        req.emitted_ids = len(req.output_ids)
        if req.finished:
            self._requests.pop(req.id, None)
        return _OUTPUT.model_copy(
            update=dict(
                request_id=req.id,
                prompt=req.prompt,
                prompt_ids=req.prompt_ids,
                ids=list(req.output_ids),
                text=req.text[:end],
                delta_ids=delta_ids,
                delta_text=delta_text,
                finished=req.finished,
                finish_reason=req.finish_reason,
                stop_reason=req.stop_reason,
                timings=self._timings(req),
                logprobs=list(req.logprobs) if wants else None,
                delta_logprobs=delta_logprobs,
                prompt_logprobs=list(req.prompt_logprobs)
                if req.params.prompt_logprobs is not None
                else None,
                num_cached_tokens=req.num_cached,
            )
        )

    def _timings(self, req: _Request) -> Timings:
        n_prompt, n_gen = len(req.prompt_ids), len(req.output_ids)
        queued = (req.t_scheduled or req.t_arrival) - req.t_arrival
        prefill_s = decode_s = prefill_rate = decode_rate = None
        if req.t_scheduled is not None and req.t_first is not None:
            prefill_s = req.t_first - req.t_scheduled
            computed = n_prompt - req.num_cached
            prefill_rate = computed / prefill_s if prefill_s > 0 else None
        if req.t_first is not None and req.t_last is not None and n_gen > 1:
            decode_s = req.t_last - req.t_first
            decode_rate = (n_gen - 1) / decode_s if decode_s > 0 else None
        return _TIMINGS.model_copy(
            update=dict(
                prompt_tokens=n_prompt,
                generated_tokens=n_gen,
                queued_s=queued,
                prefill_s=prefill_s,
                decode_s=decode_s,
                prefill_tok_s=prefill_rate,
                decode_tok_s=decode_rate,
            )
        )

    # ------------------------------------------------------------------ slots
    def _finish(self, req: _Request, reason: FinishReason) -> None:
        if reason != "abort" and not isinstance(req.stop_reason, str):
            # An incomplete character left at the end becomes U+FFFD, as in decode().
            req.text += req.decoder.flush()
        req.finished = True
        req.finish_reason = reason
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._running:
            self._running.remove(req)
        if req.slot is not None:
            slot, req.slot = req.slot, None
            if self.prefix_caching:
                # What the slot's KV holds once its steps are done: the prompt chunks
                # submitted and the sampled ids fed back as inputs.
                fed = req.output_ids[: min(req.fed, len(req.output_ids))]
                self._prefix.remember(slot, req.prompt_ids[: req.num_prefilled] + fed)
            inflight = self._inflight
            if inflight is not None and any(s == slot for _, s, _ in inflight.rows):
                # The device may still write this slot's KV: reuse it only after that step.
                self._deferred_free.append((slot, inflight.seq))
            else:
                self._release_slot(slot)

    def _release_slot(self, slot: int) -> None:
        if self.prefix_caching:
            self.runner.free_slot(slot, keep=self._prefix.held(slot))
        else:
            self.runner.free_slot(slot)
        self._free_slots.append(slot)
        self._free_slots.sort()

    def _free_deferred(self, seq: int) -> None:
        keep = []
        for slot, after in self._deferred_free:
            if after <= seq:
                self._release_slot(slot)
            else:
                keep.append((slot, after))
        self._deferred_free = keep

    def _recover(self, error: BaseException) -> None:
        """After a step raised (or an interrupt): back to a known-good state.

        Requests with a row in the failing step, or with tokens in a step in flight with
        it, are dropped; running requests that have no token yet go back to the head of
        the queue; waiting ones stay. Every slot is reclaimed and the runner recovered
        (:meth:`ModelRunner.recover`: streams drained, steps in flight dropped, graphs
        cleared, a probe step run); if that fails the engine is unhealthy and refuses more
        work. :attr:`last_failure` says what happened.
        """
        failing = {id(r) for r in self._failing}
        self._failing = []
        self._inflight = None
        failed: list[_Request] = []
        requeue: list[_Request] = []
        for req in self._running:
            if req.finished:
                continue
            if id(req) in failing or req.output_ids:
                failed.append(req)
            else:
                requeue.append(req)
        for req in self._waiting:  # cannot be in a step; listed for an interrupt
            if id(req) in failing:
                failed.append(req)
        for req in failed:
            req.finished, req.finish_reason, req.slot = True, "abort", None
            self._requests.pop(req.id, None)
            if req in self._waiting:
                self._waiting.remove(req)
        for req in reversed(requeue):
            req.slot, req.num_prefilled, req.pending = None, 0, 0
            req.num_cached = req.fed = 0
            req.t_scheduled = None
            req.decoder = self.tokenizer.incremental_decoder(skip_special=True)
            self._waiting.appendleft(req)
        self._running.clear()
        self._deferred_free.clear()
        self._free_slots = list(range(self.max_slots))
        self._prefix.clear()  # the runner forgets every slot's positions as it recovers
        healthy, reason = True, None
        recover = getattr(self.runner, "recover", None)
        try:
            if recover is not None:
                recover()
            else:
                for slot in range(self.max_slots):
                    self.runner.free_slot(slot)
        except Exception as exc:  # noqa: BLE001 - reported through health and last_failure
            healthy, reason = False, f"{type(exc).__name__}: {exc}"
        if not healthy:
            for req in requeue + list(self._waiting):
                req.finished, req.finish_reason = True, "abort"
            failed += [r for r in self._waiting if r not in failed]
            self._waiting.clear()
            self._requests.clear()
            requeue = []
            self.healthy, self.unhealthy_reason = False, reason
        self.last_failure = StepFailure(
            error=error,
            failed=tuple(r.id for r in failed),
            requeued=tuple(r.id for r in requeue),
            healthy=healthy,
            reason=reason,
        )
