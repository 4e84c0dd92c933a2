"""``quantize="head"``: the LM head alone quantized (int4's rescored head), float decoder layers.

What must hold (skipdecode.quantize, docs/quantization.md "Quantizing only the LM head"):
- the decoder layers are untouched: same module types and the same weights as the float model,
  so the hidden state reaching the head is the float model's exactly;
- the head is :class:`~skipdecode.rescored_head.RescoredHead` of the float head's weight, so the
  logits are that head applied to the float model's hidden states (its candidates get the int8
  head's logits);
- ``load(quantize="head")`` gives float decoder layers their weight-first products (as
  ``quantize=None`` does), and compiled equals eager.
"""

from __future__ import annotations

import pytest
import torch

from skipdecode.adapters import get_adapter
from skipdecode.bench_engines import build_variant, parse_variants, step_bytes
from skipdecode.layout import WeightLeftLinear
from skipdecode.loading import load
from skipdecode.model import SkipModel
from skipdecode.quantize import Int8Linear, quantize_model, quantized_mode
from skipdecode.rescored_head import RescoredHead

from conftest import make_chain_model, make_model

IDS = torch.tensor([[5, 17, 42, 99, 7, 150, 33, 8, 61]])


def _hidden_and_logits(model):
    with torch.inference_mode():
        out = model(IDS, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "opt_proj"])
def test_layers_untouched_and_head_rescored(family):
    ref = make_model(family)
    weight = ref.get_output_embeddings().weight.detach().clone()
    bias = getattr(ref.get_output_embeddings(), "bias", None)
    hidden_ref, logits_ref = _hidden_and_logits(ref)
    model = quantize_model(make_model(family), "head")
    assert quantized_mode(model) == "head"
    # every decoder linear is still the float module with the float weights
    ref_layers, layers = get_adapter(ref).layers, get_adapter(model).layers
    for (name, a), (_, b) in zip(ref_layers.named_modules(), layers.named_modules()):
        assert type(a) is type(b), name
    for (name, a), (_, b) in zip(ref_layers.named_parameters(), layers.named_parameters()):
        assert torch.equal(a, b), name
    head = model.get_output_embeddings()
    assert isinstance(head, RescoredHead) and head.preview is not None  # int4's head: preview kept
    hidden, logits = _hidden_and_logits(model)
    assert torch.equal(hidden, hidden_ref)  # the float layers' output, exactly
    want = RescoredHead(weight, None if bias is None else bias.detach())(hidden)
    assert torch.allclose(logits, want, atol=1e-5)
    # the top candidate of each position is the int8 head's logit there
    int8 = Int8Linear(weight, None if bias is None else bias.detach())(hidden)
    top = logits.argmax(-1, keepdim=True)
    assert torch.allclose(logits.gather(-1, top), int8.gather(-1, top), atol=1e-5)
    # and the model is not the float one (the head changed the logits), nor int4's (layers changed)
    assert not torch.allclose(logits, logits_ref, atol=1e-5)
    _, logits_int4 = _hidden_and_logits(quantize_model(make_model(family), "int4"))
    assert (logits_int4 - logits).abs().max() > 10 * (logits - want).abs().max() + 1e-4


def test_tied_input_embedding_stays_float():
    model = make_model("qwen2")
    emb = model.get_input_embeddings().weight.detach().clone()
    quantize_model(model, "head")
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, emb)


def test_greedy_tokens_follow_the_float_model(tokenizer):
    prompt, text = "Describe the restaurant:", "The Eagle is a coffee shop"
    ref = SkipModel(make_chain_model(tokenizer, prompt, text), tokenizer).generate(prompt, max_new_tokens=16)
    sk = SkipModel(quantize_model(make_chain_model(tokenizer, prompt, text), "head"), tokenizer)
    policy = sk.policy_for(speedup=2.0, horizon=8)
    assert sk.generate(prompt, max_new_tokens=16).token_ids == ref.token_ids
    assert sk.generate(prompt, max_new_tokens=16, policy=policy).texts == [text]


def test_load_head_weight_first_layers_and_compiled_equals_eager(tmp_path, tokenizer):
    directory = tmp_path / "m"
    SkipModel(make_model("llama"), tokenizer).save_pretrained(directory)
    eager = load(directory, quantize="head")
    assert eager.quantize == "head"
    linears = [m for m in eager.adapter.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is WeightLeftLinear for m in linears)
    assert isinstance(eager.model.get_output_embeddings(), RescoredHead)
    rb = eager.resident_bytes()
    assert 0 < rb["quantized"] < rb["float"]  # only the head is quantized
    compiled = load(directory, quantize="head", compile=True)
    assert compiled.compile_report.enabled, compiled.compile_report.error
    prompts = [tokenizer(p)["input_ids"] for p in ("The Eagle is", "Summarize the article. The quick")]
    for policy in (None, eager.policy_for(speedup=2.0, horizon=6)):
        want = eager.generate(prompts, max_new_tokens=6, policy=policy)
        got = compiled.generate(prompts, max_new_tokens=6, policy=policy)
        assert got.token_ids == want.token_ids


def test_bench_variant_names_and_weight_first_layers(tokenizer):
    sk = SkipModel(make_model("llama"), tokenizer)
    variant, report = build_variant(sk, "head", False)
    assert report is None and quantized_mode(variant.model) == "head"
    linears = [m for m in variant.adapter.layers.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is WeightLeftLinear for m in linears)  # as load() makes them
    assert type(sk.model.get_output_embeddings()) is torch.nn.Linear  # the source is left alone
    assert parse_variants("head,head+compile") == [("head", "head", False), ("head+compile", "head", "auto")]
    with pytest.raises(ValueError, match="--variants items must be"):
        parse_variants("head-unfused")


def test_step_bytes_count_what_a_decode_step_reads(tokenizer):
    """The benchmark's floor: float layers' weights, the head's preview and candidate rows (not
    its resident int8, int4 and W8A8 copies), the final norm and rotary tables, one embedding
    row per sequence and the K/V read; oneDNN's copies (read by prefills only) never count."""
    from skipdecode import onednn

    sk = SkipModel(make_model("llama"), tokenizer)
    variant, _ = build_variant(sk, "head", False)
    model, adapter = variant.model, variant.adapter
    B, P = 2, 5
    layer = sum(p.numel() * 4 for p in adapter.layers.parameters())
    tail = sum(t.numel() * 4 for m in (model.model.norm, model.model.rotary_emb)
               for t in [*m.parameters(), *m.buffers()])
    kv_heads, head_dim = adapter.kv_shape
    kv = adapter.num_layers * B * (P + 1) * 2 * kv_heads * head_dim * 4
    emb_row = model.get_input_embeddings().weight.shape[1] * 4
    want = layer + model.get_output_embeddings().step_read_bytes(B) + tail + B * emb_row + kv
    assert step_bytes(variant, [adapter.num_layers], B, P) == pytest.approx(want)
    w8a8, _ = build_variant(sk, "w8a8", False)
    before = step_bytes(w8a8, [6, 3], 1, P)
    if onednn.enable(w8a8.model):
        assert step_bytes(w8a8, [6, 3], 1, P) == pytest.approx(before)
