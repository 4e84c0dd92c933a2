"""Dispatch: :func:`load_examples` and :func:`load_eval_items` pick the reader from a file's type
and contents (or read a hub dataset), and :func:`select_items` takes a shard of the result.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cnndm import _cnndm_eval, _cnndm_pair, read_cnndm, read_cnndm_pairs
from .e2e import read_e2e_eval, read_e2e_pairs
from .folder import default_data_dir
from .hub import _hub_e2e_eval, _hub_source
from .jsonl import _eval_converter, _pair_converter, read_jsonl_eval, read_jsonl_pairs
from .records import DataError, ReadResult
from .rows import _convert, _iter_jsonl


def _first_jsonl_keys(p: Path) -> set[str]:
    for _, rec in _iter_jsonl(p):
        if isinstance(rec, dict):
            return set(rec)
        return set()
    return set()


def _resolve_file(spec: str | os.PathLike) -> Path | None:
    """An existing path for ``spec``: as given, else relative to :func:`default_data_dir`."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    if not p.is_absolute():
        root = default_data_dir()
        if root is not None and (root / p).exists():
            return root / p
    return None


def check_data_file(spec: str | os.PathLike) -> None:
    """Refuse, before any long work, a ``spec`` that names a local folder: the readers take one
    ``.csv`` (E2E) or ``.jsonl`` file (a relative path is also looked up under
    :func:`default_data_dir`, as :func:`load_examples` does). Anything else passes: a file is
    checked when read, a name that is no local path may be a Hugging Face dataset.

    Raises:
        DataError: ``spec`` is a folder (the error's ``path`` is the folder).
    """
    p = _resolve_file(spec)
    if p is not None and p.is_dir():
        raise DataError("is a folder; give a .csv (E2E) or .jsonl file", path=p)


def _read_file(p: Path, task: str | None, skip_bad_rows: bool,
               readers: tuple[Callable[..., ReadResult], ...]) -> ReadResult:
    """Read an existing file with ``readers`` = (E2E CSV, CNN/DM JSONL, other JSONL), chosen by
    the suffix and, for JSONL, by an ``article`` key in the first record.

    Raises:
        DataError: a suffix other than ``.csv``/``.jsonl``, or any reader error.
    """
    csv_reader, cnndm_reader, jsonl_reader = readers
    check_data_file(p)
    suffix = p.suffix.lower()
    if suffix == ".csv":
        return csv_reader(p, task=task or "e2e", skip_bad_rows=skip_bad_rows)
    if suffix == ".jsonl":
        if "article" in _first_jsonl_keys(p):
            return cnndm_reader(p, task=task or "cnndm", skip_bad_rows=skip_bad_rows)
        return jsonl_reader(p, task=task or "plain", skip_bad_rows=skip_bad_rows)
    raise DataError(f"unsupported file type {p.suffix!r}; expected .csv (E2E) or .jsonl",
                    path=p)


def load_examples(spec: str | os.PathLike, *, task: str | None = None, split: str = "train",
                  skip_bad_rows: bool = False) -> ReadResult:
    """Load training pairs from a file or a Hugging Face dataset name.

    Dispatch: ``.csv`` -> :func:`read_e2e_pairs` (task default ``"e2e"``); ``.jsonl`` with an
    ``article`` key -> :func:`read_cnndm_pairs` (``"cnndm"``); other ``.jsonl`` ->
    :func:`read_jsonl_pairs` (``"plain"``). A relative path that does not exist is also looked
    up under :func:`default_data_dir`. ``split`` is used only for hub datasets, whose columns may
    be ``prompt``/``response``, ``mr``/``ref`` (or ``meaning_representation``/
    ``human_reference``) or ``article``/``highlights``.

    Raises:
        DataError: unsupported extension, a path that does not exist while ``datasets`` is not
        installed, hub load failure, or any reader error.
    """
    p = _resolve_file(spec)
    if p is not None:
        return _read_file(p, task, skip_bad_rows, (read_e2e_pairs, read_cnndm_pairs, read_jsonl_pairs))
    t, rows, collector = _hub_source(str(spec), split, task, skip_bad_rows)
    if t == "cnndm":
        conv = _cnndm_pair(t)
    elif t == "e2e":
        conv = _pair_converter(t, "ref")
    else:
        conv = _pair_converter(t)
    return collector.result(_convert(rows, collector, conv), "rows")


def load_eval_items(spec: str | os.PathLike, *, task: str | None = None, split: str = "test",
                    skip_bad_rows: bool = False) -> ReadResult:
    """Load evaluation items from a file or a Hugging Face dataset name.

    Dispatch: ``.csv`` -> :func:`read_e2e_eval` (grouped by MR); ``.jsonl`` with an
    ``article`` key -> :func:`read_cnndm`; other ``.jsonl`` -> :func:`read_jsonl_eval`.
    Relative paths are also looked up under :func:`default_data_dir`. Hub datasets (used only
    when ``spec`` is not an existing file and ``datasets`` is installed) are read with ``split``;
    E2E-style hub rows are grouped by MR like the CSV reader.

    Raises:
        DataError: as :func:`load_examples`.
    """
    p = _resolve_file(spec)
    if p is not None:
        return _read_file(p, task, skip_bad_rows, (read_e2e_eval, read_cnndm, read_jsonl_eval))
    t, rows, collector = _hub_source(str(spec), split, task, skip_bad_rows)
    if t == "cnndm":
        return collector.result(_convert(rows, collector, _cnndm_eval(t)), "rows")
    if t == "e2e":
        return _hub_e2e_eval(rows, collector, t)
    return collector.result(_convert(rows, collector, _eval_converter(t)), "rows")


def select_items(items: Sequence[Any], offset: int = 0, limit: int | None = None, source: str = "") -> list[Any]:
    """``items[offset:offset + limit]`` (a shard of an evaluation set; all from ``offset`` if no limit).

    Raises:
        ValueError: ``offset`` < 0, ``limit`` < 1, or ``offset`` skips every item (names ``source``).
    """
    if offset < 0:
        raise ValueError(f"--offset must be >= 0, got {offset}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    chosen = list(items)[offset:]
    if not chosen:
        raise ValueError(f"--offset {offset} skips every item of {source}")
    return chosen[:limit] if limit else chosen
