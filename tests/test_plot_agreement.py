"""``benchmarks/plot_agreement.py``: adapter_agreement.py results joined into one table and plot."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("plot_agreement")


def _row(label: str, ptype: str, rouge: float, speedup: float) -> dict:
    return {"model": "adapted", "policy_label": label, "policy": {"type": ptype}, "exact": 10.0,
            "rougeL": rouge, "first_divergence": 5.0, "theoretical_speedup": speedup, "texts": []}


def _report(path, adapter, n, rows) -> None:
    path.write_text(json.dumps({"adapter": adapter, "max_new_tokens": n, "rows": rows}))


def test_joins_the_skipping_rows_of_each_file(script, tmp_path, capsys):
    """Full-depth rows (100 by construction) are left out; every other row of every file is a
    table row and a point, labelled with its file, adapter and answer length."""
    stock = dict(_row("2x", "linear_decay", 11.2, 2.86), model="stock")
    _report(tmp_path / "a.json", None, 128, [_row("full", "full", 100.0, 1.0), stock,
                                             _row("2x", "linear_decay", 42.9, 3.75)])
    _report(tmp_path / "b.json", "runs/long/final", 40,
            [_row("full", "full", 100.0, 1.0), _row("trained 25->10", "linear_decay", 51.7, 2.14),
             _row("full", "full", 100.0, 1.0)])
    _report(tmp_path / "c.json", "runs/other/final", 128, [stock])  # the same stock row again: shown once
    assert script.main([str(tmp_path / f"{x}.json") for x in "abc"] + ["--out", str(tmp_path / "o"), "--name", "j"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == {"name": "j", "points": 3, "best_rougeL": 51.7}
    md = (tmp_path / "o" / "j.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and ".json" in line]
    assert rows == ["| a.json | none | stock | 2x | 128 | 10.0 % | 11.2 | 5.0 | 2.86x |",
                    "| a.json | shipped adapter | adapted | 2x | 128 | 10.0 % | 42.9 | 5.0 | 3.75x |",
                    "| b.json | runs/long/final | adapted | trained 25->10 | 40 | 10.0 % | 51.7 | 5.0 | 2.14x |"]
    assert (tmp_path / "o" / "j.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_file_that_is_not_a_result_exits_2_naming_it(script, tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"rows": 3}')
    for bad in (tmp_path / "x.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exc:
            script.main([str(bad), "--out", str(tmp_path / "o")])
        assert exc.value.code == 2
        assert f"error: {bad}: not an adapter_agreement.py result" in capsys.readouterr().err
    _report(tmp_path / "f.json", None, 40, [_row("full", "full", 100.0, 1.0)])
    with pytest.raises(SystemExit) as exc:
        script.main([str(tmp_path / "f.json"), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2 and "no skipping rows" in capsys.readouterr().err


def test_short_names_for_the_plot(script):
    assert script.short_name("skipdecode/skip_adapters/smollm2-135m-instruct (package data)") == "shipped"
    assert script.short_name("none") == "stock"
    assert script.short_name("runs/skip-adapter-long1/final") == "skip-adapter-long1"
    assert script.short_name("runs/skip-adapter-long1/checkpoint-00000100") == "checkpoint-00000100"
