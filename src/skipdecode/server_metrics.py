"""Prometheus metrics of the OpenAI-compatible server (``GET /metrics``), through ``prometheus_client``.

Each app has one :class:`ServerMetrics` with its own ``CollectorRegistry`` (never the process-wide
default registry), so several apps in one process keep their own counts. Everything is recorded on
the event loop, once per request when it finishes or is refused (:meth:`ServerMetrics.finish`,
:meth:`ServerMetrics.end`, :meth:`ServerMetrics.refused`), never per token and never on the engine
thread, so a decode step costs nothing more; the one per-event call, :meth:`RequestTimer.token`, is
an attribute check on the event loop. The row gauges read
:meth:`~skipdecode.scheduler.Scheduler.stats` when the endpoint is scraped.

The metrics (names, units and meanings; docs/serving.md#metrics-get-metrics lists them too):

- ``skipdecode_requests_total{endpoint, outcome}`` (counter): requests that ended, ``endpoint``
  ``completions`` or ``chat``, ``outcome`` ``stop`` (every row stopped at EOS or a stop string),
  ``length`` (a row reached ``max_tokens``), ``cancelled`` (the client went away before the end)
  or ``error`` (the engine failed while the request ran);
- ``skipdecode_prompt_tokens_total``, ``skipdecode_cached_prompt_tokens_total``,
  ``skipdecode_completion_tokens_total`` (counters, ``endpoint``; tokens): the sums of the ``usage``
  of requests that ended with ``stop`` or ``length`` (``prompt_tokens``,
  ``prompt_tokens_details.cached_tokens``, ``completion_tokens``);
- ``skipdecode_requests_rejected_total{endpoint, reason}`` (counter): requests answered with an
  error before they were queued: ``invalid_request`` (400), ``unauthorized`` (401: no or a wrong
  API key), ``not_found`` (404: a ``model`` other than the served one, or an unknown path),
  ``too_large`` (413), ``queue_full`` (429);
  ``endpoint`` ``other`` for a path that is neither endpoint (created at its first refusal);
- ``skipdecode_running_rows``, ``skipdecode_prefilling_rows``, ``skipdecode_waiting_rows`` (gauges;
  rows): rows decoding, rows holding a slot for a chunked prefill (:mod:`skipdecode.chunked_prefill`)
  and rows waiting for a slot when scraped (a completions request with several prompts or ``n``
  choices has several rows);
- ``skipdecode_time_to_first_token_seconds`` (histogram; seconds): from the request's arrival at
  the handler (its body parsed) to its first token on the event loop, for every request that got a
  first token (observed when it ends, whatever its outcome);
- ``skipdecode_e2e_request_latency_seconds`` (histogram; seconds): from arrival to the last token,
  for requests that ended with ``stop`` or ``length``;
- ``skipdecode_request_mean_active_layers`` (histogram; layers) and
  ``skipdecode_request_theoretical_speedup`` (histogram; ratio): ``usage.skipdecode``'s
  ``mean_active_layers`` and ``theoretical_speedup`` of requests that ended with ``stop`` or
  ``length`` after at least one decode step (a one-token answer has none).
"""

from __future__ import annotations

import math
import time
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from .generate import GenerationResult
from .scheduler import Scheduler

__all__ = ["ServerMetrics", "RequestTimer", "endpoint_of"]

ENDPOINTS = ("completions", "chat")
OUTCOMES = ("stop", "length", "cancelled", "error")
#: HTTP status -> the ``reason`` label of ``skipdecode_requests_rejected_total``
REJECTIONS = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 413: "too_large", 429: "queue_full"}
#: seconds; a CPU serves a first token in 0.1-1.5 s, one at a time under load in up to a minute
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: theoretical speedup (L x decode steps / layers run): 1 is full depth
SPEEDUP_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request path: ``completions``, ``chat`` or ``other``."""
    return {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(path, "other")


def layer_buckets(num_layers: int) -> tuple[float, ...]:
    """Histogram buckets (layers) for mean active layers: tenths of ``num_layers``, up to all of them."""
    return tuple(sorted({round(num_layers * k / 10, 3) for k in range(1, 11)}))


class RequestTimer:
    """One request's clock (``time.perf_counter`` seconds) from its arrival at the handler."""

    __slots__ = ("endpoint", "start", "first_token", "done")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self.first_token: Optional[float] = None
        self.done = False  # recorded (once)

    def token(self) -> None:
        """Note that tokens arrived on the event loop (only the first call keeps its time)."""
        if self.first_token is None:
            self.first_token = time.perf_counter()


class _SchedulerGauges:
    """Custom collector: the scheduler's running, prefilling and waiting rows, read when scraped."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _families(self, running: float, prefilling: float, waiting: float) -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("skipdecode_running_rows", "Rows decoding in the in-flight batch.", value=running),
            GaugeMetricFamily("skipdecode_prefilling_rows", "Rows holding a slot for a chunked prefill.",
                              value=prefilling),
            GaugeMetricFamily("skipdecode_waiting_rows", "Rows waiting for a batch slot.", value=waiting),
        ]

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return self._families(0, 0, 0)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self.scheduler.stats()
        return self._families(stats["running"], stats["prefilling"], stats["waiting"])


class ServerMetrics:
    """One app's Prometheus metrics (module docstring) in its own ``registry``; ``num_layers``
    (the model's L) sets the buckets of the mean-active-layers histogram."""

    def __init__(self, scheduler: Scheduler, num_layers: int) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("skipdecode_requests", "Requests that ended, by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("skipdecode_prompt_tokens", "Prompt tokens of completed requests.",
                                     ["endpoint"], registry=r)
        self.cached_tokens = Counter("skipdecode_cached_prompt_tokens", "Prompt tokens of completed "
                                     "requests reused from the prefix cache.", ["endpoint"], registry=r)
        self.completion_tokens = Counter("skipdecode_completion_tokens", "Generated tokens of completed "
                                         "requests.", ["endpoint"], registry=r)
        self.rejected = Counter("skipdecode_requests_rejected", "Requests refused before they were queued "
                                "(400 invalid_request, 401 unauthorized, 404 not_found, 413 too_large, 429 queue_full).",
                                ["endpoint", "reason"], registry=r)
        self.ttft = Histogram("skipdecode_time_to_first_token_seconds", "Seconds from a request's arrival "
                              "to its first token.", buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("skipdecode_e2e_request_latency_seconds", "Seconds from a completed "
                                 "request's arrival to its last token.", buckets=LATENCY_BUCKETS, registry=r)
        self.layers = Histogram("skipdecode_request_mean_active_layers", "Mean layers run per decode step "
                                "of a completed request.", buckets=layer_buckets(num_layers), registry=r)
        self.speedup = Histogram("skipdecode_request_theoretical_speedup", "Theoretical speedup "
                                 "(L x decode steps / layers run) of a completed request.",
                                 buckets=SPEEDUP_BUCKETS, registry=r)
        r.register(_SchedulerGauges(scheduler))
        for endpoint in ENDPOINTS:  # every series from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)
            for reason in REJECTIONS.values():
                self.rejected.labels(endpoint, reason)
            for counter in (self.prompt_tokens, self.cached_tokens, self.completion_tokens):
                counter.labels(endpoint)

    def _observe_ttft(self, timer: RequestTimer) -> None:
        if timer.first_token is not None:
            self.ttft.observe(timer.first_token - timer.start)

    def finish(self, timer: RequestTimer, result: GenerationResult) -> None:
        """Record a request that ended with all its rows (``result``: its ``usage``); once per timer."""
        if timer.done:
            return
        timer.done = True
        e = timer.endpoint
        outcome = "length" if "length" in result.finish_reasons else "stop"
        self.requests.labels(e, outcome).inc()
        self.prompt_tokens.labels(e).inc(sum(result.prompt_tokens))
        self.cached_tokens.labels(e).inc(sum(result.cached_prompt_tokens))
        self.completion_tokens.labels(e).inc(sum(result.new_tokens))
        self._observe_ttft(timer)
        self.latency.observe(time.perf_counter() - timer.start)
        if result.layers_run:  # at least one decode step
            for hist, value in ((self.layers, result.mean_active_layers), (self.speedup, result.theoretical_speedup)):
                if math.isfinite(value):
                    hist.observe(value)

    def end(self, timer: RequestTimer, outcome: str) -> None:
        """Record a request that ended without its result (``cancelled`` or ``error``); nothing
        if the timer was recorded already (so a ``finally`` may call it unconditionally)."""
        if timer.done:
            return
        timer.done = True
        self.requests.labels(timer.endpoint, outcome).inc()
        self._observe_ttft(timer)

    def refused(self, path: str, status: int) -> None:
        """Count a request to ``path`` answered with ``status`` before it was queued (400, 401, 404,
        413 or 429, :data:`REJECTIONS`; other statuses are not counted)."""
        reason = REJECTIONS.get(status)
        if reason is not None:
            self.rejected.labels(endpoint_of(path), reason).inc()

    def render(self, accept: Optional[str]) -> tuple[bytes, str]:
        """The registry in the exposition format the ``Accept`` header asks for (Prometheus text
        format 0.0.4 by default, OpenMetrics on request) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
