"""Weight variants against each other in one process, round-robin: step times without the drift
between separate runs.

Separate benchmark runs of each variant (``skipdecode bench --variants``) sit minutes apart,
and this host's speed moves by 10-30 % between them, so a comparison across variants, or a
wall/theoretical ratio, can swing with the host. Here every ``--variants`` entry (a
:func:`skipdecode.bench_engines.parse_variants` item: float32, int8, int4, w8a8 or head, each
optionally ``+compile``) is built from one loaded model and kept in memory; then ``--repeats``
rounds, each running every (variant, policy) once in a rotated order: a greedy batch-1 generation
of ``--new-tokens`` tokens at full depth and under the generic ``--speedup`` policy. Step time =
the generation's decode seconds / decode steps (``GenerationResult.stats``), in milliseconds.

Reported per variant: median step time per policy, the wall/theoretical speedup from those
medians, and the median over rounds of each round's own full / skipped ratio (both measured
within seconds of each other) over the theoretical speedup. With ``--layer-sweep 1,5,10,20,30``
the rounds also run plans of a constant n layers, and a least-squares line through their medians
splits a step into a cost per layer and a fixed cost per step that no skipping removes (the
head, sampling, the step's Python), with the wall/theoretical that line predicts and the largest
fixed cost that still allows 0.85 (issue 11's target). Prints a Markdown table, writes
``benchmarks/results/<name>.json`` (repo-relative paths) and a PNG, and ends with one JSON line.

    python benchmarks/variant_ab.py --variants float32+compile,head+compile,w8a8+compile,int4+compile --repeats 15 --name variant_ab_stop41
    python benchmarks/variant_ab.py --variants head+compile,w8a8+compile --layer-sweep 1,5,10,20,30 --repeats 12
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from guard_memo_ab import PROMPT, add_run_options, bar_chart  # noqa: E402  (shared with the guard-memo A/B)
from server_load import report  # noqa: E402  (table, JSON and PNG the same way as the load benchmarks)


def build(names: list[str], check: Callable[[object], None] = lambda base: None) -> tuple[dict, object]:
    """``{name: SkipModel}`` for each parsed variant, all from one load of the embedded model;
    ``check(base)`` runs on the loaded model before any variant is built (and may exit)."""
    from skipdecode import load
    from skipdecode.bench_engines import build_variant, parse_variants

    base = load(None, adapter=False)
    check(base)
    models = {}
    for name, quantize, compile_mode in parse_variants(",".join(names)):
        variant, report_ = build_variant(base, quantize, compile_mode)
        if report_ is not None and not report_.enabled:
            raise SystemExit(f"error: {name}: compilation fell back to eager: {report_.error}")
        models[name] = variant
    return models, base


def sweep_policies(num_layers: int, counts: Sequence[int], warmup_layers: int) -> dict:
    """``{"<n> layers": policy}``: every decode step runs the same ``n`` layers, the bottom
    ``min(warmup_layers, n - 1)`` and the top rest, as the skipping policy's layers (a
    :class:`~skipdecode.policy.LinearDecayPolicy` with ``max_layers = min_layers = n``).

    Raises:
        ValueError: a count outside 1..``num_layers`` (from the policy, naming the field).
    """
    from skipdecode.policy import LinearDecayPolicy

    return {f"{n} layers": LinearDecayPolicy(num_layers, n, n, min(warmup_layers, n - 1)) for n in counts}


def measure(models: dict, speedup: float, repeats: int, new_tokens: int, sweep: Sequence[int] = ()) -> list[dict]:
    """Rows ``{variant, policy, mean_layers, step_ms_runs, step_ms}`` for full depth, the
    ``speedup`` policy and each ``sweep`` count (:func:`sweep_policies`); rounds rotate the order."""
    from skipdecode.policy import FullPolicy

    any_sk = next(iter(models.values()))
    skipping = any_sk.policy_for(speedup=speedup)
    policies = {"full": FullPolicy(any_sk.adapter.num_layers), f"{speedup:g}x": skipping,
                **sweep_policies(any_sk.adapter.num_layers, sweep, getattr(skipping, "warmup_layers", 0))}
    cells = [(v, p) for v in models for p in policies]
    times = {c: [] for c in cells}
    layers = {}

    def step(variant: str, policy: str) -> float:
        stats = models[variant].generate(PROMPT, max_new_tokens=new_tokens, policy=policies[policy]).stats()
        layers[policy] = stats["mean_active_layers"]
        return 1e3 * stats["decode_seconds"] / stats["decode_steps"]

    for cell in cells:  # untimed: every path compiled and warm
        step(*cell)
    for r in tqdm(range(repeats), desc="rounds", file=sys.stderr):
        for cell in cells[r % len(cells):] + cells[: r % len(cells)]:
            times[cell].append(step(*cell))
    return [{"variant": v, "policy": p, "mean_layers": layers[p], "step_ms_runs": times[(v, p)],
             "step_ms": statistics.median(times[(v, p)])} for v, p in cells]


def summarize(rows: list[dict], names: list[str], policy: str) -> tuple[list[str], dict]:
    """Markdown lines and ``{variant: {...}}``: medians, wall/theoretical from the medians and
    the median of per-round ratios."""
    lines = ["| variant | full depth (ms) | " + policy + " (ms) | theoretical | wall / theoretical (medians) | "
             "wall / theoretical (per-round median) |", "|---|---:|---:|---:|---:|---:|"]
    out = {}
    for v in names:
        full = next(r for r in rows if (r["variant"], r["policy"]) == (v, "full"))
        skip = next(r for r in rows if (r["variant"], r["policy"]) == (v, policy))
        theo = full["mean_layers"] / skip["mean_layers"]
        per_round = statistics.median(f / s for f, s in zip(full["step_ms_runs"], skip["step_ms_runs"])) / theo
        out[v] = {"full_ms": full["step_ms"], "skip_ms": skip["step_ms"], "theoretical": theo,
                  "wall_over_theoretical": full["step_ms"] / skip["step_ms"] / theo,
                  "wall_over_theoretical_per_round": per_round}
        lines.append(f"| {v} | {full['step_ms']:.2f} | {skip['step_ms']:.2f} | {theo:.2f}x | "
                     f"{out[v]['wall_over_theoretical']:.2f} | {per_round:.2f} |")
    return lines, out


def fit_fixed_cost(rows: list[dict], names: list[str], num_layers: int, mean_layers: float) -> tuple[list[str], dict]:
    """Markdown lines and ``{variant: {...}}`` from the layer-sweep rows (policy ``"<n> layers"``):
    the least-squares line ``step_ms = fixed_ms + per_layer_ms * n`` over the median step times
    (``numpy.polyfit``, degree 1), and the wall/theoretical it predicts for a policy running
    ``mean_layers`` of ``num_layers`` on average:
    ``(fixed + per_layer L) / (fixed + per_layer m) / (L / m)``. The per-step cost that no skip
    removes (head, sampling, the step's Python) is ``fixed_ms``; a ratio r needs
    ``fixed_ms <= per_layer_ms * (L - r L) / (r L / m - 1)`` (``fixed_ms_allowed_at_0.85``).
    {} without sweep rows."""
    out, lines = {}, ["| variant | per layer (ms) | fixed per step (ms) | fixed allowed for 0.85 (ms) | "
                      "predicted wall / theoretical |", "|---|---:|---:|---:|---:|"]
    for v in names:
        pts = sorted((r["mean_layers"], r["step_ms"]) for r in rows if r["variant"] == v and r["policy"].endswith(" layers"))
        if len(pts) < 2:
            continue
        per_layer, fixed = (float(c) for c in np.polyfit([n for n, _ in pts], [t for _, t in pts], 1))
        theo = num_layers / mean_layers
        allowed = per_layer * (num_layers - 0.85 * num_layers) / (0.85 * theo - 1)
        predicted = (fixed + per_layer * num_layers) / (fixed + per_layer * mean_layers) / theo
        out[v] = {"layers": [n for n, _ in pts], "step_ms": [t for _, t in pts], "per_layer_ms": per_layer,
                  "fixed_ms": fixed, "fixed_ms_allowed_at_0.85": allowed, "predicted_wall_over_theoretical": predicted}
        lines.append(f"| {v} | {per_layer:.3f} | {fixed:.2f} | {allowed:.2f} | {predicted:.2f} |")
    return (lines if out else []), out


def plot(result: dict, png: Path) -> None:
    """Median step time per variant, full depth and skipped."""
    rows = result["rows"]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    series = {p: [next(r["step_ms"] for r in rows if (r["variant"], r["policy"]) == (v, p)) for v in names]
              for p in dict.fromkeys(r["policy"] for r in rows) if not p.endswith(" layers")}
    bar_chart(png, names, series, "variants round-robin in one process")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--variants", default="float32+compile,head+compile",
                    help="comma-separated skipdecode bench --variants items")
    add_run_options(ap, 8, "variant_ab")
    ap.add_argument("--layer-sweep", default="",
                    help="comma-separated layer counts n (e.g. 1,5,10,20,30): also time plans that run the same n "
                         "layers at every step, and fit step time = fixed + per-layer x n")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    from skipdecode.bench.runner import cpu_description
    from skipdecode.bench_engines import parse_variants

    try:
        parse_variants(",".join(names))
    except ValueError as err:
        ap.error(str(err))
    if len(set(names)) != len(names) or not names:
        ap.error(f"--variants needs distinct items, got {args.variants!r}")
    if args.repeats < 1 or args.new_tokens < 3 or not args.speedup >= 1:
        ap.error("--repeats must be >= 1, --new-tokens >= 3 and --speedup >= 1")
    try:
        sweep = sorted({int(n) for n in args.layer_sweep.split(",") if n.strip()})
    except ValueError:
        ap.error(f"--layer-sweep takes comma-separated layer counts, got {args.layer_sweep!r}")
    if sweep and (len(sweep) < 2 or sweep[0] < 1):
        ap.error(f"--layer-sweep needs at least two distinct counts >= 1, got {args.layer_sweep!r}")
    torch.set_num_threads(args.threads)

    def check(base) -> None:  # before the variants are built (compiling takes minutes)
        if sweep and sweep[-1] > base.adapter.num_layers:
            ap.error(f"--layer-sweep counts must be at most the model's {base.adapter.num_layers} layers, got {sweep[-1]}")

    models, base = build(names, check)
    rows = measure(models, args.speedup, args.repeats, args.new_tokens, sweep)
    lines, summary = summarize(rows, names, f"{args.speedup:g}x")
    skip_layers = next(r["mean_layers"] for r in rows if r["policy"] == f"{args.speedup:g}x")
    fit_lines, fits = fit_fixed_cost(rows, names, base.adapter.num_layers, skip_layers)
    lines += [""] + fit_lines if fit_lines else []
    quantized = [summary[n] for n, q, _ in parse_variants(",".join(names)) if q is not None]
    best = max((s["wall_over_theoretical"] for s in quantized), default=None)
    targets = {"quantized_wall_over_theoretical_best": best,  # issue 11: >= 0.85 at 3x, batch 1
               "quantized_wall_over_theoretical_ge_0.85": None if best is None or args.speedup != 3 else best >= 0.85}
    path = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    result = {"benchmark": "variant_ab", "model": "embedded SmolLM2-135M-Instruct (stock weights)", "batch_size": 1,
              "new_tokens": args.new_tokens, "speedup": args.speedup, "repeats": args.repeats, "threads": args.threads,
              "torch": torch.__version__, "cpu": cpu_description(), "rows": rows, "summary": summary, "layer_sweep": fits, "targets": targets,
              "compile_reports": {v: m.compile_report.to_dict() if getattr(m, "compile_report", None) else None
                                  for v, m in models.items()},
              "command": shlex.join(["python", "benchmarks/variant_ab.py", *sys.argv[1:]]),
              "results_file": os.path.relpath(path, ROOT)}
    report(result, path, plot, "\n".join(lines), [])


if __name__ == "__main__":
    main()
