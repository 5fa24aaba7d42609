"""The llama-family graph: runner logits equal a plain numpy forward, per architecture.

The oracle here is written out independently of the runner: whole-sequence float64 numpy
with an explicit causal mask and grouped-query heads, no KV cache, no batching. Only the
elementwise pieces (RMS norm, RoPE, dequantization) come from ``vt.reference``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from vt import reference as R
from vt.model import load_gguf
from vt.model.graph import SUPPORTED_ARCHITECTURES, LlamaGraph, check_backend
from vt.registry import Registry
from vt.runner import ModelRunner, SeqChunk
from vt.testing.tiny import write_tiny_gguf

ARCHS = ("llama", "qwen2", "qwen3")
BACKENDS = ("cpu", "tt_stub")
PROMPT = [3, 17, 42, 5, 9, 60, 1, 33, 21]


# --------------------------------------------------------------------------- helpers
# (test_runner.py and test_readback.py import these)


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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-graph")


# --------------------------------------------------------------------------- tests


def test_oracle_sees_the_model_differently_per_architecture(tiny_dir: Path) -> None:
    """The three tiny models really exercise bias, QK norm and both RoPE styles."""
    configs = {a: load_gguf(tiny_path(tiny_dir, a)).config for a in ARCHS}
    assert configs["qwen2"].has_qkv_bias and not configs["llama"].has_qkv_bias
    assert configs["qwen3"].has_qk_norm and not configs["qwen2"].has_qk_norm
    assert configs["llama"].rope.style is vt.RopeStyle.normal
    assert configs["qwen2"].rope.style is vt.RopeStyle.neox
    assert all(c.n_heads > c.n_kv_heads for c in configs.values()), "want grouped-query heads"
    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHS)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_runner_logits_equal_numpy_forward(tiny_dir: Path, arch: str, backend_name: str) -> None:
    model = load_gguf(tiny_path(tiny_dir, arch))
    want = numpy_forward(model, PROMPT + [7, 11, 13])
    with ModelRunner(make_backend(backend_name), model, max_slots=2, max_model_len=32) as r:
        # prefill, sampling the last prompt row
        got = r.compute_logits([SeqChunk(slot=1, start_pos=0, token_ids=PROMPT)])
        assert got.shape == (1, model.config.vocab_size) and got.dtype == np.float32
        assert_close(got[0], want[len(PROMPT) - 1], f"{arch} prefill")
        # decode: one token per step reads the cached K/V of every earlier position
        for j, tok in enumerate([7, 11, 13]):
            pos = len(PROMPT) + j
            got = r.compute_logits([SeqChunk(slot=1, start_pos=pos, token_ids=[tok])])
            assert_close(got[0], want[pos], f"{arch} decode at position {pos}")


@pytest.mark.parametrize(
    ("arch", "variant"),
    [
        ("qwen3", {"head_dim": 32}),  # q_dim = 128 differs from dim = 64
        ("qwen2", {"tied": False}),  # a separate output.weight
        ("llama", {"n_kv_heads": 1, "n_heads": 8, "head_dim": 16}),  # 8 query heads per KV head
    ],
    ids=["qwen3-wide-heads", "qwen2-untied", "llama-mqa"],
)
def test_shape_variants_equal_numpy_forward(tiny_dir: Path, arch: str, variant: dict) -> None:
    model = load_gguf(tiny_path(tiny_dir, arch, **variant))
    want = numpy_forward(model, PROMPT + [7])
    with ModelRunner(make_backend("cpu"), model, max_slots=2, max_model_len=32) as r:
        got = r.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
        assert_close(got[0], want[len(PROMPT) - 1], f"{arch} {variant} prefill")
        got = r.compute_logits([SeqChunk(slot=0, start_pos=len(PROMPT), token_ids=[7])])
        assert_close(got[0], want[-1], f"{arch} {variant} decode")


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_weights_match_their_dequantized_oracle(tiny_dir: Path, arch: str) -> None:
    model = load_gguf(tiny_path(tiny_dir, arch, "Q8_0"))
    want = numpy_forward(model, PROMPT)
    with ModelRunner(make_backend("cpu"), model, max_slots=1, max_model_len=16) as r:
        got = r.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)])
    assert_close(got[0], want[-1], f"{arch} Q8_0")


def test_every_prompt_row_can_be_sampled_in_one_step(tiny_dir: Path) -> None:
    """Rows of one flattened batch are independent: three sequences, three logit rows."""
    model = load_gguf(tiny_path(tiny_dir, "qwen2"))
    seqs = [PROMPT[:4], PROMPT[2:9], [5]]
    with ModelRunner(make_backend("cpu"), model, max_slots=4, max_model_len=16) as r:
        slots = (2, 0, 3)
        chunks = [
            SeqChunk(slot=s, start_pos=0, token_ids=t) for s, t in zip(slots, seqs, strict=True)
        ]
        got = r.compute_logits(chunks)
    for i, toks in enumerate(seqs):
        assert_close(got[i], numpy_forward(model, toks)[-1], f"sequence {i}")


def test_tied_output_reuses_the_embedding_upload(tiny_dir: Path) -> None:
    tied = load_gguf(tiny_path(tiny_dir, "llama"))
    untied = load_gguf(tiny_path(tiny_dir, "qwen2", tied=False))
    assert tied.config.tied_output and not untied.config.tied_output
    for model, is_tied in ((tied, True), (untied, False)):
        graph = LlamaGraph(make_backend("cpu"), model)
        try:
            assert (graph.output is graph.token_embd) is is_tied
            assert graph.output.name == ("token_embd.weight" if is_tied else "output.weight")
        finally:
            graph.close()


def test_backend_without_model_kernels_is_refused_by_name(tiny_dir: Path) -> None:
    cpu = make_backend("cpu")

    class NoRope(type(cpu)):  # type: ignore[misc]
        name = "norope"
        rope = vt.Backend.rope
        attention = vt.Backend.attention

    backend = NoRope()
    with pytest.raises(vt.KernelNotImplementedError) as err:
        check_backend(backend)
    assert "'norope'" in str(err.value)
    assert "rope" in str(err.value) and "attention" in str(err.value)
    model = load_gguf(tiny_path(tiny_dir, "llama"))
    with pytest.raises(vt.KernelNotImplementedError, match="norope"):
        ModelRunner(backend, model, max_slots=1, max_model_len=8)


class _Renamed:
    """A model whose config is altered: what a malformed or unknown file would claim."""

    def __init__(self, model: Any, **update: Any) -> None:
        self._model = model
        self.config = model.config.model_copy(update=update)

    def tensor(self, name: str) -> vt.WeightTensor:
        return self._model.tensor(name)


def test_unknown_architecture_is_refused(tiny_dir: Path) -> None:
    model = _Renamed(load_gguf(tiny_path(tiny_dir, "llama")), architecture="mamba")
    with pytest.raises(vt.ModelError, match="architecture 'mamba'"):
        LlamaGraph(make_backend("cpu"), model)


def test_tensor_shape_that_disagrees_with_config_is_refused(tiny_dir: Path) -> None:
    base = load_gguf(tiny_path(tiny_dir, "llama"))
    model = _Renamed(base, ffn_dim=base.config.ffn_dim * 2)
    with pytest.raises(vt.ModelError, match="ffn_gate.weight"):
        LlamaGraph(make_backend("cpu"), model)
