"""Chat templates from GGUF metadata, rendered in jinja2's immutable sandbox.

A GGUF is untrusted input, so its template runs in ``ImmutableSandboxedEnvironment``: a
template reaching for unsafe attributes (``__class__``, ``mro``, ...) or mutating its
inputs raises :class:`ChatTemplateError` instead of running.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ModelError

log = logging.getLogger(__name__)

#: Used when the model has no ``tokenizer.chat_template``.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ModelError):
    """The chat template is invalid, unsafe, or refused the messages."""


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's chat templates expect tojson without HTML escaping and with unicode kept.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as plain ``{"role", "content"}`` dicts; a clear error names the bad one.

    Accepts mappings or objects with ``role`` and ``content`` attributes (pydantic models).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{role, content}}, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            role, content = m.get("role"), m.get("content")
            extra = {k: v for k, v in m.items() if k not in ("role", "content")}
        elif hasattr(m, "role") and hasattr(m, "content"):
            role, content, extra = m.role, m.content, {}
        else:
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}"
            )
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"messages[{i}]: 'role' must be a non-empty string (e.g. {', '.join(ROLES)}), "
                f"got {role!r}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}] ({role}): 'content' must be a string, got {type(content).__name__}"
            )
        out.append({**extra, "role": role, "content": content})
    return out


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox normally renders an unsafe attribute as an empty Undefined; we refuse."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into a prompt string."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        is_fallback: bool = False,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the model's chat template is invalid (line {e.lineno}): {e.message}"
            ) from e

    @classmethod
    def from_model(cls, model_file: Any) -> ChatTemplate:
        """The template of a :class:`vt.model.ModelFile`, or ChatML when it has none."""
        return cls.from_metadata(model_file.metadata)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate:
        tokens = metadata.get("tokenizer.ggml.tokens") or []

        def token(key: str) -> str:
            i = metadata.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        source = metadata.get("tokenizer.chat_template")
        if source is None:
            log.warning("the model has no chat template (tokenizer.chat_template); using ChatML")
            return cls(CHATML_TEMPLATE, bos, eos, is_fallback=True)
        if not isinstance(source, str):
            raise ChatTemplateError("metadata 'tokenizer.chat_template' must be a string")
        return cls(source, bos, eos)

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``; extra ``kwargs`` reach the template."""
        msgs = validate_messages(messages)
        try:
            return self._template.render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except _TemplateRaised as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except SecurityError as e:
            raise ChatTemplateError(
                f"the model's chat template tried an unsafe operation and was stopped: {e}"
            ) from None
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(
                f"the model's chat template failed: {type(e).__name__}: {e}"
            ) from e

    def __repr__(self) -> str:
        kind = "ChatML fallback" if self.is_fallback else f"{len(self.source)} chars"
        return f"ChatTemplate({kind})"
