"""The HTTP side of ``vt serve``: a Starlette app with OpenAI's routes.

Handlers parse and check a request (tokenize, chat template, lengths), hand it to the
:class:`~vt.frontends.server.engine_loop.EngineLoop` and wait on their own asyncio queue.
Every error
is OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``; a message names the
field at fault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..engine import EngineUnhealthyError, RequestError, RequestOutput
from ..sampling import SamplingParams
from .engine_loop import Delivery, EngineLoop, Prompt, ShuttingDown
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
)

log = logging.getLogger("vt.frontends.server")
M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def payload(self) -> ErrorResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        info = ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.payload().model_dump(), status_code=self.status)


@dataclass
class ServerState:
    """What the handlers share. ``llm`` is a :class:`vt.LLM` (its engine is owned by
    ``engine_loop``; handlers use only its tokenizer, chat template and limits)."""

    llm: Any
    engine_loop: EngineLoop
    model_name: str
    created: int


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


async def parse(request: Request, model: type[M]) -> M:
    body = await request.body()
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, param = describe(exc)
        raise ApiError(400, message, param) from None


def sampling_params(
    req: Any, max_tokens: int | None, max_tokens_field: str = "max_tokens"
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


def create_app(state: ServerState) -> Starlette:
    """The ASGI app. The caller starts and stops ``state.engine_loop``."""

    def endpoint(
        handler: Callable[[Request, ServerState], Any],
    ) -> Callable[[Request], Any]:
        async def call(request: Request) -> Response:
            try:
                return await handler(request, state)
            except ApiError as exc:
                return exc.response()

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
        Route("/health", endpoint(health), methods=["GET"]),
        Route("/v1/models", endpoint(models), methods=["GET"]),
        Route("/v1/completions", endpoint(completions), methods=["POST"]),
        Route("/v1/chat/completions", endpoint(chat_completions), methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.vt = state
    return app


async def health(request: Request, state: ServerState) -> Response:
    s = state.engine_loop.stats
    ok, reason = state.engine_loop.healthy
    status = "ok" if ok else ("engine stopped" if not state.engine_loop.alive else "unhealthy")
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
    card = ModelCard(
        id=state.model_name, created=state.created, max_model_len=state.llm.max_model_len
    )
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


def check_prompt(state: ServerState, ids: list[int], field: str, param: str) -> None:
    """Refuse what the engine would (with the field named), before anything is queued."""
    if not ids:
        raise ApiError(400, f"{field}: the prompt is empty: it needs at least one token", param)
    vocab = int(state.llm.engine.vocab_size)
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ApiError(
            400, f"{field}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param
        )
    limit = state.llm.max_model_len
    if len(ids) >= limit:
        raise ApiError(
            400,
            f"{field}: the prompt has {len(ids)} tokens but this server's max_model_len is "
            f"{limit}; it must be shorter to leave room for at least one generated token",
            param,
            "context_length_exceeded",
        )


async def completions(request: Request, state: ServerState) -> Response:
    req = await parse(request, CompletionRequest)
    check_model(state, req.model)
    params = sampling_params(req, req.max_tokens)
    prompts: list[Prompt] = []
    for i, p in enumerate(req.prompt):
        field = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            prompt = Prompt(state.llm.encode(p), p)
        else:
            prompt = Prompt(list(p))
        check_prompt(state, prompt.ids, field, "prompt")
        prompts.append(prompt)
    stream = _Run(state, request, new_id("cmpl"), prompts, params)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await stream.respond(req.stream, include_usage, chat=False)


async def chat_completions(request: Request, state: ServerState) -> Response:
    from ...model.chat import ChatTemplateError

    req = await parse(request, ChatCompletionRequest)
    check_model(state, req.model)
    if req.max_completion_tokens is not None:
        params = sampling_params(req, req.max_completion_tokens, "max_completion_tokens")
    else:
        params = sampling_params(req, req.max_tokens)
    messages = [{"role": m.role, "content": m.content or ""} for m in req.messages]
    try:
        text = state.llm.render_chat(messages)
    except (ChatTemplateError, ValueError) as exc:
        raise ApiError(400, f"messages: {exc}", "messages") from None
    prompt = Prompt(state.llm.encode(text), text)
    check_prompt(state, prompt.ids, "messages", "messages")
    stream = _Run(state, request, new_id("chatcmpl"), [prompt], params)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await stream.respond(req.stream, include_usage, chat=True)


# --------------------------------------------------------------------------- one request


def _engine_error(exc: BaseException) -> ApiError:
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), "prompt")
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
    ) -> None:
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
        self.state.engine_loop.submit(self.id, self.prompts, self.params, self.queue, loop)
        try:
            first = await self.queue.get()  # accepted, or refused before anything ran
        except BaseException:
            self.state.engine_loop.abort(self.id)
            raise
        if first.error is not None:
            raise _engine_error(first.error)
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
                self.state.engine_loop.abort(self.id)
        if not self.done:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(self._chat_body() if chat else self._completion_body())

    # ---- waiting
    async def _next(self) -> Delivery:
        item = await self.queue.get()
        if item.error is not None:
            self.done = True
            raise _engine_error(item.error)
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
                self.state.engine_loop.abort(self.id)

    # ---- bodies
    def _usage(self) -> Usage:
        prompt = sum(len(p.ids) for p in self.prompts)
        completion = sum(len(o.ids) for o in self.finals.values())
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _completion_body(self) -> dict[str, Any]:
        choices = [
            CompletionChoice(
                index=i,
                text=out.text,
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
        while not self.done:
            item = await self._next()
            out = item.output
            assert out is not None
            if not out.delta_text and not out.finished:
                continue
            choice = CompletionChoice(
                index=item.index,
                text=out.delta_text,
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

        def chunk(delta: ChatDelta, out: RequestOutput | None = None) -> ChatCompletionChunk:
            finished = out is not None and out.finished
            choice = ChatChunkChoice(
                index=0,
                delta=delta,
                finish_reason=out.finish_reason if finished and out else None,
                stop_reason=out.stop_reason if finished and out else None,
            )
            return ChatCompletionChunk(
                id=self.id, created=self.created, model=name, choices=[choice]
            )

        yield chunk(ChatDelta(role="assistant", content=""))
        while not self.done:
            item = await self._next()
            out = item.output
            assert out is not None
            if out.delta_text:
                yield chunk(ChatDelta(content=out.delta_text))
            if out.finished:
                yield chunk(ChatDelta(), out)
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
