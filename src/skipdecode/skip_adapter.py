"""Skip adapters: LoRA adapters trained with a skip schedule in place, shipped with the package.

A *skip adapter* is a LoRA adapter (peft format: ``adapter_config.json`` +
``adapter_model.safetensors``) plus a ``skipdecode.json`` that records the schedule it was trained
for (``policy``, ``horizon``), the chat setting, and an ``adapter`` section (the training command,
its minutes, the prompt set's sha256s). It is not an *architecture* adapter
(:mod:`skipdecode.adapters`, which tells the layer loop how to call a model family).

The package ships one, for the embedded SmolLM2-135M-Instruct
(``skipdecode/skip_adapters/smollm2-135m-instruct/``, trained by self-distillation under the 2x
schedule with ``benchmarks/train_adapter.py``). :func:`skipdecode.load` merges it into the weights
by default when it loads the embedded model (``adapter=False`` keeps the stock weights), and the
adapter's policy becomes the model's default policy, as for any checkpoint written by
``skipdecode train``. A *decode-only* adapter (trained with ``TrainConfig.base_prefill``, recorded
as ``training.config.base_prefill`` in its ``skipdecode.json``) is applied to decode steps only:
the base model prefills the prompt (:func:`skipdecode.lowrank.base_prefill`); the shipped one is
decode-only. A decode step that runs every layer (``FullPolicy``, ``--speedup 1``, or a schedule's
``full_depth_steps``) runs the base weights too (:mod:`skipdecode.lowrank`), so full-depth answers are
the stock model's; ``adapter=False`` (``--no-adapter``) loads the stock weights without the merge.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

__all__ = [
    "SHIPPED_DIR",
    "AdapterError",
    "shipped_adapter_for",
    "read_adapter_config",
    "merge_adapter",
    "reschedule_adapter",
    "is_decode_only",
    "adapter_summary",
    "entry_bridge_summary",
    "install_adapter",
]

#: Folder of the skip adapters shipped as package data, one sub-folder per base model name.
SHIPPED_DIR = Path(__file__).resolve().parent / "skip_adapters"

_WEIGHTS = "adapter_model.safetensors"
_CONFIG = "adapter_config.json"
_SKIP = "skipdecode.json"
# load() model names with a shipped adapter -> its folder under SHIPPED_DIR
_SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct"}


class AdapterError(ValueError):
    """A skip adapter cannot be found, read or applied; the message names the path and the problem."""


def shipped_adapter_for(model: str) -> Path | None:
    """The shipped skip adapter's folder for ``model`` as given to :func:`skipdecode.load`
    (``"smollm2-135m-instruct"``, the embedded default, is the only one today), or None when the
    package ships none for it or its files are missing (an install without the package data)."""
    if model not in _SHIPPED:
        return None
    folder = SHIPPED_DIR / _SHIPPED[model]
    from .lowrank import lora_weights_file

    return folder if lora_weights_file(folder) is not None and (folder / _CONFIG).is_file() else None


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``skipdecode.json`` of the adapter folder ``path`` ({} when it has none).

    Raises:
        AdapterError: ``path`` is not a folder holding ``adapter_config.json``, or its
            ``skipdecode.json`` is not valid JSON, not an object, or has a field of the wrong
            type (:func:`skipdecode.skip_config.read_skip_config`; names the file and the field).
    """
    from .skip_config import SkipConfigError, read_skip_config

    path = Path(path)
    if not (path / _CONFIG).is_file():
        raise AdapterError(f"adapter {path}: no {_CONFIG} there (not a LoRA adapter folder)")
    if not (path / _SKIP).is_file():
        return {}
    try:
        return read_skip_config(path / _SKIP)
    except SkipConfigError as e:
        raise AdapterError(f"adapter {e}") from None


def merge_adapter(hf_model: Any, path: str | os.PathLike) -> Any:
    """Merge the LoRA adapter in folder ``path`` into ``hf_model`` (peft ``merge_and_unload``).

    Each adapted linear layer's weight ``W`` (out x in) becomes ``W + (alpha / r) * B @ A``
    (Hu et al. 2021, LoRA, eq. 3), computed in the model's dtype; adapter weights stored as
    float16 are cast up first. A packed adapter (:data:`skipdecode.lowrank.PACKED_LORA_WEIGHTS`,
    e.g. int8, which peft cannot read) is dequantized (:func:`skipdecode.lowrank.read_lora`) and
    merged by the same formula in float32. Decoding afterwards costs exactly what the plain model
    costs.

    Returns:
        The plain HF model with the adapter merged (same object type as ``hf_model``), every
        parameter trainable again as in a freshly loaded model (peft freezes the base weights).

    Raises:
        AdapterError: the folder is not a LoRA adapter, or its shapes do not fit the model.
    """
    from .lowrank import LORA_WEIGHTS, PACKED_LORA_WEIGHTS, lora_weights_file

    path = Path(path)
    weights = lora_weights_file(path)
    if not (path / _CONFIG).is_file() or weights is None:
        raise AdapterError(f"adapter {path}: needs {_CONFIG} and {LORA_WEIGHTS} (or {PACKED_LORA_WEIGHTS})")
    if weights.name == PACKED_LORA_WEIGHTS:
        return _merge_packed(hf_model, path)
    from peft import PeftModel

    from .peft_compat import quiet_peft_checkpointing_warning

    try:
        with quiet_peft_checkpointing_warning():  # peft 0.21 reads a property transformers 5.24 deprecated
            peft_model = PeftModel.from_pretrained(hf_model, str(path), autocast_adapter_dtype=True)
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AdapterError(f"adapter {path} does not fit this model: {first}") from None
    merged = peft_model.merge_and_unload()
    for param in merged.parameters():  # peft froze the base weights; a plain model trains them all
        param.requires_grad_(True)
    return merged


def _merge_packed(hf_model: Any, path: Path) -> Any:
    """``W += scaling * B @ A`` (float32, cast to W's dtype) for every module of the packed adapter
    in ``path``; AdapterError (names the module) when one is missing or its shapes do not fit."""
    import torch

    from .lowrank import LoraFormatError, read_lora

    try:
        deltas = read_lora(path)
    except LoraFormatError as e:
        raise AdapterError(str(e)) from None
    with torch.no_grad():
        for name, (a, b, scaling) in deltas.items():
            try:
                weight = hf_model.get_submodule(name).weight
            except AttributeError:
                raise AdapterError(f"adapter {path} does not fit this model: it adapts {name}, which it lacks") from None
            if tuple(weight.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
                raise AdapterError(f"adapter {path} does not fit this model: {name} is {tuple(weight.shape)}, "
                                   f"the adapter's B @ A is {(b.shape[0], a.shape[1])}")
            weight.add_((scaling * (b @ a)).to(weight.device, weight.dtype))
    return hf_model


def is_decode_only(skip_config: dict[str, Any]) -> bool:
    """Whether a LoRA adapter's ``skipdecode.json`` (``skip_config``) records a decode-only adapter:
    trained with ``TrainConfig.base_prefill`` (its ``training.config.base_prefill``), so the base
    model must prefill the prompt (:func:`skipdecode.lowrank.base_prefill`)."""
    training = skip_config.get("training")
    config = training.get("config") if isinstance(training, dict) else None
    return bool(isinstance(config, dict) and config.get("base_prefill") is True)


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def entry_bridge_summary(path: str | os.PathLike) -> dict[str, Any] | None:
    """What ``skipdecode info`` reports about the entry bridge file (:mod:`skipdecode.entry_bridge`)
    in folder ``path``, read from its header (no tensor is loaded), or None when it has none:
    ``{"file", "source", "targets": {"count", "first", "last"}, "hidden_size", "dtype", "bytes",
    "megabytes"}`` (source and targets: layers; megabytes: 10^6 bytes of the file).

    Raises:
        AdapterError: the file is not safetensors, or lacks the bridge's metadata or tensors
            (names the file).
    """
    from safetensors import SafetensorError, safe_open

    from .entry_bridge import ENTRY_BRIDGE_FILE
    from .packing import PACKED_META

    f = Path(path) / ENTRY_BRIDGE_FILE
    if not f.is_file():
        return None
    try:
        with safe_open(str(f), framework="pt") as fh:
            file_meta = fh.metadata() or {}
            meta = json.loads(file_meta["skipdecode_entry_bridge"])
            names = set(fh.keys())
            if "weight_int8" in names:  # the int8 layout before skipdecode.packing
                shape, dtype = fh.get_slice("weight_int8").get_shape(), "int8"
            elif PACKED_META in file_meta:
                info = json.loads(file_meta[PACKED_META])["weight"]
                shape, dtype = info["shape"], info["format"]
            else:
                weight = fh.get_slice("weight")
                shape, dtype = weight.get_shape(), weight.get_dtype()
        targets = [int(t) for t in meta["targets"]]
        source = int(meta["source"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as err:
        raise AdapterError(f"{f}: not a readable entry bridge ({type(err).__name__}: {err})") from None
    size = f.stat().st_size
    return {
        "file": ENTRY_BRIDGE_FILE,
        "source": source,
        "targets": {"count": len(targets), "first": min(targets, default=None), "last": max(targets, default=None)},
        "hidden_size": int(shape[-1]),
        "dtype": dtype,
        "bytes": size,
        "megabytes": round(size / 1e6, 3),
    }


def adapter_summary(path: str | os.PathLike, *, shipped: bool) -> dict[str, Any]:
    """What ``skipdecode info`` reports about a merged skip adapter: its folder (relative to the
    package for a shipped one), size in bytes, LoRA rank, trained policy, the ``adapter``
    record of its ``skipdecode.json`` (command, minutes, prompt-set hashes), and its entry
    bridge (:func:`entry_bridge_summary`; None without one).

    Raises:
        AdapterError: as :func:`read_adapter_config`; an unreadable entry bridge file.
    """
    path = Path(path)
    meta = read_adapter_config(path)
    lora = json.loads((path / _CONFIG).read_text())
    where = f"skipdecode/skip_adapters/{path.name} (package data)" if shipped else str(path)
    return {
        "path": where,
        "shipped": shipped,
        "bytes": _size_bytes(path),
        "lora_r": lora.get("r"),
        "lora_alpha": lora.get("lora_alpha"),
        "policy": meta.get("policy"),
        "speedups": meta.get("speedups"),
        "training": meta.get("adapter", {}),
        "decode_only": is_decode_only(meta),
        "storage": meta.get("storage", {"lora": "float16"} if shipped else None),
        "entry_bridge": entry_bridge_summary(path),
    }


def _nonzero_lora(tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (a peft LoRA state dict) without the lora_A/lora_B pairs whose lora_B is all
    zeros; tensors that are not such a pair are kept. When every pair is zero all are kept, so that
    the file still names the adapter's modules."""
    zero = {k.split(".lora_B.")[0] for k, v in tensors.items() if ".lora_B." in k and not bool(v.any())}
    if len(zero) == sum(".lora_B." in k for k in tensors):
        return dict(tensors)
    return {k: v for k, v in tensors.items()
            if not any(k.startswith(m + ".lora_A.") or k.startswith(m + ".lora_B.") for m in zero)}


def _relabel_policy(meta: dict[str, Any], as_speedup: Any, src: Path) -> dict[str, str]:
    """Relabel ``meta``'s one trained policy as ``as_speedup`` (in place); returns ``{"from", "to"}``."""
    import math

    if isinstance(as_speedup, bool) or not isinstance(as_speedup, (int, float)) \
            or not math.isfinite(as_speedup) or as_speedup <= 1:
        raise ValueError(f"as_speedup must be a finite number > 1, got {as_speedup!r}")
    policies = meta.get("policies") or {}
    if len(policies) != 1:
        raise AdapterError(f"{src}: as_speedup needs a run that trained one schedule; its skipdecode.json "
                           f"policies are {sorted(policies) or 'absent'}")
    (old, policy), = policies.items()
    from .policy import speedup_label

    label = speedup_label(as_speedup)
    meta["policies"] = {label: policy}
    return {"from": old, "to": label}


def _reschedule(meta: dict[str, Any], full_depth_steps: Any = None, horizon: Any = None,
                min_layers: Any = None) -> dict[str, dict]:
    """Set ``full_depth_steps``, ``horizon`` and/or ``min_layers`` on ``meta``'s linear-decay
    ``policy`` and ``policies`` (in place, checked by :class:`~skipdecode.policy.LinearDecayPolicy`,
    whose ValueError names the field). Returns the storage records of what changed:
    ``{"full_depth_steps_added": {"k", "trained_with"}, "horizon_changed": {"horizon",
    "trained_with"}, "min_layers_changed": {"min_layers", "trained_with"}}`` (only the keys given;
    ``trained_with`` is the run's value, k 0 when absent)."""
    from .policy import policy_from_dict

    trained = meta.get("policy") or {}
    changes: dict[str, dict] = {}
    if full_depth_steps is not None:
        changes["full_depth_steps_added"] = {"k": full_depth_steps,
                                             "trained_with": int(trained.get("full_depth_steps", 0))}
    if horizon is not None:
        changes["horizon_changed"] = {"horizon": horizon, "trained_with": trained.get("horizon")}
    if min_layers is not None:
        changes["min_layers_changed"] = {"min_layers": min_layers, "trained_with": trained.get("min_layers")}
    for policy in [meta.get("policy"), *(meta.get("policies") or {}).values()]:
        if isinstance(policy, dict) and policy.get("type") == "linear_decay":
            if full_depth_steps is not None:
                policy["full_depth_steps"] = full_depth_steps
            if horizon is not None:
                policy["horizon"] = horizon
            if min_layers is not None:
                policy["min_layers"] = min_layers
            policy_from_dict(policy)  # ValueError naming the field for a bad value
    return changes


def reschedule_adapter(folder: str | os.PathLike, *, full_depth_steps: int | None = None,
                       horizon: int | None = None, note: str | None = None,
                       min_layers: int | None = None) -> dict[str, dict]:
    """Change the schedule of an installed skip adapter in place (no retraining): the
    ``full_depth_steps`` (decode steps that run every layer, with the base weights), the
    decay ``horizon`` (tokens) and/or the floor ``min_layers`` of its linear-decay ``policy`` and ``policies`` in
    ``folder/skipdecode.json``, written atomically; the change is recorded under ``storage`` as
    :func:`install_adapter` records it (with ``note``, e.g. how the schedule was chosen). A later
    change of the same field keeps the run's original ``trained_with``.

    Args:
        folder: an installed adapter folder (e.g. ``SHIPPED_DIR / "smollm2-135m-instruct"``).
        full_depth_steps: k >= 0, or None (unchanged).
        horizon: T >= 1 (tokens), or None (unchanged).
        min_layers: the floor (layers, warm-up layers <= it <= the schedule's max layers), or None
            (unchanged).
        note: free text stored with each change, or None (a change to the value already
            recorded keeps its note; another value drops it).

    Returns:
        The storage records written (``full_depth_steps_added``, ``horizon_changed``,
        ``min_layers_changed``).

    Raises:
        AdapterError: ``folder`` holds no ``skipdecode.json``, or no field is given.
        ValueError: a value out of range (the message names the field); nothing is written.
    """
    from .model import write_json_atomic

    path = Path(folder) / _SKIP
    if not path.is_file():
        raise AdapterError(f"{folder}: no {_SKIP} (an installed skip adapter folder is needed)")
    if full_depth_steps is None and horizon is None and min_layers is None:
        raise AdapterError("reschedule_adapter needs full_depth_steps, horizon or min_layers")
    meta = json.loads(path.read_text())
    storage = meta.setdefault("storage", {})
    changes = _reschedule(meta, full_depth_steps, horizon, min_layers)
    for key, change in changes.items():
        old = storage.get(key) or {}
        if "trained_with" in old:
            change["trained_with"] = old["trained_with"]
        if note is not None:
            change["note"] = note
        elif "note" in old and all(old.get(f) == v for f, v in change.items() if f != "trained_with"):
            change["note"] = old["note"]  # the same value again: keep how it was chosen
        storage[key] = change
    write_json_atomic(path, meta)
    return changes


def install_adapter(run_final: str | os.PathLike, name: str = "smollm2-135m-instruct",
                    target_root: str | os.PathLike | None = None, *, lora_format: str = "float16",
                    bridge_format: str = "int8", bridge_targets: Sequence[int] | None = None,
                    as_speedup: float | None = None, full_depth_steps: int | None = None,
                    horizon: int | None = None, min_layers: int | None = None) -> Path:
    """Copy a finished LoRA run (``OUT/final`` of ``skipdecode train --lora-r``) into the package
    data as a shipped skip adapter: ``adapter_config.json``, the LoRA weights in ``lora_format``,
    an entry bridge when the run has one (:mod:`skipdecode.entry_bridge`) in ``bridge_format``,
    and ``skipdecode.json`` (its training losses and run-local paths dropped, the formats
    recorded as ``storage``). Written to a temporary folder and renamed into place.

    Args:
        run_final: the run's final (or checkpoint) folder.
        name: the shipped folder's name (a base model name of :func:`shipped_adapter_for`).
        target_root: where to write (default :data:`SHIPPED_DIR`).
        lora_format: ``"float16"`` (peft's own file, half of float32's bytes) or a packed format
            of :mod:`skipdecode.packing` (``"int8"``: a quarter; written as
            :data:`skipdecode.lowrank.PACKED_LORA_WEIGHTS`, dequantized when merged). A packed
            file leaves out the modules whose ``lora_B`` is all zeros (their delta ``B A`` is
            exactly zero, e.g. layers a decode-only 2x adapter never runs).
        bridge_format: a format of :meth:`skipdecode.entry_bridge.EntryBridge.save` (``"int8"``,
            ``"int4"``, ``"float16"``, ...).
        bridge_targets: keep only these entry layers' maps (:meth:`EntryBridge.subset`; None: all).
        as_speedup: record the run's one trained schedule (e.g. an explicit ``--max-layers 25
            --min-layers 5``, labelled ``"custom"``) as its schedule for this speedup (a number
            > 1), so that ``--speedup`` / ``policy_for(speedup=...)`` resolves to it
            (:meth:`skipdecode.model.SkipModel.trained_policy`); the old label is kept as
            ``storage.policy_relabelled``. None: labels unchanged.
        full_depth_steps: set this ``LinearDecayPolicy.full_depth_steps`` on the run's schedules
            (decode steps that run every layer, with the base weights, before the decay; no
            retraining needed), recorded as ``storage.full_depth_steps_added``. None: unchanged.
        horizon: set this decay horizon (tokens) on the run's linear-decay schedules, recorded as
            ``storage.horizon_changed``. None: unchanged.
        min_layers: set this floor (layers) on the run's linear-decay schedules, e.g. a run
            trained at 25 -> 10 shipped at 25 -> 5, recorded as ``storage.min_layers_changed``.
            None: unchanged.

    Returns:
        The installed folder (``target_root/name``, default ``SHIPPED_DIR/name``).

    Raises:
        AdapterError: ``run_final`` is not a LoRA adapter folder, or ``as_speedup`` is given for
            a run that trained more than one schedule (names the labels).
        ValueError: an unknown format, ``as_speedup`` not a number > 1, ``full_depth_steps``
            not an integer >= 0, ``horizon`` not an integer >= 1, or ``min_layers`` outside the
            schedule's warm-up and max layers.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from .lowrank import PACKED_LORA_WEIGHTS
    from .packing import PACK_FORMATS, pack

    for option, fmt in (("lora_format", lora_format), ("bridge_format", bridge_format)):
        if fmt not in PACK_FORMATS:
            raise ValueError(f"{option} must be one of {', '.join(PACK_FORMATS)}, got {fmt!r}")
    src = Path(run_final)
    if not (src / _WEIGHTS).is_file() or not (src / _CONFIG).is_file():
        raise AdapterError(f"{src}: not a LoRA adapter folder (needs {_CONFIG} and {_WEIGHTS})")
    meta = read_adapter_config(src)
    relabelled = _relabel_policy(meta, as_speedup, src) if as_speedup is not None else None
    changes = _reschedule(meta, full_depth_steps, horizon, min_layers)
    root = Path(target_root) if target_root is not None else SHIPPED_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        tensors = load_file(str(src / _WEIGHTS))
        storage: dict[str, Any] = {"lora": lora_format}
        if lora_format in ("float32", "float16", "bfloat16"):  # peft's own file, readable by peft
            dtype = getattr(torch, lora_format)
            save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(tmp / _WEIGHTS),
                      metadata={"format": "pt"})
        else:
            kept = _nonzero_lora(tensors)
            storage["lora_modules"] = {"kept": len(kept) // 2, "zero_left_out": (len(tensors) - len(kept)) // 2}
            stored, packed_meta = pack(kept, lora_format)
            save_file(stored, str(tmp / PACKED_LORA_WEIGHTS), metadata={"format": "pt", **packed_meta})
        from .entry_bridge import EntryBridge, entry_bridge_files

        storage["entry_bridge"] = None
        if entry_bridge_files(src):  # its entry bridge (skipdecode.entry_bridge)
            bridge = EntryBridge.load(src)
            if bridge_targets is not None:
                bridge = bridge.subset(bridge_targets)
            bridge.save(tmp, dtype=bridge_format)
            storage["entry_bridge"] = bridge_format
            storage["entry_bridge_targets"] = bridge.targets
            shipped_bridge = bridge.meta()  # what the stored file holds (the run's may list more targets)
        from .skip_config import weight_checksums
        lora = json.loads((src / _CONFIG).read_text())
        lora["base_model_name_or_path"] = name
        (tmp / _CONFIG).write_text(json.dumps(lora, indent=2, sort_keys=True) + "\n")
        meta.pop("losses", None)
        meta["base_model"] = name
        if relabelled is not None:
            storage["policy_relabelled"] = relabelled
        storage.update(changes)
        meta["storage"] = storage
        if storage["entry_bridge"] is not None:
            meta["entry_bridge"] = shipped_bridge
        meta["weights_sha256"] = weight_checksums(tmp)  # of the stored copy, not of the run's weights
        if isinstance(meta.get("training"), dict):
            meta["training"].get("config", {}).pop("out_dir", None)
        (tmp / _SKIP).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        target = root / name
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
