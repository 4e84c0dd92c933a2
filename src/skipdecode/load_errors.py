"""The error :func:`skipdecode.load` raises (re-exported by :mod:`skipdecode.loading` and the
package), in a module of its own so that the loaders it is split across share it."""

from __future__ import annotations

__all__ = ["LoadError"]


class LoadError(ValueError):
    """A model could not be found or read; the message says what was tried.

    Attributes:
        param: ``"model"`` when the fault is the model name or path itself (the CLI names its
            ``--model`` option then), else None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
