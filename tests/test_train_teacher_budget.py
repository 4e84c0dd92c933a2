"""Two trainer options of the recipe study: a KL teacher other than the starting model
(``TrainConfig.teacher``) and a wall-clock budget that still saves the model (``max_minutes``).
Tiny random models, offline."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tokenizer
from test_train import cfg, examples, tiny_skipmodel

from skipdecode.model import SKIP_CONFIG_NAME, SkipModel
from skipdecode.policy import FullPolicy, for_speedup
from skipdecode.train import (
    TrainConfig,
    TrainConfigError,
    collate,
    latest_checkpoint,
    teacher_forced_logits,
    tokenize_examples,
    train,
)


class Killed(RuntimeError):
    pass


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny llama with other random weights than the student (seed 1), same tokenizer."""
    path = tmp_path_factory.mktemp("teacher") / "model"
    tiny_skipmodel(seed=1).save_pretrained(path)
    return path


def _kl_per_token(student: SkipModel, teacher: SkipModel, horizon: int) -> float:
    """KL(teacher || student) per response token over all of ``examples()``, computed directly:
    the student under the 2x policy, the teacher at full depth."""
    batch = collate(tokenize_examples(student.tokenizer, examples(), chat=True, max_length=256)[0])
    with torch.no_grad():
        s, _ = teacher_forced_logits(student.adapter, batch, for_speedup(6, 2.0, horizon), targets_only=True)
        t, _ = teacher_forced_logits(teacher.adapter, batch, FullPolicy(6), targets_only=True)
    kl = F.kl_div(F.log_softmax(s.float(), -1), F.log_softmax(t.float(), -1), log_target=True, reduction="sum")
    return float(kl) / s.shape[0]


@pytest.mark.parametrize("lora_r", [0, 4])
def test_kl_uses_the_given_teacher(tmp_path, teacher_dir, lora_r):
    """Step 1 sees the whole data set in one batch, so its logged KL is the KL over all examples
    between the (untrained) student and the teacher: the given model's, not the start model's."""
    import skipdecode

    settings = dict(kl_weight=0.5, batch_size=len(examples()), max_steps=1, lora_r=lora_r)
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", teacher=str(teacher_dir), **settings))
    logged = result.train_log[0]["kl"]
    expected = _kl_per_token(tiny_skipmodel(), skipdecode.load(teacher_dir), result.horizon)
    assert logged == pytest.approx(expected, rel=1e-4)
    from_start = _kl_per_token(tiny_skipmodel(), tiny_skipmodel(), result.horizon)  # today's teacher
    assert abs(from_start - expected) > 0.1 * expected
    default = train(tiny_skipmodel(), examples(), cfg(tmp_path / "default", **settings))
    assert default.train_log[0]["kl"] == pytest.approx(from_start, rel=1e-4)
    meta = json.loads((tmp_path / "run" / "final" / SKIP_CONFIG_NAME).read_text())
    assert meta["training"]["teacher"] == str(teacher_dir)


def test_bad_teacher_is_one_line_naming_teacher(tmp_path):
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", kl_weight=0.5, teacher=str(tmp_path / "nope")))
    assert info.value.field == "teacher" and "\n" not in str(info.value)
    assert str(tmp_path / "nope") in str(info.value)
    with pytest.raises(TrainConfigError) as info:  # a teacher without KL would be silently unused
        cfg(tmp_path / "run", teacher="x")
    assert info.value.field == "teacher" and "kl_weight" in str(info.value)


def test_teacher_with_another_vocabulary_is_refused(tmp_path):
    tok = make_tokenizer()
    tok.add_tokens(["<extra-token>"])
    SkipModel(tiny_skipmodel(seed=1).model, tok).save_pretrained(tmp_path / "other")
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", kl_weight=0.5, teacher=str(tmp_path / "other")))
    assert info.value.field == "teacher" and "vocabulary" in str(info.value) and "\n" not in str(info.value)


def test_resume_refuses_another_teacher(tmp_path, teacher_dir):
    settings = dict(kl_weight=0.5, max_steps=3, checkpoint_every=1)

    def kill(info):
        if info["step"] == 1:
            raise Killed

    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", teacher=str(teacher_dir), **settings),
              callback=kill)
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", resume=True, **settings))
    assert info.value.field == "teacher"
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", resume=True, teacher=str(teacher_dir),
                                                     **settings))
    assert result.steps == 3 and result.resumed_from.endswith("checkpoint-00000001")


def test_cli_bad_teacher_exits_2_naming_the_option(tmp_path):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples()))
    model = tmp_path / "model"
    tiny_skipmodel().save_pretrained(model)
    res = CliRunner().invoke(app, ["train", "--model", str(model), "--data", str(data), "--speedup", "2",
                                   "--max-steps", "1", "--out", str(tmp_path / "run"), "--kl-weight", "0.5",
                                   "--teacher", str(tmp_path / "missing"), "--no-progress"])
    assert res.exit_code == 2
    assert "--teacher" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["train", "--model", str(model), "--data", str(data), "--speedup", "2",
                                   "--out", str(tmp_path / "run2"), "--max-minutes", "0", "--no-progress"])
    assert res.exit_code == 2 and "--max-minutes" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["train", "--model", str(model), "--data", str(data), "--speedup", "2",
                                   "--max-steps", "4", "--batch-size", "2", "--out", str(tmp_path / "run3"),
                                   "--max-minutes", "0.000001", "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["stopped_on_budget"] is True and summary["total_steps"] == 4


# ---------------------------------------------------------------------------------------------
# max_minutes
# ---------------------------------------------------------------------------------------------


def test_budget_stops_early_and_still_saves_the_model(tmp_path):
    """A budget far below one step: the run stops after step 1 of 5, validates, saves final/ and
    records why; the LR schedule was planned over the 5 steps (it ended mid-schedule)."""
    import skipdecode

    sk = tiny_skipmodel()
    result = train(sk, examples(), cfg(tmp_path / "run", max_steps=5, max_minutes=1e-6, lr_scheduler="linear"),
                   val_data=examples()[:2])
    assert result.steps == 1 and result.total_steps == 5
    assert result.stopped_on_budget and result.stopped_at_step == 1
    assert [v["step"] for v in result.val_log] == [0, 1]
    record = json.loads((tmp_path / "run" / "train_record.json").read_text())
    assert record["stopped_on_budget"] is True and record["stopped_at_step"] == 1 and record["steps"] == 1
    assert record["train_seconds_total"] == pytest.approx(result.train_log[0]["seconds"])
    meta = json.loads((tmp_path / "run" / "final" / SKIP_CONFIG_NAME).read_text())
    assert meta["training"]["step"] == 1 and meta["training"]["stopped_on_budget"] is True
    saved = skipdecode.load(tmp_path / "run" / "final")
    for k, v in sk.model.state_dict().items():  # final/ holds the trained weights of step 1
        torch.testing.assert_close(saved.model.state_dict()[k], v, rtol=0, atol=0)
    # without a budget the same settings run all 5 steps and say so
    full = train(tiny_skipmodel(), examples(), cfg(tmp_path / "full", max_steps=5, lr_scheduler="linear"))
    assert full.steps == 5 and not full.stopped_on_budget and full.stopped_at_step is None


def test_resume_counts_the_minutes_already_spent(tmp_path):
    settings = dict(max_steps=4, checkpoint_every=1)

    def kill(info):
        if info["step"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", **settings), callback=kill)
    ckpt = latest_checkpoint(tmp_path / "run")
    state = json.loads((ckpt / "train_state" / "state.json").read_text())
    spent = state["train_seconds"]
    assert spent == pytest.approx(sum(r["seconds"] for r in state["train_log"])) and spent > 0
    # a budget of half the time already spent: the resumed run does no step and saves the model
    budget = spent / 60 / 2
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", resume=True, max_minutes=budget, **settings))
    assert result.steps == 2 and result.stopped_on_budget and result.stopped_at_step == 2
    assert result.train_seconds_total == pytest.approx(spent)
    assert (tmp_path / "run" / "final").is_dir()


def test_max_minutes_is_validated(tmp_path):
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(TrainConfigError) as info:
            TrainConfig(out_dir=str(tmp_path), speedup=2.0, max_minutes=bad)
        assert info.value.field == "max_minutes"
