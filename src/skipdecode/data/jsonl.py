"""Generic JSONL files: ``{"prompt", "response"}`` training pairs and ``{"prompt", "references"}``
evaluation items (or any task's template fields instead of ``prompt``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .records import EvalItem, Example, ReadResult
from .rows import _field_str, _prompt_from_record, _read_jsonl, _references
from .templates import template_fields


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
    return _read_jsonl(path, task, skip_bad_rows, _pair_converter)


def read_jsonl_eval(path: str | os.PathLike, *, task: str = "plain",
                    skip_bad_rows: bool = False) -> ReadResult:
    """Read ``{"prompt": str, "references": list[str] | str}`` lines into :class:`EvalItem`.

    A single string reference becomes a one-element tuple. ``source`` is the raw value of the
    template's field (the ``prompt`` itself for ``task="plain"``).

    Raises:
        DataError: as :func:`read_jsonl_pairs`; also a references list that is empty, holds a
        non-string, or holds only empty strings.
    """
    return _read_jsonl(path, task, skip_bad_rows, _eval_converter)

