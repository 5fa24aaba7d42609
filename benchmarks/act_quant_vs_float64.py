"""Greedy ids of a float64 forward whose matmul inputs are quantized as the cpu kernels do.

    python benchmarks/act_quant_vs_float64.py [--tokens 16] [--floats] [--json out.json]

The integer decode kernels (``vt_cpu.kernels.q8``) quantize each matmul's activation row
to blocks of 32 values (Q8_0, Q4_0, Q4_1) or 256 (the K-quants: one scale a super-block)
with 8 or 16 bits. Whether a block of 256 keeps the product's promise (greedy ids equal the
exact forward's argmax) depends on the activations, so this runs the default model's
float64 forward (``tests/model_support.py``, the weights dequantized) with every matmul
input rounded to each setting (``scale = amax / qmax`` per block, ``rint``; 576-wide rows
as blocks of 256, 256 and 64), on the oracle fixture's prompts: first the exact forward's
own greedy ids (``--tokens`` a prompt), then each setting's logits over those sequences.
A setting whose argmax equals the exact one at every generated position would generate
the same ids greedily; the smallest exact top-1 margin among the positions where it
differs says how near a tie those were. SmolLM2-135M's widths (576) are not multiples of
256, so no K-quant of this model exists: the run isolates the activations' rounding.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

#: (block, bits): vt_cpu's roundings; bits 15: the GPU gemv kernels' VT_GV_X16 (16-bit codes
#: a block of 16 under a power-of-two scale, at least 15 bits of the block's largest value).
SETTINGS = ((32, 16), (256, 16), (16, 15), (32, 8), (256, 8))


def _pow2_codes(part: np.ndarray) -> np.ndarray:
    """``part`` (float32 blocks, last axis) rounded as ``vt_x16`` (kernels/matmul_gemv.cu)
    rounds 16 values: ``m`` the power of two 2^(141 - e), ``e`` the biased exponent of the
    largest ``|x|`` bumped within 2^-15 of the next, clamped to [15, 254]; ``rint(x m) / m``."""
    bits = np.abs(part).view(np.uint32).max(axis=-1, keepdims=True)
    e = np.clip((bits + np.uint32(0x100)) >> np.uint32(23), 15, 254).astype(np.int64)
    m = np.ldexp(np.float32(1), 141 - e).astype(np.float32)
    return np.rint(part * m) / m


def quantize(x: np.ndarray, block: int, bits: int) -> np.ndarray:
    """``x`` (rows of float64) rounded as the kernels round a float32 row: per block of
    ``block`` values, ``d = amax / qmax``, ``q = rint(x / d)``, back to ``q d`` (bits 15:
    :func:`_pow2_codes`)."""
    qmax = 127.0 if bits == 8 else 32767.0
    x32 = x.astype(np.float32)
    out = np.empty_like(x32)
    for b0 in range(0, x.shape[-1], block):
        part = x32[..., b0 : b0 + block]
        if bits == 15:
            out[..., b0 : b0 + block] = _pow2_codes(part)
            continue
        amax = np.abs(part).max(axis=-1, keepdims=True)
        d = amax / np.float32(qmax)
        inv = np.where(amax > 0, np.float32(qmax) / np.where(amax > 0, amax, 1), 0)
        out[..., b0 : b0 + block] = np.rint(part * inv.astype(np.float32)) * d
    return out.astype(np.float64)


#: The GPU BLAS path's inputs (GpuBackend.blas_inputs): x and the weight's copy both
#: rounded to TF32 (float32 less 13 mantissa bits, to nearest) or to IEEE half.
FLOATS = ("tf32", "f16")


def round_float(x: np.ndarray, kind: str) -> np.ndarray:
    """``x`` (float64) rounded as the BLAS path feeds the tensor cores: ``kind`` "f16"
    (float32, then half: |x| past 65504 is inf) or "tf32"."""
    x32 = x.astype(np.float32)
    if kind == "f16":
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float64)
    b = x32.view(np.uint32).astype(np.uint64)
    b = ((b + 0x0FFF + ((b >> 13) & 1)) & 0xFFFFE000).astype(np.uint32)
    return b.view(np.float32).astype(np.float64)


def forward(
    model, tokens: list[int], f64, block: int = 0, bits: int = 0, fl: str = ""
) -> np.ndarray:  # noqa: ANN001
    """``tests/model_support.numpy_forward`` with each matmul's input rounded by
    :func:`quantize` (``block`` 0: exact), or (``fl``) its input and weight by
    :func:`round_float`."""
    from vt import reference as R

    c = model.config
    n, hd = len(tokens), c.head_dim
    group = c.n_heads // c.n_kv_heads
    pos = np.arange(n)

    def mm(x: np.ndarray, name: str) -> np.ndarray:
        if fl:
            return round_float(x, fl) @ _rounded(model, name, fl, f64).T
        return (quantize(x, block, bits) if block else x) @ f64(model, name).T

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_eps) * w

    out_name = "token_embd.weight" if c.tied_output else "output.weight"
    x = f64(model, "token_embd.weight")[np.asarray(tokens)]
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(c.n_layers):
        p = f"blk.{i}."
        h = rms(x, f64(model, p + "attn_norm.weight"))
        q, k, v = mm(h, p + "attn_q.weight"), mm(h, p + "attn_k.weight"), mm(h, p + "attn_v.weight")
        q = R.rope(q, pos, c.n_heads, c.rope).astype(np.float64).reshape(n, c.n_heads, hd)
        k = R.rope(k, pos, c.n_kv_heads, c.rope).astype(np.float64)
        k = np.repeat(k.reshape(n, c.n_kv_heads, hd), group, axis=1)
        v = np.repeat(v.reshape(n, c.n_kv_heads, hd), group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
        scores[:, future] = -np.inf
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        x = x + mm(np.einsum("hij,jhd->ihd", w, v).reshape(n, -1), p + "attn_output.weight")
        h = rms(x, f64(model, p + "ffn_norm.weight"))
        gate, up = mm(h, p + "ffn_gate.weight"), mm(h, p + "ffn_up.weight")
        x = x + mm(gate / (1 + np.exp(-gate)) * up, p + "ffn_down.weight")
    return mm(rms(x, f64(model, "output_norm.weight")), out_name)


@functools.cache
def _rounded(model, name: str, kind: str, f64) -> np.ndarray:  # noqa: ANN001
    return round_float(f64(model, name), kind)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16, help="greedy ids a prompt")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--floats", action="store_true", help="the BLAS path's inputs: x and weights in TF32, f16"
    )
    args = ap.parse_args()

    import model_support
    from vt.model import load_gguf
    from vt.model.cache import resolve_model

    model = load_gguf(resolve_model("default", progress=False))
    f64 = functools.lru_cache(maxsize=None)(model_support._f64)
    if model.config.has_qkv_bias or model.config.has_qk_norm:
        raise SystemExit("the default model changed: this forward has no biases or q/k norms")
    fixture = json.loads((ROOT / "tests" / "fixtures" / "llama_cpp_greedy.json").read_text())
    t0 = time.perf_counter()
    check = fixture["records"][0]["prompt_ids"]
    assert np.allclose(forward(model, check, f64), model_support.numpy_forward(model, check))
    seqs = []
    for rec in fixture["records"]:
        ids = list(rec["prompt_ids"])
        for _ in range(args.tokens):
            ids.append(int(np.argmax(forward(model, ids, f64)[-1])))
        seqs.append((rec["prompt"], len(rec["prompt_ids"]), ids))
    results: dict = {"tokens_per_prompt": args.tokens, "prompts": len(seqs), "settings": {}}
    wanted = [(0, 0, kind) for kind in FLOATS] if args.floats else []
    for block, bits, fl in wanted or [(block, bits, "") for block, bits in SETTINGS]:
        name = fl or ("16-bit per 16, a power of two" if bits == 15 else f"{bits}-bit per {block}")
        differ, margins, followed = 0, [], 0
        for prompt, n_prompt, ids in seqs:
            want = forward(model, ids[:-1], f64)[n_prompt - 1 :]
            got = forward(model, ids[:-1], f64, block, bits, fl)[n_prompt - 1 :]
            bad = np.nonzero(np.argmax(got, axis=-1) != np.argmax(want, axis=-1))[0]
            differ += len(bad)
            followed += int(len(bad) == 0)
            for i in bad:
                s = np.sort(want[i])
                margins.append(round(float(s[-1] - s[-2]), 5))
            if bad.size:
                print(f"{name}: {prompt!r} parts at generated token {int(bad[0])}", flush=True)
        results["settings"][name] = {
            "prompts_followed_to_the_end": followed,
            "positions_differing": differ,
            "positions": len(seqs) * args.tokens,
            "exact_top1_margins_where_differing": sorted(margins),
        }
        print(name, json.dumps(results["settings"][name]), flush=True)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
