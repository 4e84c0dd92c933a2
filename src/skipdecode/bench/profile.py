"""Where a decode step's time goes: a per-part breakdown of the engine's own loop, the weight
bytes a step must read against a memory-bandwidth floor, and Amdahl predictions for other targets.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from ..generate import encode_prompts, generate_step
from ..policy import SkipPolicy, theoretical_speedup
from .clock import _Clock, _device, _instrumented, _sync, _TimedAdapter
from .inputs import DEFAULT_PROMPTS, _policy_name, batch_prompts, bench_policies


def weight_bytes(sk) -> dict[str, int]:
    """Bytes of weights a decode step reads: per decoder layer, and the model's tail.

    Returns ``{"layer": [bytes of layer l], "head": bytes of the final norm + LM head (+ any
    projection), "embedding_row": bytes of one embedding row}``. The LM head's matrix is read in
    full every step whatever the skip plan (tied or not to the input embedding, of which a step
    reads only B rows).
    """
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    layers = [nbytes(layer) for layer in sk.adapter.layers]
    model = sk.model
    head = 0
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None:
        head += nbytes(out_emb)
    layer_ids = {id(p) for layer in sk.adapter.layers for p in layer.parameters()}
    emb = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb.parameters()}
    head_ids = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
    # final norms / projections: parameters outside layers, embeddings and the LM head
    # (position-embedding tables, read one row per token, are excluded)
    for name, p in model.named_parameters():
        if id(p) in layer_ids or id(p) in emb_ids or id(p) in head_ids:
            continue
        if "embed_positions" in name or ".wpe." in name or name.endswith("wpe.weight"):
            continue
        head += p.numel() * p.element_size()
    w = emb.weight
    return {"layer": layers, "head": head, "embedding_row": w.shape[-1] * w.element_size()}


PROFILE_PARTS = (
    "embedding",
    "positions + attention mask",
    "rotary / layer inputs",
    "decoder layers",
    "final norm + LM head",
    "sampling",
    "other (loop, cache bookkeeping, python)",
)


def profile_decode(
    sk,
    *,
    batch_sizes: Sequence[int] = (1, 8),
    speedups: Sequence[float] = (5.0,),
    new_tokens: int = 32,
    horizon: int | None = None,
    repeats: int = 3,
    bandwidth_gbs: float = 15.0,
    predict_speedups: Sequence[float] = (2.0, 3.0, 5.0),
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Where a decode step's time goes, for full depth and each speedup, per batch size.

    Runs the engine's own loop (:func:`~skipdecode.generate.generate_step`, greedy, no EOS) with
    ``perf_counter`` around each part; a step is the interval between consecutive yielded
    columns (decode steps t >= 1 only), and "other" is that interval minus the timed parts. The
    median over ``repeats`` runs of each part's mean ms per step is reported. Timers add a little
    overhead of their own (two perf_counter calls per part, ~40 per step).

    The memory model: a decode step must read the weights of every active layer and the whole
    LM head (``weight_bytes``); ``floor_ms = bytes / bandwidth_gbs``. ``head_share`` is the
    fraction of those bytes in the tail, and ``bytes_speedup_bound`` = full-depth bytes / this
    plan's bytes: the wall-clock speedup a memory-bound step can reach at most.

    From each full-depth breakdown, ``predictions`` extrapolates every ``predict_speedups``
    policy (Amdahl): the decoder-layer time scales with the mean active layers, the rest (LM
    head, sampling, loop) does not; ``ratio`` = predicted wall / theoretical speedup.

    Returns:
        ``{"bandwidth_gbs", "weights": {...}, "rows": [...], "predictions": [...]}``.
    """
    horizon = new_tokens if horizon is None else horizon
    progress = on_progress or (lambda msg: None)
    device = _device(sk)
    L = sk.num_layers
    wb = weight_bytes(sk)
    policies = [(name, policy) for name, _, policy in bench_policies(sk, speedups, horizon)]
    pad = sk.tokenizer.pad_token_id if sk.tokenizer.pad_token_id is not None else 0
    rows = []
    for B in batch_sizes:
        texts = batch_prompts(B, prompts)
        input_ids, attention_mask = encode_prompts(sk.tokenizer, texts, chat=sk.chat, device=device)
        for name, policy in policies:
            progress(f"profile: batch {B} {name}")
            per_run: list[dict[str, Any]] = []
            for r in range(repeats + 1):  # run 0 is a warm-up
                raw = _timed_steps(sk, input_ids, attention_mask, policy, new_tokens, pad, device)
                if r > 0:
                    per_run.append(_run_summary(*raw))
            rows.append(_profile_row(B, name, per_run, wb, L, bandwidth_gbs))
    _add_speedups(rows)
    return {
        "predictions": _predictions(sk, rows, predict_speedups, horizon, new_tokens, wb),
        "bandwidth_gbs": bandwidth_gbs,
        "weights": {
            "layer_bytes_mean": sum(wb["layer"]) / L,
            "layers_bytes_total": sum(wb["layer"]),
            "head_bytes": wb["head"],
            "num_layers": L,
            "dtype": str(next(sk.model.parameters()).dtype).replace("torch.", ""),
        },
        "rows": rows,
    }


def _timed_steps(sk, input_ids: torch.Tensor, attention_mask: torch.Tensor, policy: SkipPolicy,
                 new_tokens: int, pad: int, device: torch.device):
    """One instrumented run of the engine's loop (``input_ids``, ``attention_mask``: ``[B, S]``).

    Returns ``(sums, layer_sums, layer_counts, total, steps, layers_run)`` over the decode steps
    t >= 1: seconds per named part and per layer index, the number of steps each layer ran, the
    total step seconds, the step count and the active layers of each step.
    """
    clock = _Clock(device)
    adapter = _TimedAdapter(sk.adapter, clock)
    sums: dict[str, float] = defaultdict(float)
    layer_sums: dict[int, float] = defaultdict(float)
    layer_counts: dict[int, int] = defaultdict(int)
    total = 0.0
    steps = 0
    layers_run: list[int] = []
    with _instrumented(clock), torch.inference_mode():
        gen = generate_step(
            adapter, input_ids, attention_mask, policy=policy, max_new_tokens=new_tokens,
            eos_token_ids=(), pad_token_id=pad,
        )
        _sync(device)
        last = time.perf_counter()
        for out in gen:
            _sync(device)
            now = time.perf_counter()
            if out.step >= 1:
                steps += 1
                total += now - last
                layers_run.append(len(out.active_layers))
                for k, v in clock.parts.items():
                    sums[k] += v
                for k, v in clock.layers.items():
                    layer_sums[k] += v
                    layer_counts[k] += 1
            clock.reset()
            last = time.perf_counter()
    return sums, layer_sums, layer_counts, total, steps, layers_run


def _run_summary(sums, layer_sums, layer_counts, total, steps, layers_run) -> dict[str, Any]:
    """Mean ms per decode step of each part (and of each layer) of one :func:`_timed_steps` run."""
    layers_ms = sum(layer_sums.values()) / steps * 1e3
    parts = {k: sums.get(k, 0.0) / steps * 1e3 for k in PROFILE_PARTS}
    parts["decoder layers"] = layers_ms
    step_ms = total / steps * 1e3
    parts["other (loop, cache bookkeeping, python)"] = step_ms - sum(
        v for k, v in parts.items() if not k.startswith("other")
    )
    return {
        "step_ms": step_ms,
        "parts": parts,
        "layer_ms": {k: layer_sums[k] / layer_counts[k] * 1e3 for k in layer_sums},
        "layers_run": layers_run,
    }


def _profile_row(B: int, name: str, per_run: list[dict[str, Any]], wb: dict[str, Any], L: int,
                 bandwidth_gbs: float) -> dict[str, Any]:
    """The row of batch size ``B`` and policy ``name``: medians over ``per_run`` (ms), the weight
    bytes a step reads (``wb``: :func:`weight_bytes`) and the floor at ``bandwidth_gbs`` GB/s."""
    full_bytes = sum(wb["layer"]) + wb["head"]
    med = lambda key: statistics.median(x[key] for x in per_run)  # noqa: E731
    parts = {k: statistics.median(x["parts"][k] for x in per_run) for k in PROFILE_PARTS}
    layer_keys = sorted(per_run[0]["layer_ms"])
    layer_ms = {str(k): statistics.median(x["layer_ms"][k] for x in per_run) for k in layer_keys}
    layers_run = per_run[0]["layers_run"]
    mean_layers = sum(layers_run) / len(layers_run)
    mean_layer_bytes = sum(wb["layer"]) / L
    step_bytes = mean_layers * mean_layer_bytes + wb["head"] + B * wb["embedding_row"]
    step_ms = med("step_ms")
    return {
        "batch_size": B,
        "policy": name,
        "mean_active_layers": mean_layers,
        "theoretical_speedup": theoretical_speedup(L, layers_run),
        "step_ms": step_ms,
        "parts_ms": parts,
        "parts_share": {k: v / step_ms for k, v in parts.items()},
        "per_layer_ms": layer_ms,
        "mean_layer_ms": parts["decoder layers"] / mean_layers,
        "weight_bytes_per_step": step_bytes,
        "floor_ms": step_bytes / (bandwidth_gbs * 1e9) * 1e3,
        "head_share_of_bytes": wb["head"] / step_bytes,
        "bytes_speedup_bound": (full_bytes + B * wb["embedding_row"]) / step_bytes,
        "achieved_gbs": step_bytes / (step_ms * 1e-3) / 1e9,
    }


def _add_speedups(rows: list[dict[str, Any]]) -> None:
    """Add to every row its measured wall speedup against the same batch size's full depth, its
    fixed (non-layer) ms and share, and the Amdahl bound those imply (in place)."""
    for row in rows:
        full = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["policy"] == "full")
        row["wall_speedup"] = full["step_ms"] / row["step_ms"]
        row["fixed_ms"] = row["step_ms"] - row["parts_ms"]["decoder layers"]
        row["fixed_share"] = row["fixed_ms"] / row["step_ms"]
        # Amdahl: the layer part scales with active layers, the rest (head, sampling, loop) does not
        layer_full = full["parts_ms"]["decoder layers"]
        row["amdahl_speedup"] = full["step_ms"] / (
            full["fixed_ms"] + layer_full * row["mean_active_layers"] / full["mean_active_layers"]
        )


def _predictions(sk, rows: list[dict[str, Any]], predict_speedups: Sequence[float], horizon: int,
                 new_tokens: int, wb: dict[str, Any]) -> list[dict[str, Any]]:
    """Amdahl and weight-bytes predictions of each ``predict_speedups`` policy from every
    full-depth row (see :func:`profile_decode`)."""
    L = sk.num_layers
    full_bytes = sum(wb["layer"]) + wb["head"]
    predictions = []
    for full in (r for r in rows if r["policy"] == "full"):
        for target in predict_speedups:
            policy = sk.policy_for(speedup=float(target), horizon=horizon)
            budgets = [policy.budget(t) for t in range(1, new_tokens)]
            mean_layers = sum(budgets) / len(budgets)
            theo = theoretical_speedup(L, budgets)
            predicted = full["step_ms"] / (full["fixed_ms"] + full["mean_layer_ms"] * mean_layers)
            step_bytes = mean_layers * sum(wb["layer"]) / L + wb["head"]
            predictions.append(
                {
                    "batch_size": full["batch_size"],
                    "policy": _policy_name(float(target)),
                    "mean_active_layers": mean_layers,
                    "theoretical_speedup": theo,
                    "amdahl_speedup": predicted,
                    "amdahl_ratio": predicted / theo,
                    "bytes_speedup_bound": full_bytes / step_bytes,
                    "bytes_ratio": full_bytes / step_bytes / theo,
                }
            )
    return predictions
