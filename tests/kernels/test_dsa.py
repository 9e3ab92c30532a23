"""kernels.dsa.select_positions (the CPU path's selection, a block of pools at a time) against the dense
`select` mask it replaces, and kernels.mla.sparse_latent_attention against `latent_attention` over that mask."""

from __future__ import annotations

import pytest
import torch

from kernels import dsa
from kernels.mla import latent_attention, sparse_latent_attention


def _as_mask(selected: torch.Tensor, context: int) -> torch.Tensor:
    mask = torch.zeros(selected.shape[0], context + 1, dtype=torch.bool)
    mask.scatter_(1, selected.clamp(min=-1) % (context + 1), True)  # -1 lands in the spare last column
    return mask[:, :context]


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("pool_block", [1, 3, 7, 1024])
def test_select_positions_is_the_dense_selection(tail: bool, pool_block: int) -> None:
    kpool, topk, context = 4, 12, 103
    g = torch.Generator().manual_seed(pool_block)
    # Few distinct values: many ties, which must go to the lowest pool index across block boundaries too.
    scores = torch.randint(0, 3, (context, context // kpool), generator=g).float()
    positions = torch.arange(context)
    want = dsa.select(scores, positions, context, kpool, topk, tail)
    got = dsa.select_positions(lambda p0, p1: scores[:, p0:p1], context // kpool, positions, kpool, topk, tail,
                               pool_block)
    assert got.shape == (context, topk + kpool)
    assert torch.equal(_as_mask(got, context), want)
    valid = got >= 0
    # ascending, padding last, each position once
    assert torch.equal(valid, valid.sort(dim=1, descending=True, stable=True).values)
    assert bool((got[:, 1:][valid[:, 1:]] > got[:, :-1][valid[:, 1:]]).all())


def test_sparse_attention_equals_masked_dense_attention() -> None:
    kpool, topk, context, r = 4, 8, 61, 16
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(context, r, generator=g)
    q_lat = torch.randn(context, 3, r, generator=g)
    scores = torch.randn(context, context // kpool, generator=g)
    positions = torch.arange(context)
    mask = dsa.select(scores, positions, context, kpool, topk, True)
    chosen = dsa.select_positions(lambda p0, p1: scores[:, p0:p1], context // kpool, positions, kpool, topk, True)
    want = latent_attention(q_lat, latent, mask, 0.25)
    got = sparse_latent_attention(q_lat, latent[chosen.clamp(min=0)], chosen >= 0, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
