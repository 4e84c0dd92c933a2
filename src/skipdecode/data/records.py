"""The records the readers return and the error they raise: :class:`Example` (a training pair),
:class:`EvalItem` (an evaluation input with all its references), :class:`ReadResult` (a list of
records plus what was skipped) and :class:`DataError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


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
