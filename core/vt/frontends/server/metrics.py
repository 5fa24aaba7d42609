"""``GET /metrics``: the server's Prometheus metrics, through ``prometheus-client``.

Each :class:`Metrics` has its own ``CollectorRegistry`` (several servers may live in one
process, as in the tests). Counters and histograms are fed by the HTTP handlers and the
engine thread (prometheus-client is thread-safe); gauges are read when scraped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Requests, tokens, queue length, step time and KV cache use of one server."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, {"model_name": model_name}
        self.requests = Counter(
            "vt_http_requests",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vt_prompt_tokens", "Prompt tokens of requests that ran", registry=r
        )
        self.generation_tokens = Counter("vt_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "vt_requests_finished",
            "Requests (prompts) that finished, by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "vt_requests_rejected",
            "Requests refused before they ran, by reason",
            ["reason"],
            registry=r,
        )
        self.steps = Counter("vt_engine_steps", "Engine steps run", registry=r)
        self.failed_steps = Counter(
            "vt_engine_failed_steps", "Engine steps that failed", registry=r
        )
        self.step_time = Histogram(
            "vt_engine_step_seconds",
            "Wall time of one engine step (submit and collect)",
            buckets=_STEP_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "vt_time_to_first_token_seconds",
            "Arrival to first generated token (queue, prefill)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "vt_request_seconds",
            "Arrival to the last token of a finished request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.info = Gauge("vt_model_info", "The served model", ["model_name"], registry=r)
        self.info.labels(**label).set(1)
        self._gauges: list[Gauge] = []

    def gauge(self, name: str, doc: str, read: Callable[[], float]) -> None:
        """A gauge read when scraped (queue length, KV use, health)."""
        g = Gauge(name, doc, registry=self.registry)
        g.set_function(read)
        self._gauges.append(g)

    def finish(self, output: Any) -> None:
        """A request's final output (the engine thread)."""
        self.finished.labels(finish_reason=output.finish_reason or "abort").inc()
        t = output.timings
        self.prompt_tokens.inc(t.prompt_tokens)
        if t.prefill_s is not None:
            self.ttft.observe(t.queued_s + t.prefill_s)
            self.latency.observe(t.queued_s + t.prefill_s + (t.decode_s or 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
