"""Hugging Face ``datasets`` names (``name`` or ``name:config``) as a data source: rows, column
aliases and the task a hub dataset's columns imply. Used only when ``datasets`` is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .records import DataError, EvalItem, ReadResult
from .folder import missing_file_message
from .rows import _convert, _field_str, _Rows
from .templates import format_prompt


def _datasets_available() -> bool:
    return importlib.util.find_spec("datasets") is not None


def _hub_rows(spec: str, split: str) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    looks_like_file = (Path(spec).suffix.lower() in (".csv", ".jsonl", ".json", ".txt")
                       or Path(spec).expanduser().is_absolute())
    if looks_like_file:
        raise DataError(missing_file_message(spec), path=spec)
    if not _datasets_available():
        raise DataError(
            "file does not exist (and it cannot be read as a Hugging Face dataset name: "
            "hub names need `pip install datasets`)", path=spec)
    import datasets  # noqa: PLC0415 - optional dependency

    name, _, config = str(spec).partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # the hub raises many types; report them uniformly
        raise DataError(f"could not load Hugging Face dataset (split {split!r}): {e}",
                        path=spec) from e
    label = f"{spec}[{split}]"
    return label, [(i, dict(r)) for i, r in enumerate(ds, start=1)]


#: Column aliases used for hub datasets (first present wins).
_HUB_ALIASES = {
    "mr": ("mr", "meaning_representation"),
    "ref": ("ref", "human_reference", "target"),
}


def _hub_normalise(rows: list[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    out = []
    for n, r in rows:
        r = dict(r)
        for canon, aliases in _HUB_ALIASES.items():
            if canon not in r:
                for a in aliases:
                    if a in r:
                        r[canon] = r[a]
                        break
        out.append((n, r))
    return out


def _hub_task(keys: set[str], task: str | None) -> str:
    if task is not None:
        return task
    if "article" in keys:
        return "cnndm"
    if "mr" in keys:
        return "e2e"
    return "plain"



def _hub_source(spec: str, split: str, task: str | None, skip_bad_rows: bool
                ) -> tuple[str, list[tuple[int, dict[str, Any]]], _Rows]:
    """(task, normalised rows, bad-row collector) of the hub dataset ``spec``, split ``split``.

    Raises:
        DataError: as :func:`_hub_rows`.
    """
    label, rows = _hub_rows(spec, split)
    rows = _hub_normalise(rows)
    t = _hub_task(set(rows[0][1]) if rows else set(), task)
    return t, rows, _Rows(label, skip_bad_rows, unit="row")


def _hub_e2e_eval(rows: list[tuple[int, dict[str, Any]]], collector: _Rows, task: str) -> ReadResult:
    """E2E-style hub rows (``mr``, ``ref``) grouped by MR into :class:`EvalItem` s, like the CSV
    reader.

    Raises:
        DataError: no usable rows, or (unless skipping) the first row without ``mr``/``ref``.
    """
    def mr_ref(rec: Mapping[str, Any]) -> tuple[str, str]:
        expected = ("mr", "ref")
        return _field_str(rec, "mr", expected).strip(), _field_str(rec, "ref", expected)

    groups: dict[str, list[str]] = {}
    for mr, ref in _convert(rows, collector, mr_ref):
        groups.setdefault(mr, []).append(ref)
    items = [EvalItem(prompt=format_prompt(task, mr=mr), references=tuple(refs), source=mr)
             for mr, refs in groups.items()]
    return collector.result(items, "rows")
