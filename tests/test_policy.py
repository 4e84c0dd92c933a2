"""Skip policies (docs/method.md "The schedule"): invariants for every step, the budget formula
recomputed independently, target-speedup presets, serialisation and argument validation."""

from __future__ import annotations

import json
from decimal import ROUND_HALF_UP, Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skipdecode.policy import (
    FullPolicy,
    LinearDecayPolicy,
    SkipPolicy,
    for_speedup,
    policy_from_dict,
    theoretical_speedup,
)


def reference_budget(max_layers: int, min_layers: int, horizon: int, step: int) -> int:
    """docs/method.md: clamp(round_half_up(e_max - (e_max - e_min) * t / T), e_min, e_max), in Decimal."""
    x = Decimal(max_layers) - Decimal((max_layers - min_layers) * step) / Decimal(horizon)
    rounded = int(x.quantize(Decimal(1), rounding=ROUND_HALF_UP))
    return max(min_layers, min(max_layers, rounded))


@st.composite
def valid_policies(draw):
    num_layers = draw(st.integers(1, 48))
    max_layers = draw(st.integers(1, num_layers))
    min_layers = draw(st.integers(1, max_layers))
    warmup_layers = draw(st.integers(0, min_layers - 1))
    horizon = draw(st.integers(1, 80))
    return LinearDecayPolicy(
        num_layers=num_layers,
        max_layers=max_layers,
        min_layers=min_layers,
        warmup_layers=warmup_layers,
        horizon=horizon,
    )


@settings(max_examples=300, deadline=None)
@given(valid_policies())
def test_linear_decay_invariants_every_step(policy: LinearDecayPolicy):
    L, w = policy.num_layers, policy.warmup_layers
    previous: set[int] | None = None
    previous_budget: int | None = None
    for step in range(policy.horizon + 6):
        active = policy.active_layers(step)
        budget = policy.budget(step)
        expected = reference_budget(policy.max_layers, policy.min_layers, policy.horizon, step)
        assert budget == expected, (step, budget, expected)
        assert policy.min_layers <= budget <= policy.max_layers
        # exactly e(t) distinct layers, ascending, in range
        assert len(active) == budget
        assert list(active) == sorted(set(active))
        assert all(0 <= layer < L for layer in active)
        # warm-up block and the last layer always run; the rest is the top block
        assert set(range(w)) <= set(active)
        assert L - 1 in active
        assert set(active) == set(range(w)) | set(range(L - (budget - w), L))
        # rule 2: the budget never grows and active(t+1) is a subset of active(t)
        if previous is not None:
            assert budget <= previous_budget
            assert set(active) <= previous
        previous, previous_budget = set(active), budget
    # at step 0 the schedule starts at e_max and from step T on it sits at e_min
    assert policy.budget(0) == policy.max_layers
    assert policy.budget(policy.horizon) == policy.min_layers
    assert policy.budget(10 * policy.horizon + 7) == policy.min_layers


def test_budget_rounds_half_up_example():
    # e_max 5, e_min 2, T 4: 5 - 3t/4 = 5, 4.25, 3.5, 2.75, 2 -> 5, 4, 4 (half up), 3, 2
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    assert [policy.budget(t) for t in range(6)] == [5, 4, 4, 3, 2, 2]
    assert policy.active_layers(0) == (0, 2, 3, 4, 5)
    assert policy.active_layers(1) == (0, 3, 4, 5)
    assert policy.active_layers(3) == (0, 4, 5)
    assert policy.active_layers(4) == (0, 5)


def test_warmup_zero_keeps_only_top_block():
    policy = LinearDecayPolicy(num_layers=8, max_layers=6, min_layers=2, warmup_layers=0, horizon=2)
    assert policy.active_layers(0) == (2, 3, 4, 5, 6, 7)
    assert policy.active_layers(1) == (4, 5, 6, 7)
    assert policy.active_layers(2) == (6, 7)


def test_policies_implement_protocol():
    assert isinstance(FullPolicy(4), SkipPolicy)
    assert isinstance(LinearDecayPolicy(4, 3, 2, 1, 8), SkipPolicy)


@pytest.mark.parametrize("speedup,expected", [(2, (21, 9)), (3, (14, 6))])
def test_for_speedup_presets_of_method_md(speedup, expected):
    policy = for_speedup(30, speedup, 28)
    assert isinstance(policy, LinearDecayPolicy)
    assert (policy.max_layers, policy.min_layers) == expected
    assert (policy.num_layers, policy.warmup_layers, policy.horizon) == (30, 1, 28)


def test_for_speedup_one_is_full_depth():
    assert for_speedup(30, 1, 28) == FullPolicy(30)
    assert for_speedup(30, 1.0, 28) == FullPolicy(30)


@settings(max_examples=300, deadline=None)
@given(
    num_layers=st.integers(2, 64),
    fraction=st.floats(0.0, 1.0),
    warmup_layers=st.integers(0, 3),
    horizon=st.integers(1, 64),
)
def test_for_speedup_mean_budget_matches_target(num_layers, fraction, warmup_layers, horizon):
    floor = warmup_layers + 1
    if num_layers < floor:
        return
    max_speedup = num_layers / floor
    speedup = 1.0 + fraction * (max_speedup - 1.0)
    policy = for_speedup(num_layers, speedup, horizon, warmup_layers=warmup_layers)
    if speedup == 1.0:
        assert policy == FullPolicy(num_layers)
        return
    assert isinstance(policy, LinearDecayPolicy)
    assert floor <= policy.min_layers <= policy.max_layers <= num_layers
    assert policy.warmup_layers == warmup_layers and policy.horizon == horizon
    mean = (policy.max_layers + policy.min_layers) / 2
    target = num_layers / speedup
    if policy.min_layers > floor:
        # only integer rounding separates the mean budget from L / s
        assert abs(mean - target) <= 0.5 + 1e-9, (mean, target)
    else:
        # e_min clamped up to the floor: the mean can only sit above the target, by < 1 layer
        assert target - 0.5 - 1e-9 <= mean <= target + 1.0 + 1e-9, (mean, target)


def test_expected_speedup_matches_hand_sum():
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    # budgets at t = 1..6: 4, 4, 3, 2, 2, 2 -> 17 layers
    assert policy.expected_speedup(6) == pytest.approx(6 * 6 / 17)
    assert policy.expected_speedup(1) == pytest.approx(6 / 4)
    with pytest.raises(ValueError, match="num_steps"):
        policy.expected_speedup(0)


@settings(max_examples=100, deadline=None)
@given(valid_policies(), st.integers(1, 100))
def test_expected_speedup_is_layers_over_budgets(policy, num_steps):
    budgets = [reference_budget(policy.max_layers, policy.min_layers, policy.horizon, t) for t in range(1, num_steps + 1)]
    assert policy.expected_speedup(num_steps) == pytest.approx(policy.num_layers * num_steps / sum(budgets))
    assert policy.expected_speedup(num_steps) == pytest.approx(
        theoretical_speedup(policy.num_layers, [policy.budget(t) for t in range(1, num_steps + 1)])
    )


def test_for_speedup_realised_near_target_at_horizon():
    # a 2x preset over its horizon realises close to (a bit under) 2x, as docs/method.md reports (1.77x)
    policy = for_speedup(30, 2, 28)
    assert 1.6 < policy.expected_speedup(28) < 2.2


def test_full_policy():
    policy = FullPolicy(5)
    for step in (0, 1, 7, 1000):
        assert policy.active_layers(step) == (0, 1, 2, 3, 4)
        assert policy.budget(step) == 5
    assert policy.to_dict() == {"type": "full", "num_layers": 5}
    with pytest.raises(ValueError, match="step"):
        policy.active_layers(-1)
    with pytest.raises(ValueError, match="num_layers"):
        FullPolicy(0)


@settings(max_examples=100, deadline=None)
@given(valid_policies())
def test_policy_from_dict_round_trip(policy):
    data = json.loads(json.dumps(policy.to_dict()))
    assert data["type"] == "linear_decay"
    rebuilt = policy_from_dict(data)
    assert rebuilt == policy
    assert [rebuilt.active_layers(t) for t in range(policy.horizon + 2)] == [
        policy.active_layers(t) for t in range(policy.horizon + 2)
    ]


def test_policy_from_dict_full_and_errors():
    assert policy_from_dict(json.loads(json.dumps(FullPolicy(7).to_dict()))) == FullPolicy(7)
    with pytest.raises(ValueError, match="linear_decay"):  # lists the known types
        policy_from_dict({"type": "exponential", "num_layers": 4})
    with pytest.raises(ValueError, match="type"):
        policy_from_dict({"num_layers": 4})
    with pytest.raises(ValueError) as info:
        policy_from_dict({"type": "full", "num_layers": 4, "bogus": 1})
    assert str(info.value) == ("policy of type 'full': unknown field(s) 'bogus' (its fields: num_layers; "
                               "required: num_layers)")
    with pytest.raises(ValueError) as info:  # named by field, not by Python's TypeError about __init__
        policy_from_dict({"type": "linear_decay", "max_layers": 5})
    assert str(info.value).startswith("policy of type 'linear_decay': missing num_layers, min_layers (its fields: "
                                      "num_layers, max_layers, min_layers, warmup_layers, horizon")
    assert "__init__" not in str(info.value)
    with pytest.raises(ValueError, match="min_layers"):
        policy_from_dict({"type": "linear_decay", "num_layers": 6, "max_layers": 3, "min_layers": 5})


GOOD = dict(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


@pytest.mark.parametrize(
    "field,changes",
    [
        ("num_layers", {"num_layers": 0}),
        ("num_layers", {"num_layers": -3}),
        ("max_layers", {"max_layers": 7}),
        ("max_layers", {"max_layers": 0}),
        ("min_layers", {"min_layers": 6, "max_layers": 5}),  # min > max
        ("min_layers", {"min_layers": 0}),
        ("warmup_layers", {"warmup_layers": 2}),  # warmup == min
        ("warmup_layers", {"warmup_layers": 3}),  # warmup > min
        ("warmup_layers", {"warmup_layers": -1}),
        ("horizon", {"horizon": 0}),
        ("num_layers", {"num_layers": 6.0}),  # non-int
        ("max_layers", {"max_layers": "5"}),
        ("min_layers", {"min_layers": 2.5}),
        ("horizon", {"horizon": True}),  # bool is not an int here
    ],
)
def test_linear_decay_rejects_bad_field(field, changes):
    with pytest.raises(ValueError, match=field):
        LinearDecayPolicy(**{**GOOD, **changes})


@pytest.mark.parametrize("step", [-1, 1.5, "2", True])
def test_negative_or_non_int_step_rejected(step):
    policy = LinearDecayPolicy(**GOOD)
    with pytest.raises(ValueError, match="step"):
        policy.active_layers(step)
    with pytest.raises(ValueError, match="step"):
        policy.budget(step)


@pytest.mark.parametrize("speedup", [0.5, 0.999, -2, float("nan"), float("inf"), "2"])
def test_for_speedup_rejects_below_one_or_not_finite(speedup):
    with pytest.raises(ValueError, match="speedup"):
        for_speedup(30, speedup, 28)


def test_for_speedup_rejects_too_large():
    # L = 30, warm-up 1: at least 2 layers per step, so at most 15x
    assert isinstance(for_speedup(30, 15, 28), LinearDecayPolicy)
    with pytest.raises(ValueError, match="speedup"):
        for_speedup(30, 16, 28)
    with pytest.raises(ValueError, match="speedup"):
        for_speedup(30, 8, 28, warmup_layers=3)  # mean 3.75 < 4


def test_for_speedup_rejects_bad_num_layers_and_spread():
    with pytest.raises(ValueError, match="num_layers"):
        for_speedup(0, 2, 28)
    with pytest.raises(ValueError, match="num_layers"):
        for_speedup(30.0, 2, 28)
    with pytest.raises(ValueError, match="spread"):
        for_speedup(30, 2, 28, spread=1.0)
    with pytest.raises(ValueError, match="horizon"):
        for_speedup(30, 2, 0)


def test_theoretical_speedup():
    assert theoretical_speedup(6, []) == 1.0
    assert theoretical_speedup(6, [6, 6, 6]) == 1.0
    assert theoretical_speedup(6, [3, 3]) == pytest.approx(2.0)
    assert theoretical_speedup(30, [21, 15, 9]) == pytest.approx(30 * 3 / 45)
    assert theoretical_speedup(6, (4, 4, 3, 2)) == pytest.approx(24 / 13)
