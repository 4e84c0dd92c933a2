"""Fused sibling projections (skipdecode.fused_linear): q/k/v and gate/up of a quantized layer as
one product each.

The quantized schemes are per output row, so the fused layer must equal the unfused quantized
layer exactly (same codes, scales and arithmetic per column); measured: max |logits diff| = 0.0
over the 7 families and 3 modes. The tests check equality, that a group runs its product once
per layer call (eagerly and inside a compiled graph), and that the fused linear is held once.
"""

from __future__ import annotations

import copy

import pytest
import torch

from skipdecode import int4pack
from skipdecode.compiled import compile_adapter, warm_up
from skipdecode.fused_linear import FUSED_GROUPS, FusedSlice, fuse_siblings
from skipdecode.generate import encode_prompts, generate_step
from skipdecode.model import SkipModel
from skipdecode.quantize import Int4Linear, Int8Linear, quantize_model, resident_bytes
from skipdecode.w8a8 import fbgemm_available

from conftest import make_model

MODES = ["int8", "int4"] + (["w8a8"] if fbgemm_available()[0] else [])
needs_kernel = pytest.mark.skipif(not int4pack.kernel_available()[0], reason=int4pack.kernel_available()[1])
#: fused groups per decoder layer: attention q/k/v everywhere but GPT-2 (c_attn is fused already),
#: MLP gate/up in the Llama-style families
GROUPS_PER_LAYER = {"llama": 2, "mistral": 2, "qwen2": 2, "opt": 1, "opt_postln": 1, "opt_proj": 1, "gpt2": 0}


def _pair(family: str, mode: str, num_layers: int = 6):
    model = make_model(family, num_layers)
    return quantize_model(copy.deepcopy(model), mode, fuse=False), quantize_model(model, mode)


@pytest.mark.parametrize("mode", MODES)
def test_fused_model_equals_unfused(family, mode, tokenizer):
    """Prefill logits of every family and mode equal the unfused quantized model's exactly, and
    the greedy decode (cached steps, one token per row) gives the same logits and tokens."""
    torch.manual_seed(3)
    plain, fused = _pair(family, mode)
    members = [m for m in fused.modules() if isinstance(m, FusedSlice)]
    assert len(members) == 6 * {2: 5, 1: 3, 0: 0}[GROUPS_PER_LAYER[family]]
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, fused(ids).logits)
    tok = tokenizer
    a, b = SkipModel(plain, tok), SkipModel(fused, tok)
    x, mask = encode_prompts(tok, ["The Eagle is a", "Summarize the article. The quick"])
    policy = a.policy_for(speedup=2.0, horizon=6)
    for p in (None, policy):
        oa = list(generate_step(a.adapter, x, mask, policy=p, max_new_tokens=6))
        ob = list(generate_step(b.adapter, x, mask, policy=p, max_new_tokens=6))
        assert torch.equal(torch.stack([o.tokens for o in oa]), torch.stack([o.tokens for o in ob]))
        assert torch.equal(torch.stack([o.logits for o in oa]), torch.stack([o.logits for o in ob]))


def _fused_linears(model) -> list[torch.nn.Module]:
    return [m.fused for m in model.modules() if isinstance(m, FusedSlice) and hasattr(m, "fused")]


@pytest.mark.parametrize("mode", MODES)
def test_each_group_runs_its_product_once_per_layer_call(mode):
    """Forward hooks on the fused linears: one call per group per layer call (the siblings take
    their columns of the product the first member computed)."""
    model = quantize_model(make_model("llama", 3), mode)
    linears = _fused_linears(model)
    assert len(linears) == 3 * len(FUSED_GROUPS)
    calls = []
    for lin in linears:
        lin.register_forward_hook(lambda mod, inp, out: calls.append(mod))
    with torch.no_grad():
        model(torch.randint(3, 300, (2, 5)))
    assert len(calls) == len(linears) and {id(m) for m in calls} == {id(m) for m in linears}
    # and nothing is held after the group's last member took its columns
    assert all(m.group.held is None for m in model.modules() if isinstance(m, FusedSlice))


def test_member_with_another_or_modified_input_computes_its_own_columns():
    """A member called with a different tensor, or with the same tensor changed in place since
    the first member's call, returns its columns of the product of its own input."""
    torch.manual_seed(0)
    model = make_model("llama", 1)
    attn = model.model.layers[0].self_attn
    ref_k = Int8Linear(attn.k_proj.weight)
    fuse_siblings(model.model.layers, lambda lin: Int8Linear(lin.weight, lin.bias))
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert (q.start, q.stop, k.start, k.stop, v.start, v.stop) == (0, 32, 32, 48, 48, 64)
    x, other = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    q(x)
    assert torch.equal(k(other), ref_k(other))  # not x's product
    q(x)
    x.mul_(2.0)  # changed between the calls: recomputed
    assert torch.equal(k(x), ref_k(x))
    assert torch.equal(k(x), ref_k(x))  # called alone twice: the product of x each time


def test_fused_linear_held_once_and_copies_keep_their_own():
    """Resident bytes equal the unfused model's (the fused linear is registered once, under the
    group's first member); a deep copy's members share the copy's fused linear, not the
    original's."""
    plain, fused = _pair("llama", "int4")
    assert resident_bytes(fused) == resident_bytes(plain)
    twin = copy.deepcopy(fused)
    for a, b in zip(fused.model.layers, twin.model.layers):
        assert b.self_attn.k_proj._shared is b.self_attn.q_proj._shared
        assert b.self_attn.q_proj._shared.linear is b.self_attn.q_proj.fused
        assert b.self_attn.q_proj.fused is not a.self_attn.q_proj.fused
    keys = [k for k in twin.state_dict() if "k_proj" in k or "up_proj" in k]
    assert keys == []  # the siblings hold no tensors of their own


def test_unfusable_groups_are_left_alone():
    """Siblings that differ in bias (or are not plain nn.Linear) are not fused."""
    model = make_model("llama", 1)
    attn = model.model.layers[0].self_attn
    attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.out_features))
    n = fuse_siblings(model.model.layers, lambda lin: Int8Linear(lin.weight, lin.bias))
    assert n == 1 and isinstance(model.model.layers[0].mlp.gate_proj, FusedSlice)
    assert type(attn.q_proj) is torch.nn.Linear


@needs_kernel
def test_compiled_graph_holds_one_int4_product_per_group(tokenizer):
    """Inside a compiled decoder-layer graph the siblings' identity check holds: a Llama layer's
    graph calls the int4 kernel 4 times (q/k/v, o, gate/up, down) instead of 7; no graph breaks,
    no more graphs than unfused, and the compiled steps equal the eager ones to 1e-5."""
    from torch._dynamo.utils import counters

    ops: list[int] = []

    def counting(gm, example_inputs):
        ops.append(sum("_weight_int4pack_mm_for_cpu" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    graphs = {}
    for fuse in (False, True):
        torch._dynamo.reset()
        counters.clear()
        ops.clear()
        sk = SkipModel(quantize_model(make_model("llama", 4), "int4", fuse=fuse), tokenizer)
        eager = SkipModel(quantize_model(make_model("llama", 4), "int4", fuse=fuse), tokenizer)
        report = warm_up(sk, compile_adapter(sk.adapter, backend=counting, check=False), (1,))
        assert report.enabled, report.error
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        graphs[fuse] = counters["stats"]["unique_graphs"]
        layer_graphs = [n for n in ops if n > 1]  # the head graph holds none
        assert layer_graphs and set(layer_graphs) == {4 if fuse else 7}
        ids, mask = encode_prompts(tokenizer, ["The Eagle is a", "Summarize the"])
        policy = sk.policy_for(speedup=2.0, horizon=5)
        oc = list(generate_step(sk.adapter, ids, mask, policy=policy, max_new_tokens=6))
        oe = list(generate_step(eager.adapter, ids, mask, policy=policy, max_new_tokens=6))
        assert torch.equal(torch.stack([o.tokens for o in oc]), torch.stack([o.tokens for o in oe]))
        assert (torch.stack([o.logits for o in oc]) - torch.stack([o.logits for o in oe])).abs().max() <= 1e-5
    assert graphs[True] == graphs[False]


def test_lora_wraps_fused_members():
    """An unmerged LoRA path (int4 with an adapter) wraps the fused members; the model equals the
    unfused one with the same LoRA."""
    from skipdecode.lowrank import LowRankLinear

    torch.manual_seed(5)
    plain, fused = _pair("llama", "int4", num_layers=2)
    deltas = {}
    for name, mod in plain.named_modules():
        if name.endswith(("k_proj", "up_proj")):
            deltas[name] = (torch.randn(4, mod.in_features) * 0.1, torch.randn(mod.out_features, 4) * 0.1)
    for model in (plain, fused):
        for name, (a, b) in deltas.items():
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, LowRankLinear(getattr(holder, child), a, b, 2.0))
    assert isinstance(fused.model.layers[0].self_attn.k_proj.base, FusedSlice)
    ids = torch.randint(3, 300, (2, 7))
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, fused(ids).logits)
    assert isinstance(plain.model.layers[0].self_attn.k_proj.base, Int4Linear)


def test_replace_group_linear_checks_features():
    """A replacement must compute the group's features; it then serves every member and is
    registered under the owner."""
    from skipdecode.fused_linear import replace_group_linear

    model = quantize_model(make_model("llama", 1), "int8")
    attn = model.model.layers[0].self_attn
    with pytest.raises(ValueError, match="computes 32 -> 64 features, got 32 -> 48"):
        replace_group_linear(attn.k_proj, Int8Linear(torch.randn(48, 32)))
    new = Int8Linear(torch.randn(64, 32))
    replace_group_linear(attn.v_proj, new)
    x = torch.randn(1, 2, 32)
    assert attn.q_proj.fused is new and attn.k_proj.group.linear is new
    assert torch.equal(attn.v_proj(x), new(x)[..., 48:64])


def test_fuse_must_be_a_bool():
    from skipdecode.quantize import QuantizeError

    with pytest.raises(QuantizeError, match="fuse must be True or False, got 'no'"):
        quantize_model(make_model("llama", 1), "int8", fuse="no")


def test_threads_sharing_a_model_get_their_own_products():
    """Two threads running the same fused model on different inputs get their solo logits: the
    held product is read and replaced as one tuple, so a race can only miss it."""
    import threading

    model = quantize_model(make_model("llama", 2), "int8")
    inputs = [torch.randint(3, 300, (1, 6)) for _ in range(2)]
    with torch.no_grad():
        solo = [model(ids).logits for ids in inputs]
    bad = []

    def work(i):
        with torch.no_grad():
            for _ in range(40):
                if not torch.equal(model(inputs[i]).logits, solo[i]):
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert bad == [] and not any(t.is_alive() for t in threads)
