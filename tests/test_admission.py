"""Age-aligned admission (skipdecode.admission, Engine(align_steps=...), serve --align-steps):
waiting requests wait, at most ``align_steps`` engine steps, while every running row is older,
then join together; answers are unchanged."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, make_tokenizer
from test_cli_outputs import saved  # noqa: F401  (a tiny llama checkpoint, a fixture)
from test_cli_outputs import _run as cli
from skipdecode import SkipModel, get_adapter
from skipdecode.admission import SERVE_ALIGN_STEPS, check_align_steps, may_join
from skipdecode.engine import Engine, Request
from test_inflight import L, POLICIES, prompt, solo


def test_may_join_rules():
    assert not may_join(4, 0, [1, 2])  # nobody waits
    assert may_join(0, 3, [])  # no row runs: join whatever the rules
    assert may_join(1, 1, [9, 9])  # off: as they come
    assert not may_join(1, 1, [9, 9], align_steps=4, oldest_waited=3)  # all rows older than 4: wait
    assert may_join(1, 1, [9, 9], align_steps=4, oldest_waited=4)  # waited 4 steps: join
    assert may_join(1, 1, [9, 4], align_steps=4)  # a row at most 4 steps old: a wave is forming
    assert not may_join(1, 2, [1], cohort_size=2)  # the cohort rule still holds
    assert not may_join(1, 2, [1], cohort_size=2, align_steps=4, oldest_waited=9)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_align_steps_must_be_a_count(bad):
    with pytest.raises(ValueError, match="align_steps must be an integer >= 0"):
        check_align_steps(bad)
    with pytest.raises(ValueError, match="align_steps"):
        Engine(get_adapter(make_model("llama", L)), 4, align_steps=bad)


def _join_step(align_steps: int):
    """Engine steps after its submission at which a request B joins a row A that is 4 steps old,
    and both answers."""
    adapter = get_adapter(make_model("llama", L))
    eng = Engine(adapter, max_batch_size=4, align_steps=align_steps)
    a = Request(prompt(5, 1), 12, POLICIES[1])
    b = Request(prompt(4, 2), 6, POLICIES[2])
    eng.submit(a)
    got = {id(a): [], id(b): []}
    for _ in range(5):  # prefill (token 0), then 4 decode steps: A is 4 steps old
        for ev in eng.step():
            got[id(ev.row.request)].append(ev.token)
    eng.submit(b)
    joined = None
    k = 0
    while eng.busy:
        k += 1
        for ev in eng.step():
            got[id(ev.row.request)].append(ev.token)
            if ev.row.request is b and ev.step == 0:
                joined = k
    return joined, got[id(a)], got[id(b)], adapter, a, b


def test_aligned_request_waits_at_most_align_steps_and_answers_are_unchanged():
    joined, toks_a, toks_b, adapter, a, b = _join_step(align_steps=2)
    assert joined == 3  # waited 2 steps (A is older than 2), joined at the third
    assert _join_step(align_steps=0)[0] == 1  # off: the next step
    assert _join_step(align_steps=6)[0] == 1  # A (4 steps old) is young enough: at once
    for req, toks in ((a, toks_a), (b, toks_b)):
        assert toks == solo(adapter, list(req.prompt_ids), req.policy, req.max_new_tokens)[0]


def test_serve_refuses_bad_align_steps():
    from typer.testing import CliRunner

    from skipdecode.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["serve", "--align-steps", "-1"])
    assert bad.exit_code == 2 and "--align-steps must be >= 0, got -1" in bad.output
    serial = runner.invoke(app, ["serve", "--align-steps", "2", "--serial"])
    assert serial.exit_code == 2 and "--align-steps applies to in-flight batching" in serial.output


def test_serve_aligns_by_default_and_not_when_serial(saved, monkeypatch):  # noqa: F811
    """`serve` passes align_steps 8 unless told otherwise (0 with --serial, or as given);
    create_app's own default is the same and a serial app's engine never holds."""
    import skipdecode.server as server_module
    from test_server_loopback import free_port

    seen = []
    real = server_module.create_app

    def spy(*a, **kw):
        seen.append(kw["align_steps"])
        raise RuntimeError("stop here")
    monkeypatch.setattr(server_module, "create_app", spy)
    for extra in ([], ["--serial"], ["--align-steps", "0"], ["--align-steps", "3"]):
        cli(["serve", "--model", str(saved), "--port", str(free_port()), *extra])
    assert seen == [SERVE_ALIGN_STEPS, 0, 0, 3] and SERVE_ALIGN_STEPS == 8
    sk = SkipModel(make_model("llama", L), make_tokenizer())
    for kw, want in (({}, SERVE_ALIGN_STEPS), ({"serial": True}, 0)):
        scheduler = real(sk, **kw).state.scheduler
        try:
            assert scheduler.engine.align_steps == want
        finally:
            scheduler.close()
