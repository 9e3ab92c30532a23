"""Manifold-constrained hyper-connections (mHC): the torch reference.

The residual stream is `hc` parallel copies. Before a block, a small projection of the (normalised, flattened)
streams gives per-token `pre` (collapse weights), `post` (expand weights) and `comb` (an hc x hc mixing matrix made
doubly stochastic by Sinkhorn iterations). The block sees sum_i pre_i * stream_i; afterwards
stream_j <- post_j * block_out + sum_i comb[i, j] * stream_i.
"""

from __future__ import annotations

import torch

from kernels.linear import linear
from kernels.norms import unweighted_rms_norm


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, eps: float,
               norm_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams: [T, hc, D] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]) all fp32."""
    t, hc, _ = streams.shape
    flat = unweighted_rms_norm(streams.reshape(t, -1).float(), norm_eps)
    mixed = linear(flat, fn.float())
    pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * s_pre + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(t, hc, hc) * s_comb + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Block input: sum_i pre_i * stream_i (in fp32, cast back)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def expand(block_out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: stream_j = post_j * out + sum_i comb[i, j] * residual_i, summed in stream order."""
    dtype = residual.dtype
    post, comb = post.to(dtype), comb.to(dtype)
    mixed = comb[:, 0, :].unsqueeze(-1) * residual[:, 0:1, :]
    for i in range(1, residual.shape[1]):
        mixed = mixed + comb[:, i, :].unsqueeze(-1) * residual[:, i : i + 1, :]
    return post.unsqueeze(-1) * block_out.unsqueeze(1) + mixed
