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
