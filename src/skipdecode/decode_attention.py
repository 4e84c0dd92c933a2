"""Attention over the key/value head groups, for compiled decode steps and short prefills on the CPU.

Why. A decode step gives each row one query. Hugging Face's SDPA attention
(``transformers.integrations.sdpa_attention``), traced by ``torch.compile`` with a mask (every
batch whose rows hold different lengths: left padding, in-flight rows of different ages), repeats
each key/value head for its query heads (``repeat_kv``, a copy of the layer's keys and values per
step; its single-query ``pack_gqa`` path is skipped under dynamo) and calls PyTorch's CPU flash
kernel, whose per-call cost at one query is large against the work: on the 2-core AMD EPYC
(family 26) test host, SmolLM2-135M (9 query heads over 3 key/value heads, head size 64), 16 rows
of about 100 keys took 240-360 us a layer call inside compiled w8a8 decode steps, a fifth of the
step. Computing the step as two batched products over the groups, ``softmax(q k^T * scale + mask) v``
with the query heads of one key/value head stacked as rows (the grouping of
``pack_gqa`` and of SDPA's ``enable_gqa``), reads each key once and lets inductor fuse the scaling,
mask and softmax: in a static batch of 16 rows the compiled w8a8 step fell from 25.7 to 20.3 ms
at full depth and 14.7 to 11.9 ms under the 2x policy, float32 + compile from 35.5 to 32.4 and
20.5 to 18.3, with the same greedy tokens in float32 (docs/serving.md, stop 54). A prefill of a
batch of short prompts meets the same path (a padding mask, T queries per row): 16 prompts of 45
tokens took 1.57 ms a layer call in SDPA against 0.76 ms as grouped products, and the compiled
w8a8 prefill of 16 E2E prompts fell by about a tenth (docs/serving.md, stop 55).

What. :func:`grouped_decode_attention` is an attention function in Hugging Face's
``AttentionInterface`` signature. With a mask, on the CPU, no dropout, no position bias and no
soft-capping, one query per row, or T per row inside a compiled graph (a compiled prefill) with T
x K at most :data:`MAX_SCORES`: the grouped products above (same values as SDPA up to float32
summation order). Anything else (eager and long prefills, teacher forcing; steps without a mask,
where SDPA groups the heads itself; other devices; training dropout): Hugging Face's own
``sdpa_attention_forward``, unchanged, so an eager prefill, a compiled prefill's fallback
included, equals Hugging Face's exactly. :func:`enable` switches a
model that runs HF's ``"sdpa"`` to it (``compile=True`` does, :mod:`skipdecode.compiled`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MAX_SCORES", "NAME", "disable", "enable", "grouped_decode_attention"]

#: the name under which :func:`grouped_decode_attention` is registered with ``AttentionInterface``
NAME = "skipdecode_grouped_decode"

#: most scores per query head (T queries x K keys) that a call computes as grouped products; larger
#: calls (long prefills) go to SDPA, whose blocked kernel never holds the whole (T, K) matrix. At
#: 128 x 128 the scores of 16 rows of 9 heads take 9.4 MB. Compiled, with an additive mask, on the
#: 2-core AMD EPYC (family 26) host, 2 threads: 16 rows of 45 tokens 0.76 ms against SDPA's 1.57,
#: 16 of 64 1.0 against 1.5, 4 of 128 0.98 against 1.25; 2 of 512 (far above) 12.5 against 7.9
MAX_SCORES = 128 * 128


def grouped_decode_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` (B, H, T, D) over ``key``/``value`` (B, H_kv, K, D), H a multiple of
    H_kv, with an additive float or boolean ``attention_mask`` broadcastable to (B, H, T, K)
    (True = may attend), returning ``(output (B, T, H, D), None)`` as Hugging Face's attention
    functions do.

    With a mask, on the CPU, without dropout, ``position_bias`` or ``softcap``, and T = 1, or T > 1
    while ``torch.compile`` traces with T x K <= :data:`MAX_SCORES`: query head ``h`` attends
    with key/value head ``h // (H / H_kv)`` (HF's ``repeat_kv`` order), ``softmax(q k^T * s +
    mask) v`` with ``s = scaling`` or ``D ** -0.5`` (Vaswani et al. 2017, Eq. 1), computed as
    (B, H_kv, H / H_kv * T, K) products. A query whose keys are all masked gets the mean of the
    values (finite; SDPA's output there is unspecified, and nothing reads it: left padding). Otherwise ``transformers``' ``sdpa_attention_forward``
    (without a mask, a batch-1 step: SDPA's own grouped-query path, ``enable_gqa``, copies
    nothing, and was 1-2 % faster there in float32).

    Raises:
        ValueError: from ``sdpa_attention_forward`` for what it refuses (e.g. ``softcap``).
    """
    T, K = query.shape[2], key.shape[2]
    several = T > 1 and (T * K > MAX_SCORES or not torch.compiler.is_compiling())
    if (several or attention_mask is None or query.device.type != "cpu" or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    B, H, _, D = query.shape
    H_kv = key.shape[1]
    G = H // H_kv
    q = query.reshape(B, H_kv, G * T, D)  # query heads h = g * G + j over key/value head g, rows (j, t)
    scores = torch.matmul(q, key.transpose(-1, -2)) * (scaling if scaling is not None else D ** -0.5)
    scores = scores.view(B, H_kv, G, T, K)
    mask = attention_mask[..., :K]  # (B or 1, 1 or H, T or 1, K)
    if mask.dim() == 4 and mask.shape[1] == H and H != H_kv:  # a mask per query head
        mask = mask.reshape(mask.shape[0], H_kv, G, mask.shape[2], K)
    elif mask.dim() == 4:
        mask = mask.unsqueeze(2)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    out = torch.matmul(_softmax(scores).view(B, H_kv, G * T, K), value)  # (B, H_kv, G * T, D)
    return out.view(B, H, T, D).transpose(1, 2), None


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.softmax(-1)``; while torch.compile traces, float32 scores are normalised by a sum
    taken in float64. Inductor's C++ code for a float32 sum switches to a chunked accumulator
    above 4096 elements (``torch/_inductor/codegen/cpp.py``) and guards the key length on it, so
    the first decode step past 4096 keys compiled every decode variant again mid-serving (3-5
    graphs, about 7 s, stop 59); a float64 sum has one code path. The sum is over at most the
    context's keys, so the float64 pass costs nothing measurable; values agree with the float32
    softmax to rounding."""
    if scores.dtype != torch.float32 or not torch.compiler.is_compiling():
        return scores.softmax(-1)
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True, dtype=torch.float64).to(e.dtype)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_decode_attention)


def enable(model: nn.Module) -> bool:
    """Run ``model``'s attention through :func:`grouped_decode_attention` when it runs Hugging
    Face's ``"sdpa"`` (``model.set_attn_implementation``); other implementations (``"eager"``, a
    custom one) are left alone. Returns whether it switched. The name is not saved with the
    model (``save_pretrained`` writes no attention implementation)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True


def disable(model: nn.Module) -> bool:
    """Undo :func:`enable`: a model running :func:`grouped_decode_attention` goes back to Hugging
    Face's ``"sdpa"``. Returns whether it switched."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != NAME:
        return False
    model.set_attn_implementation("sdpa")
    return True
