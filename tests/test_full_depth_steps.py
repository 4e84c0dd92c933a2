"""Full-depth first steps (``LinearDecayPolicy.full_depth_steps``) and the rule that a decode step
running every layer runs the base model's weights when the model carries a decode-only skip
adapter: in the static loop, in flight (rows of one step mixing full-depth and skipping plans), and
for a single wrapper with some rows marked."""

from __future__ import annotations

import pytest
import torch

from test_decode_only_adapter import PROMPTS, _reference, decode_only_dir  # noqa: F401  (fixture)
from test_skip_adapter import NUM_LAYERS, adapter_dir, base_dir  # noqa: F401  (fixtures)
from skipdecode import load
from skipdecode.cache import SkipCache
from skipdecode.forward import skip_forward
from skipdecode.lowrank import LowRankLinear, PrefillSwitch
from skipdecode.policy import FullPolicy, LinearDecayPolicy, policy_from_dict

BASE = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=2, warmup_layers=1, horizon=4)
K = 2
WARM = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=2, warmup_layers=1, horizon=4,
                         full_depth_steps=K)
N_NEW = 8


def test_budgets_start_at_full_depth_then_follow_the_decay_from_its_start():
    assert [WARM.budget(t) for t in (1, 2)] == [NUM_LAYERS, NUM_LAYERS]
    assert WARM.active_layers(1) == tuple(range(NUM_LAYERS))
    assert [WARM.active_layers(K + j) for j in range(1, 7)] == [BASE.active_layers(j) for j in range(1, 7)]
    budgets = [WARM.budget(t) for t in range(1, 12)]
    assert budgets == sorted(budgets, reverse=True)  # non-increasing: the KV cache invariant holds
    # 2 extra full steps of 6 layers over 6 decode steps: (6 + 6 + 4 layers...) against BASE's sum
    assert WARM.expected_speedup(6) == pytest.approx(6 * 6 / (12 + sum(BASE.budget(t) for t in range(1, 5))))


def test_dict_round_trip_and_the_papers_dict_unchanged():
    assert "full_depth_steps" not in BASE.to_dict()  # stored schedules keep the dict they had
    assert WARM.to_dict()["full_depth_steps"] == K
    assert policy_from_dict(WARM.to_dict()) == WARM and policy_from_dict(BASE.to_dict()) == BASE
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="full_depth_steps must be"):
            LinearDecayPolicy(num_layers=6, max_layers=4, min_layers=2, full_depth_steps=bad)


def test_policy_for_keeps_the_default_policys_full_depth_steps(base_dir):  # noqa: F811
    sk = load(str(base_dir), adapter=False, policy=WARM)
    assert sk.policy_for(min_layers=3).full_depth_steps == K
    assert sk.policy_for(full_depth_steps=0).full_depth_steps == 0
    with pytest.raises(ValueError, match="full_depth_steps must be >= 0"):
        sk.policy_for(full_depth_steps=-1)


def test_row_marked_base_rows_get_the_base_output():
    """One wrapper, merged and unmerged: rows marked by the switch get ``base(x)``, the others
    ``base(x) + delta``; a marking of the wrong length is refused."""
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    x = torch.randn(3, 1, 8)
    delta = 1.5 * (x @ a.T) @ b.T
    merged_base = torch.nn.Linear(8, 6)
    with torch.no_grad():
        merged_base.weight.copy_(base.weight + 1.5 * b @ a)
        merged_base.bias.copy_(base.bias)
    switch = PrefillSwitch()
    for module in (LowRankLinear(base, a, b, 1.5, switch=switch),
                   LowRankLinear(merged_base, a, b, 1.5, merged=True, switch=switch)):
        switch.rows = torch.tensor([True, False, True])
        with torch.no_grad():
            out = module(x)
        torch.testing.assert_close(out[[0, 2]], base(x)[[0, 2]], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1], (base(x) + delta)[1], rtol=1e-5, atol=1e-5)
        switch.rows = torch.tensor([True, False])
        with pytest.raises(RuntimeError, match="mark 2 rows, the call has 3"):
            module(x)
    switch.rows = None


def _warm_reference(stock, merged, prompt: str) -> list[int]:
    """Greedy tokens built by hand: the stock model prefills and runs decode steps 1..K at full
    depth, then the merged adapter model decodes from the same cache under WARM's budgets."""
    ids = stock.tokenizer(prompt, return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    cache = SkipCache(NUM_LAYERS, capacity=ids.shape[1] + N_NEW)
    with torch.no_grad():
        tokens = [int(skip_forward(stock.adapter, ids, mask, cache=cache, logits_last_only=True)[0, -1].argmax())]
        for step in range(1, N_NEW):
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], 1)
            model = stock if step <= K else merged
            logits = skip_forward(model.adapter, torch.tensor([[tokens[-1]]]), mask,
                                  active_layers=WARM.active_layers(step), cache=cache)[:, -1]
            tokens.append(int(logits.argmax(-1)))
    return tokens


def test_full_depth_steps_run_the_base_model_static_and_in_flight(base_dir, adapter_dir, decode_only_dir):  # noqa: F811
    stock = load(str(base_dir), adapter=False)
    merged = load(str(base_dir), adapter=str(adapter_dir))
    only = load(str(base_dir), adapter=str(decode_only_dir))
    prompts = [*PROMPTS, "name[Zizzi] area[city centre]", "Tell me about the riverside"]
    want = [_warm_reference(stock, merged, p) for p in prompts]
    for p, w in zip(prompts, want):
        static = only.generate(p, policy=WARM, max_new_tokens=N_NEW, chat=False)
        assert list(static.token_ids[0]) == w
    # the same schedule with the adapter on at its full-depth steps writes other tokens: the switch acts
    assert any(w != _reference(stock, merged, p, WARM, n=N_NEW)[0] for p, w in zip(prompts, want))
    # full depth alone is the stock model's answer, token for token
    full = only.generate(prompts, policy=FullPolicy(NUM_LAYERS), max_new_tokens=N_NEW, chat=False)
    stock_full = stock.generate(prompts, policy=FullPolicy(NUM_LAYERS), max_new_tokens=N_NEW, chat=False)
    assert [list(t) for t in full.token_ids] == [list(t) for t in stock_full.token_ids]
    # in flight: rows of different lengths joining at different steps, so some steps run rows at full
    # depth beside skipping rows; each row's tokens and logits equal its solo static run
    import skipdecode.engine as engine_module
    from test_inflight import run_inflight, solo

    ids = [only.tokenizer(p).input_ids for p in prompts]
    reqs = [engine_module.Request(list(x), n, WARM) for x, n in zip(ids, (8, 5, 7, 6))]
    marks, real = [], engine_module.base_rows

    def spy(model, rows):
        marks.append(rows.clone())
        return real(model, rows)

    engine_module.base_rows = spy
    try:
        _, results = run_inflight(only.adapter, reqs, [0, 1, 3, 4], max_batch_size=4)
    finally:
        engine_module.base_rows = real
    assert any(bool(m.any()) and not bool(m.all()) for m in marks), "no step mixed full-depth and skipping rows"
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(only.adapter, list(req.prompt_ids), WARM, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert [r[0] for r in results][0] == want[0][:8]


@pytest.mark.slow  # about 30 s of compiling on 2 cores
def test_compiled_layers_give_the_eager_tokens_with_full_depth_steps(base_dir, decode_only_dir):  # noqa: F811
    """A compiled layer call (aot_eager) sees the switch flip between the base weights (full-depth
    steps, all rows or some) and the adapter: same tokens as eager, static and in flight, no fallback."""
    from skipdecode.compiled import compile_adapter

    torch._dynamo.reset()
    eager = load(str(base_dir), adapter=str(decode_only_dir))
    compiled = load(str(base_dir), adapter=str(decode_only_dir))
    report = compile_adapter(compiled.adapter, backend="aot_eager")
    prompts = [*PROMPTS, "name[Zizzi]"]
    for kw in ({}, {"max_batch_size": 2}):
        want = eager.generate(prompts, policy=WARM, max_new_tokens=N_NEW, chat=False, **kw)
        got = compiled.generate(prompts, policy=WARM, max_new_tokens=N_NEW, chat=False, **kw)
        assert [list(t) for t in got.token_ids] == [list(t) for t in want.token_ids]
    assert report.enabled, report.error


@pytest.fixture(scope="module")
def warmed_decode_only(base_dir, decode_only_dir):  # noqa: F811
    """The tiny model with its decode-only adapter and the ``WARM`` schedule, compiled (aot_eager)
    and warmed up at batch 1 and 2 after a dynamo reset, once for the tests below (each checks
    only that its own traffic compiles nothing new): ``(sk, report, graphs)``, ``graphs()`` the
    count of compiled graphs so far."""
    from torch._dynamo.utils import counters

    from skipdecode.compiled import compile_adapter, warm_up

    torch._dynamo.reset()
    counters.clear()
    sk = load(str(base_dir), adapter=str(decode_only_dir))
    sk.policy = WARM
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    return sk, report, lambda: counters["stats"]["unique_graphs"]


def test_warm_up_compiles_the_full_depth_steps_and_the_switch_to_the_adapter(warmed_decode_only):
    """With a decode-only adapter and a schedule with full-depth first steps (the embedded
    model's shipped 2x), nothing compiles after :func:`warm_up`: static generations past the
    full-depth steps (a user's `generate --speedup 2 --compile` once recompiled inside its timed
    steps when the switch first flipped from the base weights to the adapter), then in flight
    (what `serve --compile` runs by default) batches of up to 5 rows of different ages and
    speedups, some on the base weights and some on the adapter in the same step (a server once
    recompiled mid-load on such a batch)."""
    from skipdecode.engine import Engine, Request

    sk, report, graphs = warmed_decode_only
    after_warm = graphs()
    for B in (1, 2, 3):
        sk.generate([*PROMPTS, "name[Zizzi]"][:B], policy=WARM, max_new_tokens=N_NEW, chat=False)
    assert graphs() == after_warm
    engine = Engine(sk.adapter, max_batch_size=6)
    ids = sk.tokenizer("name[The Eagle], eatType[coffee shop]")["input_ids"]
    for i, plan in enumerate([WARM, None, WARM, None, WARM]):  # a row joins every other step
        engine.submit(Request(list(ids[: 4 + i]), max_new_tokens=N_NEW + 2 * i, policy=plan))
        engine.step()
        engine.step()
    while engine.busy:
        engine.step()
    assert report.enabled, report.error
    assert graphs() == after_warm


def test_a_row_alone_in_a_later_slot_compiles_nothing_new(warmed_decode_only):
    """A row left alone in slot 1 when the row in slot 0 ends (a server's everyday case), skipping
    or at full depth, with a decode-only skip adapter (whose switch state is part of each compiled
    variant: once a 1 s compile mid-serving): nothing new after ``warm_up``. Two rows, the first
    ending early: a skipping row after a full-depth one, then the reverse."""
    from skipdecode.engine import Engine, Request

    sk, report, graphs = warmed_decode_only
    after_warm = graphs()
    engine = Engine(sk.adapter, max_batch_size=2, prefix_cache=False)
    for short, long_ in ((None, WARM), (WARM, None)):  # the long row runs steps 3-8 alone, in slot 1
        engine.run([Request([5, 6, 7, 8], max_new_tokens=3, policy=short),
                    Request([9, 10, 11], max_new_tokens=9, policy=long_)])
    assert report.enabled, report.error
    assert graphs() == after_warm
