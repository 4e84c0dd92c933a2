"""A cheap LM head for int4 and w8a8 models: a preview of every logit (on the CPU in float32 the
W8A8 product of the int8 codes, elsewhere a 4-bit copy), the top candidates rescored exactly from
an int8 copy.

The LM head of a small model is the largest single matrix a decode step reads (SmolLM2-135M:
49152 x 576, 28 MB in int8, 14 MB in int4, against 3.5 MB in int8 for a whole decoder layer), and
it is read at every step whatever the skip policy, so it sets how much of a policy's theoretical
speedup reaches the wall clock. A plain 4-bit head costs too much quality (docs/quantization.md:
top-1 agreement with float32 0.85 against 0.95 for the int8 head). :class:`RescoredHead` reads
the 4-bit head for all ``N`` logits, keeps the ``k`` largest per row, and recomputes those ``k``
from the int8 head's rows (``k x K`` bytes, 37 KB for k = 64). This is the preview-then-refine
scheme of SVD-softmax (Shim et al., NeurIPS 2017, "SVD-Softmax: Fast Softmax Approximation on
Large Vocabulary Neural Networks", Sec. 3: a cheap preview of every logit, exact logits for the
top candidates), with a low-bit preview instead of a truncated SVD.

Guarantees (tested):

- the ``k`` candidate logits equal the int8 head's (``Int8Linear``) up to float32 summation order;
  every other logit is the preview's;
- so greedy decoding picks the int8 head's token whenever that token is among the preview's top
  ``k`` (its preview logit is within the int4 rounding of its int8 logit, and ``k`` is large
  against the preview's rank errors: on SmolLM2 the int4 head's top-1 already agrees 85 % of the
  time); top-k / top-p sampling with ``top_k <= k`` draws from exact int8 logits when the nucleus
  lies inside the candidates;
- more than :data:`RESCORE_MAX_ROWS` rows (a prefill or teacher-forced pass, compute-bound)
  run the int8 head for every logit, so prompt logits are the int8 head's exactly.

Memory: both copies are resident (int8 + int4: 28 + 15 MB for SmolLM2; w8a8 models' head has no
int4 copy), and FBGEMM's packed copy of the int8 codes for the W8A8 preview (28 MB, up to
:data:`RESCORE_MAX_ROWS` rows); a decode step
reads one preview and ``k`` int8 rows per row (:meth:`RescoredHead.step_read_bytes`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from . import guard_memo
from .selection import topk_indices

__all__ = ["RESCORE_CANDIDATES", "RESCORE_MAX_ROWS", "RescoredHead"]

#: Candidates per row whose logits are recomputed from the int8 head.
RESCORE_CANDIDATES = 64
#: Rows (batch x positions) up to which the preview is used; more rows run the int8 head alone.
RESCORE_MAX_ROWS = 64


class RescoredHead(nn.Module):
    """An LM head computing an int4 preview of all logits and int8 logits for the top ``k``.

    Args:
        weight: (N, K) float head weight (vocabulary x hidden), as in ``nn.Linear``.
        bias: (N,) float bias or None.
        candidates: k, rows' logits rescored from int8 (clamped to N); >= 1.
        int4_preview: keep the int4 preview (for rows the W8A8 one cannot take: off the CPU,
            not float32, no FBGEMM). False (w8a8 models' head): the W8A8 preview only; such rows
            then get the int8 head's logits everywhere.

    Submodules: ``preview`` (:class:`~skipdecode.quantize.Int4Linear`; None with
    ``int4_preview=False``) and ``exact``
    (:class:`~skipdecode.quantize.Int8Linear`), both of ``weight``, and ``row_preview``, the
    preview of float32 rows on the CPU: the int8 codes of ``exact`` with each row's activations
    quantized to int8 on their own (:class:`~skipdecode.w8a8.W8A8Linear`, FBGEMM; None where
    FBGEMM is missing or off the CPU), faster than PyTorch's int4 kernel at every row count
    measured on the 2-core AVX2 test CPU (the 49152 x 576 head: 1.6 against 2.1 ms at one row,
    2.4 against 5.8 at 8, 7.6 against 22.8 at 32) and closer to the int8 logits. Either way the
    candidates get the int8 head's logits and a row's logits do not depend on the other rows.
    ``forward``: (..., K) float -> (..., N) logits in the input's dtype.

    Raises:
        ValueError: ``candidates`` < 1 (names ``candidates``).
        skipdecode.quantize.QuantizeError: K odd (int4 needs an even width); ``int4_preview``
            False where the W8A8 preview cannot be made (names why).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, candidates: int = RESCORE_CANDIDATES,
                 int4_preview: bool = True) -> None:
        super().__init__()
        from .quantize import Int4Linear, Int8Linear, QuantizeError

        if not isinstance(candidates, int) or isinstance(candidates, bool) or candidates < 1:
            raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")
        self.out_features, self.in_features = weight.shape
        self.candidates = min(candidates, self.out_features)
        self.preview = Int4Linear(weight, bias) if int4_preview else None
        self.exact = Int8Linear(weight, bias)
        self.row_preview = _row_preview(self.exact)
        if self.preview is None and self.row_preview is None:
            from .w8a8 import check_usable

            check_usable(weight.device)  # raises, naming why
            raise QuantizeError("a rescored head without its int4 preview needs the W8A8 one")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., K) -> logits (..., N): preview everywhere, int8 at each row's top ``k``."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > RESCORE_MAX_ROWS or x2.shape[0] == 0:
            return self.exact(x)
        logits = self.preview_logits(x2)
        idx = topk_indices(logits, self.candidates)  # (M, k): torch.topk's set, faster on the CPU
        logits.scatter_(-1, idx, self.rescore(x2, idx))
        return logits.reshape(*shape[:-1], self.out_features)

    #: the preview a single row (a batch-1 decode step) takes where both exist: "w8a8"
    #: (:attr:`row_preview`) or "int4" (``preview``); :meth:`tune_one_row` picks the faster
    one_row_preview: str = "w8a8"

    def preview_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The preview of every logit, ``x`` (M, K) -> (M, N): :attr:`row_preview` for float32
        rows where it exists (one row: the int4 ``preview`` when :attr:`one_row_preview` says
        so), else the int4 ``preview``."""
        if x.shape[0] == 1 and self.one_row_preview == "int4" and self.preview is not None:
            return self.preview(x)
        if self.row_preview is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.row_preview(x[:, None, :])[:, 0]
        return self.preview(x) if self.preview is not None else self.exact(x)

    @torch.no_grad()
    def tune_one_row(self, measure: Callable[[Callable[[], Any]], float] | None = None) -> dict[str, float]:
        """Time both previews on one float32 row and keep the faster in :attr:`one_row_preview`.

        At one row the preview is a read of the whole head (W8A8: N x K int8 bytes; int4: half
        that, through PyTorch's int4 kernel), so the faster one depends on the CPU: on the 2-core
        AVX-512 test host, with the caches flushed before each call as the layers of a decode
        step flush them, the int4 kernel took 1.01 ms against 1.30 for W8A8 (hot, 0.94 against
        0.78), and a compiled w8a8 batch-1 step at the 3x policy 6.9-7.2 ms against 7.4-7.7; on
        the AVX2 test host W8A8 measured faster (1.6 against 2.1 ms). A head without its int4
        copy (w8a8 models) gets one made from the int8 codes (``(N, K / 2)`` bytes, about 14 MB
        for SmolLM2), kept only if it wins. Either way the candidates get the int8 head's
        logits, so greedy tokens follow the int8 head as before (the int4 preview's top 64 held
        the int8 head's top-1 at 4175 of 4175 positions of the embedded model's E2E answers).

        Args:
            measure: ``measure(fn) -> seconds`` for one call of ``fn``; default: the median of 7
                calls, each after writing a 64 MB buffer (evicting the caches), by
                ``time.perf_counter``.

        Returns:
            ``{"w8a8": ms, "int4": ms}`` (milliseconds per call); {} where there is nothing to
            choose (no W8A8 preview, or no int4 kernel here), leaving the head unchanged.
        """
        from .quantize import Int4Linear

        if self.row_preview is None:
            return {}
        made = self.preview is None
        if made:
            self.preview = Int4Linear(self.exact.dequantized(), self.exact.bias)
        if not self.preview.kernel:  # the fallback layout dequantizes every call: never faster
            if made:
                self.preview = None
            return {}
        x = torch.randn(1, self.in_features, generator=torch.Generator().manual_seed(0))
        measure = measure or _flushed_median
        times = {"w8a8": 1e3 * measure(lambda: self.row_preview(x[:, None, :])),
                 "int4": 1e3 * measure(lambda: self.preview(x))}
        self.one_row_preview = min(times, key=times.get)
        guard_memo.invalidate()  # a compiled head branches on it
        if made and self.one_row_preview != "int4":
            self.preview = None
        return times

    def rescore(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Int8 logits of the candidates: ``x`` (M, K), ``idx`` (M, k) vocabulary ids -> (M, k).

        ``logit[m, j] = scale[i] * sum_c x[m, c] q[i, c] (+ bias[i])`` with ``i = idx[m, j]``, the
        int8 head's product (:class:`~skipdecode.quantize.Int8Linear`) for those rows only.
        """
        rows = self.exact.weight_int8[idx].to(x.dtype)  # (M, k, K)
        # a multiply-and-sum per row, not bmm: a row's sums then do not depend on the batch
        y = (rows * x[:, None, :]).sum(-1) * self.exact.scale.to(x.dtype)[idx]
        if self.exact.bias is not None:
            y = y + self.exact.bias.to(x.dtype)[idx]
        return y

    def step_read_bytes(self, rows: int) -> int:
        """Bytes one float32 decode step of ``rows`` rows reads from this head: the whole preview
        (:attr:`row_preview`'s int8 weight, one packed copy, and scales where it exists, else, and at one row
        when :attr:`one_row_preview` is "int4", the int4 codes, scales and zeros, bias) plus ``k``
        int8 rows and their scales per row."""
        int4_row = rows == 1 and self.one_row_preview == "int4" and self.preview is not None
        if self.row_preview is not None and not int4_row:  # one N x K copy of the codes (FBGEMM's or oneDNN's)
            rp = self.row_preview
            preview = rp.out_features * rp.in_features + self.exact.scale.numel() * self.exact.scale.element_size()
        else:
            preview = sum(t.numel() * t.element_size() for t in [*self.preview.buffers(), *self.preview.parameters()])
        per_row = self.in_features + self.exact.scale.element_size()
        return preview + rows * self.candidates * per_row

    def dequantized(self) -> torch.Tensor:
        """The int8 head's weight (N, K) float: the logits the candidates get (see module doc)."""
        return self.exact.dequantized()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, candidates={self.candidates}"


def _flushed_median(fn: Callable[[], Any], calls: int = 7, flush_bytes: int = 64 << 20) -> float:
    """Median seconds of ``calls`` calls of ``fn`` (after one untimed call), each after writing
    ``flush_bytes`` of memory so that the weights ``fn`` reads come from memory, as in a decode
    step whose layers have just been read."""
    buf = torch.zeros(flush_bytes // 4)
    fn()
    times = []
    for _ in range(calls):
        buf.add_(1.0)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row_preview(exact: nn.Module) -> nn.Module | None:
    """The float32 rows' preview on ``exact``'s int8 codes (packed again for FBGEMM): a
    :class:`~skipdecode.w8a8.W8A8Linear`, or None off the CPU or without FBGEMM. On the 2-core AVX2
    test CPU a compiled 3x int4 decode step on the stock weights takes 8.55 against 9.3 ms at
    batch 1 with it (the previews swapped in one process), 17.6 against 20.8 at batch 8 (separate
    runs)."""
    from .quantize import QuantizeError
    from .w8a8 import W8A8Linear

    try:
        return W8A8Linear.from_int8(exact.weight_int8, exact.scale, exact.bias)
    except QuantizeError:
        return None
