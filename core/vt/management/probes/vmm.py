"""The VMM probe: the arena smoke, run on every backend that declares ``vmm``.

Each check uses its own small arena (:class:`vt.execution.memory.VmmArena`), so one failure does not
hide the others. The aliasing check is the one that would have caught the Windows ROCm bug:
two segments, distinct patterns, and the whole prefix read back through an explicit copy.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from ...errors import VmmError
from ...execution.memory.arena import VmmArena, arena_tensor, vmm_granularity
from ...protocol.backend import Backend
from .base import (
    Check,
    ProbeFailed,
    check,
    first_diff,
    first_index,
    pattern,
    run_checks,
    run_probe,
)

SMOKE_IDS: tuple[str, ...] = (
    "vmm-granularity",
    "vmm-segments-distinct",
    "vmm-over-reserve",
    "vmm-non-multiple",
    "vmm-release-reserve",
    "vmm-tensor-4097",
)

_FIX = (
    "declare `segments_may_alias=True` in the backend's VmmCaps, which selects the full-map "
    "policy (the whole reservation mapped in one segment, never grown)"
)


def _halves(n: int, which: int) -> np.ndarray:
    """Pattern A (``which`` 0) or B: A[i] + B[i] == 255 (odd), so they differ at every byte."""
    base = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
    return base if which == 0 else (255 - base).astype(np.uint8)


def _write(arena: VmmArena, offset: int, data: np.ndarray) -> None:
    arena.backend.copy_h2d(arena.buffer.view(offset, data.nbytes), data)


def _read(arena: VmmArena, offset: int, nbytes: int) -> np.ndarray:
    out = np.empty(nbytes, np.uint8)
    arena.backend.copy_d2h(out, arena.buffer.view(offset, nbytes))
    return out


def _expect_intact(arena: VmmArena, want: np.ndarray, after: str) -> None:
    got = _read(arena, 0, want.nbytes)
    if not np.array_equal(got, want):
        raise ProbeFailed(f"data changed after {after}: {first_diff(got, want)}")


def _segments_distinct(backend: Backend, g: int) -> str:
    with VmmArena.reserve(backend, 2 * g) as arena:
        a, b = _halves(g, 0), _halves(g, 1)
        if arena.full_map:
            if arena.segments != 1 or arena.mapped_bytes != arena.reserved_bytes:
                raise ProbeFailed(
                    "segments_may_alias is declared but the arena did not map its full "
                    f"reservation in one segment: {arena!r}"
                )
            _write(arena, 0, a)
            _write(arena, g, b)
            _expect_intact(arena, np.concatenate([a, b]), "writing both halves of the mapping")
            return "full-map policy (segments_may_alias): one segment covers the reservation"
        arena.map_next(g)
        _write(arena, 0, a)
        arena.map_next(g)
        _write(arena, g, b)
        got = _read(arena, 0, 2 * g)
        if np.array_equal(got[:g], b):
            raise ProbeFailed(
                f"segment 2 aliases segment 1: writing pattern B at offset {g} overwrote "
                f"pattern A at offset 0; {_FIX}"
            )
        if not np.array_equal(got, np.concatenate([a, b])):
            raise ProbeFailed(
                f"prefix read back is not A then B ({first_diff(got, np.concatenate([a, b]))}); "
                f"the segments may alias; {_FIX}"
            )
        return f"two segments of {g} bytes hold A then B"


def _rejected_map(backend: Backend, g: int, past_reserve: bool) -> str:
    """A map the arena must refuse (past the reservation, or not a multiple of the
    granularity) fails with its message, changes nothing, and leaves the data intact."""
    with VmmArena.reserve(backend, 2 * g) as arena:
        arena.ensure(g)
        a = _halves(g, 0)
        _write(arena, 0, a)
        if past_reserve:
            nbytes, fragment = arena.reserved_bytes - arena.mapped_bytes + g, "would exceed reserve"
        else:
            nbytes, fragment = g + 1, "must be a non-zero multiple of granularity"
        before = (arena.mapped_bytes, arena.segments)
        try:
            arena.map_next(nbytes)
        except VmmError as exc:
            message = str(exc)
        else:
            raise ProbeFailed(
                f"map_next({nbytes}) succeeded; expected an error containing {fragment!r}"
            )
        if fragment not in message:
            raise ProbeFailed(f"map_next({nbytes}) raised {message!r}; expected {fragment!r} in it")
        if (arena.mapped_bytes, arena.segments) != before:
            raise ProbeFailed(f"map_next({nbytes}) failed but changed the arena to {arena!r}")
        _expect_intact(arena, a, "the rejected map")
        where = " past the reservation" if past_reserve else ""
        return f"map_next({nbytes}){where} failed; data intact"


def _release_reserve(backend: Backend, g: int) -> str:
    arena = VmmArena.reserve(backend, g)
    arena.ensure(g)
    _write(arena, 0, _halves(g, 0))
    arena.release()
    arena.release()
    with VmmArena.reserve(backend, g) as fresh:
        fresh.ensure(g)
        b = _halves(g, 1)
        _write(fresh, 0, b)
        _expect_intact(fresh, b, "a write to a fresh reservation")
    return "release (twice) then a fresh reserve round-trips"


def _tensor_4097(backend: Backend, g: int) -> str:
    tensor = arena_tensor(backend, 4097)
    try:
        if tensor.nbytes != 4097:
            raise ProbeFailed(f"the tensor exposes {tensor.nbytes} bytes, expected 4097")
        want = -(-4097 // g) * g
        if tensor.arena.mapped_bytes != want or tensor.arena.segments != 1:
            raise ProbeFailed(
                f"expected one segment of {want} bytes, got {tensor.arena.segments} "
                f"segment(s) of {tensor.arena.mapped_bytes} bytes"
            )
        data = pattern(4097, 4097)
        backend.copy_h2d(tensor.buffer, data)
        got = np.empty(4097, np.uint8)
        backend.copy_d2h(got, tensor.buffer)
        if not np.array_equal(got, data):
            raise ProbeFailed(f"read back differs at byte {first_index(got != data)}")
    finally:
        tensor.release()
    return f"4097 bytes round-trip in one {want}-byte segment"


_STEPS: tuple[tuple[str, Callable[[Backend, int], str]], ...] = (
    ("vmm-segments-distinct", _segments_distinct),
    ("vmm-over-reserve", partial(_rejected_map, past_reserve=True)),
    ("vmm-non-multiple", partial(_rejected_map, past_reserve=False)),
    ("vmm-release-reserve", _release_reserve),
    ("vmm-tensor-4097", _tensor_4097),
)


def arena_smoke(backend: Backend) -> list[Check]:
    """Prove the backend's VMM path on small arenas; one
    :class:`vt.management.probes.Check` per step."""
    if backend.capabilities.vmm is None:
        why = f"backend {backend.name!r} does not declare vmm"
        return [check(i, "skip", why) for i in SMOKE_IDS]
    try:
        g = vmm_granularity(backend)
    except Exception as exc:
        return [check("vmm-granularity", "fail", f"{type(exc).__name__}: {exc}")] + [
            check(i, "skip", "skipped: no usable granularity") for i in SMOKE_IDS[1:]
        ]
    policy = "full-map" if backend.capabilities.vmm.segments_may_alias else "grow"
    checks = [check("vmm-granularity", "pass", f"granularity {g} bytes, {policy} policy")]
    return checks + [run_probe(i, partial(step, backend, g)) for i, step in _STEPS]


def probe_vmm(backend: Backend) -> list[Check]:
    """The arena smoke when vmm is declared."""
    if backend.capabilities.vmm is None:
        return [check("vmm", "skip", "vmm not declared")]
    return run_checks("vmm", partial(arena_smoke, backend))
