"""Write a random-weight GGUF with a real model's shapes, for benchmarks without the model.

    python benchmarks/write_llama_shape.py OUT.gguf --shape 1b --weight-type Q8_0
    python benchmarks/write_llama_shape.py OUT.gguf --shape 1b --weight-type Q4_K
    python benchmarks/write_llama_shape.py OUT.gguf --shape 3b --weight-type Q4_K

Shapes (architecture ``llama``, tied embedding like the originals):

- ``1b``: Llama-3.2-1B: 16 layers, dim 2048, ffn 8192, 32 heads, 8 KV heads (head dim 64),
  vocab 128256, rope base 500000.
- ``3b``: Llama-3.2-3B: 28 layers, dim 3072, ffn 8192, 24 heads, 8 KV heads (head dim 128),
  vocab 128256, rope base 500000.
- ``135m``: SmolLM2-135M: 30 layers, dim 576, ffn 1536, 9 heads, 3 KV heads, vocab 49152.

The projections are ``--weight-type``; the embedding (also the output matrix) is
``--embd-type`` (Q8_0 by default). The context length written is ``--context-length``
(8192 by default, not the originals' 131072, so that nothing sizes a KV cache for 128k
positions; no llama3 rope scaling either: the weights are random, only the cost matters).

Quantization: ``gguf.quants.quantize`` where it can (Q8_0, Q4_0, Q4_1, ...). The installed
``gguf`` (0.19) raises NotImplementedError for the K-quants, so Q4_K is encoded here (a
simple, not an optimal, encoder: per 32-value sub-block min/max scales against f16 super
scales) and checked block by block against ``gguf.quants.dequantize`` on the first rows.

The vocabulary is byte-level BPE: 3 ChatML specials, the 256 GPT-2 byte tokens, a few
merges, then filler tokens that no merge produces, so both vt's and llama.cpp's tokenizers
load it and the tensor shapes are the real ones. Tensors are generated, quantized and
written one at a time (rows in chunks), so memory stays around one quantized tensor plus
one float chunk; the weights are seeded, so the same arguments write the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

SHAPES: dict[str, dict[str, float | int]] = {
    "1b": {  # Llama-3.2-1B
        "n_layers": 16,
        "dim": 2048,
        "ffn": 8192,
        "n_heads": 32,
        "n_kv_heads": 8,
        "vocab": 128256,
        "rope_base": 500000.0,
    },
    "3b": {  # Llama-3.2-3B
        "n_layers": 28,
        "dim": 3072,
        "ffn": 8192,
        "n_heads": 24,
        "n_kv_heads": 8,
        "vocab": 128256,
        "rope_base": 500000.0,
    },
    "135m": {  # SmolLM2-135M
        "n_layers": 30,
        "dim": 576,
        "ffn": 1536,
        "n_heads": 9,
        "n_kv_heads": 3,
        "vocab": 49152,
        "rope_base": 100000.0,
    },
}

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FILE_TYPES = {  # general.file_type, which llama.cpp prints as the model's type
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32,
    GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
    GGMLQuantizationType.Q5_K: LlamaFileType.MOSTLY_Q5_K_S,
    GGMLQuantizationType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
}
CHUNK_VALUES = 1 << 24  # float32 values generated per chunk (64 MiB)


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)``: specials, bytes, a few merges, fillers."""
    tokens = list(SPECIALS) + byte_alphabet()
    types = [3] * len(SPECIALS) + [1] * 256
    merges = []
    for a, b in (("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "s")):
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(1)
    tokens += [f"<filler{i}>" for i in range(size - len(tokens))]
    types += [1] * (size - len(types))
    return tokens, types, merges


# --------------------------------------------------------------------------- Q4_K


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float32 (n, k) with k a multiple of 256 -> Q4_K bytes (n, k / 256 * 144)."""
    n_rows = rows.shape[0]
    sub = rows.reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks of 32 values
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / 15
    d = _f16(scale.max(axis=-1) / 63).astype(np.float32)
    dmin = _f16(-lo.min(axis=-1) / 63).astype(np.float32)
    sc = np.clip(np.ceil(scale / np.where(d > 0, d, 1.0)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1.0)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d[:, None] * sc
    eff_min = dmin[:, None] * mn
    q = np.round((sub + eff_min[..., None]) / np.where(eff_scale > 0, eff_scale, 1.0)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    nb = q.shape[0]
    q = q.reshape(nb, 4, 2, 32)  # sub-blocks 2c and 2c+1 share bytes: low and high nibble
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    scales = np.zeros((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    head = np.stack([_f16(d), _f16(dmin)], axis=1).view(np.uint8).reshape(nb, 4)
    return np.concatenate([head, scales, qs], axis=1).reshape(n_rows, -1)


def quantize_rows(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 rows in ``qtype``: gguf.quants where it can, this file's Q4_K where not."""
    if qtype == GGMLQuantizationType.F32:
        return values
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    try:
        return quantize(values, qtype)
    except NotImplementedError:
        if qtype == GGMLQuantizationType.Q4_K:
            return quantize_q4_k(values)
        raise SystemExit(
            f"gguf {qtype.name}: gguf.quants cannot quantize it and this script has no encoder"
        ) from None


def check_encoder(qtype: GGMLQuantizationType, rng: np.random.Generator) -> float:
    """Round trip a few rows through gguf.quants.dequantize: the worst relative error."""
    x = rng.standard_normal((4, 1024), dtype=np.float32)
    back = dequantize(quantize_rows(x, qtype), qtype).reshape(x.shape)
    err = float(np.abs(back - x).max() / np.abs(x).max())
    if err > 0.15:
        raise SystemExit(f"{qtype.name} encoder round trip error {err:.3f}: refusing to write")
    return err


# --------------------------------------------------------------------------- the writer


def tensor_plan(shape: dict, wtype: GGMLQuantizationType, etype: GGMLQuantizationType) -> list:
    """``(name, rows, cols, type, kind)`` in file order; kind is ``mat``, ``embd`` or ``norm``."""
    dim, ffn = int(shape["dim"]), int(shape["ffn"])
    head_dim = dim // int(shape["n_heads"])
    kv_dim = int(shape["n_kv_heads"]) * head_dim
    f32 = GGMLQuantizationType.F32
    plan = [("token_embd.weight", int(shape["vocab"]), dim, etype, "embd")]
    for i in range(int(shape["n_layers"])):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", 1, dim, f32, "norm"),
            (p + "attn_q.weight", dim, dim, wtype, "mat"),
            (p + "attn_k.weight", kv_dim, dim, wtype, "mat"),
            (p + "attn_v.weight", kv_dim, dim, wtype, "mat"),
            (p + "attn_output.weight", dim, dim, wtype, "mat"),
            (p + "ffn_norm.weight", 1, dim, f32, "norm"),
            (p + "ffn_gate.weight", ffn, dim, wtype, "mat"),
            (p + "ffn_up.weight", ffn, dim, wtype, "mat"),
            (p + "ffn_down.weight", dim, ffn, wtype, "mat"),
        ]
    plan.append(("output_norm.weight", 1, dim, f32, "norm"))
    return plan


def row_bytes(cols: int, qtype: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise SystemExit(f"{qtype.name} needs rows of a multiple of {block} values, got {cols}")
    return cols // block * size


def write(
    out: Path,
    shape_name: str,
    weight_type: str = "Q8_0",
    embd_type: str = "Q8_0",
    context_length: int = 8192,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    shape = SHAPES[shape_name]
    wtype = GGMLQuantizationType[weight_type.upper()]
    etype = GGMLQuantizationType[embd_type.upper()]
    rng = np.random.default_rng(seed)
    errors = {t.name: check_encoder(t, rng) for t in {wtype, etype}}
    t0 = time.perf_counter()
    dim, n_heads = int(shape["dim"]), int(shape["n_heads"])
    tokens, types, merges = vocabulary(int(shape["vocab"]))

    writer = GGUFWriter(out, "llama")
    writer.add_name(f"random-{shape_name}-{wtype.name}")
    writer.add_block_count(int(shape["n_layers"]))
    writer.add_context_length(context_length)
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(int(shape["ffn"]))
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(int(shape["n_kv_heads"]))
    writer.add_rope_dimension_count(dim // n_heads)
    writer.add_rope_freq_base(float(shape["rope_base"]))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(int(shape["vocab"]))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    writer.add_file_type(FILE_TYPES.get(wtype, LlamaFileType.GUESSED))  # a label only

    plan = tensor_plan(shape, wtype, etype)
    for name, rows, cols, qtype, _ in plan:
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            nbytes = rows * row_bytes(cols, qtype)
            writer.add_tensor_info(
                name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    n_params, shown = 0, 0.0
    for i, (_, rows, cols, qtype, kind) in enumerate(plan):
        n_params += rows * cols
        if kind == "norm":
            writer.write_tensor_data((1.0 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
            continue
        std = (4.0 if kind == "embd" else 1.0) / np.sqrt(cols)
        chunk_rows = max(1, CHUNK_VALUES // cols)
        parts = []
        for r in range(0, rows, chunk_rows):
            x = rng.standard_normal((min(chunk_rows, rows - r), cols), dtype=np.float32)
            x *= np.float32(std)
            parts.append(quantize_rows(x, qtype))
        data = np.concatenate(parts) if len(parts) > 1 else parts[0]
        writer.write_tensor_data(data)
        if progress and (time.perf_counter() - shown > 2 or i + 1 == len(plan)):
            shown = time.perf_counter()
            print(
                f"\r{i + 1}/{len(plan)} tensors, {shown - t0:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
    writer.close()
    if progress:
        print(file=sys.stderr)
    return {
        "path": str(out),
        "shape": shape_name,
        **shape,
        "weight_type": wtype.name,
        "embd_type": etype.name,
        "context_length": context_length,
        "params": n_params,
        "file_bytes": out.stat().st_size,
        "encoder_roundtrip_max_rel_error": {k: round(v, 4) for k, v in errors.items()},
        "write_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--weight-type", default="Q8_0", help="projections (default Q8_0)")
    ap.add_argument("--embd-type", default="Q8_0", help="token embedding / output (Q8_0)")
    ap.add_argument("--context-length", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    info = write(
        args.out, args.shape, args.weight_type, args.embd_type, args.context_length, args.seed
    )
    print(json.dumps(info))


if __name__ == "__main__":
    main()
