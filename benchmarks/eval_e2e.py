"""Quality and speed of fine-tuned SkipDecode checkpoints on E2E (or CNN/DM): the README's table.

One run of the evaluation harness (src/skipdecode/evaluate.py, same as ``skipdecode eval``) over
the full E2E test set (630 MRs, all references per MR) with:

* every checkpoint decoded with its own policy (from its ``skipdecode.json``) and at full depth
  (the full-depth row is each checkpoint's wall-clock reference; for the 2x checkpoint it is also
  the sanity row "a model taught one schedule, decoded at full depth");
* the stock model at full depth and under the *same* schedule as the 2x checkpoint (sanity row:
  skipping without fine-tuning collapses), unless ``--no-stock``;
* optionally CALM-style early exit (``--calm-threshold``, batch 1) on the 1x checkpoint.
* with a checkpoint labelled ``1x`` (a full-depth fine-tune) next to others, a second table of
  every row's speedups against the 1x checkpoint's full-depth row: the paper's baseline
  (``--baseline LABEL`` picks another, ``--baseline none`` drops it; ``Report.against``).

Writes ``benchmarks/results/eval_e2e.{json,md,png}`` (``eval_cnndm.*`` with ``--task cnndm``, which
reads the 80 articles of ``cnn_dailymail/cnndm_specbench80.jsonl``) and prints the Markdown table.

    python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --ckpt 2x=runs/e2e-2x/final \\
        --ckpt 3x=runs/e2e-3x/final --ckpt 5x=runs/e2e-5x/final --batch-size 16 --device cuda
    python benchmarks/eval_e2e.py --ckpt 2x=runs/e2e-2x/final --limit 16          # quick look
    python benchmarks/eval_e2e.py --ckpt 2x=runs/e2e-2x/final --no-stock --batch-size 32 \
        --static --name eval_e2e_static    # vs the default in-flight run: --name eval_e2e_inflight
    python benchmarks/eval_e2e.py --task cnndm --ckpt 2x=runs/e2e-2x/final --batch-size 16 --sort-by-length
    python benchmarks/eval_e2e.py --ckpt 1x=runs/e2e-1x/final --no-stock --calm-threshold 0.9 \\
        --batch-size 1 --name eval_e2e_calm   # the CALM-style baseline alone (batch 1)

A checkpoint given without ``LABEL=`` is labelled by its folder name. All options: ``--help``.
Exit status 2 with a one-line message on bad arguments, data or checkpoints.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DATA = {"e2e": "e2e/testset_w_refs.csv", "cnndm": "cnn_dailymail/cnndm_specbench80.jsonl"}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="eval_e2e.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--ckpt", action="append", default=[], metavar="[LABEL=]DIR",
                   help="fine-tuned checkpoint (repeatable), e.g. 2x=runs/e2e-2x/final")
    p.add_argument("--task", choices=sorted(DATA), default="e2e", help="dataset and metric set")
    p.add_argument("--data", default=None, help="eval file (default: the task's file in the shared data folder)")
    p.add_argument("--stock", default="smollm2-135m-instruct",
                   help="stock model for the sanity rows (id, dir or .gguf)")
    p.add_argument("--no-stock", action="store_true", help="leave out the stock-model rows")
    p.add_argument("--stock-speedup", type=float, default=2.0,
                   help="stock model's skip row: the schedule of the checkpoint labelled '<s>x', else for_speedup(s)")
    p.add_argument("--calm-threshold", type=float, action="append", default=[],
                   help="add a CALM early-exit row (batch 1) with this threshold (repeatable)")
    p.add_argument("--calm-min-layers", type=int, default=1, help="CALM: fewest layers before an exit")
    p.add_argument("--calm-model", default=None, help="label of the model that gets CALM rows (default: 1x, else the first)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 64 (E2E), 128 (CNN/DM)")
    p.add_argument("--limit", type=int, default=None, help="first N items only (quick runs), after --offset")
    p.add_argument("--offset", type=int, default=0,
                   help="skip the first N items (a shard; join shards with plot_eval.py --concat)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    p.add_argument("--name", default=None, help="output base name (default: eval_e2e / eval_cnndm)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--static", action="store_true",
                   help="static batches that wait for their longest item (default: in-flight batching, "
                        "--batch-size rows at most; compare the two with --name)")
    p.add_argument("--cohort-size", type=int, default=1,
                   help="in-flight: waiting items join the running rows in cohorts of at least this many "
                        "(1: every free slot at once; fewer distinct decode steps per batch when larger)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="in-flight: prefill every prompt in full (default: items sharing a prompt prefix, "
                        "e.g. the instruction, reuse its keys and values; same texts)")
    p.add_argument("--baseline", default=None, metavar="LABEL",
                   help="label of the model whose full-depth row every other row is also compared with "
                        "(the paper's baseline, a full-depth fine-tune; default: the checkpoint labelled "
                        "1x when there is one and another model; 'none': no such table)")
    p.add_argument("--sort-by-length", action="store_true",
                   help="batch prompts of similar length together (less padding; outputs stay in item order)")
    return p.parse_args(argv)


def _die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _checkpoints(specs: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep:
            label, path = Path(spec).name, spec
        path = Path(path).expanduser()
        if not path.is_dir():
            _die(f"--ckpt {spec}: {path} is not a directory")
        if label in out:
            _die(f"--ckpt label {label!r} is given twice")
        out[label] = path
    return out


def _stored_policy(path: Path) -> dict | None:
    try:
        return json.loads((path / "skipdecode.json").read_text()).get("policy")
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation described in the module docstring; returns 0 (exits 2 on bad input)."""
    args = _parse(argv)
    if args.batch_size < 1:
        _die(f"--batch-size must be >= 1, got {args.batch_size}")
    ckpts = _checkpoints(args.ckpt)
    if not ckpts and args.no_stock:
        _die("nothing to evaluate: give --ckpt and/or drop --no-stock")

    from skipdecode import load
    from skipdecode.data import DataError, load_eval_items, select_items, shared_data_path
    from skipdecode.evaluate import evaluate
    from skipdecode.loading import LoadError

    try:
        data = shared_data_path(args.data, DATA[args.task])
        items = list(load_eval_items(data, task=args.task))
    except DataError as e:
        _die(str(e))
    try:
        items = select_items(items, args.offset, args.limit, str(data))
    except ValueError as e:
        _die(str(e))

    def loader(target):
        def load_one():
            try:
                return load(target, device=args.device, dtype=args.dtype, adapter=False)  # the stock rows
            except (LoadError, ValueError) as e:
                _die(f"cannot load {target}: {e}")
        return load_one

    models, policies = {}, {}
    if not args.no_stock:
        label = "stock"
        models[label] = loader(None if args.stock == "smollm2-135m-instruct" else args.stock)
        same = ckpts.get(f"{args.stock_speedup:g}x")
        stored = _stored_policy(same) if same is not None else None
        name = f"{args.stock_speedup:g}x"
        policies[label] = [(f"{name} (= ckpt {name})", stored) if stored else args.stock_speedup]
    for label, path in ckpts.items():
        if label in models:
            _die(f"--ckpt label {label!r} clashes with the stock model's label")
        models[label] = loader(str(path))
        policies[label] = ["checkpoint"]
    baseline = args.baseline if args.baseline is not None else ("1x" if "1x" in ckpts and len(models) > 1 else "none")
    if baseline != "none" and (baseline not in models or len(models) < 2):
        _die(f"--baseline {baseline!r} must be the label of one of at least two models {list(models)} (or 'none')")
    calm_model = args.calm_model or ("1x" if "1x" in ckpts else next(iter(ckpts or models)))
    if args.calm_threshold and calm_model not in models:
        _die(f"--calm-model {calm_model!r} is not one of {list(models)}")

    command = shlex.join(["python", "benchmarks/eval_e2e.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        report = evaluate(
            models, items, policies, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
            task=args.task, calm_thresholds=args.calm_threshold, calm_min_layers=args.calm_min_layers,
            calm_models=[calm_model] if args.calm_threshold else None, progress=not args.no_progress,
            command=command, data=str(data), sort_by_length=args.sort_by_length, inflight=not args.static,
            cohort_size=args.cohort_size, prefix_cache=not args.no_prefix_cache,
        )
    except (DataError, ValueError) as e:
        _die(str(e))
    report.meta["checkpoints"] = {label: str(path) for label, path in ckpts.items()}
    if baseline != "none":
        report.set_baseline(baseline)
    paths = report.save(args.out, args.name or f"eval_{args.task}")
    print(report.to_markdown())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
