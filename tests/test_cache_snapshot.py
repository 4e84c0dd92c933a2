"""``snapshot_lengths``/``restore_lengths`` on both caches: what a compiled layer call that falls
back to eager after its cache write uses to undo the write (``skipdecode.compiled``)."""

from __future__ import annotations

import torch

from skipdecode.cache import SkipCache, SlotCache


def test_skip_cache_rolls_back_one_layers_write():
    cache = SkipCache(num_layers=3, capacity=4)
    kv = torch.randn(2, 1, 3, 4)
    cache.update(kv, kv, 0)
    cache.update(kv[:, :, :2], kv[:, :, :2], 2)
    snap = cache.snapshot_lengths()
    assert snap == [3, 0, 2]
    cache.update(kv[:, :, :1], kv[:, :, :1], 0)  # the write a failed call made
    assert cache.lengths == [4, 0, 2]
    cache.restore_lengths(snap)
    assert cache.lengths == [3, 0, 2]
    snap.append(99)  # the snapshot is a copy, not the cache's own list
    assert cache.lengths == [3, 0, 2]


def test_slot_view_rolls_back_only_through_the_shared_slot_cache():
    slots = SlotCache(num_layers=2, num_slots=3, capacity=4)
    slots.lengths[:, 0] = 2
    slots.lengths[:, 2] = 1
    view = slots.view(torch.tensor([0, 2]), torch.tensor([2, 1]), key_length=3)
    snap = view.snapshot_lengths()
    kv = torch.randn(2, 1, 1, 4)
    view.update(kv, kv, 1)  # one token per row at layer 1
    assert slots.lengths[1].tolist() == [3, 0, 2]
    view.restore_lengths(snap)
    assert slots.lengths.tolist() == [[2, 0, 1], [2, 0, 1]]
    slots.lengths[0, 1] = 5
    assert snap[0, 1] == 0  # a copy
