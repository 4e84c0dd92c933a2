"""Benchmark variants (float32 / int8 / int4, eager / compiled), memory floors and llama.cpp.

:func:`run_variants` runs :func:`skipdecode.bench.run_benchmark` once per *variant* of one loaded
model, in one process, and adds to every row:

- ``variant`` (e.g. ``"int8+compile"``), the variant's resident weight bytes and compile time
  (paid by :func:`skipdecode.compiled.warm_up` before any timing, reported separately);
- ``bytes_per_step``: what a decode step must read from memory at least: the weights of the
  layers it runs (in their stored width: 4, 1 or 0.5 bytes per weight plus scales), the tail
  (final norm + LM head, read every step whatever the plan), B embedding rows, and the KV cache
  each active layer attends to (B x (prompt + t) positions x 2 x kv heads x head dim);
- ``floor_ms = bytes_per_step / bandwidth`` and ``over_floor = step_ms / floor_ms``, with the
  read bandwidth measured in the same run by :func:`measure_bandwidth`.

:func:`llamacpp_row` (batch 1) and :func:`llamacpp_batched_row` (B sequences per
``llama_decode``) decode the same GGUF file with llama.cpp at its native quantization
(:mod:`skipdecode.bench_llamacpp`, re-exported here), greedy, same threads, timed like our rows.

The library never prints: ``skipdecode bench --variants ...`` does.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Sequence

import torch

from . import row_product
from .bench_llamacpp import llamacpp_batched_row, llamacpp_row
from .quantize import QUANTIZE_MODES, quantize_model, resident_bytes

__all__ = [
    "parse_variants",
    "variant_dtype",
    "variant_fuse",
    "measure_bandwidth",
    "build_variant",
    "step_bytes",
    "add_floors",
    "run_variants",
    "llamacpp_row",
    "llamacpp_batched_row",
    "issue_targets",
]


def parse_variants(text: str) -> list[tuple[str, str | None, bool | str]]:
    """``"float32,int8+compile"`` -> ``[("float32", None, False), ("int8+compile", "int8", "auto")]``.

    Each item is a weight format (float32, int8, int4, w8a8, or head: the LM head alone; int8,
    int4 and w8a8 optionally ``-unfused``: one product per projection instead of fused q/k/v and gate/up,
    :func:`variant_fuse`) with an optional ``+compile`` (compile mode "auto": the fused int8
    products, or the layer calls of a float32 or int4 model) or ``+compile-layers`` (mode
    "layers": every decoder-layer call); or ``bfloat16`` (the model's float weights cast to
    bfloat16, eager; :func:`variant_dtype`), fast on CPUs with AMX.

    Raises:
        ValueError: an unknown item (the message names ``--variants`` and the allowed forms).
    """
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        base, _, suffix = item.partition("+")
        if base.removesuffix("-unfused") in QUANTIZE_MODES and base != "head-unfused":  # see variant_fuse
            base = base.removesuffix("-unfused")
        if item != "bfloat16" and (base not in ("float32", *QUANTIZE_MODES)
                                   or suffix not in ("", "compile", "compile-layers")):
            raise ValueError(
                f"--variants items must be float32, int8, int4, w8a8 (these three optionally -unfused) or head, "
                f"each optionally +compile or +compile-layers, or bfloat16; got {item!r}"
            )
        mode = {"": False, "compile": "auto", "compile-layers": "layers"}[suffix]
        out.append((item, None if base in ("float32", "bfloat16") else base, mode))
    if not out:
        raise ValueError("--variants must name at least one variant")
    return out


def variant_dtype(name: str) -> torch.dtype | None:
    """The float dtype a variant named ``name`` (:func:`parse_variants`) casts the model to:
    ``torch.bfloat16`` for ``"bfloat16"``, None (the loaded model's dtype) otherwise."""
    return torch.bfloat16 if name == "bfloat16" else None


def variant_fuse(name: str) -> bool:
    """Whether a variant named ``name`` (:func:`parse_variants`) quantizes sibling projections
    as one product each (:mod:`skipdecode.fused_linear`): False for ``"<format>-unfused..."``."""
    return not name.partition("+")[0].endswith("-unfused")


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth in GB/s (1e9 bytes/s), best of ``repeats``, with torch's current threads.

    ``read_gbs``: ``src.sum()`` over a float32 tensor of ``megabytes`` MB (reads it once; what
    weight-streaming needs). ``copy_gbs``: ``dst.copy_(src)``, counting read + write bytes.
    """
    n = megabytes * 1_000_000 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.sum()
    dst.copy_(src)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t)
    nbytes = n * 4
    return {"read_gbs": nbytes / best_read / 1e9, "copy_gbs": 2 * nbytes / best_copy / 1e9, "megabytes": megabytes}


def build_variant(sk, quantize: str | None, compile: bool | str, cache: dict[Any, Any] | None = None,
                  dtype: torch.dtype | None = None, fuse: bool = True):
    """A :class:`SkipModel` sharing ``sk``'s tokenizer and policy, quantized (siblings fused into
    one product unless ``fuse`` is False) and/or compiled, or cast to ``dtype`` (a float dtype;
    None: ``sk``'s own).

    Quantized or cast weights are made from a deep copy of ``sk.model``, kept in ``cache`` by
    format, dtype and kernel mode (``int8+compile`` has its own copy, whose modules run compiled
    kernels); ``sk`` itself is never modified.
    Returns ``(model, compile_report or None)``; compile time is paid here (batch 1 and 8).
    """
    from .compiled import compile_adapter, warm_up
    from .model import SkipModel

    cache = {} if cache is None else cache
    # compiled kernels are switched on per quantized module: such a variant gets its own copy
    key = (quantize, quantize is not None and compile not in (False, "layers"), dtype, fuse)
    if key not in cache:
        if dtype is not None:  # a copy of load()'s layers; off float32 the weight-first ones run F.linear
            cache[key] = copy.deepcopy(sk.model).to(dtype)
        else:
            cache[key] = sk.model if quantize is None else quantize_model(copy.deepcopy(sk.model), quantize, fuse=fuse)
            if quantize == "head":  # float layers weight-first, as load() makes them (a no-op on its models)
                from .layout import weight_left

                weight_left(cache[key])
    variant = SkipModel(cache[key], sk.tokenizer, policy=sk.policy, chat=sk.chat, source=sk.source,
                        skip_config=sk.skip_config)
    report = None
    if compile:
        mode = "auto" if compile is True else compile
        report = warm_up(variant, compile_adapter(variant.adapter, mode=mode), (1, 8))
        variant.compile_report = report
    return variant, report


def _module_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s weights as a decode step reads them: oneDNN's packed float32
    duplicates (:mod:`skipdecode.onednn`) and the oneDNN int8 copies of W8A8 layers (used for
    prefills only, :data:`skipdecode.w8a8.ONEDNN_MIN_ROWS`) are left out, since each product
    reads either the plain weight or its packed copy, never both."""
    from .onednn import packed_nbytes
    from .w8a8 import W8A8Linear

    int8_copies = sum(m.out_features * m.in_features for m in module.modules()
                      if isinstance(m, W8A8Linear) and m.onednn_packed is not None)
    return resident_bytes(module)["total"] - packed_nbytes(module) - int8_copies


def step_bytes(sk, layers_run: Sequence[int], batch_size: int, prompt_len: int) -> float:
    """Mean bytes one decode step reads (see the module docstring), over ``layers_run``.

    Args:
        sk: the benchmarked :class:`SkipModel` (weights in their stored format).
        layers_run: active layer count of each decode step t = 1, 2, ... (the plan keeps the
            bottom ``warmup`` and top layers; per-layer sizes are equal in these models, so the
            mean layer size is used).
        batch_size: B (sequences).
        prompt_len: padded prompt length P (tokens); step t attends to P + t positions.
    """
    adapter = sk.adapter
    layer_bytes = [_module_bytes(layer) for layer in adapter.layers]
    mean_layer = sum(layer_bytes) / len(layer_bytes)
    model = sk.model
    layer_ids = {id(m) for layer in adapter.layers for m in layer.modules()}
    emb = model.get_input_embeddings()
    tail = 0
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is emb.weight:
        tail += emb.weight.numel() * emb.weight.element_size()  # tied float head: the whole table
    elif head is not None and hasattr(head, "step_read_bytes"):  # int4 preview + rescored rows
        tail += head.step_read_bytes(batch_size)
    elif head is not None:
        tail += _module_bytes(head)
    head_ids = {id(m) for m in head.modules()} if head is not None else set()  # counted above
    for name, module in model.named_modules():  # final norms / projections outside the layers
        if id(module) in layer_ids or id(module) in head_ids or module is emb or list(module.children()):
            continue
        if "embed_positions" in name or name.endswith("wpe"):
            continue
        tail += _module_bytes(module)
    emb_row = emb.weight.shape[-1] * emb.weight.element_size()
    kv_heads, head_dim = adapter.kv_shape
    el = next(model.parameters()).element_size()
    total = 0.0
    for t, n in enumerate(layers_run, start=1):
        kv = n * batch_size * (prompt_len + t) * 2 * kv_heads * head_dim * el
        total += n * mean_layer + tail + batch_size * emb_row + kv
    return total / max(len(layers_run), 1)


def add_floors(rows: list[dict[str, Any]], sk, prompt_lens: dict[int, int], bandwidth_gbs: float) -> None:
    """Add ``bytes_per_step``, ``floor_ms`` and ``over_floor`` to each row (in place)."""
    for r in rows:
        b = step_bytes(sk, r["layers_run"], r["batch_size"], prompt_lens[r["batch_size"]])
        r["bytes_per_step"] = b
        r["floor_ms"] = b / (bandwidth_gbs * 1e9) * 1e3
        r["over_floor"] = r["step_ms"] / r["floor_ms"]


def run_variants(
    sk,
    variants: Sequence[tuple[str, str | None, bool | str]],
    *,
    bench_kwargs: dict[str, Any],
    bandwidth: dict[str, float] | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Benchmark every variant of ``sk`` (see the module docstring) in one run.

    Args:
        sk: the float32 :class:`SkipModel`; HF ``generate`` runs once, on the first variant's
            model, when ``bench_kwargs["include_hf"]`` (put float32 first for the usual baseline).
        variants: from :func:`parse_variants`.
        bench_kwargs: keyword arguments of :func:`skipdecode.bench.run_benchmark`.
        bandwidth: a :func:`measure_bandwidth` result (default: measured here, first).

    Returns:
        ``{"meta", "rows", "targets", "bandwidth", "variants"}``; ``rows`` hold every variant's
        rows with ``variant`` and the floor fields.

    Raises:
        ValueError: as :func:`run_benchmark`.
    """
    from .bench import batch_prompts, run_benchmark
    from .generate import encode_prompts

    progress = on_progress or (lambda msg: None)
    if bandwidth is None:
        progress("measuring memory bandwidth")
        bandwidth = measure_bandwidth()
    cache: dict[Any, Any] = {}
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    result: dict[str, Any] = {}
    prompts = bench_kwargs.get("prompts")
    for i, (name, quantize, compile) in enumerate(variants):
        progress(f"variant {name}: preparing")
        variant, report = build_variant(sk, quantize, compile, cache, dtype=variant_dtype(name), fuse=variant_fuse(name))
        kwargs = dict(bench_kwargs)
        kwargs["include_hf"] = bool(bench_kwargs.get("include_hf", True)) and i == 0
        part = run_benchmark(variant, on_progress=lambda m, n=name: progress(f"{n}: {m}"), **kwargs)
        prompt_lens = {}
        for B in {r["batch_size"] for r in part["rows"]}:
            texts = batch_prompts(B, prompts) if prompts else batch_prompts(B)
            prompt_lens[B] = encode_prompts(variant.tokenizer, texts, chat=variant.chat)[0].shape[1]
        add_floors(part["rows"], variant, prompt_lens, bandwidth["read_gbs"])
        for r in part["rows"]:  # HF generate ran on this (the first) variant's model
            r["variant"] = name
        rows += part["rows"]
        info[name] = {
            "quantize": quantize,
            "fused_projections": quantize not in (None, "head") and variant_fuse(name),
            "compile": compile,
            "dtype": str(next(variant.model.parameters()).dtype).removeprefix("torch."),
            "resident_bytes": resident_bytes(variant.model),
            "compile_report": report.to_dict() if report is not None else None,
            "row_product": row_product.record(variant.model),
        }
        if i == 0:
            result["meta"] = part["meta"]
            result["targets"] = part["targets"]
    result.update(rows=rows, bandwidth=bandwidth, variants=info)
    return result


def issue_targets(rows: list[dict[str, Any]], llamacpp: dict[str, Any] | None,
                  llamacpp_batched: dict[str, Any] | None = None) -> dict[str, Any]:
    """The targets of issue 11, from one run's rows (None where a needed row is missing).

    - float32 full depth, batch 1, within 1.3x of its floor;
    - the 3x policy at batch 1 with the lowest-bit variant no slower per token than llama.cpp at
      full depth (int8 alone: within 1.5x of it, for weight-only int8 and for w8a8 each);
    - wall-clock over theoretical speedup at 3x, batch 1, >= 0.85 with a quantized head;
    - at batch 8, tokens/s of the 3x policy (best variant) above llama.cpp's batched decoding of
      8 sequences (``llamacpp_batched``, :func:`llamacpp_batched_row` at batch 8).
    """
    def find(variant_prefix: str, policy: str, B: int) -> list[dict[str, Any]]:
        return [r for r in rows if r.get("engine") == "skipdecode" and r["policy"] == policy
                and r["batch_size"] == B and r.get("variant", "float32").split("+")[0] == variant_prefix]

    out: dict[str, Any] = {}
    f = find("float32", "full", 1)
    out["float32_full_b1_over_floor"] = min((r["over_floor"] for r in f), default=None)
    out["float32_full_b1_within_1.3x_floor"] = None if not f else out["float32_full_b1_over_floor"] <= 1.3
    lc = llamacpp["step_ms"] if llamacpp else None
    for q, limit in (("int4", 1.0), ("int8", 1.5), ("w8a8", 1.5)):
        r3 = find(q, "3x", 1)
        best = min((r["step_ms"] for r in r3), default=None)
        out[f"{q}_3x_b1_step_ms"] = best
        out[f"{q}_3x_b1_vs_llamacpp"] = None if best is None or lc is None else best / lc
        out[f"{q}_3x_b1_within_{limit:g}x_llamacpp"] = None if best is None or lc is None else best <= limit * lc
    quant3 = [r for q in QUANTIZE_MODES for r in find(q, "3x", 1)]
    best_ratio = max((r["wall_over_theoretical"] for r in quant3), default=None)
    out["quantized_3x_b1_wall_over_theoretical"] = best_ratio
    out["quantized_3x_b1_wall_over_theoretical_ge_0.85"] = None if best_ratio is None else best_ratio >= 0.85
    b8 = [r for r in rows if r.get("engine") == "skipdecode" and r["policy"] == "3x" and r["batch_size"] == 8]
    ours8 = max((r["tokens_per_s"] for r in b8), default=None)
    lc8 = llamacpp_batched["tokens_per_s"] if llamacpp_batched and llamacpp_batched["batch_size"] == 8 else None
    out["3x_b8_tokens_per_s"] = ours8
    out["llamacpp_b8_tokens_per_s"] = lc8
    out["3x_b8_above_llamacpp_b8"] = None if ours8 is None or lc8 is None else ours8 > lc8
    return out


def variants_table(result: dict[str, Any]):
    """A ``rich.table.Table`` of :func:`run_variants` rows (and the llama.cpp rows, each after our
    rows of its batch size), with floors."""
    from rich.table import Table

    bw = result["bandwidth"]
    table = Table(
        title=(f"decode step per variant | floor = bytes read per step / {bw['read_gbs']:.1f} GB/s "
               f"(read bandwidth measured in this run; copy {bw['copy_gbs']:.1f} GB/s)"),
        title_justify="left",
    )
    for col in ("batch", "variant", "policy", "mean layers", "theoretical", "step ms", "tok/s", "wall speedup",
                "wall/theo", "MB/step", "floor ms", "x floor"):
        table.add_column(col, justify="left" if col in ("variant", "policy") else "right")
    lc = ([result["llamacpp"]] if result.get("llamacpp") else []) + list(result.get("llamacpp_batched") or [])
    rows = sorted(result["rows"] + lc, key=lambda r: (r["batch_size"], r.get("engine") == "llama.cpp",
                                                      r["policy"] != "full", r["policy"]))
    last = None
    for r in rows:
        if last is not None and r["batch_size"] != last:
            table.add_section()
        last = r["batch_size"]
        engine = r.get("engine")
        policy = {"hf": "HF generate", "llama.cpp": "llama.cpp full"}.get(engine, r["policy"])
        theo = r.get("theoretical_speedup")
        table.add_row(
            str(r["batch_size"]), r.get("variant", "-"), policy,
            f"{r['mean_active_layers']:.1f}" if "mean_active_layers" in r else "-",
            f"{theo:.2f}x" if theo else "-",
            f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:.1f}",
            f"{r['wall_speedup']:.2f}x" if engine == "skipdecode" else "-",
            f"{r['wall_over_theoretical']:.2f}" if engine == "skipdecode" and r["policy"] != "full" else "-",
            f"{r['bytes_per_step'] / 1e6:.0f}", f"{r['floor_ms']:.2f}" if "floor_ms" in r else "-",
            f"{r['over_floor']:.2f}" if "over_floor" in r else "-",
        )
    return table
