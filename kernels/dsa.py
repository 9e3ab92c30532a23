"""DSA (DeepSeek sparse attention) indexer with k-pool compression: the torch reference.

Keys are grouped into pools of `kpool` consecutive positions (pool p = positions [p*kpool, (p+1)*kpool)). A
complete pool gets one compressed key: a per-channel softmax-weighted average of its tokens' keys, the weights
coming from the cached gate scores plus a learned per-slot bias (`ape`). A query at absolute position t scores
every complete pool that ends at or before t, keeps the `topk // kpool` best, and always adds its own incomplete
tail pool (positions t+1 - ((t+1) % kpool) .. t) as raw tokens. The result is a boolean mask over positions.

Ties are broken by the lowest pool index (a stable descending sort), so the selection is a pure function of the
scores — transformers' `torch.topk` has no documented tie order.
"""

from __future__ import annotations

import torch


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """Compressed keys of the complete pools. keys, gates: [L, d] (positions 0..L-1); ape: [kpool, d] -> [P, d]."""
    n_pools = keys.shape[0] // kpool
    k = keys[: n_pools * kpool].reshape(n_pools, kpool, keys.shape[-1])
    logits = gates[: n_pools * kpool].reshape(n_pools, kpool, gates.shape[-1]).float() + ape.float()
    probs = logits.softmax(dim=1).to(k.dtype)
    return (probs * k).sum(dim=1)


def index_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """Score of every pool for every query. q: [n, heads, d]; weights: [n, heads] (already scaled); pooled: [P, d].

    score[t, p] = sum_h weights[t, h] * relu(q[t, h] . pooled[p] * d^-1/2)  -> [n, P] fp32
    """
    s = torch.einsum("nhd,pd->nhp", q.float(), pooled.float()) * (q.shape[-1] ** -0.5)
    s = torch.relu(s)
    return torch.einsum("nh,nhp->np", weights.float(), s)


def select(scores: torch.Tensor, positions: torch.Tensor, context: int, kpool: int, topk: int,
           include_tail: bool) -> torch.Tensor:
    """Boolean attention mask [n, context] from pool scores [n, P] for queries at absolute `positions` [n]."""
    n, n_pools = scores.shape
    device = scores.device
    pool_end = torch.arange(n_pools, device=device) * kpool + (kpool - 1)
    visible = pool_end.unsqueeze(0) <= positions.unsqueeze(1)  # [n, P]
    keep = min(topk // kpool, n_pools)
    mask = torch.zeros(n, context, dtype=torch.bool, device=device)
    if keep > 0 and n_pools > 0:
        masked = scores.masked_fill(~visible, float("-inf"))
        order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :keep]
        chosen = visible.gather(1, order)  # a chosen pool must be visible (fewer visible pools than `keep`)
        pool_mask = torch.zeros(n, n_pools, dtype=torch.bool, device=device)
        pool_mask.scatter_(1, order, chosen)
        mask[:, : n_pools * kpool] = pool_mask.repeat_interleave(kpool, dim=1)
    if include_tail:
        pos = torch.arange(context, device=device).unsqueeze(0)
        tail_start = positions + 1 - (positions + 1) % kpool
        mask |= (pos >= tail_start.unsqueeze(1)) & (pos <= positions.unsqueeze(1))
    return mask
