"""The agreement scores of ``benchmarks/adapter_agreement.py``: exact share, ROUGE-L against the
reference answers, and the first divergence (tokens), plus its Markdown table."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("adapter_agreement")


def test_first_divergence(script):
    assert script.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert script.first_divergence([5, 2], [1, 2]) == 0
    assert script.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert script.first_divergence([1, 2], [1, 2, 3, 4]) == 2  # a prefix: its length


def test_score_against_reference(script):
    ref = {"texts": ["the cat sat", "a dog ran home"], "token_ids": [[1, 2, 3], [4, 5, 6, 7]]}
    out = {"texts": ["the cat sat", "a dog ran"], "token_ids": [[1, 2, 3], [4, 5, 6, 9]]}
    s = script.score(out, ref)
    assert s["exact"] == pytest.approx(50.0)
    assert s["first_divergence"] == pytest.approx((3 + 3) / 2)
    assert 80 < s["rougeL"] < 100  # one answer identical, one missing a word
    assert script.score(ref, ref)["rougeL"] == pytest.approx(100.0)


def test_markdown_has_the_divergence_column(script):
    row = {"model": "stock", "policy_label": "full", "exact": 100.0, "rougeL": 100.0, "first_divergence": 12.5,
           "mean_active_layers": 30.0, "theoretical_speedup": 1.0, "texts": ["x"]}
    md = script.to_markdown({"n_prompts": 1, "max_new_tokens": 40, "num_layers": 30, "rows": [row],
                             "example_indices": [0], "prompts": [{"prompt": "p"}]})
    assert "first divergence (tokens)" in md and "| 12.5 |" in md


def test_markdown_says_which_split_it_measured(script):
    row = {"model": "adapted", "policy_label": "2x", "exact": 0.0, "rougeL": 50.0, "first_divergence": 3.0,
           "mean_active_layers": 15.0, "theoretical_speedup": 2.0, "texts": ["x"]}
    report = {"n_prompts": 1, "max_new_tokens": 40, "num_layers": 30, "rows": [row],
              "example_indices": [0], "prompts": [{"prompt": "p"}]}
    held = script.to_markdown(report)
    assert held.startswith("Held-out prompts: 1 (never trained on)")
    train = script.to_markdown({**report, "split": "train"})
    assert train.startswith("Training prompts") and "never trained on" not in train


def test_speedups_option_parses_and_refuses_bad_values(script, capsys):
    """``--speedups`` takes numbers >= 1, "" for none; anything else exits 2 naming the option."""
    assert script._speedup_list("2,3") == [2.0, 3.0]
    assert script._speedup_list("") == []
    for bad in ("x", "2,0.5"):
        with pytest.raises(SystemExit) as exc:
            script.main(["--speedups", bad])
        assert exc.value.code == 2
        assert "argument --speedups: takes comma-separated numbers >= 1" in capsys.readouterr().err


def test_limit_below_one_is_refused_before_any_loading(script, capsys):
    """``--limit 0`` used to mean every prompt (a full run instead of a smoke test)."""
    with pytest.raises(SystemExit) as exc:
        script.main(["--limit", "0"])
    assert exc.value.code == 2 and "--limit must be >= 1" in capsys.readouterr().err


def test_schedules_option_parses_and_refuses_bad_values(script, capsys):
    """``--schedules`` takes MAX:MIN pairs with MAX >= MIN >= 1, "" for none; anything else exits 2
    naming the option, before any model loads."""
    assert script._schedule_list("25:7, 25:9") == [(25, 7, None), (25, 9, None)]
    assert script._schedule_list("25:10:32") == [(25, 10, 32)]
    assert script._schedule_list("") == []
    for bad in ("25", "7:25", "25:0", "a:b", "25:7:0", "25:7:32:1"):
        with pytest.raises(SystemExit) as exc:
            script.main(["--schedules", bad])
        assert exc.value.code == 2
        assert "argument --schedules: takes comma-separated MAX:MIN layer pairs" in capsys.readouterr().err


def test_recorded_command_reruns_with_the_same_arguments(script):
    """The results file's command, split by a shell, gives back every argument, the empty
    ``--speedups ''`` included (it was written unquoted, so a rerun read the next option as its value)."""
    import shlex

    argv = ["--adapter", "runs/a b/final", "--speedups", "", "--trained-policy", "--max-new-tokens", "128"]
    assert shlex.split(script.command_line(argv)) == ["python", "benchmarks/adapter_agreement.py", *argv]
