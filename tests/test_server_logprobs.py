"""Issue 11: ``logprobs`` / ``top_logprobs`` on completions and chat completions, and
``echo`` on completions.

They come from the logits the step already computed (the op ``logprobs`` on the device for
the rows that ask, its few results read back with the sampled ids; the host fallback on a
backend without it), as the model's distribution before temperature, top-k and top-p; the
sampled ids do not change. ``echo`` prepends the prompt, and with ``logprobs`` scores it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import vt
from server_support import MODEL, check_serves, client, request, serving
from vt.execution.runner import SeqChunk
from vt.frontends.server import Server
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "hello there, how are you today?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("logprobs") / "tiny.gguf", tied=False)


# Prefix caching off on both sides: a reused prefix leaves fewer rows to a step, which
# may take another kernel (tests/test_prefix_cache.py); these tests compare logprobs with
# a recomputation to 1e-5 and less.
@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1, prefix_caching=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    with (
        vt.LLM(
            model=tiny, backend="cpu", max_slots=2, max_batch_tokens=8, prefix_caching=False
        ) as llm,
        serving(llm) as srv,
    ):
        yield srv


def offline(ref: vt.LLM, prompt: str, n: int, k: int, **kw: Any) -> vt.frontends.llm.RequestOutput:
    params = vt.SamplingParams(
        **{"temperature": 0.0, "max_tokens": n, "ignore_eos": True, "logprobs": k, **kw}
    )
    return ref.generate(prompt, params)[0]


def test_logprobs_are_the_models_distribution_and_ids_do_not_change(ref: vt.LLM) -> None:
    plain = ref.generate(PROMPT, vt.SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))[0]  # fmt: skip
    with_lp = offline(ref, PROMPT, 12, 5)
    assert with_lp.ids == plain.ids and with_lp.text == plain.text
    assert plain.logprobs is None
    assert [e.token_id for e in with_lp.logprobs] == with_lp.ids
    for e in with_lp.logprobs:  # greedy: the sampled id is the most likely one
        assert len(e.top) == 5 and e.top[0].token_id == e.token_id
        assert e.top[0].logprob == e.logprob
        assert [t.logprob for t in e.top] == sorted((t.logprob for t in e.top), reverse=True)
        assert e.logprob <= 0
    # The first token's logprobs against the logits of the prompt, computed apart.
    runner = ref.runner
    ids = ref.encode(PROMPT)
    logits = runner.compute_logits([SeqChunk(slot=0, start_pos=0, token_ids=ids)])[0]
    runner.free_slot(0)
    x = logits.astype(np.float64)
    lp = x - x.max() - math.log(np.exp(x - x.max()).sum())
    first = with_lp.logprobs[0]
    # float64 log-softmax, rounded to float32 (the op's outputs)
    assert first.logprob == pytest.approx(float(np.float32(lp[first.token_id])), abs=1e-12)
    assert [t.token_id for t in first.top] == list(np.argsort(-lp, kind="stable")[:5])
    # Sampling at a temperature reports the same distribution (temperature 1's logits).
    seeded = offline(ref, PROMPT, 6, 0, temperature=0.8, seed=3)
    assert (
        seeded.ids
        == ref.generate(
            PROMPT, vt.SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
        )[0].ids
    )
    assert seeded.logprobs[0].top == [] and seeded.logprobs[0].token_id == seeded.ids[0]


def test_completion_logprobs(server: Server, ref: vt.LLM) -> None:
    want = offline(ref, PROMPT, 8, 3)
    c = client(server.url)
    got = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want.text
    # Equal up to float32 rounding: the server prefills in chunks of 8, the reference at once.
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    tok = ref.tokenizer
    assert lp.tokens == [tok.token_bytes(i).decode("utf-8", "replace") for i in want.ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for top, e in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert max(top.values()) == pytest.approx(e.logprob, abs=1e-5) and len(top) <= 4
    streamed = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    values = [v for ch in streamed if ch.choices and ch.choices[0].logprobs
              for v in ch.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert values == lp.token_logprobs


def test_chat_logprobs(server: Server, ref: vt.LLM) -> None:
    params = vt.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = ref.chat(CHAT, params)[0]
    c = client(server.url)
    got = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = got.choices[0].logprobs.content
    want_values = [e.logprob for e in want.logprobs]
    assert [x.logprob for x in content] == pytest.approx(want_values, abs=1e-5)
    for x, i in zip(content, want.ids, strict=True):
        raw = ref.tokenizer.token_bytes(i)
        assert x.bytes == list(raw) and x.token == raw.decode("utf-8", "replace")
        assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob
    plain = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == got.choices[0].message.content
    streamed = c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    values = [x.logprob for ch in streamed if ch.choices and ch.choices[0].logprobs
              for x in ch.choices[0].logprobs.content]  # fmt: skip
    assert values == [x.logprob for x in content]


def test_logprobs_limits_and_off(server: Server, tiny: Path, ref: vt.LLM) -> None:
    reply = request(server.port, "POST", "/v1/completions", {"prompt": "Hi", "logprobs": 21})
    assert reply.status == 400 and reply.body["error"]["param"] == "logprobs"
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        from vt.frontends.server import Limits

        with serving(llm, limits=Limits(max_logprobs=0)) as srv:
            assert not llm.runner.logprobs_enabled  # no logits copies allocated
            reply = request(srv.port, "POST", "/v1/completions", {"prompt": "Hi", "logprobs": 1})
            assert reply.status == 400 and "turned off" in reply.body["error"]["message"]
            check_serves(srv.port, ref)


@pytest.mark.parametrize(
    ("backend", "async_scheduling"), [("cpu", False), ("tt_stub", True), ("tt_stub", False)]
)
def test_logprobs_agree_on_every_readback_path(
    tiny: Path, ref: vt.LLM, backend: str, async_scheduling: bool
) -> None:
    want = offline(ref, PROMPT, 10, 2)
    with vt.LLM(model=tiny, backend=backend, max_slots=1, async_scheduling=async_scheduling) as llm:
        assert llm.readback == ("host_view" if backend == "cpu" and async_scheduling else "sync")
        got = offline(llm, PROMPT, 10, 2)
    assert got.ids == want.ids
    # the same backend on another readback path: the same values; tt_stub (vt.reference's
    # numpy ops) against cpu's numba kernels: the forward passes round differently, so
    # within the logits' end-to-end error, not bit for bit
    tol = 1e-6 if backend == "cpu" else 1e-3
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=tol)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


# --------------------------------------------------------------------------- echo


def test_echo_prepends_the_prompt_text(server: Server, ref: vt.LLM) -> None:
    want = offline(ref, PROMPT, 5, 0).text
    c = client(server.url)
    got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                               echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert got.choices[0].text == PROMPT + want and got.choices[0].logprobs is None
    assert got.usage.completion_tokens == 5
    ids = ref.encode(PROMPT)
    as_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0,
                                  echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    assert as_ids.choices[0].text == ref.tokenizer.decode(ids) + want
    streamed = c.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=5,
                                    temperature=0, echo=True, stream=True,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts[0] == PROMPT + want and texts[1].startswith("Hello")


def test_echo_with_logprobs_scores_the_prompt(server: Server, ref: vt.LLM) -> None:
    """OpenAI's legacy shape: one entry per prompt token (the first null), then one per
    generated token; the prompt's entries are each token's logprob given the ones before
    it, the generated ones those of the same request without echo."""
    c = client(server.url)
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "logprobs": 2,
                          "extra_body": {"ignore_eos": True}}  # fmt: skip
    got = c.completions.create(prompt=PROMPT, echo=True, **kw)
    plain = c.completions.create(prompt=PROMPT, **kw)
    lp, ids = got.choices[0].logprobs, ref.encode(PROMPT)
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    tok = ref.tokenizer
    assert lp.tokens[:n] == [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    # with echo the prompt's rows are scored in a step of several rows, which the cpu
    # backend multiplies with another kernel than a one-row step: equal within the logits'
    # end-to-end error
    tol = 1e-3
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=tol)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 4)]
    want = ref.generate(PROMPT, vt.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    scored = want[0].prompt_logprobs
    assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in scored[1:]], abs=tol)
    for top, e, t in zip(lp.top_logprobs[1:n], scored[1:], lp.tokens[1:n], strict=True):
        assert t in top and len(top) <= 3 and top[t] == pytest.approx(e.logprob, abs=tol)
    assert got.choices[0].text == PROMPT + plain.choices[0].text
    streamed = c.completions.create(prompt=PROMPT, echo=True, stream=True, **kw)
    values = [v for ch in streamed if ch.choices and ch.choices[0].logprobs
              for v in ch.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert values == lp.token_logprobs


def test_an_echo_request_beside_others_changes_no_answer(server: Server, ref: vt.LLM) -> None:
    """Scoring a long prompt takes a few rows of logits a step (max_slots=2 here) while
    another request decodes; both answers equal their solo runs, then a normal request."""
    import threading

    c = client(server.url)
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    results: dict[str, Any] = {}

    def echo() -> None:
        results["echo"] = c.completions.create(
            model=MODEL, prompt=long_prompt, max_tokens=3, temperature=0, echo=True,
            logprobs=1, extra_body={"ignore_eos": True},
        )  # fmt: skip

    t = threading.Thread(target=echo)
    t.start()
    other = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})  # fmt: skip
    t.join(30)
    assert other.choices[0].text == offline(ref, PROMPT, 12, 0).text
    got = results["echo"].choices[0]
    assert got.text == long_prompt + offline(ref, long_prompt, 3, 0).text
    assert len(got.logprobs.tokens) == len(ref.encode(long_prompt)) + 3
    assert all(v is not None for v in got.logprobs.token_logprobs[1:])
    check_serves(server.port, ref)
