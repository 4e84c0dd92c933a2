"""A checkpoint folder's ``skipdecode.json``: the type of each field, and the sha256 of the weight
files it records.

:meth:`skipdecode.model.SkipModel.save_pretrained` (and so ``skipdecode train``, for every
checkpoint and for ``final/``) writes the file; :func:`skipdecode.load` reads it with
:func:`read_skip_config`, which checks every field the project writes (:class:`SkipConfigFile`)
before any of them is used, and then checks the weight files against the checksums recorded in
``weights_sha256`` with :func:`verify_weights`. Each fault is one :class:`SkipConfigError` line
naming the file and the field (or the weight file); fields the project does not know are kept
as they are, so newer files still load.

Only the weight files are hashed (``*.safetensors``, ``*.bin``; a few hundred MB for the default
model, about a second), not the tokenizer or config files: a flipped byte in the weights changes
the model silently, while a broken config or tokenizer fails loudly when transformers reads it.
Checkpoints of a training run also record every file in ``train_state/checksums.json``, verified
on resume (:mod:`skipdecode.training.checkpoint`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

__all__ = ["SkipConfigError", "SkipConfigFile", "WEIGHT_PATTERNS", "read_skip_config", "sha256_file",
           "verify_weights", "weight_checksums"]

#: Files whose sha256 :meth:`~skipdecode.model.SkipModel.save_pretrained` records: the weights
#: transformers and peft write (a full model, its shards, or a LoRA adapter).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")

#: A training checkpoint's record of every file's sha256 (:mod:`skipdecode.training.checkpoint`).
TRAIN_CHECKSUMS = "train_state/checksums.json"

_Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class SkipConfigError(ValueError):
    """``skipdecode.json`` or a weight file it records is wrong. ``path`` is the file at fault; the
    message is one line, ``"<path>: <problem>"``, naming the field where there is one."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class SkipConfigFile(BaseModel):
    """The fields of ``skipdecode.json`` that the project writes and reads, with their types
    (strict: ``"chat": "yes"`` or ``"chat": 1`` is not a boolean, ``"horizon": 2.0`` not an integer).

    ``policy`` is a policy dict (checked against the model by :func:`skipdecode.policy.policy_from_dict`
    once the model is loaded); ``num_layers`` (layers) and ``horizon`` (tokens) are integers
    >= 1; ``weights_sha256`` maps a weight file's name to its lowercase hex sha256. The rest
    are records (training settings, data, losses) that only reports read. Other fields are
    allowed and kept.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    policy: dict[str, Any] = None  # type: ignore[assignment]  # absent is fine, null is not
    chat: bool = None  # type: ignore[assignment]
    num_layers: int = Field(None, ge=1)  # type: ignore[assignment]
    horizon: Optional[int] = Field(None, ge=1)
    base_model: Optional[str] = None
    task: Optional[str] = None
    response_separator: Optional[str] = None
    speedups: Optional[list[float]] = None
    policies: Optional[dict[str, dict[str, Any]]] = None
    training: Optional[dict[str, Any]] = None
    data: Optional[dict[str, Any]] = None
    losses: Optional[dict[str, Any]] = None
    adapter: Optional[dict[str, Any]] = None
    skip_adapter: Optional[dict[str, Any]] = None
    weights_sha256: Optional[dict[str, _Sha256]] = None


def _field_path(loc: tuple) -> str:
    """A pydantic error ``loc`` as a field path: ``('speedups', 1)`` -> ``speedups[1]``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def read_skip_config(path: str | os.PathLike) -> dict[str, Any]:
    """The content of the ``skipdecode.json`` file at ``path``, its fields type-checked.

    Returns:
        The JSON object as a dict (unknown fields included, values unchanged).

    Raises:
        SkipConfigError: the file cannot be read, is not valid JSON, is not a JSON object, or a
            field has the wrong type or range (:class:`SkipConfigFile`); the message names the
            file and the field, e.g. ``.../skipdecode.json: field 'chat' has the wrong type or
            value (Input should be a valid boolean), got "yes"``.
    """
    path = Path(path)
    try:
        content = json.loads(path.read_text())
    except OSError as err:
        raise SkipConfigError(path, f"cannot be read ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SkipConfigError(path, f"not valid JSON ({err})") from None
    if not isinstance(content, dict):
        raise SkipConfigError(path, f"must hold a JSON object, got {type(content).__name__}")
    try:
        SkipConfigFile.model_validate(content)
    except ValidationError as err:
        first = err.errors()[0]
        field = _field_path(first["loc"])
        shown = json.dumps(first.get("input"), default=str)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise SkipConfigError(path, f"field {field!r} has the wrong type or value ({first['msg']}), "
                              f"got {shown}") from None
    return content


def sha256_file(path: str | os.PathLike) -> str:
    """Lowercase hex sha256 of the file at ``path`` (read in 1 MiB blocks).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weight_checksums(folder: str | os.PathLike) -> dict[str, str]:
    """``{file name: sha256}`` of the weight files (:data:`WEIGHT_PATTERNS`) directly in ``folder``,
    for ``skipdecode.json``'s ``weights_sha256``.

    Raises:
        OSError: a file cannot be read.
    """
    folder = Path(folder)
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in folder.glob(pattern) if f.is_file()})
    return {f.name: sha256_file(f) for f in files}


def _checkpoint_weight_sums(folder: Path) -> dict[str, str]:
    """The weight files' sums in a training checkpoint's ``train_state/checksums.json`` (written
    by :mod:`skipdecode.training.checkpoint` for every file, also before ``weights_sha256``
    existed); {} when the folder has none."""
    record = folder / TRAIN_CHECKSUMS
    if not record.is_file():
        return {}
    try:
        sums = json.loads(record.read_text())
    except (OSError, ValueError):
        sums = None
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise SkipConfigError(record, "the checksum record is not a JSON object of sha256 strings (corrupt)")
    return {name: digest for name, digest in sums.items()
            if "/" not in name and any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_PATTERNS)}


def verify_weights(folder: str | os.PathLike, skip_config: dict[str, Any]) -> None:
    """Check each weight file recorded in ``skip_config["weights_sha256"]`` (a checked
    ``skipdecode.json`` of ``folder``) against its sha256. A training checkpoint saved before
    that field existed is checked against the weight files' entries of its
    ``train_state/checksums.json``. Nothing to do when neither records a sum (files written by
    other tools or older versions).

    Raises:
        SkipConfigError: a recorded file is missing, unreadable, or its content changed since it
            was saved (a flipped byte, a truncation); the message names the file. The
            checkpoint's checksum record is not a JSON object (names it).
    """
    folder = Path(folder)
    sums = skip_config.get("weights_sha256")
    if sums is None:
        sums = _checkpoint_weight_sums(folder)
    for name, digest in sums.items():
        f = folder / name
        if Path(name).name != name:
            raise SkipConfigError(folder / "skipdecode.json", f"field 'weights_sha256' names {name!r}, which is "
                                                              "not a file name in the checkpoint folder")
        if not f.is_file():
            raise SkipConfigError(f, "the weight file is missing (its sha256 is recorded); the checkpoint is "
                                     "incomplete")
        try:
            actual = sha256_file(f)
        except OSError as err:
            raise SkipConfigError(f, f"cannot be read ({err.strerror or err})") from None
        if actual != digest:
            raise SkipConfigError(f, "its sha256 differs from the one recorded when it was saved; the weights "
                                     "are corrupt or were modified (copy the checkpoint again)")
