"""Open a GGUF file safely and hand out its metadata and raw tensors.

A GGUF is untrusted input. ``gguf.GGUFReader`` trusts every length and offset in it (on a
truncated file it raises odd errors or loops over a bogus array length), and it builds
Python objects per metadata item: a 2 MB file with a 2M-item array took it 96 s and
1.4 GB. So vt reads GGUF files itself: :func:`scan_gguf` walks the header with bounds
checks, reads the metadata within bounds on keys, items and bytes (numeric arrays in one
numpy call), checks every tensor's type, extent and place in the data section (tensors
follow each other, aligned, as llama.cpp requires: no overlap, no gap), and
:func:`load_gguf` memory-maps the file for the tensors' bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import ModelError
from ..protocol.backend import WeightTensor
from ..reference.quant import SUPPORTED_TYPES as SUPPORTED_TENSOR_TYPES
from .config import ModelConfig, config_from_gguf
from .string_array import StringArray

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# Metadata bounds, far above any real model (a 262k-token vocabulary with scores, types and
# 1M merges is under 2M items and 20 MB of strings), far below what hurts.
MAX_METADATA_KEYS = 65_536
MAX_ARRAY_ITEMS = 8 << 20  # items of one array
MAX_METADATA_ITEMS = 16 << 20  # items of all arrays together
MAX_METADATA_STRING_BYTES = 256 << 20  # bytes of all strings together
# SUPPORTED_TENSOR_TYPES (exported by vt.model) is the reference's own list, so the loader
# refuses exactly the types vt cannot dequantize.

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
# Smallest encoding of one array element, used to reject absurd array lengths up front.
_MIN_ITEM_SIZE = {
    **{t: struct.calcsize(f) for t, f in _SCALAR_FORMATS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
_NUMPY_TYPES: dict[int, str] = {
    GGUFValueType.UINT8: "<u1",
    GGUFValueType.INT8: "<i1",
    GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4",
    GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4",
    GGUFValueType.BOOL: "<u1",
    GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8",
    GGUFValueType.FLOAT64: "<f8",
}


# --------------------------------------------------------------------------- scanning


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file, as checked by :func:`scan_gguf`."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]  # GGUF order: ne[0] is the contiguous (innermost) dimension
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical numpy shape: ``ne`` reversed, e.g. ``(out_features, in_features)``."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return _type_name(self.ggml_type)


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    n_kv: int
    alignment: int
    data_offset: int
    file_size: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


class _Cursor:
    """Bounds-checked little-endian reads; every overrun names the section being read."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        self.items = 0  # metadata array items read so far
        self.string_bytes = 0  # metadata string bytes read so far

    def fail(self, what: str) -> ModelError:
        return ModelError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"truncated file: {what} needs bytes {self.pos}..{self.pos + n} "
                f"but the file has only {self.size} bytes"
            )

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        return str(self.raw_string(what), "utf-8")

    def raw_string(self, what: str) -> bytes:
        """A string's bytes, checked to be valid UTF-8."""
        n = self.unpack("<Q", f"{what} (length)")
        self.need(n, what)
        self.string_bytes += n
        if self.string_bytes > MAX_METADATA_STRING_BYTES:
            raise self.fail(
                f"the metadata holds more than {MAX_METADATA_STRING_BYTES} bytes of strings "
                f"(at {what}); no real model has that many"
            )
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e})") from None
        return raw

    def strings(self, count: int, what: str) -> StringArray:
        """An array of ``count`` strings, held as one blob (no Python string per item)."""
        blob, ends = bytearray(), array("I", [0])
        for i in range(count):
            blob += self.raw_string(f"{what}[{i}]")
            ends.append(len(blob))
        return StringArray(bytes(blob), ends)

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Read one value: a scalar, a string, or an array as a list (within the bounds)."""
        if vtype in _SCALAR_FORMATS:
            value = self.unpack(_SCALAR_FORMATS[vtype], what)
            return bool(value) if vtype == GGUFValueType.BOOL else value
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype != GGUFValueType.ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        if depth > 2:
            raise self.fail(f"{what} nests arrays too deeply")
        item_type = self.unpack("<I", f"{what} (array item type)")
        count = self.unpack("<Q", f"{what} (array length)")
        if item_type not in _MIN_ITEM_SIZE:
            raise self.fail(f"{what} is an array of unknown value type {item_type}")
        # Checked before looping, so a bogus length cannot make us spin.
        self.need(count * _MIN_ITEM_SIZE[item_type], f"{what} ({count} array items)")
        if count > MAX_ARRAY_ITEMS:
            raise self.fail(
                f"{what} is an array of {count} items; vt reads at most {MAX_ARRAY_ITEMS} "
                "per array (no real model has more)"
            )
        self.items += count
        if self.items > MAX_METADATA_ITEMS:
            raise self.fail(
                f"the metadata holds more than {MAX_METADATA_ITEMS} array items (at {what}); "
                "no real model has that many"
            )
        if item_type in _NUMPY_TYPES:
            n = count * _MIN_ITEM_SIZE[item_type]
            raw = np.frombuffer(self.buf, _NUMPY_TYPES[item_type], count, self.pos)
            self.pos += n
            return raw.astype(bool).tolist() if item_type == GGUFValueType.BOOL else raw.tolist()
        if item_type == GGUFValueType.STRING:
            return self.strings(count, what)
        return [self.value(item_type, f"{what}[{i}]", depth + 1) for i in range(count)]


def scan_gguf(path: str | os.PathLike[str]) -> GGUFLayout:
    """Check a GGUF's structure without trusting it; raise :class:`ModelError` if broken.

    Checks: the file exists and is readable, magic, version, that the header, every
    key/value and every tensor info lie inside the file, tensor types are known GGML types
    with whole blocks per row, offsets are aligned, and every tensor's data ends inside
    the file.
    """
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{p}: no such model file")
    if not p.is_file():
        raise ModelError(f"{p}: not a regular file")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            if size < 4:
                head = f.read()
                raise ModelError(
                    f"{p}: truncated file: {size} bytes ({head!r}) is too short for a GGUF header"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _scan(buf, size, p)
    except OSError as e:
        raise ModelError(f"{p}: cannot read the file: {e}") from e


def _scan(buf: Any, size: int, path: Path) -> GGUFLayout:
    cur = _Cursor(buf, size, path)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        hint = " (this looks like a zip or wheel archive)" if magic == b"PK\x03\x04" else ""
        raise cur.fail(f"not a GGUF file: the magic bytes are {magic!r}, expected b'GGUF'{hint}")
    cur.pos = 4
    version = cur.unpack("<I", "the header (version)")
    if version & 0xFFFF == 0 and version != 0:
        raise cur.fail("big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(
            f"unsupported GGUF version {version} (supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    n_tensors = cur.unpack("<Q", "the header (tensor count)")
    n_kv = cur.unpack("<Q", "the header (key/value count)")
    # Each key/value takes at least 13 bytes and each tensor info at least 24.
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise cur.fail(
            f"truncated or corrupt header: it claims {n_kv} key/values and {n_tensors} "
            f"tensors, which cannot fit in {size} bytes"
        )
    if n_kv > MAX_METADATA_KEYS:
        raise cur.fail(
            f"the header claims {n_kv} metadata keys; vt reads at most {MAX_METADATA_KEYS} "
            "(no real model has more than a few dozen)"
        )

    alignment = DEFAULT_ALIGNMENT
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key/value #{i} (key)")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.unpack("<I", f"key/value {key!r} (type)")
        value = cur.value(vtype, f"key/value {key!r}")
        metadata[key] = value
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32 or value <= 0 or value & (value - 1):
                raise cur.fail(f"general.alignment must be a power of two, got {value!r}")
            alignment = value

    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"tensor info #{i} (name)")
        if name in names:
            raise cur.fail(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.unpack("<I", f"tensor info {name!r} (dimension count)")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        ne = tuple(cur.unpack("<Q", f"tensor info {name!r} (dimensions)") for _ in range(n_dims))
        ggml_type = cur.unpack("<I", f"tensor info {name!r} (type)")
        rel_offset = cur.unpack("<Q", f"tensor info {name!r} (offset)")
        infos.append((name, ggml_type, ne, rel_offset))

    data_offset = cur.pos + (-cur.pos) % alignment
    if infos and data_offset > size:
        raise cur.fail(
            f"truncated file: tensor data should start at byte {data_offset} but the file "
            f"has only {size} bytes"
        )
    tensors = []
    for name, ggml_type, ne, rel_offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name!r} has an unknown GGML type id {ggml_type}") from None
        if ne[0] % block:
            raise cur.fail(
                f"tensor {name!r} ({qtype.name}) has rows of {ne[0]} elements, not a "
                f"multiple of the {qtype.name} block size {block}"
            )
        if rel_offset % alignment:
            raise cur.fail(
                f"tensor {name!r} has offset {rel_offset}, not a multiple of the alignment "
                f"{alignment}"
            )
        nbytes = int(np.prod(ne, dtype=object)) // block * type_size
        start = data_offset + rel_offset
        if start + nbytes > size:
            raise cur.fail(
                f"tensor {name!r} ({qtype.name}, shape {tuple(reversed(ne))}) occupies bytes "
                f"{start}..{start + nbytes} but the file has only {size} bytes "
                "(truncated or corrupt file)"
            )
        tensors.append(TensorInfo(name, int(qtype), ne, start, nbytes))
    _check_data_layout(cur, tensors, data_offset, alignment, size)
    return GGUFLayout(version, n_kv, alignment, data_offset, size, tuple(tensors), metadata)


def _check_data_layout(
    cur: _Cursor, tensors: list[TensorInfo], data_offset: int, alignment: int, size: int
) -> None:
    """Tensors follow each other in the data section, each at the aligned end of the one
    before (llama.cpp's rule): two tensors never share bytes, and a type or shape changed
    without its data shows as an overlap or a gap."""
    expected = data_offset
    previous: TensorInfo | None = None
    for t in tensors:
        if t.offset != expected:
            if previous is None:
                where = f"the data section starts at byte {data_offset}"
            else:
                where = (
                    f"the tensor before it, {previous.name!r} ({previous.type_name}, shape "
                    f"{previous.shape}), ends at byte {previous.offset + previous.nbytes}"
                )
            kind = "overlaps it" if t.offset < expected else f"leaves {t.offset - expected} bytes"
            raise cur.fail(
                f"tensor {t.name!r} ({t.type_name}, shape {t.shape}) starts at byte "
                f"{t.offset}, but {where}: it {kind} (tensors must follow each other; "
                "overlapping tensors, or a type or shape that does not match the data)"
            )
        expected = t.offset + t.nbytes + (-(t.offset + t.nbytes - data_offset)) % alignment
        previous = t
    if previous is not None and size - expected >= alignment:
        end = previous.offset + previous.nbytes
        raise cur.fail(
            f"the file has {size - end} bytes after its last tensor {previous.name!r} "
            f"({previous.type_name}, shape {previous.shape}, ending at byte {end}): a type or "
            "shape does not match the data"
        )


# --------------------------------------------------------------------------- the model file


@dataclass(frozen=True)
class LayerTensors:
    """The tensors of one transformer block; optional ones are None when absent."""

    attn_norm: WeightTensor
    attn_q: WeightTensor
    attn_k: WeightTensor
    attn_v: WeightTensor
    attn_output: WeightTensor
    ffn_norm: WeightTensor
    ffn_gate: WeightTensor
    ffn_up: WeightTensor
    ffn_down: WeightTensor
    attn_q_bias: WeightTensor | None = None  # qwen2
    attn_k_bias: WeightTensor | None = None
    attn_v_bias: WeightTensor | None = None
    attn_q_norm: WeightTensor | None = None  # qwen3: per-head RMS norm of Q and K
    attn_k_norm: WeightTensor | None = None

    def items(self) -> Iterator[tuple[str, WeightTensor]]:
        """``(field name, tensor)`` for every tensor present."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.name, value


# field of LayerTensors -> GGUF tensor name suffix of blk.{i}.
LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_output": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
    "attn_q_bias": "attn_q.bias",
    "attn_k_bias": "attn_k.bias",
    "attn_v_bias": "attn_v.bias",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
}


class ModelFile:
    """A validated, memory-mapped GGUF model. Build it with :func:`load_gguf`."""

    def __init__(self, path: Path, layout: GGUFLayout, data: np.ndarray) -> None:
        self.path = path
        self.layout = layout
        self._data: np.ndarray | None = data  # the whole file, read-only (a memory map)
        self._infos = {t.name: t for t in layout.tensors}
        #: Every key/value as plain Python values (str, int, float, bool, list), string
        #: arrays as :class:`StringArray` (a read-only list of str, held compactly).
        self.metadata: dict[str, Any] = dict(layout.metadata)
        self.config: ModelConfig = config_from_gguf(
            self.metadata, {n: t.shape for n, t in self._infos.items()}, self._rope_freqs()
        )
        self._check_model_tensors()

    # ---- tensors
    @property
    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise ModelError(f"{self.path}: the model has no tensor {name!r}") from None

    def has_tensor(self, name: str) -> bool:
        return name in self._infos

    def tensor(self, name: str) -> WeightTensor:
        """The tensor's raw bytes (flat uint8, a read-only view of the file's mmap)."""
        info = self.tensor_info(name)
        if self._data is None:
            raise ModelError(f"{self.path}: the model file is closed")
        data = self._data[info.offset : info.offset + info.nbytes].view(np.ndarray)
        return WeightTensor(name=name, ggml_type=info.ggml_type, shape=info.shape, data=data)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 in its logical shape (for tests and reference code)."""
        from gguf.quants import dequantize

        t = self.tensor(name)
        values = dequantize(t.data, GGMLQuantizationType(t.ggml_type))
        return np.asarray(values, dtype=np.float32).reshape(t.shape)

    def layer_tensors(self, i: int) -> LayerTensors:
        """The tensors of block ``i``."""
        if not 0 <= i < self.config.n_layers:
            raise ModelError(f"layer {i} is out of range (the model has {self.config.n_layers})")
        found = {}
        for attr, suffix in LAYER_TENSOR_NAMES.items():
            name = f"blk.{i}.{suffix}"
            if name in self._infos:
                found[attr] = self.tensor(name)
        return LayerTensors(**found)

    def token_embedding(self) -> WeightTensor:
        return self.tensor("token_embd.weight")

    def output_norm(self) -> WeightTensor:
        return self.tensor("output_norm.weight")

    def output(self) -> WeightTensor:
        """The output projection: ``output.weight``, or the token embedding when tied."""
        return self.tensor("token_embd.weight" if self.config.tied_output else "output.weight")

    def model_tensor_names(self) -> list[str]:
        """Every tensor the forward pass reads."""
        return [name for name, _ in self._expected_tensors()]

    def type_histogram(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds."""
        return dict(Counter(t.type_name for t in self.layout.tensors).most_common())

    @property
    def n_parameters(self) -> int:
        return sum(int(np.prod(t.ne, dtype=object)) for t in self.layout.tensors)

    def close(self) -> None:
        """Drop this object's reference to the mmap (tensors handed out keep it alive)."""
        self._data = None

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return f"ModelFile({str(self.path)!r}, {c.architecture}, {c.n_layers} layers, dim {c.dim})"

    # ---- checks
    def _layer_fields(self) -> list[str]:
        c = self.config
        names = [
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        ]
        if c.has_qkv_bias:
            names += ["attn_q_bias", "attn_k_bias", "attn_v_bias"]
        if c.has_qk_norm:
            names += ["attn_q_norm", "attn_k_norm"]
        return names

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "attn_norm": (c.dim,),
            "attn_q": (q, c.dim),
            "attn_k": (kv, c.dim),
            "attn_v": (kv, c.dim),
            "attn_output": (c.dim, q),
            "ffn_norm": (c.dim,),
            "ffn_gate": (c.ffn_dim, c.dim),
            "ffn_up": (c.ffn_dim, c.dim),
            "ffn_down": (c.dim, c.ffn_dim),
            "attn_q_bias": (q,),
            "attn_k_bias": (kv,),
            "attn_v_bias": (kv,),
            "attn_q_norm": (c.head_dim,),
            "attn_k_norm": (c.head_dim,),
        }
        return shapes

    def _expected_tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        c = self.config
        yield "token_embd.weight", (c.vocab_size, c.dim)
        yield "output_norm.weight", (c.dim,)
        if not c.tied_output:
            yield "output.weight", (c.vocab_size, c.dim)
        per_layer = self._expected_shapes()
        layer_fields = self._layer_fields()
        for i in range(c.n_layers):
            for attr in layer_fields:
                yield f"blk.{i}.{LAYER_TENSOR_NAMES[attr]}", per_layer[attr]

    def _check_model_tensors(self) -> None:
        for name, shape in self._expected_tensors():
            info = self._infos.get(name)
            if info is None:
                raise ModelError(
                    f"{self.path}: tensor {name!r} is missing ({self.config.architecture} needs it)"
                )
            if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
                raise ModelError(
                    f"{self.path}: tensor {name!r} has type {info.type_name}, which vt does "
                    f"not support (supported: {', '.join(supported_type_names())})"
                )
            if info.shape != shape:
                raise ModelError(
                    f"{self.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                    "from the model's metadata"
                )

    def _rope_freqs(self) -> np.ndarray | None:
        info = self._infos.get("rope_freqs.weight")
        if info is None:
            return None
        if info.ggml_type != GGMLQuantizationType.F32:
            raise ModelError(f"{self.path}: rope_freqs.weight must be F32, got {info.type_name}")
        start = info.offset
        assert self._data is not None
        return np.frombuffer(self._data[start : start + info.nbytes], dtype=np.float32)


def supported_type_names() -> list[str]:
    return sorted(t.name for t in SUPPORTED_TENSOR_TYPES)


def _map_file(path: Path) -> np.ndarray:
    """The whole file as read-only uint8 (tensors are views of it)."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def load_gguf(path: str | os.PathLike[str]) -> ModelFile:
    """Open, validate and memory-map a GGUF model; every problem is a :class:`ModelError`."""
    p = Path(path).expanduser()
    layout = scan_gguf(p)
    try:
        data = _map_file(p)
    except (OSError, ValueError) as e:
        raise ModelError(f"{p}: cannot map the file: {type(e).__name__}: {e}") from e
    try:
        return ModelFile(p, layout, data)
    except ModelError as e:
        if str(p) in str(e):
            raise
        raise ModelError(f"{p}: {e}") from e
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise ModelError(f"{p}: cannot read the model: {type(e).__name__}: {e}") from e
