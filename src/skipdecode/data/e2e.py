"""E2E NLG CSV files (columns ``mr`` and ``ref``): training pairs, and evaluation items grouped by
meaning representation (the official multi-reference setting).
"""

from __future__ import annotations

import os

from .records import EvalItem, Example, ReadResult
from .rows import _check_file, _iter_csv, _Rows
from .templates import format_prompt


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

