"""``vt serve``: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import click

from .options import max_batch_tokens_option
from .run_cmd import _check_max_model_len, _clean_errors, _open_llm, model_options

_MIB = 1 << 20
# The defaults of vt.frontends.server.Limits and vt.model.RenderLimits (a test keeps them
# equal), written out so that importing the CLI does not import the server.
DEFAULT_MAX_REQUEST_BYTES = 16 * _MIB
DEFAULT_MAX_WAITING = 256
DEFAULT_REQUEST_TIMEOUT = 30.0
DEFAULT_TEMPLATE_TIMEOUT = 5.0
DEFAULT_MAX_LOGPROBS = 20


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
@max_batch_tokens_option
@click.option(
    "--served-model-name",
    metavar="NAME",
    default=None,
    help="The model name clients send (and GET /v1/models lists).  [default: the --model "
    "name, the GGUF file's stem for a path, or the default model's name]",
)
@click.option(
    "--api-key",
    metavar="KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); /health and "
    "/metrics stay open.  [env: VT_API_KEY]",
)
@click.option(
    "--allowed-hosts",
    metavar="NAMES",
    default=None,
    help="Host header names accepted, comma separated ('*': any), against DNS rebinding.  "
    "[default: the --host address and localhost; any when --host is 0.0.0.0 or ::]",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(min=1024),
    default=DEFAULT_MAX_REQUEST_BYTES,
    show_default=True,
    metavar="N",
    help="Largest request body; a larger one is a 413.",
)
@click.option(
    "--max-waiting",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_WAITING,
    show_default=True,
    metavar="N",
    help="Requests (prompts) that may wait for a free slot; past that, 503 with Retry-After.",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_REQUEST_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="A request's headers must arrive within a third of this (at most 10 s) and its "
    "body within this; else 408 and the connection is closed.",
)
@click.option(
    "--template-timeout",
    type=click.FloatRange(min=0.01),
    default=DEFAULT_TEMPLATE_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="Longest a chat template may take to render one conversation (a 400 past it).",
)
@click.option(
    "--max-logprobs",
    type=click.IntRange(0, 20),
    default=DEFAULT_MAX_LOGPROBS,
    show_default=True,
    metavar="N",
    help="Most alternatives a request's logprobs/top_logprobs may ask for; 0 turns logprobs "
    "off (and saves a copy of each step's logits: --max-slots x vocabulary floats per "
    "output slot).",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse a free slot's KV for the prefix a new prompt shares with its earlier "
    "request (a chat template's system prompt, earlier turns), so only the rest is "
    "prefilled. Off: every prompt is prefilled whole.",
)
@click.option(
    "--disable-metrics",
    is_flag=True,
    help="Do not serve GET /metrics (Prometheus).",
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
    max_batch_tokens: int | None,
    served_model_name: str | None,
    api_key: str | None,
    allowed_hosts: str | None,
    max_request_bytes: int,
    max_waiting: int,
    request_timeout: float,
    template_timeout: float,
    max_logprobs: int,
    prefix_caching: bool,
    disable_metrics: bool,
    log_level: str,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, with continuous batching.

    \b
    Endpoints (see docs/server.md):
      GET  /health                 engine status (503 while loading or unhealthy)
      GET  /metrics                Prometheus metrics (unless --disable-metrics)
      GET  /v1/models              the served model
      POST /v1/completions         prompt: text, list of texts, or token ids
      POST /v1/chat/completions    messages through the model's chat template
    Both POST routes stream with "stream": true (server-sent events, then [DONE]).

    Every request joins the running batch at the next engine step; --max-slots of them
    decode at once, --max-waiting more wait for a slot. vt serve listens before it loads
    the model (/health says "loading" meanwhile), then prints the model, the backend (why
    it was chosen, whether it was verified), the readback path and the KV cache. Binding
    beyond loopback without --api-key prints a warning. Ctrl-C stops it: running requests
    end with an error and the model is released.

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
    from ... import envs
    from ...model.chat import RenderLimits
    from ..server import Server, bind
    from ..server.app import Limits

    with _clean_errors("vt serve"):
        _check_max_model_len(max_model_len)
        key = api_key if api_key is not None else envs.get("VT_API_KEY")
        hosts = None
        if allowed_hosts is not None:
            hosts = [h.strip() for h in allowed_hosts.split(",") if h.strip()]
            if not hosts:
                raise click.ClickException("--allowed-hosts needs at least one name (or '*')")
        limits = Limits(
            max_body_bytes=max_request_bytes,
            body_timeout_s=request_timeout,
            header_timeout_s=min(request_timeout / 3, 10.0),
            max_waiting=max_waiting,
            max_logprobs=max_logprobs,
        )
        _check_model_early(model)
        # Bind first: a busy or privileged port fails before seconds of model loading.
        sock = bind(host, port)
        try:
            name = served_model_name or _name_before_loading(model)
            server = Server(
                None,
                host=host,
                port=port,
                model_name=name,
                log_level=log_level,
                sock=sock,
                api_key=key,
                allowed_hosts=hosts,
                metrics=not disable_metrics,
                limits=limits,
                render_limits=RenderLimits(timeout_s=template_timeout),
                warn_exposure=False,  # printed below, as a vt serve line
            )
        except BaseException:
            sock.close()
            raise
    # SIGTERM (a service manager's stop) ends vt serve as Ctrl-C does, loading or serving.
    stop = _StopSignal()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _serve(server, model, backend, kv_cache, max_model_len, no_verify, max_slots,
               max_batch_tokens, key, host, stop, prefix_caching)  # fmt: skip
    except KeyboardInterrupt:  # a second signal while stopping: give up waiting
        click.echo("vt serve: interrupted", err=True)
        sys.exit(130)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("vt serve: stopped", err=True)


def _check_model_early(model: str | None) -> None:
    """A missing model file is an error before anything listens; a known model that is
    not downloaded yet is pulled while the server says it is loading."""
    from ...errors import ModelError
    from ...model.cache import DEFAULT_MODEL, known_model, resolve_model

    try:
        resolve_model(model, pull_if_missing=False)
    except ModelError:
        try:
            known_model(model or DEFAULT_MODEL)
        except ModelError:
            pass
        else:
            return
        raise


def _name_before_loading(model: str | None) -> str:
    """The served name known before the model loads: ``--model``'s name or file stem."""
    from pathlib import Path

    from ..server import default_model_name

    if model is None:
        return default_model_name(None, Path())
    return default_model_name(model, Path(model).expanduser())


def _serve(
    server: Any,
    model: str | None,
    backend: str | None,
    kv_cache: str,
    max_model_len: int | None,
    no_verify: bool,
    max_slots: int,
    max_batch_tokens: int | None,
    key: str | None,
    host: str,
    stop: _StopSignal,
    prefix_caching: bool = True,
) -> None:
    """Listen at once (``/health``: loading), load the model, serve until Ctrl-C."""
    from ..server.serve import exposure_warning

    server.start()
    click.echo(
        f"vt serve: listening on {server.url}/v1 (loading the model: /health answers 503 "
        "until it is ready)",
        err=True,
    )
    if (warning := exposure_warning(host, key)) is not None:
        click.echo(f"vt serve: warning: {warning}", err=True)
    llm = None
    try:
        with _clean_errors("vt serve"):
            try:
                llm = _open_llm(
                    model,
                    backend,
                    kv_cache,
                    max_model_len,
                    no_verify,
                    max_slots=max_slots,
                    max_batch_tokens=max_batch_tokens,
                    prefix_caching=prefix_caching,
                )
            except BaseException as exc:
                server.fail_loading(str(exc) or type(exc).__name__)
                raise
            server.attach(llm)
            stop.serving = True  # from now on a signal only sets stop.requested
        for line in startup_lines(llm, server, max_slots, max_batch_tokens):
            click.echo(f"vt serve: {line}", err=True)
        while not stop.requested.is_set() and not server.wait(0.2):
            pass
    finally:
        server.stop()
        if llm is not None:
            llm.close()


class _StopSignal:
    """The SIGINT/SIGTERM handler of ``vt serve``.

    While the model loads, a signal raises KeyboardInterrupt (the load stops at once:
    "interrupted", exit 130). Once serving, it only sets :attr:`requested`, which the main
    loop polls: raised there, it could land between any two statements after the "ready"
    line (a busy machine deschedules the main thread right after printing it), outside the
    loop's handler, and click ended the process with "Aborted!" and exit 1. A second
    signal while stopping raises, to stop waiting for the shutdown.
    """

    def __init__(self) -> None:
        self.serving = False
        self.requested = threading.Event()

    def __call__(self, signum: int, frame: object) -> None:
        if not self.serving or self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()


def startup_lines(
    llm: object, server: object, max_slots: int, max_batch_tokens: int | None
) -> list[str]:
    """What ``vt serve`` prints once the model is loaded: the model, the backend summary,
    and that it is ready."""

    a: Any = llm
    s: Any = server
    kv = a.kv_cache_stats()
    runner = getattr(a, "runner", None)
    steps = max_batch_tokens if runner is None else runner.max_batch_tokens  # resolved
    renderer = getattr(s, "renderer", None)
    if renderer is None or renderer.probe_error is None:
        template = "chat template checked"
    else:
        template = f"chat template unusable ({renderer.probe_error}): chat requests get 400"
    caching = "on" if getattr(getattr(a, "engine", None), "prefix_caching", False) else "off"
    lines = [
        f"model {a.model_name} ({a.model_path}) | max_model_len {a.max_model_len} | "
        f"{max_slots} slot(s) | {steps} tokens per step | prefix caching {caching} | {template}",
        f"backend {a.backend_name} ({a.backend_reason}) | {a.verification.summary()} | "
        f"readback {a.readback} | "
        f"kv {kv['backend']} {kv['mapped_bytes'] / _MIB:.1f}/{kv['reserved_bytes'] / _MIB:.1f} "
        f"MiB mapped, {kv['segments']} segment(s)",
        f"ready: serving model {s.model_name!r} on {s.url}/v1 (Ctrl-C stops)",
    ]
    return lines


COMMANDS = [serve]
