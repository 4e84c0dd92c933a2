"""The starting model of a run: what it may be and how full fine-tuning makes it trainable.

A run may start from any model :func:`skipdecode.load` reads, a finished run's ``final/``
included. A LoRA run's ``final/`` holds only the adapter: ``load`` merges it into its base
(``W + (alpha / r) B A``) through peft, whose merge leaves every base weight with
``requires_grad=False``; ``load`` switches them back on, so a full run (``lora_r == 0``) continues
from the merged weights and trains all of them, and a model with no trainable weight at all is
refused by name (:func:`trainable_for_full_fine_tuning`). A decode-only adapter (trained with
``base_prefill``) prefills with other weights than it decodes with, which one trained model
cannot hold: such a start is
refused before any work (:func:`prepare_start_model`), naming the LoRA run that continues it.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import TrainConfig, TrainConfigError

__all__ = ["prepare_start_model", "trainable_for_full_fine_tuning"]


def trainable_for_full_fine_tuning(hf_model: nn.Module) -> nn.Module:
    """``hf_model`` for full fine-tuning: the weights whose ``requires_grad`` is set train, so a
    caller's own freezing (e.g. of the embeddings) is kept. :func:`skipdecode.load` returns every
    weight trainable, a merged LoRA adapter's included (peft's merge left them frozen, the fault
    this once worked around here).

    Raises:
        TrainConfigError: (field ``base_model``, the CLI's ``--model``) no weight of ``hf_model``
            requires grad, so a step would have no gradient (it failed deep in the backward pass)."""
    if not any(p.requires_grad for p in hf_model.parameters()):
        raise TrainConfigError("base_model", "has no trainable weight (every parameter has requires_grad=False): "
                                             "unfreeze the weights to fine-tune, or give --lora-r R")
    return hf_model


def prepare_start_model(sk: Any, name: str | None, config: TrainConfig) -> None:
    """Check the starting model and name it as the run's saved files will.

    Refuses a model that runs a decode-only LoRA adapter (``load`` of a run trained with
    ``base_prefill``): its prompt runs the base weights and its decode steps the merged ones,
    and a run saves one set of weights. Then sets the HF model's ``name_or_path`` (and its
    config's), which peft writes into a LoRA run's ``adapter_config.json`` and model card, to
    ``name`` as :func:`skipdecode.paths.loadable_path` writes it, as ``skipdecode.json``'s
    ``base_model`` (not this machine's absolute path, nor the cache folder of the embedded model).

    Args:
        sk: the loaded :class:`~skipdecode.model.SkipModel`.
        name: where it was loaded from (for the message), or None.
        config: the run's settings (for the suggested LoRA rank).

    Raises:
        TrainConfigError: (field ``base_model``, the CLI's ``--model``) the model runs a
            decode-only adapter; the message gives the options that continue it as a LoRA run.
    """
    from ..lowrank import has_decode_only_adapter
    from ..paths import loadable_path

    if not has_decode_only_adapter(sk.model):
        if name:
            sk.model.name_or_path = sk.model.config.name_or_path = loadable_path(name)
        return
    meta = sk.skip_config if isinstance(sk.skip_config, dict) else {}
    base = meta.get("base_model") or "ITS_BASE"
    rank = config.lora_r or ((meta.get("training") or {}).get("config") or {}).get("lora_r") or "R"
    where = loadable_path(name) if name else "the model"
    raise TrainConfigError(
        "base_model", f"{where} runs a decode-only LoRA adapter (trained with --base-prefill): its prompt runs "
                      "other weights than its decode steps, which one trained model cannot hold; continue it as a "
                      f"LoRA run: --model {base} --lora-r {rank} --init-adapter {where} --base-prefill --no-prompt-grad")
