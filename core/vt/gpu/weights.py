"""GGUF tensors in the kernels' weight formats, prepared on the host at upload.

Float types stay as they are (F32, F16, BF16 bits). Every quantized type vt reads becomes
WT_Q: a code ``q`` per value and a ``(scale, offset)`` pair per block of 32 values (16 for
Q6_K), with ``value = scale * q + offset`` rounded in two steps. The scales are computed as
gguf's dequantization computes them (``d * sc`` for K-quants, in float32), so the kernels'
dequantization equals ``vt.reference.dequantize`` bit for bit.

How the codes and pairs are stored is the weight's layout (``LAYOUTS``, flags that
kernels/common.cu defines too): 4-bit codes two a byte where the type's codes fit 4 bits,
scales as IEEE half where the file stores them so, no offsets where they are all zero. So
a weight costs on the device about what it costs in the file (Q8_0 1.0625 bytes a value,
Q4_0 0.5625, Q4_1 0.625, Q4_K 0.75, Q6_K 1.25, Q5_K 1.25) and every layout dequantizes to
the same float32 values. ``compact=False`` gives the wide layout (int8 codes, float32 pairs,
1.25 bytes a value, 1.5 for Q6_K) that every kernel also reads: a benchmark's baseline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from ..errors import ModelError
from ..protocol.backend import WeightTensor
from ..reference.quant import SUPPORTED_TYPES, dequantize, ggml_type_name

#: Kernel weight kinds (the WT_* constants of kernels/common.cu) and their kernel name suffixes.
WT_F32, WT_F16, WT_BF16, WT_Q = 0, 1, 2, 3
SUFFIX = {WT_F32: "f32", WT_F16: "f16", WT_BF16: "bf16", WT_Q: "q"}

#: WT_Q layout flags (as kernels/common.cu defines them; the kernels get ``lg_block | layout``).
#: Q_NIB: 4-bit codes, two a byte: of each 16 values, value j is the low nibble of byte
#: j (j < 8) and value j + 8 its high nibble. Q_NIB8: a nibble n is the code n - 8.
#: Q_HALF: scales (and offsets) stored as IEEE half. Q_ONE: a scale alone, the offset 0.
Q_NIB, Q_NIB8, Q_HALF, Q_ONE = 0x100, 0x200, 0x400, 0x800
#: Every Q_* flag: what a layout (or a setting naming layouts by their flags) may hold.
Q_FLAGS = Q_NIB | Q_NIB8 | Q_HALF | Q_ONE

T = GGMLQuantizationType
F16 = np.dtype("<f2")


@dataclass(eq=False)
class PackedWeight:
    """A weight ready to copy to the device: ``data`` then, for WT_Q, ``scales``."""

    kind: int
    rows: int
    cols: int
    data: np.ndarray  # float32, uint16 (f16/bf16 bits), int8 codes or nibbles; C-contiguous
    #: float32 or uint16 (half bits), [n_blocks, 2] (scale, offset) or [n_blocks] (Q_ONE)
    scales: np.ndarray | None = None
    lg_block: int = 0  # log2 of the values per (scale, offset) pair
    layout: int = 0  # Q_* flags

    def values(self) -> np.ndarray:
        """The float32 values the kernels read (for tests; mirrors ``vt_wload``)."""
        if self.kind == WT_F32:
            out = self.data.astype(np.float32)
        elif self.kind == WT_F16:
            out = self.data.view(F16).astype(np.float32)
        elif self.kind == WT_BF16:
            out = (self.data.astype(np.uint32) << 16).view(np.float32)
        else:
            assert self.scales is not None
            scales = self.scales.view(F16) if self.layout & Q_HALF else self.scales
            pairs = scales.astype(np.float32).reshape(-1, 1 if self.layout & Q_ONE else 2)
            scale, offset = pairs[:, :1], pairs[:, 1:] if pairs.shape[1] == 2 else np.float32(0)
            q = _codes(self.data, self.layout).reshape(-1, 1 << self.lg_block).astype(np.float32)
            out = q * scale + offset
        return out.reshape(self.rows, self.cols)


def _codes(data: np.ndarray, layout: int) -> np.ndarray:
    """The int8 codes of a WT_Q weight's data, in value order."""
    if not layout & Q_NIB:
        return data.view(np.int8)
    chunks = data.view(np.uint8).reshape(-1, 8)
    codes = np.concatenate([chunks & 0x0F, chunks >> 4], axis=1).astype(np.int8)
    return (codes - np.int8(8) if layout & Q_NIB8 else codes).reshape(-1)


def _nibbles_of(codes: np.ndarray, layout: int) -> np.ndarray:
    """Codes (a multiple of 16, each 0..15 after Q_NIB8's + 8) two a byte, as ``_codes`` reads."""
    n = codes.astype(np.int16) + (8 if layout & Q_NIB8 else 0)
    if n.size % 16 or n.min(initial=0) < 0 or n.max(initial=0) > 15:
        raise AssertionError("4-bit codes out of range")  # a vt bug: LAYOUTS is wrong
    chunks = n.astype(np.uint8).reshape(-1, 16)
    return np.ascontiguousarray(chunks[:, :8] | (chunks[:, 8:] << 4)).reshape(-1)


def _raw_blocks(tensor: WeightTensor, qtype: GGMLQuantizationType) -> tuple[np.ndarray, int, int]:
    """The tensor's bytes as ``[n_blocks, type_size]`` after gguf-style validation."""
    shape = tuple(int(d) for d in tensor.shape)
    name = qtype.name
    if not shape or min(shape) <= 0:
        raise ModelError(f"tensor {tensor.name!r}: invalid shape {shape}")
    if len(shape) > 2:
        raise ModelError(
            f"tensor {tensor.name!r}: the GPU backend takes vectors and matrices, not a "
            f"{len(shape)}-d tensor of shape {shape}"
        )
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ModelError(
            f"tensor {tensor.name!r}: row length {cols} is not a multiple of the {name} "
            f"block size {block}"
        )
    raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
    need = rows * (cols // block) * type_size
    if raw.nbytes != need:
        raise ModelError(
            f"tensor {tensor.name!r}: {name} of shape {shape} needs {need} bytes, got {raw.nbytes}"
        )
    return raw.reshape(-1, type_size), rows, cols


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(F16).astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int, width: int) -> np.ndarray:
    """Low then high nibbles of ``groups`` runs of ``width`` bytes: ``[n, 2*groups, width]``."""
    q = qs.reshape(qs.shape[0], groups, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(qs.shape[0], 2 * groups, width)


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return raw[:, 2:].view(np.int8), _f16(raw[:, :2]), np.zeros(len(raw), np.float32)


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _nibbles(raw[:, 2:], 1, 16).astype(np.int8) - np.int8(8)
    return q, _f16(raw[:, :2]), np.zeros(len(raw), np.float32)


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = _nibbles(raw[:, 4:], 1, 16).astype(np.int8)
    return q, _f16(raw[:, 0:2]), _f16(raw[:, 2:4])


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-value sub-block ``d * sc`` and ``-(dmin * m)`` in float32."""
    d, dmin = _f16(raw[:, 0:2]), _f16(raw[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(raw[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, offset = _k_scales(raw)
    q = _nibbles(raw[:, 16:144], 4, 32).astype(np.int8)
    return q, scale, offset


def _q5_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, offset = _k_scales(raw)
    low = _nibbles(raw[:, 48:176], 4, 32)
    qh = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (low | ((qh & 0x01) << 4)).astype(np.int8)
    return q, scale, offset


def _q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(raw)
    ql = _nibbles(raw[:, :128], 2, 64).reshape(n, 8, 32)
    qh = raw[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
        1, 1, 4, 1
    )
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(raw[:, 208:210]) * raw[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, np.zeros_like(scale)


#: The layout of each quantized type when compact (its codes' range and its file's scales).
LAYOUTS = {
    T.Q8_0: Q_HALF | Q_ONE,
    T.Q4_0: Q_NIB | Q_NIB8 | Q_HALF | Q_ONE,
    T.Q4_1: Q_NIB | Q_HALF,
    T.Q4_K: Q_NIB,
    T.Q5_K: 0,
    T.Q6_K: Q_ONE,
}

_QUANT = {
    T.Q8_0: (_q8_0, 5),
    T.Q4_0: (_q4_0, 5),
    T.Q4_1: (_q4_1, 5),
    T.Q4_K: (_q4_k, 5),
    T.Q5_K: (_q5_k, 5),
    T.Q6_K: (_q6_k, 4),
}


def check_type(tensor: WeightTensor) -> GGMLQuantizationType:
    """The tensor's GGML type, or ModelError naming it when vt cannot run it."""
    name = ggml_type_name(tensor.ggml_type)
    if name.startswith("type ") or T(tensor.ggml_type) not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelError(
            f"tensor {tensor.name!r}: GGML tensor type {name} is not supported "
            f"(supported: {supported})"
        )
    return T(tensor.ggml_type)


def _stored_scales(scale: np.ndarray, offset: np.ndarray, layout: int) -> np.ndarray:
    """The (scale, offset) pairs as ``layout`` stores them; AssertionError if that would
    change a value (a vt bug: LAYOUTS promises the file's scales fit)."""
    pairs = scale.reshape(-1, 1) if layout & Q_ONE else np.stack([scale, offset], axis=1)
    if layout & Q_ONE and np.any(offset):
        raise AssertionError("a Q_ONE layout with nonzero offsets")
    if layout & Q_HALF:
        half = pairs.astype(F16)
        if not np.array_equal(half.astype(np.float32), pairs, equal_nan=True):
            raise AssertionError("scales that are not IEEE half values")
        pairs = half.view(np.uint16)
    out = pairs.reshape(-1) if layout & Q_ONE else pairs
    return np.ascontiguousarray(out)


def pack(
    tensor: WeightTensor, compact: bool = True, layouts: Mapping[str, int] | None = None
) -> PackedWeight:
    """``tensor`` in a kernel weight format. Vectors (norms, biases) become float32.
    Quantized types take their ``LAYOUTS`` entry, or the wide layout where not ``compact``;
    ``layouts`` (type name -> flags, a benchmark's variant) overrides the entry of a type."""
    qtype = check_type(tensor)
    if len(tensor.shape) == 1:
        values = dequantize(tensor)
        return PackedWeight(WT_F32, 1, values.shape[0], np.ascontiguousarray(values))
    raw, rows, cols = _raw_blocks(tensor, qtype)
    if qtype == T.F32:
        return PackedWeight(WT_F32, rows, cols, raw.reshape(-1).view(np.float32).copy())
    if qtype in (T.F16, T.BF16):
        kind = WT_F16 if qtype == T.F16 else WT_BF16
        return PackedWeight(kind, rows, cols, raw.reshape(-1).view(np.uint16).copy())
    unpack, lg_block = _QUANT[qtype]
    q, scale, offset = unpack(raw)
    codes = np.ascontiguousarray(q.reshape(-1))
    blocks = scale.size
    if codes.size != rows * cols or blocks != math.ceil(codes.size / (1 << lg_block)):
        raise AssertionError(f"{qtype.name} repacking produced the wrong sizes")  # a vt bug
    layout = _check_layouts(layouts).get(qtype.name, LAYOUTS[qtype]) if compact else 0
    scale = scale.reshape(-1).astype(np.float32)
    offset = offset.reshape(-1).astype(np.float32)
    try:
        scales = _stored_scales(scale, offset, layout)
        data = _nibbles_of(codes, layout) if layout & Q_NIB else codes
    except AssertionError as exc:
        if layout == LAYOUTS[qtype]:
            raise  # a vt bug: LAYOUTS is wrong
        raise ValueError(
            f"tensor {tensor.name!r}: layout {layout:#x} cannot hold {qtype.name}'s values ({exc})"
        ) from None
    return PackedWeight(WT_Q, rows, cols, data, scales, lg_block, layout)


def _check_layouts(layouts: Mapping[str, int] | None) -> Mapping[str, int]:
    """``layouts`` (overrides of ``LAYOUTS`` by type name), or ValueError naming an unknown
    type or flags outside Q_NIB | Q_NIB8 | Q_HALF | Q_ONE."""
    if not layouts:
        return {}
    names = {t.name for t in LAYOUTS}
    for name, flags in layouts.items():
        if name not in names:
            raise ValueError(
                f"layout override for {name!r}: not a quantized type vt packs "
                f"({', '.join(sorted(names))})"
            )
        if flags & ~Q_FLAGS or flags < 0:
            raise ValueError(f"layout override for {name}: flags {flags:#x} are not Q_* flags")
    return layouts
