"""Evaluation tasks: the defaults of each task (metric set, plotted metric, stop strings, token
budget) and the task of a data file (:func:`detect_task`), as :mod:`skipdecode.evaluate` uses them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TaskSpec", "TASKS", "detect_task"]


@dataclass(frozen=True)
class TaskSpec:
    """Defaults of one evaluation task.

    Attributes:
        name: task name (a key of :data:`skipdecode.data.TEMPLATES`).
        metrics: metric names computed (from :data:`skipdecode.metrics.METRICS`).
        quality_metric: the metric plotted against speedup.
        stop: default stop strings (the generated text is cut before them).
        max_new_tokens: default generation budget (tokens).
    """

    name: str
    metrics: tuple[str, ...]
    quality_metric: str
    stop: tuple[str, ...]
    max_new_tokens: int


#: Task defaults: E2E (one sentence: stop at a newline; BLEU, chrF, NIST, ROUGE-L), CNN/DailyMail
#: (summaries: ROUGE-1/2/L) and plain ``{prompt, references}`` files (every metric).
TASKS: dict[str, TaskSpec] = {
    "e2e": TaskSpec("e2e", ("bleu", "chrf", "nist", "rougeL"), "bleu", ("\n",), 64),
    "cnndm": TaskSpec("cnndm", ("rouge1", "rouge2", "rougeL"), "rougeL", (), 128),
    "plain": TaskSpec("plain", ("bleu", "chrf", "nist", "rouge1", "rouge2", "rougeL"), "bleu", (), 64),
}


def detect_task(spec: str | os.PathLike) -> str:
    """Task of a data file, as :func:`skipdecode.data.load_eval_items` dispatches it.

    ``.csv`` -> ``"e2e"``; ``.jsonl`` whose first record has an ``article`` key -> ``"cnndm"``;
    anything else (other JSONL, hub names, unreadable files) -> ``"plain"``. Never raises.
    """
    p = Path(spec).expanduser()
    if not p.exists():
        from .data import default_data_dir

        root = default_data_dir()
        if root is not None and not p.is_absolute() and (root / p).exists():
            p = root / p
    suffix = p.suffix.lower()
    if suffix == ".csv":
        return "e2e"
    if suffix == ".jsonl" and p.is_file():
        try:
            with p.open(encoding="utf-8") as fh:
                for line in fh:
                    if line.strip():
                        rec = json.loads(line)
                        return "cnndm" if isinstance(rec, dict) and "article" in rec else "plain"
        except (OSError, ValueError):
            return "plain"
    return "plain"

