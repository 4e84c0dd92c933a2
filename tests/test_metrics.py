"""Tests for skipdecode.metrics (scores come from sacrebleu / rouge-score)."""

from __future__ import annotations

import pytest
import sacrebleu
from rouge_score import rouge_scorer

from skipdecode.metrics import METRICS, corpus_bleu, corpus_chrf, corpus_nist, rouge, score_all

SENTS = [
    "the cat sat on the mat near the door",
    "a quick brown fox jumps over the lazy dog today",
]


def test_identical_text_gives_maximum_scores():
    refs = [[s] for s in SENTS]
    assert corpus_bleu(SENTS, refs) == pytest.approx(100.0)
    assert corpus_chrf(SENTS, refs) == pytest.approx(100.0)
    r = rouge(SENTS, refs)
    assert set(r) == {"rouge1", "rouge2", "rougeL"}
    for v in r.values():
        assert v == pytest.approx(100.0)


def test_disjoint_text_gives_zero():
    hyps = ["alpha beta gamma delta epsilon", "zeta eta theta iota kappa"]
    refs = [["one two three four five"], ["six seven eight nine ten"]]
    assert corpus_bleu(hyps, refs) == 0.0
    r = rouge(hyps, refs)
    assert r["rouge1"] == 0.0 and r["rouge2"] == 0.0 and r["rougeL"] == 0.0


def test_variable_reference_counts_match_sacrebleu_directly():
    hyps = [
        "the restaurant serves cheap italian food in the city centre",
        "blue spice is a coffee shop near the river",
        "it is family friendly",
    ]
    refs = [
        ["the restaurant offers cheap italian food in the centre of the city",
         "cheap italian food is served in the city centre restaurant",
         "in the city centre there is a cheap italian restaurant"],
        ["blue spice is a coffee shop by the river"],
        ["it is a family friendly place", "children are welcome"],
    ]
    # Reference streams built by hand, padding missing references with None as sacrebleu allows.
    streams = [
        [refs[0][0], refs[1][0], refs[2][0]],
        [refs[0][1], None, refs[2][1]],
        [refs[0][2], None, None],
    ]
    expected_bleu = sacrebleu.metrics.BLEU().corpus_score(hyps, streams).score
    expected_chrf = sacrebleu.metrics.CHRF().corpus_score(hyps, streams).score
    assert corpus_bleu(hyps, refs) == pytest.approx(expected_bleu)
    assert corpus_chrf(hyps, refs) == pytest.approx(expected_chrf)
    assert 0.0 < expected_bleu < 100.0

    # Extra references can only help BLEU: compare with a single-reference run.
    single = sacrebleu.metrics.BLEU().corpus_score(hyps, [streams[0]]).score
    assert corpus_bleu(hyps, refs) >= single


def test_rouge_takes_best_reference_per_item_and_averages():
    hyps = ["the cat sat on the mat", "dogs run fast in the park"]
    refs = [["something entirely different here", "the cat sat on the mat"],
            ["dogs run quickly in a park"]]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    item2 = scorer.score(refs[1][0], hyps[1])
    got = rouge(hyps, refs)
    for k in ("rouge1", "rouge2", "rougeL"):
        # item 1 matches its second reference exactly -> 1.0
        assert got[k] == pytest.approx(100.0 * (1.0 + item2[k].fmeasure) / 2)


def test_bare_string_reference_is_one_reference():
    assert corpus_bleu([SENTS[0]], [SENTS[0]]) == pytest.approx(100.0)


def test_score_all_selects_metrics():
    refs = [[s] for s in SENTS]
    out = score_all(SENTS, refs)
    assert list(out) == ["bleu", "chrf", "rougeL"]
    out = score_all(SENTS, refs, metrics=METRICS)
    assert set(out) == set(METRICS)
    assert all(v == pytest.approx(100.0) for k, v in out.items() if k != "nist")  # NIST is not 0-100
    assert out["nist"] == pytest.approx(corpus_nist(SENTS, refs))


def test_nist_matches_nltk_on_13a_tokens_with_several_references():
    from nltk.translate.nist_score import corpus_nist as nltk_nist

    hyps = ["The Eagle is a coffee shop near Burger King.", "Blue Spice serves cheap French food."]
    refs = [["The Eagle is a coffee shop.", "Near Burger King, there is a coffee shop called The Eagle."],
            ["Blue Spice is a cheap French restaurant."]]
    # the library directly, on mteval-13a tokens ("shop." -> "shop", ".")
    expected = nltk_nist(
        [[r.replace(".", " .").replace(",", " ,").split() for r in rs] for rs in refs],
        [h.replace(".", " .").split() for h in hyps], n=5)
    assert corpus_nist(hyps, refs) == pytest.approx(expected)
    assert corpus_nist(hyps, refs) > corpus_nist(hyps, [rs[:1] for rs in refs[:1]] + [refs[1]]) > 0
    assert corpus_nist(["one two three four five six"], [["seven eight nine ten eleven"]]) == 0.0
    perfect = corpus_nist([refs[1][0]], [refs[1]])
    assert perfect > corpus_nist(["Blue Spice is a French pub."], [refs[1]]) > 0


def test_nist_short_and_empty_hypotheses_do_not_crash():
    # nltk alone divides by zero when no hypothesis has 5 tokens; the order is lowered instead
    assert corpus_nist(["a cat"], [["a cat sat"]]) > 0
    assert corpus_nist(["", ""], [["a cat"], ["a dog"]]) == 0.0
    with pytest.raises(ValueError, match="n must be"):
        corpus_nist(["a"], [["a"]], n=0)


@pytest.mark.parametrize("fn", [corpus_bleu, corpus_chrf, corpus_nist, rouge, score_all])
def test_validation_errors_name_the_argument(fn):
    with pytest.raises(ValueError, match="hypotheses"):
        fn([], [["a"]])
    with pytest.raises(ValueError, match="references"):
        fn(["a"], [])
    with pytest.raises(ValueError, match=r"len\(hypotheses\)=2.*len\(references\)=1"):
        fn(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match=r"references\[0\]"):
        fn(["a"], [[]])
    with pytest.raises(ValueError, match=r"hypotheses\[0\]"):
        fn([None], [["a"]])
    with pytest.raises(ValueError, match="hypotheses"):
        fn("a string", [["a"]])


def test_score_all_rejects_unknown_metric():
    with pytest.raises(ValueError, match="meteor"):
        score_all(["a"], [["a"]], metrics=("bleu", "meteor"))
    with pytest.raises(ValueError, match="metrics"):
        score_all(["a"], [["a"]], metrics=())
