"""What ``skipdecode train`` tells its user: the summary line of a resumed or already finished run
(run totals apart from this session's numbers), Ctrl-C or SIGTERM while the model loads (one line,
exit 130/143), and errors that name the options (``--min-layers``, ``--distill``, ``--kl-weight``,
a resume with other data naming both files). Tiny random models, offline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_train import cli_run, saved_cli_inputs

from skipdecode.cli_train import summary_line
from skipdecode.train import TrainResult


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return saved_cli_inputs(tmp_path_factory.mktemp("msg"))


def _args(model, data, out, *extra):
    return ["train", "--model", str(model), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--val-fraction", "0", "--no-progress", *extra]


# ---- the summary line ---------------------------------------------------------------------


def _result(**kw) -> TrainResult:
    base = dict(out_dir="runs/x", final_dir="runs/x/final", steps=12, total_steps=12, examples_seen=96,
                tokens_seen=4794, target_tokens_seen=1200, wall_seconds=11.2, train_seconds=3.0,
                tokens_per_second=209.9, target_tokens_per_second=50.0, train_log=[{"loss": 1.5}],
                session_steps=12, session_tokens=4794, session_target_tokens=1200)
    base.update(kw)
    return TrainResult(**base)


def test_summary_line_of_a_fresh_a_resumed_and_a_finished_run():
    assert summary_line(_result()) == ("12 steps | 4794 tokens | 209.9 tok/s (50.0 response tok/s) | 11 s | "
                                       "final loss 1.5000")
    resumed = _result(resumed_from="runs/x/checkpoint-00000010", session_steps=2, session_tokens=630)
    assert summary_line(resumed) == (
        "run: 12 of 12 steps, 4794 tokens | this session (resumed from step 10): 2 steps, 630 tokens, "
        "209.9 tok/s (50.0 response tok/s), 11 s | final loss 1.5000")
    done = _result(resumed_from="runs/x/checkpoint-00000012", session_steps=0, session_tokens=0,
                   tokens_per_second=0.0, target_tokens_per_second=0.0)
    assert summary_line(done) == ("run already complete: 12 of 12 steps, 4794 tokens; nothing trained in this "
                                  "session (resumed from runs/x/checkpoint-00000012) | 11 s | final loss 1.5000")
    spent = _result(resumed_from="runs/x/checkpoint-00000005", steps=5, session_steps=0, stopped_on_budget=True)
    assert summary_line(spent).startswith("the --max-minutes budget was already spent: 5 of 12 steps")


def test_cli_summary_after_a_resume_and_after_a_finished_run(inputs, tmp_path, monkeypatch):
    """Killed after step 2 of 4, resumed: the line gives the run's 4 steps and all its tokens,
    and this session's 2 steps and their tokens; resumed again: already complete, no rate."""
    from skipdecode.training import loop

    model, data = inputs
    out = tmp_path / "run"
    args = _args(model, data, out, "--speedup", "2", "--max-steps", "4", "--checkpoint-every", "2")
    real_run = loop._Run.run

    def run(self, callback=None):
        def stop_at_2(info):
            if info["step"] == 2:
                raise KeyboardInterrupt
        return real_run(self, stop_at_2)

    monkeypatch.setattr(loop._Run, "run", run)
    res, _ = cli_run(args)
    assert res.exit_code == 130, res.output
    monkeypatch.setattr(loop._Run, "run", real_run)
    res, text = cli_run(args + ["--resume"])
    assert res.exit_code == 0, res.output
    log = json.loads((out / "train_record.json").read_text())["train_log"]
    total, session = sum(r["tokens"] for r in log), sum(r["tokens"] for r in log[2:])
    assert 0 < session < total
    assert f"run: 4 of 4 steps, {total} tokens | this session (resumed from step 2): 2 steps, {session} tokens, " in text
    res, text = cli_run(args + ["--resume"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "complete" in ln)
    assert line.startswith(f"run already complete: 4 of 4 steps, {total} tokens; nothing trained in this session")
    assert "tok/s" not in line
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["session_steps"] == 0 and summary["steps"] == 4


# ---- Ctrl-C while loading -----------------------------------------------------------------


@pytest.mark.parametrize("how,status", [("ctrl-c", 130), ("sigterm", 143)])
def test_interrupted_while_loading_says_so(inputs, tmp_path, monkeypatch, how, status):
    import skipdecode.cli_train as cli_train

    def load_model(*args, **kwargs):
        raise cli_train._Terminated if how == "sigterm" else KeyboardInterrupt

    monkeypatch.setattr(cli_train, "load_model", load_model)
    model, data = inputs
    res, text = cli_run(_args(model, data, tmp_path / "run", "--speedup", "2", "--max-steps", "1"))
    assert res.exit_code == status, res.output
    assert text == "training interrupted while loading the model; nothing was written"
    assert not (tmp_path / "run").exists()


_SELF_INTERRUPT = """
import os, signal, sys, time
# as in a terminal: a shell starts background jobs (e.g. a test run with `&`) with SIGINT ignored,
# which this child would inherit
signal.signal(signal.SIGINT, signal.default_int_handler)
import skipdecode.cli_train as cli_train
def load_model(*args, **kwargs):  # a real SIGINT arrives while the model loads
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
cli_train.load_model = load_model
from skipdecode.cli import app
sys.argv = ["skipdecode"] + sys.argv[1:]
app()
"""


def test_a_real_sigint_while_loading_exits_130_with_one_line(inputs, tmp_path):
    model, data = inputs
    args = _args(model, data, tmp_path / "run", "--speedup", "2", "--max-steps", "1")
    before = signal.getsignal(signal.SIGINT)
    proc = subprocess.run([sys.executable, "-c", _SELF_INTERRUPT, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip() == "training interrupted while loading the model; nothing was written"
    assert proc.stdout == "" and not (tmp_path / "run").exists()
    assert signal.getsignal(signal.SIGINT) is before  # this process untouched


# ---- errors that name the options ---------------------------------------------------------


@pytest.mark.parametrize("extra,words", [
    (["--max-layers", "5", "--min-layers", "3", "--warmup-layers", "3"],
     "error: --warmup-layers must be < --min-layers (3) so that the top layer always runs, got 3"),
    (["--max-layers", "4", "--warmup-layers", "4"],
     "error: --warmup-layers must be < --min-layers (4) so that the top layer always runs, got 4; --min-layers "
     "defaults to --max-layers (model has 6 layers)"),
    (["--speedup", "2", "--teacher", "x"], "error: --teacher needs --kl-weight W (the teacher only enters the KL term)"),
])
def test_schedule_and_teacher_errors_name_the_options(inputs, tmp_path, extra, words):
    model, data = inputs
    res, text = cli_run(_args(model, data, tmp_path / "run", "--max-steps", "1", *extra))
    assert res.exit_code == 2, res.output
    assert words in text and "Traceback" not in res.output


def test_distill_answers_from_names_the_distill_option(inputs, tmp_path):
    model, data = inputs
    (tmp_path / "ckpt").mkdir()
    res, text = cli_run(_args(model, data, tmp_path / "run", "--speedup", "2", "--max-steps", "1",
                           "--distill-answers-from", str(tmp_path / "ckpt")))
    assert res.exit_code == 2, res.output
    assert text.startswith("error: --distill-answers-from needs --distill (it supplies the teacher's answers)")


def test_resume_with_other_data_names_both_files(inputs, tmp_path):
    model, data = inputs
    out = tmp_path / "run"
    args = ["--speedup", "2", "--max-steps", "3", "--checkpoint-every", "1"]
    res, _ = cli_run(_args(model, data, out, *args))
    assert res.exit_code == 0, res.output
    other = tmp_path / "other.jsonl"
    other.write_text(Path(data).read_text().replace("French", "Thai"))
    res, text = cli_run(_args(model, other, out, *args, "--resume"))
    assert res.exit_code == 2, res.output
    assert text.startswith(f"error: --resume cannot continue with other training data: {out}/checkpoint-00000003 "
                           f"trained on {data} (sha256 ")
    assert f"this run reads {other} (sha256 " in text and "Traceback" not in res.output
