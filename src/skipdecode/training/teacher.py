"""The KL teacher of a run (``TrainConfig.teacher``): a separate frozen full-depth model.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import Adapter, get_adapter
from ..model import SkipModel
from .config import TrainConfigError

__all__ = ["load_teacher"]


def _vocab_size(hf_model: Any) -> int:
    """Rows of the output projection (the logits' last dimension, tokens)."""
    head = hf_model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(hf_model.config.vocab_size)  # pragma: no cover - every supported family has a head


def check_same_vocabulary(student: SkipModel, teacher: SkipModel, spec: str) -> None:
    """Require the teacher's tokenizer vocabulary and logit width to be the student's.

    The KL term compares the two distributions token id by token id, so the ids must mean the
    same tokens and the logits (N, V) must have the same V.

    Raises:
        TrainConfigError: (field ``teacher``) the vocabularies or logit widths differ.
    """
    s_vocab, t_vocab = student.tokenizer.get_vocab(), teacher.tokenizer.get_vocab()
    if s_vocab != t_vocab:
        differ = sum(1 for k, v in t_vocab.items() if s_vocab.get(k) != v) + len(set(s_vocab) - set(t_vocab))
        raise TrainConfigError("teacher", f"{spec!r} has another tokenizer vocabulary than the student "
                                          f"({len(t_vocab)} vs {len(s_vocab)} tokens, {differ} differ); "
                                          "KL needs the same token ids")
    s_width, t_width = _vocab_size(student.model), _vocab_size(teacher.model)
    if s_width != t_width:
        raise TrainConfigError("teacher", f"{spec!r} gives {t_width} logits per position, the student "
                                          f"{s_width}; KL needs the same vocabulary size")


def load_teacher(spec: str, student: SkipModel, device: torch.device | str) -> Adapter:
    """Load ``spec`` as the run's frozen KL teacher, on ``device`` in the student's dtype.

    Args:
        spec: anything :func:`skipdecode.load` takes (name, checkpoint directory, ``.gguf``).
        student: the model being trained (its tokenizer and weight dtype are the reference).
        device: where the run trains.

    Returns:
        The teacher's :class:`Adapter`, in eval mode with ``requires_grad`` off on every weight;
        the caller runs it at full depth under ``torch.no_grad()``.

    Raises:
        TrainConfigError: (field ``teacher``) it cannot be loaded (one line saying why), or its
            vocabulary differs from the student's (:func:`check_same_vocabulary`).
    """
    from ..adapters import UnsupportedArchitectureError
    from ..loading import LoadError, load

    try:
        teacher = load(spec, adapter=False)  # the stock full-depth weights
    except (LoadError, UnsupportedArchitectureError, OSError, ValueError) as err:
        first = (str(err).splitlines() or [""])[0][:300]
        raise TrainConfigError("teacher", f"cannot be loaded from {spec!r}: {first}") from None
    check_same_vocabulary(student, teacher, spec)
    dtype = next(student.model.parameters()).dtype
    hf = teacher.model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return get_adapter(hf)
