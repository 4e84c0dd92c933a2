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
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ],
)
def test_bad_values_give_400_naming_the_field(client, body, field):
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400
    assert field in resp.json()["error"]["message"]


def assert_openai_error(resp, status: int, param, *words: str, kind: str = "invalid_request_error",
                        code: str | None = None) -> str:
    """``resp`` is ``status`` with exactly OpenAI's error body (its ``code`` ``code``); its message holds ``words``."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (kind, param, code)
    assert isinstance(err["message"], str)
    for word in words:
        assert word in err["message"]
    return err["message"]


@pytest.mark.parametrize(
    "body, param, words",
    [
        # pydantic constraint: was FastAPI's 422 {"detail": [...]}
        ({"prompt": "x", "max_tokens": -5}, "max_tokens", ["max_tokens: Input should be greater than or equal to 1"]),
        ({"prompt": "x", "temperature": "hot"}, "temperature", ["temperature: ", "valid number"]),
        ({"prompt": "x", "top_p": 2}, "top_p", ["top_p: ", "less than or equal to 1"]),
        # a union: no pydantic member tag ("stop.str") in param or message
        ({"prompt": "x", "stop": 5}, "stop", ["stop: Input should be a valid string or ", "valid list"]),
        ({"max_tokens": 2}, "prompt", ["prompt: Field required"]),
        # the engine's checks: was 400 {"detail": "..."}
        ({"prompt": "x", "speedup": 0.5}, "speedup", ["speedup: ", "greater than or equal to 1", "got 0.5"]),
        ({"prompt": "x", "min_layers": 9, "max_layers": 3}, "min_layers", ["min_layers"]),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens", ["max_tokens", "context"]),
        ({"prompt": "   "}, "prompt", ["prompt must be a non-empty string"]),
        ({"prompt": []}, "prompt", ["prompt"]),
    ],
)
def test_bad_requests_give_openai_error_bodies(client, body, param, words):
    assert_openai_error(client.post("/v1/completions", json=body), 400, param, *words)


def test_chat_schema_errors_name_the_nested_field(client):
    assert_openai_error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages", "messages: ")
    bad_role = {"messages": [{"role": "bot", "content": "hi"}]}
    assert_openai_error(client.post("/v1/chat/completions", json=bad_role), 400, "messages[0].role",
                        "messages[0].role: ", "'user'")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_broken_json_is_400_with_null_param(client, path):
    resp = client.post(path, content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, None, "not valid JSON")
    resp = client.post(path, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, None, "not valid JSON", "UTF-8")  # FastAPI said "There was an error parsing the body"
    resp = client.post(path, json=["not", "an", "object"])
    assert_openai_error(resp, 400, None, "body: ")
    assert "content-type" not in resp.json()["error"]["message"]  # a JSON body of the wrong shape: no hint


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_body_without_a_json_content_type_says_so(client, path):
    """`curl -d '{...}'` without `-H 'content-type: application/json'` sends a form body; the 400
    says what to send instead of only that the body is not an object."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    resp = client.post(path, content=b'{"prompt": "x", "messages": []}', headers=form)
    assert_openai_error(resp, 400, None, "content-type: application/json", "application/x-www-form-urlencoded")


def test_unknown_model_is_404(client):
    resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "gpt-4"})
    assert_openai_error(resp, 404, "model", "gpt-4", "tiny", code="model_not_found")  # OpenAI's code
    msgs = [{"role": "user", "content": "hi"}]
    resp = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "model": "gpt-4"})
    assert_openai_error(resp, 404, "model", "gpt-4", code="model_not_found")
    assert_openai_error(client.get("/v1/models/gpt-4"), 404, "model", "gpt-4", code="model_not_found")
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "model": "tiny"}).status_code == 200


def test_unknown_route_and_method_use_the_error_shape(client):
    """Starlette's bare "Not Found" / "Method Not Allowed" become messages that say what to do."""
    assert_openai_error(client.get("/v1/nope"), 404, None, "/v1/nope is not a route", "/v1/chat/completions")
    resp = client.get("/v1/completions")
    assert_openai_error(resp, 405, None, "GET is not allowed on /v1/completions; it takes POST")
    assert resp.headers["allow"] == "POST"  # the exception's headers survive the handler


@pytest.mark.parametrize("path,body,param,where", [
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 1}', "prompt", "prompt holds"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\udfffb"], "max_tokens": 1, "stream": true}', "prompt[1]",
     "at character 1"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
     "messages", "messages[0].content holds"),
])
def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_it(client, path, body, param, where):
    """JSON's "\\ud800" is no character: the tokenizer failed on it with a TypeError (a 500)."""
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, param, where, "lone surrogate")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_body_is_named_as_empty(client, path):
    resp = client.post(path, content=b"", headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, None, "the request body is empty")
    assert "Field required" not in resp.json()["error"]["message"]


def test_server_fault_is_500_server_error(sk, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("CUDA exploded")

    monkeypatch.setattr("skipdecode.engine.skip_forward", boom)  # the engine thread's step fails
    app = create_app(sk, "tiny")
    client = TestClient(app, raise_server_exceptions=False)
    resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    message = assert_openai_error(resp, 500, None, kind="server_error")
    assert "CUDA exploded" not in message  # no internals in the answer; the server logs them
    monkeypatch.undo()  # the engine recovers: the next request is served
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_one_token_run_has_json_safe_usage(client):
    # no decode step: step_seconds is NaN, which JSON cannot carry (it used to answer 500)
    resp = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    stats = resp.json()["usage"]["skipdecode"]
    assert stats["decode_steps"] == 0 and stats["step_seconds"] is None


def stream_events(client, path: str, body: dict) -> list:
    """The decoded ``data:`` events of a streamed request; the last one must be ``[DONE]``."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": ["The Eagle is", "Describe the restaurant"]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe the restaurant"}]}),
    ],
)
def test_stream_include_usage_sends_one_last_usage_chunk(client, path, body):
    body = {**body, "max_tokens": 6, "speedup": 2, "horizon": 4}
    full = client.post(path, json=body).json()
    events = stream_events(client, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    with_usage = [e for e in events if e["usage"] is not None]
    assert with_usage == [events[-1]]  # exactly one, the last before [DONE]
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    last = events[-1]
    assert last["choices"] == []
    assert last["id"] == events[0]["id"] and last["object"] == events[0]["object"]
    use, want = last["usage"], full["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert use[key] == want[key], key
    assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"] > 0
    stats, want_stats = use["skipdecode"], want["skipdecode"]
    assert set(stats) == set(want_stats)
    for key in ("batch_size", "prompt_tokens", "new_tokens", "decode_steps", "num_layers", "policy",
                "mean_active_layers", "theoretical_speedup"):
        assert stats[key] == want_stats[key], key
    # the text is unchanged by include_usage
    if path == "/v1/completions":
        for row, choice in enumerate(full["choices"]):
            text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == row)
            assert text == choice["text"]
    else:
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == full["choices"][0]["message"]["content"]


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
def test_stream_without_include_usage_has_no_usage(client, options):
    body = {"prompt": "The Eagle is", "max_tokens": 4, "stream": True}
    if options is not None:
        body["stream_options"] = options
    events = stream_events(client, "/v1/completions", body)
    assert events and all("usage" not in e and len(e["choices"]) == 1 for e in events)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
@pytest.mark.parametrize("stream", [None, False])
def test_stream_options_without_stream_is_400(client, path, body, stream):
    body = {**body, "max_tokens": 2, "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    assert_openai_error(client.post(path, json=body), 400, "stream_options", "stream_options", "stream")


def test_stream_request_error_is_400_before_the_stream(client):
    # validated before the stream starts: a plain 400, not an error event after a 200
    body = {"prompt": "x", "max_tokens": 10_000, "stream": True, "stream_options": {"include_usage": True}}
    assert_openai_error(client.post("/v1/completions", json=body), 400, "max_tokens", "max_tokens")


def test_stream_error_event_has_the_error_shape(sk, monkeypatch):
    """A fault after the headers are sent travels as one error event, then [DONE]."""
    client = TestClient(create_app(sk, "tiny"))
    calls = []
    real = __import__("skipdecode.engine", fromlist=["skip_forward"]).skip_forward

    def fail_on_decode(*args, **kwargs):
        calls.append(1)
        if kwargs.get("row_layers") is not None:
            raise RuntimeError("CUDA exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr("skipdecode.engine.skip_forward", fail_on_decode)
    events = stream_events(client, "/v1/completions", {"prompt": "The Eagle", "max_tokens": 5, "stream": True})
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and set(errors[0]["error"]) == {"message", "type", "param", "code"}
    assert errors[0]["error"]["type"] == "server_error" and "CUDA" not in errors[0]["error"]["message"]
