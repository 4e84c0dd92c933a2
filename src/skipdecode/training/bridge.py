"""Fitting the entry bridge before training (``TrainConfig.entry_bridge``; :mod:`skipdecode.entry_bridge`).

Part of the :mod:`skipdecode.training` package.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import torch

from ..entry_bridge import EntryBridge, fit_entry_bridge
from ..policy import FullPolicy, SkipPolicy
from .batching import TokenizedExample
from .config import TrainConfigError

__all__ = ["bridge_source", "fit_training_bridge"]

log = logging.getLogger("skipdecode.train")


def bridge_source(policies: Sequence[tuple[str, SkipPolicy]]) -> int:
    """The bridge's source layer, ``warmup_layers - 1``, shared by every trained skip policy
    (full-depth policies never jump and are ignored).

    Raises:
        TrainConfigError: ``entry_bridge`` with skip policies of different warm-up depths (one
            bridge maps from one layer), or with full-depth policies only.
    """
    warm = {int(p.warmup_layers) for _, p in policies if not isinstance(p, FullPolicy)}
    if not warm:
        raise TrainConfigError("entry_bridge", "needs a skip policy: every policy runs at full depth, so no token jumps")
    if len(warm) != 1:
        raise TrainConfigError("entry_bridge", f"needs one warmup_layers for every policy, got {sorted(warm)}")
    return warm.pop() - 1


def _hidden_chunks(hf_model: Any, items: Sequence[TokenizedExample], device: Any) -> Iterator[tuple[torch.Tensor, ...]]:
    """Per example, the full-depth hidden states (HF ``output_hidden_states``) at the positions
    that predict a response token from a decode step: the response tokens but the last, (N, C) each."""
    for x in items:
        if len(x.response_ids) < 2:
            continue
        ids = torch.tensor([list(x.prompt_ids) + list(x.response_ids)], device=device)
        hs = hf_model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        P, R = len(x.prompt_ids), len(x.response_ids)
        yield tuple(h[0, P:P + R - 1].detach() for h in hs)


@torch.no_grad()
def fit_training_bridge(hf_model: Any, items: Sequence[TokenizedExample | None],
                        policies: Sequence[tuple[str, SkipPolicy]], num_layers: int, max_examples: int,
                        progress: bool = False) -> tuple[EntryBridge, dict[str, Any]]:
    """Fit an entry bridge for every possible entry layer on the first ``max_examples`` examples.

    Args:
        hf_model: the base HF model (full depth, no LoRA yet).
        items: the tokenized training examples (None entries are skipped).
        policies: the run's ``(label, policy)`` pairs (their warm-up depth gives the source layer).
        num_layers: L; targets are ``source + 2 .. L - 1`` (every layer a jump can land on).
        max_examples: how many examples feed the fit.
        progress: show a tqdm bar.

    Returns:
        ``(bridge, record)``: the bridge (float32, on the CPU) and what to record (examples,
        positions, mean relative residual of the bridge).

    Raises:
        TrainConfigError: mixed warm-up depths, or no example with two or more response tokens.
    """
    from tqdm.auto import tqdm

    source = bridge_source(policies)
    targets = list(range(source + 2, num_layers))
    if not targets:
        raise TrainConfigError("entry_bridge", f"no layer to bridge to with {num_layers} layers")
    chosen = [x for x in items if x is not None][:max_examples]
    device = next(hf_model.parameters()).device
    was_training = hf_model.training
    hf_model.eval()
    counted = {"positions": 0, "examples": 0}

    def chunks() -> Iterator[tuple[torch.Tensor, ...]]:
        for hs in _hidden_chunks(hf_model, tqdm(chosen, desc="entry bridge", disable=not progress), device):
            counted["positions"] += hs[0].shape[0]
            counted["examples"] += 1
            yield hs

    try:
        bridge, rel = fit_entry_bridge(chunks(), source, targets)
    except ValueError as e:
        raise TrainConfigError("entry_bridge", f"cannot fit: {e}") from None
    finally:
        hf_model.train(was_training)
    record = {**counted, "source": source, "targets": targets,
              "relative_residual_mean": sum(rel.values()) / len(rel)}
    log.info("entry bridge fitted on %d positions of %d examples (relative residual %.3f)",
             counted["positions"], counted["examples"], record["relative_residual_mean"])
    return bridge, record
