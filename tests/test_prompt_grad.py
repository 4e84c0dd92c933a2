"""``prompt_grad=False``: the prompt (less its last token) runs at full depth under no_grad, the rest
trains against its keys/values. Same loss value as with the prompt's gradient; gradients equal a
reference built directly as KV-cached decoding with gradient after a no-grad prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model

from skipdecode.adapters import get_adapter
from skipdecode.forward import skip_forward
from skipdecode.policy import FullPolicy, LinearDecayPolicy
from skipdecode.train import Batch, SkipLossModule, TokenizedExample, TrainConfigError, build_layer_mask, collate

L = 6
POLICY = LinearDecayPolicy(num_layers=L, max_layers=5, min_layers=2, warmup_layers=1, horizon=4)


class _GradCache:
    """A plain growing KV cache (cat, no in-place writes) so decoding can carry gradients."""

    def __init__(self, num_layers: int) -> None:
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.lengths = [0] * num_layers

    def update(self, k, v, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k], -2)
            v = torch.cat([self.values[layer_idx], v], -2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        self.lengths[layer_idx] = k.shape[-2]
        return k, v


def _batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    shapes = [(6, 7), (1, 3), (4, 9)]  # a one-token prompt has no context to precompute
    return collate([TokenizedExample(tuple(torch.randint(5, 300, (p,), generator=g).tolist()),
                                     tuple(torch.randint(5, 300, (r,), generator=g).tolist())) for p, r in shapes])


def _reference_ce(adapter, item: TokenizedExample, policy) -> torch.Tensor:
    """Summed CE of one example as decoding computes it: prompt[:-1] prefilled at full depth under
    no_grad, then the last prompt token (full depth) and response tokens (step i: active(i)) fed
    one at a time with gradient."""
    prompt, resp = list(item.prompt_ids), list(item.response_ids)
    cache = _GradCache(L)
    if len(prompt) > 1:
        with torch.no_grad():
            skip_forward(adapter, torch.tensor([prompt[:-1]]), torch.ones(1, len(prompt) - 1, dtype=torch.long),
                         cache=cache)
    fed = [prompt[-1]] + resp[:-1]
    total = 0.0
    for i, tok in enumerate(fed):
        K = len(prompt) + i
        layers = None if i == 0 else list(policy.active_layers(i))
        logits = skip_forward(adapter, torch.tensor([[tok]]), torch.ones(1, K, dtype=torch.long),
                              active_layers=layers, cache=cache)
        total = total + F.cross_entropy(logits[0, -1:].float(), torch.tensor([resp[i]]), reduction="sum")
    return total


def _grads(model, loss) -> dict[str, torch.Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
@pytest.mark.parametrize("policy", [POLICY, FullPolicy(L)], ids=["skip", "full"])
def test_no_prompt_grad_same_loss_and_reference_gradients(family, policy):
    model = make_model(family, num_layers=L)
    adapter = get_adapter(model)
    batch = _batch()
    lm = build_layer_mask(policy, batch.prompt_lens, batch.seq_lens, batch.input_ids.shape[1], L)
    args = (batch.input_ids, batch.attention_mask, batch.prompt_lens, batch.seq_lens, lm)
    n = batch.n_targets  # token mean, as training uses
    ce_on, _ = SkipLossModule(model, adapter, prompt_grad=True)(*args)
    grads_on = _grads(model, ce_on / n)
    ce_off, _ = SkipLossModule(model, adapter, prompt_grad=False)(*args)
    grads_off = _grads(model, ce_off / n)
    torch.testing.assert_close(ce_off, ce_on, rtol=0, atol=1e-5)  # the same forward
    items = [TokenizedExample(tuple(batch.input_ids[b, :p].tolist()), tuple(batch.input_ids[b, p:s].tolist()))
             for b, (p, s) in enumerate(zip(batch.prompt_lens.tolist(), batch.seq_lens.tolist()))]
    ref = sum(_reference_ce(adapter, it, policy) for it in items)
    torch.testing.assert_close(ce_off, ref, rtol=0, atol=1e-4)
    grads_ref = _grads(model, ref / n)
    differs = 0
    for name in grads_ref:
        torch.testing.assert_close(grads_off[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)
        differs += int((grads_off[name] - grads_on[name]).abs().max() > 1e-4)
    assert differs > 3  # dropping the prompt's gradient changes the gradients


@pytest.mark.parametrize("lora_r", [0, 4])
def test_train_with_no_prompt_grad_logs_the_same_first_loss(tmp_path, lora_r):
    from test_train import cfg, examples, tiny_skipmodel

    from skipdecode.train import train

    first = {}
    for on in (True, False):
        res = train(tiny_skipmodel(), examples(), cfg(tmp_path / str(on), max_steps=2, prompt_grad=on, lora_r=lora_r))
        first[on] = res.train_log[0]["loss"]
        assert res.config["prompt_grad"] is on
    assert first[False] == pytest.approx(first[True], abs=1e-5)
    with pytest.raises(TrainConfigError) as info:
        cfg(tmp_path / "x", prompt_grad=False, gradient_checkpointing=True)
    assert info.value.field == "gradient_checkpointing"


def cli_train_args(tmp_path) -> list[str]:
    """``skipdecode train`` arguments for a one-step run of a tiny saved model on a JSONL file of
    prompt/response pairs, both written under ``tmp_path`` (add ``--out`` and the options tested)."""
    import json

    from test_train import examples, tiny_skipmodel

    model_dir = tmp_path / "model"
    tiny_skipmodel().save_pretrained(model_dir)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "response": e.response}) + "\n" for e in examples()))
    return ["train", "--model", str(model_dir), "--data", str(data), "--speedup", "2", "--max-steps", "1",
            "--batch-size", "2", "--no-progress", "--val-fraction", "0"]


def test_cli_no_prompt_grad_and_teacher_forcing(tmp_path):
    import json

    from typer.testing import CliRunner

    from skipdecode.cli import app

    base = cli_train_args(tmp_path)
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run"), "--no-prompt-grad",
                                          "--teacher-forcing", "masked"])
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "run" / "final" / "skipdecode.json").read_text())["training"]["config"]
    assert saved["prompt_grad"] is False and saved["teacher_forcing"] == "masked"
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run2"), "--teacher-forcing", "dense"])
    assert res.exit_code == 2 and "--teacher-forcing" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, base + ["--out", str(tmp_path / "run3"), "--no-prompt-grad", "--grad-checkpointing"])
    assert res.exit_code == 2 and "--grad-checkpointing" in res.output
