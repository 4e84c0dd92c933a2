"""Bounds on generation settings that the Python API, the CLI and the server share, one source each.

- :data:`SEED_MIN`, :data:`SEED_MAX`: the sampling ``seed`` range, OpenAI's int64 (the API
  reference types ``seed`` as an integer; the ``openai`` package and servers take it as int64).
  ``torch.Generator.manual_seed`` takes more (up to 2**64 - 1), but one range everywhere means a
  seed that works in ``skipdecode generate`` also works in a request to ``skipdecode serve``.
- :data:`MAX_STOP_STRINGS` and :func:`check_stop`: at most 4 stop strings, none empty (OpenAI API
  reference, ``stop``: "Up to 4 sequences where the API will stop generating further tokens").
  An empty stop string is contained in every text, so it would end every row before its first
  token is shown; it is refused rather than silently dropped.

:mod:`skipdecode.sampling` checks the seed with these bounds, :mod:`skipdecode.protocol` declares the
server's ``seed`` field with them and answers :func:`check_stop`'s errors as HTTP 400 naming
``stop``, the generation entry points (:func:`skipdecode.generate.generate` and its streaming and
in-flight forms, CALM) call :func:`check_stop`, and the CLI names its options in the same words.
"""

from __future__ import annotations

from typing import Sequence, Union

__all__ = ["MAX_STOP_STRINGS", "SEED_MAX", "SEED_MIN", "check_stop"]

#: Smallest and largest sampling seed (int64, OpenAI's ``seed``); both ends included.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: Most stop strings per request (OpenAI API reference: "Up to 4 sequences").
MAX_STOP_STRINGS = 4


def check_stop(stop: Union[str, Sequence[str], None], name: str = "stop") -> list[str]:
    """The stop strings of ``stop`` as a list, checked: at most :data:`MAX_STOP_STRINGS`, each a
    non-empty string. A single string is one stop string (as OpenAI's ``stop`` field takes it),
    never a sequence of one-character stop strings; None is no stop string.

    Args:
        stop: None, one string, or a sequence of strings.
        name: what the caller calls the setting, used in messages (``"stop"`` for the Python API
            and the server, ``"--stop"`` for the CLI).

    Returns:
        The stop strings, in order (0 to 4 of them).

    Raises:
        ValueError: more than 4 stop strings, an empty one, or one that is not a string; the
            message starts with ``name``.
    """
    if stop is None:
        return []
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, Sequence) or isinstance(values, (bytes, bytearray)):
        raise ValueError(f"{name}: must be a string or a list of strings, got {type(stop).__name__}")
    values = list(values)
    if len(values) > MAX_STOP_STRINGS:
        raise ValueError(f"{name}: at most {MAX_STOP_STRINGS} stop strings are allowed (OpenAI's limit), "
                         f"got {len(values)}")
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ValueError(f"{name}: stop strings must be strings, got {type(value).__name__} at position {i}")
        if not value:
            raise ValueError(f"{name}: stop strings must not be empty (got '' at position {i}); an empty string "
                             "is in every text and would end generation before the first token")
    return values
