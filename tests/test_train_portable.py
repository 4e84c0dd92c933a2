"""Training records name no absolute path (``skipdecode.paths.portable_here``): the data as
``$SKIPDECODE_DATA/...``, the run and a local starting model relative to the current directory,
in ``train_record.json``, ``final/skipdecode.json``, every checkpoint's ``skipdecode.json`` and
``state.json`` and the printed summary. Resume compares paths by where they lead and data by the
sha256 of their token ids, so the same file or teacher spelt otherwise is accepted, other data
are refused naming both files, and checkpoints that recorded absolute paths still resume.
Tiny random models, offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_train import Killed, cfg, examples, tiny_skipmodel

import skipdecode
from skipdecode.train import TrainConfigError, latest_checkpoint, train


def _write_pairs(path: Path, pairs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in pairs))
    return path


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working folder (the current directory) holding the base model, and a data folder
    elsewhere (``$SKIPDECODE_DATA``) holding ``pairs.jsonl``."""
    work, data = tmp_path / "work", tmp_path / "data"  # not ../shared/data: that would be written so
    work.mkdir()
    tiny_skipmodel().save_pretrained(work / "base")
    _write_pairs(data / "pairs.jsonl", examples())
    monkeypatch.setenv("SKIPDECODE_DATA", str(data))
    monkeypatch.chdir(work)
    return tmp_path


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def _absolute(obj, root: Path) -> list[str]:
    return [s for s in _strings(obj) if str(root) in s]


def _cli(args):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    return CliRunner().invoke(app, ["train", *args, "--no-progress", "--val-fraction", "0", "--batch-size", "2",
                                    "--speedup", "2"])


@pytest.mark.parametrize("lora", [False, True])
def test_records_of_a_run_name_no_absolute_path(place, lora):
    """The user's case: ``--data pairs.jsonl`` found in the data folder, a local ``--model`` folder
    and ``--out`` given absolute; a LoRA run's ``final/`` still loads its base from here. Every
    JSON and Markdown file of the run is checked (peft's adapter_config.json and model card too)."""
    out = place / "work" / "runs" / "r"
    res = _cli(["--model", str(place / "work" / "base"), "--data", "pairs.jsonl", "--max-steps", "2", "--checkpoint-every", "1",
                "--keep-checkpoints", "2", "--out", str(out)] + (["--lora-r", "4"] if lora else []))
    assert res.exit_code == 0, res.output
    files = [out / "train_record.json", out / "final" / "skipdecode.json"]
    for ckpt in sorted(out.glob("checkpoint-*")):
        files += [ckpt / "skipdecode.json", ckpt / "train_state" / "state.json"]
    assert len(files) == 6 and all(f.is_file() for f in files)
    written = [f for f in out.rglob("*") if f.suffix in (".json", ".md")]
    assert len(written) > len(files)
    for f in written:
        assert str(place) not in f.read_text(), f
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert _absolute(summary, place) == []
    record = json.loads((out / "train_record.json").read_text())
    assert record["data"]["path"] == "$SKIPDECODE_DATA/pairs.jsonl" and record["data"]["spec"] == "pairs.jsonl"
    assert record["out_dir"] == "runs/r" and record["config"]["out_dir"] == "runs/r"
    meta = json.loads((out / "final" / "skipdecode.json").read_text())
    assert meta["base_model"] == "base" and meta["data"]["path"] == "$SKIPDECODE_DATA/pairs.jsonl"
    if lora:
        adapter = json.loads((out / "final" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == "base"
    assert skipdecode.load("runs/r/final", adapter=False).num_layers == 6  # a LoRA run finds its base


def test_a_base_model_is_recorded_loadable(tmp_path, monkeypatch):
    """A LoRA adapter's ``base_model`` is where ``load`` finds its base: relative when it lies
    under the current directory, absolute (no ``$SKIPDECODE_DATA/``) when only the data folder's
    form would name it."""
    from skipdecode.paths import loadable_path, portable_here

    (tmp_path / "work" / "m").mkdir(parents=True)
    (tmp_path / "data" / "m").mkdir(parents=True)
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path / "work")
    assert loadable_path(tmp_path / "work" / "m") == "m" and loadable_path("m") == "m"
    assert portable_here(str(tmp_path / "data" / "m")) == "$SKIPDECODE_DATA/m"
    assert loadable_path(tmp_path / "data" / "m") == str((tmp_path / "data" / "m").resolve())
    assert loadable_path("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def _killed_at_1(out: Path, data, **kw):
    def kill(info):
        if info["step"] == 1:
            raise Killed

    with pytest.raises(Killed):
        train(tiny_skipmodel(), data, cfg(out, max_steps=2, checkpoint_every=1, **kw), callback=kill)
    return latest_checkpoint(out)


def test_resume_accepts_the_same_data_spelt_otherwise_and_names_other_data(place):
    data_dir = place / "data"
    ckpt = _killed_at_1(Path("runs/a"), "pairs.jsonl")  # found in the data folder
    assert json.loads((ckpt / "skipdecode.json").read_text())["data"]["path"] == "$SKIPDECODE_DATA/pairs.jsonl"
    # other data: refused, naming the checkpoint's file and this run's, with their sha256
    other = _write_pairs(place / "work" / "other.jsonl", examples()[:5])
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), str(other), cfg("runs/a", max_steps=2, checkpoint_every=1, resume=True))
    message = str(info.value)
    assert info.value.field == "resume" and message.startswith("resume cannot continue with other training data: ")
    assert f"{ckpt} trained on $SKIPDECODE_DATA/pairs.jsonl (sha256 " in message
    assert "this run reads other.jsonl (sha256 " in message
    # the same data given by its absolute path: accepted, the run finishes
    result = train(tiny_skipmodel(), str(data_dir / "pairs.jsonl"),
                   cfg("runs/a", max_steps=2, checkpoint_every=1, resume=True))
    assert result.steps == 2 and result.resumed_from.endswith("checkpoint-00000001")
    # the file changed in place: refused, saying so with both sha256
    ckpt = _killed_at_1(Path("runs/b"), "pairs.jsonl")
    _write_pairs(data_dir / "pairs.jsonl", examples()[1:])
    with pytest.raises(TrainConfigError, match=r"\$SKIPDECODE_DATA/pairs.jsonl changed since .*checkpoint-00000001 "
                                               r"was written \(sha256 \w{12}\.\.\. then, sha256 \w{12}\.\.\. now\)"):
        train(tiny_skipmodel(), "pairs.jsonl", cfg("runs/b", max_steps=2, checkpoint_every=1, resume=True))


def test_resume_compares_a_teacher_path_by_where_it_leads(place):
    """A KL teacher given absolute, then relative, is the same setting; so is the absolute path an
    older checkpoint recorded (its state.json rewritten, checksums renewed); another teacher is not."""
    from skipdecode.training.checkpoint import CHECKSUMS, STATE_DIR, _write_checksums

    teacher = place / "work" / "base"
    kw = dict(kl_weight=0.5, max_steps=2, checkpoint_every=1)
    ckpt = _killed_at_1(Path("runs/t"), examples(), teacher=str(teacher), kl_weight=0.5)
    state = json.loads((ckpt / STATE_DIR / "state.json").read_text())
    assert state["config"]["teacher"] == "base"  # portable
    # an older checkpoint recorded the absolute path
    state["config"]["teacher"] = str(teacher)
    (ckpt / STATE_DIR / "state.json").write_text(json.dumps(state))
    (ckpt / STATE_DIR / CHECKSUMS).unlink()
    _write_checksums(ckpt)
    tiny_skipmodel().save_pretrained(place / "work" / "other")
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg("runs/t", resume=True, teacher="other", **kw))
    assert info.value.field == "teacher"
    result = train(tiny_skipmodel(), examples(), cfg("runs/t", resume=True, teacher="base", **kw))
    assert result.steps == 2
