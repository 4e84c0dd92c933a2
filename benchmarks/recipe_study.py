"""Recipe study (issue 9 section 2): skip-aware fine-tuning recipes compared at the same
wall-clock training budget per run, on validation loss under the policy and BLEU on held-out
E2E **dev** MRs (never the test set).

The E2E dev pairs are split by MR (``--heldout-mrs`` MRs, seeded): every recipe trains on the
other MRs' pairs; the held-out MRs' pairs give the validation loss (under the trained policy,
logged by the trainer during the run) and their greedy generations the dev BLEU (sacrebleu, all
references per MR). Each run gets ``--minutes`` of optimizer-step time through the trainer's
``max_minutes`` budget: it stops after the first optimizer step past it and still validates and
saves its model. The learning-rate schedule (cosine) is planned over ``--epochs`` of the training
MRs (or ``--max-steps``), the same plan for every recipe, so a run stopped by the budget ends
mid-schedule and faster recipes get further along it: recipes are compared at equal minutes.
Validation and BLEU generation are not part of the budget; the table records each run's steps,
planned steps and measured train minutes.

Recipes (``--recipes a,b`` runs a subset; see ``--list``), all at ``--speedup`` (default 3):

* ``1x``: full-depth fine-tune of the base model (the teacher/initialisation of ``from-1x*``;
  recipes that need it run it first);
* ``labels``: the reference: base model, cross-entropy on the gold labels, lr 2e-4, warm-up 1
  layer, full fine-tuning, prompt gradient on;
* ``lr-5e-4``, ``warmup-2``, ``lora-16`` (LoRA r 16, lr 1e-3), ``no-prompt-grad``: one change each;
* ``from-1x``: labels, starting from the ``1x`` fine-tune;
* ``from-1x-kl``: from the ``1x`` fine-tune, labels + ``kl_weight`` 1 * KL to it (the trainer's
  default teacher: a frozen copy of the starting model, at full depth);
* ``labels-kl-1x``: from the base model, labels + ``kl_weight`` 1 * KL to the ``1x`` fine-tune
  (``TrainConfig.teacher``: loaded once, frozen, full depth).

Writes ``<out>.json`` (table + curves; rewritten after every recipe, so an interrupted study
resumes: a recipe already in it is skipped), ``<out>.md`` and ``<out>.png`` (validation loss
against train minutes), prints the table and ends with one JSON line.

    python benchmarks/recipe_study.py --minutes 20 --threads 2 --no-progress     # the study (~3 h on 2 cores)
    python benchmarks/recipe_study.py --recipes labels,no-prompt-grad --minutes 5
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from study_common import (  # noqa: E402
    dev_bleu,
    repo_relative,
    split_by_mr,
    write_json_atomic,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Recipe:
    """A named recipe: TrainConfig overrides, the starting point and whether it trains at full depth."""

    description: str
    overrides: dict = field(default_factory=dict)
    init: str = "base"        # "base" or "1x" (the study's 1x fine-tune)
    full_depth: bool = False  # speedup 1 instead of --speedup
    teacher: str | None = None  # None (KL teacher: the start, frozen) or "1x" (the study's 1x fine-tune)

    def needs_1x(self) -> bool:
        """Whether the recipe starts from, or distils from, the study's 1x fine-tune."""
        return self.init == "1x" or self.teacher == "1x"


RECIPES: dict[str, Recipe] = {
    "1x": Recipe("full-depth fine-tune of the base model (start of from-1x*, teacher of *kl*)", full_depth=True),
    "labels": Recipe("reference: from base, gold labels, lr 2e-4, warm-up 1, full FT, prompt grad on"),
    "lr-5e-4": Recipe("labels with lr 5e-4", {"lr": 5e-4}),
    "warmup-2": Recipe("labels with warm-up 2 layers", {"warmup_layers": 2}),
    "lora-16": Recipe("labels with LoRA r 16 (all linear layers), lr 1e-3", {"lora_r": 16, "lr": 1e-3}),
    "no-prompt-grad": Recipe("labels with the prompt under no_grad", {"prompt_grad": False}),
    "from-1x": Recipe("labels, starting from the 1x fine-tune", init="1x"),
    "from-1x-kl": Recipe("from the 1x fine-tune, labels + 1.0 * KL to it (full depth, frozen)",
                         {"kl_weight": 1.0}, init="1x"),
    "labels-kl-1x": Recipe("from base, labels + 1.0 * KL to the 1x fine-tune (full depth, frozen teacher)",
                           {"kl_weight": 1.0}, teacher="1x"),
}
SETTINGS = ("minutes", "speedup", "data", "heldout_mrs", "seed", "batch_size", "model", "max_steps", "epochs")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recipe_study.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma list of recipes to run")
    p.add_argument("--list", action="store_true", help="print the recipes and exit")
    p.add_argument("--minutes", type=float, default=20.0, help="optimizer-step time per run (minutes)")
    p.add_argument("--epochs", type=float, default=1.0,
                   help="length of the planned LR schedule (passes over the training MRs); the budget stops runs earlier")
    p.add_argument("--max-steps", type=int, default=None,
                   help="planned steps of the LR schedule (overrides --epochs); a run stops there if its minutes last")
    p.add_argument("--speedup", type=float, default=3.0, help="target speedup of the skip recipes")
    p.add_argument("--data", default=None, help="E2E dev CSV (default: <shared data>/e2e/devset.csv)")
    p.add_argument("--out", default=None, help="output stem (default: benchmarks/results/recipe_study)")
    p.add_argument("--runs", default=None, help="run folders (default: runs/recipe_study)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model: id, directory or .gguf")
    p.add_argument("--heldout-mrs", type=int, default=40, help="dev MRs held out (validation loss, dev BLEU)")
    p.add_argument("--val-examples", type=int, default=128, help="held-out pairs scored for the validation loss")
    p.add_argument("--eval-every", type=int, default=20, help="validation every N steps (plus step 0 and the end)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False,
                   help="chat template (the real runs train on the plain task prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--keep-models", action="store_true", help="keep every recipe's final model (1x is always kept)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _selected(text: str) -> list[str]:
    """Recipes to run, with ``1x`` put first when a ``from-1x*`` recipe needs it."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown:
        _die(f"--recipes must be a comma list of {', '.join(RECIPES)}; unknown: {', '.join(unknown) or '(empty)'}")
    if any(RECIPES[n].needs_1x() for n in names) and "1x" not in names:
        names.insert(0, "1x")
    return sorted(dict.fromkeys(names), key=lambda n: (n != "1x", names.index(n)))


def _check_numbers(args: argparse.Namespace) -> None:
    if not args.minutes > 0:
        _die(f"--minutes must be > 0, got {args.minutes}")
    if args.speedup < 1:
        _die(f"--speedup must be >= 1, got {args.speedup}")
    if not args.epochs > 0:
        _die(f"--epochs must be > 0, got {args.epochs}")
    for name in ("batch_size", "eval_batch_size", "val_examples", "eval_every"):
        if getattr(args, name) < 1:
            _die(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        _die(f"--max-steps must be >= 1, got {args.max_steps}")


def _config(args: argparse.Namespace, name: str, run_dir: Path, runs: Path):
    """The TrainConfig of recipe ``name``: ``--minutes`` of optimizer-step time (``max_minutes``)
    on a schedule planned over ``--epochs`` (or ``--max-steps``)."""
    from skipdecode.train import TrainConfig

    r = RECIPES[name]
    kw = dict(out_dir=str(run_dir), speedup=1.0 if r.full_depth else args.speedup, task="e2e", epochs=args.epochs,
              max_steps=args.max_steps, max_minutes=args.minutes, batch_size=args.batch_size,
              max_length=args.max_length, lr=2e-4, max_val_examples=args.val_examples, eval_every=args.eval_every,
              checkpoint_every=0, chat=args.chat, seed=args.seed, device=args.device, bf16=args.bf16,
              progress=not args.no_progress)
    if r.teacher == "1x":
        kw["teacher"] = str(runs / "1x" / "final")
    kw.update(r.overrides)
    return TrainConfig(**kw)


def _val_curve(record: dict) -> list[dict]:
    """``[{"step", "minutes", "loss"}]``: each validation point at the train minutes it was reached."""
    elapsed, cum = 0.0, {0: 0.0}
    for r in record["train_log"]:
        elapsed += r["seconds"]
        cum[r["step"]] = elapsed / 60
    return [{"step": v["step"], "minutes": cum.get(v["step"], elapsed / 60), "loss": v["loss"]}
            for v in record["val_log"]]


def _base(model: str, runs: Path) -> str:
    """``model`` itself when it is a folder, else a plain checkpoint of it saved once under ``runs/base``
    (each recipe loads its start twice; this skips the GGUF dequantisation of the embedded model)."""
    if Path(model).is_dir():
        return model
    path = runs / "base"
    if not (path / "config.json").exists():
        import skipdecode

        skipdecode.load(model, adapter=False).save_pretrained(path)  # stock weights
    return str(path)


def run_recipe(args: argparse.Namespace, name: str, split, runs: Path) -> dict:
    """Train (for ``--minutes``) and evaluate one recipe; returns its table row (with curves)."""
    import skipdecode
    from skipdecode.policy import policy_from_dict
    from skipdecode.train import train

    r = RECIPES[name]
    start = _base(args.model, runs) if r.init == "base" else str(runs / "1x" / "final")
    needed = runs / "1x" / "final"
    if r.needs_1x() and not needed.is_dir():
        _die(f"recipe {name} needs {needed}, which is missing: rerun the 1x recipe (--recipes 1x)")

    def load():
        return skipdecode.load(start, adapter=False)  # never a shipped skip adapter

    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)  # not in the table: an unfinished run, start it afresh
    sk = load()
    t0 = time.perf_counter()
    result = train(sk, split.train, _config(args, name, run_dir, runs), val_data=split.heldout)
    rec = result.to_dict()
    label, policy = next(iter(rec["policies"].items()))
    bleu = dev_bleu(sk, split.items, policy_from_dict(policy), batch_size=args.eval_batch_size, chat=args.chat)
    curve = _val_curve(rec)
    if not args.keep_models and name != "1x":
        shutil.rmtree(Path(result.final_dir), ignore_errors=True)
    return {"recipe": name, "description": r.description, "init": r.init, "policy": label + "x",
            "steps": result.steps, "planned_steps": result.total_steps, "stopped_on_budget": result.stopped_on_budget,
            "examples": result.examples_seen, "tokens": result.tokens_seen, "train_minutes": result.train_seconds / 60,
            "wall_minutes": (time.perf_counter() - t0) / 60, "val_loss": curve[-1]["loss"] if curve else None,
            "dev_bleu": bleu["bleu"], "dev_theoretical_speedup": bleu["theoretical_speedup"],
            "dev_generation_seconds": bleu["seconds"], "val_curve": curve,
            "config": {**rec["config"], "out_dir": repo_relative(rec["config"]["out_dir"]),
                       "teacher": repo_relative(rec["config"]["teacher"]) if rec["config"]["teacher"] else None},
            "final_dir": repo_relative(result.final_dir) if Path(result.final_dir).exists() else None,
            "dev_generations": bleu["generations"]}


def to_markdown(study: dict) -> str:
    """The study table in Markdown (one row per finished recipe, in run order)."""
    s = study["settings"]
    lines = [f"Recipe study: {s['minutes']:g} min of optimizer steps per run, {s['speedup']:g}x schedule, "
             f"{s['heldout_mrs']} held-out E2E dev MRs ({study['n_heldout_pairs']} pairs), batch {s['batch_size']}.",
             "", "| recipe | start | KL teacher | steps (planned) | tokens | train min | val loss | dev BLEU "
                 "| realised speedup |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in study["recipes"].values():
        val = f"{row['val_loss']:.3f}" if row["val_loss"] is not None else "-"
        kl = row["config"].get("kl_weight") or 0
        teacher = "-" if not kl else ("1x" if row["config"].get("teacher") or row["init"] == "1x" else "start")
        planned = row.get("planned_steps", row["steps"])
        lines.append(f"| {row['recipe']} | {row['init']} | {teacher} | {row['steps']} ({planned}) | {row['tokens']} | "
                     f"{row['train_minutes']:.1f} | {val} | {row['dev_bleu']:.1f} | {row['dev_theoretical_speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(study: dict, path: Path) -> None:
    """PNG of validation loss (nats per response token) against train minutes, one line per recipe."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row in study["recipes"].values():
        pts = row["val_curve"]
        if pts:
            ax.plot([p["minutes"] for p in pts], [p["loss"] for p in pts], marker="o",
                    label=f"{row['recipe']} ({row['policy']}, BLEU {row['dev_bleu']:.1f})")
    s = study["settings"]
    ax.set_xlabel("train minutes (optimizer steps)")
    ax.set_ylabel("validation loss under the policy (nats/token)")
    ax.set_title(f"Recipe study: {s['minutes']:g} min per run, {s['speedup']:g}x, held-out dev MRs", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _load_study(path: Path, settings: dict) -> dict:
    if not path.exists():
        return {"settings": settings, "recipes": {}}
    study = json.loads(path.read_text())
    differ = [k for k in SETTINGS if study.get("settings", {}).get(k) != settings[k]]
    if differ:
        _die(f"--out {repo_relative(path)} holds a study with other settings ({', '.join(differ)}); "
             "use another --out or remove it")
    return study


def _save(study: dict, stem: Path) -> None:
    write_json_atomic(stem.with_suffix(".json"), study)
    stem.with_suffix(".md").write_text(to_markdown(study), encoding="utf-8")
    plot(study, stem.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    """Run the study described in the module docstring; returns 0 (exits 2 on bad input)."""
    args = _parse(argv)
    if args.list:
        for name, r in RECIPES.items():
            print(f"{name:15s} {r.description}")
        return 0
    _check_numbers(args)
    names = _selected(args.recipes)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from skipdecode.data import DataError, load_examples, shared_data_path
    from skipdecode.loading import LoadError
    from skipdecode.train import TrainConfigError

    try:
        data = shared_data_path(args.data, "e2e/devset.csv")
        split = split_by_mr(load_examples(data, task="e2e"), args.heldout_mrs, args.seed)
    except (DataError, ValueError) as e:
        _die(str(e))
    stem = Path(args.out) if args.out else RESULTS / "recipe_study"
    runs = Path(args.runs) if args.runs else ROOT / "runs" / "recipe_study"
    settings = {k: getattr(args, k) for k in SETTINGS if k != "data"}
    settings["data"] = repo_relative(data)
    study = _load_study(stem.with_suffix(".json"), settings)
    study.update(command=shlex.join(["python", "benchmarks/recipe_study.py", *(sys.argv[1:] if argv is None else argv)]),
                 n_train_pairs=len(split.train), n_heldout_pairs=len(split.heldout), heldout_mrs=split.heldout_mrs)
    for name in names:
        if name in study["recipes"] and (name != "1x" or (runs / "1x" / "final").is_dir()):
            print(f"[{time.strftime('%H:%M:%S')}] {name}: done already, skipped", file=sys.stderr)
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {RECIPES[name].description}", file=sys.stderr)
        try:
            study["recipes"][name] = run_recipe(args, name, split, runs)
        except TrainConfigError as e:
            _die(f"recipe {name}: {e}")
        except (DataError, LoadError) as e:
            _die(f"recipe {name}: {e}")
        study["recipes"] = {n: study["recipes"][n] for n in RECIPES if n in study["recipes"]}
        _save(study, stem)
    _save(study, stem)
    print(to_markdown(study))
    summary = {n: {"steps": r["steps"], "train_minutes": round(r["train_minutes"], 2), "val_loss": r["val_loss"],
                   "dev_bleu": r["dev_bleu"]} for n, r in study["recipes"].items()}
    print(dumps({"recipe_study": summary, "json": repo_relative(stem.with_suffix(".json"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
