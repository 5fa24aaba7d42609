"""Run the app under uvicorn on a socket vt binds itself (so a busy port is a clean error
and port 0 picks a free one), with the engine loop started and stopped around it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from ...errors import VtError
from .app import ServerState, create_app
from .engine_loop import EngineLoop

LOG_LEVELS = ("debug", "info", "warning", "error")


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


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # End running requests first (their clients get an error), so uvicorn's graceful
        # shutdown does not wait for long generations to finish.
        await asyncio.to_thread(self.engine_loop.stop)
        await super().shutdown(sockets)


class Server:
    """``llm`` served over HTTP: :meth:`run` blocks (Ctrl-C stops it cleanly), or
    :meth:`start` runs it on a thread until :meth:`stop`. Closing ``llm`` is the caller's
    job, after the server has stopped.

    ``sock``: a socket :func:`bind` already returned for ``host:port`` (``vt serve`` binds
    before loading the model, so a busy port fails at once); None binds here."""

    def __init__(
        self,
        llm: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        log_level: str = "info",
        sock: socket.socket | None = None,
    ) -> None:
        self.llm = llm
        self.sock = sock if sock is not None else bind(host, port)
        self.host = host
        self.port = int(self.sock.getsockname()[1])
        self.model_name = model_name or str(llm.model_name)
        self.engine_loop = EngineLoop(llm.engine)
        state = ServerState(llm, self.engine_loop, self.model_name, int(time.time()))
        self.app = create_app(state)
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            access_log=log_level in ("debug", "info"),
            timeout_graceful_shutdown=5,
            lifespan="off",
        )
        self._uvicorn = _Uvicorn(config, self.engine_loop)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until Ctrl-C (SIGINT/SIGTERM when on the main thread) or :meth:`stop`."""
        self.engine_loop.start()
        try:
            self._uvicorn.run(sockets=[self.sock])
        finally:
            self.engine_loop.stop()
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

    def stop(self, timeout: float = 30.0) -> None:
        """Stop a server started with :meth:`start` (or from a signal handler)."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
