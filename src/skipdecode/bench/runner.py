"""The decode-speed benchmark proper: timed runs of our engine and of Hugging Face ``generate``,
interleaved per batch size, and the result rows, metadata and README targets.

The definitions of a decode step, the timestamps and the order of runs are in the
:mod:`skipdecode.bench` package docstring.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..generate import encode_prompts, generate
from ..lowrank import has_decode_only_adapter
from ..policy import SkipPolicy, theoretical_speedup
from .clock import _device, _per_step, _sync
from .inputs import DEFAULT_PROMPTS, batch_prompts, bench_policies, schedule_notes


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
        horizon: T of the policies (tokens); default ``new_tokens``. Where the model has a trained
            schedule of another horizon for a target, the generic one is timed and
            ``meta["schedule_notes"]`` (also sent to ``on_progress``) says so
            (:func:`~skipdecode.bench.inputs.schedule_notes`).
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
    _check_counts(new_tokens, repeats, warmup, batch_sizes)
    horizon = new_tokens if horizon is None else horizon
    progress = on_progress or (lambda msg: None)
    device = _device(sk)
    policies = bench_policies(sk, speedups, horizon)
    notes = schedule_notes(sk, speedups, horizon, new_tokens)
    for note in notes:
        progress(note)
    eos_ids = _eos_ids(sk)

    rows: list[dict[str, Any]] = []
    for B in batch_sizes:
        texts = batch_prompts(B, prompts)
        input_ids, attention_mask = encode_prompts(sk.tokenizer, texts, chat=sk.chat, device=device)
        configs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (name, (lambda p=policy: _run_ours(sk, texts, p, new_tokens))) for name, _, policy in policies
        ]
        if include_hf:
            configs.append(("hf", lambda: _run_hf(sk, input_ids, attention_mask, new_tokens)))
        runs = _interleaved_runs(configs, B, warmup, repeats, progress)
        rows += _batch_rows(B, policies, runs, sk.num_layers, include_hf, int(attention_mask.sum()), eos_ids,
                            compare_ids=not has_decode_only_adapter(sk.model))

    meta = _meta(sk, batch_sizes, speedups, new_tokens, horizon, repeats, warmup, include_hf)
    return {"meta": {**meta, "schedule_notes": notes}, "rows": rows, "targets": _targets(rows)}


def _check_counts(new_tokens: int, repeats: int, warmup: int, batch_sizes: Sequence[int]) -> None:
    """Raises ValueError naming the field: ``new_tokens`` < 2, ``repeats`` < 1, ``warmup`` < 0
    (or not integers), or no batch size."""
    for name, value, low in (("new_tokens", new_tokens, 2), ("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not batch_sizes:
        raise ValueError("batch_sizes must not be empty")


def _eos_ids(sk) -> set[int]:
    """Every EOS id of the tokenizer and of the model's generation config."""
    eos_ids: set[int] = set()
    for source in (getattr(sk.tokenizer, "eos_token_id", None), getattr(sk.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos_ids.add(source)
        elif source:
            eos_ids.update(int(x) for x in source)
    return eos_ids


def _interleaved_runs(configs: list[tuple[str, Callable[[], dict[str, Any]]]], B: int, warmup: int,
                      repeats: int, progress: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """``warmup`` untimed rounds, then ``repeats`` timed rounds of every configuration in turn
    (repeat r of each before repeat r+1); returns each configuration's timed runs by name."""
    for w in range(warmup):
        for name, fn in configs:
            progress(f"batch {B}: warm-up {w + 1}/{warmup} {name}")
            fn()
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in range(repeats):
        for name, fn in configs:
            progress(f"batch {B}: repeat {r + 1}/{repeats} {name}")
            runs[name].append(fn())
    return runs


def _batch_rows(B: int, policies: list[tuple[str, float, SkipPolicy]], runs: dict[str, list[dict[str, Any]]],
                L: int, include_hf: bool, prompt_tokens: int, eos_ids: set[int],
                compare_ids: bool = True) -> list[dict[str, Any]]:
    """The rows of batch size ``B``: one per policy, then HF ``generate``'s (``include_hf``).
    ``compare_ids`` False (a decode-only skip adapter, whose prefill HF ``generate`` cannot
    reproduce) records ``tokens_match_hf`` as None with a note instead of comparing ids."""
    full_ms = statistics.median(x["step_s"] for x in runs["full"]) * 1e3
    hf_ms = statistics.median(x["step_s"] for x in runs["hf"]) * 1e3 if include_hf else None
    rows = []
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
            if not compare_ids:  # HF generate would run the adapter in the prefill too
                row["tokens_match_hf"] = None
                row["tokens_match_hf_note"] = "not compared: a decode-only skip adapter prefills with the base weights"
            else:
                row["tokens_match_hf"] = _tokens_agree(rs[0]["token_ids"], runs["hf"][0]["token_ids"], eos_ids)
        rows.append(row)
    if include_hf:
        rows.append(_hf_row(B, runs["hf"], L, full_ms, hf_ms, prompt_tokens))
    return rows


def _hf_row(B: int, rs: list[dict[str, Any]], L: int, full_ms: float, hf_ms: float,
            prompt_tokens: int) -> dict[str, Any]:
    """The row of HF ``generate`` at batch size ``B`` (full depth; ms against our full depth)."""
    step_ms = hf_ms
    return {
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
        "cpu": cpu_description(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "timing": (
            "step_ms = median over repeats of (last - first token timestamp) / (new_tokens - 1); ours: "
            "generate() on_chunk callback (after sampling + detokenization), HF: logits-processor "
            "call (after each forward); greedy, equal lengths (eos_token_ids=[] / min_new_tokens)"
        ),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _targets(rows: list[dict[str, Any]], ratio: float = 0.8) -> dict[str, Any]:
    """The README's targets: full depth no slower than HF; wall/theoretical >= ``ratio`` at B 1, 8,
    over the rows that skipped a layer (a row whose decode steps all ran every layer, theoretical
    speedup 1, would pass it trivially)."""
    full_vs_hf = {str(r["batch_size"]): r["full_vs_hf"] for r in rows if r["engine"] == "skipdecode" and r["full_vs_hf"] is not None}
    wall = {
        f"{r['batch_size']}/{r['policy']}": r["wall_over_theoretical"]
        for r in rows
        if r["engine"] == "skipdecode" and r["policy"] != "full" and r["batch_size"] in (1, 8)
        and r["theoretical_speedup"] > 1.0
    }
    return {
        "full_vs_hf": full_vs_hf,
        "full_not_slower_than_hf": all(v >= 1.0 for v in full_vs_hf.values()) if full_vs_hf else None,
        "wall_over_theoretical_min": ratio,
        "wall_over_theoretical": wall,
        "wall_over_theoretical_met": all(v >= ratio for v in wall.values()) if wall else None,
    }


def cpu_description(cpuinfo: str | Path = "/proc/cpuinfo") -> dict[str, Any]:
    """The host CPU as /proc/cpuinfo names it (Linux; {} elsewhere): ``model_name``, ``family``
    and ``model`` (AMD family 25 is Zen 3/4, 26 Zen 5), ``avx512`` (whether ``avx512f`` is among
    its flags), so that results from hosts sold under one name ("AMD EPYC") can be told apart."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():  # the first processor's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return {"model_name": fields.get("model name"), "family": fields.get("cpu family"),
            "model": fields.get("model"), "avx512": "avx512f" in fields.get("flags", "").split()}

