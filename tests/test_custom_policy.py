"""A skip policy of one's own (any object with the SkipPolicy methods): a sound one runs exactly as
the built-in policy with the same plans, statically, in flight and in training's layer table; one
that breaks a plan rule is refused with a ValueError naming ``policy.active_layers(step)``, never
run into wrong text or a deep IndexError (skipdecode.policy.plan_layers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from conftest import make_model
from skipdecode import LinearDecayPolicy, SkipModel
from skipdecode.policy import check_policy, plan_layers
from skipdecode.training.batching import build_layer_mask

L = 6
REFERENCE = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


@dataclass
class OwnPolicy:
    """A policy of one's own: ``plan(step)`` gives the layers of each decode step."""

    plan: Callable[[int], object]
    num_layers: int = L

    def active_layers(self, step: int):
        return self.plan(step)

    def budget(self, step: int) -> int:
        return len(tuple(self.plan(step)))

    def to_dict(self) -> dict:
        return {"type": "own"}


@pytest.fixture(scope="module")
def sk(tokenizer):
    return SkipModel(make_model("llama", L), tokenizer)


def test_a_sound_policy_of_ones_own_runs_as_the_builtin_with_the_same_plans(sk):
    import numpy as np

    own = OwnPolicy(lambda t: np.array(REFERENCE.active_layers(t)))  # an array of numpy integers: accepted
    for kw in ({}, {"max_batch_size": 2}):
        want = sk.generate(["The Eagle", "a b c"], policy=REFERENCE, max_new_tokens=8, **kw)
        got = sk.generate(["The Eagle", "a b c"], policy=own, max_new_tokens=8, **kw)
        assert got.token_ids == want.token_ids
        assert got.layers_run == want.layers_run and got.theoretical_speedup > 1
    table = build_layer_mask(own, torch.tensor([2]), torch.tensor([7]), 7, L)
    assert torch.equal(table, build_layer_mask(REFERENCE, torch.tensor([2]), torch.tensor([7]), 7, L))


BROKEN = {
    "reversed": lambda t: tuple(reversed(range(L))),
    "empty": lambda t: (),
    "no last layer": lambda t: (0, 1, 2),
    "past the last layer": lambda t: (0, L - 1, L),
    "negative": lambda t: (-1, L - 1),
    "repeated": lambda t: (0, 0, L - 1),
    "not integers": lambda t: (0.0, float(L - 1)),
    "booleans": lambda t: (False, True) if L == 2 else (True, L - 1),
    "not a sequence": lambda t: 3,
}


@pytest.mark.parametrize("plan", BROKEN.values(), ids=BROKEN.keys())
def test_a_broken_plan_is_refused_before_any_work(sk, plan):
    own = OwnPolicy(plan)
    with pytest.raises(ValueError, match=r"^policy\.active_layers\(1\)"):
        check_policy(own, L)
    for kw in ({}, {"max_batch_size": 2}):
        with pytest.raises(ValueError, match=r"^policy\.active_layers\(1\)"):
            sk.generate(["The Eagle"], policy=own, max_new_tokens=4, **kw)


def test_a_plan_broken_at_a_later_step_is_refused_at_that_step(sk):
    own = OwnPolicy(lambda t: REFERENCE.active_layers(t) if t < 3 else tuple(reversed(REFERENCE.active_layers(t))))
    assert plan_layers(own, 2) == REFERENCE.active_layers(2)
    for kw in ({}, {"max_batch_size": 2}):
        with pytest.raises(ValueError, match=r"^policy\.active_layers\(3\) must be ascending"):
            sk.generate(["The Eagle"], policy=own, max_new_tokens=6, **kw)
    with pytest.raises(ValueError, match=r"^policy\.active_layers\(3\)"):
        build_layer_mask(own, torch.tensor([2]), torch.tensor([7]), 7, L)



def test_evaluate_takes_a_policy_of_ones_own_as_a_named_row(sk):
    from skipdecode.data.records import EvalItem
    from skipdecode.evaluate import evaluate

    own = OwnPolicy(lambda t: REFERENCE.active_layers(t))
    items = [EvalItem(prompt=p, references=("x y",), source=p) for p in ("The Eagle", "a b c", "name")]
    report = evaluate(sk, items, [("own", own), ("reference", REFERENCE)], max_new_tokens=6, batch_size=2,
                      inflight=True, warmup=False)
    label = report.rows[0].model
    assert report.row(label, "own").generations == report.row(label, "reference").generations
    assert report.row(label, "own").mean_active_layers == report.row(label, "reference").mean_active_layers < L
    assert report.to_markdown().startswith("# Evaluation: items given in Python (3 items")
