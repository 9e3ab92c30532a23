"""Mixture-of-experts pieces: the sigmoid `noaux_tc` router and the clamped-SwiGLU experts (torch reference).

Exactness rules: router ties go to the lowest expert index (stable sorts, not `torch.topk`), and a row's routed
outputs are accumulated in ascending expert order whatever else shares the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.linear import linear, linear_fp32, pad_rows


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lowest index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D] -> (expert ids [T, k] int64, weights [T, k] fp32).

    Choice uses sigmoid scores + the correction bias; the weights are the unbiased sigmoid scores, normalised and
    scaled by `routed_scaling_factor`.
    """
    scores = linear(x.float(), weight.float()).sigmoid()
    choice = scores + bias.float()
    t, e = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_score = torch.sort(grouped, dim=-1, descending=True).values[..., :2].sum(-1)
        keep_groups = _top(group_score, topk_group)
        group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=x.device).scatter_(1, keep_groups, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = _top(choice, top_k)
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scaling


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
            down_w: torch.Tensor, limit: float) -> torch.Tensor:
    """Routed experts over one slice of their intermediate dim.

    x: [T, D]; ids, weights: [T, k]; gate_w, up_w: [E, I, D]; down_w: [E, D, I] -> [T, D] fp32 (this slice's share).
    """
    out = torch.zeros(x.shape[0], down_w.shape[1], dtype=torch.float32, device=x.device)  # fp32 partial sums
    hit = torch.unique(ids).tolist()  # ascending, so every row sums its experts in index order
    for e in hit:
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = pad_rows(x[rows])  # a row count that varies with the batch must not change SiLU's code path
        h = swiglu(linear(xe, gate_w[e]), linear(xe, up_w[e]), limit)
        y = linear_fp32(h, down_w[e])[: rows.numel()] * weights[rows, slot].unsqueeze(-1).float()
        out.index_add_(0, rows, y)
    return out
