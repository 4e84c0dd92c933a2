"""Decode-only skip adapters (trained with ``TrainConfig.base_prefill``): the base model prefills
the prompt, the adapter runs on decode steps only, in every generation path (static generate,
in-flight engine, int4 with the adapter unmerged), and the model cannot be saved as one checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_skip_adapter import ADAPTER_POLICY, NUM_LAYERS, _lora_dir
from test_skip_adapter import adapter_dir, base_dir  # noqa: F401  (fixtures)
from skipdecode import load
from skipdecode import skip_adapter as sa
from skipdecode.cache import SkipCache
from skipdecode.forward import skip_forward
from skipdecode.lowrank import LowRankLinear, PrefillSwitch, attach_lora, base_prefill, has_decode_only_adapter

PROMPTS = ["Describe the restaurant", "name[The Eagle] food[French]"]
N_NEW = 8


@pytest.fixture(scope="module")
def decode_only_dir(adapter_dir, tmp_path_factory):  # noqa: F811
    """The same LoRA weights as ``adapter_dir``, recorded as trained with base_prefill."""
    path = tmp_path_factory.mktemp("decode_only") / "lora"
    shutil.copytree(adapter_dir, path)
    meta = json.loads((path / "skipdecode.json").read_text())
    meta["training"] = {"config": {"base_prefill": True, "lora_r": 2}}
    (path / "skipdecode.json").write_text(json.dumps(meta))
    return path


def _reference(stock, merged, prompt: str, policy, n: int = N_NEW) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and token-0 logits built by hand: the stock model prefills, the merged
    adapter model decodes from the same cache."""
    ids = stock.tokenizer(prompt, return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    cache = SkipCache(NUM_LAYERS, capacity=ids.shape[1] + n)
    with torch.no_grad():
        logits0 = skip_forward(stock.adapter, ids, mask, cache=cache, logits_last_only=True)[:, -1]
        tokens = [int(logits0.argmax(-1))]
        for step in range(1, n):
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], 1)
            logits = skip_forward(merged.adapter, torch.tensor([[tokens[-1]]]), mask,
                                  active_layers=policy.active_layers(step), cache=cache)[:, -1]
            tokens.append(int(logits.argmax(-1)))
    return tokens, logits0[0]


def test_prefill_runs_the_base_model_and_decoding_the_adapter(base_dir, adapter_dir, decode_only_dir):  # noqa: F811
    stock = load(str(base_dir), adapter=False)
    merged = load(str(base_dir), adapter=str(adapter_dir))
    only = load(str(base_dir), adapter=str(decode_only_dir))
    assert has_decode_only_adapter(only.model) and not has_decode_only_adapter(merged.model)
    assert only.skip_config["skip_adapter"]["decode_only"] is True
    for prompt in PROMPTS:
        want, logits0 = _reference(stock, merged, prompt, ADAPTER_POLICY)
        static = only.generate(prompt, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False)
        assert list(static.token_ids[0]) == want
        # not the merged model's answer, nor the stock model's: both halves matter
        assert list(merged.generate(prompt, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False).token_ids[0]) != want
        assert list(stock.generate(prompt, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False).token_ids[0]) != want
        ids = only.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad(), base_prefill(only.model):
            got0 = skip_forward(only.adapter, ids, torch.ones_like(ids), logits_last_only=True)[0, -1]
        torch.testing.assert_close(got0, logits0, rtol=0, atol=1e-5)
    # the in-flight engine (several prompts, rows joining together) prefills with the base model too
    inflight = only.generate(PROMPTS, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False, max_batch_size=2)
    for prompt, toks in zip(PROMPTS, inflight.token_ids):
        assert list(toks) == _reference(stock, merged, prompt, ADAPTER_POLICY)[0]


def test_prefix_cache_reuses_base_model_prefixes(base_dir, adapter_dir, decode_only_dir):  # noqa: F811
    """In flight with prefix caching, later prompts reuse a prefix that the base model computed;
    their answers still equal the hand-built base-prefill reference."""
    stock = load(str(base_dir), adapter=False)
    merged = load(str(base_dir), adapter=str(adapter_dir))
    only = load(str(base_dir), adapter=str(decode_only_dir))
    shared = "name[The Eagle] eatType[coffee shop] food[French] priceRange[moderate] area[riverside] near["
    prompts = [shared + tail for tail in ("Burger King]", "Cafe Rouge]", "The Sorrento]")]
    res = only.generate(prompts, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False, max_batch_size=1)
    assert res.stats()["cached_prompt_tokens"] > 0
    for prompt, toks in zip(prompts, res.token_ids):
        assert list(toks) == _reference(stock, merged, prompt, ADAPTER_POLICY)[0]


def test_int4_unmerged_decode_only_adapter_is_off_in_the_prefill(base_dir, decode_only_dir):  # noqa: F811
    stock = load(str(base_dir), adapter=False, quantize="int4")
    only = load(str(base_dir), adapter=str(decode_only_dir), quantize="int4")
    assert has_decode_only_adapter(only.model)
    ids = stock.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        want = skip_forward(stock.adapter, ids, torch.ones_like(ids))[0]
        with base_prefill(only.model):
            got = skip_forward(only.adapter, ids, torch.ones_like(ids))[0]
        adapted = skip_forward(only.adapter, ids, torch.ones_like(ids))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (adapted - want).abs().max() > 1e-2  # outside the prefill the adapter acts


def test_switch_semantics_and_errors():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    x = torch.randn(3, 8)
    delta = 1.5 * (x @ a.T) @ b.T
    switch = PrefillSwitch()
    unmerged = LowRankLinear(base, a, b, 1.5, switch=switch)
    merged_base = torch.nn.Linear(8, 6)
    with torch.no_grad():
        merged_base.weight.copy_(base.weight + 1.5 * b @ a)
        merged_base.bias.copy_(base.bias)
    merged = LowRankLinear(merged_base, a, b, 1.5, merged=True, switch=switch)
    for module in (unmerged, merged):
        torch.testing.assert_close(module(x), base(x) + delta, rtol=1e-5, atol=1e-5)
    switch.base = True
    for module in (unmerged, merged):
        torch.testing.assert_close(module(x), base(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs a PrefillSwitch"):
        LowRankLinear(base, a, b, 1.0, merged=True)


def test_attach_merged_needs_decode_only(base_dir, adapter_dir):  # noqa: F811
    plain = load(str(base_dir), adapter=False)
    with pytest.raises(ValueError, match="decode-only"):
        attach_lora(plain.model, adapter_dir, merged=True)


def test_decode_only_model_refuses_to_save_and_info_reports_it(base_dir, adapter_dir, decode_only_dir, tmp_path):  # noqa: F811
    only = load(str(base_dir), adapter=str(decode_only_dir))
    with pytest.raises(ValueError, match="decode-only skip adapter"):
        only.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sa.adapter_summary(decode_only_dir, shipped=False)["decode_only"] is True
    assert sa.adapter_summary(adapter_dir, shipped=False)["decode_only"] is False


def test_calm_runs_the_base_model(base_dir, decode_only_dir):  # noqa: F811
    """CALM exits early, it does not skip lower layers: a decode-only skip adapter stays off in its
    decode steps too, so threshold 1 ("never exit") is the full-depth answer, and any threshold
    gives the stock model's CALM tokens and exits."""
    from skipdecode import FullPolicy
    from skipdecode.calm import calm_generate

    stock = load(str(base_dir), adapter=False)
    only = load(str(base_dir), adapter=str(decode_only_dir))
    for prompt in PROMPTS:
        full = only.generate(prompt, policy=FullPolicy(NUM_LAYERS), max_new_tokens=N_NEW, chat=False)
        never = calm_generate(only, prompt, threshold=1.0, max_new_tokens=N_NEW, eos_token_ids=[], chat=False)
        assert list(never.token_ids[0]) == list(full.token_ids[0])
        assert never.exit_layers == [NUM_LAYERS] * (N_NEW - 1)
        # the adapter's own decode steps would answer otherwise (the test has teeth)
        assert list(only.generate(prompt, policy=ADAPTER_POLICY, max_new_tokens=N_NEW, chat=False).token_ids[0]) \
            != list(full.token_ids[0])
        early = calm_generate(only, prompt, threshold=0.0, min_layers=3, max_new_tokens=N_NEW, eos_token_ids=[], chat=False)
        ref = calm_generate(stock, prompt, threshold=0.0, min_layers=3, max_new_tokens=N_NEW, eos_token_ids=[], chat=False)
        assert list(early.token_ids[0]) == list(ref.token_ids[0]) and early.exit_layers == ref.exit_layers == [3] * (N_NEW - 1)
