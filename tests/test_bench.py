"""The decode-speed benchmark on a tiny model: well-formed rows, exact theoretical ratios, files.

No timing assertions (timed tests are forbidden): only structure and the exact compute ratios.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from skipdecode.bench import (
    batch_prompts,
    parse_float_list,
    parse_int_list,
    profile_decode,
    results_table,
    schedule_cell,
    profile_table,
    run_benchmark,
    write_plot,
    write_results,
)
from skipdecode.model import SkipModel
from skipdecode.policy import policy_from_dict

from conftest import make_model, make_tokenizer

NUM_LAYERS = 10
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny():
    return SkipModel(make_model("llama", num_layers=NUM_LAYERS), make_tokenizer())


@pytest.fixture(scope="module")
def result(tiny):
    return run_benchmark(
        tiny, batch_sizes=(1, 2), speedups=(2, 5), new_tokens=NEW_TOKENS, repeats=1, warmup=0, include_hf=True
    )


ROW_KEYS = {
    "batch_size", "engine", "policy", "target_speedup", "policy_config", "num_layers", "decode_steps",
    "layers_run", "mean_active_layers", "theoretical_speedup", "step_ms", "step_ms_runs", "engine_step_ms",
    "ttft_ms", "tokens_per_s", "wall_speedup", "wall_over_theoretical", "hf_step_ms", "full_vs_hf",
}


def test_rows_well_formed(result):
    rows = result["rows"]
    # per batch size: full, 2x, 5x, HF
    assert [(r["batch_size"], r["policy"]) for r in rows] == [
        (1, "full"), (1, "2x"), (1, "5x"), (1, "hf-generate"), (2, "full"), (2, "2x"), (2, "5x"), (2, "hf-generate"),
    ]
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["num_layers"] == NUM_LAYERS
        assert r["decode_steps"] == NEW_TOKENS - 1 == len(r["layers_run"])
        assert len(r["step_ms_runs"]) == 1
        for key in ("step_ms", "ttft_ms", "tokens_per_s", "wall_speedup", "wall_over_theoretical"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["mean_active_layers"] == pytest.approx(sum(r["layers_run"]) / len(r["layers_run"]))
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * 1000 / r["step_ms"])
        assert r["wall_over_theoretical"] == pytest.approx(r["wall_speedup"] / r["theoretical_speedup"])
    json.dumps(result)  # serialisable
    assert result["meta"]["new_tokens"] == NEW_TOKENS and result["meta"]["horizon"] == NEW_TOKENS


def test_theoretical_speedups_are_exact(result):
    for r in result["rows"]:
        if r["policy"] in ("full", "hf-generate"):
            assert r["theoretical_speedup"] == 1.0
            assert r["layers_run"] == [NUM_LAYERS] * (NEW_TOKENS - 1)
            if r["engine"] == "skipdecode":
                assert r["wall_speedup"] == pytest.approx(1.0)
                assert r["full_vs_hf"] == pytest.approx(r["hf_step_ms"] / r["step_ms"])
                assert r["tokens_match_hf"] is True  # float32: our full depth == HF greedy
            continue
        policy = policy_from_dict(r["policy_config"])
        steps = range(1, NEW_TOKENS)
        assert r["layers_run"] == [policy.budget(t) for t in steps]
        expected = NUM_LAYERS * len(steps) / sum(policy.budget(t) for t in steps)
        assert r["theoretical_speedup"] == pytest.approx(expected, rel=0, abs=1e-12)
        assert r["theoretical_speedup"] > 1.0
        assert r["policy_config"]["horizon"] == NEW_TOKENS


def test_targets_summary(result):
    t = result["targets"]
    assert set(t["full_vs_hf"]) == {"1", "2"}
    assert set(t["wall_over_theoretical"]) == {"1/2x", "1/5x"}  # batch 2 is not a target batch
    assert isinstance(t["full_not_slower_than_hf"], bool)


def test_results_file_and_plot(result, tmp_path):
    path = write_results(result, tmp_path / "out" / "decode_speed.json")
    assert path.exists()
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    png = write_plot(result, tmp_path / "out" / "decode_speed.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results_table(result).row_count == len(result["rows"])


def test_without_hf_and_large_batch(tiny):
    res = run_benchmark(tiny, batch_sizes=(3,), speedups=(), new_tokens=3, repeats=1, warmup=0, include_hf=False)
    assert [r["policy"] for r in res["rows"]] == ["full"]
    assert res["rows"][0]["full_vs_hf"] is None and res["targets"]["full_not_slower_than_hf"] is None


def test_profile_breakdown(tiny):
    prof = profile_decode(tiny, batch_sizes=(1, 2), speedups=(5,), new_tokens=4, repeats=1)
    assert [(r["batch_size"], r["policy"]) for r in prof["rows"]] == [(1, "full"), (1, "5x"), (2, "full"), (2, "5x")]
    for r in prof["rows"]:
        assert r["step_ms"] == pytest.approx(sum(r["parts_ms"].values()))
        ran = {int(k) for k in r["per_layer_ms"]}
        assert {0, NUM_LAYERS - 1} <= ran <= set(range(NUM_LAYERS))  # warm-up and top layer always run
        assert 0 < r["head_share_of_bytes"] < 1 and r["floor_ms"] > 0
        assert r["bytes_speedup_bound"] >= 1.0
    full = prof["rows"][0]
    assert full["bytes_speedup_bound"] == pytest.approx(1.0)
    assert len(full["per_layer_ms"]) == NUM_LAYERS
    assert profile_table(prof).row_count > 7
    preds = prof["predictions"]
    assert [(p["batch_size"], p["policy"]) for p in preds] == [(b, f"{s}x") for b in (1, 2) for s in (2, 3, 5)]
    for p in preds:
        assert p["amdahl_ratio"] == pytest.approx(p["amdahl_speedup"] / p["theoretical_speedup"])
        assert 1.0 <= p["bytes_speedup_bound"] < p["theoretical_speedup"]  # the LM head caps it
    json.dumps(prof)


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="new_tokens"):
        run_benchmark(tiny, batch_sizes=(1,), new_tokens=1)
    with pytest.raises(ValueError, match="speedup"):
        run_benchmark(tiny, batch_sizes=(1,), speedups=(50,), new_tokens=3, repeats=1, warmup=0)
    with pytest.raises(ValueError, match="--batch-sizes"):
        parse_int_list("1,x", "--batch-sizes")
    with pytest.raises(ValueError):
        parse_int_list("0", "b")
    with pytest.raises(ValueError):
        parse_float_list("1", "s")
    assert parse_float_list("") == [] and parse_int_list("1, 8") == [1, 8]
    with pytest.raises(ValueError, match=r"^--speedups must not repeat a value \(2 is given twice\), got '2,3,2.0'$"):
        parse_float_list("2,3,2.0", "--speedups")  # timed twice, one row mixing both runs, before
    with pytest.raises(ValueError, match=r"^--batch-sizes must not repeat a value \(1 is given twice\)"):
        parse_int_list("1,8,1", "--batch-sizes")
    assert len(batch_prompts(40)) == 40 and len(set(batch_prompts(32))) == 32


def test_a_trained_schedule_of_another_horizon_is_named_not_timed_silently(result):
    """A model trained for its own 2x schedule (horizon 4, what ``generate --speedup 2`` runs):
    timed over horizon NEW_TOKENS, the benchmark runs the generic 2x schedule instead, and says so
    (in the meta and through ``on_progress``); at the trained horizon it times the trained one and
    says nothing. The stock model has no notes."""
    from skipdecode.policy import LinearDecayPolicy

    trained = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=7, min_layers=2, warmup_layers=1, horizon=4)
    sk = SkipModel(make_model("llama", num_layers=NUM_LAYERS), make_tokenizer(),
                   skip_config={"policies": {"2": trained.to_dict()}, "horizon": 4})
    said = []
    other = run_benchmark(sk, batch_sizes=(1,), speedups=(2,), new_tokens=NEW_TOKENS, repeats=1, warmup=0,
                          include_hf=False, on_progress=said.append)
    (note,) = other["meta"]["schedule_notes"]
    assert note.startswith("2x:") and "horizon 4" in note and f"horizon {NEW_TOKENS}" in note and "--horizon 4" in note
    assert note in said
    timed = [r for r in other["rows"] if r["policy"] == "2x"][0]["policy_config"]
    assert policy_from_dict(timed) != trained
    same = run_benchmark(sk, batch_sizes=(1,), speedups=(2,), new_tokens=NEW_TOKENS, horizon=4, repeats=1,
                         warmup=0, include_hf=False)
    assert same["meta"]["schedule_notes"] == []
    from skipdecode.policy import with_full_depth_steps

    led = SkipModel(make_model("llama", num_layers=NUM_LAYERS), make_tokenizer(),
                    skip_config={"policies": {"2": with_full_depth_steps(trained, 3).to_dict()}, "horizon": 4})
    (lead_note,) = run_benchmark(led, batch_sizes=(1,), speedups=(2,), new_tokens=NEW_TOKENS, repeats=1, warmup=0,
                                 include_hf=False)["meta"]["schedule_notes"]
    assert "first 3 decode steps at full depth" in lead_note and "well above 4" in lead_note
    assert "full depth" not in note
    assert policy_from_dict([r for r in same["rows"] if r["policy"] == "2x"][0]["policy_config"]) == trained
    assert result["meta"]["schedule_notes"] == []


def test_a_row_whose_tokens_all_run_at_full_depth_is_named():
    """The trained schedule runs its first 3 decode steps at full depth: 4 new tokens (3 decode
    steps) time no skipping at all, and the benchmark says so; 8 new tokens do skip."""
    from skipdecode.policy import LinearDecayPolicy, with_full_depth_steps

    trained = with_full_depth_steps(LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=7, min_layers=2,
                                                      warmup_layers=1, horizon=4), 3)
    sk = SkipModel(make_model("llama", num_layers=NUM_LAYERS), make_tokenizer(),
                   skip_config={"policies": {"2": trained.to_dict()}, "horizon": 4})
    short = run_benchmark(sk, batch_sizes=(1,), speedups=(2,), new_tokens=4, horizon=4, repeats=1, warmup=0,
                          include_hf=False)
    (note,) = short["meta"]["schedule_notes"]
    assert "first 3 decode steps at full depth" in note and "--new-tokens 4 gives 3" in note and "skips no layer" in note
    row = [r for r in short["rows"] if r["policy"] == "2x"][0]
    assert row["theoretical_speedup"] == pytest.approx(1.0)  # what the note explains
    assert run_benchmark(sk, batch_sizes=(1,), speedups=(2,), new_tokens=8, horizon=4, repeats=1, warmup=0,
                         include_hf=False)["meta"]["schedule_notes"] == []


def test_cli_bench_last_line_is_json(tiny, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    ckpt = tiny.save_pretrained(tmp_path / "tiny")
    # no --out: the default is a folder in the working directory, never the repository's
    # committed benchmarks/results/ (a user's quick try must not overwrite the published record)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "skipdecode-bench" / "decode_speed.json"
    args = [
        "bench", "--model", str(ckpt), "--batch-sizes", "1,2", "--speedups", "2", "--new-tokens", "3",
        "--repeats", "1", "--warmup", "0", "--threads", "1", "--profile",
        "--profile-batch-sizes", "1",
    ]
    threads = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, args)
    finally:
        torch.set_num_threads(threads)  # the command sets the process-wide thread count
    assert res.exit_code == 0, res.output
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert [(r["batch_size"], r["policy"]) for r in last["rows"]] == [
        (1, "full"), (1, "2x"), (1, "hf-generate"), (2, "full"), (2, "2x"), (2, "hf-generate"),
    ]
    assert [(r["batch_size"], r["policy"]) for r in last["profile"]["rows"]] == [(1, "full"), (1, "2x")]
    saved = json.loads(out.read_text())
    assert saved["rows"] == last["rows"]
    assert saved["meta"] == last["meta"]  # the printed line is the file's record (repo-relative paths)
    # the few-row product it timed (a tiny model: the untimed default), in the JSON and on stderr
    assert saved["meta"]["row_product"]["source"] == "default" and not saved["meta"]["row_product"]["one_row_linear"]
    assert ("few-row product: weight-first at 1 row, weight-first at 2-127 rows (default: too few weights to time)"
            in " ".join(res.stderr.split()))
    # the exact command is recorded, so the run can be repeated; defaults are left out
    assert saved["meta"]["command"].startswith(f"skipdecode bench --model {ckpt} --batch-sizes 1,2 --speedups 2")
    assert "--repeats 1" in saved["meta"]["command"] and "--horizon" not in saved["meta"]["command"]
    assert out.with_suffix(".png").exists()
    # the target line names the batch sizes it checked (batch 2 is not one of them)
    assert "at batch 1:" in " ".join(res.stderr.split()) and "1 and 8" not in res.stderr


def test_cli_bench_bad_options(tmp_path):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    for args, word in ((["--batch-sizes", "1,x"], "--batch-sizes"), (["--new-tokens", "1"], "--new-tokens"),
                       (["--speedups", "0.5"], "--speedups"), (["--speedups", "2,2"], "--speedups must not repeat"),
                       (["--batch-sizes", "1,1"], "--batch-sizes must not repeat")):
        res = CliRunner().invoke(app, ["bench", *args, "--out", str(tmp_path / "x.json")])
        assert res.exit_code == 2 and word in res.output, res.output


def test_wall_target_leaves_out_rows_that_skipped_nothing():
    """A 2x row whose decode steps all ran every layer (theoretical 1.0, wall/theoretical about 1)
    would pass the 0.8 target trivially; it is not counted, and with no other row nothing is checked."""
    from skipdecode.bench.runner import _targets

    def row(policy, theoretical, wall):
        return {"engine": "skipdecode", "batch_size": 1, "policy": policy, "full_vs_hf": None,
                "theoretical_speedup": theoretical, "wall_over_theoretical": wall}

    t = _targets([row("full", 1.0, 1.0), row("2x", 1.0, 0.99), row("5x", 2.5, 0.6)])
    assert t["wall_over_theoretical"] == {"1/5x": 0.6} and t["wall_over_theoretical_met"] is False
    t = _targets([row("full", 1.0, 1.0), row("2x", 1.0, 0.99)])
    assert t["wall_over_theoretical"] == {} and t["wall_over_theoretical_met"] is None


def test_cpu_description_reads_the_first_processor(tmp_path):
    from skipdecode.bench.runner import cpu_description

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
                    "processor\t: 1\ncpu family\t: 25\nmodel name\t: other\nflags\t\t: fpu\n")
    assert cpu_description(info) == {"model_name": "AMD EPYC", "family": "26", "model": "2", "avx512": True}
    info.write_text("cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_vnni\n")
    assert cpu_description(info)["avx512"] is False  # avx512f itself, not any avx512 extension's name
    assert cpu_description(tmp_path / "missing") == {}


def test_the_table_shows_each_rows_schedule(result):
    """The table's schedule column tells a trained schedule (full-depth first steps) from the
    generic one of the same speedup, and shows each row's own decay."""
    from rich.console import Console

    assert schedule_cell({"type": "full", "num_layers": 30}) == "30"
    assert schedule_cell({"type": "linear_decay", "num_layers": 30, "max_layers": 21, "min_layers": 9,
                          "warmup_layers": 1, "horizon": 8}) == "21->9 over 8"
    assert schedule_cell({"type": "linear_decay", "num_layers": 30, "max_layers": 25, "min_layers": 5,
                          "warmup_layers": 1, "horizon": 4, "full_depth_steps": 14}) == "14 at 30, then 25->5 over 4"
    console = Console(width=250, record=True)
    console.print(results_table(result))
    text = console.export_text()
    for r in result["rows"]:
        if r["engine"] != "hf" and r["policy"] != "full":
            c = r["policy_config"]
            assert f"{c['max_layers']}->{c['min_layers']} over {c['horizon']}" in text

