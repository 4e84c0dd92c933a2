"""Log-probabilities of generated tokens (skipdecode.logprobs): the computation, the engine's
events, and both OpenAI response shapes through the app (streamed and not)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from conftest import make_model, make_tokenizer
from skipdecode import get_adapter
from skipdecode.engine import Engine, Request
from skipdecode.logprobs import MAX_LOGPROBS, TextOffsets, chat_logprobs, completion_logprobs, token_bytes, token_logprobs
from skipdecode.model import SkipModel
from skipdecode.policy import LinearDecayPolicy
from skipdecode.server import create_app

SKIP = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


def _rebuild(token: str) -> bytes:
    """A client's reading of a token string: OpenAI's ``bytes:\\xNN...`` form parsed as hex
    (as HELM's ``convert_tokens_to_text`` does), any other string as its UTF-8."""
    if token.startswith("bytes:"):
        body = token[len("bytes:"):]
        assert body.startswith("\\x") and len(body) % 4 == 0, token
        return bytes.fromhex(body.replace("\\x", ""))
    return token.encode("utf-8")


def test_token_logprobs_are_log_softmax_and_its_top_n():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 4
    tokens, top_n = [7, 0, 49], [0, 2, 5]
    out = token_logprobs(logits, tokens, top_n)
    ref = torch.log_softmax(logits, -1)
    for r, e in enumerate(out):
        assert e.token == tokens[r]
        assert e.logprob == pytest.approx(ref[r, tokens[r]].item(), abs=1e-6)
        assert len(e.top) == top_n[r]
        values, ids = ref[r].topk(top_n[r])
        assert [t for t, _ in e.top] == ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert sum(torch.exp(ref[0])).item() == pytest.approx(1.0, abs=1e-5)  # a distribution over the vocabulary
    with pytest.raises(ValueError, match="logits must be"):
        token_logprobs(logits, tokens[:2], top_n)


def test_token_bytes_rebuild_text_whose_characters_span_tokens():
    """OpenAI's ``bytes``: each token's own bytes, so that they join into the text even where a
    character spans several tokens; a token holding part of a character is named in OpenAI's
    ``bytes:\\xNN`` form, so the token strings rebuild the text too; ``text_offset`` counts the
    characters the earlier tokens complete."""
    tok = make_tokenizer()
    text = "猫、犬 café 😀"
    ids = tok(text)["input_ids"]
    raw = [token_bytes(tok, i) for i in ids]
    assert b"".join(raw) == text.encode("utf-8")
    assert any(len(r) == 1 and r[0] >= 0x80 for r in raw)  # a token holding part of a character
    entries = token_logprobs(torch.zeros(len(ids), tok.vocab_size), ids, [1] * len(ids))
    out = completion_logprobs(entries, tok)
    assert [_rebuild(t) for t in out["tokens"]] == raw  # every token's bytes, partial ones included
    partial = [k for k, r in enumerate(raw) if len(r) == 1 and r[0] >= 0x80]
    assert all(out["tokens"][k] == f"bytes:\\x{raw[k][0]:02x}" for k in partial)
    assert all(not t.startswith("bytes:") and "\ufffd" not in t
               for k, t in enumerate(out["tokens"]) if k not in partial and raw[k].isascii())
    for k, alts in enumerate(out["top_logprobs"]):  # the alternatives' keys follow the same rule
        assert all(_rebuild(key) for key in alts) and "\ufffd" not in "".join(alts)
    assert out["text_offset"] == [len(b"".join(raw[:k]).decode("utf-8", errors="ignore")) for k in range(len(ids))]
    # invalid bytes (a character's lead byte, then another character) count as U+FFFD, as in the text
    bad = [i for i, r in enumerate(raw) if len(r) == 1 and r[0] >= 0xC0][0]  # a lone lead byte
    broken = token_logprobs(torch.zeros(3, tok.vocab_size), [ids[bad], ids[0], ids[-1]], [0, 0, 0])
    broken_text = b"".join(token_bytes(tok, e.token) for e in broken).decode("utf-8", errors="replace")
    offsets = completion_logprobs(broken, tok)["text_offset"]
    assert broken_text[offsets[2]:] == token_bytes(tok, ids[-1]).decode("utf-8", errors="replace")
    assert out["text_offset"][-1] < len(text) and out["text_offset"] == sorted(out["text_offset"])
    later = completion_logprobs(entries[3:], tok, b"".join(raw[:3]))  # a stream's later chunk
    assert later["text_offset"] == out["text_offset"][3:]
    # a stream carries TextOffsets from chunk to chunk, each chunk reading only its own bytes:
    # cut anywhere (inside a character too), the chunks' offsets are the whole row's
    for cut in range(1, len(ids)):
        carried = TextOffsets()
        first = completion_logprobs(entries[:cut], tok, carried)["text_offset"]
        assert first + completion_logprobs(entries[cut:], tok, carried)["text_offset"] == out["text_offset"]
    # the chosen token always appears among the alternatives (OpenAI: up to n + 1 entries)
    assert all(out["tokens"][k] in out["top_logprobs"][k] for k in range(len(ids)))
    chat = chat_logprobs(entries, tok)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == text.encode("utf-8")
    assert token_bytes(tok, tok.eos_token_id) == tok.eos_token.encode()  # a special token: its text


@pytest.mark.parametrize("policy", [None, SKIP], ids=["full", "skip"])
def test_engine_logprobs_follow_the_logits_each_token_was_drawn_from(policy):
    model = make_model("llama", 6)
    adapter = get_adapter(model)
    engine = Engine(adapter, max_batch_size=4, keep_logits=True)
    asked = Request([5, 9, 11, 13], 6, policy, logprobs=3)
    plain = Request([6, 7, 8], 6, policy)
    events = []
    engine.submit(asked)
    engine.submit(plain)
    while engine.busy:
        events += engine.step()
    mine = [ev for ev in events if ev.row.request is asked]
    assert len(mine) == 6 and all(ev.logprobs is None for ev in events if ev.row.request is plain)
    for ev in mine:
        ref = torch.log_softmax(ev.logits.float(), -1)
        assert ev.logprobs.token == ev.token
        assert ev.logprobs.logprob == pytest.approx(ref[ev.token].item(), abs=1e-6)
        assert [t for t, _ in ev.logprobs.top] == ref.topk(3).indices.tolist()
    if policy is None:  # full depth: the unmodified HF model's distribution at every position
        ids = torch.tensor([[5, 9, 11, 13] + [ev.token for ev in mine]])
        with torch.no_grad():
            hf = torch.log_softmax(model(ids).logits[0].float(), -1)
        for t, ev in enumerate(mine):
            assert ev.logprobs.logprob == pytest.approx(hf[3 + t, ev.token].item(), abs=1e-4)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_engine_refuses_bad_logprobs(bad):
    engine = Engine(get_adapter(make_model("llama", 6)), max_batch_size=2)
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        engine.submit(Request([5, 6], 2, logprobs=bad))


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(SkipModel(make_model("llama"), make_tokenizer()), "tiny"))


def _sse(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def test_completions_logprobs_streamed_and_not(client):
    body = {"prompt": "The Eagle is", "max_tokens": 7, "logprobs": 2, "ignore_eos": True, "speedup": 2}
    data = client.post("/v1/completions", json=body).json()
    lp = data["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == data["usage"]["completion_tokens"] == 7
    assert all(x <= 0 for x in lp["token_logprobs"])
    for k, top in enumerate(lp["top_logprobs"]):
        assert 1 <= len(top) <= 3 and top[lp["tokens"][k]] == lp["token_logprobs"][k]  # ids may share a string
    chunks = [c["choices"][0] for c in _sse(client, "/v1/completions", body)]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in streamed:
            streamed[key] += (c.get("logprobs") or {}).get(key, [])
    assert streamed == lp  # the same values, and offsets that continue across chunks
    plain = client.post("/v1/completions", json={**body, "logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == data["choices"][0]["text"]


def test_chat_logprobs_streamed_and_not(client):
    body = {"messages": [{"role": "user", "content": "Describe the restaurant"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    data = client.post("/v1/chat/completions", json=body).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert 1 <= len(content) <= 6  # special tokens (here <|im_end|>, generated under ignore_eos) get none
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == data["choices"][0]["message"]["content"]
    for e in content:
        assert _rebuild(e["token"]) == bytes(e["bytes"])  # "bytes:\\xNN" for part of a character
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert e["logprob"] <= e["top_logprobs"][0]["logprob"] + 1e-6  # the top alternative is the most likely
    streamed = [e for c in _sse(client, "/v1/chat/completions", body)
                for e in ((c["choices"] or [{}])[0].get("logprobs") or {}).get("content", [])]
    assert streamed == content
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 0}).json()
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": MAX_LOGPROBS + 1}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
])
def test_bad_logprobs_fields_answer_400_naming_them(client, path, body, param):
    resp = client.post(path, json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("inflight", [False, True], ids=["static", "inflight"])
def test_python_api_logprobs_equal_the_engines_and_follow_the_text(inflight):
    """``SkipModel.generate(logprobs=n)``: one entry per text token (EOS and special tokens left out), equal (1e-5)
    between a static batch and in-flight batching and to the server's engine; chunks carry them."""
    sk = SkipModel(make_model("llama"), make_tokenizer())
    prompts = ["The Eagle is", "Describe the restaurant"]
    kw = dict(max_new_tokens=6, policy=SKIP, logprobs=2, max_batch_size=2 if inflight else None)
    res = sk.generate(prompts, **kw)
    ref = sk.generate(prompts, **{**kw, "max_batch_size": None if inflight else 2})  # the other path
    plain = sk.generate(prompts, **{**kw, "logprobs": None})
    assert plain.logprobs is None and plain.texts == res.texts
    hidden = {i for i, t in sk.tokenizer.added_tokens_decoder.items() if t.special}  # EOS among them
    for row in range(2):
        entries = res.logprobs[row]
        assert [e.token for e in entries] == [t for t in res.token_ids[row] if t not in hidden]
        assert b"".join(token_bytes(sk.tokenizer, e.token) for e in entries).decode("utf-8", errors="replace") \
            == res.texts[row]
        assert all(len(e.top) == 2 and e.logprob <= e.top[0][1] + 1e-6 for e in entries)
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in ref.logprobs[row]], abs=1e-5)
    chunks = list(sk.stream_generate(prompts[:1], max_new_tokens=6, policy=SKIP, logprobs=0))
    streamed = [c.logprobs[0] for c in chunks if c.logprobs[0] is not None]
    assert [e.token for e in streamed] == [e.token for e in res.logprobs[0]]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in res.logprobs[0]], abs=1e-5)
    assert all(e.top == () for e in streamed)


def test_python_api_refuses_bad_logprobs_before_running():
    sk = SkipModel(make_model("llama"), make_tokenizer())
    for call in (lambda: sk.generate("x", logprobs=-1), lambda: sk.stream_generate("x", logprobs=21),
                 lambda: sk.generate("x", logprobs=True, max_batch_size=2)):
        with pytest.raises(ValueError, match="logprobs must be an integer in"):
            call()
