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

Where each piece lives (every name is re-exported here, so ``from skipdecode.data import ...``
keeps working):

* :mod:`.records`: :class:`DataError`, :class:`Example`, :class:`EvalItem`, :class:`ReadResult`.
* :mod:`.folder`: the shared data folder (:func:`default_data_dir`, :func:`shared_data_path`).
* :mod:`.templates`: :data:`TEMPLATES`, :func:`template_fields`, :func:`format_prompt`.
* :mod:`.rows`: low-level CSV/JSONL rows, the bad-row collector, record conversion.
* :mod:`.e2e`, :mod:`.jsonl`, :mod:`.cnndm`, :mod:`.hub`: one reader module per source.
* :mod:`.load`: :func:`load_examples`, :func:`load_eval_items` (dispatch), :func:`select_items`,
  :func:`check_data_file` (a folder refused before any long work).
* :mod:`.horizon`: :func:`median_response_tokens`.
"""

from __future__ import annotations

from .cnndm import read_cnndm, read_cnndm_pairs
from .e2e import read_e2e_eval, read_e2e_pairs
from .folder import default_data_dir, shared_data_path
from .horizon import median_response_tokens
from .jsonl import read_jsonl_eval, read_jsonl_pairs
from .load import check_data_file, load_eval_items, load_examples, select_items
from .records import DataError, EvalItem, Example, ReadResult
from .templates import TEMPLATES, format_prompt, template_fields

__all__ = [
    "DataError",
    "select_items",
    "Example",
    "EvalItem",
    "ReadResult",
    "TEMPLATES",
    "default_data_dir",
    "shared_data_path",
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
    "check_data_file",
    "median_response_tokens",
]
