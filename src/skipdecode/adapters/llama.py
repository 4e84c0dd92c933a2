"""Llama family adapter (llama, mistral, qwen2; SmolLM2 is llama): rotary positions, pre-norm."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Adapter, register


@register
class LlamaAdapter(Adapter):
    """Adapter for ``LlamaForCausalLM``-shaped models (``model.model.layers``, ``rotary_emb``)."""

    model_types = ("llama", "mistral", "qwen2", "qwen3", "smollm3")

    def _layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def _layer_windows(self) -> tuple[int | None, ...]:
        """Mistral applies ``sliding_window`` to every layer and ignores any ``layer_types``
        (HF ``MistralModel.forward``); the others follow :meth:`Adapter._layer_windows`."""
        cfg = self.model.config
        if cfg.model_type == "mistral":
            return (getattr(cfg, "sliding_window", None) or None,) * self.num_layers
        return super()._layer_windows()

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C); positions enter through rotary embeddings per layer."""
        return self.model.model.embed_tokens(input_ids)

    def layer_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """Rotary ``(cos, sin)`` for ``position_ids`` (B, T), computed once per forward.

        ``hidden`` (B, T, C) gives the dtype and device. Returns ``position_embeddings``, the
        model's own ``rotary_emb`` output ``(cos, sin)``, each (B, T, head_dim), and
        ``position_ids`` (B, T).
        """
        return {
            "position_embeddings": self.model.model.rotary_emb(hidden, position_ids=position_ids),
            "position_ids": position_ids,
        }

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm then the LM head: (B, T, C) -> (B, T, V)."""
        return self.model.lm_head(self.model.model.norm(hidden))
