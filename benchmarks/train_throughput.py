"""Training throughput of skip-aware fine-tuning (issue 9 section 1), a thin script over
:func:`skipdecode.training.throughput.training_throughput`.

For the embedded SmolLM2-135M on E2E dev (batch 16), it times full optimizer steps (forward,
backward, AdamW) at full depth, 2x, 3x and 5x, each with masked vs sparse teacher forcing, the
prompt's gradient on/off, and full fine-tuning vs LoRA (r 8): 32 rows, every row on the same
batches and a fresh copy of the model. It prints a table, writes
``benchmarks/results/train_throughput.json`` and ``.png`` and ends with one JSON line.

    python benchmarks/train_throughput.py                       # all 32 rows, 2 warm-up + 3 timed steps each
    python benchmarks/train_throughput.py --rows 2 --steps 1 --warmup-steps 0 --out /tmp/tp   # smoke test

Run it on a quiet machine (nothing else on the cores): the numbers are wall-clock times.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path

from skipdecode.jsonio import dumps  # strict JSON
from skipdecode.paths import portable_record

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_throughput.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model id, directory or .gguf")
    p.add_argument("--data", default=None, help="training CSV/JSONL (default: <shared data>/e2e/devset.csv)")
    p.add_argument("--task", default="e2e")
    p.add_argument("--speedups", default="1,2,3,5", help="comma list of target speedups")
    p.add_argument("--modes", default="masked,sparse", help="teacher forcing modes (masked, sparse)")
    p.add_argument("--prompt-grad", default="on,off", help="prompt gradient settings (on, off)")
    p.add_argument("--lora-ranks", default="0,8", help="0 = full fine-tuning, r > 0 = LoRA rank r")
    p.add_argument("--rows", type=int, default=None, help="measure only the first N rows (default: all)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per row")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--horizon", type=int, default=None, help="default: median response length of the data")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="output stem (default: benchmarks/results/train_throughput)")
    return p.parse_args(argv)


def _list(text: str, cast, name: str) -> list:
    try:
        return [cast(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, KeyError):
        print(f"error: --{name} must be a comma list such as {'on,off' if name == 'prompt-grad' else '1,2'}, "
              f"got {text!r}", file=sys.stderr)
        raise SystemExit(2) from None


def _on_off(x: str) -> bool:
    return {"on": True, "off": False}[x]


def _label(r: dict) -> str:
    return (f"{r['teacher_forcing']}, prompt grad {'on' if r['prompt_grad'] else 'off'}, "
            f"{'LoRA r' + str(r['lora_r']) if r['lora_r'] else 'full FT'}")


def plot(result: dict, path: Path) -> None:
    """Grouped bars: tokens/s per speedup, one bar per (mode, prompt gradient, fine-tuning) variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    speedups = sorted({r["speedup"] for r in rows})
    labels = list(dict.fromkeys(_label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs, ys = [], []
        for i, s in enumerate(speedups):
            hit = [r for r in rows if r["speedup"] == s and _label(r) == label]
            if hit:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(hit[0]["tokens_per_second"])
        ax.bar(xs, ys, width=width, label=label)
    if result.get("baseline"):
        ax.axhline(result["baseline"]["tokens_per_second"], color="black", lw=1, ls="--", label="baseline (1x masked)")
    ax.set_xticks(range(len(speedups)), [f"{s:g}x" for s in speedups])
    ax.set_xlabel("target speedup of the trained schedule")
    ax.set_ylabel("training tokens/s (prompt + response)")
    ax.set_title(f"Skip-aware training throughput, batch {result['batch_size']}, {result['device']}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="training throughput (full optimizer steps)")
    for col in ("speedup", "teacher forcing", "prompt grad", "fine-tuning", "tok/s", "s/step", "resp. active", "vs baseline"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(f"{r['speedup']:g}x", r["teacher_forcing"], "on" if r["prompt_grad"] else "off",
                  f"LoRA r{r['lora_r']}" if r["lora_r"] else "full", f"{r['tokens_per_second']:.1f}",
                  f"{r['seconds_per_step']:.2f}", f"{r['response_active_fraction']:.3f}",
                  "-" if r["relative"] is None else f"{r['relative']:.2f}x")
    Console(stderr=True).print(t)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    speedups = _list(args.speedups, float, "speedups")
    modes = _list(args.modes, str, "modes")
    prompt_grad = _list(args.prompt_grad, _on_off, "prompt-grad")
    lora = _list(args.lora_ranks, int, "lora-ranks")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import skipdecode
    from skipdecode.data import DataError, load_examples, shared_data_path
    from skipdecode.training.throughput import training_throughput

    try:
        data = shared_data_path(args.data, "e2e/devset.csv")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stem = Path(args.out) if args.out else RESULTS / "train_throughput"
    stem.parent.mkdir(parents=True, exist_ok=True)
    try:
        sk = skipdecode.load(args.model, device=args.device, adapter=False)  # train from the stock weights
        examples = load_examples(data, task=args.task)
        result = training_throughput(
            sk, examples, speedups=speedups, teacher_forcing=modes, prompt_grad=prompt_grad, lora_r=lora,
            rows=args.rows, batch_size=args.batch_size, steps=args.steps, warmup_steps=args.warmup_steps,
            horizon=args.horizon, max_length=args.max_length, chat=args.chat,
            callback=lambda r: print(f"measured {r.speedup:g}x {r.teacher_forcing} prompt_grad={r.prompt_grad} "
                                     f"lora_r={r.lora_r}: {r.tokens_per_second:.1f} tok/s", file=sys.stderr),
        )
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "python benchmarks/train_throughput.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    rel = lambda p: str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)  # noqa: E731
    result.update(model=args.model, data=rel(Path(data)), command=command,
                  machine={"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
                  json=rel(json_path), png=rel(png_path))
    result = portable_record(result)  # repository/data-relative paths
    json_path.write_text(dumps(result, indent=2) + "\n")
    plot(result, png_path)
    _table(result)
    best3 = max((r["relative"] for r in result["rows"] if r["speedup"] == 3 and r["relative"] is not None),
                default=None)
    print(dumps({"rows": len(result["rows"]), "baseline_tokens_per_second":
                      result["baseline"]["tokens_per_second"] if result["baseline"] else None,
                      "best_3x_relative": best3, "json": result["json"], "png": result["png"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
