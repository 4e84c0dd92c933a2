"""RescoredHead (skipdecode.rescored_head): an int4 preview of every logit, int8 logits for the
top-k candidates; the LM head of int4 models (quantize.HEAD_MODE["int4"])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from skipdecode import quantize
from skipdecode.model import SkipModel
from skipdecode.quantize import Int4Linear, Int8Linear, quantize_model, resident_bytes
from skipdecode.rescored_head import RESCORE_MAX_ROWS, RescoredHead
from skipdecode.w8a8 import W8A8Linear

from conftest import make_model


def _head(n: int = 512, k: int = 64, candidates: int = 16, bias: bool = False) -> RescoredHead:
    torch.manual_seed(0)
    return RescoredHead(torch.randn(n, k) * 0.1, torch.randn(n) * 0.1 if bias else None, candidates=candidates)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_preview", [True, False])
def test_candidates_get_int8_logits_and_the_rest_the_preview(bias, row_preview):
    head = _head(bias=bias)
    assert isinstance(head.row_preview, W8A8Linear)  # FBGEMM on the test CPU
    if not row_preview:
        head.row_preview = None  # as without FBGEMM: the int4 kernel's preview
    x = torch.randn(5, 64)
    out, preview, exact = head(x), head.preview_logits(x), head.exact(x)
    assert torch.equal(preview, (head.row_preview or head.preview)(x[:, None])[:, 0])
    idx = preview.topk(head.candidates, dim=-1).indices
    assert torch.allclose(out.gather(-1, idx), exact.gather(-1, idx), rtol=1e-5, atol=1e-6)
    rest = torch.ones_like(out, dtype=torch.bool).scatter_(-1, idx, False)
    assert torch.equal(out[rest], preview[rest])
    # the preview is the 4-bit weight's product, not the int8 one: rescoring changes the values
    assert not torch.allclose(preview.gather(-1, idx), exact.gather(-1, idx), atol=1e-6)


def test_greedy_pick_is_the_int8_heads():
    """With the int8 argmax inside the preview's top k, the argmax is the int8 head's; the plain
    int4 head alone disagrees with it on some rows of this draw."""
    head = _head(n=2048, candidates=64)
    x = torch.randn(64, 64)
    exact = head.exact(x).argmax(-1)
    assert torch.equal(head(x).argmax(-1), exact)
    assert not torch.equal(head.preview(x).argmax(-1), exact)  # the int4 preview alone


def test_row_preview_is_per_row_and_closer_to_int8_than_int4():
    """Each row's logits (candidates and the rest) equal its logits alone, exactly; the W8A8
    preview is closer to the int8 logits than the int4 one."""
    head = _head(n=1024, candidates=16)
    x = torch.randn(7, 64)
    out = head(x)
    for i in range(7):
        assert torch.equal(out[i], head(x[i : i + 1])[0])
    exact = head.exact(x)
    assert (head.row_preview(x[:, None])[:, 0] - exact).norm() < 0.5 * (head.preview(x) - exact).norm()


def test_without_fbgemm_the_int4_preview_serves(monkeypatch):
    from skipdecode import w8a8

    monkeypatch.setattr(w8a8, "fbgemm_available", lambda: (False, "no FBGEMM here"))
    head = _head()
    assert head.row_preview is None
    x = torch.randn(3, 64)
    assert torch.equal(head.preview_logits(x), head.preview(x))


def test_many_rows_run_the_int8_head_alone():
    head = _head()
    x = torch.randn(RESCORE_MAX_ROWS + 1, 64)
    assert torch.equal(head(x), head.exact(x))
    x3 = torch.randn(2, 3, 64)  # (B, T, K) keeps its leading shape
    assert head(x3).shape == (2, 3, 512)
    assert torch.allclose(head(x3)[1, 2], head(x3[1, 2:3])[0], rtol=1e-5, atol=1e-6)  # row by row


def test_candidates_validation_and_clamp():
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="candidates must be an integer >= 1"):
            RescoredHead(torch.randn(32, 16), candidates=bad)
    assert RescoredHead(torch.randn(32, 16), candidates=100).candidates == 32
    head = RescoredHead(torch.randn(32, 16), candidates=100)
    x = torch.randn(1, 16)
    assert torch.allclose(head(x), head.exact(x), rtol=1e-5, atol=1e-6)  # every logit rescored


def test_step_read_bytes_counts_the_preview_and_the_candidate_rows():
    head = _head(n=512, k=64, candidates=16)
    assert head.step_read_bytes(1) == 512 * 64 + 512 * 4 + 16 * (64 + 4)  # packed int8 + scales
    head.row_preview = None
    preview = sum(t.numel() * t.element_size() for t in head.preview.buffers())
    assert head.step_read_bytes(1) == preview + 16 * (64 + 4)
    assert head.step_read_bytes(8) - head.step_read_bytes(1) == 7 * 16 * (64 + 4)
    assert head.step_read_bytes(1) < resident_bytes(head)["total"]  # the int8 copy is not read


def test_step_read_bytes_follows_the_one_row_preview():
    """At one row a head whose timing chose the int4 preview reads the int4 codes, not the W8A8
    copy; more rows still take the W8A8 preview."""
    head = _head(n=512, k=64, candidates=16)
    int4 = sum(t.numel() * t.element_size() for t in head.preview.buffers())
    w8a8 = 512 * 64 + 512 * 4
    head.one_row_preview = "int4"
    assert head.step_read_bytes(1) == int4 + 16 * (64 + 4)
    assert head.step_read_bytes(2) == w8a8 + 2 * 16 * (64 + 4)
    head.one_row_preview = "w8a8"
    assert head.step_read_bytes(1) == w8a8 + 16 * (64 + 4)


def test_int4_model_decodes_as_with_an_int8_head(tokenizer, monkeypatch):
    """Greedy tokens (a 2x skip plan included) equal those of the same int4 model with a plain
    int8 head, and the step's logits agree at the chosen tokens."""
    prompts = ["The Eagle is", "Summarize the article. The quick"]
    ref_model = make_model("llama")
    model = make_model("llama")
    model.load_state_dict(ref_model.state_dict())
    monkeypatch.setitem(quantize.HEAD_MODE, "int4", "int8")
    ref = SkipModel(quantize_model(ref_model, "int4"), tokenizer)
    monkeypatch.undo()
    sk = SkipModel(quantize_model(model, "int4"), tokenizer)
    assert type(ref.model.get_output_embeddings()) is Int8Linear
    assert type(sk.model.get_output_embeddings()) is RescoredHead
    for policy in (None, sk.policy_for(speedup=2.0, horizon=4)):
        a = sk.generate(prompts, max_new_tokens=8, policy=policy)
        b = ref.generate(prompts, max_new_tokens=8, policy=policy)
        assert a.token_ids == b.token_ids


def test_int4_head_works_on_the_dequantizing_fallback():
    """Without PyTorch's int4 kernel the preview falls back to its own layout; same guarantees."""
    torch.manual_seed(1)
    w = torch.randn(256, 64) * 0.1
    head = RescoredHead(w, candidates=8)
    head.preview = Int4Linear(w, kernel=False)
    head.row_preview = None
    x = torch.randn(3, 64)
    idx = F.linear(x, head.preview.dequantized()).topk(8, dim=-1).indices
    assert torch.allclose(head(x).gather(-1, idx), head.exact(x).gather(-1, idx), rtol=1e-5, atol=1e-6)


def _fake_measure(ms: dict[str, float]):
    """A ``measure`` for :meth:`RescoredHead.tune_one_row` that returns the given times
    (milliseconds), in its call order: the W8A8 preview, then the int4 one."""
    order = iter(["w8a8", "int4"])
    return lambda fn: (fn(), ms[next(order)] / 1e3)[1]


@pytest.mark.parametrize("int4_preview", [True, False])
def test_tune_one_row_keeps_the_faster_preview(int4_preview):
    """The faster preview serves a single row (two rows keep the W8A8 one); a head without an
    int4 copy (w8a8 models) keeps the copy it made only when int4 wins; candidates stay exact."""
    torch.manual_seed(0)
    w = torch.randn(512, 64) * 0.1
    head = RescoredHead(w, candidates=16, int4_preview=int4_preview)
    assert head.one_row_preview == "w8a8" and (head.preview is not None) == int4_preview
    assert head.tune_one_row(_fake_measure({"w8a8": 2.0, "int4": 1.0})) == {"w8a8": 2.0, "int4": 1.0}
    assert head.one_row_preview == "int4" and isinstance(head.preview, Int4Linear) and head.preview.kernel
    x = torch.randn(2, 64)
    assert torch.equal(head.preview_logits(x[:1]), head.preview(x[:1]))  # one row: int4
    assert torch.equal(head.preview_logits(x), head.row_preview(x[:, None])[:, 0])  # two: W8A8
    one = head(x[:1])
    idx = head.preview(x[:1]).topk(16, dim=-1).indices
    assert torch.allclose(one.gather(-1, idx), head.exact(x[:1]).gather(-1, idx), rtol=1e-5, atol=1e-6)
    assert torch.equal(one.argmax(-1), head.exact(x[:1]).argmax(-1))
    other = RescoredHead(w, candidates=16, int4_preview=int4_preview)
    before = resident_bytes(other)["total"]
    other.tune_one_row(_fake_measure({"w8a8": 1.0, "int4": 2.0}))
    assert other.one_row_preview == "w8a8" and (other.preview is not None) == int4_preview
    assert resident_bytes(other)["total"] == before
    assert torch.equal(other.preview_logits(x[:1]), other.row_preview(x[:1, None])[:, 0])


def test_tune_one_row_measures_and_leaves_heads_without_a_choice_alone(monkeypatch):
    head = RescoredHead(torch.randn(256, 64) * 0.1, candidates=8, int4_preview=False)
    times = head.tune_one_row()  # the real timing: flushed caches, median of 7 calls
    assert set(times) == {"w8a8", "int4"} and all(t > 0 for t in times.values())
    assert head.one_row_preview == min(times, key=times.get)
    no_fbgemm = RescoredHead(torch.randn(256, 64) * 0.1, candidates=8)
    no_fbgemm.row_preview = None
    assert no_fbgemm.tune_one_row() == {} and no_fbgemm.one_row_preview == "w8a8"
    fallback = RescoredHead(torch.randn(256, 64) * 0.1, candidates=8, int4_preview=False)
    monkeypatch.setattr(quantize.int4pack, "kernel_unusable", lambda *a: "no kernel here")
    # the int4 copy it would make has no kernel: nothing to gain, nothing kept
    assert fallback.tune_one_row() == {} and fallback.preview is None
