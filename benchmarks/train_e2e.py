"""Skip-aware fine-tuning of the embedded SmolLM2-135M-Instruct on E2E (src/skipdecode/train.py).

One command reproduces a real run on the project's 2-core CPU in under 3 hours:

    python benchmarks/train_e2e.py --speedup 2 --max-steps 300          # ~20 s/step on 2 CPU cores: ~1 h 45 min

It fine-tunes the model (full fine-tuning, AdamW, lr 2e-4, cosine decay, batch 16) on the E2E dev
set (``<shared data>/e2e/devset.csv``, 4,672 pairs over 547 MRs; 5 % of the MRs held out for the
validation loss) with the SkipDecode schedule for ``--speedup`` in place (``1`` = the full-depth
baseline; ``2,3,5`` = mixed-policy training, one target drawn per step), and writes

* the run directory ``runs/e2e-<tag>/`` (``final/`` is the model, loadable with
  ``skipdecode.load`` / ``--model``; ``checkpoint-*`` for ``--resume``). It lives under the
  git-ignored ``runs/`` rather than ``benchmarks/results/`` because a checkpoint with its optimizer
  state is ~1.6 GB; ``benchmarks/eval_e2e.py --ckpt 2x=runs/e2e-2x/final`` evaluates it;
* ``benchmarks/results/train_e2e_<tag>.json``: steps, tokens, wall time, train loss per step, val
  loss per evaluation, tokens/s, policy, horizon and the command;
* ``benchmarks/results/train_e2e_<tag>.png``: the loss curves;

and prints one JSON line. ``<tag>`` is ``2x``, ``mix2-3-5`` etc. (plus ``-lora<r>``/``-distill``).

More:

    python benchmarks/train_e2e.py --speedup 2,3,5 --max-steps 300               # one model for 2x, 3x and 5x
    python benchmarks/train_e2e.py --speedup 3 --max-steps 600 --device cuda --bf16 --batch-size 32
    python benchmarks/train_e2e.py --speedup 2 --max-steps 300 --resume            # continue a killed run
    python benchmarks/train_e2e.py --measure-throughput --speedup 3                # training tok/s: 3x vs full depth
    accelerate launch --multi_gpu --num_processes 4 benchmarks/train_e2e.py --speedup 2 --device cuda --bf16

``--measure-throughput`` times forward + backward of the teacher-forced loss (sparse teacher
forcing, no optimizer step) for full depth and each ``--speedup`` on the same batches and writes
``benchmarks/results/train_throughput_quick.json``. The full comparison (masked vs sparse, prompt
gradient on/off, full vs LoRA, with optimizer steps) is ``benchmarks/train_throughput.py``.
``--teacher-forcing masked`` and ``--no-prompt-grad`` select the training paths
(docs/training-speed.md).
All options: ``python benchmarks/train_e2e.py --help``.
"""

from __future__ import annotations

import argparse
import logging
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_e2e.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--speedup", default="2", help="target speedup (1 = full depth) or a comma list for mixed-policy training, e.g. 2,3,5")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps (the LR schedule's length)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="budget of optimizer-step time: stop after the first step past it and save the model")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model id, directory or .gguf")
    p.add_argument("--data", default=None, help="training CSV/JSONL (default: <shared data>/e2e/devset.csv)")
    p.add_argument("--task", default="e2e")
    p.add_argument("--out", default=None, help="run directory (default: runs/e2e-<tag>)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lr-scheduler", default="cosine")
    p.add_argument("--warmup-ratio", type=float, default=0.05)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--horizon", type=int, default=None, help="default: median response length of the data (28 tokens on E2E dev)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--max-val-examples", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--distill", action="store_true", help="train on the full-depth model's greedy answers")
    p.add_argument("--kl-weight", type=float, default=0.0)
    p.add_argument("--teacher", default=None,
                   help="KL teacher (model id, directory or .gguf, same tokenizer); default: the starting model")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--prompt-grad", action=argparse.BooleanOptionalAction, default=True,
                   help="backpropagate through the prompt; --no-prompt-grad runs it under no_grad (same loss, faster)")
    p.add_argument("--teacher-forcing", default="sparse", choices=["sparse", "masked"],
                   help="sparse: each layer runs only on the positions that need it; masked: every position (same values)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (default: when the tokenizer has one); "
                        "--no-chat trains on the plain task prompt (shorter sequences, faster on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tag", default=None, help="name of the outputs (default: from --speedup etc.)")
    p.add_argument("--measure-throughput", action="store_true", help="only time training steps (full depth vs --speedup)")
    p.add_argument("--throughput-steps", type=int, default=2)
    p.add_argument("--throughput-batch-size", type=int, default=4)
    return p.parse_args(argv)


def _speedups(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --speedup must be a number or a comma list such as 2,3,5, got {text!r}")
    if not values:
        raise SystemExit("error: --speedup is empty")
    return values


def _tag(args: argparse.Namespace, speedups: list[float]) -> str:
    if args.tag:
        return args.tag
    tag = f"{speedups[0]:g}x" if len(speedups) == 1 else "mix" + "-".join(f"{s:g}" for s in speedups)
    if args.lora_r:
        tag += f"-lora{args.lora_r}"
    if args.distill:
        tag += "-distill"
    return tag


def _machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": device, "cpu": platform.processor() or platform.machine()}
    if device != "cpu" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def plot(record: dict, path: Path, title: str) -> None:
    """Train loss per step (points coloured by the step's policy, plus a moving average) and the
    validation loss per policy, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    log = record["train_log"]
    labels = sorted({r["speedup"] for r in log}, key=float) if log else []
    for label in labels:
        pts = [(r["step"], r["loss"]) for r in log if r["speedup"] == label]
        ax.scatter(*zip(*pts), s=6, alpha=0.35, label=f"train ({label}x step)")
    if log:
        k = max(1, len(log) // 30)
        steps = [r["step"] for r in log]
        losses = [r["loss"] for r in log]
        avg = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1]) for i in range(len(losses))]
        ax.plot(steps, avg, color="black", lw=1.2, label=f"train (moving mean of {k})")
    val = record["val_log"]
    for label in sorted({lab for v in val for lab in v["by_policy"]}, key=float):
        pts = [(v["step"], v["by_policy"][label]) for v in val if label in v["by_policy"]]
        ax.plot(*zip(*pts), marker="o", lw=2, label=f"val ({label}x)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per response token (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _measure_throughput(args: argparse.Namespace, data: str, speedups: list[float], command: str, device: str) -> int:
    """``--measure-throughput``: time training steps, write train_throughput_quick.json, print the result."""
    import skipdecode
    from skipdecode.data import DataError, load_examples
    from skipdecode.jsonio import dumps  # strict JSON: NaN/inf as null
    from skipdecode.paths import portable_record
    from skipdecode.train import measure_throughput

    sk = skipdecode.load(args.model, device=device, adapter=False)
    try:
        examples = load_examples(data, task=args.task)
        full = [1.0] + [s for s in speedups if s != 1]
        result = measure_throughput(sk, examples, speedups=full, horizon=args.horizon,
                                    batch_size=args.throughput_batch_size, steps=args.throughput_steps,
                                    max_length=args.max_length)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result.update(model=args.model, command=command, machine=_machine(device),
                  note="sparse teacher forcing (each layer runs on the positions whose plan includes it), "
                       "forward + backward only; active_fraction is the share of (position, layer) pairs run; "
                       "benchmarks/train_throughput.py is the full comparison")
    out = RESULTS / "train_throughput_quick.json"
    out.write_text(dumps(portable_record(result), indent=2) + "\n")
    print(dumps(result))
    return 0


def _train(args: argparse.Namespace, data: str, speedups: list[float], tag: str):
    """Fine-tune from the stock weights; the TrainResult, or None after printing the error."""
    import skipdecode
    from skipdecode.data import DataError
    from skipdecode.train import TrainConfig, TrainConfigError, train

    out_dir = Path(args.out) if args.out else ROOT / "runs" / f"e2e-{tag}"
    schedule = dict(speedup=speedups[0]) if len(speedups) == 1 else dict(speedups=tuple(speedups))
    try:
        config = TrainConfig(
            out_dir=str(out_dir), task=args.task, max_steps=args.max_steps, batch_size=args.batch_size,
            grad_accum=args.grad_accum, lr=args.lr, lr_scheduler=args.lr_scheduler, warmup_ratio=args.warmup_ratio,
            max_length=args.max_length, horizon=args.horizon, val_fraction=args.val_fraction,
            max_val_examples=args.max_val_examples, eval_every=args.eval_every,
            checkpoint_every=args.checkpoint_every, lora_r=args.lora_r, distill=args.distill,
            kl_weight=args.kl_weight, teacher=args.teacher, max_minutes=args.max_minutes,
            gradient_checkpointing=args.grad_checkpointing, device=args.device,
            bf16=args.bf16, chat=args.chat, seed=args.seed, resume=args.resume, progress=not args.no_progress,
            prompt_grad=args.prompt_grad, teacher_forcing=args.teacher_forcing, **schedule,
        )
        sk = skipdecode.load(args.model, adapter=False)  # train from the stock weights
        return train(sk, data, config)
    except TrainConfigError as e:
        option = {"out_dir": "--out", "gradient_checkpointing": "--grad-checkpointing", "speedups": "--speedup",
                  "resume": "--resume"}.get(e.field, "--" + e.field.replace("_", "-"))
        print(f"error: {option} {e.reason}", file=sys.stderr)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
    return None


def _write_results(args: argparse.Namespace, result, tag: str, command: str, device: str) -> dict:
    """Write train_e2e_<tag>.json and .png; returns the summary printed as the final JSON line."""
    from skipdecode.jsonio import dumps  # strict JSON: NaN/inf as null
    from skipdecode.paths import portable_record

    record = result.to_dict()
    record.update(model=args.model, tag=tag, command=command, machine=_machine(device))
    json_path = RESULTS / f"train_e2e_{tag}.json"
    png_path = RESULTS / f"train_e2e_{tag}.png"
    json_path.write_text(dumps(portable_record(record), indent=2) + "\n")
    val = record["val_log"][-1]["loss"] if record["val_log"] else float("nan")
    plot(record, png_path, f"SmolLM2-135M on E2E, {tag} schedule: {result.steps} steps, "
                           f"{result.tokens_per_second:.0f} tok/s, final val {val:.3f}")
    summary = {k: record[k] for k in ("tag", "steps", "tokens_seen", "wall_seconds", "tokens_per_second",
                                      "target_tokens_per_second", "horizon", "final_dir",
                                      "stopped_on_budget")}
    summary.update(final_train_loss=record["train_log"][-1]["loss"] if record["train_log"] else None,
                   final_val_loss=val, json=str(json_path), png=str(png_path))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    speedups = _speedups(args.speedup)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    from skipdecode.data import DataError, shared_data_path
    from skipdecode.jsonio import dumps  # strict JSON: NaN/inf as null

    try:
        data = shared_data_path(args.data, "e2e/devset.csv")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/train_e2e.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device)

    if args.measure_throughput:
        return _measure_throughput(args, data, speedups, command, device)

    tag = _tag(args, speedups)
    result = _train(args, data, speedups, tag)
    if result is None:
        return 2
    from accelerate import PartialState

    if not PartialState().is_main_process:  # under `accelerate launch`, one process writes the results
        return 0
    print(dumps(_write_results(args, result, tag, command, device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
