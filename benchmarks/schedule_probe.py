"""Probe: does another schedule shape at the same mean budget serve a skip adapter better?

Greedy answers of the embedded model with a skip adapter on the held-out prompts of
``benchmarks/adapter_prompts.py``, under linear-decay schedules with the same mean of 15 of 30
layers over the 32-token horizon (and other warm-up counts), scored against the stock model at full
depth like ``benchmarks/adapter_agreement.py`` (exact share, ROUGE-L, realised speedup). No
retraining: the adapter keeps the schedule it was trained for, so this asks how far its layers
transfer. Also the stock model at full depth with int8 and int4 weights (the metric's noise floor).

    python benchmarks/schedule_probe.py [--adapter DIR] [--name schedule_probe]

Writes ``benchmarks/results/NAME.json`` and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import adapter_agreement as aa  # noqa: E402
import adapter_prompts  # noqa: E402

SHAPES = [(21, 9, 1), (19, 11, 1), (18, 12, 1), (17, 13, 1), (15, 15, 1), (24, 6, 1), (21, 9, 2), (21, 9, 3)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", default=None, help="LoRA folder (default: the shipped adapter)")
    ap.add_argument("--data", default=None, help="data folder (default ../shared/data or SKIPDECODE_DATA)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="schedule_probe")
    args = ap.parse_args(argv)
    import torch

    import skipdecode
    from skipdecode.policy import FullPolicy, LinearDecayPolicy

    torch.set_num_threads(args.threads)
    _, held = adapter_prompts.build_or_exit(args.data, mismatch="prompt set differs from the manifest:")
    prompts = [r["prompt"] for r in held]
    kw = {"max_new_tokens": 40, "batch_size": 16}
    ref = aa.run(skipdecode.load(adapter=False), prompts, FullPolicy(30), **kw)
    rows = {}

    def record(name: str, out: dict) -> None:
        rows[name] = {**aa.score(out, ref), "speedup": out["theoretical_speedup"], "layers": out["mean_active_layers"]}
        print(name, {k: round(v, 2) for k, v in rows[name].items()}, flush=True)

    for q in ("int8", "int4"):
        record(f"stock {q} full", aa.run(skipdecode.load(adapter=False, quantize=q), prompts, FullPolicy(30), **kw))
    adapted = skipdecode.load(adapter=args.adapter) if args.adapter else skipdecode.load()
    for mx, mn, w in SHAPES:
        policy = LinearDecayPolicy(num_layers=30, max_layers=mx, min_layers=mn, warmup_layers=w, horizon=32)
        record(f"adapted {mx}->{mn} warm-up {w}", aa.run(adapted, prompts, policy, **kw))
    out = HERE / "results" / f"{args.name}.json"
    report = {"command": "python benchmarks/schedule_probe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "adapter": aa.rel(args.adapter) if args.adapter else "shipped", "n_prompts": len(prompts), "rows": rows}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: round(v["rougeL"], 1) for k, v in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
