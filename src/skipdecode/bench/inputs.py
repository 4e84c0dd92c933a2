"""What the decode-speed benchmark runs on: the prompt pool, its batches, the default output
path, and the comma-list options of ``skipdecode bench`` (batch sizes, speedups).

The library never prints: the CLI does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..policy import FullPolicy, SkipPolicy

DEFAULT_OUTPUT = Path("benchmarks") / "results" / "decode_speed.json"

#: 32 real prompts of different lengths (a few words to a paragraph), so batches are left-padded.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in simple terms why the sky is blue.",
    "Give me three tips for a good night's sleep.",
    "Describe the restaurant in one sentence.\nname[The Eagle], eatType[coffee shop], food[French], "
    "priceRange[moderate], customer rating[3 out of 5], area[riverside], familyFriendly[yes], "
    "near[Burger King]\nDescription:",
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "What is 17 times 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five common fruits that are rich in vitamin C.",
    "Why do cats purr?",
    "Write a short, polite email to a colleague asking to move our Tuesday meeting to Thursday "
    "afternoon because I have a dentist appointment.",
    "What are the main differences between a virus and a bacterium?",
    "Hello!",
    "Suggest a name for a small bakery that specialises in sourdough bread.",
    "Explain what a hash table is to a first-year computer science student, including how "
    "collisions are handled and what the average cost of a lookup is.",
    "How many legs does a spider have?",
    "Summarize the article.\nThe city council voted on Monday to extend the opening hours of all "
    "public libraries until nine in the evening on weekdays. The decision follows a survey in "
    "which most residents said they could not visit during working hours. The change will cost "
    "about two hundred thousand pounds a year and takes effect next month.\nSummary:",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Is a tomato a fruit or a vegetable?",
    "Describe the water cycle.",
    "Give a one-line definition of photosynthesis.",
    "I have eggs, spinach, cheese and bread. What can I cook for breakfast in ten minutes?",
    "Who wrote Pride and Prejudice, and when was it published?",
    "Explain the rules of chess for the knight.",
    "Write a limerick about a forgetful robot.",
    "What is the difference between weather and climate? Answer briefly, then give an example "
    "of each from everyday life.",
    "Name three planets in our solar system.",
    "How do I convert Celsius to Fahrenheit?",
    "Tell me a fun fact about octopuses.",
    "Rewrite this sentence to be more formal: hey, can u send me the report asap, thx.",
    "What are the benefits of regular exercise for mental health? Give at least four, each with "
    "one sentence of explanation, and finish with a short recommendation for a beginner.",
)



def comma_items(text: str, name: str = "value") -> list[str]:
    """The stripped items of a comma-separated ``text``: ``" 2, 3"`` -> ``["2", "3"]``, ``""`` -> ``[]``.

    Raises:
        ValueError: an empty item inside a list (``"2,,3"``, ``"2,3,"``), which is more likely a
            typo than a wish; the message names ``name``.
    """
    if not str(text).strip():
        return []
    items = [x.strip() for x in str(text).split(",")]
    if not all(items):
        raise ValueError(f"{name} has an empty item (two commas in a row, or one at an end), got {text!r}")
    return items


def parse_int_list(text: str, name: str = "value") -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (e.g. batch sizes, in sequences).

    Raises:
        ValueError: ``text`` is not comma-separated integers, is empty, holds an empty item
            (:func:`comma_items`), a value < 1 or one twice; the message names ``name``.
    """
    items = comma_items(text, name)
    try:
        values = [int(x) for x in items]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be comma-separated integers >= 1, got {text!r}")
    return _no_repeats(values, name, text)


def _no_repeats(values: list, name: str, text: str) -> list:
    """``values``, or a ValueError naming ``name`` when one is given twice (it would be timed twice,
    its rows in the table twice, each mixing both runs)."""
    seen = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{name} must not repeat a value ({v:g} is given twice), got {text!r}")
        seen.add(v)
    return values


def parse_float_list(text: str, name: str = "value") -> list[float]:
    """``"2,3,5"`` -> ``[2.0, 3.0, 5.0]`` (target speedups; may be empty: ``""``).

    Raises:
        ValueError: ``text`` is not comma-separated numbers, or holds an empty item
            (:func:`comma_items`), a value <= 1 (full depth is always measured) or one twice
            (``2,2.0``); the message names ``name``.
    """
    items = comma_items(text, name)
    try:
        values = [float(x) for x in items]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if any(not v > 1 for v in values):
        raise ValueError(f"{name} must be numbers > 1 (full depth is always measured), got {text!r}")
    return _no_repeats(values, name, text)


def batch_prompts(batch_size: int, prompts: Sequence[str] = DEFAULT_PROMPTS) -> list[str]:
    """The first ``batch_size`` of ``prompts``, cycling when more are needed.

    Raises:
        ValueError: ``batch_size`` < 1 or ``prompts`` is empty.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    return [prompts[i % len(prompts)] for i in range(batch_size)]


def _policy_name(speedup: float | None) -> str:
    if speedup is None:
        return "full"
    return f"{speedup:g}x"




def bench_policies(sk, speedups: Sequence[float], horizon: int) -> list[tuple[str, float, SkipPolicy]]:
    """``(name, target speedup, policy)`` of full depth and of each target in ``speedups``.

    Full depth comes first (``("full", 1.0, FullPolicy(num_layers))``); each ``s`` gives
    ``("{s:g}x", s, sk.policy_for(speedup=s, horizon=horizon))`` (``horizon`` in tokens).

    Raises:
        ValueError: a speedup the model's layers cannot reach (from ``SkipModel.policy_for``).
    """
    policies: list[tuple[str, float, SkipPolicy]] = [("full", 1.0, FullPolicy(sk.num_layers))]
    for s in speedups:
        policies.append((_policy_name(s), float(s), sk.policy_for(speedup=float(s), horizon=horizon)))
    return policies


def schedule_notes(sk, speedups: Sequence[float], horizon: int, new_tokens: int | None = None) -> list[str]:
    """One line per target speedup whose timed schedule is not what a reader would expect:

    - where ``sk`` has a trained schedule for ``s`` (:meth:`SkipModel.trained_policy`, the one
      ``generate --speedup s`` runs) and ``horizon`` (tokens) differs from its horizon, the
      benchmark times the generic :func:`~skipdecode.policy.for_speedup` schedule instead
      (:meth:`SkipModel.policy_for`'s rule); the line says so and how to time the trained one;
    - where the timed schedule runs its first k decode steps at full depth (``full_depth_steps``)
      and ``new_tokens`` (tokens per row) leaves at most k decode steps, the row skips nothing;
      the line says so and what ``--new-tokens`` would show its skipping.

    Empty for models without trained schedules (the stock weights) when ``horizon`` matches.
    """
    notes = []
    for s in speedups:
        timed = sk.policy_for(speedup=float(s), horizon=horizon)
        trained = sk.trained_policy(float(s))
        k_timed = getattr(timed, "full_depth_steps", 0) or 0
        if new_tokens is not None and k_timed and new_tokens - 1 <= k_timed:
            notes.append(f"{_policy_name(s)}: its schedule runs the first {k_timed} decode steps at full depth and "
                         f"--new-tokens {new_tokens} gives {new_tokens - 1}, so this row skips no layer; give "
                         f"--new-tokens well above {k_timed + 1} for its skipping to show")
        if trained is None or timed == trained:
            continue
        h = getattr(trained, "horizon", None)
        k = getattr(trained, "full_depth_steps", 0) or 0
        lead = (f"; it runs its first {k} decode steps at full depth, so give --new-tokens well above {k + 1} "
                f"for its skipping to show") if k else ""
        notes.append(f"{_policy_name(s)}: this model was trained for its own {_policy_name(s)} schedule (horizon {h}, "
                     f"what generate --speedup {float(s):g} runs); this run times the generic schedule over horizon "
                     f"{horizon} instead; pass --horizon {h} to time the trained one{lead}")
    return notes

