"""The integer experts' row tables (kernels/gpu/int_moe.py `tables`) against a torch construction, in
Triton's interpreter on the CPU and on a GPU; and the portable INT weight tile (kernels/gpu/wtiles.py `int_tile`)
through the grouped MoE kernels against the dense kernels on the twin's dequantized stacks. The humming-kernels
products themselves need a GPU: tests/gpu/test_int_moe.py."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, HALF_TOL, randn

from kernels.gpu import int_moe  # noqa: E402  (after the importorskip in gpu_support)
from kernels.gpu.moe_groups import group_pairs  # noqa: E402


def expected_tables(pair_of_slot: torch.Tensor, expert_of_block: torch.Tensor, block_m: int, n_pairs: int,
                    experts: int, shards: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The tables written out by hand: gate|up's slots with n_pairs for "no row"; down's = the used blocks of the
    one-shard grid, copied per shard with the shard's pair rows and expert block, one copy after another."""
    used = int((expert_of_block < experts).sum())
    gate_up = [p if p >= 0 else n_pairs for p in pair_of_slot.tolist()]
    slots, blocks = [], []
    for s in range(shards):
        slots += [p + s * n_pairs if p >= 0 else shards * n_pairs for p in pair_of_slot[: used * block_m].tolist()]
        blocks += [e + s * experts for e in expert_of_block[:used].tolist()]
    return gate_up, slots, blocks, [used * block_m, shards * used * block_m]


@pytest.mark.parametrize("rows,pairs,block_m,shards", [(1, 9, 8, 4), (7, 9, 8, 4), (40, 3, 16, 2), (3, 9, 8, 1)])
def test_tables_copy_the_grid_per_shard(rows: int, pairs: int, block_m: int, shards: int) -> None:
    experts = 12
    g = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(experts, generator=g)[:pairs] for _ in range(rows)]).sort(1).values
    ids[-1, -1] = experts  # a pair with no expert (a padding row's): in no block
    ids = ids.to(torch.int32).to(DEVICE)
    groups = group_pairs(ids, experts, block_m)
    tab = int_moe.tables(groups, ids.numel(), experts, shards)
    gate_up, slots, blocks, padded = expected_tables(groups.pair_of_slot.cpu(), groups.expert_of_block.cpu(),
                                                     block_m, ids.numel(), experts, shards)
    assert tab.padded.tolist() == padded
    assert tab.gate_up_rows.tolist() == gate_up
    assert torch.equal(tab.gate_up_experts, groups.expert_of_block)
    assert tab.down_rows[: len(slots)].tolist() == slots
    assert tab.down_experts[: len(blocks)].tolist() == blocks


def test_tables_of_an_empty_grid() -> None:
    """Only padding rows: no block is used, humming reads no rows (padded 0)."""
    ids = torch.full((3, 9), 12, dtype=torch.int32, device=DEVICE)
    tab = int_moe.tables(group_pairs(ids, 12, 8), ids.numel(), 12, 4)
    assert tab.padded.tolist() == [0, 0]


QE, QD, QI = 5, 256, 128  # 4 routed experts + the shared one, as tests/kernels/test_gpu_moe.py's quantized stacks


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("rows", [1 << 30, 0], ids=["decode", "prefill"])
def test_int_experts_match_their_dequantized_twin(bits: int, rows: int) -> None:
    """The Triton grouped kernels over INT stacks (wtiles' portable tile: each element decoded from its row's bit
    stream, times its own group's scale) against the same kernels over the twin's dequantized stacks."""
    from kernels.gpu import wtiles
    from kernels.quant import intn
    from tests.kernels.test_gpu_moe import quantized_moe
    quant, deq = [], []
    for j, shape in enumerate(((QI, QD), (QI, QD), (QD, QI))):
        stack = [intn.quantize(randn(*shape, seed=40 + 10 * j + e, scale=0.05).float().cpu(), bits, 32)
                 for e in range(QE)]
        t = {n: torch.stack([s[n] for s in stack]).to(DEVICE) for n in ("weight_packed", "weight_scale")}
        quant.append(wtiles.quantized("int", t, {"bits": bits, "group": 32}))
        deq.append(torch.stack([intn.CODEC.dequantize(s, shape, {"bits": bits, "group": 32}) for s in stack])
                   .to(randn(1).dtype).to(DEVICE))
    x = randn(24, QD, seed=34)
    got, want = quantized_moe(x, quant, rows), quantized_moe(x, deq, rows)
    torch.testing.assert_close(got, want, **HALF_TOL)
    if DEVICE == "cpu":  # the interpreter: the same arithmetic over the same tiles
        assert torch.equal(got, want)
