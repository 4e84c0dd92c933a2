"""Calls of a compiled layer that skip dynamo's guard check when dynamo just checked the same inputs.

Why. ``torch.compile`` checks a function's guards (about 700 for a decoder layer passed as an
argument: its submodules' types and attributes, every tensor's sizes and strides) before every
call, to pick the compiled variant the inputs fit. On the 2-core AMD EPYC test host that check and
the compiled region's entry cost about 90 us a call (64-77 us ``TorchDynamo Cache Lookup`` and 24
us of the region, PyTorch 2.13 profiler), and a decode step makes one call per layer that runs
plus one for the LM head: 31 calls, about 2.8 ms, of a 23.5 ms full-depth float32 step at batch 1.
Yet within a step every layer that runs gets inputs of the same sizes, strides and types, and the
layers are copies of one structure.

What. :class:`GuardMemo` wraps a ``torch.compile``'d function. A call with a signature
(:func:`signature`: every tensor's sizes, strides, dtype, device, ``requires_grad`` and inference
flag, every other argument's value, the layer's structure and mutable flags, the autograd and
autocast state) it has not seen goes through dynamo as usual, guards and all; dynamo moves the
cache entry that ran to the front of its list (or puts a new compile there), so the memo then
knows which compiled code those inputs select, and keeps a plain Python function over that code,
once that entry's own guards have accepted the inputs (where dynamo ran no entry, past its
``recompile_limit``, the front one belongs to other inputs and the signature stays checked).
A later call with an equal signature runs that function directly: the same bytecode dynamo
would run after the same check, minus the check. This is vLLM's custom dispatcher
(``TorchCompileWrapperWithCustomDispatcher``: run the compiled bytecode without dynamo's frame
hook), with the dispatch key derived from the inputs instead of fixed per engine.

Why it is exact. A guard can only read the inputs' properties, the modules' attributes and global
state; the signature holds all of those that can change between calls of a model already loaded:
tensor metadata and argument values per call; per layer a fingerprint (submodule names, types and
plain attributes other than ``layer_idx``, parameter and buffer metadata), recomputed after every
:func:`invalidate`; ``training`` and a decode-only adapter's prefill switch per call. Layers with
equal fingerprints share entries, as they share dynamo's. skipdecode calls :func:`invalidate` when
it changes a loaded model's modules (oneDNN copies on or off, the head's one-row preview, attaching
an adapter); code that changes a compiled model's modules another way must call it too (or
``load(compile=False)``). Compiled code with a graph break (resume functions, which only dynamo's
frame hook would compile) is never memoised. The first call of each signature, and every call of a
signature with another key length, pays the guard check.
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["GuardMemo", "invalidate", "signature", "available"]

#: bumped by :func:`invalidate`: memos and layer fingerprints made before it are dropped
_EPOCH = [0]

_PLAIN = (bool, int, float, str, type(None))

#: held by every checked call (:class:`GuardMemo`)
_CHECKED = threading.RLock()

#: memoised signatures per compiled function before the memo starts over (a decode step adds
#: one per variant and key length)
MAX_ENTRIES = 4096


def invalidate() -> None:
    """Forget every memoised call and layer fingerprint (all models): call after changing the
    modules, attributes or parameters of a model that runs under ``compile=True``."""
    _EPOCH[0] += 1


def available() -> bool:
    """Whether this PyTorch exposes dynamo's per-code cache list (a private helper,
    ``torch._dynamo.eval_frame._debug_get_cache_entry_list``); without it every call is checked."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: F401
    except ImportError:
        return False
    return True


def _leaf(value: Any) -> Any:
    """Hashable description of one argument; raises TypeError for one it cannot describe."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device, value.requires_grad, value.is_inference())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(_leaf(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _leaf(v)) for k, v in value.items())
    raise TypeError(type(value).__name__)


def _fingerprint(module: nn.Module) -> tuple:
    """Structure of ``module``: per submodule its name, type and plain attributes (``layer_idx``
    aside: an unspecialised integer, the same compiled code serves every index), per parameter
    and buffer its name and metadata."""
    parts = []
    for name, m in module.named_modules():
        attrs = tuple(sorted((k, type(v), v) for k, v in vars(m).items()
                             if isinstance(v, _PLAIN) and k != "layer_idx" and not k.startswith("__")))
        tensors = tuple((n, _leaf(t)) for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None)
        parts.append((name, type(m), attrs, tensors))
    return tuple(parts)


class _Layers:
    """Per module: (epoch, structure group, prefill switches), recomputed after :func:`invalidate`."""

    def __init__(self) -> None:
        self.info: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
        self.groups: dict[tuple, int] = {}

    def get(self, module: nn.Module) -> tuple[int, tuple]:
        hit = self.info.get(module)
        if hit is None or hit[0] != _EPOCH[0]:
            group = self.groups.setdefault(_fingerprint(module), len(self.groups))
            switches = tuple({id(s): s for m in module.modules()
                              if (s := getattr(m, "switch", None)) is not None and hasattr(s, "base")}.values())
            hit = (_EPOCH[0], group, switches)
            self.info[module] = hit
        return hit[1], hit[2]


_LAYERS = _Layers()


def signature(module: nn.Module, args: tuple) -> tuple | None:
    """The memo key of a call of a compiled function taking ``module`` and ``args``: None when an
    argument cannot be described (the call then always goes through dynamo).

    Holds: the module's structure group and ``training`` flag, each prefill switch's state
    (``base`` and the rows tensor's metadata), autograd/inference/autocast state and default
    dtype, and every argument (:func:`_leaf`)."""
    group, switches = _LAYERS.get(module)
    try:
        described = tuple(_leaf(a) for a in args)
        state = tuple((s.base, None if s.rows is None else _leaf(s.rows)) for s in switches)
    except TypeError:
        return None
    return (_EPOCH[0], group, module.training, state, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.get_default_dtype(), described)


class GuardMemo:
    """A ``torch.compile``'d function whose calls with a seen signature skip dynamo's guard check.

    Args:
        fn: the plain Python function that was compiled (its code object keys dynamo's cache).
        compiled: ``torch.compile(fn, ...)``.

    Call it as ``memo(key, *args)`` with ``key`` from :meth:`key` (None: always checked).
    ``checked`` and ``direct`` count the calls that went through dynamo and those that did not.
    Checked calls hold one process-wide lock, so that the entry read after a call is the one that
    call ran, whichever threads use compiled models.
    """

    def __init__(self, fn: Callable, compiled: Callable) -> None:
        self.code = fn.__code__
        self.globals = fn.__globals__
        self.name = fn.__name__
        self.compiled = compiled
        self.enabled = available()  # read once: without dynamo's cache list, no keys
        self.memo: dict[tuple, Callable | None] = {}
        self.epoch = _EPOCH[0]
        self.checked = 0
        self.direct = 0

    def key(self, module: nn.Module, args: tuple) -> tuple | None:
        """:func:`signature` of a call, or None (always checked) where the memo is unavailable."""
        return signature(module, args) if self.enabled else None

    def ready(self, key: tuple | None) -> bool:
        """Whether a call with ``key`` would skip the check (callers then skip their own
        compile-time preparation too)."""
        return key is not None and self.memo.get(key) is not None

    def __call__(self, key: tuple | None, *args: Any) -> Any:
        """Run the compiled function on ``args``: directly when ``key`` (from :func:`signature`,
        built from the same ``args``) was memoised, else through dynamo (which may compile).
        Returns what the function returns; raises what dynamo or the function raise."""
        if key is not None:
            if self.epoch != _EPOCH[0]:
                self.memo.clear()
                self.epoch = _EPOCH[0]
            fast = self.memo.get(key)
            if fast is not None:
                self.direct += 1
                return fast(*args)
        with _CHECKED:  # no other thread's call moves dynamo's entries between the call and _front
            self.checked += 1
            out = self.compiled(*args)
            if key is not None and key not in self.memo:
                if len(self.memo) >= MAX_ENTRIES:  # one per key length and variant: start over
                    self.memo.clear()
                self.memo[key] = self._front(args)
        return out

    def _front(self, args: tuple) -> Callable | None:
        """A function over the compiled code dynamo just ran for ``args``: its cache list's first
        entry, provided that entry's guards accept ``args`` (so dynamo would pick it for them);
        None otherwise, or when that code resumes after a graph break.

        The guard check matters where dynamo ran no entry at all: past ``recompile_limit`` it runs
        the function eagerly and leaves the list as it was, so the first entry belongs to other
        inputs (an integer argument specialised to another value would then give wrong results,
        silently; tests/test_guard_memo.py)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(self.code)
        if not entries:
            return None
        code = entries[0].code
        if any(n.startswith("__resume_at") for n in code.co_names) or code.co_freevars:
            return None
        own = self.code
        if own.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS) or len(args) != own.co_argcount:
            return None  # the frame's locals cannot be rebuilt from args alone
        if not entries[0].guard_manager.check(dict(zip(own.co_varnames, args))):
            return None
        return types.FunctionType(code, self.globals, self.name)
