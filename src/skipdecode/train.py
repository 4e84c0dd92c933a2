"""Skip-aware fine-tuning (METHOD.md "Training: the model must learn the schedule").

A stock model collapses when its lower layers are skipped, so SkipDecode fine-tunes it **with the
skip schedule in place**. This module does that with teacher forcing that reproduces the inference
computation exactly:

* **Batches are right-padded.** Row b holds ``prompt_lens[b]`` prompt tokens followed by its
  response (with EOS), ``seq_lens[b]`` real tokens in all; positions come from the attention mask
  inside :func:`skipdecode.forward.skip_forward`, so padding never shifts them.
* **One plan per position** (:func:`build_layer_mask`): prompt positions run every layer (the
  prefill); the position holding response token i runs ``policy.active_layers(i + 1)``, because the
  token there is fed at decode step i + 1 and predicts response token i + 1. The last prompt
  position predicts response token 0 at full depth, as the prefill does.
* **THE layer loop.** The (B, T, L) mask goes to ``skip_forward(..., layer_mask=...)``, the same
  loop that prefill and decoding use; there is no second copy. The masked residual update is exact
  (METHOD.md): a test checks that the teacher-forced logits equal KV-cached decoding's.
* **Loss**: next-token cross-entropy on the response tokens only (optionally plus ``kl_weight``
  times KL(full-depth teacher || student) on the same positions).

The training loop runs on Hugging Face Accelerate, so ``accelerate launch`` runs it data-parallel
unchanged: the loss is computed inside an ``nn.Module`` (:class:`SkipLossModule`) whose forward is
the prepared (DDP, autocast) one. The data order is a pure function of ``seed``: each optimizer
step takes the next ``batch_size * num_processes * grad_accum`` indices of a stream of seeded
per-epoch permutations, which makes resuming reproduce the uninterrupted run exactly.

**Gradient checkpointing** (project choice): we call Hugging Face's
``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` on older versions) with
``use_reentrant=False``. Since transformers 5 every decoder layer is a ``GradientCheckpointingLayer``
whose ``forward`` checkpoints itself, and our loop calls the stock layer modules, so the loop honours
it with no layer code copied; :func:`train` checks that each layer was switched on.

**Run directory** (``TrainConfig.out_dir``)::

    out_dir/checkpoint-00000100/   HF checkpoint + tokenizer + skipdecode.json + train_state/
    out_dir/final/                 the trained model (HF checkpoint, or LoRA adapter) + skipdecode.json
    out_dir/train_record.json      the run's record (:class:`TrainResult`), rewritten as it goes

Every directory is written under a temporary name and renamed into place, so a killed run never
leaves a half-written checkpoint. ``train_state/`` holds the optimizer, scheduler and RNG states,
the step and the logs; ``resume=True`` continues from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .adapters import Adapter, get_adapter
from .data import TEMPLATES, DataError, Example, load_examples, median_response_tokens
from .forward import skip_forward
from .generate import encode_prompts, generate
from .model import SkipModel, write_json_atomic
from .policy import FullPolicy, LinearDecayPolicy, SkipPolicy, for_speedup

__all__ = [
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "TokenizedExample",
    "Batch",
    "SkipLossModule",
    "build_layer_mask",
    "build_policies",
    "tokenize_examples",
    "collate",
    "teacher_forced_logits",
    "latest_checkpoint",
    "train",
    "measure_throughput",
]

log = logging.getLogger(__name__)

_SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")
_DEVICES = ("cpu", "cuda", "auto")
_STATE_DIR = "train_state"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
RECORD_NAME = "train_record.json"


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


class TrainConfigError(ValueError):
    """An invalid training setting. ``field`` names the :class:`TrainConfig` field, ``reason``
    says what is wrong; ``str(err)`` is ``f"{field} {reason}"``."""

    def __init__(self, field_name: str, reason: str) -> None:
        self.field = field_name
        self.reason = reason
        super().__init__(f"{field_name} {reason}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one skip-aware fine-tuning run. Validated on construction.

    Schedule (give exactly one of ``speedup``, ``speedups``, ``max_layers``/``min_layers``):
        speedup: target speedup (>= 1) -> :func:`skipdecode.policy.for_speedup`; 1 = full depth.
        speedups: several targets; each optimizer step picks one at random (seeded), so one model
            serves all of them (mixed-policy training). The first is the checkpoint's default.
        max_layers, min_layers: explicit e_max / e_min (layers) of a linear-decay schedule; a
            missing one defaults to L (max) or to ``max_layers`` (min).
        warmup_layers: bottom layers that always run (layers), default 1.
        horizon: decay horizon T (tokens); None: the median response length of the training
            data in tokens (:func:`skipdecode.data.median_response_tokens`; with ``distill`` the
            median length of the teacher's answers).

    Data:
        task: prompt template of :data:`skipdecode.data.TEMPLATES` (None: the reader's default).
        max_length: longest prompt + response (tokens); longer responses are cut, examples whose
            prompt alone fills it are dropped (counted in the record).
        val_fraction: share of distinct prompts held out for validation, in [0, 1).
        max_val_examples: cap on the validation examples (keeps evaluation cheap).
        skip_bad_rows: drop malformed data rows instead of failing.
        chat: wrap prompts in the tokenizer's chat template (None: the model's setting), exactly as
            :func:`skipdecode.generate.encode_prompts` does at inference.
        response_separator: text put between a plain (non-chat) prompt and its response when
            neither side has whitespace there (default one space).

    Optimisation:
        epochs: passes over the training set (may be fractional); ignored when ``max_steps`` is set.
        max_steps: optimizer steps to run (overrides ``epochs``).
        lr: peak learning rate of AdamW. weight_decay: AdamW decoupled weight decay.
        batch_size: examples per micro-batch per process. grad_accum: micro-batches per step.
        lr_scheduler: "cosine", "linear", "constant" or "constant_with_warmup"
            (:func:`transformers.get_scheduler`).
        warmup_ratio: share of steps of linear warm-up; ``warmup_steps`` (if set) overrides it.
        max_grad_norm: clip the global gradient norm to this (0: no clipping).
        gradient_checkpointing: recompute each layer in backward (HF activation checkpointing).
        seed: seeds data order, validation split, policy choice, LoRA init and dropout.
        device: "cpu", "cuda" (Accelerate picks the process's GPU) or "auto".
        bf16: bf16 autocast (for GPUs; works but is slow on most CPUs).

    Distillation:
        distill: train on the full-depth model's own greedy answers (computed before training,
            deduplicated by prompt; gold responses are ignored).
        kl_weight: add ``kl_weight * KL(teacher || student)`` per response token, where the teacher
            is the full-depth frozen original model (>= 0; works with or without ``distill``).
        distill_max_new_tokens: longest teacher answer (tokens). distill_batch_size: prompts per
            teacher generation batch.

    LoRA:
        lora_r: LoRA rank (0: full fine-tuning). lora_alpha: scaling numerator (None: 2 * r).
        lora_dropout: dropout on the LoRA path. base_model: name or path recorded as the adapter's
            base in skipdecode.json (None: where the model was loaded from).

    Run:
        out_dir: run directory (see the module docstring).
        eval_every: validation every N steps (0: only at the start and the end).
        checkpoint_every: checkpoint every N steps (0: only the final model).
        save_total_limit: checkpoints kept (oldest deleted first).
        resume: continue from the newest checkpoint in ``out_dir`` (fresh start if none).
        progress: show a tqdm progress bar (loss, tokens/s, ETA) on stderr.

    Raises:
        TrainConfigError: (a ValueError) a field is invalid; ``.field`` names it.
    """

    out_dir: str
    speedup: float | None = None
    speedups: tuple[float, ...] | None = None
    max_layers: int | None = None
    min_layers: int | None = None
    warmup_layers: int = 1
    horizon: int | None = None
    task: str | None = None
    max_length: int = 256
    val_fraction: float = 0.0
    max_val_examples: int = 256
    skip_bad_rows: bool = False
    chat: bool | None = None
    response_separator: str = " "
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 2e-4
    weight_decay: float = 0.0
    batch_size: int = 8
    grad_accum: int = 1
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.05
    warmup_steps: int | None = None
    max_grad_norm: float = 1.0
    gradient_checkpointing: bool = False
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False
    distill: bool = False
    kl_weight: float = 0.0
    distill_max_new_tokens: int = 64
    distill_batch_size: int = 16
    lora_r: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    base_model: str | None = None
    eval_every: int = 0
    checkpoint_every: int = 0
    save_total_limit: int = 1
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:  # noqa: C901 - one check per field
        def fail(name: str, reason: str) -> None:
            raise TrainConfigError(name, reason)

        def check_int(name: str, low: int, *, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not _is_int(v) or v < low:
                fail(name, f"must be an integer >= {low}, got {v!r}")

        def check_bool(name: str, *, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, bool):
                fail(name, f"must be true or false, got {v!r}")

        if not isinstance(self.out_dir, (str, os.PathLike)) or not str(self.out_dir).strip():
            fail("out_dir", f"must be a non-empty path, got {self.out_dir!r}")
        object.__setattr__(self, "out_dir", str(self.out_dir))
        # schedule
        if self.speedup is not None and (not _is_num(self.speedup) or self.speedup < 1):
            fail("speedup", f"must be a finite number >= 1, got {self.speedup!r}")
        if self.speedups is not None:
            if isinstance(self.speedups, (str, bytes)) or not isinstance(self.speedups, Sequence):
                fail("speedups", f"must be a list of numbers >= 1, got {self.speedups!r}")
            values = tuple(self.speedups)
            if not values:
                fail("speedups", "must hold at least one speedup")
            for v in values:
                if not _is_num(v) or v < 1:
                    fail("speedups", f"must hold finite numbers >= 1, got {v!r}")
            if len(set(values)) != len(values):
                fail("speedups", f"must not repeat a value, got {list(values)}")
            object.__setattr__(self, "speedups", tuple(float(v) for v in values))
        check_int("max_layers", 1, optional=True)
        check_int("min_layers", 1, optional=True)
        explicit = self.max_layers is not None or self.min_layers is not None
        given = [n for n, on in (("speedup", self.speedup is not None), ("speedups", self.speedups is not None),
                                 ("max_layers", explicit)) if on]
        if not given:
            fail("speedup", "is required: give speedup, speedups, or max_layers/min_layers (speedup=1 for full depth)")
        if len(given) > 1:
            fail(given[1], f"cannot be combined with {given[0]}: give one way to set the schedule")
        if self.max_layers is not None and self.min_layers is not None and self.min_layers > self.max_layers:
            fail("min_layers", f"must be <= max_layers ({self.max_layers}), got {self.min_layers}")
        check_int("warmup_layers", 0)
        check_int("horizon", 1, optional=True)
        # data
        if self.task is not None and self.task not in TEMPLATES:
            fail("task", f"must be one of {', '.join(sorted(TEMPLATES))}, got {self.task!r}")
        check_int("max_length", 2)
        if not _is_num(self.val_fraction) or not 0 <= self.val_fraction < 1:
            fail("val_fraction", f"must be in [0, 1), got {self.val_fraction!r}")
        check_int("max_val_examples", 1)
        check_bool("skip_bad_rows")
        check_bool("chat", optional=True)
        if not isinstance(self.response_separator, str):
            fail("response_separator", f"must be a string, got {self.response_separator!r}")
        # optimisation
        if not _is_num(self.epochs) or self.epochs <= 0:
            fail("epochs", f"must be a number > 0, got {self.epochs!r}")
        check_int("max_steps", 1, optional=True)
        if not _is_num(self.lr) or self.lr <= 0:
            fail("lr", f"must be a finite number > 0, got {self.lr!r}")
        if not _is_num(self.weight_decay) or self.weight_decay < 0:
            fail("weight_decay", f"must be a number >= 0, got {self.weight_decay!r}")
        check_int("batch_size", 1)
        check_int("grad_accum", 1)
        if self.lr_scheduler not in _SCHEDULERS:
            fail("lr_scheduler", f"must be one of {', '.join(_SCHEDULERS)}, got {self.lr_scheduler!r}")
        if not _is_num(self.warmup_ratio) or not 0 <= self.warmup_ratio < 1:
            fail("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio!r}")
        check_int("warmup_steps", 0, optional=True)
        if not _is_num(self.max_grad_norm) or self.max_grad_norm < 0:
            fail("max_grad_norm", f"must be a number >= 0 (0: no clipping), got {self.max_grad_norm!r}")
        check_bool("gradient_checkpointing")
        check_int("seed", 0)
        if not isinstance(self.device, str) or self.device not in _DEVICES:
            fail("device", f"must be one of {', '.join(_DEVICES)}, got {self.device!r}")
        check_bool("bf16")
        # distillation
        check_bool("distill")
        if not _is_num(self.kl_weight) or self.kl_weight < 0:
            fail("kl_weight", f"must be a number >= 0, got {self.kl_weight!r}")
        check_int("distill_max_new_tokens", 1)
        check_int("distill_batch_size", 1)
        # LoRA
        check_int("lora_r", 0)
        if self.lora_alpha is not None and (not _is_num(self.lora_alpha) or self.lora_alpha <= 0):
            fail("lora_alpha", f"must be a number > 0, got {self.lora_alpha!r}")
        if not _is_num(self.lora_dropout) or not 0 <= self.lora_dropout < 1:
            fail("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
        if self.lora_r == 0 and (self.lora_alpha is not None or self.lora_dropout):
            fail("lora_alpha" if self.lora_alpha is not None else "lora_dropout", "needs lora_r >= 1")
        if self.base_model is not None and (not isinstance(self.base_model, str) or not self.base_model):
            fail("base_model", f"must be a non-empty string, got {self.base_model!r}")
        # run
        check_int("eval_every", 0)
        check_int("checkpoint_every", 0)
        check_int("save_total_limit", 1)
        check_bool("resume")
        check_bool("progress")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of all fields."""
        d = asdict(self)
        if d["speedups"] is not None:
            d["speedups"] = list(d["speedups"])
        return d


# Fields that must match to resume a run (everything that shapes data order, model or schedule).
_RESUME_FIELDS = (
    "speedup", "speedups", "max_layers", "min_layers", "warmup_layers", "horizon", "task", "max_length",
    "val_fraction", "max_val_examples", "chat", "response_separator", "epochs", "max_steps", "lr",
    "weight_decay", "batch_size", "grad_accum", "lr_scheduler", "warmup_ratio", "warmup_steps",
    "max_grad_norm", "seed", "distill", "kl_weight", "distill_max_new_tokens", "lora_r", "lora_alpha",
    "lora_dropout", "skip_bad_rows",
)


def _speedup_label(s: float) -> str:
    return format(float(s), "g")


def build_policies(config: TrainConfig, num_layers: int, horizon: int) -> list[tuple[str, SkipPolicy]]:
    """The ``(label, policy)`` pairs trained by ``config`` for a model of ``num_layers`` layers.

    Labels are the speedups as text ("2", "2.5") or "custom" for explicit ``max_layers``/
    ``min_layers``. The first pair is the checkpoint's default policy.

    Args:
        config: the run's settings.
        num_layers: L (layers).
        horizon: T (tokens), >= 1.

    Raises:
        TrainConfigError: a schedule the model cannot run (e.g. a speedup above L / (w + 1));
            ``.field`` names the offending setting.
    """
    field_of = "speedups" if config.speedups else "speedup"
    try:
        if config.speedups:
            return [(_speedup_label(s), for_speedup(num_layers, s, horizon, warmup_layers=config.warmup_layers))
                    for s in config.speedups]
        if config.speedup is not None:
            return [(_speedup_label(config.speedup),
                     for_speedup(num_layers, config.speedup, horizon, warmup_layers=config.warmup_layers))]
        e_max = config.max_layers if config.max_layers is not None else num_layers
        e_min = config.min_layers if config.min_layers is not None else e_max
        return [("custom", LinearDecayPolicy(num_layers=num_layers, max_layers=e_max, min_layers=e_min,
                                             warmup_layers=config.warmup_layers, horizon=horizon))]
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        if name in ("max_layers", "min_layers", "warmup_layers", "horizon"):
            raise TrainConfigError(name, f"{rest} (model has {num_layers} layers)") from None
        raise TrainConfigError(field_of, f"{rest} (model has {num_layers} layers)") from None


# --------------------------------------------------------------------------------------------
# Tokenisation and batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizedExample:
    """Token ids of one training pair.

    Attributes:
        prompt_ids: the prompt exactly as inference encodes it (chat template applied when chat),
            >= 1 token.
        response_ids: the target tokens (the response, then EOS unless it was cut), >= 1 token.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _encode_prompt_ids(tokenizer: Any, prompts: Sequence[str], *, chat: bool) -> dict[str, list[int]]:
    """Distinct prompt -> ids, through :func:`encode_prompts` so training matches inference."""
    unique = list(dict.fromkeys(prompts))
    out: dict[str, list[int]] = {}
    for start in range(0, len(unique), 256):
        chunk = unique[start:start + 256]
        ids, mask = encode_prompts(tokenizer, chunk, chat=chat)
        for p, row, m in zip(chunk, ids, mask):
            out[p] = row[m.bool()].tolist()
    return out


def _fit(prompt_ids: Sequence[int], response_ids: Sequence[int], max_length: int) -> TokenizedExample | None:
    """Cut the response so prompt + response <= ``max_length``; None if no response token fits."""
    room = max_length - len(prompt_ids)
    if room < 1 or not response_ids:
        return None
    return TokenizedExample(tuple(prompt_ids), tuple(response_ids[:room]))


def tokenize_examples(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_length: int,
    response_separator: str = " ",
) -> tuple[list[TokenizedExample | None], int]:
    """Tokenize ``(prompt, response)`` pairs for teacher forcing.

    The prompt is encoded by :func:`skipdecode.generate.encode_prompts` (``chat=True``: a user
    turn plus the generation prompt of the tokenizer's chat template), so training sees exactly the
    ids inference feeds. The response is tokenized without special tokens (in plain mode preceded by
    ``response_separator`` when neither side has whitespace at the join) and followed by
    ``tokenizer.eos_token_id``. Pairs longer than ``max_length`` tokens lose the end of their
    response (and its EOS); pairs whose prompt alone fills ``max_length`` give None.

    Returns:
        ``(items, n_dropped)``: one :class:`TokenizedExample` or None per example, and the number
        of Nones.

    Raises:
        ValueError: the tokenizer has no EOS token, or a prompt is empty / tokenizes to nothing.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: cannot mark the end of responses")
    prompt_ids = _encode_prompt_ids(tokenizer, [e.prompt for e in examples], chat=chat)
    texts = []
    for e in examples:
        text = e.response
        if (not chat and response_separator and text and not text[:1].isspace()
                and e.prompt and not e.prompt[-1:].isspace()):
            text = response_separator + text
        texts.append(text)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    items: list[TokenizedExample | None] = []
    for e, ids in zip(examples, encoded):
        items.append(_fit(prompt_ids[e.prompt], list(ids) + [eos], max_length))
    return items, sum(x is None for x in items)


@dataclass
class Batch:
    """A right-padded batch of prompt + response sequences.

    Attributes:
        input_ids: (B, T) long; positions >= ``seq_lens[b]`` hold the pad id.
        attention_mask: (B, T) long, 1 on the ``seq_lens[b]`` real tokens.
        prompt_lens: (B,) long, prompt tokens per row (>= 1).
        seq_lens: (B,) long, prompt + response tokens per row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    seq_lens: torch.Tensor

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on ``device``."""
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.prompt_lens, self.seq_lens)))

    @property
    def n_tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.seq_lens.sum())

    @property
    def n_targets(self) -> int:
        """Response tokens, i.e. predicted (loss) positions."""
        return int((self.seq_lens - self.prompt_lens).sum())

    def target_mask(self) -> torch.Tensor:
        """(B, T) bool: positions whose next token is a response token, ``prompt_len-1 <= p < seq_len-1``."""
        T = self.input_ids.shape[1]
        pos = torch.arange(T, device=self.input_ids.device)[None]
        return (pos >= self.prompt_lens[:, None] - 1) & (pos < self.seq_lens[:, None] - 1)

    def labels(self) -> torch.Tensor:
        """(B, T) long: the next token at each position (``input_ids`` shifted left; last column pad)."""
        return torch.cat([self.input_ids[:, 1:], self.input_ids[:, -1:]], dim=1)


def collate(examples: Sequence[TokenizedExample], pad_token_id: int = 0) -> Batch:
    """Right-pad ``examples`` into a :class:`Batch` (T = the longest example).

    Raises:
        ValueError: no examples, or an example with an empty prompt or response.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    for i, ex in enumerate(examples):
        if not ex.prompt_ids or not ex.response_ids:
            raise ValueError(f"examples[{i}] needs >= 1 prompt and >= 1 response token")
    T = max(len(ex) for ex in examples)
    B = len(examples)
    ids = torch.full((B, T), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[b, :len(seq)] = 1
    prompt_lens = torch.tensor([len(ex.prompt_ids) for ex in examples], dtype=torch.long)
    seq_lens = torch.tensor([len(ex) for ex in examples], dtype=torch.long)
    return Batch(ids, mask, prompt_lens, seq_lens)


# --------------------------------------------------------------------------------------------
# The teacher-forced forward
# --------------------------------------------------------------------------------------------


def build_layer_mask(
    policy: SkipPolicy,
    prompt_lens: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    T: int,
    num_layers: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per-position layer plan (B, T, L) bool for a right-padded teacher-forced batch.

    Row b holds ``prompt_lens[b]`` prompt tokens at positions ``0 .. P_b - 1`` and response token i
    at position ``P_b + i`` for ``i < seq_lens[b] - P_b``. Prompt positions run every layer (the
    full-depth prefill); the position holding response token i runs ``policy.active_layers(i+1)``
    (the token there is fed at decode step i + 1). Padding positions (``p >= seq_lens[b]``) run no
    layer; causal attention never lets a real position read them.

    Args:
        policy: the skip policy; ``policy.num_layers`` must equal ``num_layers``.
        prompt_lens: (B,) prompt lengths (tokens), >= 1.
        seq_lens: (B,) prompt + response lengths (tokens), ``prompt_lens <= seq_lens <= T``.
        T: padded sequence length (positions).
        num_layers: L (layers).
        device: device of the result (default: that of ``prompt_lens`` if a tensor, else CPU).

    Returns:
        (B, T, L) bool tensor, ``mask[b, p, l]`` = layer l runs at position p of row b.

    Raises:
        ValueError: mismatched lengths, a prompt length < 1, ``seq_lens`` outside
            ``[prompt_lens, T]``, or ``policy.num_layers != num_layers``.
    """
    if getattr(policy, "num_layers", None) != num_layers:
        raise ValueError(f"policy.num_layers ({getattr(policy, 'num_layers', None)}) must equal num_layers ({num_layers})")
    if device is None and isinstance(prompt_lens, torch.Tensor):
        device = prompt_lens.device
    p_len = torch.as_tensor(prompt_lens, dtype=torch.long).flatten().cpu()
    s_len = torch.as_tensor(seq_lens, dtype=torch.long).flatten().cpu()
    if p_len.shape != s_len.shape:
        raise ValueError(f"prompt_lens and seq_lens must have the same length, got {len(p_len)} and {len(s_len)}")
    if not _is_int(T) or T < 0:
        raise ValueError(f"T must be an integer >= 0, got {T!r}")
    if len(p_len) and (bool((p_len < 1).any()) or bool((s_len < p_len).any()) or bool((s_len > T).any())):
        raise ValueError(
            f"need 1 <= prompt_lens <= seq_lens <= T={T}; got prompt_lens={p_len.tolist()}, seq_lens={s_len.tolist()}"
        )
    B = len(p_len)
    n_resp = int((s_len - p_len).max()) if B else 0
    table = torch.zeros((max(n_resp, 1), num_layers), dtype=torch.bool)
    for i in range(n_resp):
        table[i, list(policy.active_layers(i + 1))] = True
    pos = torch.arange(T)[None, :]  # (1, T)
    resp_idx = pos - p_len[:, None]  # (B, T), response index held at each position
    in_prompt = resp_idx < 0
    in_resp = (resp_idx >= 0) & (pos < s_len[:, None])
    mask = table[resp_idx.clamp(0, table.shape[0] - 1)]  # (B, T, L)
    mask = (mask & in_resp[..., None]) | in_prompt[..., None]
    return mask.to(device) if device is not None else mask


def _target_logits(adapter: Adapter, batch: Batch, layer_mask: torch.Tensor | None, target_mask: torch.Tensor) -> torch.Tensor:
    """Logits (N, V) at the N ``target_mask`` positions (row-major) under ``layer_mask`` (None: full depth)."""
    hidden = skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=layer_mask, return_hidden=True)
    return adapter.head(hidden[target_mask][None])[0]


def teacher_forced_logits(
    adapter: Adapter,
    batch: Batch,
    policy: SkipPolicy,
    *,
    targets_only: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The training forward: prompt at full depth, response token i's position under
    ``policy.active_layers(i + 1)``, through :func:`skipdecode.forward.skip_forward`.

    Args:
        adapter: the model's adapter.
        batch: a right-padded :class:`Batch` on the model's device.
        policy: the skip policy.
        targets_only: return only the N loss positions (what :func:`train` computes).

    Returns:
        Logits (B, T, V); with ``targets_only`` a pair ``(logits (N, V), labels (N,))`` over the
        positions of ``batch.target_mask()`` in row-major order (position ``P_b - 1 + i`` predicts
        response token i).

    Raises:
        ValueError: as :func:`build_layer_mask`.
    """
    T = batch.input_ids.shape[1]
    layer_mask = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, T, adapter.num_layers,
                                  device=batch.input_ids.device)
    if not targets_only:
        return skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=layer_mask)
    target_mask = batch.target_mask()
    return _target_logits(adapter, batch, layer_mask, target_mask), batch.labels()[target_mask]


class SkipLossModule(nn.Module):
    """The loss as an ``nn.Module`` so Accelerate can wrap it (DDP, autocast) unchanged.

    Args:
        model: the trainable model registered as submodule ``model`` (HF model or peft model).
        adapter: the adapter over the HF model whose layers ``model`` trains (for peft: the inner
            ``peft_model.base_model.model``, whose LoRA layers are injected in place).
    """

    def __init__(self, model: nn.Module, adapter: Adapter) -> None:
        super().__init__()
        self.model = model
        self.adapter = adapter  # not a Module: no duplicate registration

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        layer_mask: torch.Tensor,
        teacher_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed losses of a batch.

        Args:
            input_ids, attention_mask, prompt_lens, seq_lens: the :class:`Batch` tensors,
                (B, T), (B, T), (B,), (B,).
            layer_mask: (B, T, L) bool from :func:`build_layer_mask`.
            teacher_logits: (N, V) full-depth logits at the N target positions, or None.

        Returns:
            ``(ce_sum, kl_sum)``: scalar float32 sums over the N response tokens (nats) of the
            cross-entropy and of KL(teacher || student) (0 without teacher logits).
        """
        batch = Batch(input_ids, attention_mask, prompt_lens, seq_lens)
        target_mask = batch.target_mask()
        logits = _target_logits(self.adapter, batch, layer_mask, target_mask).float()
        targets = batch.labels()[target_mask]
        ce = F.cross_entropy(logits, targets, reduction="sum")
        if teacher_logits is None:
            return ce, ce.new_zeros(())
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits.float(), -1),
                      log_target=True, reduction="sum")
        return ce, kl


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """The record of a run (also written to ``out_dir/train_record.json``).

    Attributes:
        out_dir: the run directory. final_dir: the trained model's directory (``out_dir/final``).
        steps: optimizer steps done (all invocations). total_steps: steps planned.
        examples_seen, tokens_seen, target_tokens_seen: examples, real tokens (prompt + response)
            and response tokens processed by all processes, all invocations.
        wall_seconds: wall time of this invocation (s), loading and saving included.
        train_seconds: time spent in optimizer steps in this invocation (s).
        tokens_per_second, target_tokens_per_second: tokens (all / response) processed per second
            of optimizer-step time in this invocation.
        train_log: per step ``{"step", "loss" (mean CE per response token, nats), "kl", "lr",
            "speedup" (the policy label), "tokens", "seconds"}``.
        val_log: per evaluation ``{"step", "loss" (mean over policies), "by_policy": {label: loss}}``.
        policy: the default policy's dict. policies: ``{label: policy dict}``. horizon: T (tokens).
        num_layers: L. lora: LoRA run. distill: distillation run.
        data: what the run read and saw (spec, sha256, counts, examples/epochs seen).
        resumed_from: the checkpoint this invocation continued, or None.
        config: the :class:`TrainConfig` as a dict.
    """

    out_dir: str
    final_dir: str | None
    steps: int
    total_steps: int
    examples_seen: int
    tokens_seen: int
    target_tokens_seen: int
    wall_seconds: float
    train_seconds: float
    tokens_per_second: float
    target_tokens_per_second: float
    train_log: list[dict] = field(default_factory=list)
    val_log: list[dict] = field(default_factory=list)
    policy: dict = field(default_factory=dict)
    policies: dict = field(default_factory=dict)
    horizon: int = 0
    num_layers: int = 0
    lora: bool = False
    distill: bool = False
    data: dict = field(default_factory=dict)
    resumed_from: str | None = None
    config: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict."""
        return asdict(self)


# --------------------------------------------------------------------------------------------
# Data order
# --------------------------------------------------------------------------------------------


class _Order:
    """The stream of training indices: epoch e is ``random.Random(seed, e)``'s shuffle of range(n)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # keep one epoch in memory
        return self._perms[epoch]

    def take(self, start: int, count: int) -> list[int]:
        return [self._perm(p // self.n)[p % self.n] for p in range(start, start + count)]


def _policy_index(seed: int, step: int, n: int) -> int:
    """Seeded choice of the policy trained at ``step`` (a pure function: resumes reproduce it)."""
    return 0 if n == 1 else random.Random(seed * 7_919 + step).randrange(n)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint ``out_dir/checkpoint-NNNNNNNN`` (one holding
    ``train_state/state.json``), or None."""
    root = Path(out_dir)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir() and (p / _STATE_DIR / "state.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def _checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    out = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


def _load_full_weights(model: nn.Module, directory: Path) -> None:
    """Load a HF checkpoint's safetensors into ``model`` in place (tied weights may be absent)."""
    from safetensors.torch import load_file

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        raise FileNotFoundError(f"{directory} holds no model.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = [k for k in missing if not (k in params and id(params[k]) in loaded)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {directory} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_examples(items: Sequence[TokenizedExample]) -> str:
    h = hashlib.sha256()
    for ex in items:
        h.update(json.dumps([ex.prompt_ids, ex.response_ids]).encode())
    return h.hexdigest()


def _base_model_name(sk: SkipModel, spec: Any) -> str | None:
    """Where the model can be loaded from again (for a LoRA adapter's ``base_model``)."""
    from .loading import DEFAULT_MODEL

    name = str(spec) if isinstance(spec, (str, os.PathLike)) else sk.source
    if not name:
        return None
    if name == DEFAULT_MODEL or name.startswith(DEFAULT_MODEL + " "):
        return DEFAULT_MODEL
    if Path(name).exists():
        return str(Path(name).resolve())
    return name


# --------------------------------------------------------------------------------------------
# The training loop
# --------------------------------------------------------------------------------------------


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device", "is 'cuda' but torch sees no CUDA device")
    return device


def _split_val(examples: Sequence[Example], fraction: float, cap: int, seed: int) -> tuple[list[int], list[int]]:
    """Indices (train, val): val takes ``fraction`` of the *distinct prompts* (so no prompt is in
    both; E2E has several references per MR), at most ``cap`` examples."""
    if fraction <= 0:
        return list(range(len(examples))), []
    prompts = list(dict.fromkeys(e.prompt for e in examples))
    if len(prompts) < 2:
        raise TrainConfigError("val_fraction", f"needs >= 2 distinct prompts, the data has {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    n_val = min(len(prompts) - 1, max(1, round(fraction * len(prompts))))
    val_prompts = set(prompts[:n_val])
    val = [i for i, e in enumerate(examples) if e.prompt in val_prompts][:cap]
    train_idx = [i for i, e in enumerate(examples) if e.prompt not in val_prompts]
    return train_idx, val


def _as_examples(data: Any, config: TrainConfig, what: str) -> tuple[list[Example], dict]:
    """Examples and a description of where they came from."""
    if isinstance(data, (str, os.PathLike)):
        rows = load_examples(data, task=config.task, skip_bad_rows=config.skip_bad_rows)
        info: dict[str, Any] = {"spec": str(data), "path": getattr(rows, "path", str(data)),
                                "n_skipped_rows": getattr(rows, "n_skipped", 0)}
        p = Path(info["path"])
        if p.is_file():
            info["sha256"] = _sha256_file(p)
        return list(rows), info
    if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray)):
        out = []
        for i, e in enumerate(data):
            if isinstance(e, Example):
                out.append(e)
            elif isinstance(e, str) and config.distill:
                out.append(Example(e, ""))
            else:
                raise DataError(f"{what}[{i}] must be an Example{' or a prompt string' if config.distill else ''}, got {type(e).__name__}")
        if not out:
            raise DataError(f"{what} holds no examples")
        return out, {"spec": "<in-memory>", "n_skipped_rows": 0}
    raise DataError(f"{what} must be a path, a dataset name or a list of Examples, got {type(data).__name__}")


def _teacher_answers(adapter: Adapter, tokenizer: Any, prompts: list[str], *, chat: bool,
                     max_new_tokens: int, batch_size: int, accelerator: Any) -> dict[str, list[int]]:
    """Full-depth greedy answers (token ids, EOS included when produced) for ``prompts``,
    generated in batches sharded over the processes."""
    from accelerate.utils import gather_object

    ordered = sorted(prompts, key=len)
    mine = ordered[accelerator.process_index::accelerator.num_processes]
    full = FullPolicy(adapter.num_layers)
    answers: list[tuple[str, list[int]]] = []
    for start in range(0, len(mine), batch_size):
        chunk = mine[start:start + batch_size]
        result = generate(adapter, tokenizer, chunk, policy=full, max_new_tokens=max_new_tokens, chat=chat)
        answers.extend(zip(chunk, result.token_ids))
    if accelerator.num_processes > 1:
        answers = gather_object(answers)
    return {p: list(ids) for p, ids in answers}


def train(
    model: SkipModel | str | os.PathLike | None,
    data: str | os.PathLike | Sequence[Example | str],
    config: TrainConfig,
    *,
    val_data: str | os.PathLike | Sequence[Example] | None = None,
    callback: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Fine-tune ``model`` with its skip schedule in place (METHOD.md "Training").

    Args:
        model: a :class:`SkipModel`, or anything :func:`skipdecode.load` takes (None: the embedded
            default). It is trained in place and moved to the run's device. With LoRA the adapter
            is injected into its layers (peft) and merged into the weights when the run ends, so
            the model is plain again; a run stopped early leaves the unmerged LoRA layers in it.
        data: a data file / dataset name for :func:`skipdecode.data.load_examples`, or a list of
            :class:`~skipdecode.data.Example` (with ``distill``, plain prompt strings too).
        config: the :class:`TrainConfig`.
        val_data: explicit validation data (default: ``config.val_fraction`` of ``data``).
        callback: called on every process after each optimizer step (and after that step's
            checkpoint is written) with ``{"step", "total_steps", "loss", "lr", "speedup",
            "checkpoint"}``; an exception it raises stops the run (checkpoints stay usable).

    Returns:
        :class:`TrainResult`, also written to ``out_dir/train_record.json``; the model is in
        ``out_dir/final`` (a LoRA run saves only the adapter there, plus ``base_model``).

    Raises:
        TrainConfigError: settings that do not fit the model or the data (``.field`` names it),
            e.g. a speedup too high for the layer count, ``out_dir`` holding another run's
            checkpoints without ``resume`` or a finished model (``final/``) with no checkpoint to
            resume from, or a resume whose settings differ from the checkpoint's.
        skipdecode.data.DataError: the data cannot be read, or no example fits ``max_length``.
        skipdecode.loading.LoadError: ``model`` cannot be loaded.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    wall_start = time.perf_counter()
    device = _resolve_device(config.device)
    out_dir = Path(config.out_dir)

    # ---- model --------------------------------------------------------------------------
    if isinstance(model, SkipModel):
        sk = model
    else:
        from .loading import load

        sk = load(model)
    base_name = config.base_model or _base_model_name(sk, model)
    hf_model = sk.model
    tokenizer = sk.tokenizer
    chat = sk.chat if config.chat is None else config.chat
    num_layers = sk.num_layers
    max_positions = sk.adapter.max_positions
    if max_positions is not None and config.max_length > max_positions:
        raise TrainConfigError("max_length", f"must be <= the model's context of {max_positions} positions, got {config.max_length}")

    set_seed(config.seed)
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if config.bf16 else "no")
    main = accelerator.is_main_process
    rank, world = accelerator.process_index, accelerator.num_processes

    # ---- resume: find the checkpoint first (its settings must match) --------------------
    ckpt: Path | None = None
    saved: dict[str, Any] = {}
    existing = _checkpoints(out_dir)
    if config.resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None and (out_dir / "final").exists():
            raise TrainConfigError("resume", f"{out_dir} holds a finished model ({out_dir / 'final'}) but no "
                                             "checkpoint to resume from; choose another directory to train again")
        if ckpt is None:
            log.warning("resume: no checkpoint in %s, starting a fresh run", out_dir)
        else:
            saved = json.loads((ckpt / _STATE_DIR / "state.json").read_text())
            if saved.get("num_processes", 1) != world:
                raise TrainConfigError("resume", f"needs the {saved.get('num_processes', 1)} processes of {ckpt} "
                                                 f"(the data order depends on it), got {world}")
            for name in _RESUME_FIELDS:
                old, new = saved["config"].get(name), config.to_dict()[name]
                if old != new:
                    raise TrainConfigError(name, f"differs from the checkpoint's ({old!r} in {ckpt}, {new!r} now): "
                                                 "resume needs the same settings")
    elif existing:
        raise TrainConfigError("out_dir", f"{out_dir} already holds checkpoints ({existing[-1][1].name}); "
                                          "pass resume to continue that run or choose another directory")
    elif (out_dir / "final").exists():
        raise TrainConfigError("out_dir", f"{out_dir} already holds a finished model ({out_dir / 'final'}); "
                                          "choose another directory (or remove it) to train again")

    # ---- data ---------------------------------------------------------------------------
    examples, data_info = _as_examples(data, config, "data")
    if val_data is not None:
        val_examples, val_info = _as_examples(val_data, config, "val_data")
        train_raw = examples
        data_info["val_spec"] = val_info.get("spec")
    else:
        train_idx, val_idx = _split_val(examples, config.val_fraction, config.max_val_examples, config.seed)
        train_raw = [examples[i] for i in train_idx]
        val_examples = [examples[i] for i in val_idx]
    if config.distill:  # no labels: one example per distinct prompt
        train_raw = [Example(p, "") for p in dict.fromkeys(e.prompt for e in train_raw)]
        val_examples = [Example(p, "") for p in dict.fromkeys(e.prompt for e in val_examples)]
    elif any(not e.response for e in train_raw):
        raise DataError("an example has an empty response; give responses or use distill")
    if not train_raw:
        raise DataError("no training examples left after the validation split")
    # Drop examples whose prompt alone fills max_length (no response token would fit) *before*
    # planning the data order, so every planned micro-batch holds trainable examples.
    prompt_ids = _encode_prompt_ids(tokenizer, [e.prompt for e in train_raw + val_examples], chat=chat)
    n_before, n_val_before = len(train_raw), len(val_examples)
    train_raw = [e for e in train_raw if len(prompt_ids[e.prompt]) < config.max_length]
    val_examples = [e for e in val_examples if len(prompt_ids[e.prompt]) < config.max_length]
    n_dropped, n_val_dropped = n_before - len(train_raw), n_val_before - len(val_examples)
    if not train_raw:
        raise DataError(f"no training example fits max_length={config.max_length} tokens (the prompts are longer)")

    n_train = len(train_raw)
    step_examples = config.batch_size * world * config.grad_accum
    if config.max_steps is not None:
        total_steps = config.max_steps
    else:
        total_steps = max(1, math.ceil(config.epochs * n_train / step_examples))
    order = _Order(n_train, config.seed)

    # ---- distillation targets (before any weight changes) -------------------------------
    answers: dict[str, list[int]] = {}
    if config.distill:
        if ckpt is not None:
            answers = {k: list(v) for k, v in json.loads((ckpt / _STATE_DIR / "distill_answers.json").read_text()).items()}
        else:
            used = sorted(set(order.take(0, total_steps * step_examples)))
            needed = list(dict.fromkeys([train_raw[i].prompt for i in used] + [e.prompt for e in val_examples]))
            was_training = hf_model.training
            hf_model.to(accelerator.device).eval()
            answers = _teacher_answers(sk.adapter, tokenizer, needed, chat=chat,
                                       max_new_tokens=config.distill_max_new_tokens,
                                       batch_size=config.distill_batch_size, accelerator=accelerator)
            hf_model.train(was_training)

    def tokenize(raw: list[Example]) -> list[TokenizedExample | None]:
        if not config.distill:
            return tokenize_examples(tokenizer, raw, chat=chat, max_length=config.max_length,
                                     response_separator=config.response_separator)[0]
        # prompts outside the planned steps have no teacher answer (and are never drawn): None
        return [_fit(prompt_ids[e.prompt], answers[e.prompt], config.max_length) if e.prompt in answers else None
                for e in raw]

    train_items = tokenize(train_raw)
    val_items = [x for x in tokenize(val_examples) if x is not None]
    data_hash = _hash_examples([x for x in train_items if x is not None])
    if saved and saved.get("data_hash") != data_hash:
        raise TrainConfigError("resume", f"the training data differ from those of {ckpt}")

    # ---- schedule -----------------------------------------------------------------------
    if config.horizon is not None:
        horizon = config.horizon
    elif config.distill:
        lengths = [len(ids) - (1 if ids and ids[-1] == tokenizer.eos_token_id else 0)
                   for e in train_raw if (ids := answers.get(e.prompt)) is not None]
        horizon = max(1, int(math.floor(statistics.median(lengths) + 0.5))) if lengths else 1
    else:
        horizon = max(1, median_response_tokens(train_raw, tokenizer))
    policies = build_policies(config, num_layers, horizon)
    labels = [label for label, _ in policies]

    # ---- trainable model ----------------------------------------------------------------
    hf_model.to(accelerator.device)
    teacher_adapter: Adapter | None = None
    peft_model = None
    if config.kl_weight > 0 and config.lora_r == 0:
        teacher = copy.deepcopy(hf_model).eval().requires_grad_(False)  # the original weights, frozen
        teacher_adapter = get_adapter(teacher)
    if config.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora_cfg = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha or 2 * config.lora_r,
                              lora_dropout=config.lora_dropout, target_modules="all-linear", bias="none",
                              task_type="CAUSAL_LM")
        peft_model = get_peft_model(hf_model, lora_cfg)
        inner = peft_model.base_model.model  # the HF model, LoRA layers injected in place
        trainable: nn.Module = peft_model
    else:
        inner = hf_model
        trainable = hf_model
    adapter = get_adapter(inner)
    if config.kl_weight > 0 and peft_model is not None:
        teacher_adapter = adapter  # run under peft_model.disable_adapter(): the frozen base
    if config.gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(inner, "activation_checkpointing_enable"):
            inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # pragma: no cover - older transformers
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if not all(getattr(layer, "gradient_checkpointing", False) for layer in adapter.layers):
            raise RuntimeError("gradient checkpointing was not switched on for every decoder layer")
    if ckpt is not None:
        if peft_model is not None:
            from peft.utils import load_peft_weights, set_peft_model_state_dict

            set_peft_model_state_dict(peft_model, load_peft_weights(str(ckpt), device="cpu"))
        else:
            _load_full_weights(hf_model, ckpt)

    module = SkipLossModule(trainable, adapter)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio * total_steps)
    scheduler = get_scheduler(config.lr_scheduler, optimizer, num_warmup_steps=min(warmup, total_steps),
                              num_training_steps=total_steps)
    # The scheduler is not prepared: Accelerate would step it once per process.
    module, optimizer = accelerator.prepare(module, optimizer)

    start_step = 0
    train_log: list[dict] = []
    val_log: list[dict] = []
    totals = {"tokens": 0, "targets": 0}
    if ckpt is not None:
        state_dir = ckpt / _STATE_DIR
        optimizer.load_state_dict(torch.load(state_dir / "optimizer.pt", map_location="cpu", weights_only=False))
        scheduler.load_state_dict(torch.load(state_dir / "scheduler.pt", weights_only=False))
        start_step = int(saved["step"])
        train_log = list(saved.get("train_log", []))
        val_log = list(saved.get("val_log", []))
        totals = {"tokens": int(saved.get("tokens_seen", 0)), "targets": int(saved.get("target_tokens_seen", 0))}
        rng_file = state_dir / f"rng-{rank}.pt"
        if not rng_file.exists():
            rng_file = state_dir / "rng-0.pt"
        _set_rng_state(torch.load(rng_file, weights_only=False))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def unwrapped() -> SkipLossModule:
        return accelerator.unwrap_model(module)

    def teacher_logits(batch: Batch, target_mask: torch.Tensor) -> torch.Tensor | None:
        if teacher_adapter is None:
            return None
        ctx = peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()
        with torch.no_grad(), ctx, accelerator.autocast():
            return _target_logits(teacher_adapter, batch, None, target_mask).float()

    def batch_inputs(items: list[TokenizedExample], policy: SkipPolicy) -> tuple[Batch, torch.Tensor]:
        batch = collate(items, pad_id).to(accelerator.device)
        T = batch.input_ids.shape[1]
        lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, T, num_layers, device=accelerator.device)
        return batch, lm

    def evaluate() -> dict[str, float]:
        """Mean CE per response token on the validation set, per policy (all processes)."""
        m = unwrapped()
        m.eval()
        mine = val_items[rank::world]
        result = {}
        with torch.no_grad():
            for label, policy in policies:
                sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
                for start in range(0, len(mine), config.batch_size):
                    batch, lm = batch_inputs(mine[start:start + config.batch_size], policy)
                    with accelerator.autocast():
                        ce, _ = m(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
                    sums += torch.tensor([float(ce), batch.n_targets], dtype=torch.float64, device=accelerator.device)
                sums = accelerator.reduce(sums, "sum")
                result[label] = float(sums[0] / sums[1]) if float(sums[1]) > 0 else float("nan")
        m.train()
        return result

    def log_val(step: int) -> None:
        if not val_items:
            return
        by = evaluate()
        val_log.append({"step": step, "loss": sum(by.values()) / len(by), "by_policy": by})
        log.info("step %d: val loss %s", step, by)

    def data_record(step: int) -> dict[str, Any]:
        return {**data_info, "task": config.task, "n_examples": len(examples), "n_train": n_train,
                "n_train_dropped_too_long": n_dropped, "n_val": len(val_items),
                "n_val_dropped_too_long": n_val_dropped, "examples_seen": step * step_examples,
                "epochs_seen": step * step_examples / n_train, "order_seed": config.seed,
                "distill_prompts": len(answers) if config.distill else 0}

    def skip_config_extra(step: int) -> dict[str, Any]:
        return {
            "task": config.task or ("e2e" if str(data_info.get("path", "")).lower().endswith(".csv") else None),
            "response_separator": None if chat else config.response_separator,
            "horizon": horizon,
            "speedups": [float(s) for s in config.speedups] if config.speedups else None,
            "policies": {label: p.to_dict() for label, p in policies},
            "base_model": base_name,
            "training": {"config": config.to_dict(), "step": step, "total_steps": total_steps,
                         "lora": config.lora_r > 0, "distill": config.distill, "kl_weight": config.kl_weight},
            "data": data_record(step),
            "losses": {"train": [[r["step"], r["loss"]] for r in train_log],
                       "val": [[r["step"], r["loss"]] for r in val_log]},
        }

    def save_model(target: Path, step: int) -> Path:
        """Write the model (HF checkpoint or LoRA adapter) + skipdecode.json atomically."""
        inner_model = unwrapped().model
        hf_inner = inner_model.base_model.model if peft_model is not None else inner_model
        sk_save = SkipModel(hf_inner, tokenizer, policy=policies[0][1], chat=chat, source=base_name or "",
                            skip_config={k: v for k, v in sk.skip_config.items() if k not in ("training", "losses", "data")})
        if peft_model is not None:
            sk_save.model = inner_model  # PeftModel.save_pretrained writes only the adapter
        return sk_save.save_pretrained(target, extra=skip_config_extra(step))

    def record(step: int, final_dir: Path | None, train_seconds: float, tokens_now: int, targets_now: int) -> TrainResult:
        return TrainResult(
            out_dir=str(out_dir), final_dir=str(final_dir) if final_dir else None, steps=step,
            total_steps=total_steps, examples_seen=step * step_examples, tokens_seen=totals["tokens"],
            target_tokens_seen=totals["targets"], wall_seconds=time.perf_counter() - wall_start,
            train_seconds=train_seconds,
            tokens_per_second=tokens_now / train_seconds if train_seconds > 0 else 0.0,
            target_tokens_per_second=targets_now / train_seconds if train_seconds > 0 else 0.0,
            train_log=train_log, val_log=val_log, policy=policies[0][1].to_dict(),
            policies={label: p.to_dict() for label, p in policies}, horizon=horizon, num_layers=num_layers,
            lora=config.lora_r > 0, distill=config.distill, data=data_record(step),
            resumed_from=str(ckpt) if ckpt else None, config=config.to_dict(),
        )

    def save_checkpoint(step: int) -> Path:
        target = out_dir / f"checkpoint-{step:08d}"
        accelerator.wait_for_everyone()
        if main:
            out_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".checkpoint-tmp-", dir=out_dir))
            try:
                ck = save_model(staging / "ckpt", step)
                state_dir = ck / _STATE_DIR
                state_dir.mkdir()
                torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
                torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
                if config.distill:
                    write_json_atomic(state_dir / "distill_answers.json", answers)
                write_json_atomic(state_dir / "state.json", {
                    "step": step, "total_steps": total_steps, "config": config.to_dict(), "data_hash": data_hash,
                    "horizon": horizon, "train_log": train_log, "val_log": val_log,
                    "tokens_seen": totals["tokens"], "target_tokens_seen": totals["targets"],
                    "num_processes": world,
                })
                torch.save(_rng_state(), state_dir / "rng-0.pt")
                if target.exists():
                    shutil.rmtree(target)
                os.replace(ck, target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        accelerator.wait_for_everyone()
        if world > 1:  # each process keeps its own RNG stream (dropout)
            torch.save(_rng_state(), target / _STATE_DIR / f"rng-{rank}.pt")
        if main:
            for _, old in _checkpoints(out_dir)[:-config.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def write_record(res: TrainResult) -> None:
        if main:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(out_dir / RECORD_NAME, res.to_dict())

    # ---- loop ---------------------------------------------------------------------------
    if start_step == 0:
        log_val(0)
    bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
               disable=not (config.progress and main))
    train_seconds = 0.0
    tokens_now = targets_now = 0
    n_trainable = sum(p.numel() for p in params)
    log.info("training %d params (%s), %d steps of %d examples, policies %s, horizon %d",
             n_trainable, "LoRA" if peft_model is not None else "full", total_steps, step_examples, labels, horizon)
    try:
        for step in range(start_step, total_steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            label, policy = policies[_policy_index(config.seed, step, len(policies))]
            indices = order.take(step * step_examples, step_examples)
            micro_items = []
            for j in range(config.grad_accum):
                g = indices[j * config.batch_size * world:(j + 1) * config.batch_size * world]
                mine = [train_items[i] for i in g[rank * config.batch_size:(rank + 1) * config.batch_size]]
                if any(x is None for x in mine):  # pragma: no cover - planning guarantees it
                    raise RuntimeError(f"step {step}: an example without targets was drawn")
                micro_items.append(mine)
            n_targets_local = sum(sum(len(x.response_ids) for x in items) for items in micro_items)
            stats = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # ce, kl, tokens, targets
            for j, items in enumerate(micro_items):
                last = j == len(micro_items) - 1
                ctx = contextlib.nullcontext() if last else accelerator.no_sync(module)
                with ctx:
                    batch, lm = batch_inputs(items, policy)
                    t_logits = teacher_logits(batch, batch.target_mask())
                    ce, kl = module(batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens,
                                    lm, t_logits)
                    loss = (ce + config.kl_weight * kl) / n_targets_local  # token mean over the whole step
                    stats += torch.tensor([float(ce.detach()), float(kl.detach()), batch.n_tokens, batch.n_targets],
                                          dtype=torch.float64, device=accelerator.device)
                    accelerator.backward(loss)
            if config.max_grad_norm > 0:
                accelerator.clip_grad_norm_(params, config.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            stats = accelerator.reduce(stats, "sum")
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            train_seconds += seconds
            n_tok, n_tgt = int(stats[2]), int(stats[3])
            totals["tokens"] += n_tok
            totals["targets"] += n_tgt
            tokens_now += n_tok
            targets_now += n_tgt
            loss_value = float(stats[0] / stats[3]) if n_tgt else float("nan")
            kl_value = float(stats[1] / stats[3]) if n_tgt else float("nan")
            done = step + 1
            train_log.append({"step": done, "loss": loss_value, "kl": kl_value, "lr": lr, "speedup": label,
                              "tokens": n_tok, "seconds": seconds})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tokens_now / train_seconds:.0f}", policy=label,
                            refresh=False)
            if config.eval_every and done % config.eval_every == 0 and done < total_steps:
                log_val(done)
            ckpt_path = None
            if config.checkpoint_every and done % config.checkpoint_every == 0:
                ckpt_path = save_checkpoint(done)
                write_record(record(done, None, train_seconds, tokens_now, targets_now))
            if callback is not None:
                callback({"step": done, "total_steps": total_steps, "loss": loss_value, "lr": lr,
                          "speedup": label, "checkpoint": str(ckpt_path) if ckpt_path else None})
    finally:
        bar.close()

    if not val_log or val_log[-1]["step"] != total_steps:
        log_val(total_steps)
    final_dir = out_dir / "final"
    accelerator.wait_for_everyone()
    if main:
        save_model(final_dir, total_steps)
    accelerator.wait_for_everyone()
    if peft_model is not None:  # leave the caller's model plain, with the adapter merged in place
        peft_model.merge_and_unload()
    result = record(total_steps, final_dir, train_seconds, tokens_now, targets_now)
    write_record(result)
    return result


# --------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------


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
                logits = _target_logits(adapter, batch, lm, target_mask).float()
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
