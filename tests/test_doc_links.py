"""Every relative link of README.md and docs/*.md resolves: the file exists and a ``#anchor``
names one of its headings (GitHub's heading slugs). Runs on the text only (no model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def split_markdown(text: str) -> tuple[list[tuple[str, str]], str]:
    """``([(language, code), ...], prose)``: each fenced block of a Markdown ``text`` in order
    (fences open and close in turn, so a closing fence never starts a block), and the lines
    outside them."""
    blocks, lang, code, prose = [], None, [], []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, code = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(code) + "\n"))
                lang = None
        elif lang is not None:
            code.append(line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading anchors of ``page`` (outside fenced code), with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in split_markdown(page.read_text())[1].splitlines():
        if not line.startswith("#"):
            continue
        base = slug(line.lstrip("#"))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(page: Path) -> list[str]:
    text = split_markdown(page.read_text())[1]  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_slug_follows_github():
    assert slug(" `--align-steps 8` by default, with weight-first products (stop 33)") == \
        "--align-steps-8-by-default-with-weight-first-products-stop-33"
    assert slug(" Decode speed: float32, int4 and w8a8, against llama.cpp") == \
        "decode-speed-float32-int4-and-w8a8-against-llamacpp"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
