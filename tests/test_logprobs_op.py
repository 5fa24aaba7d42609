"""The ``logprobs`` op in the runner: launched only for the rows that ask, read back with
the sampled ids (a few bytes, not the logits), the host fallback on a backend without it,
and decode graphs that stay the same whether a step asks or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import vt
from fake_gpu import make
from vt.execution.runner import ModelRunner, SeqChunk
from vt.model import load_gguf
from vt.testing.tiny import write_tiny_gguf

PROMPTS = {0: [1, 5, 9, 2], 1: [3, 3, 7]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("lp") / "tiny.gguf", tied=False)


@pytest.fixture(scope="module")
def model(tiny: Path) -> Iterator[vt.model.ModelFile]:
    with load_gguf(tiny) as m:
        yield m


def backend(name: str) -> vt.Backend:
    return vt.management.registry.Registry(env={}).create_backend(name)[0]


def decode(
    runner: ModelRunner, steps: int, asks: dict[int, int | None], temperature: float = 0.0
) -> list[tuple[dict[int, int], dict]]:
    """Prefill both prompts, then ``steps`` decode steps; ``asks[slot]`` is the chunks'
    ``logprobs``. Returns each step's (ids, logprobs)."""
    chunks = [
        SeqChunk(slot=s, start_pos=0, token_ids=ids, logprobs=asks[s], temperature=temperature,
                 seed=7, counter=0)
        for s, ids in PROMPTS.items()
    ]  # fmt: skip
    out = runner.execute(chunks)
    got = [(out.get_output(), out.get_logprobs())]
    pos = {s: len(ids) for s, ids in PROMPTS.items()}
    for step in range(steps):
        chunks = [
            SeqChunk(slot=s, start_pos=pos[s], token_ids=None, from_previous=True,
                     logprobs=asks[s], temperature=temperature, seed=7, counter=step + 1)
            for s in PROMPTS
        ]  # fmt: skip
        out = runner.execute(chunks)
        got.append((out.get_output(), out.get_logprobs()))
        for s in PROMPTS:
            pos[s] += 1
    for s in PROMPTS:
        runner.free_slot(s)
    return got


def test_the_device_op_equals_the_host_fallback_and_reads_back_bytes_not_logits(
    model: vt.model.ModelFile,
) -> None:
    """On cpu, the native op against the host fallback: the same ids, logprobs equal up to
    the op's float32 rounding; slot 1 asks for none, slot 0 for 3 alternatives."""
    asks = {0: 3, 1: None}
    runs = {}
    for on_device in (True, False):
        be = backend("cpu")
        with ModelRunner(be, model, max_slots=2, graphs=False) as r:
            r.enable_logprobs(5, on_device=on_device)
            assert r.logprobs_on_device is on_device
            runs[on_device] = decode(r, 4, asks, temperature=0.9)
            assert r._pool is not None
            read = r._pool.lp_bytes_read
        be.close()
        if on_device:  # chosen + 3 (id, logprob) pairs per step, for the one asking row
            assert read == 5 * 4 * (1 + 2 * 3)
        else:  # a logits row per step
            assert read == 5 * model.config.vocab_size * 4
    for (ids_d, lp_d), (ids_h, lp_h) in zip(runs[True], runs[False], strict=True):
        assert ids_d == ids_h and set(lp_d) == set(lp_h) == {0}
        (c_d, top_d), (c_h, top_h) = lp_d[0], lp_h[0]
        assert c_d == pytest.approx(c_h, rel=1e-6) and c_d == float(np.float32(c_h))
        assert [t for t, _ in top_d] == [t for t, _ in top_h] and len(top_d) == 3
        assert [v for _, v in top_d] == [float(np.float32(v)) for _, v in top_h]


def test_tt_stub_takes_the_host_fallback(model: vt.model.ModelFile) -> None:
    cpu, tt = backend("cpu"), backend("tt_stub")
    try:
        assert not tt.supports("logprobs") and cpu.supports("logprobs")
        results = []
        for be in (cpu, tt):
            with ModelRunner(be, model, max_slots=2) as r:
                r.enable_logprobs(2)
                assert r.logprobs_on_device is (be is cpu)
                results.append(decode(r, 2, {0: 2, 1: 0}))
        for (ids_c, lp_c), (ids_t, lp_t) in zip(*results, strict=True):
            assert ids_c == ids_t
            for slot in (0, 1):
                assert lp_c[slot][0] == pytest.approx(lp_t[slot][0], abs=1e-5)
                assert [t for t, _ in lp_c[slot][1]] == [t for t, _ in lp_t[slot][1]]
            assert lp_c[1][1] == [] and len(lp_c[0][1]) == 2
        with ModelRunner(tt, model, max_slots=2) as r:
            with pytest.raises(ValueError, match="does not implement the op logprobs"):
                r.enable_logprobs(2, on_device=True)
    finally:
        cpu.close()
        tt.close()


def test_a_step_with_logprobs_replays_the_same_decode_graph(model: vt.model.ModelFile) -> None:
    """The op runs eagerly after the replay: asking or not, one graph per shape, and the
    logprobs of replayed steps equal those of eager ones."""
    be = backend("cpu")
    try:
        with ModelRunner(be, model, max_slots=2, graphs=False) as r:
            r.enable_logprobs(4)
            eager = decode(r, 5, {0: 4, 1: 1})
        with ModelRunner(be, model, max_slots=2, graphs=True) as r:
            r.enable_logprobs(4)
            assert r.graphs
            replayed = decode(r, 5, {0: 4, 1: 1})
            stats = r.graph_stats
            plain = decode(r, 3, {0: None, 1: None})  # the same shape, no logprobs
            assert r.graph_stats["captures"] == stats["captures"] == 1
        assert stats["replays"] == 4 and all(lp == {} for _, lp in plain[1:])
        assert replayed == eager
    finally:
        be.close()


def test_on_the_gpu_a_step_launches_the_op_for_the_asking_rows_only(tmp_path: Path) -> None:
    """The fake GPU: the kernel gets the asking rows (staged with the inputs), and the
    readback copies m * (1 + 2k) values on the copy stream, never a logits row."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama")
    gpu, rt = make()
    with load_gguf(path) as m, ModelRunner(gpu, m, max_slots=4, graphs=False) as r:
        r.enable_logprobs(20)
        assert r.logprobs_on_device and r.readback == "async_d2h"
        vocab = m.config.vocab_size
        r.execute([SeqChunk(slot=s, start_pos=0, token_ids=[1, 2]) for s in range(3)])
        rt.calls.clear()
        rt.launches.clear()
        chunks = [
            SeqChunk(slot=s, start_pos=2, token_ids=None, from_previous=True, logprobs=k)
            for s, k in ((0, None), (1, 2), (2, 5))
        ]
        out = r.execute(chunks)
        launch = rt.launches[-1]
        assert launch.kernel == "logprobs" and launch.grid == (2, 1, 1)
        assert launch.args[-4:] == [2, 5, 3, vocab]  # m asking rows, k, rows of logits
        copies = [a[2] for n, a in rt.calls if n == "memcpy_d2h"]
        assert copies == [4 * 4, 4 * 2 * (1 + 2 * 5)]  # the ids, then the op's results
        assert max(copies) < vocab * 4
        out.get_output()
        assert set(out.get_logprobs()) == {1, 2}
        rt.calls.clear()
        rt.launches.clear()
        plain = [SeqChunk(slot=s, start_pos=3, token_ids=None, from_previous=True) for s in (0, 1)]
        r.execute(plain).get_output()
        assert all(x.kernel != "logprobs" for x in rt.launches)


def test_bad_logprobs_requests_are_refused_before_anything_runs(model: vt.model.ModelFile) -> None:
    be = backend("cpu")
    try:
        with ModelRunner(be, model, max_slots=2) as r:
            chunk = SeqChunk(slot=0, start_pos=0, token_ids=[1], logprobs=2)
            with pytest.raises(vt.execution.runner.InvalidStepError, match="not enabled"):
                r.execute([chunk])
            r.enable_logprobs(3)
            with pytest.raises(vt.execution.runner.InvalidStepError, match="must be in 0..3"):
                r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1], logprobs=4)])
            with pytest.raises(ValueError, match="max_logprobs must be in 0..20"):
                r.enable_logprobs(21)
            with pytest.raises(ValueError, match="already enabled on the other path"):
                r.enable_logprobs(3, on_device=False)
            assert r.execute([chunk]).get_output()  # still works
            r.free_slot(0)
            # more alternatives later: the buffers grow, a step still in flight keeps its
            pending = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 4], logprobs=3)])
            r.enable_logprobs(7)
            assert len(pending.get_output()) == 1 and len(pending.get_logprobs()[0][1]) == 3
            r.free_slot(0)
            out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 4], logprobs=7)])
            out.get_output()
            assert out.get_logprobs()[0][1][:3] == pending.get_logprobs()[0][1]
    finally:
        be.close()


# --------------------------------------------------------------------------- prompt logprobs


def _prefix_logprobs(ref: vt.LLM, ids: list[int]) -> list[float]:
    """logprob of ids[i] given ids[:i], for i >= 1: one prefill per prefix, float64."""
    runner = ref.runner
    out = []
    for i in range(1, len(ids)):
        x = runner.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=ids[:i])])[0]
        runner.free_slot(0)
        x = x.astype(np.float64)
        out.append(float(x[ids[i]] - x.max() - np.log(np.exp(x - x.max()).sum())))
    return out


@pytest.mark.parametrize("name", ["cpu", "tt_stub"])
def test_prompt_logprobs_score_every_prompt_token_a_few_rows_a_step(tiny: Path, name: str) -> None:
    """max_slots=2: two rows of logits a step, so a 9-token prompt is scored over 5 steps
    while another request decodes beside it; each entry is the logprob of that prompt token
    given the ones before it (the device op on cpu, the host fallback on tt_stub)."""
    prompt = [3, 17, 42, 5, 9, 60, 1, 33, 21]
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as ref:
        want = _prefix_logprobs(ref, prompt)
        ids = {"prompt_token_ids": prompt}
        plain = ref.generate(ids, vt.SamplingParams(temperature=0, max_tokens=4))[0]
    with vt.LLM(model=tiny, backend=name, max_slots=2) as llm:
        params = vt.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, logprobs=1)
        other = vt.SamplingParams(temperature=0, max_tokens=12)
        both = llm.generate([{"prompt_token_ids": [8, 2, 50]}, ids], [other, params])
        got = both[1]
    assert got.ids == plain.ids  # scoring the prompt changes nothing generated
    lp = got.prompt_logprobs
    assert lp is not None and len(lp) == len(prompt) and lp[0] is None
    assert [e.token_id for e in lp[1:]] == prompt[1:]
    # another row count takes another kernel (the cpu backend's row and tile matmuls sum
    # in other orders): equal within the logits' end-to-end error, not bit for bit
    assert [e.logprob for e in lp[1:]] == pytest.approx(want, abs=1e-3)
    for e in lp[1:]:
        assert len(e.top) == 3 and e.top[0].logprob >= e.logprob - 1e-6
    assert both[0].prompt_logprobs is None and len(got.logprobs) == len(got.ids)


def test_bad_prompt_scoring_chunks_are_refused(model: vt.model.ModelFile) -> None:
    be = backend("cpu")
    try:
        with ModelRunner(be, model, max_slots=2) as r:
            r.enable_logprobs(2)
            bad = [
                (dict(prompt_logprobs=1, prompt_targets=[1]), "2 scored rows"),
                (dict(prompt_logprobs=3, prompt_targets=[1, 2]), "must be in 0..2"),
                (dict(prompt_logprobs=1, prompt_targets=[1, 10**6]), "outside the vocabulary"),
                (dict(prompt_logprobs=1), "need a prompt chunk"),
            ]
            for kw, message in bad:
                chunk = SeqChunk(slot=0, start_pos=0, token_ids=[1, 2, 3], **kw)
                with pytest.raises(vt.execution.runner.InvalidStepError, match=message):
                    r.execute([chunk])
            many = SeqChunk(slot=0, start_pos=0, token_ids=[1, 2, 3, 4], sample=False,
                            prompt_logprobs=0, prompt_targets=[2, 3, 4, 5])  # fmt: skip
            with pytest.raises(vt.execution.runner.InvalidStepError, match="rows of logits"):
                r.execute([many])
            out = r.execute([SeqChunk(slot=0, start_pos=0, token_ids=[1, 2], sample=False,
                                      prompt_logprobs=0, prompt_targets=[2, 3])])  # fmt: skip
            assert out.get_output() == {}
            assert [t for t, _, _ in out.get_prompt_logprobs()[0]] == [2, 3]
    finally:
        be.close()
