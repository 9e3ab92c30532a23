"""DSA (DeepSeek sparse attention) indexer with k-pool compression: the torch reference.

Keys are grouped into pools of `kpool` consecutive positions (pool p = positions [p*kpool, (p+1)*kpool)). A
complete pool gets one compressed key: a per-channel softmax-weighted average of its tokens' keys, the weights
coming from the cached gate scores plus a learned per-slot bias (`ape`). A query at absolute position t scores
every complete pool that ends at or before t, keeps the `topk // kpool` best, and always adds its own incomplete
tail pool (positions t+1 - ((t+1) % kpool) .. t) as raw tokens. `select` returns a boolean mask over positions
(the dense reference the GPU tests compare with); `select_positions`, what the CPU path runs, the same selection as
position lists, scored a block of pools at a time so no buffer grows with the context.

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


def select_positions(scores_of, n_pools: int, positions: torch.Tensor, kpool: int, topk: int, include_tail: bool,
                     pool_block: int = 1024) -> torch.Tensor:
    """`select` without the [n, context] mask: the selected positions of each query, ascending, -1 padded
    ([n, (topk // kpool + 1) * kpool] int64), for a memory footprint flat in the context length.

    scores_of(p0, p1) -> [n, p1 - p0]: the queries' scores of pools p0 .. p1-1 (computed a block at a time by the
    caller). The best `topk // kpool` visible pools are kept as a running top-k across blocks with the same order as
    `select` (score descending, ties to the lowest pool index): candidates are the best so far (all of lower index
    than the new block, ties already in index order) followed by the block, and a stable sort keeps that order.
    """
    n, device = positions.shape[0], positions.device
    keep = topk // kpool
    best_v = torch.empty(n, 0, dtype=torch.float32, device=device)
    best_i = torch.empty(n, 0, dtype=torch.int64, device=device)
    for p0 in range(0, n_pools, pool_block):
        p1 = min(n_pools, p0 + pool_block)
        idx = torch.arange(p0, p1, device=device)
        visible = (idx * kpool + kpool - 1).unsqueeze(0) <= positions.unsqueeze(1)
        s = scores_of(p0, p1).float().masked_fill(~visible, float("-inf"))
        cand_v, cand_i = torch.cat([best_v, s], dim=1), torch.cat([best_i, idx.expand(n, -1)], dim=1)
        order = torch.sort(cand_v, dim=-1, descending=True, stable=True).indices[:, :keep]
        best_v, best_i = cand_v.gather(1, order), cand_i.gather(1, order)
    chosen = (best_i * kpool + kpool - 1) <= positions.unsqueeze(1)  # fewer visible pools than `keep`
    pos = (best_i.unsqueeze(-1) * kpool + torch.arange(kpool, device=device)).masked_fill(~chosen.unsqueeze(-1), -1)
    out = torch.full((n, (keep + 1) * kpool), -1, dtype=torch.int64, device=device)
    out[:, : pos.shape[1] * kpool] = pos.flatten(1)
    if include_tail:
        tail_start = positions + 1 - (positions + 1) % kpool
        tail = tail_start.unsqueeze(1) + torch.arange(kpool, device=device)
        out[:, keep * kpool :] = tail.masked_fill(tail > positions.unsqueeze(1), -1)
    # Ascending positions, padding last: attention then sums each row's keys in position order, whatever the chunk.
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(out.masked_fill(out < 0, big), dim=-1).values
    return ordered.masked_fill_(ordered == big, -1)
