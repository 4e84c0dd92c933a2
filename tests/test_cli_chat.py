"""``skipdecode chat`` (skipdecode.cli_chat) on a tiny random checkpoint with a chat template:
every answer equals the library's greedy answer to the conversation so far."""

from __future__ import annotations

import copy
import re

import pytest
from typer.testing import CliRunner

from conftest import make_model
from skipdecode import LinearDecayPolicy, SkipModel, load
from skipdecode.cli import app

NUM_LAYERS = 6
POLICY = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
N = 6  # tokens per answer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("chat") / "tiny"
    SkipModel(make_model("llama", NUM_LAYERS), tokenizer, policy=POLICY).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sk(model_dir):
    return load(str(model_dir))


def answer(sk, messages, **kw) -> str:
    """The library's answer to ``messages`` (the reference the command must print)."""
    return sk.generate([messages], max_new_tokens=N, policy=POLICY, chat=True, **kw).texts[0]


def run_chat(model_dir, lines: str, *args: str):
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "-n", str(N), "--no-stats", *args],
                             input=lines, env={"COLUMNS": "200"})
    return res


def test_each_answer_continues_the_conversation(model_dir, sk):
    res = run_chat(model_dir, "The Eagle\nDescribe the restaurant\n/exit\n")
    assert res.exit_code == 0, res.output
    first = answer(sk, [{"role": "user", "content": "The Eagle"}])
    history = [{"role": "user", "content": "The Eagle"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "Describe the restaurant"}]
    second = answer(sk, history)
    alone = answer(sk, [{"role": "user", "content": "Describe the restaurant"}])
    assert second != alone  # the history changes the answer, so the test can tell them apart
    assert res.stdout == f"{first}\n{second}\n"


def test_reset_starts_over_and_a_system_message_opens_each_conversation(model_dir, sk):
    system = {"role": "system", "content": "Be brief."}
    res = run_chat(model_dir, "The Eagle\n/reset\nDescribe the restaurant\n", "--system", "Be brief.")
    assert res.exit_code == 0, res.output  # end of input ends the session
    first = answer(sk, [system, {"role": "user", "content": "The Eagle"}])
    after_reset = answer(sk, [system, {"role": "user", "content": "Describe the restaurant"}])
    assert res.stdout == f"{first}\n{after_reset}\n"
    assert "new conversation" in res.stderr


def test_sampling_options_reach_every_answer(model_dir, sk):
    res = run_chat(model_dir, "The Eagle\n", "--temperature", "1.0", "--seed", "4")
    assert res.exit_code == 0, res.output
    sampled = answer(sk, [{"role": "user", "content": "The Eagle"}], temperature=1.0, seed=4)
    assert sampled != answer(sk, [{"role": "user", "content": "The Eagle"}])
    assert res.stdout == f"{sampled}\n"


def test_unknown_command_and_blank_lines_are_not_sent(model_dir, sk):
    res = run_chat(model_dir, "\n/help\n/nope\n   \nThe Eagle\n")
    assert res.exit_code == 0, res.output
    assert "commands: /reset (start a new conversation)" in res.stderr and "/help (list these commands)" in res.stderr
    assert "unknown command /nope: /reset" in res.stderr
    assert res.stdout == answer(sk, [{"role": "user", "content": "The Eagle"}]) + "\n"


def test_a_turn_past_the_context_keeps_the_session(model_dir, sk):
    """The tiny model holds 256 positions: a longer message prints the library's message and the
    session goes on (the failed turn is not kept)."""
    long = " ".join(["Eagle"] * 300)
    res = run_chat(model_dir, f"{long}\nThe Eagle\n")
    assert res.exit_code == 0, res.output
    assert "error:" in res.stderr and "/reset starts a new conversation" in res.stderr
    assert res.stdout == answer(sk, [{"role": "user", "content": "The Eagle"}]) + "\n"


def test_stats_line_per_answer(model_dir):
    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "-n", str(N)], input="The Eagle\nHi\n",
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert res.stderr.count(f"/{NUM_LAYERS} layers, theoretical") == 2


@pytest.mark.parametrize("args, words", [
    (["-n", "0"], "--max-new-tokens must be >= 1"),
    (["--speedup", "0.5"], "--speedup must be a finite number >= 1"),
    (["--top-p", "2"], "--top-p must be in [0, 1]"),
    (["--system", "  "], "--system must hold text"),
])
def test_bad_options_fail_in_one_line_before_loading(tmp_path, args, words):
    res = CliRunner().invoke(app, ["chat", "--model", str(tmp_path / "missing"), *args], input="",
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2 and words in res.output and "missing" not in res.output, res.output


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path, tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    path = tmp_path / "plain"
    SkipModel(make_model("llama", NUM_LAYERS), plain, policy=POLICY).save_pretrained(path)
    res = CliRunner().invoke(app, ["chat", "--model", str(path)], input="hi\n", env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "no chat template" in res.output, res.output


def test_ctrl_c_stops_an_answer_which_is_then_not_kept(model_dir, sk, monkeypatch):
    """Ctrl-C after the first streamed token: the answer is dropped from the conversation, and the
    next turn runs (on a fresh engine: the stopped row stayed in the old one)."""
    import skipdecode.inflight as inflight

    real, calls = inflight.generate_inflight, []

    def interrupted_once(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            show = kwargs["on_chunk"]

            def stop_after_the_first_token(chunk):
                show(chunk)
                raise KeyboardInterrupt

            kwargs = {**kwargs, "on_chunk": stop_after_the_first_token}
        return real(*args, **kwargs)

    monkeypatch.setattr(inflight, "generate_inflight", interrupted_once)
    res = run_chat(model_dir, "The Eagle\nDescribe the restaurant\n")
    assert res.exit_code == 0, res.output
    assert "answer stopped" in res.stderr and "error" not in res.stderr
    assert calls[1] == [[{"role": "user", "content": "Describe the restaurant"}]]  # the stopped turn is gone
    assert res.stdout.endswith("\n" + answer(sk, calls[1][0]) + "\n")


def test_later_turns_reuse_the_earlier_prompts_keys_and_values(model_dir, sk):
    """The turns share one engine whose prefix cache holds the previous prompt: the second turn
    prefills only the last answer and the new message, and still answers as a full prefill."""
    from skipdecode.prompts import encode_prompt

    res = CliRunner().invoke(app, ["chat", "--model", str(model_dir), "-n", str(N)],
                             input="The Eagle\nDescribe the restaurant\n", env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    cached = [int(m) for m in re.findall(r"\((\d+) cached\)", res.stderr)]
    first_prompt = encode_prompt(sk.tokenizer, [{"role": "user", "content": "The Eagle"}], chat=True)
    assert len(cached) == 2 and cached[0] == 0 and 0 < cached[1] <= len(first_prompt)
    first = answer(sk, [{"role": "user", "content": "The Eagle"}])
    second = answer(sk, [{"role": "user", "content": "The Eagle"}, {"role": "assistant", "content": first},
                         {"role": "user", "content": "Describe the restaurant"}])
    assert res.stdout == f"{first}\n{second}\n"


def test_messages_are_sent_stripped_and_stop_strings_apply(model_dir, sk):
    """The line's surrounding spaces are not part of the message (they changed the answer);
    --stop cuts every answer as the library's stop strings do."""
    res = run_chat(model_dir, "   The Eagle  \n")
    assert res.stdout == answer(sk, [{"role": "user", "content": "The Eagle"}]) + "\n"
    full = answer(sk, [{"role": "user", "content": "Describe the restaurant"}])
    cut = full[1:3]
    want = answer(sk, [{"role": "user", "content": "Describe the restaurant"}], stop=[cut])
    assert want != full
    res = run_chat(model_dir, "Describe the restaurant\n", "--stop", cut)
    assert res.exit_code == 0, res.output
    assert res.stdout == want + "\n"


def test_the_oldest_exchanges_are_dropped_when_the_context_is_full(model_dir, sk):
    """The tiny model holds 256 positions: messages of about 90 tokens fill it by the third turn,
    which then runs without the first exchange (the system message stays)."""
    from skipdecode.prompts import encode_prompt

    system = {"role": "system", "content": "Be brief."}

    def message(word: str) -> str:  # a user turn of about 80 tokens: two fit with their answers, three do not
        text = word
        while len(encode_prompt(sk.tokenizer, [{"role": "user", "content": text}], chat=True)) < 80:
            text += " " + word
        return text

    msgs = [message("Eagle"), message("Describe"), message("river")]
    assert sk.adapter.max_positions == 256
    res = run_chat(model_dir, "\n".join(msgs) + "\n", "--system", "Be brief.")
    assert res.exit_code == 0, res.output
    assert res.stderr.count("oldest exchange(s) dropped") == 1 and "its 1 oldest" in res.stderr
    first = answer(sk, [system, {"role": "user", "content": msgs[0]}])
    second = answer(sk, [system, {"role": "user", "content": msgs[0]}, {"role": "assistant", "content": first},
                         {"role": "user", "content": msgs[1]}])
    third = answer(sk, [system, {"role": "user", "content": msgs[1]}, {"role": "assistant", "content": second},
                        {"role": "user", "content": msgs[2]}])
    assert res.stdout == f"{first}\n{second}\n{third}\n"
