"""A bound on the in-flight engine's key/value memory (kv_budget.py, Engine(max_cache_bytes=),
serve --kv-cache-gb).

The tiny llama holds 768 bytes a position (6 layers x 2 x 2 heads x 8 x 4 bytes) and its slot
buffers start at 256 positions, so a row of up to 255 positions plans 196,608 bytes (buffers always
hold more positions than asked). Under a bound
of two such rows at most two rows run, the buffers never pass the bound, and every answer equals
its solo run; a long row holds the others back until it ends, after which buffers too large are
dropped; a request that cannot fit alone is refused naming max_new_tokens, in the engine and as a
400 from a real server; options are checked and reach the engine from `serve`.
"""

from __future__ import annotations

import httpx
import pytest

from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from test_cli_outputs import _run as cli
from conftest import make_config, model_from_config
from test_inflight import POLICIES, adapter_of, prompt, solo
from skipdecode import get_adapter
from skipdecode.engine import Engine, Request
from skipdecode.kv_budget import check_max_cache_bytes, position_bytes, serve_default_bytes

ROW = 256 * 768  # bytes of one row of the tiny llama's first buffers


def long_context_adapter(positions: int = 1024):
    """The tiny llama with a context of ``positions`` (its buffers still start at 256)."""
    config = make_config("llama")
    config.max_position_embeddings = positions
    return get_adapter(model_from_config(config))


def run_bounded(engine, requests):
    """Submit all, step until idle; returns tokens per request and the most rows that ran at once,
    checking after every step that the buffers stay within the bound."""
    for r in requests:
        engine.submit(r)
    toks, most = {id(r): [] for r in requests}, 0
    while engine.busy:
        for ev in engine.step():
            toks.setdefault(id(ev.row.request), []).append(ev.token)  # rows submitted before too
        most = max(most, len(engine.running))
        assert engine.cache.allocated_bytes <= engine.max_cache_bytes
    return [toks[id(r)] for r in requests], most


def test_position_bytes_of_the_tiny_llama():
    assert position_bytes(adapter_of("llama")) == 768


def test_at_most_the_rows_that_fit_run_and_answers_equal_solo():
    adapter = adapter_of("llama")
    reqs = [Request(prompt(6 + i, 80 + i), 5, POLICIES[i % 4]) for i in range(5)]
    got, most = run_bounded(Engine(adapter, 4, max_cache_bytes=2 * ROW), reqs)
    assert most == 2  # a third slot would make 4 buffer rows: 786,432 bytes
    for r, toks in zip(reqs, got):
        assert toks == solo(adapter, list(r.prompt_ids), r.policy, r.max_new_tokens)[0]
    _, free_most = run_bounded(Engine(adapter, 4, max_cache_bytes=10**9), reqs)
    assert free_most == 4


def test_a_long_row_holds_the_others_back_and_its_large_buffers_are_dropped_after_it():
    """A row planned at 300 positions takes 512-position buffers (393,216 bytes for one row):
    the short requests wait until it ends, then the 512-position buffers are dropped and two
    short rows run at once in 256-position ones."""
    adapter = long_context_adapter()
    eng = Engine(adapter, 4, max_cache_bytes=2 * ROW, prefix_cache=False)
    long_ = Request(prompt(40, 90), 261)  # 40 + 261 - 1 = 300 positions
    shorts = [Request(prompt(5, 91 + i), 4) for i in range(3)]
    eng.submit(long_)
    eng.step()
    got, most = run_bounded(eng, shorts)
    assert most == 2 and eng.cache.keys[0].shape[2] == 256
    for r, toks in zip(shorts, got):
        assert toks == solo(adapter, list(r.prompt_ids), None, 4)[0]


def test_a_request_that_cannot_fit_alone_is_refused_naming_max_new_tokens():
    eng = Engine(long_context_adapter(), 4, max_cache_bytes=ROW)
    eng.check(Request(prompt(10, 1), 246))  # 255 positions: one row of 196,608 bytes
    # 256 positions take the next size: buffers always hold more positions than asked (cache.py)
    with pytest.raises(ValueError, match="max_new_tokens 247 need 0 MiB of key/value cache \\(512 positions\\)"):
        eng.check(Request(prompt(10, 1), 247))


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "1"])
def test_bad_max_cache_bytes_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="max_cache_bytes must be None"):
        check_max_cache_bytes(value)
    with pytest.raises(ValueError, match="max_cache_bytes must be None"):
        Engine(adapter_of("llama"), 2, max_cache_bytes=value)


def test_serve_passes_the_bound_and_refuses_a_negative_one(saved, monkeypatch):  # noqa: F811
    import skipdecode.server as server_module
    from test_server_loopback import free_port

    for value in ("-1", "inf", "nan"):
        bad, _ = cli(["serve", "--kv-cache-gb", value])
        assert bad.exit_code == 2 and "--kv-cache-gb must be a number of GiB >= 0" in bad.output, value
    seen = []

    def spy(*a, **kw):
        seen.append(kw["max_cache_bytes"])
        raise RuntimeError("stop here")
    monkeypatch.setattr(server_module, "create_app", spy)
    for extra in ([], ["--kv-cache-gb", "0"], ["--kv-cache-gb", "0.5"]):
        cli(["serve", "--model", str(saved), "--port", str(free_port()), *extra])
    assert seen == [serve_default_bytes(), None, 2**29] and serve_default_bytes() > 2**30


def test_a_real_server_answers_400_for_a_request_beyond_the_bound_and_serves_the_rest():
    from test_server_loopback import health, start_server, stop_server

    proc, url = start_server("--max-cache-bytes", str(ROW), "--context", "1024")
    try:
        big = httpx.post(url + "/v1/completions", json={"prompt": "The Eagle", "max_tokens": 300}, timeout=30)
        ok = httpx.post(url + "/v1/completions", json={"prompt": "The Eagle", "max_tokens": 8}, timeout=30)
        stats = health(url)["scheduler"]
    finally:
        stop_server(proc)
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_tokens"
    assert "max_cache_bytes" in big.json()["error"]["message"]
    assert ok.status_code == 200
    assert stats["max_cache_bytes"] == ROW and 0 < stats["cache_bytes"] <= ROW


def test_short_requests_arriving_one_by_one_after_a_long_one_join_together():
    """After a long row left 512-position buffers, the first short request drops them (nothing
    else holds a slot), so the next one joins beside it at once instead of waiting."""
    adapter = long_context_adapter()
    eng = Engine(adapter, 4, max_cache_bytes=2 * ROW, prefix_cache=False)
    run_bounded(eng, [Request(prompt(40, 95), 261)])
    assert eng.cache.keys[0].shape[2] == 512
    a, b = Request(prompt(5, 96), 6), Request(prompt(6, 97), 6)
    eng.submit(a)
    eng.step()
    eng.submit(b)
    eng.step()
    assert {r.request for r in eng.running} == {a, b}  # b joined at the step after its submission
    assert eng.cache.keys[0].shape[2] == 256 and eng.cache.allocated_bytes <= 2 * ROW


def test_the_plan_counts_each_layers_own_buffers():
    """Two rows whose decode steps skip layers 0 and 1: the longer one grows only the layers they
    run to 512 positions while layers 0 and 1 keep their 256 from the prefills. After it ends, the
    plan for the row still running (256 positions) counts each layer's own buffers, so it is never
    below what they hold (a plan from layer 0 alone would count 6 x 256)."""
    adapter = long_context_adapter()
    eng = Engine(adapter, 4, max_cache_bytes=10**9, prefix_cache=False)
    longer, shorter = Request(prompt(240, 98), 61, POLICIES[2]), Request(prompt(5, 99), 200, POLICIES[2])
    eng.submit(longer)
    eng.submit(shorter)
    while any(r.request is longer for r in eng.running) or eng.waiting:
        eng.step()
    sizes = [k.shape[2] for k in eng.cache.keys]
    assert sizes[:2] == [256, 256] and sizes[-1] == 512
    assert [r.request for r in eng.running] == [shorter]
    assert eng.planned_cache_bytes >= eng.cache.allocated_bytes > 6 * 2 * 256 * 128


def test_slot_buffers_always_hold_more_positions_than_asked():
    """SlotCache's growth rule (_ensure, and dims_after which plans by it): for every need from 1
    to 600 positions, grown step by step or allocated fresh, the buffers end with more positions
    than the need (a decode step whose key length equalled the buffers' size compiled a variant of
    its own, mid-serving), a power of two at least the starting capacity, and dims_after predicts
    exactly what _ensure allocates."""
    import torch

    from skipdecode.cache import SlotCache

    like = torch.zeros(1, 2, 1, 8)
    grown = SlotCache(1, 4, capacity=16)
    for need in range(1, 601):
        fresh = SlotCache(1, 4, capacity=16)
        for cache in (grown, fresh):
            planned = cache.dims_after(2, need)
            cache._ensure(0, like, like, need, 2)
            size = cache.keys[0].shape[2]
            assert (cache.keys[0].shape[0], size) == planned
            assert size > need and size >= 16 and size & (size - 1) == 0, (need, size)
