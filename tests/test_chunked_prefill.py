"""Chunked prefill in the in-flight engine (chunked_prefill.py, Engine(prefill_chunk_tokens=...),
serve --prefill-chunk-tokens).

For every family: long prompts prefilled C tokens per engine step, joining at different steps next
to short ones and with different policies, give the greedy tokens and logits (1e-4) of their solo
runs. Running rows decode at every step of a chunked prefill; every prefill forward runs at most C
tokens and the chunks together run each prompt token once; a prompt of exactly C tokens is
prefilled whole. A chunked prefill starts after a prefix-cache hit; cancelling one frees its slot;
seeded samples are unchanged. Bad options are refused naming them, and the option reaches the
engine from `serve`; a real server streams while a long prompt is prefilled in chunks and answers
that prompt as alone.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from conftest import make_model, make_tokenizer
from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from test_cli_outputs import _run as cli
from test_inflight import L, POLICIES, adapter_of, prompt, solo
from skipdecode import SkipModel
from skipdecode.chunked_prefill import SERVE_PREFILL_CHUNK_TOKENS, check_prefill_chunk_tokens
from skipdecode.engine import Engine, Request
from skipdecode.sampling import SamplingParams
from skipdecode.scheduler import Scheduler

C = 16  # tokens per chunk in these tests

# (prompt length, policy index, max_new_tokens, submitted before engine step)
CASES = [(5, 1, 12, 0), (50, 2, 6, 1), (37, 0, 5, 1), (9, 3, 7, 2), (70, 1, 4, 3), (17, 2, 5, 4)]


def drive(engine, requests, submit_at):
    """Submit request i just before engine step ``submit_at[i]``; step until idle. Returns, per
    request, (tokens, stacked logits, engine steps of its events)."""
    got = {id(r): ([], [], []) for r in requests}
    step, pending = 0, sorted(range(len(requests)), key=lambda i: submit_at[i])
    while pending or engine.busy:
        while pending and submit_at[pending[0]] <= step:
            engine.submit(requests[pending.pop(0)])
        for ev in engine.step():
            toks, logs, steps = got[id(ev.row.request)]
            toks.append(ev.token)
            logs.append(ev.logits)
            steps.append(step)
        step += 1
    return [(t, torch.stack(lg) if lg and lg[0] is not None else None, s) for t, lg, s in (got[id(r)] for r in requests)]


def forward_sizes(monkeypatch) -> list[tuple[str, int, int]]:
    """Record (kind, rows, tokens) of every skip_forward call the engine makes ("decode": a step of
    the running rows; "prefill": a prefill or a chunk of one)."""
    import skipdecode.chunked_prefill as chunked
    import skipdecode.engine as engine_mod

    seen = []
    for module in (engine_mod, chunked):
        def spy(adapter, ids, *a, _real=module.skip_forward, **kw):
            seen.append(("decode" if kw.get("row_layers") is not None else "prefill", ids.shape[0], ids.shape[1]))
            return _real(adapter, ids, *a, **kw)
        monkeypatch.setattr(module, "skip_forward", spy)
    return seen


def test_chunked_long_prompts_equal_their_solo_runs(family):
    adapter = adapter_of(family)
    reqs = [Request(prompt(n, 30 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
    eng = Engine(adapter, max_batch_size=4, keep_logits=True, prefill_chunk_tokens=C)
    results = drive(eng, reqs, [c[3] for c in CASES])
    assert not eng.prefilling and len(eng.free_slots) == 4
    for req, (toks, logits, _) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_running_rows_decode_at_every_step_of_a_chunked_prefill(monkeypatch):
    """A row decoding while a 50-token prompt joins with C = 16: the prompt runs in 4 forwards of
    16, 16, 16 and 2 tokens, one per engine step from the step it joins at, and the running row
    gets a token at each of those steps; the long row's token 0 comes at the fourth."""
    adapter = adapter_of("llama")
    short, long_ = Request(prompt(5, 1), 12, POLICIES[1]), Request(prompt(50, 2), 4, POLICIES[2])
    sizes = forward_sizes(monkeypatch)
    eng = Engine(adapter, max_batch_size=4, prefill_chunk_tokens=C)
    (_, _, short_steps), (_, _, long_steps) = drive(eng, [short, long_], [0, 2])
    assert short_steps == list(range(12))  # one token at every engine step, chunks or not
    assert long_steps == [5, 6, 7, 8]  # joined at step 2, chunks at steps 2-5, then decoding
    prefills = [n for kind, _, n in sizes if kind == "prefill"]
    assert prefills == [5, 16, 16, 16, 2]
    assert [rows for kind, rows, _ in sizes if kind == "decode"] == [1] * 5 + [2] * 3 + [1] * 3
    whole = forward_sizes(monkeypatch)
    drive(Engine(adapter, max_batch_size=4), [short, long_], [0, 2])
    assert [n for kind, _, n in whole if kind == "prefill"] == [5, 50]  # off: one forward of the whole prompt


def test_a_chunked_rows_prefill_seconds_run_from_its_admission_to_its_first_token(monkeypatch):
    """usage.skipdecode.prefill_seconds is the time to first token after the queue: for a chunked
    prefill it spans the decode steps between its chunks (3 decode steps of at least 0.05 s each
    run between its first chunk and its last), not only its chunks' own time."""
    import skipdecode.engine as engine_mod

    real = engine_mod.skip_forward

    def slow_decode(*a, **kw):
        if kw.get("row_layers") is not None:
            time.sleep(0.05)
        return real(*a, **kw)
    monkeypatch.setattr(engine_mod, "skip_forward", slow_decode)
    eng = Engine(adapter_of("llama"), max_batch_size=4, prefill_chunk_tokens=C)
    short, long_ = Request(prompt(5, 1), 12), Request(prompt(50, 2), 2)
    eng.submit(short)
    eng.step()
    eng.submit(long_)
    chunk_seconds, first = [], None
    while first is None:
        eng.step()
        chunk_seconds = [p.seconds for p in eng.prefilling] or chunk_seconds
        first = next((r for r in eng.running if r.request is long_), None)
    assert first.prefill_seconds >= 3 * 0.05
    assert first.prefill_seconds > chunk_seconds[0] + 3 * 0.05  # its earlier chunks and the decode steps between


@pytest.mark.parametrize("n, forwards", [(C, [C]), (C + 1, [C, 1]), (2 * C + 1, [C, C, 1]), (3 * C, [C, C, C])])
def test_a_prompt_is_chunked_only_beyond_the_chunk(monkeypatch, n, forwards):
    """Chunks of C, the rest in the last (one token too: it runs as a one-token prefill)."""
    adapter = adapter_of("llama")
    req = Request(prompt(n, 7), 3)
    sizes = forward_sizes(monkeypatch)
    (toks, _, _), = drive(Engine(adapter, 2, prefill_chunk_tokens=C), [req], [0])
    assert [k for kind, _, k in sizes if kind == "prefill"] == forwards
    assert toks == solo(adapter, list(req.prompt_ids), None, 3)[0]


def test_a_chunked_prefill_starts_after_a_cached_prefix(family, monkeypatch):
    """The second prompt shares the first one's 32 leading tokens (stored after the first's prefill)
    and has 40 more: it computes only those 40, in chunks of 16, 16 and 8, reports 32 cached
    tokens, and equals its solo run."""
    adapter = adapter_of(family)
    shared = prompt(32, 100)
    first, second = Request(shared + prompt(4, 101), 3), Request(shared + prompt(40, 102), 5, POLICIES[1])
    eng = Engine(adapter, 4, keep_logits=True, prefill_chunk_tokens=C)
    drive(eng, [first], [0])
    sizes = forward_sizes(monkeypatch)
    rows = []
    eng.submit(second)
    while eng.busy:
        rows += [ev for ev in eng.step() if ev.row.request is second]
    assert [n for kind, _, n in sizes if kind == "prefill"] == [16, 16, 8]
    assert rows[0].row.cached_prompt_tokens == 32
    want_toks, want_logits = solo(adapter, list(second.prompt_ids), second.policy, 5)
    assert [ev.token for ev in rows] == want_toks
    torch.testing.assert_close(torch.stack([ev.logits for ev in rows]), want_logits, atol=1e-4, rtol=1e-4)


def test_cancelling_a_chunked_prefill_frees_its_slot_at_the_next_step():
    adapter = adapter_of("llama")
    eng = Engine(adapter, max_batch_size=1, prefill_chunk_tokens=C)
    long_, short = Request(prompt(60, 3), 5), Request(prompt(4, 4), 3)
    eng.submit(long_)
    eng.submit(short)
    assert eng.step() == [] and [p.request for p in eng.prefilling] == [long_]
    assert eng.held_requests() == [long_, short] and eng.free_slots == []
    eng.cancel(long_)
    events = eng.step()
    assert [ev.row.request for ev in events] == [short]  # long_ dropped, short prefilled into its slot
    while eng.busy:
        assert all(ev.row.request is short for ev in eng.step())
    assert not eng.prefilling and eng.free_slots == [0]


def test_seeded_samples_are_the_same_with_and_without_chunks():
    adapter = adapter_of("qwen2")
    reqs = [Request(prompt(n, 40 + n), 8, POLICIES[1], SamplingParams(temperature=1.0, seed=n)) for n in (45, 6, 33)]
    texts = [drive(Engine(adapter, 4, prefill_chunk_tokens=c), reqs, [0, 1, 1]) for c in (0, C)]
    assert [t for t, _, _ in texts[0]] == [t for t, _, _ in texts[1]]


@pytest.mark.parametrize("value", [-1, True, 2.5, "16", None])
def test_bad_prefill_chunk_tokens_is_refused_naming_it(value):
    adapter = adapter_of("llama")
    for build in (lambda: check_prefill_chunk_tokens(value), lambda: Engine(adapter, 2, prefill_chunk_tokens=value),
                  lambda: Scheduler(adapter, 2, prefill_chunk_tokens=value)):
        with pytest.raises(ValueError, match="prefill_chunk_tokens must be an integer >= 0"):
            build()


def test_serve_passes_the_chunk_and_refuses_a_negative_one(saved, monkeypatch):  # noqa: F811
    """`serve` gives create_app its --prefill-chunk-tokens (256 by default); a negative one exits
    with code 2 naming the option before any model is loaded; a serial app never chunks."""
    import skipdecode.server as server_module
    from skipdecode.server import create_app
    from test_server_loopback import free_port

    bad, text = cli(["serve", "--prefill-chunk-tokens", "-1"])
    assert bad.exit_code == 2 and "--prefill-chunk-tokens must be >= 0" in bad.output
    seen = []

    def spy(*a, **kw):
        seen.append(kw["prefill_chunk_tokens"])
        raise RuntimeError("stop here")
    monkeypatch.setattr(server_module, "create_app", spy)
    for extra in ([], ["--prefill-chunk-tokens", "0"], ["--prefill-chunk-tokens", "64"]):
        cli(["serve", "--model", str(saved), "--port", str(free_port()), *extra])
    assert seen == [SERVE_PREFILL_CHUNK_TOKENS, 0, 64] and SERVE_PREFILL_CHUNK_TOKENS == 256
    sk = SkipModel(make_model("llama", L), make_tokenizer())
    for kw, want in (({}, SERVE_PREFILL_CHUNK_TOKENS), ({"serial": True}, 0), ({"prefill_chunk_tokens": 32}, 32)):
        scheduler = create_app(sk, **kw).state.scheduler
        try:
            assert scheduler.engine.prefill_chunk_tokens == want
            assert scheduler.stats()["prefill_chunk_tokens"] == want
        finally:
            scheduler.close()


def test_a_real_server_streams_while_a_long_prompt_is_prefilled_in_chunks():
    """A server (a real process, 0.05 s per forward, chunks of 16) streaming one answer gets a
    prompt of about 150 tokens: /health and /metrics show it prefilling while the stream's tokens keep coming
    (at least 5 of them arrive between the long request's submission and its answer), and the
    long prompt's answer equals the same request alone."""
    from test_server_loopback import health, run, start_server, stop_server
    from test_server_metrics import parse, value

    long_prompt = " ".join(f"The Eagle {i} is a coffee shop." for i in range(12))
    sk = SkipModel(make_model("llama"), make_tokenizer())
    assert len(sk.tokenizer(long_prompt)["input_ids"]) > 8 * C
    proc, url = start_server("--prefill-chunk-tokens", str(C), "--step-delay", "0.05")
    try:
        assert health(url)["scheduler"]["prefill_chunk_tokens"] == C
        seen_prefilling, gauges = [], []

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                stamps = []

                async def stream():
                    body = {"prompt": "The", "max_tokens": 60, "stream": True, "ignore_eos": True}
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                stamps.append(time.monotonic())

                async def long_request():
                    while len(stamps) < 3:
                        await asyncio.sleep(0.01)
                    t0 = time.monotonic()
                    task = asyncio.create_task(c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 5}))
                    while not task.done():
                        seen_prefilling.append((await c.get("/health")).json()["scheduler"]["prefilling"])
                        gauges.append(value(parse((await c.get("/metrics")).text), "skipdecode_prefilling_rows"))
                        await asyncio.sleep(0.05)
                    return t0, time.monotonic(), await task

                _, (t0, t1, answer) = await asyncio.gather(stream(), long_request())
                return stamps, t0, t1, answer

        stamps, t0, t1, answer = run(scenario(), 90)
    finally:
        stop_server(proc)
    assert answer.status_code == 200, answer.text
    assert json.loads(answer.text)["choices"][0]["text"] == sk.generate([long_prompt], max_new_tokens=5).texts[0]
    assert 1 in seen_prefilling and 1 in gauges  # /health and /metrics both show it
    assert sum(t0 < s < t1 for s in stamps) >= 5  # the stream went on during the chunks


def test_compiled_chunks_equal_eager_and_compile_nothing_new(tokenizer):
    """Under a compiled model (aot_eager, warmed up), chunked prefills of 40- and 57-token prompts
    (one after a stored prefix) compile no new graph and give eager's tokens and logits (1e-5)."""
    from torch._dynamo.utils import counters

    from skipdecode.compiled import compile_adapter, warm_up

    torch._dynamo.reset()
    counters.clear()
    eager = SkipModel(make_model("llama", num_layers=6), tokenizer)
    sk = SkipModel(make_model("llama", num_layers=6), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    after_warm = counters["stats"]["unique_graphs"]
    shared = prompt(24, 5)
    reqs = [Request(shared + prompt(16, 6), 4, POLICIES[1]), Request(prompt(6, 7), 6),
            Request(shared + prompt(33, 8), 5, POLICIES[2])]
    want = drive(Engine(eager.adapter, 4, keep_logits=True, prefill_chunk_tokens=C), reqs, [0, 0, 2])
    got = drive(Engine(sk.adapter, 4, keep_logits=True, prefill_chunk_tokens=C), reqs, [0, 0, 2])
    assert counters["stats"]["unique_graphs"] == after_warm
    assert report.enabled and report.prefill, report.error
    for (toks, logits, _), (want_toks, want_logits, _) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-5


def test_requests_with_the_same_prompt_are_prefilled_once(monkeypatch):
    """A request's n choices (the same prompt, their own seeds) joining at one step: the prompt
    runs once, whole (one left-padded 2-row forward for 3 twins and another prompt) or in chunks
    (4 forwards for 3 twins of 50 tokens), every twin's slot holds the whole prompt in every
    layer, and each choice equals its solo seeded sample; twins count their prompt as cached."""
    adapter = adapter_of("llama")
    sizes = forward_sizes(monkeypatch)
    for n_tokens, forwards in ((12, [(2, 12)]), (50, [(1, 5)] + [(1, 16)] * 3 + [(1, 2)])):
        sizes.clear()
        same = prompt(n_tokens, 60)
        reqs = [Request(same, 6, POLICIES[1], SamplingParams(temperature=1.0, seed=j)) for j in range(3)]
        reqs.append(Request(prompt(5, 61), 4))
        eng = Engine(adapter, 4, prefill_chunk_tokens=C, prefix_cache=False)
        joined = {}
        for r in reqs:
            eng.submit(r)
        got = {id(r): [] for r in reqs}
        while eng.busy:
            for ev in eng.step():
                got[id(ev.row.request)].append(ev.token)
                if ev.step == 0:
                    joined[id(ev.row.request)] = ev.row
                    assert eng.cache.lengths[:, ev.row.slot].tolist() == [len(ev.row.request.prompt_ids)] * L
        assert sorted((rows, k) for kind, rows, k in sizes if kind == "prefill") == sorted(forwards)
        assert [joined[id(r)].cached_prompt_tokens for r in reqs] == [0, n_tokens, n_tokens, 0]
        for r in reqs:
            assert got[id(r)] == solo(adapter, list(r.prompt_ids), r.policy, r.max_new_tokens, r.sampling)[0]


def test_cancelling_the_first_of_twins_in_a_chunked_prefill_hands_it_on():
    adapter = adapter_of("llama")
    same = prompt(50, 70)
    a, b = Request(same, 4), Request(same, 5, POLICIES[2])
    eng = Engine(adapter, 2, prefill_chunk_tokens=C)
    eng.submit(a)
    eng.submit(b)
    eng.step()  # both admitted, the first chunk runs
    assert len(eng.prefilling) == 1 and eng.held_requests() == [a, b] and eng.free_slots == []
    eng.cancel(a)
    toks = []
    while eng.busy:
        toks += [ev.token for ev in eng.step() if ev.row.request is b]
        assert all(r is b for r in eng.held_requests())
    assert toks == solo(adapter, same, b.policy, 5)[0]
    assert sorted(eng.free_slots) == [0, 1]


def test_copy_slot_refuses_an_empty_source():
    from skipdecode.cache import SlotCache

    with pytest.raises(ValueError, match="copy_slot needs a loaded source slot"):
        SlotCache(2, 4).copy_slot(0, 1)
