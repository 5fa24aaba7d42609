"""The HTTP side of ``vt serve``: a Starlette app with OpenAI's routes.

Handlers parse and check a request (body size, JSON, fields, stop strings, prompt bytes,
then the chat template and the tokenizer off the event loop, then lengths), hand it to the
:class:`~vt.frontends.server.engine_loop.EngineLoop` and wait on their own asyncio queue.
In front of the routes, :class:`Guard` checks the ``Host`` header, the API key and the
content type. Every error is OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; a message names the field at fault.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine import EngineUnhealthyError, RequestError, RequestOutput
from ..sampling import SamplingParams
from .engine_loop import Delivery, EngineLoop, Prompt, QueueFull, ShuttingDown, TooManyPrompts
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    new_id,
)

log = logging.getLogger("vt.frontends.server")
M = TypeVar("M", bound=BaseModel)

_MIB = 1 << 20
#: Bodies up to this size are parsed on the event loop; larger ones on a worker thread.
_PARSE_INLINE_BYTES = 64 * 1024
#: Prompts up to this many bytes are tokenized on the event loop; longer ones off it.
_TOKENIZE_INLINE_BYTES = 4 * 1024


@dataclass(frozen=True)
class Limits:
    """What one request may cost (``docs/server.md``, "Limits")."""

    max_body_bytes: int = 16 * _MIB  # a larger body is a 413
    body_timeout_s: float = 30.0  # the whole body must arrive within this (else 408)
    header_timeout_s: float = 10.0  # the request line and headers (else 408, then closed)
    max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    max_stop_chars: int = 256  # characters per stop string
    max_stop_token_ids: int = 256
    max_waiting: int | None = 256  # prompts waiting for a slot; past it 503 + Retry-After
    max_logprobs: int = 20  # top_logprobs / logprobs at most this; 0: logprobs are off
    retry_after_s: int = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def payload(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.payload().model_dump(), status_code=self.status, headers=self.headers
        )


@dataclass
class ServerState:
    """What the handlers share. ``llm`` is a :class:`vt.LLM` (its engine is owned by
    ``engine_loop``; handlers use only its tokenizer, chat template and limits); both are
    None while the model loads (every model route answers 503)."""

    llm: Any
    engine_loop: EngineLoop | None
    model_name: str
    created: int
    limits: Limits = field(default_factory=Limits)
    metrics: Any = None  # a Metrics, or None with --disable-metrics
    renderer: Any = None  # a vt.model.chat.TemplateRenderer; None: llm.render_chat
    max_prompt_bytes: int | None = None  # prompt text past this cannot fit max_model_len
    loading_error: str | None = None

    def attach(self, llm: Any, engine_loop: EngineLoop, renderer: Any = None) -> None:
        """The model finished loading: serve it."""
        from ...model.tokenizer import Tokenizer

        tokenizer = llm.tokenizer
        per_token = tokenizer.max_token_bytes if isinstance(tokenizer, Tokenizer) else None
        if per_token is not None:
            self.max_prompt_bytes = int(llm.max_model_len) * max(per_token, 4)
        self.renderer = renderer
        self.engine_loop = engine_loop
        self.llm = llm

    def ready(self) -> tuple[Any, EngineLoop]:
        """``(llm, engine_loop)``, or a 503 while the model loads."""
        if self.llm is None or self.engine_loop is None:
            if self.loading_error is not None:
                raise ApiError(503, f"the model failed to load: {self.loading_error}")
            raise ApiError(
                503,
                "the model is still loading; retry shortly",
                code="model_loading",
                headers={"Retry-After": str(self.limits.retry_after_s)},
            )
        return self.llm, self.engine_loop


# --------------------------------------------------------------------------- the guard


def _host_name(host: str) -> str:
    """The host part of a ``Host`` header (no port, no brackets, lower case)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def default_allowed_hosts(bound: str) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``bound`` accepts by default: the bound
    address and the loopback names; None (any) for a wildcard bind (0.0.0.0, ::), which has
    no one address to check against."""
    if is_wildcard(bound):
        return None
    return frozenset({_host_name(bound), *LOOPBACK_NAMES})


class Guard:
    """ASGI middleware in front of the routes: ``Host`` check (DNS rebinding), API key
    (``/v1/*``), JSON content type for POST, and a declared body size over the limit."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None = None,
        allowed_hosts: Iterable[str] | None = None,
        max_body_bytes: int | None = None,
        on_reject: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        hosts = None if allowed_hosts is None else {_host_name(h) for h in allowed_hosts}
        self.allowed_hosts = None if hosts is None or "*" in hosts else frozenset(hosts)
        self.max_body_bytes = max_body_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is None:
            await self.app(scope, receive, send)
            return
        if self.on_reject is not None:
            self.on_reject(scope.get("path", ""), error.status)
        await error.response()(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k, v)
        path: str = scope.get("path", "")
        host = headers.get(b"host")
        if self.allowed_hosts is not None and host is not None:
            name = _host_name(host.decode("latin-1"))
            if name not in self.allowed_hosts:
                return ApiError(
                    403,
                    f"the Host header {name!r} is not one this server answers to "
                    f"({', '.join(sorted(self.allowed_hosts))}); start vt serve with "
                    "--allowed-hosts to add it",
                    code="host_not_allowed",
                )
        if self.api_key is not None and path.startswith("/v1/"):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                what = "no API key was given" if not given else "the API key is wrong"
                return ApiError(
                    401,
                    f"{what}: send it as 'Authorization: Bearer KEY' (the key vt serve "
                    "was started with, --api-key or VT_API_KEY)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope.get("method") == "POST":
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                shown = kind.decode("latin-1") or "none"
                return ApiError(
                    415,
                    f"the request body must be JSON with 'Content-Type: application/json' "
                    f"(got {shown})",
                )
            length = headers.get(b"content-length")
            if length is not None and self.max_body_bytes is not None:
                try:
                    declared = int(length)
                except ValueError:
                    return ApiError(400, f"bad Content-Length {length.decode('latin-1')!r}")
                if declared > self.max_body_bytes:
                    return _too_large(declared, self.max_body_bytes)
        return None


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size} bytes; this server takes at most {limit} "
        "(--max-request-bytes)",
        headers={"Connection": "close"},
    )


# --------------------------------------------------------------------------- parsing


def describe(err: ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` for a pydantic error: each bad field named, the first as param."""
    parts: list[str] = []
    first: str | None = None
    for e in err.errors():
        loc = [str(p) for p in e.get("loc", ())]
        where = ".".join(loc)
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        kind = e.get("type")
        if kind == "extra_forbidden":
            msg = "unknown parameter (not in the OpenAI API, or not supported by vt)"
        elif kind == "json_invalid":
            where = ""
            msg = f"the request body is not valid JSON ({e.get('ctx', {}).get('error', msg)})"
        elif kind == "model_type" and not loc:
            msg = "the request body must be a JSON object"
        if where and not msg.startswith(f"{loc[-1]} "):  # SamplingParams names it already
            msg = f"{where}: {msg}"
        parts.append(msg)
        if first is None and loc:
            first = loc[0]
    return "; ".join(parts), first


async def read_body(request: Request, limits: Limits) -> bytes:
    """The whole body, at most ``max_body_bytes`` (413), within ``body_timeout_s`` (408)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout_s
    chunks: list[bytes] = []
    total = 0
    stream = request.stream().__aiter__()
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), left)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {limits.body_timeout_s:g} s",
                headers={"Connection": "close"},
            ) from None
        total += len(chunk)
        if total > limits.max_body_bytes:
            raise _too_large(total, limits.max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model: type[M], limits: Limits) -> M:
    body = await read_body(request, limits)
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        if len(body) <= _PARSE_INLINE_BYTES:
            return model.model_validate_json(body)
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ApiError(400, message, param) from None


def check_stops(req: Any, limits: Limits) -> None:
    """Stop strings and stop ids, bounded: their cost is paid on the engine's thread."""
    stops = req.stop or []
    if len(stops) > limits.max_stop:
        raise ApiError(
            400,
            f"stop: {len(stops)} stop strings; at most {limits.max_stop} are allowed",
            "stop",
        )
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            raise ApiError(
                400,
                f"stop[{i}]: a stop string of {len(s)} characters; at most "
                f"{limits.max_stop_chars} are allowed",
                "stop",
            )
    ids = req.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise ApiError(
            400,
            f"stop_token_ids: {len(ids)} ids; at most {limits.max_stop_token_ids} are allowed",
            "stop_token_ids",
        )


def check_logprobs(k: int | None, limits: Limits, param: str) -> int | None:
    """The number of alternatives a request asks for, within the server's limit."""
    if k is None:
        return None
    if limits.max_logprobs == 0:
        raise ApiError(400, f"{param}: logprobs are turned off on this server", param)
    if k > limits.max_logprobs:
        raise ApiError(400, f"{param}: at most {limits.max_logprobs} alternatives, got {k}", param)
    return k


def sampling_params(
    req: Any,
    max_tokens: int | None,
    max_tokens_field: str = "max_tokens",
    logprobs: int | None = None,
) -> SamplingParams:
    """The engine's :class:`SamplingParams` of a request (OpenAI's defaults where unset);
    ``max_tokens_field`` is the name the request gave the limit."""
    values: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "seed": req.seed,
        "stop": req.stop or [],
        "stop_token_ids": req.stop_token_ids or [],
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
    }
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        message, param = describe(exc)
        if param == "max_tokens":
            message = message.replace("max_tokens", max_tokens_field)
            param = max_tokens_field
        raise ApiError(400, message, param) from None


# --------------------------------------------------------------------------- the app


def create_app(
    state: ServerState,
    *,
    api_key: str | None = None,
    allowed_hosts: Iterable[str] | None = None,
) -> ASGIApp:
    """The ASGI app (the routes behind :class:`Guard`). The caller starts and stops
    ``state.engine_loop``. ``allowed_hosts`` None accepts any ``Host``."""

    metrics = state.metrics

    def endpoint(
        route: str, handler: Callable[[Request, ServerState], Any]
    ) -> Callable[[Request], Any]:
        async def call(request: Request) -> Response:
            try:
                response = await handler(request, state)
            except ApiError as exc:
                response = exc.response()
            except ClientDisconnect:
                response = Response(status_code=499)
            if metrics is not None:
                metrics.requests.labels(route=route, status=str(response.status_code)).inc()
            return response

        return call

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        where = f"{request.method} {request.url.path}"
        msg = f"{where}: {exc.detail}" if exc.status_code != 404 else f"{where}: no such route"
        return ApiError(exc.status_code, msg).response()

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    routes = [
        Route("/health", endpoint("/health", health), methods=["GET"]),
        Route("/v1/models", endpoint("/v1/models", models), methods=["GET"]),
        Route("/v1/completions", endpoint("/v1/completions", completions), methods=["POST"]),
        Route(
            "/v1/chat/completions",
            endpoint("/v1/chat/completions", chat_completions),
            methods=["POST"],
        ),
    ]
    if metrics is not None:
        routes.append(Route("/metrics", metrics_route(metrics), methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.vt = state

    def rejected(path: str, status: int) -> None:
        if metrics is not None:
            metrics.requests.labels(route="(refused)", status=str(status)).inc()

    return Guard(
        app,
        api_key=api_key,
        allowed_hosts=allowed_hosts,
        max_body_bytes=state.limits.max_body_bytes,
        on_reject=rejected,
    )


def metrics_route(metrics: Any) -> Callable[[Request], Any]:
    from .metrics import CONTENT_TYPE

    async def scrape(request: Request) -> Response:
        body = await asyncio.to_thread(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    return scrape


async def health(request: Request, state: ServerState) -> Response:
    loop = state.engine_loop
    if state.llm is None or loop is None:
        status = "loading" if state.loading_error is None else "failed"
        body = {"status": status, "reason": state.loading_error, "model": state.model_name}
        return JSONResponse(body, status_code=503)
    s = loop.stats
    ok, reason = loop.healthy
    status = "ok" if ok else ("engine stopped" if not loop.alive else "unhealthy")
    body = {
        "status": status,
        "reason": reason,
        "model": state.model_name,
        "backend": state.llm.backend_name,
        "running": s.running,
        "waiting": s.waiting,
        "steps": s.steps,
        "failed_steps": s.failed_steps,
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def models(request: Request, state: ServerState) -> Response:
    llm, _ = state.ready()
    card = ModelCard(id=state.model_name, created=state.created, max_model_len=llm.max_model_len)
    return JSONResponse(ModelList(data=[card]).model_dump())


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(
            404,
            f"model: the model {name!r} does not exist; this server serves "
            f"{state.model_name!r} (see GET /v1/models)",
            "model",
            "model_not_found",
        )


def _too_long(state: ServerState, field: str, param: str, what: str) -> ApiError:
    return ApiError(
        400,
        f"{field}: {what} but this server's max_model_len is {state.llm.max_model_len}; it "
        "must be shorter to leave room for at least one generated token",
        param,
        "context_length_exceeded",
    )


def check_prompt_bytes(state: ServerState, nbytes: int, field: str, param: str) -> None:
    """Refuse text that cannot fit ``max_model_len`` before anything tokenizes or renders
    it: no token stands for more bytes than the vocabulary's longest one."""
    bound = state.max_prompt_bytes
    if bound is not None and nbytes > bound:
        raise _too_long(
            state,
            field,
            param,
            f"the prompt is {nbytes} bytes, more than any {state.llm.max_model_len} tokens "
            f"of this model can hold ({bound} bytes)",
        )


def check_prompt(state: ServerState, ids: list[int], field: str, param: str) -> None:
    """Refuse what the engine would (with the field named), before anything is queued."""
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty: it needs at least one token", param)
    limit = state.llm.max_model_len
    if len(ids) >= limit:
        raise _too_long(state, field, param, f"the prompt has {len(ids)} tokens")
    vocab = int(state.llm.engine.vocab_size)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ApiError(
            400, f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param
        )


async def tokenize(state: ServerState, text: str, field: str, param: str) -> Prompt:
    """The prompt of ``text``: bytes bounded first, then tokenized (off the event loop when
    long), then checked."""
    nbytes = len(text.encode("utf-8", "surrogatepass"))
    check_prompt_bytes(state, nbytes, field, param)
    if nbytes <= _TOKENIZE_INLINE_BYTES:
        ids = state.llm.encode(text)
    else:
        ids = await asyncio.to_thread(state.llm.encode, text)
    check_prompt(state, ids, field, param)
    return Prompt(ids, text)


async def completions(request: Request, state: ServerState) -> Response:
    state.ready()
    req = await parse(request, CompletionRequest, state.limits)
    check_model(state, req.model)
    check_stops(req, state.limits)
    logprobs = check_logprobs(req.logprobs, state.limits, "logprobs")
    params = sampling_params(req, req.max_tokens, logprobs=logprobs)
    if req.echo and logprobs is not None:  # the prompt's tokens are scored too
        params = params.model_copy(update={"prompt_logprobs": logprobs})
    prompts: list[Prompt] = []
    n = len(req.prompt)
    fields = ["prompt" if n == 1 else f"prompt[{i}]" for i in range(n)]
    for field_name, p in zip(fields, req.prompt, strict=True):  # cheap checks first
        if isinstance(p, str):
            check_prompt_bytes(state, len(p.encode("utf-8", "surrogatepass")), field_name, "prompt")
        else:
            check_prompt(state, p, field_name, "prompt")
    for field_name, p in zip(fields, req.prompt, strict=True):
        if isinstance(p, str):
            prompts.append(await tokenize(state, p, field_name, "prompt"))
        else:
            prompts.append(Prompt(list(p)))
    stream = _Run(state, request, new_id("cmpl"), prompts, params, echo=req.echo)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await stream.respond(req.stream, include_usage, chat=False)


async def chat_completions(request: Request, state: ServerState) -> Response:
    from ...model.chat import ChatTemplateError

    llm, _ = state.ready()
    req = await parse(request, ChatCompletionRequest, state.limits)
    check_model(state, req.model)
    check_stops(req, state.limits)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs 'logprobs': true", "top_logprobs")
    logprobs = None
    if req.logprobs:
        param = "top_logprobs" if req.top_logprobs is not None else "logprobs"
        logprobs = check_logprobs(req.top_logprobs or 0, state.limits, param)
    if req.max_completion_tokens is not None:
        limit, name = req.max_completion_tokens, "max_completion_tokens"
    else:
        limit, name = req.max_tokens, "max_tokens"
    params = sampling_params(req, limit, name, logprobs)
    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    content = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
    check_prompt_bytes(state, content, "messages", "messages")
    try:
        if state.renderer is not None:
            text = await asyncio.to_thread(state.renderer.render, messages)
        else:
            text = await asyncio.to_thread(llm.render_chat, messages)
    except (ChatTemplateError, ValueError) as exc:
        raise ApiError(400, f"messages: {exc}", "messages") from None
    prompt = await tokenize(state, text, "messages", "messages")
    stream = _Run(state, request, new_id("chatcmpl"), [prompt], params)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await stream.respond(req.stream, include_usage, chat=True)


# --------------------------------------------------------------------------- one request


def _engine_error(exc: BaseException, state: ServerState) -> ApiError:
    if isinstance(exc, (RequestError, TooManyPrompts)):
        return ApiError(400, str(exc), "prompt")
    if isinstance(exc, QueueFull):
        if state.metrics is not None:
            state.metrics.rejected.labels(reason="queue_full").inc()
        retry = {"Retry-After": str(state.limits.retry_after_s)}
        return ApiError(503, str(exc), code="server_busy", headers=retry)
    if isinstance(exc, (ShuttingDown, EngineUnhealthyError)):
        return ApiError(503, str(exc))
    return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", code="engine_error")


class _Run:
    """One HTTP request's prompts in the engine: submit, then answer or stream."""

    def __init__(
        self,
        state: ServerState,
        request: Request,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        echo: bool = False,
    ) -> None:
        _, self.engine_loop = state.ready()
        self.echo = echo  # completions: the prompt's text (and logprobs) come first
        self.state = state
        self.request = request
        self.id = request_id
        self.prompts = prompts
        self.params = params
        self.created = int(time.time())
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self.finals: dict[int, RequestOutput] = {}
        self.done = False  # every prompt finished or failed: nothing to abort

    async def respond(self, stream: bool, include_usage: bool, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        self.engine_loop.submit(
            self.id, self.prompts, self.params, self.queue, loop, finals_only=not stream
        )
        try:
            first = await self.queue.get()  # accepted, or refused before anything ran
        except BaseException:
            self.engine_loop.abort(self.id)
            raise
        if first.error is not None:
            raise _engine_error(first.error, self.state)
        if stream:
            events = self._chat_events if chat else self._completion_events
            return StreamingResponse(
                self._sse(events(include_usage)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            await self._collect()
        finally:
            if not self.done:
                self.engine_loop.abort(self.id)
        if not self.done:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(self._chat_body() if chat else self._completion_body())

    # ---- waiting
    async def _next(self) -> Delivery:
        item = await self.queue.get()
        if item.error is not None:
            self.done = True
            raise _engine_error(item.error, self.state)
        assert item.output is not None
        if item.output.finished:
            self.finals[item.index] = item.output
            self.done = len(self.finals) == len(self.prompts)
        return item

    async def _collect(self) -> None:
        """Wait for every prompt to finish, or for the client to disconnect."""
        gone = asyncio.ensure_future(_disconnected(self.request))
        try:
            while not self.done:
                nxt = asyncio.ensure_future(self._next())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return
                nxt.result()
        finally:
            gone.cancel()

    async def _sse(self, events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects: abort in finally.
        try:
            try:
                async for event in events:
                    yield f"data: {event.model_dump_json()}\n\n"
            except ApiError as exc:
                # The status line is gone already: the error travels as an event, as in
                # OpenAI's and vLLM's streams (the openai client raises it).
                yield f"data: {exc.payload().model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not self.done:
                self.engine_loop.abort(self.id)

    # ---- bodies
    def _usage(self) -> Usage:
        prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(o.ids) for o in self.finals.values())
        cached = sum(o.num_cached_tokens for o in self.finals.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    # ---- logprobs (token-aligned: one entry per generated id, the stop token included)
    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.state.llm.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _echo_text(self, index: int) -> str:
        """The prompt as the choice's text starts with it (``echo``)."""
        p = self.prompts[index]
        return p.text if p.text is not None else self.state.llm.tokenizer.decode(p.ids)

    def _prompt_entries(self, out: RequestOutput) -> tuple[list[str], list[Any], list[Any]]:
        """``echo`` with logprobs: the prompt's tokens, logprobs (the first is None: nothing
        predicts it) and alternatives, as the legacy object lists them."""
        tokens, values, tops = [], [], []
        entries = out.prompt_logprobs or [None] * len(out.prompt_ids)
        for tid, e in zip(out.prompt_ids, entries, strict=True):
            tokens.append(self._token(tid)[0])
            values.append(None if e is None else e.logprob)
            tops.append(None if e is None else self._top(e, tokens[-1]))
        return tokens, values, tops

    def _top(self, e: Any, text: str) -> dict[str, float]:
        top: dict[str, float] = {}
        for t in e.top:  # two ids may print alike (partial UTF-8): the likelier stays
            top.setdefault(self._token(t.token_id)[0], t.logprob)
        top.setdefault(text, e.logprob)  # the sampled (or prompt) token is always listed
        return top

    def _completion_logprobs(
        self, entries: list[Any] | None, offset: int = 0, echo: RequestOutput | None = None
    ) -> CompletionLogprobs | None:
        """The legacy logprobs object of ``entries``; ``echo``: the prompt's first."""
        if entries is None or self.params.logprobs is None:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        if echo is not None:
            tokens, values, tops = self._prompt_entries(echo)
            for t in tokens:
                offsets.append(offset)
                offset += len(t)
        for e in entries:
            text, _ = self._token(e.token_id)
            tokens.append(text)
            values.append(e.logprob)
            tops.append(self._top(e, text))
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    def _chat_logprobs(self, entries: list[Any] | None) -> ChatLogprobs | None:
        if entries is None or self.params.logprobs is None:
            return None
        content = []
        for e in entries:
            text, raw = self._token(e.token_id)
            top = []
            for t in e.top:
                t_text, t_raw = self._token(t.token_id)
                top.append(TopLogprob(token=t_text, logprob=t.logprob, bytes=t_raw))
            content.append(
                ChatTokenLogprob(token=text, logprob=e.logprob, bytes=raw, top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    def _completion_body(self) -> dict[str, Any]:
        choices = [
            CompletionChoice(
                index=i,
                text=(self._echo_text(i) if self.echo else "") + out.text,
                logprobs=self._completion_logprobs(out.logprobs, 0, out if self.echo else None),
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
            )
            for i, out in sorted(self.finals.items())
        ]
        body = CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=choices,
            usage=self._usage(),
        )
        return body.model_dump()

    def _chat_body(self) -> dict[str, Any]:
        out = self.finals[0]
        body = ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.model_name,
            choices=[
                ChatChoice(
                    index=0,
                    message=AssistantMessage(content=out.text),
                    logprobs=self._chat_logprobs(out.logprobs),
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            ],
            usage=self._usage(),
        )
        return body.model_dump()

    # ---- stream events
    async def _completion_events(self, include_usage: bool) -> AsyncIterator[BaseModel]:
        name = self.state.model_name
        held: dict[int, list[Any]] = {}  # logprobs of tokens whose text is not out yet
        offsets: dict[int, int] = {}
        echoed: set[int] = set()  # choices whose first chunk (with the prompt) went out
        while not self.done:
            item = await self._next()
            out = item.output
            assert out is not None
            held.setdefault(item.index, []).extend(out.delta_logprobs or [])
            if not out.delta_text and not out.finished:
                continue
            entries = held.pop(item.index, [])
            echo = self.echo and item.index not in echoed
            echoed.add(item.index)
            logprobs = self._completion_logprobs(
                entries, offsets.get(item.index, 0), out if echo else None
            )
            if logprobs is not None:
                offsets[item.index] = offsets.get(item.index, 0) + sum(map(len, logprobs.tokens))
            choice = CompletionChoice(
                index=item.index,
                text=(self._echo_text(item.index) if echo else "") + out.delta_text,
                logprobs=logprobs,
                finish_reason=out.finish_reason if out.finished else None,
                stop_reason=out.stop_reason if out.finished else None,
            )
            yield CompletionResponse(id=self.id, created=self.created, model=name, choices=[choice])
        if include_usage:
            yield CompletionResponse(
                id=self.id, created=self.created, model=name, choices=[], usage=self._usage()
            )

    async def _chat_events(self, include_usage: bool) -> AsyncIterator[BaseModel]:
        name = self.state.model_name

        def chunk(
            delta: ChatDelta, out: RequestOutput | None = None, logprobs: Any = None
        ) -> ChatCompletionChunk:
            finished = out is not None and out.finished
            choice = ChatChunkChoice(
                index=0,
                delta=delta,
                logprobs=logprobs,
                finish_reason=out.finish_reason if finished and out else None,
                stop_reason=out.stop_reason if finished and out else None,
            )
            return ChatCompletionChunk(
                id=self.id, created=self.created, model=name, choices=[choice]
            )

        yield chunk(ChatDelta(role="assistant", content=""))
        held: list[Any] = []  # logprobs of tokens whose text is not out yet
        while not self.done:
            item = await self._next()
            out = item.output
            assert out is not None
            held.extend(out.delta_logprobs or [])
            if out.delta_text:
                yield chunk(ChatDelta(content=out.delta_text), None, self._chat_logprobs(held))
                held = []
            if out.finished:
                yield chunk(ChatDelta(), out, self._chat_logprobs(held) if held else None)
        if include_usage:
            yield ChatCompletionChunk(
                id=self.id, created=self.created, model=name, choices=[], usage=self._usage()
            )


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
