"""Checkpoints: find, write atomically, load; RNG state.

Run directory layout (``TrainConfig.out_dir``)::

    out_dir/checkpoint-00000100/   HF checkpoint + tokenizer + skipdecode.json + train_state/
    out_dir/final/                 the trained model (HF checkpoint, or LoRA adapter) + skipdecode.json
    out_dir/train_record.json      the run's record (:class:`TrainResult`), rewritten as it goes

``train_state/`` holds ``optimizer.pt``, ``scheduler.pt``, ``rng-<rank>.pt``, ``state.json`` (step,
logs, config) and, for distillation, ``distill_answers.json``. Every directory is written under a
temporary name (``.checkpoint-tmp-*``) and renamed into place.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..model import SKIP_CONFIG_NAME, SkipModel, write_json_atomic
from ..paths import portable_here, writable_dir_problem
from ..skip_config import SkipConfigError, read_skip_config, verify_weights
from .batching import _sha256_file
from .config import RESUME_FIELDS, TrainConfig, TrainConfigError

__all__ = ["latest_checkpoint", "CheckpointError", "check_out_dir", "verify_checkpoint", "check_same_data", "STATE_DIR",
           "RECORD_NAME"]

STATE_DIR = "train_state"
RECORD_NAME = "train_record.json"
CHECKSUMS = "checksums.json"  # in STATE_DIR: {path relative to the checkpoint: sha256}
_TMP_PREFIX = ".checkpoint-tmp-"


class CheckpointError(TrainConfigError):
    """A checkpoint file is missing, corrupt or does not fit the run; ``field`` is "resume" and
    the message names the file and what is wrong."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = Path(path)
        super().__init__("resume", f"cannot continue from {path}: {problem}")


def check_out_dir(out_dir: Path) -> None:
    """Make sure the run can write ``out_dir`` before the first step (creating it if needed).

    Raises:
        TrainConfigError: (field ``out_dir``) it is a file, or it cannot be created or written."""
    problem = writable_dir_problem(out_dir)
    if problem is not None:
        raise TrainConfigError("out_dir", problem)


def _write_checksums(ckpt: Path) -> None:
    """Record the sha256 of every file of checkpoint folder ``ckpt`` in ``train_state/checksums.json``."""
    sums = {str(f.relative_to(ckpt)): _sha256_file(f) for f in sorted(ckpt.rglob("*")) if f.is_file()}
    write_json_atomic(ckpt / STATE_DIR / CHECKSUMS, sums)


def verify_checkpoint(ckpt: Path) -> None:
    """Check every file recorded in ``train_state/checksums.json`` exists with its sha256.

    Without that record, the weight files are still checked against the ``weights_sha256`` of
    the checkpoint's ``skipdecode.json`` (:mod:`skipdecode.skip_config`) when it has one;
    checkpoints written before either was recorded are accepted with a warning.

    Raises:
        CheckpointError: a recorded file is missing or its content changed (names the file)."""
    record = ckpt / STATE_DIR / CHECKSUMS
    if not record.exists():
        _verify_recorded_weights(ckpt)
        return
    try:
        sums = json.loads(record.read_text())
        assert isinstance(sums, dict)
    except (ValueError, AssertionError, OSError):
        raise CheckpointError(record, "the checksum record is not a JSON object (corrupt)") from None
    for rel, digest in sums.items():
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(f, "the file is missing")
        if _sha256_file(f) != digest:
            raise CheckpointError(f, "its content differs from the sha256 recorded when it was saved "
                                     "(corrupt, truncated or modified)")


def _verify_recorded_weights(ckpt: Path) -> None:
    """The fallback of :func:`verify_checkpoint`: the weights against skipdecode.json's sums."""
    meta_file = ckpt / SKIP_CONFIG_NAME
    try:
        meta = read_skip_config(meta_file) if meta_file.is_file() else {}
        if not meta.get("weights_sha256"):
            log.warning("%s has no %s (an older checkpoint): its files are not verified", ckpt, CHECKSUMS)
            return
        verify_weights(ckpt, meta)
    except SkipConfigError as err:
        raise CheckpointError(err.path, err.problem) from None


def _read(path: Path, loader: Callable[[Path], Any], what: str) -> Any:
    """``loader(path)`` with any failure turned into a :class:`CheckpointError` naming ``path``."""
    if not path.is_file():
        raise CheckpointError(path, "the file is missing")
    if path.stat().st_size == 0:
        raise CheckpointError(path, "the file is empty")
    try:
        return loader(path)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - torch/safetensors/json raise many kinds; name the file
        first = (str(err).splitlines() or [""])[0][:200]
        raise CheckpointError(path, f"cannot read {what} ({type(err).__name__}: {first})") from None


def _remove_leftovers(out_dir: Path) -> None:
    """Remove staging folders of checkpoint saves that were killed midway."""
    for p in out_dir.glob(_TMP_PREFIX + "*"):
        if p.is_dir():
            log.warning("removing %s, left by a checkpoint save that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)
log = logging.getLogger("skipdecode.train")  # one logger for the whole training package
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint ``out_dir/checkpoint-NNNNNNNN`` (one holding
    ``train_state/state.json``), or None."""
    root = Path(out_dir)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _CKPT_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_DIR / "state.json").exists():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def _checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    out = []
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            m = _CKPT_RE.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


def _load_full_weights(model: nn.Module, directory: Path) -> None:
    """Load a HF checkpoint's safetensors into ``model`` in place (tied weights may be absent)."""
    from safetensors.torch import load_file

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        raise FileNotFoundError(f"{directory} holds no model.safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = [k for k in missing if not (k in params and id(params[k]) in loaded)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {directory} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _base_model_name(sk: SkipModel, spec: Any) -> str | None:
    """Where the model can be loaded from again (for a LoRA adapter's ``base_model``)."""
    from ..loading import DEFAULT_MODEL

    name = str(spec) if isinstance(spec, (str, os.PathLike)) else sk.source
    if not name:
        return None
    if name == DEFAULT_MODEL or name.startswith(DEFAULT_MODEL + " "):
        return DEFAULT_MODEL
    if Path(name).exists():
        return str(Path(name).resolve())
    return name


def _read_state(ckpt: Path) -> dict[str, Any]:
    """``train_state/state.json`` of ``ckpt``, checked for the fields resume needs."""
    path = ckpt / STATE_DIR / "state.json"
    saved = _read(path, lambda p: json.loads(p.read_text()), "the training state (JSON)")
    if not isinstance(saved, dict):
        raise CheckpointError(path, "the training state is not a JSON object")
    for key, kind in (("step", int), ("config", dict), ("data_hash", str)):
        if not isinstance(saved.get(key), kind):
            raise CheckpointError(path, f"the training state lacks a valid {key!r}")
    return saved


def find_resume_checkpoint(out_dir: Path, config: TrainConfig, world: int,
                           main: bool = True) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to resume from and its ``state.json`` (None, {} for a fresh run).

    On resume it first removes staging folders left by killed saves (main process) and verifies
    the checkpoint's files against their recorded checksums.

    Raises:
        TrainConfigError: ``out_dir`` holds another run (checkpoints or ``final/``) and
            ``resume`` is off; resume finds only a finished model; the checkpoint was written by
            another number of processes or with other settings (``.field`` names the setting).
        CheckpointError: a checkpoint file is missing, corrupt or unreadable (names it).
    """
    existing = _checkpoints(out_dir)
    if not config.resume:
        if existing:
            raise TrainConfigError("out_dir", f"{out_dir} already holds checkpoints ({existing[-1][1].name}); continue "
                                              "that run with resume=True (--resume on the command line) or choose another directory")
        if (out_dir / "final").exists():
            raise TrainConfigError("out_dir", f"{out_dir} already holds a finished model ({out_dir / 'final'}); "
                                              "choose another directory (or remove it) to train again")
        return None, {}
    ckpt = latest_checkpoint(out_dir)
    if ckpt is None and (out_dir / "final").exists():
        raise TrainConfigError("resume", f"{out_dir} holds a finished model ({out_dir / 'final'}) but no "
                                         "checkpoint to resume from; choose another directory to train again")
    if main and out_dir.is_dir():
        _remove_leftovers(out_dir)
    if ckpt is None:
        log.warning("resume: no checkpoint in %s, starting a fresh run", out_dir)
        return None, {}
    verify_checkpoint(ckpt)
    saved = _read_state(ckpt)
    if saved.get("num_processes", 1) != world:
        raise TrainConfigError("resume", f"needs the {saved.get('num_processes', 1)} processes of {ckpt} "
                                         f"(the data order depends on it), got {world}")
    now = config.to_dict()
    defaults = TrainConfig(out_dir=".", speedup=1.0).to_dict()  # fields older checkpoints lack
    for name in RESUME_FIELDS:
        if name == "epochs" and now["max_steps"] is not None:
            continue  # epochs plans nothing when max_steps is set (a differing max_steps is refused)
        old, new = saved["config"].get(name, defaults[name]), now[name]
        if _comparable(old) != _comparable(new):  # paths by where they lead, not by their spelling
            raise TrainConfigError(name, f"differs from the checkpoint's ({old!r} in {ckpt}, {new!r} now): "
                                         "resume needs the same settings")
    return ckpt, saved


def _comparable(value: Any) -> Any:
    """A setting as resume compares it: a string naming an existing file or folder as its
    resolved, portable path (:func:`skipdecode.paths.portable_here`), so that ``runs/a/final``,
    its absolute spelling and the portable form a checkpoint records all compare equal (older
    checkpoints recorded absolute paths); any other value as it is."""
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        return portable_here(str(path.resolve()) if path.exists() else value)
    return value


def _data_name(record: dict[str, Any]) -> str:
    """The data file a data record names (portable), its spec, or "in-memory examples"."""
    return str(_comparable(record.get("path") or record.get("spec") or "in-memory examples"))


def _sha(record: dict[str, Any]) -> str:
    digest = record.get("sha256")
    return f"sha256 {digest[:12]}..." if isinstance(digest, str) and digest else "no sha256"


def check_same_data(ckpt: Path | None, saved: dict[str, Any], data_hash: str, info: dict[str, Any]) -> None:
    """On resume, make sure the run reads the data its checkpoint ``ckpt`` trained on: the sha256
    of the token ids of its training examples (``data_hash``) must equal the checkpoint's, so the
    same file given by another spelling (relative or absolute) is the same data. Nothing to
    check for a fresh run (``ckpt`` None).

    Args:
        ckpt: the checkpoint resumed from, or None. saved: its ``state.json``.
        data_hash: this run's hash of its tokenized training examples.
        info: where this run's data came from (``spec``, ``path``, ``sha256``).

    Raises:
        TrainConfigError: (field ``resume``) the data differ; the message names the file and
            sha256 the checkpoint trained on (its ``skipdecode.json``) and this run's, says that
            the file changed, or that the same file gives other token ids (another tokenizer)."""
    if ckpt is None or saved.get("data_hash") == data_hash:
        return
    try:
        old = json.loads((ckpt / SKIP_CONFIG_NAME).read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        old = None
    old = old if isinstance(old, dict) else {}
    if old.get("sha256") and old.get("sha256") == info.get("sha256"):
        problem = (f"{_data_name(info)} ({_sha(info)}) is the file {ckpt} trained on, but its examples give "
                   "other token ids: resume needs the same starting model (its tokenizer)")
    elif old.get("path") and _data_name(old) == _data_name(info):
        problem = f"{_data_name(info)} changed since {ckpt} was written ({_sha(old)} then, {_sha(info)} now)"
    elif old:
        problem = f"{ckpt} trained on {_data_name(old)} ({_sha(old)}), this run reads {_data_name(info)} ({_sha(info)})"
    else:
        problem = f"the sha256 of the training examples' token ids differs from {ckpt}'s"
    raise TrainConfigError("resume", f"cannot continue with other training data: {problem}")


def load_distill_answers(ckpt: Path) -> dict[str, list[int]]:
    """The distillation targets saved with checkpoint ``ckpt`` (prompt -> token ids)."""
    path = ckpt / STATE_DIR / "distill_answers.json"
    raw = _read(path, lambda p: json.loads(p.read_text()), "the distillation answers (JSON)")
    if not isinstance(raw, dict):
        raise CheckpointError(path, "the distillation answers are not a JSON object")
    return {k: list(v) for k, v in raw.items()}


#: settings that shape the teacher's answers: another run's answers are reused only when they match
ANSWER_FIELDS = ("distill_max_new_tokens", "chat", "response_separator")


#: teacher answers stored batch by batch while they are generated (single process), so that a run
#: killed before its first checkpoint does not generate them again (the first checkpoint stores
#: them; the file goes when the run ends)
PARTIAL_ANSWERS = "teacher_answers.partial.json"


def load_partial_answers(out_dir: Path, settings: dict[str, Any]) -> dict[str, list[int]]:
    """The teacher answers a killed run of ``out_dir`` stored (:data:`PARTIAL_ANSWERS`), when they
    were made with the same ``settings`` (the :data:`ANSWER_FIELDS` and the base model); else {}.

    An unreadable file or one made with other settings is ignored with a warning (it is rewritten
    by the new answers), never an error: it only saves time."""
    path = Path(out_dir) / PARTIAL_ANSWERS
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("%s is unreadable: generating the teacher answers again", path)
        return {}
    if not isinstance(raw, dict) or not isinstance(raw.get("answers"), dict):
        log.warning("%s holds no answers: generating the teacher answers again", path)
        return {}
    if raw.get("settings") != settings:
        log.warning("%s was made with other settings (%s, now %s): generating the teacher answers again",
                    path, raw.get("settings"), settings)
        return {}
    log.info("reusing %d teacher answers stored in %s", len(raw["answers"]), path)
    return {k: list(v) for k, v in raw["answers"].items()}


def save_partial_answers(out_dir: Path, settings: dict[str, Any], answers: dict[str, list[int]]) -> None:
    """Store ``answers`` (prompt -> token ids) made with ``settings`` in ``out_dir`` atomically
    (:data:`PARTIAL_ANSWERS`, read back by :func:`load_partial_answers`)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(out_dir) / PARTIAL_ANSWERS, {"settings": settings, "answers": answers})


def reuse_distill_answers(ckpt: str | os.PathLike, config: TrainConfig, needed: list[str]) -> dict[str, list[int]]:
    """Another run's stored teacher answers (``TrainConfig.distill_answers_from``) for the
    ``needed`` prompts (prompt -> token ids; the stored answers of other prompts are dropped).

    Raises:
        TrainConfigError: (field ``distill_answers_from``) the folder holds no answers or no valid
            training state; its run's :data:`ANSWER_FIELDS` differ from ``config``'s; or its answers
            miss some of ``needed`` (the message counts them and quotes the first).
    """
    ckpt = Path(ckpt)
    field = "distill_answers_from"
    try:
        saved = _read_state(ckpt)
        answers = load_distill_answers(ckpt)
    except CheckpointError as err:
        raise TrainConfigError(field, f"{ckpt} is not a checkpoint with teacher answers: {err.args[0]}") from None
    defaults = TrainConfig.__dataclass_fields__
    for name in ANSWER_FIELDS:
        old, new = saved["config"].get(name, defaults[name].default), getattr(config, name)
        if old != new:
            raise TrainConfigError(field, f"its answers were made with {name}={old!r}, this run has {new!r}")
    missing = [p for p in needed if p not in answers]
    if missing:
        raise TrainConfigError(field, f"its answers cover {len(needed) - len(missing)} of the {len(needed)} prompts "
                                      f"this run needs; missing e.g. {missing[0][:60]!r}")
    return {p: answers[p] for p in needed}


def load_weights(ckpt: Path, hf_model: nn.Module, peft_model: Any) -> None:
    """Load the checkpoint's weights: the LoRA adapter into ``peft_model``, or the full model."""
    if peft_model is not None:
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        _read(ckpt / "adapter_model.safetensors", lambda p: set_peft_model_state_dict(
            peft_model, load_peft_weights(str(ckpt), device="cpu")), "the LoRA adapter weights")
    elif (ckpt / "model.safetensors.index.json").exists():  # sharded
        _load_full_weights(hf_model, ckpt)
    else:
        _read(ckpt / "model.safetensors", lambda p: _load_full_weights(hf_model, ckpt), "the model weights")


def load_train_state(ckpt: Path, saved: dict[str, Any], optimizer: Any, scheduler: Any, rank: int) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG state from ``ckpt``; return the step, logs and totals."""
    state_dir = ckpt / STATE_DIR
    _read(state_dir / "optimizer.pt", lambda p: optimizer.load_state_dict(
        torch.load(p, map_location="cpu", weights_only=False)), "the optimizer state")
    _read(state_dir / "scheduler.pt", lambda p: scheduler.load_state_dict(torch.load(p, weights_only=False)),
          "the learning-rate scheduler state")
    rng_file = state_dir / f"rng-{rank}.pt"
    if not rng_file.exists():
        rng_file = state_dir / "rng-0.pt"
    _read(rng_file, lambda p: _set_rng_state(torch.load(p, weights_only=False)), "the random-number state")
    return {"step": int(saved["step"]), "train_log": list(saved.get("train_log", [])),
            "val_log": list(saved.get("val_log", [])),
            "totals": {"tokens": int(saved.get("tokens_seen", 0)), "targets": int(saved.get("target_tokens_seen", 0))},
            # optimizer-step seconds spent so far (older checkpoints: the sum of the logged steps)
            "train_seconds": float(saved.get("train_seconds", sum(r.get("seconds", 0.0)
                                                                   for r in saved.get("train_log", []))))}


def save_checkpoint(out_dir: Path, step: int, *, accelerator: Any, save_model: Callable[[Path], Path],
                    optimizer: Any, scheduler: Any, state: dict[str, Any], answers: dict | None,
                    keep: int) -> Path:
    """Write ``out_dir/checkpoint-<step>`` atomically (staging folder + rename); keep the newest ``keep``.

    ``save_model(dir)`` writes the model into ``dir`` and returns it; ``state`` becomes
    ``train_state/state.json``. Every process writes its own ``rng-<rank>.pt``."""
    target = out_dir / f"checkpoint-{step:08d}"
    main = accelerator.is_main_process
    accelerator.wait_for_everyone()
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=out_dir))
        try:
            ckpt = save_model(staging / "ckpt")
            state_dir = ckpt / STATE_DIR
            state_dir.mkdir()
            torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
            torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
            if answers is not None:
                write_json_atomic(state_dir / "distill_answers.json", answers)
            write_json_atomic(state_dir / "state.json", portable_here(state))  # no absolute paths
            torch.save(_rng_state(), state_dir / "rng-0.pt")
            _write_checksums(ckpt)
            if target.exists():
                shutil.rmtree(target)
            os.replace(ckpt, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:  # each process keeps its own RNG stream (dropout)
        torch.save(_rng_state(), target / STATE_DIR / f"rng-{accelerator.process_index}.pt")
    if main:
        for _, old in _checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def write_record(out_dir: Path, record: dict[str, Any]) -> None:
    """Write ``out_dir/train_record.json`` atomically, its paths portable
    (:func:`skipdecode.paths.portable_here`: relative to the repository, the data folder or the
    current directory, never this machine's absolute paths)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / RECORD_NAME, portable_here(record))
