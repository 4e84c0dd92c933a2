"""Incremental detokenization (:class:`skipdecode.row_text.IncrementalText`) and the row text built
on it (:class:`~skipdecode.row_text.RowText`): the text after every token equals one decode of
all ids so far, multi-byte characters split across tokens included, on a byte-level BPE tokenizer
(SmolLM2's kind) and on a SentencePiece-style one (a leading space stripped at the start of a text);
the work per row is linear in its tokens (it was quadratic: every token decoded every id again);
stop strings are found as before; the stream's deltas concatenate to the final text.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from conftest import CORPUS, make_tokenizer
from skipdecode.row_text import CONTEXT_TOKENS, FULL_DECODE_IDS, IncrementalText, RowText

EOS = 2  # conftest tokenizer: </s>


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer with SentencePiece's Metaspace rules (Llama 2, Mistral): words carry a
    leading "▁", and a decoded text's first space is stripped."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS + ["naïve café — 東京 ünïcödé"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class CountingTokenizer:
    """Wraps a tokenizer, counting the ids its ``decode`` reads."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0
        self.all_special_ids, self.added_tokens_decoder = tok.all_special_ids, tok.added_tokens_decoder

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kwargs)


def texts_of(tok, n: int, seed: int, text: str) -> list[int]:
    """``n`` ids: ``text`` encoded, then random ids of the vocabulary (bytes that split UTF-8
    characters, special tokens)."""
    rng = random.Random(seed)
    ids = tok(text)["input_ids"]
    return (ids + [rng.randrange(len(tok)) for _ in range(n)])[:n]


@pytest.mark.parametrize("make", [make_tokenizer, metaspace_tokenizer], ids=["byte-level", "metaspace"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_text_equals_one_decode_after_every_token(make, seed):
    tok = make()
    ids = texts_of(tok, 120, seed, "The Eagle is a café — naïve 東京 food. " * 3)
    inc = IncrementalText(tok, drop={EOS})
    kept = []
    for token in ids:
        text = inc.add(token)
        if token != EOS:
            kept.append(token)
        assert text == tok.decode(kept, skip_special_tokens=True)


def test_a_character_split_across_tokens_is_held_until_complete():
    """A multi-byte character whose bytes are separate tokens: the text ends in U+FFFD, as one
    decode does, until its last byte, and the piece is committed only then."""
    tok = make_tokenizer()
    vocab = tok.get_vocab()
    byte_ids = [vocab[c] for c in pre_tokenizers.ByteLevel.alphabet() if c in vocab]
    euro = [tid for tid in (tok.convert_tokens_to_ids(t) for t in tok.tokenize("€")) if tid is not None]
    assert len(byte_ids) > 200 and len(euro) >= 2  # € (3 bytes) is not one token of this vocabulary
    inc = IncrementalText(tok)
    filler = tok("The Eagle is a coffee shop by the riverside. " * 20)["input_ids"][: FULL_DECODE_IDS + 3]
    for token in filler:  # past the whole decodes of a short row: the incremental path holds it
        inc.add(token)
    for i, token in enumerate(euro):
        text = inc.add(token)
        assert text == tok.decode(inc.ids, skip_special_tokens=True)
        assert text.endswith("\ufffd") == (i < len(euro) - 1)
    assert inc.text.endswith("€") and inc.read == len(inc.ids)


@pytest.mark.parametrize("n", [64, 512])
def test_the_decoding_work_of_a_row_is_linear_in_its_tokens(n):
    """Past the first FULL_DECODE_IDS tokens (decoded whole: cheaper there), each token decodes
    at most CONTEXT_TOKENS + a few ids twice (its window and the window's context), and the final
    token one full decode: the old RowText decoded every id at every token, n (n + 1) / 2 in all
    (131,328 ids at 512 tokens, against at most about 7,800 now)."""
    tok = CountingTokenizer(make_tokenizer())
    ids = texts_of(tok.tok, n, 5, "The Eagle is a coffee shop by the riverside. " * 40)
    row = RowText(tok, [EOS], ends_at_eos=False)
    for i, token in enumerate(ids):
        row.push(token, i == n - 1)
    assert row.text == tok.tok.decode([t for t in ids if t != EOS], skip_special_tokens=True)
    assert tok.decoded <= 2 * (CONTEXT_TOKENS + 4) * n + n + FULL_DECODE_IDS * (FULL_DECODE_IDS + 1) / 2
    assert n < 256 or tok.decoded < n * (n + 1) / 2 / 10  # the old work, quadratic


def test_stop_strings_are_found_from_the_incremental_text_and_confirmed():
    """``stopped`` (the engine's check, given the whole id list each time) says True at the token
    that completes a stop string, as one decode of the ids would, and not before; reading the
    ids incrementally costs linear work; a different id list starts over."""
    tok = CountingTokenizer(make_tokenizer())
    ids = tok.tok("The Eagle is a coffee shop with food. " * 12 + "It is by the riverside. It serves food.")["input_ids"]
    row = RowText(tok, [EOS], stop=["riverside"])
    first = next(k for k in range(1, len(ids) + 1) if "riverside" in tok.tok.decode(ids[:k]))
    assert first > FULL_DECODE_IDS + CONTEXT_TOKENS  # found on the incremental path
    answers = [row.stopped(ids[:k]) for k in range(1, first + 1)]
    assert answers == [False] * (first - 1) + [True] and row.reason == "stop"
    assert tok.decoded < 2 * (CONTEXT_TOKENS + 4) * first + first + 1 + FULL_DECODE_IDS * (FULL_DECODE_IDS + 1) / 2
    other = RowText(tok, [EOS], stop=["coffee"])
    assert other.stopped(ids) is True  # the whole list at once
    assert other.stopped(tok.tok("No match here")["input_ids"]) is False  # another row: starts over


@pytest.mark.parametrize("make", [make_tokenizer, metaspace_tokenizer], ids=["byte-level", "metaspace"])
def test_stream_deltas_concatenate_to_the_final_text(make):
    tok = make()
    ids = texts_of(tok, 80, 7, "naïve café 東京 — the riverside")
    row = RowText(tok, [EOS], stop=["zzz"], ends_at_eos=False)
    deltas = [row.push(token, i == len(ids) - 1) for i, token in enumerate(ids)]
    assert "".join(deltas) == row.text == tok.decode([t for t in ids if t != EOS], skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas[:-1] if d) or "\ufffd" in row.text
