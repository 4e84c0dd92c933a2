"""Where the project's shared data lives (``../shared/data`` beside the repository, or
``$SKIPDECODE_DATA``): :func:`default_data_dir`, and :func:`shared_data_path` for a default data
file under it (what the benchmark scripts use when ``--data`` is not given).
"""

from __future__ import annotations

import os
from pathlib import Path

from .records import DataError


def default_data_dir() -> Path | None:
    """Where the project's shared data lives, or ``None`` if no such folder is found.

    Order: ``$SKIPDECODE_DATA`` if set (returned as given, even if it does not exist);
    else ``../shared/data`` relative to the current working directory if it is a directory;
    else the first ``shared/data`` directory found beside this file's ancestors (i.e. walking up
    from this file, ``<ancestor>/shared/data``), which finds the folder beside the repo root.
    """
    env = os.environ.get("SKIPDECODE_DATA")
    if env:
        return Path(env).expanduser()
    cwd_candidate = Path.cwd().parent / "shared" / "data"
    if cwd_candidate.is_dir():
        return cwd_candidate.resolve()
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return None


def shared_data_path(given: str | os.PathLike | None, relative: str | os.PathLike = "", *,
                     option: str = "--data") -> str:
    """The data a command reads: ``given`` when set, else ``relative`` under the shared data folder.

    The one place where a command (the CLI, every script under ``benchmarks/``) turns an optional
    data option into a data spec. ``given`` is returned unchanged (as ``str``) and is not checked:
    it may be a file, a folder or a Hugging Face dataset name, and the reader reports its own
    problems. Without it the default is ``default_data_dir() / relative`` (``relative=""``: the
    folder itself), which must exist.

    Args:
        given: the option's value (``None`` or ``""``: not given).
        relative: the default file (or folder) inside the shared data folder, e.g.
            ``"e2e/devset.csv"``.
        option: the command-line option ``given`` came from; named in the error.

    Returns:
        ``str(given)``, or the default's path as a string (absolute unless ``$SKIPDECODE_DATA``
        is relative).

    Raises:
        DataError: ``given`` is not set and no shared data folder is found, or the default is not
            in it; the one-line message names ``option``, the folder(s) looked in and the file.
    """
    if given is not None and str(given) != "":
        return str(given)
    root = default_data_dir()
    name = Path(relative).as_posix()
    what = "a data folder" if name == "." else f"the default {name}"
    if root is None:
        raise DataError(
            f"no {option} given and no shared data folder for {what}: SKIPDECODE_DATA is not set, "
            f"{Path.cwd().parent / 'shared' / 'data'} does not exist and no folder above "
            f"{Path(__file__).resolve().parent} holds shared/data; pass {option} or set SKIPDECODE_DATA"
        )
    path = root / relative
    if not path.exists():
        source = " (SKIPDECODE_DATA)" if os.environ.get("SKIPDECODE_DATA") else ""
        problem = (f"the shared data folder {root}{source} does not exist" if not root.is_dir()
                   else f"{name} is not in the shared data folder {root}{source}")
        raise DataError(f"no {option} given and {problem}; pass {option} or set SKIPDECODE_DATA "
                        "to the folder that holds it")
    return str(path)


def missing_file_message(path: str | os.PathLike) -> str:
    """Why a data file that :func:`~skipdecode.data.load_examples` / ``load_eval_items`` could not
    find is missing, in words: for a relative path, also that they looked in the shared data
    folder (they read ``e2e/devset.csv`` from there when the current folder has no such file), or
    that no shared data folder was found. (The single-file readers, such as ``read_e2e_pairs``,
    read the path as given and say "file does not exist".)"""
    if Path(path).expanduser().is_absolute():
        return "file does not exist"
    root = default_data_dir()
    if root is None:
        return ("file does not exist here, and no shared data folder was found to look in (set SKIPDECODE_DATA "
                "to the folder that holds the datasets)")
    source = " (SKIPDECODE_DATA)" if os.environ.get("SKIPDECODE_DATA") else ""
    return f"file does not exist here or in the shared data folder {root}{source}"
