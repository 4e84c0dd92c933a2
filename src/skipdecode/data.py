"""Dataset readers and prompt templates.

Two record types come out of this module:

* :class:`Example` -- a ``(prompt, response)`` training pair (one per CSV row / JSONL line);
* :class:`EvalItem` -- an evaluation input with *all* its references (E2E rows are grouped
  by meaning representation, so one MR gives one item with ~7 references).

Supported inputs (dispatched by :func:`load_examples` / :func:`load_eval_items`):

* ``.csv`` -- E2E NLG files (columns ``mr`` and ``ref``; header names are matched
  case-insensitively, extra columns such as ``fixed``/``orig_mr`` are ignored);
* ``.jsonl`` -- one JSON object per line: ``{"prompt", "response"}`` pairs,
  ``{"prompt", "references"}`` eval items, or CNN/DailyMail records
  (``{"article", "highlights"}``, detected by the ``article`` key);
* anything else that is not an existing file: a Hugging Face ``datasets`` name
  (``name`` or ``name:config``), only when ``datasets`` is installed.

**Return value / skipped rows.** Every reader returns a :class:`ReadResult`, which *is a list*
of records (so it can be used wherever ``list[Example]`` is expected) with two extra
attributes: ``n_skipped`` (number of malformed rows dropped) and ``skipped`` (one message per
dropped row, naming file and line). By default (``skip_bad_rows=False``) the first malformed row
raises :class:`DataError`; with ``skip_bad_rows=True`` malformed rows are dropped, counted and
logged. Problems that concern the whole file (missing file, missing CSV column, broken CSV
quoting, undecodable bytes, no usable rows at all) always raise.

Every :class:`DataError` message starts with ``<file>, line <n>:`` when a line is known.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import logging
import math
import os
import statistics
import string
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DataError",
    "select_items",
    "Example",
    "EvalItem",
    "ReadResult",
    "TEMPLATES",
    "default_data_dir",
    "format_prompt",
    "template_fields",
    "read_e2e_pairs",
    "read_e2e_eval",
    "read_jsonl_pairs",
    "read_jsonl_eval",
    "read_cnndm",
    "read_cnndm_pairs",
    "load_examples",
    "load_eval_items",
    "median_response_tokens",
]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Records and errors
# --------------------------------------------------------------------------------------------


class DataError(ValueError):
    """A data file (or dataset) cannot be read as requested.

    ``path`` and ``line`` (1-based, ``None`` when the problem concerns the whole file) are kept
    as attributes; the message always names the file and, when known, the line.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 line: int | None = None) -> None:
        self.path = None if path is None else str(path)
        self.line = line
        self.reason = message
        prefix = ""
        if self.path is not None:
            prefix = f"{self.path}, line {line}: " if line is not None else f"{self.path}: "
        super().__init__(prefix + message)


@dataclass(frozen=True)
class Example:
    """A training pair: the formatted ``prompt`` and the target ``response`` (plain text).

    The prompt is already passed through the task's template (see :data:`TEMPLATES`); how the
    two strings are joined (separator, EOS) is the tokenisation code's business.
    """

    prompt: str
    response: str


@dataclass(frozen=True)
class EvalItem:
    """An evaluation input.

    ``prompt`` is the formatted model input, ``references`` every gold output for it (in file
    order; empty only when read with ``require_refs=False``), and ``source`` the raw input the
    prompt was built from (the E2E meaning representation, the CNN/DM article, or the plain
    prompt).
    """

    prompt: str
    references: tuple[str, ...]
    source: str


class ReadResult(list):
    """A list of records plus what was skipped while reading them.

    Attributes:
        path: the file (or dataset name) that was read.
        n_skipped: number of malformed rows dropped (always 0 unless ``skip_bad_rows=True``).
        skipped: one message per dropped row, each naming file and line.
    """

    def __init__(self, items: Iterable[Any] = (), *, path: str = "",
                 skipped: Sequence[str] = ()) -> None:
        super().__init__(items)
        self.path = path
        self.skipped: list[str] = list(skipped)

    @property
    def n_skipped(self) -> int:
        """Number of malformed rows that were dropped."""
        return len(self.skipped)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"ReadResult({len(self)} items, n_skipped={self.n_skipped}, path={self.path!r})"


# --------------------------------------------------------------------------------------------
# Data directory
# --------------------------------------------------------------------------------------------


def default_data_dir() -> Path | None:
    """Where the project's shared data lives, or ``None`` if no such folder is found.

    Order: ``$SKIPDECODE_DATA`` if set (returned as given, even if it does not exist);
    else ``../shared/data`` relative to the current working directory if it is a directory;
    else the first ``shared/data`` directory found beside this file's ancestors (i.e. walking up
    from this file, ``<ancestor>/shared/data``), which finds the folder beside the repo root.
    """
    env = os.environ.get("SKIPDECODE_DATA")
    if env:
        return Path(env).expanduser()
    cwd_candidate = Path.cwd().parent / "shared" / "data"
    if cwd_candidate.is_dir():
        return cwd_candidate.resolve()
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


# --------------------------------------------------------------------------------------------
# Prompt templates
# --------------------------------------------------------------------------------------------

#: Prompt templates by task name; ``str.format`` fields are filled by :func:`format_prompt`.
#: Add an entry to register a new task.
TEMPLATES: dict[str, str] = {
    "e2e": "Describe the restaurant in one sentence.\n{mr}\nDescription:",
    "cnndm": "Summarize the article in three sentences.\n{article}\nSummary:",
    "plain": "{prompt}",
}


def template_fields(task: str) -> tuple[str, ...]:
    """The field names (in order of appearance, no duplicates) of ``TEMPLATES[task]``.

    Raises:
        ValueError: unknown task (the message lists the known ones).
    """
    template = _template(task)
    names: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None and field not in names:
            names.append(field)
    return tuple(names)


def format_prompt(task: str, **fields: Any) -> str:
    """Fill the template of ``task`` with ``fields`` (extra fields are ignored).

    Raises:
        ValueError: unknown task, or a field the template needs is missing.
    """
    template = _template(task)
    missing = [f for f in template_fields(task) if f not in fields]
    if missing:
        raise ValueError(
            f"template {task!r} needs field(s) {', '.join(missing)}; "
            f"got {', '.join(sorted(fields)) or 'none'}"
        )
    return template.format(**fields)


def _template(task: str) -> str:
    try:
        return TEMPLATES[task]
    except KeyError:
        raise ValueError(
            f"unknown task {task!r}; known tasks: {', '.join(sorted(TEMPLATES))}"
        ) from None


# --------------------------------------------------------------------------------------------
# Low-level readers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Record conversion (shared by JSONL files and hub datasets)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# E2E (CSV)
# --------------------------------------------------------------------------------------------


def read_e2e_pairs(path: str | os.PathLike, *, task: str = "e2e",
                   skip_bad_rows: bool = False) -> ReadResult:
    """Read an E2E CSV (columns ``mr``, ``ref``) into one :class:`Example` per row.

    ``prompt = format_prompt(task, mr=row.mr)``, ``response = row.ref``. Line numbers in errors
    are those of the first physical line of the CSV record.

    Returns:
        :class:`ReadResult` of :class:`Example` (``.n_skipped`` counts dropped rows).
    Raises:
        DataError: missing file, missing column (lists the columns found and expected), broken
        CSV quoting, empty file / no usable rows, and -- unless ``skip_bad_rows`` -- a row with
        the wrong number of fields or an empty ``mr``/``ref``.
    """
    p = _check_file(path)
    rows = _Rows(str(p), skip_bad_rows)
    out = []
    for n, row in _iter_csv(p, ("mr", "ref")):
        if isinstance(row, str):
            rows.bad(n, row)
            continue
        if not row["mr"].strip():
            rows.bad(n, "empty 'mr'")
            continue
        if not row["ref"].strip():
            rows.bad(n, "empty 'ref'")
            continue
        out.append(Example(prompt=format_prompt(task, mr=row["mr"]), response=row["ref"]))
    return rows.result(out, "rows")


def read_e2e_eval(path: str | os.PathLike, *, task: str = "e2e", skip_bad_rows: bool = False,
                  require_refs: bool = True) -> ReadResult:
    """Read an E2E CSV into one :class:`EvalItem` per unique ``mr``.

    Items are in order of each MR's first appearance; ``references`` holds every ``ref`` of
    that MR in file order (the official multi-reference E2E setting). MRs are compared after
    stripping surrounding whitespace. With ``require_refs=False`` a file without a ``ref`` column
    (e.g. E2E ``testset.csv``, header ``MR``) is accepted and gives empty ``references``.

    Returns:
        :class:`ReadResult` of :class:`EvalItem` (``source`` = the MR).
    Raises:
        DataError: as :func:`read_e2e_pairs`.
    """
    p = _check_file(path)
    rows = _Rows(str(p), skip_bad_rows)
    required = ("mr", "ref") if require_refs else ("mr",)
    groups: dict[str, list[str]] = {}
    for n, row in _iter_csv(p, required, optional=("ref",)):
        if isinstance(row, str):
            rows.bad(n, row)
            continue
        mr = row["mr"].strip()
        if not mr:
            rows.bad(n, "empty 'mr'")
            continue
        ref = row.get("ref")
        if ref is not None and not ref.strip():
            rows.bad(n, "empty 'ref'")
            continue
        refs = groups.setdefault(mr, [])
        if ref is not None:
            refs.append(ref)
    items = [EvalItem(prompt=format_prompt(task, mr=mr), references=tuple(refs), source=mr)
             for mr, refs in groups.items()]
    return rows.result(items, "rows")


# --------------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------------


def _pair_converter(task: str, response_key: str = "response"):
    def convert(rec: Mapping[str, Any]) -> Example:
        prompt, _ = _prompt_from_record(task, rec, (response_key,))
        return Example(prompt=prompt, response=_field_str(
            rec, response_key, (*template_fields(task), response_key)))
    return convert


def _eval_converter(task: str, refs_key: str = "references"):
    def convert(rec: Mapping[str, Any]) -> EvalItem:
        prompt, source = _prompt_from_record(task, rec, (refs_key,))
        refs = _references(rec, refs_key, (*template_fields(task), refs_key))
        return EvalItem(prompt=prompt, references=refs, source=source)
    return convert


def read_jsonl_pairs(path: str | os.PathLike, *, task: str = "plain",
                     skip_bad_rows: bool = False) -> ReadResult:
    """Read ``{"prompt": str, "response": str}`` lines into :class:`Example` records.

    The prompt is ``format_prompt(task, **record)``: with the default ``task="plain"`` that is
    the ``prompt`` value verbatim; with another task the record must hold that template's fields
    (e.g. ``mr`` for ``"e2e"``). Blank lines are ignored; other keys are ignored.

    Raises:
        DataError: missing file, no usable records, and -- unless ``skip_bad_rows`` -- invalid
        JSON, a non-object line, a missing key (lists keys found and expected), a non-string or
        empty value; the message names the file and line.
    """
    p = _check_file(path)
    _template(task)
    rows = _Rows(str(p), skip_bad_rows)
    return rows.result(_convert(_iter_jsonl(p), rows, _pair_converter(task)), "records")


def read_jsonl_eval(path: str | os.PathLike, *, task: str = "plain",
                    skip_bad_rows: bool = False) -> ReadResult:
    """Read ``{"prompt": str, "references": list[str] | str}`` lines into :class:`EvalItem`.

    A single string reference becomes a one-element tuple. ``source`` is the raw value of the
    template's field (the ``prompt`` itself for ``task="plain"``).

    Raises:
        DataError: as :func:`read_jsonl_pairs`; also a references list that is empty, holds a
        non-string, or holds only empty strings.
    """
    p = _check_file(path)
    _template(task)
    rows = _Rows(str(p), skip_bad_rows)
    return rows.result(_convert(_iter_jsonl(p), rows, _eval_converter(task)), "records")


#: Keys accepted as the gold summary of a CNN/DM record, in order of preference.
_CNNDM_REF_KEYS = ("highlights", "summary", "references")


def _cnndm_ref_key(rec: Mapping[str, Any]) -> str:
    for k in _CNNDM_REF_KEYS:
        if k in rec:
            return k
    raise _RowProblem(
        f"missing summary key; found keys: {', '.join(map(repr, rec)) or 'none'}; "
        f"expected 'article' and one of {', '.join(map(repr, _CNNDM_REF_KEYS))}")


def _cnndm_eval(task: str):
    def convert(rec: Mapping[str, Any]) -> EvalItem:
        key = _cnndm_ref_key(rec)
        return _eval_converter(task, key)(rec)
    return convert


def _cnndm_pair(task: str):
    def convert(rec: Mapping[str, Any]) -> Example:
        key = _cnndm_ref_key(rec)
        if key == "references":
            refs = _references(rec, key, ("article", key))
            prompt, _ = _prompt_from_record(task, rec, (key,))
            return Example(prompt=prompt, response=refs[0])
        return _pair_converter(task, key)(rec)
    return convert


def read_cnndm(path: str | os.PathLike, *, task: str = "cnndm",
               skip_bad_rows: bool = False) -> ReadResult:
    """Read CNN/DailyMail JSONL (``article`` + ``highlights``) into :class:`EvalItem` records.

    ``prompt = format_prompt(task, article=...)``, ``references = (highlights,)``,
    ``source = article``. ``summary`` or ``references`` are accepted instead of ``highlights``.
    The project file is ``cnn_dailymail/cnndm_specbench80.jsonl`` (80 articles).

    Raises:
        DataError: as :func:`read_jsonl_eval`.
    """
    p = _check_file(path)
    _template(task)
    rows = _Rows(str(p), skip_bad_rows)
    return rows.result(_convert(_iter_jsonl(p), rows, _cnndm_eval(task)), "records")


def read_cnndm_pairs(path: str | os.PathLike, *, task: str = "cnndm",
                     skip_bad_rows: bool = False) -> ReadResult:
    """CNN/DailyMail JSONL as training pairs: article -> prompt, highlights -> response.

    Raises:
        DataError: as :func:`read_jsonl_pairs`.
    """
    p = _check_file(path)
    _template(task)
    rows = _Rows(str(p), skip_bad_rows)
    return rows.result(_convert(_iter_jsonl(p), rows, _cnndm_pair(task)), "records")


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


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
        suffix = p.suffix.lower()
        if suffix == ".csv":
            return read_e2e_pairs(p, task=task or "e2e", skip_bad_rows=skip_bad_rows)
        if suffix == ".jsonl":
            if "article" in _first_jsonl_keys(p):
                return read_cnndm_pairs(p, task=task or "cnndm", skip_bad_rows=skip_bad_rows)
            return read_jsonl_pairs(p, task=task or "plain", skip_bad_rows=skip_bad_rows)
        raise DataError(f"unsupported file type {p.suffix!r}; expected .csv (E2E) or .jsonl",
                        path=p)
    label, rows = _hub_rows(str(spec), split)
    rows = _hub_normalise(rows)
    t = _hub_task(set(rows[0][1]) if rows else set(), task)
    collector = _Rows(label, skip_bad_rows, unit="row")
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
        suffix = p.suffix.lower()
        if suffix == ".csv":
            return read_e2e_eval(p, task=task or "e2e", skip_bad_rows=skip_bad_rows)
        if suffix == ".jsonl":
            if "article" in _first_jsonl_keys(p):
                return read_cnndm(p, task=task or "cnndm", skip_bad_rows=skip_bad_rows)
            return read_jsonl_eval(p, task=task or "plain", skip_bad_rows=skip_bad_rows)
        raise DataError(f"unsupported file type {p.suffix!r}; expected .csv (E2E) or .jsonl",
                        path=p)
    label, rows = _hub_rows(str(spec), split)
    rows = _hub_normalise(rows)
    t = _hub_task(set(rows[0][1]) if rows else set(), task)
    collector = _Rows(label, skip_bad_rows, unit="row")
    if t == "cnndm":
        return collector.result(_convert(rows, collector, _cnndm_eval(t)), "rows")
    if t == "e2e":
        def mr_ref(rec: Mapping[str, Any]) -> tuple[str, str]:
            expected = ("mr", "ref")
            return _field_str(rec, "mr", expected).strip(), _field_str(rec, "ref", expected)

        groups: dict[str, list[str]] = {}
        for mr, ref in _convert(rows, collector, mr_ref):
            groups.setdefault(mr, []).append(ref)
        items = [EvalItem(prompt=format_prompt(t, mr=mr), references=tuple(refs), source=mr)
                 for mr, refs in groups.items()]
        return collector.result(items, "rows")
    return collector.result(_convert(rows, collector, _eval_converter(t)), "rows")


# --------------------------------------------------------------------------------------------
# Horizon helper
# --------------------------------------------------------------------------------------------


def median_response_tokens(examples: Iterable[Example | str], tokenizer: Any) -> int:
    """Median number of tokens of the responses, rounded half up to an integer.

    Used to set the schedule's ``horizon`` (the paper uses the median target length of the
    training data). Each response is tokenised with ``tokenizer(texts,
    add_special_tokens=False)`` (a Hugging Face tokenizer, batched); plain strings are accepted
    as responses too.

    Raises:
        ValueError: ``examples`` is empty.
    """
    texts = [e if isinstance(e, str) else e.response for e in examples]
    if not texts:
        raise ValueError("examples is empty: cannot take the median response length")
    encoded = tokenizer(texts, add_special_tokens=False)
    ids = encoded["input_ids"]
    lengths = [len(x) for x in ids]
    return int(math.floor(statistics.median(lengths) + 0.5))


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
