"""The in-flight engine's records (:mod:`skipdecode.engine`): a :class:`Request` to complete, the
:class:`Row` a running request becomes, and the :class:`TokenEvent` of each generated token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .logprobs import TokenLogprobs
from .policy import SkipPolicy
from .sampling import Sampler, SamplingParams

__all__ = ["Request", "Row", "TokenEvent", "mean_batch_rows"]


@dataclass(eq=False)
class Request:
    """One prompt to complete.

    Attributes:
        prompt_ids: the prompt's token ids (no padding), at least one.
        max_new_tokens: most generated tokens (tokens), >= 1.
        policy: the row's skip policy (None: full depth).
        sampling: the row's sampling settings (None: greedy); its seed seeds the row's own generator.
        eos_token_ids: generated ids that end the row (emitted, then the row stops).
        stop_fn: ``stop_fn(generated_ids) -> bool`` after each token (e.g. stop strings); True ends
            the row with reason "stop".
        tag: anything the caller wants back on the events (e.g. a request id and row index).
        logprobs: None (default) for none; n >= 0 (at most
            :data:`~skipdecode.logprobs.MAX_LOGPROBS`) to attach to each token's event its
            log-probability and the n most likely alternatives (:mod:`skipdecode.logprobs`).
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    policy: SkipPolicy | None = None
    sampling: SamplingParams | None = None
    eos_token_ids: Sequence[int] = ()
    stop_fn: Callable[[list[int]], bool] | None = None
    tag: Any = None
    logprobs: int | None = None


@dataclass(eq=False)
class Row:
    """A running (or finished) request's state and statistics.

    Attributes:
        request: the :class:`Request`.
        slot: its slot in the :class:`SlotCache`.
        length: tokens held in its slot (prompt + fed generated tokens), its next write position.
        tokens: generated ids so far.
        finished: True once it ended; ``reason`` is then "eos", "stop", "length" or "cancelled".
        layers_run: layers run at each of its decode steps t >= 1.
        prefill_seconds: wall-clock time from leaving the waiting queue (taking a slot) to its
            first token: the prefill it joined with; for a chunked prefill also the decode steps
            between its chunks and the chunks of earlier long prompts it waited behind, s.
        decode_seconds: wall-clock time of the engine steps it took part in, s.
        joined_at: engine step count when it joined (for tests and statistics).
        cached_prompt_tokens: leading prompt tokens whose K/V came from the prefix cache instead
            of its prefill (tokens; :mod:`skipdecode.prefix_cache`); all of them when a request
            with the same prompt joined at the same step and was prefilled for both.
        shared_rows: summed over its decode steps, the rows that step ran (itself included), so
            ``shared_rows / len(layers_run)`` is the mean batch it decoded in (rows).
    """

    request: Request
    slot: int
    length: int
    sampler: Sampler
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    reason: str | None = None
    layers_run: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    joined_at: int = 0
    cached_prompt_tokens: int = 0
    shared_rows: int = 0

    @property
    def step(self) -> int:
        """Index of the last generated token (0: from the prefill)."""
        return len(self.tokens) - 1


def mean_batch_rows(rows: Sequence[Row]) -> float | None:
    """Mean rows per engine step over the decode steps of ``rows`` (rows of every request in the
    engine, counted at each step one of ``rows`` decoded; ``Row.shared_rows``); None when they
    ran no decode step."""
    steps = sum(len(r.layers_run) for r in rows)
    return sum(r.shared_rows for r in rows) / steps if steps else None


@dataclass
class TokenEvent:
    """One generated token of one row.

    Attributes:
        row: the :class:`Row` (its ``request.tag`` identifies the caller's request).
        step: generated-token index (0 = from the prefill).
        token: the id.
        num_layers_run: layers run to produce it (all at step 0).
        finished: the row ended with this token; ``row.reason`` says why.
        logits: (V,) logits it was drawn from, when the engine keeps them (``keep_logits``), else None.
        logprobs: its :class:`~skipdecode.logprobs.TokenLogprobs` when the request asked
            (``Request.logprobs``), else None.
    """

    row: Row
    step: int
    token: int
    num_layers_run: int
    finished: bool
    logits: torch.Tensor | None = None
    logprobs: TokenLogprobs | None = None
