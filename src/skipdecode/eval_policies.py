"""Which rows an evaluation runs for one model: a :data:`PolicySpec` turned into a named policy
(:func:`resolve_policy`), and a model's rows, reference first, with the policy or CALM exit rule
each one decodes with (:func:`plan_rows`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

from .eval_report import EvalRow
from .jsonio import dumps
from .policy import FullPolicy, LinearDecayPolicy, SkipPolicy, check_policy, policy_from_dict

__all__ = ["PolicySpec", "resolve_policy", "policy_summary", "is_single_spec", "plan_rows"]


#: A policy request: ``"full"``, ``"checkpoint"`` (the model's own policy), a target speedup
#: (float >= 1, turned into a policy by ``SkipModel.policy_for``), a policy dict
#: (``policy_from_dict``; ``num_layers`` may be left out: the model's), a policy object, or a
#: ``(name, spec)`` pair naming any of these.
PolicySpec = Union[str, float, int, dict, SkipPolicy, tuple]


def policy_summary(policy: Any) -> str:
    """Human-readable schedule of ``policy`` (a SkipDecode policy or a CALM config), the ``description``
    of its row: ``"full (30 layers)"``, ``"linear 21->9 over 28 steps, warm-up 1"``, a CALM rule, else
    the policy's sorted JSON. Never raises on an object with ``to_dict()`` or a mapping."""
    if isinstance(policy, FullPolicy):
        return f"full ({policy.num_layers} layers)"
    if isinstance(policy, LinearDecayPolicy):
        first = f"{policy.full_depth_steps} full-depth steps, then " if policy.full_depth_steps else ""
        return (f"{first}linear {policy.max_layers}->{policy.min_layers} over {policy.horizon} steps, "
                f"warm-up {policy.warmup_layers}")
    d = policy.to_dict() if hasattr(policy, "to_dict") else dict(policy)
    if d.get("type") == "calm":
        return f"CALM early exit, top-2 margin >= {d['threshold']:g}, min {d['min_layers']} layers"
    return dumps(d, sort_keys=True)


def resolve_policy(model, spec: PolicySpec, *, horizon: int | None = None) -> tuple[str, SkipPolicy]:
    """Turn a :data:`PolicySpec` into ``(name, policy)`` for ``model``.

    Names: ``"full"``, ``"checkpoint"``, ``"{s:g}x"`` for a speedup (``"full"`` for 1), the given
    name of a ``(name, spec)`` pair, else ``"custom"``.

    Args:
        model: :class:`skipdecode.model.SkipModel`.
        spec: see :data:`PolicySpec`. Strings may also be a number (``"2"``, ``"2x"``) or a JSON
            policy dict.
        horizon: horizon T (tokens) for speedup policies (None: the model's).

    Raises:
        ValueError: unknown string, speedup < 1 or too large for the model, invalid policy dict, or
            a policy whose ``num_layers`` differs from the model's.
    """
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], str) or not spec[0].strip():
            raise ValueError(f"a named policy must be a (name, spec) pair, got {spec!r}")
        return spec[0].strip(), resolve_policy(model, spec[1], horizon=horizon)[1]
    if isinstance(spec, str):
        text = spec.strip()
        low = text.lower()
        if low in ("full", "1x", "none"):
            return "full", FullPolicy(model.num_layers)
        if low in ("checkpoint", "ckpt", "default"):
            return "checkpoint", model.policy
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"policy {spec!r} is not valid JSON: {e}") from None
        else:
            try:
                spec = float(low[:-1] if low.endswith("x") else low)
            except ValueError:
                raise ValueError(
                    f"unknown policy {spec!r}; use 'full', 'checkpoint', a speedup such as '2' "
                    "or '2x', or a JSON policy dict"
                ) from None
    if isinstance(spec, bool):
        raise ValueError(f"unknown policy {spec!r}")
    if isinstance(spec, (int, float)):
        policy = model.policy_for(speedup=float(spec), horizon=horizon)
        return ("full" if isinstance(policy, FullPolicy) else f"{float(spec):g}x"), policy
    if isinstance(spec, dict):  # num_layers may be left out: the model's
        policy = policy_from_dict(spec, num_layers=model.num_layers)
    else:
        policy = spec
    if policy is None or not isinstance(policy, SkipPolicy):
        raise ValueError(f"not a policy: {spec!r}")
    policy = check_policy(policy, model.num_layers)
    return ("full" if isinstance(policy, FullPolicy) else "custom"), policy


def is_single_spec(x: Any) -> bool:
    """True for one :data:`PolicySpec` (a policy dict has a ``type`` key; a label mapping has not).

    Strings, numbers and policy objects are single specs; lists, tuples and label mappings are not.
    Never raises."""
    if isinstance(x, Mapping):
        return "type" in x
    return isinstance(x, (str, int, float)) or hasattr(x, "active_layers")


def _resolved_specs(model, label: str, policies: Any, horizon: int | None) -> list[tuple[str, Any]]:
    """``(name, policy)`` of every policy ``label`` asks for, full depth first; a policy equal to an
    earlier one is merged into it (its name joined with ``" = "``, never into ``"full"``)."""
    if isinstance(policies, Mapping):
        specs = policies.get(label, ["checkpoint"])
        specs = [specs] if is_single_spec(specs) else list(specs)
    elif policies is None:
        specs = ["checkpoint"]
    else:
        specs = list(policies)
    resolved: list[tuple[str, Any]] = [("full", FullPolicy(model.num_layers))]
    for s in specs:
        name, pol = resolve_policy(model, s, horizon=horizon)
        for i, (n, p) in enumerate(resolved):
            if p.to_dict() == pol.to_dict():
                if name not in n.split(" = ") and name != "full":
                    resolved[i] = (f"{n} = {name}" if n != "full" else n, p)
                break
        else:
            resolved.append((name, pol))
    return resolved


def _calm_rows(model, label: str, batch_size: int, calm_cfgs: Sequence[Any]) -> tuple[list[EvalRow], list[Any]]:
    """CALM rows (batch 1) of one model, after a full-depth batch-1 reference row when the harness
    batch is larger, and the plan (policy or CALM config) of each."""
    rows, plans = [], []
    ref1 = "full"
    if batch_size != 1:
        ref1 = "full@bs1"
        pol = FullPolicy(model.num_layers)
        rows.append(EvalRow(
            model=label, policy=ref1, policy_config=pol.to_dict(),
            description=policy_summary(pol) + ", batch 1 (CALM's reference)", kind="skipdecode",
            reference=True, reference_policy=ref1, batch_size=1, num_layers=model.num_layers,
        ))
        plans.append(pol)
    for cfg in calm_cfgs:
        if cfg.min_layers > model.num_layers:
            raise ValueError(f"calm_min_layers must be <= the model's {model.num_layers} layers, got {cfg.min_layers}")
        rows.append(EvalRow(
            model=label, policy=f"calm@{cfg.threshold:g}", policy_config=cfg.to_dict(),
            description=policy_summary(cfg), kind="calm", reference=False, reference_policy=ref1,
            batch_size=1, num_layers=model.num_layers,
        ))
        plans.append(cfg)
    return rows, plans


def plan_rows(model, label: str, *, policies: Any, horizon: int | None, batch_size: int,
              calm_cfgs: Sequence[Any], calm_models: Sequence[str] | None) -> tuple[list[EvalRow], list[Any]]:
    """The rows of one model (empty sums), reference first, and the plan each one decodes with.

    Args:
        model: :class:`skipdecode.model.SkipModel`.
        label: the model's label (``EvalRow.model``).
        policies: as :func:`skipdecode.evaluate.evaluate` takes them: a :data:`PolicySpec` list, a
            mapping label -> list or spec (a label not in it gets ``"checkpoint"``), or None
            (``"checkpoint"``).
        horizon: horizon T (tokens) of speedup policies (None: the model's).
        batch_size: prompts per generation call of the SkipDecode rows.
        calm_cfgs: :class:`skipdecode.calm.CalmConfig` of each CALM row (batch 1).
        calm_models: labels of the models that get the CALM rows (None: all).

    Returns:
        ``(rows, plans)``: one :class:`EvalRow` per distinct policy (the full-depth reference
        first, equal policies merged), then, with CALM rows, a full-depth batch-1 reference when
        ``batch_size`` != 1 and one row per CALM config; ``plans[i]`` is row i's policy or config.

    Raises:
        ValueError: an invalid policy spec (:func:`resolve_policy`), or a CALM ``min_layers``
            above the model's ``num_layers``.
    """
    rows, plans = [], []
    for name, pol in _resolved_specs(model, label, policies, horizon):
        rows.append(EvalRow(
            model=label, policy=name, policy_config=pol.to_dict(), description=policy_summary(pol),
            kind="skipdecode", reference=name == "full", reference_policy="full", batch_size=batch_size,
            num_layers=model.num_layers,
        ))
        plans.append(pol)
    if calm_cfgs and (calm_models is None or label in calm_models):
        calm_rows, calm_plans = _calm_rows(model, label, batch_size, calm_cfgs)
        rows += calm_rows
        plans += calm_plans
    return rows, plans
