"""benchmarks/long_prompt_stall.py on a tiny Llama saved locally: one row per chunk value, the
long prompt's forwards counted from the chunk, the running rows' waits recorded between their
tokens, results and plot written, bad arguments exit 2 (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from conftest import load_benchmark

PROMPTS = ["The Eagle is a", "Blue Spice serves", "The Mill is", "Aromi has"]


def test_rows_count_chunks_and_waits(saved, tmp_path, monkeypatch, capsys):  # noqa: F811
    bench = load_benchmark("long_prompt_stall")
    monkeypatch.setattr(bench, "prompts", lambda: list(PROMPTS))
    result = bench.main(["--model", str(saved), "--prompt-tokens", "60", "--chunks", "0,16", "--running", "2",
                         "--warm-steps", "2", "--out", str(tmp_path), "--name", "t"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "t.png").stat().st_size > 0
    whole, chunked = result["rows"]
    assert result["prompt_tokens"] == 60 and result["command"].startswith("python benchmarks/long_prompt_stall.py")
    assert (whole["chunks"], whole["engine_steps"], len(whole["gaps"])) == (1, 1, 1)  # joined and answered in one step
    assert (chunked["chunks"], chunked["engine_steps"], len(chunked["gaps"])) == (4, 4, 4)  # 16+16+16+12, one a step
    assert chunked["running_tokens_meanwhile"] == 4 * 2
    for row in (whole, chunked):
        assert row["longest_wait_s"] == max(row["gaps"]) and 0 < row["time_to_first_token_s"]
        assert row["time_to_first_token_s"] == pytest.approx(sum(row["gaps"]), rel=1e-6)


@pytest.mark.parametrize("argv, message", [(["--chunks", "0,x"], "--chunks takes comma-separated integers"),
                                            (["--chunks", "-1"], "--chunks must be >= 0"),
                                            (["--prompt-tokens", "1"], "--prompt-tokens must be >= 2")])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    bench = load_benchmark("long_prompt_stall")
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
