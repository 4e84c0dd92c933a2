"""llama.cpp rows of the decode-speed benchmark (issue 11): the same GGUF file at its native
quantization, greedy, with the same threads, decoded by llama.cpp through ``llama-cpp-python``
(the optional extra ``bench-llamacpp``; an sdist, so pip builds llama.cpp from source).

* :func:`llamacpp_row`: batch 1, through the high-level ``Llama`` object (one sequence).
* :func:`llamacpp_batched_row`: B sequences decoded together, through the low-level C API
  (``llama_batch_init`` / ``llama_decode`` on a context with ``n_seq_max = B``): every step is one
  ``llama_decode`` call holding one token of each sequence, each at its own position and with its
  own sequence id, as llama.cpp's own ``batched`` example does
  (``examples/batched/batched.cpp`` in ggml-org/llama.cpp).

Step time = (last - first token timestamp) / (new_tokens - 1), median over ``repeats`` after one
warm-up, as for our rows (:mod:`skipdecode.bench`). ``bytes_per_step`` is the GGUF file size
(llama.cpp reads every tensor each step; the tied embedding table is stored once), a lower bound.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
from typing import Any, Callable, Sequence

__all__ = ["LlamaCppCrash", "llamacpp_row", "llamacpp_batched_row", "run_isolated"]


class LlamaCppCrash(RuntimeError):
    """llama.cpp's child process ended without a result (a crash inside llama.cpp)."""


def _child(conn, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Run ``fn`` in the child and send back ``("ok", value)`` or ``("error", exception)``."""
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as exc:  # sent back and raised in the parent
        try:
            conn.send(("error", exc))
        except Exception:  # an exception that does not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    finally:
        conn.close()


def run_isolated(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh child process (``spawn``), so that a crash inside
    llama.cpp cannot end the benchmark and lose the rows it already timed. On a 2-core Intel Xeon
    with AMX (stop 64) llama.cpp died with a general protection fault inside ``libggml-cpu`` when
    run in the benchmark's process after PyTorch's compiled variants, and decoded normally in a
    process of its own. ``fn`` must be importable (a module-level function); its exceptions are
    raised here.

    Raises:
        LlamaCppCrash: the child ended without a result; the message gives its exit code or signal.
    """
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs), daemon=True)
    proc.start()
    send.close()
    try:
        kind, value = receive.recv()
    except EOFError:
        proc.join()
        code = proc.exitcode
        how = (f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0
               else f"exit code {code}")
        raise LlamaCppCrash(f"llama.cpp's process ended without a result ({how}) in {fn.__name__}: "
                            "a crash inside llama.cpp (its output, if any, is above)") from None
    finally:
        receive.close()
    proc.join()
    if kind == "error":
        raise value
    return value


def _floor(row: dict[str, Any], size: int, bandwidth_gbs: float | None) -> dict[str, Any]:
    """Add ``floor_ms`` (file bytes / read bandwidth, ms) and ``over_floor`` to ``row``."""
    if bandwidth_gbs:
        row["floor_ms"] = size / (bandwidth_gbs * 1e9) * 1e3
        row["over_floor"] = row["step_ms"] / row["floor_ms"]
    return row


def llamacpp_row(
    gguf_path: str,
    prompt: str,
    new_tokens: int,
    threads: int,
    repeats: int = 3,
    bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    """Batch-1 greedy decode of ``gguf_path`` with llama.cpp at its native quantization.

    Returns a row: ``step_ms`` (ms per token), ``tokens_per_s``, ``bytes_per_step`` (bytes) and,
    with ``bandwidth_gbs`` (GB/s), ``floor_ms`` and ``over_floor``.

    Raises:
        ImportError: llama-cpp-python is not installed (``pip install -e '.[bench-llamacpp]'``).
    """
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)

    def once() -> tuple[float, list[int]]:
        stamps, out = [], []
        llm.reset()
        for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            out.append(tok)
            if len(out) == new_tokens:
                break
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1), out

    once()
    runs = [once() for _ in range(repeats)]
    step_s = statistics.median(r[0] for r in runs)
    size = os.path.getsize(gguf_path)
    row = {
        "batch_size": 1, "engine": "llama.cpp", "variant": "gguf-native", "policy": "full",
        "step_ms": step_s * 1e3, "step_ms_runs": [r[0] * 1e3 for r in runs], "tokens_per_s": 1.0 / step_s,
        "prompt_tokens": len(tokens), "bytes_per_step": float(size), "threads": threads,
        "api": "high-level Llama.generate (one sequence)",
    }
    return _floor(row, size, bandwidth_gbs)


class _BatchedDecoder:
    """A llama.cpp model and context for ``n_seq`` sequences (low-level C API), freed by :meth:`close`."""

    def __init__(self, gguf_path: str, n_seq: int, n_ctx_seq: int, n_batch: int, threads: int) -> None:
        import llama_cpp as C

        self.C = C
        C.llama_backend_init()
        mparams = C.llama_model_default_params()
        self.model = C.llama_model_load_from_file(str(gguf_path).encode("utf-8"), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        cparams = C.llama_context_default_params()
        cparams.n_ctx = n_seq * n_ctx_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            C.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context with n_seq_max = %d" % n_seq)
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.batch = C.llama_batch_init(n_batch, 0, 1)

    def decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, sequence id, wants logits)`` entries.

        Raises:
            RuntimeError: llama_decode returned non-zero (no KV slot, or a fault)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self.C.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, i: int) -> int:
        """Greedy token at batch entry ``i`` of the last decode (an entry that asked for logits;
        ``llama_get_logits_ith`` takes the entry's index in the batch)."""
        import numpy as np

        ptr = self.C.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def clear(self) -> None:
        """Empty the KV cache of every sequence."""
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)

    def close(self) -> None:
        C = self.C
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


def llamacpp_batched_row(
    gguf_path: str,
    prompts: Sequence[str],
    new_tokens: int,
    threads: int,
    repeats: int = 3,
    bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    """Greedy decode of ``len(prompts)`` sequences together with llama.cpp (one ``llama_decode`` per step).

    The prompts are prefilled in one ``llama_decode`` (each its own sequence, positions from 0,
    no padding: llama.cpp keeps a position per sequence), then each step decodes one token of
    every sequence. Sequences do not stop at EOS, so every step holds all B rows, as our batched
    benchmark rows do.

    Args:
        gguf_path: the GGUF file. prompts: B >= 1 prompt texts (tokenized by llama.cpp with BOS).
        new_tokens: tokens per sequence, >= 2. threads: CPU threads. repeats: timed runs, >= 1.
        bandwidth_gbs: measured read bandwidth (GB/s) for ``floor_ms``.

    Returns:
        A row like :func:`llamacpp_row` with ``batch_size`` B, ``step_ms`` per step (B tokens),
        ``tokens_per_s`` = B / step time, and ``texts_token_ids`` (the first run's greedy tokens).

    Raises:
        ImportError: llama-cpp-python is not installed. ValueError: no prompts or
        ``new_tokens`` < 2. RuntimeError: llama.cpp refused the model, context or a batch.
    """
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 (a step time needs two tokens), got {new_tokens}")
    from llama_cpp import Llama

    vocab = Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    ids = [vocab.tokenize(p.encode("utf-8"), add_bos=True, special=True) for p in prompts]
    B = len(ids)
    n_batch = max(B, sum(len(x) for x in ids))
    dec = _BatchedDecoder(gguf_path, B, max(len(x) for x in ids) + new_tokens + 8, n_batch, threads)

    def once() -> tuple[float, list[list[int]]]:
        dec.clear()
        entries = [(t, p, s, p == len(x) - 1) for s, x in enumerate(ids) for p, t in enumerate(x)]
        dec.decode(entries)
        last = [sum(len(x) for x in ids[: s + 1]) - 1 for s in range(B)]  # batch index of each prompt's end
        out = [[dec.argmax(i)] for i in last]
        stamps = [time.perf_counter()]
        for step in range(1, new_tokens):
            dec.decode([(out[s][-1], len(ids[s]) + step - 1, s, True) for s in range(B)])
            for s in range(B):
                out[s].append(dec.argmax(s))
            stamps.append(time.perf_counter())
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1), out

    try:
        once()
        runs = [once() for _ in range(repeats)]
    finally:
        dec.close()
    step_s = statistics.median(r[0] for r in runs)
    size = os.path.getsize(gguf_path)
    row = {
        "batch_size": B, "engine": "llama.cpp", "variant": "gguf-native", "policy": "full",
        "step_ms": step_s * 1e3, "step_ms_runs": [r[0] * 1e3 for r in runs], "tokens_per_s": B / step_s,
        "prompt_tokens": sum(len(x) for x in ids), "bytes_per_step": float(size), "threads": threads,
        "api": "low-level llama_decode, n_seq_max = batch size (one token per sequence per step)",
        "token_ids": runs[0][1],
    }
    return _floor(row, size, bandwidth_gbs)
