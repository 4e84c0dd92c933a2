"""What ``skipdecode serve --compile`` warms up compiles everything its traffic needs: after
``warm_up`` a chunked prompt of kC + 1 tokens (its last chunk of one token), a stored prefix plus one token and a wave sharing a
prefix compile nothing new (a row alone in a later slot: tests/test_full_depth_steps.py); after the long-prompt warm-up
(skipdecode.compile_warmup.warm_up_long_prompts), long prompts (attention scores past
MAX_SCORES: SDPA's path), whole in batches, after a stored prefix and chunked, compile nothing
new either; all answer as eager does; ``/health`` counts the graphs compiled after start-up.

The tests that need a fresh dynamo (``torch._dynamo.reset()``) come first. The others share one
warmed model (the ``warmed`` fixture, about 15 s of compiling saved per test) and run in file
order: each checks only that its own traffic compiles nothing new; the /health test's long prompt
compiles on purpose, before the last test runs the long-prompt warm-up."""

from __future__ import annotations

import pytest
import torch

from skipdecode.compile_warmup import warm_up_long_prompts
from skipdecode.compiled import compile_adapter, warm_up
from skipdecode.engine import Engine, Request
from skipdecode.model import SkipModel

from conftest import make_model
from test_compiled import run_waves

CHUNK = 150  # the test models hold 256 positions: chunks of 150 reach SDPA's path (T x K > 128 x 128)
VOCAB = 128


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


def test_long_warm_up_is_a_no_op_when_compiling_is_off(tokenizer):
    """A report whose compiling is off (eager model) comes back unchanged, nothing run."""
    from skipdecode.compiled import CompileReport

    sk = SkipModel(make_model("llama", num_layers=2), tokenizer)
    report = CompileReport(enabled=False, error="no compiler here")
    assert warm_up_long_prompts(sk, report, CHUNK) is report and report.compile_seconds == 0.0



@pytest.mark.slow  # about 25 s of compiling on 2 cores: the contrast to the test below
def test_long_prompts_compile_new_graphs_without_the_long_warm_up(tokenizer):
    """Without the long warm-up the long traffic compiles new graphs (so that the check of
    ``test_long_prompts_compile_nothing_new_after_the_long_warm_up`` can fail)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    after_warm = counters["stats"]["unique_graphs"]
    _long_traffic(sk.adapter, VOCAB)
    assert counters["stats"]["unique_graphs"] > after_warm


def test_later_chunks_past_the_score_bound_compile_nothing_new(tokenizer):
    """Chunks of 80 tokens: the first two stay under MAX_SCORES (80 x 160 scores), the third takes
    SDPA after the prompt's own history (80 x 240), a variant of its own as a middle chunk and
    another as the last one (its keys filling the prompt's buffer): a user's check found 2 graphs,
    1.9 s, mid-serving, for prompts of 5 chunks of 64. After ``warm_up`` and the long warm-up for
    chunks of 80 (prompts of 3 x 80 + 5 and 3 x 80 tokens), prompts of 239 (a last chunk of 79 on
    SDPA), 247 (a middle one) and 241 tokens (then one token) compile nothing new and answer as
    eager does (1e-5). (The former warm-up, one prompt of 2C + 5 tokens, compiled on them.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    warm_up_long_prompts(sk, report, 80)
    waves = [[_ids(31, 239, VOCAB)], [_ids(32, 247, VOCAB)], [_ids(33, 241, VOCAB)]]
    _equal_to_eager_compiling_nothing((sk, report, lambda: counters["stats"]["unique_graphs"]), tokenizer,
                                      waves, max_batch_size=2, prefill_chunk_tokens=80)


@pytest.fixture(scope="module")
def warmed(tokenizer):
    """A 4-layer llama, compiled (aot_eager) after a dynamo reset and warmed up at batch 1 and 2
    as ``serve --compile`` does: ``(sk, report, graphs)``, ``graphs()`` the graphs compiled so far
    in this process."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sk = SkipModel(make_model("llama", num_layers=4), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    assert report.enabled, report.error
    return sk, report, lambda: counters["stats"]["unique_graphs"]


def _equal_to_eager_compiling_nothing(warmed, tokenizer, waves, cached=None, **engine_kw):
    """Run ``waves`` (lists of prompts, each wave to completion; :func:`run_waves`) on an eager
    4-layer llama and on the ``warmed`` compiled one: the compiled run compiles no new graph, its
    tokens equal eager's and its first logits to 1e-5, and (``cached``) its prefix cache reused
    that many prompt tokens."""
    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    want = run_waves(Engine(eager.adapter, keep_logits=True, **engine_kw), waves)
    sk, _, graphs = warmed
    after_warm = graphs()
    engine = Engine(sk.adapter, keep_logits=True, **engine_kw)
    got = run_waves(engine, waves)
    if cached is not None:
        assert engine.prefix_cache.stats()["cached_prompt_tokens"] == cached
    assert graphs() == after_warm
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks and (logits - want_logits).abs().max().item() <= 1e-5


def test_a_chunked_prompt_ending_in_a_one_token_chunk_compiles_nothing_new(warmed, tokenizer):
    """A prompt one token longer than a whole number of chunks (17 tokens in chunks of 8) is
    prefilled as 8 + 8 + 1. Its last chunk, one token on the prompt's own cache, once took a
    decode step's variant (key length equal to the cache's size) and compiled mid-serving; on a
    prefill cache (``SkipCache.prefill``) it runs as a one-token prefill, the variant of a stored
    prefix and one token more. After ``warm_up`` it compiles nothing, and its answer equals the
    whole prefill's (1e-5)."""
    from skipdecode.chunked_prefill import run_chunk, start_partial

    prompt = _ids(5, 17, 128)
    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    part = start_partial(eager.adapter, Request(prompt, max_new_tokens=2), 0, None, 0.0)
    sizes = []
    while part.remaining:
        before = part.done
        run_chunk(eager.adapter, part, 8, torch.device("cpu"))
        sizes.append(part.done - before)
    assert sizes == [8, 8, 1]
    _equal_to_eager_compiling_nothing(warmed, tokenizer, [[prompt]], max_batch_size=2, prefill_chunk_tokens=8)


def test_one_token_after_a_stored_prefix_compiles_nothing_new(warmed, tokenizer):
    """A prompt that is a stored prefix and one token more (the same prompt sent again, or a
    request's choices arriving apart) prefills one token on the stored keys: alone and two at once,
    nothing new after ``warm_up`` (it compiled mid-serving on a user's check), answers equal to
    the eager engine's (1e-5)."""
    shared = _ids(11, 16, 128)
    waves = [[shared + [3, 4, 5], shared + [6, 7]], [shared + [8]], [shared + [9], shared + [10]]]
    # the last three run one token each on the stored 16
    _equal_to_eager_compiling_nothing(warmed, tokenizer, waves, cached=3 * 16, max_batch_size=4)


def test_a_wave_sharing_a_prefix_compiles_nothing_new(warmed, tokenizer):
    """Four prompts that share 24 tokens join at once: their prefix is prefilled first (one row),
    then the four after it (the engine's in-batch prefix sharing); nothing new after ``warm_up``,
    answers equal to the eager engine's (1e-5)."""
    shared = _ids(21, 24, VOCAB)
    waves = [[shared + _ids(22 + k, 3 + k, VOCAB) for k in range(4)]]
    # the prefix ran once, first: each of the four reused its 24 tokens
    _equal_to_eager_compiling_nothing(warmed, tokenizer, waves, cached=4 * 24, max_batch_size=4)


def test_health_reports_graphs_compiled_after_the_server_started(warmed, tokenizer):
    """``/health``'s ``compile``: None for an eager model; for a compiled one its warm-up seconds
    and ``graphs_after_start``, 0 while requests stay within what the warm-ups ran, and counting
    the graphs a request compiled mid-serving (a long prompt before the long-prompt warm-up: so
    this test runs before the one that runs it)."""
    from fastapi.testclient import TestClient

    from skipdecode.server import create_app

    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    with TestClient(create_app(eager, "tiny")) as client:
        assert client.get("/health").json()["compile"] is None
    sk, report, _ = warmed
    sk.compile_report = report
    with TestClient(create_app(sk, "tiny", prefill_chunk_tokens=CHUNK)) as client:
        short = client.post("/v1/completions", json={"prompt": "The Eagle", "max_tokens": 4})
        state = client.get("/health").json()["compile"]
        assert short.status_code == 200
        assert state["enabled"] and state["warm_up_seconds"] > 0 and state["graphs_after_start"] == 0
        long_ = client.post("/v1/completions", json={"prompt": [_ids(3, 200, VOCAB)], "max_tokens": 2})
        assert long_.status_code == 200
        assert client.get("/health").json()["compile"]["graphs_after_start"] > 0


def test_long_prompts_compile_nothing_new_after_the_long_warm_up(warmed, tokenizer):
    """After ``warm_up`` and ``warm_up_long_prompts`` (what ``skipdecode serve --compile``
    runs), long-prompt traffic compiles no new graph and breaks none, and every row's tokens and
    first logits equal the eager engine's (1e-5, float32). (The slow test above shows the same
    traffic compiling without the long warm-up.)"""
    from torch._dynamo.utils import counters

    eager = SkipModel(make_model("llama", num_layers=4), tokenizer)
    want = _long_traffic(eager.adapter, VOCAB)
    sk, report, graphs = warmed
    before = report.compile_seconds
    assert warm_up_long_prompts(sk, report, CHUNK) is report and report.compile_seconds > before
    after_warm = graphs()
    got = _long_traffic(sk.adapter, VOCAB)
    assert graphs() == after_warm
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert report.enabled and report.prefill, report.prefill_error
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-5
