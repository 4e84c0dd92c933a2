"""Weight-only int8/int4 linears (skipdecode.quantize) on tiny models of every family.

Tolerances (docs/quantization.md):
- one linear layer: the exact rounding bound. int8 moves each weight by at most s_n / 2
  (s_n = max_k |W[n, k]| / 127), so |y_n - y'_n| <= sum_k |x_k| * s_n / 2; int4 moves each weight
  by at most s_g / 2 of its group g, so |y_n - y'_n| <= sum_g s_ng / 2 * sum_{k in g} |x_k|, plus,
  on PyTorch's int4 kernel, 2^-7 |x| @ |W'|^T for its bfloat16 activations (test_quantize_int4.py).
  Checked with a float32 slack of 1e-5 relative to the output scale.
- whole model, int8: max |logits - logits_float| <= 5% of max |logits_float|. The per-weight
  error is at most 1/254 of its row's largest weight; over 6 layers x 4-7 linears the measured
  worst case on these tiny random models (weights N(0, 0.15), 7 families) is 2.6%, so 5% is a 2x
  margin, and the test fails for int4 (10-50%) and for a wrong scale or transposed weight.
- greedy agreement: on a model with clear margins (the bigram chain model) int8 greedy tokens
  equal float32's exactly. Random tiny models have near-ties and are not used for this.
"""

from __future__ import annotations

import pytest
import torch

from skipdecode.loading import LoadError, load
from skipdecode.model import SkipModel
from skipdecode.quantize import (
    Int4Linear,
    Int8Linear,
    QuantizeError,
    check_quantize,
    quantize_model,
    quantized_mode,
    resident_bytes,
)

from conftest import make_chain_model, make_model

PROMPT_IDS = [[5, 17, 42, 99, 7, 150, 33, 8, 61]]


def _logits(model, ids=PROMPT_IDS):
    with torch.inference_mode():
        return model(torch.tensor(ids)).logits


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_int8_linear_within_rounding_bound(rows):
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.2
    b = torch.randn(48)
    x = torch.randn(rows, 64)
    layer = Int8Linear(w, b)
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.abs().max() <= 127
    s = w.abs().amax(1) / 127
    assert torch.allclose(layer.scale, s)
    # dequantized weight within half a step of the float weight, per output channel
    assert ((layer.dequantized() - w).abs() <= s[:, None] / 2 + 1e-7).all()
    y = layer(x)
    ref = x @ w.t() + b
    bound = x.abs().sum(-1, keepdim=True) * s / 2  # (rows, 48)
    assert ((y - ref).abs() <= bound + 1e-5 * ref.abs().max()).all()
    # and it equals the product with the dequantized weight (the eager kernels' math)
    assert torch.allclose(y, x @ layer.dequantized().t() + b, atol=1e-5)
    # a wrong (all-ones) scale would break the bound: the bound is tight enough to matter
    assert (bound < ref.abs().max()).all()


@pytest.mark.parametrize("n", [40, 48])  # 40 rows: the fallback layout; 48: PyTorch's int4 kernel
def test_int4_linear_within_group_bound(n):
    torch.manual_seed(1)
    w = torch.randn(n, 96) * 0.2
    x = torch.randn(2, 96)
    layer = Int4Linear(w, None, group_size=32)
    assert layer.codes().shape == (n, 96) and layer.scales_and_zeros.shape == (3, n, 2)
    wg = w.reshape(n, 3, 32)
    s = layer.scales_and_zeros[..., 0].t().float()  # the stored bfloat16 step, (n, 3)
    assert (s <= (wg.amax(-1) - wg.amin(-1)) / 15 * (1 + 2**-7)).all()  # (max - min) / 15, rounded up
    assert ((layer.dequantized().reshape(n, 3, 32) - wg).abs() <= s[..., None] / 2 + 1e-6).all()
    y = layer(x)
    bound = (x.abs().reshape(2, 1, 3, 32).sum(-1) * s[None] / 2).sum(-1)
    kernel_rounding = 2**-7 * 1.01 * (x.abs() @ layer.dequantized().abs().t())  # bfloat16 activations
    assert ((y - x @ w.t()).abs() <= bound + kernel_rounding + 1e-5).all()


def test_int4_narrow_layer_uses_smaller_groups():
    layer = Int4Linear(torch.randn(8, 16), None, group_size=32)
    assert layer.group_size == 16
    with pytest.raises(QuantizeError, match="even"):
        Int4Linear(torch.randn(8, 15), None)


def test_int8_logits_close_every_family(family):
    ref_model = make_model(family)
    ref = _logits(ref_model)
    q = quantize_model(make_model(family), "int8")
    assert quantized_mode(q) == "int8"
    out = _logits(q)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel <= 0.05, rel
    # every decoder linear and the head were replaced; nothing float is left in them
    from skipdecode.adapters import get_adapter

    layers = get_adapter(q).layers
    assert not any(isinstance(m, torch.nn.Linear) for m in layers.modules())
    assert type(q.get_output_embeddings()).__name__ == "Int8Linear"


def test_int4_logits_farther_than_int8(family):
    """int4 is coarser: its error is larger than int8's (so the 5% test above is not vacuous)."""
    ref = _logits(make_model(family))
    e8 = (_logits(quantize_model(make_model(family), "int8")) - ref).abs().max()
    e4 = (_logits(quantize_model(make_model(family), "int4")) - ref).abs().max()
    assert e4 > 2 * e8
    assert (e4 / ref.abs().max()) < 0.75  # still the same model, not noise


@pytest.mark.parametrize("family", ["qwen2", "gpt2", "opt_proj"])
def test_tied_head_correct(family):
    """A tied model: input embedding stays float32 and untouched; the head is int8 of it."""
    model = make_model(family)
    emb = model.get_input_embeddings().weight.detach().clone()
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    quantize_model(model, "int8")
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, emb)
    head = model.get_output_embeddings()
    assert torch.allclose(head.dequantized(), Int8Linear(emb).dequantized())
    before = _logits(model)
    model.tie_weights()  # HF re-tying (save/load paths call it) must not break the head
    assert torch.equal(_logits(model), before)


def test_greedy_tokens_agree_with_float(tokenizer):
    prompt, text = "Describe the restaurant:", "The Eagle is a coffee shop"
    ref = SkipModel(make_chain_model(tokenizer, prompt, text), tokenizer).generate(prompt, max_new_tokens=16)
    for mode in ("int8", "int4"):
        sk = SkipModel(quantize_model(make_chain_model(tokenizer, prompt, text), mode), tokenizer)
        out = sk.generate(prompt, max_new_tokens=16)
        assert out.token_ids == ref.token_ids, mode
        assert out.texts == ref.texts == [text]


def test_skip_plan_runs_quantized(tokenizer):
    sk = SkipModel(quantize_model(make_model("llama"), "int8"), tokenizer)
    policy = sk.policy_for(speedup=2.0, horizon=4)
    res = sk.generate(["The Eagle is", "Summarize the article. The quick"], max_new_tokens=6, policy=policy)
    assert res.layers_run == [len(policy.active_layers(t)) for t in range(1, 6)]
    assert min(res.layers_run) < 6 and all(len(t) == 6 for t in res.token_ids)


def test_resident_bytes_shrink():
    model = make_model("llama")
    float_total = resident_bytes(model)["total"]
    assert float_total == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.untyped_storage().nbytes() for b in model.buffers()
    )
    quantize_model(model, "int8")
    rb = resident_bytes(model)
    from skipdecode.adapters import get_adapter

    lin = sum(m.weight_int8.numel() + m.scale.numel() * 4 for m in model.modules() if isinstance(m, Int8Linear))
    assert rb["quantized"] == lin + 0  # no biases in Llama
    assert rb["total"] < float_total
    assert get_adapter(model).num_layers == 6


@pytest.mark.parametrize("bad", ["int2", "INT8", 8, "fp8", True])
def test_bad_quantize_value_names_field(bad):
    with pytest.raises(QuantizeError, match="quantize must be one of int8, int4"):
        check_quantize(bad)
    with pytest.raises(LoadError, match="quantize must be one of"):
        load("/nonexistent/model", quantize=bad)  # checked before anything is read


def test_quantize_twice_and_save_refused(tmp_path, tokenizer):
    model = quantize_model(make_model("llama"), "int8")
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="cannot save a int8-quantized model"):
        SkipModel(model, tokenizer).save_pretrained(tmp_path / "x")
    assert quantize_model(make_model("llama"), None).get_output_embeddings().__class__ is torch.nn.Linear


def test_load_quantize_option(tmp_path, tokenizer):
    src = SkipModel(make_model("qwen2"), tokenizer)
    src.save_pretrained(tmp_path / "ckpt")
    sk = load(tmp_path / "ckpt", quantize="int8")
    assert sk.quantize == "int8"
    assert sk.resident_bytes()["quantized"] > 0
    ref = _logits(load(tmp_path / "ckpt").model)
    assert ((_logits(sk.model) - ref).abs().max() / ref.abs().max()) <= 0.05


def test_load_refuses_a_device_this_machine_lacks(tmp_path, tokenizer):
    """From Python as from the CLI: one LoadError naming ``device``, before anything is read."""
    missing = tmp_path / "never_read"
    if not torch.cuda.is_available():
        with pytest.raises(LoadError, match="device cuda: this torch build or machine has no CUDA GPU; use device cpu"):
            load(missing, device="cuda")
    with pytest.raises(LoadError, match="device must be a torch device such as cpu, cuda or cuda:1, got 'gpu0'"):
        load(missing, device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_named_as_given(tmp_path):
    """``cuda:7`` is reported whole (was cut to ``cuda:``)."""
    with pytest.raises(LoadError, match="^device cuda:7: this torch build or machine has no CUDA GPU; use device cpu"):
        load(tmp_path / "never_read", device="cuda:7")
