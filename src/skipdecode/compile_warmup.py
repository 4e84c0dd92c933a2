"""Compiling ahead of use (:func:`warm_up`, :func:`warm_up_long_prompts`): run the compiled
variants a model will meet before any timed or served step, so that no compile lands inside one.

A variant the warm-up misses compiles at its first use, with every stream of a server waiting:
stop 59 found a burst of new prompts (1.5 s: the warm-up's equal prompts had become twins,
prefilled once), a one-token prompt (1.7 s, and eight graph breaks) and the first long prompt
(4-6 s on the embedded model, w8a8) doing so mid-serving.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from .decode_attention import MAX_SCORES

if TYPE_CHECKING:  # (skipdecode.compiled imports this module: its CompileReport only annotates here)
    from .compiled import CompileReport

__all__ = ["warm_up", "warm_up_long_prompts", "compiled_graphs"]


def _warm_policy(sk):
    """The skipping policy the warm-up decodes with: the model's own when it skips (e.g. the
    shipped 2x, whose full-depth first steps flip a decode-only adapter's switch to the base
    weights), else a 2x decay over 2 tokens; None for models under 4 layers."""
    from .policy import LinearDecayPolicy, for_speedup

    if isinstance(sk.policy, LinearDecayPolicy):
        return sk.policy
    L = sk.adapter.num_layers
    return for_speedup(L, 2.0, horizon=2) if L >= 4 else None


def _warm_up_inflight(sk, new_tokens: int) -> None:
    """Compile the in-flight variants too (:class:`~skipdecode.engine.Engine`: a slot cache, rows
    of different ages whose plans differ, so layers run on one row or on several): one request
    alone in slot 0 (keys read in place) past its full-depth steps, then a second joining; then
    three rows in consecutive slots mixing full depth and the skipping policy, whose middle one
    ends early so that the others run in slots that are not consecutive (keys gathered from the
    buffer), mixed or both skipping, and then the last alone, skipping and at full depth (three
    runs; with a decode-only adapter its switch state is part of each variant). On the way the
    prefills' variants compile: one row and several (distinct prompts, not twins), from an empty
    cache and after a stored prefix (one token after it too), and one-token prompts alone and two
    together."""
    from .engine import Engine, Request

    policy = _warm_policy(sk)
    lead = getattr(policy, "full_depth_steps", 0)
    ids = sk.tokenizer("Hello there, how are you?")["input_ids"] or [0]
    engine = Engine(sk.adapter, max_batch_size=2, prefix_cache=False)
    vocab = sk.adapter.model.get_input_embeddings().num_embeddings
    one = [ids[0], (ids[0] + 1) % vocab]
    engine.run([Request([one[0]], max_new_tokens=2)])  # one-token prompts' prefills (T = 1), alone and two
    engine.run([Request([t], max_new_tokens=2) for t in one])
    # alone in slot 0 (read in place) through its full-depth steps and two skipping ones
    engine.submit(Request(list(ids), max_new_tokens=2 * lead + new_tokens + 2, policy=policy))
    for _ in range(lead + 2):
        engine.step()
    engine.submit(Request(list(ids[:2]) or [0], max_new_tokens=lead + new_tokens, policy=policy))
    while engine.busy:
        engine.step()
    engine = Engine(sk.adapter, max_batch_size=3)  # prefills after a stored prefix, of one row and of two
    base = list(ids) * 3
    for group in ([base + list(ids[:1])], [base + list(ids[:2])], [base + list(ids[:3]), base + list(ids[:2])]):
        for prompt in group:
            engine.submit(Request(prompt, max_new_tokens=2, policy=None))
        while engine.busy:
            engine.step()
    stored = max(engine.prefix_cache.entries, key=len, default=None)
    if stored is not None:  # a stored prefix and one token more (e.g. the same prompt again): a
        # one-token prefill on stored keys, alone and two at once
        for group in ([list(stored) + [one[0]]], [list(stored) + [t] for t in one]):
            engine.run([Request(p, max_new_tokens=2) for p in group])
    for prompt, plans in ((list(ids), (None, policy, policy)), (list(ids), (policy, None, policy)),
                          (list(ids) * 2, (policy, None, None))):
        engine = Engine(sk.adapter, max_batch_size=3, prefix_cache=False)  # (two prompt lengths: the
        for i, plan in enumerate(plans):  # prefill of several rows compiles with a symbolic length)
            # distinct prompts: equal ones joining at one step are prefilled once (twins), which
            # would leave the prefill of several rows from an empty cache to a server's first burst
            distinct = [(prompt[0] + i) % vocab] + prompt[1:]
            # the last row outlives the first by two steps: it ends alone in slot 2 (a batch of one,
            # keys gathered), skipping in the first two runs and at full depth in the third
            tokens = 2 if i == 1 else lead + new_tokens + (2 if i == 2 else 0)
            engine.submit(Request(distinct, max_new_tokens=tokens, policy=plan))
        while engine.busy:
            engine.step()


def warm_up(sk, report: CompileReport, batch_sizes: tuple[int, ...] = (1,), new_tokens: int = 4) -> CompileReport:
    """Compile ahead of use: one short greedy generation per batch size, timed as a whole.

    Per batch size, one generation runs the prefill and ``new_tokens - 1`` decode steps
    at full depth (every layer, so every layer's variant is compiled) with two different key
    lengths, which is what makes key length symbolic, on equal prompts (decode steps without a
    mask, :func:`skipdecode.forward.unmasked_layers`), and one runs the model's skipping policy
    past its full-depth first steps (:func:`_warm_policy`) on the same prompts and, from batch 2
    on, again on prompts of two lengths (left padding: decode steps with a mask; without a
    skipping policy that run is at full depth); then in-flight rows of different ages,
    plans and slot layouts compile the engine's variants (:func:`_warm_up_inflight`). Adds the
    wall-clock seconds to ``report.compile_seconds``.

    Args:
        sk: a :class:`skipdecode.model.SkipModel` whose adapter went through :func:`compile_adapter`.
        report: its report (updated in place and returned).
        batch_sizes: batch sizes to compile for (sequences); later sizes reuse a symbolic batch.
        new_tokens: tokens per warm-up generation (>= 3).

    Raises:
        ValueError: ``new_tokens`` < 3.
    """
    if new_tokens < 3:
        raise ValueError(f"new_tokens must be >= 3, got {new_tokens}")
    if not report.enabled:
        return report
    from .generate import generate

    start = time.perf_counter()
    policy = _warm_policy(sk)
    lead = getattr(policy, "full_depth_steps", 0)
    for B in batch_sizes:
        prompts = ["Hello there, how are you?"] * B
        # unpadded: decode steps whose layers get no mask (forward.unmasked_layers)
        generate(sk.adapter, sk.tokenizer, prompts, max_new_tokens=new_tokens, eos_token_ids=[], chat=False)
        padded = [["Hi"] + prompts[1:]] if B > 1 else []  # left padding: decode steps with a mask
        if policy is not None:  # skipping steps (and a decode-only adapter's switch both ways)
            for batch in [prompts] + padded:
                generate(sk.adapter, sk.tokenizer, batch, policy=policy, max_new_tokens=lead + new_tokens,
                         eos_token_ids=[], chat=False)
        else:
            for batch in padded:
                generate(sk.adapter, sk.tokenizer, batch, max_new_tokens=new_tokens, eos_token_ids=[], chat=False)
        report.warmed_batch_sizes.append(B)
    _warm_up_inflight(sk, new_tokens)
    report.compile_seconds += time.perf_counter() - start
    if report.mode == "kernels":
        from .quantize import kernel_error

        if kernel_error():
            report.enabled, report.error = False, kernel_error()
    return report


def warm_up_long_prompts(sk, report: CompileReport, prefill_chunk_tokens: int = 0) -> CompileReport:
    """Compile the prefill variants of long prompts, which short ones never reach: prompts whose
    attention scores (T x K) pass :data:`~skipdecode.decode_attention.MAX_SCORES` take PyTorch's
    SDPA instead of the grouped products (:func:`~skipdecode.decode_attention.grouped_decode_attention`),
    a graph of its own per batch (one row, several) and per key length (equal to the prompt's, or
    longer after a stored prefix); and, with chunked prefill (``prefill_chunk_tokens`` C > 0,
    :mod:`skipdecode.chunked_prefill`), a prompt's first chunk and its later ones, on either
    side of the bound. Runs in-flight prefills of prompts of ``isqrt(MAX_SCORES) + 2`` new tokens
    (130): two distinct ones from an empty cache, two after a stored 16-token prefix, one of each
    alone; with C > 0 prompts of kC + 5 and of kC tokens (at most the model's context), chunked,
    with k the first chunk whose C x kC scores pass MAX_SCORES, at least 2 (chunks of 64: k = 5;
    256: k = 2; 2 when no prompt the model holds gets that far): chunk k runs on SDPA once with
    keys short of the prompt's buffer and once filling it, two variants. ``skipdecode serve --compile`` runs it at start-up (about 2-4 s of
    compiling with a warm inductor cache on the embedded model): the first long prompt would
    otherwise stop every stream for 4-6 s while it compiles. Adds the seconds to
    ``report.compile_seconds``.

    Args:
        sk: a :class:`skipdecode.model.SkipModel` whose adapter went through
            :func:`~skipdecode.compiled.compile_adapter` (and :func:`warm_up`).
        report: its report (returned unchanged when compiling is off).
        prefill_chunk_tokens: the server's chunk size C (tokens); 0: prompts run whole.

    Raises:
        ValueError: ``prefill_chunk_tokens`` is not an int >= 0 (from the engine).
    """
    if not report.enabled:
        return report
    from .engine import Engine, Request

    start = time.perf_counter()
    vocab = sk.adapter.model.get_input_embeddings().num_embeddings
    n = math.isqrt(MAX_SCORES) + 2

    def tokens(seed: int, count: int) -> list[int]:  # distinct, deterministic ids (no tokenizer: exact lengths)
        return [(seed * 7919 + 31 * i + 3) % vocab for i in range(count)]

    shared = tokens(1, 16)
    engine = Engine(sk.adapter, max_batch_size=2, prefill_chunk_tokens=prefill_chunk_tokens)
    waves = ([shared + tokens(2, n), shared + tokens(3, n)],  # two, empty cache (stores the shared 16)
             [shared + tokens(4, n), shared + tokens(5, n)],  # two after the stored prefix
             [tokens(6, n + 16)], [shared + tokens(7, n)])  # one of each alone
    longest = (sk.adapter.max_positions or math.inf) - 1  # prompt + 2 new tokens - 1 positions
    if prefill_chunk_tokens:
        C = prefill_chunk_tokens
        # chunk k sees kC keys: the first whose C x kC scores pass MAX_SCORES takes SDPA after the
        # prompt's own history (chunks of 64: the fifth, a user's check), as a middle chunk (its
        # keys short of the prompt's buffer) and as the last one (keys filling it): two variants
        k = max(2, MAX_SCORES // (C * C) + 1)
        k = k if k * C <= longest else 2
        waves += ([tokens(8, min(k * C + 5, longest))], [tokens(9, min(k * C, longest))])
    for wave in waves:  # (prompts the model cannot hold are left out: nor can a server's)
        engine.run([Request(p, max_new_tokens=2) for p in wave if len(p) <= longest])
    report.compile_seconds += time.perf_counter() - start
    return report


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (dynamo's ``unique_graphs``
    counter, every model and function together). The server reports those compiled after it
    started (``/health``'s ``compile.graphs_after_start``): each one stopped every stream while it
    compiled, so anything but 0 names a variant the warm-up missed."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
