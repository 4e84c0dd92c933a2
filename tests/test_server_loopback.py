"""The server as a real process on loopback (uvicorn in a subprocess), every test bounded in time.

Issue 10's faults, each of which this file reproduced on the one-at-a-time server (a lock around
the engine): a stream plus 40 concurrent requests wedged the server for good; a client closing a
stream kept the lock forever; abandoned requests were still computed; a 10 MB prompt was tokenized
before its error. And the in-flight guarantees: 32 concurrent requests with mixed speedups each get
their solo greedy answer exactly once; a disconnect frees the slot; a full queue answers 429.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import make_model, make_tokenizer
from skipdecode.model import SkipModel

HERE = Path(__file__).resolve().parent
STEP_DELAY = 0.02  # seconds per engine step: the tiny model paced like a real one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, stderr=None):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent / "src"), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, str(HERE / "serve_tiny.py"), str(port), *args], env=env,
                            start_new_session=True, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the test server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError("the test server did not start within 120 s")


def stop_server(proc) -> None:
    """SIGTERM, then SIGKILL (the old server ignored SIGTERM once wedged)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server("--step-delay", str(STEP_DELAY))
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def serial_server():
    """One row at a time (the comparison design), a waiting queue of one."""
    proc, url = start_server("--serial", "--max-waiting", "1", "--step-delay", str(STEP_DELAY))
    yield url
    stop_server(proc)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=5).json()


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def run(coro, timeout: float):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_stream_plus_40_concurrent_requests_all_complete(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            body = {"prompt": "The Eagle", "max_tokens": 150, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ")
                posts = [c.post("/v1/completions", json={"prompt": f"Describe {i}", "max_tokens": 4})
                         for i in range(40)]
                answers = await asyncio.gather(*posts)
                rest = [ln async for ln in lines]
            return answers, rest

    answers, rest = run(scenario(), 60)
    assert [a.status_code for a in answers] == [200] * 40
    assert "data: [DONE]" in rest
    assert health(server)["status"] == "ok"


def test_client_closing_a_stream_after_3_events_frees_the_engine(server):
    before = health(server).get("scheduler", {})

    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=30) as c:
            body = {"prompt": "The Eagle", "max_tokens": 200, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                got = 0
                async for line in r.aiter_lines():
                    got += line.startswith("data: ")
                    if got == 3:
                        break  # closes the connection
        async with httpx.AsyncClient(base_url=server, timeout=10) as c:
            return await c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})

    assert run(scenario(), 30).status_code == 200  # the next request is served (it used to hang)
    assert wait_until(lambda: health(server)["scheduler"]["running"] == 0, 5)
    after = health(server)["scheduler"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 100  # not the 200 asked for


def test_abandoned_requests_stop_consuming_steps(server):
    before = health(server).get("scheduler", {})

    async def abandon():
        async with httpx.AsyncClient(base_url=server, timeout=0.5) as c:
            async def give_up(i):
                with pytest.raises(httpx.ReadTimeout):
                    await c.post("/v1/completions", json={"prompt": f"The Eagle {i}", "max_tokens": 200})
            await asyncio.gather(*(give_up(i) for i in range(6)))

    run(abandon(), 20)
    time.sleep(1)  # time to notice the six disconnects
    t0 = time.monotonic()
    assert httpx.post(server + "/v1/completions", json={"prompt": "The", "max_tokens": 1}, timeout=30).status_code == 200
    assert time.monotonic() - t0 < 3  # not queued behind 6 x 200 abandoned steps
    assert wait_until(lambda: health(server)["scheduler"]["running"] == 0, 5)
    after = health(server)["scheduler"]
    assert after["cancelled"] - before["cancelled"] == 6
    assert after["generated_tokens"] - before["generated_tokens"] < 6 * 100


def test_huge_prompt_is_refused_before_it_is_read(server):
    t0 = time.monotonic()
    resp = httpx.post(server + "/v1/completions", json={"prompt": "x " * 5_000_000, "max_tokens": 1}, timeout=30)
    assert resp.status_code == 413, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "accepts at most 1000000 bytes" in err["message"]
    assert time.monotonic() - t0 < 10


def test_a_chunked_body_over_the_limit_is_refused_as_it_arrives(server):
    """Without a Content-Length (``Transfer-Encoding: chunked``) the limit counts the body as it
    comes: 15 MB are refused once the first 1 MB has passed, not read and tokenized (the server
    did that for 12 s, delaying every other request); a chunked body within it is served."""
    def upload(pieces):
        def body():
            yield from pieces
        return httpx.post(server + "/v1/completions", content=body(), timeout=30,
                          headers={"content-type": "application/json"})

    t0 = time.monotonic()
    resp = upload([b'{"prompt": "'] + [b"x " * 25_000] * 300 + [b'", "max_tokens": 1}'])
    assert resp.request.headers["transfer-encoding"] == "chunked" and "content-length" not in resp.request.headers
    assert resp.status_code == 413, resp.text
    assert "over 1000000 bytes" in resp.json()["error"]["message"] and time.monotonic() - t0 < 10
    small = upload([b'{"prompt": "The Eagle", ', b'"max_tokens": 2, "temperature": 0}'])
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    plain = httpx.post(server + "/v1/completions", json={"prompt": "The Eagle", "max_tokens": 2}, timeout=30)
    assert small.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_32_concurrent_requests_with_mixed_speedups_get_their_solo_answers(server):
    sk = SkipModel(make_model("llama"), make_tokenizer())  # the server's model, built the same way
    speedups = [1.0, 1.5, 2.0, 3.0]
    prompts = [f"The Eagle {i} is a" for i in range(32)]

    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            posts = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 10, "speedup": speedups[i % 4]})
                     for i, p in enumerate(prompts)]
            return await asyncio.gather(*posts)

    answers = run(scenario(), 90)
    assert [a.status_code for a in answers] == [200] * 32
    for i, (p, a) in enumerate(zip(prompts, answers)):
        body = a.json()
        want = sk.generate([p], max_new_tokens=10, policy=sk.policy_for(speedup=speedups[i % 4]))
        assert [c["text"] for c in body["choices"]] == want.texts
        stats = body["usage"]["skipdecode"]
        assert stats["theoretical_speedup"] == pytest.approx(want.theoretical_speedup)
        assert body["usage"]["completion_tokens"] == want.new_tokens[0]
    assert len({a.json()["id"] for a in answers}) == 32


def test_concurrent_streams_with_logprobs_match_their_solo_requests(server):
    """12 streamed requests with log-probabilities (mixed speedups) among 12 without, all at once:
    each gets one entry per token, the same tokens and (1e-4) values as the same request alone,
    and a request without them gets none (a row's log-probabilities do not depend on its
    neighbours in the batch)."""
    import json

    speedups = [1.0, 2.0, 3.0]

    def body(i: int, stream: bool) -> dict:
        return {"prompt": f"The Eagle {i} is a", "max_tokens": 8, "ignore_eos": True, "stream": stream,
                "speedup": speedups[i % 3], **({"logprobs": 2} if i % 2 == 0 else {})}

    async def streamed(c, i):
        entries, chunks = [], 0
        async with c.stream("POST", "/v1/completions", json=body(i, True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = (json.loads(line[6:])["choices"] or [{}])[0]
                    chunks += 1
                    lp = choice.get("logprobs")
                    if lp:
                        entries += list(zip(lp["tokens"], lp["token_logprobs"]))
        return entries, chunks

    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            together = await asyncio.gather(*(streamed(c, i) for i in range(24)))
            alone = [(await c.post("/v1/completions", json=body(i, False))).json() for i in range(0, 24, 2)]
        return together, alone

    together, alone = run(scenario(), 120)
    for i in range(24):
        entries, chunks = together[i]
        assert chunks >= 2  # streamed: text events, then the finish
        if i % 2:
            assert entries == []
            continue
        lp = alone[i // 2]["choices"][0]["logprobs"]
        assert [t for t, _ in entries] == lp["tokens"] and entries  # EOS ids (ignore_eos) and special tokens have no entry
        assert [v for _, v in entries] == pytest.approx(lp["token_logprobs"], abs=1e-4)


def test_concurrent_requests_with_n_choices_get_their_seeded_solo_samples(server):
    """8 concurrent streamed requests with n = 3 sampled choices each: every choice arrives under
    its own index and equals the solo sample with seed ``seed + j``."""
    import json

    sk = SkipModel(make_model("llama"), make_tokenizer())  # the server's model, built the same way

    async def one(c, i):
        body = {"prompt": f"The Eagle {i} is a", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 100 + i,
                "stream": True}
        texts = ["", "", ""]
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for ch in json.loads(line[6:])["choices"]:
                        texts[ch["index"]] += ch["text"]
        return texts

    async def scenario():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    got = run(scenario(), 90)
    for i, texts in enumerate(got):
        want = [sk.generate([f"The Eagle {i} is a"], max_new_tokens=6, temperature=1.0, seed=100 + i + j).texts[0]
                for j in range(3)]
        assert texts == want


def test_a_request_that_fails_in_the_engine_fails_alone():
    """A server whose rows with seed 666 cannot draw a token (tests/serve_tiny.py --fail-seed): that
    request gets a 500 (streamed: an error event) while 6 concurrent requests get their answers,
    and the server keeps serving."""
    proc, url = start_server("--fail-seed", "666", "--step-delay", str(STEP_DELAY))
    sk = SkipModel(make_model("llama"), make_tokenizer())
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                good = [asyncio.create_task(c.post("/v1/completions", json={"prompt": f"The Eagle {i} is a",
                                                                            "max_tokens": 40}))
                        for i in range(6)]
                await asyncio.sleep(0.3)  # the good rows are decoding when the bad ones join and fail
                bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 12, "temperature": 1.0,
                                                      "seed": 666})
                bad_stream = c.post("/v1/completions", json={"prompt": "y", "max_tokens": 12, "temperature": 1.0,
                                                             "seed": 666, "stream": True})
                return await asyncio.gather(bad, bad_stream, *good)

        bad, bad_stream, *good = run(scenario(), 90)
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
        assert bad_stream.status_code == 200 and '"server_error"' in bad_stream.text
        assert bad_stream.text.rstrip().endswith("data: [DONE]")
        for i, resp in enumerate(good):
            want = sk.generate([f"The Eagle {i} is a"], max_new_tokens=40).texts[0]
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want
        assert httpx.post(url + "/v1/completions", json={"prompt": "The", "max_tokens": 2}, timeout=30).status_code == 200
    finally:
        stop_server(proc)


def test_disconnect_mid_stream_frees_the_only_slot(serial_server):
    async def scenario():
        async with httpx.AsyncClient(base_url=serial_server, timeout=30) as c:
            body = {"prompt": "The Eagle", "max_tokens": 200, "stream": True}  # 4 s of steps
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
            t0 = time.monotonic()
            resp = await c.post("/v1/completions", json={"prompt": "The", "max_tokens": 2})
            return resp, time.monotonic() - t0

    resp, seconds = run(scenario(), 30)
    assert resp.status_code == 200
    assert seconds < 2  # served at once, not after the abandoned stream's 200 steps


def test_full_queue_answers_429_in_openai_shape(serial_server):
    async def scenario():
        async with httpx.AsyncClient(base_url=serial_server, timeout=30) as c:
            body = {"prompt": "The Eagle", "max_tokens": 200, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()  # kept open: the stream holds the only slot
                while not (await anext(lines)).startswith("data: "):
                    pass
                waiting = asyncio.create_task(c.post("/v1/completions", json={"prompt": "A", "max_tokens": 200}))
                assert await asyncio.to_thread(
                    wait_until, lambda: health(serial_server)["scheduler"]["waiting"] == 1, 5)
                refused = await c.post("/v1/completions", json={"prompt": "B", "max_tokens": 2})
                waiting.cancel()
                return refused

    resp = run(scenario(), 30)
    assert resp.status_code == 429, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "rate_limit_error"
    assert "max_waiting" in err["message"] and resp.headers["retry-after"] == "1"
    assert "1 request waits for 1 running slot (max_waiting 1)" in err["message"]  # not "1 requests wait ... 1 slots"


def test_server_process_runs_on_uvloop_with_the_stack_uvicorn_options_names(server):
    """The real server process runs its event loop on uvloop (a dependency where it installs), as
    :func:`uvicorn_options` asks; a missing install step would leave asyncio's loop."""
    from skipdecode.server import uvicorn_options

    opts = uvicorn_options()
    assert opts == {"loop": "uvloop", "http": "httptools"}
    assert health(server)["event_loop"] == "uvloop"


def test_uvicorn_options_fall_back_to_asyncio_and_h11_without_the_fast_stack(monkeypatch):
    import importlib.util

    from skipdecode.server import uvicorn_options

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvloop", "httptools") else real(name, *a))
    assert uvicorn_options() == {"loop": "asyncio", "http": "h11"}


def _interrupted_while_streaming(max_tokens: int, signals: int) -> tuple[int, str, list[str], float]:
    """Start a server (0.05 s a step), stream ``max_tokens`` tokens from it, send SIGINT
    ``signals`` times 0.5 s apart once the first event arrived; return the server's exit status,
    its stderr, the stream's events and the seconds from the last signal to the exit."""
    proc, url = start_server("--step-delay", "0.05", stderr=subprocess.PIPE)
    events: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"prompt": "The", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        except httpx.HTTPError:
            pass  # cut off by a forced exit

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        assert first.wait(30)
        for i in range(signals):
            if i:
                time.sleep(0.5)
            assert proc.poll() is None  # still draining the stream
            os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        status = proc.wait(timeout=60)
        waited = time.monotonic() - t0
        reader.join(timeout=10)
        return status, proc.stderr.read().decode(), events, waited
    finally:
        stop_server(proc)


def test_ctrl_c_lets_the_streams_in_flight_finish_then_exits_0():
    status, err, events, _ = _interrupted_while_streaming(40, signals=1)
    assert status == 0 and "Traceback" not in err, err
    assert events[-1] == "[DONE]" and '"finish_reason": "length"' in events[-2]  # the whole answer


def test_a_second_ctrl_c_exits_at_once_with_one_line_and_130():
    """uvicorn's forced exit (a second Ctrl-C) skipped the app's shutdown: the cancelled streams
    printed about 120 lines of tracebacks and the process aborted (SIGABRT) with the engine thread
    inside torch. Now it leaves at once with one line."""
    status, err, events, waited = _interrupted_while_streaming(200, signals=2)
    assert status == 130 and waited < 5, (status, err)
    assert "second interrupt" in err and "Traceback" not in err and "CancelledError" not in err, err
    assert events and "[DONE]" not in events  # the 10-second stream was cut off
