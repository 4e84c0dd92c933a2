"""``n`` completions per prompt on the server (OpenAI's ``n``): choice indexes, per-choice seeds,
usage counting each prompt once, streaming, and the limits."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from conftest import make_model, make_tokenizer
from skipdecode.limits import SEED_MAX, SEED_MIN
from skipdecode.model import SkipModel
from skipdecode.protocol import MAX_CHOICES
from skipdecode.sampling import SamplingParams, choice_sampling
from skipdecode.server import create_app

MSGS = [{"role": "user", "content": "Describe the restaurant"}]


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


@pytest.fixture(scope="module")
def client(sk):
    return TestClient(create_app(sk, "tiny", prefix_cache=False))


def test_choice_seeds_are_the_request_seed_plus_j_within_int64():
    base = SamplingParams(temperature=1.0, seed=5)
    assert [choice_sampling(base, j).seed for j in range(3)] == [5, 6, 7]
    assert choice_sampling(SamplingParams(temperature=1.0, seed=SEED_MAX), 1).seed == SEED_MIN  # wraps
    assert choice_sampling(SamplingParams(temperature=1.0), 2).seed is None  # unseeded: each row its own
    assert choice_sampling(base, 2).temperature == 1.0


def test_chat_n_choices_are_the_seeded_solo_samples(client, sk):
    body = {"messages": MSGS, "max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11}
    data = client.post("/v1/chat/completions", json=body).json()
    texts = [c["message"]["content"] for c in data["choices"]]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    want = [sk.generate([MSGS], max_new_tokens=8, temperature=1.0, seed=11 + j).texts[0] for j in range(3)]
    assert texts == want and len(set(texts)) > 1  # seeds 11, 12, 13: different samples
    solo = client.post("/v1/chat/completions", json={**body, "n": 1}).json()
    assert solo["choices"][0]["message"]["content"] == texts[0]  # choice 0 is the n = 1 request
    usage = data["usage"]
    assert usage["prompt_tokens"] == solo["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == usage["skipdecode"]["new_tokens"] >= 3


def test_completions_n_with_a_prompt_list_orders_choices_by_prompt(client, sk):
    prompts = ["The Eagle is", "Describe"]
    data = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 6, "n": 2}).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    greedy = sk.generate(prompts, max_new_tokens=6).texts
    assert [c["text"] for c in data["choices"]] == [greedy[0], greedy[0], greedy[1], greedy[1]]  # greedy: alike


def test_streamed_n_choices_equal_the_non_streamed(client):
    body = {"messages": MSGS, "max_tokens": 8, "n": 2, "temperature": 1.0, "seed": 3}
    full = client.post("/v1/chat/completions", json=body).json()
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    texts, finishes = ["", ""], [None, None]
    for ln in lines:
        for c in json.loads(ln[6:])["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
            finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert texts == [c["message"]["content"] for c in full["choices"]]
    assert finishes == [c["finish_reason"] for c in full["choices"]]


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1])
def test_n_out_of_range_is_a_400_naming_it(client, n):
    resp = client.post("/v1/completions", json={"prompt": "x", "n": n})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"


def test_more_rows_than_the_server_ever_holds_is_a_400_not_a_429(sk):
    """prompts x n above --max-waiting + --max-batch-size could never be queued: a retry cannot help."""
    small = TestClient(create_app(sk, "tiny", max_batch_size=2, max_waiting=4))
    resp = small.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "n": 4})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    assert "need 8 rows" in resp.json()["error"]["message"]
    assert small.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "n": 3}).status_code == 200


# ------------------------------------------------------------------ n in the Python API
PROMPTS = ["The Eagle is", "Describe"]


@pytest.mark.parametrize("inflight", [None, 4])
def test_api_n_rows_are_the_seeded_solo_samples(sk, inflight):
    """``generate(n=3)``: row k*n+j is prompt k sampled alone with seed + j, in a static batch and
    in flight; choice 0 is the n = 1 sample."""
    result = sk.generate(PROMPTS, n=3, temperature=1.0, seed=5, max_new_tokens=6, max_batch_size=inflight)
    want = [sk.generate(p, temperature=1.0, seed=5 + j, max_new_tokens=6).texts[0] for p in PROMPTS for j in range(3)]
    assert result.texts == want and len(set(want[:3])) > 1
    assert len(result.finish_reasons) == len(result.new_tokens) == 6
    assert result.batch_size == (6 if inflight is None else inflight)  # in flight: the most rows at once
    assert result.prompt_tokens[0] == result.prompt_tokens[2] != result.prompt_tokens[3]


def test_api_n_streams_every_row_and_greedy_choices_are_alike(sk):
    chunks = list(sk.stream_generate(PROMPTS, n=2, max_new_tokens=5))
    texts = ["".join(c.deltas[i] for c in chunks) for i in range(4)]
    greedy = sk.generate(PROMPTS, max_new_tokens=5).texts
    assert texts == [greedy[0], greedy[0], greedy[1], greedy[1]]
    logged = sk.generate(PROMPTS, n=2, max_new_tokens=5, logprobs=1)
    assert len(logged.logprobs) == 4 and logged.logprobs[0] == logged.logprobs[1]


def test_per_row_sampling_settings_are_each_rows_own(sk):
    """``sampling`` may be one SamplingParams per prompt: a greedy row and a sampled row in one
    batch each equal their solo runs (one generator per row)."""
    from skipdecode.generate import generate

    rows = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=3)]
    for max_batch_size in (None, 2):
        out = generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=rows, max_new_tokens=6, max_batch_size=max_batch_size)
        assert out.texts == [sk.generate(PROMPTS[0], max_new_tokens=6).texts[0],
                             sk.generate(PROMPTS[1], temperature=1.0, top_k=20, seed=3, max_new_tokens=6).texts[0]]
    sampled = generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=rows, n=2, max_new_tokens=6)
    assert sampled.texts[1] == sampled.texts[0]  # the greedy prompt's two choices
    assert sampled.texts[3] == sk.generate(PROMPTS[1], temperature=1.0, top_k=20, seed=4, max_new_tokens=6).texts[0]


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_api_bad_n_names_it_at_once(sk, n):
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        sk.generate(PROMPTS, n=n)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        sk.stream_generate(PROMPTS, n=n)  # at the call, not at the first step


def test_per_row_sampling_of_the_wrong_length_names_sampling(sk):
    from skipdecode.generate import generate

    with pytest.raises(ValueError, match="sampling holds 1 SamplingParams for 2 rows"):
        generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=[SamplingParams()], max_new_tokens=2)
    with pytest.raises(ValueError, match="sampling holds 4 SamplingParams for 2 prompts; give one per prompt"):
        generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=[SamplingParams()] * 4, n=2, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"sampling\[0\] must be a SamplingParams \(SamplingParams\(\) for greedy\)"):
        generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=[None, SamplingParams()], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"sampling\[1\] must be a SamplingParams"):
        generate(sk.adapter, sk.tokenizer, PROMPTS, sampling=[SamplingParams(), 0.7], max_new_tokens=2)
