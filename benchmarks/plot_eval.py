"""Join saved evaluation reports into one table and one plot.

Reports on the same items are joined row by row, e.g. batched SkipDecode rows and a batch-1 CALM
run, or one report redrawn with a frontier line and rescored with the current metric set:

    python benchmarks/plot_eval.py benchmarks/results/eval_e2e.json --name eval_e2e --rescore \\
        --frontier 1x:full --frontier 2x:checkpoint --frontier 3x:checkpoint --frontier 5x:checkpoint

With ``--concat`` the reports are shards of one run over disjoint items (``eval_e2e.py --offset
K --limit N``), joined into one report over all their items (sums, then speedups and scores
recomputed). Writes ``NAME.json``, ``NAME.md`` and ``NAME.png`` into ``--out`` (default: benchmarks/results)
and prints the Markdown table. Exit status 2 with a one-line message on a bad or mismatched file.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    """Combine the reports named on the command line; returns 0 (exits 2 on bad input)."""
    p = argparse.ArgumentParser(prog="plot_eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="report JSON files written by eval / eval_e2e.py")
    p.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    p.add_argument("--name", default="eval_combined", help="output base name")
    p.add_argument("--frontier", action="append", default=[], metavar="MODEL:POLICY",
                   help="row joined into the plot's frontier line (repeatable, in order), e.g. 2x:checkpoint")
    p.add_argument("--concat", action="store_true",
                   help="the reports are shards of one run over disjoint items (--offset/--limit): join "
                        "their items instead of their rows")
    p.add_argument("--rescore", action="store_true",
                   help="recompute scores from the stored generations with the task's current metric set "
                        "(e.g. NIST for reports written before it was added)")
    args = p.parse_args(argv)

    from skipdecode.evaluate import Report, combine_reports, concat_reports

    try:
        reports = [Report.load(path) for path in args.reports]
        if args.rescore:
            reports = [r.rescore() for r in reports]
        report = concat_reports(reports) if args.concat else combine_reports(reports)
        report.meta["post_command"] = shlex.join(["python", "benchmarks/plot_eval.py",
                                                  *(sys.argv[1:] if argv is None else argv)])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    frontier = []
    for spec in args.frontier:
        model, sep, policy = spec.rpartition(":")
        if not sep or not model or not policy:
            print(f"error: --frontier {spec!r}: expected MODEL:POLICY, e.g. 2x:checkpoint", file=sys.stderr)
            return 2
        frontier.append((model, policy))
    try:
        paths = report.save(args.out, args.name, frontier=frontier or None)
    except KeyError as e:
        print(f"error: --frontier: {e.args[0]}", file=sys.stderr)
        return 2
    print(report.to_markdown())
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
