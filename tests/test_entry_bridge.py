"""Entry bridges (:mod:`skipdecode.entry_bridge`, a project extension): an affine map per entry
layer, applied where a token's plan jumps from the warm-up block to its first top layer.

The three plan forms of :func:`skip_forward` (one plan with a KV cache, per-position masks in
teacher forcing, per-row plans in flight) must apply it to exactly the jumping positions and
agree with a decode step built by hand from the adapter's primitives; full-depth passes never
jump, so they still equal the unmodified model; the least-squares fit recovers a known map."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model

from skipdecode.adapters import get_adapter
from skipdecode.cache import SkipCache
from skipdecode.entry_bridge import EntryBridge, attach_entry_bridge, entry_bridge_of, fit_entry_bridge
from skipdecode.forward import skip_forward
from skipdecode.policy import LinearDecayPolicy

L = 6
POLICY = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


def _bridge(hidden: int, source: int = 0, seed: int = 0) -> EntryBridge:
    g = torch.Generator().manual_seed(seed)
    targets = list(range(source + 2, L))
    n = len(targets)
    weight = torch.eye(hidden).expand(n, hidden, hidden) + 0.3 * torch.randn(n, hidden, hidden, generator=g) / hidden ** 0.5
    bias = 0.5 * torch.randn(n, hidden, generator=g)
    return EntryBridge(hidden, source, targets, weight, bias)


def _model(family: str):
    torch.manual_seed(0)
    model = make_model(family, num_layers=L)
    return model, get_adapter(model)


def _hand_step(adapter, bridge, tok: int, K: int, cache: SkipCache, active: list[int]) -> torch.Tensor:
    """One decode step from the adapter's primitives: warm-up layers, W h + b, top layers, head."""
    ids = torch.tensor([[tok]])
    mask = torch.ones(1, K, dtype=torch.long)
    pos = torch.tensor([[K - 1]])
    from skipdecode.forward import layer_attention_masks

    masks = layer_attention_masks(adapter, mask, 1, torch.float32)
    h = adapter.embed(ids, pos)
    extra = adapter.layer_inputs(h, pos)
    prev = -1
    for l in active:
        if l > prev + 1 and prev == bridge.source:
            h = h @ bridge.weight[bridge.targets.index(l)].T + bridge.bias[bridge.targets.index(l)]
        h = adapter.run_layer(l, h, masks[l], cache, extra)
        prev = l
    return adapter.head(h)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cached_decode_applies_the_bridge_exactly_where_the_plan_jumps(family):
    model, adapter = _model(family)
    bridge = _bridge(model.config.hidden_size)
    prompt, resp = [5, 9, 3, 17, 4], [8, 2, 11, 6, 7, 12]
    ids = torch.tensor([prompt])
    # reference without the bridge attached; the bridge only changes skipped decode steps
    plain = skip_forward(adapter, ids, torch.ones_like(ids), cache=SkipCache(L))
    attach_entry_bridge(model, bridge)
    assert entry_bridge_of(model) is bridge
    cache, hand_cache = SkipCache(L), SkipCache(L)
    pre = skip_forward(adapter, ids, torch.ones_like(ids), cache=cache)
    skip_forward(adapter, ids, torch.ones_like(ids), cache=hand_cache)
    assert torch.equal(pre, plain)  # full depth: no jump, no change
    changed = 0
    for i, tok in enumerate(resp):
        K = len(prompt) + i + 1
        active = list(POLICY.active_layers(i + 1))
        got = skip_forward(adapter, torch.tensor([[tok]]), torch.ones(1, K, dtype=torch.long),
                           active_layers=active, cache=cache)
        want = _hand_step(adapter, bridge, tok, K, hand_cache, active)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        changed += 1
    attach_entry_bridge(model, None)
    assert entry_bridge_of(model) is None and changed == len(resp)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_teacher_forcing_and_in_flight_rows_match_cached_decoding_with_a_bridge(family):
    from skipdecode.train import build_layer_mask

    model, adapter = _model(family)
    attach_entry_bridge(model, _bridge(model.config.hidden_size, seed=1))
    prompt, resp = [5, 9, 3, 17, 4], [8, 2, 11, 6, 7, 12]
    seq = torch.tensor([prompt + resp])
    P, S = len(prompt), len(prompt) + len(resp)
    lm = build_layer_mask(POLICY, torch.tensor([P]), torch.tensor([S]), S, L)
    for sparse in (True, False):
        tf = skip_forward(adapter, seq, torch.ones_like(seq), layer_mask=lm, sparse=sparse)
        cache = SkipCache(L)
        dec = [skip_forward(adapter, seq[:, :P], torch.ones(1, P, dtype=torch.long), cache=cache)[:, -1]]
        for i, tok in enumerate(resp[:-1]):
            K = P + i + 1
            dec.append(skip_forward(adapter, torch.tensor([[tok]]), torch.ones(1, K, dtype=torch.long),
                                    active_layers=list(POLICY.active_layers(i + 1)), cache=cache)[:, -1])
        torch.testing.assert_close(tf[0, P - 1:S - 1], torch.cat(dec), atol=1e-4, rtol=1e-4)


def test_identity_bridge_changes_nothing_and_a_real_one_does():
    model, adapter = _model("llama")
    C = model.config.hidden_size
    prompt, resp = [5, 9, 3, 17, 4], [8, 2, 11, 6]
    seq = torch.tensor([prompt + resp])
    P, S = len(prompt), len(seq[0])
    from skipdecode.train import build_layer_mask

    lm = build_layer_mask(POLICY, torch.tensor([P]), torch.tensor([S]), S, L)
    plain = skip_forward(adapter, seq, torch.ones_like(seq), layer_mask=lm)
    attach_entry_bridge(model, EntryBridge(C, 0, list(range(2, L))))
    torch.testing.assert_close(skip_forward(adapter, seq, torch.ones_like(seq), layer_mask=lm), plain,
                               atol=1e-6, rtol=1e-6)
    attach_entry_bridge(model, _bridge(C))
    bridged = skip_forward(adapter, seq, torch.ones_like(seq), layer_mask=lm)
    assert torch.equal(bridged[0, :P], plain[0, :P])  # the prompt runs every layer: no jump
    assert (bridged[0, P:] - plain[0, P:]).abs().max() > 1e-2  # decode positions jump


def test_fit_recovers_a_known_affine_map():
    g = torch.Generator().manual_seed(0)
    C, N = 8, 400
    x = torch.randn(N, C, generator=g)
    A, b = torch.randn(C, C, generator=g), torch.randn(C, generator=g)
    layers = [torch.randn(N, C, generator=g), x, torch.randn(N, C, generator=g), x @ A.T + b]  # inputs of layers 0..3
    chunks = [tuple(h[:200] for h in layers), tuple(h[200:] for h in layers)]
    bridge, rel = fit_entry_bridge(chunks, source=0, targets=[3], ridge=0.0)
    torch.testing.assert_close(bridge.weight[0], A, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bridge.bias[0], b, atol=1e-4, rtol=1e-4)
    assert rel[3] < 1e-8
    _, rel_noisy = fit_entry_bridge(chunks, source=0, targets=[2], ridge=0.0)
    assert rel_noisy[2] > 0.9  # unrelated target: nothing to explain


@pytest.mark.parametrize("bad", [dict(targets=[]), dict(targets=[1]), dict(targets=[4, 3]),
                                 dict(weight=torch.zeros(2, 4, 4))])
def test_bad_bridges_are_refused(bad):
    kw = {"targets": [2, 3], **bad}
    with pytest.raises(ValueError, match="entry bridge"):
        EntryBridge(8, 0, kw.pop("targets"), **kw)


def test_saved_dtypes_round_trip(tmp_path):
    bridge = _bridge(16)
    for dtype, tol in ((torch.float32, 0.0), (torch.float16, 2e-3), (torch.int8, None)):
        d = tmp_path / str(dtype)
        d.mkdir()
        bridge.save(d, dtype=dtype)
        got = EntryBridge.load(d)
        assert got.targets == bridge.targets and got.source == bridge.source and got.weight.dtype == torch.float32
        if tol is None:  # per-row int8: within half a quantization step of each row
            step = bridge.weight.abs().amax(-1, keepdim=True) / 127
            assert bool(((got.weight - bridge.weight).abs() <= step / 2 + 1e-6).all())
        else:
            torch.testing.assert_close(got.weight, bridge.weight, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="dtype"):
        bridge.save(tmp_path, dtype=torch.int32)
