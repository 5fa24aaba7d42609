"""vt serve: the real HTTP server on 127.0.0.1 (a free port) over a tiny GGUF on the cpu
backend, driven by the official ``openai`` client and by raw HTTP for malformed input.

Expected answers come from a separate ``vt.LLM`` on the same file (same engine code, run
offline), so "equals its solo result" means equal to that request run alone.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import vt
from click.testing import CliRunner
from server_support import step_delay
from vt.frontends.cli import main
from vt.frontends.server import Server, bind
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)

MODEL = "tiny"
SLOTS = 2
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["The capital of France is", "Hello world!", "What is the answer? The answer is"]
CHAT = [{"role": "user", "content": "hello there, how are you today?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Untied output weights: the tied tiny model mostly repeats its last token.
    return write_tiny_gguf(tmp_path_factory.mktemp("serve") / "tiny.gguf", tied=False)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    """The offline engine on the same model: the expected answers."""
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    # Small steps (8 tokens) so prompts prefill in chunks beside running decodes.
    llm = vt.LLM(model=tiny, backend="cpu", max_slots=SLOTS, max_batch_tokens=8)
    srv = Server(llm, host="127.0.0.1", port=0, model_name=MODEL, log_level="warning")
    srv.start()
    yield srv
    srv.stop()
    llm.close()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.fixture
def slow_steps(server: Server) -> Iterator[Callable[[float], None]]:
    """``slow_steps(seconds)``: each engine step takes at least that long (restored after)."""
    with step_delay(server.llm.runner) as set_delay:
        yield set_delay


def solo(ref: vt.LLM, prompt: str, **kw: Any) -> vt.frontends.llm.RequestOutput:
    params = vt.SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})
    return ref.generate(prompt, params)[0]


def raw(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP request with exactly ``body`` (bytes as given, else JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def health(server: Server) -> dict[str, Any]:
    status, body = raw(server, "GET", "/health")
    assert status == 200
    return body


def wait_idle(server: Server, within: float) -> float:
    """Seconds until the engine runs and queues nothing; fails after ``within``."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        h = health(server)
        if h["running"] == 0 and h["waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    pytest.fail(f"the engine still holds requests after {within} s: {health(server)}")


# --------------------------------------------------------------------------- basics


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vt"
    assert models.data[0].max_model_len == server.llm.max_model_len
    h = health(server)
    assert h["status"] == "ok" and h["model"] == MODEL and h["backend"] == "cpu"


def test_completion_greedy_equals_llm(client: openai.OpenAI, ref: vt.LLM) -> None:
    want = solo(ref, PROMPTS[0], max_tokens=12)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, **GREEDY)
    assert got.object == "text_completion" and got.model == MODEL
    (choice,) = got.choices
    assert choice.text == want.text and choice.index == 0
    assert choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_ids)
    assert got.usage.completion_tokens == 12
    assert got.usage.total_tokens == len(want.prompt_ids) + 12


def test_completion_stream_equals_llm(client: openai.OpenAI, ref: vt.LLM) -> None:
    want = solo(ref, PROMPTS[1], max_tokens=10)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_completion_prompt_shapes(client: openai.OpenAI, ref: vt.LLM) -> None:
    want = [solo(ref, p, max_tokens=6) for p in PROMPTS]
    ids = ref.encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == want[0].text
    many = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [w.text for w in want]
    assert many.usage.prompt_tokens == sum(len(w.prompt_ids) for w in want)
    assert many.usage.completion_tokens == 18
    lists = client.completions.create(
        model=MODEL, prompt=[ref.encode(p) for p in PROMPTS[:2]], max_tokens=6, **GREEDY
    )
    assert [c.text for c in lists.choices] == [w.text for w in want[:2]]
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, stream=True, **GREEDY
    ):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [w.text for w in want]


def test_sampling_params_reach_the_engine(client: openai.OpenAI, ref: vt.LLM) -> None:
    seeded = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 11}
    want = solo(ref, PROMPTS[2], max_tokens=10, **seeded)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[2],
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=11,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    assert got.choices[0].text == want.text
    # A stop string taken from the greedy answer ends it there, trimmed.
    full = solo(ref, PROMPTS[0], max_tokens=12).text
    stop = full[4:6]
    want = solo(ref, PROMPTS[0], max_tokens=12, stop=[stop])
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, stop=stop, **GREEDY
    )
    assert got.choices[0].text == want.text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].stop_reason == stop


def test_chat_equals_llm_chat(client: openai.OpenAI, ref: vt.LLM) -> None:
    params = vt.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = ref.chat(CHAT, params)[0]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, **GREEDY)
    assert got.object == "chat.completion"
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(ref.encode(ref.render_chat(CHAT)))
    assert got.usage.completion_tokens == 10
    # max_completion_tokens is the newer name of max_tokens.
    newer = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, **GREEDY
    )
    assert newer.choices[0].message.content == want.text


def test_chat_stream_equals_llm_chat(client: openai.OpenAI, ref: vt.LLM) -> None:
    params = vt.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    messages = [{"role": "system", "content": "Be brief."}, *CHAT]
    want = ref.chat(messages, params)[0]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8
    # Text parts are joined; the model sees the same prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    got = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, **GREEDY)
    assert got.choices[0].message.content == ref.chat(CHAT, params)[0].text


# --------------------------------------------------------------------------- batching


def test_concurrent_requests_each_equal_their_solo_result(
    client: openai.OpenAI, ref: vt.LLM
) -> None:
    # Six requests on two slots: some wait for a slot, all join the batch as slots free up.
    jobs = [(PROMPTS[i % 3], 4 + 3 * i) for i in range(6)]
    want = [solo(ref, p, max_tokens=n).text for p, n in jobs]
    got: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        prompt, n = jobs[i]
        try:
            if i % 2:
                stream = client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=n, stream=True, **GREEDY
                )
                got[i] = "".join(c.choices[0].text for c in stream)
            else:
                r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, **GREEDY)
                got[i] = r.choices[0].text
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert [got[i] for i in range(len(jobs))] == want


def test_request_joins_while_another_decodes(
    server: Server, client: openai.OpenAI, ref: vt.LLM, slow_steps: Callable[[float], None]
) -> None:
    slow_steps(0.005)  # the long request takes about 100 * 5 ms
    long_want = solo(ref, PROMPTS[0], max_tokens=100).text
    short_want = solo(ref, PROMPTS[1], max_tokens=5).text
    times: list[float] = []
    texts: list[str] = []
    started = threading.Event()

    def long_request() -> None:
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=100, stream=True, **GREEDY
        )
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            times.append(time.monotonic())
            if len(times) == 3:
                started.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(10)
    short = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, **GREEDY)
    short_done = time.monotonic()
    running_then = health(server)["running"]
    t.join(30)
    assert short.choices[0].text == short_want
    assert "".join(texts) == long_want
    # The short request was answered while the long one was still streaming its tokens.
    assert short_done < times[-1]
    assert running_then == 1


def test_client_disconnect_frees_the_slot(
    server: Server, client: openai.OpenAI, ref: vt.LLM, slow_steps: Callable[[float], None]
) -> None:
    # Left alone, each of these would decode to max_model_len: 250 steps of 20 ms (5 s).
    slow_steps(0.02)
    streams = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=None, stream=True, **GREEDY)
        for p in PROMPTS[:SLOTS]
    ]
    for stream in streams:
        next(iter(stream))
    assert health(server)["running"] == SLOTS  # every slot is taken
    for stream in streams:
        stream.close()
    assert wait_idle(server, within=2.0) < 2.0
    # A non-streaming request whose client times out is aborted too.
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.3).completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=None, **GREEDY
        )
    wait_idle(server, within=2.0)
    slow_steps(0.0)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, **GREEDY)
    assert got.choices[0].text == solo(ref, PROMPTS[2], max_tokens=6).text


def test_engine_failure_is_a_500_and_the_server_keeps_serving(
    server: Server, client: openai.OpenAI, ref: vt.LLM
) -> None:
    runner = server.llm.runner
    original = runner.execute
    calls = {"n": 0}

    def failing(chunks: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:  # in the middle of decoding
            raise RuntimeError("injected device fault")
        return original(chunks)

    failed_before = health(server)["failed_steps"]
    runner.execute = failing
    try:
        with pytest.raises(openai.InternalServerError, match="injected device fault"):
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, **GREEDY)
        calls["n"] = 0
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, stream=True, **GREEDY
        )
        with pytest.raises(openai.APIError, match="injected device fault"):
            for _ in stream:
                pass
    finally:
        runner.execute = original
    assert health(server)["failed_steps"] == failed_before + 2
    wait_idle(server, within=2.0)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, **GREEDY)
    assert got.choices[0].text == solo(ref, PROMPTS[0], max_tokens=8).text


# --------------------------------------------------------------------------- bad input

COMPLETION_ERRORS = [
    ({"temperature": -1}, "temperature", "temperature must be a finite number >= 0"),
    ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"top_k": -5}, "top_k", "top_k must be >= 0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"seed": -1}, "seed", "seed must be between 0 and"),
    ({"n": 2}, "n", "only n=1 is supported"),
    ({"stop": ""}, "stop", "stop strings must not be empty"),
    ({"stop": [1]}, "stop", "stop: must be a string or a list of strings"),
    ({"temperature": "hot"}, "temperature", "temperature: Input should be a valid number"),
    ({"stream": "maybe"}, "stream", "stream: Input should be a valid boolean"),
    ({"temprature": 0.5}, "temprature", "temprature: unknown parameter"),
    ({"logprobs": 21}, "logprobs", "logprobs: at most 20 alternatives, got 21"),
    ({"logprobs": -1}, "logprobs", "logprobs must be >= 0"),
    ({"echo": "yes"}, "echo", "echo: Input should be a valid boolean"),
    ({"echo": True, "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"echo": True, "logprobs": 21}, "logprobs", "logprobs: at most 20 alternatives, got 21"),
    ({"presence_penalty": 0.5}, "presence_penalty", "penalties are not supported"),
    ({"prompt": None}, "prompt", "prompt: must be a string"),
    ({"prompt": 5}, "prompt", "must be a string, a list of strings, a list of token ids"),
    ({"prompt": []}, "prompt", "got an empty list"),
    ({"prompt": [1, "a"]}, "prompt", "a list mixing types"),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt 1 must be a non-empty list"),
    ({"prompt": [5, 99999]}, "prompt", "token ids [99999] are outside the vocabulary"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": "the " * 300}, "prompt", "but this server's max_model_len is 256"),
    ({"prompt": ["ok", "the " * 300]}, "prompt", "prompt[1]: the prompt has"),
]


@pytest.mark.parametrize(("change", "param", "message"), COMPLETION_ERRORS)
def test_bad_completion_request_is_400_naming_the_field(
    server: Server, change: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **change}
    # A streamed request is refused before its stream starts, with the same status.
    for extra in ({}, {"stream": True}) if "stream" not in change else ({},):
        status, got = raw(server, "POST", "/v1/completions", {**body, **extra})
        assert status == 400, got
        error = got["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error"


def test_missing_prompt_and_too_long_code(server: Server) -> None:
    status, got = raw(server, "POST", "/v1/completions", {"model": MODEL})
    assert status == 400 and got["error"]["message"] == "prompt: Field required"
    status, got = raw(server, "POST", "/v1/completions", {"prompt": "the " * 300})
    assert status == 400 and got["error"]["code"] == "context_length_exceeded"
    assert "tokens but this server's max_model_len is 256" in got["error"]["message"]


CHAT_ERRORS = [
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "messages.0.role"),
    (
        {"messages": [{"role": "user", "content": 5}]},
        "messages",
        "messages.0.content: must be a string",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
        "part 0: only text parts are supported, got 'image_url'",
    ),
    ({"messages": [{"role": "user"}], "extra": 1}, "extra", "extra: unknown parameter"),
    ({"messages": "hi"}, "messages", "messages: Input should be a valid array"),
    ({"messages": [{"role": "user", "content": "the " * 300}]}, "messages", "max_model_len"),
    ({"tools": [{"type": "function"}]}, "tools", "tool calling is not supported"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20 alternatives"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs: needs 'logprobs': true"),
    ({"max_completion_tokens": -3}, "max_completion_tokens", "max_completion_tokens must be"),
    ({"response_format": {"type": "json_object"}}, "response_format", "only response_format"),
]


@pytest.mark.parametrize(("change", "param", "message"), CHAT_ERRORS)
def test_bad_chat_request_is_400_naming_the_field(
    server: Server, change: dict[str, Any], param: str, message: str
) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **change}
    status, got = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 400, got
    assert message in got["error"]["message"]
    assert got["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "the request body is empty"),
        (b"{not json", "the request body is not valid JSON"),
        (b"[1, 2]", "the request body must be a JSON object"),
    ],
)
def test_malformed_body_is_400(server: Server, body: bytes, message: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, got = raw(server, "POST", path, body)
        assert status == 400 and message in got["error"]["message"]


def test_unknown_model_is_404(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist"):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=CHAT, stream=True)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_unknown_route_and_method(server: Server) -> None:
    status, got = raw(server, "GET", "/v1/nothing")
    assert status == 404 and "no such route" in got["error"]["message"]
    status, got = raw(server, "GET", "/v1/completions")
    assert status == 405 and "Method Not Allowed" in got["error"]["message"]


def test_openai_client_sees_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="only n=1 is supported"):
        client.completions.create(model=MODEL, prompt="Hi", n=2)


# --------------------------------------------------------------------------- lifetime


def test_stopping_the_server_ends_running_requests(tiny: Path) -> None:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        srv = Server(llm, port=0, model_name=MODEL, log_level="warning")
        srv.start()
        runner, original = llm.runner, llm.runner.execute

        def slow(chunks: Any) -> Any:
            time.sleep(0.02)
            return original(chunks)

        runner.execute = slow
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)
        # ignore_eos: the random tiny model must not end the request before stop() does
        stream = c.completions.create(
            model=MODEL, prompt="Hi", max_tokens=None, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        t0 = time.monotonic()
        srv.stop()
        assert time.monotonic() - t0 < 5
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                pass
        assert not srv.engine_loop.alive


# --------------------------------------------------------------------------- the command


def test_serve_help_lists_the_options() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in (
        "--model",
        "--backend",
        "--host",
        "--port",
        "--kv-cache",
        "--max-model-len",
        "--max-slots",
        "--max-batch-tokens",
        "--served-model-name",
    ):
        assert option in result.output
    assert "/v1/chat/completions" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-slots", "0"], "Invalid value for '--max-slots'"),
        (["--port", "70000"], "Invalid value for '--port'"),
        (["--kv-cache", "paged"], "Invalid value for '--kv-cache'"),
        (["--max-model-len", "1"], "--max-model-len must be at least 2"),
        (["--backend", "nonesuch"], "nonesuch"),
    ],
)
def test_serve_bad_options(tiny: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny), *args])
    assert result.exit_code in (1, 2)
    assert message in result.output


def test_serve_busy_port_is_a_clean_error(server: Server, tiny: Path) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--model", str(tiny), "--backend", "cpu", "--port", str(server.port)]
    )
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{server.port}" in result.output


def test_serve_busy_port_fails_before_loading_the_model(
    server: Server, tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded although the port is busy")

    monkeypatch.setattr("vt.frontends.llm.LLM", no_load)
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny), "--port", str(server.port)])
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{server.port}" in result.output


def test_serve_releases_the_port_when_the_model_fails_to_load(tmp_path: Path) -> None:
    probe = bind("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()
    missing = tmp_path / "missing.gguf"
    result = CliRunner().invoke(main, ["serve", "--model", str(missing), "--port", str(port)])
    assert result.exit_code == 1
    assert result.output.strip() == f"Error: {missing}: no such model file"
    bind("127.0.0.1", port).close()  # the port is free again


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_vt_serve_command_serves_and_stops_on_a_signal(tiny: Path, stop_signal: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from vt.frontends.cli import main; main()", "serve"]
        + ["--model", str(tiny), "--backend", "cpu", "--port", "0"]
        + ["--max-slots", "2", "--kv-cache", "contiguous", "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "VT_ASYNC_RUNNER"} | {"VT_PLUGINS": ""},
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True)
    reader.start()
    try:
        seen = ""
        while "ready: serving" not in seen:  # a fresh process may compile kernels first
            seen += lines.get(timeout=150)
        assert seen.index("listening on") < seen.index("backend cpu")  # listens, then loads
        assert "backend cpu" in seen and "readback host_view" in seen
        assert "kv contiguous" in seen and "2 slot(s)" in seen
        url = seen.split("listening on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10)
        assert [m.id for m in c.models.list().data] == [tiny.stem]
        got = c.completions.create(model=tiny.stem, prompt="Hi", max_tokens=3)
        assert 1 <= got.usage.completion_tokens <= 3
        proc.send_signal(stop_signal)  # Ctrl-C, or a service manager's stop
        assert proc.wait(timeout=15) == 0
        reader.join(5)
        while not lines.empty():
            seen += lines.get()
        assert seen.rstrip().endswith("vt serve: stopped")
        assert "Traceback" not in seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- default model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_model_served_equals_llm() -> None:
    questions = ["Why is the sky blue?", "Name three fruits.", "What is 2+2?", "Say hi."]
    with vt.LLM(backend="cpu", max_slots=4) as llm:
        params = vt.SamplingParams(temperature=0.0, max_tokens=24)
        want = [llm.chat([{"role": "user", "content": q}], params)[0].text for q in questions]
        srv = Server(llm, port=0, model_name="smollm2", log_level="warning")
        srv.start()
        try:
            c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
            r = c.completions.create(
                model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0
            )
            assert r.choices[0].text.startswith(" Paris.")
            got: dict[int, str] = {}

            def ask(i: int) -> None:
                msgs = [{"role": "user", "content": questions[i]}]
                out = c.chat.completions.create(
                    model="smollm2", messages=msgs, max_tokens=24, temperature=0
                )
                got[i] = out.choices[0].message.content

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert [got.get(i) for i in range(len(questions))] == want
        finally:
            srv.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("flag", "state"), [([], "on"), (["--no-prefix-caching"], "off")])
def test_vt_serve_prefix_caching_option_reaches_the_engine(
    tiny: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str], state: str
) -> None:
    from vt.frontends.cli import serve_cmd

    lines, engines = serve_cmd.startup_lines, []

    def record_then_stop(llm: Any, *args: Any) -> list[str]:
        engines.append(llm.engine)
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: stops serving
        return lines(llm, *args)

    monkeypatch.setattr(serve_cmd, "startup_lines", record_then_stop)
    result = CliRunner().invoke(
        main, ["serve", "--model", str(tiny), "--backend", "cpu", "--port", "0",
               "--max-slots", "1", "--log-level", "warning", *flag],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [e.prefix_caching for e in engines] == [state == "on"]
    assert f" | prefix caching {state} | " in result.output


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_signal_right_after_ready_stops_vt_serve_cleanly(
    tiny: Path, stop_signal: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race behind a flaky "Aborted!": a stop signal that lands while vt serve is still
    between its "ready" line and its wait loop (a busy machine deschedules it there) must
    stop it as one that lands in the loop does: exit 0, "vt serve: stopped"."""
    from vt.frontends.cli import serve_cmd

    lines = serve_cmd.startup_lines

    def ready_then_signal(*args: Any) -> list[str]:
        os.kill(os.getpid(), stop_signal)  # handled at the next bytecode, here
        return lines(*args)

    monkeypatch.setattr(serve_cmd, "startup_lines", ready_then_signal)
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(
        main, ["serve", "--model", str(tiny), "--backend", "cpu", "--port", "0",
               "--max-slots", "1", "--log-level", "warning"],
    )  # fmt: skip
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous
    assert result.exit_code == 0, result.output
    assert "Aborted" not in result.output and "Traceback" not in result.output
    assert result.output.rstrip().endswith("vt serve: stopped")
