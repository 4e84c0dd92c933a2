"""Weight memory layout for the CPU float32 decode step.

A batch-1 decode step is a chain of matrix-vector products that stream every weight once. With
the row-major ``(out_features, in_features)`` weights of ``nn.Linear``, ``F.linear(x, W)`` asks
the BLAS for ``x @ W^T`` with a transposed operand; on this project's 2-core CPU (PyTorch 2.13,
oneDNN/MKL) that product reads weights at about 17 GB/s, while the same product on the same values
stored column-major (``W^T`` contiguous, so ``F.linear`` hands the BLAS a plain ``x @ B``) reads at
about 21 GB/s: 30.9 ms against 24.9 ms for the 211 linears of SmolLM2-135M at batch 1, and the
same time at batch 8 and 32 (measured with distinct weights per call, so nothing stays in cache;
docs/quantization.md "Weight layout").

:func:`column_major` re-lays the weights in place: each ``weight`` stays an ``nn.Parameter`` of
the same shape and values (``W.t().contiguous().t()``), so modules, tied embeddings, hooks and
``state_dict`` keys are unchanged and ``F.linear`` picks the faster product by itself. Results equal
the row-major ones up to float32 summation order (about 1e-6 relative). :func:`row_major` undoes
it; training and saving call it, since optimisers, peft and safetensors expect contiguous weights.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["column_major", "row_major", "is_column_major"]


def _is_transposed_view(weight: torch.Tensor) -> bool:
    """Whether a 2-D ``weight`` is stored column-major (strides ``(1, out_features)``)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride() == (1, weight.shape[0])


def column_major(model: nn.Module) -> int:
    """Store the weight of every float32 CPU ``nn.Linear`` of ``model`` column-major, in place.

    Args:
        model: any module; its ``nn.Linear`` submodules (decoder-layer projections and the LM head;
            a head tied to the input embedding shares the re-laid tensor, and embedding lookups
            of B token rows stay correct on it) are changed. Quantized or non-CPU or non-float32
            weights are left alone.

    Returns:
        The number of distinct weight tensors re-laid (a tied head and embedding count once).
    """
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if id(weight) in seen or weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        if weight.dim() != 2 or not weight.is_contiguous() or min(weight.shape) < 2:
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        seen.add(id(weight))
    return len(seen)


def row_major(model: nn.Module) -> int:
    """Undo :func:`column_major`: make every column-major 2-D parameter of ``model`` contiguous.

    Returns:
        The number of parameters changed (0 when the model was never re-laid).
    """
    changed = 0
    for param in model.parameters():
        if _is_transposed_view(param):
            with torch.no_grad():
                param.data = param.data.contiguous()
            changed += 1
    return changed


def is_column_major(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is stored column-major (see :func:`column_major`)."""
    return any(_is_transposed_view(p) for p in model.parameters())
