"""benchmarks/engine_load.py on a tiny Llama saved locally: the closed loop serves every timed
request once, its statistics add up, the ratios follow from the rows, results and plot are
written, bad arguments exit 2 (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from conftest import load_benchmark

PROMPTS = ["The Eagle is a", "Blue Spice serves", "The Mill is", "Aromi has", "Zizzi is a", "Cotto serves"]


def test_engine_load_rows_ratios_and_outputs(saved, tmp_path, monkeypatch, capsys):  # noqa: F811
    engine_load = load_benchmark("engine_load")
    monkeypatch.setattr(engine_load, "prompts", lambda: list(PROMPTS))
    result = engine_load.main(["--model", str(saved), "--clients", "2", "--requests-per-client", "2",
                               "--max-tokens", "3", "--speedups", "1,2", "--align-steps", "2",
                               "--out", str(tmp_path), "--name", "t"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "t.png").stat().st_size > 0
    full, two = result["rows"]
    for row in (full, two):
        assert row["requests"] == 8  # max(8, 2 clients x 2): each timed request finished once
        generated = round(row["tokens_per_second"] * row["seconds"])
        assert 8 <= generated <= 8 * 3
        assert 0 < row["prefill_s"] and 0 < row["decode_s"] and row["prefill_s"] + row["decode_s"] <= row["seconds"]
        assert 1 <= row["mean_rows_per_decode_step"] <= 2
        assert row["computed_prompt_tokens"] > 0
    assert full["theoretical_speedup"] == 1.0 and two["theoretical_speedup"] > 1.0
    (ratio,) = result["ratios"]
    assert ratio["requests_per_second_ratio"] == pytest.approx(two["requests_per_second"] / full["requests_per_second"])
    total = full["prefill_s"] + full["decode_s"]
    assert ratio["ceiling_at_theoretical_decode"] == pytest.approx(
        total / (full["prefill_s"] + full["decode_s"] / two["theoretical_speedup"]))
    assert result["align_steps"] == 2 and result["command"].startswith("python benchmarks/engine_load.py")


def test_engine_load_repeats_alternate_the_order_and_take_medians(saved, tmp_path, monkeypatch, capsys):  # noqa: F811
    """--repeats 3: the cells run 1,2 / 2,1 / 1,2, each row says its run, and the ratio is the median
    of the three runs' ratios (each computed within its own run), which are kept in ``runs``."""
    import statistics

    engine_load = load_benchmark("engine_load")
    monkeypatch.setattr(engine_load, "prompts", lambda: list(PROMPTS))
    result = engine_load.main(["--model", str(saved), "--clients", "2", "--requests-per-client", "1",
                               "--max-tokens", "2", "--speedups", "1,2", "--repeats", "3",
                               "--out", str(tmp_path), "--name", "r"])
    rows = result["rows"]
    assert [(r["repeat"], r["speedup"]) for r in rows] == [(0, 1.0), (0, 2.0), (1, 2.0), (1, 1.0), (2, 1.0), (2, 2.0)]
    (ratio,) = result["ratios"]
    runs = [two["requests_per_second"] / full["requests_per_second"]
            for full, two in ((rows[0], rows[1]), (rows[3], rows[2]), (rows[4], rows[5]))]
    assert ratio["runs"] == pytest.approx(runs)
    assert ratio["requests_per_second_ratio"] == pytest.approx(statistics.median(runs))
    assert result["repeats"] == 3 and "median of 3 runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        engine_load.main(["--model", str(saved), "--repeats", "0"])
    assert exit_info.value.code == 2


def test_engine_load_ignore_eos_gives_every_request_max_tokens(tmp_path, monkeypatch, capsys, tokenizer):
    """--ignore-eos: on the chain model (its answer ends at EOS before --max-tokens) every timed
    request writes exactly --max-tokens tokens; without it, its answer and EOS."""
    from serve_tiny import CHAIN_PROMPT, CHAIN_TEXT
    from conftest import make_chain_model
    from skipdecode import SkipModel

    model_dir = tmp_path / "chain"
    SkipModel(make_chain_model(tokenizer, CHAIN_PROMPT, CHAIN_TEXT), tokenizer).save_pretrained(model_dir)
    engine_load = load_benchmark("engine_load")
    monkeypatch.setattr(engine_load, "prompts", lambda: [CHAIN_PROMPT])
    answer = len(tokenizer(CHAIN_TEXT)["input_ids"]) + 1
    tokens = {}
    for flag in ([], ["--ignore-eos"]):
        result = engine_load.main(["--model", str(model_dir), "--clients", "2", "--requests-per-client", "2",
                                   "--max-tokens", str(answer + 4), "--speedups", "1", *flag,
                                   "--out", str(tmp_path), "--name", "eos"])
        (row,) = result["rows"]
        tokens[bool(flag)] = round(row["tokens_per_second"] * row["seconds"])
        assert result["ignore_eos"] is bool(flag) and result["quantize"] is None and result["compile"] is False
    assert tokens == {False: 8 * answer, True: 8 * (answer + 4)}


@pytest.mark.parametrize("args, message", [
    (["--clients", "0"], "--clients must be >= 1, got 0"),
    (["--align-steps", "-1"], "--align-steps must be >= 0, got -1"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--speedups", "2,3"], "--speedups must include 1"),
    (["--speedups", "fast"], "--speedups takes comma-separated numbers"),
    (["--quantize", "int3"], "--quantize: invalid choice"),
    (["--prompt-repeats", "0"], "--prompt-repeats must be >= 1, got 0"),
])
def test_engine_load_bad_arguments_exit_2(args, message, capsys):
    engine_load = load_benchmark("engine_load")
    with pytest.raises(SystemExit) as exc:
        engine_load._parse(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_engine_load_prompt_repeats_make_long_prompts(saved, tmp_path, monkeypatch):  # noqa: F811
    """--prompt-repeats 3: every cell gets each prompt's text three times over, joined by spaces,
    and the result records it."""
    engine_load = load_benchmark("engine_load")
    monkeypatch.setattr(engine_load, "prompts", lambda: list(PROMPTS))
    seen = []

    def cell(sk, texts, args, speedup):
        seen.append(list(texts))
        return {"speedup": speedup, "requests_per_second": 1.0, "prefill_s": 1.0, "decode_s": 1.0,
                "theoretical_speedup": speedup, "seconds": 2.0, "requests": 1, "tokens_per_second": 1.0,
                "engine_steps": 1, "mean_rows_per_decode_step": 1.0, "cached_prompt_tokens": 0,
                "computed_prompt_tokens": 1}

    monkeypatch.setattr(engine_load, "run_cell", cell)
    monkeypatch.setattr(engine_load, "plot", lambda result, path: path)
    result = engine_load.main(["--model", str(saved), "--prompt-repeats", "3", "--out", str(tmp_path), "--name", "r"])
    assert seen and all(texts == [" ".join([p] * 3) for p in PROMPTS] for texts in seen)
    assert result["prompt_repeats"] == 3
