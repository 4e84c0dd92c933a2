"""``benchmarks/stock_warmup_probe.py``: its ``--keep-delta`` patch (the adapter kept on at the
static loop's full-depth decode steps, restored on exit) and its option parsing."""

from __future__ import annotations

import importlib

import pytest
import torch

from test_decode_only_adapter import decode_only_dir  # noqa: F401  (fixture)
from conftest import load_benchmark
from test_skip_adapter import NUM_LAYERS, adapter_dir, base_dir  # noqa: F401  (fixtures; decode_only_dir needs adapter_dir)
from skipdecode import load
from skipdecode.policy import LinearDecayPolicy

WARM = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=2, warmup_layers=1, horizon=4,
                         full_depth_steps=2)


@pytest.fixture(scope="module")
def script():
    return load_benchmark("stock_warmup_probe")


def test_keep_delta_runs_the_adapted_weights_at_full_depth_steps(script, base_dir, decode_only_dir):  # noqa: F811
    """Outside the patch, the full-depth first steps write the base model's tokens; inside it,
    other ones (the adapter on); the patched function is restored."""
    only = load(str(base_dir), adapter=str(decode_only_dir))
    gen = importlib.import_module("skipdecode.generate")
    before = gen.skip_forward
    kw = dict(policy=WARM, max_new_tokens=3, chat=False)
    with torch.no_grad():
        stock_steps = only.generate("name[The Eagle]", **kw)
        with script.delta_kept_at_full_depth_steps(only.model):
            kept = only.generate("name[The Eagle]", **kw)
    assert gen.skip_forward is before
    plain = load(str(base_dir), adapter=False)
    # token 0 comes from the base prefill either way; token 1 from a full-depth decode step
    assert list(stock_steps.token_ids[0][:2]) == list(plain.generate("name[The Eagle]", **kw).token_ids[0][:2])
    assert kept.token_ids[0][0] == stock_steps.token_ids[0][0]
    assert list(kept.token_ids[0]) != list(stock_steps.token_ids[0])  # the patch changes what the steps run


def test_ks_option_refuses_bad_values(script, capsys):
    assert script._k_list("0,2,8") == [0, 2, 8]
    for bad in ("", "x", "2,-1"):
        with pytest.raises(SystemExit) as exc:
            script.main(["--ks", bad])
        assert exc.value.code == 2
        assert "argument --ks: takes comma-separated integers >= 0" in capsys.readouterr().err
