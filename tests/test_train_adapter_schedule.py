"""``benchmarks/train_adapter.py --max-layers/--min-layers``: an explicit schedule reaches the
trainer as ``TrainConfig.max_layers/min_layers`` (and the policy it trains), and mixing it with
``--speedups`` or giving bad bounds exits 2 with one line naming the option."""

from __future__ import annotations

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("train_adapter")


def test_explicit_schedule_becomes_the_trained_policy(script, tmp_path):
    from skipdecode.policy import LinearDecayPolicy
    from skipdecode.train import TrainConfig
    from skipdecode.training.config import build_policies

    args = script.parse_args(["--out", str(tmp_path / "r"), "--max-layers", "25", "--min-layers", "5"])
    speedups = script._speedups(args)
    assert speedups == ()
    config = script._config(args, TrainConfig, tmp_path / "r", speedups)
    assert (config.speedup, config.speedups, config.max_layers, config.min_layers) == (None, None, 25, 5)
    (label, policy), = build_policies(config, 30, config.horizon)
    assert isinstance(policy, LinearDecayPolicy)
    assert (policy.max_layers, policy.min_layers, policy.horizon, policy.warmup_layers) == (25, 5, 32, 1)
    assert [policy.budget(t) for t in (0, 16, 32, 40)] == [25, 15, 5, 5]


def test_default_is_the_shipped_2x_target(script, tmp_path):
    from skipdecode.train import TrainConfig

    args = script.parse_args(["--out", str(tmp_path / "r")])
    assert script._speedups(args) == (2.0,)
    config = script._config(args, TrainConfig, tmp_path / "r", (2.0,))
    assert (config.speedup, config.max_layers, config.min_layers) == (2.0, None, None)


def test_mixed_or_bad_schedules_exit_2_in_one_line(script, tmp_path, capsys):
    from skipdecode.train import TrainConfig, TrainConfigError

    args = script.parse_args(["--speedups", "2", "--max-layers", "25"])
    with pytest.raises(SystemExit) as exc:
        script._speedups(args)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == "error: give either --speedups or --max-layers/--min-layers, not both"

    with pytest.raises(SystemExit):
        script._speedups(script.parse_args(["--speedups", "two"]))
    assert "--speedups takes comma-separated numbers" in capsys.readouterr().err

    args = script.parse_args(["--out", str(tmp_path / "r"), "--max-layers", "25", "--min-layers", "30"])
    with pytest.raises(TrainConfigError) as info:
        script._config(args, TrainConfig, tmp_path / "r", script._speedups(args))
    with pytest.raises(SystemExit) as exc:
        script._config_error(info.value)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err == "error: --min-layers must be <= --max-layers (25), got 30"

    args = script.parse_args(["--out", str(tmp_path / "r"), "--speedups", "0.5"])
    with pytest.raises(TrainConfigError) as info:  # a bad speedup names only the option given
        script._config(args, TrainConfig, tmp_path / "r", script._speedups(args))
    with pytest.raises(SystemExit):
        script._config_error(info.value)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --speedups must be") and "max-layers" not in err, err
