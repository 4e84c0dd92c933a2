"""The prompt set of the shipped skip adapter (issue 12): built from ``../shared/data`` plus the
prompts written for this project (``benchmarks/adapter_prompts/own_prompts.txt``).

The data files are read by path and never copied: :func:`build` derives the prompts from them
deterministically (fixed seed, fixed truncation) and :func:`check_manifest` compares the result with
``benchmarks/adapter_prompts/manifest.json`` (ids, split, a sha256 per prompt and per split), so a
rebuild on another machine is verified to be the same set. Sources and licences:
``benchmarks/adapter_prompts/SOURCES.md``.

Run ``python benchmarks/adapter_prompts.py`` to build, check and write ``train.jsonl`` /
``heldout.jsonl`` (one ``{"id", "source", "category", "prompt"}`` per line) under ``--out``
(default ``runs/adapter-prompts``, git-ignored); ``--write-manifest`` rewrites the manifest.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OWN = HERE / "adapter_prompts" / "own_prompts.txt"
MANIFEST = HERE / "adapter_prompts" / "manifest.json"
SEED = 12
HELDOUT_SHARE = 0.13
# how many prompts each Spec-Bench category contributes (MT-bench categories: all 10 each)
SPEC_BENCH_TAKE = {"qa": 50, "math_reasoning": 50, "translation": 40, "rag": 30, "summarization": 40}
E2E_TAKE = 60
# the README's run command's two prompts: always held out, so the demo shows unseen prompts
ALWAYS_HELDOUT = ("own-3", "own-4")
ARTICLE_WORDS = 120   # CNN/DM articles are cut to their first 120 words
RAG_CONTEXT_WORDS = 90  # Spec-Bench RAG passages are cut to their first 90 words, question kept


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _own() -> list[dict]:
    rows = []
    for n, line in enumerate(OWN.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        category, prompt = line.split("\t", 1)
        rows.append({"id": f"own-{n}", "source": "own", "category": category,
                     "prompt": prompt.replace("\\n", "\n")})
    return rows


def _words(text: str, n: int) -> str:
    words = text.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


def _spec_bench(data_dir: Path, rng: random.Random) -> list[dict]:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    with open(data_dir / "cnn_dailymail" / "spec_bench_question.jsonl", encoding="utf-8") as fh:
        for line in fh:
            by_cat[json.loads(line)["category"]].append(json.loads(line))
    rows = []
    for cat in sorted(by_cat):
        items = by_cat[cat]
        if cat in SPEC_BENCH_TAKE:
            items = rng.sample(items, SPEC_BENCH_TAKE[cat])
        for d in items:
            text = d["turns"][0]
            if cat == "summarization":
                article = text.removeprefix("Summarize: ")
                text = "Summarize this news article in two sentences.\n\n" + _words(article, ARTICLE_WORDS)
                source = "cnndm"
            elif cat == "rag":
                context, question = text.rsplit("\n", 1)
                text = f"{_words(context, RAG_CONTEXT_WORDS)}\n\nBased on the text above: {question.strip()}"
                source = "specbench-rag"
            else:
                source = "specbench-" + (cat if cat in SPEC_BENCH_TAKE else "mtbench")
            rows.append({"id": f"specbench-{d['question_id']}", "source": source, "category": cat, "prompt": text})
    return rows


def _e2e(data_dir: Path, rng: random.Random) -> list[dict]:
    with open(data_dir / "e2e" / "devset.csv", encoding="utf-8", newline="") as fh:
        mrs = list(dict.fromkeys(row["mr"] for row in csv.DictReader(fh)))
    picked = sorted(rng.sample(range(len(mrs)), E2E_TAKE))
    return [{"id": f"e2e-dev-{i}", "source": "e2e", "category": "data-to-text",
             "prompt": f"Write one sentence describing this restaurant.\n{mrs[i]}"} for i in picked]


def build(data_dir: str | Path | None = None) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt rows, ``{"id", "source", "category", "prompt"}`` each.

    The held-out split takes ``HELDOUT_SHARE`` of every (source, category) stratum (at least one
    prompt of each stratum with 5 or more), seeded, so it covers every kind of prompt; the README
    run command's two prompts (``ALWAYS_HELDOUT``) are held out too. ``data_dir`` (the ``--data``
    option) defaults to the shared data folder.

    Raises:
        FileNotFoundError: a data file is missing under ``data_dir``.
        skipdecode.data.DataError: no ``data_dir`` given and no shared data folder found.
    """
    from skipdecode.data import shared_data_path

    data_dir = Path(shared_data_path(data_dir))
    rng = random.Random(SEED)
    rows = _own() + _spec_bench(data_dir, rng) + _e2e(data_dir, rng)
    strata: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        strata[(r["source"], r["category"])].append(r)
    held: set[str] = set(ALWAYS_HELDOUT)
    for key in sorted(strata):
        items = strata[key]
        k = round(HELDOUT_SHARE * len(items)) if len(items) >= 5 else 0
        k = max(k, 1) if len(items) >= 5 else k
        held.update(r["id"] for r in rng.sample([r for r in items if r["id"] not in held], k))
    train = [r for r in rows if r["id"] not in held]
    heldout = [r for r in rows if r["id"] in held]
    return train, heldout


def manifest(train: list[dict], heldout: list[dict]) -> dict:
    """The manifest: per split the ids with each prompt's sha256, per-source counts and one sha256
    over the split's prompts (joined with NUL, in file order)."""
    out = {"seed": SEED, "heldout_share": HELDOUT_SHARE, "article_words": ARTICLE_WORDS,
           "rag_context_words": RAG_CONTEXT_WORDS, "splits": {}}
    for name, rows in (("train", train), ("heldout", heldout)):
        out["splits"][name] = {
            "n": len(rows),
            "by_source": dict(sorted(Counter(r["source"] for r in rows).items())),
            "sha256": sha256_text("\0".join(r["prompt"] for r in rows)),
            "prompts": [[r["id"], sha256_text(r["prompt"])] for r in rows],
        }
    return out


def check_manifest(train: list[dict], heldout: list[dict]) -> list[str]:
    """Differences between the built set and the committed manifest (empty: identical)."""
    want = json.loads(MANIFEST.read_text())
    got = manifest(train, heldout)
    problems = []
    for name in ("train", "heldout"):
        if want["splits"][name]["sha256"] != got["splits"][name]["sha256"]:
            w = dict(want["splits"][name]["prompts"])
            g = dict(got["splits"][name]["prompts"])
            diff = sorted(k for k in set(w) | set(g) if w.get(k) != g.get(k))
            problems.append(f"{name}: {len(diff)} prompts differ from the manifest (first: {diff[:5]})")
    return problems


def write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def build_or_exit(data_dir: str | Path | None, mismatch: str | None = None) -> tuple[list[dict], list[dict]]:
    """:func:`build` for the scripts' ``--data`` option: a missing data folder or file is a one-line
    error on stderr and exit status 2 (``SystemExit``), not a traceback. With ``mismatch``, a prompt
    set that differs from the committed manifest is fatal too: ``mismatch`` and each problem on
    stderr, exit status 1."""
    from skipdecode.data import DataError

    try:
        train, heldout = build(data_dir)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    problems = check_manifest(train, heldout) if mismatch else []
    if problems:
        print(mismatch, *problems, sep="\n  ", file=sys.stderr)
        raise SystemExit(1)
    return train, heldout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="data folder (default: ../shared/data or SKIPDECODE_DATA)")
    ap.add_argument("--out", default=str(REPO / "runs" / "adapter-prompts"))
    ap.add_argument("--write-manifest", action="store_true", help="rewrite the committed manifest")
    args = ap.parse_args()
    train, heldout = build_or_exit(args.data)
    if args.write_manifest:
        MANIFEST.write_text(json.dumps(manifest(train, heldout), indent=1) + "\n")
    problems = check_manifest(train, heldout)
    for p in problems:
        print("manifest mismatch:", p, file=sys.stderr)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    m = manifest(train, heldout)["splits"]
    print(json.dumps({"train": m["train"]["n"], "heldout": m["heldout"]["n"], "train_sha256": m["train"]["sha256"],
                      "heldout_sha256": m["heldout"]["sha256"], "heldout_by_source": m["heldout"]["by_source"],
                      "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
