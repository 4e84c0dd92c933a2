"""What a :class:`~skipdecode.eval_report.Report` looks like to a reader: the Markdown table
(:func:`report_markdown`, behind :meth:`Report.to_markdown`) and the quality-against-speedup plot
(:func:`plot_report`, behind :meth:`Report.plot`; matplotlib's Agg canvas, no pyplot state)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .eval_report import EvalRow, Report

__all__ = ["METRIC_LABELS", "report_markdown", "plot_report"]

#: Display name of each metric of :data:`skipdecode.metrics.METRICS` (table heads, plot axis).
METRIC_LABELS = {"bleu": "BLEU", "rougeL": "ROUGE-L", "chrf": "chrF", "nist": "NIST", "rouge1": "ROUGE-1",
                 "rouge2": "ROUGE-2"}

_SPEED_NOTE = (
    "Theoretical speedup = L x decode steps / layers run, summed over all batches (prefill and "
    "token 0 at full depth excluded). Wall-clock speedup = tokens/s over the same model's "
    "full-depth reference row (`ref`) at the same batch size, measured in this run (outputs of "
    "other lengths change tokens per batch step); decode-step speedup = ratio of mean "
    "decode-step times, the wall-clock counterpart of the theoretical speedup."
)


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _x(x: Any) -> str:
    """A speedup cell: ``1.23x``, or ``n/a`` (no unit) when there is no value."""
    text = _fmt(x)
    return text if text == "n/a" else text + "x"


def _run_line(meta: dict[str, Any]) -> str:
    """The commands (every joined report's, each distinct one once), device, date and package
    versions of a report."""
    commands = [c.get("command", "") for c in meta.get("combined") or meta.get("shards") or [meta]]
    return (
        " + ".join(f"`{c}`" for c in dict.fromkeys(commands))
        + (f", then `{meta['post_command']}`" if meta.get("post_command") else "")
        + f" on {meta.get('device', '?')}, {meta.get('date', '')}; "
        + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    )


def _calm_note(calm: list[EvalRow]) -> str:
    """What the layer counts of CALM rows mean, with each row's executed layers and exit heads."""
    return (
        "CALM rows: layers run = layers used to compute each token (its exit layer); the skipped "
        "upper layers still run on the exit state to fill their KV cache (state propagation), so "
        "layers executed / head evaluations: "
        + "; ".join(f"{r.model} {r.policy}: {r.compute_layers} layers executed "
                    f"(compute speedup {_fmt(r.compute_speedup)}x), {r.head_evals} exit heads"
                    for r in calm)
        + "."
    )


def _baseline_lines(report: Report) -> list[str]:
    """The table of :meth:`Report.against` for ``meta['baseline']`` (``{"model", "policy"}``),
    then a blank line; nothing when the report names no baseline or it is not among the rows."""
    base = report.meta.get("baseline")
    if not isinstance(base, dict):
        return []
    try:
        rows = report.against(base.get("model"), base.get("policy", "full"))
    except KeyError:
        return []
    lines = ["", f"Against the baseline {base.get('model')} at {base.get('policy', 'full')} (another model's "
             "full-depth row; ratios as in the table above, across models):", "",
             "| model | policy | tokens per item | theor. speedup | wall-clock speedup | decode-step speedup "
             "| wall / decode-step | time speedup |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["model"], r["policy"], _fmt(r["new_tokens_per_item"], 1), _x(r["theoretical_speedup"]),
                 _x(r["wallclock_speedup"]), _x(r["decode_speedup"]), _fmt(r["wall_over_decode"]),
                 _x(r["time_speedup"])]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines + [""]  # a paragraph right after a table would read as one more row


def report_markdown(report: Report) -> str:
    """The Markdown of :meth:`Report.to_markdown`: a title (data, items, task), the run line
    (commands, device, date, versions), one table line per row (scores of ``meta['metrics']``,
    mean layers of L, theoretical, wall-clock and decode-step speedups (x), tokens/s, batch size;
    NaN shown as ``n/a``), notes on the speedups, the table against ``meta['baseline']`` when the
    report names one (:meth:`Report.against`), and a note on CALM rows when there are any.
    Never raises on a report built by :func:`skipdecode.evaluate.evaluate` or :meth:`Report.load`.
    """
    meta = report.meta
    metrics = list(meta.get("metrics", []))
    order = [m for m in ("bleu", "rougeL", "chrf", "nist", "rouge1", "rouge2") if m in metrics]
    head = (["model", "policy", "ref"] + [METRIC_LABELS[m] for m in order]
            + ["mean layers", "theor. speedup", "tok/s", "wall-clock speedup", "decode-step speedup", "batch"])
    lines = [
        f"# Evaluation: {meta.get('data') or 'items given in Python'} ({meta.get('n_items', '?')} items, "
        f"task {meta.get('task', '?')})",
        "",
        _run_line(meta),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|",
    ]
    for r in report.rows:
        cells = [r.model, f"{r.policy}: {r.description}", "yes" if r.reference else ""]
        cells += [_fmt(r.scores.get(m)) for m in order]
        cells += [f"{_fmt(r.mean_active_layers)}/{r.num_layers}", _x(r.theoretical_speedup),
                  _fmt(r.tokens_per_second, 1), _x(r.wallclock_speedup), _x(r.decode_speedup),
                  str(r.batch_size)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", _SPEED_NOTE]
    lines += _baseline_lines(report)
    calm = [r for r in report.rows if r.kind == "calm"]
    if calm:
        lines.append(_calm_note(calm))
    return "\n".join(lines) + "\n"


def _plot_model(ax, rows: list[EvalRow], metric: str, color: str, label: str, labelled: bool) -> None:
    """One model's points on ``ax``: its SkipDecode rows joined by a line (markers only when
    ``labelled``, i.e. a frontier is drawn), CALM triangles, hollow decode-step markers on dotted
    lines, and a policy label per point (``model policy`` when ``labelled``)."""
    rows = [r for r in rows if r.scores.get(metric) is not None]
    # a second full-depth row at batch 1 only serves as CALM's reference: same point as "full"
    rows = [r for r in rows if not (r.reference and r.policy != "full")]
    rows.sort(key=lambda r: r.theoretical_speedup)
    line = [r for r in rows if r.kind != "calm"]
    ax.plot([r.theoretical_speedup for r in line], [r.scores[metric] for r in line],
            "o" if labelled else "-o", color=color, label=label)
    for r in rows:
        q = r.scores[metric]
        marker = "^" if r.kind == "calm" else "s"
        if r.kind == "calm":
            ax.plot([r.theoretical_speedup], [q], marker, color=color)
        if not r.reference and not math.isnan(r.decode_speedup):
            ax.plot([r.theoretical_speedup, r.decode_speedup], [q, q], ":", color=color, lw=1)
            ax.plot([r.decode_speedup], [q], marker, mfc="none", color=color)
        ax.annotate(f"{r.model} {r.policy}" if labelled else r.policy, (r.theoretical_speedup, q),
                    textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)


def _legend_and_labels(ax, report: Report, metric: str) -> None:
    """Legend (models, marker meanings, CALM when present), axis labels, title and grid."""
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], marker="o", color="gray", ls="", label="theoretical (compute) speedup"),
        Line2D([], [], marker="s", mfc="none", color="gray", ls="", label="measured decode-step speedup"),
    ]
    if any(r.kind == "calm" for r in report.rows):
        handles.append(Line2D([], [], marker="^", color="gray", ls="", label="CALM (batch 1)"))
    ax.legend(handles=handles, fontsize=8, loc="best")
    ax.set_xlabel("speedup over the same model at full depth (x)")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    data = report.meta.get("data")
    where = f": {Path(str(data)).name}" if data else ""
    ax.set_title(f"{METRIC_LABELS.get(metric, metric)} vs speedup{where} ({report.meta.get('n_items', '?')} items)",
                 fontsize=10)
    ax.grid(True, alpha=0.3)


def plot_report(report: Report, path: str | os.PathLike,
                frontier: Sequence[tuple[str, str]] | None = None) -> Path:
    """Write the PNG of :meth:`Report.plot` (quality against theoretical and decode-step speedup,
    x; markers, colours and the optional ``frontier`` of ``(model, policy)`` rows as described
    there) to ``path`` and return it as a :class:`~pathlib.Path`.

    Raises:
        KeyError: a ``frontier`` row is not in the report (the message lists the rows).
        OSError: ``path`` cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metric = report.meta.get("quality_metric", "bleu")
    front = [report.row(m, p) for m, p in frontier] if frontier else []
    fig = Figure(figsize=(7.5, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    models = list(dict.fromkeys(r.model for r in report.rows))
    if front:
        ax.plot([r.theoretical_speedup for r in front], [r.scores.get(metric) for r in front], "-",
                color="black", lw=2.5, alpha=0.35, zorder=1, label="SkipDecode frontier")
    for i, model in enumerate(models):
        _plot_model(ax, [r for r in report.rows if r.model == model], metric, f"C{i % 10}", model, bool(front))
    _legend_and_labels(ax, report, metric)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
