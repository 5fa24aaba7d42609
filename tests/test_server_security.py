"""Issue 11, item 7: ``vt serve`` is not drivable from a web page or by a stranger.

An API key (``--api-key`` / ``VT_API_KEY``) is required on ``/v1/*`` (401, OpenAI's
shape); POST bodies must be JSON (415 otherwise: a browser's cross-site "simple request"
cannot send that without a preflight, which vt never grants); the ``Host`` header must name
the bound address (DNS rebinding: 403); binding beyond loopback without a key prints a
warning; types are strict (``"max_tokens": "10"`` is a 400). Each hostile case is followed
by a normal request that must get the right answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import vt
from server_support import (
    JSON,
    MODEL,
    check_serves,
    client,
    request,
    serve_process,
    serving,
    solo,
)
from vt.frontends.server import Server
from vt.frontends.server.app import default_allowed_hosts
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test-0123456789"
AUTH = {**JSON, "Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("security") / "tiny.gguf", tied=False)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def llm(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=2, max_batch_tokens=8) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm: vt.LLM) -> Iterator[Server]:
    with serving(llm, api_key=KEY) as srv:
        yield srv


def completion(server: Server, headers: dict[str, str], body: Any = None) -> Any:
    body = body or {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    return request(server.port, "POST", "/v1/completions", body, headers)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (JSON, "no API key was given"),
        ({**JSON, "Authorization": "Bearer wrong"}, "the API key is wrong"),
        ({**JSON, "Authorization": KEY}, "the API key is wrong"),  # no scheme
        ({**JSON, "Authorization": f"Basic {KEY}"}, "the API key is wrong"),
    ],
)
def test_a_request_without_the_key_is_401(
    server: Server, ref: vt.LLM, headers: dict[str, str], message: str
) -> None:
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
        body = {"prompt": "Hi"} if method == "POST" else None
        reply = request(server.port, method, path, body, headers)
        assert reply.status == 401
        assert reply.headers["www-authenticate"] == "Bearer"
        error = reply.body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"] and error["code"] == "invalid_api_key"
        assert error["type"] == "invalid_request_error"
    check_serves(server.port, ref, Authorization=f"Bearer {KEY}")


def test_the_openai_client_with_the_key_gets_its_answer(server: Server, ref: vt.LLM) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(server.url, api_key="wrong").models.list()
    c = client(server.url, api_key=KEY)
    got = c.completions.create(
        model=MODEL, prompt="Hello world!", max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].text == solo(ref, "Hello world!", max_tokens=6).text
    # Probes stay open: a load balancer or Prometheus has no key.
    assert request(server.port, "GET", "/health").status == 200
    assert request(server.port, "GET", "/metrics").status == 200


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_body_that_is_not_declared_json_is_415(
    server: Server, ref: vt.LLM, content_type: str | None
) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    reply = completion(server, headers)
    assert reply.status == 415
    assert "must be JSON with 'Content-Type: application/json'" in reply.body["error"]["message"]
    reply = completion(server, {**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert reply.status == 200
    check_serves(server.port, ref, Authorization=f"Bearer {KEY}")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example"])
def test_a_foreign_host_header_is_403(server: Server, ref: vt.LLM, host: str) -> None:
    # A web page that rebinds its own name to 127.0.0.1 still sends its own name as Host.
    reply = completion(server, {**AUTH, "Host": host})
    assert reply.status == 403
    assert reply.body["error"]["code"] == "host_not_allowed"
    assert "--allowed-hosts" in reply.body["error"]["message"]
    assert request(server.port, "GET", "/health", headers={"Host": host}).status == 403
    for ok in ("localhost", f"localhost:{server.port}", "127.0.0.1", f"127.0.0.1:{server.port}"):
        assert completion(server, {**AUTH, "Host": ok}).status == 200
    check_serves(server.port, ref, Authorization=f"Bearer {KEY}")


def test_allowed_hosts_defaults_and_option(llm: vt.LLM) -> None:
    assert default_allowed_hosts("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert default_allowed_hosts("::1") == {"::1", "127.0.0.1", "localhost"}
    assert default_allowed_hosts("10.1.2.3") == {"10.1.2.3", "127.0.0.1", "localhost", "::1"}
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("::") is None
    with serving(llm, allowed_hosts=["models.internal"]) as srv:
        body = {"prompt": "Hi", "max_tokens": 2}
        h = {**JSON, "Host": "models.internal:443"}
        assert request(srv.port, "POST", "/v1/completions", body, h).status == 200
        h = {**JSON, "Host": "localhost"}
        assert request(srv.port, "POST", "/v1/completions", body, h).status == 403
    with serving(llm, allowed_hosts=["*"]) as srv:
        h = {**JSON, "Host": "anything.example"}
        assert request(srv.port, "POST", "/v1/completions", body, h).status == 200


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10.0}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"seed": "7"}, "seed"),
        ({"top_k": 5.5}, "top_k"),
        ({"ignore_eos": "true"}, "ignore_eos"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"user": 5}, "user"),
    ],
)
def test_types_are_strict(server: Server, ref: vt.LLM, change: dict[str, Any], param: str) -> None:
    reply = completion(server, AUTH, {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **change})
    assert reply.status == 400, reply.body
    assert reply.body["error"]["param"] == param
    messages = [{"role": "user", "content": "Hi"}]
    reply = request(
        server.port, "POST", "/v1/chat/completions", {"messages": messages, **change}, AUTH
    )
    assert reply.status == 400 and reply.body["error"]["param"] == param
    # An integer where a number is asked for is a number, as in JSON.
    number = {"prompt": "Hi", "max_tokens": 2, "temperature": 1}
    assert completion(server, AUTH, number).status == 200
    check_serves(server.port, ref, Authorization=f"Bearer {KEY}")


@pytest.mark.timeout(300)
def test_vt_serve_reads_the_key_from_vt_api_key_and_warns_beyond_loopback(
    tiny: Path, ref: vt.LLM
) -> None:
    with serve_process(tiny, "--host", "0.0.0.0", env={"VT_API_KEY": KEY}) as proc:
        port = proc.port
        assert "warning" not in proc.seen  # a key is set
        assert request(port, "POST", "/v1/completions", {"prompt": "Hi"}).status == 401
        body = {"model": tiny.stem, "prompt": "Hello world!", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        reply = request(port, "POST", "/v1/completions", body, AUTH)
        assert reply.status == 200
        assert reply.body["choices"][0]["text"] == solo(ref, "Hello world!", max_tokens=6).text
    with serve_process(tiny, "--host", "0.0.0.0") as proc:
        proc.wait_for("ready: serving")
        assert (
            "vt serve: warning: listening on 0.0.0.0, beyond this machine, without an API key"
            in proc.seen
        )
        assert request(proc.port, "GET", "/v1/models").status == 200
    assert proc.proc.returncode == 0
