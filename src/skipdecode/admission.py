"""When waiting requests join the running rows of in-flight batching (:class:`skipdecode.engine.Engine`).

Under one decaying schedule a decode step runs the layers of its youngest row (younger rows need a
superset of the layers older rows need), so rows of mixed ages make every step run most layers:
with the embedded model's 2x schedule (14 full-depth steps first) and 16 rows joining as they come,
some row is nearly always in its first 14 steps and every step runs all 30 layers
(docs/serving.md). Two admission controls keep ages together:

- ``cohort_size``: join only when the free slots hold a cohort of that many rows (or every
  waiting request, or no row runs).
- ``align_steps`` (A): while every running row is more than A decode steps old, a waiting request
  waits, at most A engine steps; requests that arrive in the meantime join with it. Rows then join
  in waves that share their full-depth steps, and a request waits at most A steps longer.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["may_join", "check_align_steps", "SERVE_ALIGN_STEPS"]

#: The server's default ``align_steps`` (``skipdecode serve``, :func:`skipdecode.server.create_app`):
#: at 4 to 64 clients it serves the shipped 2x 1.34-1.51x and full depth 1.10-1.17x the requests/s of
#: arrivals joining as they come, at lower p95 latencies (docs/serving.md "Age-aligned admission").
#: The engine's own default stays 0: a batch job queues every prompt at once, where holding a
#: request never aligns anything.
SERVE_ALIGN_STEPS = 8


def check_align_steps(align_steps: object) -> int:
    """``align_steps`` as an int >= 0 (engine steps). Raises ValueError (naming ``align_steps``) otherwise."""
    if isinstance(align_steps, bool) or not isinstance(align_steps, int) or align_steps < 0:
        raise ValueError(f"align_steps must be an integer >= 0, got {align_steps!r}")
    return align_steps


def may_join(free_slots: int, waiting: int, running_steps: Sequence[int], cohort_size: int = 1,
             align_steps: int = 0, oldest_waited: int = 0) -> bool:
    """Whether waiting requests join at this engine step.

    Args:
        free_slots: free rows of the batch.
        waiting: requests waiting (rows).
        running_steps: each running row's decode step (tokens generated so far minus one).
        cohort_size: join only when ``free_slots`` >= min(``cohort_size``, ``waiting``) (rows).
        align_steps: A >= 0; with A > 0, hold the waiting requests while every running row is more
            than A steps old, unless the oldest has waited A engine steps (0: never hold).
        oldest_waited: engine steps the oldest waiting request has waited.

    Returns:
        True when they join now: some wait and no row runs, or the cohort rule and the alignment
        rule both let them.
    """
    if not waiting:
        return False
    if not running_steps:
        return True
    if align_steps and min(running_steps) > align_steps and oldest_waited < align_steps:
        return False
    return free_slots >= min(cohort_size, waiting)
