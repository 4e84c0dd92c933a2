"""Sampling: greedy, temperature, top-k, top-p with a seeded generator.

The logits transforms are Hugging Face's own warpers (``transformers.generation.logits_process``);
this module only composes them and draws with a ``torch.Generator`` so runs are reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .limits import SEED_MAX, SEED_MIN
from .selection import argmax_last

__all__ = ["SamplingParams", "Sampler", "GREEDY_TEMPERATURE"]

#: Temperatures below this decode greedily (argmax), as vLLM (``_SAMPLING_EPS = 1e-5`` in
#: ``vllm/sampling_params.py``) and SGLang do. Below it ``logits / temperature`` leaves float32's
#: range for ordinary logits (1e-38 overflows any logit above 3.4; 5e-324 is 0 in float32), the
#: softmax turns into NaN and nothing could be drawn; at and above it the division stays finite
#: for any logit under 1e33, and the softmax is already all but one-hot.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Args:
        temperature: below :data:`GREEDY_TEMPERATURE` (1e-5), 0 included, greedy (argmax), so
            API, CLI and server all decode a degenerate temperature such as 1e-38 greedily; from
            1e-5 on, samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0: no limit).
        top_p: nucleus sampling mass in (0, 1] (1: no limit).
        seed: seed of the sampling generator (None: nondeterministic); same seed, same tokens;
            an integer in [:data:`~skipdecode.limits.SEED_MIN`, :data:`~skipdecode.limits.SEED_MAX`]
            = [-2**63, 2**63 - 1] (int64, OpenAI's ``seed``; the server and the CLI take the same
            range).

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):  # one range for the API, the CLI and the server (skipdecode.limits)
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: ``temperature < GREEDY_TEMPERATURE`` (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE


class Sampler:
    """Draws next tokens (B,) from logits (B, V) according to :class:`SamplingParams`.

    Args:
        params: temperature / top-k / top-p / seed; greedy (argmax) when ``params.greedy``
            (temperature below :data:`GREEDY_TEMPERATURE`).
            Warping uses Hugging Face's ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
            ``TopPLogitsWarper`` in that order, as ``transformers.generate`` does.
        device: device of the ``torch.Generator`` (that of the logits); seeded with
            ``params.seed`` so a seed reproduces a sample, else from OS entropy.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.warpers = LogitsProcessorList()
        if not params.greedy:
            self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next token ids (B,) for ``logits`` (B, V); ``input_ids`` (B, K) is passed to warpers.

        NaN logits never reach sampling (PITFALLS 5).

        Raises:
            RuntimeError: ``logits`` hold a NaN (greedy: in a chosen position, which argmax
                picks whenever a row holds one).
        """
        if self.params.greedy:
            tokens = argmax_last(logits)  # torch.argmax's answer, faster on the CPU (skipdecode.selection)
            # argmax picks a NaN whenever a row holds one, so checking the B chosen logits
            # is as strict as checking all B x V of them, and much cheaper.
            if torch.isnan(logits.gather(-1, tokens[:, None])).any():
                raise RuntimeError("NaN in logits: refusing to sample")
            return tokens
        if torch.isnan(logits).any():
            raise RuntimeError("NaN in logits: refusing to sample")
        scores = self.warpers(input_ids, logits.float())
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
