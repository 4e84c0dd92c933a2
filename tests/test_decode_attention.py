"""Grouped single-query attention (skipdecode.decode_attention): the values of Hugging Face's SDPA
attention, the same tokens in every family, and what compiled decode steps trace."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import FAMILIES, left_pad, make_model
from skipdecode import decode_attention
from skipdecode.adapters import get_adapter
from skipdecode.compiled import compile_adapter
from skipdecode.decode_attention import NAME, grouped_decode_attention
from skipdecode.generate import generate_step
from skipdecode.policy import LinearDecayPolicy


class Heads(torch.nn.Module):
    """The attributes HF's attention functions read from the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(B, H, H_kv, T, K, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, T), (H_kv, K), (H_kv, K)))
    return q, k, v


def _masks(B, T, K, H):
    allowed = torch.ones(B, 1, T, K, dtype=torch.bool)
    allowed[0, :, :, :3] = False  # a left-padded row
    allowed[-1, :, :, 1] = False
    additive = torch.zeros(B, 1, T, K).masked_fill(~allowed, torch.finfo(torch.float32).min)
    per_head = additive.expand(B, H, T, K).clone()
    return {"none": None, "additive": additive, "bool": allowed, "per head": per_head}


@pytest.mark.parametrize("H, H_kv", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "bool", "per head"])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_one_query_equals_hf_sdpa(H, H_kv, mask_kind, scaling):
    B, K = 3, 11
    q, k, v = _inputs(B, H, H_kv, 1, K)
    mask = _masks(B, 1, K, H)[mask_kind]
    module = Heads(H // H_kv)
    got, weights = grouped_decode_attention(module, q, k, v, mask, scaling=scaling)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)
    assert weights is None and got.shape == want.shape == (B, 1, H, q.shape[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_several_queries_no_mask_and_dropout_are_hf_sdpa_exactly():
    q, k, v = _inputs(2, 6, 2, 4, 4)
    module = Heads(3)
    want, _ = sdpa_attention_forward(module, q, k, v, None)
    assert torch.equal(grouped_decode_attention(module, q, k, v, None)[0], want)  # a prefill
    q1 = q[:, :, -1:]
    want, _ = sdpa_attention_forward(module, q1, k, v, None)
    assert torch.equal(grouped_decode_attention(module, q1, k, v, None)[0], want)  # an unmasked step
    torch.manual_seed(0)
    want, _ = sdpa_attention_forward(module, q1, k, v, None, dropout=0.5)
    torch.manual_seed(0)
    assert torch.equal(grouped_decode_attention(module, q1, k, v, None, dropout=0.5)[0], want)


def _compiled_graphs(fn, *args):
    """Run ``fn(*args)`` under ``torch.compile`` (no inductor: the traced graph as is); returns
    its result and the set of op names of each graph traced."""
    torch._dynamo.reset()
    seen = []

    def recording(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward

    return torch.compile(fn, backend=recording, fullgraph=True)(*args), seen


@pytest.mark.parametrize("mask_kind", ["additive", "bool", "per head"])
def test_several_queries_in_a_compiled_graph_equal_hf_sdpa(mask_kind):
    """A compiled prefill (T queries per row, a padding mask) takes the grouped products, with
    SDPA's values; outside a compiled graph the same call is SDPA itself."""
    B, H, H_kv, T, K = 3, 9, 3, 5, 8
    q, k, v = _inputs(B, H, H_kv, T, K)
    mask = _masks(B, T, K, H)[mask_kind]
    module = Heads(H // H_kv)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    got, graphs = _compiled_graphs(lambda *a: grouped_decode_attention(module, *a)[0], q, k, v, mask)
    assert got.shape == want.shape == (B, T, H, q.shape[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert len(graphs) == 1 and not any("scaled_dot_product" in x for x in graphs[0])
    assert torch.equal(grouped_decode_attention(module, q, k, v, mask)[0], want)  # eager: SDPA


def test_several_queries_beyond_max_scores_stay_on_sdpa(monkeypatch):
    """A prefill with more than MAX_SCORES scores per head (a long prompt) keeps SDPA's kernel,
    which never holds the whole (T, K) matrix, even compiled."""
    B, H, H_kv, T, K = 2, 4, 2, 4, 6
    q, k, v = _inputs(B, H, H_kv, T, K)
    mask = _masks(B, T, K, H)["additive"]
    module = Heads(2)
    monkeypatch.setattr(decode_attention, "MAX_SCORES", T * K - 1)
    got, graphs = _compiled_graphs(lambda *a: grouped_decode_attention(module, *a)[0], q, k, v, mask)
    assert any("scaled_dot_product" in x for x in graphs[0])
    torch.testing.assert_close(got, sdpa_attention_forward(module, q, k, v, mask)[0], rtol=0, atol=1e-6)
    monkeypatch.setattr(decode_attention, "MAX_SCORES", T * K)  # at the limit: grouped
    _, graphs = _compiled_graphs(lambda *a: grouped_decode_attention(module, *a)[0], q, k, v, mask)
    assert not any("scaled_dot_product" in x for x in graphs[0])


def test_enable_switches_only_sdpa_models_and_disable_restores(tmp_path):
    model = make_model("llama")
    assert decode_attention.enable(model) and model.config._attn_implementation == NAME
    assert not decode_attention.enable(model)  # already on
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()  # a saved model does not need it
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    assert decode_attention.disable(model) and model.config._attn_implementation == "sdpa"
    assert not decode_attention.disable(model)
    eager = make_model("llama")
    eager.set_attn_implementation("eager")
    assert not decode_attention.enable(eager) and eager.config._attn_implementation == "eager"


def _padded_run(model, policy):
    adapter = get_adapter(model)
    g = torch.Generator().manual_seed(3)
    ids, mask = left_pad([torch.randint(5, 300, (n,), generator=g).tolist() for n in (7, 3, 5)],
                         model.config.pad_token_id or 0)
    outs = list(generate_step(adapter, ids, mask, policy=policy, max_new_tokens=6))
    return torch.stack([o.logits for o in outs]), torch.stack([o.tokens for o in outs])


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_attention_gives_sdpa_tokens_in_every_family(family):
    """A left-padded batch (masks in every decode step), full depth and skipping: same greedy
    tokens, logits to 1e-5, with the model switched and without."""
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    for plan in (None, policy):
        want_logits, want_tokens = _padded_run(make_model(family), plan)
        model = make_model(family)
        assert decode_attention.enable(model)
        logits, tokens = _padded_run(model, plan)
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)


def test_compiled_decode_steps_trace_the_grouped_products_not_sdpa():
    """compile=True switches the model; decode-step graphs, and the compiled prefill's of short
    prompts, then hold no SDPA call, and the report says so."""
    seen = []

    def recording(gm, example_inputs):
        seen.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward

    torch._dynamo.reset()
    model = make_model("llama")
    adapter = get_adapter(model)
    report = compile_adapter(adapter, backend=recording)
    assert report.grouped_attention and model.config._attn_implementation == NAME
    ids, mask = left_pad([[5, 6, 7, 8, 9], [10, 11]], 0)
    list(generate_step(adapter, ids, mask, max_new_tokens=4))
    assert report.enabled, report.error
    decode = [t for t in seen if any("softmax" in x or "amax" in x for x in t)]  # (compiled: _softmax)
    assert decode and not any(any("scaled_dot_product" in x for x in t) for t in decode)


def test_compiled_decode_attention_past_4096_keys_compiles_nothing_new():
    """Compiled with inductor (its C++ code) and the key length symbolic, one query per row over
    100 keys and then over 5000 run the same graph, with SDPA's values (1e-5): inductor's code for
    a float32 sum switches to a chunked accumulator above 4096 elements and guarded the key length
    on it, so the first decode step past 4096 keys recompiled every variant mid-serving; the
    softmax's sum now runs in float64 while compiling (decode_attention._softmax)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = Heads(3)
    fn = torch.compile(lambda q, k, v, m: grouped_decode_attention(module, q, k, v, m)[0], backend="inductor")
    for K in (100, 5000):
        q, k, v = _inputs(2, 9, 3, 1, K, D=16)
        mask = torch.zeros(2, 1, 1, K)
        mask[0, :, :, :7] = torch.finfo(torch.float32).min  # a left-padded row
        for t in (k, v, mask):
            torch._dynamo.maybe_mark_dynamic(t, t.dim() - 1 if t is mask else 2)
        got = fn(q, k, v, mask)
        want, _ = sdpa_attention_forward(module, q, k, v, mask)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
