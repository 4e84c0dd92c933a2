"""Skip policies: which layers run at each decode step (SkipDecode, arXiv 2307.02628, Sec. 3).

Pure Python, no torch. A policy maps a decode ``step`` (index of the generated token, see
docs/method.md: step 0 is produced by the full-depth prefill, decode step t >= 1 feeds generated token
t-1) to the tuple of ``active_layers`` (0-indexed layer indices, ascending). Three rules hold for
every policy here (tested with hypothesis):

1. the plan depends only on the step, never on token content (one plan per batch step);
2. ``active_layers(t + 1)`` is a subset of ``active_layers(t)``, so the exit point never increases;
3. the bottom ``warmup_layers`` and the top ``e(t) - warmup_layers`` layers run; the last layer
   always runs, and the model's own final norm and LM head follow.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "SkipPolicy",
    "check_policy",
    "plan_layers",
    "FullPolicy",
    "LinearDecayPolicy",
    "for_speedup",
    "policy_from_dict",
    "theoretical_speedup",
    "speedup_label",
    "with_full_depth_steps",
]


@runtime_checkable
class SkipPolicy(Protocol):
    """Protocol every policy implements.

    Attributes:
        num_layers: L, the number of decoder layers of the model (layers).
    """

    num_layers: int

    def active_layers(self, step: int) -> tuple[int, ...]:
        """Layer indices (ascending, 0-indexed) run at decode ``step`` (>= 0)."""

    def budget(self, step: int) -> int:
        """Number of layers e(t) run at decode ``step`` (== len(active_layers(step)))."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable description, inverse of :func:`policy_from_dict`."""


def _check_int(name: str, value: Any, low: int, high: int | None = None, high_is: str = "") -> None:
    """ValueError naming ``name`` unless ``value`` is an int in [low, high] (``high_is``: where
    the upper bound comes from, said in the message, e.g. ``"max_layers"``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]" + (f" (at most {high_is})" if high_is else "")
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")


@dataclass(frozen=True)
class FullPolicy:
    """Run every layer at every step (the 1x baseline and the reference for correctness).

    Args:
        num_layers: L (layers), >= 1.

    Raises:
        ValueError: ``num_layers`` is not a positive integer.
    """

    num_layers: int

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)

    def active_layers(self, step: int) -> tuple[int, ...]:
        """All layers ``(0, ..., L-1)`` for any ``step`` >= 0; raises ValueError on a bad step."""
        _check_step(step)
        return tuple(range(self.num_layers))

    def budget(self, step: int) -> int:
        """Always L (layers)."""
        _check_step(step)
        return self.num_layers

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "full", "num_layers": L}``."""
        return {"type": "full", "num_layers": self.num_layers}


@dataclass(frozen=True)
class LinearDecayPolicy:
    """SkipDecode's linear-decay schedule (docs/method.md "The schedule"; paper Sec. 3.2).

    ``e(t) = clamp(round_half_up(max_layers - (max_layers - min_layers) * t / horizon),
    min_layers, max_layers)`` and ``active(t) = {0..w-1} U {L-(e(t)-w) .. L-1}`` with
    ``w = warmup_layers``. Arithmetic is exact (``fractions.Fraction``), so rounding never
    depends on float error.

    Args:
        num_layers: L, decoder layers of the model, >= 2.
        max_layers: e_max, budget at step 0 (layers), ``min_layers <= max_layers <= L``.
        min_layers: e_min, floor of the budget (layers), ``warmup_layers < min_layers``.
        warmup_layers: w, bottom layers that always run (default 1), ``0 <= w < min_layers``
            so that the last layer always runs.
        horizon: T, decode steps over which the budget decays from e_max to e_min (tokens);
            the paper sets it to the median target length of the training data. >= 1.
        full_depth_steps: k, decode steps 1..k that run all L layers before the decay starts
            (default 0, the paper's schedule): step ``k + j`` runs what step ``j`` runs without
            them. A project extension (docs/results.md, "Full-depth first steps"): most answers
            part from the full-depth model's in their first tokens, and a decode step that runs
            every layer runs the base model's weights (:mod:`skipdecode.lowrank`), so these k
            tokens are the full-depth model's own. The budget stays non-increasing in t, so the
            KV cache invariant of docs/method.md holds. >= 0.

    Raises:
        ValueError: a field is out of range; the message names the field and the allowed range.
    """

    num_layers: int
    max_layers: int
    min_layers: int
    warmup_layers: int = 1
    horizon: int = 32
    full_depth_steps: int = 0

    def __post_init__(self) -> None:
        _check_int("num_layers", self.num_layers, 1)
        _check_int("max_layers", self.max_layers, 1, self.num_layers, "the model's layers")
        _check_int("min_layers", self.min_layers, 1, self.max_layers, "max_layers")
        _check_int("warmup_layers", self.warmup_layers, 0)
        if self.warmup_layers >= self.min_layers:
            raise ValueError(
                f"warmup_layers must be < min_layers ({self.min_layers}) so that the top layer "
                f"always runs, got {self.warmup_layers}"
            )
        _check_int("horizon", self.horizon, 1)
        _check_int("full_depth_steps", self.full_depth_steps, 0)

    def budget(self, step: int) -> int:
        """e(t): number of layers run at decode ``step`` (layers): L for ``1 <= step <= k``
        (``full_depth_steps``), else the decay at ``step - k``. Raises ValueError on bad step."""
        _check_step(step)
        k = self.full_depth_steps
        if k and 1 <= step <= k:
            return self.num_layers
        return _budget(self.max_layers, self.min_layers, self.horizon, step - k if step > k else step)

    def active_layers(self, step: int) -> tuple[int, ...]:
        """Ascending layer indices run at ``step``: warm-up block then the top ``e(t)-w`` layers."""
        e = self.budget(step)
        if e == self.num_layers:
            return tuple(range(e))
        w = self.warmup_layers
        return tuple(range(w)) + tuple(range(self.num_layers - (e - w), self.num_layers))

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "linear_decay", ...fields}`` (JSON-serialisable); ``full_depth_steps`` only
        when it is not 0, so that the paper's schedule keeps the dict it always had."""
        d = {"type": "linear_decay", **asdict(self)}
        if not self.full_depth_steps:
            del d["full_depth_steps"]
        return d

    def expected_speedup(self, num_steps: int) -> float:
        """Theoretical speedup L * n / sum_{t=1..n} e(t) over decode steps 1..``num_steps``.

        docs/method.md "Target speedup"; token 0 comes from the full-depth prefill and is excluded.
        Raises ValueError if ``num_steps`` < 1.
        """
        _check_int("num_steps", num_steps, 1)
        total = sum(self.budget(t) for t in range(1, num_steps + 1))
        return self.num_layers * num_steps / total


@lru_cache(maxsize=65536)
def _budget(max_layers: int, min_layers: int, horizon: int, step: int) -> int:
    x = Fraction(max_layers) - Fraction((max_layers - min_layers) * step, horizon)
    rounded = math.floor(x + Fraction(1, 2))  # round half up, monotone in x
    return max(min_layers, min(max_layers, rounded))


def for_speedup(
    num_layers: int,
    speedup: float,
    horizon: int,
    *,
    warmup_layers: int = 1,
    spread: float = 0.4,
) -> LinearDecayPolicy | FullPolicy:
    """Pick ``max_layers``/``min_layers`` for a target ``speedup`` (docs/method.md "Target speedup").

    The mean budget ``(e_max + e_min) / 2`` is set to ``L / speedup`` and the two bounds sit
    ``spread`` of that mean above and below it: ``e_max = round(mean * (1 + spread))``,
    ``e_min = 2 * mean - e_max`` (so the mean is kept), then clamped to
    ``[warmup_layers + 1, L]``. For L = 30 this gives 2x -> (21, 9) and 3x -> (14, 6), the
    settings probed in docs/method.md. A speedup of 1 returns :class:`FullPolicy`.

    Args:
        num_layers: L (layers).
        speedup: target ratio of full-depth to skipped compute, >= 1.
        horizon: T (tokens), see :class:`LinearDecayPolicy`.
        warmup_layers: w (layers).
        spread: relative half-width of the schedule, in [0, 1).

    Raises:
        ValueError: ``speedup`` < 1 or not finite, or a speedup so large that the mean budget
            falls below ``warmup_layers + 1`` layers; other fields as in LinearDecayPolicy.
    """
    _check_int("num_layers", num_layers, 1)
    if not isinstance(speedup, (int, float)) or not math.isfinite(speedup) or speedup < 1:
        raise ValueError(f"speedup must be a finite number >= 1, got {speedup!r}")
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread!r}")
    if speedup == 1:
        return FullPolicy(num_layers)
    _check_int("warmup_layers", warmup_layers, 0)
    if warmup_layers >= num_layers:  # the field at fault, not the speedup it would constrain
        raise ValueError(f"warmup_layers must be < the model's {num_layers} layers to leave a layer to skip, "
                         f"got {warmup_layers}")
    mean = num_layers / speedup
    floor = warmup_layers + 1
    if mean < floor:
        raise ValueError(
            f"speedup must be <= {num_layers / floor:.2f} for a model of {num_layers} layers with "
            f"warmup_layers={warmup_layers} (at least {floor} layers per step), got {speedup}"
        )
    e_max = min(num_layers, math.floor(mean * (1 + spread) + 0.5))
    e_min = max(floor, math.floor(2 * mean - e_max + 0.5))
    e_min = min(e_min, e_max)
    return LinearDecayPolicy(
        num_layers=num_layers,
        max_layers=e_max,
        min_layers=e_min,
        warmup_layers=warmup_layers,
        horizon=horizon,
    )


def check_policy(policy: Any, num_layers: int) -> SkipPolicy:
    """``policy`` for a model of ``num_layers`` layers: itself, or :class:`FullPolicy` when None.

    Raises:
        ValueError: ``policy`` is not None or a policy object (:class:`SkipPolicy`: a
            :class:`FullPolicy`, :class:`LinearDecayPolicy`, :func:`for_speedup`'s result; a name
            such as ``"fast"`` or a dict is not one), or its ``num_layers`` differs from the model's
            (both messages start with ``policy``).
    """
    if policy is None:
        return FullPolicy(num_layers)
    if not isinstance(policy, SkipPolicy):
        raise ValueError(
            f"policy must be None or a policy object (FullPolicy, LinearDecayPolicy, for_speedup(...), "
            f"SkipModel.policy_for(...); policy_from_dict(...) for a dict), got {type(policy).__name__} {policy!r}"
        )
    if policy.num_layers != num_layers:
        raise ValueError(f"policy.num_layers ({policy.num_layers}) must equal the model's num_layers ({num_layers})")
    plan_layers(policy, 1)  # a policy of one's own: its first decode step's plan is checked before any work
    return policy


def plan_layers(policy: SkipPolicy, step: int) -> tuple[int, ...]:
    """``policy.active_layers(step)``, checked: the layers (0-indexed) decode ``step`` runs.

    The policies of this module hold the rules by construction and are returned as they are. A
    policy of one's own (any object with the :class:`SkipPolicy` methods) is checked at each
    step against what every plan needs: at least one layer, integers ascending without repeats,
    each in ``[0, L)``, the last layer ``L - 1`` among them (the model's final norm and LM head
    read its output; module docstring, rule 3). Rule 2 (a layer skipped once never runs again)
    spans steps and is checked by the KV cache, which raises RuntimeError when it is broken.

    Raises:
        ValueError: the plan breaks a rule; the message starts with ``policy.active_layers(step)``.
    """
    active = policy.active_layers(step)
    if type(policy) in (FullPolicy, LinearDecayPolicy):
        return active
    L = policy.num_layers
    where = f"policy.active_layers({step})"
    try:
        items = tuple(active)
    except TypeError:
        raise ValueError(f"{where} must return a sequence of layer indices, got {active!r}") from None
    try:  # ints and integer-like values (numpy integers: operator.index); never bools
        if any(isinstance(i, bool) for i in items):
            raise TypeError
        layers = tuple(operator.index(i) for i in items)
    except TypeError:
        raise ValueError(f"{where} must hold integer layer indices, got {items!r}") from None
    if not layers or layers[-1] != L - 1 or layers[0] < 0 or any(a >= b for a, b in zip(layers, layers[1:])):
        raise ValueError(
            f"{where} must be ascending layer indices in [0, {L}) without repeats, ending with the "
            f"last layer {L - 1} (its output feeds the LM head), got {layers!r}"
        )
    return layers


def with_full_depth_steps(policy: Any, k: int | None) -> Any:
    """``policy`` with :attr:`LinearDecayPolicy.full_depth_steps` set to ``k`` (decode steps), or
    ``policy`` itself when ``k`` is None or it is not a linear decay (a full-depth policy has
    nothing to add). Raises ValueError (naming ``full_depth_steps``) for a bad ``k``."""
    if k is None or not isinstance(policy, LinearDecayPolicy):
        return policy
    return replace(policy, full_depth_steps=k)


def speedup_label(speedup: float) -> str:
    """A speedup as the label a checkpoint's ``skipdecode.json`` ``policies`` use for it:
    ``format(float(speedup), "g")`` (2 -> ``"2"``, 2.5 -> ``"2.5"``)."""
    return format(float(speedup), "g")


def policy_from_dict(data: dict[str, Any], num_layers: int | None = None) -> LinearDecayPolicy | FullPolicy:
    """Rebuild a policy from :meth:`to_dict` output (e.g. a checkpoint's ``skipdecode.json``).

    Args:
        data: ``{"type": "full" | "linear_decay", <the type's fields>}``.
        num_layers: the model's layer count, used when ``data`` has no ``num_layers`` (which is
            then not listed as required); None: ``data`` must give it.

    Raises:
        ValueError: unknown ``type`` (lists the known ones), or fields missing or unknown for the
            type (names them and lists the type's fields and the required ones).
    """
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"policy must be a dict with a 'type' key, got {data!r}")
    kinds = {"full": FullPolicy, "linear_decay": LinearDecayPolicy}
    kind = data["type"]
    if not isinstance(kind, str) or kind not in kinds:
        raise ValueError(f"policy type must be one of 'full', 'linear_decay'; got {kind!r}")
    cls = kinds[kind]
    fields = {k: v for k, v in data.items() if k != "type"}
    if num_layers is not None:
        fields.setdefault("num_layers", num_layers)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    required = [f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                and not (f.name == "num_layers" and num_layers is not None)]
    unknown = [k for k in fields if k not in known]
    missing = [k for k in required if k not in fields]
    if unknown or missing:
        what = "; ".join(part for part in (
            f"unknown field(s) {', '.join(map(repr, unknown))}" if unknown else "",
            f"missing {', '.join(missing)}" if missing else "") if part)
        raise ValueError(f"policy of type {kind!r}: {what} (its fields: {', '.join(known)}; "
                         f"required: {', '.join(required) or 'none'})")
    return cls(**fields)


def theoretical_speedup(num_layers: int, layers_run: list[int] | tuple[int, ...]) -> float:
    """``L * len(layers_run) / sum(layers_run)``: docs/method.md's theoretical (compute) speedup.

    Args:
        num_layers: L (layers).
        layers_run: number of layers run at each decode step t >= 1 (the full-depth prefill
            and token 0 are excluded by definition).

    Returns:
        The ratio (1.0 when ``layers_run`` is empty: no decode step, nothing skipped).
    """
    if not layers_run:
        return 1.0
    return num_layers * len(layers_run) / sum(layers_run)
