"""Sampling: greedy, temperature, top-k, top-p with a seeded generator, and repetition,
frequency and presence penalties.

The logits transforms are Hugging Face's own warpers and its repetition penalty
(``transformers.generation.logits_process``); this module composes them, adds OpenAI's frequency
and presence penalties (which Hugging Face does not have) and draws with a ``torch.Generator`` so
runs are reproducible.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .limits import SEED_MAX, SEED_MIN
from .selection import argmax_last

__all__ = ["SamplingParams", "Sampler", "choice_sampling", "row_sampling", "GREEDY_TEMPERATURE", "PENALTY_RANGE",
           "REPETITION_PENALTY_RANGE"]

#: Temperatures below this decode greedily (argmax), as vLLM (``_SAMPLING_EPS = 1e-5`` in
#: ``vllm/sampling_params.py``) and SGLang do. Below it ``logits / temperature`` leaves float32's
#: range for ordinary logits (1e-38 overflows any logit above 3.4; 5e-324 is 0 in float32), the
#: softmax turns into NaN and nothing could be drawn; at and above it the division stays finite
#: for any logit under 1e33, and the softmax is already all but one-hot.
GREEDY_TEMPERATURE = 1e-5
#: The range of ``frequency_penalty`` and ``presence_penalty`` (OpenAI API reference: -2.0 to 2.0).
PENALTY_RANGE = (-2.0, 2.0)
#: The range of ``repetition_penalty``: > 0 in Hugging Face and vLLM; bounded here so that a penalised
#: logit stays finite in float32 (dividing by 1e-38 overflows, and sampling then fails).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _is_real(value: object) -> bool:
    """A real number that is not a bool: Python's int and float, NumPy's scalars (``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    """An integer that is not a bool: Python's int, NumPy's integer scalars (``numbers.Integral``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: The fields stored as float whatever number type they were given as (``temperature=1`` is 1.0).
_FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token.

    Args:
        temperature: below :data:`GREEDY_TEMPERATURE` (1e-5), 0 included, greedy (argmax), so
            API, CLI and server all decode a degenerate temperature such as 1e-38 greedily; from
            1e-5 on, samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0: no limit).
        top_p: nucleus sampling mass in [0, 1] (1: no limit; 0: a nucleus of the most likely
            token alone, so greedy whatever the temperature, as OpenAI's API allows).
        seed: seed of the sampling generator (None: nondeterministic); same seed, same tokens;
            an integer in [:data:`~skipdecode.limits.SEED_MIN`, :data:`~skipdecode.limits.SEED_MAX`]
            = [-2**63, 2**63 - 1] (int64, OpenAI's ``seed``; the server and the CLI take the same
            range).
        repetition_penalty: in [0.01, 100] (:data:`REPETITION_PENALTY_RANGE`); 1 is off. Hugging Face's ``RepetitionPenaltyLogitsProcessor``
            (CTRL, Keskar et al. 2019): every token already in the prompt or the output has its
            logit divided by it when positive, multiplied when negative (vLLM's
            ``repetition_penalty``).
        frequency_penalty: in [-2, 2]; 0 is off. OpenAI's: each token's logit minus the penalty
            times the number of times it occurs in the output so far (generated tokens only, as
            OpenAI and vLLM).
        presence_penalty: in [-2, 2]; 0 is off. OpenAI's: the penalty is subtracted once from the
            logit of each token that occurs in the output so far.

        The penalties change the logits before greedy choice and before the warpers; a row's
        history is its own prompt (without padding) and its own generated tokens.

    The number fields take ints and NumPy scalars as their floats (``temperature=1`` is stored as
    1.0), ``top_k`` and ``seed`` NumPy integers as ints; booleans are refused.

    Raises:
        ValueError: a field is out of range or not a number (the message names it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            not _is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):  # one range for the API, the CLI and the server (skipdecode.limits)
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64) or None, got {self.seed!r}")
        rp, (lo, hi) = self.repetition_penalty, REPETITION_PENALTY_RANGE
        if not _is_real(rp) or not lo <= rp <= hi:
            raise ValueError(f"repetition_penalty must be a number in [{lo:g}, {hi:g}] (1: off), got {rp!r}")
        low, high = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not low <= v <= high:
                raise ValueError(f"{name} must be a number in [{low:g}, {high:g}] (0: off), got {v!r}")
        for name in _FLOAT_FIELDS:  # a whole or NumPy number counts as its float (HF's warpers refuse ints)
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "top_k", int(self.top_k))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax: ``temperature < GREEDY_TEMPERATURE`` (0 included), or
        ``top_p`` 0 (a nucleus that holds only the most likely token)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_p == 0

    @property
    def penalized(self) -> bool:
        """True when a penalty is on (``repetition_penalty`` != 1 or a frequency or presence
        penalty != 0): the next token then depends on the row's history."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def choice_sampling(sampling: SamplingParams, j: int) -> SamplingParams:
    """The sampling settings of a prompt's ``j``-th choice (``n`` > 1, OpenAI's and vLLM's ``n``):
    its seed is ``seed + j`` (wrapping within int64), so the choices of a seeded request differ
    from each other and choice 0 is the request with ``n`` = 1; without a seed each row draws from
    its own OS-seeded generator. Greedy choices are all the same text, as OpenAI's."""
    if sampling.seed is None or j == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + j - SEED_MIN) % 2**64 + SEED_MIN)


def row_sampling(sampling: SamplingParams | Sequence[SamplingParams] | None, rows: int,
                 unit: str = "rows") -> list[SamplingParams]:
    """Each of ``rows`` rows' :class:`SamplingParams`: ``sampling`` for every row (None: greedy),
    or, given a sequence, its i-th item for row i (each item a :class:`SamplingParams`; None
    items are refused: give ``SamplingParams()`` for a greedy row). ``unit`` names what the rows
    are in messages ("rows", "prompts").

    Raises:
        ValueError: a sequence whose length is not ``rows``, or an item (or ``sampling``) that is
            not a :class:`SamplingParams` (the message names ``sampling``).
    """
    if sampling is None or isinstance(sampling, SamplingParams):
        return [sampling or SamplingParams()] * rows
    if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence):
        raise ValueError(f"sampling must be a SamplingParams, one per row, or None; got {type(sampling).__name__}")
    if len(sampling) != rows:
        raise ValueError(f"sampling holds {len(sampling)} SamplingParams for {rows} {unit}; give one per {unit[:-1]}")
    for i, p in enumerate(sampling):
        if not isinstance(p, SamplingParams):
            hint = " (SamplingParams() for greedy)" if p is None else ""
            raise ValueError(f"sampling[{i}] must be a SamplingParams{hint}, got {type(p).__name__}")
    return list(sampling)


class Sampler:
    """Draws next tokens (B,) from logits (B, V) according to :class:`SamplingParams`.

    Args:
        params: temperature / top-k / top-p / seed; greedy (argmax) when ``params.greedy``
            (temperature below :data:`GREEDY_TEMPERATURE`, or top-p 0).
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

    def __call__(self, logits: torch.Tensor, input_ids: torch.Tensor | None = None, generated: int = 0) -> torch.Tensor:
        """Next token ids (B,) for ``logits`` (B, V). ``input_ids`` (B, K) is each row's history
        (its prompt without padding, then its output), passed to the warpers and read by the
        penalties; its last ``generated`` columns are the output so far (tokens).

        NaN logits never reach sampling (docs/correctness.md pitfall 5).

        Raises:
            RuntimeError: ``logits`` hold a NaN (greedy: in a chosen position, which argmax
                picks whenever a row holds one).
            ValueError: a penalty is on and ``input_ids`` is None.
        """
        if self.params.penalized:
            logits = self.penalize(logits, input_ids, generated)
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

    def penalize(self, logits: torch.Tensor, input_ids: torch.Tensor | None, generated: int) -> torch.Tensor:
        """``logits`` (B, V) with the params' penalties applied (a new tensor, float32).

        Repetition: Hugging Face's ``RepetitionPenaltyLogitsProcessor`` over all of ``input_ids``
        (B, K). Frequency and presence (OpenAI API reference, "Parameter details"): ``logit[j] -=
        c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, ``c[j]`` the count of token j
        in the last ``generated`` columns (the output).

        Raises:
            ValueError: ``input_ids`` is None.
        """
        if input_ids is None:
            raise ValueError("penalties need the row's history (input_ids)")
        p = self.params
        out = logits.float()
        if p.repetition_penalty != 1:
            out = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(input_ids, out.clone())
        if (p.frequency_penalty or p.presence_penalty) and generated > 0:
            output = input_ids[:, input_ids.shape[1] - generated:]
            counts = torch.zeros_like(out).scatter_add_(1, output, torch.ones_like(output, dtype=out.dtype))
            out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)
        return out
