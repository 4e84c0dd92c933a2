"""Per-layer attention settings (issue 13 item 1): each layer gets its own window, as HF does.

Qwen2 and Qwen3 derive ``config.layer_types`` from ``use_sliding_window``/``max_window_layers``
(or take it as given); SmolLM3 makes its NoPE layers the sliding ones. HF builds one mask per
layer type and gives each layer the mask of its type; Mistral has no ``layer_types`` and applies
its one window to every layer. The contract (docs/correctness.md pitfall 2): at full depth our layer loop equals
the unmodified HF model in logits and greedy tokens, for every family with per-layer types, with
windows shorter than the sequences so that a wrong window changes the answer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config, SmolLM3Config

from conftest import VOCAB, left_pad, model_from_config
from skipdecode import LinearDecayPolicy, UnsupportedArchitectureError, generate_step, get_adapter
from skipdecode.forward import layer_attention_masks, skip_forward

NUM_LAYERS = 6
WINDOW = 4
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)

# name -> (config, the window HF gives each layer)
CASES = {
    # the example: layers >= max_window_layers slide
    "qwen2_max_window_layers": (
        lambda: Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3, **TINY),
        (None, None, None, WINDOW, WINDOW, WINDOW),
    ),
    "qwen2_layer_types": (
        lambda: Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 3, **TINY,
        ),
        (WINDOW, None) * 3,
    ),
    # use_sliding_window=False: no window anywhere, whatever sliding_window says
    "qwen2_window_off": (
        lambda: Qwen2Config(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0, **TINY),
        (None,) * NUM_LAYERS,
    ),
    "qwen3_max_window_layers": (
        lambda: Qwen3Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, head_dim=8, **TINY),
        (None, None, WINDOW, WINDOW, WINDOW, WINDOW),
    ),
    # SmolLM3: every 2nd layer is NoPE and, with use_sliding_window, slides
    "smollm3_nope_sliding": (
        lambda: SmolLM3Config(use_sliding_window=True, sliding_window=WINDOW, no_rope_layer_interval=2, **TINY),
        (None, WINDOW) * 3,
    ),
    # Mistral: one window for every layer (it has no layer_types)
    "mistral_window": (
        lambda: MistralConfig(sliding_window=WINDOW, **TINY),
        (WINDOW,) * NUM_LAYERS,
    ),
}


def build(name: str):
    make, windows = CASES[name]
    return model_from_config(make(), seed=5), windows


def prompts(lengths=(11, 6, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(CASES))
def test_adapter_gives_each_layer_hf_window(name):
    model, windows = build(name)
    assert get_adapter(model).layer_windows == windows


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_depth_equals_hf_with_per_layer_windows(name):
    """Forward over a padded batch and greedy generation past the window == stock HF."""
    model, _ = build(name)
    adapter = get_adapter(model)
    ids, mask = left_pad(prompts(), 0)
    with torch.no_grad():
        ours = skip_forward(adapter, ids, mask)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], rtol=0, atol=1e-5)

    steps = list(generate_step(adapter, ids, mask, max_new_tokens=8, eos_token_ids=(), pad_token_id=0))
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(torch.stack([s.tokens for s in steps], 1), hf.sequences[:, ids.shape[1]:])
    torch.testing.assert_close(torch.stack([s.logits for s in steps], 1), torch.stack(hf.logits, 1),
                               rtol=0, atol=1e-5)


def test_windows_change_the_answer():
    """The cases above are sensitive: giving every layer of the Qwen2 example the window (the
    fault of issue 13 item 1) moves the logits far beyond the test's tolerance."""
    model, _ = build("qwen2_max_window_layers")
    adapter = get_adapter(model)
    ids, mask = left_pad(prompts(), 0)
    with torch.no_grad():
        right = skip_forward(adapter, ids, mask)
        adapter.layer_windows = (WINDOW,) * NUM_LAYERS
        wrong = skip_forward(adapter, ids, mask)
    assert (right - wrong)[mask.bool()].abs().max() > 1e-2


def test_skipped_decode_equals_recomputation_with_per_layer_windows():
    """Under skipping, cached decode == teacher-forced recomputation: both paths pick each
    layer's own mask (the sliding layers are the top ones, which run at every step)."""
    model, _ = build("qwen2_max_window_layers")
    adapter = get_adapter(model)
    policy = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    ids, mask = left_pad(prompts(), 0)
    n = 8
    steps = list(generate_step(adapter, ids, mask, policy=policy, max_new_tokens=n, eos_token_ids=(), pad_token_id=0))
    generated = torch.stack([s.tokens for s in steps], 1)
    B, P = ids.shape
    full_ids = torch.cat([ids, generated[:, :-1]], dim=1)
    full_mask = torch.cat([mask, torch.ones((B, n - 1), dtype=mask.dtype)], dim=1)
    layer_mask = torch.ones((B, P + n - 1, NUM_LAYERS), dtype=torch.bool)
    for i in range(n - 1):
        plan = torch.zeros(NUM_LAYERS, dtype=torch.bool)
        plan[list(policy.active_layers(i + 1))] = True
        layer_mask[:, P + i] = plan
    with torch.no_grad():
        ref = skip_forward(adapter, full_ids, full_mask, layer_mask=layer_mask)[:, P - 1:]
    torch.testing.assert_close(torch.stack([s.logits for s in steps], 1), ref, rtol=0, atol=1e-4)


def test_layer_attention_masks_share_one_tensor_per_window():
    model, _ = build("qwen2_max_window_layers")
    adapter = get_adapter(model)
    _, mask = left_pad(prompts(), 0)
    masks = layer_attention_masks(adapter, mask, 3, torch.float32)
    assert len(masks) == NUM_LAYERS
    assert masks[0] is masks[1] is masks[2] and masks[3] is masks[4] is masks[5]
    assert not torch.equal(masks[0], masks[3])


def test_unknown_layer_type_is_refused():
    """A layer type the layer loop cannot mask (e.g. chunked or linear attention) is a clear
    error naming the type, never a silently wrong mask."""
    cfg = Qwen2Config(layer_types=["full_attention"] * 5 + ["chunked_attention"], **TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(UnsupportedArchitectureError, match="chunked_attention"):
        get_adapter(model)


def test_calm_baseline_uses_each_layers_window():
    """The CALM baseline's own token loop picks each layer's mask too: at full depth (threshold
    1: never exit) it reproduces HF greedy decoding of a Qwen2 with per-layer windows."""
    from skipdecode.calm import CalmConfig, calm_generate_ids

    model, _ = build("qwen2_max_window_layers")
    adapter = get_adapter(model)
    ids = torch.tensor(prompts((11,)))
    mask = torch.ones_like(ids)
    out = calm_generate_ids(adapter, ids, mask, CalmConfig(threshold=1.0), max_new_tokens=8)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert out["token_ids"] == hf[0, ids.shape[1]:].tolist()
