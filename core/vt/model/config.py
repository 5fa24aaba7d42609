"""The model's hyper-parameters, read from GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import ModelError
from ..protocol.backend import RopeParams, RopeStyle
from .string_array import ARRAY_TYPES

#: architecture -> RoPE style (see MODEL_FACTS.md: llama GGUFs are permuted for "normal").
SUPPORTED_ARCHITECTURES: dict[str, RopeStyle] = {
    "llama": RopeStyle.normal,
    "qwen2": RopeStyle.neox,
    "qwen3": RopeStyle.neox,
}
MAX_HEAD_DIM = 1024  # far above any real model; bounds work done before shapes are checked
# RoPE's base: real models use 1e4 .. 1e7; outside these bounds the frequencies overflow or
# vanish in float32 and every position looks alike.
MIN_ROPE_BASE = 1.0
MAX_ROPE_BASE = 1e12
MAX_ROPE_FACTOR = 1e4


class ModelConfig(BaseModel):
    """What the runner needs to build the llama-family graph."""

    model_config = ConfigDict(frozen=True)

    architecture: str
    name: str
    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope: RopeParams
    tied_output: bool
    has_qkv_bias: bool
    has_qk_norm: bool

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class _Meta:
    """Typed access to metadata with errors that name the key."""

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.m, self.arch = metadata, arch

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        full = key.replace("{arch}", self.arch)
        if full not in self.m:
            if required:
                raise ModelError(f"required metadata {full!r} is missing")
            return default
        value = self.m[full]
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ModelError(f"metadata {full!r} must be an integer, got {value!r}")
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
                raise ModelError(f"metadata {full!r} must be a number, got {value!r}")
            if not math.isfinite(float(value)):
                raise ModelError(f"metadata {full!r} must be a finite number, got {value!r}")
            return float(value)
        if not isinstance(value, kind):
            raise ModelError(f"metadata {full!r} must be a {kind.__name__}, got {value!r}")
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.get(key, int, default, required=default is None)
        if value <= 0:
            raise ModelError(
                f"metadata {key.replace('{arch}', self.arch)!r} must be > 0, got {value}"
            )
        return value


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
) -> ModelConfig:
    """Build and check a :class:`ModelConfig`; ``tensor_shapes`` are logical numpy shapes."""
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelError("required metadata 'general.architecture' is missing")
    if not isinstance(arch, str):
        raise ModelError(f"metadata 'general.architecture' must be a string, got {arch!r}"[:200])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    m = _Meta(metadata, arch)
    n_layers = m.positive("{arch}.block_count")
    # Each block has at least 9 tensors; checked here so a corrupt count cannot make the
    # per-layer checks loop for millions of layers.
    if n_layers * 9 > len(tensor_shapes):
        raise ModelError(
            f"{arch}.block_count is {n_layers}, but the file holds only {len(tensor_shapes)} "
            "tensors (at least 9 per block are needed)"
        )
    dim = m.positive("{arch}.embedding_length")
    ffn_dim = m.positive("{arch}.feed_forward_length")
    n_heads = m.positive("{arch}.attention.head_count")
    n_kv_heads = m.positive("{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv_heads:
        raise ModelError(
            f"{arch}.attention.head_count ({n_heads}) is not a multiple of "
            f"head_count_kv ({n_kv_heads})"
        )
    if "{arch}.attention.key_length".replace("{arch}", arch) not in metadata and dim % n_heads:
        raise ModelError(
            f"{arch}.embedding_length ({dim}) is not a multiple of head_count ({n_heads}) "
            f"and {arch}.attention.key_length is missing"
        )
    head_dim = m.positive("{arch}.attention.key_length", dim // n_heads)
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ModelError(
            f"head dimension {head_dim} is not supported (RoPE needs an even size, at most "
            f"{MAX_HEAD_DIM})"
        )
    value_dim = m.positive("{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ModelError(
            f"{arch}.attention.value_length ({value_dim}) differs from key_length ({head_dim}): "
            "not supported"
        )
    rope_dim = m.positive("{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ModelError(
            f"{arch}.rope.dimension_count ({rope_dim}) differs from the head dimension "
            f"({head_dim}): partial RoPE is not supported"
        )
    rms_eps = m.get("{arch}.attention.layer_norm_rms_epsilon", float, required=True)
    if not 0 < rms_eps < 1:
        raise ModelError(
            f"{arch}.attention.layer_norm_rms_epsilon must be in (0, 1), got {rms_eps}"
        )

    if "token_embd.weight" not in tensor_shapes:
        raise ModelError("tensor 'token_embd.weight' is missing")
    embd_rows = tensor_shapes["token_embd.weight"][0]
    vocab_size = m.positive("{arch}.vocab_size", embd_rows)
    if vocab_size != embd_rows:
        raise ModelError(
            f"{arch}.vocab_size ({vocab_size}) disagrees with token_embd.weight's {embd_rows} rows"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ARRAY_TYPES) and len(tokens) > vocab_size:
        raise ModelError(
            f"tokenizer.ggml.tokens has {len(tokens)} tokens, more than the {vocab_size} "
            "rows of token_embd.weight"
        )

    return ModelConfig(
        architecture=arch,
        name=str(metadata.get("general.name") or metadata.get("general.basename") or arch),
        n_layers=n_layers,
        dim=dim,
        ffn_dim=ffn_dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        context_length=m.positive("{arch}.context_length"),
        rms_eps=rms_eps,
        rope=_rope_params(m, head_dim, rope_freqs),
        tied_output="output.weight" not in tensor_shapes,
        has_qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        has_qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
    )


def _rope_params(m: _Meta, head_dim: int, rope_freqs: np.ndarray | None) -> RopeParams:
    base = m.get("{arch}.rope.freq_base", float, 10000.0)
    if not MIN_ROPE_BASE <= base <= MAX_ROPE_BASE:
        raise ModelError(
            f"{m.arch}.rope.freq_base must be between {MIN_ROPE_BASE:g} and {MAX_ROPE_BASE:g}, "
            f"got {base}"
        )
    style = SUPPORTED_ARCHITECTURES[m.arch]
    scaling = m.get("{arch}.rope.scaling.type", str, "none")
    factor = m.get("{arch}.rope.scaling.factor", float, None)
    if factor is None:  # the older key
        factor = m.get("{arch}.rope.scale_linear", float, None)
        if factor is not None and scaling == "none":
            scaling = "linear"
    if factor is not None and not 0 < factor <= MAX_ROPE_FACTOR:
        raise ModelError(
            f"{m.arch}.rope.scaling.factor must be in (0, {MAX_ROPE_FACTOR:g}], got {factor}"
        )

    inv_freq: tuple[float, ...] | None = None
    linear_factor = 1.0
    if scaling == "linear":
        linear_factor = factor or 1.0
    elif scaling == "llama3":
        inv_freq = _llama3_inv_freq(m, head_dim, base, factor or 8.0)
    elif scaling not in ("none", ""):
        raise ModelError(
            f"{m.arch}.rope.scaling.type {scaling!r} is not supported (supported: none, linear, "
            "llama3)"
        )
    if rope_freqs is not None:
        # llama.cpp divides each pair's frequency by rope_freqs (Llama 3.1 GGUFs store it).
        if rope_freqs.shape != (head_dim // 2,):
            raise ModelError(
                f"rope_freqs.weight has shape {rope_freqs.shape}, expected ({head_dim // 2},)"
            )
        if not np.all(np.isfinite(rope_freqs)) or np.any(rope_freqs <= 0):
            raise ModelError("rope_freqs.weight must hold positive finite factors")
        plain = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        inv_freq = tuple(float(x) for x in plain / rope_freqs.astype(np.float64))
    return RopeParams(
        head_dim=head_dim,
        base=base,
        style=style,
        linear_factor=linear_factor,
        inv_freq=inv_freq,
    )


def _llama3_inv_freq(m: _Meta, head_dim: int, base: float, factor: float) -> tuple[float, ...]:
    """Llama 3.1 frequency scaling from metadata (when no rope_freqs tensor is stored)."""
    low = m.get("{arch}.rope.scaling.low_freq_factor", float, 1.0)
    high = m.get("{arch}.rope.scaling.high_freq_factor", float, 4.0)
    original = m.get("{arch}.rope.scaling.original_context_length", int, 8192)
    if not 0 < low < high:
        raise ModelError(
            "rope.scaling.high_freq_factor must exceed low_freq_factor, both > 0, got "
            f"{high} and {low}"
        )
    if original <= 0:
        raise ModelError(f"rope.scaling.original_context_length must be > 0, got {original}")
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for i in range(0, head_dim, 2):
        freq = base ** (-i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return tuple(out)
