"""Evaluation harness: quality (sacrebleu, rouge-score) and speed of skip policies vs full depth.

:func:`evaluate` generates for every evaluation item (:class:`skipdecode.data.EvalItem`) with each
model (:class:`skipdecode.model.SkipModel`) under each requested policy, in batches, and scores the
outputs with :mod:`skipdecode.metrics`. For every model the full-depth policy is always run too and
flagged as the *reference*: wall-clock speedups are measured against it in the same run
(PITFALLS 13). Policies are interleaved batch by batch (batch b runs under every policy before batch
b+1), so slow drifts of a shared machine hit every row alike.

Speed figures of a row (all aggregated over every batch of the row):

* ``mean_active_layers`` = sum of layers run / decode steps (layers; decode steps t >= 1 only);
* ``theoretical_speedup`` = sum over batches of L * steps / sum over batches of layers run
  (METHOD.md "Target speedup"; the full-depth prefill and token 0 are excluded by definition);
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
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Union

from .data import EvalItem
from .jsonio import dumps, json_safe
from .limits import check_stop
from .metrics import METRICS, score_all
from .policy import FullPolicy, LinearDecayPolicy, SkipPolicy, policy_from_dict

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
]

#: A policy request: ``"full"``, ``"checkpoint"`` (the model's own policy), a target speedup
#: (float >= 1, turned into a policy by ``SkipModel.policy_for``), a policy dict
#: (``policy_from_dict``), a policy object, or a ``(name, spec)`` pair naming any of these.
PolicySpec = Union[str, float, int, dict, SkipPolicy, tuple]


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

_METRIC_LABELS = {"bleu": "BLEU", "rougeL": "ROUGE-L", "chrf": "chrF", "nist": "NIST", "rouge1": "ROUGE-1",
                  "rouge2": "ROUGE-2"}


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


def _policy_summary(policy: Any) -> str:
    if isinstance(policy, FullPolicy):
        return f"full ({policy.num_layers} layers)"
    if isinstance(policy, LinearDecayPolicy):
        return (f"linear {policy.max_layers}->{policy.min_layers} over {policy.horizon} steps, "
                f"warm-up {policy.warmup_layers}")
    d = policy.to_dict() if hasattr(policy, "to_dict") else dict(policy)
    if d.get("type") == "calm":
        return f"CALM early exit, top-2 margin >= {d['threshold']:g}, min {d['min_layers']} layers"
    return dumps(d, sort_keys=True)


def resolve_policy(model, spec: PolicySpec, *, horizon: int | None = None) -> tuple[str, SkipPolicy]:
    """Turn a :data:`PolicySpec` into ``(name, policy)`` for ``model``.

    Names: ``"full"``, ``"checkpoint"``, ``"{s:g}x"`` for a speedup (``"full"`` for 1), the given
    name of a ``(name, spec)`` pair, else ``"custom"``.

    Args:
        model: :class:`skipdecode.model.SkipModel`.
        spec: see :data:`PolicySpec`. Strings may also be a number (``"2"``, ``"2x"``) or a JSON
            policy dict.
        horizon: horizon T (tokens) for speedup policies (None: the model's).

    Raises:
        ValueError: unknown string, speedup < 1 or too large for the model, invalid policy dict, or
            a policy whose ``num_layers`` differs from the model's.
    """
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], str) or not spec[0].strip():
            raise ValueError(f"a named policy must be a (name, spec) pair, got {spec!r}")
        return spec[0].strip(), resolve_policy(model, spec[1], horizon=horizon)[1]
    if isinstance(spec, str):
        text = spec.strip()
        low = text.lower()
        if low in ("full", "1x", "none"):
            return "full", FullPolicy(model.num_layers)
        if low in ("checkpoint", "ckpt", "default"):
            return "checkpoint", model.policy
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"policy {spec!r} is not valid JSON: {e}") from None
        else:
            try:
                spec = float(low[:-1] if low.endswith("x") else low)
            except ValueError:
                raise ValueError(
                    f"unknown policy {spec!r}; use 'full', 'checkpoint', a speedup such as '2' "
                    "or '2x', or a JSON policy dict"
                ) from None
    if isinstance(spec, bool):
        raise ValueError(f"unknown policy {spec!r}")
    if isinstance(spec, (int, float)):
        policy = model.policy_for(speedup=float(spec), horizon=horizon)
        return ("full" if isinstance(policy, FullPolicy) else f"{float(spec):g}x"), policy
    if isinstance(spec, dict):
        policy = policy_from_dict(spec)
    else:
        policy = spec
    if not hasattr(policy, "active_layers") or not hasattr(policy, "to_dict"):
        raise ValueError(f"not a policy: {spec!r}")
    if policy.num_layers != model.num_layers:
        raise ValueError(
            f"policy.num_layers ({policy.num_layers}) must equal the model's num_layers ({model.num_layers})"
        )
    return ("full" if isinstance(policy, FullPolicy) else "custom"), policy


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
        batch_size: prompts per generation call.
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


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


@dataclass
class Report:
    """Result of :func:`evaluate`.

    Attributes:
        rows: one :class:`EvalRow` per (model, policy), reference rows first for each model.
        items: the evaluated items as dicts (``prompt``, ``references``, ``source``).
        meta: run description: ``command``, ``date`` (ISO 8601, UTC), ``versions``, ``data``,
            ``task``, ``metrics``, ``quality_metric``, ``n_items``, ``batch_size``,
            ``max_new_tokens``, ``stop``, ``models`` (label -> source, num_layers, chat, stored
            policy, model_type), ``device``, ``platform``, ``seconds`` (whole run).
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
        metrics = list(self.meta.get("metrics", []))
        order = [m for m in ("bleu", "rougeL", "chrf", "nist", "rouge1", "rouge2") if m in metrics]
        head = (["model", "policy", "ref"] + [_METRIC_LABELS[m] for m in order]
                + ["mean layers", "theor. speedup", "tok/s", "wall-clock speedup", "decode-step speedup", "batch"])
        lines = [
            f"# Evaluation: {self.meta.get('data', '?')} ({self.meta.get('n_items', '?')} items, task {self.meta.get('task', '?')})",
            "",
            " + ".join(f"`{c.get('command', '')}`"
                       for c in self.meta.get("combined") or self.meta.get("shards") or [self.meta])
            + (f", then `{self.meta['post_command']}`" if self.meta.get("post_command") else "")
            + f" on {self.meta.get('device', '?')}, {self.meta.get('date', '')}; "
            + ", ".join(f"{k} {v}" for k, v in self.meta.get("versions", {}).items()),
            "",
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|",
        ]
        for r in self.rows:
            cells = [r.model, f"{r.policy}: {r.description}", "yes" if r.reference else ""]
            cells += [_fmt(r.scores.get(m)) for m in order]
            cells += [f"{_fmt(r.mean_active_layers)}/{r.num_layers}", _fmt(r.theoretical_speedup) + "x",
                      _fmt(r.tokens_per_second, 1), _fmt(r.wallclock_speedup) + "x", _fmt(r.decode_speedup) + "x",
                      str(r.batch_size)]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines += [
            "",
            "Theoretical speedup = L x decode steps / layers run, summed over all batches (prefill and "
            "token 0 at full depth excluded). Wall-clock speedup = tokens/s over the same model's "
            "full-depth reference row (`ref`) at the same batch size, measured in this run (outputs of "
            "other lengths change tokens per batch step); decode-step speedup = ratio of mean "
            "decode-step times, the wall-clock counterpart of the theoretical speedup.",
        ]
        calm = [r for r in self.rows if r.kind == "calm"]
        if calm:
            lines.append(
                "CALM rows: layers run = layers used to compute each token (its exit layer); the skipped "
                "upper layers still run on the exit state to fill their KV cache (state propagation), so "
                "layers executed / head evaluations: "
                + "; ".join(f"{r.model} {r.policy}: {r.compute_layers} layers executed "
                            f"(compute speedup {_fmt(r.compute_speedup)}x), {r.head_evals} exit heads"
                            for r in calm)
                + "."
            )
        return "\n".join(lines) + "\n"

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
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        metric = self.meta.get("quality_metric", "bleu")
        front = [self.row(m, p) for m, p in frontier] if frontier else []
        fig = Figure(figsize=(7.5, 5), dpi=120)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        models = list(dict.fromkeys(r.model for r in self.rows))
        colors = {m: f"C{i % 10}" for i, m in enumerate(models)}
        if front:
            ax.plot([r.theoretical_speedup for r in front], [r.scores.get(metric) for r in front], "-",
                    color="black", lw=2.5, alpha=0.35, zorder=1, label="SkipDecode frontier")
        for model in models:
            color = colors[model]
            rows = [r for r in self.rows if r.model == model and r.scores.get(metric) is not None]
            # a second full-depth row at batch 1 only serves as CALM's reference: same point as "full"
            rows = [r for r in rows if not (r.reference and r.policy != "full")]
            rows.sort(key=lambda r: r.theoretical_speedup)
            line = [r for r in rows if r.kind != "calm"]
            ax.plot([r.theoretical_speedup for r in line], [r.scores[metric] for r in line],
                    "o" if front else "-o", color=color, label=model)
            for r in rows:
                q = r.scores[metric]
                marker = "^" if r.kind == "calm" else "s"
                if r.kind == "calm":
                    ax.plot([r.theoretical_speedup], [q], marker, color=color)
                if not r.reference and not math.isnan(r.decode_speedup):
                    ax.plot([r.theoretical_speedup, r.decode_speedup], [q, q], ":", color=color, lw=1)
                    ax.plot([r.decode_speedup], [q], marker, mfc="none", color=color)
                ax.annotate(f"{r.model} {r.policy}" if front else r.policy, (r.theoretical_speedup, q),
                            textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        handles, _ = ax.get_legend_handles_labels()
        handles += [
            Line2D([], [], marker="o", color="gray", ls="", label="theoretical (compute) speedup"),
            Line2D([], [], marker="s", mfc="none", color="gray", ls="", label="measured decode-step speedup"),
        ]
        if any(r.kind == "calm" for r in self.rows):
            handles.append(Line2D([], [], marker="^", color="gray", ls="", label="CALM (batch 1)"))
        ax.legend(handles=handles, fontsize=8, loc="best")
        ax.set_xlabel("speedup over the same model at full depth (x)")
        ax.set_ylabel(_METRIC_LABELS.get(metric, metric))
        data = self.meta.get("data")
        where = f": {Path(str(data)).name}" if data else ""
        ax.set_title(f"{_METRIC_LABELS.get(metric, metric)} vs speedup{where} ({self.meta.get('n_items', '?')} items)",
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, format="png")
        return path

    def save(self, out_dir: str | os.PathLike, name: str = "eval",
             frontier: Sequence[tuple[str, str]] | None = None) -> dict[str, Path]:
        """Write ``{name}.json``, ``{name}.md`` and ``{name}.png`` into ``out_dir`` (created).

        ``frontier`` goes to :meth:`plot`.

        Returns:
            ``{"json": path, "md": path, "png": path}``.
        Raises:
            OSError: the folder cannot be created or written.
            KeyError: a ``frontier`` row is not in the report.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / f"{name}.json", "md": out / f"{name}.md", "png": out / f"{name}.png"}
        tmp = paths["json"].with_suffix(".json.tmp")
        tmp.write_text(dumps(self.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, paths["json"])
        paths["md"].write_text(self.to_markdown(), encoding="utf-8")
        self.plot(paths["png"], frontier=frontier)
        return paths


def combine_reports(reports: Sequence[Report]) -> Report:
    """Join the rows of several reports on the same items into one (one table, one plot).

    Used to show batch-1 CALM rows beside the batched SkipDecode rows of a separate run. A row of a
    later report whose (model, policy) already exists is renamed ``policy@bsN`` (N its batch size),
    as :func:`evaluate` names a second reference row, and its report's ``reference_policy`` links
    follow. ``meta`` is the first report's, with ``meta['combined']`` listing every report's
    command, date and ``n_items``.

    Raises:
        ValueError: no reports, reports on different data or numbers of items (names both), or a
            row name that stays ambiguous after renaming.
    """
    if not reports:
        raise ValueError("combine_reports needs at least one report")
    first = reports[0]
    rows = [replace(r) for r in first.rows]
    taken = {(r.model, r.policy) for r in rows}
    for k, rep in enumerate(reports[1:], start=1):
        for key in ("n_items", "data", "task"):
            if rep.meta.get(key) != first.meta.get(key):
                raise ValueError(f"reports[{k}] has {key}={rep.meta.get(key)!r} but reports[0] has "
                                 f"{first.meta.get(key)!r}: only reports on the same items can be combined")
        renamed = {}
        for r in rep.rows:
            if (r.model, r.policy) in taken:
                new = f"{r.policy}@bs{r.batch_size}"
                if (r.model, new) in taken:
                    raise ValueError(f"row ({r.model!r}, {r.policy!r}) of reports[{k}] clashes with an existing row")
                renamed[(r.model, r.policy)] = new
        for r in rep.rows:
            r2 = replace(r, policy=renamed.get((r.model, r.policy), r.policy),
                         reference_policy=renamed.get((r.model, r.reference_policy), r.reference_policy))
            rows.append(r2)
            taken.add((r2.model, r2.policy))
    meta = dict(first.meta)
    meta["combined"] = [{"command": r.meta.get("command"), "date": r.meta.get("date"),
                         "n_items": r.meta.get("n_items")} for r in reports]
    return Report(rows=rows, items=list(first.items), meta=meta)


_SUMMED = ("n_items", "decode_steps", "layers_run", "compute_layers", "head_evals", "new_tokens",
           "generation_seconds", "prefill_seconds", "decode_seconds")


def concat_reports(reports: Sequence[Report]) -> Report:
    """Join reports of the same runs over *disjoint* item ranges (shards) into one report.

    For an evaluation too long for one sitting (e.g. batch-1 CALM rows): run it in shards with
    ``--offset``/``--limit``, then join. Rows are matched by (model, policy); counts, tokens and
    seconds are summed, generations concatenated in report order, and the derived figures
    (speedups against each model's reference row) and the scores (the task's metrics over all
    items, corpus-level) recomputed, so the result equals one run over all items up to timing
    noise. ``meta`` is the first report's with ``n_items`` updated and ``meta['shards']``
    listing every report's command, date and ``n_items``.

    Raises:
        ValueError: no reports; different data, task, batch size or rows (names them); an item
            (same prompt) in two reports.
    """
    if not reports:
        raise ValueError("concat_reports needs at least one report")
    first = reports[0]
    keys = [(r.model, r.policy) for r in first.rows]
    for k, rep in enumerate(reports[1:], start=1):
        for key in ("data", "task", "batch_size", "max_new_tokens"):
            if rep.meta.get(key) != first.meta.get(key):
                raise ValueError(f"reports[{k}] has {key}={rep.meta.get(key)!r} but reports[0] has "
                                 f"{first.meta.get(key)!r}: only shards of the same run can be joined")
        other = [(r.model, r.policy) for r in rep.rows]
        if other != keys:
            raise ValueError(f"reports[{k}] has rows {other} but reports[0] has {keys}")
    items = [it for rep in reports for it in rep.items]
    seen: set[str] = set()
    for it in items:
        if it.get("prompt") in seen:
            raise ValueError(f"item {it.get('prompt')!r:.80} is in more than one report: shards must be disjoint")
        seen.add(it.get("prompt"))
    rows = []
    for i in range(len(keys)):
        parts = [rep.rows[i] for rep in reports]
        row = replace(parts[0], generations=[g for p in parts for g in p.generations],
                      finish_reasons=[f for p in parts for f in p.finish_reasons])
        for name in _SUMMED:
            setattr(row, name, sum(getattr(p, name) for p in parts))
        rows.append(row)
    for model in dict.fromkeys(r.model for r in rows):
        _finish_rows([r for r in rows if r.model == model])
    meta = dict(first.meta)
    meta["n_items"] = len(items)
    meta["shards"] = [{"command": r.meta.get("command"), "date": r.meta.get("date"),
                       "n_items": r.meta.get("n_items")} for r in reports]
    report = Report(rows=rows, items=items, meta=meta).rescore(first.meta.get("metrics"))
    # Scoring the joined items is part of joining, not a rescoring of stored results: keep
    # ``meta['rescored']`` only where the first shard carried one.
    if "rescored" in first.meta:
        report.meta["rescored"] = first.meta["rescored"]
    else:
        report.meta.pop("rescored", None)
    return report


ModelLike = Any  # SkipModel or a zero-argument callable returning one


def _model_entries(models: Any) -> list[tuple[str, ModelLike]]:
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


def _device_of(model) -> str:
    try:
        dev = next(model.model.parameters()).device
    except (StopIteration, AttributeError):
        return "cpu"
    if dev.type == "cuda":
        import torch

        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return str(dev)


def _unpermute(values: list, order: list[int]) -> list:
    """Return ``values`` (``values[k]`` belongs to item ``order[k]``) in item order."""
    out: list = [None] * len(order)
    for k, i in enumerate(order):
        out[i] = values[k]
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
    from .calm import CalmConfig, calm_generate

    start_run = time.perf_counter()
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    spec = TASKS[task]
    items = list(items)
    if not items:
        raise ValueError("items is empty: nothing to evaluate")
    for i, it in enumerate(items):
        if not getattr(it, "references", None):
            raise ValueError(f"items[{i}] has no reference; every item needs at least one to be scored")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    max_new_tokens = spec.max_new_tokens if max_new_tokens is None else max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    stop = tuple(spec.stop if stop is None else check_stop(stop))  # refused, not dropped: skipdecode.limits
    metrics = tuple(spec.metrics if metrics is None else metrics)
    if not metrics:
        raise ValueError("metrics is empty; choose from " + ", ".join(METRICS))
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(map(repr, unknown))}; known: {', '.join(METRICS)}")
    quality = spec.quality_metric if spec.quality_metric in metrics else metrics[0]
    calm_cfgs = [CalmConfig(float(t), calm_min_layers) for t in calm_thresholds]
    entries = _model_entries(models)
    if _is_single_spec(policies):
        policies = [policies]  # one spec given bare
    labels = [label for label, _ in entries]
    if isinstance(policies, Mapping):
        extra = [k for k in policies if k not in labels]
        if extra:
            raise ValueError(f"policies names unknown model(s) {extra}; models: {labels}")
    if calm_models is not None:
        extra = [k for k in calm_models if k not in labels]
        if extra:
            raise ValueError(f"calm_models names unknown model(s) {extra}; models: {labels}")
    order = list(range(len(items)))
    if sort_by_length:
        order.sort(key=lambda i: -len(items[i].prompt))  # stable: ties keep file order
    batches = [[items[j] for j in order[i : i + batch_size]] for i in range(0, len(items), batch_size)]

    bar = None
    done = 0
    rows: list[EvalRow] = []
    model_info: dict[str, dict[str, Any]] = {}
    device = "cpu"
    try:
        for label, entry in entries:
            model = entry if hasattr(entry, "generate") else entry()
            device = _device_of(model)
            model_info[label] = {
                "source": getattr(model, "source", ""), "num_layers": model.num_layers,
                "chat": bool(model.chat if chat is None else chat), "policy": model.policy.to_dict(),
                "model_type": getattr(getattr(model.model, "config", None), "model_type", None),
            }
            model_rows, plans = _plan_rows(
                model, label, policies, horizon, batch_size, calm_cfgs,
                calm_models is None or label in calm_models,
            )
            if bar is None and progress is True:
                # drawn once the first model is loaded and its policies resolved, so that a bad
                # model or policy fails with its message alone, not under a stray empty bar
                from tqdm.auto import tqdm

                bar = tqdm(total=len(entries) * len(batches), unit="batch", desc="eval", file=sys.stderr,
                           dynamic_ncols=True)
            gen_kwargs = dict(max_new_tokens=max_new_tokens, stop=stop, chat=chat)
            if warmup:  # untimed: first calls pay one-off kernel and allocator set-up
                warm = dict(max_new_tokens=min(8, max_new_tokens), stop=stop, chat=chat)
                first = [it.prompt for it in batches[0]]
                for row, plan in zip(model_rows, plans):
                    if row.kind == "calm":
                        calm_generate(model, first[0], threshold=plan.threshold, min_layers=plan.min_layers, **warm)
                    else:
                        model.generate(first[: row.batch_size], policy=plan, **warm)
            if bar is not None:
                bar.set_description(f"eval {label}")
            streamed = [r.kind != "calm" and not (r.batch_size == 1 and batch_size != 1) for r in model_rows]
            if inflight:  # each such row: every item through one in-flight engine
                all_prompts = [items[j].prompt for j in order]
                for row, plan, flag in zip(model_rows, plans, streamed):
                    if flag:
                        t0 = time.perf_counter()
                        res = model.generate(all_prompts, policy=plan, max_batch_size=batch_size, **gen_kwargs)
                        row.add(res, time.perf_counter() - t0)
            for batch in batches:
                prompts = [it.prompt for it in batch]
                for row, plan, flag in zip(model_rows, plans, streamed):
                    if inflight and flag:
                        continue  # ran above
                    if row.kind == "calm":
                        for p in prompts:
                            t0 = time.perf_counter()
                            res = calm_generate(model, p, threshold=plan.threshold, min_layers=plan.min_layers,
                                                **gen_kwargs)
                            row.add(res, time.perf_counter() - t0)
                    elif row.batch_size == 1 and batch_size != 1:
                        for p in prompts:
                            t0 = time.perf_counter()
                            res = model.generate([p], policy=plan, **gen_kwargs)
                            row.add(res, time.perf_counter() - t0)
                    else:
                        t0 = time.perf_counter()
                        res = model.generate(prompts, policy=plan, **gen_kwargs)
                        row.add(res, time.perf_counter() - t0)
                done += 1
                if bar is not None:
                    bar.update(1)
                elif callable(progress):
                    progress(done)
            _finish_rows(model_rows)
            for row in model_rows:  # batches ran in `order`: put outputs back in item order
                row.generations = _unpermute(row.generations, order)
                row.finish_reasons = _unpermute(row.finish_reasons, order)
            rows.extend(model_rows)
            if entry is not model:  # loaded here: release it before the next checkpoint
                del model
                gc.collect()
                _empty_device_cache()
    finally:
        if bar is not None:
            bar.close()

    references = [list(it.references) for it in items]
    for row in rows:
        row.scores = score_all(row.generations, references, metrics)
    meta = {
        "command": command if command is not None else shlex.join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "data": data,
        "task": task,
        "metrics": list(metrics),
        "quality_metric": quality,
        "n_items": len(items),
        "batch_size": batch_size,
        "sort_by_length": bool(sort_by_length),
        "inflight": bool(inflight),
        "max_new_tokens": max_new_tokens,
        "stop": list(stop),
        "models": model_info,
        "device": device,
        "platform": platform.platform(),
        "seconds": time.perf_counter() - start_run,
    }
    item_dicts = [{"prompt": it.prompt, "references": list(it.references), "source": it.source} for it in items]
    from .paths import portable_record  # reports name no machine-specific paths

    return Report(rows=rows, items=portable_record(item_dicts), meta=portable_record(meta))


def _is_single_spec(x: Any) -> bool:
    """True for one :data:`PolicySpec` (a policy dict has a ``type`` key; a label mapping has not)."""
    if isinstance(x, Mapping):
        return "type" in x
    return isinstance(x, (str, int, float)) or hasattr(x, "active_layers")


def _plan_rows(model, label, policies, horizon, batch_size, calm_cfgs, with_calm):
    """Rows (reference first) and the policy/CALM config each one runs, for one model."""
    if isinstance(policies, Mapping):
        specs = policies.get(label, ["checkpoint"])
        specs = [specs] if _is_single_spec(specs) else list(specs)
    elif policies is None:
        specs = ["checkpoint"]
    else:
        specs = list(policies)
    resolved: list[tuple[str, Any]] = [("full", FullPolicy(model.num_layers))]
    for s in specs:
        name, pol = resolve_policy(model, s, horizon=horizon)
        for i, (n, p) in enumerate(resolved):
            if p.to_dict() == pol.to_dict():
                if name not in n.split(" = ") and name != "full":
                    resolved[i] = (f"{n} = {name}" if n != "full" else n, p)
                break
        else:
            resolved.append((name, pol))
    rows, plans = [], []
    for name, pol in resolved:
        rows.append(EvalRow(
            model=label, policy=name, policy_config=pol.to_dict(), description=_policy_summary(pol),
            kind="skipdecode", reference=name == "full", reference_policy="full", batch_size=batch_size,
            num_layers=model.num_layers,
        ))
        plans.append(pol)
    if with_calm and calm_cfgs:
        ref1 = "full"
        if batch_size != 1:
            ref1 = "full@bs1"
            pol = FullPolicy(model.num_layers)
            rows.append(EvalRow(
                model=label, policy=ref1, policy_config=pol.to_dict(),
                description=_policy_summary(pol) + ", batch 1 (CALM's reference)", kind="skipdecode",
                reference=True, reference_policy=ref1, batch_size=1, num_layers=model.num_layers,
            ))
            plans.append(pol)
        for cfg in calm_cfgs:
            if cfg.min_layers > model.num_layers:
                raise ValueError(f"calm_min_layers must be <= the model's {model.num_layers} layers, got {cfg.min_layers}")
            rows.append(EvalRow(
                model=label, policy=f"calm@{cfg.threshold:g}", policy_config=cfg.to_dict(),
                description=_policy_summary(cfg), kind="calm", reference=False, reference_policy=ref1,
                batch_size=1, num_layers=model.num_layers,
            ))
            plans.append(cfg)
    return rows, plans


def _finish_rows(rows: list[EvalRow]) -> None:
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
