"""How the server executes a request validated by :func:`skipdecode.protocol.validate_request`
(prompts already token ids, lengths already checked): check it against the engine before it is
queued, hand its rows to the shared :class:`~skipdecode.scheduler.Scheduler`, and turn the
engine's token events into text deltas and a :class:`~skipdecode.generate.GenerationResult` (the
response's ``usage``).

Nothing here holds a lock across an ``await`` or a ``yield``, and nothing blocks a worker thread
while waiting for tokens, so a slow or vanished client can never stall the others (issue 10's two
hangs). A request whose client disconnects is cancelled: its rows leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .engine import Request, Row, TokenEvent, mean_batch_rows
from .generate import GenerationResult, RowText, _eos_ids, expand_choices
from .logprobs import TokenLogprobs
from .model import SkipModel
from .sampling import row_sampling
from .scheduler import Scheduler

__all__ = ["Executor", "Submission"]


class Submission:
    """The rows of one HTTP request in the scheduler, seen from the event loop.

    Create it on the event loop (it captures the running loop), then :meth:`start`. Events arrive
    through an ``asyncio.Queue`` fed thread-safely by the engine thread, in groups:
    ``stream_interval`` (tokens, >= 1) holds a row's tokens on the engine thread until it has that
    many, except its first token and its last, which go at once (vLLM's and SGLang's
    ``--stream-interval``: fewer events, and fewer wake-ups of the event loop, per token; 1: every
    token at once). Each row's tokens are held and sent on their own (a queue item is one row's
    events), so every row of a request gets groups of ``stream_interval``; an engine failure sends
    what every row holds, then the exception.
    """

    def __init__(self, scheduler: Scheduler, requests: list[Request], texts: list[RowText], job: Any,
                 stream_interval: int = 1) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.texts = texts
        self.job = job
        self.stream_interval = stream_interval
        self.rows: list[Row | None] = [None] * len(requests)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.failed = False
        self._held: list[list[TokenEvent]] = [[] for _ in requests]  # engine thread only: per row, not sent yet
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in requests]  # per row, its text's tokens so far

    def _sink(self, event: TokenEvent | BaseException) -> None:
        """Engine thread: hold ``event`` or send its row's group (class docstring)."""
        if isinstance(event, BaseException):
            items = [held for held in self._held if held] + [event]
            self._held = [[] for _ in self._held]
        else:
            held = self._held[event.row.request.tag]
            held.append(event)
            if len(held) < self.stream_interval and event.step > 0 and not event.finished:
                return
            items = [held[:]]
            held.clear()
        for item in items:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def start(self) -> None:
        """Queue the rows. Raises :class:`~skipdecode.scheduler.QueueFull` or ValueError (nothing queued)."""
        self.scheduler.submit(self.requests, self._sink)

    @property
    def finished(self) -> bool:
        """True when every row has ended (or the engine failed while they ran)."""
        return self.failed or all(r is not None for r in self.rows)

    async def next(self, timeout: float | None = None) -> list[tuple[int, str, bool, list[TokenLogprobs]]]:
        """The next group of one row's tokens (class docstring), as a one-entry list
        ``[(row index, text delta, row finished, log-probabilities)]``, the delta being its
        tokens' text joined and the log-probabilities those of its tokens that belong to the text
        (EOS and special tokens left out; empty unless the request asked, ``Request.logprobs``).

        Raises:
            asyncio.TimeoutError: nothing within ``timeout`` seconds.
            Exception: the engine failed while this request ran (the step's exception), after
                the groups sent before it were read.
        """
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if isinstance(item, BaseException):
            self.failed = True  # the scheduler dropped every row of this request
            raise item
        i, last = item[0].row.request.tag, item[-1]
        delta = "".join(self.texts[i].push(ev.token, ev.finished) for ev in item)
        entries = [ev.logprobs for ev in item if ev.logprobs is not None and self.texts[i].in_text(ev.token)]
        self.logprobs[i] += entries
        if last.finished:
            self.rows[i] = last.row
        return [(i, delta, last.finished, entries)]

    def cancel(self) -> None:
        """Drop the rows that have not ended; they leave the batch at the next engine step."""
        self.scheduler.cancel([r for r, row in zip(self.requests, self.rows) if row is None])

    def result(self, num_layers: int) -> GenerationResult:
        """The finished request's :class:`GenerationResult` (its ``usage.skipdecode``).

        Per row, one request's rows ran their own steps: ``layers_run`` holds every row's decode
        steps (so ``theoretical_speedup`` = L x row-steps / layers run, docs/method.md), ``decode_steps``
        and ``decode_seconds`` are those of its longest row, ``prefill_seconds`` its slowest
        prefill (time to first token); ``cached_prompt_tokens`` its rows' prompt tokens reused
        from the engine's prefix cache; ``mean_batch_rows`` the rows of all requests that its
        decode steps ran with (:func:`skipdecode.engine.mean_batch_rows`). With ``n`` choices per
        prompt, ``prompt_tokens`` and ``cached_prompt_tokens`` count each prompt once (its first
        choice's), as OpenAI's ``usage`` does; the rest counts every row.
        """
        rows = [r for r in self.rows if isinstance(r, Row)]
        n = getattr(self.job, "n", 1)  # a prompt's n choices: its prompt counts once (OpenAI's usage)
        return GenerationResult(
            texts=[t.text for t in self.texts],
            token_ids=[t.ids for t in self.texts],
            finish_reasons=[t.reason for t in self.texts],
            prompt_tokens=[len(r.prompt_ids) for r in self.requests[::n]],
            new_tokens=[len(t.ids) for t in self.texts],
            prefill_seconds=max(r.prefill_seconds for r in rows),
            decode_seconds=max(r.decode_seconds for r in rows),
            decode_steps=max(len(r.layers_run) for r in rows),
            layers_run=[n for r in rows for n in r.layers_run],
            num_layers=num_layers,
            batch_size=len(rows),
            policy=self.job.policy.to_dict(),
            cached_prompt_tokens=[r.cached_prompt_tokens for r in self.rows[::n] if isinstance(r, Row)],
            mean_batch_rows=mean_batch_rows(rows),
            logprobs=self.logprobs if self.job.logprobs is not None else None,
        )


class Executor:
    """Builds :class:`Submission` objects for ``model`` on ``scheduler``, each sending its tokens in
    groups of ``stream_interval`` (:class:`Submission`)."""

    def __init__(self, model: SkipModel, scheduler: Scheduler, stream_interval: int = 1) -> None:
        self.model = model
        self.scheduler = scheduler
        self.stream_interval = stream_interval
        self.eos_token_ids = _eos_ids(model.tokenizer, model.model)

    def submit(self, job: Any) -> Submission:
        """Queue ``job`` (a :class:`~skipdecode.protocol.ValidRequest`: ``prompts`` as token ids,
        ``max_new_tokens``, ``policy``, ``sampling``, ``stop``, ``ignore_eos``, ``logprobs``, ``n``:
        ``n`` rows per prompt, row ``k * n + j`` prompt k's choice j with
        :func:`~skipdecode.generate.expand_choices`); call it on the event loop.

        Raises:
            ValueError: the engine refuses a row (names ``max_new_tokens`` or ``prompts``), or the
                request's rows (prompts x ``n``) exceed what the scheduler ever holds (names ``n``);
                nothing is queued.
            QueueFull: the waiting queue is full (the server answers 429).
        """
        tok = self.model.tokenizer
        n = getattr(job, "n", 1)
        rows, sampling = expand_choices(job.prompts, job.sampling, n)  # row k * n + j: prompt k's choice j
        params = row_sampling(sampling, len(rows))
        room = self.scheduler.max_waiting + self.scheduler.max_batch_size
        if len(rows) > room:  # never fits, however long the client retries: a 400, not a 429
            raise ValueError(f"n: {len(job.prompts)} prompt(s) x n={n} need {len(rows)} rows, more than this "
                             f"server ever holds ({room}: --max-waiting + --max-batch-size)")
        # ignore_eos: EOS ends no row (RowText still leaves EOS tokens out of the text)
        texts = [RowText(tok, self.eos_token_ids, job.stop, ends_at_eos=not job.ignore_eos) for _ in rows]
        ends = () if job.ignore_eos else tuple(self.eos_token_ids)
        reqs = [
            Request(list(ids), job.max_new_tokens, job.policy, params[i], ends,
                    texts[i].stopped if texts[i].stop else None, tag=i, logprobs=job.logprobs)
            for i, ids in enumerate(rows)
        ]
        sub = Submission(self.scheduler, reqs, texts, job, self.stream_interval)
        sub.start()
        return sub
