"""One known warning between peft and transformers, silenced exactly where we call peft.

peft (0.21.2, the newest release) builds every ``PeftModel`` (``PeftModel.from_pretrained``,
``get_peft_model``) with ``getattr(model, "is_gradient_checkpointing", True)``
(``peft/peft_model.py``, ``PeftModel.__init__``). transformers 5.24 deprecated that property in
favour of ``is_activation_checkpointing`` and warns on every read with a ``FutureWarning``
("`is_gradient_checkpointing` is deprecated and will be removed in v6"), so every
``skipdecode`` command that merges the shipped skip adapter (``generate``, ``info``, ``serve``...)
printed it. The call is peft's, not ours, and the value it reads is right; so the one warning
is filtered around our peft calls, and nothing else is. Remove this when peft reads
``is_activation_checkpointing`` (or when transformers 6 drops the old property).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

__all__ = ["PEFT_CHECKPOINTING_WARNING", "PEFT_SAVE_LOOKUP_WARNINGS", "quiet_peft_checkpointing_warning",
           "quiet_peft_save_lookup"]

#: Start of the message of transformers' FutureWarning that peft triggers (a regular expression).
PEFT_CHECKPOINTING_WARNING = r"`is_gradient_checkpointing` is deprecated"


@contextlib.contextmanager
def quiet_peft_checkpointing_warning() -> Iterator[None]:
    """Within the block, ignore only transformers' ``FutureWarning`` about
    ``is_gradient_checkpointing`` (issued from ``transformers.modeling_utils`` when peft builds a
    ``PeftModel``); every other warning is shown as before. Uses ``warnings.catch_warnings``, so
    the filter is undone on exit (it is process-wide while the block runs, as Python's warning
    filters are).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_CHECKPOINTING_WARNING, category=FutureWarning,
                                module=r"transformers\.modeling_utils")
        yield


#: Starts of peft's two ``UserWarning``s when ``PeftModel.save_pretrained`` cannot tell whether the
#: base model's vocabulary changed (``save_embedding_layers="auto"`` looks for the base's
#: ``config.json`` locally, then on the hub): the embedded model's base has no such folder and
#: this project's machines no hub. peft then assumes an unchanged vocabulary, which is right here:
#: training never resizes the embeddings.
PEFT_SAVE_LOOKUP_WARNINGS = (r"Unable to fetch remote file", r"Could not find a config file in")


@contextlib.contextmanager
def quiet_peft_save_lookup() -> Iterator[None]:
    """Within the block, ignore only peft's two ``UserWarning``s about looking up the base
    model's ``config.json`` while saving a LoRA adapter (:data:`PEFT_SAVE_LOOKUP_WARNINGS`; they
    printed this machine's paths into every checkpoint's progress bar); every other warning is
    shown as before. Uses ``warnings.catch_warnings`` (undone on exit)."""
    with warnings.catch_warnings():
        for message in PEFT_SAVE_LOOKUP_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"peft\.")
        yield
