"""LoRA adapters kept unmerged, as a float low-rank path beside quantized weights.

Merging a LoRA adapter (``W + (alpha / r) B A``, Hu et al. 2021, eq. 3) and *then* quantizing to
int4 loses the adapter: the embedded model's weights come from a 4-bit GGUF file, so they already
sit on a 4-bit grid, and a fine-tuning delta smaller than half a grid step is rounded straight back
to the base weights. Measured on SmolLM2-135M (``benchmarks/quant_delta.py``): int4 keeps 15 % of
the shipped skip adapter's delta and 7 % of a full 2x fine-tune's, int8 keeps 100 % of both. So
with ``load(..., quantize="int4")`` an adapter stays a separate float path,
``y = Q(W) x + (alpha / r) B (A x)`` (QLoRA's inference form, Dettmers et al. 2023): exact for the
adapter, and at rank 8 it adds 2 x r x (in + out) multiply-adds per token and linear.

**Decode-only adapters** (trained with ``TrainConfig.base_prefill``): the base model prefills the
prompt and the adapter runs on decode steps only. Every wrapper of a model shares one
:class:`PrefillSwitch`; inside :func:`base_prefill` an unmerged wrapper drops its delta, and a
wrapper around weights the delta was merged into (float32, int8) subtracts it again,
``y = (W + s B A) x - s B (A x)``, so decoding keeps the merged weights' speed and only the
prefill (compute-bound, many tokens) pays the two thin products.

**Decode steps that run every layer run the base model too** (a decode-only adapter is for
skipping): the static loop enters :func:`base_prefill` for such a step, and an in-flight step whose
rows mix full-depth and skipping plans marks its full-depth rows with :func:`base_rows` (the
wrappers then take the delta out of those rows only, :func:`narrow_rows` following the rows a
layer runs on). So a policy's full-depth first steps
(:attr:`skipdecode.policy.LinearDecayPolicy.full_depth_steps`) write the base model's own tokens,
and a full-depth request to a model with a skip adapter gets the base model's answer.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import guard_memo

__all__ = ["LowRankLinear", "PrefillSwitch", "base_prefill", "base_rows", "narrow_rows", "has_decode_only_adapter", "read_lora", "attach_lora",
           "LoraFormatError", "LORA_WEIGHTS", "PACKED_LORA_WEIGHTS", "lora_weights_file", "read_lora_tensors"]

#: attribute of the HF model that holds its decode-only adapter's :class:`PrefillSwitch`
SWITCH_ATTR = "_skipdecode_prefill_switch"

_PREFIX = "base_model.model."
#: peft's weights file of a LoRA adapter folder
LORA_WEIGHTS = "adapter_model.safetensors"
#: the same tensors stored compactly (:mod:`skipdecode.packing`, e.g. int8), which peft cannot read
PACKED_LORA_WEIGHTS = "adapter_model.packed.safetensors"
#: adapter_config.json fields whose non-default values change what the adapter computes
_UNSUPPORTED = {"use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


class LoraFormatError(ValueError):
    """The folder is not a plain LoRA adapter this module can apply, or it does not fit the model."""


class PrefillSwitch:
    """Shared by the :class:`LowRankLinear` wrappers of one model: ``base`` is True while the base
    model runs (a decode-only adapter's prefill, :func:`base_prefill`); ``rows``, a (n,) bool
    tensor or None, marks the rows of the current call that run the base model (:func:`base_rows`)."""

    def __init__(self) -> None:
        self.base = False
        self.rows: torch.Tensor | None = None


class LowRankLinear(nn.Module):
    """``base(x) + scaling * (x A^T) B^T``: a linear layer (float or quantized) plus an unmerged
    LoRA delta in float32; or, for a decode-only adapter, its prefill switch (module docstring).

    Args:
        base: the layer it wraps; input (..., in_features) -> output (..., out_features).
        lora_A: (r, in_features) float.
        lora_B: (out_features, r) float.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), a float.
        merged: the delta is already merged into ``base``'s weights; the wrapper then only
            subtracts it while ``switch.base`` is set (needs ``switch``).
        switch: a decode-only adapter's :class:`PrefillSwitch` (None: the delta always applies).

    Raises:
        LoraFormatError: the shapes do not fit ``base``'s in/out features or each other.
        ValueError: ``merged`` without a ``switch``.
    """

    def __init__(self, base: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, *,
                 merged: bool = False, switch: PrefillSwitch | None = None) -> None:
        super().__init__()
        n_in, n_out = _check_lora_shapes(base, lora_A, lora_B)
        self.base = base
        self.in_features, self.out_features = n_in, n_out
        self.register_buffer("lora_A", lora_A.detach().float().contiguous())
        self.register_buffer("lora_B", lora_B.detach().float().contiguous())
        self.scaling = float(scaling)
        if merged and switch is None:
            raise ValueError("merged=True needs a PrefillSwitch: a merged delta is only ever subtracted in the prefill")
        self.merged = merged
        self.switch = switch

    def _plus_delta(self, out: torch.Tensor, x: torch.Tensor, sign: float) -> torch.Tensor:
        """``out + sign * scaling * (x A^T) B^T`` as one ``addmm`` over the flattened tokens, so a
        prefill of many tokens reads and writes its (tokens, out_features) output once instead of
        three times (product, scaling, sum)."""
        xa = F.linear(x.to(self.lora_A.dtype), self.lora_A)  # (..., r)
        flat = out.reshape(-1, self.out_features).to(self.lora_B.dtype)
        res = torch.addmm(flat, xa.reshape(-1, xa.shape[-1]), self.lora_B.t(), alpha=sign * self.scaling)
        return res.reshape(out.shape).to(out.dtype)

    def _row_delta(self, out: torch.Tensor, x: torch.Tensor, base_rows: torch.Tensor) -> torch.Tensor:
        """``out`` (n, ..., out_features) plus the delta on the rows that keep the adapter: rows
        where ``base_rows`` (n,) is set get the base model's output (merged: the delta taken out;
        unmerged: none added)."""
        if base_rows.shape[0] != x.shape[0]:
            raise RuntimeError(f"base rows mark {base_rows.shape[0]} rows, the call has {x.shape[0]}")
        keep = (~base_rows).to(device=x.device, dtype=self.lora_A.dtype)
        weight = keep - 1.0 if self.merged else keep  # merged: -1 on base rows; unmerged: +1 on the others
        xa = F.linear(x.to(self.lora_A.dtype), self.lora_A) * weight.view(-1, *([1] * (x.dim() - 1)))
        return (out.to(self.lora_B.dtype) + self.scaling * F.linear(xa, self.lora_B)).to(out.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features): base plus the delta, or the base model's
        output while a decode-only adapter's switch is on (for the rows it marks, if it marks rows)."""
        base_only = self.switch is not None and self.switch.base
        if not base_only and self.switch is not None and self.switch.rows is not None:
            return self._row_delta(self.base(x), x, self.switch.rows)
        if self.merged:
            return self._plus_delta(self.base(x), x, -1.0) if base_only else self.base(x)
        return self.base(x) if base_only else self._plus_delta(self.base(x), x, 1.0)


@contextmanager
def base_prefill(model: nn.Module) -> Iterator[None]:
    """Run ``model`` (the HF model) as its base model inside the block when it carries a
    decode-only adapter (:func:`attach_lora` with ``decode_only``); otherwise do nothing.
    Every prefill site of the generation loop enters it (generate, the in-flight engine, CALM)."""
    switch = getattr(model, SWITCH_ATTR, None)
    if switch is None or switch.base:
        yield
        return
    switch.base = True
    try:
        yield
    finally:
        switch.base = False


@contextmanager
def _marked_rows(switch: PrefillSwitch, rows: torch.Tensor) -> Iterator[None]:
    """``switch.rows = rows`` inside the block, the previous marking restored on exit. The row
    count is marked symbolic for ``torch.compile`` (:mod:`skipdecode.compiled`): compiled layer
    calls then serve any batch of mixed rows with one graph."""
    if rows.shape[0] > 1:
        torch._dynamo.maybe_mark_dynamic(rows, 0)
    saved, switch.rows = switch.rows, rows
    try:
        yield
    finally:
        switch.rows = saved


@contextmanager
def base_rows(model: nn.Module, rows: torch.Tensor) -> Iterator[None]:
    """Inside the block, the rows of ``model``'s calls marked in ``rows`` ((B,) bool) run the base
    model when it carries a decode-only adapter: all of them (:func:`base_prefill`), none (nothing
    changes), or some (the wrappers take the delta out of those rows, :meth:`LowRankLinear._row_delta`;
    a layer run on a subset of the rows must enter :func:`narrow_rows`). The marking moves to the
    model's device once here, not in every wrapper. Without such an adapter, or already inside
    :func:`base_prefill`, it does nothing."""
    switch = getattr(model, SWITCH_ATTR, None)
    if switch is None or switch.base or not bool(rows.any()):
        yield
        return
    if bool(rows.all()):
        with base_prefill(model):
            yield
        return
    device = next(model.parameters()).device
    with _marked_rows(switch, rows.to(device=device, dtype=torch.bool)):
        yield


@contextmanager
def narrow_rows(model: nn.Module, index: torch.Tensor) -> Iterator[None]:
    """Inside the block, the rows marked by :func:`base_rows` are those of ``index`` (n,) (the
    rows a layer runs on, gathered in that order); nothing changes when none are marked."""
    switch = getattr(model, SWITCH_ATTR, None)
    if switch is None or switch.rows is None:
        yield
        return
    with _marked_rows(switch, switch.rows.index_select(0, index.to(switch.rows.device))):
        yield


def has_decode_only_adapter(model: nn.Module) -> bool:
    """True when ``model`` (the HF model) carries a decode-only adapter."""
    return getattr(model, SWITCH_ATTR, None) is not None


def _check_lora_shapes(base: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor) -> tuple[int, int]:
    """``(in, out)`` features of ``base`` after checking that A (r, in) and B (out, r) fit it.

    Raises:
        LoraFormatError: they do not fit (names both shapes), or ``base`` has no in/out features.
    """
    n_in, n_out = _features(base)
    r = lora_A.shape[0]
    if lora_A.shape != (r, n_in) or lora_B.shape != (n_out, r):
        raise LoraFormatError(f"LoRA shapes A {tuple(lora_A.shape)}, B {tuple(lora_B.shape)} do not fit a "
                              f"{n_in} -> {n_out} linear")
    return n_in, n_out


def _features(module: nn.Module) -> tuple[int, int]:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    if hasattr(module, "nf") and hasattr(module, "weight"):  # GPT-2 Conv1D: weight (in, out)
        return int(module.weight.shape[0]), int(module.nf)
    raise LoraFormatError(f"cannot attach LoRA to a {type(module).__name__} (no in/out features)")


def lora_weights_file(path: str | os.PathLike) -> Path | None:
    """The weights file of the LoRA adapter folder ``path``: peft's :data:`LORA_WEIGHTS`, else
    :data:`PACKED_LORA_WEIGHTS`, else None."""
    for name in (LORA_WEIGHTS, PACKED_LORA_WEIGHTS):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def read_lora_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The float32 tensors (peft key names) of the adapter folder ``path``'s weights file, packed
    ones dequantized (:func:`skipdecode.packing.unpack`).

    Raises:
        LoraFormatError: no weights file, or a file that cannot be read or unpacked (names it).
    """
    from safetensors import SafetensorError, safe_open

    from .packing import unpack

    weights = lora_weights_file(path)
    if weights is None:
        raise LoraFormatError(f"adapter {path}: needs {LORA_WEIGHTS} (or {PACKED_LORA_WEIGHTS})")
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        return unpack(stored, meta)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraFormatError(f"adapter {weights}: cannot be read ({type(e).__name__}: {e})") from None


def read_lora(path: str | os.PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The deltas of the peft LoRA adapter in folder ``path``.

    Returns:
        ``{module path in the HF model (e.g. "model.layers.0.self_attn.q_proj"): (A (r, in),
        B (out, r), scaling)}`` with float32 tensors.

    Raises:
        LoraFormatError: no adapter_config.json or weights file (:func:`lora_weights_file`), not a
            LoRA adapter, an option the unmerged path does not compute (DoRA, rank or alpha
            patterns, modules to save), or a module with only one of its two matrices.
    """
    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", lora_weights_file(path)
    if not cfg_file.is_file() or weights is None:
        raise LoraFormatError(f"adapter {path}: needs adapter_config.json and {LORA_WEIGHTS} (or {PACKED_LORA_WEIGHTS})")
    cfg = json.loads(cfg_file.read_text())
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraFormatError(f"adapter {path}: peft_type is {cfg.get('peft_type')!r}, not LORA")
    for key, default in _UNSUPPORTED.items():
        if cfg.get(key, default) not in (default, None, {}, False):
            raise LoraFormatError(f"adapter {path}: '{key}' is set; int4 keeps adapters unmerged and that path "
                                  "computes plain LoRA only (use quantize='int8', which merges it)")
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / (r ** 0.5 if cfg.get("use_rslora") else r)
    tensors = read_lora_tensors(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0]
                module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
                pairs.setdefault(module, {})[part] = t.float()
    out = {}
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoraFormatError(f"adapter {path}: {module} has only {', '.join(ab)}")
        out[module] = (ab["lora_A"], ab["lora_B"], scaling)
    if not out:
        raise LoraFormatError(f"adapter {path}: no lora_A/lora_B weights in {weights.name}")
    return out


def _attach_group(members: list, merged: bool, switch: PrefillSwitch | None) -> None:
    """One :class:`LowRankLinear` around a fused group's product (:mod:`skipdecode.fused_linear`)
    for the deltas of its members: ``A`` stacks the members' ``A_i`` (sum r_i, in), ``B`` is block
    diagonal (out_total, sum r_i) with ``s_i B_i`` in member i's output columns and its own rank's
    columns (zeros elsewhere: a member without a delta gets none). So ``B (A x)`` holds every
    member's ``s_i B_i (A_i x)`` in its columns: two thin products per group instead of two per
    member (the float sums differ from the separate ones by rounding only)."""
    from .fused_linear import replace_group_linear

    group = members[0][0].group
    lin = group.linear
    a_cat = torch.cat([a.float() for _, a, _, _ in members], 0)
    b_bd = torch.zeros(lin.out_features, a_cat.shape[0], dtype=torch.float32)
    offset = 0
    for member, a, b, scaling in members:
        b_bd[member.start:member.stop, offset:offset + a.shape[0]] = scaling * b.float()
        offset += a.shape[0]
    tensors = [*lin.parameters(), *lin.buffers()]
    wrapped = LowRankLinear(lin, a_cat, b_bd, 1.0, merged=merged, switch=switch)
    replace_group_linear(members[0][0], wrapped.to(tensors[0].device if tensors else a_cat.device))


def attach_lora(model: nn.Module, path: str | os.PathLike, *, merged: bool = False, decode_only: bool = False) -> int:
    """Wrap every module that the adapter in ``path`` adapts in a :class:`LowRankLinear`
    (in place; after quantization, so the wrapped layer may be an int8/int4 module). Fused
    siblings (:mod:`skipdecode.fused_linear`) get one wrapper around their group's product,
    holding all their deltas (:func:`_attach_group`).

    Args:
        model: the HF model.
        path: the LoRA adapter folder.
        merged: the adapter is already merged into ``model``'s weights (needs ``decode_only``:
            the wrappers then only take it out again in :func:`base_prefill`).
        decode_only: the adapter was trained for decode steps only (``TrainConfig.base_prefill``):
            the wrappers share one :class:`PrefillSwitch`, stored on ``model``.

    Returns:
        The number of adapted modules (the adapter's module paths).

    Raises:
        LoraFormatError: see :func:`read_lora`; a module path the model does not have; shapes
            that do not fit.
    """
    if merged and not decode_only:
        raise ValueError("attach_lora: merged=True is for decode-only adapters (decode_only=True)")
    from .fused_linear import FusedSlice

    deltas = read_lora(path)
    switch = (getattr(model, SWITCH_ATTR, None) or PrefillSwitch()) if decode_only else None
    groups: dict[int, list] = {}  # fused siblings (q/k/v, gate/up): one low-rank path per group
    for name, (a, b, scaling) in deltas.items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            base = getattr(parent, child)
        except AttributeError:
            raise LoraFormatError(f"adapter {path} adapts {name}, which this model does not have") from None
        try:
            _check_lora_shapes(base, a, b)
        except LoraFormatError as e:
            raise LoraFormatError(f"adapter {path}, {name}: {e}") from None
        if isinstance(base, FusedSlice):
            groups.setdefault(id(base.group), []).append((base, a, b, scaling))
            continue
        wrapped = LowRankLinear(base, a, b, scaling, merged=merged, switch=switch)
        tensors = [*base.parameters(), *base.buffers()]  # a quantized layer holds only buffers
        setattr(parent, child, wrapped.to(tensors[0].device if tensors else a.device))
    for members in groups.values():
        _attach_group(members, merged, switch)
    if switch is not None:
        object.__setattr__(model, SWITCH_ATTR, switch)  # a plain attribute, not a submodule
    guard_memo.invalidate()  # new modules: compiled calls must be checked again
    return len(deltas)
