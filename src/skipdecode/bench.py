"""Decode-speed benchmark: SkipDecode policies vs full depth vs Hugging Face ``generate``.

PITFALLS 13: the theoretical (compute) ratio and the wall-clock ratio are reported side by side,
measured in the same run, for several batch sizes.

What is measured (one :func:`run_benchmark` call):

- for each batch size B, the first B prompts of :data:`DEFAULT_PROMPTS` (cycled if B > 32), as
  one left-padded batch, identical token ids for every engine;
- our engine (:func:`skipdecode.generate.generate`) at full depth and at each target speedup
  (``SkipModel.policy_for(speedup=s, horizon=H)``, H = ``new_tokens`` by default), greedy,
  ``eos_token_ids=[]`` so that every row of every run generates exactly ``new_tokens`` tokens;
- Hugging Face ``model.generate`` on the same model and ids, greedy, ``min_new_tokens =
  max_new_tokens = new_tokens`` (equal length).

How a decode step is timed (the same definition for both engines): the wall-clock interval
between two consecutive generated tokens becoming available. For our engine the timestamp is
taken in the ``on_chunk`` callback of :func:`~skipdecode.generate.generate`, i.e. *after*
sampling and the streaming detokenization of every row (so our figure includes work HF's
``generate`` does not do: it is conservative). For HF it is taken by a logits processor, i.e.
right after each forward (HF calls it once per step, before sampling). Both series hold
``new_tokens`` timestamps; the ``new_tokens - 1`` intervals between the first (after the
full-depth prefill) and the last are the decode steps t = 1 .. new_tokens-1 (each interval is
one complete step: sampling, bookkeeping, one forward). Per run, step time = (last - first) /
(new_tokens - 1); the table reports the median over ``repeats`` runs. The engine's own per-step
clock (forward + sampling, ``GenerationResult.step_seconds``) is reported beside it
(``engine_step_ms``). Time to first token: our engine's step-0 clock; for HF, from the call to
the first logits-processor call. Runs are interleaved (repeat r of every configuration of a batch
size before repeat r+1) so that drift in machine load hits every configuration alike, after
``warmup`` untimed runs of each configuration.

``profile_decode`` breaks a decode step into embedding, positions + attention mask, rotary
inputs, each decoder layer, final norm + LM head, sampling and the rest (Python overhead of the
loop) with ``perf_counter`` around each part (``torch.cuda.synchronize`` first on CUDA), and sets
the weight bytes a step must read against a memory-bandwidth floor.

The library never prints: the CLI (``skipdecode bench``) and ``benchmarks/decode_speed.py`` do.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .generate import encode_prompts, generate, generate_step
from .policy import FullPolicy, SkipPolicy, theoretical_speedup

__all__ = [
    "DEFAULT_PROMPTS",
    "DEFAULT_OUTPUT",
    "batch_prompts",
    "run_benchmark",
    "profile_decode",
    "weight_bytes",
    "results_table",
    "profile_table",
    "write_results",
    "write_plot",
    "parse_int_list",
    "parse_float_list",
]

DEFAULT_OUTPUT = Path("benchmarks") / "results" / "decode_speed.json"

#: 32 real prompts of different lengths (a few words to a paragraph), so batches are left-padded.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in simple terms why the sky is blue.",
    "Give me three tips for a good night's sleep.",
    "Describe the restaurant in one sentence.\nname[The Eagle], eatType[coffee shop], food[French], "
    "priceRange[moderate], customer rating[3 out of 5], area[riverside], familyFriendly[yes], "
    "near[Burger King]\nDescription:",
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "What is 17 times 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five common fruits that are rich in vitamin C.",
    "Why do cats purr?",
    "Write a short, polite email to a colleague asking to move our Tuesday meeting to Thursday "
    "afternoon because I have a dentist appointment.",
    "What are the main differences between a virus and a bacterium?",
    "Hello!",
    "Suggest a name for a small bakery that specialises in sourdough bread.",
    "Explain what a hash table is to a first-year computer science student, including how "
    "collisions are handled and what the average cost of a lookup is.",
    "How many legs does a spider have?",
    "Summarize the article.\nThe city council voted on Monday to extend the opening hours of all "
    "public libraries until nine in the evening on weekdays. The decision follows a survey in "
    "which most residents said they could not visit during working hours. The change will cost "
    "about two hundred thousand pounds a year and takes effect next month.\nSummary:",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Is a tomato a fruit or a vegetable?",
    "Describe the water cycle.",
    "Give a one-line definition of photosynthesis.",
    "I have eggs, spinach, cheese and bread. What can I cook for breakfast in ten minutes?",
    "Who wrote Pride and Prejudice, and when was it published?",
    "Explain the rules of chess for the knight.",
    "Write a limerick about a forgetful robot.",
    "What is the difference between weather and climate? Answer briefly, then give an example "
    "of each from everyday life.",
    "Name three planets in our solar system.",
    "How do I convert Celsius to Fahrenheit?",
    "Tell me a fun fact about octopuses.",
    "Rewrite this sentence to be more formal: hey, can u send me the report asap, thx.",
    "What are the benefits of regular exercise for mental health? Give at least four, each with "
    "one sentence of explanation, and finish with a short recommendation for a beginner.",
)


# ---------------------------------------------------------------------------------------------
# small helpers


def parse_int_list(text: str, name: str = "value") -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]`` (e.g. batch sizes, in sequences).

    Raises:
        ValueError: ``text`` is not comma-separated integers, is empty, or holds a value < 1;
            the message names ``name``.
    """
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{name} must be comma-separated integers >= 1, got {text!r}")
    return values


def parse_float_list(text: str, name: str = "value") -> list[float]:
    """``"2,3,5"`` -> ``[2.0, 3.0, 5.0]`` (target speedups; may be empty: ``""``).

    Raises:
        ValueError: ``text`` is not comma-separated numbers, or holds a value <= 1 (full depth
            is always measured); the message names ``name``.
    """
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if any(not v > 1 for v in values):
        raise ValueError(f"{name} must be numbers > 1 (full depth is always measured), got {text!r}")
    return values


def batch_prompts(batch_size: int, prompts: Sequence[str] = DEFAULT_PROMPTS) -> list[str]:
    """The first ``batch_size`` of ``prompts``, cycling when more are needed.

    Raises:
        ValueError: ``batch_size`` < 1 or ``prompts`` is empty.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    return [prompts[i % len(prompts)] for i in range(batch_size)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(sk) -> torch.device:
    return next(sk.model.parameters()).device


def _policy_name(speedup: float | None) -> str:
    if speedup is None:
        return "full"
    return f"{speedup:g}x"


def _per_step(first: float, last: float, steps: int) -> float:
    return (last - first) / steps if steps else float("nan")


# ---------------------------------------------------------------------------------------------
# one timed run of each engine


def _run_ours(sk, prompts: list[str], policy: SkipPolicy, new_tokens: int) -> dict[str, Any]:
    device = _device(sk)
    stamps: list[float] = []

    def on_chunk(chunk) -> None:
        stamps.append(time.perf_counter())

    result = generate(
        sk.adapter,
        sk.tokenizer,
        prompts,
        policy=policy,
        max_new_tokens=new_tokens,
        chat=sk.chat,
        eos_token_ids=[],
        on_chunk=on_chunk,
    )
    _sync(device)
    steps = len(stamps) - 1
    if result.decode_steps != steps or any(n != new_tokens for n in result.new_tokens):
        raise RuntimeError(
            f"expected every row to generate {new_tokens} tokens, got {result.new_tokens} "
            f"({result.decode_steps} decode steps)"
        )
    return {
        "step_s": _per_step(stamps[0], stamps[-1], steps),
        "engine_step_s": result.step_seconds,
        "prefill_s": result.prefill_seconds,
        "layers_run": list(result.layers_run),
        "decode_steps": result.decode_steps,
        "token_ids": result.token_ids,
    }


def _hf_stamp_processor(stamps: list[float], device: torch.device):
    from transformers import LogitsProcessor

    class _Stamp(LogitsProcessor):
        """Records a timestamp each time HF's generate has new logits (once per step)."""

        def __call__(self, input_ids, scores):
            _sync(device)
            stamps.append(time.perf_counter())
            return scores

    return _Stamp()


def _run_hf(sk, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    device = input_ids.device
    stamps: list[float] = []
    pad = sk.tokenizer.pad_token_id
    if pad is None:
        pad = sk.tokenizer.eos_token_id or 0
    _sync(device)
    start = time.perf_counter()
    out = sk.model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        logits_processor=LogitsProcessorList([_hf_stamp_processor(stamps, device)]),
        pad_token_id=pad,
    )
    _sync(device)
    generated = out[:, input_ids.shape[1] :]
    if generated.shape[1] != new_tokens or len(stamps) != new_tokens:
        raise RuntimeError(
            f"HF generate produced {generated.shape[1]} tokens ({len(stamps)} steps), expected {new_tokens}"
        )
    return {
        "step_s": _per_step(stamps[0], stamps[-1], new_tokens - 1),
        "prefill_s": stamps[0] - start,
        "decode_steps": new_tokens - 1,
        "token_ids": generated.tolist(),
    }


def _tokens_agree(ours: list[list[int]], hf: list[list[int]], eos_ids: set[int]) -> bool:
    """Our full-depth ids equal HF's up to our first EOS (HF must avoid EOS under min_new_tokens)."""
    for a, b in zip(ours, hf):
        n = next((i for i, t in enumerate(a) if t in eos_ids), len(a))
        if a[:n] != b[:n]:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# the benchmark


def run_benchmark(
    sk,
    *,
    batch_sizes: Sequence[int] = (1, 8, 32),
    speedups: Sequence[float] = (2.0, 3.0, 5.0),
    new_tokens: int = 32,
    horizon: int | None = None,
    repeats: int = 3,
    warmup: int = 1,
    include_hf: bool = True,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure per-step decode time and tokens/s for every batch size and policy (and HF).

    Args:
        sk: a :class:`skipdecode.model.SkipModel`.
        batch_sizes: batch sizes B (prompts per batch).
        speedups: target speedups s > 1 for ``sk.policy_for(speedup=s, horizon=horizon)``;
            full depth is always measured.
        new_tokens: tokens generated per row in every run (>= 2: at least one decode step).
        horizon: T of the policies (tokens); default ``new_tokens``.
        repeats: timed runs per configuration; the median is reported.
        warmup: untimed runs per configuration before timing.
        include_hf: also time Hugging Face ``generate``.
        prompts: prompt pool (see :func:`batch_prompts`).
        on_progress: called with a short message before each configuration's runs.

    Returns:
        ``{"meta": {...}, "rows": [...], "targets": {...}}`` (JSON-serialisable). One row per
        (batch size, engine/policy); times in ms, see the module docstring for definitions.

    Raises:
        ValueError: bad arguments (names the field), or a speedup too large for the model.
    """
    for name, value, low in (("new_tokens", new_tokens, 2), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not batch_sizes:
        raise ValueError("batch_sizes must not be empty")
    horizon = new_tokens if horizon is None else horizon
    progress = on_progress or (lambda msg: None)
    device = _device(sk)
    L = sk.num_layers
    policies: list[tuple[str, float, SkipPolicy]] = [("full", 1.0, FullPolicy(L))]
    for s in speedups:
        policies.append((_policy_name(s), float(s), sk.policy_for(speedup=float(s), horizon=horizon)))
    eos_ids: set[int] = set()
    for source in (getattr(sk.tokenizer, "eos_token_id", None), getattr(sk.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos_ids.add(source)
        elif source:
            eos_ids.update(int(x) for x in source)

    rows: list[dict[str, Any]] = []
    for B in batch_sizes:
        texts = batch_prompts(B, prompts)
        input_ids, attention_mask = encode_prompts(sk.tokenizer, texts, chat=sk.chat, device=device)
        configs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (name, (lambda p=policy: _run_ours(sk, texts, p, new_tokens))) for name, _, policy in policies
        ]
        if include_hf:
            configs.append(("hf", lambda: _run_hf(sk, input_ids, attention_mask, new_tokens)))
        for w in range(warmup):
            for name, fn in configs:
                progress(f"batch {B}: warm-up {w + 1}/{warmup} {name}")
                fn()
        runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in range(repeats):
            for name, fn in configs:
                progress(f"batch {B}: repeat {r + 1}/{repeats} {name}")
                runs[name].append(fn())

        full_ms = statistics.median(x["step_s"] for x in runs["full"]) * 1e3
        hf_ms = statistics.median(x["step_s"] for x in runs["hf"]) * 1e3 if include_hf else None
        prompt_tokens = int(attention_mask.sum())
        for name, target, policy in policies:
            rs = runs[name]
            step_ms = statistics.median(x["step_s"] for x in rs) * 1e3
            layers_run = rs[0]["layers_run"]
            theo = theoretical_speedup(L, layers_run)
            wall = full_ms / step_ms
            row = {
                "batch_size": B,
                "engine": "skipdecode",
                "policy": name,
                "target_speedup": target,
                "policy_config": policy.to_dict(),
                "num_layers": L,
                "decode_steps": rs[0]["decode_steps"],
                "layers_run": layers_run,
                "mean_active_layers": sum(layers_run) / len(layers_run),
                "theoretical_speedup": theo,
                "step_ms": step_ms,
                "step_ms_runs": [x["step_s"] * 1e3 for x in rs],
                "engine_step_ms": statistics.median(x["engine_step_s"] for x in rs) * 1e3,
                "ttft_ms": statistics.median(x["prefill_s"] for x in rs) * 1e3,
                "tokens_per_s": B * 1e3 / step_ms,
                "wall_speedup": wall,
                "wall_over_theoretical": wall / theo,
                "hf_step_ms": hf_ms,
                "full_vs_hf": (hf_ms / step_ms) if (include_hf and name == "full") else None,
                "prompt_tokens": prompt_tokens,
            }
            if include_hf and name == "full":
                row["tokens_match_hf"] = _tokens_agree(rs[0]["token_ids"], runs["hf"][0]["token_ids"], eos_ids)
            rows.append(row)
        if include_hf:
            rs = runs["hf"]
            step_ms = hf_ms
            rows.append(
                {
                    "batch_size": B,
                    "engine": "hf",
                    "policy": "hf-generate",
                    "target_speedup": 1.0,
                    "policy_config": {"type": "full", "num_layers": L},
                    "num_layers": L,
                    "decode_steps": rs[0]["decode_steps"],
                    "layers_run": [L] * rs[0]["decode_steps"],
                    "mean_active_layers": float(L),
                    "theoretical_speedup": 1.0,
                    "step_ms": step_ms,
                    "step_ms_runs": [x["step_s"] * 1e3 for x in rs],
                    "engine_step_ms": None,
                    "ttft_ms": statistics.median(x["prefill_s"] for x in rs) * 1e3,
                    "tokens_per_s": B * 1e3 / step_ms,
                    "wall_speedup": full_ms / step_ms,
                    "wall_over_theoretical": full_ms / step_ms,
                    "hf_step_ms": hf_ms,
                    "full_vs_hf": None,
                    "prompt_tokens": prompt_tokens,
                }
            )

    return {"meta": _meta(sk, batch_sizes, speedups, new_tokens, horizon, repeats, warmup, include_hf),
            "rows": rows, "targets": _targets(rows)}


def _meta(sk, batch_sizes, speedups, new_tokens, horizon, repeats, warmup, include_hf) -> dict[str, Any]:
    import platform

    import transformers

    device = _device(sk)
    dtype = next(sk.model.parameters()).dtype
    return {
        "model": sk.source or type(sk.model).__name__,
        "num_layers": sk.num_layers,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "batch_sizes": list(batch_sizes),
        "speedups": [float(s) for s in speedups],
        "new_tokens": new_tokens,
        "decode_steps": new_tokens - 1,
        "horizon": horizon,
        "repeats": repeats,
        "warmup": warmup,
        "hf_baseline": include_hf,
        "chat_template": bool(sk.chat),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "timing": (
            "step_ms = median over repeats of (last - first token timestamp) / (new_tokens - 1); ours: "
            "generate() on_chunk callback (after sampling + detokenization), HF: logits-processor "
            "call (after each forward); greedy, equal lengths (eos_token_ids=[] / min_new_tokens)"
        ),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _targets(rows: list[dict[str, Any]], ratio: float = 0.8) -> dict[str, Any]:
    """The README's targets: full depth no slower than HF; wall/theoretical >= ``ratio`` at B 1, 8."""
    full_vs_hf = {str(r["batch_size"]): r["full_vs_hf"] for r in rows if r["engine"] == "skipdecode" and r["full_vs_hf"] is not None}
    wall = {
        f"{r['batch_size']}/{r['policy']}": r["wall_over_theoretical"]
        for r in rows
        if r["engine"] == "skipdecode" and r["policy"] != "full" and r["batch_size"] in (1, 8)
    }
    return {
        "full_vs_hf": full_vs_hf,
        "full_not_slower_than_hf": all(v >= 1.0 for v in full_vs_hf.values()) if full_vs_hf else None,
        "wall_over_theoretical_min": ratio,
        "wall_over_theoretical": wall,
        "wall_over_theoretical_met": all(v >= ratio for v in wall.values()) if wall else None,
    }


# ---------------------------------------------------------------------------------------------
# profile


def weight_bytes(sk) -> dict[str, int]:
    """Bytes of weights a decode step reads: per decoder layer, and the model's tail.

    Returns ``{"layer": [bytes of layer l], "head": bytes of the final norm + LM head (+ any
    projection), "embedding_row": bytes of one embedding row}``. The LM head's matrix is read in
    full every step whatever the skip plan (tied or not to the input embedding, of which a step
    reads only B rows).
    """
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    layers = [nbytes(layer) for layer in sk.adapter.layers]
    model = sk.model
    head = 0
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out_emb is not None:
        head += nbytes(out_emb)
    layer_ids = {id(p) for layer in sk.adapter.layers for p in layer.parameters()}
    emb = model.get_input_embeddings()
    emb_ids = {id(p) for p in emb.parameters()}
    head_ids = {id(p) for p in out_emb.parameters()} if out_emb is not None else set()
    # final norms / projections: parameters outside layers, embeddings and the LM head
    # (position-embedding tables, read one row per token, are excluded)
    for name, p in model.named_parameters():
        if id(p) in layer_ids or id(p) in emb_ids or id(p) in head_ids:
            continue
        if "embed_positions" in name or ".wpe." in name or name.endswith("wpe.weight"):
            continue
        head += p.numel() * p.element_size()
    w = emb.weight
    return {"layer": layers, "head": head, "embedding_row": w.shape[-1] * w.element_size()}


class _Clock:
    """Accumulates perf_counter time per named part for the current decode step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, float] = defaultdict(float)
        self.layers: dict[int, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str, layer: int | None = None) -> Iterator[None]:
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            elapsed = time.perf_counter() - start
            if layer is None:
                self.parts[name] += elapsed
            else:
                self.layers[layer] += elapsed

    def reset(self) -> None:
        self.parts = defaultdict(float)
        self.layers = defaultdict(float)


class _TimedAdapter:
    """Wraps an adapter and times its hooks; everything else is delegated unchanged."""

    def __init__(self, inner, clock: _Clock) -> None:
        self._inner = inner
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def embed(self, input_ids, position_ids):
        with self._clock.part("embedding"):
            return self._inner.embed(input_ids, position_ids)

    def layer_inputs(self, hidden, position_ids):
        with self._clock.part("rotary / layer inputs"):
            return self._inner.layer_inputs(hidden, position_ids)

    def run_layer(self, layer_idx, hidden, attention_mask, cache, extra):
        with self._clock.part("layer", layer=layer_idx):
            return self._inner.run_layer(layer_idx, hidden, attention_mask, cache, extra)

    def head(self, hidden):
        with self._clock.part("final norm + LM head"):
            return self._inner.head(hidden)


@contextlib.contextmanager
def _instrumented(clock: _Clock) -> Iterator[None]:
    """Temporarily time the mask/positions helpers and the sampler used by the engine loop."""
    import importlib

    # ``skipdecode.generate`` the attribute is the function; the module is looked up by name
    fwd = importlib.import_module(f"{__package__}.forward")
    gen = importlib.import_module(f"{__package__}.generate")

    orig_mask, orig_pos, orig_sampler = fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler

    def timed_mask(*args, **kwargs):
        with clock.part("positions + attention mask"):
            return orig_mask(*args, **kwargs)

    def timed_pos(*args, **kwargs):
        with clock.part("positions + attention mask"):
            return orig_pos(*args, **kwargs)

    class TimedSampler(orig_sampler):  # type: ignore[misc, valid-type]
        def __call__(self, logits, input_ids=None):
            with clock.part("sampling"):
                return super().__call__(logits, input_ids)

    fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler = timed_mask, timed_pos, TimedSampler
    try:
        yield
    finally:
        fwd.build_attention_mask, fwd.positions_from_mask, gen.Sampler = orig_mask, orig_pos, orig_sampler


PROFILE_PARTS = (
    "embedding",
    "positions + attention mask",
    "rotary / layer inputs",
    "decoder layers",
    "final norm + LM head",
    "sampling",
    "other (loop, cache bookkeeping, python)",
)


def profile_decode(
    sk,
    *,
    batch_sizes: Sequence[int] = (1, 8),
    speedups: Sequence[float] = (5.0,),
    new_tokens: int = 32,
    horizon: int | None = None,
    repeats: int = 3,
    bandwidth_gbs: float = 15.0,
    predict_speedups: Sequence[float] = (2.0, 3.0, 5.0),
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Where a decode step's time goes, for full depth and each speedup, per batch size.

    Runs the engine's own loop (:func:`~skipdecode.generate.generate_step`, greedy, no EOS) with
    ``perf_counter`` around each part; a step is the interval between consecutive yielded
    columns (decode steps t >= 1 only), and "other" is that interval minus the timed parts. The
    median over ``repeats`` runs of each part's mean ms per step is reported. Timers add a little
    overhead of their own (two perf_counter calls per part, ~40 per step).

    The memory model: a decode step must read the weights of every active layer and the whole
    LM head (``weight_bytes``); ``floor_ms = bytes / bandwidth_gbs``. ``head_share`` is the
    fraction of those bytes in the tail, and ``bytes_speedup_bound`` = full-depth bytes / this
    plan's bytes: the wall-clock speedup a memory-bound step can reach at most.

    From each full-depth breakdown, ``predictions`` extrapolates every ``predict_speedups``
    policy (Amdahl): the decoder-layer time scales with the mean active layers, the rest (LM
    head, sampling, loop) does not; ``ratio`` = predicted wall / theoretical speedup.

    Returns:
        ``{"bandwidth_gbs", "weights": {...}, "rows": [...], "predictions": [...]}``.
    """
    horizon = new_tokens if horizon is None else horizon
    progress = on_progress or (lambda msg: None)
    device = _device(sk)
    L = sk.num_layers
    wb = weight_bytes(sk)
    full_bytes = sum(wb["layer"]) + wb["head"]
    policies: list[tuple[str, SkipPolicy]] = [("full", FullPolicy(L))]
    policies += [(_policy_name(s), sk.policy_for(speedup=float(s), horizon=horizon)) for s in speedups]
    pad = sk.tokenizer.pad_token_id if sk.tokenizer.pad_token_id is not None else 0
    rows = []
    for B in batch_sizes:
        texts = batch_prompts(B, prompts)
        input_ids, attention_mask = encode_prompts(sk.tokenizer, texts, chat=sk.chat, device=device)
        for name, policy in policies:
            progress(f"profile: batch {B} {name}")
            per_run: list[dict[str, Any]] = []
            for r in range(repeats + 1):  # run 0 is a warm-up
                clock = _Clock(device)
                adapter = _TimedAdapter(sk.adapter, clock)
                sums: dict[str, float] = defaultdict(float)
                layer_sums: dict[int, float] = defaultdict(float)
                layer_counts: dict[int, int] = defaultdict(int)
                total = 0.0
                steps = 0
                layers_run: list[int] = []
                with _instrumented(clock), torch.inference_mode():
                    gen = generate_step(
                        adapter, input_ids, attention_mask, policy=policy, max_new_tokens=new_tokens,
                        eos_token_ids=(), pad_token_id=pad,
                    )
                    _sync(device)
                    last = time.perf_counter()
                    for out in gen:
                        _sync(device)
                        now = time.perf_counter()
                        if out.step >= 1:
                            steps += 1
                            total += now - last
                            layers_run.append(len(out.active_layers))
                            for k, v in clock.parts.items():
                                sums[k] += v
                            for k, v in clock.layers.items():
                                layer_sums[k] += v
                                layer_counts[k] += 1
                        clock.reset()
                        last = time.perf_counter()
                if r == 0:
                    continue
                layers_ms = sum(layer_sums.values()) / steps * 1e3
                parts = {k: sums.get(k, 0.0) / steps * 1e3 for k in PROFILE_PARTS}
                parts["decoder layers"] = layers_ms
                step_ms = total / steps * 1e3
                parts["other (loop, cache bookkeeping, python)"] = step_ms - sum(
                    v for k, v in parts.items() if not k.startswith("other")
                )
                per_run.append(
                    {
                        "step_ms": step_ms,
                        "parts": parts,
                        "layer_ms": {k: layer_sums[k] / layer_counts[k] * 1e3 for k in layer_sums},
                        "layers_run": layers_run,
                    }
                )
            med = lambda key: statistics.median(x[key] for x in per_run)  # noqa: E731
            parts = {k: statistics.median(x["parts"][k] for x in per_run) for k in PROFILE_PARTS}
            layer_keys = sorted(per_run[0]["layer_ms"])
            layer_ms = {str(k): statistics.median(x["layer_ms"][k] for x in per_run) for k in layer_keys}
            layers_run = per_run[0]["layers_run"]
            mean_layers = sum(layers_run) / len(layers_run)
            mean_layer_bytes = sum(wb["layer"]) / L
            step_bytes = mean_layers * mean_layer_bytes + wb["head"] + B * wb["embedding_row"]
            step_ms = med("step_ms")
            rows.append(
                {
                    "batch_size": B,
                    "policy": name,
                    "mean_active_layers": mean_layers,
                    "theoretical_speedup": theoretical_speedup(L, layers_run),
                    "step_ms": step_ms,
                    "parts_ms": parts,
                    "parts_share": {k: v / step_ms for k, v in parts.items()},
                    "per_layer_ms": layer_ms,
                    "mean_layer_ms": parts["decoder layers"] / mean_layers,
                    "weight_bytes_per_step": step_bytes,
                    "floor_ms": step_bytes / (bandwidth_gbs * 1e9) * 1e3,
                    "head_share_of_bytes": wb["head"] / step_bytes,
                    "bytes_speedup_bound": (full_bytes + B * wb["embedding_row"]) / step_bytes,
                    "achieved_gbs": step_bytes / (step_ms * 1e-3) / 1e9,
                }
            )
    # measured wall speedups and the bound implied by the measured fixed (non-layer) cost
    for row in rows:
        full = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["policy"] == "full")
        row["wall_speedup"] = full["step_ms"] / row["step_ms"]
        row["fixed_ms"] = row["step_ms"] - row["parts_ms"]["decoder layers"]
        row["fixed_share"] = row["fixed_ms"] / row["step_ms"]
        # Amdahl: the layer part scales with active layers, the rest (head, sampling, loop) does not
        layer_full = full["parts_ms"]["decoder layers"]
        row["amdahl_speedup"] = full["step_ms"] / (
            full["fixed_ms"] + layer_full * row["mean_active_layers"] / full["mean_active_layers"]
        )
    predictions = []
    for full in (r for r in rows if r["policy"] == "full"):
        for target in predict_speedups:
            policy = sk.policy_for(speedup=float(target), horizon=horizon)
            budgets = [policy.budget(t) for t in range(1, new_tokens)]
            mean_layers = sum(budgets) / len(budgets)
            theo = theoretical_speedup(L, budgets)
            predicted = full["step_ms"] / (full["fixed_ms"] + full["mean_layer_ms"] * mean_layers)
            step_bytes = mean_layers * sum(wb["layer"]) / L + wb["head"]
            predictions.append(
                {
                    "batch_size": full["batch_size"],
                    "policy": _policy_name(float(target)),
                    "mean_active_layers": mean_layers,
                    "theoretical_speedup": theo,
                    "amdahl_speedup": predicted,
                    "amdahl_ratio": predicted / theo,
                    "bytes_speedup_bound": full_bytes / step_bytes,
                    "bytes_ratio": full_bytes / step_bytes / theo,
                }
            )
    return {
        "predictions": predictions,
        "bandwidth_gbs": bandwidth_gbs,
        "weights": {
            "layer_bytes_mean": sum(wb["layer"]) / L,
            "layers_bytes_total": sum(wb["layer"]),
            "head_bytes": wb["head"],
            "num_layers": L,
            "dtype": str(next(sk.model.parameters()).dtype).replace("torch.", ""),
        },
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------
# output


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{spec}}{suffix}"


def results_table(result: dict[str, Any]):
    """A ``rich.table.Table`` of the benchmark rows (the CLI prints it)."""
    from rich.table import Table

    meta = result["meta"]
    table = Table(
        title=(
            f"decode speed: {meta['model'].split(' (')[0]} | {meta['device']} {meta['dtype']} | {meta['threads']} threads | "
            f"{meta['new_tokens']} new tokens ({meta['decode_steps']} decode steps), horizon {meta['horizon']}, "
            f"median of {meta['repeats']}"
        ),
        title_justify="left",
    )
    for col, justify in (
        ("batch", "right"), ("policy", "left"), ("mean layers", "right"), ("theoretical", "right"),
        ("step ms", "right"), ("tok/s", "right"), ("wall speedup", "right"), ("wall/theo", "right"),
        ("ours-full vs HF", "right"), ("TTFT ms", "right"),
    ):
        table.add_column(col, justify=justify)
    last_b = None
    for r in result["rows"]:
        if last_b is not None and r["batch_size"] != last_b:
            table.add_section()
        last_b = r["batch_size"]
        hf = r["engine"] == "hf"
        vs_hf = "-"
        if r["full_vs_hf"] is not None:
            match = "" if r.get("tokens_match_hf", True) else " (ids differ)"
            vs_hf = f"{r['full_vs_hf']:.2f}x{match}"
        table.add_row(
            str(r["batch_size"]),
            "HF generate" if hf else r["policy"],
            f"{r['mean_active_layers']:.1f}/{r['num_layers']}",
            _fmt(r["theoretical_speedup"], ".2f", "x"),
            _fmt(r["step_ms"], ".1f"),
            _fmt(r["tokens_per_s"], ".1f"),
            _fmt(r["wall_speedup"], ".2f", "x"),
            "-" if hf or r["policy"] == "full" else _fmt(r["wall_over_theoretical"], ".2f"),
            vs_hf,
            _fmt(r["ttft_ms"], ".0f"),
        )
    return table


def profile_table(profile: dict[str, Any]):
    """A ``rich.table.Table`` of :func:`profile_decode`'s breakdown (ms per decode step)."""
    from rich.table import Table

    w = profile["weights"]
    table = Table(
        title=(
            f"decode step profile (ms per step, share) | layer {w['layer_bytes_mean'] / 1e6:.1f} MB x "
            f"{w['num_layers']}, LM head + norm {w['head_bytes'] / 1e6:.1f} MB ({w['dtype']}) | floor at "
            f"{profile['bandwidth_gbs']:g} GB/s"
        ),
        title_justify="left",
    )
    table.add_column("part")
    for r in profile["rows"]:
        table.add_column(f"B={r['batch_size']} {r['policy']}", justify="right")
    for part in PROFILE_PARTS:
        cells = [f"{r['parts_ms'][part]:.2f} ({r['parts_share'][part]:.0%})" for r in profile["rows"]]
        table.add_row(part, *cells)
    table.add_section()
    table.add_row("step total", *[f"{r['step_ms']:.2f}" for r in profile["rows"]])
    table.add_row("mean active layers", *[f"{r['mean_active_layers']:.1f}" for r in profile["rows"]])
    table.add_row("ms per decoder layer", *[f"{r['mean_layer_ms']:.2f}" for r in profile["rows"]])
    table.add_row("fixed (non-layer) ms", *[f"{r['fixed_ms']:.2f} ({r['fixed_share']:.0%})" for r in profile["rows"]])
    table.add_row("wall speedup (this profile)", *[f"{r['wall_speedup']:.2f}x" for r in profile["rows"]])
    table.add_row("theoretical speedup", *[f"{r['theoretical_speedup']:.2f}x" for r in profile["rows"]])
    table.add_row("Amdahl bound (measured fixed ms)", *[f"{r['amdahl_speedup']:.2f}x" for r in profile["rows"]])
    table.add_section()
    table.add_row("weight MB read per step", *[f"{r['weight_bytes_per_step'] / 1e6:.0f}" for r in profile["rows"]])
    table.add_row("LM head share of bytes", *[f"{r['head_share_of_bytes']:.0%}" for r in profile["rows"]])
    table.add_row(f"floor ms at {profile['bandwidth_gbs']:g} GB/s", *[f"{r['floor_ms']:.2f}" for r in profile["rows"]])
    table.add_row("bytes bound on speedup", *[f"{r['bytes_speedup_bound']:.2f}x" for r in profile["rows"]])
    table.add_row("achieved GB/s (weights)", *[f"{r['achieved_gbs']:.1f}" for r in profile["rows"]])
    preds = profile.get("predictions", [])
    if preds:
        table.add_section()
        for name in dict.fromkeys(p["policy"] for p in preds):
            cells = []
            for r in profile["rows"]:
                p = next((p for p in preds if p["batch_size"] == r["batch_size"] and p["policy"] == name), None)
                cells.append(
                    "-" if p is None or r["policy"] != "full" else
                    f"{p['amdahl_speedup']:.2f}x / {p['theoretical_speedup']:.2f}x = {p['amdahl_ratio']:.2f}"
                )
            table.add_row(f"{name}: predicted wall / theoretical", *cells)
    return table


def write_results(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``result`` as JSON to ``path`` (atomically; parent folders are created)."""
    from .model import write_json_atomic
    from .paths import portable_record

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, portable_record(result))  # paths relative to the repository / data folder
    path.chmod(0o644)
    return path


def write_plot(result: dict[str, Any], path: str | os.PathLike) -> Path:
    """Bar chart per batch size: theoretical vs wall-clock speedup of each policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in result["rows"] if r["engine"] == "skipdecode"]
    hf_rows = {r["batch_size"]: r for r in result["rows"] if r["engine"] == "hf"}
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), sharey=True, squeeze=False)
    top = max([r["theoretical_speedup"] for r in result["rows"]] + [r["wall_speedup"] for r in result["rows"]] + [1.0])
    for ax, B in zip(axes[0], batches):
        sub = [r for r in rows if r["batch_size"] == B]
        xs = range(len(sub))
        ax.bar([x - 0.2 for x in xs], [r["theoretical_speedup"] for r in sub], 0.4, label="theoretical", color="#9ab")
        ax.bar([x + 0.2 for x in xs], [r["wall_speedup"] for r in sub], 0.4, label="wall-clock", color="#e73")
        ax.plot(list(xs), [0.8 * r["theoretical_speedup"] for r in sub], "k--", lw=1, label="0.8 x theoretical")
        ax.axhline(1.0, color="grey", lw=0.8)
        labels = [r["policy"] for r in sub]
        if B in hf_rows:  # HF generate's wall-clock speed relative to our full depth (< 1: HF slower)
            ax.bar([len(sub) + 0.2], [hf_rows[B]["wall_speedup"]], 0.4, color="#555", label="HF generate")
            labels.append("HF")
        ax.set_xticks(list(range(len(labels))), labels)
        ax.set_title(f"batch {B}")
        ax.set_ylim(0, top * 1.1)
    axes[0][0].set_ylabel("speedup vs our full depth")
    axes[0][0].legend(loc="upper left", fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"SkipDecode decode speed: {meta['device']} {meta['dtype']}, {meta['threads']} threads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
