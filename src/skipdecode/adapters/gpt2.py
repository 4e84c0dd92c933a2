"""GPT-2 adapter: learned absolute positions, ``transformer.h`` blocks, final ``ln_f``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Adapter, register


@register
class GPT2Adapter(Adapter):
    """Adapter for ``GPT2LMHeadModel`` (``model.transformer``)."""

    model_types = ("gpt2",)

    def _layers(self) -> nn.ModuleList:
        return self.model.transformer.h

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``wte(ids) + wpe(position_ids)`` then embedding dropout: (B, T, C)."""
        tr = self.model.transformer
        return tr.drop(tr.wte(input_ids) + tr.wpe(position_ids))

    def layer_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """``{"position_ids": (B, T)}``: GPT-2 blocks need no other per-forward extras.

        ``hidden`` (B, T, C) is unused; positions are added once in :meth:`embed`.
        """
        return {"position_ids": position_ids}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(ln_f(hidden))``: (B, T, C) -> (B, T, V)."""
        return self.model.lm_head(self.model.transformer.ln_f(hidden))
