"""Every ```python example of the README and of docs/*.md runs as written.

A page's examples run in order in one namespace (a later example may use an earlier one's
``model``), with ``skipdecode.load`` called without a model name answering a tiny random Llama
checkpoint of 30 layers (as the embedded SmolLM2, so that the examples' explicit schedules fit it)
instead of the embedded model (its keyword arguments, ``quantize`` and ``compile``
among them, are passed on unchanged). So a renamed function, argument, attribute or statistic
in the documented API fails here; the texts printed are a random model's.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import skipdecode
from conftest import make_model
from skipdecode import LinearDecayPolicy, SkipModel

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples(page: Path) -> list[str]:
    """The ```python blocks of ``page``, in order."""
    return FENCE.findall(page.read_text(encoding="utf-8"))


PAGES_WITH_EXAMPLES = [p for p in PAGES if examples(p)]


def test_the_readme_and_the_api_docs_have_examples():
    names = {p.name for p in PAGES_WITH_EXAMPLES}
    assert {"README.md", "design.md"} <= names


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("doc") / "tiny"
    policy = LinearDecayPolicy(num_layers=30, max_layers=21, min_layers=9, warmup_layers=1, horizon=8)
    SkipModel(make_model("llama", 30), tokenizer, policy=policy).save_pretrained(path)
    return path


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: p.name)
def test_examples_run_as_written(page, tiny_dir, monkeypatch):
    real_load = skipdecode.load
    calls = []

    def load(model=None, **kwargs):
        calls.append(kwargs)
        return real_load(str(tiny_dir) if model is None else model, **kwargs)

    monkeypatch.setattr(skipdecode, "load", load)
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    out = io.StringIO()
    for i, code in enumerate(examples(page)):
        with contextlib.redirect_stdout(out):
            try:
                exec(compile(code, f"{page.name} example {i + 1}", "exec"), namespace)
            except Exception as err:  # name the page and the example, then fail
                pytest.fail(f"{page.name} example {i + 1} fails: {type(err).__name__}: {err}\n{code}")
    assert calls, f"{page.name}'s examples never load a model"
    if "print(" in "".join(examples(page)):
        assert out.getvalue().strip(), f"{page.name}'s examples print nothing"


def test_the_readme_example_prints_one_answer_per_prompt(tiny_dir, monkeypatch):
    real_load = skipdecode.load
    monkeypatch.setattr(skipdecode, "load", lambda model=None, **kw: real_load(str(tiny_dir), **kw))
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(examples(ROOT / "README.md")[0], namespace)
    result = namespace["result"]
    assert len(result.texts) == 2 and result.finish_reasons
    assert result.stats()["theoretical_speedup"] > 1  # the tiny model's policy_for(speedup=2) skips layers
