"""Issue 11, items 2 and 3: big bodies, slow clients and stop strings cannot stall or kill
``vt serve``.

A body over the limit is a 413 before it is read; a prompt whose bytes cannot fit
``max_model_len`` is refused before it is tokenized; tokenizing runs off the event loop;
the context-length check comes before any heavy work; headers and bodies that do not arrive
in time get a 408. Stop strings are bounded (a 400), and checking them costs each request
only its own bounded strings. Each hostile case is followed by a normal request that must
get the right answer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vt
from server_support import MODEL, check_serves, post_big, request, serving
from vt.frontends.engine import _StopStrings
from vt.frontends.server import Server
from vt.frontends.server.app import Limits
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)

LIMITS = Limits(max_body_bytes=256 * 1024, body_timeout_s=1.0, header_timeout_s=0.5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A 4096-token context: prompts of tens of kilobytes still fit.
    path = tmp_path_factory.mktemp("limits") / "tiny.gguf"
    return write_tiny_gguf(path, tied=False, context_length=4096)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Server]:
    llm = vt.LLM(model=tiny, backend="cpu", max_slots=2, max_batch_tokens=64)
    with serving(llm, limits=LIMITS) as srv:
        yield srv
    llm.close()


@pytest.fixture
def encoded(server: Server) -> Iterator[list[int]]:
    """The byte length of every text the server tokenizes."""
    llm = server.llm
    original = llm.encode
    seen: list[int] = []

    def encode(prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            seen.append(len(prompt.encode()))
        return original(prompt)

    llm.encode = encode
    yield seen
    llm.encode = original


def post(server: Server, body: Any, path: str = "/v1/completions", **kw: Any) -> Any:
    return request(server.port, "POST", path, body, **kw)


# --------------------------------------------------------------------------- item 2


def test_a_body_over_the_limit_is_413_before_it_is_read(server: Server, ref: vt.LLM) -> None:
    big = b'{"prompt": "' + b"x" * LIMITS.max_body_bytes + b'"}'
    answer = post_big(server.port, "/v1/completions", big)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b"at most 262144" in answer
    # A declared length over the limit is refused from the header alone.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n"
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")
    check_serves(server.port, ref)


def test_a_chunked_body_over_the_limit_is_413(server: Server, ref: vt.LLM) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        try:
            for _ in range(8):
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # the server answered and closed while we were still sending
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")
    check_serves(server.port, ref)


def test_a_30_mb_prompt_is_refused_and_nothing_stalls(tiny: Path, ref: vt.LLM) -> None:
    # The case: 30 MB killed the server; 5 MB stalled every client for 10 s.
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm, serving(llm) as srv:
        assert srv.limits.max_body_bytes == 16 << 20  # the default
        answer = post_big(srv.port, "/v1/completions", b'{"prompt": "' + b"x" * (30 << 20) + b'"}')
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        lengths: list[int] = []
        original = llm.encode
        llm.encode = lambda p: lengths.append(len(p)) or original(p)  # type: ignore[method-assign]
        answered: list[float] = []

        def ping() -> None:
            t0 = time.monotonic()
            request(srv.port, "GET", "/health")
            answered.append(time.monotonic() - t0)

        pinger = threading.Thread(target=lambda: [ping() for _ in range(5)])
        pinger.start()
        five_mb = {"prompt": "hello " * ((5 << 20) // 6)}
        reply = request(srv.port, "POST", "/v1/completions", five_mb)
        pinger.join()
        assert reply.status == 400 and reply.body["error"]["code"] == "context_length_exceeded"
        assert "bytes, more than any 4096 tokens of this model can hold" in str(reply.body)
        assert lengths == []  # never tokenized
        assert max(answered) < 1.0
        check_serves(srv.port, ref)


def test_the_byte_bound_comes_before_the_tokenizer(
    server: Server, ref: vt.LLM, encoded: list[int]
) -> None:
    bound = server.state.max_prompt_bytes
    assert bound == 4096 * server.llm.tokenizer.max_token_bytes
    for body in (
        {"prompt": "a" * (bound + 1)},
        {"prompt": ["ok", "b" * (bound + 1)]},
        {"messages": [{"role": "user", "content": "c" * (bound + 1)}]},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        reply = post(server, body, path)
        assert reply.status == 400, reply.body
        assert reply.body["error"]["code"] == "context_length_exceeded"
    assert encoded == []  # none of them was tokenized (nor the first prompt of the list)
    check_serves(server.port, ref)


def test_the_context_length_check_comes_before_the_vocabulary_scan(server: Server) -> None:
    ids = [10**9] * 5000  # too long and out of the vocabulary: the length is named
    reply = post(server, {"prompt": ids})
    assert reply.status == 400 and reply.body["error"]["code"] == "context_length_exceeded"


def test_tokenizing_runs_off_the_event_loop(
    server: Server, ref: vt.LLM, encoded: list[int]
) -> None:
    llm = server.llm
    counting = llm.encode

    def slow_encode(prompt: Any) -> list[int]:
        if isinstance(prompt, str) and len(prompt) > 4096:
            time.sleep(0.8)  # a long tokenization
        return counting(prompt)

    llm.encode = slow_encode
    try:
        prompt = "The capital of France is " * 250  # 6 KB, ~3000 tokens: it fits
        want = ref.generate(prompt, vt.SamplingParams(temperature=0.0, max_tokens=4))[0].text
        result: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: result.update(
                r=post(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            )
        )
        t.start()
        time.sleep(0.2)  # tokenizing now
        t0 = time.monotonic()
        assert request(server.port, "GET", "/health").status == 200
        assert time.monotonic() - t0 < 0.4  # the event loop was free
        t.join(20)
        assert result["r"].status == 200
        assert result["r"].body["choices"][0]["text"] == want
    finally:
        llm.encode = counting
    check_serves(server.port, ref)


def test_headers_that_never_finish_get_408_and_the_connection_closes(
    server: Server, ref: vt.LLM
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        t0 = time.monotonic()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert s.recv(4096) == b""  # closed
        assert time.monotonic() - t0 < 3
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        assert s.recv(4096) == b""  # an idle connection is closed too
    check_serves(server.port, ref)


def test_a_body_that_never_finishes_gets_408(server: Server, ref: vt.LLM) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '
        )
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b"did not arrive within 1 s" in answer
    check_serves(server.port, ref)


# --------------------------------------------------------------------------- item 3


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["x"] * 17, "stop: 17 stop strings; at most 16 are allowed"),
        (["ok", "y" * 257], "stop[1]: a stop string of 257 characters; at most 256"),
        (["z" * 80] * 2000, "stop: 2000 stop strings"),
    ],
)
def test_stop_strings_are_bounded(
    server: Server, ref: vt.LLM, stop: list[str], message: str
) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        reply = post(server, {"model": MODEL, "stop": stop, **extra}, path)
        assert reply.status == 400
        assert message in reply.body["error"]["message"]
        assert reply.body["error"]["param"] == "stop"
    reply = post(server, {"prompt": "Hi", "stop_token_ids": list(range(257))})
    assert reply.status == 400 and reply.body["error"]["param"] == "stop_token_ids"
    check_serves(server.port, ref)


def test_the_stop_check_costs_only_the_requests_own_bounded_strings() -> None:
    # The hold-back (text that may start a stop string) used to try every prefix of every
    # stop string: 16 strings of 256 characters against a text that matches all prefixes.
    stops = _StopStrings(["a" * 255 + chr(ord("b") + i) for i in range(16)])
    text = "x" * 1000 + "a" * 300
    t0 = time.perf_counter()
    for _ in range(2000):
        assert stops.holdback(text) == 255
    assert time.perf_counter() - t0 < 1.0  # about 2000 * 256 set lookups
    assert _StopStrings(["abc"]).holdback("xxab") == 2
    assert _StopStrings(["abc"]).holdback("xxabc") == 0  # a whole stop string is found, not held
    assert _StopStrings(["abc", "bd"]).holdback("zb") == 1


def test_a_request_at_the_stop_limits_does_not_slow_another(
    server: Server, ref: vt.LLM, slow: Callable[..., Any] | None = None
) -> None:
    stop = [("q" * 255) + chr(0x100 + i) for i in range(16)]
    want = ref.generate("Hello world!", vt.SamplingParams(temperature=0.0, max_tokens=40,
                                                          ignore_eos=True))[0].text  # fmt: skip
    results: dict[str, Any] = {}

    def hostile() -> None:
        results["hostile"] = post(
            server,
            {"prompt": "q" * 200, "max_tokens": 200, "stop": stop, "ignore_eos": True},
        )

    t = threading.Thread(target=hostile)
    t.start()
    t0 = time.monotonic()
    normal = post(
        server,
        {"prompt": "Hello world!", "max_tokens": 40, "temperature": 0, "ignore_eos": True},
    )
    took = time.monotonic() - t0
    t.join(30)
    assert normal.status == 200 and normal.body["choices"][0]["text"] == want
    assert results["hostile"].status == 200
    assert took < 10
