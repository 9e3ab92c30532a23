"""mHC around a block on the GPU, one program per row. Torch twins: kernels/mhc.py (hc_weights, collapse, expand)
and kernels/norms.py (rms_norm), composed as `kernels.mhc.pre` / `kernels.mhc.post` do.

`pre`: the streams' RMS statistics, the small projection to (pre, post, comb), the Sinkhorn iterations, the
collapse and the block's input RMSNorm — one pass of reads for what torch runs as ~60 small kernels.
`post`: the ordered sum of the row-parallel partials (virtual shard order), then the expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pre_kernel(s_ptr, fn_ptr, base_ptr, scale_ptr, nw_ptr, h_ptr, post_ptr, comb_ptr, D, hc_eps, norm_eps, rms_eps,
                ITERS: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    act = h_ptr.dtype.element_ty
    st = tl.arange(0, HC)
    flat_n = HC * D
    streams_row = s_ptr + row * flat_n
    # Pass 1 over the flattened streams: sum of squares, and the three projections (rows of fn: pre, post, comb).
    a = tl.arange(0, HC * HC)
    # Each chunk's contribution is reduced over d at once (fixed chunk order), keeping the accumulators small.
    sq = tl.zeros((HC,), tl.float32)
    acc_pre = tl.zeros((HC, HC), tl.float32)
    acc_post = tl.zeros((HC, HC), tl.float32)
    acc_comb = tl.zeros((HC * HC, HC), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(streams_row + st[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        col = st[None, :, None] * D + d[None, None, :]  # flat column of (stream, d)
        m3 = dm[None, None, :]
        f_pre = tl.load(fn_ptr + st[:, None, None] * flat_n + col, mask=m3, other=0.0).to(tl.float32)
        f_post = tl.load(fn_ptr + (HC + st[:, None, None]) * flat_n + col, mask=m3, other=0.0).to(tl.float32)
        f_comb = tl.load(fn_ptr + (2 * HC + a[:, None, None]) * flat_n + col, mask=m3, other=0.0).to(tl.float32)
        acc_pre += tl.sum(f_pre * x[None, :, :], axis=2)
        acc_post += tl.sum(f_post * x[None, :, :], axis=2)
        acc_comb += tl.sum(f_comb * x[None, :, :], axis=2)
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / flat_n + norm_eps)
    m_pre = tl.sum(acc_pre, axis=1) * rstd
    m_post = tl.sum(acc_post, axis=1) * rstd
    m_comb = tl.reshape(tl.sum(acc_comb, axis=1) * rstd, (HC, HC))

    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(m_pre * s_pre + tl.load(base_ptr + st)) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * s_post + tl.load(base_ptr + HC + st))
    logits = m_comb * s_comb + tl.load(base_ptr + 2 * HC + st[:, None] * HC + st[None, :])
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(post_ptr + row * HC + st, post)
    tl.store(comb_ptr + row * HC * HC + st[:, None] * HC + st[None, :], comb)

    # Pass 2: the collapse (rounded to the activation dtype, as the twin), its RMS, then the normalised output.
    sq2 = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        x = tl.load(streams_row + st[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        col = tl.sum(pre[:, None] * x, axis=0).to(act)
        tl.store(h_ptr + row * D + d, col, mask=dm)
        cf = col.to(tl.float32)
        sq2 += cf * cf
    rstd2 = 1.0 / tl.sqrt(tl.sum(sq2, axis=0) / D + rms_eps)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        dm = d < D
        cf = tl.load(h_ptr + row * D + d, mask=dm, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * D + d, (w * (cf * rstd2).to(act).to(tl.float32)).to(act), mask=dm)


def pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor,
        *, eps: float, norm_eps: float, rms_eps: float, iters: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (block input [T, D] normed, post [T, hc] fp32, comb [T, hc, hc] fp32)."""
    t, hc, d = streams.shape
    streams = streams.contiguous()
    h = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    if t:
        _pre_kernel[(t,)](streams, fn, base.float().contiguous(), scale.float().contiguous(), norm_weight, h, post,
                          comb, d, float(eps), float(norm_eps), float(rms_eps), ITERS=iters, HC=hc,
                          BLOCK_D=min(128, triton.next_power_of_2(d)), num_warps=8)
    return h, post, comb


@triton.jit
def _post_kernel(parts_ptr, n_parts, T, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    act = out_ptr.dtype.element_ty
    block_out = tl.load(parts_ptr + row * D + d, mask=dm, other=0.0)
    for s in range(1, n_parts):  # partials summed in virtual-shard order, as Collective.sum_partials does
        block_out += tl.load(parts_ptr + (s * T + row) * D + d, mask=dm, other=0.0)
    out_f = block_out.to(act).to(tl.float32)
    st = tl.arange(0, HC)
    res = tl.load(res_ptr + row * HC * D + st[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    post = tl.load(post_ptr + row * HC + st).to(act).to(tl.float32)
    comb = tl.load(comb_ptr + row * HC * HC + st[:, None] * HC + st[None, :]).to(act).to(tl.float32)  # [i, j]
    mixed = tl.sum(comb[:, :, None] * res[:, None, :], axis=0)  # [j, D]: sum_i comb[i, j] res_i
    new = post[:, None] * out_f[None, :] + mixed
    tl.store(out_ptr + row * HC * D + st[:, None] * D + d[None, :], new.to(act), mask=dm[None, :])


def post(partials: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """partials [S, T, D] fp32 (every virtual shard's row-parallel partial, in shard order); residual [T, hc, D]
    -> new streams [T, hc, D]."""
    t, hc, d = residual.shape
    out = torch.empty_like(residual)
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _post_kernel[(t, triton.cdiv(d, block))](partials.contiguous(), partials.shape[0], t, residual.contiguous(),
                                                 post_w, comb, out, d, HC=hc, BLOCK_D=block, num_warps=4)
    return out
