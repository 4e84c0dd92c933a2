"""Joining saved evaluation reports: :func:`combine_reports` puts the rows of runs on the same
items side by side (e.g. batch-1 CALM rows beside batched SkipDecode rows); :func:`concat_reports`
joins shards of one run over disjoint item ranges into the report of one run over all items."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .eval_report import Report, finish_rows

__all__ = ["combine_reports", "concat_reports"]


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
    return _refresh_baseline(Report(rows=rows, items=list(first.items), meta=meta))


_SUMMED = ("n_items", "decode_steps", "layers_run", "compute_layers", "head_evals", "new_tokens",
           "prompt_tokens", "cached_prompt_tokens", "generation_seconds", "prefill_seconds", "decode_seconds")


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
        finish_rows([r for r in rows if r.model == model])
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
    return _refresh_baseline(report)


def _refresh_baseline(report: Report) -> Report:
    """Recompute ``meta['against_baseline']`` from the joined rows (the first report's numbers are
    stale); drop both baseline keys when the baseline row is not among them. Returns ``report``."""
    base = report.meta.get("baseline")
    if isinstance(base, dict) and "against_baseline" in report.meta:
        try:
            report.set_baseline(base.get("model"), base.get("policy", "full"))
        except KeyError:
            report.meta.pop("baseline", None)
            report.meta.pop("against_baseline", None)
    return report
