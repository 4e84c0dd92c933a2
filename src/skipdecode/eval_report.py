"""Evaluation results: :class:`EvalRow` (one model under one policy: sums, derived speed figures,
generations) and :class:`Report` (rows, items, run description) with its JSON round trip
(:meth:`Report.to_dict`, :meth:`Report.from_dict`, :meth:`Report.load`), rescoring from stored
generations, and :meth:`Report.save` (JSON, Markdown and PNG; the last two are drawn by
:mod:`skipdecode.eval_output`). :func:`finish_rows` turns a model's sums into its speedups against
its reference row; the formulas are those of :mod:`skipdecode.evaluate`'s module docstring."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .eval_output import plot_report, report_markdown
from .eval_tasks import TASKS
from .jsonio import dumps, json_safe
from .metrics import score_all
from .paths import is_file_name

__all__ = ["EvalRow", "Report", "finish_rows"]


@dataclass
class EvalRow:
    """One row of the report: one model decoded with one policy over every item.

    Attributes:
        model: the model's label.
        policy: the policy's short name (``"full"``, ``"2x"``, ``"checkpoint"``, ``"calm@0.9"``).
        policy_config: the policy's ``to_dict()``.
        description: human-readable schedule.
        kind: ``"skipdecode"`` or ``"calm"``.
        reference: True for the full-depth row wall-clock speedups are measured against.
        reference_policy: name of this row's reference row (same model).
        batch_size: prompts per generation call (the largest batch that ran: the setting, or the
            number of items when they are fewer; the run's setting is in ``Report.meta``).
        num_layers: L (layers).
        n_items: items generated.
        scores: metric name -> score (0-100).
        decode_steps: decode steps t >= 1 summed over batches.
        layers_run: layers run in those steps, summed (layers).
        compute_layers: layers executed including CALM's KV propagation (== layers_run for
            SkipDecode rows), summed (layers).
        head_evals: CALM confidence heads evaluated (0 for SkipDecode rows).
        mean_active_layers: layers_run / decode_steps (L when there was no decode step).
        theoretical_speedup: L * decode_steps / layers_run (1.0 with no decode step).
        compute_speedup: L * decode_steps / compute_layers.
        new_tokens: generated tokens, all items (tokens).
        prompt_tokens: prompt tokens, all items (tokens, without padding).
        cached_prompt_tokens: of those, the ones reused from the in-flight engine's prefix cache
            instead of prefilled (tokens; 0 in static batches, batch-1 and CALM rows).
        generation_seconds: wall-clock time of the generation calls (s).
        prefill_seconds: summed prefill + token-0 time (s); decode_seconds: summed decode time (s).
        tokens_per_second: new_tokens / generation_seconds.
        step_seconds: decode_seconds / decode_steps (s).
        wallclock_speedup: tokens_per_second / the reference row's (filled by :func:`evaluate`).
        decode_speedup: reference step_seconds / this row's step_seconds.
        time_speedup: reference generation_seconds / this row's (whole test set, outputs of
            different lengths included).
        generations: generated text per item (stripped; what was scored), in item order.
        finish_reasons: per item ("eos", "stop", "length").
    """

    model: str
    policy: str
    policy_config: dict
    description: str
    kind: str
    reference: bool
    reference_policy: str
    batch_size: int
    num_layers: int
    n_items: int = 0
    scores: dict[str, float] = field(default_factory=dict)
    decode_steps: int = 0
    layers_run: int = 0
    compute_layers: int = 0
    head_evals: int = 0
    mean_active_layers: float = float("nan")
    theoretical_speedup: float = float("nan")
    compute_speedup: float = float("nan")
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens_per_second: float = float("nan")
    step_seconds: float = float("nan")
    wallclock_speedup: float = float("nan")
    decode_speedup: float = float("nan")
    time_speedup: float = float("nan")
    generations: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, result: Any, seconds: float) -> None:
        """Accumulate one :class:`GenerationResult` (or CalmResult) that took ``seconds`` (s)."""
        self.n_items += len(result.texts)
        self.generations.extend(t.strip() for t in result.texts)
        self.finish_reasons.extend(result.finish_reasons)
        self.decode_steps += result.decode_steps
        self.layers_run += sum(result.layers_run)
        self.compute_layers += sum(getattr(result, "compute_layers", None) or result.layers_run)
        self.head_evals += sum(getattr(result, "head_evals", None) or [])
        self.new_tokens += sum(result.new_tokens)
        self.prompt_tokens += sum(getattr(result, "prompt_tokens", None) or [])
        self.cached_prompt_tokens += sum(getattr(result, "cached_prompt_tokens", None) or [])
        self.generation_seconds += seconds
        self.prefill_seconds += result.prefill_seconds
        self.decode_seconds += result.decode_seconds

    def finish(self) -> None:
        """Compute the derived speed figures from the sums."""
        L, n = self.num_layers, self.decode_steps
        self.mean_active_layers = self.layers_run / n if n else float(L)
        self.theoretical_speedup = L * n / self.layers_run if self.layers_run else 1.0
        self.compute_speedup = L * n / self.compute_layers if self.compute_layers else 1.0
        self.tokens_per_second = self.new_tokens / self.generation_seconds if self.generation_seconds > 0 else float("nan")
        self.step_seconds = self.decode_seconds / n if n else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (NaN becomes None)."""
        return json_safe(asdict(self))


def _ratio(a: float, b: float) -> float:
    """a / b, NaN when either is None, NaN or 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or not a or not b:
        return float("nan")
    return a / b


def finish_rows(rows: list[EvalRow]) -> None:
    """Derive the speed figures of one model's rows, in place (:meth:`EvalRow.finish`), then their
    speedups against each row's reference row (``reference_policy``, same model):
    ``wallclock_speedup`` (tokens/s ratio), ``decode_speedup`` (ratio of mean decode-step seconds)
    and ``time_speedup`` (ratio of generation seconds); exactly 1 for the reference itself (its
    ``decode_speedup`` stays NaN when it had no decode step). A figure whose inputs are NaN or 0
    stays NaN.

    Raises:
        KeyError: a row's ``reference_policy`` is not among ``rows``.
    """
    for r in rows:
        r.finish()
    by_name = {r.policy: r for r in rows}
    for r in rows:
        ref = by_name[r.reference_policy]
        if ref.tokens_per_second and not math.isnan(ref.tokens_per_second) and not math.isnan(r.tokens_per_second):
            r.wallclock_speedup = r.tokens_per_second / ref.tokens_per_second
        if r.step_seconds and not math.isnan(ref.step_seconds) and not math.isnan(r.step_seconds):
            r.decode_speedup = ref.step_seconds / r.step_seconds
        if r.generation_seconds > 0:
            r.time_speedup = ref.generation_seconds / r.generation_seconds
        if r is ref:  # exactly 1 by definition
            r.wallclock_speedup = r.time_speedup = 1.0
            r.decode_speedup = float("nan") if math.isnan(r.step_seconds) else 1.0


@dataclass
class Report:
    """Result of :func:`evaluate`.

    Attributes:
        rows: one :class:`EvalRow` per (model, policy), reference rows first for each model.
        items: the evaluated items as dicts (``prompt``, ``references``, ``source``).
        meta: run description: ``command``, ``date`` (ISO 8601, UTC), ``versions``, ``data``,
            ``task``, ``metrics``, ``quality_metric``, ``n_items``, ``batch_size``,
            ``max_new_tokens``, ``stop``, ``models`` (label -> source, num_layers, chat, stored
            policy, model_type), ``device``, ``platform``, ``seconds`` (whole run); after
            :meth:`set_baseline`, ``baseline`` (``{"model", "policy"}``) and ``against_baseline``
            (:meth:`against`); ``benchmarks/eval_e2e.py`` adds ``checkpoints`` (label -> folder).
    """

    rows: list[EvalRow]
    items: list[dict[str, Any]]
    meta: dict[str, Any]

    def row(self, model: str, policy: str) -> EvalRow:
        """The row of ``model`` under ``policy`` (names as in the table).

        Raises:
            KeyError: no such row (the message lists the rows).
        """
        for r in self.rows:
            if r.model == model and r.policy == policy:
                return r
        raise KeyError(f"no row ({model!r}, {policy!r}); rows: {[(r.model, r.policy) for r in self.rows]}")

    def against(self, model: str, policy: str = "full") -> list[dict[str, Any]]:
        """Speed of every other SkipDecode row against one baseline row, across models.

        Each row's own speedups (:func:`finish_rows`) compare it with the *same* model at full
        depth. The paper's baseline is another model: the fine-tuned full-depth (1x) model
        (docs/method.md, "What the paper reports"), whose outputs can differ in length from those of a
        model taught a skip schedule and then decoded at full depth. This gives, for every row
        but the baseline, CALM rows and rows of another batch size than the baseline's (e.g. the
        ``full@bs1`` references of CALM rows), four dimensionless ratios against ``(model, policy)``:

        * ``wallclock_speedup``: tokens_per_second / the baseline's;
        * ``decode_speedup``: the baseline's step_seconds / this row's (mean decode-step time);
        * ``time_speedup``: the baseline's generation_seconds / this row's (the whole item set);
        * ``wall_over_decode``: wallclock_speedup / decode_speedup (1 when the outputs are as
          long and the prefill as cheap, relative to decoding, as the baseline's).

        Rows of different models ran at different times of the run (one model is loaded at a
        time), so a machine whose speed drifts moves these ratios; rows of one model interleave.
        Evaluating the baseline model twice (``--model X --model X``) measures that effect.

        Returns:
            one dict per row: ``model``, ``policy``, ``batch_size``, the four ratios (NaN when
            either input is NaN or 0), ``theoretical_speedup`` and ``new_tokens_per_item`` (tokens).

        Raises:
            KeyError: no such baseline row (the message lists the rows).
        """
        base = self.row(model, policy)
        out = []
        for r in self.rows:
            if r is base or r.kind == "calm" or r.batch_size != base.batch_size:
                continue
            wall = _ratio(r.tokens_per_second, base.tokens_per_second)
            decode = _ratio(base.step_seconds, r.step_seconds)
            out.append({
                "model": r.model, "policy": r.policy, "batch_size": r.batch_size,
                "wallclock_speedup": wall, "decode_speedup": decode,
                "time_speedup": _ratio(base.generation_seconds, r.generation_seconds),
                "wall_over_decode": _ratio(wall, decode), "theoretical_speedup": r.theoretical_speedup,
                "new_tokens_per_item": _ratio(r.new_tokens, r.n_items),
            })
        return out

    def set_baseline(self, model: str, policy: str = "full") -> list[dict[str, Any]]:
        """Name ``(model, policy)`` the run's baseline: stores ``meta['baseline']`` (its labels)
        and ``meta['against_baseline']`` (:meth:`against`), which the Markdown then shows as a
        second table. Returns the :meth:`against` list.

        Raises:
            KeyError: no such row (the message lists the rows).
        """
        rows = self.against(model, policy)
        self.meta["baseline"] = {"model": model, "policy": policy}
        self.meta["against_baseline"] = json_safe(rows)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict: ``meta``, ``rows`` (with generations) and ``items``."""
        return {"meta": json_safe(self.meta), "rows": [r.to_dict() for r in self.rows], "items": self.items}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Report":
        """Rebuild a report from :meth:`to_dict` output (a saved ``NAME.json``).

        Raises:
            ValueError: ``data`` lacks ``rows``/``meta`` or a row has unknown or missing fields.
        """
        if not isinstance(data, Mapping) or not isinstance(data.get("rows"), list) or "meta" not in data:
            raise ValueError("not an evaluation report: expected a JSON object with 'meta' and 'rows'")
        names = {f.name for f in fields(EvalRow)}
        rows = []
        for i, raw in enumerate(data["rows"]):
            unknown = sorted(set(raw) - names) if isinstance(raw, Mapping) else ["<not an object>"]
            if unknown:
                raise ValueError(f"rows[{i}] has unknown field(s) {unknown}; known: {sorted(names)}")
            try:
                row = EvalRow(**{k: (float("nan") if v is None else v) for k, v in raw.items()})
            except TypeError as e:
                raise ValueError(f"rows[{i}]: {e}") from None
            rows.append(row)
        return cls(rows=rows, items=list(data.get("items", [])), meta=dict(data["meta"]))

    def rescore(self, metrics: Sequence[str] | None = None) -> "Report":
        """Recompute every row's scores from its stored generations and the items' references.

        Generation is untouched (same texts, same timings); only the scores are recomputed, e.g.
        to add a metric to a saved report. ``metrics`` defaults to the report task's metric set
        (:data:`TASKS`). Sets ``meta['metrics']`` and records ``meta['rescored']`` (date,
        metrics). Returns ``self``.

        Raises:
            ValueError: the report holds no items with references, a row's generations do not
                match the items in number, or an unknown metric.
        """
        task = TASKS.get(self.meta.get("task", "plain"), TASKS["plain"])
        metrics = list(task.metrics if metrics is None else metrics)
        refs = [list(it.get("references") or []) for it in self.items]
        if not refs or not all(refs):
            raise ValueError("cannot rescore: the report's items carry no references")
        for row in self.rows:
            if len(row.generations) != len(refs):
                raise ValueError(f"cannot rescore row ({row.model!r}, {row.policy!r}): "
                                 f"{len(row.generations)} generations for {len(refs)} items")
            row.scores = score_all(row.generations, refs, metrics)
        self.meta["metrics"] = metrics
        self.meta["rescored"] = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                 "metrics": metrics}
        return self

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Report":
        """Read a report saved by :meth:`save` (``NAME.json``).

        Raises:
            ValueError: the file is missing, not JSON, or not a report (the message names the path).
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"cannot read report {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"report {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"report {path}: {e}") from None

    def to_markdown(self) -> str:
        """A Markdown table (one line per row) with a short header and notes."""
        return report_markdown(self)

    def plot(self, path: str | os.PathLike, frontier: Sequence[tuple[str, str]] | None = None) -> Path:
        """PNG of quality (``meta['quality_metric']``) against realised speedup.

        Filled markers: theoretical speedup (L x decode steps / layers run); hollow markers joined
        to them by a dotted line: the measured decode-step speedup of the same row (wall clock,
        ratio of mean decode-step times against the model's full-depth row; unlike the tokens/s
        ratio it does not move with output lengths). CALM rows are triangles. One colour per model.

        Args:
            path: PNG file to write.
            frontier: optional ``(model, policy)`` rows joined by one thick line, e.g. each
                fine-tuned checkpoint under its own schedule. Given, the per-model lines are
                dropped and every point is labelled ``model policy``. None: one line per model.

        Uses matplotlib's Agg canvas directly (no pyplot, no global backend change).

        Returns:
            the path.
        Raises:
            KeyError: a ``frontier`` row is not in the report (the message lists the rows).
        """
        return plot_report(self, path, frontier)

    def save(self, out_dir: str | os.PathLike, name: str = "eval",
             frontier: Sequence[tuple[str, str]] | None = None) -> dict[str, Path]:
        """Write ``{name}.json``, ``{name}.md`` and ``{name}.png`` into ``out_dir`` (created).

        ``frontier`` goes to :meth:`plot`.

        Returns:
            ``{"json": path, "md": path, "png": path}``.
        Raises:
            OSError: the folder cannot be created or written.
            KeyError: a ``frontier`` row is not in the report.
            ValueError: ``name`` is not a plain file name (it would write outside ``out_dir``).
        """
        if not is_file_name(name):
            raise ValueError(f"name must be a file name without a folder, got {name!r}")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
        tmp = paths["json"].with_suffix(".json.tmp")
        tmp.write_text(dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, paths["json"])
        paths["md"].write_text(self.to_markdown(), encoding="utf-8")
        self.plot(paths["png"], frontier=frontier)
        return paths
