"""A VMM arena: one reserved range of device virtual addresses, mapped as a growing prefix.

The arena owns a :class:`vt.VirtualRange` and a list of physical :class:`vt.Segment` objects
mapped back to back from offset 0. Invariants the methods keep:

- ``reserved_bytes`` is ``nbytes`` rounded up to the granularity;
- the mapped prefix ``[0, mapped_bytes)`` is exactly the segments, in order, each a
  non-zero multiple of the granularity, and never extends past the reservation;
- a rejected or failed request leaves the arena and the bytes already mapped untouched.

Aliasing policy: on some runtimes (ROCm 7.2 on Windows) a later segment may alias the
physical pages of an earlier one, silently corrupting everything written before. A backend
on such a platform declares ``VmmCaps(segments_may_alias=True)``; the arena then maps the
*full* reservation in one segment at :meth:`VmmArena.reserve` and never grows, so
:meth:`VmmArena.ensure` anywhere within the reservation is a no-op, and :meth:`map_next`
always fails (there is nothing left to map) with a message that names the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import CapabilityError, VmmError
from ...protocol.backend import Backend, Buffer, Segment, VirtualRange

#: Offsets of tensors bump-allocated on an arena are aligned to this many bytes.
TENSOR_ALIGNMENT = 256


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def vmm_granularity(backend: Backend) -> int:
    """The granularity an arena on ``backend`` uses, from its effective capabilities.

    Raises :class:`vt.CapabilityError` when the backend does not declare ``vmm``, and
    :class:`vt.VmmError` when the declared granularity disagrees with ``vmm_granularity()``.
    """
    caps = backend.capabilities.vmm
    if caps is None:
        raise CapabilityError(
            f"backend {backend.name!r} does not declare vmm; use a contiguous allocation "
            "(--kv-cache contiguous, kv_cache='contiguous') or a backend that supports "
            "virtual memory"
        )
    runtime = backend.vmm_granularity()
    declared = caps.granularity
    if not _is_size(runtime) or runtime <= 0:
        raise VmmError(
            f"backend {backend.name!r}: vmm_granularity() returned {runtime!r}, "
            "expected a positive number of bytes"
        )
    if declared <= 0 or declared % runtime:
        raise VmmError(
            f"backend {backend.name!r}: declared vmm granularity {declared} is not a positive "
            f"multiple of the runtime's vmm_granularity() {runtime}"
        )
    return declared


class VmmArena:
    """A reserved virtual range whose prefix is backed by physical segments.

    Build with :meth:`reserve`. Use :meth:`ensure` to grow by policy, :meth:`map_next` to
    append one segment of an exact size, :meth:`alloc_tensor` to carve tensors from it.
    """

    def __init__(
        self,
        backend: Backend,
        vrange: VirtualRange,
        reserved: int,
        granularity: int,
        *,
        full_map: bool,
        min_growth: int,
    ) -> None:
        self._backend = backend
        self._vrange: VirtualRange | None = vrange
        self._reserved = reserved
        self._granularity = granularity
        self._full_map = full_map
        self._min_growth = min_growth
        self._segments: list[Segment] = []
        self._mapped = 0
        self._tensor_top = 0
        self._buffer: Buffer | None = None

    @classmethod
    def reserve(cls, backend: Backend, nbytes: int, *, min_growth: int = 0) -> VmmArena:
        """Reserve ``nbytes`` (rounded up to the granularity) of device virtual memory.

        ``min_growth`` is the smallest physical chunk :meth:`ensure` maps at once (rounded up
        to the granularity). Where the backend declares ``segments_may_alias``, the whole
        reservation is mapped here, in one segment.
        """
        granularity = vmm_granularity(backend)
        if not _is_size(nbytes) or nbytes <= 0:
            raise VmmError(f"reservation size must be a positive number of bytes, got {nbytes!r}")
        if not _is_size(min_growth) or min_growth < 0:
            raise VmmError(f"min_growth must be a non-negative number of bytes, got {min_growth!r}")
        reserved = _round_up(nbytes, granularity)
        vrange = backend.vmm_reserve(reserved)
        if vrange.nbytes < reserved:
            backend.vmm_release(vrange)
            raise VmmError(
                f"backend {backend.name!r}: vmm_reserve({reserved}) returned a range of only "
                f"{vrange.nbytes} bytes"
            )
        full_map = bool(backend.capabilities.vmm.segments_may_alias)  # type: ignore[union-attr]
        arena = cls(
            backend,
            vrange,
            reserved,
            granularity,
            full_map=full_map,
            min_growth=_round_up(min_growth, granularity),
        )
        if full_map:
            try:
                arena._map(reserved)
            except BaseException:
                backend.vmm_release(vrange)
                raise
        return arena

    # ---- properties
    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def mapped_bytes(self) -> int:
        return self._mapped

    @property
    def granularity(self) -> int:
        return self._granularity

    @property
    def segments(self) -> int:
        """How many physical segments are mapped."""
        return len(self._segments)

    @property
    def full_map(self) -> bool:
        """Whether the full-map policy is in force (the backend's segments may alias)."""
        return self._full_map

    @property
    def min_growth(self) -> int:
        return self._min_growth

    @property
    def released(self) -> bool:
        return self._vrange is None

    @property
    def vrange(self) -> VirtualRange:
        """The backend's reservation handle (raises once released)."""
        return self._live()

    @property
    def buffer(self) -> Buffer:
        """A Buffer over the whole reservation; only ``[0, mapped_bytes)`` may be touched."""
        vrange = self._live()
        if self._buffer is None:
            self._buffer = self._backend.vmm_buffer(vrange)
        return self._buffer

    # ---- growth
    def map_next(self, nbytes: int) -> Segment:
        """Map one physical segment of ``nbytes`` right after the mapped prefix."""
        self._live()
        g, m, r = self._granularity, self._mapped, self._reserved
        if not _is_size(nbytes) or nbytes <= 0 or nbytes % g:
            raise VmmError(f"map size {nbytes!r} must be a non-zero multiple of granularity {g}")
        if m + nbytes > r:
            policy = (
                " (the backend declares segments_may_alias, so the full reservation was mapped "
                "in one segment at reserve time and the arena never grows)"
                if self._full_map
                else ""
            )
            raise VmmError(
                f"map of {nbytes} bytes would exceed reserve {m} + {nbytes} > {r}{policy}"
            )
        return self._map(nbytes)

    def ensure(self, nbytes: int) -> int:
        """Grow so the mapped prefix covers ``nbytes``; returns the bytes newly mapped.

        Maps one segment of at least ``min_growth`` bytes, rounded up to the granularity and
        clipped to the reservation. A no-op when already covered (always, under full-map).
        """
        self._live()
        if not _is_size(nbytes) or nbytes < 0:
            raise VmmError(f"ensure size must be a non-negative number of bytes, got {nbytes!r}")
        if nbytes > self._reserved:
            raise VmmError(
                f"cannot map {nbytes} bytes: the arena reserves only {self._reserved} bytes"
            )
        if nbytes <= self._mapped:
            return 0
        chunk = _round_up(max(nbytes - self._mapped, self._min_growth), self._granularity)
        chunk = min(chunk, self._reserved - self._mapped)
        self.map_next(chunk)
        return chunk

    def _map(self, nbytes: int) -> Segment:
        vrange = self._live()
        segment = self._backend.vmm_map(vrange, self._mapped, nbytes)
        # Record only after the backend succeeded, so a failed map leaves the arena as it was.
        self._segments.append(segment)
        self._mapped += nbytes
        return segment

    # ---- tensors
    def alloc_tensor(self, nbytes: int) -> Buffer:
        """Carve a tensor of exactly ``nbytes`` from the arena, mapping what it needs.

        Offsets are aligned to :data:`TENSOR_ALIGNMENT`; the mapping grows by whole granules,
        so a 4097-byte first tensor maps ``round_up(4097, granularity)`` bytes.
        """
        self._live()
        if not _is_size(nbytes) or nbytes <= 0:
            raise VmmError(f"tensor size must be a positive number of bytes, got {nbytes!r}")
        offset = _round_up(self._tensor_top, TENSOR_ALIGNMENT)
        end = offset + nbytes
        if end > self._reserved:
            raise VmmError(
                f"tensor of {nbytes} bytes at offset {offset} does not fit in the arena's "
                f"reservation of {self._reserved} bytes"
            )
        self.ensure(end)
        self._tensor_top = end
        return self.buffer.view(offset, nbytes)

    # ---- teardown
    def release(self) -> None:
        """Unmap every segment in reverse order and free the reservation.

        Idempotent. If the backend fails part way, the segments not yet unmapped stay listed
        (and counted in ``mapped_bytes``); calling ``release()`` again continues from there.
        """
        vrange = self._vrange
        if vrange is None:
            return
        while self._segments:
            segment = self._segments[-1]
            try:
                self._backend.vmm_unmap(vrange, segment)
            except Exception as exc:
                raise VmmError(
                    f"backend {self._backend.name!r}: unmapping the segment at offset "
                    f"{segment.offset} ({segment.nbytes} bytes) failed: {exc}; "
                    f"{len(self._segments)} segment(s) still mapped, call release() again"
                ) from exc
            self._segments.pop()
            self._mapped -= segment.nbytes
        self._buffer = None
        try:
            self._backend.vmm_release(vrange)
        except Exception as exc:
            raise VmmError(
                f"backend {self._backend.name!r}: freeing the reservation of {self._reserved} "
                f"bytes failed: {exc}; call release() again"
            ) from exc
        self._vrange = None
        self._tensor_top = 0

    def _live(self) -> VirtualRange:
        if self._vrange is None:
            raise VmmError("the VMM arena has been released")
        return self._vrange

    def __enter__(self) -> VmmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (
            f"VmmArena(backend={self._backend.name!r}, reserved_bytes={self._reserved}, "
            f"mapped_bytes={self._mapped}, granularity={self._granularity}, "
            f"segments={self.segments}, full_map={self._full_map})"
        )


@dataclass(eq=False)
class ArenaTensor:
    """A tensor with an arena of its own; ``buffer`` is exactly the requested size."""

    arena: VmmArena
    buffer: Buffer

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def release(self) -> None:
        self.arena.release()


def arena_tensor(backend: Backend, nbytes: int) -> ArenaTensor:
    """Allocate one ``nbytes`` tensor through a fresh VMM arena.

    The arena reserves and maps ``round_up(nbytes, granularity)`` in one segment; the
    returned buffer exposes exactly ``nbytes``.
    """
    if not _is_size(nbytes) or nbytes <= 0:
        raise VmmError(f"tensor size must be a positive number of bytes, got {nbytes!r}")
    arena = VmmArena.reserve(backend, nbytes)
    try:
        return ArenaTensor(arena, arena.alloc_tensor(nbytes))
    except BaseException:
        arena.release()
        raise
