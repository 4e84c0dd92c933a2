"""W8A8 linears (skipdecode.w8a8): int8 weights, each decode row's activations quantized to int8 on
their own, FBGEMM's kernel; ``quantize="w8a8"`` on tiny models.

Tolerances:
- one linear layer, one position per row: with x' = a (u - z) the row's dequantized activations
  (|x'_k - x_k| <= a, the grid's step a = range / 127, a half step of rounding and at most a half
  step from rounding the zero point) and W' = q s the int8 weight (|W' - W| <= s_n / 2):
  |y_n - x W^T| <= a sum_k |W'_nk| + s_n / 2 sum_k |x_k|, plus a float32 slack of 1e-5 of the scale;
- whole model, one decode step after a prefill: max |logits - float| <= 8 % of max |logits|
  (measured worst case over the 7 families below 4 %), and closer to float than int4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from skipdecode import w8a8
from skipdecode.cache import SkipCache
from skipdecode.engine import Engine, Request
from skipdecode.forward import skip_forward
from skipdecode.loading import LoadError, load
from skipdecode.model import SkipModel
from skipdecode.quantize import QuantizeError, quantize_model, quantized_mode, resident_bytes
from skipdecode.rescored_head import RescoredHead
from skipdecode.w8a8 import W8A8Linear

from conftest import make_chain_model, make_model


def _bound(x: torch.Tensor, layer: W8A8Linear) -> torch.Tensor:
    """(M, N) error bound of the module docstring for rows x (M, K)."""
    lo, hi = x.amin(1, keepdim=True).clamp(max=0), x.amax(1, keepdim=True).clamp(min=0)
    a = (hi - lo) / 127
    wq = layer.dequantized()
    return a * wq.abs().sum(1)[None] + x.abs().sum(1, keepdim=True) * layer.scale[None] / 2


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_product_within_rounding_bound_and_not_float(rows):
    torch.manual_seed(rows)
    w, b = torch.randn(48, 40) * 0.1, torch.randn(48)
    layer = W8A8Linear(w, b)
    x = torch.randn(rows, 1, 40) * 3
    y = layer(x)[:, 0]
    ref = x[:, 0] @ w.T + b
    err = (y - ref).abs()
    assert (err <= _bound(x[:, 0], layer) + 1e-5 * ref.abs().max()).all()
    # activations are rounded too: farther from float than the weight-only int8 product
    weight_only = x[:, 0] @ layer.dequantized().T + b
    assert (y - ref).norm() > 1.5 * (weight_only - ref).norm()


def test_rows_do_not_depend_on_their_batch():
    """Each row (a zero row and a constant row included) equals its solo result exactly."""
    torch.manual_seed(0)
    layer = W8A8Linear(torch.randn(64, 32) * 0.2)
    x = torch.randn(6, 1, 32)
    x[2] = 0.0
    x[4] = 1.5
    x[5, 0, 3] = 40.0  # an outlier row: its large scale must not leak into the others
    out = layer(x)
    for i in range(6):
        assert torch.equal(out[i], layer(x[i : i + 1])[0])
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_every_position_is_quantized_on_its_own():
    """A prefill's positions (B, T, K) each equal their own one-position product, exactly, and
    stay within the bound; the codes are the weight-only int8 codes."""
    torch.manual_seed(1)
    w, b = torch.randn(24, 16), torch.randn(24)
    layer = W8A8Linear(w, b)
    x = torch.randn(2, 5, 16)
    out = layer(x)
    for i in range(2):
        for t in range(5):
            assert torch.equal(out[i, t], layer(x[i : i + 1, t : t + 1])[0, 0])
    ref = x.reshape(10, 16) @ w.T + b
    assert ((out.reshape(10, 24) - ref).abs() <= _bound(x.reshape(10, 16), layer) + 1e-5 * ref.abs().max()).all()
    assert torch.equal(layer.codes(), torch.round(w / layer.scale[:, None]).to(torch.int8))
    assert layer(torch.randn(0, 16)).shape == (0, 24)


def test_copies_pack_their_own_weights():
    torch.manual_seed(2)
    layer = W8A8Linear(torch.randn(32, 16))
    x = torch.randn(3, 1, 16)
    y = layer(x)
    twin = copy.deepcopy(layer)
    assert int(twin.key) != int(layer.key)
    del layer
    assert torch.equal(twin(x), y)  # the copy does not lean on the original's packed weights


def test_compiled_graph_holds_the_product_without_a_break():
    torch.manual_seed(3)
    layer = W8A8Linear(torch.randn(32, 16), torch.randn(32))
    fn = torch.compile(lambda m, t: torch.relu(m(t)) * 2, backend="inductor", fullgraph=True)
    x = torch.randn(4, 1, 16)
    assert torch.allclose(fn(layer, x), torch.relu(layer(x)) * 2, rtol=1e-6, atol=1e-6)
    other = W8A8Linear(torch.randn(32, 16))  # another layer reuses the graph with its own weights
    assert torch.allclose(fn(other, x), torch.relu(other(x)) * 2, rtol=1e-6, atol=1e-6)


def _decode_logits(model, ids):
    """Logits of one decode step (one position) after a prefill of ``ids[:, :-1]``."""
    with torch.inference_mode():
        past = model(ids[:, :-1], use_cache=True).past_key_values
        return model(ids[:, -1:], past_key_values=past).logits[:, -1]


def test_decode_logits_close_every_family(family):
    ids = torch.tensor([[5, 17, 42, 99, 7, 150, 33, 8, 61]])
    ref = _decode_logits(make_model(family), ids)
    q = quantize_model(make_model(family), "w8a8")
    assert quantized_mode(q) == "w8a8"
    rel = ((_decode_logits(q, ids) - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel <= 0.08, rel
    head = q.get_output_embeddings()  # W8A8 preview, candidates rescored from int8, no int4 copy
    assert isinstance(head, RescoredHead) and head.preview is None and isinstance(head.row_preview, W8A8Linear)
    q4 = quantize_model(make_model(family), "int4")
    assert (_decode_logits(q4, ids) - ref).abs().max() > (_decode_logits(q, ids) - ref).abs().max()


def test_greedy_tokens_and_skip_plans(tokenizer):
    prompt, text = "Describe the restaurant:", "The Eagle is a coffee shop"
    ref = SkipModel(make_chain_model(tokenizer, prompt, text), tokenizer).generate(prompt, max_new_tokens=16)
    sk = SkipModel(quantize_model(make_chain_model(tokenizer, prompt, text), "w8a8"), tokenizer)
    out = sk.generate(prompt, max_new_tokens=16)
    assert out.token_ids == ref.token_ids and out.texts == [text]
    sk = SkipModel(quantize_model(make_model("llama"), "w8a8"), tokenizer)
    policy = sk.policy_for(speedup=2.0, horizon=4)
    res = sk.generate(["The Eagle is", "Summarize the article. The quick"], max_new_tokens=6, policy=policy)
    assert res.layers_run == [len(policy.active_layers(t)) for t in range(1, 6)]


def _count_onednn(monkeypatch) -> list[int]:
    """Patch :func:`skipdecode.w8a8._onednn_product` to record the row count of every call."""
    calls: list[int] = []
    real = w8a8._onednn_product

    def spy(codes, *args):
        calls.append(codes.shape[0])
        return real(codes, *args)

    monkeypatch.setattr(w8a8, "_onednn_product", spy)
    return calls


def test_onednn_copy_gives_fbgemms_integers_for_prefills_only(monkeypatch):
    """With a oneDNN copy, products of ONEDNN_MIN_ROWS rows or more go through it and equal
    FBGEMM's exactly (both accumulate the same integers); fewer rows stay on FBGEMM; copies
    (deepcopy) keep the copy; the bytes count it."""
    assert w8a8.onednn_available()[0], w8a8.onednn_available()[1]
    torch.manual_seed(1)
    layer = W8A8Linear(torch.randn(96, 48) * 0.1, torch.randn(96))
    many = torch.randn(2, w8a8.ONEDNN_MIN_ROWS // 2, 48) * 2  # 64 positions, and the guard row
    few = torch.randn(w8a8.ONEDNN_MIN_ROWS - 2, 1, 48)  # the guard row makes it MIN_ROWS - 1
    want_many, want_few = layer(many), layer(few)
    calls = _count_onednn(monkeypatch)
    assert layer.enable_onednn() and layer.packed_nbytes() == 2 * 96 * 48
    assert torch.equal(layer(many), want_many) and calls == [w8a8.ONEDNN_MIN_ROWS + 1]
    assert torch.equal(layer(few), want_few) and calls == [w8a8.ONEDNN_MIN_ROWS + 1]
    twin = copy.deepcopy(layer)
    assert twin.onednn_packed is not None and torch.equal(twin(many), want_many) and len(calls) == 2
    layer.disable_onednn()
    assert layer.onednn_packed is None and layer.packed_nbytes() == 96 * 48
    assert torch.equal(layer(many), want_many) and len(calls) == 2


def test_onednn_enable_copies_the_decoder_layers_for_prefills_and_the_heads_preview_for_8_rows(monkeypatch):
    """Decoder layers take oneDNN from ONEDNN_MIN_ROWS rows (prefills), the head's W8A8 preview
    from HEAD_ONEDNN_MIN_ROWS (8 rows and the guard row: batched decode steps), with FBGEMM's
    integers either way; the bytes count both copies."""
    from skipdecode import onednn

    model = quantize_model(make_model("llama"), "w8a8")
    head = model.get_output_embeddings()
    preview = head.row_preview
    in_layers = [m for m in model.model.layers.modules() if isinstance(m, W8A8Linear)]
    torch.manual_seed(0)
    rows = {n: torch.randn(n, head.in_features) for n in (w8a8.HEAD_ONEDNN_MIN_ROWS - 2, w8a8.HEAD_ONEDNN_MIN_ROWS - 1)}
    want = {n: head.preview_logits(x) for n, x in rows.items()}
    before = resident_bytes(model)["quantized"]
    assert onednn.enable(model) == len(in_layers) + 1 and len(in_layers) > 0
    assert all(m.onednn_packed is not None and m.onednn_min_rows == w8a8.ONEDNN_MIN_ROWS for m in in_layers)
    assert preview.onednn_packed is not None and preview.onednn_min_rows == w8a8.HEAD_ONEDNN_MIN_ROWS
    copies = sum(m.out_features * m.in_features for m in [*in_layers, preview])
    assert resident_bytes(model)["quantized"] == before + copies
    calls = _count_onednn(monkeypatch)
    for n, x in rows.items():  # the guard row makes n + 1 product rows
        assert torch.equal(head.preview_logits(x), want[n])
    assert calls == [w8a8.HEAD_ONEDNN_MIN_ROWS]  # only the 8-row preview went to oneDNN
    copied = copy.deepcopy(preview)  # a copy keeps its threshold
    assert copied.onednn_packed is not None and copied.onednn_min_rows == w8a8.HEAD_ONEDNN_MIN_ROWS
    assert onednn.disable(model) == len(in_layers) + 1 and resident_bytes(model)["quantized"] == before
    with pytest.raises(ValueError, match="min_rows"):
        preview.enable_onednn(0)


def test_inflight_rows_equal_solo_and_compiled_equals_eager(tmp_path, tokenizer, monkeypatch):
    """Rows joining at different steps with different plans give their solo tokens; the compiled
    step (the product inside each layer's graph) gives the eager tokens, and so does a compiled
    prefill of 64+ positions, whose products go through oneDNN's copy."""
    directory = tmp_path / "m"
    SkipModel(make_model("llama"), tokenizer).save_pretrained(directory)
    eager = load(directory, quantize="w8a8")
    compiled = load(directory, quantize="w8a8", compile=True)
    assert compiled.compile_report.enabled, compiled.compile_report.error
    long_prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"]
    assert len(long_prompt) >= w8a8.ONEDNN_MIN_ROWS
    want = eager.generate([long_prompt], max_new_tokens=4).token_ids
    calls = _count_onednn(monkeypatch)
    assert compiled.generate([long_prompt], max_new_tokens=4).token_ids == want
    assert calls and min(calls) >= w8a8.ONEDNN_MIN_ROWS and compiled.compile_report.prefill
    # with gradients on (a caller without torch.no_grad) layer calls and the head run eagerly,
    # and compiled decode steps stay on: the custom products have no autograd formula
    outs = []
    for sk in (eager, compiled):
        cache = SkipCache(sk.adapter.num_layers, capacity=8)
        with torch.enable_grad():
            skip_forward(sk.adapter, torch.tensor([[5, 6, 7]]), torch.ones((1, 3), dtype=torch.long), cache=cache)
            outs.append(skip_forward(sk.adapter, torch.tensor([[8]]), torch.ones((1, 4), dtype=torch.long), cache=cache))
    assert compiled.compile_report.enabled, compiled.compile_report.error
    # (the rest of the logits are each head's preview, which may differ: RescoredHead.tune_one_row)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    assert torch.allclose(outs[0].amax(-1), outs[1].amax(-1), atol=1e-4)
    prompts = [tokenizer(p)["input_ids"] for p in ("The Eagle is", "Summarize the article. The quick", "A")]
    plans = [None, eager.policy_for(speedup=2.0, horizon=4), eager.policy_for(speedup=3.0, horizon=4)]
    solo = [eager.generate([p], max_new_tokens=6, policy=plan).token_ids[0] for p, plan in zip(prompts, plans)]
    for sk in (eager, compiled):
        engine = Engine(sk.adapter, max_batch_size=3, prefix_cache=False)
        requests = [Request(list(p), max_new_tokens=6, policy=plan) for p, plan in zip(prompts, plans)]
        rows: dict[int, object] = {}
        for i, request in enumerate(requests):  # joining at steps 0, 1 and 2
            engine.submit(request)
            while engine.busy and (i == len(requests) - 1 or not rows.get(-1 - i)):
                for ev in engine.step():
                    if ev.finished:
                        rows[id(ev.row.request)] = ev.row
                if i < len(requests) - 1:
                    rows[-1 - i] = True  # one step, then the next request joins
        assert [rows[id(r)].tokens for r in requests] == solo


def test_resident_bytes_count_the_packed_weights():
    model = make_model("llama")
    quantize_model(model, "w8a8")
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]  # the head's preview included
    rb = resident_bytes(model)
    expected = sum(m.out_features * m.in_features + 8 * m.out_features + 8 for m in layers)  # codes, scale, sums, key
    exact = model.get_output_embeddings().exact  # the head's int8 codes, for rescoring; its
    expected += exact.weight_int8.numel()  # scales are the preview's (one storage, counted once)
    assert rb["quantized"] == expected


def test_w8a8_head_picks_the_int8_heads_token():
    """The w8a8 models' head: a W8A8 preview of every logit, the top candidates rescored from the
    int8 head; its greedy pick is the int8 head's where the plain W8A8 head's is not."""
    torch.manual_seed(4)
    w = torch.randn(2048, 64) * 0.1
    head = RescoredHead(w, candidates=64, int4_preview=False)
    x = torch.randn(64, 64)
    exact = head.exact(x)
    assert torch.equal(head(x).argmax(-1), exact.argmax(-1))
    assert not torch.equal(head.row_preview(x[:, None])[:, 0].argmax(-1), exact.argmax(-1))
    for i in range(3):  # per row, exactly
        assert torch.equal(head(x)[i], head(x[i : i + 1])[0])


def test_refusals_name_the_option(monkeypatch, tmp_path, tokenizer):
    with pytest.raises(QuantizeError, match="quantize='w8a8' runs on CPUs only"):
        w8a8.check_usable(torch.device("meta"))
    layer = W8A8Linear(torch.randn(16, 8))
    with pytest.raises(QuantizeError, match="w8a8 layers take float32 CPU inputs"):
        layer(torch.randn(1, 1, 8, dtype=torch.bfloat16))
    directory = tmp_path / "m"
    SkipModel(make_model("llama"), tokenizer).save_pretrained(directory)
    with pytest.raises(LoadError, match="compile='kernels' needs quantize='int8' or 'int4'"):
        load(directory, quantize="w8a8", compile="kernels")
    with pytest.raises(LoadError, match="quantize='w8a8' needs dtype float32 .*, got 'bfloat16'"):
        load(directory, quantize="w8a8", dtype="bfloat16")
    monkeypatch.setattr(w8a8, "fbgemm_available", lambda: (False, "no FBGEMM engine"))
    with pytest.raises(LoadError, match="quantize='w8a8' needs FBGEMM: no FBGEMM engine"):
        load(directory, quantize="w8a8")
    with pytest.raises(QuantizeError, match="quantize='w8a8' needs FBGEMM: no FBGEMM engine"):
        RescoredHead(torch.randn(32, 16), int4_preview=False)


def test_fbgemm_self_test_passes_here():
    assert w8a8.fbgemm_available() == (True, "")
