"""The ``skipdecode`` command (``skipdecode.cli.app``) on tiny checkpoints saved to tmp_path."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_chain_model, make_model
from skipdecode import FullPolicy, LinearDecayPolicy, SkipModel, for_speedup, load
from skipdecode.cli import app

NUM_LAYERS = 6
CHAIN_PROMPT = "Describe the restaurant:"
TARGET = "The Eagle is a coffee shop"
SAVED_POLICY = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
GENERATE_OPTIONS = [
    "--model", "--speedup", "--max-layers", "--min-layers", "--warmup-layers", "--horizon",
    "--prompts-file", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--json",
]


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory, tokenizer):
    """Random tiny llama + tokenizer, full-depth default policy."""
    path = tmp_path_factory.mktemp("ckpt") / "random"
    SkipModel(make_model("llama", NUM_LAYERS), tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory, tokenizer):
    """Programmed tiny llama (writes TARGET then EOS after CHAIN_PROMPT) saved with a policy."""
    path = tmp_path_factory.mktemp("ckpt") / "chain"
    model = make_chain_model(tokenizer, CHAIN_PROMPT, TARGET, NUM_LAYERS)
    SkipModel(model, tokenizer, policy=SAVED_POLICY).save_pretrained(path, extra={"note": "test"})
    return path


def squash(text: str) -> str:
    """Rich wraps long error lines; compare without whitespace."""
    return "".join(text.split())


def invoke(runner, args):
    return runner.invoke(app, args, env={"COLUMNS": "200"})


def json_out(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_generate_json(runner, random_dir):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(random_dir), "-n", "5", "--json"])
    data = json_out(res)
    assert set(data) >= {"texts", "finish_reasons", "token_ids", "stats"}
    assert len(data["texts"]) == 1 and len(data["token_ids"][0]) <= 5
    stats = data["stats"]
    assert stats["batch_size"] == 1 and stats["num_layers"] == NUM_LAYERS
    assert stats["new_tokens"] == len(data["token_ids"][0])
    assert stats["policy"] == FullPolicy(NUM_LAYERS).to_dict()
    assert stats["theoretical_speedup"] == 1.0
    for key in ("prefill_seconds", "decode_seconds", "tokens_per_second", "mean_active_layers", "step_seconds"):
        assert key in stats


def test_generate_speedup(runner, random_dir):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(random_dir), "-n", "6", "--json", "--speedup", "2"])
    stats = json_out(res)["stats"]
    expected = for_speedup(NUM_LAYERS, 2, 32)
    assert (expected.max_layers, expected.min_layers) == (4, 2)
    assert stats["policy"] == expected.to_dict()
    if stats["decode_steps"]:
        budgets = [expected.budget(t) for t in range(1, stats["decode_steps"] + 1)]
        assert stats["theoretical_speedup"] == pytest.approx(NUM_LAYERS * len(budgets) / sum(budgets))
        assert stats["theoretical_speedup"] > 1


def test_generate_explicit_layers(runner, chain_dir):
    args = ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json",
            "--max-layers", "4", "--min-layers", "3", "--warmup-layers", "0", "--horizon", "2"]
    data = json_out(invoke(runner, args))
    policy = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=3, warmup_layers=0, horizon=2)
    stats = data["stats"]
    assert stats["policy"] == policy.to_dict()
    assert data["texts"] == [TARGET] and data["finish_reasons"] == ["eos"]
    budgets = [policy.budget(t) for t in range(1, stats["decode_steps"] + 1)]
    assert stats["mean_active_layers"] == pytest.approx(sum(budgets) / len(budgets))


def test_horizon_alone_retimes_saved_policy(runner, chain_dir):
    data = json_out(invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json",
                                    "--horizon", "9"]))
    expected = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=9)
    assert data["stats"]["policy"] == expected.to_dict()
    # an explicit flag overrides one field and keeps the checkpoint's others
    data = json_out(invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json",
                                    "--min-layers", "3"]))
    assert data["stats"]["policy"] == {**SAVED_POLICY.to_dict(), "min_layers": 3}


def test_saved_policy_is_picked_up(runner, chain_dir):
    sk = load(str(chain_dir))
    assert sk.policy == SAVED_POLICY
    assert sk.skip_config["note"] == "test"
    assert sk.num_layers == NUM_LAYERS
    # the CLI uses it when no policy flag is given ...
    data = json_out(invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json"]))
    assert data["stats"]["policy"] == SAVED_POLICY.to_dict()
    steps = data["stats"]["decode_steps"]
    budgets = [SAVED_POLICY.budget(t) for t in range(1, steps + 1)]
    assert data["stats"]["theoretical_speedup"] == pytest.approx(NUM_LAYERS * steps / sum(budgets))
    # ... and `info` reports it
    info = json.loads(invoke(runner, ["info", "--model", str(chain_dir), "--json"]).stdout)
    assert info["policy"] == SAVED_POLICY.to_dict() and info["num_layers"] == NUM_LAYERS
    assert info["model_type"] == "llama"
    # the generic --speedup schedules' horizon has its own name, apart from the policy's horizon
    assert info["speedup_horizon"] == load(str(chain_dir)).horizon and "horizon" not in info


def test_load_policy_override_and_weights_round_trip(chain_dir, tokenizer):
    override = FullPolicy(NUM_LAYERS)
    sk = load(str(chain_dir), policy=override)
    assert sk.policy == override
    original = make_chain_model(tokenizer, CHAIN_PROMPT, TARGET, NUM_LAYERS)
    for (name, a), (_, b) in zip(original.state_dict().items(), sk.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert sk.generate(CHAIN_PROMPT, max_new_tokens=20).texts == [TARGET]


def test_streaming_output(runner, chain_dir):
    res = invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20"])
    assert res.exit_code == 0, res.output
    assert TARGET in res.stdout
    assert "theoretical speedup" in res.stderr
    # the statistics name the model's saved schedule in words, not as a Python dict
    stats = " ".join(res.stderr.split())
    assert f"policy 5 -> 2 of {NUM_LAYERS} layers over 4 tokens (warm-up 1)" in stats, res.stderr
    assert "'type'" not in res.stderr


def test_a_local_directory_loads_without_transformers_progress_bar(chain_dir, capfd):
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()  # another test may have turned it off
    hf_logging.enable_progress_bar()
    try:
        load(str(chain_dir))
        assert "Loading weights" not in capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()  # restored for the caller's own loads
    finally:
        if not was_on:
            hf_logging.disable_progress_bar()


def test_prompts_file_and_arguments_batch(runner, chain_dir, tmp_path):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{CHAIN_PROMPT}\n\n</s>{CHAIN_PROMPT}\n")
    res = invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "--prompts-file", str(prompts_file),
                          "-n", "20", "--json"])
    data = json_out(res)
    assert data["texts"] == [TARGET] * 3  # the blank line is skipped
    assert data["stats"]["batch_size"] == 3


def test_stop_and_sampling_flags(runner, chain_dir, random_dir):
    data = json_out(invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json",
                                    "--stop", "coffee"]))
    assert data["texts"] == ["The Eagle is a "] and data["finish_reasons"] == ["stop"]
    # seeded sampling is reproducible from the command line, and the seed matters: the random
    # model's samples differ between seeds (the chain model's would not, issue 13 item 14)
    args = ["generate", "The Eagle", "--model", str(random_dir), "-n", "12", "--json", "--temperature", "1.0", "--seed"]
    a, b, c = (json_out(invoke(runner, args + [s])) for s in ("5", "5", "6"))
    assert a["token_ids"] == b["token_ids"] and a["token_ids"] != c["token_ids"]


@pytest.mark.parametrize(
    "extra,option",
    [
        (["--top-p", "3"], "top_p"),
        (["--top-p", "-0.1"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--speedup", "0.5"], "speedup"),
        (["--speedup", "100"], "speedup"),
        (["--min-layers", "9", "--max-layers", "3"], "min_layers"),
        (["--max-layers", "7"], "max_layers"),
        (["--warmup-layers", "3", "--min-layers", "2"], "warmup_layers"),
        (["--horizon", "0", "--max-layers", "4", "--min-layers", "2"], "horizon"),
        (["--horizon", "0"], "horizon"),
        (["--speedup", "2", "--max-layers", "4"], "speedup"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--max-batch-size", "0"], "max-batch-size"),
        (["Another prompt", "--max-new-tokens", "1000"], "max_new_tokens"),  # several prompts: in flight
        (["--max-new-tokens", "1000"], "max_new_tokens"),  # longer than the 256-position context
        (["--dtype", "float8"], "dtype"),
        (["--horizon", "4"], "horizon"),  # a full-depth model: a horizon alone would be ignored
        (["--warmup-layers", "2"], "warmup_layers"),
        (["--device", "foo"], "--device"),
        (["--device", "cuda:7"] if not __import__("torch").cuda.is_available() else ["--device", "foo"], "--device"),
    ],
)
def test_bad_values_exit_2_naming_the_option(runner, random_dir, extra, option):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(random_dir), "-n", "3", *extra])
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.output
    message = squash(res.output).replace("-", "_")
    assert option.replace("-", "_") in message, res.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_this_machine_lacks_is_named_as_given(runner, tmp_path):
    """``--device cuda:7`` is reported whole (was cut to ``cuda:``), before the model is read."""
    res = invoke(runner, ["generate", "The Eagle", "--model", str(tmp_path / "never_read"), "--device", "cuda:7"])
    assert res.exit_code == 2, res.output
    assert squash("--device cuda:7: this torch build or machine has no CUDA GPU") in squash(res.output), res.output


def test_missing_model_path_exits_2(runner, tmp_path):
    missing = tmp_path / "no_such_model"
    res = invoke(runner, ["generate", "The Eagle", "--model", str(missing), "-n", "3"])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert squash(str(missing)) in squash(res.output)


def test_directory_without_checkpoint_exits_2(runner, tmp_path):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(tmp_path), "-n", "3"])
    assert res.exit_code == 2, res.output
    assert "config.json" in squash(res.output)


def test_blank_prompt_argument_exits_2_naming_it_before_loading(runner, tmp_path):
    """The second of two prompts blank: exit 2 naming PROMPT 2 (1-based, as typed), before the
    model loads (the model path does not exist, yet the prompt is what the error is about)."""
    res = invoke(runner, ["generate", "The Eagle", "  ", "--model", str(tmp_path / "no_such_model"), "-n", "3"])
    assert res.exit_code == 2, res.output
    assert squash("PROMPT 2 is empty (of 2 given as arguments)") in squash(res.output)
    assert "Traceback" not in res.output and "prompts[1]" not in res.output


def test_missing_prompts_file_exits_2(runner, random_dir, tmp_path):
    res = invoke(runner, ["generate", "--model", str(random_dir), "--prompts-file", str(tmp_path / "nope.txt")])
    assert res.exit_code == 2
    assert "--prompts-file" in res.output and "Traceback" not in res.output


def test_empty_prompts_file_is_named(runner, random_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    res = invoke(runner, ["generate", "--model", str(random_dir), "--prompts-file", str(empty)])
    assert res.exit_code == 2 and squash(f"--prompts-file {empty} holds no prompts") in squash(res.output)


def test_speedup_with_layer_bounds_names_the_options(runner, random_dir):
    res = invoke(runner, ["generate", "x", "--model", str(random_dir), "--speedup", "2", "--max-layers", "4"])
    assert res.exit_code == 2
    assert squash("give either --speedup or --max-layers/--min-layers, not both") in squash(res.output)


def test_no_prompt_exits_2(runner, random_dir):
    res = invoke(runner, ["generate", "--model", str(random_dir)])
    assert res.exit_code == 2
    assert "prompt" in res.output and "Traceback" not in res.output


def test_blank_prompt_exits_2(runner, random_dir):
    res = invoke(runner, ["generate", "   ", "--model", str(random_dir), "-n", "2"])
    assert res.exit_code == 2, res.output
    assert squash("PROMPT 1 is empty") in squash(res.output) and "Traceback" not in res.output


def test_non_numeric_option_exits_2(runner, random_dir):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(random_dir), "--max-layers", "many"])
    assert res.exit_code == 2
    assert "--max-layers" in res.output


def test_generate_help_lists_every_option(runner):
    res = invoke(runner, ["generate", "--help"])
    assert res.exit_code == 0
    for option in GENERATE_OPTIONS:
        assert option in res.output, option


def test_top_level_help_lists_generate(runner):
    res = invoke(runner, ["--help"])
    assert res.exit_code == 0
    assert "generate" in res.output and "info" in res.output


def test_speedup_combines_with_warmup_layers(runner, random_dir):
    res = invoke(runner, ["generate", "The Eagle", "--model", str(random_dir), "-n", "3", "--json",
                          "--speedup", "2", "--warmup-layers", "2", "--horizon", "4"])
    assert res.exit_code == 0, res.output
    policy = json.loads(res.stdout.strip().splitlines()[-1])["stats"]["policy"]
    assert policy["warmup_layers"] == 2 and policy["horizon"] == 4 and policy["type"] == "linear_decay"


def test_serve_on_a_busy_port_fails_at_once_with_one_line(runner, tmp_path):
    """The port is checked before the model loads: a model path that does not exist is never
    reached, and the message names --port."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = invoke(runner, ["serve", "--port", str(port), "--model", str(tmp_path / "no_such_model")])
    assert res.exit_code == 2, res.output
    message = squash(res.output)
    assert "--port" in message and str(port) in message and "no_such_model" not in message, res.output
    assert "Traceback" not in res.output


def test_error_messages_print_brackets_verbatim(runner, tmp_path):
    """Messages are printed as text, not rich markup: a path (or an E2E MR) with brackets is shown
    as is; '[/f]' would otherwise be read as a closing tag and crash the error report itself."""
    missing = tmp_path / "d[" / "f][bold].txt"
    res = invoke(runner, ["bench", "--prompts-file", str(missing), "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert str(missing) in squash(res.output), res.output


@pytest.mark.parametrize(
    "args, option",
    [(["generate", "hi", "--speedup", "abc"], "--speedup"), (["train", "--data", "x.csv"], "--out"),
     (["generate", "hi", "--no-such-flag"], "--no-such-flag")],
)
def test_console_entry_point_usage_errors_are_one_line(capsys, args, option):
    """Errors click finds before our code runs (bad type, missing option, unknown flag) leave the
    ``skipdecode`` command as one ``error:`` line naming the option, exit code 2."""
    from skipdecode.cli import main

    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and option in lines[0], lines


def test_console_entry_point_success_and_help_exit_0(capsys):
    from skipdecode.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "generate" in capsys.readouterr().out


def test_console_entry_point_without_arguments_prints_help_and_no_empty_error(capsys):
    """``skipdecode`` alone shows the command list (exit 2, as click's no-arguments help), without
    an empty ``error:`` line after it."""
    from skipdecode.cli import main

    with pytest.raises(SystemExit) as info:
        main([])
    captured = capsys.readouterr()
    assert info.value.code == 2 and "generate" in captured.out and "serve" in captured.out
    assert "error" not in captured.err, captured.err


@pytest.mark.parametrize("width", [80, 100, 200])
def test_terminals_show_whole_command_summaries(width):
    """At 80, 100 and 200 columns no command's summary is cut short with '...'."""
    res = CliRunner().invoke(app, ["--help"], terminal_width=width)
    commands = res.output.split("Commands:")[1]
    assert res.exit_code == 0 and "..." not in commands, res.output
    assert "Chat in the terminal under a skip policy (/reset, /exit, /help)." in res.output
    assert "Serve an OpenAI-compatible API, with /health and /metrics." in res.output


def test_version_option(capsys):
    from skipdecode import __version__
    from skipdecode.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"skipdecode {__version__}"


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "serve", "bench", "train", "info"])
def test_help_at_80_columns_cuts_no_option_name(command):
    """Help on an 80-column terminal (or a pipe) wraps, never ellipsizes option names (rich's
    tables cut ``--repetition-penalty`` to ``--repetition-pena…``)."""
    res = CliRunner().invoke(app, [command, "--help"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "\u2026" not in res.output
    if command == "generate":
        for option in ("--repetition-penalty", "--frequency-penalty", "--presence-penalty", "--logprobs"):
            assert option in res.output, option


def test_serve_rejects_zero_threads_before_loading(runner, tmp_path):
    """--threads 0 is refused with one line naming the option, before any model is loaded."""
    res = invoke(runner, ["serve", "--threads", "0", "--model", str(tmp_path / "no_such_model")])
    assert res.exit_code == 2, res.output
    message = squash(res.output)
    assert "--threadsmustbe>=1,got0" in message and "no_such_model" not in message, res.output


def test_set_threads_applies_the_count_and_keeps_the_default_when_unset():
    from skipdecode.cli_common import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        set_threads(None)  # unset: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_serve_interrupted_while_loading_exits_130_at_once(runner, monkeypatch):
    """Ctrl-C while the model loads on its own thread (scheduler.on_fresh_thread): one line and
    exit code 130 through os._exit, not the interpreter's shutdown, which raced the loading
    thread inside torch's C++ code and sometimes ended in a C++ abort (found in a trial)."""
    import socket

    import skipdecode.cli as cli
    import skipdecode.scheduler as scheduler

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(scheduler, "on_fresh_thread", interrupted)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    res = invoke(runner, ["serve", "--port", str(port)])
    assert exits == [130] and res.exit_code == 130, res.output
    assert "interrupted while loading the model" in res.output and "Traceback" not in res.output


def test_generate_logprobs(runner, chain_dir):
    """``--logprobs N``: per text token its id, text, log-probability and N alternatives (the
    EOS that ends the chain's answer gets none); the table in text mode; a bad value names the
    flag before anything loads."""
    data = json_out(invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--json",
                                    "--logprobs", "2"]))
    entries = data["logprobs"][0]
    assert data["finish_reasons"] == ["eos"] and [e["token"] for e in entries] == data["token_ids"][0][:-1]
    assert "".join(e["text"] for e in entries) == data["texts"][0] == TARGET
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8") == TARGET
    assert all(len(e["top"]) == 2 and e["top"][0]["token"] == e["token"] for e in entries)  # greedy: the top one
    assert all(e["logprob"] >= e["top"][1]["logprob"] for e in entries)
    res = invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "20", "--logprobs", "0"])
    assert res.exit_code == 0, res.output
    assert "log-probabilities" in res.stdout and "Eagle" in res.stdout
    res = invoke(runner, ["generate", "x", "--model", str(chain_dir), "--logprobs", "21"])
    assert res.exit_code != 0 and "--logprobs must be an integer in [0, 20]" in res.output
    assert "Traceback" not in res.output and "Loading" not in res.output


@pytest.mark.parametrize("command", ["generate", "eval", "bench"])
def test_a_bad_model_path_is_named_as_the_model_option(runner, tmp_path, command):
    """A model that is neither a folder, a .gguf file nor a hub id is refused naming --model,
    on every command that loads one, before anything runs."""
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    items = tmp_path / "items.jsonl"  # eval reads its data before the model: no shared data folder needed
    items.write_text(json.dumps({"prompt": "name[The Eagle]", "references": ["The Eagle."]}) + "\n")
    args = {"generate": ["generate", "x", "-n", "1"],
            "eval": ["eval", "--data", str(items), "--limit", "1", "--out", str(tmp_path / "o")],
            "bench": ["bench", "--output", str(tmp_path / "b.json")]}[command]
    for model, detail in ((str(text), "neither a directory nor a .gguf file"),
                          (str(tmp_path / "gone.gguf"), "GGUF file not found")):
        res = invoke(runner, [*args, "--model", model])
        assert res.exit_code == 2, res.output
        message = squash(res.output)
        assert message.startswith("error:--model:") and squash(detail) in message, res.output
        assert "Traceback" not in res.output
