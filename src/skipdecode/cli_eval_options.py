"""``skipdecode eval``'s options checked before any data or model is read
(:func:`check_eval_rows`, :func:`check_eval_run`), its data (:func:`eval_items`), and the library's
errors of a run worded with the options that caused them (:func:`eval_error_message`).
:mod:`skipdecode.cli` defines the command; every exit here is :func:`~skipdecode.cli_common.fail`'s
one line, exit status 2."""

from __future__ import annotations

import dataclasses

from rich.markup import escape

from .cli_common import as_option_error, check_cohort_option, check_policy_options, err, fail, stop_from_options
from .policy import LinearDecayPolicy


def _is_speedup(spec: str) -> bool:
    """Whether a ``--policy`` value is a speedup above 1 (``2``, ``2x``), a row ``--horizon`` times."""
    text = spec.strip().lower()
    try:
        return float(text[:-1] if text.endswith("x") else text) > 1
    except ValueError:
        return False


def check_eval_rows(speedups, policies, horizon, calm_thresholds, calm_min_layers, metrics) -> None:
    """Check the options that choose ``eval``'s rows and scores, before any data or model is read.

    Raises:
        typer.Exit: (2, via :func:`~skipdecode.cli_common.fail`) a ``--speedup`` that is not a
            finite number >= 1, a ``--horizon`` below 1 (with or without ``--speedup``), a
            ``--calm-threshold`` outside [0, 1] or ``--calm-min-layers`` below 1 (or given
            without ``--calm-threshold``), a ``--horizon`` without a speedup row to time (a
            ``--speedup`` above 1 or such a number as ``--policy``), or a
            ``--metric`` that is not one of :data:`skipdecode.metrics.METRICS`.
    """
    from .calm import CalmConfig
    from .metrics import METRICS

    for speedup in speedups:
        check_policy_options(speedup, None, None, None)
    check_policy_options(None, None, None, horizon)
    if horizon is not None and not any(s > 1 for s in speedups) and not any(_is_speedup(p) for p in policies):
        # it would be ignored: full depth has no horizon, the checkpoint row keeps its own
        fail(f"--horizon ({horizon}) needs --speedup above 1 (or such a number as --policy): it times the speedup rows; "
             "the checkpoint's policy keeps its own horizon")
    if calm_min_layers != 1 and not calm_thresholds:  # it would be ignored: no CALM row runs
        fail(f"--calm-min-layers ({calm_min_layers}) needs --calm-threshold: it sets the CALM rows' fewest layers")
    for threshold in calm_thresholds:  # the library's range, checked before any data or model is read
        try:
            CalmConfig(threshold, calm_min_layers)
        except ValueError as e:
            fail(as_option_error(e, {"threshold": "--calm-threshold", "min_layers": "--calm-min-layers"}))
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        fail(f"--metric must be one of {', '.join(METRICS)}, got {unknown[0]!r}")


def check_eval_run(stop, cohort_size, batch_size, inflight, limit, max_new_tokens, task) -> list:
    """Check the options of how ``eval`` generates, before any data or model is read; return the
    ``--stop`` strings (``--stop ''`` alone: none; ``\\n`` and ``\\t`` written as escapes).

    Raises:
        typer.Exit: (2, via :func:`~skipdecode.cli_common.fail`) naming the option: a bad
            ``--stop``, ``--cohort-size``/``--batch-size``, ``--limit``, ``--max-new-tokens`` or
            ``--task``, or ``--cohort-size`` with ``--static``.
    """
    from .evaluate import TASKS

    # --stop '' alone means "no stop string" (the E2E default is a newline); otherwise the rule of
    # skipdecode.limits, with \n and \t written as escapes
    escaped = [s.replace("\\n", "\n").replace("\\t", "\t") for s in stop]
    stops = [] if escaped == [""] else stop_from_options(escaped)
    check_cohort_option(cohort_size, batch_size, "--batch-size")
    if cohort_size > 1 and not inflight:
        fail("--cohort-size applies to in-flight batching; drop it or --static")
    if limit is not None and limit < 1:
        fail(f"--limit must be >= 1, got {limit}")
    if max_new_tokens is not None and max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if task is not None and task not in TASKS:
        fail(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    return stops


def eval_items(data, task, skip_bad_rows, offset, limit) -> tuple:
    """``eval``'s data path (``--data`` or the shared E2E test set) and its selected items.

    Raises:
        typer.Exit: (2, via :func:`~skipdecode.cli_common.fail`) data that cannot be read: a
            ``--data`` folder (``--data DIR: is a folder; give ...``), a file the readers refuse
            (its message after ``--data``), or an ``--offset`` that skips every item.
    """
    from .data import DataError, load_eval_items, select_items, shared_data_path

    try:
        path = shared_data_path(data, "e2e/testset_w_refs.csv")
        items = load_eval_items(path, task=task, skip_bad_rows=skip_bad_rows)
    except DataError as e:
        fail(_data_error_message(e, given=data))
    except ValueError as e:
        fail(str(e))
    if getattr(items, "n_skipped", 0):
        err.print(f"[yellow]skipped {items.n_skipped} bad row(s) of {escape(str(path))}[/]", highlight=False)
    try:
        items = select_items(items, offset, limit, str(path))
    except ValueError as e:
        fail(str(e))
    return path, items


def _data_error_message(error, given) -> str:
    """The one line for a :class:`~skipdecode.data.DataError` of ``eval``'s data: a problem of the
    file the user gave (``given``: ``--data``'s value; a folder among them,
    :func:`~skipdecode.data.check_data_file`) is prefixed with ``--data``; others unchanged."""
    if given and error.path is not None:
        return f"--data {error}"
    return str(error)


#: the fields of a --policy JSON dict (:func:`~skipdecode.policy.policy_from_dict`), which its errors name first
_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(LinearDecayPolicy)) | {"type", "policy.num_layers"}


def eval_error_message(error: Exception, speedups, policies) -> str:
    """The message of a library ``error`` raised by an evaluation, its leading field written as the
    option that set it: ``calm_min_layers`` (above the model's layers) as ``--calm-min-layers``,
    ``speedup`` (too large for the model) as ``--speedup``, ``--policy`` (a speedup given as a
    policy, ``--policy 9``) or ``--speedup/--policy`` when both were given; other messages
    unchanged (:func:`~skipdecode.cli_common.as_option_error`)."""
    given = [option for option, values in (("--speedup", speedups), ("--policy", policies)) if values]
    message = str(error)
    field = message.partition(" ")[0].rstrip(":")
    if policies and message.startswith("policy "):  # "policy type must be ...", "policy '{' is not valid JSON"
        return "--" + message
    if policies and (field in _POLICY_FIELDS or message.startswith("unknown policy")):  # from a --policy value
        return f"--policy: {message}"
    return as_option_error(error, {"calm_min_layers": "--calm-min-layers", "speedup": "/".join(given) or "--speedup"})
