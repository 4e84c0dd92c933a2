"""OPT adapter: learned positions with offset 2, optional project_in/project_out, pre- or post-LN."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Adapter, register


@register
class OPTAdapter(Adapter):
    """Adapter for ``OPTForCausalLM`` (``model.model.decoder``).

    Positions follow HF OPT: ``position_ids`` (0-based, from the attention mask) are shifted by
    the embedding's own offset (2) inside ``OPTLearnedPositionalEmbedding``. Post-LN variants
    (``do_layer_norm_before=False``, e.g. OPT-350m) have no final layer norm (docs/correctness.md pitfall 9).
    """

    model_types = ("opt",)

    def _layers(self) -> nn.ModuleList:
        return self.model.model.decoder.layers

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``project_in(embed_tokens(ids)) + embed_positions(position_ids)``: (B, T, C)."""
        dec = self.model.model.decoder
        x = dec.embed_tokens(input_ids)
        if dec.project_in is not None:
            x = dec.project_in(x)
        pos = dec.embed_positions(None, 0, position_ids=position_ids)
        return x + pos

    def layer_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """``{"position_ids": (B, T)}``: OPT layers use it only for flash-attention.

        ``hidden`` (B, T, C) is unused; learned positions are added once in :meth:`embed`.
        """
        return {"position_ids": position_ids}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) from the last hidden state (B, T, C).

        Optional final layer norm (pre-LN OPT only), optional ``project_out`` (C -> the word
        embedding width, e.g. OPT-350m), then the LM head.
        """
        dec = self.model.model.decoder
        if dec.final_layer_norm is not None:
            hidden = dec.final_layer_norm(hidden)
        if dec.project_out is not None:
            hidden = dec.project_out(hidden)
        return self.model.lm_head(hidden)
