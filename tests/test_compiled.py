"""The compiled decode step (skipdecode.compiled): equal to eager, bounded variants, clean fallback.

The fast tests use dynamo with the ``aot_eager`` backend (the same graph capture, cache write
traced into the layer's graph, and guards as inductor, without generating C++); the inductor tests compile real
kernels (about 10-30 s each on this CPU) and are marked slow, except one float32 Llama check.
"""

from __future__ import annotations

import pytest
import torch

from skipdecode.compiled import CompileReport, compile_adapter, warm_up
from skipdecode.generate import encode_prompts, generate_step
from skipdecode import get_adapter
from skipdecode.model import SkipModel
from skipdecode.quantize import quantize_model

from conftest import make_model

PROMPTS = ["The Eagle is a", "Summarize the article. The quick brown fox"]


def _run(sk, policy, new_tokens=8):
    ids, mask = encode_prompts(sk.tokenizer, PROMPTS)
    outs = list(generate_step(sk.adapter, ids, mask, policy=policy, max_new_tokens=new_tokens))
    return torch.stack([o.logits for o in outs]), torch.stack([o.tokens for o in outs])


def assert_equal_runs(eager, compiled, run=_run, horizon=6, atol=1e-5):
    """``compiled`` gives ``eager``'s greedy tokens and its logits to ``atol``, at full depth and
    under a 2x policy over ``horizon`` tokens (``run(sk, policy) -> (logits, tokens)``)."""
    for policy in (None, eager.policy_for(speedup=2.0, horizon=horizon)):
        le, te = run(eager, policy)
        lc, tc = run(compiled, policy)
        assert torch.equal(te, tc)
        assert (le - lc).abs().max().item() <= atol


def _check_equal(family, tokenizer, backend, quantize=None, atol=1e-5, weight_left=False):
    """Compiled (``backend``) against eager, logits to ``atol`` and tokens equal; with
    ``weight_left`` the compiled model's linears compute as :func:`skipdecode.load` makes them
    (weight-first products, skipdecode.layout) and the eager one keeps plain ``nn.Linear``."""
    torch._dynamo.reset()
    build = lambda: quantize_model(make_model(family), quantize) if quantize else make_model(family)  # noqa: E731
    eager = SkipModel(build(), tokenizer)
    compiled = SkipModel(build(), tokenizer)
    if weight_left:
        from skipdecode.layout import weight_left as relayout

        assert relayout(compiled.model) > 0
    report = compile_adapter(compiled.adapter, backend=backend)
    assert report.enabled and report.error == ""
    warm_up(compiled, report, (2,))
    assert report.compile_seconds > 0 and report.warmed_batch_sizes == [2]
    assert_equal_runs(eager, compiled, atol=atol)
    assert report.enabled, report.error  # no silent fallback happened
    return report


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt_proj"])
def test_compiled_equals_eager_aot(family, tokenizer):
    _check_equal(family, tokenizer, "aot_eager")


def test_compiled_int4_layers_equal_eager_aot(tokenizer):
    """int4 (PyTorch's kernel, what compile=True now compiles by layers) inside the layer graphs
    equals eager int4 to 1e-5, tokens equal."""
    _check_equal("llama", tokenizer, "aot_eager", "int4")


def test_compiled_inductor_equals_eager_llama(tokenizer):
    _check_equal("llama", tokenizer, "inductor")


def test_compiled_inductor_on_weight_first_products_equals_plain_eager(tokenizer):
    _check_equal("llama", tokenizer, "inductor", weight_left=True)


@pytest.mark.slow
@pytest.mark.parametrize("family,quantize", [("gpt2", None), ("opt", None), ("llama", "int8"), ("qwen2", "int4")])
def test_compiled_inductor_equals_eager_slow(family, quantize, tokenizer):
    _check_equal(family, tokenizer, "inductor", quantize)


def test_compile_failure_falls_back_to_eager(tokenizer):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C compiler here")

    torch._dynamo.reset()
    ref_logits, ref_tokens = _run(SkipModel(make_model("llama"), tokenizer), None)
    sk = SkipModel(make_model("llama"), tokenizer)
    report = compile_adapter(sk.adapter, backend=broken_backend)
    logits, tokens = _run(sk, None)
    assert not report.enabled and "no C compiler here" in report.error
    assert torch.equal(tokens, ref_tokens) and torch.allclose(logits, ref_logits, atol=1e-6)
    # the cache write of the failed call was undone: a second generation is still exact
    logits2, _ = _run(sk, None)
    assert torch.allclose(logits2, ref_logits, atol=1e-6)


def test_compile_unavailable_reported(monkeypatch, tokenizer):
    import skipdecode.compiled as C

    monkeypatch.setattr(C, "compile_available", lambda: (False, "InvalidCxxCompiler: no working C++ compiler"))
    sk = SkipModel(make_model("llama"), tokenizer)
    report = compile_adapter(sk.adapter)
    assert report == CompileReport(enabled=False, error="InvalidCxxCompiler: no working C++ compiler")
    assert sk.adapter.compiled_layer_call is None
    assert warm_up(sk, report).compile_seconds == 0.0


def _kernels_equal(family, tokenizer, quantize):
    eager = SkipModel(quantize_model(make_model(family), quantize), tokenizer)
    compiled = SkipModel(quantize_model(make_model(family), quantize), tokenizer)
    report = warm_up(compiled, compile_adapter(compiled.adapter, mode="kernels"), (2,))
    assert report.enabled and report.mode == "kernels", report.error
    assert_equal_runs(eager, compiled)
    assert report.enabled, report.error


def test_compiled_kernels_int8_equal_eager(tokenizer):
    """Mode "kernels": the fused int8 products (inductor) equal the eager int8 kernels to 1e-5."""
    _kernels_equal("llama", tokenizer, "int8")


@pytest.mark.slow
@pytest.mark.parametrize("family,quantize", [("gpt2", "int8"), ("opt_proj", "int4"), ("qwen2", "int4")])
def test_compiled_kernels_equal_eager_slow(family, quantize, tokenizer):
    _kernels_equal(family, tokenizer, quantize)


def test_compile_mode_checks(tokenizer):
    from skipdecode.compiled import resolve_mode

    sk = SkipModel(make_model("llama"), tokenizer)
    assert resolve_mode(sk.adapter, "auto") == "layers"
    assert resolve_mode(SkipModel(quantize_model(make_model("llama"), "int8"), tokenizer).adapter, "auto") == "kernels"
    assert resolve_mode(SkipModel(quantize_model(make_model("llama"), "int4"), tokenizer).adapter, "auto") == "layers"
    with pytest.raises(ValueError, match="compile must be True, False or one of auto, kernels, layers"):
        resolve_mode(sk.adapter, "fast")
    assert resolve_mode(SkipModel(quantize_model(make_model("llama"), "w8a8"), tokenizer).adapter, "auto") == "layers"
    with pytest.raises(ValueError, match="needs weight-only quantized weights"):
        compile_adapter(sk.adapter, mode="kernels")
    with pytest.raises(ValueError, match="needs weight-only quantized weights"):
        compile_adapter(SkipModel(quantize_model(make_model("llama"), "w8a8"), tokenizer).adapter, mode="kernels")
    from skipdecode.loading import LoadError, load

    with pytest.raises(LoadError, match="compile='kernels' needs quantize"):
        load("/nonexistent", compile="kernels")
    with pytest.raises(LoadError, match="compile must be True, False or one of"):
        load("/nonexistent", compile="fast")


def test_compiled_kernel_failure_falls_back(monkeypatch, tokenizer):
    import skipdecode.quantize as Q

    def broken(*args):
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler")

    monkeypatch.setitem(Q._KERNEL_STATE, "int8", broken)
    monkeypatch.setitem(Q._KERNEL_STATE, "error", "")
    ref = _run(SkipModel(quantize_model(make_model("llama"), "int8"), tokenizer), None)
    sk = SkipModel(quantize_model(make_model("llama"), "int8"), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, mode="kernels"), (1,))
    assert not report.enabled and "no working C++ compiler" in report.error
    logits, tokens = _run(sk, None)
    assert torch.equal(tokens, ref[1]) and torch.allclose(logits, ref[0], atol=1e-6)


def _inflight(adapter, min_prompt=1):
    """Six requests joining at different steps with mixed policies, in flight (tests/test_inflight.py);
    prompts of at least ``min_prompt`` tokens (>= 2: the first one-token layer call is a decode step)."""
    from test_inflight import CASES, POLICIES, prompt, run_inflight

    from skipdecode.engine import Request

    reqs = [Request(prompt(max(n, min_prompt), 40 + i), m, POLICIES[p]) for i, (n, p, m, _) in enumerate(CASES)]
    eng, results = run_inflight(adapter, reqs, [c[3] for c in CASES], max_batch_size=4)
    return eng, results


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_inflight_steps_equal_eager(backend):
    """In-flight steps (a SlotView cache, rows of different ages and plans, each layer on a
    subset of rows) run through the compiled layer call and equal the eager engine: tokens, and
    logits to 1e-5 in float32. (The compiled call once read per-layer lengths off the cache and
    crashed on a SlotView: `generate --compile` with two prompts.)"""
    from test_inflight import L

    torch._dynamo.reset()
    eager = get_adapter(make_model("llama", L))
    compiled = get_adapter(make_model("llama", L))
    report = compile_adapter(compiled, backend=backend)
    assert report.enabled, report.error
    _, want = _inflight(eager)
    eng, got = _inflight(compiled)
    assert report.enabled, report.error  # no silent fallback to eager
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-5
    assert not eng.running and eng.cache.lengths.sum().item() == 0  # every slot freed


def test_inflight_rows_in_the_first_slots_read_their_keys_in_place():
    """Rows that are slots 0..B-1 in order get a decode graph that reads the slot buffers in
    place (no gather of keys and values); once the middle row ends (slots 0 and 2) the graph
    gathers them; tokens and logits equal the eager engine's either way."""
    from skipdecode.engine import Engine, Request

    def run(adapter):
        engine = Engine(adapter, max_batch_size=3, keep_logits=True, prefix_cache=False)
        reqs = [Request(list(range(5, 9 + i)), max_new_tokens=3 if i == 1 else 8) for i in range(3)]
        logits = {id(r): [] for r in reqs}
        rows = engine.run(reqs, on_event=lambda ev: logits[id(ev.row.request)].append(ev.logits))
        return [(row.tokens, torch.stack(logits[id(r)])) for row, r in zip(rows, reqs)]

    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes})
        return gm.forward

    torch._dynamo.reset()
    want = run(get_adapter(make_model("llama", 4)))
    adapter = get_adapter(make_model("llama", 4))
    report = compile_adapter(adapter, backend=recording)
    got = run(adapter)
    assert report.enabled, report.error
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks and torch.allclose(logits, want_logits, atol=1e-5, rtol=0)
    steps = [g for g in graphs if any("setitem" in t for t in g)]  # decode graphs write rows by index
    assert any(not any("index_select" in t for t in g) for g in steps)  # slots 0..2: in place
    assert any(any("index_select" in t for t in g) for g in steps)  # slots 0 and 2: gathered


def test_compile_failure_in_flight_falls_back_and_undoes_the_cache_write():
    """A backend that fails on the layer's graph (attention, and the cache write traced inside it)
    at the first in-flight decode step (a SlotView): the engine falls back to eager, the failed
    call's (layer, slot) lengths stay as they were, and the answers are exact."""
    from test_inflight import L

    def attention_fails(gm, example_inputs):
        # SDPA (a prefill) or the grouped products' softmax (a decode step, skipdecode.decode_attention:
        # its max and exponent, compiled)
        if any(k in str(node.target) for node in gm.graph.nodes for k in ("scaled_dot_product", "softmax", "amax")):
            raise RuntimeError("no C compiler here")
        return gm.forward

    torch._dynamo.reset()
    _, want = _inflight(get_adapter(make_model("llama", L)), min_prompt=2)
    adapter = get_adapter(make_model("llama", L))
    report = compile_adapter(adapter, backend=attention_fails)
    _, got = _inflight(adapter, min_prompt=2)
    assert not report.enabled and "no C compiler here" in report.error
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-6


def test_warm_up_compiles_every_variant_once_without_graph_breaks(tokenizer):
    """After :func:`warm_up` at batch 1 and 2 (what ``load(compile=True)`` runs):

    - static generations under four policies and in-flight steps of three rows joining at
      different steps with different policies compile nothing new, so no compile time lands
      inside timed steps (`generate "a" "b" --compile` once recompiled there), and the graph
      count is bounded by the layers, not by the policies;
    - no call breaks its graph: the cache write is traced into the layer's graph
      (skipdecode.compiled._TracedWrite), so each decoder-layer call is one compiled region (a
      break inside the attention once cost a resumed region, and its guards, for every frame
      above it: about 7 regions per layer).

    (One warm-up for the three checks: each warm-up takes about 20 s.)"""
    from torch._dynamo.utils import counters

    from skipdecode.engine import Engine, Request

    torch._dynamo.reset()
    counters.clear()
    layers = 8
    sk = SkipModel(make_model("llama", num_layers=layers), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    after_warm = counters["stats"]["unique_graphs"]
    assert report.enabled, report.error
    assert 0 < after_warm <= 3 * layers, after_warm  # 16 at 4 layers and at 8 (2026-12-05)
    for s in (1.5, 2.0, 3.0, 4.0):
        _run(sk, sk.policy_for(speedup=s, horizon=5), new_tokens=10)
    engine = Engine(sk.adapter, max_batch_size=4)
    plans = [sk.policy_for(speedup=2.0, horizon=5), None, sk.policy_for(speedup=3.0, horizon=4)]
    for i, policy in enumerate(plans):
        engine.submit(Request(list(range(5, 9 + 2 * i)), max_new_tokens=7, policy=policy))
        engine.step()
        engine.step()
    while engine.busy:
        engine.step()
    assert counters["stats"]["unique_graphs"] == after_warm
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_decode_write_targets():
    """Where a compiled decode step writes: a SkipCache layer grows when full and reports the key
    length after the write; a SlotView hands over the slot buffers and its slots and positions;
    nothing changes the lengths until commit_decode_write."""
    from skipdecode.cache import SkipCache, SlotCache

    cache = SkipCache(num_layers=2, capacity=3)
    kv = torch.randn(2, 1, 3, 4)
    cache.update(kv, kv, 0)
    write = cache.decode_write(0, rows=2)
    assert write.keys.shape[2] > 3 and write.key_length == 4 and write.positions is None
    assert torch.equal(write.keys[:, :, :3], kv) and cache.lengths == [3, 0]
    cache.commit_decode_write(0, write)
    assert cache.lengths == [4, 0]
    assert cache.decode_write(1, rows=2) is None  # no buffer yet: the eager write
    assert cache.decode_write(0, rows=1) is None  # another batch size
    # a prefill of 5 tokens into an empty layer: buffers made from the (1, H_kv, 1, D) geometry
    like = (torch.zeros(1, 1, 1, 4, dtype=torch.float64), torch.zeros(1, 1, 1, 4, dtype=torch.float64))
    write = cache.decode_write(1, rows=2, new_tokens=5, like=like)
    assert write.keys.shape == (2, 1, 5, 4) and write.keys.dtype == torch.float64 and write.key_length == 5
    assert cache.lengths == [4, 0]
    assert cache.decode_write(0, rows=2, new_tokens=9).key_length == 13  # after 4 cached: grown to hold 13
    assert cache.keys[0].shape[2] >= 13 and torch.equal(cache.keys[0][:, :, :3], kv)

    slots = SlotCache(num_layers=1, num_slots=4, capacity=4)
    prefill = SkipCache(num_layers=1)
    prefill.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), 0)
    for slot in range(4):
        slots.load_prefill(slot, prefill, 0, 0, 2)
    view = slots.view(torch.tensor([1, 2]), torch.tensor([2, 2]), key_length=3)
    write = view.decode_write(0, rows=2)  # consecutive slots not from 0: gathered (no view per offset)
    assert torch.equal(write.slots, torch.tensor([1, 2])) and write.keys is slots.keys[0]
    assert torch.equal(write.positions, torch.tensor([2, 2])) and write.key_length == 3
    gathered = slots.view(torch.tensor([3, 0]), torch.tensor([2, 2]), key_length=3).decode_write(0, rows=2)
    assert torch.equal(gathered.slots, torch.tensor([3, 0])) and gathered.keys is slots.keys[0]
    for order in ([1, 0], [0, 1, 3]):  # not slots 0..B-1 in order: gathered too
        assert not slots.view(torch.tensor(order), torch.tensor([2] * len(order)), key_length=3).leading
    lead = slots.view(torch.tensor([0, 1]), torch.tensor([2, 1]), key_length=3).decode_write(0, rows=2)
    assert lead.slots is None and lead.keys.shape[0] == 2 and lead.keys.data_ptr() == slots.keys[0].data_ptr()
    assert torch.equal(lead.positions, torch.tensor([2, 1])) and lead.values.shape == lead.keys.shape
    assert slots.lengths[0].tolist() == [2, 2, 2, 2]
    view.commit_decode_write(0, write)
    assert slots.lengths[0].tolist() == [2, 3, 3, 2]


def run_waves(engine, waves, max_new_tokens=3):
    """Submit each wave of prompts (lists of token ids) to ``engine`` together and step until
    they end (greedy, full depth); returns each row's (tokens, first logits: the prefill's), in
    submission order. ``engine`` needs ``keep_logits=True``."""
    from skipdecode.engine import Request

    out = []
    for wave in waves:
        reqs = [Request(list(p), max_new_tokens=max_new_tokens) for p in wave]
        first, rows = {}, {}
        for r in reqs:
            engine.submit(r)
        while engine.busy:
            for ev in engine.step():
                first.setdefault(id(ev.row.request), ev.logits)
                rows[id(ev.row.request)] = ev.row
        out += [(list(rows[id(r)].tokens), first[id(r)]) for r in reqs]
    return out


def _prefill_engine(adapter):
    """Rows joining in groups of 1, 3 and 2, their prompts sharing a 12-token prefix (the second
    and third groups prefill after the stored prefix), greedy, full depth; returns the engine and
    each row's tokens and first logits (the prefill's)."""
    from skipdecode.engine import Engine

    engine = Engine(adapter, max_batch_size=4, keep_logits=True)
    shared = list(range(5, 17))
    groups = ([[20, 21]], [[22], [23, 24, 25], [26, 27]], [[28, 29, 30, 31], [32]])
    return engine, run_waves(engine, [[shared + tail for tail in group] for group in groups])


def _burst_engine(adapter):
    """Three distinct prompts (5, 9 and 7 tokens) joining at once with no prefix stored, then two
    more, then one-token prompts alone and two at once; greedy, full depth; returns the engine and
    each row's tokens and first logits."""
    from skipdecode.engine import Engine

    engine = Engine(adapter, max_batch_size=4, keep_logits=True, prefix_cache=False)
    waves = ([list(range(40, 45)), list(range(50, 59)), list(range(60, 67))], [[70, 71, 72], [80, 81, 82]],
             [[90]], [[91], [92]])
    return engine, run_waves(engine, waves)


def test_compiled_prefill_equals_eager_and_compiles_nothing_new(tokenizer):
    """Prefills run compiled (skipdecode.compiled._prefill_layer: the cache write in the graph,
    prompt length, key length, batch and capacity symbolic): after the warm-up, prefills of 1 to 3
    rows with new lengths, after a stored prefix or not (several distinct prompts from an empty
    cache too: a burst of new requests once compiled for 1.5 s inside a server's timed cell; and
    one-token prompts, alone, two at once and in a static generation), compile no new graph and
    break none, and every row's
    first logits (the prefill's) and tokens equal the eager engine's (1e-5, float32)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from skipdecode import compiled as C

    torch._dynamo.reset()
    counters.clear()
    eager = SkipModel(make_model("llama", num_layers=6), tokenizer)
    sk = SkipModel(make_model("llama", num_layers=6), tokenizer)
    report = warm_up(sk, compile_adapter(sk.adapter, backend="aot_eager"), (1, 2))
    assert report.prefill and len(_debug_get_cache_entry_list(C._prefill_layer)) > 0
    after_warm = counters["stats"]["unique_graphs"]
    _, want = _prefill_engine(eager.adapter)
    engine, got = _prefill_engine(sk.adapter)
    assert engine.prefix_cache.stats()["cached_prompt_tokens"] > 0  # some prefills ran after a stored prefix
    # several distinct prompts with nothing stored, joining at one step (a server's burst of new
    # requests; the warm-up's equal prompts are prefilled once, as twins, so it must use distinct ones)
    _, want_burst = _burst_engine(eager.adapter)
    _, got_burst = _burst_engine(sk.adapter)
    # a one-token prompt in a static generation (a decode write once found no buffers there and
    # fell back to an eager write that broke each layer's graph)
    one = torch.tensor([[7]]), torch.ones(1, 1, dtype=torch.long)
    want_one = [o.logits for o in generate_step(eager.adapter, *one, max_new_tokens=3)]
    got_one = [o.logits for o in generate_step(sk.adapter, *one, max_new_tokens=3)]
    assert counters["stats"]["unique_graphs"] == after_warm
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert all((a - b).abs().max().item() <= 1e-5 for a, b in zip(got_one, want_one))
    got, want = got + got_burst, want + want_burst
    assert report.enabled and report.prefill and report.prefill_error == ""
    for (toks, logits), (want_toks, want_logits) in zip(got, want):
        assert toks == want_toks
        assert (logits - want_logits).abs().max().item() <= 1e-5


def test_prefill_compile_failure_keeps_the_decode_steps_compiled(tokenizer):
    """A backend that fails on prefill graphs (a 3-d input with more than one position) turns
    compiled prefill off, says why, reruns that call eagerly, and leaves the decode steps
    compiled; the answers equal eager's (1e-5: the decode steps are compiled)."""

    def prefill_fails(gm, example_inputs):
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.ndim == 3 and value.shape[1] != 1:
                raise RuntimeError("no prefill kernels here")
        return gm.forward

    torch._dynamo.reset()
    ref_logits, ref_tokens = _run(SkipModel(make_model("llama"), tokenizer), None)
    sk = SkipModel(make_model("llama"), tokenizer)
    report = compile_adapter(sk.adapter, backend=prefill_fails)
    _run(sk, None)  # the first prefill runs eagerly and teaches each layer's K/V geometry
    assert report.prefill
    logits, tokens = _run(sk, None)  # the second compiles its prefill, and fails
    assert report.enabled and report.error == ""
    assert not report.prefill and "no prefill kernels here" in report.prefill_error
    assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max().item() <= 1e-5
    logits2, _ = _run(sk, None)  # the failed call left no stray cache length behind
    assert (logits2 - ref_logits).abs().max().item() <= 1e-5
