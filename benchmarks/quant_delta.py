"""How much of a fine-tune's weight change survives weight-only quantization (int8, int4).

A skip fine-tune moves the decoder weights of its base model by a small delta ``D = W - B``; the
quantized weight ``Q(W)`` keeps the share ``<Q(W) - B, D> / |D|^2`` of it (the projection of what
reaches the base model onto the delta: 1 when the delta survives, 0 when quantization snaps the
weights back to where they came from). Next to it: the Frobenius norms of the delta and of the
quantization error ``Q(W) - W``, summed over every decoder-layer linear (``skipdecode.quantize``'s
schemes: int8 per output channel, int4 in groups of 32 with bfloat16 step and zero).

When the int4 error is larger than the delta, the quantized fine-tune is closer to a quantized
*base* model than to the fine-tune: under its skip policy it then writes what the untuned model
writes there (word salad). That is what `benchmarks/results/quant_quality_int4.json` shows.

    python benchmarks/quant_delta.py --ckpt runs/e2e-2x-150-noprompt/checkpoint-00000100
    python benchmarks/quant_delta.py --ckpt smollm2-135m-instruct --with-adapter --output benchmarks/results/quant_delta_adapter.json

Prints a table, writes ``benchmarks/results/quant_delta.json`` (``--output``), ends with one JSON
line. Exit status 2 with a one-line message on bad arguments or checkpoints.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)
from skipdecode.paths import portable_record

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("int8", "int4")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quant_delta.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True, help="fine-tuned checkpoint directory")
    p.add_argument("--base", default=None, help="its base model: id, directory or .gguf (default: the embedded model)")
    p.add_argument("--with-adapter", action="store_true",
                   help="merge the skip adapter shipped for --ckpt (the delta is then the adapter's)")
    p.add_argument("--output", default=str(RESULTS / "quant_delta.json"))
    return p.parse_args(argv)


@torch.no_grad()
def delta_survival(fine: torch.nn.Module, base: torch.nn.Module, modes=MODES) -> dict:
    """Per quantization mode, how much of ``fine``'s change from ``base`` survives.

    Args:
        fine, base: two models of one architecture (the same decoder-layer linears, in order).
        modes: quantization modes of :mod:`skipdecode.quantize`.

    Returns:
        ``{"delta_norm": |W - B|, "linears": n, mode: {"error_norm": |Q(W) - W|,
        "kept_share": <Q(W) - B, W - B> / |W - B|^2}}`` (Frobenius norms over every decoder-layer
        linear; weights in float32).

    Raises:
        ValueError: the models' decoder linears differ in count or shape, or are equal (no delta).
    """
    from skipdecode.adapters import get_adapter
    from skipdecode.quantize import Int4Linear, Int8Linear, _is_linear, _linear_weight

    def linears(model):
        return [_linear_weight(m)[0] for layer in get_adapter(model).layers for m in layer.modules() if _is_linear(m)]

    fw, bw = linears(fine), linears(base)
    if len(fw) != len(bw) or any(a.shape != b.shape for a, b in zip(fw, bw)):
        raise ValueError("ckpt and base must have the same decoder linears (count and shapes)")
    make = {"int8": Int8Linear, "int4": lambda w: Int4Linear(w, kernel=False)}
    delta2, out = 0.0, {m: {"error2": 0.0, "kept": 0.0} for m in modes}
    for w, b in zip(fw, bw):
        w, b = w.float(), b.float()
        d = w - b
        delta2 += d.pow(2).sum().item()
        for mode in modes:
            q = make[mode](w).dequantized().float()
            out[mode]["error2"] += (q - w).pow(2).sum().item()
            out[mode]["kept"] += ((q - b) * d).sum().item()
    if delta2 == 0:
        raise ValueError("ckpt and base have equal decoder weights: there is no fine-tuning delta")
    result = {"delta_norm": delta2 ** 0.5, "linears": len(fw)}
    for mode in modes:
        result[mode] = {"error_norm": out[mode]["error2"] ** 0.5, "kept_share": out[mode]["kept"] / delta2}
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the measurement described in the module docstring; returns 0 (exits 2 on bad input)."""
    args = _parse(argv)
    import skipdecode
    from skipdecode.loading import LoadError

    try:
        fine = skipdecode.load(args.ckpt, adapter=args.with_adapter).model
        base = skipdecode.load(args.base, adapter=False).model
        result = delta_survival(fine, base)
    except (LoadError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fine-tune delta |W - B| = {result['delta_norm']:.3f} over {result['linears']} linears")
    for col in ("weights", "|Q(W) - W|", "delta kept"):
        table.add_column(col, justify="right")
    for mode in MODES:
        table.add_row(mode, f"{result[mode]['error_norm']:.3f}", f"{100 * result[mode]['kept_share']:.1f} %")
    Console().print(table)
    record = portable_record({"ckpt": args.ckpt, "with_adapter": args.with_adapter, "base": args.base or "embedded SmolLM2-135M-Instruct", **result,
                              "command": shlex.join(["python", "benchmarks/quant_delta.py", *(sys.argv[1:] if argv is None else argv)]),
                              "output": args.output})
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(record, indent=1) + "\n")
    print(dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
