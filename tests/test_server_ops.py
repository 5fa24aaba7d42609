"""Issue 11, what an OpenAI-compatible server is also expected to do: ``GET /metrics``
(Prometheus), a bounded waiting queue (503 with ``Retry-After``), and ``/health`` while the
model loads (503 ``"loading"``, then 200)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vt
from click.testing import CliRunner
from server_support import MODEL, check_serves, request, serving, solo, wait_for
from vt.frontends.cli import main
from vt.frontends.server import Limits, Server
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("ops") / "tiny.gguf", tied=False)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        yield llm


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_metrics_count_requests_tokens_steps_and_kv_use(tiny: Path, ref: vt.LLM) -> None:
    with (
        vt.LLM(model=tiny, backend="cpu", max_slots=2, max_batch_tokens=8) as llm,
        serving(llm) as srv,
    ):
        before = request(srv.port, "GET", "/metrics")
        assert before.status == 200
        assert before.headers["content-type"].startswith("text/plain")
        text = before.body
        assert metric(text, "vt_model_info", model_name=MODEL) == 1
        assert metric(text, "vt_kv_slots") == 2
        assert metric(text, "vt_engine_healthy") == 1
        assert metric(text, "vt_kv_cache_reserved_bytes") > 0
        check_serves(srv.port, ref)  # 6 tokens
        bad = request(srv.port, "POST", "/v1/completions", {"prompt": "Hi", "top_p": 0})
        assert bad.status == 400
        after = request(srv.port, "GET", "/metrics").body
        ok = {"route": "/v1/completions", "status": "200"}
        assert metric(after, "vt_http_requests_total", **ok) == 1
        assert metric(after, "vt_http_requests_total", route="/v1/completions", status="400") == 1
        assert metric(after, "vt_generation_tokens_total") == 6
        assert metric(after, "vt_prompt_tokens_total") == len(ref.encode("Hello world!"))
        assert metric(after, "vt_requests_finished_total", finish_reason="length") == 1
        assert metric(after, "vt_engine_steps_total") >= 6
        assert metric(after, "vt_engine_step_seconds_count") >= 6
        assert metric(after, "vt_time_to_first_token_seconds_count") == 1
        assert metric(after, "vt_request_seconds_count") == 1
        assert metric(after, "vt_requests_running") == 0
        assert metric(after, "vt_requests_waiting") == 0
        assert metric(after, "vt_kv_cache_usage_ratio") == 0


def test_metrics_can_be_turned_off(tiny: Path, ref: vt.LLM) -> None:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm, serving(llm, metrics=False) as srv:
        reply = request(srv.port, "GET", "/metrics")
        assert reply.status == 404 and "no such route" in reply.body["error"]["message"]
        check_serves(srv.port, ref)
    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for option in ("--disable-metrics", "--max-waiting", "--api-key", "--allowed-hosts"):
        assert option in help_text


def test_the_waiting_queue_is_bounded(tiny: Path, ref: vt.LLM) -> None:
    limits = Limits(max_waiting=1)
    with (
        vt.LLM(model=tiny, backend="cpu", max_slots=1, max_batch_tokens=8) as llm,
        serving(llm, limits=limits) as srv,
    ):
        original = llm.runner.execute

        def slow(chunks: Any) -> Any:
            time.sleep(0.01)
            return original(chunks)

        llm.runner.execute = slow
        body = {"prompt": "Hello world!", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        replies: list[Any] = []
        threads = [
            threading.Thread(
                target=lambda: replies.append(request(srv.port, "POST", "/v1/completions", body))
            )
            for _ in range(2)
        ]
        for t in threads:  # one runs, one waits
            t.start()
        wait_for(lambda: srv.engine_loop.admitted == 2, 10, "two admitted requests")
        busy = request(srv.port, "POST", "/v1/completions", body)
        assert busy.status == 503
        assert busy.headers["retry-after"] == "1"
        assert busy.body["error"]["code"] == "server_busy"
        assert "at most 2" in busy.body["error"]["message"]
        many = request(srv.port, "POST", "/v1/completions", {**body, "prompt": ["a", "b", "c"]})
        assert many.status == 400 and "holds at most 2 at once" in many.body["error"]["message"]
        for t in threads:
            t.join(30)
        want = solo(ref, "Hello world!", max_tokens=30).text
        assert [r.status for r in replies] == [200, 200]
        assert all(r.body["choices"][0]["text"] == want for r in replies)
        metrics = request(srv.port, "GET", "/metrics").body
        assert metric(metrics, "vt_requests_rejected_total", reason="queue_full") == 1
        llm.runner.execute = original
        assert srv.engine_loop.admitted == 0
        check_serves(srv.port, ref)


def test_health_answers_while_the_model_loads(tiny: Path, ref: vt.LLM) -> None:
    srv = Server(None, host="127.0.0.1", port=0, model_name=MODEL, log_level="warning")
    srv.start()
    try:
        health = request(srv.port, "GET", "/health")
        assert health.status == 503 and health.body["status"] == "loading"
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            body = {"prompt": "Hi"} if method == "POST" else None
            reply = request(srv.port, method, path, body)
            assert reply.status == 503 and reply.headers["retry-after"] == "1"
            assert reply.body["error"]["code"] == "model_loading"
        with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
            srv.attach(llm)
            health = request(srv.port, "GET", "/health")
            assert health.status == 200 and health.body["status"] == "ok"
            check_serves(srv.port, ref)
            srv.stop()
    finally:
        srv.stop()


def test_health_says_why_loading_failed() -> None:
    srv = Server(None, host="127.0.0.1", port=0, model_name=MODEL, log_level="warning")
    srv.start()
    try:
        srv.fail_loading("nope.gguf: no such model file")
        health = request(srv.port, "GET", "/health")
        assert health.status == 503 and health.body["status"] == "failed"
        assert health.body["reason"] == "nope.gguf: no such model file"
        reply = request(srv.port, "POST", "/v1/completions", {"prompt": "Hi"})
        assert reply.status == 503 and "failed to load" in reply.body["error"]["message"]
    finally:
        srv.stop()


def test_cli_defaults_equal_the_servers() -> None:
    from vt.frontends.cli import serve_cmd
    from vt.model import RenderLimits

    limits = Limits()
    assert serve_cmd.DEFAULT_MAX_REQUEST_BYTES == limits.max_body_bytes
    assert serve_cmd.DEFAULT_MAX_WAITING == limits.max_waiting
    assert serve_cmd.DEFAULT_REQUEST_TIMEOUT == limits.body_timeout_s
    assert serve_cmd.DEFAULT_MAX_LOGPROBS == limits.max_logprobs
    assert serve_cmd.DEFAULT_TEMPLATE_TIMEOUT == RenderLimits().timeout_s
