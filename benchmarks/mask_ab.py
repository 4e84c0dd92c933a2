"""Unpadded decode steps without an attention mask, against the same steps with one, in one process.

Since stop 42 a decode step whose queries may see every key (one new token per row, no padding)
gives its layers without an attention window no mask
(:func:`skipdecode.forward.unmasked_layers`); HF's SDPA attention then groups the query heads over
the shared key/value heads instead of copying keys and values once per query head, which under
``torch.compile`` it does whenever a mask is passed. The copy grows with the context, so this
benchmark times a short prompt (an E2E meaning representation) and a long one (the first
``--articles`` CNN/DailyMail articles of the data folder, summarised with the project's prompt
template; a built-in text repeated when the folder is absent).

One model (``--quantize``, compiled unless ``--no-compile``) is loaded and warmed up; then
``--repeats`` rounds, alternating which setting goes first, each running a greedy batch-1
generation of ``--new-tokens`` tokens per (prompt, policy: full depth and ``--speedup``) with
the masks dropped (the shipped path) and kept (``unmasked_layers`` answering False for every
layer, the path before stop 42). Step time = decode seconds / decode steps, in ms. Prints a
Markdown table, writes ``benchmarks/results/<name>.json`` (repo-relative paths) and a PNG, and
ends with one JSON line.

    python benchmarks/mask_ab.py --repeats 14 --name mask_ab_stop42
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from guard_memo_ab import PROMPT, add_run_options, bar_chart  # noqa: E402  (shared with the other in-process A/Bs)
from server_load import report  # noqa: E402  (table, JSON and PNG the same way as the load benchmarks)

FALLBACK_TEXT = ("The Eagle is a coffee shop by the riverside that serves French food at moderate prices; "
                 "it is not family-friendly and sits near Burger King. ")


def long_prompt(data_dir: Path | None, articles: int) -> tuple[str, str]:
    """(prompt, where it came from): the CNN/DailyMail prompt of the first ``articles`` articles
    of ``data_dir`` joined, or the built-in text repeated 40 times when the file is absent."""
    from skipdecode.data import read_cnndm
    from skipdecode.paths import portable

    path = data_dir / "cnn_dailymail" / "cnndm_specbench80.jsonl" if data_dir else None
    if path is None or not path.exists():
        return "Summarize: " + FALLBACK_TEXT * 40, "built-in text x 40"
    items = read_cnndm(path)[:articles]
    return "\n\n".join(item.prompt for item in items), f"{portable(str(path))}, first {articles} article(s)"


@contextmanager
def masks_kept(on: bool):
    """Within the block, with ``on``, every layer gets its mask (the path before stop 42)."""
    import skipdecode.forward as forward

    real = forward.unmasked_layers
    if on:
        forward.unmasked_layers = lambda adapter, attention_mask, num_queries: [False] * adapter.num_layers
    try:
        yield
    finally:
        forward.unmasked_layers = real


def measure(sk, prompts: dict[str, str], speedup: float, repeats: int, new_tokens: int) -> list[dict]:
    """Rows ``{prompt, prompt_tokens, policy, masks, mean_layers, step_ms_runs, step_ms}``; rounds
    alternate which setting (``"dropped"``, ``"kept"``) goes first."""
    from skipdecode.policy import FullPolicy

    policies = {"full": FullPolicy(sk.adapter.num_layers), f"{speedup:g}x": sk.policy_for(speedup=speedup)}
    cells = [(p, pol) for p in prompts for pol in policies]
    times = {(p, pol, m): [] for p, pol in cells for m in ("dropped", "kept")}
    info = {}

    def step(prompt: str, policy: str) -> float:
        res = sk.generate(prompts[prompt], max_new_tokens=new_tokens, policy=policies[policy], chat=False)
        stats = res.stats()
        info[(prompt, policy)] = (res.prompt_tokens[0], stats["mean_active_layers"])
        return 1e3 * stats["decode_seconds"] / stats["decode_steps"]

    for setting in ("dropped", "kept"):  # untimed: every path compiled
        with masks_kept(setting == "kept"):
            for cell in cells:
                step(*cell)
    for r in tqdm(range(repeats), desc="rounds", file=sys.stderr):
        for setting in (("dropped", "kept") if r % 2 == 0 else ("kept", "dropped")):
            with masks_kept(setting == "kept"):
                for cell in cells:
                    times[(*cell, setting)].append(step(*cell))
    return [{"prompt": p, "prompt_tokens": info[(p, pol)][0], "policy": pol, "masks": m,
             "mean_layers": info[(p, pol)][1], "step_ms_runs": v, "step_ms": statistics.median(v)}
            for (p, pol, m), v in times.items()]


def table(rows: list[dict]) -> str:
    """Markdown: per (prompt, policy) the medians with masks kept and dropped, and their ratio."""
    lines = ["| prompt (tokens) | policy | masks kept (ms) | masks dropped (ms) | dropped / kept |",
             "|---|---|---:|---:|---:|"]
    for p, pol in dict.fromkeys((r["prompt"], r["policy"]) for r in rows):
        get = {r["masks"]: r for r in rows if (r["prompt"], r["policy"]) == (p, pol)}
        kept, dropped = get["kept"], get["dropped"]
        lines.append(f"| {p} ({kept['prompt_tokens']}) | {pol} | {kept['step_ms']:.2f} | {dropped['step_ms']:.2f} | "
                     f"{dropped['step_ms'] / kept['step_ms']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    """Median step time per (prompt, policy), masks kept and dropped."""
    rows = result["rows"]
    cells = list(dict.fromkeys((r["prompt"], r["policy"]) for r in rows))
    series = {f"masks {m}": [next(r["step_ms"] for r in rows if (r["prompt"], r["policy"], r["masks"]) == (*c, m))
                             for c in cells] for m in ("kept", "dropped")}
    bar_chart(png, [f"{p}\n{pol}" for p, pol in cells], series, "unpadded decode steps: masks kept against dropped")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_options(ap, 6, "mask_ab")
    ap.add_argument("--quantize", default=None, help="weights: int8, int4, w8a8 or head (default: float32)")
    ap.add_argument("--no-compile", action="store_true", help="eager steps (HF's eager GQA path then copies nothing either way)")
    ap.add_argument("--data-dir", type=Path, default=None, help="the shared data folder (default: ../shared/data when it exists)")
    ap.add_argument("--articles", type=int, default=1, help="CNN/DailyMail articles in the long prompt (>= 1)")
    args = ap.parse_args()
    from skipdecode.data import default_data_dir
    from skipdecode.quantize import QUANTIZE_MODES

    if args.quantize is not None and args.quantize not in QUANTIZE_MODES:
        ap.error(f"--quantize takes {', '.join(QUANTIZE_MODES)}, got {args.quantize!r}")
    if args.repeats < 1 or args.new_tokens < 3 or not args.speedup >= 1 or args.articles < 1:
        ap.error("--repeats must be >= 1, --new-tokens >= 3, --speedup >= 1 and --articles >= 1")
    if args.data_dir is not None and not args.data_dir.is_dir():
        ap.error(f"--data-dir {args.data_dir} is not a directory")
    torch.set_num_threads(args.threads)
    text, source = long_prompt(args.data_dir or default_data_dir(), args.articles)
    from skipdecode import load

    sk = load(None, adapter=False, quantize=args.quantize, compile=not args.no_compile)
    rows = measure(sk, {"short": PROMPT, "long": text}, args.speedup, args.repeats, args.new_tokens)
    path = ROOT / "benchmarks" / "results" / f"{args.name}.json"
    result = {"benchmark": "mask_ab", "model": "embedded SmolLM2-135M-Instruct (stock weights)", "batch_size": 1,
              "quantize": args.quantize, "compile": not args.no_compile, "long_prompt": source,
              "new_tokens": args.new_tokens, "speedup": args.speedup, "repeats": args.repeats, "threads": args.threads,
              "torch": torch.__version__, "rows": rows, "command": shlex.join(["python", "benchmarks/mask_ab.py", *sys.argv[1:]]),
              "results_file": os.path.relpath(path, ROOT)}
    report(result, path, plot, table(rows), [])


if __name__ == "__main__":
    main()
