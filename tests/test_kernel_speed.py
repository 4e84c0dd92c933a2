"""benchmarks/kernel_speed.py on a tiny Llama saved locally: shapes, keys, step sums and the JSON
output (no timing assertions; the compiled fused kernels are left out to keep this fast)."""

from __future__ import annotations

import json

import pytest

from skipdecode import int4pack
from skipdecode.model import SkipModel

from conftest import load_benchmark, make_model



@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("kernels") / "llama"
    SkipModel(make_model("llama"), tokenizer).save_pretrained(path)
    return path


def test_kernel_speed_rows_and_step_sums(tiny_dir, tmp_path, capsys):
    out = tmp_path / "k.json"
    kernels = ["float32", "float32cm", "float32left", "bfloat16", "int8pack", "int4pack"]
    result = load_benchmark("kernel_speed").main(["--model", str(tiny_dir), "--kernels", ",".join(kernels), "--repeats", "2",
                             "--warmup", "0", "--threads", "1", "--batch-sizes", "1,2", "--bandwidth-mb", "8",
                             "--step-ms", "5", "--step-ms-threads", "1", "--output", str(out)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(out.read_text()) == json.loads(json.dumps(result))
    # the tiny Llama: hidden 32, 4 heads x 8 (2 KV heads), intermediate 64, vocab 320, 6 layers
    shapes = {(s["out_features"], s["in_features"], s["per_layer"], s["head"]) for s in result["shapes"]}
    assert shapes == {(32, 32, 2, False), (16, 32, 2, False), (64, 32, 2, False), (32, 64, 1, False),
                      (320, 32, 0, True)}
    assert result["num_layers"] == 6 and result["linears_per_layer"] == 7
    with_int4 = kernels if int4pack.kernel_available()[0] else kernels[:5]
    assert len(result["rows"]) == 5 * 2 * len(with_int4)
    for r in result["rows"]:
        assert r["kernel"] in with_int4 and r["threads"] == 1 and r["ms"] > 0
        assert r["gbs"] == pytest.approx(r["weight_bytes"] / (r["ms"] * 1e-3) / 1e9)
    bytes_of = {(r["out_features"], r["in_features"], r["kernel"]): r["weight_bytes"] for r in result["rows"]}
    assert bytes_of[(320, 32, "float32")] == bytes_of[(320, 32, "float32cm")] == bytes_of[(320, 32, "float32left")] == 320 * 32 * 4
    assert bytes_of[(320, 32, "bfloat16")] == 320 * 32 * 2
    assert bytes_of[(320, 32, "int8pack")] == 320 * 32 + 320 * 4
    if "int4pack" in with_int4:  # codes + a bfloat16 (step, zero) per group of 32
        assert bytes_of[(320, 32, "int4pack")] == 320 * 16 + 320 * 2 * 2
    assert {b["threads"] for b in result["bandwidth"]} == {1} and result["bandwidth"][0]["read_gbs"] > 0
    assert {(o["threads"], o["batch_size"]) for o in result["overhead"]} == {(1, 1), (1, 2)}
    sums = {(s["batch_size"], s["kernel"]): s for s in result["step_sums"]}
    assert set(sums) == {(B, k) for B in (1, 2) for k in with_int4}
    per_shape = {(r["batch_size"], r["kernel"], r["out_features"], r["in_features"]): r["ms"] for r in result["rows"]}
    s = sums[(1, "float32")]
    expect = 6 * (2 * per_shape[(1, "float32", 32, 32)] + 2 * per_shape[(1, "float32", 16, 32)]
                  + 2 * per_shape[(1, "float32", 64, 32)] + per_shape[(1, "float32", 32, 64)]) + per_shape[(1, "float32", 320, 32)]
    assert s["calls"] == 6 * 7 + 1 and s["step_ms"] == pytest.approx(expect)
    assert s["measured_step_ms"] == 5 and s["share_of_measured"] == pytest.approx(expect / 5)
    assert sums[(2, "float32")]["measured_step_ms"] is None  # --step-ms is a batch-1 time
    assert result["output"] == str(out) and result["command"].startswith("python benchmarks/kernel_speed.py")


@pytest.mark.parametrize("args,message", [
    (["--kernels", "float32,int3"], "--kernels items must be float32, float32cm, float32left, bfloat16, int8pack, int8fused, int4pack, int4fused, got 'int3'"),
    (["--batch-sizes", "0"], "--batch-sizes must be comma-separated integers >= 1, got '0'"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_kernel_speed_bad_arguments_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load_benchmark("kernel_speed").main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err
