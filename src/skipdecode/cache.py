"""Per-layer KV cache with per-layer lengths (docs/correctness.md pitfalls 1, 8).

Under SkipDecode a skipped layer gets no cache entry, so layers hold different numbers of cached
positions: the layers that ran at every step hold all of them, the bottom layers skipped since step
t hold ``prompt + t`` of them. :class:`SkipCache` keeps one preallocated buffer and one length per
layer and implements the ``update(key, value, layer_idx, ...)`` contract that Hugging Face attention
modules call, so the stock layers write into it unchanged. Nothing here reads "layer 0's length".

For in-flight batching (rows at different steps, each with its own plan) :class:`SlotCache` keeps
one slot per running request and one length per (layer, slot); a :class:`SlotView` is one decode
step's window on it (docs/method.md "Rows at different steps in one forward").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SkipCache", "SlotCache", "SlotView", "DecodeWrite"]


@dataclass
class DecodeWrite:
    """One layer's cache write in a decode step, as the compiled layer call makes it inside its
    graph (:mod:`skipdecode.compiled`), with the bookkeeping left to the cache.

    Attributes:
        keys: the layer's key buffer, (B or R, H_kv, capacity, D); R the slot buffers' rows (:class:`SlotCache`).
        values: its value buffer, same shape.
        key_length: K, keys returned per row after the write (tokens; in a :class:`SlotView`
            ``max(positions) + 1``, each row's attention mask hiding the positions after its own).
        slots: (B,) long buffer row (slot) of each batch row (:class:`SlotView`), or None: batch
            row i is buffer row i (:class:`SkipCache`, or a :class:`SlotView` whose rows are
            slots 0..B-1, ``keys``/``values`` then being the buffers' first B rows).
        positions: (B,) long write position of each row, or None: every row writes at
            position ``K - 1`` (:class:`SkipCache`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_length: int
    slots: torch.Tensor | None = None
    positions: torch.Tensor | None = None


class SkipCache:
    """Preallocated K/V buffers, one per layer, each with its own length.

    Args:
        num_layers: L (layers).
        capacity: positions to preallocate per layer (tokens); buffers grow (doubling) if a
            write would exceed it.
        prefill: True for a prompt's cache (the in-flight engine's prefill batches, chunked
            prefills, batches after stored prefixes): every call on it writes prompt tokens,
            so a compiled layer call runs one token on it as a prefill, never as a decode step
            (:mod:`skipdecode.compiled`).

    Buffers are created lazily on a layer's first write with shape (B, H_kv, capacity, D) and
    the key's dtype and device.

    Raises:
        ValueError: ``num_layers`` < 1 or ``capacity`` < 1.
    """

    def __init__(self, num_layers: int, capacity: int = 256, prefill: bool = False) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = [0] * num_layers
        self.prefill = prefill

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` (B, H_kv, T, D) to layer ``layer_idx``.

        Returns the layer's keys and values so far, (B, H_kv, length, D) views. This is the call
        Hugging Face attention modules make (``Cache.update``); extra arguments are ignored.
        """
        n_new = key_states.shape[-2]
        start = self.lengths[layer_idx]
        end = start + n_new
        k_buf = self.keys[layer_idx]
        if k_buf is None or end > k_buf.shape[-2] or k_buf.shape[0] != key_states.shape[0]:
            k_buf, v_buf = self._grow(layer_idx, key_states, value_states, max(end, self.capacity))
        else:
            v_buf = self.values[layer_idx]
        k_buf[:, :, start:end] = key_states
        v_buf[:, :, start:end] = value_states
        self.lengths[layer_idx] = end
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def _grow(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        size = need if old_k is None else max(need, 2 * old_k.shape[-2])
        b, h, _, d = key.shape
        k_buf = key.new_zeros((b, h, size, d))
        v_buf = value.new_zeros((b, value.shape[1], size, value.shape[-1]))
        n = self.lengths[layer_idx]
        if old_k is not None and n:
            k_buf[:, :, :n] = old_k[:, :, :n]
            v_buf[:, :, :n] = old_v[:, :, :n]
        self.keys[layer_idx], self.values[layer_idx] = k_buf, v_buf
        return k_buf, v_buf

    def get_seq_length(self, layer_idx: int) -> int:
        """Cached positions of layer ``layer_idx`` (tokens). There is deliberately no default
        layer: under skipping the layers differ (docs/correctness.md pitfall 1)."""
        return self.lengths[layer_idx]

    def crop(self, num_positions: int) -> None:
        """Roll back to the first ``num_positions`` positions in every layer (docs/correctness.md pitfall 8).

        A layer holding fewer positions (skipped later on) keeps what it has; a layer holding more
        is truncated. ``num_positions`` is in tokens.

        Raises:
            ValueError: ``num_positions`` < 0.
        """
        if num_positions < 0:
            raise ValueError(f"num_positions must be >= 0, got {num_positions}")
        self.lengths = [min(n, num_positions) for n in self.lengths]

    def snapshot_lengths(self) -> list[int]:
        """A copy of the per-layer cached lengths (tokens), for :meth:`restore_lengths`: a caller
        that may abandon a layer call after its cache write (a compiled call falling back to
        eager) rolls the lengths back with it."""
        return list(self.lengths)

    def restore_lengths(self, snapshot: list[int]) -> None:
        """Put back lengths taken by :meth:`snapshot_lengths` (positions written since are then
        ignored and overwritten by the next write)."""
        self.lengths[:] = snapshot

    def decode_write(self, layer_idx: int, rows: int, new_tokens: int = 1,
                     like: tuple[torch.Tensor, torch.Tensor] | None = None) -> "DecodeWrite | None":
        """Where a compiled layer call writes its ``new_tokens`` new positions (a decode step: 1;
        a prefill: the prompt's tokens) in layer ``layer_idx`` (:mod:`skipdecode.compiled`): the
        layer's buffers, grown first if full, and the key length after the write (the call
        writes positions ``key_length - new_tokens`` to ``key_length``). A layer without buffers
        gets them from ``like``, a (key, value) pair of (1, H_kv, 1, D) tensors giving their
        geometry, dtype and device. None when the layer has no buffers and no ``like``, or its
        buffers hold another batch size than ``rows`` (the caller then writes through
        :meth:`update`). Call :meth:`commit_decode_write` once the write has run."""
        k_buf = self.keys[layer_idx]
        end = self.lengths[layer_idx] + new_tokens
        if k_buf is None and like is not None:
            k_like, v_like = (t.expand(rows, -1, -1, -1) for t in like)
            # at least 2 positions: a buffer of 1 (a one-token prompt's) would be a compiled
            # variant of its own (dynamo specialises sizes 0 and 1)
            self._grow(layer_idx, k_like, v_like, max(end, self.capacity, 2))
        elif k_buf is None or k_buf.shape[0] != rows:
            return None
        elif end > k_buf.shape[-2]:
            self._grow(layer_idx, k_buf[:, :, :1], self.values[layer_idx][:, :, :1], end)
        return DecodeWrite(self.keys[layer_idx], self.values[layer_idx], end)

    def commit_decode_write(self, layer_idx: int, write: "DecodeWrite") -> None:
        """Record the tokens a :meth:`decode_write` target received: the layer's length becomes
        ``write.key_length``."""
        self.lengths[layer_idx] = write.key_length

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (B',) (long indices into B) in every layer, e.g. to drop finished rows."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, rows)
                self.values[i] = self.values[i].index_select(0, rows)


class SlotCache:
    """K/V buffers for in-flight batching: one cache row ("slot") per running request, and one
    length per (layer, slot) (docs/method.md "Rows at different steps in one forward").

    Each slot holds one request's history from its own position 0 (no padding): a request is
    prefilled at full depth elsewhere and its real positions are copied in with
    :meth:`load_prefill`; then each decode step appends one token per running row to exactly the
    layers its plan runs, through a :class:`SlotView`. A slot is reused once :meth:`free` is called.

    Args:
        num_layers: L (layers).
        num_slots: S, the most rows that can run at once (the scheduler's maximum batch size).
        capacity: positions first allocated per slot (tokens); buffers double when a write needs more.

    Buffers are (R, H_kv, size, D) per layer, R the slots used so far rounded up to a power of
    two (at most S): slots are taken lowest first, so R follows the most requests that ran at
    once, not S. Every slot shares ``size``, the longest history held (a paged cache would
    not): 16 slots next to one 8192-token prompt hold 16 x 8192 positions per layer.

    Attributes:
        lengths: (L, S) long tensor, cached positions of every (layer, slot) (tokens).
        loads: per slot, how many requests :meth:`load_prefill` has put in it (a slot's
            contents are those of its last load while this count is unchanged).

    Raises:
        ValueError: ``num_layers``, ``num_slots`` or ``capacity`` < 1.
    """

    def __init__(self, num_layers: int, num_slots: int, capacity: int = 256) -> None:
        for name, value in (("num_layers", num_layers), ("num_slots", num_slots), ("capacity", capacity)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros((num_layers, num_slots), dtype=torch.long)
        self.loads = [0] * num_slots

    def _ensure(self, layer_idx: int, like_k: torch.Tensor, like_v: torch.Tensor, need: int, rows: int = 1) -> None:
        """Allocate or grow layer ``layer_idx``'s buffers (R, H_kv, size, D) to hold ``need``
        positions of slots ``0 .. rows - 1``: R doubles (from 1, at most S) and size grows to the
        larger of twice itself and the power of two > ``need`` (at least ``capacity``), so that
        a long prompt's first decode steps do not copy the buffers again. Always more positions
        than ``need``: a decode step whose key length equalled the buffers' size was a compiled
        variant of its own (dynamo guards the relation; a 1 s compile mid-serving). New positions
        are zeros: keys a row's mask hides must stay finite."""
        old_k = self.keys[layer_idx]
        have_rows, have_size = (0, 0) if old_k is None else (old_k.shape[0], old_k.shape[2])
        if have_rows >= rows and have_size > need:
            return
        R, size = self.dims_after(rows, need, layer_idx)
        k_buf = like_k.new_zeros((R, like_k.shape[1], size, like_k.shape[-1]))
        v_buf = like_v.new_zeros((R, like_v.shape[1], size, like_v.shape[-1]))
        if old_k is not None:
            k_buf[:have_rows, :, :have_size] = old_k
            v_buf[:have_rows, :, :have_size] = self.values[layer_idx]
        self.keys[layer_idx], self.values[layer_idx] = k_buf, v_buf

    def dims_after(self, rows: int, need: int, layer_idx: int = 0, fresh: bool = False) -> tuple[int, int]:
        """(R, size): the buffer rows and positions layer ``layer_idx``'s buffers have once they
        hold ``need`` positions (tokens) of slots ``0 .. rows - 1``, by :meth:`_ensure`'s rule
        (unchanged when they already do; ``fresh``: as if nothing were allocated yet). The
        engine's memory bound uses it to plan admissions."""
        old_k = None if fresh else self.keys[layer_idx]
        have_rows, have_size = (0, 0) if old_k is None else (old_k.shape[0], old_k.shape[2])
        R = max(have_rows, 1)
        while R < rows:
            R *= 2
        R = min(R, self.num_slots)
        pow2 = 1 << need.bit_length()  # the power of two > need
        if old_k is None:
            size = max(self.capacity, pow2)
        else:
            size = have_size if have_size > need else max(pow2, 2 * have_size)
        return R, size

    def planned_bytes(self, rows: int, need: int, layer_position_bytes: int, fresh: bool = False) -> int:
        """Bytes of every layer's key and value buffers once each holds ``need`` positions of
        slots ``0 .. rows - 1`` (:meth:`dims_after` per layer: layers that decode steps skip keep
        smaller buffers), at ``layer_position_bytes`` a position and row of one layer (keys and
        values); ``fresh``: as if nothing were allocated."""
        total = 0
        for layer_idx in range(self.num_layers):
            R, size = self.dims_after(rows, need, layer_idx, fresh)
            total += R * size * layer_position_bytes
        return total

    def reset(self) -> None:
        """Drop every buffer (the next load allocates small ones again) and mark every slot empty;
        what slots held can no longer be read (``loads`` of every slot moves on)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.lengths.zero_()
        self.loads = [n + 1 for n in self.loads]

    @property
    def allocated_bytes(self) -> int:
        """Bytes held by the key and value buffers of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def load_prefill(self, slot: int, source: SkipCache, row: int, start: int, end: int, prefix: int = 0,
                     prefix_start: int = 0) -> None:
        """Copy batch row ``row`` of a prefilled :class:`SkipCache` (every layer) into ``slot``:
        its columns ``prefix_start : prefix_start + prefix`` (a cached prompt prefix,
        :mod:`skipdecode.prefix_cache`; ``prefix_start`` > 0 when rows with longer prefixes share
        the batch, :func:`~skipdecode.prefix_cache.prefix_skip_cache`) then ``start:end`` (the
        positions it computed), as the slot's positions ``0:prefix + end - start``; the slot's
        lengths become that in every layer. ``start`` skips the row's left padding, which sits
        between the prefix and the computed positions (columns, tokens).

        Raises:
            ValueError: not ``0 <= prefix_start`` and ``prefix_start + prefix <= start <= end``,
                or a layer of ``source`` does not hold ``end`` positions (not a full-depth prefill).
        """
        if not (0 <= prefix_start and 0 <= prefix and prefix_start + prefix <= start <= end):
            raise ValueError(f"load_prefill needs 0 <= prefix_start, prefix_start + prefix <= start <= end, got "
                             f"prefix_start={prefix_start}, prefix={prefix}, start={start}, end={end}")
        n = prefix + end - start
        for layer_idx in range(self.num_layers):
            if source.lengths[layer_idx] < end or source.keys[layer_idx] is None:
                raise ValueError(
                    f"layer {layer_idx} of the prefill cache holds {source.lengths[layer_idx]} positions, "
                    f"need {end}: a joining request must be prefilled at full depth"
                )
            k_src, v_src = source.keys[layer_idx], source.values[layer_idx]
            self._ensure(layer_idx, k_src, v_src, n, slot + 1)
            k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
            k_buf[slot, :, :prefix] = k_src[row, :, prefix_start : prefix_start + prefix]
            v_buf[slot, :, :prefix] = v_src[row, :, prefix_start : prefix_start + prefix]
            k_buf[slot, :, prefix:n] = k_src[row, :, start:end]
            v_buf[slot, :, prefix:n] = v_src[row, :, start:end]
        self.lengths[:, slot] = n
        self.loads[slot] += 1

    def copy_slot(self, src: int, dst: int) -> None:
        """Make ``dst`` hold what ``src`` holds (every layer's K/V and length), as if the same
        prefill had been loaded into it: requests with the same prompt (a request's ``n``
        choices) are prefilled once (:class:`skipdecode.engine.Engine`).

        Raises:
            ValueError: ``src`` holds nothing (never loaded, or freed), or ``src`` == ``dst``.
        """
        n = int(self.lengths[:, src].max())
        if n == 0 or src == dst:
            raise ValueError(f"copy_slot needs a loaded source slot other than the destination, got {src} -> {dst}")
        for layer_idx in range(self.num_layers):
            k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
            self._ensure(layer_idx, k_buf, v_buf, n, max(src, dst) + 1)
            k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
            k_buf[dst, :, :n] = k_buf[src, :, :n]
            v_buf[dst, :, :n] = v_buf[src, :, :n]
        self.lengths[:, dst] = self.lengths[:, src]
        self.loads[dst] += 1

    def read(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of positions ``0:n`` of ``slot`` in every layer: ``(keys, values)``, each a list
        of L tensors (H_kv, n, D). The prompt positions of a slot hold the full-depth prefill in
        every layer; they stay as loaded after :meth:`free` until the next :meth:`load_prefill`
        of that slot (``loads[slot]`` counts those), so a caller may read a finished request's
        prompt until then.

        Raises:
            ValueError: ``n`` < 1, or more positions than the slot's buffers hold.
        """
        size = 0 if self.keys[0] is None else self.keys[0].shape[2]
        if not 1 <= n <= size:
            raise ValueError(f"read needs 1 <= n <= {size} (positions held per slot), got {n}")
        keys = [self.keys[i][slot, :, :n].clone() for i in range(self.num_layers)]
        values = [self.values[i][slot, :, :n].clone() for i in range(self.num_layers)]
        return keys, values

    def free(self, slot: int) -> None:
        """Mark ``slot`` empty (lengths 0 in every layer); its buffers are overwritten by the next user."""
        self.lengths[:, slot] = 0

    def view(self, slots: torch.Tensor, positions: torch.Tensor, key_length: int,
             slot_bound: int | None = None) -> "SlotView":
        """A :class:`SlotView` for one decode step of rows in ``slots`` (B,) writing at
        ``positions`` (B,) (each row's history length, tokens) and returning ``key_length`` keys;
        ``slot_bound``, when the caller knows it, is ``max(slots) + 1`` (else computed once)."""
        return SlotView(self, slots, positions, key_length, slot_bound)


class SlotView:
    """One decode step's window on a :class:`SlotCache`: batch row i is slot ``slots[i]`` and
    writes its one new token at position ``positions[i]``; every layer call returns ``key_length``
    keys per row (the caller's attention mask hides, per row, the positions after its own).

    It implements the ``update(key, value, layer_idx)`` contract of Hugging Face attention
    modules, like :class:`SkipCache`. :meth:`rows` narrows it to the rows that run a layer.

    Args:
        cache: the :class:`SlotCache`.
        slots: (B,) long slot indices (distinct).
        positions: (B,) long write positions (tokens); each < ``key_length``.
        key_length: K, keys returned per row (tokens), ``max(positions) + 1`` for a decode step.
        slot_bound: ``max(slots) + 1`` or a larger slot count, or None (computed when needed).
    """

    def __init__(self, cache: SlotCache, slots: torch.Tensor, positions: torch.Tensor, key_length: int,
                 slot_bound: int | None = None) -> None:
        self.cache = cache
        self.slots = slots.long().cpu()
        self.positions = positions.long().cpu()
        self.key_length = key_length
        self._bound = slot_bound

    @property
    def slot_bound(self) -> int:
        """Slots ``0 .. slot_bound - 1`` include every row's (the buffer rows a write needs)."""
        if self._bound is None:
            self._bound = int(self.slots.max()) + 1 if len(self.slots) else 1
        return self._bound

    @property
    def leading(self) -> bool:
        """Whether the rows are slots 0..B-1 in order: a compiled step then reads the buffers'
        first B rows in place (:meth:`decode_write`; computed there only, not per view)."""
        return bool(torch.equal(self.slots, torch.arange(len(self.slots))))

    def rows(self, rows: torch.Tensor) -> "SlotView":
        """The view restricted to batch rows ``rows`` (B',) (long indices)."""
        rows = rows.cpu()
        return SlotView(self.cache, self.slots[rows], self.positions[rows], self.key_length, self._bound)

    def check(self, layer_idx: int) -> None:
        """Raise RuntimeError unless every row's cached length at ``layer_idx`` equals its position:
        a layer that runs for a row must hold that row's complete history (docs/method.md)."""
        have = self.cache.lengths[layer_idx, self.slots]
        bad = (have != self.positions).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise RuntimeError(
                f"layer {layer_idx} holds {int(have[i])} cached positions for slot {int(self.slots[i])}, "
                f"expected {int(self.positions[i])}: a layer skipped earlier cannot run again (the plan is not monotone)"
            )

    def snapshot_lengths(self) -> torch.Tensor:
        """A copy of the slot cache's (L, S) per-(layer, slot) lengths (tokens), for
        :meth:`restore_lengths` (as :meth:`SkipCache.snapshot_lengths`)."""
        return self.cache.lengths.clone()

    def restore_lengths(self, snapshot: torch.Tensor) -> None:
        """Put back lengths taken by :meth:`snapshot_lengths`."""
        self.cache.lengths.copy_(snapshot)

    def decode_write(self, layer_idx: int, rows: int) -> "DecodeWrite | None":
        """Where a compiled decode step writes row i's new token in layer ``layer_idx``: slot
        ``slots[i]``, position ``positions[i]`` of the layer's (R, H_kv, capacity, D) buffers (R rows: the slots used so far)
        (doubled first if needed), returning ``key_length`` keys per row. Rows that are slots
        0..B-1 in order (:attr:`leading`, the engine's usual layout: free slots are taken lowest
        first) get the buffers' first B rows, ``slots`` None, and the graph reads their keys in
        place; other slot sets get the whole buffers and ``slots``, and the graph gathers their
        keys (a copy of B x K keys and values per layer call, which grows with the context: a
        compiled w8a8 step of 16 rows after 700-token prompts took 58-65 ms gathered and 46-50
        in place on the 2-core test host, stop 55). Two layouts in all, whatever the slots: a view
        starting at another slot would add variants per storage offset. None when the layer has
        no buffers yet (the caller then writes through :meth:`update`). ``rows`` (the batch size)
        is ``len(slots)`` here and not checked. Call :meth:`commit_decode_write` once the write
        has run."""
        cache = self.cache
        if cache.keys[layer_idx] is None:
            return None
        cache._ensure(layer_idx, cache.keys[layer_idx], cache.values[layer_idx], self.key_length, self.slot_bound)
        k_buf, v_buf = cache.keys[layer_idx], cache.values[layer_idx]
        positions = self.positions.to(k_buf.device)
        if self.leading:
            B = len(self.slots)
            return DecodeWrite(k_buf[:B], v_buf[:B], self.key_length, None, positions)
        return DecodeWrite(k_buf, v_buf, self.key_length, self.slots.to(k_buf.device), positions)

    def commit_decode_write(self, layer_idx: int, write: "DecodeWrite") -> None:
        """Record the tokens a :meth:`decode_write` target received (each row's length at
        ``layer_idx`` becomes its position + 1; ``write`` itself is not needed here)."""
        self.cache.lengths[layer_idx, self.slots] = self.positions + 1

    def _slot_index(self, buf: torch.Tensor) -> torch.Tensor | slice:
        first, n = int(self.slots[0]), len(self.slots)
        if bool((self.slots == torch.arange(first, first + n)).all()):
            return slice(first, first + n)  # contiguous slots: a view, no copy
        return self.slots.to(buf.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` (B, H_kv, 1, D) at each row's position in layer
        ``layer_idx``; return that layer's keys and values (B, H_kv, K, D) of the rows' slots.

        Raises:
            ValueError: more than one new token per row (decode steps feed one).
        """
        if key_states.shape[-2] != 1:
            raise ValueError(f"a SlotView step writes one token per row, got {key_states.shape[-2]}")
        cache = self.cache
        cache._ensure(layer_idx, key_states, value_states, self.key_length, self.slot_bound)
        k_buf, v_buf = cache.keys[layer_idx], cache.values[layer_idx]
        slots, pos = self.slots.to(k_buf.device), self.positions.to(k_buf.device)
        k_buf[slots, :, pos] = key_states[:, :, 0]
        v_buf[slots, :, pos] = value_states[:, :, 0]
        cache.lengths[layer_idx, self.slots] = self.positions + 1
        index = self._slot_index(k_buf)
        K = self.key_length
        if isinstance(index, slice):
            return k_buf[index, :, :K], v_buf[index, :, :K]
        return k_buf[:, :, :K].index_select(0, index), v_buf[:, :, :K].index_select(0, index)
