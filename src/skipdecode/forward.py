"""THE layer loop. Prefill, decode, teacher-forced training and evaluation all call
:func:`skip_forward`; there is no second copy (DESIGN.md, PITFALLS 2).

Two ways to say which layers run:
- ``active_layers``: one plan for every position of the call (prefill: all layers; decode step
  t: ``policy.active_layers(t)``); skipped layers are the identity and get no cache entry.
- ``layer_mask`` (B, T, L) bool: per-position plans for teacher forcing (METHOD.md "Training"):
  ``h_l(p) = h_{l-1}(p) + m_l(p) * (Layer_l(h_{l-1})(p) - h_{l-1}(p))``, implemented with
  ``torch.where`` so that kept rows are bit-identical to a skip.

Sparse teacher forcing (METHOD.md "Prefixes in training"; the default): layer l runs only on
``hidden[:, :n_l]``, n_l = 1 + the last position that any row runs l at; the masked update is kept
for the rows whose own prefix is shorter, positions >= n_l pass through unchanged. It is exact for
any mask, because a query never attends to a later key (causal attention): what the masked form
computes at positions >= n_l is discarded anyway. Under a monotone plan n_l follows the schedule,
so the layer work of teacher forcing is what decoding does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .adapters import Adapter
from .cache import SkipCache

__all__ = ["positions_from_mask", "build_attention_mask", "layer_attention_masks", "skip_forward"]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, K) from a left- or right-padded 0/1 ``attention_mask`` (B, K).

    ``cumsum(mask) - 1`` with padding positions set to 0, as Hugging Face's ``generate`` does
    (PITFALLS 4). Each row's first real token gets position 0.
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp_min(0)


def build_attention_mask(
    attention_mask: torch.Tensor,
    num_queries: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive attention mask (B, 1, T, K) for the last ``T = num_queries`` of K positions.

    Query i (absolute index K-T+i) may attend to key j when j <= K-T+i (causal) and key j is a
    real token (``attention_mask[:, j] == 1``) and, with a ``sliding_window`` W, K-T+i - j < W.
    Every query may always attend to itself, so no row is fully masked and SDPA can never
    return NaN for padding rows (PITFALLS 5); real rows are unaffected because they attend to
    themselves anyway. Allowed entries are 0, others ``torch.finfo(dtype).min``.
    """
    B, K = attention_mask.shape
    device = attention_mask.device
    q_idx = torch.arange(K - num_queries, K, device=device)[:, None]  # (T, 1)
    k_idx = torch.arange(K, device=device)[None, :]  # (1, K)
    allowed = (k_idx <= q_idx) & attention_mask.bool()[:, None, :]  # (B, T, K)
    if sliding_window is not None:
        allowed = allowed & (q_idx - k_idx < sliding_window)
    allowed = allowed | (k_idx == q_idx)
    mask = torch.zeros((B, 1, num_queries, K), dtype=dtype, device=device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def layer_attention_masks(
    adapter: Adapter, attention_mask: torch.Tensor, num_queries: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The additive mask (B, 1, T, K) of every layer, indexed by ``layer_idx`` (L entries).

    Each layer gets :func:`build_attention_mask` with its own window
    (``adapter.layer_windows[layer_idx]``: Qwen2/Qwen3/SmolLM3 ``layer_types``, Mistral's one
    window, or none), as HF builds one mask per layer type; layers with the same window share
    one tensor, so a model without windows builds one mask.
    """
    by_window = {
        w: build_attention_mask(attention_mask, num_queries, dtype, w) for w in dict.fromkeys(adapter.layer_windows)
    }
    return [by_window[w] for w in adapter.layer_windows]


def skip_forward(
    adapter: Adapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    active_layers: Sequence[int] | None = None,
    layer_mask: torch.Tensor | None = None,
    cache: SkipCache | None = None,
    logits_last_only: bool = False,
    return_hidden: bool = False,
    sparse: bool = True,
    kv_prefix: Any = None,
) -> torch.Tensor:
    """Run the model over ``input_ids`` with the given layer plan; return logits.

    Args:
        adapter: the architecture adapter of the model.
        input_ids: (B, T) new tokens.
        attention_mask: (B, K) 0/1 mask over *all* K positions so far (cached + new, K >= T);
            positions come from it (:func:`positions_from_mask`), never from a cache length.
        active_layers: ascending layer indices to run for all T positions (None: all layers).
        layer_mask: (B, T, L) bool, per-position plan (teacher forcing); excludes ``cache``.
        cache: :class:`SkipCache`; every active layer must hold exactly K - T positions.
        logits_last_only: return logits for the last position only, (B, 1, V).
        return_hidden: return the final hidden state (B, T, C) before the head instead.
        sparse: with ``layer_mask``, run layer l on the first n_l positions only (see the module
            docstring; exact); False runs every layer on all T positions (the masked reference).
        kv_prefix: instead of ``cache``, read-only keys/values of the first K - T positions
            (``update`` returns prefix + new and stores nothing; ``lengths`` per layer), e.g.
            :class:`skipdecode.training.loss.PrefixKV` for a prompt run under ``no_grad``.

    Returns:
        Logits (B, T, V) (or (B, 1, V), or hidden (B, T, C)).

    Raises:
        ValueError: shapes disagree, or ``layer_mask`` / ``kv_prefix`` is combined with ``cache``.
        RuntimeError: an active layer's cached length is not K - T (a broken skip plan; the
            SkipDecode invariant of METHOD.md "Why the KV cache is always complete").
    """
    B, T = input_ids.shape
    K = attention_mask.shape[-1]
    if attention_mask.shape[0] != B or K < T:
        raise ValueError(
            f"attention_mask must be (B={B}, K>={T}), got {tuple(attention_mask.shape)}"
        )
    if cache is not None and kv_prefix is not None:
        raise ValueError("kv_prefix cannot be combined with a cache")
    if layer_mask is not None:
        if cache is not None:
            raise ValueError("layer_mask (teacher forcing) cannot be combined with a cache; pass kv_prefix")
        if layer_mask.shape != (B, T, adapter.num_layers):
            raise ValueError(
                f"layer_mask must be (B, T, L)=({B}, {T}, {adapter.num_layers}), got {tuple(layer_mask.shape)}"
            )
    layers = range(adapter.num_layers) if active_layers is None else active_layers
    position_ids = positions_from_mask(attention_mask)[:, K - T :]
    hidden = adapter.embed(input_ids, position_ids)
    masks = layer_attention_masks(adapter, attention_mask, T, hidden.dtype)  # per layer (B, 1, T, K)
    extra = adapter.layer_inputs(hidden, position_ids)
    extras = {T: extra}  # per prefix length (sparse teacher forcing)
    prefix = _active_prefix_lengths(layer_mask) if layer_mask is not None and sparse else None
    store = cache if cache is not None else kv_prefix
    for layer_idx in layers:
        if store is not None and store.lengths[layer_idx] != K - T:
            raise RuntimeError(
                f"layer {layer_idx} holds {store.lengths[layer_idx]} cached positions, expected {K - T}: "
                "a layer skipped earlier cannot run again (the plan is not monotone)"
            )
        if layer_mask is not None:
            keep = layer_mask[:, :, layer_idx]
            n = prefix[layer_idx] if prefix is not None else (T if bool(keep.any()) else 0)
            if n:
                hidden = _masked_layer(adapter, layer_idx, hidden, keep, n, masks[layer_idx], store, extras, position_ids)
        else:
            hidden = adapter.run_layer(layer_idx, hidden, masks[layer_idx], store, extra)
    if return_hidden:
        return hidden
    if logits_last_only:
        hidden = hidden[:, -1:]
    return adapter.head(hidden)


def _active_prefix_lengths(layer_mask: torch.Tensor) -> list[int]:
    """Per layer l, n_l = 1 + the last position (of T) that any row runs l at (0: no position).

    ``layer_mask`` is (B, T, L) bool; returns L lengths (positions)."""
    T = layer_mask.shape[1]
    any_row = layer_mask.any(0)  # (T, L)
    idx = torch.arange(1, T + 1, device=layer_mask.device)[:, None] * any_row
    return idx.amax(0).tolist() if T else [0] * layer_mask.shape[2]


def _masked_layer(
    adapter: Adapter,
    layer_idx: int,
    hidden: torch.Tensor,
    keep: torch.Tensor,
    n: int,
    mask4d: torch.Tensor,
    cache: Any,
    extras: dict,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Layer ``layer_idx`` on the first ``n`` of T positions with the masked residual update.

    ``hidden`` (B, T, C), ``keep`` (B, T) bool (``keep[:, n:]`` must be all False), ``mask4d``
    (B, 1, T, K), ``position_ids`` (B, T); ``extras`` caches ``adapter.layer_inputs`` per prefix
    length. Returns the new hidden state (B, T, C); positions >= n are passed through."""
    T, K = hidden.shape[1], mask4d.shape[-1]
    if n not in extras:
        extras[n] = adapter.layer_inputs(hidden[:, :n], position_ids[:, :n])
    part = hidden[:, :n]
    out = adapter.run_layer(layer_idx, part, mask4d[:, :, :n, : K - T + n], cache, extras[n])
    out = torch.where(keep[:, :n, None], out, part)
    return out if n == T else torch.cat([out, hidden[:, n:]], dim=1)
