"""Training throughput: timed forward + backward of the teacher-forced loss per policy.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..data import Example, median_response_tokens
from ..model import SkipModel
from ..policy import for_speedup
from .batching import TokenizedExample, build_layer_mask, collate, tokenize_examples
from ..policy import speedup_label
from .config import _is_int
from .loss import SkipLossModule, target_logits

__all__ = ["measure_throughput", "training_throughput", "ThroughputRow", "response_active_fraction"]


def _fitting_items(model: SkipModel, examples: Sequence[Example], need: int, *, horizon: int | None,
                   max_length: int, chat: bool | None, steps: int, batch_size: int
                   ) -> tuple[list[TokenizedExample], int, bool]:
    """``need`` tokenized examples (repeated if too few fit), the horizon and the chat setting.

    Raises:
        ValueError: ``steps`` or ``batch_size`` not an integer >= 1, or no example fits ``max_length``.
    """
    if not _is_int(steps) or steps < 1 or not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"steps and batch_size must be integers >= 1, got {steps!r}, {batch_size!r}")
    chat = model.chat if chat is None else chat
    items, _ = tokenize_examples(model.tokenizer, list(examples)[: need * 4], chat=chat, max_length=max_length)
    items = [x for x in items if x is not None][:need]
    if not items:
        raise ValueError(f"no example fits max_length={max_length}")
    while len(items) < need:
        items = items + items[: need - len(items)]
    if horizon is None:
        horizon = max(1, median_response_tokens(examples, model.tokenizer))
    return items, horizon, chat


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
    """Forward + backward throughput of the teacher-forced loss per target speedup (sparse
    teacher forcing, no optimizer step). :func:`training_throughput` is the full comparison.

    All speedups see the same batches. ``active_fraction`` is the share of (real position, layer)
    pairs the policy runs.

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
    items, horizon, chat = _fitting_items(model, examples, batch_size * (steps + warmup_steps), horizon=horizon,
                                          max_length=max_length, chat=chat, steps=steps, batch_size=batch_size)
    adapter = model.adapter
    device = next(model.model.parameters()).device
    pad = model.tokenizer.pad_token_id or 0
    was_training = model.model.training
    model.model.train()
    plans = [(speedup_label(s), for_speedup(adapter.num_layers, float(s), horizon)) for s in speedups]
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


_VARIANT_KEYS = ("speedup", "teacher_forcing", "prompt_grad", "lora_r")


def response_active_fraction(policy: Any, prompt_lens: torch.Tensor, seq_lens: torch.Tensor,
                             num_layers: int) -> float:
    """Share of the (response position, layer) pairs that ``policy`` runs, in [0, 1].

    ``prompt_lens``, ``seq_lens`` (B,) in tokens; the position holding response token i runs
    ``policy.active_layers(i + 1)`` (:func:`build_layer_mask`)."""
    T = int(seq_lens.max())
    lm = build_layer_mask(policy, prompt_lens, seq_lens, T, num_layers)
    pos = torch.arange(T)[None]
    resp = (pos >= prompt_lens[:, None]) & (pos < seq_lens[:, None])
    n = int(resp.sum())
    return float(lm[resp].sum()) / (n * num_layers) if n else 0.0


def _trainable_copy(model: SkipModel, lora_r: int) -> tuple[torch.nn.Module, Any]:
    """A deep copy of the HF model to train (the caller's stays untouched) and its adapter; with
    ``lora_r`` > 0 a peft model with LoRA on all linear layers."""
    import copy

    from ..adapters import get_adapter

    hf = copy.deepcopy(model.model).train()
    if lora_r <= 0:
        return hf, get_adapter(hf)
    from peft import LoraConfig, get_peft_model

    from ..peft_compat import quiet_peft_checkpointing_warning

    with quiet_peft_checkpointing_warning():  # peft 0.21 reads a property transformers 5.24 deprecated
        peft_model = get_peft_model(hf, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear",
                                                   bias="none", task_type="CAUSAL_LM"))
    return peft_model, get_adapter(peft_model.base_model.model)


def _time_variant(model: SkipModel, batches: list, variant: dict, horizon: int, warmup_steps: int) -> dict[str, float]:
    """Seconds, tokens and response tokens of the timed steps (after ``warmup_steps``) of one variant:
    forward + backward + AdamW step, as :func:`skipdecode.training.train` does."""
    trainable, adapter = _trainable_copy(model, variant["lora_r"])
    module = SkipLossModule(trainable, adapter, sparse=variant["teacher_forcing"] == "sparse",
                            prompt_grad=variant["prompt_grad"])
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    policy = for_speedup(adapter.num_layers, float(variant["speedup"]), horizon)
    device = next(trainable.parameters()).device
    acc = {"seconds": 0.0, "tokens": 0, "targets": 0}
    for k, batch in enumerate(batches):
        lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1],
                              adapter.num_layers, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ce, _ = module(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
        (ce / batch.n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= warmup_steps:
            acc["seconds"] += time.perf_counter() - t0
            acc["tokens"] += batch.n_tokens
            acc["targets"] += batch.n_targets
    return acc


@dataclass
class ThroughputRow:
    """One measured training variant.

    Attributes:
        speedup: target speedup (1 = full depth). teacher_forcing: "sparse" or "masked".
        prompt_grad: gradient through the prompt. lora_r: LoRA rank (0: full fine-tuning).
        tokens_per_second: real (prompt + response) tokens per second of step time.
        target_tokens_per_second: response tokens per second. seconds_per_step: mean step time (s).
        response_active_fraction: share of response-position layer work the policy runs.
        relative: tokens/s over the baseline row's (full depth, masked, prompt gradient, full FT).
    """

    speedup: float
    teacher_forcing: str
    prompt_grad: bool
    lora_r: int
    tokens_per_second: float
    target_tokens_per_second: float
    seconds_per_step: float
    response_active_fraction: float
    relative: float | None = None


def training_throughput(
    model: SkipModel,
    examples: Sequence[Example],
    *,
    speedups: Sequence[float] = (1.0, 2.0, 3.0, 5.0),
    teacher_forcing: Sequence[str] = ("masked", "sparse"),
    prompt_grad: Sequence[bool] = (True, False),
    lora_r: Sequence[int] = (0, 8),
    rows: int | None = None,
    batch_size: int = 16,
    steps: int = 3,
    warmup_steps: int = 2,
    horizon: int | None = None,
    max_length: int = 256,
    chat: bool | None = None,
    callback: Any = None,
) -> dict[str, Any]:
    """Training tokens/s of every combination of speedup, teacher forcing, prompt gradient and
    fine-tuning kind, each a full optimizer step (forward, backward, AdamW) on a fresh copy of
    ``model`` (its weights are not changed), all on the same batches.

    Args:
        model: the model (copied per variant).
        examples: data; the first ``batch_size * (steps + warmup_steps)`` fitting examples.
        speedups, teacher_forcing, prompt_grad, lora_r: the values combined (outer to inner).
        rows: measure only the first ``rows`` combinations (None: all).
        batch_size: examples per step. steps: timed steps. warmup_steps: untimed steps first.
        horizon: T (tokens; None: the median response length of ``examples``).
        max_length: truncation (tokens). chat: chat template (None: the model's setting).
        callback: called with each :class:`ThroughputRow` as it is measured.

    Returns:
        ``{"rows": [ThroughputRow as dict], "baseline": the baseline row's variant or None,
        "batch_size", "steps", "warmup_steps", "horizon", "device", "prompt_tokens",
        "response_tokens"}``; ``relative`` is tokens/s over the row with speedup 1, masked, prompt
        gradient on, full fine-tuning, when it was measured.

    Raises:
        ValueError: bad counts, an unknown teacher-forcing mode, a speedup the model cannot run,
            or no example fits ``max_length``.
    """
    for mode in teacher_forcing:
        if mode not in ("sparse", "masked"):
            raise ValueError(f"teacher_forcing must hold 'sparse' or 'masked', got {mode!r}")
    if rows is not None and (not _is_int(rows) or rows < 1):
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    items, horizon, _ = _fitting_items(model, examples, batch_size * (steps + warmup_steps), horizon=horizon,
                                       max_length=max_length, chat=chat, steps=steps, batch_size=batch_size)
    device = next(model.model.parameters()).device
    pad = model.tokenizer.pad_token_id or 0
    batches = [collate(items[k * batch_size:(k + 1) * batch_size], pad).to(device)
               for k in range(steps + warmup_steps)]
    variants = [dict(zip(_VARIANT_KEYS, v)) for v in itertools.product(speedups, teacher_forcing, prompt_grad, lora_r)]
    L = model.num_layers
    timed = batches[warmup_steps:]
    out: list[ThroughputRow] = []
    for variant in variants[:rows]:
        policy = for_speedup(L, float(variant["speedup"]), horizon)
        acc = _time_variant(model, batches, variant, horizon, warmup_steps)
        frac = sum(response_active_fraction(policy, b.prompt_lens.cpu(), b.seq_lens.cpu(), L) * b.n_targets
                   for b in timed) / sum(b.n_targets for b in timed)
        row = ThroughputRow(float(variant["speedup"]), variant["teacher_forcing"], bool(variant["prompt_grad"]),
                            int(variant["lora_r"]), acc["tokens"] / acc["seconds"], acc["targets"] / acc["seconds"],
                            acc["seconds"] / steps, frac)
        out.append(row)
        if callback is not None:
            callback(row)
    base = next((r for r in out if r.speedup == 1 and r.teacher_forcing == "masked" and r.prompt_grad
                 and r.lora_r == 0), None)
    for r in out:
        r.relative = r.tokens_per_second / base.tokens_per_second if base else None
    return {"rows": [asdict(r) for r in out], "baseline": asdict(base) if base else None, "batch_size": batch_size,
            "steps": steps, "warmup_steps": warmup_steps, "horizon": horizon, "device": str(device),
            "prompt_tokens": sum(int(b.prompt_lens.sum()) for b in timed),
            "response_tokens": sum(b.n_targets for b in timed)}
