"""The ``skipdecode`` command (typer). The library never prints; only this module does.

Subcommands: ``generate``, ``chat`` (cli_chat.py), ``bench`` (cli_bench.py), ``train`` (cli_train.py), ``eval``,
``serve`` (cli_serve.py), ``info``. Heavy imports happen inside each command so ``--help`` is instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from .jsonio import dumps

app = typer.Typer(
    help="SkipDecode (arXiv 2307.02628): batch- and KV-cache-compatible layer skipping for fast decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names instead of cutting them
    context_settings={"max_content_width": 120},  # wide terminals show whole command summaries
)
from .cli_common import (  # noqa: E402  (shared with cli_bench)
    COHORT_HELP,
    COMPILE_HELP,
    FREQUENCY_PENALTY_HELP,
    PRESENCE_PENALTY_HELP,
    REPETITION_PENALTY_HELP,
    STOP_HELP,
    TEMPERATURE_HELP,
    TOP_K_HELP,
    TOP_P_HELP,
    MODEL_HELP,
    NO_ADAPTER_HELP,
    PREFIX_CACHE_HELP,
    QUANTIZE_HELP,
    THREADS_HELP,
    as_option_error,
    check_cohort_option,
    check_policy_options,
    check_output_folder,
    check_quantize_option,
    command_line,
    err,
    fail,
    load_model,
    out,
    print_logprobs,
    read_prompts_file,
    resolve_policy,
    sampling_from_options,
    set_threads,
    speedup_values,
    stock_weights_at_full_depth,
    stop_from_options,
)
from .cli_chat import chat  # noqa: E402
from .cli_eval_options import check_eval_rows, check_eval_run, eval_error_message, eval_items  # noqa: E402


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        out.print(f"skipdecode {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print skipdecode's version and exit."),
) -> None:
    """SkipDecode (arXiv 2307.02628): batch- and KV-cache-compatible layer skipping for fast decoding."""

#: ``eval --model``'s help: unlike generate/bench/serve, its default is the stock weights.
EVAL_MODEL_HELP = ("HF model id, checkpoint directory or .gguf file, or LABEL=MODEL to name its rows LABEL "
                   "(e.g. 2x=runs/e2e-2x/final); repeatable. Default: 'stock', the embedded "
                   "SmolLM2-135M-Instruct WITHOUT its skip adapter (its stock weights; generate, bench and "
                   "serve merge the adapter by default). '--model default' evaluates the embedded model with its "
                   "2x skip adapter merged; '--model stock --model default' compares the two.")
#: ``eval --no-adapter``'s help (the other commands' NO_ADAPTER_HELP says the adapter is merged by default).
EVAL_NO_ADAPTER_HELP = ("Do not merge a model's shipped skip adapter. eval's default model, 'stock', never has it; "
                        "'--model default' (the embedded SmolLM2-135M-Instruct with its 2x adapter) runs without it "
                        "under this flag.")


@app.command(short_help="Generate under a skip policy, streamed, then print statistics.")
def generate(
    prompts: List[str] = typer.Argument(None, help="Prompt(s); several run as one left-padded batch."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="Text file, one prompt per line (added to the batch)."),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Target speedup (>= 1); picks max/min layers (paper Sec. 3; docs/design.md)."),
    max_layers: Optional[int] = typer.Option(None, "--max-layers", help="e_max: layers at step 0 of the decay."),
    min_layers: Optional[int] = typer.Option(None, "--min-layers", help="e_min: floor of the layer budget (default: the floor of the model's own policy, e.g. its skip adapter's; without one, = --max-layers, a constant budget)."),
    warmup_layers: Optional[int] = typer.Option(None, "--warmup-layers", help="Bottom layers that always run (default: the model's schedule's, else 1)."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Decode steps over which the budget decays (tokens)."),
    full_depth_steps: Optional[int] = typer.Option(None, "--full-depth-steps", help="First decode steps that run every layer, with the base model's weights, before the decay (default: the model's schedule's, e.g. 14 for the embedded model's --speedup 2; 0: the paper's schedule)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Most tokens generated per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: int = typer.Option(0, "--top-k", help=TOP_K_HELP),
    top_p: float = typer.Option(1.0, "--top-p", help=TOP_P_HELP),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed in [-2**63, 2**63 - 1], as the server's (same seed, same tokens)."),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help=REPETITION_PENALTY_HELP),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help=FREQUENCY_PENALTY_HELP),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help=PRESENCE_PENALTY_HELP),
    stop: List[str] = typer.Option([], "--stop", help=STOP_HELP),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Use the chat template (default: if the tokenizer has one)."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (texts, finish reasons, statistics) instead of streaming."),
    max_batch_size: int = typer.Option(32, "--max-batch-size", help="Several prompts: most rows decoding at once (in-flight batching; a finished row's slot goes to the next prompt)."),
    cohort_size: int = typer.Option(1, "--cohort-size", help=COHORT_HELP.format(what="prompts") + " Applies to several prompts."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP + " Applies to several prompts."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Also print each token's log-probability (under the layers that ran for it) and this many alternatives (0-20)."),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=NO_ADAPTER_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Generate with a skip policy, streaming to the terminal, then print the statistics."""
    set_threads(threads)
    all_prompts = _collect_prompts(prompts, prompts_file)
    from .generate import generate as run_generate
    from .logprobs import check_logprobs

    sampling = sampling_from_options(temperature, top_k, top_p, seed, repetition_penalty, frequency_penalty,
                                     presence_penalty)
    stop = stop_from_options(stop)
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    check_cohort_option(cohort_size, max_batch_size, "--max-batch-size")
    check_policy_options(speedup, max_layers, min_layers, horizon, full_depth_steps, warmup_layers)
    try:
        check_logprobs(logprobs, "--logprobs")
    except ValueError as e:
        fail(str(e))
    sk = load_model(model, device, dtype, chat, quantize, compile, adapter=not no_adapter)
    policy = resolve_policy(sk, speedup, max_layers, min_layers, warmup_layers, horizon, full_depth_steps)
    sk = stock_weights_at_full_depth(sk, policy, (model, device, dtype, chat, quantize, compile))
    single = len(all_prompts) == 1
    show, live = _stream_view(sk.num_layers, len(all_prompts), single, as_json)
    try:
        if live is not None:
            live.start()
        result = run_generate(
            sk.adapter, sk.tokenizer, all_prompts, policy=policy, sampling=sampling,
            max_new_tokens=max_new_tokens, stop=stop, chat=sk.chat, on_chunk=show,
            max_batch_size=None if single else max_batch_size, cohort_size=1 if single else cohort_size,
            prefix_cache=prefix_cache, logprobs=logprobs,
        )
    except ValueError as e:  # e.g. the context check's "max_new_tokens <= N fits"
        fail(as_option_error(e, {"max_new_tokens": "--max-new-tokens"}))
    finally:
        if live is not None:
            live.stop()
    _print_generation(result, single, as_json, sk.tokenizer)


def _collect_prompts(prompts: Optional[List[str]], prompts_file: Optional[Path]) -> List[str]:
    """``generate``'s prompts: the arguments, then ``--prompts-file``'s lines (exits 2 on none or a blank one)."""
    all_prompts = list(prompts or [])
    if prompts_file is not None:
        all_prompts += read_prompts_file(prompts_file)
    if not all_prompts:
        fail("give at least one prompt (argument) or --prompts-file")
    blank = [i + 1 for i, p in enumerate(prompts or []) if not p.strip()]
    if blank:  # before the model loads; the library's message would name prompts[i] (0-based)
        fail(f"PROMPT {blank[0]} is empty (of {len(prompts)} given as arguments): every prompt must hold text")
    return all_prompts


def _stream_view(num_layers: int, n_rows: int, single: bool, as_json: bool):
    """``generate``'s ``on_chunk`` callback and the live view it redraws (None: one prompt, or --json)."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    rows = [""] * n_rows

    def render(step: int = 0, layers: int = 0) -> Group:
        head = Text(f"step {step}: {layers}/{num_layers} layers", style="dim")
        return Group(head, *(Text(f"[{i}] {t}") for i, t in enumerate(rows)))

    # A batch streams into a live view (one line per row, redrawn as tokens arrive); the view
    # is replaced by the final texts and finish reasons when generation ends.
    live = None if (single or as_json) else Live(render(), console=out, refresh_per_second=8, transient=True)

    def show(chunk) -> None:
        """One prompt: print its deltas. A batch: update the live view."""
        if as_json:
            return
        if single:
            if chunk.deltas[0]:
                out.print(chunk.deltas[0], end="", highlight=False, markup=False)
            return
        for i, delta in enumerate(chunk.deltas):
            rows[i] += delta.replace("\n", " ")
        live.update(render(chunk.step + 1, len(chunk.active_layers)))

    return show, live


def _print_generation(result, single: bool, as_json: bool, tokenizer) -> None:
    """Print ``generate``'s result: one JSON object, or the texts (a batch's), the log-probabilities
    when asked (a table per prompt) and the statistics line."""
    from rich.text import Text

    if as_json:
        record = {"texts": result.texts, "finish_reasons": result.finish_reasons,
                  "token_ids": result.token_ids, "stats": result.stats()}
        if result.logprobs is not None:
            from .logprobs import logprobs_record

            record["logprobs"] = [logprobs_record(entries, tokenizer) for entries in result.logprobs]
        print(dumps(record))
        return
    out.print()
    if not single:
        out.rule("results")
        for i, text in enumerate(result.texts):
            out.print(Text.assemble((f"[{i}] ", "bold"), f"({result.finish_reasons[i]}) {text}"), highlight=False)
    if result.logprobs is not None:
        print_logprobs(result.logprobs, tokenizer)
    err.print(f"\n[dim]{_stats_line(result.stats())}[/]", highlight=False)


def _stats_line(s: dict) -> str:
    """The one-line summary of :meth:`GenerationResult.stats` ``s``; the decode-step figures
    read ``-`` when no decode step ran (a one-token answer: the prefill gave it)."""
    import math

    from .info import describe_policy

    def fmt(value, spec: str) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)

    step_ms = None if s["step_seconds"] is None else s["step_seconds"] * 1000
    return (f"batch {s['batch_size']} | prompt {s['prompt_tokens']} tok ({s['cached_prompt_tokens']} cached) | "
            f"new {s['new_tokens']} tok | TTFT {s['prefill_seconds'] * 1000:.0f} ms | step {fmt(step_ms, '.1f')} ms | "
            f"{s['tokens_per_second']:.1f} tok/s | mean active layers {fmt(s['mean_active_layers'], '.2f')}/{s['num_layers']} | "
            f"theoretical speedup {fmt(s['theoretical_speedup'], '.2f')}x | "
            f"policy {escape(describe_policy(s['policy'], s['num_layers'], by_step=False))}")


@app.command(short_help="Summarise the model: layers, policy, schedules, skip adapter.")
def info(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=NO_ADAPTER_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the full record as JSON (training records, "
                                 "storage, the checkpoint's skipdecode.json) instead of the summary."),
) -> None:
    """Summarise the model: architecture, layer count, default policy, the schedules --speedup runs,
    skip adapter (if merged) and entry bridge (if attached); --json prints the full record."""
    from .info import info_lines, model_info

    record = model_info(load_model(model, adapter=not no_adapter))
    print(dumps(record, indent=2) if as_json else "\n".join(info_lines(record)))


# --- further subcommands (bench, train, eval, serve) are added below ---------------------------


def _baseline_label(baseline: Optional[str], given: list[str], labels: list[str]) -> Optional[str]:
    """The table label of ``--baseline``: a ``--model`` value as given, the same folder spelled
    otherwise, or a label of the table (``one``, ``one#2``). Exits 2 (naming the option) when it
    is none of them or fewer than two models are evaluated."""
    if baseline is None:
        return None
    if len(given) >= 2:
        for spec, label in zip(given, labels):  # a LABEL= the user wrote wins over a model spelled alike
            if _labelled(spec)[0] == baseline:
                return label
        for spec, label in zip(given, labels):
            if baseline in (spec, _labelled(spec)[1]):
                return label
        if baseline in labels:
            return baseline
        if Path(baseline).exists():
            for spec, label in zip(given, labels):
                path = _labelled(spec)[1]
                if Path(path).exists() and os.path.samefile(path, baseline):
                    return label
    fail(f"--baseline must be one of at least two --model values {given} (or their labels {labels}), "
         f"got {baseline!r}")


@app.command("eval", short_help="Score quality and speed of skip policies against full depth.")
def eval_command(
    ctx: typer.Context,
    models: List[str] = typer.Option([], "--model", "-m", help=EVAL_MODEL_HELP),
    data: Optional[str] = typer.Option(None, "--data", "-d", help="Eval data: E2E .csv (grouped by MR), CNN/DM .jsonl, {prompt, references} .jsonl or a HF dataset name (default: E2E test set with references in the shared data folder)."),
    task: Optional[str] = typer.Option(None, "--task", help="e2e, cnndm or plain: prompt template and metric set (default: from the file)."),
    speedups: List[str] = typer.Option([], "--speedup", "--speedups", "-s", help="Target speedup policy (repeatable, or comma-separated as in bench: --speedups 2,3; 1 = full depth)."),
    policies: List[str] = typer.Option([], "--policy", help="'full', 'checkpoint', a speedup ('2' or '2x') or a JSON policy dict such as '{\"type\": \"linear_decay\", \"max_layers\": 21, \"min_layers\": 9}' (num_layers: the model's; repeatable). Default with no --speedup/--policy: the checkpoint's policy."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Horizon of --speedup policies (tokens; default: the checkpoint's; needs --speedup or a number as --policy)."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Prompts per generation batch."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Evaluate only the first N items (after --offset)."),
    offset: int = typer.Option(0, "--offset", help="Skip the first N items (evaluate a shard; join shards with benchmarks/plot_eval.py --concat)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens per item (default: 64 for E2E/plain, 128 for CNN/DM)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable, at most 4; default: newline for E2E, none otherwise; --stop '' alone for none)."),
    metrics: List[str] = typer.Option([], "--metric", help="Metric (repeatable): bleu, chrf, nist, rouge1, rouge2, rougeL (default: by task)."),
    calm_thresholds: List[float] = typer.Option([], "--calm-threshold", help="Add a CALM early-exit baseline row (batch 1) with this top-2 softmax margin threshold in [0, 1] (1: never exit; repeatable)."),
    calm_min_layers: int = typer.Option(1, "--calm-min-layers", help="With --calm-threshold: fewest layers a CALM token runs before it may exit."),
    out_dir: Path = typer.Option(Path("eval_results"), "--out", "-o", help="Folder for NAME.json, NAME.md and NAME.png."),
    name: str = typer.Option("eval", "--name", help="Base name of the three output files in --out (no folder)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Use the chat template (default: the checkpoint's setting)."),
    device: str = typer.Option("cpu", "--device", help="torch device, e.g. cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Drop malformed data rows (counted) instead of failing."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar over batches (stderr)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help=QUANTIZE_HELP),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    sort_by_length: bool = typer.Option(False, "--sort-by-length", help="Batch prompts of similar length together (less padding; outputs stay in item order)."),
    inflight: bool = typer.Option(True, "--inflight/--static", help="In-flight batching (a finished item's slot goes to the next at once; --batch-size rows at most) or static batches that wait for their longest item."),
    cohort_size: int = typer.Option(1, "--cohort-size", help=COHORT_HELP.format(what="items") + " Applies with --inflight."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help=PREFIX_CACHE_HELP + " Applies with --inflight."),
    no_adapter: bool = typer.Option(False, "--no-adapter", help=EVAL_NO_ADAPTER_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="One of the --model values (as given, the same folder spelled otherwise, or its label in the table, e.g. NAME#2 for a second copy), e.g. a full-depth (1x) fine-tune: every other row's speedups are also given against its full-depth row (the paper's baseline), in a second table."),
) -> None:
    """Score quality (BLEU, chrF, ROUGE) and speed of skip policies against full depth; write JSON, Markdown, PNG."""
    from .data import DataError
    from .evaluate import detect_task, evaluate
    from .paths import is_file_name

    set_threads(threads)
    check_quantize_option(quantize)
    speedups = speedup_values(speedups, "--speedup")
    check_eval_rows(speedups, policies, horizon, calm_thresholds, calm_min_layers, metrics)
    stops = check_eval_run(stop, cohort_size, batch_size, inflight, limit, max_new_tokens, task)
    data, items = eval_items(data, task, skip_bad_rows, offset, limit)
    eval_task = task or detect_task(data)
    check_output_folder(out_dir, "--out")
    if not is_file_name(name):
        fail(f"--name must be a file name without a folder (the files go to --out), got {name!r}")
    entries = _eval_entries(models, device, dtype, chat, quantize, compile, no_adapter)
    specs = [*speedups, *policies] or None
    baseline_label = _baseline_label(baseline, list(models or ["stock"]), list(entries))
    command = command_line(ctx)
    try:
        report = evaluate(
            entries, items, specs, batch_size=batch_size, max_new_tokens=max_new_tokens,
            stop=stops if stop else None, task=eval_task, metrics=metrics or None, horizon=horizon,
            calm_thresholds=calm_thresholds, calm_min_layers=calm_min_layers, chat=chat,
            progress=progress, command=command, data=str(data), sort_by_length=sort_by_length,
            inflight=inflight, cohort_size=cohort_size, prefix_cache=prefix_cache,
        )
    except (DataError, ValueError) as e:
        fail(eval_error_message(e, speedups, policies))
    if baseline_label is not None:
        report.set_baseline(baseline_label)
    try:
        paths = report.save(out_dir, name)
    except OSError as e:
        fail(f"cannot write the report to {out_dir}: {e}")
    print(report.to_markdown(), flush=True)  # plain print: rich would re-wrap the table's lines
    err.print("wrote " + ", ".join(str(p) for p in paths.values()), highlight=False, markup=False)


def _labelled(spec: str) -> tuple[Optional[str], str]:
    """``(label, model)`` of an ``eval --model`` value: ``LABEL=MODEL`` names its rows LABEL
    (``2x=runs/e2e-2x/final``), anything else is a model alone (label None). A value that is
    an existing path, or whose part before ``=`` holds a ``/``, is a model (paths may hold ``=``)."""
    label, sep, model = spec.partition("=")
    if not sep or Path(spec).exists() or "/" in label:
        return None, spec
    if not label.strip():
        fail(f"--model {spec!r}: LABEL=MODEL needs a label before '=' (or give the model alone)")
    if not model.strip():
        fail(f"--model {spec!r}: LABEL=MODEL needs a model after '=' (an HF id, a checkpoint directory "
             f"or a .gguf file)")
    return label.strip(), model.strip()


def _path_label(spec: str) -> str:
    """The table label of a ``--model`` path: its folder's name, with the run's folder in front
    for the names every training run writes (``runs/e2e-2x/final`` -> ``e2e-2x/final``,
    ``runs/e2e-2x/checkpoint-00000100`` -> ``e2e-2x/checkpoint-00000100``), so that two runs'
    outputs get their runs' names rather than ``final`` and ``final#2``."""
    path = Path(os.path.abspath(spec))  # "." and "../x" have names too
    if path.name == "final" or path.name.startswith("checkpoint-"):
        return f"{path.parent.name}/{path.name}" if path.parent.name else path.name
    return path.name


def _eval_entries(models, device, dtype, chat, quantize, compile, no_adapter) -> dict:
    """``eval``'s table label -> loader of each ``--model`` (a repeated label gets ``#2``, ``#3``, ...)."""
    from .loading import DEFAULT_MODEL

    def loader(spec):
        named = spec in ("stock", "default") and not Path(spec).exists()
        target = DEFAULT_MODEL if named else spec
        use_adapter = not no_adapter and not (named and spec == "stock")  # 'stock' = the stock weights
        return lambda: load_model(target, device, dtype, chat, quantize, compile, adapter=use_adapter)

    entries = {}
    for given in models or ["stock"]:
        label, spec = _labelled(given)
        if label is None:
            label = _path_label(spec) if Path(spec).exists() else spec
        base, k = label, 2
        while label in entries:
            label, k = f"{base}#{k}", k + 1
        entries[label] = loader(spec)
    return entries


from .cli_bench import bench  # noqa: E402  (the bench command lives in its own module)

from .cli_serve import serve  # noqa: E402
from .cli_train import train  # noqa: E402  (the train command and its interrupt handling)

app.command(short_help="Fine-tune a model with its skip schedule in place (LoRA or full).")(train)
app.command(short_help="Decode speed of full depth and each speedup against HF generate.")(bench)
app.command(short_help="Chat in the terminal under a skip policy (/reset, /exit, /help).")(chat)
app.command(short_help="Serve an OpenAI-compatible API, with /health and /metrics.")(serve)


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point (``skipdecode``).

    Usage errors that click itself detects (an unknown option, ``--speedup abc``, a missing
    required option) are printed as one ``error:`` line naming the option, like the command's
    own errors, instead of click/rich's framed usage box.

    Raises:
        SystemExit: always, with the command's exit code (2 for bad input).
    """
    from typer.exceptions import TyperException  # base of the (vendored) click exceptions

    try:
        code = app(args=argv, standalone_mode=False)
    except typer.Abort:
        err.print("aborted", markup=False)
        raise SystemExit(1) from None
    except TyperException as e:
        if not hasattr(e, "format_message"):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":  # `skipdecode` alone: its help, as click's own
            out.print(e.ctx.get_help(), markup=False, highlight=False)
            raise SystemExit(getattr(e, "exit_code", 2)) from None
        ctx = getattr(e, "ctx", None)  # usage errors carry the command: point to its --help
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        err.print(f"[bold red]error:[/] {escape(e.format_message())}{escape(hint)}", highlight=False)
        raise SystemExit(getattr(e, "exit_code", 2)) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
