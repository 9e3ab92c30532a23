"""Keyed sampling gives the same ids, noise and filtered logits on CUDA as on CPU, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling import filter_logits, gumbel_noise, sample
from tests.kernels.test_sampling import GOLDEN_IDS, GOLDEN_ROWS, _exact_logits, _params, _random_row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(8)
    vocab = 154_880
    rows = [_random_row(gen, vocab) for _ in range(32)]
    logits = torch.randn(32, vocab, generator=gen) * 4
    logits[:, :64] = logits[:, :64].round()  # plenty of ties
    pos = torch.randint(0, 2**40, (32,), generator=gen)
    pc, pg = _params(rows), _params(rows, "cuda")
    assert torch.equal(gumbel_noise(pc.seed, pos, vocab), gumbel_noise(pg.seed, pos.cuda(), vocab).cpu())
    assert torch.equal(filter_logits(logits, pc), filter_logits(logits.cuda(), pg).cpu())
    assert torch.equal(sample(logits, pos, pc), sample(logits.cuda(), pos.cuda(), pg).cpu())
    golden = sample(_exact_logits(len(GOLDEN_ROWS), 5000).cuda(),
                    (torch.arange(len(GOLDEN_ROWS)) * 1000 + 17).cuda(), _params(GOLDEN_ROWS, "cuda"))
    assert golden.tolist() == GOLDEN_IDS
