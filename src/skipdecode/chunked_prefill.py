"""Chunked prefill for the in-flight engine: a long prompt is prefilled a chunk at a time between
decode steps, so that the rows already decoding keep emitting tokens while it is prefilled.

Without it a joining request's whole prompt runs in one forward inside one engine step, and every
running row waits for it: on 2 CPU cores a 6,700-token prompt of the embedded model takes about
45 s at float32, and every stream that was running stops for those 45 s. With a chunk of C tokens
(:class:`~skipdecode.engine.Engine` ``prefill_chunk_tokens``) a request whose prompt still has more
than C tokens to compute (after any prefix-cache hit) becomes a :class:`PartialPrefill`: it holds
its slot, and each engine step, after the running rows' decode step, runs the next C of its
tokens (vLLM's and SGLang's chunked prefill, which batch the chunk with the decode rows; here the
chunk is its own forward in the same engine step). Its last chunk gives the logits of generated
token 0, its K/V go to its slot, and it joins the running rows as any joiner does.

Why it is exact. The prompt runs at full depth either way (docs/method.md: the prefill runs every
layer). Under causal attention the K/V of positions 0..n-1 depend only on those tokens, so a chunk
that runs positions n..n+C-1 on top of the K/V of the first n (kept in the partial's own
:class:`~skipdecode.cache.SkipCache`, which grows by each chunk in place) computes the same values
as one forward over the whole prompt, up to float rounding (the products run on other shapes):
the same reasoning as the prefix cache (:mod:`skipdecode.prefix_cache`). Positions come from the
attention mask, all ones over the n + C positions.

Partials are prefilled one at a time, oldest first (first come, first served); each engine step
runs at most one chunk, so a step's prefill work is at most one chunk plus the short prompts
joining at that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters import Adapter
from .cache import SkipCache
from .forward import skip_forward
from .lowrank import base_prefill
from .prefix_cache import PrefixEntry, prefix_skip_cache

__all__ = ["PartialPrefill", "check_prefill_chunk_tokens", "start_partial", "run_chunk",
           "SERVE_PREFILL_CHUNK_TOKENS"]

#: The server's default chunk (tokens; ``skipdecode serve --prefill-chunk-tokens``,
#: :func:`skipdecode.server.create_app`): on 2 CPU cores a float32 chunk of 256 tokens of the
#: embedded model takes about 0.6 s near the start of a prompt and under 2 s at 6,000 tokens of
#: context, the longest a running stream then waits between two tokens. Prompts of up to 256
#: tokens (E2E's are about 100) are never chunked. The engine's own default is 0 (off): a batch
#: job gains nothing from interleaving.
SERVE_PREFILL_CHUNK_TOKENS = 256


def check_prefill_chunk_tokens(value: Any) -> int:
    """``prefill_chunk_tokens`` as an int >= 0 (tokens per chunk; 0: off). Small chunks are
    allowed but each chunk is a forward that reads every weight once, so chunks under about 64
    tokens spend most of their time reading weights.

    Raises:
        ValueError: anything else (a bool, a float, a string, a negative integer); the message
            names ``prefill_chunk_tokens`` and what is allowed.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prefill_chunk_tokens must be an integer >= 0 (tokens per prefill chunk; 0: off), "
                         f"got {value!r}")
    return value


@dataclass(eq=False)
class PartialPrefill:
    """A request whose prompt is being prefilled in chunks.

    Attributes:
        request: the :class:`~skipdecode.engine.Request`.
        slot: the slot it holds and will decode in.
        cache: its own :class:`~skipdecode.cache.SkipCache`, one row, capacity P (the prompt's
            length): every layer holds the K/V of its first ``done`` prompt positions.
        done: prompt tokens whose K/V are held (tokens; starts at the prefix-cache hit).
        cached: leading prompt tokens that came from the prefix cache (tokens).
        seconds: wall-clock time of its chunks so far (s).
        chunks: forwards run so far.
        started: ``time.perf_counter()`` when it left the waiting queue (s).
        twins: ``(request, slot)`` of requests with the same prompt that joined with it (a
            request's ``n`` choices): their slots get a copy of its K/V when it is done.
    """

    request: Any
    slot: int
    cache: SkipCache
    done: int
    cached: int = 0
    seconds: float = 0.0
    chunks: int = 0
    started: float = 0.0
    twins: list = field(default_factory=list)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to prefill (tokens)."""
        return len(self.request.prompt_ids) - self.done


def start_partial(adapter: Adapter, request: Any, slot: int, entry: PrefixEntry | None,
                  started: float = 0.0) -> PartialPrefill:
    """A :class:`PartialPrefill` for ``request`` in ``slot``, starting after ``entry`` (a stored
    prefix of its prompt, :mod:`skipdecode.prefix_cache`; None: from position 0), whose K/V are
    copied into the partial's own cache of capacity P (the prompt's length, tokens); ``started``:
    when it left the waiting queue (``time.perf_counter()``, s)."""
    P = len(request.prompt_ids)
    if entry is None:
        return PartialPrefill(request, slot, SkipCache(adapter.num_layers, capacity=P, prefill=True), 0, started=started)
    return PartialPrefill(request, slot, prefix_skip_cache([entry], capacity=P), entry.length, cached=entry.length,
                          started=started)


def run_chunk(adapter: Adapter, part: PartialPrefill, chunk_tokens: int, device: torch.device) -> torch.Tensor | None:
    """Run the next ``chunk_tokens`` (at most) of ``part``'s prompt at full depth on top of the
    K/V it holds, appending theirs to its cache, and advance ``part.done``. (A last chunk of one
    token runs as a prefill of one token, since ``part.cache`` is a prefill cache: the variant of
    a stored prefix and one token more, which the compile warm-up runs.)

    Returns:
        The (V,) logits of the prompt's last position when this chunk completed the prompt
        (generated token 0 is drawn from them), else None.

    Raises:
        ValueError: nothing is left to prefill (``part.remaining`` is 0), or ``chunk_tokens`` < 1.
    """
    if part.remaining < 1 or chunk_tokens < 1:
        raise ValueError(f"run_chunk needs prompt tokens left and chunk_tokens >= 1, got "
                         f"{part.remaining} left and chunk_tokens={chunk_tokens}")
    end = part.done + min(chunk_tokens, part.remaining)
    ids = torch.as_tensor([list(part.request.prompt_ids[part.done:end])], dtype=torch.long)
    mask = torch.ones((1, end), dtype=torch.long)  # one row, no padding: positions 0..end-1
    with base_prefill(adapter.model):  # a decode-only skip adapter is off in the prefill
        logits = skip_forward(adapter, ids.to(device), mask.to(device), cache=part.cache, logits_last_only=True)
    part.done = end
    part.chunks += 1
    return logits[0, -1] if part.remaining == 0 else None
