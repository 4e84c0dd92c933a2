"""The int4 weight scheme and PyTorch's own CPU int4 kernel, for :class:`skipdecode.quantize.Int4Linear`.

Scheme (asymmetric, one step ``s`` and one zero ``z`` per group of ``group_size`` consecutive
input channels of an output channel, both stored in bfloat16, codes ``q`` in [0, 15]):

    W'[n, k] = (q[n, k] - 8) * s[n, g] + z[n, g]          (g = k // group_size)

This is the dequantization of PyTorch's weight-only int4 kernel
``aten._weight_int4pack_mm_for_cpu`` (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``: codes
shifted to [-8, 7], ``value * scale + zero`` with bfloat16 scales and zeros; the same convention as
torchao's "tinygemm" int4 layout, whose zero is the float value of code 8). Our former scheme
(``W' = q * s + min``, float32 ``s``/``min``) maps onto it exactly by ``z = min + 8 s``; what
changes is only that ``s`` and ``z`` are bfloat16. :func:`quantize_groups` picks them so that the
rounding bound keeps its form:

- ``s = (max - min) / 15`` of the group, floored at ``2^-6 max |W|`` (only a nearly constant
  group, range under a quarter of its largest weight, reaches the floor) and 1 for an all-zero
  group, then rounded *up* to bfloat16, so 16 steps of ``s`` still span ``[min, max]``;
- ``z = bfloat16(min + 8 s)`` (round to nearest: moves the grid by ``|dz| <= 2^-8 |z|``, and with
  the floor ``|z| <= max |W| + 8 s <= 72 s``, so ``|dz| <= 0.29 s``);
- ``q = clamp(round((W - z) / s) + 8, 0, 15)``.

A weight inside the grid moves by at most ``s / 2``; a clamped one (the group's extremes, when
the grid moved) by at most ``|dz| < s / 2``. So every weight moves by at most ``s / 2`` of its
stored step, the bound of the former float32 scheme (tested), with ``s`` at most ``2^-7`` above
``(max - min) / 15`` outside the floor.

The kernel (``_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)``) is
vectorised (AVX2 / AVX-512) only for bfloat16 activations; with float32 activations it runs a
scalar reference loop (about 1000x slower on the LM head). :func:`pack_mm` therefore rounds the
activations to bfloat16 and returns the product (accumulated in float32 by the kernel, stored in
bfloat16) in the input dtype. Against the float32 product with the dequantized weight ``W'`` the
difference is at most ``2 u (1 + u) sum_k |x_k| |W'[n, k]|`` with ``u = 2^-8`` (bfloat16's unit
roundoff: one rounding of each activation, one of the output), i.e. ``2^-7`` of ``|x| @ |W'|^T``
(the tests' tolerance, plus float32 accumulation slack).

Shapes the kernel takes (else :class:`~skipdecode.quantize.Int4Linear` keeps its own nibble
layout and dequantizes): ``group_size`` in (32, 64, 128, 256) dividing ``K``; ``N`` a multiple of
16 (its column tiles); CPU tensors. The packed layout depends on the CPU's vector width (it is made
by ``aten._convert_weight_to_int4pack_for_cpu`` on the machine that runs it; quantized models
refuse ``save_pretrained``); :func:`unpack_codes` reads the codes back through the kernel itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "KERNEL_GROUP_SIZES",
    "KERNEL_N_MULTIPLE",
    "BF16_UNIT_ROUNDOFF",
    "quantize_groups",
    "dequantize",
    "kernel_available",
    "kernel_unusable",
    "pack",
    "pack_mm",
    "unpack_codes",
]

#: Group sizes (input channels per scale and zero) that ``_weight_int4pack_mm_for_cpu`` accepts.
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
#: The kernel's output channels come in tiles of 16.
KERNEL_N_MULTIPLE = 16
#: bfloat16 unit roundoff (8 significant bits): ``|bf16(v) - v| <= u |v|``.
BF16_UNIT_ROUNDOFF = 2.0 ** -8

_STATE: dict[str, Any] = {"checked": False, "ok": False, "why": ""}


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight`` (N, K) float to the scheme above.

    Args:
        weight: (N, K) float weight, as in ``nn.Linear``; K a multiple of ``group_size``.
        group_size: input channels per (step, zero) pair.

    Returns:
        ``codes`` (N, K) uint8 in [0, 15] and ``scales_and_zeros`` (K // group_size, N, 2)
        bfloat16 (``[..., 0]`` the step ``s``, ``[..., 1]`` the zero ``z``: the kernel's layout).
    """
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    step = torch.maximum((hi - lo) / 15.0, w.abs().amax(-1) * 2.0 ** -6)
    step = torch.where(step > 0, step, torch.ones_like(step))
    s = step.to(torch.bfloat16)
    s = torch.where(s.float() < step, torch.nextafter(s, torch.full_like(s, float("inf"))), s)  # round up
    z = (lo + 8 * s.float()).to(torch.bfloat16)
    sf, zf = s.float()[..., None], z.float()[..., None]
    q = torch.round((w - zf) / sf).add_(8).clamp_(0, 15).to(torch.uint8).reshape(N, K)
    return q, torch.stack([s.t(), z.t()], dim=-1).contiguous()


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``W' = (q - 8) * s + z``: codes (N, K) uint8 and scales_and_zeros (G, N, 2) -> (N, K) float32."""
    N, K = codes.shape
    G = scales_and_zeros.shape[0]
    s = scales_and_zeros[..., 0].t().float()[..., None]  # (N, G, 1)
    z = scales_and_zeros[..., 1].t().float()[..., None]
    q = codes.reshape(N, G, K // G).float()
    return ((q - 8) * s + z).reshape(N, K)


def _ops_present() -> str:
    missing = [n for n in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu")
               if not hasattr(torch.ops.aten, n)]
    return f"torch {torch.__version__} has no aten.{missing[0]}" if missing else ""


def kernel_available() -> tuple[bool, str]:
    """Whether ``_weight_int4pack_mm_for_cpu`` exists here and computes the scheme: ``(ok, why not)``.

    Checked once per process: the ops must exist, and a 32 x 64 layer (group 32) at 1 and 5 rows
    must match the bfloat16-activation reference within the tolerance above. Any failure means
    every :class:`~skipdecode.quantize.Int4Linear` keeps its own (dequantizing) path.
    """
    if not _STATE["checked"]:
        _STATE["checked"] = True
        why = _ops_present()
        if not why:
            try:
                why = _self_test()
            except Exception as exc:  # the op exists but fails on this platform
                why = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
        _STATE["ok"], _STATE["why"] = not why, why
    return _STATE["ok"], _STATE["why"]


def _self_test() -> str:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen)
    codes, sz = quantize_groups(w, 32)
    packed = pack(codes)
    ref_w = dequantize(codes, sz)
    if not torch.equal(unpack_codes(packed, 32, 32, 64), codes):
        return "aten._weight_int4pack_mm_for_cpu does not read back the packed codes"
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=gen)
        ref = F.linear(x.bfloat16().float(), ref_w)
        tol = 2 * BF16_UNIT_ROUNDOFF * 1.01 * (x.abs() @ ref_w.abs().t()) + 1e-5
        if not ((pack_mm(x, packed, 32, sz) - ref).abs() <= tol).all():
            return "aten._weight_int4pack_mm_for_cpu disagrees with the dequantized reference"
    return ""


def kernel_unusable(out_features: int, in_features: int, group_size: int, device: torch.device | str) -> str:
    """Why a (N = ``out_features``, K = ``in_features``) layer cannot use the kernel ("" if it can)."""
    ok, why = kernel_available()
    if not ok:
        return why
    if torch.device(device).type != "cpu":
        return f"the int4 kernel runs on the CPU, the weight is on {torch.device(device).type}"
    if group_size not in KERNEL_GROUP_SIZES or in_features % group_size:
        return f"in_features {in_features} has no kernel group size ({', '.join(map(str, KERNEL_GROUP_SIZES))})"
    if out_features % KERNEL_N_MULTIPLE:
        return f"out_features {out_features} is not a multiple of {KERNEL_N_MULTIPLE}"
    return ""


def nibble_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) uint8 in [0, 15], K even -> (N, K // 2) uint8, two codes per byte, the low
    nibble holding the even input channel (this project's own, CPU-independent layout)."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def nibble_unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`nibble_pack`: (N, K // 2) uint8 -> codes (N, K) uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) uint8 in [0, 15] -> (N, K // 2) uint8 in the kernel's layout for this CPU.

    Raises:
        RuntimeError: from the aten op (N not a multiple of 16, K odd).
    """
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W'^T`` through the kernel: x (M, K) float -> (M, N) in ``x.dtype``.

    The activations are rounded to bfloat16 (the kernel's vectorised dtype) and the output is
    bfloat16 before the cast back: see the module docstring for the error bound.
    """
    if x.shape[0] == 0:
        return x.new_zeros(0, packed.shape[0])
    if scales_and_zeros.dtype != torch.bfloat16:  # a model cast with .to(dtype) after quantization
        scales_and_zeros = scales_and_zeros.to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group_size, scales_and_zeros)
    return y.to(x.dtype)


def unpack_codes(packed: torch.Tensor, group_size: int, out_features: int, in_features: int) -> torch.Tensor:
    """The codes (N, K) uint8 held in ``packed``, read through the kernel (layout-independent):
    the identity (K, K) times ``W`` with step 1 and zero 8 is ``q^T`` exactly (integers <= 15)."""
    G = in_features // group_size
    unit = torch.zeros(G, out_features, 2, dtype=torch.bfloat16)
    unit[..., 0], unit[..., 1] = 1.0, 8.0
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    q = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group_size, unit)
    return q.t().to(torch.uint8).contiguous()
