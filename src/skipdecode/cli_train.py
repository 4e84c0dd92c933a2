"""``skipdecode train``: fine-tune a model with its skip schedule in place, resumably (SIGTERM and
Ctrl-C say how to resume). :mod:`skipdecode.cli` registers it."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from .cli_common import THREADS_HELP, err, fail, load_model, set_threads, speedup_values
from .jsonio import dumps
from .paths import portable_here

TRAIN_MODEL_HELP = ("Model to fine-tune: HF model id, checkpoint directory (a LoRA run's final/ loads with its adapter "
                    "merged, then trains as any model) or .gguf file. Default: the embedded SmolLM2-135M-Instruct's "
                    "stock weights (training never starts from a shipped skip adapter).")

def train(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=TRAIN_MODEL_HELP),
    data: str = typer.Option(..., "--data", help="Training data: .csv (E2E), .jsonl (prompt/response or CNN/DM) or a HF dataset name; relative paths are also looked up in the shared data folder."),
    out: Path = typer.Option(..., "--out", "-o", help="Run directory: checkpoints, final/ (the model) and train_record.json."),
    task: Optional[str] = typer.Option(None, "--task", help="Prompt template (e2e, cnndm, plain; default: by file type)."),
    speedup: Optional[float] = typer.Option(None, "--speedup", "-s", help="Target speedup (>= 1; 1 = full-depth fine-tune)."),
    speedups: Optional[str] = typer.Option(None, "--speedups", help="Mixed-policy training: comma-separated speedups, one drawn per step (e.g. 2,3,5)."),
    max_layers: Optional[int] = typer.Option(None, "--max-layers", help="e_max of an explicit schedule (layers)."),
    min_layers: Optional[int] = typer.Option(None, "--min-layers", help="e_min of an explicit schedule (layers)."),
    warmup_layers: int = typer.Option(1, "--warmup-layers", help="Bottom layers that always run."),
    horizon: Optional[int] = typer.Option(None, "--horizon", help="Decay horizon T in tokens (default: median response length of the data)."),
    full_depth_steps: int = typer.Option(0, "--full-depth-steps", help="First decode steps that run every layer before the decay (with --base-prefill: the base weights, as at inference); 0: the paper's schedule."),
    epochs: float = typer.Option(1.0, "--epochs", help="Passes over the training data (ignored with --max-steps)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps (overrides --epochs)."),
    max_minutes: Optional[float] = typer.Option(None, "--max-minutes", help="Budget of optimizer-step time (minutes): stop after the first step past it, then validate and save final/ as at the end (the LR schedule stays planned over --max-steps/--epochs)."),
    lr: float = typer.Option(2e-4, "--lr", help="Peak learning rate (AdamW)."),
    lr_scheduler: str = typer.Option("cosine", "--lr-scheduler", help="cosine, linear, constant or constant_with_warmup."),
    warmup_ratio: float = typer.Option(0.05, "--warmup-ratio", help="Share of steps of linear LR warm-up."),
    weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Examples per micro-batch (per process)."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Gradient clipping norm (0: off)."),
    max_length: int = typer.Option(256, "--max-length", help="Longest prompt + response in tokens (longer responses are cut)."),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="Share of distinct prompts held out for validation loss (0: no validation, the quickest for short trial runs)."),
    eval_every: int = typer.Option(0, "--eval-every", help="Validation every N steps (0: start and end only; needs --val-fraction > 0)."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Checkpoint every N steps for --resume (0: final model only)."),
    keep_checkpoints: Optional[int] = typer.Option(None, "--keep-checkpoints", help="With --checkpoint-every: checkpoints kept in --out, newest first (older ones are deleted as new ones are written; default 1)."),
    distill: bool = typer.Option(False, "--distill", help="Self-distillation: train on the full-depth model's greedy answers (no labels needed)."),
    kl_weight: float = typer.Option(0.0, "--kl-weight", help="Add this times KL to the full-depth teacher's logits."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="KL teacher model (name, directory or .gguf; same tokenizer vocabulary); default: the starting model, frozen."),
    distill_max_new_tokens: int = typer.Option(64, "--distill-max-new-tokens", help="Longest teacher answer (tokens)."),
    distill_answers_from: Optional[str] = typer.Option(None, "--distill-answers-from", help="With --distill: reuse the teacher answers stored in this checkpoint folder of an earlier run (same model, --distill-max-new-tokens and chat setting) instead of generating them."),
    on_policy: float = typer.Option(0.0, "--on-policy", help="With --kl-weight: share in [0, 1] of each batch's rows answered by the student itself under its schedule, the teacher's choices as targets (on-policy distillation, a project extension)."),
    position_half_life: Optional[float] = typer.Option(None, "--position-half-life", help="Weigh response token i's loss 2^(-i/H) for this H (tokens): early answer tokens count more (a project extension); default: every token the same."),
    lora_r: int = typer.Option(0, "--lora-r", help="LoRA rank on all linear projections (0: full fine-tuning)."),
    init_adapter: Optional[str] = typer.Option(None, "--init-adapter", help="With --lora-r: start the LoRA (and, with --entry-bridge, the bridge) from this adapter folder, e.g. a finished run's final/; its rank and alpha must equal --lora-r/--lora-alpha."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="LoRA alpha (default: 2 * rank)."),
    grad_checkpointing: bool = typer.Option(False, "--grad-checkpointing", help="Recompute layers in backward to save memory."),
    prompt_grad: bool = typer.Option(True, "--prompt-grad/--no-prompt-grad", help="Backpropagate through the prompt; --no-prompt-grad runs it (less its last token) under no_grad (same loss, faster)."),
    base_prefill: bool = typer.Option(False, "--base-prefill", help="With --lora-r and --no-prompt-grad: the base model (adapter off) prefills the prompt, the adapter trains on decode positions only (a decode-only adapter)."),
    entry_bridge: bool = typer.Option(False, "--entry-bridge", help="Fit an affine map per entry layer (least squares on full-depth hidden states) and train with it; saved with the model (a project extension, docs/entry-bridge.md)."),
    entry_bridge_lr: Optional[float] = typer.Option(None, "--entry-bridge-lr", help="With --entry-bridge: train the bridge too, at this learning rate (default: it stays as fitted)."),
    teacher_forcing: str = typer.Option("sparse", "--teacher-forcing", help="sparse (each layer runs only on the positions that need it) or masked (every layer on every position; same values)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its newest checkpoint."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (for GPUs)."),
    seed: int = typer.Option(0, "--seed", help="Seed of data order, split, policy draws and init."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Drop malformed data rows instead of failing."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Chat template on prompts (default: the model's setting)."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Progress bar on stderr."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
) -> None:
    """Fine-tune a model with its skip schedule in place; prints the run record's summary as JSON."""
    main_thread = threading.current_thread() is threading.main_thread()  # where signal handlers can be set
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None  # says how to resume, as Ctrl-C
    loading = True  # until the run starts: an interrupt then says that nothing was written
    try:
        from .data import DataError, check_data_file
        from .train import TrainConfig, TrainConfigError, train as run_train

        set_threads(threads)
        if keep_checkpoints is not None and not checkpoint_every:  # it would be silently ignored
            fail(f"--keep-checkpoints ({keep_checkpoints}) needs --checkpoint-every: without it only final/ is written")
        speedup_list = None if speedups is None else tuple(speedup_values([speedups], "--speedups"))
        try:
            config = TrainConfig(
                out_dir=str(out), speedup=speedup, speedups=speedup_list, max_layers=max_layers,
                min_layers=min_layers, warmup_layers=warmup_layers, horizon=horizon,
                full_depth_steps=full_depth_steps, task=task, max_length=max_length, val_fraction=val_fraction,
                skip_bad_rows=skip_bad_rows, chat=chat, epochs=epochs, max_steps=max_steps,
                max_minutes=max_minutes, teacher=teacher, lr=lr, weight_decay=weight_decay, batch_size=batch_size,
                grad_accum=grad_accum, lr_scheduler=lr_scheduler, warmup_ratio=warmup_ratio,
                max_grad_norm=max_grad_norm, gradient_checkpointing=grad_checkpointing, seed=seed, device=device,
                bf16=bf16, distill=distill, kl_weight=kl_weight, distill_max_new_tokens=distill_max_new_tokens,
                distill_answers_from=distill_answers_from, lora_r=lora_r, lora_alpha=lora_alpha,
                eval_every=eval_every, checkpoint_every=checkpoint_every,
                save_total_limit=1 if keep_checkpoints is None else keep_checkpoints, resume=resume,
                progress=progress, prompt_grad=prompt_grad, teacher_forcing=teacher_forcing,
                base_prefill=base_prefill, entry_bridge=entry_bridge, entry_bridge_lr=entry_bridge_lr,
                on_policy=on_policy, init_adapter=init_adapter, position_half_life=position_half_life,
            )
        except TrainConfigError as e:
            fail(_train_error(e))
        if config.needs_val_data:  # the CLI has no separate validation file: it would be silently ignored
            fail(f"--eval-every ({eval_every}) needs a validation set: --val-fraction is 0")
        try:
            check_data_file(data)  # a folder fails here, before the model loads
        except DataError as e:
            fail(f"--data {e}")
        sk = load_model(model, "cpu", "float32", chat, adapter=False)  # train from the stock weights
        loading = False
        result = run_train(sk, data, config)
    except KeyboardInterrupt as stop:
        _interrupted(out, checkpoint_every, 143 if isinstance(stop, _Terminated) else 130, loading=loading)
    except TrainConfigError as e:
        fail(_train_error(e))
    except DataError as e:
        fail(f"--data {e}")
    except ValueError as e:
        fail(str(e))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    err.print(f"[dim]{summary_line(result)}[/]", highlight=False)
    err.print(f"model written to {result.final_dir}  (try: skipdecode generate --model {result.final_dir} ...)",
              highlight=False, markup=False)
    summary = {k: v for k, v in result.to_dict().items() if k not in ("train_log", "val_log", "config")}
    summary["final_train_loss"] = result.train_log[-1]["loss"] if result.train_log else None
    summary["final_val_loss"] = result.val_log[-1]["loss"] if result.val_log else None
    print(dumps(portable_here(summary)))  # as train_record.json: no absolute paths


#: TrainConfig field -> the option that sets it, where the names differ (for error messages)
_RENAMED = {"out_dir": "--out", "gradient_checkpointing": "--grad-checkpointing", "base_model": "--model",
            "save_total_limit": "--keep-checkpoints"}


def _option(field_name: str) -> str:
    """The ``skipdecode train`` option that sets TrainConfig field ``field_name``."""
    return _RENAMED.get(field_name, "--" + field_name.replace("_", "-"))


def _train_error(e) -> str:
    """A :class:`~skipdecode.train.TrainConfigError` as the CLI's one-line message: its field as
    the option that sets it, then its reason with the options it names (:func:`_with_options`)."""
    return f"{_option(e.field)} {_with_options(e.reason, _option)}"


def summary_line(result) -> str:
    """The line ``skipdecode train`` prints after a run (a :class:`~skipdecode.train.TrainResult`).

    A fresh run: its steps, tokens, tokens/s (all and response tokens), wall seconds and last
    training loss. A resumed run says which numbers are the run's totals (steps, tokens) and which
    are this session's (steps, tokens, rates, seconds); a resume that had nothing left to train
    says the run was already complete (or its ``--max-minutes`` budget already spent) instead of
    printing 0 tok/s."""
    loss = f"final loss {result.train_log[-1]['loss'] if result.train_log else float('nan'):.4f}"
    rates = f"{result.tokens_per_second:.1f} tok/s ({result.target_tokens_per_second:.1f} response tok/s)"
    wall = f"{result.wall_seconds:.0f} s"
    if result.resumed_from is None:
        return f"{result.steps} steps | {result.tokens_seen} tokens | {rates} | {wall} | {loss}"
    if result.session_steps == 0:
        state = ("run already complete" if result.steps >= result.total_steps
                 else "the --max-minutes budget was already spent")
        return (f"{state}: {result.steps} of {result.total_steps} steps, {result.tokens_seen} tokens; nothing "
                f"trained in this session (resumed from {result.resumed_from}) | {wall} | {loss}")
    return (f"run: {result.steps} of {result.total_steps} steps, {result.tokens_seen} tokens | this session "
            f"(resumed from step {result.steps - result.session_steps}): {result.session_steps} steps, "
            f"{result.session_tokens} tokens, {rates}, {wall} | {loss}")


def _with_options(reason: str, option) -> str:
    """A training error's ``reason`` with the schedule field it compares against written as its
    option (``option(field)``): ``must be <= max_layers (10)`` as ``must be <= --max-layers (10)``
    (``must be < min_layers`` too), ``min_layers defaults to max_layers`` and ``warmup_layers=1``
    as options,
    ``needs distill=True, i.e. --distill`` as ``needs --distill``,
    ``cannot be combined with speedup`` as ``... with --speedup``, ``resume=True (--resume on
    the command line)`` as ``--resume``, ``needs lora_r >= 1`` as ``needs --lora-r R (R >= 1)``, and the
    missing schedule's fields as options. Only these phrasings are rewritten, so paths and quoted
    values in other messages stay as they are."""
    import re

    fields = ("speedups", "speedup", "max_layers", "min_layers")
    reason = reason.replace("resume=True (--resume on the command line)", "--resume")
    reason = reason.replace("needs lora_r >= 1", "needs --lora-r R (R >= 1)")
    reason = reason.replace("min_layers defaults to max_layers", "--min-layers defaults to --max-layers")
    reason = reason.replace("give speedup, speedups, or max_layers/min_layers (speedup=1 for full depth)",
                            "give --speedup, --speedups, or --max-layers/--min-layers (--speedup 1 for full depth)")
    reason = re.sub(r"\bwarmup_layers=(\d+)", r"--warmup-layers \1", reason)
    reason = re.sub(r"\b[a-z_]+(?:=\w+| > 0), i\.e\. (?=--)", "", reason)  # "distill=True, i.e. --distill": the option
    return re.sub(r"\b(must be <=?|cannot be combined with) (" + "|".join(fields) + r")\b(?![\w/=])",
                  lambda m: f"{m.group(1)} {option(m.group(2))}", reason)


class _Terminated(KeyboardInterrupt):
    """``train`` got SIGTERM: it stops as on Ctrl-C (exit status 143 instead of 130)."""


def _interrupt(signum, frame) -> None:
    """SIGTERM handler of ``train``."""
    raise _Terminated


def _interrupted(out: Path, checkpoint_every: int, status: int, loading: bool = False) -> None:
    """After ``train`` was interrupted (Ctrl-C: ``status`` 130, SIGTERM: 143, as shells report a
    process ended by the signal): say where the run can resume from (or, ``loading``, that it
    stopped before the run started, while the model loaded) and exit with ``status``.

    Raises:
        typer.Exit: always, with ``status``."""
    if loading:  # before the run started (imports, checks, the model loading): no heavy import here
        err.print("training interrupted while loading the model; nothing was written", markup=False, highlight=False)
        raise typer.Exit(status)
    from .train import latest_checkpoint

    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        hint = f"its newest checkpoint is {ckpt}: run the same command with --resume to continue"
    elif checkpoint_every:
        hint = f"no checkpoint was written yet (the first comes after step {checkpoint_every})"
    else:
        hint = "no checkpoint was written (--checkpoint-every N makes a run resumable)"
    err.print(f"training interrupted; {hint}", markup=False, highlight=False)
    raise typer.Exit(status)


