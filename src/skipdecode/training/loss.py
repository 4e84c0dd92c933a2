"""The teacher-forced training forward and its loss (docs/method.md "Training").

Prompt positions run every layer; the position holding response token i runs
``policy.active_layers(i + 1)``; the loss is next-token cross-entropy on the response tokens
(plus, optionally, KL to a full-depth teacher). Everything goes through THE layer loop,
:func:`skipdecode.forward.skip_forward`.

Two exact speed options (docs/training-speed.md):

* ``sparse`` (default): each layer runs only on the prefix of positions whose plan includes it.
* ``prompt_grad=False``: the prompt, except its last token, runs at full depth under
  ``torch.no_grad()`` into a KV cache (keys/values from the current weights); the last prompt
  token and the response run with gradient against those keys/values. The forward computes the
  same values as with ``prompt_grad=True``; no gradient flows through the prompt's activations or
  its cached keys/values.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import Adapter
from ..cache import SkipCache
from ..forward import skip_forward
from ..policy import SkipPolicy
from .batching import Batch, build_layer_mask

__all__ = ["teacher_forced_logits", "target_logits", "SkipLossModule", "PrefixKV", "position_weights"]


def position_weights(response_lens: list[int], half_life: float | None,
                     device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Per-target loss weights that halve every ``half_life`` response tokens.

    Response token ``i`` (0-based) of every row weighs ``2 ** (-i / half_life)``, so the first
    answer tokens, where a greedy answer first parts from the teacher's and which decide most of
    a sequence-level agreement score, count more than late ones (a project extension,
    ``TrainConfig.position_half_life``; the paper's loss is the unweighted token mean).

    Args:
        response_lens: tokens of each row's response, in batch order (the row-major order of
            ``Batch.target_mask()``: row b contributes ``response_lens[b]`` targets).
        half_life: tokens (> 0), or None for uniform weights.
        device: where the weights live.

    Returns:
        (N,) float32 weights, N = ``sum(response_lens)``, or None when ``half_life`` is None.

    Raises:
        ValueError: ``half_life`` not a finite number > 0, or a negative length.
    """
    if half_life is None:
        return None
    if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not half_life > 0 \
            or half_life == float("inf"):
        raise ValueError(f"half_life must be a finite number > 0 (tokens), got {half_life!r}")
    if any(n < 0 for n in response_lens):
        raise ValueError(f"response_lens must be >= 0, got {list(response_lens)!r}")
    idx = torch.cat([torch.arange(n, dtype=torch.float32) for n in response_lens]) if response_lens \
        else torch.zeros(0)
    return torch.exp2(-idx / float(half_life)).to(device)


class PrefixKV:
    """A read-only per-layer key/value prefix that HF attention modules can call ``update`` on.

    ``update(key, value, layer_idx)`` returns ``cat(prefix, new)`` along the sequence axis and
    stores nothing, so a layer recomputed or run twice sees the same keys (no cache state).

    Args:
        cache: a :class:`SkipCache` filled by a full-depth prefill; its first ``lengths[l]``
            positions of layer l are the prefix, (B, H_kv, n, D) each.
    """

    def __init__(self, cache: SkipCache) -> None:
        self.lengths = list(cache.lengths)
        self.keys = [None if k is None else k[:, :, :n] for k, n in zip(cache.keys, self.lengths)]
        self.values = [None if v is None else v[:, :, :n] for v, n in zip(cache.values, self.lengths)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H_kv, n + T, D): the prefix then the new (B, H_kv, T, D) ones."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if k is None:
            return key_states, value_states
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)

    def get_seq_length(self, layer_idx: int) -> int:
        """Prefix positions of layer ``layer_idx`` (tokens)."""
        return self.lengths[layer_idx]


def _split_batch(batch: Batch, layer_mask: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Re-lay a right-padded batch as [left-padded context | right-padded suffix].

    The context of row b is its prompt less the last token (``P_b - 1`` tokens, left-padded to
    C = max); the suffix is the last prompt token and the response (``S_b - P_b + 1`` tokens,
    right-padded to R = max). Returns ``ctx_ids`` (B, C), ``suf_ids`` (B, R), ``attention_mask``
    (B, C + R), ``suffix_mask`` (B, R, L) (the rows of ``layer_mask``) and ``targets`` (B, R)
    bool, the suffix columns that predict a response token (in the order of
    ``batch.target_mask()``)."""
    ids, P, S = batch.input_ids, batch.prompt_lens, batch.seq_lens
    T, dev = ids.shape[1], ids.device
    C, R = int((P - 1).max()), int((S - P + 1).max())
    src_c = (P - 1)[:, None] - C + torch.arange(C, device=dev)[None]  # (B, C)
    src_s = (P - 1)[:, None] + torch.arange(R, device=dev)[None]  # (B, R)
    ctx_ok, suf_ok = src_c >= 0, src_s < S[:, None]
    pad = torch.full((), pad_id, dtype=ids.dtype, device=dev)
    ctx_ids = torch.where(ctx_ok, ids.gather(1, src_c.clamp_min(0)), pad)
    suf_src = src_s.clamp_max(T - 1)
    suf_ids = torch.where(suf_ok, ids.gather(1, suf_src), pad)
    L = layer_mask.shape[-1]
    suffix_mask = layer_mask.gather(1, suf_src[..., None].expand(-1, -1, L)) & suf_ok[..., None]
    targets = torch.arange(R, device=dev)[None] < (S - P)[:, None]
    return {"ctx_ids": ctx_ids, "suf_ids": suf_ids, "attention_mask": torch.cat([ctx_ok, suf_ok], 1).long(),
            "suffix_mask": suffix_mask, "targets": targets}


def _hidden_prompt_no_grad(adapter: Adapter, batch: Batch, layer_mask: torch.Tensor, sparse: bool) -> torch.Tensor:
    """Final hidden states (N, C) at the target positions, prompt (less its last token) under no_grad."""
    parts = _split_batch(batch, layer_mask, pad_id=0)
    C = parts["ctx_ids"].shape[1]
    prefix = None
    if C:
        cache = SkipCache(adapter.num_layers, capacity=C)
        with torch.no_grad():
            skip_forward(adapter, parts["ctx_ids"], parts["attention_mask"][:, :C], cache=cache, return_hidden=True)
        prefix = PrefixKV(cache)
    hidden = skip_forward(adapter, parts["suf_ids"], parts["attention_mask"], layer_mask=parts["suffix_mask"],
                          kv_prefix=prefix, return_hidden=True, sparse=sparse)
    return hidden[parts["targets"]]


def _full_depth_lead(layer_mask: torch.Tensor, P: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(B,) count j_b of the leading response inputs (tokens 0 .. n_b - 2) whose plan runs every
    layer: the decode steps 1 .. j_b that run at full depth, e.g. the first
    ``LinearDecayPolicy.full_depth_steps`` (the budget never rises, so they lead)."""
    B, T, _ = layer_mask.shape
    dev = layer_mask.device
    full = layer_mask.all(-1)  # (B, T)
    R = max(int(n.max()) - 1, 0)
    src = (P[:, None] + torch.arange(R, device=dev)[None]).clamp_max(T - 1)  # (B, R)
    ok = torch.arange(R, device=dev)[None] < (n - 1)[:, None]
    lead = (full.gather(1, src) & ok).long().cumprod(1)  # 1 while every position so far is full depth
    return lead.sum(1)


def _hidden_base_prefill(adapter: Adapter, batch: Batch, layer_mask: torch.Tensor, sparse: bool,
                         base_context: Callable[[], ContextManager]) -> torch.Tensor:
    """Final hidden states (N, C) at the target positions when the base model prefills the prompt.

    The whole prompt (its last token included) runs at full depth under ``torch.no_grad()`` and
    ``base_context()`` (the LoRA adapter switched off), as a decode-only skip adapter is run at
    inference (:func:`skipdecode.load`): its last position gives response token 0. So do the
    leading response tokens 0 .. j_b - 1 whose decode steps run every layer (:func:`_full_depth_lead`,
    e.g. ``LinearDecayPolicy.full_depth_steps``): at inference a decode step that runs every layer
    runs the base weights (:mod:`skipdecode.lowrank`, :func:`skipdecode.generate.generate_step`), so
    they are part of the base model's no-grad prefill here and give tokens 1 .. j_b. Response
    tokens j_b .. n-2 then run with the adapter on, under their plans, against those keys/values,
    and give tokens j_b + 1 .. n-1. Row-major order, as ``batch.target_mask()``."""
    ids, P, S = batch.input_ids, batch.prompt_lens, batch.seq_lens
    T, dev = ids.shape[1], ids.device
    n = S - P  # response lengths (tokens), >= 1
    j = _full_depth_lead(layer_mask, P, n)  # (B,) response tokens in the base prefill
    pre = P + j  # prefill lengths (tokens)
    C, K, R = int(pre.max()), int(j.max()), int((n - 1 - j).max())
    src_c = pre[:, None] - C + torch.arange(C, device=dev)[None]  # (B, C), left-padded prefill
    src_s = pre[:, None] + torch.arange(R, device=dev)[None]  # (B, R), response tokens j .. n-2
    ctx_ok, suf_ok = src_c >= 0, src_s < (S - 1)[:, None]
    pad = torch.zeros((), dtype=ids.dtype, device=dev)
    ctx_ids = torch.where(ctx_ok, ids.gather(1, src_c.clamp_min(0)), pad)
    cache = SkipCache(adapter.num_layers, capacity=C)
    with torch.no_grad(), base_context():
        h_prompt = skip_forward(adapter, ctx_ids, ctx_ok.long(), cache=cache, return_hidden=True)  # (B, C, H)
    # the last j_b + 1 prefill columns predict response tokens 0 .. j_b; left-align them
    cols = torch.arange(K + 1, device=dev)[None]  # (1, K + 1)
    first_src = (C - 1 - j[:, None] + cols).clamp_max(C - 1)  # (B, K + 1)
    first = h_prompt.gather(1, first_src[..., None].expand(-1, -1, h_prompt.shape[-1]))
    first_ok = cols <= j[:, None]
    if R == 0:
        return first[first_ok]
    suf_src = src_s.clamp_max(T - 1)
    suf_ids = torch.where(suf_ok, ids.gather(1, suf_src), pad)
    L = layer_mask.shape[-1]
    suffix_mask = layer_mask.gather(1, suf_src[..., None].expand(-1, -1, L)) & suf_ok[..., None]
    hidden = skip_forward(adapter, suf_ids, torch.cat([ctx_ok, suf_ok], 1).long(), layer_mask=suffix_mask,
                          kv_prefix=PrefixKV(cache), return_hidden=True, sparse=sparse)  # (B, R, H)
    # column c < K + 1 predicts token c (valid when c <= j_b); column K + 1 + r predicts token j_b + 1 + r
    both = torch.cat([first, hidden], 1)  # (B, K + 1 + R, H)
    targets = torch.cat([first_ok, suf_ok], 1)
    return both[targets]


def target_logits(
    adapter: Adapter,
    batch: Batch,
    layer_mask: torch.Tensor | None,
    *,
    sparse: bool = True,
    prompt_grad: bool = True,
    base_context: Callable[[], ContextManager] | None = None,
) -> torch.Tensor:
    """Logits (N, V) at the N positions of ``batch.target_mask()`` (row-major order).

    Args:
        adapter: the model's adapter.
        batch: a right-padded :class:`Batch` on the model's device, (B, T).
        layer_mask: (B, T, L) bool from :func:`build_layer_mask`, or None (full depth).
        sparse: run each layer on the prefix of positions that need it (exact; module docstring).
        prompt_grad: False: the prompt less its last token runs under ``torch.no_grad()`` (same
            values, no gradient through it).
        base_context: a context manager factory that switches the LoRA adapter off (peft's
            ``disable_adapter``): the base model prefills the whole prompt without gradient, the
            adapter runs on the response positions only (``TrainConfig.base_prefill``).
    """
    if base_context is not None:
        if layer_mask is None:
            layer_mask = torch.ones((*batch.input_ids.shape, adapter.num_layers), dtype=torch.bool,
                                    device=batch.input_ids.device) & batch.attention_mask.bool()[..., None]
        hidden = _hidden_base_prefill(adapter, batch, layer_mask, sparse, base_context)
    elif not prompt_grad:
        if layer_mask is None:
            layer_mask = torch.ones((*batch.input_ids.shape, adapter.num_layers), dtype=torch.bool,
                                    device=batch.input_ids.device) & batch.attention_mask.bool()[..., None]
        hidden = _hidden_prompt_no_grad(adapter, batch, layer_mask, sparse)
    else:
        full = skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=layer_mask,
                            return_hidden=True, sparse=sparse)
        hidden = full[batch.target_mask()]
    return adapter.head(hidden[None])[0]


def teacher_forced_logits(
    adapter: Adapter,
    batch: Batch,
    policy: SkipPolicy,
    *,
    targets_only: bool = False,
    sparse: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The training forward: prompt at full depth, response token i's position under
    ``policy.active_layers(i + 1)``, through :func:`skipdecode.forward.skip_forward`.

    Args:
        adapter: the model's adapter.
        batch: a right-padded :class:`Batch` on the model's device.
        policy: the skip policy.
        targets_only: return only the N loss positions (what :func:`train` computes).
        sparse: sparse (default) or masked teacher forcing; both exact, equal values.

    Returns:
        Logits (B, T, V); with ``targets_only`` a pair ``(logits (N, V), labels (N,))`` over the
        positions of ``batch.target_mask()`` in row-major order (position ``P_b - 1 + i`` predicts
        response token i).

    Raises:
        ValueError: as :func:`build_layer_mask`.
    """
    T = batch.input_ids.shape[1]
    layer_mask = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, T, adapter.num_layers,
                                  device=batch.input_ids.device)
    if not targets_only:
        return skip_forward(adapter, batch.input_ids, batch.attention_mask, layer_mask=layer_mask, sparse=sparse)
    return target_logits(adapter, batch, layer_mask, sparse=sparse), batch.labels()[batch.target_mask()]


class SkipLossModule(nn.Module):
    """The loss as an ``nn.Module`` so Accelerate can wrap it (DDP, autocast) unchanged.

    Args:
        model: the trainable model registered as submodule ``model`` (HF model or peft model).
        adapter: the adapter over the HF model whose layers ``model`` trains (for peft: the inner
            ``peft_model.base_model.model``, whose LoRA layers are injected in place).
        sparse: sparse (default) or masked teacher forcing (:func:`target_logits`).
        prompt_grad: gradient through the prompt (default) or not (:func:`target_logits`).
        base_prefill: the base model (``model.disable_adapter()``, a peft model) prefills the
            prompt; the adapter trains on the response positions (:func:`target_logits`).
    """

    def __init__(self, model: nn.Module, adapter: Adapter, *, sparse: bool = True, prompt_grad: bool = True,
                 base_prefill: bool = False) -> None:
        super().__init__()
        self.model = model
        self.adapter = adapter  # not a Module: no duplicate registration
        self.sparse = sparse
        self.prompt_grad = prompt_grad
        self.base_prefill = base_prefill

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        layer_mask: torch.Tensor,
        teacher_logits: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed losses of a batch.

        Args:
            input_ids, attention_mask, prompt_lens, seq_lens: the :class:`Batch` tensors,
                (B, T), (B, T), (B,), (B,).
            layer_mask: (B, T, L) bool from :func:`build_layer_mask`.
            teacher_logits: (N, V) full-depth logits at the N target positions, or None.
            targets: (N,) cross-entropy targets at those positions (None: the next tokens;
                on-policy rows pass the teacher's choices, :func:`on_policy_targets`).
            weights: (N,) per-target weights (:func:`position_weights`), or None (each 1).

        Returns:
            ``(ce_sum, kl_sum)``: scalar float32 sums over the N response tokens (nats) of the
            cross-entropy and of KL(teacher || student) (0 without teacher logits), each token's
            term times its weight when ``weights`` is given.
        """
        batch = Batch(input_ids, attention_mask, prompt_lens, seq_lens)
        base = self.model.disable_adapter if self.base_prefill else None
        logits = target_logits(self.adapter, batch, layer_mask, sparse=self.sparse,
                               prompt_grad=self.prompt_grad or not torch.is_grad_enabled(),
                               base_context=base).float()
        if targets is None:
            targets = batch.labels()[batch.target_mask()]
        if weights is None:
            ce = F.cross_entropy(logits, targets, reduction="sum")
        else:
            ce = (F.cross_entropy(logits, targets, reduction="none") * weights).sum()
        if teacher_logits is None:
            return ce, ce.new_zeros(())
        if weights is None:
            kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits.float(), -1),
                          log_target=True, reduction="sum")
        else:
            kl = (F.kl_div(F.log_softmax(logits, -1), F.log_softmax(teacher_logits.float(), -1),
                           log_target=True, reduction="none").sum(-1) * weights).sum()
        return ce, kl
