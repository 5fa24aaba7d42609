"""Chat templates from GGUF metadata, rendered in jinja2's immutable sandbox under limits.

A GGUF is untrusted input, so its template runs in ``ImmutableSandboxedEnvironment`` (with
the time and size limits of :mod:`vt.model.template_sandbox`): a template reaching for
unsafe attributes (``__class__``, ``mro``, ...), mutating its inputs, running too long,
building huge strings or failing in any way raises :class:`ChatTemplateError`, one line.

:meth:`ChatTemplate.render` renders in this process (``vt run``, ``vt.LLM``).
:class:`TemplateRenderer` renders in worker processes that are killed when a render runs
past its time and whose memory is capped, and checks the template with a probe
conversation when it starts (``vt serve``).
"""

from __future__ import annotations

import json
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError

from ..errors import ModelError
from . import template_sandbox as sandbox
from .string_array import ARRAY_TYPES

log = logging.getLogger(__name__)

#: Used when the model has no ``tokenizer.chat_template``.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")

#: The conversations a template is checked with when the server starts.
PROBE_CONVERSATIONS: tuple[list[dict[str, str]], ...] = (
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
    ],
)


class ChatTemplateError(ModelError):
    """The chat template is invalid, unsafe, too costly, or refused the messages.

    ``refused`` is True when the template itself refused these messages
    (``raise_exception``): the messages are at fault, not the template."""

    refused: bool = False


def _refusal(message: str) -> ChatTemplateError:
    err = ChatTemplateError(f"the chat template refused the messages: {message}")
    err.refused = True
    return err


@dataclass(frozen=True)
class RenderLimits:
    """What one render may cost: wall time, characters of output (and of any string the
    template builds), and, in a worker process, memory."""

    timeout_s: float = sandbox.TIMEOUT_S
    max_chars: int = sandbox.MAX_CHARS
    memory_bytes: int = 1 << 30
    workers: int = 2


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


def _error(kind: str, message: str) -> ChatTemplateError:
    """The one-line error for a render result of ``kind`` (see ``render_request``)."""
    if kind == "refused":
        return _refusal(message)
    if kind == "unsafe":
        return ChatTemplateError(
            f"the model's chat template tried an unsafe operation and was stopped: {message}"
        )
    if kind == "limit":
        return ChatTemplateError(f"the model's chat template was stopped: {message}")
    if kind == "syntax":
        return ChatTemplateError(f"the model's chat template is {message}")
    return ChatTemplateError(f"the model's chat template failed: {message}")


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into a prompt string."""

    def __init__(
        self,
        source: str,
        bos_token: str = "",
        eos_token: str = "",
        is_fallback: bool = False,
        limits: RenderLimits | None = None,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        self.limits = limits or RenderLimits()
        #: Why this template cannot render anything (it did not compile); None when usable.
        self.error: ChatTemplateError | None = None
        env = sandbox.make_environment(self.limits.max_chars)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the model's chat template is invalid (line {e.lineno}): {e.message}"
            ) from e
        except (sandbox.RenderLimitError, SecurityError) as e:  # constants folded at compile
            raise ChatTemplateError(f"the model's chat template was stopped: {e}") from e
        except Exception as e:  # noqa: BLE001 - untrusted code: any failure is its error
            raise ChatTemplateError(
                f"the model's chat template cannot be compiled: {type(e).__name__}: {e}"
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
            ok = isinstance(i, int) and isinstance(tokens, ARRAY_TYPES) and 0 <= i < len(tokens)
            return tokens[i] if ok and isinstance(tokens[i], str) else ""

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        source = metadata.get("tokenizer.chat_template")
        if source is None:
            log.warning("the model has no chat template (tokenizer.chat_template); using ChatML")
            return cls(CHATML_TEMPLATE, bos, eos, is_fallback=True)
        if not isinstance(source, str):
            return cls._unusable(
                ChatTemplateError("metadata 'tokenizer.chat_template' must be a string"), bos, eos
            )
        try:
            return cls(source, bos, eos)
        except ChatTemplateError as e:
            # The model still completes plain prompts; only a chat needs the template.
            return cls._unusable(e, bos, eos, source)

    @classmethod
    def _unusable(
        cls, error: ChatTemplateError, bos: str, eos: str, source: str = ""
    ) -> ChatTemplate:
        log.warning("%s; chat requests will fail", error)
        template = cls("", bos, eos)
        template.source = source
        template.error = error
        return template

    def context(
        self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """What the template sees (messages checked by :func:`validate_messages`)."""
        return {
            **kwargs,
            "messages": validate_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``; extra ``kwargs`` reach the template."""
        context = self.context(messages, add_generation_prompt, **kwargs)
        if self.error is not None:
            raise ChatTemplateError(str(self.error))
        lim = self.limits
        try:
            return sandbox.render_limited(self._template, context, lim.timeout_s, lim.max_chars)
        except sandbox.TemplateRaised as e:
            raise _refusal(str(e)) from None
        except SecurityError as e:
            raise _error("unsafe", str(e)) from None
        except sandbox.RenderLimitError as e:
            raise _error("limit", str(e)) from None
        except MemoryError:
            raise _error("limit", "the render ran out of memory") from None
        except RecursionError:
            raise _error("failed", "the render recursed too deeply") from None
        except jinja2.TemplateError as e:
            raise _error("failed", f"{type(e).__name__}: {e}") from None
        except Exception as e:  # noqa: BLE001 - untrusted code: any failure is its error
            raise _error("failed", f"{type(e).__name__}: {e}") from None

    def __repr__(self) -> str:
        kind = "ChatML fallback" if self.is_fallback else f"{len(self.source)} chars"
        return f"ChatTemplate({kind})"


# --------------------------------------------------------------------------- worker processes

_BOOTSTRAP = (
    "import importlib.util as u, sys\n"
    "spec = u.spec_from_file_location('vt_template_sandbox', sys.argv[1])\n"
    "m = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
    "m.worker_main(int(sys.argv[2]))\n"
)


class _WorkerGone(Exception):
    pass


class _Worker:
    """One render process: ``template_sandbox.worker_main`` over a pipe."""

    def __init__(self, memory_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(Path(sandbox.__file__)), str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin.fileno()
        self._out = self.proc.stdout.fileno()
        self.ready = False

    def _read(self, n: int, deadline: float) -> bytes:
        data = b""
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            readable, _, _ = select.select([self._out], [], [], left)
            if not readable:
                raise TimeoutError
            chunk = os.read(self._out, n - len(data))
            if not chunk:
                raise _WorkerGone
            data += chunk
        return data

    def receive(self, deadline: float) -> Any:
        size = struct.unpack("<I", self._read(4, deadline))[0]
        return json.loads(self._read(size, deadline))

    def call(self, request: Mapping[str, Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        if not self.ready:  # the first call waits for the interpreter to start
            self.receive(deadline + 30.0)
            self.ready = True
        try:
            sandbox.write_message(self._in, request)
        except OSError:
            raise _WorkerGone from None
        return self.receive(deadline)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class TemplateRenderer:
    """Renders one :class:`ChatTemplate` in up to ``limits.workers`` worker processes.

    A render past ``limits.timeout_s`` is stopped by killing its worker (a fresh one
    starts for the next render); a worker's memory is capped at ``limits.memory_bytes``
    (``RLIMIT_AS``). The template is checked at start with :data:`PROBE_CONVERSATIONS`:
    if it fails on them (other than refusing them), every render raises that one-line
    error (``probe_error``) without running it again. Thread-safe; blocking (call it off
    the event loop). Where worker processes are not available (not POSIX) it renders in
    this process, with the sandbox's own limits.
    """

    def __init__(self, template: ChatTemplate, limits: RenderLimits | None = None) -> None:
        self.template = template
        self.limits = limits or template.limits
        self.in_process = os.name != "posix"
        self._idle: list[_Worker] = []
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()
        self.probe_error: str | None = None
        self.probe_s = 0.0
        t0 = time.monotonic()
        for conversation in PROBE_CONVERSATIONS:
            try:
                self._render(conversation, True)
            except ChatTemplateError as e:
                if not e.refused:
                    self.probe_error = str(e)
                    log.warning("the chat template failed its check at load: %s", e)
                    break
        self.probe_s = time.monotonic() - t0

    def render(self, messages: Any, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``; :class:`ChatTemplateError` on any failure."""
        if self.probe_error is not None:
            raise ChatTemplateError(f"{self.probe_error} (when the server checked it at load)")
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: Any, add_generation_prompt: bool) -> str:
        t = self.template
        if self.in_process or t.error is not None:
            return t.render(messages, add_generation_prompt)
        lim = self.limits
        request = {
            "source": t.source,
            "context": t.context(messages, add_generation_prompt),
            "timeout_s": lim.timeout_s,
            "max_chars": lim.max_chars,
        }
        worker = self._acquire()
        try:
            # The worker stops the render itself at timeout_s; the kill is the backstop
            # for what the sandbox cannot interrupt.
            result = worker.call(request, lim.timeout_s + 1.0)
        except TimeoutError:
            self._discard(worker)
            raise _error(
                "limit", f"the render took longer than {lim.timeout_s:g} s and was stopped"
            ) from None
        except (_WorkerGone, OSError, ValueError):
            code = worker.proc.poll()
            self._discard(worker)
            raise _error(
                "limit", f"the render process died (exit status {code}; out of memory?)"
            ) from None
        self._release(worker)
        if "text" in result:
            return str(result["text"])
        raise _error(str(result.get("kind")), str(result.get("error")))

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise ChatTemplateError("the chat template renderer is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.limits.workers:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.limits.memory_bytes)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _release(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify()

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
