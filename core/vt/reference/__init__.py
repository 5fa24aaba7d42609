"""numpy reference kernels: the oracle every backend is compared against.

Pure functions over float32 activations and int32 ids. The mixins :class:`ReferenceOps`
(every op of :data:`vt.protocol.ops.OPS` from these functions) and :class:`HostMemory` (copies over
numpy memory) run them behind the :class:`vt.Backend` protocol.
"""

from __future__ import annotations

from typing import Any

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
    "HostMemory",
    "ReferenceOps",
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


def __getattr__(name: str) -> Any:
    # vt.protocol.ops imports these kernels while vt.protocol.backend is still loading;
    # the mixins, which
    # subclass vt.Backend, load on first use.
    if name in ("HostMemory", "ReferenceOps"):
        from . import host

        return getattr(host, name)
    raise AttributeError(f"module 'vt.reference' has no attribute {name!r}")
