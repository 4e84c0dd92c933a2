"""Agreement of skipped decoding with the stock full-depth model on the held-out prompts (issue 12).

For the embedded SmolLM2-135M-Instruct, greedy, chat template, on the held-out split of
``benchmarks/adapter_prompts.py`` (never trained on): the stock model at full depth writes the
reference answers; then each configuration answers the same prompts and is scored against them:

* ``exact``: share of answers identical to the reference (token for token), in %;
* ``rougeL``: ROUGE-L F-measure against the reference answer (rouge-score, stemmed, 0-100,
  :func:`skipdecode.metrics.rouge`);
* ``first_divergence``: mean index of the first token that differs from the reference (tokens);
* mean active layers per decode step and the realised theoretical speedup
  (L x decode steps / layers run, over all batches).

Rows: stock at 2x, adapted at 2x, adapted at 3x, adapted at full depth (and stock at full depth,
the reference itself). When the adapter has an entry bridge (:mod:`skipdecode.entry_bridge`),
also the stock model with that bridge and no LoRA at 2x (``--no-bridge-ablation`` drops it). With ``--calibrate`` (default) also the stock model at full depth with int8
weights: a model anyone would call the same one, whose answers still drift from the float32 ones
a few tokens in; its ROUGE-L is the metric's noise floor. The adapted model's 2x and 3x are what
``--speedup 2`` / ``3`` runs for it (:meth:`skipdecode.model.SkipModel.policy_for`): the schedule the
adapter was trained with for that speedup when its ``skipdecode.json`` has one, else
:func:`skipdecode.policy.for_speedup` with the adapter's horizon (2x: 21 -> 9 layers over 32 tokens).
The stock model's 2x is ``for_speedup`` (what ``--no-adapter --speedup 2`` runs). The table's
schedule column gives each row's layers.

    python benchmarks/adapter_agreement.py                          # the shipped adapter
    python benchmarks/adapter_agreement.py --adapter runs/skip-adapter/final

Writes ``benchmarks/results/adapter_agreement.{json,md}`` (``--name`` changes the stem), prints
the Markdown table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import adapter_prompts  # noqa: E402  (benchmarks/adapter_prompts.py)
from skipdecode.jsonio import dumps  # noqa: E402  strict JSON (NaN/inf -> null)


def rel(path: str | Path) -> str:
    """``path`` relative to the repository when it lies inside it, else as given."""
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def run(sk, prompts: list[str], policy, *, max_new_tokens: int, batch_size: int) -> dict:
    """Greedy answers for ``prompts`` (in order) under ``policy``, batched by prompt length.

    Returns ``{"texts", "token_ids", "mean_active_layers", "theoretical_speedup", "seconds"}``;
    the speedup is L x decode steps / layers run, summed over batches."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: list[str | None] = [None] * len(prompts)
    ids: list[list[int] | None] = [None] * len(prompts)
    steps = layers = 0.0
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        res = sk.generate([prompts[i] for i in chunk], policy=policy, max_new_tokens=max_new_tokens, chat=True)
        s = res.stats()
        steps += s["decode_steps"]
        layers += s["mean_active_layers"] * s["decode_steps"]
        for i, text, tok in zip(chunk, res.texts, res.token_ids):
            texts[i], ids[i] = text, list(tok)
    return {"texts": texts, "token_ids": ids, "mean_active_layers": layers / steps if steps else 0.0,
            "theoretical_speedup": sk.num_layers * steps / layers if layers else 1.0,
            "seconds": time.perf_counter() - t0}


def command_line(argv: list[str]) -> str:
    """The command that reruns this script with ``argv``, quoted for a POSIX shell (an empty
    ``--speedups ''`` stays an argument)."""
    return shlex.join(["python", "benchmarks/adapter_agreement.py", *argv])


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where ``a`` and ``b`` differ (tokens); the shorter length when one
    is a prefix of the other (equal answers: their length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def score(out: dict, ref: dict) -> dict:
    """Exact-match share (%), ROUGE-L (0-100) and mean first divergence (tokens) of ``out``
    against ``ref``."""
    from skipdecode.metrics import rouge

    exact = sum(a == b for a, b in zip(out["token_ids"], ref["token_ids"])) / len(ref["token_ids"])
    div = [first_divergence(a, b) for a, b in zip(out["token_ids"], ref["token_ids"])]
    return {"exact": 100 * exact, "rougeL": rouge(out["texts"], [[t] for t in ref["texts"]])["rougeL"],
            "first_divergence": sum(div) / len(div)}


def _sha256_dir(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in (".safetensors", ".json"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _schedule(policy: dict | None) -> str:
    """A policy dict as ``"25->5 over 32"`` (linear decay; ``"2 x 30, then 25->5 over 32"`` with
    full-depth first steps), ``"all"`` (full depth) or ``""``."""
    if not policy:
        return ""
    if policy.get("type") == "linear_decay":
        first = f"{policy['full_depth_steps']} x {policy['num_layers']}, then " if policy.get("full_depth_steps") else ""
        return f"{first}{policy['max_layers']}->{policy['min_layers']} over {policy['horizon']}"
    return "all" if policy.get("type") == "full" else ""


def to_markdown(report: dict, n_examples: int = 4) -> str:
    """The table and a few side-by-side examples."""
    what = ("Training prompts (a seeded sample; the adapter was trained on them)" if report.get("split") == "train"
            else "Held-out prompts")
    lines = [f"{what}: {report['n_prompts']}" + (" (never trained on)" if report.get("split") != "train" else "")
             + ", greedy, chat template, "
             f"at most {report['max_new_tokens']} new tokens; reference = the stock model at full depth.", "",
             "| model | policy | schedule (layers) | identical answers | ROUGE-L vs full depth | "
             "first divergence (tokens) | mean active layers | theoretical speedup |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        div = f"{r['first_divergence']:.1f}" if "first_divergence" in r else ""
        lines.append(f"| {r['model']} | {r['policy_label']} | {_schedule(r.get('policy'))} | {r['exact']:.1f} % | "
                     f"{r['rougeL']:.1f} | {div} | "
                     f"{r['mean_active_layers']:.2f}/{report['num_layers']} | {r['theoretical_speedup']:.2f}x |")
    lines += ["", "Examples (held-out prompts):", ""]
    by = {(r["model"], r["policy_label"]): r for r in report["rows"]}
    show = [("stock", "full"), ("stock", "2x")]
    show += [(r["model"], r["policy_label"]) for r in report["rows"]
             if r["model"].startswith("adapted") and r["policy_label"] != "full"][:2]
    head = "| prompt | " + " | ".join(f"{m} {p}" for m, p in show) + " |"
    lines += [head, "|" + "---|" * (len(show) + 1)]

    def cell(t: str) -> str:
        return t.replace("|", "\\|").replace("\n", " ").strip()

    for i in report["example_indices"][:n_examples]:
        row = [cell(report["prompts"][i]["prompt"][:120])]
        row += [cell(by[k]["texts"][i]) if k in by else "" for k in show]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _speedup_list(text: str) -> list[float]:
    """``"2,3"`` as ``[2.0, 3.0]`` ("" gives none); argparse reports the error with the option's name."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers >= 1, e.g. 2,3; got {text!r}") from None
    if any(not v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers >= 1, e.g. 2,3; got {text!r}")
    return values


def _schedule_list(text: str) -> list[tuple[int, int, int | None]]:
    """``"25:7,25:10:32"`` as ``[(25, 7, None), (25, 10, 32)]``: MAX:MIN layers, and optionally the
    decay horizon in tokens (None: the adapter's); "" gives none. argparse reports the error with
    the option's name. The model's own checks (bounds within its layers) run when the policy is built."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) < int(parts[1]):
            raise argparse.ArgumentTypeError(
                "takes comma-separated MAX:MIN layer pairs with MAX >= MIN >= 1, each optionally with :HORIZON "
                f"tokens >= 1, e.g. 25:7,25:10:32; got {text!r}")
        out.append((int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
    return out


def add_common_args(ap: argparse.ArgumentParser, name: str) -> None:
    """The options every agreement probe shares (``--data``, ``--max-new-tokens``, ``--batch-size``,
    ``--limit``, ``--threads``, ``--name`` defaulting to ``name``, ``--out``)."""
    ap.add_argument("--data", default=None, help="data folder (default ../shared/data or SKIPDECODE_DATA)")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts (smoke test)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default=name)
    ap.add_argument("--out", default=str(HERE / "results"))


def common_setup(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Check ``--limit``, ``--batch-size`` and ``--max-new-tokens`` (``ap.error``), write a
    ``--limit`` run under ``NAME_limitN`` unless ``--name`` is given (a smoke test never overwrites
    the committed results), set ``--threads``, and build the prompt splits ``(train, heldout)``
    checked against the committed manifest (exit 1 on a mismatch, 2 without data)."""
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be >= 1 (leave it out for every prompt), got {args.limit}")
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if args.limit and args.name == ap.get_default("name"):  # a smoke test keeps the committed results
        args.name = f"{args.name}_limit{args.limit}"
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return adapter_prompts.build_or_exit(args.data, mismatch="prompt set differs from the manifest:")


def _parser() -> argparse.ArgumentParser:
    """The script's options (those of :func:`add_common_args` included)."""
    ap = argparse.ArgumentParser(description="Agreement with the stock full-depth model on held-out prompts.")
    ap.add_argument("--adapter", default=None, help="LoRA folder (default: the adapter shipped in the package)")
    ap.add_argument("--speedups", default="2,3", type=_speedup_list,
                    help="adapted-model speedups to measure (each as --speedup S runs it: the adapter's trained "
                         "schedule for S, else for_speedup; '' for none)")
    ap.add_argument("--trained-policy", action="store_true",
                    help="also measure the adapted model under its checkpoint's own trained schedule")
    ap.add_argument("--schedules", default="", type=_schedule_list,
                    help="also measure the adapted model under these linear decays, MAX:MIN layers over the "
                         "adapter's horizon, or MAX:MIN:HORIZON over HORIZON tokens (e.g. 25:7,25:9: the trained "
                         "25 -> 5 with a higher floor); the adapter's full-depth steps stay")
    ap.add_argument("--split", choices=["heldout", "train"], default="heldout",
                    help="prompt split to measure on; train: a seeded sample of --train-sample training prompts "
                         "(how well the adapter fits what it was taught, against held-out: how it generalizes)")
    ap.add_argument("--train-sample", type=int, default=77, help="with --split train: prompts sampled (seed 0)")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None,
                    help="load the adapted model with these weights (the reference stays the float32 stock model)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="load the adapted model in this dtype (the reference stays the float32 stock model); "
                         "bfloat16 also adds the stock model at full depth in bfloat16 (what the dtype alone moves)")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="add the stock model at full depth with int8 weights: how far a model everyone would "
                         "call the same one lands on this metric (its noise floor)")
    ap.add_argument("--bridge-ablation", action=argparse.BooleanOptionalAction, default=True,
                    help="when the adapter has an entry bridge, add the stock model with that bridge and no "
                         "LoRA at 2x (what the bridge alone does)")
    add_common_args(ap, "adapter_agreement")
    return ap


def _measured_rows(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The prompt splits ``(train, measured)``: :func:`common_setup`, then ``--split`` and ``--limit``."""
    train_rows, held_rows = common_setup(ap, args)
    if args.train_sample < 1:
        ap.error(f"--train-sample must be >= 1, got {args.train_sample}")
    if args.split == "train":  # measure on what was trained on; the manifest check above still ran
        import random
        held_rows = random.Random(0).sample(train_rows, min(args.train_sample, len(train_rows)))
    if args.limit:
        held_rows = held_rows[: args.limit]
    return train_rows, held_rows


def _configs(ap: argparse.ArgumentParser, args: argparse.Namespace, stock, adapted, adapter_path: Path) -> list[tuple]:
    """The rows to measure, reference first, as ``(model name, policy label, model, policy, entry bridge)``."""
    import skipdecode
    from skipdecode.entry_bridge import EntryBridge, entry_bridge_files
    from skipdecode.policy import FullPolicy, for_speedup

    adapted_name = " ".join(["adapted", *([args.quantize] if args.quantize else []),
                             *([args.dtype] if args.dtype != "float32" else [])])
    horizon = adapted.horizon
    L = stock.num_layers
    configs = [("stock", "full", stock, FullPolicy(L), None), ("stock", "2x", stock, for_speedup(L, 2, horizon), None)]
    if entry_bridge_files(adapter_path) and args.bridge_ablation:  # what the bridge alone does, no LoRA
        configs.append(("stock + entry bridge", "2x", stock, for_speedup(L, 2, horizon), EntryBridge.load(adapter_path)))
    # rows whose model is loaded when their turn comes (a callable in place of the model)
    if args.calibrate:
        configs.append(("stock int8", "full", lambda: skipdecode.load(adapter=False, quantize="int8"), FullPolicy(L), None))
    if args.dtype != "float32":
        configs.append((f"stock {args.dtype}", "full", lambda: skipdecode.load(adapter=False, dtype=args.dtype),
                        FullPolicy(L), None))
    for s in args.speedups:
        # the schedule the adapter was trained with for s (SkipModel.trained_policy), else for_speedup
        configs.append((adapted_name, f"{s:g}x", adapted, adapted.policy_for(speedup=s), None))
    if args.trained_policy:  # the checkpoint's own schedule, e.g. one trained with --max-layers/--min-layers
        p = adapted.policy
        label = f"trained {p.max_layers}->{p.min_layers}" if hasattr(p, "max_layers") else "trained (full)"
        configs.append((adapted_name, label, adapted, p, None))
    for hi, lo, horizon in args.schedules:  # explicit decays, e.g. the trained schedule with a higher floor
        item = f"{hi}:{lo}" + (f":{horizon}" if horizon else "")
        try:
            p = adapted.policy_for(max_layers=hi, min_layers=lo, horizon=horizon)
        except ValueError as e:
            ap.error(f"--schedules {item}: {e}")
        configs.append((adapted_name, f"{hi}->{lo}" + (f" over {horizon}" if horizon else ""), adapted, p, None))
    configs.append((adapted_name, "full", adapted, FullPolicy(L), None))
    return configs


def _measure(configs: list[tuple], prompts: list[str], **kw) -> list[dict]:
    """Run each config on ``prompts`` and score it against the first (the reference), printing a line each."""
    from skipdecode.entry_bridge import attach_entry_bridge

    rows, ref = [], None
    for model_name, label, sk, policy, bridge in configs:
        if callable(sk):
            sk = sk()
        if bridge is not None:
            attach_entry_bridge(sk.model, bridge)
        out = run(sk, prompts, policy, **kw)
        if bridge is not None:
            attach_entry_bridge(sk.model, None)
        if ref is None:
            ref = out
        row = {"model": model_name, "policy_label": label, "policy": policy.to_dict(), **score(out, ref),
               **{k: out[k] for k in ("mean_active_layers", "theoretical_speedup", "seconds", "texts")}}
        rows.append(row)
        print(f"{model_name} {label}: identical {row['exact']:.1f} %, ROUGE-L {row['rougeL']:.1f}, "
              f"speedup {row['theoretical_speedup']:.2f}x ({row['seconds']:.0f} s)", flush=True)
    return rows


def _example_indices(rows: list[dict]) -> list[int]:
    """Indices of the first prompt of each source kind, in order."""
    seen, examples = set(), []
    for i, r in enumerate(rows):
        if r["source"] not in seen:
            seen.add(r["source"])
            examples.append(i)
    return examples


def _report(args: argparse.Namespace, argv: list[str] | None, adapter_path: Path, train_rows: list[dict],
            held_rows: list[dict], rows: list[dict], *, num_layers: int, horizon: int) -> dict:
    """The results record: the run's settings, the measured prompts and the scored rows."""
    import torch

    import skipdecode

    m = adapter_prompts.manifest(train_rows, held_rows)["splits"]["heldout"]  # sha256 of the prompts measured
    shipped = args.adapter is None
    return {
        "name": args.name, "command": command_line(argv if argv is not None else sys.argv[1:]),
        "model": skipdecode.DEFAULT_MODEL, "num_layers": num_layers, "horizon": horizon,
        "adapter": "skipdecode/skip_adapters/smollm2-135m-instruct (package data)" if shipped else rel(adapter_path),
        "adapter_sha256": _sha256_dir(adapter_path), "n_prompts": len(held_rows),
        "split": args.split, "heldout_sha256": m["sha256"], "prompt_builder": "benchmarks/adapter_prompts.py",
        "data_dir": "../shared/data" if args.data is None else rel(args.data),
        "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "greedy": True, "chat": True,
        "quantize": args.quantize, "dtype": args.dtype,
        "versions": {"torch": torch.__version__, "skipdecode": getattr(skipdecode, "__version__", None)},
        "prompts": held_rows, "example_indices": _example_indices(held_rows), "rows": rows,
    }


def _write_results(report: dict, out_dir: Path) -> str:
    """Write ``NAME.json`` and ``NAME.md`` into ``out_dir``; returns the Markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{report['name']}.json").write_text(dumps(report, indent=1, ensure_ascii=False) + "\n")
    md = to_markdown(report)
    (out_dir / f"{report['name']}.md").write_text(md)
    return md


def _summary(rows: list[dict]) -> dict:
    """The final JSON line: exact share, ROUGE-L and speedup per row."""
    return {r["model"] + " " + r["policy_label"]: {"exact": round(r["exact"], 1), "rougeL": round(r["rougeL"], 1),
                                                  "speedup": round(r["theoretical_speedup"], 2)} for r in rows}


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    import skipdecode
    from skipdecode.skip_adapter import shipped_adapter_for

    train_rows, held_rows = _measured_rows(ap, args)
    prompts = [r["prompt"] for r in held_rows]
    adapter_path = Path(args.adapter) if args.adapter else shipped_adapter_for(skipdecode.DEFAULT_MODEL)
    if adapter_path is None:
        print("no shipped adapter found; pass --adapter DIR", file=sys.stderr)
        return 1

    stock = skipdecode.load(adapter=False)
    adapted = skipdecode.load(adapter=str(adapter_path), quantize=args.quantize, dtype=args.dtype)
    configs = _configs(ap, args, stock, adapted, adapter_path)
    rows = _measure(configs, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    report = _report(args, argv, adapter_path, train_rows, held_rows, rows,
                     num_layers=stock.num_layers, horizon=adapted.horizon)
    print(_write_results(report, Path(args.out)))
    print(dumps(_summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
