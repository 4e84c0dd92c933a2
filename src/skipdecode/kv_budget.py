"""A bound on the in-flight engine's key/value memory (``Engine(max_cache_bytes=)``,
``serve --kv-cache-gb``).

Why. The engine's :class:`~skipdecode.cache.SlotCache` holds, per layer, buffers of R rows (the
slots used so far, a power of two) by ``size`` positions (the longest history held, a power of
two). A long prompt therefore sizes every row: with the embedded model in float32 (46 KB a
position) 32 rows next to one 8192-token request hold 12 GB, and on a 24 GB machine more rows or
a second process end in an out-of-memory kill that loses every request in flight. Serving
engines bound this memory and queue what does not fit (vLLM's KV-cache block pool).

What. With a bound B (bytes), a waiting request joins only if the buffers, planned for every
running row and every joiner at its longest history (prompt + ``max_new_tokens`` - 1 positions)
by the cache's own growth rule, layer by layer (:meth:`~skipdecode.cache.SlotCache.dims_after`;
layers that decode steps skip keep smaller buffers), take at most B;
otherwise it waits (first come, first served) until rows finish. A request that cannot fit even
alone is refused when submitted (a ValueError naming ``max_new_tokens``: the server's 400). When
nothing runs and the buffers left by earlier requests are larger than the next ones need, they
are dropped and allocated afresh (so a long request does not make later short ones join one at
a time). Not counted: a prefill's temporary cache (one forward's prompts),
a chunked prefill's own cache (:mod:`skipdecode.chunked_prefill`) and the prefix cache's entries
(:mod:`skipdecode.prefix_cache`, bounded by its own token budget).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from .adapters import Adapter
from .cache import SlotCache

__all__ = ["admits", "check_fits_alone", "check_max_cache_bytes", "planned_bytes", "position_bytes",
           "SERVE_KV_CACHE_FRACTION", "serve_default_bytes"]

#: ``skipdecode serve``'s default bound: this share of the machine's physical memory
SERVE_KV_CACHE_FRACTION = 0.4


def check_max_cache_bytes(value: Any) -> int | None:
    """``max_cache_bytes`` as None (no bound) or an int >= 1 (bytes).

    Raises:
        ValueError: anything else (a bool, a float, a string, an integer < 1), naming
            ``max_cache_bytes`` and what is allowed.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_cache_bytes must be None (no bound) or an integer >= 1 (bytes), got {value!r}")
    return value


def position_bytes(adapter: Adapter) -> int:
    """Bytes one cached position takes over every layer: L x 2 (keys and values) x H_kv x D x
    the element size of the model's floating-point weights (the activations' dtype; quantized
    models keep a float embedding). 46,080 for SmolLM2-135M in float32 (30 x 2 x 3 x 64 x 4)."""
    kv_heads, head_dim = adapter.kv_shape
    dtype = next((p.dtype for p in adapter.model.parameters() if p.is_floating_point()), torch.float32)
    return adapter.num_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def serve_default_bytes(fraction: float = SERVE_KV_CACHE_FRACTION) -> int | None:
    """``fraction`` of the physical memory (bytes, from ``os.sysconf``), or None where unknown."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_alone(cache: SlotCache, per_position: int, bound: int | None, prompt_tokens: int,
                     max_new_tokens: int) -> None:
    """Refuse a request that could not run even alone under ``bound`` (bytes; None: no bound):
    one row of ``prompt_tokens + max_new_tokens - 1`` positions in freshly allocated buffers
    (``per_position`` bytes a position over every layer, :func:`position_bytes`).

    Raises:
        ValueError: it does not fit; the message names ``max_new_tokens`` and the bound.
    """
    if bound is None:
        return
    need = prompt_tokens + max_new_tokens - 1
    planned = cache.planned_bytes(1, need, per_position // cache.num_layers, fresh=True)
    if planned > bound:
        size = cache.dims_after(1, need, fresh=True)[1]
        raise ValueError(
            f"prompt length {prompt_tokens} + max_new_tokens {max_new_tokens} need {planned / 2**20:.0f} MiB "
            f"of key/value cache ({size} positions), more than the engine's max_cache_bytes of "
            f"{bound / 2**20:.0f} MiB; lower max_new_tokens or shorten the prompt")


def planned_bytes(cache: SlotCache, per_position: int, held: Sequence[tuple[Any, int]],
                  free_slots: Sequence[int] = (), joiners: Sequence[Any] = (), fresh: bool = False) -> int:
    """Bytes ``cache``'s buffers would take (:meth:`~skipdecode.cache.SlotCache.planned_bytes`)
    for the ``held`` ``(request, slot)`` pairs (running rows and chunked prefills) and
    ``joiners`` (requests taking the lowest ``free_slots``), each at its longest history
    (prompt + ``max_new_tokens`` - 1 positions), at ``per_position`` bytes a position over every
    layer; 0 when there are none. ``fresh``: as if nothing were allocated."""
    taken = sorted(free_slots)[: len(joiners)]
    slots = [slot for _, slot in held] + taken
    if not slots:
        return 0
    need = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in [r for r, _ in held] + list(joiners))
    return cache.planned_bytes(max(slots) + 1, need, per_position // cache.num_layers, fresh)


def admits(cache: SlotCache, per_position: int, bound: int, held: Sequence[tuple[Any, int]],
           free_slots: Sequence[int], joiners: Sequence[Any]) -> bool:
    """Whether ``joiners`` may join the ``held`` rows under ``bound`` (bytes): the buffers planned
    for all of them (:func:`planned_bytes`) take at most ``bound``. With nothing held, buffers
    that earlier requests left larger than the joiners need are dropped first
    (:meth:`~skipdecode.cache.SlotCache.reset`), so that a long request does not make the
    requests after it join one at a time."""
    plan = planned_bytes(cache, per_position, held, free_slots, joiners)
    if not held and plan > planned_bytes(cache, per_position, held, free_slots, joiners, fresh=True):
        cache.reset()
        plan = planned_bytes(cache, per_position, held, free_slots, joiners)
    return plan <= bound
