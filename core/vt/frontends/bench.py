"""``vt bench``: prefill and decode tokens/s of one model on one backend, async on and off.

Both runs share the backend and the loaded model file; each builds its own runner (the
async setting is fixed per runner), warms up with a short request, then runs one greedy
request of exactly ``prompt_tokens`` prompt tokens and ``gen_tokens`` generated tokens
(``ignore_eos``), ``repeat`` times. The rates are the engine's per-request timings, the best
of the repeats (on a shared machine noise only ever slows a run down). Peak memory is the
process's peak resident set size (``getrusage``), so it covers both runs.
"""

from __future__ import annotations

import gc
import sys
import time
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
    kv_cache: dict[str, Any]
    ids: list[int]
    graphs: bool = False  # decode-step graph replay on (VT_GRAPHS, graphs capability)
    graphs_reason: str = ""
    graph_stats: dict[str, int] = {}


class BenchResult(BaseModel):
    backend: str
    backend_reason: str
    verification: Verification
    model: str
    model_path: str
    prompt_tokens: int
    gen_tokens: int
    max_model_len: int
    load_s: float
    runs: list[BenchRun]
    same_ids: bool  # async on and off generated the same greedy ids
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
    max_batch_tokens: int = 256,
    warmup: bool = True,
    repeat: int = 3,
    log: Any = None,
    verify: bool | None = None,
) -> BenchResult:
    """Measure; ``log(str)`` (optional) hears about progress.

    ``verify``: as for :class:`vt.LLM` (None follows ``VT_VERIFY``); the verification runs
    before the clock of ``load_s`` starts, so it never counts as loading.
    """
    from ..execution.runner import DEFAULT_MAX_MODEL_LEN, ModelRunner
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
            runs = []
            for async_on in (True, False):
                say(f"async scheduling {'on' if async_on else 'off'}: loading the runner")
                runner = ModelRunner(
                    be,
                    model_file,
                    max_slots=1,
                    max_model_len=limit,
                    max_batch_tokens=max_batch_tokens,
                    kv_cache=kv_cache,
                    async_scheduling=async_on,
                )
                try:
                    engine = Engine(runner, tokenizer)
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
    return BenchResult(
        backend=be.name,
        backend_reason=why,
        verification=verification,
        model=model_file.config.name,
        model_path=str(path),
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        max_model_len=limit,
        load_s=load_s,
        runs=runs,
        same_ids=runs[0].ids == runs[1].ids,
        peak_rss_bytes=peak_rss_bytes(),
        rss_bytes=rss_bytes(),
    )


def _complete(
    engine: Engine, prompt: list[int], params: SamplingParams, max_tokens: int | None = None
) -> RequestOutput:
    if max_tokens is not None:
        params = params.model_copy(update={"max_tokens": max_tokens})
    rid = engine.add_request(prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


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
        kv_cache=runner.kv.stats().model_dump(),
        ids=ids,
        graphs=runner.graphs,
        graphs_reason=runner.graphs_reason,
        graph_stats=dict(runner.graph_stats),
    )


def format_table(result: BenchResult) -> str:
    """A human-readable report of a :class:`BenchResult`."""
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


def _graphs_line(runs: list[BenchRun]) -> str:
    # Only decode-only steps replay, and with async off every step takes host input: say
    # how many replays each setting made, so "on" is not read as "used by both".
    first = runs[0]
    line = f"graphs: {'on' if first.graphs else 'off'} ({first.graphs_reason})"
    if first.graphs:
        replays = ", ".join(
            f"{r.graph_stats.get('replays', 0)} with async {'on' if r.async_scheduling else 'off'}"
            for r in runs
        )
        line += f"; decode steps replayed: {replays}"
    return line


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"
