"""Sibling projections of a quantized decoder layer as one product: q/k/v, and gate/up.

Why. A Llama-style layer computes ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` from the same
input, and ``gate_proj(x)``, ``up_proj(x)`` from another: five weight-only products where two
would do. At one token per row each quantized product is mostly fixed cost (a kernel call, its
threads, w8a8's activation quantization), so fusing them pays: on the AVX2 test CPU, 2 threads,
one row, PyTorch's int4 kernel takes 148 us for q, k and v of the embedded model (576 -> 576,
192, 192) and 77 us for one 576 -> 960 product; gate and up (576 -> 1536 each) 203 us against
164 us fused (``docs/quantization.md``). llama.cpp's CPU backend and vLLM's ``QKVParallelLinear``
/ ``MergedColumnParallelLinear`` fuse the same way.

How. :func:`fuse_siblings` replaces a group of sibling ``nn.Linear`` modules (:data:`FUSED_GROUPS`,
same input width, all with or all without bias) by :class:`FusedSlice` modules sharing one
quantized linear over the concatenated weights (output rows stacked in group order). The first
member owns it (registered as ``fused``: counted once by ``state_dict``, ``.to``, resident
bytes); the others reach it through a plain attribute. The first member called computes the
whole product and keeps it with the input *tensor object* it came from; a sibling called with
that same tensor takes its columns of it; the last one drops it. Called with any other input a
member computes the product itself, so the result is always the fused product of the member's
own input, only the cost changes (eagerly the input's version counter is checked too, so an
input modified in place between two calls is recomputed; inside a compiled graph, and for
inference-mode tensors, which have no version counter, the identity alone decides: HF layers
never modify the input between the calls). The held product is one tuple read and replaced
whole, so threads sharing a model can only miss it, never take another input's.

LoRA. An adapter kept unmerged beside the quantized weights (int4, :mod:`skipdecode.lowrank`)
gets one low-rank path per group, around the fused product (stacked ``A``, block-diagonal ``B``:
:func:`skipdecode.lowrank.attach_lora`), so its thin products are fused too;
:func:`replace_group_linear` puts such a wrapper in the group's place.

Exactness. The quantized schemes here are per output row (int8 and w8a8: one scale per row;
int4: a step and zero per row and input group; w8a8's activations: one scale per input row), so
each output column of the fused product has the codes, scale and arithmetic of the separate one:
the fused layer equals the unfused quantized layer (tests check it to float rounding).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

__all__ = ["FUSED_GROUPS", "FusedSlice", "fuse_siblings", "replace_group_linear"]

#: sibling projection names computed from one input, each fused into one product (HF's Llama,
#: Mistral, Qwen2 attention and MLP names; GPT-2 and OPT name theirs otherwise or fuse already)
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Shared:
    """State of one fused group, a plain object (not a module) so that the fused linear is
    registered once, under the owning member."""

    def __init__(self, linear: nn.Module, members: int) -> None:
        self.linear = linear
        self.members = members
        # (input, its version, the product of it, siblings that may still take their columns) or
        # None: one tuple, read and replaced whole, so that a thread racing another on the same
        # model can only miss the held product, never take another input's
        self.held: tuple[torch.Tensor, int, torch.Tensor, int] | None = None
        self.owner: nn.Module | None = None  # the member that registers ``linear``


def _version(x: torch.Tensor) -> int:
    """``x``'s version counter (bumped by every in-place change); -1 for an inference tensor,
    which has none (``torch.inference_mode``)."""
    return -1 if x.is_inference() else x._version


class FusedSlice(nn.Module):
    """One projection of a fused group: output columns ``[start, stop)`` of the group's product.

    ``forward``: ``x`` (..., in_features) -> (..., stop - start), the same as the quantized
    projection it replaces (module docstring). Attributes ``in_features``, ``out_features``
    (features), ``start``, ``stop`` (columns of the fused product); the owner (first member) holds
    the fused linear as ``fused``.
    """

    def __init__(self, shared: _Shared, start: int, stop: int, owner: bool) -> None:
        super().__init__()
        if owner:
            self.fused = shared.linear
            shared.owner = self
        self._shared = shared
        self.start, self.stop = int(start), int(stop)
        self.in_features = int(shared.linear.in_features)
        self.out_features = self.stop - self.start

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        s = self._shared
        compiling = torch.compiler.is_compiling()
        held = s.held
        if held is not None and held[0] is x and (compiling or held[1] == _version(x)):
            _, version, y, pending = held
            s.held = None if pending <= 1 else (x, version, y, pending - 1)
            return y
        y = s.linear(x)
        s.held = (x, -1 if compiling else _version(x), y, s.members - 1)
        return y

    @property
    def group(self) -> _Shared:
        """The group's shared state: ``.linear`` (the fused linear), ``.members`` (count)."""
        return self._shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., out_features): this member's columns of the fused product."""
        return self._product(x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns={self.start}:{self.stop}"


def _fusable(children: list[nn.Module]) -> bool:
    if not all(type(c) is nn.Linear for c in children):
        return False
    first = children[0]
    return all(
        c.in_features == first.in_features and c.weight.dtype == first.weight.dtype
        and c.weight.device == first.weight.device and (c.bias is None) == (first.bias is None)
        for c in children
    )


@torch.no_grad()
def fuse_siblings(root: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every group of :data:`FUSED_GROUPS` siblings under ``root`` by :class:`FusedSlice`
    members over one linear ``make(nn.Linear(concatenated weights))`` (the quantizer).

    A group is fused only when all its names are plain ``nn.Linear`` children of one parent with
    the same input width, dtype and device, all with or all without bias; others are left as
    they are (for the caller to quantize one by one).

    Args:
        root: the decoder layers (an ``nn.ModuleList``) or any module above them.
        make: builds the quantized linear from a float ``nn.Linear`` (N_total, K).

    Returns:
        The number of groups fused.
    """
    count = 0
    for parent in list(root.modules()):
        for names in FUSED_GROUPS:
            children = [getattr(parent, n, None) for n in names]
            if any(c is None for c in children) or not _fusable(children):
                continue
            weight = torch.cat([c.weight for c in children], 0)
            joined = nn.Linear(weight.shape[1], weight.shape[0], bias=children[0].bias is not None,
                               device=weight.device, dtype=weight.dtype)
            joined.weight.copy_(weight)
            if joined.bias is not None:
                joined.bias.copy_(torch.cat([c.bias for c in children], 0))
            shared = _Shared(make(joined), len(children))
            start = 0
            for i, (name, child) in enumerate(zip(names, children)):
                stop = start + child.out_features
                setattr(parent, name, FusedSlice(shared, start, stop, owner=i == 0))
                start = stop
            count += 1
    return count


def replace_group_linear(member: FusedSlice, linear: nn.Module) -> None:
    """Make ``linear`` (same in/out features) the fused product of ``member``'s group, for every
    member, and register it under the group's owner (e.g. a LoRA wrapper around the old one,
    :func:`skipdecode.lowrank.attach_lora`).

    Raises:
        ValueError: ``linear``'s features differ from the group's; no owner holds the group.
    """
    shared = member.group
    old = shared.linear
    if (linear.in_features, linear.out_features) != (old.in_features, old.out_features):
        raise ValueError(f"replace_group_linear: the group computes {old.in_features} -> {old.out_features} "
                         f"features, got {linear.in_features} -> {linear.out_features}")
    if shared.owner is None:
        raise ValueError("replace_group_linear: no member of this group owns its fused linear")
    shared.owner.fused = linear
    shared.linear = linear
