"""Decode-speed benchmark: SkipDecode policies vs full depth vs Hugging Face ``generate``.

docs/correctness.md pitfall 13: the theoretical (compute) ratio and the wall-clock ratio are reported side by side,
measured in the same run, for several batch sizes.

What is measured (one :func:`run_benchmark` call):

- for each batch size B, the first B prompts of :data:`DEFAULT_PROMPTS` (cycled if B > 32), as
  one left-padded batch, identical token ids for every engine;
- our engine (:func:`skipdecode.generate.generate`) at full depth and at each target speedup
  (``SkipModel.policy_for(speedup=s, horizon=H)``, H = ``new_tokens`` by default), greedy,
  ``eos_token_ids=[]`` so that every row of every run generates exactly ``new_tokens`` tokens;
- Hugging Face ``model.generate`` on the same model and ids, greedy, ``min_new_tokens =
  max_new_tokens = new_tokens`` (equal length).

How a decode step is timed (the same definition for both engines): the wall-clock interval
between two consecutive generated tokens becoming available. For our engine the timestamp is
taken in the ``on_chunk`` callback of :func:`~skipdecode.generate.generate`, i.e. *after*
sampling and the streaming detokenization of every row (so our figure includes work HF's
``generate`` does not do: it is conservative). For HF it is taken by a logits processor, i.e.
right after each forward (HF calls it once per step, before sampling). Both series hold
``new_tokens`` timestamps; the ``new_tokens - 1`` intervals between the first (after the
full-depth prefill) and the last are the decode steps t = 1 .. new_tokens-1 (each interval is
one complete step: sampling, bookkeeping, one forward). Per run, step time = (last - first) /
(new_tokens - 1); the table reports the median over ``repeats`` runs. The engine's own per-step
clock (forward + sampling, ``GenerationResult.step_seconds``) is reported beside it
(``engine_step_ms``). Time to first token: our engine's step-0 clock; for HF, from the call to
the first logits-processor call. Runs are interleaved (repeat r of every configuration of a batch
size before repeat r+1) so that drift in machine load hits every configuration alike, after
``warmup`` untimed runs of each configuration.

``profile_decode`` breaks a decode step into embedding, positions + attention mask, rotary
inputs, each decoder layer, final norm + LM head, sampling and the rest (Python overhead of the
loop) with ``perf_counter`` around each part (``torch.cuda.synchronize`` first on CUDA), and sets
the weight bytes a step must read against a memory-bandwidth floor.

The library never prints: the CLI (``skipdecode bench``) and ``benchmarks/decode_speed.py`` do.

Where each piece lives (every name below is re-exported here, so ``from skipdecode.bench import
...`` keeps working):

* :mod:`.inputs`: :data:`DEFAULT_PROMPTS`, :data:`DEFAULT_OUTPUT`, :func:`batch_prompts`,
  :func:`parse_int_list`, :func:`parse_float_list`.
* :mod:`.clock`: timing primitives (device sync, the per-part clock and the instrumented loop).
* :mod:`.runner`: :func:`run_benchmark` (our engine and HF ``generate``, interleaved).
* :mod:`.profile`: :func:`profile_decode`, :func:`weight_bytes`, :data:`PROFILE_PARTS`.
* :mod:`.report`: :func:`results_table` (with :func:`schedule_cell`), :func:`profile_table`, :func:`write_results`,
  :func:`write_plot`.
"""

from __future__ import annotations

from .inputs import DEFAULT_OUTPUT, DEFAULT_PROMPTS, batch_prompts, parse_float_list, parse_int_list
from .profile import PROFILE_PARTS, profile_decode, weight_bytes  # noqa: F401  (PROFILE_PARTS: public, not in __all__)
from .report import profile_table, results_table, schedule_cell, write_plot, write_results
from .runner import run_benchmark

__all__ = [
    "DEFAULT_PROMPTS",
    "DEFAULT_OUTPUT",
    "batch_prompts",
    "run_benchmark",
    "profile_decode",
    "weight_bytes",
    "results_table",
    "schedule_cell",
    "profile_table",
    "write_results",
    "write_plot",
    "parse_int_list",
    "parse_float_list",
]
