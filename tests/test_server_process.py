"""Issue 11's hostile client, replayed against a real ``vt serve`` process on loopback.

One process (a tiny model whose chat template misbehaves on some messages) takes every
kind of request that broke, stalled or fooled the server before; after each, a normal
request must get its right answer, and the process must still stop cleanly (exit 0).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vt
from server_support import JSON, ServeProcess, post_big, request, serve_process
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(300)

TRAP = (
    "{% for m in messages %}"
    "{% if m.content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if m.content == 'grow' %}{% set ns = namespace(s='ab') %}"
    "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("process") / "hostile.gguf"
    return write_tiny_gguf(path, tied=False, chat_template=TRAP)


@pytest.fixture(scope="module")
def ref(model: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=model, backend="cpu", max_slots=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def proc(model: Path) -> Iterator[ServeProcess]:
    args = ("--template-timeout", "0.5", "--request-timeout", "1.5", "--max-batch-tokens", "8")
    with serve_process(model, *args) as p:
        p.wait_for("ready: serving")
        yield p
    assert p.proc.returncode == 0, p.output()
    assert "Traceback" not in p.output()


def normal(proc: ServeProcess, ref: vt.LLM) -> None:
    params = vt.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = request(proc.port, "POST", "/v1/completions", {"prompt": "Hello world!", **body})
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["text"] == ref.generate("Hello world!", params)[0].text
    chat = [{"role": "user", "content": "hello there"}]
    reply = request(proc.port, "POST", "/v1/chat/completions", {"messages": chat, **body})
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["message"]["content"] == ref.chat(chat, params)[0].text


def post(proc: ServeProcess, body: Any, path: str = "/v1/completions", **kw: Any) -> Any:
    return request(proc.port, "POST", path, body, **kw)


HOSTILE: list[tuple[str, Any, int]] = [
    # item 1: rows the sampler cannot take
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_p": 1e-50}, 400),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 2**31}, 400),
    # item 2: a prompt far past max_model_len, refused before tokenizing
    ("/v1/completions", {"prompt": "hello " * 900_000}, 400),
    # item 3: 10,000 stop strings of 80 characters
    ("/v1/completions", {"prompt": "Hi", "stop": ["s" * 80] * 10_000}, 400),
    # item 4: templates that spin or grow
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "spin"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "grow"}]}, 400),
    # item 7: loose types
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "10"}, 400),
    ("/v1/completions", {"prompt": "Hi", "stream": "yes"}, 400),
]


@pytest.mark.parametrize(("path", "body", "status"), HOSTILE)
def test_a_hostile_request_fails_alone(
    proc: ServeProcess, ref: vt.LLM, path: str, body: Any, status: int
) -> None:
    reply = post(proc, body, path)
    assert reply.status == status, reply.body
    assert set(reply.body["error"]) == {"message", "type", "param", "code"}
    normal(proc, ref)


def test_a_30_mb_body_is_413(proc: ServeProcess, ref: vt.LLM) -> None:
    answer = post_big(proc.port, "/v1/completions", b'{"prompt": "' + b"x" * (30 << 20) + b'"}')
    assert answer.startswith(b"HTTP/1.1 413 ")
    normal(proc, ref)


def test_browsers_and_slow_clients_are_refused(proc: ServeProcess, ref: vt.LLM) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert post(proc, body, headers={"Content-Type": "text/plain"}).status == 415
    assert post(proc, body, headers={**JSON, "Host": "attacker.example"}).status == 403
    with socket.create_connection(("127.0.0.1", proc.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        t0 = time.monotonic()
        assert s.recv(4096).startswith(b"HTTP/1.1 408 ")
        assert time.monotonic() - t0 < 3
    normal(proc, ref)


def test_health_and_metrics_after_all_that(proc: ServeProcess, ref: vt.LLM) -> None:
    health = request(proc.port, "GET", "/health")
    assert health.status == 200 and health.body["status"] == "ok"
    assert health.body["failed_steps"] == 0
    metrics = request(proc.port, "GET", "/metrics")
    assert metrics.status == 200 and "vt_generation_tokens_total" in metrics.body
    normal(proc, ref)
