"""Repetition, frequency and presence penalties (skipdecode.sampling): the arithmetic, a row's
history (its own prompt without padding, its own output), the same tokens alone, in a padded batch
and in flight, and the server and CLI fields."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from fastapi.testclient import TestClient
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from typer.testing import CliRunner

from conftest import make_model, make_tokenizer
from skipdecode.cli import app as cli_app
from skipdecode.model import SkipModel
from skipdecode.policy import LinearDecayPolicy
from skipdecode.sampling import Sampler, SamplingParams
from skipdecode.server import create_app

SKIP = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


@pytest.fixture(scope="module")
def sk():
    return SkipModel(make_model("llama"), make_tokenizer())


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0), ("repetition_penalty", -1.0),
                                         ("repetition_penalty", 1e-38), ("repetition_penalty", 101.0),
                                         ("repetition_penalty", float("nan")), ("repetition_penalty", True),
                                         ("frequency_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", "1")])
def test_bad_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_penalty_arithmetic_on_the_row_history():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 3
    history = torch.tensor([[3, 5, 5, 7, 7, 7, 9]])  # prompt [3, 5], output [5, 7, 7, 7, 9]
    raw = logits.clone()
    out = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)).penalize(logits, history, 5)
    counts = torch.zeros(12)
    for t in (5, 7, 7, 7, 9):
        counts[t] += 1
    want = raw[0] - 0.5 * counts - 0.25 * (counts > 0).float()
    assert torch.equal(logits, raw)  # the caller's logits (the log-probabilities' source) are untouched
    assert torch.allclose(out[0], want) and out[0, 3] == raw[0, 3]  # a prompt-only token: no OpenAI penalty
    rep = Sampler(SamplingParams(repetition_penalty=1.7)).penalize(logits, history, 5)
    assert torch.equal(rep, RepetitionPenaltyLogitsProcessor(1.7)(history, raw.clone()))
    assert rep[0, 3] != raw[0, 3]  # the repetition penalty also reads the prompt
    assert torch.equal(logits, raw)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 5.0}])
def test_penalties_stop_greedy_repetition(sk, kw):
    plain = sk.generate(["The Eagle is"], max_new_tokens=16)
    ids = plain.token_ids[0]
    assert len(set(ids)) < len(ids)  # the tiny model repeats itself unpenalised
    got = sk.generate(["The Eagle is"], max_new_tokens=16, **kw).token_ids[0]
    assert len(set(got)) == len(got) == 16


@pytest.mark.parametrize("kw", [{"presence_penalty": 1.0, "repetition_penalty": 1.3},
                                {"frequency_penalty": 0.7, "temperature": 0.9, "seed": 3}])
def test_a_penalised_row_is_the_same_alone_padded_in_a_batch_and_in_flight(sk, kw):
    """The history is the row's own: left padding (its pad id) and other rows never count."""
    prompts = ["The Eagle is a", "Describe", "The restaurant near the river is"]
    solo = [sk.generate([p], max_new_tokens=10, policy=SKIP, **kw).token_ids[0] for p in prompts]
    batch = sk.generate(prompts, max_new_tokens=10, policy=SKIP, **kw).token_ids
    inflight = sk.generate(prompts, max_new_tokens=10, policy=SKIP, max_batch_size=2, **kw).token_ids
    assert batch == solo and inflight == solo


def test_server_fields_equal_the_library(sk):
    client = TestClient(create_app(sk, "tiny"))
    body = {"prompt": "The Eagle is", "max_tokens": 12, "frequency_penalty": 1.5, "repetition_penalty": 1.3,
            "presence_penalty": 0}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    want = sk.generate(["The Eagle is"], max_new_tokens=12, frequency_penalty=1.5, repetition_penalty=1.3).texts[0]
    assert got == want != sk.generate(["The Eagle is"], max_new_tokens=12).texts[0]
    for field, value in (("frequency_penalty", 2.5), ("presence_penalty", -2.1), ("repetition_penalty", 0),
                         ("repetition_penalty", 1e-300)):
        resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], field: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_cli_options(sk, tmp_path):
    path = tmp_path / "tiny"
    sk.save_pretrained(path)
    runner = CliRunner()
    res = runner.invoke(cli_app, ["generate", "The Eagle is", "--model", str(path), "-n", "10", "--json", "--no-chat",
                                  "--presence-penalty", "2"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["token_ids"] == sk.generate(["The Eagle is"], max_new_tokens=10, chat=False,
                                                               presence_penalty=2.0).token_ids
    res = runner.invoke(cli_app, ["generate", "x", "--model", str(path), "--frequency-penalty", "3"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "--frequency-penalty must be a number in [-2, 2]" in res.output
    assert "Traceback" not in res.output


def test_left_padding_is_not_part_of_a_rows_history():
    from skipdecode.generate import sample_rows

    logits = torch.zeros(2, 10)
    logits[:, 0], logits[:, 1] = 2.0, 1.9  # id 0 (the pad id here) is each row's best
    ids = torch.tensor([[0, 0, 5, 6], [4, 3, 5, 6]])  # row 0: two pad columns, then its prompt
    samplers = [Sampler(SamplingParams(repetition_penalty=5.0)) for _ in range(2)]
    assert sample_rows(samplers, logits, ids, starts=[2, 0]).tolist() == [0, 0]
    assert sample_rows(samplers, logits, ids).tolist() == [1, 0]  # what counting the padding would do


def test_plain_greedy_keeps_no_history(sk, monkeypatch):
    """Only the warpers and the penalties read a row's history: plain greedy decoding does not
    grow it (one concatenation per step), penalised greedy decoding does."""
    gen = importlib.import_module("skipdecode.generate")
    widths = []
    real = gen.sample_rows

    def spy(samplers, logits, input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return real(samplers, logits, input_ids, *args, **kwargs)

    monkeypatch.setattr(gen, "sample_rows", spy)
    sk.generate(["The Eagle is"], max_new_tokens=5, chat=False)
    assert len(set(widths)) == 1
    widths.clear()
    sk.generate(["The Eagle is"], max_new_tokens=5, chat=False, presence_penalty=1.0)
    assert widths == list(range(widths[0], widths[0] + 5))
