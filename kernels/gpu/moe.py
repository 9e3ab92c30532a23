"""Fused mixture-of-experts on the GPU: router top-k, tokens grouped by expert, one launch per projection for every
expert hit, and a combine in fixed expert order. The torch twin is `kernels/moe.py` (route + experts + the shared
expert added last).

Layout: the shared expert is stored as one more expert (index E, after the E routed ones) that every real row
takes with weight 1, so it rides in the same grouped launches. Each row therefore has `k + 1` (token, expert)
pairs, its routed experts in ascending index order and the shared one last; padding rows (past `n_real`) get a
sentinel expert id and are never routed (docs/design.md §5.1).

Routing (`route`) reads the router's fp32 logits (its GEMM is a launch of its own: 288 x 4096 weights, which one
program cannot stream fast) and gives each row its top-k and the shared expert's pair. A decode step (every row
decode-class, up to moe_groups.FUSED_PAIRS pairs) also groups its pairs by expert in that same one-program launch,
with the expert format's tables (EXL3's slot tables, the integer experts' humming tables; `grouping` says which),
so before the experts a MoE layer's decode step is two launches, the router GEMM and the routing (before: the
routing, the grouping and, for EXL3 or integer experts, their tables, a launch each). Prompt-sized steps route
with a program per row and group per row class. A row's ids and weight bits are the same either way and in any
company: the top-k is exact, and the weights add their normalising sum in pick order, never by a reduction tree
(`_top_k`, `_weight`).

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

from kernels.gpu import arch as gpu_arch, exl3_cuda, hadamard, int_moe, pdl
from kernels.gpu.int_moe import IntExperts
from kernels.gpu.moe_groups import (FUSED_PAIRS, Groups, SlotTables, empty_groups, empty_slot_tables, group_pairs,
                                    slot_rows, slot_tables)
from kernels.gpu.swiglu import clamped_swiglu
from kernels.gpu.gemm import RowClass
from kernels.gpu.pdl import wait_for_inputs
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
def _top_k(logits_ptr, bias_ptr, rows, real, E, ROWS: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
           BLOCK_E: tl.constexpr):
    """The choice of the rows `rows` ([ROWS]) whose `real` is set: sigmoid scores + correction bias, top-k, ties ->
    lowest index. Returns the picked experts in pick order and each one's place among the row's in ascending expert
    order ([ROWS, KP, 1]; KP >= TOP_K; the other rows' are not meant). Max and min are exact: the choice is the same
    whatever the tile or the launch.

    Why [ROWS, PARTS, LANES] tiles (expert part * LANES + lane): a warp's 32 lanes of 4-wide loads span 128
    experts, so a [ROWS, BLOCK_E] tile of several warps spreads a row over BLOCK_E / 128 of them and every step would
    meet at a barrier; with the experts' parts on an axis of their own, the warps split the rows and each row's
    reductions stay in its warp (the picks share the tile's layout for the same reason)."""
    LANES: tl.constexpr = BLOCK_E if BLOCK_E < 128 else 128
    e = (tl.arange(0, BLOCK_E // LANES) * LANES)[None, :, None] + tl.arange(0, LANES)[None, None, :]
    valid = real[:, None, None] & (e < E)
    logit = tl.load(logits_ptr + rows[:, None, None] * E + e, mask=valid, other=0.0)
    # (the bias loaded at the tile's shape: a [1, PARTS, LANES] load would take a layout that splits rows over warps)
    bias = tl.load(bias_ptr + e + 0 * rows[:, None, None], mask=valid, other=0.0)
    choice = tl.where(valid, tl.sigmoid(logit) + bias, float("-inf"))
    j = tl.arange(0, KP)[None, :, None]
    picks = tl.zeros((ROWS, KP, 1), dtype=tl.int32)
    places = tl.zeros((ROWS, KP, 1), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        # (the parts first: they are a thread's own, so the lanes' exchanges then carry one value a row, not one a part)
        best = tl.max(tl.max(choice, axis=1, keep_dims=True), axis=2, keep_dims=True)
        # the lowest index among the maxima
        first = tl.min(tl.min(tl.where(choice == best, e, BLOCK_E), axis=1, keep_dims=True), axis=2, keep_dims=True)
        choice = tl.where(e == first, float("-inf"), choice)
        picks, places = _record_pick(picks, places, first, j, k, 1)
    return picks, places


@triton.jit
def _record_pick(picks, places, first, j, k, AXIS: tl.constexpr):
    """Pick k of a row's top-k (`first`, along the picks' axis AXIS) recorded: its place among the row's pairs is
    the number of earlier picks of a lower expert, and every earlier pick of a higher expert moves one place on (a
    row's pairs lie in expert order)."""
    earlier = j < k
    places += (earlier & (picks > first)).to(tl.int32)
    places = tl.where(j == k, tl.sum((earlier & (picks < first)).to(tl.int32), axis=AXIS, keep_dims=True), places)
    return tl.where(j == k, first, picks), places


@triton.jit
def _pick_score(logits_ptr, rows, pick, mask, E):
    """A pick's unbiased score, off the tile: the same elementwise sigmoid of the same logit, so the same bits."""
    return tl.sigmoid(tl.load(logits_ptr + rows * E + pick, mask=mask, other=0.0))


@triton.jit
def _weight(score, total, scaling, NORM: tl.constexpr):
    """A pick's routing weight from its score and its row's total: the picks' scores added one by one in pick order,
    never by a reduction tree, whose order would follow the layout — so a row's weights are the same bits in every
    launch, whatever its tiles."""
    if NORM:
        score = score / (total + 1e-20)
    return score * scaling


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, E, scaling,
                  TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr,
                  KP: tl.constexpr, PDL: tl.constexpr = False):
    """Per row: its top-k (`_top_k`) and weights (`_weight`); k pairs, routed ascending, then (SHARED) the shared
    expert's pair; padding rows (from n_real on) get no pairs."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    if row >= tl.load(n_real_ptr):  # padding row: no pairs at all
        for j in tl.static_range(TOP_K + SHARED):
            tl.store(ids_ptr + row * (TOP_K + SHARED) + j, E + 1)
            tl.store(w_ptr + row * (TOP_K + SHARED) + j, 0.0)
        return
    rows = row + tl.arange(0, 1)
    picks, places = _top_k(logits_ptr, bias_ptr, rows, rows >= 0, E, 1, TOP_K, KP, BLOCK_E)
    j = tl.arange(0, KP)[None, :, None]
    total = tl.zeros((1, 1, 1), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # (each pick taken out of the row exactly: a sum of it and zeros)
        total += _pick_score(logits_ptr, row, tl.sum(tl.where(j == k, picks, 0), axis=1, keep_dims=True), True, E)
    for k in tl.static_range(TOP_K):
        pick = tl.sum(tl.where(j == k, picks, 0), axis=1, keep_dims=True)
        out = row * (TOP_K + SHARED) + tl.sum(tl.where(j == k, places, 0), axis=1, keep_dims=True)
        tl.store(ids_ptr + out, pick)
        tl.store(w_ptr + out, _weight(_pick_score(logits_ptr, row, pick, True, E), total, scaling, NORM))
    if SHARED:
        tl.store(ids_ptr + row * (TOP_K + SHARED) + TOP_K, E)
        tl.store(w_ptr + row * (TOP_K + SHARED) + TOP_K, 1.0)


@triton.jit
def _route_group_top_k(choice, e, ROWS: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """`_top_k`'s picks and places from `_route_group`'s [LANES, ROWS, PARTS] choice tile (a row's experts on its
    warp's lanes, PARTS in each thread): picks and places [1, ROWS, KP], in every thread of the row's warp.

    The same picks by integer keys: each score's bits mapped to an int32 in the floats' order, so that a warp's
    max and its min index are one `redux.sync` each, where a float max is five shuffles and their latency. NaNs as
    `_top_k` takes them: a NaN's key is below every number's (tl.max, a maxnum, passes NaNs over), and a step
    whose best is a NaN picks BLOCK_E (`choice == best` matches nothing there). No score is -0 (no sigmoid is, so
    neither is its sum with a bias): +0 and -0, one float but two keys, never meet."""
    j = tl.arange(0, KP)[None, None, :]
    bits = choice.to(tl.int32, bitcast=True)
    nan_key = tl.full((1, 1, 1), -2147483648, tl.int32)
    key = tl.where(choice == choice, bits ^ ((bits >> 31) & 0x7FFFFFFF), nan_key)
    NO_KEY: tl.constexpr = -2139095041  # -inf's key (a pick's score leaves the choice as -inf)
    picks = tl.zeros((1, ROWS, KP), dtype=tl.int32)
    places = tl.zeros((1, ROWS, KP), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.max(key, axis=2, keep_dims=True), axis=0, keep_dims=True)
        first = tl.min(tl.min(tl.where(key == best, e, BLOCK_E), axis=2, keep_dims=True), axis=0, keep_dims=True)
        first = tl.where(best == nan_key, BLOCK_E, first)
        key = tl.where(e == first, NO_KEY, key)
        picks, places = _record_pick(picks, places, first, j, k, 2)
    return picks, places


@triton.jit
def _route_group_place(word, row, start, e, pair_ptr, expert_ptr, gu_ptr, dn_ptr, block_ptr, used, n_pairs, experts,
                       shards, P: tl.constexpr, CODES: tl.constexpr, BLOCK_M: tl.constexpr, INT: tl.constexpr):
    """The pairs of a block of rows, from their words (`_route_group`), scattered into the tables: a pair's slot is
    its expert's first slot plus its rank; a tile's first slot names the tile's expert (runs start on whole tiles)."""
    code = word % CODES
    slot = start + word // CODES
    chosen = code > 0
    pair = row * P + code - 1
    tl.store(pair_ptr + slot, pair, mask=chosen)
    head = chosen & (slot % BLOCK_M == 0)
    tile = slot // BLOCK_M
    tl.store(expert_ptr + tile, e + 0 * row, mask=head)
    if INT:  # humming's rows (int_moe.table_rows): gate|up's; down's, the shards' copies of the used tiles in a row
        tl.store(gu_ptr + slot, pair, mask=chosen)
        for s in range(shards):
            tl.store(dn_ptr + s * used * BLOCK_M + slot, pair + s * n_pairs, mask=chosen)
            tl.store(block_ptr + s * used + tile, e + s * experts + 0 * row, mask=head)


@triton.jit
def _route_group(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr, gu_ptr, dn_ptr,
                 block_ptr, padded_ptr, T, E, stride_e, scaling, cap, blocks, shards, TOP_K: tl.constexpr,
                 NORM: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr, KP: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, INT: tl.constexpr):
    """One program: `_route_kernel`'s routing of every row, ROWS rows at a time, and the grouping of its pairs
    (num_experts = E + SHARED) into exactly moe_groups.group_pairs' tables, and with INT humming's row tables
    (int_moe.table_rows') and their padded counts; returns the tiles used.

    A one-row step's launch is latency, so nothing here waits on more than it must: no chain of dependent loads
    (the tables are scattered from registers, where a search of the runs in memory would be a load per step), the
    reductions in a warp, and barriers only for the block's counts across its warps and the empty marks. Every
    step works on [LANES, ROWS, PARTS] tiles, row r on warp r, expert e = lane * PARTS + part (a thread's experts
    adjacent): the top-k's reductions are a thread's, then its warp's; the row's picks mark its chosen experts in a
    word per (row, expert), rank * CODES + place + 1 (0: not chosen), whose rank, the earlier rows that chose the
    expert, is a scan over the block's rows; after the last block each expert's first slot is a thread's prefix
    plus one scan over the lanes, and every chosen word scatters its pair into the tables: slot, humming's rows
    and, from a tile's first slot, the tile's expert (its run starts there; moe_groups._group_kernel counts the runs
    that end before each tile instead). The earlier blocks' words go through scratch (each thread reads back what
    it wrote), the last block's stay in registers.

    The tiles' layout is the one Triton gives a load or store whose addresses it sees no order in (in this Triton:
    lanes on the first axis, warps on the second, the rest in each thread). So the experts' stride in the logits
    and the bias (1: both contiguous) is a runtime argument and the scratch is not specialised on alignment: a load
    Triton could vectorise would take a layout of its own, and every tile would cross shared memory to meet it
    (barriers each time)."""
    P: tl.constexpr = TOP_K + SHARED
    CODES: tl.constexpr = P + 1
    WIDTH: tl.constexpr = BLOCK_E if BLOCK_E > 32 else 32  # the tile's experts: 32 lanes of PARTS
    PARTS: tl.constexpr = WIDTH // 32
    n_pairs = T * P
    experts = E + SHARED
    GROUPS: tl.constexpr = (PARTS + 15) // 16  # int64 words of 4-bit counts a thread (`hit` below)
    tl.static_assert(ROWS < 16)
    lane = tl.arange(0, 32)[:, None, None]
    part = tl.arange(0, PARTS)[None, None, :]
    e = lane * PARTS + part
    at = part * 32 + lane  # a word's place in its row of scratch (the lanes adjacent)
    j = tl.arange(0, KP)[None, None, :]
    rows = tl.arange(0, ROWS)[None, :, None]
    # the first block's logits (and the bias) in flight before the row count (a load of its own) arrives
    here = (rows < T) & (e < E)
    logit = tl.load(logits_ptr + rows * E + e * stride_e, mask=here, other=0.0)
    bias = tl.load(bias_ptr + e * stride_e + 0 * rows, mask=here, other=0.0)
    n_real = tl.minimum(tl.load(n_real_ptr), T)
    # empty marks, which the placing overwrites after the barrier: slots, and humming's rows
    for s0 in range(0, cap, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(pair_ptr + s, tl.full((CHUNK,), -1, tl.int32), mask=s < cap)
        if INT:
            tl.store(gu_ptr + s, tl.zeros((CHUNK,), tl.int32) + n_pairs, mask=s < cap)
    if INT:
        for r0 in range(0, shards * cap, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            tl.store(dn_ptr + r, tl.zeros((CHUNK,), tl.int32) + shards * n_pairs, mask=r < shards * cap)
    for q0 in range(n_real * P, n_pairs, CHUNK):  # padding rows: no pairs
        q = q0 + tl.arange(0, CHUNK)
        tl.store(ids_ptr + q, tl.full((CHUNK,), E + 1, tl.int32), mask=q < n_pairs)
        tl.store(w_ptr + q, tl.zeros((CHUNK,), tl.float32), mask=q < n_pairs)
    seen = tl.zeros((32, 1, PARTS), dtype=tl.int32)  # pairs per expert so far
    word = tl.zeros((32, ROWS, PARTS), dtype=tl.int32)  # the last block's words
    for r0 in range(0, n_real, ROWS):
        row = r0 + rows
        real = row < n_real
        following = row + ROWS  # the next block's logits, in flight during this block's top-k
        logit_next = tl.load(logits_ptr + following * E + e * stride_e, mask=(following < n_real) & (e < E),
                             other=0.0)
        seen_before = seen
        choice = tl.where(real & (e < E), tl.sigmoid(logit) + bias, float("-inf"))
        picks, places = _route_group_top_k(choice, e, ROWS, TOP_K, KP, BLOCK_E)
        # ids and weights, `_route_kernel`'s bits: every lane has the row's scores, added in pick order; lane k
        # writes pair k (the shared expert's: lane TOP_K)
        score = _pick_score(logits_ptr, row, picks + 0 * lane, real, E)
        total = tl.zeros((32, ROWS, 1), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            total += tl.sum(tl.where(j == k, score, 0.0), axis=2, keep_dims=True)  # (a score and zeros: exact)
        pick = tl.sum(tl.where(j == lane, picks, 0), axis=2, keep_dims=True)
        place = tl.sum(tl.where(j == lane, places, 0), axis=2, keep_dims=True)
        weight = _weight(tl.sum(tl.where(j == lane, score, 0.0), axis=2, keep_dims=True), total, scaling, NORM)
        if SHARED:
            pick = tl.where(lane == TOP_K, E, pick)
            place = tl.where(lane == TOP_K, TOP_K, place)
            weight = tl.where(lane == TOP_K, 1.0, weight)
        tl.store(ids_ptr + row * P + place, pick, mask=real & (lane < P))
        tl.store(w_ptr + row * P + place, weight, mask=real & (lane < P))
        code = tl.zeros((32, ROWS, PARTS), dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            code += tl.where(e == tl.sum(tl.where(j == k, picks, 0), axis=2, keep_dims=True),
                             tl.sum(tl.where(j == k, places, 0), axis=2, keep_dims=True) + 1, 0)
        if SHARED:  # every real row's last pair: its rank in the shared expert's run is the row
            code = tl.where(e == E, P, code)
        code = tl.where(real & (e < experts), code, 0)
        # each expert's rank in the block (the earlier rows that chose it) and the block's count: a scan and a sum
        # over the warps, of a thread's experts packed 4 bits each in an int64 (a count of up to ROWS < 16 rows
        # never carries into the next field), so each crosses shared memory as one word a thread, not PARTS
        hit = (code > 0).to(tl.int64)
        below = tl.zeros((32, ROWS, PARTS), dtype=tl.int32)
        field = 4 * (part % 16)
        for g in tl.static_range(GROUPS):
            mine = (part // 16) == g
            packed = tl.sum(tl.where(mine, hit << field, 0), axis=2, keep_dims=True)
            below += tl.where(mine, ((tl.cumsum(packed, axis=1) - packed) >> field) & 15, 0).to(tl.int32)
            seen += tl.where(mine, (tl.sum(packed, axis=1, keep_dims=True) >> field) & 15, 0).to(tl.int32)
        word = (below + seen_before) * CODES + code
        tl.store(scratch_ptr + row * WIDTH + at, word, mask=real & (r0 + ROWS < n_real))
        logit = logit_next
    tl.debug_barrier()  # the empty marks land before any pair is placed
    # each expert's first slot: the runs padded to whole tiles, added up in expert order, a thread's own experts
    # and one scan of the lanes' sums (at the tile's shape, each warp its own copy: Triton scans no tile that
    # every warp holds whole)
    runs = (seen + BLOCK_M - 1) // BLOCK_M  # each expert's tiles
    used = tl.sum(tl.sum(tl.sum(runs, axis=2), axis=0), axis=0)
    padded = (runs + 0 * rows) * BLOCK_M
    lane_total = tl.sum(padded, axis=2, keep_dims=True)
    start = tl.cumsum(lane_total, axis=0) - lane_total + tl.cumsum(padded, axis=2) - padded
    last = tl.maximum(n_real - 1, 0) // ROWS * ROWS
    for r0 in range(0, last, ROWS):
        row = r0 + rows
        _route_group_place(tl.load(scratch_ptr + row * WIDTH + at), row, start, e, pair_ptr, expert_ptr, gu_ptr,
                           dn_ptr, block_ptr, used, n_pairs, experts, shards, P, CODES, BLOCK_M, INT)
    _route_group_place(word, last + rows, start, e, pair_ptr, expert_ptr, gu_ptr, dn_ptr, block_ptr, used, n_pairs,
                       experts, shards, P, CODES, BLOCK_M, INT)
    for b0 in range(used, blocks, CHUNK):  # the unused tiles
        b = b0 + tl.arange(0, CHUNK)
        tl.store(expert_ptr + b, tl.zeros((CHUNK,), tl.int32) + experts, mask=b < blocks)
    if INT:
        tl.store(padded_ptr, used * BLOCK_M)
        tl.store(padded_ptr + 1, used * BLOCK_M * shards)
        # the down grid's unused tiles (int_moe.table_rows' with no tile used: shard s's first, its "none" expert)
        for r0 in range(shards * used, shards * blocks, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            tl.store(block_ptr + r, tl.where((used == 0) & (r < shards), (r + 1) * experts, 0),
                     mask=r < shards * blocks)
    return used


# The grouping launches: one build whatever the row count (counts are not specialised on, docs/gpu-engine.md; the
# row block is fixed by the shapes, so a row's arithmetic is too); the experts' stride and the scratch's alignment
# neither, for the tiles' layout (`_route_group`).
@triton.jit(do_not_specialize=["T", "cap", "blocks", "stride_e"], do_not_specialize_on_alignment=["scratch_ptr"])
def _route_group_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr, T, E,
                        stride_e, scaling, cap, blocks, TOP_K: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_E: tl.constexpr, SHARED: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    _route_group(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr, pair_ptr,
                 pair_ptr, pair_ptr, pair_ptr, T, E, stride_e, scaling, cap, blocks, 1, TOP_K, NORM, BLOCK_E, SHARED,
                 KP, ROWS, BLOCK_M, CHUNK, False)


@triton.jit(do_not_specialize=["T", "cap", "blocks", "stride_e"], do_not_specialize_on_alignment=["scratch_ptr"])
def _route_group_slots_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr,
                              pairs_ptr, block_ptr, token_ptr, vec_ptr, weight_ptr, row_of_pair_ptr, T, E, stride_e,
                              scaling, cap, blocks, shards, TOP_K: tl.constexpr, NORM: tl.constexpr,
                              BLOCK_E: tl.constexpr, SHARED: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """`_route_group_kernel`, then the EXL3 experts' slot tables (moe_groups.slot_tables)."""
    wait_for_inputs(PDL)
    _route_group(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr, pair_ptr,
                 pair_ptr, pair_ptr, pair_ptr, T, E, stride_e, scaling, cap, blocks, shards, TOP_K, NORM, BLOCK_E,
                 SHARED, KP, ROWS, BLOCK_M, CHUNK, False)
    tl.debug_barrier()  # the grouping and the weights are whole before they are read
    for r0 in range(0, shards * cap, CHUNK):
        slot_rows(r0 + tl.arange(0, CHUNK), pair_ptr, expert_ptr, w_ptr, pairs_ptr, block_ptr, token_ptr, vec_ptr,
                  weight_ptr, row_of_pair_ptr, cap, blocks, E + SHARED, T * (TOP_K + SHARED), shards,
                  TOP_K + SHARED, BLOCK_M)


@triton.jit(do_not_specialize=["T", "cap", "blocks", "stride_e"], do_not_specialize_on_alignment=["scratch_ptr"])
def _route_group_int_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr,
                            gu_ptr, dn_ptr, block_ptr, padded_ptr, T, E, stride_e, scaling, cap, blocks, shards,
                            TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr,
                            KP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                            PDL: tl.constexpr = False):
    """`_route_group_kernel`, with humming's row tables of the integer experts (int_moe.tables) scattered from the
    same pairs."""
    wait_for_inputs(PDL)
    _route_group(logits_ptr, bias_ptr, ids_ptr, w_ptr, n_real_ptr, scratch_ptr, pair_ptr, expert_ptr, gu_ptr, dn_ptr,
                 block_ptr, padded_ptr, T, E, stride_e, scaling, cap, blocks, shards, TOP_K, NORM, BLOCK_E, SHARED,
                 KP, ROWS, BLOCK_M, CHUNK, True)


def route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, norm_topk_prob: bool, scaling: float,
          n_real: int | torch.Tensor, shared: bool = True, grouping: Grouping | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (ids [T, k+1] int32, weights [T, k+1] fp32); id E = the shared expert, E+1 = none.
    Rows from n_real on are padding (an int, or an int32 device scalar a CUDA graph can refill). shared=False:
    k pairs per row (the shared expert runs apart, e.g. when it is stored in another format than the routed).
    grouping (`grouping()`): where a decode-sized step's grouping and expert tables go when this launch builds them
    too (up to moe_groups.FUSED_PAIRS pairs, stacks of E + shared experts); left unset otherwise, and `experts`
    then groups the pairs itself. The ids and weights are the same bits either way."""
    t, e = logits.shape
    if not isinstance(n_real, torch.Tensor):
        n_real = torch.tensor([n_real], dtype=torch.int32, device=logits.device)
    pairs = top_k + int(shared)
    ids = torch.empty(t, pairs, dtype=torch.int32, device=logits.device)
    w = torch.empty(t, pairs, dtype=torch.float32, device=logits.device)
    logits, bias = logits.contiguous(), bias.float().contiguous()
    if grouping is not None and 0 < t * pairs <= FUSED_PAIRS and grouping.experts == e + int(shared):
        _route_grouped(logits, bias, ids, w, n_real, grouping, top_k=top_k, norm=bool(norm_topk_prob),
                       scaling=float(scaling), shared=int(shared))
    elif t:
        # One warp a row: its top-k's reductions stay in the warp (bench.ptx_stats, sm_90: 52 bar.sync with the
        # default 4 warps, none with 1); a row is a few hundred scores.
        _route_kernel[(t,)](logits, bias, ids, w, n_real, e, float(scaling), TOP_K=top_k, NORM=bool(norm_topk_prob),
                            BLOCK_E=triton.next_power_of_2(e), SHARED=int(shared), KP=triton.next_power_of_2(top_k),
                            num_warps=1, **pdl.options())
    return ids, w


@dataclass
class Grouping:
    """A decode step's grouping (and its experts' tables), built in the routing's launch: what `grouping()` says
    the experts need, and (set by `route`) what it built. `experts` takes it for its decode-class rows."""
    experts: int  # experts in a shard's stack, the shared one included
    block_m: int  # the decode tile's slots
    shards: int
    tables: str  # "" (the grouping only), "slots" (EXL3: moe_groups.slot_tables) or "int" (int_moe.tables)
    groups: Groups | None = None
    slots: SlotTables | None = None
    int_tables: int_moe.Tables | None = None


def grouping(x: torch.Tensor, gate: torch.Tensor | WeightArgs | IntExperts, decode_rows: int, shards: int = 1
             ) -> Grouping | None:
    """What `route` may build for `experts`' decode tiles over these stacks (as `experts` reads them), or None when
    rows of x are prompt rows (a prompt-sized step: its rows are grouped per class as before)."""
    if decode_rows < x.shape[0]:
        return None
    arch = gpu_arch.row(x.device)
    if isinstance(gate, IntExperts):
        return Grouping(gate.gate_up.experts, int_moe.tile(RowClass.DECODE, arch).block_m, gate.shards, "int")
    w = gate if isinstance(gate, WeightArgs) else dense(gate)
    if w.fmt is Fmt.EXL3:
        return Grouping(w.data.shape[0] // shards, _tile(RowClass.DECODE, x, w).block_m, shards, "slots")
    return Grouping(w.data.shape[0], _tile(RowClass.DECODE, x, w).block_m, shards, "")


# Rows a step of the grouping launch routes, and its warps: a row a warp. The launch's cost is the top-k's work on
# every row of a block (a row's reductions inside its warp: no barrier in the top-k), so the block is the smallest
# that keeps two warps on each of an SM's four schedulers, to hide the reductions' latency: a one-row step does no
# more than one block, and from a few rows on the work is the same whatever the block (and under 16: a block's
# counts go across the warps 4 bits an expert). The warps also split the empty marks' loops, and each places its
# own rows' pairs. Against the two launches it replaces, at 64 rows: `_route_kernel` spreads the same top-k over 64
# SMs, but moe_groups._group_kernel then compares every pair with every expert, a [32, experts] one-hot per 32
# pairs, more instructions a thread than this whole top-k (bench.ptx_stats' builds of both); here a pair's slot
# comes from a scan over its block's choices instead.
_ROUTE_ROWS, _ROUTE_WARPS = 8, 8


def _route_grouped(logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                   n_real: torch.Tensor, g: Grouping, *, top_k: int, norm: bool, scaling: float, shared: int) -> None:
    """`route` and the grouping of its pairs (+ g's tables) in one program (`_route_group`), into g."""
    t, e = logits.shape
    dev = logits.device
    groups = empty_groups(ids.numel(), g.experts, g.block_m, dev)
    cap, blocks = groups.pair_of_slot.shape[0], groups.blocks
    block_e, kp = triton.next_power_of_2(g.experts), triton.next_power_of_2(top_k)
    scratch = torch.empty(t * max(block_e, 32), dtype=torch.int32, device=dev)  # `_route_group`'s words
    head = (logits, bias, ids, w, n_real, scratch, groups.pair_of_slot, groups.expert_of_block)
    meta = dict(TOP_K=top_k, NORM=norm, BLOCK_E=block_e, SHARED=shared, KP=kp, ROWS=_ROUTE_ROWS, BLOCK_M=g.block_m,
                CHUNK=1024, num_warps=_ROUTE_WARPS)
    if g.tables == "slots":
        s = empty_slot_tables(groups, ids.numel(), g.shards)
        _route_group_slots_kernel[(1,)](*head, s.grouped.pair_of_slot, s.grouped.expert_of_block, s.token, s.vec,
                                        s.weight, s.row_of_pair, t, e, logits.stride(1), scaling, cap, blocks, g.shards,
                                        **meta, **pdl.options())
        g.slots = s
    elif g.tables == "int":
        tab = int_moe.empty_tables(groups, g.shards)
        _route_group_int_kernel[(1,)](*head, tab.gate_up_rows, tab.down_rows, tab.down_experts, tab.padded, t, e,
                                      logits.stride(1), scaling, cap, blocks, g.shards, **meta, **pdl.options())
        g.int_tables = tab
    else:
        _route_group_kernel[(1,)](*head, t, e, logits.stride(1), scaling, cap, blocks, **meta, **pdl.options())
    g.groups = groups


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, gate_s_ptr, up_ptr, up_s_ptr, h_ptr, pair_ptr, expert_ptr, num_experts, I, D,
                    limit, swe, swn, swk, sse, ssn, ssk,
                    PAIRS_PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr,
                    PDL: tl.constexpr = False):
    """h[slot] = silu(min(x g^T, limit)) * clamp(x u^T, -limit, limit) for each slot of one expert tile."""
    wait_for_inputs(PDL)
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
                 FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr, PDL: tl.constexpr = False):
    """y[shard, pair] = (h[slot, shard's I columns] @ down[shard, expert]^T) * routing weight, in fp32, stored by
    pair (row-major per row). Shard s reads columns [s*I, (s+1)*I) of h and expert block s*num_experts + e."""
    wait_for_inputs(PDL)
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
def _combine_kernel(y_ptr, ids_ptr, rw_ptr, add_ptr, out_ptr, num_experts, D, T, out_rows, row0,
                    PAIRS_PER_ROW: tl.constexpr, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr,
                    ROUNDED_MUL: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr = False):
    """out[shard, row0 + row] = sum of the row's pair outputs in pair order (routed ascending, shared last); 0 for
    padding. (out has out_rows rows per shard: this call's T rows are one row class's run of them.) WEIGHTED: the
    pair outputs (any dtype) are not yet weighted: each is times its routing weight in fp32, rounded before the add
    (ROUNDED_MUL; an fma would round once fewer, other bits than the torch twin's product-then-sum). ADD: plus
    add[shard, row0 + row] (laid out as out) after the sum, one fp32 add: the bits of adding it afterwards."""
    wait_for_inputs(PDL)
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
    at = (shard * out_rows + row0 + row) * D + cols
    if ADD:
        acc += tl.load(add_ptr + at, mask=mask, other=0.0)
    tl.store(out_ptr + at, acc, mask=mask)


def combine(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int, row0: int,
            weights: torch.Tensor | None = None, add: torch.Tensor | None = None) -> None:
    """out[s, row0 + row] (fp32) = the row's pair outputs y[s, row * P + j] added in pair order; y [shards x T x P,
    D] (or [shards, T x P, D]), times `weights` [T, P] first when given (else y is already weighted); then plus
    add[s, row0 + row] when given (`_addend`)."""
    t, pairs_per_row = ids.shape
    d = out.shape[-1]
    shards = y.numel() // (t * pairs_per_row * d) if t else 0
    block = 1024
    if t:
        _combine_kernel[(t, triton.cdiv(d, block), shards)](
            y, ids, y if weights is None else weights, _addend(add, out), out, num_experts, d, t, out.shape[1], row0,
            PAIRS_PER_ROW=pairs_per_row, BLOCK=block, WEIGHTED=weights is not None,
            ROUNDED_MUL=not hadamard.INTERPRETED, ADD=add is not None, **pdl.options())


def _addend(add: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """What a combine adds after the experts' sum (the shared expert's partial when it runs apart, model/ffn.py),
    laid out as `out`; `out` itself as the unread pointer when there is none."""
    if add is None:
        return out
    if add.shape != out.shape or add.dtype != out.dtype or not add.is_contiguous():
        raise ValueError(f"the addend must be laid out as the output: {list(add.shape)} {add.dtype}, "
                         f"{list(out.shape)} {out.dtype} contiguous")
    return add


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["n_pairs", "out_rows", "row0"])
def _combine_rotated_kernel(acc_ptr, svh_ptr, vec_ptr, weight_ptr, row_of_pair_ptr, ids_ptr, add_ptr, out_ptr,
                            num_experts, D, n_pairs, out_rows, row0, scale, PAIRS_PER_ROW: tl.constexpr,
                            ROUNDED_MUL: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr = False):
    """`_combine_kernel` over EXL3 down products still in their rotated basis: each pair's output is rotated out
    here (`hadamard.rotate_out`'s arithmetic: had(acc) * svh * scale, times the routing weight) as it is added, in
    the same pair order, so the rotated rows are never stored; ADD as there. One 128-column block of one row per
    program."""
    wait_for_inputs(PDL)
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
    at = (shard.to(tl.int64) * out_rows + row0 + row) * D + cols[None, :]
    if ADD:
        total += tl.load(add_ptr + at)
    tl.store(out_ptr + at, total)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, s_ptr, out_ptr, pair_ptr, expert_ptr, num_experts, N, K,
                    swe, swn, swk, sse, ssn, ssk,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    IEEE: tl.constexpr, FMT: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[slot] = a[slot] @ w[expert of the slot's tile]^T in fp32, a [slots, K] already per slot (0 for empty
    slots; unused tiles are not written)."""
    wait_for_inputs(PDL)
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
        num_stages=tile.stages, **pdl.options())
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
                  down: WeightArgs, limit: float, tile: MoeTile, shards: int, out: torch.Tensor, row0: int,
                  built: Grouping | None = None, add: torch.Tensor | None = None) -> None:
    """EXL3 expert stacks, every local shard in one launch per step: per (shard, slot) row, rotate in (its token's
    row, its shard's expert's suh), grouped GEMM over the trellis tiles, rotate out (that expert's svh); gate and up
    then SwiGLU, down then the routing weight, by pair; into out[:, row0 : row0 + T].

    The stacks hold the shards' experts one block after another ([shards * (E+1), ...]: gate / up with the shard's
    I_local outputs, down with its I_local inputs). Shard s's rows are a copy of the slot grid whose tiles read
    expert block s * (E+1) + e, so each row's arithmetic is the one-shard launch's: the tiles and the grouping are
    the same for every shard. Launches: grouping, its tables (both in the routing's launch when `built` has them),
    gate and up rotated in together, their products (one CUDA launch for both), their rotations out with the SwiGLU
    and down's rotation in, down's product, and the combine with down's rotation out."""
    t, d = x.shape
    n_exp = gate.data.shape[0] // shards
    if built is not None and built.slots is not None:
        tables = built.slots
    else:
        tables = slot_tables(group_pairs(ids, n_exp, tile.block_m), weights, n_exp, shards)
    # row (s, slot): SwiGLU of shard s's I_local columns of its slot, rotated in for down, in one launch. (Every
    # big temporary dies with the call that made it: at a prompt chunk each is gigabytes, and the largest moment of
    # a prompt chunk sizes the KV pool.)
    h = hadamard.rotate_out_swiglu(*_gate_up_exl3(x, gate, up, tables, tile), gate.svh, up.svh, tables.vec, limit,
                                   x.dtype, next_suh=down.suh)
    acc = _grouped(h, down, tables.grouped, tile)
    # One warp a 128-column block: the Hadamard butterflies' exchanges stay in the warp (bench.ptx_stats, sm_90: 53
    # bar.sync with the default 4 warps, none with 1). The arithmetic is elementwise, so the bits are the same.
    _combine_rotated_kernel[(t, d // hadamard.HAD, shards)](
        acc, down.svh, tables.vec, tables.weight, tables.row_of_pair, ids, _addend(add, out), out, n_exp, d,
        ids.numel(), out.shape[1], row0, hadamard.OUT_SCALE, PAIRS_PER_ROW=ids.shape[1],
        ROUNDED_MUL=not hadamard.INTERPRETED, ADD=add is not None, num_warps=1, **pdl.options())


def _experts_one_class(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: WeightArgs,
                       up: WeightArgs, down: WeightArgs, limit: float, tile: MoeTile, shards: int,
                       out: torch.Tensor, row0: int, built: Grouping | None = None,
                       add: torch.Tensor | None = None) -> None:
    """One row class's rows (out[:, row0 : row0 + T]); `built`: their grouping from the routing's launch; `add`:
    what `combine` adds after the experts' sum."""
    t, d = x.shape
    n_exp, i_dim = gate.data.shape[0], gate.n
    pairs_per_row = ids.shape[1]
    for w in (gate, down):
        if w.max_block_k() % tile.block_k:
            raise ValueError(f"a {tile.block_k}-wide K step straddles the experts' {w.max_block_k()}-wide groups")
    groups = built.groups if built is not None else group_pairs(ids, n_exp, tile.block_m)
    h = torch.empty(groups.blocks * tile.block_m, i_dim, dtype=x.dtype, device=x.device)
    gs, us = gate.strides(), up.strides()
    if gs != us or gate.fmt != up.fmt:
        raise ValueError("gate and up experts must share one storage layout")
    _gate_up_kernel[(groups.blocks * triton.cdiv(i_dim, tile.block_n),)](
        x, gate.data, gate.scale, up.data, up.scale, h, groups.pair_of_slot, groups.expert_of_block, n_exp, i_dim, d,
        float(limit), *gs, PAIRS_PER_ROW=pairs_per_row, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, GROUP_M=tile.group_m, FMT=int(gate.fmt), SB_N=gate.block_n, SB_K=gate.block_k,
        num_warps=tile.warps, num_stages=tile.stages, **pdl.options())
    n_pairs = t * pairs_per_row
    y = torch.empty(shards, n_pairs, d, dtype=torch.float32, device=x.device)
    _down_kernel[(groups.blocks * triton.cdiv(d, tile.block_n), shards)](
        h, down.data, down.scale, y, groups.pair_of_slot, groups.expert_of_block, weights, n_exp, i_dim // shards, d,
        n_pairs, *down.strides(), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, FMT=int(down.fmt), SB_N=down.block_n, SB_K=down.block_k, num_warps=tile.warps,
        num_stages=tile.stages, **pdl.options())
    combine(y, ids, out, n_exp, row0, add=add)


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
            decode_rows: int, shards: int = 1, grouping: Grouping | None = None, add: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Grouped experts: x [T, D]; ids, weights [T, P] from `route` (P = k + 1 pairs per row, or k); gate, up
    [E+1, I, D]; down [shards * (E+1), D, I / shards] (the shared expert last in each shard's block; dense, or
    quantized stacks as WeightArgs) -> [shards, T, D] fp32: each virtual shard's partial of the routed + shared
    outputs. The shards' slices of I lie side by side in gate / up (one launch computes all of them); shard s's
    partial reads its own I columns and down block. EXL3 stacks instead hold each shard's experts one block after
    another in all three ([shards * (E+1), ...]; each expert's Hadamard vectors are its own). Every element is
    computed as a one-shard call on that shard's weights would compute it: the tiles are fixed per row class, never
    by how many shards share the launch. Rows [0, decode_rows) are decode-class and the rest prompt rows; each class
    is grouped and run with its own fixed schedule. Integer experts prepared for humming-kernels come as one
    `IntExperts` in `gate` (up and down None; kernels/gpu/int_moe.py). grouping: what `route` was given, and built
    when the step was decode-sized (then the decode rows are not grouped again). add: [shards, T, D] fp32 added to
    each row after its experts' sum, in the combine's launch (the shared expert's partial when it runs apart: the
    bits of adding it afterwards, one launch fewer)."""
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    t = x.shape[0]
    split = min(max(decode_rows, 0), t)
    classes = [(rows, part) for rows, part in ((RowClass.DECODE, slice(0, split)), (RowClass.PREFILL, slice(split, t)))
               if part.stop > part.start]
    built = grouping if grouping is not None and grouping.groups is not None and split == t else None
    if isinstance(gate, IntExperts):
        out = torch.empty(gate.shards, t, x.shape[1], dtype=torch.float32, device=x.device)
        for rows, part in classes:
            fits = built is not None and built.block_m == int_moe.tile(rows, gpu_arch.row(x.device)).block_m
            int_moe.experts(x[part], ids[part], weights[part], gate, limit, rows, out, part.start,
                            tab=built.int_tables if fits else None, add=add)
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
        tile = _tile(rows, x, gate)
        one_class(x[part], ids[part], weights[part], gate, up, down, limit, tile, shards, out, part.start,
                  built if built is not None and built.block_m == tile.block_m else None, add)
    return out
