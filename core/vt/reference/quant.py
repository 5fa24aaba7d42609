"""Dequantization of GGUF tensors to float32, through the ``gguf`` package."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ..errors import ModelError
from ..protocol.handles import WeightTensor

#: The GGML tensor types vt runs; anything else is refused by name.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


def ggml_type_name(ggml_type: int) -> str:
    """The GGML name of a type id (``"Q4_1"``), or ``"type 99"`` when unknown."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def dequantize(tensor: WeightTensor) -> np.ndarray:
    """``tensor`` as a float32 array of ``tensor.shape``.

    Raises :class:`vt.ModelError` naming the tensor for an unsupported type, a row length
    that is not a whole number of blocks, or a byte count that does not match the shape.
    """
    name = ggml_type_name(tensor.ggml_type)
    if name.startswith("type ") or GGMLQuantizationType(tensor.ggml_type) not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelError(
            f"tensor {tensor.name!r}: GGML tensor type {name} is not supported "
            f"(supported: {supported})"
        )
    qtype = GGMLQuantizationType(tensor.ggml_type)
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or min(shape) <= 0:
        raise ModelError(f"tensor {tensor.name!r}: invalid shape {shape}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ModelError(
            f"tensor {tensor.name!r}: row length {shape[-1]} is not a multiple of the "
            f"{name} block size {block}"
        )
    row_bytes = shape[-1] // block * type_size
    n_rows = math.prod(shape[:-1])
    raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
    if raw.nbytes != n_rows * row_bytes:
        raise ModelError(
            f"tensor {tensor.name!r}: {name} of shape {shape} needs {n_rows * row_bytes} "
            f"bytes, got {raw.nbytes}"
        )
    out = quants.dequantize(raw.reshape(n_rows, row_bytes), qtype)
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)
