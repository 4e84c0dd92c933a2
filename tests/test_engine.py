"""The engine (forward.py, cache.py, generate.py) on tiny random models of every family.

Contracts checked here (docs/method.md; docs/correctness.md, the pitfalls):
- full depth reproduces Hugging Face greedy generation token for token (docs/correctness.md pitfalls 2, 7);
- under skipping, cached step-by-step logits equal a no-cache recomputation of the whole sequence
  with the same per-position layer sets (docs/method.md "Why the KV cache is always complete");
- per-layer cache lengths equal the tokens that actually ran each layer (docs/correctness.md pitfall 1);
- batched == one prompt at a time (docs/correctness.md pitfalls 4, 11); no NaN from padding (docs/correctness.md pitfall 5);
- forward hooks see exactly the planned layers; cache rollback (docs/correctness.md pitfall 8); clean errors.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB, left_pad, make_config, make_model
from skipdecode import (
    FullPolicy,
    LinearDecayPolicy,
    SkipModel,
    UnsupportedArchitectureError,
    generate_step,
    get_adapter,
    supported_model_types,
)
from skipdecode.cache import SkipCache
from skipdecode.forward import build_attention_mask, positions_from_mask, skip_forward

# the package re-exports the function `generate`, which shadows the submodule attribute
gen_mod = importlib.import_module("skipdecode.generate")

NUM_LAYERS = 6
SKIP = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
SKIP_W0 = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=1, warmup_layers=0, horizon=3)
SKIP_W2 = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=3, warmup_layers=2, horizon=4)
N_NEW = 8
PROMPT_LENS = [7, 3, 5, 1]



@lru_cache(maxsize=None)
def model_and_adapter(family: str):
    model = make_model(family, NUM_LAYERS)
    return model, get_adapter(model)


def pad_id(model) -> int:
    return model.config.pad_token_id


def prompts(lengths=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # ids >= 5 avoid every special id (pad/bos/eos of all families)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(adapter, ids, mask, policy=None, n=N_NEW, pad=0):
    """All StepOutputs of generate_step with no EOS (every row runs ``n`` steps)."""
    return list(generate_step(adapter, ids, mask, policy=policy, max_new_tokens=n, eos_token_ids=(), pad_token_id=pad))


def tokens_of(steps) -> torch.Tensor:
    return torch.stack([s.tokens for s in steps], dim=1)  # (B, n)


def logits_of(steps) -> torch.Tensor:
    return torch.stack([s.logits for s in steps], dim=1)  # (B, n, V)


# --------------------------------------------------------------------------------------------
# full depth == Hugging Face
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", ["single", "padded4"])
def test_full_depth_matches_hf_generate(family, batch):
    model, adapter = model_and_adapter(family)
    seqs = prompts([6]) if batch == "single" else prompts()
    ids, mask = left_pad(seqs, pad_id(model))
    steps = run(adapter, ids, mask, None, N_NEW, pad_id(model))
    with torch.no_grad():
        ref = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id(model),
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_tokens = ref.sequences[:, ids.shape[1] :]
    assert hf_tokens.shape == (len(seqs), N_NEW)
    assert torch.equal(tokens_of(steps), hf_tokens)
    hf_logits = torch.stack(ref.logits, dim=1)
    torch.testing.assert_close(logits_of(steps), hf_logits, rtol=0, atol=1e-5)
    # full depth reports every layer at every step
    assert all(s.active_layers == tuple(range(NUM_LAYERS)) for s in steps)


def test_sliding_window_matches_hf():
    """Mistral with a sliding window shorter than the sequence: our mask == HF's window."""
    cfg = make_config("mistral", NUM_LAYERS)
    cfg.sliding_window = 4
    from conftest import model_from_config

    model = model_from_config(cfg, seed=3)
    adapter = get_adapter(model)
    assert adapter.layer_windows == (4,) * NUM_LAYERS
    ids, mask = left_pad(prompts([9, 5]), 0)
    steps = run(adapter, ids, mask, None, 6, 0)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(tokens_of(steps), ref.sequences[:, ids.shape[1] :])
    torch.testing.assert_close(logits_of(steps), torch.stack(ref.logits, 1), rtol=0, atol=1e-5)


def test_skip_forward_no_plan_equals_hf_forward(family):
    """The one layer loop at full depth, no cache, over a padded batch == the stock HF forward."""
    model, adapter = model_and_adapter(family)
    ids, mask = left_pad(prompts(), pad_id(model))
    with torch.no_grad():
        ours = skip_forward(adapter, ids, mask)
        # HF generate's convention for left padding: positions count real tokens only
        hf_positions = (mask.cumsum(-1) - 1).clamp_min(0)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=hf_positions).logits
        all_true = torch.ones(ids.shape + (NUM_LAYERS,), dtype=torch.bool)
        masked = skip_forward(adapter, ids, mask, layer_mask=all_true)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=0, atol=1e-5)
    assert torch.equal(masked, ours)


# --------------------------------------------------------------------------------------------
# skipping: cached decode == no-cache recomputation with per-position plans
# --------------------------------------------------------------------------------------------


def recompute_with_layer_mask(adapter, ids, mask, generated, policy):
    """No-cache teacher-forced logits over prompt + generated[:, :-1]; prompt positions run every
    layer and the position holding generated token i runs policy.active_layers(i + 1)."""
    B, P = ids.shape
    n = generated.shape[1]
    full_ids = torch.cat([ids, generated[:, :-1]], dim=1)
    full_mask = torch.cat([mask, torch.ones((B, n - 1), dtype=mask.dtype)], dim=1)
    layer_mask = torch.ones((B, P + n - 1, adapter.num_layers), dtype=torch.bool)
    for i in range(n - 1):
        plan = torch.zeros(adapter.num_layers, dtype=torch.bool)
        plan[list(policy.active_layers(i + 1))] = True
        layer_mask[:, P + i] = plan
    with torch.no_grad():
        logits = skip_forward(adapter, full_ids, full_mask, layer_mask=layer_mask)
    return logits[:, P - 1 :]  # (B, n, V): position P-1+i gives generated token i


@pytest.mark.parametrize("policy", [SKIP, SKIP_W0, SKIP_W2], ids=["warmup1", "warmup0", "warmup2"])
def test_cached_skip_decode_equals_recomputation(family, policy):
    model, adapter = model_and_adapter(family)
    ids, mask = left_pad(prompts(), pad_id(model))
    steps = run(adapter, ids, mask, policy, N_NEW, pad_id(model))
    generated = tokens_of(steps)
    ref = recompute_with_layer_mask(adapter, ids, mask, generated, policy)
    torch.testing.assert_close(logits_of(steps), ref, rtol=0, atol=1e-4)
    # the reference really differs from full depth: skipping is not a no-op here
    full_ref = recompute_with_layer_mask(adapter, ids, mask, generated, FullPolicy(NUM_LAYERS))
    assert (full_ref[:, 1:] - ref[:, 1:]).abs().max() > 1e-2
    # and the step-0 logits (full-depth prefill) agree with the full-depth reference
    torch.testing.assert_close(logits_of(steps)[:, 0], full_ref[:, 0], rtol=0, atol=1e-4)


def test_recomputation_reference_matches_hand_rolled_loop():
    """Independent check of the layer_mask reference: run the stock layers position by position
    ourselves (no cache, explicit keep/skip per position) through the adapter hooks."""
    model, adapter = model_and_adapter("llama")
    ids, mask = left_pad(prompts([5, 2]), 0)
    steps = run(adapter, ids, mask, SKIP, 6, 0)
    generated = tokens_of(steps)
    B, P = ids.shape
    full_ids = torch.cat([ids, generated[:, :-1]], dim=1)
    full_mask = torch.cat([mask, torch.ones((B, 5), dtype=mask.dtype)], dim=1)
    K = full_ids.shape[1]
    plans = [set(range(NUM_LAYERS))] * P + [set(SKIP.active_layers(i + 1)) for i in range(5)]
    with torch.no_grad():
        pos = positions_from_mask(full_mask)
        hidden = adapter.embed(full_ids, pos)
        extra = adapter.layer_inputs(hidden, pos)
        m4 = build_attention_mask(full_mask, K, hidden.dtype)
        for layer in range(NUM_LAYERS):
            out = adapter.run_layer(layer, hidden, m4, None, extra)
            keep = torch.tensor([layer in plans[p] for p in range(K)])
            hidden = torch.where(keep[None, :, None], out, hidden)
        logits = adapter.head(hidden)[:, P - 1 :]
    torch.testing.assert_close(logits_of(steps), logits, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------
# per-layer cache lengths
# --------------------------------------------------------------------------------------------


@pytest.fixture
def recorded_caches(monkeypatch):
    caches: list[SkipCache] = []

    class RecordingCache(SkipCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(gen_mod, "SkipCache", RecordingCache)
    return caches


@pytest.mark.parametrize("policy", [SKIP, SKIP_W0, SKIP_W2], ids=["warmup1", "warmup0", "warmup2"])
def test_cache_length_per_layer_counts_tokens_that_ran_it(family, policy, recorded_caches):
    model, adapter = model_and_adapter(family)
    ids, mask = left_pad(prompts(), pad_id(model))
    P = ids.shape[1]
    gen = generate_step(adapter, ids, mask, policy=policy, max_new_tokens=N_NEW, eos_token_ids=(), pad_token_id=pad_id(model))
    for step_out in gen:
        (cache,) = recorded_caches
        t = step_out.step
        # tokens fed so far: the prompt (all layers) and generated tokens 0..t-1 at steps 1..t
        expected = [P + sum(layer in policy.active_layers(s) for s in range(1, t + 1)) for layer in range(NUM_LAYERS)]
        assert cache.lengths == expected, (t, cache.lengths, expected)
        for layer in range(NUM_LAYERS):
            assert cache.get_seq_length(layer) == expected[layer]
            assert cache.keys[layer].shape[0] == ids.shape[0]
    # the schedule really made the layers differ
    assert len(set(cache.lengths)) > 1
    assert cache.lengths[NUM_LAYERS - 1] == P + N_NEW - 1


def test_step_zero_layer_zero_skipped_positions_come_from_mask(recorded_caches):
    """warmup 0: layer 0 stops growing at step 1; later positions must not come from its length."""
    model, adapter = model_and_adapter("gpt2")  # learned absolute positions: a wrong one shows at once
    ids, mask = left_pad(prompts([4]), 0)
    steps = run(adapter, ids, mask, SKIP_W0, N_NEW, 0)
    (cache,) = recorded_caches
    assert cache.lengths[0] == ids.shape[1]  # layer 0 only saw the prompt
    ref = recompute_with_layer_mask(adapter, ids, mask, tokens_of(steps), SKIP_W0)
    torch.testing.assert_close(logits_of(steps), ref, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------
# batch == one at a time
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, SKIP], ids=["full", "skip"])
def test_batched_equals_each_prompt_alone(family, policy):
    model, adapter = model_and_adapter(family)
    seqs = prompts()
    ids, mask = left_pad(seqs, pad_id(model))
    batched = run(adapter, ids, mask, policy, N_NEW, pad_id(model))
    for row, seq in enumerate(seqs):
        one_ids, one_mask = left_pad([seq], pad_id(model))
        alone = run(adapter, one_ids, one_mask, policy, N_NEW, pad_id(model))
        assert torch.equal(tokens_of(batched)[row], tokens_of(alone)[0]), row
        torch.testing.assert_close(logits_of(batched)[row], logits_of(alone)[0], rtol=0, atol=1e-4)


# --------------------------------------------------------------------------------------------
# hooks: exactly the planned layers run
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [SKIP, SKIP_W0, SKIP_W2], ids=["warmup1", "warmup0", "warmup2"])
def test_forward_hooks_see_exactly_the_plan(family, policy):
    model, adapter = model_and_adapter(family)
    ran: list[int] = []
    handles = [
        layer.register_forward_hook(lambda mod, args, out, idx=idx: ran.append(idx))
        for idx, layer in enumerate(adapter.layers)
    ]
    try:
        ids, mask = left_pad(prompts(), pad_id(model))
        for out in generate_step(adapter, ids, mask, policy=policy, max_new_tokens=N_NEW, eos_token_ids=(), pad_token_id=pad_id(model)):
            expected = list(range(NUM_LAYERS)) if out.step == 0 else list(policy.active_layers(out.step))
            assert ran == expected, (out.step, ran, expected)
            assert list(out.active_layers) == expected
            ran.clear()
    finally:
        for h in handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# NaN safety and the attention mask
# --------------------------------------------------------------------------------------------


def nan_on_empty_rows_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An attention kernel that returns NaN for a query row with no allowed key, as SDPA or
    flash kernels with -inf or boolean masks do on some versions and devices (docs/correctness.md pitfall 5):
    entries of the additive mask below 0 become -inf before the softmax. (This torch's SDPA and
    HF's eager attention turn a fully masked finfo.min row into a uniform softmax instead, so a
    NaN guard cannot be tested through them.) Shapes: query (B, H, T, D), key/value
    (B, H_kv, K, D), mask (B, 1, T, K); returns (B, T, H, D) and the weights."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)) * scale
    if attention_mask is not None:
        scores = scores.masked_fill(attention_mask[..., : key.shape[-2]] < 0, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def mask_without_self_attention(attention_mask, num_queries, dtype, sliding_window=None):
    """build_attention_mask minus its guard (each query may attend to itself): a left-padding
    query then has no allowed key at all."""
    allowed = (build_attention_mask(attention_mask, num_queries, dtype, sliding_window)[:, 0] == 0)
    B, K = attention_mask.shape
    q_idx = torch.arange(K - num_queries, K)[:, None]
    k_idx = torch.arange(K)[None, :]
    allowed = allowed & ((k_idx <= q_idx) & attention_mask.bool()[:, None, :])
    return torch.zeros((B, 1, num_queries, K), dtype=dtype).masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def strict_model(family: str):
    from transformers import AttentionInterface

    AttentionInterface.register("nan_on_empty_rows", nan_on_empty_rows_attention)
    model = make_model(family, NUM_LAYERS)
    model.set_attn_implementation("nan_on_empty_rows")
    return model, get_adapter(model)


def test_padded_batch_logits_finite_everywhere(family, monkeypatch):
    """docs/correctness.md pitfall 5 with an attention kernel that really turns a fully masked row into NaN: a
    left-padded batch (padding positions included, the prefill, skipped decode steps and
    teacher forcing) stays finite everywhere, because no query row is fully masked. Without the
    guard the same run does give NaN (checked below), so this test fails if the guard goes."""
    model, adapter = strict_model(family)
    ids, mask = left_pad(prompts([9, 1, 4]), pad_id(model))
    with torch.no_grad():
        every_position = skip_forward(adapter, ids, mask)  # pad positions included
        all_layers = torch.ones(ids.shape + (NUM_LAYERS,), dtype=torch.bool)
        teacher_forced = skip_forward(adapter, ids, mask, layer_mask=all_layers)
    assert torch.isfinite(every_position).all() and torch.isfinite(teacher_forced).all()
    for policy in (None, SKIP):
        steps = run(adapter, ids, mask, policy, N_NEW, pad_id(model))
        assert torch.isfinite(logits_of(steps)).all()
    # the check is sensitive: without the guard, this kernel gives NaN on the padding rows
    monkeypatch.setattr(importlib.import_module("skipdecode.forward"), "build_attention_mask", mask_without_self_attention)
    with torch.no_grad():
        unguarded = skip_forward(adapter, ids, mask)
    assert torch.isnan(unguarded[~mask.bool()]).any()


def test_no_layer_receives_a_fully_masked_row(family):
    """The guard itself, at the point of use: every mask any decoder layer receives (prefill,
    skipped decode steps) has at least one allowed key per query row, for a batch whose padding
    rows have no real key at all."""
    model, adapter = model_and_adapter(family)
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        seen.append(kwargs["attention_mask"])

    handles = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in adapter.layers]
    try:
        ids, mask = left_pad(prompts([9, 1, 4]), pad_id(model))
        run(adapter, ids, mask, SKIP, N_NEW, pad_id(model))
    finally:
        for h in handles:
            h.remove()
    assert len(seen) >= NUM_LAYERS * 2
    for m in seen:
        assert (m == 0).any(-1).all()


def brute_force_mask(attention_mask, num_queries, window=None):
    """A window counts the row's own tokens: query and key *positions* (the real tokens before
    them), not columns; with left padding only the two agree, with padding inside a row (between
    a cached prompt prefix and the rest) only positions are right."""
    B, K = attention_mask.shape
    allowed = torch.zeros((B, num_queries, K), dtype=torch.bool)
    for b in range(B):
        pos = [max(int(attention_mask[b, : j + 1].sum()) - 1, 0) for j in range(K)]
        for i in range(num_queries):
            q = K - num_queries + i
            for k in range(K):
                ok = k <= q and bool(attention_mask[b, k]) and (window is None or pos[q] - pos[k] < window)
                allowed[b, i, k] = ok or k == q
    return allowed


@pytest.mark.parametrize("window", [None, 3])
def test_build_attention_mask_exact_and_never_fully_masked(window):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, K = 4, int(torch.randint(1, 10, (1,), generator=g))
        am = (torch.rand((B, K), generator=g) > 0.5).long()
        am[0] = 0  # a row with no real token at all
        for T in {1, K, max(1, K // 2)}:
            m = build_attention_mask(am, T, torch.float32, window)
            assert m.shape == (B, 1, T, K)
            allowed = m[:, 0] == 0
            assert torch.equal(allowed, brute_force_mask(am, T, window))
            assert set(m.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}
            assert allowed.any(-1).all()  # no query row fully masked


def test_positions_from_left_padded_mask():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert positions_from_mask(am).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]


# --------------------------------------------------------------------------------------------
# cache rollback
# --------------------------------------------------------------------------------------------


def decode_manually(adapter, ids, mask, tokens, policy, cache, first_step=1):
    """Feed tokens[:, j] at decode step first_step + j; return logits (B, n, V)."""
    out = []
    for j in range(tokens.shape[1]):
        step = first_step + j
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)
        out.append(skip_forward(adapter, tokens[:, j : j + 1], mask, active_layers=policy.active_layers(step), cache=cache)[:, -1])
    return torch.stack(out, 1), mask


@pytest.mark.parametrize("family_name", ["llama", "opt"])
def test_crop_rolls_back_and_continues_like_a_fresh_run(family_name):
    model, adapter = model_and_adapter(family_name)
    ids, mask = left_pad(prompts([6, 3]), pad_id(model))
    B, P = ids.shape
    steps = run(adapter, ids, mask, SKIP, N_NEW, pad_id(model))
    generated = tokens_of(steps)
    fresh = logits_of(steps)
    with torch.no_grad():
        cache = SkipCache(NUM_LAYERS, capacity=4)  # small capacity: exercises growth too
        skip_forward(adapter, ids, mask, cache=cache)
        _, _ = decode_manually(adapter, ids, mask, generated[:, : N_NEW - 1], SKIP, cache)
        before = list(cache.lengths)
        keep = 2  # keep decode steps 1..2
        cache.crop(P + keep)
        assert cache.lengths == [min(n, P + keep) for n in before]
        assert cache.lengths != before
        mask_kept = torch.cat([mask, torch.ones((B, keep), dtype=mask.dtype)], dim=1)
        again, _ = decode_manually(adapter, ids, mask_kept, generated[:, keep : N_NEW - 1], SKIP, cache, first_step=keep + 1)
    torch.testing.assert_close(again, fresh[:, keep + 1 :], rtol=0, atol=1e-5)
    # crop beyond every length changes nothing; a negative crop is refused
    lengths = list(cache.lengths)
    cache.crop(10_000)
    assert cache.lengths == lengths
    with pytest.raises(ValueError, match="num_positions"):
        cache.crop(-1)


def test_crop_to_zero_then_prefill_again():
    model, adapter = model_and_adapter("qwen2")
    ids, mask = left_pad(prompts([5]), 0)
    with torch.no_grad():
        cache = SkipCache(NUM_LAYERS)
        first = skip_forward(adapter, ids, mask, cache=cache)
        cache.crop(0)
        assert cache.lengths == [0] * NUM_LAYERS
        second = skip_forward(adapter, ids, mask, cache=cache)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_unknown_architecture_fake_config():
    fake = SimpleNamespace(config=SimpleNamespace(model_type="mamba"))
    with pytest.raises(UnsupportedArchitectureError) as info:
        get_adapter(fake)
    message = str(info.value)
    assert "mamba" in message
    for model_type in ("llama", "mistral", "qwen2", "opt", "gpt2"):
        assert model_type in message
    assert set(supported_model_types()) >= {"llama", "mistral", "qwen2", "opt", "gpt2"}
    assert isinstance(info.value, ValueError)


def test_unknown_architecture_tiny_bert(tokenizer):
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, is_decoder=True)
    bert = BertLMHeadModel(cfg).eval()
    with pytest.raises(UnsupportedArchitectureError, match="llama"):
        get_adapter(bert)
    with pytest.raises(UnsupportedArchitectureError, match="bert"):
        SkipModel(bert, tokenizer)


@pytest.mark.parametrize("prompt_len", [256, 250])
def test_context_boundary_equals_hf(family, prompt_len):
    """P + N - 1 positions are needed (the last new token is never fed back, issue 13 item 6):
    a prompt filling all 256 positions gets 1 token and 250 + 7 fits, exactly as HF generate
    returns them; one token more is refused with an error naming max_new_tokens."""
    model, adapter = model_and_adapter(family)
    limit = 256  # conftest: max_position_embeddings / n_positions
    fits = limit - prompt_len + 1
    ids = torch.tensor(prompts([prompt_len], seed=4))
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match=f"max_new_tokens <= {fits} fits"):
        next(generate_step(adapter, ids, mask, max_new_tokens=fits + 1))
    steps = run(adapter, ids, mask, None, fits, pad_id(model))
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=fits, do_sample=False, eos_token_id=None,
                             pad_token_id=pad_id(model), output_logits=True, return_dict_in_generate=True)
    assert torch.equal(tokens_of(steps), ref.sequences[:, prompt_len:])
    torch.testing.assert_close(logits_of(steps), torch.stack(ref.logits, 1), rtol=0, atol=1e-4)


def test_context_check_is_shared_by_the_calm_baseline():
    """The CALM baseline uses the same rule (one check, Adapter.check_context)."""
    from skipdecode.calm import CalmConfig, calm_generate_ids

    _, adapter = model_and_adapter("llama")
    ids = torch.tensor(prompts([256], seed=4))
    out = calm_generate_ids(adapter, ids, torch.ones_like(ids), CalmConfig(threshold=1.0), max_new_tokens=1)
    assert len(out["token_ids"]) == 1
    with pytest.raises(ValueError, match="max_new_tokens <= 1 fits"):
        calm_generate_ids(adapter, ids, torch.ones_like(ids), CalmConfig(threshold=1.0), max_new_tokens=2)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_max_new_tokens_raises(bad):
    _, adapter = model_and_adapter("llama")
    ids, mask = left_pad(prompts([3]), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        next(generate_step(adapter, ids, mask, max_new_tokens=bad))


def test_policy_with_wrong_num_layers_raises(tokenizer):
    model, adapter = model_and_adapter("llama")
    ids, mask = left_pad(prompts([3]), 0)
    wrong = LinearDecayPolicy(num_layers=8, max_layers=5, min_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        next(generate_step(adapter, ids, mask, policy=wrong))
    with pytest.raises(ValueError, match="num_layers"):
        SkipModel(model, tokenizer, policy=FullPolicy(NUM_LAYERS + 1))
    sk = SkipModel(model, tokenizer)
    with pytest.raises(ValueError, match="num_layers"):
        sk.generate("The Eagle", policy=wrong, max_new_tokens=2)


@pytest.mark.parametrize("bad", ["fast", 2.0, {"type": "full", "num_layers": NUM_LAYERS}])
def test_policy_that_is_not_a_policy_object_raises_naming_it(tokenizer, bad):
    """A name, a number or a dict is refused with one ValueError naming ``policy`` and what it may
    be, on every path that takes a policy (was: AttributeError 'str' object has no attribute 'num_layers')."""
    from skipdecode.engine import Engine, Request

    model, adapter = model_and_adapter("llama")
    ids, mask = left_pad(prompts([3]), 0)
    match = r"policy must be None or a policy object \(FullPolicy, LinearDecayPolicy"
    with pytest.raises(ValueError, match=match):
        next(generate_step(adapter, ids, mask, policy=bad))
    with pytest.raises(ValueError, match=match):
        SkipModel(model, tokenizer, policy=bad)
    sk = SkipModel(model, tokenizer)
    for inflight in ({}, {"max_batch_size": 2}):
        with pytest.raises(ValueError, match=match):
            sk.generate(["hi"], policy=bad, max_new_tokens=2, **inflight)
    with pytest.raises(ValueError, match=match):
        sk.stream_generate("hi", policy=bad)
    with pytest.raises(ValueError, match=match):
        Engine(adapter, max_batch_size=2).submit(Request([5, 6], 2, bad))


def test_load_refuses_a_policy_that_is_not_a_policy_object(tmp_path, tokenizer):
    from skipdecode import load
    from skipdecode.loading import LoadError

    model, _ = model_and_adapter("llama")
    SkipModel(model, tokenizer).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(LoadError, match="policy must be None or a policy object.*got str 'fast'"):
        load(tmp_path / "ckpt", policy="fast")


def test_bad_shapes_raise():
    _, adapter = model_and_adapter("llama")
    ids, mask = left_pad(prompts([3, 2]), 0)
    with pytest.raises(ValueError, match="attention_mask"):
        next(generate_step(adapter, ids, mask[:, 1:]))
    with pytest.raises(ValueError, match="attention_mask"):
        skip_forward(adapter, ids, mask[:1])
    with pytest.raises(ValueError, match="layer_mask"):
        skip_forward(adapter, ids, mask, layer_mask=torch.ones((2, 3, NUM_LAYERS), dtype=torch.bool), cache=SkipCache(NUM_LAYERS))
    with pytest.raises(ValueError, match="layer_mask"):
        skip_forward(adapter, ids, mask, layer_mask=torch.ones((2, 3, NUM_LAYERS + 1), dtype=torch.bool))


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_non_monotone_plan_raises(family_name):
    _, adapter = model_and_adapter(family_name)
    ids, mask = left_pad(prompts([4]), 0)
    one = torch.ones((1, 1), dtype=torch.long)
    tok = torch.tensor([[9]])
    with torch.no_grad():
        cache = SkipCache(NUM_LAYERS)
        skip_forward(adapter, ids, mask, cache=cache)
        mask = torch.cat([mask, one], 1)
        skip_forward(adapter, tok, mask, active_layers=(4, 5), cache=cache)  # skips layers 0..3
        mask = torch.cat([mask, one], 1)
        with pytest.raises(RuntimeError, match="layer 0"):
            skip_forward(adapter, tok, mask, active_layers=(0, 5), cache=cache)
        # a plan that only drops layers is fine
        skip_forward(adapter, tok, mask, active_layers=(5,), cache=cache)
    assert cache.lengths == [4, 4, 4, 4, 5, 6]
