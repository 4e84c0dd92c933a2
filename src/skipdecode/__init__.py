"""SkipDecode: layer-skipping decoding with batching and KV caching (arXiv 2307.02628).

The public names below are imported on first use (PEP 562 ``__getattr__``), so that importing
the package, or running ``skipdecode --help``, does not import torch and transformers (about 2 s
on 2 cores). ``from skipdecode import load`` and ``skipdecode.load`` work as before.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any, List

__version__ = "0.1.0"

# public name -> the submodule that defines it
_PUBLIC = {
    "UnsupportedArchitectureError": "adapters",
    "get_adapter": "adapters",
    "supported_model_types": "adapters",
    "GenerationResult": "generate",
    "StreamChunk": "generate",
    "encode_prompts": "generate",
    "generate": "generate",
    "generate_step": "generate",
    "stream_generate": "generate",
    "DEFAULT_MODEL": "loading",
    "LoadError": "loading",
    "load": "loading",
    "TokenLogprobs": "logprobs",
    "SkipModel": "model",
    "FullPolicy": "policy",
    "LinearDecayPolicy": "policy",
    "SkipPolicy": "policy",
    "for_speedup": "policy",
    "policy_from_dict": "policy",
    "SamplingParams": "sampling",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from .adapters import UnsupportedArchitectureError, get_adapter, supported_model_types  # noqa: F401
    from .generate import (GenerationResult, StreamChunk, encode_prompts, generate, generate_step,  # noqa: F401
                           stream_generate)
    from .loading import DEFAULT_MODEL, LoadError, load  # noqa: F401
    from .logprobs import TokenLogprobs  # noqa: F401
    from .model import SkipModel  # noqa: F401
    from .policy import FullPolicy, LinearDecayPolicy, SkipPolicy, for_speedup, policy_from_dict  # noqa: F401
    from .sampling import SamplingParams  # noqa: F401


def __getattr__(name: str) -> Any:
    """Import a public name's submodule on first access (PEP 562).

    Raises:
        AttributeError: ``name`` is neither a public name nor a submodule.
    """
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'skipdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


class _Package(types.ModuleType):
    """The package's module type: a submodule named like one of its public functions
    (``skipdecode.generate``) stays behind that function. Importing a submodule sets it as an
    attribute of its package (importlib), which would otherwise replace ``skipdecode.generate``,
    the function, with the module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> List[str]:
    """The module's names, the not yet imported public names included."""
    return sorted(set(globals()) | set(_PUBLIC))
