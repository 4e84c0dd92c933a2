"""Column-major float32 weights for the CPU decode step (skipdecode.layout).

load() stores CPU float32 linear weights column-major (same values, faster batch-1 products);
everything that needs contiguous weights (quantizers, training, save_pretrained) gets them back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import FAMILIES, make_model, make_tokenizer
from test_train import cfg, examples
from skipdecode import SkipModel, load
from skipdecode.layout import column_major, is_column_major, row_major
from skipdecode.policy import LinearDecayPolicy
from skipdecode.train import train

PROMPTS = ["The Eagle is a", "Blue Spice serves French food in the city centre"]


def _linears(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("family", FAMILIES)
def test_column_major_keeps_values_tying_and_every_answer(family):
    """Same values, column-major strides, a tied head still shared with the embedding, and the
    same greedy tokens and logits (1e-5) with and without skipping."""
    sk = SkipModel(make_model(family), make_tokenizer())
    before = {k: v.clone() for k, v in sk.model.state_dict().items()}
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, horizon=6)
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    want_logits = sk.model(ids).logits
    want = {p: sk.generate(PROMPTS, max_new_tokens=8, policy=p).token_ids
            for p in (sk.policy_for(speedup=1.0), policy)}
    n = column_major(sk.model)
    assert n >= 1 and is_column_major(sk.model)
    for w in _linears(sk.model):
        if min(w.shape) > 1:
            assert not w.is_contiguous() and w.stride() == (1, w.shape[0])
    for k, v in sk.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    out_emb, in_emb = sk.model.get_output_embeddings(), sk.model.get_input_embeddings()
    if sk.model.config.tie_word_embeddings:
        assert out_emb.weight is in_emb.weight
    torch.testing.assert_close(sk.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    for p, ref in want.items():
        assert sk.generate(PROMPTS, max_new_tokens=8, policy=p).token_ids == ref
    assert row_major(sk.model) == n and not is_column_major(sk.model)
    assert all(w.is_contiguous() for w in _linears(sk.model))


def test_load_lays_cpu_float32_out_column_major_and_saves_contiguous(tmp_path):
    """load() re-lays the weights; save_pretrained writes them (contiguous) and a reload answers
    the same; a quantized load starts from contiguous weights and matches quantizing a
    row-major copy."""
    path = tmp_path / "tiny"
    reference = SkipModel(make_model("qwen2"), make_tokenizer())
    reference.save_pretrained(path)
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    want, want_logits = reference.generate(PROMPTS, max_new_tokens=6).token_ids, reference.model(ids).logits
    sk = load(str(path))
    assert is_column_major(sk.model)
    assert sk.generate(PROMPTS, max_new_tokens=6).token_ids == want
    torch.testing.assert_close(sk.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    sk.save_pretrained(tmp_path / "again")
    assert not is_column_major(sk.model)
    again = load(str(tmp_path / "again"))
    assert again.generate(PROMPTS, max_new_tokens=6).token_ids == want
    torch.testing.assert_close(again.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    q = load(str(path), quantize="int8")
    assert not is_column_major(q.model)
    from skipdecode.quantize import quantize_model

    quantize_model(reference.model, "int8")  # from the row-major weights
    torch.testing.assert_close(q.model(ids).logits, reference.model(ids).logits)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_training_a_loaded_model_makes_its_weights_contiguous(tmp_path, lora_r):
    """A model from load() (column-major) trains and saves: full fine-tune and LoRA."""
    path = tmp_path / "tiny"
    SkipModel(make_model("llama"), make_tokenizer()).save_pretrained(path)
    sk = load(str(path))
    assert is_column_major(sk.model)
    result = train(sk, examples(), cfg(tmp_path / "run", max_steps=2, lora_r=lora_r, kl_weight=0.0))
    assert not is_column_major(sk.model)
    final = load(result.final_dir)
    assert len(final.generate(PROMPTS, max_new_tokens=4).token_ids) == 2
