"""Helpers shared by the model tests (graph, runner, readback): tiny models, a numpy oracle
of the whole forward pass, backends by name, and a greedy generation loop.

The oracle is written out independently of the runner: whole-sequence float64 numpy with an
explicit causal mask and grouped-query heads, no KV cache, no batching. Only the elementwise
pieces (RMS norm, RoPE, dequantization) come from ``vt.reference``.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import vt
from vt import reference as R
from vt.execution.runner import ModelRunner, SeqChunk
from vt.management.registry import Registry
from vt.testing.tiny import write_tiny_gguf

ARCHS = ("llama", "qwen2", "qwen3")
PROMPT = [3, 17, 42, 5, 9, 60, 1, 33, 21]


def make_backend(name: str) -> vt.Backend:
    """A fresh instance of an installed backend with its effective capabilities."""
    backend, _ = Registry(env={}).create_backend(name)
    return backend


_MODELS: dict[tuple[Any, ...], Path] = {}


def tiny_path(tmp_dir: Path, arch: str, weight_type: str = "F32", **kw: Any) -> Path:
    """A tiny GGUF of ``arch`` (written once per process; ``kw`` go to write_tiny_gguf)."""
    key = (arch, weight_type, *sorted(kw.items()))
    if key not in _MODELS:
        extra = "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        path = tmp_dir / f"tiny-{arch}-{weight_type}{extra}.gguf"
        write_tiny_gguf(path, arch=arch, weight_type=weight_type, **kw)
        _MODELS[key] = path
    return _MODELS[key]


def _f64(model: Any, name: str) -> np.ndarray:
    return R.dequantize(model.tensor(name)).astype(np.float64)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def numpy_forward(model: Any, tokens: list[int]) -> np.ndarray:
    """Logits ``[len(tokens), vocab]`` of the whole sequence, computed from scratch."""
    c = model.config
    n, hd = len(tokens), c.head_dim
    group = c.n_heads // c.n_kv_heads
    pos = np.arange(n)
    out_name = "token_embd.weight" if c.tied_output else "output.weight"
    x = _f64(model, "token_embd.weight")[np.asarray(tokens)]
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(c.n_layers):

        def w(name: str, i: int = i) -> np.ndarray:
            return _f64(model, f"blk.{i}.{name}")

        h = _rms(x, w("attn_norm.weight"), c.rms_eps)
        q, k, v = h @ w("attn_q.weight").T, h @ w("attn_k.weight").T, h @ w("attn_v.weight").T
        if c.has_qkv_bias:
            q, k, v = q + w("attn_q.bias"), k + w("attn_k.bias"), v + w("attn_v.bias")
        q = q.reshape(n, c.n_heads, hd)
        k = k.reshape(n, c.n_kv_heads, hd)
        v = v.reshape(n, c.n_kv_heads, hd)
        if c.has_qk_norm:
            q = _rms(q, w("attn_q_norm.weight"), c.rms_eps)
            k = _rms(k, w("attn_k_norm.weight"), c.rms_eps)
        q = R.rope(q.reshape(n, -1), pos, c.n_heads, c.rope).astype(np.float64)
        k = R.rope(k.reshape(n, -1), pos, c.n_kv_heads, c.rope).astype(np.float64)
        q = q.reshape(n, c.n_heads, hd)
        k = np.repeat(k.reshape(n, c.n_kv_heads, hd), group, axis=1)  # head h -> kv h//group
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd)
        scores[:, future] = -np.inf
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", p, v).reshape(n, -1)
        x = x + attn @ w("attn_output.weight").T
        h = _rms(x, w("ffn_norm.weight"), c.rms_eps)
        gate, up = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w("ffn_down.weight").T
    return _rms(x, _f64(model, "output_norm.weight"), c.rms_eps) @ _f64(model, out_name).T


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * max(1.0, scale), f"{what}: max |diff| {err:.3g} (logit scale {scale:.3g})"


def cpu_with_readback(path: str) -> vt.Backend:
    """The cpu backend with capabilities that lead the runner to ``path``."""
    backend = make_backend("cpu")
    caps = backend.capabilities
    if path != "host_view":
        caps = caps.with_value(
            "device_memory_is_host_addressable", False, vt.Source.env, "test: force a copy"
        )
    if path == "sync":
        caps = caps.with_value(
            "supports_async_sampled_token_readback", False, vt.Source.env, "test: no async"
        )
    backend.capabilities = caps
    return backend


def greedy(
    runner: ModelRunner, prompts: dict[int, list[int]], n_new: int, chunk: int | None = None
) -> dict[int, list[int]]:
    """Generate ``n_new`` greedy ids per slot, all slots batched, prompts prefilled in
    chunks of ``chunk`` tokens, decode inputs taken device-side (``from_previous``)."""
    out: dict[int, list[int]] = {s: [] for s in prompts}
    done = {s: 0 for s in prompts}
    got: dict[int, int] = {}
    while any(done[s] < len(p) for s, p in prompts.items()):  # prefill, one chunk per slot
        chunks = []
        for s, p in prompts.items():
            if done[s] < len(p):
                part = p[done[s] : done[s] + (chunk or len(p))]
                last = done[s] + len(part) == len(p)
                chunks.append(SeqChunk(slot=s, start_pos=done[s], token_ids=part, sample=last))
                done[s] += len(part)
        got = runner.execute(chunks).get_output()
        for s, tok in got.items():
            out[s].append(tok)
    pos = {s: len(p) for s, p in prompts.items()}
    prev_sampled = set(got)
    for _ in range(n_new - 1):
        chunks = [
            SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True)
            if s in prev_sampled
            else SeqChunk(slot=s, start_pos=pos[s], token_ids=[out[s][-1]])
            for s in prompts
        ]
        got = runner.execute(chunks).get_output()
        prev_sampled = set(got)
        for s, tok in got.items():
            out[s].append(tok)
            pos[s] += 1
    return out


class LiveWeights:
    """Counts the weights a backend instance holds: uploaded and not yet freed.

    Wraps ``upload_weight``/``free_weight`` on the instance and keeps a weak reference to each
    weight's handle, so a test can also see whether the memory behind it was let go.
    """

    def __init__(self, backend: vt.Backend) -> None:
        self.live: dict[int, vt.Weight] = {}
        self.handles: list[weakref.ref[Any]] = []
        upload, free = backend.upload_weight, backend.free_weight

        def upload_weight(tensor: vt.WeightTensor) -> vt.Weight:
            weight = upload(tensor)
            self.live[id(weight)] = weight
            self.handles.append(weakref.ref(weight.handle))
            return weight

        def free_weight(weight: vt.Weight) -> None:
            free(weight)
            self.live.pop(id(weight))

        backend.upload_weight = upload_weight  # type: ignore[method-assign]
        backend.free_weight = free_weight  # type: ignore[method-assign]

    def handles_alive(self) -> int:
        """How many weight handles are still referenced by anything."""
        gc.collect()
        return sum(ref() is not None for ref in self.handles)
