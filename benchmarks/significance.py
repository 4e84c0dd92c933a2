"""Is a BLEU difference between two evaluated rows real? Paired bootstrap resampling (Koehn 2004).

Each system is a row of an evaluation report (``skipdecode eval``, ``eval_e2e.py``,
``frontier.py``): ``REPORT.json:MODEL:POLICY``, e.g. ``benchmarks/results/frontier_eval_2x.json:2x:checkpoint``.
Every system is compared with ``--baseline`` on the same items and references (the reports must
hold the same items in the same order) by :func:`skipdecode.metrics.paired_bootstrap_bleu`
(sacrebleu's paired bootstrap test, ``--samples`` resamples).

    python benchmarks/significance.py --baseline benchmarks/results/frontier_eval_1x.json:1x:full \\
        --system benchmarks/results/frontier_eval_2x.json:2x:checkpoint \\
        --system benchmarks/results/frontier_eval_3x.json:3x:checkpoint \\
        --system benchmarks/results/frontier_eval_5x.json:5x:checkpoint --name frontier_significance

Prints a table, writes ``benchmarks/results/<name>.json`` (``--out``), ends with one JSON line.
Exit status 2 with a one-line message on a bad spec, a missing row or mismatched items.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)
from skipdecode.paths import portable_record

RESULTS = Path(__file__).resolve().parent / "results"


class SpecError(ValueError):
    """A ``REPORT.json:MODEL:POLICY`` spec that cannot be read."""


def read_row(spec: str) -> tuple[list[str], list[list[str]], list[str]]:
    """``(generations, references, prompts)`` of the row named by ``spec`` (``REPORT.json:MODEL:POLICY``).

    Raises:
        SpecError: not three ``:``-separated parts, an unreadable report, no such row, or a row
            without stored generations.
    """
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or not all(parts):
        raise SpecError(f"{spec!r}: expected REPORT.json:MODEL:POLICY")
    path, model, policy = parts
    try:
        report = json.loads(Path(path).read_text())
        items, rows = report["items"], report["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecError(f"{path}: not a readable evaluation report ({type(e).__name__}: {e})") from None
    row = next((r for r in rows if r.get("model") == model and r.get("policy") == policy), None)
    if row is None:
        have = ", ".join(f"{r.get('model')}:{r.get('policy')}" for r in rows)
        raise SpecError(f"{path}: no row {model}:{policy} (rows: {have})")
    if not row.get("generations") or len(row["generations"]) != len(items):
        raise SpecError(f"{path}: row {model}:{policy} holds no generation per item")
    return list(row["generations"]), [list(i["references"]) for i in items], [i["prompt"] for i in items]


def compare(baseline: str, systems: list[str], samples: int) -> list[dict]:
    """One paired bootstrap test per system against ``baseline`` (specs as :func:`read_row`).

    Returns:
        Per system ``{"system", "bleu", "bleu_ci", "baseline_bleu", "baseline_ci", "difference",
        "p_value"}`` (BLEU points; ``*_ci`` half-widths of the 95 % intervals).

    Raises:
        SpecError: see :func:`read_row`; a system evaluated on other items than the baseline.
    """
    from skipdecode.metrics import paired_bootstrap_bleu

    base_hyps, refs, prompts = read_row(baseline)
    out = []
    for spec in systems:
        hyps, sys_refs, sys_prompts = read_row(spec)
        if sys_prompts != prompts or sys_refs != refs:
            raise SpecError(f"{spec}: evaluated on other items than the baseline {baseline}")
        r = paired_bootstrap_bleu(base_hyps, hyps, refs, n_samples=samples)
        out.append({"system": spec, "bleu": r["system"], "bleu_ci": r["system_ci"], "baseline_bleu": r["baseline"],
                    "baseline_ci": r["baseline_ci"], "difference": r["difference"], "p_value": r["p_value"]})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the comparison described in the module docstring; returns 0 (2 on bad input)."""
    p = argparse.ArgumentParser(prog="significance.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--baseline", required=True, help="REPORT.json:MODEL:POLICY")
    p.add_argument("--system", action="append", required=True, help="REPORT.json:MODEL:POLICY (repeatable)")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (>= 100)")
    p.add_argument("--name", default="significance", help="results base name")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    try:
        rows = compare(args.baseline, args.system, args.samples)
    except (SpecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"paired bootstrap BLEU against {args.baseline} ({args.samples} resamples)")
    for col in ("system", "BLEU (95 % CI)", "difference", "p-value"):
        table.add_column(col, justify="right" if col != "system" else "left")
    for r in rows:
        table.add_row(r["system"], f"{r['bleu']:.2f} ± {r['bleu_ci']:.2f}", f"{r['difference']:+.2f}",
                      f"{r['p_value']:.4f}")
    Console().print(table)
    record = portable_record({"baseline": args.baseline, "samples": args.samples, "comparisons": rows,
                              "command": shlex.join(["python", "benchmarks/significance.py", *(sys.argv[1:] if argv is None else argv)])})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(dumps(record, indent=1) + "\n")
    print(dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
