"""Fused mixture-of-experts on the GPU: router top-k, tokens grouped by expert, one launch per projection for every
expert hit, and a combine in fixed expert order. The torch twin is `kernels/moe.py` (route + experts + the shared
expert added last).

Layout: the shared expert is stored as one more expert (index E, after the E routed ones) that every real row
takes with weight 1, so it rides in the same grouped launches. Each row therefore has `k + 1` (token, expert)
pairs, its routed experts in ascending index order and the shared one last; padding rows (past `n_real`) get a
sentinel expert id and are never routed (docs/design.md §5.1).

Exactness: every (token, expert) product is one row of a tensor-core tile whose K order is fixed by the schedule,
so it does not depend on which other tokens share the expert's tile; the combine adds a row's pair outputs in its
own pair order (ascending expert, shared last) — the order of the torch twin. Nothing here syncs with the host:
the grouping is built with device-side sorts and scans, and the grouped launches cover an upper bound of blocks,
the unused ones returning at once.

EXL3 experts (`_experts_exl3`) run the same grouping and tiles, with each projection's rows rotated around it
(kernels/gpu/hadamard.py): every slot takes its token's row times its expert's suh, a grouped GEMM over the decoded
trellis tiles, then its expert's output rotation; SwiGLU, routing weight and combine as above. Row-wise steps and
slot rows that never read one another keep the invariance. Their decode-class grouped products run the
hand-written CUDA kernel where it is built (kernels/gpu/exl3_cuda.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.gpu import arch as gpu_arch, exl3_cuda, hadamard, int_moe
from kernels.gpu.int_moe import IntExperts
from kernels.gpu.moe_groups import Groups, SlotTables, group_pairs, slot_tables
from kernels.gpu.swiglu import clamped_swiglu
from kernels.gpu.gemm import RowClass
from kernels.gpu.tile_order import launch_tile
from kernels.gpu.wtiles import Fmt, WeightArgs, dense, weight_tile


@dataclass(frozen=True)
class MoeTile:
    block_m: int  # pairs per grouped tile (one expert per tile)
    block_n: int
    block_k: int
    warps: int
    stages: int
    group_m: int = 8  # row tiles that sweep the column tiles together (tile_order.py): L2 reuse, same bits


# Pipeline stages of the decode tile per architecture (kernels/gpu/arch.py): Hopper 4 (108 KiB of shared memory);
# GB10 has 99 KiB a block, so 3 (72 KiB; bench.kernel_census), as the GEMM's decode tile takes. Stages pipeline the
# loads, not the arithmetic: the bits are Hopper's. Not timed on a GB10 yet.
_DECODE_STAGES = {gpu_arch.HOPPER: 4, gpu_arch.GB10: 3}


def moe_schedule(rows: RowClass, arch: int = gpu_arch.HOPPER) -> MoeTile:
    """Grouped-GEMM tiles per row class and architecture row (pure function of both; the shapes come from the
    weights). The prompt tile won bench/kernels.py's sweep at 8,192 tokens (docs/benchmarks.md)."""
    if rows is RowClass.PREFILL:
        return MoeTile(block_m=128, block_n=128, block_k=64, warps=8, stages=3)
    return MoeTile(block_m=16, block_n=64, block_k=128, warps=4, stages=_DECODE_STAGES[arch])


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, E, scaling,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr):
    """Per row: sigmoid scores, + correction bias for the choice, top-k (ties -> lowest index), weights =
    unbiased scores normalised over the chosen and scaled. Writes k pairs, routed ascending, then (SHARED) the
    shared expert's pair."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    out_ids = ids_ptr + row * (TOP_K + SHARED)
    out_w = w_ptr + row * (TOP_K + SHARED)
    if row >= tl.load(n_real_ptr):  # padding row: no pairs at all
        for j in tl.static_range(TOP_K + SHARED):
            tl.store(out_ids + j, E + 1)
            tl.store(out_w + j, 0.0)
        return
    logit = tl.load(logits_ptr + row * E + e, mask=valid, other=0.0)
    score = tl.sigmoid(logit)
    choice = tl.where(valid, score + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    chosen = e < 0
    for _ in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        first = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)  # lowest index among the maxima
        chosen = chosen | (e == first)
        choice = tl.where(e == first, float("-inf"), choice)
    weight = tl.where(chosen, score, 0.0)
    if NORM:
        weight = weight / (tl.sum(weight, axis=0) + 1e-20)
    weight = weight * scaling
    rank = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending expert order
    tl.store(out_ids + rank, e.to(tl.int32), mask=chosen)
    tl.store(out_w + rank, weight, mask=chosen)
    if SHARED:
        tl.store(out_ids + TOP_K, E)
        tl.store(out_w + TOP_K, 1.0)


def route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, norm_topk_prob: bool, scaling: float,
          n_real: int | torch.Tensor, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (ids [T, k+1] int32, weights [T, k+1] fp32); id E = the shared expert, E+1 = none.
    Rows from n_real on are padding (an int, or an int32 device scalar a CUDA graph can refill). shared=False:
    k pairs per row (the shared expert runs apart, e.g. when it is stored in another format than the routed)."""
    t, e = logits.shape
    if not isinstance(n_real, torch.Tensor):
        n_real = torch.tensor([n_real], dtype=torch.int32, device=logits.device)
    pairs = top_k + int(shared)
    ids = torch.empty(t, pairs, dtype=torch.int32, device=logits.device)
    w = torch.empty(t, pairs, dtype=torch.float32, device=logits.device)
    if t:
        # One warp a row: its top-k's reductions stay in the warp (bench.ptx_stats, sm_90: 52 bar.sync with the
        # default 4 warps, none with 1); a row is a few hundred scores.
        _route_kernel[(t,)](logits.contiguous(), bias.float().contiguous(), ids, w, n_real, e, float(scaling),
                            TOP_K=top_k, NORM=bool(norm_topk_prob), BLOCK_E=triton.next_power_of_2(e),
                            SHARED=int(shared), num_warps=1)
    return ids, w


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, gate_s_ptr, up_ptr, up_s_ptr, h_ptr, pair_ptr, expert_ptr, num_experts, I, D,
                    limit, swe, swn, swk, sse, ssn, ssk,
                    PAIRS_PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr):
    """h[slot] = silu(min(x g^T, limit)) * clamp(x u^T, -limit, limit) for each slot of one expert tile."""
    blk, pid_n = launch_tile(I, BLOCK_N, GROUP_M)
    expert = tl.load(expert_ptr + blk)
    if expert >= num_experts:
        return
    slots = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + slots)
    has = pair >= 0
    token = tl.where(has, pair // PAIRS_PER_ROW, 0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    e = expert.to(tl.int64)
    act = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + rk
        a = tl.load(x_ptr + token[:, None] * D + kk[None, :], mask=has[:, None] & (kk[None, :] < D), other=0.0)
        g = weight_tile(gate_ptr + e * swe, gate_s_ptr + e * sse, rn, k0, I, D, swn, swk, ssn, ssk, FMT, BLOCK_N,
                        BLOCK_K, SB_N, SB_K, act)
        u = weight_tile(up_ptr + e * swe, up_s_ptr + e * sse, rn, k0, I, D, swn, swk, ssn, ssk, FMT, BLOCK_N,
                        BLOCK_K, SB_N, SB_K, act)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
    # The torch twin rounds each projection to the activation dtype, then SiLU, then the product: do the same.
    h = clamped_swiglu(acc_g.to(act).to(tl.float32), acc_u.to(act).to(tl.float32), limit, act)
    tl.store(h_ptr + slots[:, None] * I + rn[None, :], h, mask=has[:, None] & (rn[None, :] < I))


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_pairs"])
def _down_kernel(h_ptr, down_ptr, down_s_ptr, y_ptr, pair_ptr, expert_ptr, rw_ptr, num_experts, I, D, n_pairs,
                 swe, swn, swk, sse, ssn, ssk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr):
    """y[shard, pair] = (h[slot, shard's I columns] @ down[shard, expert]^T) * routing weight, in fp32, stored by
    pair (row-major per row). Shard s reads columns [s*I, (s+1)*I) of h and expert block s*num_experts + e."""
    blk, pid_n = launch_tile(D, BLOCK_N, GROUP_M)
    shard = tl.program_id(1)
    expert = tl.load(expert_ptr + blk)
    if expert >= num_experts:
        return
    slots = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + slots)
    has = pair >= 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    e = (shard * num_experts + expert).to(tl.int64)
    h_width = I * tl.num_programs(1)
    act = h_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + rk
        a = tl.load(h_ptr + slots[:, None] * h_width + shard * I + kk[None, :], mask=has[:, None] & (kk[None, :] < I),
                    other=0.0)
        b = weight_tile(down_ptr + e * swe, down_s_ptr + e * sse, rn, k0, D, I, swn, swk, ssn, ssk, FMT, BLOCK_N,
                        BLOCK_K, SB_N, SB_K, act)
        acc = tl.dot(a, b, acc)
    weight = tl.load(rw_ptr + tl.where(has, pair, 0), mask=has, other=0.0)
    y = acc * weight[:, None]
    out = y_ptr + shard.to(tl.int64) * n_pairs * D
    tl.store(out + tl.where(has, pair, 0).to(tl.int64)[:, None] * D + rn[None, :], y,
             mask=has[:, None] & (rn[None, :] < D))


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["T", "out_rows", "row0"])
def _combine_kernel(y_ptr, ids_ptr, rw_ptr, out_ptr, num_experts, D, T, out_rows, row0, PAIRS_PER_ROW: tl.constexpr,
                    BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, ROUNDED_MUL: tl.constexpr):
    """out[shard, row0 + row] = sum of the row's pair outputs in pair order (routed ascending, shared last); 0 for
    padding. (out has out_rows rows per shard: this call's T rows are one row class's run of them.) WEIGHTED: the
    pair outputs (any dtype) are not yet weighted: each is times its routing weight in fp32, rounded before the add
    (ROUNDED_MUL; an fma would round once fewer, other bits than the torch twin's product-then-sum)."""
    row = tl.program_id(0)
    shard = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    y_ptr += shard * T * PAIRS_PER_ROW * D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(PAIRS_PER_ROW):
        expert = tl.load(ids_ptr + row * PAIRS_PER_ROW + j)
        part = tl.load(y_ptr + (row * PAIRS_PER_ROW + j).to(tl.int64) * D + cols,
                       mask=mask & (expert < num_experts), other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(rw_ptr + row * PAIRS_PER_ROW + j, mask=expert < num_experts, other=0.0)
            part = libdevice.mul_rn(part, w) if ROUNDED_MUL else part * w
        acc += part
    tl.store(out_ptr + (shard * out_rows + row0 + row) * D + cols, acc, mask=mask)


def combine(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int, row0: int,
            weights: torch.Tensor | None = None) -> None:
    """out[s, row0 + row] (fp32) = the row's pair outputs y[s, row * P + j] added in pair order; y [shards x T x P,
    D] (or [shards, T x P, D]), times `weights` [T, P] first when given (else y is already weighted)."""
    t, pairs_per_row = ids.shape
    d = out.shape[-1]
    shards = y.numel() // (t * pairs_per_row * d) if t else 0
    block = 1024
    if t:
        _combine_kernel[(t, triton.cdiv(d, block), shards)](
            y, ids, y if weights is None else weights, out, num_experts, d, t, out.shape[1], row0,
            PAIRS_PER_ROW=pairs_per_row, BLOCK=block, WEIGHTED=weights is not None,
            ROUNDED_MUL=not hadamard.INTERPRETED)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_pairs", "out_rows", "row0"])
def _combine_rotated_kernel(acc_ptr, svh_ptr, vec_ptr, weight_ptr, row_of_pair_ptr, ids_ptr, out_ptr, num_experts,
                            D, n_pairs, out_rows, row0, scale, PAIRS_PER_ROW: tl.constexpr,
                            ROUNDED_MUL: tl.constexpr):
    """`_combine_kernel` over EXL3 down products still in their rotated basis: each pair's output is rotated out
    here (`hadamard.rotate_out`'s arithmetic: had(acc) * svh * scale, times the routing weight) as it is added, in
    the same pair order, so the rotated rows are never stored. One 128-column block of one row per program."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    shard = tl.program_id(2)
    total = tl.zeros((1, 128), dtype=tl.float32)
    for j in tl.static_range(PAIRS_PER_ROW):
        pair = row * PAIRS_PER_ROW + j
        real = tl.load(ids_ptr + pair) < num_experts
        r = tl.load(row_of_pair_ptr + shard * n_pairs + pair, mask=real, other=0).to(tl.int64)
        x = tl.load(acc_ptr + r * D + cols[None, :], mask=real, other=0.0)
        vec = tl.load(svh_ptr + tl.load(vec_ptr + r, mask=real, other=0).to(tl.int64) * D + cols[None, :],
                      mask=real, other=0.0).to(tl.float32)
        y = hadamard.rotated_out(x, vec, scale, 1)
        w = tl.load(weight_ptr + r, mask=real, other=0.0)
        # The weighted output rounded on its own before the add (an fma would round once fewer: other bits than
        # adding stored pair outputs, as `_combine_kernel` does)
        total += libdevice.mul_rn(y, w) if ROUNDED_MUL else y * w
    out = out_ptr + (shard.to(tl.int64) * out_rows + row0 + row) * D + cols[None, :]
    tl.store(out, total)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, s_ptr, out_ptr, pair_ptr, expert_ptr, num_experts, N, K,
                    swe, swn, swk, sse, ssn, ssk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    IEEE: tl.constexpr, FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr):
    """out[slot] = a[slot] @ w[expert of the slot's tile]^T in fp32, a [slots, K] already per slot (0 for empty
    slots; unused tiles are not written)."""
    blk, pid_n = launch_tile(N, BLOCK_N, GROUP_M)
    expert = tl.load(expert_ptr + blk)
    if expert >= num_experts:
        return
    slots = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    has = tl.load(pair_ptr + slots) >= 0
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    e = expert.to(tl.int64)
    act = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + slots.to(tl.int64)[:, None] * K + kk[None, :], mask=has[:, None] & (kk[None, :] < K),
                    other=0.0)
        b = weight_tile(w_ptr + e * swe, s_ptr + e * sse, rn, k0, N, K, swn, swk, ssn, ssk, FMT, BLOCK_N, BLOCK_K,
                        SB_N, SB_K, act)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + slots.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=rn[None, :] < N)


def _grouped(a: torch.Tensor, w: WeightArgs, groups: Groups, tile: MoeTile) -> torch.Tensor:
    if exl3_cuda.covers(a, w, tile.block_m):
        return exl3_cuda.grouped(a, w, groups.pair_of_slot, groups.expert_of_block)
    out = torch.empty(a.shape[0], w.n, dtype=torch.float32, device=a.device)
    _grouped_kernel[(groups.blocks * triton.cdiv(w.n, tile.block_n),)](
        a, w.data, w.scale, out, groups.pair_of_slot, groups.expert_of_block, w.data.shape[0], w.n, w.k,
        *w.strides(), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        IEEE=a.dtype == torch.float32, FMT=int(w.fmt), SB_N=w.block_n, SB_K=w.block_k, num_warps=tile.warps,
        num_stages=tile.stages)
    return out


def _gate_up_exl3(x: torch.Tensor, gate: WeightArgs, up: WeightArgs, tables: SlotTables, tile: MoeTile
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """gate's and up's float32 products of every (shard, slot) row, still rotated. Decode-class tiles on the CUDA
    kernel: both rotated in by one launch and multiplied by one. Otherwise (prompt rows: up to hundreds of
    thousands of slot rows, a 4096-wide rotated row each) one projection at a time, so only one rotated input is
    held at once (both would add gigabytes to a prompt chunk's peak, which sizes the KV pool)."""
    rows = tables.token.shape[0]
    grid = tables.grouped
    if exl3_cuda.runs(x.device, hadamard.operand_dtype(x.dtype), gate, tile.block_m) and exl3_cuda.pairs_with(gate, up):
        gu = hadamard.rotate_in(x, gate.suh, rows=rows, src_rows=tables.token, vec_rows=tables.vec, suh2=up.suh)
        acc = exl3_cuda.grouped_pair(gu, gate, up, grid.pair_of_slot, grid.expert_of_block)
        return acc[:rows], acc[rows:]
    return tuple(_grouped(hadamard.rotate_in(x, w.suh, rows=rows, src_rows=tables.token, vec_rows=tables.vec), w,
                          grid, tile) for w in (gate, up))


def _experts_exl3(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: WeightArgs, up: WeightArgs,
                  down: WeightArgs, limit: float, tile: MoeTile, shards: int, out: torch.Tensor, row0: int) -> None:
    """EXL3 expert stacks, every local shard in one launch per step: per (shard, slot) row, rotate in (its token's
    row, its shard's expert's suh), grouped GEMM over the trellis tiles, rotate out (that expert's svh); gate and up
    then SwiGLU, down then the routing weight, by pair; into out[:, row0 : row0 + T].

    The stacks hold the shards' experts one block after another ([shards * (E+1), ...]: gate / up with the shard's
    I_local outputs, down with its I_local inputs). Shard s's rows are a copy of the slot grid whose tiles read
    expert block s * (E+1) + e, so each row's arithmetic is the one-shard launch's: the tiles and the grouping are
    the same for every shard. Launches: grouping, its tables, gate and up rotated in together, their products
    (one CUDA launch for both), their rotations out with the SwiGLU and down's rotation in, down's product, and the
    combine with down's rotation out."""
    t, d = x.shape
    n_exp = gate.data.shape[0] // shards
    groups = group_pairs(ids, n_exp, tile.block_m)
    tables = slot_tables(groups, weights, n_exp, shards)
    # row (s, slot): SwiGLU of shard s's I_local columns of its slot, rotated in for down, in one launch. (Every
    # big temporary dies with the call that made it: at a prompt chunk each is gigabytes, and the largest moment of
    # a prompt chunk sizes the KV pool.)
    h = hadamard.rotate_out_swiglu(*_gate_up_exl3(x, gate, up, tables, tile), gate.svh, up.svh, tables.vec, limit,
                                   x.dtype, next_suh=down.suh)
    acc = _grouped(h, down, tables.grouped, tile)
    # One warp a 128-column block: the Hadamard butterflies' exchanges stay in the warp (bench.ptx_stats, sm_90: 53
    # bar.sync with the default 4 warps, none with 1). The arithmetic is elementwise, so the bits are the same.
    _combine_rotated_kernel[(t, d // hadamard.HAD, shards)](
        acc, down.svh, tables.vec, tables.weight, tables.row_of_pair, ids, out, n_exp, d, ids.numel(), out.shape[1],
        row0, hadamard.OUT_SCALE, PAIRS_PER_ROW=ids.shape[1], ROUNDED_MUL=not hadamard.INTERPRETED, num_warps=1)


def _experts_one_class(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: WeightArgs,
                       up: WeightArgs, down: WeightArgs, limit: float, tile: MoeTile, shards: int,
                       out: torch.Tensor, row0: int) -> None:
    """One row class's rows (out[:, row0 : row0 + T])."""
    t, d = x.shape
    n_exp, i_dim = gate.data.shape[0], gate.n
    pairs_per_row = ids.shape[1]
    for w in (gate, down):
        if w.max_block_k() % tile.block_k:
            raise ValueError(f"a {tile.block_k}-wide K step straddles the experts' {w.max_block_k()}-wide groups")
    groups = group_pairs(ids, n_exp, tile.block_m)
    h = torch.empty(groups.blocks * tile.block_m, i_dim, dtype=x.dtype, device=x.device)
    gs, us = gate.strides(), up.strides()
    if gs != us or gate.fmt != up.fmt:
        raise ValueError("gate and up experts must share one storage layout")
    _gate_up_kernel[(groups.blocks * triton.cdiv(i_dim, tile.block_n),)](
        x, gate.data, gate.scale, up.data, up.scale, h, groups.pair_of_slot, groups.expert_of_block, n_exp, i_dim, d,
        float(limit), *gs, PAIRS_PER_ROW=pairs_per_row, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_M=tile.group_m, FMT=int(gate.fmt), SB_N=gate.block_n, SB_K=gate.block_k,
        num_warps=tile.warps, num_stages=tile.stages)
    n_pairs = t * pairs_per_row
    y = torch.empty(shards, n_pairs, d, dtype=torch.float32, device=x.device)
    _down_kernel[(groups.blocks * triton.cdiv(d, tile.block_n), shards)](
        h, down.data, down.scale, y, groups.pair_of_slot, groups.expert_of_block, weights, n_exp, i_dim // shards, d,
        n_pairs, *down.strides(), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, FMT=int(down.fmt), SB_N=down.block_n, SB_K=down.block_k, num_warps=tile.warps,
        num_stages=tile.stages)
    combine(y, ids, out, n_exp, row0)


def _tile(rows: RowClass, x: torch.Tensor, gate: WeightArgs) -> MoeTile:
    """The row class's tile; EXL3 prompt rows take the decode class's 16-slot tiles where the CUDA product runs.
    Why: a grouped tile decodes its expert's whole trellis, and Triton's decode is several times slower than the
    CUDA one, so eight times the tiles still cost less; 64-slot blocks that share each decoded fragment among four
    tiles were slower (too few blocks to fill the GPU at ~64 rows an expert). The prefills that showed it:
    docs/benchmarks.md, "Expert products". It is still a pure function of the class and the weight
    (docs/design.md §5.1)."""
    arch = gpu_arch.row(x.device)
    if gate.fmt is Fmt.EXL3 and exl3_cuda.runs(x.device, hadamard.operand_dtype(x.dtype), gate, exl3_cuda.BLOCK_M):
        return moe_schedule(RowClass.DECODE, arch)
    return moe_schedule(rows, arch)


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor | WeightArgs | IntExperts,
            up: torch.Tensor | WeightArgs | None, down: torch.Tensor | WeightArgs | None, limit: float,
            decode_rows: int, shards: int = 1) -> torch.Tensor:
    """Grouped experts: x [T, D]; ids, weights [T, P] from `route` (P = k + 1 pairs per row, or k); gate, up
    [E+1, I, D]; down [shards * (E+1), D, I / shards] (the shared expert last in each shard's block; dense, or
    quantized stacks as WeightArgs) -> [shards, T, D] fp32: each virtual shard's partial of the routed + shared
    outputs. The shards' slices of I lie side by side in gate / up (one launch computes all of them); shard s's
    partial reads its own I columns and down block. EXL3 stacks instead hold each shard's experts one block after
    another in all three ([shards * (E+1), ...]; each expert's Hadamard vectors are its own). Every element is
    computed as a one-shard call on that shard's weights would compute it: the tiles are fixed per row class, never
    by how many shards share the launch. Rows [0, decode_rows) are decode-class and the rest prompt rows; each class
    is grouped and run with its own fixed schedule. Integer experts prepared for humming-kernels come as one
    `IntExperts` in `gate` (up and down None; kernels/gpu/int_moe.py)."""
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    t = x.shape[0]
    split = min(max(decode_rows, 0), t)
    classes = [(rows, part) for rows, part in ((RowClass.DECODE, slice(0, split)), (RowClass.PREFILL, slice(split, t)))
               if part.stop > part.start]
    if isinstance(gate, IntExperts):
        out = torch.empty(gate.shards, t, x.shape[1], dtype=torch.float32, device=x.device)
        for rows, part in classes:
            int_moe.experts(x[part], ids[part], weights[part], gate, limit, rows, out, part.start)
        return out
    gate, up, down = (w if isinstance(w, WeightArgs) else dense(w) for w in (gate, up, down))
    if (gate.fmt is Fmt.EXL3) != (down.fmt is Fmt.EXL3) or (gate.fmt is Fmt.EXL3) != (up.fmt is Fmt.EXL3):
        raise ValueError("EXL3 experts need gate, up and down all in EXL3")
    if gate.fmt is Fmt.EXL3:
        if gate.data.shape[0] % shards or not gate.data.shape[0] == up.data.shape[0] == down.data.shape[0]:
            raise ValueError(f"{shards} shards: EXL3 stacks need one expert block per shard in gate, up and down")
    elif gate.n % shards or down.data.shape[0] != shards * gate.data.shape[0]:
        raise ValueError(f"{shards} shards: gate/up need I divisible by it and down one expert block per shard")
    out = torch.empty(shards, t, x.shape[1], dtype=torch.float32, device=x.device)
    one_class = _experts_exl3 if gate.fmt is Fmt.EXL3 else _experts_one_class
    for rows, part in classes:
        one_class(x[part], ids[part], weights[part], gate, up, down, limit, _tile(rows, x, gate), shards, out,
                  part.start)
    return out
