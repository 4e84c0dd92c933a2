"""benchmarks/quant_delta.py: the share of a fine-tuning delta that survives int8 / int4."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_model
from conftest import load_benchmark
from skipdecode.adapters import get_adapter


def _moved(model, scale: float, seed: int = 0):
    """A copy of ``model`` whose decoder-layer linears moved by ``scale`` x their own std (noise)."""
    g = torch.Generator().manual_seed(seed)
    fine = copy.deepcopy(model)
    with torch.no_grad():
        for layer in get_adapter(fine).layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight += scale * m.weight.std() * torch.randn(m.weight.shape, generator=g)
    return fine


def _on_int4_grid(model):
    """``model`` with its decoder linears rounded to the int4 grid (like a GGUF Q4 base model)."""
    from skipdecode.quantize import Int4Linear

    with torch.no_grad():
        for layer in get_adapter(model).layers:
            for m in layer.modules():
                if isinstance(m, torch.nn.Linear):
                    m.weight.copy_(Int4Linear(m.weight, kernel=False).dequantized())
    return model


def test_a_small_delta_from_a_4_bit_base_is_erased_by_int4_and_kept_by_int8():
    qd = load_benchmark("quant_delta")
    base = _on_int4_grid(make_model("llama"))
    small = qd.delta_survival(_moved(base, 0.01), base)  # far under half an int4 step
    assert small["int4"]["kept_share"] < 0.2 and small["int8"]["kept_share"] > 0.8
    assert small["int4"]["error_norm"] > small["int8"]["error_norm"]
    large = qd.delta_survival(_moved(base, 1.0), base)  # a change far above the int4 step survives
    assert large["int4"]["kept_share"] > 0.9 and large["int8"]["kept_share"] > 0.99
    off_grid = qd.delta_survival(_moved(make_model("llama"), 0.01), make_model("llama"))
    assert off_grid["int4"]["kept_share"] > 0.5  # a float base: the error is not aimed at the delta
    n = sum(isinstance(m, torch.nn.Linear) for layer in get_adapter(base).layers for m in layer.modules())
    assert small["linears"] == n


def test_equal_or_mismatched_models_are_refused():
    qd = load_benchmark("quant_delta")
    base = make_model("llama")
    with pytest.raises(ValueError, match="no fine-tuning delta"):
        qd.delta_survival(copy.deepcopy(base), base)
    with pytest.raises(ValueError, match="same decoder linears"):
        qd.delta_survival(make_model("llama", num_layers=4), base)


def test_cli_bad_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    qd = load_benchmark("quant_delta")
    assert qd.main(["--ckpt", str(tmp_path / "missing"), "--output", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and "missing" in err
