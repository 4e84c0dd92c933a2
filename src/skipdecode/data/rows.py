"""Low-level reading shared by every reader: file checks, UTF-8 decoding, CSV and JSONL rows with
their line numbers, the per-row problem collector (:class:`_Rows`: raise at once, or skip and
count), and the conversion of one record (JSONL line or hub row) into a prompt and its fields.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .records import DataError, ReadResult
from .templates import _template, format_prompt, template_fields

#: one logger for the whole data package (``skipdecode.data``), as before the split
log = logging.getLogger(__package__)


class _Rows:
    """Collects per-row problems: raises at once, or records them when skipping."""

    def __init__(self, path: str, skip_bad_rows: bool, unit: str = "line") -> None:
        self.path = path
        self.skip = skip_bad_rows
        self.unit = unit
        self.skipped: list[str] = []

    def bad(self, line: int, message: str) -> None:
        if self.unit == "line":
            err = DataError(message, path=self.path, line=line)
        else:  # hub datasets: rows, not lines
            err = DataError(f"row {line}: {message}", path=self.path)
        if not self.skip:
            raise err
        log.warning("skipping bad row: %s", err)
        self.skipped.append(str(err))

    def result(self, items: list[Any], what: str) -> ReadResult:
        if not items:
            detail = f" ({self.n_skipped_text()})" if self.skipped else ""
            raise DataError(f"no usable {what} found{detail}", path=self.path)
        if self.skipped:
            log.warning("%s: skipped %d bad row(s)", self.path, len(self.skipped))
        return ReadResult(items, path=self.path, skipped=self.skipped)

    def n_skipped_text(self) -> str:
        return f"{len(self.skipped)} bad row(s) skipped; first: {self.skipped[0]}"


def _check_file(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError("file does not exist", path=p)
    if not p.is_file():
        raise DataError("not a regular file", path=p)
    return p


def _decode(p: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"not valid UTF-8 ({e.reason} at byte {e.start})",
                        path=p, line=line) from None


def _iter_csv(p: Path, required: Sequence[str], optional: Sequence[str] = ()
              ) -> Iterator[tuple[int, dict[str, str] | str]]:
    """Yield ``(line_of_record_start, row_dict | problem_message)`` for each data record.

    Header names are matched case-insensitively after stripping whitespace; the dicts are keyed
    by the lower-case *required*/*optional* names. A missing required column raises.
    """
    text = _decode(p, p.read_bytes())
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        while header is not None and not header:  # leading blank lines
            header = next(reader, None)
    except csv.Error as e:
        raise DataError(f"malformed CSV header: {e}", path=p, line=reader.line_num) from None
    if header is None:
        raise DataError(
            f"file is empty; expected a CSV header with columns {', '.join(required)}", path=p)
    names = [h.strip().lower() for h in header]
    missing = [c for c in required if c not in names]
    if missing:
        raise DataError(
            f"missing column(s) {', '.join(repr(c) for c in missing)}; "
            f"found columns: {', '.join(repr(h) for h in header)}; "
            f"expected columns: {', '.join(repr(c) for c in required)}",
            path=p, line=reader.line_num)
    index = {c: names.index(c) for c in (*required, *optional) if c in names}
    prev = reader.line_num
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise DataError(f"malformed CSV ({e})", path=p, line=prev + 1) from None
        start, prev = prev + 1, reader.line_num
        if not row or all(not f.strip() for f in row):  # blank line
            continue
        if len(row) != len(header):
            yield start, (f"expected {len(header)} fields ({', '.join(header)}), "
                          f"found {len(row)}")
            continue
        yield start, {c: row[i] for c, i in index.items()}


def _iter_jsonl(p: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield ``(line_number, record | problem_message)`` for each non-blank line."""
    raw = p.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    for n, bline in enumerate(raw.split(b"\n"), start=1):
        try:
            line = bline.decode("utf-8")
        except UnicodeDecodeError as e:
            yield n, f"not valid UTF-8 ({e.reason} at byte {e.start} of the line)"
            continue
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            yield n, f"invalid JSON ({e.msg} at column {e.colno}); expected one JSON object per line"
            continue
        if not isinstance(rec, dict):
            yield n, f"expected a JSON object, found {type(rec).__name__}"
            continue
        yield n, rec


def _field_str(rec: Mapping[str, Any], key: str, expected: Sequence[str]) -> str:
    """``rec[key]`` as a non-empty string, else raise ``_RowProblem``."""
    if key not in rec:
        raise _RowProblem(
            f"missing key {key!r}; found keys: {', '.join(map(repr, rec)) or 'none'}; "
            f"expected keys: {', '.join(map(repr, expected))}")
    value = rec[key]
    if not isinstance(value, str):
        raise _RowProblem(f"{key!r} must be a string, found {type(value).__name__}")
    if not value.strip():
        raise _RowProblem(f"empty {key!r}")
    return value


def _references(rec: Mapping[str, Any], key: str, expected: Sequence[str]) -> tuple[str, ...]:
    if key not in rec:
        raise _RowProblem(
            f"missing key {key!r}; found keys: {', '.join(map(repr, rec)) or 'none'}; "
            f"expected keys: {', '.join(map(repr, expected))}")
    value = rec[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _RowProblem(
            f"{key!r} must be a string or a list of strings, found {type(value).__name__}")
    refs = []
    for i, r in enumerate(value):
        if not isinstance(r, str):
            raise _RowProblem(f"{key}[{i}] must be a string, found {type(r).__name__}")
        refs.append(r)
    if not refs or not any(r.strip() for r in refs):
        raise _RowProblem(f"{key!r} has no non-empty reference")
    return tuple(refs)


class _RowProblem(Exception):
    pass


def _prompt_from_record(task: str, rec: Mapping[str, Any], extra: Sequence[str]
                        ) -> tuple[str, str]:
    """(formatted prompt, source) from a record holding the template's fields."""
    fields = template_fields(task)
    expected = (*fields, *extra)
    values = {f: _field_str(rec, f, expected) for f in fields}
    prompt = format_prompt(task, **values)
    source = values[fields[0]] if len(fields) == 1 else prompt
    return prompt, source


def _convert(rows: Iterable[tuple[int, Any]], collector: _Rows,
             convert: Callable[[Mapping[str, Any]], Any]) -> list[Any]:
    out = []
    for n, rec in rows:
        if isinstance(rec, str):
            collector.bad(n, rec)
            continue
        try:
            out.append(convert(rec))
        except _RowProblem as e:
            collector.bad(n, str(e))
    return out



def _read_jsonl(path: str | os.PathLike, task: str, skip_bad_rows: bool,
                converter: Callable[[str], Callable[[Mapping[str, Any]], Any]]) -> ReadResult:
    """Read a JSONL file, one record per non-blank line, through ``converter(task)``.

    Raises:
        DataError: missing file, unknown task, no usable records, or (unless ``skip_bad_rows``)
        the first bad line.
    """
    p = _check_file(path)
    _template(task)
    rows = _Rows(str(p), skip_bad_rows)
    return rows.result(_convert(_iter_jsonl(p), rows, converter(task)), "records")
