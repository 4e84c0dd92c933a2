"""``skipdecode bench``: the decode-speed benchmark command (float32 against HF ``generate``, or
quantized/compiled variants next to llama.cpp). :mod:`skipdecode.cli` registers it on its app."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .cli_common import (
    COMPILE_HELP,
    MODEL_HELP,
    NO_ADAPTER_HELP,
    QUANTIZE_HELP,
    as_option_error,
    check_output_folder,
    check_policy_options,
    check_quantize_option,
    set_threads,
    command_line,
    err,
    fail,
    load_model,
    out,
    read_prompts_file,
)
from .jsonio import dumps
from .paths import portable_record

#: The policy fields a benchmark's ValueError may name -> bench's options (e.g. a speedup the model
#: cannot reach: "--speedups must be <= 15.00 for a model of 30 layers ...").
BENCH_POLICY_OPTIONS = {"speedup": "--speedups", "horizon": "--horizon"}


def bench(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    batch_sizes: str = typer.Option("1,8,32", "--batch-sizes", help="Comma-separated batch sizes."),
    speedups: List[str] = typer.Option([], "--speedups", "--speedup", "-s", help="Target speedups, comma-separated or repeated (--speedup 2 --speedup 3; default 2,3,5; full depth is always run)."),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Tokens generated per row in every run (equal lengths)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Policies' horizon T (default: --new-tokens). A model trained for its own schedule of another horizon (the embedded model's 2x adapter: 4) then times the generic schedule; the run says so, and --horizon H times the trained one."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per configuration (median reported)."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs per configuration."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads (torch.set_num_threads; default: every core, as timings want)."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="Also time Hugging Face generate on the same prompts."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="Prompt pool, one per line (default: 32 built-in prompts)."),
    output: Path = typer.Option(Path("skipdecode-bench/decode_speed.json"), "--output", "--out", "-o", help="Results JSON (a PNG plot is written beside it). benchmarks/decode_speed.py writes benchmarks/results/ instead."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Write the PNG plot beside the JSON."),
    profile: bool = typer.Option(False, "--profile", help="Also break a decode step down (full depth and the largest speedup)."),
    profile_batch_sizes: str = typer.Option("1,8", "--profile-batch-sizes", help="Batch sizes of the --profile breakdown."),
    bandwidth_gbs: float = typer.Option(15.0, "--bandwidth-gbs", help="Memory bandwidth (GB/s) of the profile's bytes-per-step floor."),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=NO_ADAPTER_HELP + " The stock weights are what llama.cpp runs: the adapter costs speed on full-depth decode steps (its delta is taken out again) and with int4 (it stays a float LoRA path)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP + " Benchmarks that one variant."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    variants: Optional[str] = typer.Option(None, "--variants", help="Several variants in one run, comma-separated: float32, int8, int8+compile, int4+compile, w8a8+compile, head+compile, ... (e.g. float32,w8a8+compile; each row gets its memory floor; head: the LM head alone quantized); int8-unfused, int4-unfused+compile, ...: one product per projection instead of fused q/k/v and gate/up."),
    llamacpp: Optional[str] = typer.Option(None, "--llamacpp", help="Add llama.cpp rows decoding this GGUF file ('default': the embedded model's): batch 1, and each batch size > 1 as that many sequences per llama_decode; needs the bench-llamacpp extra."),
) -> None:
    """Decode speed: per-step ms and tokens/s of full depth and each speedup vs HF generate; table + JSON."""
    from . import bench as B

    speedup_text = ",".join(speedups) if speedups else "2,3,5"  # --speedup 2 --speedup 3 == --speedups 2,3
    sizes, targets, profile_sizes = _parse_bench_options(batch_sizes, speedup_text, profile_batch_sizes, new_tokens,
                                                         repeats, warmup, horizon, bandwidth_gbs)
    prompts = B.DEFAULT_PROMPTS
    if prompts_file is not None:
        prompts = tuple(read_prompts_file(prompts_file))
    check_output_folder(output.parent, "--output", output)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(f"--device {device}: CUDA is not available on this machine")
    set_threads(threads, default_all_cores=True)
    check_quantize_option(quantize)
    if variants is not None and (quantize is not None or compile):
        fail("give either --variants or --quantize/--compile, not both")
    bench_kwargs = dict(batch_sizes=sizes, speedups=targets, new_tokens=new_tokens, horizon=horizon, repeats=repeats,
                        warmup=warmup, include_hf=hf, prompts=prompts)
    if variants is not None or quantize is not None or compile or llamacpp is not None:
        if profile:
            fail("--profile breaks down the float32 eager step only; leave out --variants/--quantize/--compile/--llamacpp")
        variant_list = _parse_variant_list(variants, quantize, compile)
        gguf = None if llamacpp is None else _llamacpp_gguf(llamacpp)
        _bench_variants(ctx, model, device, dtype, not no_adapter, variant_list, gguf, output, plot, bench_kwargs)
        return
    sk = load_model(model, device, dtype, adapter=not no_adapter)
    try:
        result = B.run_benchmark(sk, **bench_kwargs, on_progress=_progress)
        if profile:
            result["profile"] = B.profile_decode(
                sk, batch_sizes=profile_sizes, speedups=targets[-1:] if targets else (), new_tokens=new_tokens,
                horizon=horizon, repeats=repeats, bandwidth_gbs=bandwidth_gbs, predict_speedups=targets, prompts=prompts,
                on_progress=_progress,
            )
    except ValueError as e:
        fail(as_option_error(e, BENCH_POLICY_OPTIONS))
    from .row_product import record

    result["meta"]["row_product"] = record(sk.model)
    _report_float_bench(ctx, result, output, plot, profile)


def _parse_bench_options(batch_sizes, speedups, profile_batch_sizes, new_tokens, repeats, warmup, horizon,
                         bandwidth_gbs) -> tuple:
    """Parse ``bench``'s list options and check its counts (exits 2 naming the option)."""
    from . import bench as B

    try:
        sizes = B.parse_int_list(batch_sizes, "--batch-sizes")
        targets = B.parse_float_list(speedups, "--speedups")
        profile_sizes = B.parse_int_list(profile_batch_sizes, "--profile-batch-sizes")
    except ValueError as e:
        fail(str(e))
    for name, value, low in (("--new-tokens", new_tokens, 2), ("--repeats", repeats, 1), ("--warmup", warmup, 0)):
        if value < low:
            fail(f"{name} must be >= {low}, got {value}")
    check_policy_options(None, None, None, horizon)  # --horizon >= 1
    if bandwidth_gbs <= 0:
        fail(f"--bandwidth-gbs must be > 0, got {bandwidth_gbs}")
    return sizes, targets, profile_sizes


def _parse_variant_list(variants, quantize, compile) -> list:
    """The variants to time: ``--variants``, else the one that ``--quantize``/``--compile`` name.
    Exits 2 with one line naming ``--variants`` on an unknown item or one given twice (it would be
    timed twice, its rows in the table twice, and the JSON would keep one)."""
    from . import bench_engines as E

    try:
        variant_list = E.parse_variants(variants or (quantize or "float32") + ("+compile" if compile else ""))
    except ValueError as e:
        fail(str(e))
    names = [name for name, _, _ in variant_list]
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        fail(f"--variants lists {repeated!r} more than once; give each variant once")
    return variant_list


def _llamacpp_gguf(llamacpp: str) -> str:
    """The GGUF file of ``--llamacpp`` ('default': the embedded model's), checked with llama-cpp-python."""
    from .loading import LoadError, embedded_gguf_path

    try:
        gguf = str(embedded_gguf_path()) if llamacpp == "default" else llamacpp
    except LoadError as e:
        fail(f"--llamacpp: {e}")
    if not Path(gguf).is_file():
        fail(f"--llamacpp {gguf}: no such GGUF file")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        fail("--llamacpp needs llama-cpp-python: pip install -e '.[bench-llamacpp]'")
    return gguf


def _progress(msg: str) -> None:
    """Print a benchmark progress line to stderr, dimmed."""
    err.print(f"[dim]{escape(msg)}[/]", highlight=False)


def _report_float_bench(ctx, result: dict, output: Path, plot: bool, profile: bool) -> None:
    """Write the float32 benchmark's files, print its tables and targets, then its JSON line."""
    from . import bench as B

    result["meta"]["command"] = command_line(ctx)
    path = B.write_results(result, output)
    if plot:
        B.write_plot(result, path.with_suffix(".png"))
    table_out = out if out.is_terminal else Console(width=200)
    table_out.print(B.results_table(result))
    if profile:
        table_out.print(B.profile_table(result["profile"]))
    t = result["targets"]
    checked = sorted({int(k.split("/")[0]) for k in t["wall_over_theoretical"]})
    wall_target = (f"wall/theoretical >= {t['wall_over_theoretical_min']} at batch "
                   f"{' and '.join(map(str, checked))}: {t['wall_over_theoretical_met']}" if checked
                   else "wall/theoretical: not checked (it needs batch 1 or 8 and a speedup that skips a layer)")
    hf = t["full_not_slower_than_hf"]
    if result["meta"].get("row_product") is not None:
        from .row_product import describe

        err.print(f"few-row product: {describe(result['meta']['row_product'])}", markup=False, highlight=False)
    err.print(
        f"[dim]targets: ours-full no slower than HF: {'n/a (--no-hf)' if hf is None else hf} | {wall_target} | "
        f"results: {escape(str(path))}[/]",
        highlight=False,
    )
    print(dumps(portable_record(result)), flush=True)  # as written: repo-relative paths


def _llamacpp_rows(result: dict, gguf: str, bench_kwargs: dict, threads: int) -> None:
    """Add llama.cpp's rows (``llamacpp``, ``llamacpp_batched``) to ``result``, each decoded in a
    child process of its own (:func:`skipdecode.bench_llamacpp.run_isolated`). A crash inside
    llama.cpp keeps our rows: it is recorded as ``llamacpp_error`` and printed, and the run goes on
    without llama.cpp's remaining rows. Exits 2 (naming ``--llamacpp``) on llama.cpp's own errors."""
    from . import bench as B
    from . import bench_llamacpp as L

    prompts, new_tokens, repeats = bench_kwargs["prompts"], bench_kwargs["new_tokens"], bench_kwargs["repeats"]
    bandwidth = result["bandwidth"]["read_gbs"]
    result["llamacpp_batched"] = []
    try:
        _progress("llama.cpp: batch 1, full depth")
        result["llamacpp"] = L.run_isolated(L.llamacpp_row, gguf, B.batch_prompts(1, prompts)[0], new_tokens,
                                            threads, repeats, bandwidth)
        for b in (b for b in bench_kwargs["batch_sizes"] if b > 1):  # same prompts as our rows of batch b
            _progress(f"llama.cpp: batch {b}, full depth (low-level llama_decode, {b} sequences)")
            try:
                result["llamacpp_batched"].append(L.run_isolated(
                    L.llamacpp_batched_row, gguf, B.batch_prompts(b, prompts), new_tokens, threads, repeats, bandwidth))
            except L.LlamaCppCrash:
                raise
            except RuntimeError as e:
                fail(f"--llamacpp: batch {b}: {e}")
    except L.LlamaCppCrash as e:
        hint = ("; a llama.cpp built with AMX kernels stops so on these machines: rebuild it without AMX "
                "(docs/quantization.md, 'The benchmark')" if "SIGILL" in str(e) else "")
        result["llamacpp_error"] = f"{e}{hint}"
        err.print(f"warning: --llamacpp: {e}{hint}; its remaining rows are left out, ours are kept", markup=False,
                  highlight=False)


def _bench_variants(ctx, model, device, dtype, adapter, variant_list, gguf, output, plot, bench_kwargs) -> None:
    """``skipdecode bench --variants/--quantize/--compile/--llamacpp``: table, files, JSON line."""
    import torch

    from . import bench as B
    from . import bench_engines as E
    from .row_product import describe as describe_row_product

    sk = load_model(model, device, dtype, adapter=adapter)
    try:
        result = E.run_variants(sk, variant_list, bench_kwargs=bench_kwargs, on_progress=_progress)
    except ValueError as e:
        fail(as_option_error(e, BENCH_POLICY_OPTIONS))
    if gguf is not None:
        _llamacpp_rows(result, gguf, bench_kwargs, torch.get_num_threads())
    batched8 = next((r for r in result.get("llamacpp_batched", []) if r["batch_size"] == 8), None)
    result["issue_targets"] = E.issue_targets(result["rows"], result.get("llamacpp"), batched8)
    result["meta"]["command"] = command_line(ctx)
    result["meta"]["variants"] = [v[0] for v in variant_list]
    path = B.write_results(result, output)
    if plot:  # the speedup plot of the first variant (the others are in the table and JSON)
        first = variant_list[0][0]
        B.write_plot({**result, "rows": [r for r in result["rows"] if r.get("variant") == first]},
                     path.with_suffix(".png"))
    table_out = out if out.is_terminal else Console(width=220)
    table_out.print(E.variants_table(result))
    for name, v in result["variants"].items():
        rb = v["resident_bytes"]
        comp = v["compile_report"]
        extra = "" if comp is None else (f" | compile {comp['compile_seconds']:.1f} s (batch 1 and 8, before timing)"
                                         if comp["enabled"] else f" | compile unavailable: {comp['error']}")
        if v.get("row_product") is not None:
            extra += f" | few-row product: {describe_row_product(v['row_product'])}"
        err.print(f"{name}: resident weights {rb['total'] / 1e6:.0f} MB ({rb['quantized'] / 1e6:.0f} MB quantized){extra}",
                  markup=False, highlight=False)
    err.print(f"issue 11 targets: {dumps(result['issue_targets'])} | results: {path}", markup=False, highlight=False)
    print(dumps(portable_record(result)), flush=True)  # as written: repo-relative paths
