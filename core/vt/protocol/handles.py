"""The handles that cross the backend protocol: memory, streams, tensors and weights.

Every field is plain data; only the backend that made a handle knows what ``handle``
holds. Activations are float32, token ids and positions int32, row-major.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

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


# --------------------------------------------------------------------------- tensors

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
U8 = np.dtype(np.uint8)


@dataclass(frozen=True, eq=False)
class Tensor:
    """A typed view of device memory: ``shape`` elements of ``dtype`` at the start of
    ``buffer``, row-major. Ops take tensors, so the core checks sizes once for every backend.
    """

    buffer: Buffer
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        shape = tuple(self.shape)
        for d in shape:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
                raise ValueError(f"tensor shape {shape}: dimension {d!r} is not a size")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def rows(self, n: int) -> Tensor:
        """The first ``n`` rows (leading dimension), no copy."""
        return Tensor(self.buffer, self.dtype, (n, *self.shape[1:]))

    def reshape(self, *shape: int) -> Tensor:
        """The same elements with another shape (the element count must match)."""
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} ({self.size} elements) to {shape}")
        return Tensor(self.buffer, self.dtype, tuple(shape))

    @classmethod
    def of(cls, buffer: Buffer, dtype: Any, *shape: int) -> Tensor:
        """A tensor over ``buffer``; raises if ``shape`` of ``dtype`` does not fit."""
        t = cls(buffer, np.dtype(dtype), shape)
        if t.nbytes > buffer.nbytes:
            raise ValueError(
                f"tensor {t.shape} of {t.dtype} needs {t.nbytes} bytes, the buffer has "
                f"{buffer.nbytes}"
            )
        return t


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
    owner: str = ""  # backend name, set by upload_weight


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
