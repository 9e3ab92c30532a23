"""`twinspark eval`'s arithmetic without a server: windows count every scored token once, and KL from top-k lists
is the KL of the bucketed distributions — never above the full-vocabulary KL, equal to it when the lists cover the
vocabulary, 0 for identical models."""

from __future__ import annotations

import math

import pytest
import torch

from services.evaluate.divergence import Divergence, Perplexity, kl_topk
from services.evaluate.windows import cut


@pytest.mark.parametrize("n, window, stride", [(10, 4, None), (11, 4, 4), (10, 4, 2), (100, 16, 5), (5, 8, None),
                                               (3, 2, 1)])
def test_windows_count_each_position_once(n, window, stride):
    ids = list(range(n))
    windows = cut(ids, window, stride)
    counted = [w.start + i for w in windows for i in range(w.counted_from, len(w.ids))]
    assert all(len(w.ids) <= window and w.counted_from >= 1 for w in windows)
    if stride in (None, window):  # non-overlapping: each window's first token is its context only
        assert counted == [p for p in range(n) if p % window]
    else:
        assert counted == list(range(1, n))
    assert sum(w.counted for w in windows) == len(counted)


def test_window_limits_and_refusals():
    assert len(cut(list(range(100)), 10, limit=3)) == 3
    assert cut([1], 4) == []
    with pytest.raises(ValueError):
        cut(list(range(10)), 4, 5)


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    v, i = torch.topk(logprobs, k)
    return list(zip(i.tolist(), v.tolist()))


def test_kl_from_top_k_is_a_lower_bound_that_closes_at_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.log_softmax(torch.randn(300, generator=g, dtype=torch.float64) * 3, -1)
        q = torch.log_softmax(p + 0.3 * torch.randn(300, generator=g, dtype=torch.float64), -1)
        exact = float((p.exp() * (p - q)).sum())
        approx = [kl_topk(_top(p, k), _top(q, k)) for k in (1, 5, 20, 300)]
        assert all(a <= exact + 1e-9 for a in approx)
        assert approx[-1] == pytest.approx(exact, rel=1e-9)
        assert approx[2] >= 0.3 * exact  # k = 20 of 300 ids keeps most of it for nearby distributions
    same = _top(p, 20)
    assert kl_topk(same, same) == 0.0


def test_summaries():
    d = Divergence()
    a = [(1, math.log(0.6)), (2, math.log(0.3))]
    d.add(a, a)
    d.add(a, [(2, math.log(0.6)), (1, math.log(0.3))])
    s = d.summary()
    assert s["positions"] == 2 and s["top1_agreement"] == 0.5 and s["kl_mean"] > 0
    ppl = Perplexity()
    ppl.add([math.log(0.5), math.log(0.25)])
    assert ppl.value == pytest.approx(math.sqrt(8)) and ppl.summary()["tokens"] == 2
