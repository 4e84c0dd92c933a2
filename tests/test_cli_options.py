"""Options spelled the same way across commands (a new user's trial, stop 51): ``--threads`` on
every command that runs the model, and speedups given either way (``--speedup 2 --speedup 3`` or
``--speedups 2,3``) to both ``eval`` and ``bench``."""

from __future__ import annotations

import json

import pytest
from test_cli_outputs import _run as _run_squeezed
from test_cli_outputs import saved  # noqa: F401  (the tiny saved checkpoint fixture)


def _run(args):
    """``(result, output with whitespace runs as single spaces)`` of the CLI on ``args``."""
    res, _ = _run_squeezed(args)
    return res, " ".join(res.output.split())


class _Stop(Exception):
    """Raised by a stand-in for the command's work; ``args`` and ``kwargs`` are what it was given."""

    def __init__(self, args, kwargs):
        super().__init__("stand-in reached")
        self.call_args, self.kwargs = args, kwargs


def _capture(monkeypatch, module, name):
    """Replace ``module.name`` by a function that raises :class:`_Stop` with its arguments."""
    def stand_in(*args, **kwargs):
        raise _Stop(args, kwargs)
    monkeypatch.setattr(module, name, stand_in)


@pytest.fixture
def thread_calls(monkeypatch):
    """The values given to ``torch.set_num_threads`` during the test (the real one is not called,
    so the test process keeps its threads)."""
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


def _eval_data(tmp_path):
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "references": ["hi"]}) + "\n")
    return data


def _commands(saved, tmp_path):
    """Each command that runs the model, with arguments that reach its work."""
    data = _eval_data(tmp_path)
    return {
        "generate": ["generate", "--model", str(saved), "hello", "-n", "2"],
        "eval": ["eval", "--model", str(saved), "--data", str(data), "-n", "2", "--out", str(tmp_path / "o"),
                 "--no-progress"],
        "train": ["train", "--model", str(saved), "--data", str(data), "--out", str(tmp_path / "run"),
                  "--speedup", "2", "--max-steps", "1", "--no-progress"],
        "chat": ["chat", "--model", str(saved)],
        "bench": ["bench", "--model", str(saved), "--output", str(tmp_path / "b.json")],
    }


@pytest.mark.parametrize("command", ["generate", "eval", "train", "chat", "bench", "serve"])
def test_threads_below_one_is_refused_on_every_command(command, saved, tmp_path, thread_calls):
    args = _commands(saved, tmp_path).get(command, [command])
    res, text = _run([*args, "--threads", "0"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--threads must be >= 1, got 0" in text
    assert thread_calls == []


@pytest.mark.parametrize("command", ["generate", "eval", "train"])
def test_threads_sets_torchs_intra_op_threads(command, saved, tmp_path, thread_calls, monkeypatch):
    import importlib

    for name in ("generate", "evaluate", "train"):  # the modules (the package exports functions of these names)
        _capture(monkeypatch, importlib.import_module(f"skipdecode.{name}"), name)
    res, _ = _run([*_commands(saved, tmp_path)[command], "--threads", "1"])
    assert isinstance(res.exception, _Stop), res.output  # the command reached its work
    assert thread_calls == [1]


def test_eval_takes_speedups_repeated_or_comma_separated(saved, tmp_path, monkeypatch):
    import skipdecode.evaluate as evaluate_module

    _capture(monkeypatch, evaluate_module, "evaluate")
    base = _commands(saved, tmp_path)["eval"]
    specs = []
    for extra in (["--speedup", "2", "--speedup", "3"], ["--speedups", "2,3"], ["-s", "2,3"], ["-s", "2", "-s", "3,5"]):
        res, _ = _run([*base, *extra])
        assert isinstance(res.exception, _Stop), res.output
        specs.append(list(res.exception.call_args[2]))  # evaluate(entries, items, specs, ...)
    assert specs == [[2.0, 3.0], [2.0, 3.0], [2.0, 3.0], [2.0, 3.0, 5.0]]


def test_eval_speedup_that_is_not_a_number_names_the_option(saved, tmp_path):
    res, text = _run([*_commands(saved, tmp_path)["eval"], "--speedups", "2,fast"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--speedup must be a number (or comma-separated numbers such as 2,3), got '2,fast'" in text


def test_bench_takes_speedups_repeated_or_comma_separated(saved, monkeypatch, tmp_path):
    import skipdecode.bench as bench

    _capture(monkeypatch, bench, "run_benchmark")
    base = ["bench", "--model", str(saved), "--batch-sizes", "1", "--new-tokens", "2", "--repeats", "1",
            "--no-hf", "--output", str(tmp_path / "b.json")]
    got = {}
    for label, extra in (("repeated", ["--speedup", "2", "--speedup", "3"]), ("list", ["--speedups", "2,3"]),
                         ("default", []), ("none", ["--speedups", ""])):
        res, _ = _run([*base, *extra])
        assert isinstance(res.exception, _Stop), res.output
        got[label] = list(res.exception.kwargs["speedups"])
    assert got == {"repeated": [2.0, 3.0], "list": [2.0, 3.0], "default": [2.0, 3.0, 5.0], "none": []}


@pytest.mark.parametrize("command", ["generate", "eval", "train", "chat", "bench", "serve"])
def test_more_threads_than_cores_is_refused(command, saved, tmp_path, thread_calls):
    """--threads 100000 used to end in "can't start new thread" and a segmentation fault."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    args = _commands(saved, tmp_path).get(command, [command])
    res, text = _run([*args, "--threads", str(cores + 1)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"--threads must be at most {cores} (the cores this process may use), got {cores + 1}" in text
    assert thread_calls == []


def test_a_bound_from_the_schedule_in_a_comparison_is_named_so(tmp_path, tokenizer):
    """--warmup-layers alone on a model whose schedule's floor is 2: the 2 is the schedule's, not
    an option the user gave; with --min-layers given, the option is named."""
    from conftest import make_model
    from skipdecode import SkipModel
    from skipdecode.policy import LinearDecayPolicy

    path = tmp_path / "scheduled"
    SkipModel(make_model("llama", 4), tokenizer, policy=LinearDecayPolicy(4, 3, 2, 1, horizon=4)).save_pretrained(path)
    res, text = _run(["generate", "--model", str(path), "hello", "-n", "2", "--warmup-layers", "2"])
    assert res.exit_code == 2, res.output
    assert "--warmup-layers must be < the schedule's min layers (2)" in text
    res, text = _run(["generate", "--model", str(path), "hello", "-n", "2", "--warmup-layers", "3", "--min-layers", "3"])
    assert res.exit_code == 2, res.output
    assert "--warmup-layers must be < --min-layers (3)" in text


def test_a_speedup_the_model_cannot_reach_names_bench_option(saved, tmp_path):
    res, text = _run(["bench", "--model", str(saved), "--batch-sizes", "1", "--speedups", "30", "--new-tokens", "2",
                      "--repeats", "1", "--warmup", "0", "--no-hf", "--output", str(tmp_path / "b.json")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert text.startswith("error: --speedups must be <=") or "error: --speedups must be <=" in text


@pytest.mark.parametrize("text", ["2,,3", "2,3,", ",2"])
def test_an_empty_item_in_a_speedup_list_is_refused(text, saved, tmp_path):
    """"2,,3" ran 2x and 3x without a word: more likely a typo than a wish. The whole list empty
    ("") stays allowed on bench (full depth only)."""
    commands = _commands(saved, tmp_path)
    train = [a for a in commands["train"] if a not in ("--speedup", "2")]  # --speedups instead
    for args, option in ((commands["eval"], "--speedup"), (commands["bench"], "--speedups"), (train, "--speedups")):
        res, out = _run([*args, "--speedups", text])
        assert res.exit_code == 2 and "Traceback" not in res.output, (args[0], res.output)
        assert f"{option} has an empty item (two commas in a row, or one at an end), got '{text}'" in out, res.output


def test_bench_batch_sizes_with_an_empty_item_are_refused(saved, tmp_path):
    res, text = _run([*_commands(saved, tmp_path)["bench"], "--batch-sizes", "1,,2"])
    assert res.exit_code == 2, res.output
    assert "--batch-sizes has an empty item (two commas in a row, or one at an end), got '1,,2'" in text
