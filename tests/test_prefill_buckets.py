"""Prefill batches of similar lengths (engine.length_buckets): the split is the cheapest one, the
engine prefills long and short joiners in separate forwards, and every row's tokens and logits are
still those of its solo run."""

from __future__ import annotations

import random

import pytest
import torch

from skipdecode.engine import PREFILL_CALL_TOKENS, Engine, Request, length_buckets
from test_inflight import POLICIES, adapter_of, prompt, run_inflight, solo


def _cost(lengths, buckets, call_tokens):
    return sum(len(b) * max(lengths[i] for i in b) + call_tokens for b in buckets)


def _partitions(items):
    """Every set partition of ``items`` (a list)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


@pytest.mark.parametrize("seed", range(12))
def test_buckets_are_the_cheapest_split_of_all_partitions(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 7))]
    call = rng.choice([0, 8, 32, 100])
    got = length_buckets(lengths, call)
    assert sorted(i for b in got for i in b) == list(range(len(lengths)))  # every index once
    for b in got:
        assert [lengths[i] for i in b] == sorted(lengths[i] for i in b)
    best = min(_cost(lengths, p, call) for p in _partitions(list(range(len(lengths)))))
    assert _cost(lengths, got, call) == best


def test_bucket_extremes():
    assert length_buckets([5, 80, 6, 79], 10**6) == [[0, 2, 3, 1]]  # a forward dearer than any padding
    assert length_buckets([4, 9, 4, 9], 0) == [[0, 2], [1, 3]]  # free forwards: no padding at all
    assert length_buckets([3, 3, 50, 52]) == [[0, 1], [2, 3]]  # default: 2*3 + 2*52 + 64 < 4*52 + 32
    assert length_buckets([]) == []
    with pytest.raises(ValueError, match="must be >= 0"):
        length_buckets([3, -1])
    with pytest.raises(ValueError, match="must be >= 0"):
        length_buckets([3], -1)


def test_engine_prefills_short_and_long_joiners_apart_with_solo_answers(family, monkeypatch):
    adapter = adapter_of(family)
    lengths = [3, 50, 2, 48]
    reqs = [Request(prompt(n, 40 + i), 6, POLICIES[i % len(POLICIES)]) for i, n in enumerate(lengths)]
    sizes = []
    real = Engine._prefill_group

    def counted(self, group, slots, entry):
        sizes.append(sorted(len(r.prompt_ids) for r in group))
        return real(self, group, slots, entry)

    monkeypatch.setattr(Engine, "_prefill_group", counted)
    _, results = run_inflight(adapter, reqs, [0, 0, 0, 0])
    assert sorted(sizes) == [[2, 3], [48, 50]]  # one forward each, not one padded to 50
    assert 2 * 3 + 2 * 50 + 2 * PREFILL_CALL_TOKENS < 4 * 50 + PREFILL_CALL_TOKENS
    for req, (toks, logits) in zip(reqs, results):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
