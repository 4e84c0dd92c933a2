"""Sparse teacher forcing (each layer runs only on the prefix of positions that need it) equals the
masked reference in logits and gradients, for every family, warm-up, padding side and mixed
policies; and a layer really receives only that prefix. Tiny random models, float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import FAMILIES, make_model

from skipdecode.adapters import get_adapter
from skipdecode.forward import skip_forward
from skipdecode.policy import LinearDecayPolicy
from skipdecode.train import Batch, TokenizedExample, build_layer_mask, collate

L = 6


def _policy(warmup: int, max_layers: int = 5, min_layers: int = 2) -> LinearDecayPolicy:
    return LinearDecayPolicy(num_layers=L, max_layers=max_layers, min_layers=min_layers, warmup_layers=warmup,
                             horizon=4)


def _batch(seed: int = 0) -> Batch:
    """Three rows of different prompt and response lengths (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (3, 2), (8, 9)]  # (prompt tokens, response tokens)
    items = [TokenizedExample(tuple(torch.randint(5, 300, (p,), generator=g).tolist()),
                              tuple(torch.randint(5, 300, (r,), generator=g).tolist())) for p, r in shapes]
    return collate(items, pad_token_id=0)


def _to_left_padding(batch: Batch, layer_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same rows left-padded: ids (B, T), attention mask (B, T), layer mask (B, T, L)."""
    ids, am, lm = batch.input_ids.clone(), batch.attention_mask.clone(), layer_mask.clone()
    T = ids.shape[1]
    for b, s in enumerate(batch.seq_lens.tolist()):
        shift = T - s
        ids[b], am[b], lm[b] = ids[b].roll(shift), am[b].roll(shift), lm[b].roll(shift, dims=0)
    return ids, am, lm


def _logits_and_grads(model, ids, am, lm, sparse: bool):
    adapter = get_adapter(model)
    model.zero_grad(set_to_none=True)
    logits = skip_forward(adapter, ids, am, layer_mask=lm, sparse=sparse)
    real = am.bool()
    labels = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    loss = F.cross_entropy(logits[real].float(), labels[real])
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return logits.detach(), {n: g for (n, _), g in zip(model.named_parameters(), grads)}, real


def _assert_same(model, ids, am, lm):
    logits_m, grads_m, real = _logits_and_grads(model, ids, am, lm, sparse=False)
    logits_s, grads_s, _ = _logits_and_grads(model, ids, am, lm, sparse=True)
    torch.testing.assert_close(logits_s[real], logits_m[real], rtol=0, atol=1e-5)
    assert grads_s.keys() == grads_m.keys()
    nonzero = 0
    for name in grads_m:
        gm, gs = grads_m[name], grads_s[name]
        if gm is None:
            assert gs is None or not gs.any(), name
            continue
        torch.testing.assert_close(gs, gm, rtol=0, atol=1e-5, msg=name)
        nonzero += int(gm.abs().max() > 0)
    assert nonzero > 5  # the comparison is not vacuous


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("warmup", [0, 1, 2])
def test_sparse_equals_masked_logits_and_gradients(family, warmup):
    model = make_model(family, num_layers=L)
    batch = _batch()
    T = batch.input_ids.shape[1]
    lm = build_layer_mask(_policy(warmup, 5, warmup + 1), batch.prompt_lens, batch.seq_lens, T, L)
    _assert_same(model, batch.input_ids, batch.attention_mask, lm)  # right padding
    _assert_same(model, *_to_left_padding(batch, lm))  # left padding


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_sparse_equals_masked_with_mixed_policies_in_one_batch(family):
    """Rows trained under different policies in one batch (several speedups at once)."""
    model = make_model(family, num_layers=L)
    batch = _batch(seed=1)
    T = batch.input_ids.shape[1]
    policies = [_policy(1, 6, 6), _policy(0, 3, 1), _policy(2, 5, 3)]  # full depth, aggressive, mild
    lm = torch.stack([build_layer_mask(p, batch.prompt_lens[b:b + 1], batch.seq_lens[b:b + 1], T, L)[0]
                      for b, p in enumerate(policies)])
    _assert_same(model, batch.input_ids, batch.attention_mask, lm)
    _assert_same(model, *_to_left_padding(batch, lm))


def _expected_prefix(policy, batch: Batch) -> list[int]:
    """Per layer: the longest (prompt + response positions running it) over the rows."""
    out = []
    for layer in range(L):
        best = 0
        for P, S in zip(batch.prompt_lens.tolist(), batch.seq_lens.tolist()):
            run = [i for i in range(S - P) if layer in policy.active_layers(i + 1)]
            assert run == list(range(len(run)))  # monotone: a prefix of the response
            best = max(best, P + len(run))
        out.append(best)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_layer_receives_only_the_prefix_it_needs(family):
    model = make_model(family, num_layers=L)
    adapter = get_adapter(model)
    batch = _batch()
    T = batch.input_ids.shape[1]
    policy = _policy(1, max_layers=5, min_layers=2)
    lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, T, L)
    seen: dict[int, list[int]] = {i: [] for i in range(L)}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0].shape[1]))
             for i, layer in enumerate(adapter.layers)]
    try:
        skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=lm)
        sparse = {i: v[-1] for i, v in seen.items()}
        skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=lm, sparse=False)
        masked = {i: v[-1] for i, v in seen.items()}
    finally:
        for h in hooks:
            h.remove()
    expected = _expected_prefix(policy, batch)
    assert [sparse[i] for i in range(L)] == expected
    assert min(expected) < T  # the schedule really shortens some layers here
    assert all(masked[i] == T for i in range(L))


def test_train_sparse_and_masked_reach_the_same_weights(tmp_path):
    """TrainConfig.teacher_forcing selects the path; both train to the same weights (1e-5)."""
    from test_train import cfg, examples, tiny_skipmodel, weights

    from skipdecode.train import TrainConfigError, train

    runs = {}
    for mode in ("sparse", "masked"):
        sk = tiny_skipmodel()
        train(sk, examples(), cfg(tmp_path / mode, max_steps=2, speedup=3.0, teacher_forcing=mode))
        runs[mode] = weights(sk.model)
    fresh = weights(tiny_skipmodel().model)
    assert any((runs["sparse"][k] != fresh[k]).any() for k in fresh)
    for k in runs["masked"]:
        torch.testing.assert_close(runs["sparse"][k], runs["masked"][k], rtol=0, atol=1e-5, msg=k)
    with pytest.raises(TrainConfigError) as info:
        cfg(tmp_path / "x", teacher_forcing="dense")
    assert info.value.field == "teacher_forcing"


def test_sparse_equals_masked_with_a_sliding_window():
    """The attention mask is sliced with the hidden states: a window (Mistral) stays exact."""
    from transformers import AutoModelForCausalLM

    from conftest import make_config

    config = make_config("mistral", L)
    config.sliding_window = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert set(get_adapter(model).layer_windows) == {4}
    batch = _batch(seed=2)
    lm = build_layer_mask(_policy(1), batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1], L)
    _assert_same(model, batch.input_ids, batch.attention_mask, lm)
