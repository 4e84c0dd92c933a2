"""skipdecode.selection: the block-wise arg-max and top-k give torch.argmax's and torch.topk's
answers (ties: the first maximal position; NaN counted as the largest), and fall back to them for
shapes the blocks do not fit."""

from __future__ import annotations

import pytest
import torch

from skipdecode.selection import BLOCK, argmax_last, topk_indices


def _rows(B, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g)


@pytest.mark.parametrize("B", [2, 3, 16])
def test_argmax_equals_torch_with_ties_and_nan(B):
    x = _rows(B, 96 * BLOCK)
    x[0, 5 * BLOCK + 3] = x[0, 70 * BLOCK + 1] = x[0].max() + 1  # a tie across blocks: the first wins
    x[-1, 9] = x[-1, 10] = x[-1].max() + 2  # a tie inside a block
    assert torch.equal(argmax_last(x), x.argmax(dim=-1))
    assert argmax_last(x)[0].item() == 5 * BLOCK + 3 and argmax_last(x)[-1].item() == 9
    x[0, 4000] = x[0, 12] = float("nan")  # argmax picks the first NaN
    assert torch.equal(argmax_last(x), x.argmax(dim=-1)) and argmax_last(x)[0].item() == 12
    one = _rows(1, 768 * BLOCK)  # SmolLM2's vocabulary, one row
    assert torch.equal(argmax_last(one), one.argmax(dim=-1))


@pytest.mark.parametrize("B,k", [(1, 64), (5, 64), (16, 8), (2, 96)])
def test_topk_indices_is_torch_topks_set(B, k):
    x = _rows(B, 96 * BLOCK, seed=k)
    x[0, :BLOCK] += 10.0  # one block holds the whole top k of row 0 when k <= BLOCK
    got, want = topk_indices(x, k), x.topk(k, dim=-1).indices
    assert got.shape == (B, k)
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


def test_topk_keeps_nan_as_largest():
    x = _rows(2, 64 * BLOCK)
    x[1, 3000] = float("nan")
    assert 3000 in topk_indices(x, 4)[1].tolist()


def test_fallbacks_for_shapes_the_blocks_do_not_fit():
    odd = _rows(3, 49153)  # not a multiple of the block
    assert torch.equal(argmax_last(odd), odd.argmax(-1))
    assert torch.equal(topk_indices(odd, 5).sort(-1).values, odd.topk(5).indices.sort(-1).values)
    few = _rows(2, 4 * BLOCK)  # fewer blocks than k
    assert torch.equal(topk_indices(few, 8).sort(-1).values, few.topk(8).indices.sort(-1).values)
    strided = _rows(4, 8 * BLOCK).t().contiguous().t()[:, :BLOCK * 4]  # not contiguous
    assert torch.equal(argmax_last(strided), strided.argmax(-1))
    three = _rows(2, 3 * BLOCK).view(2, 3, BLOCK)
    assert torch.equal(argmax_last(three), three.argmax(-1))
    with pytest.raises(RuntimeError):
        topk_indices(_rows(1, 8), 9)
