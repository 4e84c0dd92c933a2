"""Output of the decode-speed benchmark: ``rich`` tables of the rows and of the profile, the JSON
results file and the speedup bar chart (PNG). The library never prints: the CLI prints the tables.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .profile import PROFILE_PARTS


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{suffix}"


def _table(title: str):
    """An empty ``rich.table.Table`` titled ``title`` (left-justified)."""
    from rich.table import Table

    return Table(title=title, title_justify="left")


def schedule_cell(policy: dict[str, Any] | None) -> str:
    """A benchmark row's schedule, short: ``"30"`` (full depth), ``"21->9 over 8"`` (linear
    decay from ``max_layers`` to ``min_layers`` over ``horizon`` tokens), ``"14 at 30, then 25->5
    over 4"`` with full-depth first steps (docs/method.md "The schedule"), so a trained schedule and the
    generic one of the same speedup read apart; "-" for HF's rows (no policy), else the dict."""
    if not policy:
        return "-"
    if policy.get("type") == "full":
        return str(policy.get("num_layers", "full"))
    if policy.get("type") == "linear_decay":
        decay = f"{policy['max_layers']}->{policy['min_layers']} over {policy['horizon']}"
        first = policy.get("full_depth_steps") or 0
        return f"{first} at {policy['num_layers']}, then {decay}" if first else decay
    return str(policy)


def results_table(result: dict[str, Any]):
    """A ``rich.table.Table`` of the benchmark rows (the CLI prints it)."""
    meta = result["meta"]
    table = _table(
        f"decode speed: {meta['model'].split(' (')[0]} | {meta['device']} {meta['dtype']} | {meta['threads']} threads | "
        f"{meta['new_tokens']} new tokens ({meta['decode_steps']} decode steps), horizon {meta['horizon']}, "
        f"median of {meta['repeats']}"
    )
    for col, justify in (
        ("batch", "right"), ("policy", "left"), ("schedule", "left"), ("mean layers", "right"), ("theoretical", "right"),
        ("step ms", "right"), ("tok/s", "right"), ("wall speedup", "right"), ("wall/theo", "right"),
        ("ours-full vs HF", "right"), ("TTFT ms", "right"),
    ):
        table.add_column(col, justify=justify)
    last_b = None
    for r in result["rows"]:
        if last_b is not None and r["batch_size"] != last_b:
            table.add_section()
        last_b = r["batch_size"]
        hf = r["engine"] == "hf"
        vs_hf = "-"
        if r["full_vs_hf"] is not None:
            agree = r.get("tokens_match_hf", True)
            match = "" if agree else " (ids not compared)" if agree is None else " (ids differ)"
            vs_hf = f"{r['full_vs_hf']:.2f}x{match}"
        table.add_row(
            str(r["batch_size"]),
            "HF generate" if hf else r["policy"],
            "-" if hf else schedule_cell(r.get("policy_config")),
            f"{r['mean_active_layers']:.1f}/{r['num_layers']}",
            _fmt(r["theoretical_speedup"], ".2f", "x"),
            _fmt(r["step_ms"], ".1f"),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["wall_speedup"], ".2f", "x"),
            "-" if hf or r["policy"] == "full" else _fmt(r["wall_over_theoretical"], ".2f"),
            vs_hf,
            _fmt(r["ttft_ms"], ".0f"),
        )
    return table


def profile_table(profile: dict[str, Any]):
    """A ``rich.table.Table`` of :func:`profile_decode`'s breakdown (ms per decode step)."""
    w = profile["weights"]
    table = _table(
        f"decode step profile (ms per step, share) | layer {w['layer_bytes_mean'] / 1e6:.1f} MB x "
        f"{w['num_layers']}, LM head + norm {w['head_bytes'] / 1e6:.1f} MB ({w['dtype']}) | floor at "
        f"{profile['bandwidth_gbs']:g} GB/s"
    )
    table.add_column("part")
    for r in profile["rows"]:
        table.add_column(f"B={r['batch_size']} {r['policy']}", justify="right")
    for part in PROFILE_PARTS:
        cells = [f"{r['parts_ms'][part]:.2f} ({r['parts_share'][part]:.0%})" for r in profile["rows"]]
        table.add_row(part, *cells)
    table.add_section()
    table.add_row("step total", *[f"{r['step_ms']:.2f}" for r in profile["rows"]])
    table.add_row("mean active layers", *[f"{r['mean_active_layers']:.1f}" for r in profile["rows"]])
    table.add_row("ms per decoder layer", *[f"{r['mean_layer_ms']:.2f}" for r in profile["rows"]])
    table.add_row("fixed (non-layer) ms", *[f"{r['fixed_ms']:.2f} ({r['fixed_share']:.0%})" for r in profile["rows"]])
    table.add_row("wall speedup (this profile)", *[f"{r['wall_speedup']:.2f}x" for r in profile["rows"]])
    table.add_row("theoretical speedup", *[f"{r['theoretical_speedup']:.2f}x" for r in profile["rows"]])
    table.add_row("Amdahl bound (measured fixed ms)", *[f"{r['amdahl_speedup']:.2f}x" for r in profile["rows"]])
    table.add_section()
    table.add_row("weight MB read per step", *[f"{r['weight_bytes_per_step'] / 1e6:.0f}" for r in profile["rows"]])
    table.add_row("LM head share of bytes", *[f"{r['head_share_of_bytes']:.0%}" for r in profile["rows"]])
    table.add_row(f"floor ms at {profile['bandwidth_gbs']:g} GB/s", *[f"{r['floor_ms']:.2f}" for r in profile["rows"]])
    table.add_row("bytes bound on speedup", *[f"{r['bytes_speedup_bound']:.2f}x" for r in profile["rows"]])
    table.add_row("achieved GB/s (weights)", *[f"{r['achieved_gbs']:.1f}" for r in profile["rows"]])
    preds = profile.get("predictions", [])
    if preds:
        table.add_section()
        for name in dict.fromkeys(p["policy"] for p in preds):
            cells = []
            for r in profile["rows"]:
                p = next((p for p in preds if p["batch_size"] == r["batch_size"] and p["policy"] == name), None)
                cells.append(
                    "-" if p is None or r["policy"] != "full" else
                    f"{p['amdahl_speedup']:.2f}x / {p['theoretical_speedup']:.2f}x = {p['amdahl_ratio']:.2f}"
                )
            table.add_row(f"{name}: predicted wall / theoretical", *cells)
    return table


def write_results(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``result`` as JSON to ``path`` (atomically; parent folders are created)."""
    from ..model import write_json_atomic
    from ..paths import portable_record

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, portable_record(result))  # paths relative to the repository / data folder
    path.chmod(0o644)
    return path


def write_plot(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Bar chart per batch size: theoretical vs wall-clock speedup of each policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["rows"] if r["engine"] == "skipdecode"]
    hf_rows = {r["batch_size"]: r for r in result["rows"] if r["engine"] == "hf"}
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False)
    top = max([r["theoretical_speedup"] for r in result["rows"]] + [r["wall_speedup"] for r in result["rows"]] + [1.0])
    for ax, B in zip(axes[0], batches):
        sub = [r for r in rows if r["batch_size"] == B]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["theoretical_speedup"] for r in sub], 0.4, label="theoretical", color="#9ab")
        ax.bar([x + 0.2 for x in xs], [r["wall_speedup"] for r in sub], 0.4, label="wall-clock", color="#e73")
        ax.plot(list(xs), [0.8 * r["theoretical_speedup"] for r in sub], "k--", lw=1, label="0.8 x theoretical")
        ax.axhline(1.0, color="grey", lw=0.8)
        labels = [r["policy"] for r in sub]
        if B in hf_rows:  # HF generate's wall-clock speed relative to our full depth (< 1: HF slower)
            ax.bar([len(sub) + 0.2], [hf_rows[B]["wall_speedup"]], 0.4, color="#555", label="HF generate")
            labels.append("HF")
        ax.set_xticks(list(range(len(labels))), labels)
        ax.set_title(f"batch {B}")
        ax.set_ylim(0, top * 1.1)
    axes[0][0].set_ylabel("speedup vs our full depth")
    axes[0][0].legend(loc="upper left", fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"SkipDecode decode speed: {meta['device']} {meta['dtype']}, {meta['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
