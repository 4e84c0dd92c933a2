"""CALM-style token-level early exit for decoder-only models: the paper's baseline (batch 1 only).

SkipDecode (arXiv 2307.02628) compares against a decoder-only adaptation of CALM (Schuster et
al., 2022): each token leaves the layer stack at the first layer, after at least ``min_layers``,
whose softmax top-2 margin ``p_1 - p_2`` (computed with the model's *own* tail: final norm,
projections and LM head, i.e. ``adapter.head`` on the intermediate hidden state) reaches
``threshold``. The exit point depends on the token's content, so two rows of a batch would want
different depths: this is exactly what SkipDecode's step-wise, content-free plan removes, and why
this baseline refuses batches larger than one.

**Skipped layers and the KV cache (CALM's state propagation).** A later token that runs deeper
than an earlier one needs the earlier token's keys and values at those upper layers. As in CALM,
they are computed from the *exit* hidden state: every layer above the exit point is run on the
exit state with the cache, so that its attention writes K/V, and its output is discarded. The
stock layers are driven through :meth:`Adapter.run_layer` (never copied, docs/correctness.md pitfall 2), so the
propagation runs each upper layer in full; a real CALM kernel would compute only the K/V
projections. Two counts are therefore reported per decode step:

* ``layers_run`` (== ``exit_layers``): layers used to compute the token (what CALM "saves" on);
* ``compute_layers``: layers actually executed, including the propagation (always L here), and
  ``head_evals``: confidence heads evaluated (each costs a vocabulary projection).

The prefill runs every layer over the prompt and gives generated token 0 (as in SkipDecode's
generation, docs/method.md), decoding is greedy and KV-cached with a :class:`SkipCache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .cache import SkipCache
from .lowrank import base_prefill
from .forward import positions_from_mask, skip_forward, step_masks
from .generate import GenerationResult, _eos_ids, encode_prompts
from .limits import check_stop
from .row_text import RowText

__all__ = ["CalmConfig", "CalmResult", "calm_generate", "calm_generate_ids"]

_BATCH_ONE = (
    "CALM-style token-level early exit supports batch size 1 only, got batch size {B}: each token "
    "exits at its own, content-dependent layer, so rows of a batch disagree on how many layers to "
    "run and a batch could only stop at its slowest row (and the KV cache of skipped layers must "
    "be filled per row). Removing this limit is the point of SkipDecode; evaluate CALM one prompt "
    "at a time."
)


@dataclass(frozen=True)
class CalmConfig:
    """Exit rule of the CALM baseline.

    Args:
        threshold: minimum softmax top-2 margin ``p_1 - p_2`` (a difference of probabilities,
            so in [0, 1]) at which a token exits. ``0`` exits every token at ``min_layers``; ``1``
            disables early exit (float32 softmax can saturate to a margin of exactly 1.0, so 1.0
            is defined as "never" to make it the full-depth baseline). A value above 1 could
            never be reached by a margin and is refused, as a mistyped percentage would be.
        min_layers: fewest layers a token runs before it may exit (layers), in [1, L].

    Raises:
        ValueError: ``threshold`` not a number in [0, 1], or ``min_layers`` not an integer >= 1
            (the message starts with the field).
    """

    threshold: float
    min_layers: int = 1

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:  # NaN fails too
            raise ValueError(f"threshold must be a number in [0, 1] (a top-2 softmax margin; 1 = never exit), "
                             f"got {t!r}")
        m = self.min_layers
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"min_layers must be an integer >= 1, got {m!r}")

    @property
    def exits_early(self) -> bool:
        """False when ``threshold == 1`` (full depth for every token)."""
        return self.threshold < 1

    def to_dict(self) -> dict[str, Any]:
        """``{"type": "calm", "threshold": ..., "min_layers": ...}`` (JSON-serialisable)."""
        return {"type": "calm", "threshold": float(self.threshold), "min_layers": self.min_layers}


@dataclass
class CalmResult(GenerationResult):
    """:class:`GenerationResult` of the CALM baseline plus its exit statistics.

    ``layers_run`` holds, per decode step t >= 1, the layers used to compute the token (its exit
    layer count), so ``theoretical_speedup`` is CALM's claimed compute ratio.

    Attributes:
        exit_layers: per decode step, layers run before the token exited (== ``layers_run``).
        compute_layers: per decode step, layers executed including the KV propagation (layers).
        head_evals: per decode step, intermediate confidence heads evaluated.
    """

    exit_layers: list[int] = field(default_factory=list)
    compute_layers: list[int] = field(default_factory=list)
    head_evals: list[int] = field(default_factory=list)

    @property
    def compute_speedup(self) -> float:
        """L * decode steps / layers executed including propagation (1.0 with no decode step)."""
        total = sum(self.compute_layers)
        return self.num_layers * len(self.compute_layers) / total if total else 1.0

    def stats(self) -> dict:
        """:meth:`GenerationResult.stats` plus ``compute_layers``, ``head_evals``, ``compute_speedup``."""
        s = super().stats()
        s.update(
            compute_layers=sum(self.compute_layers),
            head_evals=sum(self.head_evals),
            compute_speedup=self.compute_speedup,
        )
        return s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _top2_margin(logits: torch.Tensor) -> float:
    """``p_1 - p_2`` of softmax(``logits``) for logits (1, V), in float32."""
    top2 = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    return float(top2[0, 0] - top2[0, 1])


@torch.inference_mode()
def calm_generate_ids(
    adapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: CalmConfig,
    *,
    max_new_tokens: int = 64,
    eos_token_ids: Sequence[int] = (),
    stop_fn=None,
    cache: SkipCache | None = None,
) -> dict[str, Any]:
    """Greedy CALM-style early-exit decoding of one prompt (the token-level loop).

    A decode-only skip adapter (the embedded model's; :func:`skipdecode.lowrank.base_prefill`) is
    off for the whole generation: it was trained to skip lower layers, so CALM runs the base model,
    and threshold 1 gives the full-depth answer.

    Args:
        adapter: architecture adapter of the model (``skipdecode.adapters``).
        input_ids: (1, P) prompt ids.
        attention_mask: (1, P) 0/1 mask.
        config: :class:`CalmConfig`; ``min_layers`` must be <= L.
        max_new_tokens: most generated tokens (tokens), >= 1.
        eos_token_ids: ids that end generation (emitted, then the loop stops).
        stop_fn: ``stop_fn(generated_ids) -> bool`` after each token; True ends generation.
        cache: an empty :class:`SkipCache` to fill (for inspection); None: a new one.

    Returns:
        dict with ``token_ids`` (list[int]), ``finish_reason`` ("eos", "stop", "length"),
        ``prefill_seconds``, ``decode_seconds`` (s), ``exit_layers``, ``compute_layers``,
        ``head_evals`` (per decode step t >= 1).

    Raises:
        ValueError: batch size other than 1 (explains why), bad shapes, ``max_new_tokens`` < 1,
            ``min_layers`` > L, or a prompt plus ``max_new_tokens`` beyond the model's context.
    """
    P = _check_calm_inputs(adapter, input_ids, attention_mask, config, max_new_tokens)
    if cache is None:
        cache = SkipCache(adapter.num_layers, capacity=P + max_new_tokens)
    elif any(cache.lengths):
        raise ValueError("cache must be empty")
    # A decode-only skip adapter (lowrank.base_prefill) was trained to skip lower layers, not to
    # exit early: CALM runs the base model throughout, as generate_step's full-depth steps do, so
    # that threshold 1 is the full-depth baseline.
    with base_prefill(adapter.model):
        return _calm_loop(adapter, input_ids, attention_mask.long(), config, cache, max_new_tokens,
                          set(int(i) for i in eos_token_ids), stop_fn)


def _calm_loop(adapter, input_ids: torch.Tensor, mask: torch.Tensor, config: CalmConfig, cache: SkipCache,
               max_new_tokens: int, eos: set[int], stop_fn) -> dict[str, Any]:
    """:func:`calm_generate_ids`' token loop over checked inputs: ``input_ids`` and ``mask`` (1, P),
    an empty ``cache``; returns its dict."""
    L = adapter.num_layers
    device = input_ids.device
    ids: list[int] = []
    exit_layers: list[int] = []
    compute_layers: list[int] = []
    head_evals: list[int] = []
    prefill_seconds = decode_seconds = 0.0
    reason = "length"
    token = None
    for step in range(max_new_tokens):
        _sync(device)
        start = time.perf_counter()
        if step == 0:  # full-depth prefill, same call as generate_step (docs/correctness.md pitfalls 6, 7)
            logits = skip_forward(adapter, input_ids, mask, cache=cache, logits_last_only=True)[:, -1]
        else:
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype, device=device)], dim=1)
            logits, exit_at, heads = _calm_step(adapter, token, mask, cache, config)
            exit_layers.append(exit_at)
            compute_layers.append(L)
            head_evals.append(heads)
        if torch.isnan(logits).any():
            raise RuntimeError("NaN in logits: refusing to sample")
        next_id = int(logits.argmax(dim=-1)[0])
        ids.append(next_id)
        _sync(device)
        seconds = time.perf_counter() - start
        if step == 0:
            prefill_seconds = seconds
        else:
            decode_seconds += seconds
        if next_id in eos:
            reason = "eos"
            break
        if stop_fn is not None and stop_fn(ids):
            reason = "stop"
            break
        token = torch.tensor([[next_id]], dtype=torch.long, device=device)
    return dict(
        token_ids=ids,
        finish_reason=reason,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
        exit_layers=exit_layers,
        compute_layers=compute_layers,
        head_evals=head_evals,
    )


def _check_calm_inputs(adapter, input_ids: torch.Tensor, attention_mask: torch.Tensor, config: CalmConfig,
                       max_new_tokens: int) -> int:
    """Check :func:`calm_generate_ids`' arguments (its ValueErrors): ``input_ids`` (1, P) and the rest -> P."""
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be (1, P); got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    B, P = input_ids.shape
    if B != 1:
        raise ValueError(_BATCH_ONE.format(B=B))
    if P == 0:
        raise ValueError("the prompt must hold at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    L = adapter.num_layers
    if config.min_layers > L:
        raise ValueError(f"min_layers must be <= the model's {L} layers, got {config.min_layers}")
    adapter.check_context(P, max_new_tokens)
    return P


def _calm_step(adapter, token: torch.Tensor, mask: torch.Tensor, cache: SkipCache,
               config: CalmConfig) -> tuple[torch.Tensor, int, int]:
    """One decode step of ``token`` (1, 1) with ``mask`` (1, K) -> (logits (1, V), exit layers, heads evaluated)."""
    L = adapter.num_layers
    K = mask.shape[1]
    position_ids = positions_from_mask(mask)[:, K - 1 :]  # (1, 1), from the mask (docs/correctness.md pitfall 1)
    hidden = adapter.embed(token, position_ids)  # (1, 1, C)
    masks = step_masks(adapter, mask, 1, hidden.dtype)  # per layer (1, 1, 1, K), or None: no padding
    extra = adapter.layer_inputs(hidden, position_ids)
    exit_at, heads, logits = L, 0, None
    for layer_idx in range(L):
        hidden = adapter.run_layer(layer_idx, hidden, masks[layer_idx], cache, extra)
        used = layer_idx + 1
        if config.exits_early and config.min_layers <= used < L:
            heads += 1
            candidate = adapter.head(hidden)[:, -1]  # (1, V), the model's own tail
            if _top2_margin(candidate) >= config.threshold:
                exit_at, logits = used, candidate
                break
    # CALM state propagation: upper layers get K/V computed from the exit state; their
    # outputs are discarded.
    for layer_idx in range(exit_at, L):
        adapter.run_layer(layer_idx, hidden, masks[layer_idx], cache, extra)
    if logits is None:  # ran every layer: exactly skip_forward's full-depth tail
        logits = adapter.head(hidden[:, -1:])[:, -1]
    return logits, exit_at, heads


def calm_generate(
    model,
    prompts: str | Sequence[str],
    *,
    threshold: float,
    min_layers: int = 1,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    chat: bool | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> CalmResult:
    """Greedy CALM-style early-exit generation for ONE prompt with a :class:`SkipModel`.

    Args:
        model: :class:`skipdecode.model.SkipModel`.
        prompts: one prompt (a string, or a list holding exactly one string).
        threshold, min_layers: see :class:`CalmConfig`.
        max_new_tokens: most generated tokens (tokens), >= 1.
        stop: stop strings; generation ends when the text contains one and the text is cut
            before it (as in :func:`skipdecode.generate.generate`).
        chat: apply the chat template (None: ``model.chat``).
        eos_token_ids: override of the EOS ids (default: tokenizer's and generation config's).

    Returns:
        :class:`CalmResult` (batch size 1): text, ids, finish reason, timings, and per decode
        step ``layers_run``/``exit_layers``, ``compute_layers``, ``head_evals``.

    Raises:
        ValueError: more than one prompt (batch size > 1 is what SkipDecode solves; the message
            explains why CALM cannot batch), invalid ``threshold``/``min_layers``, ``stop`` as in
            :func:`skipdecode.limits.check_stop`, or the errors of
            :func:`skipdecode.generate.encode_prompts`.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if len(prompts) != 1:
        raise ValueError(_BATCH_ONE.format(B=len(prompts)))
    config = CalmConfig(threshold=threshold, min_layers=min_layers)
    stop = check_stop(stop)
    tokenizer = model.tokenizer
    adapter = model.adapter
    device = next(adapter.model.parameters()).device
    use_chat = model.chat if chat is None else chat
    input_ids, attention_mask = encode_prompts(tokenizer, prompts, chat=use_chat, device=device)
    if eos_token_ids is None:
        eos_token_ids = _eos_ids(tokenizer, adapter.model)
    eos = set(eos_token_ids)

    def text_of(ids: list[int]) -> str:
        return tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)

    out = calm_generate_ids(  # the stop check reads the ids incrementally (RowText.stopped)
        adapter, input_ids, attention_mask, config, max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids, stop_fn=RowText(tokenizer, eos_token_ids, stop).stopped if stop else None,
    )
    text = text_of(out["token_ids"])
    if out["finish_reason"] == "stop":
        text = text[: min(text.find(s) for s in stop if s in text)]
    return CalmResult(
        texts=[text],
        token_ids=[out["token_ids"]],
        finish_reasons=[out["finish_reason"]],
        prompt_tokens=attention_mask.sum(-1).tolist(),
        new_tokens=[len(out["token_ids"])],
        prefill_seconds=out["prefill_seconds"],
        decode_seconds=out["decode_seconds"],
        decode_steps=len(out["exit_layers"]),
        layers_run=list(out["exit_layers"]),
        num_layers=adapter.num_layers,
        batch_size=1,
        policy=config.to_dict(),
        exit_layers=out["exit_layers"],
        compute_layers=out["compute_layers"],
        head_evals=out["head_evals"],
    )
