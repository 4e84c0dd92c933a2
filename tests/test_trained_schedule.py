"""``--speedup S`` runs the schedule a checkpoint was trained with for S
(:meth:`SkipModel.trained_policy`), and ``install_adapter(as_speedup=S)`` /
``train_adapter.py --install --as-speedup S`` records an explicit trained schedule under that label.
Tiny llama and a tiny LoRA adapter built here."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import make_model
from skipdecode import LinearDecayPolicy, SkipModel, for_speedup, load
from skipdecode import skip_adapter as sa
from test_skip_adapter import NUM_LAYERS, _lora_dir, base_dir  # noqa: F401  (a fixture)

# an explicit schedule (train --max-layers 5 --min-layers 2), not the one for_speedup gives for 2x (4 -> 2)
CUSTOM = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


def _model(tokenizer, policies):
    return SkipModel(make_model("llama", NUM_LAYERS), tokenizer, policy=CUSTOM,
                     skip_config={"policies": policies, "horizon": 4})


def test_a_trained_speedup_resolves_to_its_trained_schedule(tokenizer):
    sk = _model(tokenizer, {"2": CUSTOM.to_dict()})
    assert for_speedup(NUM_LAYERS, 2, 4) != CUSTOM  # the test would not tell them apart otherwise
    assert sk.trained_policy(2) == CUSTOM and sk.trained_policy(2.0) == CUSTOM
    assert sk.policy_for(speedup=2) == CUSTOM
    assert sk.policy_for(speedup=2, horizon=4) == CUSTOM  # the trained horizon, given explicitly
    assert sk.policy_for(speedup=2, warmup_layers=1) == CUSTOM


def test_other_speedups_horizons_and_warmups_fall_back_to_for_speedup(tokenizer):
    sk = _model(tokenizer, {"2": CUSTOM.to_dict()})
    assert sk.trained_policy(3) is None and sk.policy_for(speedup=3) == for_speedup(NUM_LAYERS, 3, 4)
    assert sk.policy_for(speedup=2, horizon=8) == for_speedup(NUM_LAYERS, 2, 8)
    assert sk.policy_for(speedup=2, warmup_layers=0) == for_speedup(NUM_LAYERS, 2, 4, warmup_layers=0)
    assert sk.policy_for(speedup=1).budget(1) == NUM_LAYERS  # full depth, never a trained entry
    # a custom label is not a speedup, and no policies at all is the old behaviour
    assert _model(tokenizer, {"custom": CUSTOM.to_dict()}).policy_for(speedup=2) == for_speedup(NUM_LAYERS, 2, 4)
    assert _model(tokenizer, None).policy_for(speedup=2) == for_speedup(NUM_LAYERS, 2, 4)
    for bad in (0.5, float("nan"), True):
        assert sk.trained_policy(bad) is None


def test_a_broken_trained_entry_names_its_label(tokenizer):
    wrong_depth = LinearDecayPolicy(num_layers=8, max_layers=5, min_layers=2, horizon=4).to_dict()
    for entry, what in ((wrong_depth, "num_layers"), ({"type": "zigzag"}, "policy type")):
        with pytest.raises(ValueError, match=rf"policies\['2'\]: .*{what}"):
            _model(tokenizer, {"2": entry}).policy_for(speedup=2)


@pytest.fixture(scope="module")
def custom_run(tmp_path_factory):
    """A finished LoRA run trained with an explicit schedule: its policies say ``custom``."""
    path = _lora_dir(tmp_path_factory.mktemp("run") / "final", zero=False)
    meta = json.loads((path / "skipdecode.json").read_text())
    meta.update(policy=CUSTOM.to_dict(), policies={"custom": CUSTOM.to_dict()}, speedups=None)
    (path / "skipdecode.json").write_text(json.dumps(meta))
    return path


def test_install_as_speedup_makes_speedup_run_the_trained_schedule(tmp_path, custom_run, base_dir):
    plain = sa.install_adapter(custom_run, name="plain", target_root=tmp_path)
    target = sa.install_adapter(custom_run, name="tiny", target_root=tmp_path, as_speedup=2)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policies"] == {"2": CUSTOM.to_dict()}
    assert meta["storage"]["policy_relabelled"] == {"from": "custom", "to": "2"}
    assert "policy_relabelled" not in json.loads((plain / "skipdecode.json").read_text())["storage"]
    relabelled = load(str(base_dir), adapter=str(target))
    assert relabelled.policy_for(speedup=2) == CUSTOM
    assert load(str(base_dir), adapter=str(plain)).policy_for(speedup=2) == for_speedup(NUM_LAYERS, 2, 4)
    from skipdecode.info import describe_policy, info_lines, model_info  # info lists what --speedup 2 runs

    lines = info_lines(model_info(relabelled))
    # 5 - 3 t / 4 rounded half up: 4, 4, 3, 2 at decode steps 1-4
    assert "  --speedup 2:   5 -> 2 of 6 layers over 4 tokens (warm-up 1); decode steps 1-2: 4 layers, 3: 3, 4+: 2" in lines
    # the other targets run the generic schedule, said as such (for_speedup(6, 3, 4) is 3 -> 2)
    generic = describe_policy(for_speedup(NUM_LAYERS, 3, 4).to_dict(), NUM_LAYERS)
    assert f"  --speedup 3:   {generic} (generic; not trained for)" in lines
    assert not any(line.startswith("  --speedup 2:") and "generic" in line for line in lines)
    # what generation runs: the trained schedule's budgets, step by step
    out = relabelled.generate(["name[The Eagle]"], policy=relabelled.policy_for(speedup=2), max_new_tokens=6)
    assert len(out.layers_run) >= 2  # step 2 is where 5 -> 2 and for_speedup's 4 -> 2 differ (4 against 3)
    assert out.layers_run == [CUSTOM.budget(t) for t in range(1, len(out.layers_run) + 1)]


def test_install_as_speedup_refuses_bad_values_and_many_schedules(tmp_path, custom_run):
    for bad in (1, 0.5, float("inf"), "2"):
        with pytest.raises(ValueError, match="as_speedup must be a finite number > 1"):
            sa.install_adapter(custom_run, name="x", target_root=tmp_path, as_speedup=bad)
    two = tmp_path / "two"
    shutil.copytree(custom_run, two)
    meta = json.loads((two / "skipdecode.json").read_text())
    meta["policies"] = {"2": CUSTOM.to_dict(), "3": for_speedup(NUM_LAYERS, 3, 4).to_dict()}
    (two / "skipdecode.json").write_text(json.dumps(meta))
    with pytest.raises(sa.AdapterError, match=r"one schedule.*\['2', '3'\]"):
        sa.install_adapter(two, name="x", target_root=tmp_path, as_speedup=2)
    assert not (tmp_path / "x").exists()  # nothing written on a refusal


def test_train_adapter_as_speedup_is_checked_by_the_parser(capsys):
    from conftest import load_benchmark

    script = load_benchmark("train_adapter")
    assert script.parse_args(["--install", "--as-speedup", "2"]).as_speedup == 2.0
    for bad in ("1", "abc", "inf", "-2"):
        with pytest.raises(SystemExit) as exc:
            script.parse_args(["--install", "--as-speedup", bad])
        assert exc.value.code == 2 and "--as-speedup" in capsys.readouterr().err


def test_install_with_full_depth_steps_adds_them_to_the_schedule(tmp_path, custom_run, base_dir):
    target = sa.install_adapter(custom_run, name="warm", target_root=tmp_path, as_speedup=2, full_depth_steps=2)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policies"]["2"]["full_depth_steps"] == 2 and meta["policy"]["full_depth_steps"] == 2
    assert meta["storage"]["full_depth_steps_added"] == {"k": 2, "trained_with": 0}
    policy = load(str(base_dir), adapter=str(target)).policy_for(speedup=2)
    assert policy.full_depth_steps == 2 and [policy.budget(t) for t in (1, 2)] == [NUM_LAYERS, NUM_LAYERS]
    assert policy.active_layers(3) == CUSTOM.active_layers(1)
    with pytest.raises(ValueError, match="full_depth_steps must be >= 0"):
        sa.install_adapter(custom_run, name="bad", target_root=tmp_path, full_depth_steps=-1)
    assert not (tmp_path / "bad").exists()


def test_a_retimed_default_schedule_leaves_generic_speedups_on_the_checkpoints_horizon(tokenizer):
    """A shipped schedule re-timed without retraining (horizon 2, the run's 4 kept as the
    checkpoint's ``horizon``): ``--speedup 2`` runs it, other speedups keep the checkpoint's
    horizon, explicit bounds keep the default policy's."""
    from dataclasses import replace

    retimed = replace(CUSTOM, horizon=2, full_depth_steps=1)
    sk = SkipModel(make_model("llama", NUM_LAYERS), tokenizer, policy=retimed,
                   skip_config={"policies": {"2": retimed.to_dict()}, "horizon": 4})
    assert sk.horizon == 4 and sk.policy_for(speedup=2) == retimed
    assert sk.policy_for(speedup=3) == for_speedup(NUM_LAYERS, 3, 4)
    assert sk.policy_for(max_layers=4).horizon == 2 and sk.policy_for(max_layers=4, horizon=3).horizon == 3
    # without a saved horizon the default policy's is the default, as before
    plain = SkipModel(make_model("llama", NUM_LAYERS), tokenizer, policy=retimed, skip_config={})
    assert plain.horizon == 2 and plain.policy_for(speedup=3) == for_speedup(NUM_LAYERS, 3, 2)


def test_info_names_the_layers_each_decode_step_runs():
    """`skipdecode info` spells out the budgets (docs/method.md: e(t) = round_half_up(e_max - (e_max -
    e_min) t / T)): with 14 full-depth steps, 25 -> 5 over 4 tokens runs 20, 15, 10, 5 at steps
    15-18, never 25 (the prefill's budget); a long decay names only its first step and floor."""
    from skipdecode.info import describe_policy, layers_by_step
    from skipdecode.policy import LinearDecayPolicy

    shipped = LinearDecayPolicy(30, 25, 5, 1, 4, full_depth_steps=14).to_dict()
    assert layers_by_step(shipped) == "decode steps 1-14: 30 layers, 15: 20, 16: 15, 17: 10, 18+: 5"
    assert describe_policy(shipped, 30).endswith("(warm-up 1); decode steps 1-14: 30 layers, 15: 20, 16: 15, 17: 10, 18+: 5")
    # 14 - 8 t / 32 reaches 6.5 at t = 30 (rounds half up to 7), 6.25 at t = 31
    assert layers_by_step(LinearDecayPolicy(30, 14, 6, 1, 32).to_dict()) == "decode step 1: 14 layers ... 6 from step 31"
    assert layers_by_step(LinearDecayPolicy(6, 5, 5, 1, 4).to_dict()) == "decode steps 1+: 5 layers"
