"""The prompt set of the shipped skip adapter (issue 12): built from ``../shared/data`` plus the
prompts written for this project (``benchmarks/adapter_prompts/own_prompts.txt``, and the train-only
``own_prompts_train.txt``).

The held-out split is drawn from the base set (own prompts, a seeded sample of Spec-Bench, 60 E2E dev
MRs) exactly as when the adapter first shipped, so its sha256 stays comparable across training runs.
The train split then also gets train-only prompts that are never held out: every
``own_prompts_train.txt`` prompt, the Spec-Bench questions the sample did not take, and 150 more E2E
dev MRs; one equal (lowercased, whitespace collapsed) to a held-out prompt is dropped and counted.

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
OWN_TRAIN = HERE / "adapter_prompts" / "own_prompts_train.txt"  # train-only prompts
MANIFEST = HERE / "adapter_prompts" / "manifest.json"
SEED = 12
HELDOUT_SHARE = 0.13
# how many prompts each Spec-Bench category contributes (MT-bench categories: all 10 each)
SPEC_BENCH_TAKE = {"qa": 50, "math_reasoning": 50, "translation": 40, "rag": 30, "summarization": 40}
E2E_TAKE = 60
E2E_TRAIN_TAKE = 150  # train-only: more E2E dev MRs, none of the E2E_TAKE ones
TRAIN_SEED = SEED + 1  # draws the train-only E2E MRs (the held-out draw keeps SEED's rng)
# the README's run command's two prompts: always held out, so the demo shows unseen prompts
ALWAYS_HELDOUT = ("own-3", "own-4")
ARTICLE_WORDS = 120   # CNN/DM articles are cut to their first 120 words
RAG_CONTEXT_WORDS = 90  # Spec-Bench RAG passages are cut to their first 90 words, question kept


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _own(path: Path | None = None, source: str = "own") -> list[dict]:
    """The prompts of ``path`` (default ``OWN``): ``category<TAB>prompt`` lines, ``\\n`` a newline,
    ``#`` comments; id ``<source>-<line number>``."""
    rows = []
    for n, line in enumerate((path or OWN).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        category, prompt = line.split("\t", 1)
        rows.append({"id": f"{source}-{n}", "source": source, "category": category,
                     "prompt": prompt.replace("\\n", "\n")})
    return rows


def _words(text: str, n: int) -> str:
    words = text.split()
    return " ".join(words[:n]) + (" ..." if len(words) > n else "")


def _spec_row(d: dict, cat: str) -> dict:
    """One Spec-Bench question ``d`` of category ``cat`` as a prompt row (first turn; CNN/DM articles
    and RAG passages cut to ``ARTICLE_WORDS`` / ``RAG_CONTEXT_WORDS`` words)."""
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
    return {"id": f"specbench-{d['question_id']}", "source": source, "category": cat, "prompt": text}


def _spec_bench(data_dir: Path, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(taken, not taken): ``SPEC_BENCH_TAKE`` questions sampled per category (all of the MT-bench
    categories), and the rest of the sampled categories' questions, which are train-only."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    with open(data_dir / "cnn_dailymail" / "spec_bench_question.jsonl", encoding="utf-8") as fh:
        for line in fh:
            by_cat[json.loads(line)["category"]].append(json.loads(line))
    taken, rest = [], []
    for cat in sorted(by_cat):
        items = by_cat[cat]
        if cat in SPEC_BENCH_TAKE:
            picked = rng.sample(items, SPEC_BENCH_TAKE[cat])
            ids = {id(d) for d in picked}
            rest += [_spec_row(d, cat) for d in items if id(d) not in ids]
            items = picked
        taken += [_spec_row(d, cat) for d in items]
    return taken, rest


def _e2e_mrs(data_dir: Path) -> list[str]:
    """The distinct meaning representations of the E2E dev set, in file order."""
    with open(data_dir / "e2e" / "devset.csv", encoding="utf-8", newline="") as fh:
        return list(dict.fromkeys(row["mr"] for row in csv.DictReader(fh)))


def _e2e_rows(mrs: list[str], picked: list[int]) -> list[dict]:
    return [{"id": f"e2e-dev-{i}", "source": "e2e", "category": "data-to-text",
             "prompt": f"Write one sentence describing this restaurant.\n{mrs[i]}"} for i in sorted(picked)]


def normalize(text: str) -> str:
    """``text`` lowercased with every run of whitespace made one space (the duplicate test)."""
    return " ".join(text.lower().split())


def _split(rows: list[dict], rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(train, heldout): ``HELDOUT_SHARE`` of every (source, category) stratum of ``rows`` (at least
    one of each stratum with 5 or more) plus ``ALWAYS_HELDOUT``, drawn with ``rng``."""
    strata: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        strata[(r["source"], r["category"])].append(r)
    held: set[str] = set(ALWAYS_HELDOUT)
    for key in sorted(strata):
        items = strata[key]
        k = round(HELDOUT_SHARE * len(items)) if len(items) >= 5 else 0
        k = max(k, 1) if len(items) >= 5 else k
        held.update(r["id"] for r in rng.sample([r for r in items if r["id"] not in held], k))
    return [r for r in rows if r["id"] not in held], [r for r in rows if r["id"] in held]


def _drop_heldout(rows: list[dict], heldout: list[dict]) -> tuple[list[dict], list[str]]:
    """(kept rows, ids dropped): a row is dropped when its normalized prompt equals a held-out one's."""
    held = {normalize(r["prompt"]) for r in heldout}
    kept = [r for r in rows if normalize(r["prompt"]) not in held]
    return kept, [r["id"] for r in rows if normalize(r["prompt"]) in held]


def build_splits(data_dir: str | Path | None = None, train_only: bool = True) -> dict:
    """``{"train", "heldout", "dropped"}``: the two splits (prompt rows, ``{"id", "source",
    "category", "prompt"}`` each) and the ids of the train-only prompts dropped because they equal
    (after :func:`normalize`) a held-out prompt.

    The held-out split is drawn first, from the base set (``own_prompts.txt``, ``SPEC_BENCH_TAKE``
    Spec-Bench questions, ``E2E_TAKE`` E2E MRs), by :func:`_split`. With ``train_only`` the train
    split then also gets, never held out: every ``own_prompts_train.txt`` prompt (``own-train``),
    the Spec-Bench questions the base set did not take, and ``E2E_TRAIN_TAKE`` more E2E MRs (seed
    ``TRAIN_SEED``). The held-out split is the same with or without them.

    Raises:
        FileNotFoundError: a data file is missing under ``data_dir``.
        skipdecode.data.DataError: no ``data_dir`` given and no shared data folder found.
    """
    from skipdecode.data import shared_data_path

    data_dir = Path(shared_data_path(data_dir))
    rng = random.Random(SEED)
    spec, spec_rest = _spec_bench(data_dir, rng)
    mrs = _e2e_mrs(data_dir)
    used = rng.sample(range(len(mrs)), E2E_TAKE)
    train, heldout = _split(_own() + spec + _e2e_rows(mrs, used), rng)
    if not train_only:
        return {"train": train, "heldout": heldout, "dropped": []}
    unused = sorted(set(range(len(mrs))) - set(used))
    more = random.Random(TRAIN_SEED).sample(unused, min(E2E_TRAIN_TAKE, len(unused)))
    added, dropped = _drop_heldout(_own(OWN_TRAIN, "own-train") + spec_rest + _e2e_rows(mrs, more), heldout)
    return {"train": train + added, "heldout": heldout, "dropped": dropped}


def build(data_dir: str | Path | None = None, train_only: bool = True) -> tuple[list[dict], list[dict]]:
    """(train, heldout) of :func:`build_splits` (same arguments and errors)."""
    splits = build_splits(data_dir, train_only)
    return splits["train"], splits["heldout"]


def manifest(train: list[dict], heldout: list[dict], dropped: list[str] | None = None) -> dict:
    """The manifest: per split the ids with each prompt's sha256, per-source counts and one sha256
    over the split's prompts (joined with NUL, in file order); with ``dropped``, the ids of the
    train-only prompts dropped as equal to a held-out prompt (:func:`build_splits`)."""
    out = {"seed": SEED, "train_seed": TRAIN_SEED, "heldout_share": HELDOUT_SHARE,
           "article_words": ARTICLE_WORDS, "rag_context_words": RAG_CONTEXT_WORDS, "splits": {}}
    if dropped is not None:
        out["train_only_dropped"] = list(dropped)
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
    dropped = build_splits(args.data)["dropped"]
    if args.write_manifest:
        MANIFEST.write_text(json.dumps(manifest(train, heldout, dropped), indent=1) + "\n")
    problems = check_manifest(train, heldout)
    for p in problems:
        print("manifest mismatch:", p, file=sys.stderr)
    out = Path(args.out)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    m = manifest(train, heldout)["splits"]
    print(json.dumps({"train": m["train"]["n"], "heldout": m["heldout"]["n"], "train_sha256": m["train"]["sha256"],
                      "heldout_sha256": m["heldout"]["sha256"], "train_by_source": m["train"]["by_source"],
                      "heldout_by_source": m["heldout"]["by_source"], "train_only_dropped": len(dropped),
                      "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
