"""Training throughput: timed forward + backward of the teacher-forced loss per policy.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..data import Example, median_response_tokens
from ..model import SkipModel
from ..policy import for_speedup
from .batching import build_layer_mask, collate, tokenize_examples
from .config import _is_int, _speedup_label
from .loss import target_logits

__all__ = ["measure_throughput"]


def measure_throughput(
    model: SkipModel,
    examples: Sequence[Example],
    *,
    speedups: Sequence[float] = (1.0, 3.0),
    horizon: int | None = None,
    batch_size: int = 8,
    steps: int = 3,
    warmup_steps: int = 1,
    max_length: int = 256,
    chat: bool | None = None,
) -> dict[str, Any]:
    """Training throughput (forward + backward of the teacher-forced loss) per target speedup.

    All speedups see the same batches. In the masked form every layer still computes every
    position densely (skipped rows are discarded by ``torch.where``), so the gain is about zero:
    compare ``tokens_per_second`` across speedups, and ``active_fraction`` (the share of
    (position, layer) pairs that a sparse implementation would compute).

    Args:
        model: the model (weights are not changed: no optimizer step).
        examples: data; the first ``batch_size * (steps + warmup_steps)`` fitting ones are used.
        speedups: target speedups to compare (1 = full depth).
        horizon: T (tokens); None: the median response length of ``examples``.
        batch_size: examples per step. steps: timed steps per speedup. warmup_steps: untimed steps.
        max_length: truncation (tokens). chat: chat template (None: the model's setting).

    Returns:
        ``{"results": {label: {"tokens_per_second", "seconds_per_step", "active_fraction"}},
        "relative_to_full": {label: ratio of tokens/s to speedup 1's}, "batch_size", "steps",
        "horizon", "device"}``.

    Raises:
        ValueError: bad counts, a speedup the model cannot run, or no example fits ``max_length``.
    """
    if not _is_int(steps) or steps < 1 or not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"steps and batch_size must be integers >= 1, got {steps!r}, {batch_size!r}")
    chat = model.chat if chat is None else chat
    need = batch_size * (steps + warmup_steps)
    items, _ = tokenize_examples(model.tokenizer, list(examples)[: need * 4], chat=chat, max_length=max_length)
    items = [x for x in items if x is not None][:need]
    if not items:
        raise ValueError(f"no example fits max_length={max_length}")
    while len(items) < need:
        items = items + items[: need - len(items)]
    horizon = horizon or max(1, median_response_tokens(examples, model.tokenizer))
    adapter = model.adapter
    device = next(model.model.parameters()).device
    pad = model.tokenizer.pad_token_id or 0
    was_training = model.model.training
    model.model.train()
    plans = [(_speedup_label(s), for_speedup(adapter.num_layers, float(s), horizon)) for s in speedups]
    acc = {label: {"seconds": 0.0, "tokens": 0, "active": 0, "total": 0} for label, _ in plans}
    try:
        for k in range(steps + warmup_steps):  # policies interleaved step by step, so drift hits all alike
            batch = collate(items[k * batch_size:(k + 1) * batch_size], pad).to(device)
            target_mask = batch.target_mask()
            for label, policy in plans:
                lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1],
                                      adapter.num_layers, device=device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                logits = target_logits(adapter, batch, lm).float()
                F.cross_entropy(logits, batch.labels()[target_mask]).backward()
                model.model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if k >= warmup_steps:
                    a = acc[label]
                    a["seconds"] += time.perf_counter() - t0
                    a["tokens"] += batch.n_tokens
                    real = batch.attention_mask.bool()
                    a["active"] += int(lm[real].sum())
                    a["total"] += int(real.sum()) * adapter.num_layers
        results = {label: {"tokens_per_second": a["tokens"] / a["seconds"], "seconds_per_step": a["seconds"] / steps,
                           "active_fraction": a["active"] / a["total"]} for label, a in acc.items()}
    finally:
        model.model.train(was_training)
    base = results.get("1")
    return {
        "results": results,
        "relative_to_full": {k: v["tokens_per_second"] / base["tokens_per_second"] for k, v in results.items()} if base else {},
        "batch_size": batch_size, "steps": steps, "horizon": horizon, "device": str(device),
    }
