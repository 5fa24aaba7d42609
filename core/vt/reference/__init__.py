"""numpy reference kernels: the oracle every backend is compared against.

Pure functions over float32 activations and int32 ids. :class:`HostKernels` runs them
behind the :class:`vt.Backend` protocol for backends whose memory is host numpy arrays.
"""

from __future__ import annotations

from .host import HostKernels
from .kernels import (
    add,
    attention,
    embedding,
    gather_rows,
    kv_store,
    matmul,
    rms_norm,
    rope,
    rope_cos_sin,
    silu_mul,
)
from .quant import SUPPORTED_TYPES, dequantize, ggml_type_name
from .sampling import sample, splitmix64, uniform

__all__ = [
    "SUPPORTED_TYPES",
    "HostKernels",
    "add",
    "attention",
    "dequantize",
    "embedding",
    "gather_rows",
    "ggml_type_name",
    "kv_store",
    "matmul",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "sample",
    "silu_mul",
    "splitmix64",
    "uniform",
]
