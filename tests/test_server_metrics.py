"""``GET /metrics``: the server's Prometheus metrics (:mod:`skipdecode.server_metrics`).

Through the app (FastAPI TestClient, the tiny model): a completion, a chat request and a streamed
request move the request counters by one each and the token counters by exactly their ``usage``;
refusals (400, 413, 429) and engine failures are counted by endpoint; each app has its own
registry. And a real server process on loopback: concurrent requests, a client that disconnects
mid-stream and a 400, after which the scraped text parses and shows each request once.
(tests/test_metrics.py is another module's: the evaluation metrics.)
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_model, make_tokenizer
from skipdecode.model import SkipModel
from skipdecode.scheduler import QueueFull
from skipdecode.server import create_app
from test_server_loopback import STEP_DELAY, run, start_server, stop_server, wait_until

ENDPOINTS = ("completions", "chat")
OUTCOMES = ("stop", "length", "cancelled", "error")
REASONS = ("invalid_request", "unauthorized", "not_found", "too_large", "queue_full")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
TOKENS = {"prompt_tokens": "skipdecode_prompt_tokens_total",
          "completion_tokens": "skipdecode_completion_tokens_total"}


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


def parse(text: str) -> dict[tuple, float]:
    """Every sample of an exposition text, keyed by (sample name, sorted label items)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value (KeyError if the series is missing)."""
    return samples[(name, tuple(sorted(labels.items())))]


def scrape(client) -> dict[tuple, float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(resp.text)


def outcome(finish_reasons) -> str:
    """A request's outcome label: ``length`` if a row reached max_tokens, else ``stop``."""
    return "length" if "length" in finish_reasons else "stop"


def read_stream(lines) -> tuple[list[str], dict]:
    """The finish reasons and the usage of a streamed response's ``data:`` lines."""
    reasons, usage = [], None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        usage = chunk.get("usage") or usage
    assert usage is not None
    return reasons, usage


def check_requests(before: dict, after: dict, done: list[tuple[str, list[str], dict]], cancelled=0, errors=0):
    """``after`` - ``before`` holds exactly ``done`` ((endpoint, finish reasons, usage) of each
    completed request) and ``cancelled`` cancelled / ``errors`` failed completions requests."""
    want = Counter((e, outcome(r)) for e, r, _ in done)
    want[("completions", "cancelled")] += cancelled
    want[("completions", "error")] += errors
    for e in ENDPOINTS:
        for o in OUTCOMES:
            got = value(after, "skipdecode_requests_total", endpoint=e, outcome=o) - \
                value(before, "skipdecode_requests_total", endpoint=e, outcome=o)
            assert got == want[(e, o)], (e, o)
        mine = [u for end, _, u in done if end == e]
        for field, name in TOKENS.items():
            got = value(after, name, endpoint=e) - value(before, name, endpoint=e)
            assert got == sum(u[field] for u in mine), (e, field)
        got = value(after, "skipdecode_cached_prompt_tokens_total", endpoint=e) - \
            value(before, "skipdecode_cached_prompt_tokens_total", endpoint=e)
        assert got == sum(u["prompt_tokens_details"]["cached_tokens"] for u in mine)


def count(after: dict, before: dict, hist: str, suffix: str = "count") -> float:
    return value(after, f"{hist}_{suffix}") - value(before, f"{hist}_{suffix}")


def test_completion_chat_and_stream_move_the_counters_by_their_usage(sk):
    client = TestClient(create_app(sk, "tiny"))
    before = scrape(client)
    body = {"prompt": ["The Eagle is", "Describe the restaurant"], "max_tokens": 6, "speedup": 2, "horizon": 4}
    comp = client.post("/v1/completions", json=body).json()
    msgs = [{"role": "user", "content": "Describe the restaurant"}]
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 5}).json()
    body = {"prompt": "The Eagle is a", "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        stream_reasons, stream_usage = read_stream(list(r.iter_lines()))
    after = scrape(client)
    done = [("completions", [c["finish_reason"] for c in comp["choices"]], comp["usage"]),
            ("chat", [chat["choices"][0]["finish_reason"]], chat["usage"]),
            ("completions", stream_reasons, stream_usage)]
    check_requests(before, after, done)
    assert sum(u["completion_tokens"] for *_, u in done) > 0
    assert count(after, before, "skipdecode_time_to_first_token_seconds") == 3
    assert count(after, before, "skipdecode_e2e_request_latency_seconds") == 3
    assert count(after, before, "skipdecode_e2e_request_latency_seconds", "sum") > 0
    stepped = [u["skipdecode"] for *_, u in done if u["skipdecode"]["decode_steps"] > 0]
    for hist, key in (("skipdecode_request_mean_active_layers", "mean_active_layers"),
                      ("skipdecode_request_theoretical_speedup", "theoretical_speedup")):
        assert count(after, before, hist) == len(stepped)
        assert count(after, before, hist, "sum") == pytest.approx(sum(s[key] for s in stepped))
    for e in ENDPOINTS:  # nothing refused
        for reason in REASONS:
            assert value(after, "skipdecode_requests_rejected_total", endpoint=e, reason=reason) == 0
    assert value(after, "skipdecode_running_rows") == 0 and value(after, "skipdecode_waiting_rows") == 0


def test_refusals_are_counted_by_endpoint_and_reason(sk, monkeypatch):
    app = create_app(sk, "tiny", max_request_bytes=2000)
    client = TestClient(app)
    assert client.post("/v1/completions", json={"prompt": "x", "temperature": 5}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000}).status_code == 400
    broken = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert client.post("/v1/completions", json={"prompt": "x " * 2000}).status_code == 413
    assert client.post("/v1/completions", json={"prompt": "x", "model": "other"}).status_code == 404

    def full(requests, sink):
        raise QueueFull("the server is busy")

    monkeypatch.setattr(app.state.scheduler, "submit", full)
    msgs = [{"role": "user", "content": "hi"}]
    assert client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).status_code == 429
    s = scrape(client)
    want = {("completions", "invalid_request"): 2, ("chat", "invalid_request"): 1, ("completions", "not_found"): 1,
            ("completions", "too_large"): 1, ("chat", "queue_full"): 1}
    for e in ENDPOINTS:
        for reason in REASONS:
            assert value(s, "skipdecode_requests_rejected_total", endpoint=e, reason=reason) == want.get((e, reason), 0)
        for o in OUTCOMES:  # a refused request never ends as a request
            assert value(s, "skipdecode_requests_total", endpoint=e, outcome=o) == 0
    assert value(s, "skipdecode_time_to_first_token_seconds_count") == 0


def test_engine_failures_count_as_errors_without_tokens(sk, monkeypatch):
    client = TestClient(create_app(sk, "tiny"), raise_server_exceptions=False)
    real = __import__("skipdecode.engine", fromlist=["skip_forward"]).skip_forward

    def fail_on_decode(*args, **kwargs):
        if kwargs.get("row_layers") is not None:
            raise RuntimeError("CUDA exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr("skipdecode.engine.skip_forward", fail_on_decode)
    before = scrape(client)
    assert client.post("/v1/completions", json={"prompt": "The Eagle", "max_tokens": 5}).status_code == 500
    with client.stream("POST", "/v1/completions", json={"prompt": "The Eagle", "max_tokens": 5, "stream": True}) as r:
        assert any('"server_error"' in line for line in r.iter_lines())
    after = scrape(client)
    check_requests(before, after, [], errors=2)
    assert count(after, before, "skipdecode_e2e_request_latency_seconds") == 0


def test_each_app_has_its_own_registry(sk):
    first, second = TestClient(create_app(sk, "tiny")), TestClient(create_app(sk, "tiny"))
    assert first.post("/v1/completions", json={"prompt": "The", "max_tokens": 2}).status_code == 200
    counts = [sum(value(scrape(c), "skipdecode_requests_total", endpoint="completions", outcome=o)
                  for o in OUTCOMES) for c in (first, second)]
    assert counts == [1, 0]
    assert REGISTRY.get_sample_value("skipdecode_running_rows") is None  # not the process-wide registry


# --- a real server process on loopback ---------------------------------------------------------


async def _request(c: httpx.AsyncClient, endpoint: str, body: dict) -> tuple[str, list[str], dict]:
    """One completed request: (endpoint, finish reasons, usage); streamed if ``body`` says so."""
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
        async with c.stream("POST", PATHS[endpoint], json=body) as r:
            assert r.status_code == 200
            reasons, usage = read_stream([line async for line in r.aiter_lines()])
        return endpoint, reasons, usage
    r = await c.post(PATHS[endpoint], json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    return endpoint, [ch["finish_reason"] for ch in data["choices"]], data["usage"]


async def _loopback_scenario(url: str):
    """A long stream read for 3 events; while it runs, 8 concurrent requests start (streamed and
    not, both endpoints, one with two prompts); the stream's client then leaves; a 400 follows."""
    msgs = [{"role": "user", "content": "Describe the restaurant"}]
    bodies = [("completions", {"prompt": f"The Eagle {i} is", "max_tokens": 6}) for i in range(3)]
    bodies += [("completions", {"prompt": ["Describe it", "The cat"], "max_tokens": 5, "speedup": 2}),
               ("chat", {"messages": msgs, "max_tokens": 5}),
               ("chat", {"messages": msgs, "max_tokens": 4, "speedup": 2}),
               ("completions", {"prompt": "A pub", "max_tokens": 8, "stream": True}),
               ("chat", {"messages": msgs, "max_tokens": 6, "stream": True})]
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        long_body = {"prompt": "The Eagle", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with c.stream("POST", "/v1/completions", json=long_body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 3:
                    break
            live = parse((await c.get("/metrics")).text)
            tasks = [asyncio.create_task(_request(c, e, b)) for e, b in bodies]
            await asyncio.sleep(0.1)
        # leaving the block closed the stream mid-generation
        bad = await c.post("/v1/completions", json={"prompt": "x", "temperature": 5})
        done = await asyncio.gather(*tasks)
    return live, done, bad


def test_real_server_metrics_after_concurrent_requests_a_disconnect_and_a_400():
    proc, url = start_server("--step-delay", str(STEP_DELAY))
    try:
        live, done, bad = run(_loopback_scenario(url), timeout=90)
        assert bad.status_code == 400
        assert value(live, "skipdecode_running_rows") >= 1  # the long stream, scraped while it ran

        def settled():
            s = parse(httpx.get(url + "/metrics", timeout=5).text)
            return (value(s, "skipdecode_requests_total", endpoint="completions", outcome="cancelled") == 1
                    and value(s, "skipdecode_running_rows") == 0)

        assert wait_until(settled, 10)
        final = parse(httpx.get(url + "/metrics", timeout=5).text)
    finally:
        stop_server(proc)
    zero = {key: 0.0 for key in final}
    check_requests(zero, final, done, cancelled=1)
    for e in ENDPOINTS:
        for reason in REASONS:
            want = 1 if (e, reason) == ("completions", "invalid_request") else 0
            assert value(final, "skipdecode_requests_rejected_total", endpoint=e, reason=reason) == want
    assert value(final, "skipdecode_e2e_request_latency_seconds_count") == len(done)
    # the cancelled stream had its first token too
    assert value(final, "skipdecode_time_to_first_token_seconds_count") == len(done) + 1
    assert value(final, "skipdecode_waiting_rows") == 0
