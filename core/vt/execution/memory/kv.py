"""The KV cache: one position-major buffer for all layers and slots (see :class:`vt.KVLayout`).

Two kinds:

- ``contiguous``: one ``backend.alloc`` of ``layout.nbytes``, zeroed at creation, so the
  whole ``max_len`` is committed up front.
- ``vmm``: a :class:`~vt.execution.memory.arena.VmmArena` reserves ``layout.nbytes`` and maps
  physical memory as sequences lengthen. Positions are the layout's outermost dimension,
  so growing the cache is mapping more of the reservation's prefix.

The runner calls :meth:`KVCache.ensure_positions` on the host *before* enqueueing a step
(never inside one): kernels must not allocate, and mapping memory under a running kernel is
undefined on most runtimes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from ...errors import VtError
from ...protocol.backend import Backend, Buffer, KVLayout, Stream

if TYPE_CHECKING:
    from .arena import VmmArena

KVKind = Literal["contiguous", "vmm"]
KV_KINDS: tuple[str, ...] = ("contiguous", "vmm", "auto")
DEFAULT_GROW_TOKENS = 64
DEFAULT_MIN_GROWTH_BYTES = 2 << 20


class KVCapacityError(VtError):
    """More positions were asked of a KV cache than its ``max_len`` holds."""


class KVCacheStats(BaseModel):
    """What a KV cache reserves and commits; ``vt run --json`` reports it as ``kv_cache``.

    ``backend`` is the KV cache kind (``contiguous`` or ``vmm``), not the hardware backend.
    A contiguous cache counts as one segment with everything mapped.
    """

    model_config = ConfigDict(frozen=True)

    backend: KVKind
    reserved_bytes: int
    mapped_bytes: int
    segments: int


def resolve_kind(backend: Backend, kind: str) -> KVKind:
    """``auto`` becomes ``vmm`` where the backend's effective capabilities declare it."""
    if kind not in KV_KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; expected one of {', '.join(KV_KINDS)}")
    if kind == "auto":
        return "vmm" if backend.capabilities.vmm is not None else "contiguous"
    return kind  # type: ignore[return-value]


def _check_layout(layout: KVLayout) -> None:
    for name in ("n_layers", "n_slots", "max_len", "n_kv_heads", "head_dim"):
        value = getattr(layout, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"KV layout {name} must be a positive integer, got {value!r}")


class KVCache:
    """A KV cache buffer plus the policy that commits its memory. Build with :meth:`create`."""

    def __init__(
        self,
        backend: Backend,
        layout: KVLayout,
        kind: KVKind,
        buffer: Buffer,
        arena: VmmArena | None = None,
        grow_tokens: int = DEFAULT_GROW_TOKENS,
    ) -> None:
        self._backend = backend
        self._layout = layout
        self._kind: KVKind = kind
        self._buffer: Buffer | None = buffer
        self._arena = arena
        self._grow_tokens = grow_tokens

    @classmethod
    def create(
        cls,
        backend: Backend,
        layout: KVLayout,
        kind: str = "auto",
        grow_tokens: int = DEFAULT_GROW_TOKENS,
        min_growth_bytes: int = DEFAULT_MIN_GROWTH_BYTES,
    ) -> KVCache:
        """Allocate a KV cache of ``kind`` (``contiguous`` | ``vmm`` | ``auto``).

        ``auto`` picks ``vmm`` where the backend declares it, else ``contiguous``. A ``vmm``
        cache maps its first chunk (``grow_tokens`` positions, at least ``min_growth_bytes``)
        at once; :meth:`ensure_positions` maps more.
        """
        resolved = resolve_kind(backend, kind)
        _check_layout(layout)
        if not isinstance(grow_tokens, int) or grow_tokens <= 0:
            raise ValueError(f"grow_tokens must be a positive integer, got {grow_tokens!r}")
        if not isinstance(min_growth_bytes, int) or min_growth_bytes < 0:
            raise ValueError(
                f"min_growth_bytes must be a non-negative integer, got {min_growth_bytes!r}"
            )
        if resolved == "contiguous":
            buf = backend.alloc(layout.nbytes)
            try:
                backend.memset(buf, 0)
            except BaseException:
                backend.free(buf)
                raise
            return cls(backend, layout, "contiguous", buf, grow_tokens=grow_tokens)

        from .arena import VmmArena

        arena = VmmArena.reserve(backend, layout.nbytes, min_growth=min_growth_bytes)
        cache = cls(
            backend,
            layout,
            "vmm",
            arena.buffer.view(0, layout.nbytes),
            arena=arena,
            grow_tokens=grow_tokens,
        )
        try:
            cache.ensure_positions(min(grow_tokens, layout.max_len))
        except BaseException:
            arena.release()
            raise
        return cache

    # ---- properties
    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def kind(self) -> KVKind:
        return self._kind

    @property
    def arena(self) -> VmmArena | None:
        """The VMM arena behind a ``vmm`` cache (None for ``contiguous``)."""
        return self._arena

    @property
    def buffer(self) -> Buffer:
        """The cache, ``layout.nbytes`` long; for ``vmm`` touch only the first
        :attr:`capacity_positions` positions."""
        if self._buffer is None:
            raise VtError("the KV cache has been released")
        return self._buffer

    @property
    def released(self) -> bool:
        return self._buffer is None

    @property
    def capacity_positions(self) -> int:
        """Positions (of every slot) backed by committed memory right now."""
        if self._buffer is None:
            return 0
        if self._arena is None:
            return self._layout.max_len
        return min(self._layout.max_len, self._arena.mapped_bytes // self._layout.position_bytes)

    # ---- growth
    def ensure_positions(self, n: int, stream: Stream | None = None) -> int:
        """Make positions ``0..n-1`` usable; returns the bytes newly committed.

        Call on the host before enqueueing the step that writes position ``n - 1``. A ``vmm``
        cache grows to the next multiple of ``grow_tokens`` positions, committing at least
        ``min_growth_bytes`` (rounded to the granularity) per growth. Fresh memory is zeroed
        on ``stream`` (ordered before the step's kernels) or, when None, synchronously.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"position count must be a non-negative integer, got {n!r}")
        max_len = self._layout.max_len
        if n > max_len:
            raise KVCapacityError(
                f"{n} positions requested but the KV cache holds at most max_len={max_len} "
                "positions; raise the model length limit (--max-model-len)"
            )
        buf = self.buffer  # raises once released
        if self._arena is None or n <= self.capacity_positions:
            return 0
        chunk = self._grow_tokens
        target = min(max_len, -(-n // chunk) * chunk)
        before = self._arena.mapped_bytes
        self._arena.ensure(target * self._layout.position_bytes)
        after = min(self._arena.mapped_bytes, self._layout.nbytes)
        if after > before:
            # Fresh physical memory is not zero on every runtime; zero it so a vmm cache holds
            # exactly what a contiguous one does.
            self._backend.memset(buf.view(before, after - before), 0, stream)
        return self._arena.mapped_bytes - before

    # ---- reporting and teardown
    def stats(self) -> KVCacheStats:
        if self._arena is not None and not self._arena.released:
            return KVCacheStats(
                backend="vmm",
                reserved_bytes=self._arena.reserved_bytes,
                mapped_bytes=self._arena.mapped_bytes,
                segments=self._arena.segments,
            )
        held = 0 if self._buffer is None else self._layout.nbytes
        return KVCacheStats(
            backend=self._kind,
            reserved_bytes=held,
            mapped_bytes=held,
            segments=1 if held else 0,
        )

    def release(self) -> None:
        """Free the cache's memory. Idempotent; after a failed vmm release, call it again."""
        if self._arena is not None:
            self._arena.release()
            self._buffer = None
            return
        if self._buffer is not None:
            self._backend.free(self._buffer)
            self._buffer = None

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"KVCache(kind={self._kind!r}, capacity_positions={self.capacity_positions}, "
            f"reserved_bytes={s.reserved_bytes}, mapped_bytes={s.mapped_bytes}, "
            f"segments={s.segments})"
        )
