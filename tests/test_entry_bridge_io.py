"""Entry bridges (:mod:`skipdecode.entry_bridge`, a project extension) outside the forward pass:
the in-flight engine and its prefix cache apply a bridge exactly as a solo static run does;
``save_pretrained`` / ``load`` round-trip it (checksummed; a damaged file is one LoadError naming
it); a skip adapter folder brings its own (over the model's); ``install_adapter`` keeps it;
``skipdecode train --entry-bridge`` fits it before step 1, keeps it frozen, saves it with every
checkpoint and ``final/``, and a resume reloads it instead of fitting again; ``info`` and
``adapter_summary`` report it. Tiny random llama/gpt2 models, offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_model
from test_entry_bridge import _bridge
from test_inflight import CASES as INFLIGHT_CASES
from test_inflight import L, POLICIES, prompt, run_inflight, solo
from test_prefix_cache import CASES as PREFIX_CASES
from test_prefix_cache import assert_solo, requests_of, run_rows
from test_skip_adapter import adapter_dir, base_dir  # noqa: F401  (fixtures)
from test_train import Killed, cfg, examples, tiny_skipmodel, weights
from test_train import data_file, tiny_model_dir  # noqa: F401  (fixtures)
from skipdecode import FullPolicy, LinearDecayPolicy, LoadError, SkipModel, for_speedup, get_adapter, load
from skipdecode import skip_adapter as sa
from skipdecode.cli import app
from skipdecode.engine import Request
from skipdecode.entry_bridge import ENTRY_BRIDGE_FILE, EntryBridge, attach_entry_bridge, entry_bridge_of
from skipdecode.model import SKIP_CONFIG_NAME
from skipdecode.skip_config import sha256_file
from skipdecode.train import TrainConfigError, latest_checkpoint, train

SKIP = POLICIES[1]  # warm-up 1: jumps from layer 0, the source of _bridge's maps (targets 2..5)
PROMPTS = ["Describe the restaurant", "name[The Eagle] food[French]"]
TARGETS = {"count": L - 2, "first": 2, "last": L - 1}


def _same_bridge(got: EntryBridge | None, want: EntryBridge) -> None:
    assert got is not None and got.source == want.source and got.targets == want.targets
    assert torch.equal(got.weight.cpu(), want.weight.cpu()) and torch.equal(got.bias.cpu(), want.bias.cpu())


def _greedy(sk: SkipModel, n: int = 10) -> list[list[int]]:
    return sk.generate(PROMPTS, policy=SKIP, max_new_tokens=n, chat=False).token_ids


# ---------------------------------------------------------------------------------------------
# In-flight rows and the prefix cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_inflight_rows_with_a_bridge_equal_their_solo_runs(family):
    """Rows join at different steps with different policies; only the rows whose plan runs layer 0
    and jumps get the bridge, and each equals its solo static run with the same bridge."""
    model = make_model(family, L)
    adapter = get_adapter(model)

    def requests():
        return [Request(prompt(n, 10 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(INFLIGHT_CASES)]

    joins = [c[3] for c in INFLIGHT_CASES]
    _, plain = run_inflight(adapter, requests(), joins)
    attach_entry_bridge(model, _bridge(model.config.hidden_size))
    reqs = requests()
    _, bridged = run_inflight(adapter, reqs, joins)
    for req, (toks, logits), (_, plain_logits) in zip(reqs, bridged, plain):
        want_toks, want_logits = solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)
        assert toks == want_toks
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        if req.policy is not SKIP:  # full depth, warm-up 0 or 2: never "ran layer 0, then jumped"
            torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=1e-5)
    jumping = [i for i, c in enumerate(INFLIGHT_CASES) if POLICIES[c[1]] is SKIP]
    assert any(bridged[i][0] != plain[i][0] for i in jumping)  # the row path really applies it


def test_prefix_cache_with_a_bridge_equals_no_prefix_cache():
    model = make_model("llama", L)
    adapter = get_adapter(model)
    joins = [c[3] for c in PREFIX_CASES]
    _, _, plain = run_rows(adapter, requests_of(PREFIX_CASES), joins)
    attach_entry_bridge(model, _bridge(model.config.hidden_size, seed=2))
    reqs = requests_of(PREFIX_CASES)
    _, rows, on = run_rows(adapter, reqs, joins)
    _, _, off = run_rows(adapter, requests_of(PREFIX_CASES), joins, prefix_cache=False)
    assert [r.cached_prompt_tokens for r in rows] == [c[4] for c in PREFIX_CASES]  # prefixes were reused
    for (a_toks, a_logits), (b_toks, b_logits) in zip(on, off):
        assert a_toks == b_toks
        torch.testing.assert_close(a_logits, b_logits, atol=1e-4, rtol=1e-4)
    assert_solo(adapter, reqs, on)
    assert any(a[0] != b[0] for a, b in zip(on, plain))  # and the bridge acted


# ---------------------------------------------------------------------------------------------
# Saving and loading
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridged_dir(tmp_path_factory, tokenizer):
    """A tiny llama (the weights of test_skip_adapter's base_dir) saved with a bridge, and the
    in-memory SkipModel it was saved from (read-only)."""
    model = make_model("llama", L)
    attach_entry_bridge(model, _bridge(model.config.hidden_size, seed=3))
    sk = SkipModel(model, tokenizer, policy=SKIP, chat=False)
    path = tmp_path_factory.mktemp("bridged") / "model"
    sk.save_pretrained(path)
    return path, sk


@pytest.fixture(scope="module")
def bridged_adapter_dir(adapter_dir, tmp_path_factory):  # noqa: F811
    """test_skip_adapter's LoRA adapter folder plus a bridge of its own (no recorded checksums)."""
    path = tmp_path_factory.mktemp("bridged_adapter") / "lora"
    shutil.copytree(adapter_dir, path)
    _bridge(32, seed=4).save(path)
    return path


def test_save_and_load_round_trip_the_bridge(bridged_dir):
    path, sk = bridged_dir
    original = entry_bridge_of(sk.model)
    meta = json.loads((path / SKIP_CONFIG_NAME).read_text())
    assert meta["weights_sha256"][ENTRY_BRIDGE_FILE] == sha256_file(path / ENTRY_BRIDGE_FILE)
    assert meta["entry_bridge"]["source"] == 0 and meta["entry_bridge"]["targets"] == list(range(2, L))
    loaded = load(str(path))
    _same_bridge(entry_bridge_of(loaded.model), original)
    assert entry_bridge_of(loaded.model) is not original and loaded.entry_bridge_path == path
    want = _greedy(sk)
    assert _greedy(loaded) == want
    attach_entry_bridge(loaded.model, None)
    assert _greedy(loaded) != want  # without its bridge the saved model answers otherwise


def test_resident_bytes_count_the_bridge(tokenizer):
    sk = SkipModel(make_model("llama", L), tokenizer)
    before = sk.resident_bytes()
    bridge = _bridge(32)
    attach_entry_bridge(sk.model, bridge)
    extra = (bridge.weight.numel() + bridge.bias.numel()) * 4  # float32, outside the module tree
    assert sk.resident_bytes() == {"total": before["total"] + extra, "quantized": 0, "float": before["float"] + extra}


@pytest.mark.parametrize("damage", ["flipped", "truncated", "no_metadata"])
def test_a_damaged_bridge_file_is_a_load_error_naming_it(bridged_dir, tmp_path, damage):
    """A flipped byte fails the recorded sha256; an unrecorded truncated file or one without the
    bridge's metadata fails when read. Each is one LoadError naming the file."""
    from safetensors.torch import save_file

    path = tmp_path / "model"
    shutil.copytree(bridged_dir[0], path)
    f = path / ENTRY_BRIDGE_FILE
    meta = json.loads((path / SKIP_CONFIG_NAME).read_text())
    if damage == "flipped":
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        del meta["weights_sha256"][ENTRY_BRIDGE_FILE]
        (path / SKIP_CONFIG_NAME).write_text(json.dumps(meta))
        if damage == "truncated":
            f.write_bytes(f.read_bytes()[:40])
        else:
            save_file({"weight": torch.zeros(4, 32, 32), "bias": torch.zeros(4, 32)}, str(f))
    with pytest.raises(LoadError) as info:
        load(str(path))
    message = str(info.value)
    assert ENTRY_BRIDGE_FILE in message and "\n" not in message
    assert {"flipped": "sha256", "truncated": "safetensors", "no_metadata": "metadata"}[damage] in message


def test_a_skip_adapter_folder_brings_its_bridge(base_dir, adapter_dir, bridged_adapter_dir, bridged_dir):  # noqa: F811
    want = EntryBridge.load(bridged_adapter_dir)
    on = load(str(base_dir), adapter=str(bridged_adapter_dir))
    _same_bridge(entry_bridge_of(on.model), want)
    assert on.entry_bridge_path == bridged_adapter_dir
    summary = on.skip_config["skip_adapter"]["entry_bridge"]
    size = (bridged_adapter_dir / ENTRY_BRIDGE_FILE).stat().st_size
    assert summary == {"file": ENTRY_BRIDGE_FILE, "source": 0, "targets": TARGETS, "hidden_size": 32,
                       "dtype": "float32", "bytes": size, "megabytes": round(size / 1e6, 3)}
    assert sa.adapter_summary(adapter_dir, shipped=False)["entry_bridge"] is None
    off = load(str(base_dir), adapter=False)
    assert entry_bridge_of(off.model) is None and off.entry_bridge_path is None
    without = load(str(base_dir), adapter=str(adapter_dir))  # the same LoRA, no bridge
    assert entry_bridge_of(without.model) is None and _greedy(without) != _greedy(on)
    # over a model folder with its own bridge, the adapter's wins; adapter=False keeps the model's
    model_path, _ = bridged_dir
    _same_bridge(entry_bridge_of(load(str(model_path), adapter=str(bridged_adapter_dir)).model), want)
    _same_bridge(entry_bridge_of(load(str(model_path), adapter=False).model), EntryBridge.load(model_path))


def test_a_damaged_adapter_bridge_is_a_load_error(base_dir, bridged_adapter_dir, tmp_path):  # noqa: F811
    path = tmp_path / "lora"
    shutil.copytree(bridged_adapter_dir, path)
    (path / ENTRY_BRIDGE_FILE).write_bytes(b"not safetensors at all")
    with pytest.raises(LoadError, match=ENTRY_BRIDGE_FILE):
        load(str(base_dir), adapter=str(path))


def test_install_adapter_keeps_the_bridge(base_dir, bridged_adapter_dir, tmp_path):  # noqa: F811
    target = sa.install_adapter(bridged_adapter_dir, name="tiny", target_root=tmp_path)
    want = EntryBridge.load(bridged_adapter_dir)
    got = EntryBridge.load(target)
    assert got.targets == want.targets and got.source == want.source
    # stored per-row int8: each weight within half a step (row absmax / 127, rounded up to float16)
    step = want.weight.abs().amax(-1, keepdim=True) / 127 * (1 + 2.0 ** -10)
    assert bool(((got.weight - want.weight).abs() <= step / 2 + 1e-7).all())
    assert not torch.equal(got.weight, want.weight)  # it really was rounded
    torch.testing.assert_close(got.bias, want.bias)  # the bias stays float32
    assert sa.entry_bridge_summary(target)["dtype"] == "int8"
    assert (target / ENTRY_BRIDGE_FILE).stat().st_size < 0.4 * (bridged_adapter_dir / ENTRY_BRIDGE_FILE).stat().st_size
    meta = json.loads((target / SKIP_CONFIG_NAME).read_text())
    assert meta["weights_sha256"][ENTRY_BRIDGE_FILE] == sha256_file(target / ENTRY_BRIDGE_FILE)
    assert load(str(base_dir), adapter=str(target)).entry_bridge_path == target


# ---------------------------------------------------------------------------------------------
# skipdecode info
# ---------------------------------------------------------------------------------------------


def _info(*args: str) -> dict:
    res = CliRunner().invoke(app, ["info", *args, "--json"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cli_info_reports_the_bridge(base_dir, bridged_dir, bridged_adapter_dir, monkeypatch):  # noqa: F811
    model_path, _ = bridged_dir
    got = _info("--model", str(model_path))["entry_bridge"]
    size = (model_path / ENTRY_BRIDGE_FILE).stat().st_size
    assert got == {"file": ENTRY_BRIDGE_FILE, "source": 0, "targets": TARGETS, "hidden_size": 32, "dtype": "float32",
                   "bytes": size, "megabytes": round(size / 1e6, 3), "path": str(model_path)}
    assert _info("--model", str(base_dir))["entry_bridge"] is None
    # a (pretend) shipped adapter with a bridge: reported in both places; --no-adapter drops it
    monkeypatch.setattr(sa, "shipped_adapter_for", lambda name: bridged_adapter_dir if name == str(base_dir) else None)
    info = _info("--model", str(base_dir))
    assert info["entry_bridge"]["path"] == str(bridged_adapter_dir)
    assert info["skip_adapter"]["entry_bridge"]["targets"] == TARGETS
    assert _info("--model", str(base_dir), "--no-adapter")["entry_bridge"] is None
    summary = CliRunner().invoke(app, ["info", "--model", str(base_dir)], env={"COLUMNS": "200"}).stdout
    first, last = TARGETS["first"], TARGETS["last"]
    assert f"entry bridge:    layer 0 -> entry layers {first}-{last} ({TARGETS['count']} layers)" in summary


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def _spy_attach(monkeypatch) -> list[tuple[EntryBridge, torch.Tensor, torch.Tensor]]:
    """Record every bridge attached from now on, with copies of its weights at that moment."""
    import skipdecode.entry_bridge as eb

    seen = []
    real = eb.attach_entry_bridge

    def spy(model, bridge):
        if bridge is not None:
            seen.append((bridge, bridge.weight.detach().clone(), bridge.bias.detach().clone()))
        real(model, bridge)

    monkeypatch.setattr(eb, "attach_entry_bridge", spy)
    return seen


@pytest.mark.parametrize("lora_r", [0, 4])
def test_training_fits_a_frozen_bridge_and_saves_it(tmp_path, monkeypatch, lora_r):
    base = tmp_path / "base"
    tiny_skipmodel().save_pretrained(base)
    sk = load(str(base))
    before = weights(sk.model)
    seen = _spy_attach(monkeypatch)
    settings = dict(max_steps=3, lr=1e-2, lora_r=lora_r, speedup=2.0)
    result = train(sk, examples(), cfg(tmp_path / "run", entry_bridge=True, entry_bridge_examples=4, **settings))
    assert len(seen) == 1
    bridge, w0, b0 = seen[0]
    assert entry_bridge_of(sk.model) is bridge and not bridge.weight.requires_grad
    assert torch.equal(bridge.weight, w0) and torch.equal(bridge.bias, b0)  # frozen through training
    assert not torch.equal(w0, torch.eye(32).expand_as(w0))  # fitted, not the identity
    assert any(not torch.equal(before[k], v) for k, v in weights(sk.model).items())  # the model did train
    final = Path(result.final_dir)
    saved = EntryBridge.load(final)
    assert saved.source == 0 and saved.targets == list(range(2, L))
    assert torch.equal(saved.weight, w0) and torch.equal(saved.bias, b0)
    meta = json.loads((final / SKIP_CONFIG_NAME).read_text())
    record = meta["training"]["entry_bridge"]
    assert record["positions"] > 0 and record["examples"] == 4 and record["targets"] == list(range(2, L))
    assert meta["weights_sha256"][ENTRY_BRIDGE_FILE] == sha256_file(final / ENTRY_BRIDGE_FILE)
    loaded = load(str(final))
    _same_bridge(entry_bridge_of(loaded.model), saved)
    # the bridge takes part in training: without it the first step's loss differs
    plain = train(load(str(base)), examples(), cfg(tmp_path / "plain", **{**settings, "max_steps": 1}))
    assert plain.train_log[0]["loss"] != pytest.approx(result.train_log[0]["loss"], abs=1e-6)


def test_resume_reloads_the_checkpoint_bridge(tmp_path, monkeypatch):
    import skipdecode.training.bridge as tb

    out = tmp_path / "run"
    settings = dict(max_steps=4, checkpoint_every=2, entry_bridge=True, entry_bridge_examples=3)
    seen = _spy_attach(monkeypatch)

    def kill(info):
        if info["step"] == 2:
            raise Killed

    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(out, **settings), callback=kill)
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "checkpoint-00000002" and (ckpt / ENTRY_BRIDGE_FILE).is_file()
    record = json.loads((ckpt / SKIP_CONFIG_NAME).read_text())["training"]["entry_bridge"]

    def refit(*args, **kwargs):
        raise AssertionError("a resumed run fitted its bridge again")

    monkeypatch.setattr(tb, "fit_training_bridge", refit)
    result = train(tiny_skipmodel(), examples(), cfg(out, resume=True, **settings))
    assert result.resumed_from.endswith("checkpoint-00000002") and result.steps == 4
    assert len(seen) == 2 and torch.equal(seen[1][1], seen[0][1]) and torch.equal(seen[1][2], seen[0][2])
    final = out / "final"
    assert torch.equal(EntryBridge.load(final).weight, seen[0][1])
    assert json.loads((final / SKIP_CONFIG_NAME).read_text())["training"]["entry_bridge"] == record
    with pytest.raises(TrainConfigError) as info:  # a resume without the bridge is refused
        train(tiny_skipmodel(), examples(), cfg(out, resume=True, **{**settings, "entry_bridge": False}))
    assert info.value.field == "entry_bridge"


def test_a_trained_bridge_moves_and_resumes_like_an_uninterrupted_run(tmp_path, monkeypatch):
    settings = dict(max_steps=4, checkpoint_every=2, entry_bridge=True, entry_bridge_examples=3,
                    entry_bridge_lr=1e-2, lora_r=2, lr=1e-2)
    seen = _spy_attach(monkeypatch)
    whole = train(tiny_skipmodel(), examples(), cfg(tmp_path / "whole", **settings))
    bridge, w0, _ = seen[0]
    assert bridge.weight.requires_grad and not torch.equal(bridge.weight.detach(), w0)  # it trained
    final = EntryBridge.load(whole.final_dir)
    torch.testing.assert_close(final.weight, bridge.weight.detach())  # the trained bridge is saved
    assert json.loads((Path(whole.final_dir) / SKIP_CONFIG_NAME).read_text())["training"]["entry_bridge"]["trained"]

    def kill(info):
        if info["step"] == 2:
            raise Killed

    out = tmp_path / "cut"
    with pytest.raises(Killed):
        train(tiny_skipmodel(), examples(), cfg(out, **settings), callback=kill)
    resumed = train(tiny_skipmodel(), examples(), cfg(out, resume=True, **settings))
    assert resumed.resumed_from.endswith("checkpoint-00000002")
    got = EntryBridge.load(resumed.final_dir)  # the optimizer state of the bridge was restored too
    torch.testing.assert_close(got.weight, final.weight, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.bias, final.bias, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kw,field", [(dict(entry_bridge_examples=0), "entry_bridge_examples"),
                                      (dict(entry_bridge="yes"), "entry_bridge"),
                                      (dict(entry_bridge_lr=0.0), "entry_bridge_lr"),
                                      (dict(entry_bridge_lr=1e-3, entry_bridge=False), "entry_bridge_lr"),
                                      (dict(speedup=1.0), "entry_bridge")])
def test_bridge_settings_are_checked(tmp_path, kw, field):
    with pytest.raises(TrainConfigError) as info:
        cfg(tmp_path, **{"entry_bridge": True, **kw})
    assert info.value.field == field and str(info.value).startswith(field)


def test_mixed_warmup_depths_are_refused_naming_entry_bridge():
    """TrainConfig has one ``warmup_layers`` for every speedup, so only the fit's own check can see
    two depths; one bridge maps from one layer."""
    from skipdecode.training.bridge import bridge_source

    one = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    two = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=3, warmup_layers=2, horizon=4)
    assert bridge_source([("a", one)]) == 0 and bridge_source([("b", two)]) == 1
    with pytest.raises(TrainConfigError) as info:
        bridge_source([("a", one), ("b", two)])
    assert info.value.field == "entry_bridge" and "warmup_layers" in str(info.value)


def test_a_full_depth_policy_does_not_block_the_bridge():
    from skipdecode.training.bridge import bridge_source

    assert bridge_source([("1", FullPolicy(L)), ("2", for_speedup(L, 2.0, 4))]) == 0
    with pytest.raises(TrainConfigError, match="full depth"):
        bridge_source([("1", FullPolicy(L))])


def test_a_bridge_computes_in_float32_and_returns_its_inputs_dtype():
    bridge = EntryBridge(4, 0, [2], torch.eye(4)[None] * 2, torch.ones(1, 4))
    h = torch.ones(1, 1, 4, dtype=torch.float64)
    out = bridge(2, h)
    assert out.dtype == torch.float64 and torch.equal(out, torch.full((1, 1, 4), 3.0, dtype=torch.float64))


def test_cli_train_entry_bridge_flag(tiny_model_dir, data_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model_dir), "--data", str(data_file), "--speedup", "2", "--max-steps", "1",
        "--batch-size", "2", "--out", str(out), "--no-progress", "--entry-bridge",
    ])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "final" / SKIP_CONFIG_NAME).read_text())
    assert meta["training"]["config"]["entry_bridge"] is True and meta["training"]["entry_bridge"]["positions"] > 0
    assert EntryBridge.load(out / "final").targets == list(range(2, L))


def test_a_lora_model_folder_keeps_its_base_models_bridge(bridged_dir, adapter_dir, tmp_path):  # noqa: F811
    """A LoRA checkpoint folder without a bridge, over a base folder with one: the base's bridge
    is attached (the LoRA folder's own would win), and ``entry_bridge_path`` says where it came from."""
    model_path, _ = bridged_dir
    lora = tmp_path / "lora"
    shutil.copytree(adapter_dir, lora)
    meta = json.loads((lora / SKIP_CONFIG_NAME).read_text())
    (lora / SKIP_CONFIG_NAME).write_text(json.dumps({**meta, "base_model": str(model_path)}))
    sk = load(str(lora))
    _same_bridge(entry_bridge_of(sk.model), EntryBridge.load(model_path))
    assert sk.entry_bridge_path == model_path
    _bridge(32, seed=5).save(lora)
    sk = load(str(lora))
    _same_bridge(entry_bridge_of(sk.model), EntryBridge.load(lora))
    assert sk.entry_bridge_path == lora
