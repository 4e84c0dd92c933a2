"""``serve --stream-interval N``: a streamed row's tokens go out in groups of N (first and last at
once), as vLLM's and SGLang's option of that name. The grouping itself (a fake scheduler, real
:class:`~skipdecode.generate.RowText`), an engine failure after held tokens, the option checks
(``create_app``, the CLI, the load benchmark), and a real server process on loopback whose grouped
stream carries the same text and usage as the one-event-per-token stream in fewer events.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from typer.testing import CliRunner

from conftest import load_benchmark, make_model, make_tokenizer, record_server_commands
from skipdecode.engine import Request, Row, TokenEvent
from skipdecode.execution import Submission
from skipdecode.generate import RowText
from skipdecode.model import SkipModel
from skipdecode.sampling import Sampler, SamplingParams
from test_server_loopback import STEP_DELAY, run, start_server, stop_server


class FakeScheduler:
    """Takes the sink; :class:`Submission` needs nothing else here."""

    def submit(self, requests, sink):
        self.sink = sink

    def cancel(self, requests):
        pass


def tokens_and_texts(tok, count: int) -> tuple[list[int], list[str]]:
    """``count`` token ids that each decode to a non-empty piece of text, and those pieces."""
    ids = tok("the cat sat on a mat and then ran off far away", add_special_tokens=False)["input_ids"]
    ids = [i for i in ids if tok.decode([i])][:count]
    assert len(ids) == count
    return ids, [tok.decode([i]) for i in ids]


async def _groups(interval: int, tokens: int, rows: int = 1):
    """Feed ``tokens`` events per row (interleaved, as engine steps are) through a Submission
    with ``interval``; returns the queue's groups (as (row, step) lists) and what next() read."""
    tok = make_tokenizer()
    ids, pieces = tokens_and_texts(tok, tokens)
    texts = [RowText(tok, [tok.eos_token_id], ends_at_eos=False) for _ in range(rows)]
    reqs = [Request([1, 2], tokens, None, tag=r) for r in range(rows)]
    sub = Submission(FakeScheduler(), reqs, texts, job=None, stream_interval=interval)
    sub.start()
    groups = []
    put = sub.queue.put_nowait

    def spy(group):  # what the engine thread sends, group by group
        groups.append([(ev.row.request.tag, ev.step) for ev in group])
        put(group)

    sub.queue.put_nowait = spy
    row_objs = [Row(reqs[r], r, 2, Sampler(SamplingParams())) for r in range(rows)]
    for step in range(tokens):
        for r in range(rows):
            sub._sink(TokenEvent(row_objs[r], step, ids[step], 6, step == tokens - 1))
    read = []
    while not sub.finished:
        read.append(await sub.next(timeout=1))
    return groups, read, pieces


def test_tokens_go_in_groups_of_the_interval_with_the_first_and_last_at_once():
    groups, read, pieces = asyncio.run(_groups(interval=4, tokens=10))
    steps = [[s for _, s in g] for g in groups]
    assert steps == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert [len(r) for r in read] == [1, 1, 1, 1]  # one entry per row and group
    assert [r[0][1] for r in read] == ["".join(pieces[:1]), "".join(pieces[1:5]), "".join(pieces[5:9]), pieces[9]]
    assert [r[0][2] for r in read] == [False, False, False, True]


def test_interval_one_sends_every_token_at_once():
    groups, read, pieces = asyncio.run(_groups(interval=1, tokens=5))
    assert [[s for _, s in g] for g in groups] == [[0], [1], [2], [3], [4]]
    assert [r[0][1] for r in read] == pieces


def test_each_row_of_a_request_gets_its_own_groups_and_its_own_text():
    """Two rows stepping together: each gets groups of 1, 3, 3 for 7 tokens at interval 3 (a
    row's group never carries, or is cut by, the other row's tokens); each row's text is whole."""
    groups, read, pieces = asyncio.run(_groups(interval=3, tokens=7, rows=2))
    assert groups[0] == [(0, 0)] and groups[1] == [(1, 0)]  # first tokens: at once, per row
    for row in (0, 1):
        mine = [g for g in groups if g[0][0] == row]
        assert all(r == row for g in mine for r, _ in g)
        assert [[s for _, s in g] for g in mine] == [[0], [1, 2, 3], [4, 5, 6]]
    for row in (0, 1):
        text = "".join(delta for group in read for i, delta, _, _ in group if i == row)
        assert text == "".join(pieces)
        assert [fin for group in read for i, _, fin, _ in group if i == row][-1] is True


def test_held_tokens_are_read_before_an_engine_failure():
    async def scenario():
        tok = make_tokenizer()
        ids, pieces = tokens_and_texts(tok, 3)
        req = Request([1, 2], 8, None, tag=0)
        sub = Submission(FakeScheduler(), [req], [RowText(tok, [tok.eos_token_id])], job=None, stream_interval=8)
        sub.start()
        row = Row(req, 0, 2, Sampler(SamplingParams()))
        for step in range(3):
            sub._sink(TokenEvent(row, step, ids[step], 6, False))
        sub._sink(RuntimeError("engine step failed"))
        first = await sub.next(timeout=1)
        second = await sub.next(timeout=1)
        with pytest.raises(RuntimeError, match="engine step failed"):
            await sub.next(timeout=1)
        return first, second, pieces, sub.finished

    first, second, pieces, finished = asyncio.run(scenario())
    assert first == [(0, pieces[0], False, [])]
    assert second == [(0, pieces[1] + pieces[2], False, [])]  # held tokens 1-2 arrive with the failure
    assert finished  # the request is over: the scheduler dropped its rows


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_create_app_refuses_a_bad_stream_interval(bad):
    from skipdecode.server import create_app

    with pytest.raises(ValueError, match="stream_interval must be an integer >= 1"):
        create_app(SkipModel(make_model("llama"), make_tokenizer()), stream_interval=bad)


def test_serve_refuses_stream_interval_zero_before_loading(tmp_path):
    from skipdecode.cli import app

    res = CliRunner().invoke(app, ["serve", "--stream-interval", "0", "--model", str(tmp_path / "no_such_model")],
                             env={"COLUMNS": "200"})
    message = "".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "--stream-intervalmustbe>=1" in message and "no_such_model" not in message, res.output


def test_server_load_passes_the_stream_interval_and_checks_it(monkeypatch, capsys):
    server_load = load_benchmark("server_load")
    seen = record_server_commands(monkeypatch, server_load)
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse(["--stream-interval", "8"]), serial=False)
    assert seen["cmd"][seen["cmd"].index("--stream-interval") + 1] == "8"
    with pytest.raises(SystemExit, match="status 3"):
        server_load.start_server(server_load._parse([]), serial=False)
    assert "--stream-interval" not in seen["cmd"]  # serve's default, 1
    with pytest.raises(SystemExit) as exc:
        server_load._parse(["--stream-interval", "0"])
    assert exc.value.code == 2 and "--stream-interval must be >= 1, got 0" in capsys.readouterr().err


async def _stream(url: str, max_tokens: int, prompt) -> tuple[dict[int, list[str]], dict]:
    """Per choice index, the content pieces (one per SSE event with text), and the usage, of one
    streamed completion of ``prompt`` (a string or a list: one row each)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    pieces: dict[int, list[str]] = {}
    usage = None
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    if choice["text"]:
                        pieces.setdefault(choice["index"], []).append(choice["text"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return pieces, usage


def test_a_grouped_stream_carries_the_same_text_in_fewer_events():
    """A real server with --stream-interval 4 against one with the default, same tiny model, one
    prompt and then two in one request: each row's text and the token counts equal; at most
    1 + ceil(11 / 4) content events per row for 12 tokens, and fewer than the default sends."""
    grouped, url = start_server("--step-delay", str(STEP_DELAY), "--stream-interval", "4")
    plain, plain_url = start_server("--step-delay", str(STEP_DELAY))
    try:
        for prompt in ("hello there", ["hello there", "the cat sat"]):
            g_pieces, g_usage = run(_stream(url, 12, prompt), timeout=60)
            p_pieces, p_usage = run(_stream(plain_url, 12, prompt), timeout=60)
            rows = 1 if isinstance(prompt, str) else len(prompt)
            assert sorted(g_pieces) == sorted(p_pieces) == list(range(rows))
            for i in range(rows):
                assert "".join(g_pieces[i]) == "".join(p_pieces[i]) and "".join(p_pieces[i])
                assert len(g_pieces[i]) <= 4 < len(p_pieces[i]), (i, g_pieces[i])
            assert g_usage["completion_tokens"] == p_usage["completion_tokens"] == 12 * rows
    finally:
        stop_server(grouped)
        stop_server(plain)
