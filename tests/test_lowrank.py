"""LoRA adapters kept unmerged beside int4 weights (``skipdecode.lowrank``, ``load(quantize="int4")``).

Merged and then quantized to int4, an adapter whose delta is under half a 4-bit step vanishes
(the base weights of a GGUF Q4 model sit on the grid); kept unmerged it acts in full."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import make_model
from test_skip_adapter import ADAPTER_POLICY, NUM_LAYERS, PROMPT, _lora_dir
from test_skip_adapter import adapter_dir, base_dir  # noqa: F401  (fixtures)
from skipdecode import FullPolicy, LoadError, SkipModel, load
from skipdecode.fused_linear import FusedSlice
from skipdecode.lowrank import LoraFormatError, LowRankLinear, attach_lora, read_lora
from skipdecode.quantize import Int4Linear, quantize_model


@pytest.fixture(scope="module")
def grid_base_dir(tmp_path_factory, tokenizer):
    """The tiny llama with its decoder linears on the int4 grid (as the embedded GGUF's are)."""
    model = make_model("llama", NUM_LAYERS)
    with torch.no_grad():
        for layer in model.model.layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(Int4Linear(m.weight, kernel=False).dequantized())
    path = tmp_path_factory.mktemp("gridbase") / "tiny"
    SkipModel(model, tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_adapter_dir(tmp_path_factory):
    """A LoRA whose delta is far under half an int4 step (B ~ N(0, 0.01), scaling 2)."""
    path = _lora_dir(tmp_path_factory.mktemp("small") / "lora", zero=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for k, t in tensors.items():
        if "lora_B" in k:
            tensors[k] = 0.01 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_low_rank_linear_computes_base_plus_scaled_delta():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    a, b = torch.randn(2, 8), torch.randn(6, 2)
    x = torch.randn(3, 4, 8)
    want = base(x) + 1.5 * (x @ a.T) @ b.T
    torch.testing.assert_close(LowRankLinear(base, a, b, 1.5)(x), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(LoraFormatError, match="do not fit a 8 -> 6 linear"):
        LowRankLinear(base, torch.randn(2, 7), b, 1.0)


def test_read_lora_maps_peft_names_to_model_paths(adapter_dir):
    deltas = read_lora(adapter_dir)
    a, b, scaling = deltas["model.layers.0.self_attn.q_proj"]
    assert scaling == 2.0 and a.shape[0] == 2 and b.shape[1] == 2
    assert len(deltas) == 7 * NUM_LAYERS  # all-linear: q k v o gate up down in every layer


def test_unmerged_adapter_equals_the_merged_model_in_float(base_dir, adapter_dir):
    merged = load(str(base_dir), adapter=str(adapter_dir))
    plain = load(str(base_dir), adapter=False)
    assert attach_lora(plain.model, adapter_dir) == 7 * NUM_LAYERS
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(plain.model(ids).logits, merged.model(ids).logits, rtol=1e-4, atol=1e-4)


def test_int4_keeps_a_small_adapter_that_merging_would_erase(grid_base_dir, small_adapter_dir):
    floating = load(str(grid_base_dir), adapter=str(small_adapter_dir))
    stock = load(str(grid_base_dir), adapter=False)
    int4 = load(str(grid_base_dir), adapter=str(small_adapter_dir), quantize="int4")
    q_proj = int4.model.model.layers[0].self_attn.q_proj
    # q/k/v as one int4 product (fused_linear), the group's LoRA deltas as one low-rank path around it
    assert isinstance(q_proj, FusedSlice) and isinstance(q_proj.fused, LowRankLinear)
    assert isinstance(q_proj.fused.base, Int4Linear)
    assert int4.skip_config["skip_adapter"]["merged"] is False and int4.policy == ADAPTER_POLICY
    merged_then_int4 = copy.deepcopy(floating)
    quantize_model(merged_then_int4.model, "int4")  # the former path: merge, then quantize
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        want = floating.model(ids).logits - stock.model(ids).logits  # what the adapter changes
        kept = int4.model(ids).logits - stock.model(ids).logits
        lost = merged_then_int4.model(ids).logits - stock.model(ids).logits
    share = lambda d: float((d * want).sum() / (want * want).sum())  # noqa: E731
    assert share(kept) > 0.8 and share(lost) < 0.3, (share(kept), share(lost))
    text = int4.generate([PROMPT], policy=ADAPTER_POLICY, max_new_tokens=6)
    assert text.new_tokens[0] == 6


def test_int8_still_merges(base_dir, adapter_dir):
    int8 = load(str(base_dir), adapter=str(adapter_dir), quantize="int8")
    assert not any(isinstance(m, LowRankLinear) for m in int8.model.modules())
    assert int8.skip_config["skip_adapter"]["merged"] is True


def test_unsupported_lora_options_are_refused_by_name(base_dir, adapter_dir, tmp_path):
    import shutil

    dora = tmp_path / "dora"
    shutil.copytree(adapter_dir, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoadError, match="'use_dora' is set"):
        load(str(base_dir), adapter=str(dora), quantize="int4")
    other = tmp_path / "other"
    shutil.copytree(adapter_dir, other)
    from safetensors.torch import load_file, save_file

    t = load_file(str(other / "adapter_model.safetensors"))
    t = {k.replace("layers.0.", "layers.60."): v for k, v in t.items()}
    save_file(t, str(other / "adapter_model.safetensors"))
    with pytest.raises(LoadError, match="layers.60"):
        load(str(base_dir), adapter=str(other), quantize="int4")


def test_full_policy_unaffected_with_int4_and_no_adapter(base_dir):
    sk = load(str(base_dir), adapter=False, quantize="int4")
    assert not any(isinstance(m, LowRankLinear) for m in sk.model.modules())
    assert sk.generate([PROMPT], policy=FullPolicy(NUM_LAYERS), max_new_tokens=3).new_tokens[0] == 3


@pytest.mark.slow  # about 25 s of compiling on 2 cores; int4 compiled: test_compiled.py, low-rank compiled: test_full_depth_steps.py
def test_int4_with_unmerged_adapter_compiles_to_the_eager_result(base_dir, adapter_dir):
    """The compiled decode step (mode "layers", dynamo + aot_eager) traces the low-rank path."""
    from skipdecode.compiled import compile_adapter, warm_up

    torch._dynamo.reset()
    eager = load(str(base_dir), adapter=str(adapter_dir), quantize="int4")
    compiled = load(str(base_dir), adapter=str(adapter_dir), quantize="int4")
    report = compile_adapter(compiled.adapter, mode="layers", backend="aot_eager")
    warm_up(compiled, report, (2,))
    assert report.enabled, report.error
    prompts = [PROMPT, "name[The Eagle]"]
    a = eager.generate(prompts, policy=ADAPTER_POLICY, max_new_tokens=6)
    b = compiled.generate(prompts, policy=ADAPTER_POLICY, max_new_tokens=6)
    assert a.token_ids == b.token_ids and report.enabled, report.error


@pytest.mark.parametrize("quantize,merged", [("int4", False), ("int8", True), ("int4", True)])
def test_fused_group_holds_one_low_rank_path_equal_to_one_per_projection(adapter_dir, quantize, merged):
    """With fused siblings (q/k/v, gate/up: skipdecode.fused_linear) attach_lora puts one
    LowRankLinear around each group's product (stacked A, block-diagonal B): 4 wrappers a layer
    instead of 7, and the same logits as one wrapper per projection on decode steps, inside
    base_prefill and with some rows marked as base: to float rounding (1e-5 of the logits' scale)
    with int8; with int4, whose kernel rounds each layer's input to bfloat16, a float-rounding
    difference can flip a bfloat16 rounding downstream, so to the 3 % of the logits' scale that
    tests/test_quantize_int4.py derives for int4 against float (measured here: 1 %)."""
    from skipdecode.lowrank import base_prefill, base_rows

    torch.manual_seed(2)
    float_model = make_model("llama", NUM_LAYERS)
    models = {}
    for fuse in (False, True):
        model = quantize_model(copy.deepcopy(float_model), quantize, fuse=fuse)
        assert attach_lora(model, adapter_dir, merged=merged, decode_only=True) == 7 * NUM_LAYERS
        models[fuse] = model
    wrappers = {f: sum(isinstance(m, LowRankLinear) for m in models[f].modules()) for f in models}
    assert wrappers == {False: 7 * NUM_LAYERS, True: 4 * NUM_LAYERS}
    qkv = models[True].model.layers[0].self_attn.q_proj
    assert isinstance(qkv, FusedSlice) and isinstance(qkv.fused, LowRankLinear) and qkv.group.linear is qkv.fused
    ids = torch.randint(3, 300, (3, 7))
    rows = torch.tensor([True, False, True])
    out = {}
    with torch.no_grad():
        for fuse, model in models.items():
            plain = model(ids).logits
            with base_prefill(model):
                base = model(ids).logits
            with base_rows(model, rows):
                mixed = model(ids).logits
            out[fuse] = (plain, base, mixed)
    scale = out[False][0].abs().max()
    tol = 1e-5 if quantize == "int8" else 0.03
    for a, b in zip(out[False], out[True]):
        assert (a - b).abs().max() <= tol * scale
    assert (out[True][0] - out[True][1]).abs().max() > 1e-2 * scale  # the delta is not nothing
    torch.testing.assert_close(out[True][2][1], out[True][0][1])  # unmarked row: with the delta
    torch.testing.assert_close(out[True][2][0], out[True][1][0])  # marked row: the base model's
