"""SkipDecode: layer-skipping decoding with batching and KV caching (arXiv 2307.02628)."""

__version__ = "0.1.0"

from .adapters import UnsupportedArchitectureError, get_adapter, supported_model_types
from .generate import GenerationResult, StreamChunk, generate, generate_step, stream_generate
from .loading import DEFAULT_MODEL, LoadError, load
from .logprobs import TokenLogprobs
from .model import SkipModel
from .policy import FullPolicy, LinearDecayPolicy, SkipPolicy, for_speedup, policy_from_dict
from .sampling import SamplingParams

__all__ = [
    "DEFAULT_MODEL",
    "FullPolicy",
    "GenerationResult",
    "LinearDecayPolicy",
    "LoadError",
    "SamplingParams",
    "SkipModel",
    "SkipPolicy",
    "StreamChunk",
    "TokenLogprobs",
    "UnsupportedArchitectureError",
    "for_speedup",
    "generate",
    "generate_step",
    "get_adapter",
    "load",
    "policy_from_dict",
    "stream_generate",
    "supported_model_types",
]
