"""A row whose token cannot be drawn fails alone (Engine(isolate_failures=True), the scheduler and
the server): the other rows of the step go on with their own tokens, the failing request hears its
exception once and its other rows stop; a library call (isolate_failures off) still raises."""

from __future__ import annotations

import threading

import pytest

import skipdecode.engine as engine_module
from conftest import make_model
from skipdecode import get_adapter
from skipdecode.engine import Engine, Request
from skipdecode.sampling import Sampler, SamplingParams
from skipdecode.scheduler import Scheduler

FAIL_SEED = 666


class FailingSampler(Sampler):
    def __call__(self, *args, **kwargs):
        raise RuntimeError("NaN in logits: refusing to sample")


@pytest.fixture
def failing_seed(monkeypatch):
    """Rows sampled with seed FAIL_SEED get a sampler that raises (as NaN in their logits would)."""
    def make(params, device="cpu"):
        return (FailingSampler if params.seed == FAIL_SEED else Sampler)(params, device=device)

    monkeypatch.setattr(engine_module, "Sampler", make)


def _requests():
    bad = SamplingParams(temperature=1.0, seed=FAIL_SEED)
    return [Request([5, 9, 11], 6), Request([6, 7], 6, sampling=bad), Request([8, 9, 10, 12], 6)]


def _tokens(events, request) -> list[int]:
    return [ev.token for ev in events if ev.row.request is request]


def test_a_failing_row_ends_alone_and_the_others_keep_their_tokens(failing_seed):
    adapter = get_adapter(make_model("llama", 6))
    reqs = _requests()
    engine = Engine(adapter, 4, isolate_failures=True)
    for r in reqs:
        engine.submit(r)
    events = []
    while engine.busy:
        events += engine.step()
    assert [(row.request, row.reason, type(exc)) for row, exc in engine.failures] == [(reqs[1], "error", RuntimeError)]
    assert _tokens(events, reqs[1]) == [] and sorted(engine.free_slots) == [0, 1, 2, 3]
    solo = Engine(adapter, 4)
    for r in (reqs[0], reqs[2]):
        solo.submit(r)
    ref = []
    while solo.busy:
        ref += solo.step()
    for r in (reqs[0], reqs[2]):
        assert _tokens(events, r) == _tokens(ref, r) and len(_tokens(events, r)) == 6


def test_without_isolation_the_step_raises(failing_seed):
    engine = Engine(get_adapter(make_model("llama", 6)), 4)
    for r in _requests():
        engine.submit(r)
    with pytest.raises(RuntimeError, match="NaN in logits"):
        while engine.busy:
            engine.step()


def test_nan_in_one_greedy_row_fails_that_row_only():
    """The greedy rows share one argmax; when it refuses (NaN), each row is drawn alone to find
    the failing one."""
    adapter = get_adapter(make_model("llama", 6))
    reqs = [Request([5, 9, 11], 5), Request([6, 7], 5), Request([8, 9, 10, 12], 5)]
    engine = Engine(adapter, 4, isolate_failures=True)
    for r in reqs:
        engine.submit(r)
    events = engine.step()  # the prefill: token 0 of each
    real_head = adapter.head

    def nan_in_row_1_once(hidden):
        out = real_head(hidden)
        adapter.head = real_head  # one step only
        out[1] = float("nan")
        return out

    adapter.head = nan_in_row_1_once
    while engine.busy:
        events += engine.step()
    assert [(row.request, row.reason) for row, _ in engine.failures] == [(reqs[1], "error")]
    assert [len(_tokens(events, r)) for r in reqs] == [5, 1, 5]


def test_the_scheduler_gives_the_exception_to_its_caller_only_and_stops_its_other_rows(failing_seed):
    adapter = get_adapter(make_model("llama", 6))
    sched = Scheduler(adapter, max_batch_size=4)
    got = {"ok": [], "bad": []}
    done = threading.Event()

    def sink(name):
        def put(item):
            got[name].append(item)
            if name == "ok" and getattr(item, "finished", False):
                done.set()
        return put

    ok, (a, b, c) = Request([5, 9, 11], 30), _requests()
    b.max_new_tokens = c.max_new_tokens = 30
    sched.submit([b, c], sink("bad"))  # one caller's two rows, the first of which fails
    sched.submit([ok], sink("ok"))
    try:
        assert done.wait(60)
    finally:
        sched.close()
    assert [type(x) for x in got["bad"] if isinstance(x, BaseException)] == [RuntimeError]
    assert isinstance(got["bad"][-1], RuntimeError)  # nothing after the exception
    assert len([ev for ev in got["bad"] if not isinstance(ev, BaseException)]) < 30  # c stopped early
    assert [ev.step for ev in got["ok"]] == list(range(30))
