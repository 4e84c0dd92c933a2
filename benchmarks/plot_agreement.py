"""Join ``adapter_agreement.py`` results into one table and one plot: ROUGE-L against the stock
full-depth answers over the realised theoretical speedup, one point per (results file, row).

    python benchmarks/plot_agreement.py benchmarks/results/adapter_agreement_shipped_n128.json \\
        benchmarks/results/adapter_agreement_long1_n128.json --name adapter_agreement_long

Rows at full depth (the reference and an adapted model's ``full`` row) are left out: they score
100 by construction; a stock-model row that another file already gave (same policy, answer length
and score) is shown once, with adapter "none". Writes ``NAME.md`` and ``NAME.png`` into ``--out`` (default:
benchmarks/results), prints the Markdown table and ends with one JSON line. Exit status 2 with a
one-line message on a file that is missing or is not such a result.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def load_points(paths: list[Path]) -> list[dict]:
    """The skipping rows of the results files ``paths`` (repeated stock rows once), each ``{"file", "adapter", "max_new_tokens",
    "model", "policy", "rougeL", "exact", "first_divergence", "speedup"}`` (speedup: realised
    theoretical, L x decode steps / layers run; rougeL and exact in 0-100).

    Raises:
        ValueError: a file is unreadable, not JSON, or lacks the fields adapter_agreement.py writes
            (the message names the file)."""
    points, seen = [], set()
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
            rows, n = report["rows"], report["max_new_tokens"]
            adapter = report.get("adapter") or "shipped adapter"
            for r in rows:
                stock = r["model"].startswith("stock")
                key = (r["model"], r["policy_label"], n, r["rougeL"])
                if r["policy"].get("type") == "full" or (stock and key in seen):
                    continue
                seen.add(key)
                points.append({"file": Path(path).name, "adapter": "none" if stock else adapter,
                               "max_new_tokens": n, "model": r["model"],
                               "policy": r["policy_label"], "rougeL": r["rougeL"], "exact": r["exact"],
                               "first_divergence": r["first_divergence"], "speedup": r["theoretical_speedup"]})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not an adapter_agreement.py result ({type(e).__name__}: {e})") from None
    return points


def to_markdown(points: list[dict]) -> str:
    """One table row per point: file, adapter, model, policy, new tokens, ROUGE-L, speedup."""
    lines = ["| results file | adapter | model | policy | max new tokens | identical answers | ROUGE-L vs full depth "
             "| first divergence (tokens) | theoretical speedup |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p['file']} | {p['adapter']} | {p['model']} | {p['policy']} | {p['max_new_tokens']} "
                     f"| {p['exact']:.1f} % | {p['rougeL']:.1f} | {p['first_divergence']:.1f} | {p['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def short_name(adapter: str) -> str:
    """A plot label for an adapter: ``shipped`` (package data), ``stock`` (none), a run folder's
    name for ``runs/NAME/final``, else the folder's own name."""
    if "package data" in adapter:
        return "shipped"
    if adapter == "none":
        return "stock"
    path = Path(adapter)
    return path.parent.name if path.name == "final" else path.name


def plot(points: list[dict], path: Path) -> None:
    """ROUGE-L over realised speedup, a colour per answer length, each point labelled (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 5.0))
    lengths = sorted({p["max_new_tokens"] for p in points})
    for i, n in enumerate(lengths):
        mine = [p for p in points if p["max_new_tokens"] == n]
        ax.scatter([p["speedup"] for p in mine], [p["rougeL"] for p in mine], s=22, color=f"C{i}",
                   label=f"at most {n} new tokens")
        for j, p in enumerate(sorted(mine, key=lambda q: -q["rougeL"])):
            dx, dy, ha = ((6, 4, "left"), (6, -9, "left"), (-6, -3, "right"))[j % 3]  # neighbours apart
            ax.annotate(f"{short_name(p['adapter'])}: {p['policy']}", (p["speedup"], p["rougeL"]), fontsize=6.5,
                        xytext=(dx, dy), textcoords="offset points", ha=ha)
    ax.set_xlabel("realised theoretical speedup (x)")
    ax.set_ylabel("ROUGE-L vs stock full depth (held-out prompts)")
    ax.set_title("Skip adapters against the full-depth answers")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Join the results files named on the command line; returns 0 (exits 2 on bad input)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="JSON files written by adapter_agreement.py")
    ap.add_argument("--name", default="adapter_agreement_joined", help="output base name")
    ap.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = ap.parse_args(argv)
    try:
        points = load_points(args.reports)
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    if not points:
        ap.exit(2, "error: the files hold no skipping rows to plot\n")
    args.out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "benchmarks/plot_agreement.py", *(sys.argv[1:] if argv is None else argv)])
    table = to_markdown(points)
    (args.out / f"{args.name}.md").write_text(f"`{command}`\n\n{table}")
    plot(points, args.out / f"{args.name}.png")
    print(table)
    print(json.dumps({"name": args.name, "points": len(points),
                      "best_rougeL": max(p["rougeL"] for p in points)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
