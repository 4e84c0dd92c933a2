"""Weight-first float32 products for the CPU decode step (skipdecode.layout).

load() makes every CPU float32 linear layer a WeightLeftLinear (same parameters, products taken
as (W x^T)^T); its outputs equal F.linear's for any number of rows (one row padded to two),
with a bias, and it falls back to F.linear off float32. Everything that needs plain layers or
contiguous weights (quantizers, training) gets them back; saving keeps the model fast. The older
column-major layout (kept for the layout benchmark) keeps values, tying and every answer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import FAMILIES, make_model, make_tokenizer
from test_train import cfg, examples
from skipdecode import SkipModel, load
from skipdecode.layout import (LINEAR_MIN_ROWS, WeightLeftLinear, column_major, is_column_major, is_weight_left, row_major,
                               weight_left)
from skipdecode.policy import LinearDecayPolicy
from skipdecode.train import train

PROMPTS = ["The Eagle is a", "Blue Spice serves French food in the city centre"]


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _answers(sk, ids):
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, horizon=6)
    return sk.model(ids).logits, {p: sk.generate(PROMPTS, max_new_tokens=8, policy=p).token_ids
                                  for p in (sk.policy_for(speedup=1.0), policy)}


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 17, LINEAR_MIN_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_first_product_equals_f_linear(rows, bias):
    """(..., K) -> (..., N) for 2-D and 3-D inputs, a single row padded and cut back."""
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 24)
    want = F.linear(x, layer.weight, layer.bias)
    layer.__class__ = WeightLeftLinear
    got = layer(x)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    x3 = torch.randn(3, rows, 24)
    torch.testing.assert_close(layer(x3), F.linear(x3, layer.weight, layer.bias), atol=1e-6, rtol=1e-5)


def test_a_long_prefill_gives_sdpa_a_row_major_query_and_equals_hugging_face(monkeypatch):
    """A loaded (weight-first) model's eager prefill of LINEAR_MIN_ROWS or more tokens hands PyTorch's
    SDPA queries whose last dimension is contiguous (a strided one sends SDPA to its math kernel,
    which holds the whole score matrix: 1.9x slower at 2048 tokens), and its logits equal the
    unmodified model's."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    plain = make_model("llama")
    sk = SkipModel(make_model("llama"), make_tokenizer())
    assert weight_left(sk.model) > 0
    strides = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *a, **kw):
        strides.append(query.stride(-1))
        return real(query, *a, **kw)
    monkeypatch.setattr(hf_sdpa.torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(5, 90, (1, LINEAR_MIN_ROWS + 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = sk.model(ids).logits
        assert strides == [1] * 6  # one call per layer, every query row-major
        torch.testing.assert_close(got, plain(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 24), (1, 1, 24), (3, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_compiled_one_row_product_is_a_reduction(shape, bias):
    """Traced by dynamo, one input row is a multiply and a sum over the input features (no
    matrix product in the graph, so inductor makes it one reduction loop over the weight); more
    rows keep the weight-first GEMM. Values equal F.linear's to float rounding."""
    torch.manual_seed(len(shape))
    layer = nn.Linear(24, 40, bias=bias)
    layer.__class__ = WeightLeftLinear
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(*shape)
    got = torch.compile(lambda t: layer(t), backend=capture, dynamic=False)(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-6, rtol=1e-5)
    assert got.shape == (*shape[:-1], 40)
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")}
    one_row = x.shape[:-1].numel() == 1
    assert any("mm" in t for t in targets) is not one_row, targets
    assert ("sum" in targets) is one_row, targets


def test_weight_first_falls_back_to_f_linear_off_float32():
    layer = nn.Linear(8, 6).double()
    layer.__class__ = WeightLeftLinear
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # the very same call


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_left_keeps_values_tying_and_every_answer(family):
    """Every float32 nn.Linear becomes weight-first with contiguous weights; same values, a tied
    head still shared with the embedding, the same greedy tokens and logits (1e-5) with and
    without skipping; row_major gives plain layers back."""
    sk = SkipModel(make_model(family), make_tokenizer())
    before = {k: v.clone() for k, v in sk.model.state_dict().items()}
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    want_logits, want = _answers(sk, ids)
    plain = [m for m in _linears(sk.model) if type(m) is nn.Linear]
    n = weight_left(sk.model)
    assert n == len(plain) and is_weight_left(sk.model)
    assert all(type(m) is WeightLeftLinear and m.weight.is_contiguous() for m in plain)
    for k, v in sk.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    if sk.model.config.tie_word_embeddings:
        assert sk.model.get_output_embeddings().weight is sk.model.get_input_embeddings().weight
    got_logits, got = _answers(sk, ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert got == want
    assert row_major(sk.model) == n and not is_weight_left(sk.model)
    assert all(type(m) is nn.Linear for m in plain)


@pytest.mark.parametrize("family", FAMILIES)
def test_column_major_keeps_values_tying_and_every_answer(family):
    """The former layout (benchmarks compare it): column-major strides, same values and answers;
    weight_left re-lays it contiguous."""
    sk = SkipModel(make_model(family), make_tokenizer())
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    want_logits, want = _answers(sk, ids)
    n = column_major(sk.model)
    assert n >= 1 and is_column_major(sk.model)
    for m in _linears(sk.model):
        if min(m.weight.shape) > 1:
            assert m.weight.stride() == (1, m.weight.shape[0])
    got_logits, got = _answers(sk, ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert got == want
    weight_left(sk.model)
    assert not is_column_major(sk.model) and all(m.weight.is_contiguous() for m in _linears(sk.model))


def test_load_makes_linears_weight_first_saves_and_stays_fast(tmp_path):
    """load() makes the layers weight-first; save_pretrained writes contiguous weights and keeps
    the model weight-first; a reload answers the same; a quantized load has no float linears left
    weight-first and matches quantizing a plain copy."""
    path = tmp_path / "tiny"
    reference = SkipModel(make_model("qwen2"), make_tokenizer())
    reference.save_pretrained(path)
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    want, want_logits = reference.generate(PROMPTS, max_new_tokens=6).token_ids, reference.model(ids).logits
    sk = load(str(path))
    assert is_weight_left(sk.model) and not is_column_major(sk.model)
    assert sk.generate(PROMPTS, max_new_tokens=6).token_ids == want
    torch.testing.assert_close(sk.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    sk.save_pretrained(tmp_path / "again")
    assert is_weight_left(sk.model)
    again = load(str(tmp_path / "again"))
    assert again.generate(PROMPTS, max_new_tokens=6).token_ids == want
    torch.testing.assert_close(again.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    q = load(str(path), quantize="int8")
    assert not is_weight_left(q.model) and not is_column_major(q.model)
    from skipdecode.quantize import quantize_model

    quantize_model(reference.model, "int8")  # from the plain weights
    torch.testing.assert_close(q.model(ids).logits, reference.model(ids).logits)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_training_a_loaded_model_gets_plain_layers(tmp_path, lora_r):
    """A model from load() (weight-first) trains and saves: full fine-tune and LoRA."""
    path = tmp_path / "tiny"
    SkipModel(make_model("llama"), make_tokenizer()).save_pretrained(path)
    sk = load(str(path))
    assert is_weight_left(sk.model)
    result = train(sk, examples(), cfg(tmp_path / "run", max_steps=2, lora_r=lora_r, kl_weight=0.0))
    assert not is_weight_left(sk.model)
    final = load(result.final_dir)
    assert is_weight_left(final.model)
    assert len(final.generate(PROMPTS, max_new_tokens=4).token_ids) == 2
