"""The backend protocol: the only way the runner touches a device.

A backend subclasses :class:`Backend` and overrides what its hardware does. Methods the
base class leaves as ``NotImplementedError`` are optional; the registry's rules check that
every *declared* capability is backed by overridden methods (see ``vt.rules``).

Conventions every backend follows:

- Work enqueued on a :class:`Stream` runs in order and asynchronously to the host. Kernels
  and ``*_async`` copies never block the host and never allocate.
- Activations are float32, token ids and positions int32, row-major, in :class:`Buffer`
  objects the caller allocated before the step.
- ``Buffer.offset`` addresses a sub-range of an allocation (see :meth:`Buffer.view`);
  backends must honour it in every method.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .capabilities import Capabilities
from .errors import HostAccessError, KernelNotImplementedError

# --------------------------------------------------------------------------- handles


@dataclass(eq=False)
class Buffer:
    """Device memory: an opaque backend handle plus a byte range within it."""

    handle: Any
    nbytes: int
    offset: int = 0
    owner: str = ""  # backend name, for error messages

    def view(self, offset: int, nbytes: int) -> Buffer:
        """A sub-range ``[offset, offset + nbytes)`` of this buffer (no copy)."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) is outside the buffer of {self.nbytes} bytes"
            )
        return Buffer(self.handle, nbytes, self.offset + offset, self.owner)


@dataclass(eq=False)
class HostBuffer:
    """Host memory from :meth:`Backend.alloc_pinned`; ``array`` is a uint8 view of it."""

    array: np.ndarray
    handle: Any = None
    pinned: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(eq=False)
class Stream:
    handle: Any
    name: str = ""


@dataclass(eq=False)
class Event:
    handle: Any


@dataclass(eq=False)
class Graph:
    """Work captured on a stream (:meth:`Backend.end_capture`), replayed by
    :meth:`Backend.launch_graph` until :meth:`Backend.destroy_graph`."""

    handle: Any
    name: str = ""  # the stream it was captured on, for messages


@dataclass(eq=False)
class VirtualRange:
    """A reserved, initially unmapped, range of device virtual addresses."""

    handle: Any
    nbytes: int


@dataclass(eq=False)
class Segment:
    """Physical memory mapped at ``offset`` within a :class:`VirtualRange`."""

    handle: Any
    offset: int
    nbytes: int


# --------------------------------------------------------------------------- weights


@dataclass(eq=False)
class WeightTensor:
    """A tensor as stored in the model file.

    ``shape`` is the logical numpy shape (``(out_features, in_features)`` for a matrix,
    ``(n,)`` for a vector); ``data`` the raw bytes in GGML format ``ggml_type`` (an int,
    a ``gguf.GGMLQuantizationType`` value).
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(eq=False)
class Weight:
    """A weight in the backend's own format, returned by :meth:`Backend.upload_weight`."""

    name: str
    shape: tuple[int, ...]
    handle: Any
    ggml_type: int = 0


class RopeStyle(str, enum.Enum):
    normal = "normal"  # rotate adjacent pairs (x[2i], x[2i+1]): llama GGUFs
    neox = "neox"  # rotate (x[i], x[i + d/2]): qwen2, qwen3


@dataclass(frozen=True)
class RopeParams:
    head_dim: int
    base: float = 10000.0
    style: RopeStyle = RopeStyle.normal
    # Linear scaling divides positions by ``linear_factor`` (GGUF rope.scaling.type=linear).
    linear_factor: float = 1.0
    # Precomputed per-pair inverse frequencies for llama3-style scaling; None = base**(-2i/d).
    inv_freq: tuple[float, ...] | None = None


@dataclass(frozen=True)
class KVLayout:
    """Layout of the KV cache, one buffer for all layers and sequence slots.

    Position-major so that a VMM arena can grow it by mapping more positions:
    element ``(pos, slot, layer, kv, head, d)`` of a float32 array of shape
    ``(max_len, n_slots, n_layers, 2, n_kv_heads, head_dim)``; ``kv`` 0 is K, 1 is V.
    """

    n_layers: int
    n_slots: int
    max_len: int
    n_kv_heads: int
    head_dim: int

    @property
    def token_bytes(self) -> int:
        """Bytes that one position of one slot takes (all layers, K and V)."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4

    @property
    def position_bytes(self) -> int:
        """Bytes that one position takes across all slots."""
        return self.n_slots * self.token_bytes

    @property
    def nbytes(self) -> int:
        return self.max_len * self.position_bytes

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.max_len, self.n_slots, self.n_layers, 2, self.n_kv_heads, self.head_dim)


#: One row of sampling parameters, uploaded to the device each step.
#: temperature <= 0 means greedy; top_k <= 0 means no top-k; top_p >= 1 means no top-p.
#: ``counter`` is the per-sequence step number mixed with ``seed`` for the random draw.
SAMPLE_PARAMS_DTYPE = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_p", "<f4"),
        ("top_k", "<i4"),
        ("seed", "<u4"),
        ("counter", "<u4"),
    ]
)

#: Kernels the llama-family model needs; the runner refuses a backend missing any.
MODEL_KERNELS: tuple[str, ...] = (
    "upload_weight",
    "embedding",
    "rms_norm",
    "matmul",
    "rope",
    "kv_store",
    "attention",
    "silu_mul",
    "add",
    "gather_rows",
    "sample",
    "copy_d2d",
)


# --------------------------------------------------------------------------- protocol


def _missing(backend: Backend, what: str) -> KernelNotImplementedError:
    return KernelNotImplementedError(f"backend {backend.name!r} does not implement {what}")


class Backend:
    """Base class of every backend. Override what the hardware does.

    Class attributes a backend sets: ``name`` (unique), ``priority`` (higher wins under
    ``auto``), ``description``. ``capabilities`` is the backend's declaration; the registry
    replaces it on the instance with the *effective* capabilities.
    """

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    description: ClassVar[str] = ""
    capabilities: Capabilities = Capabilities()

    @classmethod
    def probe(cls) -> Probe:
        """Is the hardware there, and what does it declare? Must be cheap; may raise."""
        return Probe(available=True, capabilities=cls.capabilities)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything the backend holds."""

    # ---- memory
    def alloc(self, nbytes: int) -> Buffer:
        raise _missing(self, "alloc")

    def free(self, buf: Buffer) -> None:
        raise _missing(self, "free")

    def memset(self, buf: Buffer, value: int, stream: Stream | None = None) -> None:
        """Set every byte of ``buf`` to ``value``; synchronous when ``stream`` is None."""
        raise _missing(self, "memset")

    def copy_h2d(self, dst: Buffer, src: np.ndarray) -> None:
        """Synchronous host-to-device copy of ``src``'s bytes to the start of ``dst``."""
        raise _missing(self, "copy_h2d")

    def copy_d2h(self, dst: np.ndarray, src: Buffer) -> None:
        """Synchronous device-to-host copy of ``dst.nbytes`` bytes from ``src``."""
        raise _missing(self, "copy_d2h")

    def copy_h2d_async(self, dst: Buffer, src: HostBuffer | np.ndarray, stream: Stream) -> None:
        """Enqueue a host-to-device copy; ``src`` must stay alive until the stream passes it."""
        raise _missing(self, "copy_h2d_async")

    def copy_d2h_async(self, dst: HostBuffer, src: Buffer, stream: Stream) -> None:
        """Enqueue a copy of ``dst.nbytes`` bytes from ``src`` into pinned host memory."""
        raise _missing(self, "copy_d2h_async")

    def copy_d2d(self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream) -> None:
        raise _missing(self, "copy_d2d")

    def alloc_pinned(self, nbytes: int) -> HostBuffer:
        """Page-locked host memory. The base returns ordinary (pageable) memory."""
        return HostBuffer(np.zeros(nbytes, dtype=np.uint8), pinned=False)

    def free_pinned(self, buf: HostBuffer) -> None:  # noqa: B027 - ordinary memory is GC'd
        pass

    def host_view(self, buf: Buffer) -> np.ndarray:
        """A uint8 numpy view of device memory; raises unless it is host-addressable."""
        raise HostAccessError(
            f"backend {self.name!r}: device memory is not host-addressable; "
            "copy it to the host with copy_d2h or copy_d2h_async"
        )

    # ---- streams
    def create_stream(self, name: str = "") -> Stream:
        raise _missing(self, "create_stream")

    def destroy_stream(self, stream: Stream) -> None:
        raise _missing(self, "destroy_stream")

    def synchronize(self, stream: Stream) -> None:
        """Block the host until all work enqueued on ``stream`` has finished."""
        raise _missing(self, "synchronize")

    # ---- events (the base is a no-op: a backend without events is synchronous)
    def create_event(self) -> Event:
        return Event(None)

    def destroy_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event, stream: Stream) -> None:
        pass

    def query_event(self, event: Event) -> bool:
        return True

    def synchronize_event(self, event: Event) -> None:
        pass

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        pass

    # ---- graphs (optional; declare ``graphs`` only when overridden)
    def begin_capture(self, stream: Stream) -> None:
        """Record the work enqueued on ``stream`` from now on instead of running it.

        Until :meth:`end_capture`, kernels, ``*_async`` copies, ``copy_d2d`` and stream
        memsets on ``stream`` are recorded with their arguments (buffer addresses, sizes),
        not executed. The host must not synchronize ``stream`` or record events on it
        meanwhile, and must not allocate or free what the captured work touches.
        """
        raise _missing(self, "begin_capture")

    def end_capture(self, stream: Stream) -> Graph:
        """Stop recording on ``stream``; the captured work as a replayable :class:`Graph`."""
        raise _missing(self, "end_capture")

    def launch_graph(self, graph: Graph, stream: Stream) -> None:
        """Enqueue one replay of ``graph`` on ``stream``, in order with its other work.

        A replay reruns the captured work on the buffers' contents *at the time it runs*
        (a device-to-device copy copies what the source holds then); it never replays
        results computed at capture time.
        """
        raise _missing(self, "launch_graph")

    def destroy_graph(self, graph: Graph) -> None:
        """Release ``graph``; replays already enqueued still run."""
        raise _missing(self, "destroy_graph")

    # ---- virtual memory (optional; declare ``vmm`` only when overridden)
    def vmm_granularity(self) -> int:
        raise _missing(self, "vmm_granularity")

    def vmm_reserve(self, nbytes: int) -> VirtualRange:
        raise _missing(self, "vmm_reserve")

    def vmm_map(self, vrange: VirtualRange, offset: int, nbytes: int) -> Segment:
        """Create ``nbytes`` of physical memory and map it at ``offset`` in ``vrange``."""
        raise _missing(self, "vmm_map")

    def vmm_unmap(self, vrange: VirtualRange, segment: Segment) -> None:
        """Unmap ``segment`` and release its physical memory."""
        raise _missing(self, "vmm_unmap")

    def vmm_release(self, vrange: VirtualRange) -> None:
        """Free the reservation (every segment must be unmapped first)."""
        raise _missing(self, "vmm_release")

    def vmm_buffer(self, vrange: VirtualRange) -> Buffer:
        """A :class:`Buffer` over the whole reservation; only mapped bytes may be touched."""
        raise _missing(self, "vmm_buffer")

    # ---- kernels (all enqueue on ``stream``; shapes in elements)
    def upload_weight(self, tensor: WeightTensor) -> Weight:
        """Convert a file tensor into the backend's own format (done once, at load)."""
        raise _missing(self, "upload_weight")

    def free_weight(self, weight: Weight) -> None:  # noqa: B027 - optional hook
        pass

    def embedding(self, out: Buffer, table: Weight, ids: Buffer, n: int, stream: Stream) -> None:
        """``out[i, :] = table[ids[i], :]`` for ``i < n`` (dequantized to float32)."""
        raise _missing(self, "embedding")

    def rms_norm(
        self, out: Buffer, x: Buffer, weight: Weight, n: int, dim: int, eps: float, stream: Stream
    ) -> None:
        """``out[i] = x[i] / sqrt(mean(x[i]**2) + eps) * weight`` over ``n`` rows of ``dim``."""
        raise _missing(self, "rms_norm")

    def matmul(
        self,
        out: Buffer,
        x: Buffer,
        weight: Weight,
        n: int,
        stream: Stream,
        bias: Weight | None = None,
    ) -> None:
        """``out[n, out_f] = x[n, in_f] @ weight.T (+ bias)``; ``weight.shape == (out_f, in_f)``."""
        raise _missing(self, "matmul")

    def rope(
        self,
        x: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        params: RopeParams,
        stream: Stream,
    ) -> None:
        """Rotate ``x[n, n_heads, head_dim]`` in place by each row's position."""
        raise _missing(self, "rope")

    def kv_store(
        self,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        k: Buffer,
        v: Buffer,
        slots: Buffer,
        positions: Buffer,
        n: int,
        stream: Stream,
    ) -> None:
        """Write ``k[i], v[i]`` (``n_kv_heads * head_dim`` floats each) at cache position
        ``positions[i]`` of slot ``slots[i]``."""
        raise _missing(self, "kv_store")

    def attention(
        self,
        out: Buffer,
        q: Buffer,
        cache: Buffer,
        layout: KVLayout,
        layer: int,
        slots: Buffer,
        positions: Buffer,
        n: int,
        n_heads: int,
        scale: float,
        stream: Stream,
    ) -> None:
        """Causal attention: row ``i`` attends to positions ``0..positions[i]`` of its slot.

        Query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``.
        """
        raise _missing(self, "attention")

    def silu_mul(self, out: Buffer, gate: Buffer, up: Buffer, n: int, stream: Stream) -> None:
        """``out = silu(gate) * up`` over ``n`` elements."""
        raise _missing(self, "silu_mul")

    def add(self, out: Buffer, a: Buffer, b: Buffer, n: int, stream: Stream) -> None:
        """``out = a + b`` over ``n`` elements (``out`` may alias ``a``)."""
        raise _missing(self, "add")

    def gather_rows(
        self, out: Buffer, x: Buffer, rows: Buffer, n: int, dim: int, stream: Stream
    ) -> None:
        """``out[i] = x[rows[i]]`` for ``i < n``; rows are int32."""
        raise _missing(self, "gather_rows")

    def sample(
        self,
        out_ids: Buffer,
        logits: Buffer,
        params: Buffer,
        n: int,
        vocab: int,
        stream: Stream,
    ) -> None:
        """Sample one int32 id per row of ``logits[n, vocab]``.

        ``params`` holds ``n`` records of :data:`SAMPLE_PARAMS_DTYPE`; the draw must equal
        ``vt.reference.sample`` for the same inputs.
        """
        raise _missing(self, "sample")

    # ---- introspection
    @classmethod
    def overrides(cls, method: str) -> bool:
        """Whether this backend class overrides ``method`` of the base protocol."""
        return getattr(cls, method, None) is not getattr(Backend, method, None)

    @classmethod
    def missing_kernels(cls) -> list[str]:
        return [k for k in MODEL_KERNELS if not cls.overrides(k)]


@dataclass
class Probe:
    """What a backend's probe found: availability, why not, and its declaration."""

    available: bool
    reason: str = ""
    capabilities: Capabilities | None = None
    device: str = ""
    details: dict[str, Any] = field(default_factory=dict)
