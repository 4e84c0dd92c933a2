"""The inputs of :func:`skipdecode.generate.generate_step`, checked before any work, so that a bad
one is named (argument and what it must be) instead of failing inside torch, and a right-padded
batch, which would decode its short rows after their padding, is refused."""

from __future__ import annotations

from typing import Sequence

import torch

from .adapters import Adapter


def check_step_inputs(adapter: Adapter, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  eos_token_ids: Sequence[int]) -> None:
    """:func:`generate_step`'s inputs, checked before any work: an :class:`Adapter`, two (B, P)
    tensors with B, P >= 1, integer ids in [0, vocabulary size), a left-padded mask
    (:func:`check_left_padded`) and a sequence of EOS ids.

    Raises:
        ValueError: naming the argument at fault and what it must be.
    """
    if not all(hasattr(adapter, a) for a in ("check_context", "num_layers", "model", "run_layer")):  # or a proxy of one
        hint = " (a SkipModel's is model.adapter)" if hasattr(adapter, "adapter") else ""
        raise ValueError(f"adapter must be a model's Adapter (skipdecode.get_adapter(model)){hint}, "
                         f"got {type(adapter).__name__}")
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a (B, P) torch.Tensor (skipdecode.encode_prompts builds both), "
                             f"got {type(t).__name__}")
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (B, P); got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one prompt of at least one token")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    vocab = adapter.model.get_input_embeddings().num_embeddings
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (padding included), got {low if low < 0 else high}")
    check_left_padded(attention_mask)
    if isinstance(eos_token_ids, (int, str, bytes)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in eos_token_ids):
        raise ValueError(f"eos_token_ids must be a sequence of token ids (e.g. [2]), got {eos_token_ids!r}")


def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Refuse a (B, P) ``attention_mask`` that is not left-padded: each row some 0s (padding),
    then 1s up to its last column. A right-padded batch (Hugging Face tokenizers' default
    ``padding_side="right"``) would decode every short row after its padding, silently wrong.

    Raises:
        ValueError: naming the first row that is not left-padded and how to build one.
    """
    m = attention_mask
    ok = ((m == 0) | (m == 1)).all(-1) & (m[:, 1:] >= m[:, :-1]).all(-1) & (m[:, -1] == 1)
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0, 0])
        if bool((m[row] == 0).all()):
            raise ValueError(f"attention_mask row {row} holds no token (all 0): every row needs a prompt of >= 1 token")
        raise ValueError(
            f"attention_mask must be left-padded (per row 0s, then 1s up to the last column); row {row} is "
            f"{m[row].tolist() if m.shape[1] <= 16 else 'not'}: pad on the left (tokenizer.padding_side = "
            f"'left') or build the batch with skipdecode.encode_prompts(tokenizer, prompts)")
