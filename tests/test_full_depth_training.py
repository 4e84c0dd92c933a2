"""Full-depth first steps in training and in the shipped schedule: ``TrainConfig.full_depth_steps``
(``skipdecode train --full-depth-steps``) trains the schedule that inference runs, and
``install_adapter(horizon=)`` / :func:`skipdecode.skip_adapter.reschedule_adapter` change an
installed adapter's schedule without retraining, recorded in its ``skipdecode.json``.
The loss itself is checked against decoding in ``tests/test_base_prefill.py``."""

from __future__ import annotations

import json
import shutil

import pytest

from skipdecode import LinearDecayPolicy, load
from skipdecode import skip_adapter as sa
from skipdecode.train import TrainConfigError, build_policies
from test_skip_adapter import NUM_LAYERS, base_dir  # noqa: F401  (a fixture)
from test_train import cfg
from test_trained_schedule import CUSTOM, custom_run  # noqa: F401  (a fixture)


def test_config_puts_full_depth_steps_on_linear_decay_schedules(tmp_path):
    c = cfg(tmp_path / "a", speedup=None, max_layers=5, min_layers=2, full_depth_steps=3)
    (label, policy), = build_policies(c, 6, 4)
    assert label == "custom" and policy == LinearDecayPolicy(6, 5, 2, 1, 4, 3)
    assert [policy.budget(t) for t in (1, 2, 3, 4)] == [6, 6, 6, LinearDecayPolicy(6, 5, 2, 1, 4).budget(1)]
    mixed = build_policies(cfg(tmp_path / "b", speedup=None, speedups=(1, 2), full_depth_steps=2), 6, 4)
    assert mixed[0][1].budget(5) == 6  # full depth stays full depth
    assert mixed[1][1].full_depth_steps == 2
    assert build_policies(cfg(tmp_path / "c"), 6, 4)[0][1].full_depth_steps == 0  # the default: the paper's
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(TrainConfigError) as info:
            cfg(tmp_path / "d", full_depth_steps=bad)
        assert info.value.field == "full_depth_steps", bad


def test_cli_train_with_full_depth_steps_records_them_and_decodes_with_them(tmp_path):
    from typer.testing import CliRunner

    from skipdecode.cli import app
    from test_prompt_grad import cli_train_args

    base = cli_train_args(tmp_path) + ["--lora-r", "2", "--no-prompt-grad", "--base-prefill"]
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "bad"), "--full-depth-steps", "-1"])
    assert res.exit_code == 2 and "--full-depth-steps" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run"), "--full-depth-steps", "2"])
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "run" / "final" / "skipdecode.json").read_text())
    assert saved["policy"]["full_depth_steps"] == 2 and saved["training"]["config"]["full_depth_steps"] == 2
    sk = load(str(tmp_path / "run" / "final"))
    assert sk.policy.full_depth_steps == 2 and sk.policy.budget(2) == sk.num_layers


def test_install_with_a_shipped_horizon(tmp_path, custom_run):
    target = sa.install_adapter(custom_run, name="h", target_root=tmp_path, as_speedup=2, full_depth_steps=1,
                                horizon=2)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policies"]["2"]["horizon"] == meta["policy"]["horizon"] == 2
    assert meta["storage"]["horizon_changed"] == {"horizon": 2, "trained_with": CUSTOM.horizon}
    assert meta["storage"]["full_depth_steps_added"] == {"k": 1, "trained_with": 0}
    with pytest.raises(ValueError, match="horizon"):
        sa.install_adapter(custom_run, name="bad", target_root=tmp_path, horizon=0)
    assert not (tmp_path / "bad").exists()


def test_install_and_reschedule_with_another_floor(tmp_path, custom_run, base_dir, monkeypatch, capsys):
    """A run trained with one floor ships with another (``min_layers``, ``--ship-min-layers``):
    every linear-decay schedule of the installed copy gets it, the change is recorded with the
    trained value, a floor outside [warm-up layers, max layers] is refused naming the option."""
    target = sa.install_adapter(custom_run, name="m", target_root=tmp_path, as_speedup=2, min_layers=3)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policies"]["2"]["min_layers"] == meta["policy"]["min_layers"] == 3 != CUSTOM.min_layers
    assert meta["storage"]["min_layers_changed"] == {"min_layers": 3, "trained_with": CUSTOM.min_layers}
    policy = load(str(base_dir), adapter=str(target)).policy_for(speedup=2)
    assert policy == LinearDecayPolicy(NUM_LAYERS, CUSTOM.max_layers, 3, 1, CUSTOM.horizon)
    with pytest.raises(ValueError, match="min_layers must be in"):
        sa.install_adapter(custom_run, name="bad", target_root=tmp_path, min_layers=CUSTOM.max_layers + 1)
    assert not (tmp_path / "bad").exists()
    sa.reschedule_adapter(target, min_layers=4)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policy"]["min_layers"] == 4 and meta["storage"]["min_layers_changed"]["trained_with"] == CUSTOM.min_layers
    from conftest import load_benchmark

    monkeypatch.setattr(sa, "SHIPPED_DIR", tmp_path)
    (tmp_path / "smollm2-135m-instruct").symlink_to(target)
    script = load_benchmark("train_adapter")
    assert script.main(["--reschedule", "--ship-min-layers", "2"]) == 0
    assert json.loads((target / "skipdecode.json").read_text())["policy"]["min_layers"] == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        script.main(["--reschedule", "--ship-min-layers", "0"])
    assert exc.value.code == 2 and "error: --reschedule: --ship-min-layers must be in" in capsys.readouterr().err


def test_reschedule_adapter_changes_an_installed_schedule_in_place(tmp_path, custom_run, base_dir):
    target = sa.install_adapter(custom_run, name="r", target_root=tmp_path, as_speedup=2)
    changes = sa.reschedule_adapter(target, full_depth_steps=3, horizon=2, note="chosen by a probe")
    assert changes["full_depth_steps_added"] == {"k": 3, "trained_with": 0, "note": "chosen by a probe"}
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["storage"]["horizon_changed"]["horizon"] == 2 and meta["policy"]["full_depth_steps"] == 3
    policy = load(str(base_dir), adapter=str(target)).policy_for(speedup=2)
    assert policy == LinearDecayPolicy(NUM_LAYERS, CUSTOM.max_layers, CUSTOM.min_layers, 1, 2, 3)
    # a second change keeps what the run was trained with
    sa.reschedule_adapter(target, horizon=3)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["storage"]["horizon_changed"] == {"horizon": 3, "trained_with": CUSTOM.horizon}
    before = (target / "skipdecode.json").read_text()
    for kw, match in (({"full_depth_steps": -2}, "full_depth_steps"), ({"horizon": 0}, "horizon")):
        with pytest.raises(ValueError, match=match):
            sa.reschedule_adapter(target, **kw)
    with pytest.raises(sa.AdapterError, match="needs full_depth_steps, horizon or min_layers"):
        sa.reschedule_adapter(target)
    with pytest.raises(sa.AdapterError, match="skipdecode.json"):
        sa.reschedule_adapter(tmp_path / "nowhere", horizon=2)
    assert (target / "skipdecode.json").read_text() == before  # nothing written on a refusal


def test_train_adapter_reschedule_edits_the_package_copy(tmp_path, custom_run, monkeypatch, capsys):
    from conftest import load_benchmark

    root = tmp_path / "pkg"
    sa.install_adapter(custom_run, name="smollm2-135m-instruct", target_root=root, as_speedup=2)
    monkeypatch.setattr(sa, "SHIPPED_DIR", root)
    script = load_benchmark("train_adapter")
    assert script.main(["--reschedule", "--full-depth-steps", "2", "--ship-horizon", "3", "--note", "n"]) == 0
    meta = json.loads((root / "smollm2-135m-instruct" / "skipdecode.json").read_text())
    assert meta["policy"]["horizon"] == 3 and meta["storage"]["full_depth_steps_added"]["note"] == "n"
    capsys.readouterr()
    for args, words in ((["--ship-horizon", "0"], "error: --reschedule: --ship-horizon must be >= 1"),
                        (["--full-depth-steps", "-1"], "error: --reschedule: --full-depth-steps must be >= 0")):
        with pytest.raises(SystemExit) as exc:
            script.main(["--reschedule", *args])
        assert exc.value.code == 2 and words in capsys.readouterr().err
    # the same value again without --note keeps the stored note; another value drops it
    assert script.main(["--reschedule", "--full-depth-steps", "2"]) == 0
    storage = json.loads((root / "smollm2-135m-instruct" / "skipdecode.json").read_text())["storage"]
    assert storage["full_depth_steps_added"]["note"] == "n"
    assert script.main(["--reschedule", "--full-depth-steps", "3"]) == 0
    storage = json.loads((root / "smollm2-135m-instruct" / "skipdecode.json").read_text())["storage"]
    assert "note" not in storage["full_depth_steps_added"] and storage["horizon_changed"]["note"] == "n"
    shutil.rmtree(root)
    with pytest.raises(SystemExit) as exc:
        script.main(["--reschedule", "--ship-horizon", "3"])
    assert exc.value.code == 2 and "skipdecode.json" in capsys.readouterr().err
