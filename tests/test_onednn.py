"""oneDNN's packed float32 products (skipdecode.onednn): used for 3+ rows, equal to F.linear,
never stale, counted in memory, dropped by copies and by row_major, equal to eager when compiled."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_model
from test_compiled import assert_equal_runs
from skipdecode import onednn
from skipdecode.compiled import compile_adapter, warm_up
from skipdecode.generate import encode_prompts, generate_step
from skipdecode.layout import WeightLeftLinear, row_major, weight_left
from skipdecode.model import SkipModel
from skipdecode.quantize import resident_bytes

pytestmark = pytest.mark.skipif(not onednn.available()[0], reason=f"oneDNN unavailable: {onednn.available()[1]}")


def _layer(out_features=40, in_features=24, bias=True, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.__class__ = WeightLeftLinear
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear_and_is_used_from_three_rows(bias):
    """Values equal F.linear for 1..17 rows (2-D and 3-D inputs). A packed copy swapped for
    another weight's changes exactly the products of MIN_ROWS or more rows: those use it."""
    net = nn.Sequential(_layer(bias=bias))
    layer = net[0]
    assert onednn.enable(net) == 1 and layer.onednn
    for rows in (1, 2, 3, 5, 17):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 4, 24)
    torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    stamp, _ = layer._onednn_packed
    layer._onednn_packed = (stamp, torch.ops.mkldnn._reorder_linear_weight(torch.zeros(40, 24), None))
    for rows in (1, 2, 3, 8):
        x = torch.randn(rows, 24)
        want = F.linear(x, layer.weight, layer.bias)
        changed = not torch.allclose(layer(x), want, atol=1e-4)
        assert changed is (rows >= onednn.MIN_ROWS), rows


def test_weight_changed_in_place_is_repacked():
    net = nn.Sequential(_layer())
    onednn.enable(net)
    layer = net[0]
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    x = torch.randn(6, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_unknown_weight_falls_back_to_f_linear():
    """The op with a weight no enabled layer owns computes F.linear itself."""
    w, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(5, 8)
    torch.testing.assert_close(torch.ops.skipdecode.onednn_linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("rows", [2, 3, 7])
def test_op_output_is_contiguous_like_its_fake(rows):
    """Compiled graphs read the op's result with the fake kernel's strides (contiguous (M, N)):
    below MIN_ROWS (weight-first, a transposed product) and above it (oneDNN) alike. A transposed
    view once gave NaN logits inside a compiled layer."""
    net = nn.Sequential(_layer(bias=False))
    onednn.enable(net)
    x = torch.randn(rows, 24)
    for w in (net[0].weight, torch.randn(40, 24)):
        y = torch.ops.skipdecode.onednn_linear(x, w, None)
        assert y.is_contiguous() and y.shape == (rows, 40)
        torch.testing.assert_close(y, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_copies_and_row_major_drop_the_packed_copy_and_memory_counts_it():
    torch.manual_seed(0)
    net = nn.Sequential(_layer(), _layer(16, 40, seed=1))
    before = resident_bytes(net)["total"]
    assert onednn.enable(net) == 2
    packed = onednn.packed_nbytes(net)
    assert packed == (40 * 24 + 16 * 40) * 4
    assert resident_bytes(net)["total"] == before + packed and resident_bytes(net)["float"] == before + packed
    twin = copy.deepcopy(net)
    assert onednn.packed_nbytes(twin) == 0 and not twin[0].onednn
    with torch.no_grad():
        twin[0].weight.add_(1.0)  # the copy's own weight, never packed: its products must follow it
    x = torch.randn(4, 24)
    torch.testing.assert_close(twin[0](x), F.linear(x, twin[0].weight, twin[0].bias), atol=1e-5, rtol=1e-5)
    assert row_major(net) == 2 and onednn.packed_nbytes(net) == 0
    assert type(net[0]) is nn.Linear and resident_bytes(net)["total"] == before


def test_enable_is_a_no_op_without_onednn(monkeypatch):
    net = nn.Sequential(_layer())
    monkeypatch.setattr(onednn, "available", lambda: (False, "no oneDNN"))
    assert onednn.enable(net) == 0 and not net[0].onednn
    assert onednn.enable(nn.Sequential(nn.Linear(4, 4))) == 0  # plain nn.Linear: weight_left first


PROMPTS = ["The Eagle is a", "Summarize the article. The quick brown fox", "Hello", "A cheap coffee shop near"]


def _run(sk, policy, new_tokens=6):
    ids, mask = encode_prompts(sk.tokenizer, PROMPTS)
    outs = list(generate_step(sk.adapter, ids, mask, policy=policy, max_new_tokens=new_tokens))
    return torch.stack([o.logits for o in outs]), torch.stack([o.tokens for o in outs])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_batch_with_packed_weights_equals_eager(family, tokenizer):
    """compile_adapter (aot_eager graphs) enables the packed products; a batch of 4 (the products
    of 4 rows and the prefill's go to oneDNN, inside the compiled graphs as one opaque op) gives
    the eager model's tokens and logits to 1e-5, full depth and skipping."""
    torch._dynamo.reset()
    eager = SkipModel(make_model(family), tokenizer)
    fast = SkipModel(make_model(family), tokenizer)
    assert weight_left(fast.model) > 0
    report = compile_adapter(fast.adapter, backend="aot_eager")
    assert report.onednn_layers == sum(type(m) is WeightLeftLinear for m in fast.model.modules())
    assert report.onednn_layers > 0 and onednn.packed_nbytes(fast.model) > 0
    warm_up(fast, report, (4,))
    assert_equal_runs(eager, fast, run=_run, horizon=5)
    assert report.enabled, report.error
