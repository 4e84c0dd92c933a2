"""Text-level generation through ``SkipModel`` on a tiny llama and the conftest tokenizer: EOS,
stop strings, finish reasons, BOS == EOS prompts, sampling, chat template, prompt validation,
statistics and streaming (docs/correctness.md pitfalls 10, 11, 13)."""

from __future__ import annotations

import importlib
import json
import re
from types import SimpleNamespace

import pytest
import torch

from conftest import make_chain_model, make_model
from skipdecode import FullPolicy, LinearDecayPolicy, SkipModel, generate_step, get_adapter
from skipdecode.generate import encode_prompts, generate
from skipdecode.sampling import SamplingParams

gen_mod = importlib.import_module("skipdecode.generate")  # the package re-exports `generate`

NUM_LAYERS = 6
SKIP = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
PROMPTS = ["The Eagle is a coffee shop", "Describe the restaurant in one sentence.", "name[The Eagle]"]
EOS = 2  # conftest tokenizer: </s>
TARGET = "The Eagle is a coffee shop"
CHAIN_PROMPT = "Describe the restaurant:"



@pytest.fixture(scope="module")
def sk(tokenizer):
    """Random tiny llama (6 layers)."""
    return SkipModel(make_model("llama", NUM_LAYERS), tokenizer)


@pytest.fixture(scope="module")
def chain_sk(tokenizer):
    """A tiny llama programmed (conftest.make_chain_model) to write TARGET then EOS after
    CHAIN_PROMPT, under any layer plan; EOS (a prompt's BOS) is followed by TARGET too."""
    return SkipModel(make_chain_model(tokenizer, CHAIN_PROMPT, TARGET, NUM_LAYERS), tokenizer)


def no_eos_generate(sk, prompts, **kwargs):
    return generate(sk.adapter, sk.tokenizer, prompts, eos_token_ids=[], **kwargs)


# --------------------------------------------------------------------------------------------
# EOS, stop strings, finish reasons
# --------------------------------------------------------------------------------------------


def test_eos_ends_row_and_is_not_in_text(chain_sk, tokenizer):
    for policy in (None, SKIP):
        res = chain_sk.generate(CHAIN_PROMPT, max_new_tokens=30, policy=policy)
        target_ids = tokenizer(TARGET)["input_ids"]
        assert res.token_ids == [target_ids + [EOS]]
        assert res.texts == [TARGET]
        assert res.finish_reasons == ["eos"]
        assert res.new_tokens == [len(target_ids) + 1]
        # the batch stopped with its last row: token 0 from the prefill, then one step per token
        assert res.decode_steps == len(target_ids)


def test_eos_freezes_row_in_batch(sk, tokenizer):
    """Row 0 ends at step k on an EOS chosen from its own greedy output; afterwards it is fed and
    reports the pad id, emits nothing, and row 1 is untouched (tokens and logits)."""
    input_ids, mask = encode_prompts(tokenizer, PROMPTS[:2])
    n = 12
    free = list(generate_step(sk.adapter, input_ids, mask, policy=SKIP, max_new_tokens=n, eos_token_ids=()))
    row0 = [int(s.tokens[0]) for s in free]
    row1 = [int(s.tokens[1]) for s in free]
    candidates = [k for k in range(1, n - 2) if row0[k] not in row0[:k] and row0[k] not in row1]
    assert candidates, (row0, row1)
    k = candidates[0]
    eos = row0[k]
    pad = tokenizer.pad_token_id
    steps = list(generate_step(sk.adapter, input_ids, mask, policy=SKIP, max_new_tokens=n, eos_token_ids=[eos], pad_token_id=pad))
    assert len(steps) == n
    for t, s in enumerate(steps):
        assert bool(s.emitted[0]) == (t <= k)
        assert bool(s.finished[0]) == (t >= k)
        assert int(s.tokens[0]) == (row0[t] if t <= k else pad)
        assert bool(s.emitted[1]) and not bool(s.finished[1])
        assert int(s.tokens[1]) == row1[t]
        torch.testing.assert_close(s.logits[1], free[t].logits[1], rtol=0, atol=1e-5)
    # text level: the same EOS override through generate()
    res = generate(sk.adapter, tokenizer, PROMPTS[:2], policy=SKIP, max_new_tokens=n, eos_token_ids=[eos])
    assert res.token_ids[0] == row0[: k + 1]
    assert res.token_ids[1] == row1
    assert res.finish_reasons == ["eos", "length"]
    assert res.new_tokens == [k + 1, n]
    assert res.texts[0] == tokenizer.decode(row0[:k], skip_special_tokens=True)


def test_eos_from_generation_config(tokenizer):
    """The model's generation_config EOS ids are used together with the tokenizer's."""
    model = make_model("llama", NUM_LAYERS)
    sk = SkipModel(model, tokenizer)
    free = no_eos_generate(sk, PROMPTS[:1], max_new_tokens=10).token_ids[0]
    k = next(k for k in range(1, 10) if free[k] not in free[:k])
    model.generation_config.eos_token_id = [free[k]]
    res = sk.generate(PROMPTS[0], max_new_tokens=10)
    assert res.token_ids == [free[: k + 1]] and res.finish_reasons == ["eos"]


def test_stop_string_cuts_text(chain_sk, tokenizer):
    target_ids = tokenizer(TARGET)["input_ids"]
    for stop, expected in [("coffee", "The Eagle is a "), ("Eagle is", "The "), ("shop", "The Eagle is a coffee ")]:
        res = chain_sk.generate(CHAIN_PROMPT, max_new_tokens=30, stop=[stop], policy=SKIP)
        assert res.texts == [expected]
        assert res.finish_reasons == ["stop"]
        # the row stopped on the first token whose text completes the stop string
        k = next(k for k in range(1, len(target_ids) + 1) if stop in tokenizer.decode(target_ids[:k]))
        assert res.token_ids == [target_ids[:k]]


def test_stop_string_spanning_tokens_is_never_streamed(chain_sk):
    """Text that may begin a stop string is held back; deltas join to exactly the final text."""
    for stop in ["Eagle is", "is a cof", "coffee", "shop", "no such text", "The"]:
        chunks = list(chain_sk.stream_generate(CHAIN_PROMPT, max_new_tokens=30, stop=[stop]))
        res = chain_sk.generate(CHAIN_PROMPT, max_new_tokens=30, stop=[stop])
        streamed = "".join(c.deltas[0] for c in chunks)
        assert streamed == res.texts[0], (stop, streamed, res.texts[0])
        assert stop not in streamed
    assert res.texts == [""] and res.finish_reasons == ["stop"]  # "The" stops on the first token


def test_max_new_tokens_gives_length(sk):
    res = no_eos_generate(sk, PROMPTS, max_new_tokens=5)
    assert res.finish_reasons == ["length"] * 3
    assert res.new_tokens == [5, 5, 5]
    assert all(len(ids) == 5 for ids in res.token_ids)


def test_length_when_budget_ends_before_eos(chain_sk, tokenizer):
    res = chain_sk.generate(CHAIN_PROMPT, max_new_tokens=3)
    assert res.finish_reasons == ["length"]
    assert res.token_ids == [tokenizer(TARGET)["input_ids"][:3]]


def test_bos_equal_to_eos_in_prompt_does_not_end_generation(chain_sk, tokenizer):
    """OPT starts every prompt with id 2, which is also EOS: only generated tokens may end a row."""
    target_ids = tokenizer(TARGET)["input_ids"]
    ids_start = tokenizer("</s>" + CHAIN_PROMPT)["input_ids"]
    assert ids_start[0] == EOS == tokenizer.eos_token_id
    # a prompt that starts with EOS, and one that ends with it (its last fed token is EOS)
    res = chain_sk.generate(["</s>" + CHAIN_PROMPT, "</s>"], max_new_tokens=30)
    assert res.token_ids == [target_ids + [EOS], target_ids + [EOS]]
    assert res.finish_reasons == ["eos", "eos"]
    assert res.texts == [TARGET, TARGET]


def test_bos_equal_to_eos_with_tiny_opt():
    model = make_model("opt", NUM_LAYERS)
    adapter = get_adapter(model)
    ids = torch.tensor([[2, 50, 60, 70], [1, 1, 2, 80]])  # OPT: BOS == EOS == 2, pad == 1
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    steps = list(generate_step(adapter, ids, mask, max_new_tokens=6, eos_token_ids=[2], pad_token_id=1))
    first = steps[0]
    assert first.emitted.all()
    assert torch.equal(first.finished, first.tokens == 2)
    assert len(steps) >= 2  # the random model does not emit EOS at step 0 for both rows
    for row in range(2):
        if int(first.tokens[row]) != 2:
            assert bool(steps[1].emitted[row])


# --------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------


def test_sampling_same_seed_reproducible_and_seeds_differ(sk):
    kw = dict(max_new_tokens=16, temperature=1.0, policy=SKIP)
    a = sk.generate(PROMPTS, seed=7, **kw)
    b = sk.generate(PROMPTS, seed=7, **kw)
    c = sk.generate(PROMPTS, seed=8, **kw)
    greedy = sk.generate(PROMPTS, max_new_tokens=16, policy=SKIP)
    assert a.token_ids == b.token_ids and a.texts == b.texts
    assert a.token_ids != c.token_ids
    assert a.token_ids != greedy.token_ids  # temperature 1 really samples


def test_top_k_one_and_tiny_top_p_equal_greedy(sk):
    greedy = sk.generate(PROMPTS, max_new_tokens=10, policy=SKIP)
    top1 = sk.generate(PROMPTS, max_new_tokens=10, policy=SKIP, temperature=1.5, top_k=1, seed=3)
    nucleus = sk.generate(PROMPTS, max_new_tokens=10, policy=SKIP, temperature=1.5, top_p=1e-6, seed=3)
    assert top1.token_ids == greedy.token_ids
    assert nucleus.token_ids == greedy.token_ids
    # top_p 0 (OpenAI's API allows it; the server, the CLI and the API agree): greedy at any temperature
    zero = sk.generate(PROMPTS, max_new_tokens=10, policy=SKIP, temperature=1.5, top_p=0, seed=3)
    assert zero.token_ids == greedy.token_ids


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": -1.0}),
    ("top_k", {"top_k": -1}),
    ("top_p", {"top_p": -0.5}),
    ("top_p", {"top_p": 1.5}),
    ("seed", {"seed": 1.5}),
])
def test_bad_sampling_parameters(sk, field, kwargs):
    with pytest.raises(ValueError, match=field):
        sk.generate("The Eagle", max_new_tokens=2, **kwargs)


def test_whole_number_sampling_values_sample_as_their_floats(sk):
    """``temperature=1`` is 1.0 (Hugging Face's warpers refuse an int: "has to be a strictly
    positive float"), in ``SkipModel.generate`` and in a row's ``SamplingParams``."""
    as_int = sk.generate(PROMPTS, max_new_tokens=8, policy=SKIP, temperature=2, top_p=1, seed=5, repetition_penalty=2)
    as_float = sk.generate(PROMPTS, max_new_tokens=8, policy=SKIP, temperature=2.0, top_p=1.0, seed=5,
                           repetition_penalty=2.0)
    assert as_int.token_ids == as_float.token_ids
    assert type(SamplingParams(temperature=1, frequency_penalty=1).temperature) is float
    np = pytest.importorskip("numpy")
    as_numpy = sk.generate(PROMPTS, max_new_tokens=8, policy=SKIP, temperature=np.float32(2), top_p=np.float64(1),
                           seed=np.int64(5), repetition_penalty=np.int32(2))
    assert as_numpy.token_ids == as_float.token_ids
    assert SamplingParams(top_k=np.int64(3), seed=np.int64(1)) == SamplingParams(top_k=3, seed=1)
    rows = [SamplingParams(temperature=1, seed=0), SamplingParams(temperature=1.0, seed=0)]
    out = generate(sk.adapter, sk.tokenizer, [PROMPTS[0]] * 2, sampling=rows, policy=SKIP, max_new_tokens=8)
    assert out.token_ids[0] == out.token_ids[1]


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "frequency_penalty"])
def test_a_boolean_sampling_value_is_refused_naming_it(sk, field):
    with pytest.raises(ValueError, match=f"{field} must be"):
        sk.generate("The Eagle", max_new_tokens=2, **{field: True})


# --------------------------------------------------------------------------------------------
# chat template, prompt validation
# --------------------------------------------------------------------------------------------


@pytest.fixture
def captured_prompts(monkeypatch):
    seen: list[torch.Tensor] = []
    real = gen_mod.generate_step

    def spy(adapter, input_ids, attention_mask, **kwargs):
        seen.append(input_ids.clone())
        return real(adapter, input_ids, attention_mask, **kwargs)

    monkeypatch.setattr(gen_mod, "generate_step", spy)
    return seen


def test_chat_uses_template(sk, tokenizer, captured_prompts):
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    sk.generate("The Eagle", max_new_tokens=2, chat=True)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "The Eagle"}], add_generation_prompt=True, tokenize=False
    )
    assert expected.startswith("<|im_start|>user\nThe Eagle<|im_end|>")
    ids = captured_prompts[-1][0].tolist()
    assert im_start in ids
    assert ids == tokenizer(expected)["input_ids"]
    sk.generate("The Eagle", max_new_tokens=2, chat=False)
    assert captured_prompts[-1][0].tolist() == tokenizer("The Eagle")["input_ids"]
    # the SkipModel default applies when chat is not given
    chat_model = SkipModel(sk.model, tokenizer, chat=True)
    chat_model.generate("The Eagle", max_new_tokens=2)
    assert captured_prompts[-1][0].tolist() == ids


def test_chat_without_template_raises(sk, tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        SkipModel(sk.model, plain).generate("hi", max_new_tokens=2, chat=True)


@pytest.mark.parametrize("chat", ["maybe", 1, "false"])
def test_load_refuses_a_chat_that_is_not_true_false_or_none(tmp_path, chat):
    """One LoadError naming ``chat`` before anything is read (was: accepted silently)."""
    from skipdecode.loading import LoadError, load

    with pytest.raises(LoadError, match=rf"^chat must be True, False or None .*got {chat!r}$"):
        load(tmp_path / "never_read", chat=chat)


@pytest.mark.parametrize("prompts,index", [("", 0), (["The Eagle", "   "], 1), (["ok", "fine", "\n\t"], 2), ([None], 0)])
def test_empty_or_blank_prompt_raises_naming_it(sk, prompts, index):
    with pytest.raises(ValueError, match=rf"prompts\[{index}\]"):
        sk.generate(prompts, max_new_tokens=2)


@pytest.mark.parametrize("prompts,where", [("\ud800", "prompts[0]"), (["ok", "a\udfffb"], "prompts[1]"),
                                           ([[{"role": "user", "content": "\ud800"}]], "prompts[0][0].content")])
def test_a_lone_surrogate_is_refused_naming_the_prompt(sk, prompts, where):
    with pytest.raises(ValueError, match=rf"{re.escape(where)} holds a lone surrogate"):
        sk.generate(prompts, max_new_tokens=2, chat=False)


@pytest.mark.parametrize("kwargs,words", [({"cohort_size": 0}, "cohort_size must be an integer >= 1"),
                                          ({"prefix_cache": "x"}, "prefix_cache must be"),
                                          ({"prefix_cache": -1}, "prefix_cache must be"),
                                          ({"chat": "no"}, "chat must be True or False")])
@pytest.mark.parametrize("prompts", ["The Eagle", ["The Eagle", "Describe it."]])
def test_settings_are_checked_for_one_prompt_as_for_many(sk, kwargs, words, prompts):
    """One prompt ran as a static batch, where the in-flight settings went unchecked, and
    ``chat="no"`` counted as True."""
    with pytest.raises(ValueError, match=words):
        sk.generate(prompts, max_new_tokens=2, **kwargs)


def test_no_prompts_raises(sk):
    with pytest.raises(ValueError, match="prompt"):
        sk.generate([], max_new_tokens=2)


# --------------------------------------------------------------------------------------------
# statistics and streaming
# --------------------------------------------------------------------------------------------


def test_stats_count_layers_actually_run(sk, tokenizer):
    n = 9
    res = no_eos_generate(sk, PROMPTS[:2], policy=SKIP, max_new_tokens=n)
    budgets = [SKIP.budget(t) for t in range(1, n)]  # decode steps 1..n-1; token 0 from prefill
    assert res.decode_steps == n - 1
    assert res.layers_run == budgets
    assert res.theoretical_speedup == pytest.approx(NUM_LAYERS * (n - 1) / sum(budgets))
    assert res.mean_active_layers == pytest.approx(sum(budgets) / (n - 1))
    assert res.new_tokens == [n, n]
    assert res.prompt_tokens == [len(tokenizer(p)["input_ids"]) for p in PROMPTS[:2]]
    stats = json.loads(json.dumps(res.stats()))
    assert stats["new_tokens"] == 2 * n
    assert stats["prompt_tokens"] == sum(res.prompt_tokens)
    assert stats["batch_size"] == 2 and stats["num_layers"] == NUM_LAYERS
    assert stats["theoretical_speedup"] == pytest.approx(res.theoretical_speedup)
    assert stats["mean_active_layers"] == pytest.approx(res.mean_active_layers)
    assert stats["policy"] == SKIP.to_dict()
    assert stats["decode_steps"] == n - 1
    assert stats["tokens_per_second"] > 0 and stats["prefill_seconds"] > 0 and stats["decode_seconds"] > 0
    assert stats["step_seconds"] == pytest.approx(res.decode_seconds / (n - 1))
    # full depth: nothing skipped, speedup exactly 1
    full = no_eos_generate(sk, PROMPTS[:2], policy=FullPolicy(NUM_LAYERS), max_new_tokens=n)
    assert full.layers_run == [NUM_LAYERS] * (n - 1)
    assert full.theoretical_speedup == 1.0 and full.mean_active_layers == NUM_LAYERS


def test_stats_when_generation_ends_early(chain_sk, tokenizer):
    """Realised, not target, speedup: the batch stops at EOS, so only the steps run count."""
    steps = len(tokenizer(TARGET)["input_ids"])  # decode steps: TARGET tokens 1.. and the EOS
    res = chain_sk.generate(CHAIN_PROMPT, policy=SKIP, max_new_tokens=40)
    budgets = [SKIP.budget(t) for t in range(1, steps + 1)]
    assert res.decode_steps == steps and res.layers_run == budgets
    assert res.theoretical_speedup == pytest.approx(NUM_LAYERS * steps / sum(budgets))


def test_single_token_generation_stats(sk):
    res = no_eos_generate(sk, PROMPTS[:1], policy=SKIP, max_new_tokens=1)
    assert res.new_tokens == [1] and res.decode_steps == 0 and res.layers_run == []
    assert res.theoretical_speedup == 1.0 and res.mean_active_layers == NUM_LAYERS


@pytest.mark.parametrize("policy", [None, SKIP], ids=["full", "skip"])
def test_stream_deltas_concatenate_to_final_text(sk, policy):
    chunks = list(sk.stream_generate(PROMPTS, max_new_tokens=14, policy=policy))
    res = sk.generate(PROMPTS, max_new_tokens=14, policy=policy)
    for row in range(len(PROMPTS)):
        assert "".join(c.deltas[row] for c in chunks) == res.texts[row]
    assert [c.step for c in chunks] == list(range(len(chunks)))
    # chunk tokens are the generated ids, column by column
    for row in range(len(PROMPTS)):
        emitted = [int(c.tokens[row]) for c in chunks][: res.new_tokens[row]]
        assert emitted == res.token_ids[row]
    expected_layers = [tuple(range(NUM_LAYERS))] + [
        (policy or FullPolicy(NUM_LAYERS)).active_layers(t) for t in range(1, len(chunks))
    ]
    assert [c.active_layers for c in chunks] == expected_layers


def test_stream_chunks_mark_every_end_and_its_reason(chain_sk):
    """A row that ends on ``max_new_tokens`` is finished in the last chunk (it read False before),
    with its reason: each chunk's ``finish_reasons`` is None while a row runs, then the result's
    reason (the chain model's row ends on EOS, the others on the length, one row on a stop string)."""
    prompts = [CHAIN_PROMPT, "The Eagle", CHAIN_PROMPT]
    kw = dict(max_new_tokens=4, policy=SKIP)
    full = chain_sk.generate(prompts, max_new_tokens=12, policy=SKIP)
    budget = max(full.new_tokens) - 1  # the longest answer's EOS does not fit: that row ends on the length
    chunks = list(chain_sk.stream_generate(prompts, max_new_tokens=budget, policy=SKIP, stop=["never"]))
    res = chain_sk.generate(prompts, max_new_tokens=budget, policy=SKIP)
    assert chunks[-1].finished == [True] * 3 and chunks[-1].finish_reasons == res.finish_reasons
    assert "length" in res.finish_reasons and "eos" in res.finish_reasons
    short = list(chain_sk.stream_generate(prompts, **kw, n=2))
    assert [c.finished for c in short[:-1]] == [[False] * 6] * 3 and short[-1].finished == [True] * 6
    assert [c.finish_reasons for c in short] == [[None] * 6] * 3 + [["length"] * 6]
    stopped = list(chain_sk.stream_generate(prompts[:1], max_new_tokens=12, policy=SKIP, stop=["coffee"]))
    ends = [i for i, c in enumerate(stopped) if c.finished[0]]
    assert stopped[ends[0]].finish_reasons == ["stop"] and all(c.finish_reasons == [None] for c in stopped[:ends[0]])
    seen = []  # in flight (max_batch_size): the same flags and reasons per row
    inflight = generate(chain_sk.adapter, chain_sk.tokenizer, prompts, max_batch_size=2, on_chunk=seen.append,
                        max_new_tokens=budget, policy=SKIP)
    for row, reason in enumerate(inflight.finish_reasons):
        flags = [c.finished[row] for c in seen]
        first = flags.index(True)
        assert all(flags[first:]) and [c.finish_reasons[row] for c in seen[first:]] == [reason] * (len(seen) - first)
        assert all(c.finish_reasons[row] is None for c in seen[:first])
    assert inflight.finish_reasons == res.finish_reasons


def test_generate_step_refuses_a_right_padded_batch(sk, tokenizer):
    """A tokenizer pads on the right by default; generate_step would decode the short row after
    its padding (a wrong answer, silently). It is refused naming the row and the way out, which works."""
    import skipdecode

    left_ids, left_mask = encode_prompts(tokenizer, PROMPTS[:2])
    right_ids = torch.stack([torch.roll(i, -int((m == 0).sum())) for i, m in zip(left_ids, left_mask)])
    right_mask = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in left_mask])
    short = int(right_mask.sum(-1).argmin())
    with pytest.raises(ValueError, match=rf"left-padded .* row {short} is .*padding_side = 'left'.*skipdecode\.encode_prompts"):
        next(generate_step(sk.adapter, right_ids, right_mask, max_new_tokens=2))
    ids, mask = skipdecode.encode_prompts(tokenizer, PROMPTS[:2])  # the named fix, as written
    assert len(list(generate_step(sk.adapter, ids, mask, max_new_tokens=2))) == 2
    empty = left_mask.clone()
    empty[1] = 0
    with pytest.raises(ValueError, match="attention_mask row 1 holds no token"):
        next(generate_step(sk.adapter, left_ids, empty, max_new_tokens=2))
    with pytest.raises(ValueError, match="attention_mask must be left-padded"):  # a value other than 0/1
        next(generate_step(sk.adapter, left_ids, torch.full_like(left_mask, 2), max_new_tokens=2))


@pytest.mark.parametrize("change,words", [
    (lambda a, i, m: (a.model, i, m, {}), "adapter must be a model's Adapter"),
    (lambda a, i, m: (SimpleNamespace(adapter=a), i, m, {}), "a SkipModel's is model.adapter"),
    (lambda a, i, m: (a, i.tolist(), m, {}), "input_ids must be a (B, P) torch.Tensor"),
    (lambda a, i, m: (a, i, None, {}), "attention_mask must be a (B, P) torch.Tensor"),
    (lambda a, i, m: (a, i.float(), m, {}), "input_ids must hold integer token ids"),
    (lambda a, i, m: (a, i - 10**6, m, {}), "input_ids must be token ids in [0, "),
    (lambda a, i, m: (a, i + 10**6, m, {}), "input_ids must be token ids in [0, "),
    (lambda a, i, m: (a, i, m, {"eos_token_ids": 2}), "eos_token_ids must be a sequence of token ids"),
])
def test_generate_step_names_each_bad_input(sk, tokenizer, change, words):
    """Each used to fail deep inside (torch's embedding, an IndexError, 'NoneType' has no shape)."""
    adapter, ids, mask, extra = change(sk.adapter, *encode_prompts(tokenizer, PROMPTS[:2]))
    with pytest.raises(ValueError) as info:
        next(generate_step(adapter, ids, mask, max_new_tokens=2, **extra))
    assert words in str(info.value)


def test_on_chunk_sees_every_chunk(sk):
    seen = []
    out = generate(sk.adapter, sk.tokenizer, PROMPTS[:2], policy=SKIP, max_new_tokens=6, eos_token_ids=[], on_chunk=seen.append)
    assert len(seen) == 6
    assert ["".join(c.deltas[r] for c in seen) for r in range(2)] == out.texts


def test_inflight_chunks_name_the_layers_run(sk):
    """In flight, a chunk's active_layers are the layers its engine step ran: those of the static
    stream for one prompt (the plan's top layers, not range(count)), the union of other steps'
    and policies' plans for other rows, every layer at a step that prefilled a row."""
    kw = dict(max_new_tokens=6, eos_token_ids=[])
    static, flight = [], []
    generate(sk.adapter, sk.tokenizer, PROMPTS[:1], policy=SKIP, on_chunk=static.append, **kw)
    generate(sk.adapter, sk.tokenizer, PROMPTS[:1], policy=SKIP, on_chunk=flight.append, max_batch_size=1, **kw)
    assert [c.active_layers for c in flight] == [c.active_layers for c in static]
    assert flight[-1].active_layers == SKIP.active_layers(5) != tuple(range(len(SKIP.active_layers(5))))
    # rows at other steps or with other policies (the server's case): the union of their plans
    from types import SimpleNamespace

    from skipdecode.inflight import _layers_run

    def event(step, policy):
        return SimpleNamespace(step=step, row=SimpleNamespace(request=SimpleNamespace(policy=policy)))

    other = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=3, min_layers=2, warmup_layers=0, horizon=2)
    union = tuple(sorted(set(other.active_layers(1)) | set(SKIP.active_layers(5))))
    assert union not in (other.active_layers(1), SKIP.active_layers(5))
    assert _layers_run([event(1, other), event(5, SKIP)], NUM_LAYERS) == union
    assert _layers_run([event(3, None)], NUM_LAYERS) == tuple(range(NUM_LAYERS))  # no policy: full depth
    assert _layers_run([event(4, SKIP), event(0, SKIP)], NUM_LAYERS) == tuple(range(NUM_LAYERS))  # a prefill


def test_batched_text_equals_single(sk):
    batched = sk.generate(PROMPTS, max_new_tokens=10, policy=SKIP)
    for i, prompt in enumerate(PROMPTS):
        alone = sk.generate(prompt, max_new_tokens=10, policy=SKIP)
        assert alone.token_ids[0] == batched.token_ids[i]
        assert alone.texts[0] == batched.texts[i]
        assert alone.finish_reasons[0] == batched.finish_reasons[i]


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=0)])
def test_nan_logits_never_reach_a_token(params):
    """docs/correctness.md pitfall 5: a NaN anywhere in a row's logits raises instead of yielding a token."""
    from skipdecode.sampling import Sampler

    logits = torch.randn(3, 50)
    assert Sampler(params)(logits.clone()).shape == (3,)
    logits[1, 7] = float("nan")
    with pytest.raises(RuntimeError, match="NaN"):
        Sampler(params)(logits)


@pytest.mark.parametrize("prompts", [None, 123, {"role": "user", "content": "hi"}, b"hi", {"a", "b"}],
                         ids=["None", "int", "dict", "bytes", "set"])
def test_prompts_that_are_neither_a_string_nor_a_list_name_the_argument(sk, prompts):
    calls = {"generate": lambda: sk.generate(prompts), "in flight": lambda: sk.generate(prompts, max_batch_size=2),
             "stream": lambda: next(iter(sk.stream_generate(prompts)))}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"^prompts must be a string or a list of prompts.*got {type(prompts).__name__}"):
            call()
