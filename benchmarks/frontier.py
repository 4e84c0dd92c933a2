"""The quality/speed frontier at equal training budgets (issue 9 section 3): the successor of the
training part of ``cpu_real_runs.sh``.

With one recipe of ``recipe_study.py`` (``--recipe``, default ``labels``) it fine-tunes one model
per target speedup (``--speedups``, default 1,2,3,5) and one mixed-policy model (``--mixed``,
default 2,3,5: each optimizer step draws one of them), every model for the same number of
examples (``--epochs`` of E2E dev, default 1; 5 % of the dev MRs are held out for the validation
loss), then evaluates each on the E2E test set (all 630 MRs unless ``--limit``; BLEU, NIST,
ROUGE-L, chrF; theoretical and decode-step speedup against the model's own full-depth row): the
single-speedup models with their own schedule, the mixed model at each of its speedups. Finally it
joins the reports and draws the frontier (BLEU against speedup).

Every step logs the minutes it took (``<name>_steps.json``). Steps already done are skipped (a
model whose ``final/`` exists, an evaluation whose report exists), so a killed run resumes.
``--deadline-minutes`` bounds the whole run: the training length is first cut (equally for every
model, from a measured s/step) so that training plus ``--eval-reserve-minutes`` fits, a training
step still running at the deadline stops (its model is then not evaluated), an evaluation still
running at the deadline stops, and steps that cannot start before it are skipped.

Outputs in ``--out`` (default benchmarks/results): ``<name>.{json,md,png}`` (the joined
evaluation and the frontier plot), ``<name>_eval_<model>.json`` (one report per model),
``<name>_train_<model>.json`` (training records), ``<name>_steps.json`` (the step log and the BLEU
gap to the equally trained 1x model). Prints the table, ends with one JSON line.

    python benchmarks/frontier.py --threads 2 --no-progress                       # one epoch each (2 cores: ~4.5 h)
    python benchmarks/frontier.py --recipe no-prompt-grad --epochs 2 --name frontier_2ep
    python benchmarks/frontier.py --recipe from-1x --lr 5e-4 --speedups 3 --mixed '' --name frontier_from1x
    python benchmarks/frontier.py --dry-run                                         # the plan only
    python benchmarks/frontier.py --device cuda --bf16 --eval-dtype bfloat16 --epochs 5 --batch-size 64 \\
        --eval-batch-size 128 --deadline-minutes 9                                   # benchmarks/gpu_frontier.sh
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_study import RECIPES  # noqa: E402
from study_common import (  # noqa: E402
    DeadlineReached,
    deadline_callback,
    repo_relative,
    seconds_per_step,
    write_json_atomic,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
COMPASS = {2.0: 1.0, 3.0: 2.0, 5.0: 4.0}  # issue 9: BLEU loss against the 1x model at most this


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="frontier.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipe", default="labels", help="recipe of recipe_study.py (not 1x)")
    p.add_argument("--speedups", default="1,2,3,5", help="one model per target speedup")
    p.add_argument("--mixed", default="2,3,5", help="speedups of the mixed-policy model ('' for none)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training pairs, every model")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate of every model, 1x included (default: the recipe's; 2e-4 where it sets none)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="base model: id, directory or .gguf")
    p.add_argument("--data", default=None, help="E2E dev CSV (default: <shared data>/e2e/devset.csv)")
    p.add_argument("--test-data", default=None, help="E2E test CSV (default: <shared data>/e2e/testset_w_refs.csv)")
    p.add_argument("--limit", type=int, default=None, help="first N test MRs only")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    p.add_argument("--name", default="frontier", help="base name of the results")
    p.add_argument("--runs", default=None, help="model folders (default: runs/<name>)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bf16", action="store_true", help="bf16 autocast in training")
    p.add_argument("--eval-dtype", default="float32", help="dtype of the evaluated models")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--deadline-minutes", type=float, default=None, help="stop everything by then")
    p.add_argument("--eval-reserve-minutes", type=float, default=3.0,
                   help="with a deadline: time kept for the evaluations")
    p.add_argument("--checkpoint-every", type=int, default=40,
                   help="checkpoint every N optimizer steps; a killed run resumes a model from its newest (0: restart it)")
    p.add_argument("--dry-run", action="store_true", help="print the plan (models, steps) and exit")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        _die(f"{option} must be a comma list of speedups >= 1 such as 2,3,5, got {text!r}")
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        _die(f"{option} must list distinct speedups >= 1, got {text!r}")
    return values


def _check(args: argparse.Namespace) -> None:
    if args.recipe not in RECIPES or args.recipe == "1x":
        _die(f"--recipe must be one of {', '.join(n for n in RECIPES if n != '1x')}, got {args.recipe!r}")
    if not args.epochs > 0:
        _die(f"--epochs must be > 0, got {args.epochs}")
    if args.lr is not None and not 0 < args.lr < 1:
        _die(f"--lr must be in (0, 1), got {args.lr}")
    for name in ("batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            _die(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        _die(f"--limit must be >= 1, got {args.limit}")
    if args.deadline_minutes is not None and not args.deadline_minutes > 0:
        _die(f"--deadline-minutes must be > 0, got {args.deadline_minutes}")


def plan(args: argparse.Namespace) -> list[dict]:
    """The models to train: ``[{"label", "speedups"}]``, 1x first (a recipe starting from, or
    distilling from, the 1x fine-tune needs it), the mixed-policy model last."""
    single = _floats(args.speedups, "--speedups")
    mixed = _floats(args.mixed, "--mixed")
    if RECIPES[args.recipe].needs_1x() and 1.0 not in single:
        single.insert(0, 1.0)
    models = [{"label": f"{s:g}x", "speedups": [s]} for s in sorted(single)]
    if len(mixed) == 1:
        _die("--mixed needs two or more speedups (one speedup is a single-policy model: use --speedups)")
    if mixed:
        models.append({"label": "mix" + "-".join(f"{s:g}" for s in mixed), "speedups": mixed})
    if not models:
        _die("nothing to train: --speedups and --mixed are both empty")
    return models


def _train_config(args: argparse.Namespace, entry: dict, run_dir: Path, epochs: float):
    """The TrainConfig of model ``entry`` in ``run_dir`` (beside the 1x model's folder)."""
    from skipdecode.train import TrainConfig

    overrides = dict(RECIPES[args.recipe].overrides)
    if RECIPES[args.recipe].teacher == "1x" and entry["speedups"] != [1.0]:
        overrides["teacher"] = str(run_dir.parent / "1x" / "final")  # KL to the equally trained 1x model
    if entry["speedups"] == [1.0]:  # the equally trained reference: the recipe without its skip-only parts
        overrides = {k: v for k, v in overrides.items() if k not in ("kl_weight", "warmup_layers")}
    sched = {"speedup": entry["speedups"][0]} if len(entry["speedups"]) == 1 else {"speedups": tuple(entry["speedups"])}
    kw = dict(out_dir=str(run_dir), task="e2e", epochs=epochs, batch_size=args.batch_size, max_length=args.max_length,
              lr=2e-4, val_fraction=0.05, max_val_examples=64, eval_every=0, chat=args.chat,
              checkpoint_every=args.checkpoint_every, save_total_limit=1, resume=args.checkpoint_every > 0,
              seed=args.seed, device=args.device, bf16=args.bf16, progress=not args.no_progress, **sched)
    kw.update(overrides)
    if args.lr is not None:  # one learning rate for every model, as the recipe's own would be
        kw["lr"] = args.lr
    return TrainConfig(**kw)


class Runner:
    """One frontier run: its settings, the step log and the deadline."""

    def __init__(self, args: argparse.Namespace, data: str, test_data: str) -> None:
        self.args, self.data, self.test_data = args, data, test_data
        self.out = Path(args.out) if args.out else RESULTS
        self.runs = Path(args.runs) if args.runs else ROOT / "runs" / args.name
        self.start = time.time()
        self.deadline = self.start + args.deadline_minutes * 60 if args.deadline_minutes else None
        self.steps_path = self.out / f"{args.name}_steps.json"
        self.log = {"command": shlex.join(["python", "benchmarks/frontier.py", *sys.argv[1:]]),
                    "recipe": args.recipe, "epochs_planned": args.epochs, "epochs": args.epochs, "steps": []}
        self.models = plan(args)
        if self.steps_path.exists():  # a resumed run keeps the earlier invocations' step log
            self.log["steps"] = json.loads(self.steps_path.read_text()).get("steps", [])

    def step(self, name: str, fn) -> dict:
        """Run ``fn`` as the step ``name``, log its status and minutes; returns the log entry."""
        t0 = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr)
        if self.deadline is not None and t0 >= self.deadline:
            status, info = "skipped: deadline", {}
        else:
            try:
                status, info = fn()
            except DeadlineReached as e:
                status, info = f"stopped: {e}", {}
            except ValueError as e:  # TrainConfigError, LoadError, DataError: this step fails, the others run
                status, info = f"failed: {e}", {}
        entry = {"step": name, "status": status, "minutes": (time.time() - t0) / 60, **info}
        self.log["steps"].append(entry)
        write_json_atomic(self.steps_path, self.log)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {status} ({entry['minutes']:.1f} min)", file=sys.stderr)
        return entry

    def base(self) -> str:
        """A plain checkpoint of the base model (later loads skip GGUF dequantisation)."""
        if Path(self.args.model).is_dir():
            return self.args.model
        path = self.runs / "base"

        def save():
            if (path / "config.json").exists():
                return "done already", {}
            import skipdecode

            skipdecode.load(self.args.model, adapter=False).save_pretrained(path)  # stock weights
            return "ok", {}
        self.step("base", save)
        return str(path)

    def resumed_epochs(self) -> bool:
        """On a resumed run, take ``epochs`` from a model already trained (so that every model sees
        the same examples even when the first invocation cut them); True when one was found."""
        for m in self.models:
            record = self.out / f"{self.args.name}_train_{m['label']}.json"
            if (self.runs / m["label"] / "final").is_dir() and record.exists():
                self.log["epochs"] = json.loads(record.read_text())["config"]["epochs"]
                self.log["epochs_from"] = m["label"]
                return True
        # a model stopped mid-way resumes from its checkpoint only with the epochs it started with
        started = [m["label"] for m in self.models if any((self.runs / m["label"]).glob("checkpoint-*"))]
        if started and self.steps_path.exists():
            previous = json.loads(self.steps_path.read_text())
            self.log["epochs"] = previous["epochs"]
            self.log["epochs_from"] = f"{started[0]} (checkpoint of an earlier invocation)"
            return True
        return False

    def fit_deadline(self, base: str) -> None:
        """Cut ``epochs`` (equally for all models) so that training fits before the deadline."""
        if self.resumed_epochs() or self.deadline is None:
            return
        import skipdecode
        from skipdecode.data import load_examples

        todo = [m for m in self.models if not (self.runs / m["label"] / "final").is_dir()]
        if not todo:
            return

        def calibrate():
            cfg = _train_config(self.args, todo[0], self.runs / "calibrate", self.args.epochs)  # 1x: the slowest
            sps = seconds_per_step(lambda: skipdecode.load(base, adapter=False), self.data, cfg, steps=2)
            steps_per_epoch = 0.95 * len(load_examples(self.data, task="e2e")) / self.args.batch_size
            left = self.deadline - time.time() - self.args.eval_reserve_minutes * 60
            affordable = left / (sps * len(todo) * steps_per_epoch * 1.15)  # 15 %: loading, validation, saving
            self.log["epochs"] = min(self.args.epochs, max(affordable, 0.0))
            return "ok", {"seconds_per_step": sps, "epochs": self.log["epochs"]}
        self.step("calibrate", calibrate)

    def train(self, base: str, entry: dict) -> None:
        """Train one model unless its ``final/`` exists; writes ``<name>_train_<label>.json``."""
        import skipdecode
        from skipdecode.train import train

        run_dir = self.runs / entry["label"]
        record_path = self.out / f"{self.args.name}_train_{entry['label']}.json"

        def go():
            if (run_dir / "final").is_dir():
                return "done already", {}
            if self.log["epochs"] <= 0:
                return "skipped: no time to train", {}
            start = base
            recipe = RECIPES[self.args.recipe]
            if entry["speedups"] != [1.0] and recipe.needs_1x():
                if not (self.runs / "1x" / "final").is_dir():
                    return "skipped: the 1x model is missing", {}
                if recipe.init == "1x":
                    start = str(self.runs / "1x" / "final")
            if self.args.checkpoint_every <= 0:  # no checkpoints to resume from: start clean
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
            # a run still going here would eat the evaluations' time: stop it (its model is lost)
            deadline = None if self.deadline is None else self.deadline - self.args.eval_reserve_minutes * 30
            result = train(skipdecode.load(start, adapter=False), self.data, _train_config(self.args, entry, run_dir, self.log["epochs"]),
                           callback=deadline_callback(deadline))
            rec = result.to_dict()
            rec.update(out_dir=repo_relative(rec["out_dir"]), final_dir=repo_relative(rec["final_dir"]),
                       resumed_from=rec["resumed_from"] and repo_relative(rec["resumed_from"]))
            for key in ("spec", "path"):  # the data file, relative to the repository (results stay portable)
                if isinstance(rec.get("data", {}).get(key), str):
                    rec["data"][key] = repo_relative(rec["data"][key])
            rec["config"]["out_dir"] = repo_relative(rec["config"]["out_dir"])
            write_json_atomic(record_path, rec)
            return "ok", {"train_steps": result.steps, "examples": result.examples_seen,
                          "train_minutes": result.train_seconds / 60, "record": repo_relative(record_path)}
        self.step(f"train {entry['label']}", go)

    def evaluate(self, entry: dict, items: list) -> None:
        """Evaluate one model on the test items unless its report exists."""
        import skipdecode
        from skipdecode.evaluate import evaluate

        label = entry["label"]
        path = self.out / f"{self.args.name}_eval_{label}.json"
        final = self.runs / label / "final"

        def go():
            if path.exists():
                return "done already", {}
            if not final.is_dir():
                return "skipped: no trained model", {}
            specs = ["checkpoint"] if len(entry["speedups"]) == 1 else [(f"{s:g}x", s) for s in entry["speedups"]]
            deadline = self.deadline

            def progress(done: int) -> None:
                if deadline is not None and time.time() > deadline:
                    raise DeadlineReached(f"deadline reached after {done} batches")
            report = evaluate({label: lambda: skipdecode.load(final, device=self.args.device, dtype=self.args.eval_dtype)},
                              items, {label: specs}, batch_size=self.args.eval_batch_size, task="e2e",
                              progress=(not self.args.no_progress) if deadline is None else progress,
                              command=self.log["command"], data=repo_relative(self.test_data))
            report.meta["checkpoints"] = {label: repo_relative(final)}
            report.meta["models"][label]["source"] = repo_relative(report.meta["models"][label]["source"])
            report.save(self.out, path.stem)
            return "ok", {"report": repo_relative(path)}
        self.step(f"eval {label}", go)

    def finish(self) -> dict:
        """Join the per-model reports, draw the frontier, log the BLEU gap to the 1x model."""
        from skipdecode.evaluate import Report, combine_reports

        labels = [m["label"] for m in self.models if (self.out / f"{self.args.name}_eval_{m['label']}.json").exists()]
        if not labels:
            return {}
        report = combine_reports([Report.load(self.out / f"{self.args.name}_eval_{lab}.json") for lab in labels])
        line = [(lab, "full" if lab == "1x" else "checkpoint") for lab in labels if not lab.startswith("mix")]
        report.save(self.out, self.args.name, frontier=line or None)
        print(report.to_markdown())
        return self.gaps(report)

    def gaps(self, report) -> dict:
        """Per skip row: BLEU, realised speedups, the BLEU gap to the equally trained 1x model's
        full-depth row and the issue's compass bound for the row's target speedup (2x: 1.0, 3x: 2.0,
        5x: 4.0 BLEU)."""
        ref = next((r for r in report.rows if r.model == "1x" and r.policy == "full"), None)
        out = {}
        for r in report.rows:
            if r.policy == "full" and r.model != "1x":
                continue
            target = r.model if r.policy == "checkpoint" else r.policy  # "2x" model, or mixed row "2x"
            try:
                target_speedup = float(target.rstrip("x"))
            except ValueError:
                target_speedup = None
            out[f"{r.model} {r.policy}"] = {
                "target_speedup": target_speedup, "bleu": r.scores["bleu"],
                "theoretical_speedup": r.theoretical_speedup, "decode_speedup": r.decode_speedup,
                "bleu_loss_vs_1x": None if ref is None else ref.scores["bleu"] - r.scores["bleu"],
                "compass_max_loss": COMPASS.get(target_speedup)}
        self.log["frontier"] = out
        write_json_atomic(self.steps_path, self.log)
        return out


def _data_paths(args: argparse.Namespace) -> tuple[str, str]:
    from skipdecode.data import DataError, shared_data_path

    try:
        return (shared_data_path(args.data, "e2e/devset.csv"),
                shared_data_path(args.test_data, "e2e/testset_w_refs.csv", option="--test-data"))
    except DataError as e:
        _die(str(e))


def main(argv: list[str] | None = None) -> int:
    """Run the frontier described in the module docstring; returns 0 (exits 2 on bad input)."""
    args = _parse(argv)
    _check(args)
    models = plan(args)
    data, test = _data_paths(args)
    from skipdecode.data import DataError, load_eval_items, load_examples, select_items

    try:
        n_pairs = len(load_examples(data, task="e2e"))
        items = select_items(list(load_eval_items(test, task="e2e")), 0, args.limit, test)
    except (DataError, ValueError) as e:
        _die(str(e))
    if args.dry_run:
        steps = math.ceil(args.epochs * 0.95 * n_pairs / args.batch_size)
        print(dumps({"recipe": args.recipe, "models": models, "train_pairs": n_pairs, "epochs": args.epochs,
                          "steps_per_model_about": steps, "test_items": len(items), "device": args.device}))
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    runner = Runner(args, data, test)
    runner.log["command"] = shlex.join(["python", "benchmarks/frontier.py", *(sys.argv[1:] if argv is None else argv)])
    base = runner.base()
    runner.fit_deadline(base)
    for entry in models:
        runner.train(base, entry)
    for entry in models:
        runner.evaluate(entry, items)
    gaps = runner.finish()
    steps = [{k: s[k] for k in ("step", "status", "minutes")} for s in runner.log["steps"]]
    failed = [f"{s['step']}: {s['status']}" for s in steps if s["status"].startswith("failed")]
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    print(dumps({"frontier": gaps, "steps": steps, "json": repo_relative(runner.steps_path)}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
