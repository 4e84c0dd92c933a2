"""Automatic prefix caching in the in-flight engine (prefix_cache.py, engine.py, SlotCache).

For every family: requests that share a 32-token prompt prefix, joining at different steps and
together, get the greedy tokens and logits (1e-4) of their solo runs while later ones reuse the
stored prefix (counted exactly, block-rounded); a reusing prefill feeds the layers only the tokens
after the prefix; every (layer, slot) holds the whole prompt after joining. Sliding windows count
from each row's own position with padding between prefix and suffix. A small budget evicts and
stays correct; prompts that share nothing store nothing. Options are checked, and reach the engine
from every entry point; a real server reports cached tokens in OpenAI's usage field and /health.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from conftest import VOCAB, make_model, make_tokenizer
from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from test_cli_outputs import _run as cli
from test_inflight import L, POLICIES, adapter_of, solo
from test_server_loopback import health, run, start_server, stop_server
from skipdecode import SkipModel, get_adapter
from skipdecode.engine import Engine, Request
from skipdecode.prefix_cache import DEFAULT_PREFIX_TOKENS, PrefixCache

SHARED = 32  # tokens of the shared prefix: a multiple of the block size (8)

def _spy_engine_prefix_cache(monkeypatch) -> list:
    """Record the ``prefix_cache`` argument of every Engine built from now on (list returned)."""
    import skipdecode.engine as engine_mod

    seen = []
    real = engine_mod.Engine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("prefix_cache"))
        real(self, *a, **kw)
    monkeypatch.setattr(engine_mod.Engine, "__init__", spy)
    return seen



def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n,), generator=g).tolist()  # ids >= 5: no special id


PREFIX = ids(SHARED, 1000)
OTHER = ids(SHARED, 2000)  # another prefix (distinct first token from PREFIX)
assert PREFIX[0] != OTHER[0]

# (prompt, policy index, max_new_tokens, join step, cached prompt tokens expected)
CASES = [
    (PREFIX + ids(5, 1), 1, 6, 0, 0),         # first two join together: nothing stored yet
    (PREFIX + ids(3, 2), 2, 5, 0, 0),         # ... their shared 32 tokens are stored after it
    (PREFIX + ids(9, 3), 0, 6, 2, SHARED),    # later: reuse all 32
    (PREFIX + ids(1, 4), 3, 7, 3, SHARED),    # prompt = prefix + 1 token
    (PREFIX + ids(6, 5), 1, 4, 3, SHARED),    # same group: suffixes of 1 and 6, left-padded
    (PREFIX[:20] + ids(7, 6), 2, 5, 5, 16),   # shares 20 tokens: 16 (block-rounded) stored and reused
    (OTHER + ids(4, 7), 1, 5, 5, 0),          # nothing shared, joins in the same step: its own group
    (list(PREFIX), 0, 5, 7, 24),              # exactly the prefix: at most 31 may be reused -> 24
]


def requests_of(cases):
    return [Request(list(p), m, POLICIES[k]) for p, k, m, _, _ in cases]


def assert_solo(adapter, reqs, results):
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def cached_of(eng_rows):
    return [r.cached_prompt_tokens for r in eng_rows]


def run_rows(adapter, reqs, join_steps, **engine_kw):
    """Like ``run_inflight``, also returning each request's :class:`Row`."""
    eng = Engine(adapter, max_batch_size=8, keep_logits=True, **engine_kw)
    got = {id(r): ([], []) for r in reqs}
    rows = {}
    step, pending = 0, sorted(range(len(reqs)), key=lambda i: join_steps[i])
    while pending or eng.busy:
        while pending and join_steps[pending[0]] <= step:
            eng.submit(reqs[pending.pop(0)])
        for ev in eng.step():
            rows[id(ev.row.request)] = ev.row
            got[id(ev.row.request)][0].append(ev.token)
            got[id(ev.row.request)][1].append(ev.logits)
        step += 1
    results = [(got[id(r)][0], torch.stack(got[id(r)][1])) for r in reqs]
    return eng, [rows[id(r)] for r in reqs], results


def test_shared_prefix_rows_equal_solo_runs_and_later_ones_reuse_it(family):
    adapter = adapter_of(family)
    reqs = requests_of(CASES)
    eng, rows, results = run_rows(adapter, reqs, [c[3] for c in CASES])
    assert cached_of(rows) == [c[4] for c in CASES]
    assert_solo(adapter, reqs, results)
    stats = eng.prefix_cache.stats()
    assert stats["hits"] == sum(c[4] > 0 for c in CASES)
    assert stats["cached_prompt_tokens"] == sum(c[4] for c in CASES)
    assert stats["computed_prompt_tokens"] == sum(len(c[0]) - c[4] for c in CASES)
    assert stats["stored_tokens"] == sum(len(t) for t in eng.prefix_cache.entries)
    # ... and the same requests without prefix caching: same tokens, logits to 1e-4
    _, off_rows, off = run_rows(adapter, requests_of(CASES), [c[3] for c in CASES], prefix_cache=False)
    assert cached_of(off_rows) == [0] * len(CASES)
    for (a_toks, a_logits), (b_toks, b_logits) in zip(results, off):
        assert a_toks == b_toks
        torch.testing.assert_close(a_logits, b_logits, atol=1e-4, rtol=1e-4)


def test_second_request_reuses_the_first_ones_slot_after_it_finished(family):
    """One request at a time (a chat client waiting for each answer): the 2nd already hits, its
    prefix read from the slot the 1st left (freed, not yet reloaded)."""
    adapter = adapter_of(family)
    eng = Engine(adapter, max_batch_size=2, keep_logits=True)
    prompts = [PREFIX + ids(n, 10 + n) for n in (4, 7, 2)]
    rows = [eng.run([Request(p, 5, POLICIES[1])])[0] for p in prompts]
    assert cached_of(rows) == [0, SHARED, SHARED]
    assert [r.slot for r in rows] == [0, 0, 0]  # the slot it read from is the one it then took
    for p, row in zip(prompts, rows):
        assert row.tokens == solo(adapter, p, POLICIES[1], 5)[0]


@pytest.mark.parametrize("name", ["qwen2_max_window_layers", "smollm3_nope_sliding", "mistral_window"])
def test_windowed_models_with_a_cached_prefix_equal_solo(name):
    """Windows (4 tokens) far shorter than the prompts: with padding between the cached prefix
    and a shorter suffix, each row's window still counts from its own position."""
    from test_layer_types import build

    adapter = get_adapter(build(name)[0])
    reqs = requests_of(CASES)
    _, rows, results = run_rows(adapter, reqs, [c[3] for c in CASES])
    assert cached_of(rows) == [c[4] for c in CASES]
    assert_solo(adapter, reqs, results)


def test_a_reusing_prefill_runs_only_the_tokens_after_the_prefix():
    adapter = adapter_of("llama")
    seen: list[tuple[int, int]] = []  # (batch, tokens) of layer 0's input at each call
    handle = adapter.layers[0].register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape[:2])))
    try:
        eng = Engine(adapter, max_batch_size=4)
        eng.run([Request(PREFIX + ids(3, 1), 2), Request(PREFIX + ids(5, 2), 2)])
        assert seen[0] == (2, SHARED + 5)  # nothing stored yet: the whole prompts
        seen.clear()
        eng.submit(Request(PREFIX + ids(1, 3), 3))
        eng.submit(Request(PREFIX + ids(6, 4), 3))
        eng.step()
        assert seen == [(2, 6)]  # one group: T = the longest suffix, not the 38-token prompt
    finally:
        handle.remove()


def test_rows_from_different_prefixes_share_one_prefill_call_and_equal_solo(family):
    """Joiners at one step that start from a 32-token entry, a 16-token entry and none run as one
    left-padded forward (layer 0 sees one batch of 3 rows and the longest remaining suffix; before, one call per entry), and
    every row still gets its solo tokens and logits: a row's prefix sits right-aligned after
    padding, and its own tokens continue from its own prefix length."""
    adapter = adapter_of(family)
    seen: list[tuple[int, int]] = []
    eng = Engine(adapter, max_batch_size=6, keep_logits=True)
    eng.run([Request(PREFIX + ids(3, 1), 2), Request(PREFIX + ids(5, 2), 2)])  # stores PREFIX (32)
    eng.run([Request(PREFIX[:20] + ids(6, 3), 2), Request(PREFIX[:20] + ids(4, 4), 2)])  # stores 16
    assert sorted(len(t) for t in eng.prefix_cache.entries) == [16, 32]
    reqs = [Request(PREFIX + ids(12, 5), 6, POLICIES[1]),       # reuses 32, runs 12
            Request(PREFIX[:20] + ids(9, 6), 6, POLICIES[2]),   # reuses 16, runs 13
            Request(OTHER[:10] + ids(4, 7), 6, POLICIES[3])]    # reuses nothing, runs 14
    handle = adapter.layers[0].register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape[:2])))
    try:
        for r in reqs:
            eng.submit(r)
        got = {id(r): ([], []) for r in reqs}
        rows = {}
        while eng.busy:
            for ev in eng.step():
                rows[id(ev.row.request)] = ev.row
                got[id(ev.row.request)][0].append(ev.token)
                got[id(ev.row.request)][1].append(ev.logits)
                if ev.step == 0:
                    assert seen == [(3, 14)]  # one prefill call: 3 rows, the longest suffix
    finally:
        handle.remove()
    assert [rows[id(r)].cached_prompt_tokens for r in reqs] == [SHARED, 16, 0]
    assert_solo(adapter, reqs, [(got[id(r)][0], torch.stack(got[id(r)][1])) for r in reqs])


def test_shared_prefixes_are_chosen_only_where_they_save_tokens():
    """The plan (:func:`skipdecode.prefill_buckets.shared_prefixes`): a prefix several joiners
    share is prefilled first when that computes fewer tokens (buckets' cost, a forward = 32
    tokens); two prompts sharing 32 tokens break even (2 x 37 + 32 against 2 x 5 + 32 + 32 + 32)
    and are left alone; a prefix only one row would use, or one a stored entry covers, is not."""
    from skipdecode.prefill_buckets import buckets_cost, shared_prefixes

    tails = [ids(n, 40 + n) for n in (3, 5, 2, 6)]
    four = [PREFIX + t for t in tails]
    pc = PrefixCache()
    assert shared_prefixes(pc, four, [0] * 4) == [tuple(PREFIX)]
    assert buckets_cost([38, 38, 38, 38]) == 4 * 38 + 32 and buckets_cost([]) == 0
    assert shared_prefixes(pc, four[:2], [0, 0]) == []  # 106 against 42 + 64: no gain
    lone = PREFIX[:16] + ids(9, 50)  # shares 16 with the others, but their own longest is 32
    assert shared_prefixes(pc, four + [lone], [0] * 5) == [tuple(PREFIX)]
    two_pairs = [PREFIX + ids(4, 60), PREFIX + ids(5, 61), OTHER + ids(4, 62), OTHER + ids(6, 63)]
    assert sorted(shared_prefixes(pc, two_pairs * 2, [0] * 8)) == sorted([tuple(PREFIX), tuple(OTHER)])
    pc.store(PREFIX, *[[torch.zeros(2, SHARED, 4)] * 2] * 2)  # stored: nothing left to share
    assert shared_prefixes(pc, four, [SHARED] * 4) == []


def test_joiners_sharing_a_prefix_prefill_it_once_first_and_equal_solo(family):
    """Four prompts that share 32 tokens join at one step: one forward runs the prefix (1 row, 32
    tokens) and stores it, then one runs the four after it (4 rows, the longest tail); every row
    gets its solo tokens and logits, reports 32 cached tokens, and the cache counts 32 + the tails
    as computed."""
    adapter = adapter_of(family)
    tails = [ids(n, 40 + n) for n in (3, 5, 2, 6)]
    reqs = [Request(PREFIX + t, 5, POLICIES[k]) for k, t in enumerate(tails)]
    seen: list[tuple[int, int]] = []
    handle = adapter.layers[0].register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape[:2])))
    try:
        eng, rows, results = run_rows(adapter, reqs, [0] * 4)
    finally:
        handle.remove()
    assert seen[:2] == [(1, SHARED), (4, 6)]
    assert cached_of(rows) == [SHARED] * 4
    assert eng.prefix_cache.stats()["computed_prompt_tokens"] == SHARED + sum(map(len, tails))
    assert_solo(adapter, reqs, results)


def test_cache_lengths_per_layer_and_slot_are_the_whole_prompt_after_a_cached_join(family):
    adapter = adapter_of(family)
    eng = Engine(adapter, max_batch_size=4)
    eng.run([Request(PREFIX + ids(3, 1), 2), Request(PREFIX + ids(4, 2), 2)])
    reqs = [Request(PREFIX + ids(n, 5 + n), 30, POLICIES[2]) for n in (1, 6, 3)]
    for r in reqs:
        eng.submit(r)
    eng.step()  # the prefill: no decode yet
    assert all(row.cached_prompt_tokens == SHARED for row in eng.running)
    for row in eng.running:
        assert eng.cache.lengths[:, row.slot].tolist() == [len(row.request.prompt_ids)] * L
    for _ in range(3):
        eng.step()
    for row in eng.running:  # then each layer gains the steps that ran it
        counts = [len(row.request.prompt_ids)] * L
        for t in range(1, row.step + 1):
            for layer in row.request.policy.active_layers(t):
                counts[layer] += 1
        assert eng.cache.lengths[:, row.slot].tolist() == counts


def test_a_small_budget_evicts_whole_entries_and_stays_correct():
    """Room for one 32-token prefix (budget 40): two prefixes in turn evict each other; every
    answer still equals its solo run and the stored tokens never exceed the budget."""
    adapter = adapter_of("qwen2")
    budget = 40
    eng = Engine(adapter, max_batch_size=2, keep_logits=True, prefix_cache=budget)
    turns = [(PREFIX, 2, 0), (PREFIX, 1, SHARED), (OTHER, 2, 0), (OTHER, 1, SHARED), (PREFIX, 1, 0), (PREFIX, 1, SHARED)]
    seed = 50
    for prefix, n, cached in turns:  # (prefix, requests joining together, cached tokens each)
        reqs = [Request(prefix + ids(3 + k, seed + k), 4, POLICIES[k + 1]) for k in range(n)]
        seed += n
        got = {id(r): ([], []) for r in reqs}
        rows = {}
        for r in reqs:
            eng.submit(r)
        while eng.busy:
            for ev in eng.step():
                rows[id(ev.row.request)] = ev.row
                got[id(ev.row.request)][0].append(ev.token)
                got[id(ev.row.request)][1].append(ev.logits)
            assert eng.prefix_cache.stored_tokens <= budget
        assert [rows[id(r)].cached_prompt_tokens for r in reqs] == [cached] * n
        assert_solo(adapter, reqs, [(got[id(r)][0], torch.stack(got[id(r)][1])) for r in reqs])
    # the 5th turn's prefix had been evicted, and the slots that held it reloaded: computed again
    stats = eng.prefix_cache.stats()
    assert (stats["hits"], stats["evictions"], stats["entries"], stats["stored_tokens"]) == (3, 2, 1, SHARED)


def test_prompts_sharing_nothing_store_nothing_and_run_as_before(family):
    adapter = adapter_of(family)
    firsts = [5 + 7 * i for i in range(6)]  # distinct first tokens
    prompts = [[f] + ids(20 + i, 300 + i) for i, f in enumerate(firsts)]
    joins = [0, 0, 1, 3, 3, 6]
    reqs = [Request(p, 5, POLICIES[i % 4]) for i, p in enumerate(prompts)]
    eng, rows, on = run_rows(adapter, reqs, joins)
    _, _, off = run_rows(adapter, [Request(p, 5, POLICIES[i % 4]) for i, p in enumerate(prompts)], joins,
                         prefix_cache=False)
    assert eng.prefix_cache.stats()["entries"] == 0 and cached_of(rows) == [0] * 6
    for (a_toks, a_logits), (b_toks, b_logits) in zip(on, off):
        assert a_toks == b_toks and torch.equal(a_logits, b_logits)  # the very same computation


# ------------------------------------------------------------------------------- options
@pytest.mark.parametrize("value, budget", [(True, DEFAULT_PREFIX_TOKENS), (False, None), (0, None), (100, 100)])
def test_prefix_cache_option_sets_the_budget(value, budget):
    eng = Engine(adapter_of("llama"), max_batch_size=2, prefix_cache=value)
    assert (eng.prefix_cache and eng.prefix_cache.max_tokens) == budget


@pytest.mark.parametrize("value", [-1, 3, 1.5, "yes"])
def test_bad_prefix_cache_option_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=r"prefix_cache must be True, False or a token budget of 0 \(off\) or >= 8"):
        Engine(adapter_of("llama"), max_batch_size=2, prefix_cache=value)


@pytest.mark.parametrize("kwargs, name", [({"block_size": 0}, "block_size"), ({"min_tokens": -2}, "min_tokens"),
                                          ({"recent": 0}, "recent"), ({"max_tokens": 4}, "max_tokens")])
def test_prefix_cache_arguments_are_checked(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be an integer >= "):
        PrefixCache(**kwargs)


def test_lookup_takes_the_longest_whole_entry_and_leaves_one_token():
    pc = PrefixCache(64)
    kv = lambda n: ([torch.zeros(2, n, 4)], [torch.zeros(2, n, 4)])  # noqa: E731
    pc.store(PREFIX[:16], *kv(16))
    pc.store(PREFIX[:32], *kv(32))
    assert pc.lookup(PREFIX + [7])[1] == 32
    assert pc.lookup(PREFIX)[1] == 16  # the 32-token entry would leave nothing to run
    assert pc.lookup(PREFIX[:16] + OTHER)[1] == 16
    assert pc.lookup(OTHER) == (None, 0)
    pc.store(OTHER[:24], *kv(24))  # 72 > 64 tokens: the least recently used entry (32: the
    assert sorted(len(t) for t in pc.entries) == [16, 24] and pc.stats()["evictions"] == 1  # 16 was used since)
    assert pc.store(ids(72, 9)[:72], *kv(72)) is None  # larger than the whole budget: not stored


def test_generate_and_evaluate_pass_the_option_and_record_cached_tokens(tokenizer, monkeypatch):
    from skipdecode.data import EvalItem
    from skipdecode.evaluate import evaluate

    sk = SkipModel(make_model("llama", L), tokenizer)
    instruction = "Describe the restaurant in one sentence. Description: a cheap family friendly pub. "
    prompts = [instruction + x for x in ("The Eagle", "name[The Eagle]", "The quick brown fox", "Summarize")]
    seen = _spy_engine_prefix_cache(monkeypatch)
    on = sk.generate(prompts, max_new_tokens=6, max_batch_size=2)
    off = sk.generate(prompts, max_new_tokens=6, max_batch_size=2, prefix_cache=False)
    assert seen == [True, False]
    assert on.token_ids == off.token_ids
    assert on.stats()["cached_prompt_tokens"] > 0 == off.stats()["cached_prompt_tokens"]
    # the first two join together and share the 48-token instruction: it is prefilled once first
    assert on.cached_prompt_tokens[:2] == [48, 48] and min(on.cached_prompt_tokens[2:]) >= 8
    items = [EvalItem(p, ("a pub",), p) for p in prompts]
    kw = dict(batch_size=2, max_new_tokens=5, stop=(), warmup=False, inflight=True)
    rep_on = evaluate(sk, items, [2.0], **kw)
    rep_off = evaluate(sk, items, [2.0], prefix_cache=False, **kw)
    assert rep_on.meta["prefix_cache"] is True and rep_off.meta["prefix_cache"] is False
    for a, b in zip(rep_on.rows, rep_off.rows):
        assert a.generations == b.generations and a.prompt_tokens == b.prompt_tokens > 0
        assert a.cached_prompt_tokens > 0 == b.cached_prompt_tokens
        assert a.to_dict()["cached_prompt_tokens"] == a.cached_prompt_tokens
    with pytest.raises(ValueError, match="prefix_cache"):
        evaluate(sk, items, [2.0], prefix_cache=-5, **kw)


# ------------------------------------------------------------------------------- the CLI
def test_cli_no_prefix_cache_reaches_generate_eval_and_serve(saved, tmp_path, monkeypatch):  # noqa: F811
    import skipdecode.server as server_module

    seen = _spy_engine_prefix_cache(monkeypatch)
    base = ["generate", "The Eagle is", "A coffee shop", "--model", str(saved), "-n", "3", "--json"]
    on, _ = cli(base)
    off, _ = cli(base + ["--no-prefix-cache"])
    assert on.exit_code == 0 and off.exit_code == 0, (on.output, off.output)
    assert seen == [True, False]
    assert "cached_prompt_tokens" in json.loads(on.stdout)["stats"]

    from test_cohort_options import eval_kwargs

    assert eval_kwargs(saved, tmp_path, monkeypatch, "--no-prefix-cache")["prefix_cache"] is False

    apps = {}

    def fake_create_app(*a, **kw):
        apps.update(kw)
        raise RuntimeError("stop here")
    monkeypatch.setattr(server_module, "create_app", fake_create_app)
    from test_server_loopback import free_port

    cli(["serve", "--model", str(saved), "--port", str(free_port()), "--no-prefix-cache"])
    assert apps["prefix_cache"] is False


def test_benchmarks_take_no_prefix_cache():
    from conftest import load_benchmark

    assert load_benchmark("server_load")._parse(["--no-prefix-cache"]).no_prefix_cache is True
    assert load_benchmark("eval_e2e")._parse(["--no-prefix-cache"]).no_prefix_cache is True


# ---------------------------------------------------------- the server, a real process
SYSTEM = "You are a helpful assistant who answers in one short sentence about restaurants."


def test_server_reuses_a_shared_system_prompt_and_reports_it():
    proc, url = start_server("--max-batch-size", "4", "--step-delay", "0.01")
    try:
        sk = SkipModel(make_model("llama"), make_tokenizer())  # the server's model, built the same way
        users = ["The Eagle", "Blue Spice", "The Mill", "Aromi", "Green Man", "Five"]

        def body(u):
            return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}],
                    "max_tokens": 6}

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                first = await c.post("/v1/chat/completions", json=body(users[0]))
                rest = await asyncio.gather(*(c.post("/v1/chat/completions", json=body(u)) for u in users[1:]))
                return [first, *rest]

        answers = run(scenario(), 90)
        assert [a.status_code for a in answers] == [200] * len(users)
        cached = [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        assert cached[0] == 0 and min(cached[1:]) >= 16  # the system prompt is > 16 tokens here
        for u, a in zip(users, answers):
            conversation = body(u)["messages"]
            want = sk.generate([conversation], max_new_tokens=6)
            assert a.json()["choices"][0]["message"]["content"] == want.texts[0]
            assert a.json()["usage"]["skipdecode"]["cached_prompt_tokens"] == a.json()["usage"][
                "prompt_tokens_details"]["cached_tokens"]
        stats = health(url)["scheduler"]["prefix_cache"]
        assert stats["hits"] == len(users) - 1 and stats["cached_prompt_tokens"] == sum(cached)
    finally:
        stop_server(proc)


def test_server_without_prefix_cache_reports_none():
    proc, url = start_server("--no-prefix-cache")
    try:
        assert health(url)["scheduler"]["prefix_cache"] is None
        r = httpx.post(url + "/v1/completions", json={"prompt": "The Eagle", "max_tokens": 2}, timeout=30)
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    finally:
        stop_server(proc)
