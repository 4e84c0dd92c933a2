"""In-flight batching engine: every running row carries its own decode step and policy.

docs/method.md "Rows at different steps in one forward". A request waits in a queue; when a slot is
free it is prefilled at full depth (with the other requests joining at the same step, in
left-padded batches of similar lengths), its real K/V positions are copied into its own slot of a
:class:`~skipdecode.cache.SlotCache`, and it emits generated token 0. At every later
:meth:`Engine.step`, each running row feeds its last token through *its own* plan
``policy.active_layers(t)`` (t its own decode step): one :func:`~skipdecode.forward.skip_forward`
call with ``row_layers``, in which each layer runs only on the rows whose plan holds it. A row that
ends (EOS, a stop condition, its token budget, or cancellation) frees its slot at once, and a waiting
request takes it at the next step.

Sampling draws each row with its own :class:`~skipdecode.sampling.Sampler` (own generator, seeded by
the request's seed), so a request's tokens never depend on its neighbours.

The engine is synchronous and not thread-safe; :mod:`skipdecode.scheduler` runs it in a thread
for the server, and :func:`skipdecode.inflight.generate_inflight` runs it on the caller's thread for many prompts.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from typing import Callable, Sequence

import torch

from .adapters import Adapter
from .admission import check_align_steps, may_join
from .cache import SkipCache, SlotCache
from .chunked_prefill import PartialPrefill, check_prefill_chunk_tokens, run_chunk, start_partial
from .kv_budget import admits, check_fits_alone, check_max_cache_bytes, planned_bytes, position_bytes
from .lowrank import base_prefill, base_rows
from .forward import skip_forward
from .logprobs import check_logprobs, requested_logprobs
from .policy import FullPolicy, check_policy, plan_layers
from .prefill_buckets import PREFILL_CALL_TOKENS, length_buckets, shared_prefixes
from .engine_rows import Request, Row, TokenEvent, mean_batch_rows
from .prefix_cache import PrefixCache, PrefixEntry, prefix_cache_budget, prefix_skip_cache
from .sampling import Sampler, SamplingParams

__all__ = ["Request", "Row", "TokenEvent", "Engine", "PREFILL_CALL_TOKENS", "length_buckets", "mean_batch_rows"]


class Engine:
    """Slots, a waiting queue and the step loop of in-flight batching.

    Args:
        adapter: the model's adapter.
        max_batch_size: most rows decoding at once (slots), >= 1.
        keep_logits: attach each token's logits to its :class:`TokenEvent` (tests).
        cohort_size: waiting requests join the running rows only as a cohort of at least this
            many (rows), 1 <= ``cohort_size`` <= ``max_batch_size``; fewer join when fewer wait
            (all that wait fit) or when no row runs. 1 (default) fills every free slot at the next
            step (lowest time to first token). Larger cohorts keep the running rows at fewer
            distinct decode steps, so a step runs fewer layers: under one decaying schedule a
            step reads the layers of its youngest row (docs/inflight-batching.md).
        align_steps: A >= 0 (engine steps): while every running row is more than A decode steps
            old, waiting requests wait, at most A steps, and then join together, so rows share
            their full-depth steps (:mod:`skipdecode.admission`; 0, the default: never hold).
        prefix_cache: automatic prefix caching (:mod:`skipdecode.prefix_cache`): True (default)
            with a budget of :data:`~skipdecode.prefix_cache.DEFAULT_PREFIX_TOKENS` tokens, an
            integer for that budget (tokens), False or 0 for off. Joining requests whose prompts
            start with a stored prefix prefill only the rest of the prompt; outputs are unchanged.
        isolate_failures: a row whose token cannot be drawn (its sampler raises, e.g. NaN in its
            own logits) ends with reason "error" and goes to :attr:`failures` while the other rows
            go on (the server: one request's failure never fails the others); False (default):
            :meth:`step` raises, as a library call should.
        prefill_chunk_tokens: C > 0 (tokens): a joining request with more than C prompt tokens
            to compute (after any prefix-cache hit) is prefilled C tokens per engine step, after
            the running rows' decode step, so they keep decoding meanwhile; it holds its slot and
            joins when its last chunk is done (:mod:`skipdecode.chunked_prefill`; outputs are
            unchanged). 0 (default): every prompt is prefilled whole in the step it joins at.
        max_cache_bytes: a bound on the slot cache's key/value buffers (bytes): a waiting
            request joins only when the buffers, planned for every row at its longest history,
            fit (:mod:`skipdecode.kv_budget`); None (default): no bound.

    Attributes:
        prefix_cache: the :class:`~skipdecode.prefix_cache.PrefixCache`, or None when off; its
            ``stats()`` are the engine's prefix-cache statistics.
        failures: with ``isolate_failures``, ``(row, exception)`` of each row ended that way since
            the caller last emptied it (the scheduler delivers and clears them after each step).
        prefilling: the :class:`~skipdecode.chunked_prefill.PartialPrefill` of each request whose
            prompt is being prefilled in chunks, oldest first (only the first advances).

    Raises:
        ValueError: ``max_batch_size`` < 1, ``cohort_size`` outside [1, ``max_batch_size``],
            ``align_steps`` < 0, a ``prefix_cache`` that is not True, False or a token budget
            (0 or >= 8), a ``prefill_chunk_tokens`` that is not an integer >= 0, or a
            ``max_cache_bytes`` that is not None or an integer >= 1.
    """

    def __init__(self, adapter: Adapter, max_batch_size: int = 32, *, keep_logits: bool = False,
                 cohort_size: int = 1, prefix_cache: bool | int = True, align_steps: int = 0,
                 isolate_failures: bool = False, prefill_chunk_tokens: int = 0,
                 max_cache_bytes: int | None = None) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if isinstance(cohort_size, bool) or not isinstance(cohort_size, int) or not 1 <= cohort_size <= max_batch_size:
            raise ValueError(f"cohort_size must be an integer in [1, max_batch_size={max_batch_size}], got {cohort_size!r}")
        budget = prefix_cache_budget(prefix_cache)
        self.prefix_cache = PrefixCache(budget) if budget else None
        self.cohort_size = cohort_size
        self.align_steps = check_align_steps(align_steps)
        self.prefill_chunk_tokens = check_prefill_chunk_tokens(prefill_chunk_tokens)
        self.prefilling: deque[PartialPrefill] = deque()
        self.max_cache_bytes = check_max_cache_bytes(max_cache_bytes)
        self._position_bytes = position_bytes(adapter)
        self._queued_at: dict[int, int] = {}  # id(request) -> engine step it was submitted at
        self.adapter = adapter
        self.max_batch_size = max_batch_size
        self.keep_logits = keep_logits
        self.device = next(adapter.model.parameters()).device
        capacity = min(256, adapter.max_positions or 256)
        self.cache = SlotCache(adapter.num_layers, max_batch_size, capacity=capacity)
        self.free_slots = list(range(max_batch_size))
        self.running: list[Row] = []
        self.waiting: deque[Request] = deque()
        self.steps = 0
        self.generated_tokens = 0
        self.prefill_seconds = 0.0  # totals over the engine's life (seconds)
        self.decode_seconds = 0.0
        self.decode_steps = 0  # steps that decoded at least one row
        self._cancelled: set[int] = set()
        self.isolate_failures = isolate_failures
        self.failures: list[tuple[Row, BaseException]] = []

    # -- queue -------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """Raise ValueError (naming the field) if ``request`` cannot run on this model: an empty
        prompt, ``max_new_tokens`` < 1, prompt + ``max_new_tokens`` beyond the context
        (``max_positions``), a ``policy`` that is not None or a policy object or is for another
        layer count (:func:`skipdecode.policy.check_policy`), or ``logprobs`` that is not None or
        an integer in [0, :data:`~skipdecode.logprobs.MAX_LOGPROBS`]."""
        n = request.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        P = len(request.prompt_ids)
        if P == 0:
            raise ValueError("prompts: a prompt must hold at least one token")
        self.adapter.check_context(P, n)  # P + n - 1 positions: the last token is never fed back
        check_fits_alone(self.cache, self._position_bytes, self.max_cache_bytes, P, n)
        check_policy(request.policy, self.adapter.num_layers)
        check_logprobs(request.logprobs)

    def submit(self, request: Request) -> None:
        """Queue ``request``; it joins at a later :meth:`step` when a slot is free.

        Raises:
            ValueError: as :meth:`check`.
        """
        self.check(request)
        self.waiting.append(request)
        self._queued_at[id(request)] = self.steps

    def cancel(self, request: Request) -> None:
        """Drop ``request`` (waiting or running) at the start of the next :meth:`step`; its slot is freed."""
        self._cancelled.add(id(request))

    @property
    def busy(self) -> bool:
        """True while a request runs, is being prefilled in chunks, or waits."""
        return bool(self.running or self.prefilling or self.waiting)

    def held_requests(self) -> list[Request]:
        """Every request the engine holds: running, being prefilled in chunks, then waiting."""
        partial = [r for p in self.prefilling for r in [p.request] + [t for t, _ in p.twins]]
        return [r.request for r in self.running] + partial + list(self.waiting)

    # -- step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One engine step: drop cancelled requests, decode one token for every running row
        (each with its own plan), prefill waiting requests into free slots (their token 0; with
        ``prefill_chunk_tokens``, a long prompt starts a chunked prefill instead), then run the
        next chunk of the oldest chunked prefill (its token 0 when it was the last).

        Returns the step's :class:`TokenEvent` list (cancelled rows get none).

        Raises:
            RuntimeError: NaN logits (:class:`~skipdecode.sampling.Sampler`), or a layer about to
                run for a row without that row's complete history (a non-monotone policy).
        """
        self._drop_cancelled()
        events = self._decode() if self.running else []
        joiners = []
        if self._cohort_may_join():
            while self.waiting and len(joiners) < len(self.free_slots) and self._fits(joiners + [self.waiting[0]]):
                joiners.append(self.waiting.popleft())
                self._queued_at.pop(id(joiners[-1]), None)
        if joiners:
            events += self._prefill(joiners)
        if self.prefilling:
            events += self._advance_prefill()
        self.steps += 1
        self.generated_tokens += len(events)
        return events

    def _cohort_may_join(self) -> bool:
        """Whether waiting requests join at this step (:func:`skipdecode.admission.may_join`: no
        row runs, or the cohort and alignment rules let them)."""
        waited = self.steps - self._queued_at.get(id(self.waiting[0]), self.steps) if self.waiting else 0
        return may_join(len(self.free_slots), len(self.waiting), [r.step for r in self.running],
                        self.cohort_size, self.align_steps, waited)

    def _fits(self, joiners: list[Request]) -> bool:
        """Whether ``joiners`` may join under ``max_cache_bytes`` (:func:`~skipdecode.kv_budget.admits`)."""
        if self.max_cache_bytes is None:
            return True
        return admits(self.cache, self._position_bytes, self.max_cache_bytes, self._held(), self.free_slots, joiners)

    def _held(self) -> list[tuple[Request, int]]:
        """``(request, slot)`` of every row holding a slot: running, or in a chunked prefill."""
        return ([(r.request, r.slot) for r in self.running] + [(p.request, p.slot) for p in self.prefilling]
                + [t for p in self.prefilling for t in p.twins])

    @property
    def planned_cache_bytes(self) -> int:
        """Bytes the slot cache's buffers are planned to reach for the rows held now, each at its
        longest history (what ``max_cache_bytes`` admission counts; :mod:`skipdecode.kv_budget`)."""
        return planned_bytes(self.cache, self._position_bytes, self._held())

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        self.waiting = deque(r for r in self.waiting if id(r) not in self._cancelled)
        for key in self._cancelled:
            self._queued_at.pop(key, None)
        for row in [r for r in self.running if id(r.request) in self._cancelled]:
            row.finished, row.reason = True, "cancelled"
            self._release(row)
        for part in list(self.prefilling):  # slots of a chunked prefill were never loaded
            for r, slot in [t for t in part.twins if id(t[0]) in self._cancelled]:
                part.twins.remove((r, slot))
                heapq.heappush(self.free_slots, slot)
            if id(part.request) in self._cancelled:
                heapq.heappush(self.free_slots, part.slot)
                if part.twins:  # a twin carries the prefill on
                    part.request, part.slot = part.twins.pop(0)
                else:
                    self.prefilling.remove(part)
        self._cancelled.clear()

    def _release(self, row: Row) -> None:
        self.running.remove(row)
        self.cache.free(row.slot)
        heapq.heappush(self.free_slots, row.slot)

    def _prefill(self, joiners: list[Request]) -> list[TokenEvent]:
        """Full-depth prefill of ``joiners`` into free slots (taken in joiner order), each prompt
        after the stored prefix it starts with (none: the whole prompt), in left-padded batches of
        similar remaining lengths (:func:`length_buckets`) whatever prefix each row starts from
        (:func:`~skipdecode.prefix_cache.prefix_skip_cache`), after prefilling once the prefixes
        that several of them share when that computes fewer tokens
        (:meth:`_prefill_shared_prefixes`); then store newly shared prefixes.
        Joiners with the same prompt (a request's ``n`` choices) are prefilled once: the others'
        slots get a copy (:meth:`~skipdecode.cache.SlotCache.copy_slot`) and the same logits.
        With ``prefill_chunk_tokens`` C, a joiner with more than C tokens left to compute starts
        a chunked prefill instead (:attr:`prefilling`, its twins with it) and emits nothing yet."""
        start = time.perf_counter()
        slots = [heapq.heappop(self.free_slots) for _ in joiners]
        first: dict[tuple[int, ...], int] = {}
        leader = [first.setdefault(tuple(r.prompt_ids), i) for i, r in enumerate(joiners)]
        twins: dict[int, list[int]] = {i: [] for i in first.values()}
        for j, i in enumerate(leader):
            if i != j:
                twins[i].append(j)
        pc = self.prefix_cache
        if pc is not None:
            self._reuse_recent_prefixes([joiners[i] for i in twins])  # twins share their leader's
        matches = {i: pc.lookup(joiners[i].prompt_ids) if pc is not None else (None, 0) for i in twins}
        C = self.prefill_chunk_tokens
        whole = [i for i in twins if not C or len(joiners[i].prompt_ids) - matches[i][1] <= C]
        for i in sorted(set(twins) - set(whole)):
            entry = matches[i][0]
            if entry is not None:
                entry.hits += 1
            part = start_partial(self.adapter, joiners[i], slots[i], entry, start)
            part.twins = [(joiners[j], slots[j]) for j in twins[i]]
            self.prefilling.append(part)
        if not whole:
            self._count_prefill(start)
            return []
        if pc is not None and len(whole) > 1 and self._prefill_shared_prefixes(
                [joiners[i].prompt_ids for i in whole], [matches[i][1] for i in whole]):
            matches.update({i: pc.lookup(joiners[i].prompt_ids) for i in whole})
        batches = length_buckets([len(joiners[i].prompt_ids) - matches[i][1] for i in whole])
        logits: dict[int, torch.Tensor] = {}
        for idx in batches:
            group = [whole[k] for k in idx]
            out = self._prefill_group([joiners[i] for i in group], [slots[i] for i in group],
                                      [matches[i][0] for i in group])
            for k, i in enumerate(group):
                logits[i] = out[k]
                for j in twins[i]:
                    self.cache.copy_slot(slots[i], slots[j])
        rows = sorted(whole + [j for i in whole for j in twins[i]])
        cached = [matches[i][1] if i in twins else len(joiners[i].prompt_ids) for i in rows]
        return self._join([joiners[i] for i in rows], [slots[i] for i in rows], cached,
                          torch.stack([logits[leader[i]] for i in rows]), start)

    def _advance_prefill(self) -> list[TokenEvent]:
        """Run the next chunk of the oldest chunked prefill; when it was the last, load the
        prompt's K/V into the request's slot (and its twins'), and join them to the running rows
        (their token 0)."""
        start = time.perf_counter()
        part = self.prefilling[0]
        logits = run_chunk(self.adapter, part, self.prefill_chunk_tokens, self.device)
        if logits is None:
            part.seconds += self._count_prefill(start)
            return []
        self.prefilling.popleft()
        P = len(part.request.prompt_ids)
        self.cache.load_prefill(part.slot, part.cache, 0, 0, P)
        for _, slot in part.twins:
            self.cache.copy_slot(part.slot, slot)
        reqs = [part.request] + [r for r, _ in part.twins]
        return self._join(reqs, [part.slot] + [s for _, s in part.twins], [part.cached] + [P] * len(part.twins),
                          logits.expand(len(reqs), -1), start, part.started)

    def _count_prefill(self, start: float) -> float:
        """Add the time since ``start`` to the engine's prefill time; return it (s)."""
        seconds = time.perf_counter() - start
        self.prefill_seconds += seconds
        return seconds

    def _join(self, reqs: list[Request], slots: list[int], cached: list[int], logits: torch.Tensor,
              start: float, admitted: float | None = None) -> list[TokenEvent]:
        """Make running rows of prefilled ``reqs`` (in ``slots``, ``cached`` prompt tokens from the
        prefix cache each), store newly shared prefixes, and emit their token 0 from ``logits``
        (B, V). ``start``: when this step's prefill work began; ``admitted``: when a chunked
        prefill's request left the queue (its rows' ``prefill_seconds`` count from then, the
        decode steps between its chunks included; None: from ``start``), ``time.perf_counter()`` s."""
        rows = [
            Row(r, slot, len(r.prompt_ids), Sampler(r.sampling or SamplingParams(), device=self.device),
                joined_at=self.steps, cached_prompt_tokens=p)
            for r, slot, p in zip(reqs, slots, cached)
        ]
        if self.prefix_cache is not None:
            self._store_shared_prefixes(rows)
        seconds = self._count_prefill(start)
        for row in rows:
            row.prefill_seconds = seconds if admitted is None else time.perf_counter() - admitted
        self.running = sorted(self.running + rows, key=lambda row: row.slot)
        return self._emit(rows, logits, [self.adapter.num_layers] * len(rows), start)

    def _prefill_group(self, reqs: list[Request], slots: list[int],
                       entries: list[PrefixEntry | None]) -> torch.Tensor:
        """Prefill ``reqs`` at full depth, row i after its stored prefix ``entries[i]`` (p_i
        tokens; None: p_i = 0), and load them into ``slots``; returns their last logits (B, V)."""
        cache, logits, C, S, lens, ps = self._forward_prompts([r.prompt_ids for r in reqs], entries)
        for i, (slot, p) in enumerate(zip(slots, ps)):
            self.cache.load_prefill(slot, cache, i, C + S - lens[i], C + S, prefix=p, prefix_start=C - p)
        return logits

    def _forward_prompts(self, prompts: list[Sequence[int]], entries: list[PrefixEntry | None]):
        """The full-depth forward of a prefill batch: row i runs ``prompts[i]``'s tokens after its
        stored prefix ``entries[i]`` (p_i tokens), left-padded among the batch: columns
        ``[padding][prefix p_i][padding][own tokens]`` with C = max p_i prefix columns, mask
        ``[0]*(C - p_i) + [1]*p_i + [0]*pad + [1]*s_i``. Positions come from the mask, so they
        continue from p_i; the padding is masked out of attention. Returns ``(cache, logits, C,
        S, lens, ps)``: the batch's :class:`SkipCache` (row i's prefix in columns ``C - p_i : C``,
        its own tokens in ``C + S - lens[i] : C + S``), the last logits (B, V), C, S = max
        ``lens``, the own token counts ``lens`` and the prefix lengths ``ps``."""
        ps = [0 if e is None else e.length for e in entries]
        C = max(ps)
        lens = [len(ids) - p for ids, p in zip(prompts, ps)]
        S = max(lens)
        ids = torch.zeros((len(prompts), S), dtype=torch.long)
        mask = torch.zeros((len(prompts), C + S), dtype=torch.long)
        for i, (prompt, p) in enumerate(zip(prompts, ps)):
            ids[i, S - lens[i] :] = torch.as_tensor(list(prompt[p:]), dtype=torch.long)
            mask[i, C - p : C] = 1
            mask[i, C + S - lens[i] :] = 1
        if C == 0:
            cache = SkipCache(self.adapter.num_layers, capacity=S, prefill=True)
        else:
            cache = prefix_skip_cache(entries, capacity=C + S)
            for e in entries:
                if e is not None:
                    e.hits += 1
        with base_prefill(self.adapter.model):  # a decode-only skip adapter is off in the prefill
            logits = skip_forward(
                self.adapter, ids.to(self.device), mask.to(self.device), cache=cache, logits_last_only=True
            )[:, -1]
        return cache, logits, C, S, lens, ps

    def _prefill_shared_prefixes(self, prompts: list[Sequence[int]], matched: list[int]) -> bool:
        """Before a prefill batch: prefill once, in one forward, the prefixes that several of
        ``prompts`` share and no stored entry covers, when that computes fewer tokens
        (:func:`~skipdecode.prefill_buckets.shared_prefixes`; ``matched``: tokens each prompt
        takes from a stored entry now), and store them in the prefix cache. True if it did."""
        pc = self.prefix_cache
        prefixes = shared_prefixes(pc, prompts, matched)
        if not prefixes:
            return False
        cache, _, C, S, lens, ps = self._forward_prompts(prefixes, [pc.lookup(p)[0] for p in prefixes])
        for i, prefix in enumerate(prefixes):
            own = slice(C + S - lens[i], C + S)
            keys, values = [], []
            for k_buf, v_buf in zip(cache.keys, cache.values):
                keys.append(torch.cat([k_buf[i, :, C - ps[i] : C], k_buf[i, :, own]], dim=-2))
                values.append(torch.cat([v_buf[i, :, C - ps[i] : C], v_buf[i, :, own]], dim=-2))
            pc.store(prefix, keys, values)
        pc.computed_prompt_tokens += sum(lens)  # run for no request alone: counted here
        return True

    def _reuse_recent_prefixes(self, joiners: list[Request]) -> None:
        """Before a prefill: store the prefixes that joiners share with recent prompts whose slot
        still holds them (running, or freed and not reloaded), read from that slot, so that the
        joiners already reuse them."""
        pc = self.prefix_cache
        for r in joiners:
            n, source = pc.best_source(r.prompt_ids, lambda src: self.cache.loads[src[0]] == src[1])
            if n:
                pc.store(r.prompt_ids[:n], *self.cache.read(source[0], n))

    def _store_shared_prefixes(self, rows: list[Row]) -> None:
        """After a prefill: store each joined prompt's prefix shared with a recent prompt or another
        joiner (read from the row's own slot), then remember the prompts and count the reuse."""
        pc = self.prefix_cache
        prompts = [tuple(row.request.prompt_ids) for row in rows]
        recent = [tokens for tokens, _ in pc.recent]
        for i, (row, ids) in enumerate(zip(rows, prompts)):
            n = pc.wanted(ids, recent + prompts[:i] + prompts[i + 1 :])
            if n:
                pc.store(ids[:n], *self.cache.read(row.slot, n))
        for row, ids in zip(rows, prompts):
            pc.remember(ids, (row.slot, self.cache.loads[row.slot]))
            pc.record(row.cached_prompt_tokens, len(ids))

    def _decode(self) -> list[TokenEvent]:
        """One token for every running row, each through its own plan."""
        start = time.perf_counter()
        rows = list(self.running)
        L = self.adapter.num_layers
        positions = torch.tensor([r.length for r in rows], dtype=torch.long)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        K = int(positions.max()) + 1
        row_layers = torch.zeros((len(rows), L), dtype=torch.bool)
        counts = []
        for i, r in enumerate(rows):
            active = plan_layers(r.request.policy or FullPolicy(L), r.step + 1)
            row_layers[i, list(active)] = True
            counts.append(len(active))
        mask = (torch.arange(K)[None, :] <= positions[:, None]).long()
        tokens = torch.tensor([[r.tokens[-1]] for r in rows], dtype=torch.long)
        view = self.cache.view(slots, positions, K, slot_bound=max(r.slot for r in rows) + 1)
        with base_rows(self.adapter.model, row_layers.all(dim=1)):  # full-depth rows: the base model's weights
            logits = skip_forward(
                self.adapter, tokens.to(self.device), mask.to(self.device),
                row_layers=row_layers, cache=view,
            )[:, -1]
        for i, r in enumerate(rows):
            r.length += 1
            r.layers_run.append(counts[i])
        events = self._emit(rows, logits, counts, start)
        self.decode_seconds += time.perf_counter() - start
        self.decode_steps += 1
        return events

    def _emit(self, rows: list[Row], logits: torch.Tensor, counts: list[int], start: float) -> list[TokenEvent]:
        """Sample one token per row from ``logits`` (B, V), record it, end rows that are done."""
        tokens = self._sample(rows, logits)
        failed = {i for i, t in enumerate(tokens) if isinstance(t, BaseException)}
        logprobs = requested_logprobs([None if i in failed else r.request.logprobs for i, r in enumerate(rows)],
                                      logits, [0 if i in failed else t for i, t in enumerate(tokens)])
        events = []
        for i, (row, token) in enumerate(zip(rows, tokens)):
            if i in failed:  # isolate_failures: this row ends here, the others go on
                row.finished, row.reason = True, "error"
                self.failures.append((row, token))
                continue
            row.tokens.append(token)
            req = row.request
            if token in req.eos_token_ids:
                row.finished, row.reason = True, "eos"
            elif req.stop_fn is not None and req.stop_fn(row.tokens):
                row.finished, row.reason = True, "stop"
            elif len(row.tokens) >= req.max_new_tokens:
                row.finished, row.reason = True, "length"
            kept = logits[i].detach().clone() if self.keep_logits else None
            events.append(TokenEvent(row, row.step, token, counts[i], row.finished, kept, logprobs.get(i)))
        seconds = time.perf_counter() - start
        for row in rows:
            if row.step > 0:
                row.decode_seconds += seconds
                row.shared_rows += len(rows)
            if row.finished:
                self._release(row)
        return events

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[int | BaseException]:
        """Greedy rows without penalties by one argmax; the others each with their own sampler
        and history (prompt, then the row's tokens). With ``isolate_failures`` a row whose
        sampler raises gets the exception instead of a token (a failed greedy batch is redrawn
        row by row to find it); otherwise the exception propagates."""
        alone = [r.sampler.params.greedy and not r.sampler.params.penalized for r in rows]
        greedy = [i for i, a in enumerate(alone) if a]
        out: list[int | BaseException] = [0] * len(rows)
        if greedy:
            chosen = logits if len(greedy) == len(rows) else logits.index_select(0, torch.tensor(greedy, device=logits.device))
            try:
                for i, t in zip(greedy, rows[greedy[0]].sampler(chosen).tolist()):
                    out[i] = t
            except (RuntimeError, ValueError):
                if not self.isolate_failures:
                    raise
                alone = [False] * len(rows)  # find the failing rows one by one below
        for i, r in enumerate(rows):
            if not alone[i]:
                history = torch.tensor([list(r.request.prompt_ids) + r.tokens], device=logits.device)
                try:
                    out[i] = int(r.sampler(logits[i : i + 1], history, len(r.tokens))[0])
                except (RuntimeError, ValueError) as exc:
                    if not self.isolate_failures:
                        raise
                    out[i] = exc
        return out

    def run(self, requests: Sequence[Request], on_event: Callable[[TokenEvent], None] | None = None) -> list[Row]:
        """Submit ``requests`` and step until all end; return their :class:`Row` in request order.

        ``on_event`` is called with each :class:`TokenEvent`. Raises ValueError as :meth:`check`
        (before anything runs).
        """
        for r in requests:
            self.check(r)
        done: dict[int, Row] = {}
        for r in requests:
            self.submit(r)
        while self.busy:
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
                if ev.finished:
                    done[id(ev.row.request)] = ev.row
        return [done[id(r)] for r in requests]
