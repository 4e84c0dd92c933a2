"""Models read through transformers' ``from_pretrained``: a local Hugging Face folder, or a model
id from the local Hugging Face cache or the hub (part of :func:`skipdecode.load`, in
:mod:`skipdecode.loading`). A model id that is not cached is downloaded only once one metadata
request shows the hub has it, so a machine without the hub fails at once with the reason instead
of after huggingface_hub's retries.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .load_errors import LoadError

__all__: list[str] = []  # internal to skipdecode.load


def _from_hub(model: str | os.PathLike, dtype: torch.dtype) -> tuple[Any, Any]:
    """Model and tokenizer of Hugging Face model id ``model``: from the local Hugging Face cache
    without the network, else downloaded once :func:`_hub_problem` finds the hub has it.

    Raises:
        LoadError: not a valid model id, or not cached and the hub is unreachable,
            ``HF_HUB_OFFLINE`` is set, the hub has no such model, or the download fails (each
            named), at once rather than after huggingface_hub's retries (about 70 s on a
            machine without the hub).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = str(model)
    try:
        validate_repo_id(name)
    except HFValidationError as err:
        raise LoadError(f"{name!r} is neither an existing path nor a valid Hugging Face model id "
                        f"({str(err).splitlines()[0]})", param="model") from None
    try:
        return _from_pretrained(name, dtype, local_files_only=True)
    except OSError:
        pass  # not (completely) in the cache
    where = f"could not load {name!r}: not a local path and not in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise LoadError(f"{where}, and HF_HUB_OFFLINE is set", param="model") from None
    problem = _hub_problem(name)
    if problem:
        raise LoadError(f"{where}, and {problem}", param="model") from None
    try:
        return _from_pretrained(name, dtype)
    except OSError as err:
        raise LoadError(f"{where}, and the download failed ({str(err).splitlines()[0]})", param="model") from None


def _hub_problem(name: str) -> str | None:
    """Why the Hugging Face hub cannot provide model ``name`` (one metadata request,
    ``HfApi.model_info``, 10 s at most), or None when it can (gated models included: the
    download then uses the user's token)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=10)
    except GatedRepoError:
        return None
    except RepositoryNotFoundError:
        return "the hub has no model of that name (or it is private: log in with `hf auth login`)"
    except Exception as err:  # noqa: BLE001 - network errors vary by HTTP backend
        detail = str(err).splitlines()[0] if str(err) else ""
        return f"the Hugging Face hub cannot be reached ({type(err).__name__}: {detail})"
    return None


def _from_pretrained(name: str, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    """Tokenizer and HF model of ``name``; a local directory loads without transformers' "Loading
    weights" progress bar (under a second, and printed at every load, the cache's included)."""
    tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    with _quiet_progress(Path(name).is_dir()):
        hf_model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa", **kwargs)
    return hf_model, tokenizer


@contextlib.contextmanager
def _quiet_progress(quiet: bool):
    """Turn transformers' progress bars off inside the block when ``quiet`` (their state is restored)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if quiet and was_on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_on:
            hf_logging.enable_progress_bar()
