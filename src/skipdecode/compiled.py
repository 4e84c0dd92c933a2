"""A compiled decode step: ``torch.compile`` of each decoder-layer call (``load(..., compile=True)``).

What is compiled: :func:`skipdecode.adapters.base.call_layer`, the one function through which
THE layer loop (:mod:`skipdecode.forward`) runs a stock decoder layer, for decode steps only (one
new token per row) and for prefills (several new tokens per row, no gradient:
:func:`_prefill_layer`), and the adapter's ``head`` (final norm and LM head) for one position per
row. The layer module is an argument of the compiled
function, so all layers of a model share its compiled code. The KV-cache write is traced into
the layer's graph (:class:`_TracedWrite`): the cache hands over the layer's preallocated buffers
and the key length after the write (``decode_write``), the graph writes each row's new token in
place and attends to the first ``key_length`` positions, and the cache's per-layer (or per-slot)
lengths are bumped outside, after the call (``commit_decode_write``). So each layer call is one
compiled region without a graph break, and a growing cache changes no graph's code (key length
and buffer capacity are symbolic). A prefill writes its T positions the same way into a
:class:`~skipdecode.cache.SkipCache` (its first prefill per layer runs eagerly and teaches the
layer's K/V geometry), with batch, T, key length and capacity symbolic from its first compile.
A cache without ``decode_write`` gets the former path: its ``update`` runs eagerly between two
compiled regions (a graph break).

Variants are bounded and do not grow with the policy or the layer count: one graph per cache
layout (a static batch, a :class:`~skipdecode.cache.SlotCache`'s first B slots read in place, or
slots gathered from it), per state of a decode-only adapter's switch (base weights, adapter,
rows of both) and per batch of one or of more rows (a batch of
more is symbolic from its first compile, :func:`_mark_dynamic`); layer indices are not
specialised, and key length and buffer capacity are symbolic after their second value (dynamo's
automatic dynamic shapes). The prefill's variants: a batch of one or more rows, an empty cache,
a stored prefix or a static batch's (whose capacity exceeds its key length); a weight-only
quantized linear takes its eager kernel there at any row count (its fused loop is for decode
steps), so no row count makes a variant. The number of recompilations a model may trigger is
raised to ``2 * num_layers + 8`` for these calls only.
With :mod:`skipdecode.quantize` weights, the compiled region fuses each weight-only product into one
loop (the fast int8/int4 path).

Decode-step layer calls and the head run through a :class:`~skipdecode.guard_memo.GuardMemo`: a
call whose inputs match, in everything a guard can read, a call dynamo checked before runs the
compiled code dynamo chose then, without the check (about 90 us a call on the test host).

First-call compile time is paid by :func:`warm_up` (run by ``load(compile=True)`` and by the
benchmark before any timing) and reported by it, never inside step timings. Where compilation is
unavailable (no C compiler, an unsupported platform, a dynamo error), :func:`compile_adapter`
falls back to eager and says why in :attr:`CompileReport.error`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx.experimental._config  # use_duck_shape (compiled prefill)

from . import decode_attention, guard_memo
from .adapters.base import Adapter, call_layer
from .cache import SkipCache
from .guard_memo import GuardMemo

__all__ = ["COMPILE_MODES", "CompileReport", "compile_adapter", "resolve_mode", "warm_up", "compile_available"]


@dataclass
class CompileReport:
    """What :func:`compile_adapter` / :func:`warm_up` did.

    Attributes:
        enabled: decode steps run compiled (False: eager fallback).
        mode: "kernels" (the weight-only products of quantized linears) or "layers" (every
            decoder-layer call and the LM head).
        backend: the torch.compile backend ("inductor").
        compile_seconds: wall-clock seconds of the warm-up generations that compiled (s);
            0.0 before :func:`warm_up`.
        warmed_batch_sizes: batch sizes the warm-up ran (sequences).
        error: why compilation is unavailable, one line ("" when enabled).
        onednn_layers: linears with a oneDNN copy of their weights (:mod:`skipdecode.onednn`;
            mode "layers" only): float32 ones use it from 3 rows, W8A8 ones of the decoder
            layers from 64 (prefills, :data:`skipdecode.w8a8.ONEDNN_MIN_ROWS`), an LM head's
            W8A8 preview from 9 (:data:`skipdecode.w8a8.HEAD_ONEDNN_MIN_ROWS`).
        prefill: mode "layers": prefill layer calls (several new tokens per row, no gradient)
            run compiled too; False once a prefill compile failed (the decode steps stay
            compiled; ``prefill_error`` says why).
        prefill_error: why compiled prefill was turned off, one line ("" while it runs).
        head_one_row: mode "layers" with a rescored LM head that has both previews: the one a
            batch-1 step takes and both times, e.g. ``{"chosen": "int4", "w8a8": 1.3, "int4":
            1.0}`` (milliseconds; :meth:`~skipdecode.rescored_head.RescoredHead.tune_one_row`);
            {} otherwise.
        grouped_attention: mode "layers": the model's HF SDPA attention was switched to
            :func:`~skipdecode.decode_attention.grouped_decode_attention` (one query per row on
            the CPU as products over the key/value head groups; anything else still SDPA).
        memos: the :class:`~skipdecode.guard_memo.GuardMemo` of the decode-step layer call and
            of the head (mode "layers"); not serialised, counted by :meth:`guard_checks`.
    """

    enabled: bool
    mode: str = "layers"
    backend: str = "inductor"
    compile_seconds: float = 0.0
    warmed_batch_sizes: list[int] = field(default_factory=list)
    error: str = ""
    onednn_layers: int = 0
    prefill: bool = False
    prefill_error: str = ""
    head_one_row: dict[str, Any] = field(default_factory=dict)
    grouped_attention: bool = False
    memos: list = field(default_factory=list, repr=False)

    def guard_checks(self) -> dict[str, int]:
        """Compiled decode-step calls so far (layer calls and heads): ``checked`` went through
        dynamo's guard check, ``direct`` skipped it (:mod:`skipdecode.guard_memo`)."""
        return {"checked": sum(m.checked for m in self.memos), "direct": sum(m.direct for m in self.memos)}

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable copy (with :meth:`guard_checks`)."""
        out = {k: v for k, v in self.__dict__.items() if k != "memos"}
        out["guard_checks"] = self.guard_checks()
        return out


def _fall_back(adapter: Adapter, report: CompileReport, exc: BaseException) -> None:
    """A compiled call failed: the model runs eagerly from now on, as it was before
    :func:`compile_adapter` (HF's SDPA attention again), and ``report`` says why."""
    report.enabled = False
    report.error = _one_line(exc)
    if report.grouped_attention:
        decode_attention.disable(adapter.model)
        report.grouped_attention = False


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (at most 300 characters)."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}"[:300]


class _EagerCacheWrite:
    """Hands the layer's cache write to the real cache outside the compiled graph."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """``cache.update`` (B, H_kv, T, D) -> the layer's keys and values so far, run eagerly."""
        return self.cache.update(key_states, value_states, layer_idx, *args, **kwargs)


class _TracedWrite:
    """The layer's cache write *inside* the compiled graph (no graph break): each row's new token
    goes into preallocated buffers and the layer attends to their first ``key_length`` positions.
    Tracing it keeps one compiled region per layer call (a break inside the attention costs a
    resumed region, and its guards, for every frame above it); the cache's lengths are bumped
    outside, by ``commit_decode_write``.

    ``keys``/``values`` are (B, H_kv, capacity, D) buffers holding batch row i in their row i
    (a :class:`~skipdecode.cache.SkipCache`, or the first B slots of a slot cache, ``slots``
    None), or (R, H_kv, capacity, D) slot buffers (R rows: the slots used so far) with ``slots`` (B,) mapping rows to slots
    (their keys gathered). ``positions`` (B,) are the write positions; None: every row writes at
    ``key_length - 1``.
    """

    def __init__(self, keys, values, key_length, slots, positions) -> None:
        self.keys, self.values, self.key_length = keys, values, key_length
        self.slots, self.positions = slots, positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """Write (B, H_kv, T, D) keys/values (T = 1 with ``slots``; a prefill writes its T
        positions ``K - T`` to ``K``); return (B, H_kv, K, D) keys/values so far."""
        K = self.key_length
        if self.positions is None:
            T = key_states.shape[2]
            self.keys.narrow(2, K - T, T).copy_(key_states)
            self.values.narrow(2, K - T, T).copy_(value_states)
            return self.keys[:, :, :K], self.values[:, :, :K]
        if self.slots is None:  # batch row i is buffer row i: written and read in place
            rows = torch.arange(key_states.shape[0], device=key_states.device)
            self.keys[rows, :, self.positions] = key_states[:, :, 0]
            self.values[rows, :, self.positions] = value_states[:, :, 0]
            return self.keys[:, :, :K], self.values[:, :, :K]
        self.keys[self.slots, :, self.positions] = key_states[:, :, 0]
        self.values[self.slots, :, self.positions] = value_states[:, :, 0]
        return self.keys[:, :, :K].index_select(0, self.slots), self.values[:, :, :K].index_select(0, self.slots)


def _decode_layer(layer, hidden, attention_mask, keys, values, key_length, slots, positions, cache_kw, extra):
    """:func:`call_layer` for one decode step with the cache write traced (:class:`_TracedWrite`)."""
    cache = _TracedWrite(keys, values, key_length, slots, positions)
    return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)


def _prefill_layer(layer, hidden, attention_mask, keys, values, cache_kw, extra):
    """:func:`call_layer` for a prefill with the cache write traced: :func:`_decode_layer`'s
    twin, a function of its own so that its compiled variants (symbolic prompt length) sit in a
    cache of their own and a decode step's lookup never walks them. The key length after the
    write is the mask's last size, (B, 1, T, K), a symbolic size where a passed integer would be
    specialised on its first value."""
    cache = _TracedWrite(keys, values, attention_mask.shape[-1], None, None)
    return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)


def compile_available() -> tuple[bool, str]:
    """Whether ``torch.compile`` with inductor can run here: ``(ok, reason when not)``.

    Compiles and runs a two-op function once (a few seconds the first time in a process).
    """
    try:
        fn = torch.compile(lambda x: (x * 2).sum(-1), backend="inductor", dynamic=False)
        fn(torch.ones(2, 3))
        return True, ""
    except Exception as exc:  # any failure means: run eagerly
        return False, _one_line(exc)


COMPILE_MODES = ("auto", "kernels", "layers")


def resolve_mode(adapter: Adapter, mode: str) -> str:
    """``"auto"`` -> ``"kernels"`` for int8 weights (its fused products, faster than int8 inside
    the layer graphs on the AVX2 test CPU: 72 against 89 ms a 3x step), else ``"layers"`` (float and
    int4 weights; int4 on PyTorch's kernel inside the layer graphs: 11.6 against 16.2 ms a 3x step
    eagerly, docs/quantization.md).

    Raises:
        ValueError: ``mode`` is not one of :data:`COMPILE_MODES` (names ``compile``).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be True, False or one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    from .quantize import quantized_mode

    return "kernels" if quantized_mode(adapter.model) == "int8" else "layers"


def compile_adapter(adapter: Adapter, backend: str = "inductor", check: bool = True, mode: str = "layers",
                    onednn: bool = True) -> CompileReport:
    """Compile the decode step of ``adapter``'s model.

    Args:
        adapter: the model's adapter.
        backend: torch.compile backend of mode "layers" ("inductor"; "eager"/"aot_eager" for
            debugging); mode "kernels" always uses inductor.
        check: first test that inductor works here (:func:`compile_available`).
        mode: "layers": ``adapter.run_layer`` uses a compiled layer call (and ``adapter.head`` a
            compiled tail) for decode steps. "kernels": every quantized linear
            (:mod:`skipdecode.quantize`) runs its decode-step product through a shared compiled
            fused kernel; the rest stays eager (the faster choice on the test CPU, see
            docs/quantization.md). "auto": kernels for an int8 model, else layers (:func:`resolve_mode`).
        onednn: mode "layers": float32 CPU linears also get oneDNN's packed weights for products
            of 3 or more rows, eager ones included (a prefill), and W8A8 linears a oneDNN int8
            copy for products of 64 or more rows (prefills), at the cost of a second copy of
            those weights (:func:`skipdecode.onednn.enable`; ``CompileReport.onednn_layers``).

    Returns:
        A :class:`CompileReport`; ``enabled=False`` and ``error`` set when compilation is
        unavailable (the model is then left eager).

    Raises:
        ValueError: unknown ``mode``; mode "kernels" on a model without quantized linears.
    """
    mode = resolve_mode(adapter, mode)
    quantized = _kernel_linears(adapter) if mode == "kernels" else []
    if check and (backend == "inductor" or mode == "kernels"):
        ok, why = compile_available()
        if not ok:
            adapter.compiled_layer_call = None
            return CompileReport(enabled=False, mode=mode, backend="inductor", error=why)
    if mode == "kernels":
        for m in quantized:
            m.compiled_kernel = m.fuses_when_compiled  # int4 with PyTorch's kernel: stays on it
        return CompileReport(enabled=True, mode="kernels", backend="inductor")
    report = CompileReport(enabled=True, mode="layers", backend=getattr(backend, "__name__", str(backend)))
    report.grouped_attention = decode_attention.enable(adapter.model)
    if report.grouped_attention:
        guard_memo.invalidate()  # graphs traced before read the old attention function
    run = _layer_call(adapter, backend, report)
    report.prefill = True
    adapter.compiled_layer_call = run
    _compile_head(adapter, backend, report)
    if onednn:
        from . import onednn as _onednn

        report.onednn_layers = _onednn.enable(adapter.model)
    return report


def _kernel_linears(adapter: Adapter) -> list:
    """Mode "kernels": ``adapter`` -> its model's weight-only quantized linears (ValueError: its layers hold none)."""
    from .quantize import _QuantLinear

    quantized = [m for m in adapter.model.modules() if isinstance(m, _QuantLinear)]
    if not any(isinstance(m, _QuantLinear) for m in adapter.layers.modules()):  # (w8a8: only its head's int8 copy)
        raise ValueError("compile mode 'kernels' needs weight-only quantized weights (quantize='int8' or 'int4')")
    return quantized


def _layer_call(adapter: Adapter, backend: Any, report: CompileReport) -> Callable:
    """Mode "layers": ``adapter`` -> its ``compiled_layer_call`` (decode steps; prefills via :func:`_prefill_call`)."""
    compiled = torch.compile(call_layer, backend=backend, dynamic=None)
    traced = GuardMemo(_decode_layer, torch.compile(_decode_layer, backend=backend, dynamic=None))
    report.memos.append(traced)
    traced_prefill = GuardMemo(_prefill_layer, torch.compile(_prefill_layer, backend=backend, dynamic=None))
    report.memos.append(traced_prefill)
    limit = 2 * adapter.num_layers + 8
    index_of = _layer_indices(adapter)
    # made once: entering a ready patch costs about 15 us a layer call, building one 34 us
    # (measured on the AVX2 test CPU; 31 layer calls a full-depth step)
    limits = torch._dynamo.config.patch(
        recompile_limit=limit, accumulated_recompile_limit=max(256, 4 * limit), allow_unspec_int_on_nn_module=True
    )
    run_prefill = _prefill_call(report, index_of, traced_prefill, limits)

    def run(layer, hidden, attention_mask, cache, cache_kw, extra):
        if not report.enabled:  # an earlier compile failed (layer or head): stay eager
            return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)
        layer_idx = index_of.get(id(layer))
        if hidden.shape[1] > 1 or (isinstance(cache, SkipCache) and layer_idx is not None
                                   and (cache.prefill or cache.keys[layer_idx] is None)):
            # a prompt's tokens, one token too: on a prefill cache (a one-token chunk, a stored
            # prefix and one token more) a decode write would take a decode step's variant, key
            # length = the buffers' size, that compiled mid-serving; on an empty layer it finds no
            # buffers, and the eager write it fell back to broke each layer's graph into four
            if attention_mask is None:  # one token, no padding: it sees every key, itself included
                attention_mask = hidden.new_zeros(hidden.shape[0], 1, 1, cache.lengths[layer_idx] + 1)
            return run_prefill(layer, hidden, attention_mask, cache, cache_kw, extra)
        # position ids arrive as a slice of a (B, K) tensor whose stride grows with K: make them
        # contiguous so that strides never trigger a recompile
        extra = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        write = None
        if cache is not None and layer_idx is not None and hasattr(cache, "decode_write"):
            write = cache.decode_write(layer_idx, hidden.shape[0])
        # only an eager write can change the lengths before a failure (the traced one commits after)
        lengths = cache.snapshot_lengths() if cache is not None and write is None else None
        try:
            if write is not None:
                args = (layer, hidden, attention_mask, write.keys, write.values, write.key_length, write.slots,
                        write.positions, cache_kw, extra)
                out = _memo_call(traced, args, write, False, limits)
                cache.commit_decode_write(layer_idx, write)
                return out
            with limits:
                wrapped = None if cache is None else _EagerCacheWrite(cache)
                return compiled(layer, hidden, attention_mask, wrapped, cache_kw, extra)
        except Exception as exc:  # compilation failed at run time: fall back for good
            _fall_back(adapter, report, exc)
            adapter.compiled_layer_call = None
            if lengths is not None:  # undo an eager cache write the failed call may have made
                cache.restore_lengths(lengths)
            return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)

    return run


def _prefill_call(report: CompileReport, index_of: dict[int, int], traced_prefill: Any, limits: Any) -> Callable:
    """``traced_prefill`` (compiled :func:`_prefill_layer`) and the recompile ``limits`` -> the prefill layer call."""
    # prefill shapes: a prompt length equal to the key length gets no shared symbol (duck sizing),
    # so the first prefill after a stored prefix (key length > prompt length) compiles nothing new
    prefill_shapes = torch.fx.experimental._config.patch(use_duck_shape=False)
    kv_like: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per layer: (1, H_kv, 1, D) K/V geometry

    def run_prefill(layer, hidden, attention_mask, cache, cache_kw, extra):
        """A prefill layer call (T new tokens per row into a :class:`SkipCache`, T > 1 or a
        one-token prompt into an empty layer, no gradient), compiled like a decode step with the
        cache write in its graph, the batch, T, the key length and the buffers' capacity symbolic
        from the start (:func:`_mark_dynamic`). A layer whose K/V geometry is not known yet (its
        first prefill) runs eagerly once and teaches it. A failure turns compiled prefill off for good
        and reruns the call eagerly; the decode steps stay compiled."""
        layer_idx = index_of.get(id(layer))
        if not report.prefill or layer_idx is None or not isinstance(cache, SkipCache):
            return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)
        write = cache.decode_write(layer_idx, hidden.shape[0], hidden.shape[1], kv_like.get(layer_idx))
        if write is None or write.key_length != attention_mask.shape[-1]:
            # no geometry yet, buffers of another batch, or a mask that is not the cache's: eager
            out = call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)
            if cache.keys[layer_idx] is not None:
                kv_like[layer_idx] = (cache.keys[layer_idx][:1, :, :1].clone(), cache.values[layer_idx][:1, :, :1].clone())
            return out
        extra = {k: _canonical(v) for k, v in extra.items()}
        args = (layer, hidden, attention_mask, write.keys, write.values, cache_kw, extra)
        try:  # the first layer of a prefill is checked, the others run the code it chose
            out = _memo_call(traced_prefill, args, write, True, limits, prefill_shapes)
        except Exception as exc:  # the lengths were not bumped: the eager call writes the same positions
            report.prefill = False
            report.prefill_error = _one_line(exc)
            return call_layer(layer, hidden, attention_mask, cache, cache_kw, extra)
        cache.commit_decode_write(layer_idx, write)
        return out

    return run_prefill


def _memo_call(memo: GuardMemo, args: tuple, write: Any, prefill: bool, *contexts: Any) -> Any:
    """A layer call with its cache write traced, ``args = (layer, hidden, attention_mask, ...,
    extra)``, through ``memo``: directly when dynamo checked inputs like these before; else with
    its varying sizes marked symbolic (:func:`_mark_dynamic`, ``write`` and ``prefill`` as there)
    and checked by dynamo inside ``contexts`` (recompile limits, prefill shape settings).
    Returns the layer's output; raises what dynamo or the layer raise."""
    key = memo.key(args[0], args[1:])
    if memo.ready(key):
        return memo(key, *args)
    _mark_dynamic(args[1], args[2], args[-1], write, prefill=prefill)
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        return memo(key, *args)


def _canonical(value: Any) -> Any:
    """A layer extra (tensor, or tuple/list of them) with row-major strides. ``contiguous()``
    keeps the stride of a size-1 dimension (a batch of one sliced from a wider tensor), and
    dynamo guards on it: a copy makes every call's strides the same."""
    if isinstance(value, torch.Tensor):
        strides, step = [], 1
        for size in reversed(value.shape):
            strides.append(step)
            step *= size
        return value if value.stride() == tuple(reversed(strides)) else value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, (tuple, list)):
        return type(value)(_canonical(v) for v in value)
    return value


def _mark_dynamic(hidden: torch.Tensor, attention_mask: torch.Tensor | None, extra: dict, write: Any,
                  prefill: bool) -> None:
    """Mark a layer call's varying sizes symbolic before its first compile, so that a new batch
    size (or, in a prefill, prompt length or key length) compiles nothing: the cache buffers'
    rows and capacity (``write``, a :class:`~skipdecode.cache.DecodeWrite`: (B or R, H_kv,
    capacity, D)); the batch B (dimension 0 of every input and of a slot view's (B,) slots and
    positions, when B > 1; a batch of one keeps its own graph); and, with ``prefill``, the new
    tokens T (``hidden`` (B, T, C), dimension 1 of every extra of T positions such as position ids
    (B, T) and rotary tables (B, T, D)) and the key length K (``attention_mask`` (B, 1, T, K);
    None in an unpadded decode step, :func:`skipdecode.forward.unmasked_layers`)."""
    B, T = hidden.shape[:2]

    def mark(t: torch.Tensor, dims: list[int]) -> None:
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)

    for buf in (write.keys, write.values):  # slots and capacity vary: never specialise on them
        mark(buf, [0, 2])
    batch = [0] if B > 1 else []
    mark(hidden, batch + ([1] if prefill else []))
    if attention_mask is not None:  # None: an unpadded decode step (forward.unmasked_layers)
        mark(attention_mask, batch + ([2, 3] if prefill else []))
    for t in (write.slots, write.positions):
        if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == B:
            mark(t, batch)
    stack = list(extra.values())
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor) and v.ndim >= 2:
            mark(v, (batch if v.shape[0] == B else []) + ([1] if prefill and v.shape[1] == T else []))


def _layer_indices(adapter: Adapter) -> dict[int, int]:
    """``id(layer) -> index`` of every decoder layer whose attention writes the cache under that
    index (HF attention modules pass their ``layer_idx`` to ``Cache.update``); a layer whose
    attention says otherwise is left out and keeps the eager cache write."""
    out = {}
    for i, layer in enumerate(adapter.layers):
        declared = {getattr(m, "layer_idx") for m in layer.modules() if isinstance(getattr(m, "layer_idx", None), int)}
        if declared <= {i}:
            out[id(layer)] = i
    return out


def _compile_head(adapter: Adapter, backend: str, report: CompileReport) -> None:
    """Compile the model's tail (final norm, projections, LM head) for one position per row,
    after a rescored head picked its one-row preview (``report.head_one_row``).

    Sets an instance attribute ``head`` that shadows the class method, so :func:`skip_forward`
    (which calls ``adapter.head``) is unchanged; more than one position (teacher forcing, a
    full-sequence prefill) and calls with gradients on run the eager head.
    """
    from .rescored_head import RescoredHead

    for module in adapter.model.modules():  # before compiling: the graph follows the choice
        if isinstance(module, RescoredHead):
            times = module.tune_one_row()
            if times:
                report.head_one_row = {"chosen": module.one_row_preview, **times}
    eager_head = adapter.head
    fn = type(adapter).head
    compiled = GuardMemo(fn, torch.compile(fn, backend=backend, dynamic=None))
    report.memos.append(compiled)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] != 1 or not report.enabled or torch.is_grad_enabled():
            return eager_head(hidden)
        try:
            hidden = hidden.contiguous()  # the prefill passes a strided last-position view
            return compiled(compiled.key(adapter.model, (hidden,)), adapter, hidden)
        except Exception as exc:
            _fall_back(adapter, report, exc)
            return eager_head(hidden)

    adapter.head = head


from .compile_warmup import warm_up  # noqa: E402  (re-exported; the warm-up lives in its own module)
