"""Grouping a MoE step's (row, expert) pairs into expert tiles of `block_m` slots: the tables the grouped kernels
read (kernels/gpu/moe.py). The number of tiles is an upper bound from the shapes alone (every pair, plus a partly
empty tile for each expert that can be hit), so nothing here syncs with the host.

Two ways to the same tables: one Triton program for decode-sized steps (a handful of pairs: torch's sorts and scans
would be about twenty launches per MoE layer, a real part of a one-row step), torch's for prompt-sized ones.
`tests/kernels/test_gpu_moe_groups.py` checks they agree. A decode step of the model has its grouping built by
the routing's own launch instead (kernels/gpu/moe.py `route` with a `grouping`: the same tables, checked in
`tests/kernels/test_gpu_moe_route_group.py`); `group_pairs` serves the other steps and direct callers.

`slot_tables` derives, in one more launch, the per-row tables of the EXL3 experts' rotations (kernels/gpu/moe.py):
each slot of each virtual shard's copy of the grid, its token, its expert's vector row and its routing weight, and
each pair's row (a dozen torch index ops otherwise); its body (`slot_rows`) runs in the routing's launch too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gpu import pdl
from kernels.gpu.pdl import wait_for_inputs

FUSED_PAIRS = 4096  # pairs up to which one program groups them (decode steps: rows x (top-k + 1))
_CHUNK = 32  # pairs per step of the program's loops (a [32, experts] one-hot per step)


@dataclass
class Groups:
    """Pairs grouped by expert into tiles of `block_m` slots (device tensors, sized by an upper bound)."""
    pair_of_slot: torch.Tensor  # [blocks * block_m] int32: pair index (row * (k+1) + j) in each slot, -1 = empty
    expert_of_block: torch.Tensor  # [blocks] int32: the tile's expert, num_experts for unused tiles
    blocks: int


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> Groups:
    """Sort (row, slot) pairs by expert (stable: ascending row within an expert) and pad each expert's run to
    whole tiles. num_experts counts the shared expert; ids == num_experts marks a pair that does not exist.
    Up to FUSED_PAIRS pairs (decode-sized batches) in one launch, more with torch's sorts and scans: the same
    tables either way."""
    pairs = ids.numel()
    blocks = tiles(pairs, num_experts, block_m)
    if pairs <= FUSED_PAIRS:
        return _group_fused(ids, num_experts, block_m, blocks)
    return _group_torch(ids, num_experts, block_m, blocks)


def tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """The tiles a grouping of `pairs` pairs has: every pair, plus a partly empty tile for each expert that can be
    hit (an upper bound from the shapes alone)."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def empty_groups(pairs: int, num_experts: int, block_m: int, device: torch.device) -> Groups:
    """A grouping's tables, unset, sized for `pairs` pairs."""
    blocks = tiles(pairs, num_experts, block_m)
    return Groups(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                  torch.empty(blocks, dtype=torch.int32, device=device), blocks)


def _group_torch(ids: torch.Tensor, num_experts: int, block_m: int, blocks: int) -> Groups:
    flat = ids.reshape(-1).long().clamp(max=num_experts)  # every "no pair" id counts as num_experts
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    real = expert < num_experts
    safe = expert.clamp(max=num_experts - 1)
    rank = torch.arange(pairs, device=dev) - start[safe]
    cap = blocks * block_m
    dest = torch.where(real, padded_start[safe] + rank, cap)  # non-pairs land in a dump slot past the end
    pair_of_slot = torch.full((cap + 1,), -1, dtype=torch.int32, device=dev)
    pair_of_slot.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(blocks, device=dev) * block_m
    expert_of_block = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return Groups(pair_of_slot[:cap], expert_of_block, blocks)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["pairs", "cap", "blocks"], do_not_specialize_on_alignment=["ids_ptr"])
def _group_kernel(ids_ptr, pair_ptr, expert_ptr, pairs, num_experts, cap, blocks,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One program: per-expert counts, padded runs, each pair's slot (stable: ascending pair index within an
    expert), each tile's expert; the tables `_group_torch` builds."""
    wait_for_inputs(PDL)
    e = tl.arange(0, E_BLOCK)
    expert_ok = e < num_experts
    counts = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for c0 in range(0, pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        x = tl.minimum(tl.load(ids_ptr + p, mask=p < pairs, other=num_experts), num_experts)
        counts += tl.sum((x[:, None] == e[None, :]).to(tl.int32), axis=0)
    counts = tl.where(expert_ok, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    for s0 in range(0, cap, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(pair_ptr + s, tl.full((CHUNK,), -1, tl.int32), mask=s < cap)
    tl.debug_barrier()  # the empty marks land before any pair's slot is written
    seen = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for c0 in range(0, pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        x = tl.minimum(tl.load(ids_ptr + p, mask=p < pairs, other=num_experts), num_experts)
        onehot = (x[:, None] == e[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, axis=0) - onehot + seen[None, :]  # same-expert pairs before each pair
        slot = tl.sum(onehot * (padded_start[None, :] + earlier), axis=1)
        tl.store(pair_ptr + slot, p.to(tl.int32), mask=(p < pairs) & (x < num_experts))
        seen += tl.sum(onehot, axis=0)
    for b0 in range(0, blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        done = (padded_end[None, :] <= (b * BLOCK_M)[:, None]) & expert_ok[None, :]  # runs ending before the tile
        tl.store(expert_ptr + b, tl.sum(done.to(tl.int32), axis=1), mask=b < blocks)


def _group_fused(ids: torch.Tensor, num_experts: int, block_m: int, blocks: int) -> Groups:
    g = empty_groups(ids.numel(), num_experts, block_m, ids.device)
    _group_kernel[(1,)](ids.reshape(-1).to(torch.int32), g.pair_of_slot, g.expert_of_block, ids.numel(), num_experts,
                        blocks * block_m, blocks, BLOCK_M=block_m, CHUNK=_CHUNK,
                        E_BLOCK=triton.next_power_of_2(num_experts + 1), num_warps=8, **pdl.options())
    return g


@dataclass
class SlotTables:
    """Per (shard, slot) row of `shards` copies of a grouping (row s * cap + slot), int32 unless said: what the
    EXL3 experts' rotations and grouped products read (kernels/gpu/moe.py `_experts_exl3`)."""
    token: torch.Tensor  # the slot's token row, -1 for an empty slot
    vec: torch.Tensor  # the slot's expert in the shards' stacked experts (s * experts + e); shards * experts = none
    weight: torch.Tensor  # float32 routing weight of the slot's pair, 0 for none
    grouped: Groups  # the grid repeated per shard, each copy's tiles reading its own expert block
    row_of_pair: torch.Tensor  # [shards * pairs]: pair p's row of shard s at s * pairs + p (unset: a pair with no
    # expert, which no reader asks for)


@triton.jit
def slot_rows(r, pair_ptr, expert_ptr, rw_ptr, pairs_ptr, block_ptr, token_ptr, vec_ptr, weight_ptr, row_of_pair_ptr,
              cap, blocks, experts, n_pairs, shards, PAIRS_PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr):
    """`SlotTables`' rows `r` (and tiles, for r < shards * blocks) from the grouping's tables: the body of
    `_slot_tables_kernel`, and of the routing launch that builds them itself (kernels/gpu/moe.py)."""
    rows = r < shards * cap
    shard = r // cap
    slot = r % cap
    pair = tl.load(pair_ptr + slot, mask=rows, other=-1)
    expert = tl.load(expert_ptr + slot // BLOCK_M, mask=rows, other=experts)
    has = pair >= 0
    tl.store(pairs_ptr + r, pair, mask=rows)
    tl.store(token_ptr + r, tl.where(has, pair // PAIRS_PER_ROW, -1), mask=rows)
    tl.store(vec_ptr + r, tl.where(expert < experts, expert + shard * experts, shards * experts), mask=rows)
    tl.store(row_of_pair_ptr + tl.where(has, pair + shard * n_pairs, 0), r, mask=rows & has)
    tl.store(weight_ptr + r, tl.load(rw_ptr + pair, mask=rows & has, other=0.0), mask=rows)
    tiles = r < shards * blocks  # the tiles' table: tile s * blocks + b reads expert block s * experts + e
    e = tl.load(expert_ptr + r % blocks, mask=tiles, other=experts)
    tl.store(block_ptr + r, tl.where(e < experts, e + (r // blocks) * experts, shards * experts), mask=tiles)


# Counts that change from round to round are not specialised on: one build whatever they are (docs/gpu-engine.md).
@triton.jit(do_not_specialize=["cap", "blocks", "n_pairs"])
def _slot_tables_kernel(pair_ptr, expert_ptr, rw_ptr, pairs_ptr, block_ptr, token_ptr, vec_ptr, weight_ptr,
                        row_of_pair_ptr, cap, blocks, experts, n_pairs, shards,
                        PAIRS_PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    slot_rows(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), pair_ptr, expert_ptr, rw_ptr, pairs_ptr, block_ptr,
              token_ptr, vec_ptr, weight_ptr, row_of_pair_ptr, cap, blocks, experts, n_pairs, shards, PAIRS_PER_ROW,
              BLOCK_M)


def slot_tables(groups: Groups, weights: torch.Tensor, experts: int, shards: int) -> SlotTables:
    """The rotations' tables for `shards` copies of `groups` (made for ids of weights' shape [T, P]: pair p =
    row * P + j) over stacks of `experts` experts per shard."""
    cap = groups.pair_of_slot.shape[0]
    t = empty_slot_tables(groups, weights.numel(), shards)
    block_rows = 1024
    _slot_tables_kernel[(triton.cdiv(shards * cap, block_rows),)](
        groups.pair_of_slot, groups.expert_of_block, weights.reshape(-1).float(), t.grouped.pair_of_slot,
        t.grouped.expert_of_block, t.token, t.vec, t.weight, t.row_of_pair, cap, groups.blocks, experts,
        weights.numel(), shards, PAIRS_PER_ROW=weights.shape[1], BLOCK_M=cap // groups.blocks, BLOCK=block_rows,
        **pdl.options())
    return t


def empty_slot_tables(groups: Groups, n_pairs: int, shards: int) -> SlotTables:
    """`SlotTables`' tensors, unset, for `shards` copies of `groups` (of n_pairs pairs)."""
    rows = shards * groups.pair_of_slot.shape[0]
    dev = groups.pair_of_slot.device

    def table(dtype: torch.dtype = torch.int32, n: int = rows) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=dev)

    pairs, block, token, vec, weight = table(), table(n=shards * groups.blocks), table(), table(), table(torch.float32)
    return SlotTables(token, vec, weight, Groups(pairs, block, groups.blocks * shards), table(n=shards * n_pairs))
