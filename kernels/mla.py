"""Attention of NoPE MLA over a selected set of positions, in the absorbed (latent) form: the torch reference.

MLA keys and values are k = W_uk c and v = W_uv c of one shared latent row c per position. Folding W_uk into the
query (q_lat = W_uk^T q) and W_uv after the weighted sum means attention runs directly over the cached latent rows,
never expanding the context per head. Softmax in fp32.
"""

from __future__ import annotations

import torch


def latent_attention(q_lat: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat: [n, h, r]; latent: [L, r]; mask: [n, L] bool (True = attend) -> weighted latent [n, h, r] (fp32)."""
    scores = torch.einsum("nhr,lr->hnl", q_lat.float(), latent.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lr->nhr", probs, latent.float())


def sparse_latent_attention(q_lat: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float
                            ) -> torch.Tensor:
    """`latent_attention` over each query's own gathered rows: q_lat [n, h, r]; rows [n, S, r] (the latent rows of
    the positions the indexer selected for that query, ascending); valid [n, S] -> [n, h, r] fp32. Memory is
    n x S x r whatever the context length."""
    scores = torch.einsum("nhr,nsr->hns", q_lat.float(), rows.float()) * scale
    scores = scores.masked_fill(~valid.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hns,nsr->nhr", probs, rows.float())


def expanded_attention(q: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention in the expanded form, each position's latent row turned into per-head keys and values
    first: q [n, h, dn] (before W_uk is folded in); latent [L, r]; w_uk [h, dn, r]; w_uv [h, dv, r]; mask [n, L]
    -> [n, h, dv] fp32, which equals `latent_attention` of q_lat = W_uk^T q followed by W_uv. The GPU runs it for
    prompt rows that attend to their whole context (kernels/gpu/mla_expanded.py), where it costs half the FLOPs."""
    keys = torch.einsum("lr,hdr->lhd", latent.float(), w_uk.float())
    values = torch.einsum("lr,hvr->lhv", latent.float(), w_uv.float())
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~mask.unsqueeze(0), float("-inf")), dim=-1)
    return torch.einsum("hnl,lhv->nhv", probs, values)
