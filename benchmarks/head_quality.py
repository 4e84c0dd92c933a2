"""How close each quantized LM head is to the float32 head: next-token top-1 agreement and KL.

The embedded model's float32 decoder runs teacher-forced over E2E test texts (``MR\\nreference``,
one per row of ``testset_w_refs.csv``); at every position its final hidden state goes through
the heads of the same tied matrix: float32 (the reference), int8 (``Int8Linear``), W8A8
(``W8A8Linear``: int8 weights, the hidden state quantized to int8), a plain int4 head
(``Int4Linear``) and the int4 models' head (``RescoredHead``: a preview of every logit, int8
logits for the top candidates; :mod:`skipdecode.rescored_head`) with each of its previews: the
int4 kernel's and the W8A8 one it uses on the CPU. Per head: the share of positions whose
argmax equals float32's, the share equal to the int8 head's, and the mean KL(float32 || head) in
nats per token (the distribution moved by the head alone; decoder layers stay float32).

    python benchmarks/head_quality.py --rows 100

Prints a table, writes ``benchmarks/results/head_quality.json`` (``--output``), ends with one
JSON line. Exit status 2 with a one-line message when the data file is missing.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from skipdecode.data.folder import shared_data_path
from skipdecode.jsonio import dumps
from skipdecode.paths import portable_record

RESULTS = Path(__file__).resolve().parent / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="head_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None, help="E2E testset_w_refs.csv (default: the shared data folder's)")
    p.add_argument("--rows", type=int, default=100, help="texts (rows of the CSV) to run, >= 1")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--output", default=str(RESULTS / "head_quality.json"))
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows must be >= 1, got {args.rows}")
    return args


def heads(weight: torch.Tensor) -> dict[str, torch.nn.Module]:
    """The compared heads of ``weight`` (V, C) float32, by name (float32 first)."""
    from skipdecode.quantize import Int4Linear, Int8Linear
    from skipdecode.rescored_head import RescoredHead

    from skipdecode.w8a8 import W8A8Linear

    float_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    float_head.weight.data = weight
    int4_preview = RescoredHead(weight)
    int4_preview.row_preview = None  # the former preview: PyTorch's int4 kernel
    return {"float32": float_head, "int8": Int8Linear(weight), "w8a8": W8A8Linear(weight),
            "int4 (plain)": Int4Linear(weight),
            "int4 rescored, int4 preview": int4_preview,
            "int4 rescored, W8A8 preview (int4 models' head)": RescoredHead(weight)}


@torch.no_grad()
def compare(sk, texts: list[str]) -> dict[str, dict[str, float]]:
    """Per head: ``top1_vs_float32``, ``top1_vs_int8`` (shares of positions) and ``kl_nats``
    (mean KL(float32 || head) per position), over every position of every text."""
    base = sk.model.get_output_embeddings().weight.detach().contiguous()
    named = heads(base)
    agree = {n: [0, 0] for n in named}
    kl = {n: 0.0 for n in named}
    count = 0
    for text in tqdm(texts, desc="texts", unit="text"):
        ids = sk.tokenizer(text, return_tensors="pt")["input_ids"]
        hidden = sk.model.model(ids).last_hidden_state[0]  # (T, C), after the final norm
        for h in hidden.split(1):  # one position at a time, as a decode step runs the head
            logits = {n: m(h).float() for n, m in named.items()}
            ref, ref8 = logits["float32"], logits["int8"]
            logp_ref = F.log_softmax(ref, -1)
            for n, lg in logits.items():
                agree[n][0] += int(lg.argmax() == ref.argmax())
                agree[n][1] += int(lg.argmax() == ref8.argmax())
                kl[n] += float(F.kl_div(F.log_softmax(lg, -1), logp_ref, log_target=True, reduction="sum"))
            count += 1
    return {n: {"top1_vs_float32": agree[n][0] / count, "top1_vs_int8": agree[n][1] / count,
                "kl_nats": kl[n] / count, "positions": count} for n in named}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    path = Path(shared_data_path(args.data, "e2e/testset_w_refs.csv"))
    if not path.is_file():
        print(f"head_quality.py: --data: no such file {path}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    from skipdecode import load

    with path.open(newline="", encoding="utf-8") as f:
        texts = [f"{r['mr']}\n{r['ref']}" for _, r in zip(range(args.rows), csv.DictReader(f))]
    sk = load()
    result = compare(sk, texts)
    print(f"| head | top-1 = float32 | top-1 = int8 head | KL(float32 || head), nats |  ({result['float32']['positions']} positions)")
    print("|---|---:|---:|---:|")
    for n, r in result.items():
        print(f"| {n} | {r['top1_vs_float32']:.4f} | {r['top1_vs_int8']:.4f} | {r['kl_nats']:.5f} |")
    record = portable_record({"data": str(path), "rows": len(texts), "heads": result,
                              "command": "python benchmarks/head_quality.py " + " ".join(argv if argv is not None else sys.argv[1:])})
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(dumps(record, indent=2) + "\n")
    print(dumps({"rows": len(texts), **{n: r["top1_vs_int8"] for n, r in result.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
