"""Write a random-weight GGUF of a real model's shapes, fast, for benchmarks on a device.

    python plugins/cuda/tools/write_shape.py OUT.gguf --shape 135m --weight-type Q4_1
    python plugins/cuda/tools/write_shape.py OUT.gguf --shape 1b --weight-type Q8_0
    python plugins/cuda/tools/write_shape.py OUT.gguf --shape 1b --weight-type Q4_K_M

Shapes (architecture ``llama``, tied Q8_0 embedding): ``135m`` is SmolLM2-135M (30 layers,
dim 576, ffn 1536, 9/3 heads, vocab 49152), ``1b`` Llama-3.2-1B (16 layers, dim 2048, ffn
8192, 32/8 heads, vocab 128256). The blocks are random bytes with their scales set so that
each weight has about unit variance over the row (``1/sqrt(cols)`` per value): no float
matrix is made and nothing is quantized, so the 1B file (1.3 GB) takes seconds. Only the
cost of running it is real. ``Q4_K_M`` is llama.cpp's mix of that name for llama models:
Q4_K projections, Q6_K for ``attn_v`` and ``ffn_down`` in the layers llama.cpp gives more
bits (the first and last eighth, every third between), and a Q6_K embedding (tied: also
the output matrix). The tokenizer is :func:`vt.testing.tiny.tiny_vocab`'s, padded
with filler tokens to the vocabulary size (as ``write_smollm2_shape.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from vt.testing import tiny

T = GGMLQuantizationType
SHAPES: dict[str, dict[str, int | float]] = {
    "135m": {"n_layers": 30, "dim": 576, "ffn": 1536, "n_heads": 9, "n_kv_heads": 3,
             "vocab": 49152, "context_length": 8192, "rope_base": 100000.0},
    "1b": {"n_layers": 16, "dim": 2048, "ffn": 8192, "n_heads": 32, "n_kv_heads": 8,
           "vocab": 128256, "context_length": 8192, "rope_base": 500000.0},
}  # fmt: skip
_STD = {T.Q8_0: 73.6, T.Q4_0: 4.6, T.Q4_1: 4.6}  # std of a uniform random code
#: K-quants: a uniform code times a random 6-bit (Q4_K) or int8 (Q6_K) sub-block scale.
_STD_K = {T.Q4_K: 4.6 * 36.4, T.Q6_K: 18.5 * 73.6}
MIXES = ("Q4_K_M",)


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v / ffn_down Q4_K_M keeps Q6_K."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def layer_type(weight_type: str, name: str, layer: int, n_layers: int) -> T:
    """The type of projection ``name`` of ``layer`` (a mix picks per tensor)."""
    if weight_type != "Q4_K_M":
        return T[weight_type]
    more = name in ("attn_v", "ffn_down") and _more_bits(layer, n_layers)
    return T.Q6_K if more else T.Q4_K


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: T, gain: float = 1.0):
    """``rows x cols`` values of ``qtype`` as raw bytes ``[rows, cols / block * size]``."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    raw = np.frombuffer(rng.bytes(n * size), np.uint8).reshape(n, size).copy()
    if qtype in _STD_K:
        d = np.float16(gain / (_STD_K[qtype] * np.sqrt(cols)))
        if qtype == T.Q4_K:  # [d, dmin, 12 bytes of 6-bit scales/mins, 128 of nibbles]
            raw[:, 0:2] = np.full((n, 1), d, np.float16).view(np.uint8)
            # value = d sc q - dmin m: about centred with mean sc = mean m, mean q = 7.5
            raw[:, 2:4] = np.full((n, 1), np.float16(7.5 * float(d)), np.float16).view(np.uint8)
        else:  # Q6_K: [ql 128, qh 64, int8 scales 16, d]
            raw[:, 208:210] = np.full((n, 1), d, np.float16).view(np.uint8)
        return raw.reshape(rows, cols // block * size)
    d = np.float16(gain / (_STD[qtype] * np.sqrt(cols)))
    raw[:, 0:2] = np.full((n, 1), d, np.float16).view(np.uint8)
    if qtype == T.Q4_1:  # value = d * q + m with q in 0..15: centre it
        raw[:, 2:4] = np.full((n, 1), np.float16(-7.5 * float(d)), np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def write(path: Path, shape: str, weight_type: str, seed: int = 0) -> Path:
    c = SHAPES[shape]
    etype = T.Q6_K if weight_type == "Q4_K_M" else T.Q8_0
    dim, ffn, vocab = int(c["dim"]), int(c["ffn"]), int(c["vocab"])
    head_dim = dim // int(c["n_heads"])
    q_dim, kv_dim = dim, int(c["n_kv_heads"]) * head_dim
    rng = np.random.default_rng(seed)
    learnt = tiny.tiny_vocab(300)
    tokens = learnt[0] + [f"<filler{i}>" for i in range(vocab - len(learnt[0]))]
    types = learnt[1] + [1] * (vocab - len(learnt[1]))
    w = GGUFWriter(path, "llama")
    kv = {
        "general.name": (f"{shape}-shape-{weight_type}", GGUFValueType.STRING),
        "llama.block_count": (int(c["n_layers"]), GGUFValueType.UINT32),
        "llama.context_length": (int(c["context_length"]), GGUFValueType.UINT32),
        "llama.embedding_length": (dim, GGUFValueType.UINT32),
        "llama.feed_forward_length": (ffn, GGUFValueType.UINT32),
        "llama.attention.head_count": (int(c["n_heads"]), GGUFValueType.UINT32),
        "llama.attention.head_count_kv": (int(c["n_kv_heads"]), GGUFValueType.UINT32),
        "llama.rope.freq_base": (float(c["rope_base"]), GGUFValueType.FLOAT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, GGUFValueType.FLOAT32),
        "llama.vocab_size": (vocab, GGUFValueType.UINT32),
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING),
        "tokenizer.ggml.pre": ("smollm", GGUFValueType.STRING),
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32),
        "tokenizer.ggml.padding_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL),
        "tokenizer.chat_template": (tiny.CHATML_TEMPLATE, GGUFValueType.STRING),
    }
    for key, (value, vtype) in kv.items():
        w.add_key_value(key, value, vtype)
    w.add_key_value("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", types, GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.merges", learnt[2], GGUFValueType.ARRAY, GGUFValueType.STRING)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w.add_tensor("token_embd.weight", random_blocks(rng, vocab, dim, etype, 4.0), raw_dtype=etype)
    n_layers = int(c["n_layers"])
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(dim))
        for name, rows, cols in (("attn_q", q_dim, dim), ("attn_k", kv_dim, dim),
                                 ("attn_v", kv_dim, dim), ("attn_output", dim, q_dim),
                                 ("ffn_gate", ffn, dim), ("ffn_up", ffn, dim),
                                 ("ffn_down", dim, ffn)):  # fmt: skip
            wtype = layer_type(weight_type, name, i, n_layers)
            w.add_tensor(p + name + ".weight", random_blocks(rng, rows, cols, wtype),
                         raw_dtype=wtype)  # fmt: skip
        w.add_tensor(p + "ffn_norm.weight", norm(dim))
    w.add_tensor("output_norm.weight", norm(dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    types = [t.name for t in (*_STD, *_STD_K)] + list(MIXES)
    ap.add_argument("--weight-type", choices=types, default="Q4_1")
    a = ap.parse_args()
    t0 = time.perf_counter()
    write(a.out, a.shape, a.weight_type)
    size = a.out.stat().st_size / 1e9
    print(f"{a.out}: {a.shape} {a.weight_type}, {size:.2f} GB in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
