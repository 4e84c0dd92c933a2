"""Training data: tokenisation, right-padded batches, the per-position layer plan, the data order.

Part of the :mod:`skipdecode.training` package (re-exported by :mod:`skipdecode.train`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data import DataError, Example, load_examples
from ..generate import encode_prompts
from ..policy import SkipPolicy, plan_layers
from ..skip_config import sha256_file as _sha256_file  # one sha256 helper for data and checkpoints
from .config import TrainConfig, TrainConfigError, _is_int

__all__ = ["TokenizedExample", "Batch", "tokenize_examples", "collate", "build_layer_mask"]


@dataclass(frozen=True)
class TokenizedExample:
    """Token ids of one training pair.

    Attributes:
        prompt_ids: the prompt exactly as inference encodes it (chat template applied when chat),
            >= 1 token.
        response_ids: the target tokens (the response, then EOS unless it was cut), >= 1 token.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _encode_prompt_ids(tokenizer: Any, prompts: Sequence[str], *, chat: bool) -> dict[str, list[int]]:
    """Distinct prompt -> ids, through :func:`encode_prompts` so training matches inference."""
    unique = list(dict.fromkeys(prompts))
    out: dict[str, list[int]] = {}
    for start in range(0, len(unique), 256):
        chunk = unique[start:start + 256]
        ids, mask = encode_prompts(tokenizer, chunk, chat=chat)
        for p, row, m in zip(chunk, ids, mask):
            out[p] = row[m.bool()].tolist()
    return out


def _fit(prompt_ids: Sequence[int], response_ids: Sequence[int], max_length: int) -> TokenizedExample | None:
    """Cut the response so prompt + response <= ``max_length``; None if no response token fits."""
    room = max_length - len(prompt_ids)
    if room < 1 or not response_ids:
        return None
    return TokenizedExample(tuple(prompt_ids), tuple(response_ids[:room]))


def tokenize_examples(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_length: int,
    response_separator: str = " ",
) -> tuple[list[TokenizedExample | None], int]:
    """Tokenize ``(prompt, response)`` pairs for teacher forcing.

    The prompt is encoded by :func:`skipdecode.generate.encode_prompts` (``chat=True``: a user
    turn plus the generation prompt of the tokenizer's chat template), so training sees exactly the
    ids inference feeds. The response is tokenized without special tokens (in plain mode preceded by
    ``response_separator`` when neither side has whitespace at the join) and followed by
    ``tokenizer.eos_token_id``. Pairs longer than ``max_length`` tokens lose the end of their
    response (and its EOS); pairs whose prompt alone fills ``max_length`` give None.

    Returns:
        ``(items, n_dropped)``: one :class:`TokenizedExample` or None per example, and the number
        of Nones.

    Raises:
        ValueError: the tokenizer has no EOS token, or a prompt is empty / tokenizes to nothing.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id: cannot mark the end of responses")
    prompt_ids = _encode_prompt_ids(tokenizer, [e.prompt for e in examples], chat=chat)
    texts = []
    for e in examples:
        text = e.response
        if (not chat and response_separator and text and not text[:1].isspace()
                and e.prompt and not e.prompt[-1:].isspace()):
            text = response_separator + text
        texts.append(text)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    items: list[TokenizedExample | None] = []
    for e, ids in zip(examples, encoded):
        items.append(_fit(prompt_ids[e.prompt], list(ids) + [eos], max_length))
    return items, sum(x is None for x in items)


@dataclass
class Batch:
    """A right-padded batch of prompt + response sequences.

    Attributes:
        input_ids: (B, T) long; positions >= ``seq_lens[b]`` hold the pad id.
        attention_mask: (B, T) long, 1 on the ``seq_lens[b]`` real tokens.
        prompt_lens: (B,) long, prompt tokens per row (>= 1).
        seq_lens: (B,) long, prompt + response tokens per row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lens: torch.Tensor
    seq_lens: torch.Tensor

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on ``device``."""
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.prompt_lens, self.seq_lens)))

    @property
    def n_tokens(self) -> int:
        """Real (non-pad) tokens in the batch."""
        return int(self.seq_lens.sum())

    @property
    def n_targets(self) -> int:
        """Response tokens, i.e. predicted (loss) positions."""
        return int((self.seq_lens - self.prompt_lens).sum())

    def target_mask(self) -> torch.Tensor:
        """(B, T) bool: positions whose next token is a response token, ``prompt_len-1 <= p < seq_len-1``."""
        T = self.input_ids.shape[1]
        pos = torch.arange(T, device=self.input_ids.device)[None]
        return (pos >= self.prompt_lens[:, None] - 1) & (pos < self.seq_lens[:, None] - 1)

    def labels(self) -> torch.Tensor:
        """(B, T) long: the next token at each position (``input_ids`` shifted left; last column pad)."""
        return torch.cat([self.input_ids[:, 1:], self.input_ids[:, -1:]], dim=1)


def collate(examples: Sequence[TokenizedExample], pad_token_id: int = 0) -> Batch:
    """Right-pad ``examples`` into a :class:`Batch` (T = the longest example).

    Raises:
        ValueError: no examples, or an example with an empty prompt or response.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    for i, ex in enumerate(examples):
        if not ex.prompt_ids or not ex.response_ids:
            raise ValueError(f"examples[{i}] needs >= 1 prompt and >= 1 response token")
    T = max(len(ex) for ex in examples)
    B = len(examples)
    ids = torch.full((B, T), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, ex in enumerate(examples):
        seq = ex.prompt_ids + ex.response_ids
        ids[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[b, :len(seq)] = 1
    prompt_lens = torch.tensor([len(ex.prompt_ids) for ex in examples], dtype=torch.long)
    seq_lens = torch.tensor([len(ex) for ex in examples], dtype=torch.long)
    return Batch(ids, mask, prompt_lens, seq_lens)


def build_layer_mask(
    policy: SkipPolicy,
    prompt_lens: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    T: int,
    num_layers: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Per-position layer plan (B, T, L) bool for a right-padded teacher-forced batch.

    Row b holds ``prompt_lens[b]`` prompt tokens at positions ``0 .. P_b - 1`` and response token i
    at position ``P_b + i`` for ``i < seq_lens[b] - P_b``. Prompt positions run every layer (the
    full-depth prefill); the position holding response token i runs ``policy.active_layers(i+1)``
    (the token there is fed at decode step i + 1). Padding positions (``p >= seq_lens[b]``) run no
    layer; causal attention never lets a real position read them.

    Args:
        policy: the skip policy; ``policy.num_layers`` must equal ``num_layers``.
        prompt_lens: (B,) prompt lengths (tokens), >= 1.
        seq_lens: (B,) prompt + response lengths (tokens), ``prompt_lens <= seq_lens <= T``.
        T: padded sequence length (positions).
        num_layers: L (layers).
        device: device of the result (default: that of ``prompt_lens`` if a tensor, else CPU).

    Returns:
        (B, T, L) bool tensor, ``mask[b, p, l]`` = layer l runs at position p of row b.

    Raises:
        ValueError: mismatched lengths, a prompt length < 1, ``seq_lens`` outside
            ``[prompt_lens, T]``, or ``policy.num_layers != num_layers``.
    """
    if getattr(policy, "num_layers", None) != num_layers:
        raise ValueError(f"policy.num_layers ({getattr(policy, 'num_layers', None)}) must equal num_layers ({num_layers})")
    if device is None and isinstance(prompt_lens, torch.Tensor):
        device = prompt_lens.device
    p_len = torch.as_tensor(prompt_lens, dtype=torch.long).flatten().cpu()
    s_len = torch.as_tensor(seq_lens, dtype=torch.long).flatten().cpu()
    if p_len.shape != s_len.shape:
        raise ValueError(f"prompt_lens and seq_lens must have the same length, got {len(p_len)} and {len(s_len)}")
    if not _is_int(T) or T < 0:
        raise ValueError(f"T must be an integer >= 0, got {T!r}")
    if len(p_len) and (bool((p_len < 1).any()) or bool((s_len < p_len).any()) or bool((s_len > T).any())):
        raise ValueError(
            f"need 1 <= prompt_lens <= seq_lens <= T={T}; got prompt_lens={p_len.tolist()}, seq_lens={s_len.tolist()}"
        )
    B = len(p_len)
    n_resp = int((s_len - p_len).max()) if B else 0
    table = torch.zeros((max(n_resp, 1), num_layers), dtype=torch.bool)
    for i in range(n_resp):
        table[i, list(plan_layers(policy, i + 1))] = True
    pos = torch.arange(T)[None, :]  # (1, T)
    resp_idx = pos - p_len[:, None]  # (B, T), response index held at each position
    in_prompt = resp_idx < 0
    in_resp = (resp_idx >= 0) & (pos < s_len[:, None])
    mask = table[resp_idx.clamp(0, table.shape[0] - 1)]  # (B, T, L)
    mask = (mask & in_resp[..., None]) | in_prompt[..., None]
    return mask.to(device) if device is not None else mask


class _Order:
    """The stream of training indices: epoch e is ``random.Random(seed, e)``'s shuffle of range(n)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # keep one epoch in memory
        return self._perms[epoch]

    def take(self, start: int, count: int) -> list[int]:
        return [self._perm(p // self.n)[p % self.n] for p in range(start, start + count)]


def _policy_index(seed: int, step: int, n: int) -> int:
    """Seeded choice of the policy trained at ``step`` (a pure function: resumes reproduce it)."""
    return 0 if n == 1 else random.Random(seed * 7_919 + step).randrange(n)


def _split_val(examples: Sequence[Example], fraction: float, cap: int, seed: int) -> tuple[list[int], list[int]]:
    """Indices (train, val): val takes ``fraction`` of the *distinct prompts* (so no prompt is in
    both; E2E has several references per MR), at most ``cap`` examples."""
    if fraction <= 0:
        return list(range(len(examples))), []
    prompts = list(dict.fromkeys(e.prompt for e in examples))
    if len(prompts) < 2:
        raise TrainConfigError("val_fraction", f"needs >= 2 distinct prompts, the data has {len(prompts)}")
    random.Random(seed).shuffle(prompts)
    n_val = min(len(prompts) - 1, max(1, round(fraction * len(prompts))))
    val_prompts = set(prompts[:n_val])
    val = [i for i, e in enumerate(examples) if e.prompt in val_prompts][:cap]
    train_idx = [i for i, e in enumerate(examples) if e.prompt not in val_prompts]
    return train_idx, val


def _as_examples(data: Any, config: TrainConfig, what: str) -> tuple[list[Example], dict]:
    """Examples and a description of where they came from."""
    if isinstance(data, (str, os.PathLike)):
        rows = load_examples(data, task=config.task, skip_bad_rows=config.skip_bad_rows)
        info: dict[str, Any] = {"spec": str(data), "path": getattr(rows, "path", str(data)),
                                "n_skipped_rows": getattr(rows, "n_skipped", 0)}
        p = Path(info["path"])
        if p.is_file():
            info["sha256"] = _sha256_file(p)
        return list(rows), info
    if isinstance(data, Sequence) and not isinstance(data, (bytes, bytearray)):
        out = []
        for i, e in enumerate(data):
            if isinstance(e, Example):
                out.append(e)
            elif isinstance(e, str) and config.distill:
                out.append(Example(e, ""))
            else:
                raise DataError(f"{what}[{i}] must be an Example{' or a prompt string' if config.distill else ''}, got {type(e).__name__}")
        if not out:
            raise DataError(f"{what} holds no examples")
        return out, {"spec": "<in-memory>", "n_skipped_rows": 0}
    raise DataError(f"{what} must be a path, a dataset name or a list of Examples, got {type(data).__name__}")


def _hash_examples(items: Sequence[TokenizedExample]) -> str:
    h = hashlib.sha256()
    for ex in items:
        h.update(json.dumps([ex.prompt_ids, ex.response_ids]).encode())
    return h.hexdigest()
