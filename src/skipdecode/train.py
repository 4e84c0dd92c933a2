"""Skip-aware fine-tuning: a thin re-export of :mod:`skipdecode.training` (kept so that
``from skipdecode.train import TrainConfig, train, ...`` and the ``skipdecode train`` command keep
working). See the package docstring for where each piece lives."""

from __future__ import annotations

from .training import (
    RECORD_NAME,
    Batch,
    SkipLossModule,
    TokenizedExample,
    TrainConfig,
    TrainConfigError,
    TrainResult,
    build_layer_mask,
    build_policies,
    collate,
    latest_checkpoint,
    measure_throughput,
    target_logits,
    teacher_forced_logits,
    tokenize_examples,
    train,
)

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
    "target_logits",
    "latest_checkpoint",
    "train",
    "measure_throughput",
    "RECORD_NAME",
]
