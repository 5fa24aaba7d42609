"""Write tiny, valid GGUF models for tests: random weights, a real byte-level BPE vocabulary.

``write_tiny_gguf(path)`` gives a 2-layer llama-family model that :func:`vt.model.load_gguf`,
:class:`vt.model.Tokenizer` and :class:`vt.model.ChatTemplate` accept, in any supported
tensor type. Weights are seeded, so two calls with the same arguments write the same file.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

QK_K = 256

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Text the tiny vocabulary's merges are learnt from (so common words become single tokens).
_CORPUS = (
    "The capital of France is Paris. Hello world! The quick brown fox jumps over the lazy dog. "
    "the the the and and of of to in is it that this with for on as are was be at by an "
    "hello there, how are you today? I am fine, thank you. What is the answer? The answer is 42."
)

_GPT2_PRINTABLE = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
)


def _byte_alphabet() -> list[str]:
    """GPT-2's mapping of the 256 bytes to printable characters, in byte order."""
    table = {b: b for b in _GPT2_PRINTABLE}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def tiny_vocab(vocab: int = 300) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)``: 3 specials, 256 bytes, then learnt merges."""
    n_merges = vocab - len(SPECIAL_TOKENS) - 256
    if n_merges < 0:
        raise ValueError(f"vocab must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab}")
    alphabet = _byte_alphabet()
    tokens = list(SPECIAL_TOKENS) + alphabet
    types = [3] * len(SPECIAL_TOKENS) + [1] * 256
    # Words as GPT-2 pre-tokenizes them roughly: a leading space belongs to the word.
    words: Counter[tuple[str, ...]] = Counter()
    for i, w in enumerate(_CORPUS.split(" ")):
        text = ("" if i == 0 else " ") + w
        words[tuple(alphabet[b] for b in text.encode("utf-8"))] += 1
    merges: list[str] = []
    seen = set(tokens)
    while len(tokens) < vocab:
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[a, b] += count
        if not pairs:
            raise ValueError(
                f"the tiny corpus yields fewer than {n_merges} merges: use a smaller vocab"
            )
        # Highest count first, ties broken by the pair itself: deterministic.
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in seen:  # two merges may spell the same token
            tokens.append(merged)
            types.append(1)
            seen.add(merged)
        new_words: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return tokens, types, merges


# --------------------------------------------------------------------------- K-quants
# gguf.quants can read but not write K-quants, so these simple (not optimal) encoders
# write them; gguf.quants.dequantize reads them back in the tests.


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Pack 8 six-bit scales and mins per block into the 12-byte K-quant layout."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _k_scales(x: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block scale/min, quantized to 6 bits against f16 super-scales."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / qmax
    d = _f16(scale.max(axis=-1) / 63).astype(np.float32)
    dmin = _f16(-lo.min(axis=-1) / 63).astype(np.float32)
    safe_d = np.where(d > 0, d, 1.0)[:, None]
    safe_m = np.where(dmin > 0, dmin, 1.0)[:, None]
    sc = np.clip(np.ceil(scale / safe_d), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / safe_m), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * mn
    q = np.round((sub + eff_min[..., None]) / np.where(eff_scale > 0, eff_scale, 1.0)[..., None])
    q = np.clip(q, 0, qmax).astype(np.uint8)
    return d, dmin, sc, mn, q


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_scales(x, 15)
    n = q.shape[0]
    q = q.reshape(n, 4, 2, 32)  # sub-blocks 2c and 2c+1 share bytes: low and high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    head = np.stack([_f16(d), _f16(dmin)], axis=1).view(np.uint8).reshape(n, 4)
    return np.concatenate([head, _pack_k_scales(sc, mn), qs], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_scales(x, 31)
    n = q.shape[0]
    low, high = q & 0x0F, q >> 4  # (n, 8, 32)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j] << j).astype(np.uint8)
    low = low.reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    head = np.stack([_f16(d), _f16(dmin)], axis=1).view(np.uint8).reshape(n, 4)
    return np.concatenate([head, _pack_k_scales(sc, mn), qh, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    n = sub.shape[0]
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31
    d = _f16(scale.max(axis=-1) / 127).astype(np.float32)
    sc = np.clip(np.ceil(scale / np.where(d > 0, d, 1.0)[:, None]), 0, 127).astype(np.int8)
    eff = d[:, None] * sc
    q = np.round(sub / np.where(eff > 0, eff, 1.0)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)  # row r = 32 values
    # Row r = 4h + 2s + k: nibble s of ql[64h + 32k + l]; bits 2t.. of qh[32h + l], t = 2s + k.
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for r in range(8):
        h, rem = divmod(r, 4)
        s, k = divmod(rem, 2)
        lo = ql[:, 64 * h + 32 * k : 64 * h + 32 * k + 32]
        lo |= ((q[:, r] & 0x0F) << (4 * s)).astype(np.uint8)
        hi = qh[:, 32 * h : 32 * h + 32]
        hi |= ((q[:, r] >> 4) << (2 * rem)).astype(np.uint8)
    tail = _f16(d).view(np.uint8).reshape(n, 2)
    return np.concatenate([ql, qh, sc.view(np.uint8), tail], axis=1)


_K_QUANTIZERS = {
    GGMLQuantizationType.Q4_K: _quantize_q4_k,
    GGMLQuantizationType.Q5_K: _quantize_q5_k,
    GGMLQuantizationType.Q6_K: _quantize_q6_k,
}


def quantize_matrix(values: np.ndarray, qtype: GGMLQuantizationType | str) -> np.ndarray:
    """``values`` (rows, cols) float32 in GGML format ``qtype``: raw bytes per row, or F32/F16."""
    qtype = _qtype(qtype)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype in _K_QUANTIZERS:
        if values.shape[-1] % QK_K:
            raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} values")
        rows = values.reshape(-1, values.shape[-1])
        blocks = _K_QUANTIZERS[qtype](rows.reshape(-1, QK_K))
        return blocks.reshape(rows.shape[0], -1)
    return quantize(values, qtype)


def _qtype(name: GGMLQuantizationType | str) -> GGMLQuantizationType:
    if isinstance(name, GGMLQuantizationType):
        return name
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise ValueError(f"unknown GGML type {name!r}") from None


# --------------------------------------------------------------------------- the writer


def write_tiny_gguf(
    path: str | os.PathLike[str],
    arch: str = "llama",
    weight_type: str = "Q8_0",
    tied: bool = True,
    n_layers: int = 2,
    dim: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    vocab: int = 300,
    seed: int = 0,
    *,
    embd_type: str | None = None,
    head_dim: int | None = None,
    context_length: int = 256,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-5,
    chat_template: str | None = CHATML_TEMPLATE,
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    omit_tensors: tuple[str, ...] = (),
) -> Path:
    """Write a tiny model and return its path.

    ``weight_type`` is the type of the projection matrices (and ``output.weight`` when not
    ``tied``); the embedding is ``embd_type`` (default: ``weight_type`` for float types,
    else Q8_0, like SmolLM2). K-quants need ``dim``, ``ffn`` and ``n_heads * head_dim``
    to be multiples of 256. ``arch="qwen2"`` adds Q/K/V biases, ``"qwen3"`` Q/K norms.
    ``metadata`` overrides keys (a value of None deletes the key); ``extra_tensors`` adds
    F32 tensors; ``omit_tensors`` leaves tensors out (for error tests).
    """
    wtype = _qtype(weight_type)
    float_types = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    etype = (
        _qtype(embd_type)
        if embd_type
        else (wtype if wtype in float_types else GGMLQuantizationType.Q8_0)
    )
    head_dim = head_dim or dim // n_heads
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    if wtype in _K_QUANTIZERS:
        bad = {
            k: v for k, v in {"dim": dim, "ffn": ffn, "n_heads*head_dim": q_dim}.items() if v % QK_K
        }
        if bad:
            raise ValueError(
                f"{wtype.name} needs every matrix's input size to be a multiple of {QK_K}, "
                f"but {bad}: pass e.g. dim=256, ffn=256, n_heads=4"
            )
    tokens, types, merges = tiny_vocab(vocab)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
    tensors["token_embd.weight"] = (mat(vocab, dim) * 4, etype)
    for i in range(n_layers):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = (norm(dim), GGMLQuantizationType.F32)
        tensors[p + "attn_q.weight"] = (mat(q_dim, dim), wtype)
        tensors[p + "attn_k.weight"] = (mat(kv_dim, dim), wtype)
        tensors[p + "attn_v.weight"] = (mat(kv_dim, dim), wtype)
        tensors[p + "attn_output.weight"] = (mat(dim, q_dim), wtype)
        if arch == "qwen2":
            for name, n in (
                ("attn_q.bias", q_dim),
                ("attn_k.bias", kv_dim),
                ("attn_v.bias", kv_dim),
            ):
                tensors[p + name] = (
                    (0.1 * rng.standard_normal(n)).astype(np.float32),
                    GGMLQuantizationType.F32,
                )
        if arch == "qwen3":
            tensors[p + "attn_q_norm.weight"] = (norm(head_dim), GGMLQuantizationType.F32)
            tensors[p + "attn_k_norm.weight"] = (norm(head_dim), GGMLQuantizationType.F32)
        tensors[p + "ffn_norm.weight"] = (norm(dim), GGMLQuantizationType.F32)
        tensors[p + "ffn_gate.weight"] = (mat(ffn, dim), wtype)
        tensors[p + "ffn_up.weight"] = (mat(ffn, dim), wtype)
        tensors[p + "ffn_down.weight"] = (mat(dim, ffn), wtype)
    tensors["output_norm.weight"] = (norm(dim), GGMLQuantizationType.F32)
    if not tied:
        tensors["output.weight"] = (mat(vocab, dim), wtype)
    for name, value in (extra_tensors or {}).items():
        tensors[name] = (np.asarray(value, dtype=np.float32), GGMLQuantizationType.F32)

    kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {
        "general.architecture": (arch, GGUFValueType.STRING, None),
        "general.name": (f"tiny-{arch}-{wtype.name}", GGUFValueType.STRING, None),
        f"{arch}.block_count": (n_layers, GGUFValueType.UINT32, None),
        f"{arch}.context_length": (context_length, GGUFValueType.UINT32, None),
        f"{arch}.embedding_length": (dim, GGUFValueType.UINT32, None),
        f"{arch}.feed_forward_length": (ffn, GGUFValueType.UINT32, None),
        f"{arch}.attention.head_count": (n_heads, GGUFValueType.UINT32, None),
        f"{arch}.attention.head_count_kv": (n_kv_heads, GGUFValueType.UINT32, None),
        f"{arch}.rope.freq_base": (rope_base, GGUFValueType.FLOAT32, None),
        f"{arch}.attention.layer_norm_rms_epsilon": (rms_eps, GGUFValueType.FLOAT32, None),
        f"{arch}.vocab_size": (vocab, GGUFValueType.UINT32, None),
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING, None),
        "tokenizer.ggml.pre": (
            "qwen2" if arch.startswith("qwen") else "smollm",
            GGUFValueType.STRING,
            None,
        ),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32, None),
        "tokenizer.ggml.padding_token_id": (2, GGUFValueType.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL, None),
    }
    if head_dim != dim // n_heads:
        kv[f"{arch}.attention.key_length"] = (head_dim, GGUFValueType.UINT32, None)
        kv[f"{arch}.attention.value_length"] = (head_dim, GGUFValueType.UINT32, None)
    if chat_template is not None:
        kv["tokenizer.chat_template"] = (chat_template, GGUFValueType.STRING, None)
    for key, value in (metadata or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = (value, *_value_type(value))

    path = Path(path)
    writer = GGUFWriter(path, arch)
    writer.kv_data[0].clear()  # drop the automatic general.architecture: kv decides
    for key, (value, vtype, sub_type) in kv.items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, (values, qtype) in tensors.items():
        if name in omit_tensors:
            continue
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, values)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, quantize_matrix(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _value_type(value: Any) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32 if value >= 0 else GGUFValueType.INT32, None
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, list) and value:
        return GGUFValueType.ARRAY, _value_type(value[0])[0]
    raise ValueError(f"cannot write metadata value {value!r}")
