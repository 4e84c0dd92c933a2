"""Compact storage of shipped adapter tensors: per-row int8 and group-wise int4 (dequantized at load).

The skip adapter shipped with the embedded model (:mod:`skipdecode.skip_adapter`) is package
data, so its bytes are everybody's download. Its tensors are stored in one of these formats and
turned back into float32 when loaded; nothing runs in the packed form.

- ``float32`` / ``float16`` / ``bfloat16``: the tensor as ``name``.
- ``int8``: symmetric, one scale per output row: ``name.int8`` (N, K) int8 and ``name.scale``
  (N, 1) float16, ``scale = max_k |W[n, k]| / 127`` rounded *up* to float16 (at most ``2^-10``
  relative), ``W' = q * scale`` (the per-channel absmax scheme of LLM.int8(), Dettmers et al.
  2022, Sec. 3.1, without outlier columns). No code is clamped, so a weight moves by at most
  ``scale / 2`` of its stored scale.
- ``int4``: asymmetric per group of ``group_size`` input channels, the scheme of
  :mod:`skipdecode.int4pack` (step and zero in bfloat16; a weight moves by at most half its step):
  ``name.int4`` (N, K // 2) uint8, two codes per byte (low nibble = even channel), and
  ``name.int4_sz`` (G, N, 2) bfloat16. K must be a multiple of ``group_size``.

A tensor of more than two dimensions is packed as (prod(leading), K) rows and reshaped back; its
shape is kept in the safetensors metadata (``skipdecode_packed``, a JSON object ``{name:
{"format", "shape", "group_size"}}``), which :func:`unpack` reads. A file without that metadata
is a plain safetensors file and :func:`unpack` returns its tensors as float32.
"""

from __future__ import annotations

import json
from typing import Any, Collection

import torch

from . import int4pack

__all__ = ["PACK_FORMATS", "PACKED_META", "pack", "unpack", "packed_formats"]

#: storage formats :func:`pack` writes
PACK_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
#: safetensors metadata key that lists the packed tensors
PACKED_META = "skipdecode_packed"
_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (..., K), at least two dimensions, as float32 rows (prod(...), K) on the CPU."""
    return t.detach().to("cpu", torch.float32).reshape(-1, t.shape[-1])


def pack(tensors: dict[str, torch.Tensor], fmt: str, group_size: int = 64,
         keep_float32: Collection[str] = ()) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Pack every tensor of ``tensors`` in format ``fmt`` (see the module docstring).

    Args:
        tensors: name -> float tensor of any shape (an int4 tensor's last dimension K must be a
            multiple of ``group_size``; one-dimensional tensors such as biases are kept float32
            under int8 and int4, where per-row scales would cost as much as they save).
        fmt: one of :data:`PACK_FORMATS`.
        group_size: int4 input channels per (step, zero) pair.
        keep_float32: names stored as float32 whatever ``fmt`` is (e.g. biases).

    Returns:
        ``(stored, metadata)``: the tensors to write with ``safetensors.torch.save_file`` and its
        ``metadata`` argument (``{PACKED_META: json}``).

    Raises:
        ValueError: an unknown ``fmt``, or an int4 tensor whose last dimension is not a multiple
            of ``group_size`` (names the tensor).
    """
    if fmt not in PACK_FORMATS:
        raise ValueError(f"pack format must be one of {', '.join(PACK_FORMATS)}, got {fmt!r}")
    stored: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        shape = list(t.shape)
        kind = fmt if (fmt in _FLOATS or t.ndim >= 2) and name not in keep_float32 else "float32"
        if kind in _FLOATS:
            stored[name] = t.detach().to("cpu", _FLOATS[kind]).contiguous()
        elif kind == "int8":
            w = _rows(t)
            exact = (w.abs().amax(-1, keepdim=True) / 127).clamp_min(2.0 ** -24)
            scale = exact.to(torch.float16)  # rounded up below: no code leaves [-127, 127]
            scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, 65504.0)), scale)
            stored[name + ".int8"] = torch.round(w / scale.float()).clamp(-127, 127).to(torch.int8).contiguous()
            stored[name + ".scale"] = scale.contiguous()
        else:
            w = _rows(t)
            if w.shape[-1] % group_size or w.shape[-1] % 2:
                raise ValueError(f"int4 packing of {name}: last dimension {w.shape[-1]} is not a multiple of "
                                 f"group_size {group_size}")
            codes, sz = int4pack.quantize_groups(w, group_size)
            stored[name + ".int4"] = int4pack.nibble_pack(codes)
            stored[name + ".int4_sz"] = sz
        index[name] = {"format": kind, "shape": shape, "group_size": group_size if kind == "int4" else None}
    return stored, {PACKED_META: json.dumps(index, sort_keys=True)}


def unpack(stored: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    """The float32 tensors of a file written from :func:`pack` (``stored`` = its tensors,
    ``metadata`` = its safetensors metadata); a file without :data:`PACKED_META` is returned as
    float32 tensors under their own names.

    Raises:
        ValueError: the metadata is not valid JSON, or names a tensor or part the file lacks, or
            an unknown format (the message names the tensor).
    """
    raw = (metadata or {}).get(PACKED_META)
    if raw is None:
        return {k: v.float() for k, v in stored.items()}
    try:
        index = json.loads(raw)
        out = {}
        for name, info in index.items():
            kind, shape = info["format"], tuple(info["shape"])
            if kind in _FLOATS:
                w = stored[name].float()
            elif kind == "int8":
                w = stored[name + ".int8"].float() * stored[name + ".scale"].float()
            elif kind == "int4":
                w = int4pack.dequantize(int4pack.nibble_unpack(stored[name + ".int4"]), stored[name + ".int4_sz"])
            else:
                raise ValueError(f"tensor {name}: unknown packed format {kind!r}")
            out[name] = w.reshape(shape)
    except (KeyError, TypeError, json.JSONDecodeError, RuntimeError) as e:
        raise ValueError(f"packed tensors do not match their {PACKED_META} metadata ({type(e).__name__}: {e})") from None
    return out


def packed_formats(metadata: dict[str, str] | None) -> list[str]:
    """The sorted distinct formats named in a file's :data:`PACKED_META` metadata ([] for a plain file)."""
    raw = (metadata or {}).get(PACKED_META)
    if raw is None:
        return []
    try:
        return sorted({info["format"] for info in json.loads(raw).values()})
    except (TypeError, KeyError, json.JSONDecodeError):
        return []
