"""The recipe study script (benchmarks/recipe_study.py) end to end on a tiny random model, a
synthetic E2E-shaped CSV and a budget of a few seconds; plus the dev split by MR it relies on."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from test_train import tiny_skipmodel

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


NAMES = ["The Eagle", "The Mill", "Alimentum", "Blue Spice", "Zizzi", "Cotto", "Aromi", "Wildwood", "Strada"]
FOODS = ["French", "Italian", "English", "Chinese"]


def write_e2e_csv(path: Path, n_mrs: int = 9, refs_per_mr: int = 3) -> Path:
    """An E2E-shaped CSV (columns mr, ref): ``n_mrs`` MRs with ``refs_per_mr`` references each."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref"])
        for i in range(n_mrs):
            name, food = NAMES[i % len(NAMES)], FOODS[i % len(FOODS)]
            for k in range(refs_per_mr):
                w.writerow([f"name[{name}], food[{food}]", f"{name} serves {food} food{'.' * (k + 1)}"])
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_skipmodel(num_layers=8, chat=False).save_pretrained(path)
    return path


def test_split_by_mr_holds_out_whole_mrs(tmp_path):
    from skipdecode.data import load_examples

    common = load_benchmark("study_common")
    ex = load_examples(write_e2e_csv(tmp_path / "dev.csv"), task="e2e")
    split = common.split_by_mr(ex, 3, seed=0)
    held = {e.prompt for e in split.heldout}
    assert len(held) == 3 and not held & {e.prompt for e in split.train}  # no MR on both sides
    assert len(split.train) + len(split.heldout) == len(ex) == 27
    assert [len(it.references) for it in split.items] == [3, 3, 3]
    assert common.split_by_mr(ex, 3, seed=0).heldout_mrs == split.heldout_mrs  # seeded
    with pytest.raises(ValueError, match="--heldout-mrs"):
        common.split_by_mr(ex, 9, seed=0)


def test_recipe_study_runs_end_to_end_and_resumes(tmp_path, tiny_dir, capsys):
    mod = load_benchmark("recipe_study")
    data = write_e2e_csv(tmp_path / "dev.csv")
    stem = tmp_path / "study"
    common = ["--model", str(tiny_dir), "--data", str(data), "--out", str(stem), "--runs", str(tmp_path / "runs"),
              "--minutes", "0.02", "--max-steps", "3", "--speedup", "2", "--heldout-mrs", "3", "--batch-size", "4",
              "--eval-batch-size", "4", "--eval-every", "2", "--no-progress"]
    assert mod.main(common + ["--recipes", "labels,from-1x-kl,labels-kl-1x"]) == 0
    study = json.loads(stem.with_suffix(".json").read_text())
    # 1x added first: from-1x-kl starts from it, labels-kl-1x distils from it
    assert list(study["recipes"]) == ["1x", "labels", "from-1x-kl", "labels-kl-1x"]
    for row in study["recipes"].values():
        assert 1 <= row["steps"] <= 3 and row["tokens"] > 0 and row["train_minutes"] > 0
        assert 0 <= row["dev_bleu"] <= 100 and row["val_loss"] > 0
        assert len(row["dev_generations"]) == 3 and row["val_curve"][0]["step"] == 0
        assert row["val_curve"][-1]["step"] == row["steps"]
    assert study["recipes"]["1x"]["policy"] == "1x" and study["recipes"]["labels"]["policy"] == "2x"
    assert study["recipes"]["1x"]["dev_theoretical_speedup"] == 1.0
    assert study["recipes"]["labels"]["dev_theoretical_speedup"] > 1.0
    assert study["recipes"]["from-1x-kl"]["config"]["kl_weight"] == 1.0
    assert study["recipes"]["from-1x-kl"]["init"] == "1x" and study["recipes"]["from-1x-kl"]["config"]["teacher"] is None
    kl_1x = study["recipes"]["labels-kl-1x"]
    assert kl_1x["init"] == "base" and kl_1x["config"]["kl_weight"] == 1.0
    # the 1x run's final checkpoint: relative to the repository when beside it (a clone in /tmp
    # next to pytest's tmp_path), else as given (study_common.repo_relative)
    teacher = kl_1x["config"]["teacher"]
    assert (ROOT / teacher).resolve() == (tmp_path / "runs" / "1x" / "final").resolve()
    beside = (tmp_path.resolve()).is_relative_to(ROOT.parent)
    assert teacher == (str(tmp_path / "runs" / "1x" / "final") if not beside else
                       str(Path("..") / (tmp_path / "runs" / "1x" / "final").resolve().relative_to(ROOT.parent)))
    for row in study["recipes"].values():  # the --minutes budget is the trainer's max_minutes
        assert row["config"]["max_minutes"] == 0.02 and row["planned_steps"] == 3
    assert study["n_heldout_pairs"] == 9 and study["n_train_pairs"] == 18
    assert (tmp_path / "runs" / "1x" / "final").is_dir() and not (tmp_path / "runs" / "labels" / "final").exists()
    md = stem.with_suffix(".md").read_text()
    assert "| from-1x-kl | 1x | 1x |" in md and "| labels-kl-1x | base | 1x |" in md and "| labels | base | - |" in md
    assert stem.with_suffix(".png").stat().st_size > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert set(json.loads(last)["recipe_study"]) == {"1x", "labels", "from-1x-kl", "labels-kl-1x"}

    # resumable: finished recipes are skipped, a new one is added
    before = stem.with_suffix(".json").read_text()
    assert mod.main(common + ["--recipes", "labels,no-prompt-grad"]) == 0
    again = json.loads(stem.with_suffix(".json").read_text())
    assert again["recipes"]["labels"] == json.loads(before)["recipes"]["labels"]
    assert list(again["recipes"]) == ["1x", "labels", "no-prompt-grad", "from-1x-kl", "labels-kl-1x"]
    assert again["recipes"]["no-prompt-grad"]["config"]["prompt_grad"] is False


def test_recipe_study_budget_stops_runs_mid_schedule(tmp_path, tiny_dir):
    """A budget far below one step: the run stops after its first step of the 50 planned, and its
    model is still validated and scored (the trainer's max_minutes, no calibration)."""
    mod = load_benchmark("recipe_study")
    stem = tmp_path / "study"
    assert mod.main(["--model", str(tiny_dir), "--data", str(write_e2e_csv(tmp_path / "dev.csv")), "--out", str(stem),
                     "--runs", str(tmp_path / "runs"), "--minutes", "0.00001", "--max-steps", "50", "--speedup", "2",
                     "--heldout-mrs", "3", "--batch-size", "4", "--eval-batch-size", "4", "--no-progress",
                     "--recipes", "labels"]) == 0
    row = json.loads(stem.with_suffix(".json").read_text())["recipes"]["labels"]
    assert row["steps"] == 1 and row["planned_steps"] == 50 and row["stopped_on_budget"] is True
    assert [p["step"] for p in row["val_curve"]] == [0, 1] and 0 <= row["dev_bleu"] <= 100
    assert "| labels | base | - | 1 (50) |" in stem.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--recipes", "labels,bogus"], "--recipes"),
    (["--minutes", "0"], "--minutes"),
    (["--heldout-mrs", "50"], "--heldout-mrs"),
])
def test_recipe_study_bad_input_is_a_one_line_error(tmp_path, tiny_dir, capsys, args, message):
    mod = load_benchmark("recipe_study")
    data = write_e2e_csv(tmp_path / "dev.csv")
    with pytest.raises(SystemExit) as exc:
        mod.main(["--model", str(tiny_dir), "--data", str(data), "--out", str(tmp_path / "s"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1


def test_recipe_study_refuses_an_out_with_other_settings(tmp_path, tiny_dir, capsys):
    mod = load_benchmark("recipe_study")
    stem = tmp_path / "s"
    stem.with_suffix(".json").write_text(json.dumps({"settings": {"minutes": 99}, "recipes": {}}))
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tiny_dir), "--data", str(write_e2e_csv(tmp_path / "d.csv")), "--out", str(stem),
                  "--heldout-mrs", "3"])
    assert "other settings" in capsys.readouterr().err


def test_repo_relative_paths_in_records():
    common = load_benchmark("study_common")
    assert common.repo_relative(ROOT / "runs" / "x" / "final") == "runs/x/final"
    assert common.repo_relative(ROOT.parent / "shared" / "data" / "e2e" / "devset.csv") == "../shared/data/e2e/devset.csv"
    assert common.repo_relative("/elsewhere/model") == "/elsewhere/model"
