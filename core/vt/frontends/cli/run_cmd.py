"""``vt run`` (generate from a prompt) and ``vt bench`` (tokens/s, async on and off)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from .options import (
    backend_option,
    flag_skipped,
    max_batch_tokens_option,
    verify_option,
    verify_setting,
)

F = TypeVar("F", bound=Callable[..., Any])

KV_CHOICES = ("auto", "contiguous", "vmm")
_MIB = 1 << 20


# --------------------------------------------------------------------------- shared options


def model_options(func: F) -> F:
    """--model, --backend, --no-verify, --kv-cache, --max-model-len."""
    func = click.option(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="Most tokens (prompt + generated) one sequence may hold; the KV cache reserves "
        "this many positions.  [default: the model's context length, at most 4096]",
    )(func)
    func = click.option(
        "--kv-cache",
        type=click.Choice(KV_CHOICES),
        default="auto",
        show_default=True,
        help="KV cache kind: vmm grows a virtual-memory arena as sequences lengthen; "
        "contiguous commits max-model-len up front; auto picks vmm where the backend "
        "supports it (vmm on a backend without it is an error).",
    )(func)
    func = verify_option(func)
    func = backend_option(func)
    func = click.option(
        "--model",
        "-m",
        metavar="PATH|NAME",
        default=None,
        help="A GGUF file or a model name from `vt model list`.  [default: the default "
        "model, fetched on first use]",
    )(func)
    return func


@contextmanager
def _clean_errors(prog: str = "vt") -> Iterator[None]:
    """Turn the errors a user can cause into one line and exit 1 (VT_DEBUG=1: traceback);
    Ctrl-C (while loading, say) into ``PROG: interrupted`` and exit 130."""
    from pydantic import ValidationError

    from ... import envs
    from ...errors import VtError
    from ..sampling import describe_validation_error

    try:
        debug = bool(envs.get("VT_DEBUG"))  # read first: a bad value is itself the error
    except envs.EnvError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        yield
    except KeyboardInterrupt:
        click.echo(f"{prog}: interrupted", err=True)
        sys.exit(130)
    except click.ClickException:
        raise
    except ValidationError as exc:
        if debug:
            raise
        raise click.ClickException(_flag_names(describe_validation_error(exc))) from None
    except (VtError, ValueError, OSError) as exc:
        if debug:
            raise
        raise click.ClickException(str(exc) or type(exc).__name__) from None


def _flag_names(message: str) -> str:
    """``top_p: ...`` -> ``--top-p: ...`` so the error names the option the user typed."""
    parts = []
    for part in message.split("; "):
        field, sep, rest = part.partition(": ")
        parts.append(f"--{field.replace('_', '-')}{sep}{rest}" if sep else part)
    return "; ".join(parts)


# --------------------------------------------------------------------------- vt run


@click.command("run")
@click.argument("prompt")
@model_options
@click.option(
    "--max-tokens", "-n", type=int, default=256, show_default=True, help="Most tokens to generate."
)
@click.option(
    "--temperature",
    "-t",
    type=float,
    default=0.0,
    show_default=True,
    help="Sampling temperature; 0 is greedy (the same answer every time).",
)
@click.option(
    "--top-k",
    type=int,
    default=0,
    show_default=True,
    help="Sample from the k most likely tokens only; 0 turns it off.",
)
@click.option(
    "--top-p",
    type=float,
    default=1.0,
    show_default=True,
    help="Sample from the smallest set of tokens whose probability reaches p.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Seed of the sampler (0..4294967295), for reproducible sampling.",
)
@click.option(
    "--stop",
    multiple=True,
    metavar="TEXT",
    help="Stop when the answer contains TEXT (trimmed); repeatable.",
)
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Keep generating past end-of-turn tokens (until --max-tokens or --stop).",
)
@click.option(
    "--system", "-s", default=None, metavar="TEXT", help="A system message for the chat template."
)
@click.option("--raw", is_flag=True, help="Plain completion of PROMPT: no chat template.")
@click.option(
    "--no-stream",
    is_flag=True,
    help="Print the answer when it is complete instead of as it is generated.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (ids, text, timings, kv cache) instead of text.",
)
def run(
    prompt: str,
    model: str | None,
    backend: str | None,
    no_verify: bool,
    kv_cache: str,
    max_model_len: int | None,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    stop: tuple[str, ...],
    ignore_eos: bool,
    system: str | None,
    raw: bool,
    no_stream: bool,
    as_json: bool,
) -> None:
    """Generate an answer to PROMPT and stream it to stdout.

    PROMPT goes through the model's chat template (unless --raw); "-" reads it from stdin.
    A one-line summary goes to stderr: the backend and why it was chosen, whether its probes
    passed (run once per backend version, device and capabilities, then cached), the
    readback path of sampled tokens, the KV cache, and prefill and decode tokens/s.

    \b
    Examples:
      vt run "Why is the sky blue?"
      vt run --raw --temperature 0 -n 32 "The capital of France is"
      echo "Write a haiku about rain" | vt run -
      vt run --json --backend tt_stub "Hi"
      VT_ASYNC_RUNNER=0 vt run "Hi"        # the synchronous readback path

    \b
    Environment:
      VT_BACKEND=NAME      the default of --backend
      VT_ASYNC_RUNNER=0    async scheduling off (the sync readback path)
      VT_GRAPHS=0          no graph replay of steps (where the backend has graphs)
      VT_PREFILL_GRAPHS=0  prefill steps run eagerly (graphs replay only decode steps)
      VT_HOME=DIR          the model cache is DIR/models, verified backends DIR/verified
                           (default ~/.cache/vt)
      VT_VERIFY=0          do not verify the backend (as --no-verify)
      VT_DEBUG=1           a traceback instead of the one-line error

    Exit status: 0 on success, 1 on an error (one line on stderr), 130 when interrupted.
    """
    from ..sampling import SamplingParams

    with _clean_errors():
        if prompt == "-":
            prompt = sys.stdin.read()
            if prompt.endswith("\n"):
                prompt = prompt[:-1]
        if not prompt.strip():
            raise click.ClickException("the prompt is empty")
        if raw and system is not None:
            raise click.ClickException("--system needs the chat template; drop --raw")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=list(stop),
            ignore_eos=ignore_eos,
        )
        _check_max_model_len(max_model_len)
        llm = _open_llm(model, backend, kv_cache, max_model_len, no_verify)
        with llm:
            _run_one(llm, prompt, params, system, raw, no_stream or as_json, as_json)


def _check_max_model_len(value: int | None) -> None:
    if value is not None and value < 2:
        raise click.ClickException(
            f"--max-model-len must be at least 2 (a prompt token and a generated one), got {value}"
        )


def _open_llm(
    model: str | None,
    backend: str | None,
    kv_cache: str,
    max_model_len: int | None,
    no_verify: bool,
    **kwargs: Any,
) -> Any:
    """The :class:`vt.LLM` for a command's options (``vt run``: one KV slot by default)."""
    from ..llm import LLM

    # One request: one KV slot, so a contiguous cache commits max_model_len positions once.
    kwargs.setdefault("max_slots", 1)
    llm = LLM(
        model=model,
        backend=backend,
        kv_cache=kv_cache,
        max_model_len=max_model_len,
        verify=verify_setting(no_verify),
        **kwargs,
    )
    llm.verification = flag_skipped(llm.verification, no_verify)
    return llm


def _run_one(
    llm: Any, prompt: str, params: Any, system: str | None, raw: bool, quiet: bool, as_json: bool
) -> None:
    if raw:
        text = prompt
    else:
        text = llm.render_chat([{"role": "user", "content": prompt}], system=system)
    stream = llm.stream(text, params)
    out = None
    printed = ""
    try:
        for out in stream:
            if not quiet and out.delta_text:
                printed += out.delta_text
                click.echo(out.delta_text, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()  # aborts the request
        if printed and not printed.endswith("\n"):
            click.echo()
        click.echo("vt: interrupted", err=True)
        sys.exit(130)
    assert out is not None and out.finished
    if as_json:
        click.echo(json.dumps(run_json(llm, out)))
        return
    if quiet:
        printed = out.text
        click.echo(out.text, nl=False)
    if not printed.endswith("\n"):
        click.echo()
    click.echo(summary_line(llm, out), err=True)


def run_json(llm: Any, out: Any) -> dict[str, Any]:
    """The object ``vt run --json`` prints."""
    return {
        "backend": llm.backend_name,
        "model": llm.model_name,
        "model_path": str(llm.model_path),
        "readback": llm.readback,
        "verification": llm.verification.summary(),
        "prompt_ids": out.prompt_ids,
        "ids": out.ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "timings": out.timings.model_dump(),
        "kv_cache": llm.kv_cache_stats(),
    }


def summary_line(llm: Any, out: Any) -> str:
    """One line for stderr: backend (why), verification, readback, kv cache, rates."""
    t = out.timings
    kv = llm.kv_cache_stats()
    return (
        f"vt: backend {llm.backend_name} ({llm.backend_reason}) | "
        f"{llm.verification.summary()} | readback {llm.readback} | "
        f"kv {kv['backend']} {kv['mapped_bytes'] / _MIB:.1f}/{kv['reserved_bytes'] / _MIB:.1f} "
        f"MiB mapped, {kv['segments']} segment(s) | "
        f"prefill {t.prompt_tokens} tok {_rate(t.prefill_tok_s)} | "
        f"decode {t.generated_tokens} tok {_rate(t.decode_tok_s)} | finish {out.finish_reason}"
    )


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} tok/s"


# --------------------------------------------------------------------------- vt bench


@click.command("bench")
@model_options
@click.option(
    "--prompt-tokens",
    type=int,
    default=128,
    show_default=True,
    metavar="N",
    help="Prompt length of the timed request.",
)
@click.option(
    "--gen-tokens",
    type=int,
    default=64,
    show_default=True,
    metavar="N",
    help="Tokens to generate (end-of-turn tokens are ignored).",
)
@click.option(
    "--repeat",
    type=int,
    default=3,
    show_default=True,
    metavar="N",
    help="Timed requests per setting; the best rates are reported.",
)
@click.option(
    "--batch",
    "batch",
    default=None,
    metavar="B[,B...]",
    help="Aggregate decode tok/s of B requests at once through the engine, for each B "
    "(e.g. 1,8,32), instead of the single-request runs.",
)
@max_batch_tokens_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def bench(
    model: str | None,
    backend: str | None,
    no_verify: bool,
    kv_cache: str,
    max_model_len: int | None,
    prompt_tokens: int,
    gen_tokens: int,
    repeat: int,
    batch: str | None,
    max_batch_tokens: int | None,
    as_json: bool,
) -> None:
    """Measure prefill and decode tokens/s, with async scheduling on and then off.

    Each run is one greedy request of exactly --prompt-tokens prompt tokens and
    --gen-tokens generated tokens, after a short warm-up, repeated --repeat times (the
    best rates are reported: noise on a shared machine only slows runs down). Reports the
    readback path of each setting, whether both generated the same ids, the KV cache, and
    the process's peak resident memory.

    With --batch B,...: for each B, B such requests are added at once and run to the end
    through the engine (continuous batching); reports the aggregate decode tok/s (tokens
    generated once every request has its first token, over that time: llama-batched-bench's
    S_TG) and the end-to-end tok/s (every generated token over the whole wall time).
    Prompts are prefilled --max-batch-tokens at a time beside the running requests, so with
    B x --prompt-tokens above it the last requests start later and the timed window ends
    with fewer rows; llama-batched-bench prefills every prompt first: a --max-batch-tokens
    of at least B x --prompt-tokens measures the same way.

    \b
    Examples:
      vt bench
      vt bench --backend cpu --prompt-tokens 512 --gen-tokens 128 --json
      vt bench --kv-cache contiguous --max-model-len 8192
      vt bench --backend cuda --batch 1,8,32 --gen-tokens 128 --json
      vt bench --backend cuda --prompt-tokens 512 --max-batch-tokens 512   # one chunk
      VT_GRAPHS=0 vt bench --backend cuda   # decode without graph replay, to compare

    Exit status: 0 on success, 1 on an error (one line on stderr), 130 when interrupted.
    """
    from ..bench import format_table, run_bench

    with _clean_errors("vt bench"):
        for flag, value in (
            ("--prompt-tokens", prompt_tokens),
            ("--gen-tokens", gen_tokens),
            ("--repeat", repeat),
        ):
            if value < 1:
                raise click.ClickException(f"{flag} must be at least 1, got {value}")
        _check_max_model_len(max_model_len)
        batches = _batch_sizes(batch)
        log = None if as_json else (lambda msg: click.echo(f"vt bench: {msg}", err=True))
        result = run_bench(
            model,
            backend,
            prompt_tokens=prompt_tokens,
            gen_tokens=gen_tokens,
            kv_cache=kv_cache,
            max_model_len=max_model_len,
            max_batch_tokens=max_batch_tokens,
            repeat=repeat,
            log=log,
            verify=verify_setting(no_verify),
            batches=batches,
        )
        result.verification = flag_skipped(result.verification, no_verify)
    if as_json:
        exclude = {"runs": {"__all__": {"ids"}}, "batch_runs": {"__all__": {"ids"}}}
        click.echo(result.model_dump_json(exclude=exclude))
    else:
        click.echo(format_table(result))


def _batch_sizes(text: str | None) -> list[int] | None:
    """``--batch 1,8,32`` -> [1, 8, 32]; a one-line error for anything else."""
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise click.ClickException(
            f"--batch takes batch sizes of at least 1, comma separated (1,8,32), got {text!r}"
        )
    return sizes


COMMANDS = [run, bench]
