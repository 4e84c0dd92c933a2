"""The benchmark scripts' default data (``skipdecode.data.shared_data_path``): without ``--data``
and with a shared data folder that lacks the default file, every script that reads data stops with
exit status 2 and one line naming the option, the folder and the file (no traceback, nothing
loaded); ``server_load.py`` falls back to its built-in prompts. No model is loaded."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark
from test_recipe_study import write_e2e_csv

# (script, extra arguments, option named, default file inside the shared data folder)
FILE_SCRIPTS = [
    ("eval_e2e", [], "--data", "e2e/testset_w_refs.csv"),
    ("quant_quality", ["--ckpt", "stock"], "--data", "e2e/testset_w_refs.csv"),
    ("recipe_study", [], "--data", "e2e/devset.csv"),
    ("train_e2e", [], "--data", "e2e/devset.csv"),
    ("train_throughput", [], "--data", "e2e/devset.csv"),
    ("frontier", ["--data", "given-dev.csv"], "--test-data", "e2e/testset_w_refs.csv"),
]


def _exit_code(script, argv) -> int:
    try:
        return script.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("name,extra,option,default", FILE_SCRIPTS, ids=[s[0] for s in FILE_SCRIPTS])
def test_missing_default_data_file_is_one_line_naming_option_and_folder(
        name, extra, option, default, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))  # exists, but holds no data file
    monkeypatch.chdir(tmp_path)
    script = load_benchmark(name)
    assert _exit_code(script, extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and f"no {option} given" in err
    assert str(tmp_path) in err and default in err


@pytest.mark.parametrize("name", ["adapter_agreement", "train_adapter"])
def test_adapter_scripts_without_a_data_folder_exit_2_with_one_line(name, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "no-such-folder"
    monkeypatch.setenv("SKIPDECODE_DATA", str(missing))
    script = load_benchmark(name)
    assert _exit_code(script, ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no --data given" in err and str(missing) in err, err


def test_adapter_prompts_given_folder_without_files_is_one_line(tmp_path, capsys):
    script = load_benchmark("adapter_prompts")
    with pytest.raises(SystemExit) as info:
        script.build_or_exit(str(tmp_path))  # a given --data is used as is; its files are missing
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path) in err, err


def test_server_load_prompts_from_the_shared_folder_else_built_in(tmp_path, monkeypatch):
    from skipdecode.data import TEMPLATES

    script = load_benchmark("server_load")
    built_in = [TEMPLATES["e2e"].format(mr=mr) for mr in script.FALLBACK_MRS]
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))
    assert script.prompts() == built_in  # the folder lacks e2e/testset_w_refs.csv
    (tmp_path / "e2e").mkdir()
    write_e2e_csv(tmp_path / "e2e" / "testset_w_refs.csv", n_mrs=3)
    got = script.prompts()
    assert len(got) == 3 and got != built_in[:3] and got[0] == TEMPLATES["e2e"].format(mr="name[The Eagle], food[French]")


def test_cli_eval_default_data_missing_names_option_and_folder(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path))  # exists, but holds no E2E test set
    res = CliRunner().invoke(app, ["eval"], env={"COLUMNS": "200"})
    text = "".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "no--datagiven" in text and "".join(str(tmp_path).split()) in text
    assert "e2e/testset_w_refs.csv" in text


def test_adapter_prompts_manifest_mismatch_is_fatal_only_when_asked(monkeypatch, capsys):
    script = load_benchmark("adapter_prompts")
    rows = ([{"id": "own-x", "source": "own", "category": "x", "prompt": "not in the manifest"}], [])
    monkeypatch.setattr(script, "build", lambda data_dir=None: rows)
    assert script.build_or_exit("given") == rows  # no manifest check without a message
    with pytest.raises(SystemExit) as info:
        script.build_or_exit("given", mismatch="prompt set differs:")
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("prompt set differs:\n  train: ") and "differ from the manifest" in err


def test_server_load_pairs_the_speedups_of_a_client_count_on_the_same_prompts(monkeypatch, tmp_path):
    script = load_benchmark("server_load")
    texts = [f"p{i}" for i in range(500)]
    monkeypatch.setattr(script, "prompts", lambda: texts)
    calls = []

    def fake_cell(args, texts_, mode, clients, speedup, offset):
        calls.append((mode, clients, speedup, offset))
        return {"mode": mode, "clients": clients, "speedup": speedup, "requests": 1, "requests_per_second": 1.0,
                "tokens_per_second": 1.0, "completion_tokens": 1, "latency_p50": 1.0, "latency_p95": 1.0,
                "ttft_p50": 0.1, "ttft_p95": 0.1}

    monkeypatch.setattr(script, "run_cell", fake_cell)
    monkeypatch.setattr(script, "plot", lambda result, path: path)
    script.main(["--clients", "1,16", "--speedups", "1,2", "--requests-per-client", "3", "--out", str(tmp_path)])
    by = {(m, c, s): o for m, c, s, o in calls}
    for mode in ("inflight", "serial"):
        assert by[(mode, 1, 1.0)] == by[(mode, 1, 2.0)] == 0  # the same prompts for both speedups
        assert by[(mode, 16, 1.0)] == by[(mode, 16, 2.0)] == script.cell_size(1, 3) == 9
    queue, warm = script.cell_prompts(texts, 16, 9, 3)
    assert len(queue) == 48 and len(warm) == 16 and not set(warm) & set(queue)  # one warm-up round
    assert len(set(queue) | set(warm)) == 64  # no repeat within a cell
    assert not (set(queue) | set(warm)) & set(script.cell_prompts(texts, 1, 0, 3)[0])  # client counts differ
    assert script.cell_prompts(["a", "b", "c"], 1, 2)[0][:2] == ["c", "a"]  # cyclic when texts run out


def test_server_load_repeats_alternate_the_speedups_and_take_median_ratios(monkeypatch, tmp_path, capsys):
    """--repeats 3: each client count's cells run 1,2 / 2,1 / 1,2 on the same prompts, the 2x/full
    ratio is computed within each run and the pairs and targets take the median of the three."""
    script = load_benchmark("server_load")
    monkeypatch.setattr(script, "prompts", lambda: [f"p{i}" for i in range(500)])
    rps = iter([4.0, 5.6, 6.0, 3.0, 5.0, 7.0])  # runs: 5.6/4 = 1.4, 6/3 = 2.0, 7/5 = 1.4
    calls = []

    def fake_cell(args, texts_, mode, clients, speedup, offset):
        calls.append((speedup, offset))
        return {"mode": mode, "clients": clients, "speedup": speedup, "requests": 1, "requests_per_second": next(rps),
                "tokens_per_second": 1.0, "completion_tokens": 1, "latency_p50": 1.0, "latency_p95": 1.0,
                "ttft_p50": 0.1, "ttft_p95": 0.1}

    monkeypatch.setattr(script, "run_cell", fake_cell)
    monkeypatch.setattr(script, "plot", lambda result, path: path)
    script.main(["--clients", "16", "--modes", "inflight", "--repeats", "3", "--out", str(tmp_path), "--name", "r"])
    assert calls == [(1.0, 0), (2.0, 0), (2.0, 0), (1.0, 0), (1.0, 0), (2.0, 0)]
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["repeat"] for r in result["rows"]] == [0, 0, 1, 1, 2, 2]
    (pair,) = result["pairs"]
    assert pair["runs"] == pytest.approx([1.4, 2.0, 1.4])
    assert pair["requests_per_second_ratio"] == pytest.approx(1.4)  # the median, not the ratio of medians (6/4)
    assert result["targets"]["two_x_over_full_at_16"] == pytest.approx(1.4)
    assert "median of 3 runs: 1.40, 2.00, 1.40" in capsys.readouterr().out


def test_server_load_splits_a_cells_engine_time_from_health():
    """A cell's row records what the server's engine did in it (from /health before and after):
    prompt tokens reused and computed, seconds in prefills and decode steps, decode steps, graphs
    compiled meanwhile; a server that reports none of them (the serial one) gives zeros, not an
    error."""
    script = load_benchmark("server_load")
    before = {"prefix_cache": {"cached_prompt_tokens": 10, "computed_prompt_tokens": 50},
              "prefill_seconds": 1.5, "decode_seconds": 4.0, "decode_steps": 100, "graphs_after_start": 2}
    after = {"prefix_cache": {"cached_prompt_tokens": 25, "computed_prompt_tokens": 90},
             "prefill_seconds": 2.25, "decode_seconds": 9.5, "decode_steps": 340, "graphs_after_start": 5}
    assert script.engine_deltas(before, after) == {
        "cached_prompt_tokens": 15, "computed_prompt_tokens": 40, "engine_prefill_s": 0.75,
        "engine_decode_s": 5.5, "engine_decode_steps": 240, "graphs_compiled": 3}
    assert script.engine_deltas({}, {}) == {
        "cached_prompt_tokens": 0, "computed_prompt_tokens": 0, "engine_prefill_s": 0,
        "engine_decode_s": 0, "engine_decode_steps": 0, "graphs_compiled": 0}
