"""Decode steps without an attention mask (skipdecode.forward.unmasked_layers / step_masks).

A decode step of an unpadded batch (every batch-1 step) lets every query see every key, so its
layers run with ``attention_mask=None``: the same attention, and HF's SDPA then groups query heads
over the key/value heads instead of copying keys and values per head. The contract: the same
logits and tokens as with the explicit all-visible mask, a mask wherever one matters (padding, a
window shorter than the keys, several new tokens), and the in-flight path unchanged.
"""

from __future__ import annotations

import pytest
import torch

import skipdecode.forward as forward
from conftest import FAMILIES, VOCAB, left_pad, make_model
from skipdecode import LinearDecayPolicy, generate_step, get_adapter
from skipdecode.forward import step_masks, unmasked_layers


def _masks_seen(adapter):
    """Record the ``attention_mask`` every decoder layer receives: (list, hook handles)."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
             for layer in adapter.layers]
    return seen, hooks


def _decode(adapter, ids, mask, policy=None, n=6):
    steps = list(generate_step(adapter, ids, mask, policy=policy, max_new_tokens=n, eos_token_ids=(), pad_token_id=0))
    return torch.stack([s.tokens for s in steps], 1), torch.stack([s.logits for s in steps], 1)


def test_which_steps_need_no_mask():
    adapter = get_adapter(make_model("llama"))
    ones = torch.ones(2, 7, dtype=torch.long)
    assert unmasked_layers(adapter, ones, 1) == [True] * adapter.num_layers
    padded = ones.clone()
    padded[1, 0] = 0
    assert unmasked_layers(adapter, padded, 1) == [False] * adapter.num_layers
    assert unmasked_layers(adapter, ones, 2) == [False] * adapter.num_layers  # a prefill keeps its causal mask
    # windowed layers keep their mask, whether the keys fit the window or not (one compiled
    # variant per layer for a whole generation)
    adapter.layer_windows = (4, None, 4, None, 4, None)
    assert unmasked_layers(adapter, torch.ones(1, 3, dtype=torch.long), 1) == [False, True] * 3
    assert unmasked_layers(adapter, torch.ones(1, 5, dtype=torch.long), 1) == [False, True] * 3
    masks = step_masks(adapter, torch.ones(1, 5, dtype=torch.long), 1, torch.float32)
    assert [m is None for m in masks] == [False, True] * 3 and masks[0].shape == (1, 1, 1, 5)
    # the in-flight path always builds its per-row masks
    assert all(m is not None for m in step_masks(adapter, ones, 1, torch.float32, per_row=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_unmasked_decode_equals_the_masked_one(family, monkeypatch):
    """Equal-length prompts, full depth and skipping: the layers get no mask in decode steps,
    and tokens and logits equal those of the same run with the all-visible masks forced."""
    adapter = get_adapter(make_model(family))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    for plan in (None, policy):
        seen, hooks = _masks_seen(adapter)
        got = _decode(adapter, ids, mask, plan)
        for h in hooks:
            h.remove()
        prefill_calls = adapter.num_layers
        assert all(m is not None for m in seen[:prefill_calls])  # the prefill's causal mask
        assert seen[prefill_calls:] and all(m is None for m in seen[prefill_calls:])
        with monkeypatch.context() as m:
            m.setattr(forward, "unmasked_layers", lambda a, am, T: [False] * a.num_layers)
            want = _decode(adapter, ids, mask, plan)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_padded_and_windowed_steps_keep_their_masks():
    """Left padding, or a window shorter than the keys, still masks: every decode step's layers
    get a tensor (dropping it would let padding or out-of-window keys in)."""
    adapter = get_adapter(make_model("llama"))
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11, 12]], 0)
    seen, hooks = _masks_seen(adapter)
    _decode(adapter, ids, mask)
    assert all(m is not None for m in seen)
    seen.clear()
    adapter.layer_windows = (3,) * adapter.num_layers  # shorter than any step's keys
    _decode(adapter, torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long))
    for h in hooks:
        h.remove()
    assert all(m is not None for m in seen)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_unmasked_decode_with_eager_attention_equals_the_masked_one(family, monkeypatch):
    """HF's eager attention takes a None mask too (it adds none): same tokens and logits as the
    eager run with the all-visible masks forced."""
    model = make_model(family)
    model.config._attn_implementation = "eager"
    adapter = get_adapter(model)
    ids = torch.randint(5, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    got = _decode(adapter, ids, mask)
    with monkeypatch.context() as m:
        m.setattr(forward, "unmasked_layers", lambda a, am, T: [False] * a.num_layers)
        want = _decode(adapter, ids, mask)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)


def test_teacher_forcing_of_one_token_keeps_its_masks():
    """``layer_mask`` (teacher forcing, which reads each layer's mask) over a single position
    with nothing padded: the masks stay, and an all-True plan equals the plain forward (a
    one-token suffix of base-prefill training once crashed on a None mask)."""
    adapter = get_adapter(make_model("llama"))
    ids = torch.tensor([[5]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = forward.skip_forward(adapter, ids, mask)
        taught = forward.skip_forward(adapter, ids, mask, layer_mask=torch.ones(1, 1, adapter.num_layers, dtype=torch.bool))
    torch.testing.assert_close(taught, plain, rtol=0, atol=1e-6)


def test_mask_ab_benchmark_toggles_the_path_and_reports_both(tokenizer, tmp_path):
    """benchmarks/mask_ab.py: ``masks_kept`` puts the masks back and restores the shipped path;
    ``measure`` times every (prompt, policy) both ways; the long prompt comes from the data
    folder's CNN/DailyMail file, or the built-in text without it."""
    import json

    from conftest import load_benchmark
    from skipdecode.model import SkipModel

    ab = load_benchmark("mask_ab")
    sk = SkipModel(make_model("llama"), tokenizer)
    seen, hooks = _masks_seen(sk.adapter)
    for kept in (True, False):
        seen.clear()
        with ab.masks_kept(kept):
            sk.generate("The Eagle", max_new_tokens=3, chat=False)
        assert all((m is not None) == kept for m in seen[sk.adapter.num_layers:])  # the decode steps
    for h in hooks:
        h.remove()
    assert forward.unmasked_layers is unmasked_layers  # restored
    rows = ab.measure(sk, {"short": "The Eagle", "long": "The Eagle " * 20}, 2.0, 2, 4)
    assert {(r["prompt"], r["policy"], r["masks"]) for r in rows} == {
        (p, pol, m) for p in ("short", "long") for pol in ("full", "2x") for m in ("kept", "dropped")}
    assert all(len(r["step_ms_runs"]) == 2 for r in rows)
    assert next(r for r in rows if r["prompt"] == "long")["prompt_tokens"] > next(r for r in rows if r["prompt"] == "short")["prompt_tokens"]
    lines = ab.table(rows).splitlines()
    kept = next(r for r in rows if (r["prompt"], r["policy"], r["masks"]) == ("short", "full", "kept"))
    dropped = next(r for r in rows if (r["prompt"], r["policy"], r["masks"]) == ("short", "full", "dropped"))
    assert lines[2].endswith(f"| {dropped['step_ms'] / kept['step_ms']:.2f} |")
    assert ab.long_prompt(tmp_path, 1)[1] == "built-in text x 40"
    (tmp_path / "cnn_dailymail").mkdir()
    (tmp_path / "cnn_dailymail" / "cnndm_specbench80.jsonl").write_text(
        "\n".join(json.dumps({"article": f"Article {i} text.", "highlights": "h"}) for i in range(3)) + "\n")
    text, source = ab.long_prompt(tmp_path, 2)
    assert "Article 0 text." in text and "Article 1 text." in text and "Article 2" not in text
    assert source.endswith("first 2 article(s)")


def test_mixed_window_model_decodes_like_hf_without_padding():
    """Qwen2 with a window on its top layers (shorter than the generation): in each unpadded
    batch-1 step the windowed layers get their masks and the others none; tokens and logits
    equal stock HF ``generate``."""
    from transformers import Qwen2Config

    from conftest import model_from_config

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=True, sliding_window=4, max_window_layers=3)
    model = model_from_config(config, seed=5)
    adapter = get_adapter(model)
    assert adapter.layer_windows == (None, None, None, 4, 4, 4)
    ids = torch.randint(5, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    seen, hooks = _masks_seen(adapter)
    tokens, logits = _decode(adapter, ids, mask, n=8)
    for h in hooks:
        h.remove()
    step = seen[adapter.num_layers: 2 * adapter.num_layers]  # the first decode step's six layers
    assert [m is None for m in step] == [True, True, True, False, False, False]
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(tokens, hf.sequences[:, ids.shape[1]:])
    torch.testing.assert_close(logits, torch.stack(hf.logits, 1), rtol=0, atol=1e-5)
