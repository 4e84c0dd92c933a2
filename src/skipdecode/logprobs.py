"""Log-probabilities of generated tokens: computed by the in-flight engine for the rows that ask,
and written in OpenAI's two response shapes.

What a log-probability is here: ``log_softmax`` of the logits the token was drawn from, over the
whole vocabulary, *before* the penalties, temperature, top-k and top-p (the model's own distribution at that
step, as vLLM's default ``logprobs_mode="raw_logprobs"``), in float32. Under a skip policy these
are the logits of the layers that ran at that step, so they show what skipping does to the
model's confidence; the first token comes from the full-depth prefill. With a quantized head
(``quantize="int4"``, ``"w8a8"``, ``"head"``) the logits are those of
:class:`~skipdecode.rescored_head.RescoredHead`: exact int8 logits for each row's top 64
candidates, the preview elsewhere, so the normalisation includes the preview's values.

Shapes written (OpenAI API reference):

- ``/v1/completions`` (``logprobs: n``): ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``, one entry per token; ``top_logprobs[i]`` maps the ``n`` most likely token
  strings, and the chosen one, to their log-probabilities (up to n + 1 entries, as OpenAI says;
  fewer where ids decode to the same string, the chosen id's value kept for its string).
- ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: n``): ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [n x {"token", "logprob", "bytes"}]}], "refusal": null}``.

A token's ``bytes`` are its own raw bytes (:func:`token_bytes`: for byte-level BPE tokenizers,
GPT-2's byte-to-unicode table inverted; ``<0xHH>`` byte-fallback pieces; else the UTF-8 of its
decoded text), so the bytes of consecutive tokens join into the text even where one character
spans several tokens, as OpenAI intends. Its string (:func:`token_string`) is those bytes decoded
where they are valid UTF-8, else OpenAI's form for part of a character, ``"bytes:"`` and each byte
as ``\\xNN`` (``"bytes:\\xe2\\x80"``), from which clients rebuild the text.
Completions' ``text_offset`` counts the characters the tokens before it complete.
(SentencePiece tokenizers: a piece's "▁" reads as a space, also on a row's first token, whose
leading space the text's decoding strips, so there the joined bytes hold one extra leading space.)
Tokens the text leaves out get no entry: EOS ids (also under ``ignore_eos``) and special tokens
(the text is decoded with ``skip_special_tokens``). The token that completed a stop string keeps
its entry (as vLLM), so with ``stop`` the last entries can reach past the returned text.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch

__all__ = ["MAX_LOGPROBS", "check_logprobs", "TokenLogprobs", "token_logprobs", "requested_logprobs",
           "token_bytes", "token_string", "TextOffsets", "completion_logprobs", "chat_logprobs", "logprobs_record"]

#: Most alternatives per token a request may ask for (``logprobs`` / ``top_logprobs``), OpenAI's
#: chat limit (0-20) and vLLM's default ``max_logprobs``.
MAX_LOGPROBS = 20


def check_logprobs(value: Any, name: str = "logprobs") -> int | None:
    """``value`` if it is None or an integer in [0, :data:`MAX_LOGPROBS`] (alternatives per
    token), else ValueError naming ``name`` (the API's ``logprobs``, the CLI's ``--logprobs``)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
        raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token), got {value!r}")
    return value


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and its most likely alternatives.

    Attributes:
        token: the generated id.
        logprob: its natural-log probability (<= 0).
        top: the ``n`` most likely ids with theirs, most likely first (``n`` = what the request
            asked for; the chosen id appears here only if it is among them).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprobs]:
    """Log-probabilities of ``tokens`` under ``logits``, one row each.

    Args:
        logits: (R, V) the logits each row's token was drawn from (any float dtype).
        tokens: R generated ids.
        top_n: per row, how many alternatives to return (0..V).

    Returns:
        R :class:`TokenLogprobs`: ``logprob = log_softmax(logits[r].float())[tokens[r]]``, and
        ``top`` the ``top_n[r]`` largest entries of that row (``torch.topk``, most likely first).

    Raises:
        ValueError: ``logits`` not 2-D, or ``tokens`` / ``top_n`` of another length than its rows.
    """
    if logits.ndim != 2 or len(tokens) != logits.shape[0] or len(top_n) != logits.shape[0]:
        raise ValueError(f"logits must be (R, V) with R = len(tokens) = len(top_n); got {tuple(logits.shape)}, "
                         f"{len(tokens)} tokens and {len(top_n)} top_n values")
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.as_tensor(list(tokens), device=lp.device)[:, None])[:, 0].tolist()
    k = max(top_n)
    values, ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprobs(int(t), c, tuple(zip(ids[r][:n], values[r][:n])))
            for r, (t, c, n) in enumerate(zip(tokens, chosen, top_n))]


def requested_logprobs(top_n: Sequence[int | None], logits: torch.Tensor,
                       tokens: Sequence[int]) -> dict[int, TokenLogprobs]:
    """``{i: TokenLogprobs}`` for the rows i of ``logits`` (B, V) whose ``top_n[i]`` is not None
    (rows that asked for log-probabilities), computed together by :func:`token_logprobs`;
    ``tokens`` are the B generated ids. Rows that did not ask cost nothing."""
    asked = [i for i, n in enumerate(top_n) if n is not None]
    if not asked:
        return {}
    picked = logits.index_select(0, torch.tensor(asked, device=logits.device))
    return dict(zip(asked, token_logprobs(picked, [tokens[i] for i in asked], [top_n[i] for i in asked])))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (``bytes_to_unicode`` inverted, as
    transformers builds byte-level tokenizers with it); {} if transformers no longer has it."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # pragma: no cover - depends on the transformers version
        return {}
    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(tokenizer: Any) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The raw bytes token ``token`` stands for: a byte-level BPE piece mapped back through GPT-2's
    table, a ``<0xHH>`` byte-fallback piece as its byte, a special token or any other piece as the
    UTF-8 of ``tokenizer.decode([token])`` (SentencePiece's "▁" as a space)."""
    piece = tokenizer.convert_ids_to_tokens(int(token))
    if isinstance(piece, str) and int(token) not in set(tokenizer.all_special_ids):
        table = _byte_decoder()
        if _byte_level(tokenizer) and table and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([int(token)]).encode("utf-8")


def token_string(raw: bytes) -> str:
    """A token's string in a ``logprobs`` response, from its bytes ``raw`` (:func:`token_bytes`):
    ``raw`` decoded when it is valid UTF-8, else OpenAI's form for a token holding part of a
    character, ``"bytes:"`` followed by every byte as a backslash, ``x`` and two lower-case hex
    digits (``b"\\xe2\\x80"`` -> ``bytes:\\xe2\\x80``, as OpenAI's legacy completions write
    them), so that clients can rebuild the text where U+FFFD would lose it."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _text(tokenizer: Any, token: int) -> str:
    return token_string(token_bytes(tokenizer, token))


class TextOffsets:
    """Where a row's next token starts in its text (characters), carried from chunk to chunk of
    a stream: the characters its earlier tokens' bytes complete, an invalid byte sequence as one
    U+FFFD each, through Python's incremental UTF-8 decoder (``errors="replace"``), which holds
    back a character's first bytes until it is complete, as the text's decoding does. Each chunk
    reads only its own tokens' bytes (a stream that kept the row's bytes and decoded them again at
    every event did O(n) work an event).

    Attributes:
        chars: characters completed so far.
    """

    def __init__(self, before: bytes = b"") -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = len(self._decoder.decode(before))

    def advance(self, raw: Sequence[bytes]) -> list[int]:
        """The offsets of tokens with bytes ``raw`` (each before its own bytes), in order; the
        state moves past them."""
        offsets = []
        for b in raw:
            offsets.append(self.chars)
            self.chars += len(self._decoder.decode(b))
        return offsets


def completion_logprobs(entries: Sequence[TokenLogprobs], tokenizer: Any, before: bytes | TextOffsets = b"") -> dict[str, Any]:
    """The ``logprobs`` object of a ``/v1/completions`` choice (or chunk) for ``entries``.

    ``text_offset``: the characters of the text before each token (:class:`TextOffsets`).
    ``before``: the bytes of the row's earlier tokens, or a stream's :class:`TextOffsets` for the
    row, which this call advances past ``entries``."""
    raw = [token_bytes(tokenizer, e.token) for e in entries]
    tokens = [token_string(b) for b in raw]
    offsets = (before if isinstance(before, TextOffsets) else TextOffsets(before)).advance(raw)
    top = []
    for e, s in zip(entries, tokens):
        alts = {_text(tokenizer, t): lp for t, lp in e.top}
        alts[s] = e.logprob  # ids with the same string share a key: the chosen one's value wins
        top.append(alts)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def _chat_token(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token)
    return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(entries: Sequence[TokenLogprobs], tokenizer: Any) -> dict[str, Any]:
    """The ``logprobs`` object of a ``/v1/chat/completions`` choice (or chunk) for ``entries``."""
    content = [{**_chat_token(tokenizer, e.token, e.logprob),
                "top_logprobs": [_chat_token(tokenizer, t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def logprobs_record(entries: Sequence[TokenLogprobs], tokenizer: Any) -> list[dict[str, Any]]:
    """``entries`` as JSON-ready dicts (``skipdecode generate --logprobs N --json``): per token
    ``{"token": id, "text", "bytes", "logprob", "top": [{"token": id, "text", "bytes", "logprob"}]}``,
    ``bytes`` the token's own (:func:`token_bytes`) and ``text`` its :func:`token_string`."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(tokenizer, token)
        return {"token": token, "text": token_string(raw), "bytes": list(raw),
                "logprob": logprob}

    return [{**one(e.token, e.logprob), "top": [one(t, lp) for t, lp in e.top]} for e in entries]
