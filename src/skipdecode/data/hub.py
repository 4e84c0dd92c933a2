"""Hugging Face ``datasets`` names (``name`` or ``name:config``) as a data source: rows, column
aliases and the task a hub dataset's columns imply. Used only when ``datasets`` is installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from .records import DataError


def _datasets_available() -> bool:
    return importlib.util.find_spec("datasets") is not None


def _hub_rows(spec: str, split: str) -> tuple[str, list[tuple[int, dict[str, Any]]]]:
    looks_like_file = (Path(spec).suffix.lower() in (".csv", ".jsonl", ".json", ".txt")
                       or Path(spec).expanduser().is_absolute())
    if looks_like_file:
        raise DataError("file does not exist", path=spec)
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

