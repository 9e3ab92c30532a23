"""mHC around a block on the GPU, one program per row. Torch twins: kernels/mhc.py (hc_weights, collapse, expand)
and kernels/norms.py (rms_norm), composed as `kernels.mhc.pre` / `kernels.mhc.post` do.

`pre`: the small projection to (pre, post, comb) as a fixed-schedule GEMM, then per row the streams' RMS, the
Sinkhorn iterations, the collapse and the block's input RMSNorm — two launches for what torch runs as ~60.
`post`: the ordered sum of the row-parallel partials (virtual shard order), then the expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import gemm


@triton.jit
def _pre_kernel(s_ptr, mixed_ptr, base_ptr, scale_ptr, nw_ptr, h_ptr, post_ptr, comb_ptr, D, hc_eps, norm_eps,
                rms_eps, ITERS: tl.constexpr, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: RMS of the flattened streams scales the raw projection (`mixed` = streams @ fn^T, from the GEMM),
    then pre / post / comb with Sinkhorn, then the collapse and the block's RMSNorm."""
    row = tl.program_id(0).to(tl.int64)
    act = h_ptr.dtype.element_ty
    st = tl.arange(0, HC)
    flat_n = HC * D
    streams_row = s_ptr + row * flat_n
    sq = tl.zeros((HC,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(streams_row + st[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / flat_n + norm_eps)
    n_mix = HC * (2 + HC)
    m_pre = tl.load(mixed_ptr + row * n_mix + st) * rstd
    m_post = tl.load(mixed_ptr + row * n_mix + HC + st) * rstd
    m_comb = tl.load(mixed_ptr + row * n_mix + 2 * HC + st[:, None] * HC + st[None, :]) * rstd

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

    # The collapse (rounded to the activation dtype, as the twin), its RMS, then the normalised output.
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
        *, eps: float, norm_eps: float, rms_eps: float, iters: int, decode_rows: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (block input [T, D] normed, post [T, hc] fp32, comb [T, hc, hc] fp32).

    The projection of the flattened streams goes through the fixed-schedule GEMM (rows [0, decode_rows) are
    decode-class): unnormalised bf16 products summed in fp32, scaled by the row's RMS afterwards — the twin
    normalises first, the same value up to rounding."""
    t, hc, d = streams.shape
    streams = streams.contiguous()
    h = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    if t:
        mixed = gemm.matmul(streams.view(t, hc * d), fn, decode_rows, torch.float32)
        _pre_kernel[(t,)](streams, mixed, base.float().contiguous(), scale.float().contiguous(), norm_weight, h, post,
                          comb, d, float(eps), float(norm_eps), float(rms_eps), ITERS=iters, HC=hc,
                          BLOCK_D=min(1024, triton.next_power_of_2(d)), num_warps=4)
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
