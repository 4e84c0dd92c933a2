"""CALM-style early-exit baseline (skipdecode.calm) on tiny random models."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from skipdecode.cache import SkipCache
from skipdecode.calm import CalmConfig, CalmResult, calm_generate, calm_generate_ids
from skipdecode.forward import skip_forward
from skipdecode.generate import encode_prompts, generate
from skipdecode.model import SkipModel

PROMPT = "name[The Eagle], eatType[coffee shop]"
N_NEW = 12



@pytest.fixture(scope="module")
def models(tokenizer):
    return {fam: SkipModel(make_model(fam, 6), tokenizer, chat=False) for fam in ("llama", "opt", "gpt2")}


@pytest.mark.parametrize("fam", ["llama", "opt", "gpt2"])
@pytest.mark.parametrize("threshold", [1.0])
def test_threshold_one_reproduces_full_depth_greedy(models, fam, threshold):
    sk = models[fam]
    ref = generate(sk.adapter, sk.tokenizer, [PROMPT], max_new_tokens=N_NEW, eos_token_ids=[])
    res = calm_generate(sk, PROMPT, threshold=threshold, max_new_tokens=N_NEW, eos_token_ids=[])
    assert isinstance(res, CalmResult)
    assert res.token_ids == ref.token_ids
    assert res.texts == ref.texts
    assert res.exit_layers == [6] * (N_NEW - 1)
    assert res.layers_run == res.exit_layers
    assert res.head_evals == [0] * (N_NEW - 1)  # no confidence head is ever evaluated
    assert res.theoretical_speedup == 1.0
    assert res.policy == {"type": "calm", "threshold": float(threshold), "min_layers": 1}


@pytest.mark.parametrize("min_layers", [1, 3])
def test_threshold_zero_exits_at_min_layers_and_fills_every_layer_cache(models, min_layers):
    sk = models["llama"]
    ids, mask = encode_prompts(sk.tokenizer, [PROMPT])
    cache = SkipCache(6)
    out = calm_generate_ids(sk.adapter, ids, mask, CalmConfig(0.0, min_layers), max_new_tokens=N_NEW, cache=cache)
    assert out["exit_layers"] == [min_layers] * (N_NEW - 1)
    assert out["compute_layers"] == [6] * (N_NEW - 1)  # propagation runs the upper layers
    assert out["head_evals"] == [1] * (N_NEW - 1)
    # every layer holds the prompt plus every fed token: the propagated K/V are in place
    assert cache.lengths == [ids.shape[1] + N_NEW - 1] * 6
    res = calm_generate(sk, PROMPT, threshold=0.0, min_layers=min_layers, max_new_tokens=N_NEW, eos_token_ids=[])
    assert res.theoretical_speedup == pytest.approx(6 / min_layers)
    assert res.compute_speedup == 1.0
    assert res.stats()["head_evals"] == N_NEW - 1


def _teacher_forced_tokens(sk, prompt_ids, generated, exit_layers):
    """Argmax tokens of a cache-free forward where each generated position keeps its exit state.

    Under the masked residual update of skip_forward(layer_mask=...), a position whose layer l is
    inactive keeps h_{l-1} and layer l's K/V at that position are computed from it, i.e. from
    the exit state: exactly CALM's state propagation. Logits of a position then come from its
    exit state through the model's head, as CALM's exit does.
    """
    L = sk.num_layers
    full = torch.cat([prompt_ids, torch.tensor([generated[:-1]])], dim=1)
    P = prompt_ids.shape[1]
    layer_mask = torch.ones((1, full.shape[1], L), dtype=torch.bool)
    for i, e in enumerate(exit_layers):  # generated token i is fed at decode step i + 1
        layer_mask[0, P + i, e:] = False
    with torch.inference_mode():
        logits = skip_forward(sk.adapter, full, torch.ones_like(full), layer_mask=layer_mask)
    return logits[0, P - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_mixed_exits_match_state_propagation_reference(models, fam):
    sk = models[fam]
    res = calm_generate(sk, PROMPT, threshold=0.006, min_layers=2, max_new_tokens=N_NEW, eos_token_ids=[])
    exits = res.exit_layers
    assert len(set(exits)) > 1, exits
    # a later token runs deeper than an earlier one: it reads propagated K/V
    assert any(exits[j] > exits[i] for i in range(len(exits)) for j in range(i + 1, len(exits))), exits
    prompt_ids, _ = encode_prompts(sk.tokenizer, [PROMPT])
    assert _teacher_forced_tokens(sk, prompt_ids, res.token_ids[0], exits) == res.token_ids[0]


def test_batch_larger_than_one_raises(models):
    sk = models["llama"]
    with pytest.raises(ValueError, match="batch size 1 only.*SkipDecode"):
        calm_generate(sk, [PROMPT, PROMPT + " area[riverside]"], threshold=0.5)
    ids, mask = encode_prompts(sk.tokenizer, [PROMPT, PROMPT])
    with pytest.raises(ValueError, match="batch size 1 only"):
        calm_generate_ids(sk.adapter, ids, mask, CalmConfig(0.5))


def test_stop_strings_and_eos(models, tokenizer):
    sk = models["llama"]
    free = calm_generate(sk, PROMPT, threshold=1.0, max_new_tokens=N_NEW, eos_token_ids=[])
    text = free.texts[0]
    assert len(text) > 2
    stop = text[len(text) // 2 :][:2]
    cut = calm_generate(sk, PROMPT, threshold=1.0, max_new_tokens=N_NEW, eos_token_ids=[], stop=[stop])
    assert cut.finish_reasons == ["stop"]
    assert cut.texts[0] == text[: text.find(stop)]
    first = free.token_ids[0][2]
    eos = calm_generate(sk, PROMPT, threshold=1.0, max_new_tokens=N_NEW, eos_token_ids=[first])
    assert eos.finish_reasons == ["eos"]
    assert eos.token_ids[0][-1] == first and len(eos.token_ids[0]) <= 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(threshold=1.5), r"threshold must be a number in \[0, 1\]"),  # a margin never exceeds 1
        (dict(threshold=2), r"threshold must be a number in \[0, 1\]"),
        (dict(threshold=float("inf")), "threshold"),
        (dict(threshold=0.5, stop=["a", ""]), r"^stop: .*empty"),
        (dict(threshold=0.5, stop=list("abcde")), r"^stop: at most 4"),
        (dict(threshold=0.5, min_layers=0), "min_layers"),
        (dict(threshold=0.5, min_layers=7), "min_layers"),
        (dict(threshold=0.5, max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_invalid_arguments(models, kwargs, match):
    with pytest.raises(ValueError, match=match):
        calm_generate(models["llama"], PROMPT, **kwargs)
