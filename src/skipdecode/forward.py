"""THE layer loop. Prefill, decode, teacher-forced training and evaluation all call
:func:`skip_forward`; there is no second copy (docs/design.md, docs/correctness.md pitfall 2).

Three ways to say which layers run:
- ``active_layers``: one plan for every position of the call (prefill: all layers; decode step
  t: ``policy.active_layers(t)``); skipped layers are the identity and get no cache entry.
- ``layer_mask`` (B, T, L) bool: per-position plans for teacher forcing (docs/method.md "Training"):
  ``h_l(p) = h_{l-1}(p) + m_l(p) * (Layer_l(h_{l-1})(p) - h_{l-1}(p))``, implemented with
  ``torch.where`` so that kept rows are bit-identical to a skip.
- ``row_layers`` (B, L) bool: one plan per *row* for an in-flight decode step (one new token per
  row, rows at different steps or with different policies; docs/method.md "Rows at different steps in
  one forward"). Layer l runs only on the rows whose plan holds it: their hidden states are
  gathered (or used whole when every row runs it), run, and scattered back; other rows pass
  through and cost nothing. The cache is then a :class:`~skipdecode.cache.SlotView`.

Sparse teacher forcing (docs/method.md "Prefixes in training"; the default): layer l runs only on
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
from .cache import SkipCache, SlotView
from .lowrank import narrow_rows

__all__ = [
    "positions_from_mask", "build_attention_mask", "build_row_attention_mask", "layer_attention_masks",
    "unmasked_layers", "step_masks", "skip_forward",
]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, K) from a left- or right-padded 0/1 ``attention_mask`` (B, K).

    ``cumsum(mask) - 1`` with padding positions set to 0, as Hugging Face's ``generate`` does
    (docs/correctness.md pitfall 4). Each row's first real token gets position 0.
    """
    return _mask_positions(attention_mask)


def _mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """:func:`positions_from_mask` itself (B, K), also called by the mask builder."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def build_attention_mask(
    attention_mask: torch.Tensor,
    num_queries: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive attention mask (B, 1, T, K) for the last ``T = num_queries`` of K positions.

    Query i (absolute index K-T+i) may attend to key j when j <= K-T+i (causal) and key j is a
    real token (``attention_mask[:, j] == 1``) and, with a ``sliding_window`` W, its position
    minus key j's is < W (positions from :func:`positions_from_mask`: a row's own token count,
    so padding *inside* a row, between a cached prompt prefix and the tokens computed after it,
    does not shorten its window; with left padding only this is K-T+i - j).
    Every query may always attend to itself, so no row is fully masked and SDPA can never
    return NaN for padding rows (docs/correctness.md pitfall 5); real rows are unaffected because they attend to
    themselves anyway. Allowed entries are 0, others ``torch.finfo(dtype).min``.
    """
    B, K = attention_mask.shape
    device = attention_mask.device
    q_idx = torch.arange(K - num_queries, K, device=device)[:, None]  # (T, 1)
    k_idx = torch.arange(K, device=device)[None, :]  # (1, K)
    allowed = (k_idx <= q_idx) & attention_mask.bool()[:, None, :]  # (B, T, K)
    if sliding_window is not None:
        pos = _mask_positions(attention_mask)  # (B, K)
        allowed = allowed & (pos[:, K - num_queries :, None] - pos[:, None, :] < sliding_window)
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


def unmasked_layers(adapter: Adapter, attention_mask: torch.Tensor, num_queries: int) -> list[bool]:
    """Per layer (L entries), whether it runs without a mask because its mask would let every
    query see every key: one new token per row (``num_queries`` T = 1), no padding
    (``attention_mask`` (B, K) all ones, so each row's history is all K positions, every row at
    position K - 1), and a layer without an attention window (``adapter.layer_windows``; a
    windowed layer keeps its mask even while K fits the window, so that its compiled variant
    never changes mid-generation).

    Such a step is every batch-1 decode step and every step of an unpadded batch (for the layers
    without a window). HF's SDPA attention given no mask groups the query heads over the shared
    key/value heads (``enable_gqa``, transformers' ``sdpa_attention_forward``) instead of copying
    the keys and values once per query head (``repeat_kv``), which it does under torch.compile
    whenever a mask is passed: on the 2-core test host a 749-token prompt decodes 10 % faster at
    full depth and 12 % at 3x with float32 + compile (same tokens; docs/quantization.md); short
    prompts are unchanged.
    """
    L = adapter.num_layers
    if num_queries != 1 or not bool(attention_mask.all()):
        return [False] * L
    return [w is None for w in adapter.layer_windows]


def step_masks(adapter: Adapter, attention_mask: torch.Tensor, num_queries: int, dtype: torch.dtype,
               per_row: bool = False) -> list[torch.Tensor | None]:
    """The attention mask of every layer for one forward: :func:`layer_attention_masks`
    (B, 1, T, K), None for a layer that needs none (:func:`unmasked_layers`); with ``per_row``
    (an in-flight step, T = 1) :func:`build_row_attention_mask` per window (B, 1, 1, K), always
    (the in-flight engine's compiled variants are warmed with masks). A mask that allows
    everything and no mask give the same attention."""
    if per_row:
        by_window = {w: build_row_attention_mask(attention_mask, dtype, w) for w in dict.fromkeys(adapter.layer_windows)}
        return [by_window[w] for w in adapter.layer_windows]
    free = unmasked_layers(adapter, attention_mask, num_queries)
    if all(free):
        return [None] * adapter.num_layers
    masks = layer_attention_masks(adapter, attention_mask, num_queries, dtype)
    return [None if f else m for f, m in zip(free, masks)]


def build_row_attention_mask(
    attention_mask: torch.Tensor, dtype: torch.dtype, sliding_window: int | None = None
) -> torch.Tensor:
    """Additive mask (B, 1, 1, K) for one new token per row whose query sits at that row's own
    last real position ``q = sum(attention_mask[b]) - 1`` (rows of an in-flight step end at
    different positions; keys after a row's query are other requests' stale slot entries).

    Key j is allowed when ``attention_mask[b, j] == 1`` and, with a ``sliding_window`` W,
    ``q - j < W``. The query's own key is always real, so no row is fully masked (docs/correctness.md pitfall 5).
    """
    K = attention_mask.shape[-1]
    allowed = attention_mask.bool()
    if sliding_window is not None:
        q = attention_mask.long().sum(-1, keepdim=True) - 1
        allowed = allowed & (q - torch.arange(K, device=attention_mask.device)[None, :] < sliding_window)
    mask = torch.zeros((attention_mask.shape[0], 1, 1, K), dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~allowed[:, None, None, :], torch.finfo(dtype).min)


def _take_rows(value, rows: torch.Tensor, batch: int):
    """``value`` (a layer extra: tensor, tuple/list of them, or other) restricted to batch ``rows``."""
    if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == batch:
        return value.index_select(0, rows)
    if isinstance(value, (tuple, list)):
        return type(value)(_take_rows(v, rows, batch) for v in value)
    return value


def _run_layer_on_rows(
    adapter: Adapter, layer_idx: int, hidden: torch.Tensor, mask4d: torch.Tensor, cache: SlotView,
    extra: dict, run: torch.Tensor,
) -> torch.Tensor:
    """Layer ``layer_idx`` on the rows where ``run`` (B,) bool is set; other rows of ``hidden``
    (B, 1, C) are returned unchanged. Checks each running row's cache length first (RuntimeError)."""
    rows = run.cpu().nonzero().flatten()  # the plan lives on the CPU: no device sync per layer
    B = hidden.shape[0]
    if rows.numel() == 0:
        return hidden
    view = cache.rows(rows)
    view.check(layer_idx)
    if rows.numel() == B:
        return adapter.run_layer(layer_idx, hidden, mask4d, view, extra)
    rows = rows.to(hidden.device)
    sub_extra = {k: _take_rows(v, rows, B) for k, v in extra.items()}
    with narrow_rows(adapter.model, rows):  # a skip adapter's base-model rows (lowrank.base_rows), gathered too
        out = adapter.run_layer(layer_idx, hidden.index_select(0, rows), mask4d.index_select(0, rows), view, sub_extra)
    return hidden.index_copy(0, rows, out)


def skip_forward(
    adapter: Adapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    active_layers: Sequence[int] | None = None,
    layer_mask: torch.Tensor | None = None,
    row_layers: torch.Tensor | None = None,
    cache: SkipCache | SlotView | None = None,
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
        row_layers: (B, L) bool (best on the CPU), per-row plan of an in-flight decode step (T = 1); needs a
            :class:`SlotView` cache whose rows end at their own positions: ``attention_mask``
            row b is 1 exactly on that row's history and new token (no padding inside a slot).
        cache: :class:`SkipCache`; every active layer must hold exactly K - T positions (with
            ``row_layers``: a :class:`SlotView`, each running row's length at its position).
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
        ValueError: shapes disagree, ``layer_mask`` or ``kv_prefix`` is combined with ``cache``, or
            ``row_layers`` comes without a :class:`SlotView`, with ``active_layers``/``layer_mask``,
            or with T > 1.
        RuntimeError: an active layer's cached length is not K - T (a broken skip plan; the
            SkipDecode invariant of docs/method.md "Why the KV cache is always complete").
    """
    B, T = input_ids.shape
    K = attention_mask.shape[-1]
    _check_inputs(adapter, B, T, attention_mask, active_layers, layer_mask, row_layers, cache, kv_prefix)
    layers = range(adapter.num_layers) if active_layers is None else active_layers
    position_ids = positions_from_mask(attention_mask)[:, K - T :]
    hidden = adapter.embed(input_ids, position_ids)
    # per layer (B, 1, T, K), or with row_layers (B, 1, 1, K), each row's query at its own
    # position; None where every query sees every key (unpadded decode steps, not in teacher forcing)
    if layer_mask is not None:  # teacher forcing: every layer keeps its mask (_masked_layer reads it)
        masks = layer_attention_masks(adapter, attention_mask, T, hidden.dtype)
    else:
        masks = step_masks(adapter, attention_mask, T, hidden.dtype, per_row=row_layers is not None)
    extra = adapter.layer_inputs(hidden, position_ids)
    extras = {T: extra}  # per prefix length (sparse teacher forcing)
    prefix = _active_prefix_lengths(layer_mask) if layer_mask is not None and sparse else None
    store = cache if cache is not None else kv_prefix
    bridge = adapter.entry_bridge
    prev = -1  # the last layer run (one shared plan)
    for layer_idx in layers:
        if bridge is not None and layer_idx > bridge.source + 1 and bridge.has(layer_idx):
            hidden = _bridge_jumps(bridge, layer_idx, hidden, prev, layer_mask, row_layers)
        prev = layer_idx
        if row_layers is not None:
            hidden = _run_layer_on_rows(adapter, layer_idx, hidden, masks[layer_idx], cache, extra,
                                        row_layers[:, layer_idx])
            continue
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


def _bridge_jumps(bridge, layer_idx: int, hidden: torch.Tensor, prev: int,
                  layer_mask: torch.Tensor | None, row_layers: torch.Tensor | None) -> torch.Tensor:
    """``hidden`` (B, T, C) with the entry bridge of ``layer_idx`` applied where a plan jumps to it.

    A position jumps to layer s when it runs s, ran the bridge's ``source`` layer (or source is
    -1, the embeddings) and runs none of the layers between (:mod:`skipdecode.entry_bridge`).
    One shared plan: ``prev`` is the last layer it ran; ``layer_mask`` (B, T, L) and
    ``row_layers`` (B, L) give per-position and per-row plans."""
    src = bridge.source
    if row_layers is None and layer_mask is None:
        return bridge(layer_idx, hidden) if prev == src else hidden
    plan = row_layers[:, None, :] if row_layers is not None else layer_mask  # (B, T|1, L)
    jump = plan[..., layer_idx] & ~plan[..., src + 1:layer_idx].any(-1)
    if src >= 0:
        jump = jump & plan[..., src]
    if not bool(jump.any()):
        return hidden
    jump = jump.to(hidden.device)
    if bool(jump.all()):
        return bridge(layer_idx, hidden)
    return torch.where(jump[..., None], bridge(layer_idx, hidden), hidden)


def _check_inputs(adapter, B, T, attention_mask, active_layers, layer_mask, row_layers, cache, kv_prefix) -> None:
    """The argument checks of :func:`skip_forward` (ValueError naming what is wrong)."""
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
    if row_layers is not None:
        _check_row_layers(row_layers, B, T, adapter.num_layers, cache, active_layers, layer_mask)


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


def _check_row_layers(row_layers, B, T, num_layers, cache, active_layers, layer_mask) -> None:
    """ValueError unless ``row_layers`` (B, L) bool comes alone with a SlotView and T == 1."""
    if tuple(row_layers.shape) != (B, num_layers):
        raise ValueError(f"row_layers must be (B, L)=({B}, {num_layers}), got {tuple(row_layers.shape)}")
    if not isinstance(cache, SlotView):
        raise ValueError("row_layers (per-row plans) needs a SlotView cache")
    if active_layers is not None or layer_mask is not None:
        raise ValueError("row_layers cannot be combined with active_layers or layer_mask")
    if T != 1:
        raise ValueError(f"row_layers runs one new token per row, got T={T}")
