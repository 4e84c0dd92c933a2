"""What skipping must never do to the model around it (docs/correctness.md pitfalls 3, 9, 10).

* docs/correctness.md pitfall 3: the Hugging Face config (``num_hidden_layers`` etc.) and generation config are never
  written, and one request's policy never leaks into another's, even when two generations are
  interleaved on the same model (the server's situation).
* docs/correctness.md pitfall 9: tied input/output embeddings stay tied through ``save_pretrained`` -> ``load`` and
  through training, so the head a reloaded model exits through is the trained one.
* docs/correctness.md pitfall 10: pad == EOS (common: many tokenizers have no pad token) neither ends a left-padded
  row at its padding nor changes any row's output against the row run alone.

Tiny random models, offline.
"""

from __future__ import annotations

import copy

import pytest
import torch

import skipdecode
from conftest import left_pad, make_model, make_tokenizer
from skipdecode import LinearDecayPolicy, generate_step
from skipdecode.adapters import get_adapter
from skipdecode.data import Example
from skipdecode.model import SkipModel
from skipdecode.train import TrainConfig, train

NUM_LAYERS = 6
SKIP = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
PROMPT_IDS = [[11, 40, 7, 93, 150], [60, 61], [200, 17, 5]]


def configs(model) -> tuple[dict, dict]:
    return copy.deepcopy(model.config.to_dict()), copy.deepcopy(model.generation_config.to_dict())


# --------------------------------------------------------------------------------------------
# docs/correctness.md pitfall 3: configs untouched, no leaks between requests
# --------------------------------------------------------------------------------------------


def test_generation_never_writes_the_hf_config(family, tokenizer):
    model = make_model(family, NUM_LAYERS)
    before = configs(model)
    adapter = get_adapter(model)
    ids, mask = left_pad(PROMPT_IDS, model.config.pad_token_id)
    steps = list(generate_step(adapter, ids, mask, policy=SKIP, max_new_tokens=6, eos_token_ids=()))
    assert len(steps[-1].active_layers) < NUM_LAYERS  # it did skip
    sk = SkipModel(model, tokenizer, chat=False)
    sk.generate(["The Eagle is", "a pub"], policy=SKIP, max_new_tokens=6)
    list(sk.stream_generate("a pub", policy=SKIP, max_new_tokens=4))
    after = configs(model)
    assert after == before
    assert model.config.num_hidden_layers == NUM_LAYERS and len(adapter.layers) == NUM_LAYERS


def test_training_never_writes_the_hf_config(tmp_path, tokenizer):
    sk = SkipModel(make_model("llama", NUM_LAYERS), tokenizer, chat=False)
    before = configs(sk.model)
    examples = [Example("Describe: name[The Eagle]", "The Eagle is a pub.")] * 4
    train(sk, examples, TrainConfig(out_dir=str(tmp_path / "run"), speedup=2.0, batch_size=2, max_steps=1,
                                    lr=1e-3, progress=False, warmup_ratio=0.0, val_fraction=0.0))
    # Hugging Face's own save_pretrained records ``architectures`` and ``dtype`` on the config it
    # saves; every other field (layer count, heads, ids, generation settings) is untouched
    saved_by_hf = {"architectures", "dtype"}
    after = configs(sk.model)
    assert {k: v for k, v in after[0].items() if k not in saved_by_hf} == \
        {k: v for k, v in before[0].items() if k not in saved_by_hf}
    assert after[1] == before[1]
    reloaded = skipdecode.load(tmp_path / "run" / "final")
    assert reloaded.model.config.num_hidden_layers == NUM_LAYERS  # the saved config is the model's


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_interleaved_generations_do_not_leak_policies(family_name):
    """Two generations stepped in turn on one model (one skipping, one at full depth) each give
    exactly what they give alone: no policy, cache or plan state is shared."""
    model = make_model(family_name, NUM_LAYERS)
    adapter = get_adapter(model)
    pad = model.config.pad_token_id
    a_ids, a_mask = left_pad(PROMPT_IDS, pad)
    b_ids, b_mask = left_pad(PROMPT_IDS[1:], pad)

    def run(ids, mask, policy):
        return generate_step(adapter, ids, mask, policy=policy, max_new_tokens=6, eos_token_ids=(), pad_token_id=pad)

    alone_a, alone_b = list(run(a_ids, a_mask, SKIP)), list(run(b_ids, b_mask, None))
    gen_a, gen_b = run(a_ids, a_mask, SKIP), run(b_ids, b_mask, None)
    inter_a, inter_b = [], []
    for sa, sb in zip(gen_a, gen_b):  # strictly alternating steps
        inter_a.append(sa)
        inter_b.append(sb)
    assert len(inter_a) == len(alone_a) == 6
    for inter, alone in ((inter_a, alone_a), (inter_b, alone_b)):
        for x, y in zip(inter, alone):
            assert x.tokens.tolist() == y.tokens.tolist()
            torch.testing.assert_close(x.logits, y.logits, rtol=0, atol=1e-6)
    # the two runs really differ (the skipping one ran fewer layers), so the check can fail
    assert any(not torch.allclose(x.logits[1:], y.logits) for x, y in zip(alone_a[1:], alone_b[1:]))


# --------------------------------------------------------------------------------------------
# docs/correctness.md pitfall 9: tied embeddings through save/load and training
# --------------------------------------------------------------------------------------------


def _input_embedding(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


@pytest.mark.parametrize("family_name", ["qwen2", "gpt2"])
def test_tied_embeddings_survive_save_and_load(tmp_path, tokenizer, family_name):
    model = make_model(family_name, NUM_LAYERS)
    assert model.config.tie_word_embeddings
    sk = SkipModel(model, tokenizer, chat=False)
    assert sk.model.lm_head.weight.data_ptr() == _input_embedding(sk.model).data_ptr()
    want = sk.generate(["The Eagle is", "a pub"], policy=SKIP, max_new_tokens=6)
    loaded = skipdecode.load(sk.save_pretrained(tmp_path / "ckpt"))
    head, emb = loaded.model.lm_head.weight, _input_embedding(loaded.model)
    assert head.data_ptr() == emb.data_ptr()  # one tensor, not two copies
    torch.testing.assert_close(emb, _input_embedding(model), rtol=0, atol=0)
    got = loaded.generate(["The Eagle is", "a pub"], policy=SKIP, max_new_tokens=6)
    assert got.token_ids == want.token_ids


def test_tied_head_follows_training_after_reload(tmp_path, tokenizer):
    """After training a tied model, the reloaded head is the trained embedding (not the initial
    one, nor an untied stale copy): its teacher-forced logits equal the trained model's."""
    from skipdecode.train import collate, teacher_forced_logits, tokenize_examples

    sk = SkipModel(make_model("qwen2", NUM_LAYERS), tokenizer, chat=False)
    initial = _input_embedding(sk.model).detach().clone()
    examples = [Example("Describe: name[The Eagle]", "The Eagle is a pub.")] * 4
    result = train(sk, examples, TrainConfig(out_dir=str(tmp_path / "run"), speedup=2.0, batch_size=2, max_steps=2,
                                             lr=1e-2, progress=False, warmup_ratio=0.0, val_fraction=0.0))
    loaded = skipdecode.load(result.final_dir)
    assert loaded.model.lm_head.weight.data_ptr() == _input_embedding(loaded.model).data_ptr()
    assert not torch.equal(_input_embedding(loaded.model), initial)  # training changed the tied weight
    batch = collate(tokenize_examples(tokenizer, examples[:2], chat=False, max_length=64)[0])
    torch.testing.assert_close(teacher_forced_logits(loaded.adapter, batch, SKIP),
                               teacher_forced_logits(sk.adapter, batch, SKIP), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------
# docs/correctness.md pitfall 10: pad == EOS
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, SKIP], ids=["full", "skip"])
def test_pad_equal_to_eos_changes_nothing(policy):
    tok = make_tokenizer()
    tok.pad_token = tok.eos_token  # pad id == EOS id == 2
    assert tok.pad_token_id == tok.eos_token_id == 2
    model = make_model("llama", NUM_LAYERS)
    model.config.pad_token_id = model.generation_config.pad_token_id = 2
    sk = SkipModel(model, tok, chat=False)
    prompts = ["The Eagle is a French coffee shop by the", "a pub", "Describe the restaurant in"]
    batch = sk.generate(prompts, policy=policy, max_new_tokens=8)
    # the short rows are left-padded with id 2 == EOS: that must not end them
    assert batch.new_tokens[1] > 1 and batch.new_tokens[2] > 1
    for i, p in enumerate(prompts):
        alone = sk.generate([p], policy=policy, max_new_tokens=8)
        assert batch.token_ids[i] == alone.token_ids[0], p
        assert batch.finish_reasons[i] == alone.finish_reasons[0]


def test_pad_equal_to_eos_frozen_row_does_not_disturb_the_others():
    """generate_step with pad == EOS: a row that emits EOS is fed EOS (as pad) from then on; the
    other rows' tokens and logits equal their run without that row."""
    model = make_model("llama", NUM_LAYERS)
    adapter = get_adapter(model)
    ids, mask = left_pad(PROMPT_IDS, 2)
    free = list(generate_step(adapter, ids, mask, policy=SKIP, max_new_tokens=6, eos_token_ids=(), pad_token_id=2))
    # declare row 0's third token an EOS: row 0 stops there, rows 1 and 2 must not notice
    eos = free[2].tokens[0].item()
    assert eos not in [s.tokens[r].item() for s in free for r in (1, 2)], "pick prompts whose rows differ"
    ended = list(generate_step(adapter, ids, mask, policy=SKIP, max_new_tokens=6, eos_token_ids=(eos,),
                               pad_token_id=eos))
    assert ended[3].tokens[0].item() == eos  # frozen row reports pad (== EOS) after its EOS
    for a, b in zip(free, ended):
        assert a.tokens[1:].tolist() == b.tokens[1:].tolist()
        torch.testing.assert_close(a.logits[1:], b.logits[1:], rtol=0, atol=1e-5)
