"""Engine load: the in-flight engine under a closed loop of C clients, in one process, no HTTP.

The same work as one cell of ``benchmarks/server_load.py`` (the same prompts, ``max(8, R C)``
timed requests after an untimed round of C, greedy, ``--max-tokens`` each, full depth and each
``--speedups`` value), but the clients are a loop around :class:`skipdecode.engine.Engine`: a
request that ends is replaced by the next one at once. So it measures what the engine itself
does, and, set against the server's cell, what the HTTP layer and the load-generating client cost
on the same cores. Per policy it reports requests/s, the engine's prefill and decode seconds
(``Engine.prefill_seconds``/``decode_seconds``, timed part only), engine steps, mean rows per
decode step and the prompt tokens reused and computed (prefix caching); per speedup the
requests/s ratio to full depth and ``ceiling``, the ratio the full-depth run's own timings would
give if its decode seconds ran the theoretical speedup faster while its prefill stayed
(Amdahl's law, docs/method.md "the prompt is prefilled at full depth").

Prints a Markdown table, writes ``benchmarks/results/<name>.json`` (repo-relative paths) and a PNG
of the prefill and decode seconds per policy, and ends with one JSON line.

    python benchmarks/engine_load.py --adapter --chat --clients 16 --requests-per-client 6 --align-steps 8
    python benchmarks/engine_load.py --clients 16 --ignore-eos --quantize w8a8 --compile   # a server_load cell's twin
    python benchmarks/engine_load.py --clients 16 --ignore-eos --quantize w8a8 --compile --prompt-repeats 20  # ~700-token prompts
    python benchmarks/engine_load.py --model DIR --clients 2 --requests-per-client 2 --max-tokens 4 --name smoke
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
from server_load import cell_prompts, median_of, prompts, report  # noqa: E402  (the same prompts as the server's cells)
from skipdecode.quantize import QUANTIZE_MODES  # noqa: E402


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model for skipdecode.load (default: the embedded SmolLM2-135M)")
    p.add_argument("--adapter", action=argparse.BooleanOptionalAction, default=False,
                   help="the embedded model's shipped skip adapter (off: stock weights); ignored with --model")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as one chat user turn")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the closed loop")
    p.add_argument("--requests-per-client", type=int, default=6, help="timed requests per client (at least 8 in all)")
    p.add_argument("--speedups", default="1,2", help="comma-separated request speedups (1 = full depth)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--prompt-repeats", type=int, default=1,
                   help="each prompt's text this many times over, joined by spaces: long prompts (an E2E "
                        "prompt is about 35 tokens, so 20 gives about 700)")
    p.add_argument("--max-batch-size", type=int, default=64, help="the engine's slots")
    p.add_argument("--align-steps", type=int, default=8, help="Engine(align_steps=) (serve's default is 8)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="EOS ends no row: every request writes exactly --max-tokens tokens (server_load.py's --ignore-eos)")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZE_MODES),
                   help="skipdecode.load(quantize=) (default: float32 weights)")
    p.add_argument("--compile", action="store_true", help="skipdecode.load(compile=True); compiles before timing")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the cells this many times, alternating their order (1,2 then 2,1, ...); the "
                        "ratios are the medians of each run's (step times drift between runs on a shared host)")
    p.add_argument("--name", default="engine_load", help="results base name under --out")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the results JSON and PNG")
    args = p.parse_args(argv)
    try:
        args.speedups = [float(x) for x in args.speedups.split(",")]
    except ValueError:
        p.error(f"--speedups takes comma-separated numbers, got {args.speedups!r}")
    for option, value, low in (("--clients", args.clients, 1), ("--requests-per-client", args.requests_per_client, 1),
                               ("--max-tokens", args.max_tokens, 1), ("--max-batch-size", args.max_batch_size, 1),
                               ("--align-steps", args.align_steps, 0), ("--threads", args.threads, 1),
                               ("--prompt-repeats", args.prompt_repeats, 1),
                               ("--repeats", args.repeats, 1)):
        if value is not None and value < low:
            p.error(f"{option} must be >= {low}, got {value}")
    if 1.0 not in args.speedups:
        p.error("--speedups must include 1 (full depth: the ratios are to it)")
    return args


def run_cell(sk, texts: list[str], args: argparse.Namespace, speedup: float) -> dict:
    """One policy's closed loop on a fresh engine (empty prefix cache): the row of the table.

    Raises:
        ValueError: a speedup the model cannot plan (``sk.policy_for``).
    """
    from skipdecode.engine import Engine, Request
    from skipdecode.generate import _eos_ids
    from skipdecode.prompts import encode_prompt

    policy = None if speedup == 1.0 else sk.policy_for(speedup=speedup)
    eos = () if args.ignore_eos else _eos_ids(sk.tokenizer, sk.model)
    queue, warm = cell_prompts(texts, args.clients, 0, args.requests_per_client)
    engine = Engine(sk.adapter, args.max_batch_size, align_steps=args.align_steps)

    def request(text: str) -> Request:
        return Request(encode_prompt(sk.tokenizer, text, chat=args.chat), args.max_tokens, policy, eos_token_ids=eos)

    for text in warm:  # untimed: the engine has run this batch size and this policy before the clock
        engine.submit(request(text))
    while engine.busy:
        engine.step()
    before = dict(engine.prefix_cache.stats()) if engine.prefix_cache else {}
    prefill0, decode0, steps0, tokens0 = engine.prefill_seconds, engine.decode_seconds, engine.steps, engine.generated_tokens
    pending = list(queue)
    for _ in range(min(args.clients, len(pending))):
        engine.submit(request(pending.pop(0)))
    rows_in_steps, layers, done = [], [], 0
    start = time.perf_counter()
    with tqdm(total=len(queue), desc=f"{speedup:g}x", unit="req", leave=False) as bar:
        while engine.busy:
            running = len(engine.running)
            events = engine.step()
            if running:
                rows_in_steps.append(running)
            for ev in events:
                if ev.step > 0:
                    layers.append(ev.num_layers_run)
                if ev.finished:
                    done += 1
                    bar.update(1)
                    if pending:
                        engine.submit(request(pending.pop(0)))
    seconds = time.perf_counter() - start
    after = engine.prefix_cache.stats() if engine.prefix_cache else {}
    L = sk.adapter.num_layers
    return {
        "speedup": speedup, "clients": args.clients, "requests": done, "seconds": seconds,
        "requests_per_second": done / seconds, "tokens_per_second": (engine.generated_tokens - tokens0) / seconds,
        "prefill_s": engine.prefill_seconds - prefill0, "decode_s": engine.decode_seconds - decode0,
        "engine_steps": engine.steps - steps0,
        "mean_rows_per_decode_step": sum(rows_in_steps) / len(rows_in_steps) if rows_in_steps else None,
        "theoretical_speedup": L * len(layers) / sum(layers) if layers else None,
        **{k: after.get(k, 0) - before.get(k, 0) for k in ("cached_prompt_tokens", "computed_prompt_tokens")},
    }


def ratios(rows: list[dict]) -> list[dict]:
    """Per speedup: requests/s over full depth's, the decode-step speedup and the Amdahl ceiling
    from full depth's own prefill and decode seconds with this policy's theoretical decode
    speedup, each the median over the repeats (rows carry ``repeat``; one run: its values), with
    each run's requests/s ratio in ``runs``."""
    out = []
    for speedup in dict.fromkeys(r["speedup"] for r in rows if r["speedup"] != 1.0):
        runs = []
        for rep in sorted({r.get("repeat", 0) for r in rows}):
            full = next(r for r in rows if r["speedup"] == 1.0 and r.get("repeat", 0) == rep)
            r = next(x for x in rows if x["speedup"] == speedup and x.get("repeat", 0) == rep)
            theo = r["theoretical_speedup"]
            ceiling = ((full["prefill_s"] + full["decode_s"]) / (full["prefill_s"] + full["decode_s"] / theo)
                       if theo else None)
            runs.append({"requests_per_second_ratio": r["requests_per_second"] / full["requests_per_second"],
                         "decode_speedup": full["decode_s"] / r["decode_s"] if r["decode_s"] else None,
                         "theoretical_speedup": theo, "ceiling_at_theoretical_decode": ceiling})
        out.append({"speedup": speedup, **{k: median_of(runs, k) for k in runs[0]},
                    "runs": [x["requests_per_second_ratio"] for x in runs]})
    return out


def table(rows: list[dict]) -> str:
    """Markdown table of the rows."""
    lines = ["| run | speedup | req/s | tok/s | prefill s | decode s | engine steps | rows/step | theor. | prompt tokens cached / computed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rows_step = f"{r['mean_rows_per_decode_step']:.1f}" if r["mean_rows_per_decode_step"] else ""
        theo = f"{r['theoretical_speedup']:.2f}x" if r["theoretical_speedup"] else ""
        lines.append(f"| {r.get('repeat', 0) + 1} | {r['speedup']:g}x | {r['requests_per_second']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['prefill_s']:.1f} | {r['decode_s']:.1f} | {r['engine_steps']} | {rows_step} | {theo} | "
                     f"{r['cached_prompt_tokens']} / {r['computed_prompt_tokens']} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    """Stacked bars: prefill and decode seconds (and the rest of the loop) per policy; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    many = len({r.get("repeat", 0) for r in rows}) > 1
    names = [f"{r['speedup']:g}x" + (f" run {r.get('repeat', 0) + 1}" if many else "")
             + f"\n{r['requests_per_second']:.2f} req/s" for r in rows]
    prefill = [r["prefill_s"] for r in rows]
    decode = [r["decode_s"] for r in rows]
    rest = [max(0.0, r["seconds"] - p - d) for r, p, d in zip(rows, prefill, decode)]
    fig, ax = plt.subplots(figsize=(max(5.5, 1.4 * len(rows)), 4))
    ax.bar(names, prefill, label="prefill (full depth)")
    ax.bar(names, decode, bottom=prefill, label="decode steps")
    ax.bar(names, rest, bottom=[p + d for p, d in zip(prefill, decode)], label="other")
    ax.set_ylabel("seconds")
    ax.set_title(f"engine load: {result['clients']} clients, {rows[0]['requests']} requests", fontsize=10)
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

    sk = load(args.model, adapter=bool(args.adapter) and args.model is None, quantize=args.quantize,
              compile=args.compile)
    texts = [" ".join([t] * args.prompt_repeats) for t in prompts()]
    rows = []
    for rep in range(args.repeats):  # alternate the order, so that a drift favours no policy
        for s in (args.speedups if rep % 2 == 0 else args.speedups[::-1]):
            rows.append({**run_cell(sk, texts, args, s), "repeat": rep})
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    result = {
        "benchmark": "engine_load", "model": args.model or "embedded SmolLM2-135M-Instruct",
        "adapter": bool(args.adapter and not args.model), "chat": args.chat, "clients": args.clients,
        "max_tokens": args.max_tokens, "prompt_repeats": args.prompt_repeats, "ignore_eos": args.ignore_eos, "quantize": args.quantize,
        "compile": args.compile, "max_batch_size": args.max_batch_size, "align_steps": args.align_steps,
        "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows, "ratios": ratios(rows),
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "results_file": os.path.relpath(path, ROOT),
    }
    summary = [f"{r['speedup']:g}x / full: {r['requests_per_second_ratio']:.2f}x requests/s"
               + (f" (median of {len(r['runs'])} runs: " + ", ".join(f"{x:.2f}" for x in r["runs"]) + ")"
                  if len(r["runs"]) > 1 else "") + "; decode "
               f"{r['decode_speedup'] or float('nan'):.2f}x of theoretical {r['theoretical_speedup'] or float('nan'):.2f}x; "
               f"ceiling {r['ceiling_at_theoretical_decode'] or float('nan'):.2f}x" for r in result["ratios"]]
    report(result, path, plot, table(rows), summary, summary_file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
