"""What every ``skipdecode`` subcommand shares: the consoles, clean exits (:func:`fail`), policy
and model loading from flags, the rebuilt command line and common help texts. Printing happens
here and in the command modules only; the library never prints."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """Print ``message`` as a clean error (no traceback) and exit with ``code``.

    Raises:
        typer.Exit: always, with ``code`` (2 for bad input, as the README says).
    """
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # paths, MRs hold brackets
    raise typer.Exit(code)


def check_policy_options(speedup, max_layers, min_layers, horizon, full_depth_steps=None, warmup_layers=None) -> None:
    """The policy options' checks that need no model, run before the model loads (seconds
    earlier than :func:`resolve_policy`); the same messages as the library's.

    Raises:
        typer.Exit: (2, via :func:`fail`) a ``--speedup`` that is not a finite number >= 1, both
            kinds of schedule, a ``--max-layers``/``--min-layers``/``--horizon`` below 1, or a
            ``--full-depth-steps`` or ``--warmup-layers`` below 0.
    """
    import math

    if speedup is not None and (max_layers is not None or min_layers is not None):
        fail("give either --speedup or --max-layers/--min-layers, not both")
    if speedup is not None and not (math.isfinite(speedup) and speedup >= 1):
        fail(f"--speedup must be a finite number >= 1, got {speedup!r}")
    for name, value in (("--max-layers", max_layers), ("--min-layers", min_layers), ("--horizon", horizon)):
        if value is not None and value < 1:
            fail(f"{name} must be >= 1, got {value}")
    for name, value in (("--full-depth-steps", full_depth_steps), ("--warmup-layers", warmup_layers)):
        if value is not None and value < 0:
            fail(f"{name} must be >= 0, got {value}")


def resolve_policy(model, speedup, max_layers, min_layers, warmup_layers, horizon, full_depth_steps=None):
    """Policy from CLI flags (speedup or explicit bounds, ``full_depth_steps`` with either), else the
    checkpoint's; exits on error (the model-free checks of :func:`check_policy_options` first, then
    the model's, e.g. ``--full-depth-steps must be >= 0``)."""
    check_policy_options(speedup, max_layers, min_layers, horizon, full_depth_steps, warmup_layers)
    given = {"speedup": speedup, "max_layers": max_layers, "min_layers": min_layers, "warmup_layers": warmup_layers,
             "horizon": horizon, "full_depth_steps": full_depth_steps}
    try:
        if any(v is not None for v in given.values()):
            return model.policy_for(**given)
        return model.policy
    except ValueError as e:
        fail(as_option_error(policy_bound_source(e, given), POLICY_OPTION_NAMES))


def policy_bound_source(error: Exception, given: dict) -> str:
    """The message of a policy ``error`` with each bound that names a field the user did not give
    (None in ``given``) said to come from the schedule: "(at most max_layers)" -> "(at most the
    schedule's max layers)", "< min_layers (5)" -> "< the schedule's min layers (5)". Such a bound
    came from the model's schedule or the speedup, not from an option on the command line; the
    fields the user gave stay as they are (:func:`as_option_error` then names their options)."""
    message = str(error)
    for name, value in given.items():
        if value is None:
            words = f"the schedule's {name.replace('_', ' ')}"
            message = message.replace(f"(at most {name})", f"(at most {words})")
            message = re.sub(rf"\b{name}\b(?= \(-?\d)", words, message)
    return message


def runs_every_layer(policy) -> bool:
    """Whether ``policy`` runs all of the model's layers at every decode step (the 1x baseline:
    a :class:`~skipdecode.policy.FullPolicy`, or a linear decay whose floor is every layer)."""
    return policy.to_dict().get("type") == "full" or policy.min_layers == policy.num_layers


def stock_weights_at_full_depth(sk, policy, model_args: tuple):
    """The model to run ``policy`` with: ``sk``, or ``sk`` reloaded without its skip adapter when
    the policy runs every layer (issue 12: the adapter is for skipping; at full depth it moves the
    answers away from the stock model's, so ``--speedup 1`` gives the stock model, the reference).

    ``model_args``: the :func:`load_model` arguments ``(model, device, dtype, chat, quantize, compile)``
    that loaded ``sk``. A note goes to stderr when the weights change.
    """
    if not sk.skip_config.get("skip_adapter") or not runs_every_layer(policy):
        return sk
    err.print("full depth: running the stock weights (the skip adapter is for skipping; --no-adapter "
              "always runs them)", markup=False)
    return load_model(*model_args, adapter=False)


#: Python names of generation settings -> the CLI options that set them (for error messages:
#: the library's ValueErrors start with the field, the CLI names the option instead).
OPTION_NAMES = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed",
                "stop": "--stop", "repetition_penalty": "--repetition-penalty",
                "frequency_penalty": "--frequency-penalty", "presence_penalty": "--presence-penalty"}


#: Python names of the policy fields -> their CLI options.
POLICY_OPTION_NAMES = {name: "--" + name.replace("_", "-") for name in
                       ("speedup", "max_layers", "min_layers", "warmup_layers", "horizon", "full_depth_steps")}


def as_option_error(error: Exception, options: dict = OPTION_NAMES) -> str:
    """The message of a library ``error`` with each field name in ``options`` (whole words)
    written as its CLI option: ``"top_p must be in [0, 1], got 2.0"`` -> ``"--top-p must be
    ..."``, ``"warmup_layers must be < min_layers (6)"`` -> ``"--warmup-layers must be <
    --min-layers (6)"``; other words unchanged."""
    if not options:
        return str(error)
    fields = sorted(options, key=len, reverse=True)  # the longest name first where one holds another
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, fields)) + r")\b")
    return pattern.sub(lambda m: options[m.group(1)], str(error))


def sampling_from_options(temperature, top_k, top_p, seed, repetition_penalty=1.0, frequency_penalty=0.0,
                          presence_penalty=0.0):
    """:class:`~skipdecode.sampling.SamplingParams` from the CLI options; exits 2 with one line
    naming the option (``--temperature``, ``--top-k``, ``--top-p``, ``--seed``, the penalties) and its allowed
    range when a value is out of range (the ranges are the library's, e.g. the seed's int64 range
    of :mod:`skipdecode.limits`, the same as the server's; the seed's is checked here, as the
    library's message also allows None, which the option cannot be given)."""
    from .limits import SEED_MAX, SEED_MIN
    from .sampling import SamplingParams

    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        fail(f"--seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64), got {seed}")
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty)
    except ValueError as e:
        fail(as_option_error(e))


def stop_from_options(stop) -> list:
    """The ``--stop`` strings checked by :func:`skipdecode.limits.check_stop` (at most 4, none
    empty); exits 2 with one line naming ``--stop`` otherwise."""
    from .limits import check_stop

    try:
        return check_stop(list(stop), "--stop")
    except ValueError as e:
        fail(str(e))


QUANTIZE_HELP = "Quantized decoder linears and LM head: int8 or int4 (weight-only), or w8a8 (int8 weights and per-token int8 activations, CPU; the fastest int8 on CPUs without AVX-512); or head: the LM head alone (int4 preview rescored from int8), float decoder layers (default: float weights; docs/quantization.md)."
COMPILE_HELP = ("torch.compile the decode step: the fused int8 products with --quantize int8, else every decoder-layer "
                "call (compile time is reported separately; falls back to eager where unavailable). Costs memory "
                "for oneDNN copies of the weights: float32 doubles them, w8a8 adds about 40 % "
                "(docs/quantization.md).")

COHORT_HELP = ("Waiting {what} join the running rows only in cohorts of at least this many (1: at once; larger: "
               "rows sit at fewer decode steps, so a step runs fewer layers; docs/inflight-batching.md).")

PREFIX_CACHE_HELP = ("Automatic prefix caching (default on): a prompt that shares its first tokens with recent "
                     "ones (a system prompt, an instruction) reuses their keys and values and prefills only the "
                     "rest; outputs are unchanged (docs/inflight-batching.md).")


def check_cohort_option(cohort_size: int, batch_size: int, batch_option: str) -> None:
    """Exit 2 with a one-line error unless ``batch_size`` >= 1 and 1 <= ``cohort_size`` <= ``batch_size``
    (the rule of :class:`skipdecode.engine.Engine`); ``batch_option`` names the batch-size option."""
    if batch_size < 1:
        fail(f"{batch_option} must be >= 1, got {batch_size}")
    if not 1 <= cohort_size <= batch_size:
        fail(f"--cohort-size must be in [1, {batch_option}={batch_size}], got {cohort_size}")


#: Help of ``--threads`` on generate, eval, chat and train (bench and serve say their own default).
THREADS_HELP = "torch intra-op threads (torch.set_num_threads; default: torch's, one per core)."


def set_threads(threads, default_all_cores: bool = False) -> None:
    """Exit 2 with a one-line error unless ``--threads`` is unset or in [1, the cores this process
    may run on] (more threads than cores only slow torch down, and far more crash it: "can't start
    new thread"), then apply it with ``torch.set_num_threads`` (intra-op threads). Unset keeps
    torch's default, or uses every core (``os.cpu_count()``) when ``default_all_cores``."""
    import os

    if threads is not None and threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is not None and threads > cores:
        fail(f"--threads must be at most {cores} (the cores this process may use), got {threads}")
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif default_all_cores:
        torch.set_num_threads(os.cpu_count() or 1)


def speedup_values(items, option: str = "--speedup") -> list[float]:
    """The speedups of a repeatable option whose values may also be comma-separated lists
    (``--speedup 2 --speedup 3`` and ``--speedups 2,3`` alike): ``["2", "3,5"]`` -> ``[2.0, 3.0,
    5.0]``. Exits 2 naming ``option`` when an entry is not a number; ranges are checked later."""
    from .bench.inputs import comma_items

    values = []
    for item in items:
        try:
            parts = comma_items(item, option)
        except ValueError as e:
            fail(str(e))
        for part in parts:
            try:
                values.append(float(part))
            except ValueError:
                fail(f"{option} must be a number (or comma-separated numbers such as 2,3), got {item!r}")
    return values


def check_quantize_option(quantize) -> None:
    """Exit 2 with a one-line error unless ``--quantize`` is unset, int8, int4, w8a8 or head."""
    from .quantize import QUANTIZE_MODES

    if quantize is not None and quantize not in QUANTIZE_MODES:
        fail(f"--quantize must be one of {', '.join(QUANTIZE_MODES)}, got {quantize!r}")


#: What ``--prompts-file`` must hold, said when it holds no prompt (``generate`` and ``bench``).
PROMPTS_FILE_EMPTY = "holds no prompts (one per line; blank lines are skipped)"


def read_prompts_file(path: Path) -> list:
    """The non-blank lines of ``--prompts-file`` ``path`` (UTF-8 text); exits 2 with one line naming
    ``--prompts-file`` when it does not exist, is a folder, cannot be read, is not UTF-8 text, or
    holds no prompt (:data:`PROMPTS_FILE_EMPTY`)."""
    if not path.exists():
        fail(f"--prompts-file {path} does not exist")
    if path.is_dir():
        fail(f"--prompts-file {path} is a folder, not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        fail(f"--prompts-file {path} is not UTF-8 text")
    except OSError as e:
        fail(f"--prompts-file {path} cannot be read: {e.strerror or e}")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        fail(f"--prompts-file {path} {PROMPTS_FILE_EMPTY}")
    return lines


def check_output_folder(folder: Path, option: str, given: Path | None = None) -> None:
    """Exit 2 with one line naming ``option`` unless ``folder`` can receive files (checked before
    any long work, so nothing is computed for an output that cannot be written).

    ``given``: the option's value when it is a file in ``folder`` (``--output DIR/x.json``), named
    in the message with its folder; None when the option names ``folder`` itself (``--out DIR``).
    """
    from .paths import writable_dir_problem

    if given is not None and given.is_dir():
        fail(f"{option} {given} is a folder; give a file path in it, such as {given / 'results.json'}")
    problem = writable_dir_problem(folder)  # "FOLDER is a file, ..." / "FOLDER cannot be written: REASON"
    if problem is not None:
        fail(f"{option} {problem}" if given is None else f"{option} {given}: its folder {problem}")


def load_model(model_name, device="cpu", dtype="float32", chat=None, quantize=None, compile=False, adapter=True):
    """Load ``model_name`` (None: embedded default), turning load errors into clean exits.

    ``quantize`` ("int8"/"int4"/"w8a8"), ``compile`` and ``adapter`` (True: the shipped skip
    adapter, if any; False: none) are passed to :func:`skipdecode.load`; with
    ``compile``, the compile time (or why it fell back to eager) is printed to stderr.
    """
    check_quantize_option(quantize)

    from .adapters import UnsupportedArchitectureError
    from .loading import LoadError, _resolve_dtype, check_device, load

    try:
        _resolve_dtype(dtype)
    except LoadError as e:
        fail(f"--{e}")

    try:
        check_device(device, "--device")
    except LoadError as e:
        fail(str(e))

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        with err.status(f"loading {model_name or 'the embedded default model'} ..."):
            sk = load(model_name, device=device, dtype=dtype, chat=chat, quantize=quantize, compile=compile,
                      adapter=adapter)
    except (LoadError, UnsupportedArchitectureError) as e:
        fail(f"--model: {e}" if getattr(e, "param", None) == "model" else str(e))
    if sk.compile_report is not None:
        err.print(compile_summary(sk.compile_report), markup=False)
    return sk


def compile_summary(report) -> str:
    """The one line ``--compile`` prints after loading, from a
    :class:`~skipdecode.compiled.CompileReport`: mode, warm-up seconds and batch sizes, the
    linears given oneDNN copies and the LM head's batch-1 preview when there are any; or why
    it runs eagerly."""
    if not report.enabled:
        return f"--compile: compilation unavailable, running eagerly ({report.error})"
    sizes = " and ".join(str(b) for b in report.warmed_batch_sizes)
    extras = []
    if report.onednn_layers:
        extras.append(f"{report.onednn_layers} linears with oneDNN copies")
    if report.head_one_row:
        extras.append(f"batch-1 head preview {report.head_one_row['chosen']}")
    return (f"compiled the decode step ({report.mode}) in {report.compile_seconds:.1f} s "
            f"(first calls, batch {sizes}" + "".join(f"; {e}" for e in extras) + ")")


def command_line(ctx: typer.Context) -> str:
    """The running subcommand as a shell command rebuilt from its parsed parameters.

    Rebuilt from click's context rather than ``sys.argv``, so it is right however the command was
    invoked (console script, ``python -m``, tests); options left at their defaults are omitted.
    A ``SKIPDECODE_ROW_PRODUCT`` set in the environment (:mod:`skipdecode.row_product`) leads it,
    since it changes what the command measures.
    """
    from .row_product import ENV_VAR

    forced = os.environ.get(ENV_VAR, "").strip()
    parts = [f"{ENV_VAR}={forced}"] if forced and forced.lower() != "auto" else []
    parts += ["skipdecode", ctx.info_name or ""]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value == param.default or value in ([], ()):
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if param.param_type_name == "argument":
            parts += [str(v) for v in values]
            continue
        opt = max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            if value:
                parts.append(opt)
            elif param.secondary_opts:
                parts.append(max(param.secondary_opts, key=len))
            continue
        for v in values:
            parts += [opt, str(v)]
    return shlex.join(parts)


MODEL_HELP = "HF model id, checkpoint directory or .gguf file (default: embedded SmolLM2-135M-Instruct)."
#: Help of the sampling options that generate and chat share.
TEMPERATURE_HELP = ("Any value >= 0, as vLLM: below 1e-5 (0 included) = greedy, otherwise samples (the server, "
                    "as OpenAI's API, takes 0-2).")
TOP_K_HELP = "Keep the k most likely tokens (0: off)."
TOP_P_HELP = "Nucleus mass in [0, 1] (1: off; 0: the most likely token only, i.e. greedy)."
REPETITION_PENALTY_HELP = "Hugging Face's repetition penalty over prompt and output tokens (0.01..100; 1: off)."
FREQUENCY_PENALTY_HELP = "OpenAI's: subtract this times each token's count in the output so far (-2..2; 0: off)."
PRESENCE_PENALTY_HELP = "OpenAI's: subtract this once from each token already in the output (-2..2; 0: off)."
STOP_HELP = "Stop string (repeatable, at most 4, none empty)."

NO_ADAPTER_HELP = ("Do not merge the skip adapter shipped for the model (the embedded SmolLM2-135M-Instruct "
                   "has a 2x one, merged by default): run the stock weights.")


def print_logprobs(rows: list, tokenizer) -> None:
    """One table per prompt of ``rows`` (per prompt, its :class:`~skipdecode.logprobs.TokenLogprobs`):
    each token's text, log-probability, probability and alternatives (``generate --logprobs``); a
    token holding only part of a character shows its bytes (``b'\\xe3\\x82'``)."""
    import math

    from rich.markup import escape
    from rich.table import Table

    from .logprobs import token_bytes

    def shown(token: int) -> str:
        raw = token_bytes(tokenizer, token)
        try:
            return escape(repr(raw.decode("utf-8")))
        except UnicodeDecodeError:
            return escape(repr(raw))

    for i, entries in enumerate(rows):
        table = Table(title=f"[{i}] log-probabilities", title_justify="left")
        for col in ("token", "logprob", "p", "alternatives"):
            table.add_column(col, justify="right" if col in ("logprob", "p") else "left")
        for e in entries:
            alts = "  ".join(f"{shown(t)} {lp:.2f}" for t, lp in e.top)
            table.add_row(shown(e.token), f"{e.logprob:.3f}", f"{math.exp(e.logprob):.3f}", alts)
        out.print(table)
