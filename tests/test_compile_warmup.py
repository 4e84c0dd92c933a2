"""The long-prompt warm-up (skipdecode.compile_warmup.warm_up_long_prompts): after it, long
prompts (attention scores past MAX_SCORES: SDPA's path), whole in batches, after a stored prefix
and chunked, compile nothing new, and answer as eager does."""

from __future__ import annotations

import torch

from skipdecode.compile_warmup import warm_up_long_prompts
from skipdecode.compiled import compile_adapter, warm_up
from skipdecode.engine import Engine, Request
from skipdecode.model import SkipModel

from conftest import make_model
from test_compiled import run_waves
from test_decode_only_adapter import decode_only_dir  # noqa: F401  (a fixture)
from test_skip_adapter import ADAPTER_POLICY, adapter_dir, base_dir  # noqa: F401  (fixtures)

CHUNK = 150  # the test models hold 256 positions: chunks of 150 reach SDPA's path (T x K > 128 x 128)


def _ids(seed, count, vocab):
    return [(seed * 104729 + 17 * i + 5) % vocab for i in range(count)]


def _long_traffic(adapter, vocab):
    """Prompts of 135-250 tokens other than the warm-up's: three whole at once from an empty
    cache, two after a stored 24-token prefix, one alone, one chunked (150 + 100); returns each
    row's tokens and first logits."""
    shared = _ids(90, 24, vocab)
    engine = Engine(adapter, max_batch_size=4, keep_logits=True, prefill_chunk_tokens=CHUNK)
    out = run_waves(engine, ([shared + _ids(91, 111, vocab), shared + _ids(92, 116, vocab), _ids(93, 148, vocab)],
                             [shared + _ids(94, 120, vocab), shared + _ids(95, 124, vocab)],
                             [_ids(96, 149, vocab)], [_ids(97, 250, vocab)]))
    assert engine.prefix_cache.stats()["cached_prompt_tokens"] >= 48  # the second wave ran after the prefix
    return out


def test_long_prompts_compile_nothing_new_after_the_long_warm_up(tokenizer):
    """After ``warm_up`` and ``warm_up_long_prompts`` (what ``skipdecode serve --compile``
    runs), long-prompt traffic compiles no new graph and breaks none, and every row's tokens and
    first logits equal the eager engine's (1e-5, float32). Without the long warm-up the same
    traffic compiles new graphs (the check can fail)."""
    from torch._dynamo.utils import counters

    vocab = 128
    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    want = _long_traffic(eager.adapter, vocab)
    for long_warm_up in (False, True):
        torch._dynamo.reset()
        counters.clear()
        sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
        report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
        if long_warm_up:
            before = report.compile_seconds
            assert warm_up_long_prompts(sk, report, CHUNK) is report and report.compile_seconds > before
        after_warm = counters["stats"]["unique_graphs"]
        got = _long_traffic(sk.adapter, vocab)
        new_graphs = counters["stats"]["unique_graphs"] - after_warm
        assert (new_graphs == 0) == long_warm_up, new_graphs
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert report.enabled and report.prefill, report.prefill_error
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-5


def test_long_warm_up_is_a_no_op_when_compiling_is_off(tokenizer):
    """A report whose compiling is off (eager model) comes back unchanged, nothing run."""
    from skipdecode.compiled import CompileReport

    sk = SkipModel(make_model("llama", num_layers=2), tokenizer)
    report = CompileReport(enabled=False, error="no compiler here")
    assert warm_up_long_prompts(sk, report, CHUNK) is report and report.compile_seconds == 0.0



def _lone_rows(sk):
    """Two rows whose first (slot 0) ends early, so that the other runs alone in slot 1 (keys
    gathered, a batch of one): a skipping row after a full-depth one, then the reverse."""
    policy = sk.policy if sk.policy is not None and sk.policy.to_dict().get("type") != "full" else ADAPTER_POLICY
    engine = Engine(sk.adapter, max_batch_size=2, prefix_cache=False)
    for short, long_ in ((None, policy), (policy, None)):
        engine.run([Request([5, 6, 7, 8], max_new_tokens=3, policy=short),
                    Request([9, 10, 11], max_new_tokens=9, policy=long_)])


def test_a_row_alone_in_a_later_slot_compiles_nothing_new(base_dir, decode_only_dir):  # noqa: F811
    """A row left alone in slot 1 when the row in slot 0 ends (a server's everyday case), skipping
    or at full depth, with a decode-only skip adapter (whose switch state is part of each compiled
    variant: once a 1 s compile mid-serving): nothing new after ``warm_up``. (Without an adapter
    the old warm-up already covered it; the adapter's switch makes the case that failed.)"""
    from torch._dynamo.utils import counters

    from skipdecode import load

    torch._dynamo.reset()
    counters.clear()
    sk = load(str(base_dir), adapter=str(decode_only_dir))
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    assert report.enabled, report.error
    after_warm = counters["stats"]["unique_graphs"]
    _lone_rows(sk)
    assert counters["stats"]["unique_graphs"] == after_warm


def test_health_reports_graphs_compiled_after_the_server_started(tokenizer):
    """``/health``'s ``compile``: None for an eager model; for a compiled one its warm-up seconds
    and ``graphs_after_start``, 0 while requests stay within what the warm-ups ran, and counting
    the graphs a request compiled mid-serving (a long prompt without the long-prompt warm-up)."""
    from fastapi.testclient import TestClient

    from skipdecode.server import create_app

    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    with TestClient(create_app(eager, "tiny")) as client:
        assert client.get("/health").json()["compile"] is None
    torch._dynamo.reset()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    sk.compile_report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    with TestClient(create_app(sk, "tiny", prefill_chunk_tokens=CHUNK)) as client:
        short = client.post("/v1/completions", json={"prompt": "The Eagle", "max_tokens": 4})
        state = client.get("/health").json()["compile"]
        assert short.status_code == 200
        assert state["enabled"] and state["warm_up_seconds"] > 0 and state["graphs_after_start"] == 0
        long_ = client.post("/v1/completions", json={"prompt": [_ids(3, 200, 128)], "max_tokens": 2})
        assert long_.status_code == 200
        assert client.get("/health").json()["compile"]["graphs_after_start"] > 0


def test_a_chunked_prompt_never_ends_in_a_one_token_chunk(tokenizer):
    """A prompt one token longer than a whole number of chunks (17 tokens in chunks of 8) is
    prefilled as 8 + 7 + 2: a last chunk of one token had a decode step's shape on the prompt's
    own cache (its key length equal to the cache's size), a variant that compiled mid-serving.
    After ``warm_up`` it compiles nothing, and its answer equals the whole prefill's (1e-5)."""
    from torch._dynamo.utils import counters

    from skipdecode.chunked_prefill import run_chunk, start_partial

    prompt = _ids(5, 17, 128)
    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    part = start_partial(eager.adapter, Request(prompt, max_new_tokens=2), 0, None, 0.0)
    sizes = []
    while part.remaining:
        before = part.done
        run_chunk(eager.adapter, part, 8, torch.device("cpu"))
        sizes.append(part.done - before)
    assert sizes == [8, 7, 2]
    want = run_waves(Engine(eager.adapter, max_batch_size=2, keep_logits=True), [[prompt]])
    torch._dynamo.reset()
    counters.clear()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    after_warm = counters["stats"]["unique_graphs"]
    got = run_waves(Engine(sk.adapter, max_batch_size=2, keep_logits=True, prefill_chunk_tokens=8), [[prompt]])
    assert counters["stats"]["unique_graphs"] == after_warm
    assert got[0][0] == want[0][0] and (got[0][1] - want[0][1]).abs().max().item() <= 1e-5


def test_one_token_after_a_stored_prefix_compiles_nothing_new(tokenizer):
    """A prompt that is a stored prefix and one token more (the same prompt sent again, or a
    request's choices arriving apart) prefills one token on the stored keys: alone and two at once,
    nothing new after ``warm_up`` (it compiled mid-serving on a user's check), answers equal to
    the eager engine's (1e-5)."""
    from torch._dynamo.utils import counters

    shared = _ids(11, 16, 128)
    waves = [[shared + [3, 4, 5], shared + [6, 7]], [shared + [8]], [shared + [9], shared + [10]]]
    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    want = run_waves(Engine(eager.adapter, max_batch_size=4, keep_logits=True), waves)
    torch._dynamo.reset()
    counters.clear()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    after_warm = counters["stats"]["unique_graphs"]
    engine = Engine(sk.adapter, max_batch_size=4, keep_logits=True)
    got = run_waves(engine, waves)
    assert engine.prefix_cache.stats()["cached_prompt_tokens"] == 3 * 16  # the last three ran one token each
    assert counters["stats"]["unique_graphs"] == after_warm
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks and (logits - want_logits).abs().max().item() <= 1e-5
