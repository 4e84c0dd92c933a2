"""What a run trains on: the examples, the validation split, distillation answers, the horizon.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..adapters import Adapter
from ..data import DataError, Example, median_response_tokens
from ..generate import generate
from ..policy import FullPolicy
from .batching import TokenizedExample, _as_examples, _encode_prompt_ids, _fit, _split_val, tokenize_examples
from .config import TrainConfig

__all__ = ["RunData", "load_run_data"]


@dataclass
class RunData:
    """The examples of a run before tokenisation.

    Attributes:
        train_raw, val_raw: training / validation :class:`Example` lists (distillation: one
            example per distinct prompt, empty responses).
        info: where the data came from (spec, path, sha256, skipped rows).
        prompt_ids: prompt text -> token ids as inference encodes it.
        n_examples: examples read. n_dropped, n_val_dropped: examples whose prompt alone fills
            ``max_length`` (dropped before planning the data order).
        answers: distillation targets, prompt -> token ids (filled by the run).
    """

    train_raw: list[Example]
    val_raw: list[Example]
    info: dict[str, Any]
    prompt_ids: dict[str, list[int]]
    n_examples: int
    n_dropped: int
    n_val_dropped: int
    answers: dict[str, list[int]] = field(default_factory=dict)


def load_run_data(data: Any, val_data: Any, config: TrainConfig, tokenizer: Any, chat: bool) -> RunData:
    """Read ``data`` (and ``val_data``), split off validation, drop prompts that fill ``max_length``.

    Raises:
        skipdecode.data.DataError: unreadable data, empty responses without ``distill``, nothing
            left to train on, or no example fits ``max_length``.
        TrainConfigError: ``val_fraction`` needs more distinct prompts than the data has.
    """
    examples, info = _as_examples(data, config, "data")
    if val_data is not None:
        val_examples, val_info = _as_examples(val_data, config, "val_data")
        train_raw = examples
        info["val_spec"] = val_info.get("spec")
    else:
        train_idx, val_idx = _split_val(examples, config.val_fraction, config.max_val_examples, config.seed)
        train_raw = [examples[i] for i in train_idx]
        val_examples = [examples[i] for i in val_idx]
    if config.distill:  # no labels: one example per distinct prompt
        train_raw = [Example(p, "") for p in dict.fromkeys(e.prompt for e in train_raw)]
        val_examples = [Example(p, "") for p in dict.fromkeys(e.prompt for e in val_examples)]
    elif any(not e.response for e in train_raw):
        raise DataError("an example has an empty response; give responses or use distill")
    if not train_raw:
        raise DataError("no training examples left after the validation split")
    # Drop examples whose prompt alone fills max_length (no response token would fit) *before*
    # planning the data order, so every planned micro-batch holds trainable examples.
    prompt_ids = _encode_prompt_ids(tokenizer, [e.prompt for e in train_raw + val_examples], chat=chat)
    n_before, n_val_before = len(train_raw), len(val_examples)
    train_raw = [e for e in train_raw if len(prompt_ids[e.prompt]) < config.max_length]
    val_examples = [e for e in val_examples if len(prompt_ids[e.prompt]) < config.max_length]
    if not train_raw:
        raise DataError(f"no training example fits max_length={config.max_length} tokens (the prompts are longer)")
    return RunData(train_raw, val_examples, info, prompt_ids, len(examples), n_before - len(train_raw),
                   n_val_before - len(val_examples))


def tokenize_run(rd: RunData, raw: Sequence[Example], config: TrainConfig, tokenizer: Any,
                 chat: bool) -> list[TokenizedExample | None]:
    """Token ids of ``raw`` (gold responses, or the distillation answers; None where nothing fits
    or a prompt has no teacher answer because it is never drawn)."""
    if not config.distill:
        return tokenize_examples(tokenizer, list(raw), chat=chat, max_length=config.max_length,
                                 response_separator=config.response_separator)[0]
    return [_fit(rd.prompt_ids[e.prompt], rd.answers[e.prompt], config.max_length) if e.prompt in rd.answers
            else None for e in raw]


def choose_horizon(rd: RunData, config: TrainConfig, tokenizer: Any) -> int:
    """The schedule's horizon T (tokens): the configured one, or the median response length of the
    training data (with ``distill``, of the teacher's answers, EOS not counted)."""
    if config.horizon is not None:
        return config.horizon
    if config.distill:
        lengths = [len(ids) - (1 if ids and ids[-1] == tokenizer.eos_token_id else 0)
                   for e in rd.train_raw if (ids := rd.answers.get(e.prompt)) is not None]
        return max(1, int(math.floor(statistics.median(lengths) + 0.5))) if lengths else 1
    return max(1, median_response_tokens(rd.train_raw, tokenizer))


def teacher_answers(adapter: Adapter, tokenizer: Any, prompts: list[str], *, chat: bool,
                    max_new_tokens: int, batch_size: int, accelerator: Any,
                    done: dict[str, list[int]] | None = None,
                    on_batch: Callable[[dict[str, list[int]]], None] | None = None,
                    progress: bool = False) -> dict[str, list[int]]:
    """Full-depth greedy answers (prompt -> token ids, EOS included when produced) for ``prompts``,
    generated in batches of ``batch_size`` prompts (shortest first) sharded over the processes.

    ``done`` holds answers already made (e.g. by a killed run, :func:`.checkpoint.load_partial_answers`):
    its prompts are not generated again. ``on_batch`` (single process only) gets every answer so
    far, ``done`` included, after each batch, so that a caller can store them
    (:func:`.checkpoint.save_partial_answers`). ``progress`` shows a tqdm bar (batches).

    Raises:
        ValueError: ``on_batch`` with more than one process (each holds only its shard).
    """
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    if on_batch is not None and accelerator.num_processes > 1:
        raise ValueError("on_batch needs a single process (each process answers only its shard)")
    given = {p: list(done[p]) for p in prompts if done and p in done}
    ordered = sorted((p for p in dict.fromkeys(prompts) if p not in given), key=len)
    mine = ordered[accelerator.process_index::accelerator.num_processes]
    full = FullPolicy(adapter.num_layers)
    answers: list[tuple[str, list[int]]] = []
    starts = range(0, len(mine), batch_size)
    for start in tqdm(starts, desc="teacher answers", unit="batch", disable=not progress, dynamic_ncols=True):
        chunk = mine[start:start + batch_size]
        result = generate(adapter, tokenizer, chunk, policy=full, max_new_tokens=max_new_tokens, chat=chat)
        answers.extend(zip(chunk, result.token_ids))
        if on_batch is not None:
            on_batch({**given, **{p: list(ids) for p, ids in answers}})
    if accelerator.num_processes > 1:
        answers = gather_object(answers)
    return {**given, **{p: list(ids) for p, ids in answers}}
