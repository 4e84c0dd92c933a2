"""Many prompts through the in-flight engine on the caller's thread: :func:`generate_inflight`,
what :func:`skipdecode.generate.generate` runs when given ``max_batch_size``."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .adapters import Adapter
from .engine import Engine, Request, Row, mean_batch_rows
from .generate import GenerationResult, RowText, StreamChunk, _eos_ids, encode_prompts
from .limits import check_stop
from .policy import FullPolicy, SkipPolicy, check_policy, plan_layers
from .sampling import SamplingParams, row_sampling

__all__ = ["generate_inflight"]


def generate_inflight(
    adapter: Adapter,
    tokenizer,
    prompts: Sequence[str],
    *,
    policy: SkipPolicy | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    on_chunk: Callable[[StreamChunk], None] | None = None,
    max_batch_size: int = 32,
    cohort_size: int = 1,
    prefix_cache: bool | int = True,
    logprobs: int | None = None,
    engine: Engine | None = None,
) -> GenerationResult:
    """:func:`generate` with in-flight batching (:class:`~skipdecode.engine.Engine`): each prompt
    is a row with its own decode step; at most ``max_batch_size`` rows decode at once, and waiting
    prompts join in cohorts of at least ``cohort_size`` rows; ``prefix_cache`` as in
    :class:`Engine` (prompts sharing a prefix reuse its K/V; texts unchanged); ``logprobs`` as in
    :func:`skipdecode.generate.stream_generate`; ``sampling`` one :class:`SamplingParams` for every
    prompt or one per prompt. ``engine``: an idle :class:`Engine` of ``adapter`` to run on instead
    of a new one (``max_batch_size``, ``cohort_size`` and ``prefix_cache`` are then its own), so
    that its prefix cache carries over from call to call (a conversation's earlier prompts prefill
    only once, as ``skipdecode chat`` does); the statistics are this call's. A call interrupted
    by an exception may leave it busy: do not reuse it then.

    Statistics: ``prefill_seconds`` and ``decode_seconds`` are the time the engine spent in this
    call's prefills and decode steps; ``layers_run`` holds one entry per row per decode step, and
    ``decode_steps`` counts those row-steps (so ``theoretical_speedup`` = L x row-steps / layers
    run, and ``step_seconds`` is decode time per generated token). ``on_chunk`` gets one
    :class:`StreamChunk` per engine step (``step`` the engine step, ``tokens`` pad for rows without
    a token, ``active_layers`` the layers run in it: the union of its rows' plans, every layer when
    a row was prefilled).

    Raises:
        ValueError: as :func:`encode_prompts`; a prompt plus ``max_new_tokens`` beyond the context
            (before anything runs); ``max_batch_size`` < 1; ``cohort_size`` outside
            [1, ``max_batch_size``]; a bad ``prefix_cache``; an ``engine`` that is busy or of
            another adapter; ``stop`` as in
            :func:`skipdecode.limits.check_stop`; ``policy`` and ``logprobs`` as in :meth:`Engine.check`.
    """
    stop = check_stop(stop)
    policy = check_policy(policy, adapter.num_layers)
    device = next(adapter.model.parameters()).device
    ids, mask = encode_prompts(tokenizer, prompts, chat=chat)
    if eos_token_ids is None:
        eos_token_ids = _eos_ids(tokenizer, adapter.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_token_ids[0] if eos_token_ids else 0)
    texts = [RowText(tokenizer, eos_token_ids, stop) for _ in prompts]
    if engine is None:
        engine = Engine(adapter, max_batch_size, cohort_size=cohort_size, prefix_cache=prefix_cache)
    elif engine.adapter is not adapter or engine.busy:
        raise ValueError("engine must be an idle Engine of this model's adapter (or None for a new one)")
    before = (engine.prefill_seconds, engine.decode_seconds, engine.steps)  # this call's share only
    params = row_sampling(sampling, len(prompts))  # one per row (expand_choices' rows)
    requests = [
        Request(ids[i][mask[i].bool()].tolist(), max_new_tokens, policy, params[i], tuple(eos_token_ids),
                texts[i].stopped if texts[i].stop else None, tag=i, logprobs=logprobs)
        for i in range(len(prompts))
    ]
    for r in requests:
        engine.check(r)
    for r in requests:
        engine.submit(r)
    layers_run: list[int] = []
    finished = [False] * len(prompts)
    cached = [0] * len(prompts)
    done_rows: list[Row] = []
    kept = None if logprobs is None else [[] for _ in prompts]  # per row, its text tokens' log-probabilities
    while engine.busy:
        events = engine.step()
        deltas = [""] * len(prompts)
        step_logprobs = None if logprobs is None else [None] * len(prompts)
        column = torch.full((len(prompts),), pad, dtype=torch.long)
        for ev in events:
            i = ev.row.request.tag
            cached[i] = ev.row.cached_prompt_tokens
            deltas[i] = texts[i].push(ev.token, ev.finished)
            column[i] = ev.token
            finished[i] = ev.finished
            if ev.finished:
                done_rows.append(ev.row)
            if ev.step > 0:
                layers_run.append(ev.num_layers_run)
            if kept is not None and texts[i].in_text(ev.token):
                kept[i].append(ev.logprobs)
                step_logprobs[i] = ev.logprobs
        if on_chunk is not None and events:
            on_chunk(StreamChunk(engine.steps - 1 - before[2], column.to(device), deltas,
                                 _layers_run(events, adapter.num_layers), list(finished), step_logprobs,
                                 [t.reason if f else None for t, f in zip(texts, finished)]))
    return GenerationResult(
        texts=[t.text for t in texts],
        token_ids=[t.ids for t in texts],
        finish_reasons=[t.reason for t in texts],
        prompt_tokens=[len(r.prompt_ids) for r in requests],
        new_tokens=[len(t.ids) for t in texts],
        prefill_seconds=engine.prefill_seconds - before[0],
        decode_seconds=engine.decode_seconds - before[1],
        decode_steps=len(layers_run),
        layers_run=layers_run,
        num_layers=adapter.num_layers,
        batch_size=min(engine.max_batch_size, len(prompts)),
        policy=policy.to_dict(),
        cached_prompt_tokens=cached,
        mean_batch_rows=mean_batch_rows(done_rows),
        logprobs=kept,
    )


def _layers_run(events: Sequence, num_layers: int) -> tuple[int, ...]:
    """The layers (sorted indices) one engine step ran for its :class:`~skipdecode.engine.TokenEvent`
    ``events``: the union of the rows' plans for the tokens they got (a token from a prefill: all
    ``num_layers``), as :class:`StreamChunk` ``active_layers`` gives them in a static batch."""
    ran: set[int] = set()
    for ev in events:
        if ev.step == 0:
            return tuple(range(num_layers))
        ran.update(plan_layers(ev.row.request.policy or FullPolicy(num_layers), ev.step))
    return tuple(sorted(ran))
