"""``ignore_eos`` (vLLM's request extension) on the server: EOS ends no row, so a request runs to
``max_tokens`` (or a stop string) and says "length"; without it the same request stops at EOS."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from conftest import make_chain_model
from skipdecode.model import SkipModel
from skipdecode.server import create_app

NUM_LAYERS = 6
CHAIN_PROMPT = "Describe the restaurant:"
TARGET = "The Eagle is a coffee shop"


@pytest.fixture(scope="module")
def chain(tokenizer):
    """A server on a tiny llama that writes TARGET, then EOS, then TARGET again (conftest)."""
    sk = SkipModel(make_chain_model(tokenizer, CHAIN_PROMPT, TARGET, NUM_LAYERS), tokenizer)
    return sk, TestClient(create_app(sk, "tiny"))


def _target_len(tokenizer) -> int:
    return len(tokenizer(TARGET)["input_ids"])


def test_without_ignore_eos_the_row_stops_at_eos(chain, tokenizer):
    _, client = chain
    out = client.post("/v1/completions", json={"prompt": CHAIN_PROMPT, "max_tokens": 20}).json()
    assert out["choices"][0]["text"] == TARGET
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == _target_len(tokenizer) + 1  # the EOS counts


@pytest.mark.parametrize("speedup", [1.0, 3.0])
def test_ignore_eos_runs_to_max_tokens_and_says_length(chain, tokenizer, speedup):
    _, client = chain
    n = _target_len(tokenizer)
    body = {"prompt": CHAIN_PROMPT, "max_tokens": n + 4, "ignore_eos": True, "speedup": speedup}
    out = client.post("/v1/completions", json=body).json()
    assert out["usage"]["completion_tokens"] == n + 4
    assert out["choices"][0]["finish_reason"] == "length"
    # after EOS (left out of the text) the chain starts TARGET again: its first 3 tokens
    again = tokenizer.decode(tokenizer(TARGET)["input_ids"][:3])
    assert out["choices"][0]["text"] == TARGET + again


def test_ignore_eos_streams_to_max_tokens(chain, tokenizer):
    _, client = chain
    n = _target_len(tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": n + 6, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == n + 6
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"]


def test_ignore_eos_keeps_stop_strings(chain):
    _, client = chain
    body = {"prompt": CHAIN_PROMPT, "max_tokens": 40, "ignore_eos": True, "stop": "coffee"}
    out = client.post("/v1/completions", json=body).json()
    assert out["choices"][0]["text"] == "The Eagle is a "
    assert out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("value", [1, "yes", None])
def test_ignore_eos_must_be_a_bool(chain, value):
    _, client = chain
    resp = client.post("/v1/completions", json={"prompt": CHAIN_PROMPT, "ignore_eos": value})
    if value is None:  # null is the default, as for every optional OpenAI field
        assert resp.status_code == 200
        return
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "ignore_eos"


def test_ignore_eos_with_several_prompts_and_a_skip_schedule(chain):
    """A multi-prompt request under a skip schedule: every row runs to max_tokens."""
    _, client = chain
    body = {"prompt": [CHAIN_PROMPT, CHAIN_PROMPT], "max_tokens": 15, "ignore_eos": True,
            "max_layers": 5, "min_layers": 2, "horizon": 4}
    out = client.post("/v1/completions", json=body).json()
    assert out["usage"]["completion_tokens"] == 30
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
