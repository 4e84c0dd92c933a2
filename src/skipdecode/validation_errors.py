"""The message and ``param`` of a request that fails the request models' own checks (pydantic's
errors as FastAPI hands them over), in OpenAI's error shape: one line that names each field by its
path (``messages[0].content``, ``prompt[0][0]``) and what it allows, for the server's 400s
(:func:`skipdecode.server` registers it for ``RequestValidationError``). The checks past the
models (token ids, lengths, policies) are :func:`skipdecode.protocol.validate_request`'s.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart, StreamOptions

__all__ = ["FIELD_NAMES", "validation_message"]

FIELD_NAMES = frozenset(
    name for cls in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions)
    for name in cls.model_fields
)


def _loc_path(loc: Sequence[Union[str, int]]) -> str:
    """A pydantic error ``loc`` as a field path (``messages[0].role``; "" for the whole body).

    The ``body`` prefix and the union-member tags pydantic inserts (``prompt.str``,
    ``stop.list[str]``: any name that is no request field) are left out.
    """
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELD_NAMES:
            path += f".{part}" if path else part
    return path


def _branch(loc: Sequence[Union[str, int]]) -> Optional[tuple[tuple[Union[str, int], ...], str, tuple[int, ...]]]:
    """(where, tag, progress) of an error inside a union's alternative, or None outside any
    union. ``progress`` is the location inside the alternative with list indices kept and field
    names counted as 0 (``prompt.list[list[int]].0.0``: ``(("body", "prompt"), "list[list[int]]",
    (0, 0))``), so that comparing two tuples tells which error lies further into the value: a
    later list item, or deeper into the same one."""
    for i, part in enumerate(loc):
        if i and isinstance(part, str) and part not in FIELD_NAMES:
            return tuple(loc[:i]), part, tuple(p if isinstance(p, int) else 0 for p in loc[i + 1 :])
    return None


def _likeliest_branches(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``errors`` without those of a union's alternatives that failed sooner than another: for a
    value that fails every alternative, the ones whose first error lies furthest into it. As a
    prompt, ``[[1.5]]`` fails as a string at the top, as a list of strings or ids at ``[0]`` and as
    a list of id lists at ``[0][0]``; ``[1, "a"]`` fails as strings at ``[0]`` and as ids at
    ``[1]``: the last is the user's likely intent. Ties keep every alternative; errors outside
    unions stay."""
    branches = [_branch(e.get("loc", ())) for e in errors]
    first: dict[tuple, tuple[int, ...]] = {}  # (where, tag) -> where that alternative first failed
    for b in branches:
        if b is not None and (b[:2] not in first or b[2] < first[b[:2]]):
            first[b[:2]] = b[2]
    furthest: dict[tuple, tuple[int, ...]] = {}
    for (where, _), progress in first.items():
        furthest[where] = max(furthest.get(where, progress), progress)
    return [e for e, b in zip(errors, branches) if b is None or first[b[:2]] == furthest[b[0]]]


def _alternatives(msgs: list[str]) -> str:
    """A field's messages joined by " or ", their common "Input should be " said once."""
    lead = "Input should be "
    if len(msgs) > 1 and all(m.startswith(lead) for m in msgs):
        return lead + " or ".join(m[len(lead) :] for m in msgs)
    return " or ".join(msgs)


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """(message, param) for FastAPI's request validation ``errors`` (pydantic error dicts).

    A body that is not valid JSON, or is empty, is named as such (``param`` None).
    The message is ``"<field>: <pydantic msg>"`` per field (a union's alternatives joined by
    " or "), fields joined by "; "; ``param`` is the first error's field path, or None for a body
    that is not valid JSON or not a JSON object.
    """
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            where = f" at character {e['loc'][-1]}" if isinstance(e["loc"][-1], int) else ""
            return f"the request body is not valid JSON ({reason}{where})", None
        if e.get("type") == "missing" and tuple(e.get("loc", ())) == ("body",):  # no body at all
            return "the request body is empty: send a JSON object with the request's fields", None
    by_path: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for e in _likeliest_branches(errors):
        path = _loc_path(e.get("loc", ()))
        msgs = by_path.setdefault(path, [])
        if e.get("msg", "invalid value") not in msgs:
            msgs.append(e.get("msg", "invalid value"))
        value = e.get("input")
        if e.get("type") != "missing" and value is None:
            got.setdefault(path, " (got null)")
        elif e.get("type") != "missing" and isinstance(value, (bool, int, float, str)) and len(repr(value)) <= 60:
            got.setdefault(path, f" (got {value!r})")
    message = "; ".join(f"{path or 'body'}: {_alternatives(msgs)}{got.get(path, '')}" for path, msgs in by_path.items())
    return message or "invalid request", next((path for path in by_path if path), None)
