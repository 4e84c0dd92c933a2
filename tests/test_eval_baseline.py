"""Speedups against another model's full-depth row (``Report.against`` / ``set_baseline``,
``skipdecode eval --baseline``, ``eval_e2e.py --baseline``): the paper's 1x baseline."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from conftest import make_model
from skipdecode.data import load_eval_items
from skipdecode.eval_report import EvalRow, Report
from skipdecode.evaluate import evaluate
from skipdecode.model import SkipModel
from skipdecode.policy import LinearDecayPolicy
from conftest import load_benchmark
from test_evaluate import RECORDS, _run  # noqa: F401  (shared helpers)

L = 6


def _row(model, policy, *, tokens, items, seconds, decode_seconds, steps, layers, reference=False):
    r = EvalRow(model=model, policy=policy, policy_config={}, description="", kind="skipdecode",
                reference=reference, reference_policy="full", batch_size=2, num_layers=L, n_items=items,
                new_tokens=tokens, generation_seconds=seconds, decode_seconds=decode_seconds,
                decode_steps=steps, layers_run=layers)
    r.finish()
    return r


def test_against_gives_ratios_of_the_baseline_row_across_models():
    base = _row("1x", "full", tokens=100, items=4, seconds=10.0, decode_seconds=8.0, steps=80, layers=480,
                reference=True)
    two = _row("2x", "checkpoint", tokens=60, items=4, seconds=4.0, decode_seconds=2.4, steps=60, layers=180)
    two_full = _row("2x", "full", tokens=160, items=4, seconds=14.0, decode_seconds=12.0, steps=120, layers=720,
                    reference=True)
    calm = _row("1x", "calm@0.9", tokens=100, items=4, seconds=30.0, decode_seconds=28.0, steps=80, layers=200)
    calm.kind = "calm"
    rep = Report(rows=[base, calm, two_full, two], items=[], meta={})
    out = {(r["model"], r["policy"]): r for r in rep.against("1x")}
    assert set(out) == {("2x", "full"), ("2x", "checkpoint")}  # neither the baseline nor CALM rows
    r = out[("2x", "checkpoint")]
    assert r["wallclock_speedup"] == pytest.approx((60 / 4.0) / (100 / 10.0))  # 1.5
    assert r["decode_speedup"] == pytest.approx((8.0 / 80) / (2.4 / 60))  # 2.5
    assert r["wall_over_decode"] == pytest.approx(1.5 / 2.5)
    assert r["time_speedup"] == pytest.approx(10.0 / 4.0)
    assert r["theoretical_speedup"] == pytest.approx(L * 60 / 180)
    assert r["new_tokens_per_item"] == pytest.approx(15.0)
    assert out[("2x", "full")]["decode_speedup"] == pytest.approx(0.1 / 0.1)
    with pytest.raises(KeyError, match="no row"):
        rep.against("3x")


def test_against_is_nan_when_a_row_did_not_decode():
    base = _row("1x", "full", tokens=4, items=4, seconds=1.0, decode_seconds=0.0, steps=0, layers=0, reference=True)
    other = _row("2x", "checkpoint", tokens=8, items=4, seconds=1.0, decode_seconds=1.0, steps=4, layers=8)
    (r,) = Report(rows=[base, other], items=[], meta={}).against("1x")
    assert math.isnan(r["decode_speedup"]) and math.isnan(r["wall_over_decode"])
    assert r["wallclock_speedup"] == pytest.approx(2.0)


@pytest.fixture(scope="module")
def two_models(tokenizer):
    one = SkipModel(make_model("llama", L, seed=1), tokenizer, chat=False, source="one")
    two = SkipModel(make_model("llama", L, seed=3), tokenizer, chat=False, source="two",
                    policy=LinearDecayPolicy(num_layers=L, max_layers=4, min_layers=2, horizon=8))
    return one, two


def test_set_baseline_on_a_real_run_matches_the_rows_and_shows_in_markdown(two_models, tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    items = load_eval_items(path)[:3]
    rep = evaluate({"1x": two_models[0], "2x": two_models[1]}, items, None, batch_size=2, max_new_tokens=4,
                   stop=(), warmup=False)
    rows = rep.set_baseline("1x")
    base, skip = rep.row("1x", "full"), rep.row("2x", "checkpoint")
    got = {(r["model"], r["policy"]): r for r in rows}[("2x", "checkpoint")]
    assert got["wallclock_speedup"] == pytest.approx(skip.tokens_per_second / base.tokens_per_second)
    assert got["decode_speedup"] == pytest.approx(base.step_seconds / skip.step_seconds)
    assert rep.meta["baseline"] == {"model": "1x", "policy": "full"}
    md = rep.to_markdown()
    assert "Against the baseline 1x at full" in md and "| 2x | checkpoint |" in md.split("Against the baseline")[1]
    saved = rep.save(tmp_path / "out", "b")
    data = json.loads(saved["json"].read_text())
    assert data["meta"]["against_baseline"][-1]["policy"] == "checkpoint"
    assert "Against the baseline" not in evaluate(two_models[0], items, [2], batch_size=2, max_new_tokens=2,
                                                  stop=(), warmup=False).to_markdown()


@pytest.fixture(scope="module")
def saved_pair(two_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    for name, sk in zip(("one", "two"), two_models):
        sk.save_pretrained(root / name)
    return root / "one", root / "two"


def test_cli_eval_baseline_table_and_bad_value(saved_pair, tmp_path):
    one, two = saved_pair
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    base = ["eval", "--model", str(one), "--model", str(two), "--data", str(data), "--limit", "2",
            "--max-new-tokens", "3", "--no-progress", "--out", str(tmp_path / "o")]
    result, text = _run([*base, "--baseline", str(one)])
    assert result.exit_code == 0, text
    assert "Against the baseline one at full" in result.stdout
    rep = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert rep["meta"]["baseline"] == {"model": "one", "policy": "full"}
    assert {r["model"] for r in rep["meta"]["against_baseline"]} == {"two"}
    for bad in ("elsewhere", ):
        result, text = _run([*base, "--baseline", bad])
        assert result.exit_code == 2 and "--baseline" in text and "Traceback" not in text
    result, text = _run(["eval", "--model", str(one), "--data", str(data), "--baseline", str(one), "--no-progress",
                         "--out", str(tmp_path / "o2")])
    assert result.exit_code == 2 and "at least two" in text


def test_eval_e2e_script_defaults_to_the_1x_checkpoint_as_baseline(saved_pair, tmp_path, capsys):
    one, two = saved_pair
    csv = tmp_path / "test.csv"
    csv.write_text('"mr","ref"\n"name[The Eagle]","The Eagle."\n"name[Blue Spice]","Blue Spice."\n')
    script = load_benchmark("eval_e2e")
    common = ["--no-stock", "--data", str(csv), "--batch-size", "2", "--max-new-tokens", "3", "--no-progress",
              "--out", str(tmp_path / "res")]
    assert script.main(["--ckpt", f"1x={one}", "--ckpt", f"2x={two}", *common]) == 0
    data = json.loads((tmp_path / "res" / "eval_e2e.json").read_text())
    assert data["meta"]["baseline"] == {"model": "1x", "policy": "full"}
    assert "Against the baseline 1x" in capsys.readouterr().out
    assert script.main(["--ckpt", f"1x={one}", "--ckpt", f"2x={two}", "--baseline", "none", *common,
                        "--name", "nob"]) == 0
    assert "baseline" not in json.loads((tmp_path / "res" / "nob.json").read_text())["meta"]
    with pytest.raises(SystemExit) as exc:
        script.main(["--ckpt", f"2x={two}", "--baseline", "1x", *common])
    assert exc.value.code == 2


def test_against_skips_rows_of_another_batch_size_and_nan_on_zero_inputs():
    base = _row("1x", "full", tokens=100, items=4, seconds=10.0, decode_seconds=8.0, steps=80, layers=480,
                reference=True)
    bs1 = _row("1x", "full@bs1", tokens=100, items=4, seconds=20.0, decode_seconds=18.0, steps=320, layers=1920)
    bs1.batch_size = 1
    idle = _row("2x", "checkpoint", tokens=0, items=4, seconds=0.0, decode_seconds=0.0, steps=0, layers=0)
    (r,) = Report(rows=[base, bs1, idle], items=[], meta={}).against("1x")
    assert r["policy"] == "checkpoint" and r["batch_size"] == 2
    assert all(math.isnan(r[k]) for k in ("wallclock_speedup", "decode_speedup", "time_speedup", "wall_over_decode"))


def test_markdown_keeps_the_calm_note_out_of_the_baseline_table_and_shows_na_without_unit():
    base = _row("1x", "full", tokens=100, items=4, seconds=10.0, decode_seconds=8.0, steps=80, layers=480,
                reference=True)
    other = _row("2x", "checkpoint", tokens=8, items=4, seconds=1.0, decode_seconds=0.0, steps=0, layers=0)
    calm = _row("2x", "calm@0.9", tokens=8, items=4, seconds=1.0, decode_seconds=1.0, steps=4, layers=8)
    calm.kind = "calm"
    rep = Report(rows=[base, other, calm], items=[], meta={})
    rep.set_baseline("1x")
    md = rep.to_markdown()
    after = md.split("Against the baseline")[1].splitlines()
    table_end = max(i for i, line in enumerate(after) if line.startswith("|"))
    assert after[table_end + 1] == ""  # a blank line ends the table before any note
    assert "n/ax" not in md and "| n/a |" in md


def test_joined_shards_recompute_the_baseline_comparison(two_models, tmp_path):
    from skipdecode.evaluate import concat_reports

    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    items = load_eval_items(path)
    shards = []
    for part in (items[:2], items[2:4]):
        rep = evaluate({"1x": two_models[0], "2x": two_models[1]}, part, None, batch_size=2, max_new_tokens=3,
                       stop=(), warmup=False)
        rep.set_baseline("1x")
        shards.append(Report.from_dict(json.loads(json.dumps(rep.to_dict()))))
    joined = concat_reports(shards)
    stored, fresh = joined.meta["against_baseline"], joined.against("1x")
    assert [(r["model"], r["policy"]) for r in stored] == [(r["model"], r["policy"]) for r in fresh]
    for a, b in zip(stored, fresh):
        assert a["wallclock_speedup"] == pytest.approx(b["wallclock_speedup"])
        assert a["time_speedup"] == pytest.approx(b["time_speedup"])
    assert joined.meta["against_baseline"][-1]["wallclock_speedup"] == pytest.approx(
        joined.row("2x", "checkpoint").tokens_per_second / joined.row("1x", "full").tokens_per_second)


def test_cli_baseline_accepts_the_folder_spelled_otherwise_and_table_labels(saved_pair, tmp_path, monkeypatch):
    one, two = saved_pair
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    monkeypatch.chdir(one.parent)
    common = ["--data", str(data), "--limit", "1", "--max-new-tokens", "2", "--no-progress", "--out", str(tmp_path / "o")]
    for models, baseline, label in (
        (["one", "two"], "./one/", "one"),  # same folder, spelled otherwise
        ([str(one), "two"], "one", "one"),  # the table label of a path
        (["one", "one"], "one#2", "one#2"),  # the second copy
    ):
        args = ["eval", *[x for m in models for x in ("--model", m)], "--baseline", baseline, *common]
        result, text = _run(args)
        assert result.exit_code == 0, text
        rep = json.loads((tmp_path / "o" / "eval.json").read_text())
        assert rep["meta"]["baseline"]["model"] == label
    monkeypatch.chdir(one)
    result, text = _run(["eval", "--model", ".", "--model", "../two", "--baseline", ".", *common])
    assert result.exit_code == 0, text
    assert json.loads((tmp_path / "o" / "eval.json").read_text())["meta"]["baseline"]["model"] == "one"


def test_cli_model_label_equals_path_names_the_rows(saved_pair, tmp_path, monkeypatch):
    """``--model LABEL=MODEL`` names a model's rows LABEL; --baseline takes the label, the
    model as written or its folder spelled otherwise; a path holding '=' is still a path."""
    one, two = saved_pair
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    common = ["--data", str(data), "--limit", "1", "--max-new-tokens", "2", "--no-progress", "--out", str(tmp_path / "o")]
    for baseline in ("1x", str(one), str(one) + "/"):
        result, text = _run(["eval", "--model", f"1x={one}", "--model", f"2x={two}", "--baseline", baseline, *common])
        assert result.exit_code == 0, text
        rep = json.loads((tmp_path / "o" / "eval.json").read_text())
        assert list(dict.fromkeys(r["model"] for r in rep["rows"])) == ["1x", "2x"] and rep["meta"]["baseline"]["model"] == "1x"
    odd = tmp_path / "a=b"
    shutil.copytree(one, odd)
    monkeypatch.chdir(tmp_path)
    result, text = _run(["eval", "--model", "a=b", *common])
    assert result.exit_code == 0, text
    assert json.loads((tmp_path / "o" / "eval.json").read_text())["rows"][0]["model"] == "a=b"
    monkeypatch.chdir(one.parent)  # a label written as LABEL= wins over a model spelled like it
    result, text = _run(["eval", "--model", "one=two", "--model", "one", "--baseline", "one", *common])
    assert result.exit_code == 0, text
    rep = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert rep["meta"]["baseline"]["model"] == "one" and rep["meta"]["models"]["one"]["source"].endswith("two")
    result, text = _run(["eval", "--model", "=two", *common])
    assert result.exit_code == 2 and "needs a label" in text and "Traceback" not in result.output


def test_cli_runs_final_folders_are_labelled_by_their_run(saved_pair, tmp_path, monkeypatch):
    """Two training runs' ``final`` (or ``checkpoint-N``) folders are labelled ``RUN/final``
    (not ``final`` and ``final#2``), and --baseline takes that label; ``LABEL=`` with no model
    is refused by name."""
    one, two = saved_pair
    runs = tmp_path / "runs"
    shutil.copytree(one, runs / "a" / "final")
    shutil.copytree(two, runs / "b" / "checkpoint-00000012")
    data = tmp_path / "items.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    common = ["--data", str(data), "--limit", "1", "--max-new-tokens", "2", "--no-progress", "--out", str(tmp_path / "o")]
    monkeypatch.chdir(tmp_path)
    result, text = _run(["eval", "--model", "runs/a/final", "--model", str(runs / "b" / "checkpoint-00000012"),
                         "--baseline", "a/final", *common])
    assert result.exit_code == 0, text
    rep = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert list(dict.fromkeys(r["model"] for r in rep["rows"])) == ["a/final", "b/checkpoint-00000012"]
    assert rep["meta"]["baseline"]["model"] == "a/final"
    result, text = _run(["eval", "--model", "x=", *common])
    assert result.exit_code == 2 and "needs a model after '='" in text and "Traceback" not in result.output
