"""Cohort admission (issue 10) reaches users: ``--cohort-size`` on ``skipdecode generate``, ``eval``
and ``serve``, ``cohort_size`` on :func:`skipdecode.server.create_app` and the scheduler.

The engine's rule itself (waiting requests join only in cohorts; answers unchanged) is tested in
tests/test_inflight.py; here each entry point must hand the value to the engine, refuse values
outside [1, batch size] with one line naming the option before any model loads, and (the server,
as a real process on loopback) keep every request's solo answer with cohorts on.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conftest import make_model, make_tokenizer
from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from test_cli_outputs import _run as cli
from test_server_loopback import health, run, start_server, stop_server
from test_validation_leftovers import assert_one_line_exit_2, no_model_load
from skipdecode import SkipModel
from skipdecode.scheduler import Scheduler
from skipdecode.server import create_app


# ------------------------------------------------------------------------- the Python API
def test_scheduler_and_app_hand_the_cohort_size_to_the_engine():
    sk = SkipModel(make_model("llama"), make_tokenizer())
    scheduler = Scheduler(sk.adapter, max_batch_size=8, max_waiting=4, cohort_size=3)
    try:
        assert scheduler.engine.cohort_size == 3 and scheduler.stats()["cohort_size"] == 3
    finally:
        scheduler.close()
    app = create_app(sk, "tiny", max_batch_size=8, cohort_size=5)
    try:
        assert app.state.scheduler.engine.cohort_size == 5
    finally:
        app.state.scheduler.close()
    serial = create_app(sk, "tiny", serial=True, cohort_size=5)  # one row at a time: no cohorts
    try:
        assert serial.state.scheduler.engine.cohort_size == 1
    finally:
        serial.state.scheduler.close()


def test_scheduler_stats_report_the_engines_prefill_and_decode_time():
    """/health's scheduler statistics carry the engine's prefill and decode seconds and decode
    steps (server_load.py reads them to split a cell's time): after 2 requests of 4 tokens each,
    3 decode steps each (token 0 comes from the prefill), run side by side."""
    import threading

    from skipdecode.engine import Request

    sk = SkipModel(make_model("llama"), make_tokenizer())
    scheduler = Scheduler(sk.adapter, max_batch_size=8, max_waiting=4)
    try:
        before = scheduler.stats()
        assert (before["decode_steps"], before["prefill_seconds"], before["decode_seconds"]) == (0, 0.0, 0.0)
        done = threading.Event()
        finished = []

        def sink(ev):
            if not isinstance(ev, BaseException) and ev.finished:
                finished.append(ev)
                if len(finished) == 2:
                    done.set()

        scheduler.submit([Request([5, 6, 7], 4), Request([8, 9], 4)], sink)
        assert done.wait(60)
        after = scheduler.stats()
        assert after["decode_steps"] == scheduler.engine.decode_steps == 3  # both rows joined in one prefill
        assert after["prefill_seconds"] == scheduler.engine.prefill_seconds > 0
        assert after["decode_seconds"] == scheduler.engine.decode_seconds > 0
    finally:
        scheduler.close()


@pytest.mark.parametrize("cohort", [0, 9, True, 2.0])
def test_app_refuses_a_cohort_outside_one_to_the_batch_size(cohort):
    sk = SkipModel(make_model("llama"), make_tokenizer())
    with pytest.raises(ValueError, match=r"cohort_size must be an integer in \[1, max_batch_size=8\]"):
        create_app(sk, "tiny", max_batch_size=8, cohort_size=cohort)


# ------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("command, extra, words", [
    (["generate", "a", "b"], ["--cohort-size", "0"], ["--cohort-size must be in [1, --max-batch-size=32]", "0"]),
    (["generate", "a", "b"], ["--max-batch-size", "4", "--cohort-size", "5"],
     ["--cohort-size must be in [1, --max-batch-size=4]", "5"]),
    (["eval"], ["--batch-size", "4", "--cohort-size", "5"], ["--cohort-size must be in [1, --batch-size=4]"]),
    (["eval"], ["--static", "--cohort-size", "2"], ["--cohort-size applies to in-flight batching"]),
    (["serve", "--port", "1"], ["--cohort-size", "40"], ["--cohort-size must be in [1, --max-batch-size=32]"]),
    (["serve", "--port", "1"], ["--serial", "--cohort-size", "2"], ["--cohort-size applies to in-flight batching"]),
])
def test_cli_refuses_a_bad_cohort_size_before_any_work(saved, tmp_path, monkeypatch, command, extra, words):  # noqa: F811
    no_model_load(monkeypatch)
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "references": ["world"]}) + "\n")
    where = ["--data", str(data), "--out", str(tmp_path / "o")] if command == ["eval"] else []
    assert_one_line_exit_2(*cli([*command, "--model", str(saved), *where, *extra]), *words)


def test_cli_generate_cohort_size_reaches_the_engine_and_keeps_the_answers(saved, monkeypatch):  # noqa: F811
    import skipdecode.engine as engine_module

    seen = []
    real_init = engine_module.Engine.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("cohort_size", 1))
        real_init(self, *args, **kwargs)
    monkeypatch.setattr(engine_module.Engine, "__init__", spy)
    prompts = ["The Eagle", "A coffee shop near", "Green Man", "Five"]
    base = ["generate", *prompts, "--model", str(saved), "-n", "6", "--json", "--speedup", "2", "--max-batch-size", "2"]
    res1, _ = cli(base)
    res3, _ = cli(base + ["--cohort-size", "2"])
    assert res1.exit_code == 0 and res3.exit_code == 0, (res1.output, res3.output)
    assert seen == [1, 2]
    assert json.loads(res3.stdout)["texts"] == json.loads(res1.stdout)["texts"]  # greedy: unchanged


def eval_kwargs(model_dir, tmp_path, monkeypatch, *options: str) -> dict:
    """The keyword arguments that ``skipdecode eval --model MODEL_DIR OPTIONS`` passes to
    :func:`skipdecode.evaluate.evaluate` (stubbed: nothing is generated), on a one-item data file."""
    import skipdecode.evaluate as evaluate_module

    seen = {}

    def fake_evaluate(*args, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")
    monkeypatch.setattr(evaluate_module, "evaluate", fake_evaluate)
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "references": ["world"]}) + "\n")
    cli(["eval", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o"), *options])
    return seen


def test_cli_eval_cohort_size_reaches_evaluate(saved, tmp_path, monkeypatch):  # noqa: F811
    seen = eval_kwargs(saved, tmp_path, monkeypatch, "--batch-size", "8", "--cohort-size", "4")
    assert seen["cohort_size"] == 4 and seen["inflight"] is True


# ---------------------------------------------------------- the server, a real process
def test_server_with_cohorts_gives_every_concurrent_request_its_solo_answer():
    proc, url = start_server("--max-batch-size", "4", "--cohort-size", "3", "--step-delay", "0.01")
    try:
        assert health(url)["scheduler"]["cohort_size"] == 3
        sk = SkipModel(make_model("llama"), make_tokenizer())  # the server's model, built the same way
        prompts = [f"The Eagle {i} is a" for i in range(10)]
        lengths = [3 + (i * 5) % 11 for i in range(10)]  # rows end at different steps: slots free unevenly

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await asyncio.gather(*(
                    c.post("/v1/completions", json={"prompt": p, "max_tokens": n, "speedup": 2.0})
                    for p, n in zip(prompts, lengths)))

        answers = run(scenario(), 90)
        assert [a.status_code for a in answers] == [200] * 10
        for p, n, a in zip(prompts, lengths, answers):
            want = sk.generate([p], max_new_tokens=n, policy=sk.policy_for(speedup=2.0))
            assert [c["text"] for c in a.json()["choices"]] == want.texts
        assert health(url)["scheduler"]["running"] == 0
    finally:
        stop_server(proc)


def test_server_load_benchmark_passes_the_cohort_size_and_checks_it(capsys):
    from conftest import load_benchmark

    server_load = load_benchmark("server_load")
    args = server_load._parse(["--max-batch-size", "8", "--cohort-size", "4"])
    assert args.cohort_size == 4
    with pytest.raises(SystemExit) as exc:
        server_load._parse(["--max-batch-size", "8", "--cohort-size", "9"])
    assert exc.value.code == 2 and "--cohort-size must be in [1, --max-batch-size=8]" in capsys.readouterr().err


def test_server_load_client_counts_tokens_of_text_and_chat_completions():
    """The benchmark's client (the official ``openai`` client, streaming) against a real server:
    every request is counted once, its tokens come from the server's ``usage``, and ``--chat``
    goes through /v1/chat/completions (the adapter's format)."""
    from conftest import load_benchmark

    server_load = load_benchmark("server_load")
    assert server_load._parse(["--chat", "--adapter"]).chat is True
    proc, url = start_server("--max-batch-size", "4")
    try:
        before = health(url)["scheduler"]
        rows = {chat: asyncio.run(server_load.load(url, ["The Eagle is a", "Blue Spice serves"], 2, 2.0, 3, chat,
                                                    served_model="tiny", server_pid=proc.pid))
                for chat in (False, True)}
        for chat, row in rows.items():
            assert row["requests"] == 8 and 0 < row["completion_tokens"] <= 8 * 3
            assert row["tokens_per_request"] == row["completion_tokens"] / 8
            assert 0 < row["ttft_p50"] <= row["latency_p50"]
            # the server's own statistics, averaged over the cell's requests
            assert row["step_ms"] > 0 and 0 < row["prefill_s"] < row["latency_p50"] and row["batch_rows"] >= 1
            assert row["theoretical_speedup"] >= 1
            # CPU of the timed part: the client's, the server's, and its event-loop (main) thread's
            # (/proc counts in 10 ms ticks: a tiny server's share may round to 0)
            assert 0 < row["client_cpu_s"] and 0 <= row["server_loop_cpu_s"] <= row["server_cpu_s"]
        served = health(url)["scheduler"]["generated_tokens"] - before["generated_tokens"]
        warm_up = served - sum(row["completion_tokens"] for row in rows.values())
        # per cell one untimed warm-up round of 2 clients x at most 3 tokens, nothing else
        assert 2 * 2 <= warm_up <= 2 * 2 * 3
    finally:
        stop_server(proc)


def test_server_load_ignore_eos_gives_every_request_max_tokens():
    """--ignore-eos reaches the server: on the chain model (its answer is shorter than max_tokens
    and ends at EOS) every request then writes exactly max_tokens tokens; without it, the answer
    and its EOS."""
    from serve_tiny import CHAIN_PROMPT, CHAIN_TEXT
    from conftest import load_benchmark

    server_load = load_benchmark("server_load")
    assert server_load._parse(["--ignore-eos"]).ignore_eos is True
    assert server_load._parse([]).ignore_eos is False
    answer = len(make_tokenizer()(CHAIN_TEXT)["input_ids"]) + 1  # its EOS included
    max_tokens = answer + 5
    proc, url = start_server("--chain")
    try:
        rows = {flag: asyncio.run(server_load.load(url, [CHAIN_PROMPT], 2, 1.0, max_tokens, served_model="tiny",
                                                   ignore_eos=flag))
                for flag in (False, True)}
    finally:
        stop_server(proc)
    assert rows[False]["tokens_per_request"] == answer
    assert rows[True]["tokens_per_request"] == max_tokens
    assert rows[True]["completion_tokens"] == 8 * max_tokens


def test_server_load_passes_the_server_threads_and_checks_them(monkeypatch, capsys):
    """--threads reaches `skipdecode serve --threads`; 0 is refused by the benchmark's parser;
    --align-steps always reaches an in-flight server (0 included), never a serial one; --quantize
    and --compile reach the server only when given, and an unknown format is refused."""
    from conftest import load_benchmark, record_server_commands

    server_load = load_benchmark("server_load")
    seen = record_server_commands(monkeypatch, server_load)
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse(["--threads", "1"]), serial=False)
    cmd = seen["cmd"]
    assert cmd[cmd.index("--threads") + 1] == "1"
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse([]), serial=False)
    assert "--threads" not in seen["cmd"]
    # the in-flight server always gets --align-steps: 0 must reach it (serve's own default is 8)
    assert seen["cmd"][seen["cmd"].index("--align-steps") + 1] == "0"
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse(["--align-steps", "8", "--modes", "inflight"]), serial=False)
    assert seen["cmd"][seen["cmd"].index("--align-steps") + 1] == "8"
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse([]), serial=True)
    assert "--serial" in seen["cmd"] and "--align-steps" not in seen["cmd"]
    assert "--quantize" not in seen["cmd"] and "--compile" not in seen["cmd"]  # float32, eager by default
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse(["--quantize", "w8a8", "--compile"]), serial=False)
    assert seen["cmd"][seen["cmd"].index("--quantize") + 1] == "w8a8" and "--compile" in seen["cmd"]
    for bad in ("0", "1,0.5", "nan"):  # refused before any server starts
        with pytest.raises(SystemExit) as exc:
            server_load._parse(["--speedups", bad])
        assert exc.value.code == 2 and "--speedups must be finite numbers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        server_load._parse(["--quantize", "int3"])
    assert exc.value.code == 2 and "--quantize" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        server_load._parse(["--threads", "0"])
    assert exc.value.code == 2 and "--threads must be >= 1, got 0" in capsys.readouterr().err


def test_server_load_pairs_report_the_amdahl_ceiling_of_a_full_depth_prefill():
    from conftest import load_benchmark

    server_load = load_benchmark("server_load")

    def row(speedup, rps, lat, ttft, step_ms, theo):
        return {"mode": "inflight", "clients": 16, "speedup": speedup, "requests_per_second": rps,
                "latency_p50": lat, "ttft_p50": ttft, "step_ms": step_ms, "theoretical_speedup": theo,
                "tokens_per_second": 32 * rps, "tokens_per_request": 32.0, "completion_tokens": 256, "requests": 8, "latency_p95": lat, "ttft_p95": ttft}

    rows = [row(1.0, 1.0, 12.0, 4.0, 250.0, 1.0), row(2.0, 1.2, 10.0, 4.0, 200.0, 2.0),
            {**row(2.0, 9.0, 1.0, 0.1, 1.0, 2.0), "mode": "serial"}]  # other modes are not paired
    (pair,) = server_load.pairs(rows)
    assert pair["clients"] == 16 and pair["requests_per_second_ratio"] == pytest.approx(1.2)
    assert pair["step_speedup"] == pytest.approx(1.25)
    # 12 s = 4 s prefill + 8 s decode; decode at 2x: 4 + 4 = 8 s -> 12 / 8
    assert pair["ceiling_at_theoretical_steps"] == pytest.approx(1.5)
    assert server_load.pairs(rows[1:]) == []  # no full-depth cell: nothing to pair
    assert "| 250 | 1.00x |" in server_load.table(rows[:1])


def test_server_load_cpu_use_takes_differences_per_thread_and_the_main_thread_as_the_loop():
    import os
    import time

    from conftest import load_benchmark

    server_load = load_benchmark("server_load")
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:  # 100 ms of CPU on this (main) thread
        pass
    mine = server_load._thread_seconds(os.getpid())
    assert os.getpid() in mine and mine[os.getpid()] >= 0.05  # /proc/<pid>/task/<tid>/stat, read right
    assert server_load._thread_seconds(2 ** 22 + 12345) == {}  # no such process
    before = (1.0, {100: 2.0, 101: 5.0})
    after = (1.5, {100: 2.25, 101: 7.0, 102: 1.0})  # thread 102 started in between
    use = server_load.cpu_use(before, after, 100)
    assert use == {"client_cpu_s": 0.5, "server_cpu_s": 3.25, "server_loop_cpu_s": 0.25}
    assert server_load.cpu_use((1.0, {}), (2.0, {}), None) == {
        "client_cpu_s": 1.0, "server_cpu_s": None, "server_loop_cpu_s": None}
