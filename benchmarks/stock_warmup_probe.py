"""Probe (issue 12): the shipped skip adapter with its first k decode steps run at full depth,
then its trained schedule from the start (``LinearDecayPolicy.full_depth_steps = k``).

Why: the adapted model at full depth agreed with the stock model only to ROUGE-L 54.1, and most
held-out answers part from the teacher in their first tokens, so the early, many-layer steps are
where agreement is lost (``docs/results.md``). A decode step that runs every layer runs the base
model's weights (:mod:`skipdecode.lowrank`), so the first k answer tokens are the stock model's
own; step ``k + j`` runs what the adapter's ``--speedup 2`` schedule runs at step ``j``. The cost
is k full-depth steps per answer, seen in the realised theoretical speedup. ``--keep-delta``
measures the same schedules with the adapter kept on at those steps (the static loop's
``skip_forward`` wrapped in this process to switch the base weights off again), which is what
shows that the base weights, not the extra layers, make the difference.

Scores as in ``benchmarks/adapter_agreement.py`` (static batches): identical answers, ROUGE-L
against the stock model's full-depth answers, first divergence.

    python benchmarks/stock_warmup_probe.py --ks 0,1,2,4,8,12 --threads 2
    python benchmarks/stock_warmup_probe.py --ks 2,4,8 --keep-delta --threads 2 --name stock_warmup_probe_keep_delta

Writes ``benchmarks/results/stock_warmup_probe.{json,md}`` (``--name`` changes the stem), prints
the table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import adapter_agreement as aa  # noqa: E402  (benchmarks/adapter_agreement.py)
import adapter_prompts  # noqa: E402
from skipdecode.jsonio import dumps  # noqa: E402


@contextmanager
def delta_kept_at_full_depth_steps(model):
    """Inside the block, the static loop's full-depth decode steps keep ``model``'s decode-only
    adapter on (the engine runs them with the base weights, :mod:`skipdecode.lowrank`): the
    ``skip_forward`` it calls is wrapped to switch the :class:`~skipdecode.lowrank.PrefillSwitch`
    off for calls with an ``active_layers`` plan (decode steps; the prefill passes none).
    Restores the function and the switch on exit."""
    from skipdecode.lowrank import SWITCH_ATTR

    gen = importlib.import_module("skipdecode.generate")  # the package exports a function of that name
    switch, orig = getattr(model, SWITCH_ATTR), gen.skip_forward

    def skip_forward(adapter, *args, **kwargs):
        if kwargs.get("active_layers") is None:
            return orig(adapter, *args, **kwargs)
        saved, switch.base = switch.base, False
        try:
            return orig(adapter, *args, **kwargs)
        finally:
            switch.base = saved

    gen.skip_forward = skip_forward
    try:
        yield
    finally:
        gen.skip_forward = orig


def _k_list(text: str) -> list[int]:
    """``"0,2,4"`` as ``[0, 2, 4]``; argparse reports an error with the option's name."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"takes comma-separated integers >= 0, e.g. 0,2,4; got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The shipped adapter after k stock full-depth decode steps.")
    ap.add_argument("--ks", default="0,1,2,4,8", type=_k_list, help="full-depth stock steps before the schedule")
    ap.add_argument("--keep-delta", action="store_true",
                    help="keep the LoRA delta on at the k full-depth steps (the adapted model's own full-depth "
                         "steps, a pure schedule change) instead of the stock weights")
    aa.add_common_args(ap, "stock_warmup_probe")
    args = ap.parse_args(argv)

    import torch

    import skipdecode
    from skipdecode.policy import FullPolicy

    train_rows, held = aa.common_setup(ap, args)
    held = held[: args.limit] if args.limit else held
    prompts = [r["prompt"] for r in held]
    kw = {"max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    stock = skipdecode.load(adapter=False)
    L = stock.num_layers
    ref = aa.run(stock, prompts, FullPolicy(L), **kw)
    del stock
    adapted = skipdecode.load()  # the shipped adapter
    base = replace(adapted.policy_for(speedup=2), full_depth_steps=0)
    rows = []
    with (delta_kept_at_full_depth_steps(adapted.model) if args.keep_delta else nullcontext()):
        for k in args.ks:
            policy = replace(base, full_depth_steps=k)
            out = aa.run(adapted, prompts, policy, **kw)
            row = {"k": k, "policy": policy.to_dict(), **aa.score(out, ref),
                   **{f: out[f] for f in ("mean_active_layers", "theoretical_speedup", "seconds", "texts")}}
            rows.append(row)
            print(f"k={k}: ROUGE-L {row['rougeL']:.1f}, identical {row['exact']:.1f} %, "
                  f"speedup {row['theoretical_speedup']:.2f}x ({row['seconds']:.0f} s)", flush=True)
    md = ["Held-out prompts: %d, greedy, chat template, at most %d new tokens; reference = the stock model at "
          "full depth; the shipped adapter's 2x schedule (%s) after k full-depth decode steps (%s weights)."
          % (len(prompts), args.max_new_tokens, aa._schedule(base.to_dict()),
             "adapted" if args.keep_delta else "stock"), "",
          "| k (full-depth steps) | identical answers | ROUGE-L vs full depth | first divergence (tokens) | "
          "mean active layers | theoretical speedup |", "|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['k']} | {r['exact']:.1f} % | {r['rougeL']:.1f} | {r['first_divergence']:.1f} | "
           f"{r['mean_active_layers']:.2f}/{L} | {r['theoretical_speedup']:.2f}x |" for r in rows]
    report = {"name": args.name,
              "command": " ".join(["python benchmarks/stock_warmup_probe.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": skipdecode.DEFAULT_MODEL, "adapter": "skipdecode/skip_adapters/smollm2-135m-instruct (package data)",
              "n_prompts": len(prompts), "full_depth_steps_weights": "adapted" if args.keep_delta else "stock", "heldout_sha256": adapter_prompts.manifest(train_rows, held)["splits"]["heldout"]["sha256"],
              "data_dir": "../shared/data" if args.data is None else aa.rel(args.data),
              "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "num_layers": L,
              "versions": {"torch": torch.__version__}, "rows": rows}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.json").write_text(dumps(report, indent=1, ensure_ascii=False) + "\n")
    (out_dir / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(dumps({f"k={r['k']}": {"rougeL": round(r["rougeL"], 1), "speedup": round(r["theoretical_speedup"], 2)}
                 for r in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
