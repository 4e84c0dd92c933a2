"""Quality metrics, computed by well-kept libraries only.

* BLEU and chrF: `sacrebleu <https://github.com/mjpost/sacrebleu>`_ (``sacrebleu.metrics.BLEU``
  / ``CHRF``, corpus level, default settings: BLEU with 13a tokenisation and exponential
  smoothing; chrF with character order 6, word order 0, beta 2).
* NIST (the E2E challenge's second metric): ``nltk.translate.nist_score.corpus_nist`` (n = 5) over
  sacrebleu's 13a tokenisation (the tokeniser of mteval-v13a, which the challenge used; case kept,
  as for BLEU). NIST is information-weighted n-gram precision and is *not* on a 0-100 scale.
  nltk scores each hypothesis against its best single reference (mteval clips n-gram counts
  against all references at once), so its values run lower than the challenge's published NIST
  (about 7-9 for E2E systems) and are comparable only with each other. The challenge's METEOR (nltk needs the WordNet corpus, a download)
  and CIDEr (pycocoevalcap, 100 MB with Java parts) are left out: neither works offline from PyPI.
* ROUGE: Google's ``rouge-score`` (``rouge_scorer.RougeScorer`` with ``use_stemmer=True``).
  Note its default tokeniser lower-cases and keeps only ``[a-z0-9]`` tokens, so non-English
  text scores 0.

All scores but NIST are on a 0-100 scale. ``references`` is one entry per hypothesis, each entry the
sequence of reference strings for that item (counts may vary between items); a bare string is
taken as a single reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["METRICS", "corpus_bleu", "corpus_chrf", "corpus_nist", "rouge", "score_all", "paired_bootstrap_bleu"]

#: Metric names understood by :func:`score_all`.
METRICS: tuple[str, ...] = ("bleu", "chrf", "nist", "rouge1", "rouge2", "rougeL")

_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def _validate(hypotheses: Sequence[str], references: Sequence[Sequence[str] | str]
              ) -> tuple[list[str], list[list[str]]]:
    """Check shapes and types; return hypotheses and per-item reference lists."""
    if isinstance(hypotheses, str) or not isinstance(hypotheses, Sequence):
        raise ValueError("hypotheses must be a list of strings (one per item)")
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise ValueError("references must be a list with one sequence of references per item")
    if len(hypotheses) == 0:
        raise ValueError("hypotheses is empty")
    if len(references) == 0:
        raise ValueError("references is empty")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"hypotheses and references differ in length: len(hypotheses)={len(hypotheses)}, "
            f"len(references)={len(references)}")
    hyps = []
    for i, h in enumerate(hypotheses):
        if not isinstance(h, str):
            raise ValueError(f"hypotheses[{i}] must be a string, found {type(h).__name__}")
        hyps.append(h)
    refs = []
    for i, r in enumerate(references):
        if isinstance(r, str):
            r = [r]
        if not isinstance(r, Sequence) or len(r) == 0:
            raise ValueError(f"references[{i}] must be a non-empty sequence of strings")
        for j, x in enumerate(r):
            if not isinstance(x, str):
                raise ValueError(
                    f"references[{i}][{j}] must be a string, found {type(x).__name__}")
        refs.append(list(r))
    return hyps, refs


def _reference_streams(refs: list[list[str]]) -> list[list[str | None]]:
    """Transpose per-item references into sacrebleu reference streams.

    Items with fewer references are padded with ``None``, which sacrebleu drops per segment
    (``Metric._cache_references``: "A particular reference segment can be '' or None to allow
    the use of variable number of references per segment"; only ``None`` is actually removed,
    an empty string would count as an empty reference, so ``None`` is used).
    """
    n = max(len(r) for r in refs)
    return [[r[k] if k < len(r) else None for r in refs] for k in range(n)]


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                **bleu_kwargs: Any) -> float:
    """Corpus BLEU (0-100) computed by ``sacrebleu.metrics.BLEU``.

    Multi-reference with a variable number of references per item (missing ones are passed
    to sacrebleu as ``None``). ``bleu_kwargs`` go to ``BLEU(...)`` (e.g. ``tokenize="13a"``,
    ``lowercase=True``).

    Raises:
        ValueError: empty ``hypotheses``/``references``, different lengths, an item with no
        reference, or a non-string entry (the message names the argument).
    """
    from sacrebleu.metrics import BLEU

    hyps, refs = _validate(hypotheses, references)
    return float(BLEU(**bleu_kwargs).corpus_score(hyps, _reference_streams(refs)).score)


def paired_bootstrap_bleu(baseline: Sequence[str], system: Sequence[str], references: Sequence[Sequence[str]],
                          n_samples: int = 1000, seed: int = 12345) -> dict[str, float]:
    """Paired bootstrap resampling of corpus BLEU (Koehn 2004), by ``sacrebleu.significance.PairedTest``.

    Both systems are scored on the same ``n_samples`` resamples of the items (seeded through
    sacrebleu's ``SACREBLEU_SEED``); the p-value is the share of resamples where the difference
    ``system - baseline`` is not on the side of the observed one (sacrebleu's definition).

    Args:
        baseline, system: one hypothesis per item, same length as ``references``.
        references: per item, one or more reference strings (as :func:`corpus_bleu`).
        n_samples: bootstrap resamples (>= 100).
        seed: resampling seed.

    Returns:
        ``{"baseline": BLEU, "system": BLEU, "difference": system - baseline, "p_value",
        "baseline_ci", "system_ci"}`` (BLEU points; ``*_ci`` the half-width of the 95 % interval
        around the bootstrap mean).

    Raises:
        ValueError: as :func:`corpus_bleu` for either system; ``n_samples`` < 100.
    """
    import os

    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 100:
        raise ValueError(f"n_samples must be an integer >= 100, got {n_samples!r}")
    base, refs = _validate(baseline, references)
    other, _ = _validate(system, references)
    old = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(int(seed))
    try:
        test = PairedTest([("baseline", base), ("system", other)], {"BLEU": BLEU()}, _reference_streams(refs),
                          test_type="bs", n_samples=n_samples)
        _, scores = test()
    finally:
        if old is None:
            os.environ.pop("SACREBLEU_SEED", None)
        else:
            os.environ["SACREBLEU_SEED"] = old
    b, s = scores["BLEU"]
    return {"baseline": float(b.score), "system": float(s.score), "difference": float(s.score - b.score),
            "p_value": float(s.p_value), "baseline_ci": float(b.ci), "system_ci": float(s.ci)}


def corpus_chrf(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                **chrf_kwargs: Any) -> float:
    """Corpus chrF (0-100) computed by ``sacrebleu.metrics.CHRF`` (multi-reference as BLEU).

    ``chrf_kwargs`` go to ``CHRF(...)`` (``word_order=2`` gives chrF++).

    Raises:
        ValueError: as :func:`corpus_bleu`.
    """
    from sacrebleu.metrics import CHRF

    hyps, refs = _validate(hypotheses, references)
    return float(CHRF(**chrf_kwargs).corpus_score(hyps, _reference_streams(refs)).score)


def corpus_nist(hypotheses: Sequence[str], references: Sequence[Sequence[str]], n: int = 5) -> float:
    """Corpus NIST score (Doddington 2002), multi-reference, computed by nltk.

    Text is tokenised by sacrebleu's ``Tokenizer13a`` (mteval-v13a's rules), then scored by
    ``nltk.translate.nist_score.corpus_nist(references, hypotheses, n)``. nltk divides by zero when
    no hypothesis has ``n`` tokens; then the order is lowered to the longest hypothesis' length
    (0.0 when every hypothesis is empty), so a degenerate system scores instead of crashing.

    Returns:
        NIST score (>= 0, not bounded by 100). nltk uses the best single reference per item, so
        values run below mteval-v13a's multi-reference NIST; compare them only with each other.
    Raises:
        ValueError: as :func:`corpus_bleu`, or ``n`` < 1.
    """
    from nltk.translate.nist_score import corpus_nist as nltk_corpus_nist
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    hyps, refs = _validate(hypotheses, references)
    tok = Tokenizer13a()
    hyp_tokens = [tok(h).split() for h in hyps]
    ref_tokens = [[tok(x).split() for x in r] for r in refs]
    order = min(n, max(len(h) for h in hyp_tokens))
    if order == 0:
        return 0.0
    return float(nltk_corpus_nist(ref_tokens, hyp_tokens, n=order))


def rouge(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """ROUGE-1/2/L F-measure (0-100), averaged over items.

    Computed by ``rouge_score.rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"],
    use_stemmer=True)``; for each item and each ROUGE type the reference with the highest
    F-measure is used (``RougeScorer.score_multi``), then items are averaged (macro mean).

    Returns:
        ``{"rouge1": ..., "rouge2": ..., "rougeL": ...}``.
    Raises:
        ValueError: as :func:`corpus_bleu`.
    """
    from rouge_score import rouge_scorer

    hyps, refs = _validate(hypotheses, references)
    scorer = rouge_scorer.RougeScorer(list(_ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(_ROUGE_TYPES, 0.0)
    for h, r in zip(hyps, refs):
        best = scorer.score_multi(r, h)
        for k in _ROUGE_TYPES:
            totals[k] += best[k].fmeasure
    return {k: 100.0 * v / len(hyps) for k, v in totals.items()}


def score_all(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
              metrics: Sequence[str] = ("bleu", "chrf", "rougeL")) -> dict[str, float]:
    """Several metrics at once, keyed by name, each on a 0-100 scale except ``nist``.

    ``metrics`` may hold any of :data:`METRICS` (``bleu``, ``chrf``, ``nist``, ``rouge1``, ``rouge2``,
    ``rougeL``); ROUGE is computed once for all ROUGE names. Libraries as in the individual
    functions.

    Raises:
        ValueError: an unknown or empty ``metrics``, or invalid inputs (as :func:`corpus_bleu`).
    """
    if isinstance(metrics, str):
        metrics = (metrics,)
    if not metrics:
        raise ValueError("metrics is empty; choose from " + ", ".join(METRICS))
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(
            f"unknown metric(s) {', '.join(map(repr, unknown))} in metrics; "
            f"known: {', '.join(METRICS)}")
    _validate(hypotheses, references)
    out: dict[str, float] = {}
    rouge_scores: dict[str, float] | None = None
    for m in metrics:
        if m == "bleu":
            out[m] = corpus_bleu(hypotheses, references)
        elif m == "chrf":
            out[m] = corpus_chrf(hypotheses, references)
        elif m == "nist":
            out[m] = corpus_nist(hypotheses, references)
        else:
            if rouge_scores is None:
                rouge_scores = rouge(hypotheses, references)
            out[m] = rouge_scores[m]
    return out
