"""Compact storage of shipped adapter tensors (:mod:`skipdecode.packing`): the rounding bounds of
int8 and int4, shapes and float32 biases kept, plain files read as float32, damaged metadata
refused; a LoRA adapter installed packed merges as LoRA eq. 3 of its dequantized tensors (equal to
peft's merge when stored in float32), loads through ``load(adapter=...)`` and the unmerged int4
path, and ``adapter_summary`` reports its storage. Tiny random tensors and models, offline."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_entry_bridge_io import bridged_adapter_dir  # noqa: F401  (fixture)
from test_skip_adapter import _lora_dir, adapter_dir, base_dir  # noqa: F401  (fixtures)
from skipdecode import LoadError, load
from skipdecode import skip_adapter as sa
from skipdecode.int4pack import dequantize
from skipdecode.lowrank import LORA_WEIGHTS, PACKED_LORA_WEIGHTS, read_lora
from skipdecode.packing import PACK_FORMATS, PACKED_META, pack, packed_formats, unpack


def _weights(*shape: int) -> torch.Tensor:
    """Rows of very different magnitudes, so that one scale per row matters."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g)
    return w * torch.logspace(-3, 1, shape[-2])[:, None]


def _round_trip(tensors: dict, fmt: str, **kw) -> tuple[dict, dict, dict]:
    stored, meta = pack(tensors, fmt, **kw)
    return unpack(stored, meta), stored, meta


def test_int8_moves_each_weight_by_at_most_half_its_stored_row_scale():
    w = _weights(3, 16, 40)  # 3-D: packed as 48 rows and reshaped back
    got, stored, meta = _round_trip({"w": w}, "int8")
    assert got["w"].shape == w.shape and got["w"].dtype == torch.float32
    scale = stored["w.scale"].float().reshape(3, 16, 1)
    assert stored["w.int8"].dtype == torch.int8 and stored["w.scale"].dtype == torch.float16
    assert bool(((got["w"] - w).abs() <= scale / 2 * (1 + 1e-6)).all())
    assert bool((scale >= w.abs().amax(-1, keepdim=True) / 127).all())  # rounded up: nothing clamped
    assert not torch.equal(got["w"], w)
    assert packed_formats(meta) == ["int8"]


def test_int4_moves_each_weight_by_at_most_half_its_group_step():
    w = _weights(24, 128)
    got, stored, _ = _round_trip({"w": w}, "int4", group_size=32)
    assert stored["w.int4"].shape == (24, 64) and stored["w.int4"].dtype == torch.uint8
    step = stored["w.int4_sz"][..., 0].t().float().repeat_interleave(32, dim=1)  # (24, 128)
    assert bool(((got["w"] - w).abs() <= step / 2 * (1 + 1e-6)).all())
    codes = torch.stack([stored["w.int4"] & 15, stored["w.int4"] >> 4], -1).reshape(24, 128)
    torch.testing.assert_close(got["w"], dequantize(codes, stored["w.int4_sz"]), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float32"])
def test_float_formats_are_plain_casts(fmt):
    w = _weights(4, 8)
    got, stored, _ = _round_trip({"w": w}, fmt)
    assert torch.equal(got["w"], w.to(getattr(torch, fmt)).float()) and set(stored) == {"w"}


def test_vectors_and_named_tensors_stay_float32():
    w, b, b2 = _weights(4, 64), torch.randn(4), torch.randn(2, 4)
    got, stored, meta = _round_trip({"w": w, "b": b, "b2": b2}, "int4", keep_float32=("b2",))
    assert torch.equal(got["b"], b) and torch.equal(got["b2"], b2)
    assert stored["b"].dtype == torch.float32 and "w.int4" in stored
    assert packed_formats(meta) == ["float32", "int4"]


def test_sizes_shrink_as_stated(tmp_path):
    w = {"w": _weights(256, 512)}
    sizes = {}
    for fmt in PACK_FORMATS:
        stored, meta = pack(w, fmt)
        save_file(stored, str(tmp_path / f"{fmt}.safetensors"), metadata=meta)
        sizes[fmt] = (tmp_path / f"{fmt}.safetensors").stat().st_size
    assert sizes["float16"] < 0.51 * sizes["float32"]
    assert sizes["int8"] < 0.26 * sizes["float32"]
    assert sizes["int4"] < 0.15 * sizes["float32"]


def test_bad_input_is_refused_naming_what_is_allowed():
    with pytest.raises(ValueError, match="float32, float16, bfloat16, int8, int4"):
        pack({"w": torch.ones(2, 2)}, "int3")
    with pytest.raises(ValueError, match="int4 packing of w: last dimension 40 .* group_size 64"):
        pack({"w": torch.ones(2, 40)}, "int4")
    stored, meta = pack({"w": _weights(4, 8)}, "int8")
    del stored["w.scale"]
    with pytest.raises(ValueError, match=PACKED_META):
        unpack(stored, meta)
    with pytest.raises(ValueError, match=PACKED_META):
        unpack({"w": torch.ones(1)}, {PACKED_META: "{not json"})


def test_a_plain_file_is_read_as_float32():
    got = unpack({"w": torch.ones(2, 3, dtype=torch.float16)}, {"format": "pt"})
    assert got["w"].dtype == torch.float32 and torch.equal(got["w"], torch.ones(2, 3))
    assert packed_formats({"format": "pt"}) == []


# ---------------------------------------------------------------------------------------------
# Packed LoRA adapters
# ---------------------------------------------------------------------------------------------


def _packed_copy(adapter_dir, path, fmt):  # noqa: F811
    """``adapter_dir``'s LoRA with its weights packed in ``fmt`` (config and skipdecode.json kept)."""
    path.mkdir()
    for name in ("adapter_config.json", "skipdecode.json"):
        (path / name).write_text((adapter_dir / name).read_text())
    stored, meta = pack(load_file(str(adapter_dir / LORA_WEIGHTS)), fmt)
    save_file(stored, str(path / PACKED_LORA_WEIGHTS), metadata=meta)
    return path


def _layer_weights(sk) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sk.model.state_dict().items() if "layers." in k}


def test_a_float32_packed_adapter_merges_exactly_as_peft_does(base_dir, adapter_dir, tmp_path):  # noqa: F811
    packed = _packed_copy(adapter_dir, tmp_path / "packed", "float32")
    want = _layer_weights(load(str(base_dir), adapter=str(adapter_dir)))  # peft's merge_and_unload
    got = _layer_weights(load(str(base_dir), adapter=str(packed)))
    plain = _layer_weights(load(str(base_dir), adapter=False))
    assert want.keys() == got.keys()
    assert any(not torch.equal(want[k], plain[k]) for k in want)  # the adapter changes the weights
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)


def _tensor_bytes(path) -> int:
    return sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


def test_an_int8_install_stores_under_three_tenths_of_float32s_tensor_bytes(tmp_path):
    """At rank 16 (the shipped rank) the float16 row scales add 2 bytes to each 16-byte row of B."""
    lora16 = _lora_dir(tmp_path / "r16", zero=False, r=16)
    target = sa.install_adapter(lora16, name="tiny", target_root=tmp_path / "out", lora_format="int8")
    assert _tensor_bytes(target / PACKED_LORA_WEIGHTS) < 0.3 * _tensor_bytes(lora16 / LORA_WEIGHTS)


def test_an_int8_install_merges_its_dequantized_deltas(base_dir, adapter_dir, tmp_path):  # noqa: F811
    target = sa.install_adapter(adapter_dir, name="tiny", target_root=tmp_path, lora_format="int8")
    assert (target / PACKED_LORA_WEIGHTS).is_file() and not (target / LORA_WEIGHTS).exists()
    meta = json.loads((target / "skipdecode.json").read_text())
    modules = sum(".lora_B." in k for k in load_file(str(adapter_dir / LORA_WEIGHTS)))
    assert meta["storage"] == {"lora": "int8", "lora_modules": {"kept": modules, "zero_left_out": 0},
                               "entry_bridge": None}
    assert sa.adapter_summary(target, shipped=False)["storage"] == meta["storage"]
    plain = _layer_weights(load(str(base_dir), adapter=False))
    merged = load(str(base_dir), adapter=str(target))
    got = _layer_weights(merged)
    deltas = read_lora(target)  # dequantized A, B
    for module, (a, b, scaling) in deltas.items():
        key = module.removeprefix("model.") + ".weight"
        key = next(k for k in got if k.endswith(key))
        torch.testing.assert_close(got[key], plain[key] + scaling * (b @ a), rtol=1e-5, atol=1e-6)
    exact = read_lora(adapter_dir)
    assert any(not torch.equal(deltas[m][0], exact[m][0]) for m in exact)  # it really was rounded
    for m, (a, b, _) in exact.items():  # each within half a row scale of the float32 adapter
        for got_t, want_t in ((deltas[m][0], a), (deltas[m][1], b)):
            bound = want_t.abs().amax(-1, keepdim=True) / 127 * (1 + 2.0 ** -10) / 2
            assert bool(((got_t - want_t).abs() <= bound * (1 + 1e-6)).all()), m
    # the unmerged path of int4 reads the packed file too
    q = load(str(base_dir), adapter=str(target), quantize="int4")
    assert q.generate(["Describe the restaurant"], max_new_tokens=3, chat=False).token_ids[0]


def test_a_damaged_packed_adapter_is_one_load_error_naming_it(base_dir, adapter_dir, tmp_path):  # noqa: F811
    target = sa.install_adapter(adapter_dir, name="tiny", target_root=tmp_path, lora_format="int8")
    (target / PACKED_LORA_WEIGHTS).write_bytes(b"\x00" * 64)
    with pytest.raises((LoadError, sa.AdapterError)) as info:
        load(str(base_dir), adapter=str(target))
    assert PACKED_LORA_WEIGHTS in str(info.value) and "\n" not in str(info.value)


def test_install_refuses_an_unknown_format(adapter_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="lora_format must be one of"):
        sa.install_adapter(adapter_dir, name="tiny", target_root=tmp_path, lora_format="int2")
    with pytest.raises(ValueError, match="bridge_format must be one of"):
        sa.install_adapter(adapter_dir, name="tiny", target_root=tmp_path, bridge_format="fp8")
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_packed_install_leaves_out_modules_whose_delta_is_zero(base_dir, adapter_dir, tmp_path):  # noqa: F811
    """A decode-only 2x adapter never trains the layers its schedule skips: their B stays zero, so
    B A is exactly zero and the packed file can leave them out; the merge is unchanged."""
    src = tmp_path / "partly_zero"
    src.mkdir()
    for name in ("adapter_config.json", "skipdecode.json"):
        (src / name).write_text((adapter_dir / name).read_text())
    tensors = load_file(str(adapter_dir / LORA_WEIGHTS))
    zeroed = [k for k in tensors if ".layers.0." in k and ".lora_B." in k]
    assert zeroed
    for k in zeroed:
        tensors[k] = torch.zeros_like(tensors[k])
    save_file(tensors, str(src / LORA_WEIGHTS))
    target = sa.install_adapter(src, name="tiny", target_root=tmp_path / "out", lora_format="int8")
    stored = load_file(str(target / PACKED_LORA_WEIGHTS))
    assert not any(".layers.0." in k for k in stored) and any(".layers.1." in k for k in stored)
    storage = json.loads((target / "skipdecode.json").read_text())["storage"]
    assert storage["lora_modules"]["zero_left_out"] == len(zeroed)
    plain = _layer_weights(load(str(base_dir), adapter=False))
    full = _layer_weights(load(str(base_dir), adapter=str(src)))  # peft, every module
    got = _layer_weights(load(str(base_dir), adapter=str(target)))
    for k in got:
        if ".layers.0." in k:
            assert torch.equal(got[k], plain[k]) and torch.allclose(full[k], plain[k])
        elif not torch.equal(full[k], plain[k]):
            assert not torch.equal(got[k], plain[k]), k  # adapted layers stay adapted


def test_install_keeps_the_chosen_bridge_targets_in_int4(base_dir, bridged_adapter_dir, tmp_path):  # noqa: F811
    from skipdecode.entry_bridge import EntryBridge, entry_bridge_of

    want = EntryBridge.load(bridged_adapter_dir)
    keep = want.targets[1::2]
    target = sa.install_adapter(bridged_adapter_dir, name="tiny", target_root=tmp_path, lora_format="int8",
                                bridge_format="int4", bridge_targets=keep)
    got = EntryBridge.load(target)
    assert got.targets == keep and got.source == want.source
    rows = [want.targets.index(t) for t in keep]
    ref = want.weight.detach()[rows]
    # int4 in groups of gcd(C, 64) = 32 input channels: the whole row of this 32-wide model
    err = (got.weight - ref).abs().amax()
    assert 0 < err <= (ref.amax(-1) - ref.amin(-1)).amax() / 15 / 2 * 1.01
    storage = json.loads((target / "skipdecode.json").read_text())["storage"]
    assert storage["entry_bridge"] == "int4" and storage["entry_bridge_targets"] == keep
    assert json.loads((target / "skipdecode.json").read_text())["entry_bridge"]["targets"] == keep
    assert sa.entry_bridge_summary(target)["dtype"] == "int4"
    loaded = entry_bridge_of(load(str(base_dir), adapter=str(target)).model)
    assert loaded.targets == keep


def test_entry_bridge_subset():
    from skipdecode.entry_bridge import EntryBridge

    bridge = EntryBridge(8, 0, [2, 3, 4, 5], weight=torch.randn(4, 8, 8), bias=torch.randn(4, 8))
    sub = bridge.subset([5, 3])
    assert sub.targets == [3, 5] and torch.equal(sub.weight.detach()[1], bridge.weight.detach()[3])
    assert torch.equal(sub.bias.detach()[0], bridge.bias.detach()[1])
    assert sub.has(3) and not sub.has(2)
    for bad in ([1, 3], []):
        with pytest.raises(ValueError, match="subset of"):
            bridge.subset(bad)


def test_train_adapter_install_options_fail_in_one_line(tmp_path, capsys):
    """--bridge-targets is checked by the parser (before any file is read); a run folder without
    skipdecode.json is one error line naming it, not a traceback."""
    from conftest import load_benchmark

    script = load_benchmark("train_adapter")
    assert script.parse_args(["--bridge-targets", "10-29"]).bridge_targets == range(10, 30)
    for bad in ("10to29", "29-10"):
        with pytest.raises(SystemExit) as exc:
            script.parse_args(["--install", "--bridge-targets", bad])
        assert exc.value.code == 2 and "--bridge-targets" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        script.main(["--install", "--out", str(tmp_path / "no_run")])
    message = str(exc.value.code)
    assert message.startswith("error: --install:") and "skipdecode.json" in message and "\n" not in message
