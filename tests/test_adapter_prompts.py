"""The skip adapter's prompt set (``benchmarks/adapter_prompts.py``) with its train-only sources:
the held-out split is the one drawn before they existed, they never land in it, one equal to a
held-out prompt (after normalization) is dropped, and ``own_prompts_train.txt`` parses. Runs on a
small fake data folder written in ``tmp_path`` (never on ``../shared/data``); loads no model."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest

from conftest import load_benchmark

MTBENCH = ["coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"]
N_PER_TAKEN_CATEGORY = 80
N_MRS = 300
# sha256 of the held-out prompts (joined with NUL) that the builder before the train-only sources
# (commit da8d48e) draws from this fake folder: the train-only sources must not move the draw
FAKE_HELDOUT_SHA256 = "37eef5ad74ff0d99627e8e399fdb4dd24f79335c5f304490aedd38ef5bb49089"


def _question(qid: int, cat: str, k: int) -> dict:
    if cat == "summarization":
        text = "Summarize: " + " ".join(f"story{k}word{j}" for j in range(150))
    elif cat == "rag":
        text = " ".join(f"passage{k}word{j}" for j in range(100)) + f"\nWhat is fact number {k}?"
    elif cat == "translation":
        text = f"Translate German to English: Satz Nummer {k}."
    else:
        text = f"{cat} question number {k}?"
    return {"question_id": qid, "category": cat, "turns": [text, "a second turn"]}


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory) -> Path:
    """A data folder shaped like ``../shared/data``: Spec-Bench with 10 questions per MT-bench
    category and 80 per sampled category, and an E2E dev set of ``N_MRS`` distinct MRs."""
    root = tmp_path_factory.mktemp("data")
    (root / "cnn_dailymail").mkdir()
    qid = 0
    with open(root / "cnn_dailymail" / "spec_bench_question.jsonl", "w", encoding="utf-8") as fh:
        for cat in MTBENCH + ["qa", "math_reasoning", "translation", "rag", "summarization"]:
            for k in range(10 if cat in MTBENCH else N_PER_TAKEN_CATEGORY):
                qid += 1
                fh.write(json.dumps(_question(qid, cat, k)) + "\n")
    (root / "e2e").mkdir()
    with open(root / "e2e" / "devset.csv", "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mr", "ref"])
        for i in range(N_MRS):
            for k in range(2):  # two references per MR, as in the real dev set
                w.writerow([f"name[Place {i}], food[French], area[riverside]", f"Place {i} is French{'.' * (k + 1)}"])
    return root


@pytest.fixture()
def script():
    return load_benchmark("adapter_prompts")


def _sha(rows: list[dict]) -> str:
    return hashlib.sha256("\0".join(r["prompt"] for r in rows).encode("utf-8")).hexdigest()


def test_heldout_split_is_the_same_with_and_without_train_only_sources(script, fake_data):
    base_train, base_held = script.build(fake_data, train_only=False)
    train, held = script.build(fake_data)
    assert held == base_held
    assert _sha(held) == FAKE_HELDOUT_SHA256  # the draw of the builder before train-only sources
    assert train[:len(base_train)] == base_train  # the old train split, then the added prompts
    assert len(train) > len(base_train) + 800


def test_train_only_prompts_never_land_in_heldout(script, fake_data):
    base_train, base_held = script.build(fake_data, train_only=False)
    train, held = script.build(fake_data)
    base_ids = {r["id"] for r in base_train + base_held}
    added = [r for r in train if r["id"] not in base_ids]
    held_ids = {r["id"] for r in held}
    assert not held_ids & {r["id"] for r in added}
    own_lines = [line for line in script.OWN_TRAIN.read_text(encoding="utf-8").splitlines()
                 if line.strip() and not line.startswith("#")]
    by_source: dict[str, list[dict]] = {}
    for r in added:
        by_source.setdefault(r["source"], []).append(r)
    assert len(by_source["own-train"]) == len(own_lines)
    # every Spec-Bench question is used exactly once: the ones the sample left out are the added ones
    spec_ids = [r["id"] for r in train + held if r["id"].startswith("specbench-")]
    assert len(spec_ids) == len(set(spec_ids)) == len(MTBENCH) * 10 + 5 * N_PER_TAKEN_CATEGORY
    left_out = sum(N_PER_TAKEN_CATEGORY - k for k in script.SPEC_BENCH_TAKE.values())
    assert sum(len(v) for k, v in by_source.items() if k.startswith("specbench-") or k == "cnndm") == left_out
    summary = "Summarize this news article in two sentences.\n\n"
    assert all(r["prompt"].startswith(summary) and r["prompt"].endswith(" ...") for r in by_source["cnndm"])
    assert all("\n\nBased on the text above: What is fact number" in r["prompt"] for r in by_source["specbench-rag"])
    # more E2E MRs, none of the ones the base set uses, same prompt template
    e2e_base = {r["prompt"] for r in base_train + base_held if r["source"] == "e2e"}
    e2e_added = {r["prompt"] for r in by_source["e2e"]}
    assert len(e2e_added) == script.E2E_TRAIN_TAKE and not e2e_added & e2e_base
    assert all(p.startswith("Write one sentence describing this restaurant.\nname[Place ") for p in e2e_added)


def test_train_only_prompt_equal_to_a_heldout_prompt_after_normalization_is_dropped(
        script, fake_data, tmp_path, monkeypatch):
    own_train = tmp_path / "own_prompts_train.txt"
    own_train.write_text("# comment\ninstruction\t  WRITE one   sentence about THE sea.  \n"
                         "instruction\tName five kinds of cheese.\nquestion\tName three colors, please.\n",
                         encoding="utf-8")
    monkeypatch.setattr(script, "OWN_TRAIN", own_train)
    splits = script.build_splits(fake_data)
    held_prompts = {r["prompt"] for r in splits["heldout"]}
    assert "Write one sentence about the sea." in held_prompts  # own-3: always held out
    train_ids = {r["id"] for r in splits["train"]}
    assert splits["dropped"] == ["own-train-2"] and "own-train-2" not in train_ids
    assert {"own-train-3", "own-train-4"} <= train_ids  # not equal to a held-out prompt: kept
    assert splits["heldout"] == script.build(fake_data, train_only=False)[1]
    m = script.manifest(splits["train"], splits["heldout"], splits["dropped"])
    assert m["train_only_dropped"] == ["own-train-2"]


def test_own_prompts_train_file_parses(script):
    norm = script.normalize
    categories = {r["category"] for r in script._own()}
    own = {norm(r["prompt"]) for r in script._own()}
    lines = script.OWN_TRAIN.read_text(encoding="utf-8").splitlines()
    rows = script._own(script.OWN_TRAIN, "own-train")
    assert len(rows) >= 850
    for r in rows:
        n = int(r["id"].removeprefix("own-train-"))
        assert lines[n - 1] == f"{r['category']}\t{r['prompt']}".replace("\n", "\\n"), r["id"]
        assert r["category"] in categories, r
        assert r["prompt"].strip() == r["prompt"] and r["prompt"] and "\t" not in r["prompt"], r
    texts = [norm(r["prompt"]) for r in rows]
    assert len(set(texts)) == len(texts), sorted(t for t in set(texts) if texts.count(t) > 1)
    assert not own & set(texts), sorted(own & set(texts))
    assert all(line.startswith("#") or line.count("\t") == 1 for line in lines if line.strip())
