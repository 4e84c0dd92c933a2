"""The text of one generated row, token by token: EOS left out, cut at stop strings, and the
deltas a stream may send without ever taking text back (:class:`RowText`). Used by
:func:`skipdecode.generate.stream_generate`, the in-flight engine's callers and the server."""

from __future__ import annotations

from typing import Sequence

__all__ = ["CONTEXT_TOKENS", "FULL_DECODE_IDS", "IncrementalText", "RowText"]


def _partial_stop_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _special_ids(tokenizer) -> set[int]:
    """The ids ``decode(..., skip_special_tokens=True)`` drops: the named special tokens and every
    added token marked special (e.g. a chat template's ``<|im_end|>``)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return ids | {int(i) for i, t in added.items() if getattr(t, "special", False)}


#: tokens before the window's new ones that each incremental decode re-reads, so that a
#: tokenizer's rules at the start of a text (SentencePiece's leading space) apply to them, not to
#: the new tokens (vLLM's ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`` is 5 as well)
CONTEXT_TOKENS = 5

#: rows of at most this many ids decode all of them at each token, which costs less than the two
#: small decodes of an incremental step until about 50 ids with SmolLM2's tokenizer (about 6 us a
#: call plus 0.14 us an id)
FULL_DECODE_IDS = 48


class IncrementalText:
    """The text of a growing list of token ids, decoded a few tokens at a time.

    Decoding all ids at every token costs O(n) per token, O(n^2) a row: 84 us a token at 1000
    tokens with SmolLM2's tokenizer (a 16-row server streaming 1000-token answers spent 1.3 CPU-s
    a wave on it). Each :meth:`add` decodes only the ids since a read offset, after up to
    :data:`CONTEXT_TOKENS` ids of context, and keeps the difference (vLLM's incremental
    detokenization, ``detokenize_incrementally``; rows of at most :data:`FULL_DECODE_IDS` ids
    decode them all, which is cheaper there): a new piece is committed once it decodes to
    more text than its context alone and does not end in U+FFFD (a multi-byte character split
    across tokens); until then :attr:`text` ends with the uncommitted piece as the full decode
    would. For byte-level BPE (SmolLM2, GPT-2, Llama 3, Qwen2) decoding is a concatenation of
    bytes, so :attr:`text` equals ``tokenizer.decode(ids, skip_special_tokens=True)``; callers
    that need that exactly at the end (:meth:`RowText.push` with ``final``) decode once in full.

    Args:
        tokenizer: the model's HF tokenizer.
        drop: ids left out of the text (EOS); special tokens are skipped by the decode itself.

    Attributes:
        ids: the ids decoded so far (``drop`` ones left out).
        text: their text.
    """

    def __init__(self, tokenizer, drop: set[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.drop = drop
        self.ids: list[int] = []
        self.committed = ""
        self.text = ""
        self.read = 0  # ids before this are in ``committed``

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append ``token`` (ignored if in ``drop``); returns :attr:`text`."""
        if token in self.drop:
            return self.text
        self.ids.append(token)
        if len(self.ids) <= FULL_DECODE_IDS:
            self.text = self._decode(self.ids)
            if not self.text.endswith("\ufffd"):
                self.committed, self.read = self.text, len(self.ids)
            return self.text
        start = max(0, self.read - CONTEXT_TOKENS)
        context = self._decode(self.ids[start : self.read]) if start < self.read else ""
        window = self._decode(self.ids[start:])
        piece = window[len(context) :] if window.startswith(context) else None
        if piece is None:  # the context decoded differently beside the new ids: decode it all
            self.committed, self.read = self._decode(self.ids), len(self.ids)
            self.text = self.committed
        elif piece and not window.endswith("\ufffd"):
            self.committed += piece
            self.read = len(self.ids)
            self.text = self.committed
        else:
            self.text = self.committed + piece
        return self.text


class RowText:
    """The text of one generated row, built token by token, and the deltas to stream.

    Args:
        tokenizer: the model's HF tokenizer (decodes with ``skip_special_tokens``).
        eos_token_ids: ids that end the row (left out of the text).
        stop: stop strings; the text is cut before the first one found.
        ends_at_eos: False when EOS does not end the row (a request's ``ignore_eos``): EOS ids are
            still left out of the text, but pushing one does not make the reason "eos".

    Attributes:
        ids: generated ids so far (a final EOS included).
        text: the row's text so far (EOS left out, cut at a stop string).
        reason: "length", "eos" (an EOS id was pushed and ends the row) or "stop" (:meth:`stopped`
            found one).
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], stop: Sequence[str] = (),
                 ends_at_eos: bool = True) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.hidden = self.eos | _special_ids(tokenizer)  # never in the text
        self.ends_at_eos = ends_at_eos
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""
        self.printed = ""
        self.reason = "length"
        self._pushed = IncrementalText(tokenizer, self.eos)  # push's (the caller's thread)
        self._seen = IncrementalText(tokenizer)  # stopped's (the engine's thread): every id it is given

    def in_text(self, token: int) -> bool:
        """Whether ``token`` shows in the text: EOS ids and special tokens (which the text's
        ``skip_special_tokens`` decoding drops) do not."""
        return token not in self.hidden

    def stopped(self, ids: Sequence[int]) -> bool:
        """True (and reason "stop") when the text of ``ids`` contains a stop string."""
        if not self.stop:
            return False
        seen, n = self._seen, len(self._seen.ids)
        if len(ids) < n or (n and ids[n - 1] != seen.ids[-1]):  # not the same row grown: start over
            seen = self._seen = IncrementalText(self.tokenizer)
        for token in ids[len(seen.ids) :]:
            seen.add(token)
        if any(s in seen.text for s in self.stop):
            text = self.tokenizer.decode(list(ids), skip_special_tokens=True)  # confirmed in full, once
            if any(s in text for s in self.stop):
                self.reason = "stop"
                return True
        return False

    def push(self, token: int, final: bool) -> str:
        """Add generated ``token``; ``final`` when the row ends with it. Returns the new text to
        stream ("" when nothing visible is new)."""
        self.ids.append(token)
        if token in self.eos and self.ends_at_eos:
            self.reason = "eos"
        text = self._pushed.add(token)
        if final:  # the row's text exactly as one decode of its ids gives it
            text = self.tokenizer.decode([t for t in self.ids if t not in self.eos], skip_special_tokens=True)
        if self.reason == "stop":
            cut = min((text.find(s) for s in self.stop if s in text), default=len(text))
            text = text[:cut]
        self.text = text
        # Hold back a trailing U+FFFD (a multi-byte character split across tokens) until the
        # row's next token completes it or the row ends, so deltas never need rewriting.
        shown = text if final else text.rstrip("\ufffd")
        if not final:
            # Likewise hold back a tail that may begin a stop string: it is cut if the stop
            # string completes on a later token, and a streamed delta cannot be taken back.
            shown = shown[: len(shown) - _partial_stop_len(shown, self.stop)]
        if shown.startswith(self.printed) and len(shown) > len(self.printed):
            delta = shown[len(self.printed) :]
            self.printed = shown
            return delta
        return ""
