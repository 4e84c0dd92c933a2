"""benchmarks/variant_ab.py on tiny models: every (variant, policy) cell gets one run per round,
and the summary's ratios follow from the runs (no timing assertions)."""

from __future__ import annotations

import statistics

import pytest

from skipdecode.model import SkipModel
from skipdecode.quantize import quantize_model

from conftest import load_benchmark, make_model



def test_rounds_cover_every_cell_and_summary_follows_the_runs(tokenizer, tmp_path):
    va = load_benchmark("variant_ab")
    models = {"float32": SkipModel(make_model("llama"), tokenizer),
              "head": SkipModel(quantize_model(make_model("llama"), "head"), tokenizer)}
    calls = []
    for name, sk in models.items():
        generate = sk.generate
        sk.generate = (lambda *a, _g=generate, _n=name, **k: calls.append((_n, k["policy"].to_dict()["type"])) or _g(*a, **k))
    rows = va.measure(models, speedup=2.0, repeats=3, new_tokens=4)
    assert [(r["variant"], r["policy"]) for r in rows] == [("float32", "full"), ("float32", "2x"), ("head", "full"), ("head", "2x")]
    assert all(len(r["step_ms_runs"]) == 3 and r["step_ms"] == statistics.median(r["step_ms_runs"]) for r in rows)
    assert len(calls) == 4 * (1 + 3)  # one untimed warm-up of each cell, then one run per cell per round
    assert calls[4:8][0] != calls[8:12][0]  # the order rotates between rounds
    full = next(r for r in rows if r["policy"] == "full")
    skip = next(r for r in rows if r["policy"] == "2x")
    assert full["mean_layers"] == 6 and skip["mean_layers"] < 6
    lines, summary = va.summarize(rows, ["float32", "head"], "2x")
    s = summary["float32"]
    theo = 6 / skip["mean_layers"]
    assert s["theoretical"] == pytest.approx(theo)
    assert s["wall_over_theoretical"] == pytest.approx(full["step_ms"] / skip["step_ms"] / theo)
    per_round = statistics.median(f / k for f, k in zip(full["step_ms_runs"], skip["step_ms_runs"])) / theo
    assert s["wall_over_theoretical_per_round"] == pytest.approx(per_round)
    assert len(lines) == 2 + 2 and lines[2].startswith("| float32 |")
    result = {"rows": rows}
    va.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_layer_sweep_runs_constant_plans_and_the_fit_recovers_a_known_line(tokenizer):
    va = load_benchmark("variant_ab")
    pols = va.sweep_policies(6, [1, 3, 6], warmup_layers=1)
    assert pols["1 layers"].active_layers(5) == (5,)  # no room for the warm-up layer: the top one
    assert pols["3 layers"].active_layers(1) == pols["3 layers"].active_layers(9) == (0, 4, 5)
    assert pols["6 layers"].active_layers(3) == tuple(range(6))
    models = {"float32": SkipModel(make_model("llama"), tokenizer)}
    rows = va.measure(models, speedup=2.0, repeats=2, new_tokens=4, sweep=[1, 3])
    assert [r["policy"] for r in rows] == ["full", "2x", "1 layers", "3 layers"]
    assert [r["mean_layers"] for r in rows[2:]] == [1, 3]
    # a known line: 0.5 ms per layer plus 2 ms per step, any variant name
    fake = [{"variant": "v", "policy": f"{n} layers", "mean_layers": n, "step_ms": 2.0 + 0.5 * n} for n in (1, 10, 30)]
    lines, fits = va.fit_fixed_cost(fake, ["v"], 30, 10.0)
    f = fits["v"]
    assert f["per_layer_ms"] == pytest.approx(0.5) and f["fixed_ms"] == pytest.approx(2.0)
    assert f["predicted_wall_over_theoretical"] == pytest.approx((2 + 15) / (2 + 5) / 3)
    # at exactly the allowed fixed cost the predicted ratio is 0.85
    allowed = f["fixed_ms_allowed_at_0.85"]
    edge = [{**r, "step_ms": allowed + 0.5 * r["mean_layers"]} for r in fake]
    assert va.fit_fixed_cost(edge, ["v"], 30, 10.0)[1]["v"]["predicted_wall_over_theoretical"] == pytest.approx(0.85)
    assert len(lines) == 3 and lines[2].startswith("| v | 0.500 | 2.00 |")
    assert va.fit_fixed_cost(fake[:1], ["v"], 30, 10.0) == ([], {})  # one point: no line
