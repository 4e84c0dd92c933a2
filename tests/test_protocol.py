"""OpenAI request parsing and validation (skipdecode.protocol) and the one prompt-encoding path.

Schema cases go through FastAPI's TestClient on a tiny model; the encoding path is also checked
on a real ``skipdecode serve`` process on loopback, driven by the official ``openai`` client.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from tokenizers import processors
from typer.testing import CliRunner

from conftest import CHAT_TEMPLATE, make_model, make_tokenizer
from skipdecode.cli import app as cli_app
from skipdecode.generate import encode_prompts
from skipdecode.model import SkipModel
from skipdecode.prompts import encode_prompt
from skipdecode.protocol import (
    APIError,
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    StreamOptions,
    validate_request,
)
from skipdecode.sampling import SamplingParams
from skipdecode.server import create_app

BOS = 1
MSGS = [{"role": "user", "content": "Describe the restaurant"}]


def make_bos_tokenizer():
    """The tiny tokenizer, made to add BOS (``<s> $A``) and given a chat template that starts
    with ``{{ bos_token }}``: the pair that gave the server a double BOS (issue 13 item 2)."""
    tok = make_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


@pytest.fixture(scope="module")
def client(sk):
    return TestClient(create_app(sk, "tiny"))


@pytest.fixture(scope="module")
def bos_sk():
    return SkipModel(make_model("llama", seed=3), make_bos_tokenizer())


def post(client, path: str, body: dict):
    return client.post(path, json=body)


def assert_400(resp, param: str, *words: str) -> str:
    """``resp`` is OpenAI's 400 invalid_request_error naming ``param``; its message holds ``words``."""
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, None), err
    for word in (param, *words):
        assert word in err["message"], err["message"]
    return err["message"]


def chat_text(resp) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


# ------------------------------------------------------------------------- one encoding path
def test_bos_tokenizer_setup_is_the_double_bos_case(bos_sk):
    tok = bos_sk.tokenizer
    assert tok("hi")["input_ids"][0] == BOS  # the tokenizer adds BOS
    rendered = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    assert tok(rendered)["input_ids"][:2] == [BOS, BOS]  # render, then tokenize again: the old server path


def test_library_server_and_cli_encode_one_bos(bos_sk, tmp_path):
    tok = bos_sk.tokenizer
    ids = encode_prompt(tok, MSGS)
    assert ids[:2] == [BOS, 3] and ids.count(BOS) == 1
    lib_ids, _ = encode_prompts(tok, [MSGS[0]["content"]], chat=True)
    assert lib_ids[0].tolist() == ids  # a string with chat=True is the same one-user-turn conversation
    want = bos_sk.generate([MSGS[0]["content"]], max_new_tokens=6, chat=True)
    assert bos_sk.generate([MSGS], max_new_tokens=6).texts == want.texts  # a conversation prompt

    resp = post(TestClient(create_app(bos_sk, "tiny")), "/v1/chat/completions", {"messages": MSGS, "max_tokens": 6})
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)  # was len(ids) + 1
    assert chat_text(resp) == want.texts[0]

    path = tmp_path / "bos"
    bos_sk.save_pretrained(path)
    res = CliRunner().invoke(cli_app, ["generate", MSGS[0]["content"], "--model", str(path), "--chat", "-n", "6",
                                       "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["stats"]["prompt_tokens"] == len(ids) and out["texts"] == want.texts


def test_token_id_prompts_are_used_as_given(client, sk):
    tok = sk.tokenizer
    a, b = tok("The Eagle is")["input_ids"], tok("Describe the restaurant")["input_ids"]
    want = sk.generate(["The Eagle is", "Describe the restaurant"], max_new_tokens=5)
    one = post(client, "/v1/completions", {"prompt": a, "max_tokens": 5}).json()
    assert one["choices"][0]["text"] == want.texts[0] and one["usage"]["prompt_tokens"] == len(a)
    two = post(client, "/v1/completions", {"prompt": [a, b], "max_tokens": 5}).json()
    assert [c["text"] for c in two["choices"]] == want.texts
    # ids are never re-tokenized: a BOS-adding tokenizer does not add one to an id prompt
    assert encode_prompt(make_bos_tokenizer(), [5, 6, 7]) == [5, 6, 7]


@pytest.mark.parametrize(
    "prompt, param, words",
    [([5, 9999], "prompt[1]", ["token id", "9999"]), ([[5], [-1]], "prompt[1][0]", ["token id"]),
     ([999999], "prompt[0]", []), ([[5, 6], [7, 999999]], "prompt[1][1]", []), ("", "prompt", []),
     ([], "prompt", ["at least one"]), ([[5], []], "prompt[1]", ["non-empty"]),
     (["ok", " "], "prompt[1]", ["non-empty"]),
     # wrong types: the error of the alternative that got furthest (a user's check: [[1.5]] named
     # `prompt` with every alternative's message)
     ([[1.5]], "prompt[0][0]", ["valid integer", "got 1.5"]), ([[5, [6]]], "prompt[0][1]", ["valid integer"]),
     ([1.5], "prompt[0]", ["valid string or a valid integer or a valid list (got 1.5)"]),
     (3, "prompt", ["Input should be a valid string or a valid list (got 3)"]),
     # the alternative that failed at the later item: ids at [1], not strings at [0]
     ([1, "a"], "prompt[1]", ["valid integer (got 'a')"]), (["a", 2], "prompt[1]", ["valid string (got 2)"])],
)
def test_bad_prompts_name_the_prompt(client, prompt, param, words):
    assert_400(post(client, "/v1/completions", {"prompt": prompt}), param, *words)


def test_an_empty_token_list_on_completions_is_named_without_chat_messages(client):
    """Completions take strings and token ids only: an empty row's message offers those (a
    user's check found it offering chat messages, which only /v1/chat/completions takes)."""
    r = post(client, "/v1/completions", {"prompt": [[]]})
    assert_400(r, "prompt[0]", "non-empty list of token ids")
    assert "chat" not in r.json()["error"]["message"]


# --------------------------------------------------------------- OpenAI fields, their meaning
def test_every_field_of_the_openai_types_is_handled():
    """Each field of the official client's request types is supported, ignored or refused here."""
    from openai.types import completion_create_params as cp
    from openai.types.chat import (
        ChatCompletionAssistantMessageParam,
        ChatCompletionContentPartTextParam,
        ChatCompletionDeveloperMessageParam,
        ChatCompletionStreamOptionsParam,
        ChatCompletionSystemMessageParam,
        ChatCompletionUserMessageParam,
    )
    from openai.types.chat import completion_create_params as ccp

    def keys(*types) -> set[str]:
        return {k for t in types for k in t.__annotations__}

    def handled(model, place: str) -> set[str]:
        return set(model.model_fields) | set(UNSUPPORTED_FIELDS[place]) | IGNORED_FIELDS[place]

    completion = keys(cp.CompletionCreateParamsNonStreaming, cp.CompletionCreateParamsStreaming)
    chat = keys(ccp.CompletionCreateParamsNonStreaming, ccp.CompletionCreateParamsStreaming)
    messages = keys(ChatCompletionAssistantMessageParam, ChatCompletionDeveloperMessageParam,
                    ChatCompletionSystemMessageParam, ChatCompletionUserMessageParam)
    assert {"max_completion_tokens", "logprobs", "tools", "response_format"} <= chat  # the types are read
    assert completion - handled(CompletionRequest, "completion") == set()
    assert chat - handled(ChatCompletionRequest, "chat") == set()
    assert messages - handled(ChatMessage, "message") == set()
    assert keys(ChatCompletionStreamOptionsParam) - handled(StreamOptions, "stream_options") == set()
    assert keys(ChatCompletionContentPartTextParam) - handled(ContentPart, "part") == set()


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_max_completion_tokens_bounds_the_answer(client, sk, field):
    want = sk.generate([MSGS[0]["content"]], max_new_tokens=2, chat=True)
    data = post(client, "/v1/chat/completions", {"messages": MSGS, field: 2}).json()
    assert data["usage"]["completion_tokens"] == sum(want.new_tokens) <= 2  # was up to 64
    assert data["choices"][0]["message"]["content"] == want.texts[0]


def test_max_tokens_and_max_completion_tokens_must_agree(client):
    body = {"messages": MSGS, "max_tokens": 3, "max_completion_tokens": 2}
    assert_400(post(client, "/v1/chat/completions", body), "max_tokens", "max_completion_tokens")
    assert post(client, "/v1/chat/completions", {**body, "max_tokens": 2}).status_code == 200


def test_developer_role_and_text_parts_mean_what_openai_means(client):
    system = [{"role": "system", "content": "Be brief."}, MSGS[0]]
    want = post(client, "/v1/chat/completions", {"messages": system, "max_tokens": 6})
    developer = [{"role": "developer", "content": "Be brief."}, MSGS[0]]
    got = post(client, "/v1/chat/completions", {"messages": developer, "max_tokens": 6})
    assert chat_text(got) == chat_text(want)
    assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "it"}]}]
    joined = [{"role": "user", "content": "Describe\nit"}]
    assert chat_text(post(client, "/v1/chat/completions", {"messages": parts, "max_tokens": 6})) == chat_text(
        post(client, "/v1/chat/completions", {"messages": joined, "max_tokens": 6}))


def test_developer_role_is_kept_for_a_template_that_knows_it():
    tok = make_tokenizer()
    tok.chat_template = "{% if messages[0]['role'] == 'developer' %}DEV{% endif %}" + CHAT_TEMPLATE
    sk = SkipModel(make_model("llama"), tok)
    body = {"messages": [{"role": "developer", "content": "x"}, MSGS[0]], "max_tokens": 1}
    job = validate_request(ChatCompletionRequest.model_validate(body), sk, "tiny")
    assert tok.decode(job.prompts[0]).startswith("DEV<|im_start|>developer")


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/completions", "echo", True), ("/v1/completions", "best_of", 2),
        ("/v1/completions", "suffix", "end"), ("/v1/completions", "logit_bias", {"5": 10}),
        ("/v1/completions", "echo", 0),  # a number is not false
        ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("/v1/chat/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "functions", [{"name": "f"}]), ("/v1/chat/completions", "audio", {"voice": "x"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]), ("/v1/chat/completions", "store", True),
        ("/v1/chat/completions", "reasoning_effort", "high"), ("/v1/chat/completions", "service_tier", "flex"),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ],
)
def test_unsupported_features_are_refused_by_name(client, path, field, value):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": MSGS}
    assert_400(post(client, path, {**base, "max_tokens": 2, field: value}), field, "not supported")


@pytest.mark.parametrize("path, neutral", [
    ("/v1/completions", {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "logit_bias": {},
                         "frequency_penalty": 0, "presence_penalty": 0.0, "n": 1, "user": "u-1"}),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
                              "response_format": {"type": "text"}, "store": False, "metadata": {"a": "b"},
                              "parallel_tool_calls": True, "service_tier": "auto", "modalities": ["text"],
                              "n": 1, "user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k"}),
])
def test_neutral_values_of_unsupported_fields_change_nothing(client, path, neutral):
    base = {"prompt": "The Eagle is"} if path == "/v1/completions" else {"messages": MSGS}
    plain = post(client, path, {**base, "max_tokens": 5})
    with_fields = post(client, path, {**base, "max_tokens": 5, **neutral})
    assert with_fields.status_code == 200, with_fields.text
    assert with_fields.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "min_p": 0.1}, "min_p"),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 2}, "max_completion_tokens"),  # chat only
        ("/v1/chat/completions", {"messages": [{**MSGS[0], "foo": 1}]}, "messages[0].foo"),
        ("/v1/chat/completions", {"messages": MSGS, "stream": True, "stream_options": {"bar": 1}},
         "stream_options.bar"),
    ],
)
def test_unknown_fields_are_refused_by_name(client, path, body, param):
    assert_400(post(client, path, body), param, "unrecognized")


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                       {"type": "image_url", "image_url": {"url": "u"}}]}],
         "messages[0].content[1].type", ["image_url"]),
        ([MSGS[0], {"role": "tool", "content": "42", "tool_call_id": "c1"}], "messages[1].role", ["tool"]),
        ([MSGS[0], {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}],
         "messages[1].tool_calls", ["not supported"]),
        ([{"role": "user"}], "messages[0].content", ["required"]),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", ["required"]),
        ([{"role": "robot", "content": "hi"}], "messages[0].role",
         ["must be 'system', 'developer', 'user' or 'assistant', got 'robot'"]),
        ([{"role": 3, "content": "hi"}], "messages[0].role", []),
    ],
)
def test_unsupported_message_contents_are_refused_by_name(client, messages, param, words):
    assert_400(post(client, "/v1/chat/completions", {"messages": messages}), param, *words)


def test_n_above_the_limit_is_refused(client):
    assert_400(post(client, "/v1/chat/completions", {"messages": MSGS, "n": 129}), "n", "128")


# --------------------------------------------------------- validation before the engine
@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"seed": 2**70}, "seed", ["9223372036854775807"]),
        ({"seed": -(2**63) - 1}, "seed", []),
        ({"seed": 1.5}, "seed", ["integer"]),
        ({"temperature": 2.5}, "temperature", ["2"]),
        ({"temperature": -1}, "temperature", []),
        ({"temperature": True}, "temperature", []),
        ({"top_p": 1.5}, "top_p", []),
        ({"top_k": -2}, "top_k", ["-1"]),
        ({"max_tokens": 0}, "max_tokens", []),
        ({"max_tokens": 2.0}, "max_tokens", ["integer"]),
        ({"n": 0}, "n", []),
        ({"stop": [1]}, "stop[0]", ["valid string", "got 1"]),  # the list alternative got furthest
        ({"stop": ["a", None]}, "stop[1]", ["valid string (got null)"]),
        ({"speedup": "fast"}, "speedup", []),
        ({"speedup": 100}, "speedup", ["<="]),
        ({"max_layers": 99}, "max_layers", ["[1, 6]"]),
        ({"max_layers": 4, "min_layers": 2, "warmup_layers": 3}, "warmup_layers", ["min_layers"]),
        ({"horizon": 0}, "horizon", []),
        ({"full_depth_steps": -1}, "full_depth_steps", []),
        ({"full_depth_steps": 1.5}, "full_depth_steps", ["integer"]),
        ({"speedup": 2, "max_layers": 4}, "speedup", ["not both"]),
    ],
)
def test_bad_fields_are_named_before_the_engine_runs(sk, body, param, words, monkeypatch):
    def engine(*args, **kwargs):
        raise AssertionError("a bad request reached the engine")

    monkeypatch.setattr(sk, "generate", engine)
    app = TestClient(create_app(sk, "tiny"), raise_server_exceptions=False)
    assert_400(post(app, "/v1/completions", {"prompt": "x", **body}), param, *words)
    assert_400(post(app, "/v1/chat/completions", {"messages": MSGS, **body}), param, *words)


def test_full_depth_steps_reach_the_requests_policy(sk):
    """``full_depth_steps`` with a schedule or a speedup: the request's policy runs that many
    full-depth first steps, then its decay from the start."""
    from skipdecode.protocol import CompletionRequest

    for extra in ({"max_layers": 4, "min_layers": 2}, {"speedup": 2}):
        body = {"prompt": "x", "max_tokens": 1, "full_depth_steps": 3, **extra}
        policy = validate_request(CompletionRequest.model_validate(body), sk, "tiny").policy
        plain = validate_request(CompletionRequest.model_validate({**body, "full_depth_steps": 0}), sk, "tiny").policy
        assert [policy.budget(t) for t in (1, 2, 3)] == [sk.num_layers] * 3
        assert policy.active_layers(4) == plain.active_layers(1) and plain.budget(1) < sk.num_layers


def test_servers_schedule_shape_holds_for_requests_that_choose_a_speedup():
    """``serve --full-depth-steps/--horizon/--warmup-layers`` (``policy_defaults``) fill those fields
    of a request that sends only ``speedup`` (before, such a request ran the trained schedule's
    full-depth steps or the checkpoint's horizon, unlike one that sent nothing); a request's own
    value wins, and a request that sends no policy field runs the server's default policy."""
    from skipdecode.policy import LinearDecayPolicy
    from skipdecode.protocol import CompletionRequest

    trained = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4, full_depth_steps=3)
    model = SkipModel(make_model("llama", 6), make_tokenizer(), policy=trained,
                      skip_config={"policies": {"2": trained.to_dict()}, "horizon": 32})

    def policy(body, defaults=None):
        req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 1, **body})
        return validate_request(req, model, "tiny", defaults).policy

    assert policy({"speedup": 2}) == trained  # no server value: the trained schedule, its k = 3
    assert policy({"speedup": 2}, {"full_depth_steps": 0}) == LinearDecayPolicy(
        num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4, full_depth_steps=0)
    assert policy({"speedup": 2, "full_depth_steps": 1}, {"full_depth_steps": 0}).full_depth_steps == 1
    assert (policy({"speedup": 1.5}).horizon, policy({"speedup": 1.5}).warmup_layers) == (32, 1)
    shaped = policy({"speedup": 1.5}, {"horizon": 10, "warmup_layers": 2})
    assert (shaped.horizon, shaped.warmup_layers) == (10, 2)
    assert policy({"speedup": 1.5, "horizon": 5}, {"horizon": 10}).horizon == 5
    assert policy({}, {"horizon": 10, "full_depth_steps": 0}) is model.policy  # the server's own policy
    # a value the client did not send is named as the server's
    with pytest.raises(APIError) as info:
        policy({"max_layers": 2}, {"warmup_layers": 2})
    assert info.value.param == "warmup_layers" and info.value.detail.endswith(
        "(warmup_layers 2 is the server's --warmup-layers; send warmup_layers to override)"), info.value.detail
    with pytest.raises(ValueError, match="policy_defaults keys must be among warmup_layers, horizon, full_depth_steps, got 'speedup'"):
        create_app(model, "tiny", policy_defaults={"speedup": 2})


def test_serve_passes_its_schedule_shape_options_as_request_defaults(monkeypatch, tmp_path):
    """``skipdecode serve`` hands the shape options it was given (and only those) to create_app."""
    import skipdecode.server as server_module
    from test_server_loopback import free_port

    path = tmp_path / "tiny"
    SkipModel(make_model("llama", 6), make_tokenizer()).save_pretrained(path)
    seen = []

    def spy(*a, **kw):
        seen.append(kw["policy_defaults"])
        raise RuntimeError("stop here")
    monkeypatch.setattr(server_module, "create_app", spy)
    runner = CliRunner()
    for extra in ([], ["--speedup", "2", "--horizon", "7", "--full-depth-steps", "0"], ["--max-layers", "4", "--warmup-layers", "0"]):
        runner.invoke(cli_app, ["serve", "--model", str(path), "--port", str(free_port()), *extra])
    assert seen == [{}, {"horizon": 7, "full_depth_steps": 0}, {"warmup_layers": 0}]


def test_sampling_params_take_the_servers_seed_range():
    """One seed range (int64, skipdecode.limits) for the API, the CLI and the server; the API used
    to take up to 2**64 - 1 (torch's range) while the server stopped at 2**63 - 1."""
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**70)
    for seed in (2**63, 2**64 - 1, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"^seed must be an integer in \[-9223372036854775808, 9223372036854775807\]"):
            SamplingParams(temperature=1.0, seed=seed)
    SamplingParams(temperature=1.0, seed=2**63 - 1)
    SamplingParams(temperature=1.0, seed=-(2**63))


def test_top_p_zero_is_greedy_and_temperature_two_is_allowed(client):
    greedy = post(client, "/v1/completions", {"prompt": "The Eagle is", "max_tokens": 5}).json()["choices"]
    zero = post(client, "/v1/completions", {"prompt": "The Eagle is", "max_tokens": 5, "temperature": 1.0,
                                            "top_p": 0}).json()["choices"]
    assert zero == greedy
    hot = {"prompt": "The", "max_tokens": 2, "temperature": 2, "seed": 1}
    assert post(client, "/v1/completions", hot).status_code == 200


def context_request(sk, prompt_len: int, **fields) -> CompletionRequest:
    ids = [5] * prompt_len
    assert sk.adapter.max_positions == 256
    return CompletionRequest.model_validate({"prompt": ids, **fields})


def test_context_check_counts_the_positions_really_needed(sk):
    # P + n - 1 positions are needed: the last generated token is never fed back (issue 13 item 6)
    assert validate_request(context_request(sk, 250, max_tokens=7), sk, "tiny").max_new_tokens == 7
    assert validate_request(context_request(sk, 256, max_tokens=1), sk, "tiny").max_new_tokens == 1
    # with no max_tokens, the default budget is lowered to what the context leaves
    assert validate_request(context_request(sk, 250), sk, "tiny").max_new_tokens == 7
    for prompt_len, n in ((250, 8), (256, 2)):
        with pytest.raises(APIError) as e:
            validate_request(context_request(sk, prompt_len, max_tokens=n), sk, "tiny")
        assert e.value.param == "max_tokens" and f"at most {257 - prompt_len}" in e.value.detail
    with pytest.raises(APIError) as e:
        validate_request(context_request(sk, 257), sk, "tiny")
    assert e.value.param == "prompt" and "257 prompt tokens" in e.value.detail


def test_context_errors_name_the_field_through_the_server(client):
    assert_400(post(client, "/v1/completions", {"prompt": [5] * 250, "max_tokens": 8}), "max_tokens", "at most 7")
    assert_400(post(client, "/v1/chat/completions", {"messages": MSGS, "max_completion_tokens": 300}),
               "max_completion_tokens", "context")
    long = [{"role": "user", "content": "word " * 300}]
    assert_400(post(client, "/v1/chat/completions", {"messages": long}), "messages", "context")


# ------------------------------------------------------------- a real server on loopback
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_cli(model_dir: Path, **env_extra: str):
    """``skipdecode serve --model model_dir --name tiny`` as a process on a free loopback port, with
    ``env_extra`` in its environment; yields its base URL once ``/health`` answers (at most 180 s),
    then stops it (SIGTERM, SIGKILL after 20 s)."""
    port = free_port()
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           **env_extra}
    proc = subprocess.Popen(
        [sys.executable, "-m", "skipdecode.cli", "serve", "--model", str(model_dir), "--port", str(port), "--name", "tiny"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited early: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not start within 180 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def served_bos(tmp_path_factory, bos_sk):
    """``skipdecode serve`` in a subprocess on loopback, over the BOS-adding tokenizer's model."""
    path = tmp_path_factory.mktemp("serve") / "bos"
    bos_sk.save_pretrained(path)
    with serve_cli(path) as base:
        yield base


def test_real_server_with_the_openai_client(served_bos, bos_sk):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served_bos + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = encode_prompt(bos_sk.tokenizer, MSGS)
    want = bos_sk.generate([MSGS[0]["content"]], max_new_tokens=4, chat=True)
    # the official client sends max_completion_tokens; one BOS, as the library encodes
    chat = client.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=4)
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == want.texts[0]
    assert chat.usage.completion_tokens == sum(want.new_tokens) <= 4
    # token-id prompts and our fields through extra_body
    text_ids = bos_sk.tokenizer("The Eagle is")["input_ids"]
    policy = bos_sk.policy_for(speedup=2, horizon=4)
    comp = client.completions.create(model="tiny", prompt=text_ids, max_tokens=4,
                                     extra_body={"speedup": 2, "horizon": 4})
    assert comp.choices[0].text == bos_sk.generate(["The Eagle is"], max_new_tokens=4, policy=policy).texts[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, seed=2**70)
    assert e.value.body["param"] == "seed"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, top_logprobs=2)  # without logprobs
    assert e.value.body["param"] == "top_logprobs"
    # log-probabilities through the official client's own types: one entry per token of the text
    lp = client.chat.completions.create(model="tiny", messages=MSGS, max_completion_tokens=4, logprobs=True,
                                        top_logprobs=2)
    entries = lp.choices[0].logprobs.content
    # their bytes join into the text (an invalid byte decodes as U+FFFD there, and its token is
    # named in OpenAI's "bytes:\\xNN" form, whose bytes are the same)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", errors="replace") \
        == lp.choices[0].message.content == want.texts[0]
    assert all(e.token == bytes(e.bytes).decode("utf-8") if e.token[:6] != "bytes:"
               else e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes) for e in entries)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in entries)
    comp = client.completions.create(model="tiny", prompt=text_ids, max_tokens=4, logprobs=1)
    assert len(comp.choices[0].logprobs.token_logprobs) == comp.usage.completion_tokens


def test_cli_names_a_seed_out_of_range():
    res = CliRunner().invoke(cli_app, ["generate", "x", "--seed", str(2**70), "--temperature", "1"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 2, res.output
    assert "seed" in res.output and "Traceback" not in res.output


def test_top_k_minus_one_is_off_as_in_vllm():
    from skipdecode.protocol import CompletionRequest, _sampling

    assert _sampling(CompletionRequest(prompt="x", top_k=-1, temperature=0.7)).top_k == 0
    assert _sampling(CompletionRequest(prompt="x", top_k=5, temperature=0.7)).top_k == 5
