"""int4 through PyTorch's CPU kernel (skipdecode.int4pack, Int4Linear) and its fallback.

Tolerances (derived in skipdecode/int4pack.py's docstring):
- the weight: every weight moves by at most s / 2 of its group's stored bfloat16 step s, and s is
  at most 2^-7 above (max - min) / 15 (so the bound is the former float32 scheme's);
- one linear on the kernel against the float32 product with the dequantized weight W': the
  kernel rounds each activation and each output to bfloat16 (unit roundoff u = 2^-8), so
  |y - x @ W'^T| <= 2u(1+u) |x| @ |W'|^T; checked with 1% slack for float32 accumulation;
- the fallback layout computes exactly x @ W'^T (float32, to 1e-6);
- a whole tiny model on the kernel against the same model with every int4 layer replaced by a
  float32 nn.Linear of its dequantized weight: max |logits diff| <= 3% of max |logits|. Measured
  0.6-1.5% over 7 families (bfloat16 activations through 6 layers of these large-init random
  models), so 3% is a 2x margin; int4 quantization itself moves these logits by 10-50%.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from skipdecode import int4pack
from skipdecode.adapters import get_adapter
from skipdecode.cache import SkipCache
from skipdecode.forward import skip_forward
from skipdecode.quantize import Int4Linear, QuantizeError, quantize_model

from conftest import make_model

U = int4pack.BF16_UNIT_ROUNDOFF

needs_kernel = pytest.mark.skipif(not int4pack.kernel_available()[0], reason=int4pack.kernel_available()[1])


def _steps(layer: Int4Linear) -> torch.Tensor:
    """The stored step of each weight's group, (N, K) float32."""
    return layer.scales_and_zeros[..., 0].t().float().repeat_interleave(layer.group_size, dim=1)


@pytest.mark.parametrize("kernel", [None, False])
def test_int4_weight_within_half_step(kernel):
    torch.manual_seed(1)
    w = torch.randn(48, 96) * 0.2
    layer = Int4Linear(w, None, group_size=32, kernel=kernel)
    codes = layer.codes()
    assert codes.shape == (48, 96) and codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert layer.scales_and_zeros.shape == (3, 48, 2) and layer.scales_and_zeros.dtype == torch.bfloat16
    s = _steps(layer)
    wg = w.reshape(48, 3, 32)
    s_exact = ((wg.amax(-1) - wg.amin(-1)) / 15).repeat_interleave(32, dim=1)
    assert (s >= s_exact).all() and (s <= s_exact * (1 + 2 ** -7)).all()
    assert ((layer.dequantized() - w).abs() <= s / 2 * (1 + 1e-5)).all()
    # every code is used somewhere: the grid spans each group (a wrong zero would shift it)
    assert set(codes.unique().tolist()) == set(range(16))


def test_int4_nearly_constant_group_keeps_its_value():
    """A group whose range is tiny next to its values: the step floor keeps the zero precise."""
    w = torch.full((16, 32), 0.0123)
    w[:, 0] += 1e-4
    layer = Int4Linear(w, kernel=False)
    assert ((layer.dequantized() - w).abs() <= 0.0123 * 2 ** -7).all()
    assert torch.equal(Int4Linear(torch.zeros(16, 32), kernel=False).dequantized(), torch.zeros(16, 32))


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 96), (4, 96), (9, 96), (2, 7, 96)], ids=["b1", "b4", "b9", "prefill"])
def test_int4_kernel_equals_dequantized_reference(shape):
    torch.manual_seed(2)
    w, b = torch.randn(64, 96) * 0.2, torch.randn(64)
    layer = Int4Linear(w, b)
    assert layer.kernel and layer.kernel_note == "" and hasattr(layer, "weight_int4pack")
    x = torch.randn(*shape)
    wq = layer.dequantized()
    ref = F.linear(x, wq, b)
    y = layer(x)
    assert y.shape == ref.shape and y.dtype == torch.float32
    tol = 2 * U * (1 + U) * 1.01 * (x.abs() @ wq.abs().t()) + 1e-6
    assert ((y - ref).abs() <= tol).all()
    assert tol.max() < 0.05 * ref.abs().max()  # the tolerance is far below a wrong product
    # the same codes, steps and zeros as the fallback layout: one scheme, two kernels
    fallback = Int4Linear(w, b, kernel=False)
    assert torch.equal(fallback.codes(), layer.codes()) and torch.equal(fallback.dequantized(), wq)
    assert torch.allclose(fallback(x), ref, atol=1e-6)


@pytest.mark.parametrize(
    "n,k,why",
    [(40, 96, "out_features 40 is not a multiple of 16"), (48, 48, "in_features 48 has no kernel group size"),
     (32, 16, "in_features 16 has no kernel group size")],
)
def test_int4_odd_shapes_fall_back(n, k, why):
    torch.manual_seed(3)
    w = torch.randn(n, k) * 0.2
    layer = Int4Linear(w)
    if int4pack.kernel_available()[0]:
        assert why in layer.kernel_note
        with pytest.raises(QuantizeError, match="kernel=True but the int4 kernel cannot run this layer"):
            Int4Linear(w, kernel=True)
    assert not layer.kernel and hasattr(layer, "weight_int4") and layer.weight_int4.shape == (n, k // 2)
    x = torch.randn(3, k)
    assert torch.allclose(layer(x), F.linear(x, layer.dequantized()), atol=1e-6)
    assert ((layer.dequantized() - w).abs() <= _steps(layer) / 2 * (1 + 1e-5)).all()


def test_int4_missing_op_falls_back(monkeypatch):
    """No kernel in this torch (or a failed self-test): every layer keeps the fallback layout."""
    monkeypatch.setattr(int4pack, "_STATE", {"checked": False, "ok": False, "why": ""})
    monkeypatch.setattr(int4pack, "_ops_present", lambda: "torch 0.0 has no aten._weight_int4pack_mm_for_cpu")
    assert int4pack.kernel_available() == (False, "torch 0.0 has no aten._weight_int4pack_mm_for_cpu")
    layer = Int4Linear(torch.randn(64, 64))
    assert not layer.kernel and "has no aten._weight_int4pack_mm_for_cpu" in layer.kernel_note
    monkeypatch.setattr(int4pack, "_STATE", {"checked": False, "ok": False, "why": ""})
    monkeypatch.setattr(int4pack, "_ops_present", lambda: "")
    monkeypatch.setattr(int4pack, "_self_test", lambda: "aten._weight_int4pack_mm_for_cpu disagrees with the dequantized reference")
    assert not Int4Linear(torch.randn(64, 64)).kernel


@needs_kernel
def test_int4_pack_failure_falls_back(monkeypatch):
    def refuse(codes):
        raise RuntimeError("_convert_weight_to_int4pack: expect N to be dividable by 16")

    monkeypatch.setattr(int4pack, "pack", refuse)
    layer = Int4Linear(torch.randn(64, 64))
    assert not layer.kernel and "dividable by 16" in layer.kernel_note
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), F.linear(x, layer.dequantized()), atol=1e-6)


def _float_reference(model: nn.Module) -> nn.Module:
    """``model`` with every Int4Linear replaced by a float32 nn.Linear of its dequantized weight."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Int4Linear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight.data = child.dequantized()
                if child.bias is not None:
                    lin.bias.data = child.bias.data.clone()
                setattr(parent, name, lin)
    return ref


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen2", "opt_proj", "gpt2"])
def test_int4_model_logits_equal_dequantized_reference(family, monkeypatch):
    """Prefill shapes (batch 1 and 3) and a decode step (one token per row, with the cache). The
    head is a plain int8 one here (the same in both models): a rescored head picks its int8
    candidates from the preview, so a float preview would rescore other tokens
    (tests/test_rescored_head.py covers it)."""
    from skipdecode import quantize

    monkeypatch.setitem(quantize.HEAD_MODE, "int4", "int8")
    torch.manual_seed(4)
    model = quantize_model(make_model(family), "int4")
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert sum(m.kernel for m in layers) >= len(layers) - 1  # opt_proj's 16-wide head falls back
    ref = _float_reference(model)
    ids = torch.randint(3, 300, (3, 9))
    with torch.inference_mode():
        for batch in (ids[:1], ids):
            a, b = model(batch).logits, ref(batch).logits
            assert (a - b).abs().max() <= 0.03 * b.abs().max()
    # a decode step of our engine: the prompt prefilled into the cache, then one token per row
    a, b = _decode_step_logits(model, ids), _decode_step_logits(ref, ids)
    assert a.shape == (3, 1, 320) and (a - b).abs().max() <= 0.03 * b.abs().max()


def _decode_step_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, 1, V) of feeding ``ids[:, -1]`` after prefilling ``ids[:, :-1]`` (SkipCache)."""
    adapter = get_adapter(model)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        cache = SkipCache(adapter.num_layers)
        skip_forward(adapter, ids[:, :-1], mask[:, :-1], cache=cache)
        return skip_forward(adapter, ids[:, -1:], mask, cache=cache)


@needs_kernel
def test_int4_kernel_layout_is_smaller():
    """bfloat16 (step, zero) pairs: 0.625 bytes per weight against 0.75 with float32 pairs."""
    layer = Int4Linear(torch.randn(64, 128))
    nbytes = sum(t.untyped_storage().nbytes() for t in layer.buffers())
    assert nbytes == 64 * 128 // 2 + 4 * 64 * 2 * 2


def test_int4_kernel_layer_refuses_other_devices():
    layer = Int4Linear(torch.randn(64, 64))
    if not layer.kernel:
        pytest.skip(layer.kernel_note)
    meta_x = torch.empty(1, 64, device="meta")
    with pytest.raises(QuantizeError, match="cannot run on meta"):
        layer._eager(meta_x)


@pytest.mark.slow
def test_int4_fallback_compiled_kernels_equal_eager(monkeypatch, tokenizer):
    """The fallback layout's fused product under compile mode "kernels" (inductor) equals eager."""
    from test_compiled import _kernels_equal

    monkeypatch.setattr(int4pack, "_STATE", {"checked": True, "ok": False, "why": "forced fallback"})
    _kernels_equal("llama", tokenizer, "int4")


def test_int4_head_is_an_int4_preview_rescored_from_int8():
    """A plain 4-bit head of SmolLM2's tied embedding moved the next-token distribution 26x further
    than 4-bit decoder layers did (quantize.HEAD_MODE): int4 models get a RescoredHead (int4
    preview, int8 candidates; tests/test_rescored_head.py), the decoder layers are all int4."""
    from skipdecode.quantize import HEAD_MODE, Int8Linear
    from skipdecode.rescored_head import RescoredHead

    model = quantize_model(make_model("llama"), "int4")
    head = model.get_output_embeddings()
    assert HEAD_MODE["int4"] == "int4-rescored" and type(head) is RescoredHead
    assert type(head.preview) is Int4Linear and type(head.exact) is Int8Linear
    decoder = [m for m in model.model.layers.modules() if isinstance(m, (Int4Linear, Int8Linear, nn.Linear))]
    assert decoder and all(isinstance(m, Int4Linear) for m in decoder)
