"""The MoE grouping's two ways (kernels/gpu/moe_groups.py) build the same tables: the one-program kernel of decode
steps and torch's sorts and scans, on routings with absent pairs (padding rows), hot and cold experts."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, triton  # noqa: F401  (skips without Triton)

from kernels.gpu import moe_groups  # noqa: E402


def routing(rows: int, pairs_per_row: int, experts: int, absent: int, seed: int) -> torch.Tensor:
    """ids [rows, pairs_per_row] int32 as `route` writes them: distinct ascending routed experts, the shared expert
    (experts - 1) last, and `absent` padding rows whose ids are past every expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:pairs_per_row - 1].sort().values
                       for _ in range(rows)])
    ids = torch.cat([ids, torch.full((rows, 1), experts - 1)], dim=1)
    ids[rows - absent:] = experts + 1
    return ids.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("rows,pairs_per_row,experts,absent,block_m", [
    (1, 9, 289, 0, 16), (8, 9, 289, 2, 16), (40, 3, 7, 5, 16), (64, 9, 289, 0, 16), (5, 4, 12, 0, 128)])
def test_the_fused_grouping_equals_torchs(rows: int, pairs_per_row: int, experts: int, absent: int,
                                          block_m: int) -> None:
    ids = routing(rows, pairs_per_row, experts, absent, seed=rows * 31 + experts)
    pairs = ids.numel()
    blocks = triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m)
    fused = moe_groups._group_fused(ids, experts, block_m, blocks)
    reference = moe_groups._group_torch(ids, experts, block_m, blocks)
    assert torch.equal(fused.pair_of_slot.cpu(), reference.pair_of_slot.cpu())
    assert torch.equal(fused.expert_of_block.cpu(), reference.expert_of_block.cpu())
    # and the tables mean what they say: every real pair once, in its expert's tiles
    slots = fused.pair_of_slot.cpu()
    real = slots[slots >= 0]
    flat = ids.reshape(-1).cpu()
    assert sorted(real.tolist()) == [p for p in range(pairs) if flat[p] < experts]
    tile_expert = fused.expert_of_block.cpu().repeat_interleave(block_m)
    assert torch.equal(tile_expert[slots >= 0], flat[real.long()])


def test_group_pairs_takes_the_fused_way_up_to_its_limit(monkeypatch) -> None:
    ids = routing(4, 3, 9, 0, seed=3)
    taken = []
    monkeypatch.setattr(moe_groups, "_group_fused", lambda *a: taken.append("fused"))
    monkeypatch.setattr(moe_groups, "_group_torch", lambda *a: taken.append("torch"))
    moe_groups.group_pairs(ids, 9, 16)
    monkeypatch.setattr(moe_groups, "FUSED_PAIRS", ids.numel() - 1)
    moe_groups.group_pairs(ids, 9, 16)
    assert taken == ["fused", "torch"]


def test_slot_tables_follow_the_grouping() -> None:
    """Each (shard, slot) row's token, expert vector row and weight, each pair's row, and each shard's tiles
    reading its own expert block — as the grouping's tables say, recomputed here with plain indexing."""
    rows, per_row, experts, shards, block_m = 6, 4, 11, 3, 16
    ids = routing(rows, per_row, experts, absent=1, seed=5)
    weights = torch.rand(rows, per_row, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    groups = moe_groups.group_pairs(ids, experts, block_m)
    t = moe_groups.slot_tables(groups, weights, experts, shards)
    pair, blk = groups.pair_of_slot.cpu().long(), groups.expert_of_block.cpu().long()
    cap, n_pairs = pair.numel(), ids.numel()
    for s in range(shards):
        lo = s * cap
        has = pair >= 0
        expert = blk[torch.arange(cap) // block_m]
        assert torch.equal(t.grouped.pair_of_slot[lo : lo + cap].cpu(), pair.int())
        assert torch.equal(t.token[lo : lo + cap].cpu(), torch.where(has, pair // per_row, -1).int())
        assert torch.equal(t.vec[lo : lo + cap].cpu(),
                           torch.where(expert < experts, expert + s * experts, shards * experts).int())
        rows_of_pairs = t.row_of_pair[s * n_pairs : (s + 1) * n_pairs].cpu()
        assert torch.equal(rows_of_pairs[pair[has]], (lo + torch.arange(cap)[has]).int())
        assert torch.equal(t.weight[lo : lo + cap].cpu(),
                           torch.where(has, weights.reshape(-1).cpu()[pair.clamp(min=0)], 0.0))
        tiles = t.grouped.expert_of_block[s * groups.blocks : (s + 1) * groups.blocks].cpu()
        assert torch.equal(tiles, torch.where(blk < experts, blk + s * experts, shards * experts).int())
    assert t.grouped.blocks == shards * groups.blocks
