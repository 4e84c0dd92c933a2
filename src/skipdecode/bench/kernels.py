"""One matrix product per linear shape of a model, per weight kernel: what limits a decode step.

Used by ``benchmarks/kernel_speed.py``. For each distinct linear shape of one decoder layer
(N output x K input features, with how many linears of the layer have it) and the LM head, each
batch size (rows M) and thread count, it times one product ``x (M, K) -> (M, N)`` with each
kernel:

- ``float32``: ``F.linear`` with the float32 weight (4 bytes per weight), row-major;
- ``float32cm``: ``F.linear`` with the weight stored column-major (:func:`skipdecode.layout.column_major`,
  ``load()``'s layout before its weight-first products);
- ``float32left``: the weight-first product of :class:`skipdecode.layout.WeightLeftLinear`
  (``(W @ x^T)^T``, row-major weight, one row padded to two; what ``load()`` runs now);
- ``bfloat16``: ``F.linear`` of bfloat16 input and weight (2 bytes per weight; oneDNN, AMX tiles
  on CPUs that have them; includes casting the input);
- ``int8pack``: ``aten._weight_int8pack_mm`` (1 byte per weight + a float32 scale per row);
- ``int8fused``: :func:`skipdecode.quantize._fused_int8` compiled by inductor (same bytes);
- ``int4pack``: ``aten._weight_int4pack_mm_for_cpu`` through :func:`skipdecode.int4pack.pack_mm`
  (0.5 byte per weight + a bfloat16 step and zero per group of 32; includes the bfloat16 casts);
- ``int4fused``: :func:`skipdecode.quantize._fused_int4` compiled (the fallback layout's path).

Each time is the median over ``repeats`` calls (seconds -> ms), after ``warmup`` calls; the
effective rate is weight bytes / median time (GB/s, 1e9 bytes/s), to compare with
:func:`skipdecode.bench_engines.measure_bandwidth`'s read rate at the same thread count. A bare
per-call cost (``F.linear`` of a (M, 16) input with a 16 x 16 weight) separates dispatch overhead
from the kernel's streaming rate. :func:`step_sums` adds one decode step's products (every
linear of every layer, plus the head) per kernel, to set against a measured full-depth step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import int4pack
from ..layout import WeightLeftLinear
from ..quantize import INT4_GROUP_SIZE, Int4Linear, Int8Linear, _fused_int4, _fused_int8, _is_linear, _linear_weight

__all__ = ["KERNELS", "model_shapes", "time_call", "kernel_rows", "overhead_ms", "step_sums"]

#: Kernel names in table order.
KERNELS = ("float32", "float32cm", "float32left", "bfloat16", "int8pack", "int8fused", "int4pack", "int4fused")


def model_shapes(layers: nn.ModuleList, head: nn.Module) -> list[dict[str, Any]]:
    """Distinct linear shapes of ``layers[0]`` and the head.

    Returns:
        ``[{"name", "out_features" N, "in_features" K, "per_layer" (linears of one layer with this
        shape; 0 for the head), "head" (bool), "weight" (N, K) float32}]``; the layer's linears
        first (in module order), the head last.

    Raises:
        ValueError: the layer has no linear, or the head is not linear.
    """
    shapes: dict[tuple[int, int], dict[str, Any]] = {}
    for name, module in layers[0].named_modules():
        if _is_linear(module):
            w, _ = _linear_weight(module)
            key = tuple(w.shape)
            if key not in shapes:
                shapes[key] = {"name": name, "out_features": key[0], "in_features": key[1], "per_layer": 0,
                               "head": False, "weight": w.float().contiguous()}
            else:
                shapes[key]["name"] += f",{name.rsplit('.', 1)[-1]}"
            shapes[key]["per_layer"] += 1
    if not shapes:
        raise ValueError("the first decoder layer has no linear layers")
    if not _is_linear(head):
        raise ValueError("the model's head (get_output_embeddings()) is not a linear layer")
    hw, _ = _linear_weight(head)
    out = list(shapes.values())
    out.append({"name": "lm_head", "out_features": hw.shape[0], "in_features": hw.shape[1], "per_layer": 0,
                "head": True, "weight": hw.float().contiguous()})
    return out


def time_call(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls.

    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    compiled = torch.compile(fn, dynamic=False)

    def run(*args: torch.Tensor) -> torch.Tensor:
        with torch._dynamo.config.patch(recompile_limit=256, accumulated_recompile_limit=1024):
            return compiled(*args)

    return run


def _kernel_calls(weight: torch.Tensor, kernels: Sequence[str]) -> dict[str, tuple[int, Callable[[torch.Tensor], Any]]]:
    """``{kernel: (weight bytes read, fn(x))}`` for one (N, K) float32 weight."""
    N, K = weight.shape
    calls: dict[str, tuple[int, Callable[[torch.Tensor], Any]]] = {}
    if "float32" in kernels:
        calls["float32"] = (N * K * 4, lambda x: F.linear(x, weight))
    if "float32cm" in kernels:
        wcm = weight.t().contiguous().t()
        calls["float32cm"] = (N * K * 4, lambda x: F.linear(x, wcm))
    if "float32left" in kernels:
        left = WeightLeftLinear(K, N, bias=False)
        left.weight.data = weight.contiguous()
        calls["float32left"] = (N * K * 4, left)
    if "bfloat16" in kernels:  # oneDNN's bfloat16 GEMM (AMX where the CPU has it); x cast per call
        w16 = weight.to(torch.bfloat16)
        calls["bfloat16"] = (N * K * 2, lambda x: F.linear(x.to(torch.bfloat16), w16))
    if {"int8pack", "int8fused"} & set(kernels):
        q8 = Int8Linear(weight)
        w8, s8 = q8.weight_int8, q8.scale
        nbytes = w8.numel() + s8.numel() * s8.element_size()
        if "int8pack" in kernels:
            calls["int8pack"] = (nbytes, lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, s8))
        if "int8fused" in kernels:
            fused8 = _compiled(_fused_int8)
            calls["int8fused"] = (nbytes, lambda x: fused8(x, w8, s8))
    if "int4pack" in kernels and not int4pack.kernel_unusable(N, K, INT4_GROUP_SIZE, "cpu"):
        q4 = Int4Linear(weight, group_size=INT4_GROUP_SIZE, kernel=True)
        p4, sz, g = q4.weight_int4pack, q4.scales_and_zeros, q4.group_size
        calls["int4pack"] = (p4.numel() + sz.numel() * 2, lambda x: int4pack.pack_mm(x, p4, g, sz))
    if "int4fused" in kernels:
        f4 = Int4Linear(weight, group_size=INT4_GROUP_SIZE, kernel=False)
        n4, sz4 = f4.weight_int4, f4.scales_and_zeros
        fused4 = _compiled(_fused_int4)
        calls["int4fused"] = (n4.numel() + sz4.numel() * 2, lambda x: fused4(x, n4, sz4))
    return calls


@torch.inference_mode()
def kernel_rows(
    shapes: list[dict[str, Any]], batch_sizes: Sequence[int], threads: int, kernels: Sequence[str] = KERNELS,
    repeats: int = 20, warmup: int = 2,
) -> list[dict[str, Any]]:
    """Time every (shape, batch size, kernel) at ``threads`` threads (``torch.set_num_threads``).

    Returns rows ``{"shape", "out_features", "in_features", "per_layer", "head", "batch_size",
    "threads", "kernel", "weight_bytes", "ms" (median), "gbs" (weight bytes / median time)}``.
    A kernel that does not take a shape (int4pack where N is not a multiple of 16, or no op) is
    left out for that shape; a kernel that raises gets ``"error"`` instead of a time.
    """
    torch.set_num_threads(threads)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        calls = _kernel_calls(shape["weight"], kernels)
        for B in batch_sizes:
            x = torch.randn(B, shape["in_features"], generator=gen)
            for kernel in [k for k in kernels if k in calls]:
                nbytes, fn = calls[kernel]
                row = {k: shape[k] for k in ("out_features", "in_features", "per_layer", "head")}
                row.update(shape=shape["name"], batch_size=B, threads=threads, kernel=kernel, weight_bytes=nbytes)
                try:
                    ms = time_call(lambda: fn(x), repeats, warmup) * 1e3
                    row.update(ms=ms, gbs=nbytes / (ms * 1e-3) / 1e9)
                except Exception as exc:  # a kernel missing on this platform: say so in the row
                    row["error"] = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
                rows.append(row)
    return rows


@torch.inference_mode()
def overhead_ms(batch_sizes: Sequence[int], threads: int, repeats: int = 200) -> dict[int, float]:
    """Median ms of a bare ``F.linear`` of (M, 16) by a 16 x 16 weight per batch size M: the
    per-call dispatch cost that every product pays whatever its size."""
    torch.set_num_threads(threads)
    w = torch.randn(16, 16)
    return {B: time_call(lambda x=torch.randn(B, 16): F.linear(x, w), repeats, warmup=10) * 1e3 for B in batch_sizes}


def step_sums(rows: list[dict[str, Any]], num_layers: int) -> list[dict[str, Any]]:
    """One decode step's products per (threads, batch size, kernel): ``num_layers`` x every
    linear of a layer + the head, in ms, with its weight bytes and rate; only complete sets
    (a kernel with a time for every shape)."""
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["threads"], r["batch_size"], r["kernel"]), []).append(r)
    n_shapes = len({(r["shape"], r["head"]) for r in rows})
    out = []
    for (threads, B, kernel), rs in groups.items():
        if len(rs) != n_shapes or any("ms" not in r for r in rs):
            continue
        count = [1 if r["head"] else r["per_layer"] * num_layers for r in rs]
        ms = sum(c * r["ms"] for c, r in zip(count, rs))
        nbytes = sum(c * r["weight_bytes"] for c, r in zip(count, rs))
        calls = sum(count)
        out.append({"threads": threads, "batch_size": B, "kernel": kernel, "step_ms": ms, "weight_bytes": nbytes,
                    "gbs": nbytes / (ms * 1e-3) / 1e9, "calls": calls})
    return out
