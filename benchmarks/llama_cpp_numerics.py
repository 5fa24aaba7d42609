"""Is a greedy divergence from llama.cpp numerics or a bug? Emulate llama.cpp's CPU numerics.

llama.cpp's CPU path quantizes activations to 8 bits inside quantized dot products
(Q8_1 blocks of 32 against Q4_1 weights, Q8_0 against Q8_0) and keeps the KV cache, Q and the
attention probabilities in float16. vt computes in float32. This script runs a plain numpy
forward of the model from ``vt.reference`` kernels, optionally with those two llama.cpp
numerics, and reports how many of the oracle fixture's greedy ids each variant reproduces.

    python benchmarks/llama_cpp_numerics.py MODEL.gguf [--fixture FIXTURE.json]

Prints one JSON object: per variant, prompts fully matched and tokens matched before the
first divergence.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from vt import reference as ref
from vt.model import load_gguf


def quantize_rows_q8(x: np.ndarray) -> np.ndarray:
    """Round-trip rows through llama.cpp's 8-bit activation blocks (32 values, one scale)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = amax / 127.0
    safe = np.where(d == 0, 1.0, d)
    q = np.sign(blocks / safe) * np.floor(np.abs(blocks / safe) + 0.5)  # roundf: half away
    return (q * d).reshape(x.shape).astype(np.float32)


class Forward:
    def __init__(self, path: str, act_q8: bool, kv_f16: bool) -> None:
        mf = load_gguf(path)
        self.cfg = mf.config
        self.act_q8, self.kv_f16 = act_q8, kv_f16
        self.emb = ref.dequantize(mf.tensor("token_embd.weight"))
        self.out_norm = ref.dequantize(mf.tensor("output_norm.weight"))
        self.out_w = ref.dequantize(mf.output())
        self.layers = []
        for i in range(self.cfg.n_layers):
            lt = mf.layer_tensors(i)
            self.layers.append({k: ref.dequantize(t) for k, t in lt.items()})

    def mm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        if self.act_q8:
            x = quantize_rows_q8(x)
        return x @ w.T

    def greedy(self, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
        c = self.cfg
        ks: list[list[np.ndarray]] = [[] for _ in range(c.n_layers)]
        vs: list[list[np.ndarray]] = [[] for _ in range(c.n_layers)]
        ids, gaps, tokens, pos0 = [], [], list(prompt_ids), 0
        group = c.n_heads // c.n_kv_heads
        for _ in range(n):
            t = len(tokens)
            x = self.emb[np.asarray(tokens)].astype(np.float32)
            pos = np.arange(pos0, pos0 + t, dtype=np.int32)
            for li, L in enumerate(self.layers):
                h = ref.rms_norm(x, L["attn_norm"], c.rms_eps)
                q = self.mm(h, L["attn_q"]).reshape(t, c.n_heads, c.head_dim)
                k = self.mm(h, L["attn_k"]).reshape(t, c.n_kv_heads, c.head_dim)
                v = self.mm(h, L["attn_v"]).reshape(t, c.n_kv_heads, c.head_dim)
                q = ref.rope(q, pos, c.n_heads, c.rope).reshape(t, c.n_heads, c.head_dim)
                k = ref.rope(k, pos, c.n_kv_heads, c.rope).reshape(t, c.n_kv_heads, c.head_dim)
                if self.kv_f16:
                    k, v, q = (a.astype(np.float16).astype(np.float32) for a in (k, v, q))
                ks[li].append(k)
                vs[li].append(v)
                K, V = np.concatenate(ks[li]), np.concatenate(vs[li])
                att = np.empty((t, c.n_heads, c.head_dim), np.float32)
                for hh in range(c.n_heads):
                    s = q[:, hh] @ K[:, hh // group].T / np.sqrt(c.head_dim)
                    mask = np.arange(K.shape[0])[None, :] > pos[:, None]
                    s[mask] = -np.inf
                    p = np.exp(s - s.max(axis=1, keepdims=True))
                    p /= p.sum(axis=1, keepdims=True)
                    if self.kv_f16:
                        p = p.astype(np.float16).astype(np.float32)
                    att[:, hh] = p @ V[:, hh // group]
                x = x + self.mm(att.reshape(t, -1), L["attn_output"])
                h = ref.rms_norm(x, L["ffn_norm"], c.rms_eps)
                g = self.mm(h, L["ffn_gate"])
                u = self.mm(h, L["ffn_up"])
                x = x + self.mm(ref.silu_mul(g, u), L["ffn_down"])
            h = ref.rms_norm(x[-1:], self.out_norm, c.rms_eps)
            logits = self.mm(h, self.out_w)[0]
            top2 = np.partition(logits, -2)[-2:]
            tok = int(np.argmax(logits))
            ids.append(tok)
            gaps.append(float(abs(top2[1] - top2[0])))
            pos0 += t
            tokens = [tok]
        return ids, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--fixture", default="tests/fixtures/llama_cpp_greedy.json")
    args = ap.parse_args()
    fixture = json.load(open(args.fixture))
    result = {}
    for name, aq, kf in [
        ("float32", False, False),
        ("q8_activations", True, False),
        ("q8_activations+f16_kv", True, True),
    ]:
        fw = Forward(args.model, aq, kf)
        full, prefix = 0, []
        for rec in fixture["records"]:
            ids, _ = fw.greedy(rec["prompt_ids"], fixture["n_tokens"])
            pairs = enumerate(zip(ids, rec["ids"], strict=True))
            same = next((i for i, (a, b) in pairs if a != b), len(ids))
            prefix.append(same)
            full += same == len(ids)
        result[name] = {"prompts_fully_matched": full, "matched_prefix_lengths": prefix}
    result["prompts"] = len(fixture["records"])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
