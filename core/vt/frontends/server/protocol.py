"""The OpenAI-compatible payloads of ``vt serve``: requests, responses, stream chunks, errors.

Requests forbid unknown fields (as OpenAI does), so a typo is a 400 that names the field
instead of a silently ignored option, and types are strict (pydantic's strict mode):
``"max_tokens": "10"``, ``"stream": "yes"`` or ``"max_tokens": true`` are 400s, not coerced.
Fields OpenAI defines that vt does not implement are accepted only at their neutral value
(``presence_penalty=0``, ...); anything else is a 400 saying it is not supported.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
)

FinishReason = Literal["stop", "length", "abort"]


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# --------------------------------------------------------------------------- requests


#: Every request model: unknown fields refused, no coercion between JSON types.
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """Fields completions and chat completions share."""

    model_config = STRICT

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, description="vt/vLLM extension; 0 or -1: off")
    seed: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM extension")
    user: str | None = None  # accepted and ignored, as OpenAI only logs it
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            raise ValueError("must be a string or a list of strings")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported (one choice per prompt), got {v}")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError(f"penalties are not supported yet; leave it 0, got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported yet")
        return v


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, a list of token
    ids, or a list of lists of token ids; each prompt gets one choice (index in order)."""

    prompt: Any
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        return normalize_prompt(v)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"logprobs must be >= 0, got {v}")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got {v}")
        return v


def normalize_prompt(v: Any) -> list[str | list[int]]:
    """Every accepted ``prompt`` shape as a list of prompts (text or token ids)."""
    shapes = "a string, a list of strings, a list of token ids or a list of lists of ids"
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not v:
        what = "an empty list" if isinstance(v, list) else type(v).__name__
        raise ValueError(f"must be {shapes}; got {what}")
    if all(_is_id(x) for x in v):
        return [list(v)]
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(isinstance(x, list) for x in v):
        for i, ids in enumerate(v):
            if not ids or not all(_is_id(x) for x in ids):
                raise ValueError(f"prompt {i} must be a non-empty list of integer token ids")
        return [list(ids) for ids in v]
    raise ValueError(f"must be {shapes}; got a list mixing types")


def _is_id(x: Any) -> bool:
    return type(x) is int


class ChatMessage(BaseModel):
    """One message. ``content`` may be OpenAI's list of parts; only text parts are taken,
    joined into one string."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"part {i}: only text parts are supported, got {kind!r}")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: 'text' must be a string")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("must be a string or a list of {'type': 'text', 'text': ...} parts")


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: until a stop or max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {v}")
        return v

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise ValueError("tool calling is not supported yet")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none"):
            raise ValueError("tool calling is not supported yet")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    #: Prompt tokens whose KV was reused from an earlier request (prefix caching).
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions ``logprobs`` object: one entry per generated token (with
    ``echo``, first one per prompt token: the first prompt token's entries are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM extension: the stop string or token id


class CompletionResponse(BaseModel):
    """The body of a non-streaming completion, and (``usage`` None) each stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vt"
    max_model_len: int  # vLLM extension


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
