"""OpenAI-compatible server on a tiny model (FastAPI TestClient; no network)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from conftest import make_model, make_tokenizer
from skipdecode.model import SkipModel
from skipdecode.policy import LinearDecayPolicy
from skipdecode.server import create_app


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


@pytest.fixture(scope="module")
def client(sk):
    return TestClient(create_app(sk, "tiny"))


def test_models_lists_the_served_name(client):
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_completion_equals_library_generate(client, sk):
    body = {"prompt": ["The Eagle is", "Describe the restaurant"], "max_tokens": 6, "speedup": 2, "horizon": 4}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    expected = sk.generate(["The Eagle is", "Describe the restaurant"], max_new_tokens=6,
                           policy=sk.policy_for(speedup=2, horizon=4))
    assert [c["text"] for c in data["choices"]] == expected.texts
    stats = data["usage"]["skipdecode"]
    assert stats["policy"] == sk.policy_for(speedup=2, horizon=4).to_dict()
    assert stats["theoretical_speedup"] == pytest.approx(expected.theoretical_speedup)
    assert data["usage"]["completion_tokens"] == sum(expected.new_tokens)


def test_explicit_policy_fields(client, sk):
    resp = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 4, "max_layers": 5, "min_layers": 3,
                                                "warmup_layers": 1, "horizon": 2})
    assert resp.status_code == 200
    want = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=3, warmup_layers=1, horizon=2).to_dict()
    assert resp.json()["usage"]["skipdecode"]["policy"] == want


def test_chat_stream_concatenates_to_non_stream(client):
    msgs = [{"role": "user", "content": "Describe the restaurant"}]
    full = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8}).json()
    text = full["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    choices = [json.loads(ln[6:])["choices"][0] for ln in lines[:-1]]
    assert choices[0]["delta"] == {"role": "assistant"}  # OpenAI: the role comes first
    assert "".join(c["delta"].get("content", "") for c in choices) == text
    assert [c["finish_reason"] for c in choices][-1] == full["choices"][0]["finish_reason"]
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)


def test_completion_stream_ends_each_row_with_its_finish_reason(client, sk):
    prompts = ["The Eagle is", "Describe the restaurant"]
    body = {"prompt": prompts, "max_tokens": 5, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    expected = sk.generate(prompts, max_new_tokens=5)
    for row in range(2):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == row]
        assert "".join(c["text"] for c in mine) == expected.texts[row]
        want = "length" if expected.finish_reasons[row] == "length" else "stop"
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [want]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "speedup": 0.5}, "speedup"),
        ({"prompt": "x", "min_layers": 9, "max_layers": 3}, "min_layers"),
        ({"prompt": "   "}, "prompts[0]"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_new_tokens"),
    ],
)
def test_bad_values_give_400_naming_the_field(client, body, field):
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400
    assert field in resp.json()["detail"]


def test_schema_errors_give_422(client):
    assert client.post("/v1/completions", json={"prompt": "x", "top_p": 2}).status_code == 422
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
