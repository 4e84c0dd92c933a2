"""Per-layer KV cache with per-layer lengths (PITFALLS 1, 8).

Under SkipDecode a skipped layer gets no cache entry, so layers hold different numbers of cached
positions: the layers that ran at every step hold all of them, the bottom layers skipped since step
t hold ``prompt + t`` of them. :class:`SkipCache` keeps one preallocated buffer and one length per
layer and implements the ``update(key, value, layer_idx, ...)`` contract that Hugging Face attention
modules call, so the stock layers write into it unchanged. Nothing here reads "layer 0's length".
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SkipCache"]


class SkipCache:
    """Preallocated K/V buffers, one per layer, each with its own length.

    Args:
        num_layers: L (layers).
        capacity: positions to preallocate per layer (tokens); buffers grow (doubling) if a
            write would exceed it.

    Buffers are created lazily on a layer's first write with shape (B, H_kv, capacity, D) and
    the key's dtype and device.

    Raises:
        ValueError: ``num_layers`` < 1 or ``capacity`` < 1.
    """

    def __init__(self, num_layers: int, capacity: int = 256) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.num_layers = num_layers
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = [0] * num_layers

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
        layer: under skipping the layers differ (PITFALLS 1)."""
        return self.lengths[layer_idx]

    def crop(self, num_positions: int) -> None:
        """Roll back to the first ``num_positions`` positions in every layer (PITFALLS 8).

        A layer holding fewer positions (skipped later on) keeps what it has; a layer holding more
        is truncated. ``num_positions`` is in tokens.

        Raises:
            ValueError: ``num_positions`` < 0.
        """
        if num_positions < 0:
            raise ValueError(f"num_positions must be >= 0, got {num_positions}")
        self.lengths = [min(n, num_positions) for n in self.lengths]

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (B',) (long indices into B) in every layer, e.g. to drop finished rows."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, rows)
                self.values[i] = self.values[i].index_select(0, rows)
