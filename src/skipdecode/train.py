"""Skip-aware fine-tuning: a thin re-export of :mod:`skipdecode.training` (kept so that
``from skipdecode.train import TrainConfig, train, ...`` and the ``skipdecode train`` command keep
working). See the package docstring for where each piece lives; ``__all__`` is the package's."""

from __future__ import annotations

from .training import *  # noqa: F401,F403  (the public names, listed once in training.__all__)
from .training import __all__  # noqa: F401
