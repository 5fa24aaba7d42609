"""Chat templates rendered under limits: jinja2's immutable sandbox, plus time and size.

A GGUF's chat template is untrusted code. ``ImmutableSandboxedEnvironment`` stops unsafe
attribute access and mutation; :class:`LimitedSandbox` adds what it lacks:

- time: while a template renders, a trace function on the template's own frames raises
  :class:`RenderLimitError` once ``timeout_s`` has passed (nested ``range`` loops);
- depth: the same function raises ``RecursionError`` past :data:`MAX_NESTING` nested
  template calls (a macro calling itself), while the stack still has room for whatever
  else runs meanwhile (a garbage collection's finalizers), not at Python's own limit;
- size: ``*``, ``+``, ``%`` and ``**``, every call (``'a'.center(10**9)``) and every filter
  are checked against ``max_chars``, before they run where the size can be foreseen
  (``'A' * 10**8``) and on their result otherwise; the output is counted as it is
  generated; ``lipsum`` is gone.

That is as far as one process can go: a string that doubles itself with ``~`` in a loop
still allocates before anything can look at it. So ``vt serve`` renders in worker
processes (:func:`worker_main`, driven by :class:`vt.model.chat.TemplateRenderer`) whose
memory is capped (``RLIMIT_AS``) and which are killed when a render overruns its time.

This module imports only the standard library and jinja2: a worker runs it by path, without
importing vt.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: Default limits of one render.
TIMEOUT_S = 5.0
MAX_CHARS = 1_000_000  # output, and any string or list the template builds
MAX_EXPONENT = 4096
#: Template frames (the template's body, its macros and call blocks) that may be active at
#: once: each costs a few interpreter frames, so 100 stays far below Python's recursion
#: limit (1000 by default); real chat templates nest a handful.
MAX_NESTING = 100
#: Filters whose integer arguments size their result (width, length, count).
_SIZING_FILTERS = frozenset({"center", "indent", "truncate", "wordwrap", "batch", "slice"})
_NUMBERS = re.compile(r"\d+")


class RenderLimitError(Exception):
    """A render ran past a limit (time, size); the message says which."""


class TemplateRaised(Exception):
    """``raise_exception()`` called by the template itself: it refused the messages."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's chat templates expect tojson without HTML escaping and with unicode kept.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with size checks; an unsafe attribute is an error."""

    intercepted_binops = frozenset({"*", "+", "%", "**", "//"})

    def __init__(self, max_chars: int = MAX_CHARS, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_chars = max_chars
        self.globals.pop("lipsum", None)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._checked_filter(name, fn)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def _too_big(self, what: str, size: int) -> RenderLimitError:
        return RenderLimitError(
            f"{what} would make a value of {size} items, past the limit of {self.max_chars}"
        )

    def _check_result(self, what: str, value: Any) -> Any:
        size = _size(value)
        if size > self.max_chars:
            raise self._too_big(what, size)
        return value

    def _check_ints(self, what: str, args: Any) -> None:
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise RenderLimitError(f"{what} got {a}, past the limit of {self.max_chars}")

    def _check_format(self, what: str, fmt: str) -> None:
        """A width or precision in a format string past the limit (``'%0999999999d'``)."""
        for number in _NUMBERS.findall(fmt):
            if len(number) > 6 and int(number) > self.max_chars:
                raise RenderLimitError(f"{what} asks for width {number}, past the limit")

    def _checked_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sizing = name in _SIZING_FILTERS

        @wraps(fn)  # keeps jinja's pass_context / pass_environment markers
        def checked(*args: Any, **kwargs: Any) -> Any:
            if sizing:
                self._check_ints(f"filter {name!r}", list(args[1:]) + list(kwargs.values()))
            elif name == "format" and args and isinstance(args[0], str):
                self._check_format("filter 'format'", args[0])
            return self._check_result(f"filter {name!r}", fn(*args, **kwargs))

        return checked

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > self.max_chars:
                    raise self._too_big("'*'", _size(seq) * n)
        elif op == "+" and _size(left) and _size(left) + _size(right) > self.max_chars:
            raise self._too_big("'+'", _size(left) + _size(right))
        elif op == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            if isinstance(left, int) and left not in (0, 1, -1):
                raise RenderLimitError(f"'**' with exponent {right} (at most {MAX_EXPONENT})")
        elif op == "%" and isinstance(left, str):
            self._check_format("'%'", left)
        return self._check_result(f"'{op}'", self.binop_table[op](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, list, tuple)):  # 'a'.center(10**9)
            what = f"'{getattr(__obj, '__name__', 'method')}'"
            __self._check_ints(what, list(args) + list(kwargs.values()))
        result = super().call(__context, __obj, *args, **kwargs)
        return __self._check_result("a call", result)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        self._check_format("'format'", value.__self__)  # '{:>999999999}'.format(1)
        return wrapped


def make_environment(max_chars: int = MAX_CHARS) -> LimitedSandbox:
    return LimitedSandbox(
        max_chars=max_chars, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False
    )


def render_limited(
    template: jinja2.Template,
    context: Mapping[str, Any],
    timeout_s: float = TIMEOUT_S,
    max_chars: int = MAX_CHARS,
) -> str:
    """Render ``template`` with ``context``, raising :class:`RenderLimitError` past
    ``timeout_s`` seconds or ``max_chars`` characters of output, and ``RecursionError``
    past :data:`MAX_NESTING` nested template calls."""
    deadline = time.monotonic() + timeout_s
    ticks = [0]
    depth = [0]  # template frames entered and not yet left (a generator's: per resumption)

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":  # also when the frame is left by an exception
            depth[0] -= 1
        ticks[0] += 1
        if not ticks[0] & 255 and time.monotonic() > deadline:
            raise RenderLimitError(f"the render took longer than {timeout_s:g} s and was stopped")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        # Only the template's own code: its loops are where a render can spin.
        if not frame.f_code.co_filename.startswith("<template"):
            return None
        if depth[0] >= MAX_NESTING:  # this frame gets no "return" event: not counted
            raise RecursionError(f"more than {MAX_NESTING} nested template calls")
        depth[0] += 1
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        parts: list[str] = []
        size = 0
        for part in template.generate(**context):
            size += len(part)
            if size > max_chars:
                raise RenderLimitError(f"the output passed {max_chars} characters")
            parts.append(part)
        return "".join(parts)
    finally:
        sys.settrace(previous)


# --------------------------------------------------------------------------- the worker


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_message(fd: int) -> Any:
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack("<I", head)[0])
    return None if body is None else json.loads(body)


def write_message(fd: int, value: Any) -> None:
    body = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    data = struct.pack("<I", len(body)) + body
    while data:
        data = data[os.write(fd, data) :]


def render_request(request: Mapping[str, Any], cache: dict[str, jinja2.Template]) -> Any:
    """One render for a worker: ``{"text"}``, or ``{"error", "kind"}`` where kind is
    ``refused`` (the template's raise_exception), ``limit``, ``unsafe`` or ``failed``."""
    max_chars = int(request.get("max_chars", MAX_CHARS))
    source = request["source"]
    key = f"{max_chars}:{source}"
    try:
        template = cache.get(key)
        if template is None:
            if len(cache) >= 8:
                cache.pop(next(iter(cache)))
            template = make_environment(max_chars).from_string(source)
            cache[key] = template
        context = dict(request.get("context", {}))
        text = render_limited(
            template, context, float(request.get("timeout_s", TIMEOUT_S)), max_chars
        )
        return {"text": text}
    except TemplateRaised as e:
        return {"error": str(e), "kind": "refused"}
    except RenderLimitError as e:
        return {"error": str(e), "kind": "limit"}
    except SecurityError as e:
        return {"error": str(e), "kind": "unsafe"}
    except MemoryError:
        return {"error": "the render ran out of memory", "kind": "limit"}
    except RecursionError:
        return {"error": "the render recursed too deeply", "kind": "failed"}
    except jinja2.TemplateSyntaxError as e:
        return {"error": f"invalid (line {e.lineno}): {e.message}", "kind": "syntax"}
    except Exception as e:  # noqa: BLE001 - any failure of untrusted code is its error
        return {"error": f"{type(e).__name__}: {e}", "kind": "failed"}


def worker_main(memory_bytes: int | None = None) -> None:
    """Serve renders on stdin/stdout (4-byte length, then JSON) until stdin closes."""
    if memory_bytes:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ImportError, ValueError, OSError):
            pass
    fd_in, fd_out = sys.stdin.fileno(), sys.stdout.fileno()
    sys.stdout = sys.stderr  # nothing else may write to the channel
    cache: dict[str, jinja2.Template] = {}
    write_message(fd_out, {"ready": True})
    while (request := read_message(fd_in)) is not None:
        write_message(fd_out, render_request(request, cache))


if __name__ == "__main__":
    worker_main(int(sys.argv[1]) if len(sys.argv) > 1 else None)
