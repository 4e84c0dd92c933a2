"""Strict JSON (RFC 8259) for everything the project writes: CLI ``--json`` output, run records,
checkpoint configs, benchmark and evaluation results, server responses and stream events.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` by default, which strict parsers
(JavaScript's ``JSON.parse``, ``jq``, Go, Rust's serde_json) reject. A statistic with no value
(``step_seconds`` of a run without decode steps, a speed ratio with no reference) is written as
``null`` instead: :func:`json_safe` maps every non-finite float to None, and :func:`dumps` /
:func:`dump` serialise with ``allow_nan=False`` after it, so a non-finite float can never reach
the output.
"""

from __future__ import annotations

import json
import math
from typing import IO, Any

__all__ = ["json_safe", "dumps", "dump"]


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, recursively through
    dicts, lists and tuples (tuples become lists, as JSON has no tuple). Other values are
    returned unchanged."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(json_safe(value), allow_nan=False, **kwargs)``: strict JSON text.

    Raises:
        TypeError: ``value`` holds an object JSON cannot represent.
    """
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def dump(value: Any, fh: IO[str], **kwargs: Any) -> None:
    """Write :func:`dumps` of ``value`` to the text file ``fh``.

    Raises:
        TypeError: ``value`` holds an object JSON cannot represent.
    """
    json.dump(json_safe(value), fh, allow_nan=False, **kwargs)
