"""One prompt-encoding path for the library, the CLI and the server.

A prompt is one of:

- a **string**: with ``chat=False`` tokenized as the tokenizer is configured (a tokenizer that
  adds BOS adds it); with ``chat=True`` wrapped as one user turn and encoded as a conversation;
- a **conversation** (a sequence of ``{"role", "content", ...}`` mappings): rendered with the
  tokenizer's chat template and tokenized **once, without adding special tokens**, as
  ``transformers``' ``apply_chat_template(tokenize=True)`` does. The template's own
  ``{{ bos_token }}`` is then the only BOS: rendering to text and tokenizing that text again with
  special tokens (the server's old path) gave ``[BOS, BOS, ...]`` on tokenizers that add BOS;
- **token ids** (a sequence of ints): used exactly as given, never re-tokenized (OpenAI's
  token-array prompts of ``/v1/completions``).

:func:`skipdecode.generate.encode_prompts` (library, CLI, evaluation, training) and
``skipdecode.protocol`` (server) both call :func:`encode_prompt`, so a prompt gives the same ids
everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

__all__ = ["Prompt", "encode_prompt", "is_conversation", "is_token_ids", "prompt_list"]

#: A string, a conversation (sequence of message mappings) or token ids (sequence of ints).
Prompt = Union[str, Sequence[int], Sequence[Mapping[str, Any]]]


def prompt_list(prompts: Any) -> list:
    """``prompts`` as a list of prompts: a string is one prompt, a list or tuple (or another
    iterable) holds one prompt per item, each checked later by :func:`encode_prompt`.

    Raises:
        ValueError: ``prompts`` is neither (None, a number, a dict, bytes, a set: it has no
            order); the message names ``prompts`` and its type.
    """
    if isinstance(prompts, str):
        return [prompts]
    if (prompts is None or isinstance(prompts, (bytes, bytearray, Mapping, set, frozenset))
            or not hasattr(prompts, "__iter__")):  # a set has no order: its rows would come back shuffled
        raise ValueError(
            "prompts must be a string or a list of prompts (strings, chat conversations or token-id lists), "
            f"got {type(prompts).__name__} {prompts!r}"[:300]
        )
    return list(prompts)


def is_token_ids(prompt: Any) -> bool:
    """True when ``prompt`` is a non-string sequence whose items are all ints (not bools)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def is_conversation(prompt: Any) -> bool:
    """True when ``prompt`` is a non-empty, non-string sequence of mappings (chat messages)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, (str, bytes))
        and len(prompt) > 0
        and all(isinstance(m, Mapping) for m in prompt)
    )


def _check_ids(tokenizer: Any, ids: Sequence[int], where: str) -> list[int]:
    vocab = len(tokenizer)
    for j, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise ValueError(f"{where}[{j}] must be a token id in [0, {vocab - 1}], got {t}")
    return list(ids)


def _render_ids(out: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)``'s output (ids, or a BatchEncoding) as a list."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


def _check_text(value: Any, where: str) -> None:
    """Refuse a lone UTF-16 surrogate (e.g. JSON's ``"\\ud800"``) in any string of ``value`` (a
    string, or a conversation's nested messages): it is no character, and the tokenizer fails
    on it with a TypeError.

    Raises:
        ValueError: naming ``where`` (and the message field) and the character's position.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} holds a lone surrogate {value[e.start]!r} at character {e.start}, "
                             "which is not text (no UTF-8 encoding)") from None
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_text(item, f"{where}.{key}")
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat: bool = False, where: str = "prompt") -> list[int]:
    """Token ids (length P, no padding) of one ``prompt`` (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer (with ``chat_template`` for conversations).
        prompt: a non-empty string, a non-empty conversation, or non-empty token ids.
        chat: wrap a string prompt as one user turn of the chat template (conversations are
            always templated; token ids never are).
        where: the name of the prompt in error messages (``prompts[3]``, ``messages``).

    Returns:
        The prompt's token ids (tokens), at least one.

    Raises:
        ValueError: ``chat`` not a bool, a prompt of another type, an empty or blank string, a string holding a lone
            surrogate (not text; the tokenizer would fail on it), a token id outside
            ``[0, len(tokenizer))``, a conversation (or ``chat=True``) with a tokenizer that has
            no chat template, or a prompt that encodes to zero tokens; the message starts
            with ``where``.
    """
    if not isinstance(chat, bool):  # "no" would count as True
        raise ValueError(f"chat must be True or False, got {chat!r}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where} must be a non-empty string, got {prompt!r}")
        _check_text(prompt, where)
        if not chat:
            ids = list(tokenizer(prompt)["input_ids"])
        else:
            prompt, ids = [{"role": "user", "content": prompt}], None
    elif is_token_ids(prompt):
        return _check_ids(tokenizer, prompt, where)
    elif is_conversation(prompt):
        _check_text(prompt, where)
        ids = None
    else:
        raise ValueError(
            f"{where} must be a non-empty string, a non-empty list of token ids or a non-empty list of "
            f"chat messages, got {prompt!r}"
        )
    if ids is None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: chat templating was asked for but the tokenizer has no chat template")
        # tokenize=True renders and tokenizes once with add_special_tokens=False (transformers'
        # apply_chat_template): the template's own BOS is the only one.
        ids = _render_ids(tokenizer.apply_chat_template(
            [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True, return_dict=False
        ))
    if not ids:
        raise ValueError(f"{where} encodes to zero tokens")
    return ids
