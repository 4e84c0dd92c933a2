"""Evaluation harness (skipdecode.evaluate) and the `skipdecode eval` command, on tiny models.

Offline and independent of the shared data folder: items are written to tmp_path.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import load_benchmark, make_model
from skipdecode.cli import app
from skipdecode.data import DataError, EvalItem, load_eval_items
from skipdecode.evaluate import TASKS, Report, combine_reports, detect_task, evaluate, resolve_policy
from skipdecode.metrics import score_all
from skipdecode.model import SkipModel
from skipdecode.policy import FullPolicy, LinearDecayPolicy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
L = 6
RECORDS = [
    {"prompt": "name[The Eagle], eatType[coffee shop]", "references": ["The Eagle is a coffee shop.", "A coffee shop."]},
    {"prompt": "name[Blue Spice], food[French]", "references": ["Blue Spice serves French food."]},
    {"prompt": "Describe the restaurant in one sentence.", "references": "A cheap family friendly pub."},
    {"prompt": "The quick brown fox", "references": ["jumps over the lazy dog."]},
    {"prompt": "Summarize the article.", "references": ["The fox jumps.", "A dog sleeps.", "River bank."]},
]



@pytest.fixture(scope="module")
def sk(tokenizer):
    return SkipModel(make_model("llama", L, seed=1), tokenizer, chat=False, source="tiny-llama")


@pytest.fixture
def items_file(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    return path


class Recorder:
    """Wraps ``sk.generate`` to keep every GenerationResult the harness gets (by policy)."""

    def __init__(self, sk, monkeypatch):
        self.calls = []
        original = sk.generate

        def generate(prompts, **kw):
            res = original(prompts, **kw)
            self.calls.append((list(prompts), kw["policy"].to_dict(), kw["max_new_tokens"], res))
            return res

        monkeypatch.setattr(sk, "generate", generate)

    def timed(self, policy: dict, max_new_tokens: int):
        return [c for c in self.calls if c[1] == policy and c[2] == max_new_tokens]


def test_evaluate_end_to_end_report(sk, items_file, monkeypatch):
    items = load_eval_items(items_file)
    rec = Recorder(sk, monkeypatch)
    report = evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=9, stop=(), warmup=True)
    assert isinstance(report, Report)
    # one row per policy, the full-depth reference first although it was not asked for
    assert [(r.model, r.policy) for r in report.rows] == [("tiny-llama", "full"), ("tiny-llama", "2x")]
    full, skip = report.rows
    assert full.reference and not skip.reference and skip.reference_policy == "full"
    assert full.theoretical_speedup == 1.0 and full.wallclock_speedup == 1.0 and full.decode_speedup == 1.0
    assert full.mean_active_layers == L
    assert skip.policy_config == sk.policy_for(speedup=2.0).to_dict()
    assert isinstance(sk.policy_for(speedup=2.0), LinearDecayPolicy)
    for row in report.rows:
        calls = rec.timed(row.policy_config, 9)  # the untimed warm-up call used 8 tokens
        assert [len(c[0]) for c in calls] == [2, 2, 1]
        results = [c[3] for c in calls]
        steps = sum(r.decode_steps for r in results)
        layers = sum(sum(r.layers_run) for r in results)
        assert steps > 0
        assert row.decode_steps == steps and row.layers_run == layers
        # realised theoretical speedup: sum over batches of L*steps / sum of layers run
        assert row.theoretical_speedup == pytest.approx(L * steps / layers)
        assert row.mean_active_layers == pytest.approx(layers / steps)
        assert row.generations == [t.strip() for r in results for t in r.texts]
        assert row.new_tokens == sum(sum(r.new_tokens) for r in results)
        assert row.tokens_per_second > 0 and row.step_seconds > 0
        assert row.n_items == 5 and len(row.finish_reasons) == 5 and row.batch_size == 2
        refs = [list(it.references) for it in items]
        assert row.scores == pytest.approx(score_all(row.generations, refs, TASKS["plain"].metrics))
    assert skip.theoretical_speedup > 1.0
    assert skip.wallclock_speedup == pytest.approx(skip.tokens_per_second / full.tokens_per_second)
    assert skip.decode_speedup == pytest.approx(full.step_seconds / skip.step_seconds)


def test_rows_report_the_batch_that_ran_when_items_are_fewer(sk, items_file):
    """Two items at batch_size 8 ran as one batch of 2: the rows (and the table's batch column)
    say 2, not the setting; the run's record keeps the setting."""
    items = load_eval_items(items_file)[:2]
    report = evaluate(sk, items, [2.0], batch_size=8, max_new_tokens=4, stop=(), warmup=False)
    assert [r.batch_size for r in report.rows] == [2, 2]
    assert report.meta["batch_size"] == 8


def test_inflight_eval_same_generations_and_row_step_speedup(sk, items_file):
    """--inflight: every item through one in-flight engine per policy; greedy outputs equal the
    static batches', the theoretical speedup counts each item's own decode steps."""
    items = load_eval_items(items_file)
    static = evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=9, stop=(), warmup=False)
    inflight = evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=9, stop=(), warmup=False, inflight=True)
    assert inflight.meta["inflight"] is True and static.meta["inflight"] is False
    policy = sk.policy_for(speedup=2.0)
    alone = [sk.generate([it.prompt], max_new_tokens=9, policy=policy, stop=()) for it in items]
    row_steps = sum(len(a.layers_run) for a in alone)
    row_layers = sum(sum(a.layers_run) for a in alone)
    for s_row, i_row in zip(static.rows, inflight.rows):
        assert i_row.generations == s_row.generations
        assert i_row.n_items == 5
    skip = inflight.rows[1]
    assert skip.decode_steps == row_steps and skip.layers_run == row_layers
    assert skip.theoretical_speedup == pytest.approx(L * row_steps / row_layers)


def test_warm_up_takes_the_path_of_the_timed_calls(sk, items_file, monkeypatch):
    """The untimed warm-up runs each row as its timed calls will: in flight through the engine
    (max_batch_size, cohort_size, prefix_cache as the timed call), else a static batch; a warm-up
    on the static path only left the engine's first timed row to run it cold."""
    items = load_eval_items(items_file)
    calls = []
    real = SkipModel.generate

    def spy(self, prompts, **kw):
        calls.append((len(prompts), kw.get("max_batch_size"), kw.get("cohort_size", 1), kw["max_new_tokens"]))
        return real(self, prompts, **kw)

    monkeypatch.setattr(SkipModel, "generate", spy)
    evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=9, stop=(), warmup=True, inflight=True, cohort_size=2)
    # full depth and 2x: two warm-ups (first batch, 8 tokens), then two timed runs over all 5 items
    assert calls == [(2, 2, 2, 8), (2, 2, 2, 8), (5, 2, 2, 9), (5, 2, 2, 9)]
    calls.clear()
    evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=9, stop=(), warmup=True)
    assert calls[:2] == [(2, None, 1, 8), (2, None, 1, 8)] and all(c[1] is None for c in calls)


def test_inflight_eval_cohorts_reach_the_engine_and_keep_generations(sk, items_file, monkeypatch):
    """cohort_size goes to the in-flight engine (recorded in meta), the generations are unchanged,
    and a cohort larger than the batch is refused naming cohort_size."""
    import skipdecode.engine as engine_mod

    items = load_eval_items(items_file)
    base = evaluate(sk, items, [2.0], batch_size=3, max_new_tokens=9, stop=(), warmup=False, inflight=True)
    seen = []
    real = engine_mod.Engine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("cohort_size"))
        real(self, *a, **kw)
    monkeypatch.setattr(engine_mod.Engine, "__init__", spy)
    cohort = evaluate(sk, items, [2.0], batch_size=3, max_new_tokens=9, stop=(), warmup=False, inflight=True,
                      cohort_size=2)
    assert seen and set(seen) == {2} and cohort.meta["cohort_size"] == 2 and base.meta["cohort_size"] == 1
    for a, b in zip(base.rows, cohort.rows):
        assert a.generations == b.generations
    with pytest.raises(ValueError, match="cohort_size"):
        evaluate(sk, items, [2.0], batch_size=3, max_new_tokens=9, stop=(), warmup=False, inflight=True, cohort_size=4)


def test_sort_by_length_batches_by_length_and_keeps_item_order(sk, items_file, monkeypatch):
    items = list(load_eval_items(items_file))
    one = {it.prompt: evaluate(sk, [it], [2.0], batch_size=1, max_new_tokens=6, stop=(), warmup=False)
           for it in items}  # each item alone: no padding, no batch effects
    rec = Recorder(sk, monkeypatch)
    report = evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=6, stop=(), warmup=False, sort_by_length=True)
    assert report.meta["sort_by_length"] is True
    by_len = sorted((it.prompt for it in items), key=len, reverse=True)
    for row in report.rows:
        batches = [c[0] for c in rec.timed(row.policy_config, 6)]
        assert batches == [by_len[0:2], by_len[2:4], by_len[4:5]]  # longest first
        expected = [next(r for r in one[it.prompt].rows if r.policy == row.policy).generations[0] for it in items]
        assert row.generations == expected  # back in item (file) order, not batch order
        assert len(row.finish_reasons) == len(items)
    # the file order is not the length order, so an unsorted report's batches differ
    assert by_len != [it.prompt for it in items]


def test_report_files_json_markdown_png(sk, items_file, tmp_path):
    items = load_eval_items(items_file)
    report = evaluate(sk, items, ["full", 2], batch_size=3, max_new_tokens=5, stop=(), warmup=False,
                      command="skipdecode eval --test", data=str(items_file))
    paths = report.save(tmp_path / "out", "run")
    assert {k: p.name for k, p in paths.items()} == {"json": "run.json", "md": "run.md", "png": "run.png"}
    for bad in ("../run", "sub/run", ".."):  # would write outside the folder
        with pytest.raises(ValueError, match="name must be a file name without a folder"):
            report.save(tmp_path / "out", bad)
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "out" / "sub").exists()
    data = json.loads(paths["json"].read_text())
    assert set(data) == {"meta", "rows", "items"}
    meta = data["meta"]
    for key in ("command", "date", "versions", "data", "task", "metrics", "n_items", "batch_size",
                "max_new_tokens", "quality_metric"):
        assert key in meta, key
    assert meta["command"] == "skipdecode eval --test" and meta["n_items"] == 5 and meta["batch_size"] == 3
    assert {"torch", "transformers", "skipdecode"} <= set(meta["versions"])
    assert len(data["items"]) == 5 and data["items"][0]["references"] == RECORDS[0]["references"]
    assert [r["policy"] for r in data["rows"]] == ["full", "2x"]
    for row in data["rows"]:
        for key in ("model", "policy", "scores", "mean_active_layers", "theoretical_speedup",
                    "tokens_per_second", "wallclock_speedup", "batch_size", "generations", "reference"):
            assert key in row, key
        assert len(row["generations"]) == 5
        assert set(row["scores"]) == {"bleu", "chrf", "nist", "rouge1", "rouge2", "rougeL"}
    md = paths["md"].read_text()
    table = [line for line in md.splitlines() if line.startswith("| tiny-llama")]
    assert len(table) == 2 and "BLEU" in md and "ROUGE-L" in md and "chrF" in md
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


def test_policy_resolution_and_deduplication(sk, items_file):
    items = load_eval_items(items_file)[:2]
    report = evaluate(sk, items, ["full", 1, "checkpoint", "1x"], batch_size=2, max_new_tokens=3, stop=(), warmup=False)
    assert [r.policy for r in report.rows] == ["full"]  # all the same policy: one (reference) row
    name, pol = resolve_policy(sk, "2x")
    assert name == "2x" and pol == sk.policy_for(speedup=2.0)
    custom = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=3, horizon=4)
    assert resolve_policy(sk, json.dumps(custom.to_dict())) == ("custom", custom)
    assert resolve_policy(sk, custom.to_dict()) == ("custom", custom)
    no_layers = {k: v for k, v in custom.to_dict().items() if k != "num_layers"}  # the model's count
    assert resolve_policy(sk, no_layers) == ("custom", custom)
    assert resolve_policy(sk, json.dumps(no_layers)) == ("custom", custom)
    assert resolve_policy(sk, "full") == ("full", FullPolicy(L))
    for bad, match in [("fast", "unknown policy"), (0.5, "speedup"), ("{bad json", "JSON"),
                       (LinearDecayPolicy(num_layers=8, max_layers=4, min_layers=2), "num_layers"),
                       (object(), "not a policy"), ([2], "not a policy")]:
        with pytest.raises(ValueError, match=match):
            resolve_policy(sk, bad)


def test_several_models_each_with_own_reference_and_lazy_loading(sk, tokenizer, items_file):
    items = load_eval_items(items_file)[:3]
    loaded = []

    def load_other():
        loaded.append(True)
        return SkipModel(make_model("gpt2", 4, seed=2), tokenizer, chat=False)

    report = evaluate({"a": sk, "b": load_other}, items, {"a": [2], "b": ["full"]}, batch_size=2,
                      max_new_tokens=4, stop=(), warmup=False)
    assert loaded == [True]
    assert [(r.model, r.policy, r.reference) for r in report.rows] == [
        ("a", "full", True), ("a", "2x", False), ("b", "full", True)]
    assert report.row("b", "full").num_layers == 4
    with pytest.raises(KeyError):
        report.row("b", "2x")


def test_calm_rows_run_at_batch_one_against_batch_one_reference(sk, items_file):
    items = load_eval_items(items_file)[:3]
    report = evaluate(sk, items, None, batch_size=2, max_new_tokens=5, stop=(), warmup=False,
                      calm_thresholds=[0.0], calm_min_layers=2)
    assert [(r.policy, r.batch_size, r.reference) for r in report.rows] == [
        ("full", 2, True), ("full@bs1", 1, True), ("calm@0", 1, False)]
    calm = report.row("tiny-llama", "calm@0")
    assert calm.kind == "calm" and calm.reference_policy == "full@bs1"
    assert calm.decode_steps > 0
    assert calm.theoretical_speedup == pytest.approx(L / 2)  # threshold 0: every token exits at 2
    assert calm.compute_layers == L * calm.decode_steps and calm.compute_speedup == 1.0
    assert calm.head_evals == calm.decode_steps
    assert calm.policy_config == {"type": "calm", "threshold": 0.0, "min_layers": 2}
    assert "CALM" in report.to_markdown()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(items=[]), "items is empty"),
        (dict(items=[EvalItem("p", (), "p")]), "no reference"),
        (dict(batch_size=0), "batch_size"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(task="summarise"), "unknown task"),
        (dict(metrics=["meteor"]), "unknown metric"),
        (dict(policies=["warp"]), "unknown policy"),
        (dict(policies={"nope": [2]}), "unknown model"),
        (dict(calm_thresholds=[-1.0]), "threshold"),
    ],
)
def test_evaluate_rejects_bad_arguments(sk, kwargs, match):
    args = dict(items=[EvalItem("p", ("r",), "p")], policies=None)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        evaluate(sk, args.pop("items"), args.pop("policies"), warmup=False, **args)


def test_detect_task(tmp_path, items_file):
    csv = tmp_path / "x.csv"
    csv.write_text('"mr","ref"\n"name[A]","A."\n')
    cnn = tmp_path / "c.jsonl"
    cnn.write_text(json.dumps({"article": "a", "highlights": "b"}) + "\n")
    assert detect_task(csv) == "e2e" and detect_task(cnn) == "cnndm" and detect_task(items_file) == "plain"
    assert detect_task(tmp_path / "missing.jsonl") == "plain"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    SkipModel(make_model("llama", L, seed=1), tokenizer, chat=False).save_pretrained(path)
    return path


def _run(args):
    result = CliRunner().invoke(app, args)
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result, " ".join(text.split())  # rich wraps long error lines


def test_cli_eval_writes_report(ckpt, items_file, tmp_path):
    out = tmp_path / "out"
    result, text = _run(["eval", "--model", str(ckpt), "--data", str(items_file), "--speedup", "1", "--speedup", "2",
                         "--batch-size", "2", "--max-new-tokens", "4", "--limit", "3", "--out", str(out),
                         "--name", "e", "--no-progress"])
    assert result.exit_code == 0, text
    assert "| tiny | full" in result.stdout and "| tiny | 2x" in result.stdout
    data = json.loads((out / "e.json").read_text())
    assert data["meta"]["command"].startswith("skipdecode ")
    assert data["meta"]["n_items"] == 3 and [r["policy"] for r in data["rows"]] == ["full", "2x"]
    assert (out / "e.md").exists() and (out / "e.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "content, name, match",
    [
        (None, "missing.jsonl", "does not exist"),
        ('{"question": "q", "answer": "a"}\n', "bad_keys.jsonl", "prompt"),
        ('{"prompt": "p", "references": ["r"]}\n{not json\n', "broken.jsonl", "line 2"),
        ('"meaning","text"\n"name[A]","A."\n', "bad_cols.csv", "mr"),
        ("hello\n", "notes.txt", "unsupported file type"),
    ],
)
def test_bad_data_files_give_data_error_and_clean_cli_exit(ckpt, tmp_path, content, name, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_eval_items(path)
    result, text = _run(["eval", "--model", str(ckpt), "--data", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
    assert result.exit_code == 2, text
    assert "error" in text and match in text
    assert "Traceback" not in text and isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--speedup", "0.5"], "speedup"),
        (["--policy", "warp"], "unknown policy"),
        (["--batch-size", "0"], "--batch-size"),
        (["--task", "qa"], "--task"),
        (["--metric", "meteor"], "--metric must be one of bleu, chrf, nist, rouge1, rouge2, rougeL, got 'meteor'"),
        (["--offset", "-1"], "--offset"),
        (["--offset", "5"], "skips every item"),
    ],
)
def test_cli_bad_options_exit_2(ckpt, items_file, tmp_path, extra, match):
    result, text = _run(["eval", "--model", str(ckpt), "--data", str(items_file), "--limit", "1",
                         "--max-new-tokens", "2", "--out", str(tmp_path / "o"), "--no-progress", *extra])
    assert result.exit_code == 2, text
    assert match in text and "Traceback" not in text and isinstance(result.exception, SystemExit)


# ----------------------------------------------------------------------------------------------
# benchmarks/eval_e2e.py
# ----------------------------------------------------------------------------------------------




def test_eval_e2e_script_rows(tmp_path, tokenizer, ckpt, capsys):
    csv = tmp_path / "test.csv"
    csv.write_text(
        '"mr","ref"\n'
        '"name[The Eagle], eatType[coffee shop]","The Eagle is a coffee shop."\n'
        '"name[The Eagle], eatType[coffee shop]","A coffee shop called The Eagle."\n'
        '"name[Blue Spice], food[French]","Blue Spice serves French food."\n'
        '"name[Blue Spice], area[riverside]","Blue Spice is by the riverside."\n'
    )
    two = LinearDecayPolicy(num_layers=L, max_layers=4, min_layers=2, horizon=8)
    ckpt2 = tmp_path / "e2e-2x"
    SkipModel(make_model("llama", L, seed=3), tokenizer, policy=two, chat=False).save_pretrained(ckpt2)
    script = load_benchmark("eval_e2e")
    rc = script.main(["--ckpt", f"2x={ckpt2}", "--stock", str(ckpt), "--data", str(csv), "--batch-size", "2",
                      "--max-new-tokens", "4", "--calm-threshold", "0", "--calm-min-layers", "3",
                      "--out", str(tmp_path / "res"), "--no-progress"])
    assert rc == 0
    data = json.loads((tmp_path / "res" / "eval_e2e.json").read_text())
    assert data["meta"]["n_items"] == 3 and data["meta"]["task"] == "e2e"
    assert data["meta"]["metrics"] == ["bleu", "chrf", "nist", "rougeL"] and data["meta"]["stop"] == ["\n"]
    rows = [(r["model"], r["policy"], r["policy_config"]) for r in data["rows"]]
    # stock: full + the 2x checkpoint's very schedule; 2x: full (sanity row) + its own schedule + CALM
    assert rows[0][:2] == ("stock", "full") and rows[1][:2] == ("stock", "2x (= ckpt 2x)")
    assert rows[1][2] == two.to_dict() and rows[3][2] == two.to_dict()
    assert [r[:2] for r in rows[2:]] == [("2x", "full"), ("2x", "checkpoint"), ("2x", "full@bs1"), ("2x", "calm@0")]
    assert (tmp_path / "res" / "eval_e2e.png").read_bytes()[:8] == PNG_MAGIC
    assert "| 2x | checkpoint" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        script.main(["--ckpt", str(tmp_path / "nope"), "--data", str(csv)])
    assert exc.value.code == 2
    # a shard: --offset skips items in file (MR) order, --limit caps what is left
    rc = script.main(["--ckpt", f"2x={ckpt2}", "--no-stock", "--data", str(csv), "--offset", "1", "--limit", "1",
                      "--max-new-tokens", "2", "--out", str(tmp_path / "res"), "--name", "shard", "--no-progress"])
    assert rc == 0
    shard = json.loads((tmp_path / "res" / "shard.json").read_text())
    assert [it["prompt"] for it in shard["items"]] == [data["items"][1]["prompt"]]
    with pytest.raises(SystemExit) as exc:
        script.main(["--ckpt", f"2x={ckpt2}", "--data", str(csv), "--offset", "3"])
    assert exc.value.code == 2


def test_report_round_trip_and_combine_with_calm_run(sk, items_file, tmp_path):
    items = load_eval_items(items_file)[:3]
    main = evaluate(sk, items, [2.0], batch_size=3, max_new_tokens=4, stop=(), warmup=False)
    calm = evaluate(sk, items, [], batch_size=1, max_new_tokens=4, stop=(), warmup=False,
                    calm_thresholds=[0.0], calm_min_layers=2)
    main.save(tmp_path, "main")
    calm.save(tmp_path, "calm")
    loaded = Report.load(tmp_path / "main.json")
    assert loaded.to_markdown() == main.to_markdown()
    assert [r.to_dict() for r in loaded.rows] == [r.to_dict() for r in main.rows]

    both = combine_reports([loaded, Report.load(tmp_path / "calm.json")])
    # the batch-1 run's full-depth row clashes with the batched one: renamed, and CALM's link follows
    assert [(r.policy, r.batch_size, r.reference_policy) for r in both.rows] == [
        ("full", 3, "full"), ("2x", 3, "full"), ("full@bs1", 1, "full@bs1"), ("calm@0", 1, "full@bs1")]
    assert both.row("tiny-llama", "calm@0").theoretical_speedup == pytest.approx(L / 2)
    md = both.to_markdown()
    assert main.meta["command"] in md and calm.meta["command"] in md

    # the script writes the three files; mismatched items and non-reports are clean errors
    mod = load_benchmark("plot_eval")
    assert mod.main([str(tmp_path / "main.json"), str(tmp_path / "calm.json"), "--out", str(tmp_path / "o"),
                     "--name", "all"]) == 0
    assert (tmp_path / "o" / "all.png").read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((tmp_path / "o" / "all.json").read_text())
    assert len(saved["rows"]) == 4
    assert saved["meta"]["post_command"].startswith("python benchmarks/plot_eval.py ")
    assert saved["meta"]["post_command"].endswith("--name all")
    other = evaluate(sk, items[:2], [], batch_size=2, max_new_tokens=4, stop=(), warmup=False)
    with pytest.raises(ValueError, match="n_items"):
        combine_reports([main, other])
    (tmp_path / "bad.json").write_text('{"rows": [{"model": "x", "speed": 1}], "meta": {}}')
    with pytest.raises(ValueError, match=r"bad.json: rows\[0\] has unknown field\(s\) \['speed'\]"):
        Report.load(tmp_path / "bad.json")
    assert mod.main([str(tmp_path / "missing.json")]) == 2
    assert mod.main([str(tmp_path / "main.json"), "--out", str(tmp_path / "f"), "--frontier", "tiny-llama:full",
                     "--frontier", "tiny-llama:2x"]) == 0
    assert (tmp_path / "f" / "eval_combined.png").read_bytes()[:8] == PNG_MAGIC
    assert mod.main([str(tmp_path / "main.json"), "--out", str(tmp_path / "f"), "--frontier", "tiny-llama:9x"]) == 2
    assert mod.main([str(tmp_path / "main.json"), "--out", str(tmp_path / "f"), "--frontier", "nocolon"]) == 2


def test_rescore_recomputes_scores_from_stored_generations(sk, items_file):
    items = load_eval_items(items_file)[:4]
    report = evaluate(sk, items, [2.0], batch_size=2, max_new_tokens=6, stop=(), warmup=False, metrics=["bleu"])
    before = [dict(r.scores) for r in report.rows]
    assert all(set(s) == {"bleu"} for s in before)
    report.rescore(["bleu", "nist", "rougeL"])
    refs = [list(it.references) for it in items]
    for row, old in zip(report.rows, before):
        assert row.scores == pytest.approx(score_all(row.generations, refs, ["bleu", "nist", "rougeL"]))
        assert row.scores["bleu"] == pytest.approx(old["bleu"])
    assert report.meta["metrics"] == ["bleu", "nist", "rougeL"] and report.meta["rescored"]["metrics"]
    report.rows[0].generations.pop()
    with pytest.raises(ValueError, match="3 generations for 4 items"):
        report.rescore()


def test_concat_shards_equals_one_run_over_all_items(sk, items_file, tmp_path):
    from skipdecode.evaluate import concat_reports

    items = list(load_eval_items(items_file))
    kw = dict(batch_size=2, max_new_tokens=5, stop=(), warmup=False)
    whole = evaluate(sk, items, [2.0], **kw)
    # shard boundary on a batch boundary, so the batches (and decode steps) are those of `whole`
    a, b = evaluate(sk, items[:2], [2.0], **kw), evaluate(sk, items[2:], [2.0], **kw)
    a.meta["command"], b.meta["command"] = "run shard a", "run shard b"
    joined = concat_reports([a, b])
    assert joined.meta["n_items"] == 5 and len(joined.meta["shards"]) == 2
    assert "`run shard a` + `run shard b`" in joined.to_markdown()  # every shard's command is shown
    assert "rescored" not in joined.meta  # joining scores the items once; nothing was rescored
    assert [it["prompt"] for it in joined.items] == [it.prompt for it in items]
    for w, j in zip(whole.rows, joined.rows):
        assert (j.model, j.policy) == (w.model, w.policy)
        assert j.generations == w.generations
        for name in ("n_items", "decode_steps", "layers_run", "new_tokens"):
            assert getattr(j, name) == getattr(w, name), name
        assert j.theoretical_speedup == pytest.approx(w.theoretical_speedup)
        # corpus-level scores over all items, not an average of the shards' scores
        assert j.scores == pytest.approx(w.scores)
        assert j.generation_seconds == pytest.approx(sum(r.generation_seconds for r in (a.row(j.model, j.policy),
                                                                                        b.row(j.model, j.policy))))
    assert joined.row("tiny-llama", "full").decode_speedup == 1.0
    skip = joined.row("tiny-llama", "2x")
    assert skip.decode_speedup == pytest.approx(joined.row("tiny-llama", "full").step_seconds / skip.step_seconds)
    with pytest.raises(ValueError, match="more than one report"):
        concat_reports([a, a])
    with pytest.raises(ValueError, match="rows"):
        concat_reports([a, evaluate(sk, items[2:], ["full"], **kw)])

    # the script: eval_e2e-style shards joined by plot_eval.py --concat
    a.save(tmp_path, "a")
    b.save(tmp_path, "b")
    mod = load_benchmark("plot_eval")
    assert mod.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--concat", "--out", str(tmp_path),
                     "--name", "ab"]) == 0
    assert Report.load(tmp_path / "ab.json").row("tiny-llama", "2x").generations == whole.row("tiny-llama", "2x").generations
    assert mod.main([str(tmp_path / "a.json"), str(tmp_path / "a.json"), "--concat", "--out", str(tmp_path)]) == 2


def test_progress_counts_batches_of_every_model_and_draws_one_bar(sk, items_file, capsys):
    """progress: a callable gets batches done after each batch, over all models (5 items at batch 2
    = 3 batches a model); True draws one tqdm bar on stderr, labelled by model, nothing on stdout."""
    items = load_eval_items(items_file)
    loads = []

    def loader():
        loads.append(1)
        return sk

    ticks = []
    kw = dict(batch_size=2, max_new_tokens=2, stop=(), warmup=False)
    evaluate({"a": sk, "b": loader}, items, ["full"], progress=ticks.append, **kw)
    assert ticks == [1, 2, 3, 4, 5, 6] and loads == [1]  # the loader ran once, in its turn
    capsys.readouterr()
    evaluate(sk, items, ["full"], progress=True, **kw)
    out, err = capsys.readouterr()
    assert out == "" and "eval tiny-llama" in err and "3/3" in err


def test_public_names_stay_importable_from_evaluate():
    """Tests, the CLI and benchmarks import these from skipdecode.evaluate (the parts live in the
    eval_* modules); each is the one object, not a copy."""
    import skipdecode.evaluate as ev
    from skipdecode import eval_join, eval_policies, eval_report, eval_tasks

    for name in ev.__all__:
        assert getattr(ev, name) is not None, name
    assert ev.Report is eval_report.Report and ev.EvalRow is eval_report.EvalRow
    assert ev.combine_reports is eval_join.combine_reports and ev.concat_reports is eval_join.concat_reports
    assert ev.resolve_policy is eval_policies.resolve_policy and ev.TASKS is eval_tasks.TASKS
    assert set(ev.__all__) >= {"TASKS", "TaskSpec", "PolicySpec", "EvalRow", "Report", "detect_task",
                               "resolve_policy", "evaluate", "package_versions", "combine_reports", "concat_reports"}


def test_joined_report_names_each_distinct_command_once():
    """The frontier joins one report per model, all made by the same command: the Markdown header
    named it four times."""
    from skipdecode.eval_output import _run_line

    same = {"combined": [{"command": "python a.py --x"}] * 3 + [{"command": "python b.py"}], "device": "cpu"}
    line = _run_line(same)
    assert line.count("`python a.py --x`") == 1 and line.count("`python b.py`") == 1
    assert line.index("a.py") < line.index("b.py")
