"""Run the app under uvicorn on a socket vt binds itself (so a busy port is a clean error
and port 0 picks a free one), with the engine loop started and stopped around it.

The server can start before its model is loaded (:meth:`Server.attach` hands it over):
``/health`` then answers 503 ``"loading"`` and the model routes 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...errors import VtError
from .app import Limits, ServerState, create_app, default_allowed_hosts, is_loopback
from .engine_loop import EngineLoop

LOG_LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("vt.frontends.server")

#: The most bytes of a request line and headers (h11 refuses larger ones with a 400).
MAX_HEADER_BYTES = 64 * 1024


def default_model_name(model: str | None, path: Path) -> str:
    """The name clients send as ``model``: the name given to ``--model``, else the file's
    stem for a path, else the default model's name."""
    from ...model.cache import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    if Path(model).expanduser().is_file() or "/" in model or model.endswith(".gguf"):
        return path.stem
    return model


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6), or a :class:`VtError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise VtError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise VtError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for a server reachable beyond this machine without an API key."""
    if api_key or is_loopback(host):
        return None
    return (
        f"listening on {host}, beyond this machine, without an API key: anyone who can "
        "reach it can use the model (set --api-key or VT_API_KEY)"
    )


class _QuietLifecycle(logging.Filter):
    """Drops uvicorn's process lifecycle lines: ``vt serve`` prints its own."""

    NOISE = ("Started server process", "Finished server process", "Shutting down")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.NOISE)


def _quiet_uvicorn() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietLifecycle) for f in logger.filters):
        logger.addFilter(_QuietLifecycle())


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers: a
    client that opens a connection (or starts a request) and does not finish its headers
    within ``header_timeout`` gets a 408 and the connection is closed. (uvicorn's own
    keep-alive timeout only runs between requests, so partial headers could hold a
    connection forever.) The body's deadline is the app's (``Limits.body_timeout_s``)."""

    header_timeout = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _header_deadline(self) -> None:
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return  # closed, or the request's headers arrived
        if self.conn.trailing_data[0]:  # part of a request arrived: say why we hang up
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                b"content-length: 49\r\nconnection: close\r\n\r\n"
                b"the request headers did not arrive in time (408)\n"
            )
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._header_timer.cancel()
            self._arm_header_timer()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, owner: Server) -> None:
        super().__init__(config)
        self.owner = owner

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # End running requests first (their clients get an error), so uvicorn's graceful
        # shutdown does not wait for long generations to finish.
        loop = self.owner.engine_loop
        if loop is not None:
            await asyncio.to_thread(loop.stop)
        await super().shutdown(sockets)


class Server:
    """``llm`` served over HTTP: :meth:`run` blocks (Ctrl-C stops it cleanly), or
    :meth:`start` runs it on a thread until :meth:`stop`. Closing ``llm`` is the caller's
    job, after the server has stopped.

    ``llm`` may be None: the server answers ``/health`` with 503 ``"loading"`` until
    :meth:`attach` gives it the model. ``sock``: a socket :func:`bind` already returned for
    ``host:port`` (``vt serve`` binds before loading the model, so a busy port fails at
    once); None binds here. ``api_key``: required as ``Authorization: Bearer`` on
    ``/v1/*``. ``allowed_hosts``: the ``Host`` names accepted (``["*"]``: any); None: the
    bound address and the loopback names (any for 0.0.0.0 or ::). ``metrics``: serve
    ``GET /metrics``. ``limits``: see :class:`Limits`; ``render_limits``: the chat
    template's (:class:`vt.model.RenderLimits`). ``warn_exposure``: log a warning when
    listening beyond loopback without an API key.
    """

    def __init__(
        self,
        llm: Any = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        log_level: str = "info",
        sock: socket.socket | None = None,
        api_key: str | None = None,
        allowed_hosts: list[str] | None = None,
        metrics: bool = True,
        limits: Limits | None = None,
        render_limits: Any = None,
        warn_exposure: bool = True,
    ) -> None:
        from .metrics import Metrics

        if llm is None and model_name is None:
            raise ValueError("a server started before its model is loaded needs a model_name")
        self.llm: Any = None
        self.sock = sock if sock is not None else bind(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.model_name = model_name or str(llm.model_name)
        self.limits = limits or Limits()
        self.render_limits = render_limits
        self.engine_loop: EngineLoop | None = None
        self.renderer: Any = None
        self.metrics = Metrics(self.model_name) if metrics else None
        self.state = ServerState(
            None, None, self.model_name, int(time.time()), self.limits, self.metrics
        )
        hosts = default_allowed_hosts(host) if allowed_hosts is None else allowed_hosts
        self.allowed_hosts = None if hosts is None else sorted(hosts)
        self.app = create_app(self.state, api_key=api_key, allowed_hosts=hosts)
        if warn_exposure and (warning := exposure_warning(host, api_key)) is not None:
            log.warning("%s", warning)
        protocol = type("TimedH11", (_TimedH11,), {"header_timeout": self.limits.header_timeout_s})
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            access_log=log_level in ("debug", "info"),
            timeout_graceful_shutdown=5,
            lifespan="off",
            http=protocol,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        self._uvicorn = _Uvicorn(config, self)
        _quiet_uvicorn()
        self._thread: threading.Thread | None = None
        self._running = False
        if llm is not None:
            self.attach(llm)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def attach(self, llm: Any) -> None:
        """Serve ``llm`` (loaded after the server started, or given to the constructor):
        the chat template renderer starts and checks the template, the engine loop starts
        if the server runs."""
        from ...model.chat import TemplateRenderer

        self.llm = llm
        template = getattr(llm, "chat_template", None)
        if template is not None:
            self.renderer = TemplateRenderer(template, self.render_limits)
        runner = getattr(llm, "runner", None)
        if self.limits.max_logprobs and hasattr(runner, "enable_logprobs"):
            runner.enable_logprobs(self.limits.max_logprobs)  # before the engine thread runs
        engine_loop = EngineLoop(llm.engine, self.limits.max_waiting, self.metrics)
        self.engine_loop = engine_loop
        if self.metrics is not None:
            self._gauges(llm, engine_loop)
        if self._running:
            engine_loop.start()
        self.state.attach(llm, engine_loop, self.renderer)

    def _gauges(self, llm: Any, loop: EngineLoop) -> None:
        m = self.metrics
        assert m is not None

        def kv(key: str) -> float:
            try:
                return float(llm.kv_cache_stats()[key])
            except Exception:  # noqa: BLE001 - a scrape never fails on a closed model
                return 0.0

        m.gauge("vt_requests_running", "Requests holding a KV slot", lambda: loop.stats.running)
        m.gauge(
            "vt_requests_waiting",
            "Requests waiting for a KV slot (the queue)",
            lambda: max(loop.admitted - loop.stats.running, 0),
        )
        m.gauge("vt_kv_slots", "KV slots (--max-slots)", lambda: llm.engine.max_slots)
        m.gauge(
            "vt_kv_cache_usage_ratio",
            "KV slots in use, as a fraction of all",
            lambda: loop.stats.running / max(llm.engine.max_slots, 1),
        )
        m.gauge("vt_kv_cache_mapped_bytes", "KV cache bytes mapped", lambda: kv("mapped_bytes"))
        m.gauge(
            "vt_kv_cache_reserved_bytes", "KV cache bytes reserved", lambda: kv("reserved_bytes")
        )
        m.gauge("vt_engine_healthy", "1 while the engine takes requests", lambda: loop.healthy[0])

    def fail_loading(self, reason: str) -> None:
        """The model could not be loaded: ``/health`` says so until the server stops."""
        self.state.loading_error = reason

    def run(self) -> None:
        """Serve until Ctrl-C (SIGINT/SIGTERM when on the main thread) or :meth:`stop`."""
        self._running = True
        if self.engine_loop is not None:
            self.engine_loop.start()
        try:
            self._uvicorn.run(sockets=[self.sock])
        finally:
            self._running = False
            if self.engine_loop is not None:
                self.engine_loop.stop()
            if self.renderer is not None:
                self.renderer.close()
            self.sock.close()

    def start(self, timeout: float = 30.0) -> None:
        """Serve on a background thread; returns once requests are being accepted."""
        self._thread = threading.Thread(target=self.run, name="vt-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise VtError(f"the server on {self.url} did not start")
            time.sleep(0.01)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a server started with :meth:`start` stops; False on timeout."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop a server started with :meth:`start` (or from a signal handler)."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
