"""Evaluation harness: quality (sacrebleu, rouge-score) and speed of skip policies vs full depth.

:func:`evaluate` generates for every evaluation item (:class:`skipdecode.data.EvalItem`) with each
model (:class:`skipdecode.model.SkipModel`) under each requested policy, in batches, and scores the
outputs with :mod:`skipdecode.metrics`. For every model the full-depth policy is always run too and
flagged as the *reference*: wall-clock speedups are measured against it in the same run
(docs/correctness.md pitfall 13). Policies are interleaved batch by batch (batch b runs under every policy before batch
b+1), so slow drifts of a shared machine hit every row alike.

Speed figures of a row (all aggregated over every batch of the row):

* ``mean_active_layers`` = sum of layers run / decode steps (layers; decode steps t >= 1 only);
* ``theoretical_speedup`` = sum over batches of L * steps / sum over batches of layers run
  (docs/method.md "Target speedup"; the full-depth prefill and token 0 are excluded by definition);
* ``tokens_per_second`` = generated tokens of every item / wall-clock seconds spent in the
  generation calls (tokenisation, prefill, decode and detokenisation included);
* ``wallclock_speedup`` = ``tokens_per_second`` / the reference row's (the reference row has 1.0);
* ``step_seconds`` = decode seconds / decode steps (the batch's inter-token latency) and
  ``decode_speedup`` = the reference's ``step_seconds`` / this row's: the wall-clock analogue of
  ``theoretical_speedup``;
* ``time_speedup`` = the reference's generation seconds / this row's (time for the whole set).

Outputs of different lengths move ``wallclock_speedup`` (tokens/s) apart from ``decode_speedup``:
a batch keeps stepping until its longest row ends, so a row whose outputs are shorter or more
uneven emits fewer tokens per step. Compare ``decode_speedup`` with ``theoretical_speedup``.

The CALM baseline (:mod:`skipdecode.calm`) runs at batch size 1; when the harness batch size is
larger, a full-depth batch-1 reference row is added for each model that gets a CALM row, and the
CALM row's wall-clock figures are relative to it.

Outputs: :meth:`Report.to_dict` (JSON with package versions, command line, date, per-item
generations), :meth:`Report.to_markdown` and :meth:`Report.plot` (PNG, Agg canvas, no pyplot
state); :meth:`Report.save` writes all three. The library never prints; ``progress=True`` shows a
tqdm bar on stderr.

This module holds :func:`evaluate` (argument checks, scoring, the run description) and re-exports
the parts, one concern a module: :mod:`~skipdecode.eval_tasks` (task defaults, :func:`detect_task`),
:mod:`~skipdecode.eval_policies` (policy specs, each model's rows), :mod:`~skipdecode.eval_run`
(the timed generation runs), :mod:`~skipdecode.eval_report` (:class:`EvalRow`, :class:`Report`,
JSON), :mod:`~skipdecode.eval_output` (Markdown table, PNG plot) and :mod:`~skipdecode.eval_join`
(:func:`combine_reports`, :func:`concat_reports`).
"""

from __future__ import annotations

import datetime as _dt
import functools
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .data import EvalItem
from .eval_join import combine_reports, concat_reports
from .eval_policies import PolicySpec, is_single_spec, plan_rows, resolve_policy
from .eval_report import EvalRow, Report
from .eval_run import Progress, RunSettings, model_entries, run_models
from .eval_tasks import TASKS, TaskSpec, detect_task
from .limits import check_stop
from .metrics import METRICS, score_all
from .prefix_cache import prefix_cache_budget

__all__ = [
    "TaskSpec",
    "TASKS",
    "PolicySpec",
    "EvalRow",
    "Report",
    "detect_task",
    "resolve_policy",
    "evaluate",
    "package_versions",
    "combine_reports",
    "concat_reports",
]


def package_versions() -> dict[str, str]:
    """Versions of python, torch, transformers, skipdecode, sacrebleu, rouge-score, tokenizers."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "skipdecode", "tokenizers", "sacrebleu", "rouge-score"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def evaluate(
    models: Any,
    items: Sequence[EvalItem],
    policies: Sequence[PolicySpec] | Mapping[str, Sequence[PolicySpec]] | None = None,
    *,
    batch_size: int = 8,
    max_new_tokens: int | None = None,
    stop: Sequence[str] | None = None,
    task: str = "plain",
    metrics: Sequence[str] | None = None,
    horizon: int | None = None,
    calm_thresholds: Sequence[float] = (),
    calm_min_layers: int = 1,
    calm_models: Sequence[str] | None = None,
    chat: bool | None = None,
    warmup: bool = True,
    progress: bool | Callable[[int], None] = False,
    command: str | None = None,
    data: str | None = None,
    sort_by_length: bool = False,
    inflight: bool = False,
    cohort_size: int = 1,
    prefix_cache: bool | int = True,
) -> Report:
    """Generate for ``items`` with every model under every policy, then score and time each row.

    Args:
        models: a :class:`~skipdecode.model.SkipModel`, a sequence of them, or a mapping
            label -> SkipModel or zero-argument callable returning one (loaded when its turn comes
            and released afterwards, so several checkpoints need not fit in memory at once).
            Labels default to ``model.source``.
        items: evaluation items (``prompt``, ``references``); every item needs >= 1 reference.
        policies: :data:`PolicySpec` list applied to every model, or a mapping label -> list
            (models not in it get the checkpoint's policy). None: each model's own policy. The
            full-depth reference row is always added; duplicate policies of a model are merged.
        batch_size: prompts per generation call (>= 1); the last batch may be smaller. With
            ``inflight``: the most rows decoding at once.
        inflight: run each SkipDecode row's items with in-flight batching
            (:func:`~skipdecode.generate.generate_inflight`): a finished item's slot goes to the
            next item at once, so a long item no longer holds its batch (batch-1 and CALM rows are
            unchanged). ``decode_steps`` then counts row-steps.
        cohort_size: with ``inflight``, waiting items join the running rows only in cohorts of
            at least this many (1 <= ``cohort_size`` <= ``batch_size``; :class:`skipdecode.engine.Engine`).
        prefix_cache: with ``inflight``, reuse the K/V of prompt prefixes the items share (True:
            the default token budget, an integer: that budget, False/0: off;
            :class:`skipdecode.engine.Engine`); generations are unchanged, and each row records its
            ``prompt_tokens`` and ``cached_prompt_tokens``.
        max_new_tokens: tokens per item (None: the task's default, :data:`TASKS`).
        stop: stop strings (None: the task's default; ``()`` for none; at most 4, none empty:
            :func:`skipdecode.limits.check_stop`, whose ValueError names ``stop``).
        task: key of :data:`TASKS` (metric set, plotted metric, defaults).
        metrics: metric names overriding the task's (see :data:`skipdecode.metrics.METRICS`).
        horizon: horizon T (tokens) of speedup policies (None: each model's).
        calm_thresholds: CALM top-2 margin thresholds; each adds a batch-1 CALM row
            (:mod:`skipdecode.calm`) per model in ``calm_models``.
        calm_min_layers: CALM's minimum layers before an exit.
        calm_models: labels of the models that get CALM rows (None: all).
        chat: apply the chat template (None: each model's ``chat`` setting).
        warmup: before timing a model, run every row once, untimed, on the first batch with at
            most 8 new tokens (first calls pay one-off kernel and allocator set-up).
        progress: True for a tqdm bar over batches (stderr), or a callable called with the number
            of batches done after each batch.
        command: command line recorded in ``meta`` (None: ``sys.argv``).
        data: data description recorded in ``meta`` (e.g. the file path).
        sort_by_length: form batches from items sorted by prompt length (characters, longest
            first) so that a batch pads less (left padding to its longest prompt); generations are
            put back in item order. Off by default: batches follow the file order.

    Returns:
        :class:`Report`; its rows' ``wallclock_speedup``/``decode_speedup`` are relative to each
        model's full-depth reference row (1.0 for the reference itself).

    Raises:
        ValueError: no models or items, an item without references, ``batch_size`` or
            ``max_new_tokens`` < 1, unknown task or metric, an invalid policy spec (names it),
            unknown labels in ``policies``/``calm_models``, or a generation error.
    """
    start_run = time.perf_counter()
    items = _checked_items(task, items)
    settings = _run_settings(TASKS[task], items, batch_size, max_new_tokens, stop, chat=chat, warmup=warmup,
                             inflight=inflight, sort_by_length=sort_by_length, cohort_size=cohort_size,
                             prefix_cache=prefix_cache)
    metrics, quality = _checked_metrics(TASKS[task], metrics)
    # the rows' batch size is the largest batch that ran: fewer items than batch_size make one smaller batch
    entries, plan = _planned_models(models, policies, horizon, min(batch_size, len(items)), calm_thresholds,
                                    calm_min_layers, calm_models)
    progress_ = Progress(progress, len(entries) * len(settings.batches))
    rows, model_info, device = run_models(entries, settings, plan, progress_)
    _score(rows, items, metrics)
    meta = _meta(settings, command=command, data=data, task=task, metrics=list(metrics), quality=quality,
                 n_items=len(items), models=model_info, device=device, start_run=start_run)
    return _report(rows, items, meta)


def _checked_items(task: str, items: Sequence[EvalItem]) -> list[EvalItem]:
    """``items`` as a list, checked (the task first).

    Raises:
        ValueError: unknown task, no items, or an item without references.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    items = list(items)
    if not items:
        raise ValueError("items is empty: nothing to evaluate")
    for i, it in enumerate(items):
        if not getattr(it, "references", None):
            raise ValueError(f"items[{i}] has no reference; every item needs at least one to be scored")
    return items


def _checked_metrics(spec: TaskSpec, metrics: Sequence[str] | None) -> tuple[tuple[str, ...], str]:
    """``(metrics, quality_metric)``: the metric names (the task's by default) and the plotted one
    (the task's when computed, else the first).

    Raises:
        ValueError: no metric, or one not in :data:`skipdecode.metrics.METRICS`.
    """
    metrics = tuple(spec.metrics if metrics is None else metrics)
    if not metrics:
        raise ValueError("metrics is empty; choose from " + ", ".join(METRICS))
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(map(repr, unknown))}; known: {', '.join(METRICS)}")
    quality = spec.quality_metric if spec.quality_metric in metrics else metrics[0]
    return metrics, quality


def _run_settings(spec: TaskSpec, items: list[EvalItem], batch_size: Any, max_new_tokens: Any,
                  stop: Sequence[str] | None, *, chat: bool | None, warmup: bool, inflight: bool,
                  sort_by_length: bool, cohort_size: Any = 1, prefix_cache: Any = True) -> RunSettings:
    """The generation settings of :func:`evaluate` (task defaults filled in) and its batches: file
    order, or prompts longest first (characters; ties keep file order) with ``sort_by_length``.

    Raises:
        ValueError: ``batch_size`` or ``max_new_tokens`` is not an integer >= 1,
            ``cohort_size`` is not an integer in [1, ``batch_size``], or ``prefix_cache`` is not
            True, False or a token budget (:func:`skipdecode.prefix_cache.prefix_cache_budget`).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(cohort_size, bool) or not isinstance(cohort_size, int) or not 1 <= cohort_size <= batch_size:
        raise ValueError(f"cohort_size must be an integer in [1, batch_size={batch_size}], got {cohort_size!r}")
    prefix_cache_budget(prefix_cache)  # refused here, before any model is loaded
    max_new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stop = tuple(spec.stop if stop is None else check_stop(stop))  # refused, not dropped: skipdecode.limits
    order = list(range(len(items)))
    if sort_by_length:
        order.sort(key=lambda i: -len(items[i].prompt))  # stable: ties keep file order
    batches = [[items[j] for j in order[i : i + batch_size]] for i in range(0, len(items), batch_size)]
    return RunSettings(batches, order, batch_size, max_new_tokens, stop, chat, warmup, inflight, sort_by_length,
                       cohort_size, prefix_cache)


def _planned_models(models: Any, policies: Any, horizon: int | None, batch_size: int,
                    calm_thresholds: Sequence[float], calm_min_layers: int, calm_models: Sequence[str] | None):
    """``(entries, plan)``: the ``(label, model or loader)`` pairs (:func:`~skipdecode.eval_run.model_entries`)
    and ``plan(model, label)``, the rows and plans of one model (:func:`~skipdecode.eval_policies.plan_rows`).

    Raises:
        ValueError: an invalid CALM threshold or ``calm_min_layers``, no models, or unknown labels
            in ``policies``/``calm_models``.
    """
    from .calm import CalmConfig

    calm_cfgs = [CalmConfig(float(t), calm_min_layers) for t in calm_thresholds]
    entries = model_entries(models)
    policies = [policies] if is_single_spec(policies) else policies  # one spec given bare
    _check_labels(policies, calm_models, [label for label, _ in entries])
    plan = functools.partial(plan_rows, policies=policies, horizon=horizon, batch_size=batch_size,
                             calm_cfgs=calm_cfgs, calm_models=calm_models)
    return entries, plan


def _check_labels(policies: Any, calm_models: Sequence[str] | None, labels: list[str]) -> None:
    """Raises ValueError when ``policies`` (a mapping) or ``calm_models`` name a model not in ``labels``."""
    if isinstance(policies, Mapping):
        extra = [k for k in policies if k not in labels]
        if extra:
            raise ValueError(f"policies names unknown model(s) {extra}; models: {labels}")
    if calm_models is not None:
        extra = [k for k in calm_models if k not in labels]
        if extra:
            raise ValueError(f"calm_models names unknown model(s) {extra}; models: {labels}")


def _meta(settings: RunSettings, *, command: str | None, data: str | None, task: str, metrics: list[str],
          quality: str, n_items: int, models: dict[str, Any], device: str, start_run: float) -> dict[str, Any]:
    """The run description :attr:`Report.meta` (keys in the order the JSON report has always had);
    ``seconds``: the whole run since ``start_run`` (a ``time.perf_counter()`` reading, s)."""
    return {
        "command": command if command is not None else shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "data": data,
        "task": task,
        "metrics": metrics,
        "quality_metric": quality,
        "n_items": n_items,
        "batch_size": settings.batch_size,
        "sort_by_length": bool(settings.sort_by_length),
        "inflight": bool(settings.inflight),
        "cohort_size": settings.cohort_size,
        "prefix_cache": settings.prefix_cache if settings.inflight else False,
        "max_new_tokens": settings.max_new_tokens,
        "stop": list(settings.stop),
        "models": models,
        "device": device,
        "platform": platform.platform(),
        "seconds": time.perf_counter() - start_run,
    }


def _score(rows: list[EvalRow], items: list[EvalItem], metrics: Sequence[str]) -> None:
    """Set every row's ``scores`` (0-100) from its generations and the items' references
    (:func:`~skipdecode.metrics.score_all`, corpus-level)."""
    references = [list(it.references) for it in items]
    for row in rows:
        row.scores = score_all(row.generations, references, metrics)


def _report(rows: list[EvalRow], items: list[EvalItem], meta: dict[str, Any]) -> Report:
    """The :class:`Report`; its items and meta name no machine-specific path
    (:func:`~skipdecode.paths.portable_record`)."""
    from .paths import portable_record  # reports name no machine-specific paths

    item_dicts = [{"prompt": it.prompt, "references": list(it.references), "source": it.source} for it in items]
    return Report(rows=rows, items=portable_record(item_dicts), meta=portable_record(meta))
