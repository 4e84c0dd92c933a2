"""``TrainConfig.base_prefill``: the base model (LoRA switched off) prefills the whole prompt, the
adapter trains on the decode positions only, as a decode-only skip adapter runs at inference.
The loss equals KV-cached decoding built directly: a base-model prefill, then the response tokens
fed one at a time with the adapter on; gradients match it and never reach the prompt pass."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from test_prompt_grad import L, POLICY, _batch, _grads, _GradCache

from skipdecode.adapters import get_adapter
from skipdecode.forward import skip_forward
from skipdecode.train import SkipLossModule, TokenizedExample, TrainConfigError, build_layer_mask


def _lora(family: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(make_model(family, num_layers=L),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", bias="none"))
    with torch.no_grad():  # a non-zero adapter (B starts at zero)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return peft_model, get_adapter(peft_model.base_model.model)


def _reference_ce(peft_model, adapter, item: TokenizedExample, policy, base_at_full_depth: bool = True) -> torch.Tensor:
    """Summed CE as decoding computes it: the whole prompt prefilled by the base model (adapter
    off, no grad) gives token 0; response tokens 0..n-2 are fed one at a time, adapter on except
    at decode steps that run every layer (with ``base_at_full_depth``)."""
    prompt, resp = list(item.prompt_ids), list(item.response_ids)
    cache = _GradCache(L)
    with torch.no_grad(), peft_model.disable_adapter():
        logits = skip_forward(adapter, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                              cache=cache)
    total = F.cross_entropy(logits[0, -1:].float(), torch.tensor([resp[0]]), reduction="sum")
    for i, tok in enumerate(resp[:-1]):
        K = len(prompt) + i + 1
        active = list(policy.active_layers(i + 1))
        # a decode step that runs every layer runs the base weights (skipdecode.lowrank)
        with peft_model.disable_adapter() if base_at_full_depth and len(active) == L else nullcontext():
            logits = skip_forward(adapter, torch.tensor([[tok]]), torch.ones(1, K, dtype=torch.long),
                                  active_layers=active, cache=cache)
        total = total + F.cross_entropy(logits[0, -1:].float(), torch.tensor([resp[i + 1]]), reduction="sum")
    return total


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_base_prefill_loss_and_gradients_equal_base_prefilled_decoding(family):
    peft_model, adapter = _lora(family)
    batch = _batch()
    lm = build_layer_mask(POLICY, batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1], L)
    args = (batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
    n = batch.n_targets
    ce, _ = SkipLossModule(peft_model, adapter, prompt_grad=False, base_prefill=True)(*args)
    items = [TokenizedExample(tuple(batch.input_ids[b, :p].tolist()), tuple(batch.input_ids[b, p:s].tolist()))
             for b, (p, s) in enumerate(zip(batch.prompt_lens.tolist(), batch.seq_lens.tolist()))]
    ref = sum(_reference_ce(peft_model, adapter, it, POLICY) for it in items)
    torch.testing.assert_close(ce, ref, rtol=0, atol=1e-4)
    grads, grads_ref = _grads(peft_model, ce / n), _grads(peft_model, ref / n)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)
    # the adapter-on prefill (prompt_grad=False alone) is a different forward
    ce_adapted, _ = SkipLossModule(peft_model, adapter, prompt_grad=False)(*args)
    assert abs(ce_adapted.item() - ce.item()) > 1e-3


@pytest.mark.parametrize("k", [2, 4])
def test_base_prefill_with_full_depth_steps_equals_base_weights_at_those_steps(k):
    """``LinearDecayPolicy.full_depth_steps``: decode steps 1..k run every layer, hence the base
    weights at inference, so the loss of a decode-only adapter equals decoding that runs them with
    the adapter off (k=4 exceeds the 3-token row's inputs: rows lead with different counts), and
    differs from keeping the adapter on at those steps."""
    peft_model, adapter = _lora("llama")
    policy = replace(POLICY, full_depth_steps=k)
    batch = _batch()
    lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1], L)
    args = (batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
    ce, _ = SkipLossModule(peft_model, adapter, prompt_grad=False, base_prefill=True)(*args)
    items = [TokenizedExample(tuple(batch.input_ids[b, :p].tolist()), tuple(batch.input_ids[b, p:s].tolist()))
             for b, (p, s) in enumerate(zip(batch.prompt_lens.tolist(), batch.seq_lens.tolist()))]
    ref = sum(_reference_ce(peft_model, adapter, it, policy) for it in items)
    torch.testing.assert_close(ce, ref, rtol=0, atol=1e-4)
    n = batch.n_targets
    grads, grads_ref = _grads(peft_model, ce / n), _grads(peft_model, ref / n)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)
    # the same plan with the adapter kept on at the full-depth steps is another loss
    ref_on = sum(_reference_ce(peft_model, adapter, it, policy, base_at_full_depth=False) for it in items)
    assert abs(ref_on.item() - ce.item()) > 1e-3


def test_base_prefill_token0_is_the_base_models():
    """With a batch of one-token responses the whole loss comes from the base prefill: it equals
    the base model's cross-entropy, and no LoRA weight gets a gradient."""
    peft_model, adapter = _lora("llama")
    batch = _batch()
    P = batch.prompt_lens
    one = TokenizedExample
    from skipdecode.train import collate

    items = [one(tuple(batch.input_ids[b, :p].tolist()), (int(batch.input_ids[b, p]),)) for b, p in enumerate(P.tolist())]
    b1 = collate(items)
    lm = build_layer_mask(POLICY, b1.prompt_lens, b1.seq_lens, b1.input_ids.shape[1], L)
    ce, _ = SkipLossModule(peft_model, adapter, prompt_grad=False, base_prefill=True)(
        b1.input_ids, b1.attention_mask, b1.prompt_lens, b1.seq_lens, lm)
    assert not ce.requires_grad
    with torch.no_grad(), peft_model.disable_adapter():
        ref = sum(F.cross_entropy(skip_forward(adapter, torch.tensor([list(it.prompt_ids)]),
                                               torch.ones(1, len(it.prompt_ids), dtype=torch.long))[0, -1:],
                                  torch.tensor([it.response_ids[0]]), reduction="sum") for it in items)
    torch.testing.assert_close(ce, ref, rtol=0, atol=1e-4)


def test_base_prefill_config_errors(tmp_path):
    from test_train import cfg

    for kw, field in [({"base_prefill": True, "lora_r": 4}, "base_prefill"),  # prompt_grad defaults True
                      ({"base_prefill": True, "prompt_grad": False}, "base_prefill"),  # lora_r 0
                      ({"base_prefill": 1, "prompt_grad": False, "lora_r": 4}, "base_prefill")]:
        with pytest.raises(TrainConfigError) as info:
            cfg(tmp_path / "x", **kw)
        assert info.value.field == field, kw


def test_cli_base_prefill(tmp_path):
    import json

    from typer.testing import CliRunner

    from test_prompt_grad import cli_train_args

    from skipdecode.cli import app

    base = cli_train_args(tmp_path) + ["--base-prefill"]
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "bad"), "--lora-r", "2"])  # prompt_grad on
    assert res.exit_code == 2 and "--base-prefill" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run"), "--lora-r", "2", "--no-prompt-grad"])
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "run" / "final" / "skipdecode.json").read_text())
    assert saved["training"]["config"]["base_prefill"] is True
    from skipdecode import load
    from skipdecode.lowrank import has_decode_only_adapter

    assert has_decode_only_adapter(load(str(tmp_path / "run" / "final")).model)  # loads as decode-only
