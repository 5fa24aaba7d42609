"""GGUF tensors in the kernels' weight formats, prepared on the host at upload.

Float types stay as they are (F32, F16, BF16 bits). Every quantized type vt reads becomes
one format the kernels dequantize on the fly: int8 codes ``q`` per value plus a float32
``(scale, offset)`` pair per block of 32 values (16 for Q6_K), with
``value = scale * q + offset`` rounded in two steps. The scales are computed here in float32
exactly as gguf's dequantization computes them (``d * sc`` for K-quants), so the kernels'
dequantization equals ``vt.reference.dequantize`` bit for bit. That costs 1.25 bytes per
value (a Q4 file's 0.56 doubles; still a quarter of float32) and keeps one matmul kernel
for every quantized type.
"""

from __future__ import annotations

import math
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

T = GGMLQuantizationType
F16 = np.dtype("<f2")


@dataclass(eq=False)
class PackedWeight:
    """A weight ready to copy to the device: ``data`` then, for WT_Q, ``scales``."""

    kind: int
    rows: int
    cols: int
    data: np.ndarray  # float32, uint16 (f16/bf16 bits) or int8 codes; C-contiguous
    scales: np.ndarray | None = None  # float32 [n_blocks, 2]: (scale, offset)
    lg_block: int = 0  # log2 of the values per (scale, offset) pair

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
            block = 1 << self.lg_block
            q = self.data.reshape(-1, block).astype(np.float32)
            out = q * self.scales[:, :1] + self.scales[:, 1:]
        return out.reshape(self.rows, self.cols)


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


def pack(tensor: WeightTensor) -> PackedWeight:
    """``tensor`` in a kernel weight format. Vectors (norms, biases) become float32."""
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
    scales = np.stack([scale.reshape(-1), offset.reshape(-1)], axis=1).astype(np.float32)
    codes = np.ascontiguousarray(q.reshape(-1))
    if codes.size != rows * cols or scales.shape[0] != math.ceil(codes.size / (1 << lg_block)):
        raise AssertionError(f"{qtype.name} repacking produced the wrong sizes")  # a vt bug
    return PackedWeight(WT_Q, rows, cols, codes, np.ascontiguousarray(scales), lg_block)
