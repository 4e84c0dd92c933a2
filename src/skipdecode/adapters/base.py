"""Architecture adapters: drive the stock Hugging Face decoder layers, never copy their forward.

An adapter exposes the four pieces SkipDecode's one layer loop (:mod:`skipdecode.forward`) needs:
``embed`` (token + position embeddings), ``layer_inputs`` (per-step extras such as rotary
``position_embeddings``), ``run_layer`` (one stock decoder layer) and ``head`` (the model's own
tail: final norm, any output projection, LM head). It never writes the HF config (docs/correctness.md pitfall 3).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["Adapter", "ADAPTERS", "register", "get_adapter", "supported_model_types", "UnsupportedArchitectureError"]


class UnsupportedArchitectureError(ValueError):
    """Raised for a ``config.model_type`` with no registered adapter (lists the supported ones),
    or a config whose attention the layer loop cannot reproduce (names the setting)."""


# ``config.layer_types`` values whose attention is a causal mask, optionally windowed.
_WINDOWED_LAYER_TYPES = ("full_attention", "sliding_attention")


class Adapter:
    """Base class. Subclasses set ``model_types`` and implement the hooks below.

    Args:
        model: a Hugging Face ``*ForCausalLM`` model.

    Attributes:
        model: the wrapped model (never modified).
        layers: the stock decoder layers, ``num_layers`` of them.
        num_layers: L (layers).
        max_positions: longest sequence the model's positions support (tokens), or None.
        layer_windows: per layer, its sliding attention window (tokens) or None (full causal
            attention); see :meth:`_layer_windows`.

    Raises:
        UnsupportedArchitectureError: the config's per-layer attention types cannot be masked.
    """

    model_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: nn.ModuleList = self._layers()
        self.num_layers = len(self.layers)
        cfg = model.config
        self.max_positions: int | None = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        # Sliding-window attention per layer, enforced by our own masks (None: full attention).
        self.layer_windows: tuple[int | None, ...] = self._layer_windows()
        # transformers renamed the layers' cache argument from `past_key_values` to `cache`
        # (5.2x); pass whichever the installed version's layer accepts.
        params = inspect.signature(type(self.layers[0]).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # set by skipdecode.compiled.compile_adapter: a torch.compile'd stand-in for
        # call_layer that run_layer uses for decode steps (one new token per row)
        self.compiled_layer_call: Any = None

    @property
    def entry_bridge(self) -> Any:
        """The :class:`skipdecode.entry_bridge.EntryBridge` attached to the model, or None (the
        paper's plain jump; :func:`skipdecode.entry_bridge.attach_entry_bridge`)."""
        from ..entry_bridge import entry_bridge_of

        return entry_bridge_of(self.model)

    # -- hooks -------------------------------------------------------------------------------
    def _layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def _layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of each layer (tokens; None: full causal attention), as HF's
        own model forward builds its masks.

        A config with ``layer_types`` (Qwen2 and Qwen3 derive it from ``use_sliding_window`` and
        ``max_window_layers``, SmolLM3 from its NoPE layers) gets, per layer, one mask per type:
        ``config.sliding_window`` for ``"sliding_attention"``, none for ``"full_attention"``
        (HF ``masking_utils.create_sliding_window_causal_mask`` / ``create_causal_mask``). A
        config without it applies ``sliding_window`` to every layer (Mistral), unless
        ``use_sliding_window`` is false. Families whose HF model ignores ``layer_types`` override
        this hook.

        Raises:
            UnsupportedArchitectureError: a layer type other than full or sliding attention
                (chunked, linear, ...), which the layer loop cannot mask; or ``layer_types`` of
                the wrong length.
        """
        cfg = self.model.config
        window = getattr(cfg, "sliding_window", None) or None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is None:
            return (window if getattr(cfg, "use_sliding_window", True) else None,) * self.num_layers
        if len(layer_types) != self.num_layers:
            raise UnsupportedArchitectureError(
                f"config.layer_types has {len(layer_types)} entries for {self.num_layers} layers"
            )
        unknown = sorted(set(layer_types) - set(_WINDOWED_LAYER_TYPES))
        if unknown:
            raise UnsupportedArchitectureError(
                f"config.layer_types holds {', '.join(map(repr, unknown))}; the layer loop supports "
                f"{' and '.join(map(repr, _WINDOWED_LAYER_TYPES))} layers only"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings (B, T, C) for ``input_ids`` (B, T) at ``position_ids`` (B, T).

        Raises:
            NotImplementedError: a subclass must implement it (each family's adapter does).
        """
        raise NotImplementedError

    def layer_inputs(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
        """Extra keyword arguments every decoder layer gets for this forward (default: none).

        ``hidden`` is the layer input (B, T, C) (used only for its dtype and device) and
        ``position_ids`` (B, T) the absolute positions (tokens) of the T new tokens; the values
        of the returned dict are computed once per forward and passed to every layer.
        """
        return {}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) from the last hidden state (B, T, C): final norm, projections, LM head.

        Raises:
            NotImplementedError: a subclass must implement it (each family's adapter does).
        """
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------
    def run_layer(
        self,
        layer_idx: int,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
        extra: dict[str, Any],
    ) -> torch.Tensor:
        """Run stock decoder layer ``layer_idx`` on ``hidden`` (B, T, C) -> (B, T, C).

        ``attention_mask`` is the additive 4-D mask (B, 1, T, K), or None when every query sees
        every key (:func:`skipdecode.forward.unmasked_layers`); ``cache`` is a
        :class:`skipdecode.cache.SkipCache` (or None in training) that the layer's attention
        updates through the HF ``Cache.update`` contract.
        """
        kwargs = dict(extra)
        call = call_layer
        if self.compiled_layer_call is not None and not torch.is_grad_enabled() and (
            hidden.shape[1] == 1 or cache is not None
        ):  # decode steps and prefills (:mod:`skipdecode.compiled`), inference only: the compiled
            call = self.compiled_layer_call  # graphs' custom products have no derivative
        return call(self.layers[layer_idx], hidden, attention_mask, cache, self._cache_kw, kwargs)

    def check_context(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a generation whose positions do not fit the model's context.

        A prompt of P tokens and N new tokens need ``P + N - 1`` positions: the last generated
        token is never fed back, so HF's ``generate`` returns 1 token for a prompt that fills the
        whole context. ``prompt_tokens`` is P (the padded batch width, tokens); ``max_new_tokens``
        is N (tokens).

        Raises:
            ValueError: ``P + N - 1 > max_positions``; the message names ``max_new_tokens`` and
                the largest value that fits.
        """
        needed = prompt_tokens + max_new_tokens - 1
        if self.max_positions is not None and needed > self.max_positions:
            fits = self.max_positions - prompt_tokens + 1
            hint = f"max_new_tokens <= {fits} fits" if fits >= 1 else "shorten the prompt"
            raise ValueError(
                f"prompt length {prompt_tokens} + max_new_tokens {max_new_tokens} needs {needed} positions "
                f"(the last new token is never fed back), more than the model's context of "
                f"{self.max_positions}; {hint}"
            )

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(num_key_value_heads, head_dim) of every layer's cache entries."""
        cfg = self.model.config
        heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        return kv_heads, head_dim


def call_layer(
    layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any, cache_kw: str, extra: dict[str, Any]
) -> torch.Tensor:
    """One stock decoder layer call, (B, T, C) -> (B, T, C): ``cache`` is passed under the
    keyword ``cache_kw`` (``cache`` or ``past_key_values``) and ``extra`` as keywords."""
    out = layer(hidden, attention_mask=attention_mask, use_cache=cache is not None, **{cache_kw: cache}, **extra)
    return out[0] if isinstance(out, tuple) else out


ADAPTERS: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    """Class decorator: register ``cls`` for each of its ``model_types``."""
    for model_type in cls.model_types:
        ADAPTERS[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    """Sorted list of ``config.model_type`` values with an adapter."""
    return sorted(ADAPTERS)


def get_adapter(model: nn.Module) -> Adapter:
    """Build the adapter for ``model`` from ``model.config.model_type``.

    Raises:
        UnsupportedArchitectureError: the model type has no adapter (message lists the
            supported ones).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = ADAPTERS.get(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported architectures: "
            f"{', '.join(supported_model_types())}"
        )
    return cls(model)
