"""``vt bench``: prefill and decode tokens/s of one model on one backend, async on and off.

Both runs share the backend and the loaded model file; each builds its own runner (the
async setting is fixed per runner), warms up with a short request, then runs one greedy
request of exactly ``prompt_tokens`` prompt tokens and ``gen_tokens`` generated tokens
(``ignore_eos``), ``repeat`` times. The rates are the engine's per-request timings, the best
of the repeats (on a shared machine noise only ever slows a run down). Peak memory is the
process's peak resident set size (``getrusage``), so it covers both runs.

``batches`` (``vt bench --batch 1,8,32``) measures aggregate throughput through the engine
instead: for each batch size B, B greedy requests of the same prompt are added at once and
stepped to the end. ``decode_tok_s`` is the tokens generated from the step at which every
request has its first token to the last step, over that time (what llama.cpp's
``llama-batched-bench`` reports as S_TG, which prefills every prompt first: here prompts
are prefilled ``max_batch_tokens`` at a time, so the window's last steps may run fewer
rows unless that holds every prompt); ``e2e_tok_s`` is every generated token over the
whole wall time, prefill included; each the best of the repeats, on its own (the first
repeat may pay a one-time cost, such as capturing the prompt's prefill graph, that the
decode window does not see). One runner per async setting, with ``max(batches)`` KV
slots, runs every batch size after a short warm-up at that size (so graphs are captured
before the clock starts).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..management.trust import Verification
from .engine import Engine, RequestOutput
from .sampling import SamplingParams

# Text repeated to build a prompt of any length (real words, so the tokenizer behaves).
_PASSAGE = (
    "The sky appears blue because molecules in the air scatter shorter wavelengths of "
    "sunlight more strongly than longer ones. This effect, called Rayleigh scattering, "
    "also explains why sunsets look red and orange near the horizon. "
)


class BenchRun(BaseModel):
    """One timed request with async scheduling on or off."""

    async_scheduling: bool
    readback: str
    readback_reason: str
    prompt_tokens: int
    gen_tokens: int
    repeat: int
    prefill_s: float | None  # of the fastest repeat
    decode_s: float | None
    prefill_tok_s: float | None  # best of the repeats
    decode_tok_s: float | None
    #: Every repeat's prefill rate, in order: with prefill graphs the first runs eagerly,
    #: the second is captured, the rest replay (the best of them is ``prefill_tok_s``).
    prefill_tok_s_each: list[float | None] = []
    kv_cache: dict[str, Any]
    #: Prompt tokens a repeat took from a cache (most of any repeat): 0, every repeat
    #: prefills its whole prompt (the bench's engine runs without prefix caching).
    cached_prompt_tokens: int = 0
    ids: list[int]
    graphs: bool = False  # decode-step graph replay on (VT_GRAPHS, graphs capability)
    graphs_reason: str = ""
    #: Prefill and mixed steps replayed too (VT_PREFILL_GRAPHS, the backend's hint)
    prefill_graphs: bool = False
    prefill_graphs_reason: str = ""
    graph_stats: dict[str, int] = {}
    #: The backend's context classes (``Backend.context_classes``): the graphs are keyed by
    #: them and attention bounded by them; empty: one class.
    context_classes: list[int] = []


class BatchRun(BaseModel):
    """B requests at once through the engine, with async scheduling on or off."""

    batch: int
    async_scheduling: bool
    readback: str
    prompt_tokens: int  # per request
    gen_tokens: int  # per request
    repeat: int
    decode_tok_s: float | None  # aggregate, decode phase (best of the repeats)
    decode_s: float | None
    decode_tokens: int  # generated in the decode window
    e2e_tok_s: float  # every generated token over the whole wall time (best of the repeats)
    e2e_s: float
    steps: int  # engine steps of the fastest repeat
    same_ids: bool  # every request generated the same ids (same prompt, greedy)
    ids: list[int]  # the first request's ids
    graphs: bool = False
    graphs_reason: str = ""
    graph_stats: dict[str, int] = {}  # this batch size's share, its warm-up included
    context_classes: list[int] = []  # as BenchRun's


class BenchResult(BaseModel):
    backend: str
    backend_reason: str
    verification: Verification
    model: str
    model_path: str
    prompt_tokens: int
    gen_tokens: int
    max_model_len: int
    max_batch_tokens: int = 256  # a longer prompt was prefilled in chunks of this many tokens
    # (the runner's: --max-batch-tokens, else the backend's default_batch_tokens)
    load_s: float
    runs: list[BenchRun]
    same_ids: bool  # async on and off (and every batch run) generated the same greedy ids
    batch_runs: list[BatchRun] = []
    peak_rss_bytes: int
    rss_bytes: int


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far."""
    try:
        import resource
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB else
    # Linux updates the high-water mark lazily: it can trail the current RSS a little.
    return max(int(peak), rss_bytes())


def rss_bytes() -> int:
    """The process's resident set size now."""
    try:  # Linux: what psutil reads, without importing it (~0.5 MiB resident)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def bench_prompt(tokenizer: Any, n: int) -> list[int]:
    """Exactly ``n`` prompt ids: BOS (if the model wants one) then the passage, repeated."""
    ids = tokenizer.encode(_PASSAGE * (1 + n // 8))
    while len(ids) < n:
        ids += tokenizer.encode(_PASSAGE, add_special=False)
    return ids[:n]


def run_bench(
    model: str | None = None,
    backend: str | None = None,
    *,
    prompt_tokens: int = 128,
    gen_tokens: int = 64,
    kv_cache: str = "auto",
    max_model_len: int | None = None,
    max_batch_tokens: int | None = None,
    warmup: bool = True,
    repeat: int = 3,
    log: Any = None,
    verify: bool | None = None,
    batches: list[int] | None = None,
) -> BenchResult:
    """Measure; ``log(str)`` (optional) hears about progress. ``batches``: the aggregate
    throughput of each batch size instead of the single-request runs.

    ``verify``: as for :class:`vt.LLM` (None follows ``VT_VERIFY``); the verification runs
    before the clock of ``load_s`` starts, so it never counts as loading.
    """
    from ..execution.runner import DEFAULT_MAX_MODEL_LEN, ModelRunner, batch_tokens
    from ..management.trust import open_verified_backend
    from ..model import Tokenizer, load_gguf
    from ..model.cache import resolve_model

    say = log or (lambda _msg: None)
    for name, value in (
        ("prompt_tokens", prompt_tokens),
        ("gen_tokens", gen_tokens),
        ("repeat", repeat),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be at least 1, got {value!r}")
    if batches is not None:
        if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
            raise ValueError(f"batch sizes must be integers of at least 1, got {batches!r}")
    path = resolve_model(model)
    be, why, verification = open_verified_backend(backend, verify=verify)
    t0 = time.perf_counter()
    try:
        with load_gguf(path) as model_file:
            tokenizer = Tokenizer.from_model(model_file)
            load_s = time.perf_counter() - t0
            limit = max_model_len or min(model_file.config.context_length, DEFAULT_MAX_MODEL_LEN)
            if prompt_tokens + gen_tokens > limit:
                raise ValueError(
                    f"prompt_tokens + gen_tokens = {prompt_tokens + gen_tokens} exceeds "
                    f"max_model_len {limit}; raise --max-model-len or ask for fewer tokens"
                )
            prompt = bench_prompt(tokenizer, prompt_tokens)
            params = SamplingParams(temperature=0.0, max_tokens=gen_tokens, ignore_eos=True)
            runs: list[BenchRun] = []
            batch_runs: list[BatchRun] = []
            resolved_batch_tokens = batch_tokens(be, max_batch_tokens)
            for async_on in (True, False):
                say(f"async scheduling {'on' if async_on else 'off'}: loading the runner")
                runner = ModelRunner(
                    be,
                    model_file,
                    max_slots=max(batches) if batches else 1,
                    max_model_len=limit,
                    max_batch_tokens=resolved_batch_tokens,
                    kv_cache=kv_cache,
                    async_scheduling=async_on,
                )
                try:
                    # Every repeat must compute its whole prompt: with prefix caching the
                    # second would reuse the first's KV and time one token's prefill.
                    engine = Engine(runner, tokenizer, prefix_caching=False)
                    if batches:
                        for b in batches:
                            say(f"async {'on' if async_on else 'off'}, batch {b}: x{repeat}")
                            before = dict(runner.graph_stats)
                            if warmup:
                                _batch(engine, b, prompt[: min(8, prompt_tokens)], params, 4)
                            timed = [_batch(engine, b, prompt, params) for _ in range(repeat)]
                            batch_runs.append(
                                _record_batch(async_on, runner, b, len(prompt), timed, before)
                            )
                        continue
                    if warmup:
                        _complete(engine, prompt[: min(8, prompt_tokens)], params, max_tokens=4)
                    say(f"async scheduling {'on' if async_on else 'off'}: timing x{repeat}")
                    outs = [_complete(engine, prompt, params) for _ in range(repeat)]
                    runs.append(_record(async_on, runner, outs))
                finally:
                    runner.close()
                    gc.collect()  # let the first runner's weights go before the second's
    finally:
        be.close()
    rss = rss_bytes()  # before the peak, which must not trail it by the page read between
    return BenchResult(
        backend=be.name,
        backend_reason=why,
        verification=verification,
        model=model_file.config.name,
        model_path=str(path),
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        max_model_len=limit,
        max_batch_tokens=resolved_batch_tokens,
        load_s=load_s,
        runs=runs,
        same_ids=_same_ids(runs, batch_runs),
        batch_runs=batch_runs,
        peak_rss_bytes=max(peak_rss_bytes(), rss),
        rss_bytes=rss,
    )


def _complete(
    engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int | None = None
) -> RequestOutput:
    if max_tokens is not None:
        params = params.model_copy(update={"max_tokens": max_tokens})
    rid = engine.add_request(prompt, params, final_only=True)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


@dataclass
class _BatchTiming:
    decode_s: float | None
    decode_tokens: int
    e2e_s: float
    tokens: int
    steps: int
    ids: list[list[int]]


def _batch(
    engine: Engine, batch: int, prompt: list[int], params: SamplingParams, max_tokens: int = 0,
    final_only: bool = True,
) -> _BatchTiming:  # fmt: skip
    """``batch`` requests of ``prompt`` added at once and stepped to the end; by default
    ``final_only``, as LLM.generate adds its requests (one output a request, at its end)."""
    if max_tokens:
        params = params.model_copy(update={"max_tokens": max_tokens})
    t0 = time.perf_counter()
    rids = [engine.add_request(prompt, params, final_only=final_only) for _ in range(batch)]
    made = dict.fromkeys(rids, 0)
    ids: dict[str, list[int]] = {}
    start: tuple[float, int] | None = None  # (time, tokens) once every request has one
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.request_id in made:
                made[out.request_id] = len(out.ids)
                if out.finished:
                    ids[out.request_id] = list(out.ids)
        if start is None:
            for rid in made:
                if rid not in ids:
                    made[rid] = engine.num_generated(rid)
            if all(made.values()):
                start = (time.perf_counter(), sum(made.values()))
    t1 = time.perf_counter()
    total = sum(made.values())
    decode_s = t1 - start[0] if start is not None and t1 > start[0] else None
    decode_tokens = total - start[1] if start is not None else 0
    return _BatchTiming(decode_s, decode_tokens, t1 - t0, total, steps, [ids[r] for r in rids])


def _record_batch(
    async_on: bool,
    runner: Any,
    batch: int,
    prompt_tokens: int,
    timed: list[_BatchTiming],
    stats_before: dict[str, int],
) -> BatchRun:
    def rate(t: _BatchTiming) -> float:
        return t.decode_tokens / t.decode_s if t.decode_s else 0.0

    best = max(timed, key=rate)
    best_e2e = max(timed, key=lambda t: t.tokens / t.e2e_s)
    first = timed[0].ids[0]
    return BatchRun(
        batch=batch,
        async_scheduling=async_on,
        readback=runner.readback,
        prompt_tokens=prompt_tokens,
        gen_tokens=len(first),
        repeat=len(timed),
        decode_tok_s=rate(best) or None,
        decode_s=best.decode_s,
        decode_tokens=best.decode_tokens,
        e2e_tok_s=best_e2e.tokens / best_e2e.e2e_s,
        e2e_s=best_e2e.e2e_s,
        steps=best.steps,
        same_ids=all(i == first for t in timed for i in t.ids),
        ids=first,
        graphs=runner.graphs,
        graphs_reason=runner.graphs_reason,
        graph_stats={
            k: v if k == "cached" else v - stats_before.get(k, 0)
            for k, v in runner.graph_stats.items()
        },
        context_classes=list(runner.context_classes),
    )


def _same_ids(runs: list[BenchRun], batch_runs: list[BatchRun]) -> bool:
    ids = [r.ids for r in runs] + [b.ids for b in batch_runs]
    return all(b.same_ids for b in batch_runs) and all(i == ids[0] for i in ids)


def _record(async_on: bool, runner: Any, outs: list[RequestOutput]) -> BenchRun:
    def best(key: str) -> RequestOutput:
        return max(outs, key=lambda o: getattr(o.timings, key) or 0.0)

    prefill, decode = best("prefill_tok_s").timings, best("decode_tok_s").timings
    ids = outs[0].ids
    if any(o.ids != ids for o in outs):
        raise RuntimeError("greedy repeats of the same request generated different ids")
    return BenchRun(
        async_scheduling=async_on,
        readback=runner.readback,
        readback_reason=runner.readback_reason,
        prompt_tokens=prefill.prompt_tokens,
        gen_tokens=decode.generated_tokens,
        repeat=len(outs),
        prefill_s=prefill.prefill_s,
        decode_s=decode.decode_s,
        prefill_tok_s=prefill.prefill_tok_s,
        decode_tok_s=decode.decode_tok_s,
        prefill_tok_s_each=[o.timings.prefill_tok_s for o in outs],
        kv_cache=runner.kv.stats().model_dump(),
        cached_prompt_tokens=max(o.num_cached_tokens for o in outs),
        ids=ids,
        graphs=runner.graphs,
        graphs_reason=runner.graphs_reason,
        prefill_graphs=runner.prefill_graphs,
        prefill_graphs_reason=runner.prefill_graphs_reason,
        graph_stats=dict(runner.graph_stats),
        context_classes=list(runner.context_classes),
    )


def format_table(result: BenchResult) -> str:
    """A human-readable report of a :class:`BenchResult`."""
    if result.batch_runs:
        return _format_batches(result)
    mib = 1 << 20
    lines = [
        f"model    {result.model} ({result.model_path})",
        f"backend  {result.backend}: {result.backend_reason}; {result.verification.summary()}",
        f"tokens   {result.prompt_tokens} prompt + {result.gen_tokens} generated "
        f"(max_model_len {result.max_model_len}); best of {result.runs[0].repeat} runs",
        "",
        f"{'async':<6} {'readback':<10} {'prefill tok/s':>14} {'decode tok/s':>13}  kv cache",
    ]
    for r in result.runs:
        kv = r.kv_cache
        lines.append(
            f"{'on' if r.async_scheduling else 'off':<6} {r.readback:<10} "
            f"{_rate(r.prefill_tok_s):>14} {_rate(r.decode_tok_s):>13}  "
            f"{kv['backend']}, {kv['mapped_bytes'] / mib:.1f} of "
            f"{kv['reserved_bytes'] / mib:.1f} MiB mapped, {kv['segments']} segment(s)"
        )
    lines += [
        "",
        f"same greedy ids with async on and off: {'yes' if result.same_ids else 'NO'}",
        _graphs_line(result.runs),
        f"peak RSS {result.peak_rss_bytes / mib:.1f} MiB (now {result.rss_bytes / mib:.1f} MiB)",
    ]
    return "\n".join(lines)


#: Why identical requests of one batch can part (docs/gpu.md, "Batch invariance"): said
#: where they did, so a user does not take it for a race.
_PARTED = (
    "  (a request's ids can depend on what else was in the steps that computed it: the "
    "kernels and their order of summation follow each step's rows, so a near-tie between "
    "two ids can go either way; the same batch and schedule give the same ids every time)"
)


def _format_batches(result: BenchResult) -> str:
    runs = result.batch_runs
    lines = [
        f"model    {result.model} ({result.model_path})",
        f"backend  {result.backend}: {result.backend_reason}; {result.verification.summary()}",
        f"tokens   B requests of {result.prompt_tokens} prompt + {result.gen_tokens} generated "
        f"tokens each, at once (max_model_len {result.max_model_len}); best of "
        f"{runs[0].repeat} runs",
        "",
        f"{'async':<6} {'batch':>5} {'decode tok/s':>13} {'e2e tok/s':>10} {'steps':>6}  graphs",
    ]
    for r in runs:
        g = r.graph_stats
        graphs = (
            f"{g.get('replays', 0)} replays, {g.get('captures', 0)} captures" if r.graphs else "off"
        )
        lines.append(
            f"{'on' if r.async_scheduling else 'off':<6} {r.batch:>5} "
            f"{_rate(r.decode_tok_s):>13} {r.e2e_tok_s:>10.1f} {r.steps:>6}  {graphs}"
        )
    lines += [
        "",
        "decode tok/s: tokens generated once every request had its first one, over that time "
        "(all requests together); e2e: every generated token over the whole wall time",
        f"same greedy ids in every request and setting: {'yes' if result.same_ids else 'NO'}",
        *([] if result.same_ids else [_PARTED]),
        f"graphs: {'on' if runs[0].graphs else 'off'} ({runs[0].graphs_reason}); "
        "replays and captures per batch size, warm-up included" + _classes(runs[0].context_classes),
    ]
    return "\n".join(lines)


def _classes(bounds: list[int]) -> str:
    """The graphs line's note of the backend's context classes; "" where it has none."""
    if not bounds:
        return ""
    return f"; keyed by context class (positions: {', '.join(map(str, bounds))})"


def _graphs_line(runs: list[BenchRun]) -> str:
    # Say how many steps each setting replayed, and each repeat's prefill rate where
    # prefill steps replay too (the first repeat runs eagerly, the second is captured).
    first = runs[0]
    line = f"graphs: {'on' if first.graphs else 'off'} ({first.graphs_reason})"
    if first.graphs:
        replays = ", ".join(
            f"{r.graph_stats.get('replays', 0)} with async {'on' if r.async_scheduling else 'off'}"
            for r in runs
        )
        line += f"; steps replayed: {replays}"
        line += _classes(first.context_classes)
        line += f"\n{first.prefill_graphs_reason}"
        if first.prefill_graphs:
            each = "; ".join(
                f"async {'on' if r.async_scheduling else 'off'} "
                + ", ".join(_rate(v) for v in r.prefill_tok_s_each)
                for r in runs
            )
            line += f"; prefill tok/s of each repeat: {each}"
    return line


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
