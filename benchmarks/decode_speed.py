"""Decode-speed benchmark of SkipDecode (same as ``skipdecode bench``; see src/skipdecode/bench/).

On the embedded default model (SmolLM2-135M-Instruct, 30 layers, float32, CPU), in ONE run:
per-step decode time and tokens/s at each batch size for full depth and the 2x, 3x and 5x
policies, next to Hugging Face ``generate`` on the same model and prompts; prints a table, then
one JSON line; writes ``benchmarks/results/decode_speed.json`` and ``decode_speed.png``.

    python benchmarks/decode_speed.py --batch-sizes 1,8,32 --repeats 3 --new-tokens 32
    python benchmarks/decode_speed.py --batch-sizes 1,8 --profile     # + where a step's time goes
    python benchmarks/decode_speed.py --device cuda --dtype bfloat16  # on a GPU

int8/int4 weights and the compiled step, each row with its memory floor, and llama.cpp
(docs/quantization.md; about 20-30 minutes on a quiet 2-core machine):

    python benchmarks/decode_speed.py --variants float32,float32+compile,int8+compile,int4+compile \
        --llamacpp default --threads 2 --output benchmarks/results/decode_speed_quant.json

All options: ``python benchmarks/decode_speed.py --help``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from skipdecode.cli import app

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "decode_speed.json"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("--output", "--out", "-o") or a.startswith(("--output=", "--out=")) for a in args):
        args += ["--output", str(DEFAULT_OUTPUT)]
    app(["bench", *args], prog_name="decode_speed.py")


if __name__ == "__main__":
    main()
