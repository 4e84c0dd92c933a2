"""The in-flight scheduler: one engine thread steps an :class:`~skipdecode.engine.Engine` for
every caller (the server's requests, ``generate``/``eval`` with many prompts).

Callers :meth:`Scheduler.submit` a group of :class:`~skipdecode.engine.Request` with a ``sink``
that receives each :class:`~skipdecode.engine.TokenEvent` (called on the engine thread; it must
not block). The waiting queue is bounded (:class:`QueueFull` past ``max_waiting``); requests are
checked (context length, ...) before they enter it; :meth:`Scheduler.cancel` drops a request at
the next step and frees its slot. If a step fails, every request then running gets the exception
through its sink and the engine starts afresh, so one fault never wedges the server.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from .adapters import Adapter
from .engine import Engine, Request, TokenEvent

__all__ = ["QueueFull", "Scheduler", "on_fresh_thread", "run_requests"]

Sink = Callable[["TokenEvent | BaseException"], None]


def on_fresh_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on a new thread that ends when it returns; return its result
    or raise its exception (``SystemExit`` included) on the calling thread.

    Why: OpenMP (libgomp, PyTorch's CPU thread pool) keeps a team of worker threads for every
    thread that ran a parallel region, until that thread ends. While more of them exist than
    there are cores, libgomp stops spin-waiting between parallel regions, and every region of the
    engine thread then pays a wake-up. On the 2-core test host a 16-row compiled decode step took
    79-83 ms on a second thread once the model had been loaded (and compiled) on the main thread,
    against 61-64 ms on the loading thread itself or on a fresh thread after the loading thread
    had ended; a bare 200k-element add took 58 against 16 us. So ``skipdecode serve`` loads the
    model through this function, and the scheduler's engine thread is the only one left with a
    team (the main thread's event loop and tokenizer calls run no parallel regions).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on the caller, SystemExit included
            box["error"] = exc

    thread = threading.Thread(target=target, name="skipdecode-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests (the server answers 429)."""


class Scheduler:
    """Runs an :class:`Engine` on a daemon thread.

    Args:
        adapter: the model's adapter.
        max_batch_size: most rows decoding at once, >= 1 (1 serves one request at a time).
        max_waiting: most requests (rows) waiting for a slot, >= 0.
        cohort_size: waiting requests join the running rows in cohorts of at least this many
            rows, 1 <= ``cohort_size`` <= ``max_batch_size`` (:class:`Engine`; 1 = every free slot
            is filled at the next step).
        prefix_cache: the engine's automatic prefix caching (:class:`Engine`): True (default
            budget), a token budget, or False/0 (off).
        align_steps: the engine's age alignment (:class:`Engine`, :mod:`skipdecode.admission`):
            waiting requests wait at most this many steps while every running row is older (0: off).
        prefill_chunk_tokens: the engine's chunked prefill (:class:`Engine`,
            :mod:`skipdecode.chunked_prefill`): prompts with more tokens to compute are prefilled
            this many tokens per step while the running rows go on decoding (0: off).
        max_cache_bytes: the engine's bound on its key/value buffers (:class:`Engine`,
            :mod:`skipdecode.kv_budget`): requests that would exceed it wait (None: no bound).

    Raises:
        ValueError: ``max_batch_size`` < 1, ``max_waiting`` < 0, ``cohort_size`` outside
            [1, ``max_batch_size``], ``align_steps`` < 0, ``prefill_chunk_tokens`` < 0, a
            ``max_cache_bytes`` that is not None or >= 1, or a bad ``prefix_cache``.
    """

    def __init__(self, adapter: Adapter, max_batch_size: int = 32, max_waiting: int = 256,
                 cohort_size: int = 1, prefix_cache: bool | int = True, align_steps: int = 0,
                 prefill_chunk_tokens: int = 0, max_cache_bytes: int | None = None) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.adapter = adapter
        self._engine_options = dict(cohort_size=cohort_size, prefix_cache=prefix_cache, align_steps=align_steps,
                                    prefill_chunk_tokens=prefill_chunk_tokens, max_cache_bytes=max_cache_bytes)
        self.engine = Engine(adapter, max_batch_size, isolate_failures=True, **self._engine_options)
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.cancelled = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._sinks: dict[int, Sink] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="skipdecode-engine", daemon=True)
        self._thread.start()

    def check(self, request: Request) -> None:
        """Raise ValueError (naming the field) if ``request`` cannot run (see :meth:`Engine.check`)."""
        self.engine.check(request)

    def submit(self, requests: Sequence[Request], sink: Sink) -> None:
        """Queue ``requests`` (all or none); ``sink`` gets each of their events, or an exception
        if the engine fails while they run.

        Raises:
            ValueError: a request cannot run (:meth:`check`); nothing is queued.
            QueueFull: the waiting queue cannot take them all.
            RuntimeError: the scheduler is closed.
        """
        for r in requests:
            self.check(r)
        with self._lock:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            waiting = len(self._inbox) + len(self.engine.waiting)
            if waiting + len(requests) > self.max_waiting + len(self.engine.free_slots):
                raise QueueFull(
                    f"the server is busy: {waiting} request{'s' * (waiting != 1)} wait{'s' * (waiting == 1)} "
                    f"for {self.max_batch_size} running slot{'s' * (self.max_batch_size != 1)} "
                    f"(max_waiting {self.max_waiting}); retry later"
                )
            for r in requests:
                self._sinks[id(r)] = sink
            self._inbox.extend(requests)
            self._wake.notify()

    def cancel(self, requests: Sequence[Request]) -> None:
        """Drop ``requests`` (waiting or running) at the next step; their sinks get nothing more."""
        with self._lock:
            for r in requests:
                if self._sinks.pop(id(r), None) is not None:
                    self._cancels.append(r)
                    self.cancelled += 1
            self._wake.notify()

    def stats(self) -> dict[str, Any]:
        """``running``, ``prefilling`` (rows whose prompt is being prefilled in chunks; they hold
        a slot), ``waiting`` (rows), ``steps``, ``decode_steps`` and ``generated_tokens`` so
        far, ``prefill_seconds`` and ``decode_seconds`` (the engine's wall-clock time in prefills
        and in decode steps so far, s; the rest of the server's time the engine waited or
        delivered events), ``max_cache_bytes`` (the bound, None: none), ``cache_bytes`` (the
        slot cache's buffers now) and ``planned_cache_bytes`` (what they may reach for the rows
        held now, which admission counts), ``cancelled`` rows (a request's prompts and ``n`` choices count one
        each; the server's ``/metrics`` counts requests), the sizes, and ``prefix_cache``: the engine's
        prefix-cache statistics (:meth:`~skipdecode.prefix_cache.PrefixCache.stats`; None when
        off). The engine's counters count since it started, which a failed step restarts."""
        with self._lock:
            pc = self.engine.prefix_cache
            return {
                "running": len(self.engine.running),
                "prefilling": sum(1 + len(p.twins) for p in self.engine.prefilling),
                "waiting": len(self._inbox) + len(self.engine.waiting),
                "steps": self.engine.steps,
                "decode_steps": self.engine.decode_steps,
                "prefill_seconds": self.engine.prefill_seconds,
                "decode_seconds": self.engine.decode_seconds,
                "generated_tokens": self.engine.generated_tokens,
                "cancelled": self.cancelled,
                "max_batch_size": self.max_batch_size,
                "max_waiting": self.max_waiting,
                "cohort_size": self.engine.cohort_size,
                "align_steps": self.engine.align_steps,
                "prefill_chunk_tokens": self.engine.prefill_chunk_tokens,
                "max_cache_bytes": self.engine.max_cache_bytes,
                "cache_bytes": self.engine.cache.allocated_bytes,
                "planned_cache_bytes": self.engine.planned_cache_bytes,
                "prefix_cache": None if pc is None else pc.stats(),
            }

    def close(self) -> None:
        """Stop the engine thread after its current step (requests still queued are dropped)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _take_work(self) -> bool:
        """Move submissions and cancellations into the engine; wait while idle. False: closed."""
        with self._lock:
            while not self._closed and not (self._inbox or self._cancels or self.engine.busy):
                self._wake.wait()
            if self._closed:
                return False
            for r in self._inbox:
                self.engine.submit(r)
            self._inbox.clear()
            for r in self._cancels:
                self.engine.cancel(r)
            self._cancels.clear()
            return True

    def _loop(self) -> None:
        while self._take_work():
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - delivered to every affected caller
                self._fail(exc)
                continue
            with self._lock:
                sinks = [(self._sinks.get(id(ev.row.request)), ev) for ev in events]
                for ev in events:
                    if ev.finished:
                        self._sinks.pop(id(ev.row.request), None)
                failed = self._take_failures()
            for sink, ev in sinks:
                if sink is not None:
                    sink(ev)
            for sink, exc in failed:
                sink(exc)

    def _take_failures(self) -> list[tuple[Sink, BaseException]]:
        """Under the lock: the engine's rows that failed alone (``Engine.failures``), one
        ``(sink, exception)`` per caller; the caller's other rows are cancelled (its request has
        failed) and forgotten, so it hears of nothing after the exception."""
        out = []
        for row, exc in self.engine.failures:
            sink = self._sinks.pop(id(row.request), None)
            if sink is None:
                continue  # a row of a caller that failed earlier in this step
            siblings = {k for k, s in self._sinks.items() if s is sink}
            for r in self.engine.held_requests():
                if id(r) in siblings:
                    self.engine.cancel(r)
            for key in siblings:
                self._sinks.pop(key)
            out.append((sink, exc))
        self.engine.failures.clear()
        return out

    def _fail(self, exc: Exception) -> None:
        """Give ``exc`` to every request the engine held (running, joining or waiting; not those
        still in the inbox) and start a fresh engine."""
        with self._lock:
            queued = {id(r) for r in self._inbox}
            sinks = [self._sinks.pop(k) for k in list(self._sinks) if k not in queued]
            self.engine = Engine(self.adapter, self.max_batch_size, isolate_failures=True, **self._engine_options)
        for sink in sinks:
            if sink is not None:
                sink(exc)


def run_requests(
    adapter: Adapter, requests: Sequence[Request], max_batch_size: int = 32,
    on_event: Callable[[TokenEvent], None] | None = None, prefix_cache: bool | int = True,
):
    """Run ``requests`` to completion with in-flight batching on the calling thread (no server):
    a finished row's slot goes to the next request at once; ``prefix_cache`` as in
    :class:`Engine`. Returns their :class:`~skipdecode.engine.Row` in request order.

    Raises:
        ValueError: a request cannot run, ``max_batch_size`` < 1, or a bad ``prefix_cache``.
    """
    return Engine(adapter, max_batch_size, prefix_cache=prefix_cache).run(requests, on_event)
