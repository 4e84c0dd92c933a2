"""Long-prompt stall: how long running rows wait while a long prompt joins, with and without
chunked prefill (``Engine(prefill_chunk_tokens=)``, ``serve --prefill-chunk-tokens``).

For each ``--chunks`` value (tokens per prefill chunk; 0: the whole prompt in one forward), a fresh
engine decodes ``--running`` short requests (E2E prompts, no EOS) for ``--warm-steps`` engine steps,
then a prompt of ``--prompt-tokens`` tokens (E2E prompts joined, cut to that length) is
submitted. Measured, from its submission to its first token: its time to first token (s), the
running rows' longest wait between two of their tokens (s, the stall a streaming user sees) and the
tokens they emitted meanwhile. One run per chunk value, in one process, in the order given, after
an untimed whole prefill of the long prompt (the first prefill of a length runs slower: fresh
memory); greedy; full depth unless ``--speedup``.

Prints a Markdown table, writes ``benchmarks/results/<name>.json`` (repo-relative paths) and a PNG
of every wait between two tokens of the running rows over the run, and ends with one JSON line.

    python benchmarks/long_prompt_stall.py --prompt-tokens 2048 --chunks 0,128,256,512
    python benchmarks/long_prompt_stall.py --model DIR --prompt-tokens 64 --chunks 0,16 --name smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_load import prompts, report  # noqa: E402  (the E2E prompts of the load benchmarks)
from skipdecode.quantize import QUANTIZE_MODES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="long_prompt_stall.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model for skipdecode.load (default: the embedded SmolLM2-135M)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens of the long prompt")
    p.add_argument("--chunks", default="0,128,256,512", help="comma-separated prefill_chunk_tokens values (0: off)")
    p.add_argument("--running", type=int, default=4, help="short requests decoding when the long prompt arrives")
    p.add_argument("--warm-steps", type=int, default=4, help="engine steps the running rows decode before it arrives")
    p.add_argument("--speedup", type=float, default=1.0, help="the running rows' speedup (1: full depth)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZE_MODES),
                   help="skipdecode.load(quantize=) (default: float32 weights)")
    p.add_argument("--compile", action="store_true", help="skipdecode.load(compile=True); compiles before timing")
    p.add_argument("--name", default="long_prompt_stall", help="results base name under --out")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the results JSON and PNG")
    args = p.parse_args(argv)
    try:
        args.chunks = [int(x) for x in args.chunks.split(",")]
    except ValueError:
        p.error(f"--chunks takes comma-separated integers, got {args.chunks!r}")
    for option, value, low in (("--prompt-tokens", args.prompt_tokens, 2), ("--running", args.running, 1),
                               ("--warm-steps", args.warm_steps, 1), ("--threads", args.threads, 1),
                               ("--speedup", args.speedup, 1)):
        if value is not None and value < low:
            p.error(f"{option} must be >= {low}, got {value}")
    if any(c < 0 for c in args.chunks):
        p.error(f"--chunks must be >= 0 each (0: off), got {args.chunks}")
    return args


def long_prompt_ids(sk, n: int) -> list[int]:
    """``n`` token ids: the E2E prompts joined by spaces (repeated as needed), cut to ``n``."""
    texts = prompts()
    ids: list[int] = []
    while len(ids) < n:
        ids += sk.tokenizer(" ".join(texts), add_special_tokens=False)["input_ids"]
    return ids[:n]


def run_one(sk, args: argparse.Namespace, chunk: int, long_ids: list[int], progress=None) -> dict:
    """One chunk value on a fresh engine: the table's row, with ``gaps`` (s), every wait between
    two tokens of the running rows after the long prompt's submission, in order."""
    from skipdecode.engine import Engine, Request
    from skipdecode.prompts import encode_prompt

    policy = None if args.speedup == 1.0 else sk.policy_for(speedup=args.speedup)
    engine = Engine(sk.adapter, args.running + 1, prefill_chunk_tokens=chunk, prefix_cache=False)
    budget = sk.adapter.max_positions or 10**9
    texts = prompts()
    running = [Request(ids, max(1, min(4096, budget - len(ids))), policy)  # no EOS: they run throughout
               for ids in (encode_prompt(sk.tokenizer, texts[i % len(texts)]) for i in range(args.running))]
    for r in running:
        engine.submit(r)
    for _ in range(args.warm_steps):
        engine.step()
    long_req = Request(long_ids, 1)
    engine.submit(long_req)
    submitted = last = time.perf_counter()
    gaps, steps, first = [], 0, None
    while first is None:
        events = engine.step()
        now = time.perf_counter()
        steps += 1
        if any(ev.row.request is not long_req for ev in events):
            gaps.append(now - last)
            last = now
        if any(ev.row.request is long_req for ev in events):
            first = now - submitted
        if progress is not None:
            progress.update(1)
    return {"prefill_chunk_tokens": chunk, "time_to_first_token_s": first, "longest_wait_s": max(gaps or [first]),
            "running_tokens_meanwhile": len(gaps) * args.running, "engine_steps": steps, "gaps": gaps,
            "chunks": -(-len(long_ids) // chunk) if chunk and len(long_ids) > chunk else 1}


def table(rows: list[dict], prompt_tokens: int, running: int) -> str:
    """Markdown table of the rows."""
    whole = next((r for r in rows if r["prefill_chunk_tokens"] == 0), None)
    lines = [f"| chunk (tokens) | forwards for the {prompt_tokens}-token prompt | its time to first token (s) | vs whole | "
             f"longest wait of {running} running rows (s) | their tokens meanwhile |", "|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['time_to_first_token_s'] / whole['time_to_first_token_s']:.2f}x" if whole else ""
        lines.append(f"| {r['prefill_chunk_tokens'] or 'off'} | {r['chunks']} | {r['time_to_first_token_s']:.2f} | {vs} | "
                     f"{r['longest_wait_s']:.2f} | {r['running_tokens_meanwhile']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Each chunk value's waits between the running rows' tokens over the seconds since the long
    prompt's submission (each wait a level over the time it lasted, a dot at its token); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in result["rows"]:
        t, xs, ys = 0.0, [0.0], [r["gaps"][0]]
        for g in r["gaps"]:  # each wait drawn over the time it lasted, ending at the token
            t += g
            xs.append(t)
            ys.append(g)
        label = f"chunk {r['prefill_chunk_tokens'] or 'off'} (its first token at {r['time_to_first_token_s']:.1f} s)"
        ax.step(xs, ys, where="pre", label=label)
        ax.plot(xs[1:], ys[1:], ".", color=ax.lines[-1].get_color())
    ax.set_xlabel("seconds since the long prompt arrived")
    ax.set_ylabel("wait for the running rows' token (s)")
    ax.set_title(f"{result['running']} running rows, a {result['prompt_tokens']}-token prompt joins", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from skipdecode import load

    sk = load(args.model, adapter=False, quantize=args.quantize, compile=args.compile)
    long_ids = long_prompt_ids(sk, args.prompt_tokens)
    sk.adapter.check_context(len(long_ids), 1)
    run_one(sk, args, 0, long_ids)  # untimed: the first prefill of a length pays for its memory (stop 58: +47 %)
    with tqdm(desc="engine steps", unit="step", leave=False) as bar:
        rows = [run_one(sk, args, c, long_ids, bar) for c in args.chunks]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    result = {
        "benchmark": "long_prompt_stall", "model": args.model or "embedded SmolLM2-135M-Instruct",
        "prompt_tokens": len(long_ids), "running": args.running, "warm_steps": args.warm_steps,
        "speedup": args.speedup, "quantize": args.quantize, "compile": args.compile,
        "threads": torch.get_num_threads(), "rows": rows,
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "results_file": os.path.relpath(path, ROOT),
    }
    summary = [f"chunk {r['prefill_chunk_tokens'] or 'off'}: running rows waited at most {r['longest_wait_s']:.2f} s; "
               f"the long prompt's first token after {r['time_to_first_token_s']:.2f} s" for r in rows]
    report(result, path, plot, table(rows, len(long_ids), args.running), summary, summary_file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
