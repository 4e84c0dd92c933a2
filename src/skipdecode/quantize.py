"""Weight-only int8 / int4 linear layers for the decoder layers and the LM head.

``quantize_model(model, "int8")`` replaces every linear layer (``nn.Linear`` and GPT-2's
``Conv1D``) inside the decoder layers, and the LM head, with a module that stores the weight in
8 (or 4) bits and dequantizes it inside the matrix product. Activations, norms, embeddings and the
KV cache stay in the model's float dtype. The input embedding is left untouched, so a model whose
LM head is tied to its input embedding keeps a float32 input embedding and gets an int8 *copy* of
the head (the tie is broken on purpose; the logits stay those of the tied matrix up to rounding).

Schemes (the weight-only schemes of GPTQ/AWQ-style inference engines and of PyTorch's own
``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu`` kernels):

- ``int8``: symmetric, one scale per output channel: ``s_n = max_k |W[n, k]| / 127``,
  ``q = round(W / s_n)`` in [-127, 127], ``W' = q * s_n``. Each weight moves by at most
  ``s_n / 2``, so each output moves by at most ``sum_k |x_k| * s_n / 2`` (the bound the tests
  check).
- ``int4`` (decoder-layer linears; the LM head is an int4 preview rescored from int8, see
  :data:`HEAD_MODE` and :mod:`skipdecode.rescored_head`): asymmetric,
  one bfloat16 step ``s`` and zero ``z`` per group of ``group_size`` (32)
  consecutive input channels, ``W' = (q - 8) * s + z`` with codes ``q`` in [0, 15] (PyTorch's int4
  kernel's convention; ``s`` about ``(max - min) / 15``, ``z = min + 8 s``; each weight moves by at
  most ``s / 2``): :mod:`skipdecode.int4pack`.
- ``head``: only the LM head is quantized (the int4-rescored head of ``int4``); the decoder
  layers keep their float weights. The head is the largest single matrix a decode step reads
  (SmolLM2-135M: 113 MB in float32, 21 % of the weights) and is read at every step whatever the
  skip policy, so this leaves the layers' arithmetic alone and removes most of the per-step cost
  that skipping cannot (docs/quantization.md "Quantizing only the LM head").

Kernels. Eagerly, int8 uses ``torch.ops.aten._weight_int8pack_mm`` for up to
:data:`INT8PACK_MAX_ROWS` rows (PyTorch's weight-only kernel: it reads only the int8 weight, but
on CPUs without AVX-512 it is slower than a float32 GEMV) and a dequantize-then-``F.linear``
otherwise (prefill). int4 uses PyTorch's CPU kernel ``aten._weight_int4pack_mm_for_cpu`` (bfloat16
activations, every row count, eager and compiled alike) wherever it exists and fits the layer's
shape, and otherwise (no op, a failed self-test, a narrow or odd layer, a non-CPU weight)
dequantizes its group table. Under ``torch.compile`` (``load(..., compile=True)``, :mod:`skipdecode.compiled`) the product is
written as one broadcast multiply-and-sum, which inductor fuses into a single loop that reads the
packed weight once and never materialises a float copy: that is int8's fast path (on the test CPU,
one thread, the 49152x576 LM head at batch 1: float32 7.2 ms, int8 fused 1.1 ms) and the
fallback int4 layout's; int4 on PyTorch's kernel stays on it (0.8 ms there, eager).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import int4pack

__all__ = [
    "QUANTIZE_MODES",
    "HEAD_MODE",
    "INT4_GROUP_SIZE",
    "INT8PACK_MAX_ROWS",
    "FUSED_MAX_ROWS",
    "QuantizeError",
    "check_quantize",
    "Int8Linear",
    "int8_codes",
    "Int4Linear",
    "quantize_model",
    "quantized_mode",
    "resident_bytes",
    "kernel_error",
]

#: ``quantize`` values: weight formats of the decoder layers and LM head ("head": the LM head only).
QUANTIZE_MODES = ("int8", "int4", "w8a8", "head")
#: The LM head's scheme under each mode. A plain 4-bit head of the tied 49152x576 embedding moved
#: SmolLM2's next-token distribution 26x further (KL per token 0.055 against 0.0021 for int4
#: decoder layers; top-1 agreement 0.85 against 0.95) and turned the E2E fine-tune's greedy
#: outputs into noise (engines keep the head wider: llama.cpp stores ``output.weight`` at 6 bits
#: in its 4-bit files, GPTQ/AWQ leave it in float). So int4 uses ``"int4-rescored"``
#: (:class:`~skipdecode.rescored_head.RescoredHead`): a 4-bit preview of every logit, whose top
#: candidates get the int8 head's exact logits (on the CPU the preview is the W8A8 product of the
#: int8 codes, faster than the int4 kernel). w8a8 uses the same head without the 4-bit copy: a
#: plain W8A8 head moved the next-token distribution 15x further than the int8 head (KL 0.022
#: against 0.0014, top-1 agreement with float32 0.914 against 0.966; benchmarks/head_quality.py),
#: the rescored one picks the int8 head's top-1 at every position measured. "head" (float layers)
#: takes int4's head.
HEAD_MODE = {"int8": "int8", "int4": "int4-rescored", "w8a8": "w8a8-rescored", "head": "int4-rescored"}
#: Input channels sharing one int4 scale and minimum.
INT4_GROUP_SIZE = 32
#: Eager int8: rows (batch x tokens) up to which ``_weight_int8pack_mm`` beats dequantize + GEMM.
INT8PACK_MAX_ROWS = 4
#: Compiled: rows up to which the fused multiply-and-sum is used (decode steps up to batch 64).
#: It beats dequantize + GEMM at every batch measured (the LM head, 1 thread: 65 ms against
#: 116 ms at 32 rows) but not a float32 GEMM beyond about 16 rows (31 ms at 32 rows).
FUSED_MAX_ROWS = 64


class QuantizeError(ValueError):
    """A bad ``quantize`` value, or a model that cannot be quantized; the message says why."""


def check_quantize(quantize: Any) -> str | None:
    """Validate a ``quantize`` option: None (float weights), ``"int8"``, ``"int4"``, ``"w8a8"`` or
    ``"head"`` (:data:`QUANTIZE_MODES`).

    Raises:
        QuantizeError: any other value (the message names ``quantize`` and the allowed values).
    """
    if quantize is None or quantize in QUANTIZE_MODES:
        return quantize
    raise QuantizeError(f"quantize must be one of {', '.join(QUANTIZE_MODES)} or None, got {quantize!r}")


def _linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight (N, K) as in ``F.linear``, bias (N,) or None) of an ``nn.Linear`` or ``Conv1D``."""
    if isinstance(module, nn.Linear):
        return module.weight.detach(), module.bias
    # transformers' Conv1D (GPT-2): y = x @ W + b with W (K, N)
    return module.weight.detach().t(), module.bias


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.ndim == 2


class _QuantLinear(nn.Module):
    """Shared parts of the weight-only linears: bias, shapes, the fused/eager dispatch."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    #: set by :func:`skipdecode.compiled.compile_adapter` (mode "kernels"): decode steps run
    #: the product through the module-level compiled fused kernel
    compiled_kernel: bool = False
    #: whether compile mode "kernels" should route this layer's decode-step product through the
    #: compiled fused function (False where an eager kernel is the faster path)
    fuses_when_compiled: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., K) float -> (..., N), as the float layer would compute it from ``W'``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        # a decode step (one position per row) inside a compiled layer: inductor fuses the product.
        # A compiled prefill's T is symbolic >= 2, so this test adds no guard on its row count.
        one_position = x.ndim < 3 or shape[-2] == 1
        if torch.compiler.is_compiling() and one_position and x2.shape[0] <= FUSED_MAX_ROWS:
            y = self._fused(x2)
        elif self.compiled_kernel and x.ndim == 3 and shape[1] == 1 and x2.shape[0] <= FUSED_MAX_ROWS:
            y = _run_compiled_kernel(self, x2)  # a decode step: one token per row
        else:
            y = self._eager(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 scheme of :class:`Int8Linear` (and :class:`~skipdecode.w8a8.W8A8Linear`):
    ``weight`` (N, K) -> (codes (N, K) int8 in [-127, 127], scale (N,) float32), with
    ``scale_n = max_k |W[n, k]| / 127`` (1 for an all-zero row) and ``codes = round(W / scale)``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear(_QuantLinear):
    """Weight-only int8 linear layer: symmetric, one scale per output channel.

    Args:
        weight: (N, K) float weight, as in ``nn.Linear``.
        bias: (N,) float bias or None.

    Buffers: ``weight_int8`` (N, K) int8 in [-127, 127]; ``scale`` (N,) in the weight's dtype,
    ``max_k |W[n, k]| / 127`` (1 for an all-zero row). ``forward``: (..., K) -> (..., N).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        q, scale = int8_codes(weight)
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale.to(weight.dtype))

    def dequantized(self) -> torch.Tensor:
        """The float weight the layer computes with, ``q * scale``: (N, K)."""
        return self.weight_int8.to(self.scale.dtype) * self.scale[:, None]

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_int8(x, self.weight_int8, self.scale)

    def _kernel_args(self) -> tuple[torch.Tensor, ...]:
        return (self.weight_int8, self.scale)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8PACK_MAX_ROWS and x.device.type == "cpu" and x.dtype in (
            torch.float32, torch.bfloat16, torch.float16
        ):
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scale.to(x.dtype))
        return F.linear(x, self.weight_int8.to(x.dtype)) * self.scale.to(x.dtype)


class Int4Linear(_QuantLinear):
    """Weight-only int4 linear layer: groups of ``group_size`` input channels, each with a
    bfloat16 step and zero (the scheme of :mod:`skipdecode.int4pack`: ``W' = (q - 8) s + z``).

    Args:
        weight: (N, K) float weight; K even.
        bias: (N,) float bias or None.
        group_size: input channels per (step, zero) pair, at most; halved until it divides K
            (so a 16-wide layer uses groups of 16).
        kernel: use PyTorch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``). None
            (default): whenever it exists, passes its self-test and takes this shape (group size
            32-256 dividing K, N a multiple of 16, a CPU weight); False: never (the fallback).

    Buffers: ``scales_and_zeros`` (K // group_size, N, 2) bfloat16 (step, zero) per group, and
    either ``weight_int4pack`` (N, K // 2) uint8 in the kernel's layout (``self.kernel`` True) or
    ``weight_int4`` (N, K // 2) uint8, two codes per byte, low nibble = even input channel (the
    fallback; ``self.kernel_note`` says why). ``forward``: (..., K) -> (..., N). With the kernel
    the activations are rounded to bfloat16 (error bound in :mod:`skipdecode.int4pack`); the
    fallback computes in the input's dtype with the dequantized weight.

    Raises:
        QuantizeError: K is odd; ``kernel=True`` where the kernel cannot be used (says why);
            ``forward`` of a kernel-packed layer on a non-CPU input.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = INT4_GROUP_SIZE,
        kernel: bool | None = None,
    ) -> None:
        N, K = weight.shape
        while group_size > 2 and K % group_size:
            group_size //= 2  # narrow layers: the largest power of two dividing K
        if K % group_size or group_size % 2:
            raise QuantizeError(f"int4 needs an even number of input features, got {K}")
        super().__init__(K, N, bias)
        self.group_size = group_size
        codes, scales_and_zeros = int4pack.quantize_groups(weight, group_size)
        why = "kernel=False" if kernel is False else int4pack.kernel_unusable(N, K, group_size, weight.device)
        packed = None
        if not why:
            try:
                packed = int4pack.pack(codes)
            except Exception as exc:  # the op refuses this shape: keep the fallback layout
                why = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
        if kernel and packed is None:
            raise QuantizeError(f"kernel=True but the int4 kernel cannot run this layer: {why}")
        self.kernel = packed is not None
        self.kernel_note = why
        if self.kernel:
            self.register_buffer("weight_int4pack", packed)
        else:
            self.register_buffer("weight_int4", int4pack.nibble_pack(codes))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(weight.device))

    #: compile mode "kernels" routes decode steps through the fused compiled function only for
    #: the fallback layout; the kernel is faster eagerly (docs/quantization.md, measured)
    @property
    def fuses_when_compiled(self) -> bool:
        """True for the fallback layout (its compiled fused product is its fast path)."""
        return not self.kernel

    def codes(self) -> torch.Tensor:
        """The int4 codes ``q`` (N, K) uint8 in [0, 15] (read back through the kernel if packed)."""
        if self.kernel:
            return int4pack.unpack_codes(self.weight_int4pack, self.group_size, self.out_features, self.in_features)
        return int4pack.nibble_unpack(self.weight_int4)

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, ``(q - 8) * s + z``: (N, K) float32."""
        return int4pack.dequantize(self.codes(), self.scales_and_zeros)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:  # inside a compiled region: the same aten op (an extern call for inductor)
            return self._eager(x)
        return _fused_int4(x, self.weight_int4, self.scales_and_zeros)

    def _kernel_args(self) -> tuple[torch.Tensor, ...]:
        return (self.weight_int4, self.scales_and_zeros)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            if x.device.type != "cpu":
                raise QuantizeError(f"int4 weights packed for the CPU kernel cannot run on {x.device.type}; "
                                    "quantize after moving the model")
            return int4pack.pack_mm(x, self.weight_int4pack, self.group_size, self.scales_and_zeros)
        return F.linear(x, self.dequantized().to(x.dtype))


def _fused_int8(x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(M, K) x int8 (N, K) with per-row ``scale`` (N,) -> (M, N), written as one broadcast
    multiply-and-sum so that inductor fuses the dequantization into the reduction."""
    return (x[:, None, :] * weight_int8.to(x.dtype)[None]).sum(-1) * scale.to(x.dtype)


def _fused_int4(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """(M, K) x nibble-packed int4 (N, K/2) with group (step, zero) pairs (G, N, 2) -> (M, N),
    ``W' = (q - 8) s + z``, as one broadcast multiply-and-sum for inductor to fuse."""
    G, N = scales_and_zeros.shape[:2]
    K = x.shape[1]
    q = int4pack.nibble_unpack(packed).reshape(N, G, K // G).to(x.dtype)
    sz = scales_and_zeros.to(x.dtype).transpose(0, 1)  # (N, G, 2)
    w = (q - 8) * sz[..., 0:1] + sz[..., 1:2]
    return (x.reshape(x.shape[0], 1, G, K // G) * w[None]).sum((-1, -2))


_KERNEL_STATE: dict[str, Any] = {"int8": None, "int4": None, "error": ""}


def _run_compiled_kernel(module: "_QuantLinear", x: torch.Tensor) -> torch.Tensor:
    """``module._fused(x)`` through one shared ``torch.compile``'d function (inductor fuses the
    dequantization into the product). Variants: one per distinct (weight format, N, K) and batch
    size until the batch becomes symbolic; never per layer or per policy. Falls back to the eager
    kernel for good (recording why in :func:`kernel_error`) if compilation fails.
    """
    if _KERNEL_STATE["error"]:
        return module._eager(x)
    kind = "int8" if isinstance(module, Int8Linear) else "int4"
    if _KERNEL_STATE[kind] is None:
        _KERNEL_STATE[kind] = torch.compile(_fused_int8 if kind == "int8" else _fused_int4, dynamic=None)
    try:
        with torch._dynamo.config.patch(recompile_limit=64):
            return _KERNEL_STATE[kind](x, *module._kernel_args())
    except Exception as exc:  # no compiler, unsupported platform: eager from now on
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        _KERNEL_STATE["error"] = f"{type(exc).__name__}: {text}"[:300]
        return module._eager(x)


def kernel_error() -> str:
    """Why the compiled fused kernels fell back to eager in this process ("" if they did not)."""
    return _KERNEL_STATE["error"]


def _replace(parent: nn.Module, name: str, new: nn.Module) -> None:
    setattr(parent, name, new)


def _quantize_children(root: nn.Module, mode: str) -> int:
    """Replace every linear under ``root`` (not ``root`` itself); returns the count."""
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if _is_linear(child):
                _replace(parent, name, _make(child, mode))
                count += 1
    return count


def _make(module: nn.Module, mode: str) -> nn.Module:
    weight, bias = _linear_weight(module)
    if mode in ("int4-rescored", "w8a8-rescored"):
        from .rescored_head import RescoredHead

        return RescoredHead(weight, bias, int4_preview=mode == "int4-rescored").to(weight.device)
    if mode == "int8":
        return Int8Linear(weight, bias).to(weight.device)
    if mode == "w8a8":
        from .w8a8 import W8A8Linear

        return W8A8Linear(weight, bias)
    return Int4Linear(weight, bias).to(weight.device)


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str | None, layers: nn.ModuleList | None = None,
                   fuse: bool = True) -> nn.Module:
    """Quantize the decoder layers' linears and the LM head of ``model`` in place (the head in
    :data:`HEAD_MODE` ``[mode]``: int8 for int8, an int4 preview rescored from int8 for int4), or
    with ``mode="head"`` the LM head alone (int4's head; the decoder layers stay float).

    Args:
        model: a Hugging Face ``*ForCausalLM`` with ``get_output_embeddings()``.
        mode: ``"int8"``, ``"int4"``, ``"w8a8"`` (int8 weights and per-token int8 activations on
            FBGEMM, CPU only: :mod:`skipdecode.w8a8`), ``"head"`` (the LM head only) or None
            (returns ``model`` unchanged).
        layers: the decoder layers (default: from the model's adapter).
        fuse: quantize sibling projections of one input (q/k/v, gate/up) as one product each
            (:mod:`skipdecode.fused_linear`: the same values, fewer kernel calls); False: one
            quantized linear per projection.

    Returns:
        ``model`` (the same object), with ``model._skipdecode_quantize = mode``.

    Raises:
        QuantizeError: bad ``mode`` or ``fuse``; the model is already quantized; no linear LM head; int4
            with an odd input width; w8a8 off the CPU or without FBGEMM.
    """
    mode = check_quantize(mode)
    if not isinstance(fuse, bool):
        raise QuantizeError(f"fuse must be True or False, got {fuse!r}")
    if mode is None:
        return model
    if quantized_mode(model) is not None:
        raise QuantizeError(f"the model is already quantized ({quantized_mode(model)})")
    from .layout import row_major

    if layers is None:
        from .adapters import get_adapter

        layers = get_adapter(model).layers
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not _is_linear(head):
        raise QuantizeError("quantize needs a model with a linear LM head (get_output_embeddings())")
    # the quantizers and their kernels expect contiguous float weights; "head" leaves the layers as they are
    row_major(head if mode == "head" else model)
    if mode != "head":  # "head": the decoder layers keep their float weights
        if fuse:
            from .fused_linear import fuse_siblings

            fuse_siblings(layers, lambda linear: _make(linear, mode))
        _quantize_children(layers, mode)
    new_head = _make(head, HEAD_MODE[mode])
    model.set_output_embeddings(new_head)
    # the head no longer shares the input embedding's storage: never re-tie it (tie_weights()
    # would assign a float .weight to the quantized module)
    model._skipdecode_quantize = mode
    model._tied_weights_keys = {}
    return model


def quantized_mode(model: nn.Module) -> str | None:
    """``"int8"``/``"int4"``/``"w8a8"``/``"head"`` when :func:`quantize_model` quantized ``model``, else None."""
    return getattr(model, "_skipdecode_quantize", None)


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by ``model``'s parameters and buffers, each tensor's storage counted once, plus
    those of the entry bridge attached to it (:mod:`skipdecode.entry_bridge`, kept outside the
    module tree; float).

    Returns ``{"total", "quantized" (int8/int4 weights and their scales, w8a8's packed FBGEMM
    weights), "float"}`` in bytes; "float" includes oneDNN's packed float32 copies
    (:func:`skipdecode.onednn.packed_nbytes`, made by ``compile=True``).
    """
    from .entry_bridge import entry_bridge_of
    from .w8a8 import W8A8Linear

    seen: set[int] = set()
    quant = total = 0
    bridge = entry_bridge_of(model)
    for module in [*model.modules(), *(bridge.modules() if bridge is not None else ())]:
        is_q = isinstance(module, (_QuantLinear, W8A8Linear))
        if isinstance(module, W8A8Linear):  # its int8 codes live in FBGEMM's packed weight
            total += module.packed_nbytes()
            quant += module.packed_nbytes()
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key = t.untyped_storage().data_ptr()
            if key in seen:
                continue
            seen.add(key)
            n = t.untyped_storage().nbytes()
            total += n
            quant += n if is_q else 0
    from .onednn import packed_nbytes

    total += packed_nbytes(model)
    return {"total": total, "quantized": quant, "float": total - quant}
