"""Kimi Delta Attention (KDA): the torch reference forms.

Per head, with a recurrent state S (dk x dv, fp32), each token does
    S <- diag(exp(g)) S;  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T q
with q, k l2-normalised and q scaled by dk^-1/2. `recurrent` runs that literally (decode rows); `chunked` is the
WY/UT-transform chunk form used for prefill (same maths, fewer sequential steps). Both take and return the state
explicitly so the caller owns where states live (per-sequence slots in the paged cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.norms import l2_norm


def _prepare(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = l2_norm(q.float())
    k = l2_norm(k.float())
    return q * (q.shape[-1] ** -0.5), k


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B independent sequences.

    q, k, g: [B, H, dk]; v: [B, H, dv]; beta: [B, H]; state: [B, H, dk, dv] fp32.
    Returns (o [B, H, dv] fp32, new state [B, H, dk, dv] fp32).
    """
    q, k = _prepare(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float() * g.exp().unsqueeze(-1)
    kv_mem = (s * k.unsqueeze(-1)).sum(-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (s * q.unsqueeze(-1)).sum(-2)
    return o, s


def _intra_chunk(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk WY terms for chunks [H, n, C, d]: (u = A v_beta, w = A (k_beta e^g), decay [H, n, C, C, dk]).

    A = (I + L)^-1 with L strictly lower, L_ij = beta_i k_i . (decay_ij * k_j), solved by forward substitution.
    """
    c = k.shape[-2]
    incl = torch.triu(torch.ones(c, c, dtype=torch.bool, device=k.device), diagonal=0)
    strict = torch.triu(torch.ones(c, c, dtype=torch.bool, device=k.device), diagonal=1)
    k_beta = k * beta.unsqueeze(-1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp()
    a = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1).masked_fill(incl, 0)
    for i in range(1, c):
        row = a[..., i, :i].clone()
        sub = a[..., :i, :i].clone()
        a[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    a = a + torch.eye(c, dtype=a.dtype, device=a.device)
    return a @ (v * beta.unsqueeze(-1)), a @ (k_beta * g.exp()), decay


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = 64, group: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of one sequence in chunks.

    q, k, g: [T, H, dk]; v: [T, H, dv]; beta: [T, H]; state: [H, dk, dv] fp32.
    Returns (o [T, H, dv] fp32, final state [H, dk, dv] fp32). The intra-chunk terms are built `group` chunks at a
    time so memory stays bounded for long prompts (the decay tensor is C x C x dk per chunk and head).
    """
    q, k = _prepare(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    t_len = q.shape[0]
    pad = (-t_len) % chunk
    # [H, T, d]; zero padding at the end leaves the state untouched (k = 0, beta = 0, g = 0 -> decay 1).
    q, k, v, g = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta.transpose(0, 1), (0, pad))
    h = q.shape[0]
    n = q.shape[1] // chunk
    q, k, v, g = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(h, n, chunk)
    g = g.cumsum(-2)
    strict = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=1)

    s = state.float()
    out = torch.empty(h, n, chunk, v.shape[-1], dtype=torch.float32, device=q.device)
    for g0 in range(0, n, group):
        grp = slice(g0, min(g0 + group, n))
        u, w, decay = _intra_chunk(k[:, grp], v[:, grp], g[:, grp], beta[:, grp])
        for i, c in enumerate(range(grp.start, grp.stop)):
            q_c, k_c, g_c = q[:, c], k[:, c], g[:, c]
            inter = (q_c * g_c.exp()) @ s
            intra = (q_c.unsqueeze(-2) * k_c.unsqueeze(-3) * decay[:, i]).sum(-1).masked_fill(strict, 0)
            v_new = u[:, i] - w[:, i] @ s
            out[:, c] = inter + intra @ v_new
            s = s * g_c[:, -1].exp().unsqueeze(-1) + (k_c * (g_c[:, -1:] - g_c).exp()).transpose(-1, -2) @ v_new
    out = out.reshape(h, n * chunk, -1)[:, :t_len].transpose(0, 1)
    return out, s


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over new rows, for one sequence or a batch of them.

    x: [..., T, C] new inputs; weight: [C, K]; history: [..., K-1, C] the previous K-1 inputs (zeros at a
    sequence's start). out[t] = silu(sum_j weight[:, j] * ext[t + j]) with ext = history ++ x — KDA's short conv,
    summed tap by tap in a fixed order.
    """
    kernel = weight.shape[1]
    t_len = x.shape[-2]
    ext = torch.cat([history.to(x.dtype), x], dim=-2).float()
    w = weight.float()
    acc = ext[..., 0:t_len, :] * w[:, 0]
    for j in range(1, kernel):
        acc = acc + ext[..., j : j + t_len, :] * w[:, j]
    return F.silu(acc).to(x.dtype)


def conv_history(x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """The last K-1 inputs after appending x ([..., T, C]): the conv state to keep for the next step."""
    keep = history.shape[-2]
    if not keep:
        return history
    # only x's last `keep` rows can stay: concatenating a whole prompt chunk first would copy all of it
    tail = x[..., max(x.shape[-2] - keep, 0) :, :]
    return torch.cat([history.to(x.dtype), tail], dim=-2)[..., tail.shape[-2] :, :]
