"""Compiled decode-step calls that skip dynamo's guard check for inputs it already checked
(:mod:`skipdecode.guard_memo`): same tokens and logits as eager, the check skipped for most calls,
layers that differ kept apart, changes seen after ``invalidate``, graph breaks never memoised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from skipdecode import guard_memo
from skipdecode.compiled import compile_adapter
from skipdecode.guard_memo import GuardMemo, signature
from skipdecode.lowrank import PrefillSwitch
from skipdecode.model import SkipModel

from conftest import make_model
from test_compiled import assert_equal_runs


def _pair(tokenizer, change=None, num_layers=4):
    """An eager and a compiled (aot_eager; variants compile on first use, no warm-up) tiny llama;
    ``change(model)`` first."""
    torch._dynamo.reset()
    models = [make_model("llama", num_layers), make_model("llama", num_layers)]
    if change is not None:
        for m in models:
            change(m)
    eager, compiled = (SkipModel(m, tokenizer) for m in models)
    report = compile_adapter(compiled.adapter, backend="aot_eager")
    assert report.enabled, report.error
    return eager, compiled, report


def test_memoised_calls_equal_eager_and_skip_most_checks(tokenizer):
    eager, compiled, report = _pair(tokenizer)
    before = report.guard_checks()
    assert_equal_runs(eager, compiled)
    after = report.guard_checks()
    direct, checked = after["direct"] - before["direct"], after["checked"] - before["checked"]
    # 2 runs x 8 tokens x (<= 4 layers + head): each step checks its first call of a key length
    assert direct > checked > 0
    assert report.to_dict()["guard_checks"] == after


def test_prefill_layer_calls_skip_the_check_after_the_first_layer(tokenizer):
    """A compiled prefill's layers share one signature: the first layer's call is checked, the
    others run the code it chose (each layer's very first prefill runs eagerly, to learn its
    cache geometry)."""
    eager, compiled, report = _pair(tokenizer)
    prefill = next(m for m in report.memos if m.name == "_prefill_layer")
    assert_equal_runs(eager, compiled)  # two compiled runs: an eager prefill, then a compiled one
    assert prefill.checked >= 1 and prefill.direct >= 3 * prefill.checked  # 4 layers


def _gelu_in_layer_one(model):
    model.model.layers[1].mlp.act_fn = nn.GELU()


def test_layers_of_another_structure_get_their_own_compiled_code(tokenizer):
    """Layer 1's activation differs: its calls must not run the code compiled for the others."""
    eager, compiled, report = _pair(tokenizer, _gelu_in_layer_one)
    assert_equal_runs(eager, compiled)
    assert report.guard_checks()["direct"] > 0


def test_invalidate_makes_a_changed_layer_checked_again(tokenizer):
    eager, compiled, report = _pair(tokenizer)
    assert_equal_runs(eager, compiled)  # memo filled for four identical layers
    for sk in (eager, compiled):
        _gelu_in_layer_one(sk.model)
    guard_memo.invalidate()
    assert_equal_runs(eager, compiled)


def test_signature_tells_apart_what_a_guard_can_read():
    layer = nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    key = signature(layer, (x, 3, None))
    assert key == signature(layer, (torch.randn(2, 4), 3, None))  # values of tensors do not matter
    assert key != signature(layer, (torch.randn(3, 4), 3, None))  # sizes
    assert key != signature(layer, (torch.randn(4, 2).t(), 3, None))  # strides
    assert key != signature(layer, (x.double(), 3, None))  # dtype
    assert key != signature(layer, (x, 4, None))  # plain values
    assert key != signature(layer, (x, True, None))  # ... and their types
    assert key != signature(nn.Linear(4, 5).eval(), (x, 3, None))  # another structure
    layer.train()
    assert key != signature(layer, (x, 3, None))
    layer.eval()
    with torch.inference_mode():
        assert key != signature(layer, (x, 3, None))
    assert signature(layer, (object(),)) is None  # nothing it can describe: always checked


def test_signature_follows_the_prefill_switch_and_invalidate():
    layer = nn.Sequential(nn.Linear(4, 4))
    layer[0].switch = PrefillSwitch()
    x = torch.randn(1, 4)
    key = signature(layer, (x,))
    layer[0].switch.base = True
    assert signature(layer, (x,)) != key
    layer[0].switch.base = False
    assert signature(layer, (x,)) == key
    guard_memo.invalidate()
    assert signature(layer, (x,)) != key  # the epoch is part of every key


def _with_break(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


def _plain(x):
    return x * 2 + 1


@pytest.mark.parametrize("fn,memoised", [(_with_break, False), (_plain, True)])
def test_only_code_without_graph_breaks_is_memoised(fn, memoised):
    torch._dynamo.reset()
    memo = GuardMemo(fn, torch.compile(fn, backend="eager"))
    x = torch.arange(3.0)
    key = signature(nn.Identity(), (x,))
    for _ in range(3):
        assert torch.equal(memo(key, x), x * 2 + 1)
    assert (memo.direct, memo.checked) == ((2, 1) if memoised else (0, 3))
    assert torch.equal(memo(None, x), x * 2 + 1) and memo.checked == (2 if memoised else 4)  # no key: checked


def test_without_dynamos_cache_list_every_call_is_checked(tokenizer, monkeypatch):
    """Where the private cache-list helper is missing (another PyTorch), nothing is memoised."""
    monkeypatch.setattr(guard_memo, "available", lambda: False)
    eager, compiled, report = _pair(tokenizer)
    assert_equal_runs(eager, compiled)
    checks = report.guard_checks()
    assert checks["direct"] == 0 and checks["checked"] > 0


def _scaled(x, n):
    return x * n + 1


def test_a_call_dynamo_ran_eagerly_past_the_recompile_limit_is_never_memoised():
    """Past ``recompile_limit`` dynamo runs a new signature eagerly and leaves its cache list as it
    was: the first entry then belongs to other inputs (here n == 3, specialised). Memoising it for
    n == 4 would give x * 3 + 1 (4 for x = 1) instead of x * 4 + 1 (5), silently; the memo checks
    the entry's guards against the call's arguments and keeps such a signature checked."""
    torch._dynamo.reset()
    memo = GuardMemo(_scaled, torch.compile(_scaled, backend="eager"))
    x = torch.ones(2)
    with torch._dynamo.config.patch(recompile_limit=1, automatic_dynamic_shapes=False):
        assert torch.equal(memo((3,), x, 3), x * 3 + 1)
        for _ in range(3):
            assert torch.equal(memo((4,), x, 4), x * 4 + 1)  # eager each time: checked
        assert torch.equal(memo((3,), x, 3), x * 3 + 1)  # the compiled entry is its own
    assert (memo.checked, memo.direct) == (4, 1)
