"""The llama-family graph: runner logits equal a plain numpy forward, per architecture.

The oracle (``numpy_forward`` in model_support.py) is written out independently of the
runner: whole-sequence float64 numpy with an explicit causal mask and grouped-query heads, no
KV cache, no batching. Only the elementwise pieces (RMS norm, RoPE, dequantization) come from
``vt.reference``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from model_support import ARCHS, PROMPT, assert_close, make_backend, numpy_forward, tiny_path
from vt.execution.runner import ModelRunner, SeqChunk
from vt.model import load_gguf
from vt.model.graph import SUPPORTED_ARCHITECTURES, LlamaGraph, check_backend

BACKENDS = ("cpu", "tt_stub")


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


def test_backend_without_a_primitive_op_is_refused_naming_the_ops(tiny_dir: Path) -> None:
    cpu = make_backend("cpu")
    lacks = (
        "rope",
        "attention",
        "rope_kv_store",
        "qkv_rope_kv_store",
        "rms_norm_qkv_rope_kv_store",
    )
    keep = tuple(o for o in vt.OPS if o not in lacks)

    class NoRope(type(cpu)):  # type: ignore[misc]
        name = "norope"
        reference_ops = keep

    backend = NoRope()
    with pytest.raises(vt.KernelNotImplementedError) as err:
        check_backend(backend)
    # rope_kv_store, qkv_rope_kv_store and rms_norm_qkv_rope_kv_store are fused: their
    # decompositions need rope, which is what is missing.
    assert "'norope'" in str(err.value)
    assert "op(s) attention, rope " in str(err.value)
    model = load_gguf(tiny_path(tiny_dir, "llama"))
    with pytest.raises(vt.KernelNotImplementedError, match="norope"):
        ModelRunner(backend, model, max_slots=1, max_model_len=8)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_ops_run_as_decomposition_with_equal_logits(tiny_dir: Path, arch: str) -> None:
    """A backend with only the primitive ops runs the model through the decompositions of
    the fused ops, and its logits equal the backend that runs them natively."""
    cpu = make_backend("cpu")

    class PrimitiveOnly(type(cpu)):  # type: ignore[misc]
        name = "primitive-only"
        reference_ops = vt.PRIMITIVE_OPS

    model = load_gguf(tiny_path(tiny_dir, arch))
    chunks = [SeqChunk(slot=0, start_pos=0, token_ids=PROMPT)]
    got = {}
    for backend in (cpu, PrimitiveOnly()):
        assert backend.supports("swiglu") is (backend is cpu)
        runner = ModelRunner(backend, model, max_slots=1, max_model_len=32)
        try:
            got[backend.name] = runner.compute_logits(chunks)
        finally:
            runner.close()
    np.testing.assert_array_equal(got["cpu"], got["primitive-only"])


def _steps_against_the_forward(
    backend: Any, tiny_dir: Path, arch: str
) -> Iterator[tuple[list[str], int]]:
    """A prefill of PROMPT and a decode step of one more token on ``backend``, each step's
    logits checked against the float64 forward: yields the ops launched in each step
    (``backend.launch``'s calls) and the model's layer count."""
    launched: list[str] = []
    launch = backend.launch
    backend.launch = lambda op, stream, **a: (launched.append(op), launch(op, stream, **a))[1]
    model = load_gguf(tiny_path(tiny_dir, arch))
    want = numpy_forward(model, [*PROMPT, 7])
    with ModelRunner(backend, model, max_slots=2, max_model_len=32) as r:
        for start, ids in ((0, PROMPT), (len(PROMPT), [7])):
            launched.clear()
            got = r.compute_logits([SeqChunk(slot=1, start_pos=start, token_ids=ids)])
            pos = start + len(ids) - 1
            assert_close(got[0], want[pos], f"{arch} at position {pos}")
            yield launched, model.config.n_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_norm_in_the_projection_epilogue_where_the_backend_runs_it(
    tiny_dir: Path, arch: str
) -> None:
    """A backend that runs matmul_add_rms_norm natively gets the o and down projections
    with the next norm in their epilogue (every layer's but the last down projection), the
    consumers on the normalised h (no rms_norm_swiglu, no second norm), and the logits of
    the float64 forward at prefill and at a decode step."""
    cpu = make_backend("cpu")

    class Epilogue(type(cpu)):  # type: ignore[misc]
        name = "epilogue"

        def op_matmul_add_rms_norm(self, stream: Any, out: Any, normed: Any, x: Any,
                                   weight: Any, residual: Any, norm: Any, eps: float,
                                   scratch: Any) -> None:  # fmt: skip
            self.launch("matmul_add", stream, out=out, x=x, weight=weight, residual=residual,
                        scratch=scratch)  # fmt: skip
            self.launch("rms_norm", stream, out=normed, x=out, weight=norm, eps=eps)

    for launched, layers in _steps_against_the_forward(Epilogue(), tiny_dir, arch):
        assert launched.count("matmul_add_rms_norm") == 2 * layers - 1
        assert "rms_norm_swiglu" not in launched
        # rms_norm: the epilogues' (launched above), the output norm's and, for qwen3,
        # layer 0's attn_norm and every layer's q and k norms
        norms = 2 * layers - 1 + 1 + (1 + 2 * layers if arch == "qwen3" else 0)
        assert launched.count("rms_norm") == norms


@pytest.mark.parametrize("arch", ARCHS)
def test_projection_and_consumer_as_one_op_where_the_backend_runs_them(
    tiny_dir: Path, arch: str
) -> None:
    """A backend that runs matmul_add_rms_norm_swiglu and
    matmul_add_rms_norm_qkv_rope_kv_store natively gets every layer's output projection
    with its feed-forward as one op and every down projection but the last with the next
    layer's attention inputs (layer i + 1's weights, RoPE and cache layer), so only layer
    0's attention inputs and the output norm are separate (qwen3, whose q and k norms sit
    between, keeps its own); the logits of the float64 forward at prefill and at a decode
    step."""
    cpu = make_backend("cpu")
    ops = ("matmul_add_rms_norm_swiglu", "matmul_add_rms_norm_qkv_rope_kv_store")

    class OneOp(type(cpu)):  # type: ignore[misc]
        name = "one-op"

        def supports(self, op: str, dtype: str | None = None) -> bool:
            return op in ops or super().supports(op, dtype)

        def _dispatch(self, op: str, stream: Any, args: dict[str, Any]) -> None:
            if op in ops:  # "native": the decomposition, each part through launch()
                vt.OPS[op].decompose(self._dispatch_part, stream, args)  # type: ignore[misc]
                return
            super()._dispatch(op, stream, args)

    qwen3 = arch == "qwen3"
    for launched, layers in _steps_against_the_forward(OneOp(), tiny_dir, arch):
        assert launched.count(ops[0]) == layers
        assert launched.count(ops[1]) == (0 if qwen3 else layers - 1)
        assert launched.count("rms_norm_qkv_rope_kv_store") == (0 if qwen3 else 1)
        assert "rms_norm_swiglu" not in launched and "matmul_add_rms_norm" not in launched


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
