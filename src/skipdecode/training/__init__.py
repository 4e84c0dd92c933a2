"""Skip-aware fine-tuning (docs/method.md "Training: the model must learn the schedule").

A stock model collapses when its lower layers are skipped, so SkipDecode fine-tunes it **with the
skip schedule in place**, by teacher forcing that reproduces the inference computation exactly:

* :mod:`.config`: :class:`TrainConfig` (validated settings), :class:`TrainConfigError`, the
  policies a run trains (:func:`build_policies`).
* :mod:`.batching`: tokenisation exactly as inference encodes prompts, right-padded
  :class:`Batch` es, the per-position layer plan (:func:`build_layer_mask`: prompt positions run
  every layer, the position holding response token i runs ``policy.active_layers(i + 1)``), the
  seeded data order.
* :mod:`.loss`: the teacher-forced forward through THE layer loop
  (:func:`skipdecode.forward.skip_forward`), sparse or masked, with or without the prompt's
  gradient; :class:`SkipLossModule` (cross-entropy on response tokens, optional KL to a teacher).
* :mod:`.checkpoint`: atomic checkpoints, resume, RNG state.
* :mod:`.prepare`: the run's examples, validation split, distillation answers and horizon.
* :mod:`.loop`: :func:`train`. :mod:`.record`: :class:`TrainResult`.
* :mod:`.throughput`: :func:`measure_throughput`.

:mod:`skipdecode.train` re-exports the public names, so ``from skipdecode.train import ...`` works.
"""

from .batching import Batch, TokenizedExample, build_layer_mask, collate, tokenize_examples
from .checkpoint import RECORD_NAME, latest_checkpoint
from .config import TrainConfig, TrainConfigError, build_policies
from .loop import train
from .loss import SkipLossModule, target_logits, teacher_forced_logits
from .record import TrainResult
from .throughput import measure_throughput

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
