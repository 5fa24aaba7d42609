"""vt.LLM on a tiny GGUF with the cpu and tt_stub backends: what a Python user relies on."""

from __future__ import annotations

from pathlib import Path

import pytest
import vt
from model_support import LiveWeights
from vt.frontends.engine import RequestError
from vt.frontends.llm import RequestOutput
from vt.management import registry
from vt.testing.tiny import write_tiny_gguf

LONG = vt.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Seeded sampling is a pure function of (logits, seed, counter): batching must not change it.
SAMPLED = vt.SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "Hello world!", "What is the answer? The answer is"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Untied output weights: the tied tiny model mostly repeats its last token.
    return write_tiny_gguf(tmp_path_factory.mktemp("llm") / "tiny.gguf", tied=False)


@pytest.fixture(autouse=True)
def _async_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VT_ASYNC_RUNNER", raising=False)


@pytest.fixture(scope="module")
def cpu(tiny: Path):
    with vt.LLM(model=tiny, backend="cpu", max_slots=2, max_batch_tokens=8) as llm:
        yield llm


def _ids(outs) -> list[list[int]]:
    return [o.ids for o in outs]


def test_generate_one_prompt(cpu) -> None:
    (out,) = cpu.generate("The capital of France is", LONG)
    assert isinstance(out, RequestOutput)
    assert out.prompt == "The capital of France is"
    assert out.prompt_ids == cpu.tokenizer.encode("The capital of France is")
    assert len(out.ids) == 12 and out.finish_reason == "length"
    assert out.text == cpu.tokenizer.decode(out.ids, skip_special=True)
    assert out.timings.prompt_tokens == len(out.prompt_ids)
    assert out.timings.prefill_tok_s > 0 and out.timings.decode_tok_s > 0


def test_batched_generation_equals_one_at_a_time(cpu) -> None:
    # Three prompts through two slots, prompts prefilled in chunks of 8 tokens.
    for params in (LONG, SAMPLED):
        together = cpu.generate(PROMPTS, params)
        alone = [cpu.generate(p, params)[0] for p in PROMPTS]
        assert _ids(together) == _ids(alone)
    assert [o.prompt for o in together] == PROMPTS


def test_generate_takes_one_output_a_request_and_stream_one_a_step(cpu) -> None:
    """generate and chat add their requests final_only: the engine builds no output for
    them before they finish (host work a large batch waits on); stream gets one a step."""
    seen: list[RequestOutput] = []
    step = cpu.engine.step

    def recording() -> list[RequestOutput]:
        outs = step()
        seen.extend(outs)
        return outs

    cpu.engine.step = recording
    try:
        cpu.generate(PROMPTS, LONG)
        cpu.chat([{"role": "user", "content": "Hi"}], LONG)
        assert len(seen) == len(PROMPTS) + 1 and all(o.finished for o in seen)
        seen.clear()
        list(cpu.stream("Hello world!", LONG))
        assert len(seen) > 1 and not seen[0].finished
    finally:
        del cpu.engine.step
    assert cpu.engine.step == step


def test_one_sampling_params_per_prompt(cpu) -> None:
    params = [vt.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 5)]
    outs = cpu.generate(PROMPTS[:2], params)
    assert [len(o.ids) for o in outs] == [1, 5]
    with pytest.raises(ValueError, match="got 2 sampling params for 3 prompts"):
        cpu.generate(PROMPTS, params)


def test_token_id_prompts(cpu) -> None:
    ids = cpu.tokenizer.encode(PROMPTS[0])
    (a,) = cpu.generate({"prompt_token_ids": ids}, LONG)
    (b,) = cpu.generate(PROMPTS[0], LONG)
    assert a.ids == b.ids and a.prompt is None


def test_seeded_sampling_is_reproducible(cpu) -> None:
    p = vt.SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=3, max_tokens=10)
    assert cpu.generate(PROMPTS[0], p)[0].ids == cpu.generate(PROMPTS[0], p)[0].ids


def test_stop_string_is_trimmed(cpu) -> None:
    (full,) = cpu.generate(PROMPTS[1], LONG)
    text = full.text
    cut = next(i for i in range(3, len(text) - 1) if text[i : i + 2].isprintable())
    stop = text[cut : cut + 2]
    (out,) = cpu.generate(PROMPTS[1], LONG.model_copy(update={"stop": [stop]}))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert full.ids[: len(out.ids)] == out.ids


def test_stop_token_ids(cpu) -> None:
    (full,) = cpu.generate(PROMPTS[0], LONG)
    target = full.ids[4]
    (out,) = cpu.generate(PROMPTS[0], LONG.model_copy(update={"stop_token_ids": [target]}))
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.ids == full.ids[: full.ids.index(target) + 1]


def test_stream_deltas_add_up_and_closing_aborts(cpu) -> None:
    deltas, ids = [], []
    for out in cpu.stream(PROMPTS[0], LONG):
        deltas.append(out.delta_text)
        ids += out.delta_ids
    assert out.finished and "".join(deltas) == out.text and ids == out.ids
    it = cpu.stream(PROMPTS[0], LONG)
    next(it)
    it.close()
    assert not cpu.engine.has_unfinished()


def test_chat_applies_the_template(cpu) -> None:
    msgs = [{"role": "user", "content": "Hello"}]
    (out,) = cpu.chat(msgs, LONG, system="Be brief.")
    rendered = cpu.render_chat(msgs, system="Be brief.")
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt_ids == cpu.tokenizer.encode(rendered)
    two = cpu.chat([msgs, [{"role": "user", "content": "Hi"}]], LONG)
    assert len(two) == 2 and two[0].ids == cpu.chat(msgs, LONG)[0].ids
    (streamed,) = [o for o in cpu.stream_chat(msgs, LONG, system="Be brief.") if o.finished]
    assert streamed.ids == out.ids


def test_bad_messages_are_refused(cpu) -> None:
    with pytest.raises(ValueError, match="role"):
        cpu.chat([{"content": "no role"}], LONG)


def test_too_long_prompt_fails_the_batch_before_it_runs(tiny: Path) -> None:
    with vt.LLM(model=tiny, backend="cpu", max_model_len=16) as llm:
        long_prompt = "hello there, how are you today? " * 4
        with pytest.raises(RequestError, match="prompt 1: the prompt has .* max_model_len is 16"):
            llm.generate([PROMPTS[1], long_prompt], LONG)
        assert not llm.engine.has_unfinished()
        (out,) = llm.generate(PROMPTS[1], LONG.model_copy(update={"max_tokens": None}))
        assert len(out.prompt_ids) + len(out.ids) == 16 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "tt_stub"},
        {"backend": "cpu", "async_scheduling": False},
        {"backend": "cpu", "kv_cache": "contiguous"},
        {"backend": "cpu", "kv_cache": "vmm"},
        {"backend": "cpu", "max_slots": 1, "max_batch_tokens": 3},
    ],
)
def test_same_greedy_ids_everywhere(tiny: Path, cpu, kwargs: dict) -> None:
    expected = [_ids(cpu.generate(PROMPTS, p)) for p in (LONG, SAMPLED)]
    with vt.LLM(model=tiny, **kwargs) as llm:
        assert [_ids(llm.generate(PROMPTS, p)) for p in (LONG, SAMPLED)] == expected
        if kwargs.get("kv_cache"):
            assert llm.kv_cache_stats()["backend"] == kwargs["kv_cache"]


def test_readback_paths(tiny: Path, cpu) -> None:
    assert cpu.readback == "host_view"
    with vt.LLM(model=tiny, backend="tt_stub") as llm:
        assert llm.readback == "sync"
    with vt.LLM(model=tiny, backend="cpu", async_scheduling=False) as llm:
        assert llm.readback == "sync"


def test_facts_and_repr(cpu, tiny: Path) -> None:
    assert cpu.backend_name == "cpu" and cpu.model_path == tiny
    assert cpu.model_name == "tiny-llama-Q8_0"
    assert set(cpu.kv_cache_stats()) == {"backend", "reserved_bytes", "mapped_bytes", "segments"}
    assert "tiny-llama-Q8_0" in repr(cpu) and "cpu" in repr(cpu)


def test_unknown_backend_and_model(tiny: Path) -> None:
    with pytest.raises(vt.BackendUnavailableError, match="unknown backend 'nope'"):
        vt.LLM(model=tiny, backend="nope")
    with pytest.raises(vt.ModelError, match="no such model file"):
        vt.LLM(model="/nonexistent/model.gguf", backend="cpu")


def test_bad_engine_settings(tiny: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len=100000 must be between 1 and"):
        vt.LLM(model=tiny, backend="cpu", max_model_len=100_000)
    with pytest.raises(ValueError, match="unknown KV cache kind 'paged'"):
        vt.LLM(model=tiny, backend="cpu", kv_cache="paged")


def test_close_is_idempotent(tiny: Path) -> None:
    llm = vt.LLM(model=tiny, backend="cpu")
    llm.close()
    llm.close()
    with pytest.raises(vt.VtError, match="closed"):
        llm.generate("Hello", LONG)


def test_close_frees_the_weights_and_the_kv_cache(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[LiveWeights] = []
    plain = registry.create_backend

    def create_backend(name: str | None = None) -> tuple[vt.Backend, str]:
        backend, why = plain(name)
        created.append(LiveWeights(backend))
        return backend, why

    monkeypatch.setattr(registry, "create_backend", create_backend)
    llm = vt.LLM(model=tiny, backend="cpu", kv_cache="contiguous")
    llm.generate("Hello", LONG)
    (weights,) = created
    assert weights.live and weights.handles_alive() == len(weights.live)
    assert llm.kv_cache_stats()["mapped_bytes"] > 0
    llm.close()
    assert weights.live == {}
    assert weights.handles_alive() == 0  # while `llm` itself is still referenced
    assert llm.runner.kv.released


@pytest.mark.slow
def test_default_model_batch_equals_alone_and_chat_stops() -> None:
    greedy = vt.SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    with vt.LLM(max_slots=2) as llm:
        together = llm.generate(prompts, greedy)
        assert together[0].text.startswith(" Paris.")
        assert _ids(together) == [llm.generate(p, greedy)[0].ids for p in prompts]
        longer = greedy.model_copy(update={"max_tokens": 64})
        (answer,) = llm.chat([{"role": "user", "content": "Say hello."}], longer)
        assert answer.text.strip()
        if answer.finish_reason == "stop":
            assert answer.ids[-1] in llm.tokenizer.stop_ids
