"""Timing primitives of the decode-speed benchmark and profile: device synchronisation, the
per-step interval, and the instrumentation :func:`~skipdecode.bench.profile.profile_decode` wraps
around the engine's loop (a per-part clock, a timed adapter, timed mask/positions helpers and
sampler).

Every timestamp is ``time.perf_counter()`` (seconds), taken after ``torch.cuda.synchronize`` on
CUDA so that queued kernels are counted where they run.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections import defaultdict
from typing import Any, Iterator

import torch

#: the ``skipdecode`` package (this module lives in ``skipdecode.bench``)
_ROOT = __package__.rpartition(".")[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(sk) -> torch.device:
    return next(sk.model.parameters()).device


def _per_step(first: float, last: float, steps: int) -> float:
    return (last - first) / steps if steps else float("nan")



class _Clock:
    """Accumulates perf_counter time per named part for the current decode step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, float] = defaultdict(float)
        self.layers: dict[int, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str, layer: int | None = None) -> Iterator[None]:
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            elapsed = time.perf_counter() - start
            if layer is None:
                self.parts[name] += elapsed
            else:
                self.layers[layer] += elapsed

    def reset(self) -> None:
        self.parts = defaultdict(float)
        self.layers = defaultdict(float)


class _TimedAdapter:
    """Wraps an adapter and times its hooks; everything else is delegated unchanged."""

    def __init__(self, inner, clock: _Clock) -> None:
        self._inner = inner
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def embed(self, input_ids, position_ids):
        with self._clock.part("embedding"):
            return self._inner.embed(input_ids, position_ids)

    def layer_inputs(self, hidden, position_ids):
        with self._clock.part("rotary / layer inputs"):
            return self._inner.layer_inputs(hidden, position_ids)

    def run_layer(self, layer_idx, hidden, attention_mask, cache, extra):
        with self._clock.part("layer", layer=layer_idx):
            return self._inner.run_layer(layer_idx, hidden, attention_mask, cache, extra)

    def head(self, hidden):
        with self._clock.part("final norm + LM head"):
            return self._inner.head(hidden)


@contextlib.contextmanager
def _instrumented(clock: _Clock) -> Iterator[None]:
    """Temporarily time the mask/positions helpers and the sampler used by the engine loop."""
    # ``skipdecode.generate`` the attribute is the function; the module is looked up by name
    fwd = importlib.import_module(f"{_ROOT}.forward")
    gen = importlib.import_module(f"{_ROOT}.generate")

    orig_mask, orig_pos, orig_sampler = fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler

    def timed_mask(*args, **kwargs):
        with clock.part("positions + attention mask"):
            return orig_mask(*args, **kwargs)

    def timed_pos(*args, **kwargs):
        with clock.part("positions + attention mask"):
            return orig_pos(*args, **kwargs)

    class TimedSampler(orig_sampler):  # type: ignore[misc, valid-type]
        def __call__(self, logits, input_ids=None, generated=0):
            with clock.part("sampling"):
                return super().__call__(logits, input_ids, generated)

    fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler = timed_mask, timed_pos, TimedSampler
    try:
        yield
    finally:
        fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler = orig_mask, orig_pos, orig_sampler

