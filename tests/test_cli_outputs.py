"""Faults a new user hit after the first sweep (issue 13's kinds, on more commands): outputs that
cannot be written are refused before any work, and a checkpoint folder that transformers cannot
read is one line naming the folder, exit 2, never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from conftest import make_model
from skipdecode import SkipModel
from skipdecode.cli import app

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    SkipModel(make_model("llama", NUM_LAYERS), tokenizer).save_pretrained(path)
    return path


def _run(args):
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    return res, "".join(res.output.split())


def _no_work(monkeypatch, module, name):
    """Make ``module.name`` fail the test if reached: the check must come before the work."""
    def boom(*a, **k):
        raise AssertionError(f"{name} ran although the output cannot be written")
    monkeypatch.setattr(module, name, boom)


def test_bench_output_under_a_file_fails_before_measuring(saved, tmp_path, monkeypatch):
    import skipdecode.bench as bench

    _no_work(monkeypatch, bench, "run_benchmark")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    res, text = _run(["bench", "--model", str(saved), "--batch-sizes", "1", "--speedups", "2",
                      "--new-tokens", "2", "--repeats", "1", "--output", str(blocker / "x.json")])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "--output" in text and "afile" in text


def test_eval_out_that_is_a_file_fails_before_generating(saved, tmp_path, monkeypatch):
    import skipdecode.evaluate as evaluate_module

    _no_work(monkeypatch, evaluate_module, "evaluate")
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "references": ["world"]}) + "\n")
    out = tmp_path / "report"
    out.write_text("not a folder")
    res, text = _run(["eval", "--model", str(saved), "--data", str(data), "--limit", "1", "-n", "2",
                      "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "--out" in text and "isafile" in text


@pytest.mark.parametrize("damage", ["no-weights", "broken-config", "empty-config", "no-tokenizer", "list-meta"])
def test_generate_with_an_unreadable_checkpoint_is_one_line(saved, tmp_path, damage):
    bad = tmp_path / damage
    shutil.copytree(saved, bad)
    if damage == "no-weights":
        (bad / "model.safetensors").unlink()
    elif damage == "broken-config":
        (bad / "config.json").write_text("{")
    elif damage == "empty-config":
        (bad / "config.json").write_text("{}")
    elif damage == "no-tokenizer":
        for f in bad.glob("tokenizer*"):
            f.unlink()
    else:
        (bad / "skipdecode.json").write_text("[1, 2]")
    res, text = _run(["generate", "--model", str(bad), "hello", "-n", "2"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and str(bad).replace(" ", "") in text
    assert len(res.output.strip().splitlines()) <= 3  # one message (rich may wrap a long line)


def test_too_many_warmup_layers_names_warmup_layers_not_speedup(saved):
    from skipdecode.policy import for_speedup
    from skipdecode.protocol import _named

    with pytest.raises(ValueError, match=r"^warmup_layers must be < num_layers \(4\)") as err:
        for_speedup(NUM_LAYERS, 2.0, 8, warmup_layers=7)
    assert _named(err.value, ("speedup", "warmup_layers"), "speedup").param == "warmup_layers"  # server's param
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", "--speedup", "2",
                      "--warmup-layers", "7"])
    assert res.exit_code == 2, res.output
    assert "--warmup-layersmustbe<num_layers" in text and "speedupmustbe" not in text  # the CLI's option name


@pytest.mark.parametrize("extra,want", [
    (["--speedup", "0"], "--speedupmustbeafinitenumber>=1"),
    (["--max-layers", "3", "--min-layers", "4"], "--min-layersmustbein[1,3]"),
])
def test_policy_errors_name_the_cli_option(saved, extra, want):
    """The policy's own message names its field (``speedup``, ``min_layers``); on the command line
    it names the option the user typed."""
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", *extra])
    assert res.exit_code == 2 and want in text, res.output
