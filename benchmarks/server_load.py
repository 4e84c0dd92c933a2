"""Server load: requests/s, tokens/s, latency and time to first token of ``skipdecode serve`` under
1, 4, 16 and 64 concurrent clients, in-flight batching against one-at-a-time (``--serial``).

For each mode, each number of concurrent clients C and each speedup (a fresh server process on
loopback per cell, so every cell starts with an empty prefix cache), C clients (the official
``openai`` client, streaming with ``include_usage``) each send their share of
``max(8, R C)`` E2E-style prompts (R = ``--requests-per-client``, default 2) one after another, ``--max-tokens`` new tokens each (greedy), at
full depth and at each ``--speedup`` (the request's ``speedup`` field). Prompts come from the E2E
test set in the shared data folder (the eval prompt template), else from built-in MRs.

A row ends at EOS unless ``--ignore-eos`` sends ``ignore_eos: true`` (vLLM's extension, as its
serving benchmark does): then every request writes exactly ``--max-tokens`` tokens at every policy,
so requests/s compares equal work (otherwise a policy whose answers run longer serves fewer
requests for the same tokens/s). ``--quantize`` and ``--compile`` are passed to ``serve``.

The servers run with automatic prefix caching (``--no-prefix-cache`` turns it off). The cells of
one client count, full depth and each speedup alike, in both modes, take the same consecutive
prompts (``prompt_offset`` in the row), so the policies are compared on the same work; no prompt
repeats within a cell, and only what prompts really share (the chat template's system prompt, the
E2E instruction, an MR's opening fields) is reused. Each row records the prompt
tokens its cell reused and computed (``cached_prompt_tokens``, ``computed_prompt_tokens``, from
``/health``, warm-up included), and the seconds the server's engine spent in prefills and in
decode steps and its decode steps during the timed part (``engine_prefill_s``,
``engine_decode_s``, ``engine_decode_steps``; the rest of the cell's ``seconds`` it waited for
requests or delivered events).

Prints a Markdown table and ends with one JSON line; writes ``benchmarks/results/server_load.json``
(repo-relative paths). Targets (issue 10): at 16 clients, in-flight full depth >= 3x the
requests/s of serial full depth, and in-flight 2x >= 1.5x in-flight full depth.

    python benchmarks/server_load.py                                    # embedded SmolLM2-135M
    python benchmarks/server_load.py --clients 16 --modes inflight --ignore-eos --quantize w8a8 --compile
    python benchmarks/server_load.py --clients 1,4 --max-tokens 8 --model DIR --name smoke  # quick look

Needs ``pip install -e ".[bench]"`` (the ``openai`` client). Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)
from skipdecode.quantize import QUANTIZE_MODES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FALLBACK_MRS = [
    "name[The Eagle], eatType[coffee shop], food[French], priceRange[moderate], area[riverside]",
    "name[Blue Spice], eatType[pub], food[Chinese], area[city centre], familyFriendly[yes]",
    "name[The Mill], eatType[restaurant], food[Italian], priceRange[cheap], near[Café Rouge]",
    "name[Aromi], eatType[coffee shop], customer rating[5 out of 5], area[riverside]",
]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="server_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="model for `skipdecode serve --model` (None: the embedded one)")
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrent clients")
    p.add_argument("--speedups", default="1,2", help="comma-separated request speedups (1 = full depth)")
    p.add_argument("--modes", default="inflight,serial", help="inflight and/or serial")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send `ignore_eos: true` (vLLM's extension), so every request writes exactly "
                        "--max-tokens tokens at every policy (off: rows end at EOS)")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="timed requests per client in a cell (at least 8 per cell)")
    p.add_argument("--max-batch-size", type=int, default=64, help="in-flight server: rows decoding at once")
    p.add_argument("--cohort-size", type=int, default=1,
                   help="in-flight server: waiting requests join in cohorts of at least this many rows")
    p.add_argument("--align-steps", type=int, default=0,
                   help="in-flight server: `serve --align-steps` (hold waiting requests, at most this many "
                        "steps, while every running row is older; 0: off, whereas `serve` defaults to 8)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="`serve --stream-interval`: tokens per streamed event (first and last token at once)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="serve with `--no-prefix-cache` (off: the servers reuse shared prompt prefixes; "
                        "each row records the prompt tokens reused and computed, from /health)")
    p.add_argument("--adapter", action=argparse.BooleanOptionalAction, default=False,
                   help="serve the embedded model with its shipped skip adapter (the users' default); "
                        "off: the stock weights. Ignored with --model")
    p.add_argument("--chat", action="store_true",
                   help="send chat completions (the adapter's training format) instead of text completions")
    p.add_argument("--threads", type=int, default=None,
                   help="the server's torch threads (`skipdecode serve --threads`; default: torch's, one per core)")
    p.add_argument("--device", default="cpu", help="`skipdecode serve --device`")
    p.add_argument("--dtype", default="float32", help="`skipdecode serve --dtype`")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZE_MODES),
                   help="`skipdecode serve --quantize` (None: float32 weights)")
    p.add_argument("--compile", action="store_true",
                   help="`skipdecode serve --compile` (the server compiles before it answers /health)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each client count's cells this many times, alternating the speedups' order "
                        "(1,2 then 2,1, ...), each on a fresh server; pairs and targets take the median of "
                        "each run's ratio (step times drift between runs on a shared host)")
    p.add_argument("--name", default="server_load", help="results base name under --out")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="only redraw the PNG beside a saved result JSON, then exit")
    args = p.parse_args(argv)
    try:
        args.clients = [int(x) for x in args.clients.split(",")]
        args.speedups = [float(x) for x in args.speedups.split(",")]
    except ValueError:
        p.error("--clients and --speedups take comma-separated numbers")
    args.modes = args.modes.split(",")
    checks = [("--modes", ",".join(args.modes), "inflight and/or serial", set(args.modes) <= {"inflight", "serial"}),
              ("--clients", ",".join(map(str, args.clients)), ">= 1", min(args.clients) >= 1),
              ("--speedups", ",".join(f"{x:g}" for x in args.speedups), "finite numbers >= 1 (1 = full depth)",
               all(math.isfinite(x) and x >= 1 for x in args.speedups)),
              ("--max-tokens", args.max_tokens, ">= 1", args.max_tokens >= 1),
              ("--requests-per-client", args.requests_per_client, ">= 1", args.requests_per_client >= 1),
              ("--threads", args.threads, ">= 1", args.threads is None or args.threads >= 1),
              ("--repeats", args.repeats, ">= 1", args.repeats >= 1),
              ("--stream-interval", args.stream_interval, ">= 1", args.stream_interval >= 1)]
    for option, value, allowed, ok in checks:
        if not ok:
            p.error(f"{option} must be {allowed}, got {value}")
    if args.align_steps < 0:
        p.error(f"--align-steps must be >= 0, got {args.align_steps}")
    if args.align_steps and "inflight" not in args.modes:
        p.error("--align-steps applies to the in-flight server; add --modes inflight or drop it")
    if not 1 <= args.cohort_size <= args.max_batch_size:
        p.error(f"--cohort-size must be in [1, --max-batch-size={args.max_batch_size}], got {args.cohort_size}")
    return args


def prompts() -> list[str]:
    """E2E test prompts (eval template) from the shared data folder, else the built-in MRs."""
    try:
        from skipdecode.data import load_eval_items, shared_data_path

        return [it.prompt for it in load_eval_items(shared_data_path(None, "e2e/testset_w_refs.csv"), task="e2e")]
    except Exception:  # noqa: BLE001 - any data problem: fall back to built-in prompts
        pass
    from skipdecode.data import TEMPLATES

    return [TEMPLATES["e2e"].format(mr=mr) for mr in FALLBACK_MRS]


def start_server(args: argparse.Namespace, serial: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "from skipdecode.cli import main; main()", "serve", "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--name", "bench",
           "--max-batch-size", str(args.max_batch_size), "--max-waiting", "4096"]
    if args.model:
        cmd += ["--model", args.model]
    elif not args.adapter:  # the stock weights (every request names its speedup either way)
        cmd.append("--no-adapter")
    if args.no_prefix_cache:
        cmd.append("--no-prefix-cache")
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.quantize:
        cmd += ["--quantize", args.quantize]
    if args.compile:
        cmd.append("--compile")
    if serial:
        cmd.append("--serial")
    else:
        if args.cohort_size != 1:
            cmd += ["--cohort-size", str(args.cohort_size)]
        cmd += ["--align-steps", str(args.align_steps)]  # always: the server's own default is 8
    if args.stream_interval != 1:
        cmd += ["--stream-interval", str(args.stream_interval)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("error: the server did not start within 600 s")


def scheduler_stats(url: str) -> dict:
    """The server's scheduler statistics from ``/health`` ({} for a server without them, the
    one-at-a-time ``--serial`` one)."""
    import httpx

    health = httpx.get(url + "/health", timeout=10).json()
    stats = dict(health.get("scheduler") or {})
    if health.get("compile"):  # graphs compiled after the server's start-up (each one stalls every stream)
        stats["graphs_after_start"] = health["compile"]["graphs_after_start"]
    return stats


def engine_deltas(before: dict, after: dict) -> dict:
    """What the server's engine did between two :func:`scheduler_stats`: the prompt tokens its
    prefix cache reused and computed, and its seconds in prefills and in decode steps and its
    decode steps (``engine_prefill_s``, ``engine_decode_s``, ``engine_decode_steps``), and the
    graphs torch.compile compiled meanwhile (``graphs_compiled``: a compile inside a timed cell
    stalls it for a second or more; the cell is then not a fair measure); 0 where the server does
    not report them."""
    pb, pa = before.get("prefix_cache") or {}, after.get("prefix_cache") or {}
    out = {k: pa[k] - pb[k] if k in pa and k in pb else 0 for k in ("cached_prompt_tokens", "computed_prompt_tokens")}
    for key, name in (("prefill_seconds", "engine_prefill_s"), ("decode_seconds", "engine_decode_s"),
                      ("decode_steps", "engine_decode_steps"), ("graphs_after_start", "graphs_compiled")):
        out[name] = after[key] - before[key] if key in after and key in before else 0
    return out


async def one_request(client, prompt: str, max_tokens: int, speedup: float,
                      chat: bool = False, served_model: str = "bench",
                      ignore_eos: bool = False) -> tuple[float, float, int, dict]:
    """(latency s, time to first token s, completion tokens, the server's ``usage.skipdecode``
    statistics ({} without them)) of one streamed request: a text completion of ``prompt``, or
    with ``chat`` a chat completion of one user message ``prompt``; ``ignore_eos`` asks for
    exactly ``max_tokens`` new tokens."""
    extra = {"speedup": speedup}  # always explicit: never the server's default policy
    if ignore_eos:
        extra["ignore_eos"] = True
    common = dict(model=served_model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    t0 = time.perf_counter()
    first = None
    tokens, stats = 0, {}
    if chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    async for chunk in stream:
        text = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) if chunk.choices else None
        if first is None and text:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            stats = (chunk.usage.model_extra or {}).get("skipdecode") or {}
    end = time.perf_counter()
    return end - t0, (first or end) - t0, tokens, stats


def engine_means(stats: list[dict]) -> dict:
    """Means over a cell's requests of the server's own statistics: ``step_ms`` (decode time per
    decode step of a request, ms), ``prefill_s`` (its prefill, s), ``theoretical_speedup`` and
    ``batch_rows`` (rows sharing its steps); None where no request reported one."""
    def mean(key: str, scale: float = 1.0):
        vals = [s[key] * scale for s in stats if isinstance(s.get(key), (int, float))]
        return float(np.mean(vals)) if vals else None

    return {"step_ms": mean("step_seconds", 1000.0), "prefill_s": mean("prefill_seconds"),
            "theoretical_speedup": mean("theoretical_speedup"), "batch_rows": mean("mean_batch_rows")}


def cell_size(clients: int, per_client: int = 2) -> int:
    """Requests of one load cell (``max(8, per_client x clients)``) plus its ``clients`` warm-up
    requests."""
    return max(8, per_client * clients) + clients


def cell_prompts(texts: list[str], clients: int, offset: int, per_client: int = 2) -> tuple[list[str], list[str]]:
    """The timed prompts and the warm-up prompts of a cell: ``texts[offset : offset +
    cell_size(clients, per_client)]`` (cyclically), the last ``clients`` for the warm-up."""
    block = [texts[(offset + i) % len(texts)] for i in range(cell_size(clients, per_client))]
    return block[:-clients], block[-clients:]


async def load(url: str, texts: list[str], clients: int, speedup: float, max_tokens: int,
               chat: bool = False, served_model: str = "bench", offset: int = 0, per_client: int = 2,
               ignore_eos: bool = False, server_pid: int | None = None) -> dict:
    """One load cell: ``clients`` concurrent streaming clients send ``max(8, per_client x clients)``
    requests to the server at ``url`` (serving ``served_model``), after an untimed warm-up round of
    ``clients`` concurrent requests with the same settings on other prompts.
    The cell uses prompts ``texts[offset : offset + cell_size(clients, per_client)]`` (cyclically),
    the last ``clients`` for the warm-up; no prompt repeats within a cell, so the prefix cache only reuses
    what prompts really share. Returns requests/s, tokens/s (from the server's ``usage``),
    tokens per request, p50/p95 latency and time to first token (seconds), the server's own
    per-request means (:func:`engine_means`), the CPU the timed part used (:func:`cpu_use`;
    the server's with ``server_pid``) and what the engine did in it (``engine_prefill_s``,
    ``engine_decode_s``, ``engine_decode_steps``: :func:`engine_deltas`)."""
    from openai import AsyncOpenAI

    queue, warm = cell_prompts(texts, clients, offset, per_client)
    total = len(queue)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        # warm-up, untimed: one round of `clients` concurrent requests at the cell's settings, so
        # that a fresh server has run this batch size and this policy before the clock starts
        await asyncio.gather(*(one_request(client, w, max_tokens, speedup, chat, served_model, ignore_eos)
                               for w in warm))
        results: list[tuple[float, float, int, dict]] = []

        async def worker(k: int) -> None:
            for prompt in queue[k::clients]:
                results.append(await one_request(client, prompt, max_tokens, speedup, chat, served_model,
                                                 ignore_eos))

        stats0 = scheduler_stats(url)
        cpu0 = cpu_snapshot(server_pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        seconds = time.perf_counter() - t0
        cpu = cpu_use(cpu0, cpu_snapshot(server_pid), server_pid)
        timed = {k: v for k, v in engine_deltas(stats0, scheduler_stats(url)).items()
                 if k.startswith("engine_") or k == "graphs_compiled"}
    if timed.get("graphs_compiled"):
        print(f"warning: the server compiled {timed['graphs_compiled']} graph(s) inside this timed cell "
              f"({clients} clients, speedup {speedup}): the cell includes their compile time", file=sys.stderr)
    lat = np.array([r[0] for r in results])
    ttft = np.array([r[1] for r in results])
    tokens = sum(r[2] for r in results)
    return {
        "clients": clients, "speedup": speedup, "requests": total, "seconds": seconds,
        "requests_per_second": total / seconds, "tokens_per_second": tokens / seconds,
        "completion_tokens": tokens, "tokens_per_request": tokens / total,
        "latency_p50": float(np.percentile(lat, 50)), "latency_p95": float(np.percentile(lat, 95)),
        "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p95": float(np.percentile(ttft, 95)),
        **engine_means([r[3] for r in results]), **cpu, **timed,
    }


def _thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid``, from ``/proc`` ({} where
    it cannot be read: not Linux, or the process is gone)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (proc(5))
    return out


def cpu_snapshot(server_pid: int | None) -> tuple[float, dict[int, float]]:
    """(this process's CPU seconds, all threads, from ``time.process_time``; the server's CPU
    seconds per thread, {} without ``server_pid``)."""
    return time.process_time(), (_thread_seconds(server_pid) if server_pid else {})


def cpu_use(before: tuple[float, dict[int, float]], after: tuple[float, dict[int, float]],
            server_pid: int | None = None) -> dict:
    """CPU seconds between two :func:`cpu_snapshot`: ``client_cpu_s`` (the load client: the
    ``openai`` client, its event loop), and where the server's threads were read,
    ``server_cpu_s`` (all its threads) and ``server_loop_cpu_s`` (its main thread, which runs
    uvicorn's event loop: HTTP, JSON, the streams); the rest is the engine thread and PyTorch's
    worker threads. Both share the host's cores with the engine (docs/serving.md)."""
    out = {"client_cpu_s": after[0] - before[0], "server_cpu_s": None, "server_loop_cpu_s": None}
    if before[1] and after[1]:
        out["server_cpu_s"] = sum(after[1].values()) - sum(before[1].values())
        if server_pid in after[1]:  # the main thread's id is the process id
            out["server_loop_cpu_s"] = after[1][server_pid] - before[1].get(server_pid, 0.0)
    return out


def table(rows: list[dict]) -> str:
    head = ("| run | mode | clients | speedup | req/s | tok/s | tokens/req | p50 latency s | p95 latency s | "
            "p50 TTFT s | p95 TTFT s | step ms | theor. | CPU s: client / server loop |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        per_req = r.get("tokens_per_request", r["completion_tokens"] / r["requests"])
        step = f"{r['step_ms']:.0f}" if r.get("step_ms") is not None else ""
        theo = f"{r['theoretical_speedup']:.2f}x" if r.get("theoretical_speedup") is not None else ""
        cpu = " / ".join(f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("client_cpu_s", "server_loop_cpu_s"))
        lines.append(f"| {r.get('repeat', 0) + 1} | {r['mode']} | {r['clients']} | {r['speedup']:g}x | {r['requests_per_second']:.2f} | "
                     f"{r['tokens_per_second']:.1f} | {per_req:.1f} | {r['latency_p50']:.2f} | {r['latency_p95']:.2f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} | {step} | {theo} | {cpu} |")
    return "\n".join(lines)


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of ``run[key]`` over ``runs`` (None when any is None)."""
    values = [x[key] for x in runs]
    return None if any(v is None for v in values) else float(np.median(values))


def _cell(rows: list[dict], mode: str, clients: int, speedup: float, repeat: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["clients"] == clients and r["speedup"] == speedup
                 and r.get("repeat", 0) == repeat), None)


def pairs(rows: list[dict]) -> list[dict]:
    """Per client count with in-flight full-depth and 2x cells: the 2x/full requests/s, the
    decode-step speedup (full step ms / 2x step ms, from the server's statistics) and
    ``ceiling_at_theoretical_steps``, the 2x/full latency ratio the full cell's own timings
    would give if its decode part (p50 latency - p50 TTFT) ran the theoretical speedup faster
    while its prefill (TTFT, full depth in both, docs/method.md) stayed: ``lat / (ttft + (lat - ttft) / theor.)``
    (Amdahl's law). Where the measured ratio is far below it, decode steps lose; where the ceiling
    itself is low, the full-depth prefill dominates the request. Each value is the median over the
    repeats (rows carry ``repeat``; one run: its values), each run's ratio within its own run;
    ``runs`` lists the runs' requests/s ratios."""
    out = []
    for clients in sorted({r["clients"] for r in rows}):
        runs = []
        for rep in sorted({r.get("repeat", 0) for r in rows}):
            full, two = _cell(rows, "inflight", clients, 1.0, rep), _cell(rows, "inflight", clients, 2.0, rep)
            if full is None or two is None:
                continue
            theo, lat, ttft = two.get("theoretical_speedup"), full["latency_p50"], full["ttft_p50"]
            runs.append({
                "requests_per_second_ratio": two["requests_per_second"] / full["requests_per_second"],
                "step_speedup": full["step_ms"] / two["step_ms"] if full.get("step_ms") and two.get("step_ms") else None,
                "theoretical_speedup": theo,
                "ceiling_at_theoretical_steps": lat / (ttft + (lat - ttft) / theo) if theo else None,
            })
        if runs:
            out.append({"clients": clients, **{k: median_of(runs, k) for k in runs[0]},
                        "runs": [x["requests_per_second_ratio"] for x in runs]})
    return out


def targets(rows: list[dict]) -> dict:
    """Issue 10's targets at 16 clients (None where a needed cell was not run): in flight over one
    at a time at full depth (medians of the repeats' requests/s), and the 2x / full ratio (the
    median of the repeats' ratios, :func:`pairs`)."""
    def rps(mode: str, speedup: float):
        values = [r["requests_per_second"] for r in rows
                  if r["mode"] == mode and r["clients"] == 16 and r["speedup"] == speedup]
        return float(np.median(values)) if values else None

    full_in, full_serial = rps("inflight", 1.0), rps("serial", 1.0)
    inflight_over_serial = full_in / full_serial if full_in and full_serial else None
    two_over_full = next((p["requests_per_second_ratio"] for p in pairs(rows) if p["clients"] == 16), None)
    return {
        "inflight_over_serial_at_16": inflight_over_serial,
        "inflight_over_serial_target": 3.0,
        "two_x_over_full_at_16": two_over_full,
        "two_x_over_full_target": 1.5,
        "met": None if inflight_over_serial is None or two_over_full is None
        else bool(inflight_over_serial >= 3.0 and two_over_full >= 1.5),
    }


def plot(result: dict, path: Path) -> Path:
    """Requests/s and p50 latency (s) against concurrent clients, one line per (mode, speedup); PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rps, ax_lat) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["mode"], r["speedup"]) for r in result["rows"]})
    for mode, speedup in keys:  # one point per client count: the median over the repeats
        rows = [r for r in result["rows"] if r["mode"] == mode and r["speedup"] == speedup]
        clients = sorted({r["clients"] for r in rows})
        label = f"{'in flight' if mode == 'inflight' else 'one at a time'}, {speedup:g}x"
        style = "-o" if mode == "inflight" else "--s"
        for ax, key in ((ax_rps, "requests_per_second"), (ax_lat, "latency_p50")):
            ax.plot(clients, [median_of([r for r in rows if r["clients"] == c], key) for c in clients], style, label=label)
    for ax, name in ((ax_rps, "requests/s"), (ax_lat, "p50 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_lat.set_yscale("log")
    ax_rps.legend(fontsize=8)
    fig.suptitle(f"skipdecode serve under load ({result['model']}, {result['device']}, "
                 f"at most {result['max_tokens']} new tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_client(coro):
    """Run the load client's coroutine on uvloop's event loop where it is installed (a
    dependency of skipdecode, as the server's), else asyncio's: the client shares the cores
    with the server, and uvloop costs it less CPU (``client_cpu_s``)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_cell(args: argparse.Namespace, texts: list[str], mode: str, clients: int, speedup: float,
             offset: int) -> dict:
    """One cell on a fresh server (``mode``), so that its prefix cache starts empty: the row of
    :func:`load` plus the mode, the prompt offset and the prompt tokens the server reused and
    computed (warm-up included, from ``/health``)."""
    proc, url = start_server(args, serial=mode == "serial")
    try:
        before = scheduler_stats(url)
        row = {"mode": mode, "prompt_offset": offset,
               **run_client(load(url, texts, clients, speedup, args.max_tokens, args.chat, offset=offset,
                                 per_client=args.requests_per_client, ignore_eos=args.ignore_eos,
                                 server_pid=proc.pid))}
        after = scheduler_stats(url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    deltas = engine_deltas(before, after)  # the prompt tokens: warm-up included
    row.update({k: deltas[k] for k in ("cached_prompt_tokens", "computed_prompt_tokens")})
    print(f"{mode} clients={clients} speedup={speedup:g}: {row['requests_per_second']:.2f} req/s, "
          f"{row['tokens_per_second']:.1f} tok/s", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.replot is not None:  # redraw the PNG of a saved result
        saved = json.loads(args.replot.read_text())
        print(plot(saved, args.replot.with_suffix(".png")))
        return
    texts = prompts()
    rows: list[dict] = []
    for mode in args.modes:
        offset = 0  # every mode the same prompts; the speedups of one client count the same ones too
        for clients in args.clients:
            for rep in range(args.repeats):  # alternate the order, so that a drift favours no policy
                for speedup in (args.speedups if rep % 2 == 0 else args.speedups[::-1]):
                    rows.append({**run_cell(args, texts, mode, clients, speedup, offset), "repeat": rep})
            offset += cell_size(clients, args.requests_per_client)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    result = {
        "benchmark": "server_load", "model": args.model or "embedded SmolLM2-135M-Instruct",
        "adapter": bool(args.adapter and not args.model), "endpoint": "chat" if args.chat else "completions",
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "max_batch_size": args.max_batch_size,
        "cohort_size": args.cohort_size, "align_steps": args.align_steps, "stream_interval": args.stream_interval, "prefix_cache": not args.no_prefix_cache, "device": args.device, "server_threads": args.threads,
        "dtype": args.dtype, "quantize": args.quantize, "compile": args.compile, "repeats": args.repeats, "rows": rows, "pairs": pairs(rows), "targets": targets(rows),
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])]),
        "results_file": os.path.relpath(path, ROOT),
    }
    summary = [f"{p['clients']} clients: 2x/full {p['requests_per_second_ratio']:.2f}x requests/s"
               + (f" (median of {len(p['runs'])} runs: " + ", ".join(f"{x:.2f}" for x in p["runs"]) + ")"
                  if len(p["runs"]) > 1 else "") + "; decode steps "
               f"{p['step_speedup'] or float('nan'):.2f}x of theoretical {p['theoretical_speedup'] or float('nan'):.2f}x; "
               f"ceiling with theoretical steps {p['ceiling_at_theoretical_steps'] or float('nan'):.2f}x"
               for p in result["pairs"]]
    report(result, path, plot, table(rows), summary)


def report(result: dict, path: Path, plot_fn, table_text: str, summary: list[str], summary_file=sys.stdout) -> None:
    """Write ``result`` to ``path`` (indented JSON) and its PNG beside it (``plot_fn(result,
    png_path)``), print the Markdown table, the summary lines (to ``summary_file``) and last the
    result as one JSON line (shared with benchmarks/engine_load.py)."""
    from skipdecode.bench.runner import cpu_description

    result.setdefault("cpu", cpu_description())  # hosts sold under one name differ (docs/serving.md)
    path.write_text(dumps(result, indent=2) + "\n")
    plot_fn(result, path.with_suffix(".png"))
    print(table_text)
    for line in summary:
        print(line, file=summary_file)
    print(dumps(result))


if __name__ == "__main__":
    main()
