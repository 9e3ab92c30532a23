"""mHC around a block on the GPU. Torch twins: kernels/mhc.py (hc_weights, collapse, expand) and kernels/norms.py
(rms_norm), composed as `kernels.mhc.pre` / `kernels.mhc.post` do.

`pre`: the small projection of the flattened streams to (pre, post, comb), then per row the streams' RMS, the
Sinkhorn iterations, the collapse and the block's input RMSNorm — two launches per row class for what torch runs as
~60. The projection is [T, hc*D] x [hc*(2+hc), hc*D]^T: N is 24 for hc=4, K is 16,384 at D=4,096.
- Decode-class rows: `_proj_kernel` splits K into fixed chunks (a function of hc and D only) and writes each
  chunk's fp32 partial products; `_pre_row_kernel` sums them in chunk order and does the rest with the whole row
  in registers (one read of the streams, one write of the output). The general GEMM's decode schedule would tile
  N=24 into a 128-wide tile (81% of it padding) with K split only 16 ways (16 programs streaming fn at one row),
  then a third launch to sum the splits, and a row pass that streamed D in blocks read the row three times with 4
  warps (what that cost: docs/benchmarks.md, "Attention, KDA and mHC").
- Prompt rows: the projection by the fixed-schedule GEMM's prompt schedule (its narrow tile: N is 24), then the
  same register-resident row pass. (A program per row that streamed D in 1,024-wide blocks read the row twice and
  its output twice, about twice its bytes' time.)
`post`: the ordered sum of the row-parallel partials (virtual shard order), then the expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import gemm, pdl
from kernels.gpu.pdl import wait_for_inputs

# Decode projection: K elements per program (64 programs per 16 rows at K=16,384, each streaming a 12 KB slice of fn)
# and rows per program (tl.dot's smallest M: fn is read once per 16 rows, and a tile's row never reads another row).
_CHUNK = 256
_ROWS = 16


@triton.jit
def _hc_weights(m_pre, m_post, m_comb, base_ptr, scale_ptr, hc_eps, ITERS: tl.constexpr, HC: tl.constexpr,
                COPIES: tl.constexpr):
    """(pre [HC], post [HC], comb [HC, HC, COPIES]) from the RMS-scaled projection: sigmoids, then softmax +
    Sinkhorn. m_comb [HC, HC, COPIES] holds the matrix COPIES times over, and so does comb: the copies only shape
    the tile, so that the sums keep to one warp (`_pre_row_kernel` says why)."""
    st = tl.arange(0, HC)
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(m_pre * s_pre + tl.load(base_ptr + st)) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * s_post + tl.load(base_ptr + HC + st))
    at = st[:, None, None] * HC + st[None, :, None] + 0 * tl.arange(0, COPIES)[None, None, :]
    logits = m_comb * s_comb + tl.load(base_ptr + 2 * HC + at)
    e = tl.exp(logits - tl.max(logits, axis=1, keep_dims=True))
    comb = e / tl.sum(e, axis=1, keep_dims=True) + hc_eps
    comb = comb / (tl.sum(comb, axis=0, keep_dims=True) + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1, keep_dims=True) + hc_eps)
        comb = comb / (tl.sum(comb, axis=0, keep_dims=True) + hc_eps)
    return pre, post, comb


@triton.jit(do_not_specialize=["M"])  # one compiled kernel (one arithmetic) for M = 1 and M > 1
def _proj_kernel(x_ptr, fn_ptr, ws_ptr, M, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    """ws[row, chunk, :] = x[row, chunk's K] @ fn[:, chunk's K]^T in fp32, for BLOCK_M rows and one chunk of K."""
    wait_for_inputs(PDL)
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    chunk = tl.program_id(1)
    kk = chunk * CHUNK + tl.arange(0, CHUNK)
    rn = tl.arange(0, BLOCK_N)
    a = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
    b = tl.load(fn_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                other=0.0).to(x_ptr.dtype.element_ty)  # fn in the streams' dtype, as the GEMM's weight tiles
    if IEEE:  # fp32 streams (the fp32 test models): true fp32 products, as the GEMM (tl.dot would round to tf32)
        part = tl.dot(a, b, input_precision="ieee")
    else:
        part = tl.dot(a, b)
    out = ws_ptr + (rm[:, None] * tl.num_programs(1) + chunk) * N + rn[None, :]
    tl.store(out, part, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _pre_row_kernel(s_ptr, ws_ptr, base_ptr, scale_ptr, nw_ptr, h_ptr, post_ptr, comb_ptr, D, hc_eps, norm_eps,
                    rms_eps, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, ITERS: tl.constexpr, HC: tl.constexpr,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """One row, its whole [HC, D] streams held in registers: the projection summed from CHUNKS partials (the decode
    rows' `_proj_kernel` chunks, or the prompt rows' GEMM output as one), the RMS, the weights, the collapse and the
    block's RMSNorm, with one read of the streams and one write of the output."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    act = h_ptr.dtype.element_ty
    st = tl.arange(0, HC)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    x = tl.load(s_ptr + row * HC * D + st[:, None] * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (HC * D) + norm_eps)
    n_mix = HC * (2 + HC)
    # Every chunk's partials in three loads, summed over the chunk axis: a reduction tree fixed by CHUNKS_P2 (a
    # function of the shapes), so a row's sums never depend on its company; one load per chunk would be ~200
    # dependent small loads.
    ch = tl.arange(0, CHUNKS_P2)
    live = ch < CHUNKS
    parts = ws_ptr + row * CHUNKS * n_mix + ch * n_mix
    m_pre = tl.sum(tl.load(parts[:, None] + st[None, :], mask=live[:, None], other=0.0), axis=0)
    m_post = tl.sum(tl.load(parts[:, None] + HC + st[None, :], mask=live[:, None], other=0.0), axis=0)
    comb_at = parts[:, None, None] + 2 * HC + st[None, :, None] * HC + st[None, None, :]
    comb_tile = tl.load(comb_at, mask=live[:, None, None], other=0.0)
    # The Sinkhorn's 2 x ITERS sums over the [HC, HC] matrix run where it lies. Summed from a tile of many chunks,
    # it has its rows (i) on different warps, and each column sum would cross shared memory (two or three
    # barriers, most of the kernel's). So it goes out to this row's comb output (overwritten below) and back as
    # [HC, HC, CHUNKS_P2], the matrix CHUNKS_P2 times over: a tile of the partials' size and dtype, j contiguous
    # as there, which Triton splits over registers and lanes along j as it did the partials, the copies (not i)
    # taking the warps. Every sum then stays in a warp, with the order of additions the partials' layout gave it
    # (the same bits). One chunk (prompt rows): the rows are on lanes already.
    copy = tl.arange(0, CHUNKS_P2)
    comb_out = comb_ptr + row * HC * HC + st[:, None, None] * HC + st[None, :, None] + 0 * copy[None, None, :]
    if CHUNKS_P2 > 1:
        bounce = comb_ptr + row * HC * HC + st[None, :, None] * HC + st[None, None, :] + 0 * copy[:, None, None]
        tl.store(bounce, tl.sum(comb_tile, axis=0, keep_dims=True), mask=copy[:, None, None] == 0)
        tl.debug_barrier()  # every warp's part stored before any reads it back
        m_comb = tl.load(comb_out)
        tl.debug_barrier()  # and read back before any warp stores the result there
    else:
        m_comb = tl.sum(comb_tile, axis=0)[:, :, None]
    pre, post, comb = _hc_weights(m_pre * rstd, m_post * rstd, m_comb * rstd, base_ptr, scale_ptr, hc_eps, ITERS, HC,
                                  CHUNKS_P2)
    tl.store(post_ptr + row * HC + st, post)
    tl.store(comb_out, comb, mask=copy[None, None, :] == 0)

    # The collapse rounded to the activation dtype (as the twin) before its RMS, then the normalised output.
    cf = tl.sum(pre[:, None] * x, axis=0).to(act).to(tl.float32)
    rstd2 = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / D + rms_eps)
    w = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * D + d, (w * (cf * rstd2).to(act).to(tl.float32)).to(act), mask=dm)


def _decode_rows(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 norm_weight: torch.Tensor, h: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor, hc_eps: float,
                 norm_eps: float, rms_eps: float, *, iters: int) -> None:
    """`pre` for decode-class rows, written into h / post_w / comb: the split-K projection, then one program per
    row. The chunk count depends on hc and D only, so a row's sums never depend on how many rows share the call."""
    m, hc, d = streams.shape
    n_mix, k = fn.shape
    chunks = triton.cdiv(k, _CHUNK)
    ws = torch.empty(m, chunks, n_mix, dtype=torch.float32, device=streams.device)
    _proj_kernel[(triton.cdiv(m, _ROWS), chunks)](streams, fn, ws, m, k, n_mix, BLOCK_M=_ROWS,
                                                  BLOCK_N=max(16, triton.next_power_of_2(n_mix)), CHUNK=_CHUNK,
                                                  IEEE=streams.dtype == torch.float32, num_warps=4, **pdl.options())
    _row_pass(streams, ws, base, scale, norm_weight, h, post_w, comb, hc_eps, norm_eps, rms_eps, iters=iters)


def _row_pass(streams: torch.Tensor, ws: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
              norm_weight: torch.Tensor, h: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor, hc_eps: float,
              norm_eps: float, rms_eps: float, *, iters: int) -> None:
    """`_pre_row_kernel` over every row of `streams`, their projection in `ws` ([M, chunks, hc * (2 + hc)] fp32
    partials, summed in chunk order)."""
    m, hc, d = streams.shape
    chunks = ws.shape[1]
    block_d = triton.next_power_of_2(d)
    # About 32 fp32 stream values per thread (16 warps for hc=4, D=4,096): the row fits in registers.
    warps = min(16, max(4, hc * block_d // 1024))
    _pre_row_kernel[(m,)](streams, ws, base, scale, norm_weight, h, post_w, comb, d, hc_eps, norm_eps, rms_eps,
                          CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks), ITERS=iters, HC=hc,
                          BLOCK_D=block_d, num_warps=warps, **pdl.options())


def pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor,
        *, eps: float, norm_eps: float, rms_eps: float, iters: int, decode_rows: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (block input [T, D] normed, post [T, hc] fp32, comb [T, hc, hc] fp32).

    Rows [0, decode_rows) are decode-class, the rest prompt rows; each class runs its own two launches (see the
    module docstring). The projection is of the unnormalised streams (half-precision products summed in fp32),
    scaled by the row's RMS afterwards — the twin normalises first, the same value up to rounding."""
    t, hc, d = streams.shape
    streams = streams.contiguous()
    h = torch.empty(t, d, dtype=streams.dtype, device=streams.device)
    post_w = torch.empty(t, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device)
    split = min(max(decode_rows, 0), t)
    consts = (base.float().contiguous(), scale.float().contiguous(), norm_weight)
    eps_args = (float(eps), float(norm_eps), float(rms_eps))
    if split:
        s, outs = streams[:split], (h[:split], post_w[:split], comb[:split])
        _decode_rows(s, fn.contiguous(), *consts, *outs, *eps_args, iters=iters)
    if split < t:
        s = streams[split:]
        mixed = gemm.matmul(s.view(t - split, hc * d), fn, 0, torch.float32)  # one "chunk" of partials a row
        _row_pass(s, mixed.unsqueeze(1), *consts, h[split:], post_w[split:], comb[split:], *eps_args, iters=iters)
    return h, post_w, comb


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["T"])
def _post_kernel(parts_ptr, n_parts, T, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr,
                 BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
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
                                                 post_w, comb, out, d, HC=hc, BLOCK_D=block,
                                                 num_warps=4, **pdl.options())
    return out
