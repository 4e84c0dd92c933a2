"""Adapter registry keyed by ``config.model_type`` (importing this registers every family)."""

from . import gpt2, llama, opt  # noqa: F401  (registration side effects)
from .base import ADAPTERS, Adapter, UnsupportedArchitectureError, get_adapter, supported_model_types

__all__ = ["ADAPTERS", "Adapter", "UnsupportedArchitectureError", "get_adapter", "supported_model_types"]
