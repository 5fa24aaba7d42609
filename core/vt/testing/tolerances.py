"""How close a backend's results must be to ``vt.reference``: normalized MSE bounds.

``nmse(got, want) = sum((got - want)**2) / sum(want**2)``, in float64. A bound of 0 means
bit-exact. The bounds leave room for what real devices legitimately do differently from
numpy (another summation order, fused multiply-add, ``rsqrt``/``exp`` approximations, TF32
or 8-bit activations in quantized dot products as llama.cpp does), and stay orders of
magnitude below what an off-by-one or a wrong index produces (1e-4 and up).
"""

from __future__ import annotations

import numpy as np

#: Weight types the ops with weight matrices take (``embedding``, ``matmul``, ``matmul_add``,
#: ``swiglu``, ``qkv`` and the fused ops over them) and ``upload_weight`` stores.
WEIGHT_TYPES: tuple[str, ...] = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
FLOAT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16")

#: ``op (or core method) -> {dtype or "*": bound}``. Ops on activations only use ``"F32"``.
KERNEL_NMSE: dict[str, dict[str, float]] = {
    # Dequantizing a float type is exact; a quantized block is scale * q (+ min), where an
    # FMA or another operation order may differ by an ulp.
    "upload_weight": {"F32": 0.0, "F16": 0.0, "BF16": 0.0, "*": 1e-12},
    "embedding": {"F32": 0.0, "F16": 0.0, "BF16": 0.0, "*": 1e-12},
    # F32 allows TF32-class accumulation; F16/BF16 allow activations in that type; quantized
    # types allow 8-bit activation quantization.
    "matmul": {"F32": 1e-6, "F16": 1e-5, "BF16": 1e-5, "*": 1e-3},
    # A projection with the residual add in its epilogue: the matmul's error, relative to a
    # result that the residual only makes larger.
    "matmul_add": {"F32": 1e-6, "F16": 1e-5, "BF16": 1e-5, "*": 1e-3},
    # silu(x @ gate.T) * (x @ up.T): the product of two projections, each with matmul's
    # error, so their relative errors add.
    "swiglu": {"F32": 2e-6, "F16": 2e-5, "BF16": 2e-5, "*": 2e-3},
    # Three projections of one input (one matmul each): matmul's bounds.
    "qkv": {"F32": 1e-6, "F16": 1e-5, "BF16": 1e-5, "*": 1e-3},
    "rms_norm": {"*": 1e-9},
    # theta = position * inv_freq in float32 loses ~position * 2**-24 radians.
    "rope": {"*": 1e-6},
    "attention": {"*": 1e-7},
    # attention's result whatever the bound (a bound picks kernels, not another answer)
    "attention_bounded": {"*": 1e-7},
    "silu_mul": {"*": 1e-9},
    "add": {"*": 0.0},
    "gather_rows": {"*": 0.0},
    "kv_store": {"*": 0.0},
    # rope's bound for q, k and the K plane of the cache (the V plane is checked as kv_store)
    "rope_kv_store": {"*": 1e-6},
    # qkv's projections, then a rotation (rope's 1e-6 adds to them): q, k, v and the cache
    "qkv_rope_kv_store": {"F32": 2e-6, "F16": 1.1e-5, "BF16": 1.1e-5, "*": 1.001e-3},
    # the same of a normalised x (rms_norm's 1e-9 adds to them)
    "rms_norm_qkv_rope_kv_store": {"F32": 2e-6, "F16": 1.1e-5, "BF16": 1.1e-5, "*": 1.001e-3},
    "rms_norm_swiglu": {"F32": 2e-6, "F16": 2e-5, "BF16": 2e-5, "*": 2e-3},
    # out is matmul_add's; normed = rms_norm(out) keeps out's relative error (rms_norm's 1e-9
    # adds to it), so matmul_add's bounds, not rms_norm_swiglu's (two projections' errors)
    "matmul_add_rms_norm": {"F32": 1e-6, "F16": 1e-5, "BF16": 1e-5, "*": 1e-3},
    # out is matmul_add's; what follows the norm has the op after it's bounds, which
    # rms_norm_swiglu's and rms_norm_qkv_rope_kv_store's already allow (the projection's
    # error in out reaches them through the norm, relative, as rms_norm's does)
    "matmul_add_rms_norm_swiglu": {"F32": 2e-6, "F16": 2e-5, "BF16": 2e-5, "*": 2e-3},
    "matmul_add_rms_norm_qkv_rope_kv_store": {
        "F32": 2e-6,
        "F16": 1.1e-5,
        "BF16": 1.1e-5,
        "*": 1.001e-3,
    },
    "copy_d2d": {"*": 0.0},
    "sample": {"*": 0.0},  # ids: greedy exact, seeded draws equal to vt.reference.sample
    # ids exact (the order is by the float32 logit, then the id). Values: float64
    # accumulation in any order, rounded to float32, equals the reference bit for bit on the
    # kit's cases (an ulp flipped on one value of 60 is ~6e-17); float32 accumulation gives
    # 2e-16 to 4e-15 there, so the bound asks for float64.
    "logprobs": {"I32": 0.0, "*": 1e-16},
}

#: End-to-end logits of a tiny model against the float64 numpy forward, by weight type.
MODEL_NMSE: dict[str, float] = {"F32": 1e-5, "F16": 1e-5, "BF16": 1e-5, "*": 2e-3}


def kernel_tolerance(op: str, dtype: str) -> float:
    """The normalized-MSE bound for ``op`` (or a core method) on ``dtype``."""
    table = KERNEL_NMSE[op]
    return table.get(dtype, table.get("*", 0.0))


def model_tolerance(weight_type: str) -> float:
    return MODEL_NMSE.get(weight_type, MODEL_NMSE["*"])


def nmse(got: np.ndarray, want: np.ndarray) -> float:
    """Normalized mean squared error (plain MSE when ``want`` is all zeros)."""
    g = np.asarray(got, dtype=np.float64).reshape(-1)
    w = np.asarray(want, dtype=np.float64).reshape(-1)
    err = float(np.sum((g - w) ** 2))
    ref = float(np.sum(w * w))
    return err / ref if ref > 0 else err / max(1, w.size)
