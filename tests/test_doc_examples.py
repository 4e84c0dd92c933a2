"""Every ```python example of the README and of docs/*.md runs as written, and every
``skipdecode`` command they show names a real subcommand and real options.

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
import sys
import types
from pathlib import Path

import pytest

import skipdecode
from conftest import make_model
from skipdecode import LinearDecayPolicy, SkipModel

from test_doc_links import PAGES, ROOT, split_markdown  # the same pages, read the same way


def examples(page: Path) -> list[str]:
    """The ```python blocks of ``page``, in order."""
    return [code for lang, code in split_markdown(page.read_text(encoding="utf-8"))[0] if lang == "python"]


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
    module = types.ModuleType(f"doc_{page.stem}")  # a real module: dataclasses look their class's module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
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


def cli_lines(page: Path) -> list[str]:
    """Shell lines of ``page``'s code blocks and its inline code spans that run ``skipdecode``."""
    blocks, prose = split_markdown(page.read_text(encoding="utf-8"))
    shell = [code for lang, code in blocks if lang in ("", "bash", "sh", "shell", "console")]
    lines = [ln for code in shell for ln in code.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"`(skipdecode(?: [^`]*)?)`", prose)  # inline code that starts with the command
    return [s for s in lines if re.search(r"(^|[\s;&|(])skipdecode( |$)", s)] + spans


def cli_calls(line: str) -> list[tuple[str | None, list[str]]]:
    """``(subcommand or None, --options)`` of each ``skipdecode`` call in a shell ``line``."""
    calls = []
    line = line.split(" #")[0].replace("\\|", " ")  # an escaped pipe separates alternatives in a table cell
    for part in re.split(r"&&|\|\||[;&|]", line):
        words = part.replace("[", " ").replace("]", " ").split()  # optional parts: [--option VALUE]
        if "skipdecode" not in words:
            continue
        args = words[words.index("skipdecode") + 1:]
        sub = args[0] if args and not args[0].startswith("-") else None
        calls.append((sub, [a.split("=")[0] for a in args if re.fullmatch(r"--[a-z][\w-]*(=.*)?", a)]))
    return calls


def test_every_documented_cli_command_and_option_exists():
    """Each ``skipdecode ...`` of the README and docs/ names a real subcommand, and each of its
    ``--options`` is one that subcommand takes (the same options its ``--help`` lists)."""
    import typer

    from skipdecode.cli import app

    group = typer.main.get_command(app)
    wrong, seen = [], 0
    for page in PAGES:
        for line in cli_lines(page):
            for sub, options in cli_calls(line):
                seen += 1
                command = group if sub is None else group.commands.get(sub)
                if command is None:
                    wrong.append(f"{page.name}: no command {sub!r} in {line.strip()!r}")
                    continue
                known = {o for p in command.params for o in p.opts + p.secondary_opts} | {"--help"}
                wrong += [f"{page.name}: {sub} has no {o} in {line.strip()!r}" for o in options if o not in known]
    assert seen > 30  # the README and docs document dozens of commands
    assert not wrong, "\n".join(wrong)
