"""A plain float64 numpy forward of a llama-family GGUF: the kit's end-to-end oracle.

Whole-sequence attention with an explicit causal mask and grouped-query heads: no KV
cache, no batching, no backend. Only dequantization and RoPE come from ``vt.reference``
(the kit checks them op by op on their own).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import reference as R


def _mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ w.T`` without BLAS: threaded BLAS on a busy machine can take 100x longer for
    these small products, and the oracle must not depend on the host's thread pool."""
    return np.einsum("ik,jk->ij", x, w, optimize=False)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


class NumpyModel:
    """The dequantized weights of ``model`` (a :class:`vt.model.ModelFile`), in float64."""

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self._w: dict[str, np.ndarray] = {
            name: R.dequantize(model.tensor(name)).astype(np.float64)
            for name in model.model_tensor_names()
        }

    def w(self, name: str) -> np.ndarray:
        return self._w[name]

    def logits(self, tokens: list[int]) -> np.ndarray:
        """``[len(tokens), vocab]`` logits of every position of the sequence."""
        c = self.config
        n, hd, group = len(tokens), c.head_dim, c.n_heads // c.n_kv_heads
        pos = np.arange(n)
        x = self.w("token_embd.weight")[np.asarray(tokens)]
        future = np.triu(np.ones((n, n), dtype=bool), k=1)
        for i in range(c.n_layers):
            p = f"blk.{i}."
            h = _rms(x, self.w(p + "attn_norm.weight"), c.rms_eps)
            q = _mm(h, self.w(p + "attn_q.weight"))
            k = _mm(h, self.w(p + "attn_k.weight"))
            v = _mm(h, self.w(p + "attn_v.weight"))
            if c.has_qkv_bias:
                q = q + self.w(p + "attn_q.bias")
                k = k + self.w(p + "attn_k.bias")
                v = v + self.w(p + "attn_v.bias")
            q, k = q.reshape(n, c.n_heads, hd), k.reshape(n, c.n_kv_heads, hd)
            if c.has_qk_norm:
                q = _rms(q, self.w(p + "attn_q_norm.weight"), c.rms_eps)
                k = _rms(k, self.w(p + "attn_k_norm.weight"), c.rms_eps)
            q = R.rope(q.reshape(n, -1), pos, c.n_heads, c.rope).astype(np.float64)
            k = R.rope(k.reshape(n, -1), pos, c.n_kv_heads, c.rope).astype(np.float64)
            q = q.reshape(n, c.n_heads, hd)
            k = np.repeat(k.reshape(n, c.n_kv_heads, hd), group, axis=1)  # head h: kv h//group
            v = np.repeat(v.reshape(n, c.n_kv_heads, hd), group, axis=1)
            scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
            scores[:, future] = -np.inf
            prob = np.exp(scores - scores.max(axis=-1, keepdims=True))
            prob /= prob.sum(axis=-1, keepdims=True)
            attn = np.einsum("hij,jhd->ihd", prob, v).reshape(n, -1)
            x = x + _mm(attn, self.w(p + "attn_output.weight"))
            h = _rms(x, self.w(p + "ffn_norm.weight"), c.rms_eps)
            gate = _mm(h, self.w(p + "ffn_gate.weight"))
            up = _mm(h, self.w(p + "ffn_up.weight"))
            x = x + _mm(gate / (1.0 + np.exp(-gate)) * up, self.w(p + "ffn_down.weight"))
        out = "token_embd.weight" if c.tied_output else "output.weight"
        return _mm(_rms(x, self.w("output_norm.weight"), c.rms_eps), self.w(out))
