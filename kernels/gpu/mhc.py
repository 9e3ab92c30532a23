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
`post_pre`: a block's `post` and the next block's `pre`. For decode-class rows one launch writes the new streams and
the next projection's chunk partials (each program 16 rows and one 256-wide slice of every stream: the expand's
inputs read once, and each chunk's partials from a `tl.dot` of `_proj_kernel`'s shapes and dtypes on the values as
stored, so the same bits), then the row pass: two launches a block boundary instead of three. Prompt rows run
`post`, then `pre`'s prompt path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gpu import gemm

# Decode projection: K elements per program (64 programs per 16 rows at K=16,384, each streaming a 12 KB slice of fn)
# and rows per program (tl.dot's smallest M: fn is read once per 16 rows, and a tile's row never reads another row).
_CHUNK = 256
_ROWS = 16


@triton.jit
def _hc_weights(m_pre, m_post, m_comb, base_ptr, scale_ptr, hc_eps, ITERS: tl.constexpr, HC: tl.constexpr):
    """(pre [HC], post [HC], comb [HC, HC]) from the RMS-scaled projection: sigmoids, then softmax + Sinkhorn."""
    st = tl.arange(0, HC)
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
    return pre, post, comb


@triton.jit(do_not_specialize=["M"])  # one compiled kernel (one arithmetic) for M = 1 and M > 1
def _proj_kernel(x_ptr, fn_ptr, ws_ptr, M, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr, IEEE: tl.constexpr):
    """ws[row, chunk, :] = x[row, chunk's K] @ fn[:, chunk's K]^T in fp32, for BLOCK_M rows and one chunk of K."""
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
                    BLOCK_D: tl.constexpr):
    """One row, its whole [HC, D] streams held in registers: the projection summed from CHUNKS partials (the decode
    rows' `_proj_kernel` chunks, or the prompt rows' GEMM output as one), the RMS, the weights, the collapse and the
    block's RMSNorm, with one read of the streams and one write of the output."""
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
    m_comb = tl.sum(tl.load(comb_at, mask=live[:, None, None], other=0.0), axis=0)
    pre, post, comb = _hc_weights(m_pre * rstd, m_post * rstd, m_comb * rstd, base_ptr, scale_ptr, hc_eps, ITERS, HC)
    tl.store(post_ptr + row * HC + st, post)
    tl.store(comb_ptr + row * HC * HC + st[:, None] * HC + st[None, :], comb)

    # The collapse rounded to the activation dtype (as the twin) before its RMS, then the normalised output.
    cf = tl.sum(pre[:, None] * x, axis=0).to(act).to(tl.float32)
    rstd2 = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / D + rms_eps)
    w = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * D + d, (w * (cf * rstd2).to(act).to(tl.float32)).to(act), mask=dm)


def _project(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """`_proj_kernel`: decode-class rows' projection partials [M, chunks, n_mix] fp32. The chunk count depends on hc
    and D only, so a row's sums never depend on how many rows share the call."""
    m = streams.shape[0]
    n_mix, k = fn.shape
    chunks = triton.cdiv(k, _CHUNK)
    ws = torch.empty(m, chunks, n_mix, dtype=torch.float32, device=streams.device)
    _proj_kernel[(triton.cdiv(m, _ROWS), chunks)](streams, fn.contiguous(), ws, m, k, n_mix, BLOCK_M=_ROWS,
                                                  BLOCK_N=_block_n(n_mix), CHUNK=_CHUNK,
                                                  IEEE=streams.dtype == torch.float32, num_warps=4)
    return ws


def _prompt_project(streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """Prompt rows' projection by the GEMM's prompt schedule, as one "chunk" of partials a row [M, 1, n_mix]."""
    m, hc, d = streams.shape
    return gemm.matmul(streams.view(m, hc * d), fn, 0, torch.float32).unsqueeze(1)


def _block_n(n_mix: int) -> int:
    return max(16, triton.next_power_of_2(n_mix))


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
                          BLOCK_D=block_d, num_warps=warps)


def _pre_outputs(streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pre`'s outputs for the rows of `streams`: block input [T, D], post [T, hc] fp32, comb [T, hc, hc] fp32."""
    t, hc, d = streams.shape
    return (torch.empty(t, d, dtype=streams.dtype, device=streams.device),
            torch.empty(t, hc, dtype=torch.float32, device=streams.device),
            torch.empty(t, hc, hc, dtype=torch.float32, device=streams.device))


def pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor,
        *, eps: float, norm_eps: float, rms_eps: float, iters: int, decode_rows: int
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, D] -> (block input [T, D] normed, post [T, hc] fp32, comb [T, hc, hc] fp32).

    Rows [0, decode_rows) are decode-class, the rest prompt rows; each class runs its own two launches (see the
    module docstring). The projection is of the unnormalised streams (half-precision products summed in fp32),
    scaled by the row's RMS afterwards — the twin normalises first, the same value up to rounding."""
    t = streams.shape[0]
    streams = streams.contiguous()
    h, post_w, comb = _pre_outputs(streams)
    split = min(max(decode_rows, 0), t)
    consts = (base.float().contiguous(), scale.float().contiguous(), norm_weight)
    eps_args = (float(eps), float(norm_eps), float(rms_eps))
    if split:
        s = streams[:split]
        _row_pass(s, _project(s, fn), *consts, h[:split], post_w[:split], comb[:split], *eps_args, iters=iters)
    if split < t:
        s = streams[split:]
        _row_pass(s, _prompt_project(s, fn), *consts, h[split:], post_w[split:], comb[split:], *eps_args,
                  iters=iters)
    return h, post_w, comb


@triton.jit
def _block_out(at, n_parts, shard_stride, mask, act: tl.constexpr):
    """The block's output at `at` (offsets into shard 0's partials): every virtual shard's fp32 partial summed in
    shard order (as Collective.sum_partials), rounded to the activation dtype as the twin rounds it."""
    total = tl.load(at, mask=mask, other=0.0)
    for s in range(1, n_parts):
        total += tl.load(at + s * shard_stride, mask=mask, other=0.0)
    return total.to(act).to(tl.float32)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
# Both expand kernels write stream j = post_j * out + sum_i comb[i, j] res_i with the sum over i written out in stream
# order (as the twin): the same arithmetic for every element whatever the tile, so a row's new streams have the same
# bits from either (a tl.sum would leave the order to the reduction's lowering).
@triton.jit(do_not_specialize=["shard_stride"])
def _post_kernel(parts_ptr, n_parts, shard_stride, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    act = out_ptr.dtype.element_ty
    out_f = _block_out(parts_ptr + row * D + d, n_parts, shard_stride, dm, act)
    st = tl.arange(0, HC)
    res_at = res_ptr + row * HC * D + d  # stream i at + i * D
    comb_at = comb_ptr + row * HC * HC + st  # comb[0, j]; comb[i, j] at + i * HC
    mixed = (tl.load(comb_at).to(act).to(tl.float32)[:, None]
             * tl.load(res_at, mask=dm, other=0.0).to(tl.float32)[None, :])  # [j, D]
    for i in tl.static_range(1, HC):
        mixed += (tl.load(comb_at + i * HC).to(act).to(tl.float32)[:, None]
                  * tl.load(res_at + i * D, mask=dm, other=0.0).to(tl.float32)[None, :])
    post = tl.load(post_ptr + row * HC + st).to(act).to(tl.float32)
    new = post[:, None] * out_f[None, :] + mixed
    tl.store(out_ptr + row * HC * D + st[:, None] * D + d[None, :], new.to(act), mask=dm[None, :])


@triton.jit(do_not_specialize=["shard_stride", "M"])
def _post_proj_kernel(parts_ptr, n_parts, shard_stride, res_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, ws_ptr, M, D,
                      N, HC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                      IEEE: tl.constexpr):
    """`_post_kernel` then the next block's `_proj_kernel`, for BLOCK_M rows and d in one CHUNK (D a multiple of
    CHUNK): each new stream j's [BLOCK_M, CHUNK] tile is stored and is the `a` tile of the projection's chunk
    j * D / CHUNK + c, so ws gets that chunk's partials from the same tl.dot as `_proj_kernel`'s."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.program_id(1)
    d = c * CHUNK + tl.arange(0, CHUNK)
    rn = tl.arange(0, BLOCK_N)
    live_rows = rm < M
    live = live_rows[:, None]
    act = out_ptr.dtype.element_ty
    k = HC * D
    out_f = _block_out(parts_ptr + rm[:, None] * D + d[None, :], n_parts, shard_stride, live, act)
    res_at = res_ptr + rm[:, None] * k + d[None, :]  # stream i at + i * D
    comb_at = comb_ptr + rm * HC * HC  # comb[i, j] at + i * HC + j
    for j in tl.static_range(HC):
        mixed = (tl.load(comb_at + j, mask=live_rows, other=0.0).to(act).to(tl.float32)[:, None]
                 * tl.load(res_at, mask=live, other=0.0).to(tl.float32))
        for i in tl.static_range(1, HC):
            mixed += (tl.load(comb_at + i * HC + j, mask=live_rows, other=0.0).to(act).to(tl.float32)[:, None]
                      * tl.load(res_at + i * D, mask=live, other=0.0).to(tl.float32))
        post = tl.load(post_ptr + rm * HC + j, mask=live_rows, other=0.0).to(act).to(tl.float32)
        a = (post[:, None] * out_f + mixed).to(act)
        tl.store(out_ptr + rm[:, None] * k + j * D + d[None, :], a, mask=live)
        kk = j * D + d  # the projection's chunk j * D / CHUNK + c, as _proj_kernel reads it
        b = tl.load(fn_ptr + rn[None, :] * k + kk[:, None], mask=rn[None, :] < N, other=0.0).to(act)
        if IEEE:
            part = tl.dot(a, b, input_precision="ieee")
        else:
            part = tl.dot(a, b)
        chunk = j * tl.num_programs(1) + c
        tl.store(ws_ptr + (rm[:, None] * HC * tl.num_programs(1) + chunk) * N + rn[None, :], part,
                 mask=live & (rn[None, :] < N))


def _post_rows(partials: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor,
               out: torch.Tensor) -> None:
    """`_post_kernel` into `out` for the rows of `residual`; partials [S, rows, D] may be a row slice of a contiguous
    [S, T, D] (its shards stride(0) apart)."""
    t, hc, d = residual.shape
    if t:
        block = min(1024, triton.next_power_of_2(d))
        _post_kernel[(t, triton.cdiv(d, block))](partials, partials.shape[0], partials.stride(0), residual, post_w,
                                                 comb, out, d, HC=hc, BLOCK_D=block, num_warps=4)


def _post_project(partials: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor,
                  fn: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`_post_proj_kernel` for the rows of `residual` (D a multiple of _CHUNK; partials [S, T, D] with those rows
    first): the new streams into `out`, and their projection partials by fn, as `_project` lays them out."""
    m, hc, d = residual.shape
    n_mix, k = fn.shape
    ws = torch.empty(m, k // _CHUNK, n_mix, dtype=torch.float32, device=residual.device)
    _post_proj_kernel[(triton.cdiv(m, _ROWS), d // _CHUNK)](
        partials, partials.shape[0], partials.stride(0), residual, post_w, comb, out, fn.contiguous(), ws, m, d,
        n_mix, HC=hc, BLOCK_M=_ROWS, BLOCK_N=_block_n(n_mix), CHUNK=_CHUNK, IEEE=residual.dtype == torch.float32,
        num_warps=4)
    return ws


def post(partials: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """partials [S, T, D] fp32 (every virtual shard's row-parallel partial, in shard order); residual [T, hc, D]
    -> new streams [T, hc, D]."""
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    _post_rows(partials.contiguous(), residual, post_w, comb, out)
    return out


def post_pre(partials: torch.Tensor, residual: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor,
             fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor, *, eps: float,
             norm_eps: float, rms_eps: float, iters: int, decode_rows: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`post` (partials, residual, post_w, comb), then `pre` of the next block (fn, base, scale, norm_weight and
    the eps / iters) on the new streams -> (new streams, block input, post, comb), the same bits as the two calls.

    Rows [0, decode_rows) are decode-class: `_post_proj_kernel`, then the row pass; prompt rows: `_post_kernel`,
    then the GEMM and the row pass. Where D is not a multiple of the projection's chunk (a chunk would span two
    streams), the two calls."""
    t, hc, d = residual.shape
    if d % _CHUNK:
        streams = post(partials, residual, post_w, comb)
        return streams, *pre(streams, fn, base, scale, norm_weight, eps=eps, norm_eps=norm_eps, rms_eps=rms_eps,
                             iters=iters, decode_rows=decode_rows)
    partials, residual = partials.contiguous(), residual.contiguous()
    streams = torch.empty_like(residual)
    h, post_next, comb_next = _pre_outputs(residual)
    split = min(max(decode_rows, 0), t)
    consts = (base.float().contiguous(), scale.float().contiguous(), norm_weight)
    eps_args = (float(eps), float(norm_eps), float(rms_eps))
    if split:
        s = streams[:split]
        ws = _post_project(partials, residual[:split], post_w, comb, fn, s)
        _row_pass(s, ws, *consts, h[:split], post_next[:split], comb_next[:split], *eps_args, iters=iters)
    if split < t:
        s = streams[split:]
        _post_rows(partials[:, split:], residual[split:], post_w[split:], comb[split:], s)
        _row_pass(s, _prompt_project(s, fn), *consts, h[split:], post_next[split:], comb_next[split:], *eps_args,
                  iters=iters)
    return streams, h, post_next, comb_next
