"""Portable paths in results files: records name paths relative to the repository or the data
folder, never the absolute paths of the machine they ran on (issue 12)."""

from __future__ import annotations

import os
import re
import tempfile
import sysconfig
from pathlib import Path
from typing import Any

__all__ = ["portable", "portable_record", "portable_here", "loadable_path"]


def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, replacement) pairs, longest first: the repository root (-> relative),
    the data folder (-> ``../shared/data/`` when it sits beside the repository, else
    ``$SKIPDECODE_DATA/``), and the Python ``site-packages`` folder (-> ``<site-packages>/``)."""
    from .data import default_data_dir

    here = Path(__file__).resolve().parents[2]
    repo = here if (here / "pyproject.toml").exists() else Path.cwd().resolve()
    pairs = [(str(repo) + os.sep, "")]
    data = default_data_dir()
    if data is not None:
        data = Path(data).resolve()
        beside = (repo.parent / "shared" / "data").resolve()
        pairs.append((str(data) + os.sep, "../shared/data/" if data == beside else "$SKIPDECODE_DATA/"))
    for key in ("purelib", "platlib"):
        site = sysconfig.get_paths().get(key)
        if site:
            pairs.append((str(Path(site).resolve()) + os.sep, "<site-packages>/"))
    return sorted(set(pairs), key=lambda p: -len(p[0]))


def portable(text: str) -> str:
    """``text`` with every absolute path under the repository, the data folder or
    ``site-packages`` rewritten relative to it (see :func:`_prefixes`); other text unchanged.

    Example: ``"/home/me/skipdecode/runs/e2e-2x/final"`` -> ``"runs/e2e-2x/final"``.
    """
    for prefix, repl in _prefixes():
        text = re.sub(re.escape(prefix), lambda _m, r=repl: r, text)
    return text


def _map_strings(obj: Any, fn) -> Any:
    """A copy of a JSON-like record (dicts, lists, strings, numbers) with ``fn`` applied to
    every string, dict keys included (tuples become lists, as JSON writes them)."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {fn(k) if isinstance(k, str) else k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_strings(v, fn) for v in obj]
    return obj


def portable_record(obj: Any) -> Any:
    """A copy of a JSON-like record (dicts, lists, strings, numbers) with :func:`portable`
    applied to every string (dict keys included)."""
    return _map_strings(obj, portable)


def portable_here(obj: Any) -> Any:
    """:func:`portable_record` of ``obj`` (a JSON-like record or a string), then every absolute
    path left under the current directory written relative to it: the rule for records of runs
    whose files lie outside the repository (e.g. ``cd /tmp/work && skipdecode train --out runs/a``
    records ``runs/a``, not ``/tmp/work/runs/a``). Paths under the repository, the data folder or
    ``site-packages`` keep :func:`portable`'s form; other text is unchanged."""
    here = str(Path.cwd().resolve())
    prefix = here.rstrip(os.sep) + os.sep

    def rewrite(text: str) -> str:
        text = portable(text)
        return text if here == os.sep else re.sub(re.escape(prefix), "", text)

    return _map_strings(obj, rewrite)


def loadable_path(path: str | os.PathLike) -> str:
    """``path`` (an existing file or folder, e.g. a model folder that a record must still be able
    to load) as :func:`portable_here` writes it when that relative form, read from the current
    directory, names the same place; else its absolute path (e.g. a folder outside both the
    repository and the current directory, or under the data folder, whose ``$SKIPDECODE_DATA/``
    form no loader expands). A ``path`` that does not exist (a Hugging Face model id) is
    returned unchanged."""
    text = os.fspath(path)
    if not Path(text).exists():
        return text
    absolute = Path(text).resolve()
    short = portable_here(str(absolute))
    return short if short != str(absolute) and Path(short).resolve() == absolute else str(absolute)


def is_file_name(name: str) -> bool:
    """True when ``name`` is a plain file name: not empty, not ``.`` or ``..``, no folder part
    (``/`` or ``\\``), so that ``folder / name`` stays inside ``folder``. Never raises."""
    return isinstance(name, str) and bool(name.strip()) and name not in (".", "..") and not any(
        sep in name for sep in ("/", "\\"))


def writable_dir_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot receive files, or None when it can (it is created if missing).

    Checked before long work (training, evaluation, benchmarks) so that an unwritable output is
    reported before anything runs, never after. Returns one line: the folder is a file, or
    creating it / writing a probe file in it failed (with the OS reason)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        return f"{folder} cannot be written: {err.strerror or err}"
    return None


def remove_new_empty_dirs(folder: str | os.PathLike, existing: str | os.PathLike) -> None:
    """Remove ``folder`` and its parents up to ``existing`` (an ancestor that existed before, or
    ``folder`` itself) while they are empty: undoes :func:`writable_dir_problem`'s creation after
    work that failed before writing anything. A folder holding anything is kept, so no file is
    ever removed; errors are ignored (another process may be writing)."""
    folder, existing = Path(folder).absolute(), Path(existing).absolute()
    while folder != existing and existing in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def first_existing(folder: str | os.PathLike) -> Path:
    """``folder`` or its nearest ancestor that exists (absolute)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
