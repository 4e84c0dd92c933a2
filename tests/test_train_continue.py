"""Training further from a finished run: full fine-tuning from a LoRA run's ``final/`` starts from
the adapter merged into its base and trains every weight (it crashed with "element 0 of tensors
does not require grad": peft's merge leaves the base weights frozen); a decode-only adapter,
which one set of weights cannot hold, is refused naming the LoRA run that continues it.
Tiny random models, offline."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from test_train import cfg, examples, tiny_skipmodel, weights

import skipdecode
from skipdecode.train import TrainConfigError, train


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A saved tiny base model and a 2-step LoRA run (r=4, alpha=8) trained from it."""
    root = tmp_path_factory.mktemp("continue")
    tiny_skipmodel().save_pretrained(root / "base")
    train(skipdecode.load(root / "base", adapter=False), examples(),
          cfg(root / "lora", lora_r=4, lr=1e-2, max_steps=2))
    return root


def test_lora_final_loads_as_base_plus_its_delta(lora_run):
    """The starting weights of the full run are W + (alpha / r) B A for every adapted linear, the
    base's weights elsewhere: a wrong merge (or none) would fail here."""
    base = weights(skipdecode.load(lora_run / "base", adapter=False).model)
    merged = weights(skipdecode.load(lora_run / "lora" / "final", adapter=False).model)
    lora = load_file(str(lora_run / "lora" / "final" / "adapter_model.safetensors"))
    config = json.loads((lora_run / "lora" / "final" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert scale == 2.0
    adapted = set()
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        torch.testing.assert_close(merged[name], base[name] + scale * (b.float() @ a.float()), rtol=0, atol=1e-6)
        adapted.add(name)
    assert len(adapted) == 6 * 7  # every linear of the 6 layers
    assert any(not torch.equal(merged[n], base[n]) for n in adapted)  # the adapter changed something
    for name in set(base) - adapted:
        assert torch.equal(merged[name], base[name]), name


def test_full_fine_tuning_from_a_lora_run_trains_every_weight(lora_run, tmp_path):
    """No --lora-r from a LoRA run's final/: every parameter requires grad and receives a gradient
    at step 2 (hooks set after step 1), the loss is finite and every weight tensor moves."""
    sk = skipdecode.load(lora_run / "lora" / "final", adapter=False)
    start = weights(sk.model)
    got_grad: set[str] = set()

    def hook_after_step_1(info):
        if info["step"] == 1:
            for name, p in sk.model.named_parameters():
                p.register_hook(lambda g, n=name: got_grad.add(n) if bool(g.abs().sum() > 0) else None)

    result = train(sk, examples(), cfg(tmp_path / "full", max_steps=2), callback=hook_after_step_1)
    assert not result.lora and result.steps == 2
    assert all(math.isfinite(r["loss"]) for r in result.train_log)
    names = {n for n, _ in sk.model.named_parameters()}
    assert got_grad == names
    assert all(p.requires_grad for p in sk.model.parameters())
    after = weights(sk.model)
    assert all(not torch.equal(after[n], start[n]) for n in names)
    # the saved model is a full checkpoint that loads back as trained
    final = tmp_path / "full" / "final"
    assert (final / "model.safetensors").exists() and not (final / "adapter_config.json").exists()
    reloaded = weights(skipdecode.load(final, adapter=False).model)
    for n in names:
        torch.testing.assert_close(reloaded[n], after[n], rtol=0, atol=0)


def test_cli_full_run_from_a_lora_final(lora_run, tmp_path):
    """The user's command: ``skipdecode train --model runs/lora/final`` without --lora-r."""
    from typer.testing import CliRunner

    from skipdecode.cli import app

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples()))
    res = CliRunner().invoke(app, [
        "train", "--model", str(lora_run / "lora" / "final"), "--data", str(data), "--val-fraction", "0",
        "--max-steps", "1", "--batch-size", "2", "--speedup", "2", "--out", str(tmp_path / "b1"), "--no-progress"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 1 and not summary["lora"] and math.isfinite(summary["final_train_loss"])


def test_a_decode_only_adapter_is_refused_for_full_fine_tuning(lora_run, tmp_path):
    """A decode-only adapter prefills with the base weights: one trained model cannot hold both,
    so the run is refused before any work, naming the options of a LoRA run that continues it."""
    train(skipdecode.load(lora_run / "base", adapter=False), examples(),
          cfg(tmp_path / "dec", lora_r=4, max_steps=1, prompt_grad=False, base_prefill=True))
    final = tmp_path / "dec" / "final"
    with pytest.raises(TrainConfigError) as info:
        train(skipdecode.load(final, adapter=False), examples(), cfg(tmp_path / "full", max_steps=1))
    assert info.value.field == "base_model"
    assert "decode-only" in info.value.reason and f"--init-adapter {final}" in info.value.reason
    assert "--lora-r 4" in info.value.reason and "--base-prefill" in info.value.reason
    assert not (tmp_path / "full").exists()


def test_a_lora_run_recorded_with_a_relative_base_loads_from_another_directory(lora_run, tmp_path, monkeypatch):
    """Training records a local base relative to the directory it ran in; loading the run's
    final/ from elsewhere finds the base from the run folder's ancestors, merges it as before,
    and returns a model whose every parameter can train (peft's merge left them frozen)."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(lora_run / "base", work / "base")
    final = work / "runs" / "lora" / "final"
    shutil.copytree(lora_run / "lora" / "final", final)
    for name, key in (("skipdecode.json", "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        record = json.loads((final / name).read_text())
        if key in record:
            record[key] = "base"  # as a run started in `work` records it
            (final / name).write_text(json.dumps(record))
    monkeypatch.chdir(tmp_path)  # not where training ran: "base" is not here
    sk = skipdecode.load(final, adapter=False)
    want = weights(skipdecode.load(lora_run / "lora" / "final", adapter=False).model)
    got = weights(sk.model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(p.requires_grad for p in sk.model.parameters())


def test_saving_a_lora_run_prints_no_base_config_lookup_warnings(tmp_path):
    """peft's two warnings about looking up the base's config.json while saving an adapter
    (the base here, as the embedded model's, has no such folder) are silenced, nothing else."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "lora", lora_r=4, max_steps=1))
        warnings.warn("a warning of our own", UserWarning)  # still shown inside the same block
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if m.startswith(("Unable to fetch remote file", "Could not find a config file"))]
    assert "a warning of our own" in messages


def test_full_fine_tuning_keeps_a_callers_frozen_weights_and_refuses_a_wholly_frozen_model(tmp_path):
    """Weights the caller froze stay as they are; a model with nothing to train is refused by
    name (it failed deep in the backward pass)."""
    sk = tiny_skipmodel()
    embed = sk.model.get_input_embeddings().weight
    embed.requires_grad_(False)
    before = embed.detach().clone()
    train(sk, examples(), cfg(tmp_path / "part", lr=1e-2, max_steps=2))
    assert torch.equal(sk.model.get_input_embeddings().weight.detach(), before)
    frozen = tiny_skipmodel()
    frozen.model.requires_grad_(False)
    with pytest.raises(TrainConfigError, match="no trainable weight"):
        train(frozen, examples(), cfg(tmp_path / "none", max_steps=1))
