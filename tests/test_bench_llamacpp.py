"""llama.cpp rows of the decode-speed benchmark (skipdecode.bench_llamacpp, issue 11).

Without llama-cpp-python, a fake ``llama_cpp`` module stands in for the C API: a deterministic
"model" whose next token is a function of each sequence's whole history, and which checks that
every entry arrives at its sequence's next position. The batched row must return, for every
sequence, that model's greedy continuation of its own prompt: it would not if the logits of
another batch entry were read, or positions or sequence ids were mixed up. With the real
library installed, a slow test checks batched decoding against the batch-1 row on the GGUF file.
"""

from __future__ import annotations

import ctypes
import json
import sys
import types

import pytest

from skipdecode.bench_engines import issue_targets, llamacpp_batched_row, variants_table

V = 97  # vocabulary of the fake model


def _next(history: list[int]) -> int:
    return (sum(t * (i + 3) for i, t in enumerate(history)) + 7 * len(history)) % V


def _tokenize(text: bytes) -> list[int]:
    return [1] + [b % V for b in text]


class _Batch:
    def __init__(self, n: int) -> None:
        self.n_tokens = 0
        self.token, self.pos, self.n_seq_id, self.logits = [0] * n, [0] * n, [0] * n, [False] * n
        self.seq_id = [[0] for _ in range(n)]


class _Ctx:
    def __init__(self, params) -> None:
        self.params, self.seqs, self.out, self.decodes = params, {}, {}, 0


def _fake_llama_cpp(log: list) -> types.ModuleType:
    m = types.ModuleType("llama_cpp")
    m.llama_backend_init = lambda: None
    m.llama_model_default_params = lambda: types.SimpleNamespace()
    m.llama_model_load_from_file = lambda path, params: "model"
    m.llama_context_default_params = lambda: types.SimpleNamespace()
    m.llama_init_from_model = lambda model, params: _Ctx(params)
    m.llama_model_get_vocab = lambda model: "vocab"
    m.llama_vocab_n_tokens = lambda vocab: V
    m.llama_batch_init = lambda n, embd, n_seq: _Batch(n)
    m.llama_batch_free = lambda b: None
    m.llama_free = lambda ctx: None
    m.llama_model_free = lambda model: None
    m.llama_get_memory = lambda ctx: ctx

    def clear(ctx, data):
        ctx.seqs.clear()

    def decode(ctx, b):
        assert b.n_tokens <= ctx.params.n_batch
        ctx.out, ctx.decodes = {}, ctx.decodes + 1
        log.append(b.n_tokens)
        for i in range(b.n_tokens):
            assert b.n_seq_id[i] == 1 and 0 <= b.seq_id[i][0] < ctx.params.n_seq_max
            hist = ctx.seqs.setdefault(b.seq_id[i][0], [])
            assert b.pos[i] == len(hist), "an entry not at its sequence's next position"
            hist.append(b.token[i])
            if b.logits[i]:
                arr = (ctypes.c_float * V)()
                arr[_next(hist)] = 1.0
                ctx.out[i] = arr
        return 0

    def logits_ith(ctx, i):
        return ctypes.cast(ctx.out[i], ctypes.POINTER(ctypes.c_float))  # KeyError: no logits asked there

    m.llama_memory_clear, m.llama_decode, m.llama_get_logits_ith = clear, decode, logits_ith

    class Llama:  # the high-level object: tokenizer, and the batch-1 row's one-sequence generate
        def __init__(self, model_path, vocab_only=False, verbose=True, **kw):
            pass

        def tokenize(self, text, add_bos=True, special=True):
            return _tokenize(text)

        def reset(self):
            pass

        def generate(self, tokens, **kw):
            hist = list(tokens)
            while True:
                hist.append(_next(hist))
                yield hist[-1]

    m.Llama = Llama
    return m


@pytest.fixture
def fake(monkeypatch, tmp_path):
    log: list[int] = []
    monkeypatch.setitem(sys.modules, "llama_cpp", _fake_llama_cpp(log))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    return gguf, log


def _greedy(prompt: str, n: int) -> list[int]:
    hist, out = _tokenize(prompt.encode()), []
    for _ in range(n):
        out.append(_next(hist))
        hist.append(out[-1])
    return out


def test_batched_row_gives_each_sequence_its_own_greedy_continuation(fake):
    gguf, log = fake
    prompts = ["Hello!", "What is the capital of France?", "Why do cats purr?"]
    row = llamacpp_batched_row(str(gguf), prompts, 6, threads=2, repeats=2, bandwidth_gbs=1e-3)
    assert row["token_ids"] == [_greedy(p, 6) for p in prompts]
    assert row["batch_size"] == 3 and row["engine"] == "llama.cpp"
    assert row["tokens_per_s"] == pytest.approx(3 / (row["step_ms"] / 1e3))
    assert row["floor_ms"] == pytest.approx(1000 / 1e6 * 1e3) and row["bytes_per_step"] == 1000
    assert row["prompt_tokens"] == sum(len(_tokenize(p.encode())) for p in prompts)
    # per run: one prefill of all prompt tokens, then 5 steps of one token per sequence (warm-up + 2 runs)
    assert log == [row["prompt_tokens"], 3, 3, 3, 3, 3] * 3


def test_batched_row_refuses_bad_arguments(fake):
    gguf, _ = fake
    with pytest.raises(ValueError, match="at least one prompt"):
        llamacpp_batched_row(str(gguf), [], 4, threads=1)
    with pytest.raises(ValueError, match="new_tokens must be >= 2"):
        llamacpp_batched_row(str(gguf), ["a"], 1, threads=1)


def test_batched_row_reports_a_failed_decode(fake, monkeypatch):
    gguf, _ = fake
    monkeypatch.setattr(sys.modules["llama_cpp"], "llama_decode", lambda ctx, b: 1)
    with pytest.raises(RuntimeError, match="llama_decode returned 1"):
        llamacpp_batched_row(str(gguf), ["a", "b"], 3, threads=1)


def test_issue_target_compares_3x_batch_8_with_llamacpp_batched():
    rows = [{"engine": "skipdecode", "variant": "int4+compile", "policy": "3x", "batch_size": 8, "tokens_per_s": 700.0},
            {"engine": "skipdecode", "variant": "float32", "policy": "3x", "batch_size": 8, "tokens_per_s": 300.0},
            {"engine": "skipdecode", "variant": "float32", "policy": "3x", "batch_size": 1, "tokens_per_s": 900.0}]
    t = issue_targets(rows, None, {"batch_size": 8, "tokens_per_s": 650.0})
    assert t["3x_b8_tokens_per_s"] == 700.0 and t["llamacpp_b8_tokens_per_s"] == 650.0
    assert t["3x_b8_above_llamacpp_b8"] is True
    assert issue_targets(rows, None, {"batch_size": 8, "tokens_per_s": 701.0})["3x_b8_above_llamacpp_b8"] is False
    assert issue_targets(rows, None)["3x_b8_above_llamacpp_b8"] is None


def test_table_puts_llamacpp_rows_after_ours_of_the_same_batch():
    from rich.console import Console

    ours = {"engine": "skipdecode", "variant": "float32", "policy": "full", "mean_active_layers": 30.0,
            "theoretical_speedup": 1.0, "step_ms": 40.0, "tokens_per_s": 25.0, "wall_speedup": 1.0,
            "wall_over_theoretical": 1.0, "bytes_per_step": 5e8}
    lc = {"engine": "llama.cpp", "variant": "gguf-native", "policy": "full", "step_ms": 7.0, "tokens_per_s": 1,
          "bytes_per_step": 1e8}
    result = {"bandwidth": {"read_gbs": 40.0, "copy_gbs": 20.0},
              "rows": [{**ours, "batch_size": 8}, {**ours, "batch_size": 1}],
              "llamacpp": {**lc, "batch_size": 1}, "llamacpp_batched": [{**lc, "batch_size": 8, "step_ms": 12.5}]}
    console = Console(width=220, record=True)
    console.print(variants_table(result))
    lines = [ln for ln in console.export_text().splitlines() if "full" in ln]
    assert [("llama.cpp" in ln, ln.split()[1]) for ln in lines] == [(False, "1"), (True, "1"), (False, "8"), (True, "8")]
    assert "12.50" in lines[3]


def _bench_with_llamacpp(tmp_path, gguf):
    """``skipdecode bench --variants float32 --llamacpp GGUF`` on a tiny model at batch 1 and 2:
    (CLI result, results path)."""
    from typer.testing import CliRunner

    from conftest import make_model, make_tokenizer
    from skipdecode.model import SkipModel
    from test_quantize_cli import invoke

    model_dir = tmp_path / "tiny"
    SkipModel(make_model("llama"), make_tokenizer()).save_pretrained(model_dir)
    out = tmp_path / "b.json"
    res = invoke(CliRunner(), ["bench", "--model", str(model_dir), "--batch-sizes", "1,2", "--speedups", "3",
                               "--new-tokens", "4", "--repeats", "1", "--warmup", "0", "--variants", "float32",
                               "--llamacpp", str(gguf), "--output", str(out), "--no-plot", "--no-hf"])
    return res, out


def test_bench_cli_adds_a_llamacpp_row_per_batch_size(fake, tmp_path, monkeypatch):
    from skipdecode import bench_llamacpp

    gguf, log = fake
    # the fake llama_cpp lives in this process; a child process (run_isolated) would not see it
    monkeypatch.setattr(bench_llamacpp, "run_isolated", lambda fn, *args, **kwargs: fn(*args, **kwargs))
    res, out = _bench_with_llamacpp(tmp_path, gguf)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert data["llamacpp"]["batch_size"] == 1
    assert [r["batch_size"] for r in data["llamacpp_batched"]] == [2]
    assert len(data["llamacpp_batched"][0]["token_ids"]) == 2 and log[-1] == 2
    assert data["issue_targets"]["llamacpp_b8_tokens_per_s"] is None  # no batch 8 in this run


def test_run_isolated_returns_raises_and_survives_a_crash():
    """A child process's value comes back, its exception is raised here, and its death (a crash
    inside llama.cpp) is a LlamaCppCrash naming the signal, not the end of the benchmark."""
    import os

    from skipdecode.bench_llamacpp import LlamaCppCrash, run_isolated

    assert run_isolated(pow, 2, 10) == 1024
    with pytest.raises(ValueError, match="invalid literal"):
        run_isolated(int, "x")
    with pytest.raises(LlamaCppCrash, match=r"\(signal 6 \(SIGABRT\)\) in abort: a crash inside llama.cpp"):
        run_isolated(os.abort)


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGILL"])
def test_bench_cli_keeps_our_rows_when_llamacpp_crashes(tmp_path, monkeypatch, sig):
    """llama.cpp dying in its process leaves a results file with our rows, the error recorded
    and printed, and exit status 0; a SIGILL (AMX kernels on these machines) says how to rebuild."""
    from skipdecode import bench_llamacpp

    def crash(fn, *args, **kwargs):
        raise bench_llamacpp.LlamaCppCrash(f"llama.cpp's process ended without a result (signal 11 ({sig})) "
                                           "in llamacpp_row: a crash inside llama.cpp")

    monkeypatch.setattr(bench_llamacpp, "run_isolated", crash)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # --llamacpp checks the import
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1000)
    res, out = _bench_with_llamacpp(tmp_path, gguf)
    assert res.exit_code == 0, res.output
    saved = json.loads(out.read_text())
    assert {(r["batch_size"], r["policy"]) for r in saved["rows"]} == {(1, "full"), (1, "3x"), (2, "full"), (2, "3x")}
    assert sig in saved["llamacpp_error"] and "llamacpp" not in saved and saved["llamacpp_batched"] == []
    assert ("rebuild it without AMX" in saved["llamacpp_error"]) is (sig == "SIGILL")
    assert saved["issue_targets"]["int4_3x_b1_vs_llamacpp"] is None
    assert "warning: --llamacpp: llama.cpp's process ended" in " ".join(res.stderr.split())


@pytest.mark.slow
def test_real_llamacpp_batched_equals_batch_1_on_the_embedded_gguf():
    pytest.importorskip("llama_cpp")
    import torch

    from skipdecode.bench_engines import llamacpp_row
    from skipdecode.loading import embedded_gguf_path

    gguf = str(embedded_gguf_path())
    prompts = ["What is the capital of France?", "Why do cats purr?"]
    row = llamacpp_batched_row(gguf, prompts, 8, torch.get_num_threads(), 1)
    assert row["batch_size"] == 2 and row["step_ms"] > 0
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=256, verbose=False)
    for p, got in zip(prompts, row["token_ids"]):
        solo = []
        for tok in llm.generate(llm.tokenize(p.encode(), add_bos=True, special=True), temp=0.0, top_k=1,
                                repeat_penalty=1.0, reset=True):
            solo.append(tok)
            if len(solo) == 8:
                break
        assert got == solo
    assert llamacpp_row(gguf, prompts[0], 4, torch.get_num_threads(), 1)["batch_size"] == 1
