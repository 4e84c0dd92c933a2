"""W8A8: int8 weights and int8 activations quantized per token at run time (``quantize="w8a8"``).

Scheme (SmoothQuant's W8A8 without smoothing; the dynamic quantization of PyTorch's
``torch.ao.nn.quantized.dynamic.Linear``, per output channel):

- weights: symmetric int8, one scale per output channel, ``s_n = max_k |W[n, k]| / 127``, the
  codes of :class:`skipdecode.quantize.Int8Linear`;
- activations: each position (a decode row, a prompt token) is quantized on its own to unsigned
  7-bit codes with its own scale and zero point (from its min and max, at run time), multiplied
  with the int8 weights in int32 and rescaled to float32 by FBGEMM
  (``torch.ops.quantized.linear_dynamic`` with ``reduce_range=True``, PyTorch's x86 kernel; 7 bits
  keep its 8-bit multiply-adds from saturating), all positions in one call (:func:`_rows`). A
  position's output never depends on the other positions or rows (solo and batched rows are
  equal, as with float weights).

Why: on CPUs without AVX-512 PyTorch's weight-only int8 kernel (``_weight_int8pack_mm``) and
inductor's fused dequantizing loops are slower than a float32 GEMV, while FBGEMM's integer
kernels read int8 weights near memory speed (the 49152x576 LM head at one row on the 2-core AVX2
test CPU: 1.3 ms against about 13-14 ms weight-only int8 and 4.6 ms float32; docs/quantization.md).
Activation rounding costs accuracy: about 1.6 % relative error per product on Gaussian inputs
against 0.75 % for weight-only int8 (measured; the quality table is in docs/quantization.md).
A decode step runs at int8's memory traffic. With ``compile=True`` each layer also gets a copy
of its codes in oneDNN's layout (:meth:`W8A8Linear.enable_onednn`), through which products of
:data:`ONEDNN_MIN_ROWS` or more rows (prefills) run: the same integers, 8-35 % faster than
FBGEMM's at 64-448 rows on the AVX-512 test host (whole prefills 0-11 % faster, as the host
varies), for N x K more bytes.

The product is the custom op ``skipdecode::w8a8_linear`` so that compiled layer graphs
(``load(..., compile=True)``) keep it as one opaque call without a graph break (FBGEMM's packed
weights are a TorchScript object, oneDNN's an opaque tensor, neither of which dynamo can pass;
the op finds them by a per-layer key held in a 0-dimensional buffer, so every layer shares one
graph). CPU only: FBGEMM has no GPU kernels.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from . import guard_memo

__all__ = ["W8A8Linear", "check_usable", "fbgemm_available", "w8a8_linear"]

#: key -> layer, for the custom op to find the packed weights (weak: a freed layer leaves)
_LAYERS: "weakref.WeakValueDictionary[int, W8A8Linear]" = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


@functools.lru_cache(maxsize=1)
def fbgemm_available() -> tuple[bool, str]:
    """Whether FBGEMM's quantized CPU kernels work in this PyTorch build: ``(ok, reason when
    not)``, from a self-test (pack a 16 x 16 weight, multiply one row) run once per process."""
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines:
        return False, f"this PyTorch build has no FBGEMM quantized engine (engines: {', '.join(engines)})"
    try:
        packed = _pack(torch.ones((16, 16), dtype=torch.int8), torch.ones(16), None)
        y = torch.ops.quantized.linear_dynamic(torch.ones((1, 16)), packed, True)
        if not torch.allclose(y, torch.full((1, 16), 16.0), rtol=1e-2):
            return False, "FBGEMM's dynamic linear failed its self-test"
    except Exception as exc:  # a removed or broken API (PyTorch deprecates quantized dtypes)
        return False, f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
    return True, ""


def check_usable(device: torch.device) -> None:
    """Raise :class:`~skipdecode.quantize.QuantizeError` (naming ``quantize='w8a8'``) unless
    W8A8 layers can live on ``device``: the CPU, with FBGEMM in this PyTorch build."""
    from .quantize import QuantizeError

    ok, why = fbgemm_available()
    if not ok:
        raise QuantizeError(f"quantize='w8a8' needs FBGEMM: {why}")
    if torch.device(device).type != "cpu":
        raise QuantizeError(f"quantize='w8a8' runs on CPUs only (FBGEMM), got a weight on {torch.device(device).type}")


def _pack(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """FBGEMM's packed weight for int8 ``codes`` (N, K) with per-row float ``scale`` (N,)."""
    prior = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():  # the qint8 tensor only carries the codes into FBGEMM's pack
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            q = torch._make_per_channel_quantized_tensor(codes, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())
    finally:
        torch.backends.quantized.engine = prior


def _rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], weight_sums: torch.Tensor,
          guard: torch.Tensor) -> torch.Tensor:
    """(M, K) float32 -> (M, N) float32: each row quantized on its own, one integer product for all.

    Row r gets the scale ``a_r = (max(x_r, 0) - min(x_r, 0)) / 127`` and zero point
    ``z_r = round(-min(x_r, 0) / a_r)``, codes ``u_r = clamp(round(x_r / a_r) + z_r, 0, 127)`` (the
    7-bit grid of FBGEMM's own dynamic quantization, ``reduce_range``). ``product``
    (:meth:`W8A8Linear._matmul`) gets the codes in ``guard``'s dtype with one ``guard`` row (1, K)
    holding 0 and 127 (so that FBGEMM's dynamic linear, which picks tensor-wide parameters,
    picks scale 1 and zero 0 and reads the codes exactly); it returns ``s_n sum_k u_rk q_nk``, and
    ``a_r (that - z_r weight_sums_n)`` with ``weight_sums_n = s_n sum_k q_nk`` is row r's product.
    The accumulation is in integers, so row r's result is the same whatever the other rows hold.
    Plain tensor code: inside a compiled layer inductor fuses it around the one opaque
    ``product`` call. Float codes for FBGEMM, which takes floats; uint8 codes (one byte each) for
    oneDNN's product of a prefill: a conversion call per product costs about 0.5 ms of a
    30-layer batch-1 step on one side, and a prefill's oneDNN gain on the other.
    """
    if x.shape[0] == 0:
        return x.new_zeros((0, weight_sums.shape[0]))
    lo = x.amin(dim=1, keepdim=True).clamp(max=0.0)
    hi = x.amax(dim=1, keepdim=True).clamp(min=0.0)
    a = (hi - lo) / 127.0
    a = torch.where(a > 0, a, torch.ones_like(a))
    z = torch.round(-lo / a)
    u = torch.clamp(torch.round(x / a) + z, 0.0, 127.0).to(guard.dtype)
    y = product(torch.cat([u, guard]))[:-1]
    return a * (y - z * weight_sums)


# A plain operator registration (torch.library.Library) rather than torch.library.custom_op: the
# latter's Python wrapper costs about 45 us a call on the 2-core test CPU, the product itself
# 25-45 us. Compiled graphs call it; eager layers call FBGEMM directly.
_LIB = torch.library.Library("skipdecode", "FRAGMENT")
_LIB.define("w8a8_linear(Tensor codes, Tensor key, Tensor scale) -> Tensor")


def w8a8_linear(codes: torch.Tensor, key: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The integer product of ``codes`` (M, K, 7-bit codes, float32 or uint8) with the int8
    weight of the layer that ``key`` (0-dim int64) names (:meth:`W8A8Linear._matmul`): (M, N)
    float32; ``scale`` (N,) gives N. The CPU kernel of the operator ``torch.ops.skipdecode.w8a8_linear`` (:func:`_rows`
    makes the codes); the row count is decided here, inside the opaque op, so a compiled graph
    holds no guard on it."""
    return _LAYERS[int(key)]._matmul(codes)


_LIB.impl("w8a8_linear", w8a8_linear, "CPU")


@torch.library.register_fake("skipdecode::w8a8_linear")
def _w8a8_linear_fake(codes: torch.Tensor, key: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.new_empty((codes.shape[0], scale.shape[0]), dtype=torch.float32)


#: rows (the guard row included) from which a layer with a oneDNN copy multiplies through it:
#: a prefill. Measured on the 2-core AVX-512 test host (PyTorch 2.13), oneDNN's u8 x s8 inner
#: product against FBGEMM's dynamic linear for SmolLM2-135M's shapes: 957 against 1400 us
#: (576 -> 1536) and 904 against 1077 (1536 -> 576) at 448 rows, 162 against 215 and 155
#: against 204 at 64 rows; FBGEMM is as fast or faster up to about 33 rows and at one row
#: (21 against 34 us), so decode steps stay on it.
ONEDNN_MIN_ROWS = 64
#: the same threshold for an LM head's W8A8 preview (:class:`~skipdecode.rescored_head.RescoredHead`,
#: 49152 x 576 for SmolLM2-135M), whose products are wide enough that oneDNN wins from a few rows:
#: on the 2-core AMD EPYC (family 26) host, 2 threads, caches flushed before each call, 1.05
#: against 1.17-1.38 ms at 8 rows, 1.46 against 1.76 at 16, 2.32 against 2.91-3.26 at 32, and
#: 1.03 against 0.93-1.06 at 4 (stop 55); so batched decode steps of 8 or more rows use it
HEAD_ONEDNN_MIN_ROWS = 9


@functools.lru_cache(maxsize=1)
def onednn_available() -> tuple[bool, str]:
    """Whether oneDNN's int8 linear (``torch.ops.onednn.qlinear_prepack`` / ``qlinear_pointwise``)
    works in this PyTorch build and agrees with FBGEMM: ``(ok, reason when not)``, from a
    self-test run once per process."""
    try:
        codes = (torch.arange(256, dtype=torch.int64).reshape(16, 16) % 255 - 127).to(torch.int8)
        scale = torch.linspace(0.5, 2.0, 16)
        u = torch.arange(48, dtype=torch.int64).reshape(3, 16).remainder(128).to(torch.uint8)
        want = (u.double() @ codes.double().T * scale.double()).float()
        got = _onednn_product(u, torch.ops.onednn.qlinear_prepack(codes, None), scale, torch.zeros(16, dtype=torch.long))
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-3):
            return False, "oneDNN's int8 linear failed its self-test"
    except Exception as exc:  # a private op renamed or removed in another PyTorch
        return False, f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
    return True, ""


def _onednn_product(codes: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zeros: torch.Tensor) -> torch.Tensor:
    """``scale_n sum_k codes[m, k] q[n, k]``: uint8 ``codes`` (M, K), oneDNN's packed int8 weight
    (N, K), ``scale`` (N,) float32 -> (M, N) float32 (activation scale 1, zero point 0; the
    inductor x86 quantization path's ``qlinear_pointwise`` op)."""
    return torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, packed, scale, zeros, None, 1.0, 0,
                                              torch.float32, "none", [None], "")


class W8A8Linear(nn.Module):
    """A linear layer with int8 weights and per-token int8 activations (module docstring).

    Args:
        weight: (N, K) float weight, as in ``nn.Linear`` (on the CPU).
        bias: (N,) float bias or None.

    Buffers: ``scale`` (N,) float32, ``max_k |W[n, k]| / 127`` (1 for an all-zero row);
    ``weight_sums`` (N,) ``scale_n sum_k q_nk`` and ``key`` (0-dim int64), neither saved. The int8
    codes live in FBGEMM's packed weight only (``self.packed``, N x K bytes, counted by
    :func:`skipdecode.quantize.resident_bytes` through :meth:`packed_nbytes`), and after
    :meth:`enable_onednn` in a second copy for oneDNN (``self.onednn_packed``, products of
    ``onednn_min_rows`` or more rows: :data:`ONEDNN_MIN_ROWS`, or what ``enable_onednn`` was given). ``forward``:
    (..., K) float32 -> (..., N), every position quantized on its own.

    Raises:
        QuantizeError: a non-CPU weight, or a PyTorch build without FBGEMM (says why); ``forward``
            on a non-CPU or non-float32 input.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        from .quantize import int8_codes

        super().__init__()
        check_usable(weight.device)
        self.out_features, self.in_features = weight.shape
        self._init(*int8_codes(weight), bias)

    @classmethod
    def from_int8(cls, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "W8A8Linear":
        """A layer on existing int8 ``codes`` (N, K) in [-127, 127] and per-row ``scale`` (N,),
        e.g. those of an :class:`~skipdecode.quantize.Int8Linear` (packed, not kept)."""
        check_usable(codes.device)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = codes.shape
        self._init(codes, scale.float(), bias)
        return self

    def _init(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.onednn_packed = None
        self.onednn = False  # a plain flag for traced code (the opaque copy is never touched there)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.register_buffer("scale", scale)
        self.register_buffer("weight_sums", scale * codes.sum(dim=1, dtype=torch.int32).float(), persistent=False)
        self.register_buffer("key", torch.zeros((), dtype=torch.long), persistent=False)
        self.guard = torch.zeros((1, self.in_features))  # :func:`_rows`' guard row, made once
        self.guard[0, 0] = 127.0
        self.guard_u8 = self.guard.to(torch.uint8)  # the same, for a prefill's uint8 codes
        self._set_packed(codes)

    def _set_packed(self, codes: torch.Tensor) -> None:
        # the bias is added outside the kernel, in float32
        self.packed = _pack(codes.contiguous(), self.scale, None)
        self.key.fill_(next(_KEYS))
        _LAYERS[int(self.key)] = self

    def codes(self) -> torch.Tensor:
        """The int8 codes (N, K) in [-127, 127], read back from the packed weight (a copy)."""
        return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()

    def _product(self, codes: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque call in the layer's graph
            return torch.ops.skipdecode.w8a8_linear(codes, self.key, self.scale)
        return self._matmul(codes)

    def _matmul(self, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` (M, K) float32 or uint8 holding 7-bit codes, the guard row included -> (M, N)
        float32 ``s_n sum_k u q``: through oneDNN's copy (uint8 codes) from
        ``onednn_min_rows`` rows when :meth:`enable_onednn` made one, else FBGEMM's dynamic
        linear (float codes)."""
        if self.onednn_packed is not None and codes.shape[0] >= self.onednn_min_rows:
            u8 = codes if codes.dtype == torch.uint8 else codes.to(torch.uint8)
            return _onednn_product(u8, self.onednn_packed, self.scale, self._zero_points)
        return torch.ops.quantized.linear_dynamic(codes.float(), self.packed, True)

    #: rows (the guard row included) from which products use the oneDNN copy
    onednn_min_rows: int = ONEDNN_MIN_ROWS

    def enable_onednn(self, min_rows: int | None = None) -> bool:
        """Make a second copy of the int8 codes in oneDNN's layout, used for products of
        ``min_rows`` (default :data:`ONEDNN_MIN_ROWS`: prefills) or more rows, the guard row
        included (``compile=True`` calls it through :func:`skipdecode.onednn.enable`, with
        :data:`HEAD_ONEDNN_MIN_ROWS` for an LM head's preview). Costs N x K more bytes
        (:meth:`packed_nbytes`); results are the same integers (exact). Returns False, changing
        nothing, where oneDNN's int8 linear is unavailable (:func:`onednn_available`).

        Raises:
            ValueError: ``min_rows`` < 1.
        """
        if min_rows is not None and (isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1):
            raise ValueError(f"min_rows must be an integer >= 1, got {min_rows!r}")
        if not onednn_available()[0]:
            return False
        if min_rows is not None:
            self.onednn_min_rows = min_rows
        self.onednn_packed = torch.ops.onednn.qlinear_prepack(self.codes(), None)
        self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        self.onednn = True
        guard_memo.invalidate()  # compiled graphs branch on the flag
        return True

    def disable_onednn(self) -> None:
        """Drop the oneDNN copy (products go to FBGEMM at every row count)."""
        self.onednn_packed = None
        self.onednn = False
        guard_memo.invalidate()

    def dequantized(self) -> torch.Tensor:
        """The int8 weight as floats, ``q * scale``: (N, K) float32."""
        return self.codes().float() * self.scale[:, None]

    def packed_nbytes(self) -> int:
        """Bytes of the packed int8 weights: N x K, twice with a oneDNN copy (FBGEMM's column
        offsets not counted)."""
        return self.out_features * self.in_features * (1 if self.onednn_packed is None else 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., T, K) float32 CPU -> (..., T, N)."""
        from .quantize import QuantizeError

        if x.device.type != "cpu" or x.dtype != torch.float32:
            raise QuantizeError(f"w8a8 layers take float32 CPU inputs, got {x.dtype} on {x.device.type}")
        shape = x.shape
        # several positions per row with a oneDNN copy (a prefill): uint8 codes, oneDNN's input.
        # In a compiled prefill T is symbolic >= 2, so this test adds no guard on its value.
        prefill = self.onednn and x.dim() >= 3 and shape[-2] != 1
        guard = self.guard_u8 if prefill else self.guard
        y = _rows(x.reshape(-1, self.in_features), self._product, self.weight_sums, guard)
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    # copies (deepcopy, pickle) carry the codes and pack them again, under a key of their own
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_codes"] = self.codes()
        state["onednn_packed"] = state.get("onednn_packed") is not None  # an opaque tensor: packed again
        del state["packed"]
        return state

    def __setstate__(self, state: dict) -> None:
        codes = state.pop("_codes")
        onednn = state.pop("onednn_packed", False)
        super().__setstate__(state)
        self.onednn_packed, self.onednn = None, False
        self._set_packed(codes)
        if onednn:
            self.enable_onednn()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
