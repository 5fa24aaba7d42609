"""Helpers shared by the ``vt serve`` tests: a served tiny model on loopback, raw HTTP, a
``vt serve`` subprocess, and a kernel fault that can be armed on the cpu backend."""

from __future__ import annotations

import http.client
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import vt
from vt.frontends.server import Server

MODEL = "tiny"
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
JSON = {"Content-Type": "application/json"}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


def request(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 20,
) -> Reply:
    """One HTTP request with exactly ``body`` (bytes as given, else JSON) and ``headers``
    (default: a JSON content type); the body comes back parsed when it is JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=JSON if headers is None else headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed: Any = json.loads(raw)
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed)
    finally:
        conn.close()


def post_big(port: int, path: str, body: bytes, timeout: float = 20) -> bytes:
    """POST ``body`` on a raw socket; the server's answer even when it hangs up before the
    body is sent (http.client would only report the broken pipe)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head + body)
        except OSError:
            pass  # answered and closed while we were still sending
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.endswith(b"}"):
                    break
        except OSError:
            pass
        return answer


def solo(ref: vt.LLM, prompt: str, **kw: Any) -> Any:
    """The answer of ``prompt`` run alone through ``vt.LLM`` (greedy, ignoring EOS)."""
    params = vt.SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})
    return ref.generate(prompt, params)[0]


def client(url: str, api_key: str = "unused", timeout: float = 20) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout)


def check_serves(port: int, ref: vt.LLM, prompt: str = "Hello world!", **headers: str) -> None:
    """A normal request after a hostile one: 200 and the answer ``ref`` gives alone."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    reply = request(port, "POST", "/v1/completions", {**body, "ignore_eos": True},
                    {**JSON, **headers})  # fmt: skip
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["text"] == solo(ref, prompt, max_tokens=6).text


@dataclass
class KernelFault:
    """Arms a fault in the cpu backend's ``sample`` op: the next ``count`` sample launches
    that *run* raise on the stream (a device-side error, sticky until synchronized)."""

    armed: int = 0
    fired: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, backend: Any) -> None:
        original = backend.op_sample

        def check() -> None:
            with self.lock:
                if self.armed <= 0:
                    return
                self.armed -= 1
                self.fired += 1
            raise RuntimeError("injected kernel fault")

        def op_sample(stream: Any, **args: Any) -> None:
            original(stream, **args)
            backend.enqueue_host(stream, "sample-check", check)

        backend.op_sample = op_sample

    def arm(self, count: int = 1) -> None:
        with self.lock:
            self.armed = count


@contextmanager
def serving(llm: vt.LLM, **kw: Any) -> Iterator[Server]:
    srv = Server(llm, host="127.0.0.1", port=0, model_name=MODEL, log_level="warning", **kw)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def step_delay(runner: Any) -> Iterator[Callable[[float], None]]:
    """``set_delay(seconds)`` makes each engine step of ``runner`` take at least that long,
    so a test can act while a request is still decoding; restored on exit."""
    original = runner.execute

    def set_delay(seconds: float) -> None:
        def execute(chunks: Any) -> Any:
            time.sleep(seconds)
            return original(chunks)

        runner.execute = execute

    try:
        yield set_delay
    finally:
        runner.execute = original


def wait_for(predicate: Any, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out after {within} s waiting for {what}")


class ServeProcess:
    """``vt serve`` as a subprocess on a free loopback port; ``url`` once listening."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("VT_") or k == "VT_HOME"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from vt.frontends.cli import main; main()", "serve"]
            + ["--port", "0", "--backend", "cpu", "--log-level", "warning", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=base | {"VT_PLUGINS": ""} | (env or {}),
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen = ""
        assert self.proc.stderr is not None
        stderr = self.proc.stderr
        self._reader = threading.Thread(
            target=lambda: [self.lines.put(x) for x in stderr], daemon=True
        )
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 150) -> str:
        # Generous: a fresh process may compile the cpu backend's kernels first.
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"vt serve did not print {text!r} in {timeout} s: {self.seen}")
            try:
                self.seen += self.lines.get(timeout=left)
            except queue.Empty:
                continue
        return self.seen

    @property
    def url(self) -> str:
        """The address, once the model is loaded and served."""
        seen = self.wait_for("ready: serving")
        return seen.split("listening on ")[1].split()[0].removesuffix("/v1")

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def output(self) -> str:
        while not self.lines.empty():
            self.seen += self.lines.get()
        return self.seen

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self.output()
        return self.proc.returncode


@contextmanager
def serve_process(
    model: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[ServeProcess]:
    proc = ServeProcess(["--model", str(model), "--max-slots", "2", *args], env)
    try:
        yield proc
    finally:
        proc.stop()
