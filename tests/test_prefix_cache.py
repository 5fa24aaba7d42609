"""Prefix caching: a request reuses the KV a free slot holds for the prefix it shares with
that slot's earlier request, and gets exactly what it would have got without it.

The engine tests run over test_engine's fake runner in its ``whole_context`` mode, whose
next id is a hash of everything the slot's KV holds up to the sampled position: a reused
position holding the wrong token changes the ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import vt
from test_engine import FakeRunner, FakeTokenizer, _run
from vt.execution.runner import InvalidStepError, ModelRunner, SeqChunk
from vt.frontends.engine import Engine
from vt.frontends.prefix_cache import PrefixCache, common_prefix
from vt.frontends.sampling import SamplingParams
from vt.frontends.server import Server
from vt.management import registry
from vt.model import load_gguf
from vt.testing.tiny import write_tiny_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SYSTEM = list(range(1, 21))  # a shared "system prompt" of 20 tokens


def _engine(prefix_caching: bool = True, **kw) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(whole_context=True, **kw)
    return Engine(runner, FakeTokenizer(), prefix_caching=prefix_caching), runner


def _one_by_one(prompts: list[list[int]], prefix_caching: bool = True, **kw) -> list:
    engine, _ = _engine(prefix_caching, **kw)
    outs = []
    for prompt in prompts:
        rid = engine.add_request(prompt, GREEDY)
        outs.append(_run(engine)[rid])
    return outs


# --------------------------------------------------------------------------- the table


def test_common_prefix() -> None:
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2])) == 2
    assert common_prefix(a, np.array([7])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


def test_pick_takes_the_longest_shared_prefix_and_leaves_one_token() -> None:
    cache = PrefixCache(3)
    cache.remember(0, [1, 2, 3])
    cache.remember(1, [1, 2, 3, 4, 5, 6])
    assert cache.pick([0, 1, 2], [1, 2, 3, 4, 9]) == (1, 4)
    # The whole prompt is held: its last token is computed again, for the logits.
    assert cache.pick([0, 1, 2], [1, 2, 3, 4, 5]) == (1, 4)
    assert cache.pick([0, 2], [1, 2, 3, 4, 5]) == (0, 3)  # slot 1 is not free
    assert cache.pick([0, 1, 2], [1]) == (0, 0)


def test_pick_without_a_shared_prefix_keeps_the_newest_prefixes() -> None:
    cache = PrefixCache(3)
    assert cache.pick([0, 1, 2], [5]) == (0, 0)  # nothing held: the first slot
    cache.remember(0, [1, 2])
    cache.remember(1, [3, 4])
    assert cache.pick([0, 1, 2], [5]) == (2, 0)  # an empty slot before any held prefix
    assert cache.pick([0, 1], [5]) == (0, 0)  # then the one freed longest ago
    cache.forget(0)
    assert cache.held(0) == 0 and cache.held(1) == 2
    cache.clear()
    assert cache.pick([0, 1], [3, 4]) == (0, 0)


# --------------------------------------------------------------------------- the engine


def test_a_shared_prefix_is_skipped_and_the_ids_are_unchanged() -> None:
    prompts = [SYSTEM + [30, 31], SYSTEM + [40, 41, 42], SYSTEM + [40, 41, 50], [60]]
    with_cache = _one_by_one(prompts)
    without = _one_by_one(prompts, prefix_caching=False)
    assert [o.ids for o in with_cache] == [o.ids for o in without]
    assert [o.num_cached_tokens for o in with_cache] == [0, 20, 22, 0]
    assert all(o.num_cached_tokens == 0 for o in without)
    assert with_cache[1].timings.prompt_tokens == 23


def test_the_next_turn_reuses_the_answer_it_was_given() -> None:
    engine, runner = _engine()
    first = SYSTEM + [30]
    rid = engine.add_request(first, GREEDY)
    out = _run(engine)[rid]
    # The last generated id was never an input, so its KV is not there.
    turn = first + out.ids + [33]
    rid = engine.add_request(turn, GREEDY)
    second = _run(engine)[rid]
    assert second.num_cached_tokens == len(first) + len(out.ids) - 1
    first_chunk = next(c for c in runner.steps[-len(second.ids)] if c.token_ids)
    assert first_chunk.start_pos == second.num_cached_tokens
    assert second.ids == _one_by_one([turn], prefix_caching=False)[0].ids


def test_a_stopped_request_lends_its_prefix_before_its_last_step_is_read() -> None:
    # A stop id is known only once read back: async scheduling has already submitted the
    # request's next row, so its slot is busy until that step is read. The next request
    # takes it anyway (its steps come after on the stream) instead of an empty slot.
    prompt = SYSTEM + [30]
    ids = _one_by_one([prompt])[0].ids
    assert ids[2] not in ids[:2]
    stop = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[ids[2]])
    engine, runner = _engine(max_slots=2)
    rid = engine.add_request(prompt, stop)
    assert _run(engine)[rid].finish_reason == "stop"
    rid = engine.add_request(SYSTEM + [31], GREEDY)
    out = _run(engine)[rid]
    assert out.num_cached_tokens == len(SYSTEM)
    (chunk,) = runner.steps[-len(out.ids)]
    assert (chunk.slot, chunk.start_pos) == (0, len(SYSTEM))
    assert out.ids == _one_by_one([SYSTEM + [31]], prefix_caching=False)[0].ids


def test_another_conversation_copies_the_shared_prefix_and_leaves_the_history() -> None:
    # B shares 8 tokens with A's slot, which holds 33: B takes an empty slot with those 8
    # copied, and A's whole history is still there for A's next turn.
    engine, runner = _engine(max_slots=3)
    a, b = SYSTEM[:8] + list(range(30, 50)), SYSTEM[:8] + [60, 61]
    rid = engine.add_request(a, GREEDY)
    out_a = _run(engine)[rid]
    rid = engine.add_request(b, GREEDY)
    out_b = _run(engine)[rid]
    assert runner.copies == [(0, 1, 8)] and out_b.num_cached_tokens == 8
    assert out_b.ids == _one_by_one([b], prefix_caching=False)[0].ids
    turn = a + out_a.ids + [5]
    rid = engine.add_request(turn, GREEDY)
    out = _run(engine)[rid]
    assert out.num_cached_tokens == len(a) + len(out_a.ids) - 1
    assert out.ids == _one_by_one([turn], prefix_caching=False)[0].ids
    assert runner.copies == [(0, 1, 8)]  # the next turn reused its own slot in place


def test_with_every_other_slot_busy_the_prefix_is_reused_in_place() -> None:
    engine, runner = _engine(max_slots=1)
    a, b = SYSTEM[:8] + list(range(30, 50)), SYSTEM[:8] + [60, 61]
    for prompt in (a, b):
        rid = engine.add_request(prompt, GREEDY)
        out = _run(engine)[rid]
    assert runner.copies == [] and out.num_cached_tokens == 8


def test_slots_keep_their_prefixes_apart() -> None:
    # Two conversations through two slots, one after the other: each turn finds its own.
    engine, _ = _engine(max_slots=2)
    a, b = SYSTEM + [30, 31, 32], SYSTEM + [40, 41, 42]
    ids = [engine.add_request(p, GREEDY) for p in (a, b)]
    outs = _run(engine)
    cached = []
    for prompt, rid in zip((a, b), ids, strict=True):
        rid = engine.add_request(prompt + outs[rid].ids + [5], GREEDY)
        cached.append(_run(engine)[rid].num_cached_tokens)
    assert cached == [len(a) + 5, len(b) + 5]


def test_an_aborted_prefill_leaves_only_what_it_wrote() -> None:
    engine, runner = _engine(max_batch_tokens=8)
    long = SYSTEM + list(range(30, 40))
    rid = engine.add_request(long, GREEDY)
    engine.step()  # one or (async) two chunks of 8 prompt tokens
    written = len(runner.kv[0])
    assert written in (8, 16)
    assert engine.abort(rid)
    _run(engine)
    rid = engine.add_request(long, GREEDY)
    out = _run(engine)[rid]
    assert out.num_cached_tokens == written
    assert out.ids == _one_by_one([long], prefix_caching=False)[0].ids


def test_scored_prompts_reuse_nothing() -> None:
    engine, runner = _engine()
    runner.logprobs_enabled, runner.max_logprobs = True, 5
    engine.add_request(SYSTEM + [30], GREEDY)
    _run(engine)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    # The fake runner computes no prompt logprobs: look at the schedule only.
    engine.add_request(SYSTEM + [31], scored)
    (row,) = engine._schedule()
    assert row[1] == 0 and row[2] == (SYSTEM + [31])[: row[3]]  # from position 0


def test_a_failed_step_forgets_every_prefix() -> None:
    engine, runner = _engine()
    rid = engine.add_request(SYSTEM + [30], GREEDY)
    _run(engine)
    real = runner.execute

    def boom(chunks):
        raise RuntimeError("device lost")

    runner.execute = boom
    engine.add_request(SYSTEM + [31], GREEDY)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    runner.execute = real
    runner.kv = {s: [] for s in runner.kv}  # what ModelRunner.recover does to positions
    rid = engine.add_request(SYSTEM + [32], GREEDY)
    assert _run(engine)[rid].num_cached_tokens == 0


def test_a_slot_freed_behind_the_engines_back_is_not_trusted() -> None:
    engine, runner = _engine(max_slots=1)
    rid = engine.add_request(SYSTEM + [30], GREEDY)
    _run(engine)
    runner.free_slot(0)  # someone used the runner directly
    rid = engine.add_request(SYSTEM + [31], GREEDY)
    out = _run(engine)[rid]
    assert out.num_cached_tokens == 0
    assert out.ids == _one_by_one([SYSTEM + [31]], prefix_caching=False)[0].ids


def test_off_frees_slots_whole() -> None:
    engine, runner = _engine(prefix_caching=False)
    for _ in range(2):
        rid = engine.add_request(SYSTEM + [30], GREEDY)
        assert _run(engine)[rid].num_cached_tokens == 0
        assert runner.kv[0] == []


# --------------------------------------------------------------------------- the runner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("prefix") / "tiny.gguf", tied=False)


def test_runner_keeps_a_prefix_and_refuses_to_skip_past_it(tiny: Path) -> None:
    backend, _ = registry.create_backend("cpu")
    model = load_gguf(tiny)
    with ModelRunner(backend, model, max_slots=1, max_model_len=64) as runner:
        runner.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 2, 3, 4, 5])]).get_output()
        runner.free_slot(0, keep=3)
        assert runner.seq_len(0) == 3
        with pytest.raises(InvalidStepError, match="skips positions"):
            runner.execute([SeqChunk(slot=0, start_pos=4, token_ids=[9])])
        runner.free_slot(0, keep=10)  # never more than was written
        assert runner.seq_len(0) == 3
        with pytest.raises(InvalidStepError, match="keep -1"):
            runner.free_slot(0, keep=-1)
        runner.free_slot(0)
        assert runner.seq_len(0) == 0


def test_a_copied_prefix_gives_the_logits_of_the_original(tiny: Path) -> None:
    backend, _ = registry.create_backend("cpu")
    model = load_gguf(tiny)
    with ModelRunner(backend, model, max_slots=2, max_model_len=64) as runner:
        runner.execute([SeqChunk(slot=0, start_pos=0, token_ids=list(range(1, 11)))])
        runner.copy_prefix(0, 1, 6)
        assert runner.seq_len(1) == 6 and runner.seq_len(0) == 10
        rest = [SeqChunk(slot=1, start_pos=6, token_ids=[7, 8, 9, 10])]
        copied = runner.compute_logits(rest)
        runner.free_slot(0, keep=6)
        in_place = runner.compute_logits([SeqChunk(slot=0, start_pos=6, token_ids=[7, 8, 9, 10])])
        np.testing.assert_array_equal(copied, in_place)
        with pytest.raises(InvalidStepError, match="both slot 1"):
            runner.copy_prefix(1, 1, 2)
        with pytest.raises(InvalidStepError, match="11 positions asked of slot 0"):
            runner.copy_prefix(0, 1, 11)
        with pytest.raises(InvalidStepError, match="outside"):
            runner.copy_prefix(0, 2, 1)


def test_llm_reuses_a_chat_prefix_with_the_same_ids(tiny: Path) -> None:
    system = "You are a careful assistant who answers in one short sentence."
    questions = ["Why is the sky blue?", "What is a river?", "Why is the sea salty?"]
    results = {}
    for caching in (True, False):
        with vt.LLM(model=tiny, backend="cpu", max_slots=1, prefix_caching=caching) as llm:
            prompts = [
                llm.render_chat([{"role": "user", "content": q}], system=system) for q in questions
            ]
            results[caching] = [llm.generate(p, GREEDY)[0] for p in prompts]
    cached = [o.num_cached_tokens for o in results[True]]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    assert [o.ids for o in results[True]] == [o.ids for o in results[False]]


def test_server_reports_cached_prompt_tokens(tiny: Path) -> None:
    llm = vt.LLM(model=tiny, backend="cpu", max_slots=1)
    srv = Server(llm, host="127.0.0.1", port=0, model_name="tiny", log_level="warning")
    srv.start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=20)
        system = {"role": "system", "content": "You are a careful assistant."}
        usage = [
            client.chat.completions.create(
                model="tiny",
                messages=[system, {"role": "user", "content": q}],
                max_tokens=3,
                temperature=0,
            ).usage
            for q in ("Why is the sky blue?", "What is a river?")
        ]
    finally:
        srv.stop()
        llm.close()
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert 0 < usage[1].prompt_tokens_details.cached_tokens < usage[1].prompt_tokens
