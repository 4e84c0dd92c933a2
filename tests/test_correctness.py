"""Correctness sweep (issue 13 items 3, 4, 5, 14): each kind of fault checked on every path that
has it — the library API, the ``skipdecode`` CLI and the HTTP server — on tiny random models.

- falsy values are values: ``warmup_layers=0`` is never replaced by a default (item 4);
- every JSON the project writes is strict JSON, no NaN/Infinity (item 5);
- numerically degenerate sampling settings (temperature 1e-38) decode greedily below
  ``GREEDY_TEMPERATURE`` instead of crashing, on every path alike (item 3);
- seeded sampling: same seed, same text AND other seed, other text, on every path (item 14).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from conftest import make_model
from skipdecode import SkipModel, for_speedup
from skipdecode.cli import app
from skipdecode.server import create_app

NUM_LAYERS = 6
PROMPT = "The Eagle"


@pytest.fixture(scope="module")
def sk(tokenizer):
    """Random tiny llama: its sampled continuations differ between seeds."""
    return SkipModel(make_model("llama", NUM_LAYERS), tokenizer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, sk):
    path = tmp_path_factory.mktemp("ckpt") / "random"
    sk.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def client(sk):
    return TestClient(create_app(sk, "tiny"))


def cli(model_dir, *args: str) -> dict:
    """Run ``skipdecode generate PROMPT --model DIR --json ARGS``; return its parsed JSON."""
    res = CliRunner().invoke(app, ["generate", PROMPT, "--model", str(model_dir), "--json", *args],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return strict_json(res.stdout.strip().splitlines()[-1])


def strict_json(text: str):
    """Parse ``text`` as strict JSON (RFC 8259): NaN/Infinity tokens are an error."""
    def reject(token: str):
        raise AssertionError(f"non-standard JSON constant {token} in {text[:200]!r}")

    return json.loads(text, parse_constant=reject)


# --------------------------------------------------------------------------------------------
# item 4: a falsy value is a value
# --------------------------------------------------------------------------------------------


def test_speedup_with_warmup_zero_keeps_zero_api(sk):
    policy = sk.policy_for(speedup=2, warmup_layers=0)
    assert policy == for_speedup(NUM_LAYERS, 2, sk.horizon, warmup_layers=0)
    assert policy.warmup_layers == 0 and policy.active_layers(10)[0] != 0  # layer 0 really skipped


def test_speedup_with_warmup_zero_keeps_zero_cli(model_dir):
    policy = cli(model_dir, "-n", "3", "--speedup", "2", "--warmup-layers", "0")["stats"]["policy"]
    assert policy["warmup_layers"] == 0 and policy["type"] == "linear_decay"


def test_speedup_with_warmup_zero_keeps_zero_server(client):
    resp = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "speedup": 2, "warmup_layers": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["skipdecode"]["policy"]["warmup_layers"] == 0
