"""Training and loading faults (issue 13 items 9-12): an output folder that cannot be written is
found before the first step; a missing, empty, truncated or modified checkpoint file on resume is
one error naming the file (CLI: exit 2); checksums recorded at save time catch a flipped byte;
staging folders of killed saves are removed on resume; ``generate --model`` with a corrupt model
or a policy that does not fit it is one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_train import Killed, cfg, cli_run, examples, saved_cli_inputs, tiny_skipmodel

from skipdecode.train import TrainConfig, TrainConfigError, latest_checkpoint, train
from skipdecode.training.checkpoint import CheckpointError

SETTINGS = dict(max_steps=3, checkpoint_every=2, speedup=2.0)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A run killed after its step-2 checkpoint (of 3 steps)."""
    out = tmp_path_factory.mktemp("killed") / "run"

    def kill(info):
        if info["step"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(out, **SETTINGS), callback=kill)
    return out


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst, latest_checkpoint(dst)


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) - 10] ^= 0x01
    p.write_bytes(bytes(data))


FAULTS = {
    "model truncated": ("model.safetensors", _truncate),
    "model empty": ("model.safetensors", lambda p: p.write_bytes(b"")),
    "model byte flipped": ("model.safetensors", _flip),
    "optimizer truncated": ("train_state/optimizer.pt", _truncate),
    "optimizer empty": ("train_state/optimizer.pt", lambda p: p.write_bytes(b"")),
    "rng deleted": ("train_state/rng-0.pt", lambda p: p.unlink()),
    "state empty object": ("train_state/state.json", lambda p: p.write_text("{}")),
    "scheduler garbage": ("train_state/scheduler.pt", lambda p: p.write_bytes(b"not a torch file")),
}


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_resume_names_the_damaged_file(killed_run, tmp_path, fault, checksums):
    """With the checksum record every fault is caught before loading; without it (an older
    checkpoint) each reader still names its file, and a flipped weight byte is caught by the
    weights' sha256 in skipdecode.json (it used to load as a different weight)."""
    run, ckpt = _copy(killed_run, tmp_path)
    rel, damage = FAULTS[fault]
    if not checksums:
        (ckpt / "train_state" / "checksums.json").unlink()
    damage(ckpt / rel)
    with pytest.raises(CheckpointError) as info:
        train(tiny_skipmodel(), examples(), cfg(run, resume=True, **SETTINGS))
    err = info.value
    assert err.field == "resume" and err.path == ckpt / rel, str(err)
    assert rel.split("/")[-1] in str(err) and "\n" not in str(err)


def test_checksums_cover_every_checkpoint_file(killed_run):
    ckpt = latest_checkpoint(killed_run)
    sums = json.loads((ckpt / "train_state" / "checksums.json").read_text())
    files = {str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file()} - {"train_state/checksums.json"}
    assert set(sums) == files and {"model.safetensors", "train_state/optimizer.pt"} <= files


def test_resume_removes_leftover_staging_folders(killed_run, tmp_path):
    run, _ = _copy(killed_run, tmp_path)
    leftover = run / ".checkpoint-tmp-abc123" / "ckpt"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"x" * 100)
    result = train(tiny_skipmodel(), examples(), cfg(run, resume=True, **SETTINGS))
    assert result.steps == 3 and not list(run.glob(".checkpoint-tmp-*"))


def test_out_dir_that_cannot_be_written_fails_before_training(tmp_path, monkeypatch):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    calls = []
    for out in (a_file, a_file / "run"):
        with pytest.raises(TrainConfigError) as info:
            train(tiny_skipmodel(), examples(), cfg(out, max_steps=1), callback=calls.append)
        assert info.value.field == "out_dir" and str(a_file) in str(info.value)
    import skipdecode.training.checkpoint as ck

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ck.tempfile, "mkstemp", denied)  # root ignores chmod, so deny the probe
    with pytest.raises(TrainConfigError, match="Permission denied") as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "ro", max_steps=1), callback=calls.append)
    assert info.value.field == "out_dir" and calls == []  # no step ran


# ---------------------------------------------------------------------------------------------
# CLI: one line, exit 2
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_inputs(tmp_path_factory):
    return saved_cli_inputs(tmp_path_factory.mktemp("cli"))


def test_cli_train_resume_with_a_damaged_file_exits_2(cli_inputs, tmp_path):
    model, data = cli_inputs
    args = ["train", "--model", str(model), "--data", str(data), "--speedup", "2", "--max-steps", "1",
            "--batch-size", "2", "--checkpoint-every", "1", "--no-progress", "--out", str(tmp_path / "run")]
    res, _ = cli_run(args)
    assert res.exit_code == 0, res.output
    res, text = cli_run(args)  # the same command again, without --resume: names the option to add
    assert res.exit_code == 2 and "already holds checkpoints" in text and "continue that run with --resume or" in text
    _truncate(latest_checkpoint(tmp_path / "run") / "train_state" / "optimizer.pt")
    res, text = cli_run(args + ["--resume"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "--resume" in text and "optimizer.pt" in text
    res, text = cli_run(args[:-1] + [str(data)])  # --out naming an existing file
    assert res.exit_code == 2 and "--out" in text and "is a file" in text


def test_cli_generate_with_a_corrupt_model_or_misfit_policy_exits_2(cli_inputs, tmp_path):
    model, _ = cli_inputs
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    _truncate(bad / "model.safetensors")
    res, text = cli_run(["generate", "--model", str(bad), "hello", "-n", "2"])
    assert res.exit_code == 2 and "Traceback" not in res.output and "model.safetensors" in text
    misfit = tmp_path / "misfit"
    shutil.copytree(model, misfit)
    meta = json.loads((misfit / "skipdecode.json").read_text())
    meta["policy"] = {"type": "linear_decay", "num_layers": 30, "max_layers": 20, "min_layers": 10,
                      "warmup_layers": 1, "horizon": 10}
    (misfit / "skipdecode.json").write_text(json.dumps(meta))
    res, text = cli_run(["generate", "--model", str(misfit), "hello", "-n", "2"])
    assert res.exit_code == 2 and "Traceback" not in res.output and "skipdecode.json" in text


def test_loading_a_checkpoint_folder_verifies_its_weights(killed_run, tmp_path):
    """``load(checkpoint folder)`` (``generate --model``) checks the weights' sha256 too, not only
    ``--resume``: from skipdecode.json's ``weights_sha256``, or, for a checkpoint saved before that
    field existed, from the weight entries of ``train_state/checksums.json``."""
    from skipdecode import load
    from skipdecode.loading import LoadError
    from skipdecode.skip_config import TRAIN_CHECKSUMS
    from skipdecode.training.checkpoint import CHECKSUMS, STATE_DIR

    assert TRAIN_CHECKSUMS == f"{STATE_DIR}/{CHECKSUMS}"
    for older in (False, True):
        _, ckpt = _copy(killed_run, tmp_path / str(older))
        meta = json.loads((ckpt / "skipdecode.json").read_text())
        assert set(meta["weights_sha256"]) == {"model.safetensors"}
        if older:  # as written before skipdecode.json recorded the weights' sums
            del meta["weights_sha256"]
            (ckpt / "skipdecode.json").write_text(json.dumps(meta))
        load(ckpt)
        _flip(ckpt / "model.safetensors")
        with pytest.raises(LoadError, match=r"model\.safetensors: its sha256 differs from the one recorded"):
            load(ckpt)


def test_a_run_refused_before_writing_leaves_no_empty_out_dir(tmp_path):
    """The out folder (and its parents) that a refused run created are removed again; a folder that
    existed before, or one that holds anything, is kept."""
    from skipdecode.data import DataError

    out = tmp_path / "new" / "deeper" / "run"
    with pytest.raises(DataError):
        train(tiny_skipmodel(), str(tmp_path / "missing.jsonl"), cfg(out))
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    (kept / "run").mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    with pytest.raises(DataError):
        train(tiny_skipmodel(), str(tmp_path / "missing.jsonl"), cfg(kept / "run"))
    assert (kept / "run").is_dir() and (kept / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_cli_train_interrupted_says_how_to_resume_and_keeps_n_checkpoints(cli_inputs, tmp_path, monkeypatch, how):
    """Ctrl-C or SIGTERM after step 3 ends ``skipdecode train`` with exit 130 and one line naming the
    newest checkpoint and --resume; --keep-checkpoints 2 kept the two newest."""
    import os
    import signal

    from skipdecode.training import loop

    real_run = loop._Run.run

    def run(self, callback=None):
        def stop_at_3(info):
            if info["step"] == 3:
                if how == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)  # alone: a run that ignored it would finish
                else:
                    raise KeyboardInterrupt
        return real_run(self, stop_at_3)

    monkeypatch.setattr(loop._Run, "run", run)
    model, data = cli_inputs
    out = tmp_path / "run"
    res, text = cli_run(["train", "--model", str(model), "--data", str(data), "--speedup", "2", "--max-steps", "6",
                      "--batch-size", "2", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--no-progress",
                      "--val-fraction", "0", "--out", str(out)])
    assert res.exit_code == {"ctrl-c": 130, "sigterm": 143}[how], res.output
    assert "training interrupted; its newest checkpoint is" in text and "checkpoint-00000003" in text
    assert "--resume" in text and "Traceback" not in res.output
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-00000002", "checkpoint-00000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the command


def test_resume_compares_epochs_only_when_they_plan_the_run(tmp_path):
    """``epochs`` is ignored with ``max_steps`` (its help says so), so a resume with another
    ``epochs`` and the same ``max_steps`` goes on; without ``max_steps`` it is refused."""
    from skipdecode.training.checkpoint import find_resume_checkpoint

    def run_with(name, **kw):
        out = tmp_path / name
        state = out / "checkpoint-00000005" / "train_state"
        state.mkdir(parents=True)
        saved = TrainConfig(out_dir=str(out), speedup=2.0, **kw).to_dict()
        (state / "state.json").write_text(json.dumps({"step": 5, "config": saved, "data_hash": "x", "num_processes": 1}))
        return out

    out = run_with("steps", max_steps=10, epochs=1.0)
    ckpt, _ = find_resume_checkpoint(out, TrainConfig(out_dir=str(out), speedup=2.0, max_steps=10, epochs=3.0, resume=True), 1)
    assert ckpt.name == "checkpoint-00000005"
    with pytest.raises(TrainConfigError) as info:
        find_resume_checkpoint(out, TrainConfig(out_dir=str(out), speedup=2.0, max_steps=12, resume=True), 1)
    assert info.value.field == "max_steps"
    out = run_with("epochs", epochs=1.0)
    with pytest.raises(TrainConfigError) as info:
        find_resume_checkpoint(out, TrainConfig(out_dir=str(out), speedup=2.0, epochs=3.0, resume=True), 1)
    assert info.value.field == "epochs"
