"""Position-weighted training loss (``TrainConfig.position_half_life``, ``--position-half-life``)."""

from __future__ import annotations

import pytest
import torch

from skipdecode.policy import for_speedup
from skipdecode.train import TrainConfigError, tokenize_examples, train
from skipdecode.training.loss import position_weights

from test_train import cfg, examples, per_token_ce, tiny_skipmodel, weights


def test_weights_halve_every_half_life_tokens_and_restart_per_row():
    w = position_weights([3, 2], 1.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 0.5, 0.25, 1.0, 0.5]))
    w = position_weights([5], 2.0)
    assert w[2].item() == pytest.approx(0.5) and w[4].item() == pytest.approx(0.25)
    assert position_weights([3, 2], None) is None
    assert position_weights([], 4.0).numel() == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "8"])
def test_bad_half_life_is_refused(bad):
    with pytest.raises(ValueError, match="half_life"):
        position_weights([2], bad)


@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), float("inf"), "8", True])
def test_config_names_the_field(tmp_path, bad):
    with pytest.raises(TrainConfigError) as info:
        cfg(tmp_path, position_half_life=bad)
    assert info.value.field == "position_half_life"


def test_logged_loss_is_the_position_weighted_mean(tmp_path, tokenizer):
    """One step with a half-life of 2 tokens logs sum_i 2^(-i/2) ce_i / sum_i 2^(-i/2) over every
    response token i of every row (computed here directly, one row at a time), not the plain mean."""
    exs = examples()
    original = tiny_skipmodel()
    reference = weights(original.model)
    result = train(original, exs, cfg(tmp_path / "run", max_steps=1, batch_size=len(exs), position_half_life=2.0))
    policy = for_speedup(6, 2.0, result.horizon)
    sk = tiny_skipmodel()
    sk.model.load_state_dict(reference)
    items = tokenize_examples(tokenizer, exs, chat=True, max_length=256)[0]
    weighted = total_w = plain = 0.0
    n = 0
    for ce in per_token_ce(sk, items, policy):
        w = torch.tensor([2.0 ** (-i / 2.0) for i in range(len(ce))])
        weighted += float((w * ce).sum())
        total_w += float(w.sum())
        plain += float(ce.sum())
        n += len(ce)
    logged = result.train_log[0]["loss"]
    assert logged == pytest.approx(weighted / total_w, abs=1e-5)
    assert abs(logged - plain / n) > 1e-3  # the weighting is visible


def test_weighted_kl_and_gradient_reach_the_model(tmp_path):
    """With a KL teacher the half-life changes the update: a long half-life (weights ~ 1) gives the
    unweighted run's parameters, a short one other parameters."""
    def run(name, **kw):
        sk = tiny_skipmodel()
        train(sk, examples(), cfg(tmp_path / name, max_steps=2, kl_weight=0.5, teacher=None, **kw))
        return weights(sk.model)

    plain, long_, short = run("plain"), run("long", position_half_life=1e9), run("short", position_half_life=1.0)
    for k in plain:
        torch.testing.assert_close(long_[k], plain[k], atol=1e-6, rtol=1e-5)
    assert any(not torch.allclose(short[k], plain[k], atol=1e-6) for k in plain)


def test_resume_refuses_another_half_life(tmp_path):
    class Killed(Exception):
        pass

    def kill(info):
        if info["step"] == 2:
            raise Killed

    settings = dict(max_steps=4, checkpoint_every=2)
    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", position_half_life=4.0, **settings), callback=kill)
    with pytest.raises(TrainConfigError) as info:  # same settings but the half-life
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", resume=True, position_half_life=8.0, **settings))
    assert info.value.field == "position_half_life"
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", resume=True, position_half_life=4.0, **settings))
    assert result.steps == 4 and result.resumed_from.endswith("checkpoint-00000002")
