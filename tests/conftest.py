"""Tiny random models, one per architecture family, and a tiny tokenizer; all built offline."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

VOCAB = 320

CORPUS = [
    "name[The Eagle], eatType[coffee shop], food[French], priceRange[moderate], area[riverside]",
    "The Eagle is a moderately priced French coffee shop by the riverside.",
    "Summarize the article. The quick brown fox jumps over the lazy dog near the river bank.",
    "Describe the restaurant in one sentence. Description: a cheap family friendly pub.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer (vocab <= VOCAB) with pad/bos/eos and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _common(num_layers: int) -> dict:
    return dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_config(family: str, num_layers: int = 6):
    """Tiny config of ``family``: llama, mistral, qwen2, opt, opt_postln, opt_proj, gpt2."""
    c = _common(num_layers)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
        extra = {"sliding_window": None} if family == "mistral" else {}
        return cls(
            hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=family != "llama",
            **extra, **c,
        )
    if family.startswith("opt"):
        return OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=num_layers, num_attention_heads=4,
            max_position_embeddings=256, word_embed_proj_dim=16 if family == "opt_proj" else 32,
            do_layer_norm_before=family != "opt_postln", dropout=0.0, attention_dropout=0.0,
            bos_token_id=2, eos_token_id=2, pad_token_id=1, vocab_size=VOCAB,  # OPT: BOS == EOS
        )
    if family == "gpt2":
        return GPT2Config(
            n_embd=32, n_layer=num_layers, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **c,
        )
    raise ValueError(family)


FAMILIES = ["llama", "mistral", "qwen2", "opt", "opt_postln", "opt_proj", "gpt2"]


def model_from_config(config, seed: int = 0):
    """Tiny random float32 model of a transformers ``config`` in eval mode, SDPA attention, its
    matrices drawn from N(0, 0.15) after ``torch.manual_seed(seed)`` (larger than the default
    init, so that greedy paths are not all one token)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.15)
    return model.eval()


def make_model(family: str, num_layers: int = 6, seed: int = 0):
    """Tiny random float32 model of ``family`` in eval mode, SDPA attention (:func:`model_from_config`)."""
    return model_from_config(make_config(family, num_layers), seed)


def make_chain_model(tokenizer, prompt: str, text: str, num_layers: int = 6):
    """Tiny llama programmed as a bigram model: after ``prompt`` it greedily writes ``text`` then
    EOS (id 2), under any layer plan; EOS itself is followed by ``text``'s first token. The decoder
    layers add nothing to the residual (o_proj, down_proj zero); the LM head maps each chain token
    to its successor. ``text``'s tokens and the prompt's last token must be distinct."""
    text_ids = tokenizer(text)["input_ids"]
    chain = [tokenizer(prompt)["input_ids"][-1]] + text_ids + [2, text_ids[0]]
    assert len(set(chain[:-1])) == len(chain) - 1, "bigram chain needs distinct tokens"
    model = make_model("llama", num_layers, seed=1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = model.model.norm(model.model.embed_tokens.weight)  # what the head sees per token
        head = torch.zeros_like(model.lm_head.weight)
        for a, b in zip(chain, chain[1:]):
            head[b] += 10 * normed[a] / normed[a].norm()
        model.lm_head.weight.copy_(head)
    return model


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids (B, P) and attention mask (B, P) for token lists of any lengths."""
    P = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), P), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), P), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, P - len(s) :] = torch.tensor(s)
        mask[i, P - len(s) :] = 1
    return ids, mask


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models: one intra-op thread is faster than several (and far faster on a busy CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def record_server_commands(monkeypatch, server_load) -> dict:
    """Make ``server_load``'s ``subprocess.Popen`` start a server that exits at once (status 3),
    so that ``server_load.start_server`` raises SystemExit after recording its command: the
    returned dict's ``"cmd"`` is the last command it ran."""
    seen: dict = {}

    class ExitedServer:
        pid, returncode = 0, 3

        def __init__(self, cmd, **kwargs):
            seen["cmd"] = cmd

        def poll(self):
            return self.returncode

    monkeypatch.setattr(server_load.subprocess, "Popen", ExitedServer)
    return seen


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module (the benchmarks folder is not a package; it
    goes on ``sys.path`` for the scripts' imports of each other, and the module into
    ``sys.modules``, where dataclasses look their module up)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
