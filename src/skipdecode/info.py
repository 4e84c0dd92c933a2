"""What ``skipdecode info`` reports about a loaded model: a full record (``--json``) and a short
summary of it for people (the default).

The record holds the model's source, architecture, layer count, default policy, chat setting,
skip adapter (:func:`skipdecode.skip_adapter.adapter_summary`), attached entry bridge
(:func:`skipdecode.skip_adapter.entry_bridge_summary`) and the checkpoint's ``skipdecode.json``.
The summary is about a dozen lines: the training records and per-layer lists stay in the record.
"""

from __future__ import annotations

from typing import Any

__all__ = ["model_info", "describe_policy", "info_lines"]


def _entry_bridge_info(sk: Any) -> dict | None:
    """The attached entry bridge (:mod:`skipdecode.entry_bridge`) as
    :func:`skipdecode.skip_adapter.entry_bridge_summary` gives it plus the folder it came from;
    None when none is attached."""
    from .entry_bridge import entry_bridge_of
    from .skip_adapter import entry_bridge_summary

    bridge = entry_bridge_of(sk.model)
    if bridge is None:
        return None
    if sk.entry_bridge_path is None:  # attached in memory, not read from a folder
        return {"source": bridge.source, "hidden_size": int(bridge.weight.shape[-1]),
                "targets": {"count": len(bridge.targets), "first": bridge.targets[0], "last": bridge.targets[-1]}}
    return {**entry_bridge_summary(sk.entry_bridge_path), "path": str(sk.entry_bridge_path)}


def model_info(sk: Any) -> dict[str, Any]:
    """The full record of ``skipdecode info --json`` for the :class:`~skipdecode.model.SkipModel`
    ``sk``: ``source``, ``model_type``, ``num_layers`` (layers), ``policy`` (its ``to_dict()``: the model's default
    schedule), ``speedup_horizon`` (tokens: the horizon of the generic schedules ``--speedup``
    builds where the model has no schedule of its own for that speedup; not the default schedule's),
    ``chat``, ``quantize`` (``"int8"``/``"int4"`` or None), ``dtype`` (of the float weights, e.g.
    ``"float32"``), ``skip_adapter`` (None without one),
    ``entry_bridge`` (None without one), ``row_product`` (the few-row float32 products chosen for
    this host, :func:`skipdecode.row_product.record`; None without float32 CPU layers) and
    ``skip_config`` (the checkpoint's ``skipdecode.json`` without the ``skip_adapter`` entry,
    which is reported on its own)."""
    from .row_product import record as row_product_record

    return {"source": sk.source, "model_type": sk.model.config.model_type, "num_layers": sk.num_layers,
            "policy": sk.policy.to_dict(), "speedup_horizon": sk.horizon, "chat": sk.chat, "quantize": sk.quantize,
            "dtype": str(getattr(sk.model, "dtype", "")).replace("torch.", ""),
            "skip_adapter": sk.skip_config.get("skip_adapter"), "entry_bridge": _entry_bridge_info(sk),
            "row_product": row_product_record(sk.model),
            "skip_config": {k: v for k, v in sk.skip_config.items() if k != "skip_adapter"}}


def describe_policy(policy: dict[str, Any] | None, num_layers: int, by_step: bool = True) -> str:
    """A policy dict (``SkipPolicy.to_dict()``) in words: ``"21 -> 9 of 30 layers over 32 tokens
    (warm-up 1)"`` for linear decay (prefixed ``"2 full-depth steps, then "`` with
    ``full_depth_steps``; followed by :func:`layers_by_step` unless ``by_step`` is False)
    (docs/method.md "The schedule"), ``"full depth (30 layers)"`` for full depth, else the dict as text."""
    if not policy or policy.get("type") == "full":
        return f"full depth ({num_layers} layers)"
    if policy.get("type") == "linear_decay":
        first = (f"{policy['full_depth_steps']} full-depth steps, then "
                 if policy.get("full_depth_steps") else "")
        steps = f"; {layers_by_step(policy)}" if by_step else ""
        return (f"{first}{policy['max_layers']} -> {policy['min_layers']} of {num_layers} layers over "
                f"{policy['horizon']} tokens (warm-up {policy['warmup_layers']}){steps}")
    return str(policy)


def layers_by_step(policy: dict[str, Any], max_runs: int = 6) -> str:
    """The layers a linear-decay policy dict runs at each decode step, as runs of equal budgets:
    ``"decode steps 1-14: 30 layers, 15: 20, 16: 15, 17: 10, 18+: 5"`` (the decay's own first
    step already runs below ``max_layers``, which is the prefill's budget at step 0; docs/method.md
    "The schedule"). With more than ``max_runs`` runs only the first and the floor are named:
    ``"decode step 1: 14 layers ... 6 from step 31"``.

    Raises:
        ValueError: ``policy`` is not a valid linear-decay dict (:func:`~skipdecode.policy.policy_from_dict`).
    """
    from .policy import policy_from_dict

    p = policy_from_dict(policy)
    runs: list[list[int]] = []  # [first step, last step, layers]
    step = 1
    while True:
        e = p.budget(step)
        if runs and runs[-1][2] == e:
            runs[-1][1] = step
        else:
            runs.append([step, step, e])
        if e == p.min_layers and step > p.full_depth_steps:
            break
        step += 1
    if len(runs) > max_runs:
        return f"decode step 1: {runs[0][2]} layers ... {runs[-1][2]} from step {runs[-1][0]}"
    spans = [f"{a}" if a == b else f"{a}-{b}" for a, b, _ in runs[:-1]] + [f"{runs[-1][0]}+"]
    items = [f"{span}: {e}" for span, (_, _, e) in zip(spans, runs)]
    items[0] += " layers"
    return "decode steps " + ", ".join(items)


def _mb(nbytes: Any) -> str:
    if not isinstance(nbytes, (int, float)):
        return "size unknown"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def _adapter_lines(adapter: dict[str, Any] | None) -> list[str]:
    if not adapter:
        return ["skip adapter:    none"]
    storage = adapter.get("storage") or {}
    parts = [f"{adapter.get('path')}", _mb(adapter.get("bytes")),
             f"LoRA r={adapter.get('lora_r')} alpha={adapter.get('lora_alpha')}"
             + (f" stored {storage['lora']}" if storage.get("lora") else ""),
             "decode steps only (the base model prefills)" if adapter.get("decode_only") else "prefill and decode",
             "merged" if adapter.get("merged") else "not merged"]
    lines = ["skip adapter:    " + ", ".join(parts)]
    training = adapter.get("training") or {}
    if training.get("command"):
        minutes = training.get("minutes")
        lines.append(f"  trained by:    {training['command']}"
                     + (f" ({minutes:g} min)" if isinstance(minutes, (int, float)) else ""))
    return lines


def _bridge_line(bridge: dict[str, Any] | None) -> str:
    if not bridge:
        return "entry bridge:    none"
    targets = bridge.get("targets") or {}
    span = (f"{targets.get('first')}-{targets.get('last')} ({targets.get('count')} layers)"
            if isinstance(targets, dict) else str(targets))
    extra = [bridge["dtype"]] if bridge.get("dtype") else []
    if "bytes" in bridge:
        extra.append(_mb(bridge["bytes"]))
    return f"entry bridge:    layer {bridge.get('source')} -> entry layers {span}" + "".join(f", {e}" for e in extra)


#: The paper's targets (docs/method.md "Target speedup") that ``info`` spells out when the checkpoint
#: has no trained schedule for them.
GENERIC_SPEEDUPS = (2, 3, 5)


def _generic_lines(record: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    """Lines for the :data:`GENERIC_SPEEDUPS` without a trained schedule: what ``--speedup S``
    runs for them, :func:`skipdecode.policy.for_speedup` over the record's ``speedup_horizon`` (tokens;
    :attr:`skipdecode.model.SkipModel.horizon`), marked "not
    trained for" when the model has trained schedules or an adapter; none for a model too shallow
    for a speedup."""
    from .policy import for_speedup, speedup_label

    L = record["num_layers"]
    horizon = record.get("speedup_horizon") or 32
    note = " (generic; not trained for)" if trained or record.get("skip_adapter") else " (generic)"
    lines = []
    for s in GENERIC_SPEEDUPS:
        if speedup_label(s) in trained:
            continue
        try:
            policy = for_speedup(L, s, horizon).to_dict()
        except ValueError:  # too few layers for this speedup
            continue
        lines.append(f"  {f'--speedup {s}:':<14} {describe_policy(policy, L)}{note}")
    return lines


def info_lines(record: dict[str, Any]) -> list[str]:
    """The short summary of a :func:`model_info` record, one string per line: model, architecture,
    default policy, the schedules ``--speedup S`` runs because the checkpoint was trained with them
    (:meth:`skipdecode.model.SkipModel.trained_policy`), the generic ones it runs for the other
    targets of 2, 3 and 5 (:func:`_generic_lines`), skip adapter, entry bridge, and a last line
    pointing at ``--json``."""
    L = record["num_layers"]
    config = record.get("skip_config") or {}
    lines = [f"model:           {record['source']}",
             f"architecture:    {record['model_type']}, {L} layers, weights "
             f"{record.get('quantize') or record.get('dtype') or '?'}, chat template {'on' if record['chat'] else 'off'}",
             f"default policy:  {describe_policy(record['policy'], L)}"]
    trained = config.get("policies") or {}
    for label, policy in trained.items():
        name = f"--speedup {label}" if label.replace(".", "", 1).isdigit() else f"trained ({label})"
        lines.append(f"  {name + ':':<14} {describe_policy(policy, L)}")
    lines += _generic_lines(record, trained)
    lines += _adapter_lines(record.get("skip_adapter"))
    lines.append(_bridge_line(record.get("entry_bridge")))
    lines += _row_product_lines(record.get("row_product"))
    lines.append("full record:     skipdecode info --json")
    return lines


def _row_product_lines(choice: dict[str, Any] | None) -> list[str]:
    """The ``few-row product:`` line of :func:`info_lines` for a
    :func:`skipdecode.row_product.record` (none without one)."""
    from .row_product import describe

    return [] if choice is None else [f"few-row product: {describe(choice)}"]
