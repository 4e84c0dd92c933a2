"""A warning, not a silent 20x slowdown: bfloat16 on an x86 CPU without AVX-512
(``skipdecode.loading.slow_bfloat16_cpu``), for ``load(dtype="bfloat16")`` and bf16 training."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

import skipdecode
from skipdecode.loading import slow_bfloat16_cpu
from skipdecode.train import train

from test_train import cfg, examples, tiny_skipmodel


def _cpu(monkeypatch, machine: str, capability: str) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)


@pytest.mark.parametrize("machine,capability,slow", [
    ("x86_64", "AVX2", True), ("AMD64", "NO AVX", True), ("x86_64", "DEFAULT", True),
    ("x86_64", "AVX512", False), ("aarch64", "DEFAULT", False), ("arm64", "SVE256", False),
])
def test_only_x86_below_avx512_is_judged_slow(monkeypatch, machine, capability, slow):
    _cpu(monkeypatch, machine, capability)
    reason = slow_bfloat16_cpu()
    assert (reason is not None) == slow
    if slow:
        assert capability in reason and "float32" in reason


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "model"
    tiny_skipmodel().save_pretrained(path)
    return path


def test_load_in_bfloat16_warns_on_a_slow_cpu_and_still_loads(monkeypatch, caplog, saved):
    _cpu(monkeypatch, "x86_64", "AVX2")
    with caplog.at_level(logging.WARNING, logger="skipdecode"):
        sk = skipdecode.load(saved, dtype="bfloat16")
    assert next(sk.model.parameters()).dtype == torch.bfloat16
    assert any("dtype='bfloat16'" in r.getMessage() and "AVX2" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skipdecode"):
        skipdecode.load(saved)  # float32: no warning
    assert not any("bfloat16" in r.getMessage() for r in caplog.records)
    _cpu(monkeypatch, "x86_64", "AVX512")
    with caplog.at_level(logging.WARNING, logger="skipdecode"):
        skipdecode.load(saved, dtype="bfloat16")
    assert not any("bfloat16" in r.getMessage() for r in caplog.records)


def test_bf16_training_warns_on_a_slow_cpu(monkeypatch, caplog, tmp_path):
    """The warning comes before Accelerate is set up. Accelerate's process-wide state cannot switch
    to bf16 once an earlier test built it without, so the run is stopped right there."""
    import accelerate

    class Stop(Exception):
        pass

    def no_accelerator(*args, **kwargs):
        assert kwargs.get("mixed_precision") == "bf16"
        raise Stop

    monkeypatch.setattr(accelerate, "Accelerator", no_accelerator)  # the trainer imports it at run time
    for capability, warned in (("AVX2", True), ("AVX512", False)):
        _cpu(monkeypatch, "x86_64", capability)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="skipdecode"), pytest.raises(Stop):
            train(tiny_skipmodel(), examples(), cfg(tmp_path / capability, max_steps=1, bf16=True))
        assert any("bf16 autocast" in r.getMessage() and "AVX2" in r.getMessage() for r in caplog.records) == warned
