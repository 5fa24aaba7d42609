"""The engine's scheduling, stop conditions and detokenization, over a fake runner.

The fake runner is a tiny "model" whose next token is a pure function of what is in a slot's
KV at the sampled position (or, with ``whole_context``, of everything the slot's KV holds), and
it checks the runner contract on every step: a chunk starts at a written position (0, or
within a prefix the slot kept), ``from_previous`` is used only right after the slot sampled,
``get_output`` is called once, the token budget and slot range hold.
"""

from __future__ import annotations

import codecs

import pytest
from vt.frontends.engine import Engine, RequestError, RequestOutput, Timings
from vt.frontends.sampling import SamplingParams

VOCAB = 64
EOS = 0


class FakeTokenizer:
    """Token i decodes to "t{i} "; 0 is end-of-turn; 63 decodes to one half of "é"."""

    stop_ids = (EOS,)

    class _Decoder:
        def __init__(self) -> None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def step(self, token: int) -> str:
            return self.utf8.decode(FakeTokenizer.piece(token))

        def flush(self) -> str:
            return self.utf8.decode(b"", final=True)

    @staticmethod
    def piece(token: int) -> bytes:
        if token == 63:
            return "é".encode()[:1]
        if token == 62:
            return "é".encode()[1:]
        if token == EOS:
            return b""  # special tokens are skipped
        return f"t{token} ".encode()

    def incremental_decoder(self, skip_special: bool = False) -> _Decoder:
        assert skip_special, "generated text skips special tokens"
        return self._Decoder()


class _Config:
    vocab_size = VOCAB


class FakeStep:
    def __init__(self, runner: FakeRunner, out: dict[int, int]) -> None:
        self.runner, self.out, self.read = runner, out, False

    def get_output(self) -> dict[int, int]:
        assert not self.read, "get_output called twice"
        self.read = True
        self.runner.outstanding -= 1
        return dict(self.out)


class FakeRunner:
    """Greedy: next = (token at the sampled position + 1) % VOCAB. Sampled: seed-mixed."""

    def __init__(
        self,
        readback: str = "host_view",
        max_slots: int = 4,
        max_model_len: int = 64,
        max_batch_tokens: int = 16,
        whole_context: bool = False,
    ) -> None:
        self.readback = readback
        self.whole_context = whole_context
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.config = _Config()
        self.kv: dict[int, list[int]] = {s: [] for s in range(max_slots)}
        self.last_sample: dict[int, int] = {}  # slot -> id sampled in the previous step
        self.outstanding = 0
        self.steps: list[list] = []
        self.freed: list[int] = []
        self.copies: list[tuple[int, int, int]] = []  # copy_prefix calls: (src, dst, n)
        self.max_outstanding = 0

    def _next(self, slot: int, pos: int, chunk) -> int:
        if self.whole_context:  # any wrong position in the slot changes the next id
            return 1 + hash(tuple(self.kv[slot][: pos + 1])) % (VOCAB - 1)
        tok = self.kv[slot][pos]
        if chunk.temperature == 0:
            return (tok + 1) % VOCAB
        return 1 + hash((chunk.seed, chunk.counter, tok)) % 61

    def execute(self, chunks) -> FakeStep:
        self.steps.append(chunks)
        slots = [c.slot for c in chunks]
        assert len(slots) == len(set(slots)), "a slot twice in one step"
        n_tokens = sum(1 if c.from_previous else len(c.token_ids) for c in chunks)
        assert 0 < n_tokens <= self.max_batch_tokens
        out: dict[int, int] = {}
        sampled_now: dict[int, int] = {}
        for c in chunks:
            assert 0 <= c.slot < self.max_slots
            if c.from_previous:
                assert self.readback != "sync", "from_previous on the sync path"
                assert c.token_ids is None
                assert c.slot in self.last_sample, "from_previous without a sample last step"
                ids = [self.last_sample[c.slot]]
            else:
                ids = list(c.token_ids)
            # As ModelRunner: a chunk may start at any written position (a reused prefix).
            assert c.start_pos <= len(self.kv[c.slot]), (
                f"slot {c.slot}: write at {c.start_pos} but {len(self.kv[c.slot])} written"
            )
            assert c.start_pos + len(ids) <= self.max_model_len
            self.kv[c.slot][c.start_pos :] = ids
            if c.sample:
                tok = self._next(c.slot, len(self.kv[c.slot]) - 1, c)
                out[c.slot] = tok
                sampled_now[c.slot] = tok
        self.last_sample = sampled_now
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        if self.readback == "sync":
            assert self.outstanding == 1
        return FakeStep(self, out)

    def seq_len(self, slot: int) -> int:
        return len(self.kv[slot])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        assert src != dst and 0 <= n <= len(self.kv[src])
        self.kv[dst] = self.kv[src][:n]
        self.last_sample.pop(dst, None)
        self.copies.append((src, dst, n))

    def free_slot(self, slot: int, keep: int = 0) -> None:
        self.kv[slot] = self.kv[slot][:keep]
        self.last_sample.pop(slot, None)
        self.freed.append(slot)


def _engine(
    readback: str = "host_view", prefix_caching: bool = True, **kw
) -> tuple[Engine, FakeRunner]:
    runner = FakeRunner(readback, **kw)
    return Engine(runner, FakeTokenizer(), prefix_caching=prefix_caching), runner


def _run(engine: Engine, earlier: list | None = None) -> dict[str, object]:
    """Step until done; ``earlier`` holds outputs of steps the test took itself."""
    finals = {}
    streamed: dict[str, str] = {}
    pending = list(earlier or [])
    for _ in range(10_000):
        if not pending and not engine.has_unfinished():
            break
        outs, pending = pending + engine.step(), []
        for out in outs:
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.delta_text
            assert out.text == streamed[out.request_id]
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished()
    return finals


GREEDY = SamplingParams(temperature=0.0, max_tokens=5)


@pytest.mark.parametrize("readback", ["host_view", "sync"])
def test_greedy_continuation_and_max_tokens(readback: str) -> None:
    engine, runner = _engine(readback)
    rid = engine.add_request([5, 6], GREEDY)
    out = _run(engine)[rid]
    assert out.ids == [7, 8, 9, 10, 11]
    assert out.text == "t7 t8 t9 t10 t11 "
    assert out.finish_reason == "length"
    assert out.prompt_ids == [5, 6]
    assert runner.freed == [0]


@pytest.mark.parametrize("readback", ["host_view", "sync", "async_d2h"])
@pytest.mark.parametrize("stop", [[], ["t9"]])
def test_a_final_only_request_has_one_output_with_everything(readback: str, stop: list) -> None:
    """final_only (LLM.generate, vt bench, a non-streaming answer): step() returns the
    request's output once, finished, with what an every-step request's last output has
    (ids, the stop-trimmed text, the reason) and all of it as its delta; num_generated
    says its progress in between, and names an id the engine does not hold."""
    engine, _ = _engine(readback)
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=stop)
    every = engine.add_request([5, 6], params)
    final = engine.add_request([5, 6], params, final_only=True)
    outs: dict[str, list] = {every: [], final: []}
    progress = []
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
        if not outs[final]:
            progress.append(engine.num_generated(final))
    assert len(outs[final]) == 1 and outs[final][0].finished
    assert len(outs[every]) > 1
    a, b = outs[every][-1], outs[final][0]
    assert (b.ids, b.text, b.finish_reason, b.stop_reason) == (
        a.ids, a.text, a.finish_reason, a.stop_reason
    )  # fmt: skip
    assert b.text == ("t7 t8 " if stop else "t7 t8 t9 t10 t11 t12 ")
    assert b.delta_ids == b.ids and b.delta_text == b.text
    assert progress == sorted(progress) and progress[-1] < len(b.ids)
    with pytest.raises(KeyError, match="no request 'nope'"):
        engine.num_generated("nope")
    with pytest.raises(KeyError, match=final):  # finished and returned
        engine.num_generated(final)


def test_async_overlaps_one_step_and_sync_does_not() -> None:
    engine, runner = _engine("async_d2h")
    engine.add_request([5], GREEDY)
    _run(engine)
    assert runner.max_outstanding == 2
    assert any(c.from_previous for step in runner.steps for c in step)
    engine, runner = _engine("sync")
    engine.add_request([5], GREEDY)
    _run(engine)
    assert runner.max_outstanding == 1


def test_async_and_sync_give_the_same_ids_for_many_requests() -> None:
    prompts = [
        [3],
        [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
        [40, 41],
        [50],
        [7, 7, 7],
        [20] * 30,
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 9, 30, 1, 12, 20)]
    params[2] = SamplingParams(temperature=0.9, seed=7, max_tokens=30)
    results = []
    for readback in ("host_view", "sync"):
        engine, _ = _engine(readback, max_slots=3, max_batch_tokens=8)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        finals = _run(engine)
        results.append([(finals[i].ids, finals[i].finish_reason) for i in ids])
    assert results[0] == results[1]


def test_eos_stops_and_is_kept_in_ids_but_not_text() -> None:
    engine, _ = _engine()
    rid = engine.add_request([61], SamplingParams(temperature=0.0, max_tokens=10))
    out = _run(engine)[rid]
    # 61 -> 62 (second half of "é", alone invalid) -> 63 ("é" first half) -> 0 (EOS)
    assert out.ids == [62, 63, 0]
    assert out.finish_reason == "stop" and out.stop_reason == 0
    assert out.text == "\ufffd\ufffd"  # lone halves of "é"; the last one flushed at the end


def test_ignore_eos_and_stop_token_ids() -> None:
    engine, _ = _engine()
    a = engine.add_request([62], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    b = engine.add_request([5], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[8]))
    finals = _run(engine)
    assert finals[a].ids == [63, 0, 1, 2] and finals[a].finish_reason == "length"
    assert finals[a].text == "\ufffdt1 t2 "  # 63 alone is an incomplete character
    assert finals[b].ids == [6, 7, 8] and finals[b].finish_reason == "stop"
    assert finals[b].stop_reason == 8


@pytest.mark.parametrize("readback", ["host_view", "sync"])
def test_stop_string_across_tokens_is_trimmed_and_never_streamed(readback: str) -> None:
    engine, runner = _engine(readback)
    engine.add_request([5], SamplingParams(temperature=0.0, max_tokens=20, stop="8 t9"))
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.delta_text)
            if out.finished:
                final = out
    assert final.text == "t6 t7 t"
    assert "".join(deltas) == "t6 t7 t"
    assert final.finish_reason == "stop" and final.stop_reason == "8 t9"
    assert final.ids == [6, 7, 8, 9]
    if readback == "host_view":
        # The slot's wasted row may still be running: it is freed once that step is read.
        assert runner.freed == []
        assert engine.step() == []
    assert runner.freed == [0]


def test_earliest_of_several_stop_strings_wins() -> None:
    engine, _ = _engine()
    rid = engine.add_request(
        [5], SamplingParams(temperature=0.0, max_tokens=20, stop=["t9", "7 t8"])
    )
    out = _run(engine)[rid]
    assert out.text == "t6 t" and out.stop_reason == "7 t8"


def test_max_model_len_finishes_with_length() -> None:
    engine, runner = _engine(max_model_len=8)
    rid = engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=None))
    out = _run(engine)[rid]
    assert len(out.prompt_ids) + len(out.ids) == 8
    assert out.finish_reason == "length"
    assert max(len(runner.kv[s]) for s in runner.kv) <= 8


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    engine, runner = _engine(max_batch_tokens=4)
    prompt = list(range(1, 11))
    rid = engine.add_request(prompt, GREEDY)
    out = _run(engine)[rid]
    prefill_chunks = [c for step in runner.steps for c in step if c.token_ids and not c.sample]
    assert [len(c.token_ids) for c in prefill_chunks] == [4, 4]
    assert out.ids == [11, 12, 13, 14, 15]


def test_decode_rows_are_batched_and_requests_join_between_steps() -> None:
    engine, runner = _engine(max_slots=2, max_batch_tokens=8)
    ids = [engine.add_request([10 * i + 1], GREEDY) for i in range(4)]
    finals = _run(engine)
    assert [finals[i].ids[0] for i in ids] == [2, 12, 22, 32]
    assert max(len(step) for step in runner.steps) == 2  # two rows per step, never more
    assert sorted(runner.freed) == [0, 0, 1, 1]  # four requests through two slots


@pytest.mark.parametrize(
    "prompt, match",
    [([], "empty"), ([1] * 64, "max_model_len is 64"), ([1, VOCAB], "outside the vocabulary")],
)
def test_bad_prompt_is_refused_without_disturbing_others(prompt, match) -> None:
    engine, _ = _engine()
    good = engine.add_request([5], GREEDY)
    earlier = engine.step()
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, GREEDY)
    out = _run(engine, earlier)[good]
    assert out.ids == [6, 7, 8, 9, 10]


def test_duplicate_request_id_is_refused() -> None:
    engine, _ = _engine()
    engine.add_request([5], GREEDY, request_id="a")
    with pytest.raises(RequestError, match="'a' is already in use"):
        engine.add_request([5], GREEDY, request_id="a")


@pytest.mark.parametrize("readback", ["host_view", "sync"])
def test_abort_frees_the_slot_and_others_continue(readback: str) -> None:
    engine, runner = _engine(readback, max_slots=1)
    a = engine.add_request([5], SamplingParams(temperature=0.0, max_tokens=50))
    b = engine.add_request([20], GREEDY)
    earlier = engine.step() + engine.step()
    assert engine.abort(a)
    assert not engine.abort(a)
    finals = _run(engine, earlier)
    assert a not in finals
    assert finals[b].ids == [21, 22, 23, 24, 25]


def test_seeded_sampling_is_reproducible_and_differs_by_seed() -> None:
    def run(seed: int) -> list[int]:
        engine, _ = _engine()
        rid = engine.add_request([5], SamplingParams(temperature=1.0, seed=seed, max_tokens=8))
        return _run(engine)[rid].ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_timings_are_reported() -> None:
    engine, _ = _engine()
    rid = engine.add_request([1, 2, 3], GREEDY)
    t = _run(engine)[rid].timings
    assert t.prompt_tokens == 3 and t.generated_tokens == 5
    assert t.prefill_tok_s is not None and t.prefill_tok_s > 0
    assert t.decode_tok_s is not None and t.decode_tok_s > 0


def test_every_output_is_a_whole_model_of_its_own() -> None:
    """Each step's output has every field set (none left at a default the engine forgot),
    round-trips through model_dump, and shares no list with another output: a caller may
    keep or change one without touching the next."""
    engine, _ = _engine()
    rid = engine.add_request([1, 2, 3], GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 5 and [len(o.ids) for o in outs] == [1, 2, 3, 4, 5]
    for out in outs:
        assert out.model_fields_set == set(RequestOutput.model_fields)
        assert out.timings.model_fields_set == set(Timings.model_fields)
        assert RequestOutput.model_validate(out.model_dump()) == out
    assert outs[-1].timings.generated_tokens == 5 and outs[0].timings.generated_tokens == 1
    outs[0].ids.append(99)
    outs[1].delta_ids.append(99)
    assert outs[2].ids == [4, 5, 6] and outs[2].delta_ids == [6]
    assert outs[-1].request_id == rid and outs[-1].finished


def test_runner_error_aborts_everything_and_engine_recovers() -> None:
    engine, runner = _engine()
    engine.add_request([5], GREEDY)
    real = runner.execute

    def boom(chunks):
        raise RuntimeError("device lost")

    runner.execute = boom
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert not engine.has_unfinished()
    runner.execute = real
    runner.kv = {s: [] for s in runner.kv}
    rid = engine.add_request([5], GREEDY)
    assert _run(engine)[rid].ids == [6, 7, 8, 9, 10]
