"""The training throughput measurement (library) and its benchmark script, smoke-tested with one
step on a tiny model; the real benchmark runs on a quiet machine (docs/training-speed.md)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark
from test_train import examples, tiny_skipmodel

from skipdecode.policy import for_speedup
from skipdecode.training.throughput import response_active_fraction, training_throughput

def test_response_active_fraction_counts_response_layer_work():
    policy = for_speedup(6, 3.0, 4)
    P, S = torch.tensor([3, 2]), torch.tensor([7, 4])  # 4 and 2 response tokens
    expected = sum(len(policy.active_layers(i + 1)) for i in range(4)) + sum(
        len(policy.active_layers(i + 1)) for i in range(2))
    assert response_active_fraction(policy, P, S, 6) == pytest.approx(expected / (6 * 6))
    assert response_active_fraction(for_speedup(6, 1.0, 4), P, S, 6) == 1.0


def test_training_throughput_rows_and_baseline():
    sk = tiny_skipmodel()
    before = {k: v.clone() for k, v in sk.model.state_dict().items()}
    out = training_throughput(sk, examples(), speedups=(1, 3), teacher_forcing=("masked", "sparse"),
                              prompt_grad=(True, False), lora_r=(0, 4), rows=9, batch_size=2, steps=1, warmup_steps=0)
    rows = out["rows"]
    assert len(rows) == 9  # --rows cuts the 16 combinations
    assert rows[0] == {**out["baseline"]} and rows[0]["relative"] == 1.0
    assert (rows[0]["speedup"], rows[0]["teacher_forcing"], rows[0]["prompt_grad"], rows[0]["lora_r"]) == (1.0, "masked", True, 0)
    assert rows[8]["speedup"] == 3.0 and rows[8]["response_active_fraction"] < 1.0 == rows[0]["response_active_fraction"]
    assert all(r["tokens_per_second"] > 0 and r["seconds_per_step"] > 0 for r in rows)
    assert out["prompt_tokens"] > 0 and out["response_tokens"] > 0
    for k, v in sk.model.state_dict().items():  # the caller's model is not trained
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="teacher_forcing"):
        training_throughput(sk, examples(), teacher_forcing=("dense",), steps=1)


def test_benchmark_script_smoke(tmp_path):
    mod = load_benchmark("train_throughput")
    model_dir = tmp_path / "model"
    tiny_skipmodel().save_pretrained(model_dir)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples()))
    stem = tmp_path / "tp"
    rc = mod.main(["--model", str(model_dir), "--data", str(data), "--task", "plain", "--rows", "2", "--steps", "1",
                   "--warmup-steps", "0", "--batch-size", "2", "--out", str(stem)])
    assert rc == 0
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert len(saved["rows"]) == 2 and stem.with_suffix(".png").stat().st_size > 0
    assert mod.main(["--model", str(model_dir), "--data", str(data), "--modes", "dense", "--steps", "1",
                     "--out", str(stem)]) == 2
    with pytest.raises(SystemExit) as info:
        mod.main(["--model", str(model_dir), "--data", str(data), "--prompt-grad", "yes", "--out", str(stem)])
    assert info.value.code == 2
