"""Prompt templates by task: :data:`TEMPLATES`, :func:`template_fields`, :func:`format_prompt`."""

from __future__ import annotations

import string
from typing import Any


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
