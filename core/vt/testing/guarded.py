"""Device buffers with guard regions, and comparison against the reference.

Every tensor an op case hands to the backend is a view into a larger allocation: a
canary of :data:`GUARD` bytes before and after it, outputs poisoned with NaN bytes. After
the op, the whole allocation is copied back (``copy_d2h`` works on every backend) and
the canaries, the untouched inputs and the outputs are checked, so an out-of-bounds write,
a write into an input or an unwritten output element fails with its location.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..protocol.backend import Buffer, Tensor
from .kit import KitContext, KitFailure
from .tolerances import kernel_tolerance, nmse

GUARD = 4096
POISON = 0xFF  # float32 NaN, int32 -1
_CANARY = np.random.default_rng(0xC0FFEE).integers(0, 256, 2 * GUARD, dtype=np.uint8)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


@dataclass(eq=False)
class _Guarded:
    name: str
    raw: Buffer
    buf: Buffer
    written: np.ndarray  # the payload as written
    role: str  # "input", "output", "inout" or "scratch"


class CaseBuffers:
    """The guarded buffers of one op case; use as a context manager."""

    def __init__(self, ctx: KitContext, title: str) -> None:
        self.ctx, self.title = ctx, title
        self._items: dict[str, _Guarded] = {}
        self._payloads: dict[str, np.ndarray] | None = None

    def __enter__(self) -> CaseBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        b = self.ctx.backend
        try:
            b.synchronize(self.ctx.stream)
        except Exception:
            if exc[0] is None:
                raise
        finally:
            for item in self._items.values():
                b.free(item.raw)

    def _add(self, name: str, payload: np.ndarray, role: str) -> Buffer:
        b, n = self.ctx.backend, payload.nbytes
        raw = b.alloc(n + 2 * GUARD)
        # Registered before anything else can fail, so __exit__ frees it.
        item = _Guarded(name, raw, raw.view(GUARD, n), payload, role)
        self._items[name] = item
        b.copy_h2d(raw, np.concatenate([_CANARY[:GUARD], payload, _CANARY[GUARD:]]))
        return item.buf

    def input(self, name: str, array: np.ndarray) -> Tensor:
        """A tensor holding ``array`` (its dtype and shape); the op must not change it."""
        buf = self._add(name, _as_bytes(array).copy(), "input")
        return Tensor(buf, array.dtype, tuple(array.shape))

    def inout(self, name: str, array: np.ndarray) -> Tensor:
        """A tensor holding ``array`` that the op updates in place."""
        buf = self._add(name, _as_bytes(array).copy(), "inout")
        return Tensor(buf, array.dtype, tuple(array.shape))

    def output(self, name: str, dtype: np.dtype | type, shape: tuple[int, ...]) -> Tensor:
        """A tensor of poisoned bytes (NaN as float32, -1 as int32) for the op to fill."""
        dt, shape = np.dtype(dtype), tuple(int(d) for d in shape)
        nbytes = dt.itemsize * math.prod(shape)
        return Tensor(self._add(name, np.full(nbytes, POISON, dtype=np.uint8), "output"), dt, shape)

    def scratch(self, name: str, dtype: np.dtype | type, shape: tuple[int, ...]) -> Tensor:
        """A poisoned tensor the op may use as it likes (a fused op's scratch): its
        contents are not checked, its guard regions are."""
        t = self.output(name, dtype, shape)
        self._items[name].role = "scratch"
        return t

    def _collect(self) -> dict[str, np.ndarray]:
        """Synchronize, copy every allocation back and check canaries and inputs."""
        if self._payloads is not None:
            return self._payloads
        b = self.ctx.backend
        b.synchronize(self.ctx.stream)
        payloads = {}
        for item in self._items.values():
            n = item.written.nbytes
            whole = np.empty(n + 2 * GUARD, dtype=np.uint8)
            b.copy_d2h(whole, item.raw)
            for side, got, want in (
                ("before the start", whole[:GUARD], _CANARY[:GUARD]),
                ("past the end", whole[GUARD + n :], _CANARY[GUARD:]),
            ):
                bad = np.flatnonzero(got != want)
                if bad.size:
                    # 1 = the byte right next to the buffer
                    dist = GUARD - int(bad[-1]) if side.startswith("before") else int(bad[0]) + 1
                    raise KitFailure(
                        f"{self.title}: wrote {bad.size} byte(s) {side} of {item.role} "
                        f"{item.name!r} (the nearest is byte {dist} {side.split()[0]} it): an "
                        "out-of-bounds write"
                    )
            payload = whole[GUARD : GUARD + n]
            if item.role == "input" and not np.array_equal(payload, item.written):
                first = int(np.flatnonzero(payload != item.written)[0])
                raise KitFailure(
                    f"{self.title}: modified its input {item.name!r} (first changed byte {first})"
                )
            payloads[item.name] = payload
        self.ctx.count(len(self._items))  # one guard check per buffer
        self._payloads = payloads
        return payloads

    def result(self, name: str, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        """The payload of buffer ``name`` after the op, as ``dtype[shape]``."""
        return self._collect()[name].view(dtype).reshape(shape)


def _at(index: int, shape: tuple[int, ...]) -> str:
    return str(tuple(int(i) for i in np.unravel_index(index, shape))) if shape else "()"


def compare(
    ctx: KitContext,
    title: str,
    op: str,
    dtype: str,
    got: np.ndarray,
    want: np.ndarray,
    what: str = "",
) -> str:
    """Check ``got`` against the reference ``want`` within ``op``'s tolerance for ``dtype``;
    ``what`` names the output when an op has several."""
    if what:
        title = f"{title}: {what}"
    if got.shape != want.shape:
        raise KitFailure(f"{title}: result shape {got.shape} != reference {want.shape}")
    tol = kernel_tolerance(op, dtype)
    if np.issubdtype(want.dtype, np.floating):
        broken = ~np.isfinite(got) & np.isfinite(want)
        if broken.any():
            first = int(np.flatnonzero(broken)[0])
            raise KitFailure(
                f"{title}: {int(broken.sum())} of {got.size} output values are NaN or inf "
                f"(unwritten memory holds NaN), first at {_at(first, got.shape)}"
            )
    ctx.count(got.size)
    if tol == 0.0:
        diff = got != want
        if np.issubdtype(want.dtype, np.floating):
            diff &= ~(np.isnan(got) & np.isnan(want))
        if diff.any():
            first = int(np.flatnonzero(diff)[0])
            raise KitFailure(
                f"{title}: {int(diff.sum())} of {got.size} values differ from the reference "
                f"(must be exact); first at {_at(first, got.shape)}: got "
                f"{got.reshape(-1)[first]!r}, want {want.reshape(-1)[first]!r}"
            )
        return f"bit-exact ({got.size} values)"
    err = nmse(got, want)
    if not err <= tol:
        worst = int(np.argmax(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        raise KitFailure(
            f"{title}: normalized MSE {err:.3g} exceeds the {dtype} tolerance {tol:g}; "
            f"worst at {_at(worst, got.shape)}: got {float(got.reshape(-1)[worst]):.6g}, "
            f"want {float(want.reshape(-1)[worst]):.6g}"
        )
    return f"nmse {err:.2g} <= {tol:g} ({got.size} values)"
