"""Weight-first float32 products for the CPU decode step and prefill.

Every decode step is a chain of products of a few input rows (the batch) with every weight. For
``nn.Linear`` PyTorch computes ``x @ W^T``; on this project's 2-core AVX2 CPU (PyTorch 2.13,
MKL) that GEMM is poor with few rows: the 211 linears of SmolLM2-135M (distinct weights per
call, nothing left in cache) take 38, 51, 69 and 137 ms at 2, 4, 16 and 64 rows, in either weight
layout. The same product taken weight-first, ``(W @ x^T)^T`` with the row-major weight as the
left operand, takes 21, 22, 43 and 97 ms, and 198 against 232 ms at 132 rows (a prefill). At one
row it pads to two (MKL's two-column GEMM streams the weights faster than its GEMV): 22 against
25-26 ms alone, within noise in a compiled decode step and 3-10 % slower eagerly (more Python
operations per call). Inside a compiled decode step (``torch.compile``, :mod:`skipdecode.compiled`)
one row is instead a multiply and a sum over the input features, which inductor fuses into one
vectorised reduction loop over the weight split across threads: on the 2-core AMD EPYC host of
stop 37 MKL's one- and two-row products stream the weights at about 10-15 GB/s on one thread, the
reduction at 24-42 GB/s, and the compiled full-depth batch-1 step falls from 40 to 21-25 ms
(``benchmarks/results/decode_speed_float32_stop37.json``). It is inductor's own ``decompose_mm_pass``
idea for CPU (``torch/_inductor/fx_passes/decompose_mem_bound_mm.py``) without its 2048-feature
limit, which leaves out the LM head. Eagerly the sum would materialise the (out, in) product, so
eager calls keep the GEMM. In the decode-speed benchmark a static batch of 8 decodes at 88.8 against
119.7 ms per step at full depth and 36.5 against 57.3 ms at 3x, batch 32 1.10-1.29x faster
(benchmarks/results/decode_speed_weightleft.json against column-major weights, same host; the
serving cells: docs/serving.md; docs/quantization.md "Weight layout").

Which BLAS call is fastest for a few rows depends on the CPU (MKL picks its kernels by vendor): on
a 2-core Intel Xeon (stop 64) ``F.linear``'s one-row GEMV streams the weights at 21 GB/s and the
weight-first GEMM at 8.6, so :func:`weight_left` times both on the model's weights once per process
(:mod:`skipdecode.row_product`) and its layers run ``F.linear`` for one row and for 2-127 rows where
that is faster.

:func:`weight_left` turns every CPU float32 ``nn.Linear`` into a :class:`WeightLeftLinear` in
place: same parameters (row-major, contiguous), ``state_dict`` keys, tying and hooks, so results
equal ``F.linear``'s up to float32 summation order (about 1e-6 relative). :func:`row_major` undoes
it (plain ``nn.Linear``, contiguous weights); training, saving and the quantizers call it.
:func:`column_major` is the layout ``load()`` used before (a transposed weight view: faster than
row-major ``F.linear`` at one row, no faster with more), kept for the layout benchmark's
comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import onednn

__all__ = ["LINEAR_MIN_ROWS", "WeightLeftLinear", "weight_left", "is_weight_left", "column_major", "row_major", "contiguous_weights",
           "is_column_major"]


def _is_transposed_view(weight: torch.Tensor) -> bool:
    """Whether a 2-D ``weight`` is stored column-major (strides ``(1, out_features)``)."""
    return weight.dim() == 2 and weight.shape[0] > 1 and weight.shape[1] > 1 and weight.stride() == (1, weight.shape[0])


def column_major(model: nn.Module) -> int:
    """Store the weight of every float32 CPU ``nn.Linear`` of ``model`` column-major, in place
    (``W.t().contiguous().t()``: same parameter, shape and values, strides ``(1, out_features)``),
    so ``F.linear`` runs ``x @ B`` with a contiguous ``B``. :func:`load` used this before
    :func:`weight_left`; it is kept for comparing the layouts.

    Args:
        model: any module; its ``nn.Linear`` submodules (a head tied to the input embedding shares
            the re-laid tensor, and embedding lookups stay correct on it) are changed. Quantized,
            non-CPU or non-float32 weights are left alone.

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
    """Undo :func:`weight_left` and :func:`column_major`: every :class:`WeightLeftLinear` of
    ``model`` becomes a plain ``nn.Linear`` again (its oneDNN packed copy, if any, is dropped:
    :func:`skipdecode.onednn.disable`) and every column-major 2-D parameter contiguous.

    Returns:
        The number of modules and parameters changed (0 when the model was never re-laid).
    """
    changed = 0
    onednn.disable(model)
    for module in model.modules():
        if type(module) is WeightLeftLinear:
            module.__class__ = nn.Linear
            changed += 1
    return changed + contiguous_weights(model)


def contiguous_weights(model: nn.Module) -> int:
    """Make every column-major 2-D parameter of ``model`` (:func:`column_major`) contiguous, in
    place, leaving the modules' classes alone (a :class:`WeightLeftLinear` stays one); what
    safetensors needs to save the weights.

    Returns:
        The number of parameters changed.
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


def is_weight_left(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` is a :class:`WeightLeftLinear` (see :func:`weight_left`)."""
    return any(type(m) is WeightLeftLinear for m in model.modules())


#: products of this many rows or more (eagerly, without oneDNN) run ``F.linear``: from about 100
#: rows it is as fast as the weight-first GEMM on the 2-core AMD EPYC (family 26) host (128-2048
#: rows of SmolLM2-135M's 576 x 576, 1536 x 576 and 576 x 1536 weights: within 4 %; at 64 rows,
#: a large static decode batch, up to 10 % slower), and its output is row-major. The weight-first
#: product's is transposed, and a query with a strided last dimension sends PyTorch's SDPA to its
#: math kernel, which holds the whole (T, K) score matrix: a 2048-token float32 prefill took 7.8 s
#: against 4.2 s (stop 58; docs/serving.md "Chunked prefill")
LINEAR_MIN_ROWS = 128


class WeightLeftLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, ``state_dict`` keys and hooks) whose CPU float32 product
    is computed weight-first: ``y = (W @ x^T)^T`` with the row-major weight ``W``
    (out_features, in_features) as the left operand of one BLAS GEMM, instead of ``F.linear``'s
    ``x @ W^T``. Same values up to float32 summation order.

    Why: on this project's 2-core AVX2 CPU (PyTorch 2.13, MKL) ``x @ W^T`` with a few input rows
    is a poor GEMM (measured in the module docstring). A single input row is padded to two:
    MKL's two-column GEMM streams the weight faster than its GEMV. Traced by ``torch.compile``
    (:func:`torch.compiler.is_compiling`), a single row is ``(x * W).sum(-1)`` instead: inductor
    fuses it into one reduction loop over the weight (module docstring). Eagerly, where this host's
    BLAS is faster as ``F.linear`` (``one_row_linear``, ``few_rows_linear``, set by
    :func:`weight_left` from :mod:`skipdecode.row_product`), one row and 2-127 rows run it. With ``onednn`` set
    (:func:`skipdecode.onednn.enable`, done by ``compile=True``), products of 3 or more rows go
    to oneDNN's prepacked weight instead (:mod:`skipdecode.onednn`). Otherwise products of
    :data:`LINEAR_MIN_ROWS` or more rows (prefills) run ``F.linear``.

    Input ``x`` (..., in_features) -> output (..., out_features), a view of the GEMM's
    (out_features, M) result (M = rows of ``x``; non-contiguous for 1 < M < :data:`LINEAR_MIN_ROWS`,
    as a transposed product is). Other dtypes, devices or a non-contiguous weight fall back to ``F.linear``.
    """

    #: set by :func:`skipdecode.onednn.enable`: products of ``onednn.MIN_ROWS`` or more rows use
    #: oneDNN's packed copy of the weight (held in ``_onednn_packed``)
    onednn: bool = False
    _onednn_packed = None
    #: set by :func:`weight_left` from :func:`skipdecode.row_product.choose`: eager one-row products
    #: run ``F.linear`` (MKL's GEMV) instead of the weight-first GEMM padded to two columns
    one_row_linear: bool = False
    #: the same for 2 to LINEAR_MIN_ROWS - 1 rows (also below oneDNN's MIN_ROWS in compiled graphs)
    few_rows_linear: bool = False

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed oneDNN weight out (a copy has its own weight)."""
        state = dict(self.__dict__)
        state.pop("_onednn_packed", None)
        state.pop("onednn", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or x.dtype != w.dtype or not w.is_contiguous():
            return F.linear(x, w, self.bias)
        x2 = x.reshape(-1, x.shape[-1])
        one = x2.shape[0] == 1
        if one and torch.compiler.is_compiling():
            # one fused reduction loop over the weight, split across threads (module docstring)
            y = (x2.unsqueeze(-2) * w).sum(-1)
            return (y if self.bias is None else y + self.bias).reshape(*x.shape[:-1], w.shape[0])
        if self.onednn and not one:  # oneDNN's packed weight from MIN_ROWS rows (skipdecode.onednn)
            y = torch.ops.skipdecode.onednn_linear(x2, w, self.bias)
            return y.reshape(*x.shape[:-1], w.shape[0])
        if (self.one_row_linear if one else self.few_rows_linear) or x2.shape[0] >= LINEAR_MIN_ROWS:
            # this host's BLAS is faster as F.linear (skipdecode.row_product), or a prefill, where
            # F.linear is as fast and its output row-major
            return F.linear(x, w, self.bias)
        if one:
            x2 = torch.cat([x2, x2])  # a real copy: a stride-0 expand would make MKL copy per call, slower
        y = torch.mm(w, x2.t()).t()
        if one:
            y = y[:1]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], w.shape[0])


def weight_left(model: nn.Module) -> int:
    """Make every CPU float32 ``nn.Linear`` of ``model`` (exactly that class: quantized and LoRA
    layers are left alone) a :class:`WeightLeftLinear`, in place, with its weight row-major
    (contiguous; a column-major one from :func:`column_major` is re-laid). Parameters, tying
    (a head tied to the input embedding keeps sharing it) and ``state_dict`` keys are unchanged;
    :func:`row_major` undoes it. Each layer gets this host's few-row products
    (:func:`skipdecode.row_product.choose`, timed on these weights once per process: where
    ``F.linear`` is faster, as with MKL on Intel CPUs, one-row and few-row products run it); the
    choice is kept in ``model.skipdecode_row_product`` (a
    :class:`~skipdecode.row_product.RowProduct`).

    Returns:
        The number of modules changed.

    Raises:
        skipdecode.row_product.RowProductError: ``SKIPDECODE_ROW_PRODUCT`` holds an unknown value.
    """
    from .row_product import choose, env_choice

    env_choice()  # a bad SKIPDECODE_ROW_PRODUCT fails before any layer changes
    changed = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            continue
        if not weight.is_contiguous():
            with torch.no_grad():
                weight.data = weight.data.contiguous()
        module.__class__ = WeightLeftLinear
        changed.append(module)
    if changed:
        choice = choose([m.weight for m in changed])
        model.skipdecode_row_product = choice
        for module in changed:
            module.one_row_linear = choice.one_row_linear
            module.few_rows_linear = choice.few_rows_linear
    return len(changed)
