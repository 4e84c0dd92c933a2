"""The generation runs of an evaluation: each model loaded in its turn (and released after it),
its rows warmed up, then every batch generated under every row's plan, interleaved batch by batch
(batch b runs under every policy before batch b+1), with each generation call timed into its
:class:`~skipdecode.eval_report.EvalRow` (:meth:`EvalRow.add`). :func:`skipdecode.evaluate.evaluate`
checks the arguments, calls :func:`run_models`, then scores the rows."""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .data import EvalItem
from .eval_report import EvalRow, finish_rows

__all__ = ["ModelLike", "RunSettings", "Progress", "model_entries", "device_of", "run_models"]

ModelLike = Any  # SkipModel or a zero-argument callable returning one


@dataclass(frozen=True)
class RunSettings:
    """What every generation call of one evaluation shares.

    Attributes:
        batches: the items in generation order, cut into batches of at most ``batch_size``.
        order: ``order[k]`` is the index (in the caller's item list) of the k-th item generated.
        batch_size: prompts per generation call (with ``inflight``: the most rows decoding at once).
        max_new_tokens: tokens per item.
        stop: stop strings.
        chat: apply the chat template (None: each model's setting).
        warmup: run every row once, untimed, on the first batch with at most 8 new tokens.
        inflight: run each batched SkipDecode row's items through one in-flight engine.
        sort_by_length: ``batches`` hold the items longest prompt first (recorded in the report).
        cohort_size: with ``inflight``, waiting items join the running rows in cohorts of at
            least this many (:class:`skipdecode.engine.Engine`).
        prefix_cache: with ``inflight``, the engine's automatic prefix caching (True, False or a
            token budget; :class:`skipdecode.engine.Engine`).
    """

    batches: list[list[EvalItem]]
    order: list[int]
    batch_size: int
    max_new_tokens: int
    stop: tuple[str, ...]
    chat: bool | None
    warmup: bool
    inflight: bool
    sort_by_length: bool = False
    cohort_size: int = 1
    prefix_cache: bool | int = True

    def gen_kwargs(self, max_new_tokens: int | None = None) -> dict[str, Any]:
        """Keyword arguments of a generation call (``max_new_tokens`` overrides the budget, tokens)."""
        return dict(max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
                    stop=self.stop, chat=self.chat)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that send a generation call through the in-flight engine."""
        return dict(max_batch_size=self.batch_size, cohort_size=self.cohort_size, prefix_cache=self.prefix_cache)


class Progress:
    """Progress over batches: a tqdm bar on stderr (``progress=True``), a callable called with the
    number of batches done after each batch, or nothing (False)."""

    def __init__(self, progress: bool | Callable[[int], None], total: int):
        self.progress, self.total, self.done, self.bar = progress, total, 0, None

    def start(self) -> None:
        """Draw the bar (once; only with ``progress=True``). Called once the first model is loaded
        and its policies resolved, so that a bad model or policy fails with its message alone, not
        under a stray empty bar."""
        if self.bar is None and self.progress is True:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, unit="batch", desc="eval", file=sys.stderr, dynamic_ncols=True)

    def describe(self, label: str) -> None:
        """Show the label of the model being run on the bar."""
        if self.bar is not None:
            self.bar.set_description(f"eval {label}")

    def step(self) -> None:
        """One batch done (of every row of the current model)."""
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif callable(self.progress):
            self.progress(self.done)

    def close(self) -> None:
        """Close the bar, if drawn."""
        if self.bar is not None:
            self.bar.close()


def model_entries(models: Any) -> list[tuple[str, ModelLike]]:
    """``(label, model or loader)`` pairs of the ``models`` argument of :func:`skipdecode.evaluate.evaluate`.

    A mapping gives its labels; a single SkipModel or a sequence gets ``model.source`` up to
    ``" ("`` (else ``model{i}``) as labels, a repeated label suffixed ``#2``, ``#3``, ...

    Raises:
        ValueError: no model.
    """
    if isinstance(models, Mapping):
        entries = list(models.items())
    elif hasattr(models, "generate") and hasattr(models, "adapter"):
        entries = [(None, models)]
    else:
        entries = [(None, m) for m in models]
    if not entries:
        raise ValueError("models is empty: give at least one SkipModel")
    out, seen = [], set()
    for i, (label, m) in enumerate(entries):
        if label is None:
            label = (getattr(m, "source", "") or f"model{i}").split(" (")[0]
        base, k = str(label), 2
        while label in seen:
            label = f"{base}#{k}"
            k += 1
        seen.add(label)
        out.append((str(label), m))
    return out


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_of(model) -> str:
    """Device of ``model``'s weights for the report: ``"cpu"``, ``"cuda (NAME)"``, ...; ``"cpu"``
    when it has none. Never raises."""
    try:
        dev = next(model.model.parameters()).device
    except (StopIteration, AttributeError):
        return "cpu"
    if dev.type == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _model_info(model, chat: bool | None) -> dict[str, Any]:
    """``meta['models'][label]``: source, num_layers, chat, stored policy, model_type."""
    return {
        "source": getattr(model, "source", ""), "num_layers": model.num_layers,
        "chat": bool(model.chat if chat is None else chat), "policy": model.policy.to_dict(),
        "model_type": getattr(getattr(model.model, "config", None), "model_type", None),
    }


def _unpermute(values: list, order: list[int]) -> list:
    """Return ``values`` (``values[k]`` belongs to item ``order[k]``) in item order."""
    out: list = [None] * len(order)
    for k, i in enumerate(order):
        out[i] = values[k]
    return out


def _timed(row: EvalRow, generate: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run one generation call ``generate(*args, **kwargs)`` and add its result and wall-clock
    seconds to ``row``."""
    t0 = time.perf_counter()
    res = generate(*args, **kwargs)
    row.add(res, time.perf_counter() - t0)


def _warm_up(model, rows: list[EvalRow], plans: list[Any], inflight: list[bool], settings: RunSettings) -> None:
    """Untimed: first calls pay one-off kernel and allocator set-up, each row on the path its timed
    calls take (``inflight[i]``: the in-flight engine, whose first call otherwise runs cold and
    slows only the first timed row)."""
    from .calm import calm_generate

    warm = settings.gen_kwargs(min(8, settings.max_new_tokens))
    first = [it.prompt for it in settings.batches[0]]
    for row, plan, engine in zip(rows, plans, inflight):
        if row.kind == "calm":
            calm_generate(model, first[0], threshold=plan.threshold, min_layers=plan.min_layers, **warm)
        elif engine:
            model.generate(first, policy=plan, **settings.engine_kwargs(), **warm)
        else:
            model.generate(first[: row.batch_size], policy=plan, **warm)


def _run_batch(model, prompts: list[str], rows: list[EvalRow], plans: list[Any], skip: list[bool],
               settings: RunSettings) -> None:
    """One batch under every row's plan but those flagged in ``skip``: CALM rows and batch-1 rows
    (of a batched harness) one prompt at a time, the others in one call."""
    from .calm import calm_generate

    kw = settings.gen_kwargs()
    for row, plan, skipped in zip(rows, plans, skip):
        if skipped:
            continue
        if row.kind == "calm":
            for p in prompts:
                _timed(row, calm_generate, model, p, threshold=plan.threshold, min_layers=plan.min_layers, **kw)
        elif row.batch_size == 1 and settings.batch_size != 1:
            for p in prompts:
                _timed(row, model.generate, [p], policy=plan, **kw)
        else:
            _timed(row, model.generate, prompts, policy=plan, **kw)


def _run_model(model, label: str, rows: list[EvalRow], plans: list[Any], settings: RunSettings,
               progress: Progress) -> None:
    """Every generation of one model's rows (warm-up first), then their derived figures
    (:func:`~skipdecode.eval_report.finish_rows`) and outputs back in item order."""
    streamed = [r.kind != "calm" and not (r.batch_size == 1 and settings.batch_size != 1) for r in rows]
    inflight = [settings.inflight and flag for flag in streamed]
    if settings.warmup:
        _warm_up(model, rows, plans, inflight, settings)
    progress.describe(label)
    if settings.inflight:  # each such row: every item through one in-flight engine
        all_prompts = [it.prompt for batch in settings.batches for it in batch]
        for row, plan, flag in zip(rows, plans, inflight):
            if flag:
                _timed(row, model.generate, all_prompts, policy=plan, **settings.engine_kwargs(),
                       **settings.gen_kwargs())
    for batch in settings.batches:
        _run_batch(model, [it.prompt for it in batch], rows, plans, inflight, settings)
        progress.step()
    finish_rows(rows)
    for row in rows:  # batches ran in `order`: put outputs back in item order
        row.generations = _unpermute(row.generations, settings.order)
        row.finish_reasons = _unpermute(row.finish_reasons, settings.order)


def run_models(entries: Sequence[tuple[str, ModelLike]], settings: RunSettings,
               plan: Callable[[Any, str], tuple[list[EvalRow], list[Any]]],
               progress: Progress) -> tuple[list[EvalRow], dict[str, dict[str, Any]], str]:
    """Generate with every model of ``entries`` under every row that ``plan(model, label)`` gives
    it (:func:`~skipdecode.eval_policies.plan_rows`), one model at a time; a model given as a loader
    is loaded when its turn comes and released afterwards.

    Returns:
        ``(rows, model_info, device)``: every model's rows in turn (sums, derived speed figures and
        generations in item order; scores not yet set), ``meta['models']`` (label -> source,
        num_layers, chat, stored policy, model_type) and the last model's device.

    Raises:
        ValueError: from ``plan`` (an invalid policy) or a generation call. The progress bar is
            closed whatever happens.
    """
    rows: list[EvalRow] = []
    model_info: dict[str, dict[str, Any]] = {}
    device = "cpu"
    try:
        for label, entry in entries:
            model = entry if hasattr(entry, "generate") else entry()
            device = device_of(model)
            model_info[label] = _model_info(model, settings.chat)
            model_rows, plans = plan(model, label)
            progress.start()
            _run_model(model, label, model_rows, plans, settings, progress)
            rows.extend(model_rows)
            if entry is not model:  # loaded here: release it before the next checkpoint
                del model
                gc.collect()
                _empty_device_cache()
    finally:
        progress.close()
    return rows, model_info, device
