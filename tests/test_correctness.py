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


# --------------------------------------------------------------------------------------------
# item 5: all JSON the project writes is strict JSON
# --------------------------------------------------------------------------------------------


def test_jsonio_maps_every_non_finite_float_to_null():
    from skipdecode.jsonio import dumps

    value = {"a": float("nan"), "b": [1.5, float("inf"), (float("-inf"), 2)], "c": {"d": float("nan")}, "e": "NaN"}
    assert strict_json(dumps(value)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": None}, "e": "NaN"}


def test_cli_json_of_a_one_token_run_is_strict(model_dir):
    """``generate --json -n 1`` has no decode step: step_seconds has no value and is null."""
    stats = cli(model_dir, "-n", "1")["stats"]
    assert stats["decode_steps"] == 0 and stats["step_seconds"] is None


def test_written_records_are_strict(tmp_path):
    """Checkpoint configs, run records and benchmark results all go through write_json_atomic;
    evaluation reports through EvalReport.save: both write null for NaN."""
    from skipdecode.model import write_json_atomic

    path = tmp_path / "record.json"
    write_json_atomic(path, {"loss": float("nan"), "rows": [{"tokens_per_second": float("inf")}]})
    assert strict_json(path.read_text()) == {"loss": None, "rows": [{"tokens_per_second": None}]}


def test_eval_report_with_nan_statistics_is_strict(tmp_path):
    from skipdecode.evaluate import EvalRow, Report

    row = EvalRow(model="m", policy="full", policy_config={"type": "full", "num_layers": 6}, description="full",
                  kind="skipdecode", reference=True, reference_policy="full", batch_size=1, num_layers=6)
    report = Report(rows=[row], items=[], meta={"ratio": float("nan")})  # row speed statistics: NaN
    paths = report.save(tmp_path, "report")
    data = strict_json(paths["json"].read_text())
    assert data["meta"]["ratio"] is None and data["rows"][0]["step_seconds"] is None


def test_server_responses_and_stream_events_are_strict(client):
    body = {"prompt": PROMPT, "max_tokens": 1}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert strict_json(resp.text)["usage"]["skipdecode"]["step_seconds"] is None
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert strict_json(events[-1])["usage"]["skipdecode"]["step_seconds"] is None
    for event in events:
        strict_json(event)


def test_server_response_class_is_strict(sk):
    """Every server response (routes and errors) is rendered by one strict response class: a
    non-finite float anywhere in a body is null, never a bare NaN or a 500 from the renderer."""
    from skipdecode.server import StrictJSONResponse

    body = StrictJSONResponse({"a": float("nan"), "b": [float("inf")]}).body
    assert strict_json(body.decode()) == {"a": None, "b": [None]}
    assert create_app(sk, "tiny").router.default_response_class is StrictJSONResponse


# --------------------------------------------------------------------------------------------
# item 3: numerically degenerate sampling settings decode greedily, on every path
# --------------------------------------------------------------------------------------------

# far below float32's range (overflows logits / T for |logits| > 3.4), the smallest double
# (0 in float32: logits / T is inf everywhere), just under the threshold
TINY_TEMPERATURES = [1e-38, 5e-324, 1e-6]


@pytest.fixture(scope="module")
def sharp_sk(tokenizer):
    """Random tiny llama with logits of real-model size (tens): logits / 1e-38 overflow."""
    import torch

    model = make_model("llama", NUM_LAYERS, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return SkipModel(model, tokenizer)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, sharp_sk):
    path = tmp_path_factory.mktemp("ckpt") / "sharp"
    sharp_sk.save_pretrained(path)
    return path


def test_sharp_model_overflows_a_tiny_temperature(sharp_sk):
    """The fixture is sharp enough that dividing its logits by 1e-38 leaves float32's range."""
    import torch

    ids, mask = sharp_sk.tokenizer(PROMPT, return_tensors="pt").values()
    with torch.no_grad():
        logits = sharp_sk.model(input_ids=ids).logits[0, -1]
    assert not torch.isfinite(logits / 1e-38).all()


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_is_greedy_api(sharp_sk, temperature):
    from skipdecode.sampling import GREEDY_TEMPERATURE, SamplingParams

    assert temperature < GREEDY_TEMPERATURE and SamplingParams(temperature=temperature).greedy
    greedy = sharp_sk.generate(PROMPT, max_new_tokens=12)
    tiny = sharp_sk.generate(PROMPT, max_new_tokens=12, temperature=temperature, seed=3)
    assert tiny.token_ids == greedy.token_ids


def test_threshold_temperature_samples(sharp_sk):
    """At the threshold itself sampling is on, and logits / 1e-5 stay finite for real logits."""
    from skipdecode.sampling import GREEDY_TEMPERATURE, SamplingParams

    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    out = sharp_sk.generate(PROMPT, max_new_tokens=12, temperature=GREEDY_TEMPERATURE, seed=3)
    assert len(out.token_ids[0]) == 12


@pytest.mark.parametrize("temperature", ["1e-38", "5e-324"])
def test_tiny_temperature_is_greedy_cli(sharp_dir, temperature):
    greedy = cli(sharp_dir, "-n", "12")
    tiny = cli(sharp_dir, "-n", "12", "--temperature", temperature, "--seed", "3")
    assert tiny["token_ids"] == greedy["token_ids"]


@pytest.mark.parametrize("temperature", [1e-38, 5e-324])
def test_tiny_temperature_is_greedy_server(sharp_sk, temperature):
    client = TestClient(create_app(sharp_sk, "tiny"))
    body = {"prompt": PROMPT, "max_tokens": 12}
    greedy = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    tiny = client.post("/v1/completions", json={**body, "temperature": temperature, "seed": 3})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy
    with client.stream("POST", "/v1/completions", json={**body, "temperature": temperature, "stream": True}) as r:
        deltas = [json.loads(ln[6:])["choices"][0]["text"] for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert "".join(deltas) == greedy


# --------------------------------------------------------------------------------------------
# item 14: seeded sampling on every path: same seed, same text; other seed, other text
# --------------------------------------------------------------------------------------------

SAMPLE = dict(max_new_tokens=16, temperature=1.0)


def test_samples_differ_between_seeds_api(sk):
    a, b, c = (sk.generate(PROMPT, seed=s, **SAMPLE) for s in (7, 7, 8))
    assert a.token_ids == b.token_ids and a.texts == b.texts
    assert a.token_ids != c.token_ids and a.texts != c.texts
    chunks = list(sk.stream_generate(PROMPT, seed=7, **SAMPLE))  # the streaming API draws the same
    assert [int(ch.tokens[0]) for ch in chunks] == a.token_ids[0]


def test_samples_differ_between_seeds_cli(model_dir):
    """``generate --seed`` reaches the sampler: a CLI that ignored it fails one of the two."""
    args = ("-n", "16", "--temperature", "1.0", "--seed")
    a, b, c = (cli(model_dir, *args, s) for s in ("7", "7", "8"))
    assert a["token_ids"] == b["token_ids"] and a["texts"] == b["texts"]
    assert a["token_ids"] != c["token_ids"] and a["texts"] != c["texts"]


@pytest.mark.parametrize("stream", [False, True])
def test_samples_differ_between_seeds_server(client, stream):
    def text(seed: int) -> str:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": seed, "stream": stream}
        if not stream:
            resp = client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json=body) as r:
            return "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in r.iter_lines()
                           if ln.startswith("data: ") and ln != "data: [DONE]")

    a, b, c = text(7), text(7), text(8)
    assert a == b and a != c


def test_top_p_zero_is_greedy_everywhere(sharp_sk, sharp_dir):
    """top_p 0 (OpenAI's range is [0, 1]) means a nucleus of the most likely token alone: the API,
    the CLI and the server all take it and decode greedily at any temperature (they used to
    disagree: the server took it, the API and the CLI refused it)."""
    from skipdecode.sampling import Sampler, SamplingParams

    params = SamplingParams(temperature=1.5, top_p=0)
    assert params.greedy and not SamplingParams(temperature=1.5, top_p=1e-6).greedy
    assert len(Sampler(params).warpers) == 0
    greedy = sharp_sk.generate(PROMPT, max_new_tokens=12)
    assert sharp_sk.generate(PROMPT, max_new_tokens=12, temperature=1.5, top_p=0, seed=3).token_ids == greedy.token_ids
    assert cli(sharp_dir, "-n", "12", "--temperature", "1.5", "--top-p", "0", "--seed", "3")["token_ids"] == greedy.token_ids
    client = TestClient(create_app(sharp_sk, "tiny"))
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5, "seed": 3}
    zero = client.post("/v1/completions", json={**body, "top_p": 0}).json()["choices"][0]["text"]
    assert zero == client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    with pytest.raises(ValueError, match=r"top_p must be in \[0, 1\]"):
        SamplingParams(top_p=-0.1)
