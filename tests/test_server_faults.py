"""Issue 11, item 1: no request and no failed step breaks ``vt serve``.

A sampling row the device cannot take (``top_p`` that is 0 in float32, ``top_k`` past
int32) is a 400 for its own request; a kernel that raises in one step fails only that
step's requests, with async scheduling on, and the engine is back in a known-good state for
the next request; a runner that cannot be recovered makes ``/health`` say so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import vt
from server_support import (
    GREEDY,
    MODEL,
    KernelFault,
    check_serves,
    client,
    request,
    serving,
    solo,
    step_delay,
    wait_for,
)
from vt.execution.runner import RunnerError
from vt.frontends.server import Server
from vt.testing.tiny import write_tiny_gguf

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("faults") / "tiny.gguf", tied=False)


@pytest.fixture(scope="module")
def ref(tiny: Path) -> Iterator[vt.LLM]:
    with vt.LLM(model=tiny, backend="cpu", max_slots=1) as llm:
        yield llm


def _llm(tiny: Path, fault: KernelFault) -> vt.LLM:
    llm = vt.LLM(model=tiny, backend="cpu", max_slots=2, max_batch_tokens=8, async_scheduling=True)
    assert llm.engine.async_scheduling and llm.readback == "host_view"
    fault.install(llm.backend)
    return llm


@pytest.fixture(scope="module")
def fault() -> KernelFault:
    return KernelFault()


@pytest.fixture(scope="module")
def server(tiny: Path, fault: KernelFault) -> Iterator[Server]:
    llm = _llm(tiny, fault)
    with serving(llm) as srv:
        yield srv
    llm.close()


@pytest.fixture
def slow_steps(server: Server) -> Iterator[Callable[[float], None]]:
    """``slow_steps(seconds)``: each engine step takes at least that long (restored after)."""
    with step_delay(server.llm.runner) as set_delay:
        yield set_delay


def health(server: Server) -> dict[str, Any]:
    return request(server.port, "GET", "/health").body


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"top_p": 1e-50}, "top_p", "which is 0 in float32"),
        ({"top_k": 2**31}, "top_k", "top_k must be at most 2147483647 (int32)"),
        ({"top_k": 2**70}, "top_k", "top_k must be at most 2147483647 (int32)"),
        ({"temperature": 1e39}, "temperature", "temperature must be at most 3.403e+38"),
    ],
)
def test_a_row_the_sampler_cannot_take_fails_only_its_request(
    server: Server,
    ref: vt.LLM,
    slow_steps: Callable[[float], None],
    change: dict[str, Any],
    param: str,
    message: str,
) -> None:
    slow_steps(0.01)
    c = client(server.url)
    want = solo(ref, "The capital of France is", max_tokens=24).text
    failed_before = health(server)["failed_steps"]
    stream = c.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=24, stream=True, **GREEDY
    )
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # the other request is decoding now
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        reply = request(server.port, "POST", path, {"model": MODEL, **body, **change})
        assert reply.status == 400, reply.body
        assert message in reply.body["error"]["message"]
        assert reply.body["error"]["param"] == param
    text += "".join(chunk.choices[0].text for chunk in chunks)
    assert text == want  # the running stream never noticed
    h = health(server)
    assert h["status"] == "ok" and h["failed_steps"] == failed_before
    check_serves(server.port, ref)


def test_kernel_fault_fails_only_that_steps_requests(
    server: Server, fault: KernelFault, ref: vt.LLM, slow_steps: Callable[[float], None]
) -> None:
    # Two requests decode in the two slots; a third waits for a slot. A sample kernel
    # that raises on the device fails the step: the two running requests get the error,
    # the waiting one runs next and gets its right answer, and so does a later one.
    slow_steps(0.01)
    c = client(server.url)
    failed_before = health(server)["failed_steps"]
    errors: dict[int, BaseException] = {}
    answers: dict[int, str] = {}
    started = [threading.Event(), threading.Event()]

    def running(i: int) -> None:
        try:
            stream = c.completions.create(
                model=MODEL, prompt=f"Story {i}:", max_tokens=200, stream=True, **GREEDY
            )
            for chunk in stream:
                started[i].set()
                answers[i] = answers.get(i, "") + chunk.choices[0].text
        except openai.APIError as exc:
            errors[i] = exc
        finally:
            started[i].set()

    def waiting() -> None:
        r = c.completions.create(model=MODEL, prompt="Hello world!", max_tokens=8, **GREEDY)
        answers[2] = r.choices[0].text

    threads = [threading.Thread(target=running, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(20)
    threads.append(threading.Thread(target=waiting))
    threads[-1].start()
    wait_for(lambda: health(server)["waiting"] == 1, 10, "the third request to queue")
    fault.arm(1)
    for t in threads:
        t.join(30)
    assert fault.fired == 1
    assert set(errors) == {0, 1}
    for exc in errors.values():
        assert "injected kernel fault" in str(exc)
    assert answers[2] == solo(ref, "Hello world!", max_tokens=8).text
    h = health(server)
    assert h["status"] == "ok" and h["reason"] is None
    assert h["failed_steps"] == failed_before + 1
    assert h["running"] == 0 and h["waiting"] == 0
    slow_steps(0.0)
    check_serves(server.port, ref)
    check_serves(server.port, ref, "The capital of France is")


def test_a_request_in_the_step_after_the_failed_one_starts_over(tiny: Path, ref: vt.LLM) -> None:
    # With async scheduling the engine submits step N+1 before it reads step N. A request
    # whose first rows are in N+1 has produced nothing when N fails: it is requeued and
    # its answer is the one it gets alone; the request whose row was in N fails.
    fault = KernelFault()
    with _llm(tiny, fault) as llm:
        engine = llm.engine
        greedy = vt.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        a = engine.add_request(llm.encode("The capital of France is"), greedy)
        engine.step()  # submits steps 1 and 2, reads step 1
        llm.runner.synchronize()  # step 2 has run: the fault hits the next step
        fault.arm(1)
        engine.step()  # submits step 3 (a's decode row), reads step 2
        b = engine.add_request(llm.encode("Hello world!"), greedy)
        with pytest.raises(vt.VtError, match="injected kernel fault"):
            engine.step()  # submits step 4 (b's prompt), reads step 3: it failed
        failure = engine.last_failure
        assert failure is not None and failure.healthy
        assert failure.failed == (a,) and failure.requeued == (b,)
        outputs: dict[str, Any] = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id] = out
        assert set(outputs) == {b}
        assert outputs[b].text == solo(ref, "Hello world!", max_tokens=6).text
        assert llm.generate("Hi", greedy)[0].text == solo(ref, "Hi", max_tokens=6).text


def test_a_runner_that_cannot_recover_makes_health_unhealthy(tiny: Path, ref: vt.LLM) -> None:
    fault = KernelFault()
    with _llm(tiny, fault) as llm:

        def recover() -> None:
            raise RunnerError("the device did not recover: device lost")

        llm.runner.recover = recover
        with serving(llm) as srv:
            check_serves(srv.port, ref)
            fault.arm(1)
            reply = request(srv.port, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
            assert reply.status == 500 and "injected kernel fault" in str(reply.body)
            h = request(srv.port, "GET", "/health")
            assert h.status == 503
            assert h.body["status"] == "unhealthy"
            assert "device lost" in h.body["reason"]
            reply = request(srv.port, "POST", "/v1/completions", {"prompt": "Hi"})
            assert reply.status == 503
            assert "the engine is unusable" in reply.body["error"]["message"]
            assert "device lost" in reply.body["error"]["message"]
            assert request(srv.port, "GET", "/v1/models").status == 200
