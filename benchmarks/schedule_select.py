"""Choose the shipped adapter's 2x schedule on prompts it never trained on, not on the held-out set.

Greedy answers of the embedded model with its skip adapter (``--adapter DIR``: a trained run's) under
linear-decay schedules with full-depth first steps (``K:MAX:MIN:HORIZON``: decode steps 1..K run all
layers with the base weights, then the decay MAX -> MIN layers over HORIZON tokens;
:class:`skipdecode.policy.LinearDecayPolicy`), scored
against the stock model at full depth like ``benchmarks/adapter_agreement.py`` (identical answers,
ROUGE-L, first divergence, realised theoretical speedup).

The prompts are the **selection split**: the training prompts that ``benchmarks/train_adapter.py``'s
validation split held back (``val_fraction`` 0.04 of the distinct training prompts, seed 0, through the
trainer's own ``_split_val``): the adapter never trained on them, and they are not the 77 held-out
prompts that the README's table reports. The best schedule whose realised speedup reaches
``--min-speedup`` is marked; measure it once on the held-out prompts with ``adapter_agreement.py``.

    python benchmarks/schedule_select.py --threads 2 \\
        --schedules 0:25:5:32,2:25:5:32,8:25:5:16,10:25:5:12,12:25:5:8

Writes ``benchmarks/results/NAME.{json,md,png}`` (``--name``, default ``schedule_select``): a table of
every schedule and a plot of ROUGE-L against realised speedup; ends with one JSON line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import adapter_agreement as aa  # noqa: E402  (benchmarks/adapter_agreement.py)
import adapter_prompts  # noqa: E402
from skipdecode.jsonio import dumps  # noqa: E402

VAL_FRACTION, SEED = 0.04, 0  # benchmarks/train_adapter.py's TrainConfig(val_fraction=0.04, seed=0)


def selection_prompts(train_rows: list[dict], heldout_rows: list[dict]) -> list[str]:
    """The training prompts that ``train_adapter.py``'s validation split holds back from every step
    (all of its validation prompts, not only the ``max_val_examples`` it scores), in split order.
    Computed with the trainer's own :func:`skipdecode.training.batching._split_val` on the list of
    prompts that script passes to :func:`skipdecode.train.train`."""
    from skipdecode.data import Example
    from skipdecode.training.batching import _split_val

    held = {r["prompt"] for r in heldout_rows}
    prompts = [r["prompt"] for r in train_rows if r["prompt"] not in held]
    examples = [Example(p, "") for p in prompts]
    _, val_idx = _split_val(examples, VAL_FRACTION, len(examples), SEED)
    return list(dict.fromkeys(prompts[i] for i in val_idx))


def _schedules(text: str) -> list[tuple[int, int, int, int]]:
    """``"8:25:5:16,10:25:5:12"`` as ``[(8, 25, 5, 16), (10, 25, 5, 12)]``; argparse reports errors."""
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        try:
            k, mx, mn, h = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"takes comma-separated K:MAX:MIN:HORIZON integers, e.g. 10:25:5:12; got {part!r}") from None
        out.append((k, mx, mn, h))
    if not out:
        raise argparse.ArgumentTypeError("needs at least one K:MAX:MIN:HORIZON")
    return out


def _plot(rows: list[dict], best: dict | None, path: Path, min_speedup: float) -> None:
    """ROUGE-L against realised speedup, one labelled point per schedule (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.scatter([r["theoretical_speedup"] for r in rows], [r["rougeL"] for r in rows], s=18)
    for r in rows:
        ax.annotate(r["schedule"], (r["theoretical_speedup"], r["rougeL"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    if best is not None:
        ax.scatter([best["theoretical_speedup"]], [best["rougeL"]], s=60, facecolors="none", edgecolors="red")
    ax.axvline(min_speedup, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("realised theoretical speedup (x)")
    ax.set_ylabel("ROUGE-L vs stock full depth")
    ax.set_title("Schedules K:MAX:MIN:HORIZON on the selection split")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The shipped adapter under full-depth-first schedules, selection split.")
    ap.add_argument("--schedules", required=True, type=_schedules, help="comma-separated K:MAX:MIN:HORIZON")
    ap.add_argument("--adapter", default=None, metavar="DIR",
                    help="a trained run's adapter folder (e.g. runs/skip-adapter-v13/final) instead of the shipped one")
    ap.add_argument("--min-speedup", type=float, default=2.0, help="realised speedup the chosen schedule must reach")
    aa.add_common_args(ap, "schedule_select")
    args = ap.parse_args(argv)

    import torch

    import skipdecode
    from skipdecode.policy import FullPolicy, LinearDecayPolicy

    train_rows, held = aa.common_setup(ap, args)
    prompts = selection_prompts(train_rows, held)[: args.limit]
    kw = {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    stock = skipdecode.load(adapter=False)
    L = stock.num_layers
    policies = []
    for k, mx, mn, h in args.schedules:  # every schedule checked before any is run
        try:
            policies.append(((k, mx, mn, h), LinearDecayPolicy(L, mx, mn, 1, h, k)))
        except ValueError as e:
            ap.error(f"--schedules {k}:{mx}:{mn}:{h}: {e}")
    ref = aa.run(stock, prompts, FullPolicy(L), **kw)
    del stock
    adapted = skipdecode.load(adapter=args.adapter or True)  # the shipped adapter by default
    rows = []
    for (k, mx, mn, h), policy in policies:
        out = aa.run(adapted, prompts, policy, **kw)
        row = {"schedule": f"{k}:{mx}:{mn}:{h}", "policy": policy.to_dict(), **aa.score(out, ref),
               **{f: out[f] for f in ("mean_active_layers", "theoretical_speedup", "seconds")}}
        rows.append(row)
        print(f"{row['schedule']}: ROUGE-L {row['rougeL']:.1f}, speedup {row['theoretical_speedup']:.2f}x "
              f"({row['seconds']:.0f} s)", flush=True)
    ok = [r for r in rows if r["theoretical_speedup"] >= args.min_speedup]
    best = max(ok, key=lambda r: r["rougeL"]) if ok else None
    md = [f"Selection split: {len(prompts)} training prompts the adapter never trained on (train_adapter.py's "
          f"validation split), greedy, chat template, at most {args.max_new_tokens} new tokens; reference = the "
          f"stock model at full depth. K:MAX:MIN:HORIZON = K full-depth decode steps (base weights), then "
          f"MAX -> MIN layers over HORIZON tokens. Marked: the best ROUGE-L at >= {args.min_speedup}x.", "",
          "| schedule | identical answers | ROUGE-L vs full depth | first divergence (tokens) | "
          "mean active layers | theoretical speedup |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {'**' + r['schedule'] + '**' if r is best else r['schedule']} | {r['exact']:.1f} % | "
           f"{r['rougeL']:.1f} | {r['first_divergence']:.1f} | {r['mean_active_layers']:.2f}/{L} | "
           f"{r['theoretical_speedup']:.2f}x |" for r in rows]
    report = {"name": args.name,
              "command": " ".join(["python benchmarks/schedule_select.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": skipdecode.DEFAULT_MODEL, "adapter": aa.rel(args.adapter) if args.adapter else "skipdecode/skip_adapters/smollm2-135m-instruct (package data)",
              "split": "selection (train_adapter.py validation prompts, never trained on)",
              "n_prompts": len(prompts), "selection_sha256": adapter_prompts.sha256_text("\n".join(prompts)),
              "data_dir": "../shared/data" if args.data is None else aa.rel(args.data),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "num_layers": L,
              "min_speedup": args.min_speedup, "best": best["schedule"] if best else None,
              "versions": {"torch": torch.__version__}, "rows": rows}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(dumps(report, indent=1, ensure_ascii=False) + "\n")
    (out_dir / f"{args.name}.md").write_text("\n".join(md) + "\n")
    _plot(rows, best, out_dir / f"{args.name}.png", args.min_speedup)
    print("\n".join(md))
    print(dumps({"best": report["best"], **{r["schedule"]: {"rougeL": round(r["rougeL"], 1),
                                                            "speedup": round(r["theoretical_speedup"], 2)}
                                            for r in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
