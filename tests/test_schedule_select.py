"""``benchmarks/schedule_select.py``: its selection split is exactly the prompts that
``benchmarks/train_adapter.py``'s run holds back from training (checked against the trainer's own
data preparation), and its option parsing."""

from __future__ import annotations

import pytest

from conftest import make_tokenizer
from conftest import load_benchmark
from skipdecode.train import TrainConfig
from skipdecode.training.prepare import load_run_data


@pytest.fixture(scope="module")
def script():
    return load_benchmark("schedule_select")


def test_selection_prompts_are_the_ones_training_never_sees(script, tmp_path):
    train_rows = [{"prompt": f"prompt number {i}"} for i in range(120)]
    heldout_rows = [{"prompt": "prompt number 7"}, {"prompt": "another"}]  # one overlaps a training prompt
    chosen = script.selection_prompts(train_rows, heldout_rows)
    # what train_adapter.py passes to train(): the training prompts that are not held out
    passed = [r["prompt"] for r in train_rows if r["prompt"] != "prompt number 7"]
    config = TrainConfig(out_dir=str(tmp_path / "x"), speedup=2.0, distill=True, val_fraction=0.04,
                         max_val_examples=2, seed=0, chat=False, progress=False)
    data = load_run_data(passed, None, config, make_tokenizer(), chat=False)
    trained = {e.prompt for e in data.train_raw}
    assert len(chosen) == round(0.04 * len(passed)) == 5 and len(set(chosen)) == 5
    assert trained.isdisjoint(chosen) and trained | set(chosen) == set(passed)
    assert {e.prompt for e in data.val_raw} <= set(chosen)  # the validation loss scores 2 of them
    assert "prompt number 7" not in chosen


def test_schedules_option(script, capsys):
    assert script._schedules("10:25:5:12,0:25:5:32") == [(10, 25, 5, 12), (0, 25, 5, 32)]
    for bad in ("", "10:25:5", "a:b:c:d"):
        with pytest.raises(SystemExit) as exc:
            script.main(["--schedules", bad])
        assert exc.value.code == 2 and "--schedules" in capsys.readouterr().err


def test_probe_options_are_checked_and_a_smoke_test_keeps_the_committed_results(script, capsys, monkeypatch):
    import argparse

    import adapter_agreement as aa

    for bad, flag in ((["--batch-size", "0"], "--batch-size"), (["--max-new-tokens", "0"], "--max-new-tokens")):
        with pytest.raises(SystemExit) as exc:
            script.main(["--schedules", "1:25:5:4", *bad])
        assert exc.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err
    monkeypatch.setattr(aa.adapter_prompts, "build_or_exit", lambda data, mismatch=None: ([], []))
    ap = argparse.ArgumentParser()
    aa.add_common_args(ap, "schedule_select")
    for argv, name in ((["--limit", "2"], "schedule_select_limit2"), ([], "schedule_select"),
                       (["--limit", "2", "--name", "mine"], "mine")):
        args = ap.parse_args(argv)
        aa.common_setup(ap, args)
        assert args.name == name, argv
