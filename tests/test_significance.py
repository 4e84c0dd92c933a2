"""Paired bootstrap BLEU (skipdecode.metrics.paired_bootstrap_bleu, benchmarks/significance.py)."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark
from skipdecode.metrics import corpus_bleu, paired_bootstrap_bleu

REFS = [[f"the {w} shop is near the river and serves food"] for w in
        ("red", "blue", "green", "old", "new", "small", "big", "quiet", "busy", "cheap")] * 6
GOOD = [r[0] for r in REFS]
BAD = ["a place" for _ in REFS]


def test_paired_bootstrap_scores_and_p_values():
    near = GOOD[:-1] + ["the red shop is near the river"]  # one item of 60 a little worse
    close = paired_bootstrap_bleu(GOOD, near, REFS, n_samples=200)
    assert close["system"] == pytest.approx(corpus_bleu(near, REFS)) and close["baseline"] == pytest.approx(100)
    assert -3 < close["difference"] < 0 and close["p_value"] > 0.05  # within resampling noise
    worse = paired_bootstrap_bleu(GOOD, BAD, REFS, n_samples=200)
    assert worse["difference"] == pytest.approx(corpus_bleu(BAD, REFS) - corpus_bleu(GOOD, REFS))
    assert worse["difference"] < -50 and worse["p_value"] < 0.01
    with pytest.raises(ValueError, match="n_samples"):
        paired_bootstrap_bleu(GOOD, GOOD, REFS, n_samples=10)
    with pytest.raises(ValueError):
        paired_bootstrap_bleu(GOOD, BAD[:-1], REFS)


def _report(path, model, policy, gens, prompts=None):
    items = [{"prompt": p, "references": r} for p, r in zip(prompts or [f"mr {i}" for i in range(len(REFS))], REFS)]
    path.write_text(json.dumps({"items": items, "rows": [{"model": model, "policy": policy, "generations": gens}]}))
    return f"{path}:{model}:{policy}"


def test_script_compares_rows_and_refuses_bad_specs(tmp_path, capsys):
    sig = load_benchmark("significance")
    base = _report(tmp_path / "a.json", "1x", "full", GOOD)
    worse = _report(tmp_path / "b.json", "2x", "checkpoint", BAD)
    assert sig.main(["--baseline", base, "--system", worse, "--samples", "200", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "significance.json").read_text())
    (row,) = saved["comparisons"]
    assert row["system"].endswith("b.json:2x:checkpoint") and row["p_value"] < 0.01 and row["difference"] < -50
    other = _report(tmp_path / "c.json", "2x", "checkpoint", BAD, prompts=[f"other {i}" for i in range(len(REFS))])
    for spec, words in ((f"{tmp_path / 'b.json'}:2x:full", "no row 2x:full"), ("nocolons", "REPORT.json:MODEL:POLICY"),
                        (other, "other items")):
        capsys.readouterr()
        assert sig.main(["--baseline", base, "--system", spec, "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and words in err and len(err.splitlines()) == 1
