"""Skip-aware, KV-cached, batched generation: ``generate_step`` -> ``stream_generate`` -> ``generate``.

Schedule (docs/method.md "The schedule"): the prefill runs every layer over the (left-padded) prompts
and gives the logits of generated token 0; decode step t = 1, 2, ... feeds token t-1 through
``policy.active_layers(t)`` and gives token t. All rows share t, so the batch runs one plan per
step (rule 1). Finished rows are frozen: they are fed the pad token and emit nothing more.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Sequence

import torch

from .adapters import Adapter
from .cache import SkipCache
from .lowrank import base_prefill
from .forward import skip_forward
from .limits import check_stop
from .logprobs import TokenLogprobs, check_logprobs, requested_logprobs
from .policy import SkipPolicy, check_policy, plan_layers, theoretical_speedup
from .prefix_cache import prefix_cache_budget
from .prompts import Prompt, encode_prompt, prompt_list
from .row_text import RowText  # noqa: F401  (part of this module's API, as before)
from .sampling import Sampler, SamplingParams, choice_sampling, row_sampling
from .step_inputs import check_step_inputs

__all__ = [
    "StepOutput",
    "StreamChunk",
    "GenerationResult",
    "generate_step",
    "sample_rows",
    "encode_prompts",
    "RowText",
    "stream_generate",
    "generate",
]


@dataclass
class StepOutput:
    """One column of the batch's generation.

    Attributes:
        step: index of the generated token (0 = from the prefill).
        tokens: (B,) token ids; rows finished before this step hold the pad id.
        logits: (B, V) logits this step's tokens were drawn from (float, as the model computed).
        active_layers: layers run to produce this column (all layers at step 0).
        emitted: (B,) bool, rows that produced a real token at this step.
        finished: (B,) bool, rows finished after this step.
        seconds: wall-clock time of this step (forward + sampling), seconds.
    """

    step: int
    tokens: torch.Tensor
    logits: torch.Tensor
    active_layers: tuple[int, ...]
    emitted: torch.Tensor
    finished: torch.Tensor
    seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor, input_ids: torch.Tensor,
                starts: Sequence[int] | None = None, generated: int = 0) -> torch.Tensor:
    """Next tokens (B,) for ``logits`` (B, V): one greedy :class:`Sampler` for the whole batch
    (``len(samplers) == 1``), else ``samplers[b]`` (row b's own generator) draws row b from
    ``logits[b]`` with history ``input_ids[b, starts[b]:]`` ((B, K) left-padded; ``starts[b]``
    row b's padding columns, default none), of which the last ``generated`` are its output.

    Raises:
        RuntimeError: NaN logits (see :class:`Sampler`).
    """
    if len(samplers) == 1:
        return samplers[0](logits, input_ids, generated)
    starts = starts or [0] * len(samplers)
    return torch.cat([s(logits[b : b + 1], input_ids[b : b + 1, starts[b]:], generated)
                      for b, s in enumerate(samplers)])


@torch.inference_mode()
def generate_step(
    adapter: Adapter,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    policy: SkipPolicy | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_new_tokens: int = 64,
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    stop_fn: Callable[[int, list[int]], bool] | None = None,
    prefill_context: Callable[[], ContextManager] | None = None,
) -> Iterator[StepOutput]:
    """Generator over token columns for a left-padded batch (the engine's core loop).

    Args:
        adapter: architecture adapter of the model.
        input_ids: (B, P) left-padded prompt ids.
        attention_mask: (B, P) 0/1, 0 on left padding.
        policy: skip policy (None: full depth).
        sampling: :class:`SamplingParams` of every row (None: greedy), or a sequence of B, one
            per row (:func:`~skipdecode.sampling.row_sampling`).
        max_new_tokens: most tokens generated per row (tokens), >= 1.
        eos_token_ids: ids that end a row (the row's EOS is emitted, then the row is frozen).
            Only generated tokens are checked, so a prompt's BOS (== EOS in OPT) never ends it.
        pad_token_id: id fed to and reported for finished rows.
        stop_fn: ``stop_fn(row, generated_ids) -> bool`` called after each emitted token of an
            unfinished row (e.g. stop strings); True freezes the row.
        prefill_context: factory of the context the prefill runs in (None:
            :func:`skipdecode.lowrank.base_prefill`, which switches a merged decode-only adapter
            off); training passes peft's ``disable_adapter`` to generate a decode-only adapter's
            own answers (:mod:`skipdecode.training.on_policy`). Decode steps that run every
            layer run in it too (the base weights, as a full-depth step of a decode-only adapter).

    Yields:
        :class:`StepOutput` per step, until every row is finished or ``max_new_tokens``.

    Raises:
        ValueError: bad shapes, an ``attention_mask`` that is not left-padded (e.g. a tokenizer's
            default right padding), ``max_new_tokens`` < 1, prompts plus ``max_new_tokens`` - 1
            longer than the model's context (``max_position_embeddings``; see
            :meth:`Adapter.check_context`), a ``policy`` that is not None or a policy object
            or is for another layer count (:func:`skipdecode.policy.check_policy`), or a
            ``sampling`` sequence that is not one :class:`SamplingParams` per row.
    """
    check_step_inputs(adapter, input_ids, attention_mask, eos_token_ids)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    B, P = input_ids.shape
    adapter.check_context(P, max_new_tokens)
    policy = check_policy(policy, adapter.num_layers)
    device = input_ids.device
    # one generator per row (each seeded with its seed): a row's samples never depend on its
    # neighbours, so a prompt gives the same text alone, in a batch and in flight (engine.py)
    params = row_sampling(sampling, B)
    keep_history = any(not p.greedy or p.penalized for p in params)  # the warpers and the penalties read it
    samplers = [Sampler(p, device=device) for p in (params if keep_history else params[:1])]
    starts = (P - attention_mask.sum(-1)).tolist()  # left padding per row: not part of its history
    cache = SkipCache(adapter.num_layers, capacity=P + max_new_tokens)
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    mask = attention_mask.long()
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    history: list[list[int]] = [[] for _ in range(B)]
    all_ids = input_ids
    tokens = input_ids
    full = tuple(range(adapter.num_layers))
    base_weights = prefill_context or (lambda: base_prefill(adapter.model))  # the base model's weights

    for step in range(max_new_tokens):
        _sync(device)
        start = time.perf_counter()
        if step == 0:
            active = full
            with base_weights():  # a decode-only skip adapter is off in the prefill
                logits = skip_forward(adapter, input_ids, mask, cache=cache, logits_last_only=True)[:, -1]
        else:
            active = plan_layers(policy, step)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
            # a step that runs every layer runs the base model (a decode-only skip adapter is for skipping)
            with base_weights() if len(active) == adapter.num_layers else nullcontext():
                logits = skip_forward(adapter, tokens, mask, active_layers=active, cache=cache)[:, -1]
        next_tokens = sample_rows(samplers, logits, all_ids, starts, step)
        emitted = ~finished
        next_tokens = torch.where(emitted, next_tokens, torch.full_like(next_tokens, pad_token_id))
        if eos.numel():
            finished = finished | (emitted & torch.isin(next_tokens, eos))
        if stop_fn is not None:
            emitted_rows = emitted.nonzero().flatten().tolist()
            column = next_tokens.tolist()
            stops = []
            for row in emitted_rows:
                history[row].append(column[row])
                if not finished[row] and stop_fn(row, history[row]):
                    stops.append(row)
            if stops:
                finished[stops] = True
        _sync(device)
        seconds = time.perf_counter() - start
        yield StepOutput(step, next_tokens, logits, active, emitted, finished.clone(), seconds)
        if bool(finished.all()):
            return
        tokens = next_tokens[:, None]
        if keep_history:  # only the logits warpers and the penalties read it
            all_ids = torch.cat([all_ids, tokens], dim=1)


@dataclass
class StreamChunk:
    """Text produced by one step of :func:`stream_generate`.

    Attributes:
        step: generated-token index.
        tokens: (B,) token column (pad id for frozen rows).
        deltas: new text per row at this step ("" for rows that emitted nothing visible).
        active_layers: layers run at this step.
        finished: per-row finished flags after this step (an EOS, a stop string, or the row's
            ``max_new_tokens``-th token).
        logprobs: when the run asked (``logprobs``), per row the
            :class:`~skipdecode.logprobs.TokenLogprobs` of this step's token (None for a row
            without one, or whose token is left out of the text: EOS, special tokens); else None.
        finish_reasons: per row, once it has finished, why (``"eos"``, ``"stop"`` or
            ``"length"``, as :attr:`GenerationResult.finish_reasons`); None while it runs (as
            mlx-lm's ``GenerationResponse.finish_reason``).
    """

    step: int
    tokens: torch.Tensor
    deltas: list[str]
    active_layers: tuple[int, ...]
    finished: list[bool]
    logprobs: list | None = None
    finish_reasons: list[str | None] | None = None


@dataclass
class GenerationResult:
    """Output of :func:`generate` for a batch of prompts.

    Each per-row list has one item per row: per prompt, or with ``n`` choices per prompt
    ``len(prompts) * n`` items, row ``k * n + j`` prompt k's j-th choice (:func:`expand_choices`;
    each choice's prompt is counted in ``prompt_tokens``, and in a static batch prefilled, once
    per choice).

    Attributes:
        texts: generated text per prompt (stop strings and EOS removed).
        token_ids: generated ids per prompt (including a final EOS if one ended the row).
        finish_reasons: per prompt, "eos", "stop" (a stop string) or "length".
        prompt_tokens: prompt length per prompt (tokens, without padding).
        new_tokens: generated tokens per prompt.
        prefill_seconds: time of the full-depth prefill and token 0 (time to first token), s.
        decode_seconds: time of decode steps t >= 1, s.
        decode_steps: number of decode steps t >= 1 the batch ran.
        layers_run: layers run at each decode step t >= 1.
        num_layers: L of the model.
        batch_size: B.
        policy: the policy's ``to_dict()``.
        cached_prompt_tokens: per prompt, leading prompt tokens reused from the in-flight
            engine's prefix cache instead of prefilled (tokens; empty: none, e.g. a static batch).
        mean_batch_rows: in-flight runs, the mean number of rows (of every request in the engine)
            that shared this run's decode steps (rows per step; None: a static batch, where it
            is ``batch_size``).
        logprobs: per prompt, a :class:`~skipdecode.logprobs.TokenLogprobs` for each token of its
            text (EOS and special tokens left out) when the run asked for log-probabilities (the server's
            ``logprobs``), else None.
    """

    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    layers_run: list[int]
    num_layers: int
    batch_size: int
    policy: dict = field(default_factory=dict)
    cached_prompt_tokens: list[int] = field(default_factory=list)
    mean_batch_rows: float | None = None
    logprobs: list[list] | None = None

    @classmethod
    def from_record(cls, record: dict, num_layers: int, policy: SkipPolicy) -> "GenerationResult":
        """The result of a finished :func:`stream_generate` run, from the ``record`` dict it
        filled (its ``_record`` argument): what :func:`generate` returns, and what a streaming
        caller (the server's usage statistics) rebuilds after the last chunk.

        Raises:
            KeyError: ``record`` is not that of a finished run.
        """
        return cls(
            texts=record["texts"],
            token_ids=record["token_ids"],
            finish_reasons=record["finish_reasons"],
            prompt_tokens=record["prompt_tokens"],
            new_tokens=[len(ids) for ids in record["token_ids"]],
            prefill_seconds=record["prefill_seconds"],
            decode_seconds=record["decode_seconds"],
            decode_steps=record["decode_steps"],
            layers_run=record["layers_run"],
            num_layers=num_layers,
            batch_size=record["batch_size"],
            policy=policy.to_dict(),
            logprobs=record.get("logprobs"),
        )

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of all rows / (prefill + decode seconds)."""
        total = self.prefill_seconds + self.decode_seconds
        return sum(self.new_tokens) / total if total > 0 else float("nan")

    @property
    def step_seconds(self) -> float:
        """Mean wall-clock time of one decode step (s); the batch's inter-token latency."""
        return self.decode_seconds / self.decode_steps if self.decode_steps else float("nan")

    @property
    def mean_active_layers(self) -> float:
        """Mean layers run per decode step t >= 1 (L when there was none)."""
        return sum(self.layers_run) / len(self.layers_run) if self.layers_run else float(self.num_layers)

    @property
    def theoretical_speedup(self) -> float:
        """L * decode steps / layers run in them (docs/method.md); prefill and token 0 excluded."""
        return theoretical_speedup(self.num_layers, self.layers_run)

    def stats(self) -> dict:
        """JSON-serialisable statistics (counts in tokens, times in seconds)."""
        return {
            "batch_size": self.batch_size,
            "mean_batch_rows": float(self.batch_size) if self.mean_batch_rows is None else self.mean_batch_rows,
            "prompt_tokens": sum(self.prompt_tokens),
            "cached_prompt_tokens": sum(self.cached_prompt_tokens),
            "new_tokens": sum(self.new_tokens),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_steps": self.decode_steps,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "num_layers": self.num_layers,
            "mean_active_layers": self.mean_active_layers,
            "theoretical_speedup": self.theoretical_speedup,
            "policy": self.policy,
        }


def encode_prompts(
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    chat: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``prompts`` into a left-padded batch, each through
    :func:`skipdecode.prompts.encode_prompt` (the one path shared with the server).

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompts: each a non-empty string, a conversation (list of ``{"role", "content"}``
            messages, always rendered with the chat template) or a list of token ids (used as
            given); a single string is one prompt.
        chat: wrap each string prompt as a user turn with the tokenizer's chat template.
        device: device of the returned tensors.

    Returns:
        ``(input_ids, attention_mask)``, both (B, P), left-padded.

    Raises:
        ValueError: no prompts, or a bad prompt (see :func:`~skipdecode.prompts.encode_prompt`;
            the message names it as ``prompts[i]``), or ``chat`` with a tokenizer that has no
            chat template.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    seqs = [encode_prompt(tokenizer, p, chat=chat, where=f"prompts[{i}]") for i, p in enumerate(prompts)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, P - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _eos_ids(tokenizer, model) -> list[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return sorted(ids)


def _step_logprobs(rows: list[RowText], logits: torch.Tensor, column: list[int], emitted: list[bool],
                   top_n: int) -> list[TokenLogprobs | None]:
    """Per row, the :class:`~skipdecode.logprobs.TokenLogprobs` of its token in ``column`` under
    ``logits`` (B, V), for rows that emitted one that shows in the text (:meth:`RowText.in_text`)."""
    wanted = [top_n if emitted[r] and rows[r].in_text(column[r]) else None for r in range(len(rows))]
    got = requested_logprobs(wanted, logits, column)
    return [got.get(r) for r in range(len(rows))]


def check_choices(n: int) -> None:
    """Raise ValueError naming ``n`` unless it is an integer >= 1 (choices per prompt)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1 (choices per prompt), got {n!r}")


def expand_choices(prompts: Sequence[Prompt] | str, sampling: SamplingParams | Sequence[SamplingParams] | None,
                   n: int) -> tuple[list, SamplingParams | Sequence[SamplingParams] | None]:
    """The rows of ``n`` choices per prompt (OpenAI's and vLLM's ``n``, Hugging Face's
    ``num_return_sequences``): row ``k * n + j`` is prompt k's j-th choice, sampled with
    :func:`~skipdecode.sampling.choice_sampling` (seed ``seed + j``), so choice 0 is the ``n`` = 1
    row. ``sampling``: one :class:`SamplingParams` for every prompt or one per prompt
    (:func:`~skipdecode.sampling.row_sampling`). Returns ``(rows' prompts, their sampling)``,
    unchanged when ``n`` is 1.

    Raises:
        ValueError: ``n`` not an integer >= 1 (the message names ``n``); ``prompts`` neither a
            string nor a list (:func:`~skipdecode.prompts.prompt_list`); ``sampling`` as in
            :func:`~skipdecode.sampling.row_sampling`.
    """
    check_choices(n)
    prompts = prompt_list(prompts)
    if n == 1:
        return prompts, sampling
    params = row_sampling(sampling, len(prompts), unit="prompts")
    return [p for p in prompts for _ in range(n)], [choice_sampling(sp, j) for sp in params for j in range(n)]


def stream_generate(
    adapter: Adapter,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    policy: SkipPolicy | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_new_tokens: int = 64,
    stop: Sequence[str] | str = (),
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    logprobs: int | None = None,
    n: int = 1,
    _record: dict | None = None,
) -> Iterator[StreamChunk]:
    """Stream text deltas for a batch of ``prompts`` (one :class:`StreamChunk` per step).

    Args:
        adapter, policy, max_new_tokens: as in :func:`generate_step`.
        sampling: one :class:`SamplingParams` for every prompt (None: greedy) or one per prompt.
        tokenizer: the model's HF tokenizer.
        prompts: the prompts: strings, conversations or token ids (see :func:`encode_prompts`).
        stop: stop strings (one string, or up to 4 non-empty ones: :func:`skipdecode.limits.check_stop`);
            a row stops when its text contains one (the text is cut before it).
        chat: apply the tokenizer's chat template.
        eos_token_ids: override of the EOS ids (default: tokenizer's and generation config's).
        logprobs: None (default), or n in [0, 20]: each chunk's ``logprobs`` holds every row's
            token log-probability and its n most likely alternatives, and the run's
            :class:`GenerationResult` ``logprobs`` those of each row's text (:mod:`skipdecode.logprobs`).
        n: choices per prompt (:func:`expand_choices`): the batch holds ``len(prompts) * n`` rows,
            row ``k * n + j`` prompt k's j-th choice (seed ``seed + j``).

    Raises:
        ValueError: as in :func:`encode_prompts` and :func:`generate_step`; ``stop`` holds more
            than 4 strings, an empty one or a non-string (the message starts with ``stop``);
            ``logprobs`` not None or an integer in [0, 20]; ``n`` as in :func:`expand_choices`.
    """
    stop = check_stop(stop)
    check_logprobs(logprobs)
    prompts, sampling = expand_choices(prompts, sampling, n)
    device = next(adapter.model.parameters()).device
    input_ids, attention_mask = encode_prompts(tokenizer, prompts, chat=chat, device=device)
    if eos_token_ids is None:
        eos_token_ids = _eos_ids(tokenizer, adapter.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_token_ids[0] if eos_token_ids else 0)
    B = input_ids.shape[0]
    rows = [RowText(tokenizer, eos_token_ids, stop) for _ in range(B)]

    def stop_fn(row: int, ids: list[int]) -> bool:
        return rows[row].stopped(ids)

    steps = generate_step(
        adapter,
        input_ids,
        attention_mask,
        policy=policy,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad,
        stop_fn=stop_fn if stop else None,
    )
    record = _record if _record is not None else {}
    record.update(prefill_seconds=0.0, decode_seconds=0.0, layers_run=[], decode_steps=0,
                  logprobs=None if logprobs is None else [[] for _ in range(B)])
    for out in steps:
        if out.step == 0:
            record["prefill_seconds"] = out.seconds
        else:
            record["decode_seconds"] += out.seconds
            record["layers_run"].append(len(out.active_layers))
            record["decode_steps"] += 1
        column = out.tokens.tolist()
        emitted = out.emitted.tolist()
        last = out.step == max_new_tokens - 1  # every row ends here: "length" unless it ended before
        finished_now = [f or last for f in out.finished.tolist()]
        deltas = [""] * B
        for row in range(B):
            if emitted[row]:
                deltas[row] = rows[row].push(column[row], finished_now[row])
        step_logprobs = None if logprobs is None else _step_logprobs(rows, out.logits, column, emitted, logprobs)
        if step_logprobs is not None:
            for row, entry in enumerate(step_logprobs):
                if entry is not None:
                    record["logprobs"][row].append(entry)
        reasons = [r.reason if f else None for r, f in zip(rows, finished_now)]
        yield StreamChunk(out.step, out.tokens, deltas, out.active_layers, finished_now, step_logprobs, reasons)
    record.update(
        texts=[r.text for r in rows],
        token_ids=[r.ids for r in rows],
        finish_reasons=[r.reason for r in rows],
        prompt_tokens=attention_mask.sum(-1).tolist(),
        batch_size=B,
    )


def generate(
    adapter: Adapter,
    tokenizer,
    prompts: Sequence[Prompt] | str,
    *,
    policy: SkipPolicy | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_new_tokens: int = 64,
    stop: Sequence[str] | str = (),
    chat: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    on_chunk: Callable[[StreamChunk], None] | None = None,
    max_batch_size: int | None = None,
    cohort_size: int = 1,
    prefix_cache: bool | int = True,
    logprobs: int | None = None,
    n: int = 1,
) -> GenerationResult:
    """Generate for a batch of prompts and return texts, ids, finish reasons and statistics.

    Arguments as in :func:`stream_generate`; ``on_chunk`` is called with each streamed chunk.
    ``max_batch_size`` (rows) switches from one static batch to in-flight batching
    (:func:`skipdecode.inflight.generate_inflight`): at most that many rows decode at once and a finished row's slot
    goes to the next prompt at once, so a long row no longer holds the others; ``cohort_size``
    (in-flight only) makes waiting prompts join in groups of at least that many and
    ``prefix_cache`` (in-flight only) reuses the K/V of prompt prefixes the prompts share
    (:class:`skipdecode.engine.Engine`). Greedy texts are the same either way; seeded samples too
    (one generator per row). ``logprobs`` n (0-20) fills the result's ``logprobs``: each text
    token's log-probability and its n most likely alternatives (:mod:`skipdecode.logprobs`).
    ``n`` choices per prompt: the result holds ``len(prompts) * n`` rows, row ``k * n + j``
    prompt k's j-th choice (:func:`expand_choices`).

    Raises:
        ValueError: as in :func:`encode_prompts` and :func:`generate_step`; ``max_batch_size`` < 1;
            ``cohort_size`` not an integer >= 1 or a bad ``prefix_cache``
            (:func:`~skipdecode.prefix_cache.prefix_cache_budget`), even without ``max_batch_size``;
            ``stop``, ``logprobs`` and ``n`` as in :func:`stream_generate` and ``policy`` as in
            :func:`generate_step` (all checked before anything runs).
    """
    prompts, sampling = expand_choices(prompts, sampling, n)
    stop = check_stop(stop)
    policy = check_policy(policy, adapter.num_layers)
    check_logprobs(logprobs)
    # the in-flight settings are checked whether or not they apply (max_batch_size), so a bad
    # value fails on one prompt as it does on many
    if isinstance(cohort_size, bool) or not isinstance(cohort_size, int) or cohort_size < 1:
        raise ValueError(f"cohort_size must be an integer >= 1 (rows), got {cohort_size!r}")
    prefix_cache_budget(prefix_cache)
    if max_batch_size is not None:
        from .inflight import generate_inflight

        return generate_inflight(
            adapter, tokenizer, prompts, policy=policy, sampling=sampling, max_new_tokens=max_new_tokens,
            stop=stop, chat=chat, eos_token_ids=eos_token_ids, on_chunk=on_chunk, max_batch_size=max_batch_size,
            cohort_size=cohort_size, prefix_cache=prefix_cache, logprobs=logprobs,
        )
    record: dict = {}
    for chunk in stream_generate(
        adapter,
        tokenizer,
        prompts,
        policy=policy,
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        stop=stop,
        chat=chat,
        eos_token_ids=eos_token_ids,
        logprobs=logprobs,
        _record=record,
    ):
        if on_chunk is not None:
            on_chunk(chunk)
    return GenerationResult.from_record(record, adapter.num_layers, policy)

