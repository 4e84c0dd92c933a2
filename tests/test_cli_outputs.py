"""Faults a new user hit after the first sweep (issue 13's kinds, on more commands): outputs that
cannot be written are refused before any work, and a checkpoint folder that transformers cannot
read is one line naming the folder, exit 2, never a traceback. A later trial's faults follow at the
end: a ``--prompts-file`` that is a folder or not UTF-8, ``eval --horizon`` ignored, messages that
named a Python field instead of the option, ``bench --variants`` repeats, ``eval --model``'s
default and ``--data``/``--output`` problems that did not name the option."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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

    with pytest.raises(ValueError, match=r"^warmup_layers must be < the model's 4 layers") as err:
        for_speedup(NUM_LAYERS, 2.0, 8, warmup_layers=7)
    assert _named(err.value, ("speedup", "warmup_layers"), "speedup").param == "warmup_layers"  # server's param
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", "--speedup", "2",
                      "--warmup-layers", "7"])
    assert res.exit_code == 2, res.output
    assert "--warmup-layersmustbe<themodel's4layers" in text and "speedupmustbe" not in text  # the CLI's option name


@pytest.mark.parametrize("extra,want", [
    (["--speedup", "0"], "--speedupmustbeafinitenumber>=1"),
    (["--max-layers", "3", "--min-layers", "4"], "--min-layersmustbein[1,3]"),
])
def test_policy_errors_name_the_cli_option(saved, extra, want):
    """The policy's own message names its field (``speedup``, ``min_layers``); on the command line
    it names the option the user typed."""
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", *extra])
    assert res.exit_code == 2 and want in text, res.output


# ------------------------------------------------------------ a later new-user trial
def _no_model_load(monkeypatch):
    """Fail the test if the command loads a model: the check must come before."""
    def boom(*a, **k):
        raise AssertionError("the model was loaded before the option was checked")
    monkeypatch.setattr("skipdecode.loading.load", boom)


def _one_line_exit_2(res, text, *fragments):
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)
    for fragment in fragments:
        assert "".join(fragment.split()) in text, (fragment, res.output)


def _eval_data(tmp_path):
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "references": ["world"]}) + "\n")
    return data


@pytest.mark.parametrize("command", ["generate", "bench"])
@pytest.mark.parametrize("kind", ["folder", "not-utf8", "empty"])
def test_prompts_file_folder_binary_or_empty_is_one_line_naming_it(saved, tmp_path, monkeypatch, command, kind):
    """A folder or a non-UTF-8 file used to end in IsADirectoryError/UnicodeDecodeError tracebacks;
    an empty file said "holds no prompt" in bench, the longer text in generate."""
    _no_model_load(monkeypatch)
    path = tmp_path / kind
    if kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe caf\xe9\n" if kind == "not-utf8" else b"\n  \n")
    want = {"folder": "is a folder, not a file", "not-utf8": "is not UTF-8 text",
            "empty": "holds no prompts (one per line; blank lines are skipped)"}[kind]
    args = {"generate": ["generate", "-n", "2"], "bench": ["bench", "--output", str(tmp_path / "b.json")]}[command]
    res, text = _run([*args, "--model", str(saved), "--prompts-file", str(path)])
    _one_line_exit_2(res, text, f"error: --prompts-file {path} {want}")


@pytest.mark.parametrize("command", ["generate", "bench", "eval"])
@pytest.mark.parametrize("horizon", ["0", "-5"])
@pytest.mark.parametrize("with_speedup", [False, True])
def test_bad_horizon_fails_before_loading_naming_horizon(saved, tmp_path, monkeypatch, command, horizon, with_speedup):
    """``eval --horizon 0`` without --speedup used to be ignored (the run went on), and with it the
    model's message (``horizon must be an integer >= 1``) named no option; generate and bench alike."""
    import skipdecode.evaluate as evaluate_module

    _no_model_load(monkeypatch)
    _no_work(monkeypatch, evaluate_module, "evaluate")
    args = {"generate": ["generate", "hello"], "bench": ["bench", "--output", str(tmp_path / "b.json")],
            "eval": ["eval", "--data", str(_eval_data(tmp_path)), "--out", str(tmp_path / "o"), "--no-progress"]}
    speedup = [{"bench": "--speedups"}.get(command, "--speedup"), "2"] if with_speedup else []
    res, text = _run([*args[command], "--model", str(saved), "--horizon", horizon, *speedup])
    _one_line_exit_2(res, text, f"error: --horizon must be >= 1, got {horizon}")


@pytest.mark.parametrize("extra, want, loads", [
    (["--speedup", "0.5"], "error: --speedup must be a finite number >= 1, got 0.5", False),
    (["--metric", "foo"], "error: --metric must be one of bleu, chrf, nist, rouge1, rouge2, rougeL, got 'foo'", False),
    (["--calm-threshold", "0.5", "--calm-min-layers", "99"],
     f"error: --calm-min-layers must be <= the model's {NUM_LAYERS} layers, got 99", True),
    (["--speedup", "100"], "error: --speedup must be <= 2.00 for a model of 4 layers with warmup_layers=1", True),  # eval has no --warmup-layers
    (["--policy", "100"], "error: --policy must be <= 2.00 for a model of 4 layers with warmup_layers=1", True),
    (["--policy", '{"type": "linear_decay", "num_layers": 4, "max_layers": 9, "min_layers": 2}'],
     "error: --policy: max_layers must be in [1, 4] (at most the model's layers), got 9", True),
    (["--policy", '{"type": "linear_decay", "num_layers": 30, "max_layers": 9, "min_layers": 2}'],
     "error: --policy: policy.num_layers (30) must equal the model's num_layers (4)", True),
    (["--policy", "warp"], "error: --policy: unknown policy 'warp'", True),
    (["--policy", '{"type": "linear_decay", "max_layers": 3}'],  # num_layers comes from the model
     "error: --policy of type 'linear_decay': missing min_layers (its fields: num_layers, max_layers", True),
    (["--policy", '{"type": "linear_decay", "max_layers": 3}'],  # num_layers is not asked for: the model gives it
     "required: max_layers, min_layers)", True),
])
def test_eval_option_errors_name_the_option(saved, tmp_path, monkeypatch, extra, want, loads):
    """These named the library's field (``speedup must``, ``calm_min_layers must``) or none at all
    (``unknown metric(s) 'foo'``); those that need no model are refused before it loads."""
    if not loads:
        _no_model_load(monkeypatch)
    res, text = _run(["eval", "--model", str(saved), "--data", str(_eval_data(tmp_path)), "-n", "2",
                      "--out", str(tmp_path / "o"), "--no-progress", *extra])
    _one_line_exit_2(res, text, want)
    assert "calm_min_layers" not in text and "unknownmetric" not in text


def test_seed_out_of_range_names_the_option_without_none(saved, monkeypatch):
    """The library's seed message ends ``(int64) or None``: no value of --seed is None."""
    _no_model_load(monkeypatch)
    res, text = _run(["generate", "hello", "--model", str(saved), "--seed", str(2**64)])
    _one_line_exit_2(res, text, f"error: --seed must be an integer in [{-(2**63)}, {2**63 - 1}] (int64), got {2**64}")
    assert "None" not in res.output


def test_bench_repeated_variant_is_refused_before_loading(saved, tmp_path, monkeypatch):
    """``--variants float32,float32`` used to time float32 twice (the JSON kept one)."""
    _no_model_load(monkeypatch)
    res, text = _run(["bench", "--model", str(saved), "--variants", "float32,int8, float32",
                      "--output", str(tmp_path / "b.json")])
    _one_line_exit_2(res, text, "error: --variants lists 'float32' more than once; give each variant once")


def test_eval_model_help_says_its_default_is_the_stock_weights():
    """``eval``'s default model is 'stock' (no skip adapter), unlike generate/bench/serve: the help
    used to say only "(default: embedded SmolLM2-135M-Instruct)"."""
    res, _ = _run(["eval", "--help"])
    assert res.exit_code == 0, res.output
    text = "".join(res.output.replace("\u2502", "").split())  # without rich's box borders
    for fragment in ("Default: 'stock', the embedded SmolLM2-135M-Instruct WITHOUT its skip adapter",
                     "'--model default' evaluates the embedded model with its 2x skip adapter merged"):
        assert "".join(fragment.split()) in text, res.output
    assert "(default:embeddedSmolLM2-135M-Instruct)" not in text
    # its --no-adapter help does not repeat the other commands' "merged by default"
    assert "eval'sdefaultmodel,'stock',neverhasit" in text and "mergedbydefault" not in text


def test_eval_data_folder_names_the_option(saved, tmp_path, monkeypatch):
    """A folder as --data used to read ``unsupported file type ''``."""
    _no_model_load(monkeypatch)
    folder = tmp_path / "data"
    folder.mkdir()
    res, text = _run(["eval", "--model", str(saved), "--data", str(folder), "--out", str(tmp_path / "o")])
    _one_line_exit_2(res, text, f"error: --data {folder}: is a folder; give a .csv (E2E) or .jsonl file")
    assert "unsupportedfiletype" not in text


def test_train_data_folder_fails_before_loading_naming_the_option(tmp_path, monkeypatch):
    """``train --data DIR`` used to load the model, then say ``unsupported file type ''``."""
    _no_model_load(monkeypatch)
    folder = tmp_path / "data"
    folder.mkdir()
    res, text = _run(["train", "--data", str(folder), "--out", str(tmp_path / "run"), "--speedup", "2", "--max-steps", "1"])
    _one_line_exit_2(res, text, f"error: --data {folder}: is a folder; give a .csv (E2E) or .jsonl file")


def test_train_model_help_says_it_starts_from_the_stock_weights():
    res, text = _run(["train", "--help"])
    assert res.exit_code == 0 and "stockweights" in text and "neverstartsfromashippedskipadapter" in text


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_bench_output_problem_names_the_option_value_and_its_folder(saved, tmp_path, monkeypatch, where):
    """``--output /proc/x.json`` used to say ``--output: /proc cannot be written: ...``: the file
    given is named now, and the folder as its folder."""
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    _no_model_load(monkeypatch)
    if where == "proc":
        folder, want = Path("/proc"), "its folder /proc cannot be written"
    else:
        folder = tmp_path / "afile"
        folder.write_text("x")
        want = f"its folder {folder} is a file, not a folder"
    output = folder / "x.json"
    res, text = _run(["bench", "--model", str(saved), "--output", str(output)])
    _one_line_exit_2(res, text, f"error: --output {output}: {want}")


def test_eval_stop_help_keeps_its_own_default():
    """eval's --stop has its own default (a newline for E2E) and its '' form: its help says so,
    unlike generate's and chat's shared stop help."""
    res, text = _run(["eval", "--help"])
    assert res.exit_code == 0 and "default:newlineforE2E" in text and "--stop''aloneforn" in text, res.output


@pytest.mark.parametrize("name", ["../afile", "sub/x", "..", ""])
def test_eval_name_is_a_file_name(saved, tmp_path, monkeypatch, name):
    """``--name ../afile`` wrote ``OUT/../afile.json``, outside --out; refused before loading."""
    _no_model_load(monkeypatch)
    res, text = _run(["eval", "--model", str(saved), "--data", str(_eval_data(tmp_path)), "-n", "2",
                      "--out", str(tmp_path / "o"), "--no-progress", "--name", name])
    _one_line_exit_2(res, text, f"error: --name must be a file name without a folder (the files go to --out), got {name!r}")


def test_bench_output_that_is_a_folder_is_refused_before_loading(saved, tmp_path, monkeypatch):
    """``bench --output DIR`` ran the whole benchmark, then failed with IsADirectoryError and left
    its temp file beside DIR; now one line before the model loads, and nothing is written."""
    _no_model_load(monkeypatch)
    folder = tmp_path / "outdir"
    folder.mkdir()
    res, text = _run(["bench", "--model", str(saved), "--output", str(folder)])
    _one_line_exit_2(res, text, f"error: --output {folder} is a folder; give a file path in it, such as "
                                f"{folder / 'results.json'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outdir"] and not any(folder.iterdir())


def test_write_json_atomic_leaves_no_temp_file_when_it_fails(tmp_path):
    from skipdecode.model import write_json_atomic

    folder = tmp_path / "d"
    folder.mkdir()
    with pytest.raises(IsADirectoryError):
        write_json_atomic(folder, {"a": 1})
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_policy_errors_name_every_option_they_mention(saved):
    """The library's message names two fields; the CLI writes both as options."""
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", "--max-layers", "3",
                      "--min-layers", "2", "--warmup-layers", "2"])
    _one_line_exit_2(res, text, "error: --warmup-layers must be < --min-layers (2) so that the top layer always runs, got 2")
    assert "min_layers" not in text and "warmup_layers" not in text


def test_as_option_error_replaces_whole_field_names_only():
    from skipdecode.cli_common import as_option_error

    msg = ValueError("calm_min_layers and min_layers: min_layers must be >= 1, got 0")
    assert as_option_error(msg, {"min_layers": "--min-layers"}) == (
        "calm_min_layers and --min-layers: --min-layers must be >= 1, got 0")
    assert as_option_error(msg, {}) == str(msg)


def test_a_damaged_gguf_model_is_one_error_line(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file" * 100)
    res, text = _run(["generate", "hello", "--model", str(fake)])
    _one_line_exit_2(res, text, f"error: cannot read GGUF file {fake}:")


def test_a_policy_bound_says_where_it_comes_from(saved):
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "2", "--max-layers", "3", "--min-layers", "4"])
    _one_line_exit_2(res, text, "error: --min-layers must be in [1, 3] (at most --max-layers), got 4")


def test_a_bound_from_the_schedule_is_not_called_an_option(tmp_path, tokenizer):
    """A model whose schedule runs at most 3 of 4 layers: --min-layers 4 alone breaks a bound the
    user never gave, so the message names the schedule, not --max-layers."""
    from skipdecode.policy import LinearDecayPolicy

    path = tmp_path / "scheduled"
    SkipModel(make_model("llama", NUM_LAYERS), tokenizer,
              policy=LinearDecayPolicy(NUM_LAYERS, 3, 2, 1, horizon=4)).save_pretrained(path)
    res, text = _run(["generate", "--model", str(path), "hello", "-n", "2", "--min-layers", "4"])
    _one_line_exit_2(res, text, "error: --min-layers must be in [1, 3] (at most the schedule's max layers), got 4")


def test_a_one_token_answer_prints_no_nan(saved):
    """One new token comes from the prefill: no decode step ran, so the step figures are '-'."""
    res, _ = _run(["generate", "--model", str(saved), "hello", "-n", "1"])
    assert res.exit_code == 0, res.output
    assert "nan" not in res.output.lower() and "step - ms" in res.output


def test_too_many_new_tokens_names_the_option(saved):
    res, text = _run(["generate", "--model", str(saved), "hello", "-n", "100000"])
    _one_line_exit_2(res, text, "--max-new-tokens 100000 needs", "--max-new-tokens <=")
    assert "max_new_tokens" not in text


def test_a_negative_warmup_is_refused_before_the_model_loads(saved, monkeypatch):
    _no_model_load(monkeypatch)
    res, text = _run(["generate", "--model", str(saved), "hello", "--warmup-layers", "-1"])
    _one_line_exit_2(res, text, "error: --warmup-layers must be >= 0, got -1")
