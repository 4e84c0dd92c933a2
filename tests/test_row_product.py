"""The host's few-row float32 product (skipdecode.row_product): the choice follows the timings and
its margin, the environment overrides it and a bad value is named, tiny models keep the default,
one measurement serves a process, and layers that run F.linear give the reference answers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import typer
from torch import nn
from typer.testing import CliRunner

from conftest import make_model, make_tokenizer
from skipdecode import SkipModel, load, onednn, row_product
from skipdecode.cli_common import command_line
from skipdecode.layout import WeightLeftLinear, weight_left
from skipdecode.load_errors import LoadError
from skipdecode.policy import LinearDecayPolicy
from skipdecode.row_product import ENV_VAR, FEW_ROWS, MARGIN, RowProduct, RowProductError, choose, describe, measure

PROMPTS = ["The Eagle is a", "Blue Spice serves French food in the city centre"]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setattr(row_product, "_MEASURED", {})


def _spy_on_f_linear(monkeypatch, module) -> list:
    """Make ``module``'s ``F`` count its ``F.linear`` calls; returns the list of calls."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def linear(*args):
            calls.append(1)
            return F.linear(*args)

    monkeypatch.setattr(module, "F", Spy())
    return calls


def _fake_times(monkeypatch, linear: dict[int, float], first: dict[int, float]):
    def fake(product, weights, rows, repeats):
        return (linear if product is F.linear else first)[rows]
    monkeypatch.setattr(row_product, "_pass_ms", fake)


def test_measure_chooses_each_product_where_it_is_faster_by_the_margin(monkeypatch):
    """One row and 2-127 rows are decided apart; F.linear needs to be MARGIN faster."""
    w = [torch.zeros(8, 8)]
    _fake_times(monkeypatch, {1: 20.0, 2: 21.0, 4: 34.0, 16: 47.0}, {1: 49.0, 2: 50.0, 4: 49.0, 16: 51.0})
    got = measure(w)
    assert got.one_row_linear and got.few_rows_linear and got.source == "measured"
    assert got.ms["linear@1"] == 20.0 and got.ms["weight-first@16"] == 51.0
    # the AMD hosts' pattern: the weight-first GEMM faster everywhere
    _fake_times(monkeypatch, {1: 26.0, 2: 38.0, 4: 51.0, 16: 69.0}, {1: 22.0, 2: 21.0, 4: 22.0, 16: 43.0})
    got = measure(w)
    assert not got.one_row_linear and not got.few_rows_linear
    # within the margin the weight-first default stays; just past it F.linear wins
    close = 100.0 * MARGIN + 0.5
    _fake_times(monkeypatch, {1: close, **{r: 10.0 for r in FEW_ROWS}}, {1: 100.0, **{r: 30.0 for r in FEW_ROWS}})
    got = measure(w)
    assert not got.one_row_linear and got.few_rows_linear


def test_measure_times_real_products_at_every_row_count():
    got = measure([torch.randn(64, 32), torch.randn(32, 64)], repeats=1)
    assert set(got.ms) == {f"{p}@{r}" for p in ("linear", "weight-first") for r in (1, *FEW_ROWS)}
    assert all(v > 0 for v in got.ms.values()) and got.threads == torch.get_num_threads()
    assert got.sample_mb == round((2 * 64 * 32 * 4) / 2**20, 1)


def test_tiny_weights_keep_the_default_without_timing(monkeypatch):
    monkeypatch.setattr(row_product, "measure", lambda weights: pytest.fail("a tiny model was timed"))
    got = choose([torch.randn(64, 64)])
    assert (got.one_row_linear, got.few_rows_linear, got.source) == (False, False, "default")


def test_one_measurement_per_process_and_thread_count(monkeypatch):
    calls = []

    def fake(weights):
        calls.append(len(weights))
        return row_product.RowProduct(one_row_linear=True, few_rows_linear=True, source="measured")

    monkeypatch.setattr(row_product, "measure", fake)
    monkeypatch.setattr(row_product, "MIN_SAMPLE_BYTES", 1024)
    w = torch.randn(64, 64)
    assert choose([w, w]).one_row_linear and calls == [1]  # the shared tensor counted once
    assert choose([torch.randn(64, 64)]).one_row_linear and calls == [1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        choose([w])
        assert calls == [1, 1]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("value, linear", [("linear", True), ("weight-first", False), (" LINEAR ", True)])
def test_environment_forces_a_product(monkeypatch, value, linear):
    monkeypatch.setenv(ENV_VAR, value)
    monkeypatch.setattr(row_product, "measure", lambda weights: pytest.fail("measured despite the environment"))
    got = choose([torch.randn(4096, 4096)])
    assert (got.one_row_linear, got.few_rows_linear, got.source) == (linear, linear, "env")


def test_a_bad_environment_value_is_named_and_load_fails_cleanly(monkeypatch, tmp_path):
    """The value as set is quoted, a near miss gets a hint, and load() refuses it before reading
    anything, whatever its other options (quantized models never consult the choice)."""
    monkeypatch.setenv(ENV_VAR, "gemv")
    with pytest.raises(RowProductError, match=f"{ENV_VAR} must be one of auto, weight-first, linear; got 'gemv'$"):
        choose([torch.randn(4, 4)])
    monkeypatch.setenv(ENV_VAR, " GEMV")
    with pytest.raises(RowProductError, match="got ' GEMV'$"):
        choose([torch.randn(4, 4)])
    monkeypatch.setenv(ENV_VAR, "weight_first")
    with pytest.raises(RowProductError, match=r"got 'weight_first' \(did you mean 'weight-first'\?\)"):
        choose([torch.randn(4, 4)])
    net = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(RowProductError):
        weight_left(net)
    assert type(net[0]) is nn.Linear  # nothing changed before the error
    SkipModel(make_model("llama"), make_tokenizer()).save_pretrained(tmp_path / "tiny")
    for kwargs in ({}, {"quantize": "int8"}, {"dtype": "bfloat16"}):
        with pytest.raises(LoadError, match=ENV_VAR):
            load(str(tmp_path / "tiny"), **kwargs)
    with pytest.raises(LoadError, match=ENV_VAR):  # before looking for the model
        load(str(tmp_path / "no-such-model"))


def test_the_choice_in_words():
    """What skipdecode info and bench print for each way the choice was made."""
    measured = RowProduct(one_row_linear=True, few_rows_linear=False, source="measured", threads=2,
                          sample_mb=256.5).as_dict()
    assert describe(measured) == ("F.linear at 1 row, weight-first at 2-127 rows "
                                  "(timed on 256.5 MB of the weights, 2 threads)")
    forced = RowProduct(one_row_linear=True, few_rows_linear=True, source="env").as_dict()
    assert describe(forced) == f"F.linear at 1 row, F.linear at 2-127 rows (forced: {ENV_VAR}=linear)"
    assert describe(RowProduct().as_dict()).endswith("(default: too few weights to time)")
    assert describe(None) == ""


@pytest.mark.parametrize("rows", [1, 2, 5, 17])
@pytest.mark.parametrize("linear", [False, True])
def test_layers_run_the_chosen_product(monkeypatch, rows, linear):
    """With the choice set, one-row and few-row products call F.linear (and only then)."""
    torch.manual_seed(rows)
    layer = nn.Linear(24, 40)
    layer.__class__ = WeightLeftLinear
    layer.one_row_linear = layer.few_rows_linear = linear
    import skipdecode.layout as layout

    calls = _spy_on_f_linear(monkeypatch, layout)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-6, rtol=1e-5)
    assert bool(calls) is linear


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_a_model_on_f_linear_gives_the_reference_answers(monkeypatch, family):
    """weight_left under SKIPDECODE_ROW_PRODUCT=linear: every layer runs F.linear for few rows,
    and the model's logits and greedy tokens, full depth and skipping, equal the unmodified
    model's."""
    monkeypatch.setenv(ENV_VAR, "linear")
    sk = SkipModel(make_model(family), make_tokenizer())
    ids = torch.tensor([[5, 9, 13, 7, 21, 3]])
    policies = (sk.policy_for(speedup=1.0), LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, horizon=6))
    want_logits = sk.model(ids).logits
    want = [sk.generate(PROMPTS, max_new_tokens=8, policy=p).token_ids for p in policies]
    assert weight_left(sk.model) > 0
    assert sk.model.skipdecode_row_product.source == "env"
    layers = [m for m in sk.model.modules() if type(m) is WeightLeftLinear]
    assert layers and all(m.one_row_linear and m.few_rows_linear for m in layers)
    torch.testing.assert_close(sk.model(ids).logits, want_logits, atol=1e-5, rtol=1e-5)
    assert [sk.generate(PROMPTS, max_new_tokens=8, policy=p).token_ids for p in policies] == want
    solo = [sk.generate([p], max_new_tokens=8).token_ids[0] for p in PROMPTS]
    assert solo == want[0]  # one row (F.linear's GEMV) and two rows agree


@pytest.mark.skipif(not onednn.available()[0], reason="oneDNN unavailable")
def test_two_row_products_below_onednn_follow_the_choice(monkeypatch):
    """The compiled graphs' opaque op sends 2 rows (below MIN_ROWS) to F.linear when the layer's
    choice says so, and returns a contiguous result as its fake kernel promises."""
    import skipdecode.onednn as mod

    net = nn.Sequential(nn.Linear(24, 40))
    net[0].__class__ = WeightLeftLinear
    onednn.enable(net)
    calls = _spy_on_f_linear(monkeypatch, mod)
    x = torch.randn(2, 24)
    for linear in (False, True):
        net[0].few_rows_linear = linear
        calls.clear()
        y = torch.ops.skipdecode.onednn_linear(x, net[0].weight, net[0].bias)
        assert y.is_contiguous() and bool(calls) is linear
        torch.testing.assert_close(y, F.linear(x, net[0].weight, net[0].bias), atol=1e-5, rtol=1e-5)


def test_a_forced_product_leads_the_recorded_command(monkeypatch):
    """Benchmarks record their command; a forced product changes what it measures, so it is part of it."""
    app = typer.Typer()

    @app.command()
    def bench(ctx: typer.Context, threads: int = typer.Option(1, "--threads")):
        print(command_line(ctx))

    runner = CliRunner()
    assert runner.invoke(app, ["--threads", "2"], prog_name="bench").output.strip() == "skipdecode bench --threads 2"
    monkeypatch.setenv(ENV_VAR, "weight-first")
    got = runner.invoke(app, ["--threads", "2"], prog_name="bench").output.strip()
    assert got == f"{ENV_VAR}=weight-first skipdecode bench --threads 2"
    monkeypatch.setenv(ENV_VAR, "auto")
    assert runner.invoke(app, [], prog_name="bench").output.strip() == "skipdecode bench"
