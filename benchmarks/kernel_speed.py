"""Kernel microbenchmark: one matrix product per linear shape of the model, per weight kernel.

Explains the decode step's floor (issue 11): for each linear shape of the model (SmolLM2-135M:
q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536, LM head 49152x576), batch 1 and 8,
1 and 2 threads, it times float32 ``F.linear``, ``_weight_int8pack_mm``, the compiled fused int8
product, PyTorch's int4 kernel (``_weight_int4pack_mm_for_cpu``) and the compiled fused int4
product (skipdecode.bench.kernels), each with its effective GB/s (weight bytes / time) next to
the read bandwidth of a ``sum()`` at the same thread count, a bare per-call overhead, and the sum
over one full-depth decode step (every linear of every layer + the head) against a measured step
time if given. Prints a table, writes ``benchmarks/results/kernel_speed.json``, ends with one
JSON line.

    python benchmarks/kernel_speed.py --step-ms 39.4          # the embedded model, ~5-10 min
    python benchmarks/kernel_speed.py --model /tmp/tiny --repeats 2 --kernels float32,int4pack --output /tmp/k.json

Run it on a quiet machine (nothing else on the cores): the numbers are wall-clock times.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from skipdecode.bench.kernels import KERNELS, kernel_rows, model_shapes, overhead_ms, step_sums
from skipdecode.bench_engines import measure_bandwidth
from skipdecode.jsonio import dumps
from skipdecode.paths import portable, portable_record

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "kernel_speed.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kernel_speed.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model id, directory or .gguf (skipdecode.load)")
    p.add_argument("--batch-sizes", default="1,8", help="comma list of rows per product")
    p.add_argument("--threads", default="1,2", help="comma list of torch thread counts")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list from {', '.join(KERNELS)}")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per product (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per product (compiles the fused ones)")
    p.add_argument("--step-ms", type=float, default=None, help="a measured full-depth decode step (ms) to compare with")
    p.add_argument("--step-ms-threads", type=int, default=2, help="thread count of --step-ms")
    p.add_argument("--bandwidth-mb", type=int, default=512, help="MB read by the bandwidth probe")
    p.add_argument("--output", default=str(DEFAULT_OUT), help="JSON file to write")
    args = p.parse_args(argv)
    args.batch_sizes = _ints(args.batch_sizes, "batch-sizes")
    args.threads = _ints(args.threads, "threads")
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [k for k in args.kernels if k not in KERNELS]
    if bad or not args.kernels:
        _fail(f"--kernels items must be {', '.join(KERNELS)}, got {bad[0] if bad else args.kernels!r}")
    for name in ("repeats", "bandwidth_mb"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        _fail(f"--warmup must be >= 0, got {args.warmup}")
    return args


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _ints(text: str, name: str) -> list[int]:
    from skipdecode.bench import parse_int_list

    try:
        return parse_int_list(text, f"--{name}")
    except ValueError as e:
        _fail(str(e))


def _table(result: dict) -> Table:
    bw = {b["threads"]: b["read_gbs"] for b in result["bandwidth"]}
    over = {(o["threads"], o["batch_size"]): o["ms"] for o in result["overhead"]}
    t = Table(title="one product per linear shape: median ms | effective GB/s (weight bytes / time)")
    for col in ("threads", "batch", "shape (N x K)", "kernel", "ms", "GB/s", "read GB/s", "call overhead ms"):
        t.add_column(col, justify="left" if col in ("shape (N x K)", "kernel") else "right")
    for r in result["rows"]:
        shape = f"{r['shape']} {r['out_features']}x{r['in_features']}"
        ms = f"{r['ms']:.4f}" if "ms" in r else r.get("error", "-")[:30]
        gbs = f"{r['gbs']:.1f}" if "gbs" in r else "-"
        t.add_row(str(r["threads"]), str(r["batch_size"]), shape, r["kernel"], ms, gbs,
                  f"{bw[r['threads']]:.1f}", f"{over[(r['threads'], r['batch_size'])]:.4f}")
    return t


def _step_table(result: dict) -> Table:
    t = Table(title=f"sum over one full-depth decode step ({result['num_layers']} layers x "
                    f"{result['linears_per_layer']} linears + head)")
    for col in ("threads", "batch", "kernel", "step ms", "GB/s", "calls", "calls x overhead ms", "measured step ms"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    for s in result["step_sums"]:
        t.add_row(str(s["threads"]), str(s["batch_size"]), s["kernel"], f"{s['step_ms']:.2f}", f"{s['gbs']:.1f}",
                  str(s["calls"]), f"{s['overhead_ms']:.2f}",
                  "-" if s.get("measured_step_ms") is None else f"{s['measured_step_ms']:.2f}")
    return t


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result written to ``--output``."""
    args = _parse(argv)
    import skipdecode

    try:
        sk = skipdecode.load(args.model, adapter=False)
    except Exception as exc:  # a bad --model: one line, exit 2
        _fail(f"--model {args.model!r} cannot be loaded: {exc}")
    shapes = model_shapes(sk.adapter.layers, sk.model.get_output_embeddings())
    rows, bandwidth, overhead = [], [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth.append({"threads": threads, **measure_bandwidth(args.bandwidth_mb)})
        for B, ms in overhead_ms(args.batch_sizes, threads).items():
            overhead.append({"threads": threads, "batch_size": B, "ms": ms})
        rows += kernel_rows(shapes, args.batch_sizes, threads, args.kernels, args.repeats, args.warmup)
    sums = step_sums(rows, sk.adapter.num_layers)
    over = {(o["threads"], o["batch_size"]): o["ms"] for o in overhead}
    for s in sums:
        s["overhead_ms"] = s["calls"] * over[(s["threads"], s["batch_size"])]
        measured = args.step_ms if (s["threads"] == args.step_ms_threads and s["batch_size"] == 1) else None
        s["measured_step_ms"] = measured
        s["share_of_measured"] = None if measured is None else s["step_ms"] / measured
    result = {
        "benchmark": "kernel_speed",
        "model": portable(str(args.model)),
        "num_layers": sk.adapter.num_layers,
        "linears_per_layer": sum(s["per_layer"] for s in shapes),
        "shapes": [{k: v for k, v in s.items() if k != "weight"} for s in shapes],
        "batch_sizes": args.batch_sizes,
        "threads": args.threads,
        "kernels": args.kernels,
        "repeats": args.repeats,
        "bandwidth": bandwidth,
        "overhead": overhead,
        "rows": rows,
        "step_sums": sums,
        "measured_step_ms": args.step_ms,
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "command": "python " + " ".join(shlex.quote(portable(a)) for a in [
            "benchmarks/kernel_speed.py", *(sys.argv[1:] if argv is None else argv)]),
        "output": portable(str(Path(args.output).resolve())),
    }
    result = portable_record(result)
    console = Console(width=160)
    console.print(_table(result))
    console.print(_step_table(result))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1) + "\n")
    print(dumps(result))
    return result


if __name__ == "__main__":
    main()
