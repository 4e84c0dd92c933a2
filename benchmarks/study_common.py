"""Pieces shared by the recipe study (``recipe_study.py``) and the equal-budget frontier runner
(``frontier.py``): the E2E dev split by meaning representation, training runs sized to a time
budget (s/step measured, for the frontier's equal-examples cut) or stopped at a deadline, and
greedy BLEU on held-out dev MRs. (The recipe study's per-run time budget is the trainer's own
``TrainConfig.max_minutes``.)

Not a library module: the benchmark scripts import it from their own folder.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)
from typing import Any, Callable, Sequence

__all__ = ["DevSplit", "split_by_mr", "DeadlineReached", "deadline_callback", "seconds_per_step",
           "dev_bleu", "write_json_atomic", "repo_relative", "E2E_STOP", "E2E_MAX_NEW_TOKENS"]

#: E2E generation settings, the evaluation harness's (skipdecode.evaluate.TASKS["e2e"]).
E2E_STOP = ("\n",)
E2E_MAX_NEW_TOKENS = 64
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class DevSplit:
    """E2E dev pairs split by MR: ``train`` (pairs of the training MRs), ``heldout`` (pairs of the
    held-out MRs: the validation loss) and ``items`` (one ``EvalItem`` per held-out MR with all its
    references: the dev BLEU). ``heldout_mrs`` lists the held-out prompts in split order."""

    train: list
    heldout: list
    items: list
    heldout_mrs: list[str]


def split_by_mr(examples: Sequence[Any], n_heldout: int, seed: int) -> DevSplit:
    """Hold out ``n_heldout`` distinct prompts (E2E MRs), chosen by a seeded shuffle.

    Args:
        examples: :class:`skipdecode.data.Example` pairs (several references per MR).
        n_heldout: MRs held out (>= 1, fewer than the distinct MRs).
        seed: shuffle seed (the same seed gives the same split).

    Raises:
        ValueError: ``n_heldout`` out of range (names ``--heldout-mrs``).
    """
    from skipdecode.data import EvalItem

    prompts = list(dict.fromkeys(e.prompt for e in examples))
    if not 1 <= n_heldout < len(prompts):
        raise ValueError(f"--heldout-mrs must be between 1 and {len(prompts) - 1} (the data have "
                         f"{len(prompts)} MRs), got {n_heldout}")
    order = prompts[:]
    random.Random(seed).shuffle(order)
    held = order[:n_heldout]
    held_set = set(held)
    refs: dict[str, list[str]] = {p: [] for p in held}
    for e in examples:
        if e.prompt in held_set:
            refs[e.prompt].append(e.response)
    items = [EvalItem(prompt=p, references=tuple(refs[p]), source=p) for p in held]
    return DevSplit(train=[e for e in examples if e.prompt not in held_set],
                    heldout=[e for e in examples if e.prompt in held_set], items=items, heldout_mrs=held)


class DeadlineReached(RuntimeError):
    """Raised by :func:`deadline_callback` to stop a training run at its deadline."""


def deadline_callback(deadline: float | None) -> Callable[[dict], None] | None:
    """A ``train(callback=...)`` that raises :class:`DeadlineReached` after the first optimizer
    step that ends past ``deadline`` (a ``time.time()`` value, seconds); None without a deadline."""
    if deadline is None:
        return None

    def check(info: dict) -> None:
        if time.time() > deadline:
            raise DeadlineReached(f"deadline reached after step {info['step']} of {info['total_steps']}")
    return check


def seconds_per_step(load_model: Callable[[], Any], data: Sequence[Any], config: Any, steps: int = 3) -> float:
    """Measured seconds per optimizer step of ``config``'s run (s), from a short throw-away run.

    Used by ``frontier.py`` to cut the epochs of every model equally so that all of them fit before
    a deadline (equal examples; a plain time budget is ``TrainConfig.max_minutes``). This runs
    ``steps`` optimizer steps of the same settings (same batch size, teacher, LoRA, options) on a
    freshly loaded model in a temporary folder, without validation, and returns the median step
    time of the steps after the first (the first pays one-off set-up), or the first's with one step.

    Raises:
        whatever :func:`skipdecode.train.train` raises for the settings (TrainConfigError, ...).
    """
    import dataclasses

    from skipdecode.train import train

    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        probe = dataclasses.replace(config, out_dir=str(Path(tmp) / "run"), max_steps=steps, eval_every=0,
                                    checkpoint_every=0, val_fraction=0.0, resume=False, progress=False)
        result = train(load_model(), data, probe)
    times = [r["seconds"] for r in result.train_log]
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def dev_bleu(sk: Any, items: Sequence[Any], policy: Any, *, batch_size: int, chat: bool | None) -> dict:
    """Greedy generation for ``items`` under ``policy`` and its corpus BLEU (0-100, sacrebleu via
    :func:`skipdecode.metrics.corpus_bleu`, all references per MR).

    Returns:
        ``{"bleu", "n_items", "theoretical_speedup" (L x decode steps / layers run), "seconds"
        (generation wall time, s), "generations"}``.
    Raises:
        ValueError: from generation (bad policy) or scoring (an item without references).
    """
    from skipdecode.metrics import corpus_bleu

    sk.model.eval()
    texts: list[str] = []
    steps = layers = 0
    t0 = time.perf_counter()
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        res = sk.generate([it.prompt for it in batch], policy=policy, max_new_tokens=E2E_MAX_NEW_TOKENS,
                          stop=E2E_STOP, chat=chat)
        texts.extend(t.strip() for t in res.texts)
        steps += res.decode_steps
        layers += sum(res.layers_run)
    seconds = time.perf_counter() - t0
    bleu = corpus_bleu(texts, [list(it.references) for it in items])
    speedup = sk.num_layers * steps / layers if layers else 1.0
    return {"bleu": bleu, "n_items": len(items), "theoretical_speedup": speedup, "seconds": seconds,
            "generations": texts}


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` through a temporary file and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def repo_relative(path: Any) -> str:
    """``path`` relative to the repository root when it lies inside it or beside it (the shared
    data folder is ``../shared/data``), else as given."""
    p = Path(path).resolve()
    if p.is_relative_to(ROOT.parent):
        return os.path.relpath(p, ROOT)
    return str(path)
