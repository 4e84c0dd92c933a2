"""``skipdecode serve --api-key`` (``create_app(api_key=)``, server._ApiKey): the /v1/ routes need
``Authorization: Bearer <key>``; /health and /metrics stay open. In process, and as a real
``skipdecode serve`` process on loopback driven by the official ``openai`` client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import make_model, make_tokenizer
from skipdecode.cli import app as cli_app
from skipdecode.model import SkipModel
from skipdecode.server import create_app
from test_protocol import serve_cli

KEY = "sk-test-0123"
BODY = {"prompt": "The Eagle is", "max_tokens": 3}


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


@pytest.fixture(scope="module")
def client(sk):
    return TestClient(create_app(sk, "tiny", api_key=KEY))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_401(resp, *words: str) -> None:
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["param"] is None
    for w in words:
        assert w in error["message"], error["message"]


def test_v1_routes_need_the_key(client, sk):
    assert_401(client.post("/v1/completions", json=BODY), "no API key was given", "Authorization: Bearer")
    assert_401(client.post("/v1/completions", json=BODY, headers=bearer("sk-wrong")), "not this server's")
    assert_401(client.post("/v1/completions", json=BODY, headers={"Authorization": KEY}), "Bearer scheme")
    assert_401(client.get("/v1/models"))
    msgs = [{"role": "user", "content": "hi"}]
    assert_401(client.post("/v1/chat/completions", json={"messages": msgs}, headers=bearer(KEY + "x")))
    ok = client.post("/v1/completions", json=BODY, headers=bearer(KEY))
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == sk.generate(["The Eagle is"], max_new_tokens=3).texts[0]
    assert client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # case-blind scheme


def test_a_refused_request_is_not_read_and_probes_stay_open(client):
    """No key: 401 even for a body over the size limit or broken JSON (the key is checked first);
    /health and /metrics answer without a key and count the refusals."""
    assert_401(client.post("/v1/completions", content=b"{broken", headers={"content-type": "application/json"}))
    assert_401(client.post("/v1/completions", json={"prompt": "x " * 600_000}))
    assert client.get("/health").status_code == 200
    metrics = client.get("/metrics").text
    line = 'skipdecode_requests_rejected_total{endpoint="completions",reason="unauthorized"}'
    assert any(row.startswith(line) and float(row.split()[-1]) >= 2 for row in metrics.splitlines()), metrics


def test_without_a_key_nothing_is_asked(sk):
    assert TestClient(create_app(sk, "tiny")).post("/v1/completions", json=BODY).status_code == 200


@pytest.mark.parametrize("bad, words", [("", "non-empty"), ("   ", "non-empty"), (5, "non-empty"),
                                        ("a b", "printable ASCII"), ("cl\u00e9", "printable ASCII")])
def test_create_app_refuses_a_key_no_client_can_send(sk, bad, words):
    with pytest.raises(ValueError, match=f"api_key must be .*{words}"):
        create_app(sk, "tiny", api_key=bad)


def test_a_key_read_with_a_newline_is_the_key_without_it(sk):
    """A key from a secret file ends in a newline that no client sends back: it is stripped."""
    client = TestClient(create_app(sk, "tiny", api_key=f"  {KEY}\n"))
    assert client.post("/v1/completions", json=BODY, headers=bearer(KEY)).status_code == 200
    assert_401(client.post("/v1/completions", json=BODY, headers=bearer(KEY[:-1])))


@pytest.mark.parametrize("args, env, words", [
    (["--api-key", " "], {}, "--api-key (or SKIPDECODE_API_KEY) must be a non-empty string"),
    (["--api-key", "a b"], {}, "must be printable ASCII without spaces"),
    ([], {"SKIPDECODE_API_KEY": ""}, "SKIPDECODE_API_KEY is set but empty"),
])
def test_cli_refuses_a_bad_key_before_loading(tmp_path, args, env, words):
    """An empty SKIPDECODE_API_KEY (a missing secret) would otherwise serve without any key."""
    res = CliRunner().invoke(cli_app, ["serve", *args, "--model", str(tmp_path / "missing")],
                             env={"COLUMNS": "200", **env})
    assert res.exit_code == 2 and words in res.output and "missing" not in res.output, res.output


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, sk):
    """``skipdecode serve`` as a process on loopback, its key from SKIPDECODE_API_KEY (/health,
    which the start-up waits on, answers without it)."""
    path = tmp_path_factory.mktemp("keyed") / "tiny"
    sk.save_pretrained(path)
    with serve_cli(path, SKIPDECODE_API_KEY=KEY) as base:
        yield base


def test_real_server_with_the_openai_client_and_concurrent_bad_keys(keyed_server, sk):
    """16 concurrent requests, half with the key (their solo answers), half with a wrong one
    (401, ``openai.AuthenticationError``), within a bounded time."""
    openai = pytest.importorskip("openai")
    good = openai.AsyncOpenAI(base_url=keyed_server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    wrong = openai.AsyncOpenAI(base_url=keyed_server + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    prompts = [f"The Eagle {i} is a" for i in range(8)]

    async def scenario():
        async def bad(i):
            try:
                await wrong.completions.create(model="tiny", prompt=prompts[i], max_tokens=5)
            except openai.AuthenticationError as e:
                return e.status_code
            return 200

        tasks = [good.completions.create(model="tiny", prompt=p, max_tokens=5) for p in prompts]
        return await asyncio.gather(*tasks, *(bad(i) for i in range(8)))

    results = asyncio.run(asyncio.wait_for(scenario(), 120))
    for p, resp in zip(prompts, results[:8]):
        assert resp.choices[0].text == sk.generate([p], max_new_tokens=5).texts[0]
    assert results[8:] == [401] * 8
    assert httpx.get(keyed_server + "/v1/models", timeout=10).status_code == 401  # no key at all


@pytest.mark.parametrize("name", ["", "   "])
def test_an_empty_served_model_name_is_refused(sk, name):
    """``serve --name ''`` started a server no request could name (404 for every model);
    both entry points refuse it, naming the option."""
    with pytest.raises(ValueError, match="model_name must be a non-empty string"):
        create_app(sk, name)
    res = CliRunner().invoke(cli_app, ["serve", "--name", name, "--model", "no_such_model_dir"], env={"COLUMNS": "200"})
    message = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "--name must be a non-empty model name" in message and "no_such_model_dir" not in message, res.output
