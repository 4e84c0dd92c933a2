"""Prefill planning for the in-flight engine (:class:`skipdecode.engine.Engine`): the left-padded
split of joining prompts into batches that computes the fewest tokens (:func:`length_buckets`), and
the prefixes that several joining prompts share, worth prefilling once first
(:func:`shared_prefixes`)."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["PREFILL_CALL_TOKENS", "length_buckets", "buckets_cost", "shared_prefixes"]


#: the cost of one more prefill forward, in prompt tokens: a forward reads every weight once
#: (about 36 ms for the embedded model's 538 MB at 15 GB/s), about what 24 tokens of compute cost
#: at its 0.21 GFLOP a token and about 130 GFLOP/s (2 CPU cores, float32)
PREFILL_CALL_TOKENS = 32


def length_buckets(lengths: Sequence[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[list[int]]:
    """Split prompts of ``lengths`` (tokens each) into left-padded prefill batches that minimise
    the tokens computed: sum over batches of ``len(batch) * max(batch lengths) + call_tokens``.

    Prompts of similar length share a batch, so short prompts stop paying for the longest one's
    padding (E2E prompts at 64 clients: 27 % of a single batch's tokens are padding); a split
    costs one more forward, ``call_tokens``. Exact by dynamic programming over the lengths sorted
    (a best split of a sorted list is into contiguous runs). Returns lists of indices into
    ``lengths``, each ascending by length; every index once. Raises ValueError on a negative
    length or ``call_tokens``.
    """
    order, best, cut = _best_splits(lengths, call_tokens)
    buckets, j = [], len(order)
    while j > 0:
        buckets.append(order[cut[j]:j])
        j = cut[j]
    return buckets[::-1]


def _best_splits(lengths: Sequence[int], call_tokens: int) -> tuple[list[int], list[float], list[int]]:
    """The dynamic programme of :func:`length_buckets`: the indices sorted by length, ``best[j]``
    (the least cost of the first j of them, tokens) and ``cut[j]`` (where its last batch starts)."""
    if call_tokens < 0 or any(n < 0 for n in lengths):
        raise ValueError(f"lengths and call_tokens must be >= 0, got {list(lengths)}, {call_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j prompts in sorted order
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + call_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    return order, best, cut


def buckets_cost(lengths: Sequence[int], call_tokens: int = PREFILL_CALL_TOKENS) -> float:
    """The cost of :func:`length_buckets`' split of ``lengths`` (tokens computed, padding
    included, plus ``call_tokens`` a forward); 0 for no prompt. Raises ValueError as it does."""
    return _best_splits(lengths, call_tokens)[1][-1]


def shared_prefixes(prefix_cache: Any, prompts: Sequence[Sequence[int]], matched: Sequence[int],
                    call_tokens: int = PREFILL_CALL_TOKENS) -> list[tuple[int, ...]]:
    """Prefixes that joining prompts share and no stored entry covers, worth prefilling once
    before the prompts themselves (SGLang's in-batch prefix caching, done in the same step).

    Without it, prompts that join at the same step compute a prefix they share once each (16
    E2E prompts share 16-48 leading tokens in pairs and fours: a third of their tokens).

    Args:
        prefix_cache: the engine's :class:`~skipdecode.prefix_cache.PrefixCache` (its block
            size and minimum, and its stored entries, via ``wanted`` and ``lookup``).
        prompts: the joining prompts' token ids (each prefilled whole, not in chunks).
        matched: tokens each already takes from a stored entry.
        call_tokens: a forward's cost in tokens (:data:`PREFILL_CALL_TOKENS`).

    Returns:
        The distinct prefixes (token-id tuples), each the longest storable prefix
        (:meth:`~skipdecode.prefix_cache.PrefixCache.wanted`) of at least two prompts and longer
        than what they match now; empty unless prefilling them (from their own stored prefixes)
        and then the prompts after them costs fewer tokens by :func:`buckets_cost` than the
        prompts alone.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prompts):
        n = prefix_cache.wanted(ids, [other for j, other in enumerate(prompts) if j != i])
        if n > matched[i]:
            groups.setdefault(tuple(ids[:n]), []).append(i)
    chosen = {prefix: rows for prefix, rows in groups.items() if len(rows) >= 2}
    if not chosen:
        return []
    start = {i: len(prefix) for prefix, rows in chosen.items() for i in rows}
    before = buckets_cost([len(ids) - m for ids, m in zip(prompts, matched)], call_tokens)
    after = buckets_cost([len(ids) - start.get(i, m) for i, (ids, m) in enumerate(zip(prompts, matched))], call_tokens)
    first = buckets_cost([len(p) - prefix_cache.lookup(p)[1] for p in chosen], call_tokens)
    return list(chosen) if first + after < before else []
