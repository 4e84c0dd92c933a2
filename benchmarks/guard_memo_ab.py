"""Guard memo on against off, in one process: what skipping dynamo's guard check saves per step.

For each ``--variants`` entry (float32, w8a8, int4; all ``compile=True``) one model is loaded and
warmed up; then ``--repeats`` rounds, alternating which setting goes first, each time a greedy
batch-1 generation of ``--new-tokens`` tokens at full depth and under the generic ``--speedup``
policy with the memo on (:mod:`skipdecode.guard_memo`) and with it off (every compiled call
through dynamo's guard check, the behaviour before stop 40). Step time = the generation's decode
seconds / decode steps (``GenerationResult.stats``), in milliseconds; the table gives medians and
the wall / theoretical speedup of each setting. Alternating in one process removes most of the
host's drift between runs, which separate benchmark runs cannot.

Prints a Markdown table, writes ``benchmarks/results/<name>.json`` (repo-relative paths) and a
PNG of the median step times, and ends with one JSON line.

    python benchmarks/guard_memo_ab.py --variants float32,w8a8,int4 --repeats 4 --name guard_memo_ab_stop40
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from server_load import report  # noqa: E402  (table, JSON and PNG the same way as the load benchmarks)

PROMPT = "Describe the restaurant: name[The Eagle], eatType[coffee shop], food[French], priceRange[moderate]"
VARIANTS = {"float32": None, "w8a8": "w8a8", "int4": "int4"}


def measure(quantize: str | None, speedup: float, repeats: int, new_tokens: int) -> list[dict]:
    """Rows ``{variant, policy, memo, step_ms_runs, step_ms, mean_layers}`` for one variant."""
    from skipdecode import load
    from skipdecode.policy import FullPolicy

    sk = load(None, adapter=False, quantize=quantize, compile=True)
    memos = sk.compile_report.memos

    def use_memo(on: bool) -> None:  # off: no keys, every call through dynamo's check
        for m in memos:
            m.enabled = on
    policies = {"full": FullPolicy(sk.adapter.num_layers), f"{speedup:g}x": sk.policy_for(speedup=speedup)}
    times = {(m, p): [] for m in ("on", "off") for p in policies}
    layers = {}

    def step(policy) -> tuple[float, float]:
        stats = sk.generate(PROMPT, max_new_tokens=new_tokens, policy=policy).stats()
        return 1e3 * stats["decode_seconds"] / stats["decode_steps"], stats["mean_active_layers"]

    try:
        for on in (True, False):  # untimed: both paths compiled and memoised
            use_memo(on)
            for policy in policies.values():
                step(policy)
        for r in tqdm(range(repeats), desc=f"{quantize or 'float32'}: rounds", file=sys.stderr):
            for memo in (("on", "off") if r % 2 == 0 else ("off", "on")):
                use_memo(memo == "on")
                for name, policy in policies.items():
                    ms, layers[name] = step(policy)
                    times[(memo, name)].append(ms)
    finally:
        use_memo(True)
    return [{"variant": quantize or "float32", "policy": p, "memo": m, "mean_layers": layers[p],
             "step_ms_runs": v, "step_ms": statistics.median(v)} for (m, p), v in times.items()]


def bar_chart(png: Path, groups: list[str], series: dict[str, list[float]], title: str) -> None:
    """Grouped bars of median ms per decode step: one group per ``groups`` label, one bar per
    ``series`` entry (label -> a value per group); saved to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(series), 1)
    for i, (label, ms) in enumerate(series.items()):
        ax.bar([j + width * i for j in range(len(groups))], ms, width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], groups)
    ax.set_ylabel("ms per decode step (batch 1, median)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot(result: dict, png: Path) -> None:
    """Median step time per variant and policy, memo on and off."""
    rows = result["rows"]
    cells = sorted({(r["variant"], r["policy"]) for r in rows}, key=lambda c: (c[0], c[1] != "full"))
    series = {f"guard memo {memo}": [next(r["step_ms"] for r in rows if (r["variant"], r["policy"], r["memo"]) == (*c, memo))
                                     for c in cells] for memo in ("off", "on")}
    bar_chart(png, [f"{v}\n{p}" for v, p in cells], series, "compile=True: guard memo on against off, one process per variant")


def add_run_options(ap: argparse.ArgumentParser, repeats: int, name: str) -> None:
    """``--speedup``, ``--repeats``, ``--new-tokens``, ``--threads`` and ``--name`` (the in-process A/B benchmarks')."""
    ap.add_argument("--speedup", type=float, default=3.0, help="the skipping policy's target speedup (>= 1)")
    ap.add_argument("--repeats", type=int, default=repeats, help="rounds (>= 1)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens per generation (>= 3)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--name", default=name, help="results file name (no extension)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="float32,w8a8,int4", help="comma-separated: float32, w8a8, int4")
    add_run_options(ap, 4, "guard_memo_ab")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        ap.error(f"--variants takes {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.repeats < 1 or args.new_tokens < 3 or not args.speedup >= 1:
        ap.error("--repeats must be >= 1, --new-tokens >= 3 and --speedup >= 1")
    torch.set_num_threads(args.threads)
    rows = [row for v in names for row in measure(VARIANTS[v], args.speedup, args.repeats, args.new_tokens)]
    lines = ["| variant | policy | mean layers | memo off (ms) | memo on (ms) | on / off | wall / theoretical off / on |",
             "|---|---|---:|---:|---:|---:|---:|"]
    pol = f"{args.speedup:g}x"
    for v in names:
        get = lambda p, m: next(r for r in rows if (r["variant"], r["policy"], r["memo"]) == (v, p, m))  # noqa: E731
        for p in ("full", pol):
            off, on = get(p, "off"), get(p, "on")
            wot = ""
            if p != "full":
                theo = get("full", "on")["mean_layers"] / on["mean_layers"]
                wot = " / ".join(f"{get('full', m)['step_ms'] / get(p, m)['step_ms'] / theo:.2f}" for m in ("off", "on"))
            lines.append(f"| {v} | {p} | {on['mean_layers']:.1f} | {off['step_ms']:.2f} | {on['step_ms']:.2f} | "
                         f"{on['step_ms'] / off['step_ms']:.2f} | {wot} |")
    path = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    result = {"benchmark": "guard_memo_ab", "model": "embedded SmolLM2-135M-Instruct", "batch_size": 1,
              "new_tokens": args.new_tokens, "speedup": args.speedup, "repeats": args.repeats, "threads": args.threads,
              "torch": torch.__version__, "rows": rows, "command": shlex.join(["python", "benchmarks/guard_memo_ab.py", *sys.argv[1:]]),
              "results_file": os.path.relpath(path, ROOT)}
    report(result, path, plot, "\n".join(lines), [])


if __name__ == "__main__":
    main()
