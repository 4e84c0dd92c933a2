"""oneDNN's prepacked float32 products for decode steps of several rows (``compile=True`` on CPUs).

Why. A decode step of a batch multiplies a few rows (the running requests) by every weight. On
the 2-core AMD EPYC test host (PyTorch 2.13) MKL's GEMM is poor at that shape whichever operand
comes first (:mod:`skipdecode.layout`), while oneDNN's inner product on a weight reordered once
into its blocked layout runs 1.6-1.9x faster: the 211 linears of SmolLM2-135M at 8 rows take
about 21 ms against 34 ms weight-first, at 16 rows 25 against 41-44 ms, the 49152x576 LM head at
16 rows 6.9 against 13.5 ms; at 64 rows (a prefill) 72 against 92 ms. At one or two rows the
other paths are as fast or faster (a compiled one-row product is one fused reduction, two rows
MKL's two-column GEMM), so :data:`MIN_ROWS` is 3. This is the product inductor itself emits for a
frozen float32 ``nn.Linear`` on CPU (``torch.ops.mkldnn._linear_pointwise`` with a weight from
``torch.ops.mkldnn._reorder_linear_weight``), used here without freezing, so that the layers
still share one compiled graph.

Memory. The packed weight is a second copy of each float32 weight: the plain one stays for the
input embedding (tied to the LM head), ``state_dict``, training and quantizers. For the embedded
model that is 538 MB more; ``resident_bytes`` counts it (:func:`packed_nbytes`).

How. :func:`enable` packs every :class:`~skipdecode.layout.WeightLeftLinear` of a model and marks
it (``onednn = True``); such a layer sends every product of two or more rows to the custom op
``skipdecode::onednn_linear(x, weight, bias)``, which compiled layer graphs keep as one opaque
call (dynamo cannot pass oneDNN's opaque tensors). The op uses the packed copy from
:data:`MIN_ROWS` rows on (it decides, so graphs hold no guard on the row count) and finds it by
the weight's storage address. A packed copy is used only while the weight is the one it was
packed from, unmodified (same address, shape and version counter); otherwise the op repacks it (a
weight changed in place) or computes the product weight-first (a weight it never saw), so results
stay right.
:func:`disable` drops the copies.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import guard_memo

__all__ = ["MIN_ROWS", "available", "disable", "enable", "onednn_linear", "packed_nbytes"]

#: fewest rows a product needs to go to oneDNN (fewer: the weight-first or one-row paths)
MIN_ROWS = 3

#: weight storage address -> the layer owning the packed copy (weak: a freed layer leaves)
_OWNERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Whether oneDNN's packed float32 linear works in this PyTorch build: ``(ok, reason when
    not)``, from a self-test (pack a 16 x 8 weight, multiply 3 rows) run once per process."""
    if not torch.backends.mkldnn.is_available():
        return False, "this PyTorch build has no oneDNN (mkldnn)"
    try:
        w = torch.arange(128, dtype=torch.float32).reshape(16, 8) / 64
        x = torch.ones(3, 8)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None, "none", [], "")
        if not torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5):
            return False, "oneDNN's packed linear failed its self-test"
    except Exception as exc:  # a private op renamed or removed in another PyTorch
        return False, f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
    return True, ""


def _stamp(weight: torch.Tensor) -> tuple[int, tuple[int, ...], int]:
    """(storage address, shape, version counter) of ``weight``: what a packed copy must match."""
    return weight.data_ptr(), tuple(weight.shape), weight._version


def _pack(layer: nn.Module) -> None:
    """Pack ``layer.weight`` (out, in) float32 into oneDNN's layout and register the layer."""
    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
    layer._onednn_packed = (_stamp(layer.weight), packed)
    _OWNERS[layer.weight.data_ptr()] = layer


def _packed_for(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``weight`` (repacked first if its layer's weight changed in place), or
    None when no enabled layer owns a weight at this address and shape."""
    layer = _OWNERS.get(weight.data_ptr())
    held = None if layer is None else layer._onednn_packed
    if held is None or layer.weight.data_ptr() != weight.data_ptr() or layer.weight.shape != weight.shape:
        return None
    stamp, packed = held
    if stamp != _stamp(layer.weight):
        _pack(layer)
        packed = layer._onednn_packed[1]
    return packed


# A plain operator registration (torch.library.Library), as for skipdecode::w8a8_linear: a
# custom_op's Python wrapper costs tens of microseconds a call.
_LIB = torch.library.Library("skipdecode", "FRAGMENT")
_LIB.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x (M, K) float32, weight (N, K), bias (N,) or None ->
    (M, N): from :data:`MIN_ROWS` rows through the packed copy of ``weight`` that :func:`enable`
    made, below it (or when there is no copy) as :class:`~skipdecode.layout.WeightLeftLinear`
    computes it (weight-first, or ``F.linear`` where its layer's ``few_rows_linear`` says so). The
    CPU kernel of ``torch.ops.skipdecode.onednn_linear``. The row count is decided here, inside
    the opaque op, so that a compiled graph holds no guard on it (a guard would compile the layers
    again for every batch size on either side of :data:`MIN_ROWS`)."""
    packed = _packed_for(weight) if x.shape[0] >= MIN_ROWS else None
    if packed is None:
        owner = _OWNERS.get(weight.data_ptr())
        if not weight.is_contiguous() or (owner is not None and owner.few_rows_linear):
            return F.linear(x, weight, bias)  # this host's BLAS is faster so (skipdecode.row_product)
        # contiguous, as the fake kernel promises: compiled code reads the result with its strides
        y = torch.mm(weight, x.t()).t().contiguous()
        return y if bias is None else y + bias
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


_LIB.impl("onednn_linear", onednn_linear, "CPU")


@torch.library.register_fake("skipdecode::onednn_linear")
def _onednn_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def enable(model: nn.Module) -> int:
    """Pack the weight of every float32 CPU :class:`~skipdecode.layout.WeightLeftLinear` of
    ``model`` for oneDNN and mark the layer (``onednn = True``), so that its products of
    :data:`MIN_ROWS` or more rows use the packed copy; and give every
    :class:`~skipdecode.w8a8.W8A8Linear` its oneDNN int8 copy
    (:meth:`~skipdecode.w8a8.W8A8Linear.enable_onednn`): a decoder layer's for prefills
    (:data:`~skipdecode.w8a8.ONEDNN_MIN_ROWS` rows), an LM head's W8A8 preview for decode steps
    of 8 or more rows (:data:`~skipdecode.w8a8.HEAD_ONEDNN_MIN_ROWS`). A weight shared by two
    layers is packed once per layer. Costs a second copy of those weights (module docstring).

    Returns:
        The number of layers enabled; 0 when oneDNN is unavailable here (:func:`available`) or
        ``model`` has no such layer (call :func:`skipdecode.layout.weight_left` first).
    """
    from .layout import WeightLeftLinear
    from .rescored_head import RescoredHead
    from .w8a8 import HEAD_ONEDNN_MIN_ROWS, W8A8Linear

    if not available()[0]:
        return 0
    count = 0
    previews = {id(m.row_preview) for m in model.modules() if isinstance(m, RescoredHead)}
    for module in model.modules():
        if isinstance(module, W8A8Linear):
            count += module.enable_onednn(HEAD_ONEDNN_MIN_ROWS if id(module) in previews else None)
            continue
        if type(module) is not WeightLeftLinear:
            continue
        w = module.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 or not w.is_contiguous():
            continue
        _pack(module)
        module.onednn = True
        count += 1
    guard_memo.invalidate()  # compiled graphs branch on the flags
    return count


def disable(model: nn.Module) -> int:
    """Drop the packed copies of ``model``'s layers (float32 and W8A8) and unmark them; returns
    how many it dropped."""
    from .w8a8 import W8A8Linear

    count = 0
    for module in model.modules():
        if isinstance(module, W8A8Linear) and module.onednn_packed is not None:
            module.disable_onednn()
            count += 1
        elif getattr(module, "_onednn_packed", None) is not None:
            module._onednn_packed = None
            module.onednn = False
            count += 1
    guard_memo.invalidate()
    return count


def packed_nbytes(model: nn.Module) -> int:
    """Bytes held by the packed copies of ``model``'s layers (each copy counted once)."""
    total, seen = 0, set()
    for module in model.modules():
        held = getattr(module, "_onednn_packed", None)
        if held is not None and id(held[1]) not in seen:
            seen.add(id(held[1]))
            total += held[1].numel() * held[1].element_size()
    return total
