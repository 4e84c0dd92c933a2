"""Quality of int8 (or int4) weights against float32 on E2E: greedy agreement and BLEU difference.

For the first ``--limit`` (100) MRs of the E2E test set (all references per MR), one checkpoint
(``--ckpt``: the best 2x fine-tuned checkpoint, decoded with its own skip policy from its
``skipdecode.json``; ``--speedup``/``--full-depth`` override it) generates greedily, once with float32
weights and once with ``--quantize`` weights (``skipdecode.load(..., quantize=...)``), same
prompts, batches, stop string and token budget. Reported:

- ``identical_share``: share of MRs whose generated token ids are identical;
- ``token_agreement``: share of generated positions (up to the shorter output of each pair) that hold
  the same token, and ``mean_first_divergence`` (tokens before the first difference);
- corpus BLEU (sacrebleu, ``skipdecode.metrics.corpus_bleu``) of each and their difference.

Prints a table, writes ``benchmarks/results/quant_quality.json`` (``--output``) and ends with one
JSON line. The checkpoint is a path option because fine-tuned checkpoints are not in the
repository (``skipdecode train`` writes them; README "Fine-tuning"); ``--ckpt stock`` runs the
untuned embedded model (a smoke test only: its E2E outputs are not meaningful).

    python benchmarks/quant_quality.py --ckpt runs/e2e-2x-150/final              # ~10 min on 2 cores
    python benchmarks/quant_quality.py --ckpt stock --limit 4 --max-new-tokens 8  # smoke test

Exit status 2 with a one-line message on bad arguments, data or checkpoints.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from skipdecode.jsonio import dumps  # strict JSON (NaN/inf -> null)
from skipdecode.paths import portable_record

RESULTS = Path(__file__).resolve().parent / "results"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="quant_quality.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint directory (the 2x fine-tune), or 'stock'")
    p.add_argument("--quantize", choices=["int8", "int4", "w8a8", "head"], default="int8")
    p.add_argument("--data", default=None, help="E2E test CSV with references (default: the shared data folder's)")
    p.add_argument("--limit", type=int, default=100, help="first N MRs")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--speedup", type=float, default=None, help="decode with for_speedup(s) instead of the checkpoint's policy")
    p.add_argument("--full-depth", action="store_true", help="decode at full depth instead of the checkpoint's policy")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--compile", action="store_true",
                   help="the quantized model with load(compile=True) (its prefill and decode steps compiled)")
    p.add_argument("--output", default=str(RESULTS / "quant_quality.json"))
    return p.parse_args(argv)


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _generate(sk, prompts, policy, batch_size, max_new_tokens, stop):
    ids, texts, seconds = [], [], 0.0
    for i in range(0, len(prompts), batch_size):
        res = sk.generate(prompts[i : i + batch_size], policy=policy, max_new_tokens=max_new_tokens, stop=stop)
        ids += res.token_ids
        texts += res.texts
        seconds += res.prefill_seconds + res.decode_seconds
    return ids, texts, seconds


def compare(ids_a: list[list[int]], ids_b: list[list[int]]) -> dict[str, float]:
    """Agreement of two lists of generated id sequences (same items, same order).

    Returns ``identical_share`` (share of identical sequences), ``token_agreement`` (equal
    positions / compared positions, each pair compared up to its shorter length) and
    ``mean_first_divergence`` (mean index of the first differing token; the shorter length
    when one is a prefix of the other), in tokens.
    """
    same = equal = total = 0
    firsts = []
    for a, b in zip(ids_a, ids_b):
        same += a == b
        n = min(len(a), len(b))
        equal += sum(x == y for x, y in zip(a[:n], b[:n]))
        total += n
        firsts.append(next((i for i in range(n) if a[i] != b[i]), n))
    return {
        "identical_share": same / len(ids_a),
        "token_agreement": equal / total if total else 1.0,
        "mean_first_divergence": sum(firsts) / len(firsts),
    }


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    for name in ("limit", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    import torch

    from skipdecode.data import DataError, load_eval_items, select_items, shared_data_path
    from skipdecode.evaluate import TASKS
    from skipdecode.loading import DEFAULT_MODEL, LoadError, load
    from skipdecode.metrics import corpus_bleu

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        data = shared_data_path(args.data, "e2e/testset_w_refs.csv")
        items = select_items(load_eval_items(data, task="e2e"), 0, args.limit, data)
    except (DataError, ValueError) as e:
        _fail(str(e))
    ckpt = DEFAULT_MODEL if args.ckpt == "stock" else args.ckpt
    try:
        float_model = load(ckpt)
        quant_model = load(ckpt, quantize=args.quantize, compile=args.compile)
    except LoadError as e:
        _fail(str(e))
    if args.full_depth:
        policy = float_model.policy_for(max_layers=float_model.num_layers, min_layers=float_model.num_layers)
    elif args.speedup is not None:
        try:
            policy = float_model.policy_for(speedup=args.speedup)
        except ValueError as e:
            _fail(f"--speedup: {e}")
    else:
        policy = float_model.policy
    prompts = [it.prompt for it in items]
    refs = [list(it.references) for it in items]
    stop = list(TASKS["e2e"].stop)
    start = time.perf_counter()
    ids_f, texts_f, sec_f = _generate(float_model, prompts, policy, args.batch_size, args.max_new_tokens, stop)
    ids_q, texts_q, sec_q = _generate(quant_model, prompts, policy, args.batch_size, args.max_new_tokens, stop)
    bleu_f, bleu_q = corpus_bleu(texts_f, refs), corpus_bleu(texts_q, refs)
    result = {
        "checkpoint": args.ckpt,
        "quantize": args.quantize,
        "compile": args.compile,
        "items": len(items),
        "policy": policy.to_dict(),
        **compare(ids_f, ids_q),
        "bleu_float32": bleu_f,
        f"bleu_{args.quantize}": bleu_q,
        "bleu_difference": bleu_q - bleu_f,
        "generation_seconds": {"float32": sec_f, args.quantize: sec_q},
        "resident_bytes": {"float32": float_model.resident_bytes(), args.quantize: quant_model.resident_bytes()},
        "wall_seconds": time.perf_counter() - start,
        "command": shlex.join(["python", "benchmarks/quant_quality.py", *(sys.argv[1:] if argv is None else argv)]),
        "data": str(data),
        "examples": [{"float32": a, args.quantize: b} for a, b in list(zip(texts_f, texts_q))[:5]],
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = portable_record(result)  # repository/data-relative paths
    out.write_text(dumps(result, indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.quantize} vs float32 on the first {len(items)} E2E test MRs ({args.ckpt})",
                  title_justify="left")
    for col in ("identical outputs", "token agreement", "first divergence (tok)", "BLEU float32",
                f"BLEU {args.quantize}", "BLEU diff"):
        table.add_column(col, justify="right")
    table.add_row(f"{result['identical_share']:.1%}", f"{result['token_agreement']:.1%}",
                  f"{result['mean_first_divergence']:.1f}", f"{bleu_f:.2f}", f"{bleu_q:.2f}",
                  f"{bleu_q - bleu_f:+.2f}")
    Console(stderr=True).print(table)
    print(dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
