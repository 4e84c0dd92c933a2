"""Which float32 BLAS product a CPU decode step of a few rows runs, chosen per host by timing it.

Why. A decode step multiplies a few rows (the running requests) by every weight, a memory-bound
product, and which BLAS call streams the weights fastest depends on the CPU, because MKL
dispatches its kernels by vendor. On the 2-core AMD EPYC hosts this project was first measured on
(PyTorch 2.13, MKL), a pass of ``F.linear``'s ``x @ W^T`` over the 211 linears of SmolLM2-135M
(the LM head included) took 38, 51 and 69 ms at 2, 4 and 16 rows and the same products taken
weight-first, ``(W @ x^T)^T``, 21, 22 and 43 ms (:mod:`skipdecode.layout`). On a 2-core Intel
Xeon with AMX and AVX-512 (stop 64, 23 GB/s read bandwidth) it is the other way round: a pass over
the model's 120 distinct decoder-layer weights (425 MB; the head left out) took 20.3 ms at one row
and 21.5 ms at two with ``F.linear`` (21 and 20 GB/s, MKL's GEMV) against 49.6 and 50.6 ms
weight-first (8.6 and 8.4 GB/s), and 34, 42 and 47 ms against 49, 51 and 51 at 4, 8 and 16 rows.
The embedded model's eager batch-1 decode step there ran at 11.2 tokens/s weight-first and 23.3
with ``F.linear`` (``benchmarks/results/decode_speed_intel_*_stop64.json``).

So :func:`choose` times both products on the model's own weights, once per process and thread
count, and :func:`skipdecode.layout.weight_left` sets the winner on every layer it makes weight-first
(:class:`~skipdecode.layout.WeightLeftLinear`'s ``one_row_linear`` and ``few_rows_linear``). Two
decisions: one row (``F.linear``'s GEMV against the weight-first GEMM padded to two columns) and
2 to 127 rows (the times at :data:`FEW_ROWS` rows summed). ``F.linear`` is chosen only when its
time is at most :data:`MARGIN` (0.9) of the weight-first product's, at least 10 % faster, so hosts
where the two are close keep the weight-first default. Products inside compiled graphs are not
affected (one row is a fused reduction there, :mod:`skipdecode.layout`, and from
:data:`skipdecode.onednn.MIN_ROWS` rows oneDNN's packed weight), except two-row products, which
follow the few-row choice. Results equal ``F.linear``'s up to float32 summation order either way.

``SKIPDECODE_ROW_PRODUCT`` (environment) overrides the measurement: ``auto`` (default: measure;
also when unset or empty), ``weight-first`` or ``linear`` (both decisions), for reproducible
timings or a host whose measurement is too noisy. Case and surrounding spaces are ignored; any
other value is refused (:class:`RowProductError`; :func:`skipdecode.load` raises ``LoadError``
before reading the model, whatever its other options).
"""

from __future__ import annotations

import difflib
import os
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

__all__ = ["CHOICES", "ENV_VAR", "FEW_ROWS", "MARGIN", "MAX_SAMPLE_BYTES", "MIN_SAMPLE_BYTES", "RowProduct",
           "RowProductError", "choose", "describe", "env_choice", "measure", "record"]

#: the environment variable that overrides the measurement
ENV_VAR = "SKIPDECODE_ROW_PRODUCT"
#: its values: measure, or force one product for both decisions
CHOICES = ("auto", "weight-first", "linear")
#: ``F.linear`` must take at most this share of the weight-first product's time to be chosen
MARGIN = 0.9
#: row counts whose times are summed for the 2-127-row decision (decode batches)
FEW_ROWS = (2, 4, 16)
#: fewer weight bytes than this (a tiny test model) are not measured: the weight-first default
#: stays, since the timing would be the call overhead's, not the product's
MIN_SAMPLE_BYTES = 32 * 2**20
#: at most this many weight bytes are timed (the model's first linears; a few passes each)
MAX_SAMPLE_BYTES = 256 * 2**20

_MEASURED: dict[int, "RowProduct"] = {}


class RowProductError(ValueError):
    """``SKIPDECODE_ROW_PRODUCT`` holds a value outside :data:`CHOICES`."""


@dataclass(frozen=True)
class RowProduct:
    """The products a host's few-row float32 decode products use.

    Attributes:
        one_row_linear: one row runs ``F.linear`` (MKL's GEMV) instead of the weight-first GEMM
            padded to two columns.
        few_rows_linear: 2 to 127 rows run ``F.linear`` instead of the weight-first GEMM.
        source: ``"measured"``, ``"env"`` (:data:`ENV_VAR`) or ``"default"`` (too few weight bytes
            to time, or no float32 CPU weights).
        threads: torch intra-op threads when chosen.
        ms: milliseconds of one pass over the timed weights per product and row count, e.g.
            ``{"linear@1": 20.3, "weight-first@1": 49.6, ...}`` (empty unless measured).
        sample_mb: megabytes of weights timed (0 unless measured).
    """

    one_row_linear: bool = False
    few_rows_linear: bool = False
    source: str = "default"
    threads: int = 1
    ms: dict[str, float] = field(default_factory=dict)
    sample_mb: float = 0.0

    def as_dict(self) -> dict:
        """A JSON-ready record (benchmarks' ``row_product``)."""
        return asdict(self)


def env_choice() -> str:
    """The value of :data:`ENV_VAR`, lower-cased (``"auto"`` when unset or empty).

    Raises:
        RowProductError: it is not one of :data:`CHOICES`.
    """
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower() or "auto"
    if value not in CHOICES:
        close = difflib.get_close_matches(value.replace("_", "-"), CHOICES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise RowProductError(f"{ENV_VAR} must be one of {', '.join(CHOICES)}; got {raw!r}{hint}")
    return value


def _weight_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 1:
        x = torch.cat([x, x])
    return torch.mm(w, x.t())


def _pass_ms(product, weights: list[torch.Tensor], rows: int, repeats: int) -> float:
    """Best-of-``repeats`` milliseconds of ``product`` over every weight at ``rows`` rows."""
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms the caches and MKL's buffers
        start = time.perf_counter()
        for w in weights:
            product(inputs[w.shape[1]], w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure(weights: list[torch.Tensor], repeats: int = 3) -> RowProduct:
    """Time ``F.linear`` against the weight-first product over ``weights`` at 1 row and at
    :data:`FEW_ROWS` rows, and choose ``F.linear`` for one row, and for 2-127 rows, where its time
    is at most :data:`MARGIN` of the weight-first product's (module docstring).

    Args:
        weights: 2-D contiguous float32 CPU tensors (out_features, in_features), distinct, at least
            :data:`MIN_SAMPLE_BYTES` together (the caller samples them; only the first
            :data:`MAX_SAMPLE_BYTES` are timed).
        repeats: timed passes per product and row count (best taken).

    Returns:
        A :class:`RowProduct` with ``source="measured"`` and the times in ``ms``.
    """
    sample, total = [], 0
    for w in weights:
        if total >= MAX_SAMPLE_BYTES:
            break
        sample.append(w)
        total += w.numel() * w.element_size()
    ms: dict[str, float] = {}
    with torch.no_grad():
        for rows in (1, *FEW_ROWS):
            ms[f"linear@{rows}"] = round(_pass_ms(F.linear, sample, rows, repeats), 3)
            ms[f"weight-first@{rows}"] = round(_pass_ms(_weight_first, sample, rows, repeats), 3)
    few_linear = sum(ms[f"linear@{r}"] for r in FEW_ROWS)
    few_first = sum(ms[f"weight-first@{r}"] for r in FEW_ROWS)
    return RowProduct(one_row_linear=ms["linear@1"] <= MARGIN * ms["weight-first@1"],
                      few_rows_linear=few_linear <= MARGIN * few_first, source="measured",
                      threads=torch.get_num_threads(), ms=ms, sample_mb=round(total / 2**20, 1))


def choose(weights: list[torch.Tensor]) -> RowProduct:
    """The few-row products for a model whose float32 CPU linear weights are ``weights``: from
    :data:`ENV_VAR` when it is set to a product; else, when the distinct weights hold at least
    :data:`MIN_SAMPLE_BYTES`, measured on up to :data:`MAX_SAMPLE_BYTES` of them (:func:`measure`,
    about 0.8 s for SmolLM2-135M) once per process and thread count, the first such model's
    measurement serving every later one; else the weight-first default.

    Raises:
        RowProductError: :data:`ENV_VAR` is not one of :data:`CHOICES`.
    """
    threads = torch.get_num_threads()
    forced = env_choice()
    if forced != "auto":
        linear = forced == "linear"
        return RowProduct(one_row_linear=linear, few_rows_linear=linear, source="env", threads=threads)
    if threads in _MEASURED:
        return _MEASURED[threads]
    distinct = list({w.data_ptr(): w for w in weights if w.dtype == torch.float32 and w.device.type == "cpu"
                     and w.dim() == 2 and w.is_contiguous()}.values())
    if sum(w.numel() * w.element_size() for w in distinct) < MIN_SAMPLE_BYTES:
        return RowProduct(threads=threads)
    _MEASURED[threads] = measure(distinct)
    return _MEASURED[threads]


def record(model: torch.nn.Module) -> dict | None:
    """The few-row products :func:`skipdecode.layout.weight_left` chose for ``model``, as
    :meth:`RowProduct.as_dict` (None when it has no float32 CPU layers made weight-first)."""
    choice = getattr(model, "skipdecode_row_product", None)
    return None if choice is None else choice.as_dict()


def describe(choice: dict | None) -> str:
    """A :func:`record` in words, for ``skipdecode info`` and ``bench``: ``"F.linear at 1 row,
    weight-first at 2-127 rows (timed on 256.5 MB of the weights, 2 threads)"``, ``"... (forced:
    SKIPDECODE_ROW_PRODUCT=linear)"`` or ``"... (default: too few weights to time)"``; ``""`` for
    None."""
    if choice is None:
        return ""
    name = {True: "F.linear", False: "weight-first"}
    if choice["source"] == "measured":
        how = f"timed on {choice['sample_mb']:g} MB of the weights, {choice['threads']} threads"
    elif choice["source"] == "env":
        how = f"forced: {ENV_VAR}={'linear' if choice['one_row_linear'] else 'weight-first'}"
    else:
        how = "default: too few weights to time"
    return f"{name[choice['one_row_linear']]} at 1 row, {name[choice['few_rows_linear']]} at 2-127 rows ({how})"
