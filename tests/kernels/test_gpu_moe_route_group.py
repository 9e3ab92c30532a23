"""The routing launch that also groups (kernels/gpu/moe.py `route` with a `grouping`): its ids and weights are
`route`'s alone, bit for bit, and its tables are exactly those of moe_groups.group_pairs and of the expert format's
tables (moe_groups.slot_tables for EXL3 experts, int_moe.tables for integer ones) built from them; a row's ids and
weight bits are the same alone and among others; the experts give the same bits from either tables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.gpu_support import DEVICE, randn, triton  # noqa: F401  (skips without Triton)

from kernels.gpu import arch as gpu_arch, gemm, int_moe, moe, moe_groups, wtiles  # noqa: E402
from kernels.gpu.gemm import RowClass  # noqa: E402

E, TOP_K = 288, 8  # the release's router: 288 routed experts, top-8, + the shared one


def logits_of(rows: int, experts: int, seed: int, ties: bool) -> torch.Tensor:
    """fp32 router logits; with `ties`, on a coarse grid, so rows hold equal scores across the top-k's edge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, experts, generator=g) * 2
    if ties:
        x = (x * 2).round() / 2
    return x.to(DEVICE)


def bias_of(experts: int, seed: int, ties: bool) -> torch.Tensor:
    if ties:
        return torch.zeros(experts, device=DEVICE)
    return (torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.1).to(DEVICE)


def route(logits: torch.Tensor, bias: torch.Tensor, n_real: int, shared: bool, grouping=None):
    return moe.route(logits, bias, top_k=TOP_K, norm_topk_prob=True, scaling=2.5, n_real=n_real, shared=shared,
                     grouping=grouping)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int32), b.cpu().view(torch.int32))


def assert_the_launch_is_route_then_grouping_then_tables(logits: torch.Tensor, bias: torch.Tensor, n_real: int,
                                                        shared: bool, tables: str, block_m: int, shards: int) -> None:
    experts = logits.shape[1] + int(shared)
    g = moe.Grouping(experts, block_m, shards, tables)
    ids, w = route(logits, bias, n_real, shared, g)
    want_ids, want_w = route(logits, bias, n_real, shared)
    assert torch.equal(ids, want_ids) and same_bits(w, want_w)
    want = moe_groups.group_pairs(want_ids, experts, block_m)
    assert g.groups is not None and g.groups.blocks == want.blocks
    assert torch.equal(g.groups.pair_of_slot, want.pair_of_slot)
    assert torch.equal(g.groups.expert_of_block, want.expert_of_block)
    if tables == "int":
        tab = int_moe.tables(want, want_ids.numel(), experts, shards)
        for name in ("gate_up_rows", "gate_up_experts", "down_rows", "down_experts", "padded"):
            assert torch.equal(getattr(g.int_tables, name), getattr(tab, name)), name
    elif tables == "slots":
        s = moe_groups.slot_tables(want, want_w, experts, shards)
        for name in ("token", "vec", "weight"):
            assert same_bits(getattr(g.slots, name), getattr(s, name)), name
        assert torch.equal(g.slots.grouped.pair_of_slot, s.grouped.pair_of_slot)
        assert torch.equal(g.slots.grouped.expert_of_block, s.grouped.expert_of_block)
        assert g.slots.grouped.blocks == s.grouped.blocks
        real = (want_ids.reshape(-1) < experts).repeat(shards)  # a pair with no expert has no row (never read)
        assert torch.equal(g.slots.row_of_pair[real], s.row_of_pair[real])
    else:
        assert g.slots is None and g.int_tables is None


_TABLES = [("", 16, 1), ("slots", 16, 2), ("slots", 16, 4), ("int", 8, 4), ("int", 16, 1), ("int", 8, 2)]
# Steps of 1, 7 and 64 rows cross every table layout with and without the shared expert; the 200-row step (several
# row blocks, ~12 s a case in the interpreter) runs each layout once, with and without the shared expert in turn.
_CASES = [(rows, n_real, shared, *t) for rows, n_real in ((1, 1), (7, 5), (64, 64)) for shared in (True, False)
          for t in _TABLES] + [(200, 171, i % 2 == 0, *t) for i, t in enumerate(_TABLES)]


@pytest.mark.parametrize("rows,n_real,shared,tables,block_m,shards", [
    pytest.param(*case, id=f"{case[3]}-{case[4]}-{case[5]}-{'shared' if case[2] else 'no-shared'}-{case[0]}-{case[1]}")
    for case in _CASES])
def test_the_launch_equals_route_then_grouping_then_tables(rows: int, n_real: int, shared: bool, tables: str,
                                                            block_m: int, shards: int) -> None:
    ties = rows % 2 == 1
    logits, bias = logits_of(rows, E, seed=rows, ties=ties), bias_of(E, seed=rows + 1, ties=ties)
    assert_the_launch_is_route_then_grouping_then_tables(logits, bias, n_real, shared, tables, block_m, shards)


@pytest.mark.parametrize("tables,block_m,shards", [("int", 8, 4), ("slots", 16, 2), ("", 16, 1)])
def test_scores_at_the_edges_pick_as_the_float_top_k(tables: str, block_m: int, shards: int) -> None:
    """The launch's top-k orders integer keys of the scores' bits: NaN passed over as tl.max passes it, +-inf,
    saturated sigmoids (a row of ties), -0.0 biases, tiny and huge logits give `route`'s own picks and tables."""
    logits = logits_of(12, E, seed=20, ties=False).cpu()
    logits[0, 5] = float("nan")
    logits[1, ::7] = float("nan")
    logits[2, 100:] = float("inf")
    logits[3, :] = 40.0  # every sigmoid 1.0: the lowest indices win
    logits[4, :200] = float("-inf")
    logits[5, 3::9] = -1e30
    logits[6, :] = 0.0
    logits[7, 1::2] = 1e-40  # subnormal logits
    bias = bias_of(E, seed=21, ties=False).cpu()
    bias[::5] = -0.0
    bias[7] = float("-inf")
    assert_the_launch_is_route_then_grouping_then_tables(logits.to(DEVICE), bias.to(DEVICE), 10, True, tables,
                                                         block_m, shards)


@pytest.mark.parametrize("tables,shards", [("int", 4), ("int", 1), ("slots", 2), ("", 1)])
def test_a_step_with_no_real_row_has_no_pairs(tables: str, shards: int) -> None:
    """Every row padding (n_real 0): no pair, no used tile, and the tables' empty marks as the grouping's own."""
    logits, bias = logits_of(3, E, seed=22, ties=False), bias_of(E, seed=23, ties=False)
    assert_the_launch_is_route_then_grouping_then_tables(logits, bias, 0, True, tables, 8, shards)


def test_the_launch_compiles_to_one_layout() -> None:
    """Compiled for sm_90 at the release's shapes (bench.ptx_stats, in a process of its own: the suite runs the
    interpreter): every tile keeps one layout, so the barriers are the block's rank scan and count and the placing's
    own (a tile crossing to another layout costs a barrier or two each, dozens in all), and nothing spills."""
    sig = ("logits_ptr=*fp32,bias_ptr=*fp32,ids_ptr=*i32,w_ptr=*fp32,n_real_ptr=*i32,scratch_ptr=*i32,pair_ptr=*i32,"
           "expert_ptr=*i32,gu_ptr=*i32,dn_ptr=*i32,block_ptr=*i32,padded_ptr=*i32,T=i32,E=i32,stride_e=i32,"
           "scaling=fp32,cap=i32,blocks=i32,shards=i32")
    consts = f"TOP_K={TOP_K},NORM=True,BLOCK_E=512,SHARED=1,KP=8,ROWS={moe._ROUTE_ROWS},BLOCK_M=8,CHUNK=1024"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.ptx_stats", "kernels.gpu.moe:_route_group_int_kernel",
                          "--signature", sig, "--constexprs", consts, "--num-warps", str(moe._ROUTE_WARPS),
                          "--divisible", "E", "--unaligned", "scratch_ptr"], cwd=Path(__file__).resolve().parents[2],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", out.stdout.split(":", 2)[-1])}
    assert got["bar_sync"] <= 8 and got["spill_bytes"] == 0, got


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_the_routing_is_the_reference_top_k(ties: bool) -> None:
    """Ties go to the lowest index, the routed experts ascend, the shared one is last, padding rows have no pairs;
    the weights are the normalised scores within fp32 rounding (the sum's order is the kernel's own)."""
    rows, n_real = 40, 33
    logits, bias = logits_of(rows, E, seed=5, ties=ties), bias_of(E, seed=6, ties=ties)
    g = moe.Grouping(E + 1, 16, 1, "")
    ids, w = route(logits, bias, n_real, True, g)
    lc, bc = logits.cpu(), bias.cpu()
    score = lc.sigmoid()
    key = score + bc  # stable sort descending: equal keys keep ascending index order
    chosen = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :TOP_K].sort(dim=1).values
    assert torch.equal(ids[:n_real, :TOP_K].cpu().long(), chosen[:n_real])
    picked = score.gather(1, chosen)
    want = picked / (picked.sum(1, keepdim=True) + 1e-20) * 2.5
    torch.testing.assert_close(w[:n_real, :TOP_K].cpu(), want[:n_real], rtol=2e-6, atol=0)
    assert torch.all(ids[:n_real, TOP_K].cpu() == E) and torch.all(w[:n_real, TOP_K].cpu() == 1.0)
    assert torch.all(ids[n_real:].cpu() == E + 1) and torch.all(w[n_real:].cpu() == 0)


def test_a_row_alone_is_the_row_among_others() -> None:
    """A row's ids and weight bits from the launch, alone, are its bits at any place among 1 .. 199 others (and
    `route`'s without the grouping)."""
    crowd, bias = logits_of(200, E, seed=7, ties=False), bias_of(E, seed=8, ties=False)
    row = crowd[123:124]
    alone = route(row, bias, 1, True, moe.Grouping(E + 1, 8, 4, "int"))
    plain = route(row, bias, 1, True)
    assert torch.equal(alone[0], plain[0]) and same_bits(alone[1], plain[1])
    for m in (2, 7, 17, 64, 200):
        batch = crowd[:m] if m > 123 else torch.cat([crowd[:m - 1], row])
        at = 123 if m > 123 else m - 1
        ids, w = route(batch, bias, m, True, moe.Grouping(E + 1, 8, 4, "int"))
        assert torch.equal(ids[at], alone[0][0]) and same_bits(w[at], alone[1][0]), f"row changed beside {m - 1}"


def test_route_builds_the_grouping_only_for_what_it_covers(monkeypatch) -> None:
    logits, bias = logits_of(10, E, seed=9, ties=False), bias_of(E, seed=10, ties=False)
    other = moe.Grouping(E + 2, 16, 1, "")  # stacks of another expert count: not these ids' grouping
    route(logits, bias, 10, True, other)
    assert other.groups is None
    monkeypatch.setattr(moe, "FUSED_PAIRS", 10 * (TOP_K + 1) - 1)  # a prompt-sized step
    big = moe.Grouping(E + 1, 16, 1, "")
    ids, w = route(logits, bias, 10, True, big)
    assert big.groups is None
    want_ids, want_w = route(logits, bias, 10, True)
    assert torch.equal(ids, want_ids) and same_bits(w, want_w)


def test_grouping_follows_the_experts_format_and_row_class() -> None:
    x = torch.zeros(6, 64, device=DEVICE)
    dense = torch.zeros(E + 1, 32, 64, device=DEVICE)
    assert moe.grouping(x, dense, 5) is None  # a prompt row among them: grouped per class by `experts`
    g = moe.grouping(x, dense, 6)
    assert (g.experts, g.block_m, g.shards, g.tables) == (E + 1, 16, 1, "")
    for arch in gpu_arch.ROWS:
        with gpu_arch.assume(arch):
            ie = int_moe.IntExperts(int_moe.Stack("", dense, dense, 64, 64, E + 1), None, 4)
            g = moe.grouping(x, ie, 1 << 30)
            want = int_moe.tile(RowClass.DECODE, arch).block_m
            assert (g.experts, g.block_m, g.shards, g.tables) == (E + 1, want, 4, "int")


# ----- the experts read the launch's tables: the same bits as from their own grouping -----

DE, DD, DI, LIMIT = 8, 64, 32, 10.0


def experts_pair(x: torch.Tensor, stacks: tuple, experts: int, shards: int, n_real: int) -> tuple:
    """(with the launch's grouping, with the experts' own) for a decode step."""
    logits = gemm.matmul(x, randn(experts - 1, x.shape[1], seed=40, scale=0.3), 1 << 30, torch.float32)
    bias = torch.zeros(experts - 1, device=DEVICE)
    g = moe.grouping(x, stacks[0], 1 << 30, shards)
    outs = []
    for grouping in (g, None):
        ids, w = moe.route(logits, bias, top_k=2, norm_topk_prob=True, scaling=1.5, n_real=n_real,
                           grouping=grouping)
        outs.append(moe.experts(x, ids, w, *stacks, LIMIT, 1 << 30, shards=shards, grouping=grouping))
    assert g.groups is not None
    return outs[0], outs[1]


@pytest.mark.parametrize("rows,n_real", [(1, 1), (9, 6)])
def test_dense_experts_give_the_same_bits_from_the_launchs_grouping(rows: int, n_real: int) -> None:
    stacks = (randn(DE + 1, DI, DD, seed=41, scale=0.2), randn(DE + 1, DI, DD, seed=42, scale=0.2),
              randn(2 * (DE + 1), DD, DI // 2, seed=43, scale=0.2))
    x = randn(rows, DD, seed=44)
    fused, own = experts_pair(x, stacks, DE + 1, 2, n_real)
    assert torch.equal(fused, own)


def test_exl3_experts_give_the_same_bits_from_the_launchs_tables() -> None:
    from kernels.quant import random_quantized
    g = torch.Generator().manual_seed(45)
    e, d, i, shards = 4, 128, 128, 2
    stacks = tuple(wtiles.stack_quantized([random_quantized("exl3", o, k, std=0.08, bits=3, codebook="mcg",
                                                            generator=g).to(DEVICE) for _ in range(shards * (e + 1))])
                   for o, k in ((i, d), (i, d), (d, i)))
    x = randn(5, d, seed=46)
    fused, own = experts_pair(x, stacks, e + 1, shards, 4)
    assert torch.equal(fused, own)
