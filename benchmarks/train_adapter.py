"""Retrain the skip adapter shipped with the embedded SmolLM2-135M-Instruct (issue 12).

Self-distillation under the 2x schedule: the full-depth model answers the training prompts of
``benchmarks/adapter_prompts.py`` (greedy, chat template), and a LoRA adapter learns those answers
(cross-entropy) plus ``kl_weight`` x KL to the full-depth logits, with the skip schedule in place.
Everything goes through the public trainer API (:class:`skipdecode.train.TrainConfig`,
:func:`skipdecode.train.train`).

    python benchmarks/train_adapter.py                      # the shipped run (see docs/training.md)
    python benchmarks/train_adapter.py --resume             # continue a killed run from its checkpoint
    python benchmarks/train_adapter.py --install            # copy runs/skip-adapter/final into the package

The run directory (default ``runs/skip-adapter``) gets checkpoints, ``train_record.json`` and
``final/``, whose ``skipdecode.json`` is completed with an ``adapter`` section: the prompt set's
sha256s, the exact command, the minutes it took and the base model. ``--install`` writes the
adapter as float16 safetensors into ``src/skipdecode/skip_adapters/smollm2-135m-instruct/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import adapter_prompts  # noqa: E402  (benchmarks/adapter_prompts.py)
from skipdecode.jsonio import dumps  # noqa: E402  strict JSON (NaN/inf -> null)


def _rel(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _layer_range(text: str) -> range:
    """``"FIRST-LAST"`` (layers, inclusive) as a range; argparse reports a ValueError as a bad value."""
    try:
        first, last = (int(x) for x in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes FIRST-LAST layers, e.g. 10-29; got {text!r}") from None
    if not 0 <= first <= last:
        raise argparse.ArgumentTypeError(f"needs 0 <= FIRST <= LAST; got {text!r}")
    return range(first, last + 1)


def _speedup_above_one(text: str) -> float:
    """argparse type of --as-speedup: a finite number > 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 1, got {text!r}") from None
    if not 1 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 1, got {text!r}")
    return value


def _add_run_options(ap: argparse.ArgumentParser) -> None:
    """Where the run goes, what it trains on and its skip schedule."""
    ap.add_argument("--out", default=str(REPO / "runs" / "skip-adapter"), help="run directory")
    ap.add_argument("--data", default=None, help="data folder (default ../shared/data or SKIPDECODE_DATA)")
    ap.add_argument("--model", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--speedups", default=None,
                    help="comma-separated targets (mixed policy when several; default 2)")
    ap.add_argument("--max-layers", type=int, default=None,
                    help="explicit schedule instead of --speedups: layers at the first decode step "
                         "(alone with --min-layers: every layer)")
    ap.add_argument("--min-layers", type=int, default=None,
                    help="explicit schedule instead of --speedups: layers after the horizon, the floor "
                         "(alone with --max-layers: a constant budget of --max-layers)")
    ap.add_argument("--horizon", type=int, default=32, help="decay horizon T (tokens)")


def _add_training_options(ap: argparse.ArgumentParser) -> None:
    """The optimizer, loss, LoRA, entry bridge and teacher-answer settings."""
    ap.add_argument("--max-steps", type=int, default=240, help="optimizer steps (the cosine schedule spans them)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per optimizer step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the LoRA")
    ap.add_argument("--kl-weight", type=float, default=0.5, help="weight of KL(teacher || student) next to the cross-entropy")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: 2 x rank)")
    ap.add_argument("--prompt-grad", action=argparse.BooleanOptionalAction, default=False,
                    help="backward through the prompt positions (--no-prompt-grad: the prompt runs under "
                         "no_grad at full depth, TrainConfig.prompt_grad=False)")
    ap.add_argument("--base-prefill", action=argparse.BooleanOptionalAction, default=True,
                    help="the base model (adapter off) prefills the prompt and the adapter trains on decode "
                         "positions only: a decode-only adapter (TrainConfig.base_prefill)")
    ap.add_argument("--entry-bridge", action=argparse.BooleanOptionalAction, default=True,
                    help="fit an affine map per entry layer before training and train with it "
                         "(TrainConfig.entry_bridge; a project extension, docs/entry-bridge.md)")
    ap.add_argument("--entry-bridge-lr", type=float, default=None,
                    help="train the entry bridge too, at this learning rate (default: it stays as fitted)")
    ap.add_argument("--on-policy", type=float, default=0.0, metavar="SHARE",
                    help="share in [0, 1] of each batch's rows answered by the student itself under the schedule, "
                         "with the teacher's choices as targets (TrainConfig.on_policy; on-policy distillation)")
    ap.add_argument("--position-half-life", type=float, default=None, metavar="TOKENS",
                    help="weigh response token i's loss 2^(-i/TOKENS), so that early answer tokens count more "
                         "(TrainConfig.position_half_life); default: every token the same")
    ap.add_argument("--init-adapter", default=None, metavar="DIR",
                    help="start the LoRA and the entry bridge from this adapter folder (TrainConfig.init_adapter; "
                         "e.g. the shipped adapter) instead of a fresh LoRA and a bridge fit; its rank and alpha "
                         "must be --lora-r/--lora-alpha, and with --entry-bridge (the default) it must hold a bridge")
    ap.add_argument("--warmup-ratio", type=float, default=0.05, help="share of steps of learning-rate warm-up")
    ap.add_argument("--max-new-tokens", type=int, default=40, help="longest teacher answer (tokens)")
    ap.add_argument("--distill-answers-from", metavar="CKPT", default=None,
                    help="reuse the teacher answers stored in this checkpoint of an earlier run of this script "
                         "(e.g. runs/skip-adapter-v7/checkpoint-00000280) instead of generating them (17 min here)")
    ap.add_argument("--max-length", type=int, default=256, help="longest prompt + answer (tokens)")
    ap.add_argument("--limit-prompts", type=int, default=None, help="use only the first N training prompts (pilot)")
    ap.add_argument("--eval-every", type=int, default=20, help="validation loss every N steps")
    ap.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint every N steps (2 kept)")


def _add_machine_options(ap: argparse.ArgumentParser) -> None:
    """Threads, device, precision and resuming."""
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads (2: the shipped run, on a quiet 2-core CPU; 1 is faster on a busy one)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast for the training steps (TrainConfig.bf16; fp32 master weights). Fast on "
                         "CPUs with AMX (amx_bf16 in /proc/cpuinfo) and on GPUs, about 12x slower than float32 on an AVX2-only "
                         "CPU (a warning says so); the teacher answers stay float32")
    ap.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")


def _add_install_options(ap: argparse.ArgumentParser) -> None:
    """``--install`` and ``--reschedule``: shipping a run's adapter into the package."""
    ap.add_argument("--install", action="store_true", help="only copy OUT/final into the package data (float16)")
    ap.add_argument("--lora-format", default="float16", choices=("float16", "int8"),
                    help="with --install: how the LoRA weights are stored (int8: a quarter of float32, skipdecode.packing)")
    ap.add_argument("--bridge-format", default="int8", choices=("float16", "int8", "int4"),
                    help="with --install: how the entry bridge is stored (int4: about a seventh of float32)")
    ap.add_argument("--bridge-targets", default=None, metavar="FIRST-LAST", type=_layer_range,
                    help="with --install: ship only the entry bridge's maps of these entry layers (e.g. 10-29: "
                         "those the 2x, 3x and 5x schedules jump to); default all")
    ap.add_argument("--as-speedup", default=None, type=_speedup_above_one, metavar="S",
                    help="with --install: record the run's trained schedule (e.g. --max-layers 25 --min-layers 5, "
                         "labelled 'custom') as its schedule for --speedup S, so that --speedup S runs it")
    ap.add_argument("--full-depth-steps", default=None, type=int, metavar="K",
                    help="the first K decode steps run at full depth with the base weights before the decay "
                         "(LinearDecayPolicy.full_depth_steps): trained with (TrainConfig.full_depth_steps), or "
                         "with --install / --reschedule set on the shipped schedule without retraining")
    ap.add_argument("--ship-horizon", default=None, type=int, metavar="T",
                    help="with --install / --reschedule: the shipped schedule's decay horizon (tokens) instead of "
                         "the trained one")
    ap.add_argument("--ship-min-layers", default=None, type=int, metavar="LAYERS",
                    help="with --install / --reschedule: the shipped schedule's floor instead of the trained one "
                         "(e.g. a run trained at 25 -> 10 shipped at 25 -> 5)")
    ap.add_argument("--reschedule", action="store_true",
                    help="only change the schedule of the adapter installed in the package (--full-depth-steps, "
                         "--ship-horizon, --ship-min-layers; recorded in its skipdecode.json with --note), no retraining")
    ap.add_argument("--note", default=None, help="with --reschedule: how the new schedule was chosen (stored)")
    ap.add_argument("--install-from", default=None, help="with --install: this folder instead of OUT/final "
                    "(e.g. OUT/checkpoint-00000120 of an unfinished run)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The script's settings (defaults: the shipped run)."""
    ap = argparse.ArgumentParser(description="Retrain the shipped skip adapter of the embedded model.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_run_options(ap)
    _add_training_options(ap)
    _add_machine_options(ap)
    _add_install_options(ap)
    return ap.parse_args(argv)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _adapter_record(command: str, minutes: float, train_rows: list[dict], heldout_rows: list[dict], *,
                    resumed: bool) -> dict:
    """The ``adapter`` section of the adapter's skipdecode.json: command, minutes, machine, commit,
    and the prompt set's sizes, sources and sha256s."""
    import torch

    m = adapter_prompts.manifest(train_rows, heldout_rows)["splits"]
    return {
        "command": command,
        "minutes": round(minutes, 1),
        "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
        "git_commit": _git_commit(),
        "prompt_set": {"builder": "benchmarks/adapter_prompts.py", "manifest": "benchmarks/adapter_prompts/manifest.json",
                       "train_prompts": m["train"]["n"], "train_sha256": m["train"]["sha256"],
                       "heldout_prompts": m["heldout"]["n"], "heldout_sha256": m["heldout"]["sha256"],
                       "sources": m["train"]["by_source"]},
        "resumed": resumed,
    }


def _config(args: argparse.Namespace, config_cls, out: Path, speedups: tuple[float, ...]):
    """The run's :class:`skipdecode.train.TrainConfig` (raises its TrainConfigError on a bad value).

    ``speedups`` is empty when the schedule is explicit (``--max-layers``/``--min-layers``)."""
    return config_cls(
        out_dir=str(out), speedups=speedups if len(speedups) > 1 else None,
        speedup=speedups[0] if len(speedups) == 1 else None, horizon=args.horizon,
        max_layers=args.max_layers, min_layers=args.min_layers,
        max_length=args.max_length, val_fraction=0.04, max_val_examples=24, chat=True,
        max_steps=args.max_steps, lr=args.lr, batch_size=args.batch_size, warmup_ratio=args.warmup_ratio,
        on_policy=args.on_policy, init_adapter=args.init_adapter, position_half_life=args.position_half_life,
        full_depth_steps=args.full_depth_steps or 0,
        distill=True, kl_weight=args.kl_weight, distill_max_new_tokens=args.max_new_tokens,
        distill_batch_size=16, distill_answers_from=args.distill_answers_from,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, prompt_grad=args.prompt_grad,
        base_prefill=args.base_prefill, entry_bridge=args.entry_bridge, entry_bridge_lr=args.entry_bridge_lr,
        base_model="smollm2-135m-instruct" if args.model is None else None,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, save_total_limit=2,
        resume=args.resume, progress=False, seed=0, device=args.device, bf16=args.bf16,
    )


#: TrainConfig fields set by an option of another name (the rest: --field-name).
_FLAGS = {"speedup": "--speedups", "speedups": "--speedups", "distill_max_new_tokens": "--max-new-tokens",
          "batch_size": "--batch-size", "entry_bridge": "--entry-bridge/--no-entry-bridge", "out_dir": "--out"}


def _config_error(e) -> None:
    """Exit 2 with a TrainConfigError worded for this script's options (``--init-adapter ...``)."""
    flag = _FLAGS.get(e.field, "--" + e.field.replace("_", "-"))
    reason = e.reason.replace("max_layers", "--max-layers").replace("min_layers", "--min-layers")
    print(f"error: {flag} {reason}", file=sys.stderr)
    raise SystemExit(2)


def _speedups(args: argparse.Namespace) -> tuple[float, ...]:
    """``--speedups`` as numbers; empty with an explicit ``--max-layers``/``--min-layers`` schedule.

    Raises:
        SystemExit: (2) both kinds of schedule given, or a speedup that is not a number.
    """
    explicit = args.max_layers is not None or args.min_layers is not None
    if explicit:
        if args.speedups is not None:
            print("error: give either --speedups or --max-layers/--min-layers, not both", file=sys.stderr)
            raise SystemExit(2)
        return ()
    try:
        return tuple(float(s) for s in (args.speedups or "2").split(","))
    except ValueError:
        print(f"error: --speedups takes comma-separated numbers, e.g. 2 or 2,3; got {args.speedups!r}",
              file=sys.stderr)
        raise SystemExit(2) from None


def _name_prompt_set(meta: dict) -> None:
    """Name the in-memory training data of ``meta`` (an adapter's skipdecode.json) as the prompt builder."""
    data = meta.get("data", {})
    if data.get("spec") == "<in-memory>":
        data["spec"] = "benchmarks/adapter_prompts.py (train split)"


def _reschedule(args: argparse.Namespace) -> int:
    """``--reschedule``: change the installed adapter's schedule (exit 2 on a bad value)."""
    from skipdecode.skip_adapter import SHIPPED_DIR, AdapterError, reschedule_adapter

    try:
        changes = reschedule_adapter(SHIPPED_DIR / "smollm2-135m-instruct", full_depth_steps=args.full_depth_steps,
                                     horizon=args.ship_horizon, note=args.note, min_layers=args.ship_min_layers)
    except (AdapterError, ValueError) as e:
        message = str(e)
        for field, flag in (("full_depth_steps", "--full-depth-steps"), ("horizon", "--ship-horizon"),
                            ("min_layers", "--ship-min-layers")):
            if message.startswith(field + " "):  # the library names its field: name the option
                message = flag + message[len(field):]
        print(f"error: --reschedule: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    print(dumps({"rescheduled": "src/skipdecode/skip_adapters/smollm2-135m-instruct", **changes}))
    return 0


def _install(args: argparse.Namespace, out: Path) -> int:
    """``--install``: copy OUT/final (or ``--install-from``) into the package data."""
    from skipdecode.skip_adapter import install_adapter

    src = Path(args.install_from) if args.install_from else out / "final"
    meta_path = src / "skipdecode.json"
    if not meta_path.is_file():
        raise SystemExit(f"error: --install: {_rel(src)} holds no skipdecode.json (a finished run's final/ "
                         "or a checkpoint; see --out and --install-from)")
    meta = json.loads(meta_path.read_text())
    if "adapter" not in meta:  # a checkpoint of an unfinished run: record what it is
        record = json.loads((out / "train_record.json").read_text()) if (out / "train_record.json").exists() else {}
        train_rows, heldout_rows = adapter_prompts.build_or_exit(args.data)
        meta["adapter"] = _adapter_record("python benchmarks/train_adapter.py (checkpoint of an unfinished run)",
                                          record.get("wall_seconds", 0) / 60, train_rows, heldout_rows, resumed=False)
        meta["adapter"]["checkpoint_step"] = meta.get("training", {}).get("step")
        _name_prompt_set(meta)
        from skipdecode.model import write_json_atomic

        write_json_atomic(meta_path, meta)
    try:
        target = install_adapter(src, lora_format=args.lora_format, bridge_format=args.bridge_format,
                                 bridge_targets=args.bridge_targets, as_speedup=args.as_speedup,
                                 full_depth_steps=args.full_depth_steps, horizon=args.ship_horizon,
                                 min_layers=args.ship_min_layers)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    print(dumps({"installed": _rel(target),
                      "bytes": sum(f.stat().st_size for f in target.iterdir() if f.is_file())}))
    return 0


def _train(args: argparse.Namespace, argv: list[str] | None, out: Path) -> int:
    """Train the adapter on the training prompts and complete its skipdecode.json."""
    from skipdecode.train import TrainConfig, TrainConfigError, train

    train_rows, heldout_rows = adapter_prompts.build_or_exit(
        args.data, mismatch="prompt set differs from benchmarks/adapter_prompts/manifest.json:")
    if args.limit_prompts:
        train_rows = train_rows[: args.limit_prompts]
    held = {r["prompt"] for r in heldout_rows}
    prompts = [r["prompt"] for r in train_rows if r["prompt"] not in held]
    speedups = _speedups(args)
    try:
        config = _config(args, TrainConfig, out, speedups)
    except TrainConfigError as e:
        _config_error(e)
    command = "python benchmarks/train_adapter.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    start = time.time()
    print(f"[{time.strftime('%H:%M:%S')}] {len(prompts)} training prompts, {config}", flush=True)

    def report(info: dict) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] step {info['step']}/{info['total_steps']} loss {info['loss']:.4f} "
              f"lr {info['lr']:.2e} speedup {info['speedup']} {info['checkpoint'] or ''} "
              f"({(time.time() - start) / 60:.1f} min)", flush=True)

    from skipdecode import load

    base = load(args.model, adapter=False)  # the stock weights: never start from the shipped adapter
    try:
        result = train(base, prompts, config, callback=report)
    except TrainConfigError as e:  # e.g. an init_adapter of another rank
        _config_error(e)
    minutes = (time.time() - start) / 60
    final = Path(result.final_dir)
    meta = json.loads((final / "skipdecode.json").read_text())
    meta["adapter"] = _adapter_record(command.strip(), minutes, train_rows, heldout_rows, resumed=args.resume)
    _name_prompt_set(meta)
    from skipdecode.model import write_json_atomic

    write_json_atomic(final / "skipdecode.json", meta)
    print(dumps({"final": _rel(final), "minutes": round(minutes, 1), "steps": result.steps,
                      "val_log": result.val_log, "horizon": result.horizon}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.reschedule:
        return _reschedule(args)
    if args.install:
        return _install(args, out)
    return _train(args, argv, out)


if __name__ == "__main__":
    sys.exit(main())
