"""Entry bridges: an affine map where a token's plan jumps over its skipped layers (project extension).

SkipDecode (docs/method.md, rule 3) runs the warm-up layers ``0 .. w-1``, jumps, and feeds the
warm-up output unchanged to the first kept top layer ``s = L - (e(t) - w)``. That layer was
trained on the residual stream *after* layers ``w .. s-1``, which the jump leaves out. An entry
bridge replaces the identity of the jump by an affine map per entry layer ``s``::

    h_in(s) = W_s h_{w-1} + b_s        (W_s: C x C, b_s: C; h_{w-1}: warm-up output, (B, T, C))

fitted by ridge least squares from full-depth hidden states (the linear "short-cut" maps of
Din et al., "Jump to Conclusions: Short-Cutting Transformers with Linear Transformations",
arXiv 2303.09435, applied between two inner layers) and optionally trained further with the
skip adapter. It is **not** part of the paper's method: a model without a bridge decodes exactly
as docs/method.md says, and ``attach_entry_bridge(model, None)`` removes one. Cost: one C x C
matrix-vector product per token per step, about 0.08 of a SmolLM2-135M decoder layer.

:func:`skipdecode.forward.skip_forward` applies the bridge of layer ``s`` to every position
whose plan runs ``s``, does not run ``s - 1``, and ran the bridge's ``source`` layer (the last
warm-up layer; -1 = the embeddings when ``w = 0``), in all three plan forms (one plan, a
per-position mask, a per-row plan). Nothing else changes: the KV cache invariant of docs/method.md
holds as before, since the bridge only changes the input of a layer that runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

__all__ = [
    "EntryBridge", "attach_entry_bridge", "entry_bridge_of", "fit_entry_bridge", "entry_bridge_files",
    "ENTRY_BRIDGE_FILE",
]

ENTRY_BRIDGE_FILE = "entry_bridge.safetensors"
_ATTR = "_skipdecode_entry_bridge"


class EntryBridge(nn.Module):
    """Affine maps ``h -> h @ weight[i].T + bias[i]`` for the entry layers ``targets[i]``.

    Args:
        hidden_size: C, the residual-stream width.
        source: the last layer a token runs before its jump (``warmup_layers - 1``; -1 = the
            embeddings).
        targets: ascending entry layers s > source + 1 that get a map (layers).
        weight: optional (len(targets), C, C) initial weights (default: identity).
        bias: optional (len(targets), C) initial biases (default: zero).

    Raises:
        ValueError: ``targets`` empty, not ascending, or not above ``source + 1``; weight/bias of
            the wrong shape.
    """

    def __init__(self, hidden_size: int, source: int, targets: Sequence[int],
                 weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        targets = [int(t) for t in targets]
        if not targets or targets != sorted(set(targets)) or targets[0] <= source + 1:
            raise ValueError(f"entry bridge targets must be ascending layers above source + 1 = {source + 1}, "
                             f"got {targets}")
        n, C = len(targets), int(hidden_size)
        if weight is None:
            weight = torch.eye(C).expand(n, C, C).clone()
        if bias is None:
            bias = torch.zeros(n, C)
        if tuple(weight.shape) != (n, C, C) or tuple(bias.shape) != (n, C):
            raise ValueError(f"entry bridge weight must be ({n}, {C}, {C}) and bias ({n}, {C}), "
                             f"got {tuple(weight.shape)} and {tuple(bias.shape)}")
        self.source = int(source)
        self.targets = targets
        self._index = {t: i for i, t in enumerate(targets)}
        self.weight = nn.Parameter(weight.float().clone())
        self.bias = nn.Parameter(bias.float().clone())

    def has(self, layer_idx: int) -> bool:
        """Whether entry layer ``layer_idx`` has a map."""
        return layer_idx in self._index

    def forward(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """The bridged input (..., C) of entry layer ``layer_idx`` for the warm-up output ``hidden``
        (..., C), in ``hidden``'s dtype. Raises KeyError for a layer without a map."""
        i = self._index[layer_idx]
        if self.weight.device != hidden.device:  # the model was moved after the bridge was attached
            self.to(hidden.device)
        w, b = self.weight[i], self.bias[i]
        out = torch.nn.functional.linear(hidden.to(w.dtype), w, b)
        return out.to(hidden.dtype)

    def subset(self, targets: Iterable[int]) -> "EntryBridge":
        """A new bridge with the maps of ``targets`` only (a jump to another entry layer then stays
        the identity of docs/method.md), e.g. to ship only the entry layers a schedule reaches.

        Raises:
            ValueError: a target this bridge has no map for, or no target.
        """
        keep = sorted({int(t) for t in targets})
        missing = [t for t in keep if t not in self._index]
        if missing or not keep:
            raise ValueError(f"entry bridge targets must be a non-empty subset of {self.targets}, got {keep}")
        rows = torch.tensor([self._index[t] for t in keep])
        return EntryBridge(self.weight.shape[-1], self.source, keep, weight=self.weight.detach()[rows],
                           bias=self.bias.detach()[rows])

    def meta(self) -> dict[str, Any]:
        """The JSON description stored beside the weights (``skipdecode.json`` ``entry_bridge``)."""
        return {"source": self.source, "targets": list(self.targets), "file": ENTRY_BRIDGE_FILE,
                "hidden_size": int(self.weight.shape[-1]),
                "reference": "Din et al. 2023, arXiv 2303.09435 (linear short-cuts); project extension"}

    def save(self, directory: str | Path, dtype: torch.dtype | str = torch.float32) -> dict[str, Any]:
        """Write ``entry_bridge.safetensors`` into ``directory``; returns :meth:`meta`.

        ``dtype`` float32, float16 or bfloat16 (a torch dtype or its name) stores the weights in
        it; ``torch.int8`` / ``"int8"`` stores them symmetric per output row and ``"int4"`` in
        groups of gcd(C, 64) input channels (:mod:`skipdecode.packing`: a quarter and, at 64,
        about a seventh of float32's bytes); :meth:`load` dequantizes them. The bias stays float32 for int8 and int4.

        Raises:
            ValueError: another dtype or format.
        """
        from safetensors.torch import save_file

        from .packing import PACK_FORMATS, pack

        fmt = str(dtype).removeprefix("torch.")
        if fmt not in PACK_FORMATS:
            raise ValueError(f"entry bridge dtype must be one of {', '.join(PACK_FORMATS)}, got {dtype}")
        meta = self.meta()
        stored, packed_meta = pack({"weight": self.weight, "bias": self.bias}, fmt,
                                   group_size=math.gcd(int(self.weight.shape[-1]), 64),
                                   keep_float32=() if fmt in ("float16", "bfloat16") else ("bias",))
        save_file(stored, str(Path(directory) / ENTRY_BRIDGE_FILE),
                  metadata={"skipdecode_entry_bridge": json.dumps(meta), **packed_meta})
        return meta

    @classmethod
    def load(cls, directory: str | Path) -> "EntryBridge":
        """Read ``entry_bridge.safetensors`` from ``directory`` (float32 in memory; int8 and int4
        weights are dequantized, :func:`skipdecode.packing.unpack`).

        Raises:
            FileNotFoundError: no bridge file there.
            ValueError: the file lacks its metadata or its shapes disagree with it.
        """
        from safetensors import safe_open

        from .packing import unpack

        path = Path(directory) / ENTRY_BRIDGE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no {ENTRY_BRIDGE_FILE} in {directory}")
        with safe_open(str(path), "pt") as f:
            raw = (f.metadata() or {}).get("skipdecode_entry_bridge")
            if raw is None:
                raise ValueError(f"{path} has no skipdecode_entry_bridge metadata")
            meta = json.loads(raw)
            stored = {name: f.get_tensor(name) for name in f.keys()}
            file_meta = f.metadata()
        if "weight_int8" in stored:  # the int8 layout of skipdecode 0.x before skipdecode.packing
            weight = stored["weight_int8"].float() * stored["weight_scale"].float()
            bias = stored["bias"].float()
        else:
            tensors = unpack(stored, file_meta)
            weight, bias = tensors["weight"], tensors["bias"]
        return cls(weight.shape[-1], meta["source"], meta["targets"], weight=weight, bias=bias)


def entry_bridge_files(directory: str | Path) -> bool:
    """Whether ``directory`` holds an entry bridge file."""
    return (Path(directory) / ENTRY_BRIDGE_FILE).is_file()


def _inner(model: Any) -> Any:
    """The HF model under a peft wrapper (or ``model`` itself)."""
    base = getattr(model, "base_model", None)
    inner = getattr(base, "model", None)
    return inner if base is not None and inner is not None and base is not model else model


def attach_entry_bridge(model: Any, bridge: EntryBridge | None) -> None:
    """Make ``skip_forward`` on ``model`` (an HF model or a peft wrapper) use ``bridge`` (None: remove).

    The bridge is kept outside the model's module tree (its ``state_dict`` and HF/peft saving
    are unchanged) and moved to the model's device. Raises ValueError when its width is not the
    model's ``hidden_size``."""
    target = _inner(model)
    if bridge is None:
        target.__dict__.pop(_ATTR, None)
        return
    hidden = getattr(getattr(target, "config", None), "hidden_size", None)
    if hidden is not None and int(hidden) != bridge.weight.shape[-1]:
        raise ValueError(f"entry bridge width {bridge.weight.shape[-1]} != the model's hidden_size {hidden}")
    param = next(iter(target.parameters()), None)
    if param is not None:
        bridge.to(param.device)
    target.__dict__[_ATTR] = bridge


def entry_bridge_of(model: Any) -> EntryBridge | None:
    """The bridge attached to ``model`` (HF model or peft wrapper) by :func:`attach_entry_bridge`, or None."""
    return _inner(model).__dict__.get(_ATTR)


@torch.no_grad()
def fit_entry_bridge(
    hidden_states: Iterable[tuple[torch.Tensor, ...]],
    source: int,
    targets: Sequence[int],
    ridge: float = 1e-2,
) -> tuple[EntryBridge, dict[int, float]]:
    """Ridge least-squares bridge from full-depth hidden states (Din et al. 2023, Sec. 3).

    Args:
        hidden_states: per chunk of positions, HF's ``output_hidden_states`` tuple restricted to
            those positions: entry l is the input of layer l, (N, C) (entry 0 = the embeddings).
        source: the last warm-up layer (-1: embeddings); X = entry ``source + 1``.
        targets: entry layers s; Y_s = entry ``s`` (the input of layer s at full depth).
        ridge: lambda, relative to the mean diagonal of X^T X (unitless).

    Solves ``min_W ||[X 1] W - Y_s||^2 + lambda * mean(diag) * ||W||^2`` in float64 for every s.

    Returns:
        ``(bridge, relative_residual)``: the bridge and, per target, ||[X 1] W - Y||^2 /
        ||Y - mean(Y)||^2 on the fitting positions (the identity jump has
        ||X - Y||^2 / ||Y - mean(Y)||^2).

    Raises:
        ValueError: no positions, or ``ridge`` < 0.
    """
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    G = XY = None
    n, y_sum, y_sq = 0, {}, {}
    for hs in hidden_states:
        x = hs[source + 1].double()
        xa = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], 1)
        G = xa.T @ xa if G is None else G + xa.T @ xa
        if XY is None:
            XY = {s: torch.zeros(xa.shape[1], x.shape[1], dtype=x.dtype, device=x.device) for s in targets}
        for s in targets:
            y = hs[s].double()
            XY[s] += xa.T @ y
            y_sum[s] = y_sum.get(s, 0) + y.sum(0)
            y_sq[s] = y_sq.get(s, 0) + (y * y).sum()
        n += x.shape[0]
    if not n:
        raise ValueError("fit_entry_bridge got no positions")
    C = G.shape[0] - 1
    reg = G + ridge * (G.diagonal()[:C].mean()) * torch.eye(C + 1, dtype=G.dtype, device=G.device)
    weights, biases, rel = [], [], {}
    for s in targets:
        W = torch.linalg.solve(reg, XY[s])  # (C + 1, C)
        # ||XaW - Y||^2 = W^T G W - 2 W^T XY + Y^T Y, from the accumulated moments
        sse = (W * (G @ W)).sum() - 2 * (W * XY[s]).sum() + y_sq[s]
        sst = y_sq[s] - (y_sum[s] * y_sum[s]).sum() / n
        rel[s] = float(sse / sst)
        weights.append(W[:C].T.float().cpu())
        biases.append(W[C].float().cpu())
    return EntryBridge(C, source, targets, torch.stack(weights), torch.stack(biases)), rel
