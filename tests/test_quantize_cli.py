"""--quantize / --compile / --variants / --llamacpp on the command line, and the benchmark's
memory floors (skipdecode.bench_engines) on tiny models. No timing assertions."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from skipdecode.quantize import resident_bytes
from skipdecode.bench_engines import issue_targets, measure_bandwidth, parse_variants, run_variants, step_bytes
from skipdecode.cli import app
from skipdecode.model import SkipModel
from skipdecode.quantize import quantize_model

from conftest import make_chain_model, make_model

CHAIN_PROMPT = "Describe the restaurant:"
TARGET = "The Eagle is a coffee shop"


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("ckpt") / "chain"
    SkipModel(make_chain_model(tokenizer, CHAIN_PROMPT, TARGET, 6), tokenizer).save_pretrained(path)
    return path


def invoke(runner, args):
    return runner.invoke(app, args, env={"COLUMNS": "200"})


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8", "head"])
def test_generate_quantized_same_text(runner, chain_dir, mode):
    res = invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "12", "--json", "--no-chat",
                          "--quantize", mode])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["texts"] == [TARGET]


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"], ["bench"], ["eval", "--data", "x.jsonl"]])
def test_bad_quantize_exits_2_naming_option(runner, chain_dir, command):
    res = invoke(runner, [*command, "--model", str(chain_dir), "--quantize", "int3"])
    assert res.exit_code == 2
    assert "--quantize must be one of int8, int4, w8a8, head, got 'int3'" in " ".join(res.output.split())


def test_bench_variants_rows_and_floors(runner, chain_dir, tmp_path):
    out = tmp_path / "b.json"
    res = invoke(runner, ["bench", "--model", str(chain_dir), "--batch-sizes", "1,2", "--speedups", "2",
                          "--new-tokens", "4", "--repeats", "1", "--warmup", "0", "--variants", "float32,int8",
                          "--output", str(out), "--no-plot"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text())["rows"] == data["rows"]
    keys = [(r["batch_size"], r["variant"], r["policy"]) for r in data["rows"]]
    assert keys == [(1, "float32", "full"), (1, "float32", "2x"), (1, "float32", "hf-generate"),
                    (2, "float32", "full"), (2, "float32", "2x"), (2, "float32", "hf-generate"),
                    (1, "int8", "full"), (1, "int8", "2x"), (2, "int8", "full"), (2, "int8", "2x")]
    by = {(r["batch_size"], r["variant"], r["policy"]): r for r in data["rows"]}
    # int8 reads about a quarter of the weight bytes; the floor follows bytes / measured bandwidth
    assert by[(1, "int8", "full")]["bytes_per_step"] < 0.5 * by[(1, "float32", "full")]["bytes_per_step"]
    bw = data["bandwidth"]["read_gbs"]
    for r in data["rows"]:
        assert r["floor_ms"] == pytest.approx(r["bytes_per_step"] / (bw * 1e9) * 1e3)
    v = data["variants"]
    assert v["int8"]["resident_bytes"]["total"] < v["float32"]["resident_bytes"]["total"]
    assert v["int8"]["resident_bytes"]["quantized"] > 0 and v["float32"]["resident_bytes"]["quantized"] == 0
    assert set(data["issue_targets"]) >= {"float32_full_b1_within_1.3x_floor", "int8_3x_b1_vs_llamacpp"}


def test_bench_bad_variants(runner, chain_dir):
    res = invoke(runner, ["bench", "--model", str(chain_dir), "--variants", "int8+jit"])
    assert res.exit_code == 2 and "--variants items must be float32, int8, int4, w8a8" in res.output
    res = invoke(runner, ["bench", "--model", str(chain_dir), "--variants", "int8", "--quantize", "int8"])
    assert res.exit_code == 2 and "either --variants or --quantize" in res.output


def test_parse_variants():
    assert parse_variants("float32, int8+compile,int4") == [
        ("float32", None, False), ("int8+compile", "int8", "auto"), ("int4", "int4", False)]
    assert parse_variants("bfloat16") == [("bfloat16", None, False)]
    assert parse_variants("int4-unfused+compile,w8a8-unfused") == [
        ("int4-unfused+compile", "int4", "auto"), ("w8a8-unfused", "w8a8", False)]
    for bad in ("bfloat16+compile", "bf16", "float16", "float32-unfused", "int4-unfused-unfused"):
        with pytest.raises(ValueError, match="or bfloat16; got"):
            parse_variants(bad)


def test_unfused_variant_keeps_one_product_per_projection(tokenizer):
    """``int8-unfused`` builds a copy without fused siblings, ``int8`` one with them (q/k/v and
    gate/up: skipdecode.fused_linear); both leave the benchmarked model as it was."""
    from skipdecode.bench_engines import build_variant, variant_fuse
    from skipdecode.fused_linear import FusedSlice

    sk = SkipModel(make_model("llama"), tokenizer)
    cache: dict = {}
    counts = {}
    for name in ("int8-unfused", "int8"):
        (item,) = parse_variants(name)
        variant, _ = build_variant(sk, item[1], item[2], cache, fuse=variant_fuse(name))
        counts[name] = sum(isinstance(m, FusedSlice) for m in variant.model.modules())
    assert counts == {"int8-unfused": 0, "int8": 6 * 5} and len(cache) == 2
    assert not any(isinstance(m, FusedSlice) for m in sk.model.modules())


def test_run_variants_bfloat16_casts_a_copy(tokenizer):
    """The bfloat16 variant runs a bfloat16 copy (half the resident bytes, half the floor) and
    leaves the benchmarked float32 model as it was."""
    sk = SkipModel(make_model("llama"), tokenizer)
    before = {k: v.clone() for k, v in sk.model.state_dict().items()}
    res = run_variants(sk, parse_variants("float32,bfloat16"), bench_kwargs=dict(
        batch_sizes=(1,), speedups=(2,), new_tokens=4, repeats=1, warmup=0, include_hf=False))
    f32, bf16 = res["variants"]["float32"], res["variants"]["bfloat16"]
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert bf16["resident_bytes"]["total"] * 2 == f32["resident_bytes"]["total"]
    rows = {(r["variant"], r["policy"]): r for r in res["rows"] if r.get("engine") != "hf"}
    full32, full16 = rows[("float32", "full")], rows[("bfloat16", "full")]
    assert full16["bytes_per_step"] < full32["bytes_per_step"] < 2.1 * full16["bytes_per_step"]
    assert all(p.dtype == torch.float32 for p in sk.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in sk.model.state_dict().items())


def test_step_bytes_exact(tokenizer):
    model = make_model("llama")  # untied head, 6 layers, kv 2 heads x 8
    sk = SkipModel(model, tokenizer)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    tail = (model.lm_head.weight.numel() + model.model.norm.weight.numel()) * 4
    rotary = sum(b.untyped_storage().nbytes() for b in model.model.rotary_emb.buffers())
    emb_row = 32 * 4
    B, P = 2, 5
    kv = lambda n, t: n * B * (P + t) * 2 * 2 * 8 * 4  # noqa: E731
    expected = ((6 * layer + tail + rotary + B * emb_row + kv(6, 1)) + (3 * layer + tail + rotary + B * emb_row + kv(3, 2))) / 2
    assert step_bytes(sk, [6, 3], B, P) == pytest.approx(expected)
    q = SkipModel(quantize_model(make_model("llama"), "int8"), tokenizer)
    assert step_bytes(q, [6, 3], B, P) < 0.4 * expected
    from skipdecode import onednn
    from skipdecode.layout import weight_left

    weight_left(model)  # oneDNN's packed duplicates are memory, not bytes a step reads
    if onednn.enable(model):
        assert resident_bytes(model)["total"] > sum(p.numel() * 4 for p in model.parameters())
        assert step_bytes(sk, [6, 3], B, P) == pytest.approx(expected)


def test_bandwidth_positive():
    bw = measure_bandwidth(megabytes=16, repeats=1)
    assert bw["read_gbs"] > 0 and bw["copy_gbs"] > 0


def test_issue_targets_from_rows():
    rows = [
        {"engine": "skipdecode", "variant": "float32", "policy": "full", "batch_size": 1, "over_floor": 1.2,
         "step_ms": 40.0, "wall_over_theoretical": 1.0},
        {"engine": "skipdecode", "variant": "int8+compile", "policy": "3x", "batch_size": 1, "over_floor": 2.0,
         "step_ms": 12.0, "wall_over_theoretical": 0.9},
        {"engine": "skipdecode", "variant": "int4+compile", "policy": "3x", "batch_size": 1, "over_floor": 2.0,
         "step_ms": 9.0, "wall_over_theoretical": 0.8},
    ]
    t = issue_targets(rows, {"step_ms": 8.0})
    assert t["float32_full_b1_within_1.3x_floor"] is True
    assert t["int4_3x_b1_vs_llamacpp"] == pytest.approx(9 / 8) and t["int4_3x_b1_within_1x_llamacpp"] is False
    assert t["int8_3x_b1_within_1.5x_llamacpp"] is True
    assert t["quantized_3x_b1_wall_over_theoretical"] == 0.9
    assert issue_targets(rows, None)["int8_3x_b1_vs_llamacpp"] is None


@pytest.mark.slow
def test_generate_compiled_same_text(runner, chain_dir):
    res = invoke(runner, ["generate", CHAIN_PROMPT, "--model", str(chain_dir), "-n", "12", "--json", "--no-chat",
                          "--quantize", "int8", "--compile"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["texts"] == [TARGET]
    assert "compiled the decode step (kernels) in" in res.output


@pytest.mark.slow
def test_run_variants_compiled(tokenizer):
    sk = SkipModel(make_model("llama"), tokenizer)
    res = run_variants(sk, parse_variants("int8+compile"), bench_kwargs=dict(
        batch_sizes=(1,), speedups=(2,), new_tokens=4, repeats=1, warmup=0, include_hf=False))
    rep = res["variants"]["int8+compile"]["compile_report"]
    assert rep["enabled"] and rep["compile_seconds"] > 0 and rep["warmed_batch_sizes"] == [1, 8]
    assert sk.quantize is None  # the benchmarked float model was not modified


@pytest.mark.slow
def test_llamacpp_row_embedded_gguf():
    pytest.importorskip("llama_cpp")
    from skipdecode.bench_engines import llamacpp_row
    from skipdecode.loading import embedded_gguf_path

    row = llamacpp_row(str(embedded_gguf_path()), "What is the capital of France?", 4, torch.get_num_threads(), 1, 10.0)
    assert row["engine"] == "llama.cpp" and row["batch_size"] == 1 and row["step_ms"] > 0
    assert row["floor_ms"] == pytest.approx(row["bytes_per_step"] / 1e10 * 1e3)


def test_bench_profile_with_variants_refused(runner, chain_dir):
    res = invoke(runner, ["bench", "--model", str(chain_dir), "--variants", "int8", "--profile"])
    assert res.exit_code == 2 and "--profile breaks down the float32 eager step only" in " ".join(res.output.split())


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_dtype_names_the_option(runner, chain_dir, command):
    args = [command, "--model", str(chain_dir), "--dtype", "float64"] + (["x"] if command == "generate" else [])
    res = invoke(runner, args)
    assert res.exit_code == 2
    assert "--dtype must be float32, bfloat16 or float16 (or fp32, bf16, fp16), got 'float64'" in " ".join(res.output.split())


def test_compile_summary_names_the_copies_and_the_head_preview():
    from skipdecode.cli_common import compile_summary
    from skipdecode.compiled import CompileReport

    rep = CompileReport(enabled=True, mode="layers", compile_seconds=61.25, warmed_batch_sizes=[1, 2],
                        onednn_layers=120, head_one_row={"chosen": "int4", "w8a8": 1.2, "int4": 0.9})
    assert compile_summary(rep) == ("compiled the decode step (layers) in 61.2 s (first calls, batch 1 and 2; "
                                    "120 linears with oneDNN copies; batch-1 head preview int4)")
    plain = CompileReport(enabled=True, mode="kernels", compile_seconds=3.0, warmed_batch_sizes=[1])
    assert compile_summary(plain) == "compiled the decode step (kernels) in 3.0 s (first calls, batch 1)"
    off = CompileReport(enabled=False, error="no C compiler")
    assert compile_summary(off) == "--compile: compilation unavailable, running eagerly (no C compiler)"
