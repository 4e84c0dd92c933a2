"""On-policy distillation (``TrainConfig.on_policy``) and warm starts (``TrainConfig.init_adapter``).

The reference is built from the inference path, not from the training code: the student's answer
is what ``skipdecode.load(base, adapter=folder).generate`` writes (decode-only: the base model
prefills), its logits are the generation loop's, and the targets are the unmodified Hugging Face
model's argmax at every answer position."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from test_decode_only_adapter import decode_only_dir  # noqa: F401  (fixture)
from test_skip_adapter import ADAPTER_POLICY, NUM_LAYERS, adapter_dir, base_dir  # noqa: F401  (fixtures)
from test_train import cfg

from skipdecode import load
from skipdecode.generate import _eos_ids, encode_prompts, generate_step
from skipdecode.train import Batch, TokenizedExample, TrainConfigError, train
from skipdecode.training.on_policy import on_policy_rows, on_policy_targets, student_answers

PROMPTS = ["Describe the restaurant", "name[The Eagle] food[French] area[riverside]"]
N_NEW = 6


def _run_cfg(out, **kw):
    base = dict(distill=True, lora_r=2, lora_alpha=4, base_prefill=True, prompt_grad=False, kl_weight=0.5,
                max_layers=ADAPTER_POLICY.max_layers, min_layers=ADAPTER_POLICY.min_layers,
                warmup_layers=ADAPTER_POLICY.warmup_layers, horizon=ADAPTER_POLICY.horizon, speedup=None,
                distill_max_new_tokens=N_NEW, chat=False, val_fraction=0.0, max_steps=1, batch_size=2, lr=1e-6)
    base.update(kw)
    return cfg(out, **base)


def _reference_loss(base_dir, folder) -> tuple[float, list[list[int]]]:  # noqa: F811
    """Mean CE per answer token of the decode-only student's own greedy answers (inference path)
    against the stock HF model's argmax at each answer position; and the answers."""
    student = load(str(base_dir), adapter=str(folder))
    stock = load(str(base_dir), adapter=False)
    eos = _eos_ids(student.tokenizer, student.model)
    total, count, answers = 0.0, 0, []
    for prompt in PROMPTS:
        ids, mask = encode_prompts(student.tokenizer, [prompt], chat=False)
        with torch.no_grad():
            steps = list(generate_step(student.adapter, ids, mask, policy=ADAPTER_POLICY, max_new_tokens=N_NEW,
                                       eos_token_ids=eos))
        answer = [int(s.tokens[0]) for s in steps if bool(s.emitted[0])]
        answers.append(answer)
        for j, s in enumerate(steps[:len(answer)]):
            seq = torch.cat([ids, torch.tensor([answer[:j]], dtype=torch.long)], 1)
            with torch.no_grad():
                target = stock.model(seq).logits[0, -1].argmax()  # the unmodified HF model
            total += float(F.cross_entropy(s.logits[0].float()[None], target[None]))
            count += 1
    return total / count, answers


def test_on_policy_rows_rounds_and_keeps_at_least_one():
    assert [on_policy_rows(0.5, 16), on_policy_rows(0.1, 4), on_policy_rows(0.0, 16), on_policy_rows(1.0, 3)] \
        == [8, 1, 0, 3]
    assert on_policy_rows(0.26, 8) == 2 and on_policy_rows(0.3, 0) == 0


def test_on_policy_targets_take_the_teachers_argmax_on_leading_rows_only():
    items = [TokenizedExample((5, 6), (7, 8, 9)), TokenizedExample((5,), (10, 11)), TokenizedExample((4, 4, 4), (12, 13))]
    from skipdecode.train import collate

    batch: Batch = collate(items, pad_token_id=0)
    n = batch.n_targets
    torch.manual_seed(0)
    logits = torch.randn(n, 20)
    got = on_policy_targets(batch, logits, rows=2)
    argmax = logits.argmax(-1)
    assert got[:5].tolist() == argmax[:5].tolist()  # rows 0 (3 targets) and 1 (2 targets)
    assert got[5:].tolist() == [12, 13]  # row 2 keeps its own next tokens
    assert on_policy_targets(batch, logits, rows=0).tolist() == [7, 8, 9, 10, 11, 12, 13]
    with pytest.raises(ValueError, match="target positions"):
        on_policy_targets(batch, logits[:-1], rows=1)


def test_student_answers_are_the_decode_only_models_generations(base_dir, decode_only_dir):  # noqa: F811
    """The training-time answers equal what the loaded decode-only adapter generates, and need the
    base-model prefill (without it, another answer)."""
    from peft import PeftModel

    want = _reference_loss(base_dir, decode_only_dir)[1]
    stock = load(str(base_dir), adapter=False)
    peft_model = PeftModel.from_pretrained(stock.model, str(decode_only_dir))
    from skipdecode.adapters import get_adapter

    adapter = get_adapter(peft_model.base_model.model)
    tok = stock.tokenizer
    items = [TokenizedExample(tuple(encode_prompts(tok, [p], chat=False)[0][0].tolist()), (1,)) for p in PROMPTS]
    eos = _eos_ids(tok, stock.model)
    got = student_answers(adapter, items, ADAPTER_POLICY, max_new_tokens=N_NEW, max_length=256, eos_token_ids=eos,
                          pad_token_id=0, prefill_context=peft_model.disable_adapter)
    assert [list(x.response_ids) for x in got] == want
    assert [x.prompt_ids for x in got] == [x.prompt_ids for x in items]
    adapted_prefill = student_answers(adapter, items, ADAPTER_POLICY, max_new_tokens=N_NEW, max_length=256,
                                      eos_token_ids=eos, pad_token_id=0)
    assert [list(x.response_ids) for x in adapted_prefill] != want
    short = student_answers(adapter, items, ADAPTER_POLICY, max_new_tokens=N_NEW, max_length=len(items[0].prompt_ids) + 2,
                            eos_token_ids=eos, pad_token_id=0, prefill_context=peft_model.disable_adapter)
    assert list(short[0].response_ids) == want[0][:2]  # cut to max_length


def test_on_policy_step_loss_equals_the_inference_reference(base_dir, decode_only_dir, tmp_path):  # noqa: F811
    """One optimizer step from the warm-started adapter with every row on-policy: the logged loss
    is the CE of the student's own answers against the teacher's choices, built from inference."""
    ref, answers = _reference_loss(base_dir, decode_only_dir)
    result = train(str(base_dir), PROMPTS, _run_cfg(tmp_path / "run", on_policy=1.0, init_adapter=str(decode_only_dir)))
    assert result.train_log[0]["loss"] == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert result.train_log[0]["tokens"] == sum(len(a) for a in answers) + sum(
        len(encode_prompts(load(str(base_dir), adapter=False).tokenizer, [p], chat=False)[0][0]) for p in PROMPTS)
    # off-policy, the same warm start trains on the teacher's answers: another loss
    off = train(str(base_dir), PROMPTS, _run_cfg(tmp_path / "off", init_adapter=str(decode_only_dir)))
    assert abs(off.train_log[0]["loss"] - ref) > 1e-3
    saved = json.loads((tmp_path / "run" / "final" / "skipdecode.json").read_text())
    assert saved["training"]["config"]["on_policy"] == 1.0
    assert saved["training"]["config"]["init_adapter"] == str(decode_only_dir)


def test_init_adapter_starts_from_the_folder_and_its_bridge(base_dir, decode_only_dir, tmp_path):  # noqa: F811
    from skipdecode.entry_bridge import EntryBridge
    from skipdecode.lowrank import read_lora_tensors

    folder = tmp_path / "with_bridge"
    shutil.copytree(decode_only_dir, folder)
    torch.manual_seed(1)
    C = load(str(base_dir), adapter=False).model.config.hidden_size
    bridge = EntryBridge(C, 0, [2, 3, 4], weight=torch.eye(C) + 0.05 * torch.randn(3, C, C), bias=0.1 * torch.randn(3, C))
    bridge.save(folder)
    out = tmp_path / "run"
    train(str(base_dir), PROMPTS, _run_cfg(out, init_adapter=str(folder), entry_bridge=True, lr=1e-9))
    final = out / "final"
    got = EntryBridge.load(final)  # frozen bridge: saved as it started
    assert got.targets == [2, 3, 4]
    torch.testing.assert_close(got.weight, bridge.weight, rtol=0, atol=1e-6)
    start, end = read_lora_tensors(folder), read_lora_tensors(final)
    assert set(start) == set(end)
    for k in start:  # lr 1e-9: one step barely moves the warm-started weights
        torch.testing.assert_close(end[k], start[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("kw,field,text", [
    ({"on_policy": 1.5}, "on_policy", "[0, 1]"),
    ({"on_policy": 0.5, "kl_weight": 0.0}, "on_policy", "kl_weight"),
    ({"init_adapter": "/nonexistent/adapter"}, "init_adapter", "existing folder"),
    ({"init_adapter": ".", "lora_r": 0, "lora_alpha": None, "base_prefill": False, "prompt_grad": True},
     "init_adapter", "lora_r"),
])
def test_config_errors_name_the_field(tmp_path, kw, field, text):
    with pytest.raises(TrainConfigError) as info:
        _run_cfg(tmp_path / "x", **kw)
    assert info.value.field == field and text in str(info.value)


def test_init_adapter_of_another_rank_is_refused(base_dir, decode_only_dir, tmp_path):  # noqa: F811
    with pytest.raises(TrainConfigError) as info:
        train(str(base_dir), PROMPTS, _run_cfg(tmp_path / "run", init_adapter=str(decode_only_dir), lora_r=4,
                                               lora_alpha=8))
    assert info.value.field == "init_adapter" and "r=2" in str(info.value) and "r=4" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TrainConfigError, match="adapter_config.json"):
        train(str(base_dir), PROMPTS, _run_cfg(tmp_path / "run2", init_adapter=str(empty)))


def test_cli_on_policy_and_init_adapter(tmp_path, decode_only_dir):  # noqa: F811
    from typer.testing import CliRunner

    from test_prompt_grad import cli_train_args

    from skipdecode.cli import app

    base = cli_train_args(tmp_path) + ["--lora-r", "2", "--lora-alpha", "4", "--no-prompt-grad", "--base-prefill",
                                       "--kl-weight", "0.5", "--distill", "--distill-max-new-tokens", "4"]
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "bad"), "--on-policy", "1.5"])
    assert res.exit_code == 2 and "--on-policy must be a share in [0, 1]" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "rank"), "--init-adapter", str(decode_only_dir),
                                          "--lora-r", "4", "--lora-alpha", "8"])
    assert res.exit_code == 2 and "--init-adapter" in res.output and "r=2" in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run"), "--on-policy", "0.5",
                                          "--init-adapter", str(decode_only_dir)])
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "run" / "final" / "skipdecode.json").read_text())
    assert saved["training"]["config"]["on_policy"] == 0.5
    assert saved["training"]["config"]["init_adapter"] == str(decode_only_dir)


def _broken_copy(src, dst, *, config=None, meta=None, tensors=None):
    """A copy of the adapter folder ``src`` with its adapter_config.json, skipdecode.json or LoRA
    tensors changed (each a function of the loaded value)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        (dst / "adapter_config.json").write_text(json.dumps(config(json.loads((dst / "adapter_config.json").read_text()))))
    if meta is not None:
        (dst / "skipdecode.json").write_text(json.dumps(meta(json.loads((dst / "skipdecode.json").read_text()))))
    if tensors is not None:
        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return dst


def _grow_one_lora_b(t):
    name = next(k for k in sorted(t) if k.endswith("lora_B.weight"))
    t[name] = torch.zeros(t[name].shape[0] + 1, t[name].shape[1])
    return t


@pytest.mark.parametrize("change, text", [
    (dict(config=lambda c: [1, 2]), "must hold a JSON object"),
    (dict(config=lambda c: {**c, "r": "two"}), "'r' must be the LoRA rank, an integer >= 1, got 'two'"),
    (dict(config=lambda c: {k: v for k, v in c.items() if k != "lora_alpha"}), "'lora_alpha' must be a number > 0"),
    (dict(meta=lambda m: {**m, "num_layers": NUM_LAYERS + 2}), f"model of {NUM_LAYERS + 2} layers; this model has {NUM_LAYERS}"),
    (dict(tensors=_grow_one_lora_b), "do not fit this model"),
])
def test_malformed_init_adapter_is_one_error_naming_the_field(base_dir, decode_only_dir, tmp_path, change, text):  # noqa: F811
    folder = _broken_copy(decode_only_dir, tmp_path / "bad", **change)
    with pytest.raises(TrainConfigError) as info:
        train(str(base_dir), PROMPTS, _run_cfg(tmp_path / "run", init_adapter=str(folder)))
    assert info.value.field == "init_adapter" and text in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run" / "final").exists()


def test_train_adapter_script_words_config_errors_as_its_options(tmp_path, capsys):
    """benchmarks/train_adapter.py: a bad setting exits 2 with one line naming the script's option."""
    from conftest import load_benchmark

    script = load_benchmark("train_adapter")
    args = script.parse_args(["--on-policy", "3", "--out", str(tmp_path / "r"), "--lora-alpha", "8"])
    assert args.lora_alpha == 8.0
    from skipdecode.train import TrainConfig

    with pytest.raises(TrainConfigError) as info:
        script._config(args, TrainConfig, tmp_path / "r", (2.0,))
    with pytest.raises(SystemExit) as exc:
        script._config_error(info.value)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err == "error: --on-policy must be a share in [0, 1], got 3.0"
    with pytest.raises(SystemExit):
        script._config_error(TrainConfigError("distill_max_new_tokens", "must be an integer >= 1, got 0"))
    assert capsys.readouterr().err.startswith("error: --max-new-tokens must be")


def test_student_answers_with_full_depth_steps_run_them_with_the_base_weights(base_dir, decode_only_dir):  # noqa: F811
    """With ``full_depth_steps`` the training-time answers (peft, adapter switched off at the
    full-depth steps) equal the loaded, merged decode-only model's generation of that schedule."""
    from dataclasses import replace

    from peft import PeftModel

    from skipdecode.adapters import get_adapter

    policy = replace(ADAPTER_POLICY, full_depth_steps=2)
    student = load(str(base_dir), adapter=str(decode_only_dir))
    want = [list(student.generate(p, policy=policy, max_new_tokens=N_NEW, chat=False).token_ids[0]) for p in PROMPTS]
    stock = load(str(base_dir), adapter=False)
    peft_model = PeftModel.from_pretrained(stock.model, str(decode_only_dir))
    adapter = get_adapter(peft_model.base_model.model)
    items = [TokenizedExample(tuple(encode_prompts(stock.tokenizer, [p], chat=False)[0][0].tolist()), (1,))
             for p in PROMPTS]
    kw = dict(max_new_tokens=N_NEW, max_length=256, eos_token_ids=_eos_ids(stock.tokenizer, stock.model),
              pad_token_id=0, prefill_context=peft_model.disable_adapter)
    got = student_answers(adapter, items, policy, **kw)
    assert [list(x.response_ids) for x in got] == want
    kept_on = student_answers(adapter, items, replace(ADAPTER_POLICY, max_layers=NUM_LAYERS, horizon=N_NEW + 2), **kw)
    assert [list(x.response_ids) for x in kept_on] != want  # the test tells schedules apart
