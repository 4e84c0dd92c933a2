"""Automatic prefix caching for the in-flight engine: reuse the K/V of prompt prefixes that
requests share (a chat template's system prompt, an instruction before the data).

Why it is exact under SkipDecode. A joining request is prefilled at full depth, so every layer
holds its prompt's complete history (docs/method.md "Why the KV cache is always complete"). With causal
attention the keys and values of the first p prompt positions depend on those p tokens alone, at
every layer; positions come from the attention mask, so a stored prefix is position-exact. A
request whose prompt starts with a stored prefix therefore runs only its other tokens, at full
depth, on top of the stored K/V, and gets the same logits (to float rounding) as a full prefill.

What is stored (no configuration; as vLLM's automatic prefix caching and SGLang's RadixAttention,
whose block and tree ideas this borrows in a simple form). :class:`PrefixCache` remembers the last
``recent`` prompts it was shown. When a prompt shares at least ``min_tokens`` leading tokens with
one of them (or with a prompt joining at the same step), the shared length, rounded *down* to a
multiple of ``block_size`` and at most the prompt's length - 1 (one prompt token must run so that
the prefill gives logits), is a prefix worth keeping, unless a stored entry already covers it.
The engine then stores that prefix's K/V: from the slot of the earlier request when its slot still
holds it (so the 2nd request that shares it already reuses it) or from the new request's own slot
after its prefill. Rounding to blocks keeps near-identical prompts from making one entry each.

Entries are whole prefixes (every layer's K/V of p tokens), used only when the whole entry is a
prefix of the prompt; a prompt takes the longest such entry. The cache is bounded by ``max_tokens``
(the sum of the stored entries' lengths, tokens) and evicts whole entries, least recently used
first.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from .cache import SkipCache

__all__ = ["PrefixEntry", "PrefixCache", "DEFAULT_PREFIX_TOKENS", "prefix_cache_budget", "prefix_skip_cache"]

#: Token budget of ``Engine(prefix_cache=True)`` (tokens of stored prefixes, all entries).
DEFAULT_PREFIX_TOKENS = 4096


def prefix_cache_budget(value: Any, min_tokens: int = 8) -> int:
    """The token budget that an engine's ``prefix_cache`` option means: True ->
    :data:`DEFAULT_PREFIX_TOKENS`, False or 0 -> 0 (off), an integer >= ``min_tokens`` -> itself.

    Raises:
        ValueError: anything else (a negative or too small integer, a float, a string); the
            message names ``prefix_cache`` and what is allowed.
    """
    if value is True:
        return DEFAULT_PREFIX_TOKENS
    if value is False or value is None:
        return 0
    if isinstance(value, int) and (value == 0 or value >= min_tokens):
        return value
    raise ValueError(f"prefix_cache must be True, False or a token budget of 0 (off) or >= {min_tokens} "
                     f"(the smallest entry), got {value!r}")


@dataclass(eq=False)
class PrefixEntry:
    """The full-depth K/V of one prompt prefix.

    Attributes:
        tokens: the prefix's token ids (p of them).
        keys: per layer (L entries), keys (H_kv, p, D) at positions 0..p-1.
        values: per layer, values (H_kv, p, D).
        hits: requests that reused it.
    """

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hits: int = 0

    @property
    def length(self) -> int:
        """p, the prefix's length (tokens)."""
        return len(self.tokens)


def prefix_skip_cache(entries: Sequence[PrefixEntry | None], capacity: int) -> SkipCache:
    """A :class:`SkipCache` for one prefill batch whose rows start from different stored prefixes:
    row i holds ``entries[i]``'s K/V (p_i tokens; None: p_i = 0) right-aligned in the first
    C = max p_i columns, columns ``C - p_i : C`` (the columns before are left padding, zeros),
    in every layer; lengths C, buffers (B, H_kv, ``capacity``, D); a prefill cache
    (``SkipCache.prefill``). Rows that share an entry
    share its values (one read each). The prefill then runs each row's own tokens after column C
    with a mask ``[0]*(C - p_i) + [1]*p_i + [0]*pad + [1]*s_i``: positions come from the mask,
    so a row's own tokens continue from p_i whatever its neighbours hold.

    Raises:
        ValueError: no entry at all (nothing to hold: use a plain prefill), or ``capacity`` < C.
    """
    stored = [e for e in entries if e is not None]
    if not stored:
        raise ValueError("prefix_skip_cache needs at least one stored prefix among the entries")
    C = max(e.length for e in stored)
    if capacity < C:
        raise ValueError(f"prefix_skip_cache needs capacity >= {C} (the longest prefix), got {capacity}")
    cache = SkipCache(len(stored[0].keys), capacity=capacity, prefill=True)
    for layer in range(len(stored[0].keys)):
        k0, v0 = stored[0].keys[layer], stored[0].values[layer]
        k_buf = k0.new_zeros((len(entries), k0.shape[0], capacity, k0.shape[-1]))
        v_buf = v0.new_zeros((len(entries), v0.shape[0], capacity, v0.shape[-1]))
        for i, e in enumerate(entries):
            if e is not None:
                k_buf[i, :, C - e.length : C] = e.keys[layer]
                v_buf[i, :, C - e.length : C] = e.values[layer]
        cache.keys[layer], cache.values[layer], cache.lengths[layer] = k_buf, v_buf, C
    return cache


def _shared_blocks(a: Sequence[int], b: Sequence[int], limit: int, block: int) -> int:
    """Largest multiple c of ``block`` with c <= ``limit`` and ``a[:c] == b[:c]`` (tokens)."""
    c = 0
    while c + block <= limit and a[c : c + block] == b[c : c + block]:
        c += block
    return c


class PrefixCache:
    """Stored prompt prefixes (full-depth K/V, every layer), bounded by a token budget.

    Args:
        max_tokens: most tokens of all stored entries together, >= ``min_tokens``; the least
            recently used entries are evicted to fit a new one.
        min_tokens: shortest prefix worth storing (tokens), >= 1.
        block_size: stored lengths are multiples of it (tokens), >= 1. The default 8 suits short
            shared instructions: the E2E template's instruction is 10 tokens in SmolLM2's
            tokenizer, the chat template's system prompt about 30.
        recent: prompts remembered for finding shared prefixes, >= 1.

    Raises:
        ValueError: an argument out of range (named).
    """

    def __init__(self, max_tokens: int = DEFAULT_PREFIX_TOKENS, *, min_tokens: int = 8, block_size: int = 8,
                 recent: int = 32) -> None:
        for name, value, low in (("min_tokens", min_tokens, 1), ("block_size", block_size, 1),
                                 ("recent", recent, 1), ("max_tokens", max_tokens, min_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.block_size = block_size
        self.entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()  # least recently used first
        self.recent: deque[tuple[tuple[int, ...], Any]] = deque(maxlen=recent)
        self.stored_tokens = 0
        self.hits = 0
        self.cached_prompt_tokens = 0
        self.computed_prompt_tokens = 0
        self.evictions = 0

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int]) -> tuple[PrefixEntry | None, int]:
        """The longest stored entry that is a prefix of ``prompt_ids`` and leaves at least one
        token to run, and its length p (tokens); ``(None, 0)`` when none. A found entry becomes
        the most recently used."""
        entry, p = self._longest(tuple(prompt_ids))
        if entry is not None:
            self.entries.move_to_end(entry.tokens)
        return entry, p

    def _longest(self, ids: tuple[int, ...]) -> tuple[PrefixEntry | None, int]:
        """:meth:`lookup` without touching the entry's recency."""
        top = (len(ids) - 1) // self.block_size * self.block_size
        for p in range(top, self.min_tokens - 1, -self.block_size):
            entry = self.entries.get(ids[:p])
            if entry is not None:
                return entry, p
        return None, 0

    def wanted(self, prompt_ids: Sequence[int], others: Iterable[Sequence[int]]) -> int:
        """The prefix of ``prompt_ids`` worth storing: its longest shared prefix with any of
        ``others`` (token-id sequences), rounded down to ``block_size`` and at most
        ``len(prompt_ids) - 1`` (tokens); 0 when that is below ``min_tokens`` or a stored entry
        already covers it."""
        ids = tuple(prompt_ids)
        limit = len(ids) - 1
        best = 0
        for other in others:
            best = max(best, _shared_blocks(ids, tuple(other), min(limit, len(other)), self.block_size))
        if best < self.min_tokens or best <= self._longest(ids)[1]:
            return 0
        return best

    def best_source(self, prompt_ids: Sequence[int], usable) -> tuple[int, Any]:
        """Among the remembered prompts whose source satisfies ``usable(source)``, the one sharing
        the longest storable prefix with ``prompt_ids``: ``(length, source)`` as :meth:`wanted`
        measures it, ``(0, None)`` when none is worth storing."""
        best, source = 0, None
        for tokens, src in self.recent:
            if usable(src):
                n = self.wanted(prompt_ids, [tokens])
                if n > best:
                    best, source = n, src
        return best, source

    # -- updates -----------------------------------------------------------------------------
    def remember(self, prompt_ids: Sequence[int], source: Any = None) -> None:
        """Add a prompt to the recent ones (the oldest is forgotten past ``recent``); ``source``
        says where its K/V can be read (the engine's slot and load count)."""
        self.recent.append((tuple(prompt_ids), source))

    def store(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> PrefixEntry | None:
        """Store the prefix ``tokens`` (p of them) with its per-layer ``keys``/``values``
        (H_kv, p, D), evicting least recently used entries to stay within ``max_tokens``.
        Returns the entry (the existing one if already stored), or None when p > ``max_tokens``.

        Raises:
            ValueError: a layer's K/V does not hold p positions.
        """
        tokens = tuple(tokens)
        p = len(tokens)
        if any(t.shape[-2] != p for t in (*keys, *values)):
            raise ValueError(f"store: every layer's keys and values must hold {p} positions")
        if tokens in self.entries:
            self.entries.move_to_end(tokens)
            return self.entries[tokens]
        if p > self.max_tokens:
            return None
        while self.stored_tokens + p > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.stored_tokens -= old.length
            self.evictions += 1
        entry = PrefixEntry(tokens, keys, values)
        self.entries[tokens] = entry
        self.stored_tokens += p
        return entry

    def record(self, cached: int, prompt_tokens: int) -> None:
        """Count one prefilled request: ``cached`` of its ``prompt_tokens`` reused (tokens)."""
        self.hits += cached > 0
        self.cached_prompt_tokens += cached
        self.computed_prompt_tokens += prompt_tokens - cached

    def stats(self) -> dict[str, int]:
        """``hits`` (requests that reused a prefix), ``cached_prompt_tokens`` (reused) and
        ``computed_prompt_tokens`` (run) over the cache's life, ``entries``, ``stored_tokens``,
        ``max_tokens``, ``evictions`` (tokens and counts)."""
        return {
            "hits": self.hits,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "entries": len(self.entries),
            "stored_tokens": self.stored_tokens,
            "max_tokens": self.max_tokens,
            "evictions": self.evictions,
        }
