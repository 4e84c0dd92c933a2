"""The schedule's horizon from data: :func:`median_response_tokens` (the paper sets the horizon to
the median target length of the training data).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from .records import Example


def median_response_tokens(examples: Iterable[Example | str], tokenizer: Any) -> int:
    """Median number of tokens of the responses, rounded half up to an integer.

    Used to set the schedule's ``horizon`` (the paper uses the median target length of the
    training data). Each response is tokenised with ``tokenizer(texts,
    add_special_tokens=False)`` (a Hugging Face tokenizer, batched); plain strings are accepted
    as responses too.

    Raises:
        ValueError: ``examples`` is empty.
    """
    texts = [e if isinstance(e, str) else e.response for e in examples]
    if not texts:
        raise ValueError("examples is empty: cannot take the median response length")
    encoded = tokenizer(texts, add_special_tokens=False)
    ids = encoded["input_ids"]
    lengths = [len(x) for x in ids]
    return int(math.floor(statistics.median(lengths) + 0.5))

