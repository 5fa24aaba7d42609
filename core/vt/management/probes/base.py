"""What every probe shares: the :class:`Check` it reports, how a probe body becomes one,
and the helpers the probes and the conformance kit's contracts exercise a backend with.

The kit (:mod:`vt.testing.contracts_suite`) builds its stricter contracts from these
helpers; neither keeps its own copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Literal, TypeVar

import numpy as np
from pydantic import BaseModel

from ...protocol.backend import Backend, Buffer, Event, HostBuffer, Stream

Kind = Literal["rule", "probe"]
Result = Literal["pass", "fail", "skip"]

T = TypeVar("T")


class Check(BaseModel):
    """One audit result."""

    id: str
    kind: Kind
    result: Result
    detail: str = ""


class ProbeFailed(Exception):
    """A probe saw the backend break its declaration; the message is the check's detail."""


def check(check_id: str, result: Result, detail: str, kind: Kind = "probe") -> Check:
    return Check(id=check_id, kind=kind, result=result, detail=detail)


def _failure(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ProbeFailed) else f"{type(exc).__name__}: {exc}"


def run_probe(check_id: str, body: Callable[[], str]) -> Check:
    """Run ``body``; its return value is the pass detail, any exception a failure."""
    try:
        return check(check_id, "pass", body())
    except Exception as exc:
        return check(check_id, "fail", _failure(exc))


def run_checks(check_id: str, probe: Callable[[], list[Check]]) -> list[Check]:
    """Run a probe that reports several checks; if it raises, one failed check ``check_id``."""
    try:
        return list(probe())
    except Exception as exc:
        return [check(check_id, "fail", _failure(exc))]


# --------------------------------------------------------------------------- helpers

#: Work queued ahead of what a probe watches (memsets of :data:`WORK_BYTES`, tried with
#: more and more rounds), so that a host check lands while the watched work is still
#: pending, even when the host thread is preempted for a few milliseconds on a busy machine.
WORK_BYTES = 32 << 20
WORK_ROUNDS = (8, 32, 128)
#: What a host buffer holds before a copy into it.
POISON = 0xCD


@contextmanager
def _held(obj: T, *release: Callable[[T], object]) -> Iterator[T]:
    try:
        yield obj
    finally:
        for step in release:
            step(obj)


def device_buffer(backend: Backend, nbytes: int) -> AbstractContextManager[Buffer]:
    """Device memory, freed on exit."""
    return _held(backend.alloc(nbytes), backend.free)


def pinned_buffer(backend: Backend, nbytes: int) -> AbstractContextManager[HostBuffer]:
    """Pinned host memory, freed on exit."""
    return _held(backend.alloc_pinned(nbytes), backend.free_pinned)


def new_stream(backend: Backend, name: str) -> AbstractContextManager[Stream]:
    """A stream, synchronized and destroyed on exit."""
    return _held(backend.create_stream(name), backend.synchronize, backend.destroy_stream)


def new_event(backend: Backend) -> AbstractContextManager[Event]:
    """An event, destroyed on exit."""
    return _held(backend.create_event(), backend.destroy_event)


def busy(backend: Backend, work: Buffer, stream: Stream, rounds: int) -> None:
    """Keep ``stream`` busy: ``rounds`` memsets of ``work``."""
    for i in range(rounds):
        backend.memset(work, i & 0xFF, stream)


def read(backend: Backend, buf: Buffer, *, as_runner: bool = False) -> np.ndarray:
    """A copy of ``buf``'s bytes through ``copy_d2h``; ``as_runner``: as the runner reads
    them, through ``host_view`` where device memory is host-addressable."""
    if as_runner and backend.capabilities.device_memory_is_host_addressable:
        return np.array(backend.host_view(buf), dtype=np.uint8, copy=True)
    out = np.empty(buf.nbytes, dtype=np.uint8)
    backend.copy_d2h(out, buf)
    return out


def pattern(nbytes: int, seed: int, *, below: int = 256) -> np.ndarray:
    """Random bytes from ``seed``, each below ``below`` (``POISON``: none looks poisoned)."""
    return np.random.default_rng(seed).integers(0, below, nbytes, dtype=np.uint8)


def first_index(mask: np.ndarray) -> int:
    """The index of the first true element of ``mask`` (which has one)."""
    return int(np.flatnonzero(mask)[0])


def first_diff(got: np.ndarray, want: np.ndarray) -> str:
    idx = np.flatnonzero(got != want)
    return "no difference" if idx.size == 0 else f"first wrong byte at {int(idx[0])}"
