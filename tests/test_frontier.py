"""The equal-budget frontier runner (benchmarks/frontier.py) and the GPU script around it
(benchmarks/gpu_frontier.sh), run end to end on CPU with a tiny random model, synthetic
E2E-shaped dev/test CSVs and a budget of seconds, so that neither can fail for a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_benchmark
from test_recipe_study import write_e2e_csv
from test_train import tiny_skipmodel

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_skipmodel(num_layers=8, chat=False).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def csvs(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    return write_e2e_csv(d / "devset.csv"), write_e2e_csv(d / "testset_w_refs.csv", n_mrs=5, refs_per_mr=2)


def _args(tiny_dir, csvs, tmp_path, *extra):
    dev, test = csvs
    return ["--model", str(tiny_dir), "--data", str(dev), "--test-data", str(test), "--out", str(tmp_path / "out"),
            "--runs", str(tmp_path / "runs"), "--speedups", "1,2", "--mixed", "2,3", "--batch-size", "4",
            "--eval-batch-size", "4", "--no-progress", *extra]


def test_frontier_trains_equal_budgets_evaluates_and_resumes(tmp_path, tiny_dir, csvs, capsys):
    mod = load_benchmark("frontier")
    args = _args(tiny_dir, csvs, tmp_path, "--epochs", "0.5", "--name", "fr")
    assert mod.main(args) == 0
    out = tmp_path / "out"
    log = json.loads((out / "fr_steps.json").read_text())
    names = [s["step"] for s in log["steps"]]
    assert names == ["train 1x", "train 2x", "train mix2-3", "eval 1x", "eval 2x", "eval mix2-3"]
    assert all(s["status"] == "ok" and s["minutes"] >= 0 for s in log["steps"])
    trained = {s["step"]: s for s in log["steps"] if s["step"].startswith("train")}
    assert len({s["examples"] for s in trained.values()}) == 1  # the same number of examples for every model
    mix = json.loads((out / "fr_train_mix2-3.json").read_text())
    assert set(mix["policies"]) == {"2", "3"}
    report = json.loads((out / "fr.json").read_text())
    rows = {(r["model"], r["policy"]) for r in report["rows"]}
    assert {("1x", "full"), ("2x", "checkpoint"), ("mix2-3", "2x"), ("mix2-3", "3x")} <= rows
    assert all(r["n_items"] == 5 for r in report["rows"])
    assert set(report["rows"][0]["scores"]) >= {"bleu", "nist", "rougeL", "chrf"}
    assert (out / "fr.png").stat().st_size > 0 and (out / "fr.md").exists()
    gaps = log["frontier"]
    assert gaps["1x full"]["bleu_loss_vs_1x"] == 0.0 and gaps["1x full"]["compass_max_loss"] is None
    two = gaps["2x checkpoint"]
    assert two["theoretical_speedup"] > 1.0 and two["compass_max_loss"] == 1.0 and two["target_speedup"] == 2.0
    assert gaps["mix2-3 3x"]["compass_max_loss"] == 2.0
    assert two["bleu_loss_vs_1x"] == pytest.approx(gaps["1x full"]["bleu"] - two["bleu"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["json"].endswith("fr_steps.json")

    # a second run finds every step done (and keeps the first run's step log before its own)
    assert mod.main(args) == 0
    again = json.loads((out / "fr_steps.json").read_text())
    assert again["steps"][:6] == log["steps"]
    assert [s["status"] for s in again["steps"][6:]] == ["done already"] * 6

    # a model retrained on resume sees the examples the others saw, whatever --epochs now says
    import shutil

    shutil.rmtree(tmp_path / "runs" / "2x" / "final")
    (out / "fr_eval_2x.json").unlink()
    assert mod.main(_args(tiny_dir, csvs, tmp_path, "--epochs", "3", "--name", "fr")) == 0
    third = json.loads((out / "fr_steps.json").read_text())
    redo = [s for s in third["steps"] if s["step"] == "train 2x"][-1]
    assert redo["status"] == "ok" and redo["examples"] == trained["train 1x"]["examples"]
    assert third["epochs"] == 0.5 and third["epochs_from"] == "1x"


def test_frontier_resumes_a_model_stopped_mid_way_from_its_checkpoint(tmp_path, tiny_dir, csvs):
    """A run killed inside a model's training resumes that model from its newest checkpoint, with
    the epochs the first invocation chose (even if --epochs now says otherwise)."""
    mod = load_benchmark("frontier")
    args = _args(tiny_dir, csvs, tmp_path, "--epochs", "0.5", "--name", "mid", "--speedups", "2", "--mixed", "",
                 "--checkpoint-every", "2")
    assert mod.main(args) == 0
    out, run = tmp_path / "out", tmp_path / "runs" / "2x"
    first = json.loads((out / "mid_train_2x.json").read_text())
    assert first["steps"] >= 3 and first["steps"] % 2 == 1, "the test needs a checkpoint before the last step"
    # as if killed after the last checkpoint: no final model, no record, no evaluation
    import shutil

    shutil.rmtree(run / "final")
    (out / "mid_train_2x.json").unlink()
    (out / "mid_eval_2x.json").unlink()
    assert [p.name for p in run.glob("checkpoint-*")] == [f"checkpoint-{first['steps'] - 1:08d}"]
    assert mod.main(_args(tiny_dir, csvs, tmp_path, "--epochs", "3", "--name", "mid", "--speedups", "2", "--mixed", "",
                          "--checkpoint-every", "2")) == 0
    second = json.loads((out / "mid_train_2x.json").read_text())
    assert second["resumed_from"] and second["resumed_from"].endswith(f"checkpoint-{first['steps'] - 1:08d}")
    assert second["steps"] == first["steps"] and second["examples_seen"] == first["examples_seen"]
    log = json.loads((out / "mid_steps.json").read_text())
    assert log["epochs"] == 0.5 and "checkpoint" in log["epochs_from"]


def test_frontier_deadline_cuts_training_equally(tmp_path, tiny_dir, csvs):
    mod = load_benchmark("frontier")
    t0 = time.time()
    args = _args(tiny_dir, csvs, tmp_path, "--epochs", "500", "--deadline-minutes", "0.25",
                 "--eval-reserve-minutes", "0.05", "--name", "dl", "--mixed", "")
    assert mod.main(args) == 0
    assert time.time() - t0 < 0.25 * 60 + 45  # the deadline plus at most one step and the final join
    log = json.loads((tmp_path / "out" / "dl_steps.json").read_text())
    assert log["steps"][0]["step"] == "calibrate" and log["steps"][0]["seconds_per_step"] > 0
    assert 0 <= log["epochs"] < 500 == log["epochs_planned"]
    assert all(s["status"] in ("ok", "skipped: deadline", "skipped: no trained model") or s["status"].startswith("stopped")
               for s in log["steps"])


def test_frontier_dry_run_and_bad_input(tmp_path, tiny_dir, csvs, capsys):
    mod = load_benchmark("frontier")
    assert mod.main(_args(tiny_dir, csvs, tmp_path, "--dry-run", "--recipe", "from-1x", "--speedups", "3")) == 0
    dry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [m["label"] for m in dry["models"]] == ["1x", "3x", "mix2-3"]  # from-1x needs the 1x model
    assert dry["test_items"] == 5 and not (tmp_path / "runs").exists()
    for bad, option in [(["--recipe", "1x"], "--recipe"), (["--speedups", "2,x"], "--speedups"),
                        (["--mixed", "3"], "--mixed"), (["--epochs", "0"], "--epochs"), (["--lr", "0"], "--lr"),
                        (["--lr", "2"], "--lr")]:
        with pytest.raises(SystemExit) as exc:
            mod.main(_args(tiny_dir, csvs, tmp_path, "--dry-run", *bad))
        assert exc.value.code == 2
        assert option in capsys.readouterr().err


def test_frontier_labels_kl_1x_distils_from_the_equally_trained_1x_model(tmp_path, tiny_dir, csvs, capsys):
    """Recipe labels-kl-1x: 1x is trained first; skip models start from the base and take the 1x
    model as KL teacher; the 1x model itself has neither KL nor a teacher."""
    mod = load_benchmark("frontier")
    assert mod.main(_args(tiny_dir, csvs, tmp_path, "--dry-run", "--recipe", "labels-kl-1x", "--speedups", "3")) == 0
    dry = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [m["label"] for m in dry["models"]] == ["1x", "3x", "mix2-3"]
    args = mod._parse(_args(tiny_dir, csvs, tmp_path, "--recipe", "labels-kl-1x"))
    runs = tmp_path / "runs"
    skip = mod._train_config(args, {"label": "3x", "speedups": [3.0]}, runs / "3x", 1.0)
    assert skip.kl_weight == 1.0 and skip.teacher == str(runs / "1x" / "final")
    mixed = mod._train_config(args, {"label": "mix2-3", "speedups": [2.0, 3.0]}, runs / "mix2-3", 1.0)
    assert mixed.teacher == str(runs / "1x" / "final")
    ref = mod._train_config(args, {"label": "1x", "speedups": [1.0]}, runs / "1x", 1.0)
    assert ref.kl_weight == 0 and ref.teacher is None


def test_frontier_lr_overrides_the_recipe_for_every_model(tmp_path, tiny_dir, csvs):
    """--lr sets the learning rate of every model (1x and skip models alike); without it each model
    takes its recipe's (lr-5e-4: 5e-4) or the trainer default of the frontier (2e-4)."""
    mod = load_benchmark("frontier")
    runs = tmp_path / "runs"
    entries = [({"label": "1x", "speedups": [1.0]}, runs / "1x"), ({"label": "3x", "speedups": [3.0]}, runs / "3x")]
    for extra, want in [(["--recipe", "from-1x"], 2e-4), (["--recipe", "lr-5e-4"], 5e-4),
                        (["--recipe", "from-1x", "--lr", "5e-4"], 5e-4), (["--recipe", "lr-5e-4", "--lr", "1e-4"], 1e-4)]:
        args = mod._parse(_args(tiny_dir, csvs, tmp_path, *extra))
        assert [mod._train_config(args, e, d, 1.0).lr for e, d in entries] == [want, want], extra


def test_gpu_frontier_script_runs_on_cpu_with_a_tiny_model(tmp_path, tiny_dir, csvs):
    dev, test = csvs
    env = {**os.environ, "FRONTIER_MODEL": str(tiny_dir), "FRONTIER_DATA": str(dev.parent), "DEVICE": "cpu",
           "BF16": "1", "EPOCHS": "0.3", "BATCH": "4", "EVAL_BATCH": "4", "LIMIT_S": "120", "EVAL_RESERVE_MIN": "0.3", "FRONTIER_ARGS": "--mixed 2,3 --speedups 1,2",
           "RUNS": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    out = tmp_path / "OUT"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_frontier.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads((out / "gpu_frontier_steps.json").read_text())
    assert [s["status"] for s in log["steps"]][-3:] == ["ok"] * 3  # the three evaluations
    assert (out / "gpu_frontier.png").exists() and (out / "env.txt").exists()
    record = json.loads((out / "gpu_frontier_train_2x.json").read_text())
    assert record["config"]["bf16"] is True  # the GPU settings ran, on CPU
    assert "--eval-dtype bfloat16" in log["command"]


def test_frontier_step_that_fails_is_logged_and_the_others_run(tmp_path, tiny_dir, csvs, capsys):
    mod = load_benchmark("frontier")
    # 5x needs more than the tiny model's 8 layers allow with a warm-up layer
    assert mod.main(_args(tiny_dir, csvs, tmp_path, "--speedups", "1,5", "--mixed", "", "--epochs", "0.2",
                          "--name", "bad")) == 1
    log = json.loads((tmp_path / "out" / "bad_steps.json").read_text())
    status = {s["step"]: s["status"] for s in log["steps"]}
    assert status["train 1x"] == "ok" and status["eval 1x"] == "ok"
    assert status["train 5x"].startswith("failed: speedup") and status["eval 5x"] == "skipped: no trained model"
    assert "error: train 5x: failed" in capsys.readouterr().err
