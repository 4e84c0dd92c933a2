"""CNN/DailyMail JSONL (``article`` + ``highlights``): evaluation items and training pairs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .jsonl import _eval_converter, _pair_converter
from .records import EvalItem, Example, ReadResult
from .rows import _prompt_from_record, _read_jsonl, _references, _RowProblem


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
    return _read_jsonl(path, task, skip_bad_rows, _cnndm_eval)


def read_cnndm_pairs(path: str | os.PathLike, *, task: str = "cnndm",
                     skip_bad_rows: bool = False) -> ReadResult:
    """CNN/DailyMail JSONL as training pairs: article -> prompt, highlights -> response.

    Raises:
        DataError: as :func:`read_jsonl_pairs`.
    """
    return _read_jsonl(path, task, skip_bad_rows, _cnndm_pair)

