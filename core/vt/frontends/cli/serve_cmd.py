"""``vt serve``: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import signal

import click

from .run_cmd import _check_max_model_len, _clean_errors, _open_llm, model_options

_MIB = 1 << 20


@click.command("serve")
@model_options
@click.option(
    "--host",
    default="127.0.0.1",
    metavar="ADDR",
    show_default=True,
    help="Address to listen on; 0.0.0.0 (or ::) listens on every interface.",
)
@click.option(
    "--port",
    "-p",
    type=click.IntRange(0, 65535),
    default=8000,
    metavar="PORT",
    show_default=True,
    help="TCP port; 0 picks a free one (printed on start).",
)
@click.option(
    "--max-slots",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    metavar="N",
    help="Requests decoded at once (KV slots); more wait in a queue for a free slot.",
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    metavar="N",
    help="Most tokens in one engine step; long prompts are prefilled in chunks of this size "
    "alongside the running requests' decode tokens.",
)
@click.option(
    "--served-model-name",
    metavar="NAME",
    default=None,
    help="The model name clients send (and GET /v1/models lists).  [default: the --model "
    "name, the GGUF file's stem for a path, or the default model's name]",
)
@click.option(
    "--log-level",
    type=click.Choice(("debug", "info", "warning", "error")),
    default="info",
    show_default=True,
    help="uvicorn's log level; info and debug also log one line per request.",
)
def serve(
    model: str | None,
    backend: str | None,
    no_verify: bool,
    kv_cache: str,
    max_model_len: int | None,
    host: str,
    port: int,
    max_slots: int,
    max_batch_tokens: int,
    served_model_name: str | None,
    log_level: str,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with continuous batching.

    \b
    Endpoints (see docs/server.md):
      GET  /health                 engine status, running and waiting requests
      GET  /v1/models              the served model
      POST /v1/completions         prompt: text, list of texts, or token ids
      POST /v1/chat/completions    messages through the model's chat template
    Both POST routes stream with "stream": true (server-sent events, then [DONE]).

    Every request joins the running batch at the next engine step; --max-slots of them
    decode at once. On start, vt serve prints where it listens, the backend (why it was
    chosen, whether it was verified), the readback path of sampled tokens and the KV cache.
    Ctrl-C stops it: running requests end with an error and the model is released.

    \b
    Examples:
      vt serve
      vt serve --model model.gguf --port 8080 --max-slots 16
      vt serve --backend cpu --kv-cache contiguous --max-model-len 2048
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2-135m-instruct-q4_1",
             "messages": [{"role": "user", "content": "Hi"}]}'

    Exit status: 0 after Ctrl-C, 1 on an error (one line on stderr, e.g. a busy port).
    """
    from ..server import Server, bind, default_model_name

    with _clean_errors("vt serve"):
        _check_max_model_len(max_model_len)
        # Bind first: a busy or privileged port fails before seconds of model loading.
        sock = bind(host, port)
        try:
            llm = _open_llm(
                model,
                backend,
                kv_cache,
                max_model_len,
                no_verify,
                max_slots=max_slots,
                max_batch_tokens=max_batch_tokens,
            )
        except BaseException:
            sock.close()
            raise
    with llm:
        with _clean_errors("vt serve"):
            name = served_model_name or default_model_name(model, llm.model_path)
            server = Server(
                llm, host=host, port=port, model_name=name, log_level=log_level, sock=sock
            )
        for line in startup_lines(llm, server, max_slots, max_batch_tokens):
            click.echo(f"vt serve: {line}", err=True)
        # uvicorn handles SIGINT and SIGTERM while it runs, then re-raises the signal it
        # caught; as KeyboardInterrupt both end here, so the model is released either way.
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
    click.echo("vt serve: stopped", err=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def startup_lines(llm: object, server: object, max_slots: int, max_batch_tokens: int) -> list[str]:
    """What ``vt serve`` prints on start: the model, the backend summary, the address."""
    from typing import Any

    a: Any = llm
    s: Any = server
    kv = a.kv_cache_stats()
    return [
        f"model {a.model_name} ({a.model_path}) | max_model_len {a.max_model_len} | "
        f"{max_slots} slot(s) | {max_batch_tokens} tokens per step",
        f"backend {a.backend_name} ({a.backend_reason}) | {a.verification.summary()} | "
        f"readback {a.readback} | "
        f"kv {kv['backend']} {kv['mapped_bytes'] / _MIB:.1f}/{kv['reserved_bytes'] / _MIB:.1f} "
        f"MiB mapped, {kv['segments']} segment(s)",
        f"listening on {s.url}/v1 as model {s.model_name!r} (Ctrl-C stops)",
    ]


COMMANDS = [serve]
